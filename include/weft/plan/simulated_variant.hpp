// A report's variant simulated from a schedule and a thread map, described as `weft plan` draws
// it, and the collective inventory the report lists for a schedule. Shared by the `weft plan`
// command and the Python package, so that both write the same page.
//
//   const pipeline::CompiledSchedule compiled(hstu::hstu_schedule({.cascade = kD6}));
//   VariantReport v = simulate_variant("full_split_d6", "d6", compiled,
//                                      pipeline::ThreadMap::preset("full_split"),
//                                      CostModel::hstu_defaults());
#pragma once

#include <string>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/simulate.hpp"

namespace weft::plan {

// "- (legacy, one thread)", "by_stream (5)", "per_task (14)" or the thread names joined by " / "
// with their count, e.g. "io / data_dist / prefetch / compute (4)".
std::string describe_thread_map(const pipeline::ThreadMap& map,
                                const pipeline::ThreadAssignment& threads);

// Simulates `schedule` under `map` (source "simulated"); `costs` is used as given (the caller
// checks it against the schedule where it should).
VariantReport simulate_variant(std::string name, std::string cascade,
                               const pipeline::CompiledSchedule& schedule,
                               const pipeline::ThreadMap& map, const CostModel& costs,
                               const SimulationOptions& options = {});

// Appends every collective the schedule's tasks declare to options.collectives.
void add_collective_inventory(const pipeline::CompiledSchedule& schedule, ReportOptions& options);

}  // namespace weft::plan
