#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

using testing::expect_error;

// A config naming a task the schedule lacks changes nothing, whichever entry names it.
TEST(ScheduleConfigTest, ApplyChecksEveryNameBeforeChangingAnything) {
  const ScheduleConfig config = ScheduleConfig::parse(R"({
    "lookahead": {"h2d": 5},
    "same_progress_sync": [{"producer": "ghost", "consumer": "forward", "side": "cpu"}]})");
  Schedule s = hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3});
  expect_error([&] { config.apply(s); }, {"$.same_progress_sync[0].producer", "'ghost'"});
  EXPECT_EQ(s.task("h2d").lookahead(), 2);
  EXPECT_TRUE(s.task("forward").same_progress_sync().empty());
  expect_error([&] { config.check_task_names([](std::string_view n) { return n != "ghost"; }); },
               {"$.same_progress_sync[0].producer"});
  config.check_task_names([](std::string_view) { return true; });
}

TEST(ScheduleConfigTest, RoundTripAndApply) {
  const char* text = R"({
    "thread_map": {"groups": {"io": ["h2d", "start_shuffle", "finish_shuffle"],
                              "dist": ["start_input_dist", "wait_input_dist"]},
                   "rest": "compute"},
    "lookahead": {"h2d": 5, "start_shuffle": 4, "finish_shuffle": 3, "start_input_dist": 3,
                  "wait_input_dist": 2},
    "same_progress_sync": [{"producer": "zero_grad", "consumer": "forward", "side": "cpu"}]
  })";
  const ScheduleConfig config = ScheduleConfig::parse(text);
  EXPECT_EQ(ScheduleConfig::parse(config.to_json()), config);
  ASSERT_TRUE(config.thread_map.has_value());
  EXPECT_EQ(config.thread_map->thread_groups().size(), 2u);

  Schedule s = hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3});
  config.apply(s);
  CompiledSchedule c(std::move(s));
  EXPECT_EQ(c.in_flight(), 6);
  EXPECT_EQ(c.task(c.task_id("finish_shuffle")).lookahead(), 3);
  const auto threads = config.thread_map->assign(c);
  EXPECT_EQ(threads.thread_names, (std::vector<std::string>{"io", "dist", "compute"}));
  bool found = false;
  for (const WaitEdge& w : cross_thread_waits(c, threads)) {
    found |= c.task(w.producer).name() == "finish_shuffle" &&
             c.task(w.consumer).name() == "start_input_dist";
  }
  EXPECT_TRUE(found);  // the d6 lookaheads bring the io -> dist wait

  const ScheduleConfig preset = ScheduleConfig::parse(R"({"thread_map": "full_split"})");
  EXPECT_EQ(preset.thread_map, ThreadMap::preset("full_split"));
  EXPECT_EQ(ScheduleConfig::parse(preset.to_json()), preset);
  EXPECT_EQ(ScheduleConfig::parse("{}"), ScheduleConfig{});
}

TEST(ScheduleConfigTest, SchemaErrorsSayWhere) {
  auto parse = [](const char* text) { return [text] { ScheduleConfig::parse(text); }; };
  expect_error(parse("{"), {"$: not valid JSON"});
  expect_error(parse("[]"), {"$: expected an object"});
  expect_error(parse(R"({"threads": 1})"), {"$.threads: unknown key"});
  expect_error(parse(R"({"thread_map": "nope"})"), {"$.thread_map:", "'nope'"});
  expect_error(parse(R"({"thread_map": 3})"), {"$.thread_map: expected a preset name"});
  expect_error(parse(R"({"thread_map": {"groups": {"io": ["h2d", 4]}}})"),
               {"$.thread_map.groups.io[1]: expected a task name"});
  expect_error(parse(R"({"thread_map": {"grops": {}}})"), {"$.thread_map.grops: unknown key"});
  expect_error(parse(R"({"lookahead": {"h2d": -1}})"), {"$.lookahead.h2d: expected an integer"});
  expect_error(parse(R"({"lookahead": {"h2d": "5"}})"), {"$.lookahead.h2d"});
  expect_error(parse(R"({"same_progress_sync": {}})"), {"$.same_progress_sync: expected an array"});
  expect_error(parse(R"({"same_progress_sync": [{"producer": "a"}]})"),
               {"$.same_progress_sync[0].consumer: missing"});
  expect_error(parse(R"({"thread_map": {"rest": "x"}})"), {"$.thread_map.groups: missing"});
  expect_error(parse(R"({"thread_map": {"groups": {"io": "h2d"}}})"),
               {"$.thread_map.groups.io: expected an array of task names"});
  expect_error(parse(R"({"same_progress_sync": [{"producer": "a", "consumer": "b", "side": "up"}]})"),
               {"$.same_progress_sync[0].side:", "'up'"});
  Schedule s = hstu::hstu_schedule();
  expect_error([&] { ScheduleConfig::parse(R"({"lookahead": {"ghost": 1}})").apply(s); },
               {"$.lookahead.ghost", "no task 'ghost'"});
  expect_error([&] {
    ScheduleConfig::parse(R"({"same_progress_sync": [{"producer": "x", "consumer": "forward"}]})")
        .apply(s);
  }, {"$.same_progress_sync[0].producer", "'x'"});
  expect_error([] { ScheduleConfig::load("/nonexistent/config.json"); },
               {"cannot read schedule config '/nonexistent/config.json'"});
}

TEST(TraceTest, SpansWaitsAndChromeJson) {
  hstu::HstuOptions options{.cascade = hstu::HstuCascade::kD6};
  for (auto name : hstu::hstu_task_names()) {
    options.bodies[std::string(name)] = [](TaskContext& c) {
      if (c.name() == "finish_shuffle" || c.name() == "forward") {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // make the consumer wait
      }
    };
  }
  Engine engine(hstu::hstu_schedule(options), ThreadMap::preset("per_task"), HostBackend(),
                {.trace = true});
  engine.set_source([n = 0](Batch&) mutable { return n++ < 4; });
  while (engine.progress()) {
  }
  const Trace trace = engine.take_trace();
  EXPECT_EQ(trace.host_spans.size(), 14u * 4);
  EXPECT_EQ(trace.thread_names.size(), 14u);
  bool saw_ticket = false;
  for (const HostSpan& s : trace.host_spans) {
    EXPECT_LE(s.begin_us, s.end_us);
    saw_ticket |= s.ticket >= 0;
  }
  EXPECT_TRUE(saw_ticket);
  bool saw_forward_wait = false;
  for (const WaitRecord& w : trace.waits) {
    saw_forward_wait |= trace.task_names[w.producer] == "forward" &&
                        trace.task_names[w.consumer] == "backward";
  }
  EXPECT_TRUE(saw_forward_wait);
  const auto json = nlohmann::json::parse(trace.to_chrome_json());
  int num_spans = 0, num_flow_starts = 0, num_flow_ends = 0;
  for (const auto& e : json.at("traceEvents")) {
    const auto ph = e.at("ph").get<std::string>();
    num_spans += ph == "X";
    num_flow_starts += ph == "s";
    num_flow_ends += ph == "f";
  }
  EXPECT_EQ(num_spans, 14 * 4);
  EXPECT_GT(num_flow_starts, 0);
  EXPECT_EQ(num_flow_starts, num_flow_ends);
  EXPECT_TRUE(engine.take_trace().host_spans.empty());  // taken
}

}  // namespace
}  // namespace weft::pipeline
