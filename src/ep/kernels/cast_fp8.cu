// weft::ep's fp8 cast: bf16 rows -> packed fp8 rows (weft::ep::Fp8RowLayout).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/types.hpp"

namespace weft::ep::detail {
namespace {

// bf16 -> packed fp8 rows, bit-identical to reference::cast_to_fp8 (formulas in types.hpp, with
// or without round_scale): one warp per (token, group of 128 elements), lane l owning elements
// [4l, 4l + 4) of the group (one 8-byte load, one 4-byte store). Every operation is the
// reference's, in fp32: fmaxf ignores NaN like std::fmax, and IEEE reciprocals and products
// (__frcp_rn, __fmul_rn: nothing fused). The warp of group 0 also zeroes the row's padding
// bytes, so whole rows are deterministic.
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
  float scale = __fmul_rn(amax, kFp8InverseE4M3Max);
  float inverse;
  if (p.round_scale) {
    scale = __uint_as_float(fp8_round_scale_bits(__float_as_uint(scale)));
    inverse = __frcp_rn(scale);
  } else {
    inverse = __fmul_rn(__frcp_rn(amax), kFp8E4M3Max);
  }
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = __nv_cvt_float_to_fp8(__fmul_rn(v[i], inverse), __NV_SATFINITE, __NV_E4M3);
    packed |= q << (8 * i);
  }
  uint8_t* row = p.out + t * p.row_bytes;
  reinterpret_cast<uint32_t*>(row + g * kFp8GroupElements)[lane] = packed;
  if (lane == 0) {
    reinterpret_cast<float*>(row + p.hidden)[g] = scale;
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
