// weft::ep's fp8 rows, cast, cumulative statistics, cached dispatch and per-call num_sms on 2+
// GPUs (the cast on 1), one process driving all of them, checked element by element against the
// CPU reference with poisoned outputs.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"
#include "team.hpp"
#include "payload.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::identity_value;
using weft::ep::testing::refill_x;
using weft::ep::testing::upload;

using weft::ep::testing::make_team;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;

// Random distinct experts per token, each masked with probability mask_ratio; x filled with
// identity values and, with fp8, its packed rows.
std::vector<ref::RankInput> make_inputs(const BufferConfig& c, int R, int64_t T, double mask_ratio,
                                        std::mt19937& rng, bool fp8) {
  std::vector<ref::RankInput> inputs(static_cast<std::size_t>(R));
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int r = 0; r < R; ++r) {
    auto& in = inputs[std::size_t(r)];
    in.num_tokens = T - (r == 0 && T > 1);  // ranks with different T
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) in.x.push_back(identity_value(r, t, h));
      std::vector<int> experts(std::size_t(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[std::size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < c.top_k; ++k) {
        in.topk_idx.push_back(uni(rng) < mask_ratio ? -1 : experts[std::size_t(k)]);
        in.topk_weights.push_back(uni(rng));
      }
    }
    if (fp8) in.x_fp8 = ref::cast_to_fp8(c.hidden, in.num_tokens, in.x);
  }
  return inputs;
}

class EpFeaturesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  }
  void make(const BufferConfig& c, const weft::ep::BufferOptions& o = {}) {
    config = c;
    R = team_size();
    eps = make_team(c, o);
    x.resize(std::size_t(R));
    idx.resize(std::size_t(R));
    weights.resize(std::size_t(R));
    if (!streams.empty()) return;  // a test may make several Buffers in turn
    streams.resize(std::size_t(R));
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[std::size_t(r)], cudaStreamNonBlocking));
    }
  }
  void TearDown() override {
    for (auto s : streams) cudaStreamDestroy(s);
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[std::size_t(r)]));
      eps[std::size_t(r)]->check();
    }
  }
  // Poisons every rank's whole receive region (the window views of `views`) and, with metadata,
  // the received sources.
  void poison(const std::vector<weft::ep::DispatchResult>& views, bool metadata = true) {
    for (int r = 0; r < R; ++r) {
      const auto& v = views[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      void* rows = v.recv_x != nullptr ? const_cast<uint16_t*>(v.recv_x)
                                       : static_cast<void*>(const_cast<uint8_t*>(v.recv_x_fp8));
      WEFT_CUDA_CHECK(cudaMemset(rows, 0xFF, std::size_t(v.capacity * config.row_bytes())));
      if (metadata) {
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_src), 0x7F, std::size_t(v.capacity * 8)));
      }
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }

  // Uploads x (bf16 or packed fp8) and the routing; launches every rank's dispatch.
  std::vector<weft::ep::DispatchResult> dispatch(const std::vector<ref::RankInput>& inputs,
                                                 bool fp8, const weft::ep::Handle* handles,
                                                 std::vector<DeviceArray>* stats = nullptr,
                                                 int num_sms = 0) {
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    const int64_t row_bytes = fp8 ? weft::ep::fp8_row_layout(config.hidden).row_bytes : 0;
    // Every upload before the first launch: freeing an array (the previous call's, replaced
    // here) synchronises its device, which on a virtual team waits for the ranks already
    // launched, while they wait for the ranks not yet launched.
    for (int r = 0; r < R; ++r) {
      const auto& in = inputs[std::size_t(r)];
      x[std::size_t(r)] = fp8 ? upload(rank_device(r), in.x_fp8) : upload(rank_device(r), in.x);
      if (handles == nullptr) {
        idx[std::size_t(r)] = upload(rank_device(r), in.topk_idx);
        weights[std::size_t(r)] = upload(rank_device(r), in.topk_weights);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      weft::ep::DispatchInputs din;
      din.x = fp8 ? weft::ep::TensorView{x[std::size_t(r)].ptr, DType::kUInt8, T, row_bytes}
                  : weft::ep::TensorView{x[std::size_t(r)].ptr, DType::kBFloat16, T, config.hidden};
      if (handles != nullptr) {
        din.handle = &handles[r];
      } else {
        din.topk_idx = {idx[std::size_t(r)].ptr, DType::kInt64, T, config.top_k};
        din.topk_weights = {weights[std::size_t(r)].ptr, DType::kFloat32, T, config.top_k};
      }
      if (stats != nullptr) {
        din.cumulative_local_expert_recv_stats = static_cast<uint32_t*>((*stats)[std::size_t(r)].ptr);
      }
      din.num_sms = num_sms;
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din, streams[std::size_t(r)]);
    }
    sync_all();
    return res;
  }

  // Every received row and its metadata against the reference.
  void check_received(const std::vector<ref::RankLayout>& layouts,
                      const std::vector<weft::ep::DispatchResult>& res, bool fp8) {
    const int K = config.top_k;
    for (int r = 0; r < R; ++r) {
      const auto& L = layouts[std::size_t(r)];
      const auto& rr = res[std::size_t(r)];
      const auto n = download<int32_t>(rank_device(r), rr.num_recv_device, 1)[0];
      ASSERT_EQ(n, L.num_recv) << "rank " << r;
      if (fp8) {
        ASSERT_EQ(rr.recv_x, nullptr);
        ASSERT_EQ(rr.row_bytes, weft::ep::fp8_row_layout(config.hidden).row_bytes);
        ASSERT_EQ(download<uint8_t>(rank_device(r), rr.recv_x_fp8, std::size_t(n * rr.row_bytes)), L.recv_x_fp8)
            << "rank " << r << ": received fp8 rows differ";
      } else {
        ASSERT_EQ(rr.recv_x_fp8, nullptr);
        ASSERT_EQ(download<uint16_t>(rank_device(r), rr.recv_x, std::size_t(n * config.hidden)), L.recv_x)
            << "rank " << r << ": received rows differ";
      }
      const auto src = download<int32_t>(rank_device(r), rr.recv_src, std::size_t(n * 2));
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(src[std::size_t(2 * j)], L.recv_src_rank[std::size_t(j)]) << "row " << j;
        ASSERT_EQ(src[std::size_t(2 * j + 1)], L.recv_src_token[std::size_t(j)]) << "row " << j;
      }
      EXPECT_EQ(download<int32_t>(rank_device(r), rr.recv_expert_idx, std::size_t(n * K)), L.recv_expert_idx);
      EXPECT_EQ(download<float>(rank_device(r), rr.recv_weights, std::size_t(n * K)), L.recv_weights);
      EXPECT_EQ(download<int32_t>(rank_device(r), rr.tokens_per_local_expert,
                                  std::size_t(config.num_local_experts(R))),
                L.tokens_per_local_expert);
    }
  }

  // combine with fresh random expert outputs, every element against the reference.
  void check_combine(const std::vector<ref::RankLayout>& layouts,
                     const std::vector<weft::ep::DispatchResult>& res, std::mt19937& rng) {
    const int64_t H = config.hidden;
    std::vector<std::vector<uint16_t>> expert_out(static_cast<std::size_t>(R));
    std::vector<DeviceArray> expert_dev(static_cast<std::size_t>(R));
    std::vector<DeviceArray> out(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& e = expert_out[std::size_t(r)];
      e.resize(std::size_t(layouts[std::size_t(r)].num_recv * H));
      for (auto& v : e) v = identity_value(9 + r, int64_t(rng() % 100000), 5);
      expert_dev[std::size_t(r)] = upload(rank_device(r), e);
      const int64_t T = layouts[std::size_t(r)].num_tokens;
      out[std::size_t(r)] = DeviceArray(rank_device(r), std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(T * H * 2)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      weft::ep::CombineInputs cin;
      cin.expert_out = {expert_dev[std::size_t(r)].ptr, DType::kBFloat16,
                        layouts[std::size_t(r)].num_recv, H};
      eps[std::size_t(r)]->combine(cin, res[std::size_t(r)].handle, out[std::size_t(r)].ptr,
                                   streams[std::size_t(r)]);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
      const auto got = download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, want.size());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
      ASSERT_EQ(wrong, 0u) << "rank " << r << ": combine output differs from the reference";
    }
  }

  BufferConfig config;
  int R = 0;
  std::vector<std::unique_ptr<weft::ep::Buffer>> eps;
  std::vector<cudaStream_t> streams;
  std::vector<DeviceArray> x, idx, weights;
};

TEST(EpCast, CastToFp8MatchesReferenceBitForBit) {
  if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  for (int64_t hidden : {128, 384, 2048, 7168}) {
    for (int64_t T : {0, 1, 77}) {
      const auto l = weft::ep::fp8_row_layout(hidden);
      std::vector<uint16_t> x(std::size_t(T * hidden));
      for (int64_t i = 0; i < T * hidden; ++i) x[std::size_t(i)] = identity_value(3, i / hidden, i % hidden);
      if (T > 1) std::fill_n(x.begin() + hidden, 128, uint16_t(0));  // an all-zero group
      if (T > 2) x[std::size_t(2 * hidden + 1)] = 0x8000;             // -0
      const DeviceArray xd = upload(0, x);
      DeviceArray out(0, std::size_t(T * l.row_bytes));
      WEFT_CUDA_CHECK(cudaMemset(out.ptr, 0xAB, std::size_t(T * l.row_bytes)));  // poison
      weft::ep::cast_to_fp8(xd.ptr, T, hidden, out.ptr, nullptr);
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(download<uint8_t>(0, out.ptr, std::size_t(T * l.row_bytes)),
                ref::cast_to_fp8(hidden, T, x))
          << "hidden " << hidden << " T " << T;
    }
  }
  EXPECT_THROW(weft::ep::cast_to_fp8(nullptr, 1, 100, nullptr, nullptr), weft::Error);
}

TEST_F(EpFeaturesTest, Fp8DispatchMovesPackedRowsAndCombines) {
  std::mt19937 rng(std::random_device{}());
  // hidden 128: a 4-byte scale row, 144-byte rows; 7168: 512-padded rows.
  for (int64_t hidden : {128, 2048, 7168}) {
    make({.max_tokens = 1100, .hidden = hidden, .num_experts = 32, .top_k = 6});
    for (int64_t T : {1, 130, 1100}) {  // local and grid count modes
      SCOPED_TRACE(testing::Message() << "hidden " << hidden << " T " << T);
      const auto inputs = make_inputs(config, R, T, 0.2, rng, true);
      const auto layouts = ref::dispatch(config, inputs, {.fp8 = true});
      auto res = dispatch(inputs, true, nullptr);
      poison(res);
      res = dispatch(inputs, true, nullptr);
      check_received(layouts, res, true);
      check_combine(layouts, res, rng);
    }
  }
}

TEST_F(EpFeaturesTest, CumulativeStatsAccumulateOnlyWhenAsked) {
  make({.max_tokens = 1500, .hidden = 256, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  const int epr = config.num_local_experts(R);
  std::vector<DeviceArray> stats;
  std::vector<std::vector<uint32_t>> want(std::size_t(R), std::vector<uint32_t>(std::size_t(epr), 7u));
  for (int r = 0; r < R; ++r) stats.push_back(upload(rank_device(r), want[std::size_t(r)]));  // not zero: accumulates
  for (int64_t T : {100, 1500, 3}) {
    const auto inputs = make_inputs(config, R, T, 0.25, rng, false);
    const auto layouts = ref::dispatch(config, inputs);
    check_received(layouts, dispatch(inputs, false, nullptr, &stats), false);
    for (int r = 0; r < R; ++r) {
      ref::accumulate_local_expert_recv_stats(layouts[std::size_t(r)], want[std::size_t(r)]);
      EXPECT_EQ(download<uint32_t>(rank_device(r), stats[std::size_t(r)].ptr, std::size_t(epr)), want[std::size_t(r)]);
    }
    dispatch(inputs, false, nullptr);  // without stats: unchanged
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(download<uint32_t>(rank_device(r), stats[std::size_t(r)].ptr, std::size_t(epr)), want[std::size_t(r)]);
    }
  }
}

TEST_F(EpFeaturesTest, CachedDispatchMatchesFreshAndRejectsStaleHandles) {
  make({.max_tokens = 1200, .hidden = 512, .num_experts = 32, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  for (bool fp8 : {false, true}) {
    for (int64_t T : {5, 1200}) {
      SCOPED_TRACE(testing::Message() << "fp8 " << fp8 << " T " << T);
      auto inputs = make_inputs(config, R, T, 0.3, rng, fp8);
      const auto fresh = dispatch(inputs, fp8, nullptr);
      const auto layouts = ref::dispatch(config, inputs, {.fp8 = fp8});
      check_received(layouts, fresh, fp8);
      std::vector<weft::ep::Handle> handles;
      for (const auto& r : fresh) handles.push_back(r.handle);
      // Twice, each time with new payload; stats accumulate the handle's counts.
      std::vector<DeviceArray> stats;
      for (int r = 0; r < R; ++r) {
        stats.push_back(upload(rank_device(r), std::vector<uint32_t>(std::size_t(config.num_local_experts(R)), 0u)));
      }
      for (int round = 1; round <= 2; ++round) {
        refill_x(config, inputs, 10 * round);
        poison(fresh, /*metadata=*/false);  // a cached dispatch must rewrite every row
        const auto cached = dispatch(inputs, fp8, handles.data(), &stats);
        const auto want_layouts = ref::dispatch(config, inputs, {.fp8 = fp8});
        check_received(want_layouts, cached, fp8);
        for (int r = 0; r < R; ++r) {
          EXPECT_EQ(cached[std::size_t(r)].handle.sequence, handles[std::size_t(r)].sequence);
          std::vector<uint32_t> want(std::size_t(config.num_local_experts(R)), 0u);
          for (int k = 0; k < round; ++k) {
            ref::accumulate_local_expert_recv_stats(want_layouts[std::size_t(r)], want);
          }
          EXPECT_EQ(download<uint32_t>(rank_device(r), stats[std::size_t(r)].ptr, want.size()), want);
        }
        // The handle stays valid for combine after cached dispatches.
        check_combine(want_layouts, cached, rng);
      }
      // Rank r's cached dispatch of the handle's layout, x as last uploaded.
      auto cached_inputs = [&](int r) {
        weft::ep::DispatchInputs din;
        din.x = {x[std::size_t(r)].ptr, fp8 ? DType::kUInt8 : DType::kBFloat16,
                 inputs[std::size_t(r)].num_tokens,
                 fp8 ? weft::ep::fp8_row_layout(config.hidden).row_bytes : config.hidden};
        din.handle = &handles[std::size_t(r)];
        return din;
      };
      // A deduplicated layout cannot be reused as an expanded one.
      for (int r = 0; r < R; ++r) {
        auto din = cached_inputs(r);
        din.expand = {.enabled = true};
        EXPECT_THROW(eps[std::size_t(r)]->dispatch(din, streams[std::size_t(r)]), weft::Error);
      }
      // A new layout makes the old handle stale: cached dispatch and combine refuse it.
      const auto again = dispatch(inputs, fp8, nullptr);
      check_received(ref::dispatch(config, inputs, {.fp8 = fp8}), again, fp8);
      for (int r = 0; r < R; ++r) {
        EXPECT_THROW(eps[std::size_t(r)]->dispatch(cached_inputs(r), streams[std::size_t(r)]),
                     weft::Error);
        DeviceArray out(rank_device(r), std::size_t(inputs[std::size_t(r)].num_tokens * config.hidden * 2));
        weft::ep::CombineInputs cin;
        cin.expert_out = {nullptr, DType::kBFloat16, 0, config.hidden};
        EXPECT_THROW(eps[std::size_t(r)]->combine(cin, handles[std::size_t(r)], out.ptr,
                                                  streams[std::size_t(r)]),
                     weft::Error);
      }
    }
  }
}

// The most blocks of a call: every SM of the device, or on a virtual team a rank's share of them
// (all ranks' grids are resident at once).
TEST_F(EpFeaturesTest, NumSmsIsValidatedAndPerCall) {
  if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  int most_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&most_sms, cudaDevAttrMultiProcessorCount, 0));
  if (weft::ep::testing::is_virtual_team()) {
    most_sms = weft::ep::Buffer::virtual_team_num_sms(team_size(), 0);
  }
  EXPECT_THROW(make_team({.max_tokens = 8, .hidden = 128, .num_experts = 8 * team_size(), .top_k = 2},
                         {.num_sms = most_sms + 1}),
               weft::Error);
  make({.max_tokens = 2000, .hidden = 1024, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  EXPECT_THROW((void)eps[0]->num_blocks(100, most_sms + 1), weft::Error);
  EXPECT_THROW((void)eps[0]->num_blocks(100, -1), weft::Error);
  EXPECT_EQ(eps[0]->num_blocks(2000, 3), 3);
  EXPECT_EQ(eps[0]->num_blocks(2000, 0), eps[0]->num_blocks(2000));
  for (int num_sms : {1, 7, most_sms}) {
    SCOPED_TRACE(testing::Message() << "num_sms " << num_sms);
    const auto inputs = make_inputs(config, R, 2000, 0.1, rng, false);
    const auto layouts = ref::dispatch(config, inputs);
    check_received(layouts, dispatch(inputs, false, nullptr, nullptr, num_sms), false);
  }
}

}  // namespace
