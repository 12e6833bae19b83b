#include <gtest/gtest.h>

#include <map>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

// "t3", "s0", ...: append, not literal + string (GCC 12's -Wrestrict misfires on that at -O2).
std::string numbered(char prefix, std::size_t i) {
  return std::string(1, prefix).append(std::to_string(i));
}

using testing::counting_source;
using testing::RunLog;

// One task per lookahead in `cascade`, named t<la>, each reading its predecessor's slot.
Schedule cascade_schedule(const std::vector<int>& cascade, RunLog& log) {
  Schedule s;
  s.add_input("input");
  std::string previous = "input";
  for (std::size_t i = 0; i < cascade.size(); ++i) {
    const std::string name = numbered('t', i);
    const std::string out = numbered('s', i);
    s.add(Task(name).lookahead(cascade[i]).reads(previous).writes(out).body(
        [&log, previous, out](TaskContext& c) {
          log.add(c);
          c.set(out, c.get<std::int64_t>(previous));
        }));
    previous = out;
  }
  return s;
}

TEST(StepRule, PureRule) {
  const StepRule rule(2);
  EXPECT_TRUE(rule.runs(2, 0, 1));
  EXPECT_FALSE(rule.runs(1, 0, 1));
  EXPECT_EQ(rule.batch_at(0, 2), 0);
  EXPECT_FALSE(rule.runs(2, 3, 3));  // drain: nothing new at la 2
  EXPECT_TRUE(rule.runs(0, 4, 3));
  EXPECT_EQ(rule.num_iterations(3), 5);
  EXPECT_EQ(rule.num_iterations(0), 0);
}

// The literal table for la {2, 1, 0} and 3 batches: prefill, steady state, drain.
TEST(StepRule, EngineFollowsTheTableForCascade210) {
  for (const char* map : {"legacy", "per_task"}) {
    RunLog log;
    Engine engine(cascade_schedule({2, 1, 0}, log), ThreadMap::preset(map));
    engine.set_source(counting_source(3));
    std::vector<std::int64_t> results;
    std::vector<std::size_t> runs_after;
    while (auto step = engine.progress()) {
      results.push_back(step->batch_index());
      EXPECT_EQ(step->get<std::int64_t>("s2"), step->batch_index());
      runs_after.push_back(log.runs().size());
    }
    EXPECT_FALSE(engine.progress().has_value());  // end of data stays end of data
    EXPECT_EQ(results, (std::vector<std::int64_t>{0, 1, 2})) << map;
    EXPECT_EQ(runs_after, (std::vector<std::size_t>{6, 8, 9})) << map;
    std::map<std::int64_t, std::vector<std::pair<std::string, std::int64_t>>> by_iteration;
    for (const auto& r : log.runs()) by_iteration[r.iteration].emplace_back(r.task, r.batch);
    for (auto& [i, runs] : by_iteration) std::sort(runs.begin(), runs.end());
    using Runs = std::vector<std::pair<std::string, std::int64_t>>;
    EXPECT_EQ(by_iteration[0], (Runs{{"t0", 0}})) << map;
    EXPECT_EQ(by_iteration[1], (Runs{{"t0", 1}, {"t1", 0}})) << map;
    EXPECT_EQ(by_iteration[2], (Runs{{"t0", 2}, {"t1", 1}, {"t2", 0}})) << map;
    EXPECT_EQ(by_iteration[3], (Runs{{"t1", 2}, {"t2", 1}})) << map;
    EXPECT_EQ(by_iteration[4], (Runs{{"t2", 2}})) << map;
    EXPECT_EQ(by_iteration.size(), 5u) << map;
  }
}

// M batches in give M results for several cascades and batch counts, each task seeing every
// batch exactly once, at the iteration the rule says.
TEST(StepRule, MBatchesGiveMResultsForSeveralCascades) {
  const std::vector<std::vector<int>> cascades = {
      {0}, {1, 0}, {2, 2, 1, 0}, {5, 4, 3, 3, 2, 1, 0}, {3, 0}, {0, 0, 0}};
  for (const auto& cascade : cascades) {
    for (std::int64_t num_batches : {0, 1, 2, 7}) {
      for (const char* map : {"legacy", "per_task", "by_stream"}) {
        RunLog log;
        Engine engine(cascade_schedule(cascade, log), ThreadMap::preset(map));
        engine.set_source(counting_source(num_batches));
        std::int64_t expected = 0;
        while (auto step = engine.progress()) {
          EXPECT_EQ(step->batch_index(), expected);
          EXPECT_EQ(step->get<std::int64_t>(numbered('s', cascade.size() - 1)), expected);
          ++expected;
        }
        EXPECT_EQ(expected, num_batches);
        const int max_la = *std::max_element(cascade.begin(), cascade.end());
        const StepRule rule(max_la);
        const auto runs = log.runs();
        EXPECT_EQ(runs.size(), cascade.size() * static_cast<std::size_t>(num_batches));
        for (const auto& r : runs) {
          const int la = cascade[static_cast<std::size_t>(std::stoi(r.task.substr(1)))];
          EXPECT_TRUE(rule.runs(la, r.iteration, num_batches));
          EXPECT_EQ(rule.batch_at(la, r.iteration), r.batch);
        }
      }
    }
  }
}

TEST(Source, NewSourceResetsAndSwitchingMidFlightIsAnError) {
  RunLog log;
  Engine engine(cascade_schedule({2, 1, 0}, log), ThreadMap::preset("per_task"));
  testing::expect_error([&] { engine.progress(); }, {"before set_source"});
  engine.set_source(counting_source(5));
  ASSERT_TRUE(engine.progress().has_value());
  EXPECT_EQ(engine.num_in_flight(), 2);
  testing::expect_error([&] { engine.set_source(counting_source(1)); },
                        {"in flight", "no switch mid-flight"});
  // Drained: a new source starts again at batch 0 with a fresh ring.
  while (engine.progress()) {
  }
  engine.set_source(counting_source(5));
  auto step = engine.progress();  // pulls batches 0, 1, 2 and finishes batch 0
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(step->batch_index(), 0);
  EXPECT_EQ(step->get<std::int64_t>("s2"), 0);
  // reset() discards what is in flight; the source continues from where it is.
  engine.reset();
  step = engine.progress();
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(step->batch_index(), 0);
  EXPECT_EQ(step->get<std::int64_t>("s2"), 3);
  step = engine.progress();
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(step->get<std::int64_t>("s2"), 4);
  EXPECT_FALSE(engine.progress().has_value());
}

}  // namespace
}  // namespace weft::pipeline
