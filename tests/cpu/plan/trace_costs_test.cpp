// weft::plan::trace_costs on synthetic traces whose GPU busy times are known by construction (a
// span that holds a wait for a producer on another stream, for the collective order or for stream
// order is charged what follows the release; a span without a wait is charged whole), the warm-up
// skip, the refusals, and the engine trace read back from its Chrome JSON.
#include "weft/plan/trace_costs.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/trace.hpp"
#include "weft/plan/trace_reader.hpp"

namespace {

using weft::Error;
using weft::pipeline::GpuSpan;
using weft::pipeline::HostSpan;
using weft::pipeline::Schedule;
using weft::pipeline::SyncSide;
using weft::pipeline::Task;
using weft::pipeline::Trace;
using weft::plan::CostModel;
using weft::plan::GpuCost;
using weft::plan::trace_costs;

HostSpan host(std::uint32_t task, std::int64_t batch, std::int64_t iteration, double begin_us,
              double end_us, int ticket = -1) {
  return {.task = task, .batch = batch, .iteration = iteration, .ticket = ticket,
          .begin_us = begin_us, .end_us = end_us};
}

GpuSpan gpu(std::uint32_t task, std::uint32_t stream, std::int64_t batch, double begin_us,
            double end_us, bool failed = false) {
  return {.task = task, .stream = stream, .batch = batch, .begin_us = begin_us, .end_us = end_us,
          .failed = failed};
}

Trace make_trace(std::vector<std::string> tasks, std::vector<std::string> streams,
                 std::vector<HostSpan> hosts, std::vector<GpuSpan> gpus) {
  Trace t;
  t.task_names = std::move(tasks);
  t.stream_names = std::move(streams);
  t.host_spans = std::move(hosts);
  t.gpu_spans = std::move(gpus);
  return t;
}

Schedule make_schedule(std::vector<std::string> streams, std::vector<Task> tasks) {
  Schedule s;
  for (auto& name : streams) s.add_stream(std::move(name));
  for (auto& task : tasks) s.add(std::move(task));
  return s;
}

// stream -> us of a task's GPU segments.
std::map<std::string, double> gpu_us(const CostModel& costs, const std::string& task) {
  std::map<std::string, double> out;
  for (const auto& seg : costs.tasks.at(task).gpu) out[seg.stream] = seg.us;
  return out;
}

// A writes x on s1, B reads it on s2: B's GPU work waits for A's.
Schedule producer_consumer() {
  return make_schedule({"s1", "s2"}, {Task("A").stream("s1").writes("x"),
                                      Task("B").stream("s2").reads("x")});
}

Trace producer_consumer_trace(double b_begin_us, double b_end_us) {
  return make_trace({"A", "B"}, {"s1", "s2"}, {host(0, 0, 0, 0, 10), host(1, 0, 0, 10, 15)},
                    {gpu(0, 0, 0, 0, 300), gpu(1, 1, 0, b_begin_us, b_end_us)});
}

TEST(TraceCosts, ASpanThatHoldsAWaitForAProducerIsChargedItsBusyTime) {
  const Trace t = producer_consumer_trace(100, 350);  // B could start only when A ended at 300
  const Schedule s = producer_consumer();
  const CostModel costs = trace_costs(t, &s);
  EXPECT_EQ(gpu_us(costs, "B"), (std::map<std::string, double>{{"s2", 50}}));
  EXPECT_EQ(gpu_us(costs, "A"), (std::map<std::string, double>{{"s1", 300}}));
  EXPECT_EQ(costs.tasks.at("B").host_us, 5);
  EXPECT_EQ(costs.default_host_us, 0);
  EXPECT_EQ(gpu_us(trace_costs(t, &s, {.gpu = GpuCost::kSpan}), "B").at("s2"), 250);
  EXPECT_EQ(gpu_us(trace_costs(t, nullptr), "B").at("s2"), 250);  // the edge is unknown
}

// B's body waits for A's GPU work of its batch (a count A's kernel writes): batch 0's span
// [10, 140] holds the wait to A's end at 110 (30 us of host work), batch 1's began after A's
// GPU work ended (40, whole), batch 2's ended before A's did (45, whole: it did not wait for
// all of it); A's failed span of batch 1 does not count.
TEST(TraceCosts, AGpuWaitIsLeftOutOfTheWaitingTasksHostTime) {
  const Trace t = make_trace(
      {"A", "B"}, {"s1", "s2"},
      {host(0, 0, 0, 0, 10), host(1, 0, 0, 10, 140), host(0, 1, 1, 140, 150),
       host(1, 1, 1, 300, 340), host(0, 2, 2, 340, 350), host(1, 2, 2, 450, 495)},
      {gpu(0, 0, 0, 10, 110), gpu(0, 0, 1, 150, 250), gpu(0, 0, 1, 250, 320, true),
       gpu(0, 0, 2, 400, 500)});
  const CostModel waited = trace_costs(t, nullptr, {.gpu_waits = {{"B", "A"}}});
  EXPECT_EQ(waited.tasks.at("B").host_us, 40);  // median of 30, 40, 45
  EXPECT_EQ(waited.tasks.at("B").waits_for_gpu_of, "A");
  EXPECT_EQ(waited.tasks.at("A").waits_for_gpu_of, "");
  const CostModel plain = trace_costs(t, nullptr);
  EXPECT_EQ(plain.tasks.at("B").host_us, 45);  // median of 130, 40, 45
  EXPECT_EQ(plain.tasks.at("B").waits_for_gpu_of, "");
  auto message = [&](std::string task, std::string producer) {
    try {
      trace_costs(t, nullptr, {.gpu_waits = {{task, producer}}});
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("B", "ghost"),
            "trace_costs: gpu_waits producer 'ghost' is not a task of the trace (A, B)");
  EXPECT_EQ(message("ghost", "A"),
            "trace_costs: gpu_waits task 'ghost' is not a task of the trace (A, B)");
  EXPECT_EQ(message("B", "B"), "trace_costs: gpu_waits: 'B' waits for its own GPU work");
}

TEST(TraceCosts, AReleaseOutsideTheSpanLeavesTheSpan) {
  const Schedule s = producer_consumer();
  for (const auto& [begin, end] : std::vector<std::pair<double, double>>{{300, 420}, {10, 290}}) {
    EXPECT_EQ(gpu_us(trace_costs(producer_consumer_trace(begin, end), &s), "B").at("s2"),
              end - begin);
  }
}

TEST(TraceCosts, ACollectiveQueuedBehindAnEarlierOneIsChargedWhatFollowsIt) {
  // C1 (ticket 0) is enqueued first, its GPU work on s1 ends at 500; C2 (ticket 1) has its span
  // on s2 from 10 to 520: 20 us busy. N, not collective, overlaps C1 the same way: 510.
  const Trace t = make_trace(
      {"C1", "C2", "N"}, {"s1", "s2", "s3"},
      {host(0, 0, 0, 0, 5, 0), host(1, 0, 0, 5, 9, 1), host(2, 0, 0, 9, 10)},
      {gpu(0, 0, 0, 0, 500), gpu(1, 1, 0, 10, 520), gpu(2, 2, 0, 10, 520)});
  const CostModel costs = trace_costs(t, nullptr);
  EXPECT_EQ(gpu_us(costs, "C2").at("s2"), 20);
  EXPECT_EQ(gpu_us(costs, "C1").at("s1"), 500);
  EXPECT_EQ(gpu_us(costs, "N").at("s3"), 510);
  // Enqueued in the other order, C1's end is no release for C2.
  const Trace swapped = make_trace({"C1", "C2"}, {"s1", "s2"},
                                   {host(1, 0, 0, 0, 4, 0), host(0, 0, 0, 5, 9, 1)},
                                   {gpu(0, 0, 0, 0, 500), gpu(1, 1, 0, 10, 520)});
  EXPECT_EQ(gpu_us(trace_costs(swapped, nullptr), "C2").at("s2"), 510);
}

TEST(TraceCosts, TheLatestReleaseCountsAndStreamOrderIsOne) {
  const Schedule s = make_schedule({"s1", "s2"}, {Task("A").stream("s1").writes("x"),
                                                  Task("P").stream("s2"),
                                                  Task("B").stream("s2").reads("x")});
  const Trace t = make_trace({"A", "P", "B"}, {"s1", "s2"},
                             {host(0, 0, 0, 0, 1), host(1, 0, 0, 1, 2), host(2, 0, 0, 2, 3)},
                             {gpu(0, 0, 0, 0, 300), gpu(1, 1, 0, -50, 100), gpu(2, 1, 0, 0, 400)});
  EXPECT_EQ(gpu_us(trace_costs(t, &s), "B").at("s2"), 100);      // from A's end at 300
  EXPECT_EQ(gpu_us(trace_costs(t, nullptr), "B").at("s2"), 300);  // from P's end at 100
}

TEST(TraceCosts, CrossIterationAndSameProgressProducersAreMatchedByBatchAndProgress) {
  // C waits for A of the previous batch and, GPU side, for S of the same progress() call; the
  // CPU-side sync with Q orders only the bodies.
  const Schedule s = make_schedule(
      {"s1", "s2", "s3", "s4"},
      {Task("A").stream("s1"), Task("S").stream("s3").lookahead(1),
       Task("Q").stream("s4").lookahead(1),
       Task("C").stream("s2").cross_iter_depends_on("A", -1).same_progress_sync("S", SyncSide::kGpu)
           .same_progress_sync("Q", SyncSide::kCpu)});
  // Progress 1: A and C work on batch 1, S and Q on batch 2. A(0) ends at 200, A(1) at 390, S(2)
  // at 250, S(1) at 330, Q(2) at 350; C(1)'s span is [100, 400].
  const Trace t = make_trace(
      {"A", "S", "Q", "C"}, {"s1", "s2", "s3", "s4"},
      {host(0, 0, 0, 0, 1), host(1, 1, 0, 1, 2), host(2, 1, 0, 2, 3), host(0, 1, 1, 10, 11),
       host(1, 2, 1, 11, 12), host(2, 2, 1, 12, 13), host(3, 1, 1, 13, 14)},
      {gpu(0, 0, 0, 0, 200), gpu(1, 2, 1, 0, 330), gpu(2, 3, 1, 0, 5), gpu(0, 0, 1, 200, 390),
       gpu(1, 2, 2, 0, 250), gpu(2, 3, 2, 100, 350), gpu(3, 1, 1, 100, 400)});
  // Releases: A(0) at 200 and S(2) at 250; not A(1), S(1) or Q(2).
  EXPECT_EQ(gpu_us(trace_costs(t, &s), "C").at("s2"), 150);
}

TEST(TraceCosts, MediansOverTheRunsLeaveFailedSpansOutAndSkipTheWarmUp) {
  // Four runs of B: one waited 200 us for A inside its span, three did not; a fifth failed.
  std::vector<HostSpan> hosts;
  std::vector<GpuSpan> gpus;
  const std::vector<std::pair<double, double>> b_spans = {{0, 400}, {1200, 1500}, {2250, 2530},
                                                          {3200, 3300}};
  for (std::int64_t b = 0; b < 4; ++b) {
    const double at = 1000.0 * double(b);
    hosts.push_back(host(0, b, b, at, at + 1 + double(b)));
    hosts.push_back(host(1, b, b, at + 10, at + 12));
    gpus.push_back(gpu(0, 0, b, at, at + 200));
    gpus.push_back(gpu(1, 1, b, b_spans[b].first, b_spans[b].second));
  }
  gpus.push_back(gpu(1, 1, 4, 4000, 9000, true));
  const Trace t = make_trace({"A", "B"}, {"s1", "s2"}, hosts, gpus);
  const Schedule s = producer_consumer();
  // Busy: 200, 300, 280, 100: the median of an even count is the mean of the middle two.
  EXPECT_EQ(gpu_us(trace_costs(t, &s), "B").at("s2"), 240);
  EXPECT_EQ(gpu_us(trace_costs(t, &s, {.gpu = GpuCost::kSpan}), "B").at("s2"), 290);
  EXPECT_EQ(trace_costs(t, &s).tasks.at("A").host_us, 2.5);  // 1, 2, 3, 4
  // The first half of each task's runs left out: busy 280 and 100, host 3 and 4.
  const CostModel warm = trace_costs(t, &s, {.skip_fraction = 0.5});
  EXPECT_EQ(gpu_us(warm, "B").at("s2"), 190);
  EXPECT_EQ(warm.tasks.at("A").host_us, 3.5);
}

TEST(TraceCosts, TheSameTraceInAnyOrderGivesTheSameCostsAndBusyIsWithinTheSpan) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<HostSpan> hosts;
  std::vector<GpuSpan> gpus;
  for (std::int64_t b = 0; b < 20; ++b) {
    for (std::uint32_t task = 0; task < 3; ++task) {
      const double base = 1000.0 * double(b) + 300.0 * task;
      hosts.push_back(host(task, b, b, base, base + 1 + 49 * u(rng), task != 0 ? int(task) : -1));
      gpus.push_back(gpu(task, task % 2, b, base + 40 * u(rng), base + 100 + 800 * u(rng)));
    }
  }
  const Schedule s = make_schedule({"s1", "s2"}, {Task("A").stream("s1").writes("x"),
                                                  Task("B").stream("s2").reads("x"),
                                                  Task("C").stream("s1").depends_on("B")});
  const std::vector<std::string> tasks = {"A", "B", "C"}, streams = {"s1", "s2"};
  const CostModel first = trace_costs(make_trace(tasks, streams, hosts, gpus), &s);
  for (int i = 0; i < 5; ++i) {
    std::shuffle(hosts.begin(), hosts.end(), rng);
    std::shuffle(gpus.begin(), gpus.end(), rng);
    EXPECT_EQ(trace_costs(make_trace(tasks, streams, hosts, gpus), &s), first);
  }
  const CostModel spans =
      trace_costs(make_trace(tasks, streams, hosts, gpus), &s, {.gpu = GpuCost::kSpan});
  for (const auto& task : tasks) {
    for (const auto& [stream, us] : gpu_us(first, task)) {
      EXPECT_GE(us, 0) << task;
      EXPECT_LE(us, gpu_us(spans, task).at(stream)) << task;
    }
  }
}

TEST(TraceCosts, BadInputIsRefused) {
  const Trace t = producer_consumer_trace(100, 350);
  const Schedule other = make_schedule({"s1"}, {Task("A").stream("s1").writes("x"),
                                                Task("Z").stream("s1").reads("x")});
  try {
    trace_costs(t, &other);
    FAIL() << "a schedule task the trace lacks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("schedule task 'Z' is not a task of the trace (A, B)"),
              std::string::npos)
        << e.message();
  }
  EXPECT_THROW(trace_costs(t, nullptr, {.skip_fraction = 1}), Error);
  EXPECT_THROW(trace_costs(t, nullptr, {.skip_fraction = -0.1}), Error);
  Trace bad = t;
  bad.gpu_spans.push_back(gpu(0, 7, 0, 0, 1));  // no stream 7
  EXPECT_THROW(trace_costs(bad, nullptr), Error);
  bad = t;
  bad.host_spans.push_back(host(9, 0, 0, 0, 1));  // no task 9
  EXPECT_THROW(trace_costs(bad, nullptr), Error);
  EXPECT_EQ(weft::plan::parse_gpu_cost("span"), GpuCost::kSpan);
  EXPECT_THROW(weft::plan::parse_gpu_cost("kernels"), Error);
}

// The Chrome JSON an engine writes, read back: the same spans (tasks numbered by their first
// span), and so the same costs.
TEST(TraceCosts, AnEngineTraceReadBackFromItsChromeJsonGivesTheSameCosts) {
  Trace t = make_trace({"A", "B"}, {"s1", "s2"}, {}, {});
  t.thread_names = {"main", "comm"};
  for (std::int64_t b = 0; b < 6; ++b) {
    const double at = 1000.0 * double(b);
    t.host_spans.push_back({.task = 0, .thread = 0, .batch = b, .lookahead = 0, .iteration = b,
                            .ticket = -1, .begin_us = at, .end_us = at + 7 + double(b)});
    t.host_spans.push_back({.task = 1, .thread = 1, .batch = b, .lookahead = 1, .iteration = b,
                            .ticket = 0, .begin_us = at + 10, .end_us = at + 12,
                            .failed = b == 5});
    t.gpu_spans.push_back(gpu(0, 0, b, at, at + 300));
    t.gpu_spans.push_back(gpu(1, 1, b, at + 100, at + 350 + double(b), b == 4));
  }
  const Trace back = weft::plan::parse_engine_trace(t.to_chrome_json());
  EXPECT_EQ(back.task_names, t.task_names);
  EXPECT_EQ(back.thread_names, t.thread_names);
  EXPECT_EQ(back.stream_names, t.stream_names);
  ASSERT_EQ(back.host_spans.size(), t.host_spans.size());
  for (std::size_t i = 0; i < t.host_spans.size(); ++i) {
    const HostSpan &a = t.host_spans[i], &b = back.host_spans[i];
    EXPECT_EQ(std::tie(a.task, a.thread, a.batch, a.lookahead, a.iteration, a.ticket, a.failed),
              std::tie(b.task, b.thread, b.batch, b.lookahead, b.iteration, b.ticket, b.failed));
    EXPECT_DOUBLE_EQ(a.begin_us, b.begin_us);
    EXPECT_DOUBLE_EQ(a.end_us, b.end_us);
  }
  ASSERT_EQ(back.gpu_spans.size(), t.gpu_spans.size());
  for (std::size_t i = 0; i < t.gpu_spans.size(); ++i) {
    const GpuSpan &a = t.gpu_spans[i], &b = back.gpu_spans[i];
    EXPECT_EQ(std::tie(a.task, a.stream, a.batch, a.failed),
              std::tie(b.task, b.stream, b.batch, b.failed));
  }
  const Schedule s = producer_consumer();
  EXPECT_EQ(trace_costs(back, &s), trace_costs(t, &s));
  EXPECT_THROW(weft::plan::parse_engine_trace(R"({"traceEvents": []})"), Error);
}

}  // namespace
