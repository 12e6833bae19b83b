// `weft plan --suggest`: the planner searches thread maps and lookaheads for the lowest simulated
// step (weft::plan::suggest), prints the best few, writes each as a schedule config, and draws
// them beside the maps it started from in the report.
//
//   weft plan --suggest                                 # HSTU d6, default costs
//   weft plan --suggest --trace run.trace.json --variant full_split_d3 --config-out mine
//   weft plan --suggest --schedule my_schedule.json --max-threads 3 --max-lookahead 4
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "weft/plan/simulate.hpp"

namespace weft::tools {

struct SuggestCliOptions {
  bool enabled = false;
  int max_threads = 4;
  int min_lookahead = 0;
  int max_lookahead = -1;  // -1: the schedule's largest
  int num_best = 3;
  double wake_up_us = 0;  // SimulationOptions::thread_wake_up_us
  // SimulationOptions::gil_tasks; "all": every task of the schedule.
  std::vector<std::string> gil_tasks;
  // TASK=PRODUCER: in the costs --trace measures, TASK's body waits for PRODUCER's GPU work of
  // its batch (plan::TraceCostOptions::gpu_waits).
  std::vector<std::string> gpu_waits;
  std::string config_prefix = "weft-suggest";  // writes PREFIX-1.json ... PREFIX-N.json
};

// What `weft plan` was given besides the search's own options.
struct SuggestInputs {
  std::string out;  // the HTML report
  std::string json_path;
  std::vector<std::string> variants;
  std::string costs_path;
  std::string schedule_path;
  std::vector<std::string> traces;
  // --steps, --batches, --slowed-stream, --overlap-slowdown (the search adds its own options).
  plan::SimulationOptions simulation;
};

void add_suggest_options(CLI::App& command, SuggestCliOptions& options);
void run_suggest(const SuggestCliOptions& options, const SuggestInputs& inputs);

}  // namespace weft::tools
