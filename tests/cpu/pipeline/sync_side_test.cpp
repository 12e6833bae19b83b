// same_progress_sync sides: kCpu orders the bodies, kGpu orders the stream work only (the
// consumer's thread does not wait for the producer's body where the backend can wait for a
// record yet to come, as the host backend can), kBoth does both.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

struct Observed {
  std::atomic<std::int64_t> consumer_started{-1};  // batch whose consumer body has begun
  std::atomic<int> num_overlapped{0};    // producer bodies that saw their consumer's body begin
  std::atomic<std::int64_t> produced{-1};  // written by the producer's stream work
  std::atomic<int> num_stream_ordered{0};  // consumer stream work that saw its producer's
  std::atomic<int> num_consumer_runs{0};
  std::atomic<bool> armed{true};  // the producer fails once at most
};

// "p" on stream "ps" waits up to `overlap_ms` in its body for "c" (on stream "cs", thread of its
// own) to begin its body in the same progress; its stream work is slow. c syncs on p with `side`.
Schedule sync_schedule(SyncSide side, std::shared_ptr<Observed> seen, int overlap_ms,
                       std::int64_t failing_batch = -1) {
  Schedule s;
  s.add_stream("ps").add_stream("cs");
  s.add(Task("p").stream("ps").body([=](TaskContext& c) {
    const std::int64_t batch = c.batch_index();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(overlap_ms);
    while (seen->consumer_started.load() != batch && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (seen->consumer_started.load() == batch) ++seen->num_overlapped;
    if (batch == failing_batch && seen->armed.exchange(false)) {
      throw std::runtime_error("producer failed");
    }
    host_stream(c).enqueue([seen, batch] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      seen->produced.store(batch);
    });
  }));
  s.add(Task("c").stream("cs").same_progress_sync("p", side).body([=](TaskContext& c) {
    const std::int64_t batch = c.batch_index();
    seen->consumer_started.store(batch);
    ++seen->num_consumer_runs;
    host_stream(c).enqueue([seen, batch] {
      if (seen->produced.load() == batch) ++seen->num_stream_ordered;
    });
  }));
  return s;
}

constexpr int kNumBatches = 6;

int run(Engine& engine) {
  engine.set_source([n = 0](Batch&) mutable { return n++ < kNumBatches; });
  int num_steps = 0;
  while (engine.progress()) ++num_steps;
  engine.synchronize();
  return num_steps;
}

TEST(SyncSide, GpuOrdersTheStreamsWithoutAHostWait) {
  auto seen = std::make_shared<Observed>();
  Engine engine(sync_schedule(SyncSide::kGpu, seen, 1000), ThreadMap::per_task());
  EXPECT_EQ(run(engine), kNumBatches);
  EXPECT_EQ(seen->num_overlapped.load(), kNumBatches) << "c's body waited for p's";
  EXPECT_EQ(seen->num_stream_ordered.load(), kNumBatches) << "c's stream work overtook p's";
  EXPECT_EQ(cross_thread_waits(engine.schedule(), engine.threads()).size(), 1u)
      << "the wait rules (and the planner) still count the edge: other backends wait on the host";
}

TEST(SyncSide, BothAndCpuOrderTheBodies) {
  for (SyncSide side : {SyncSide::kBoth, SyncSide::kCpu}) {
    SCOPED_TRACE(std::string(to_string(side)));
    auto seen = std::make_shared<Observed>();
    Engine engine(sync_schedule(side, seen, 20), ThreadMap::per_task());
    EXPECT_EQ(run(engine), kNumBatches);
    EXPECT_EQ(seen->num_overlapped.load(), 0) << "c's body began before p's returned";
    if (side == SyncSide::kBoth) {
      EXPECT_EQ(seen->num_stream_ordered.load(), kNumBatches);
    }
  }
}

// The producer fails after its consumer has put a wait for the producer's record on its stream:
// the engine records what the producer had enqueued, so the stream moves on and nothing hangs.
TEST(SyncSide, GpuWaitOnAFailedProducerDoesNotHangTheStream) {
  auto seen = std::make_shared<Observed>();
  Engine engine(sync_schedule(SyncSide::kGpu, seen, 1000, 2), ThreadMap::per_task());
  engine.set_source([n = 0](Batch&) mutable { return n++ < kNumBatches; });
  int num_steps = 0;
  EXPECT_THROW(
      {
        while (engine.progress()) ++num_steps;
      },
      std::runtime_error);
  EXPECT_EQ(num_steps, 2);
  engine.synchronize();
  engine.reset();
  int num_after = 0;
  while (engine.progress()) ++num_after;
  engine.synchronize();
  EXPECT_EQ(num_after, kNumBatches - 3);
}

}  // namespace
}  // namespace weft::pipeline
