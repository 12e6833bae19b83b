#include "weft/ep/event.hpp"

#include <cstdio>
#include <exception>

#include "weft/cuda/device_guard.hpp"
#include "weft/cuda/check.hpp"

namespace weft::ep {

struct Event::State {
  cudaEvent_t event = nullptr;
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Safe while the event is pending: CUDA releases it once it completes, and waits already
  // enqueued on it keep their meaning.
  ~State() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

Event Event::make(cudaStream_t recorded_on, cudaStream_t waiter) {
  auto state = std::make_shared<State>();
  WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&state->event, cudaEventDisableTiming));
  WEFT_CUDA_CHECK(cudaEventRecord(state->event, recorded_on));
  return Event(std::move(state), waiter);
}

Event Event::record(cudaStream_t stream) {
  int device = 0;
  WEFT_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
  cuda::DeviceGuard guard(device);
  return make(stream, stream);
}

void Event::wait(cudaStream_t stream) const {
  if (state_ != nullptr) WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, state_->event, 0));
}

void Event::wait() const { wait(stream_); }

bool Event::query() const {
  if (state_ == nullptr) return true;
  const cudaError_t status = cudaEventQuery(state_->event);
  if (status == cudaErrorNotReady) return false;
  WEFT_CUDA_CHECK(status);
  return true;
}

void Event::synchronize() const {
  if (state_ != nullptr) WEFT_CUDA_CHECK(cudaEventSynchronize(state_->event));
}

EventScope Event::scope() const { return EventScope(*this, stream_); }

EventScope Event::scope(cudaStream_t stream) const { return EventScope(*this, stream); }

cudaEvent_t Event::native() const noexcept {
  return state_ != nullptr ? state_->event : nullptr;
}

EventScope::EventScope(EventScope&& other) noexcept
    : event_(std::move(other.event_)),
      stream_(other.stream_),
      uncaught_at_start_(other.uncaught_at_start_),
      open_(std::exchange(other.open_, false)) {}

EventScope::~EventScope() {
  if (!open_ || event_.empty() || std::uncaught_exceptions() > uncaught_at_start_) return;
  const cudaError_t status = cudaStreamWaitEvent(stream_, event_.native(), 0);
  if (status != cudaSuccess) {
    std::fprintf(stderr,
                 "weft::ep::EventScope: cudaStreamWaitEvent failed at the end of the scope (%s: "
                 "%s); the streams would be left unordered, terminating\n",
                 cudaGetErrorName(status), cudaGetErrorString(status));
    std::terminate();
  }
}

void EventScope::close() {
  if (!open_) return;
  open_ = false;
  event_.wait(stream_);
}

}  // namespace weft::ep
