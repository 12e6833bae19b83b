// weft::ep combine: expert outputs back to their tokens' ranks, reduced there.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.hpp"
#include "protocol.cuh"

namespace weft::ep::detail {
namespace {

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

// acc[0..8) = fma(w, the 8 bf16 of one 16-byte vector, acc), in fp32.
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], float w, const int4 q) {
  const uint32_t u[4] = {uint32_t(q.x), uint32_t(q.y), uint32_t(q.z), uint32_t(q.w)};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc[2 * e] = __fmaf_rn(w, __uint_as_float(u[e] << 16), acc[2 * e]);
    acc[2 * e + 1] = __fmaf_rn(w, __uint_as_float(u[e] & 0xffff0000u), acc[2 * e + 1]);
  }
}

// One warp: dst[v] = bf16(sum of the num_rows rows of `rows` whose indices lanes 0..num_rows-1
// hold in `lane_row`), summed in fp32 from 0 in lane order and rounded once to nearest even: the
// reference's per-destination partial sum of an expanded dispatch, for the vectors
// [v_begin, v_end) of rows of n16 vectors. kWeighted: each row's term is
// fma(lane_weight of its lane, row, acc) (reference::combine_weighted).
template <bool kWeighted>
__device__ void warp_sum_rows(int4* __restrict__ dst, const int4* __restrict__ rows,
                              int32_t lane_row, float lane_weight, int num_rows, int64_t n16,
                              int64_t v_begin, int64_t v_end, int lane) {
  // Each lane owns kCols vectors per step and loads kRows rows of each before adding, so
  // kCols * kRows 16-byte loads per lane are in flight (the walk is otherwise latency-bound).
  constexpr int kRows = 4, kCols = 4;
  for (int64_t v0 = v_begin; v0 < v_end; v0 += 32 * kCols) {  // uniform: the shuffles need every lane
    float acc[kCols][8];
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[k][e] = 0.0f;
    }
    for (int i0 = 0; i0 < num_rows; i0 += kRows) {
      int4 q[kRows][kCols];
      float w[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int32_t r = __shfl_sync(0xffffffffu, lane_row, (i0 + u) & 31);
        w[u] = __shfl_sync(0xffffffffu, lane_weight, (i0 + u) & 31);
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          const int64_t v = v0 + k * 32 + lane;
          if (i0 + u < num_rows && v < v_end) q[u][k] = ld_stream(rows + int64_t(r) * n16 + v);
        }
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          if (i0 + u < num_rows && v0 + k * 32 + lane < v_end) {
            if constexpr (kWeighted) {
              fma_bf16x8(acc[k], w[u], q[u][k]);
            } else {
              add_bf16x8(acc[k], q[u][k]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int64_t v = v0 + k * 32 + lane;
      if (v < v_end) dst[v] = pack_bf16x8(acc[k]);
    }
  }
}

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

//
// The store-back rows go out in batches of up to kMaxSendBatch consecutive rows, which the send
// warps claim one at a time (work_claim: a fixed share per warp would leave the slowest blocks'
// rows, and the reduce of their tokens, to the end); one system fence per batch (lane 0, after
// the warp's stores), then lane 0 marks each row's slot as landed. With few rows (small T) a
// batch is one row, so that every row has its own warp and all are in flight.
constexpr int kMaxSendBatch = 4;

// What the send and reduce warps of one block share.
struct CombineCall {
  uint64_t seq;
  char* const* peer;     // [R] window bases (shared memory)
  const int2* recv_src;  // [cap] (source rank, source token) of every received row
  int32_t num_recv;
  int64_t n16;  // 16-byte vectors per row
  __device__ bool source_in_range(const CombineParams& p, int2 src) const {
    return src.x >= 0 && src.x < p.comm.num_ranks && src.y >= 0 && src.y < p.max_tokens;
  }
  // The flag of a received row's (source, token) at the source, or null (reported) where the
  // source is out of range: rows are sent only to sources that exist.
  __device__ uint64_t* source_flag(const CombineParams& p, int64_t j, int2 src) const {
    if (!source_in_range(p, src)) {
      raise_device_error(p.comm.error, kErrBadSource, p.comm.rank, j, src.x, src.y);
      return nullptr;
    }
    return reinterpret_cast<uint64_t*>(peer[src.x] + p.comm.layout.comb_flags) +
           int64_t(p.comm.rank) * p.max_tokens + src.y;
  }
};

// The call's checks before any row moves (every thread): true where the kernel is done.
// A layout that is not the one in place, or an expanded dispatch that overflowed at some rank:
// out unwritten, the call number advances. A layout whose dispatch moved no rows (some T over
// max_tokens): not a call at all (see layout_overflowed).
template <bool kExpanded>
__device__ bool skip_call(const CombineParams& p, const CallEntry& entry) {
  const CommParams& c = p.comm;
  if (layout_mismatch(c, entry, p.layout_id)) {
    finish_block(c, entry.seq);
    return true;
  }
  if (layout_overflowed(c, entry, p.max_tokens)) return true;
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
      finish_block(c, entry.seq);
      return true;
    }
  }
  return false;
}

// Send warps where expert_out lacks rows or the entry wait timed out: every row that would have
// gone out (expanded: every chain head, the own rank's too) gets its flag with `mark` and no
// payload, so that peers report this rank at once instead of timing out.
template <bool kExpanded>
__device__ void mark_rows_failed(const CombineParams& p, const CombineCall& call, uint64_t mark) {
  const CommParams& c = p.comm;
  const int num_send_threads = p.num_send_warps * 32;
  const int2* chain = reinterpret_cast<const int2*>(call.peer[c.rank] + c.layout.expand_chain);
  const int64_t own_begin = c.state->own_begin;
  const int64_t own_count = kExpanded ? 0 : c.state->own_count;
  for (int64_t r = int64_t(blockIdx.x) * num_send_threads + threadIdx.x;
       r < int64_t(call.num_recv) - own_count; r += int64_t(gridDim.x) * num_send_threads) {
    const int64_t j = r < own_begin || kExpanded ? r : r + own_count;
    if (kExpanded && chain[j].y == 0) continue;
    if (uint64_t* flag = call.source_flag(p, j, call.recv_src[j])) st_relaxed_sys(flag, mark);
  }
}

// A received row's weight in a source-weighted combine: 0 + the source's weights of the
// selections the row marks (k ascending), read from the source's window (written before its
// entry flag, which the caller's block waited for).
__device__ float source_row_weight(const CombineParams& p, const CombineCall& call, int32_t row,
                                   int2 src) {
  const CommParams& c = p.comm;
  const int32_t* idx =
      reinterpret_cast<const int32_t*>(call.peer[c.rank] + c.layout.recv_expert_idx) +
      int64_t(row) * p.top_k;
  const volatile float* w =
      reinterpret_cast<const volatile float*>(call.peer[src.x] + c.layout.comb_w) +
      int64_t(src.y) * p.top_k;
  float weight = 0.0f;
  for (int k = 0; k < p.top_k; ++k) {
    if (idx[k] >= 0) weight += w[k];
  }
  return weight;
}

// One warp: the vectors [v_begin, v_end) of the sum of the chain that row j heads (its source
// src in range), into the source's comb_x row of this rank. A chain ascends and has at most
// min(top_k, E/R) <= 32 rows; the walk is bounded by that and by num_recv regardless.
__device__ void sum_chain(const CombineParams& p, const CombineCall& call, const int2* chain,
                          int32_t j, int2 src, int64_t v_begin, int64_t v_end, int lane) {
  int32_t lane_row = -1;  // lane i: the chain's i-th row
  int num_rows = 0;
  for (int32_t r = j; r >= 0 && r < call.num_recv && num_rows < 32; r = chain[r].x) {
    if (lane == num_rows) lane_row = r;
    ++num_rows;
  }
  int4* dst = reinterpret_cast<int4*>(call.peer[src.x] + p.comm.layout.comb_x) +
              (int64_t(p.comm.rank) * p.max_tokens + src.y) * call.n16;
  const auto* y = reinterpret_cast<const int4*>(p.expert_out);
  if (p.source_weighted) {
    const float lane_weight = lane_row >= 0 ? source_row_weight(p, call, lane_row, src) : 0.0f;
    warp_sum_rows<true>(dst, y, lane_row, lane_weight, num_rows, call.n16, v_begin, v_end, lane);
  } else {
    warp_sum_rows<false>(dst, y, lane_row, 0.0f, num_rows, call.n16, v_begin, v_end, lane);
  }
}

// Send warps, expanded: every row that heads its (source, token)'s chain here sends the chain's
// sum to the source's comb_x[rank][token] (padding rows and chain members other than the head
// are skipped). A claim covers up to kMaxSendBatch rows: most rows head a chain, and few per
// claim spread a small call over many warps.
__device__ void send_chain_sums(const CombineParams& p, const CombineCall& call) {
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const int2* chain = reinterpret_cast<const int2*>(call.peer[c.rank] + c.layout.expand_chain);
  const int64_t num_recv = call.num_recv;
  const int total_warps = int(gridDim.x) * p.num_send_warps;
  const int64_t batch =
      min(int64_t(kMaxSendBatch), max(int64_t(1), (num_recv + total_warps - 1) / total_warps));
  const int64_t num_batches = (num_recv + batch - 1) / batch;
  for (int64_t b = work_claim(c, lane); b < num_batches; b = work_claim(c, lane)) {
    const int64_t r0 = b * batch;
    const int64_t r1 = min(num_recv, r0 + batch);
    // Bit i: row r0 + i heads its chain (the same mask in every lane). A batch of padding rows
    // and chain members needs no fence.
    const uint32_t heads = __ballot_sync(0xffffffffu, r0 + lane < r1 && chain[r0 + lane].y != 0);
    for (uint32_t rest = heads; rest != 0; rest &= rest - 1) {
      const int64_t j = r0 + __ffs(int(rest)) - 1;
      const int2 src = call.recv_src[j];
      if (!call.source_in_range(p, src)) continue;  // reported with the flags below
      sum_chain(p, call, chain, int32_t(j), src, 0, call.n16, lane);
    }
    __syncwarp();
    if (lane == 0 && heads != 0) {
      __threadfence_system();  // the warp's row stores (ordered by __syncwarp) before flags
      for (uint32_t rest = heads; rest != 0; rest &= rest - 1) {
        const int64_t j = r0 + __ffs(int(rest)) - 1;
        if (uint64_t* flag = call.source_flag(p, j, call.recv_src[j]))
          st_relaxed_sys(flag, call.seq);
      }
    }
    __syncwarp();
  }
}

// Send warps, expanded with fixed-stride segments (sparse_rows: mostly padding rows and few
// chains, as in a decode step), in two phases over every send warp of the grid, since one warp
// summing a whole chain alone is bound by its own issue rate and a small call has too few chains
// to keep the other warps busy (docs/perf-ep.md):
//  1. find: each warp takes 32-row batches (one load per lane) and appends the rows heading a
//     chain to sparse_heads (DeviceState::num_sparse_heads counts them; each entry's done count
//     starts at 0); then a barrier over the send warps of every block.
//  2. sum: units of (head, kSparseUnitVecs vectors) spread over the warps; each unit's warp walks
//     the chain, sums its vectors (the rows in chain order, as the one-warp path: bit-identical),
//     fences, and counts the unit done; the warp that completes a head fences again (after the
//     atomic that observed every other unit's fenced count) and raises the head's flag.
__device__ void send_chain_sums_sparse(const CombineParams& p, const CombineCall& call) {
  constexpr int64_t kSparseUnitVecs = 64;
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const int64_t warp = int64_t(blockIdx.x) * p.num_send_warps + threadIdx.x / 32;
  const int64_t num_warps = int64_t(gridDim.x) * p.num_send_warps;
  const int2* chain = reinterpret_cast<const int2*>(call.peer[c.rank] + c.layout.expand_chain);
  const int64_t num_recv = call.num_recv;
  for (int64_t b = warp; b * 32 < num_recv; b += num_warps) {
    const int64_t r = b * 32 + lane;
    const uint32_t heads = __ballot_sync(0xffffffffu, r < num_recv && chain[r].y != 0);
    if (heads == 0) continue;
    uint32_t first = 0;
    if (lane == 0) first = atomicAdd(&c.state->num_sparse_heads, uint32_t(__popc(heads)));
    first = __shfl_sync(0xffffffffu, first, 0);
    // More heads than (source, token) pairs: not this layout's chains (reported); those past
    // the list are dropped, and their sources time out waiting for them.
    if (lane == 0 && int64_t(first) + __popc(heads) > p.max_sparse_heads) {
      raise_device_error(c.error, kErrTooManyHeads, c.rank, int64_t(first) + __popc(heads),
                         p.max_sparse_heads);
    }
    if (lane < __popc(heads) && int64_t(first) + lane < p.max_sparse_heads) {
      p.sparse_heads[first + lane] = make_int2(int(b * 32 + __fns(heads, 0, lane + 1)), 0);
    }
  }
  const int num_send_threads = p.num_send_warps * 32;
  if (!grid_barrier_of(c, call.seq, [&] {
        asm volatile("bar.sync 1, %0;" ::"r"(num_send_threads) : "memory");
      })) {
    return;  // reported; the heads' sources time out waiting for them
  }
  const int64_t num_heads =
      min(p.max_sparse_heads,
          int64_t(*reinterpret_cast<volatile uint32_t*>(&c.state->num_sparse_heads)));
  const int64_t units_per_head = (call.n16 + kSparseUnitVecs - 1) / kSparseUnitVecs;
  for (int64_t unit = warp; unit < num_heads * units_per_head; unit += num_warps) {
    const int64_t h = unit / units_per_head;
    const int64_t piece = unit % units_per_head;
    const int32_t j = __ldcg(&p.sparse_heads[h]).x;  // written by other blocks in phase 1
    const int2 src = call.recv_src[j];
    if (!call.source_in_range(p, src)) {
      if (piece == 0 && lane == 0) call.source_flag(p, j, src);  // reports it
      continue;
    }
    const int64_t v_begin = piece * kSparseUnitVecs;
    sum_chain(p, call, chain, j, src, v_begin, min(call.n16, v_begin + kSparseUnitVecs), lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();  // the warp's row stores (ordered by __syncwarp) before its count
      if (atomicAdd(reinterpret_cast<uint32_t*>(&p.sparse_heads[h].y), 1u) ==
          uint32_t(units_per_head - 1)) {
        __threadfence_system();
        st_relaxed_sys(call.source_flag(p, j, src), call.seq);
      }
    }
    __syncwarp();
  }
}

// Send warps, deduplicated: only rows from peers go out (the own rank's rows, [own_begin,
// own_begin + own_count) of the received order, are reduced locally straight from expert_out):
// remote row r is received row j = r < own_begin ? r : r + own_count. The claims start at the
// rows of source rank + 1 and wrap around (remote row (r + own_begin) mod num_remote), so that at
// the start of a call the ranks store back to different peers instead of all to rank 0
// (docs/ep.md "Store-back order"; at 2 ranks the order is the received one). With topk_weights,
// the row's weights go to comb_w before the same fence.
__device__ void send_rows(const CombineParams& p, const CombineCall& call) {
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const int64_t own_begin = c.state->own_begin;
  const int64_t own_count = c.state->own_count;
  const int64_t num_remote = int64_t(call.num_recv) - own_count;
  const int total_warps = int(gridDim.x) * p.num_send_warps;
  const int64_t batch =
      min(int64_t(kMaxSendBatch), max(int64_t(1), (num_remote + total_warps - 1) / total_warps));
  const int64_t num_batches = (num_remote + batch - 1) / batch;
  auto received_row = [&](int64_t r) {
    r = (r + own_begin) % num_remote;
    return r < own_begin ? r : r + own_count;
  };
  // The order record (DeviceState::first_store_peer): one store per call, by the warp that
  // claims batch 0, or by block 0 where there is no batch (the two never both happen).
  if (num_batches == 0 && blockIdx.x == 0 && threadIdx.x == 0) c.state->first_store_peer = -1;
  for (int64_t b = work_claim(c, lane); b < num_batches; b = work_claim(c, lane)) {
    if (b == 0 && lane == 0) c.state->first_store_peer = call.recv_src[received_row(0)].x;
    const int64_t r0 = b * batch;
    const int64_t r1 = min(num_remote, r0 + batch);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = received_row(r);
      const int2 src = call.recv_src[j];
      if (!call.source_in_range(p, src)) continue;
      const int64_t slot = int64_t(c.rank) * p.max_tokens + src.y;
      warp_copy_row(reinterpret_cast<int4*>(call.peer[src.x] + c.layout.comb_x) + slot * call.n16,
                    reinterpret_cast<const int4*>(p.expert_out) + j * call.n16, call.n16, lane);
      if (p.topk_weights != nullptr && lane < p.num_weights) {
        reinterpret_cast<float*>(call.peer[src.x] + c.layout.comb_w)[slot * p.top_k + lane] =
            p.topk_weights[j * p.num_weights + lane];
      }
    }
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();  // the warp's row stores (ordered by __syncwarp) before flags
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t j = received_row(r);
        if (uint64_t* flag = call.source_flag(p, j, call.recv_src[j]))
          st_relaxed_sys(flag, call.seq);
      }
    }
    __syncwarp();
  }
}

// Reduce warp: waits for the rows of token t from every contributing peer (bit d of the result:
// rank d contributes). arrived = false where a peer timed out or failed the call. A call costs
// one timeout however many peers are missing: once a wait of this call timed out (this rank is
// broken: the call has failed and every later one does nothing) no wait starts again, so with
// R - 1 peers that never enter the reduce does not wait out one timeout per peer in turn.
template <bool kExpanded>
__device__ uint32_t wait_token_rows(const CombineParams& p, const CombineCall& call, int64_t t,
                                    bool& arrived) {
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const uint64_t* comb_flags =
      reinterpret_cast<const uint64_t*>(call.peer[c.rank] + c.layout.comb_flags);
  uint32_t ranks = 0;
  arrived = true;
  for (int d = 0; d < c.num_ranks; ++d) {
    if (p.send_slot[t * c.num_ranks + d] < 0) continue;
    ranks |= 1u << d;
    if ((!kExpanded && d == c.rank) || !arrived) continue;
    const uint64_t* f = comb_flags + int64_t(d) * p.max_tokens + t;
    uint64_t v = ld_acquire_sys(f);
    if (!flag_arrived(v, call.seq)) {
      const bool dead = is_dead(c, d) || is_broken(c);
      auto poll = [&] {
        if (flag_arrived(v = ld_acquire_sys(f), call.seq)) return true;
        __nanosleep(32);  // leave issue slots and L2 to the senders
        return false;
      };
      arrived = !dead && spin_wait(poll, c.timeout_ns);
      if (!arrived) {
        if (!dead && lane == 0) raise_timeout(c, kWaitCombineRow, d, call.seq);
        continue;
      }
    }
    if (flag_failed(v, call.seq)) {  // d had no expert_out rows to send, or timed out
      arrived = false;
      if (lane == 0 && (v & kFlagFatal) != 0) {
        raise_fatal(c, kErrPeerFailed, kWaitCombineRow, d, call.seq);
      } else if (lane == 0) {
        raise_device_error(c.error, kErrPeerRowsMissing, c.rank, d, int64_t(call.seq));
      }
    }
  }
  return ranks;
}

// Reduce warp, lanes < num_weights: combined_weights of token t = 0 + the contributing ranks'
// weights in ascending rank order. Each lane acquired every contributing peer's flag itself
// (wait_token_rows), so its comb_w loads follow the peer's stores; plain loads (written during
// this kernel: no nc cache).
__device__ void sum_weights(const CombineParams& p, const CombineCall& call, int64_t t,
                            uint32_t ranks) {
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  if (lane >= p.num_weights) return;
  const float* comb_w = reinterpret_cast<const float*>(call.peer[c.rank] + c.layout.comb_w);
  float w = 0.0f;
  for (uint32_t m = ranks; m != 0; m &= m - 1) {
    const int d = __ffs(int(m)) - 1;
    w += d == c.rank
             ? p.topk_weights[int64_t(p.send_slot[t * c.num_ranks + d]) * p.num_weights + lane]
             : comb_w[(int64_t(d) * p.max_tokens + t) * p.top_k + lane];
  }
  p.combined_weights[t * p.num_weights + lane] = w;
}

// Reduce warp: out[t] vectors [v_begin, v_end) = bias0 + bias1 + the contributing ranks' rows in
// ascending rank order, summed in fp32 and rounded once (the reference's order). Per step each
// lane loads kVec vectors of up to kGroup sources before adding, to keep enough bytes in flight.
template <bool kExpanded>
__device__ void reduce_piece(const CombineParams& p, const CombineCall& call, int64_t t,
                             uint32_t ranks, int64_t v_begin, int64_t v_end) {
  constexpr int kVec = 2;
  constexpr int kGroup = 2;
  const CommParams& c = p.comm;
  const int lane = threadIdx.x % 32;
  const int64_t n16 = call.n16;
  const int4* comb_x = reinterpret_cast<const int4*>(call.peer[c.rank] + c.layout.comb_x);
  const int num_sources = (p.bias0 != nullptr) + (p.bias1 != nullptr) + __popc(ranks);
  // Source i in the reference's order: bias0, bias1, then contributing ranks ascending.
  auto source = [&](int i, bool& coherent) -> const int4* {
    coherent = false;
    if (p.bias0 != nullptr && i-- == 0) return reinterpret_cast<const int4*>(p.bias0) + t * n16;
    if (p.bias1 != nullptr && i-- == 0) return reinterpret_cast<const int4*>(p.bias1) + t * n16;
    const int d = int(__fns(ranks, 0, i + 1));
    if (!kExpanded && d == c.rank) {
      return reinterpret_cast<const int4*>(p.expert_out) +
             int64_t(p.send_slot[t * c.num_ranks + d]) * n16;
    }
    coherent = true;  // written by a peer during this kernel: no non-coherent cache
    return comb_x + (int64_t(d) * p.max_tokens + t) * n16;
  };
  for (int64_t v0 = v_begin; v0 < v_end; v0 += 32 * kVec) {
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

// Reduce warps: units of (token, piece of kPieceVecs 16-byte vectors), so even a few tokens
// spread over many warps.
template <bool kExpanded>
__device__ void reduce_tokens(const CombineParams& p, const CombineCall& call) {
  constexpr int64_t kPieceVecs = 128;
  const int num_reduce_warps = kThreads / 32 - p.num_send_warps;
  const int total_warps = int(gridDim.x) * num_reduce_warps;
  const int64_t num_pieces = (call.n16 + kPieceVecs - 1) / kPieceVecs;
  const int reduce_warp = int(threadIdx.x / 32) - p.num_send_warps;
  for (int64_t unit = int64_t(blockIdx.x) * num_reduce_warps + reduce_warp;
       unit < p.num_tokens * num_pieces; unit += total_warps) {
    const int64_t t = unit / num_pieces;
    const int64_t piece = unit % num_pieces;
    bool arrived = true;
    const uint32_t ranks = wait_token_rows<kExpanded>(p, call, t, arrived);
    if (!arrived) continue;
    if (!kExpanded && p.combined_weights != nullptr && piece == 0) sum_weights(p, call, t, ranks);
    reduce_piece<kExpanded>(p, call, t, ranks, piece * kPieceVecs,
                            min(call.n16, (piece + 1) * kPieceVecs));
  }
}

template <bool kExpanded>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineParams p) {
  const CommParams& c = p.comm;
  const CallEntry entry = enter_call(c);
  const uint64_t seq = entry.seq;
  if (seq == 0 || skip_call<kExpanded>(p, entry)) return;
  __shared__ char* s_peer[kMaxRanks];
  __shared__ int s_ok;
  load_peers(c, entry, s_peer);
  CombineCall call;
  call.seq = seq;
  call.peer = s_peer;
  call.recv_src = reinterpret_cast<const int2*>(s_peer[c.rank] + c.layout.recv_src);
  call.num_recv = entry.num_recv;
  call.n16 = p.hidden * 2 / 16;
  // expert_out has fewer rows than were received, or the wait for the peers' entry timed out:
  // this rank reads none of its rows, sends nothing (out unwritten) and marks the rows it would
  // have sent as failed (kFlagFatal for the timeout).
  const int64_t rows_given =
      p.topk_weights != nullptr ? min(p.expert_out_rows, p.topk_weights_rows) : p.expert_out_rows;
  const bool rows_missing = call.num_recv > rows_given;

  if (blockIdx.x == 0) {
    if (p.source_weighted) {
      // This rank's weights into its comb_w, published with the entry flag: bar.sync orders
      // the block's stores before thread 0's system fence, which is cumulative.
      auto* comb_w = reinterpret_cast<float*>(s_peer[c.rank] + c.layout.comb_w);
      for (int64_t i = threadIdx.x; i < p.num_tokens * p.top_k; i += blockDim.x) {
        comb_w[i] = p.source_weights[i];
      }
      __syncthreads();
      if (threadIdx.x == 0) __threadfence_system();
    }
    if (threadIdx.x == 0) raise_at_all_peers(c, s_peer, kFlagEntry, seq);
  }
  if (int(threadIdx.x / 32) < p.num_send_warps) {
    if (threadIdx.x == 0) {
      s_ok = wait_all_peers(c, s_peer[c.rank], kFlagEntry, seq, kWaitCombineEntry);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(p.num_send_warps * 32) : "memory");
    if (!s_ok || rows_missing) {
      if (s_ok && blockIdx.x == 0 && threadIdx.x == 0) {
        raise_device_error(c.error, kErrTooManyRows, c.rank, call.num_recv, rows_given,
                           int64_t(rows_given < p.expert_out_rows));
      }
      mark_rows_failed<kExpanded>(p, call, seq | kFlagFailed | (s_ok ? 0 : kFlagFatal));
    } else if (kExpanded && p.sparse_rows) {
      send_chain_sums_sparse(p, call);
    } else if (kExpanded) {
      send_chain_sums(p, call);
    } else {
      send_rows(p, call);
    }
  } else if (!rows_missing) {
    reduce_tokens<kExpanded>(p, call);
  }
  finish_block(c, seq);
}

}  // namespace

void launch_combine(const CombineParams& params, cudaStream_t stream) {
  auto* kernel = params.expand_info != nullptr ? combine_kernel<true> : combine_kernel<false>;
  launch_cooperative(kernel, params, params.num_blocks, 0, stream);
}

}  // namespace weft::ep::detail
