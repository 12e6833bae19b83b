// CUDA and NCCL error kinds and the macros that check every CUDA/NCCL call.
//
//   WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, num_bytes, cudaMemcpyDefault, stream));
//   my_kernel<<<grid, block, 0, stream>>>(params);
//   WEFT_CUDA_CHECK_LAUNCH();
//   WEFT_NCCL_CHECK(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm, stream));
//
// Each macro evaluates its argument exactly once. A failing CUDA call also clears CUDA's
// non-sticky last error, so the next check does not report the same failure again.
#pragma once

#include <cuda_runtime_api.h>
#include "weft/cuda/nccl_include.hpp"

#include <source_location>
#include <string>

#include "weft/core/error.hpp"

namespace weft {

class CudaError : public Error {
 public:
  CudaError(cudaError_t code, const std::string& message,
            std::source_location where = std::source_location::current())
      : Error(message, where), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

class NcclError : public Error {
 public:
  NcclError(ncclResult_t code, const std::string& message,
            std::source_location where = std::source_location::current())
      : Error(message, where), code_(code) {}
  ncclResult_t code() const noexcept { return code_; }

 private:
  ncclResult_t code_;
};

namespace detail {
[[noreturn]] void throw_cuda_error(cudaError_t code, const char* expression,
                                   std::source_location where);
[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* expression,
                                   std::source_location where);
}  // namespace detail
}  // namespace weft

#define WEFT_CUDA_CHECK(expression)                                                  \
  do {                                                                               \
    const cudaError_t weft_cuda_status_ = (expression);                              \
    if (weft_cuda_status_ != cudaSuccess) [[unlikely]] {                             \
      ::weft::detail::throw_cuda_error(weft_cuda_status_, #expression,               \
                                       std::source_location::current());             \
    }                                                                                \
  } while (0)

// After a kernel launch: reports a bad launch configuration (not errors inside the kernel).
#define WEFT_CUDA_CHECK_LAUNCH() WEFT_CUDA_CHECK(cudaGetLastError())

#define WEFT_NCCL_CHECK(expression)                                                  \
  do {                                                                               \
    const ncclResult_t weft_nccl_status_ = (expression);                             \
    if (weft_nccl_status_ != ncclSuccess) [[unlikely]] {                             \
      ::weft::detail::throw_nccl_error(weft_nccl_status_, #expression,               \
                                       std::source_location::current());             \
    }                                                                                \
  } while (0)
