#include "weft/hstu/calibration.hpp"

#include <algorithm>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/plan/trace_costs.hpp"

namespace weft::hstu {
namespace {

double median_after(std::vector<double> values, double skip_fraction) {
  const auto skip = std::size_t(double(values.size()) * skip_fraction);
  values.erase(values.begin(), values.begin() + std::ptrdiff_t(skip));
  if (values.empty()) return 0;
  std::nth_element(values.begin(), values.begin() + std::ptrdiff_t(values.size() / 2), values.end());
  return values[values.size() / 2];
}

}  // namespace

plan::CostModel cost_model_from_trace(const pipeline::Trace& trace, double skip_fraction,
                                      double gpu_scale) {
  WEFT_CHECK(skip_fraction >= 0 && skip_fraction < 1, "calibration: skip_fraction ", skip_fraction);
  WEFT_CHECK(gpu_scale > 0, "calibration: gpu_scale ", gpu_scale, " must be positive");
  plan::CostModel model = plan::trace_costs(
      trace, nullptr, {.gpu = plan::GpuCost::kSpan, .skip_fraction = skip_fraction});
  for (auto& [task, cost] : model.tasks) {
    for (auto& segment : cost.gpu) segment.us *= gpu_scale;
  }
  return model;
}

double gpu_period_us(const pipeline::Trace& trace, std::string_view task, double skip_fraction) {
  WEFT_CHECK(skip_fraction >= 0 && skip_fraction < 1, "calibration: skip_fraction ", skip_fraction);
  std::vector<double> ends;
  for (const auto& span : trace.gpu_spans) {
    if (trace.task_names.at(span.task) == task) ends.push_back(span.end_us);
  }
  std::sort(ends.begin(), ends.end());
  std::vector<double> periods;
  for (std::size_t i = 1; i < ends.size(); ++i) periods.push_back(ends[i] - ends[i - 1]);
  return periods.empty() ? 0 : median_after(std::move(periods), skip_fraction);
}

}  // namespace weft::hstu
