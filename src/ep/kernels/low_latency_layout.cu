// weft::ep's low-latency layout: DeepEP's low_latency_dispatch results (src_info, layout_range,
// the scales in its layouts) from the window rows of a fixed-stride expanded dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "params.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/types.hpp"

namespace weft::ep::detail {
namespace {

constexpr int kLayoutThreads = 256;

// Block (x, e): rows [x * kLayoutThreads, (x + 1) * kLayoutThreads) of segment e, one thread per
// row: its src_info, then its scales (each thread reads its own row's, the block writes them
// along the row index, which is their stride-1 dimension). Block (0, e) also counts the whole
// segment's rows per source rank in shared memory and writes layout_range's row e.
__global__ void __launch_bounds__(kLayoutThreads)
    low_latency_layout_kernel(const LowLatencyLayoutParams p) {
  const int e = blockIdx.y;
  const int64_t S = p.segment_stride;
  const int2* src = p.recv_src + int64_t(e) * S;
  if (blockIdx.x == 0) {
    __shared__ int counts[kMaxRanks];
    if (threadIdx.x < kMaxRanks) counts[threadIdx.x] = 0;
    __syncthreads();
    for (int64_t s = threadIdx.x; s < S; s += kLayoutThreads) {
      const int rank = src[s].x;
      if (rank >= 0 && rank < p.num_ranks) atomicAdd(&counts[rank], 1);
    }
    __syncthreads();
    if (threadIdx.x < p.num_ranks) {
      int64_t begin = 0;
      for (int r = 0; r < int(threadIdx.x); ++r) begin += counts[r];
      p.layout_range[int64_t(e) * p.num_ranks + threadIdx.x] =
          (begin << 32) | int64_t(counts[threadIdx.x]);
    }
  }
  const int64_t s = int64_t(blockIdx.x) * kLayoutThreads + threadIdx.x;
  if (s >= S) return;
  p.src_info[int64_t(e) * S + s] = src[s].y;
  if (p.scales == nullptr && p.ue8m0 == nullptr) return;
  const int64_t num_groups = p.hidden / kFp8GroupElements;
  const auto* scales =
      reinterpret_cast<const float*>(p.recv_x + (int64_t(e) * S + s) * p.row_bytes + p.hidden);
  if (p.scales != nullptr) {
    float* out = p.scales + int64_t(e) * S * num_groups + s;
    for (int64_t g = 0; g < num_groups; ++g) out[g * S] = scales[g];
  }
  if (p.ue8m0 != nullptr) {
    const int64_t num_words = num_groups / 4;
    int32_t* out = p.ue8m0 + int64_t(e) * S * num_words + s;
    for (int64_t w = 0; w < num_words; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        word |= ((__float_as_uint(scales[4 * w + i]) >> 23) & 0xFFu) << (8 * i);
      }
      out[w * S] = int32_t(word);
    }
  }
}

}  // namespace

void launch_low_latency_layout(const LowLatencyLayoutParams& params, cudaStream_t stream) {
  if (params.num_local_experts == 0) return;
  const int64_t blocks_per_segment =
      params.segment_stride == 0 ? 1
                                 : (params.segment_stride + kLayoutThreads - 1) / kLayoutThreads;
  const dim3 grid(unsigned(blocks_per_segment), unsigned(params.num_local_experts));
  low_latency_layout_kernel<<<grid, kLayoutThreads, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep::detail
