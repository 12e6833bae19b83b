// `weft plan`: simulate schedules under thread maps and draw them into one self-contained HTML
// report (Gantt of one progress(), topology, variants table, collective inventory).
//
//   weft plan                                  # the nine HSTU variants, default costs
//   weft plan --variant full_split_d6 --costs my_costs.json -o hstu.html
//   weft plan --schedule my_schedule.json --json waits.json
//   weft plan --trace run.trace.json           # a real run's trace, drawn the same way
//   weft plan --trace run.trace.json --costs costs.json   # and the HSTU variants with those costs
//   weft plan --schedule step.json --batches 4  # 4 micro-batches, fill and drain included
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "command.hpp"
#include "output_file.hpp"
#include "plan_suggest.hpp"
#include "weft/core/error.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/simulate.hpp"
#include "weft/plan/simulated_variant.hpp"
#include "weft/plan/trace_reader.hpp"

namespace weft::tools {
namespace {

struct PlanOptions {
  std::string out = "weft-plan.html";
  std::vector<std::string> variants;
  std::string costs_path;
  std::string schedule_path;
  std::vector<std::string> traces;
  std::string json_path;
  // How every variant is simulated: --steps, --batches, --slowed-stream, --overlap-slowdown.
  plan::SimulationOptions simulation;
};

nlohmann::json timeline_json(const plan::VariantReport& v) {
  using nlohmann::json;
  json out = {{"name", v.name},
              {"cascade", v.cascade},
              {"thread_map", v.thread_map},
              {"source", v.source},
              {"step_us", v.timeline.step_us},
              {"host_step_us", v.timeline.host_step_us},
              {"threads", v.timeline.threads},
              {"streams", v.timeline.streams}};
  out["placement"] = json::array();
  for (const auto& p : v.placement) {
    out["placement"].push_back({{"task", p.task},
                                {"stream", p.stream},
                                {"thread", p.thread},
                                {"lookahead", p.lookahead},
                                {"collective", p.collective}});
  }
  out["host"] = json::array();
  for (const auto& s : v.timeline.host) {
    out["host"].push_back({{"task", s.task},
                           {"thread", s.thread},
                           {"start_us", s.start_us},
                           {"end_us", s.end_us},
                           {"batch", s.batch},
                           {"ticket", s.ticket}});
  }
  out["gpu"] = json::array();
  for (const auto& s : v.timeline.gpu) {
    out["gpu"].push_back(
        {{"task", s.task}, {"stream", s.stream}, {"start_us", s.start_us}, {"end_us", s.end_us}});
  }
  out["waits"] = json::array();
  for (const auto& w : v.timeline.waits) {
    out["waits"].push_back({{"producer", w.producer},
                            {"consumer", w.consumer},
                            {"producer_thread", w.producer_thread},
                            {"consumer_thread", w.consumer_thread},
                            {"rule", plan::to_string(w.rule)},
                            {"released_at_us", w.released_at_us},
                            {"waited_us", w.waited_us},
                            {"cause", w.cause}});
  }
  return out;
}

void run_plan(const PlanOptions& options) {
  WEFT_CHECK(options.schedule_path.empty() || options.variants.empty(),
             "--variant names HSTU variants; it cannot be combined with --schedule");
  // Both outputs are checked before any work, and written aside before either is put in place:
  // a failed run leaves neither.
  OutputFile html_file(options.out);
  std::optional<OutputFile> json_file;
  if (!options.json_path.empty()) json_file.emplace(options.json_path);
  std::vector<plan::VariantReport> reports;
  plan::ReportOptions report_options;
  std::optional<plan::CostModel> costs;
  if (!options.costs_path.empty()) costs = plan::CostModel::load(options.costs_path);
  // A schedule file's own costs are checked when it is read; --costs here.
  auto check_costs = [&](const pipeline::CompiledSchedule& compiled) {
    if (options.costs_path.empty()) return;
    try {
      costs->check_against(compiled);
    } catch (const Error& e) {
      WEFT_FAIL(options.costs_path, ": ", e.message());
    }
  };

  // With --trace, the HSTU variants are drawn too when --variant or --costs asks for them.
  const bool draw_hstu = options.schedule_path.empty() &&
                         (options.traces.empty() || !options.variants.empty() || costs.has_value());
  WEFT_CHECK(draw_hstu || !options.schedule_path.empty() ||
                 (options.simulation.num_batches == 0 && options.simulation.slowed_stream.empty()),
             "--batches, --slowed-stream and --overlap-slowdown shape a simulation, and with "
             "--trace alone nothing is simulated (add --variant or --costs to simulate the HSTU "
             "variants beside the trace)");
  if (!options.schedule_path.empty()) {
    auto file = plan::ScheduleFile::load(options.schedule_path);
    if (!costs) costs = file.costs;
    if (!costs) {
      std::fprintf(stderr, "weft plan: no costs given; every task counts %.0f us on the host\n",
                   plan::CostModel{}.default_host_us);
      costs = plan::CostModel{};
    }
    const pipeline::CompiledSchedule compiled(std::move(file.schedule));
    check_costs(compiled);
    plan::add_collective_inventory(compiled, report_options);
    report_options.title = "weft plan: " + options.schedule_path;
    for (std::size_t i = 0; i < file.thread_maps.size(); ++i) {
      std::fprintf(stderr, "[%zu/%zu] %s\n", i + 1, file.thread_maps.size(),
                   file.thread_map_names[i].c_str());
      reports.push_back(plan::simulate_variant(file.thread_map_names[i], "custom", compiled,
                                               file.thread_maps[i], *costs, options.simulation));
    }
  } else if (draw_hstu) {
    if (!costs) costs = plan::CostModel::hstu_defaults();
    report_options.title = "weft plan: HSTU thread-map presets";
    std::vector<const hstu::HstuVariant*> chosen;
    if (options.variants.empty()) {
      for (const auto& v : hstu::hstu_variants()) chosen.push_back(&v);
    } else {
      for (const auto& name : options.variants) chosen.push_back(&hstu::hstu_variant(name));
    }
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      const auto& v = *chosen[i];
      const pipeline::CompiledSchedule compiled(hstu::hstu_schedule({.cascade = v.cascade}));
      check_costs(compiled);
      if (i == 0) plan::add_collective_inventory(compiled, report_options);
      std::fprintf(stderr, "[%zu/%zu] simulating %.*s\n", i + 1, chosen.size(),
                   int(v.name.size()), v.name.data());
      reports.push_back(plan::simulate_variant(std::string(v.name),
                                               std::string(hstu::to_string(v.cascade)), compiled,
                                               pipeline::ThreadMap::preset(v.thread_map), *costs,
                                               options.simulation));
    }
  }
  for (const auto& path : options.traces) {
    std::fprintf(stderr, "reading trace %s\n", path.c_str());
    reports.push_back(plan::read_chrome_trace(path));
  }

  html_file.stage(plan::render_html(reports, report_options));
  if (json_file) {
    nlohmann::json root = {{"variants", nlohmann::json::array()}};
    for (const auto& r : reports) root["variants"].push_back(timeline_json(r));
    json_file->stage(root.dump(2));
  }
  html_file.commit();
  if (json_file) json_file->commit();
  if (options.simulation.num_batches > 0) {
    std::printf("simulated as one source of %d batches: step = the whole source\n",
                options.simulation.num_batches);
  }
  for (const auto& r : reports) {
    std::printf("%-26s step %9.1f us   host %8.1f us   %2zu threads   %zu waits\n",
                r.name.c_str(), r.timeline.step_us, r.timeline.host_step_us,
                r.timeline.threads.size(), r.timeline.waits.size());
  }
  std::printf("wrote %s%s%s\n", options.out.c_str(), options.json_path.empty() ? "" : " and ",
              options.json_path.c_str());
}

}  // namespace

void register_plan(CLI::App& app) {
  auto options = std::make_shared<PlanOptions>();
  auto* command = app.add_subcommand(
      "plan", "Simulate schedules under thread maps and draw them into one HTML report");
  command->add_option("-o,--out", options->out,
                      "HTML report to write (a regular file, replaced only on success; or a "
                      "device or FIFO, written to)")
      ->capture_default_str();
  command->add_option("--variant", options->variants,
                      "HSTU variant to draw (repeatable; default: all nine)");
  command->add_option("--costs", options->costs_path, "cost file (JSON) for the simulation")
      ->check(CLI::ExistingFile);
  command->add_option("--schedule", options->schedule_path,
                      "a schedule of your own (JSON) instead of the HSTU presets")
      ->check(CLI::ExistingFile);
  command->add_option("--trace", options->traces,
                      "Chrome trace of a real run to draw (repeatable); the HSTU variants are "
                      "drawn next to it with --variant or --costs")
      ->check(CLI::ExistingFile);
  command->add_option("--json", options->json_path,
                      "also write the timelines and every wait as JSON");
  auto* steps = command
                    ->add_option("--steps", options->simulation.num_progress,
                                 "progress() calls to simulate; the second to last is drawn")
                    ->capture_default_str()
                    ->check(CLI::Range(4, 10000));
  command
      ->add_option("--batches", options->simulation.num_batches,
                   "simulate one finite source of this many batches (e.g. a training step of "
                   "that many micro-batches), its fill and drain included, instead of "
                   "steady-state progress() calls (0: steady state); also for --suggest")
      ->capture_default_str()
      ->check(CLI::Range(0, 1'000'000))
      ->excludes(steps);
  auto* slowed = command->add_option(
      "--slowed-stream", options->simulation.slowed_stream,
      "the stream whose GPU work --overlap-slowdown slows (a stream of the schedule)");
  command
      ->add_option("--overlap-slowdown", options->simulation.overlap_slowdown,
                   "--slowed-stream's GPU work runs this many (1 to 100) times slower while "
                   "another stream's work runs beside it (the SMs a concurrent kernel holds); "
                   "also for --suggest")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 100.0))
      ->needs(slowed);
  auto suggest = std::make_shared<SuggestCliOptions>();
  add_suggest_options(*command, *suggest);
  command->callback([options, suggest] {
    WEFT_CHECK(suggest->enabled || suggest->gpu_waits.empty(),
               "--gpu-wait is for --suggest --trace (the costs a trace measures)");
    if (!suggest->enabled) return run_plan(*options);
    run_suggest(*suggest, {options->out, options->json_path, options->variants,
                           options->costs_path, options->schedule_path, options->traces,
                           options->simulation});
  });
}

}  // namespace weft::tools
