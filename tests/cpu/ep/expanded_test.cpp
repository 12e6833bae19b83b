// The expanded layout (dispatch and combine, alignment, zero padding, overflow) and the
// cumulative per-expert receive statistics of the CPU reference, checked against an independent
// brute-force statement of the contract (types.hpp ExpandOptions, reference.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "test_inputs.hpp"
#include "weft/core/error.hpp"
#include "weft/ep/reference.hpp"

namespace {

using weft::ep::bf16_to_float;
using weft::ep::BufferConfig;
using weft::ep::ExpandOptions;
using weft::ep::float_to_bf16;
namespace ref = weft::ep::reference;
using weft::ep::test::make_inputs;

bool selects(const BufferConfig& c, const ref::RankInput& in, int64_t t, int64_t expert) {
  for (int k = 0; k < c.top_k; ++k) {
    if (in.topk_idx[std::size_t(t * c.top_k + k)] == expert) return true;
  }
  return false;
}

void check_expanded(const BufferConfig& c, const std::vector<ref::RankInput>& inputs,
                    const std::vector<ref::RankLayout>& layouts, const ref::DispatchOptions& o) {
  const int R = int(inputs.size());
  const int epr = c.num_experts / R;
  const int64_t row_bytes = o.fp8 ? weft::ep::fp8_row_layout(c.hidden).row_bytes : 0;
  const int64_t capacity = int64_t(c.expand_factor) * R * c.max_tokens;
  std::vector<std::vector<int32_t>> first_row(static_cast<std::size_t>(R));  // [s][t * R + d]
  for (int s = 0; s < R; ++s) {
    first_row[std::size_t(s)].assign(std::size_t(inputs[std::size_t(s)].num_tokens * R), -1);
  }
  for (int d = 0; d < R; ++d) {
    const auto& L = layouts[std::size_t(d)];
    ASSERT_TRUE(L.expanded);
    int64_t begin = 0;
    std::vector<std::vector<std::pair<int, int64_t>>> rows(static_cast<std::size_t>(epr));
    for (int e = 0; e < epr; ++e) {
      for (int s = 0; s < R; ++s) {
        for (int64_t t = 0; t < inputs[std::size_t(s)].num_tokens; ++t) {
          if (selects(c, inputs[std::size_t(s)], t, int64_t(d) * epr + e)) rows[std::size_t(e)].emplace_back(s, t);
        }
      }
      ASSERT_EQ(L.tokens_per_local_expert[std::size_t(e)], int32_t(rows[std::size_t(e)].size()));
      ASSERT_EQ(L.segment_begin[std::size_t(e)], begin);
      ASSERT_EQ(begin % o.expand.expert_alignment, 0);
      begin += (int64_t(rows[std::size_t(e)].size()) + o.expand.expert_alignment - 1) /
               o.expand.expert_alignment * o.expand.expert_alignment;
    }
    ASSERT_EQ(L.segment_begin[std::size_t(epr)], begin);
    ASSERT_EQ(L.rows_required, begin);
    ASSERT_EQ(L.overflowed, begin > capacity) << "rank " << d;
    if (L.overflowed) {
      EXPECT_EQ(L.num_recv, 0);
      EXPECT_TRUE(L.recv_src_rank.empty() && L.recv_x.empty() && L.recv_x_fp8.empty());
      continue;
    }
    ASSERT_EQ(L.num_recv, begin);
    for (int e = 0; e < epr; ++e) {
      for (int64_t j = L.segment_begin[std::size_t(e)]; j < L.segment_begin[std::size_t(e) + 1]; ++j) {
        const int64_t i = j - L.segment_begin[std::size_t(e)];
        const bool padding = i >= int64_t(rows[std::size_t(e)].size());
        const int s = padding ? -1 : rows[std::size_t(e)][std::size_t(i)].first;
        const int64_t t = padding ? -1 : rows[std::size_t(e)][std::size_t(i)].second;
        ASSERT_EQ(L.recv_src_rank[std::size_t(j)], s) << "rank " << d << " row " << j;
        ASSERT_EQ(L.recv_src_token[std::size_t(j)], t) << "rank " << d << " row " << j;
        for (int k = 0; k < c.top_k; ++k) {
          const auto o_k = std::size_t(j * c.top_k + k);
          const bool mine = !padding && inputs[std::size_t(s)].topk_idx[std::size_t(t * c.top_k + k)] ==
                                             int64_t(d) * epr + e;
          ASSERT_EQ(L.recv_expert_idx[o_k], mine ? e : -1);
          ASSERT_EQ(L.recv_weights[o_k],
                    mine ? inputs[std::size_t(s)].topk_weights[std::size_t(t * c.top_k + k)] : 0.0f);
        }
        if (o.fp8) {
          for (int64_t b = 0; b < row_bytes; ++b) {
            ASSERT_EQ(L.recv_x_fp8[std::size_t(j * row_bytes + b)],
                      padding ? 0 : inputs[std::size_t(s)].x_fp8[std::size_t(t * row_bytes + b)]);
          }
        } else {
          for (int64_t h = 0; h < c.hidden; ++h) {
            ASSERT_EQ(L.recv_x[std::size_t(j * c.hidden + h)],
                      padding ? 0 : weft::ep::test::identity_value(s, t, h));
          }
        }
        if (!padding && first_row[std::size_t(s)][std::size_t(t * R + d)] < 0) {
          first_row[std::size_t(s)][std::size_t(t * R + d)] = int32_t(j);
        }
      }
    }
  }
  for (int s = 0; s < R; ++s) EXPECT_EQ(layouts[std::size_t(s)].send_slot, first_row[std::size_t(s)]);
}

// expert_out = received rows: every token comes back as (distinct selected experts) * x + bias,
// exact with small-integer payloads.
void check_expanded_round_trip(const BufferConfig& c, const std::vector<ref::RankInput>& inputs,
                               const std::vector<ref::RankLayout>& layouts, bool with_bias) {
  const int R = int(inputs.size());
  std::vector<std::vector<uint16_t>> expert_out;
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  for (int s = 0; s < R; ++s) {
    const auto& in = inputs[std::size_t(s)];
    std::vector<uint16_t> b0, b1;
    if (with_bias) {
      for (int64_t i = 0; i < in.num_tokens * c.hidden; ++i) {
        b0.push_back(float_to_bf16(float(i % 5)));
        b1.push_back(float_to_bf16(float(i % 3) - 1.0f));
      }
    }
    const auto y = ref::combine(c, s, layouts, expert_out, b0, b1);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      int fan_out = 0;
      for (int64_t e = 0; e < c.num_experts; ++e) fan_out += selects(c, in, t, e);
      for (int64_t h = 0; h < c.hidden; ++h) {
        const auto i = std::size_t(t * c.hidden + h);
        float want = float(fan_out) * bf16_to_float(in.x[i]);
        if (with_bias) want += bf16_to_float(b0[i]) + bf16_to_float(b1[i]);
        ASSERT_EQ(bf16_to_float(y[i]), want) << "rank " << s << " token " << t << " col " << h;
      }
    }
  }
}

TEST(EpExpanded, RandomRoutingsAlignmentsAndMasks) {
  std::mt19937 rng(31);
  for (int trial = 0; trial < 60; ++trial) {
    const int R = 1 + trial % 4;
    BufferConfig c{.max_tokens = 48,
                   .hidden = trial % 5 == 0 ? 128 : 8 * (1 + trial % 3),
                   .num_experts = R * (1 + trial % 6),
                   .top_k = 1 + trial % 6,
                   .expand_factor = 32};
    c.top_k = std::min(c.top_k, c.num_experts);
    std::vector<int64_t> tokens;
    for (int r = 0; r < R; ++r) tokens.push_back(int64_t(rng() % 49));
    const bool fp8 = c.hidden == 128 && trial % 2 == 0;
    const ref::DispatchOptions o{
        .fp8 = fp8,
        .expand = {.enabled = true,
                   .expert_alignment = std::vector<int>{1, 4, 16, 128}[std::size_t(trial % 4)],
                   .zero_padding = true}};
    const auto inputs = make_inputs(c, R, tokens, (trial % 3) * 0.3, rng, fp8);
    const auto layouts = ref::dispatch(c, inputs, o);
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    check_expanded(c, inputs, layouts, o);
    if (!fp8) check_expanded_round_trip(c, inputs, layouts, trial % 2 == 1);
  }
}

TEST(EpExpanded, OverflowIsReportedAndNothingMoves) {
  std::mt19937 rng(8);
  // Every token selects 3 of rank 0's 4 experts: rank 0 needs 3 * (8 + 8) = 48 rows against a
  // capacity of expand_factor * 2 * 8.
  BufferConfig c{.max_tokens = 8, .hidden = 16, .num_experts = 8, .top_k = 3};
  const auto inputs = make_inputs(c, 2, {8, 8}, 0.0, rng, false, /*crowd_rank0=*/true);
  for (int factor : {1, 2, 3, 4}) {
    c.expand_factor = factor;
    const ref::DispatchOptions o{.expand = {.enabled = true}};
    const auto layouts = ref::dispatch(c, inputs, o);
    SCOPED_TRACE(testing::Message() << "expand_factor " << factor);
    check_expanded(c, inputs, layouts, o);
    EXPECT_EQ(layouts[0].rows_required, 48);
    EXPECT_EQ(layouts[0].overflowed, factor < 3) << "48 rows fit exactly at factor 3";
    EXPECT_FALSE(layouts[1].overflowed);
    std::vector<std::vector<uint16_t>> expert_out;
    for (const auto& L : layouts) expert_out.push_back(L.recv_x);
    if (factor < 3) {
      for (const auto& L : layouts) {  // no source has a row at the overflowed rank
        for (int64_t t = 0; t < L.num_tokens; ++t) EXPECT_EQ(L.send_slot[std::size_t(t * 2)], -1);
      }
      EXPECT_THROW(ref::combine(c, 0, layouts, expert_out, {}, {}), weft::Error);
    } else {
      check_expanded_round_trip(c, inputs, layouts, true);
    }
  }
  // Alignment padding counts towards the capacity: 5 tokens of 1 expert aligned to 64.
  const BufferConfig c1{
      .max_tokens = 5, .hidden = 16, .num_experts = 2, .top_k = 1, .expand_factor = 1};
  auto one = make_inputs(c1, 2, {5, 0}, 0.0, rng, false, true);
  const auto aligned = ref::dispatch(c1, one, {.expand = {.enabled = true, .expert_alignment = 64}});
  EXPECT_EQ(aligned[0].rows_required, 64);
  EXPECT_TRUE(aligned[0].overflowed);  // capacity 1 * 2 * 5 = 10
}

// Rank d sums a token's rows in fp32 and rounds once to bf16 before the source adds the ranks:
// 2^-8 (rank 0) + [1 + 2^-8] (rank 1) gives 1 + 2^-8 -> 1.0, where one flat fp32 sum would
// give 1 + 2^-7 (exact in bf16).
TEST(EpExpanded, CombineRoundsEachRanksPartialSumOnce) {
  const BufferConfig c{
      .max_tokens = 1, .hidden = 8, .num_experts = 4, .top_k = 3, .expand_factor = 1};
  std::vector<ref::RankInput> inputs(2);
  inputs[0] = {.num_tokens = 1, .x = std::vector<uint16_t>(8, float_to_bf16(1.0f)),
               .topk_idx = {0, 2, 3}, .topk_weights = {1, 1, 1}};
  inputs[1] = {.num_tokens = 0};
  const auto layouts = ref::dispatch(c, inputs, {.expand = {.enabled = true}});
  ASSERT_EQ(layouts[0].num_recv, 1);
  ASSERT_EQ(layouts[1].num_recv, 2);
  std::vector<std::vector<uint16_t>> expert_out(2);
  expert_out[0].assign(8, float_to_bf16(1.0f / 256));
  expert_out[1].assign(8, float_to_bf16(1.0f));
  expert_out[1].insert(expert_out[1].end(), 8, float_to_bf16(1.0f / 256));
  const auto y = ref::combine(c, 0, layouts, expert_out, {}, {});
  for (uint16_t v : y) EXPECT_EQ(bf16_to_float(v), 1.0f);
}

TEST(EpExpanded, DuplicateSelectionIsOneRowMarkedTwice) {
  const BufferConfig c{
      .max_tokens = 1, .hidden = 8, .num_experts = 2, .top_k = 3, .expand_factor = 2};
  std::vector<ref::RankInput> inputs(1);
  inputs[0] = {.num_tokens = 1, .x = std::vector<uint16_t>(8, float_to_bf16(2.0f)),
               .topk_idx = {1, -1, 1}, .topk_weights = {0.25f, 0.5f, 0.75f}};
  const auto L = ref::dispatch(
      c, inputs, {.expand = {.enabled = true, .expert_alignment = 2, .zero_padding = true}})[0];
  EXPECT_EQ(L.segment_begin, (std::vector<int64_t>{0, 0, 2}));
  EXPECT_EQ(L.tokens_per_local_expert, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(L.recv_expert_idx, (std::vector<int32_t>{1, -1, 1, -1, -1, -1}));
  EXPECT_EQ(L.recv_weights, (std::vector<float>{0.25f, 0.0f, 0.75f, 0.0f, 0.0f, 0.0f}));
  EXPECT_EQ(L.recv_src_rank, (std::vector<int32_t>{0, -1}));
}

TEST(EpExpanded, BadOptionsAreClearErrors) {
  std::mt19937 rng(3);
  const BufferConfig c{
      .max_tokens = 4, .hidden = 16, .num_experts = 4, .top_k = 2, .expand_factor = 1};
  const auto inputs = make_inputs(c, 2, {2, 2}, 0.0, rng);
  EXPECT_THROW(ref::dispatch(c, inputs, {.expand = {.enabled = true, .expert_alignment = 0}}),
               weft::Error);
  BufferConfig no_capacity = c;
  no_capacity.expand_factor = 0;  // the deduplicated layout still works, the expanded one throws
  EXPECT_NO_THROW(ref::dispatch(no_capacity, inputs));
  EXPECT_THROW(ref::dispatch(no_capacity, inputs, {.expand = {.enabled = true}}), weft::Error);
  BufferConfig negative = c;
  negative.expand_factor = -1;
  EXPECT_THROW(ref::dispatch(negative, inputs), weft::Error);
  BufferConfig too_much{.max_tokens = int64_t(1) << 24,
                        .hidden = 16,
                        .num_experts = 4,
                        .top_k = 2,
                        .expand_factor = 32};  // 32 x 4 x 2^24 = 2^31 rows: above 2^31 - 1
  EXPECT_NO_THROW(too_much.validate(2));
  EXPECT_THROW(too_much.validate(4), weft::Error);
  // An expanded layout cannot be combined with a deduplicated one.
  auto mixed = ref::dispatch(c, inputs, {.expand = {.enabled = true}});
  mixed[1] = ref::dispatch(c, inputs)[1];
  std::vector<std::vector<uint16_t>> expert_out{mixed[0].recv_x, mixed[1].recv_x};
  EXPECT_THROW(ref::combine(c, 0, mixed, expert_out, {}, {}), weft::Error);
}

// Fixed-stride segments hold exactly the rows of the packed layout's segments, each at
// e * segment_stride, followed by padding rows up to the next stride.
TEST(EpExpanded, FixedStrideSegmentsHoldThePackedSegmentsRows) {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 40; ++trial) {
    const int R = 1 + trial % 4;
    const BufferConfig c{.max_tokens = 24,
                         .hidden = 8 * (1 + trial % 3),
                         .num_experts = R * (1 + trial % 5),
                         .top_k = std::min(1 + trial % 6, R * (1 + trial % 5)),
                         .expand_factor = 1 + trial % 5};
    const int epr = c.num_experts / R;
    const int alignment = trial % 2 == 0 ? 1 : 4;
    const int64_t stride = (int64_t(R) * c.max_tokens + alignment - 1) / alignment * alignment;
    std::vector<int64_t> tokens;
    for (int r = 0; r < R; ++r) tokens.push_back(int64_t(rng() % 25));
    const auto inputs = make_inputs(c, R, tokens, (trial % 3) * 0.3, rng);
    const ExpandOptions packed{.enabled = true, .expert_alignment = alignment, .zero_padding = true};
    ExpandOptions fixed = packed;
    fixed.segment_stride = stride;
    BufferConfig big = c;
    big.expand_factor = epr * (alignment == 1 ? 1 : 2);
    const auto p_layouts = ref::dispatch(big, inputs, {.expand = packed});
    const auto f_layouts = ref::dispatch(big, inputs, {.expand = fixed});
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    for (int d = 0; d < R; ++d) {
      const auto& P = p_layouts[std::size_t(d)];
      const auto& F = f_layouts[std::size_t(d)];
      ASSERT_FALSE(F.overflowed);
      ASSERT_EQ(F.num_recv, epr * stride);
      ASSERT_EQ(F.rows_required, epr * stride);
      ASSERT_EQ(F.tokens_per_local_expert, P.tokens_per_local_expert);
      const auto H = std::size_t(c.hidden);
      const auto K = std::size_t(c.top_k);
      for (int e = 0; e < epr; ++e) {
        ASSERT_EQ(F.segment_begin[std::size_t(e)], e * stride);
        const auto count = std::size_t(P.tokens_per_local_expert[std::size_t(e)]);
        const auto pb = std::size_t(P.segment_begin[std::size_t(e)]);
        const auto fb = std::size_t(e) * std::size_t(stride);
        for (std::size_t i = 0; i < std::size_t(stride); ++i) {
          const std::size_t f = fb + i;
          if (i >= count) {
            ASSERT_EQ(F.recv_src_rank[f], -1) << "padding row " << f;
            continue;
          }
          const std::size_t p = pb + i;
          ASSERT_EQ(F.recv_src_rank[f], P.recv_src_rank[p]);
          ASSERT_EQ(F.recv_src_token[f], P.recv_src_token[p]);
          for (std::size_t k = 0; k < K; ++k) {
            ASSERT_EQ(F.recv_expert_idx[f * K + k], P.recv_expert_idx[p * K + k]);
            ASSERT_EQ(F.recv_weights[f * K + k], P.recv_weights[p * K + k]);
          }
          for (std::size_t h = 0; h < H; ++h) ASSERT_EQ(F.recv_x[f * H + h], P.recv_x[p * H + h]);
        }
      }
      ASSERT_EQ(F.segment_begin[std::size_t(epr)], epr * stride);
    }
    // The sources' send slots point at the same (segment, index) in both layouts.
    for (int s = 0; s < R; ++s) {
      for (int64_t t = 0; t < tokens[std::size_t(s)]; ++t) {
        for (int d = 0; d < R; ++d) {
          const auto i = std::size_t(t * R + d);
          const int32_t ps = p_layouts[std::size_t(s)].send_slot[i];
          const int32_t fs = f_layouts[std::size_t(s)].send_slot[i];
          ASSERT_EQ(ps < 0, fs < 0);
          if (ps < 0) continue;
          const auto& P = p_layouts[std::size_t(d)];
          int e = 0;
          while (P.segment_begin[std::size_t(e) + 1] <= ps) ++e;
          ASSERT_EQ(fs, e * stride + (ps - P.segment_begin[std::size_t(e)]));
        }
      }
    }
  }
}

TEST(EpExpanded, FixedStrideOverflowsWhereAnExpertExceedsIt) {
  std::mt19937 rng(5);
  // Every token selects both of rank 0's 2 experts: 8 + 8 rows each, against a stride of 12.
  const BufferConfig c{
      .max_tokens = 8, .hidden = 16, .num_experts = 4, .top_k = 2, .expand_factor = 4};
  const auto inputs = make_inputs(c, 2, {8, 8}, 0.0, rng, false, /*crowd_rank0=*/true);
  const auto layouts = ref::dispatch(c, inputs, {.expand = {.enabled = true, .segment_stride = 12}});
  EXPECT_TRUE(layouts[0].overflowed);
  EXPECT_EQ(layouts[0].rows_required, 2 * 16);
  EXPECT_EQ(layouts[0].num_recv, 0);
  EXPECT_EQ(layouts[0].segment_begin, (std::vector<int64_t>{0, 12, 32}));
  EXPECT_FALSE(layouts[1].overflowed);
  EXPECT_EQ(layouts[1].num_recv, 2 * 12);
  EXPECT_THROW(ref::dispatch(c, inputs, {.expand = {.enabled = true, .segment_stride = -1}}),
               weft::Error);
  const auto fits = ref::dispatch(c, inputs, {.expand = {.enabled = true, .segment_stride = 16}});
  EXPECT_FALSE(fits[0].overflowed);
}

// combine_weighted with exact values (small integers, power-of-two weights) against the
// contract stated directly: out[t] = sum over selections k with an expert of w[t][k] * row.
TEST(EpExpanded, WeightedCombineIsTheWeightedSumOfTheSelections) {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 30; ++trial) {
    const int R = 1 + trial % 3;
    const BufferConfig c{.max_tokens = 16,
                         .hidden = 8,
                         .num_experts = R * (2 + trial % 3),
                         .top_k = std::min(1 + trial % 4, R * (2 + trial % 3)),
                         .expand_factor = 2 + trial % 3};
    std::vector<int64_t> tokens;
    for (int r = 0; r < R; ++r) tokens.push_back(int64_t(rng() % 17));
    auto inputs = make_inputs(c, R, tokens, 0.3, rng);
    std::vector<std::vector<float>> weights(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& in = inputs[std::size_t(r)];
      for (auto& v : in.x) v = float_to_bf16(float(1 + rng() % 8));
      for (std::size_t i = 0; i < in.topk_idx.size(); ++i) {
        if (trial % 4 == 0 && i > 0 && rng() % 5 == 0) in.topk_idx[i] = in.topk_idx[i - 1];
        weights[std::size_t(r)].push_back(std::vector<float>{0.25f, 0.5f, 1.0f, 2.0f}[rng() % 4]);
      }
    }
    const int64_t stride = int64_t(R) * c.max_tokens;
    BufferConfig big = c;
    big.expand_factor = c.num_experts / R;
    for (const ExpandOptions& o :
         {ExpandOptions{.enabled = true}, ExpandOptions{.enabled = true, .segment_stride = stride}}) {
      const auto layouts = ref::dispatch(big, inputs, {.expand = o});
      std::vector<std::vector<uint16_t>> expert_out;
      for (const auto& L : layouts) expert_out.push_back(L.recv_x);  // each row is its token's x
      SCOPED_TRACE(testing::Message() << "trial " << trial << " stride " << o.segment_stride);
      for (int s = 0; s < R; ++s) {
        const auto y = ref::combine_weighted(big, s, layouts, expert_out, weights);
        const auto& in = inputs[std::size_t(s)];
        for (int64_t t = 0; t < in.num_tokens; ++t) {
          float w = 0.0f;
          for (int k = 0; k < c.top_k; ++k) {
            if (in.topk_idx[std::size_t(t * c.top_k + k)] >= 0) {
              w += weights[std::size_t(s)][std::size_t(t * c.top_k + k)];
            }
          }
          for (int64_t h = 0; h < c.hidden; ++h) {
            const auto i = std::size_t(t * c.hidden + h);
            ASSERT_EQ(bf16_to_float(y[i]), w * bf16_to_float(in.x[i])) << "rank " << s << " token " << t;
          }
        }
      }
    }
  }
}

// Accumulated over three dispatches with masked selections, against an independent count.
TEST(EpStats, CumulativeLocalExpertRecvStatsAccumulates) {
  std::mt19937 rng(17);
  const BufferConfig c{
      .max_tokens = 64, .hidden = 16, .num_experts = 12, .top_k = 4, .expand_factor = 1};
  const int R = 3, epr = 4;
  std::vector<std::vector<uint32_t>> stats(R, std::vector<uint32_t>(epr, 0));
  std::vector<std::vector<uint32_t>> want(R, std::vector<uint32_t>(epr, 0));
  for (int call = 0; call < 3; ++call) {
    const auto inputs = make_inputs(c, R, {64, int64_t(rng() % 65), 7}, 0.25, rng);
    for (bool expand : {false, true}) {
      const auto layouts = ref::dispatch(c, inputs, {.expand = {.enabled = expand}});
      if (expand) continue;  // same counts: checked below
      for (int d = 0; d < R; ++d) ref::accumulate_local_expert_recv_stats(layouts[std::size_t(d)], stats[std::size_t(d)]);
      const auto expanded = ref::dispatch(c, inputs, {.expand = {.enabled = true}});
      for (int d = 0; d < R; ++d) {
        EXPECT_EQ(layouts[std::size_t(d)].tokens_per_local_expert,
                  expanded[std::size_t(d)].tokens_per_local_expert);
      }
    }
    for (int d = 0; d < R; ++d) {
      for (int e = 0; e < epr; ++e) {
        for (const auto& in : inputs) {
          for (int64_t t = 0; t < in.num_tokens; ++t) want[std::size_t(d)][std::size_t(e)] += selects(c, in, t, d * epr + e);
        }
      }
    }
    EXPECT_EQ(stats, want) << "after call " << call;
  }
  const auto layouts = ref::dispatch(c, make_inputs(c, R, {1, 1, 1}, 0.0, rng));
  std::vector<uint32_t> wrong(epr + 1);
  EXPECT_THROW(ref::accumulate_local_expert_recv_stats(layouts[0], wrong), weft::Error);
}

}  // namespace

// DeepEP's low-latency results of a fixed-stride dispatch (reference::low_latency_layout) against
// a brute-force statement: src_info the tokens selecting e in (rank, token) order then -1,
// layout_range's counts and prefixes from the inputs, the scales of those tokens' packed rows in
// the column-major [E, S, G] order, their exponent bytes four to a word.
TEST(EpExpanded, LowLatencyLayoutOfFixedStrideSegments) {
  std::mt19937 rng(43);
  for (int trial = 0; trial < 12; ++trial) {
    const int R = 1 + trial % 4;
    const int num_experts = R * (1 + trial % 3);
    const BufferConfig c{.max_tokens = 12, .hidden = trial % 2 == 0 ? 512 : 384,
                         .num_experts = num_experts, .top_k = std::min(3, num_experts),
                         .expand_factor = 1 + trial % 3};
    const int epr = c.num_experts / R;
    const int64_t S = int64_t(R) * c.max_tokens;
    std::vector<int64_t> tokens;
    for (int r = 0; r < R; ++r) tokens.push_back(int64_t(rng() % 13));
    auto inputs = make_inputs(c, R, tokens, 0.3, rng, true);
    for (int r = 0; r < R; ++r) {  // power-of-two scales, so that the UE8M0 bytes are exact
      auto& in = inputs[std::size_t(r)];
      in.x_fp8 = ref::cast_to_fp8(c.hidden, in.num_tokens, in.x, true);
    }
    const auto layouts =
        ref::dispatch(c, inputs, {.fp8 = true, .expand = {.enabled = true, .segment_stride = S}});
    const auto l = weft::ep::fp8_row_layout(c.hidden);
    const int64_t G = l.num_scales;
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    for (int d = 0; d < R; ++d) {
      const auto got = ref::low_latency_layout(c, R, S, layouts[std::size_t(d)]);
      ASSERT_EQ(got.src_info.size(), std::size_t(epr * S));
      ASSERT_EQ(got.layout_range.size(), std::size_t(epr * R));
      ASSERT_EQ(got.scales.size(), std::size_t(epr * S * G));
      ASSERT_EQ(got.ue8m0.size(), G % 4 == 0 ? std::size_t(epr * S * G / 4) : 0u);
      for (int e = 0; e < epr; ++e) {
        const int64_t global = int64_t(d) * epr + e;
        int64_t s = 0;
        for (int r = 0; r < R; ++r) {
          const auto& in = inputs[std::size_t(r)];
          const int64_t begin = s;
          for (int64_t t = 0; t < in.num_tokens; ++t) {
            if (!selects(c, in, t, global)) continue;
            ASSERT_EQ(got.src_info[std::size_t(e * S + s)], t);
            for (int64_t g = 0; g < G; ++g) {
              float want;
              std::memcpy(&want, in.x_fp8.data() + t * l.row_bytes + c.hidden + 4 * g, 4);
              ASSERT_EQ(got.scales[std::size_t((e * G + g) * S + s)], want);
            }
            for (int64_t w = 0; w < G / 4 && G % 4 == 0; ++w) {
              const auto word = uint32_t(got.ue8m0[std::size_t((e * G / 4 + w) * S + s)]);
              for (int i = 0; i < 4; ++i) {
                float scale;
                std::memcpy(&scale, in.x_fp8.data() + t * l.row_bytes + c.hidden + 4 * (4 * w + i),
                            4);
                ASSERT_EQ(std::ldexp(1.0f, int((word >> (8 * i)) & 0xFF) - 127), scale);
              }
            }
            ++s;
          }
          ASSERT_EQ(got.layout_range[std::size_t(e * R + r)], (begin << 32) | (s - begin));
        }
        for (; s < S; ++s) ASSERT_EQ(got.src_info[std::size_t(e * S + s)], -1);
      }
    }
  }
  // Not a fixed-stride layout: refused.
  const BufferConfig c{.max_tokens = 4, .hidden = 128, .num_experts = 2, .top_k = 1,
                       .expand_factor = 1};
  std::mt19937 r2(1);
  const auto inputs = make_inputs(c, 1, {4}, 0.0, r2);
  const auto packed = ref::dispatch(c, inputs, {.expand = {.enabled = true}});
  EXPECT_THROW(ref::low_latency_layout(c, 1, 4, packed[0]), weft::Error);
}
