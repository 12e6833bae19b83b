// weft::pipeline::HostBackend: streams made of host threads, for tests and the simulator.
//
// Each stream is a FIFO worker thread. A body puts work on its stream with host_stream(c).enqueue;
// the work runs after everything enqueued on that stream before it. An event is the position in a
// stream's FIFO at record time: it completes when the worker has finished everything enqueued
// before the record. wait() on another stream enqueues a marker that blocks that stream's worker
// until the event completes (nothing is enqueued when it already has). A work item that throws
// does not stop the stream; the first error is rethrown by synchronize() (like CUDA's sticky
// errors, but cleared once reported).
//
//   Engine engine(schedule, ThreadMap::by_stream(), HostBackend());
//   ... Task("h2d").body([](TaskContext& c) { host_stream(c).enqueue([] { copy(); }); });
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "weft/pipeline/backend.hpp"

namespace weft::pipeline {

class TaskContext;

class HostStream {
 public:
  explicit HostStream(std::string name);
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;
  // Finishes the queued work, then joins the worker.
  ~HostStream();

  const std::string& name() const noexcept { return name_; }
  void enqueue(std::function<void()> work);
  // Waits for everything enqueued so far; rethrows (and clears) the first error of a work item.
  void synchronize();

  std::uint64_t num_enqueued() const noexcept { return num_enqueued_.load(std::memory_order_acquire); }
  std::uint64_t num_completed() const noexcept { return num_completed_.load(std::memory_order_acquire); }
  // Blocks the calling thread until num_completed() >= position.
  void wait_for(std::uint64_t position) const;

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::exception_ptr first_error_;
  std::atomic<std::uint64_t> num_enqueued_{0};
  std::atomic<std::uint64_t> num_completed_{0};
  // wait_for() blocks on a condition variable, not on std::atomic<uint64_t>::wait, whose
  // wake-ups libstdc++ may lose (docs/decisions.md). The mutex guards only the hand-off of
  // completions.
  mutable std::mutex completed_mutex_;
  mutable std::condition_variable completed_;
  std::thread worker_;
};

class HostBackend final : public Backend {
 public:
  HostBackend() = default;
  HostBackend(HostBackend&&) noexcept = default;
  HostBackend& operator=(HostBackend&&) noexcept = default;
  ~HostBackend() override;

  std::string_view name() const noexcept override { return "host"; }
  void bind(const CompiledSchedule& schedule) override;
  void* stream_handle(StreamId stream) override;
  void record(TaskId task, std::uint32_t ring_slot, StreamId stream) override;
  void wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) override;
  // A marker on `stream` that blocks its worker until the record is made, then until the event
  // completes.
  bool waits_for_future_records() const noexcept override { return true; }
  void wait_for_record(StreamId stream, TaskId producer, std::uint32_t ring_slot,
                       std::uint64_t num_records) override;
  void synchronize() override;
  // Every stream gets a marker that waits for the others' work enqueued so far.
  void join_streams() override;
  std::uint64_t fence() override;
  bool fence_completed(std::uint64_t fence) override;

  HostStream& stream(StreamId id) { return *streams_.at(id); }
  // Markers enqueued by wait() so far (tests check that complete events enqueue none).
  std::uint64_t num_wait_markers() const noexcept { return num_wait_markers_->load(); }

 private:
  struct Event {
    StreamId stream = 0;
    std::uint64_t position = 0;  // complete when the stream has completed this many items
    std::uint64_t num_records = 0;
  };
  // Where a record awaited by wait_for_record() landed, once it is made.
  struct AwaitedRecord {
    std::uint64_t num_records = 0;
    bool made = false;
    Event event;
  };
  std::vector<std::unique_ptr<HostStream>> streams_;
  // Guards events_ and awaited_ (wait_for_record's markers read them from stream workers).
  std::unique_ptr<std::mutex> events_mutex_ = std::make_unique<std::mutex>();
  std::unique_ptr<std::condition_variable> record_made_ = std::make_unique<std::condition_variable>();
  std::vector<Event> events_;  // [task * in_flight + ring_slot]
  std::vector<std::vector<std::shared_ptr<AwaitedRecord>>> awaited_;  // like events_
  // Fences not known to be complete, oldest first: each stream's num_enqueued() at fence().
  std::deque<std::vector<std::uint64_t>> pending_fences_;
  std::uint64_t num_fences_ = 0;
  std::uint32_t in_flight_ = 0;
  std::unique_ptr<std::atomic<std::uint64_t>> num_wait_markers_ =
      std::make_unique<std::atomic<std::uint64_t>>(0);
};

// The host stream a body runs on (or another, by name); throws unless the engine uses HostBackend.
HostStream& host_stream(TaskContext& context);
HostStream& host_stream(TaskContext& context, std::string_view stream);

}  // namespace weft::pipeline
