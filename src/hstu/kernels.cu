#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.cuh"
#include "weft/hstu/kernels.hpp"

namespace weft::hstu {
namespace {

constexpr int kBlock = 256;
constexpr int kWarp = 32;

unsigned grid_for(std::int64_t n, int per_block = kBlock, int max_blocks = 65535) {
  return unsigned(std::clamp<std::int64_t>((n + per_block - 1) / per_block, 1, max_blocks));
}

__global__ void count_tokens_kernel(CountTokensParams p) {
  using Reduce = cub::BlockReduce<long long, kBlock>;
  __shared__ Reduce::TempStorage temp;
  long long sum = 0;
  for (int i = int(threadIdx.x); i < p.num_samples; i += kBlock) sum += p.lengths[i];
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) p.out[0] = float(sum);
}

// One block per selected sample.
__global__ void select_samples_kernel(SelectSamplesParams p) {
  const int j = int(blockIdx.x);
  const std::int64_t sample = p.plan[3 * j];
  const std::int64_t src = p.plan[3 * j + 1];
  const std::int64_t dst = p.plan[3 * j + 2];
  const std::int64_t length = p.all_lengths[sample];
  if (threadIdx.x == 0) p.out_lengths[j] = length;
  for (std::int64_t t = threadIdx.x; t < length; t += blockDim.x) {
    p.out_ids[dst + t] = p.all_ids[src + t];
  }
}

// Block d counts, per sample, the tokens owned by rank d.
__global__ void count_by_owner_kernel(PartitionParams p) {
  using Reduce = cub::BlockReduce<long long, kBlock>;
  __shared__ Reduce::TempStorage temp;
  __shared__ long long total;
  const int d = int(blockIdx.x);
  std::int64_t begin = 0;
  if (threadIdx.x == 0) total = 0;
  for (int s = 0; s < p.num_samples; ++s) {
    const std::int64_t end = begin + p.lengths[s];
    long long count = 0;
    for (std::int64_t t = begin + threadIdx.x; t < end; t += kBlock) {
      count += (p.ids[t] % p.world_size == d) ? 1 : 0;
    }
    count = Reduce(temp).Sum(count);
    if (threadIdx.x == 0) {
      p.send_lengths[d * p.num_samples + s] = count;
      total += count;
    }
    __syncthreads();
    begin = end;
  }
  if (threadIdx.x == 0) p.send_counts[d] = total;
}

// Block d writes the tokens owned by d, in token order, after those of owners < d.
__global__ void scatter_by_owner_kernel(PartitionParams p) {
  using Scan = cub::BlockScan<int, kBlock>;
  __shared__ Scan::TempStorage temp;
  __shared__ long long base;
  const int d = int(blockIdx.x);
  if (threadIdx.x == 0) {
    base = 0;
    for (int e = 0; e < d; ++e) base += p.send_counts[e];
  }
  __syncthreads();
  for (std::int64_t chunk = 0; chunk < p.num_tokens; chunk += kBlock) {
    const std::int64_t t = chunk + threadIdx.x;
    const bool mine = t < p.num_tokens && p.ids[t] % p.world_size == d;
    int offset = 0, chunk_total = 0;
    Scan(temp).ExclusiveSum(mine ? 1 : 0, offset, chunk_total);
    if (mine) {
      p.send_ids[base + offset] = p.ids[t];
      p.position[t] = base + offset;
    }
    __syncthreads();
    if (threadIdx.x == 0) base += chunk_total;
    __syncthreads();
  }
}

__global__ void check_lengths_kernel(CheckLengthsParams p) {
  const int peer = int(threadIdx.x);
  if (peer >= p.world_size) return;
  std::int64_t sum = 0;
  for (int s = 0; s < p.num_samples; ++s) sum += p.recv_lengths[peer * p.num_samples + s];
  if (sum != p.recv_counts[peer]) {
    cuda::raise_device_error(p.error, kErrorLengthMismatch, p.rank, peer, sum, p.recv_counts[peer]);
  }
}

__global__ void iota_kernel(std::int32_t* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    out[i] = std::int32_t(i);
  }
}

__global__ void head_flags_kernel(const std::int64_t* sorted, std::int64_t n, std::int32_t* flags) {
  for (std::int64_t j = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; j < n;
       j += std::int64_t(gridDim.x) * blockDim.x) {
    flags[j] = (j == 0 || sorted[j] != sorted[j - 1]) ? 1 : 0;
  }
}

// One warp per sorted position: inverse for every position, the cache row for distinct heads.
__global__ void fill_cache_kernel(PrefetchParams p) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  const std::int64_t num_warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  for (std::int64_t j = warp; j < p.num_ids; j += num_warps) {
    const int u = p.distinct_rank[j] - 1;
    if (lane == 0) p.inverse[p.sorted_arrival[j]] = u;
    const bool head = j == 0 || p.sorted_ids[j] != p.sorted_ids[j - 1];
    if (!head) continue;
    const std::int64_t id = p.sorted_ids[j];
    const std::int64_t row = id / p.world_size;
    if (id % p.world_size != p.rank || row >= p.num_local_rows) {
      if (lane == 0) cuda::raise_device_error(p.error, kErrorForeignId, p.rank, id, p.world_size, p.rank);
      continue;
    }
    const auto* src = reinterpret_cast<const float4*>(p.table + row * p.dim);
    auto* dst = reinterpret_cast<float4*>(p.cache + std::int64_t(u) * p.dim);
    for (int k = lane; k < p.dim / 4; k += kWarp) dst[k] = src[k];
  }
}

__global__ void lookup_kernel(LookupParams p) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  const std::int64_t num_warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  for (std::int64_t k = warp; k < p.num_rows; k += num_warps) {
    const auto* src = reinterpret_cast<const float4*>(p.cache + std::int64_t(p.inverse[k]) * p.dim);
    auto* dst = reinterpret_cast<float4*>(p.rows + k * p.dim);
    for (int c = lane; c < p.dim / 4; c += kWarp) dst[c] = src[c];
  }
}

__global__ void gather_rows_kernel(GatherRowsParams p) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  const std::int64_t num_warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  for (std::int64_t t = warp; t < p.num_tokens; t += num_warps) {
    const auto* src = reinterpret_cast<const float4*>(p.rows + p.position[t] * p.dim);
    __nv_bfloat16* dst = p.x + t * p.dim;
    for (int c = lane; c < p.dim / 4; c += kWarp) {
      const float4 v = src[c];
      reinterpret_cast<__nv_bfloat162*>(dst)[2 * c] = __floats2bfloat162_rn(v.x, v.y);
      reinterpret_cast<__nv_bfloat162*>(dst)[2 * c + 1] = __floats2bfloat162_rn(v.z, v.w);
    }
  }
}

__global__ void scatter_rows_kernel(ScatterRowsParams p) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  const std::int64_t num_warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  for (std::int64_t t = warp; t < p.num_tokens; t += num_warps) {
    const auto* src = reinterpret_cast<const float4*>(p.grad + t * p.dim);
    auto* dst = reinterpret_cast<float4*>(p.rows + p.position[t] * p.dim);
    for (int c = lane; c < p.dim / 4; c += kWarp) dst[c] = src[c];
  }
}

// One warp per sorted position; only the head of each run of equal ids works, summing its run
// in sorted order, so every sum has one fixed order whatever the scheduling. Zipf-distributed ids
// make some runs thousands long (the hottest id of a rank), so the walk must not be a chain of
// dependent loads: the warp finds the run's end with ballots, loads 32 arrival indices at once,
// and issues kSgdUnroll independent row loads before adding them, in order.
constexpr int kSgdUnroll = 16;

__global__ void embedding_sgd_kernel(EmbeddingSgdParams p) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = int(threadIdx.x % kWarp);
  const std::int64_t num_warps = std::int64_t(gridDim.x) * blockDim.x / kWarp;
  const int num_vectors = p.dim / 4;
  for (std::int64_t j = warp; j < p.num_ids; j += num_warps) {
    const std::int64_t id = p.sorted_ids[j];
    if (j > 0 && p.sorted_ids[j - 1] == id) continue;
    // Sorted ids: the positions equal to id after j form a prefix of every 32-wide window.
    std::int64_t end = j + 1;
    while (true) {
      const std::int64_t k = end + lane;
      const unsigned same = __ballot_sync(0xffffffffu, k < p.num_ids && p.sorted_ids[k] == id);
      if (same != 0xffffffffu) {
        end += __ffs(~same) - 1;
        break;
      }
      end += kWarp;
    }
    float* row = p.table + (id / p.world_size) * p.dim;
    for (int c0 = 0; c0 < num_vectors; c0 += kWarp) {
      const int c = c0 + lane;
      const bool active = c < num_vectors;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (std::int64_t k0 = j; k0 < end; k0 += kWarp) {
        const int n = int(min(std::int64_t(kWarp), end - k0));
        const std::int32_t my_arrival = lane < n ? p.sorted_arrival[k0 + lane] : 0;
        for (int i = 0; i < n; i += kSgdUnroll) {
          float4 g[kSgdUnroll];
#pragma unroll
          for (int u = 0; u < kSgdUnroll; ++u) {
            const std::int32_t arrival = __shfl_sync(0xffffffffu, my_arrival, (i + u) % kWarp);
            g[u] = active && i + u < n
                       ? reinterpret_cast<const float4*>(p.grad_rows + std::int64_t(arrival) * p.dim)[c]
                       : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int u = 0; u < kSgdUnroll; ++u) {
            if (i + u < n) sum.x += g[u].x, sum.y += g[u].y, sum.z += g[u].z, sum.w += g[u].w;
          }
        }
      }
      if (active) {
        float4 w = reinterpret_cast<float4*>(row)[c];
        w.x -= p.lr * sum.x, w.y -= p.lr * sum.y, w.z -= p.lr * sum.z, w.w -= p.lr * sum.w;
        reinterpret_cast<float4*>(row)[c] = w;
      }
    }
  }
}

__global__ void relu_kernel(__nv_bfloat16* x, std::int64_t n) {
  const __nv_bfloat16 zero = __float2bfloat16(0.f);
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    x[i] = __hmax(x[i], zero);
  }
}

__global__ void relu_backward_kernel(__nv_bfloat16* grad, const __nv_bfloat16* act, std::int64_t n) {
  const __nv_bfloat16 zero = __float2bfloat16(0.f);
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    if (!(__bfloat162float(act[i]) > 0.f)) grad[i] = zero;
  }
}

constexpr int kLossBlock = 1024;

// One block: a fixed strided partial per thread, then a fixed tree (deterministic).
__global__ void loss_forward_kernel(LossForwardParams p) {
  using Reduce = cub::BlockReduce<float, kLossBlock>;
  __shared__ Reduce::TempStorage temp;
  float sum = 0.f;
  for (std::int64_t t = threadIdx.x; t < p.num_tokens; t += kLossBlock) {
    const float d = p.prediction[t] - p.target[p.ids[t]];
    p.diff[t] = d;
    sum += d * d;
  }
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) p.loss_sum[0] = sum;
}

__global__ void loss_backward_kernel(LossBackwardParams p) {
  const float scale = 2.f / p.global_tokens[0];
  for (std::int64_t t = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; t < p.num_tokens;
       t += std::int64_t(gridDim.x) * blockDim.x) {
    p.d_prediction[t] = __float2bfloat16(scale * p.diff[t]);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.loss_out[0] = p.loss_sum[0] / p.global_tokens[0];
}

__global__ void sgd_kernel(SgdParams p) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < p.n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float w = p.master[i] - p.lr * p.grad[i];
    p.master[i] = w;
    p.weights[i] = __float2bfloat16(w);
  }
}

}  // namespace

void launch_count_tokens(const CountTokensParams& p, cudaStream_t stream) {
  count_tokens_kernel<<<1, kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_select_samples(const SelectSamplesParams& p, cudaStream_t stream) {
  if (p.num_samples == 0) return;
  select_samples_kernel<<<unsigned(p.num_samples), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_partition_by_owner(const PartitionParams& p, cudaStream_t stream) {
  WEFT_CHECK(p.num_samples >= 1 && p.num_samples <= 1024 && p.world_size >= 1,
             "partition_by_owner: ", p.num_samples, " samples, world ", p.world_size);
  count_by_owner_kernel<<<unsigned(p.world_size), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
  scatter_by_owner_kernel<<<unsigned(p.world_size), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_check_lengths(const CheckLengthsParams& p, cudaStream_t stream) {
  WEFT_CHECK(p.world_size <= 1024, "check_lengths: world_size ", p.world_size, " > 1024");
  check_lengths_kernel<<<1, 1024, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

std::size_t prefetch_temp_bytes(std::int64_t max_ids, int key_bits) {
  WEFT_CHECK(max_ids <= std::int64_t(1) << 30, "prefetch: ", max_ids, " ids is too many");
  const int n = int(std::max<std::int64_t>(max_ids, 1));
  std::size_t sort_bytes = 0, scan_bytes = 0;
  WEFT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const std::int64_t*>(nullptr),
      static_cast<std::int64_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
      static_cast<std::int32_t*>(nullptr), n, 0, key_bits));
  WEFT_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes,
                                                static_cast<const std::int32_t*>(nullptr),
                                                static_cast<std::int32_t*>(nullptr), n));
  return std::max(sort_bytes, scan_bytes);
}

void launch_prefetch(const PrefetchParams& p, cudaStream_t stream) {
  if (p.num_ids == 0) return;
  WEFT_CHECK(p.dim % 128 == 0, "prefetch: dim ", p.dim, " is no multiple of 128");
  const int n = int(p.num_ids);
  iota_kernel<<<grid_for(n), kBlock, 0, stream>>>(p.arrival, n);
  WEFT_CUDA_CHECK_LAUNCH();
  std::size_t bytes = p.temp_bytes;
  WEFT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(p.temp, bytes, p.recv_ids, p.sorted_ids,
                                                  p.arrival, p.sorted_arrival, n, 0, p.key_bits,
                                                  stream));
  // The flags reuse `arrival`, which the sort no longer needs.
  head_flags_kernel<<<grid_for(n), kBlock, 0, stream>>>(p.sorted_ids, n, p.arrival);
  WEFT_CUDA_CHECK_LAUNCH();
  bytes = p.temp_bytes;
  WEFT_CUDA_CHECK(cub::DeviceScan::InclusiveSum(p.temp, bytes, p.arrival, p.distinct_rank, n, stream));
  fill_cache_kernel<<<grid_for(n, kBlock / kWarp, 4096), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_lookup(const LookupParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return;
  lookup_kernel<<<grid_for(p.num_rows, kBlock / kWarp, 4096), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  gather_rows_kernel<<<grid_for(p.num_tokens, kBlock / kWarp, 4096), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_scatter_rows(const ScatterRowsParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  scatter_rows_kernel<<<grid_for(p.num_tokens, kBlock / kWarp, 4096), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_embedding_sgd(const EmbeddingSgdParams& p, cudaStream_t stream) {
  if (p.num_ids == 0) return;
  embedding_sgd_kernel<<<grid_for(p.num_ids, kBlock / kWarp, 4096), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_relu(__nv_bfloat16* x, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  relu_kernel<<<grid_for(n, kBlock, 8192), kBlock, 0, stream>>>(x, n);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_relu_backward(__nv_bfloat16* grad, const __nv_bfloat16* activation, std::int64_t n,
                          cudaStream_t stream) {
  if (n == 0) return;
  relu_backward_kernel<<<grid_for(n, kBlock, 8192), kBlock, 0, stream>>>(grad, activation, n);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_loss_forward(const LossForwardParams& p, cudaStream_t stream) {
  loss_forward_kernel<<<1, kLossBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_loss_backward(const LossBackwardParams& p, cudaStream_t stream) {
  loss_backward_kernel<<<grid_for(p.num_tokens), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_sgd(const SgdParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  sgd_kernel<<<grid_for(p.n, kBlock, 8192), kBlock, 0, stream>>>(p);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::hstu
