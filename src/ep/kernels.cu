// weft::ep dispatch and combine kernels.
//
// Cross-rank protocol. Every call (dispatch, combine, the construction handshake) has a number
// `seq`, the same on every rank: the previous call's number (DeviceState::sequence, advanced by
// the last block of each kernel) plus one. Flags in the window carry call numbers, so nothing is
// ever reset and a flag from an older call never satisfies a wait (waits test flag >= seq).
// Readers poll with ld.acquire.sys. A flag that publishes data is a relaxed store after a system
// fence that follows the data (a release pattern; the fence is shared by everything the block or
// warp wrote). An entry flag (and the construction handshake's), stored first thing in a kernel,
// publishes no data: it says the previous call has ended on this rank, which the kernel boundary
// already orders before it.
// Why no rank overwrites a peer's data that is still in use: every call starts with a wait on
// every peer having entered it (dispatch: the count exchange; combine: the entry flags), so a
// rank is at most one call ahead of any peer; regions written per call by peers (counts) are
// double-buffered by call parity, the others are rewritten only after that entry wait.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "weft/cuda/nccl_include.hpp"

#include <algorithm>
#include <cstdint>

#include "kernels.hpp"
#include "weft/ep/types.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.cuh"

namespace weft::ep::detail {
namespace {

using weft::cuda::raise_device_error;
using weft::cuda::spin_wait;

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Streaming 16-byte load of data read once (no L1 allocation).
__device__ __forceinline__ int4 ld_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ char* peer_base(const CommParams& c, int peer) {
  return static_cast<char*>(ncclGetLsaPointer(c.window, 0, peer));
}
__device__ __forceinline__ uint64_t* flag_ptr(char* base, const CommParams& c, int kind, int src) {
  return reinterpret_cast<uint64_t*>(base + c.layout.flags) + kind * kMaxRanks + src;
}

// A fatal error on this rank (kErrTimeout, kErrPeerFailed): recorded apart from bad data, and
// the rank is broken from now on (every later kernel returns at once, so nothing runs on state a
// failed call left, such as a grid barrier's arrivals). peer >= 0: the rest of this kernel skips
// its waits for it.
__device__ void raise_fatal(const CommParams& c, uint32_t code, int64_t what, int peer,
                            uint64_t seq) {
  raise_device_error(c.fatal, code, c.rank, what, peer, int64_t(seq));
  if (peer >= 0) atomicOr(&c.state->dead_peers, 1u << peer);
  atomicExch(&c.state->broken, 1u);
}
__device__ __forceinline__ void raise_timeout(const CommParams& c, int64_t what, int peer,
                                              uint64_t seq) {
  raise_fatal(c, kErrTimeout, what, peer, seq);
}
__device__ __forceinline__ bool is_broken(const CommParams& c) {
  return *reinterpret_cast<volatile const uint32_t*>(&c.state->broken) != 0;
}
__device__ __forceinline__ bool is_dead(const CommParams& c, int peer) {
  return (*reinterpret_cast<volatile const uint32_t*>(&c.state->dead_peers) >> peer & 1u) != 0;
}
// A flag value of call seq (kFlagBits aside): has it arrived, and did its writer fail the call?
__device__ __forceinline__ bool flag_arrived(uint64_t v, uint64_t seq) {
  return (v & ~kFlagBits) >= seq;
}
__device__ __forceinline__ bool flag_failed(uint64_t v, uint64_t seq) {
  return (v & kFlagFailed) != 0 && (v & ~kFlagBits) == seq;
}

// Thread 0 only: waits until this rank's flag[kind][s] >= seq for every s; on timeout reports
// (rank, what, peer, seq), on a flag that says its writer failed the call reports that peer;
// either returns false.
__device__ bool wait_all_peers(const CommParams& c, char* local, int kind, uint64_t seq,
                               WaitKind what) {
  for (int s = 0; s < c.num_ranks; ++s) {
    const uint64_t* f = flag_ptr(local, c, kind, s);
    uint64_t v = 0;
    if (!spin_wait([&] { return flag_arrived(v = ld_acquire_sys(f), seq); }, c.timeout_ns)) {
      raise_timeout(c, what, s, seq);
      return false;
    }
    if (flag_failed(v, seq)) {
      raise_fatal(c, kErrPeerFailed, what, s, seq);
      return false;
    }
  }
  return true;
}

// Barrier over the blocks of this (cooperative) grid; false on timeout. All threads call it.
__device__ bool grid_barrier(const CommParams& c, uint64_t seq) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = 1;
    DeviceState* st = c.state;
    const uint32_t generation = ld_acquire_gpu(&st->barrier_generation);
    __threadfence();
    if (atomicAdd(&st->barrier_count, 1u) == gridDim.x - 1) {
      atomicExch(&st->barrier_count, 0u);
      __threadfence();
      atomicAdd(&st->barrier_generation, 1u);
    } else if (!spin_wait([&] { return ld_acquire_gpu(&st->barrier_generation) != generation; },
                          c.timeout_ns)) {
      raise_timeout(c, kWaitGridBarrier, -1, seq);
      ok = 0;
    }
    __threadfence();
  }
  __syncthreads();
  return ok != 0;
}

// Called by every block once its last store is issued. The last block to arrive resets the
// counter, advances the call number and returns true (all threads of that block).
__device__ bool finish_block(const CommParams& c, uint64_t seq) {
  __shared__ int last;
  // bar.sync orders every thread's stores before thread 0's fence, which is cumulative: one
  // system fence per block, not one per thread (as cooperative groups' grid sync does).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&c.state->done_counter, 1u) == gridDim.x - 1;
    if (last) {
      atomicExch(&c.state->done_counter, 0u);
      atomicExch(&c.state->work_counter, 0u);
      atomicExch(&c.state->dead_peers, 0u);
      // Orders every block's stores (each fenced before its arrival, which this block's atomic
      // observed) before what the last block stores next: finish_dispatch's done flags are
      // relaxed stores that rely on this fence.
      __threadfence_system();
      c.state->sequence = seq;
    }
  }
  __syncthreads();
  return last != 0;
}

// Combine and cached dispatch (every thread): is the layout in place not the one the call was
// made for (a layout the host checked the handle against, but a CUDA graph replayed after another
// dispatch)? Block 0 reports it; the caller then skips the call. Every rank that finds another
// layout skips alike; a peer that did not times out waiting for it.
__device__ bool layout_mismatch(const CommParams& c, uint64_t layout_id) {
  const uint64_t in_place = c.state->layout_id;
  if (in_place == layout_id) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    raise_device_error(c.error, kErrLayoutMismatch, c.rank, int64_t(layout_id), int64_t(in_place));
  }
  return true;
}

// Combine and cached dispatch (every thread): did the layout in place move no rows, because some
// rank's T exceeded max_tokens (DeviceState::tokens_required)? Block 0 reports it; the caller then
// returns at once *without* finish_block: the call is a no-op that does not advance the call
// number, so a rank whose host refused the same call (it knew of the overflow: CountMode::kExact,
// or its own T) and launched nothing stays in step with those that launched it. Every rank holds
// the same tokens_required, so every rank that launches skips alike and none waits for a peer.
__device__ bool layout_overflowed(const CommParams& c, int64_t max_tokens) {
  const int32_t required = c.state->tokens_required;
  if (required <= 0) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    raise_device_error(c.error, kErrOverflowedLayout, c.rank, c.state->overflow_rank, required,
                       max_tokens);
  }
  return true;
}

// One warp claims the next unit of work of the running kernel (all lanes get the same index):
// units go to whichever warps are ready, so blocks whose stores drain faster take more and no
// block's fixed share is left over at the end.
__device__ __forceinline__ int64_t work_claim(const CommParams& c, int lane) {
  uint32_t unit = 0;
  if (lane == 0) unit = atomicAdd(&c.state->work_counter, 1u);
  return int64_t(__shfl_sync(0xffffffffu, unit, 0));
}

// The end of every dispatch kernel (all threads call it): once the last block has issued its
// stores (finish_block), raise kFlagDone at every peer and wait for every peer's, so that the
// rows this rank receives are complete when the kernel ends. Where a wait of this call timed out
// on this rank (every block's raise precedes its arrival in finish_block), the done flags carry
// kFlagFailed: a peer then reports this rank's failure instead of returning rows never written.
__device__ void finish_dispatch(const CommParams& c, char* const* peer, uint64_t seq) {
  if (finish_block(c, seq) && threadIdx.x == 0) {
    const bool failed = is_broken(c);
    // finish_block's system fence (after every block's fence and arrival) orders the rows.
    for (int r = 0; r < c.num_ranks; ++r) {
      st_relaxed_sys(flag_ptr(peer[r], c, kFlagDone, c.rank), seq | (failed ? kFlagFailed : 0));
    }
    if (!failed) wait_all_peers(c, peer[c.rank], kFlagDone, seq, kWaitDispatchDone);
  }
}

__device__ __forceinline__ int64_t load_expert(const DispatchParams& p, int64_t i) {
  return p.topk_idx_int64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                          : static_cast<const int32_t*>(p.topk_idx)[i];
}

// Destination masks of tokens [begin, end) (bit d: a selection is on rank d), a tile of
// blockDim.x / top_k tokens at a time: one thread per selection, so the index loads are coalesced
// and all in flight at once (a thread per token would issue its top_k loads one after another).
// fn(t, mask) runs once per token t, on one thread. With `hist`,
// s_hist[e] counts each token once per expert. With `report`, bad expert ids are reported (and
// always dropped). Every thread of the block calls it with the same range; s_tile and s_tmask
// hold blockDim.x entries each.
template <typename Fn>
__device__ void token_masks(const DispatchParams& p, int64_t begin, int64_t end, int epr,
                            bool hist, bool report, int32_t* s_tile, uint32_t* s_tmask,
                            int32_t* s_hist, Fn&& fn) {
  const int K = p.top_k;
  const int tile_tokens = int(blockDim.x) / K;
  const int i = int(threadIdx.x);
  for (int64_t t0 = begin; t0 < end; t0 += tile_tokens) {
    const int n = int(min(int64_t(tile_tokens), end - t0));
    int64_t e = -1;
    if (i < n * K) {
      e = load_expert(p, t0 * K + i);
      if (e != -1 && (e < 0 || e >= p.num_experts)) {
        if (report) raise_device_error(p.comm.error, kErrBadExpert, p.comm.rank, t0 + i / K, i % K, e);
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

// One warp copies a row of n16 16-byte vectors.
__device__ __forceinline__ void warp_copy_row(int4* __restrict__ dst, const int4* __restrict__ src,
                                              int64_t n16, int lane) {
  constexpr int kUnroll = 7;
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_stream(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + 32 * u] = v[u];
  }
  for (; i < n16; i += 32) dst[i] = ld_stream(src + i);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: G blocks (G = f(T), see launch_dispatch); block b owns tokens [b*chunk, (b+1)*chunk).
//  1. count, in one of two modes (DispatchParams::local_count):
//     - local (small T): every block counts the destinations of the tokens before its chunk
//       itself (at most T*K index loads, from L2, one thread per selection: token_masks); block 0
//       counts all T tokens and the per-expert histogram. No grid barrier: block 0 publishes as
//       soon as it has counted.
//     - grid (large T): each block counts its chunk (block_counts, global per-expert atomics), a
//       grid barrier, then block 0 sums and publishes; a block's prefix is the sum of the
//       block_counts before it.
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
//     window; the last block then raises kFlagDone at every peer and waits for all peers' done.
// Rows are opaque: row_bytes / 16 vectors each (bf16 rows, or packed fp8 rows).
// kAccumulateStats: block 0 also adds the per-local-expert counts to p.cumulative_stats.
template <bool kAccumulateStats>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchParams p) {
  extern __shared__ int32_t smem[];
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int epr = p.num_experts / R;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const uint64_t seq = *reinterpret_cast<volatile uint64_t*>(&c.state->sequence) + 1;
  if (is_broken(c)) return;
  const int parity = int(seq & 1);
  if (blockIdx.x == 0 && threadIdx.x == 0) c.state->layout_id = p.layout_id;

  // Shared memory: histogram [num_experts] | counts [R] | base [R] | mask [kSub] |
  //                row [kSub][R] | items [kSub * R] (token << 8 | dst) | count words [R][R] |
  //                tile [kThreads] | tile masks [kThreads] (token_masks)
  int32_t* s_hist = smem;
  int32_t* s_count = s_hist + p.num_experts;
  int32_t* s_base = s_count + kMaxRanks;
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_base + kMaxRanks);
  int32_t* s_row = reinterpret_cast<int32_t*>(s_mask + kSubChunkTokens);
  int32_t* s_item = s_row + kSubChunkTokens * R;
  int32_t* s_matrix = s_item + kSubChunkTokens * R;  // count[s][d] of this call
  int32_t* s_tile = s_matrix + R * R;
  uint32_t* s_tmask = reinterpret_cast<uint32_t*>(s_tile + kThreads);
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int32_t s_num_tokens[kMaxRanks];  // T of every rank in this call
  __shared__ int s_num_items;
  __shared__ int s_ok;

  const int64_t chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
  const int64_t t_begin = min(p.num_tokens, int64_t(blockIdx.x) * chunk);
  const int64_t t_end = min(p.num_tokens, t_begin + chunk);

  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) s_hist[i] = 0;
  if (threadIdx.x < kMaxRanks) s_count[threadIdx.x] = 0;
  if (threadIdx.x < R) s_peer[threadIdx.x] = peer_base(c, threadIdx.x);
  __syncthreads();

  // 1. Count tokens [begin, end) into s_count (rows per destination, after dedup) and, with
  // `hist`, s_hist (tokens per expert). Bad expert ids are reported by the block that counts its
  // own chunk (grid mode) or by block 0 (local mode), so each is reported by one block.
  auto count_tokens = [&](int64_t begin, int64_t end, bool hist, bool report) {
    token_masks(p, begin, end, epr, hist, report, s_tile, s_tmask, s_hist,
                [&](int64_t, uint32_t mask) {
                  for (; mask != 0; mask &= mask - 1) atomicAdd(&s_count[__ffs(int(mask)) - 1], 1);
                });
  };
  bool ok = true;
  if (p.local_count) {
    // s_count = this block's prefix (blocks > 0) or the rank's totals (block 0, whose prefix is 0).
    if (blockIdx.x == 0) {
      count_tokens(0, p.num_tokens, true, true);
    } else {
      count_tokens(0, t_begin, false, false);
      if (warp < R && lane == 0) s_base[warp] = s_count[warp];
    }
  } else {
    count_tokens(t_begin, t_end, true, true);
    if (threadIdx.x < R) p.block_counts[blockIdx.x * R + threadIdx.x] = s_count[threadIdx.x];
    for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
      if (s_hist[i] != 0) atomicAdd(&p.expert_counts[i], s_hist[i]);
    }
    ok = grid_barrier(c, seq);
    if (warp < R) {  // prefix of this block at destination `warp`
      int32_t prefix = 0;
      for (int b = lane; b < int(blockIdx.x); b += 32) prefix += p.block_counts[b * R + warp];
      for (int o = 16; o > 0; o /= 2) prefix += __shfl_xor_sync(0xffffffffu, prefix, o);
      if (lane == 0) s_base[warp] = prefix;
    }
    if (blockIdx.x == 0) {  // the rank's totals and histogram
      if (warp < R) {
        int32_t total = 0;
        for (int b = lane; b < int(gridDim.x); b += 32) total += p.block_counts[b * R + warp];
        for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (lane == 0) s_count[warp] = total;
      }
      for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
        s_hist[i] = p.expert_counts[i];
        p.expert_counts[i] = 0;  // every block's atomics precede the grid barrier above
      }
    }
    __syncthreads();
  }

  // 2. Exchange. Block 0 publishes (a timed-out grid barrier publishes nothing: peers time out).
  char* local = s_peer[c.rank];
  const uint64_t tag = uint64_t(uint32_t(seq)) << 32;
  const int W = R + 1;  // count words per source: its rows per destination, then its T
  if (blockIdx.x == 0 && ok) {
    for (int i = threadIdx.x; i < R * W; i += blockDim.x) {
      const int peer = i / W, d = i % W;
      uint64_t* m = reinterpret_cast<uint64_t*>(s_peer[peer] + c.layout.count_matrix);
      const uint32_t value = d < R ? uint32_t(s_count[d]) : uint32_t(p.num_tokens);
      st_relaxed_sys(m + (parity * R + c.rank) * W + d, tag | value);
    }
    for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x) {
      uint64_t* m = reinterpret_cast<uint64_t*>(s_peer[i / epr] + c.layout.expert_matrix);
      st_relaxed_sys(m + (parity * R + c.rank) * epr + (i % epr), tag | uint32_t(s_hist[i]));
    }
  }
  // Thread i waits for words i, i + blockDim.x, ... of [s][W] (count[s][d], then T[s]); on a
  // timeout it reports source s and waits for no further word.
  if (threadIdx.x == 0) s_ok = ok;
  __syncthreads();
  for (int i = threadIdx.x; ok && i < R * W; i += blockDim.x) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(local + c.layout.count_matrix) +
                        parity * R * W + i;
    uint64_t v = 0;
    if (!spin_wait([&] { return ((v = ld_acquire_sys(w)) & ~0xffffffffull) == tag; },
                   c.timeout_ns)) {
      raise_timeout(c, kWaitCounts, i / W, seq);
      s_ok = 0;
      break;
    }
    const int src = i / W, d = i % W;
    if (d < R) {
      s_matrix[src * R + d] = int32_t(uint32_t(v));
    } else {
      s_num_tokens[src] = int32_t(uint32_t(v));
    }
  }
  __syncthreads();
  ok = s_ok != 0;
  // Every rank decides from the same words: the largest T above max_tokens (0: none) and the
  // lowest rank with it.
  int32_t required = 0;
  int over_rank = -1;
  for (int src = 0; ok && src < R; ++src) {
    if (s_num_tokens[src] > p.max_tokens && s_num_tokens[src] > required) {
      required = s_num_tokens[src];
      over_rank = src;
    }
  }
  const bool overflow = required > 0;
  if (ok && overflow && blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      c.state->num_recv = 0;
      c.state->own_begin = 0;
      c.state->own_count = 0;
      c.state->tokens_required = required;
      c.state->overflow_rank = over_rank;
      if (p.report_overflow) {
        raise_device_error(c.error, kErrTokensOverflow, c.rank, over_rank, required, p.max_tokens);
      }
    }
    for (int e = threadIdx.x; e < epr; e += blockDim.x) p.tokens_per_expert[e] = 0;
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) p.rank_prefix_matrix[i] = 0;
  }
  if (ok && !overflow && warp < R) {  // base of this block's rows at destination `warp`
    const int d = warp;
    int32_t base = 0;
    for (int s = lane; s < c.rank; s += 32) base += s_matrix[s * R + d];
    for (int o = 16; o > 0; o /= 2) base += __shfl_xor_sync(0xffffffffu, base, o);
    if (lane == 0) s_base[d] = (blockIdx.x == 0 ? 0 : s_base[d]) + base;
  }
  if (ok && !overflow && blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      int32_t n = 0;
      for (int s = 0; s < R; ++s) n += s_matrix[s * R + c.rank];
      c.state->num_recv = n;
      c.state->tokens_required = 0;
      int32_t own_begin = 0;
      for (int s = 0; s < c.rank; ++s) own_begin += s_matrix[s * R + c.rank];
      c.state->own_begin = own_begin;
      c.state->own_count = s_matrix[c.rank * R + c.rank];
    }
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {  // [i / R][i % R]: column prefix
      int32_t n = 0;
      for (int s = 0; s <= i / R; ++s) n += s_matrix[s * R + i % R];
      p.rank_prefix_matrix[i] = n;
    }
    // Per-expert counts of every source: all sources' count words have arrived, but the expert
    // words are separate stores, so each is polled for its tag too: one thread per (source,
    // expert) word, so that all polls are in flight at once, into s_hist (published above; free).
    const uint64_t* em =
        reinterpret_cast<const uint64_t*>(local + c.layout.expert_matrix) + parity * R * epr;
    bool arrived = true;  // a thread reports (and waits out) at most one timeout
    for (int i = threadIdx.x; i < R * epr; i += blockDim.x) {
      uint64_t v = 0;
      if (arrived) {
        arrived = spin_wait(
            [&] { return ((v = ld_acquire_sys(em + i)) & ~0xffffffffull) == tag; }, c.timeout_ns);
        if (!arrived) raise_timeout(c, kWaitCounts, i / epr, seq);
      }
      s_hist[i] = arrived ? int32_t(uint32_t(v)) : 0;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < epr; e += blockDim.x) {
      int32_t n = 0;
      for (int src = 0; src < R; ++src) n += s_hist[src * epr + e];
      p.tokens_per_expert[e] = n;
      if constexpr (kAccumulateStats) p.cumulative_stats[e] += uint32_t(n);
    }
  }
  __syncthreads();

  // 3. Scatter, kSubChunkTokens tokens at a time.
  const int64_t n16 = p.row_bytes / 16;
  for (int64_t sub = t_begin; ok && !overflow && sub < t_end; sub += kSubChunkTokens) {
    const int n = int(min(int64_t(kSubChunkTokens), t_end - sub));
    token_masks(p, sub, sub + n, epr, false, false, s_tile, s_tmask, s_hist,
                [&](int64_t t, uint32_t mask) { s_mask[t - sub] = mask; });
    if (warp == 0) {
      // Slots in token order per destination (ballot prefix), and the (token, dst) item list.
      int items = 0;
      int32_t my_base = lane < R ? s_base[lane] : 0;  // lane d: next row at destination d
      for (int g = 0; g < n; g += 32) {
        const int i = g + lane;
        const uint32_t m = i < n ? s_mask[i] : 0u;
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
              s_item[item++] = (i << 8) | d;
            }
            s_row[i * R + d] = row;
            p.send_slot[(sub + i) * R + d] = row;
          }
          if (lane == d) my_base += __popc(ballot);
        }
      }
      if (lane < R) s_base[lane] = my_base;
      if (lane == 0) s_num_items = items;
    }
    __syncthreads();
    const int num_items = s_num_items;
    for (int it = warp; it < num_items; it += kThreads / 32) {
      const int i = s_item[it] >> 8;
      const int d = s_item[it] & 0xff;
      const int64_t t = sub + i;
      const int64_t row = s_row[i * R + d];
      char* base = s_peer[d];
      warp_copy_row(reinterpret_cast<int4*>(base + c.layout.recv_x) + row * n16,
                    reinterpret_cast<const int4*>(p.x) + t * n16, n16, lane);
      if (lane < p.top_k) {
        const int64_t e = load_expert(p, t * p.top_k + lane);
        const bool here = e >= 0 && e < p.num_experts && e / epr == d;
        reinterpret_cast<int32_t*>(base + c.layout.recv_expert_idx)[row * p.top_k + lane] =
            here ? int32_t(e - int64_t(d) * epr) : -1;
        reinterpret_cast<float*>(base + c.layout.recv_weights)[row * p.top_k + lane] =
            here ? p.topk_weights[t * p.top_k + lane] : 0.0f;
      }
      if (lane == 0) {
        reinterpret_cast<int2*>(base + c.layout.recv_src)[row] = make_int2(c.rank, int(t));
      }
    }
    __syncthreads();
  }
  // A block that timed out, or a call that overflowed, still records its rows as unsent (only
  // tokens below max_tokens: send_slot has max_tokens rows), so combine reads nothing stale;
  // where block 0 timed out, this rank's count is 0 rather than the previous layout's.
  if (!ok || overflow) {
    const int64_t end = min(t_end, p.max_tokens);
    for (int64_t t = t_begin + threadIdx.x; t < end; t += blockDim.x) {
      for (int d = 0; d < R; ++d) p.send_slot[t * R + d] = -1;
    }
    if (!ok && blockIdx.x == 0 && threadIdx.x == 0) {
      c.state->num_recv = 0;
      c.state->tokens_required = 0;
    }
  }

  finish_dispatch(c, s_peer, seq);
}

// ---------------------------------------------------------------------------------------------
// Expanded dispatch (types.hpp ExpandOptions): one row per (token, distinct local expert) at the
// expert's rank, in expert-major segments. dispatch_kernel's three phases with the destination
// redefined from rank to expert:
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
//     metadata. Each rank also writes the metadata of its own padding rows (source (-1, -1), no
//     selection, chain {-1, 0}) and, with zero_padding, zeroes their payload. It ends as
//     dispatch_kernel (done flags).
// Shared memory: next [E] int64 | own segment_begin [E/R + 1] int64 | hist [E] | total [E] |
//   sel [kSub][top_k] | item, row, link [kSub * top_k] each (int32).
static_assert(kExpandSubChunkTokens <= 128, "an item packs its token index in 7 bits");
__global__ void __launch_bounds__(kThreads, 1)
    expand_dispatch_kernel(const ExpandDispatchParams ep) {
  extern __shared__ int64_t smem64[];
  const DispatchParams& p = ep.dispatch;
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int E = p.num_experts;
  const int K = p.top_k;
  const int epr = E / R;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const uint64_t seq = *reinterpret_cast<volatile uint64_t*>(&c.state->sequence) + 1;
  if (is_broken(c)) return;
  const int parity = int(seq & 1);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    c.state->layout_id = p.layout_id;
    c.state->tokens_required = 0;  // T <= max_tokens: checked on the host
  }

  int64_t* s_next = smem64;
  int64_t* s_seg = s_next + E;
  int32_t* s_hist = reinterpret_cast<int32_t*>(s_seg + epr + 1);
  int32_t* s_total = s_hist + E;
  int32_t* s_sel = s_total + E;  // [i][k]: expert of selection k of token i, or -1 (none,
                                 // out of range, or repeated in the token)
  int32_t* s_item = s_sel + kExpandSubChunkTokens * K;  // head << 12 | token i << 5 | k
  int32_t* s_row = s_item + kExpandSubChunkTokens * K;
  int32_t* s_link = s_row + kExpandSubChunkTokens * K;  // the next row of the token there, or -1
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int64_t s_required[kMaxRanks];
  __shared__ uint32_t s_overflowed;  // bit d: rank d's aligned rows exceed the capacity
  __shared__ int s_num_items;
  __shared__ int s_ok;

  const int64_t chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
  const int64_t t_begin = min(p.num_tokens, int64_t(blockIdx.x) * chunk);
  const int64_t t_end = min(p.num_tokens, t_begin + chunk);

  for (int g = threadIdx.x; g < E; g += blockDim.x) s_hist[g] = 0;
  if (threadIdx.x < R) s_peer[threadIdx.x] = peer_base(c, threadIdx.x);
  __syncthreads();

  // 1. Histogram of tokens [begin, end). Bad expert ids are dropped, and reported by the one
  // block that counts the token's own chunk (grid mode) or by block 0 (local mode).
  auto count_experts = [&](int64_t begin, int64_t end, bool report) {
    for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) {
      for (int k = 0; k < K; ++k) {
        const int64_t e = load_expert(p, t * K + k);
        if (e == -1) continue;
        if (e < 0 || e >= E) {
          if (report) raise_device_error(c.error, kErrBadExpert, c.rank, t, k, e);
          continue;
        }
        bool repeated = false;
        for (int k2 = 0; k2 < k; ++k2) repeated |= load_expert(p, t * K + k2) == e;
        if (!repeated) atomicAdd(&s_hist[e], 1);
      }
    }
    __syncthreads();
  };
  bool ok = true;
  if (p.local_count) {
    if (blockIdx.x == 0) {
      count_experts(0, p.num_tokens, true);
    } else {
      count_experts(0, t_begin, false);
    }
  } else {
    count_experts(t_begin, t_end, true);
    int32_t* mine = ep.block_expert_counts + int64_t(blockIdx.x) * E;
    for (int g = threadIdx.x; g < E; g += blockDim.x) mine[g] = s_hist[g];
    ok = grid_barrier(c, seq);
    // Other blocks' rows are read past L1 (__ldcg): they were written on other SMs.
    const int num_summed = blockIdx.x == 0 ? int(gridDim.x) : int(blockIdx.x);
    for (int g = threadIdx.x; g < E; g += blockDim.x) {
      int32_t n = 0;
      for (int b = 0; b < num_summed; ++b) n += __ldcg(ep.block_expert_counts + int64_t(b) * E + g);
      s_hist[g] = n;
    }
    __syncthreads();
  }

  // 2. Exchange. Block 0 publishes (a timed-out grid barrier publishes nothing: peers time out).
  char* local = s_peer[c.rank];
  const uint64_t tag = uint64_t(uint32_t(seq)) << 32;
  if (blockIdx.x == 0 && ok) {
    for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
      const int peer = i / E, g = i % E;
      uint64_t* m = reinterpret_cast<uint64_t*>(s_peer[peer] + c.layout.expand_matrix);
      st_relaxed_sys(m + (int64_t(parity) * R + c.rank) * E + g, tag | uint32_t(s_hist[g]));
    }
  }
  if (threadIdx.x == 0) s_ok = ok;
  __syncthreads();
  if (ok) {
    const uint64_t* m =
        reinterpret_cast<const uint64_t*>(local + c.layout.expand_matrix) + int64_t(parity) * R * E;
    bool arrived = true;  // a thread reports (and waits out) at most one timeout
    for (int g = threadIdx.x; arrived && g < E; g += blockDim.x) {
      int32_t total = 0, before = 0;
      for (int s = 0; s < R; ++s) {
        const uint64_t* w = m + int64_t(s) * E + g;
        uint64_t v = 0;
        arrived = spin_wait([&] { return ((v = ld_acquire_sys(w)) & ~0xffffffffull) == tag; },
                            c.timeout_ns);
        if (!arrived) {
          raise_timeout(c, kWaitCounts, s, seq);
          s_ok = 0;
          break;
        }
        const auto n = int32_t(uint32_t(v));
        total += n;
        if (s < c.rank) before += n;
      }
      s_total[g] = total;
      s_next[g] = before + (blockIdx.x == 0 ? 0 : s_hist[g]);
    }
  }
  __syncthreads();
  ok = s_ok != 0;
  if (ok && warp < R) {  // segments of destination `warp`: a warp scan of the aligned totals
    const int d = warp;
    int64_t running = 0;
    for (int e0 = 0; e0 < epr; e0 += 32) {
      const int e = e0 + lane;
      const int64_t n = e < epr ? int64_t(s_total[d * epr + e]) : 0;
      const int64_t aligned =
          (n + ep.expert_alignment - 1) / ep.expert_alignment * ep.expert_alignment;
      int64_t inclusive = aligned;
      for (int o = 1; o < 32; o *= 2) {
        const int64_t v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
      }
      if (e < epr) {
        const int64_t begin = running + inclusive - aligned;
        s_next[d * epr + e] += begin;
        if (d == c.rank) s_seg[e] = begin;
      }
      running += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) {
      s_required[d] = running;
      if (d == c.rank) s_seg[epr] = running;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t overflowed = 0;
    for (int d = 0; ok && d < R; ++d) overflowed |= uint32_t(s_required[d] > ep.capacity) << d;
    s_overflowed = overflowed;
  }
  __syncthreads();
  const bool here_overflowed = (s_overflowed >> c.rank & 1u) != 0;
  if (ok && blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= epr; e += blockDim.x) ep.expand_info[e] = s_seg[e];
    for (int e = threadIdx.x; e < epr; e += blockDim.x) {
      const int32_t n = s_total[c.rank * epr + e];
      p.tokens_per_expert[e] = n;
      if (p.cumulative_stats != nullptr) p.cumulative_stats[e] += uint32_t(n);
    }
    if (threadIdx.x == 0) {
      // rows_required <= capacity <= 2^31 - 1 (BufferConfig::validate) where nothing overflowed
      c.state->num_recv = here_overflowed ? 0 : int32_t(s_seg[epr]);
      const int first = s_overflowed == 0 ? -1 : __ffs(int(s_overflowed)) - 1;
      ep.expand_info[epr + 1] = first;
      ep.expand_info[epr + 2] = first < 0 ? 0 : s_required[first];
    }
  }

  const int64_t n16 = p.row_bytes / 16;
  auto* recv_x = reinterpret_cast<int4*>(local + c.layout.recv_x);
  // Own padding rows: segment e's rows [segment_begin[e] + total[e], segment_begin[e + 1]),
  // segments spread over the blocks, rows over the warps.
  if (ok && !here_overflowed) {
    const int own = c.rank * epr;
    for (int e = blockIdx.x; e < epr; e += gridDim.x) {
      for (int64_t row = s_seg[e] + s_total[own + e] + warp; row < s_seg[e + 1];
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

  // 3. Scatter.
  for (int64_t sub = t_begin; ok && sub < t_end; sub += kExpandSubChunkTokens) {
    const int n = int(min(int64_t(kExpandSubChunkTokens), t_end - sub));
    for (int i = threadIdx.x; i < n * K; i += blockDim.x) {
      const int64_t t = sub + i / K;
      const int k = i % K;
      const int64_t e = load_expert(p, t * K + k);
      bool keep = e >= 0 && e < E;
      for (int k2 = 0; keep && k2 < k; ++k2) keep = load_expert(p, t * K + k2) != e;
      s_sel[i] = keep ? int32_t(e) : -1;
    }
    __syncthreads();
    if (warp == 0) {
      int items = 0;
      for (int i = 0; i < n; ++i) {
        const int32_t g = lane < K ? s_sel[i * K + lane] : -1;
        int d = g >= 0 ? g / epr : -1;
        if (d >= 0 && (s_overflowed >> d & 1u) != 0) d = -1;
        int32_t row = -1;
        if (d >= 0) {
          row = int32_t(s_next[g]);  // < capacity: d did not overflow
          s_next[g] = row + 1;
        }
        // The token's rows at one destination ascend with the local expert (segments ascend):
        // each links to the next larger one; the smallest is the head and the send slot.
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
        if (lane < K) ep.expand_rows[(sub + i) * K + lane] = d >= 0 ? make_int2(row, d) : make_int2(-1, -1);
        const uint32_t ballot = __ballot_sync(0xffffffffu, d >= 0);
        if (d >= 0) {
          const int at = items + __popc(ballot & ((1u << lane) - 1u));
          s_item[at] = int(head) << 12 | i << 5 | lane;
          s_row[at] = row;
          s_link[at] = next == INT32_MAX ? -1 : next;
        }
        items += __popc(ballot);
        __syncwarp();  // this token's s_next updates before the next token's reads
      }
      if (lane == 0) s_num_items = items;
    }
    __syncthreads();
    const int num_items = s_num_items;
    for (int it = warp; it < num_items; it += kThreads / 32) {
      const int item = s_item[it];
      const int i = item >> 5 & 127;
      const int k = item & 31;
      const int64_t t = sub + i;
      const int32_t g = s_sel[i * K + k];
      const int d = g / epr;
      const int64_t row = s_row[it];
      char* base = s_peer[d];
      warp_copy_row(reinterpret_cast<int4*>(base + c.layout.recv_x) + row * n16,
                    reinterpret_cast<const int4*>(p.x) + t * n16, n16, lane);
      if (lane < K) {  // only the selections of this row's expert
        const bool mine = load_expert(p, t * K + lane) == g;
        reinterpret_cast<int32_t*>(base + c.layout.recv_expert_idx)[row * K + lane] =
            mine ? g - d * epr : -1;
        reinterpret_cast<float*>(base + c.layout.recv_weights)[row * K + lane] =
            mine ? p.topk_weights[t * K + lane] : 0.0f;
      }
      if (lane == 0) {
        reinterpret_cast<int2*>(base + c.layout.recv_src)[row] = make_int2(c.rank, int(t));
        reinterpret_cast<int2*>(base + c.layout.expand_chain)[row] =
            make_int2(s_link[it], item >> 12);
      }
    }
    __syncthreads();
  }
  // A block that timed out still records its rows as unsent, so combine (and a cached dispatch)
  // reads nothing stale; where block 0 timed out, this rank's count is 0 rather than the previous
  // layout's (a cached dispatch bounds its padding rows by it).
  if (!ok) {
    for (int64_t t = t_begin + threadIdx.x; t < t_end; t += blockDim.x) {
      for (int d = 0; d < R; ++d) p.send_slot[t * R + d] = -1;
      for (int k = 0; k < K; ++k) ep.expand_rows[t * K + k] = make_int2(-1, -1);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) c.state->num_recv = 0;
  }

  finish_dispatch(c, s_peer, seq);
}

// acc[0..8) += the 8 bf16 of one 16-byte vector, in fp32 (bf16 -> fp32 is exact).
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4 q) {
  const uint32_t w[4] = {uint32_t(q.x), uint32_t(q.y), uint32_t(q.z), uint32_t(q.w)};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc[2 * e] += __uint_as_float(w[e] << 16);
    acc[2 * e + 1] += __uint_as_float(w[e] & 0xffff0000u);
  }
}

// The 8 fp32 of acc rounded to nearest even (as the reference) into one 16-byte bf16 vector.
__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
    w[e] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

// One warp: dst[v] = bf16(sum of the num_rows rows of `rows` whose indices lanes 0..num_rows-1
// hold in `lane_row`), summed in fp32 from 0 in lane order and rounded once to nearest even: the
// reference's per-destination partial sum of an expanded dispatch.
__device__ void warp_sum_rows(int4* __restrict__ dst, const int4* __restrict__ rows,
                              int32_t lane_row, int num_rows, int64_t n16, int lane) {
  // Each lane owns kCols vectors per step and loads kRows rows of each before adding, so
  // kCols * kRows 16-byte loads per lane are in flight (the walk is otherwise latency-bound).
  constexpr int kRows = 4, kCols = 4;
  for (int64_t v0 = 0; v0 < n16; v0 += 32 * kCols) {  // uniform: the shuffles need every lane
    float acc[kCols][8];
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[k][e] = 0.0f;
    }
    for (int i0 = 0; i0 < num_rows; i0 += kRows) {
      int4 q[kRows][kCols];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int32_t r = __shfl_sync(0xffffffffu, lane_row, (i0 + u) & 31);
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          const int64_t v = v0 + k * 32 + lane;
          if (i0 + u < num_rows && v < n16) q[u][k] = ld_stream(rows + int64_t(r) * n16 + v);
        }
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          if (i0 + u < num_rows && v0 + k * 32 + lane < n16) add_bf16x8(acc[k], q[u][k]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int64_t v = v0 + k * 32 + lane;
      if (v < n16) dst[v] = pack_bf16x8(acc[k]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Combine: warps [0, num_send_warps) of every block store back expert outputs of rows received
// from peers into the peer's comb_x[rank][token] (then comb_flags[rank][token] = seq); the other
// warps reduce this rank's tokens: bias0 + bias1 + contributions in ascending rank order, the
// own rank's read straight from expert_out (the slot would only be a local copy of it).
// With topk_weights (deduplicated only), each stored-back row's num_weights weights go into
// comb_w[rank][token] by the same warp before the same fence, so the row's flag publishes both;
// the reduce warp of a token's first piece sums them (0 + ranks ascending, the own rank's read
// straight from topk_weights) into combined_weights.
// kExpanded (the combine of an expanded dispatch): what is stored back is one row per
// (source, token), the fp32 sum of its rows here rounded once (warp_sum_rows over its
// expand_chain), and the own rank's sums go through comb_x too (its rows are not one row per
// token), so the reduce waits for every contributing rank alike.
template <bool kExpanded>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineParams p) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const uint64_t seq = *reinterpret_cast<volatile uint64_t*>(&c.state->sequence) + 1;
  if (is_broken(c)) return;
  if (layout_mismatch(c, p.layout_id)) {  // out unwritten
    finish_block(c, seq);
    return;
  }
  if (layout_overflowed(c, p.max_tokens)) return;  // out unwritten; not a call (no seq advance)
  if constexpr (kExpanded) {
    // The dispatch overflowed at some rank, which then holds none of its rows. Every rank derived
    // the same overflow from the same counts, so every rank skips the call alike (none waits for
    // a peer), reports it and leaves out unwritten.
    const int64_t overflowed_rank = p.expand_info[p.num_local_experts + 1];
    if (overflowed_rank >= 0) {
      if (blockIdx.x == 0 && threadIdx.x == 0) {
        raise_device_error(c.error, kErrExpandOverflow, c.rank, overflowed_rank,
                           p.expand_info[p.num_local_experts + 2], p.expand_capacity);
      }
      finish_block(c, seq);
      return;
    }
  }
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int s_ok;
  if (threadIdx.x < R) s_peer[threadIdx.x] = peer_base(c, threadIdx.x);
  __syncthreads();
  char* local = s_peer[c.rank];
  const int64_t n16 = p.hidden * 2 / 16;
  // expert_out has fewer rows than were received, or the wait for the peers' entry timed out:
  // this rank reads none of its rows, sends nothing (out unwritten) and marks the rows it would
  // have sent as failed (kFlagFatal for the timeout), so that its peers report it at once instead
  // of timing out on rows that never come.
  const int32_t num_recv = c.state->num_recv;
  const int64_t rows_given = p.topk_weights != nullptr
                                 ? min(p.expert_out_rows, p.topk_weights_rows)
                                 : p.expert_out_rows;
  const bool rows_missing = num_recv > rows_given;
  const int2* recv_src = reinterpret_cast<const int2*>(local + c.layout.recv_src);
  // The flag of a received row's (source, token) at the source, or null (reported) where the
  // source is out of range: rows are sent only to sources that exist.
  auto source_in_range = [&](int2 src) {
    return src.x >= 0 && src.x < R && src.y >= 0 && src.y < p.max_tokens;
  };
  auto source_flag = [&](int64_t j, int2 src) -> uint64_t* {
    if (!source_in_range(src)) {
      raise_device_error(c.error, kErrBadSource, c.rank, j, src.x, src.y);
      return nullptr;
    }
    return reinterpret_cast<uint64_t*>(s_peer[src.x] + c.layout.comb_flags) +
           int64_t(c.rank) * p.max_tokens + src.y;
  };

  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int peer = 0; peer < R; ++peer) {
      st_relaxed_sys(flag_ptr(s_peer[peer], c, kFlagEntry, c.rank), seq);
    }
  }

  if (warp < p.num_send_warps) {
    const int num_send_threads = p.num_send_warps * 32;
    if (threadIdx.x == 0) s_ok = wait_all_peers(c, local, kFlagEntry, seq, kWaitCombineEntry);
    asm volatile("bar.sync 1, %0;" ::"r"(num_send_threads) : "memory");
    if (!s_ok || rows_missing) {
      if (s_ok && blockIdx.x == 0 && threadIdx.x == 0) {
        raise_device_error(c.error, kErrTooManyRows, c.rank, num_recv, rows_given,
                           int64_t(rows_given < p.expert_out_rows));
      }
      const uint64_t mark = seq | kFlagFailed | (s_ok ? 0 : kFlagFatal);
      // Every row that would have gone out (expanded: every chain head, the own rank's too):
      // its flag carries the mark, and no payload.
      const int2* chain = reinterpret_cast<const int2*>(local + c.layout.expand_chain);
      const int64_t own_begin = c.state->own_begin;
      const int64_t own_count = kExpanded ? 0 : c.state->own_count;
      for (int64_t r = int64_t(blockIdx.x) * num_send_threads + threadIdx.x;
           r < int64_t(num_recv) - own_count; r += int64_t(gridDim.x) * num_send_threads) {
        const int64_t j = r < own_begin || kExpanded ? r : r + own_count;
        if (kExpanded && chain[j].y == 0) continue;
        if (uint64_t* flag = source_flag(j, recv_src[j])) st_relaxed_sys(flag, mark);
      }
    } else if (s_ok && kExpanded) {
      // Every row that heads its (source, token)'s chain here: the chain's sum goes to the
      // source's comb_x[rank][token], in batches of up to kMaxSendBatch received rows, claimed
      // by the send warps one at a time (work_claim; padding rows and chain members other than
      // the head are skipped), one system fence per batch, then lane 0 marks each head's slot as
      // landed. A chain ascends and has at most min(top_k, E/R) <= 32 rows; the walk is bounded
      // by that and by num_recv regardless.
      constexpr int kMaxSendBatch = 4;
      const int2* chain = reinterpret_cast<const int2*>(local + c.layout.expand_chain);
      const int total_warps = int(gridDim.x) * p.num_send_warps;
      const int64_t batch =
          min(int64_t(kMaxSendBatch),
              max(int64_t(1), (int64_t(num_recv) + total_warps - 1) / total_warps));
      const int64_t num_batches = (num_recv + batch - 1) / batch;
      for (int64_t b = work_claim(c, lane); b < num_batches; b = work_claim(c, lane)) {
        const int64_t r0 = b * batch;
        const int64_t r1 = min(int64_t(num_recv), r0 + batch);
        bool any_head = false;  // a batch of padding rows and chain members needs no fence
        for (int64_t j = r0; j < r1; ++j) {
          if (chain[j].y == 0) continue;
          any_head = true;
          if (!source_in_range(recv_src[j])) continue;  // reported with the flags below
          int32_t lane_row = -1;  // lane i: the chain's i-th row
          int num_rows = 0;
          for (int32_t r = int32_t(j); r >= 0 && r < num_recv && num_rows < 32; r = chain[r].x) {
            if (lane == num_rows) lane_row = r;
            ++num_rows;
          }
          const int2 src = recv_src[j];
          warp_sum_rows(reinterpret_cast<int4*>(s_peer[src.x] + c.layout.comb_x) +
                            (int64_t(c.rank) * p.max_tokens + src.y) * n16,
                        reinterpret_cast<const int4*>(p.expert_out), lane_row, num_rows, n16, lane);
        }
        __syncwarp();
        if (lane == 0 && any_head) {
          __threadfence_system();  // the warp's row stores (ordered by __syncwarp) before flags
          for (int64_t j = r0; j < r1; ++j) {
            if (chain[j].y == 0) continue;
            if (uint64_t* flag = source_flag(j, recv_src[j])) st_relaxed_sys(flag, seq);
          }
        }
        __syncwarp();
      }
    } else if (s_ok) {
      // Only rows from peers go out (the own rank's rows, [own_begin, own_begin + own_count) of
      // the received order, are reduced locally straight from expert_out): remote row r is
      // received row j = r < own_begin ? r : r + own_count. The claims start at the rows of
      // source rank + 1 and wrap around (remote row (r + own_begin) mod num_remote), so that at
      // the start of a call the ranks store back to different peers instead of all to rank 0
      // (docs/ep.md "Store-back order"; at 2 ranks the order is the received one). They go out
      // in batches of up to
      // kMaxSendBatch consecutive remote rows, which the send warps claim one at a time
      // (work_claim: a fixed share per warp left the slowest blocks' rows, and the reduce of
      // their tokens, to the end: 356 -> 345 us at T=8192); one system fence per batch (lane 0,
      // after the warp's stores), then lane 0 marks each row's slot as landed. With few rows
      // (small T) a batch is one row, so that every row has its own warp and all are in flight.
      constexpr int kMaxSendBatch = 4;
      const int64_t own_begin = c.state->own_begin;
      const int64_t own_count = c.state->own_count;
      const int64_t num_remote = int64_t(num_recv) - own_count;
      const int total_warps = int(gridDim.x) * p.num_send_warps;
      const int64_t batch =
          min(int64_t(kMaxSendBatch), max(int64_t(1), (num_remote + total_warps - 1) / total_warps));
      const int64_t num_batches = (num_remote + batch - 1) / batch;
      auto received_row = [&](int64_t r) {
        r = (r + own_begin) % num_remote;
        return r < own_begin ? r : r + own_count;
      };
      for (int64_t b = work_claim(c, lane); b < num_batches; b = work_claim(c, lane)) {
        const int64_t r0 = b * batch;
        const int64_t r1 = min(num_remote, r0 + batch);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t j = received_row(r);
          const int2 src = recv_src[j];
          if (!source_in_range(src)) continue;
          const int64_t slot = int64_t(c.rank) * p.max_tokens + src.y;
          warp_copy_row(reinterpret_cast<int4*>(s_peer[src.x] + c.layout.comb_x) + slot * n16,
                        reinterpret_cast<const int4*>(p.expert_out) + j * n16, n16, lane);
          if (p.topk_weights != nullptr && lane < p.num_weights) {
            reinterpret_cast<float*>(s_peer[src.x] + c.layout.comb_w)[slot * p.top_k + lane] =
                p.topk_weights[j * p.num_weights + lane];
          }
        }
        __syncwarp();
        if (lane == 0) {
          __threadfence_system();  // the warp's row stores (ordered by __syncwarp) before flags
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t j = received_row(r);
            if (uint64_t* flag = source_flag(j, recv_src[j])) st_relaxed_sys(flag, seq);
          }
        }
        __syncwarp();
      }
    }
  } else if (!rows_missing) {
    // Work unit: (token, piece of kPieceVecs 16-byte vectors), so even a few tokens spread over
    // many warps. Per step each lane loads kVec vectors of up to kGroup sources before adding,
    // to keep enough bytes in flight; the additions keep the reference's order.
    constexpr int kVec = 2;
    constexpr int kGroup = 2;
    constexpr int64_t kPieceVecs = 32 * kVec * 2;
    const int num_reduce_warps = kThreads / 32 - p.num_send_warps;
    const int total_warps = int(gridDim.x) * num_reduce_warps;
    const uint64_t* comb_flags = reinterpret_cast<const uint64_t*>(local + c.layout.comb_flags);
    const int4* comb_x = reinterpret_cast<const int4*>(local + c.layout.comb_x);
    const int64_t num_pieces = (n16 + kPieceVecs - 1) / kPieceVecs;
    const int num_bias = (p.bias0 != nullptr) + (p.bias1 != nullptr);
    for (int64_t unit = int64_t(blockIdx.x) * num_reduce_warps + (warp - p.num_send_warps);
         unit < p.num_tokens * num_pieces; unit += total_warps) {
      const int64_t t = unit / num_pieces;
      const int64_t piece = unit % num_pieces;
      uint32_t ranks = 0;  // contributing ranks of token t
      bool arrived = true;
      for (int d = 0; d < R; ++d) {
        if (p.send_slot[t * R + d] < 0) continue;
        ranks |= 1u << d;
        if ((!kExpanded && d == c.rank) || !arrived) continue;
        const uint64_t* f = comb_flags + int64_t(d) * p.max_tokens + t;
        uint64_t v = ld_acquire_sys(f);
        if (!flag_arrived(v, seq)) {
          // A peer that timed out once in this call is not waited for again: one timeout per
          // call, not one per unit.
          const bool dead = is_dead(c, d);
          auto poll = [&] {
            if (flag_arrived(v = ld_acquire_sys(f), seq)) return true;
            __nanosleep(32);  // leave issue slots and L2 to the senders
            return false;
          };
          arrived = !dead && spin_wait(poll, c.timeout_ns);
          if (!arrived) {
            if (!dead && lane == 0) raise_timeout(c, kWaitCombineRow, d, seq);
            continue;
          }
        }
        if (flag_failed(v, seq)) {  // d had no expert_out rows to send, or timed out
          arrived = false;
          if (lane == 0 && (v & kFlagFatal) != 0) {
            raise_fatal(c, kErrPeerFailed, kWaitCombineRow, d, seq);
          } else if (lane == 0) {
            raise_device_error(c.error, kErrPeerRowsMissing, c.rank, d, int64_t(seq));
          }
        }
      }
      if (!arrived) continue;
      if (!kExpanded && p.combined_weights != nullptr && piece == 0 && lane < p.num_weights) {
        // Each lane acquired every contributing peer's flag itself (above), so its comb_w loads
        // follow the peer's stores; plain loads (written during this kernel: no nc cache).
        const float* comb_w = reinterpret_cast<const float*>(local + c.layout.comb_w);
        float w = 0.0f;
        for (uint32_t m = ranks; m != 0; m &= m - 1) {
          const int d = __ffs(int(m)) - 1;
          w += d == c.rank
                   ? p.topk_weights[int64_t(p.send_slot[t * R + d]) * p.num_weights + lane]
                   : comb_w[(int64_t(d) * p.max_tokens + t) * p.top_k + lane];
        }
        p.combined_weights[t * p.num_weights + lane] = w;
      }
      const int num_sources = num_bias + __popc(ranks);
      // Source i in the reference's order: bias0, bias1, then contributing ranks ascending.
      auto source = [&](int i, bool& coherent) -> const int4* {
        coherent = false;
        if (p.bias0 != nullptr && i-- == 0) return reinterpret_cast<const int4*>(p.bias0) + t * n16;
        if (p.bias1 != nullptr && i-- == 0) return reinterpret_cast<const int4*>(p.bias1) + t * n16;
        const int d = int(__fns(ranks, 0, i + 1));
        if (!kExpanded && d == c.rank) {
          return reinterpret_cast<const int4*>(p.expert_out) + int64_t(p.send_slot[t * R + d]) * n16;
        }
        coherent = true;  // written by a peer during this kernel: no non-coherent cache
        return comb_x + (int64_t(d) * p.max_tokens + t) * n16;
      };
      const int64_t v_end = min(n16, (piece + 1) * kPieceVecs);
      for (int64_t v0 = piece * kPieceVecs; v0 < v_end; v0 += 32 * kVec) {
        float acc[kVec][8];
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
        }
        for (int g = 0; g < num_sources; g += kGroup) {
          int4 q[kGroup][kVec];
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            if (g + k < num_sources) {
              bool coherent;
              const int4* row = source(g + k, coherent);
#pragma unroll
              for (int u = 0; u < kVec; ++u) {
                const int64_t v = v0 + u * 32 + lane;
                if (v < v_end) q[k][u] = coherent ? row[v] : ld_stream(row + v);
              }
            }
          }
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            if (g + k < num_sources) {
#pragma unroll
              for (int u = 0; u < kVec; ++u) add_bf16x8(acc[u], q[k][u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          const int64_t v = v0 + u * 32 + lane;
          if (v < v_end) reinterpret_cast<int4*>(p.out)[t * n16 + v] = pack_bf16x8(acc[u]);
        }
      }
    }
  }
  finish_block(c, seq);
}

// ---------------------------------------------------------------------------------------------
// Cached dispatch: the layout of the last uncached dispatch is still in place (send_slot here;
// num_recv, the own range, tokens per expert and the received metadata at every destination),
// so only payload rows move.
//  1. entry: block 0 raises kFlagEntry = seq at every peer; every block waits until every peer
//     has entered this call (the role the count exchange plays in an uncached dispatch): a peer's
//     rows of the previous call are no longer being read when ours land there.
//  2. scatter: one warp per (token, destination) with send_slot >= 0 copies the row to that row
//     index at the destination (the row's metadata there is unchanged since the layout's call).
//     Rows stay with the block of their token: claiming them one at a time (work_claim, as
//     combine's store-back does) measured 331.1 instead of 332 us at T=8192 but 16.8 instead of
//     12.8 us at T=128, where 1,024 warps contend for the counter for 256 rows.
//     An expanded layout: one warp per (token, selection) with a row in expand_rows, then, with
//     zero_padding, this rank zeroes its own padding rows again (none where it overflowed: its
//     num_recv is 0).
//  3. the last block raises kFlagDone at every peer and waits for all peers' done, as dispatch.
template <bool kAccumulateStats>
__global__ void __launch_bounds__(kThreads, 1) cached_dispatch_kernel(const CachedDispatchParams p) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const uint64_t seq = *reinterpret_cast<volatile uint64_t*>(&c.state->sequence) + 1;
  if (is_broken(c)) return;
  if (layout_mismatch(c, p.layout_id)) {
    finish_block(c, seq);
    return;
  }
  if (layout_overflowed(c, p.max_tokens)) return;  // not a call: see layout_overflowed
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int s_ok;
  if (threadIdx.x < R) s_peer[threadIdx.x] = peer_base(c, threadIdx.x);
  __syncthreads();
  char* local = s_peer[c.rank];
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int peer = 0; peer < R; ++peer) {
      st_relaxed_sys(flag_ptr(s_peer[peer], c, kFlagEntry, c.rank), seq);
    }
  }
  if (threadIdx.x == 0) s_ok = wait_all_peers(c, local, kFlagEntry, seq, kWaitCachedEntry);
  __syncthreads();
  if (s_ok) {
    const int64_t chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
    const int64_t t_begin = min(p.num_tokens, int64_t(blockIdx.x) * chunk);
    const int64_t t_end = min(p.num_tokens, t_begin + chunk);
    const int64_t n16 = p.row_bytes / 16;
    if (p.expand_rows != nullptr) {  // one row per (token, selection with a row)
      const int K = p.top_k;
      for (int64_t item = t_begin * K + warp; item < t_end * K; item += kThreads / 32) {
        const int2 at = p.expand_rows[item];
        if (at.y < 0) continue;
        warp_copy_row(reinterpret_cast<int4*>(s_peer[at.y] + c.layout.recv_x) + int64_t(at.x) * n16,
                      static_cast<const int4*>(p.x) + item / K * n16, n16, lane);
      }
      if (p.zero_padding) {  // this rank's padding rows, segments over blocks, rows over warps
        auto* recv_x = reinterpret_cast<int4*>(local + c.layout.recv_x);
        const int64_t num_recv = c.state->num_recv;
        for (int e = blockIdx.x; e < p.num_local_experts; e += gridDim.x) {
          const int64_t end = min(p.segment_begin[e + 1], num_recv);
          for (int64_t row = p.segment_begin[e] + p.tokens_per_expert[e] + warp; row < end;
               row += kThreads / 32) {
            for (int64_t i = lane; i < n16; i += 32) recv_x[row * n16 + i] = make_int4(0, 0, 0, 0);
          }
        }
      }
    } else {
      for (int64_t item = t_begin * R + warp; item < t_end * R; item += kThreads / 32) {
        const int64_t t = item / R;
        const int d = int(item % R);
        const int64_t row = p.send_slot[item];
        if (row < 0) continue;
        warp_copy_row(reinterpret_cast<int4*>(s_peer[d] + c.layout.recv_x) + row * n16,
                      static_cast<const int4*>(p.x) + t * n16, n16, lane);
      }
    }
    if constexpr (kAccumulateStats) {
      if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < p.num_local_experts; e += blockDim.x) {
          p.cumulative_stats[e] += uint32_t(p.tokens_per_expert[e]);
        }
      }
    }
  }
  finish_dispatch(c, s_peer, seq);
}

// ---------------------------------------------------------------------------------------------
// bf16 -> packed fp8 rows, bit-identical to reference::cast_to_fp8 (formula in types.hpp): one
// warp per (token, group of 128 elements), lane l owning elements [4l, 4l + 4) of the group (one
// 8-byte load, one 4-byte store). Every operation is the reference's, in fp32: fmaxf ignores NaN
// like std::fmax, and IEEE division (no fast-math in weft's CUDA flags). The warp of group 0
// also zeroes the row's padding bytes, so whole rows are deterministic.
__global__ void __launch_bounds__(256) cast_fp8_kernel(const CastFp8Params p) {
  const int lane = threadIdx.x % 32;
  const int64_t unit = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t num_groups = p.hidden / kFp8GroupElements;
  if (unit >= p.num_tokens * num_groups) return;
  const int64_t t = unit / num_groups;
  const int64_t g = unit % num_groups;
  const uint2 bits =
      reinterpret_cast<const uint2*>(p.x + t * p.hidden + g * kFp8GroupElements)[lane];
  const float v[4] = {__uint_as_float(bits.x << 16), __uint_as_float(bits.x & 0xffff0000u),
                      __uint_as_float(bits.y << 16), __uint_as_float(bits.y & 0xffff0000u)};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  amax = fmaxf(amax, kFp8MinAmax);
  const float inverse = __fdiv_rn(kFp8E4M3Max, amax);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = __nv_cvt_float_to_fp8(__fmul_rn(v[i], inverse), __NV_SATFINITE, __NV_E4M3);
    packed |= q << (8 * i);
  }
  uint8_t* row = p.out + t * p.row_bytes;
  reinterpret_cast<uint32_t*>(row + g * kFp8GroupElements)[lane] = packed;
  if (lane == 0) {
    reinterpret_cast<float*>(row + p.hidden)[g] = __fdiv_rn(amax, kFp8E4M3Max);
  }
  if (g == 0) {
    for (int64_t b = p.raw_bytes + lane; b < p.row_bytes; b += 32) row[b] = 0;
  }
}

// Construction: every rank writes its flag into every peer's window and waits for all of them,
// which proves the window's LSA mapping works before the first real call.
__global__ void handshake_kernel(const HandshakeParams p) {
  const CommParams& c = p.comm;
  const uint64_t seq = c.state->sequence + 1;
  if (threadIdx.x == 0) {
    for (int peer = 0; peer < c.num_ranks; ++peer) {
      st_relaxed_sys(flag_ptr(peer_base(c, peer), c, kFlagHandshake, c.rank), seq);
    }
    wait_all_peers(c, peer_base(c, c.rank), kFlagHandshake, seq, kWaitHandshake);
    c.state->sequence = seq;
  }
}

template <typename Params>
void launch_cooperative(void (*kernel)(const Params), const Params& params, int num_blocks,
                        std::size_t smem_bytes, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(num_blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  WEFT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

WindowLayout make_window_layout(int num_ranks, int64_t max_tokens, int64_t hidden, int top_k,
                                int num_experts, int expand_factor) {
  const auto R = uint64_t(num_ranks);
  const auto cap = R * uint64_t(max_tokens) * uint64_t(std::max(1, expand_factor));
  const uint64_t expand_rows = expand_factor > 0 ? cap : 0;
  WindowLayout l;
  uint64_t at = 0;
  auto region = [&](uint64_t bytes) {
    const uint64_t start = at;
    at = align_up(at + bytes, 256);
    return start;
  };
  l.flags = region(sizeof(uint64_t) * kNumFlagKinds * kMaxRanks);
  l.count_matrix = region(sizeof(uint64_t) * 2 * R * (R + 1));
  l.expert_matrix = region(sizeof(uint64_t) * 2 * uint64_t(num_experts));
  l.comb_flags = region(sizeof(uint64_t) * R * uint64_t(max_tokens));
  l.recv_src = region(sizeof(int32_t) * 2 * cap);
  l.recv_expert_idx = region(sizeof(int32_t) * cap * uint64_t(top_k));
  l.recv_weights = region(sizeof(float) * cap * uint64_t(top_k));
  l.recv_x = region(2 * cap * uint64_t(hidden));
  l.comb_x = region(2 * R * uint64_t(max_tokens) * uint64_t(hidden));
  l.comb_w = region(sizeof(float) * R * uint64_t(max_tokens) * uint64_t(top_k));
  l.expand_matrix =
      region(expand_factor > 0 ? sizeof(uint64_t) * 2 * R * uint64_t(num_experts) : 0);
  l.expand_chain = region(sizeof(int32_t) * 2 * expand_rows);
  l.total_bytes = at;
  return l;
}

void launch_dispatch(const DispatchParams& params, int num_blocks, cudaStream_t stream) {
  const int R = params.comm.num_ranks;
  const std::size_t smem =
      sizeof(int32_t) * (std::size_t(params.num_experts) + 2 * kMaxRanks +
                         kSubChunkTokens * (1 + 2 * std::size_t(R)) + std::size_t(R) * R +
                         2 * std::size_t(kThreads));
  auto* kernel =
      params.cumulative_stats != nullptr ? dispatch_kernel<true> : dispatch_kernel<false>;
  if (smem > 48 * 1024) {
    WEFT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  launch_cooperative(kernel, params, num_blocks, smem, stream);
}

void launch_expand_dispatch(const ExpandDispatchParams& params, int num_blocks,
                            cudaStream_t stream) {
  const int E = params.dispatch.num_experts;
  const int epr = E / params.dispatch.comm.num_ranks;
  const std::size_t smem =
      sizeof(int64_t) * (std::size_t(E) + std::size_t(epr) + 1) +
      sizeof(int32_t) * (2 * std::size_t(E) + 4 * std::size_t(kExpandSubChunkTokens) *
                                                  std::size_t(params.dispatch.top_k));
  if (smem > 48 * 1024) {
    WEFT_CUDA_CHECK(cudaFuncSetAttribute(expand_dispatch_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  launch_cooperative(expand_dispatch_kernel, params, num_blocks, smem, stream);
}

void launch_cached_dispatch(const CachedDispatchParams& params, int num_blocks,
                            cudaStream_t stream) {
  auto* kernel = params.cumulative_stats != nullptr ? cached_dispatch_kernel<true>
                                                    : cached_dispatch_kernel<false>;
  launch_cooperative(kernel, params, num_blocks, 0, stream);
}

void launch_cast_fp8(const CastFp8Params& params, cudaStream_t stream) {
  const int64_t num_warps = params.num_tokens * (params.hidden / kFp8GroupElements);
  if (num_warps == 0) return;
  constexpr int kCastThreads = 256;
  const int64_t num_blocks = (num_warps * 32 + kCastThreads - 1) / kCastThreads;
  cast_fp8_kernel<<<unsigned(num_blocks), kCastThreads, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_combine(const CombineParams& params, int num_blocks, cudaStream_t stream) {
  auto* kernel = params.expand_info != nullptr ? combine_kernel<true> : combine_kernel<false>;
  launch_cooperative(kernel, params, num_blocks, 0, stream);
}

void launch_handshake(const HandshakeParams& params, cudaStream_t stream) {
  handshake_kernel<<<1, 32, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep::detail
