// Tokens over max_tokens (DispatchResult::tokens_required) on every visible GPU, one process
// driving all of them: a deduplicated dispatch in which some rank has T > max_tokens moves no row
// on any rank, completes, and reports the largest T on every rank (CountMode::kExact: a result;
// kOnDevice: also a bad-data device error); combine and cached dispatch of that layout are
// refused (on the host where it knows, else skipped on the device); the same Buffer then
// dispatches correctly, row by row against the CPU reference. At one GPU the overflowing rank is
// rank 0 itself; the 2-rank variants need a peer that did not overflow.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
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
using weft::ep::testing::contains;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::EpTest;
using weft::ep::testing::error_of;
using weft::ep::testing::make_inputs;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::upload;

class EpTokensOverflowTest : public EpTest {
 protected:
  // Every rank's dispatch of `inputs` (uploaded here), in `mode`; with kExact also every count.
  std::vector<weft::ep::DispatchResult> upload_and_dispatch(
      const std::vector<ref::RankInput>& inputs, CountMode mode) {
    put_inputs(inputs);
    return dispatch_all(inputs, mode);
  }
  // Poisons every rank's whole receive region (payload, metadata) through the views of an
  // earlier dispatch, so that a row written by the overflowed call cannot go unnoticed.
  void poison_receive(const std::vector<weft::ep::DispatchResult>& views) {
    for (int r = 0; r < R; ++r) {
      const auto& v = views[std::size_t(r)];
      const auto cap = std::size_t(v.capacity);
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<uint16_t*>(v.recv_x), 0x5A, cap * std::size_t(config.hidden) * 2));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_src), 0x5A, cap * 8));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_expert_idx), 0x5A, cap * std::size_t(config.top_k) * 4));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  // Every rank's receive region is still all poison (no row was written by any rank).
  void expect_receive_untouched(const std::vector<weft::ep::DispatchResult>& views) {
    for (int r = 0; r < R; ++r) {
      const auto& v = views[std::size_t(r)];
      const auto cap = std::size_t(v.capacity);
      const auto x = download<uint16_t>(rank_device(r), v.recv_x, cap * std::size_t(config.hidden));
      const auto src = download<int32_t>(rank_device(r), v.recv_src, cap * 2);
      std::size_t written = 0;
      for (uint16_t e : x) written += e != 0x5A5A;
      for (int32_t e : src) written += e != 0x5A5A5A5A;
      EXPECT_EQ(written, 0u) << "rank " << r << ": the overflowed dispatch wrote received rows";
    }
  }
  // The result of an overflowed dispatch at rank r: no row, the largest T everywhere.
  void expect_overflowed(int r, const weft::ep::DispatchResult& res, int64_t largest) {
    EXPECT_EQ(download<int32_t>(rank_device(r), res.num_recv_device, 1)[0], 0) << "rank " << r;
    EXPECT_EQ(download<int32_t>(rank_device(r), res.tokens_required_device, 1)[0], largest) << "rank " << r;
    EXPECT_EQ(download<int32_t>(rank_device(r), res.tokens_per_local_expert,
                                std::size_t(config.num_local_experts(R))),
              std::vector<int32_t>(std::size_t(config.num_local_experts(R)), 0));
    EXPECT_EQ(download<int32_t>(rank_device(r), res.rank_prefix_matrix, std::size_t(R) * std::size_t(R)),
              std::vector<int32_t>(std::size_t(R) * std::size_t(R), 0));
  }
  // A combine and a cached dispatch of an overflowed layout at every rank: refused on the host
  // where the host knows (kExact, or the rank's own T), else skipped on the device with a
  // bad-data error that check() throws. Afterwards every Buffer has no error pending.
  void expect_refused(const std::vector<weft::ep::DispatchResult>& res,
                      const std::vector<int64_t>& tokens, bool host_knows_all) {
    const int64_t H = config.hidden;
    std::vector<DeviceArray> outs;
    for (int r = 0; r < R; ++r) {
      const auto& rr = res[std::size_t(r)];
      auto& rd = ranks[std::size_t(r)];
      outs.emplace_back(rank_device(r), std::size_t(tokens[std::size_t(r)] * H * 2));
      WEFT_CUDA_CHECK(cudaMemset(outs.back().ptr, 0x5A, std::size_t(tokens[std::size_t(r)] * H * 2)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      weft::ep::CombineInputs cin{.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}};
      const bool host_knows = host_knows_all || tokens[std::size_t(r)] > config.max_tokens;
      if (host_knows) {
        EXPECT_TRUE(contains(error_of([&] {
                               eps[std::size_t(r)]->combine(cin, rr.handle, outs.back().ptr,
                                                            rd.stream);
                             }),
                             "moved no rows"));
        EXPECT_TRUE(contains(error_of([&] {
                               eps[std::size_t(r)]->dispatch(
                                   {.x = {rd.x.ptr, DType::kBFloat16, tokens[std::size_t(r)], H},
                                    .handle = &rr.handle},
                                   rd.stream);
                             }),
                             "moved no rows"));
      } else {  // launched, and skipped on the device: a bad-data error, out unwritten
        EXPECT_NO_THROW(eps[std::size_t(r)]->combine(cin, rr.handle, outs.back().ptr, rd.stream));
      }
    }
    wait_all();
    for (int r = 0; r < R; ++r) {
      auto& rd = ranks[std::size_t(r)];
      const bool host_knows = host_knows_all || tokens[std::size_t(r)] > config.max_tokens;
      if (!host_knows) {
        EXPECT_TRUE(contains(error_of([&] { eps[std::size_t(r)]->check(); }), "moved no rows"))
            << "rank " << r;
        // The cached dispatch of it likewise (after check(): the call would throw the combine's
        // error first if it had completed by then).
        EXPECT_NO_THROW(eps[std::size_t(r)]->dispatch(
            {.x = {rd.x.ptr, DType::kBFloat16, tokens[std::size_t(r)], H},
             .handle = &res[std::size_t(r)].handle},
            rd.stream));
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(rd.stream));
        EXPECT_TRUE(contains(error_of([&] { eps[std::size_t(r)]->check(); }), "moved no rows"))
            << "rank " << r;
      }
      EXPECT_NO_THROW(eps[std::size_t(r)]->check()) << "rank " << r;
      const auto out = download<uint16_t>(rank_device(r), outs[std::size_t(r)].ptr,
                                          std::size_t(tokens[std::size_t(r)] * H));
      EXPECT_EQ(out, std::vector<uint16_t>(out.size(), 0x5A5A)) << "rank " << r << ": out written";
    }
  }
};

// kExact: the overflow is a result on every rank (num_recv 0, tokens_required the largest T), no
// received row is written anywhere, combine and cached dispatch of it throw on the host, and
// the same Buffers then dispatch and combine correctly; repeated, in local and grid count mode.
TEST_F(EpTokensOverflowTest, ExactModeReportsTokensRequiredAndTheBufferStaysUsable) {
  REQUIRE_GPUS();
  std::mt19937 rng(41);
  // max_tokens 64: local count mode; 512 with T = 3000: grid count mode (T > 1024).
  for (const auto& [max_tokens, over_T] : {std::pair<int64_t, int64_t>{64, 100}, {512, 3000}}) {
    make({.max_tokens = max_tokens, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 4});
    const RoutingSpec normal{.tokens = std::vector<int64_t>(std::size_t(R), max_tokens),
                             .mask_ratio = 0.1};
    round(make_inputs(config, R, normal, rng), false, 1, true, true);  // the window's views
    const auto views = poison_ptr_;
    for (int rep = 0; rep < 3; ++rep) {
      const int over = rep % R;  // at 2+ ranks, another rank overflows each time
      std::vector<int64_t> tokens(std::size_t(R), max_tokens / 2);
      tokens[std::size_t(over)] = over_T + rep;
      poison_receive(views);
      const auto res = upload_and_dispatch(make_inputs(config, R, {.tokens = tokens}, rng),
                                    CountMode::kExact);
      for (int r = 0; r < R; ++r) {
        const auto& rr = res[std::size_t(r)];
        EXPECT_EQ(rr.num_recv, 0) << "rank " << r;
        EXPECT_EQ(rr.tokens_required, over_T + rep) << "rank " << r;
        EXPECT_EQ(rr.handle.tokens_required, over_T + rep);
        expect_overflowed(r, rr, over_T + rep);
      }
      expect_receive_untouched(views);
      expect_refused(res, tokens, /*host_knows_all=*/true);
      // The next dispatch on the same Buffers is a normal one, checked row by row.
      round(make_inputs(config, R, normal, rng), rep % 2 == 1, rep % 3, true, rep % 2 == 0);
    }
  }
}

// A dispatch without overflow reports tokens_required 0.
TEST_F(EpTokensOverflowTest, NoOverflowReportsZero) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 4 * team_size(), .top_k = 2});
  std::mt19937 rng(3);
  const auto res = upload_and_dispatch(
      make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), 64)}, rng),
      CountMode::kExact);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(res[std::size_t(r)].tokens_required, 0);
    EXPECT_EQ(download<int32_t>(rank_device(r), res[std::size_t(r)].tokens_required_device, 1)[0], 0);
  }
  wait_all();
}

// kOnDevice: every rank records the overflow as a bad-data error (thrown by check() after the
// sync), which leaves the Buffer usable; a combine of the layout at a rank whose host does not
// know is skipped on the device with its own error, and the ranks stay in step.
TEST_F(EpTokensOverflowTest, OnDeviceModeRecordsABadDataErrorAndTheBufferStaysUsable) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 4});
  std::mt19937 rng(42);
  const RoutingSpec normal{.tokens = std::vector<int64_t>(std::size_t(R), 64), .mask_ratio = 0.1};
  round(make_inputs(config, R, normal, rng), false, 0, true, false);
  const auto views = poison_ptr_;
  for (int rep = 0; rep < 4; ++rep) {
    const int over = (R - 1 + rep) % R;
    std::vector<int64_t> tokens(std::size_t(R), 10 + rep);
    tokens[std::size_t(over)] = 65 + rep;
    poison_receive(views);
    const auto res = upload_and_dispatch(make_inputs(config, R, {.tokens = tokens}, rng),
                                  CountMode::kOnDevice);
    wait_all();
    for (int r = 0; r < R; ++r) {
      const std::string what = error_of([&] { eps[std::size_t(r)]->check(); });
      EXPECT_TRUE(contains(what, "rank " + std::to_string(over) + " dispatched " +
                                     std::to_string(65 + rep) + " tokens, above max_tokens 64"))
          << what;
      EXPECT_NO_THROW(eps[std::size_t(r)]->check());  // reported once
      expect_overflowed(r, res[std::size_t(r)], 65 + rep);
    }
    expect_receive_untouched(views);
    expect_refused(res, tokens, /*host_knows_all=*/false);
    round(make_inputs(config, R, normal, rng), false, 1, true, rep % 2 == 0);
  }
}

// Two ranks, one over: the rank that did not overflow learns it from the count exchange alone
// (its own T is fine), and its combine of the layout is skipped on the device while the other
// rank's is refused on its host; the call numbers stay in step (the next round is correct).
TEST_F(EpTokensOverflowTest, APeerOverMaxTokensIsSeenByEveryRank) {
  REQUIRE_PEERS();
  make({.max_tokens = 128, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 4});
  std::mt19937 rng(43);
  const RoutingSpec normal{.tokens = std::vector<int64_t>(std::size_t(R), 128), .mask_ratio = 0.2};
  round(make_inputs(config, R, normal, rng), false, 0, true, true);
  const auto views = poison_ptr_;
  for (int over = 0; over < R; ++over) {
    std::vector<int64_t> tokens(std::size_t(R), 128);
    tokens[std::size_t(over)] = 129;
    poison_receive(views);
    auto res = upload_and_dispatch(make_inputs(config, R, {.tokens = tokens}, rng), CountMode::kOnDevice);
    wait_all();
    for (int r = 0; r < R; ++r) {
      error_of([&] { eps[std::size_t(r)]->check(); });
      expect_overflowed(r, res[std::size_t(r)], 129);
    }
    expect_receive_untouched(views);
    expect_refused(res, tokens, /*host_knows_all=*/false);
    round(make_inputs(config, R, normal, rng), true, 2, true, false);
  }
}

}  // namespace
