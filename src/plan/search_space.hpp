// The space weft::plan::suggest searches (suggest.cpp): thread maps as set partitions of the
// tasks, every task's lookahead within bounds, and the streams of the tasks the schedule declares
// movable_to; how many points each dimension has, and the enumerations of each in a fixed order
// (so that the search is deterministic).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/plan/cost_model.hpp"
#include "weft/plan/suggest.hpp"

namespace weft::plan::detail {

// A task's thread in a candidate map (canonical labels 0, 1, ...; 255 marks a new thread while a
// move is tried). Wider than a byte: ordered containers of byte vectors compare through memcmp,
// which some compilers' bounds analysis misreads (-Wstringop-overread) at -O3.
using ThreadLabel = std::uint16_t;

// Saturating arithmetic for the size of the space (Bell numbers overflow quickly).
constexpr std::size_t kHuge = std::size_t(1) << 62;
std::size_t mul_sat(std::size_t a, std::size_t b);
std::size_t add_sat(std::size_t a, std::size_t b);

// Partitions of n tasks into at most k threads: sum over j <= k of Stirling numbers S(n, j).
std::size_t num_partitions(std::size_t n, std::size_t k);

// Calls f(thread) for every restricted growth string of length n with at most k threads, in
// lexicographic order.
template <typename F>
void for_each_partition(std::size_t n, std::size_t k, F&& f) {
  std::vector<ThreadLabel> thread(n, 0);
  std::vector<ThreadLabel> max_before(n, 0);  // max of thread[0..i-1]
  while (true) {
    f(thread);
    // Next string: increment the last position that can grow, reset the ones after it.
    std::size_t i = n - 1;
    while (i >= 1 && thread[i] >= std::min<std::size_t>(max_before[i] + 1, k - 1)) --i;
    if (i == 0) return;
    ++thread[i];
    for (std::size_t j = i + 1; j < n; ++j) {
      thread[j] = 0;
      max_before[j] = std::max(max_before[j - 1], thread[j - 1]);
    }
  }
}

// Calls f(lookaheads) for every vector in [lo, hi]^n, odometer order (first task slowest).
template <typename F>
void for_each_lookahead(std::size_t n, int lo, int hi, F&& f) {
  std::vector<int> la(n, lo);
  while (true) {
    f(la);
    std::size_t i = n;
    while (i > 0 && la[i - 1] == hi) la[--i] = lo;
    if (i == 0) return;
    ++la[i - 1];
  }
}

// The streams a task may run on, its own first, then its movable_to in declaration order.
std::vector<std::string> stream_choices(const pipeline::Task& task);

// The space suggest searches: thread maps of up to k threads over the n tasks, every lookahead
// in [lo, hi], and how many of each there are (saturated at kHuge).
struct SearchSpace {
  std::size_t n = 0;
  std::size_t k = 0;
  int lo = 0;
  int hi = 0;
  std::size_t num_maps = 0;
  std::size_t num_lookaheads = 0;
  // Per task, how many streams it may run on (1: fixed), and the product over the tasks.
  std::vector<std::size_t> num_stream_choices;
  std::size_t num_stream_assignments = 1;
  std::string movable_tasks;  // "h2d (memcpy, default), ..." for the description
  std::size_t num_fixed_stream_tasks = 0;

  std::size_t num_points() const {
    return mul_sat(mul_sat(num_maps, num_lookaheads), num_stream_assignments);
  }
};

// Checks the options against the schedule and the costs, and measures the space they open.
SearchSpace search_space(const pipeline::CompiledSchedule& schedule, const CostModel& costs,
                         const SuggestOptions& options);

// Calls f(stream) for every stream assignment (indices into each task's stream choices),
// odometer order (first task slowest).
template <typename F>
void for_each_stream_assignment(const SearchSpace& space, F&& f) {
  std::vector<ThreadLabel> stream(space.n, 0);
  while (true) {
    f(stream);
    std::size_t i = space.n;
    while (i > 0 && stream[i - 1] + 1u == space.num_stream_choices[i - 1]) stream[--i] = 0;
    if (i == 0) return;
    ++stream[i - 1];
  }
}

}  // namespace weft::plan::detail
