// weft::pipeline::ThreadMap: which host thread runs which task.
//
// Kinds:
//  - legacy: no engine threads; progress() runs every task on the caller's thread in run order
//    (the sequential executor);
//  - by_stream: one thread per stream that has tasks, named after the stream;
//  - per_task: one thread per task, named after the task;
//  - groups: named threads, each with a list of task names, and optionally a `rest` thread that
//    takes every task not listed. Presets are groups over the HSTU task names with rest =
//    "compute"; names a preset lists that the schedule lacks are skipped and threads left without
//    tasks are dropped. An explicit map is strict: every name must be a task of the schedule and
//    every task must be mapped (or there must be a rest thread).
//
// Preset names: legacy, default (io / compute), by_stream, per_task, io_prefetch_compute,
// io_data_dist_compute, full_split (io / data_dist / prefetch / compute).
//
//   Engine engine(schedule, ThreadMap::preset("full_split"));
//   ThreadMap mine = ThreadMap::groups({{"io", {"h2d"}}, {"compute", {"forward", "backward"}}});
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"

namespace weft::pipeline {

struct ThreadGroup {
  std::string name;                // the engine thread's name (traces, reports)
  std::vector<std::string> tasks;  // names of the tasks the thread runs
  bool operator==(const ThreadGroup&) const = default;
};

// A thread map resolved against one schedule.
struct ThreadAssignment {
  std::vector<std::uint32_t> thread_of_task;  // by TaskId
  std::vector<std::string> thread_names;      // by thread index
  // Tasks of each thread, in run order.
  std::vector<std::vector<TaskId>> tasks_of_thread;
  bool sequential = false;                    // legacy: one thread, the caller's

  std::size_t num_threads() const noexcept { return thread_names.size(); }
};

class ThreadMap {
 public:
  enum class Kind : std::uint8_t { kLegacy, kByStream, kPerTask, kGroups };

  static ThreadMap legacy();
  static ThreadMap by_stream();
  static ThreadMap per_task();
  // Strict explicit map; `rest` (if not empty) names the thread of every unlisted task.
  static ThreadMap groups(std::vector<ThreadGroup> groups, std::string rest = {});
  // Throws weft::Error naming the known presets for an unknown name.
  static ThreadMap preset(std::string_view name);
  static std::span<const std::string_view> preset_names() noexcept;

  // Throws weft::Error for a strict map that names an unknown task, maps a task twice, or leaves
  // a task unmapped.
  ThreadAssignment assign(const CompiledSchedule& schedule) const;

  Kind kind() const noexcept { return kind_; }
  // The preset's name, or "explicit" for a map given as groups.
  const std::string& name() const noexcept { return name_; }
  const std::vector<ThreadGroup>& thread_groups() const noexcept { return groups_; }
  const std::string& rest() const noexcept { return rest_; }
  bool is_preset() const noexcept { return preset_; }

  bool operator==(const ThreadMap&) const = default;

 private:
  ThreadMap(Kind kind, std::string name) : kind_(kind), name_(std::move(name)) {}
  Kind kind_;
  std::string name_;
  std::vector<ThreadGroup> groups_;
  std::string rest_;
  bool preset_ = false;
};

}  // namespace weft::pipeline
