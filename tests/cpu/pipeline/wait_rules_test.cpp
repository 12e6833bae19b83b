#include <gtest/gtest.h>

#include <set>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

bool is_io(std::string_view task) {
  return task == "h2d" || task == "start_shuffle" || task == "finish_shuffle";
}

struct Named {
  std::string producer, consumer;
  WaitRule rule;
  auto operator<=>(const Named&) const = default;
};

std::set<Named> named_waits(const hstu::HstuVariant& v) {
  CompiledSchedule s(hstu::hstu_schedule({.cascade = v.cascade}));
  const ThreadAssignment threads = ThreadMap::preset(v.thread_map).assign(s);
  std::set<Named> out;
  for (const WaitEdge& w : cross_thread_waits(s, threads)) {
    EXPECT_NE(threads.thread_of_task[w.producer], threads.thread_of_task[w.consumer]);
    EXPECT_FALSE(describe(w, s, threads).empty());
    out.insert({s.task(w.producer).name(), s.task(w.consumer).name(), w.rule});
  }
  return out;
}

TEST(HstuPreset, FourteenTasksAndTheCascades) {
  CompiledSchedule d3(hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3}));
  CompiledSchedule d6(hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD6}));
  EXPECT_EQ(d3.num_tasks(), 14u);
  EXPECT_EQ(d3.in_flight(), 3);
  EXPECT_EQ(d6.in_flight(), 6);
  const std::map<std::string, std::pair<int, int>> la = {
      {"h2d", {2, 5}}, {"start_shuffle", {2, 4}}, {"finish_shuffle", {2, 3}},
      {"start_input_dist", {1, 3}}, {"wait_input_dist", {1, 2}},
      {"prefetch_embeddings", {1, 1}}, {"backward", {0, 0}}};
  for (const auto& [name, expected] : la) {
    EXPECT_EQ(d3.task(d3.task_id(name)).lookahead(), expected.first) << name;
    EXPECT_EQ(d6.task(d6.task_id(name)).lookahead(), expected.second) << name;
  }
  std::vector<std::string> collectives;
  for (TaskId t : d3.collective_order()) collectives.push_back(d3.task(t).name());
  EXPECT_EQ(collectives, (std::vector<std::string>{
                             "start_shuffle", "finish_shuffle", "start_input_dist",
                             "wait_input_dist", "global_tokens_allreduce", "compute_output_dist",
                             "backward", "finalize_model_grads"}));
  int num_kernels = 0;
  for (const Task& t : d3.tasks()) {
    for (const CollectiveOp& op : t.collectives()) num_kernels += op.count;
  }
  EXPECT_EQ(num_kernels, 11);  // the HSTU benchmark's NCCL inventory
  EXPECT_EQ(hstu::hstu_variants().size(), 9u);
  testing::expect_error([] { hstu::hstu_variant("nope"); }, {"'nope'", "full_split_d6"});
  testing::expect_error([] { hstu::hstu_schedule({.bodies = {{"ghost", {}}}}); }, {"'ghost'"});
}

// The HSTU benchmark's consequence: no d3 variant waits from an io task on a non-io task inside a
// progress; default_d6 and full_split_d6 do (finish_shuffle -> start_input_dist, both la 3).
TEST(WaitRules, IoToComputeWaitsOnlyInTheD6Cascade) {
  for (const hstu::HstuVariant& v : hstu::hstu_variants()) {
    bool io_to_other = false;
    for (const Named& w : named_waits(v)) io_to_other |= is_io(w.producer) && !is_io(w.consumer);
    const bool expected = v.name == "default_d6" || v.name == "full_split_d6";
    EXPECT_EQ(io_to_other, expected) << v.name;
    if (expected) {
      EXPECT_TRUE(named_waits(v).contains(
          {"finish_shuffle", "start_input_dist", WaitRule::kOrderingSameProgress}))
          << v.name;
    }
  }
}

TEST(WaitRules, PerVariantSpotChecks) {
  EXPECT_TRUE(named_waits(hstu::hstu_variant("legacy_none")).empty());
  const auto per_task = named_waits(hstu::hstu_variant("per_task_d3"));
  // The la = 0 cluster waits across threads: forward -> backward pins backward after forward.
  EXPECT_TRUE(per_task.contains({"forward", "backward", WaitRule::kOrderingSameProgress}));
  EXPECT_TRUE(per_task.contains({"prefetch_embeddings", "backward", WaitRule::kSameProgressSync}));
  // One stream fed by 3 threads keeps run order.
  EXPECT_TRUE(per_task.contains({"h2d", "start_shuffle", WaitRule::kStreamOrder}));
  // Different lookahead: satisfied by the ring, no wait.
  EXPECT_FALSE(per_task.contains({"finish_shuffle", "start_input_dist",
                                  WaitRule::kOrderingSameProgress}));
  const auto full_split = named_waits(hstu::hstu_variant("full_split_d3"));
  EXPECT_EQ(full_split, (std::set<Named>{
                            {"wait_input_dist", "prefetch_embeddings",
                             WaitRule::kOrderingSameProgress},
                            {"prefetch_embeddings", "backward", WaitRule::kSameProgressSync},
                        }));
  // default_d3: io and compute share no same-progress edge at all.
  EXPECT_TRUE(named_waits(hstu::hstu_variant("default_d3")).empty());
}

TEST(WaitRules, StreamWaitsAndSides) {
  Schedule s;
  s.add_stream("side");
  s.add(Task("p").stream("side"));
  s.add(Task("cpu_only").same_progress_sync("p", SyncSide::kCpu));
  s.add(Task("gpu_only").same_progress_sync("p", SyncSide::kGpu));
  s.add(Task("ordered").depends_on("p"));
  CompiledSchedule c(std::move(s));
  const auto threads = ThreadMap::per_task().assign(c);
  std::map<std::string, WaitEdge> by_consumer;
  for (const WaitEdge& w : wait_edges(c, threads)) {
    if (w.rule != WaitRule::kStreamOrder) by_consumer[c.task(w.consumer).name()] = w;
  }
  EXPECT_TRUE(by_consumer["cpu_only"].host_wait);
  EXPECT_FALSE(by_consumer["cpu_only"].stream_wait);
  EXPECT_TRUE(by_consumer["gpu_only"].host_wait);  // the event must be recorded first
  EXPECT_TRUE(by_consumer["gpu_only"].stream_wait);
  EXPECT_TRUE(by_consumer["ordered"].stream_wait);
  // Sequential: no host waits, the same stream waits.
  for (const WaitEdge& w : wait_edges(c, ThreadMap::legacy().assign(c))) {
    EXPECT_FALSE(w.host_wait);
  }
}

// The engine honours every host wait edge: for each progress, the producer's body has finished
// before the consumer's starts, with random delays in every body.
TEST(WaitRules, EngineHonoursHostWaitsForEveryVariant) {
  for (const hstu::HstuVariant& v : hstu::hstu_variants()) {
    const std::uint64_t seed = 1234 + v.name.size();
    SCOPED_TRACE(std::string(v.name) + " seed " + std::to_string(seed));
    std::atomic<std::int64_t> clock{0};
    const auto num_tasks = hstu::hstu_task_names().size();
    // [iteration % 64][task] -> start / end ticks
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> ticks(
        64, std::vector<std::pair<std::int64_t, std::int64_t>>(num_tasks, {-1, -1}));
    hstu::HstuOptions options{.cascade = v.cascade};
    for (std::size_t t = 0; t < num_tasks; ++t) {
      options.bodies[std::string(hstu::hstu_task_names()[t])] = [&, t](TaskContext& c) {
        auto& slot = ticks[static_cast<std::size_t>(c.iteration() % 64)][t];
        slot.first = clock.fetch_add(1);
        testing::jitter(seed, c);
        slot.second = clock.fetch_add(1);
      };
    }
    Engine engine(hstu::hstu_schedule(options), ThreadMap::preset(v.thread_map));
    const auto waits = cross_thread_waits(engine.schedule(), engine.threads());
    int num_checked = 0;
    engine.set_source([n = 0](Batch&) mutable { return n++ < 40; });
    while (engine.progress()) {
      // Every iteration since the last progress: check, then forget.
      for (auto& row : ticks) {
        for (const WaitEdge& w : waits) {
          const auto& p = row[w.producer];
          const auto& c = row[w.consumer];
          if (p.first < 0 || c.first < 0) continue;
          EXPECT_LT(p.second, c.first) << describe(w, engine.schedule(), engine.threads());
          ++num_checked;
        }
        for (auto& cell : row) cell = {-1, -1};
      }
    }
    if (!waits.empty()) {
      EXPECT_GT(num_checked, 0);
    }
  }
}

}  // namespace
}  // namespace weft::pipeline
