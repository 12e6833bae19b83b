#include "weft/plan/suggest.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using pipeline::CompiledSchedule;
using pipeline::TaskId;
using pipeline::ThreadMap;

// A point of the search space: the thread of every task as a restricted growth string over the
// tasks in declaration order (thread[0] = 0, thread[t] <= 1 + max of the earlier ones), so each
// partition has exactly one spelling, and the lookahead of every task.
// A task's thread in a candidate map (canonical labels 0, 1, ...; 255 marks a new thread while a
// move is tried). Wider than a byte: ordered containers of byte vectors compare through memcmp,
// which some compilers' bounds analysis misreads (-Wstringop-overread) at -O3.
using ThreadLabel = std::uint16_t;

struct Candidate {
  std::vector<ThreadLabel> thread;
  std::vector<int> lookahead;
  auto operator<=>(const Candidate&) const = default;
};

std::size_t num_threads_of(const Candidate& c) {
  return c.thread.empty() ? 0
                          : std::size_t(*std::max_element(c.thread.begin(), c.thread.end())) + 1;
}

// Relabels threads in order of first appearance (the canonical spelling of the partition).
void canonicalise(std::vector<ThreadLabel>& thread) {
  std::vector<int> label(256, -1);
  ThreadLabel next = 0;
  for (auto& t : thread) {
    if (label[t] < 0) label[t] = next++;
    t = ThreadLabel(label[t]);
  }
}

// Ranking key: step and host time rounded to the nanosecond, so that sums of the same figures in
// another order rank as equal and the candidate itself breaks the tie.
struct Score {
  long long step_ns = 0;
  long long host_ns = 0;
  long long waited_ns = 0;  // cross-thread waits of the drawn progress(), summed
  std::size_t num_threads = 0;
  long long lookahead_sum = 0;
  auto operator<=>(const Score&) const = default;
};

// Saturating arithmetic for the size of the space (Bell numbers overflow quickly).
constexpr std::size_t kHuge = std::size_t(1) << 62;
std::size_t mul_sat(std::size_t a, std::size_t b) {
  return (a != 0 && b > kHuge / a) ? kHuge : a * b;
}
std::size_t add_sat(std::size_t a, std::size_t b) { return std::min(kHuge, a + b); }

// Partitions of n tasks into at most k threads: sum over j <= k of Stirling numbers S(n, j).
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

class Search {
 public:
  Search(const CompiledSchedule& schedule, const CostModel& costs, const SuggestOptions& options)
      : schedule_(schedule), costs_(costs), options_(options) {}

  // The score of a candidate, or nothing where the schedule's rules refuse its lookaheads.
  std::optional<Score> score(const Candidate& c) {
    if (const auto it = scores_.find(c); it != scores_.end()) return it->second;
    std::optional<Score> result;
    if (const CompiledSchedule* compiled = compiled_with(c.lookahead)) {
      const Timeline t =
          simulate(*compiled, thread_map(c).assign(*compiled), costs_, options_.simulation);
      long long sum = 0;
      for (int la : c.lookahead) sum += la;
      double waited_us = 0;
      for (const auto& w : t.waits) waited_us += w.waited_us;
      result = Score{std::llround(t.step_us * 1000), std::llround(t.host_step_us * 1000),
                     std::llround(waited_us * 1000), num_threads_of(c), sum};
    }
    scores_.emplace(c, result);
    return result;
  }

  // True when a ranks before b; a refused candidate ranks after every other.
  bool better(const Candidate& a, const Candidate& b) {
    const auto sa = score(a), sb = score(b);
    if (!sa || !sb) return sa.has_value() && !sb.has_value();
    return std::tie(*sa, a) < std::tie(*sb, b);
  }

  const CompiledSchedule* compiled_with(const std::vector<int>& lookahead) {
    auto it = compiled_.find(lookahead);
    if (it == compiled_.end()) {
      std::optional<CompiledSchedule> compiled;
      pipeline::Schedule s = schedule_.source();
      for (TaskId t = 0; t < schedule_.num_tasks(); ++t) {
        s.task(schedule_.task(t).name()).lookahead(lookahead[t]);
      }
      try {
        compiled.emplace(std::move(s));
      } catch (const Error&) {
        // An ordering edge that would point forward in time: not a schedule, not a candidate.
        ++num_refused_;
      }
      it = compiled_.emplace(lookahead, std::move(compiled)).first;
    }
    return it->second ? &*it->second : nullptr;
  }

  // One thread: the legacy map; else one thread per part, t0, t1, ... in order of their first
  // tasks (a task's name would suggest the thread runs only that task).
  ThreadMap thread_map(const Candidate& c) const {
    const std::size_t k = num_threads_of(c);
    if (k == 1) return ThreadMap::legacy();
    std::vector<pipeline::ThreadGroup> groups(k);
    for (TaskId t = 0; t < schedule_.num_tasks(); ++t) {
      auto& g = groups[c.thread[t]];
      if (g.tasks.empty()) g.name = "t" + std::to_string(c.thread[t]);
      g.tasks.push_back(schedule_.task(t).name());
    }
    return ThreadMap::groups(std::move(groups));
  }

  std::map<Candidate, std::optional<Score>>& scores() { return scores_; }
  std::size_t num_refused() const { return num_refused_; }

 private:
  const CompiledSchedule& schedule_;
  const CostModel& costs_;
  const SuggestOptions& options_;
  std::map<Candidate, std::optional<Score>> scores_;
  std::map<std::vector<int>, std::optional<CompiledSchedule>> compiled_;
  std::size_t num_refused_ = 0;
};

std::string format_us(double us) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", us);
  return text;
}

// The space suggest searches: thread maps of up to k threads over the n tasks, every lookahead
// in [lo, hi], and how many of each there are (saturated at kHuge).
struct SearchSpace {
  std::size_t n = 0;
  std::size_t k = 0;
  int lo = 0;
  int hi = 0;
  std::size_t num_maps = 0;
  std::size_t num_lookaheads = 0;
};

// Checks the options against the schedule and the costs, and measures the space they open.
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
  WEFT_CHECK(mul_sat(num_maps, num_lookaheads) > 1,
             "suggest: the search cannot move this schedule: ",
             n == 1 ? "it has one task" : "max_threads is 1",
             " and every lookahead is fixed by the bounds [", lo, ", ", hi,
             "] (widen the lookahead bounds", n == 1 ? ")" : " or allow more threads)");
  return {n, k, lo, hi, num_maps, num_lookaheads};
}

// Scores every candidate of the space.
void search_exactly(Search& search, const SearchSpace& space) {
  for_each_lookahead(space.n, space.lo, space.hi, [&](const std::vector<int>& la) {
    if (!search.compiled_with(la)) return;
    for_each_partition(space.n, space.k, [&](const std::vector<ThreadLabel>& thread) {
      search.score({thread, la});
    });
  });
}

// The map step of the local search: the best partition for the current lookaheads, over every
// map where there are few enough, else by steepest descent. True where current improved.
bool improve_map(Search& search, const SearchSpace& space, bool exact_maps, Candidate& current) {
  const std::size_t n = space.n, k = space.k;
  bool improved = false;
  if (exact_maps) {
    Candidate best = current;
    for_each_partition(n, k, [&](const std::vector<ThreadLabel>& thread) {
      Candidate c{thread, current.lookahead};
      if (search.better(c, best)) best = std::move(c);
    });
    improved = best != current;
    current = std::move(best);
    return improved;
  }
  while (true) {  // steepest descent over moving one task
    Candidate best = current;
    const std::size_t used = num_threads_of(current);
    for (TaskId t = 0; t < n; ++t) {
      for (std::size_t to = 0; to <= std::min(used, k - 1); ++to) {
        if (to == current.thread[t]) continue;
        Candidate c = current;
        c.thread[t] = ThreadLabel(to == used ? 255 : to);  // 255: a new thread
        canonicalise(c.thread);
        if (search.better(c, best)) best = std::move(c);
      }
    }
    if (best == current) return improved;
    current = std::move(best);
    improved = true;
  }
}

// The lookahead step of the local search: the best lookaheads for the current map, over every
// combination where there are few enough, else by coordinate descent. True where current
// improved.
bool improve_lookaheads(Search& search, const SearchSpace& space, bool exact_lookaheads,
                        Candidate& current) {
  const std::size_t n = space.n;
  const int lo = space.lo, hi = space.hi;
  bool improved = false;
  if (exact_lookaheads) {
    Candidate best = current;
    for_each_lookahead(n, lo, hi, [&](const std::vector<int>& la) {
      Candidate c{current.thread, la};
      if (search.better(c, best)) best = std::move(c);
    });
    improved = best != current;
    current = std::move(best);
    return improved;
  }
  bool pass_improved = true;
  while (pass_improved) {  // coordinate descent, one task at a time
    pass_improved = false;
    for (TaskId t = 0; t < n; ++t) {
      Candidate best = current;
      for (int la = lo; la <= hi; ++la) {
        Candidate c = current;
        c.lookahead[t] = la;
        if (search.better(c, best)) best = std::move(c);
      }
      if (best != current) {
        current = std::move(best);
        pass_improved = improved = true;
      }
    }
  }
  return improved;
}

// The maps a local search starts from: legacy, by_stream, per_task (within k threads) and the
// options' start maps, each once, with the name of its first spelling added to `names`; those
// over k threads are left out.
std::vector<std::vector<ThreadLabel>> start_maps(const CompiledSchedule& schedule,
                                                 const SuggestOptions& options,
                                                 const SearchSpace& space, std::string& names) {
  const std::size_t n = space.n, k = space.k;
  std::vector<std::vector<ThreadLabel>> maps;
  auto add_start = [&](std::vector<ThreadLabel> thread, const std::string& name) {
    canonicalise(thread);
    if (num_threads_of({thread, {}}) > k ||
        std::find(maps.begin(), maps.end(), thread) != maps.end()) {
      return;
    }
    maps.push_back(std::move(thread));
    names += (names.empty() ? "" : ", ") + name;
  };
  std::vector<ThreadLabel> by_stream(n), per_task(n);
  for (TaskId t = 0; t < n; ++t) {
    by_stream[t] = ThreadLabel(std::min<std::size_t>(schedule.stream_of(t), 255));
    per_task[t] = ThreadLabel(std::min<std::size_t>(t, 255));
  }
  add_start(std::vector<ThreadLabel>(n, 0), "legacy");
  add_start(by_stream, "by_stream");
  if (n <= k) add_start(per_task, "per_task");
  for (const ThreadMap& map : options.start_maps) {
    const auto threads = map.assign(schedule);
    if (threads.num_threads() > k) continue;
    std::vector<ThreadLabel> thread(n);
    for (TaskId t = 0; t < n; ++t) thread[t] = ThreadLabel(threads.thread_of_task[t]);
    add_start(std::move(thread), map.name());
  }
  return maps;
}

// What bounds a candidate's step: a stream busy all the step, the host, or else the GPU waits
// across streams.
std::string step_bound(const CompiledSchedule& schedule, const CostModel& costs,
                       const Timeline& t) {
  // The busiest stream's work per step, from the costs (every task runs once per step).
  std::map<std::string, double> stream_busy;
  for (TaskId id = 0; id < schedule.num_tasks(); ++id) {
    for (const auto& seg : costs.cost_of(schedule.task(id).name()).gpu)
      stream_busy[seg.stream] += seg.us;
  }
  const auto busiest =
      std::max_element(stream_busy.begin(), stream_busy.end(),
                       [](const auto& a, const auto& b) { return a.second < b.second; });
  // Within 1% of the step: that resource is busy all the step, nothing else could shorten it.
  if (busiest != stream_busy.end() && busiest->second >= 0.99 * t.step_us) {
    return "stream " + busiest->first;
  }
  if (t.host_step_us >= 0.99 * t.step_us) return "host";
  std::string bound = "GPU waits across streams";
  if (busiest != stream_busy.end()) {
    bound += " (busiest: " + busiest->first + ", " + format_us(busiest->second) + " us)";
  }
  return bound;
}

// A candidate as suggest reports it: its config, placement, simulated times, waits (longest
// first) and bound.
Suggestion describe_candidate(Search& search, const CompiledSchedule& schedule,
                              const CostModel& costs, const SuggestOptions& options,
                              const Candidate& c) {
  Suggestion s;
  const CompiledSchedule& compiled = *search.compiled_with(c.lookahead);
  const ThreadMap map = search.thread_map(c);
  const auto threads = map.assign(compiled);
  const Timeline t = simulate(compiled, threads, costs, options.simulation);
  s.config.thread_map = map;
  for (TaskId id = 0; id < schedule.num_tasks(); ++id)
    s.config.lookahead[schedule.task(id).name()] = c.lookahead[id];
  s.placement = placement(compiled, threads);
  s.step_us = t.step_us;
  s.host_step_us = t.host_step_us;
  s.num_threads = threads.num_threads();
  for (const ThreadLoad& load : thread_loads(t)) {
    if (load.busy_us > s.busiest_thread_busy_us) {
      s.busiest_thread = load.thread;
      s.busiest_thread_busy_us = load.busy_us;
    }
  }
  s.waits = t.waits;
  std::stable_sort(s.waits.begin(), s.waits.end(), [](const WaitEdge& a, const WaitEdge& b) {
    return a.waited_us > b.waited_us;
  });
  s.bound = step_bound(schedule, costs, t);
  return s;
}

// SuggestResult's method, searched and not_searched: how the space was covered.
void describe_search(const SearchSpace& space, bool exact, bool exact_maps, bool exact_lookaheads,
                     const std::string& start_names, SuggestResult& result) {
  const std::string bounds = "[" + std::to_string(space.lo) + ", " + std::to_string(space.hi) + "]";
  const std::string maps =
      "thread maps: set partitions of the " + std::to_string(space.n) + " tasks into at most " +
      std::to_string(space.k) + " threads (" +
      (space.num_maps >= kHuge ? "over 4e18" : std::to_string(space.num_maps)) + ")";
  const std::string las = "lookaheads: every task in " + bounds + " (" +
                          (space.num_lookaheads >= kHuge ? "over 4e18"
                                                         : std::to_string(space.num_lookaheads)) +
                          " combinations; those the schedule's rules refuse skipped)";
  if (exact) {
    result.method = "exact";
    result.searched = {maps + ", all of them", las + ", all of them, with every map"};
  } else {
    result.method = "local";
    result.searched = {
        maps + (exact_maps ? ", all of them for each lookahead step"
                           : ", steepest descent moving one task to another or a new thread"),
        las + (exact_lookaheads ? ", all of them for each map step"
                                : ", coordinate descent one task at a time"),
        "alternating the two steps until neither improves, from the maps " + start_names +
            " (the same partition once), each with the schedule's lookaheads and with every "
            "lookahead at " +
            std::to_string(space.hi)};
    result.not_searched.push_back(
        "the rest of the space: the result is a local optimum, not proven the best");
  }
  result.not_searched.push_back(
      "streams: every task keeps its stream (a schedule config cannot move one)");
  result.not_searched.push_back("more than " + std::to_string(space.k) +
                                " threads, lookaheads outside " + bounds +
                                ", and same_progress_sync edges (kept as given)");
}

}  // namespace

SuggestResult suggest(const CompiledSchedule& schedule, const CostModel& costs,
                      const SuggestOptions& options) {
  const SearchSpace space = search_space(schedule, costs, options);
  const std::size_t n = space.n;
  Search search(schedule, costs, options);
  SuggestResult result;

  std::string start_names;  // the start maps of a local search
  const bool exact = mul_sat(space.num_maps, space.num_lookaheads) <= options.exact_limit;
  const bool exact_maps = space.num_maps <= options.exact_limit;
  const bool exact_lookaheads = space.num_lookaheads <= options.exact_limit;
  if (exact) {
    search_exactly(search, space);
  } else {
    std::vector<int> own(n);
    for (TaskId t = 0; t < n; ++t) {
      own[t] = std::clamp(schedule.task(t).lookahead(), space.lo, space.hi);
    }
    const auto maps = start_maps(schedule, options, space, start_names);
    for (const auto& lookaheads : {own, std::vector<int>(n, space.hi)}) {
      for (const auto& map : maps) {
        Candidate current{map, lookaheads};
        if (!search.score(current)) continue;
        while (true) {
          const bool map_improved = improve_map(search, space, exact_maps, current);
          if (!improve_lookaheads(search, space, exact_lookaheads, current) && !map_improved) {
            break;
          }
        }
      }
    }
  }

  // The best few of everything simulated.
  std::vector<std::pair<Score, const Candidate*>> ranked;
  for (const auto& [c, s] : search.scores()) {
    if (s) ranked.emplace_back(*s, &c);
  }
  WEFT_CHECK(!ranked.empty(),
             "suggest: every candidate was refused by the schedule's rules "
             "(the lookahead bounds [",
             space.lo, ", ", space.hi, "] admit no valid schedule)");
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, *a.second) < std::tie(b.first, *b.second);
  });

  // The best few thread maps, each with its best lookaheads: variants of one map that differ
  // only in a lookahead that changes nothing would say the same thing a few times.
  std::set<std::vector<ThreadLabel>> maps_taken;
  for (const auto& [score, c] : ranked) {
    if (result.suggestions.size() == std::size_t(options.num_best)) break;
    if (!maps_taken.insert(c->thread).second) continue;
    result.suggestions.push_back(describe_candidate(search, schedule, costs, options, *c));
  }
  Candidate start{std::vector<ThreadLabel>(n, 0), {}};
  for (TaskId t = 0; t < n; ++t) start.lookahead.push_back(schedule.task(t).lookahead());
  result.start = describe_candidate(search, schedule, costs, options, start);
  result.num_evaluated = ranked.size();
  result.num_refused = search.num_refused();
  describe_search(space, exact, exact_maps, exact_lookaheads, start_names, result);
  return result;
}

CostModel costs_from_trace(const VariantReport& measured) {
  CostModel model;
  for (const auto& span : measured.timeline.host) {
    model.tasks[span.task].host_us += span.end_us - span.start_us;
  }
  std::vector<GpuSpan> gpu = measured.timeline.gpu;
  std::stable_sort(gpu.begin(), gpu.end(),
                   [](const GpuSpan& a, const GpuSpan& b) { return a.start_us < b.start_us; });
  for (const auto& span : gpu) {
    model.tasks[span.task].gpu.push_back({span.stream, span.end_us - span.start_us});
  }
  return model;
}

std::string describe(const SuggestResult& result) {
  std::string text;
  auto row = [&](const std::string& label, const Suggestion& s, const Suggestion* start) {
    text += label + "  step " + format_us(s.step_us) + " us  host " + format_us(s.host_step_us) +
            " us  " + std::to_string(s.num_threads) + " thread" + (s.num_threads == 1 ? "" : "s") +
            " (busiest: " + s.busiest_thread + ", " + format_us(s.busiest_thread_busy_us) +
            " us busy)\n    bound: " + s.bound + "\n";
    std::string threads;
    if (s.config.thread_map->kind() == ThreadMap::Kind::kLegacy) {
      threads = "legacy (one thread)";
    } else {
      for (const auto& g : s.config.thread_map->thread_groups()) {
        std::string tasks;
        for (const auto& t : g.tasks) tasks += (tasks.empty() ? "" : ", ") + t;
        threads += (threads.empty() ? "" : " | ") + g.name + ": " + tasks;
      }
    }
    text += "    threads: " + threads + "\n";
    if (start != nullptr) {
      std::string changed;
      for (const auto& [task, la] : s.config.lookahead) {
        const int before = start->config.lookahead.at(task);
        if (la != before) {
          changed += (changed.empty() ? "" : ", ") + task + " " + std::to_string(before) + "->" +
                     std::to_string(la);
        }
      }
      text += "    lookaheads: " + (changed.empty() ? std::string("as given") : changed) + "\n";
    }
    std::string waits;
    for (std::size_t i = 0; i < s.waits.size() && i < 3 && s.waits[i].waited_us > 0; ++i) {
      const auto& w = s.waits[i];
      waits += (waits.empty() ? "" : "; ") + w.consumer + " <- " + w.producer + " (" +
               to_string(w.rule) + ") " + format_us(w.waited_us) + " us";
    }
    text += "    longest waits: " + (waits.empty() ? std::string("none") : waits) + "\n";
  };
  row("given (legacy map)", result.start, nullptr);
  for (std::size_t i = 0; i < result.suggestions.size(); ++i) {
    row("#" + std::to_string(i + 1), result.suggestions[i], &result.start);
  }
  text += "search: " + result.method + ", " + std::to_string(result.num_evaluated) +
          " schedules simulated, " + std::to_string(result.num_refused) +
          " lookahead combinations refused by the schedule's rules\n";
  for (const auto& line : result.searched) text += "  searched: " + line + "\n";
  for (const auto& line : result.not_searched) text += "  not searched: " + line + "\n";
  return text;
}

}  // namespace weft::plan
