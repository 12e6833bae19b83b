// weft::cuda::hold_sms: a kernel that occupies SMs for a set time and does nothing else, the
// stand-in for a communication kernel whose real peer is not there (emulated communication on
// one GPU: weft.moe's EmulatedDispatcher).
//
//   weft::cuda::HoldSmsParams p;
//   p.num_sms = 20;               // as many blocks as the communication kernel would run
//   p.duration_ns = 343'000;      // what one call takes on the target machine
//   weft::cuda::hold_sms(p, stream);
//
// Contracts: one block per SM: each block asks for the SM's whole opt-in shared memory, so no
// other block that uses shared memory (a GEMM's) shares an SM with it while it runs, and the
// num_sms blocks sit on num_sms distinct SMs. Each block spins on the global timer for
// duration_ns from its own start, so a block that waits for an SM to free up ends that much later,
// as a communication kernel's would. num_sms is in [1, the device's SM count]; duration_ns 0
// enqueues nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace weft::cuda {

struct HoldSmsParams {
  int num_sms = 1;           // blocks, one per SM: in [1, the current device's SM count]
  uint64_t duration_ns = 0;  // per block, from its start
};

// Enqueues the kernel on stream, a stream of the current device (weft::Error for bad params).
void hold_sms(const HoldSmsParams& params, cudaStream_t stream);

}  // namespace weft::cuda
