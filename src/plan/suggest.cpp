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

#include "search_space.hpp"
#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using pipeline::CompiledSchedule;
using pipeline::TaskId;
using pipeline::ThreadMap;
using namespace detail;

// A point of the search space: the thread of every task as a restricted growth string over the
// tasks in declaration order (thread[0] = 0, thread[t] <= 1 + max of the earlier ones), so each
// partition has exactly one spelling, the lookahead of every task, and the stream of every task as
// an index into its SearchSpace::stream_choices (0: its own stream, always so for a task the
// schedule does not declare movable_to).
struct Candidate {
  std::vector<ThreadLabel> thread;
  std::vector<int> lookahead;
  std::vector<ThreadLabel> stream;
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


class Search {
 public:
  Search(const CompiledSchedule& schedule, const CostModel& costs, const SuggestOptions& options)
      : schedule_(schedule), costs_(costs), options_(options) {}

  // The score of a candidate, or nothing where the schedule's rules refuse its lookaheads or a
  // GPU wait of the costs could never end under it (endless_gpu_wait).
  std::optional<Score> score(const Candidate& c) {
    if (const auto it = scores_.find(c); it != scores_.end()) return it->second;
    std::optional<Score> result;
    const CompiledSchedule* compiled = compiled_with(c.lookahead, c.stream);
    const auto threads = compiled ? thread_map(c).assign(*compiled) : pipeline::ThreadAssignment{};
    if (compiled && !endless_gpu_wait(*compiled, threads, costs_).empty()) {
      compiled = nullptr;
      ++num_refused_;
    }
    if (compiled) {
      const Timeline t = simulate(*compiled, threads, costs_, options_.simulation);
      long long sum = 0;
      for (int la : c.lookahead) sum += la;
      double waited_us = 0;  // across threads: a body's own wait for the GPU is not one
      for (const auto& w : t.waits) {
        if (w.rule != WaitRule::kGpuWait) waited_us += w.waited_us;
      }
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

  // The schedule with these lookaheads and streams (indices into stream_choices()), or nothing
  // where its rules refuse them.
  const CompiledSchedule* compiled_with(const std::vector<int>& lookahead,
                                        const std::vector<ThreadLabel>& stream) {
    auto it = compiled_.find({lookahead, stream});
    if (it == compiled_.end()) {
      std::optional<CompiledSchedule> compiled;
      pipeline::Schedule s = schedule_.source();
      for (TaskId t = 0; t < schedule_.num_tasks(); ++t) {
        pipeline::Task& task = s.task(schedule_.task(t).name());
        task.lookahead(lookahead[t]);
        task.move_to_stream(stream_choices(schedule_.task(t))[stream[t]]);
      }
      try {
        compiled.emplace(std::move(s));
      } catch (const Error&) {
        // An ordering edge that would point forward in time, or a cross-stream edge reaching
        // back further than the ring holds: not a schedule, not a candidate.
        ++num_refused_;
      }
      it = compiled_.emplace(std::pair{lookahead, stream}, std::move(compiled)).first;
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
  std::map<std::pair<std::vector<int>, std::vector<ThreadLabel>>, std::optional<CompiledSchedule>>
      compiled_;
  std::size_t num_refused_ = 0;
};

std::string format_us(double us) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", us);
  return text;
}


// Scores every candidate of the space.
void search_exactly(Search& search, const SearchSpace& space) {
  for_each_stream_assignment(space, [&](const std::vector<ThreadLabel>& stream) {
    for_each_lookahead(space.n, space.lo, space.hi, [&](const std::vector<int>& la) {
      if (!search.compiled_with(la, stream)) return;
      for_each_partition(space.n, space.k, [&](const std::vector<ThreadLabel>& thread) {
        search.score({thread, la, stream});
      });
    });
  });
}

// The stream step of the local search: the best stream assignment for the current map and
// lookaheads, over every assignment where there are few enough, else by coordinate descent over
// the movable tasks. True where current improved.
bool improve_streams(Search& search, const SearchSpace& space, bool exact_streams,
                     Candidate& current) {
  if (space.num_stream_assignments == 1) return false;
  bool improved = false;
  if (exact_streams) {
    Candidate best = current;
    for_each_stream_assignment(space, [&](const std::vector<ThreadLabel>& stream) {
      Candidate c{current.thread, current.lookahead, stream};
      if (search.better(c, best)) best = std::move(c);
    });
    improved = best != current;
    current = std::move(best);
    return improved;
  }
  bool pass_improved = true;
  while (pass_improved) {  // coordinate descent, one movable task at a time
    pass_improved = false;
    for (TaskId t = 0; t < space.n; ++t) {
      Candidate best = current;
      for (std::size_t s = 0; s < space.num_stream_choices[t]; ++s) {
        Candidate c = current;
        c.stream[t] = ThreadLabel(s);
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

// The map step of the local search: the best partition for the current lookaheads, over every
// map where there are few enough, else by steepest descent. True where current improved.
bool improve_map(Search& search, const SearchSpace& space, bool exact_maps, Candidate& current) {
  const std::size_t n = space.n, k = space.k;
  bool improved = false;
  if (exact_maps) {
    Candidate best = current;
    for_each_partition(n, k, [&](const std::vector<ThreadLabel>& thread) {
      Candidate c{thread, current.lookahead, current.stream};
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
      Candidate c{current.thread, la, current.stream};
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

// A local search starts from every stream assignment of the movable tasks where there are at
// most this many: a move that pays only together with a map change (a task to a stream and a
// thread of its own) is not reached by one step from the own streams.
constexpr std::size_t kMaxStartStreamAssignments = 16;

std::vector<std::vector<ThreadLabel>> start_stream_assignments(const SearchSpace& space) {
  std::vector<std::vector<ThreadLabel>> starts;
  if (space.num_stream_assignments > kMaxStartStreamAssignments) {
    starts.emplace_back(space.n, 0);
    return starts;
  }
  for_each_stream_assignment(space,
                             [&](const std::vector<ThreadLabel>& s) { starts.push_back(s); });
  return starts;
}

// What bounds a candidate's step: a stream busy all the step, the host, or else the GPU waits
// across streams. runs_per_step: how often each task runs in t's step (a source's batches).
std::string step_bound(const CompiledSchedule& schedule, const CostModel& costs,
                       const SimulationOptions& simulation, const Timeline& t, int runs_per_step) {
  // The busiest stream's work per step: from the costs, or, where a stream runs slower while
  // others run (an overlap slowdown), from the simulated spans of the step.
  std::map<std::string, double> stream_busy;
  if (simulation.overlap_slowdown == 1) {
    for (TaskId id = 0; id < schedule.num_tasks(); ++id) {
      for (const auto& seg : costs.placed_cost_of(schedule.task(id)).gpu)
        stream_busy[seg.stream] += seg.us * runs_per_step;
    }
  } else {
    for (const auto& g : t.gpu) stream_busy[g.stream] += g.end_us - g.start_us;
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
  const CompiledSchedule& compiled = *search.compiled_with(c.lookahead, c.stream);
  const ThreadMap map = search.thread_map(c);
  const auto threads = map.assign(compiled);
  const Timeline t = simulate(compiled, threads, costs, options.simulation);
  s.config.thread_map = map;
  for (TaskId id = 0; id < schedule.num_tasks(); ++id) {
    s.config.lookahead[schedule.task(id).name()] = c.lookahead[id];
    // Every movable task's stream, moved or not; the others cannot be configured.
    if (!schedule.task(id).movable_to().empty()) {
      s.config.stream[schedule.task(id).name()] = compiled.task(id).stream();
    }
  }
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
  s.bound = step_bound(compiled, costs, options.simulation, t,
                       std::max(1, options.simulation.num_batches));
  return s;
}

// How the space is covered: all of it, or a local search whose steps each cover all of their
// dimension where it has at most exact_limit points.
struct Method {
  bool exact = false;
  bool exact_maps = false;
  bool exact_lookaheads = false;
  bool exact_streams = false;
};

// SuggestResult's method, searched and not_searched: how the space was covered.
void describe_search(const SearchSpace& space, const Method& m, const std::string& start_names,
                     SuggestResult& result) {
  const std::string bounds = "[" + std::to_string(space.lo) + ", " + std::to_string(space.hi) + "]";
  const std::string maps =
      "thread maps: set partitions of the " + std::to_string(space.n) + " tasks into at most " +
      std::to_string(space.k) + " threads (" +
      (space.num_maps >= kHuge ? "over 4e18" : std::to_string(space.num_maps)) + ")";
  const std::string las = "lookaheads: every task in " + bounds + " (" +
                          (space.num_lookaheads >= kHuge ? "over 4e18"
                                                         : std::to_string(space.num_lookaheads)) +
                          " combinations; those the schedule's rules refuse skipped)";
  const std::string streams =
      "streams: the tasks declared movable_to, over the streams each may run on: " +
      space.movable_tasks + " (" +
      (space.num_stream_assignments >= kHuge ? "over 4e18"
                                             : std::to_string(space.num_stream_assignments)) +
      " assignments; those the schedule's rules refuse skipped)";
  const bool movable = space.num_stream_assignments > 1;
  if (m.exact) {
    result.method = "exact";
    result.searched = {maps + ", all of them", las + ", all of them, with every map"};
    if (movable) result.searched.push_back(streams + ", all of them, with every map and lookahead");
  } else {
    result.method = "local";
    result.searched = {
        maps + (m.exact_maps ? ", all of them for each lookahead step"
                             : ", steepest descent moving one task to another or a new thread"),
        las + (m.exact_lookaheads ? ", all of them for each map step"
                                  : ", coordinate descent one task at a time")};
    if (movable) {
      result.searched.push_back(streams + (m.exact_streams
                                               ? ", all of them for each stream step"
                                               : ", coordinate descent one task at a time"));
    }
    result.searched.push_back(
        std::string("alternating the ") + (movable ? "three" : "two") +
        " steps until none improves, from the maps " + start_names +
        " (the same partition once), each with the schedule's lookaheads and with every "
        "lookahead at " +
        std::to_string(space.hi) +
        (!movable ? ""
         : space.num_stream_assignments <= kMaxStartStreamAssignments
             ? ", and from every stream assignment of the movable tasks"
             : ", every task on its own stream"));
    result.not_searched.push_back(
        "the rest of the space: the result is a local optimum, not proven the best");
  }
  if (!movable) {
    result.not_searched.push_back(
        "streams: every task keeps its stream (no task of the schedule is declared movable_to "
        "another stream)");
  } else if (space.num_fixed_stream_tasks > 0) {
    result.not_searched.push_back("streams of the " + std::to_string(space.num_fixed_stream_tasks) +
                                  " tasks not declared movable_to (each keeps its stream)");
  }
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
  const Method method{.exact = space.num_points() <= options.exact_limit,
                      .exact_maps = space.num_maps <= options.exact_limit,
                      .exact_lookaheads = space.num_lookaheads <= options.exact_limit,
                      .exact_streams = space.num_stream_assignments <= options.exact_limit};
  const std::vector<ThreadLabel> own_streams(n, 0);
  if (method.exact) {
    search_exactly(search, space);
  } else {
    std::vector<int> own(n);
    for (TaskId t = 0; t < n; ++t) {
      own[t] = std::clamp(schedule.task(t).lookahead(), space.lo, space.hi);
    }
    const auto maps = start_maps(schedule, options, space, start_names);
    const auto stream_starts = start_stream_assignments(space);
    for (const auto& lookaheads : {own, std::vector<int>(n, space.hi)}) {
      for (const auto& map : maps) {
        for (const auto& streams : stream_starts) {
          Candidate current{map, lookaheads, streams};
          if (!search.score(current)) continue;
          while (true) {
            const bool map_improved = improve_map(search, space, method.exact_maps, current);
            const bool la_improved =
                improve_lookaheads(search, space, method.exact_lookaheads, current);
            if (!improve_streams(search, space, method.exact_streams, current) &&
                !la_improved && !map_improved) {
              break;
            }
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
             space.lo, ", ", space.hi,
             "] and the streams tasks may move to admit no valid schedule) or by a GPU wait of "
             "the costs that could never end under it");
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
  Candidate start{std::vector<ThreadLabel>(n, 0), {}, own_streams};
  for (TaskId t = 0; t < n; ++t) start.lookahead.push_back(schedule.task(t).lookahead());
  result.start = describe_candidate(search, schedule, costs, options, start);
  result.num_evaluated = ranked.size();
  result.num_refused = search.num_refused();
  describe_search(space, method, start_names, result);
  return result;
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
      std::string moved;
      for (const auto& [task, stream] : s.config.stream) {
        const std::string& before = start->config.stream.at(task);
        if (stream != before) moved += (moved.empty() ? "" : ", ") + task + " " + before + "->" + stream;
      }
      if (!s.config.stream.empty()) {
        text += "    streams: " + (moved.empty() ? std::string("as given") : moved) + "\n";
      }
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
          " candidates refused (by the schedule's rules, or a GPU wait that could never end)\n";
  for (const auto& line : result.searched) text += "  searched: " + line + "\n";
  for (const auto& line : result.not_searched) text += "  not searched: " + line + "\n";
  return text;
}

}  // namespace weft::plan
