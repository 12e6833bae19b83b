#include "weft/plan/simulate.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "weft/core/error.hpp"
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

struct GpuRecord {
  std::string task;
  std::string stream;
  double start_us;
  double end_us;
};

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

Timeline simulate(const CompiledSchedule& schedule, const ThreadAssignment& threads,
                  const CostModel& costs, const SimulationOptions& options) {
  WEFT_CHECK(options.num_progress >= 4, "simulate needs at least 4 progress() calls, got ",
             options.num_progress);
  WEFT_CHECK(options.max_host_runahead >= 1, "max_host_runahead must be >= 1, got ",
             options.max_host_runahead);
  WEFT_CHECK(options.thread_wake_up_us >= 0 && options.thread_wake_up_us <= CostModel::kMaxCostUs,
             "thread_wake_up_us must be in [0, 1e9], got ", options.thread_wake_up_us);
  costs.check_against(schedule);
  const std::size_t num_tasks = schedule.num_tasks();
  const std::size_t num_threads = threads.num_threads();

  std::vector<TaskCost> cost(num_tasks);
  for (TaskId t = 0; t < num_tasks; ++t) cost[t] = costs.cost_of(schedule.task(t).name());
  std::vector<bool> holds_gil(num_tasks, false);
  for (const auto& name : options.gil_tasks) {
    const auto id = schedule.find_task(name);
    WEFT_CHECK(id.has_value(), "gil_tasks: the schedule has no task '", name, "'");
    holds_gil[*id] = true;
  }
  const bool any_gil = !options.gil_tasks.empty();

  // Host-wait edges into each consumer, and stream-wait edges into each consumer.
  const auto edges = pipeline::wait_edges(schedule, threads);
  std::vector<std::vector<const pipeline::WaitEdge*>> host_in(num_tasks), stream_in(num_tasks);
  for (const auto& e : edges) {
    if (e.host_wait) host_in[e.consumer].push_back(&e);
    if (e.stream_wait) stream_in[e.consumer].push_back(&e);
  }
  // pipeline::describe() names producer, consumer and rule first; the planner keeps those in
  // their own fields, and the rest (slot or edge kind, lookaheads, threads, streams) as the cause.
  auto edge_cause = [&](const pipeline::WaitEdge& e) {
    std::string text = pipeline::describe(e, schedule, threads);
    const auto bracket = text.find("] ");
    return bracket == std::string::npos ? text : text.substr(bracket + 2);
  };
  // Ticket predecessor of each collective task (previous collective in run order).
  std::vector<int> ticket_prev(num_tasks, -1);
  std::vector<int> ticket_of(num_tasks, -1);
  {
    const auto order = schedule.collective_order();
    for (std::size_t i = 0; i < order.size(); ++i) {
      ticket_of[order[i]] = int(i);
      if (i > 0) ticket_prev[order[i]] = int(order[i - 1]);
    }
  }

  const int num_progress = options.num_progress;
  const int drawn = num_progress - 2;
  std::vector<std::vector<double>> host_start(num_progress), host_end(num_progress),
      gpu_end(num_progress);
  std::vector<double> progress_begin(num_progress), progress_end(num_progress);
  std::vector<double> gpu_done(num_progress, 0);  // all GPU work of a progress finished
  std::map<std::string, double> stream_free;
  std::vector<GpuRecord> gpu_records;
  std::vector<int> gpu_record_progress;
  Timeline timeline;
  timeline.threads = threads.thread_names;

  double clock = 0;
  for (int p = 0; p < num_progress; ++p) {
    double begin = clock;
    if (p >= options.max_host_runahead) begin = std::max(begin, gpu_done[p - options.max_host_runahead]);
    progress_begin[p] = begin;
    auto& start = host_start[p];
    auto& end = host_end[p];
    start.assign(num_tasks, kUnknown);
    end.assign(num_tasks, kUnknown);

    std::vector<double> thread_ready(num_threads, begin);
    std::vector<std::size_t> next(num_threads, 0);
    double gil_free = begin;  // the previous progress's bodies have all returned
    std::size_t num_placed = 0;
    struct Start {
      double at;         // when the task starts
      double deps_done;  // when its host-wait producers were done (before its ticket)
    };
    // When the next task of thread th can start, or nothing while a producer has not run yet.
    auto next_start = [&](std::size_t th) -> std::optional<Start> {
      if (next[th] == threads.tasks_of_thread[th].size()) return std::nullopt;
      const TaskId t = threads.tasks_of_thread[th][next[th]];
      double at = thread_ready[th];
      for (const auto* e : host_in[t]) {
        if (end[e->producer] == kUnknown) return std::nullopt;
        at = std::max(at, end[e->producer]);
      }
      const int prev = ticket_prev[t];
      if (prev >= 0 && end[std::size_t(prev)] == kUnknown) return std::nullopt;
      const double deps_done = at;
      if (prev >= 0) at = std::max(at, end[std::size_t(prev)]);
      if (holds_gil[t]) at = std::max(at, gil_free);
      // Producers on this thread ended by thread_ready: a later start blocked on another.
      if (at > thread_ready[th]) at += options.thread_wake_up_us;
      return Start{at, deps_done};
    };
    auto place = [&](std::size_t th, const Start& s) {
      const TaskId t = threads.tasks_of_thread[th][next[th]];
      const int prev = ticket_prev[t];
      if (p == drawn) {
        for (const auto* e : host_in[t]) {
          if (threads.thread_of_task[e->producer] == th) continue;
          // Stream order between a pair already joined by a data or sync edge adds nothing.
          if (e->rule == pipeline::WaitRule::kStreamOrder &&
              std::any_of(host_in[t].begin(), host_in[t].end(), [&](const auto* other) {
                return other->producer == e->producer &&
                       other->rule != pipeline::WaitRule::kStreamOrder;
              })) {
            continue;
          }
          timeline.waits.push_back(
              {schedule.task(e->producer).name(), schedule.task(t).name(),
               threads.thread_names[threads.thread_of_task[e->producer]],
               threads.thread_names[th], plan_rule(*e, schedule), end[e->producer] - begin,
               std::max(0.0, end[e->producer] - thread_ready[th]), edge_cause(*e)});
        }
        if (prev >= 0 && threads.thread_of_task[std::size_t(prev)] != th &&
            end[std::size_t(prev)] > s.deps_done) {
          timeline.waits.push_back(
              {schedule.task(std::size_t(prev)).name(), schedule.task(t).name(),
               threads.thread_names[threads.thread_of_task[std::size_t(prev)]],
               threads.thread_names[th], WaitRule::kTicket, end[std::size_t(prev)] - begin,
               end[std::size_t(prev)] - s.deps_done,
               "collective ticket " + std::to_string(ticket_of[t]) + " after ticket " +
                   std::to_string(ticket_of[std::size_t(prev)])});
        }
      }
      start[t] = s.at;
      end[t] = s.at + cost[t].host_us;
      if (holds_gil[t]) gil_free = end[t];
      thread_ready[th] = end[t];
      ++next[th];
      ++num_placed;
    };
    while (num_placed < num_tasks) {
      bool advanced = false;
      if (!any_gil) {
        // Without a shared lock a start depends on its thread and producers only: each thread
        // runs ahead as far as its producers allow.
        for (std::size_t th = 0; th < num_threads; ++th) {
          while (const auto s = next_start(th)) {
            place(th, *s);
            advanced = true;
          }
        }
      } else {
        // The GIL goes to the task that can start first (ties: the lower thread), so tasks are
        // placed in time order.
        std::size_t first = num_threads;
        std::optional<Start> first_start;
        for (std::size_t th = 0; th < num_threads; ++th) {
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
      if (!advanced) {
        std::string stuck;
        for (std::size_t th = 0; th < num_threads; ++th) {
          if (next[th] < threads.tasks_of_thread[th].size()) {
            stuck += " " + threads.thread_names[th] + ":" +
                     schedule.task(threads.tasks_of_thread[th][next[th]]).name();
          }
        }
        WEFT_FAIL("the schedule deadlocks under this thread map: every thread waits (", stuck,
                  " ) on a task that runs later on another thread or on a collective ticket");
      }
    }
    progress_end[p] = *std::max_element(end.begin(), end.end());
    clock = progress_end[p];

    // GPU: tasks enqueue in the order their bodies finished.
    std::vector<TaskId> order(num_tasks);
    std::iota(order.begin(), order.end(), TaskId{0});
    std::stable_sort(order.begin(), order.end(), [&](TaskId a, TaskId b) {
      return end[a] != end[b] ? end[a] < end[b]
                              : schedule.run_position(a) < schedule.run_position(b);
    });
    gpu_end[p].assign(num_tasks, 0);
    double done = progress_end[p];
    for (TaskId t : order) {
      const std::string& own = schedule.stream(schedule.stream_of(t)).name;
      double base = end[t];
      for (const auto* e : stream_in[t]) {
        const int q = p - e->progress_distance;
        if (q >= 0) base = std::max(base, gpu_end[q][e->producer]);
      }
      base = std::max(base, stream_free[own]);
      double last = base;
      for (const auto& seg : cost[t].gpu) {
        const double seg_start = std::max(last, stream_free[seg.stream]);
        const double seg_end = seg_start + seg.us;
        stream_free[seg.stream] = seg_end;
        if (seg.us > 0) {
          gpu_records.push_back({schedule.task(t).name(), seg.stream, seg_start, seg_end});
          gpu_record_progress.push_back(p);
        }
        last = seg_end;
      }
      stream_free[own] = std::max(stream_free[own], last);  // side streams join back
      gpu_end[p][t] = last;
      done = std::max(done, last);
    }
    gpu_done[p] = done;
  }

  // Steady state: the period of GPU completion over the second half of the run.
  const int k = num_progress / 2;
  timeline.step_us = (gpu_done[num_progress - 1] - gpu_done[num_progress - 1 - k]) / k;
  const double origin = progress_begin[drawn];
  timeline.host_step_us = progress_end[drawn] - origin;

  for (TaskId t : schedule.run_order()) {
    timeline.host.push_back({schedule.task(t).name(),
                             threads.thread_names[threads.thread_of_task[t]],
                             host_start[drawn][t] - origin, host_end[drawn][t] - origin, drawn,
                             ticket_of[t]});
  }
  // GPU activity during one step starting with the drawn progress, whatever progress enqueued it.
  const double window = std::max(timeline.step_us, timeline.host_step_us);
  std::set<std::string> streams_seen;
  for (std::size_t i = 0; i < gpu_records.size(); ++i) {
    const auto& r = gpu_records[i];
    const double s = std::max(r.start_us, origin), e = std::min(r.end_us, origin + window);
    if (e <= s) continue;
    timeline.gpu.push_back({r.task, r.stream, s - origin, e - origin});
    streams_seen.insert(r.stream);
  }
  for (std::size_t s = 0; s < schedule.num_streams(); ++s) {
    const auto& name = schedule.stream(pipeline::StreamId(s)).name;
    if (streams_seen.erase(name)) timeline.streams.push_back(name);
  }
  for (const auto& name : streams_seen) timeline.streams.push_back(name);
  return timeline;
}

}  // namespace weft::plan
