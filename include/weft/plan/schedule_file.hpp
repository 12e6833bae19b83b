// A schedule the planner reads from JSON: the tasks without bodies, the thread maps to compare,
// and optionally the costs.
//
//   {
//     "streams": ["memcpy", {"name": "comm", "priority": 1}],
//     "inputs": ["batch_cpu"],
//     "tasks": [
//       {"name": "h2d", "stream": "memcpy", "lookahead": 1,
//        "reads": ["batch_cpu"], "writes": ["batch_gpu"]},
//       {"name": "allreduce", "reads": ["batch_gpu"], "writes": ["sum"],
//        "collective": [{"kind": "AllReduce", "stream": "default", "bytes": 4096, "count": 1}]},
//       {"name": "train", "reads": ["sum"], "depends_on": ["h2d"],
//        "cross_iter_depends_on": [{"producer": "train", "offset": -1}],
//        "same_progress_sync": [{"producer": "h2d", "side": "gpu"}]}
//     ],
//     "thread_maps": ["legacy", "by_stream", {"groups": {"io": ["h2d"]}, "rest": "compute"}],
//     "costs": {"tasks": {"train": {"host_us": 500, "gpu": [{"stream": "default", "us": 9000}]}}}
//   }
//
// "collective" may also be just true. Thread maps take the forms of ScheduleConfig's
// "thread_map"; without "thread_maps", legacy, by_stream and per_task are compared. Errors are
// weft::Error whose message starts with the JSON path of the offending value.
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
  pipeline::Schedule schedule;
  std::vector<std::string> thread_map_names;  // for the report: "by_stream", "explicit 1", ...
  std::vector<pipeline::ThreadMap> thread_maps;
  std::optional<CostModel> costs;

  static ScheduleFile parse(std::string_view json_text);
  static ScheduleFile load(const std::string& path);
};

}  // namespace weft::plan
