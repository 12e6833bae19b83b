// The asynchronous forms of Buffer::dispatch and Buffer::combine, the comm stream and the bounded
// host run-ahead (pipeline_depth). Host-side only: the calls launch the same kernels as the
// synchronous forms, on the comm stream.
#include <cuda_runtime_api.h>

#include "async_state.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep {
namespace detail {

AsyncState::~AsyncState() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  if (comm_stream != nullptr) {
    cudaStreamSynchronize(comm_stream);
    cudaStreamDestroy(comm_stream);
  }
  for (cudaEvent_t e : ring) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (caller_ready != nullptr) cudaEventDestroy(caller_ready);
  if (comm_done != nullptr) cudaEventDestroy(comm_done);
  cudaSetDevice(previous);
}

std::unique_ptr<AsyncState> make_async_state(int device, int pipeline_depth) {  // depth >= 0
  auto state = std::make_unique<AsyncState>();
  state->device = device;
  int least = 0, greatest = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  WEFT_CUDA_CHECK(
      cudaStreamCreateWithPriority(&state->comm_stream, cudaStreamNonBlocking, greatest));
  WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&state->caller_ready, cudaEventDisableTiming));
  WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&state->comm_done, cudaEventDisableTiming));
  state->ring.resize(std::size_t(pipeline_depth), nullptr);
  for (cudaEvent_t& e : state->ring) {
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return state;
}

}  // namespace detail

cudaStream_t Buffer::comm_stream() const noexcept { return async_->comm_stream; }

void Buffer::pace_host() {
  const auto& a = *async_;
  const std::size_t depth = a.ring.size();
  // The slot of the call about to be launched holds the call `depth` calls before it.
  if (depth == 0 || a.num_launched < depth) return;
  WEFT_CUDA_CHECK(cudaEventSynchronize(a.ring[a.num_launched % depth]));
}

void Buffer::note_launched(cudaStream_t stream) {
  auto& a = *async_;
  if (!a.ring.empty()) {
    WEFT_CUDA_CHECK(cudaEventRecord(a.ring[a.num_launched % a.ring.size()], stream));
  }
  ++a.num_launched;
}

void Buffer::enter_comm_stream(const AsyncOptions& async, cudaStream_t stream) {
  WEFT_CHECK(!async.allocate_on_comm_stream ||
                 (!async.previous_event.empty() && async.async_finish),
             "allocate_on_comm_stream needs previous_event and async_finish (as in DeepEP: the "
             "outputs belong to the comm stream until the returned Event is waited on)");
  cuda::DeviceGuard guard(device_);
  if (!async.previous_event.empty()) {
    async.previous_event.wait(async_->comm_stream);
    return;
  }
  WEFT_CUDA_CHECK(cudaEventRecord(async_->caller_ready, stream));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(async_->comm_stream, async_->caller_ready, 0));
}

Event Buffer::leave_comm_stream(const AsyncOptions& async, cudaStream_t stream) {
  cuda::DeviceGuard guard(device_);
  if (async.async_finish) return Event::make(async_->comm_stream, stream);
  WEFT_CUDA_CHECK(cudaEventRecord(async_->comm_done, async_->comm_stream));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, async_->comm_done, 0));
  return {};
}

AsyncDispatchResult Buffer::dispatch(const DispatchInputs& inputs, cudaStream_t stream,
                                     const AsyncOptions& async, CountMode mode) {
  enter_comm_stream(async, stream);
  DispatchResult result = dispatch(inputs, async_->comm_stream, mode);
  return {result, leave_comm_stream(async, stream)};
}

Event Buffer::combine(const CombineInputs& inputs, const Handle& handle, void* out,
                      cudaStream_t stream, const AsyncOptions& async) {
  enter_comm_stream(async, stream);
  combine(inputs, handle, out, async_->comm_stream);
  return leave_comm_stream(async, stream);
}

}  // namespace weft::ep
