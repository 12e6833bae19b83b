// A real engine run's Chrome trace, read back and drawn like a simulated timeline.
#include "weft/plan/trace_reader.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <string>
#include <unistd.h>

#include "weft/pipeline/engine.hpp"
#include "weft/pipeline/hstu.hpp"
#include "weft/pipeline/task_context.hpp"

namespace {

using namespace weft;

void busy_for(std::chrono::microseconds duration) {
  const auto end = std::chrono::steady_clock::now() + duration;
  while (std::chrono::steady_clock::now() < end) {
  }
}

TEST(TraceReader, DrawsARealHostBackendRun) {
  pipeline::HstuOptions options{.cascade = pipeline::HstuCascade::kD6};
  for (auto name : pipeline::hstu_task_names()) {
    // forward is the long pole, as on a real step; the rest take a little time each.
    const auto cost = name == "forward" ? std::chrono::microseconds(1500)
                                        : std::chrono::microseconds(100);
    options.bodies.emplace(std::string(name), [cost](pipeline::TaskContext&) { busy_for(cost); });
  }
  pipeline::Engine engine(pipeline::hstu_schedule(options), pipeline::ThreadMap::preset("full_split"),
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
  ASSERT_EQ(t.host.size(), pipeline::hstu_task_names().size());
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

}  // namespace
