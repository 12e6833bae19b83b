// The CPU reference's verdict on tokens over max_tokens (reference.hpp): a deduplicated dispatch
// in which any rank has more than max_tokens tokens moves nothing at any rank and reports the
// largest T everywhere; the expanded dispatch refuses such a T; combine of it throws.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/ep/reference.hpp"
#include "test_inputs.hpp"

namespace {

using weft::ep::BufferConfig;
namespace ref = weft::ep::reference;
using weft::ep::test::make_inputs;

TEST(EpReferenceTokensOverflow, AnyRankOverMaxTokensMovesNothingAndReportsTheLargestT) {
  const BufferConfig c{.max_tokens = 16, .hidden = 8, .num_experts = 12, .top_k = 3};
  std::mt19937 rng(77);
  for (int num_ranks = 1; num_ranks <= 4; ++num_ranks) {
    for (int over = 0; over < num_ranks; ++over) {
      std::vector<int64_t> tokens(static_cast<std::size_t>(num_ranks), 9);
      tokens[static_cast<std::size_t>(over)] = 17 + over;  // one rank over
      if (num_ranks > 2 && over != 0) tokens[0] = 16;      // exactly max_tokens is not over
      const auto inputs = make_inputs(c, num_ranks, tokens, 0.2, rng);
      const auto layouts = ref::dispatch(c, inputs);
      const auto R = static_cast<std::size_t>(num_ranks);
      for (std::size_t d = 0; d < R; ++d) {
        const auto& L = layouts[d];
        EXPECT_EQ(L.tokens_required, 17 + over) << "rank " << d;
        EXPECT_EQ(L.num_recv, 0);
        EXPECT_TRUE(L.recv_x.empty() && L.recv_src_rank.empty() && L.recv_expert_idx.empty());
        EXPECT_EQ(L.num_tokens, tokens[d]);
        EXPECT_EQ(L.send_slot, std::vector<int32_t>(static_cast<std::size_t>(tokens[d]) * R, -1));
        EXPECT_EQ(L.tokens_per_local_expert,
                  std::vector<int32_t>(static_cast<std::size_t>(c.num_local_experts(num_ranks)), 0));
        EXPECT_EQ(L.rank_prefix_matrix, std::vector<int32_t>(R * R, 0));
      }
      std::vector<std::vector<uint16_t>> expert_out(R);
      EXPECT_THROW(ref::combine(c, 0, layouts, expert_out, {}, {}), weft::Error);
    }
  }
}

TEST(EpReferenceTokensOverflow, TheLargestTOfSeveralOverflowingRanksIsReported) {
  const BufferConfig c{.max_tokens = 8, .hidden = 8, .num_experts = 4, .top_k = 2};
  std::mt19937 rng(5);
  const auto layouts = ref::dispatch(c, make_inputs(c, 4, {9, 30, 8, 12}, 0.0, rng));
  for (const auto& L : layouts) EXPECT_EQ(L.tokens_required, 30);
}

TEST(EpReferenceTokensOverflow, AtMostMaxTokensEverywhereIsANormalDispatch) {
  const BufferConfig c{.max_tokens = 8, .hidden = 8, .num_experts = 4, .top_k = 2};
  std::mt19937 rng(6);
  const auto inputs = make_inputs(c, 2, {8, 8}, 0.0, rng);
  const auto layouts = ref::dispatch(c, inputs);
  int64_t rows = 0;
  for (const auto& L : layouts) {
    EXPECT_EQ(L.tokens_required, 0);
    rows += L.num_recv;
  }
  EXPECT_GT(rows, 0);
}

TEST(EpReferenceTokensOverflow, TheExpandedDispatchRefusesTOverMaxTokens) {
  const BufferConfig c{.max_tokens = 8, .hidden = 8, .num_experts = 4, .top_k = 2,
                       .expand_factor = 2};
  std::mt19937 rng(7);
  const auto inputs = make_inputs(c, 2, {9, 3}, 0.0, rng);
  EXPECT_THROW(ref::dispatch(c, inputs, {.expand = {.enabled = true}}), weft::Error);
}

}  // namespace
