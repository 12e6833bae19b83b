// weft::plan::CostModel: how long each task keeps its host thread busy, and how long its GPU work
// runs on which stream. Loaded from JSON:
//
//   {
//     "default_host_us": 20,                       // tasks the file does not list
//     "tasks": {
//       "h2d":      {"host_us": 150, "gpu": [{"stream": "memcpy", "us": 420}]},
//       "experts":  {"host_us": 500, "waits_for_gpu_of": "dispatch"},
//       "backward": {"host_us": 2500, "gpu": [{"stream": "default", "us": 25000},
//                                             {"stream": "output_dist_comm", "us": 1600}]}
//     }
//   }
//
// A task's GPU segments run one after the other, each on its stream, after the task's body has
// enqueued them. A task with waits_for_gpu_of blocks its thread, before its host work, until the
// GPU work of that task for the same batch has ended (a body that reads a count the producer's
// kernel writes); its host_us is the work besides that wait. Every figure is in
// [0, kMaxCostUs] (1000 s: a larger figure is a unit mistake, and the simulation's sums stay
// finite). Unknown keys, JSON nested deeper than 64 levels, files
// over 16 MiB and, when checked against a schedule, tasks or streams the schedule lacks are errors
// whose message starts with the JSON path ("$.tasks.h2d.host_us").
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"

namespace weft::plan {

struct GpuSegment {
  std::string stream;  // a stream of the schedule
  double us = 0;       // in [0, kMaxCostUs]
  bool operator==(const GpuSegment&) const = default;
};

struct TaskCost {
  double host_us = 0;            // the body's time on its host thread, in [0, kMaxCostUs]
  std::vector<GpuSegment> gpu;   // in the order they run, after the body has enqueued them
  // A task of the schedule (not this one) whose GPU work for this task's batch this body waits
  // for before its host work, holding its thread (not the GIL); empty: none. Its lookahead must
  // be at least this task's (its batch runs no later), which the simulator checks.
  std::string waits_for_gpu_of;
  bool operator==(const TaskCost&) const = default;
};

struct CostModel {
  static constexpr double kMaxCostUs = 1e9;

  double default_host_us = 20;                          // host time of a task `tasks` lacks
  std::map<std::string, TaskCost, std::less<>> tasks;   // task name -> its cost

  static CostModel parse(std::string_view json_text);
  static CostModel load(const std::string& path);
  std::string to_json() const;

  // The cost of a task (default_host_us and no GPU work when the model does not list it).
  TaskCost cost_of(std::string_view task) const;
  // The cost of a task where the schedule puts it: a GPU segment on any stream the task may run
  // on (its own or one of its movable_to, where it may have been measured before a move) runs on
  // the task's stream; segments on other streams (comm streams used inside it) stay.
  TaskCost placed_cost_of(const pipeline::Task& task) const;
  // Throws weft::Error naming the first task of the model that the schedule lacks, the first
  // GPU segment on a stream the schedule does not declare, or a waits_for_gpu_of naming no other
  // task of the schedule.
  void check_against(const pipeline::CompiledSchedule& schedule) const;

  // Rough figures for the HSTU preset tasks (see docs/planner.md for where they come from).
  static CostModel hstu_defaults();

  bool operator==(const CostModel&) const = default;
};

}  // namespace weft::plan
