// Plain types shared by weft::ep's CPU reference and its CUDA implementation (no CUDA needed).
//
//   weft::ep::BufferConfig config{.max_tokens = 8192, .hidden = 7168, .num_experts = 256,
//                                 .top_k = 8};
//   config.validate(/*num_ranks=*/2);   // throws weft::Error with the reason
#pragma once

#include <cstdint>
#include <cstring>

namespace weft::ep {

// Element types the EP API accepts. Which one an argument may have is stated where it is taken.
enum class DType : int { kBFloat16, kFloat32, kInt32, kInt64 };

const char* dtype_name(DType dtype) noexcept;
std::size_t dtype_size(DType dtype) noexcept;

// A non-owning view of a contiguous row-major [rows, cols] array (device memory on the GPU path,
// host memory for the reference). `data` may be null when rows == 0.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t cols = 0;
};

// What one Buffer is sized for. Every rank of a communicator uses the same config.
struct BufferConfig {
  int64_t max_tokens = 0;  // tokens per rank and call, upper bound (T <= max_tokens)
  int64_t hidden = 0;      // row width in elements; hidden * 2 bytes must be a multiple of 16
  int num_experts = 0;     // global experts; a multiple of the number of ranks
  int top_k = 0;           // selections per token (1..32)

  // Throws weft::Error naming the first violated invariant.
  void validate(int num_ranks) const;
  int num_local_experts(int num_ranks) const { return num_experts / num_ranks; }
  int64_t row_bytes() const { return hidden * 2; }
};

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
