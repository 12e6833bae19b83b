#include "weft/cuda/check.hpp"

namespace weft::detail {

void throw_cuda_error(cudaError_t code, const char* expression, std::source_location where) {
  (void)cudaGetLastError();  // clear the non-sticky error so the next check starts clean
  throw CudaError(code,
                  concat(expression, " failed: ", cudaGetErrorName(code), ": ",
                         cudaGetErrorString(code)),
                  where);
}

void throw_nccl_error(ncclResult_t code, const char* expression, std::source_location where) {
  const char* last = ncclGetLastError(nullptr);
  throw NcclError(code,
                  concat(expression, " failed: ", ncclGetErrorString(code),
                         (last && *last) ? concat(" (", last, ")") : std::string()),
                  where);
}

}  // namespace weft::detail
