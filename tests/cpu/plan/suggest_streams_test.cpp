// Streams a task may move between (Task::movable_to): the schedule file declares them, a schedule
// config moves only a task declared free to move and only onto a stream it may run on, the engine
// runs the moved task on its configured stream, the simulator places its GPU work there, and
// suggest searches the moves (exactly and locally) and finds one that is better by construction.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "weft/core/error.hpp"
#include "weft/pipeline/pipeline.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/suggest.hpp"

namespace {

using weft::pipeline::CompiledSchedule;
using weft::pipeline::ScheduleConfig;

// a and b are independent, each 100 us of GPU work on s1; b may also run on s2, a may not. On one
// stream a step takes 200 us of GPU time; with b on s2 the two overlap and a step takes 100 us,
// which no thread map or lookahead can reach otherwise (the GPU work of one stream is serial).
constexpr const char* kTwoGpuTasks = R"({
  "streams": ["s1", "s2"],
  "tasks": [
    {"name": "a", "stream": "s1"},
    {"name": "b", "stream": "s1", "movable_to": ["s2"]}
  ],
  "costs": {"default_host_us": 1, "tasks": {
    "a": {"host_us": 1, "gpu": [{"stream": "s1", "us": 100}]},
    "b": {"host_us": 1, "gpu": [{"stream": "s1", "us": 100}]}}}
})";

struct Parsed {
  weft::pipeline::Schedule schedule;
  weft::plan::CostModel costs;
};

Parsed parse(const char* text) {
  auto file = weft::plan::ScheduleFile::parse(text);
  return {std::move(file.schedule), *file.costs};
}

std::string stream_of(const weft::plan::Suggestion& s, const std::string& task) {
  for (const auto& p : s.placement) {
    if (p.task == task) return p.stream;
  }
  ADD_FAILURE() << "no task " << task;
  return {};
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const weft::Error& e) {
    for (const auto& f : fragments) EXPECT_NE(e.message().find(f), std::string::npos) << e.message();
    return;
  }
  ADD_FAILURE() << "no weft::Error";
}

TEST(SuggestStreams, MovingTheMovableTaskToTheFreeStreamIsFound) {
  const auto [schedule, costs] = parse(kTwoGpuTasks);
  const CompiledSchedule compiled(schedule);
  // Exact (the space is small) and local (exact_limit 1 forces it), with the lookaheads fixed.
  for (const std::size_t exact_limit : {std::size_t(20000), std::size_t(1)}) {
    SCOPED_TRACE("exact_limit " + std::to_string(exact_limit));
    const auto r = weft::plan::suggest(compiled, costs,
                                       {.max_threads = 2, .max_lookahead = 0, .exact_limit = exact_limit});
    EXPECT_EQ(r.method, exact_limit == 1 ? "local" : "exact");
    EXPECT_DOUBLE_EQ(r.start.step_us, 200);
    ASSERT_FALSE(r.suggestions.empty());
    const auto& best = r.suggestions[0];
    EXPECT_DOUBLE_EQ(best.step_us, 100);
    EXPECT_EQ(best.config.stream, (std::map<std::string, std::string>{{"b", "s2"}}));
    EXPECT_EQ(stream_of(best, "b"), "s2");
    for (const auto& s : r.suggestions) {
      EXPECT_EQ(stream_of(s, "a"), "s1");  // never moved: not declared movable
      EXPECT_FALSE(s.config.stream.contains("a"));
    }
    EXPECT_NE(weft::plan::describe(r).find("streams: b s1->s2"), std::string::npos);
    bool says_streams = false;
    for (const auto& line : r.searched) says_streams |= line.find("b (s1, s2)") != std::string::npos;
    EXPECT_TRUE(says_streams);
    bool says_fixed = false;
    for (const auto& line : r.not_searched) says_fixed |= line.find("streams of the 1 tasks not") == 0;
    EXPECT_TRUE(says_fixed);
  }
}

TEST(SuggestStreams, DeterministicAndTheConfigRoundTrips) {
  const auto [schedule, costs] = parse(kTwoGpuTasks);
  const CompiledSchedule compiled(schedule);
  const auto r1 = weft::plan::suggest(compiled, costs, {.max_threads = 2});
  const auto r2 = weft::plan::suggest(compiled, costs, {.max_threads = 2});
  EXPECT_EQ(weft::plan::describe(r1), weft::plan::describe(r2));
  ASSERT_EQ(r1.suggestions.size(), r2.suggestions.size());
  for (std::size_t i = 0; i < r1.suggestions.size(); ++i) {
    EXPECT_EQ(r1.suggestions[i].config.to_json(), r2.suggestions[i].config.to_json());
    EXPECT_EQ(ScheduleConfig::parse(r1.suggestions[i].config.to_json()), r1.suggestions[i].config);
  }
}

TEST(SuggestStreams, ASpaceMovableOnlyByStreamsIsSearched) {
  const auto [schedule, costs] = parse(kTwoGpuTasks);
  const auto r = weft::plan::suggest(CompiledSchedule(schedule), costs,
                                     {.max_threads = 1, .max_lookahead = 0});
  EXPECT_DOUBLE_EQ(r.suggestions.at(0).step_us, 100);
  EXPECT_EQ(r.num_evaluated, 2u);  // b on s1, b on s2
}

// A loader (h2d: 1000 us on the host) shares the memcpy stream with shuffle (1000 us on the
// host); fwd (10 us) is on the default stream. One thread takes 2010 us a step, and so does every
// map that keeps h2d on memcpy (shuffle waits for h2d's body, and h2d for the previous shuffle's:
// they share a stream), and h2d on the loader stream on shuffle's thread (one thread runs both
// 1000 us bodies): only h2d on the loader stream *and* on a thread of its own halves the step, a
// point that no single step of the local search reaches from the own streams. The local search
// starts from every stream assignment of the movable tasks, and finds it.
constexpr const char* kLoaderBesideShuffle = R"({
  "streams": ["memcpy", "loader"],
  "tasks": [
    {"name": "h2d", "stream": "memcpy", "movable_to": ["loader"]},
    {"name": "shuffle", "stream": "memcpy"},
    {"name": "fwd", "stream": "default"}
  ],
  "costs": {"default_host_us": 1, "tasks": {
    "h2d": {"host_us": 1000, "gpu": [{"stream": "memcpy", "us": 10}]},
    "shuffle": {"host_us": 1000, "gpu": [{"stream": "memcpy", "us": 10}]},
    "fwd": {"host_us": 10, "gpu": [{"stream": "default", "us": 10}]}}}
})";

TEST(SuggestStreams, TheLocalSearchStartsFromEveryStreamAssignment) {
  const auto [schedule, costs] = parse(kLoaderBesideShuffle);
  const CompiledSchedule compiled(schedule);
  const auto local = weft::plan::suggest(compiled, costs,
                                         {.max_threads = 2, .max_lookahead = 0, .exact_limit = 1});
  EXPECT_EQ(local.method, "local");
  ASSERT_FALSE(local.suggestions.empty());
  const auto& best = local.suggestions[0];
  EXPECT_GE(local.start.step_us, 2000);
  EXPECT_LT(best.step_us, 0.6 * local.start.step_us) << best.step_us;
  EXPECT_EQ(best.config.stream, (std::map<std::string, std::string>{{"h2d", "loader"}}));
  EXPECT_NE(stream_of(best, "h2d"), stream_of(best, "shuffle"));
  ASSERT_TRUE(best.config.thread_map.has_value());
  const auto threads = best.config.thread_map->assign(compiled);
  EXPECT_NE(threads.thread_of_task[0], threads.thread_of_task[1]);  // h2d apart from shuffle
  bool described = false;
  for (const auto& line : local.searched) {
    described |= line.find("from every stream assignment of the movable tasks") != std::string::npos;
  }
  EXPECT_TRUE(described);
  // The exact search agrees.
  const auto exact = weft::plan::suggest(compiled, costs, {.max_threads = 2, .max_lookahead = 0});
  EXPECT_EQ(exact.method, "exact");
  EXPECT_DOUBLE_EQ(exact.suggestions[0].step_us, best.step_us);
}

TEST(ScheduleConfigStreams, RefusesMovingATaskTheScheduleDoesNotDeclareMovable) {
  auto schedule = parse(kTwoGpuTasks).schedule;
  expect_error([&] { ScheduleConfig::parse(R"({"stream": {"a": "s2"}, "lookahead": {"a": 1}})").apply(schedule); },
               {"$.stream.a", "task 'a' cannot move to stream 's2'", "its stream is fixed"});
  expect_error([&] { ScheduleConfig::parse(R"({"stream": {"b": "default"}})").apply(schedule); },
               {"$.stream.b", "task 'b' cannot move to stream 'default'",
                "its movable_to allows 's1', 's2' only"});
  expect_error([&] { ScheduleConfig::parse(R"({"stream": {"ghost": "s2"}})").apply(schedule); },
               {"$.stream.ghost", "no task 'ghost'"});
  expect_error([] { ScheduleConfig::parse(R"({"stream": {"b": 2}})"); },
               {"$.stream.b: expected a stream name"});
  EXPECT_EQ(schedule.task("a").lookahead(), 0);  // nothing changed
  EXPECT_EQ(schedule.task("a").stream(), "s1");
  // A config loaded from a file names it.
  const auto path = ::testing::TempDir() + "/move_a.json";
  { std::ofstream(path) << R"({"stream": {"a": "s2"}})"; }
  expect_error([&] { ScheduleConfig::load(path).apply(schedule); }, {"move_a.json: $.stream.a"});
}

TEST(ScheduleConfigStreams, MovingKeepsTheStreamsATaskMayRunOn) {
  auto schedule = parse(kTwoGpuTasks).schedule;
  ScheduleConfig::parse(R"({"stream": {"b": "s2"}})").apply(schedule);
  EXPECT_EQ(schedule.task("b").stream(), "s2");
  EXPECT_EQ(schedule.task("b").movable_to(), (std::vector<std::string>{"s1"}));
  ScheduleConfig::parse(R"({"stream": {"b": "s1"}})").apply(schedule);  // and back
  EXPECT_EQ(schedule.task("b").stream(), "s1");
}

TEST(ScheduleFileStreams, MovableToIsChecked) {
  expect_error([] {
    weft::plan::ScheduleFile::parse(R"({"tasks": [{"name": "a", "movable_to": ["nowhere"]}]})");
  }, {"$.tasks[0].movable_to", "'nowhere' which is not declared"});
  expect_error([] {
    weft::plan::ScheduleFile::parse(
        R"({"streams": ["s1"], "tasks": [{"name": "a", "stream": "s1", "movable_to": ["s1"]}]})");
  }, {"$.tasks[0].movable_to", "twice or as its own stream"});
  expect_error([] {
    weft::plan::ScheduleFile::parse(R"({"tasks": [{"name": "a", "movable_to": "s1"}]})");
  }, {"$.tasks[0].movable_to: expected an array"});
}

// The engine runs a moved task on its configured stream (host backend), and the simulator puts
// the task's GPU work there.
TEST(ScheduleConfigStreams, TheEngineAndTheSimulatorHonourTheMove) {
  auto [schedule, costs] = parse(kTwoGpuTasks);
  std::mutex mutex;
  std::map<std::string, std::string> ran_on;
  for (const char* name : {"a", "b"}) {
    schedule.task(name).body([&](weft::pipeline::TaskContext& c) {
      std::lock_guard lock(mutex);
      ran_on[std::string(c.name())] = c.schedule().stream(c.stream_id()).name;
    });
  }
  ScheduleConfig::parse(R"({"stream": {"b": "s2"}})").apply(schedule);
  const CompiledSchedule compiled(schedule);
  const auto timeline = weft::plan::simulate(
      compiled, weft::pipeline::ThreadMap::legacy().assign(compiled), costs);
  EXPECT_DOUBLE_EQ(timeline.step_us, 100);
  weft::pipeline::Engine engine(std::move(schedule), weft::pipeline::ThreadMap::legacy());
  engine.set_source([n = 0](weft::pipeline::Batch&) mutable { return n++ < 2; });
  while (engine.progress()) {
  }
  engine.synchronize();
  EXPECT_EQ(ran_on, (std::map<std::string, std::string>{{"a", "s1"}, {"b", "s2"}}));
}

}  // namespace
