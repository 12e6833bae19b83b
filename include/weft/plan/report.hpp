// The planner's report: one self-contained HTML page (inline SVG and CSS, no script, no network)
// that draws, per variant, the Gantt of one progress() and the task -> stream/thread/lookahead
// topology, with the variants table and the collective inventory per task.
//
//   std::vector<weft::plan::VariantReport> variants = ...;   // simulated or read from traces
//   std::string html = weft::plan::render_html(variants, {.title = "HSTU presets"});
#pragma once

#include <map>
#include <string>
#include <vector>

#include "weft/plan/timeline.hpp"

namespace weft::plan {

// One collective a task enqueues per step (from a cost file or from a real run's inventory).
struct CollectiveCall {
  std::string kind;    // e.g. "AllGather", "SendRecv (a2a values)"
  std::string stream;  // the GPU stream it runs on
  double bytes = 0;    // payload per call, per rank
  int count = 1;       // calls per step
  std::string note;    // what the payload is
};

struct VariantReport {
  std::string name;        // e.g. "full_split_d6"
  std::string cascade;     // e.g. "d3", "d6", or "custom"
  std::string thread_map;  // human description, e.g. "io / data_dist / prefetch / compute (4)"
  std::string source;      // "simulated" or "trace <file>"
  std::vector<TaskPlacement> placement;  // in run order
  Timeline timeline;                     // the steady-state progress() drawn for the variant
};

struct ReportOptions {
  std::string title = "weft plan";  // the page's title and heading
  // task -> the collectives it enqueues; drawn as the collective inventory table when non-empty.
  std::map<std::string, std::vector<CollectiveCall>> collectives;
};

std::string render_html(const std::vector<VariantReport>& variants, const ReportOptions& options);

// Colour of a stream or thread name: fixed for the HSTU names, stable for any other name.
std::string stream_colour(const std::string& stream);
std::string thread_colour(const std::string& thread);

}  // namespace weft::plan
