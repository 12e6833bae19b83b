// Concurrency stress: several engines act as ranks of one communicator; failure injection.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

// What NCCL needs from the ranks: the n-th collective enqueued is the same on every rank.
// The first rank to reach position n defines it; every other rank must match.
class CollectiveOrderChecker {
 public:
  void enqueue(int rank, const std::string& what) {
    std::lock_guard lock(mutex_);
    auto& position = positions_[rank];
    if (position == order_.size()) {
      order_.push_back(what);
    } else if (order_[position] != what) {
      ++num_mismatches_;
      if (first_mismatch_.empty()) {
        first_mismatch_ = "rank " + std::to_string(rank) + " position " +
                          std::to_string(position) + ": " + what + " vs " + order_[position];
      }
    }
    ++position;
  }
  explicit CollectiveOrderChecker(int num_ranks) : positions_(static_cast<std::size_t>(num_ranks), 0) {}
  std::size_t num_mismatches() const { return num_mismatches_; }
  const std::string& first_mismatch() const { return first_mismatch_; }
  std::size_t size() const { return order_.size(); }

 private:
  std::mutex mutex_;
  std::vector<std::string> order_;
  std::vector<std::size_t> positions_;
  std::size_t num_mismatches_ = 0;
  std::string first_mismatch_;
};

// Every rank runs the HSTU schedule of one cascade under a different thread map; collective
// bodies report (task, batch) to the checker with random delays around them, and assert that
// no two collectives of one rank are ever inside their bodies at once.
void run_ranks(hstu::HstuCascade cascade, std::uint64_t seed, int num_batches) {
  std::vector<std::string> maps;
  for (auto name : ThreadMap::preset_names()) maps.emplace_back(name);
  const int num_ranks = static_cast<int>(maps.size());
  CollectiveOrderChecker checker(num_ranks);
  std::atomic<int> overlap_violations{0};
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(maps.size());
  for (int r = 0; r < num_ranks; ++r) {
    ranks.emplace_back([&, r] {
      try {
        const std::uint64_t rank_seed = seed + static_cast<std::uint64_t>(r);
        std::atomic<bool> in_collective{false};
        hstu::HstuOptions options{.cascade = cascade};
        for (auto name : hstu::hstu_task_names()) {
          options.bodies[std::string(name)] = [&, r](TaskContext& c) {
            testing::jitter(rank_seed, c);
            if (!c.task().is_collective()) return;
            if (in_collective.exchange(true)) ++overlap_violations;
            checker.enqueue(r, std::string(c.name()) + "@" + std::to_string(c.batch_index()));
            testing::jitter(rank_seed, c, 1);
            in_collective.store(false);
          };
        }
        Engine engine(hstu::hstu_schedule(options),
                      ThreadMap::preset(maps[static_cast<std::size_t>(r)]));
        engine.set_source([n = 0, num_batches](Batch&) mutable { return n++ < num_batches; });
        int num_steps = 0;
        while (engine.progress()) ++num_steps;
        if (num_steps != num_batches) errors[static_cast<std::size_t>(r)] = "wrong step count";
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(checker.num_mismatches(), 0u) << checker.first_mismatch() << " (seed " << seed << ")";
  EXPECT_EQ(overlap_violations.load(), 0) << "seed " << seed;
  EXPECT_EQ(checker.size(), static_cast<std::size_t>(num_batches) * 8) << "seed " << seed;
}

TEST(MultiRank, AllRanksEnqueueCollectivesInOneOrderD3) {
  run_ranks(hstu::HstuCascade::kD3, 42, 1500);
}
TEST(MultiRank, AllRanksEnqueueCollectivesInOneOrderD6) {
  run_ranks(hstu::HstuCascade::kD6, 7, 1500);
}

// The benchmark's pattern (bench/pipeline/engine_overhead.hpp), which the jittered tests above
// never reach: empty bodies (hand-offs microseconds apart, so waiters keep crossing from spin to
// sleep), an endless source, an Engine built and destroyed per repetition, every threaded map and
// both cascades. It is the pattern in which the host-backend benchmark hung on a 32-core machine
// (io_data_dist_compute_d3, when the engine slept in std::atomic::wait); on 2 cores it only
// checks the invariants, on many cores (scripts/gpu-test.sh runs it there) it is the stress test
// that would catch a recurrence. A watchdog aborts with the variant's name well before ctest's
// timeout, after the engine's stall report has printed where each thread waits.
TEST(EngineStress, EmptyBodiesEndlessSourceEveryThreadedMapNoHang) {
  constexpr int kEnginesPerVariant = 6;
  constexpr int kStepsPerEngine = 1500;
  std::mutex mutex;
  std::condition_variable finished_cv;
  bool finished = false;
  std::string current;  // the variant now running, for the watchdog
  std::thread watchdog([&] {
    std::unique_lock lock(mutex);
    if (!finished_cv.wait_for(lock, std::chrono::seconds(90), [&] { return finished; })) {
      std::fprintf(stderr, "EngineStress: no progress for 90 s in %s; aborting\n", current.c_str());
      std::abort();
    }
  });
  for (const hstu::HstuVariant& variant : hstu::hstu_variants()) {
    if (variant.thread_map == "legacy") continue;
    {
      std::lock_guard lock(mutex);
      current = std::string(variant.name);
    }
    SCOPED_TRACE(std::string(variant.name));
    // per_task has 14 threads: fewer steps keep the test short on 2 cores.
    const int num_steps = variant.thread_map == "per_task" ? kStepsPerEngine / 5 : kStepsPerEngine;
    for (int e = 0; e < kEnginesPerVariant; ++e) {
      // Odd engines spin on every hand-off (EngineOptions::spin_us), even ones sleep at once:
      // the two wait paths of the futex protocol, whatever the machine's core count picks.
      Engine engine(hstu::hstu_schedule({.cascade = variant.cascade}),
                    ThreadMap::preset(variant.thread_map), std::make_unique<HostBackend>(),
                    EngineOptions{.stall_report_s = 10, .spin_us = e % 2 ? 20.0 : 0.0});
      engine.set_source([](Batch&) { return true; });
      for (int i = 0; i < num_steps; ++i) {
        const auto step = engine.progress();
        ASSERT_TRUE(step.has_value());
        ASSERT_EQ(step->batch_index(), i);
      }
      EXPECT_EQ(engine.num_in_flight(), engine.schedule().max_lookahead());
      engine.synchronize();
      // Nothing is ever enqueued on a stream, so every event is complete when waited on: the
      // host backend never blocks here, and a hang in this pattern is the engine's own.
      EXPECT_EQ(static_cast<HostBackend&>(engine.backend()).num_wait_markers(), 0u);
    }
  }
  {
    std::lock_guard lock(mutex);
    finished = true;
  }
  finished_cv.notify_one();
  watchdog.join();
}

// A task throws at a random step: progress() rethrows that error, nobody hangs, the engine can
// be reset and run to the end; over every thread map and many seeds.
TEST(FailureInjection, RandomTaskThrowsOnRandomStep) {
  for (auto map : ThreadMap::preset_names()) {
    for (std::uint64_t seed = 1; seed <= 12; ++seed) {
      SCOPED_TRACE(std::string(map) + " seed " + std::to_string(seed));
      std::mt19937_64 rng(seed);
      const auto names = hstu::hstu_task_names();
      const std::string victim(names[rng() % names.size()]);
      const int bad_batch = static_cast<int>(rng() % 20);
      std::atomic<bool> armed{true};
      hstu::HstuOptions options{.cascade =
                                    seed % 2 ? hstu::HstuCascade::kD3 : hstu::HstuCascade::kD6};
      for (auto name : names) {
        options.bodies[std::string(name)] = [&, n = std::string(name)](TaskContext& c) {
          testing::jitter(seed, c);
          if (n == victim && c.batch_index() == bad_batch && armed.exchange(false)) {
            throw std::runtime_error("injected failure in " + n);
          }
        };
      }
      Engine engine(hstu::hstu_schedule(options), ThreadMap::preset(map));
      engine.set_source([n = 0](Batch&) mutable { return n++ < 30; });
      int num_steps = 0;
      bool thrown = false;
      try {
        while (engine.progress()) ++num_steps;
      } catch (const std::runtime_error& e) {
        thrown = true;
        EXPECT_EQ(std::string(e.what()), "injected failure in " + victim);
      }
      EXPECT_TRUE(thrown);
      EXPECT_TRUE(engine.failed());
      EXPECT_THROW(engine.progress(), weft::Error);
      engine.reset();
      EXPECT_FALSE(engine.failed());
      int num_after = 0;
      while (engine.progress()) ++num_after;
      // The source went on from where it was; every batch it still gives comes out.
      EXPECT_GT(num_after, 0);
      EXPECT_LE(num_steps + num_after, 30);
    }
  }
}

// The delays a seed gives do not depend on which thread runs a task, nor on the order the
// threads run in: a failing seed replays them.
TEST(Jitter, DelaysAreAFunctionOfTheSeedTaskAndBatch) {
  auto delays = [](std::uint64_t seed, const char* map) {
    std::mutex mutex;
    std::map<std::pair<std::string, std::int64_t>, int> out;
    hstu::HstuOptions options;
    for (auto name : hstu::hstu_task_names()) {
      options.bodies[std::string(name)] = [&](TaskContext& c) {
        testing::jitter(seed, c);
        std::lock_guard lock(mutex);
        out[{std::string(c.name()), c.batch_index()}] =
            testing::jitter_delay_us(seed, c.task_id(), c.batch_index());
      };
    }
    Engine engine(hstu::hstu_schedule(options), ThreadMap::preset(map));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 20; });
    while (engine.progress()) {
    }
    return out;
  };
  const auto first = delays(5, "per_task");
  EXPECT_EQ(first, delays(5, "legacy"));
  EXPECT_EQ(first, delays(5, "full_split"));
  EXPECT_NE(first, delays(6, "per_task"));
  int num_sleeps = 0;
  for (const auto& [run, delay_us] : first) num_sleeps += delay_us > 0 ? 1 : 0;
  EXPECT_GT(num_sleeps, 0);
}

TEST(FailureInjection, InitFailureJoinsThreadsAndThrows) {
  Schedule s;
  s.add(Task("ok"));
  s.add(Task("bad").init([](TaskContext&) { throw std::runtime_error("init failed"); }));
  EXPECT_THROW(Engine(s, ThreadMap::per_task()), std::runtime_error);
  EXPECT_THROW(Engine(s, ThreadMap::legacy()), std::runtime_error);
}

TEST(FailureInjection, SourceFailureIsReported) {
  Schedule s;
  s.add(Task("a"));
  Engine engine(std::move(s), ThreadMap::per_task());
  engine.set_source([](Batch&) -> bool { throw std::runtime_error("loader broke"); });
  EXPECT_THROW(engine.progress(), std::runtime_error);
  EXPECT_TRUE(engine.failed());
  engine.set_source([n = 0](Batch&) mutable { return n++ < 3; });
  int num = 0;
  while (engine.progress()) ++num;
  EXPECT_EQ(num, 3);
}

}  // namespace
}  // namespace weft::pipeline
