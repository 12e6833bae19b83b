// A slot's value lives until every task that reads it has completed its work on its stream:
// the engine destroys a batch's values only after the stream work enqueued while they were live
// has finished, also at the end of data (which does not wait for that work: a later call
// destroys them) and when the engine itself is destroyed. The stream work here reads the values
// through a pointer taken in the body, as GPU work reads a tensor's memory; under AddressSanitizer
// a value destroyed too early is a heap-use-after-free, in any build a failed liveness check.
#include <gtest/gtest.h>

#include <algorithm>
#include <any>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

// A slot value that knows whether it has been destroyed (the flag outlives it).
struct Tracked {
  std::vector<std::int64_t> payload;  // on the heap: freed memory when the value is gone
  std::shared_ptr<std::atomic<bool>> alive = std::make_shared<std::atomic<bool>>(true);
  explicit Tracked(std::int64_t batch) : payload(64, batch) {}
  Tracked(const Tracked& other) : payload(other.payload) {}
  ~Tracked() { alive->store(false); }
};

// Blocks a stream until opened.
class Gate {
 public:
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
  }
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

struct Reads {
  std::atomic<int> num_reads{0};
  std::atomic<int> num_dead{0};     // the value was destroyed before the stream work ran
  std::atomic<int> num_corrupt{0};  // the payload did not hold the batch's number
};

// "late" (la 1, stream "side") and "early" (la 0, default stream) read the source's value of
// their batch on their stream; both streams are held shut by the gate.
Schedule reading_schedule(std::shared_ptr<Reads> reads, std::shared_ptr<Gate> gate) {
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  auto body = [reads, gate](TaskContext& c) {
    const Tracked* value = &c.get<Tracked>("input");
    const std::int64_t batch = c.batch_index();
    host_stream(c).enqueue([reads, gate, value, batch, alive = value->alive] {
      gate->wait();
      if (!alive->load()) ++reads->num_dead;
      // Read through the pointer as stream work reads device memory: a use after free if the
      // value is gone (AddressSanitizer reports it).
      for (std::int64_t v : value->payload) {
        if (v != batch) {
          ++reads->num_corrupt;
          break;
        }
      }
      ++reads->num_reads;
    });
  };
  s.add(Task("late").lookahead(1).stream("side").reads("input").body(body));
  s.add(Task("early").reads("input").body(body));
  return s;
}

// `alive`, if given, collects each value's liveness flag.
Source tracked_source(std::int64_t num_batches,
                      std::vector<std::shared_ptr<std::atomic<bool>>>* alive = nullptr) {
  return [next = std::int64_t{0}, num_batches, alive](Batch& b) mutable {
    if (next == num_batches) return false;
    b.set("input", Tracked(next++));
    if (alive != nullptr) alive->push_back(b.get<Tracked>("input").alive);
    return true;
  };
}

constexpr std::int64_t kNumBatches = 6;

TEST(SlotLifetime, ValuesOutliveTheStreamWorkThatReadsThem) {
  for (auto map : {"legacy", "per_task", "by_stream"}) {
    SCOPED_TRACE(map);
    auto reads = std::make_shared<Reads>();
    auto gate = std::make_shared<Gate>();
    Engine engine(reading_schedule(reads, gate), ThreadMap::preset(map));
    std::vector<std::shared_ptr<std::atomic<bool>>> alive;
    engine.set_source(tracked_source(kNumBatches, &alive));
    std::int64_t num_steps = 0;
    for (; num_steps < kNumBatches; ++num_steps) ASSERT_TRUE(engine.progress().has_value());
    // Every batch has run its tasks; their stream work has not run yet. The end of data does
    // not wait for it: every value stays until it has run.
    EXPECT_FALSE(engine.progress().has_value());
    EXPECT_EQ(reads->num_reads.load(), 0);
    ASSERT_EQ(alive.size(), static_cast<std::size_t>(kNumBatches));
    for (const auto& a : alive) EXPECT_TRUE(a->load()) << "a value went before its stream work";
    EXPECT_FALSE(engine.progress().has_value());  // a later call keeps them too
    for (const auto& a : alive) EXPECT_TRUE(a->load()) << "a value went before its stream work";
    // Once the work has run, a later call after the end of data destroys every value.
    gate->open();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (reads->num_reads.load() < 2 * kNumBatches &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(reads->num_reads.load(), 2 * kNumBatches);
    EXPECT_EQ(reads->num_dead.load(), 0);
    EXPECT_EQ(reads->num_corrupt.load(), 0);
    // The fences queued behind the reads complete soon after them: calls that do not wait
    // destroy the values once they have.
    const auto any_alive = [&] {
      return std::any_of(alive.begin(), alive.end(), [](const auto& a) { return a->load(); });
    };
    while (any_alive() && std::chrono::steady_clock::now() < deadline) {
      EXPECT_FALSE(engine.progress().has_value());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (const auto& a : alive) EXPECT_FALSE(a->load()) << "a value outlived its stream work";
  }
}

// After the end of data, synchronize() waits for the streams and destroys every value; so does
// a new source once the old one's work has run, without waiting for it.
TEST(SlotLifetime, SynchronizeOrANewSourceDestroysTheLastValues) {
  for (const bool new_source : {false, true}) {
    SCOPED_TRACE(new_source ? "new source" : "synchronize");
    auto reads = std::make_shared<Reads>();
    auto gate = std::make_shared<Gate>();
    Engine engine(reading_schedule(reads, gate), ThreadMap::preset("per_task"));
    std::vector<std::shared_ptr<std::atomic<bool>>> alive;
    engine.set_source(tracked_source(kNumBatches, &alive));
    while (engine.progress()) {
    }
    ASSERT_EQ(alive.size(), static_cast<std::size_t>(kNumBatches));
    for (const auto& a : alive) EXPECT_TRUE(a->load()) << "a value went before its stream work";
    if (new_source) {
      // The new source joins the streams on the device; the old values wait for their work,
      // then go in the new source's calls, without a synchronize().
      engine.set_source(tracked_source(1));
      for (const auto& a : alive) EXPECT_TRUE(a->load()) << "a value went before its work";
      gate->open();
      const auto any_alive = [&] {
        return std::any_of(alive.begin(), alive.end(), [](const auto& a) { return a->load(); });
      };
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (engine.progress()) {
      }
      while (any_alive() && std::chrono::steady_clock::now() < deadline) {
        EXPECT_FALSE(engine.progress().has_value());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      std::thread opener([gate] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        gate->open();
      });
      engine.synchronize();
      opener.join();
      EXPECT_EQ(reads->num_reads.load(), 2 * kNumBatches);
    }
    EXPECT_EQ(reads->num_dead.load(), 0);
    EXPECT_EQ(reads->num_corrupt.load(), 0);
    for (const auto& a : alive) EXPECT_FALSE(a->load()) << "a value outlived its work";
  }
}

// A binding's garbage collector sees every value the engine holds, and none once they are gone.
TEST(SlotLifetime, ForEachValueVisitsEveryValueHeld) {
  Schedule s;
  s.add_input("input");
  s.add(Task("late").lookahead(1).reads("input").writes("x").body([](TaskContext& c) {
    c.set("x", c.get<Tracked>("input"));
  }));
  s.add(Task("early").reads("x"));
  Engine engine(std::move(s), ThreadMap::per_task());
  engine.set_source(tracked_source(3));
  auto count = [&] {
    int n = 0;
    engine.for_each_value([&](const std::any& v) { n += std::any_cast<Tracked>(&v) ? 1 : 0; });
    return n;
  };
  EXPECT_EQ(count(), 0);
  ASSERT_TRUE(engine.progress().has_value());
  // Batch 0's input and x in the result, batch 1's in the ring.
  EXPECT_EQ(count(), 4);
  while (engine.progress()) {
  }
  EXPECT_EQ(count(), 0);
}

// ... the values kept after the end of data for stream work not yet run included.
TEST(SlotLifetime, ForEachValueVisitsTheValuesKeptAfterTheEndOfData) {
  auto reads = std::make_shared<Reads>();
  auto gate = std::make_shared<Gate>();
  Engine engine(reading_schedule(reads, gate), ThreadMap::preset("per_task"));
  engine.set_source(tracked_source(kNumBatches));
  while (engine.progress()) {
  }
  auto count = [&] {
    int n = 0;
    engine.for_each_value([&](const std::any& v) { n += std::any_cast<Tracked>(&v) ? 1 : 0; });
    return n;
  };
  EXPECT_EQ(count(), kNumBatches) << "every batch's value waits for its gated stream work";
  gate->open();
  engine.synchronize();
  EXPECT_EQ(count(), 0);
}

// The engine is destroyed while its streams still hold work that reads the last batches.
TEST(SlotLifetime, DestructorDrainsTheStreamsBeforeDestroyingValues) {
  for (auto map : {"legacy", "per_task"}) {
    SCOPED_TRACE(map);
    auto reads = std::make_shared<Reads>();
    auto gate = std::make_shared<Gate>();
    std::thread opener;
    {
      Engine engine(reading_schedule(reads, gate), ThreadMap::preset(map));
      engine.set_source(tracked_source(kNumBatches));
      // Two results out: batches 0..2 are in the ring or the result, their work is queued.
      ASSERT_TRUE(engine.progress().has_value());
      ASSERT_TRUE(engine.progress().has_value());
      opener = std::thread([gate] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        gate->open();
      });
    }
    opener.join();
    EXPECT_EQ(reads->num_reads.load(), 2 * 2 + 1);  // batches 0, 1 by both tasks, 2 by "late"
    EXPECT_EQ(reads->num_dead.load(), 0);
    EXPECT_EQ(reads->num_corrupt.load(), 0);
  }
}

// A stream that is slow for a while: values are kept until its work is done, then released
// without waiting for the end of the run (the engine does not hoard finished batches).
TEST(SlotLifetime, FinishedBatchesAreReleasedWhileTheRunGoesOn) {
  auto reads = std::make_shared<Reads>();
  auto gate = std::make_shared<Gate>();
  std::weak_ptr<std::atomic<bool>> first_alive;
  Engine engine(reading_schedule(reads, gate), ThreadMap::legacy());
  engine.set_source([next = std::int64_t{0}, &first_alive](Batch& b) mutable {
    b.set("input", Tracked(next));
    if (next++ == 0) first_alive = b.get<Tracked>("input").alive;
    return true;
  });
  ASSERT_TRUE(engine.progress().has_value());
  ASSERT_TRUE(engine.progress().has_value());
  ASSERT_TRUE(engine.progress().has_value());
  ASSERT_FALSE(first_alive.expired());
  EXPECT_TRUE(first_alive.lock()->load()) << "batch 0's stream work has not run yet";
  gate->open();
  // No synchronize(): the run's own progress() calls destroy batch 0's value once its work (and
  // the fence behind it) has run.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool released = false;
  while (!released && std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(engine.progress().has_value());
    released = first_alive.expired() || !first_alive.lock()->load();
    if (!released) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(released) << "batch 0's work is done; its value should be gone";
  EXPECT_EQ(reads->num_dead.load(), 0);
  EXPECT_EQ(reads->num_corrupt.load(), 0);
}


// A host backend that counts synchronize() and join_streams() calls.
class SyncCountingBackend final : public testing::ForwardingBackend {
 public:
  struct Counts {
    std::atomic<int> syncs{0};
    std::atomic<int> joins{0};
  };
  explicit SyncCountingBackend(std::shared_ptr<Counts> counts) : counts_(std::move(counts)) {}
  std::string_view name() const noexcept override { return "sync-counting"; }
  void synchronize() override {
    ++counts_->syncs;
    ForwardingBackend::synchronize();
  }
  void join_streams() override {
    ++counts_->joins;
    ForwardingBackend::join_streams();
  }

 private:
  std::shared_ptr<Counts> counts_;
};

// The end of data does not wait for the streams, but joins them: work the caller queues next on
// any stream of the engine (an optimizer step on the default one) comes after every task's
// stream work of the source, also after work on another stream that no task waited for.
TEST(SlotLifetime, TheCallersWorkAfterTheEndOfDataFollowsTheSourcesOnEveryStream) {
  auto side_done = std::make_shared<std::atomic<int>>(0);
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  s.add(Task("side_work").stream("side").reads("input").body([side_done](TaskContext& c) {
    host_stream(c).enqueue([side_done] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ++*side_done;
    });
  }));
  s.add(Task("main_work").reads("input"));
  Engine engine(std::move(s), ThreadMap::preset("per_task"));
  engine.set_source(testing::counting_source(3));
  while (engine.progress()) {
  }
  auto& default_stream = static_cast<HostBackend&>(engine.backend()).stream(
      engine.schedule().find_stream("default").value());
  auto seen = std::make_shared<std::atomic<int>>(-1);
  default_stream.enqueue([side_done, seen] { seen->store(side_done->load()); });
  engine.synchronize();
  EXPECT_EQ(seen->load(), 3) << "the caller's work ran before the source's side-stream work";
}

// Neither the end of data (it joins the streams on the device and retires its values) nor a new
// source after it waits for the streams: the new source has nothing to discard and joins the
// streams on the device too, so that work queued between two sources (an optimizer step)
// overlaps the next source's first tasks on the host. Where values, batches in flight or an
// error are discarded, the streams are waited for first.
TEST(SlotLifetime, ANewSourceWaitsForTheStreamsOnlyWhereItDiscards) {
  auto counts = std::make_shared<SyncCountingBackend::Counts>();
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  s.add(Task("late").lookahead(1).stream("side").reads("input").writes("x"));
  s.add(Task("early").reads("x"));
  Engine engine(std::move(s), ThreadMap::preset("per_task"),
                std::make_unique<SyncCountingBackend>(counts));
  for (int source = 0; source < 3; ++source) {
    engine.set_source(testing::counting_source(kNumBatches));
    EXPECT_EQ(counts->joins.load(), 2 * source + 1);  // each end of data and set_source()
    int num_steps = 0;
    while (engine.progress()) ++num_steps;
    EXPECT_EQ(num_steps, kNumBatches);
    EXPECT_EQ(counts->syncs.load(), 0) << "no wait: the end of data retires its values";
  }
  // Batches in flight (lookahead 1) and a result with the caller: discarded after a wait.
  engine.set_source(testing::counting_source(kNumBatches));
  ASSERT_TRUE(engine.progress().has_value());
  engine.reset();
  EXPECT_EQ(counts->syncs.load(), 1);
  // A reset right after it holds nothing any more.
  engine.reset();
  EXPECT_EQ(counts->syncs.load(), 1);
  EXPECT_EQ(counts->joins.load(), 8);
}

// The join keeps stream order across sources: work the caller queued on the default stream
// between two sources (slow here) runs before the new source's first task on another stream.
TEST(SlotLifetime, ANewSourcesStreamsRunAfterWorkQueuedBetweenSources) {
  auto caller_done = std::make_shared<std::atomic<bool>>(false);
  auto num_early = std::make_shared<std::atomic<int>>(0);
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  s.add(Task("late").lookahead(1).stream("side").reads("input").writes("x").body(
      [caller_done, num_early](TaskContext& c) {
        host_stream(c).enqueue([caller_done, num_early] {
          if (!caller_done->load()) ++*num_early;
        });
      }));
  s.add(Task("early").reads("x"));
  Engine engine(std::move(s), ThreadMap::preset("per_task"));
  engine.set_source(testing::counting_source(2));
  while (engine.progress()) {
  }
  engine.synchronize();  // the first source's stream work, which ran before any caller's work
  num_early->store(0);
  auto& default_stream = static_cast<HostBackend&>(engine.backend()).stream(
      engine.schedule().find_stream("default").value());
  default_stream.enqueue([caller_done] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    caller_done->store(true);
  });
  engine.set_source(testing::counting_source(2));
  while (engine.progress()) {
  }
  engine.synchronize();  // the end of data does not wait for the streams
  EXPECT_TRUE(caller_done->load());
  EXPECT_EQ(num_early->load(), 0) << "the side stream ran the new source before the caller's work";
}

}  // namespace
}  // namespace weft::pipeline
