// Plain types shared by weft::ep's CPU reference and its CUDA implementation (no CUDA needed).
//
//   weft::ep::BufferConfig config{.max_tokens = 8192, .hidden = 7168, .num_experts = 256,
//                                 .top_k = 8};
//   config.validate(/*num_ranks=*/2);   // throws weft::Error with the reason
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "weft/core/host_device.hpp"

namespace weft::ep {

// Element types the EP API accepts. Which one an argument may have is stated where it is taken.
// kUInt8 is an opaque byte row: dispatch takes packed fp8 rows (see Fp8RowLayout) as uint8.
enum class DType : int { kBFloat16, kFloat32, kInt32, kInt64, kUInt8 };

const char* dtype_name(DType dtype) noexcept;
std::size_t dtype_size(DType dtype) noexcept;

// A non-owning view of a contiguous row-major [rows, cols] array (device memory on the GPU path,
// host memory for the reference). `data` may be null when rows == 0.
struct TensorView {
  const void* data = nullptr;      // the first element; rows * cols elements follow, no gaps
  DType dtype = DType::kBFloat16;  // the element type
  int64_t rows = 0;                // >= 0
  int64_t cols = 0;                // elements per row, >= 0
};

// What one Buffer is sized for. Every rank of a communicator uses the same config.
struct BufferConfig {
  // Tokens per rank and call that move (T <= max_tokens; a deduplicated dispatch of more moves
  // nothing and reports DispatchResult::tokens_required on every rank).
  int64_t max_tokens = 0;
  int64_t hidden = 0;      // row width in elements; hidden * 2 bytes must be a multiple of 16
  int num_experts = 0;     // global experts; a multiple of the number of ranks
  int top_k = 0;           // selections per token (1..32)
  // Receive capacity of an expanded dispatch (ExpandOptions), as a multiple of the deduplicated
  // layout's num_ranks * max_tokens rows: 0 (default) = no expanded dispatch on this Buffer (the
  // window holds only the deduplicated rows); >= 1 = the window's receive region holds
  // expand_factor * num_ranks * max_tokens rows (at most 2^31 - 1: rows are int32 indices).
  // Balanced routing needs about top_k / num_ranks plus the alignment's padding, which at small
  // max_tokens can dominate (e.g. 128 experts per rank aligned to 128 rows: 16384 rows). Fixed at
  // construction because it sizes the symmetric window.
  int expand_factor = 0;

  // Throws weft::Error naming the first violated invariant.
  void validate(int num_ranks) const;
  int num_local_experts(int num_ranks) const { return num_experts / num_ranks; }
  int64_t row_bytes() const { return hidden * 2; }
  // Rows a rank can receive in an expanded dispatch (0 without expand_factor).
  int64_t expand_capacity(int num_ranks) const {
    return int64_t(expand_factor) * num_ranks * max_tokens;
  }
};

// The expanded layout (DeepEP's do_expand): one received row per (token, local expert) instead
// of one per (token, rank), grouped by local expert so that each expert's rows are the contiguous
// block a grouped GEMM consumes. Expert e's segment starts at
//   segment_begin[e] = sum_{e' < e} align_up(count[e'], expert_alignment)
// and holds its count[e] rows (source rank, then source token order) followed by padding rows.
// Capacity: BufferConfig::expand_factor * num_ranks * max_tokens rows per rank (the deduplicated
// layout needs num_ranks * max_tokens; the worst case of the expanded one is
// min(top_k, experts per rank) times that, which balanced routing never approaches). A rank whose
// aligned rows would exceed its capacity receives nothing, and the number of rows it needed is
// reported: every rank derives every rank's need from the exchanged per-expert counts, so the
// overflow is known before any payload moves.
struct ExpandOptions {
  bool enabled = false;       // dispatch in this layout (needs BufferConfig::expand_factor >= 1)
  int expert_alignment = 1;   // each expert's segment is rounded up to a multiple of this (1..4096)
  bool zero_padding = false;  // padding rows' payload is zeroed (else left as it was)
  // 0: segments packed as above. > 0: fixed-stride segments (DeepEP's low-latency layout):
  //   segment_begin[e] = e * segment_stride (e < E/R),
  //   segment_begin[E/R] = rows_required = E/R * max(segment_stride, A)
  // where A is the largest aligned count of the rank's experts, so the receive region is a
  // [E/R, segment_stride, row] array whatever the counts. A rank where A > segment_stride, or
  // rows_required > the capacity, overflows (as above). With expert_alignment 1, T <= max_tokens
  // and segment_stride = num_ranks * max_tokens no rank can overflow. 0..2^31 - 1.
  int64_t segment_stride = 0;

  // Throws weft::Error naming the first violated invariant.
  void validate() const;
  bool operator==(const ExpandOptions&) const = default;
};

// fp8 rows (DeepEP's per-token cast, per_token_cast_to_fp8): each group of kFp8GroupElements
// consecutive elements of a token has its own fp32 scale, computed from the group's bf16 values,
// every operation in fp32 rounded to nearest, in torch's order of DeepEP's
// `x * (448.0 / amax)` and `amax / 448.0` on the GPU (a reciprocal, then a product):
//   amax  = max(fmax over the group of |x|, kFp8MinAmax)            (NaN elements do not count)
//   q[i]  = e4m3_satfinite_rn(float(x[i]) * ((1.0f / amax) * 448.0f))
//   scale = amax * kFp8InverseE4M3Max;  x[i] ~ e4m3_to_float(q[i]) * scale
// or, with round_scale (DeepEP's round_scale), the scale a power of two:
//   scale = fp8_round_scale(amax * kFp8InverseE4M3Max)               (2^ceil(log2), exact)
//   q[i]  = e4m3_satfinite_rn(float(x[i]) * (1.0f / scale))          (exact: a power of two)
// One packed row per token, which dispatch moves as opaque bytes in one store:
//   [0, hidden)                       e4m3 payload, one byte per element
//   [hidden, hidden + 4 * groups)     fp32 scales, groups = hidden / 128 (4-byte aligned, since
//                                     hidden is a multiple of 128)
//   [raw_bytes, row_bytes)            zero padding
// row_bytes is raw_bytes rounded up to 16 (rows move as 16-byte vectors: hidden = 128 packs to
// 132 raw bytes and needs this), or to 512 (one 16-byte vector per lane of a warp, so a warp's
// copy loop has no partial last iteration) where that costs at most kFp8Row512MaxPaddingFraction
// of raw_bytes.
constexpr int64_t kFp8GroupElements = 128;
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8InverseE4M3Max = 1.0f / kFp8E4M3Max;  // rounded to nearest
constexpr float kFp8MinAmax = 1e-4f;
// The 512-byte rule's threshold: the padding never makes a dispatch faster, and at most 5% more
// bytes keeps its time cost small (the measurements: docs/perf-ep.md, "fp8 row padding").
constexpr double kFp8Row512MaxPaddingFraction = 0.05;

// The smallest power of two at or above a positive normal fp32 value v (or +inf), by its bits:
// (bits + 0x7FFFFF) & ~0x7FFFFF (an exact power of two stays, any other mantissa carries into
// the exponent). v = amax * kFp8InverseE4M3Max with amax >= kFp8MinAmax is always normal.
constexpr WEFT_HOST_DEVICE uint32_t fp8_round_scale_bits(uint32_t bits) noexcept {
  return (bits + 0x7FFFFFu) & 0xFF800000u;
}
inline float fp8_round_scale(float v) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = fp8_round_scale_bits(bits);
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

struct Fp8RowLayout {
  int64_t hidden = 0;          // elements
  int64_t num_scales = 0;      // hidden / kFp8GroupElements
  int64_t scales_offset = 0;   // bytes; == hidden
  int64_t raw_bytes = 0;       // hidden + 4 * num_scales
  int64_t row_bytes = 0;       // padded; a multiple of 16
};
// Throws weft::Error unless hidden is a positive multiple of kFp8GroupElements.
Fp8RowLayout fp8_row_layout(int64_t hidden);

// fp32 <-> e4m3 (OCP e4m3fn: bias 7, no infinities, 0x7F / 0xFF are NaN, largest finite 448) on
// the host, bit-identical to CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3): round
// to nearest even; finite values and infinities beyond 448 saturate to +-448; NaN -> 0x7F.
inline uint8_t float_to_e4m3(float value) noexcept {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float a = std::fabs(value);
  if (a >= kFp8E4M3Max) return uint8_t(sign | 0x7E);
  // Subnormals are multiples of 2^-9 below 2^-6; a normal of exponent e has 8 steps of 2^(e-3).
  // Scaling by a power of two is exact, and nearbyint rounds half to even.
  if (a < 0x1p-6f) return uint8_t(sign | uint8_t(std::nearbyint(std::ldexp(a, 9))));
  int exponent = 0;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  const int e = exponent - 1;                                               // -6..8
  const auto steps = int(std::nearbyint(std::ldexp(a, 3 - e)));             // 8..16
  return uint8_t(sign | uint8_t(((e + 7) << 3) + (steps - 8)));  // 16 carries into the exponent
}

inline float e4m3_to_float(uint8_t bits) noexcept {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(float(mantissa), -9);
  return sign * std::ldexp(float(8 + mantissa), exponent - 10);
}

// bf16 <-> fp32 on the host (round to nearest even; NaN stays NaN).
inline float bf16_to_float(uint16_t bits) noexcept {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return uint16_t((bits >> 16) | 0x40u);  // quiet NaN
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

}  // namespace weft::ep
