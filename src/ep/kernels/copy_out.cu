// weft::ep's copy-out: a dispatch's results from the window into tensors the caller owns, every
// array of the call in one kernel (the DeepEP layer's owned results).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "params.hpp"
#include "protocol.cuh"

namespace weft::ep::detail {
namespace {

constexpr int kCopyThreads = 256;

// One warp per row (grid-stride): the payload (bf16 as it is; fp8 split into the e4m3 bytes and
// the row-major scales), then the row's source and selections, or a padding row's values. The
// payload of a row from the own range of a dispatch that deferred it comes from that dispatch's
// x (own_x) at the row's source token, in the same forms (a bf16 or packed row, or the fp8 pair
// read at its scales' strides).
__global__ void __launch_bounds__(kCopyThreads) copy_out_kernel(const CopyOutParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t num_recv = *p.num_recv;
  const bool deferred = p.own_x.x != nullptr;
  const int64_t own_lo = deferred ? p.own_begin[0] : 0;
  const int64_t own_hi = deferred ? own_lo + p.own_begin[1] : 0;
  if (blockIdx.x == 0 && p.rank_prefix_out != nullptr) {
    for (int i = threadIdx.x; i < p.num_ranks * p.num_ranks; i += blockDim.x) {
      p.rank_prefix_out[i] = p.rank_prefix_matrix[i];
    }
  }
  const int64_t num_warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kCopyThreads / 32) + threadIdx.x / 32;
       row < p.num_rows; row += num_warps) {
    const bool received = row < num_recv && row < p.valid_rows;
    const bool own = received && row >= own_lo && row < own_hi;
    if (own && p.own_x.scales != nullptr) {
      const int64_t t = p.recv_src[row].y;
      const int64_t n16 = p.hidden / 16;
      warp_copy_row(static_cast<int4*>(p.x) + row * n16,
                    static_cast<const int4*>(p.own_x.x) + t * n16, n16, lane);
      const int64_t num_groups = p.hidden / kFp8GroupElements;
      const float* scales = p.own_x.scales + t * p.own_x.scale_token_stride;
      for (int64_t g = lane; g < num_groups; g += 32) {
        p.x_scales[row * num_groups + g] = scales[g * p.own_x.scale_group_stride];
      }
    } else if (received) {
      const char* from = own ? static_cast<const char*>(p.own_x.x) + p.recv_src[row].y * p.row_bytes
                             : p.recv_x + row * p.row_bytes;
      if (p.x_scales == nullptr) {
        const int64_t n16 = p.hidden * 2 / 16;
        warp_copy_row(static_cast<int4*>(p.x) + row * n16, reinterpret_cast<const int4*>(from),
                      n16, lane);
      } else {
        const int64_t n16 = p.hidden / 16;
        warp_copy_row(static_cast<int4*>(p.x) + row * n16, reinterpret_cast<const int4*>(from),
                      n16, lane);
        const int64_t num_groups = p.hidden / kFp8GroupElements;
        const auto* scales = reinterpret_cast<const float*>(from + p.hidden);
        for (int64_t g = lane; g < num_groups; g += 32) {
          p.x_scales[row * num_groups + g] = scales[g];
        }
      }
    }
    if (p.src != nullptr && lane == 0) {
      p.src[row] = received ? p.recv_src[row] : make_int2(0, p.pad_token);
    }
    if (lane < p.num_topk) {
      const int32_t e = received ? p.recv_expert_idx[row * p.top_k + lane] : -1;
      if (p.topk_idx != nullptr) {
        if (p.topk_idx_int64) {
          static_cast<int64_t*>(p.topk_idx)[row * p.num_topk + lane] = e;
        } else {
          static_cast<int32_t*>(p.topk_idx)[row * p.num_topk + lane] = e;
        }
      }
      if (p.topk_weights != nullptr) {
        p.topk_weights[row * p.num_topk + lane] =
            received ? p.recv_weights[row * p.top_k + lane] : 0.0f;
      }
    }
  }
}

}  // namespace

void launch_copy_out(const CopyOutParams& params, cudaStream_t stream) {
  const int64_t rows_per_block = kCopyThreads / 32;
  const int64_t wanted = (params.num_rows + rows_per_block - 1) / rows_per_block;
  const int64_t num_blocks = std::clamp<int64_t>(wanted, 1, params.max_blocks);
  copy_out_kernel<<<unsigned(num_blocks), kCopyThreads, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep::detail
