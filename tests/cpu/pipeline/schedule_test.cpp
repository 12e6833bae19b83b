#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

using testing::expect_error;

Schedule two_tasks() {
  Schedule s;
  s.add_input("input");
  s.add(Task("a").lookahead(1).reads("input").writes("x"));
  s.add(Task("b").reads("x").writes("y"));
  return s;
}

TEST(Schedule, CompilesAndDerivesRingAndEdges) {
  CompiledSchedule c(two_tasks());
  EXPECT_EQ(c.max_lookahead(), 1);
  EXPECT_EQ(c.in_flight(), 2);
  ASSERT_EQ(c.edges().size(), 1u);
  const Edge& e = c.edges()[0];
  EXPECT_EQ(c.task(e.producer).name(), "a");
  EXPECT_EQ(c.task(e.consumer).name(), "b");
  EXPECT_EQ(e.kind, EdgeKind::kSlot);
  EXPECT_EQ(e.progress_distance, 1);
  EXPECT_FALSE(e.within_progress());
}

TEST(Schedule, RunOrderIsTopologicalWithDeclarationTieBreak) {
  Schedule s;
  s.add(Task("late").depends_on("early"));
  s.add(Task("free1"));
  s.add(Task("early"));
  s.add(Task("free2"));
  CompiledSchedule c(std::move(s));
  std::vector<std::string> order;
  for (TaskId t : c.run_order()) order.push_back(c.task(t).name());
  EXPECT_EQ(order, (std::vector<std::string>{"free1", "early", "late", "free2"}));
}

TEST(Schedule, EarlierProgressEdgesDoNotConstrainRunOrder) {
  // b (la 0) reads what a (la 1) wrote a progress earlier: b may come first in run order.
  Schedule s;
  s.add_input("input");
  s.add(Task("b").reads("x"));
  s.add(Task("a").lookahead(1).reads("input").writes("x"));
  CompiledSchedule c(std::move(s));
  EXPECT_EQ(c.task(c.run_order()[0]).name(), "b");
}

TEST(ScheduleValidation, EveryRuleHasANamedError) {
  expect_error([] { CompiledSchedule{Schedule{}}; }, {"no tasks"});
  expect_error([] {
    Schedule s;
    s.add(Task("a")).add(Task("a"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "unique task names"});
  expect_error([] {
    Schedule s;
    s.add(Task(""));
    CompiledSchedule{std::move(s)};
  }, {"empty name"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").lookahead(-1));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "0 <= lookahead <= 1000"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").lookahead(kMaxLookahead + 1));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "lookahead 1001", "0 <= lookahead <= 1000"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").collective({{"AllReduce", "default", 8, -5}}));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "collective inventory", "AllReduce with count -5", "count >= 1"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").collective({{"AllReduce", "nowhere", 8, 1}}));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "collective inventory", "stream 'nowhere'", "known stream"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").collective({{"", "default", 8, 1}}));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "collective inventory", "no kind"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").stream("nowhere"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "'nowhere'", "known stream"});
  expect_error([] {
    Schedule s;
    s.add_stream("default");
    s.add(Task("a"));
    CompiledSchedule{std::move(s)};
  }, {"'default'", "unique stream names"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").writes("x")).add(Task("b").writes("x"));
    CompiledSchedule{std::move(s)};
  }, {"'x'", "'a'", "'b'", "one writer per slot"});
  expect_error([] {
    Schedule s;
    s.add_input("x").add(Task("a").writes("x"));
    CompiledSchedule{std::move(s)};
  }, {"'x'", "input", "one writer per slot"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").reads("ghost"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "'ghost'", "every read has a writer"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").reads("x").writes("x"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "'x'", "no self edge"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").depends_on("ghost"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "'ghost'", "depends_on", "every edge names a task"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").same_progress_sync("ghost"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "same_progress_sync", "every edge names a task"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").cross_iter_depends_on("ghost", -1));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "cross_iter_depends_on", "every edge names a task"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").depends_on("a"));
    CompiledSchedule{std::move(s)};
  }, {"'a'", "no self edge"});
  expect_error([] {
    Schedule s;
    s.add(Task("p").writes("x")).add(Task("c").reads("x").depends_on("p"));
    CompiledSchedule{std::move(s)};
  }, {"'c'", "'p'", "at most one edge kind"});
  expect_error([] {
    Schedule s;
    s.add(Task("p")).add(Task("c").lookahead(1).depends_on("p"));
    CompiledSchedule{std::move(s)};
  }, {"'c'", "'p'", "la(producer) - la(consumer) - offset >= 0"});
  expect_error([] {
    Schedule s;
    s.add(Task("p")).add(Task("c").cross_iter_depends_on("p", 0));
    CompiledSchedule{std::move(s)};
  }, {"'c'", "offset 0", "cross_iter offsets are < 0"});
  expect_error([] {
    Schedule s;
    s.add_stream("side");
    s.add(Task("p").stream("side")).add(Task("c").cross_iter_depends_on("p", -1));
    CompiledSchedule{std::move(s)};
  }, {"'c'", "'p'", "reaches back at most"});
  expect_error([] {
    Schedule s;
    s.add(Task("a").depends_on("c")).add(Task("b").depends_on("a"));
    s.add(Task("c").same_progress_sync("b"));
    CompiledSchedule{std::move(s)};
  }, {"cycle", "'a'", "'b'", "'c'"});
}

// A rule's error says as data which task (its declaration index) and which field it is about.
TEST(ScheduleValidation, ErrorsCarryTheTaskAndTheField) {
  struct Case {
    std::function<void(Schedule&)> build;
    std::optional<std::size_t> task;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](Schedule& s) { s.add(Task("a")).add(Task("b").stream("nope")); }, 1, "stream"},
      {[](Schedule& s) { s.add(Task("a")).add(Task("a")); }, 1, "name"},
      {[](Schedule& s) { s.add(Task("a").reads("ghost")); }, 0, "reads"},
      {[](Schedule& s) { s.add(Task("a").writes("x")).add(Task("b").writes("x")); }, 1, "writes"},
      {[](Schedule& s) { s.add(Task("a")).add(Task("b").depends_on("c")); }, 1, "depends_on"},
      {[](Schedule& s) { s.add(Task("a").same_progress_sync("a")); }, 0, "same_progress_sync"},
      {[](Schedule& s) { s.add(Task("a").writes("x")).add(Task("b").lookahead(1).reads("x")); }, 1,
       "reads"},
      {[](Schedule& s) {
         s.add(Task("a").collective({{"AllReduce", "default", 8, 0}}));
       },
       0, "collective"},
      {[](Schedule& s) { s.add_stream("s").add_stream("s").add(Task("a")); }, std::nullopt,
       "streams"},
      {[](Schedule& s) { s.add_input("x").add_input("x").add(Task("a")); }, std::nullopt, "inputs"},
      {[](Schedule& s) { s.add(Task("a").depends_on("b")).add(Task("b").depends_on("a")); },
       std::nullopt, "tasks"},
      {[](Schedule&) {}, std::nullopt, "tasks"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    Schedule s;
    cases[i].build(s);
    try {
      CompiledSchedule{std::move(s)};
      ADD_FAILURE() << "no ScheduleError";
    } catch (const ScheduleError& e) {
      EXPECT_EQ(e.task(), cases[i].task) << e.what();
      EXPECT_EQ(e.field(), cases[i].field) << e.what();
      EXPECT_NE(std::string(e.what()).find("compiled_schedule.cpp:"), std::string::npos)
          << e.what();
    }
  }
}

TEST(ScheduleValidation, TaskRefusesACrossIterOffsetOfTheSameOrALaterBatch) {
  EXPECT_THROW(Task("a").cross_iter_depends_on("p", 0), weft::Error);
  EXPECT_THROW(Task("a").cross_iter_depends_on("p", 1), weft::Error);
  EXPECT_EQ(Task("a").cross_iter_depends_on("p", -1).cross_iter_depends_on().size(), 1u);
}

TEST(ScheduleValidation, TaskRefusesALookaheadOutsideTheLimit) {
  EXPECT_THROW(Task("a").lookahead(-1), weft::Error);
  EXPECT_THROW(Task("a").lookahead(kMaxLookahead + 1), weft::Error);
  EXPECT_EQ(Task("a").lookahead(kMaxLookahead).lookahead(), kMaxLookahead);
  EXPECT_EQ(Task("a").lookahead(0).lookahead(), 0);
}

TEST(ScheduleValidation, TheLargestLookaheadCompiles) {
  Schedule s;
  s.add(Task("far").lookahead(kMaxLookahead)).add(Task("near"));
  EXPECT_EQ(CompiledSchedule(std::move(s)).in_flight(), kMaxLookahead + 1);
}

TEST(ScheduleValidation, AllowedEdgeShapes) {
  Schedule s;
  // Same stream: an old batch's producer may be any number of progresses back.
  s.add(Task("opt").cross_iter_depends_on("opt", -1));
  s.add(Task("fwd").cross_iter_depends_on("opt", -1));
  // A sync edge may point from a smaller lookahead to a larger one.
  s.add(Task("ahead").lookahead(1).same_progress_sync("fwd"));
  CompiledSchedule c(std::move(s));
  EXPECT_EQ(c.in_flight(), 2);
  EXPECT_EQ(c.task(c.run_order()[0]).name(), "opt");
  EXPECT_EQ(c.task(c.run_order()[2]).name(), "ahead");
}

TEST(ThreadMapTest, PresetsAndErrors) {
  CompiledSchedule c(hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3}));
  EXPECT_EQ(ThreadMap::preset("default").assign(c).thread_names,
            (std::vector<std::string>{"io", "compute"}));
  EXPECT_EQ(ThreadMap::preset("full_split").assign(c).thread_names,
            (std::vector<std::string>{"io", "data_dist", "prefetch", "compute"}));
  EXPECT_EQ(ThreadMap::preset("io_prefetch_compute").assign(c).num_threads(), 3u);
  EXPECT_EQ(ThreadMap::preset("io_data_dist_compute").assign(c).num_threads(), 3u);
  EXPECT_EQ(ThreadMap::preset("by_stream").assign(c).thread_names,
            (std::vector<std::string>{"default", "memcpy", "data_dist", "prefetch"}));
  EXPECT_EQ(ThreadMap::preset("per_task").assign(c).num_threads(), 14u);
  EXPECT_TRUE(ThreadMap::preset("legacy").assign(c).sequential);
  // Without prefetch_embeddings, the prefetch thread disappears.
  CompiledSchedule no_prefetch(hstu::hstu_schedule({.prefetch = false}));
  EXPECT_EQ(ThreadMap::preset("full_split").assign(no_prefetch).num_threads(), 3u);

  expect_error([] { ThreadMap::preset("nope"); }, {"'nope'", "full_split"});
  expect_error([&] { ThreadMap::groups({{"io", {"h2d", "ghost"}}}, "rest").assign(c); },
               {"'ghost'"});
  expect_error([&] { ThreadMap::groups({{"io", {"h2d"}}, {"x", {"h2d"}}}, "rest").assign(c); },
               {"'h2d'", "one thread per task"});
  expect_error([&] { ThreadMap::groups({{"io", {"h2d"}}}).assign(c); },
               {"mapped to no thread"});
  const auto explicit_map = ThreadMap::groups({{"io", {"h2d"}}}, "rest").assign(c);
  EXPECT_EQ(explicit_map.thread_names, (std::vector<std::string>{"io", "rest"}));
  EXPECT_EQ(explicit_map.tasks_of_thread[0].size(), 1u);
}

}  // namespace
}  // namespace weft::pipeline
