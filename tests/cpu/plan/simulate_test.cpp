// The HSTU benchmark's statements about its preset schedule, as tests of the simulator (which
// uses the engine's own wait rules), plus exact timings on small schedules computed by hand.
#include "weft/plan/simulate.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <utility>

#include "weft/core/error.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/suggest.hpp"

namespace {

using weft::pipeline::CompiledSchedule;
using weft::pipeline::ThreadMap;
using weft::plan::CostModel;
using weft::plan::Timeline;
using weft::plan::WaitRule;

Timeline simulate_variant(const weft::hstu::HstuVariant& v) {
  const CompiledSchedule compiled(weft::hstu::hstu_schedule({.cascade = v.cascade}));
  const auto threads = ThreadMap::preset(v.thread_map).assign(compiled);
  return weft::plan::simulate(compiled, threads, CostModel::hstu_defaults());
}

const std::set<std::string> kIoTasks = {"h2d", "start_shuffle", "finish_shuffle"};

TEST(HstuPlan, NoD3VariantWaitsFromIoToNonIoButD6VariantsDo) {
  for (const auto& v : weft::hstu::hstu_variants()) {
    const Timeline t = simulate_variant(v);
    bool io_to_non_io = false;
    bool shuffle_to_input_dist = false;
    for (const auto& w : t.waits) {
      if (!weft::plan::is_lookahead_rule(w.rule)) continue;
      if (kIoTasks.count(w.producer) && !kIoTasks.count(w.consumer)) io_to_non_io = true;
      if (w.producer == "finish_shuffle" && w.consumer == "start_input_dist") {
        shuffle_to_input_dist = true;
        EXPECT_EQ(w.rule, WaitRule::kSameLookahead);
        // The cause names the edge: the slot between them and the equal lookaheads.
        EXPECT_NE(w.cause.find("slot shuffled_batch"), std::string::npos) << w.cause;
        EXPECT_NE(w.cause.find("la 3 == 3"), std::string::npos) << w.cause;
      }
    }
    const std::string name(v.name);
    if (v.cascade == weft::hstu::HstuCascade::kD3) {
      EXPECT_FALSE(io_to_non_io) << name;
    } else if (name == "default_d6" || name == "full_split_d6") {
      EXPECT_TRUE(shuffle_to_input_dist) << name;
    }
  }
}

TEST(HstuPlan, PrefetchToBackwardDrawnWheneverOnDifferentThreads) {
  for (const auto& v : weft::hstu::hstu_variants()) {
    const CompiledSchedule compiled(weft::hstu::hstu_schedule({.cascade = v.cascade}));
    const auto threads = ThreadMap::preset(v.thread_map).assign(compiled);
    const auto prefetch = compiled.task_id("prefetch_embeddings");
    const auto backward = compiled.task_id("backward");
    const bool apart = threads.thread_of_task[prefetch] != threads.thread_of_task[backward];
    const Timeline t = weft::plan::simulate(compiled, threads, CostModel::hstu_defaults());
    bool drawn = false;
    for (const auto& w : t.waits) {
      if (w.producer == "prefetch_embeddings" && w.consumer == "backward") {
        drawn = true;
        EXPECT_TRUE(w.rule == WaitRule::kSyncBoth || w.rule == WaitRule::kSyncCpu ||
                    w.rule == WaitRule::kSyncGpu);
      }
    }
    EXPECT_EQ(drawn, apart) << v.name;
  }
}

TEST(HstuPlan, PerTaskBackwardWaitsForForwardAndLegacyNeverWaits) {
  const Timeline per_task = simulate_variant(weft::hstu::hstu_variant("per_task_d3"));
  bool backward_after_forward = false;
  for (const auto& w : per_task.waits) {
    if (w.producer == "forward" && w.consumer == "backward" &&
        w.rule == WaitRule::kSameLookahead) {
      backward_after_forward = true;
    }
  }
  EXPECT_TRUE(backward_after_forward);
  double forward_end = -1, backward_start = -1;
  for (const auto& s : per_task.host) {
    if (s.task == "forward") forward_end = s.end_us;
    if (s.task == "backward") backward_start = s.start_us;
  }
  EXPECT_GE(backward_start, forward_end);

  const Timeline legacy = simulate_variant(weft::hstu::hstu_variant("legacy_none"));
  EXPECT_TRUE(legacy.waits.empty());
  EXPECT_EQ(legacy.threads.size(), 1u);
}

TEST(HstuPlan, EveryTaskRunsOnceAndThreadsNeverOverlap) {
  for (const auto& v : weft::hstu::hstu_variants()) {
    const Timeline t = simulate_variant(v);
    EXPECT_EQ(t.host.size(), weft::hstu::hstu_task_names().size()) << v.name;
    for (const auto& a : t.host) {
      for (const auto& b : t.host) {
        if (&a == &b || a.thread != b.thread) continue;
        EXPECT_TRUE(a.end_us <= b.start_us || b.end_us <= a.start_us)
            << v.name << ": " << a.task << " and " << b.task << " overlap on " << a.thread;
      }
    }
    EXPECT_GT(t.step_us, 0) << v.name;
  }
}

// Two threads, A -> B at the same lookahead; B's stream waits for A's GPU work.
//   host: A [0,10] on t0, B [10,15] on t1 (waits 10 us for A)
//   GPU:  A 100 us on s1, B 50 us on s2 after A: the step is s1-bound, 100 us per step.
TEST(Simulate, HandComputedTwoThreadSchedule) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["s1", "s2"],
    "tasks": [
      {"name": "A", "stream": "s1", "writes": ["x"]},
      {"name": "B", "stream": "s2", "reads": ["x"]}
    ],
    "thread_maps": [{"groups": {"t0": ["A"], "t1": ["B"]}}],
    "costs": {"tasks": {"A": {"host_us": 10, "gpu": [{"stream": "s1", "us": 100}]},
                        "B": {"host_us": 5, "gpu": [{"stream": "s2", "us": 50}]}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  const Timeline t = weft::plan::simulate(compiled, threads, *file.costs);
  EXPECT_DOUBLE_EQ(t.step_us, 100);
  EXPECT_DOUBLE_EQ(t.host_step_us, 15);
  ASSERT_EQ(t.host.size(), 2u);
  EXPECT_DOUBLE_EQ(t.host[1].start_us, 10);
  ASSERT_EQ(t.waits.size(), 1u);
  EXPECT_EQ(t.waits[0].producer, "A");
  EXPECT_EQ(t.waits[0].rule, WaitRule::kSameLookahead);
  EXPECT_DOUBLE_EQ(t.waits[0].waited_us, 10);

  // With a 5 us wake-up, B starts 5 us after A's release: host 10 + 5 + 5; the GPU still bounds.
  const Timeline woken = weft::plan::simulate(compiled, threads, *file.costs,
                                              {.thread_wake_up_us = 5});
  EXPECT_DOUBLE_EQ(woken.host[1].start_us, 15);
  EXPECT_DOUBLE_EQ(woken.host_step_us, 20);
  EXPECT_DOUBLE_EQ(woken.step_us, 100);
  EXPECT_THROW(weft::plan::simulate(compiled, threads, *file.costs, {.thread_wake_up_us = -1}),
               weft::Error);
}

// Collectives on two threads and two streams: the second in run order waits for nothing but
// the first's ticket.
TEST(Simulate, CollectiveTicketsSerialiseAcrossThreads) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm"],
    "tasks": [
      {"name": "c1", "collective": true},
      {"name": "c2", "stream": "comm", "collective": true}
    ],
    "thread_maps": ["per_task"],
    "costs": {"tasks": {"c1": {"host_us": 30}, "c2": {"host_us": 5}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const Timeline t =
      weft::plan::simulate(compiled, file.thread_maps.at(0).assign(compiled), *file.costs);
  ASSERT_EQ(t.host.size(), 2u);
  EXPECT_DOUBLE_EQ(t.host[1].start_us, 30);
  EXPECT_EQ(t.host[1].ticket, 1);
  ASSERT_EQ(t.waits.size(), 1u);
  EXPECT_EQ(t.waits[0].rule, WaitRule::kTicket);
  EXPECT_DOUBLE_EQ(t.waits[0].waited_us, 30);
  EXPECT_EQ(t.waits[0].cause, "collective ticket 1 after ticket 0");
}

// load (s1, 100 us, lookahead 1) then use (s2, 50 us), on threads of their own, no host time.
weft::plan::ScheduleFile two_stage_pipeline() {
  return weft::plan::ScheduleFile::parse(R"({
    "streams": ["s1", "s2"],
    "tasks": [
      {"name": "load", "stream": "s1", "lookahead": 1, "writes": ["x"]},
      {"name": "use", "stream": "s2", "reads": ["x"]}
    ],
    "thread_maps": [{"groups": {"t0": ["load"], "t1": ["use"]}}],
    "costs": {"tasks": {"load": {"host_us": 0, "gpu": [{"stream": "s1", "us": 100}]},
                        "use": {"host_us": 0, "gpu": [{"stream": "s2", "us": 50}]}}}
  })");
}

// A finite source of M batches: the engine's iterations 0 .. M + L - 1, prefill and drain, each
// task once per batch; the step is the whole source.
TEST(SimulateSource, TwoStagePipelineByHand) {
  const auto file = two_stage_pipeline();
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  for (int m : {1, 2, 4, 9}) {
    SCOPED_TRACE(m);
    const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = m});
    // s1 loads batch b in [100 b, 100 (b + 1)); s2 uses it right after: the last use ends at
    // 100 M + 50.
    EXPECT_DOUBLE_EQ(t.step_us, 100.0 * m + 50);
    ASSERT_EQ(t.host.size(), std::size_t(2 * m));
    std::multiset<std::pair<std::string, long long>> runs;
    for (const auto& h : t.host) runs.insert({h.task, h.batch});
    for (int b = 0; b < m; ++b) {
      EXPECT_EQ(runs.count({"load", b}), 1u);
      EXPECT_EQ(runs.count({"use", b}), 1u);
    }
    ASSERT_EQ(t.gpu.size(), std::size_t(2 * m));
    EXPECT_DOUBLE_EQ(t.gpu.back().end_us, 100.0 * m + 50);
  }
  // The steady state of the same schedule: one batch per 100 us.
  EXPECT_DOUBLE_EQ(weft::plan::simulate(compiled, threads, *file.costs).step_us, 100);
  // A search over the source names the stream busy all of it: s1, 900 of 950 us at M = 9 (its
  // work counted once per batch, as the source runs it).
  weft::plan::SuggestOptions options{.max_threads = 2, .simulation = {.num_batches = 9}};
  const auto found = weft::plan::suggest(compiled, *file.costs, options);
  ASSERT_FALSE(found.suggestions.empty());
  EXPECT_DOUBLE_EQ(found.suggestions[0].step_us, 950);
  EXPECT_EQ(found.suggestions[0].bound, "GPU waits across streams (busiest: s1, 900.0 us)");
  options.simulation.num_batches = 100;  // 10000 of 10050 us: within 1%
  EXPECT_EQ(weft::plan::suggest(compiled, *file.costs, options).suggestions[0].bound,
            "stream s1");
  EXPECT_THROW(weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = -1}),
               weft::Error);
}

// Host-bound, one thread: the source's iterations run back to back, the prefill and the drain
// running only the tasks with a batch (la 2: iterations 0 .. M - 1, la 0: 2 .. M + 1).
TEST(SimulateSource, InactiveTasksTakeNoTime) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "tasks": [
      {"name": "a", "lookahead": 2, "writes": ["x"]},
      {"name": "b", "lookahead": 1, "reads": ["x"], "writes": ["y"]},
      {"name": "c", "reads": ["y"]}
    ],
    "thread_maps": ["legacy"],
    "costs": {"tasks": {"a": {"host_us": 10}, "b": {"host_us": 20}, "c": {"host_us": 40}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  for (int m : {1, 3, 5}) {
    const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = m});
    EXPECT_DOUBLE_EQ(t.step_us, 70.0 * m) << m;
    EXPECT_DOUBLE_EQ(t.host_step_us, 70.0 * m) << m;
    ASSERT_EQ(t.host.size(), std::size_t(3 * m));
    EXPECT_EQ(t.host.front().task, "a");
    EXPECT_EQ(t.host.back().task, "c");
    EXPECT_EQ(t.host.back().batch, m - 1);
  }
}

// Collective tickets go to the active collectives of each iteration: in the prefill and the drain
// the one collective with a batch holds ticket 0.
TEST(SimulateSource, TicketsCountOnlyActiveCollectives) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm"],
    "tasks": [
      {"name": "c1", "lookahead": 1, "collective": true, "writes": ["x"]},
      {"name": "c2", "stream": "comm", "collective": true, "reads": ["x"]}
    ],
    "thread_maps": ["per_task"],
    "costs": {"tasks": {"c1": {"host_us": 30}, "c2": {"host_us": 5}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const Timeline t = weft::plan::simulate(compiled, file.thread_maps.at(0).assign(compiled),
                                          *file.costs, {.num_batches = 3});
  ASSERT_EQ(t.host.size(), 6u);
  for (const auto& h : t.host) {
    // c1 alone in iteration 0, c2 alone in iteration 3; both in 1 and 2, c1 first.
    const bool alone = (h.task == "c1" && h.batch == 0) || (h.task == "c2" && h.batch == 2);
    EXPECT_EQ(h.ticket, alone || h.task == "c1" ? 0 : 1) << h.task << " " << h.batch;
  }
}

// A long source approaches the steady state: each batch more adds one steady-state step.
TEST(SimulateSource, LongSourcesGrowByTheSteadyStateStep) {
  for (const char* name : {"full_split_d6", "default_d3", "per_task_d3"}) {
    SCOPED_TRACE(name);
    const auto& v = weft::hstu::hstu_variant(name);
    const CompiledSchedule compiled(weft::hstu::hstu_schedule({.cascade = v.cascade}));
    const auto threads = ThreadMap::preset(v.thread_map).assign(compiled);
    const double steady =
        weft::plan::simulate(compiled, threads, CostModel::hstu_defaults(),
                             {.num_progress = 60}).step_us;
    const double m40 = weft::plan::simulate(compiled, threads, CostModel::hstu_defaults(),
                                            {.num_batches = 40}).step_us;
    const double m80 = weft::plan::simulate(compiled, threads, CostModel::hstu_defaults(),
                                            {.num_batches = 80}).step_us;
    EXPECT_NEAR((m80 - m40) / 40, steady, 0.01 * steady);
    EXPECT_GT(m40, 40 * steady * 0.99);  // the fill and the drain add, never save
  }
}

// The overlap slowdown: s1's work runs at half speed while s2's runs. Load b + 1 starts with use
// b: 50 us of use at full speed, during which the load does 25 of its 100 us, then 75 alone, so
// every load after the first takes 125 us; a source of M batches ends at 150 + 125 (M - 1) (100 M
// + 50 without the slowdown), the steady state is one batch per 125 us.
TEST(SimulateOverlap, TheSlowedStreamRunsSlowerOnlyWhileAnotherRuns) {
  const auto file = two_stage_pipeline();
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  for (int m : {1, 2, 5}) {
    SCOPED_TRACE(m);
    const Timeline t = weft::plan::simulate(
        compiled, threads, *file.costs,
        {.num_batches = m, .slowed_stream = "s1", .overlap_slowdown = 2});
    EXPECT_DOUBLE_EQ(t.step_us, 150.0 + 125.0 * (m - 1));
    for (const auto& g : t.gpu) {
      const double expected = g.task == "use" ? 50 : g.start_us == 0 ? 100 : 125;
      EXPECT_DOUBLE_EQ(g.end_us - g.start_us, expected) << g.task << " at " << g.start_us;
    }
  }
  EXPECT_DOUBLE_EQ(weft::plan::simulate(compiled, threads, *file.costs,
                                        {.slowed_stream = "s1", .overlap_slowdown = 2})
                       .step_us,
                   125);
  // Slowing s2 instead: each use overlaps the next load whole, taking 100 us, and ends with it;
  // the last one runs alone. The step stays 100 M + 50.
  const Timeline t = weft::plan::simulate(
      compiled, threads, *file.costs,
      {.num_batches = 4, .slowed_stream = "s2", .overlap_slowdown = 2});
  EXPECT_DOUBLE_EQ(t.step_us, 450);
  for (const auto& g : t.gpu) {
    if (g.task != "use") continue;
    EXPECT_DOUBLE_EQ(g.end_us - g.start_us, g.start_us == 400 ? 50 : 100) << g.start_us;
  }
  // A factor of 1 (the default) is the simulation without the model.
  const Timeline plain = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = 4});
  const Timeline one = weft::plan::simulate(
      compiled, threads, *file.costs,
      {.num_batches = 4, .slowed_stream = "s1", .overlap_slowdown = 1});
  EXPECT_DOUBLE_EQ(one.step_us, plain.step_us);
  ASSERT_EQ(one.gpu.size(), plain.gpu.size());
  for (std::size_t i = 0; i < one.gpu.size(); ++i) {
    EXPECT_EQ(one.gpu[i].task, plain.gpu[i].task);
    EXPECT_DOUBLE_EQ(one.gpu[i].start_us, plain.gpu[i].start_us);
    EXPECT_DOUBLE_EQ(one.gpu[i].end_us, plain.gpu[i].end_us);
  }
  for (double bad : {0.5, 101.0}) {
    EXPECT_THROW(weft::plan::simulate(compiled, threads, *file.costs,
                                      {.slowed_stream = "s1", .overlap_slowdown = bad}),
                 weft::Error);
  }
  EXPECT_THROW(weft::plan::simulate(compiled, threads, *file.costs, {.overlap_slowdown = 2}),
               weft::Error);
}

// A task's work on a side stream joins back: the next task of its own stream waits for it; a
// slowed stream runs slower beside any other stream's segment, a side stream's included.
TEST(SimulateOverlap, SideStreamWorkJoinsBackAndSlowsTheOtherStream) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm", "side"],
    "tasks": [
      {"name": "a", "writes": ["x"]},
      {"name": "b", "stream": "comm", "reads": ["x"], "writes": ["y"]},
      {"name": "c", "writes": ["z"]}
    ],
    "thread_maps": ["legacy"],
    "costs": {"tasks": {"a": {"host_us": 0, "gpu": [{"stream": "default", "us": 40},
                                                    {"stream": "side", "us": 60}]},
                        "b": {"host_us": 0, "gpu": [{"stream": "comm", "us": 30}]},
                        "c": {"host_us": 0, "gpu": [{"stream": "default", "us": 20}]}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  // a: default [0, 40), then side [40, 100), the default stream busy until 100; b waits for a's
  // work (its reads): comm [100, 130); c waits for the default stream: [100, 120), alongside b.
  const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = 1});
  EXPECT_DOUBLE_EQ(t.step_us, 130);
  // Slowing default x 3 while another stream runs: c [100, 160) beside b's [100, 130): 30 us at a
  // third of its speed (10 us of work), then 10 alone: c ends at 140.
  const Timeline slowed = weft::plan::simulate(
      compiled, threads, *file.costs,
      {.num_batches = 1, .slowed_stream = "default", .overlap_slowdown = 3});
  EXPECT_DOUBLE_EQ(slowed.step_us, 140);
  for (const auto& g : slowed.gpu) {
    if (g.task == "c") {
      EXPECT_DOUBLE_EQ(g.start_us, 100);
      EXPECT_DOUBLE_EQ(g.end_us, 140);
    }
  }
  // A side stream's segment slows the slowed stream too: s (own stream comm) works 60 us on
  // side, t 30 us on default beside it from 0: 20 us of t's work by 60 at a third of its speed,
  // the last 10 alone: t ends at 70.
  const auto side = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm", "side"],
    "tasks": [{"name": "s", "stream": "comm"}, {"name": "t"}],
    "thread_maps": ["legacy"],
    "costs": {"tasks": {"s": {"host_us": 0, "gpu": [{"stream": "side", "us": 60}]},
                        "t": {"host_us": 0, "gpu": [{"stream": "default", "us": 30}]}}}
  })");
  const CompiledSchedule two(side.schedule);
  const Timeline both = weft::plan::simulate(
      two, side.thread_maps.at(0).assign(two), *side.costs,
      {.num_batches = 1, .slowed_stream = "default", .overlap_slowdown = 3});
  EXPECT_DOUBLE_EQ(both.step_us, 70);
  EXPECT_THROW(weft::plan::simulate(
                   two, side.thread_maps.at(0).assign(two), *side.costs,
                   {.num_batches = 1, .slowed_stream = "no_such", .overlap_slowdown = 3}),
               weft::Error);
}

// dispatch (comm, host 10 us, GPU 100 us) writes x; experts (default, host 20, GPU 50) reads it
// and, where `waits`, waits for dispatch's GPU work of its batch before its host work (a body
// that reads a count the dispatch kernel writes); one thread; lookaheads as given.
weft::plan::ScheduleFile dispatch_then_experts(int dispatch_lookahead, bool waits) {
  const std::string wait = waits ? R"(, "waits_for_gpu_of": "dispatch")" : "";
  return weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm"],
    "tasks": [
      {"name": "dispatch", "stream": "comm", "lookahead": )" +
                                         std::to_string(dispatch_lookahead) + R"(, "writes": ["x"]},
      {"name": "experts", "reads": ["x"]}
    ],
    "thread_maps": ["legacy"],
    "costs": {"tasks": {"dispatch": {"host_us": 10, "gpu": [{"stream": "comm", "us": 100}]},
                        "experts": {"host_us": 20, "gpu": [{"stream": "default", "us": 50}])" +
                                         wait + R"(}}}
  })");
}

// Same lookahead: batch b's dispatch body runs at 130 b, its GPU work until 130 b + 110, and the
// experts' host work only then, to 130 b + 130, when the next iteration begins: 130 us a batch,
// the last experts' GPU work ending at 130 (M - 1) + 180. Without the wait the comm stream bounds:
// 100 us a batch, the last experts' work ending at 100 (M - 1) + 160.
TEST(SimulateGpuWait, TheBodyStartsItsHostWorkWhenTheProducersGpuWorkEnds) {
  for (int m : {1, 3, 5}) {
    SCOPED_TRACE(m);
    const auto file = dispatch_then_experts(0, true);
    const CompiledSchedule compiled(file.schedule);
    const auto threads = file.thread_maps.at(0).assign(compiled);
    const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = m});
    EXPECT_DOUBLE_EQ(t.step_us, 130.0 * (m - 1) + 180);
    ASSERT_EQ(t.host.size(), std::size_t(2 * m));
    std::size_t num_waits = 0;
    for (const auto& h : t.host) {
      if (h.task == "experts") {
        EXPECT_DOUBLE_EQ(h.start_us, 130.0 * double(h.batch) + 110);
      }
    }
    for (const auto& w : t.waits) {
      if (w.rule != WaitRule::kGpuWait) continue;
      ++num_waits;
      EXPECT_EQ(w.producer, "dispatch");
      EXPECT_EQ(w.consumer, "experts");
      EXPECT_EQ(w.producer_thread, "stream comm");
      EXPECT_DOUBLE_EQ(w.waited_us, 100);  // from the end of dispatch's body to its GPU's end
      EXPECT_FALSE(weft::plan::is_lookahead_rule(w.rule));
    }
    EXPECT_EQ(num_waits, std::size_t(m));
    // The wait spins: no wake-up after it (the thread did not block on another thread).
    EXPECT_DOUBLE_EQ(weft::plan::simulate(compiled, threads, *file.costs,
                                          {.num_batches = m, .thread_wake_up_us = 5})
                         .step_us,
                     130.0 * (m - 1) + 180);

    const auto plain = dispatch_then_experts(0, false);
    const CompiledSchedule plain_compiled(plain.schedule);
    EXPECT_DOUBLE_EQ(weft::plan::simulate(plain_compiled, plain.thread_maps.at(0).assign(
                                                              plain_compiled),
                                          *plain.costs, {.num_batches = m})
                         .step_us,
                     100.0 * (m - 1) + 160);
  }
  // In steady state the same: 130 us of host per progress(), one drawn wait of 100 us.
  const auto file = dispatch_then_experts(0, true);
  const CompiledSchedule compiled(file.schedule);
  const Timeline steady =
      weft::plan::simulate(compiled, file.thread_maps.at(0).assign(compiled), *file.costs);
  EXPECT_DOUBLE_EQ(steady.step_us, 130);
  ASSERT_EQ(steady.waits.size(), 1u);
  EXPECT_EQ(steady.waits[0].rule, WaitRule::kGpuWait);
  EXPECT_DOUBLE_EQ(steady.waits[0].waited_us, 100);
}

// experts on a thread of its own waits for dispatch's body (t1), then for its GPU work. With a
// 5 us wake-up it is woken at 15 and spins to 110 (the wake-up is not added after the spin).
// M = 2: dispatch 0 [0, 10], GPU [10, 110]; experts 0 [110, 130], GPU [130, 180]; the next
// iteration at 130: dispatch 1 [130, 140], GPU [140, 240]; experts 1 [240, 260], GPU [260, 310].
TEST(SimulateGpuWait, AWaitOnAnotherThreadsProducer) {
  auto file = dispatch_then_experts(0, true);
  const CompiledSchedule compiled(file.schedule);
  const auto threads =
      ThreadMap::groups({{"t0", {"experts"}}, {"t1", {"dispatch"}}}).assign(compiled);
  for (double wake_up_us : {0.0, 5.0}) {
    const Timeline t = weft::plan::simulate(
        compiled, threads, *file.costs, {.num_batches = 2, .thread_wake_up_us = wake_up_us});
    EXPECT_DOUBLE_EQ(t.step_us, 310) << wake_up_us;
    std::map<long long, double> experts_start;
    for (const auto& h : t.host) {
      if (h.task == "experts") experts_start[h.batch] = h.start_us;
    }
    EXPECT_EQ(experts_start, (std::map<long long, double>{{0, 110}, {1, 240}})) << wake_up_us;
  }
}

// Under an overlap slowdown the first placement overlaps experts' GPU work (no data edge: it
// does not wait for dispatch's on the GPU) with dispatch's and slows it; the settled one does
// not: dispatch's GPU work [10, 110], experts' host work from 110, its GPU work [130, 530].
TEST(SimulateGpuWait, TheWaitSettlesOnTheEndOfTheSettledPlacement) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm"],
    "tasks": [{"name": "dispatch", "stream": "comm"}, {"name": "experts"}],
    "thread_maps": ["legacy"],
    "costs": {"tasks": {"dispatch": {"host_us": 10, "gpu": [{"stream": "comm", "us": 100}]},
                        "experts": {"host_us": 20, "gpu": [{"stream": "default", "us": 400}],
                                    "waits_for_gpu_of": "dispatch"}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  weft::plan::SimulationOptions options{.num_batches = 1};
  options.slowed_stream = "comm";
  options.overlap_slowdown = 1.5;
  const Timeline t =
      weft::plan::simulate(compiled, file.thread_maps.at(0).assign(compiled), *file.costs, options);
  EXPECT_DOUBLE_EQ(t.step_us, 530);
  ASSERT_EQ(t.host.size(), 2u);
  EXPECT_DOUBLE_EQ(t.host[1].start_us, 110);
}

// dispatch one batch ahead (lookahead 1), M = 3: iteration 0 runs dispatch 0 ([0, 10], GPU
// [10, 110]); iteration 1 dispatch 1 ([10, 20], GPU [110, 210]) and experts 0, which waits for
// dispatch 0's GPU work of the iteration before: [110, 130], GPU [130, 180]; iteration 2
// dispatch 2 ([130, 140], GPU [210, 310]) and experts 1 ([210, 230]); iteration 3 experts 2
// ([310, 330], GPU [330, 380]). Without the wait: 360 (experts 2's GPU work after dispatch 2's).
TEST(SimulateGpuWait, AWaitOnTheBatchOfAnEarlierIteration) {
  const auto file = dispatch_then_experts(1, true);
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, {.num_batches = 3});
  EXPECT_DOUBLE_EQ(t.step_us, 380);
  std::map<long long, double> experts_start;
  for (const auto& h : t.host) {
    if (h.task == "experts") experts_start[h.batch] = h.start_us;
  }
  EXPECT_EQ(experts_start, (std::map<long long, double>{{0, 110}, {1, 210}, {2, 310}}));
  const auto plain = dispatch_then_experts(1, false);
  const CompiledSchedule plain_compiled(plain.schedule);
  EXPECT_DOUBLE_EQ(
      weft::plan::simulate(plain_compiled, plain.thread_maps.at(0).assign(plain_compiled),
                           *plain.costs, {.num_batches = 3})
          .step_us,
      360);
}

// The wait holds its thread but not the GIL: `other` (another thread, 60 us, GIL) runs while
// experts waits for dispatch's GPU work, and experts takes the GIL after it.
TEST(SimulateGpuWait, AWaitingBodyLeavesTheGilToOthers) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm", "s3"],
    "tasks": [
      {"name": "dispatch", "stream": "comm", "writes": ["x"]},
      {"name": "experts", "reads": ["x"]},
      {"name": "other", "stream": "s3"}
    ],
    "thread_maps": [{"groups": {"t0": ["dispatch", "experts"], "t1": ["other"]}}],
    "costs": {"tasks": {"dispatch": {"host_us": 10, "gpu": [{"stream": "comm", "us": 100}]},
                        "experts": {"host_us": 20, "waits_for_gpu_of": "dispatch"},
                        "other": {"host_us": 60}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  weft::plan::SimulationOptions options{.num_batches = 1};
  options.gil_tasks = {"dispatch", "experts", "other"};
  const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, options);
  std::map<std::string, std::pair<double, double>> spans;
  for (const auto& h : t.host) spans[h.task] = {h.start_us, h.end_us};
  EXPECT_EQ(spans["dispatch"], (std::pair<double, double>{0, 10}));
  EXPECT_EQ(spans["other"], (std::pair<double, double>{10, 70}));
  EXPECT_EQ(spans["experts"], (std::pair<double, double>{110, 130}));
}

TEST(SimulateGpuWait, BadWaitsAreRefused) {
  // The error a simulation of `file` on one thread (the legacy map) throws.
  auto legacy_error = [](const weft::plan::ScheduleFile& file) {
    try {
      const CompiledSchedule compiled(file.schedule);
      weft::plan::simulate(compiled, ThreadMap::preset("legacy").assign(compiled), *file.costs);
    } catch (const weft::Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  auto message = [&](int dispatch_lookahead, const std::string& producer) {
    auto file = dispatch_then_experts(dispatch_lookahead, true);
    file.costs->tasks["experts"].waits_for_gpu_of = producer;
    return legacy_error(file);
  };
  EXPECT_EQ(message(0, "ghost"),
            "$.tasks.experts.waits_for_gpu_of: 'ghost' is no task of the schedule");
  EXPECT_EQ(message(0, "experts"),
            "$.tasks.experts.waits_for_gpu_of: 'experts' is the task itself");
  // experts (lookahead 1) before dispatch (lookahead 0) in its batch: the wait could never end.
  auto ahead = weft::plan::ScheduleFile::parse(R"({
    "tasks": [{"name": "a"}, {"name": "b", "lookahead": 1}],
    "costs": {"tasks": {"b": {"host_us": 1, "waits_for_gpu_of": "a"}}}
  })");
  EXPECT_EQ(legacy_error(ahead),
            "task 'b' (lookahead 1) waits for the GPU work of 'a' (lookahead 0), which works on "
            "its batch later: the wait would never end");
  EXPECT_THROW(CostModel::parse(R"({"tasks": {"b": {"waits_for_gpu_of": 3}}})"), weft::Error);

  // A producer whose body runs after the waiting one on its thread: the engine would wait
  // forever, the simulator says so. suggest() refuses such candidates and keeps searching.
  auto after = weft::plan::ScheduleFile::parse(R"({
    "streams": ["s1"],
    "tasks": [{"name": "a"}, {"name": "b", "stream": "s1"}],
    "costs": {"tasks": {"a": {"host_us": 1, "waits_for_gpu_of": "b"}, "b": {"host_us": 1}}}
  })");
  const std::string after_error = legacy_error(after);
  EXPECT_NE(after_error.find("task 'a' waits for the GPU work of 'b', whose body runs after it "
                             "in the same progress()"),
            std::string::npos)
      << after_error;
  const CompiledSchedule both(after.schedule);
  // On threads of their own (and streams: two threads on one stream keep run order, a host
  // wait of b for a) b can run first.
  const auto own_threads = ThreadMap::groups({{"t0", {"a"}}, {"t1", {"b"}}}).assign(both);
  EXPECT_EQ(weft::plan::endless_gpu_wait(both, own_threads, *after.costs), "");
}

// b waits for a's GPU work with no data edge between them: the lookahead search can put a below
// b (a works on b's batch later) and a map can put b first on a thread; those candidates are
// refused, the rest searched.
TEST(SimulateGpuWait, SuggestRefusesCandidatesWhoseWaitsCouldNeverEnd) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["comm"],
    "tasks": [{"name": "a", "stream": "comm", "lookahead": 1}, {"name": "b"}],
    "costs": {"tasks": {"a": {"host_us": 10, "gpu": [{"stream": "comm", "us": 100}]},
                        "b": {"host_us": 20, "gpu": [{"stream": "default", "us": 50}],
                              "waits_for_gpu_of": "a"}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto found = weft::plan::suggest(
      compiled, *file.costs, {.max_threads = 2, .min_lookahead = 0, .max_lookahead = 1});
  EXPECT_GT(found.num_refused, 0u);
  ASSERT_FALSE(found.suggestions.empty());
  for (const auto& s : found.suggestions) {
    EXPECT_GE(s.config.lookahead.at("a"), s.config.lookahead.at("b"));
  }
}

TEST(CostModel, BadInputNamesTheProblem) {
  auto message = [](const char* json) {
    try {
      CostModel::parse(json);
    } catch (const weft::Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(R"({"tasks": {"h2d": {"host_us": -1}}})"),
            "$.tasks.h2d.host_us: expected a cost >= 0, got -1");
  EXPECT_EQ(message(R"({"tasks": {"h2d": {"hots_us": 1}}})"), "$.tasks.h2d.hots_us: unknown key");
  EXPECT_EQ(message(R"({"tasks": {"h2d": {"gpu": [{"stream": "memcpy", "us": "x"}]}}})"),
            "$.tasks.h2d.gpu[0].us: expected a number, got \"x\"");
  EXPECT_NE(message("{not json").find("$: not valid JSON"), std::string::npos);

  const CompiledSchedule compiled(weft::hstu::hstu_schedule());
  auto costs = CostModel::hstu_defaults();
  costs.tasks["warp_drive"] = {};
  try {
    costs.check_against(compiled);
    FAIL() << "unknown task accepted";
  } catch (const weft::Error& e) {
    EXPECT_EQ(e.message(), "$.tasks.warp_drive: the schedule has no task of that name");
  }
}

TEST(CostModel, JsonRoundTrip) {
  auto model = CostModel::hstu_defaults();
  EXPECT_EQ(CostModel::parse(model.to_json()), model);
  model.tasks["backward"].waits_for_gpu_of = "forward";
  EXPECT_EQ(CostModel::parse(model.to_json()), model);
}

TEST(ScheduleFile, BadInputNamesThePath) {
  auto message = [](const char* json) {
    try {
      const auto file = weft::plan::ScheduleFile::parse(json);
      CompiledSchedule compiled(file.schedule);
    } catch (const weft::Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(R"({"tasks": [{"name": "a", "lookahead": "x"}]})"),
            "$.tasks[0].lookahead: expected an integer, got \"x\"");
  EXPECT_EQ(message(R"({"tasks": [{"name": "a", "colour": 1}]})"), "$.tasks[0].colour: unknown key");
  EXPECT_EQ(message(R"({"tasks": []})"), "$.tasks: expected a non-empty array of tasks");
  EXPECT_NE(message(R"({"tasks": [{"name": "a"}], "thread_maps": ["no_such_map"]})")
                .find("$.thread_maps[0]"),
            std::string::npos);
  EXPECT_NE(message(R"({"tasks": [{"name": "a"}], "costs": {"tasks": {"a": {"host_us": -2}}}})")
                .find("$.costs.tasks.a.host_us"),
            std::string::npos);
  // A cycle is the engine's validation error; it names the tasks.
  const std::string cycle = message(R"({"tasks": [
      {"name": "a", "depends_on": ["b"]}, {"name": "b", "depends_on": ["a"]}]})");
  EXPECT_NE(cycle.find("cycle"), std::string::npos) << cycle;
}

}  // namespace

// Two independent 100 us bodies on two threads: 100 us of host per progress() in parallel; when
// both hold the GIL, t0's A (ready first, the lower thread on a tie) runs, then B: 200 us.
TEST(Simulate, GilTasksShareOneLock) {
  const auto file = weft::plan::ScheduleFile::parse(R"({
    "streams": ["s1", "s2"],
    "tasks": [{"name": "A", "stream": "s1"}, {"name": "B", "stream": "s2"}],
    "thread_maps": [{"groups": {"t0": ["A"], "t1": ["B"]}}],
    "costs": {"tasks": {"A": {"host_us": 100}, "B": {"host_us": 100}}}
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  EXPECT_DOUBLE_EQ(weft::plan::simulate(compiled, threads, *file.costs).host_step_us, 100);
  weft::plan::SimulationOptions options;
  options.gil_tasks = {"A"};
  EXPECT_DOUBLE_EQ(
      weft::plan::simulate(compiled, threads, *file.costs, options).host_step_us, 100);
  options.gil_tasks = {"A", "B"};
  const Timeline t = weft::plan::simulate(compiled, threads, *file.costs, options);
  EXPECT_DOUBLE_EQ(t.host_step_us, 200);
  EXPECT_DOUBLE_EQ(t.step_us, 200);
  ASSERT_EQ(t.host.size(), 2u);
  EXPECT_EQ(t.host[0].task, "A");
  EXPECT_DOUBLE_EQ(t.host[0].start_us, 0);
  EXPECT_DOUBLE_EQ(t.host[1].start_us, 100);
  options.gil_tasks = {"ghost"};
  EXPECT_THROW(weft::plan::simulate(compiled, threads, *file.costs, options), weft::Error);
}
