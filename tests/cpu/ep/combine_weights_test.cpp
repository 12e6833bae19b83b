// The CPU reference of combine's top-k weights (reference::combine_weights, DeepEP's
// combined_topk_weights) against a brute-force statement of the contract that finds each
// token's rows by their recorded source instead of the send slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/ep/reference.hpp"
#include "test_inputs.hpp"

namespace {

using weft::ep::BufferConfig;
namespace ref = weft::ep::reference;
using weft::ep::test::make_inputs;

// Weights of mixed sign and magnitude, so that a different order of the additions gives a
// different fp32 sum.
std::vector<std::vector<float>> random_weights(std::span<const ref::RankLayout> layouts, int K,
                                               std::mt19937& rng) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<std::vector<float>> w;
  for (const auto& L : layouts) {
    auto& v = w.emplace_back(static_cast<std::size_t>(L.num_recv * K));
    for (auto& e : v) e = std::ldexp(mantissa(rng), exponent(rng));
  }
  return w;
}

// out[t][k] = 0 + w_d[row][k] over d ascending, the row being the one at d whose source is
// (rank, t).
std::vector<float> brute_force(std::span<const ref::RankLayout> layouts, int rank, int64_t T,
                               std::span<const std::vector<float>> w, int K) {
  std::vector<float> out(static_cast<std::size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      float sum = 0.0f;
      for (std::size_t d = 0; d < layouts.size(); ++d) {
        const auto& L = layouts[d];
        for (int64_t j = 0; j < L.num_recv; ++j) {
          if (L.recv_src_rank[static_cast<std::size_t>(j)] == rank &&
              L.recv_src_token[static_cast<std::size_t>(j)] == t) {
            sum += w[d][static_cast<std::size_t>(j * K + k)];
          }
        }
      }
      out[static_cast<std::size_t>(t * K + k)] = sum;
    }
  }
  return out;
}

TEST(EpReferenceCombineWeights, SumsInAscendingRankOrderForEveryK) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 40; ++trial) {
    const int num_ranks = 1 + trial % 4;
    const int num_experts = num_ranks * (2 + trial % 3);
    const BufferConfig c{.max_tokens = 32, .hidden = 8, .num_experts = num_experts,
                         .top_k = std::min(1 + trial % 5, num_experts)};
    std::vector<int64_t> tokens;
    for (int r = 0; r < num_ranks; ++r) tokens.push_back(int64_t(rng() % 33));
    const auto inputs = make_inputs(c, num_ranks, tokens, 0.3, rng);
    const auto layouts = ref::dispatch(c, inputs);
    for (int K = 1; K <= c.top_k; ++K) {
      const auto w = random_weights(layouts, K, rng);
      for (int s = 0; s < num_ranks; ++s) {
        const auto got = ref::combine_weights(c, s, layouts, w, K);
        const auto want = brute_force(layouts, s, tokens[static_cast<std::size_t>(s)], w, K);
        ASSERT_EQ(got, want) << "trial " << trial << " rank " << s << " K " << K;
      }
    }
  }
}

// Combining the received weights themselves gives back each token's weights, 0 where the
// selection is masked: every selection's weight is non-zero at exactly one rank.
TEST(EpReferenceCombineWeights, CombiningRecvWeightsRestoresTheTokensWeights) {
  std::mt19937 rng(9);
  const BufferConfig c{.max_tokens = 64, .hidden = 8, .num_experts = 12, .top_k = 4};
  const auto inputs = make_inputs(c, 3, {64, 17, 0}, 0.25, rng);
  const auto layouts = ref::dispatch(c, inputs);
  std::vector<std::vector<float>> w;
  for (const auto& L : layouts) w.push_back(L.recv_weights);
  for (int s = 0; s < 3; ++s) {
    const auto& in = inputs[static_cast<std::size_t>(s)];
    const auto got = ref::combine_weights(c, s, layouts, w, c.top_k);
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], in.topk_idx[i] >= 0 ? in.topk_weights[i] : 0.0f) << "rank " << s;
    }
  }
}

TEST(EpReferenceCombineWeights, BadArgumentsThrow) {
  std::mt19937 rng(10);
  const BufferConfig c{.max_tokens = 8, .hidden = 8, .num_experts = 4, .top_k = 2,
                       .expand_factor = 2};
  const auto inputs = make_inputs(c, 2, {8, 8}, 0.0, rng);
  const auto layouts = ref::dispatch(c, inputs);
  const auto w = random_weights(layouts, 2, rng);
  EXPECT_THROW(ref::combine_weights(c, 0, layouts, w, 3), weft::Error);  // K above top_k
  EXPECT_THROW(ref::combine_weights(c, 0, layouts, w, 1), weft::Error);  // sizes for K = 2
  const auto expanded = ref::dispatch(c, inputs, {.expand = {.enabled = true}});
  EXPECT_THROW(ref::combine_weights(c, 0, expanded, w, 2), weft::Error);
}

}  // namespace
