#include "weft/plan/simulated_variant.hpp"

#include <utility>

namespace weft::plan {

std::string describe_thread_map(const pipeline::ThreadMap& map,
                                const pipeline::ThreadAssignment& threads) {
  using Kind = pipeline::ThreadMap::Kind;
  if (threads.sequential) return "- (legacy, one thread)";
  const std::string count = " (" + std::to_string(threads.num_threads()) + ")";
  if (map.kind() == Kind::kByStream) return "by_stream" + count;
  if (map.kind() == Kind::kPerTask) return "per_task" + count;
  std::string text;
  for (const auto& name : threads.thread_names) text += (text.empty() ? "" : " / ") + name;
  return text + count;
}

VariantReport simulate_variant(std::string name, std::string cascade,
                               const pipeline::CompiledSchedule& schedule,
                               const pipeline::ThreadMap& map, const CostModel& costs,
                               const SimulationOptions& options) {
  const auto threads = map.assign(schedule);
  VariantReport report;
  report.name = std::move(name);
  report.cascade = std::move(cascade);
  report.thread_map = describe_thread_map(map, threads);
  report.source = "simulated";
  report.placement = placement(schedule, threads);
  report.timeline = simulate(schedule, threads, costs, options);
  return report;
}

void add_collective_inventory(const pipeline::CompiledSchedule& schedule, ReportOptions& options) {
  for (const auto& task : schedule.tasks()) {
    for (const auto& op : task.collectives()) {
      options.collectives[task.name()].push_back(
          {op.kind, op.stream, double(op.num_bytes), op.count, ""});
    }
  }
}

}  // namespace weft::plan
