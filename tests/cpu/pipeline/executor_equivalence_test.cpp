// The threaded executor gives every stream the work the sequential executor gives it, in the
// same order, whatever the thread map: two tasks on one stream fed by different threads keep run
// order on that stream in every iteration (prefill and drain included), and a consumer's stream
// work runs after the producer's it waits on. Checked on a hand-made case and on random
// schedules and thread maps, with reproducible random delays in the bodies.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"

namespace weft::pipeline {
namespace {

// What the streams ran: per stream, the (task, batch) of each work item in execution order, and
// a global execution sequence number per (task, batch).
class StreamLog {
 public:
  struct Entry {
    std::string task;
    std::int64_t batch;
    bool operator==(const Entry&) const = default;
  };
  void record(const std::string& stream, const std::string& task, std::int64_t batch) {
    std::lock_guard lock(mutex_);
    by_stream_[stream].push_back({task, batch});
    sequence_[{task, batch}] = next_++;
  }
  std::map<std::string, std::vector<Entry>> by_stream() const {
    std::lock_guard lock(mutex_);
    return by_stream_;
  }
  std::optional<std::int64_t> sequence(const std::string& task, std::int64_t batch) const {
    std::lock_guard lock(mutex_);
    const auto it = sequence_.find({task, batch});
    if (it == sequence_.end()) return std::nullopt;
    return it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<Entry>> by_stream_;
  std::map<std::pair<std::string, std::int64_t>, std::int64_t> sequence_;
  std::int64_t next_ = 0;
};

std::string to_text(const std::vector<StreamLog::Entry>& entries) {
  std::string out;
  for (const auto& e : entries) out += e.task + "@" + std::to_string(e.batch) + " ";
  return out;
}

// A body that enqueues one work item on the task's stream, recording it when it runs.
TaskBody logging_body(std::shared_ptr<StreamLog> log, std::function<void(TaskContext&)> before = {}) {
  return [log, before](TaskContext& c) {
    if (before) before(c);
    const std::string stream = c.schedule().stream(c.stream_id()).name;
    host_stream(c).enqueue([log, stream, task = std::string(c.name()), batch = c.batch_index()] {
      log->record(stream, task, batch);
    });
  };
}

std::map<std::string, std::vector<StreamLog::Entry>> run_and_log(
    const std::function<Schedule(std::shared_ptr<StreamLog>)>& make, const ThreadMap& map,
    int num_batches, std::shared_ptr<StreamLog> log = std::make_shared<StreamLog>()) {
  Engine engine(make(log), map);
  engine.set_source([n = 0, num_batches](Batch&) mutable { return n++ < num_batches; });
  int num_steps = 0;
  while (engine.progress()) ++num_steps;
  engine.synchronize();
  EXPECT_EQ(num_steps, num_batches);
  return log->by_stream();
}

// One stream; a (la 0), b (la 1), c (la 0) in run order; thread x = {a}, y = {b, c}; one batch.
// In the drain iteration b is inactive: c must still wait for a, which its stream-order
// predecessor b waited for in the iterations where b ran.
TEST(StreamOrder, InactiveTaskKeepsRunOrderOnItsStream) {
  auto make = [](std::shared_ptr<StreamLog> log) {
    Schedule s;
    s.add(Task("a").body(logging_body(log, [](TaskContext&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // c would overtake it
    })));
    s.add(Task("b").lookahead(1).body(logging_body(log)));
    s.add(Task("c").body(logging_body(log)));
    return s;
  };
  const auto sequential = run_and_log(make, ThreadMap::legacy(), 1);
  ASSERT_EQ(to_text(sequential.at("default")), "b@0 a@0 c@0 ");
  const auto threaded =
      run_and_log(make, ThreadMap::groups({{"x", {"a"}}, {"y", {"b", "c"}}}), 1);
  EXPECT_EQ(to_text(threaded.at("default")), "b@0 a@0 c@0 ");
}

// A random schedule: 3 to 7 tasks on 1 to 3 streams, lookaheads 0 to 2, random depends_on,
// cross_iter_depends_on and same_progress_sync edges to earlier tasks (schedules the validation
// refuses are skipped), each body delayed by a reproducible random amount.
struct RandomCase {
  std::uint64_t seed;
  std::vector<int> stream_of;
  std::vector<int> lookahead;
  std::vector<std::vector<int>> depends_on;
  std::vector<std::vector<std::pair<int, int>>> cross_iter;  // (producer, offset)
  std::vector<std::vector<std::pair<int, SyncSide>>> syncs;
  std::vector<int> thread_of;  // for the explicit map
  int num_batches = 1;

  static std::string name(int t) { return "t" + std::to_string(t); }
  static std::string stream_name(int s) { return s == 0 ? "default" : "s" + std::to_string(s); }

  Schedule make(std::shared_ptr<StreamLog> log) const {
    Schedule s;
    s.add_stream("s1").add_stream("s2");
    for (std::size_t t = 0; t < stream_of.size(); ++t) {
      Task task(name(int(t)));
      task.stream(stream_name(stream_of[t])).lookahead(lookahead[t]);
      for (int p : depends_on[t]) task.depends_on(name(p));
      for (auto [p, offset] : cross_iter[t]) task.cross_iter_depends_on(name(p), offset);
      for (auto [p, side] : syncs[t]) task.same_progress_sync(name(p), side);
      task.body(logging_body(log, [seed = seed](TaskContext& c) { testing::jitter(seed, c); }));
      s.add(std::move(task));
    }
    return s;
  }

  ThreadMap explicit_map() const {
    std::map<int, std::vector<std::string>> tasks;
    for (std::size_t t = 0; t < thread_of.size(); ++t) tasks[thread_of[t]].push_back(name(int(t)));
    std::vector<ThreadGroup> groups;
    for (auto& [thread, names] : tasks) groups.push_back({"th" + std::to_string(thread), names});
    return ThreadMap::groups(std::move(groups));
  }
};

std::optional<RandomCase> random_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int n) { return int(rng() % std::uint64_t(n)); };
  RandomCase c;
  c.seed = seed;
  const int num_tasks = 3 + pick(5);
  const int num_streams = 1 + pick(3);
  const int num_threads = 1 + pick(num_tasks);
  for (int t = 0; t < num_tasks; ++t) {
    c.stream_of.push_back(pick(num_streams));
    c.lookahead.push_back(pick(3));
    c.thread_of.push_back(pick(num_threads));
    c.depends_on.emplace_back();
    c.cross_iter.emplace_back();
    c.syncs.emplace_back();
    for (int p = 0; p < t; ++p) {
      const int r = pick(12);
      if (r < 2) {
        c.depends_on.back().push_back(p);
      } else if (r < 3) {
        c.cross_iter.back().push_back({p, -1 - pick(2)});
      } else if (r < 4) {
        c.syncs.back().push_back({p, static_cast<SyncSide>(pick(3))});
      }
    }
  }
  c.num_batches = 1 + pick(4);
  try {
    CompiledSchedule check(c.make(std::make_shared<StreamLog>()));
  } catch (const weft::Error&) {
    return std::nullopt;
  }
  return c;
}

TEST(ExecutorEquivalence, RandomSchedulesAndThreadMapsMatchTheSequentialExecutor) {
  int num_cases = 0;
  for (std::uint64_t seed = 1; num_cases < 300; ++seed) {
    const auto random = random_case(seed);
    if (!random) continue;
    ++num_cases;
    const RandomCase& rc = *random;
    auto make = [&](std::shared_ptr<StreamLog> log) { return rc.make(log); };
    const auto expected = run_and_log(make, ThreadMap::legacy(), rc.num_batches);
    for (const ThreadMap& map : {rc.explicit_map(), ThreadMap::per_task(), ThreadMap::by_stream()}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", map " + map.name());
      auto log = std::make_shared<StreamLog>();
      const auto got = run_and_log(make, map, rc.num_batches, log);
      for (const auto& [stream, entries] : expected) {
        EXPECT_EQ(to_text(got.count(stream) ? got.at(stream) : std::vector<StreamLog::Entry>{}),
                  to_text(entries))
            << "stream " << stream;
      }
      // A stream waits on the producer's event: the consumer's work runs after the producer's.
      CompiledSchedule compiled(rc.make(log));
      const ThreadAssignment threads = map.assign(compiled);
      for (const WaitEdge& w : wait_edges(compiled, threads)) {
        if (!w.stream_wait) continue;
        const std::string producer = compiled.task(w.producer).name();
        const std::string consumer = compiled.task(w.consumer).name();
        for (std::int64_t b = 0; b < rc.num_batches; ++b) {
          const auto c = log->sequence(consumer, b);
          const auto p = log->sequence(producer, b + w.batch_offset);
          if (c && p) {
            EXPECT_GT(*c, *p) << producer << " -> " << consumer << " batch " << b;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace weft::pipeline
