// weft::ep dispatch/combine on 2+ GPUs (one process driving all of them, and one process per GPU
// through Buffer::from_env and Buffer(ncclComm_t, ...)), checked element by
// element against the CPU reference. Every payload element is a hash of (source rank, source
// token, column), so a misrouted row cannot look plausible; outputs are poisoned before each
// call; inputs are drawn fresh per round.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::upload;

int num_gpus() { return weft::cuda::device_count(); }

#define REQUIRE_GPUS()                                                                   \
  do {                                                                                   \
    if (num_gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << num_gpus();           \
  } while (0)

struct RoutingSpec {
  std::vector<int64_t> tokens;  // per rank
  double mask_ratio = 0.0;
  int only_rank = -1;           // every selection on this rank (-1: random)
  int avoid_rank = -1;          // no selection on this rank
  bool all_masked = false;
};

std::vector<ref::RankInput> make_inputs(const BufferConfig& c, int R, const RoutingSpec& spec,
                                        std::mt19937& rng) {
  std::vector<ref::RankInput> inputs(static_cast<std::size_t>(R));
  const int epr = c.num_experts / R;
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int r = 0; r < R; ++r) {
    auto& in = inputs[static_cast<std::size_t>(r)];
    in.num_tokens = spec.tokens[static_cast<std::size_t>(r)];
    in.x.resize(static_cast<std::size_t>(in.num_tokens * c.hidden));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) {
        in.x[static_cast<std::size_t>(t * c.hidden + h)] = ref::identity_bf16(r, t, h);
      }
      std::vector<int> experts;
      for (int e = 0; e < c.num_experts; ++e) {
        const int owner = e / epr;
        if (spec.only_rank >= 0 && owner != spec.only_rank) continue;
        if (spec.avoid_rank >= 0 && owner == spec.avoid_rank) continue;
        experts.push_back(e);
      }
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < c.top_k; ++k) {
        int64_t e = experts[static_cast<std::size_t>(k) % experts.size()];
        if (spec.all_masked || uni(rng) < spec.mask_ratio) e = -1;
        in.topk_idx.push_back(e);
        in.topk_weights.push_back(uni(rng));
      }
    }
  }
  return inputs;
}

struct RankDevice {
  DeviceArray x, idx, weights, out, bias0, bias1, expert_out;
  cudaStream_t stream = nullptr;
};

class EpTest : public ::testing::Test {
 protected:
  // The options default to BufferOptions{} (combine_send_warps, tokens_per_block as shipped).
  void make(const BufferConfig& c, const weft::ep::BufferOptions& o = {}) {
    config = c;
    R = num_gpus();
    eps = weft::ep::Buffer::create_local(R, c, o);
    ranks.resize(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&ranks[static_cast<std::size_t>(r)].stream,
                                                cudaStreamNonBlocking));
    }
  }
  void TearDown() override {
    for (auto& rd : ranks) {
      if (rd.stream != nullptr) cudaStreamDestroy(rd.stream);
    }
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[static_cast<std::size_t>(r)].stream));
    }
  }

  // One dispatch + checks + combine + checks. expert_out: the received rows themselves
  // (zero-copy round trip) or fresh random rows.
  void round(const std::vector<ref::RankInput>& inputs, bool idx64, int num_bias,
             bool random_expert_out, bool exact) {
    const auto layouts = ref::dispatch(config, inputs);
    const int64_t H = config.hidden;
    const int K = config.top_k;
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[static_cast<std::size_t>(r)];
      const auto& in = inputs[static_cast<std::size_t>(r)];
      rd.x = upload(r, in.x);
      if (idx64) {
        rd.idx = upload(r, in.topk_idx);
      } else {
        std::vector<int32_t> v(in.topk_idx.begin(), in.topk_idx.end());
        rd.idx = upload(r, v);
      }
      rd.weights = upload(r, in.topk_weights);
    }
    // Poison the (zero-copy) outputs of every rank before any rank starts.
    for (int r = 0; r < R; ++r) {
      auto* b = eps[static_cast<std::size_t>(r)].get();
      if (poison_ptr_.size() == static_cast<std::size_t>(R)) {
        WEFT_CUDA_CHECK(cudaSetDevice(r));
        const auto& pp = poison_ptr_[static_cast<std::size_t>(r)];
        WEFT_CUDA_CHECK(cudaMemset(const_cast<uint16_t*>(pp.recv_x), 0xFF, b->capacity() * H * 2));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.recv_expert_idx), 0x7F, b->capacity() * K * 4));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<float*>(pp.recv_weights), 0xFF, b->capacity() * K * 4));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.recv_src), 0x7F, b->capacity() * 8));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.tokens_per_local_expert), 0x7F,
                                   config.num_local_experts(R) * 4));
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      }
    }
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[static_cast<std::size_t>(r)];
      const auto T = inputs[static_cast<std::size_t>(r)].num_tokens;
      weft::ep::DispatchInputs din{
          .x = {rd.x.ptr, DType::kBFloat16, T, H},
          .topk_idx = {rd.idx.ptr, idx64 ? DType::kInt64 : DType::kInt32, T, K},
          .topk_weights = {rd.weights.ptr, DType::kFloat32, T, K}};
      res[static_cast<std::size_t>(r)] = eps[static_cast<std::size_t>(r)]->dispatch(
          din, rd.stream, exact ? weft::ep::CountMode::kExact : weft::ep::CountMode::kOnDevice);
    }
    std::vector<int64_t> num_recv(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& res_r = res[static_cast<std::size_t>(r)];
      if (exact) {
        num_recv[static_cast<std::size_t>(r)] = eps[static_cast<std::size_t>(r)]->wait_num_recv(res_r);
      } else {
        WEFT_CUDA_CHECK(cudaSetDevice(r));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[static_cast<std::size_t>(r)].stream));
        eps[static_cast<std::size_t>(r)]->check();
        num_recv[static_cast<std::size_t>(r)] = download<int32_t>(r, res_r.num_recv_device, 1)[0];
      }
    }
    poison_ptr_ = res;
    for (int r = 0; r < R; ++r) {
      const auto& L = layouts[static_cast<std::size_t>(r)];
      const auto& rr = res[static_cast<std::size_t>(r)];
      const auto n = num_recv[static_cast<std::size_t>(r)];
      ASSERT_EQ(n, L.num_recv) << "rank " << r;
      const auto rx = download<uint16_t>(r, rr.recv_x, std::size_t(n * H));
      ASSERT_EQ(rx, L.recv_x) << "rank " << r << ": received rows differ";
      const auto src = download<int32_t>(r, rr.recv_src, std::size_t(n * 2));
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(src[std::size_t(2 * j)], L.recv_src_rank[std::size_t(j)]) << "row " << j;
        ASSERT_EQ(src[std::size_t(2 * j + 1)], L.recv_src_token[std::size_t(j)]) << "row " << j;
      }
      EXPECT_EQ(download<int32_t>(r, rr.recv_expert_idx, std::size_t(n * K)), L.recv_expert_idx);
      EXPECT_EQ(download<float>(r, rr.recv_weights, std::size_t(n * K)), L.recv_weights);
      EXPECT_EQ(download<int32_t>(r, rr.tokens_per_local_expert,
                                  std::size_t(config.num_local_experts(R))),
                L.tokens_per_local_expert);
    }

    // Combine.
    std::vector<std::vector<uint16_t>> expert_out(static_cast<std::size_t>(R));
    std::vector<std::vector<uint16_t>> bias0(static_cast<std::size_t>(R)), bias1(static_cast<std::size_t>(R));
    std::mt19937 rng(static_cast<uint32_t>(num_recv[0] * 7 + 1));
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[static_cast<std::size_t>(r)];
      const auto n = num_recv[static_cast<std::size_t>(r)];
      const auto T = inputs[static_cast<std::size_t>(r)].num_tokens;
      if (random_expert_out) {
        auto& e = expert_out[static_cast<std::size_t>(r)];
        e.resize(std::size_t(n * H));
        for (auto& v : e) v = ref::identity_bf16(7 + r, int64_t(rng() % 100000), 3);
        rd.expert_out = upload(r, e);
      } else {
        expert_out[static_cast<std::size_t>(r)] = layouts[static_cast<std::size_t>(r)].recv_x;
      }
      for (int b = 0; b < num_bias; ++b) {
        auto& bias = b == 0 ? bias0[static_cast<std::size_t>(r)] : bias1[static_cast<std::size_t>(r)];
        bias.resize(std::size_t(T * H));
        for (int64_t i = 0; i < T * H; ++i) bias[std::size_t(i)] = ref::identity_bf16(20 + b, i / H, i % H);
        (b == 0 ? rd.bias0 : rd.bias1) = upload(r, bias);
      }
      rd.out = DeviceArray(r, std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(rd.out.ptr, 0xFF, std::size_t(T * H * 2)));
    }
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[static_cast<std::size_t>(r)];
      const auto& rr = res[static_cast<std::size_t>(r)];
      const auto T = inputs[static_cast<std::size_t>(r)].num_tokens;
      weft::ep::CombineInputs cin;
      cin.expert_out = random_expert_out
                           ? weft::ep::TensorView{rd.expert_out.ptr, DType::kBFloat16,
                                                  num_recv[std::size_t(r)], H}
                           : weft::ep::TensorView{rr.recv_x, DType::kBFloat16, rr.capacity, H};
      if (num_bias >= 1) cin.bias0 = {rd.bias0.ptr, DType::kBFloat16, T, H};
      if (num_bias >= 2) cin.bias1 = {rd.bias1.ptr, DType::kBFloat16, T, H};
      eps[static_cast<std::size_t>(r)]->combine(cin, rr.handle, rd.out.ptr, rd.stream);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      eps[static_cast<std::size_t>(r)]->check();
      const auto want = ref::combine(config, r, layouts, expert_out, bias0[std::size_t(r)],
                                     bias1[std::size_t(r)]);
      const auto got = download<uint16_t>(r, ranks[std::size_t(r)].out.ptr, want.size());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
      ASSERT_EQ(wrong, 0u) << "rank " << r << ": combine output differs from the reference";
    }
  }

  BufferConfig config;
  int R = 0;
  std::vector<std::unique_ptr<weft::ep::Buffer>> eps;
  std::vector<RankDevice> ranks;
  std::vector<weft::ep::DispatchResult> poison_ptr_;
};

TEST_F(EpTest, RandomRoutingMatchesReference) {
  REQUIRE_GPUS();
  make({.max_tokens = 2500, .hidden = 2048, .num_experts = 64, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (double mask : {0.0, 0.25}) {
    // Dispatch counts in local mode up to 1024 tokens and in grid mode above (kernels.hpp).
    for (int64_t T : {1, 128, 1000, 1025, 2500}) {
      for (int bias = 0; bias <= 2; ++bias) {
        RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = mask};
        spec.tokens[0] = T - (T > 1 ? 1 : 0);  // ranks with different T
        SCOPED_TRACE(testing::Message() << "T " << T << " mask " << mask << " bias " << bias);
        round(make_inputs(config, R, spec, rng), trial % 2 == 0, bias, trial % 3 == 0,
              trial % 2 == 1);
        ++trial;
      }
    }
  }
}

TEST_F(EpTest, SeedShapeMatchesReference) {
  REQUIRE_GPUS();
  make({.max_tokens = 512, .hidden = 7168, .num_experts = 256, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 512), .mask_ratio = 0.1};
  round(make_inputs(config, R, spec, rng), true, 1, false, true);
  round(make_inputs(config, R, spec, rng), false, 2, true, false);
}

TEST_F(EpTest, EdgeRoutings) {
  REQUIRE_GPUS();
  make({.max_tokens = 300, .hidden = 256, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  const std::vector<int64_t> full(static_cast<std::size_t>(R), 300);
  std::vector<int64_t> none(static_cast<std::size_t>(R), 0);
  std::vector<int64_t> first_empty = full;
  first_empty[0] = 0;
  for (const RoutingSpec& spec :
       {RoutingSpec{.tokens = none}, RoutingSpec{.tokens = first_empty},
        RoutingSpec{.tokens = full, .only_rank = 0}, RoutingSpec{.tokens = full, .avoid_rank = R - 1},
        RoutingSpec{.tokens = full, .all_masked = true},
        RoutingSpec{.tokens = full, .mask_ratio = 0.9}}) {
    round(make_inputs(config, R, spec, rng), true, 1, false, true);
    round(make_inputs(config, R, spec, rng), false, 0, true, true);
  }
}

// Thousands of back-to-back dispatch + combine with changing routing, no host sync in between;
// every 97th round is checked in full, and the last one.
TEST_F(EpTest, ThousandsOfBackToBackCalls) {
  REQUIRE_GPUS();
  make({.max_tokens = 256, .hidden = 512, .num_experts = 32, .top_k = 6});
  std::mt19937 rng(std::random_device{}());
  constexpr int kRoutings = 6;
  std::vector<std::vector<ref::RankInput>> routings;
  std::vector<std::vector<RankDevice>> dev(kRoutings);
  for (int i = 0; i < kRoutings; ++i) {
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 256 - 37 * i),
                     .mask_ratio = 0.1 * i};
    if (i == 4) spec.only_rank = 1;
    routings.push_back(make_inputs(config, R, spec, rng));
  }
  const int64_t H = config.hidden;
  const int K = config.top_k;
  for (int i = 0; i < kRoutings; ++i) {
    dev[std::size_t(i)].resize(std::size_t(R));
    for (int r = 0; r < R; ++r) {
      auto& d = dev[std::size_t(i)][std::size_t(r)];
      const auto& in = routings[std::size_t(i)][std::size_t(r)];
      d.x = upload(r, in.x);
      d.idx = upload(r, in.topk_idx);
      d.weights = upload(r, in.topk_weights);
      d.out = DeviceArray(r, std::size_t(in.num_tokens * H * 2));
    }
  }
  constexpr int kRounds = 2000;
  for (int it = 0; it < kRounds; ++it) {
    const int i = it % kRoutings;
    const bool checked = it % 97 == 0 || it == kRounds - 1;
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& d = dev[std::size_t(i)][std::size_t(r)];
      const auto T = routings[std::size_t(i)][std::size_t(r)].num_tokens;
      if (checked) {
        WEFT_CUDA_CHECK(cudaSetDevice(r));
        WEFT_CUDA_CHECK(cudaMemsetAsync(d.out.ptr, 0xFF, std::size_t(T * H * 2), ranks[std::size_t(r)].stream));
      }
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
          {.x = {d.x.ptr, DType::kBFloat16, T, H},
           .topk_idx = {d.idx.ptr, DType::kInt64, T, K},
           .topk_weights = {d.weights.ptr, DType::kFloat32, T, K}},
          ranks[std::size_t(r)].stream);
    }
    for (int r = 0; r < R; ++r) {
      auto& d = dev[std::size_t(i)][std::size_t(r)];
      const auto& rr = res[std::size_t(r)];
      eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                   rr.handle, d.out.ptr, ranks[std::size_t(r)].stream);
    }
    if (!checked) continue;
    sync_all();
    const auto layouts = ref::dispatch(config, routings[std::size_t(i)]);
    std::vector<std::vector<uint16_t>> eo;
    for (const auto& L : layouts) eo.push_back(L.recv_x);
    for (int r = 0; r < R; ++r) {
      eps[std::size_t(r)]->check();
      const auto n = download<int32_t>(r, res[std::size_t(r)].num_recv_device, 1)[0];
      ASSERT_EQ(n, layouts[std::size_t(r)].num_recv) << "round " << it << " rank " << r;
      const auto want = ref::combine(config, r, layouts, eo, {}, {});
      const auto got = download<uint16_t>(r, dev[std::size_t(i)][std::size_t(r)].out.ptr, want.size());
      ASSERT_EQ(got, want) << "round " << it << " rank " << r;
    }
  }
}

TEST_F(EpTest, BadInputIsAClearErrorAndTheBufferStaysUsable) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 8, .top_k = 2});
  std::mt19937 rng(5);
  RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 64)};
  auto inputs = make_inputs(config, R, spec, rng);
  const int64_t H = config.hidden;
  std::vector<RankDevice>& rd = ranks;
  for (int r = 0; r < R; ++r) {
    auto in = inputs[std::size_t(r)];
    if (r == 0) in.topk_idx[5] = 8;  // out of range
    rd[std::size_t(r)].x = upload(r, in.x);
    rd[std::size_t(r)].idx = upload(r, in.topk_idx);
    rd[std::size_t(r)].weights = upload(r, in.topk_weights);
  }
  auto din = [&](int r, int64_t T) {
    return weft::ep::DispatchInputs{
        .x = {rd[std::size_t(r)].x.ptr, DType::kBFloat16, T, H},
        .topk_idx = {rd[std::size_t(r)].idx.ptr, DType::kInt64, T, 2},
        .topk_weights = {rd[std::size_t(r)].weights.ptr, DType::kFloat32, T, 2}};
  };
  // Host-visible errors: nothing is launched.
  auto& ep0 = *eps[0];
  auto bad = din(0, 64);
  bad.x.dtype = DType::kFloat32;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.topk_weights.dtype = DType::kBFloat16;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.x.rows = bad.topk_idx.rows = bad.topk_weights.rows = 65;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.x.cols = 120;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  EXPECT_THROW(weft::ep::Buffer::create_local(R, {.max_tokens = 8, .hidden = 12, .num_experts = 8, .top_k = 2}),
               weft::Error);

  // Device-found error: rank 0's out-of-range expert is reported, the call still completes.
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din(r, 64), rd[std::size_t(r)].stream,
                                                       weft::ep::CountMode::kExact);
  }
  try {
    eps[0]->wait_num_recv(res[0]);
    ADD_FAILURE() << "no error for an expert id out of range";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 8, out of range"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
  for (int r = 1; r < R; ++r) EXPECT_NO_THROW(eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]));
  // Handles: another Buffer's, then a stale one.
  DeviceArray out(0, 64 * H * 2);
  EXPECT_THROW(eps[0]->combine({.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, H}},
                               res[1].handle, out.ptr, rd[0].stream),
               weft::Error);
  auto wrong_dtype = weft::ep::CombineInputs{.expert_out = {res[0].recv_x, DType::kFloat32, res[0].capacity, H}};
  EXPECT_THROW(eps[0]->combine(wrong_dtype, res[0].handle, out.ptr, rd[0].stream), weft::Error);
  // The Buffers still agree: a clean round works.
  inputs = make_inputs(config, R, spec, rng);
  round(inputs, false, 1, true, true);
  const auto old_handle = res[0].handle;
  EXPECT_THROW(eps[0]->combine({.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, H}},
                               old_handle, out.ptr, rd[0].stream),
               weft::Error);
}

TEST_F(EpTest, AMissingPeerTimesOutWithRankAndReason) {
  REQUIRE_GPUS();
  make({.max_tokens = 16, .hidden = 64, .num_experts = 4, .top_k = 1}, {.timeout_s = 0.2});
  std::vector<int64_t> idx(16, 0);
  std::vector<float> w(16, 1.0f);
  std::vector<uint16_t> x(16 * 64, 0);
  auto dx = upload(0, x);
  auto di = upload(0, idx);
  auto dw = upload(0, w);
  auto res = eps[0]->dispatch({.x = {dx.ptr, DType::kBFloat16, 16, 64},
                               .topk_idx = {di.ptr, DType::kInt64, 16, 1},
                               .topk_weights = {dw.ptr, DType::kFloat32, 16, 1}},
                              ranks[0].stream, weft::ep::CountMode::kExact);
  try {
    eps[0]->wait_num_recv(res);  // rank 1 never calls
    ADD_FAILURE() << "no timeout";
  } catch (const weft::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 timed out"), std::string::npos) << what;
    EXPECT_NE(what.find("count vector"), std::string::npos) << what;
  }
}

// ---------------------------------------------------------------------------------------------
// One process per GPU. The parent test starts two copies of this binary (fork + exec of
// /proc/self/exe, filtered to EpOneProcessPerGpu.Child) with RANK, WORLD_SIZE, LOCAL_RANK and
// NCCL_COMM_ID=127.0.0.1:<free port>; each child builds its Buffer (from the environment, or over
// a communicator it created itself) and runs checked dispatch + combine rounds. Both children
// must exit 0 within the deadline.
constexpr const char* kChildModeVariable = "WEFT_EP_TEST_CHILD_MODE";  // "env" or "comm"

int free_tcp_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// Rounds of dispatch + combine on this process's rank, checked in full against the reference
// computed for every rank from the same seeds (both processes draw the same inputs).
void checked_rounds_one_rank(weft::ep::Buffer& ep) {
  const BufferConfig& config = ep.config();
  const int R = ep.num_ranks();
  const int rank = ep.rank();
  const int64_t H = config.hidden;
  const int K = config.top_k;
  cudaStream_t stream = nullptr;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int round = 0;
  for (int64_t T : {config.max_tokens, int64_t(100), int64_t(1), config.max_tokens}) {
    SCOPED_TRACE(testing::Message() << "rank " << rank << " round " << round << " T " << T);
    std::mt19937 rng(uint32_t(1000 + round++));
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = 0.1};
    const auto inputs = make_inputs(config, R, spec, rng);
    const auto layouts = ref::dispatch(config, inputs);
    const auto& in = inputs[std::size_t(rank)];
    const auto& L = layouts[std::size_t(rank)];
    auto x = upload(ep.device(), in.x);
    auto idx = upload(ep.device(), in.topk_idx);
    auto w = upload(ep.device(), in.topk_weights);
    auto r = ep.dispatch({.x = {x.ptr, DType::kBFloat16, T, H},
                          .topk_idx = {idx.ptr, DType::kInt64, T, K},
                          .topk_weights = {w.ptr, DType::kFloat32, T, K}},
                         stream, weft::ep::CountMode::kExact);
    const int64_t n = ep.wait_num_recv(r);
    ASSERT_EQ(n, L.num_recv);
    ASSERT_EQ(download<uint16_t>(ep.device(), r.recv_x, std::size_t(n * H)), L.recv_x);
    const auto src = download<int32_t>(ep.device(), r.recv_src, std::size_t(n * 2));
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(src[std::size_t(2 * j)], L.recv_src_rank[std::size_t(j)]) << "row " << j;
      ASSERT_EQ(src[std::size_t(2 * j + 1)], L.recv_src_token[std::size_t(j)]) << "row " << j;
    }
    EXPECT_EQ(download<int32_t>(ep.device(), r.recv_expert_idx, std::size_t(n * K)), L.recv_expert_idx);
    EXPECT_EQ(download<float>(ep.device(), r.recv_weights, std::size_t(n * K)), L.recv_weights);
    EXPECT_EQ(download<int32_t>(ep.device(), r.tokens_per_local_expert,
                                std::size_t(config.num_local_experts(R))),
              L.tokens_per_local_expert);
    std::vector<uint16_t> bias(std::size_t(T * H));
    for (int64_t i = 0; i < T * H; ++i) bias[std::size_t(i)] = ref::identity_bf16(20 + rank, i / H, i % H);
    auto dbias = upload(ep.device(), bias);
    DeviceArray out(ep.device(), std::size_t(T * H * 2));
    WEFT_CUDA_CHECK(cudaMemsetAsync(out.ptr, 0xFF, std::size_t(T * H * 2), stream));
    ep.combine({.expert_out = {r.recv_x, DType::kBFloat16, r.capacity, H},
                .bias0 = {dbias.ptr, DType::kBFloat16, T, H}},
               r.handle, out.ptr, stream);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    ep.check();
    std::vector<std::vector<uint16_t>> expert_out;
    for (const auto& Ld : layouts) expert_out.push_back(Ld.recv_x);
    const auto want = ref::combine(config, rank, layouts, expert_out, bias, {});
    ASSERT_EQ(download<uint16_t>(ep.device(), out.ptr, want.size()), want);
  }
  WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
}

const BufferConfig kOneProcessConfig{.max_tokens = 256, .hidden = 1024, .num_experts = 16,
                                     .top_k = 4};

TEST(EpOneProcessPerGpu, Child) {
  const char* mode = std::getenv(kChildModeVariable);
  if (mode == nullptr) GTEST_SKIP() << "runs only as a child of the other EpOneProcessPerGpu tests";
  if (std::string(mode) == "env") {
    auto ep = weft::ep::Buffer::from_env(kOneProcessConfig);
    checked_rounds_one_rank(*ep);
    return;
  }
  // "comm": this process makes its communicator (NCCL's rendezvous through NCCL_COMM_ID) and the
  // Buffer borrows it.
  WEFT_CUDA_CHECK(cudaSetDevice(std::atoi(std::getenv("LOCAL_RANK"))));
  ncclUniqueId id;
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclComm_t comm = nullptr;
  WEFT_NCCL_CHECK(ncclCommInitRank(&comm, std::atoi(std::getenv("WORLD_SIZE")), id,
                                   std::atoi(std::getenv("RANK"))));
  {
    weft::ep::Buffer ep(comm, kOneProcessConfig);
    checked_rounds_one_rank(ep);
  }
  WEFT_NCCL_CHECK(ncclCommDestroy(comm));
}

// Starts one child per rank in `mode` and waits (at most 120 s) for both to exit 0.
void run_one_process_per_gpu(const char* mode) {
  constexpr int kRanks = 2;
  const int port = free_tcp_port();
  ASSERT_GT(port, 0) << "no free TCP port on 127.0.0.1";
  std::vector<pid_t> pids;
  for (int rank = 0; rank < kRanks; ++rank) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(kRanks));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    env.push_back("NCCL_COMM_ID=127.0.0.1:" + std::to_string(port));
    env.push_back(std::string(kChildModeVariable) + "=" + mode);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=EpOneProcessPerGpu.Child";
    char exe[] = "/proc/self/exe";
    char* argv[] = {exe, filter.data(), nullptr};
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      execve(exe, argv, envp.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::vector<int> status(pids.size(), -1);
  std::size_t running = pids.size();
  while (running > 0 && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        --running;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (status[i] != -1) {
      EXPECT_TRUE(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0)
          << "rank " << i << " (" << mode << ") failed: status " << status[i];
      continue;
    }
    kill(pids[i], SIGKILL);
    waitpid(pids[i], nullptr, 0);
    ADD_FAILURE() << "rank " << i << " (" << mode << ") did not finish within 120 s";
  }
}

TEST(EpOneProcessPerGpu, FromEnv) {
  REQUIRE_GPUS();
  run_one_process_per_gpu("env");
}

TEST(EpOneProcessPerGpu, OverAnExistingCommunicator) {
  REQUIRE_GPUS();
  run_one_process_per_gpu("comm");
}

}  // namespace
