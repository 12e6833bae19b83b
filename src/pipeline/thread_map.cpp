#include "weft/pipeline/thread_map.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::pipeline {

namespace {

constexpr std::array<std::string_view, 7> kPresetNames = {
    "legacy", "default", "by_stream", "per_task", "io_prefetch_compute", "io_data_dist_compute",
    "full_split"};

ThreadGroup io_group() { return {"io", {"h2d", "start_shuffle", "finish_shuffle"}}; }
ThreadGroup data_dist_group() { return {"data_dist", {"start_input_dist", "wait_input_dist"}}; }
ThreadGroup prefetch_group() { return {"prefetch", {"prefetch_embeddings"}}; }

}  // namespace

ThreadMap ThreadMap::legacy() {
  ThreadMap map(Kind::kLegacy, "legacy");
  map.preset_ = true;
  return map;
}

ThreadMap ThreadMap::by_stream() {
  ThreadMap map(Kind::kByStream, "by_stream");
  map.preset_ = true;
  return map;
}

ThreadMap ThreadMap::per_task() {
  ThreadMap map(Kind::kPerTask, "per_task");
  map.preset_ = true;
  return map;
}

ThreadMap ThreadMap::groups(std::vector<ThreadGroup> groups, std::string rest) {
  ThreadMap map(Kind::kGroups, "explicit");
  map.groups_ = std::move(groups);
  map.rest_ = std::move(rest);
  return map;
}

std::span<const std::string_view> ThreadMap::preset_names() noexcept { return kPresetNames; }

ThreadMap ThreadMap::preset(std::string_view name) {
  if (name == "legacy") return legacy();
  if (name == "by_stream") return by_stream();
  if (name == "per_task") return per_task();
  std::vector<ThreadGroup> groups;
  if (name == "default") {
    groups = {io_group()};
  } else if (name == "io_prefetch_compute") {
    groups = {io_group(), prefetch_group()};
  } else if (name == "io_data_dist_compute") {
    groups = {io_group(), data_dist_group()};
  } else if (name == "full_split") {
    groups = {io_group(), data_dist_group(), prefetch_group()};
  } else {
    std::string known;
    for (auto n : kPresetNames) known += (known.empty() ? "" : ", ") + std::string(n);
    WEFT_FAIL("unknown thread map preset '", name, "' (known: ", known, ")");
  }
  ThreadMap map = ThreadMap::groups(std::move(groups), "compute");
  map.name_ = std::string(name);
  map.preset_ = true;
  return map;
}

ThreadAssignment ThreadMap::assign(const CompiledSchedule& schedule) const {
  const auto num_tasks = static_cast<TaskId>(schedule.num_tasks());
  constexpr std::uint32_t kUnmapped = ~std::uint32_t{0};
  ThreadAssignment out;
  out.thread_of_task.assign(num_tasks, kUnmapped);

  switch (kind_) {
    case Kind::kLegacy:
      out.sequential = true;
      out.thread_names = {"main"};
      std::fill(out.thread_of_task.begin(), out.thread_of_task.end(), 0);
      break;
    case Kind::kPerTask:
      for (TaskId t = 0; t < num_tasks; ++t) {
        out.thread_of_task[t] = t;
        out.thread_names.push_back(schedule.task(t).name());
      }
      break;
    case Kind::kByStream: {
      std::vector<std::uint32_t> thread_of_stream(schedule.num_streams(), kUnmapped);
      for (StreamId s = 0; s < schedule.num_streams(); ++s) {
        for (TaskId t = 0; t < num_tasks; ++t) {
          if (schedule.stream_of(t) != s) continue;
          if (thread_of_stream[s] == kUnmapped) {
            thread_of_stream[s] = static_cast<std::uint32_t>(out.thread_names.size());
            out.thread_names.push_back(schedule.stream(s).name);
          }
          out.thread_of_task[t] = thread_of_stream[s];
        }
      }
      break;
    }
    case Kind::kGroups: {
      // Threads in group order, the rest thread last; empty threads of a preset are dropped.
      std::vector<std::string> names;
      for (const ThreadGroup& g : groups_) {
        WEFT_CHECK(!g.name.empty(), "thread map '", name_, "': a thread has an empty name");
        WEFT_CHECK(std::find(names.begin(), names.end(), g.name) == names.end(), "thread map '",
                   name_, "': thread '", g.name, "' listed twice");
        names.push_back(g.name);
      }
      if (!rest_.empty() && std::find(names.begin(), names.end(), rest_) == names.end()) {
        names.push_back(rest_);
      }
      std::vector<std::uint32_t> group_of_task(num_tasks, kUnmapped);
      for (std::uint32_t g = 0; g < groups_.size(); ++g) {
        for (const std::string& task : groups_[g].tasks) {
          const auto id = schedule.find_task(task);
          if (!id) {
            WEFT_CHECK(preset_, "thread map '", name_, "': thread '", groups_[g].name,
                       "' lists task '", task, "' which the schedule does not have");
            continue;
          }
          WEFT_CHECK(group_of_task[*id] == kUnmapped, "thread map '", name_, "': task '", task,
                     "' is mapped to threads '", names[group_of_task[*id]], "' and '",
                     groups_[g].name, "' (rule: one thread per task)");
          group_of_task[*id] = g;
        }
      }
      for (TaskId t = 0; t < num_tasks; ++t) {
        if (group_of_task[t] != kUnmapped) continue;
        WEFT_CHECK(!rest_.empty(), "thread map '", name_, "': task '", schedule.task(t).name(),
                   "' is mapped to no thread (rule: every task has a thread; or give a rest thread)");
        group_of_task[t] = static_cast<std::uint32_t>(
            std::find(names.begin(), names.end(), rest_) - names.begin());
      }
      std::vector<std::uint32_t> thread_of_group(names.size(), kUnmapped);
      for (std::uint32_t g = 0; g < names.size(); ++g) {
        const bool used = std::find(group_of_task.begin(), group_of_task.end(), g) !=
                          group_of_task.end();
        if (!used) continue;
        thread_of_group[g] = static_cast<std::uint32_t>(out.thread_names.size());
        out.thread_names.push_back(names[g]);
      }
      for (TaskId t = 0; t < num_tasks; ++t) out.thread_of_task[t] = thread_of_group[group_of_task[t]];
      break;
    }
  }
  out.tasks_of_thread.resize(out.thread_names.size());
  for (TaskId t : schedule.run_order()) out.tasks_of_thread[out.thread_of_task[t]].push_back(t);
  return out;
}

}  // namespace weft::pipeline
