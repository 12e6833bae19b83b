// weft::pipeline::ScheduleConfig: a JSON file that tunes a schedule without recompiling.
//
//   {
//     "thread_map": "full_split",              // or "legacy" | "by_stream" | "per_task" | a preset
//                                              // or {"groups": {"io": ["h2d"], ...}, "rest":
//                                              "compute"}
//     "lookahead": {"h2d": 5, "start_shuffle": 4},
//     "stream": {"h2d": "default"},            // only tasks the schedule declares movable_to
//     "same_progress_sync": [
//       {"producer": "prefetch_embeddings", "consumer": "backward", "side": "gpu"}
//     ]
//   }
//
// Every key is optional; unknown keys are errors; a lookahead is an integer in [0, kMaxLookahead];
// a task's stream must be one it may run on (Task::movable_to: its own or one declared there), so
// a config never moves a task the schedule did not declare free to move.
// Errors are weft::Error whose message starts with the file (for a config from load()) and the
// JSON path of the offending value, e.g. "hstu.json: $.lookahead.h2d: expected an integer in
// [0, 1000], got -1", and quotes at most a short excerpt of it. load() reads at most 1 MiB and
// refuses documents nested deeper than 64 levels, as parse() does.
//
//   auto config = ScheduleConfig::parse(read_file("hstu.json"));
//   Schedule s = hstu::hstu_schedule();
//   config.apply(s);
//   Engine engine(std::move(s), config.thread_map.value_or(ThreadMap::legacy()));
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/thread_map.hpp"

namespace weft::pipeline {

// A same_progress_sync edge a config sets: added to the consumer, or its side changed if present.
struct SyncEdgeConfig {
  std::string producer;
  std::string consumer;
  SyncSide side = SyncSide::kBoth;
  bool operator==(const SyncEdgeConfig&) const = default;
};

struct ScheduleConfig {
  std::optional<ThreadMap> thread_map;        // empty: the run's own choice stays
  std::map<std::string, int> lookahead;       // task -> lookahead, 0 <= la <= kMaxLookahead
  std::map<std::string, std::string> stream;  // task -> the stream it runs on
  std::vector<SyncEdgeConfig> same_progress_sync;
  // The file load() read, named in apply()'s errors; empty for a config from parse().
  std::string source;

  static ScheduleConfig parse(std::string_view json_text);
  static ScheduleConfig load(const std::string& path);
  // Pretty-printed JSON that parse() reads back to an equal config.
  std::string to_json() const;
  // Throws weft::Error naming the source and the config entry for the first task the config
  // names that `has_task` does not know (apply() checks this before changing anything).
  void check_task_names(const std::function<bool(std::string_view)>& has_task) const;
  // Overrides lookaheads, moves tasks to their configured streams and adds (or replaces)
  // same_progress_sync edges; nothing changes when check_task_names() throws for the schedule or
  // a task is configured onto a stream it may not run on (an error naming the source, the field
  // "$.stream.<task>", the task and the streams it may run on).
  void apply(Schedule& schedule) const;
  // The same over tasks held outside a Schedule (the Python layer's): task_of(name) is the task
  // of that name, or null where there is none.
  void apply(const std::function<Task*(std::string_view)>& task_of) const;

  // Equal when they tune a schedule alike; the source is not compared.
  bool operator==(const ScheduleConfig& other) const;
};

}  // namespace weft::pipeline
