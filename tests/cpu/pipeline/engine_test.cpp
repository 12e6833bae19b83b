#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <set>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

using testing::counting_source;
using testing::expect_error;

std::vector<ThreadMap> all_maps() {
  std::vector<ThreadMap> maps;
  for (auto name : ThreadMap::preset_names()) maps.push_back(ThreadMap::preset(name));
  maps.push_back(ThreadMap::groups({{"one", {"a", "c"}}, {"two", {"b"}}}));
  return maps;
}

Schedule data_flow_schedule() {
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  s.add(Task("a").lookahead(2).stream("side").reads("input").writes("x").body([](TaskContext& c) {
    c.set("x", c.get<std::int64_t>("input") * 10);
  }));
  s.add(Task("b").lookahead(1).reads("x").writes("y").body([](TaskContext& c) {
    c.set("y", c.get<std::int64_t>("x") + 1);
  }));
  s.add(Task("c").reads("y", "input").writes("out").body([](TaskContext& c) {
    EXPECT_EQ(c.get<std::int64_t>("y"), c.get<std::int64_t>("input") * 10 + 1);
    c.set("out", c.get<std::int64_t>("y"));
  }));
  return s;
}

TEST(Engine, DataFlowsThroughTheRingOnEveryThreadMap) {
  for (const ThreadMap& map : all_maps()) {
    Engine engine(data_flow_schedule(), map);
    engine.set_source(counting_source(20));
    std::int64_t n = 0;
    while (auto step = engine.progress()) {
      EXPECT_EQ(step->get<std::int64_t>("out"), n * 10 + 1) << map.name();
      ++n;
    }
    EXPECT_EQ(n, 20) << map.name();
  }
}

// Spinning and sleeping hand-offs compute the same; a spin that is not a number or absurdly long
// is refused before any thread starts.
TEST(Engine, SpinOptionIsValidatedAndEveryChoiceRuns) {
  EXPECT_GE(usable_cpus(), 1u);
  for (double spin_us : {-1.0, 0.0, 5.0}) {
    Engine engine(data_flow_schedule(), ThreadMap::per_task(), std::make_unique<HostBackend>(),
                  EngineOptions{.spin_us = spin_us});
    engine.set_source(counting_source(50));
    std::int64_t n = 0;
    while (auto step = engine.progress()) EXPECT_EQ(step->get<std::int64_t>("out"), 10 * n++ + 1);
    EXPECT_EQ(n, 50) << spin_us;
  }
  for (double bad : {std::nan(""), 2e6}) {
    expect_error(
        [&] {
          Engine engine(data_flow_schedule(), ThreadMap::per_task(),
                        std::make_unique<HostBackend>(), EngineOptions{.spin_us = bad});
        },
        {"EngineOptions::spin_us"});
  }
}

TEST(Engine, ThreadsPersistAndInitRunsOnceOnTheTaskThread) {
  std::mutex mutex;
  std::map<std::string, std::set<std::thread::id>> body_threads;
  std::map<std::string, std::thread::id> init_threads;
  std::map<std::string, int> num_inits;
  Schedule s;
  for (const char* name : {"a", "b", "c"}) {
    s.add(Task(name)
              .init([&, name](TaskContext& c) {
                std::lock_guard lock(mutex);
                EXPECT_EQ(c.batch_index(), -1);
                init_threads[name] = std::this_thread::get_id();
                ++num_inits[name];
              })
              .body([&, name](TaskContext&) {
                std::lock_guard lock(mutex);
                body_threads[name].insert(std::this_thread::get_id());
              }));
  }
  Engine engine(std::move(s), ThreadMap::per_task());
  engine.set_source([n = 0](Batch&) mutable { return n++ < 50; });
  while (engine.progress()) {
  }
  for (const char* name : {"a", "b", "c"}) {
    EXPECT_EQ(num_inits[name], 1);
    ASSERT_EQ(body_threads[name].size(), 1u) << name;
    EXPECT_EQ(*body_threads[name].begin(), init_threads[name]);
    EXPECT_NE(init_threads[name], std::this_thread::get_id());
  }
}

TEST(Engine, SlotAccessIsCheckedAgainstDeclarations) {
  Schedule s;
  s.add_input("input");
  s.add(Task("a").reads("input").writes("x").body([](TaskContext& c) {
    c.set("x", 1);
    c.set("input", 2);  // not declared as a write
  }));
  Engine engine(std::move(s), ThreadMap::legacy());
  engine.set_source(counting_source(3));
  expect_error([&] { engine.progress(); }, {"'a'", "writes slot 'input'", "writes()"});
  EXPECT_TRUE(engine.failed());
  expect_error([&] { engine.progress(); }, {"failed in an earlier progress", "reset()"});
}

TEST(Engine, TicketsFollowRunOrderAmongActiveCollectives) {
  std::mutex mutex;
  std::vector<std::pair<std::string, int>> seen;
  auto body = [&](TaskContext& c) {
    std::lock_guard lock(mutex);
    seen.emplace_back(std::string(c.name()), c.ticket());
  };
  Schedule s;
  s.add(Task("ahead").lookahead(1).collective().body(body));
  s.add(Task("plain").body(body));
  s.add(Task("now").collective().body(body));
  Engine engine(std::move(s), ThreadMap::per_task());
  engine.set_source([n = 0](Batch&) mutable { return n++ < 2; });
  while (engine.progress()) {
  }
  std::sort(seen.begin(), seen.end());
  using Seen = std::vector<std::pair<std::string, int>>;
  // Iteration 0: only "ahead" (ticket 0); 1: ahead 0, now 1; 2: only "now" (ticket 0).
  EXPECT_EQ(seen, (Seen{{"ahead", 0}, {"ahead", 0}, {"now", 0}, {"now", 1},
                        {"plain", -1}, {"plain", -1}}));
}

// Host backend: an event covers exactly the work enqueued before it, and a consumer on another
// stream waits for it (and not for later work on the producer's stream).
TEST(HostBackendTest, CrossStreamWaitsOnTheProducersEvent) {
  std::atomic<int> value{0};
  std::atomic<bool> release_later{false};
  std::atomic<bool> later_timed_out{false};
  std::vector<int> observed;
  std::mutex mutex;
  Schedule s;
  s.add_stream("producer").add_stream("consumer");
  s.add(Task("p").stream("producer").writes("x").body([&](TaskContext& c) {
    host_stream(c).enqueue([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      value.fetch_add(1);
    });
  }));
  s.add(Task("later").stream("producer").body([&](TaskContext& c) {
    // Work after p's event on the same stream: blocks until the consumer has run.
    host_stream(c).enqueue([&] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!release_later.load()) {
        if (std::chrono::steady_clock::now() > deadline) {
          later_timed_out = true;  // q waited for the whole stream, not for p's event
          return;
        }
        std::this_thread::yield();
      }
      release_later.store(false);
    });
  }));
  s.add(Task("q").stream("consumer").reads("x").body([&](TaskContext& c) {
    host_stream(c).enqueue([&] {
      std::lock_guard lock(mutex);
      observed.push_back(value.load());
      release_later.store(true);
    });
  }));
  for (const char* map : {"legacy", "per_task"}) {
    value = 0;
    observed.clear();
    Engine engine(s, ThreadMap::preset(map));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 5; });
    while (engine.progress()) {
    }
    engine.synchronize();
    EXPECT_EQ(observed, (std::vector<int>{1, 2, 3, 4, 5})) << map;
    EXPECT_FALSE(later_timed_out.load()) << map;
  }
}

TEST(HostBackendTest, CompleteEventsEnqueueNoMarkerAndErrorsAreSticky) {
  Schedule s;
  s.add_stream("side");
  s.add(Task("p").stream("side").writes("x"));
  s.add(Task("q").reads("x").body([](TaskContext& c) {
    host_stream(c).enqueue([] { throw std::runtime_error("stream work failed"); });
  }));
  auto backend = std::make_unique<HostBackend>();
  HostBackend* host = backend.get();
  Engine engine(std::move(s), ThreadMap::per_task(), std::move(backend));
  engine.set_source([n = 0](Batch&) mutable { return n++ < 20; });
  while (engine.progress()) {
  }
  EXPECT_EQ(host->num_wait_markers(), 0u);  // p enqueues nothing: its events are complete
  EXPECT_THROW(engine.synchronize(), std::runtime_error);
  EXPECT_NO_THROW(engine.synchronize());  // reported once
}

TEST(Engine, HostStreamOnlyOnHostBackend) {
  Schedule s;
  s.add(Task("a").body([](TaskContext& c) { host_stream(c, "nowhere"); }));
  Engine engine(std::move(s), ThreadMap::legacy());
  engine.set_source([n = 0](Batch&) mutable { return n++ < 1; });
  expect_error([&] { engine.progress(); }, {"no stream 'nowhere'"});
}

}  // namespace
}  // namespace weft::pipeline
