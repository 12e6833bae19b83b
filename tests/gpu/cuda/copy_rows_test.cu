#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/copy_rows.hpp"
#include "weft/cuda/nccl.hpp"

namespace {

using weft::cuda::CopyRowsParams;
using weft::cuda::RowCopy;

struct Case {
  int64_t dst_offset, dst_pitch, src_offset, src_pitch, width, rows;
};

// Every case lands in one poisoned destination arena; every byte of it is then compared with a
// host model: the copied rows hold the source's bytes, everything else keeps the poison.
void run_cases(const std::vector<Case>& cases, std::mt19937& rng) {
  int64_t src_bytes = 0, dst_bytes = 0;
  std::vector<int64_t> src_base, dst_base;
  for (const Case& c : cases) {
    src_base.push_back(src_bytes);
    dst_base.push_back(dst_bytes);
    src_bytes += c.src_offset + c.src_pitch * c.rows + 16;
    dst_bytes += c.dst_offset + c.dst_pitch * c.rows + 16;
  }
  std::vector<uint8_t> src(static_cast<std::size_t>(src_bytes));
  std::vector<uint8_t> want(static_cast<std::size_t>(dst_bytes), 0xA5);
  for (auto& b : src) b = uint8_t(rng());
  uint8_t *d_src = nullptr, *d_dst = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&d_src, std::size_t(src_bytes)));
  WEFT_CUDA_CHECK(cudaMalloc(&d_dst, std::size_t(dst_bytes)));
  WEFT_CUDA_CHECK(cudaMemcpy(d_src, src.data(), src.size(), cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemset(d_dst, 0xA5, std::size_t(dst_bytes)));
  CopyRowsParams params;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int64_t s0 = src_base[i] + c.src_offset, d0 = dst_base[i] + c.dst_offset;
    params.add({d_dst + d0, c.dst_pitch, d_src + s0, c.src_pitch, c.width, c.rows});
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t b = 0; b < c.width; ++b) {
        want[std::size_t(d0 + r * c.dst_pitch + b)] = src[std::size_t(s0 + r * c.src_pitch + b)];
      }
    }
  }
  cudaStream_t stream;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  weft::cuda::copy_rows(params, stream);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> got(static_cast<std::size_t>(dst_bytes));
  WEFT_CUDA_CHECK(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
  WEFT_CUDA_CHECK(cudaFree(d_src));
  WEFT_CUDA_CHECK(cudaFree(d_dst));
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(int(got[i]), int(want[i])) << "byte " << i;
  }
}

TEST(CopyRows, EveryAccessWidthAndPitchCopiesExactlyTheRows) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::mt19937 rng(5);
  // The dispatch copy-out's shapes (bf16 rows of 7168, fp8 scales, int2 sources, top-8 weights
  // out of a wider window row), then offsets and widths that force 8-, 4-, 2- and 1-byte access.
  run_cases({{0, 14336, 0, 14336, 14336, 300}, {0, 224, 0, 224, 224, 300}, {0, 8, 0, 8, 8, 300},
             {0, 32, 0, 128, 32, 300}, {8, 40, 16, 48, 24, 77}, {4, 12, 0, 20, 12, 99},
             {2, 6, 6, 10, 6, 55}, {1, 7, 3, 9, 5, 33}},
            rng);
  for (int trial = 0; trial < 20; ++trial) {  // random shapes, 1 to 8 copies per launch
    std::vector<Case> cases(std::size_t(1 + rng() % 8));
    for (Case& c : cases) {
      c.width = 1 + int64_t(rng() % 600);
      c.rows = 1 + int64_t(rng() % 200);
      c.dst_offset = int64_t(rng() % 17);
      c.src_offset = int64_t(rng() % 17);
      c.dst_pitch = c.width + int64_t(rng() % 3 == 0 ? 0 : rng() % 40);
      c.src_pitch = c.width + int64_t(rng() % 3 == 0 ? 0 : rng() % 40);
    }
    run_cases(cases, rng);
    if (HasFatalFailure()) return;
  }
}

TEST(CopyRows, MalformedCopiesAreErrors) {
  CopyRowsParams params;
  int dummy[4];
  EXPECT_THROW(params.add({dummy, 4, nullptr, 4, 4, 1}), weft::Error);
  EXPECT_THROW(params.add({dummy, 2, dummy, 4, 4, 1}), weft::Error);  // pitch below the width
  EXPECT_THROW(params.add({dummy, 4, dummy, 4, -1, 1}), weft::Error);
  params.add({nullptr, 0, nullptr, 0, 0, 5});  // empty: dropped
  EXPECT_EQ(params.num_copies, 0);
  for (int i = 0; i < CopyRowsParams::kMaxCopies; ++i) params.add({dummy, 4, dummy, 4, 4, 1});
  EXPECT_THROW(params.add({dummy, 4, dummy, 4, 4, 1}), weft::Error);
}

}  // namespace
