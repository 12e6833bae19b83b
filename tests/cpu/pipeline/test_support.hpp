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
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline::testing {

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

// Random short delays so that thread interleavings vary; deterministic per (seed, thread).
class Jitter {
 public:
  explicit Jitter(std::uint64_t seed) : seed_(seed) {}
  void operator()() const {
    thread_local std::mt19937_64 rng(seed_ ^ std::hash<std::thread::id>{}(std::this_thread::get_id()));
    const auto r = rng() % 16;
    if (r < 10) return;
    if (r < 14) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 50));
    }
  }

 private:
  std::uint64_t seed_;
};

}  // namespace weft::pipeline::testing
