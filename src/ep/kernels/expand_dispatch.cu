// weft::ep expanded dispatch (types.hpp ExpandOptions): one row per (token, distinct local
// expert) at the expert's rank, in expert-major segments.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "fp8_cast.cuh"
#include "params.hpp"
#include "protocol.cuh"

namespace weft::ep::detail {
namespace {

// dispatch_kernel's three phases with the destination
// redefined from rank to expert (and, as there, block 0 coordinating without tokens of its own
// where there are other blocks):
//  1. count: a per-expert histogram (a token counts once per expert), in local or grid mode as
//     dispatch_kernel (grid mode: per-block histograms in block_expert_counts, a grid barrier).
//     s_hist ends as this block's prefix per expert; block 0's as the rank's totals (its prefix
//     is 0).
//  2. exchange: block 0 writes the histogram [E] into every rank's expand_matrix as tagged words
//     (slot [seq parity][rank]); every block waits for all R x E words (so every peer has
//     entered this call) and derives, for every rank d and its local expert e (g = d * E/R + e):
//        total(g) = sum_s count[s][g]
//        segment_begin_d[e] = sum_{e' < e} align_up(total(d * E/R + e'), expert_alignment)
//        rows_required(d) = segment_begin_d[E/R]
//     Every rank thus knows every destination's need: a destination over capacity is skipped by
//     every source before any payload moves (it receives no row; its num_recv is 0). This
//     block's next row for expert g is segment_begin_d[e] + sum_{s < rank} count[s][g] + prefix.
//  3. scatter, kExpandSubChunkTokens tokens at a time: warp 0 assigns slots in token order (one
//     token per step, lane k = selection k; a token's experts are distinct, so one lane per
//     expert) and links a token's rows at one destination in ascending order (expand_chain, what
//     the expanded combine sums); then one warp per (token, expert) pushes the row and its
//     metadata (with a cast, RowSource::cast_fp8: a piece of the sub-chunk's tokens at a time,
//     cast into packed fp8 rows in shared memory, one warp per group of 128, then those tokens'
//     rows sent from there). Each rank also writes the metadata of its own padding rows (source
//     (-1, -1), no selection, chain {-1, 0}) and, with zero_padding, zeroes their payload. It
//     ends as dispatch_kernel (done flags).
//  4. with ExpandDispatchParams::low_latency: block 0 writes layout_range after the count
//     exchange; after the done flags every block waits for them itself (every row of this rank
//     has arrived) and writes the rest of DeepEP's low-latency results over the whole grid.
static_assert(kExpandSubChunkTokens <= 128, "an item packs its token index in 7 bits");

// The kernel's dynamic shared memory; the launcher sizes it with the same carve.
struct ExpandSmem {
  char** peer;           // [kMaxRanks] window bases
  int64_t* required;     // [kMaxRanks] rows_required of every rank
  int64_t* largest;      // [kMaxRanks] every rank's largest aligned count (fixed stride)
  int64_t* next;         // [E] this block's next row per expert
  int64_t* seg;          // [E/R + 1] this rank's segment_begin
  int32_t* hist;         // [E] this block's prefix per expert (block 0: the rank's totals)
  int32_t* total;        // [E] rows per expert over all sources
  int32_t* sel;          // [kSub][top_k] expert of selection k of token i, or -1 (none, out of
                         // range, or repeated in the token)
  int32_t* item;         // [kSub * top_k] head << 12 | token i << 5 | k
  int32_t* row;          // [kSub * top_k]
  int32_t* link;         // [kSub * top_k] the next row of the token there, or -1
  int32_t* token_items;  // [kSub + 1] the first item of each token of the sub-chunk (and the end)
  int4* cast_rows;       // cast: [cast_piece_tokens][row_bytes / 16] packed fp8 rows (else none)
  uint32_t* overflowed;  // bit d: rank d's aligned rows exceed the capacity
  int* num_items;
  int* ok;
  // cast_bytes: the cast rows' bytes (cast_piece_tokens * row_bytes; 0 without a cast).
  __host__ __device__ static ExpandSmem carve(SmemCarver& m, int num_experts, int num_ranks,
                                              int top_k, std::size_t cast_bytes) {
    const std::size_t E = std::size_t(num_experts);
    const std::size_t per_sub = std::size_t(kExpandSubChunkTokens) * std::size_t(top_k);
    ExpandSmem s;
    s.peer = m.take<char*>(kMaxRanks);
    s.required = m.take<int64_t>(kMaxRanks);
    s.largest = m.take<int64_t>(kMaxRanks);
    s.next = m.take<int64_t>(E);
    s.seg = m.take<int64_t>(E / std::size_t(num_ranks) + 1);
    s.hist = m.take<int32_t>(E);
    s.total = m.take<int32_t>(E);
    s.sel = m.take<int32_t>(per_sub);
    s.item = m.take<int32_t>(per_sub);
    s.row = m.take<int32_t>(per_sub);
    s.link = m.take<int32_t>(per_sub);
    s.token_items = m.take<int32_t>(std::size_t(kExpandSubChunkTokens) + 1);
    s.cast_rows = m.take<int4>(cast_bytes / sizeof(int4));
    s.overflowed = m.take<uint32_t>(1);
    s.num_items = m.take<int>(1);
    s.ok = m.take<int>(1);
    return s;
  }
};

struct ExpandCall {
  uint64_t seq;
  uint64_t tag;  // the high half of this call's tagged words
  int parity;
  int epr;  // experts per rank
  TokenChunk chunk;
};

// 1. Histogram of tokens [begin, end) into s.hist. Bad expert ids are dropped, and reported by
// the one block that counts the token's own chunk (grid mode) or by block 0 (local mode).
__device__ void count_experts(const DispatchParams& p, const ExpandSmem& s, int64_t begin,
                              int64_t end, bool report) {
  const int K = p.top_k;
  for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) {
    for (int k = 0; k < K; ++k) {
      const int64_t e = load_expert(p, t * K + k);
      if (e == -1) continue;
      if (e < 0 || e >= p.num_experts) {
        if (report) raise_device_error(p.comm.error, kErrBadExpert, p.comm.rank, t, k, e);
        continue;
      }
      bool repeated = false;
      for (int k2 = 0; k2 < k; ++k2) repeated |= load_expert(p, t * K + k2) == e;
      if (!repeated) atomicAdd(&s.hist[e], 1);
    }
  }
  __syncthreads();
}

// 1. s.hist = this block's prefix per expert, or block 0's rank totals; false where the grid
// barrier timed out.
__device__ bool count_rows(const ExpandDispatchParams& ep, const ExpandSmem& s,
                           const ExpandCall& call) {
  const DispatchParams& p = ep.dispatch;
  const int E = p.num_experts;
  if (p.local_count) {
    count_experts(p, s, 0, blockIdx.x == 0 ? p.num_tokens : call.chunk.begin, blockIdx.x == 0);
    return true;
  }
  count_experts(p, s, call.chunk.begin, call.chunk.end, true);
  int32_t* mine = ep.block_expert_counts + int64_t(blockIdx.x) * E;
  for (int g = threadIdx.x; g < E; g += blockDim.x) mine[g] = s.hist[g];
  const bool ok = grid_barrier(p.comm, call.seq);
  // Other blocks' rows are read past L1 (__ldcg): they were written on other SMs.
  const int num_summed = blockIdx.x == 0 ? int(gridDim.x) : int(blockIdx.x);
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int32_t n = 0;
    for (int b = 0; b < num_summed; ++b) n += __ldcg(ep.block_expert_counts + int64_t(b) * E + g);
    s.hist[g] = n;
  }
  __syncthreads();
  return ok;
}

// 2. Block 0 publishes the histogram (a timed-out grid barrier publishes nothing: peers time
// out); every block waits for all R x E words into s.total (all sources) and s.next (sources
// below this rank, plus this block's prefix). False (every thread) on a timeout.
__device__ bool exchange_counts(const DispatchParams& p, const ExpandSmem& s,
                                const ExpandCall& call, bool ok) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int E = p.num_experts;
  if (blockIdx.x == 0 && ok) {
    for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
      const int peer = i / E, g = i % E;
      uint64_t* m = reinterpret_cast<uint64_t*>(s.peer[peer] + c.layout.expand_matrix);
      st_relaxed_sys(m + (int64_t(call.parity) * R + c.rank) * E + g,
                     call.tag | uint32_t(s.hist[g]));
    }
  }
  if (threadIdx.x == 0) *s.ok = ok;
  __syncthreads();
  if (ok) {
    const uint64_t* m = reinterpret_cast<const uint64_t*>(s.peer[c.rank] + c.layout.expand_matrix) +
                        int64_t(call.parity) * R * E;
    bool arrived = true;  // a thread reports (and waits out) at most one timeout
    for (int g = threadIdx.x; arrived && g < E; g += blockDim.x) {
      int32_t total = 0, before = 0;
      for (int src = 0; src < R; ++src) {
        const uint64_t* w = m + int64_t(src) * E + g;
        uint64_t v = 0;
        arrived = spin_wait([&] { return ((v = ld_acquire_sys(w)) & ~0xffffffffull) == call.tag; },
                            c.timeout_ns);
        if (!arrived) {
          raise_timeout(c, kWaitCounts, src, call.seq);
          *s.ok = 0;
          break;
        }
        const auto n = int32_t(uint32_t(v));
        total += n;
        if (src < c.rank) before += n;
      }
      s.total[g] = total;
      s.next[g] = before + (blockIdx.x == 0 ? 0 : s.hist[g]);
    }
  }
  __syncthreads();
  return *s.ok != 0;
}

// Warps d < R: destination d's segments, a warp scan of its aligned totals (or, with a fixed
// segment_stride, e * stride and the largest aligned total); s.next advances to the rows' final
// indices, s.required[d] = its rows_required, s.seg = this rank's segment_begin. Then
// s.overflowed (types.hpp ExpandOptions::segment_stride).
__device__ void lay_out_segments(const ExpandDispatchParams& ep, const ExpandSmem& s,
                                 const ExpandCall& call) {
  const CommParams& c = ep.dispatch.comm;
  const int R = c.num_ranks;
  const int lane = threadIdx.x % 32;
  const int d = int(threadIdx.x / 32);
  const int64_t stride = ep.segment_stride;
  if (d < R) {
    int64_t running = 0;
    int64_t largest = 0;
    for (int e0 = 0; e0 < call.epr; e0 += 32) {
      const int e = e0 + lane;
      const int64_t n = e < call.epr ? int64_t(s.total[d * call.epr + e]) : 0;
      const int64_t aligned =
          (n + ep.expert_alignment - 1) / ep.expert_alignment * ep.expert_alignment;
      int64_t inclusive = aligned;
      int64_t most = aligned;
      for (int o = 1; o < 32; o *= 2) {
        const int64_t v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
        most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
      }
      if (e < call.epr) {
        const int64_t begin = stride > 0 ? int64_t(e) * stride : running + inclusive - aligned;
        s.next[d * call.epr + e] += begin;
        if (d == c.rank) s.seg[e] = begin;
      }
      running += __shfl_sync(0xffffffffu, inclusive, 31);
      largest = max(largest, most);
    }
    if (stride > 0) running = int64_t(call.epr) * max(stride, largest);
    if (lane == 0) {
      s.required[d] = running;
      s.largest[d] = largest;
      if (d == c.rank) s.seg[call.epr] = running;  // = E/R * stride unless overflowed
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t overflowed = 0;
    for (int r = 0; r < R; ++r) {
      const bool over = s.required[r] > ep.capacity || (stride > 0 && s.largest[r] > stride);
      overflowed |= uint32_t(over) << r;
    }
    *s.overflowed = overflowed;
  }
  __syncthreads();
}

// Block 0: expand_info (segments, the lowest overflowed rank and its need), tokens per local
// expert (and the cumulative stats), num_recv.
__device__ void record_layout(const ExpandDispatchParams& ep, const ExpandSmem& s,
                              const ExpandCall& call, bool here_overflowed) {
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  const int epr = call.epr;
  for (int e = threadIdx.x; e <= epr; e += blockDim.x) ep.expand_info[e] = s.seg[e];
  for (int e = threadIdx.x; e < epr; e += blockDim.x) {
    const int32_t n = s.total[c.rank * epr + e];
    p.tokens_per_local_expert[e] = n;
    if (p.cumulative_stats != nullptr) p.cumulative_stats[e] += uint32_t(n);
  }
  if (threadIdx.x == 0) {
    // rows_required <= capacity <= 2^31 - 1 (BufferConfig::validate) where nothing overflowed
    c.state->num_recv = here_overflowed ? 0 : int32_t(s.seg[epr]);
    const uint32_t overflowed = *s.overflowed;
    const int first = overflowed == 0 ? -1 : __ffs(int(overflowed)) - 1;
    ep.expand_info[epr + 1] = first;
    ep.expand_info[epr + 2] = first < 0 ? 0 : s.required[first];
  }
}

// This rank's padding rows: segment e's rows [segment_begin[e] + total[e], segment_begin[e + 1]),
// segments over the blocks, rows over the warps: metadata of no row, and with zero_padding a
// zero payload.
__device__ void write_padding(const ExpandDispatchParams& ep, const ExpandSmem& s,
                              const ExpandCall& call) {
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  const int K = p.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t n16 = p.x.row_bytes / 16;
  char* local = s.peer[c.rank];
  auto* recv_x = reinterpret_cast<int4*>(local + c.layout.recv_x);
  const int own = c.rank * call.epr;
  for (int e = blockIdx.x; e < call.epr; e += gridDim.x) {
    for (int64_t row = s.seg[e] + s.total[own + e] + threadIdx.x / 32; row < s.seg[e + 1];
         row += kThreads / 32) {
      if (ep.zero_padding) {
        for (int64_t i = lane; i < n16; i += 32) recv_x[row * n16 + i] = make_int4(0, 0, 0, 0);
      }
      if (lane < K) {
        reinterpret_cast<int32_t*>(local + c.layout.recv_expert_idx)[row * K + lane] = -1;
        reinterpret_cast<float*>(local + c.layout.recv_weights)[row * K + lane] = 0.0f;
      }
      if (lane == 0) {
        reinterpret_cast<int2*>(local + c.layout.recv_src)[row] = make_int2(-1, -1);
        reinterpret_cast<int2*>(local + c.layout.expand_chain)[row] = make_int2(-1, 0);
      }
    }
  }
}

// 4 (block 0, right after the count exchange): layout_range of ExpandDispatchParams::low_latency
// from this call's count words in the window, which every block has just acquired and which no
// peer writes again before this rank's done flags let it past this call.
__device__ void write_layout_range(const ExpandDispatchParams& ep, const ExpandSmem& s,
                                   const ExpandCall& call) {
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int E = p.num_experts;
  const int epr = call.epr;
  const bool here_overflowed = (*s.overflowed >> c.rank & 1u) != 0;
  const auto* m = reinterpret_cast<const uint64_t*>(s.peer[c.rank] + c.layout.expand_matrix) +
                  int64_t(call.parity) * R * E;
  for (int e = threadIdx.x; e < epr; e += blockDim.x) {
    int64_t begin = 0;
    for (int r = 0; r < R; ++r) {
      const int64_t n =
          here_overflowed ? 0 : int64_t(uint32_t(__ldcg(m + int64_t(r) * E + c.rank * epr + e)));
      ep.low_latency.layout_range[int64_t(e) * R + r] = begin << 32 | n;
      begin += n;
    }
  }
}

// 4, every block once every rank's done flag of this call is in (thread 0 acquires them, so that
// a late peer is named by the timeout): the rest of ExpandDispatchParams::low_latency from the
// rows now here. src_info of every row (-1 for padding); the scales (and their UE8M0 bytes) of
// the received rows only, one thread per row, consecutive threads along the scales' stride-1
// dimension.
__device__ void write_low_latency_rows(const ExpandDispatchParams& ep, const ExpandSmem& s,
                                       const ExpandCall& call) {
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  const ExpandDispatchParams::LowLatencyOut& o = ep.low_latency;
  __shared__ int arrived;
  if (threadIdx.x == 0) {
    arrived = !is_broken(c) && wait_all_peers(c, s.peer[c.rank], kFlagDone, call.seq,
                                              kWaitDispatchDone);
  }
  __syncthreads();
  if (!arrived) return;
  const int epr = call.epr;
  const int64_t S = ep.segment_stride;
  const bool here_overflowed = (*s.overflowed >> c.rank & 1u) != 0;
  const char* local = s.peer[c.rank];
  const auto* recv_src = reinterpret_cast<const int2*>(local + c.layout.recv_src);
  const char* recv_x = local + c.layout.recv_x;
  const int64_t num_groups = p.x.hidden / kFp8GroupElements;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; row < epr * S;
       row += stride) {
    const int64_t e = row / S;
    const int64_t slot = row % S;
    const bool valid = !here_overflowed && slot < s.total[c.rank * epr + e];
    o.src_info[row] = valid ? __ldcg(&recv_src[row].y) : -1;
    if (!valid) continue;
    const auto* scales = reinterpret_cast<const float*>(recv_x + row * p.x.row_bytes + p.x.hidden);
    if (o.scales != nullptr) {
      float* out = o.scales + e * S * num_groups + slot;
      for (int64_t g = 0; g < num_groups; ++g) out[g * S] = __ldcg(scales + g);
    }
    if (o.ue8m0 != nullptr) {
      int32_t* out = o.ue8m0 + e * S * (num_groups / 4) + slot;
      for (int64_t w = 0; w < num_groups / 4; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          word |= ((__float_as_uint(__ldcg(scales + 4 * w + i)) >> 23) & 0xFFu) << (8 * i);
        }
        out[w * S] = int32_t(word);
      }
    }
  }
}

// 3, every thread: s.sel of the sub-chunk's n tokens.
__device__ void select_experts(const DispatchParams& p, const ExpandSmem& s, int64_t sub, int n) {
  const int K = p.top_k;
  for (int i = threadIdx.x; i < n * K; i += blockDim.x) {
    const int64_t t = sub + i / K;
    const int k = i % K;
    const int64_t e = load_expert(p, t * K + k);
    bool keep = e >= 0 && e < p.num_experts;
    for (int k2 = 0; keep && k2 < k; ++k2) keep = load_expert(p, t * K + k2) != e;
    s.sel[i] = keep ? int32_t(e) : -1;
  }
  __syncthreads();
}

// 3, warp 0: rows in token order (one token per step, lane k = selection k; a token's experts
// are distinct, so one lane per expert), each token's rows at one destination linked in
// ascending order, send_slot (the smallest) and expand_rows; the items to push.
__device__ void assign_rows(const ExpandDispatchParams& ep, const ExpandSmem& s,
                            const ExpandCall& call, int64_t sub, int n) {
  const DispatchParams& p = ep.dispatch;
  const int R = p.comm.num_ranks;
  const int K = p.top_k;
  const int lane = threadIdx.x % 32;
  const uint32_t overflowed = *s.overflowed;
  int items = 0;
  for (int i = 0; i < n; ++i) {
    if (lane == 0) s.token_items[i] = items;
    const int32_t g = lane < K ? s.sel[i * K + lane] : -1;
    int d = g >= 0 ? g / call.epr : -1;
    if (d >= 0 && (overflowed >> d & 1u) != 0) d = -1;
    int32_t row = -1;
    if (d >= 0) {
      row = int32_t(s.next[g]);  // < capacity: d did not overflow
      s.next[g] = row + 1;
    }
    // The token's rows at one destination ascend with the local expert (segments ascend): each
    // links to the next larger one; the smallest is the head and the send slot.
    int32_t next = INT32_MAX, slot = INT32_MAX;
    bool head = true;
    for (int k = 0; k < K; ++k) {
      const int dk = __shfl_sync(0xffffffffu, d, k);
      const int32_t rk = __shfl_sync(0xffffffffu, row, k);
      if (dk < 0) continue;
      if (dk == d) {
        if (rk > row) next = min(next, rk);
        if (rk < row) head = false;
      }
      if (dk == lane) slot = min(slot, rk);
    }
    if (lane < R) p.send_slot[(sub + i) * R + lane] = slot == INT32_MAX ? -1 : slot;
    if (lane < K) {
      ep.expand_rows[(sub + i) * K + lane] = d >= 0 ? make_int2(row, d) : make_int2(-1, -1);
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, d >= 0);
    if (d >= 0) {
      const int at = items + __popc(ballot & ((1u << lane) - 1u));
      s.item[at] = int(head) << 12 | i << 5 | lane;
      s.row[at] = row;
      s.link[at] = next == INT32_MAX ? -1 : next;
    }
    items += __popc(ballot);
    __syncwarp();  // this token's s.next updates before the next token's reads
  }
  if (lane == 0) {
    *s.num_items = items;
    s.token_items[n] = items;
  }
}

// 3, every warp: items [begin, end) (rows of a (token, expert)) one at a time, payload and
// metadata; with kCast the payload is the token's packed row in s.cast_rows (row i - first of
// the piece that cast_piece cast).
template <bool kCast>
__device__ void send_rows(const DispatchParams& p, const ExpandSmem& s, const ExpandCall& call,
                          int64_t sub, int begin, int end, int first) {
  const CommParams& c = p.comm;
  const int K = p.top_k;
  const int lane = threadIdx.x % 32;
  const int64_t n16 = p.x.row_bytes / 16;
  for (int it = begin + int(threadIdx.x / 32); it < end; it += kThreads / 32) {
    const int item = s.item[it];
    const int i = item >> 5 & 127;
    const int k = item & 31;
    const int64_t t = sub + i;
    const int32_t g = s.sel[i * K + k];
    const int d = g / call.epr;
    const int64_t row = s.row[it];
    char* base = s.peer[d];
    // Only the selections of this row's expert.
    auto in_row = [&](int64_t e) { return e == g; };
    if constexpr (kCast) {
      int4* dst = reinterpret_cast<int4*>(base + c.layout.recv_x) + row * n16;
      const int4* src = s.cast_rows + int64_t(i - first) * n16;
      for (int64_t v = lane; v < n16; v += 32) dst[v] = src[v];
      send_metadata(p, base, row, t, d, call.epr, lane, in_row);
    } else {
      warp_send_token(p, base, row, t, d, call.epr, lane, in_row);
    }
    if (lane == 0) {
      reinterpret_cast<int2*>(base + c.layout.expand_chain)[row] =
          make_int2(s.link[it], item >> 12);
    }
  }
}

// 3 with a cast, every thread: tokens [sub + first, sub + first + count) cast into s.cast_rows as
// packed fp8 rows (payload, scales, zero padding), one warp per (token, group of 128): every
// group in parallel rather than a row's groups one after another.
__device__ void cast_piece(const DispatchParams& p, const ExpandSmem& s, int64_t sub, int first,
                           int count) {
  const int lane = threadIdx.x % 32;
  const int64_t hidden = p.x.hidden;
  const int64_t num_groups = hidden / kFp8GroupElements;
  const int64_t words_per_row = p.x.row_bytes / 4;
  const auto* x = static_cast<const uint16_t*>(p.x.x);
  for (int64_t unit = threadIdx.x / 32; unit < count * num_groups; unit += kThreads / 32) {
    const int64_t j = unit / num_groups;
    const int64_t g = unit % num_groups;
    const auto* group =
        reinterpret_cast<const uint2*>(x + (sub + first + j) * hidden + g * kFp8GroupElements);
    const Fp8Group q = cast_fp8_group(__ldg(group + lane), p.x.round_scale);
    auto* row = reinterpret_cast<uint32_t*>(s.cast_rows) + j * words_per_row;
    row[g * 32 + lane] = q.packed;
    if (lane == 0) row[hidden / 4 + g] = __float_as_uint(q.scale);
    if (g == 0) {
      for (int64_t w = hidden / 4 + num_groups + lane; w < words_per_row; w += 32) row[w] = 0;
    }
  }
}

// A block that timed out still records its rows as unsent, so combine (and a cached dispatch)
// reads nothing stale; where block 0 timed out, this rank's count is 0 rather than the previous
// layout's (a cached dispatch bounds its padding rows by it).
__device__ void mark_unsent(const ExpandDispatchParams& ep, const ExpandCall& call) {
  const DispatchParams& p = ep.dispatch;
  const int R = p.comm.num_ranks;
  const int K = p.top_k;
  for (int64_t t = call.chunk.begin + threadIdx.x; t < call.chunk.end; t += blockDim.x) {
    for (int d = 0; d < R; ++d) p.send_slot[t * R + d] = -1;
    for (int k = 0; k < K; ++k) ep.expand_rows[t * K + k] = make_int2(-1, -1);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.comm.state->num_recv = 0;
}

// Named dispatch_*: profilers that total kernels by name (DeepEP's bench_kineto looks for
// "::dispatch" and "::combine") find it as the dispatch. kCast: x.cast_fp8 (each piece of a
// block's tokens cast into its shared memory, then sent); kLowLatency: low_latency given (phase
// 4). Variants, so that the plain dispatch carries neither's registers nor the cast's shared
// memory.
template <bool kCast, bool kLowLatency>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_expanded_kernel(const ExpandDispatchParams ep) {
  extern __shared__ __align__(16) char smem[];
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  ExpandCall call;
  const CallEntry entry = enter_call(c);
  call.seq = entry.seq;
  if (call.seq == 0) return;
  call.parity = int(call.seq & 1);
  call.tag = uint64_t(uint32_t(call.seq)) << 32;
  call.epr = p.num_experts / c.num_ranks;
  call.chunk = block_chunk(p.num_tokens, gridDim.x > 1 ? 1 : 0);  // block 0 coordinates
  SmemCarver carver{smem};
  const ExpandSmem s =
      ExpandSmem::carve(carver, p.num_experts, c.num_ranks, p.top_k,
                        kCast ? std::size_t(ep.cast_piece_tokens) * std::size_t(p.x.row_bytes) : 0);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    c.state->layout_id = p.layout_id;
    c.state->tokens_required = 0;  // T <= max_tokens: checked on the host
  }
  for (int g = threadIdx.x; g < p.num_experts; g += blockDim.x) s.hist[g] = 0;
  load_peers(c, entry, s.peer);

  bool ok = count_rows(ep, s, call);
  ok = exchange_counts(p, s, call, ok);
  if (ok) {
    lay_out_segments(ep, s, call);
    const bool here_overflowed = (*s.overflowed >> c.rank & 1u) != 0;
    if (blockIdx.x == 0) record_layout(ep, s, call, here_overflowed);
    if constexpr (kLowLatency) {
      if (blockIdx.x == 0) write_layout_range(ep, s, call);
    }
    if (!here_overflowed) write_padding(ep, s, call);
  }
  for (int64_t sub = call.chunk.begin; ok && sub < call.chunk.end; sub += kExpandSubChunkTokens) {
    const int n = int(min(int64_t(kExpandSubChunkTokens), call.chunk.end - sub));
    select_experts(p, s, sub, n);
    if (threadIdx.x < 32) assign_rows(ep, s, call, sub, n);
    __syncthreads();
    if constexpr (kCast) {
      // Pieces of the sub-chunk: cast into shared memory, then send their rows.
      for (int first = 0; first < n; first += ep.cast_piece_tokens) {
        const int count = min(ep.cast_piece_tokens, n - first);
        cast_piece(p, s, sub, first, count);
        __syncthreads();
        send_rows<true>(p, s, call, sub, s.token_items[first], s.token_items[first + count],
                        first);
        __syncthreads();
      }
    } else {
      send_rows<false>(p, s, call, sub, 0, *s.num_items, 0);
      __syncthreads();
    }
  }
  if (!ok) mark_unsent(ep, call);

  finish_dispatch(c, s.peer, call.seq);
  // A broken call writes nothing more (its host raises the error); grid_barrier lets every block
  // past once all arrived, broken or not.
  if constexpr (kLowLatency) write_low_latency_rows(ep, s, call);
}

}  // namespace

void launch_expand_dispatch(ExpandDispatchParams params, cudaStream_t stream) {
  const DispatchParams& p = params.dispatch;
  const bool cast = p.x.cast_fp8;
  SmemCarver sizer{nullptr};
  ExpandSmem::carve(sizer, p.num_experts, p.comm.num_ranks, p.top_k, 0);
  if (cast) {
    // The piece: at most 16 rows, no more than a sending block's share of the tokens (block 0
    // coordinates where there are others), in the shared memory the rest of the carve leaves.
    int device = 0;
    int most_bytes = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    WEFT_CUDA_CHECK(
        cudaDeviceGetAttribute(&most_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    // Static shared memory (the kernel's __shared__ words) and the carve's alignment slack.
    constexpr std::size_t kReserveBytes = 1024;
    const std::size_t left = std::size_t(most_bytes) > sizer.bytes + kReserveBytes
                                 ? std::size_t(most_bytes) - sizer.bytes - kReserveBytes
                                 : 0;
    const auto row_bytes = std::size_t(p.x.row_bytes);
    WEFT_CHECK(left >= row_bytes, "the fp8 cast on the way needs ", row_bytes,
               " bytes of shared memory per block for one packed row beyond the dispatch's ",
               sizer.bytes, "; the device has ", most_bytes, " (cast x with cast_to_fp8 first)");
    const int64_t senders = p.num_blocks > 1 ? p.num_blocks - 1 : 1;
    const int64_t share = std::max<int64_t>(1, (p.num_tokens + senders - 1) / senders);
    params.cast_piece_tokens = int(std::min<int64_t>(
        {16, int64_t(left / row_bytes), share, int64_t(kExpandSubChunkTokens)}));
    sizer = SmemCarver{nullptr};
    ExpandSmem::carve(sizer, p.num_experts, p.comm.num_ranks, p.top_k,
                      std::size_t(params.cast_piece_tokens) * row_bytes);
  }
  const bool low_latency = params.low_latency.src_info != nullptr;
  auto* kernel = cast ? (low_latency ? dispatch_expanded_kernel<true, true>
                                     : dispatch_expanded_kernel<true, false>)
                      : (low_latency ? dispatch_expanded_kernel<false, true>
                                     : dispatch_expanded_kernel<false, false>);
  launch_cooperative(kernel, params, p.num_blocks, sizer.bytes, stream);
}

}  // namespace weft::ep::detail
