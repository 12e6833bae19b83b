// A schedule the planner reads from JSON: the tasks without bodies, the thread maps to compare,
// and optionally the costs.
//
//   {
//     "streams": ["memcpy", {"name": "comm", "priority": 1}],
//     "inputs": ["batch_cpu", "step_cpu"],
//     "tasks": [
//       {"name": "h2d", "stream": "memcpy", "movable_to": ["default"], "lookahead": 1,
//        "reads": ["batch_cpu"], "writes": ["batch_gpu"]},
//       {"name": "log", "reads": ["step_cpu"]},
//       {"name": "allreduce", "reads": ["batch_gpu"], "writes": ["sum"],
//        "collective": [{"kind": "AllReduce", "stream": "comm", "bytes": 4096, "count": 1}]},
//       {"name": "train", "reads": ["sum"], "depends_on": ["log"],
//        "cross_iter_depends_on": [{"producer": "train", "offset": -1}],
//        "same_progress_sync": [{"producer": "h2d", "side": "gpu"}]}
//     ],
//     "thread_maps": ["legacy", "by_stream", {"groups": {"io": ["h2d"]}, "rest": "compute"}],
//     "costs": {"tasks": {"train": {"host_us": 500, "gpu": [{"stream": "default", "us": 9000}]}}}
//   }
//
// "movable_to" lists other streams the task may run on (Task::movable_to), which a schedule config
// may move it to and `weft plan --suggest` searches. "collective" may also be just true. A consumer names a producer in one edge kind only (a slot
// it reads, depends_on, cross_iter_depends_on or same_progress_sync). Thread maps take the forms
// of ScheduleConfig's "thread_map" (groups in the order written); without "thread_maps", legacy,
// by_stream and per_task are compared. The schedule's rules (CompiledSchedule) and the costs
// (CostModel::check_against) are checked by parse(). Errors are weft::Error whose message starts
// with the JSON path of the offending value (a rule's error: of the task and field its
// pipeline::ScheduleError carries, e.g. "$.tasks[1].depends_on", or "$.streams"); load()
// prefixes the file's path. Limits: 16 MiB, 64 levels of nesting, integers in int range.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/plan/cost_model.hpp"

namespace weft::plan {

struct ScheduleFile {
  pipeline::Schedule schedule;                   // valid: parse() has compiled it once
  std::vector<std::string> thread_map_names;     // for the report: "by_stream", "explicit 1", ...
  std::vector<pipeline::ThreadMap> thread_maps;  // parallel to thread_map_names
  std::optional<CostModel> costs;                // checked against the schedule; empty: none given

  static ScheduleFile parse(std::string_view json_text);
  static ScheduleFile load(const std::string& path);
};

}  // namespace weft::plan
