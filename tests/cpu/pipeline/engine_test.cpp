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

// cross_iter_depends_on at run time: the consumer of batch b runs after the producer of batch
// b + offset, on the host (same progress, other thread) and on the streams (other stream).
TEST(Engine, CrossIterDependenciesHoldAtRunTime) {
  struct Seen {
    std::atomic<std::int64_t> host_done{-1};    // the producer's last batch, set after its body
    std::atomic<std::int64_t> stream_done{-1};  // the same, by the producer's stream work
    std::atomic<int> num_host_early{0};
    std::atomic<int> num_stream_early{0};
    std::atomic<int> num_runs{0};
  };
  // Progress distance 0 (p at la 0, c at la 1, offset -1: both in one progress) and 1 (both at
  // la 0; "ahead" at la 1 makes the ring 2 deep, so that p's event of batch b - 1 is kept).
  for (const int consumer_la : {1, 0}) {
    for (const ThreadMap& map : {ThreadMap::per_task(), ThreadMap::legacy()}) {
      SCOPED_TRACE("consumer la " + std::to_string(consumer_la) + ", map " + map.name());
      auto seen = std::make_shared<Seen>();
      Schedule s;
      s.add_stream("ps").add_stream("cs");
      s.add(Task("ahead").lookahead(1));
      s.add(Task("p").stream("ps").body([seen](TaskContext& c) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        host_stream(c).enqueue([seen, batch = c.batch_index()] {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          seen->stream_done.store(batch);
        });
        seen->host_done.store(c.batch_index());
      }));
      s.add(Task("c").stream("cs").lookahead(consumer_la).cross_iter_depends_on("p", -1).body(
          [seen](TaskContext& c) {
            const std::int64_t needed = c.batch_index() - 1;
            if (seen->host_done.load() < needed) ++seen->num_host_early;
            host_stream(c).enqueue([seen, needed] {
              if (seen->stream_done.load() < needed) ++seen->num_stream_early;
              ++seen->num_runs;
            });
          }));
      Engine engine(std::move(s), map);
      engine.set_source([n = 0](Batch&) mutable { return n++ < 12; });
      std::int64_t num_steps = 0;
      while (engine.progress()) ++num_steps;
      engine.synchronize();
      EXPECT_EQ(num_steps, 12);
      EXPECT_EQ(seen->num_runs.load(), 12);
      EXPECT_EQ(seen->num_host_early.load(), 0);
      EXPECT_EQ(seen->num_stream_early.load(), 0);
    }
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
