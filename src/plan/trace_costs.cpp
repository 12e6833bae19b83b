#include "weft/plan/trace_costs.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using pipeline::GpuSpan;
using pipeline::HostSpan;
using pipeline::TaskId;
using pipeline::Trace;

// A run of a task: (task, batch).
using Run = std::pair<TaskId, std::int64_t>;

// A GPU edge into a consumer: its producer's run is at the consumer's batch + offset, or (same
// progress) the producer's run in the consumer's progress() call.
struct ProducerEdge {
  TaskId producer;
  std::int64_t offset;
  bool same_progress;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// The median of `values` (in run order) after the first skip_fraction of them.
double median_after(std::vector<double> values, double skip_fraction) {
  const auto skip = std::size_t(double(values.size()) * skip_fraction);
  values.erase(values.begin(), values.begin() + std::ptrdiff_t(skip));
  return median(std::move(values));
}

TaskId index_of(const Trace& trace, const std::string& task, const char* what) {
  const auto it = std::find(trace.task_names.begin(), trace.task_names.end(), task);
  if (it == trace.task_names.end()) {
    std::string names;
    for (const auto& n : trace.task_names) names += (names.empty() ? "" : ", ") + n;
    WEFT_FAIL("trace_costs: ", what, " '", task, "' is not a task of the trace (", names, ")");
  }
  return TaskId(it - trace.task_names.begin());
}

// Per consumer task, the edges whose producer's GPU work it waits for.
std::vector<std::vector<ProducerEdge>> producer_edges(const Trace& trace,
                                                      const pipeline::Schedule& schedule) {
  std::map<std::string, std::string, std::less<>> writer;
  for (const auto& t : schedule.tasks()) {
    for (const auto& slot : t.writes()) writer[slot] = t.name();
  }
  std::vector<std::vector<ProducerEdge>> out(trace.task_names.size());
  for (const auto& t : schedule.tasks()) {
    auto& edges = out[index_of(trace, t.name(), "schedule task")];
    auto add = [&](const std::string& producer, std::int64_t offset, bool same_progress) {
      edges.push_back({index_of(trace, producer, "producer"), offset, same_progress});
    };
    for (const auto& slot : t.reads()) {
      const auto w = writer.find(slot);
      if (w != writer.end()) add(w->second, 0, false);
    }
    for (const auto& p : t.depends_on()) add(p, 0, false);
    for (const auto& e : t.cross_iter_depends_on()) add(e.producer, e.offset, false);
    for (const auto& e : t.same_progress_sync()) {
      if (e.side != pipeline::SyncSide::kCpu) add(e.producer, 0, true);
    }
  }
  return out;
}

// The collective runs in enqueue order: the ticket order makes the host spans of collective runs
// disjoint, so their begin order is the enqueue order.
class CollectiveOrder {
 public:
  CollectiveOrder(const Trace& trace, const std::vector<const GpuSpan*>& gpu) {
    std::vector<std::tuple<double, std::int64_t, int, TaskId, std::int64_t>> runs;
    for (const auto& s : trace.host_spans) {
      if (s.ticket < 0 || s.failed) continue;
      runs.emplace_back(s.begin_us, s.iteration, s.ticket, s.task, s.batch);
    }
    std::sort(runs.begin(), runs.end());
    for (std::size_t k = 0; k < runs.size(); ++k) {
      position_[{std::get<3>(runs[k]), std::get<4>(runs[k])}] = k;
    }
    for (const GpuSpan* s : gpu) {
      const auto it = position_.find({s->task, s->batch});
      if (it != position_.end()) ends_.emplace_back(s->end_us, it->second);
    }
    std::sort(ends_.begin(), ends_.end());
  }

  // The latest end inside `span`'s (begin, end] of a collective run enqueued before the span's
  // run; none for a span of a run that is not collective, or where there is none.
  std::optional<double> latest_release(const GpuSpan& span) const {
    const auto it = position_.find({span.task, span.batch});
    if (it == position_.end()) return std::nullopt;
    auto i = std::upper_bound(ends_.begin(), ends_.end(),
                              std::pair{span.end_us, std::numeric_limits<std::size_t>::max()});
    while (i != ends_.begin() && std::prev(i)->first > span.begin_us) {
      --i;
      if (i->second < it->second) return i->first;
    }
    return std::nullopt;
  }

 private:
  std::map<Run, std::size_t> position_;
  std::vector<std::pair<double, std::size_t>> ends_;  // (end, enqueue position), by end
};

// The busy time of every span of `gpu` (sorted by begin), by its index there.
std::vector<double> busy_us(const Trace& trace, const std::vector<const GpuSpan*>& gpu,
                            const pipeline::Schedule* schedule) {
  std::map<Run, std::vector<double>> ends_of;
  for (const GpuSpan* s : gpu) ends_of[{s->task, s->batch}].push_back(s->end_us);
  const auto producers = schedule != nullptr
                             ? producer_edges(trace, *schedule)
                             : std::vector<std::vector<ProducerEdge>>(trace.task_names.size());
  std::map<Run, std::int64_t> iteration_of;                   // (task, batch) -> progress()
  std::map<std::pair<TaskId, std::int64_t>, std::int64_t> batch_of;  // (task, progress) -> batch
  for (const auto& h : trace.host_spans) {
    iteration_of[{h.task, h.batch}] = h.iteration;
    batch_of[{h.task, h.iteration}] = h.batch;
  }
  const CollectiveOrder collectives(trace, gpu);
  std::map<std::uint32_t, double> previous_end;  // stream -> end of its previous span
  std::vector<double> out(gpu.size());
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    const GpuSpan& s = *gpu[i];
    double start = s.begin_us;  // the latest release inside (begin, end], or begin
    auto release = [&](double r) {
      if (r > s.begin_us && r <= s.end_us) start = std::max(start, r);
    };
    if (const auto r = collectives.latest_release(s)) release(*r);
    const auto previous = previous_end.find(s.stream);
    if (previous != previous_end.end()) release(previous->second);
    previous_end[s.stream] = s.end_us;
    for (const ProducerEdge& e : producers[s.task]) {
      std::optional<std::int64_t> batch = s.batch + e.offset;
      if (e.same_progress) {
        batch.reset();
        const auto iteration = iteration_of.find({s.task, s.batch});
        if (iteration != iteration_of.end()) {
          const auto b = batch_of.find({e.producer, iteration->second});
          if (b != batch_of.end()) batch = b->second;
        }
      }
      if (!batch) continue;
      const auto ends = ends_of.find({e.producer, *batch});
      if (ends == ends_of.end()) continue;
      for (double r : ends->second) release(r);
    }
    out[i] = s.end_us - start;
  }
  return out;
}

}  // namespace

GpuCost parse_gpu_cost(std::string_view text) {
  if (text == "busy") return GpuCost::kBusy;
  if (text == "span") return GpuCost::kSpan;
  WEFT_FAIL("trace_costs: gpu is one of ('busy', 'span'), got '", text, "'");
}

CostModel trace_costs(const Trace& trace, const pipeline::Schedule* schedule,
                      const TraceCostOptions& options) {
  WEFT_CHECK(options.skip_fraction >= 0 && options.skip_fraction < 1,
             "trace_costs: skip_fraction must be in [0, 1), got ", options.skip_fraction);
  const std::size_t num_tasks = trace.task_names.size();
  const std::size_t num_streams = trace.stream_names.size();
  for (const auto& s : trace.host_spans) {
    WEFT_CHECK(s.task < num_tasks, "trace_costs: a host span names task ", s.task, " of ",
               num_tasks);
  }
  std::vector<const GpuSpan*> gpu;
  for (const auto& s : trace.gpu_spans) {
    WEFT_CHECK(s.task < num_tasks && s.stream < num_streams, "trace_costs: a GPU span names task ",
               s.task, " of ", num_tasks, " and stream ", s.stream, " of ", num_streams);
    if (!s.failed) gpu.push_back(&s);
  }
  // A total order, so that the same spans in any order give the same costs.
  std::sort(gpu.begin(), gpu.end(), [](const GpuSpan* a, const GpuSpan* b) {
    return std::tie(a->begin_us, a->end_us, a->stream, a->task, a->batch) <
           std::tie(b->begin_us, b->end_us, b->stream, b->task, b->batch);
  });
  std::vector<double> figure(gpu.size());
  if (options.gpu == GpuCost::kBusy) {
    figure = busy_us(trace, gpu, schedule);
  } else {
    for (std::size_t i = 0; i < gpu.size(); ++i) figure[i] = gpu[i]->end_us - gpu[i]->begin_us;
  }
  std::vector<const HostSpan*> host;
  for (const auto& s : trace.host_spans) host.push_back(&s);
  std::stable_sort(host.begin(), host.end(), [](const HostSpan* a, const HostSpan* b) {
    return std::tie(a->begin_us, a->end_us) < std::tie(b->begin_us, b->end_us);
  });
  // A waiting task's spans count from the end of its producer's GPU work of their batch.
  std::vector<std::optional<TaskId>> waits_for(num_tasks);
  for (const auto& [task, producer] : options.gpu_waits) {
    const TaskId t = index_of(trace, task, "gpu_waits task");
    const TaskId p = index_of(trace, producer, "gpu_waits producer");
    WEFT_CHECK(t != p, "trace_costs: gpu_waits: '", task, "' waits for its own GPU work");
    waits_for[t] = p;
  }
  std::map<Run, double> gpu_end;  // (task, batch) -> the end of its last GPU span
  for (const GpuSpan* g : gpu) {
    double& end = gpu_end.try_emplace({g->task, g->batch}, g->end_us).first->second;
    end = std::max(end, g->end_us);
  }
  std::vector<std::vector<double>> host_us(num_tasks);
  for (const HostSpan* s : host) {
    double begin = s->begin_us;
    if (const auto& p = waits_for[s->task]) {
      const auto end = gpu_end.find({*p, s->batch});
      // A producer's end outside the span: the body did not wait for it (or for all of it).
      if (end != gpu_end.end() && end->second > s->begin_us && end->second <= s->end_us) {
        begin = end->second;
      }
    }
    host_us[s->task].push_back(s->end_us - begin);
  }
  std::vector<std::vector<std::vector<double>>> gpu_us(
      num_tasks, std::vector<std::vector<double>>(num_streams));
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    gpu_us[gpu[i]->task][gpu[i]->stream].push_back(figure[i]);
  }

  CostModel model;
  model.default_host_us = 0;
  for (std::size_t t = 0; t < num_tasks; ++t) {
    if (host_us[t].empty()) continue;
    TaskCost cost{.host_us = median_after(host_us[t], options.skip_fraction), .gpu = {},
                  .waits_for_gpu_of = waits_for[t] ? trace.task_names[*waits_for[t]] : ""};
    for (std::size_t st = 0; st < num_streams; ++st) {
      if (gpu_us[t][st].empty()) continue;
      cost.gpu.push_back(
          {trace.stream_names[st], median_after(gpu_us[t][st], options.skip_fraction)});
    }
    model.tasks[trace.task_names[t]] = std::move(cost);
  }
  return model;
}

}  // namespace weft::plan
