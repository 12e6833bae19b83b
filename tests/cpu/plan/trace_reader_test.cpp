// A real engine run's Chrome trace, read back and drawn like a simulated timeline.
#include "weft/plan/trace_reader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/engine.hpp"
#include "weft/pipeline/task_context.hpp"
#include "weft/pipeline/trace.hpp"

namespace {

using namespace weft;

void busy_for(std::chrono::microseconds duration) {
  const auto end = std::chrono::steady_clock::now() + duration;
  while (std::chrono::steady_clock::now() < end) {
  }
}

TEST(TraceReader, DrawsARealHostBackendRun) {
  hstu::HstuOptions options{.cascade = hstu::HstuCascade::kD6};
  for (auto name : hstu::hstu_task_names()) {
    // forward is the long pole, as on a real step; the rest take a little time each.
    const auto cost = name == "forward" ? std::chrono::microseconds(1500)
                                        : std::chrono::microseconds(100);
    options.bodies.emplace(std::string(name), [cost](pipeline::TaskContext&) { busy_for(cost); });
  }
  pipeline::Engine engine(hstu::hstu_schedule(options), pipeline::ThreadMap::preset("full_split"),
                          pipeline::EngineOptions{.trace = true});
  int remaining = 24;
  engine.set_source([&](pipeline::Batch& batch) {
    if (remaining-- == 0) return false;
    batch.set("batch_cpu", remaining);
    return true;
  });
  int num_steps = 0;
  while (engine.progress()) ++num_steps;
  ASSERT_EQ(num_steps, 24);

  const auto path = std::filesystem::temp_directory_path() /
                    ("weft-trace-test-" + std::to_string(::getpid()) + ".json");
  engine.take_trace().write_chrome_json(path.string());
  const plan::VariantReport report = plan::read_chrome_trace(path.string());
  std::filesystem::remove(path);

  const plan::Timeline& t = report.timeline;
  EXPECT_EQ(std::set<std::string>(t.threads.begin(), t.threads.end()),
            (std::set<std::string>{"io", "data_dist", "prefetch", "compute"}));
  ASSERT_EQ(t.host.size(), hstu::hstu_task_names().size());
  for (const auto& a : t.host) {
    EXPECT_GE(a.start_us, 0);
    for (const auto& b : t.host) {
      if (&a != &b && a.thread == b.thread) {
        EXPECT_TRUE(a.end_us <= b.start_us || b.end_us <= a.start_us) << a.task << " " << b.task;
      }
    }
  }
  // Steady state: a step takes at least the compute thread's work (forward alone is 1.5 ms).
  EXPECT_GE(t.step_us, 1500);
  EXPECT_GE(t.host_step_us, 1500);
  for (const auto& w : t.waits) EXPECT_NE(w.producer_thread, w.consumer_thread);
  for (const auto& p : report.placement) {
    if (p.task == "h2d") {
      EXPECT_EQ(p.lookahead, 5);
    }
    if (p.task == "forward") {
      EXPECT_EQ(p.thread, "compute");
    }
  }
  const std::string html = plan::render_html({report}, {});
  EXPECT_NE(html.find("<svg class=gantt"), std::string::npos);
}

TEST(TraceReader, RejectsWhatIsNotAnEngineTrace) {
  EXPECT_THROW(plan::parse_chrome_trace("{\"traceEvents\": []}", "x"), Error);
  EXPECT_THROW(plan::parse_chrome_trace("[1, 2", "x"), Error);
  EXPECT_THROW(plan::read_chrome_trace("/nonexistent/trace.json"), Error);
}

// The smallest trace the engine writes: one thread, tasks a and b, `iterations` iterations.
std::string small_trace(int iterations, const std::string& extra_event = "") {
  std::string events = R"({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "host"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "main"}})";
  for (int i = 0; i < iterations; ++i) {
    for (const char* task : {"a", "b"}) {
      const int ts = 100 * i + (task[0] == 'a' ? 0 : 50);
      events += ",\n    {\"ph\": \"X\", \"name\": \"" + std::string(task) +
                "\", \"pid\": 1, \"tid\": 0, \"ts\": " + std::to_string(ts) +
                ", \"dur\": 40, \"args\": {\"batch\": " + std::to_string(i) +
                ", \"lookahead\": 0, \"iteration\": " + std::to_string(i) + "}}";
    }
  }
  if (!extra_event.empty()) events += ",\n    " + extra_event;
  return "{\"traceEvents\": [" + events + "]}";
}

std::string trace_error(const std::string& text) {
  try {
    plan::parse_chrome_trace(text, "x");
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

// A long run's trace as the engine writes it: tasks a and b on two threads, b waiting for a in
// every iteration (a flow arrow each).
std::string long_trace(int num_iterations) {
  pipeline::Trace trace;
  trace.task_names = {"a", "b"};
  trace.thread_names = {"t0", "t1"};
  for (int i = 0; i < num_iterations; ++i) {
    const double base = 100.0 * i;
    trace.host_spans.push_back({.task = 0, .thread = 0, .batch = i, .iteration = i,
                                .begin_us = base, .end_us = base + 40});
    trace.host_spans.push_back({.task = 1, .thread = 1, .batch = i, .iteration = i,
                                .begin_us = base + 50, .end_us = base + 90});
    trace.waits.push_back({.producer = 0, .consumer = 1, .iteration = i, .begin_us = base + 10,
                           .end_us = base + 50});
  }
  return trace.to_chrome_json();
}

double seconds_to_parse(const std::string& text) {
  const auto start = std::chrono::steady_clock::now();
  const plan::VariantReport report = plan::parse_chrome_trace(text, "long");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(report.timeline.waits.size(), 1u);
  return seconds;
}

// Eight times the events take about eight times as long (a reader quadratic in the number of
// events or flow arrows takes 64 times), within a factor of three for the machine's noise.
TEST(TraceReader, ReadingIsLinearInTheTracesSize) {
  const std::string small = long_trace(4000);
  const std::string large = long_trace(32000);
  const double small_s = std::min(seconds_to_parse(small), seconds_to_parse(small));
  const double large_s = std::min(seconds_to_parse(large), seconds_to_parse(large));
  EXPECT_LT(large_s, 3 * 8 * small_s + 0.05) << small_s << " s for " << small.size()
                                               << " bytes, " << large_s << " s for "
                                               << large.size();
}

TEST(TraceReader, ReadsTheSmallestEngineTrace) {
  const plan::VariantReport report = plan::parse_chrome_trace(small_trace(4), "x");
  ASSERT_EQ(report.timeline.host.size(), 2u);
  EXPECT_DOUBLE_EQ(report.timeline.step_us, 100);
  EXPECT_DOUBLE_EQ(report.timeline.host_step_us, 90);
}

TEST(TraceReader, WrongFieldTypesNameTheEvent) {
  // Event 6 is the appended one (two metadata events, then 2 x 2 spans).
  EXPECT_EQ(trace_error(small_trace(2, R"({"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": 0, "dur": 1,
                                           "args": {"iteration": "three"}})")),
            "trace: traceEvents[6].args.iteration: expected an integer, got \"three\"");
  EXPECT_EQ(trace_error(small_trace(2, R"({"ph": 5})")),
            "trace: traceEvents[6].ph: expected a string, got 5");
  EXPECT_EQ(trace_error(small_trace(2, R"({"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": "soon"})")),
            "trace: traceEvents[6].ts: expected a number, got \"soon\"");
  EXPECT_EQ(trace_error(small_trace(2, R"({"ph": "X", "name": "a", "pid": 1, "tid": 4294967296, "ts": 0})")),
            "trace: traceEvents[6].tid: expected an integer in [-2147483648, 2147483647], got "
            "4294967296");
  EXPECT_EQ(trace_error(small_trace(2, R"(7)")), "trace: traceEvents[6]: expected an object, got 7");
}

TEST(TraceReader, HostSpansWithoutIterationNumbersAreRefused) {
  EXPECT_EQ(trace_error(small_trace(2, R"({"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": 500, "dur": 1})")),
            "trace: traceEvents[6]: host span 'a' has no args.iteration (not a trace written by "
            "weft's engine)");
}

TEST(TraceReader, ErrorsNameTheFile) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("weft-trace-type-" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << small_trace(2, R"({"ph": 5})");
  std::string message;
  try {
    plan::read_chrome_trace(path.string());
  } catch (const Error& e) {
    message = e.message();
  }
  std::filesystem::remove(path);
  EXPECT_EQ(message, path.string() + ": trace: traceEvents[6].ph: expected a string, got 5");
}

}  // namespace
