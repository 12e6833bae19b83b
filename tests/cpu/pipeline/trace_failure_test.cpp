// The trace of a failing run is kept: after a task threw, take_trace() returns what was
// recorded, with the failed task's host span and GPU span closed where the failure happened and
// marked failed.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

// The host backend with GPU spans timed on the host clock. As on the CUDA backend (an elapsed
// time needs both events recorded), a span that was begun and never ended cannot be measured:
// take_gpu_spans() throws.
class SpanBackend final : public testing::ForwardingBackend {
 public:
  std::string_view name() const noexcept override { return "spans"; }
  void set_gpu_spans(bool enabled) override { enabled_ = enabled; }
  std::uint64_t begin_gpu_span(TaskId task, StreamId stream, std::int64_t batch) override {
    if (!enabled_) return 0;
    std::lock_guard lock(mutex_);
    spans_.push_back({{task, stream, batch, now_ns(), 0}, false});
    return spans_.size();
  }
  void end_gpu_span(std::uint64_t span, StreamId) override {
    if (span == 0) return;
    std::lock_guard lock(mutex_);
    spans_.at(span - 1).span.end_us = now_ns();
    spans_.at(span - 1).ended = true;
  }
  std::vector<GpuSpan> take_gpu_spans(std::int64_t origin_ns) override {
    std::lock_guard lock(mutex_);
    std::vector<GpuSpan> out;
    for (auto& [span, ended] : spans_) {
      WEFT_CHECK(ended, "span of task ", span.task, " has no end");
      out.push_back(span);
      out.back().begin_us = (span.begin_us - double(origin_ns)) / 1e3;
      out.back().end_us = (span.end_us - double(origin_ns)) / 1e3;
    }
    spans_.clear();
    return out;
  }

 private:
  static double now_ns() {
    return double(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
  }
  struct Pending {
    GpuSpan span;  // times in ns since the clock's epoch until taken
    bool ended;
  };
  bool enabled_ = false;
  std::mutex mutex_;
  std::vector<Pending> spans_;
};

TEST(TraceAfterFailure, TakeTraceReturnsTheFailedRunMarked) {
  for (const char* map : {"legacy", "per_task"}) {
    SCOPED_TRACE(map);
    Schedule s;
    s.add_stream("side");
    s.add(Task("load").stream("side").lookahead(1).writes("x"));
    s.add(Task("step").reads("x").body([](TaskContext& c) {
      if (c.batch_index() == 2) throw std::runtime_error("step failed");
    }));
    Engine engine(std::move(s), ThreadMap::preset(map), std::make_unique<SpanBackend>(),
                  EngineOptions{.trace = true});
    engine.set_source([n = 0](Batch&) mutable { return n++ < 5; });
    EXPECT_THROW(
        {
          while (engine.progress()) {
          }
        },
        std::runtime_error);
    Trace trace;
    ASSERT_NO_THROW(trace = engine.take_trace());
    const TaskId step = engine.schedule().task_id("step");
    int num_failed_host = 0;
    for (const HostSpan& h : trace.host_spans) {
      EXPECT_LE(h.begin_us, h.end_us);
      if (h.failed) {
        ++num_failed_host;
        EXPECT_EQ(h.task, step);
        EXPECT_EQ(h.batch, 2);
      }
    }
    EXPECT_EQ(num_failed_host, 1);
    int num_failed_gpu = 0;
    int num_step_gpu = 0;
    for (const GpuSpan& g : trace.gpu_spans) {
      EXPECT_LE(g.begin_us, g.end_us);
      num_step_gpu += g.task == step ? 1 : 0;
      if (g.failed) {
        ++num_failed_gpu;
        EXPECT_EQ(g.task, step);
        EXPECT_EQ(g.batch, 2);
      }
    }
    EXPECT_EQ(num_step_gpu, 3);  // batches 0, 1 and the failed 2
    EXPECT_EQ(num_failed_gpu, 1);
    // The export says which run failed.
    const auto json = nlohmann::json::parse(trace.to_chrome_json());
    int num_marked = 0;
    for (const auto& e : json["traceEvents"]) {
      if (e.contains("args") && e["args"].contains("failed")) ++num_marked;
    }
    EXPECT_EQ(num_marked, 2);  // the host span and the GPU span
  }
}

}  // namespace
}  // namespace weft::pipeline
