// weft::ep dispatch/combine on every visible GPU (one process driving all of them, and one
// process per GPU through Buffer::from_env and Buffer(ncclComm_t, ...)), checked element by
// element against the CPU reference (ep_fixture.hpp); one GPU is one rank, every row local.
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
#include "ep_fixture.hpp"
#include "payload.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::EpTest;
using weft::ep::testing::make_inputs;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;
using weft::ep::testing::RankDevice;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::upload;

TEST_F(EpTest, RandomRoutingMatchesReference) {
  REQUIRE_GPUS();
  make({.max_tokens = 2500, .hidden = 2048, .num_experts = 64, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (double mask : {0.0, 0.25}) {
    // Dispatch counts in local mode up to 1024 tokens and in grid mode above (kernels/params.hpp).
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
    if (i == 4) spec.only_rank = R - 1;
    routings.push_back(make_inputs(config, R, spec, rng));
  }
  const int64_t H = config.hidden;
  const int K = config.top_k;
  for (int i = 0; i < kRoutings; ++i) {
    dev[std::size_t(i)].resize(std::size_t(R));
    for (int r = 0; r < R; ++r) {
      auto& d = dev[std::size_t(i)][std::size_t(r)];
      const auto& in = routings[std::size_t(i)][std::size_t(r)];
      d.x = upload(rank_device(r), in.x);
      d.idx = upload(rank_device(r), in.topk_idx);
      d.weights = upload(rank_device(r), in.topk_weights);
      d.out = DeviceArray(rank_device(r), std::size_t(in.num_tokens * H * 2));
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
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
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
      const auto n = download<int32_t>(rank_device(r), res[std::size_t(r)].num_recv_device, 1)[0];
      ASSERT_EQ(n, layouts[std::size_t(r)].num_recv) << "round " << it << " rank " << r;
      const auto want = ref::combine(config, r, layouts, eo, {}, {});
      const auto got = download<uint16_t>(rank_device(r), dev[std::size_t(i)][std::size_t(r)].out.ptr, want.size());
      ASSERT_EQ(got, want) << "round " << it << " rank " << r;
    }
  }
}

// Tokens that select one expert more than once (every odd selection repeats the one before it),
// in local (T <= 1024) and grid mode: such a token goes to a rank once, both selections are
// marked in recv_expert_idx / recv_weights, and tokens_per_local_expert counts it once.
TEST_F(EpTest, RepeatedExpertsInOneTokenMatchReference) {
  REQUIRE_GPUS();
  make({.max_tokens = 2000, .hidden = 256, .num_experts = 16, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  for (int64_t T : {300, 2000}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = 0.1,
                     .duplicates = true};
    round(make_inputs(config, R, spec, rng), T == 300, 1, true, true);
  }
}

// The seed's largest call, T = 8192 per rank, in grid mode (a grid barrier, every SM).
TEST_F(EpTest, EightThousandTokensInGridMode) {
  REQUIRE_GPUS();
  make({.max_tokens = 8192, .hidden = 512, .num_experts = 64, .top_k = 8});
  std::mt19937 rng(std::random_device{}());
  RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 8192), .mask_ratio = 0.05};
  round(make_inputs(config, R, spec, rng), true, 2, true, false);
  spec.tokens[0] = 8191;
  round(make_inputs(config, R, spec, rng), false, 0, false, true);
}

// top-16 of 1024 experts: more than 8 selections per token (a count tile holds 64 tokens) and
// more than 256 experts (the per-expert histogram), local and grid mode.
TEST_F(EpTest, TopSixteenOfAThousandExperts) {
  REQUIRE_GPUS();
  make({.max_tokens = 1500, .hidden = 256, .num_experts = 1024, .top_k = 16});
  std::mt19937 rng(std::random_device{}());
  int trial = 0;
  for (int64_t T : {1, 700, 1500}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = 0.1};
    round(make_inputs(config, R, spec, rng), trial % 2 == 0, trial % 3, trial % 2 == 1, true);
    ++trial;
  }
}

// The routing extremes at any number of ranks: top-1 of 8 experts (one expert per rank at 8
// ranks), top-16 of 512, and T = 16384 per rank (grid mode, every rank's share of the SMs), each
// with a rank that has no tokens and one whose tokens all go to one rank.
TEST_F(EpTest, RoutingExtremesAtAnyNumberOfRanks) {
  REQUIRE_GPUS();
  std::mt19937 rng(std::random_device{}());
  struct Shape {
    BufferConfig config;
    int64_t T;
  };
  for (const Shape& shape :
       {Shape{{.max_tokens = 1024, .hidden = 256, .num_experts = 8, .top_k = 1}, 1024},
        Shape{{.max_tokens = 600, .hidden = 256, .num_experts = 512, .top_k = 16}, 600},
        Shape{{.max_tokens = 16384, .hidden = 128, .num_experts = 64, .top_k = 8}, 16384}}) {
    if (shape.config.num_experts % team_size() != 0) continue;  // R is set by make()
    make(shape.config);
    SCOPED_TRACE(testing::Message() << "experts " << config.num_experts << " top_k "
                                    << config.top_k << " T " << shape.T);
    const std::vector<int64_t> full(std::size_t(R), shape.T);
    std::vector<int64_t> one_empty = full;
    one_empty[std::size_t(R / 2)] = 0;
    std::vector<int64_t> one_token = full;
    one_token[std::size_t(R - 1)] = 1;
    round(make_inputs(config, R, {.tokens = one_empty, .mask_ratio = 0.1}, rng), true, 1, true,
          true);
    round(make_inputs(config, R, {.tokens = one_token, .only_rank = R - 1}, rng), false, 0, false,
          false);
    if (R > 1) {  // a rank that receives nothing while the others do
      round(make_inputs(config, R, {.tokens = full, .avoid_rank = 0}, rng), true, 2, true, true);
    }
  }
}

// BufferOptions::tokens_per_block sizes every call's grid: one block per token, an odd share,
// and 1000 tokens per block (one or two blocks, each with many sub-chunks).
TEST_F(EpTest, TokensPerBlockOtherThanFour) {
  REQUIRE_GPUS();
  std::mt19937 rng(std::random_device{}());
  for (int tokens_per_block : {1, 37, 1000}) {
    make({.max_tokens = 1500, .hidden = 256, .num_experts = 32, .top_k = 6},
         {.tokens_per_block = tokens_per_block});
    for (int64_t T : {1, 130, 1500}) {
      SCOPED_TRACE(testing::Message() << "tokens_per_block " << tokens_per_block << " T " << T);
      RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = 0.2};
      round(make_inputs(config, R, spec, rng), T != 130, 1, T == 130, T != 1);
    }
  }
}

// Rows move as whole 16-byte vectors, so a hidden size with a partial last vector is refused
// (BufferConfig::validate, at construction). Rows of 1 vector, of 9 (fewer than a warp's lanes)
// and of 33 (a partial last round of every per-row loop) match the reference.
TEST_F(EpTest, RowsOfFewOrOddNumbersOfVectors) {
  REQUIRE_GPUS();
  EXPECT_THROW(weft::ep::testing::make_team({.max_tokens = 8, .hidden = 100, .num_experts = 16,
                                             .top_k = 2}),
               weft::Error);  // 200 bytes: 12.5 vectors
  std::mt19937 rng(std::random_device{}());
  for (int64_t hidden : {8, 72, 264}) {
    make({.max_tokens = 300, .hidden = hidden, .num_experts = 16, .top_k = 4});
    SCOPED_TRACE(testing::Message() << "hidden " << hidden);
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 300), .mask_ratio = 0.1};
    round(make_inputs(config, R, spec, rng), true, 2, true, true);
    round(make_inputs(config, R, spec, rng), false, 0, false, false);
  }
}

// Calls of one kind launched back to back at T = 4096 (grid mode) with no host synchronisation
// until the end: dispatch -> dispatch, combine -> combine (two outputs of one layout), cached ->
// cached (two payloads). What the second call of a pair overwrites in the window is copied out
// on the stream in between (device to device, no host wait).
TEST_F(EpTest, BackToBackPairsWithoutHostSyncs) {
  REQUIRE_GPUS();
  make({.max_tokens = 4096, .hidden = 256, .num_experts = 32, .top_k = 6});
  std::mt19937 rng(std::random_device{}());
  const int64_t H = config.hidden;
  const int K = config.top_k;
  const auto num = std::size_t(R);
  RoutingSpec spec{.tokens = std::vector<int64_t>(num, 4096), .mask_ratio = 0.1};
  const auto a_in = make_inputs(config, R, spec, rng);
  spec.tokens[0] = 4095;
  spec.mask_ratio = 0.3;
  const auto b_in = make_inputs(config, R, spec, rng);
  auto b_x2 = b_in, b_x3 = b_in;  // the cached dispatches' payloads
  weft::ep::testing::refill_x(config, b_x2, 10);
  weft::ep::testing::refill_x(config, b_x3, 20);
  const auto a_layouts = ref::dispatch(config, a_in);
  const auto b_layouts = ref::dispatch(config, b_in);
  const auto x2_layouts = ref::dispatch(config, b_x2);
  const auto x3_layouts = ref::dispatch(config, b_x3);

  struct PerRank {
    DeviceArray a_x, a_idx, a_w, b_x, b_idx, b_w, x2, x3, e1, e2, out1, out2;
    DeviceArray a_rows, a_src, a_count, x2_rows;  // copies of what the next call overwrites
  };
  std::vector<PerRank> d(num);
  std::vector<std::vector<uint16_t>> e1(num), e2(num);
  for (int r = 0; r < R; ++r) {
    auto& p = d[std::size_t(r)];
    p.a_x = upload(rank_device(r), a_in[std::size_t(r)].x);
    p.a_idx = upload(rank_device(r), a_in[std::size_t(r)].topk_idx);
    p.a_w = upload(rank_device(r), a_in[std::size_t(r)].topk_weights);
    p.b_x = upload(rank_device(r), b_in[std::size_t(r)].x);
    p.b_idx = upload(rank_device(r), b_in[std::size_t(r)].topk_idx);
    p.b_w = upload(rank_device(r), b_in[std::size_t(r)].topk_weights);
    p.x2 = upload(rank_device(r), b_x2[std::size_t(r)].x);
    p.x3 = upload(rank_device(r), b_x3[std::size_t(r)].x);
    const int64_t n = b_layouts[std::size_t(r)].num_recv;
    for (auto* e : {&e1[std::size_t(r)], &e2[std::size_t(r)]}) {
      e->resize(std::size_t(n * H));
      for (auto& v : *e) v = weft::ep::testing::identity_value(30 + r, int64_t(rng() % 100000), 7);
    }
    p.e1 = upload(rank_device(r), e1[std::size_t(r)]);
    p.e2 = upload(rank_device(r), e2[std::size_t(r)]);
    const int64_t T = b_in[std::size_t(r)].num_tokens;
    p.out1 = DeviceArray(rank_device(r), std::size_t(T * H * 2));
    p.out2 = DeviceArray(rank_device(r), std::size_t(T * H * 2));
    WEFT_CUDA_CHECK(cudaMemset(p.out1.ptr, 0xFF, std::size_t(T * H * 2)));
    WEFT_CUDA_CHECK(cudaMemset(p.out2.ptr, 0xFF, std::size_t(T * H * 2)));
    const int64_t cap = eps[std::size_t(r)]->capacity();
    p.a_rows = DeviceArray(rank_device(r), std::size_t(cap * H * 2));
    p.a_src = DeviceArray(rank_device(r), std::size_t(cap * 8));
    p.a_count = DeviceArray(rank_device(r), 4);
    p.x2_rows = DeviceArray(rank_device(r), std::size_t(cap * H * 2));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto copy = [&](int r, void* dst, const void* src, int64_t bytes) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToDevice,
                                    ranks[std::size_t(r)].stream));
  };
  auto dispatch = [&](int r, const DeviceArray& x, const DeviceArray* idx, const DeviceArray* w,
                      const weft::ep::Handle* handle, int64_t T) {
    weft::ep::DispatchInputs in{.x = {x.ptr, DType::kBFloat16, T, H}, .handle = handle};
    if (handle == nullptr) {
      in.topk_idx = {idx->ptr, DType::kInt64, T, K};
      in.topk_weights = {w->ptr, DType::kFloat32, T, K};
    }
    return eps[std::size_t(r)]->dispatch(in, ranks[std::size_t(r)].stream);
  };
  std::vector<weft::ep::DispatchResult> a(num), b(num);
  for (int r = 0; r < R; ++r) {
    auto& p = d[std::size_t(r)];
    a[std::size_t(r)] =
        dispatch(r, p.a_x, &p.a_idx, &p.a_w, nullptr, a_in[std::size_t(r)].num_tokens);
  }
  for (int r = 0; r < R; ++r) {
    const auto& ar = a[std::size_t(r)];
    auto& p = d[std::size_t(r)];
    copy(r, p.a_rows.ptr, ar.recv_x, ar.capacity * H * 2);
    copy(r, p.a_src.ptr, ar.recv_src, ar.capacity * 8);
    copy(r, p.a_count.ptr, ar.num_recv_device, 4);
  }
  for (int r = 0; r < R; ++r) {
    auto& p = d[std::size_t(r)];
    b[std::size_t(r)] =
        dispatch(r, p.b_x, &p.b_idx, &p.b_w, nullptr, b_in[std::size_t(r)].num_tokens);
  }
  for (int i = 0; i < 2; ++i) {
    for (int r = 0; r < R; ++r) {
      auto& p = d[std::size_t(r)];
      const DeviceArray& e = i == 0 ? p.e1 : p.e2;
      eps[std::size_t(r)]->combine(
          {.expert_out = {e.ptr, DType::kBFloat16, b_layouts[std::size_t(r)].num_recv, H}},
          b[std::size_t(r)].handle, (i == 0 ? p.out1 : p.out2).ptr, ranks[std::size_t(r)].stream);
    }
  }
  for (int r = 0; r < R; ++r) {
    dispatch(r, d[std::size_t(r)].x2, nullptr, nullptr, &b[std::size_t(r)].handle,
             b_in[std::size_t(r)].num_tokens);
  }
  for (int r = 0; r < R; ++r) {
    const auto& br = b[std::size_t(r)];
    copy(r, d[std::size_t(r)].x2_rows.ptr, br.recv_x, br.capacity * H * 2);
  }
  for (int r = 0; r < R; ++r) {
    dispatch(r, d[std::size_t(r)].x3, nullptr, nullptr, &b[std::size_t(r)].handle,
             b_in[std::size_t(r)].num_tokens);
  }
  sync_all();

  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    eps[std::size_t(r)]->check();
    const auto& p = d[std::size_t(r)];
    const auto& A = a_layouts[std::size_t(r)];
    const int64_t na = download<int32_t>(rank_device(r), p.a_count.ptr, 1)[0];
    ASSERT_EQ(na, A.num_recv) << "the first dispatch";
    ASSERT_EQ(download<uint16_t>(rank_device(r), p.a_rows.ptr, std::size_t(na * H)), A.recv_x)
        << "the first dispatch";
    weft::ep::testing::check_sources(download<int32_t>(rank_device(r), p.a_src.ptr, std::size_t(na * 2)), A);
    const auto& br = b[std::size_t(r)];
    const auto& B = b_layouts[std::size_t(r)];
    const int64_t nb = download<int32_t>(rank_device(r), br.num_recv_device, 1)[0];
    ASSERT_EQ(nb, B.num_recv);
    check_metadata(r, br, B);
    ASSERT_EQ(download<uint16_t>(rank_device(r), p.x2_rows.ptr, std::size_t(nb * H)),
              x2_layouts[std::size_t(r)].recv_x) << "the first cached dispatch";
    ASSERT_EQ(download<uint16_t>(rank_device(r), br.recv_x, std::size_t(nb * H)),
              x3_layouts[std::size_t(r)].recv_x) << "the second cached dispatch";
    for (int i = 0; i < 2; ++i) {
      const auto want = ref::combine(config, r, b_layouts, i == 0 ? e1 : e2, {}, {});
      const auto got = download<uint16_t>(rank_device(r), (i == 0 ? p.out1 : p.out2).ptr, want.size());
      ASSERT_EQ(weft::ep::testing::count_differences(got, want), 0u)
          << "combine " << i + 1 << " differs from the reference";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One process per GPU. The parent test starts one copy of this binary per visible GPU (fork +
// exec of /proc/self/exe, filtered to EpOneProcessPerGpu.Child) with RANK, WORLD_SIZE,
// LOCAL_RANK and NCCL_COMM_ID=127.0.0.1:<free port>; each child builds its Buffer (from the
// environment, or over a communicator it created itself) and runs checked dispatch + combine
// rounds. Every child must exit 0 within the deadline.
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
// computed for every rank from the same seeds (every process draws the same inputs).
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
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));  // the count comes before the rows
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

// Four experts per rank, whatever the number of ranks (WORLD_SIZE).
BufferConfig one_process_config(int num_ranks) {
  return {.max_tokens = 256, .hidden = 1024, .num_experts = 4 * num_ranks, .top_k = 4};
}

TEST(EpOneProcessPerGpu, Child) {
  const char* mode = std::getenv(kChildModeVariable);
  if (mode == nullptr) GTEST_SKIP() << "runs only as a child of the other EpOneProcessPerGpu tests";
  if (std::string(mode) == "env") {
    auto ep = weft::ep::Buffer::from_env(one_process_config(std::atoi(std::getenv("WORLD_SIZE"))));
    checked_rounds_one_rank(*ep);
    return;
  }
  // "comm": this process makes its communicator (NCCL's rendezvous through NCCL_COMM_ID) and the
  // Buffer borrows it.
  WEFT_CUDA_CHECK(cudaSetDevice(std::atoi(std::getenv("LOCAL_RANK"))));
  ncclUniqueId id;
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclComm_t comm = nullptr;
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  WEFT_NCCL_CHECK(ncclCommInitRank(&comm, world, id, std::atoi(std::getenv("RANK"))));
  {
    weft::ep::Buffer ep(comm, one_process_config(world));
    checked_rounds_one_rank(ep);
  }
  WEFT_NCCL_CHECK(ncclCommDestroy(comm));
}

// Starts one child per visible GPU (one rank each) in `mode` and waits (at most 120 s) for every
// one to exit 0.
void run_one_process_per_gpu(const char* mode) {
  if (weft::ep::testing::is_virtual_team()) {
    GTEST_SKIP() << "one process per GPU: real ranks only (not on a virtual team)";
  }
  const int num_ranks = weft::cuda::device_count();
  const int port = free_tcp_port();
  ASSERT_GT(port, 0) << "no free TCP port on 127.0.0.1";
  std::vector<pid_t> pids;
  for (int rank = 0; rank < num_ranks; ++rank) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(num_ranks));
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
