// weft::pipeline::TaskContext: what a task body sees while it runs.
//
// get/set access the slots of the batch the task works on; a task may read only the slots it
// declared in reads() or writes(), and write only those in writes() (weft::Error otherwise).
// stream_handle() is the backend's native stream: a cudaStream_t on the CUDA backend (see
// cuda_stream() in cuda_backend.hpp), a HostStream* on the host backend (see host_stream()).
// Work a body puts on other streams must be joined back into its own stream before the body
// returns: the task's event is recorded on its own stream only.
//
//   Task("forward").reads("batch_gpu").writes("loss").body([](TaskContext& c) {
//     c.set("loss", model.forward(c.get<Tensor>("batch_gpu"), cuda_stream(c)));
//   });
#pragma once

#include <any>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "weft/pipeline/batch.hpp"
#include "weft/pipeline/compiled_schedule.hpp"

namespace weft::pipeline {

namespace detail {
class EngineCore;
}

class TaskContext {
 public:
  TaskId task_id() const noexcept { return task_; }
  const Task& task() const;
  std::string_view name() const;
  int lookahead() const;
  // The batch's index within the current source; -1 in init().
  std::int64_t batch_index() const noexcept { return batch_index_; }
  // The engine's internal iteration (see StepRule); -1 in init().
  std::int64_t iteration() const noexcept { return iteration_; }
  // This progress's ticket of a collective task (0 = the first collective to enqueue in this
  // progress, on every rank); -1 for other tasks and in init().
  int ticket() const noexcept { return ticket_; }
  // Records one collective this body just enqueued, for Engine::collective_inventory(). Only a
  // collective task may record, and only while it holds its ticket (in its body, not in init()):
  // weft::Error otherwise, since a collective enqueued outside the ticket order can deadlock
  // NCCL across ranks. Kinds are kept per (kind, stream) in the order first recorded.
  void record_collective(std::string_view kind, std::string_view stream, std::size_t num_bytes);
  std::uint32_t thread_index() const noexcept { return thread_; }

  const CompiledSchedule& schedule() const;
  StreamId stream_id() const;
  void* stream_handle() const;
  // The engine's backend (HostBackend, CudaBackend, ...).
  class Backend& backend() const;
  void* stream_handle(std::string_view stream) const;

  template <typename T>
  const T& get(std::string_view slot) const {
    return Batch::cast<const T>(readable(slot), slot);
  }
  template <typename T>
  T& get_mutable(std::string_view slot) {
    return Batch::cast<T>(writable(slot), slot);
  }
  template <typename T>
  void set(std::string_view slot, T&& value) {
    writable(slot) = std::forward<T>(value);
  }

  // The whole batch (no access checks); throws in init().
  Batch& batch();

  // The engine's GPU span of this run of the task (0: none, the engine does not trace); see
  // wait_event() in cuda_backend.hpp.
  std::uint64_t gpu_span() const noexcept { return gpu_span_; }

 private:
  friend class detail::EngineCore;
  TaskContext(detail::EngineCore* core, TaskId task, Batch* batch, std::int64_t iteration,
              int ticket, std::uint32_t thread, std::uint64_t gpu_span = 0) noexcept
      : core_(core), task_(task), batch_(batch), batch_index_(batch ? batch->index() : -1),
        iteration_(iteration), ticket_(ticket), thread_(thread), gpu_span_(gpu_span) {}

  const std::any& readable(std::string_view slot) const;
  std::any& writable(std::string_view slot);

  detail::EngineCore* core_;
  TaskId task_;
  Batch* batch_;
  std::int64_t batch_index_;
  std::int64_t iteration_;
  int ticket_;
  std::uint32_t thread_;
  std::uint64_t gpu_span_;
};

}  // namespace weft::pipeline
