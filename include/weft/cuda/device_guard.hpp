// weft::cuda::DeviceGuard: makes a device current for a scope and restores the previous one, so
// that a call that works on one device leaves the caller's current device as it was.
//
//   { weft::cuda::DeviceGuard guard(buffer_device); launch(...); }   // previous device again
#pragma once

#include <cuda_runtime_api.h>

#include "weft/cuda/check.hpp"

namespace weft::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    WEFT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) WEFT_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  // Restoring cannot throw from a destructor; it fails only if the previous device vanished.
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace weft::cuda
