// The engine records a task's event only when a consumer on another stream waits on it: the
// records it skips are driver calls on the CUDA backend, and the waits it makes still find every
// event they need recorded first.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "test_support.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline {
namespace {

// A host backend that counts record() per task and checks every wait() finds its event recorded.
class CountingBackend final : public testing::ForwardingBackend {
 public:
  struct Counts {
    std::mutex mutex;
    std::map<TaskId, int> records;
    std::map<std::pair<TaskId, std::uint32_t>, bool> recorded;
    int num_waits = 0;
    int num_waits_unrecorded = 0;
  };
  explicit CountingBackend(std::shared_ptr<Counts> counts) : counts_(std::move(counts)) {}
  std::string_view name() const noexcept override { return "counting"; }
  void record(TaskId task, std::uint32_t ring_slot, StreamId stream) override {
    {
      std::lock_guard lock(counts_->mutex);
      ++counts_->records[task];
      counts_->recorded[{task, ring_slot}] = true;
    }
    ForwardingBackend::record(task, ring_slot, stream);
  }
  void wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) override {
    {
      std::lock_guard lock(counts_->mutex);
      ++counts_->num_waits;
      if (!counts_->recorded[{producer, ring_slot}]) ++counts_->num_waits_unrecorded;
    }
    ForwardingBackend::wait(stream, producer, ring_slot);
  }

 private:
  std::shared_ptr<Counts> counts_;
};

TEST(EventRecords, OnlyProducersOfCrossStreamWaitsRecord) {
  for (const char* map : {"legacy", "per_task", "by_stream"}) {
    SCOPED_TRACE(map);
    auto counts = std::make_shared<CountingBackend::Counts>();
    Schedule s;
    s.add_stream("copy");
    s.add(Task("load").stream("copy").lookahead(1).writes("x"));  // waited on from "default"
    s.add(Task("compute").reads("x").writes("y"));                // same-stream consumer only
    s.add(Task("finish").reads("y"));
    Engine engine(std::move(s), ThreadMap::preset(map), std::make_unique<CountingBackend>(counts));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 10; });
    int num_steps = 0;
    while (engine.progress()) ++num_steps;
    ASSERT_EQ(num_steps, 10);
    const TaskId load = engine.schedule().task_id("load");
    EXPECT_EQ(counts->records[load], 10);
    EXPECT_EQ(counts->records.size(), 1u) << "only load's event is ever waited on";
    EXPECT_EQ(counts->num_waits, 10);
    EXPECT_EQ(counts->num_waits_unrecorded, 0);
  }
}

TEST(EventRecords, EveryHstuVariantWaitsOnlyOnRecordedEvents) {
  for (const auto& variant : hstu::hstu_variants()) {
    SCOPED_TRACE(std::string(variant.name));
    auto counts = std::make_shared<CountingBackend::Counts>();
    Engine engine(hstu::hstu_schedule({.cascade = variant.cascade}),
                  ThreadMap::preset(variant.thread_map), std::make_unique<CountingBackend>(counts));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 20; });
    while (engine.progress()) {
    }
    EXPECT_GT(counts->num_waits, 0);
    EXPECT_EQ(counts->num_waits_unrecorded, 0);
    // 4 of the 14 tasks have a consumer on another stream: h2d, finish_shuffle, wait_input_dist,
    // prefetch_embeddings.
    EXPECT_EQ(counts->records.size(), 4u);
  }
}

// A wait on a stale event (the producer's event of an earlier round of the ring, recorded for
// another batch) lets the consumer's stream run before the producer's work of its batch: the
// stream work here would read the previous batch's number. The producer's body is slow, so that
// a consumer that did not wait for it on the host would wait on the stale event.
TEST(EventRecords, WaitsAreOnTheEventOfTheProducersBatch) {
  for (const char* map : {"per_task", "legacy"}) {
    SCOPED_TRACE(map);
    auto written = std::make_shared<std::atomic<std::int64_t>>(-1);
    auto num_stale = std::make_shared<std::atomic<int>>(0);
    auto num_checked = std::make_shared<std::atomic<int>>(0);
    Schedule s;
    s.add_stream("copy");
    s.add(Task("load").stream("copy").writes("x").body([written](TaskContext& c) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      host_stream(c).enqueue([written, batch = c.batch_index()] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        written->store(batch);
      });
    }));
    s.add(Task("use").reads("x").body([written, num_stale, num_checked](TaskContext& c) {
      host_stream(c).enqueue([=, batch = c.batch_index()] {
        if (written->load() != batch) ++*num_stale;
        ++*num_checked;
      });
    }));
    Engine engine(std::move(s), ThreadMap::preset(map));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 20; });
    while (engine.progress()) {
    }
    engine.synchronize();
    EXPECT_EQ(num_checked->load(), 20);
    EXPECT_EQ(num_stale->load(), 0);
  }
}

}  // namespace
}  // namespace weft::pipeline
