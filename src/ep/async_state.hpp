// What a Buffer keeps for its asynchronous calls and its bounded host run-ahead (internal).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace weft::ep::detail {

struct AsyncState {
  int device = 0;
  cudaStream_t comm_stream = nullptr;  // non-blocking, the device's greatest priority
  // Reused by every async call: recorded on the caller's stream for the comm stream to wait on
  // (no previous_event), and recorded on the comm stream for the caller's stream to wait on
  // (async_finish = false). Re-recording is safe once the wait is enqueued: a wait captures the
  // event's state when it is enqueued.
  cudaEvent_t caller_ready = nullptr;
  cudaEvent_t comm_done = nullptr;
  // pipeline_depth events: ring[i % depth] is recorded after call i was launched, and waited on
  // by the host before call i + depth is launched.
  std::vector<cudaEvent_t> ring;
  uint64_t num_launched = 0;  // calls launched on the Buffer (every form)

  AsyncState() = default;
  AsyncState(const AsyncState&) = delete;
  AsyncState& operator=(const AsyncState&) = delete;
  // Waits for the work queued on the comm stream (the window must outlive it), then frees.
  ~AsyncState();
};

// Creates the comm stream and events on `device` (which must be current). Throws weft::Error
// unless pipeline_depth >= 0.
std::unique_ptr<AsyncState> make_async_state(int device, int pipeline_depth);

}  // namespace weft::ep::detail
