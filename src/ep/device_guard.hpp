// DeviceGuard (internal to weft::ep): makes a device current for a scope and restores the
// previous one, so that a call on one Buffer leaves the caller's current device as it was.
#pragma once

#include <cuda_runtime_api.h>

#include "weft/cuda/check.hpp"

namespace weft::ep::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    WEFT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) WEFT_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace weft::ep::detail
