// Helpers shared by the pipeline tests.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline::testing {

// A backend that forwards the required calls to a host backend (the optional ones keep
// Backend's defaults): a test's backend overrides the calls it observes.
class ForwardingBackend : public Backend {
 public:
  void bind(const CompiledSchedule& schedule) override { inner_.bind(schedule); }
  void* stream_handle(StreamId stream) override { return inner_.stream_handle(stream); }
  void record(TaskId task, std::uint32_t ring_slot, StreamId stream) override {
    inner_.record(task, ring_slot, stream);
  }
  void wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) override {
    inner_.wait(stream, producer, ring_slot);
  }
  void synchronize() override { inner_.synchronize(); }
  void join_streams() override { inner_.join_streams(); }
  std::uint64_t fence() override { return inner_.fence(); }
  bool fence_completed(std::uint64_t fence) override { return inner_.fence_completed(fence); }

 private:
  HostBackend inner_;
};

// Runs fn, expects a weft::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& fn, std::vector<std::string> fragments) {
  try {
    fn();
  } catch (const weft::Error& e) {
    for (const std::string& f : fragments) {
      EXPECT_NE(e.message().find(f), std::string::npos)
          << "message: " << e.message() << "\nmissing: " << f;
    }
    return;
  }
  ADD_FAILURE() << "no weft::Error thrown";
}

// A source of num_batches batches whose "input" slot holds the batch's number.
inline Source counting_source(std::int64_t num_batches, std::string slot = "input") {
  auto next = std::make_shared<std::int64_t>(0);
  return [=](Batch& b) {
    if (*next == num_batches) return false;
    b.set(slot, (*next)++);
    return true;
  };
}

// Records (iteration, task, batch) of every run, from any thread.
class RunLog {
 public:
  struct Run {
    std::int64_t iteration;
    std::string task;
    std::int64_t batch;
    bool operator==(const Run&) const = default;
  };
  void add(const TaskContext& c) {
    std::lock_guard lock(mutex_);
    runs_.push_back({c.iteration(), std::string(c.name()), c.batch_index()});
  }
  std::vector<Run> runs() const {
    std::lock_guard lock(mutex_);
    return runs_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<Run> runs_;
};

// Random short delays so that thread interleavings vary. The delay of one call is a function of
// (seed, task, batch, salt) only, so that a failing seed replays the same delays whichever thread
// runs the task: -1 none, 0 a yield, > 0 a sleep of that many microseconds.
inline int jitter_delay_us(std::uint64_t seed, TaskId task, std::int64_t batch,
                           std::uint64_t salt = 0) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + task;
  x = x * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(batch + 1);
  x = x * 0x9e3779b97f4a7c15ull + salt;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const auto r = x % 16;
  if (r < 10) return -1;
  if (r < 14) return 0;
  return static_cast<int>((x >> 8) % 50) + 1;
}

inline void jitter(std::uint64_t seed, const TaskContext& c, std::uint64_t salt = 0) {
  const int delay_us = jitter_delay_us(seed, c.task_id(), c.batch_index(), salt);
  if (delay_us == 0) std::this_thread::yield();
  if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
}

}  // namespace weft::pipeline::testing
