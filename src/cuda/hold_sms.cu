#include "weft/cuda/hold_sms.hpp"

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"

namespace weft::cuda {
namespace {

constexpr int kThreads = 32;
constexpr unsigned kSleepNs = 200;  // between timer reads: short against any hold worth asking

__device__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The block's shared memory (dynamic, the SM's opt-in maximum) is what holds the SM; the other
// threads of the warp exit at once, the block stays resident until thread 0 returns.
__global__ void hold_sms_kernel(uint64_t duration_ns) {
  extern __shared__ unsigned char held[];
  if (threadIdx.x != 0) return;
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < duration_ns) __nanosleep(kSleepNs);
  held[0] = 0;
}

}  // namespace

void hold_sms(const HoldSmsParams& params, cudaStream_t stream) {
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  int num_device_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_device_sms, cudaDevAttrMultiProcessorCount, device));
  WEFT_CHECK(params.num_sms >= 1 && params.num_sms <= num_device_sms, "hold_sms: num_sms ",
             params.num_sms, " is not in [1, ", num_device_sms, "] (the device's SMs)");
  if (params.duration_ns == 0) return;
  int shared_bytes = 0;
  WEFT_CUDA_CHECK(
      cudaDeviceGetAttribute(&shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  WEFT_CUDA_CHECK(cudaFuncSetAttribute(hold_sms_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  hold_sms_kernel<<<params.num_sms, kThreads, size_t(shared_bytes), stream>>>(params.duration_ns);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::cuda
