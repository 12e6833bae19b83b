#include "weft/pipeline/schedule.hpp"

#include <algorithm>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::pipeline {

Schedule::Schedule() { streams_.push_back({"default", 0}); }

Schedule& Schedule::add(Task task) {
  tasks_.push_back(std::move(task));
  return *this;
}

Schedule& Schedule::add_stream(std::string name, int priority) {
  streams_.push_back({std::move(name), priority});
  return *this;
}

Schedule& Schedule::add_input(std::string slot) {
  inputs_.push_back(std::move(slot));
  return *this;
}

bool Schedule::has_task(std::string_view name) const noexcept {
  return std::any_of(tasks_.begin(), tasks_.end(), [&](const Task& t) { return t.name() == name; });
}

Task& Schedule::task(std::string_view name) {
  auto it = std::find_if(tasks_.begin(), tasks_.end(),
                         [&](const Task& t) { return t.name() == name; });
  if (it == tasks_.end()) WEFT_FAIL("schedule has no task '", name, "'");
  return *it;
}

const Task& Schedule::task(std::string_view name) const {
  return const_cast<Schedule*>(this)->task(name);
}

}  // namespace weft::pipeline
