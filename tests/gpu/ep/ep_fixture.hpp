// The fixture of weft::ep's dispatch/combine GPU tests: every rank of the team (team.hpp: every
// visible GPU, or a virtual team on one), routings drawn per rank, and round(): one dispatch +
// combine on every rank, checked element by element against the CPU reference (weft::ep::reference) with poisoned
// outputs. Every payload element is a hash of (source rank, source token, column), so a misrouted
// row cannot look plausible.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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
#include "team.hpp"

namespace weft::ep::testing {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;


// The message of the weft::Error that f() throws; a test failure (and "") if it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const weft::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no weft::Error";
  return {};
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}


// Every test runs on the team of team.hpp: all visible GPUs (one rank each, create_local; one
// GPU is one rank, every row local), or a virtual team of WEFT_EP_VIRTUAL_RANKS ranks on GPU 0.
// REQUIRE_PEERS: the behaviour tested needs a peer (a rank that is late or missing).
#define REQUIRE_GPUS()                                                                   \
  do {                                                                                   \
    if (team_size() < 1) GTEST_SKIP() << "needs a GPU";                                  \
  } while (0)
#define REQUIRE_PEERS()                                                                  \
  do {                                                                                   \
    if (team_size() < 2) {                                                               \
      GTEST_SKIP() << "needs 2 ranks (2 GPUs, or WEFT_EP_VIRTUAL_RANKS=2 or more), found " \
                   << team_size();                                                       \
    }                                                                                    \
  } while (0)

struct RoutingSpec {
  std::vector<int64_t> tokens;  // per rank
  double mask_ratio = 0.0;
  int only_rank = -1;           // every selection on this rank (-1: random)
  int avoid_rank = -1;          // no selection on this rank
  bool all_masked = false;
  bool duplicates = false;      // every odd selection repeats the one before it
};

inline std::vector<ref::RankInput> make_inputs(const BufferConfig& c, int R, const RoutingSpec& spec,
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
        // No expert left (avoid_rank at one rank): no selection.
        int64_t e = experts.empty() ? -1 : experts[static_cast<std::size_t>(k) % experts.size()];
        if (spec.duplicates && k % 2 == 1) e = in.topk_idx.back();  // repeats the previous one
        if (spec.all_masked || uni(rng) < spec.mask_ratio) e = -1;
        in.topk_idx.push_back(e);
        in.topk_weights.push_back(uni(rng));
      }
    }
  }
  return inputs;
}

// Elements where got and want differ (bit for bit).
inline std::size_t count_differences(const std::vector<uint16_t>& got,
                                     const std::vector<uint16_t>& want) {
  std::size_t wrong = got.size() == want.size() ? 0 : std::max(got.size(), want.size());
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) wrong += got[i] != want[i];
  return wrong;
}

// Received sources src [rows][2] (rank, token) against the layout's, row by row.
inline void check_sources(const std::vector<int32_t>& src, const ref::RankLayout& L) {
  ASSERT_EQ(src.size(), 2 * L.recv_src_rank.size());
  for (std::size_t j = 0; j < L.recv_src_rank.size(); ++j) {
    ASSERT_EQ(src[2 * j], L.recv_src_rank[j]) << "row " << j;
    ASSERT_EQ(src[2 * j + 1], L.recv_src_token[j]) << "row " << j;
  }
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
    R = team_size();
    poison_ptr_.clear();  // views of the previous Buffer's window (a test may make several)
    eps.clear();
    eps = make_team(c, o);
    ranks.resize(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      if (ranks[static_cast<std::size_t>(r)].stream != nullptr) continue;
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&ranks[static_cast<std::size_t>(r)].stream,
                                                cudaStreamNonBlocking));
    }
  }
  void TearDown() override {
    for (auto& rd : ranks) {
      if (rd.stream != nullptr) cudaStreamDestroy(rd.stream);
    }
  }
  // Uploads every rank's x (bf16), topk_idx (int64) and weights into ranks[r].
  void put_inputs(const std::vector<ref::RankInput>& inputs) {
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[std::size_t(r)];
      const auto& in = inputs[std::size_t(r)];
      rd.x = upload(rank_device(r), in.x);
      rd.idx = upload(rank_device(r), in.topk_idx);
      rd.weights = upload(rank_device(r), in.topk_weights);
    }
  }
  weft::ep::DispatchInputs inputs_of(int r, int64_t T) const {
    const auto& rd = ranks[std::size_t(r)];
    return {.x = {rd.x.ptr, DType::kBFloat16, T, config.hidden},
            .topk_idx = {rd.idx.ptr, DType::kInt64, T, config.top_k},
            .topk_weights = {rd.weights.ptr, DType::kFloat32, T, config.top_k}};
  }
  // Every rank's dispatch of put_inputs' arrays; with kExact, also every rank's count.
  std::vector<weft::ep::DispatchResult> dispatch_all(const std::vector<ref::RankInput>& inputs,
                                                     weft::ep::CountMode mode) {
    std::vector<weft::ep::DispatchResult> res(std::size_t(R), weft::ep::DispatchResult{});
    for (int r = 0; r < R; ++r) {
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
          inputs_of(r, inputs[std::size_t(r)].num_tokens), ranks[std::size_t(r)].stream, mode);
    }
    for (int r = 0; r < R && mode == weft::ep::CountMode::kExact; ++r) {
      eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]);
    }
    // wait_num_recv may return while the rows still move (its counts are published first).
    if (mode == weft::ep::CountMode::kExact) wait_all();
    return res;
  }
  // Waits for every rank's stream without checking the Buffers' errors.
  void wait_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[std::size_t(r)].stream));
    }
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
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
      rd.x = upload(rank_device(r), in.x);
      if (idx64) {
        rd.idx = upload(rank_device(r), in.topk_idx);
      } else {
        std::vector<int32_t> v(in.topk_idx.begin(), in.topk_idx.end());
        rd.idx = upload(rank_device(r), v);
      }
      rd.weights = upload(rank_device(r), in.topk_weights);
    }
    // Poison the (zero-copy) outputs of every rank before any rank starts.
    for (int r = 0; r < R; ++r) {
      auto* b = eps[static_cast<std::size_t>(r)].get();
      if (poison_ptr_.size() == static_cast<std::size_t>(R)) {
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        const auto& pp = poison_ptr_[static_cast<std::size_t>(r)];
        WEFT_CUDA_CHECK(cudaMemset(const_cast<uint16_t*>(pp.recv_x), 0xFF, b->capacity() * H * 2));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.recv_expert_idx), 0x7F, b->capacity() * K * 4));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<float*>(pp.recv_weights), 0xFF, b->capacity() * K * 4));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.recv_src), 0x7F, b->capacity() * 8));
        WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.tokens_per_local_expert), 0x7F,
                                   config.num_local_experts(R) * 4));
        if (pp.rank_prefix_matrix != nullptr) {
          WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(pp.rank_prefix_matrix), 0x7F,
                                     std::size_t(R) * std::size_t(R) * 4));
        }
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
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[static_cast<std::size_t>(r)].stream));
        eps[static_cast<std::size_t>(r)]->check();
        num_recv[static_cast<std::size_t>(r)] = download<int32_t>(rank_device(r), res_r.num_recv_device, 1)[0];
      }
    }
    // wait_num_recv may return while the rows still move (its counts are published first):
    // the rows are read once the streams are done.
    if (exact) wait_all();
    poison_ptr_ = res;
    for (int r = 0; r < R; ++r) {
      const auto& L = layouts[static_cast<std::size_t>(r)];
      const auto& rr = res[static_cast<std::size_t>(r)];
      const auto n = num_recv[static_cast<std::size_t>(r)];
      ASSERT_EQ(n, L.num_recv) << "rank " << r;
      const auto rx = download<uint16_t>(rank_device(r), rr.recv_x, std::size_t(n * H));
      ASSERT_EQ(rx, L.recv_x) << "rank " << r << ": received rows differ";
      check_metadata(r, rr, L);
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
        rd.expert_out = upload(rank_device(r), e);
      } else {
        expert_out[static_cast<std::size_t>(r)] = layouts[static_cast<std::size_t>(r)].recv_x;
      }
      for (int b = 0; b < num_bias; ++b) {
        auto& bias = b == 0 ? bias0[static_cast<std::size_t>(r)] : bias1[static_cast<std::size_t>(r)];
        bias.resize(std::size_t(T * H));
        for (int64_t i = 0; i < T * H; ++i) bias[std::size_t(i)] = ref::identity_bf16(20 + b, i / H, i % H);
        (b == 0 ? rd.bias0 : rd.bias1) = upload(rank_device(r), bias);
      }
      rd.out = DeviceArray(rank_device(r), std::size_t(T * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(rd.out.ptr, 0xFF, std::size_t(T * H * 2)));
    }
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
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
      const auto got = download<uint16_t>(rank_device(r), ranks[std::size_t(r)].out.ptr, want.size());
      ASSERT_EQ(count_differences(got, want), 0u)
          << "rank " << r << ": combine output differs from the reference";
    }
  }

  // Rank r's received metadata (recv_src, recv_expert_idx, recv_weights, tokens per local
  // expert) against the reference's layout L of that rank.
  void check_metadata(int r, const weft::ep::DispatchResult& rr, const ref::RankLayout& L) {
    const int64_t n = L.num_recv;
    const int K = config.top_k;
    check_sources(download<int32_t>(rank_device(r), rr.recv_src, std::size_t(n * 2)), L);
    EXPECT_EQ(download<int32_t>(rank_device(r), rr.recv_expert_idx, std::size_t(n * K)), L.recv_expert_idx);
    EXPECT_EQ(download<float>(rank_device(r), rr.recv_weights, std::size_t(n * K)), L.recv_weights);
    EXPECT_EQ(download<int32_t>(rank_device(r), rr.tokens_per_local_expert,
                                std::size_t(config.num_local_experts(R))),
              L.tokens_per_local_expert);
    // DeepEP's rank_prefix_matrix: the deduplicated layout's (the expanded one has none).
    ASSERT_EQ(rr.rank_prefix_matrix == nullptr, L.rank_prefix_matrix.empty()) << "rank " << r;
    if (rr.rank_prefix_matrix != nullptr) {
      EXPECT_EQ(download<int32_t>(rank_device(r), rr.rank_prefix_matrix, std::size_t(R) * std::size_t(R)),
                L.rank_prefix_matrix)
          << "rank " << r;
    }
  }

  BufferConfig config;
  int R = 0;
  std::vector<std::unique_ptr<weft::ep::Buffer>> eps;
  std::vector<RankDevice> ranks;
  std::vector<weft::ep::DispatchResult> poison_ptr_;
};

}  // namespace weft::ep::testing
