// weft::ep::all_to_all_layout against a CPU reference written from its contract: random
// selections (negative ones and ids of no rank among them), int32 and int64, 1 to 64 ranks,
// token counts around the block's size; every element of every output checked, in arrays
// poisoned before each call; and the parameters it refuses.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/all_to_all_layout.hpp"
#include "device_array.hpp"

namespace {

using weft::ep::AllToAllLayoutParams;
using weft::ep::DType;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::upload;

struct Layout {
  std::vector<int64_t> sizes, order;
  std::vector<uint8_t> mine;
  std::vector<int64_t> send_idx;
};

// The contract, pair by pair: destination-major, selected pairs first, each group in order.
Layout reference(const std::vector<int64_t>& idx, int64_t T, int k, int R, int64_t epr) {
  Layout out;
  out.sizes.assign(size_t(R) * 3, 0);
  int64_t no_rank = 0;
  for (int64_t e : idx) {
    if (e < 0) continue;
    if (e / epr < R) {
      ++out.sizes[size_t(e / epr) * 3 + 1];
    } else {
      ++no_rank;
    }
  }
  auto selects = [&](int r, int64_t t) {
    for (int j = 0; j < k; ++j) {
      const int64_t e = idx[size_t(t * k + j)];
      if (e >= 0 && e / epr == r) return true;
    }
    return false;
  };
  for (int pass = 0; pass < 2; ++pass) {
    for (int r = 0; r < R; ++r) {
      out.sizes[size_t(r) * 3 + 2] = no_rank;
      for (int64_t t = 0; t < T; ++t) {
        if (selects(r, t) != (pass == 0)) continue;
        if (pass == 0) ++out.sizes[size_t(r) * 3];
        out.order.push_back(t);
        for (int j = 0; j < k; ++j) {
          const int64_t e = idx[size_t(t * k + j)];
          const bool is_mine = e >= 0 && e / epr == r;
          out.mine.push_back(is_mine);
          out.send_idx.push_back(is_mine ? e % epr : -1);
        }
      }
    }
  }
  return out;
}

constexpr uint8_t kPoison = 0xa5;

struct Case {
  int64_t T;
  int k;
  int R;
  int64_t epr;
  DType dtype;
};

std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " R=" +
         std::to_string(c.R) + " epr=" + std::to_string(c.epr) + " " +
         (c.dtype == DType::kInt64 ? "int64" : "int32");
}

void check_case(const Case& c, std::mt19937_64& rng) {
  SCOPED_TRACE(describe(c));
  const int64_t E = c.R * c.epr;
  // Mostly experts of a rank; some -1 (dropped), some other negatives, some of no rank.
  std::uniform_int_distribution<int64_t> expert(0, E - 1);
  std::uniform_int_distribution<int> kind(0, 19);
  std::vector<int64_t> idx(size_t(c.T * c.k));
  for (int64_t& e : idx) {
    const int what = kind(rng);
    e = what == 0 ? -1 : what == 1 ? -7 : what == 2 ? E + expert(rng) : expert(rng);
  }
  const Layout want = reference(idx, c.T, c.k, c.R, c.epr);

  const int dev = 0;
  const size_t pairs = size_t(c.R * c.T);
  const size_t idx_bytes = c.dtype == DType::kInt64 ? 8 : 4;
  DeviceArray d_idx = c.dtype == DType::kInt64
                          ? upload(dev, idx)
                          : upload(dev, std::vector<int32_t>(idx.begin(), idx.end()));
  auto poisoned = [&](size_t bytes) {
    DeviceArray a(dev, bytes);
    WEFT_CUDA_CHECK(cudaMemset(a.ptr, kPoison, bytes));
    return a;
  };
  DeviceArray d_sizes = poisoned(size_t(c.R) * 3 * 8), d_order = poisoned(pairs * 8),
              d_mine = poisoned(pairs * c.k), d_send = poisoned(pairs * c.k * idx_bytes);
  AllToAllLayoutParams p;
  p.topk_idx = d_idx.ptr;
  p.idx_dtype = c.dtype;
  p.num_tokens = c.T;
  p.top_k = c.k;
  p.num_ranks = c.R;
  p.num_local_experts = c.epr;
  p.sizes = static_cast<int64_t*>(d_sizes.ptr);
  p.order = static_cast<int64_t*>(d_order.ptr);
  p.mine = static_cast<uint8_t*>(d_mine.ptr);
  p.send_idx = d_send.ptr;
  weft::ep::all_to_all_layout(p, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());

  EXPECT_EQ(download<int64_t>(dev, d_sizes.ptr, size_t(c.R) * 3), want.sizes);
  EXPECT_EQ(download<int64_t>(dev, d_order.ptr, pairs), want.order);
  EXPECT_EQ(download<uint8_t>(dev, d_mine.ptr, pairs * c.k), want.mine);
  if (c.dtype == DType::kInt64) {
    EXPECT_EQ(download<int64_t>(dev, d_send.ptr, pairs * c.k), want.send_idx);
  } else {
    EXPECT_EQ(download<int32_t>(dev, d_send.ptr, pairs * c.k),
              std::vector<int32_t>(want.send_idx.begin(), want.send_idx.end()));
  }
}

TEST(AllToAllLayout, MatchesTheReferenceInEveryElement) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::mt19937_64 rng(20261207);
  for (DType dtype : {DType::kInt64, DType::kInt32}) {
    for (int R : {1, 2, 3, 8, 64}) {
      // Fewer tokens than threads, one and a few per thread, a ragged last thread.
      for (int64_t T : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{512}, int64_t{1024},
                        int64_t{1025}, int64_t{4099}}) {
        for (int k : {1, 8}) {
          if (R == 64 && T > 1024) continue;  // the reference's time, not the kernel's
          check_case({T, k, R, 16, dtype}, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(AllToAllLayout, ManyCallsOnOneStreamStayExact) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  // Fresh selections each round: a result that depends on a previous call or on timing moves.
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    check_case({1024, 8, 8, 4, round % 2 ? DType::kInt32 : DType::kInt64}, rng);
    if (HasFailure()) return;
  }
}

TEST(AllToAllLayout, RefusesBadParameters) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  DeviceArray buf(0, 1 << 16);
  auto valid = [&] {
    AllToAllLayoutParams p;
    p.topk_idx = buf.ptr;
    p.num_tokens = 4;
    p.top_k = 2;
    p.num_ranks = 2;
    p.num_local_experts = 4;
    p.sizes = static_cast<int64_t*>(buf.ptr);
    p.order = static_cast<int64_t*>(buf.ptr);
    p.mine = static_cast<uint8_t*>(buf.ptr);
    p.send_idx = buf.ptr;
    return p;
  };
  auto refused = [&](AllToAllLayoutParams p, const std::string& needle) {
    try {
      weft::ep::all_to_all_layout(p, nullptr);
      ADD_FAILURE() << "accepted; expected an error with '" << needle << "'";
    } catch (const weft::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // One bad field each; the rest valid.
  const std::vector<std::pair<std::function<void(AllToAllLayoutParams&)>, std::string>> cases = {
      {[](auto& p) { p.idx_dtype = DType::kFloat32; }, "int32 or int64"},
      {[](auto& p) { p.num_ranks = 65; }, "num_ranks must be in [1, 64]"},
      {[](auto& p) { p.num_ranks = 0; }, "num_ranks must be in [1, 64]"},
      {[](auto& p) { p.num_tokens = -1; }, "num_tokens must be >= 0"},
      {[](auto& p) { p.top_k = 0; }, "top_k must be >= 1"},
      {[](auto& p) { p.num_local_experts = 0; }, "num_local_experts must be >= 1"},
      {[](auto& p) { p.num_tokens = int64_t{1} << 62; }, "overflows int64"},  // x 2 x 2 = 2^64
      {[](auto& p) { p.sizes = nullptr; }, "sizes is null"},
      {[](auto& p) { p.order = nullptr; }, "a null array"},
  };
  for (const auto& [mutate, needle] : cases) {
    SCOPED_TRACE(needle);
    AllToAllLayoutParams p = valid();
    mutate(p);
    refused(p, needle);
  }
}

}  // namespace
