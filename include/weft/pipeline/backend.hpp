// weft::pipeline::Backend: the streams and events the engine drives (host or CUDA).
//
// The engine calls bind() once, then, for every task it runs: wait() for each cross-stream
// producer (on the producer's event for the producer's batch; wait_for_record() for a
// SyncSide::kGpu producer on another thread, where the backend supports it), the body, then —
// only for a task some consumer on another stream waits on — record() on the task's own stream.
// Events are indexed by (task, ring slot): ring slot = batch index modulo in_flight, so each
// event is reused, never re-created. The engine guarantees that an event is recorded before
// wait() waits on it, and that no two threads record one event at once. record(), wait() and
// wait_for_record() are called from the engine's threads concurrently (for different tasks);
// fence() and fence_completed() from the caller's thread, once per step.
//
// Implementations: HostBackend (host_backend.hpp), CudaBackend (cuda_backend.hpp, weft::cuda).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"

namespace weft::pipeline {

// A GPU span of one task run, in microseconds since the trace's reference point.
struct GpuSpan {
  TaskId task = 0;
  StreamId stream = 0;      // the stream the task ran on in that progress (after any move)
  std::int64_t batch = 0;   // the batch index the run worked on
  double begin_us = 0;      // the first work the body enqueued began
  double end_us = 0;        // the last of it ended; >= begin_us
  // The task's body threw: the span ends at the work the body had enqueued when it did.
  bool failed = false;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const noexcept = 0;
  // Creates the schedule's streams (with their priorities) and one event per task per ring slot.
  // Called once, before any other call, on the thread that constructs the engine.
  virtual void bind(const CompiledSchedule& schedule) = 0;
  // Called on every engine thread (and, for the sequential executor, on the caller's thread)
  // before it runs a task: e.g. selects the CUDA device.
  virtual void on_thread_start() {}

  virtual void* stream_handle(StreamId stream) = 0;
  // Records the task's event for ring slot `ring_slot` on `stream`.
  virtual void record(TaskId task, std::uint32_t ring_slot, StreamId stream) = 0;
  // Makes `stream` wait for the producer's event of `ring_slot` (never for the whole stream).
  virtual void wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) = 0;
  // Whether wait_for_record() is supported: a stream can wait for a record that has not been
  // made yet. Then a SyncSide::kGpu consumer's thread does not wait for its producer's body;
  // elsewhere it waits until the producer's event is recorded (CUDA: cudaStreamWaitEvent takes
  // the event's latest record, so a wait must follow the record it means on the host).
  virtual bool waits_for_future_records() const noexcept { return false; }
  // Makes `stream` wait for the `num_records`-th record (counted from 1 since bind(), over all
  // calls of record() for this task and ring slot) of the producer's event, made now or later.
  // The engine guarantees that this record is made, in this iteration, even if the producer fails.
  virtual void wait_for_record(StreamId stream, TaskId producer, std::uint32_t ring_slot,
                               std::uint64_t num_records) {
    (void)stream, (void)producer, (void)ring_slot, (void)num_records;
    WEFT_FAIL("backend '", name(), "' cannot wait for a record yet to come");
  }
  // Blocks until all work on all streams is done; throws the first error of that work.
  virtual void synchronize() = 0;
  // Orders the work enqueued on every stream from now on after the work enqueued on every stream
  // so far, without blocking the host (at the end of data, and where a new source starts with
  // nothing to discard). The default blocks: synchronize().
  virtual void join_streams() { synchronize(); }

  // Fences keep slot values alive for the stream work that reads them. fence() marks everything
  // enqueued on every stream so far and returns the fence's id (ids increase from 0);
  // fence_completed(id) tells, without blocking, whether all of that work has finished (a fence
  // completes after every earlier one). Both are called on the engine's caller thread only,
  // between iterations; the engine destroys a batch's slot values only once a fence taken after
  // the batch's last task has completed.
  virtual std::uint64_t fence() = 0;
  virtual bool fence_completed(std::uint64_t fence) = 0;

  // GPU spans (only while the engine traces). A backend without them keeps the defaults.
  virtual void set_gpu_spans(bool enabled) { (void)enabled; }
  virtual std::uint64_t begin_gpu_span(TaskId task, StreamId stream, std::int64_t batch) {
    (void)task, (void)stream, (void)batch;
    return 0;
  }
  virtual void end_gpu_span(std::uint64_t span, StreamId stream) { (void)span, (void)stream; }
  // Synchronizes and returns the spans since the last call, timed from `origin_ns` (a
  // steady_clock time_since_epoch in ns, the trace's origin).
  virtual std::vector<GpuSpan> take_gpu_spans(std::int64_t origin_ns) {
    (void)origin_ns;
    return {};
  }
};

}  // namespace weft::pipeline
