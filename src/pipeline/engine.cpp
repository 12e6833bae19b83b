#include "weft/pipeline/engine.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "engine_core.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/host_backend.hpp"
#include "weft/pipeline/step_rule.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::pipeline {
namespace detail {

EngineCore::EngineCore(Schedule schedule, ThreadMap threads, std::unique_ptr<Backend> backend,
                       EngineOptions options)
    : schedule_(std::move(schedule)),
      threads_(threads.assign(schedule_)),
      backend_(std::move(backend)),
      options_(options) {
  WEFT_CHECK(backend_ != nullptr, "engine: no backend");
  backend_->bind(schedule_);
  max_lookahead_ = schedule_.max_lookahead();
  in_flight_ = static_cast<std::uint32_t>(schedule_.in_flight());
  const auto num_tasks = static_cast<TaskId>(schedule_.num_tasks());

  plans_.resize(num_tasks);
  for (TaskId t = 0; t < num_tasks; ++t) {
    TaskPlan& plan = plans_[t];
    plan.id = t;
    plan.stream = schedule_.stream_of(t);
    plan.lookahead = schedule_.task(t).lookahead();
    plan.collective = schedule_.task(t).is_collective();
  }
  for (const WaitEdge& w : wait_edges(schedule_, threads_)) {
    TaskPlan& plan = plans_[w.consumer];
    const bool future_record =
        w.rule == WaitRule::kSameProgressSync && w.host_wait && w.stream_wait &&
        schedule_.edges()[static_cast<std::size_t>(w.edge_index)].side == SyncSide::kGpu &&
        backend_->waits_for_future_records();
    if (future_record) {
      plan.stream_waits.push_back({w.producer, w.batch_offset, true});
      plans_[w.producer].records_event = true;
      plans_[w.producer].has_future_waiters = true;
      continue;
    }
    if (w.host_wait) {
      const bool known = std::any_of(plan.host_waits.begin(), plan.host_waits.end(),
                                     [&](const auto& h) { return h.producer == w.producer; });
      if (!known) plan.host_waits.push_back({w.producer, w.rule});
      if (w.rule == WaitRule::kStreamOrder) plan.stream_order_waits.push_back({w.producer, w.rule});
    }
    if (w.stream_wait) {
      plan.stream_waits.push_back({w.producer, w.batch_offset});
      plans_[w.producer].records_event = true;
    }
  }
  for (StreamId s = 0; s < schedule_.num_streams(); ++s) {
    stream_handles_.push_back(backend_->stream_handle(s));
  }

  ring_.reserve(in_flight_);
  for (std::uint32_t i = 0; i < in_flight_; ++i) ring_.emplace_back(schedule_);
  result_ = Batch(schedule_);
  const auto num_la = static_cast<std::size_t>(max_lookahead_) + 1;
  active_by_la_.assign(num_la, 0);
  batch_by_la_.assign(num_la, -1);
  ring_slot_by_la_.assign(num_la, 0);
  ticket_of_task_.assign(num_tasks, -1);
  num_records_.assign(num_tasks * in_flight_, 0);
  awaited_record_.assign(num_tasks, 0);
  done_ = std::make_unique<Signal[]>(num_tasks);
  tallies_by_task_.resize(num_tasks);
  num_collective_runs_.assign(num_tasks, 0);
  progress_by_thread_ = std::make_unique<ThreadProgress[]>(threads_.num_threads());

  tracing_ = options_.trace;
  WEFT_CHECK(!std::isnan(options_.stall_report_s) && options_.stall_report_s >= 0,
             "EngineOptions::stall_report_s must be a number >= 0 (0 = off), got ",
             options_.stall_report_s);
  double spin_us = options_.spin_us;
  WEFT_CHECK(!std::isnan(spin_us) && spin_us <= 1e6,
             "EngineOptions::spin_us must be a number <= 1e6 (negative = automatic), got ", spin_us);
  if (spin_us < 0) {
    spin_us = usable_cpus() > threads_.num_threads() ? 20.0 : 0.0;
  }
  spin_ns_ = static_cast<std::int64_t>(spin_us * 1000.0);
  origin_ = std::chrono::steady_clock::now();
  spans_by_thread_.resize(threads_.num_threads());
  waits_by_thread_.resize(threads_.num_threads());
  backend_->set_gpu_spans(tracing_);

  call_start_ = std::chrono::steady_clock::now();
  if (threads_.sequential) {
    if (options_.stall_report_s > 0 && std::isfinite(options_.stall_report_s)) {
      watchdog_ = std::make_unique<StallWatchdog>(options_.stall_report_s,
                                                  [this](double s) { report_stall(s); });
    }
    backend_->on_thread_start();
    run_inits(0);
  } else {
    start_workers();
    if (aborted_.load()) throw_failure();  // an init failed; workers_ joins on unwinding
  }
}

EngineCore::~EngineCore() {
  try {
    backend_->synchronize();
  } catch (const std::exception&) {
    // Errors of work nobody waits for any more are dropped, as in reset().
  }
}

void EngineCore::run_inits(std::uint32_t thread) {
  for (TaskId t : threads_.tasks_of_thread[thread]) {
    const Task& task = schedule_.task(t);
    if (!task.init()) continue;
    TaskContext context(this, t, nullptr, -1, -1, thread);
    task.init()(context);
  }
}

void EngineCore::fail(std::exception_ptr error) noexcept {
  {
    std::lock_guard lock(error_mutex_);
    if (!first_error_) first_error_ = std::move(error);
  }
  aborted_.store(true, std::memory_order_seq_cst);
  // Change every value a thread may be blocked on, so that it wakes and sees aborted_.
  for (std::size_t t = 0; t < schedule_.num_tasks(); ++t) {
    done_[t].value.fetch_add(1, std::memory_order_acq_rel);
    wake_all(done_[t]);
  }
  ticket_.value.fetch_add(1, std::memory_order_acq_rel);
  wake_all(ticket_);
}

void EngineCore::throw_failure() const {
  std::exception_ptr error;
  {
    std::lock_guard lock(const_cast<std::mutex&>(error_mutex_));
    error = first_error_;
  }
  if (error) std::rethrow_exception(error);
  WEFT_FAIL("engine: aborted without an error");
}

void EngineCore::wait_value(Signal& signal, std::uint32_t target) {
  std::uint32_t v = signal.value.load(std::memory_order_acquire);
  while (v != target) {
    if (aborted_.load(std::memory_order_acquire)) throw AbortSignal{};
    wait_for_change(signal, v, spin_ns_);
    v = signal.value.load(std::memory_order_acquire);
  }
}

void EngineCore::wait_done(const TaskPlan::HostWait& wait, std::uint32_t epoch, TaskId consumer,
                           std::uint32_t thread) {
  Signal& signal = done_[wait.producer];
  if (signal.value.load(std::memory_order_acquire) == epoch) return;
  ThreadProgress& progress = progress_by_thread_[thread];
  progress.set(progress.get().position, ThreadProgress::kTask, wait.producer);
  if (!tracing_) {
    wait_value(signal, epoch);
    return;
  }
  const double begin = now_us();
  wait_value(signal, epoch);
  waits_by_thread_[thread].push_back({.producer = wait.producer, .consumer = consumer,
                                      .rule = wait.rule, .iteration = iteration_,
                                      .begin_us = begin, .end_us = now_us()});
}

void EngineCore::mark_done(TaskId task, std::uint32_t epoch) noexcept {
  done_[task].value.store(epoch, std::memory_order_release);
  wake_all(done_[task]);
}

double EngineCore::now_us() const noexcept {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_)
      .count();
}

void EngineCore::run_task(const TaskPlan& plan, std::uint32_t thread, bool threaded) {
  const std::uint32_t epoch = epoch_;
  if (!active_by_la_[static_cast<std::size_t>(plan.lookahead)]) {
    if (!threaded) return;
    for (const TaskPlan::HostWait& w : plan.stream_order_waits) wait_done(w, epoch, plan.id, thread);
    mark_done(plan.id, epoch);
    return;
  }
  const int ticket = ticket_of_task_[plan.id];
  if (threaded) {
    if (aborted_.load(std::memory_order_acquire)) throw AbortSignal{};
    for (const TaskPlan::HostWait& w : plan.host_waits) wait_done(w, epoch, plan.id, thread);
    if (ticket >= 0) {
      const std::uint32_t target = ticket_base_ + static_cast<std::uint32_t>(ticket);
      ThreadProgress& progress = progress_by_thread_[thread];
      progress.set(progress.get().position, ThreadProgress::kTicket, target);
      wait_value(ticket_, target);
    }
    ThreadProgress& progress = progress_by_thread_[thread];
    progress.set(progress.get().position);
    if (aborted_.load(std::memory_order_acquire)) throw AbortSignal{};
  }
  const auto la = static_cast<std::size_t>(plan.lookahead);
  const std::int64_t batch = batch_by_la_[la];
  const std::uint32_t ring_slot = ring_slot_by_la_[la];
  for (const TaskPlan::StreamWait& w : plan.stream_waits) {
    const std::int64_t producer_batch = batch + w.batch_offset;
    if (producer_batch < 0 || producer_batch >= num_pulled_) continue;  // never ran on it
    const auto producer_slot = static_cast<std::uint32_t>(producer_batch % in_flight_);
    if (w.future_record) {
      backend_->wait_for_record(plan.stream, w.producer, producer_slot,
                                awaited_record_[w.producer]);
    } else {
      backend_->wait(plan.stream, w.producer, producer_slot);
    }
  }
  const Task& task = schedule_.task(plan.id);
  double begin_us = 0;
  std::uint64_t gpu_span = 0;
  if (tracing_) {
    begin_us = now_us();
    gpu_span = backend_->begin_gpu_span(plan.id, plan.stream, batch);
  }
  // Closes the run's spans; a failed run's end where its body threw, marked (take_trace()).
  auto end_spans = [&](bool failed) {
    backend_->end_gpu_span(gpu_span, plan.stream);
    spans_by_thread_[thread].push_back({.task = plan.id, .thread = thread, .batch = batch,
                                        .lookahead = plan.lookahead, .iteration = iteration_,
                                        .ticket = ticket, .begin_us = begin_us,
                                        .end_us = now_us(), .failed = failed});
  };
  if (plan.collective) ++num_collective_runs_[plan.id];
  try {
    if (task.body()) {
      TaskContext context(this, plan.id, &ring_[ring_slot], iteration_, ticket, thread, gpu_span);
      task.body()(context);
    }
    if (plan.records_event) {
      backend_->record(plan.id, ring_slot, plan.stream);
      ++num_records_[plan.id * in_flight_ + ring_slot];
    }
  } catch (...) {
    if (tracing_) {
      try {
        end_spans(true);
      } catch (...) {
        // The body's error is the one to report.
      }
    }
    throw;
  }
  if (tracing_) end_spans(false);
  if (threaded) {
    if (ticket >= 0) {
      ticket_.value.store(ticket_base_ + static_cast<std::uint32_t>(ticket) + 1,
                          std::memory_order_release);
      wake_all(ticket_);
    }
    mark_done(plan.id, epoch);
  }
}

void EngineCore::set_source(Source source) {
  WEFT_CHECK(source != nullptr, "engine: set_source() needs a callable source");
  WEFT_CHECK(failed_ || ended_ || num_pulled_ == num_returned_, "engine: set_source() while ",
             num_pulled_ - num_returned_,
             " batches of the current source are in flight (rule: no switch mid-flight; call "
             "progress() until it returns no step, or reset())");
  reset();
  source_ = std::move(source);
}

void EngineCore::reset() {
  // With no batch in flight, no value held but retired ones and no failure (e.g. a new source
  // after a clean end of data, which retired its values) there is no work to discard: the
  // streams are joined on the device instead of waited for, so that the caller's work queued
  // since (an optimizer step) overlaps the new source's first tasks on the host and still
  // precedes them on every stream. Retired values keep their fences and go when those complete.
  const auto holds = [](const Batch& b) {
    return std::any_of(b.values_.begin(), b.values_.end(),
                       [](const std::any& v) { return v.has_value(); });
  };
  const bool discards = failed_ || (!ended_ && num_pulled_ != num_returned_) ||
                        holds(result_) || std::any_of(ring_.begin(), ring_.end(), holds);
  if (!discards) {
    backend_->join_streams();
    release_retired();
  } else {
    try {
      backend_->synchronize();
    } catch (const std::exception&) {
      // Errors of discarded work are discarded with it (see Engine's error contract).
    }
    retired_.clear();
  }
  for (Batch& b : ring_) b.clear();
  result_.clear();
  iteration_ = 0;
  num_pulled_ = 0;
  num_returned_ = 0;
  exhausted_ = false;
  ended_ = false;
  failed_ = false;
  epoch_ = 0;
  ticket_base_ = 0;
  for (std::size_t t = 0; t < schedule_.num_tasks(); ++t) done_[t].value.store(0);
  ticket_.value.store(0);
  first_error_ = nullptr;
  aborted_.store(false);
}

void EngineCore::pull() {
  if (exhausted_) return;
  Batch& batch = ring_[static_cast<std::size_t>(iteration_ % in_flight_)];
  batch.clear();
  batch.index_ = iteration_;
  bool more = false;
  try {
    more = source_(batch);
  } catch (...) {
    failed_ = true;
    first_error_ = std::current_exception();
    throw;
  }
  if (more) {
    ++num_pulled_;
  } else {
    exhausted_ = true;
    batch.clear();
  }
}

void EngineCore::retire(Batch& batch, std::optional<std::uint64_t> fence) {
  const bool empty = std::none_of(batch.values_.begin(), batch.values_.end(),
                                  [](const std::any& v) { return v.has_value(); });
  if (empty) return;
  Retired retired{fence ? *fence : backend_->fence(), std::vector<std::any>(batch.values_.size())};
  std::swap(retired.values, batch.values_);
  retired_.push_back(std::move(retired));
}

void EngineCore::retire_all() {
  backend_->join_streams();
  const std::uint64_t fence = backend_->fence();  // one for every batch: nothing is queued between
  retire(result_, fence);
  for (Batch& b : ring_) retire(b, fence);
  release_retired();
}

void EngineCore::synchronize() {
  backend_->synchronize();
  release_retired();
}

void EngineCore::for_each_value(const std::function<void(const std::any&)>& visit) const {
  const auto visit_all = [&](const std::vector<std::any>& values) {
    for (const std::any& v : values) {
      if (v.has_value()) visit(v);
    }
  };
  for (const Batch& b : ring_) visit_all(b.values_);
  visit_all(result_.values_);
  for (const Retired& r : retired_) visit_all(r.values);
}

void EngineCore::release_retired() {
  while (!retired_.empty() && backend_->fence_completed(retired_.front().fence)) {
    retired_.pop_front();
  }
}

void EngineCore::prepare_iteration() {
  const StepRule rule(max_lookahead_);
  for (int la = 0; la <= max_lookahead_; ++la) {
    const auto k = static_cast<std::size_t>(la);
    const std::int64_t batch = rule.batch_at(la, iteration_);
    active_by_la_[k] = rule.runs(la, iteration_, num_pulled_) ? 1 : 0;
    batch_by_la_[k] = batch;
    ring_slot_by_la_[k] = batch >= 0 ? static_cast<std::uint32_t>(batch % in_flight_) : 0;
  }
  for (const TaskPlan& plan : plans_) {
    const auto la = static_cast<std::size_t>(plan.lookahead);
    if (!plan.has_future_waiters || !active_by_la_[la]) continue;
    awaited_record_[plan.id] = num_records_[plan.id * in_flight_ + ring_slot_by_la_[la]] + 1;
  }
  int next_ticket = 0;
  for (TaskId t : schedule_.collective_order()) {
    const bool active = active_by_la_[static_cast<std::size_t>(plans_[t].lookahead)] != 0;
    ticket_of_task_[t] = active ? next_ticket++ : -1;
  }
  if (++epoch_ == 0) epoch_ = 1;  // 0 is every done_ counter's value after reset()
  reported_iteration_.store(iteration_, std::memory_order_relaxed);
}

void EngineCore::run_iteration() {
  if (threads_.sequential) {
    backend_->on_thread_start();
    ThreadProgress& progress = progress_by_thread_[0];
    const std::vector<TaskId>& tasks = threads_.tasks_of_thread[0];  // the run order
    for (std::uint32_t i = 0; i < tasks.size(); ++i) {
      progress.set(i);
      try {
        run_task(plans_[tasks[i]], 0, false);
      } catch (...) {
        fail(std::current_exception());
        break;
      }
    }
    progress.set(static_cast<std::uint32_t>(tasks.size()));
  } else {
    remaining_.value.store(static_cast<std::uint32_t>(workers_.threads.size()),
                           std::memory_order_relaxed);
    go_.value.fetch_add(1, std::memory_order_release);
    wake_all(go_);
    wait_for_workers();
  }
  int num_tickets = 0;
  for (TaskId t : schedule_.collective_order()) num_tickets += ticket_of_task_[t] >= 0 ? 1 : 0;
  ticket_base_ += static_cast<std::uint32_t>(num_tickets);
  if (aborted_.load(std::memory_order_acquire)) {
    failed_ = true;
    make_awaited_records();
    throw_failure();
  }
}

void EngineCore::make_awaited_records() noexcept {
  for (const TaskPlan& plan : plans_) {
    const auto la = static_cast<std::size_t>(plan.lookahead);
    if (!plan.has_future_waiters || !active_by_la_[la]) continue;
    const std::size_t event = plan.id * in_flight_ + ring_slot_by_la_[la];
    if (num_records_[event] >= awaited_record_[plan.id]) continue;
    try {
      backend_->record(plan.id, ring_slot_by_la_[la], plan.stream);
      ++num_records_[event];
    } catch (const std::exception&) {
      // A backend that cannot record any more cannot run the stream work either.
    }
  }
}

std::optional<Step> EngineCore::progress() {
  WEFT_CHECK(source_ != nullptr, "engine: progress() before set_source()");
  if (failed_) {
    try {
      throw_failure();
    } catch (const std::exception& e) {
      WEFT_FAIL("engine: failed in an earlier progress() (", e.what(),
                "); call reset() or set_source() first");
    }
  }
  call_start_ = std::chrono::steady_clock::now();
  stall_reported_ = false;
  if (watchdog_) watchdog_->arm();
  struct Disarm {
    StallWatchdog* watchdog;
    ~Disarm() {
      if (watchdog) watchdog->disarm();
    }
  } disarm{watchdog_.get()};
  if (ended_) release_retired();  // a call after the end of data frees what has finished
  while (!ended_) {
    release_retired();
    pull();
    if (exhausted_ && (num_pulled_ == 0 || iteration_ >= num_pulled_ + max_lookahead_)) {
      try {
        retire_all();
      } catch (...) {  // the streams are not joined: the engine is failed, as after a body's error
        failed_ = true;
        first_error_ = std::current_exception();
        throw;
      }
      ended_ = true;
      break;
    }
    prepare_iteration();
    run_iteration();
    const bool finished = active_by_la_[0] != 0;
    const std::int64_t batch = batch_by_la_[0];
    ++iteration_;
    if (finished) {
      // The previous result's time with the caller is over; its values go once the streams are
      // done with them.
      retire(result_);
      Batch& done = ring_[static_cast<std::size_t>(batch % in_flight_)];
      std::swap(result_.values_, done.values_);
      result_.index_ = batch;
      ++num_returned_;
      return Step(&result_);
    }
  }
  return std::nullopt;
}

void EngineCore::record_collective(TaskId task, std::string_view kind, std::string_view stream,
                                   std::size_t num_bytes) {
  auto& tallies = tallies_by_task_[task];
  auto it = std::find_if(tallies.begin(), tallies.end(),
                         [&](const CollectiveTally& t) { return t.kind == kind && t.stream == stream; });
  if (it == tallies.end()) {
    tallies.push_back({std::string(kind), std::string(stream), 0, 0});
    it = std::prev(tallies.end());
  }
  it->total_bytes += static_cast<double>(num_bytes);
  ++it->num_calls;
}

std::vector<MeasuredCollective> EngineCore::collective_inventory() const {
  std::vector<MeasuredCollective> out;
  for (TaskId t : schedule_.run_order()) {
    const double num_runs = static_cast<double>(num_collective_runs_[t]);
    for (const CollectiveTally& tally : tallies_by_task_[t]) {
      out.push_back({schedule_.task(t).name(), tally.kind, tally.stream,
                     tally.total_bytes / static_cast<double>(tally.num_calls),
                     num_runs > 0 ? static_cast<double>(tally.num_calls) / num_runs : 0});
    }
  }
  return out;
}

Trace EngineCore::take_trace() {
  Trace trace;
  for (const Task& t : schedule_.tasks()) trace.task_names.push_back(t.name());
  trace.thread_names = threads_.thread_names;
  for (StreamId s = 0; s < schedule_.num_streams(); ++s) {
    trace.stream_names.push_back(schedule_.stream(s).name);
  }
  for (auto& spans : spans_by_thread_) {
    trace.host_spans.insert(trace.host_spans.end(), spans.begin(), spans.end());
    spans.clear();
  }
  std::sort(trace.host_spans.begin(), trace.host_spans.end(),
            [](const HostSpan& a, const HostSpan& b) { return a.begin_us < b.begin_us; });
  for (auto& waits : waits_by_thread_) {
    trace.waits.insert(trace.waits.end(), waits.begin(), waits.end());
    waits.clear();
  }
  const auto origin_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(origin_.time_since_epoch()).count();
  trace.gpu_spans = backend_->take_gpu_spans(origin_ns);
  for (GpuSpan& g : trace.gpu_spans) {
    g.failed = std::any_of(trace.host_spans.begin(), trace.host_spans.end(), [&](const HostSpan& h) {
      return h.failed && h.task == g.task && h.batch == g.batch;
    });
  }
  return trace;
}

}  // namespace detail

// Engine --------------------------------------------------------------------------------------

Engine::Engine(Schedule schedule, ThreadMap threads, std::unique_ptr<Backend> backend,
               EngineOptions options)
    : core_(std::make_unique<detail::EngineCore>(std::move(schedule), std::move(threads),
                                                 std::move(backend), options)) {}

Engine::Engine(Schedule schedule, ThreadMap threads, EngineOptions options)
    : Engine(std::move(schedule), std::move(threads), std::make_unique<HostBackend>(), options) {}

Engine::~Engine() = default;

void Engine::set_source(Source source) { core_->set_source(std::move(source)); }
std::optional<Step> Engine::progress() { return core_->progress(); }
void Engine::reset() { core_->reset(); }
void Engine::synchronize() { core_->synchronize(); }
const CompiledSchedule& Engine::schedule() const noexcept { return core_->schedule(); }
const ThreadAssignment& Engine::threads() const noexcept { return core_->threads(); }
Backend& Engine::backend() noexcept { return core_->backend(); }
bool Engine::failed() const noexcept { return core_->failed(); }
std::int64_t Engine::num_in_flight() const noexcept { return core_->num_in_flight(); }
Trace Engine::take_trace() { return core_->take_trace(); }

std::vector<MeasuredCollective> Engine::collective_inventory() const {
  return core_->collective_inventory();
}

void Engine::for_each_value(const std::function<void(const std::any&)>& visit) const {
  core_->for_each_value(visit);
}

}  // namespace weft::pipeline
