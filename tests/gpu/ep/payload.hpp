// Payloads of weft::ep's GPU tests: every bf16 element names its (rank, token, column), so that a
// misrouted row cannot look plausible.
#pragma once

#include <cstdint>
#include <vector>

#include "weft/ep/reference.hpp"
#include "weft/ep/types.hpp"

namespace weft::ep::testing {

// Biased exponents 112..135: |v| in [2^-15, 2^9).
inline uint16_t identity_value(int rank, int64_t token, int64_t col) {
  return reference::identity_bf16(rank, token, col, 112, 24);
}

// New payload for the same tokens (a cached dispatch's x): rank r's rows become the identity
// values of rank r + salt; packed fp8 rows, where there are any, are cast again.
inline void refill_x(const BufferConfig& c, std::vector<reference::RankInput>& inputs, int salt) {
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    auto& in = inputs[r];
    for (int64_t i = 0; i < in.num_tokens * c.hidden; ++i) {
      in.x[std::size_t(i)] = identity_value(int(r) + salt, i / c.hidden, i % c.hidden);
    }
    if (!in.x_fp8.empty()) in.x_fp8 = reference::cast_to_fp8(c.hidden, in.num_tokens, in.x);
  }
}

}  // namespace weft::ep::testing
