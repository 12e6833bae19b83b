#include "weft/plan/simulate.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "stream_model.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/step_rule.hpp"
#include "weft/pipeline/wait_edges.hpp"

namespace weft::plan {
namespace {

using pipeline::CompiledSchedule;
using pipeline::TaskId;
using pipeline::ThreadAssignment;

constexpr double kUnknown = -1;

WaitRule plan_rule(const pipeline::WaitEdge& edge, const CompiledSchedule& schedule) {
  switch (edge.rule) {
    case pipeline::WaitRule::kSameProgressSync:
      switch (schedule.edges()[std::size_t(edge.edge_index)].side) {
        case pipeline::SyncSide::kCpu: return WaitRule::kSyncCpu;
        case pipeline::SyncSide::kGpu: return WaitRule::kSyncGpu;
        case pipeline::SyncSide::kBoth: return WaitRule::kSyncBoth;
      }
      break;
    case pipeline::WaitRule::kStreamOrder: return WaitRule::kStreamOrder;
    default: break;
  }
  return WaitRule::kSameLookahead;
}

// When the next task of a thread can start.
struct Start {
  double at;          // when the task starts its host work
  double deps_done;   // when its host-wait producers were done (before its ticket)
  double gpu_wait_from;  // when it began to wait for a producer's GPU work (at, where it did not)
};

// One simulation: for each progress() in turn, the task bodies placed on their threads (the host
// pass), then the GPU work they enqueue handed to the stream model (the GPU pass), which runs it
// as far as a later host pass needs (max_host_runahead) and to the end after the last.
class Simulator {
 public:
  Simulator(const CompiledSchedule& schedule, const ThreadAssignment& threads,
            const CostModel& costs, const SimulationOptions& options);

  Timeline run();

 private:
  void run_host(int p);
  void run_settled(int p);
  int gpu_wait_progress(int p, TaskId t) const;
  long long gpu_wait_job(int p, TaskId t) const;
  std::optional<Start> next_start(std::size_t th) const;
  void place(std::size_t th, const Start& s);
  void record_waits(std::size_t th, TaskId t, const Start& s);
  [[noreturn]] void fail_deadlocked() const;
  void enqueue_gpu(int p);
  double gpu_done(int p);
  void draw(Timeline& timeline) const;
  void draw_source(Timeline& timeline) const;
  std::vector<std::string> drawn_streams(std::set<std::string> seen) const;
  std::string edge_cause(const pipeline::WaitEdge& e) const;
  // Whether task t works on a batch at progress (iteration) p: always in steady state.
  bool active(int p, TaskId t) const {
    return !finite_ || rule_.runs(schedule_.task(t).lookahead(), p, options_.num_batches);
  }
  bool drawn(int p) const { return finite_ || p == drawn_; }

  const CompiledSchedule& schedule_;
  const ThreadAssignment& threads_;
  const SimulationOptions& options_;
  const std::size_t num_tasks_;
  const std::size_t num_threads_;
  const bool finite_;  // one source of options.num_batches batches, every iteration drawn
  const pipeline::StepRule rule_;  // which task works on which batch at which iteration
  const int num_progress_;
  const int drawn_;  // the progress() the timeline draws (steady state)
  std::vector<TaskCost> cost_;
  std::vector<bool> holds_gil_;
  bool any_gil_ = false;
  // Per task, the producer whose GPU work its body waits for (waits_for_gpu_of; -1: none), and
  // in the progress being placed, the end of that work (0 until known).
  std::vector<long long> gpu_wait_of_;
  std::vector<double> gpu_wait_end_;
  bool any_gpu_wait_ = false;
  std::vector<pipeline::WaitEdge> edges_;
  // Host-wait edges into each consumer, and stream-wait edges into each consumer.
  std::vector<std::vector<const pipeline::WaitEdge*>> host_in_, stream_in_;
  // Per progress, each active collective task's ticket (-1: none), and its ticket predecessor
  // in the progress being placed (the previous active collective in collective order).
  std::vector<std::vector<int>> ticket_of_;
  std::vector<int> ticket_prev_;

  // Per progress: when each task's body started and ended.
  std::vector<std::vector<double>> host_start_, host_end_;
  std::vector<double> progress_begin_, progress_end_;
  // The GPU work: per progress, each active task's job in the stream model (-1: none yet) and
  // the first of the progress's jobs; each job's task.
  detail::StreamModel gpu_;
  std::vector<std::vector<long long>> job_of_;
  std::vector<std::size_t> first_job_;
  std::vector<TaskId> task_of_job_;
  std::vector<double> gpu_done_;  // per progress, all its GPU work finished (after the run)
  std::vector<WaitEdge> waits_;  // of the drawn progress

  // The host pass of progress p_, which began at begin_.
  int p_ = 0;
  double begin_ = 0;
  std::vector<double> thread_ready_;
  std::vector<std::size_t> next_;
  double gil_free_ = 0;  // the previous progress's bodies have all returned
  std::size_t num_placed_ = 0;
};

Simulator::Simulator(const CompiledSchedule& schedule, const ThreadAssignment& threads,
                     const CostModel& costs, const SimulationOptions& options)
    : schedule_(schedule),
      threads_(threads),
      options_(options),
      num_tasks_(schedule.num_tasks()),
      num_threads_(threads.num_threads()),
      finite_(options.num_batches > 0),
      rule_(schedule.max_lookahead()),
      num_progress_(finite_ ? int(rule_.num_iterations(options.num_batches))
                            : options.num_progress),
      drawn_(options.num_progress - 2),
      gpu_(options.slowed_stream, options.overlap_slowdown) {
  WEFT_CHECK(options.num_batches >= 0 && options.num_batches <= 1'000'000,
             "num_batches must be in [0, 1000000], got ", options.num_batches);
  WEFT_CHECK(finite_ || options.num_progress >= 4,
             "simulate needs at least 4 progress() calls, got ", options.num_progress);
  WEFT_CHECK(options.max_host_runahead >= 1, "max_host_runahead must be >= 1, got ",
             options.max_host_runahead);
  WEFT_CHECK(options.thread_wake_up_us >= 0 && options.thread_wake_up_us <= CostModel::kMaxCostUs,
             "thread_wake_up_us must be in [0, 1e9], got ", options.thread_wake_up_us);
  costs.check_against(schedule);
  WEFT_CHECK(options.slowed_stream.empty() || schedule.find_stream(options.slowed_stream),
             "overlap slowdown: the schedule has no stream '", options.slowed_stream, "'");

  cost_.resize(num_tasks_);
  for (TaskId t = 0; t < num_tasks_; ++t) cost_[t] = costs.placed_cost_of(schedule.task(t));
  holds_gil_.assign(num_tasks_, false);
  for (const auto& name : options.gil_tasks) {
    const auto id = schedule.find_task(name);
    WEFT_CHECK(id.has_value(), "gil_tasks: the schedule has no task '", name, "'");
    holds_gil_[*id] = true;
  }
  any_gil_ = !options.gil_tasks.empty();
  const std::string endless = endless_gpu_wait(schedule, threads, costs);
  WEFT_CHECK(endless.empty(), endless);
  gpu_wait_of_.assign(num_tasks_, -1);
  for (TaskId t = 0; t < num_tasks_; ++t) {
    const std::string& producer = cost_[t].waits_for_gpu_of;
    if (producer.empty()) continue;
    gpu_wait_of_[t] = (long long)*schedule.find_task(producer);  // check_against: it is a task
    any_gpu_wait_ = true;
  }

  edges_ = pipeline::wait_edges(schedule, threads);
  host_in_.resize(num_tasks_);
  stream_in_.resize(num_tasks_);
  for (const auto& e : edges_) {
    if (e.host_wait) host_in_[e.consumer].push_back(&e);
    if (e.stream_wait) stream_in_[e.consumer].push_back(&e);
  }
  ticket_of_.resize(std::size_t(num_progress_));
  host_start_.resize(std::size_t(num_progress_));
  host_end_.resize(std::size_t(num_progress_));
  progress_begin_.resize(std::size_t(num_progress_));
  progress_end_.resize(std::size_t(num_progress_));
  job_of_.resize(std::size_t(num_progress_));
  first_job_.assign(std::size_t(num_progress_) + 1, 0);
}

Timeline Simulator::run() {
  for (int p = 0; p < num_progress_; ++p) {
    if (any_gpu_wait_) {
      run_settled(p);
    } else {
      run_host(p);
      enqueue_gpu(p);
    }
  }
  gpu_.run_until_done(0, task_of_job_.size());
  for (int p = 0; p < num_progress_; ++p) gpu_done_.push_back(gpu_done(p));
  Timeline timeline;
  timeline.threads = threads_.thread_names;
  draw(timeline);
  return timeline;
}

// pipeline::describe() names producer, consumer and rule first; the planner keeps those in
// their own fields, and the rest (slot or edge kind, lookaheads, threads, streams) as the cause.
std::string Simulator::edge_cause(const pipeline::WaitEdge& e) const {
  std::string text = pipeline::describe(e, schedule_, threads_);
  const auto bracket = text.find("] ");
  return bracket == std::string::npos ? text : text.substr(bracket + 2);
}

// The host pass of progress p: places every task's body on its thread, after its producers,
// its collective ticket and (a GIL task) the GIL, no earlier than max_host_runahead progresses
// after the GPU work of an earlier one finished.
void Simulator::run_host(int p) {
  double begin = p == 0 ? 0 : progress_end_[p - 1];
  // A source's iterations are not paced: nothing reads a result between them.
  if (!finite_ && p >= options_.max_host_runahead) {
    begin = std::max(begin, gpu_done(p - options_.max_host_runahead));
  }
  progress_begin_[p] = begin;
  host_start_[p].assign(num_tasks_, kUnknown);
  host_end_[p].assign(num_tasks_, kUnknown);
  p_ = p;
  begin_ = begin;
  auto& tickets = ticket_of_[std::size_t(p)];
  tickets.assign(num_tasks_, -1);
  ticket_prev_.assign(num_tasks_, -1);
  int previous = -1, num_tickets = 0;
  for (TaskId t : schedule_.collective_order()) {
    if (!active(p, t)) continue;
    tickets[t] = num_tickets++;
    ticket_prev_[t] = previous;
    previous = int(t);
  }
  thread_ready_.assign(num_threads_, begin);
  next_.assign(num_threads_, 0);
  gil_free_ = begin;
  num_placed_ = 0;
  while (num_placed_ < num_tasks_) {
    bool advanced = false;
    if (!any_gil_) {
      // Without a shared lock a start depends on its thread and producers only: each thread
      // runs ahead as far as its producers allow.
      for (std::size_t th = 0; th < num_threads_; ++th) {
        while (const auto s = next_start(th)) {
          place(th, *s);
          advanced = true;
        }
      }
    } else {
      // The GIL goes to the task that can start first (ties: the lower thread), so tasks are
      // placed in time order.
      std::size_t first = num_threads_;
      std::optional<Start> first_start;
      for (std::size_t th = 0; th < num_threads_; ++th) {
        const auto s = next_start(th);
        if (s && (!first_start || s->at < first_start->at)) {
          first = th;
          first_start = s;
        }
      }
      if (first_start) {
        place(first, *first_start);
        advanced = true;
      }
    }
    if (!advanced) fail_deadlocked();
  }
  const auto& end = host_end_[p];
  progress_end_[p] = *std::max_element(end.begin(), end.end());
}

// Progress p where bodies wait for GPU work: placed with the waits' ends known so far (none at
// first), its GPU work enqueued, the ends read; until the ends read are the ends placed with,
// the GPU model, the jobs and the drawn waits go back to before p and p is placed again with
// the ends read. Where those alternate (a later start of the waiting body can end its
// producer's work earlier: less overlap under an overlap slowdown, or another order on a
// stream), the largest end found is kept after kExactRounds placements, which settles: the ends
// then only grow, and none can grow past the body it waits in (endless_gpu_wait refused those).
// The ends read run the model no further than the bodies that waited, and every later job is
// enqueued after them. Each placement copies the stream model: a source of many batches with a
// wait in every iteration takes time quadratic in its length.
void Simulator::run_settled(int p) {
  gpu_wait_end_.assign(num_tasks_, 0);
  bool waits = false;
  for (TaskId t = 0; t < num_tasks_; ++t) waits = waits || gpu_wait_progress(p, t) >= 0;
  if (!waits) {
    run_host(p);
    enqueue_gpu(p);
    return;
  }
  const detail::StreamModel gpu_before = gpu_;
  const std::size_t num_jobs = task_of_job_.size(), num_waits = waits_.size();
  constexpr int kExactRounds = 8;
  const int max_rounds = kExactRounds + 4 * int(num_tasks_) + 8;
  for (int round = 1;; ++round) {
    run_host(p);
    enqueue_gpu(p);
    bool settled = true;
    for (TaskId t = 0; t < num_tasks_; ++t) {
      const long long job = gpu_wait_job(p, t);
      if (job < 0) continue;
      gpu_.run_until_done(std::size_t(job), std::size_t(job) + 1);
      const double end = gpu_.job_end(std::size_t(job));
      if (end > gpu_wait_end_[t] || (end < gpu_wait_end_[t] && round <= kExactRounds)) {
        gpu_wait_end_[t] = end;
        settled = false;
      }
    }
    if (settled) return;
    WEFT_CHECK(round < max_rounds, "internal: the GPU waits of progress ", p,
               " did not settle in ", max_rounds, " placements");
    gpu_ = gpu_before;
    task_of_job_.resize(num_jobs);
    waits_.resize(num_waits);
  }
}

// The progress in which task t's GPU wait in progress p has its producer run on t's batch (a
// task of lookahead k works on batch p - (L - k) at progress p). -1 where there is none: t waits
// for nothing or has no batch at p, or the producer has no run on that batch.
int Simulator::gpu_wait_progress(int p, TaskId t) const {
  if (gpu_wait_of_[t] < 0 || !active(p, t)) return -1;
  const auto producer = std::size_t(gpu_wait_of_[t]);
  const int q = p - (schedule_.task(producer).lookahead() - schedule_.task(t).lookahead());
  return q >= 0 && active(q, producer) ? q : -1;
}

// The stream model's job that task t's GPU wait in progress p is for (-1: none).
long long Simulator::gpu_wait_job(int p, TaskId t) const {
  const int q = gpu_wait_progress(p, t);
  return q < 0 ? -1 : job_of_[std::size_t(q)][std::size_t(gpu_wait_of_[t])];
}

// When the next task of thread th can start, or nothing while a producer has not run yet.
std::optional<Start> Simulator::next_start(std::size_t th) const {
  const auto& end = host_end_[p_];
  if (next_[th] == threads_.tasks_of_thread[th].size()) return std::nullopt;
  const TaskId t = threads_.tasks_of_thread[th][next_[th]];
  const bool on = active(p_, t);
  double at = thread_ready_[th];
  for (const auto* e : host_in_[t]) {
    // A task without a batch here waits for its stream-order producers only (the engine's skip).
    if (!on && e->rule != pipeline::WaitRule::kStreamOrder) continue;
    if (end[e->producer] == kUnknown) return std::nullopt;
    at = std::max(at, end[e->producer]);
  }
  const int prev = ticket_prev_[t];
  if (prev >= 0 && end[std::size_t(prev)] == kUnknown) return std::nullopt;
  const double deps_done = at;
  if (prev >= 0) at = std::max(at, end[std::size_t(prev)]);
  // Producers on this thread ended by thread_ready: a later start blocked on another.
  bool blocked = at > thread_ready_[th];
  double gpu_wait_from = at;
  if (on && gpu_wait_of_[t] >= 0) {
    // Woken from its host wait, the body spins on the GPU work (no wake-up of its own), without
    // the GIL, which it takes after.
    if (blocked) gpu_wait_from = at += options_.thread_wake_up_us;
    blocked = false;
    at = std::max(at, gpu_wait_end_[t]);
  }
  if (on && holds_gil_[t] && gil_free_ > at) {
    at = gil_free_;
    blocked = true;
  }
  if (blocked) at += options_.thread_wake_up_us;
  return Start{at, deps_done, gpu_wait_from};
}

void Simulator::place(std::size_t th, const Start& s) {
  const TaskId t = threads_.tasks_of_thread[th][next_[th]];
  const bool on = active(p_, t);
  if (on && drawn(p_)) record_waits(th, t, s);
  auto& start = host_start_[p_];
  auto& end = host_end_[p_];
  start[t] = s.at;
  end[t] = s.at + (on ? cost_[t].host_us : 0.0);
  if (on && holds_gil_[t]) gil_free_ = end[t];
  thread_ready_[th] = end[t];
  ++next_[th];
  ++num_placed_;
}

// The cross-thread waits of task t (drawn progress): its host-wait producers on other threads,
// and its collective ticket where that held it back.
void Simulator::record_waits(std::size_t th, TaskId t, const Start& s) {
  const auto& end = host_end_[p_];
  const int prev = ticket_prev_[t];
  const double origin = finite_ ? 0.0 : begin_;  // a source is drawn from its start
  for (const auto* e : host_in_[t]) {
    if (threads_.thread_of_task[e->producer] == th) continue;
    // Stream order between a pair already joined by a data or sync edge adds nothing.
    if (e->rule == pipeline::WaitRule::kStreamOrder &&
        std::any_of(host_in_[t].begin(), host_in_[t].end(), [&](const auto* other) {
          return other->producer == e->producer &&
                 other->rule != pipeline::WaitRule::kStreamOrder;
        })) {
      continue;
    }
    waits_.push_back(
        {schedule_.task(e->producer).name(), schedule_.task(t).name(),
         threads_.thread_names[threads_.thread_of_task[e->producer]],
         threads_.thread_names[th], plan_rule(*e, schedule_), end[e->producer] - origin,
         std::max(0.0, end[e->producer] - thread_ready_[th]), edge_cause(*e)});
  }
  if (prev >= 0 && threads_.thread_of_task[std::size_t(prev)] != th &&
      end[std::size_t(prev)] > s.deps_done) {
    waits_.push_back(
        {schedule_.task(std::size_t(prev)).name(), schedule_.task(t).name(),
         threads_.thread_names[threads_.thread_of_task[std::size_t(prev)]],
         threads_.thread_names[th], WaitRule::kTicket, end[std::size_t(prev)] - origin,
         end[std::size_t(prev)] - s.deps_done,
         "collective ticket " + std::to_string(ticket_of_[std::size_t(p_)][t]) +
             " after ticket " + std::to_string(ticket_of_[std::size_t(p_)][std::size_t(prev)])});
  }
  if (gpu_wait_of_[t] >= 0 && gpu_wait_end_[t] > s.gpu_wait_from) {
    const auto producer = std::size_t(gpu_wait_of_[t]);
    waits_.push_back({schedule_.task(producer).name(), schedule_.task(t).name(),
                      "stream " + schedule_.stream(schedule_.stream_of(producer)).name,
                      threads_.thread_names[th], WaitRule::kGpuWait, gpu_wait_end_[t] - origin,
                      gpu_wait_end_[t] - s.gpu_wait_from,
                      "the body waits for the GPU work of its batch's " +
                          schedule_.task(producer).name() + " (waits_for_gpu_of)"});
  }
}

void Simulator::fail_deadlocked() const {
  std::string stuck;
  for (std::size_t th = 0; th < num_threads_; ++th) {
    if (next_[th] < threads_.tasks_of_thread[th].size()) {
      stuck += " " + threads_.thread_names[th] + ":" +
               schedule_.task(threads_.tasks_of_thread[th][next_[th]]).name();
    }
  }
  WEFT_FAIL("the schedule deadlocks under this thread map: every thread waits (", stuck,
            " ) on a task that runs later on another thread or on a collective ticket");
}

// The GPU pass of progress p: tasks enqueue in the order their bodies finished, each after the
// GPU work of its stream-wait producers (of the producer's batch).
void Simulator::enqueue_gpu(int p) {
  const auto& end = host_end_[p];
  std::vector<TaskId> order(num_tasks_);
  std::iota(order.begin(), order.end(), TaskId{0});
  std::stable_sort(order.begin(), order.end(), [&](TaskId a, TaskId b) {
    return end[a] != end[b] ? end[a] < end[b]
                            : schedule_.run_position(a) < schedule_.run_position(b);
  });
  auto& jobs = job_of_[std::size_t(p)];
  jobs.assign(num_tasks_, -1);
  first_job_[std::size_t(p)] = task_of_job_.size();
  std::vector<std::size_t> after;
  for (TaskId t : order) {
    if (!active(p, t)) continue;
    after.clear();
    for (const auto* e : stream_in_[t]) {
      const int q = p - e->progress_distance;  // the progress of the producer's batch
      if (q < 0) continue;
      const long long producer = job_of_[std::size_t(q)][e->producer];
      if (producer >= 0) after.push_back(std::size_t(producer));
    }
    jobs[t] = (long long)gpu_.add_job(end[t], schedule_.stream(schedule_.stream_of(t)).name,
                                      cost_[t].gpu, after);
    task_of_job_.push_back(t);
  }
  first_job_[std::size_t(p) + 1] = task_of_job_.size();
}

// When all GPU work of progress p has finished (and its host pass: a progress without GPU work
// is done when its bodies are).
double Simulator::gpu_done(int p) {
  const std::size_t first = first_job_[std::size_t(p)], end = first_job_[std::size_t(p) + 1];
  gpu_.run_until_done(first, end);
  double done = progress_end_[p];
  for (std::size_t j = first; j < end; ++j) done = std::max(done, gpu_.job_end(j));
  return done;
}

// The timeline of the drawn progress: its steady-state step, host spans and waits, and the GPU
// activity of one step from its start.
void Simulator::draw(Timeline& timeline) const {
  if (finite_) {
    draw_source(timeline);
    return;
  }
  // Steady state: the period of GPU completion over the second half of the run.
  const int k = num_progress_ / 2;
  timeline.step_us = (gpu_done_[num_progress_ - 1] - gpu_done_[num_progress_ - 1 - k]) / k;
  const double origin = progress_begin_[drawn_];
  timeline.host_step_us = progress_end_[drawn_] - origin;
  timeline.waits = waits_;

  for (TaskId t : schedule_.run_order()) {
    timeline.host.push_back({schedule_.task(t).name(),
                             threads_.thread_names[threads_.thread_of_task[t]],
                             host_start_[drawn_][t] - origin, host_end_[drawn_][t] - origin,
                             drawn_, ticket_of_[std::size_t(drawn_)][t]});
  }
  // GPU activity during one step starting with the drawn progress, whatever progress enqueued it.
  const double window = std::max(timeline.step_us, timeline.host_step_us);
  std::set<std::string> streams_seen;
  for (const auto& r : gpu_.segment_runs()) {
    const double s = std::max(r.start_us, origin), e = std::min(r.end_us, origin + window);
    if (e <= s) continue;
    timeline.gpu.push_back({schedule_.task(task_of_job_[r.job]).name(), r.stream, s - origin,
                            e - origin});
    streams_seen.insert(r.stream);
  }
  timeline.streams = drawn_streams(std::move(streams_seen));
}

// The streams that have GPU spans: the schedule's in its order, then the others (side streams).
std::vector<std::string> Simulator::drawn_streams(std::set<std::string> seen) const {
  std::vector<std::string> streams;
  for (std::size_t s = 0; s < schedule_.num_streams(); ++s) {
    const auto& name = schedule_.stream(pipeline::StreamId(s)).name;
    if (seen.erase(name)) streams.push_back(name);
  }
  streams.insert(streams.end(), seen.begin(), seen.end());
  return streams;
}

// The timeline of a finite source: its time (to the end of its last GPU work), every task run of
// every iteration with the batch it worked on, every GPU segment, every wait.
void Simulator::draw_source(Timeline& timeline) const {
  timeline.step_us = *std::max_element(gpu_done_.begin(), gpu_done_.end());
  timeline.host_step_us = progress_end_.back();
  timeline.waits = waits_;
  for (int p = 0; p < num_progress_; ++p) {
    for (TaskId t : schedule_.run_order()) {
      if (!active(p, t)) continue;
      timeline.host.push_back({schedule_.task(t).name(),
                               threads_.thread_names[threads_.thread_of_task[t]],
                               host_start_[std::size_t(p)][t], host_end_[std::size_t(p)][t],
                               rule_.batch_at(schedule_.task(t).lookahead(), p),
                               ticket_of_[std::size_t(p)][t]});
    }
  }
  std::set<std::string> streams_seen;
  for (const auto& r : gpu_.segment_runs()) {
    timeline.gpu.push_back(
        {schedule_.task(task_of_job_[r.job]).name(), r.stream, r.start_us, r.end_us});
    streams_seen.insert(r.stream);
  }
  timeline.streams = drawn_streams(std::move(streams_seen));
}

}  // namespace

std::vector<TaskPlacement> placement(const CompiledSchedule& schedule,
                                     const ThreadAssignment& threads) {
  std::vector<TaskPlacement> result;
  for (TaskId t : schedule.run_order()) {
    const auto& task = schedule.task(t);
    result.push_back({task.name(), schedule.stream(schedule.stream_of(t)).name,
                      threads.thread_names.at(threads.thread_of_task.at(t)), task.lookahead(),
                      task.is_collective()});
  }
  return result;
}

std::string endless_gpu_wait(const CompiledSchedule& schedule, const ThreadAssignment& threads,
                             const CostModel& costs) {
  const std::size_t n = schedule.num_tasks();
  bool any = false;
  for (TaskId t = 0; t < n && !any; ++t) {
    any = !costs.cost_of(schedule.task(t).name()).waits_for_gpu_of.empty();
  }
  if (!any) return {};  // the common case: no graph to build
  // What must end before what within one progress(): run order on a thread, the host waits, the
  // collective tickets (every task active: the steady state, a source's fullest iteration).
  std::vector<std::vector<TaskId>> next(n);
  for (const auto& tasks : threads.tasks_of_thread) {
    for (std::size_t i = 1; i < tasks.size(); ++i) next[tasks[i - 1]].push_back(tasks[i]);
  }
  for (const auto& e : pipeline::wait_edges(schedule, threads)) {
    if (e.host_wait) next[e.producer].push_back(e.consumer);
  }
  const auto collectives = schedule.collective_order();
  for (std::size_t i = 1; i < collectives.size(); ++i) {
    next[collectives[i - 1]].push_back(collectives[i]);
  }
  for (TaskId t = 0; t < n; ++t) {
    const auto& task = schedule.task(t);
    const std::string& name = costs.cost_of(task.name()).waits_for_gpu_of;
    if (name.empty()) continue;
    const auto producer = schedule.find_task(name);
    if (!producer) continue;  // CostModel::check_against names it
    const int la = schedule.task(*producer).lookahead();
    if (la < task.lookahead()) {
      return "task '" + task.name() + "' (lookahead " + std::to_string(task.lookahead()) +
             ") waits for the GPU work of '" + name + "' (lookahead " + std::to_string(la) +
             "), which works on its batch later: the wait would never end";
    }
    if (la > task.lookahead()) continue;  // its batch's run is in an earlier progress()
    std::vector<bool> seen(n, false);
    std::vector<TaskId> todo{t};
    seen[t] = true;
    while (!todo.empty()) {
      const TaskId u = todo.back();
      todo.pop_back();
      for (const TaskId v : next[u]) {
        if (v == *producer) {
          return "task '" + task.name() + "' waits for the GPU work of '" + name +
                 "', whose body runs after it in the same progress() (after it on its thread, "
                 "or waiting for it through host waits or collective tickets) under this "
                 "thread map: the wait would never end";
        }
        if (!seen[v]) {
          seen[v] = true;
          todo.push_back(v);
        }
      }
    }
  }
  return {};
}

Timeline simulate(const CompiledSchedule& schedule, const ThreadAssignment& threads,
                  const CostModel& costs, const SimulationOptions& options) {
  return Simulator(schedule, threads, costs, options).run();
}

}  // namespace weft::plan
