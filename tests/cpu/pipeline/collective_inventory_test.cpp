// Collective tasks report what they enqueue; the engine tallies it per task, in run order.
#include <gtest/gtest.h>

#include <string>

#include "weft/core/error.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline {
namespace {

Schedule two_collective_tasks() {
  Schedule s;
  s.add_stream("comm");
  s.add(Task("gather").stream("comm").lookahead(1).writes("x").collective().body([](TaskContext& c) {
    // Payload grows with the batch: 100, 200, 300, ... bytes.
    c.record_collective("AllGather", "comm", std::size_t(100 * (c.batch_index() + 1)));
  }));
  s.add(Task("reduce").reads("x").collective().body([](TaskContext& c) {
    c.record_collective("AllReduce (bucket 1)", "default", 4096);
    c.record_collective("AllReduce (bucket 2)", "default", 1024);
  }));
  s.add(Task("plain"));
  return s;
}

TEST(CollectiveInventory, TalliesPerTaskKindAndStreamUnderEveryMap) {
  for (const char* map : {"legacy", "by_stream", "per_task"}) {
    SCOPED_TRACE(map);
    Engine engine(two_collective_tasks(), ThreadMap::preset(map));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 4; });
    int num_steps = 0;
    while (engine.progress()) ++num_steps;
    ASSERT_EQ(num_steps, 4);
    const auto inventory = engine.collective_inventory();
    ASSERT_EQ(inventory.size(), 3u);
    EXPECT_EQ(inventory[0].task, "gather");
    EXPECT_EQ(inventory[0].kind, "AllGather");
    EXPECT_EQ(inventory[0].stream, "comm");
    EXPECT_DOUBLE_EQ(inventory[0].bytes_per_call, 250.0);  // (100 + 200 + 300 + 400) / 4
    EXPECT_DOUBLE_EQ(inventory[0].calls_per_run, 1.0);
    EXPECT_EQ(inventory[1].kind, "AllReduce (bucket 1)");
    EXPECT_DOUBLE_EQ(inventory[1].bytes_per_call, 4096.0);
    EXPECT_EQ(inventory[2].kind, "AllReduce (bucket 2)");
    EXPECT_DOUBLE_EQ(inventory[2].calls_per_run, 1.0);
  }
}

TEST(CollectiveInventory, OnlyCollectiveTasksMayRecord) {
  Schedule s;
  s.add(Task("sneaky").body([](TaskContext& c) { c.record_collective("AllReduce", "default", 8); }));
  Engine engine(std::move(s), ThreadMap::per_task());
  engine.set_source([n = 0](Batch&) mutable { return n++ < 1; });
  try {
    engine.progress();
    FAIL() << "a task not marked collective() recorded a collective";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("is not marked collective()"), std::string::npos) << e.what();
  }
}

TEST(CollectiveInventory, NotFromInit) {
  Schedule s;
  s.add(Task("warmup").collective().init([](TaskContext& c) {
    c.record_collective("AllReduce", "default", 8);
  }));
  EXPECT_THROW(Engine(std::move(s), ThreadMap::legacy()), Error);
}

}  // namespace
}  // namespace weft::pipeline
