// suggest -> schedule-config JSON -> the engine runs it: each suggestion for the HSTU schedule,
// written to a file and loaded back, runs on the host backend with results identical to the
// schedule as given under the legacy map. The bodies compute every slot they write from the
// slots they read and the batch, and optimizer_step folds its input into a running state in
// batch order, so a config that fed a task another batch's slot, dropped or repeated a run, or
// reordered the updates would change the results.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/pipeline.hpp"
#include "weft/plan/suggest.hpp"

namespace {

using namespace weft::pipeline;

// What one run computed: every task's value per batch, the stream each task's stream work ran
// on, and the state optimizer_step folds the batches into.
struct Results {
  std::map<std::pair<std::string, std::int64_t>, std::uint64_t> values;
  std::map<std::string, std::string> stream_of_task;
  std::uint64_t state = 0;
  bool operator==(const Results&) const = default;
};

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  return (h ^ v) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
}

std::uint64_t mix(std::uint64_t h, const std::string& text) {
  for (char ch : text) h = mix(h, std::uint64_t(static_cast<unsigned char>(ch)));
  return h;
}

constexpr int kNumBatches = 12;

// The HSTU schedule of that cascade with bodies that compute from their slots, the config (if
// any) applied, run over kNumBatches under `map` on the host backend.
Results run(weft::hstu::HstuCascade cascade, const ScheduleConfig* config, const ThreadMap& map) {
  auto results = std::make_shared<Results>();
  auto mutex = std::make_shared<std::mutex>();
  weft::hstu::HstuOptions options{.cascade = cascade};
  for (auto name : weft::hstu::hstu_task_names()) {
    options.bodies[std::string(name)] = [results, mutex](TaskContext& c) {
      const CompiledSchedule& s = c.schedule();
      const std::string task(c.name());
      std::uint64_t value = mix(mix(0, task), std::uint64_t(c.batch_index()));
      for (SlotId slot : s.reads_of(c.task_id())) {
        value = mix(value, c.get<std::uint64_t>(s.slot_name(slot)));
      }
      for (SlotId slot : s.writes_of(c.task_id())) {
        c.set(s.slot_name(slot), mix(value, s.slot_name(slot)));
      }
      const std::string stream = s.stream(c.stream_id()).name;
      host_stream(c).enqueue([results, mutex, task, stream, value, batch = c.batch_index()] {
        std::lock_guard lock(*mutex);
        results->values[{task, batch}] = value;
        const auto [it, first] = results->stream_of_task.emplace(task, stream);
        if (!first && it->second != stream) it->second += " and " + stream;
        if (task == "optimizer_step") results->state = mix(results->state, value);
      });
    };
  }
  Schedule schedule = weft::hstu::hstu_schedule(options);
  if (config != nullptr) config->apply(schedule);
  Engine engine(std::move(schedule), map);
  engine.set_source([n = 0](Batch& b) mutable {
    if (n == kNumBatches) return false;
    b.set("batch_cpu", mix(7, std::uint64_t(n++)));
    return true;
  });
  int num_steps = 0;
  while (engine.progress()) ++num_steps;
  engine.synchronize();
  EXPECT_EQ(num_steps, kNumBatches);
  std::lock_guard lock(*mutex);
  return *results;
}

TEST(SuggestRoundTrip, EverySuggestionRunsWithTheResultsOfTheScheduleAsGiven) {
  for (const auto cascade : {weft::hstu::HstuCascade::kD3, weft::hstu::HstuCascade::kD6}) {
    SCOPED_TRACE(std::string(weft::hstu::to_string(cascade)));
    const CompiledSchedule compiled(weft::hstu::hstu_schedule({.cascade = cascade}));
    const weft::plan::SuggestResult result =
        weft::plan::suggest(compiled, weft::plan::CostModel::hstu_defaults(), {.max_threads = 4});
    ASSERT_EQ(result.suggestions.size(), 3u);
    const Results reference = run(cascade, nullptr, ThreadMap::legacy());
    ASSERT_EQ(reference.values.size(), weft::hstu::hstu_task_names().size() * kNumBatches);
    for (std::size_t i = 0; i < result.suggestions.size(); ++i) {
      SCOPED_TRACE("suggestion " + std::to_string(i + 1));
      const auto path = std::filesystem::path(::testing::TempDir()) /
                        ("round-trip-" + std::string(weft::hstu::to_string(cascade)) + "-" +
                         std::to_string(i + 1) + ".json");
      std::ofstream(path) << result.suggestions[i].config.to_json();
      const ScheduleConfig loaded = ScheduleConfig::load(path.string());
      EXPECT_EQ(loaded, result.suggestions[i].config);
      ASSERT_TRUE(loaded.thread_map.has_value());
      // The config moves the schedule (else the comparison would be of a run with itself).
      EXPECT_TRUE(loaded.thread_map->kind() != ThreadMap::Kind::kLegacy ||
                  result.suggestions[i].step_us != result.start.step_us);
      EXPECT_EQ(run(cascade, &loaded, *loaded.thread_map), reference);
    }
  }
}

}  // namespace
