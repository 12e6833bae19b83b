// Planner calibration from a measured run: the cost of every task taken from a real run's trace,
// so `weft plan --costs` predicts the variants a user has not run (docs/hstu.md).
//
//   Trace trace = engine.take_trace();                       // a traced run, CUDA backend
//   plan::CostModel costs = cost_model_from_trace(trace);
//   std::string json = costs.to_json();                      // weft plan --costs costs.json
#pragma once

#include <string_view>

#include "weft/pipeline/trace.hpp"
#include "weft/plan/cost_model.hpp"

namespace weft::hstu {

// plan::trace_costs with the spans themselves (GpuCost::kSpan: per task, host_us the median of
// its host spans, per stream the median of its GPU spans) and the first `skip_fraction` of each
// task's runs (prefill, warm-up) left out; every GPU figure then times gpu_scale. Tasks that
// never ran are left out (default_host_us 0).
// gpu_scale corrects for what tracing itself costs the GPU: each traced task records two timing
// events, and each event between two kernels costs the stream microseconds; pass the measured
// untraced step time over the traced one (gpu_period_us), or 1.
plan::CostModel cost_model_from_trace(const pipeline::Trace& trace, double skip_fraction = 0.25,
                                      double gpu_scale = 1.0);

// The median time between the ends of consecutive GPU spans of `task` after skip_fraction: the
// traced run's step time, for a task that runs once per step. 0 with fewer than two spans.
double gpu_period_us(const pipeline::Trace& trace, std::string_view task,
                     double skip_fraction = 0.25);

}  // namespace weft::hstu
