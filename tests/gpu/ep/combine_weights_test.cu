// combine with top-k weights (CombineInputs::topk_weights -> combined_weights, DeepEP's
// combined_topk_weights) on every visible GPU, one process driving all of them: every element of
// out and of combined_weights checked bit for bit against the CPU reference
// (reference::combine, reference::combine_weights), outputs poisoned before each call, fresh
// random inputs (weights of mixed sign and magnitude, so that another order of the additions
// would show), K from 1 to top_k, and hundreds of back-to-back calls. At one GPU every row is
// the own rank's (read straight from topk_weights); the 2-rank variants route through a peer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"
#include "ep_fixture.hpp"

namespace {

using weft::ep::CountMode;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::count_differences;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::EpTest;
using weft::ep::testing::make_inputs;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::upload;

// Elements whose bits differ (so a NaN left from the poison counts as wrong).
std::size_t count_bit_differences(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::max(got.size(), want.size());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    wrong += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
  }
  return wrong;
}

class EpCombineWeightsTest : public EpTest {
 protected:
  // Every rank's dispatch of `inputs` (uploaded here, kExact): the results, counts known.
  std::vector<weft::ep::DispatchResult> upload_and_dispatch(
      const std::vector<ref::RankInput>& inputs) {
    put_inputs(inputs);
    return dispatch_all(inputs, CountMode::kExact);
  }

  // One combine with topk_weights on every rank, every element of out and combined_weights
  // checked. K columns of weights; from_window: the weights are recv_weights itself (K = top_k)
  // and expert_out is recv_x (zero copy), else both are fresh random arrays.
  void combine_checked(const std::vector<ref::RankInput>& inputs,
                       const std::vector<ref::RankLayout>& layouts,
                       const std::vector<weft::ep::DispatchResult>& res, int K, int num_bias,
                       bool from_window, std::mt19937& rng) {
    const int64_t H = config.hidden;
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-24, 24);
    std::vector<std::vector<uint16_t>> expert_out(static_cast<std::size_t>(R));
    std::vector<std::vector<uint16_t>> bias0(static_cast<std::size_t>(R));
    std::vector<std::vector<float>> weights(static_cast<std::size_t>(R));
    std::vector<DeviceArray> d_weights, d_combined;
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[std::size_t(r)];
      const int64_t n = layouts[std::size_t(r)].num_recv;
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      if (from_window) {
        expert_out[std::size_t(r)] = layouts[std::size_t(r)].recv_x;
        weights[std::size_t(r)] = layouts[std::size_t(r)].recv_weights;
      } else {
        auto& e = expert_out[std::size_t(r)];
        e.resize(std::size_t(n * H));
        const int salt = int(rng() % 1000);
        for (int64_t i = 0; i < n * H; ++i) e[std::size_t(i)] = ref::identity_bf16(50 + salt, i / H, i % H);
        rd.expert_out = upload(rank_device(r), e);
        auto& w = weights[std::size_t(r)];
        w.resize(std::size_t(n * K));
        for (auto& v : w) v = std::ldexp(mantissa(rng), exponent(rng));
      }
      d_weights.push_back(upload(rank_device(r), weights[std::size_t(r)]));
      if (num_bias > 0) {
        auto& b = bias0[std::size_t(r)];
        b.resize(std::size_t(T * H));
        for (int64_t i = 0; i < T * H; ++i) b[std::size_t(i)] = ref::identity_bf16(90 + r, i / H, i % H);
        rd.bias0 = upload(rank_device(r), b);
      }
      rd.out = DeviceArray(rank_device(r), std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(rd.out.ptr, 0xFF, std::size_t(T * H * 2)));
      d_combined.emplace_back(rank_device(r), std::size_t(T * K) * sizeof(float));
      WEFT_CUDA_CHECK(cudaMemset(d_combined.back().ptr, 0xFF, std::size_t(T * K) * sizeof(float)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[std::size_t(r)];
      const auto& rr = res[std::size_t(r)];
      const int64_t n = layouts[std::size_t(r)].num_recv;
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      weft::ep::CombineInputs cin;
      if (from_window) {
        cin.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H};
        cin.topk_weights = {rr.recv_weights, DType::kFloat32, rr.capacity, config.top_k};
      } else {
        cin.expert_out = {rd.expert_out.ptr, DType::kBFloat16, n, H};
        cin.topk_weights = {d_weights[std::size_t(r)].ptr, DType::kFloat32, n, K};
      }
      if (num_bias > 0) cin.bias0 = {rd.bias0.ptr, DType::kBFloat16, T, H};
      cin.combined_weights = static_cast<float*>(d_combined[std::size_t(r)].ptr);
      eps[std::size_t(r)]->combine(cin, rr.handle, rd.out.ptr, rd.stream);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      eps[std::size_t(r)]->check();
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      const auto want = ref::combine(config, r, layouts, expert_out, bias0[std::size_t(r)], {});
      const auto got = download<uint16_t>(rank_device(r), ranks[std::size_t(r)].out.ptr, want.size());
      ASSERT_EQ(count_differences(got, want), 0u) << "rank " << r << ": out differs";
      const int num_weights = from_window ? config.top_k : K;
      const auto want_w = ref::combine_weights(config, r, layouts, weights, num_weights);
      const auto got_w = download<float>(rank_device(r), d_combined[std::size_t(r)].ptr, std::size_t(T * num_weights));
      ASSERT_EQ(count_bit_differences(got_w, want_w), 0u)
          << "rank " << r << ": combined_weights differ (K " << num_weights << ")";
      if (from_window) {  // the token's own weights back, 0 where masked
        const auto& in = inputs[std::size_t(r)];
        for (std::size_t i = 0; i < got_w.size(); ++i) {
          ASSERT_EQ(got_w[i], in.topk_idx[i] >= 0 ? in.topk_weights[i] : 0.0f) << "rank " << r;
        }
      }
    }
  }

  std::vector<int64_t> random_tokens(std::mt19937& rng) const {
    std::vector<int64_t> tokens;
    for (int r = 0; r < R; ++r) tokens.push_back(int64_t(rng() % uint32_t(config.max_tokens + 1)));
    return tokens;
  }
};

TEST_F(EpCombineWeightsTest, MatchesTheReferenceBitForBitForEveryK) {
  REQUIRE_GPUS();
  make({.max_tokens = 256, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 6});
  std::mt19937 rng(31);
  for (int trial = 0; trial < 6; ++trial) {
    const auto inputs = make_inputs(config, R, {.tokens = random_tokens(rng), .mask_ratio = 0.2}, rng);
    const auto layouts = ref::dispatch(config, inputs);
    const auto res = upload_and_dispatch(inputs);
    for (int K : {1, 3, 6}) combine_checked(inputs, layouts, res, K, trial % 2, false, rng);
  }
}

TEST_F(EpCombineWeightsTest, CombiningRecvWeightsRestoresTheTokensWeights) {
  REQUIRE_GPUS();
  make({.max_tokens = 300, .hidden = 128, .num_experts = 4 * team_size(), .top_k = 4});
  std::mt19937 rng(32);
  for (int trial = 0; trial < 3; ++trial) {
    const auto inputs = make_inputs(config, R, {.tokens = random_tokens(rng), .mask_ratio = 0.3}, rng);
    const auto layouts = ref::dispatch(config, inputs);
    const auto res = upload_and_dispatch(inputs);
    combine_checked(inputs, layouts, res, config.top_k, 0, true, rng);
  }
}

// 6 layouts x 50 combines (300 calls), each with fresh weights and expert outputs, each checked;
// T up to 2000 (grid count mode above 1024).
TEST_F(EpCombineWeightsTest, HundredsOfBackToBackCalls) {
  REQUIRE_GPUS();
  make({.max_tokens = 2000, .hidden = 128, .num_experts = 16 * team_size(), .top_k = 8});
  std::mt19937 rng(33);
  for (int layout = 0; layout < 6; ++layout) {
    const auto inputs = make_inputs(config, R, {.tokens = random_tokens(rng), .mask_ratio = 0.1}, rng);
    const auto layouts = ref::dispatch(config, inputs);
    const auto res = upload_and_dispatch(inputs);
    for (int call = 0; call < 50; ++call) {
      combine_checked(inputs, layouts, res, 1 + call % config.top_k, call % 2, false, rng);
      if (HasFatalFailure()) return;
    }
  }
}

// 200 combines of one layout queued back to back with no host wait between them, each with its
// own weights and outputs (comb_x / comb_w reused by every call), all checked at the end.
TEST_F(EpCombineWeightsTest, CallsQueuedWithoutAHostWaitAreEachCorrect) {
  REQUIRE_GPUS();
  make({.max_tokens = 256, .hidden = 128, .num_experts = 8 * team_size(), .top_k = 4});
  std::mt19937 rng(36);
  constexpr int kCalls = 200;
  const int K = 3;
  const int64_t H = config.hidden;
  const auto inputs = make_inputs(config, R, {.tokens = random_tokens(rng), .mask_ratio = 0.2}, rng);
  const auto layouts = ref::dispatch(config, inputs);
  const auto res = upload_and_dispatch(inputs);
  std::vector<std::vector<uint16_t>> expert_out(static_cast<std::size_t>(R));
  std::vector<DeviceArray> d_expert_out;
  for (int r = 0; r < R; ++r) {
    const int64_t n = layouts[std::size_t(r)].num_recv;
    auto& e = expert_out[std::size_t(r)];
    for (int64_t i = 0; i < n * H; ++i) e.push_back(ref::identity_bf16(60 + r, i / H, i % H));
    d_expert_out.push_back(upload(rank_device(r), e));
  }
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-24, 24);
  // [call][rank]
  std::vector<std::vector<std::vector<float>>> weights(kCalls);
  std::vector<std::vector<DeviceArray>> d_weights(kCalls), d_combined(kCalls), d_out(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    for (int r = 0; r < R; ++r) {
      const int64_t n = layouts[std::size_t(r)].num_recv;
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      auto& w = weights[std::size_t(i)].emplace_back(std::size_t(n * K));
      for (auto& v : w) v = std::ldexp(mantissa(rng), exponent(rng));
      d_weights[std::size_t(i)].push_back(upload(rank_device(r), w));
      d_combined[std::size_t(i)].emplace_back(rank_device(r), std::size_t(T * K) * sizeof(float));
      WEFT_CUDA_CHECK(cudaMemset(d_combined[std::size_t(i)].back().ptr, 0xFF,
                                 std::size_t(T * K) * sizeof(float)));
      d_out[std::size_t(i)].emplace_back(rank_device(r), std::size_t(T * H * 2));
    }
  }
  for (int r = 0; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  for (int i = 0; i < kCalls; ++i) {
    for (int r = 0; r < R; ++r) {
      const int64_t n = layouts[std::size_t(r)].num_recv;
      weft::ep::CombineInputs cin{
          .expert_out = {d_expert_out[std::size_t(r)].ptr, DType::kBFloat16, n, H},
          .topk_weights = {d_weights[std::size_t(i)][std::size_t(r)].ptr, DType::kFloat32, n, K},
          .combined_weights = static_cast<float*>(d_combined[std::size_t(i)][std::size_t(r)].ptr)};
      eps[std::size_t(r)]->combine(cin, res[std::size_t(r)].handle,
                                   d_out[std::size_t(i)][std::size_t(r)].ptr,
                                   ranks[std::size_t(r)].stream);
    }
  }
  sync_all();
  for (int r = 0; r < R; ++r) {
    eps[std::size_t(r)]->check();
    const int64_t T = inputs[std::size_t(r)].num_tokens;
    const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
    for (int i = 0; i < kCalls; ++i) {
      const auto got = download<uint16_t>(rank_device(r), d_out[std::size_t(i)][std::size_t(r)].ptr, want.size());
      ASSERT_EQ(count_differences(got, want), 0u) << "rank " << r << " call " << i;
      const auto want_w = ref::combine_weights(config, r, layouts, weights[std::size_t(i)], K);
      const auto got_w = download<float>(rank_device(r), d_combined[std::size_t(i)][std::size_t(r)].ptr,
                                         std::size_t(T * K));
      ASSERT_EQ(count_bit_differences(got_w, want_w), 0u) << "rank " << r << " call " << i;
    }
  }
}

// Two ranks or more: every selection on the last rank, so every other rank's weights all come
// back from a peer; then none on rank 0, so rank 0 sends everything back.
TEST_F(EpCombineWeightsTest, WeightsComeBackFromPeers) {
  REQUIRE_PEERS();
  make({.max_tokens = 512, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 5});
  std::mt19937 rng(34);
  for (const RoutingSpec& spec :
       {RoutingSpec{.tokens = std::vector<int64_t>(std::size_t(R), 512), .only_rank = R - 1},
        RoutingSpec{.tokens = std::vector<int64_t>(std::size_t(R), 300), .avoid_rank = 0},
        RoutingSpec{.tokens = std::vector<int64_t>(std::size_t(R), 200), .mask_ratio = 0.5,
                    .duplicates = true}}) {
    const auto inputs = make_inputs(config, R, spec, rng);
    const auto layouts = ref::dispatch(config, inputs);
    const auto res = upload_and_dispatch(inputs);
    for (int K : {5, 2}) combine_checked(inputs, layouts, res, K, 1, false, rng);
    combine_checked(inputs, layouts, res, config.top_k, 0, true, rng);
  }
}

// Arguments the host refuses on every rank alike (nothing is launched), after which the Buffers
// still agree: K above top_k, combined_weights missing or without topk_weights, a wrong dtype,
// an expanded layout.
TEST_F(EpCombineWeightsTest, BadArgumentsAreRefusedOnTheHost) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 4 * team_size(), .top_k = 2,
        .expand_factor = 2});
  std::mt19937 rng(35);
  const int64_t H = config.hidden;
  const auto inputs = make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), 64)}, rng);
  const auto layouts = ref::dispatch(config, inputs);
  auto res = upload_and_dispatch(inputs);
  std::vector<DeviceArray> combined;
  for (int r = 0; r < R; ++r) {
    const auto& rr = res[std::size_t(r)];
    auto& rd = ranks[std::size_t(r)];
    rd.out = DeviceArray(rank_device(r), std::size_t(64 * H * 2));
    combined.emplace_back(rank_device(r), std::size_t(64 * 4) * sizeof(float));
    auto* cw = static_cast<float*>(combined.back().ptr);
    const weft::ep::CombineInputs good{
        .expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H},
        .topk_weights = {rr.recv_weights, DType::kFloat32, rr.capacity, 2},
        .combined_weights = cw};
    auto bad = good;
    bad.topk_weights.cols = 3;  // K above top_k
    EXPECT_THROW(eps[std::size_t(r)]->combine(bad, rr.handle, rd.out.ptr, rd.stream), weft::Error);
    bad = good;
    bad.combined_weights = nullptr;
    EXPECT_THROW(eps[std::size_t(r)]->combine(bad, rr.handle, rd.out.ptr, rd.stream), weft::Error);
    bad = good;
    bad.topk_weights = {};
    EXPECT_THROW(eps[std::size_t(r)]->combine(bad, rr.handle, rd.out.ptr, rd.stream), weft::Error);
    bad = good;
    bad.topk_weights.dtype = DType::kBFloat16;
    EXPECT_THROW(eps[std::size_t(r)]->combine(bad, rr.handle, rd.out.ptr, rd.stream), weft::Error);
    bad = good;
    bad.topk_weights.rows = rr.num_recv - 1;  // fewer rows than were received (count known)
    if (rr.num_recv > 0) {
      EXPECT_THROW(eps[std::size_t(r)]->combine(bad, rr.handle, rd.out.ptr, rd.stream), weft::Error);
    }
  }
  // The Buffers still agree: a checked combine of the same layout.
  combine_checked(inputs, layouts, res, 2, 0, false, rng);
  // An expanded layout: refused on every rank.
  for (int r = 0; r < R; ++r) {
    auto& rd = ranks[std::size_t(r)];
    const int64_t T = inputs[std::size_t(r)].num_tokens;
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
        {.x = {rd.x.ptr, DType::kBFloat16, T, H},
         .topk_idx = {rd.idx.ptr, DType::kInt64, T, config.top_k},
         .topk_weights = {rd.weights.ptr, DType::kFloat32, T, config.top_k},
         .expand = {.enabled = true}},
        rd.stream);
  }
  for (int r = 0; r < R; ++r) {
    const auto& rr = res[std::size_t(r)];
    auto& rd = ranks[std::size_t(r)];
    const weft::ep::CombineInputs cin{
        .expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H},
        .topk_weights = {rr.recv_weights, DType::kFloat32, rr.capacity, 2},
        .combined_weights = static_cast<float*>(combined[std::size_t(r)].ptr)};
    EXPECT_THROW(eps[std::size_t(r)]->combine(cin, rr.handle, rd.out.ptr, rd.stream), weft::Error);
  }
  sync_all();
  for (int r = 0; r < R; ++r) EXPECT_NO_THROW(eps[std::size_t(r)]->check());
  // And a normal round afterwards.
  round(make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), 40)}, rng), false, 1,
        true, true);
}

}  // namespace
