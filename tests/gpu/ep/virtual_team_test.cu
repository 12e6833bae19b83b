// weft::ep at R ranks: the virtual team's construction (Buffer::create_virtual_team on GPU 0), and
// on the team of team.hpp (every GPU, or WEFT_EP_VIRTUAL_RANKS ranks on one) the paths that only
// exist at more than two ranks: the rotated store-back order, and a thousand back-to-back rounds
// with every received row, source and combined token checked on the device, every round.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"
#include "ep_fixture.hpp"
#include "team.hpp"

namespace {

using weft::ep::Buffer;
using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::contains;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::error_of;
using weft::ep::testing::EpTest;
using weft::ep::testing::make_inputs;
using weft::ep::testing::rank_device;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::team_size;
using weft::ep::testing::upload;

// A virtual team is R Buffers on one device, ranks 0..R-1, each a share of the SMs that lets all
// R grids be resident at once; asking for more, or for a team size out of range, throws.
TEST(EpVirtualTeam, EachRankGetsItsShareOfTheDevice) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  int device_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0));
  const BufferConfig config{.max_tokens = 64, .hidden = 128, .num_experts = 64, .top_k = 4};
  for (int R : {2, 4, 8}) {
    SCOPED_TRACE(testing::Message() << "R " << R);
    const int share = Buffer::virtual_team_num_sms(R, 0);
    EXPECT_EQ(share, device_sms / R);
    auto eps = Buffer::create_virtual_team(R, config);
    ASSERT_EQ(int(eps.size()), R);
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(eps[std::size_t(r)]->rank(), r);
      EXPECT_EQ(eps[std::size_t(r)]->num_ranks(), R);
      EXPECT_EQ(eps[std::size_t(r)]->device(), 0);
      EXPECT_EQ(eps[std::size_t(r)]->num_blocks(), share);
      // A call may not take more than the rank's share either.
      EXPECT_THROW((void)eps[std::size_t(r)]->num_blocks(1000, share + 1), weft::Error);
    }
    const std::string what =
        error_of([&] { Buffer::create_virtual_team(R, config, {.num_sms = share + 1}); });
    EXPECT_TRUE(contains(what, "share of the device's SMs")) << what;
    EXPECT_EQ(Buffer::create_virtual_team(R, config, {.num_sms = 1}).front()->num_blocks(), 1);
  }
  EXPECT_THROW(Buffer::create_virtual_team(0, config), weft::Error);
  EXPECT_THROW(Buffer::create_virtual_team(33, config), weft::Error);
  // The config is validated against R (64 experts are not a multiple of 5 ranks).
  EXPECT_THROW(Buffer::create_virtual_team(5, config), weft::Error);
}

// The combine send split follows R: the 2-rank value scaled by 2 (R - 1) / R (buffer.hpp).
TEST(EpVirtualTeam, CombineSendWarpsFollowTheRemoteShareOfRows) {
  EXPECT_EQ(weft::ep::combine_send_warps(4, 1), 4);
  EXPECT_EQ(weft::ep::combine_send_warps(4, 2), 4);
  EXPECT_EQ(weft::ep::combine_send_warps(4, 4), 6);
  EXPECT_EQ(weft::ep::combine_send_warps(4, 8), 7);
  EXPECT_EQ(weft::ep::combine_send_warps(1, 8), 2);
  EXPECT_EQ(weft::ep::combine_send_warps(31, 8), 31);  // at most 31: one warp reduces
}

// The rotated store-back: rank r's first claimed batch holds the rows of the first rank after r
// (cyclically) that it received rows from, so at the start of a call the ranks store to
// different peers. At 8 ranks with every rank receiving from every peer that is r + 1 mod 8 on
// every rank, which a store-back that started at rank 0 everywhere fails on 7 of the 8 ranks.
TEST_F(EpTest, StoreBackStartsAtTheNextRank) {
  REQUIRE_GPUS();
  make({.max_tokens = 512, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  for (int64_t T : {16, 512}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T)};
    if (T == 16) spec.tokens[0] = 0;  // a rank with no tokens: nobody receives from it
    const auto inputs = make_inputs(config, R, spec, rng);
    round(inputs, true, 0, false, true);
    const auto layouts = ref::dispatch(config, inputs);
    for (int r = 0; r < R; ++r) {
      const auto& src = layouts[std::size_t(r)].recv_src_rank;
      int want = -1;
      for (int k = 1; k < R && want < 0; ++k) {
        const int s = (r + k) % R;
        if (std::find(src.begin(), src.end(), s) != src.end()) want = s;
      }
      EXPECT_EQ(eps[std::size_t(r)]->first_store_peer(), want) << "rank " << r;
    }
  }
}

// Elements (32-bit words) where got and want differ, added to *wrong; the first round with a
// difference into *first_wrong (atomicMin).
__global__ void count_wrong_words(const uint32_t* got, const uint32_t* want, int64_t num_words,
                                  unsigned long long* wrong, int* first_wrong, int round) {
  unsigned long long n = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_words;
       i += int64_t(gridDim.x) * blockDim.x) {
    n += got[i] != want[i];
  }
  if (n != 0) {
    atomicAdd(wrong, n);
    atomicMin(first_wrong, round);
  }
}

__global__ void count_wrong_count(const int32_t* got, int32_t want, unsigned long long* wrong,
                                  int* first_wrong, int round) {
  if (*got != want) {
    atomicAdd(wrong, 1ull);
    atomicMin(first_wrong, round);
  }
}

// A thousand rounds of dispatch + combine launched back to back (no host wait), over routings
// that change every round (different T per rank, a rank with no tokens, one with a single token,
// every token to one rank, a rank that receives nothing, heavy masking). After every call the
// rank's stream checks on the device, against the CPU reference: the count, every received row,
// every row's source, and (out poisoned before each combine) every combined token. Nothing is
// read back until the end; then every counter must be zero.
TEST_F(EpTest, AThousandBackToBackRoundsWithoutAWrongRow) {
  REQUIRE_GPUS();
  make({.max_tokens = 256, .hidden = 512, .num_experts = 8 * team_size(), .top_k = 6});
  std::mt19937 rng(std::random_device{}());
  const int64_t H = config.hidden;
  const int K = config.top_k;
  std::vector<RoutingSpec> specs;
  for (int i = 0; i < 6; ++i) {
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 256 - 41 * i),
                     .mask_ratio = 0.15 * i};
    for (int r = 0; r < R; ++r) spec.tokens[std::size_t(r)] -= (r * 13 + i) % 29;
    if (i == 1) spec.tokens[std::size_t(R - 1)] = 0;
    if (i == 2) spec.tokens[0] = 1;
    if (i == 3) spec.only_rank = R / 2;
    if (i == 4) spec.avoid_rank = R - 1;
    specs.push_back(spec);
  }
  struct Expected {
    DeviceArray x, idx, w, recv_x, recv_src, out;
    int32_t num_recv = 0;
    int64_t num_tokens = 0;
  };
  std::vector<std::vector<Expected>> expected(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto inputs = make_inputs(config, R, specs[i], rng);
    const auto layouts = ref::dispatch(config, inputs);
    std::vector<std::vector<uint16_t>> expert_out;
    for (const auto& L : layouts) expert_out.push_back(L.recv_x);
    for (int r = 0; r < R; ++r) {
      const auto& in = inputs[std::size_t(r)];
      const auto& L = layouts[std::size_t(r)];
      Expected& e = expected[i].emplace_back();
      e.x = upload(rank_device(r), in.x);
      e.idx = upload(rank_device(r), in.topk_idx);
      e.w = upload(rank_device(r), in.topk_weights);
      e.recv_x = upload(rank_device(r), L.recv_x);
      std::vector<int32_t> src;
      for (int64_t j = 0; j < L.num_recv; ++j) {
        src.push_back(L.recv_src_rank[std::size_t(j)]);
        src.push_back(L.recv_src_token[std::size_t(j)]);
      }
      e.recv_src = upload(rank_device(r), src);
      e.out = upload(rank_device(r), ref::combine(config, r, layouts, expert_out, {}, {}));
      e.num_recv = int32_t(L.num_recv);
      e.num_tokens = in.num_tokens;
    }
  }
  // Per rank: [0] count, [1] rows, [2] sources, [3] combined tokens; and the first wrong round.
  constexpr int kChecks = 4;
  constexpr int kRounds = 1000;
  std::vector<DeviceArray> wrong, first_wrong, out;
  for (int r = 0; r < R; ++r) {
    wrong.push_back(upload(rank_device(r), std::vector<unsigned long long>(kChecks, 0)));
    first_wrong.push_back(upload(rank_device(r), std::vector<int>(1, kRounds)));
    out.emplace_back(rank_device(r), std::size_t(config.max_tokens * H * 2));
  }
  auto counter = [&](int r, int check) {
    return static_cast<unsigned long long*>(wrong[std::size_t(r)].ptr) + check;
  };
  auto check_words = [&](int r, const void* got, const DeviceArray& want, int64_t bytes,
                         int check, int it) {
    if (bytes == 0) return;
    count_wrong_words<<<8, 256, 0, ranks[std::size_t(r)].stream>>>(
        static_cast<const uint32_t*>(got), static_cast<const uint32_t*>(want.ptr), bytes / 4,
        counter(r, check), static_cast<int*>(first_wrong[std::size_t(r)].ptr), it);
    WEFT_CUDA_CHECK_LAUNCH();
  };
  // The checker itself: rank 0's poisoned out against a routing's tokens is all wrong.
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Expected& e = expected[i][0];
    if (e.num_tokens == 0) continue;
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(0)));
    WEFT_CUDA_CHECK(cudaMemset(out[0].ptr, 0xFF, std::size_t(e.num_tokens * H * 2)));
    check_words(0, out[0].ptr, e.out, e.num_tokens * H * 2, 3, -1);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[0].stream));
    ASSERT_EQ(download<unsigned long long>(rank_device(0), counter(0, 3), 1)[0],
              uint64_t(e.num_tokens * H / 2))
        << "the checker misses differences";
    wrong[0] = upload(rank_device(0), std::vector<unsigned long long>(kChecks, 0));
    first_wrong[0] = upload(rank_device(0), std::vector<int>(1, kRounds));
    break;
  }
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  for (int it = 0; it < kRounds; ++it) {
    const std::size_t i = std::size_t(it) % specs.size();
    // Every rank's call of one kind before any rank's next (each rank's kernel waits for its
    // peers'; ranks' streams may share a hardware queue).
    for (int r = 0; r < R; ++r) {
      const Expected& e = expected[i][std::size_t(r)];
      const int64_t T = e.num_tokens;
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
          {.x = {e.x.ptr, DType::kBFloat16, T, H},
           .topk_idx = {e.idx.ptr, DType::kInt64, T, K},
           .topk_weights = {e.w.ptr, DType::kFloat32, T, K}},
          ranks[std::size_t(r)].stream);
    }
    for (int r = 0; r < R; ++r) {
      const Expected& e = expected[i][std::size_t(r)];
      const auto& rr = res[std::size_t(r)];
      cudaStream_t stream = ranks[std::size_t(r)].stream;
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      count_wrong_count<<<1, 1, 0, stream>>>(rr.num_recv_device, e.num_recv, counter(r, 0),
                                             static_cast<int*>(first_wrong[std::size_t(r)].ptr),
                                             it);
      WEFT_CUDA_CHECK_LAUNCH();
      check_words(r, rr.recv_x, e.recv_x, int64_t(e.num_recv) * H * 2, 1, it);
      check_words(r, rr.recv_src, e.recv_src, int64_t(e.num_recv) * 8, 2, it);
      WEFT_CUDA_CHECK(cudaMemsetAsync(out[std::size_t(r)].ptr, 0xFF,
                                      std::size_t(e.num_tokens * H * 2), stream));
      eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                   rr.handle, out[std::size_t(r)].ptr, stream);
    }
    for (int r = 0; r < R; ++r) {
      const Expected& e = expected[i][std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      check_words(r, out[std::size_t(r)].ptr, e.out, e.num_tokens * H * 2, 3, it);
    }
  }
  sync_all();
  const char* what[kChecks] = {"num_recv", "received rows", "row sources", "combined tokens"};
  for (int r = 0; r < R; ++r) {
    eps[std::size_t(r)]->check();
    const auto counts = download<unsigned long long>(rank_device(r), wrong[std::size_t(r)].ptr,
                                                     kChecks);
    const int first = download<int>(rank_device(r), first_wrong[std::size_t(r)].ptr, 1)[0];
    for (int c = 0; c < kChecks; ++c) {
      EXPECT_EQ(counts[std::size_t(c)], 0u)
          << "rank " << r << ": " << what[c] << " wrong (first in round " << first << ")";
    }
  }
}

}  // namespace
