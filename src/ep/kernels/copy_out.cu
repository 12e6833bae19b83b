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

// The rows of the layout copied: DeviceState::num_recv where the rank's state holds that layout
// (and, standing in for a cached dispatch, it did not overflow), else -1, with the error that a
// cached dispatch or combine raises there. Every thread loads the same words.
__device__ int64_t rows_of_layout(const CopyOutParams& p) {
  const DeviceState& st = *p.state;
  const uint32_t broken = st.broken;
  const uint64_t in_place = st.layout_id;
  const int32_t required = st.tokens_required;
  const int32_t num_recv = st.num_recv;
  if (broken != 0) return -1;  // a fatal error earlier, reported already
  const bool report = blockIdx.x == 0 && threadIdx.x == 0;
  if (in_place != p.layout_id) {
    if (report) {
      raise_device_error(p.error, kErrLayoutMismatch, p.rank, int64_t(p.layout_id),
                         int64_t(in_place));
    }
    return -1;
  }
  if (p.cached_call && required > 0) {
    if (report) {
      raise_device_error(p.error, kErrOverflowedLayout, p.rank, st.overflow_rank, required,
                         p.max_tokens);
    }
    return -1;
  }
  return num_recv;
}

// One warp per row (grid-stride): the payload (bf16 as it is; fp8 split into the e4m3 bytes and
// the row-major scales), then the row's source and selections, or a padding row's values. The
// payload of a row from the own range of a dispatch that deferred it comes from that dispatch's
// x (own_x) at the row's source token, in the same forms (a bf16 or packed row, or the fp8 pair
// read at its scales' strides). A warp issues every load of a row but the payload's before its
// payload (the source, the selections, the first 64 scales), so that their latency overlaps the
// payload's instead of following it: a grid of one row per warp is bound by that chain.
__global__ void __launch_bounds__(kCopyThreads) copy_out_kernel(const CopyOutParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t layout_rows = rows_of_layout(p);
  const int64_t num_recv = layout_rows < 0 ? 0 : layout_rows;  // not in place: padding only
  const bool deferred = p.own_x.x != nullptr;
  const int64_t own_lo = deferred ? p.state->own_begin : 0;
  const int64_t own_hi = deferred ? own_lo + p.state->own_count : 0;
  const int64_t num_groups = p.hidden / kFp8GroupElements;
  if (blockIdx.x == 0 && p.rank_prefix_out != nullptr && layout_rows >= 0) {
    for (int i = threadIdx.x; i < p.num_ranks * p.num_ranks; i += blockDim.x) {
      p.rank_prefix_out[i] = p.rank_prefix_matrix[i];
    }
  }
  const int64_t num_warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kCopyThreads / 32) + threadIdx.x / 32;
       row < p.num_rows; row += num_warps) {
    const bool received = row < num_recv && row < p.valid_rows;
    const bool own = received && row >= own_lo && row < own_hi;
    const int2 src = received ? p.recv_src[row] : make_int2(0, p.pad_token);
    int32_t expert = -1;
    float weight = 0.0f;
    if (received && lane < p.num_topk) {
      if (p.topk_idx != nullptr) expert = p.recv_expert_idx[row * p.top_k + lane];
      if (p.topk_weights != nullptr) weight = p.recv_weights[row * p.top_k + lane];
    }
    if (received) {
      // The payload and its scales: an own fp8 pair (scales at their strides), or a bf16 or
      // packed row (scales behind the payload) from the window or from own_x.
      const bool own_pair = own && p.own_x.scales != nullptr;
      const char* from = own_pair ? static_cast<const char*>(p.own_x.x) + src.y * p.hidden
                         : own    ? static_cast<const char*>(p.own_x.x) + src.y * p.row_bytes
                                  : p.recv_x + row * p.row_bytes;
      const float* scales = nullptr;
      int64_t scale_stride = 1;
      if (p.x_scales != nullptr) {
        scales = own_pair ? p.own_x.scales + src.y * p.own_x.scale_token_stride
                          : reinterpret_cast<const float*>(from + p.hidden);
        scale_stride = own_pair ? p.own_x.scale_group_stride : 1;
      }
      float first_scales[2] = {0.0f, 0.0f};
      if (scales != nullptr) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int64_t g = lane + 32 * u;
          if (g < num_groups) first_scales[u] = scales[g * scale_stride];
        }
      }
      const int64_t n16 = (scales != nullptr ? p.hidden : p.hidden * 2) / 16;
      warp_copy_row(static_cast<int4*>(p.x) + row * n16, reinterpret_cast<const int4*>(from),
                    n16, lane);
      if (scales != nullptr) {
        float* to = p.x_scales + row * num_groups;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int64_t g = lane + 32 * u;
          if (g < num_groups) to[g] = first_scales[u];
        }
        for (int64_t g = lane + 64; g < num_groups; g += 32) to[g] = scales[g * scale_stride];
      }
    }
    if (p.src != nullptr && lane == 0) p.src[row] = src;
    if (lane < p.num_topk) {
      if (p.topk_idx != nullptr) {
        if (p.topk_idx_int64) {
          static_cast<int64_t*>(p.topk_idx)[row * p.num_topk + lane] = expert;
        } else {
          static_cast<int32_t*>(p.topk_idx)[row * p.num_topk + lane] = expert;
        }
      }
      if (p.topk_weights != nullptr) p.topk_weights[row * p.num_topk + lane] = weight;
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
