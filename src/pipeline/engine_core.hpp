// weft::pipeline::detail::EngineCore: the engine's state and both executors (private header).
//
// Synchronisation (threaded executor), all on 32-bit atomics with futex-backed wait/notify:
//  - go_: the caller bumps it to start an iteration; workers wait for a change.
//  - remaining_: threads still running this iteration; the last one wakes the caller.
//  - done_[task]: the epoch of the last iteration in which the task finished or was passed
//    (inactive tasks are passed by their thread, so waiting on one means "its thread got past
//    it"). A thread passes an inactive task only after that task's stream-order producers are
//    done, which keeps stream-order chains transitive across inactive tasks (prefill, drain).
//  - ticket_: the ticket now serving; a collective task waits for ticket_base_ + its ticket.
// Every wait is on a task earlier in run order, and each thread runs its tasks in run order, so
// the earliest unfinished task can always proceed: no deadlock. On failure, aborted_ is set and
// every counter is bumped and notified; every wait loop checks aborted_ and unwinds with
// AbortSignal, and run_task checks aborted_ again after its last wait.
#pragma once

#include <atomic>
#include <any>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "weft/pipeline/backend.hpp"
#include "weft/pipeline/batch.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/engine.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/pipeline/trace.hpp"
#include "weft/pipeline/wait_edges.hpp"
#include "stall_watchdog.hpp"

namespace weft::pipeline::detail {

// A 32-bit value threads wait on, with the engine's own futex protocol: a waker that changed
// `value` calls wake_all(); it makes the futex call only when some thread sleeps on the signal
// (`num_sleepers`, read after a seq_cst fence, against the sleeper's seq_cst increment before
// its last check, so one of the two always sees the other). The protocol does not go through
// std::atomic::wait, whose notify can miss a thread that is about to sleep (docs/decisions.md).
struct alignas(64) Signal {
  std::atomic<std::uint32_t> value{0};
  std::atomic<std::uint32_t> num_sleepers{0};
};

// Waits for signal.value != old: spins for up to spin_ns (rounds of pauses, each followed by a
// yield), then yields a few times, then sleeps, because the hand-offs inside one progress() are
// microseconds apart and a sleep/wake costs several microseconds per thread
// (EngineOptions::spin_us). Returns after at most one sleep of at most 50 ms, changed or not:
// callers re-check in a loop, so a wake-up lost anywhere below the engine costs a delay, never a
// hang, and a waiting caller gets to look at the clock.
void wait_for_change(Signal& signal, std::uint32_t old, std::int64_t spin_ns) noexcept;

// Where an engine thread is, for the stall report; written by the thread, read by the caller
// while the thread runs. Position, wait kind and wait target change together in one 64-bit
// store, so that a reader's one load sees a state the thread was in (a target never read with
// another state's kind).
struct alignas(64) ThreadProgress {
  enum Wait : std::uint32_t { kNone, kTask, kTicket };
  struct State {
    std::uint32_t position;  // index into the thread's task list; its size = done
    Wait wait;
    std::uint32_t wait_target;  // the producer TaskId (kTask), or the ticket value (kTicket)
  };
  void set(std::uint32_t position, Wait wait = kNone, std::uint32_t wait_target = 0) noexcept {
    // position: 30 bits (a thread's task count), wait: 2 bits, wait_target: 32 bits.
    packed.store((std::uint64_t{position} << 34) | (std::uint64_t{wait} << 32) | wait_target,
                 std::memory_order_relaxed);
  }
  State get() const noexcept {
    const std::uint64_t v = packed.load(std::memory_order_relaxed);
    return {static_cast<std::uint32_t>(v >> 34), static_cast<Wait>((v >> 32) & 3),
            static_cast<std::uint32_t>(v)};
  }
  std::atomic<std::uint64_t> packed{0};
};
// Wakes every thread sleeping in wait_for_change on this signal. Call after changing the value.
void wake_all(Signal& signal) noexcept;

// Thrown inside the engine when a wait is cut short because another task failed.
struct AbortSignal {};

// Everything run_task needs about one task, precomputed at construction.
struct TaskPlan {
  struct HostWait {
    TaskId producer;
    WaitRule rule;
  };
  struct StreamWait {
    TaskId producer;
    int batch_offset;
    // SyncSide::kGpu across threads on a backend that waits for future records: no host wait;
    // the stream waits for the producer's record of this iteration, made now or later.
    bool future_record = false;
  };
  TaskId id = 0;
  StreamId stream = 0;
  int lookahead = 0;
  bool collective = false;
  // Some consumer's stream waits on this task's event: only then is the event recorded (an
  // event record is a driver call under a lock, and most tasks have no cross-stream consumer).
  bool records_event = false;
  bool has_future_waiters = false;  // some consumer's StreamWait::future_record names this task
  std::vector<HostWait> host_waits;  // one per producer
  // The kStreamOrder producers, waited for also in an iteration where this task is inactive.
  std::vector<HostWait> stream_order_waits;
  std::vector<StreamWait> stream_waits;
};

class EngineCore {
 public:
  EngineCore(Schedule schedule, ThreadMap threads, std::unique_ptr<Backend> backend,
             EngineOptions options);
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;
  // Drains the backend's streams before the slot values they may still read are destroyed.
  ~EngineCore();

  void set_source(Source source);
  std::optional<Step> progress();
  void reset();
  // Waits for the backend's streams, then destroys the retired values (their work is done).
  void synchronize();
  Trace take_trace();
  std::vector<MeasuredCollective> collective_inventory() const;
  void for_each_value(const std::function<void(const std::any&)>& visit) const;
  void record_collective(TaskId task, std::string_view kind, std::string_view stream,
                         std::size_t num_bytes);

  const CompiledSchedule& schedule() const noexcept { return schedule_; }
  const ThreadAssignment& threads() const noexcept { return threads_; }
  Backend& backend() noexcept { return *backend_; }
  bool failed() const noexcept { return failed_; }
  std::int64_t num_in_flight() const noexcept { return num_pulled_ - num_returned_; }
  void* stream_handle(StreamId id) const { return stream_handles_.at(id); }

 private:
  // Joins the workers when destroyed; declared last so that it is destroyed first.
  struct WorkerThreads {
    std::vector<std::thread> threads;
    std::function<void()> stop;
    WorkerThreads() = default;
    WorkerThreads(const WorkerThreads&) = delete;
    WorkerThreads& operator=(const WorkerThreads&) = delete;
    ~WorkerThreads();
  };

  void start_workers();
  void worker_main(std::uint32_t thread);
  void run_inits(std::uint32_t thread);
  void pull();
  // Keeps the values of a batch that left the ring (and empties it) until the backend's streams
  // have finished all work enqueued so far; release_retired() destroys those whose time came.
  // fence: the fence the values wait for (default: a new one).
  void retire(Batch& batch, std::optional<std::uint64_t> fence = std::nullopt);
  void release_retired();
  void prepare_iteration();
  void run_iteration();
  // After an aborted iteration: makes the records that future-record waits of this iteration
  // wait for and that a failed or skipped producer did not make, so that no stream waits forever.
  void make_awaited_records() noexcept;
  void run_task(const TaskPlan& plan, std::uint32_t thread, bool threaded);
  void wait_done(const TaskPlan::HostWait& wait, std::uint32_t epoch, TaskId consumer,
                 std::uint32_t thread);
  void wait_value(Signal& signal, std::uint32_t target);
  // Waits for remaining_ == 0 (the caller's side of an iteration), reporting a stall once per
  // progress() (or construction), timed from its start.
  void wait_for_workers();
  void report_stall(double seconds) const;
  // At the end of data: the streams are joined on the device (the caller's work queued next on
  // any of them comes after all of the source's), and the last result and every batch's values
  // are retired, without waiting for the streams (a step's end does not drain the device);
  // they go when their fences complete, in a later call (progress(), a new source,
  // synchronize()) or with the engine.
  void retire_all();
  void mark_done(TaskId task, std::uint32_t epoch) noexcept;
  void fail(std::exception_ptr error) noexcept;
  [[noreturn]] void throw_failure() const;
  double now_us() const noexcept;

  CompiledSchedule schedule_;
  ThreadAssignment threads_;
  std::unique_ptr<Backend> backend_;
  EngineOptions options_;
  std::int64_t spin_ns_ = 0;  // resolved EngineOptions::spin_us
  std::vector<TaskPlan> plans_;
  std::vector<void*> stream_handles_;
  int max_lookahead_ = 0;
  std::uint32_t in_flight_ = 1;

  // Ring: ring_[batch % in_flight] holds the batch; result_ the last finished one.
  std::vector<Batch> ring_;
  Batch result_;
  struct Retired {
    std::uint64_t fence;
    std::vector<std::any> values;
  };
  std::deque<Retired> retired_;  // oldest first
  Source source_;
  std::int64_t iteration_ = 0;
  // iteration_ for the stall report, which may read it on the watchdog's thread.
  std::atomic<std::int64_t> reported_iteration_{0};
  // The current progress() (or construction) began then; its stall report is printed.
  std::chrono::steady_clock::time_point call_start_;
  bool stall_reported_ = false;
  std::int64_t num_pulled_ = 0;
  std::int64_t num_returned_ = 0;
  bool exhausted_ = false;
  bool ended_ = false;
  bool failed_ = false;

  // The current iteration, written by the caller before go_ is bumped.
  std::uint32_t epoch_ = 0;
  std::vector<std::uint8_t> active_by_la_;
  std::vector<std::int64_t> batch_by_la_;
  std::vector<std::uint32_t> ring_slot_by_la_;
  std::vector<int> ticket_of_task_;  // -1: no ticket this iteration
  // record() calls per event [task * in_flight + ring slot] since bind(), written by the task's
  // thread; for a task with future waiters, the number its record of this iteration will have.
  std::vector<std::uint64_t> num_records_;
  std::vector<std::uint64_t> awaited_record_;  // by task
  std::uint32_t ticket_base_ = 0;

  // Collectives recorded by each task's body; written only by the thread that runs the task,
  // read by the caller between iterations.
  struct CollectiveTally {
    std::string kind;
    std::string stream;
    double total_bytes = 0;
    std::int64_t num_calls = 0;
  };
  std::vector<std::vector<CollectiveTally>> tallies_by_task_;
  std::vector<std::int64_t> num_collective_runs_;  // active runs of each collective task

  std::unique_ptr<Signal[]> done_;
  std::unique_ptr<ThreadProgress[]> progress_by_thread_;
  Signal ticket_;
  Signal go_;
  Signal remaining_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> aborted_{false};
  std::mutex error_mutex_;
  std::exception_ptr first_error_;

  // Tracing: one buffer per thread, appended to only by that thread.
  bool tracing_ = false;
  std::chrono::steady_clock::time_point origin_;
  std::vector<std::vector<HostSpan>> spans_by_thread_;
  std::vector<std::vector<WaitRecord>> waits_by_thread_;

  WorkerThreads workers_;
  // The sequential executor's stall report (null with the threaded one, or the report off).
  std::unique_ptr<StallWatchdog> watchdog_;

  friend class weft::pipeline::TaskContext;
};

}  // namespace weft::pipeline::detail
