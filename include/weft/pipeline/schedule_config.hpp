// weft::pipeline::ScheduleConfig: a JSON file that tunes a schedule without recompiling.
//
//   {
//     "thread_map": "full_split",              // or "legacy" | "by_stream" | "per_task" | a preset
//                                              // or {"groups": {"io": ["h2d"], ...}, "rest": "compute"}
//     "lookahead": {"h2d": 5, "start_shuffle": 4},
//     "same_progress_sync": [
//       {"producer": "prefetch_embeddings", "consumer": "backward", "side": "gpu"}
//     ]
//   }
//
// Every key is optional; unknown keys are errors. Errors are weft::Error whose message starts with
// the JSON path of the offending value, e.g. "$.lookahead.h2d: expected an integer >= 0".
//
//   auto config = ScheduleConfig::parse(read_file("hstu.json"));
//   Schedule s = hstu_schedule();
//   config.apply(s);
//   Engine engine(std::move(s), config.thread_map.value_or(ThreadMap::legacy()));
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/thread_map.hpp"

namespace weft::pipeline {

struct SyncEdgeConfig {
  std::string producer;
  std::string consumer;
  SyncSide side = SyncSide::kBoth;
  bool operator==(const SyncEdgeConfig&) const = default;
};

struct ScheduleConfig {
  std::optional<ThreadMap> thread_map;
  std::map<std::string, int> lookahead;
  std::vector<SyncEdgeConfig> same_progress_sync;

  static ScheduleConfig parse(std::string_view json_text);
  static ScheduleConfig load(const std::string& path);
  // Pretty-printed JSON that parse() reads back to an equal config.
  std::string to_json() const;
  // Overrides lookaheads and adds (or replaces) same_progress_sync edges. Throws weft::Error
  // naming the config entry for a task the schedule lacks.
  void apply(Schedule& schedule) const;

  bool operator==(const ScheduleConfig&) const = default;
};

}  // namespace weft::pipeline
