// Device buffers for weft::ep's GPU tests: an owning allocation on one device, and checked
// copies to and from host vectors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "weft/cuda/check.hpp"

namespace weft::ep::testing {

struct DeviceArray {
  void* ptr = nullptr;
  int device = 0;
  DeviceArray() = default;
  DeviceArray(int dev, std::size_t bytes) : device(dev) {
    WEFT_CUDA_CHECK(cudaSetDevice(dev));
    WEFT_CUDA_CHECK(cudaMalloc(&ptr, bytes > 0 ? bytes : 16));
  }
  DeviceArray(DeviceArray&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), device(o.device) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(device, o.device);
    return *this;
  }
  ~DeviceArray() {
    if (ptr != nullptr) {
      cudaSetDevice(device);
      cudaFree(ptr);
    }
  }
};

template <typename T>
DeviceArray upload(int dev, const std::vector<T>& v) {
  DeviceArray a(dev, v.size() * sizeof(T));
  if (!v.empty()) {
    WEFT_CUDA_CHECK(cudaMemcpy(a.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return a;
}

template <typename T>
std::vector<T> download(int dev, const void* p, std::size_t n) {
  std::vector<T> v(n);
  WEFT_CUDA_CHECK(cudaSetDevice(dev));
  if (n > 0) WEFT_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace weft::ep::testing
