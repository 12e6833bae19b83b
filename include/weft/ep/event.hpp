// weft::ep::Event: the completion of an asynchronous dispatch or combine (DeepEP's EventOverlap),
// and EventScope, which makes a stream wait for it when the scope ends.
//
//   auto [recv, done] = ep.dispatch(in, compute, {.previous_event = Event::record(compute),
//                                                 .async_finish = true});
//   gemm_that_does_not_need_recv(compute);       // overlaps the dispatch (on ep.comm_stream())
//   {
//     auto scope = done.scope();                  // compute waits for the dispatch at the '}'
//     more_independent_work(compute);
//   }
//   expert_gemm(recv.recv_x, compute);            // ordered after the dispatch
//
// Contracts
//  - An Event is a shared handle to one CUDA event (copies refer to the same one; the CUDA event
//    is destroyed with the last copy, which is safe while it is still pending: waits already
//    enqueued on it stay in force).
//  - Destroying an Event orders nothing: a stream is ordered after the call only by wait(),
//    wait(stream) or a scope. Dropping the event of an async_finish call therefore leaves the
//    caller's stream unordered with the call's results.
//  - An empty Event (default-constructed; what a call with async_finish = false returns, since
//    it already made the caller's stream wait) completes at once: wait() and scope() enqueue
//    nothing, query() is true.
//  - No member waits on the host except synchronize().
#pragma once

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <utility>

namespace weft::ep {

class EventScope;

class Event {
 public:
  Event() = default;

  // Records an event on `stream` (on the stream's device) now: what AsyncOptions::previous_event
  // takes to order a call after the work queued so far on stream. wait() then orders `stream`.
  static Event record(cudaStream_t stream);

  bool empty() const noexcept { return state_ == nullptr; }
  // Makes `stream` wait for the event (cudaStreamWaitEvent: no host wait; any device's stream).
  void wait(cudaStream_t stream) const;
  // ... the stream of the call that returned this Event (the caller's compute stream).
  void wait() const;
  // True once the work the event covers has completed (an empty Event: at once).
  bool query() const;
  // Host wait for the work the event covers.
  void synchronize() const;
  // A scope whose end makes the call's stream (or `stream`) wait for the event.
  [[nodiscard]] EventScope scope() const;
  [[nodiscard]] EventScope scope(cudaStream_t stream) const;

  cudaEvent_t native() const noexcept;      // null when empty
  cudaStream_t stream() const noexcept { return stream_; }  // the stream wait() orders

 private:
  friend class Buffer;
  struct State;
  // The event must have been recorded already; `stream` is the one wait() orders.
  Event(std::shared_ptr<const State> state, cudaStream_t stream)
      : state_(std::move(state)), stream_(stream) {}
  // Creates a disable-timing event on the current device and records it on `recorded_on`.
  static Event make(cudaStream_t recorded_on, cudaStream_t waiter);

  std::shared_ptr<const State> state_;
  cudaStream_t stream_ = nullptr;
};

// Enqueues the wait of its stream on its event when it ends (DeepEP's `with event:`), so the work
// enqueued inside the scope is not ordered after the event, and the work after it is.
class EventScope {
 public:
  EventScope(Event event, cudaStream_t stream) : event_(std::move(event)), stream_(stream) {}
  // The wait is enqueued at the end, unless the scope is left by an exception (the results it
  // guards are then abandoned) or close() ran. A CUDA failure of that wait cannot be thrown
  // from a destructor and would leave the streams unordered, so it terminates the process with
  // the CUDA error; close() is the throwing form.
  ~EventScope();
  EventScope(EventScope&& other) noexcept;
  EventScope& operator=(EventScope&&) = delete;
  EventScope(const EventScope&) = delete;
  EventScope& operator=(const EventScope&) = delete;

  // Enqueues the wait now (throws weft::CudaError on failure); the end of the scope then does
  // nothing.
  void close();

 private:
  Event event_;
  cudaStream_t stream_ = nullptr;
  int uncaught_at_start_ = std::uncaught_exceptions();
  bool open_ = true;
};

}  // namespace weft::ep
