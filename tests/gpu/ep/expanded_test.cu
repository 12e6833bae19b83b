// weft::ep's expanded layout (DispatchInputs::expand) on 2+ GPUs, one process driving all of them,
// checked element by element against the CPU reference: every received array is poisoned before
// each call, inputs are drawn fresh per round, and every payload element names its (source rank,
// source token, column), so a misrouted row cannot look plausible.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device_array.hpp"
#include "team.hpp"
#include "payload.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
using weft::ep::ExpandOptions;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::identity_value;
using weft::ep::testing::refill_x;
using weft::ep::testing::upload;

using weft::ep::testing::make_team;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;

struct RoutingSpec {
  std::vector<int64_t> tokens;  // per rank
  double mask_ratio = 0.0;      // selections set to -1
  double repeat_ratio = 0.0;    // selections that repeat the token's previous one
  bool crowd_rank0 = false;     // rank 0's experts first (and nothing masked)
  int max_selections = 32;      // selections kept per token, the rest masked
};

// Random distinct experts per token (a router's top-k), then masked or repeated per the spec;
// x holds identity values and, with fp8, its packed rows.
std::vector<ref::RankInput> make_inputs(const BufferConfig& c, const RoutingSpec& spec,
                                        std::mt19937& rng, bool fp8) {
  const int R = int(spec.tokens.size());
  const int epr = c.num_experts / R;
  std::vector<ref::RankInput> inputs(static_cast<std::size_t>(R));
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int r = 0; r < R; ++r) {
    auto& in = inputs[std::size_t(r)];
    in.num_tokens = spec.tokens[std::size_t(r)];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) in.x.push_back(identity_value(r, t, h));
      std::vector<int> experts(std::size_t(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) experts[std::size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      if (spec.crowd_rank0) {
        std::stable_partition(experts.begin(), experts.end(), [&](int e) { return e < epr; });
      }
      for (int k = 0; k < c.top_k; ++k) {
        int64_t e = experts[std::size_t(k)];
        if (k > 0 && uni(rng) < spec.repeat_ratio) e = in.topk_idx.back();
        if ((!spec.crowd_rank0 && uni(rng) < spec.mask_ratio) || k >= spec.max_selections) e = -1;
        in.topk_idx.push_back(e);
        in.topk_weights.push_back(uni(rng));
      }
    }
    if (fp8) in.x_fp8 = ref::cast_to_fp8(c.hidden, in.num_tokens, in.x);
  }
  return inputs;
}

struct Call {
  ExpandOptions expand{.enabled = true};
  bool fp8 = false;
  bool idx64 = true;
  weft::ep::CountMode mode = weft::ep::CountMode::kOnDevice;
  int num_sms = 0;
  bool stats = false;  // accumulate into EpExpandedTest::stats
  // Cached dispatch (else null): handles[r] is rank r's layout; topk views are left empty and
  // only the rows are poisoned (the metadata is the layout's, kept by design).
  const weft::ep::Handle* handles = nullptr;
  bool cached_expand_unset = false;  // pass no expand with the handle (else call.expand)
};

class EpExpandedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  }
  void TearDown() override {
    for (auto s : streams) cudaStreamDestroy(s);
  }
  void make(const BufferConfig& c) {
    config = c;
    R = team_size();
    eps = make_team(c);
    x.resize(std::size_t(R));
    idx.resize(std::size_t(R));
    weights.resize(std::size_t(R));
    views.clear();
    stats.clear();
    for (int r = 0; r < R; ++r) {
      stats.push_back(upload(rank_device(r), std::vector<uint32_t>(std::size_t(epr()), 0u)));
    }
    want_stats.assign(std::size_t(R), std::vector<uint32_t>(std::size_t(epr()), 0u));
    if (streams.empty()) {
      streams.resize(std::size_t(R));
      for (int r = 0; r < R; ++r) {
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[std::size_t(r)], cudaStreamNonBlocking));
      }
    }
    if (c.expand_factor == 0) return;
    // A first expanded dispatch of no tokens anywhere gives poison() the window's views.
    std::vector<ref::RankInput> none(static_cast<std::size_t>(R));
    const Call call;
    const auto res = dispatch(none, call);
    check_layout(ref::dispatch(config, none, {.expand = call.expand}), res, call);
  }
  int epr() const { return config.num_local_experts(R); }
  std::vector<int64_t> tokens(int64_t T) const {
    std::vector<int64_t> v(std::size_t(R), T);
    if (T > 1) v[0] = T - 1;  // ranks with different T
    return v;
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[std::size_t(r)]));
      eps[std::size_t(r)]->check();
    }
  }

  // Poisons every received array of every rank (only the rows without `metadata`), over the
  // whole expanded capacity (the window views of the previous expanded dispatch; none before the
  // first).
  void poison(bool metadata = true) {
    for (int r = 0; r < static_cast<int>(views.size()); ++r) {
      const auto& v = views[std::size_t(r)];
      const auto cap = std::size_t(v.capacity);
      const auto K = std::size_t(config.top_k);
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaMemset(rows_of(v), 0xFF, cap * std::size_t(config.row_bytes())));
      if (!metadata) continue;
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_src), 0x7F, cap * 8));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_expert_idx), 0x7F, cap * K * 4));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<float*>(v.recv_weights), 0xFF, cap * K * 4));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.tokens_per_local_expert), 0x7F,
                                 std::size_t(epr()) * 4));
      WEFT_CUDA_CHECK(
          cudaMemset(const_cast<int64_t*>(v.segment_begin), 0x7F, std::size_t(epr() + 1) * 8));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  static void* rows_of(const weft::ep::DispatchResult& v) {
    return v.recv_x != nullptr ? static_cast<void*>(const_cast<uint16_t*>(v.recv_x))
                               : static_cast<void*>(const_cast<uint8_t*>(v.recv_x_fp8));
  }

  // Poisons, launches every rank's dispatch, then waits for all (wait_num_recv in kExact mode,
  // else a stream sync) and checks the device error flags.
  std::vector<weft::ep::DispatchResult> dispatch(const std::vector<ref::RankInput>& inputs,
                                                 const Call& call) {
    poison(/*metadata=*/call.handles == nullptr);
    auto res = launch(inputs, call);
    if (call.mode == weft::ep::CountMode::kExact) {
      for (int r = 0; r < R; ++r) eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]);
    }
    sync_all();
    if (call.expand.enabled) views = res;
    return res;
  }

  // Uploads the inputs and launches every rank's dispatch; no wait.
  std::vector<weft::ep::DispatchResult> launch(const std::vector<ref::RankInput>& inputs,
                                               const Call& call) {
    const int64_t fp8_row_bytes = call.fp8 ? weft::ep::fp8_row_layout(config.hidden).row_bytes : 0;
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    // Every upload before the first launch (freeing the previous call's arrays synchronises the
    // device: on a virtual team, a wait for ranks not yet launched).
    for (int r = 0; r < R; ++r) {
      const auto& in = inputs[std::size_t(r)];
      x[std::size_t(r)] = call.fp8 ? upload(rank_device(r), in.x_fp8) : upload(rank_device(r), in.x);
      if (call.idx64) {
        idx[std::size_t(r)] = upload(rank_device(r), in.topk_idx);
      } else {
        idx[std::size_t(r)] =
            upload(rank_device(r), std::vector<int32_t>(in.topk_idx.begin(), in.topk_idx.end()));
      }
      weights[std::size_t(r)] = upload(rank_device(r), in.topk_weights);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t T = inputs[std::size_t(r)].num_tokens;
      weft::ep::DispatchInputs din;
      din.x = call.fp8
                  ? weft::ep::TensorView{x[std::size_t(r)].ptr, DType::kUInt8, T, fp8_row_bytes}
                  : weft::ep::TensorView{x[std::size_t(r)].ptr, DType::kBFloat16, T, config.hidden};
      din.topk_idx = {idx[std::size_t(r)].ptr, call.idx64 ? DType::kInt64 : DType::kInt32, T,
                      config.top_k};
      din.topk_weights = {weights[std::size_t(r)].ptr, DType::kFloat32, T, config.top_k};
      din.expand = call.expand;
      if (call.handles != nullptr) {
        din.topk_idx = {};
        din.topk_weights = {};
        din.handle = &call.handles[r];
        if (call.cached_expand_unset) din.expand = {};
      }
      din.num_sms = call.num_sms;
      if (call.stats) {
        din.cumulative_local_expert_recv_stats = static_cast<uint32_t*>(stats[std::size_t(r)].ptr);
      }
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din, streams[std::size_t(r)], call.mode);
    }
    return res;
  }

  // Everything an expanded dispatch reports, against the reference.
  void check_layout(const std::vector<ref::RankLayout>& layouts,
                    const std::vector<weft::ep::DispatchResult>& res, const Call& call) {
    const int K = config.top_k;
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE(testing::Message() << "rank " << r);
      const auto& L = layouts[std::size_t(r)];
      const auto& rr = res[std::size_t(r)];
      ASSERT_EQ(rr.handle.expand, call.expand);
      ASSERT_EQ(rr.capacity, eps[std::size_t(r)]->expand_capacity());
      ASSERT_EQ(rr.rows_required_device, rr.segment_begin + epr());
      EXPECT_EQ(download<int32_t>(rank_device(r), rr.tokens_per_local_expert, std::size_t(epr())),
                L.tokens_per_local_expert);
      EXPECT_EQ(download<int64_t>(rank_device(r), rr.segment_begin, std::size_t(epr() + 1)), L.segment_begin);
      EXPECT_EQ(download<int64_t>(rank_device(r), rr.rows_required_device, 1)[0], L.rows_required);
      const auto n = download<int32_t>(rank_device(r), rr.num_recv_device, 1)[0];
      ASSERT_EQ(n, L.num_recv);
      if (call.mode == weft::ep::CountMode::kExact) {
        EXPECT_EQ(rr.num_recv, L.num_recv);
        EXPECT_EQ(rr.rows_required, L.rows_required);
      }
      if (call.stats) {
        ref::accumulate_local_expert_recv_stats(L, want_stats[std::size_t(r)]);
        EXPECT_EQ(download<uint32_t>(rank_device(r), stats[std::size_t(r)].ptr, std::size_t(epr())),
                  want_stats[std::size_t(r)]);
      }
      const auto cap = std::size_t(rr.capacity);
      if (L.overflowed) {  // nothing was written: the whole receive region is still poison
        const auto rows = download<uint8_t>(rank_device(r), rows_of(rr), cap * std::size_t(config.row_bytes()));
        EXPECT_EQ(std::count(rows.begin(), rows.end(), uint8_t(0xFF)), std::ptrdiff_t(rows.size()))
            << "an overflowed rank's rows were written";
        const auto src = download<int32_t>(rank_device(r), rr.recv_src, cap * 2);
        EXPECT_EQ(std::count(src.begin(), src.end(), int32_t(0x7F7F7F7F)),
                  std::ptrdiff_t(src.size()))
            << "an overflowed rank's sources were written";
        continue;
      }
      // Sources in the reference's order: per segment exactly its (source rank, source token)
      // set in (rank, token) order, then padding (-1, -1).
      const auto src = download<int32_t>(rank_device(r), rr.recv_src, std::size_t(n * 2));
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(src[std::size_t(2 * j)], L.recv_src_rank[std::size_t(j)]) << "row " << j;
        ASSERT_EQ(src[std::size_t(2 * j + 1)], L.recv_src_token[std::size_t(j)]) << "row " << j;
      }
      EXPECT_EQ(download<int32_t>(rank_device(r), rr.recv_expert_idx, std::size_t(n * K)), L.recv_expert_idx);
      EXPECT_EQ(download<float>(rank_device(r), rr.recv_weights, std::size_t(n * K)), L.recv_weights);
      // Payload of every row: a real row is its source's; a padding row is zero with
      // zero_padding and untouched (still poison) without.
      const auto row_bytes = std::size_t(rr.row_bytes);
      const auto got = download<uint8_t>(rank_device(r), rows_of(rr), std::size_t(n) * row_bytes);
      const auto* want =
          call.fp8 ? L.recv_x_fp8.data() : reinterpret_cast<const uint8_t*>(L.recv_x.data());
      ASSERT_EQ(call.fp8 ? L.recv_x_fp8.size() : L.recv_x.size() * 2, got.size());
      std::size_t wrong = 0;
      for (int64_t j = 0; j < n; ++j) {
        const bool padding = L.recv_src_rank[std::size_t(j)] < 0;
        for (std::size_t b = 0; b < row_bytes; ++b) {
          const std::size_t i = std::size_t(j) * row_bytes + b;
          const uint8_t expected = padding && !call.expand.zero_padding ? uint8_t(0xFF) : want[i];
          wrong += got[i] != expected;
        }
      }
      EXPECT_EQ(wrong, 0u) << "received payload bytes differ";
    }
  }

  // combine with fresh random expert outputs (or the received rows themselves) and num_bias
  // biases, every element against the reference.
  void check_combine(const std::vector<ref::RankLayout>& layouts,
                     const std::vector<weft::ep::DispatchResult>& res, int num_bias, bool zero_copy,
                     std::mt19937& rng) {
    const int64_t H = config.hidden;
    const auto num = static_cast<std::size_t>(R);
    std::vector<std::vector<uint16_t>> expert_out(num), bias0(num), bias1(num);
    std::vector<DeviceArray> expert_dev(num), out(num), b0(num), b1(num);
    for (int r = 0; r < R; ++r) {
      const int64_t n = layouts[std::size_t(r)].num_recv;
      const int64_t T = layouts[std::size_t(r)].num_tokens;
      auto& e = expert_out[std::size_t(r)];
      if (zero_copy) {
        e = layouts[std::size_t(r)].recv_x;  // padding rows differ (poison) but are never read
      } else {
        e.resize(std::size_t(n * H));
        for (auto& v : e) v = identity_value(9 + r, int64_t(rng() % 100000), 5);
        expert_dev[std::size_t(r)] = upload(rank_device(r), e);
      }
      for (int b = 0; b < num_bias; ++b) {
        auto& bias = b == 0 ? bias0[std::size_t(r)] : bias1[std::size_t(r)];
        for (int64_t i = 0; i < T * H; ++i) bias.push_back(identity_value(20 + b, i / H, i % H));
        (b == 0 ? b0 : b1)[std::size_t(r)] = upload(rank_device(r), bias);
      }
      out[std::size_t(r)] = DeviceArray(rank_device(r), std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(T * H * 2)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      const auto& rr = res[std::size_t(r)];
      const int64_t T = layouts[std::size_t(r)].num_tokens;
      weft::ep::CombineInputs cin;
      cin.expert_out = zero_copy
                           ? weft::ep::TensorView{rr.recv_x, DType::kBFloat16, rr.capacity, H}
                           : weft::ep::TensorView{expert_dev[std::size_t(r)].ptr, DType::kBFloat16,
                                                  layouts[std::size_t(r)].num_recv, H};
      if (num_bias >= 1) cin.bias0 = {b0[std::size_t(r)].ptr, DType::kBFloat16, T, H};
      if (num_bias >= 2) cin.bias1 = {b1[std::size_t(r)].ptr, DType::kBFloat16, T, H};
      eps[std::size_t(r)]->combine(cin, rr.handle, out[std::size_t(r)].ptr,
                                   streams[std::size_t(r)]);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      const auto want = ref::combine(config, r, layouts, expert_out, bias0[std::size_t(r)],
                                     bias1[std::size_t(r)]);
      const auto got = download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, want.size());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
      ASSERT_EQ(wrong, 0u) << "rank " << r << ": combine output differs from the reference";
    }
  }

  // The weighted combine (CombineInputs::source_weights) with fresh random expert outputs and
  // per-rank weights, every element against reference::combine_weighted.
  void check_weighted_combine(const std::vector<ref::RankLayout>& layouts,
                              const std::vector<weft::ep::DispatchResult>& res,
                              std::mt19937& rng) {
    const int64_t H = config.hidden;
    const int64_t K = config.top_k;
    const auto num = static_cast<std::size_t>(R);
    std::vector<std::vector<uint16_t>> expert_out(num);
    std::vector<std::vector<float>> source_weights(num);
    std::vector<DeviceArray> expert_dev(num), weights_dev(num), out(num);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (int r = 0; r < R; ++r) {
      const int64_t n = layouts[std::size_t(r)].num_recv;
      const int64_t T = layouts[std::size_t(r)].num_tokens;
      auto& e = expert_out[std::size_t(r)];
      e.resize(std::size_t(n * H));
      for (auto& v : e) v = identity_value(9 + r, int64_t(rng() % 100000), 5);
      expert_dev[std::size_t(r)] = upload(rank_device(r), e);
      auto& w = source_weights[std::size_t(r)];
      w.resize(std::size_t(T * K));
      for (auto& v : w) v = uni(rng);
      weights_dev[std::size_t(r)] = upload(rank_device(r), w);
      out[std::size_t(r)] = DeviceArray(rank_device(r), std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(T * H * 2)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      const int64_t T = layouts[std::size_t(r)].num_tokens;
      weft::ep::CombineInputs cin;
      cin.expert_out = {expert_dev[std::size_t(r)].ptr, DType::kBFloat16,
                        layouts[std::size_t(r)].num_recv, H};
      cin.source_weights = {weights_dev[std::size_t(r)].ptr, DType::kFloat32, T, K};
      eps[std::size_t(r)]->combine(cin, res[std::size_t(r)].handle, out[std::size_t(r)].ptr,
                                   streams[std::size_t(r)]);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      const auto want = ref::combine_weighted(config, r, layouts, expert_out, source_weights);
      const auto got = download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, want.size());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
      ASSERT_EQ(wrong, 0u) << "rank " << r << ": weighted combine differs from the reference";
    }
  }

  BufferConfig config;
  int R = 0;
  std::vector<std::unique_ptr<weft::ep::Buffer>> eps;
  std::vector<cudaStream_t> streams;
  std::vector<DeviceArray> x, idx, weights, stats;
  std::vector<std::vector<uint32_t>> want_stats;
  std::vector<weft::ep::DispatchResult> views;  // the last expanded dispatch's, for poison()
};

// Layout and combine over alignments, zero padding, both count modes (T <= 1024: local, above:
// grid), index widths, per-call SMs (1 block: many sub-chunks per block), repeated and masked
// selections, a rank with no tokens, accumulated statistics. A token has at most 6 rows at a
// rank (top-6), plus up to 127 padding rows per expert at alignment 128: expand_factor 12 holds
// that even at one rank, where every expert is local.
TEST_F(EpExpandedTest, LayoutAndCombineMatchReference) {
  make({.max_tokens = 1100, .hidden = 256, .num_experts = 32, .top_k = 6, .expand_factor = 12});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (int64_t T : {int64_t(0), int64_t(1), int64_t(100), int64_t(1025), int64_t(1100)}) {
    for (int alignment : {1, 16, 128}) {
      ++trial;
      RoutingSpec spec{.tokens = tokens(T), .mask_ratio = 0.2, .repeat_ratio = 0.1};
      if (trial % 4 == 0) spec.tokens[0] = 0;
      const Call call{
          .expand = {.enabled = true,
                     .expert_alignment = alignment,
                     .zero_padding = trial % 2 == 0},
          .idx64 = trial % 3 != 0,
          .mode = trial % 2 == 1 ? weft::ep::CountMode::kExact : weft::ep::CountMode::kOnDevice,
          .num_sms = trial % 5 == 0 ? 1 : (trial % 5 == 1 ? 3 : 0),
          .stats = true};
      SCOPED_TRACE(testing::Message()
                   << "T " << T << " alignment " << alignment << " trial " << trial);
      const auto inputs = make_inputs(config, spec, rng, false);
      const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
      for (const auto& L : layouts) ASSERT_FALSE(L.overflowed) << "the test's routing overflowed";
      const auto res = dispatch(inputs, call);
      check_layout(layouts, res, call);
      check_combine(layouts, res, trial % 3, trial % 4 == 1, rng);
    }
  }
}

// top-16 of 1024 experts: the expanded dispatch's shared memory (16 bytes per expert, 8 per local
// expert, 2 KB per selection) is above 48 KB, which needs the launch's opt-in to more (local and
// grid mode). Alignment 1 and expand_factor 16 (= top_k): no routing overflows.
TEST_F(EpExpandedTest, TopSixteenOfAThousandExpertsPastFortyEightKilobytes) {
  make({.max_tokens = 1100, .hidden = 128, .num_experts = 1024, .top_k = 16, .expand_factor = 16});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (int64_t T : {int64_t(1), int64_t(300), int64_t(1100)}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    const RoutingSpec spec{.tokens = tokens(T), .mask_ratio = 0.1, .repeat_ratio = 0.1};
    const Call call{
        .expand = {.enabled = true, .zero_padding = trial % 2 == 0},
        .mode = trial % 2 == 1 ? weft::ep::CountMode::kExact : weft::ep::CountMode::kOnDevice};
    const auto inputs = make_inputs(config, spec, rng, false);
    const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
    for (const auto& L : layouts) ASSERT_FALSE(L.overflowed) << "the test's routing overflowed";
    const auto res = dispatch(inputs, call);
    check_layout(layouts, res, call);
    check_combine(layouts, res, trial % 3, false, rng);
    ++trial;
  }
}

// Packed fp8 rows move as opaque bytes into the expanded layout (padding zeroed or untouched);
// combine takes bf16 expert outputs as ever.
TEST_F(EpExpandedTest, Fp8PackedRows) {
  std::mt19937 rng(std::random_device{}());
  for (int64_t hidden : {128, 2048}) {  // 144-byte rows, 2112-byte rows
    make({.max_tokens = 300, .hidden = hidden, .num_experts = 16, .top_k = 4, .expand_factor = 4});
    for (bool zero_padding : {true, false}) {
      SCOPED_TRACE(testing::Message() << "hidden " << hidden << " zero_padding " << zero_padding);
      const auto inputs =
          make_inputs(config, {.tokens = tokens(300), .mask_ratio = 0.1}, rng, true);
      const Call call{
          .expand = {.enabled = true, .expert_alignment = 8, .zero_padding = zero_padding},
          .fp8 = true};
      const auto layouts = ref::dispatch(config, inputs, {.fp8 = true, .expand = call.expand});
      const auto res = dispatch(inputs, call);
      for (const auto& rr : res) {
        ASSERT_EQ(rr.recv_x, nullptr);
        ASSERT_EQ(rr.row_bytes, weft::ep::fp8_row_layout(hidden).row_bytes);
      }
      check_layout(layouts, res, call);
      check_combine(layouts, res, 1, false, rng);
    }
  }
}

// Cached dispatch of an expanded layout: new payload into the handle's rows (padding zeroed
// again with zero_padding, untouched without), metadata, counts and segments the layout's; twice
// (once naming the layout's expand options, once leaving them unset), each time equal to a fresh
// expanded dispatch of the same routing; combine with the handle; stats accumulate. Then a new
// layout makes the handle stale. Both count modes (T <= 1024 local, above grid), bf16 and fp8.
TEST_F(EpExpandedTest, CachedDispatchMatchesFresh) {
  make({.max_tokens = 1100, .hidden = 256, .num_experts = 32, .top_k = 6, .expand_factor = 6});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (int64_t T : {int64_t(100), int64_t(1100)}) {
    for (bool fp8 : {false, true}) {
      for (bool zero_padding : {true, false}) {
        ++trial;
        SCOPED_TRACE(testing::Message() << "T " << T << " fp8 " << fp8 << " zero_padding "
                                        << zero_padding);
        auto inputs = make_inputs(
            config, {.tokens = tokens(T), .mask_ratio = 0.2, .repeat_ratio = 0.1}, rng, fp8);
        const Call call{
            .expand = {.enabled = true, .expert_alignment = 16, .zero_padding = zero_padding},
            .fp8 = fp8,
            .num_sms = trial % 3 == 0 ? 2 : 0,
            .stats = true};
        const ref::DispatchOptions options{.fp8 = fp8, .expand = call.expand};
        const auto res = dispatch(inputs, call);
        check_layout(ref::dispatch(config, inputs, options), res, call);
        std::vector<weft::ep::Handle> handles;
        for (const auto& rr : res) handles.push_back(rr.handle);
        for (int round = 1; round <= 2; ++round) {
          refill_x(config, inputs, 10 * round);  // new payload, same routing
          Call cached = call;
          cached.handles = handles.data();
          cached.cached_expand_unset = round == 2;
          cached.num_sms = round == 1 ? 1 : 0;  // a grid other than the layout's
          const auto cres = dispatch(inputs, cached);
          const auto want = ref::dispatch(config, inputs, options);
          for (int r = 0; r < R; ++r) {
            EXPECT_EQ(cres[std::size_t(r)].handle.sequence, handles[std::size_t(r)].sequence);
          }
          check_layout(want, cres, call);
          check_combine(want, cres, round % 2, round == 2 && !fp8, rng);
        }
        // A new layout makes the handles stale.
        const auto again = dispatch(inputs, call);
        check_layout(ref::dispatch(config, inputs, options), again, call);
        for (int r = 0; r < R; ++r) {
          weft::ep::DispatchInputs stale{
              .x = {x[std::size_t(r)].ptr, fp8 ? DType::kUInt8 : DType::kBFloat16,
                    inputs[std::size_t(r)].num_tokens,
                    fp8 ? weft::ep::fp8_row_layout(config.hidden).row_bytes : config.hidden},
              .handle = &handles[std::size_t(r)]};
          EXPECT_THROW(eps[std::size_t(r)]->dispatch(stale, streams[std::size_t(r)]), weft::Error);
        }
      }
    }
  }
}

// R > 1 ranks, 4 experts each: rank 0 needs 4 rows per token of every rank (top-5, its 4
// experts first): 256 R rows against a capacity of 1 x R x 64; at 2 ranks rank 1 needs exactly
// its capacity, at more the fifth selections spread over R - 1 ranks fit theirs. 1 rank (8
// experts): 5 rows per token, 320 against 64. Rank 0 receives nothing and reports its need,
// nothing of its window is written, the other ranks are complete; the combine is skipped on every
// rank with a clear error; then the Buffer works as before.
TEST_F(EpExpandedTest, OverflowIsReportedAndNothingCorrupts) {
  const int num_ranks = team_size();
  make({.max_tokens = 64, .hidden = 128, .num_experts = num_ranks == 1 ? 8 : 4 * num_ranks,
        .top_k = 5, .expand_factor = 1});
  const int64_t needed = R == 1 ? 320 : 256 * R;
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    const std::vector<int64_t> full(std::size_t(R), 64);
    const auto inputs = make_inputs(config, {.tokens = full, .crowd_rank0 = true}, rng, false);
    const Call call{.expand = {.enabled = true, .zero_padding = true},
                    .mode = weft::ep::CountMode::kExact};
    const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
    ASSERT_TRUE(layouts[0].overflowed);
    ASSERT_EQ(layouts[0].rows_required, needed);
    if (R == 2) {
      ASSERT_FALSE(layouts[1].overflowed);
      ASSERT_EQ(layouts[1].rows_required, 128);
    }
    const auto res = dispatch(inputs, call);
    EXPECT_EQ(res[0].num_recv, 0);
    EXPECT_EQ(res[0].rows_required, layouts[0].rows_required);
    check_layout(layouts, res, call);
    // A cached dispatch of the overflowed layout writes nothing at rank 0 either (rows poisoned
    // again first) and rank 1's rows and zeroed padding as before.
    std::vector<weft::ep::Handle> handles;
    for (const auto& rr : res) handles.push_back(rr.handle);
    Call cached = call;
    cached.handles = handles.data();
    cached.mode = weft::ep::CountMode::kOnDevice;
    check_layout(layouts, dispatch(inputs, cached), cached);

    std::vector<DeviceArray> out;
    for (int r = 0; r < R; ++r) {
      out.emplace_back(rank_device(r), std::size_t(64 * config.hidden * 2));
      WEFT_CUDA_CHECK(cudaMemset(out.back().ptr, 0xFF, std::size_t(64 * config.hidden * 2)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      const auto& rr = res[std::size_t(r)];
      eps[std::size_t(r)]->combine(
          {.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, config.hidden}}, rr.handle,
          out[std::size_t(r)].ptr, streams[std::size_t(r)]);
    }
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[std::size_t(r)]));
      try {
        eps[std::size_t(r)]->check();
        ADD_FAILURE() << "rank " << r << ": no error for the combine of an overflowed dispatch";
      } catch (const weft::Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("overflowed at rank 0, which needed " + std::to_string(needed) +
                            " rows for a capacity of " + std::to_string(64 * R)),
                  std::string::npos)
            << what;
      }
      const auto got =
          download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, std::size_t(64 * config.hidden));
      EXPECT_EQ(std::count(got.begin(), got.end(), uint16_t(0xFFFF)), std::ptrdiff_t(got.size()))
          << "rank " << r << ": out was written";
    }
    // The Buffer stays usable: one selection per token needs at most R x 64 rows anywhere.
    std::vector<int64_t> fewer = full;
    fewer.back() = R > 1 ? 63 : 64;
    const auto fits = make_inputs(config, {.tokens = fewer, .max_selections = 1}, rng, false);
    const auto fit_layouts = ref::dispatch(config, fits, {.expand = call.expand});
    const auto fit_res = dispatch(fits, call);
    check_layout(fit_layouts, fit_res, call);
    check_combine(fit_layouts, fit_res, 1, round == 0, rng);
  }
}

// Fixed-stride segments (ExpandOptions::segment_stride = R * max_tokens, DeepEP's low-latency
// layout: segment e at e * S whatever the counts) and the weighted combine, over T from 0 to
// max_tokens, masked and repeated selections, tokens that select nothing, both count modes,
// one block and the default grid, rows of several 64-vector units (the sparse combine's split);
// the same Buffer also runs packed expanded dispatches between.
TEST_F(EpExpandedTest, FixedStrideSegmentsAndWeightedCombine) {
  const int num_ranks = team_size();
  const int64_t M = 48;
  const int epr = 6;
  make({.max_tokens = M, .hidden = 1152, .num_experts = epr * num_ranks, .top_k = 4,
        .expand_factor = epr});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (int64_t T : {int64_t(0), int64_t(1), int64_t(5), int64_t(M)}) {
    for (int alignment : {1, 8}) {
      ++trial;
      SCOPED_TRACE(testing::Message() << "T " << T << " alignment " << alignment);
      RoutingSpec spec{.tokens = tokens(T), .mask_ratio = 0.3, .repeat_ratio = 0.1};
      if (trial % 3 == 0) spec.max_selections = 0;  // no token selects anything
      const int64_t stride = (R * M + alignment - 1) / alignment * alignment;
      Call call{.expand = {.enabled = true, .expert_alignment = alignment,
                           .segment_stride = stride},
                .idx64 = trial % 2 == 0,
                .mode = trial % 2 == 1 ? weft::ep::CountMode::kExact : weft::ep::CountMode::kOnDevice,
                .num_sms = trial % 4 == 0 ? 1 : 0};
      if (stride * epr > config.expand_capacity(R)) continue;  // alignment 8 at some R
      const auto inputs = make_inputs(config, spec, rng, false);
      const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
      for (const auto& L : layouts) {
        ASSERT_FALSE(L.overflowed);
        ASSERT_EQ(L.num_recv, epr * stride);
        for (int e = 0; e <= epr; ++e) ASSERT_EQ(L.segment_begin[std::size_t(e)], e * stride);
      }
      const auto res = dispatch(inputs, call);
      check_layout(layouts, res, call);
      check_weighted_combine(layouts, res, rng);
      if (trial % 2 == 0) check_combine(layouts, res, 0, false, rng);  // unweighted, same layout
      // A packed expanded dispatch in between: the fixed stride is per call.
      const Call packed{.expand = {.enabled = true}};
      const auto p_layouts = ref::dispatch(config, inputs, {.expand = packed.expand});
      check_layout(p_layouts, dispatch(inputs, packed), packed);
    }
  }
}

// A fixed stride below an expert's count overflows that rank as the capacity does: reported,
// nothing written, the combine refused on the device.
TEST_F(EpExpandedTest, FixedStrideOverflowIsReported) {
  const int num_ranks = team_size();
  make({.max_tokens = 32, .hidden = 128, .num_experts = 2 * num_ranks, .top_k = 2,
        .expand_factor = 2});
  std::mt19937 rng(std::random_device{}());
  const auto inputs =
      make_inputs(config, {.tokens = std::vector<int64_t>(std::size_t(R), 32), .crowd_rank0 = true},
                  rng, false);
  const Call call{.expand = {.enabled = true, .segment_stride = 8},
                  .mode = weft::ep::CountMode::kExact};
  const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
  ASSERT_TRUE(layouts[0].overflowed);
  ASSERT_EQ(layouts[0].rows_required, 2 * 32 * R);  // 2 experts x the largest count
  const auto res = dispatch(inputs, call);
  EXPECT_EQ(res[0].num_recv, 0);
  EXPECT_EQ(res[0].rows_required, layouts[0].rows_required);
  check_layout(layouts, res, call);
  // A stride whose rows exceed the capacity is refused on the host.
  weft::ep::DispatchInputs din;
  din.x = {x[0].ptr, DType::kBFloat16, 0, config.hidden};
  din.topk_idx = {idx[0].ptr, DType::kInt64, 0, config.top_k};
  din.topk_weights = {weights[0].ptr, DType::kFloat32, 0, config.top_k};
  din.expand = {.enabled = true, .segment_stride = 32 * R + 1};
  EXPECT_THROW(eps[0]->dispatch(din, streams[0]), weft::Error);
  din.expand = {.enabled = true, .segment_stride = -1};
  EXPECT_THROW(eps[0]->dispatch(din, streams[0]), weft::Error);
  // source_weights: [T, top_k] float32, without bias (checked before anything is launched).
  const int64_t T = 32;
  DeviceArray w(rank_device(0), std::size_t(T * config.top_k * 4));
  DeviceArray out(rank_device(0), std::size_t(T * config.hidden * 2));
  weft::ep::CombineInputs cin;
  cin.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, config.hidden};
  cin.source_weights = {w.ptr, DType::kFloat32, T, config.top_k};
  cin.bias0 = {out.ptr, DType::kBFloat16, T, config.hidden};
  EXPECT_THROW(eps[0]->combine(cin, res[0].handle, out.ptr, streams[0]), weft::Error);
  cin.bias0 = {};
  cin.source_weights = {w.ptr, DType::kFloat32, T, config.top_k - 1};
  EXPECT_THROW(eps[0]->combine(cin, res[0].handle, out.ptr, streams[0]), weft::Error);
  cin.source_weights = {w.ptr, DType::kInt32, T, config.top_k};
  EXPECT_THROW(eps[0]->combine(cin, res[0].handle, out.ptr, streams[0]), weft::Error);
}

// Thousands of back-to-back calls with changing routing and no host sync in between, on one
// Buffer, alternating expanded and deduplicated dispatches (the two layouts share the window and
// the call sequence); every 97th round, and the last, checked in full.
TEST_F(EpExpandedTest, ThousandsOfBackToBackCalls) {
  make({.max_tokens = 256, .hidden = 512, .num_experts = 32, .top_k = 6, .expand_factor = 6});
  std::mt19937 rng(std::random_device{}());
  constexpr int kRoutings = 6;
  const int64_t H = config.hidden;
  const int K = config.top_k;
  std::vector<std::vector<ref::RankInput>> routings;
  std::vector<std::vector<DeviceArray>> dx(kRoutings), didx(kRoutings), dw(kRoutings),
      dout(kRoutings);
  auto options = [](int i) {
    return ExpandOptions{.enabled = i % 3 != 2,
                         .expert_alignment = std::vector<int>{1, 8, 64}[std::size_t(i % 3)],
                         .zero_padding = i % 2 == 0};
  };
  for (int i = 0; i < kRoutings; ++i) {
    RoutingSpec spec{.tokens = tokens(256 - 41 * i), .mask_ratio = 0.1 * i, .repeat_ratio = 0.05};
    routings.push_back(make_inputs(config, spec, rng, false));
    for (int r = 0; r < R; ++r) {
      const auto& in = routings.back()[std::size_t(r)];
      dx[std::size_t(i)].push_back(upload(rank_device(r), in.x));
      didx[std::size_t(i)].push_back(upload(rank_device(r), in.topk_idx));
      dw[std::size_t(i)].push_back(upload(rank_device(r), in.topk_weights));
      dout[std::size_t(i)].emplace_back(rank_device(r), std::size_t(in.num_tokens * H * 2));
    }
  }
  constexpr int kRounds = 2000;
  for (int it = 0; it < kRounds; ++it) {
    const int i = it % kRoutings;
    const bool checked = it % 97 == 0 || it == kRounds - 1;
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      const auto T = routings[std::size_t(i)][std::size_t(r)].num_tokens;
      if (checked) {
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        WEFT_CUDA_CHECK(cudaMemsetAsync(dout[std::size_t(i)][std::size_t(r)].ptr, 0xFF,
                                        std::size_t(T * H * 2), streams[std::size_t(r)]));
      }
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
          {.x = {dx[std::size_t(i)][std::size_t(r)].ptr, DType::kBFloat16, T, H},
           .topk_idx = {didx[std::size_t(i)][std::size_t(r)].ptr, DType::kInt64, T, K},
           .topk_weights = {dw[std::size_t(i)][std::size_t(r)].ptr, DType::kFloat32, T, K},
           .expand = options(i)},
          streams[std::size_t(r)]);
    }
    for (int r = 0; r < R; ++r) {
      const auto& rr = res[std::size_t(r)];
      eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                   rr.handle, dout[std::size_t(i)][std::size_t(r)].ptr,
                                   streams[std::size_t(r)]);
    }
    if (!checked) continue;
    sync_all();
    const auto layouts = ref::dispatch(config, routings[std::size_t(i)], {.expand = options(i)});
    std::vector<std::vector<uint16_t>> eo;
    for (const auto& L : layouts) eo.push_back(L.recv_x);
    for (int r = 0; r < R; ++r) {
      const auto n = download<int32_t>(rank_device(r), res[std::size_t(r)].num_recv_device, 1)[0];
      ASSERT_EQ(n, layouts[std::size_t(r)].num_recv) << "round " << it << " rank " << r;
      if (options(i).enabled) {
        ASSERT_EQ(download<int64_t>(rank_device(r), res[std::size_t(r)].segment_begin, std::size_t(epr() + 1)),
                  layouts[std::size_t(r)].segment_begin)
            << "round " << it << " rank " << r;
      }
      const auto want = ref::combine(config, r, layouts, eo, {}, {});
      const auto got = download<uint16_t>(rank_device(r), dout[std::size_t(i)][std::size_t(r)].ptr, want.size());
      ASSERT_EQ(got, want) << "round " << it << " rank " << r;
    }
  }
}

TEST_F(EpExpandedTest, BadArgumentsAreClearErrors) {
  // A Buffer without expand_factor refuses the expanded layout (its window has no room for it).
  make({.max_tokens = 32, .hidden = 128, .num_experts = 8, .top_k = 2});
  std::mt19937 rng(std::random_device{}());
  auto inputs = make_inputs(config, {.tokens = tokens(32)}, rng, false);
  Call call;
  EXPECT_THROW(dispatch(inputs, call), weft::Error);
  EXPECT_EQ(eps[0]->expand_capacity(), 0);

  // Room for every selection plus the padding at one rank too (2 rows a token + 8 x 3).
  make({.max_tokens = 32, .hidden = 128, .num_experts = 8, .top_k = 2, .expand_factor = 4});
  EXPECT_EQ(eps[0]->expand_capacity(), 4 * R * 32);
  for (int alignment : {0, 4097}) {
    call.expand.expert_alignment = alignment;
    EXPECT_THROW(dispatch(inputs, call), weft::Error) << "alignment " << alignment;
  }
  call.expand.expert_alignment = 4;
  const auto layouts = ref::dispatch(config, inputs, {.expand = call.expand});
  const auto res = dispatch(inputs, call);
  check_layout(layouts, res, call);
  for (int r = 0; r < R; ++r) {
    const auto& rr = res[std::size_t(r)];
    // A cached dispatch that names other expand options than its handle's layout is refused.
    weft::ep::DispatchInputs cached{.x = {x[std::size_t(r)].ptr, DType::kBFloat16,
                                          inputs[std::size_t(r)].num_tokens, config.hidden},
                                    .handle = &rr.handle,
                                    .expand = {.enabled = true, .expert_alignment = 8}};
    EXPECT_THROW(eps[std::size_t(r)]->dispatch(cached, streams[std::size_t(r)]), weft::Error);
    // expert_out rows beyond the expanded capacity.
    DeviceArray out(rank_device(r), std::size_t(32 * config.hidden * 2));
    EXPECT_THROW(eps[std::size_t(r)]->combine(
                     {.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity + 1, config.hidden}},
                     rr.handle, out.ptr, streams[std::size_t(r)]),
                 weft::Error);
  }
  // Nothing was launched by the refused calls: the ranks still agree and combine.
  check_combine(layouts, res, 0, false, rng);

  // An expert id out of range is dropped and reported by its rank; the others are unaffected.
  inputs = make_inputs(config, {.tokens = tokens(32)}, rng, false);
  inputs[0].topk_idx[3] = 8;
  const Call bad_call{.mode = weft::ep::CountMode::kExact};
  auto bad = launch(inputs, bad_call);
  for (int r = 0; r < R; ++r) {
    if (r > 0) {
      EXPECT_NO_THROW(eps[std::size_t(r)]->wait_num_recv(bad[std::size_t(r)]));
      continue;
    }
    try {
      eps[0]->wait_num_recv(bad[0]);
      ADD_FAILURE() << "no error for an expert id out of range";
    } catch (const weft::Error& e) {
      EXPECT_NE(std::string(e.what()).find("expert id 8, out of range"), std::string::npos)
          << e.what();
    }
  }
  inputs = make_inputs(config, {.tokens = tokens(32)}, rng, false);
  const auto clean = ref::dispatch(config, inputs, {.expand = bad_call.expand});
  const auto clean_res = dispatch(inputs, bad_call);
  check_layout(clean, clean_res, bad_call);
  check_combine(clean, clean_res, 2, false, rng);
}

}  // namespace
