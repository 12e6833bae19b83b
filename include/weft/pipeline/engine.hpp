// weft::pipeline::Engine: runs a schedule over a data source, one step per progress().
//
//   Engine engine(hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3, .bodies = bodies}),
//                 ThreadMap::preset("full_split"), HostBackend());
//   engine.set_source(loader);                  // each batch enters the ring at the furthest slot
//   while (auto step = engine.progress()) log(step->get<float>("loss"));
//
// Semantics (docs/pipeline.md has the long form):
//  - progress() runs internal iterations (StepRule) until the la = 0 tasks finish a batch, and
//    returns that batch (valid until the next progress()), or std::nullopt at end of data. M
//    batches in give exactly M results.
//  - A slot's value lives until every task that reads it has completed its work on its stream
//    (Backend::fence); values are destroyed on the caller's thread, never on an engine thread.
//    At the end of data the progress() that returns std::nullopt does not wait for the streams:
//    the values it still holds go behind a fence, destroyed by a later call once the streams
//    are done with them (progress(), a new source, synchronize(), the destructor).
//  - set_source() starts a new data source and resets the ring; calling it while batches of the
//    previous source are in flight (not all results returned) is an error: drain first, or reset().
//    It waits for the streams only where it discards values, batches in flight or an error;
//    otherwise (e.g. after a clean end of data, whose values are retired) it joins them on the
//    device (Backend::join_streams: every stream after the work queued on every stream), so
//    that work the caller queued since overlaps the new source's first tasks on the host and
//    still precedes them on every stream.
//  - One caller: the methods are called by one thread at a time, never from a task body or init
//    of this engine, nor from the destructor of a slot value it destroys.
//  - Threaded executor (any map but legacy): persistent threads, one per thread of the map, each
//    running its tasks in run order; progress() returns when all have finished. Cross-thread waits
//    follow wait_edges(); collectives take tickets in run order (same order on every rank).
//
// Error contract: if a task body (or a backend call) throws, every waiting thread wakes, the
// remaining tasks of that progress are skipped, and progress() rethrows the first error on the
// caller's thread. The engine is then failed: the batches in flight are partially processed,
// GPU work already enqueued stays enqueued, the threads are idle and alive. progress() keeps
// throwing until reset() or set_source(), which discard the in-flight batches (after
// synchronising the backend) and make the engine usable again. The destructor joins every thread,
// also after an error. Collectives a failed step enqueued on some ranks but not on others leave
// the communicator unusable; abort it (ncclCommAbort) before resetting.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <any>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "weft/pipeline/backend.hpp"
#include "weft/pipeline/batch.hpp"
#include "weft/pipeline/collective_inventory.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/pipeline/trace.hpp"

namespace weft::pipeline {

namespace detail {
class EngineCore;
}

// Fills the batch's input slots and returns true, or returns false at end of data.
using Source = std::function<bool(Batch&)>;

struct EngineOptions {
  bool trace = false;  // record host spans, waits and (CUDA backend) GPU spans
  // When one progress() has run this long, the engine prints once, to stderr, where each of its
  // threads is: which task it runs or which producer or ticket it waits for. The progress()
  // goes on. 0 turns the report off; NaN or a negative value is an error. The sequential
  // executor, whose bodies run on the caller's thread, watches with a thread of its own.
  double stall_report_s = 60;
  // How long an engine thread spins on a hand-off (rounds of pauses, each followed by a yield)
  // before it sleeps. Hand-offs inside one progress() are microseconds apart and waking a
  // sleeping thread costs several microseconds, so spinning buys latency with CPU time. A
  // negative value picks: 20 us when the process's CPU affinity mask has a CPU for every engine
  // thread and the caller, else 0 (spinners would take the core of the thread they wait for).
  // It counts this engine's threads only: several ranks (or engines) sharing the CPUs, e.g.
  // under `mpirun --bind-to none`, may still oversubscribe them; set it explicitly there.
  double spin_us = -1;
  // Called on the caller's thread while a threaded progress() (or the constructor, running the
  // inits) waits for its threads, once the wait has lasted kInterruptCheckInterval and then at
  // most once per interval; never while the sequential executor runs a body. A hook that throws
  // aborts the step with its error, as a failing body does: waiting threads wake, tasks not
  // yet started are skipped, bodies already running finish, and progress() rethrows it (or the
  // error of a body that failed first). A binding checks for its runtime's interrupts here (the
  // Python package: Ctrl-C).
  std::function<void()> interrupt_check;
};

inline constexpr std::chrono::milliseconds kInterruptCheckInterval{20};

// CPUs this process may run on: its affinity mask (the machine's count where that is unknown).
std::size_t usable_cpus() noexcept;

// The batch a progress() finished: valid until the next progress(), reset() or set_source().
class Step {
 public:
  std::int64_t batch_index() const noexcept { return batch_->index(); }
  const Batch& batch() const noexcept { return *batch_; }
  template <typename T>
  const T& get(std::string_view slot) const {
    return batch_->get<T>(slot);
  }

 private:
  friend class detail::EngineCore;
  explicit Step(const Batch* batch) noexcept : batch_(batch) {}
  const Batch* batch_;
};

class Engine {
 public:
  // Validates the schedule, resolves the thread map, binds the backend, starts the threads and
  // runs every task's init() on its thread. Throws weft::Error (threads already joined).
  Engine(Schedule schedule, ThreadMap threads, std::unique_ptr<Backend> backend,
         EngineOptions options = {});
  template <std::derived_from<Backend> B>
  Engine(Schedule schedule, ThreadMap threads, B backend, EngineOptions options = {})
      : Engine(std::move(schedule), std::move(threads),
               std::make_unique<B>(std::move(backend)), options) {}
  // Host backend.
  Engine(Schedule schedule, ThreadMap threads, EngineOptions options = {});
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  void set_source(Source source);
  std::optional<Step> progress();
  // Discards the batches in flight and any error; the source is kept and restarts from where it
  // is (the next batch it gives is batch 0 of a new ring).
  void reset();
  // Waits for all GPU (stream) work, then destroys the slot values whose work is done (after
  // the end of data: every value held); rethrows the backend's first error.
  void synchronize();

  const CompiledSchedule& schedule() const noexcept;
  const ThreadAssignment& threads() const noexcept;
  Backend& backend() noexcept;
  bool failed() const noexcept;
  // Batches pulled from the current source and not yet returned by progress().
  std::int64_t num_in_flight() const noexcept;

  // The recording so far (tracing on); call between progress() calls. Clears the recording.
  Trace take_trace();
  // What the collective tasks recorded (TaskContext::record_collective) since construction, in
  // run order of the tasks; call between progress() calls.
  std::vector<MeasuredCollective> collective_inventory() const;
  // Calls `visit` on every slot value the engine holds (batches in flight, the last result,
  // values waiting for their streams); for a binding whose garbage collector must see them.
  // Call between progress() calls.
  void for_each_value(const std::function<void(const std::any&)>& visit) const;

 private:
  std::unique_ptr<detail::EngineCore> core_;
};

}  // namespace weft::pipeline
