// weft::ep's fp8 cast of one group of kFp8GroupElements bf16 elements by one warp, shared by the
// cast kernel and the dispatch that casts its rows on the way (RowSource::cast_fp8), so that both
// write the same bits as reference::cast_to_fp8 (formulas in types.hpp).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/ep/types.hpp"

namespace weft::ep::detail {

static_assert(kFp8GroupElements == 32 * 4, "a group is one warp of four elements per lane");

struct Fp8Group {
  uint32_t packed;  // the lane's four e4m3 codes, element 4 * lane + i in byte i
  float scale;      // the group's scale (every lane)
};

// Warp-collective (all 32 lanes): lane l holds elements [4l, 4l + 4) of the group as `bits` (one
// 8-byte load). Every operation is the reference's, in fp32: fmaxf ignores NaN like std::fmax
// (and max is exact, so the order of the reduction does not matter), IEEE reciprocals and
// products (__frcp_rn, __fmul_rn: nothing fused).
__device__ __forceinline__ Fp8Group cast_fp8_group(uint2 bits, bool round_scale) {
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
  if (round_scale) {
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
  return {packed, scale};
}

}  // namespace weft::ep::detail
