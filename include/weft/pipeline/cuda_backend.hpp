// weft::pipeline::CudaBackend: the engine's streams and events on one CUDA device (weft::cuda).
//
// bind() creates one non-blocking stream per schedule stream (or adopts the caller's, see
// AdoptedStreams), with priority mapped onto the
// device's range (schedule priority 0 = the device's default, each +1 one step more urgent,
// clamped at the device's greatest), and one event per task per ring slot (timing disabled),
// created once and reused for as long as the backend lives. record() is cudaEventRecord on the
// task's stream; wait() is cudaStreamWaitEvent on that one event, never a whole-stream sync.
// While the engine traces, each task run also records a pair of timing events (pooled) and
// take_gpu_spans() turns them into GPU spans on the trace's clock (approximately aligned: the
// reference event is recorded on the first traced task's stream).
//
//   Engine engine(std::move(schedule), ThreadMap::preset("full_split"), CudaBackend(0));
//   ... Task("forward").body([](TaskContext& c) { kernel<<<g, b, 0, cuda_stream(c)>>>(...); });
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "weft/pipeline/backend.hpp"

namespace weft::pipeline {

class TaskContext;

// Adopted streams: schedule stream name -> a stream of the caller's on `device` (e.g. a torch
// stream's handle). bind() uses an adopted stream instead of creating one (its priority is the
// stream's own) and the backend never destroys it; the caller keeps it alive for as long as the
// engine lives. Naming a stream the schedule lacks is a weft::Error at bind().
using AdoptedStreams = std::map<std::string, cudaStream_t, std::less<>>;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device = 0, AdoptedStreams adopted = {});
  CudaBackend(CudaBackend&&) noexcept;
  CudaBackend& operator=(CudaBackend&&) = delete;
  // Synchronizes the streams, then destroys events and streams (errors are not thrown here).
  ~CudaBackend() override;

  std::string_view name() const noexcept override { return "cuda"; }
  void bind(const CompiledSchedule& schedule) override;
  void on_thread_start() override;
  void* stream_handle(StreamId stream) override;
  void record(TaskId task, std::uint32_t ring_slot, StreamId stream) override;
  void wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) override;
  void synchronize() override;
  // Every stream waits for a fence's events of the others.
  void join_streams() override;
  // A fence is one event per stream (pooled, reused once the fence completed).
  std::uint64_t fence() override;
  bool fence_completed(std::uint64_t fence) override;

  void set_gpu_spans(bool enabled) override { gpu_spans_ = enabled; }
  std::uint64_t begin_gpu_span(TaskId task, StreamId stream, std::int64_t batch) override;
  void end_gpu_span(std::uint64_t span, StreamId stream) override;
  // Records the span's begin again, now, on `stream` (wait_event: the wait is not the task's work).
  void restart_gpu_span(std::uint64_t span, StreamId stream);
  std::vector<GpuSpan> take_gpu_spans(std::int64_t origin_ns) override;

  int device() const noexcept { return device_; }
  cudaStream_t stream(StreamId id) const { return streams_.at(id); }
  // The CUDA priority each stream got.
  int cuda_priority(StreamId id) const { return priorities_.at(id); }
  // Events created for record()/wait(): num_tasks * in_flight, whatever the number of steps.
  std::size_t num_events() const noexcept { return events_.size(); }
  cudaEvent_t event(TaskId task, std::uint32_t ring_slot) const {
    return events_.at(task * in_flight_ + ring_slot);
  }

 private:
  struct PendingSpan {
    TaskId task;
    StreamId stream;
    std::int64_t batch;
    cudaEvent_t begin;
    cudaEvent_t end;
  };
  cudaEvent_t pooled_timing_event();
  // Returns the events of the oldest fences that have completed to the pool (a join's fence is
  // polled by nobody else: fence() calls this, so the pending ones stay those not yet done).
  void reap_fences();
  void release() noexcept;

  int device_;
  AdoptedStreams adopted_;
  std::vector<cudaStream_t> streams_;
  std::vector<bool> owned_;  // by StreamId: created here (destroyed by release())
  std::vector<int> priorities_;
  std::vector<cudaEvent_t> events_;  // [task * in_flight + ring_slot]
  std::uint32_t in_flight_ = 0;
  std::deque<std::vector<cudaEvent_t>> pending_fences_;  // oldest first
  std::uint64_t num_fences_ = 0;
  std::vector<cudaEvent_t> free_fence_events_;
  bool gpu_spans_ = false;
  // Tracing only: guarded by spans_mutex_ (engine threads trace concurrently).
  std::unique_ptr<std::mutex> spans_mutex_ = std::make_unique<std::mutex>();
  std::vector<PendingSpan> spans_;
  std::vector<cudaEvent_t> free_timing_events_;
  cudaEvent_t reference_ = nullptr;
  std::int64_t reference_host_ns_ = 0;
};

// The task's CUDA stream (or another schedule stream, by name); throws unless the engine runs
// on a CudaBackend.
cudaStream_t cuda_stream(TaskContext& context);
cudaStream_t cuda_stream(TaskContext& context, std::string_view stream);

// Makes the task's stream wait for `event`: an input the body takes from outside the schedule's
// edges (e.g. a buffer another step releases). Where the engine traces, the task's GPU span then
// starts after the wait, so that spans measure the task's work and a planner calibrated on them
// (weft::hstu::cost_model_from_trace) does not take the wait for work. Call it before the body
// enqueues any work of its own: that work would fall before the span's new start.
void wait_event(TaskContext& context, cudaEvent_t event);

}  // namespace weft::pipeline
