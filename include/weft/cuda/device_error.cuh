// Device half of the error flag (see device_error.hpp), and the bounded spin-wait every weft
// kernel uses instead of an unbounded loop.
#pragma once

#include <cstdint>

#include "weft/cuda/device_error.hpp"

namespace weft::cuda {

// Records the first error; later calls (from any thread, block or kernel) are ignored.
// The fields are published before `code` becomes non-zero, so a host that polls sees a
// complete record.
__device__ inline void raise_device_error(DeviceErrorRecord* record, uint32_t code, int32_t rank,
                                          int64_t arg0 = 0, int64_t arg1 = 0, int64_t arg2 = 0) {
  if (record == nullptr) return;
  if (atomicCAS(&record->claimed, 0u, 1u) != 0u) return;
  record->rank = rank;
  record->args[0] = arg0;
  record->args[1] = arg1;
  record->args[2] = arg2;
  __threadfence_system();
  atomicExch(&record->code, code);
}

__device__ inline uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until ready() is true or timeout_ns elapse; returns false on timeout. The caller reports
// the timeout (rank and what it waited for) through raise_device_error and abandons its work.
template <typename Ready>
__device__ inline bool spin_wait(Ready&& ready, uint64_t timeout_ns) {
  if (ready()) return true;
  const uint64_t start = globaltimer_ns();
  while (!ready()) {
    if (globaltimer_ns() - start > timeout_ns) return false;
  }
  return true;
}

}  // namespace weft::cuda
