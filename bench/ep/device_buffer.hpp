// Owning device memory for the EP benchmarks (their own: they do not depend on tests/).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "weft/cuda/check.hpp"

namespace weft::ep::bench {

// An allocation on the device current at construction, freed on that device when its owner goes
// (the device current before is restored), so no benchmark frees a rank's buffer by hand.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) {
    WEFT_CUDA_CHECK(cudaGetDevice(&device_));
    WEFT_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), device_(o.device_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ == nullptr) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaFree(ptr_);
    cudaSetDevice(previous);
  }

  void* get() const noexcept { return ptr_; }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  int device_ = 0;
};

// A new allocation on the current device holding a copy of `bytes` bytes of host memory.
inline DeviceBuffer upload(const void* data, std::size_t bytes) {
  DeviceBuffer buffer(bytes);
  WEFT_CUDA_CHECK(cudaMemcpy(buffer.get(), data, bytes, cudaMemcpyHostToDevice));
  return buffer;
}

}  // namespace weft::ep::bench
