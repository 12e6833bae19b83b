// weft::ep's fp8 cast: bf16 rows -> packed fp8 rows (weft::ep::Fp8RowLayout).
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_cast.cuh"
#include "params.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/types.hpp"

namespace weft::ep::detail {
namespace {

// bf16 -> packed fp8 rows, bit-identical to reference::cast_to_fp8 (cast_fp8_group): one warp
// per (token, group of 128 elements), lane l owning elements [4l, 4l + 4) of the group (one
// 8-byte load, one 4-byte store). The warp of group 0 also zeroes the row's padding bytes, so
// whole rows are deterministic.
__global__ void __launch_bounds__(256) cast_fp8_kernel(const CastFp8Params p) {
  const int lane = threadIdx.x % 32;
  const int64_t unit = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t num_groups = p.hidden / kFp8GroupElements;
  if (unit >= p.num_tokens * num_groups) return;
  const int64_t t = unit / num_groups;
  const int64_t g = unit % num_groups;
  const Fp8Group q = cast_fp8_group(
      reinterpret_cast<const uint2*>(p.x + t * p.hidden + g * kFp8GroupElements)[lane],
      p.round_scale);
  uint8_t* row = p.out + t * p.row_bytes;
  reinterpret_cast<uint32_t*>(row + g * kFp8GroupElements)[lane] = q.packed;
  if (lane == 0) {
    reinterpret_cast<float*>(row + p.hidden)[g] = q.scale;
  }
  if (g == 0) {
    for (int64_t b = p.raw_bytes + lane; b < p.row_bytes; b += 32) row[b] = 0;
  }
}

}  // namespace

void launch_cast_fp8(const CastFp8Params& params, cudaStream_t stream) {
  const int64_t num_warps = params.num_tokens * (params.hidden / kFp8GroupElements);
  if (num_warps == 0) return;
  constexpr int kCastThreads = 256;
  const int64_t num_blocks = (num_warps * 32 + kCastThreads - 1) / kCastThreads;
  cast_fp8_kernel<<<unsigned(num_blocks), kCastThreads, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep::detail
