// weft::pipeline::Schedule: the tasks of one training step, their streams and the batch's inputs.
//
// A Schedule is a builder and checks nothing; CompiledSchedule validates it. The stream "default"
// always exists; other streams are declared with a priority (0 = normal, larger = more urgent).
// Inputs are the slots the data source fills when a batch enters the ring.
// Schedule and Task are plain values without synchronisation: build one on one thread; the engine
// takes it by value into its CompiledSchedule.
//
//   Schedule s;
//   s.add_stream("memcpy").add_input("batch_cpu");
//   s.add(Task("h2d").stream("memcpy").lookahead(1).reads("batch_cpu").writes("batch_gpu"));
//   s.add(Task("forward").reads("batch_gpu").writes("loss"));
//   CompiledSchedule compiled(std::move(s));   // throws weft::Error naming the task and rule
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/task.hpp"

namespace weft::pipeline {

struct StreamSpec {
  std::string name;  // non-empty, unique in the schedule; "default" is always declared
  int priority = 0;  // 0 = normal; larger = more urgent (mapped onto the backend's range)
  bool operator==(const StreamSpec&) const = default;
};

class Schedule {
 public:
  Schedule();

  Schedule& add(Task task);
  Schedule& add_stream(std::string name, int priority = 0);
  Schedule& add_input(std::string slot);

  // The task of that name, for edits before compilation; throws weft::Error if there is none.
  Task& task(std::string_view name);
  const Task& task(std::string_view name) const;
  bool has_task(std::string_view name) const noexcept;

  const std::vector<Task>& tasks() const noexcept { return tasks_; }
  const std::vector<StreamSpec>& streams() const noexcept { return streams_; }
  const std::vector<std::string>& inputs() const noexcept { return inputs_; }

 private:
  std::vector<Task> tasks_;
  std::vector<StreamSpec> streams_;
  std::vector<std::string> inputs_;
};

}  // namespace weft::pipeline
