// weft::pipeline::ScheduleError: a schedule that breaks one of CompiledSchedule's rules.
//
// The message names the task and the rule for a reader; what the rule is about is also carried as
// data, so a reader of a schedule file can point at the offending value (ScheduleFile's JSON
// paths) without parsing the message.
//
//   try { CompiledSchedule c(std::move(schedule)); }
//   catch (const ScheduleError& e) { if (e.task()) report(*e.task(), e.field(), e.message()); }
#pragma once

#include <cstddef>
#include <optional>
#include <source_location>
#include <string>

#include "weft/core/error.hpp"

namespace weft::pipeline {

class ScheduleError : public Error {
 public:
  ScheduleError(std::optional<std::size_t> task, std::string field, const std::string& message,
                std::source_location where = std::source_location::current())
      : Error(message, where), task_(task), field_(std::move(field)) {}

  // The task the rule is about: its index in Schedule::tasks() (declaration order); empty when
  // the rule concerns the schedule's streams, inputs or its task list as a whole.
  const std::optional<std::size_t>& task() const noexcept { return task_; }
  // With a task: the Task field the rule concerns ("name", "lookahead", "stream", "reads",
  // "writes", "depends_on", "cross_iter_depends_on", "same_progress_sync", "collective",
  // "movable_to").
  // Without one: "streams", "inputs" or "tasks".
  const std::string& field() const noexcept { return field_; }

 private:
  std::optional<std::size_t> task_;
  std::string field_;
};

}  // namespace weft::pipeline
