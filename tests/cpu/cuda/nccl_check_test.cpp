// Runs on every machine that builds weft::cuda, GPU or not: the NCCL error path and device count.
#include <gtest/gtest.h>

#include <string>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"

namespace {

TEST(NcclCheck, ThrowsNcclErrorWithExpression) {
  int calls = 0;
  auto failing = [&] {
    ++calls;
    return ncclInvalidArgument;
  };
  try {
    WEFT_NCCL_CHECK(failing());
    FAIL() << "no throw";
  } catch (const weft::NcclError& e) {
    EXPECT_EQ(e.code(), ncclInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("failing()"), std::string::npos) << e.what();
  }
  EXPECT_EQ(calls, 1);
}

TEST(NcclCheck, CompiledVersionIsAtLeast228) {
  EXPECT_GE(weft::cuda::nccl_compiled_version(), 22800);
}

TEST(CudaDevices, CountNeverThrows) { EXPECT_GE(weft::cuda::device_count(), 0); }

}  // namespace
