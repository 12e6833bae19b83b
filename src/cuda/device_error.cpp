#include "weft/cuda/device_error.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>

#include "weft/cuda/check.hpp"

namespace weft::cuda {

DeviceErrorFlag::DeviceErrorFlag() {
  void* host = nullptr;
  WEFT_CUDA_CHECK(cudaHostAlloc(&host, sizeof(DeviceErrorRecord), cudaHostAllocMapped));
  host_ = static_cast<DeviceErrorRecord*>(host);
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  void* device = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&device, host, 0);
  if (status != cudaSuccess) {
    cudaFreeHost(host);
    WEFT_CUDA_CHECK(status);
  }
  device_ = static_cast<DeviceErrorRecord*>(device);
}

DeviceErrorFlag::~DeviceErrorFlag() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

bool DeviceErrorFlag::raised() const noexcept {
  return std::atomic_ref<uint32_t>(host_->code).load(std::memory_order_acquire) != 0;
}

DeviceErrorRecord DeviceErrorFlag::read() const noexcept {
  DeviceErrorRecord copy{};
  copy.code = std::atomic_ref<uint32_t>(host_->code).load(std::memory_order_acquire);
  copy.claimed = host_->claimed;
  copy.rank = host_->rank;
  for (int i = 0; i < 3; ++i) copy.args[i] = host_->args[i];
  return copy;
}

void DeviceErrorFlag::clear() noexcept {
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void DeviceErrorFlag::throw_if_raised(
    const std::function<std::string(const DeviceErrorRecord&)>& describe,
    std::source_location where) {
  if (!raised()) return;
  const DeviceErrorRecord record = read();
  clear();
  throw Error(describe(record), where);
}

}  // namespace weft::cuda
