#include "weft/pipeline/task.hpp"

#include <algorithm>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::pipeline {

std::string_view to_string(SyncSide side) noexcept {
  switch (side) {
    case SyncSide::kCpu: return "cpu";
    case SyncSide::kGpu: return "gpu";
    case SyncSide::kBoth: return "both";
  }
  return "?";
}

SyncSide parse_sync_side(std::string_view text) {
  if (text == "cpu") return SyncSide::kCpu;
  if (text == "gpu") return SyncSide::kGpu;
  if (text == "both") return SyncSide::kBoth;
  WEFT_FAIL("unknown sync side '", text, "' (expected cpu, gpu or both)");
}

Task::Task(std::string name) : name_(std::move(name)) {}

Task& Task::stream(std::string name) {
  stream_ = std::move(name);
  return *this;
}

Task& Task::lookahead(int la) {
  WEFT_CHECK(la >= 0 && la <= kMaxLookahead, "schedule: task '", name_, "' has lookahead ", la,
             " (rule: 0 <= lookahead <= ", kMaxLookahead, ")");
  lookahead_ = la;
  return *this;
}

Task& Task::cross_iter_depends_on(std::string producer, int offset) {
  cross_iter_.push_back({std::move(producer), offset});
  return *this;
}

Task& Task::same_progress_sync(std::string producer, SyncSide side) {
  sync_.push_back({std::move(producer), side});
  return *this;
}

Task& Task::collective(std::vector<CollectiveOp> inventory) {
  collective_ = true;
  inventory_ = std::move(inventory);
  return *this;
}

Task& Task::body(TaskBody body) {
  body_ = std::move(body);
  return *this;
}

Task& Task::init(TaskBody init) {
  init_ = std::move(init);
  return *this;
}

void Task::set_same_progress_sync(std::string producer, SyncSide side) {
  auto it = std::find_if(sync_.begin(), sync_.end(),
                         [&](const SyncEdge& e) { return e.producer == producer; });
  if (it != sync_.end()) {
    it->side = side;
  } else {
    sync_.push_back({std::move(producer), side});
  }
}

}  // namespace weft::pipeline
