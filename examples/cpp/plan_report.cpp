// What `weft plan --schedule FILE` does, as a program: read a schedule file (tasks without bodies,
// the thread maps to compare, the costs), simulate steady-state progress() under each thread map
// and write the HTML report (Gantt of one progress, topology, variants table).
//
//   examples/cpp/weft_example_plan examples/cpp/data/schedule.json plan.html
#include <cstdio>
#include <fstream>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/simulated_variant.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SCHEDULE.json OUT.html\n", argv[0]);
    return 2;
  }
  try {
    // Throws weft::Error naming the file and the JSON path of a bad value.
    auto file = weft::plan::ScheduleFile::load(argv[1]);
    const weft::plan::CostModel costs = file.costs.value_or(weft::plan::CostModel{});
    const weft::pipeline::CompiledSchedule compiled(std::move(file.schedule));

    weft::plan::ReportOptions options{.title = std::string("weft plan: ") + argv[1]};
    weft::plan::add_collective_inventory(compiled, options);
    std::vector<weft::plan::VariantReport> reports;
    for (std::size_t i = 0; i < file.thread_maps.size(); ++i) {
      reports.push_back(weft::plan::simulate_variant(file.thread_map_names[i], "custom", compiled,
                                                     file.thread_maps[i], costs));
      const auto& t = reports.back().timeline;
      std::printf("%-12s step %8.1f us  %zu threads  %zu cross-thread waits\n",
                  reports.back().name.c_str(), t.step_us, t.threads.size(), t.waits.size());
    }
    std::ofstream(argv[2]) << weft::plan::render_html(reports, options);
    std::printf("wrote %s\n", argv[2]);
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
