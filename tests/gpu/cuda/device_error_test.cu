#include <gtest/gtest.h>

#include <string>

#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.cuh"
#include "weft/cuda/nccl.hpp"

namespace {

using weft::cuda::DeviceErrorFlag;
using weft::cuda::DeviceErrorRecord;

// Every thread whose index is in `bad` raises; only the first raise may land.
__global__ void raise_kernel(DeviceErrorRecord* record, int num_bad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_bad) weft::cuda::raise_device_error(record, 7, 3, i, 100 + i, 200 + i);
}

// Waits for a flag nobody sets; must give up after timeout_ns and report it.
__global__ void wait_forever_kernel(DeviceErrorRecord* record, const volatile int* flag,
                                    uint64_t timeout_ns) {
  const bool arrived = weft::cuda::spin_wait([&] { return *flag != 0; }, timeout_ns);
  if (!arrived) weft::cuda::raise_device_error(record, 9, 0, /*waited for*/ 1234);
}

TEST(DeviceErrorFlag, FirstErrorWinsAndIsReportedOnce) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  DeviceErrorFlag flag;
  EXPECT_FALSE(flag.raised());
  raise_kernel<<<64, 256>>>(flag.device_record(), 64 * 256);
  WEFT_CUDA_CHECK_LAUNCH();
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_TRUE(flag.raised());
  const DeviceErrorRecord record = flag.read();
  EXPECT_EQ(record.code, 7u);
  EXPECT_EQ(record.rank, 3);
  // The record is one thread's, never a mix of several.
  EXPECT_EQ(record.args[1], record.args[0] + 100);
  EXPECT_EQ(record.args[2], record.args[0] + 200);
  EXPECT_THROW(flag.throw_if_raised([](const DeviceErrorRecord& r) {
    return "code " + std::to_string(r.code);
  }),
               weft::Error);
  EXPECT_FALSE(flag.raised());
  EXPECT_NO_THROW(flag.throw_if_raised([](const DeviceErrorRecord&) { return std::string(); }));
}

TEST(DeviceErrorFlag, SpinWaitTimesOutInsteadOfHanging) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  DeviceErrorFlag flag;
  int* never_set = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&never_set, sizeof(int)));
  WEFT_CUDA_CHECK(cudaMemset(never_set, 0, sizeof(int)));
  wait_forever_kernel<<<1, 1>>>(flag.device_record(), never_set, 2'000'000);  // 2 ms
  WEFT_CUDA_CHECK_LAUNCH();
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  WEFT_CUDA_CHECK(cudaFree(never_set));
  ASSERT_TRUE(flag.raised());
  EXPECT_EQ(flag.read().code, 9u);
  EXPECT_EQ(flag.read().args[0], 1234);
}

TEST(CudaCheck, ReportsExpressionAndClearsError) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  try {
    WEFT_CUDA_CHECK(cudaSetDevice(1 << 20));
    FAIL() << "no throw";
  } catch (const weft::CudaError& e) {
    EXPECT_EQ(e.code(), cudaErrorInvalidDevice);
    EXPECT_NE(std::string(e.what()).find("cudaSetDevice"), std::string::npos);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
