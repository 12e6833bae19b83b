// Reads the Chrome trace a real run exported (weft::pipeline::Trace::write_chrome_json) into the
// planner's timeline, so a measured progress() is drawn exactly like a simulated one.
//
// One progress() is drawn: of the iterations in which every traced task ran, the second to last
// (steady state). Its step time is the median spacing of those iterations' starts; GPU spans
// (CUDA backend) are those during one step from its start, whatever iteration enqueued them.
//
//   VariantReport measured = read_chrome_trace("full_split_d3.trace.json");
#pragma once

#include <string>
#include <string_view>

#include "weft/pipeline/trace.hpp"
#include "weft/plan/report.hpp"

namespace weft::plan {

VariantReport read_chrome_trace(const std::string& path);
// The same, from the JSON text; `name` labels the variant.
VariantReport parse_chrome_trace(std::string_view json_text, std::string name);

// The engine trace itself, every span of every iteration (what trace_costs reads): tasks
// numbered in order of their first span, threads and streams by the file's track ids (a track
// without a name is called "thread k" / "stream k"), host spans sorted by begin; the waits (flow
// arrows) are not read back.
pipeline::Trace read_engine_trace(const std::string& path);
pipeline::Trace parse_engine_trace(std::string_view json_text);

}  // namespace weft::plan
