// EngineOptions::interrupt_check: the caller's hook while a threaded progress() waits. A hook
// that throws aborts the step with its error, as a failing body would: no thread hangs, the
// tasks not yet started are skipped, and reset() makes the engine usable again.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

struct Interrupted : std::runtime_error {
  Interrupted() : std::runtime_error("interrupted") {}
};

// "slow" blocks its thread for 300 ms; "after" waits for it on another thread.
Schedule slow_then_after(std::atomic<int>& num_after_runs) {
  Schedule s;
  s.add_stream("other").add_input("input");
  s.add(Task("slow").reads("input").writes("x").body(
      [](TaskContext&) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }));
  s.add(Task("after").stream("other").reads("x").body([&](TaskContext&) { ++num_after_runs; }));
  return s;
}

TEST(InterruptCheck, AThrowingCheckAbortsTheStepWithItsError) {
  std::atomic<int> num_after_runs = 0;
  std::atomic<int> num_checks = 0;
  bool interrupt = true;
  EngineOptions options;
  options.interrupt_check = [&] {
    ++num_checks;
    if (interrupt) throw Interrupted();
  };
  Engine engine(slow_then_after(num_after_runs), ThreadMap::per_task(), options);
  engine.set_source(testing::counting_source(3));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(engine.progress(), Interrupted);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The running body finishes (300 ms), its consumer is skipped, the check ran once.
  EXPECT_GE(seconds, 0.25);
  EXPECT_EQ(num_after_runs.load(), 0);
  EXPECT_EQ(num_checks.load(), 1);
  EXPECT_TRUE(engine.failed());

  // reset() discards the batch in flight; the source goes on with the other two.
  interrupt = false;
  engine.reset();
  int num_results = 0;
  while (engine.progress()) ++num_results;
  EXPECT_EQ(num_results, 2);
  EXPECT_EQ(num_after_runs.load(), 2);
  EXPECT_GE(num_checks.load(), 3);  // each 300 ms step waits past the check interval
}

TEST(InterruptCheck, NotCalledWhenTheStepIsFast) {
  std::atomic<int> num_checks = 0;
  EngineOptions options;
  options.interrupt_check = [&] { ++num_checks; };
  Engine engine(hstu::hstu_schedule(), ThreadMap::preset("full_split"), options);
  engine.set_source(testing::counting_source(200, "batch_cpu"));
  int num_results = 0;
  while (engine.progress()) ++num_results;
  EXPECT_EQ(num_results, 200);
  // Only a wait longer than the interval (20 ms) calls it; a loaded machine may make a few.
  EXPECT_LT(num_checks.load(), 20);
}

TEST(InterruptCheck, ABodyErrorBeforeTheCheckWins) {
  Schedule s;
  s.add_stream("other").add_input("input");
  s.add(Task("fails").writes("x").body([](TaskContext&) { throw std::logic_error("body"); }));
  s.add(Task("slow").stream("other").body(
      [](TaskContext&) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }));
  EngineOptions options;
  options.interrupt_check = [] { throw Interrupted(); };
  Engine engine(std::move(s), ThreadMap::per_task(), options);
  engine.set_source(testing::counting_source(1));
  EXPECT_THROW(engine.progress(), std::logic_error);
}

}  // namespace
}  // namespace weft::pipeline
