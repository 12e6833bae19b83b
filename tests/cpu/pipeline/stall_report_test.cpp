// A progress() that takes longer than EngineOptions::stall_report_s prints, once, where each
// engine thread is: the task it runs, the producer or the collective ticket it waits for.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>

#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline {
namespace {

std::string run_one_slow_step(Schedule schedule, ThreadMap map, double stall_report_s) {
  Engine engine(std::move(schedule), std::move(map), EngineOptions{.stall_report_s = stall_report_s});
  engine.set_source([n = 0](Batch&) mutable { return n++ < 1; });
  testing::internal::CaptureStderr();
  while (engine.progress()) {
  }
  return testing::internal::GetCapturedStderr();
}

void sleep_for_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(StallReport, NamesTheRunningTaskAndWhatOthersWaitFor) {
  // Each pair on its own streams, so that only the data edge and the ticket make threads wait.
  Schedule s;
  s.add_stream("s1").add_stream("s2").add_stream("s3");
  s.add(Task("slow").writes("x").body([](TaskContext&) { sleep_for_ms(600); }));
  s.add(Task("consumer").stream("s1").reads("x"));
  s.add(Task("first_collective").stream("s2").collective().body([](TaskContext&) {
    sleep_for_ms(600);
  }));
  s.add(Task("second_collective").stream("s3").collective());
  const ThreadMap map = ThreadMap::groups({{"a", {"slow"}},
                                           {"b", {"consumer"}},
                                           {"c", {"first_collective"}},
                                           {"d", {"second_collective"}}});
  const std::string report = run_one_slow_step(std::move(s), map, 0.2);
  EXPECT_NE(report.find("progress() has run"), std::string::npos) << report;
  EXPECT_NE(report.find("thread 'a': in task 'slow', running its body"), std::string::npos)
      << report;
  EXPECT_NE(report.find("thread 'b': in task 'consumer', waiting for task 'slow'"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("thread 'c': in task 'first_collective', running its body"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("thread 'd': in task 'second_collective', waiting for collective ticket 1 "
                        "(now serving 0)"),
            std::string::npos)
      << report;
  // Printed once per progress(), however long it goes on.
  EXPECT_EQ(report.find("progress() has run", report.find("progress() has run") + 1),
            std::string::npos)
      << report;
}

// Under the legacy map the body runs on the caller's thread; a thread of the engine's watches.
TEST(StallReport, LegacyReportsTheBodyOnTheCallersThread) {
  Schedule s;
  s.add(Task("slow").body([](TaskContext&) { sleep_for_ms(600); }));
  const std::string report = run_one_slow_step(std::move(s), ThreadMap::legacy(), 0.2);
  EXPECT_NE(report.find("progress() has run"), std::string::npos) << report;
  EXPECT_NE(report.find("thread 'main': in task 'slow', running its body"), std::string::npos)
      << report;
  EXPECT_EQ(report.find("progress() has run", report.find("progress() has run") + 1),
            std::string::npos)
      << report;
}

// The first progress() prefills: four internal iterations of 150 ms, none of them 400 ms long.
TEST(StallReport, TimesTheWholeProgressNotEachIteration) {
  for (const char* map : {"legacy", "per_task"}) {
    SCOPED_TRACE(map);
    Schedule s;
    s.add(Task("ahead").lookahead(3).body([](TaskContext&) { sleep_for_ms(150); }));
    s.add(Task("step"));
    Engine engine(std::move(s), ThreadMap::preset(map), EngineOptions{.stall_report_s = 0.4});
    engine.set_source([n = 0](Batch&) mutable { return n++ < 8; });
    testing::internal::CaptureStderr();
    ASSERT_TRUE(engine.progress().has_value());
    const std::string report = testing::internal::GetCapturedStderr();
    EXPECT_NE(report.find("progress() has run"), std::string::npos) << report;
    EXPECT_EQ(report.find("progress() has run", report.find("progress() has run") + 1),
              std::string::npos)
        << report;
  }
}

TEST(StallReport, ANanOrNegativeThresholdIsRefused) {
  for (double bad : {std::nan(""), -1.0}) {
    Schedule s;
    s.add(Task("a"));
    EXPECT_THROW(Engine(std::move(s), ThreadMap::legacy(), EngineOptions{.stall_report_s = bad}),
                 Error);
  }
}

TEST(StallReport, QuietWhenFastOrTurnedOff) {
  auto schedule = [] {
    Schedule s;
    s.add(Task("slow").writes("x").body([](TaskContext&) { sleep_for_ms(300); }));
    s.add(Task("consumer").reads("x"));
    return s;
  };
  EXPECT_EQ(run_one_slow_step(schedule(), ThreadMap::per_task(), 0), "");
  EXPECT_EQ(run_one_slow_step(schedule(), ThreadMap::per_task(), 30), "");
  EXPECT_EQ(run_one_slow_step(schedule(), ThreadMap::legacy(), 0), "");
  EXPECT_EQ(run_one_slow_step(schedule(), ThreadMap::legacy(), 30), "");
}

// The report reads where each thread is while the threads go on: with a report in every
// progress() (a threshold below any step's time), every read is concurrent with threads moving
// between task waits and ticket waits. Each report must describe a state a thread was in.
TEST(StallReport, ReportsWhileThreadsRunReadConsistentStates) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int num_steps = 0;
  for (std::uint64_t round = 0; std::chrono::steady_clock::now() < deadline; ++round) {
    Engine engine(hstu::hstu_schedule(
                      {.cascade = round % 2 ? hstu::HstuCascade::kD6 : hstu::HstuCascade::kD3}),
                  ThreadMap::per_task(), std::make_unique<HostBackend>(),
                  EngineOptions{.stall_report_s = 1e-9, .spin_us = 0});
    engine.set_source([](Batch&) { return true; });
    testing::internal::CaptureStderr();
    try {
      for (int i = 0; i < 200; ++i, ++num_steps) ASSERT_TRUE(engine.progress().has_value());
    } catch (const std::exception& e) {
      testing::internal::GetCapturedStderr();
      FAIL() << "progress() threw while reporting, after " << num_steps << " steps: " << e.what();
    }
    const std::string report = testing::internal::GetCapturedStderr();
    EXPECT_NE(report.find("progress() has run"), std::string::npos);
  }
  EXPECT_GT(num_steps, 0);
}

}  // namespace
}  // namespace weft::pipeline
