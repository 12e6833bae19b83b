// weft::plan::trace_costs: the cost model an engine trace of a real run measures, the one
// reading of a trace into costs (`weft plan --suggest --trace`, weft.plan.trace_costs and
// weft::hstu's calibration all use it). docs/planner.md "Costs from a trace" says what each
// figure means:
//  - a task's host_us: the median of its host spans (its body's wall time on its thread); for a
//    task named in TraceCostOptions::gpu_waits, of each span's part after the end of its
//    producer's GPU spans of the same batch where that end falls inside the span (the wait left
//    out), and the cost says waits_for_gpu_of that producer;
//  - a GPU segment per stream the task ran on, in stream order: the median over its runs there
//    of their busy time (GpuCost::kBusy), end - max(begin, the latest release inside
//    (begin, end]), a release being the end of something the run waited for: the previous span
//    on its stream, its producers' spans in the schedule (slot readers and depends_on: the same
//    batch; cross_iter_depends_on: the batch at its offset; same_progress_sync on the GPU side:
//    the producer's run in the same progress() call), and for a collective run (its host span
//    holds a ticket) the spans of every collective run enqueued before it; or of the spans
//    themselves (GpuCost::kSpan).
// Failed GPU spans are left out; the median of an even count is the mean of the middle two.
//
//   CostModel costs = trace_costs(engine.take_trace(), &schedule);
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/trace.hpp"
#include "weft/plan/cost_model.hpp"

namespace weft::plan {

enum class GpuCost { kBusy, kSpan };

// Accepts "busy" and "span"; throws weft::Error otherwise.
GpuCost parse_gpu_cost(std::string_view text);

struct TraceCostOptions {
  GpuCost gpu = GpuCost::kBusy;
  // The first fraction of each task's runs (by begin) left out of its medians: warm-up. The
  // busy times are computed over every span first. In [0, 1).
  double skip_fraction = 0;
  // Task -> the task whose GPU work of the same batch its body waits for (e.g. a count its
  // kernel writes): both tasks of the trace, not the same.
  std::map<std::string, std::string, std::less<>> gpu_waits;
};

// The costs `trace` measures. `schedule` (may be null: then only stream order and the collective
// order are releases) names the producers of each task; every task it has must be in the trace.
// The result lists every task with a host span, default_host_us 0. Throws weft::Error for a
// schedule task or producer the trace lacks, a span naming a task or stream the trace does not,
// a skip_fraction outside [0, 1), or a gpu_waits entry naming a task the trace lacks or a task
// waiting for itself. The same trace, in any order, gives the same costs.
CostModel trace_costs(const pipeline::Trace& trace, const pipeline::Schedule* schedule,
                      const TraceCostOptions& options = {});

}  // namespace weft::plan
