// The CPU reference's layout, checked against an independent brute-force statement of the
// contract (include/weft/ep/reference.hpp) on many random routings, masks and edge cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/ep/reference.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::bf16_to_float;
using weft::ep::float_to_bf16;
namespace ref = weft::ep::reference;

// A payload value that names its (rank, token, column): small integers, exact in bf16.
uint16_t identity_value(int rank, int64_t token, int64_t col) {
  return float_to_bf16(static_cast<float>((rank * 7 + token * 3 + col) % 61 - 30));
}

enum class Routing { kRandom, kAllToRank0, kNoneToLastRank, kAllMasked };

std::vector<ref::RankInput> make_inputs(const BufferConfig& c, int num_ranks,
                                        std::vector<int64_t> tokens, double mask_ratio,
                                        Routing routing, std::mt19937& rng) {
  std::vector<ref::RankInput> inputs(static_cast<std::size_t>(num_ranks));
  const int epr = c.num_experts / num_ranks;
  for (int r = 0; r < num_ranks; ++r) {
    auto& in = inputs[static_cast<std::size_t>(r)];
    in.num_tokens = tokens[static_cast<std::size_t>(r)];
    in.x.resize(static_cast<std::size_t>(in.num_tokens * c.hidden));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) {
        in.x[static_cast<std::size_t>(t * c.hidden + h)] = identity_value(r, t, h);
      }
    }
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      // Distinct experts per token, as a router's top-k gives.
      std::vector<int> experts(static_cast<std::size_t>(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[static_cast<std::size_t>(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      int chosen = 0;
      for (int k = 0; k < c.top_k; ++k) {
        int64_t e = experts[static_cast<std::size_t>(k)];
        if (routing == Routing::kAllToRank0) e = experts[static_cast<std::size_t>(k)] % epr;
        if (routing == Routing::kNoneToLastRank) {
          e = experts[static_cast<std::size_t>(k)] % (c.num_experts - epr);
        }
        if (routing == Routing::kAllMasked || uni(rng) < mask_ratio) e = -1;
        chosen += e >= 0;
        in.topk_idx.push_back(e);
        in.topk_weights.push_back(uni(rng));
      }
      (void)chosen;
    }
  }
  return inputs;
}

// Checks every clause of the contract without reusing the reference's own bookkeeping.
void check_layout(const BufferConfig& c, std::span<const ref::RankInput> inputs,
                  std::span<const ref::RankLayout> layouts) {
  const int num_ranks = static_cast<int>(inputs.size());
  const int epr = c.num_experts / num_ranks;
  for (int d = 0; d < num_ranks; ++d) {
    const auto& L = layouts[static_cast<std::size_t>(d)];
    // Expected rows at d, in (source rank, source token) order.
    std::vector<std::pair<int, int64_t>> expected;
    for (int s = 0; s < num_ranks; ++s) {
      const auto& in = inputs[static_cast<std::size_t>(s)];
      for (int64_t t = 0; t < in.num_tokens; ++t) {
        bool any = false;
        for (int k = 0; k < c.top_k; ++k) {
          const int64_t e = in.topk_idx[static_cast<std::size_t>(t * c.top_k + k)];
          any |= e >= 0 && e / epr == d;
        }
        if (any) expected.emplace_back(s, t);
      }
    }
    ASSERT_EQ(L.num_recv, static_cast<int64_t>(expected.size())) << "rank " << d;
    // rank_prefix_matrix[i][d] = rows d receives from ranks 0..i; every rank holds all of it.
    const auto R = static_cast<std::size_t>(num_ranks);
    ASSERT_EQ(L.rank_prefix_matrix.size(), R * R) << "rank " << d;
    for (std::size_t i = 0; i < R; ++i) {
      int32_t from_ranks_up_to_i = 0;
      for (const auto& [s, t] : expected) from_ranks_up_to_i += static_cast<std::size_t>(s) <= i;
      for (const auto& other : layouts) {
        EXPECT_EQ(other.rank_prefix_matrix[i * R + static_cast<std::size_t>(d)], from_ranks_up_to_i)
            << "rank_prefix_matrix[" << i << "][" << d << "]";
      }
    }
    std::vector<int32_t> per_expert(static_cast<std::size_t>(epr), 0);
    for (int64_t j = 0; j < L.num_recv; ++j) {
      const auto [s, t] = expected[static_cast<std::size_t>(j)];
      ASSERT_EQ(L.recv_src_rank[static_cast<std::size_t>(j)], s);
      ASSERT_EQ(L.recv_src_token[static_cast<std::size_t>(j)], t);
      const auto& in = inputs[static_cast<std::size_t>(s)];
      EXPECT_EQ(layouts[static_cast<std::size_t>(s)]
                    .send_slot[static_cast<std::size_t>(t * num_ranks + d)],
                j);
      std::set<int> local_experts;
      for (int k = 0; k < c.top_k; ++k) {
        const auto i = static_cast<std::size_t>(t * c.top_k + k);
        const int64_t e = in.topk_idx[i];
        const auto o = static_cast<std::size_t>(j * c.top_k + k);
        if (e >= 0 && e / epr == d) {
          EXPECT_EQ(L.recv_expert_idx[o], e - d * epr);
          EXPECT_EQ(L.recv_weights[o], in.topk_weights[i]);
          local_experts.insert(static_cast<int>(e - d * epr));
        } else {
          EXPECT_EQ(L.recv_expert_idx[o], -1);
          EXPECT_EQ(L.recv_weights[o], 0.0f);
        }
      }
      for (int e : local_experts) ++per_expert[static_cast<std::size_t>(e)];
      for (int64_t h = 0; h < c.hidden; ++h) {
        ASSERT_EQ(L.recv_x[static_cast<std::size_t>(j * c.hidden + h)], identity_value(s, t, h));
      }
    }
    EXPECT_EQ(L.tokens_per_local_expert, per_expert) << "rank " << d;
  }
  // A send slot is set exactly where the token has a selection on that rank.
  for (int s = 0; s < num_ranks; ++s) {
    const auto& in = inputs[static_cast<std::size_t>(s)];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int d = 0; d < num_ranks; ++d) {
        bool any = false;
        for (int k = 0; k < c.top_k; ++k) {
          const int64_t e = in.topk_idx[static_cast<std::size_t>(t * c.top_k + k)];
          any |= e >= 0 && e / epr == d;
        }
        EXPECT_EQ(layouts[static_cast<std::size_t>(s)]
                          .send_slot[static_cast<std::size_t>(t * num_ranks + d)] >= 0,
                  any);
      }
    }
  }
}

// combine(dispatch(x)) with expert_out = received rows is fan-out * x (+ bias); exact here because
// the payloads are small integers.
void check_round_trip(const BufferConfig& c, std::span<const ref::RankInput> inputs,
                      std::span<const ref::RankLayout> layouts, bool with_bias) {
  const int num_ranks = static_cast<int>(inputs.size());
  std::vector<std::vector<uint16_t>> expert_out;
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  for (int s = 0; s < num_ranks; ++s) {
    const auto& in = inputs[static_cast<std::size_t>(s)];
    std::vector<uint16_t> b0, b1;
    if (with_bias) {
      for (int64_t i = 0; i < in.num_tokens * c.hidden; ++i) {
        b0.push_back(float_to_bf16(static_cast<float>(i % 5)));
        b1.push_back(float_to_bf16(static_cast<float>(i % 3) - 1.0f));
      }
    }
    const auto y = ref::combine(c, s, layouts, expert_out, b0, b1);
    ASSERT_EQ(y.size(), static_cast<std::size_t>(in.num_tokens * c.hidden));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      int fan_out = 0;
      for (int d = 0; d < num_ranks; ++d) {
        fan_out += layouts[static_cast<std::size_t>(s)]
                       .send_slot[static_cast<std::size_t>(t * num_ranks + d)] >= 0;
      }
      for (int64_t h = 0; h < c.hidden; ++h) {
        const auto i = static_cast<std::size_t>(t * c.hidden + h);
        float want = static_cast<float>(fan_out) * bf16_to_float(in.x[i]);
        if (with_bias) want += bf16_to_float(b0[i]) + bf16_to_float(b1[i]);
        ASSERT_EQ(bf16_to_float(y[i]), want) << "rank " << s << " token " << t << " col " << h;
      }
    }
  }
}

// identity_bf16: finite, its biased exponent inside the requested window, and different for
// neighbouring ranks, tokens or columns far more often than not.
TEST(EpReference, IdentityValuesStayInTheirExponentWindow) {
  int num_equal_neighbours = 0, num_samples = 0;
  for (int rank = 0; rank < 4; ++rank) {
    for (int64_t token = 0; token < 64; ++token) {
      for (int64_t col = 0; col < 64; ++col) {
        for (auto [low, count] : {std::pair{118u, 16u}, std::pair{112u, 24u}}) {
          const uint16_t v = ref::identity_bf16(rank, token, col, low, count);
          const unsigned exponent = (v >> 7) & 0xFFu;
          ASSERT_GE(exponent, low);
          ASSERT_LT(exponent, low + count);
        }
        const uint16_t v = ref::identity_bf16(rank, token, col);
        num_equal_neighbours += v == ref::identity_bf16(rank + 1, token, col);
        num_equal_neighbours += v == ref::identity_bf16(rank, token + 1, col);
        num_equal_neighbours += v == ref::identity_bf16(rank, token, col + 1);
        num_samples += 3;
      }
    }
  }
  EXPECT_LT(num_equal_neighbours, num_samples / 100);
}

TEST(EpReference, RandomRoutingsAndMasks) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 60; ++trial) {
    const int num_ranks = 1 + trial % 4;
    BufferConfig c{.max_tokens = 64, .hidden = 8 * (1 + trial % 3),
                   .num_experts = num_ranks * (1 + trial % 5), .top_k = 1 + trial % 6};
    c.top_k = std::min(c.top_k, c.num_experts);
    std::vector<int64_t> tokens;
    for (int r = 0; r < num_ranks; ++r) tokens.push_back(static_cast<int64_t>(rng() % 65));
    const double mask_ratio = (trial % 3) * 0.3;
    auto inputs = make_inputs(c, num_ranks, tokens, mask_ratio, Routing::kRandom, rng);
    const auto layouts = ref::dispatch(c, inputs);
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    check_layout(c, inputs, layouts);
    check_round_trip(c, inputs, layouts, trial % 2 == 0);
  }
}

TEST(EpReference, EdgeCases) {
  std::mt19937 rng(99);
  const BufferConfig c{.max_tokens = 32, .hidden = 16, .num_experts = 8, .top_k = 3};
  for (Routing routing : {Routing::kAllToRank0, Routing::kNoneToLastRank, Routing::kAllMasked}) {
    auto inputs = make_inputs(c, 4, {32, 0, 17, 5}, 0.0, routing, rng);
    const auto layouts = ref::dispatch(c, inputs);
    check_layout(c, inputs, layouts);
    check_round_trip(c, inputs, layouts, true);
    check_round_trip(c, inputs, layouts, false);
    if (routing == Routing::kAllToRank0) {
      EXPECT_EQ(layouts[0].num_recv, 32 + 17 + 5);
      for (int d = 1; d < 4; ++d) EXPECT_EQ(layouts[static_cast<std::size_t>(d)].num_recv, 0);
    }
    if (routing == Routing::kNoneToLastRank) {
      EXPECT_EQ(layouts[3].num_recv, 0);
    }
    if (routing == Routing::kAllMasked) {
      for (const auto& L : layouts) EXPECT_EQ(L.num_recv, 0);
    }
  }
  // T = 0 everywhere.
  auto empty = make_inputs(c, 2, {0, 0}, 0.0, Routing::kRandom, rng);
  const auto layouts = ref::dispatch(c, empty);
  EXPECT_EQ(layouts[0].num_recv, 0);
  EXPECT_EQ(layouts[1].num_recv, 0);
  check_round_trip(c, empty, layouts, true);
}

TEST(EpReference, FullyMaskedTokenReturnsBiasOrZero) {
  const BufferConfig c{.max_tokens = 4, .hidden = 8, .num_experts = 2, .top_k = 2};
  std::vector<ref::RankInput> inputs(2);
  for (auto& in : inputs) {
    in.num_tokens = 1;
    in.x.assign(8, float_to_bf16(3.0f));
    in.topk_idx = {-1, -1};
    in.topk_weights = {0.5f, 0.5f};
  }
  const auto layouts = ref::dispatch(c, inputs);
  std::vector<std::vector<uint16_t>> expert_out(2);
  std::vector<uint16_t> bias(8, float_to_bf16(1.5f));
  const auto with_bias = ref::combine(c, 0, layouts, expert_out, bias, {});
  const auto without = ref::combine(c, 0, layouts, expert_out, {}, {});
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(bf16_to_float(with_bias[static_cast<std::size_t>(h)]), 1.5f);
    EXPECT_EQ(bf16_to_float(without[static_cast<std::size_t>(h)]), 0.0f);
  }
}

TEST(EpReference, BadInputIsAClearError) {
  const BufferConfig c{.max_tokens = 4, .hidden = 8, .num_experts = 4, .top_k = 1};
  std::vector<ref::RankInput> inputs(2);
  for (auto& in : inputs) {
    in.num_tokens = 1;
    in.x.assign(8, 0);
    in.topk_idx = {1};
    in.topk_weights = {1.0f};
  }
  inputs[1].topk_idx = {4};
  EXPECT_THROW(ref::dispatch(c, inputs), weft::Error);
  inputs[1].topk_idx = {-2};
  EXPECT_THROW(ref::dispatch(c, inputs), weft::Error);
  inputs[1].topk_idx = {0};
  inputs[1].num_tokens = 5;
  EXPECT_THROW(ref::dispatch(c, inputs), weft::Error);
  BufferConfig bad = c;
  bad.hidden = 12;  // 24 bytes: not a multiple of 16
  EXPECT_THROW(bad.validate(2), weft::Error);
  bad = c;
  bad.num_experts = 3;
  EXPECT_THROW(bad.validate(2), weft::Error);
}

TEST(EpReference, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
  // 1 + 2^-8 lies halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256.0f)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256.0f)), 1.0f + 4.0f / 256.0f);
}

}  // namespace
