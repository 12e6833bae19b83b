// weft::plan::suggest: searches thread maps (which tasks share a host thread) and lookaheads for
// the lowest simulated step time of a schedule under a cost model, and returns the best few as
// ScheduleConfigs that weft::pipeline loads as they are.
//
// The search space. A thread map is a set partition of the tasks into at most max_threads
// threads (one thread: the legacy map); each task's lookahead lies in [min_lookahead,
// max_lookahead] (default: 0 to the schedule's own largest lookahead, so the search never keeps
// more batches in flight than the schedule does), and a combination the schedule's rules refuse
// (an ordering edge pointing forward in time) is skipped. The streams of the tasks the schedule
// declares movable_to (Task::movable_to) are searched over the streams each may run on; every
// other task keeps its stream.
//
// The search. When the whole space (partitions x lookaheads x stream assignments) has at most
// exact_limit points it is enumerated: the result is the optimum under the model. Otherwise,
// from each start (the legacy map, by_stream, per_task and the caller's start_maps, those that
// fit in max_threads, each with the schedule's own lookaheads and with every lookahead at its
// upper bound) it alternates the steps until none improves the step: thread maps (every
// partition when there are at most exact_limit of them, else steepest descent over moving one
// task to another or a new thread) and lookaheads (every combination when there are at most
// exact_limit, else coordinate descent over the tasks in declaration order) and, where a task is
// movable, streams (every assignment when there are at most exact_limit, else coordinate descent,
// starting from every task on its own stream). Candidates are ranked by step time (to the
// nanosecond), then host time of one progress(), then less time waiting across threads, then fewer threads,
// then a smaller sum of lookaheads (fewer batches in flight), then the partition, lookaheads and
// streams (own stream first) in declaration order: the result depends on the input only.
//
//   const pipeline::CompiledSchedule compiled(hstu::hstu_schedule({.cascade = kD6}));
//   SuggestResult r = suggest(compiled, CostModel::hstu_defaults(), {.max_threads = 4});
//   std::puts(r.suggestions[0].config.to_json().c_str());   // load with ScheduleConfig::parse
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/plan/cost_model.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/simulate.hpp"

namespace weft::plan {

struct SuggestOptions {
  int max_threads = 4;     // threads of a thread map, >= 1
  int min_lookahead = 0;   // lower bound of every task's lookahead, >= 0
  int max_lookahead = -1;  // upper bound; -1: the schedule's largest lookahead
  int num_best = 3;        // suggestions returned, >= 1
  // Spaces of at most this many points are enumerated rather than searched locally.
  std::size_t exact_limit = 20000;
  SimulationOptions simulation;  // how every candidate is simulated
  // More maps to start from (e.g. the presets); the result is never worse than any of them
  // under the schedule's own lookaheads.
  std::vector<pipeline::ThreadMap> start_maps;
};

// One suggested schedule: its config and what the simulator predicts for it.
struct Suggestion {
  // thread_map (legacy, or groups t0, t1, ... in order of their first tasks), every task's
  // lookahead and every movable task's stream.
  pipeline::ScheduleConfig config;
  std::vector<TaskPlacement> placement;  // in run order
  // The predicted steady-state step (Timeline::step_us; with SimulationOptions::num_batches, the
  // whole source's time, and the host and thread times below are the source's too).
  double step_us = 0;
  double host_step_us = 0;               // the predicted progress() makespan on the host
  std::size_t num_threads = 0;           // engine threads of config's thread map
  std::string busiest_thread;  // the thread whose task bodies take longest in one progress()
  double busiest_thread_busy_us = 0;  // its bodies' time in that progress()
  // What bounds the step: "stream <name>" (the busiest stream is busy 99% of the step or more),
  // "host" (one progress() takes 99% of the step or more) or "GPU waits across streams
  // (busiest: <name>, <us> us)" (neither: streams wait for each other's work).
  std::string bound;
  // The cross-thread waits of the drawn progress(), longest first.
  std::vector<WaitEdge> waits;
};

struct SuggestResult {
  // Best first, at most num_best, one per thread map (with that map's best lookaheads).
  std::vector<Suggestion> suggestions;
  Suggestion start;                   // the schedule as given, under the legacy map
  std::string method;                 // "exact" or "local"
  std::vector<std::string> searched;  // what the search covered, one line each
  std::vector<std::string> not_searched;  // what it left fixed or skipped, one line each
  std::size_t num_evaluated = 0;  // distinct candidates simulated
  // Candidates refused: by the schedule's rules, or for a GPU wait that could never end.
  std::size_t num_refused = 0;
};

// Throws weft::Error for options out of range, costs the schedule lacks, or a space of one point
// (a schedule the search cannot move: one task or one thread, lookaheads fixed by the bounds and
// no task movable_to another stream).
SuggestResult suggest(const pipeline::CompiledSchedule& schedule, const CostModel& costs,
                      const SuggestOptions& options = {});

// The printed table `weft plan --suggest` shows: one row per suggestion and the start, then what
// was and was not searched.
std::string describe(const SuggestResult& result);

}  // namespace weft::plan
