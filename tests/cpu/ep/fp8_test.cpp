// The fp8 per-token cast, the packed row layout and its inverse, and fp8 dispatch in the CPU
// reference, each checked against an independent statement of the contract (types.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_inputs.hpp"
#include "weft/core/error.hpp"
#include "weft/ep/reference.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::e4m3_to_float;
using weft::ep::float_to_e4m3;
using weft::ep::fp8_row_layout;
namespace ref = weft::ep::reference;

// The e4m3 code nearest to v by brute force over every finite code, ties to the even code
// (mantissa lsb 0), beyond 448 saturating: the independent statement of round-to-nearest-even.
uint8_t nearest_e4m3(float v) {
  const bool negative = std::signbit(v);
  const double a = std::fabs(double(v));
  int best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7E; ++code) {
    const double distance = std::fabs(double(e4m3_to_float(uint8_t(code))) - a);
    if (distance < best_distance || (distance == best_distance && (code & 1) == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return uint8_t(best | (negative ? 0x80 : 0));
}

TEST(EpFp8, E4m3DecodesEveryCodeAndRoundTrips) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0xC0), -2.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(code))), code) << code;
  }
}

TEST(EpFp8, E4m3RoundsToNearestEvenAndSaturates) {
  // Every midpoint between adjacent finite codes goes to the even one.
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = e4m3_to_float(uint8_t(code));
    const float hi = e4m3_to_float(uint8_t(code + 1));
    const float mid = (lo + hi) / 2;  // exact: both are short binary fractions
    EXPECT_EQ(float_to_e4m3(mid), (code & 1) == 0 ? code : code + 1) << code;
    EXPECT_EQ(float_to_e4m3(-mid), ((code & 1) == 0 ? code : code + 1) | 0x80) << code;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float v = std::exp2(exponent(rng)) * (rng() % 2 ? 1.0f : -1.0f);
    ASSERT_EQ(float_to_e4m3(v), nearest_e4m3(v)) << v;
  }
  EXPECT_EQ(float_to_e4m3(460.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
}

TEST(EpFp8, RowLayoutSizesAndPaddingRule) {
  const auto h128 = fp8_row_layout(128);  // a 4-byte scale row: raw 132 bytes, padded to 144
  EXPECT_EQ(h128.num_scales, 1);
  EXPECT_EQ(h128.scales_offset, 128);
  EXPECT_EQ(h128.raw_bytes, 132);
  EXPECT_EQ(h128.row_bytes, 144);
  EXPECT_EQ(fp8_row_layout(2048).row_bytes, 2112);  // 512 would cost 21%
  EXPECT_EQ(fp8_row_layout(4096).row_bytes, 4224);  // 512 would cost 9%
  EXPECT_EQ(fp8_row_layout(7168).raw_bytes, 7392);
  EXPECT_EQ(fp8_row_layout(7168).row_bytes, 7680);  // 512 costs 3.9%
  for (int64_t hidden = 128; hidden <= 32768; hidden += 128) {
    const auto l = fp8_row_layout(hidden);
    ASSERT_EQ(l.raw_bytes, hidden + 4 * (hidden / 128));
    ASSERT_EQ(l.row_bytes % 16, 0);
    ASSERT_GE(l.row_bytes, l.raw_bytes);
    ASSERT_LE(l.row_bytes, 2 * hidden) << "fits a bf16 row of the same hidden";
    const int64_t pad512 = (l.raw_bytes + 511) / 512 * 512 - l.raw_bytes;
    const bool want512 = double(pad512) <= weft::ep::kFp8Row512MaxPaddingFraction * l.raw_bytes;
    ASSERT_EQ(l.row_bytes, want512 ? l.raw_bytes + pad512 : (l.raw_bytes + 15) / 16 * 16)
        << hidden;
  }
  EXPECT_THROW(fp8_row_layout(0), weft::Error);
  EXPECT_THROW(fp8_row_layout(100), weft::Error);
  EXPECT_THROW(fp8_row_layout(7168 + 64), weft::Error);
}

std::vector<uint16_t> random_bf16(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(n);
  for (auto& v : x) v = weft::ep::float_to_bf16(normal(rng) * std::exp2(float(rng() % 16) - 8));
  return x;
}

// max |x| over group g (128 elements) of token t of bf16 rows of hidden elements.
float group_amax(const std::vector<uint16_t>& x, int64_t hidden, int64_t t, int64_t g) {
  float amax = 0.0f;
  for (int64_t i = 0; i < 128; ++i) {
    amax = std::max(amax,
                    std::fabs(weft::ep::bf16_to_float(x[std::size_t(t * hidden + g * 128 + i)])));
  }
  return amax;
}

TEST(EpFp8, CastMatchesTheStatedFormulaAndUnpacks) {
  std::mt19937 rng(11);
  for (int64_t hidden : {128, 256, 384, 2048, 7168}) {
    const int64_t T = 5;
    auto x = random_bf16(std::size_t(T * hidden), rng);
    // Group 1 of token 2 all zero (amax clamps to kFp8MinAmax); token 3 has a -0.
    if (hidden > 128) std::fill_n(x.begin() + 2 * hidden + 128, 128, uint16_t(0));
    x[std::size_t(3 * hidden + 5)] = 0x8000;
    const auto rows = ref::cast_to_fp8(hidden, T, x);
    const auto l = fp8_row_layout(hidden);
    ASSERT_EQ(rows.size(), std::size_t(T * l.row_bytes));
    const auto unpacked = ref::unpack_fp8(hidden, T, rows);
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = rows.data() + t * l.row_bytes;
      for (int64_t b = l.raw_bytes; b < l.row_bytes; ++b) ASSERT_EQ(row[b], 0) << "padding";
      for (int64_t g = 0; g < hidden / 128; ++g) {
        const float amax = group_amax(x, hidden, t, g);
        // torch's amax / 448.0 and 448.0 / amax on the GPU: products with reciprocals.
        const float want_scale = std::max(amax, 1e-4f) * (1.0f / 448.0f);
        float scale;
        std::memcpy(&scale, row + hidden + 4 * g, 4);
        ASSERT_EQ(scale, want_scale);
        ASSERT_EQ(unpacked.scales[std::size_t(t * (hidden / 128) + g)], scale);
        for (int64_t i = 0; i < 128; ++i) {
          const auto h = std::size_t(t * hidden + g * 128 + i);
          const float v =
              weft::ep::bf16_to_float(x[h]) * ((1.0f / std::max(amax, 1e-4f)) * 448.0f);
          ASSERT_EQ(row[g * 128 + i], nearest_e4m3(v)) << "token " << t << " col " << g * 128 + i;
          ASSERT_EQ(unpacked.payload[h], row[g * 128 + i]);
          // Dequantised: within e4m3's half step (2^-4 relative, or half a subnormal step).
          const float back = e4m3_to_float(row[g * 128 + i]) * scale;
          const float exact = weft::ep::bf16_to_float(x[h]);
          ASSERT_LE(std::fabs(back - exact), std::fabs(exact) / 16 + scale * std::ldexp(1.0f, -10))
              << back << " vs " << exact;
          if (amax >= 1e-4f && std::fabs(exact) == amax) {
            ASSERT_EQ(row[g * 128 + i] & 0x7F, 0x7E) << "a group's largest magnitude is 448";
          }
        }
      }
    }
    EXPECT_EQ(ref::dequantize_fp8(hidden, T, rows).size(), std::size_t(T * hidden));
    if (hidden > 128) {
      EXPECT_EQ(unpacked.payload[std::size_t(2 * hidden + 130)], 0);
    }
    EXPECT_EQ(unpacked.payload[std::size_t(3 * hidden + 5)], 0x80);
  }
  // A non-zero padding byte is rejected by the inverse.
  std::vector<uint16_t> x(128, weft::ep::float_to_bf16(1.0f));
  auto rows = ref::cast_to_fp8(128, 1, x);
  EXPECT_EQ(rows[0], 0x7E);  // 1.0 * 448 / 1.0
  rows[140] = 1;
  EXPECT_THROW(ref::unpack_fp8(128, 1, rows), weft::Error);
  EXPECT_THROW(ref::cast_to_fp8(128, 2, x), weft::Error);
}

float scale_of(const std::vector<uint8_t>& rows, int64_t hidden, int64_t g) {
  float scale;
  std::memcpy(&scale, rows.data() + hidden + 4 * g, 4);
  return scale;
}

TEST(EpFp8, RoundScaleIsThePowerOfTwoAtOrAbove) {
  using weft::ep::fp8_round_scale;
  EXPECT_EQ(fp8_round_scale(1.0f), 1.0f);
  EXPECT_EQ(fp8_round_scale(0.75f), 1.0f);
  EXPECT_EQ(fp8_round_scale(1.0f + 0x1p-23f), 2.0f);
  EXPECT_EQ(fp8_round_scale(3.0f), 4.0f);
  EXPECT_EQ(fp8_round_scale(0x1p-20f), 0x1p-20f);
  EXPECT_EQ(fp8_round_scale(448.0f), 512.0f);
  EXPECT_EQ(fp8_round_scale(0.5f - 0x1p-25f), 0.5f);
  EXPECT_EQ(fp8_round_scale(1e-4f / 448.0f), 0x1p-22f);
  EXPECT_EQ(fp8_round_scale(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
}

// round_scale on hand-computed groups (one token, one group each): the scale is the power of two
// at or above amax / 448 and q = e4m3(x / scale).
TEST(EpFp8, CastWithRoundScaleMatchesHandComputedGroups) {
  using weft::ep::float_to_bf16;
  const int64_t G = 8;
  const int64_t hidden = 128 * G;
  std::vector<uint16_t> x(std::size_t(hidden), float_to_bf16(1.0f));
  auto group = [&](int64_t g) { return x.begin() + g * 128; };
  // 0: all 1.0: amax / 448 = 2^-8.8 -> scale 2^-8, q = 256 = 0x78.
  // 1: all 0: amax clamps to 1e-4 -> scale 2^-22, q = 0.
  std::fill_n(group(1), 128, uint16_t(0));
  // 2: all 2^-16 (amax below 1e-4): scale 2^-22, q = 2^6 = 0x68.
  std::fill_n(group(2), 128, float_to_bf16(0x1p-16f));
  // 3: +-448 and 1.0: scale exactly 1 (amax / 448 is a power of two); 448 saturates nothing:
  //    0x7E / 0xFE, 1.0 = 0x38.
  group(3)[0] = float_to_bf16(448.0f);
  group(3)[1] = float_to_bf16(-448.0f);
  // 4: 464 and 3.0: scale 2; 232 is a tie of 224 and 240 -> the even 224 = 0x76; 1.5 = 0x3C.
  std::fill_n(group(4), 128, float_to_bf16(3.0f));
  group(4)[0] = float_to_bf16(464.0f);
  // 5: NaN and -2.0: the NaN does not count (amax 2 -> scale 2^-7); -256 = 0xF8, NaN = 0x7F.
  std::fill_n(group(5), 128, float_to_bf16(-2.0f));
  group(5)[0] = 0x7FC0;
  // 6: +inf and 1.0: amax and scale infinite, 1 / scale = 0: 1.0 -> 0, inf * 0 = NaN -> 0x7F.
  group(6)[0] = 0x7F80;
  // 7: 1.0 and 2^-12: scale 2^-8, 2^-12 / 2^-8 = 2^-4 = 0x18 (a normal: exponent 3).
  group(7)[1] = float_to_bf16(0x1p-12f);
  const auto rows = ref::cast_to_fp8(hidden, 1, x, /*round_scale=*/true);
  const float want_scales[G] = {0x1p-8f, 0x1p-22f, 0x1p-22f, 1.0f, 2.0f, 0x1p-7f,
                                std::numeric_limits<float>::infinity(), 0x1p-8f};
  for (int64_t g = 0; g < G; ++g) EXPECT_EQ(scale_of(rows, hidden, g), want_scales[g]) << g;
  auto q = [&](int64_t g, int64_t i) { return int(rows[std::size_t(g * 128 + i)]); };
  EXPECT_EQ(q(0, 0), 0x78);
  EXPECT_EQ(q(0, 127), 0x78);
  EXPECT_EQ(q(1, 0), 0x00);
  EXPECT_EQ(q(2, 5), 0x68);
  EXPECT_EQ(q(3, 0), 0x7E);
  EXPECT_EQ(q(3, 1), 0xFE);
  EXPECT_EQ(q(3, 2), 0x38);
  EXPECT_EQ(q(4, 0), 0x76);
  EXPECT_EQ(q(4, 1), 0x3C);
  EXPECT_EQ(q(5, 0), 0x7F);
  EXPECT_EQ(q(5, 1), 0xF8);
  EXPECT_EQ(q(6, 0), 0x7F);
  EXPECT_EQ(q(6, 1), 0x00);
  EXPECT_EQ(q(7, 0), 0x78);
  EXPECT_EQ(q(7, 1), 0x18);
  // Without round_scale the same groups take amax * (1 / 448) (group 0: 1 / 448, q = 448).
  const auto plain = ref::cast_to_fp8(hidden, 1, x);
  EXPECT_EQ(scale_of(plain, hidden, 0), 1.0f / 448.0f);
  EXPECT_EQ(int(plain[0]), 0x7E);
  EXPECT_EQ(scale_of(plain, hidden, 1), 1e-4f * (1.0f / 448.0f));
  // amax 3 is where the orders differ: the scale is 3 * (1 / 448), not the quotient 3 / 448.
  const std::vector<uint16_t> threes(128, float_to_bf16(3.0f));
  const float three_scale = scale_of(ref::cast_to_fp8(128, 1, threes), 128, 0);
  EXPECT_EQ(three_scale, 3.0f * (1.0f / 448.0f));
  EXPECT_NE(three_scale, 3.0f / 448.0f);
}

// round_scale on random rows against an independent statement: the scale is the least 2^k at or
// above fp32 amax / 448 (found by search), q the nearest e4m3 of x / scale.
TEST(EpFp8, CastWithRoundScaleMatchesTheStatedFormula) {
  std::mt19937 rng(23);
  for (int64_t hidden : {128, 512, 7168}) {
    const int64_t T = 4;
    auto x = random_bf16(std::size_t(T * hidden), rng);
    std::fill_n(x.begin(), 128, uint16_t(0));
    const auto rows = ref::cast_to_fp8(hidden, T, x, true);
    const auto l = fp8_row_layout(hidden);
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = rows.data() + t * l.row_bytes;
      for (int64_t b = l.raw_bytes; b < l.row_bytes; ++b) ASSERT_EQ(row[b], 0) << "padding";
      for (int64_t g = 0; g < hidden / 128; ++g) {
        const float amax = group_amax(x, hidden, t, g);
        const float target = std::max(amax, 1e-4f) * (1.0f / 448.0f);
        int k = -40;
        while (std::ldexp(1.0f, k) < target) ++k;
        const float want_scale = std::ldexp(1.0f, k);
        float scale;
        std::memcpy(&scale, row + hidden + 4 * g, 4);
        ASSERT_EQ(scale, want_scale) << "token " << t << " group " << g;
        for (int64_t i = 0; i < 128; ++i) {
          const float v = weft::ep::bf16_to_float(x[std::size_t(t * hidden + g * 128 + i)]);
          ASSERT_EQ(row[g * 128 + i], nearest_e4m3(std::ldexp(v, -k)))
              << "token " << t << " col " << g * 128 + i;
        }
      }
    }
  }
}

// fp8 dispatch moves packed rows byte for byte; everything else equals the bf16 dispatch.
TEST(EpFp8, DispatchMovesPackedRowsWithTheBf16Layout) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 30; ++trial) {
    const int num_ranks = 1 + trial % 4;
    BufferConfig c{.max_tokens = 40, .hidden = 128 * (1 + trial % 3),
                   .num_experts = num_ranks * (1 + trial % 4), .top_k = 1 + trial % 5};
    c.top_k = std::min(c.top_k, c.num_experts);
    std::vector<int64_t> tokens;
    for (int r = 0; r < num_ranks; ++r) tokens.push_back(int64_t(rng() % 41));
    const auto inputs = weft::ep::test::make_inputs(c, num_ranks, tokens, (trial % 3) * 0.3, rng,
                                                    /*fp8=*/true);
    const auto bf16 = ref::dispatch(c, inputs);
    const auto fp8 = ref::dispatch(c, inputs, {.fp8 = true});
    const int64_t row_bytes = fp8_row_layout(c.hidden).row_bytes;
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    for (int d = 0; d < num_ranks; ++d) {
      const auto& F = fp8[std::size_t(d)];
      const auto& B = bf16[std::size_t(d)];
      ASSERT_EQ(F.num_recv, B.num_recv);
      EXPECT_EQ(F.recv_src_rank, B.recv_src_rank);
      EXPECT_EQ(F.recv_src_token, B.recv_src_token);
      EXPECT_EQ(F.recv_expert_idx, B.recv_expert_idx);
      EXPECT_EQ(F.recv_weights, B.recv_weights);
      EXPECT_EQ(F.tokens_per_local_expert, B.tokens_per_local_expert);
      EXPECT_EQ(F.send_slot, B.send_slot);
      EXPECT_TRUE(F.recv_x.empty());
      ASSERT_EQ(F.recv_x_fp8.size(), std::size_t(F.num_recv * row_bytes));
      for (int64_t j = 0; j < F.num_recv; ++j) {
        const auto& src = inputs[std::size_t(F.recv_src_rank[std::size_t(j)])].x_fp8;
        const int64_t t = F.recv_src_token[std::size_t(j)];
        ASSERT_TRUE(std::equal(src.begin() + t * row_bytes, src.begin() + (t + 1) * row_bytes,
                               F.recv_x_fp8.begin() + j * row_bytes))
            << "rank " << d << " row " << j;
      }
    }
  }
  // Wrong sizes and a hidden fp8 cannot pack are clear errors.
  const BufferConfig c{.max_tokens = 4, .hidden = 128, .num_experts = 2, .top_k = 1};
  auto inputs = weft::ep::test::make_inputs(c, 2, {2, 1}, 0.0, rng, true);
  inputs[1].x_fp8.pop_back();
  EXPECT_THROW(ref::dispatch(c, inputs, {.fp8 = true}), weft::Error);
  const BufferConfig c64{.max_tokens = 4, .hidden = 64, .num_experts = 2, .top_k = 1};
  EXPECT_THROW(ref::dispatch(c64, weft::ep::test::make_inputs(c64, 2, {1, 1}, 0.0, rng),
                             {.fp8 = true}),
               weft::Error);
}

}  // namespace
