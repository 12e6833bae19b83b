// weft::ep::Buffer: expert-parallel dispatch and combine over NVLink, on NCCL's device API.
//
// One process per GPU (every rank calls, with the same config):
//   weft::ep::Buffer ep(comm, {.max_tokens = 8192, .hidden = 7168, .num_experts = 256, .top_k = 8});
//   auto recv = ep.dispatch({.x = x, .topk_idx = idx, .topk_weights = w}, stream);  // no host sync
//   ... expert GEMMs read recv.recv_x[0 .. *recv.num_recv_device) ...
//   ep.combine({.expert_out = y}, recv.handle, out, stream);
//
// One process driving every local GPU (tests, tools): launch every rank's call before any host
// wait, since each rank's kernel waits on device for its peers' kernels:
//   auto eps = weft::ep::Buffer::create_local(2, config);
//   for (r...) res[r] = eps[r]->dispatch(in[r], streams[r], weft::ep::CountMode::kExact);
//   for (r...) eps[r]->wait_num_recv(res[r]);       // host waits only after all launches
//
// A virtual team (tests, benchmarks, debugging on one GPU; docs/ep.md "Virtual team"): the same,
// with R simulated ranks on the current device instead of R GPUs:
//   auto eps = weft::ep::Buffer::create_virtual_team(8, config);  // each rank: SMs / 8 blocks
//
// Contracts
//  - Collective: every rank makes the same sequence of dispatch/combine calls on its Buffer. The
//    calls of one Buffer must be ordered on the device (one stream, or ordered by events).
//  - Zero copy: a DispatchResult's arrays live in the Buffer's symmetric window and stay valid
//    until the next dispatch or combine on this Buffer is *launched*: read them (expert GEMMs),
//    or copy them out, in between. expert_out given to combine may be recv_x itself, and
//    topk_weights recv_weights.
//  - No host synchronisation inside dispatch or combine: both are single kernels, usable under
//    CUDA graph capture (the call sequence number lives on the device). CountMode::kExact only
//    adds an asynchronous 8-byte device-to-host copy (the count and tokens_required; expanded:
//    and an 8-byte one of rows_required); wait_num_recv() is the one host wait.
//  - Tokens over max_tokens (DispatchResult::tokens_required): an uncached deduplicated dispatch
//    may have T > max_tokens on some ranks. Every rank learns every T in the count exchange, so
//    all reach the same verdict in the same call: no rank moves a row, the call completes, and
//    every rank reports the largest T. The caller then rebuilds the Buffers of every rank
//    (max_tokens >= tokens_required) and dispatches again; the Buffer also stays usable as is.
//  - Errors (docs/ep.md "Errors"): bad arguments the host can see throw weft::Error at once,
//    among them pointers misaligned for their use or not device memory of this Buffer's device,
//    and handles that are stale or differ from the layout the Buffer keeps. Errors found on the
//    device are thrown by the next call on this Buffer, by wait_num_recv(), or by check() after
//    the stream was synchronised, and are of two kinds. Bad data (an expert id out of range: that
//    selection is dropped; expert_out with fewer rows than were received; a layout mismatch
//    under graph replay) leaves the Buffer usable. A timed-out wait (the message names the rank,
//    what it waited for and from which peer), or a peer's, is fatal: the ranks no longer agree
//    on the call sequence, every later call on this Buffer throws it and every later kernel does
//    nothing; destroy the Buffers of every rank.
//  - Async (the overloads taking AsyncOptions; docs/ep.md "Async"): the call runs on the Buffer's
//    comm stream (highest priority), after previous_event or else after the work queued so far
//    on the caller's stream; it returns an Event (event.hpp) to order the caller's stream after
//    it, or with async_finish = false orders the caller's stream itself. The zero-copy rule
//    above is unchanged: the next call, launched on the comm stream, overwrites the window.
//  - BufferOptions::pipeline_depth = N > 0: before launching a call, the host waits until the
//    call N calls before it (on this Buffer, any form) has completed on the device.
#pragma once

#include <cuda_runtime_api.h>
#include "weft/cuda/nccl_include.hpp"

#include <cstdint>
#include <memory>
#include <vector>

#include "weft/ep/event.hpp"
#include "weft/ep/types.hpp"

namespace weft::ep {

struct BufferOptions {
  int num_sms = 0;                 // most blocks per kernel (one per SM); 0 = every SM of the device
  // A call of T tokens runs ceil(T / tokens_per_block) blocks (at least 1, at most num_sms): at
  // small T fewer blocks make the launch and the in-kernel synchronisation cheaper.
  int tokens_per_block = 4;
  double timeout_s = 20.0;         // bound of every device-side wait
  // Of the 32 warps of a combine block at 2 ranks; the rest reduce. At R ranks the Buffer uses
  // combine_send_warps(this, R) (below): scaled with the share of received rows that go to peers.
  int combine_send_warps = 4;
  // The same for the combine of an expanded dispatch, whose store-back first sums each token's
  // rows here (several row reads per row sent), so it needs more of the block.
  int expanded_combine_send_warps = 16;
  // Bounded host run-ahead: before launching its call i, the Buffer waits on the host for its
  // call i - pipeline_depth (dispatch or combine, synchronous or async) to complete on the
  // device, so the host is at most pipeline_depth calls ahead. 0: no bound (no host wait).
  int pipeline_depth = 0;
};

// Identifies one layout of one Buffer (the uncached dispatch that computed it); what combine and
// a cached dispatch need of it stays in the Buffer, which takes T and the kernel from its own
// record and throws where a handle's fields differ from it (use a handle as returned). A handle
// is stale once the next uncached dispatch on its Buffer was launched (combine and cached
// dispatch then throw: the layout it names has been overwritten). A cached dispatch returns the
// handle it was given.
struct Handle {
  uint64_t buffer_id = 0;  // the Buffer that made it (Buffer ids are unique in the process)
  uint64_t sequence = 0;  // the layout's number (counts uncached dispatches of the Buffer)
  int64_t num_tokens = 0;  // T of the dispatch; a cached dispatch must pass the same T
  int64_t num_recv = -1;  // known only after wait_num_recv()
  ExpandOptions expand;   // the layout's DispatchInputs::expand (enabled: the expanded layout)
  // Known only after wait_num_recv() (-1 before): DispatchResult::tokens_required.
  int64_t tokens_required = -1;
};

// The most tokens of one dispatch (rows are int32 indices); up to this an uncached deduplicated
// dispatch takes T above BufferConfig::max_tokens and reports it (DispatchResult::tokens_required).
constexpr int64_t kMaxDispatchTokens = INT32_MAX;

// DeepEP's low_latency_dispatch results of a dispatch (DispatchInputs::low_latency), which must
// be an uncached expanded one with fixed-stride segments: E = num_local_experts segments of
// S = ExpandOptions::segment_stride rows, G = hidden / 128. Device arrays of the Buffer's device,
// written by the dispatch kernel once this rank's rows have arrived:
struct LowLatencyTargets {
  int32_t* src_info = nullptr;      // [E, S]: each row's source token, -1 for padding rows
  // [E, R]: per (local expert e, source rank r), (rows of e from ranks < r) << 32 | (rows of e
  // from rank r), the rows of e being in (source rank, source token) order.
  int64_t* layout_range = nullptr;
  // Optional, an fp8 dispatch's (packed rows or cast_to_fp8): fp32 [E, S, G] at strides
  // (S * G, 1, S) elements (column-major in the last two dims), the received rows' scales;
  // padding rows' are not written.
  float* scales = nullptr;
  // Optional, as scales, G a multiple of 4: int32 [E, S, G / 4] at strides (S * G / 4, 1, S),
  // the scales' exponent bytes (bits >> 23) & 0xFF (UE8M0; exact for power-of-two scales), group
  // 4w + i in byte i (little-endian) of word w.
  int32_t* ue8m0 = nullptr;
};

struct DispatchInputs {
  // [T, hidden] bf16, or [T, fp8_row_layout(hidden).row_bytes] uint8 packed fp8 rows (types.hpp;
  // cast_to_fp8 makes them from bf16; hidden must be a multiple of 128); 16-byte aligned. With
  // x_scales: [T, hidden] uint8, the e4m3 payload of DeepEP's fp8 pair.
  TensorView x;
  // DeepEP's fp8 pair's scales, read where they are: fp32 [T, hidden / 128] at (token_stride,
  // group_stride) elements (row-major: (hidden / 128, 1); column-major: (1, T)), 4-byte aligned.
  // The rows are packed on the way (the received rows are packed fp8 rows, as with packed x).
  struct Fp8Scales {
    const float* data = nullptr;  // null: x is bf16 or packed fp8 rows
    int64_t token_stride = 0;     // elements between the scales of consecutive tokens
    int64_t group_stride = 0;     // elements between a token's consecutive groups
  } x_scales;
  // [T, top_k] int32 or int64, aligned to its element; -1 = no selection. Every pointer of a
  // call is device memory of this Buffer's device (checked; the Buffer's own window is too).
  TensorView topk_idx;
  TensorView topk_weights;  // [T, top_k] float32, 4-byte aligned
  // Cached dispatch: reuse the layout of this handle's dispatch (topk_idx and topk_weights must
  // then be empty, T must be the handle's): only x moves, the layout phase is skipped. The
  // result's metadata (recv_expert_idx, recv_weights, recv_src, tokens_per_local_expert, counts,
  // segments) is the handle's dispatch's. A stale handle throws (never misroutes). An expanded
  // layout is reused as it is (expand may be left unset; if set it must equal the handle's):
  // every (token, local expert) row gets the new payload, and with zero_padding the padding rows
  // are zeroed again.
  const Handle* handle = nullptr;
  // Optional [num_local_experts] uint32 on this Buffer's device, 4-byte aligned, caller-owned:
  // this call's tokens_per_local_expert is added to it (DeepEP's
  // cumulative_local_expert_recv_stats; the caller zeroes it to start a window). Null: a kernel
  // variant without the accumulation runs.
  uint32_t* cumulative_local_expert_recv_stats = nullptr;
  // Most blocks (SMs) of this call; 0 = BufferOptions::num_sms. At most the device's SM count.
  int num_sms = 0;
  // The expanded layout (types.hpp ExpandOptions; DeepEP's do_expand): one received row per
  // (token, local expert), in expert-major segments aligned to expert_alignment rows. Needs
  // BufferConfig::expand_factor >= 1 (its capacity); not with a cached dispatch (handle). bf16
  // and packed fp8 rows alike. A rank whose aligned rows exceed expand_capacity() receives none
  // (num_recv 0, nothing written there) and reports its need in rows_required: a result, not an
  // error; the combine of such a dispatch is (see Buffer::combine).
  ExpandOptions expand{};
  // Owned results in one pass over the rows this rank sends to itself (DeepEP's owned path):
  // their metadata reaches the window, their payload does not; a copy_out given this call's x
  // (CopyOutTargets::own_x) then writes them from x straight into the caller's tensors, where
  // otherwise they would be written to the window and copied from there. Until that copy_out,
  // the window's rows [own_begin, own_begin + own_count) of this rank hold no payload (a
  // DispatchResult's recv_x views them stale). Deduplicated layout only (uncached or cached).
  // At one rank a cached dispatch with it and without statistics launches no kernel: that
  // copy_out makes its checks of the layout.
  bool defer_own_rows = false;
  // bf16 x cast to packed fp8 rows on the way (an uncached expanded dispatch): x is [T, hidden]
  // bf16, hidden a multiple of 128, and each row is cast where it is sent, so that the received
  // rows are those of cast_to_fp8(x, round_scale), bit for bit, without a pass of their own.
  struct CastToFp8 {
    bool enabled = false;
    bool round_scale = false;  // power-of-two scales (fp8_round_scale)
  } cast_to_fp8;
  // DeepEP's low-latency results of this dispatch (LowLatencyTargets), written by its kernel:
  // an uncached expanded dispatch with fixed-stride segments. Null: none.
  const LowLatencyTargets* low_latency = nullptr;
  // The caller vouches that every pointer of the call is device memory of this Buffer's device
  // (as the Python layer does for tensors it checked): their alignment is checked, but not by a
  // query to CUDA per pointer and call.
  bool pointers_checked = false;
};

// Worst-case sized views into the window (capacity = num_ranks * max_tokens rows, expanded:
// Buffer::expand_capacity()); the first *num_recv_device rows are valid, in (source rank, source
// token) order (expanded: in segments by local expert, see segment_begin).
struct DispatchResult {
  const uint16_t* recv_x = nullptr;          // [capacity, hidden] bf16
  const int32_t* recv_expert_idx = nullptr;  // [capacity, top_k] local expert id or -1
  const float* recv_weights = nullptr;       // [capacity, top_k] weight, 0 where not local
  const int32_t* recv_src = nullptr;         // [capacity, 2] (source rank, source token)
  const int32_t* tokens_per_local_expert = nullptr;  // [num_local_experts], on the device
  const int32_t* num_recv_device = nullptr;  // device scalar: rows received
  // [num_ranks][num_ranks] int32 on the device, row-major (DeepEP's rank_prefix_matrix,
  // handle[0]): [i][j] = rows rank j receives from ranks 0..i; the same matrix on every rank
  // (from the count exchange, no extra collective). This rank's rows from rank s are
  // [[s-1][rank], [s][rank]). Valid until the next uncached dispatch is launched; a cached
  // dispatch returns its handle's (the same array). All zero where the dispatch moved no rows
  // (tokens_required > 0). Null for the expanded layout (its rows are grouped by expert).
  const int32_t* rank_prefix_matrix = nullptr;
  // fp8 dispatch: [capacity, row_bytes] packed fp8 rows, and recv_x is null (bf16: the reverse).
  const uint8_t* recv_x_fp8 = nullptr;
  int64_t row_bytes = 0;                     // bytes per received row (the stride of both)
  int64_t capacity = 0;                      // rows each array above has room for
  int64_t num_recv = -1;                     // set by wait_num_recv()
  // Expanded dispatch only (else null / -1), on the device like the counts:
  //  segment_begin [num_local_experts + 1] int64: expert e's rows are [segment_begin[e],
  //  segment_begin[e] + tokens_per_local_expert[e]) in (source rank, source token) order, then
  //  padding rows up to segment_begin[e + 1] (a multiple of expert_alignment): source (-1, -1),
  //  recv_expert_idx -1, recv_weights 0, payload zero with zero_padding (else not written).
  //  A row's recv_expert_idx / recv_weights mark only the selections of its own expert.
  //  rows_required_device = segment_begin + num_local_experts: the aligned total this rank needed;
  //  above capacity the rank overflowed and received nothing (*num_recv_device == 0), though
  //  the counts and segments are still reported.
  const int64_t* segment_begin = nullptr;
  const int64_t* rows_required_device = nullptr;
  int64_t rows_required = -1;  // set by wait_num_recv() (expanded)
  // Tokens over max_tokens (deduplicated uncached dispatch; the expanded and cached ones refuse
  // T > max_tokens on the host). Every rank exchanges its T with its counts; where any rank's T
  // exceeds max_tokens, every rank moves no row (num_recv 0, counts and rank_prefix_matrix 0,
  // nothing added to cumulative_local_expert_recv_stats, no window written), the call completes
  // (the Buffer stays usable), and tokens_required is the largest T of any rank, identical on
  // every rank: what every rank rebuilds its Buffer's max_tokens to before dispatching again.
  // Combine or cached dispatch of that layout is refused (see Buffer::combine). With
  // CountMode::kExact a result, not an error; with kOnDevice also a bad-data device error
  // (thrown by the next call or check()).
  //  tokens_required_device: device int32, 0 = no rank over max_tokens, else the largest T.
  //  tokens_required: set by wait_num_recv(): 0 or that T; -1 = not waited for.
  const int32_t* tokens_required_device = nullptr;
  int64_t tokens_required = -1;
  // After wait_num_recv() of an uncached deduplicated dispatch: [num_local_experts] on the host,
  // valid until the next dispatch is launched (else null).
  const int32_t* tokens_per_local_expert_host = nullptr;
  Handle handle;  // names this layout for combine and a cached dispatch
};

// Owned copies of the latest dispatch's results (Buffer::copy_out): the first num_rows rows of
// each array given (null: not copied), device memory of the Buffer's device, contiguous. Rows at
// or past the received count (a worst-case num_rows) are padding: payload not written, src
// (0, pad_token), topk_idx -1, topk_weights 0.
struct CopyOutTargets {
  int64_t num_rows = 0;           // rows copied into each array given, >= 0
  void* x = nullptr;              // [num_rows, hidden] bf16, or the e4m3 bytes with x_scales
  float* x_scales = nullptr;      // fp8 dispatch: [num_rows, hidden / 128] row-major
  int32_t* src = nullptr;         // [num_rows, 2] (source rank, source token)
  int32_t pad_token = 0;          // the source token of the padding rows' src
  void* topk_idx = nullptr;       // [num_rows, num_topk] int32 or int64 (local expert or -1)
  bool topk_idx_int64 = false;    // topk_idx is int64 (else int32)
  float* topk_weights = nullptr;  // [num_rows, num_topk]
  int num_topk = 0;               // the first num_topk of the top_k selections
  int32_t* rank_prefix_matrix = nullptr;  // [R, R] (deduplicated layout)
  // Exactly where the latest dispatch deferred its own rows (DispatchInputs::defer_own_rows):
  // true, and that dispatch's x and x_scales (or the same rows in another of x's forms: bf16,
  // packed fp8, the fp8 pair), unchanged since: this copy reads the own rows' payload from them,
  // at their source tokens.
  bool deferred_own_rows = false;
  TensorView own_x;
  DispatchInputs::Fp8Scales own_x_scales;
  bool pointers_checked = false;  // as DispatchInputs::pointers_checked
};


enum class CountMode {
  kOnDevice,  // the count stays on the device: no host sync, graph-capturable
  kExact,     // also copies the count to pinned host memory; wait_num_recv() returns it
};

// The asynchronous form of dispatch and combine (DeepEP's previous_event / async_finish /
// allocate_on_comm_stream). The call runs on Buffer::comm_stream().
struct AsyncOptions {
  // The comm stream waits on this event before the call; empty: on the work queued so far on
  // the caller's stream. The event must cover everything the call reads (x, topk, expert_out,
  // biases) and every read of the previous call's window results (the call overwrites them).
  Event previous_event{};
  // false: the caller's stream waits on the call's completion before the call returns (its
  // results are usable on the caller's stream) and the returned Event is empty. true: the caller
  // orders its streams with the returned Event (wait() or scope()).
  bool async_finish = false;
  // weft allocates nothing in a call (dispatch results are views into the window, combine writes
  // the caller's `out`), so this moves no allocation; it states DeepEP's contract that the call's
  // outputs belong to the comm stream until the returned Event is waited on, and like DeepEP
  // requires previous_event and async_finish (else throws). Memory the caller wants ordered on
  // the comm stream (e.g. combine's out) it can allocate there itself: cudaMallocAsync on
  // comm_stream().
  bool allocate_on_comm_stream = false;
};

// The combine of an expanded dispatch: each rank first sums, per (source, token), the token's
// rows it received (fp32 from 0 in row order, rounded once to bf16), so one row per (token, rank)
// crosses NVLink; the source then reduces these as for a deduplicated dispatch (reference.hpp).
// If the dispatch overflowed at any rank, every rank skips the combine (out is not written) and
// records a device error naming that rank and the rows it needed, which the next call on the
// Buffer, wait_num_recv() or check() throws; the Buffer stays usable.
struct CombineInputs {
  // [rows >= num_recv, hidden] bf16 in the received-row order. With fewer rows than were
  // received (known only on the device) this rank reads and sends none and writes no out; its
  // peers report it and leave the tokens it contributes to unwritten (bad data: docs/ep.md).
  TensorView expert_out{};
  TensorView bias0{};       // optional [T, hidden] bf16 (data == nullptr: none)
  TensorView bias1{};       // optional [T, hidden] bf16
  int num_sms = 0;          // most blocks (SMs) of this call; 0 = BufferOptions::num_sms
  // Optional (cols == 0: none) [rows >= num_recv, K] float32 in the received-row order, K in
  // 1..top_k (DeepEP's combine(topk_weights=...), e.g. recv_weights itself with K = top_k), 4-byte
  // aligned, data null only with rows == 0. Rows short of num_recv are handled as expert_out's.
  // Deduplicated layout only (an expanded handle throws).
  TensorView topk_weights{};
  // [T, K] float32 out (DeepEP's combined_topk_weights), required iff topk_weights is given (else
  // must be null), 4-byte aligned: per token, 0.0f + the K weights of its row at each rank it
  // was sent to, in ascending rank order, every addition in fp32 (deterministic, bit-identical to
  // reference::combine_weights); 0 for a token sent nowhere. Written with out (not where out is
  // not written).
  float* combined_weights = nullptr;
  // Optional (data null: none), expanded layout only (DeepEP's low-latency combine): [T, top_k]
  // float32, 4-byte aligned, this rank's weights of its tokens' selections. Each received row
  // then counts with the weight of its own selections (reference::combine_weighted): the
  // expert rank multiplies the row by 0.0f + source_weights[t][k] over the k its
  // recv_expert_idx marks, reading the weights from the source's window, where the source's
  // kernel copies them (comb_w) before it signals its entry. No biases with it.
  TensorView source_weights{};
  bool pointers_checked = false;  // as DispatchInputs::pointers_checked
};

// The send warps of a deduplicated combine block at num_ranks ranks, from BufferOptions::
// combine_send_warps (the 2-rank value): round(send_warps_at_two_ranks * 2 (R - 1) / R), in
// 1..31; unchanged at 1 rank. Why: the send warps store back only the rows received from peers,
// (R - 1) / R of the rows under balanced routing (1/2 at 2 ranks, 7/8 at 8), while the reduce
// warps read every token's rows wherever they came from, so at the same rows per rank the send
// share of the work grows by 2 (R - 1) / R from the 2-rank point the default was tuned at
// (docs/perf-ep.md). 4 at 2 ranks: 6 at 4, 7 at 8. The expanded combine's split
// (expanded_combine_send_warps) does not change with R: its send warps sum every row, the own
// rank's included.
int combine_send_warps(int send_warps_at_two_ranks, int num_ranks);

// Packs x [num_tokens, hidden] bf16 into fp8 rows out [num_tokens, fp8_row_layout(hidden).
// row_bytes] (types.hpp; round_scale: power-of-two scales), bit-identical to
// reference::cast_to_fp8; both device pointers on the current device, 16-byte aligned; hidden a
// multiple of 128. Enqueued on stream, no host sync.
void cast_to_fp8(const void* x, int64_t num_tokens, int64_t hidden, void* out,
                 cudaStream_t stream, bool round_scale = false);

namespace detail {
struct BufferGroup;
struct BufferState;
struct AsyncState;
}  // namespace detail

// What the asynchronous dispatch returns: the results (as the synchronous form's) and the
// completion Event (empty with async_finish = false).
struct AsyncDispatchResult {
  DispatchResult result;  // valid on the caller's stream once it waited on event
  Event event;            // empty with async_finish = false
};

class Buffer {
 public:
  // Over an existing communicator (not owned); collective over it. The device current at the
  // call must be the communicator's.
  Buffer(ncclComm_t comm, const BufferConfig& config, const BufferOptions& options = {});
  // From launcher variables: rank (RANK or OMPI_COMM_WORLD_RANK), world size (WORLD_SIZE or
  // OMPI_COMM_WORLD_SIZE), local rank (LOCAL_RANK or OMPI_COMM_WORLD_LOCAL_RANK, else rank) and
  // NCCL's own rendezvous NCCL_COMM_ID=host:port. Owns the communicator it creates.
  static std::unique_ptr<Buffer> from_env(const BufferConfig& config,
                                          const BufferOptions& options = {});
  // One process drives devices 0..num_devices-1 (ncclCommInitAll); element r is rank r.
  static std::vector<std::unique_ptr<Buffer>> create_local(int num_devices,
                                                           const BufferConfig& config,
                                                           const BufferOptions& options = {});
  // A virtual team: num_ranks (1..32) simulated ranks on the current device, element r rank r,
  // each with its own window (a plain allocation on the device: no NCCL, no NVLink), device
  // state, streams and rank id; every rank's peer table holds the num_ranks windows' addresses.
  // The Buffer logic and the kernels are those of the NCCL path. Driven as create_local's
  // Buffers (launch every rank's call before any host wait, on one stream per rank: each rank's
  // kernel waits on device for its peers'). Residency: every rank's kernels must be resident at
  // once, so each rank gets at most virtual_team_num_sms(num_ranks) blocks per kernel
  // (options.num_sms: 0 = that share, more throws; a call's num_sms at most the Buffer's), one
  // block per SM (1024 threads): the R grids fit the device together as long as no other work
  // holds its SMs. A cooperative launch checks only its own grid's residency, not the sum.
  // Launch order: every rank's call i before anything that waits for a call i (a host wait, a
  // stream waiting on its event, a rank's call i + 1): the ranks' streams share the device's
  // hardware queues, where a waiting command holds back the launches queued behind it.
  static std::vector<std::unique_ptr<Buffer>> create_virtual_team(int num_ranks,
                                                                  const BufferConfig& config,
                                                                  const BufferOptions& options = {});
  // A virtual team rank's share of `device`'s SMs: min(SMs, 1024) / num_ranks (throws below 1).
  static int virtual_team_num_sms(int num_ranks, int device);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  DispatchResult dispatch(const DispatchInputs& inputs, cudaStream_t stream,
                          CountMode mode = CountMode::kOnDevice);
  // kExact only: waits for this dispatch's count, checks the device flag, stores and returns
  // result.num_recv (also in result.handle) and result.tokens_required (also in result.handle;
  // 0 unless a rank's T exceeded max_tokens); expanded, also stores result.rows_required. An
  // uncached deduplicated dispatch publishes its counts to mapped host memory when its count
  // exchange ends, so the wait returns while its rows still move (and also sets
  // result.tokens_per_local_expert_host); the others are waited for to the kernel's end.
  int64_t wait_num_recv(DispatchResult& result);

  // Owned copies of the latest dispatch's results (CopyOutTargets), in one kernel on stream
  // (which must be ordered after that dispatch), before the next dispatch or combine is
  // launched. fp8 (x_scales given) needs the latest dispatch to be an fp8 one. The kernel checks
  // that the layout copied is in place (a CUDA graph replayed over another dispatch's layout
  // writes padding rows only and raises the layout mismatch, as combine does).
  void copy_out(const CopyOutTargets& targets, cudaStream_t stream);

  // out: [handle.num_tokens, hidden] bf16, fully written (not at all after an overflowed
  // expanded dispatch: see CombineInputs).
  // A layout whose dispatch moved no rows (DispatchResult::tokens_required > 0) is refused, for
  // combine and cached dispatch alike: on the host (weft::Error, nothing launched) where this
  // rank knows it (its own T > max_tokens, or wait_num_recv reported it), else on the device
  // (the kernel skips, out unwritten, a bad-data error). Either way the call is not counted in
  // the call sequence, so ranks that refused on the host and ranks that skipped stay in step.
  void combine(const CombineInputs& inputs, const Handle& handle, void* out, cudaStream_t stream);

  // Asynchronous forms: the call runs on comm_stream() (see AsyncOptions); `stream` is the
  // caller's (compute) stream, on the Buffer's device. Same arguments, checks and results as the
  // forms above; with CountMode::kExact, wait_num_recv() works as there.
  AsyncDispatchResult dispatch(const DispatchInputs& inputs, cudaStream_t stream,
                               const AsyncOptions& async, CountMode mode = CountMode::kOnDevice);
  Event combine(const CombineInputs& inputs, const Handle& handle, void* out, cudaStream_t stream,
                const AsyncOptions& async);

  // The Buffer's communication stream (non-blocking, the device's greatest priority, so its
  // blocks are admitted ahead of a concurrent compute kernel's as SMs free up). Destroying the
  // Buffer waits for the work queued on it.
  cudaStream_t comm_stream() const noexcept;

  // Throws the recorded device error, if any. Call after the work has completed.
  void check();
  // Debugging (the rotated store-back order, docs/ep.md "Store-back order"): the rank that the
  // last deduplicated combine of this Buffer stored its first row back to, -1 where it stored
  // none to a peer. Rank r starts at the rows of rank r + 1 (cyclically, the first rank it
  // received rows from). Call after that combine completed (its stream synchronised); a host copy
  // of 4 bytes.
  int first_store_peer();

  int rank() const noexcept { return rank_; }
  int num_ranks() const noexcept { return num_ranks_; }
  int device() const noexcept { return device_; }
  const BufferConfig& config() const noexcept { return config_; }
  int64_t capacity() const noexcept { return int64_t(num_ranks_) * config_.max_tokens; }
  // Rows an expanded dispatch can receive (BufferConfig::expand_factor x capacity(); 0: none).
  int64_t expand_capacity() const noexcept { return config_.expand_capacity(num_ranks_); }
  // Bytes of the symmetric window a Buffer of this config allocates on each of num_ranks ranks
  // (validates the config first): what sizing a Buffer to a memory budget needs.
  static uint64_t window_bytes(const BufferConfig& config, int num_ranks);
  int num_blocks() const noexcept { return num_blocks_; }  // the most blocks per kernel
  int num_blocks(int64_t num_tokens) const noexcept;      // blocks of a call of num_tokens
  // ... with a per-call num_sms (0 = the Buffer's); throws unless 0 <= num_sms <= the device's.
  int num_blocks(int64_t num_tokens, int num_sms) const;

 private:
  Buffer(std::shared_ptr<detail::BufferGroup> group, std::size_t index, const BufferConfig& config,
         const BufferOptions& options);
  static void handshake(std::vector<Buffer*> buffers);
  void throw_if_device_error();
  void refuse_overflowed_layout(const Handle& layout, const char* call) const;
  DispatchResult dispatch_cached(const DispatchInputs& inputs, int64_t row_bytes,
                                 cudaStream_t stream, CountMode mode);
  DispatchResult make_result(int64_t row_bytes, const Handle& handle) const;
  void wait_published(DispatchResult& result);
  // The latest dispatch's row size, whether it deferred its own rows, and whether it was a
  // cached dispatch that launched no kernel (copy_out).
  void note_latest(int64_t row_bytes, const DispatchInputs& in,
                   bool unlaunched_cached_call = false);
  // pipeline_depth: the host wait before a launch, and the bookkeeping after it.
  void pace_host();
  void note_launched(cudaStream_t stream);
  // Async: the comm stream waits on previous_event or the caller's stream; the completion.
  void enter_comm_stream(const AsyncOptions& async, cudaStream_t stream);
  Event leave_comm_stream(const AsyncOptions& async, cudaStream_t stream);

  std::shared_ptr<detail::BufferGroup> group_;
  std::size_t index_ = 0;
  std::unique_ptr<detail::BufferState> state_;
  std::unique_ptr<detail::AsyncState> async_;
  BufferConfig config_;
  BufferOptions options_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  int num_blocks_ = 0;
  int device_num_sms_ = 0;
  int call_sms_limit_ = 0;  // most blocks of one call: the device's SMs, a virtual rank's share
  uint64_t id_ = 0;
  uint64_t dispatch_sequence_ = 0;  // uncached dispatches launched: the current layout's number
};

}  // namespace weft::ep
