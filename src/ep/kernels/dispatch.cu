// weft::ep dispatch (deduplicated layout): one row per (token, destination rank).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "params.hpp"
#include "protocol.cuh"

namespace weft::ep::detail {
namespace {

// Dispatch: G blocks (DispatchParams::num_blocks). With G > 1, block 0 coordinates (counts,
// publishes, records the layout) and sends nothing, so that its layout work is off the other
// blocks' path; blocks 1..G-1 own equal chunks of the tokens (block_chunk). With G = 1, block 0
// does both.
//  1. count, in one of two modes (DispatchParams::local_count):
//     - local (small T): every block counts the destinations of the tokens before its chunk
//       itself (at most T*K index loads, from L2, one thread per selection: token_masks); block 0
//       counts all T tokens and the per-expert histogram. No grid barrier: block 0 publishes as
//       soon as it has counted.
//     - grid (large T): each block counts its chunk (block_counts, global per-expert atomics), a
//       grid barrier, then block 0 sums and publishes; a block's prefix is the sum of the
//       block_counts before it.
//     Where a block's chunk is one sub-chunk (DispatchCall::masks_ready), the count's pass over
//     the indices also keeps its tokens' destination masks for phase 3 (no second pass).
//  2. exchange: block 0 writes this rank's count vector [R], its T and its per-local-expert
//     counts into every rank's window as *tagged words* (call number in the high half, the value
//     in the low half; slot [seq parity][rank]). A tagged word needs no fence before a flag: it
//     carries its own value, and a reader polls each word until its tag is this call's. Every
//     block waits for all R x (R + 1) count words (so every peer has entered this call: no rank
//     runs more than one call ahead) and then knows its rows' final index at every destination:
//        base(d) = sum_{s < rank} count[s][d] + prefix_b(d) + slot in block;
//     Overflow: where any rank's T exceeds max_tokens (its Buffer's rows and slots are sized for
//     max_tokens), every rank sees it in the same words and skips phase 3 alike: no row is
//     written anywhere, num_recv = 0, the counts and rank_prefix_matrix read 0, and
//     DeviceState::tokens_required = the largest T (what the caller regrows max_tokens to). The
//     call still ends with the done flags, so the call numbers stay in step.
//  3. scatter: one warp per (token, destination) writes row + metadata straight to the peer's
//     window (defer_own_rows: metadata only where the destination is this rank); the last block
//     then raises kFlagDone at every peer and waits for all peers' done.
// Rows are opaque: row_bytes / 16 vectors each (bf16 rows, or packed fp8 rows).
// kAccumulateStats: block 0 also adds the per-local-expert counts to p.cumulative_stats.

// The kernel's dynamic shared memory; the launcher sizes it with the same carve.
struct DispatchSmem {
  char** peer;          // [kMaxRanks] window bases
  int32_t* num_tokens;  // [kMaxRanks] T of every rank in this call
  int32_t* hist;        // [num_experts] tokens per expert (count), then per (source, local expert)
  int32_t* count;       // [kMaxRanks] rows per destination (this block's prefix, or the totals)
  int32_t* base;        // [kMaxRanks] this block's next row at every destination
  uint32_t* mask;       // [kSubChunkTokens] destination mask per token of the sub-chunk
  int32_t* row;         // [kSubChunkTokens][R] row of (token, destination), or -1
  int32_t* item;        // [kSubChunkTokens * R] (token << 8 | destination) of the rows to send
  int32_t* matrix;      // [R][R] count[source][destination] of this call
  int32_t* tile;        // [kThreads] token_masks' selections
  uint32_t* tmask;      // [kThreads] token_masks' masks
  int* num_items;
  int* ok;
  __host__ __device__ static DispatchSmem carve(SmemCarver& m, int num_experts, int num_ranks) {
    DispatchSmem s;
    s.peer = m.take<char*>(kMaxRanks);
    s.num_tokens = m.take<int32_t>(kMaxRanks);
    s.hist = m.take<int32_t>(std::size_t(num_experts));
    s.count = m.take<int32_t>(kMaxRanks);
    s.base = m.take<int32_t>(kMaxRanks);
    s.mask = m.take<uint32_t>(kSubChunkTokens);
    s.row = m.take<int32_t>(std::size_t(kSubChunkTokens) * num_ranks);
    s.item = m.take<int32_t>(std::size_t(kSubChunkTokens) * num_ranks);
    s.matrix = m.take<int32_t>(std::size_t(num_ranks) * num_ranks);
    s.tile = m.take<int32_t>(kThreads);
    s.tmask = m.take<uint32_t>(kThreads);
    s.num_items = m.take<int>(1);
    s.ok = m.take<int>(1);
    return s;
  }
};

// What the phases of one block share besides shared memory.
struct DispatchCall {
  uint64_t seq;
  uint64_t tag;  // (call number mod 2^32) << 32: the high half of this call's tagged words
  int parity;
  int epr;  // experts per rank
  TokenChunk chunk;
  bool masks_ready;  // the chunk is one sub-chunk: count_rows leaves its masks in s.mask
};

// Destination masks of tokens [begin, end) (bit d: a selection is on rank d), a tile of
// blockDim.x / top_k tokens at a time: one thread per selection, so the index loads are coalesced
// and all in flight at once (a thread per token would issue its top_k loads one after another).
// fn(t, mask) runs once per token t, on one thread. With `hist`,
// s_hist[e] counts each token once per expert. With `report`, bad expert ids are reported (and
// always dropped). Every thread of the block calls it with the same range; s_tile and s_tmask
// hold blockDim.x entries each.
template <typename Fn>
__device__ void token_masks(const DispatchParams& p, int64_t begin, int64_t end, int epr, bool hist,
                            bool report, int32_t* s_tile, uint32_t* s_tmask, int32_t* s_hist,
                            Fn&& fn) {
  const int K = p.top_k;
  const int tile_tokens = int(blockDim.x) / K;
  const int i = int(threadIdx.x);
  for (int64_t t0 = begin; t0 < end; t0 += tile_tokens) {
    const int n = int(min(int64_t(tile_tokens), end - t0));
    int64_t e = -1;
    if (i < n * K) {
      e = load_expert(p, t0 * K + i);
      if (e != -1 && (e < 0 || e >= p.num_experts)) {
        if (report)
          raise_device_error(p.comm.error, kErrBadExpert, p.comm.rank, t0 + i / K, i % K, e);
        e = -1;
      }
      s_tile[i] = int32_t(e);
    }
    if (i < n) s_tmask[i] = 0;
    __syncthreads();
    if (e >= 0) {
      atomicOr(&s_tmask[i / K], 1u << uint32_t(e / epr));
      if (hist) {
        bool repeated = false;  // a token counts once per expert
        for (int j = i - i % K; j < i; ++j) repeated |= s_tile[j] == e;
        if (!repeated) atomicAdd(&s_hist[e], 1);
      }
    }
    __syncthreads();
    if (i < n) fn(t0 + i, s_tmask[i]);
    __syncthreads();  // s_tile and s_tmask are the next tile's
  }
}

// 1. Count: s.count (rows per destination, after dedup) and, in block 0 or grid mode, s.hist
// (tokens per expert). Bad expert ids are reported by the block that counts its own chunk (grid
// mode) or by block 0 (local mode), so each is reported by one block. Returns false where the
// grid barrier timed out.
__device__ bool count_rows(const DispatchParams& p, const DispatchSmem& s,
                           const DispatchCall& call) {
  const int R = p.comm.num_ranks;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  // Masks of tokens [begin, end): those below count_end counted per destination, those of the
  // block's chunk kept for the scatter where it is one sub-chunk.
  auto scan = [&](int64_t begin, int64_t end, int64_t count_end, bool hist, bool report) {
    token_masks(p, begin, end, call.epr, hist, report, s.tile, s.tmask, s.hist,
                [&](int64_t t, uint32_t mask) {
                  if (call.masks_ready && t >= call.chunk.begin && t < call.chunk.end) {
                    s.mask[t - call.chunk.begin] = mask;
                  }
                  if (t >= count_end) return;
                  for (; mask != 0; mask &= mask - 1) atomicAdd(&s.count[__ffs(int(mask)) - 1], 1);
                });
  };
  if (p.local_count) {
    // s.count = this block's prefix (blocks > 0) or the rank's totals (block 0, whose prefix is 0).
    if (blockIdx.x == 0) {
      scan(0, p.num_tokens, p.num_tokens, true, true);
    } else {
      scan(0, call.chunk.end, call.chunk.begin, false, false);
      if (warp < R && lane == 0) s.base[warp] = s.count[warp];
    }
    return true;
  }
  scan(call.chunk.begin, call.chunk.end, call.chunk.end, true, true);
  if (threadIdx.x < R) p.block_counts[blockIdx.x * R + threadIdx.x] = s.count[threadIdx.x];
  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
    if (s.hist[i] != 0) atomicAdd(&p.expert_counts[i], s.hist[i]);
  }
  const bool ok = grid_barrier(p.comm, call.seq);
  if (warp < R) {  // prefix of this block at destination `warp`
    int32_t prefix = 0;
    for (int b = lane; b < int(blockIdx.x); b += 32) prefix += p.block_counts[b * R + warp];
    for (int o = 16; o > 0; o /= 2) prefix += __shfl_xor_sync(0xffffffffu, prefix, o);
    if (lane == 0) s.base[warp] = prefix;
  }
  if (blockIdx.x == 0) {  // the rank's totals and histogram
    if (warp < R) {
      int32_t total = 0;
      for (int b = lane; b < int(gridDim.x); b += 32) total += p.block_counts[b * R + warp];
      for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
      if (lane == 0) s.count[warp] = total;
    }
    for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
      s.hist[i] = p.expert_counts[i];
      p.expert_counts[i] = 0;  // every block's atomics precede the grid barrier above
    }
  }
  __syncthreads();
  return ok;
}

// 2a. Block 0 writes this rank's count words (rows per destination, then T) and its per-expert
// counts into every rank's window (a timed-out grid barrier publishes nothing: peers time out).
__device__ void publish_counts(const DispatchParams& p, const DispatchSmem& s,
                               const DispatchCall& call) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int W = R + 1;  // count words per source: its rows per destination, then its T
  for (int i = threadIdx.x; i < R * W; i += blockDim.x) {
    const int peer = i / W, d = i % W;
    uint64_t* m = reinterpret_cast<uint64_t*>(s.peer[peer] + c.layout.count_matrix);
    const uint32_t value = d < R ? uint32_t(s.count[d]) : uint32_t(p.num_tokens);
    st_relaxed_sys(m + (call.parity * R + c.rank) * W + d, call.tag | value);
  }
  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
    uint64_t* m = reinterpret_cast<uint64_t*>(s.peer[i / call.epr] + c.layout.expert_matrix);
    st_relaxed_sys(m + (call.parity * R + c.rank) * call.epr + (i % call.epr),
                   call.tag | uint32_t(s.hist[i]));
  }
}

// 2b. Every block: waits for all R x (R + 1) count words into s.matrix and s.num_tokens (thread i
// polls words i, i + blockDim.x, ...; on a timeout it reports that source and polls no more).
// Returns false (every thread) where any wait timed out.
__device__ bool receive_counts(const DispatchParams& p, const DispatchSmem& s,
                               const DispatchCall& call, bool ok) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int W = R + 1;
  if (threadIdx.x == 0) *s.ok = ok;
  __syncthreads();
  for (int i = threadIdx.x; ok && i < R * W; i += blockDim.x) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(s.peer[c.rank] + c.layout.count_matrix) +
                        call.parity * R * W + i;
    uint64_t v = 0;
    if (!spin_wait([&] { return ((v = ld_acquire_sys(w)) & ~0xffffffffull) == call.tag; },
                   c.timeout_ns)) {
      raise_timeout(c, kWaitCounts, i / W, call.seq);
      *s.ok = 0;
      break;
    }
    const int src = i / W, d = i % W;
    if (d < R) {
      s.matrix[src * R + d] = int32_t(uint32_t(v));
    } else {
      s.num_tokens[src] = int32_t(uint32_t(v));
    }
  }
  __syncthreads();
  return *s.ok != 0;
}

// A T above max_tokens at some rank (every rank decides from the same words): the largest such T
// and the lowest rank with it; required == 0 where none.
struct TokensOverflow {
  int32_t required = 0;
  int rank = -1;
};
__device__ TokensOverflow find_overflow(const DispatchParams& p, const DispatchSmem& s) {
  TokensOverflow o;
  for (int src = 0; src < p.comm.num_ranks; ++src) {
    if (s.num_tokens[src] > p.max_tokens && s.num_tokens[src] > o.required) {
      o.required = s.num_tokens[src];
      o.rank = src;
    }
  }
  return o;
}

// Block 0 of an overflowed call: no rows move; the counts read 0 and tokens_required says why.
__device__ void record_overflow(const DispatchParams& p, const DispatchCall& call,
                                TokensOverflow o) {
  const CommParams& c = p.comm;
  if (threadIdx.x == 0) {
    c.state->num_recv = 0;
    c.state->own_begin = 0;
    c.state->own_count = 0;
    c.state->tokens_required = o.required;
    c.state->overflow_rank = o.rank;
    if (p.published != nullptr) {
      p.published[2] = 0;
      p.published[3] = o.required;
    }
    if (p.report_overflow) {
      raise_device_error(c.error, kErrTokensOverflow, c.rank, o.rank, o.required, p.max_tokens);
    }
  }
  for (int e = threadIdx.x; e < call.epr; e += blockDim.x) {
    p.tokens_per_local_expert[e] = 0;
    if (p.published != nullptr) p.published[kPublishedHeaderWords + e] = 0;
  }
  const int R = c.num_ranks;
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) p.rank_prefix_matrix[i] = 0;
}

// Warps d < R: s.base[d] += the rows lower ranks send to d (block 0: its prefix is 0).
__device__ void add_lower_ranks(const DispatchParams& p, const DispatchSmem& s) {
  const int R = p.comm.num_ranks;
  const int lane = threadIdx.x % 32;
  const int d = int(threadIdx.x / 32);
  if (d >= R) return;
  int32_t base = 0;
  for (int src = lane; src < p.comm.rank; src += 32) base += s.matrix[src * R + d];
  for (int o = 16; o > 0; o /= 2) base += __shfl_xor_sync(0xffffffffu, base, o);
  if (lane == 0) s.base[d] = (blockIdx.x == 0 ? 0 : s.base[d]) + base;
}

// Block 0: num_recv, the own range, rank_prefix_matrix, and the tokens per local expert from
// every source's expert words (each polled for its tag: separate stores from the count words;
// one thread per (source, expert) word, so that all polls are in flight at once).
template <bool kAccumulateStats>
__device__ void record_layout(const DispatchParams& p, const DispatchSmem& s,
                              const DispatchCall& call) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int epr = call.epr;
  if (threadIdx.x == 0) {
    int32_t n = 0;
    for (int src = 0; src < R; ++src) n += s.matrix[src * R + c.rank];
    c.state->num_recv = n;
    c.state->tokens_required = 0;
    if (p.published != nullptr) {
      p.published[2] = n;
      p.published[3] = 0;
    }
    int32_t own_begin = 0;
    for (int src = 0; src < c.rank; ++src) own_begin += s.matrix[src * R + c.rank];
    c.state->own_begin = own_begin;
    c.state->own_count = s.matrix[c.rank * R + c.rank];
  }
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {  // [i / R][i % R]: column prefix
    int32_t n = 0;
    for (int src = 0; src <= i / R; ++src) n += s.matrix[src * R + i % R];
    p.rank_prefix_matrix[i] = n;
  }
  // s.hist was published already: free for the (source, local expert) counts.
  const uint64_t* em = reinterpret_cast<const uint64_t*>(s.peer[c.rank] + c.layout.expert_matrix) +
                       call.parity * R * epr;
  bool arrived = true;  // a thread reports (and waits out) at most one timeout
  for (int i = threadIdx.x; i < R * epr; i += blockDim.x) {
    uint64_t v = 0;
    if (arrived) {
      arrived =
          spin_wait([&] { return ((v = ld_acquire_sys(em + i)) & ~0xffffffffull) == call.tag; },
                    c.timeout_ns);
      if (!arrived) raise_timeout(c, kWaitCounts, i / epr, call.seq);
    }
    s.hist[i] = arrived ? int32_t(uint32_t(v)) : 0;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < epr; e += blockDim.x) {
    int32_t n = 0;
    for (int src = 0; src < R; ++src) n += s.hist[src * epr + e];
    p.tokens_per_local_expert[e] = n;
    if (p.published != nullptr) p.published[kPublishedHeaderWords + e] = n;
    if constexpr (kAccumulateStats) p.cumulative_stats[e] += uint32_t(n);
  }
}

// Block 0, thread 0, once the block's counts are in p.published (record_layout or
// record_overflow, then a barrier): the layout id after them. bar.sync orders every thread's
// stores before this thread's system fence, which is cumulative, so the host that sees the id
// sees the counts.
__device__ void publish_to_host(const DispatchParams& p) {
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(p.published) = p.layout_id;
}

// 3, warp 0: slots of the sub-chunk's n tokens in token order per destination (a ballot prefix,
// from s.base, which advances), into s.row and send_slot, and the (token, destination) items.
__device__ void assign_rows(const DispatchParams& p, const DispatchSmem& s, int64_t sub, int n) {
  const int R = p.comm.num_ranks;
  const int lane = threadIdx.x % 32;
  int items = 0;
  int32_t my_base = lane < R ? s.base[lane] : 0;  // lane d: next row at destination d
  for (int g = 0; g < n; g += 32) {
    const int i = g + lane;
    const uint32_t m = i < n ? s.mask[i] : 0u;
    const uint32_t lt = (1u << lane) - 1u;
    const int cnt = __popc(m);
    int scan = cnt;
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, scan, o);
      if (lane >= o) scan += v;
    }
    int item = items + scan - cnt;
    items += __shfl_sync(0xffffffffu, scan, 31);
    for (int d = 0; d < R; ++d) {
      const uint32_t bit = m >> d & 1u;
      const uint32_t ballot = __ballot_sync(0xffffffffu, bit);
      const int32_t base_d = __shfl_sync(0xffffffffu, my_base, d);
      if (i < n) {
        int32_t row = -1;
        if (bit) {
          row = base_d + __popc(ballot & lt);
          s.item[item++] = (i << 8) | d;
        }
        s.row[i * R + d] = row;
        p.send_slot[(sub + i) * R + d] = row;
      }
      if (lane == d) my_base += __popc(ballot);
    }
  }
  if (lane < R) s.base[lane] = my_base;
  if (lane == 0) *s.num_items = items;
}

// 3, every warp: pushes the sub-chunk's items (row, selections here, weights, source) straight
// into the destinations' windows, one warp per item; with defer_own_rows, the rows to this rank
// without their payload, one group of metadata_lanes() per item, after the others. A warp's
// items run one after another, each behind its loads of the selections: a group per item puts
// several items' loads in flight at once (at one rank every item is such a row).
__device__ void send_rows(const DispatchParams& p, const DispatchSmem& s, const DispatchCall& call,
                          int64_t sub) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int lane = threadIdx.x % 32;
  const int num_items = *s.num_items;
  const bool deferred = p.defer_own_rows;
  for (int it = threadIdx.x / 32; it < num_items; it += kThreads / 32) {
    const int i = s.item[it] >> 8;
    const int d = s.item[it] & 0xff;
    if (deferred && d == c.rank) continue;
    auto in_row = [&](int64_t e) { return e / call.epr == d; };
    warp_send_token(p, s.peer[d], s.row[i * R + d], sub + i, d, call.epr, lane, in_row);
  }
  if (!deferred) return;
  const int width = metadata_lanes(p.top_k);
  const int groups = kThreads / width;
  auto in_row = [&](int64_t e) { return e / call.epr == c.rank; };
  for (int it = int(threadIdx.x) / width; it < num_items; it += groups) {
    const int i = s.item[it] >> 8;
    if ((s.item[it] & 0xff) != c.rank) continue;
    send_metadata(p, s.peer[c.rank], s.row[i * R + c.rank], sub + i, c.rank, call.epr,
                  int(threadIdx.x) % width, in_row);
  }
}

// A block that timed out, or a call that overflowed, still records its rows as unsent (only
// tokens below max_tokens: send_slot has max_tokens rows), so combine reads nothing stale;
// where block 0 timed out, this rank's count is 0 rather than the previous layout's.
__device__ void mark_unsent(const DispatchParams& p, const DispatchCall& call, bool timed_out) {
  const int R = p.comm.num_ranks;
  const int64_t end = min(call.chunk.end, p.max_tokens);
  for (int64_t t = call.chunk.begin + threadIdx.x; t < end; t += blockDim.x) {
    for (int d = 0; d < R; ++d) p.send_slot[t * R + d] = -1;
  }
  if (timed_out && blockIdx.x == 0 && threadIdx.x == 0) {
    p.comm.state->num_recv = 0;
    p.comm.state->tokens_required = 0;
  }
}

template <bool kAccumulateStats>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchParams p) {
  extern __shared__ __align__(16) char smem[];
  const CommParams& c = p.comm;
  DispatchCall call;
  const CallEntry entry = enter_call(c);
  call.seq = entry.seq;
  if (call.seq == 0) return;
  call.parity = int(call.seq & 1);
  call.tag = uint64_t(uint32_t(call.seq)) << 32;
  call.epr = p.num_experts / c.num_ranks;
  call.chunk = block_chunk(p.num_tokens, gridDim.x > 1 ? 1 : 0);
  call.masks_ready = call.chunk.end - call.chunk.begin <= kSubChunkTokens;
  SmemCarver carver{smem};
  const DispatchSmem s = DispatchSmem::carve(carver, p.num_experts, c.num_ranks);
  if (blockIdx.x == 0 && threadIdx.x == 0) c.state->layout_id = p.layout_id;

  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) s.hist[i] = 0;
  if (threadIdx.x < kMaxRanks) s.count[threadIdx.x] = 0;
  load_peers(c, entry, s.peer);

  bool ok = count_rows(p, s, call);
  if (blockIdx.x == 0 && ok) publish_counts(p, s, call);
  ok = receive_counts(p, s, call, ok);
  const TokensOverflow overflow = ok ? find_overflow(p, s) : TokensOverflow{};
  const bool moves = ok && overflow.required == 0;
  if (ok && !moves && blockIdx.x == 0) record_overflow(p, call, overflow);
  if (moves) add_lower_ranks(p, s);
  if (moves && blockIdx.x == 0) record_layout<kAccumulateStats>(p, s, call);
  __syncthreads();
  if (ok && p.published != nullptr && blockIdx.x == 0 && threadIdx.x == 0) publish_to_host(p);

  for (int64_t sub = call.chunk.begin; moves && sub < call.chunk.end; sub += kSubChunkTokens) {
    const int n = int(min(int64_t(kSubChunkTokens), call.chunk.end - sub));
    if (!call.masks_ready) {
      token_masks(p, sub, sub + n, call.epr, false, false, s.tile, s.tmask, s.hist,
                  [&](int64_t t, uint32_t mask) { s.mask[t - sub] = mask; });
    }
    if (threadIdx.x < 32) assign_rows(p, s, sub, n);
    __syncthreads();
    send_rows(p, s, call, sub);
    __syncthreads();
  }
  if (!moves) mark_unsent(p, call, !ok);

  finish_dispatch(c, s.peer, call.seq);
}

}  // namespace

void launch_dispatch(const DispatchParams& params, cudaStream_t stream) {
  SmemCarver sizer{nullptr};
  DispatchSmem::carve(sizer, params.num_experts, params.comm.num_ranks);
  auto* kernel =
      params.cumulative_stats != nullptr ? dispatch_kernel<true> : dispatch_kernel<false>;
  launch_cooperative(kernel, params, params.num_blocks, sizer.bytes, stream);
}

}  // namespace weft::ep::detail
