// weft::ep kernels: parameter structs and launchers (internal). Kernels take raw pointers, one
// params struct (which also holds the call's grid) and a stream; nothing here knows Buffer or
// NCCL: a rank reaches its peers only through CommParams::peers. The kernels live in this folder,
// one file per family; protocol.cuh holds what they share.
#pragma once

#include <cuda_runtime_api.h>
#include "weft/cuda/nccl_include.hpp"
#include <cstdint>

#include "weft/cuda/device_error.hpp"

namespace weft::ep::detail {

constexpr int kThreads = 1024;      // every EP kernel: 32 warps per block, one block per SM
constexpr int kMaxBlocks = 1024;
constexpr int kMaxRanks = 32;
constexpr int kSubChunkTokens = 256;  // dispatch scatters a block's tokens in pieces of this size
// Up to this many tokens, dispatch counts in local mode (every block counts the tokens before its
// chunk itself, no grid barrier): at most kLocalCountMaxTokens * top_k index loads per block.
constexpr int64_t kLocalCountMaxTokens = 1024;
// The expanded dispatch assigns slots a sub-chunk of this many tokens at a time (its per-item
// shared arrays hold kExpandSubChunkTokens * top_k entries).
constexpr int kExpandSubChunkTokens = 128;

// Device error codes of weft::ep (DeviceErrorRecord::code) and what the args hold. Two kinds,
// recorded apart (CommParams::error and CommParams::fatal) so that neither hides the other:
//  - bad data (error): the call skipped what it could not do and the ranks still agree on the
//    call sequence; the Buffer stays usable.
//  - fatal (fatal): a wait timed out on this rank or on a peer; the ranks no longer agree on the
//    call sequence, and every later kernel of this rank does nothing (DeviceState::broken).
enum ErrorCode : uint32_t {
  kErrBadExpert = 1,        // args: token, selection k, expert id
  kErrTimeout = 2,          // fatal; args: WaitKind, peer rank (or -1), call sequence number
  kErrTooManyRows = 3,      // args: rows received, rows given, 1 if topk_weights (not
                            // expert_out) was the shorter
  kErrExpandOverflow = 4,   // combine of an overflowed expanded dispatch; args: the lowest
                            // overflowed rank, the rows it needed, its capacity
  kErrLayoutMismatch = 5,   // combine / cached dispatch / copy-out of a layout that is not the
                            // one in place; args: the call's layout, the layout in place
  kErrBadSource = 6,        // combine: a received row's source is out of range (the row was not
                            // sent back); args: row, source rank, source token
  kErrPeerRowsMissing = 7,  // combine: a peer's expert_out lacked rows, so it sent none; args:
                            // that peer, call sequence number
  kErrPeerFailed = 8,       // fatal; a peer's call failed (it timed out) and said so in its done
                            // or row flags; args: WaitKind, that peer, call sequence number
  kErrTokensOverflow = 9,   // dispatch (DispatchParams::report_overflow): a rank's T exceeded
                            // max_tokens, so no rank moved a row; args: the lowest rank of the
                            // largest T, that T, max_tokens
  kErrOverflowedLayout = 10,  // combine / cached dispatch of such a dispatch's layout (skipped);
                              // args: as kErrTokensOverflow
  kErrTooManyHeads = 11,      // fixed-stride combine: more rows head a chain than there are
                              // (source, token) pairs (corrupt chains); args: heads, the most
};
// A flag's value is a call number; kFlagFailed is set where its writer failed that call (dispatch
// done flags: the call timed out there; combine row flags: no row was sent), kFlagFatal beside it
// where the writer is broken (a timeout) rather than short of rows. Call numbers never reach them.
constexpr uint64_t kFlagFailed = uint64_t(1) << 63;
constexpr uint64_t kFlagFatal = uint64_t(1) << 62;
constexpr uint64_t kFlagBits = kFlagFailed | kFlagFatal;
enum WaitKind : int64_t {
  kWaitHandshake = 1,
  kWaitCounts = 2,       // dispatch: a peer's count words
  kWaitDispatchDone = 3, // dispatch: a peer's rows
  kWaitCombineEntry = 4, // combine: a peer entering the call (its slots are free)
  kWaitCombineRow = 5,   // combine: a peer's expert output for one of our tokens
  kWaitGridBarrier = 6,  // the blocks of our own kernel
  kWaitCachedEntry = 7,  // cached dispatch: a peer entering the call (its rows are free)
};

// Byte offsets of the regions of the symmetric window; identical on every rank.
//   flags        [kNumFlagKinds][kMaxRanks] uint64: per-source flags carrying call numbers
//   count_matrix [2 (call parity)][R source][R + 1] uint64 tagged words: the source's rows per
//                destination, then its T (the tokens of its call, which may exceed max_tokens)
//   expert_matrix[2][R source][E/R] uint64 tagged words: rows source sends here, per local expert
//   (tagged word = (call number mod 2^32) << 32 | count: valid once its tag is the call's)
//   comb_flags   [R][max_tokens] uint64: call number once rank r's row for token t landed
//   recv_src     [cap][2] int32, recv_expert_idx [cap][top_k] int32, recv_weights [cap][top_k]
//   recv_x       [cap][hidden] bf16, cap = R * max_tokens, or expand_factor * R * max_tokens when
//                that is larger (BufferConfig::expand_factor: the expanded layout's capacity)
//   comb_x       [R][max_tokens][hidden] bf16: rank r's expert output for our token t
//   comb_w       [R][max_tokens][top_k] fp32: rank r's top-k weights for our token t (the first
//                K of each row; combine with topk_weights), published by the comb_flags as comb_x;
//                in a weighted expanded combine its first [T][top_k] hold this rank's own
//                source_weights (copied before the kernel, published by the entry flag)
//   expand_matrix[2 (call parity)][R source][E] uint64 tagged words: the source's rows per expert
//                (expanded dispatch; every rank receives every source's whole histogram)
//   expand_chain [cap] int2 (expanded dispatch): per received row, {the next row of the same
//                (source, token) here or -1, 1 if it is that (source, token)'s first row here}
// The expand regions are empty when expand_factor is 0. Regions start on 256-byte boundaries.
enum FlagKind : int { kFlagHandshake = 0, kFlagDone = 1, kFlagEntry = 2, kNumFlagKinds = 3 };
struct WindowLayout {
  uint64_t flags = 0;
  uint64_t count_matrix = 0;
  uint64_t expert_matrix = 0;
  uint64_t comb_flags = 0;
  uint64_t recv_src = 0;
  uint64_t recv_expert_idx = 0;
  uint64_t recv_weights = 0;
  uint64_t recv_x = 0;
  uint64_t comb_x = 0;
  uint64_t comb_w = 0;
  uint64_t expand_matrix = 0;
  uint64_t expand_chain = 0;
  uint64_t total_bytes = 0;
};
WindowLayout make_window_layout(int num_ranks, int64_t max_tokens, int64_t hidden, int top_k,
                                int num_experts, int expand_factor);

// Per-rank device state outside the window (cudaMalloc'd, zeroed at creation).
struct DeviceState {
  uint64_t sequence;       // number of the last call that completed on this rank
  uint32_t done_counter;   // blocks of the running kernel that finished (last one resets it)
  uint32_t barrier_count;  // grid barrier arrivals
  uint32_t barrier_generation;
  int32_t num_recv;        // rows received by the last dispatch
  // 0, or the largest T of any rank where some rank's T exceeded max_tokens in the last
  // uncached dispatch (which then moved no rows): written with num_recv by every uncached
  // dispatch, read by combine and cached dispatch. Right after num_recv, so that one copy of 8
  // bytes gives the host both (CountMode::kExact).
  int32_t tokens_required;
  int32_t own_begin;       // ... of which [own_begin, own_begin + own_count) came from this rank
  int32_t own_count;
  // Units of work handed out so far in the running kernel (combine's store-back batches:
  // work_claim); the last block resets it.
  uint32_t work_counter;
  // Entries of CombineParams::sparse_heads found so far by the running combine (fixed-stride
  // segments); the last block resets it.
  uint32_t num_sparse_heads;
  // Bit d: a wait for rank d timed out in the running kernel (later waits for d are skipped, so
  // a dead peer costs one timeout per call); the last block resets it.
  uint32_t dead_peers;
  // Non-zero once a fatal error was raised on this rank: every later kernel returns at once.
  uint32_t broken;
  int32_t overflow_rank;   // with tokens_required > 0: the lowest rank whose T it is
  // The uncached dispatch whose layout is in place (its Handle::sequence): what combine and a
  // cached dispatch check their layout against.
  uint64_t layout_id;
  // The rank the last deduplicated combine that stored back rows stored its first row to (the
  // first claimed batch's; -1: it sent no row to a peer): a record of the rotated store-back
  // order (combine.cu send_rows), read only by Buffer::first_store_peer.
  int32_t first_store_peer;
};

// What every kernel needs to talk to its peers.
struct CommParams {
  // [num_ranks] (device memory): the base of rank r's window as this rank addresses it (NCCL's
  // LSA pointers, filled once by launch_peer_table; or any other mapping of R windows, such as R
  // allocations on one device). The only way a kernel reaches another rank.
  char* const* peers;
  WindowLayout layout;
  int rank;
  int num_ranks;
  DeviceState* state;
  cuda::DeviceErrorRecord* error;  // bad data (ErrorCode)
  cuda::DeviceErrorRecord* fatal;  // timeouts: kErrTimeout, kErrPeerFailed
  uint64_t timeout_ns;
};

// A dispatch's rows as the kernels read them: x [num_tokens, row_bytes], bf16 rows or packed fp8
// rows moved as opaque bytes; or, with `scales`, DeepEP's fp8 pair packed on the way into the
// receiver's row (Fp8RowLayout: payload, scales, zero padding up to row_bytes): x = e4m3
// [num_tokens, hidden] (rows hidden bytes apart, 16-byte aligned) and scales fp32
// [num_tokens, hidden / 128] at (scale_token_stride, scale_group_stride) elements, so that
// row-major and column-major scales are read where they are. Or, with cast_fp8 (the expanded
// dispatch only), x = bf16 [num_tokens, hidden] (16-byte aligned rows), each token cast once
// into a packed fp8 row in the sending block's shared memory (cast_fp8_group: the bits of
// reference::cast_to_fp8, with round_scale), which its rows then carry.
struct RowSource {
  const void* x;
  int64_t row_bytes;           // bytes per row at the destination, a multiple of 16 (<= 2 *
                               // hidden: the window's recv_x region holds [cap][row_bytes])
  const float* scales;         // null: rows copied as they are (or cast, with cast_fp8)
  int64_t hidden;              // with scales or cast_fp8: elements per row, a multiple of 128
  int64_t scale_token_stride;
  int64_t scale_group_stride;
  bool cast_fp8;
  bool round_scale;            // with cast_fp8: power-of-two scales
};

// Pinned host memory mapped into the device, which an uncached deduplicated dispatch fills as
// soon as its count exchange ends (before its rows move), so that the host can wait for the
// count there instead of for the whole kernel: int32 words
//   [0, 2) layout id (uint64, DispatchParams::layout_id), stored last, after a system fence
//   [2] num_recv  [3] tokens_required  [4, 4 + num_experts / num_ranks) tokens per local expert
// Not written where the call timed out (the host then finds the kernel ended without it).
constexpr int kPublishedHeaderWords = 4;

struct DispatchParams {
  CommParams comm;
  RowSource x;
  const void* topk_idx;        // [num_tokens, top_k] int32 or int64
  bool topk_idx_int64;
  bool local_count;            // count mode: local (no grid barrier) or grid; see dispatch_kernel
  const float* topk_weights;   // [num_tokens, top_k]
  // May exceed max_tokens (the deduplicated dispatch, up to INT32_MAX): then no rank moves a row
  // (see dispatch_kernel), and nothing [max_tokens]-sized is indexed past max_tokens.
  int64_t num_tokens;
  int64_t max_tokens;
  int top_k;
  int num_experts;
  int num_blocks;              // the grid (<= the device's SMs: all blocks co-resident)
  int32_t* block_counts;       // grid mode: [kMaxBlocks][num_ranks] rows per (block, destination)
  int32_t* expert_counts;      // grid mode: [num_experts] scratch, zero between calls
  int32_t* send_slot;          // [max_tokens][num_ranks] out: row of token t at rank d, or -1
  int32_t* tokens_per_local_expert;  // [num_experts / num_ranks] out
  // [num_ranks][num_ranks] out (DeepEP's rank_prefix_matrix): [i][j] = rows rank j receives from
  // ranks 0..i, from the exchanged count matrix (block 0; every rank computes the same matrix).
  int32_t* rank_prefix_matrix;
  // Optional [num_experts / num_ranks] (device, caller-owned): tokens_per_local_expert is added
  // to it (block 0 only, after the counts arrived; not atomic: one writer). Null: the kernel
  // variant without it runs, so the default path does not pay.
  uint32_t* cumulative_stats;
  uint64_t layout_id;          // this dispatch's layout number (DeviceState::layout_id)
  // A T above max_tokens at any rank is also a bad-data device error (kErrTokensOverflow), not
  // only DeviceState::tokens_required (CountMode::kOnDevice; kExact reports it to the host).
  bool report_overflow;
  int32_t* published;          // optional (deduplicated only): the mapped counts (above)
  // The rows this rank sends to itself get their metadata but no payload (copy_out writes them
  // from x into the caller's tensors: CopyOutParams::own_x).
  bool defer_own_rows;
};

// The expanded dispatch (types.hpp ExpandOptions): the deduplicated dispatch's parameters (its
// block_counts and expert_counts unused) plus the expanded layout's.
struct ExpandDispatchParams {
  DispatchParams dispatch;
  int32_t* block_expert_counts;  // grid mode: [gridDim.x][num_experts] per-block histograms
  // [num_experts / num_ranks + 3] out: segment_begin [E/R + 1] (the last = this rank's
  // rows_required), then the lowest overflowed rank (-1: none) and the rows it needed, which the
  // expanded combine reads.
  int64_t* expand_info;
  int64_t capacity;  // rows of the receive region (expand_factor * R * max_tokens)
  int expert_alignment;
  bool zero_padding;
  int64_t segment_stride;  // 0: packed segments; > 0: segment e at e * segment_stride
  // With x.cast_fp8: tokens a block casts at a time into its shared memory (set by
  // launch_expand_dispatch: at most 16, a sending block's share of the tokens, and what the
  // device's shared memory holds beside the rest of the kernel's).
  int cast_piece_tokens;
  // [max_tokens][top_k] out: {row, destination rank} of selection k of token t, {-1, -1} where
  // it has no row (no selection, a repeat in the token, an overflowed destination): what a
  // cached dispatch of this layout moves.
  int2* expand_rows;
  // DeepEP's low-latency results (fixed-stride segments only; src_info null: none), written once
  // this rank's rows have all arrived (weft::ep::LowLatencyTargets, whose layouts they are:
  // E = num_experts / R segments of S = segment_stride rows, G = hidden / 128).
  struct LowLatencyOut {
    int32_t* src_info;      // [E, S]
    int64_t* layout_range;  // [E, R]
    float* scales;          // optional [E, S, G] at strides (S * G, 1, S)
    int32_t* ue8m0;         // optional [E, S, G / 4] at strides (S * G / 4, 1, S)
  } low_latency;
};

// A dispatch that reuses the layout of the last uncached one (send_slot or expand_rows and
// everything the receivers derived from them are still in place): only payload rows move.
struct CachedDispatchParams {
  CommParams comm;
  RowSource x;
  int64_t num_tokens;          // == the layout's
  int num_blocks;              // the grid, as DispatchParams::num_blocks
  const int32_t* send_slot;    // [num_tokens][num_ranks] from the uncached dispatch
  const int32_t* tokens_per_local_expert;  // [num_experts / num_ranks], for cumulative_stats
  int num_local_experts;
  uint32_t* cumulative_stats;  // optional, as in DispatchParams
  // An expanded layout (else null): its rows per selection (ExpandDispatchParams::expand_rows,
  // [num_tokens][top_k]) instead of send_slot; with zero_padding, this rank's padding rows
  // ([segment_begin[e] + tokens_per_local_expert[e], segment_begin[e + 1]), expand_info's) are
  // zeroed again, so that the call equals a fresh expanded dispatch even where recv_x was written
  // since.
  const int2* expand_rows;
  int top_k;
  const int64_t* segment_begin;  // [num_local_experts + 1]
  bool zero_padding;
  uint64_t layout_id;          // the layout reused: must be DeviceState::layout_id
  int64_t max_tokens;          // for the report of an overflowed layout (kErrOverflowedLayout)
  bool defer_own_rows;         // deduplicated only: as DispatchParams::defer_own_rows
};

// bf16 -> packed fp8 rows (weft::ep::Fp8RowLayout); see cast_to_fp8 in buffer.hpp.
struct CastFp8Params {
  const uint16_t* x;           // [num_tokens, hidden] bf16
  uint8_t* out;                // [num_tokens, row_bytes]
  int64_t num_tokens;
  int64_t hidden;              // a multiple of 128
  int64_t raw_bytes;           // hidden + 4 * hidden / 128
  int64_t row_bytes;
  bool round_scale;            // power-of-two scales (weft::ep::fp8_round_scale)
};

struct CombineParams {
  CommParams comm;
  const uint16_t* expert_out;  // [expert_out_rows, hidden] bf16
  int64_t expert_out_rows;
  const uint16_t* bias0;       // [num_tokens, hidden] or null
  const uint16_t* bias1;
  uint16_t* out;               // [num_tokens, hidden]
  int64_t num_tokens;
  int64_t hidden;
  int64_t max_tokens;
  int num_blocks;              // the grid, as DispatchParams::num_blocks
  const int32_t* send_slot;    // [num_tokens][num_ranks] from the dispatch
  int num_send_warps;          // warps per block that store back; the others reduce
  // Optional (deduplicated layout only; else null): [topk_weights_rows, num_weights] fp32 in the
  // received-row order, stored back with each row into comb_w; the source writes
  // combined_weights [num_tokens, num_weights] = per token, 0 + the contributing ranks' rows in
  // ascending rank order (fp32). num_weights <= top_k (comb_w's row stride).
  const float* topk_weights;
  int64_t topk_weights_rows;
  int num_weights;
  int top_k;
  float* combined_weights;
  // Expanded dispatch only (else null / 0): its expand_info (ExpandDispatchParams) and capacity.
  const int64_t* expand_info;
  int num_local_experts;
  int64_t expand_capacity;
  // Expanded only: each source's [num_tokens][top_k] fp32 weights are at the start of its own
  // comb_w region (CombineInputs::source_weights, copied there by block 0 from source_weights
  // before it raises the entry flag, which publishes them); each row's sum term is scaled by its
  // selections' weights.
  bool source_weighted;
  const float* source_weights;  // [num_tokens][top_k] fp32 (source_weighted)
  // Expanded only: the layout has fixed-stride segments (mostly padding rows): the send warps
  // first list the rows that head a chain into sparse_heads [<= num_ranks * max_tokens] as
  // (row, units done), then sum them together (send_chain_sums_sparse).
  bool sparse_rows;
  int2* sparse_heads;
  int64_t max_sparse_heads;
  uint64_t layout_id;          // the layout combined: must be DeviceState::layout_id
};

// Owned copies of the latest dispatch's results (the first num_rows rows of the window's
// regions); rows at or past the received count (DeviceState::num_recv, read on the device) are
// padding: payload not written, src (0, pad_token), topk_idx -1, topk_weights 0. Where the
// rank's state does not hold the layout copied (a fatal error earlier, or layout_id not in
// place: a copy replayed in a CUDA graph over a later dispatch's layout), every row is padding
// and a mismatch is raised on `error` (kErrLayoutMismatch), as combine does.
struct CopyOutParams {
  const char* recv_x;          // window rows, row_bytes apart (bf16, or packed fp8 rows)
  int64_t row_bytes;
  const int2* recv_src;
  const int32_t* recv_expert_idx;  // [cap][top_k]
  const float* recv_weights;
  const DeviceState* state;    // num_recv, own_begin and own_count, layout_id, the checks'
  cuda::DeviceErrorRecord* error;
  uint64_t layout_id;          // the layout copied (its Handle::sequence)
  // The copy stands in for a cached dispatch that launched no kernel (one rank, own rows
  // deferred, no statistics: that call has no row to move and no peer to wait for), so it also
  // makes that dispatch's check of an overflowed layout (kErrOverflowedLayout).
  bool cached_call;
  int rank;
  int64_t max_tokens;          // for the report of an overflowed layout
  int top_k;
  int64_t hidden;
  int64_t num_rows;
  int64_t valid_rows;          // rows the window holds (min(num_rows, capacity))
  void* x;                     // [num_rows, hidden]: bf16, or e4m3 bytes with x_scales
  float* x_scales;             // fp8: [num_rows, hidden / 128] row-major; null: bf16
  int2* src;                   // optional [num_rows]
  int32_t pad_token;
  void* topk_idx;              // optional [num_rows, num_topk] int32 or int64
  bool topk_idx_int64;
  float* topk_weights;         // optional [num_rows, num_topk]
  int num_topk;                // <= top_k: the first num_topk selections
  const int32_t* rank_prefix_matrix;  // optional, with rank_prefix_out: [R][R]
  int32_t* rank_prefix_out;
  // x.x non-null: the dispatch deferred its own rows (DispatchParams::defer_own_rows), so the
  // rows [own_begin, own_begin + own_count) of DeviceState are read from the dispatch's own x at
  // token recv_src[row].y, not from the window.
  RowSource own_x;
  int num_ranks;
  int max_blocks;              // the grid's cap (it strides over the rows)
};

struct HandshakeParams {
  CommParams comm;
};

// Cooperative launches (all blocks resident: the kernels wait on each other) of params.num_blocks
// blocks, the caller's choice (Buffer: one block per BufferOptions::tokens_per_block tokens, up to
// num_sms). Shared memory is sized by the kernel family's own layout type (dispatch.cu,
// expand_dispatch.cu), the same one the kernel carves.
void launch_dispatch(const DispatchParams& params, cudaStream_t stream);
void launch_cached_dispatch(const CachedDispatchParams& params, cudaStream_t stream);
void launch_expand_dispatch(ExpandDispatchParams params, cudaStream_t stream);
// params.expand_info non-null: the combine of an expanded dispatch.
void launch_combine(const CombineParams& params, cudaStream_t stream);
// Ordinary launches (no peer involved).
void launch_cast_fp8(const CastFp8Params& params, cudaStream_t stream);
void launch_copy_out(const CopyOutParams& params, cudaStream_t stream);
void launch_handshake(const HandshakeParams& params, cudaStream_t stream);
// out[r] = NCCL's LSA pointer of rank r's window (offset 0), for r < num_ranks: the
// CommParams::peers of a Buffer on an NCCL window.
void launch_peer_table(ncclWindow_t window, int num_ranks, char** out, cudaStream_t stream);

}  // namespace weft::ep::detail
