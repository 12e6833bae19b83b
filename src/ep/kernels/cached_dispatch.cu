// weft::ep cached dispatch: a dispatch that reuses the layout of the last uncached one.
#include <cuda_runtime.h>

#include <cstdint>

#include "params.hpp"
#include "protocol.cuh"

namespace weft::ep::detail {
namespace {

// Cached dispatch: the layout of the last uncached dispatch is still in place (send_slot here;
// num_recv, the own range, tokens per expert and the received metadata at every destination),
// so only payload rows move.
//  1. entry: block 0 raises kFlagEntry = seq at every peer; every block waits until every peer
//     has entered this call (the role the count exchange plays in an uncached dispatch): a peer's
//     rows of the previous call are no longer being read when ours land there.
//  2. scatter: one warp per (token, destination) with send_slot >= 0 copies the row to that row
//     index at the destination (the row's metadata there is unchanged since the layout's call).
//     Rows stay with the block of their token, not claimed one at a time as combine's store-back
//     is (at small T the warps would contend for the counter: docs/perf-ep.md, "Combine's
//     store-back is claimed").
//     An expanded layout: one warp per (token, selection) with a row in expand_rows, then, with
//     zero_padding, this rank zeroes its own padding rows again (none where it overflowed: its
//     num_recv is 0).
//  3. the last block raises kFlagDone at every peer and waits for all peers' done, as dispatch.

// Scatter of an expanded layout: one warp per (token, selection with a row) in expand_rows, then,
// with zero_padding, this rank zeroes its own padding rows again.
__device__ void send_expanded_rows(const CachedDispatchParams& p, char* const* peer,
                                   TokenChunk chunk) {
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const int64_t n16 = p.x.row_bytes / 16;
  const int K = p.top_k;
  for (int64_t item = chunk.begin * K + threadIdx.x / 32; item < chunk.end * K;
       item += kThreads / 32) {
    const int2 at = p.expand_rows[item];
    if (at.y < 0) continue;
    warp_send_row(reinterpret_cast<int4*>(peer[at.y] + c.layout.recv_x) + int64_t(at.x) * n16,
                  p.x, item / K, lane);
  }
  if (!p.zero_padding) return;
  // Segments over blocks, rows over warps; none where this rank overflowed (num_recv is 0).
  auto* recv_x = reinterpret_cast<int4*>(peer[c.rank] + c.layout.recv_x);
  const int64_t num_recv = c.state->num_recv;
  for (int e = blockIdx.x; e < p.num_local_experts; e += gridDim.x) {
    const int64_t end = min(p.segment_begin[e + 1], num_recv);
    for (int64_t row = p.segment_begin[e] + p.tokens_per_local_expert[e] + threadIdx.x / 32;
         row < end; row += kThreads / 32) {
      for (int64_t i = lane; i < n16; i += 32) recv_x[row * n16 + i] = make_int4(0, 0, 0, 0);
    }
  }
}

// Scatter of a deduplicated layout: one warp per (token, destination) with send_slot >= 0 (with
// defer_own_rows, none to this rank: copy_out writes those).
__device__ void send_rows(const CachedDispatchParams& p, char* const* peer, TokenChunk chunk) {
  const CommParams& c = p.comm;
  const int R = c.num_ranks;
  if (p.defer_own_rows && R == 1) return;  // every row is an own row: nothing to send
  const int lane = threadIdx.x % 32;
  const int64_t n16 = p.x.row_bytes / 16;
  for (int64_t item = chunk.begin * R + threadIdx.x / 32; item < chunk.end * R;
       item += kThreads / 32) {
    if (p.defer_own_rows && item % R == c.rank) continue;  // tested before the slot's load
    const int64_t row = p.send_slot[item];
    if (row < 0) continue;
    warp_send_row(reinterpret_cast<int4*>(peer[item % R] + c.layout.recv_x) + row * n16, p.x,
                  item / R, lane);
  }
}

template <bool kAccumulateStats>
__global__ void __launch_bounds__(kThreads, 1)
    cached_dispatch_kernel(const CachedDispatchParams p) {
  const CommParams& c = p.comm;
  const CallEntry entry = enter_call(c);
  const uint64_t seq = entry.seq;
  if (seq == 0) return;
  if (layout_mismatch(c, entry, p.layout_id)) {
    finish_block(c, seq);
    return;
  }
  if (layout_overflowed(c, entry, p.max_tokens)) return;  // not a call: see layout_overflowed
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int s_ok;
  load_peers(c, entry, s_peer);
  if (blockIdx.x == 0 && threadIdx.x == 0) raise_at_all_peers(c, s_peer, kFlagEntry, seq);
  if (threadIdx.x == 0) {
    s_ok = wait_all_peers(c, s_peer[c.rank], kFlagEntry, seq, kWaitCachedEntry);
  }
  __syncthreads();
  if (s_ok) {
    const TokenChunk chunk = block_chunk(p.num_tokens);
    if (p.expand_rows != nullptr) {
      send_expanded_rows(p, s_peer, chunk);
    } else {
      send_rows(p, s_peer, chunk);
    }
    if constexpr (kAccumulateStats) {
      if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < p.num_local_experts; e += blockDim.x) {
          p.cumulative_stats[e] += uint32_t(p.tokens_per_local_expert[e]);
        }
      }
    }
  }
  finish_dispatch(c, s_peer, seq);
}

}  // namespace

void launch_cached_dispatch(const CachedDispatchParams& params, cudaStream_t stream) {
  auto* kernel = params.cumulative_stats != nullptr ? cached_dispatch_kernel<true>
                                                    : cached_dispatch_kernel<false>;
  launch_cooperative(kernel, params, params.num_blocks, 0, stream);
}

}  // namespace weft::ep::detail
