// A program that binds NCCL at run time (target property WEFT_NCCL_DLOPEN, as the Python
// extension does), on a machine without a GPU: nothing forwards before bind(); bind() takes the
// library CMake found, refuses a file that is not NCCL and then still binds; the headers this was
// compiled with are the NCCL CMake found (WEFT_TEST_NCCL_VERSION, from nccl.h by CMake).
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/cuda/nccl_dlopen.hpp"

namespace {

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

bool maps_mention(const std::string& what) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST(NcclDlopen, HeadersAreTheNcclCMakeFound) {
  EXPECT_EQ(version_string(NCCL_VERSION_CODE), WEFT_TEST_NCCL_VERSION);
}

// One test, in order: the binding is process-wide and never undone.
TEST(NcclDlopen, ForwardsOnlyOnceBound) {
  ASSERT_FALSE(maps_mention("libnccl")) << "the program must not load NCCL by itself";
  EXPECT_FALSE(weft::cuda::loaded_nccl().has_value());
  EXPECT_FALSE(weft::cuda::nccl_dlopen::is_bound());
  int version = 0;
  EXPECT_EQ(ncclGetVersion(&version), ncclInvalidUsage);
  EXPECT_NE(std::string(ncclGetLastError(nullptr)).find("no NCCL is bound"), std::string::npos);
  EXPECT_STREQ(ncclGetErrorString(ncclInvalidArgument), "invalid argument");
  try {
    WEFT_NCCL_CHECK(ncclGroupStart());
    FAIL() << "no throw";
  } catch (const weft::NcclError& e) {
    EXPECT_NE(std::string(e.what()).find("no NCCL is bound"), std::string::npos) << e.what();
  }

  const auto refused = weft::cuda::nccl_dlopen::bind("/proc/self/exe-is-no-nccl");
  EXPECT_FALSE(refused.bound);
  EXPECT_FALSE(refused.error.empty());
  EXPECT_FALSE(weft::cuda::nccl_dlopen::is_bound());

  const auto bound = weft::cuda::nccl_dlopen::bind(WEFT_TEST_NCCL_LIBRARY);
  ASSERT_TRUE(bound.bound) << bound.error;
  EXPECT_EQ(bound.version, NCCL_VERSION_CODE);
  EXPECT_TRUE(weft::cuda::nccl_dlopen::is_bound());
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_EQ(version, NCCL_VERSION_CODE);
  EXPECT_EQ(weft::cuda::nccl_runtime_version(), NCCL_VERSION_CODE);
  const auto loaded = weft::cuda::loaded_nccl();
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->path, bound.path);
  EXPECT_EQ(loaded->version, NCCL_VERSION_CODE);

  // Bound once: a later call names the same library whatever path it is given.
  EXPECT_EQ(weft::cuda::nccl_dlopen::bind("/elsewhere/libnccl.so.2").path, bound.path);
}

}  // namespace
