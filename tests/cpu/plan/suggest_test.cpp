// weft::plan::suggest on schedules whose best thread map and lookaheads are known by
// construction, on the HSTU schedule (determinism, never worse than the presets it starts from,
// the written config loads and simulates to the predicted step), and its refusals.
#include "weft/plan/suggest.hpp"
#include "weft/plan/trace_costs.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/trace_reader.hpp"

namespace {

using weft::pipeline::CompiledSchedule;
using weft::pipeline::ThreadMap;
using weft::plan::CostModel;
using weft::plan::SuggestOptions;
using weft::plan::SuggestResult;

struct Parsed {
  CompiledSchedule schedule;
  CostModel costs;
};

Parsed parse(const std::string& text) {
  auto file = weft::plan::ScheduleFile::parse(text);
  return {CompiledSchedule(std::move(file.schedule)), file.costs.value_or(CostModel{})};
}

std::string thread_of(const weft::plan::Suggestion& s, const std::string& task) {
  for (const auto& p : s.placement) {
    if (p.task == task) return p.thread;
  }
  ADD_FAILURE() << "no task " << task;
  return {};
}

// a and b keep the host busy 1000 us each and need nothing from each other; c joins them. On
// one thread a progress takes 2010 us; a and b on two threads, 1010 us, and no map does better
// (c cannot start before both). A third thread brings nothing: the fewer threads win the tie.
constexpr const char* kTwoHeavyTasks = R"({
  "streams": ["s1", "s2"],
  "tasks": [
    {"name": "a", "stream": "s1", "writes": ["x"]},
    {"name": "b", "stream": "s2", "writes": ["y"]},
    {"name": "c", "reads": ["x", "y"]}
  ],
  "costs": {"tasks": {"a": {"host_us": 1000}, "b": {"host_us": 1000}, "c": {"host_us": 10}}}
})";

TEST(Suggest, TwoIndependentHostHeavyTasksGoOnDifferentThreads) {
  const auto [schedule, costs] = parse(kTwoHeavyTasks);
  for (int max_threads : {2, 3}) {
    const SuggestResult r = weft::plan::suggest(schedule, costs, {.max_threads = max_threads});
    EXPECT_EQ(r.method, "exact");
    ASSERT_FALSE(r.suggestions.empty());
    const auto& best = r.suggestions[0];
    EXPECT_DOUBLE_EQ(best.step_us, 1010) << max_threads;
    EXPECT_EQ(best.num_threads, 2u) << max_threads;
    EXPECT_NE(thread_of(best, "a"), thread_of(best, "b"));
    EXPECT_EQ(best.bound, "host");
    EXPECT_DOUBLE_EQ(r.start.step_us, 2010);
    // Every partition of 3 tasks into at most 2 (1 + 3) or 3 (Bell(3) = 5) threads, lookaheads
    // fixed at 0 by the schedule.
    EXPECT_EQ(r.num_evaluated, max_threads == 2 ? 4u : 5u);
    EXPECT_EQ(r.num_refused, 0u);
  }
}

// s (10 us) feeds a and b (1000 us each, independent), c (10 us) joins them. On one thread:
// 2020 us. On two ({s, a | b, c} at best), b's thread blocks on s once: 1020 us plus one wake-up
// (c, after b on its thread, finds a done). A wake-up over 1000 us makes one thread win.
constexpr const char* kFork = R"({
  "streams": ["s1", "s2"],
  "tasks": [
    {"name": "s", "writes": ["z"]},
    {"name": "a", "stream": "s1", "reads": ["z"], "writes": ["x"]},
    {"name": "b", "stream": "s2", "reads": ["z"], "writes": ["y"]},
    {"name": "c", "reads": ["x", "y"]}
  ],
  "costs": {"tasks": {"s": {"host_us": 10}, "a": {"host_us": 1000}, "b": {"host_us": 1000},
                      "c": {"host_us": 10}}}
})";

TEST(Suggest, WakeUpCostDecidesWhetherThreadsPay) {
  const auto [schedule, costs] = parse(kFork);
  SuggestOptions options{.max_threads = 2};
  for (double wake_up_us : {0.0, 500.0}) {
    options.simulation.thread_wake_up_us = wake_up_us;
    const SuggestResult r = weft::plan::suggest(schedule, costs, options);
    EXPECT_DOUBLE_EQ(r.suggestions.at(0).step_us, 1020 + wake_up_us);
    EXPECT_EQ(r.suggestions.at(0).num_threads, 2u);
  }
  options.simulation.thread_wake_up_us = 2000;
  const SuggestResult r = weft::plan::suggest(schedule, costs, options);
  EXPECT_DOUBLE_EQ(r.suggestions.at(0).step_us, 2020);
  EXPECT_EQ(r.suggestions.at(0).num_threads, 1u);
}

// When every body holds the GIL, a second thread cannot run a and b together: one thread
// (2010 us) is as fast and, with fewer threads, ranks first.
TEST(Suggest, GilBodiesGainNothingFromThreads) {
  const auto [schedule, costs] = parse(kTwoHeavyTasks);
  SuggestOptions options{.max_threads = 2};
  options.simulation.gil_tasks = {"a", "b", "c"};
  const SuggestResult r = weft::plan::suggest(schedule, costs, options);
  EXPECT_DOUBLE_EQ(r.suggestions.at(0).step_us, 2010);
  EXPECT_EQ(r.suggestions.at(0).num_threads, 1u);
}

TEST(Suggest, ExactSearchCountsBellNumbers) {
  const auto [schedule, costs] = parse(R"({
    "tasks": [{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}]
  })");
  // Bell(4) = 15; into at most two threads, 1 + S(4, 2) = 1 + 7.
  EXPECT_EQ(weft::plan::suggest(schedule, costs, {.max_threads = 4}).num_evaluated, 15u);
  EXPECT_EQ(weft::plan::suggest(schedule, costs, {.max_threads = 2}).num_evaluated, 8u);
}

// load copies (memcpy stream) what compute uses (default stream); the host may run only one
// progress ahead of the GPU. At the same lookahead the copy and the compute of one batch are
// serial within a step: 100 + 100 host, 1000 copy, 1000 compute = 2100 us. With load one batch
// ahead, the copy of the next batch overlaps the compute of this one: 1200 us (host 100 + 100,
// then the 1000 us compute; the copy, started after load's body, ends under it).
// load at 0 and compute at 1 would read a batch not yet loaded: the schedule's rules refuse it.
constexpr const char* kLookaheadChain = R"({
  "streams": ["memcpy"],
  "inputs": ["batch_cpu"],
  "tasks": [
    {"name": "load", "stream": "memcpy", "reads": ["batch_cpu"], "writes": ["batch"]},
    {"name": "compute", "reads": ["batch"]}
  ],
  "costs": {"tasks": {"load": {"host_us": 100, "gpu": [{"stream": "memcpy", "us": 1000}]},
                      "compute": {"host_us": 100, "gpu": [{"stream": "default", "us": 1000}]}}}
})";

TEST(Suggest, FindsTheLookaheadThatOverlapsCopyAndCompute) {
  const auto [schedule, costs] = parse(kLookaheadChain);
  SuggestOptions options{.max_threads = 1, .max_lookahead = 1, .num_best = 3};
  options.simulation.max_host_runahead = 1;
  const SuggestResult r = weft::plan::suggest(schedule, costs, options);
  EXPECT_EQ(r.method, "exact");
  EXPECT_EQ(r.num_refused, 1u);
  EXPECT_EQ(r.num_evaluated, 3u);
  ASSERT_EQ(r.suggestions.size(), 1u);  // one suggestion per map, and one map on one thread
  const auto& best = r.suggestions[0];
  EXPECT_DOUBLE_EQ(best.step_us, 1200);
  EXPECT_EQ(best.config.lookahead.at("load"), 1);
  EXPECT_EQ(best.config.lookahead.at("compute"), 0);
  EXPECT_EQ(best.config.thread_map, ThreadMap::legacy());
  EXPECT_EQ(best.bound, "GPU waits across streams (busiest: default, 1000.0 us)");
  EXPECT_DOUBLE_EQ(r.start.step_us, 2100);
}

// Under two threads, the best of each map: one suggestion per partition of the two tasks.
TEST(Suggest, OneSuggestionPerThreadMap) {
  const auto [schedule, costs] = parse(kLookaheadChain);
  SuggestOptions options{.max_threads = 2, .max_lookahead = 1, .num_best = 5};
  options.simulation.max_host_runahead = 1;
  const SuggestResult r = weft::plan::suggest(schedule, costs, options);
  ASSERT_EQ(r.suggestions.size(), 2u);
  EXPECT_NE(r.suggestions[0].num_threads, r.suggestions[1].num_threads);
  for (const auto& s : r.suggestions) EXPECT_EQ(s.config.lookahead.at("load"), 1);
}

// Expects suggest() to throw weft::Error whose message contains `fragment`.
void expect_refusal(const Parsed& p, const SuggestOptions& options, const std::string& fragment) {
  try {
    weft::plan::suggest(p.schedule, p.costs, options);
    ADD_FAILURE() << "no error; expected: " << fragment;
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(Suggest, RefusesASpaceOfOnePoint) {
  expect_refusal(parse(R"({"tasks": [{"name": "only"}]})"), {.max_lookahead = 0},
                 "the search cannot move this schedule: it has one task");
  expect_refusal(parse(kTwoHeavyTasks), {.max_threads = 1},
                 "max_threads is 1 and every lookahead is fixed by the bounds [0, 0]");
}

TEST(Suggest, RefusesBadOptionsAndCostsOfUnknownTasks) {
  const auto [schedule, costs] = parse(kTwoHeavyTasks);
  EXPECT_THROW(weft::plan::suggest(schedule, costs, {.max_threads = 0}), weft::Error);
  EXPECT_THROW(weft::plan::suggest(schedule, costs, {.min_lookahead = 2, .max_lookahead = 1}),
               weft::Error);
  EXPECT_THROW(weft::plan::suggest(schedule, costs, {.num_best = 0}), weft::Error);
  CostModel ghost;
  ghost.tasks["ghost"] = {};
  EXPECT_THROW(weft::plan::suggest(schedule, ghost), weft::Error);
}

SuggestResult suggest_hstu_d6() {
  const CompiledSchedule compiled(
      weft::hstu::hstu_schedule({.cascade = weft::hstu::HstuCascade::kD6}));
  SuggestOptions options;
  for (auto name : ThreadMap::preset_names()) options.start_maps.push_back(ThreadMap::preset(name));
  return weft::plan::suggest(compiled, CostModel::hstu_defaults(), options);
}

TEST(Suggest, HstuIsDeterministicAndNoWorseThanThePresetsItStartsFrom) {
  const SuggestResult a = suggest_hstu_d6();
  const SuggestResult b = suggest_hstu_d6();
  EXPECT_EQ(a.method, "local");
  ASSERT_EQ(a.suggestions.size(), 3u);
  ASSERT_EQ(b.suggestions.size(), 3u);
  for (std::size_t i = 0; i < a.suggestions.size(); ++i) {
    EXPECT_EQ(a.suggestions[i].config.to_json(), b.suggestions[i].config.to_json()) << i;
  }
  EXPECT_EQ(weft::plan::describe(a), weft::plan::describe(b));
  EXPECT_LE(a.suggestions[0].step_us, a.start.step_us);
  for (std::size_t i = 1; i < a.suggestions.size(); ++i) {
    EXPECT_LE(a.suggestions[i - 1].step_us, a.suggestions[i].step_us);
  }
  // Every preset of at most four threads, under the d6 lookaheads, is a start of the search.
  const CompiledSchedule compiled(
      weft::hstu::hstu_schedule({.cascade = weft::hstu::HstuCascade::kD6}));
  for (auto name : ThreadMap::preset_names()) {
    const auto threads = ThreadMap::preset(name).assign(compiled);
    if (threads.num_threads() > 4) continue;
    const auto t = weft::plan::simulate(compiled, threads, CostModel::hstu_defaults());
    EXPECT_LE(a.suggestions[0].step_us, t.step_us) << name;
  }
}

TEST(Suggest, WrittenConfigLoadsAndSimulatesToThePrediction) {
  const SuggestResult r = suggest_hstu_d6();
  for (const auto& s : r.suggestions) {
    const auto config = weft::pipeline::ScheduleConfig::parse(s.config.to_json());
    EXPECT_EQ(config, s.config);
    // The config applied to the schedule as the engine gets it (either cascade: the config
    // sets every lookahead).
    auto schedule = weft::hstu::hstu_schedule({.cascade = weft::hstu::HstuCascade::kD3});
    config.apply(schedule);
    const CompiledSchedule compiled(std::move(schedule));
    const auto threads = config.thread_map.value_or(ThreadMap::legacy()).assign(compiled);
    EXPECT_EQ(threads.num_threads(), s.num_threads);
    const auto t = weft::plan::simulate(compiled, threads, CostModel::hstu_defaults());
    EXPECT_EQ(t.step_us, s.step_us);
    EXPECT_EQ(t.host_step_us, s.host_step_us);
  }
}

// What `weft plan --suggest --trace` reads: the trace file's every run, the median per task.
TEST(Suggest, CostsFromATraceFileAreTheMediansOfItsRuns) {
  const auto trace = weft::plan::read_engine_trace(std::string(WEFT_SOURCE_DIR) +
                                                   "/tests/cpu/plan/data/trace_small.json");
  EXPECT_EQ(trace.task_names, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(trace.host_spans.size(), 8u);
  const CostModel costs = weft::plan::trace_costs(trace, nullptr);
  ASSERT_EQ(costs.tasks.size(), 2u);
  for (const auto& [task, cost] : costs.tasks) {
    EXPECT_DOUBLE_EQ(cost.host_us, 40) << task;
    EXPECT_TRUE(cost.gpu.empty()) << task;
  }
}

}  // namespace
