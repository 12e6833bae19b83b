#include "search_space.hpp"

#include "weft/core/error.hpp"

namespace weft::plan::detail {

using pipeline::CompiledSchedule;
using pipeline::TaskId;

std::size_t mul_sat(std::size_t a, std::size_t b) {
  return (a != 0 && b > kHuge / a) ? kHuge : a * b;
}
std::size_t add_sat(std::size_t a, std::size_t b) { return std::min(kHuge, a + b); }

std::size_t num_partitions(std::size_t n, std::size_t k) {
  std::vector<std::size_t> s(k + 1, 0);  // S(i, j) for the current i
  s[0] = 1;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = std::min(i, k); j >= 1; --j) s[j] = add_sat(mul_sat(j, s[j]), s[j - 1]);
    s[0] = 0;
  }
  std::size_t total = 0;
  for (std::size_t j = 1; j <= k; ++j) total = add_sat(total, s[j]);
  return total;
}

std::vector<std::string> stream_choices(const pipeline::Task& task) {
  std::vector<std::string> choices{task.stream()};
  choices.insert(choices.end(), task.movable_to().begin(), task.movable_to().end());
  return choices;
}

SearchSpace search_space(const CompiledSchedule& schedule, const CostModel& costs,
                         const SuggestOptions& options) {
  const std::size_t n = schedule.num_tasks();
  WEFT_CHECK(n >= 1, "suggest: the schedule has no task to place");
  WEFT_CHECK(options.max_threads >= 1 && options.max_threads <= 64,
             "suggest: max_threads must be in [1, 64], got ", options.max_threads);
  WEFT_CHECK(options.min_lookahead >= 0 && options.min_lookahead <= pipeline::kMaxLookahead,
             "suggest: min_lookahead must be in [0, ", pipeline::kMaxLookahead, "], got ",
             options.min_lookahead);
  const int lo = options.min_lookahead;
  const int hi =
      options.max_lookahead < 0 ? std::max(lo, schedule.max_lookahead()) : options.max_lookahead;
  WEFT_CHECK(hi >= lo && hi <= pipeline::kMaxLookahead, "suggest: max_lookahead must be in [", lo,
             " (min_lookahead), ", pipeline::kMaxLookahead, "], got ", hi);
  WEFT_CHECK(options.num_best >= 1, "suggest: num_best must be >= 1, got ", options.num_best);
  costs.check_against(schedule);
  const std::size_t k = std::min<std::size_t>(std::size_t(options.max_threads), n);
  const std::size_t num_maps = num_partitions(n, k);
  std::size_t num_lookaheads = 1;
  for (std::size_t t = 0; t < n; ++t)
    num_lookaheads = mul_sat(num_lookaheads, std::size_t(hi - lo + 1));
  SearchSpace space{n, k, lo, hi, num_maps, num_lookaheads, {}, 1, {}, 0};
  for (TaskId t = 0; t < n; ++t) {
    const auto choices = stream_choices(schedule.task(t));
    space.num_stream_choices.push_back(choices.size());
    space.num_stream_assignments = mul_sat(space.num_stream_assignments, choices.size());
    if (choices.size() == 1) {
      ++space.num_fixed_stream_tasks;
      continue;
    }
    std::string streams;
    for (const auto& s : choices) streams += (streams.empty() ? "" : ", ") + s;
    space.movable_tasks +=
        (space.movable_tasks.empty() ? "" : ", ") + schedule.task(t).name() + " (" + streams + ")";
  }
  WEFT_CHECK(space.num_points() > 1, "suggest: the search cannot move this schedule: ",
             n == 1 ? "it has one task" : "max_threads is 1",
             " and every lookahead is fixed by the bounds [", lo, ", ", hi,
             "] and no task is declared movable_to another stream (widen the lookahead bounds",
             n == 1 ? ")" : " or allow more threads)");
  return space;
}

}  // namespace weft::plan::detail
