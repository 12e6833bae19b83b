// Planner calibration from a measured run: the cost of every task taken from a real run's trace,
// so `weft plan --costs` predicts the variants a user has not run (docs/hstu.md).
//
//   Trace trace = engine.take_trace();                       // a traced run, CUDA backend
//   plan::CostModel costs = cost_model_from_trace(trace);
//   std::string json = costs.to_json();                      // weft plan --costs costs.json
#pragma once

#include "weft/pipeline/trace.hpp"
#include "weft/plan/cost_model.hpp"

namespace weft::hstu {

// Per task: host_us = median of its host spans; one GPU segment on its own stream whose length is
// the median of its GPU spans. The first `skip_fraction` of the spans (prefill, warm-up) are
// ignored. Tasks that never ran are left out (the model's default applies).
plan::CostModel cost_model_from_trace(const pipeline::Trace& trace, double skip_fraction = 0.25);

}  // namespace weft::hstu
