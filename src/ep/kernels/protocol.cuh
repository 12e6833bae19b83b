// The cross-rank protocol every weft::ep kernel speaks, written once: memory-ordered loads and
// stores, flags, waits, the grid barrier, the end of a call (device code, included by each kernel
// family's .cu).
//
// Every call (dispatch, combine, the construction handshake) has a number
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
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "params.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.cuh"
#include "weft/ep/types.hpp"

namespace weft::ep::detail {

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

__device__ __forceinline__ uint64_t* flag_ptr(char* base, const CommParams& c, int kind, int src) {
  return reinterpret_cast<uint64_t*>(base + c.layout.flags) + kind * kMaxRanks + src;
}

// A fatal error on this rank (kErrTimeout, kErrPeerFailed): recorded apart from bad data, and
// the rank is broken from now on (every later kernel returns at once, so nothing runs on state a
// failed call left, such as a grid barrier's arrivals). peer >= 0: the rest of this kernel skips
// its waits for it.
__device__ inline void raise_fatal(const CommParams& c, uint32_t code, int64_t what, int peer,
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
__device__ inline bool wait_all_peers(const CommParams& c, char* local, int kind, uint64_t seq,
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

// Barrier over the blocks of this (cooperative) grid; false on timeout, or where this rank broke
// (a fatal error raised by another block: that block may never arrive, and its error is the one
// to report). Every thread that block_sync() synchronises calls it (one group per block: all
// threads, or the send warps of a named barrier); thread 0 of the block must be one of them. One
// barrier runs at a time.
template <typename BlockSync>
__device__ inline bool grid_barrier_of(const CommParams& c, uint64_t seq, BlockSync&& block_sync) {
  __shared__ int ok;
  block_sync();
  if (threadIdx.x == 0) {
    ok = 1;
    DeviceState* st = c.state;
    const uint32_t generation = ld_acquire_gpu(&st->barrier_generation);
    __threadfence();
    if (atomicAdd(&st->barrier_count, 1u) == gridDim.x - 1) {
      atomicExch(&st->barrier_count, 0u);
      __threadfence();
      atomicAdd(&st->barrier_generation, 1u);
    } else {
      const bool passed = spin_wait(
          [&] { return ld_acquire_gpu(&st->barrier_generation) != generation || is_broken(c); },
          c.timeout_ns);
      if (!passed) {
        raise_timeout(c, kWaitGridBarrier, -1, seq);
        ok = 0;
      } else if (ld_acquire_gpu(&st->barrier_generation) == generation) {
        ok = 0;  // broken: reported by whoever broke it
      }
    }
    __threadfence();
  }
  block_sync();
  return ok != 0;
}

// The barrier over every thread of the grid.
__device__ inline bool grid_barrier(const CommParams& c, uint64_t seq) {
  return grid_barrier_of(c, seq, [] { __syncthreads(); });
}

// Called by every block once its last store is issued. The last block to arrive resets the
// counter, advances the call number and returns true (all threads of that block).
__device__ inline bool finish_block(const CommParams& c, uint64_t seq) {
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
      atomicExch(&c.state->num_sparse_heads, 0u);
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

// What a call reads of this rank's state at its entry, loaded together: one round trip to
// memory rather than one per field, each behind the last. Every field was written by earlier
// kernels only (this kernel's last block advances `sequence` once every block has entered), so
// plain loads see their values.
struct CallEntry {
  uint64_t seq;             // the previous call's number + 1; 0 where this rank is broken (a
                            // fatal error earlier): the kernel then does nothing
  uint64_t layout_id;       // DeviceState::layout_id (combine and cached dispatch check it)
  int32_t tokens_required;  // DeviceState::tokens_required (the same)
  int32_t num_recv;         // DeviceState::num_recv: the rows of the layout in place
  char* peer;               // thread r < num_ranks: rank r's window base (load_peers)
};
__device__ __forceinline__ CallEntry enter_call(const CommParams& c) {
  const DeviceState& st = *c.state;
  const uint64_t previous = st.sequence;
  const uint32_t broken = st.broken;
  CallEntry e;
  e.layout_id = st.layout_id;
  e.tokens_required = st.tokens_required;
  e.num_recv = st.num_recv;
  e.peer = int(threadIdx.x) < c.num_ranks ? c.peers[threadIdx.x] : nullptr;
  e.seq = broken != 0 ? 0 : previous + 1;
  return e;
}

// Every thread: s_peer[r] = rank r's window base (from the entry's loads), visible to the whole
// block on return.
__device__ __forceinline__ void load_peers(const CommParams& c, const CallEntry& e,
                                           char** s_peer) {
  if (int(threadIdx.x) < c.num_ranks) s_peer[threadIdx.x] = e.peer;
  __syncthreads();
}

// Combine and cached dispatch (every thread): is the layout in place not the one the call was
// made for (a layout the host checked the handle against, but a CUDA graph replayed after another
// dispatch)? Block 0 reports it; the caller then skips the call. Every rank that finds another
// layout skips alike; a peer that did not times out waiting for it.
__device__ inline bool layout_mismatch(const CommParams& c, const CallEntry& e,
                                       uint64_t layout_id) {
  const uint64_t in_place = e.layout_id;
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
__device__ inline bool layout_overflowed(const CommParams& c, const CallEntry& e,
                                         int64_t max_tokens) {
  const int32_t required = e.tokens_required;
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

// One thread: raises this rank's flag of `kind` at every peer with `value`.
__device__ __forceinline__ void raise_at_all_peers(const CommParams& c, char* const* peer, int kind,
                                                   uint64_t value) {
  for (int r = 0; r < c.num_ranks; ++r) st_relaxed_sys(flag_ptr(peer[r], c, kind, c.rank), value);
}

// The end of every dispatch kernel (all threads call it): once the last block has issued its
// stores (finish_block), raise kFlagDone at every peer and wait for every peer's, so that the
// rows this rank receives are complete when the kernel ends. Where a wait of this call timed out
// on this rank (every block's raise precedes its arrival in finish_block), the done flags carry
// kFlagFailed: a peer then reports this rank's failure instead of returning rows never written.
__device__ inline void finish_dispatch(const CommParams& c, char* const* peer, uint64_t seq) {
  if (finish_block(c, seq) && threadIdx.x == 0) {
    const bool failed = is_broken(c);
    // finish_block's system fence (after every block's fence and arrival) orders the rows.
    raise_at_all_peers(c, peer, kFlagDone, seq | (failed ? kFlagFailed : 0));
    if (!failed) wait_all_peers(c, peer[c.rank], kFlagDone, seq, kWaitDispatchDone);
  }
}

__device__ __forceinline__ int64_t load_expert(const DispatchParams& p, int64_t i) {
  return p.topk_idx_int64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                          : static_cast<const int32_t*>(p.topk_idx)[i];
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

// One warp writes row t of `src` to dst (row_bytes at the destination): a plain copy, or the fp8
// pair packed (payload, then the scales read at their strides, then zero padding). Not a cast
// (RowSource::cast_fp8): the expanded dispatch's variant with one casts in shared memory first.
__device__ __forceinline__ void warp_send_row(int4* __restrict__ dst, const RowSource& src,
                                              int64_t t, int lane) {
  if (src.scales == nullptr) {
    const int64_t n16 = src.row_bytes / 16;
    warp_copy_row(dst, static_cast<const int4*>(src.x) + t * n16, n16, lane);
    return;
  }
  warp_copy_row(dst,
                reinterpret_cast<const int4*>(static_cast<const char*>(src.x) + t * src.hidden),
                src.hidden / 16, lane);
  const int64_t num_groups = src.hidden / kFp8GroupElements;
  auto* words = reinterpret_cast<uint32_t*>(dst) + src.hidden / 4;
  const float* scales = src.scales + t * src.scale_token_stride;
  for (int64_t g = lane; g < (src.row_bytes - src.hidden) / 4; g += 32) {
    words[g] = g < num_groups ? __float_as_uint(scales[g * src.scale_group_stride]) : 0u;
  }
}

// A group of at least top_k lanes (a warp, or metadata_lanes() of one) writes token t's metadata
// into row `row` of the window at `base` (rank dest's): (lanes k < top_k of the group) selection
// k's local expert and weight where in_row(e) says selection k's expert e (valid, in [0,
// num_experts)) belongs to this row (else -1 and 0), and (lane 0) the row's source (this rank,
// t). `lane` is the thread's index in its group; no lane waits for another.
template <typename InRow>
__device__ __forceinline__ void send_metadata(const DispatchParams& p, char* base, int64_t row,
                                              int64_t t, int dest, int epr, int lane,
                                              InRow&& in_row) {
  const CommParams& c = p.comm;
  const int K = p.top_k;
  if (lane < K) {
    const int64_t e = load_expert(p, t * K + lane);
    const bool mine = e >= 0 && e < p.num_experts && in_row(e);
    reinterpret_cast<int32_t*>(base + c.layout.recv_expert_idx)[row * K + lane] =
        mine ? int32_t(e - int64_t(dest) * epr) : -1;
    reinterpret_cast<float*>(base + c.layout.recv_weights)[row * K + lane] =
        mine ? p.topk_weights[t * K + lane] : 0.0f;
  }
  if (lane == 0) reinterpret_cast<int2*>(base + c.layout.recv_src)[row] = make_int2(c.rank, int(t));
}

// One warp pushes token t's row to row `row` of the window at `base`: the payload, then the
// metadata (send_metadata).
template <typename InRow>
__device__ __forceinline__ void warp_send_token(const DispatchParams& p, char* base, int64_t row,
                                                int64_t t, int dest, int epr, int lane,
                                                InRow&& in_row) {
  warp_send_row(reinterpret_cast<int4*>(base + p.comm.layout.recv_x) + row * (p.x.row_bytes / 16),
                p.x, t, lane);
  send_metadata(p, base, row, t, dest, epr, lane, in_row);
}

// The lanes of a group that sends a row's metadata alone: top_k rounded up to a power of two, so
// that a warp holds 32 / metadata_lanes() groups and has that many rows' loads in flight at once.
__device__ __forceinline__ int metadata_lanes(int top_k) {
  int lanes = 1;
  while (lanes < top_k) lanes *= 2;
  return lanes;
}

// Tokens [begin, end) of block blockIdx.x when num_tokens are cut into equal chunks over blocks
// [first_block, gridDim.x); the blocks before first_block get none.
struct TokenChunk {
  int64_t begin;
  int64_t end;
};
__device__ __forceinline__ TokenChunk block_chunk(int64_t num_tokens, int first_block = 0) {
  const int b = int(blockIdx.x) - first_block;
  if (b < 0) return {0, 0};
  const int64_t n = int64_t(gridDim.x) - first_block;
  const int64_t chunk = (num_tokens + n - 1) / n;
  const int64_t begin = min(num_tokens, int64_t(b) * chunk);
  return {begin, min(num_tokens, begin + chunk)};
}

// Carves a kernel's dynamic shared memory into typed arrays, each aligned for its type. The same
// carve runs on the host with base == nullptr, where only `bytes` matters: so a kernel family's
// layout type sizes the launch and carves the kernel from one piece of code.
struct SmemCarver {
  char* base;
  std::size_t bytes = 0;
  template <typename T>
  __host__ __device__ T* take(std::size_t count) {
    bytes = (bytes + alignof(T) - 1) / alignof(T) * alignof(T);
    T* at = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(base) + bytes);
    bytes += sizeof(T) * count;
    return at;
  }
};

// Host: a cooperative launch of `kernel` (every block co-resident) with `smem_bytes` of dynamic
// shared memory, raising the kernel's limit first where it needs more than the default 48 KiB.
// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) of kernel on the current device, where no
// call has set `bytes` or more yet: once, not per launch (the call costs about what a launch
// does).
inline void ensure_dynamic_smem(const void* kernel, std::size_t bytes) {
  static std::mutex mutex;
  static std::vector<std::tuple<const void*, int, std::size_t>> set;  // (kernel, device, bytes)
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  auto it = std::find_if(set.begin(), set.end(), [&](const auto& e) {
    return std::get<0>(e) == kernel && std::get<1>(e) == device;
  });
  if (it != set.end() && std::get<2>(*it) >= bytes) return;
  WEFT_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  if (it == set.end()) {
    set.emplace_back(kernel, device, bytes);
  } else {
    std::get<2>(*it) = bytes;
  }
}

template <typename Params>
inline void launch_cooperative(void (*kernel)(const Params), const Params& params, int num_blocks,
                               std::size_t smem_bytes, cudaStream_t stream) {
  if (smem_bytes > 48 * 1024) {
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem_bytes);
  }
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

}  // namespace weft::ep::detail
