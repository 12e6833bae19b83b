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

Task& Task::movable_to(std::vector<std::string> streams) {
  movable_to_ = std::move(streams);
  return *this;
}

bool Task::may_run_on(std::string_view stream) const noexcept {
  return stream == stream_ ||
         std::find(movable_to_.begin(), movable_to_.end(), stream) != movable_to_.end();
}

void Task::move_to_stream(const std::string& stream) {
  if (stream == stream_) return;
  const auto it = std::find(movable_to_.begin(), movable_to_.end(), stream);
  if (it == movable_to_.end()) {
    std::string allowed = "'" + stream_ + "'";
    for (const auto& s : movable_to_) allowed += ", '" + s + "'";
    WEFT_FAIL("task '", name_, "' cannot move to stream '", stream, "': ",
              movable_to_.empty() ? "its stream is fixed ('" + stream_ +
                                        "'; the schedule declares no movable_to for it)"
                                  : "its movable_to allows " + allowed + " only");
  }
  *it = std::exchange(stream_, stream);
}

Task& Task::lookahead(int la) {
  WEFT_CHECK(la >= 0 && la <= kMaxLookahead, "schedule: task '", name_, "' has lookahead ", la,
             " (rule: 0 <= lookahead <= ", kMaxLookahead, ")");
  lookahead_ = la;
  return *this;
}

Task& Task::cross_iter_depends_on(std::string producer, int offset) {
  WEFT_CHECK(offset < 0, "schedule: task '", name_, "' has cross_iter_depends_on '", producer,
             "' with offset ", offset,
             " (rule: cross_iter offsets are < 0; use depends_on for the same batch)");
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
