#include "plan_suggest.hpp"

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "output_file.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/task.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/simulated_variant.hpp"
#include "weft/plan/suggest.hpp"
#include "weft/plan/trace_costs.hpp"
#include "weft/plan/trace_reader.hpp"

namespace weft::tools {

namespace {

// An integer option in [lo, hi], its default shown in --help.
void add_int_option(CLI::App& command, const std::string& name, int& value, const std::string& help,
                    int lo, int hi) {
  command.add_option(name, value, help)->capture_default_str()->check(CLI::Range(lo, hi));
}

}  // namespace

void add_suggest_options(CLI::App& command, SuggestCliOptions& options) {
  command.add_flag("--suggest", options.enabled,
                   "search thread maps and lookaheads for the lowest simulated step, print the "
                   "best and write each as a schedule config (docs/planner.md)");
  constexpr int kMaxLa = pipeline::kMaxLookahead;
  add_int_option(command, "--max-threads", options.max_threads,
                 "--suggest: threads of a map at most", 1, 64);
  add_int_option(command, "--min-lookahead", options.min_lookahead,
                 "--suggest: lower bound of every task's lookahead", 0, kMaxLa);
  add_int_option(command, "--max-lookahead", options.max_lookahead,
                 "--suggest: upper bound of every task's lookahead (-1: the schedule's largest)",
                 -1, kMaxLa);
  add_int_option(command, "--num-suggestions", options.num_best, "--suggest: how many to keep", 1,
                 100);
  command
      .add_option("--wake-up-us", options.wake_up_us,
                  "--suggest: cost of waking a thread that blocked on another thread's task "
                  "(simulated; 0: instant)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, plan::CostModel::kMaxCostUs));
  command.add_option("--gil", options.gil_tasks,
                     "--suggest: a task whose body holds the GIL (Python bodies), simulated as "
                     "one lock shared by every thread (repeatable; all: every task)");
  command.add_option("--gpu-wait", options.gpu_waits,
                     "--suggest --trace: TASK=PRODUCER, TASK's body waits for PRODUCER's GPU "
                     "work of its batch (e.g. a count its kernel writes): the costs the first "
                     "--trace measures leave that wait out of TASK's host time and the "
                     "simulation makes it (repeatable, one per task)");
  command
      .add_option("--config-out", options.config_prefix,
                  "--suggest: write the schedule configs to PREFIX-1.json ... PREFIX-N.json")
      ->capture_default_str();
}

namespace {

nlohmann::json suggestion_json(const plan::Suggestion& s) {
  nlohmann::json waits = nlohmann::json::array();
  for (const auto& w : s.waits) {
    waits.push_back({{"producer", w.producer},
                     {"consumer", w.consumer},
                     {"rule", plan::to_string(w.rule)},
                     {"waited_us", w.waited_us},
                     {"cause", w.cause}});
  }
  return {{"step_us", s.step_us},
          {"host_step_us", s.host_step_us},
          {"num_threads", s.num_threads},
          {"bound", s.bound},
          {"config", nlohmann::json::parse(s.config.to_json())},
          {"waits", std::move(waits)}};
}

}  // namespace

void run_suggest(const SuggestCliOptions& options, const SuggestInputs& inputs) {
  WEFT_CHECK(inputs.schedule_path.empty() || inputs.variants.empty(),
             "--variant names HSTU variants; it cannot be combined with --schedule");
  WEFT_CHECK(inputs.variants.size() <= 1,
             "--suggest takes at most one --variant (the HSTU cascade and a map to start from)");
  WEFT_CHECK(options.gpu_waits.empty() || (inputs.costs_path.empty() && !inputs.traces.empty()),
             "--gpu-wait applies to the costs the first --trace measures (without --costs: a "
             "cost file says waits_for_gpu_of itself)");
  // Every output is checked before the search and put in place only when all were written.
  OutputFile html_file(inputs.out);
  std::optional<OutputFile> json_file;
  if (!inputs.json_path.empty()) json_file.emplace(inputs.json_path);
  std::vector<std::unique_ptr<OutputFile>> config_files;
  for (int i = 1; i <= options.num_best; ++i) {
    config_files.push_back(
        std::make_unique<OutputFile>(options.config_prefix + "-" + std::to_string(i) + ".json"));
  }

  // The schedule and the maps to start from (and to draw beside the suggestions).
  std::optional<pipeline::Schedule> schedule;
  std::optional<plan::CostModel> costs;
  std::vector<std::pair<std::string, pipeline::ThreadMap>> given_maps;
  std::string cascade = "custom";
  if (!inputs.schedule_path.empty()) {
    auto file = plan::ScheduleFile::load(inputs.schedule_path);
    schedule = std::move(file.schedule);
    costs = std::move(file.costs);
    for (std::size_t i = 0; i < file.thread_maps.size(); ++i) {
      given_maps.emplace_back(file.thread_map_names[i], file.thread_maps[i]);
    }
  } else {
    const auto& chosen = hstu::hstu_variant(
        inputs.variants.empty() ? std::string_view("full_split_d6") : inputs.variants[0]);
    schedule = hstu::hstu_schedule({.cascade = chosen.cascade});
    cascade = std::string(hstu::to_string(chosen.cascade));
    if (!inputs.variants.empty()) {
      given_maps.emplace_back(std::string(chosen.name),
                              pipeline::ThreadMap::preset(chosen.thread_map));
    } else {
      for (const auto& v : hstu::hstu_variants()) {
        if (v.cascade != chosen.cascade) continue;
        given_maps.emplace_back(std::string(v.name), pipeline::ThreadMap::preset(v.thread_map));
      }
    }
    costs = plan::CostModel::hstu_defaults();
  }
  const pipeline::CompiledSchedule compiled(*schedule);

  // Costs: --costs, else what the first trace measures (plan::trace_costs: medians over its
  // runs, GPU busy time), else the schedule's own.
  std::string costs_source = inputs.schedule_path.empty() ? "HSTU defaults" : inputs.schedule_path;
  std::vector<plan::VariantReport> traces;
  for (const auto& path : inputs.traces) traces.push_back(plan::read_chrome_trace(path));
  if (!inputs.costs_path.empty()) {
    costs = plan::CostModel::load(inputs.costs_path);
    costs_source = inputs.costs_path;
  } else if (!traces.empty()) {
    costs_source = inputs.traces[0];
    const pipeline::Trace trace = plan::read_engine_trace(costs_source);
    plan::TraceCostOptions trace_options;
    for (const auto& wait : options.gpu_waits) {
      const auto eq = wait.find('=');
      WEFT_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < wait.size(),
                 "--gpu-wait takes TASK=PRODUCER, got '", wait, "'");
      const std::string task = wait.substr(0, eq);
      const bool first = trace_options.gpu_waits.emplace(task, wait.substr(eq + 1)).second;
      WEFT_CHECK(first, "--gpu-wait names task '", task,
                 "' twice: a body waits for one producer's GPU work");
    }
    try {
      costs = plan::trace_costs(trace, &*schedule, trace_options);
    } catch (const Error& e) {
      WEFT_FAIL(costs_source, ": ", e.message());
    }
  }
  if (!costs) {
    std::fprintf(stderr, "weft plan: no costs given; every task counts %.0f us on the host\n",
                 plan::CostModel{}.default_host_us);
    costs = plan::CostModel{};
  }
  try {
    costs->check_against(compiled);
  } catch (const Error& e) {
    WEFT_FAIL(costs_source, ": ", e.message());
  }

  plan::SuggestOptions search_options{.max_threads = options.max_threads,
                                      .min_lookahead = options.min_lookahead,
                                      .max_lookahead = options.max_lookahead,
                                      .num_best = options.num_best};
  search_options.simulation = inputs.simulation;
  search_options.simulation.thread_wake_up_us = options.wake_up_us;
  for (const auto& name : options.gil_tasks) {
    if (name != "all") {
      search_options.simulation.gil_tasks.push_back(name);
      continue;
    }
    for (const auto& task : compiled.tasks())
      search_options.simulation.gil_tasks.push_back(task.name());
  }
  for (const auto& [name, map] : given_maps) search_options.start_maps.push_back(map);
  std::fprintf(stderr, "searching (costs: %s)\n", costs_source.c_str());
  const plan::SuggestResult result = plan::suggest(compiled, *costs, search_options);

  // The report: the suggestions, then the maps given, then the traces.
  std::vector<plan::VariantReport> reports;
  plan::ReportOptions report_options{.title = "weft plan --suggest", .collectives = {}};
  plan::add_collective_inventory(compiled, report_options);
  for (std::size_t i = 0; i < result.suggestions.size(); ++i) {
    const auto& s = result.suggestions[i];
    pipeline::Schedule tuned = *schedule;
    s.config.apply(tuned);
    reports.push_back(plan::simulate_variant("suggest-" + std::to_string(i + 1), "suggested",
                                             pipeline::CompiledSchedule(std::move(tuned)),
                                             *s.config.thread_map, *costs,
                                             search_options.simulation));
  }
  nlohmann::json given = nlohmann::json::array();
  for (const auto& [name, map] : given_maps) {
    reports.push_back(
        plan::simulate_variant(name, cascade, compiled, map, *costs, search_options.simulation));
    given.push_back({{"name", name},
                     {"step_us", reports.back().timeline.step_us},
                     {"host_step_us", reports.back().timeline.host_step_us}});
  }
  for (auto& t : traces) reports.push_back(std::move(t));

  html_file.stage(plan::render_html(reports, report_options));
  nlohmann::json root = {{"method", result.method},
                         {"searched", result.searched},
                         {"not_searched", result.not_searched},
                         {"start", suggestion_json(result.start)},
                         {"given", std::move(given)},
                         {"suggestions", nlohmann::json::array()}};
  for (std::size_t i = 0; i < result.suggestions.size(); ++i) {
    root["suggestions"].push_back(suggestion_json(result.suggestions[i]));
    config_files[i]->stage(result.suggestions[i].config.to_json() + "\n");
  }
  if (json_file) json_file->stage(root.dump(2));
  html_file.commit();
  if (json_file) json_file->commit();
  for (std::size_t i = 0; i < result.suggestions.size(); ++i) config_files[i]->commit();

  std::fputs(plan::describe(result).c_str(), stdout);
  std::printf("wrote %s", inputs.out.c_str());
  if (json_file) std::printf(", %s", inputs.json_path.c_str());
  std::printf(" and %s-1.json ... %s-%zu.json\n", options.config_prefix.c_str(),
              options.config_prefix.c_str(), result.suggestions.size());
}

}  // namespace weft::tools
