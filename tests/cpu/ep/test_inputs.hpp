// Self-describing inputs for the reference tests of the fp8 and expanded features: every payload
// element names its (rank, token, column), so a misrouted row cannot look plausible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "weft/ep/reference.hpp"

namespace weft::ep::test {

// Small integers, exact in bf16 (and in fp32 sums of a few of them).
inline uint16_t identity_value(int rank, int64_t token, int64_t col) {
  return float_to_bf16(static_cast<float>((rank * 7 + token * 3 + col) % 61 - 30));
}

// Distinct experts per token (as a router's top-k gives), each selection masked (-1) with
// probability mask_ratio. With crowd_rank0, every token's first min(top_k, E/R) selections are
// rank 0's experts and none is masked (to provoke expanded-layout overflow). With fp8, x_fp8
// holds cast_to_fp8(x).
inline std::vector<reference::RankInput> make_inputs(const BufferConfig& c, int num_ranks,
                                                     const std::vector<int64_t>& tokens,
                                                     double mask_ratio, std::mt19937& rng,
                                                     bool fp8 = false, bool crowd_rank0 = false) {
  std::vector<reference::RankInput> inputs(static_cast<std::size_t>(num_ranks));
  const int epr = c.num_experts / num_ranks;
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int r = 0; r < num_ranks; ++r) {
    auto& in = inputs[static_cast<std::size_t>(r)];
    in.num_tokens = tokens[static_cast<std::size_t>(r)];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) in.x.push_back(identity_value(r, t, h));
      std::vector<int> experts(static_cast<std::size_t>(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[static_cast<std::size_t>(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      if (crowd_rank0) {  // rank 0's experts first
        std::stable_partition(experts.begin(), experts.end(), [&](int e) { return e < epr; });
      }
      for (int k = 0; k < c.top_k; ++k) {
        int64_t e = experts[static_cast<std::size_t>(k)];
        if (!crowd_rank0 && uni(rng) < mask_ratio) e = -1;
        in.topk_idx.push_back(e);
        in.topk_weights.push_back(uni(rng));
      }
    }
    if (fp8) in.x_fp8 = reference::cast_to_fp8(c.hidden, in.num_tokens, in.x);
  }
  return inputs;
}

}  // namespace weft::ep::test
