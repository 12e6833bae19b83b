// weft::pipeline::TaskContext: what a body sees of the engine (its task, its batch's slots, its
// stream), each slot access checked against the task's declared reads and writes.
#include "weft/pipeline/task_context.hpp"

#include <algorithm>
#include <string_view>

#include "engine_core.hpp"
#include "weft/core/error.hpp"

namespace weft::pipeline {

const CompiledSchedule& TaskContext::schedule() const { return core_->schedule(); }
const Task& TaskContext::task() const { return core_->schedule().task(task_); }
std::string_view TaskContext::name() const { return task().name(); }
int TaskContext::lookahead() const { return task().lookahead(); }
StreamId TaskContext::stream_id() const { return core_->schedule().stream_of(task_); }
void* TaskContext::stream_handle() const { return core_->stream_handle(stream_id()); }
Backend& TaskContext::backend() const { return core_->backend(); }

void* TaskContext::stream_handle(std::string_view stream) const {
  const auto id = core_->schedule().find_stream(stream);
  WEFT_CHECK(id.has_value(), "task '", name(), "': no stream '", stream, "' in the schedule");
  return core_->stream_handle(*id);
}

void TaskContext::record_collective(std::string_view kind, std::string_view stream,
                                    std::size_t num_bytes) {
  WEFT_CHECK(task().is_collective(), "task '", name(), "' records a collective (", kind,
             ") but is not marked collective(): its collectives would be enqueued outside the "
             "ticket order, which can deadlock the ranks");
  WEFT_CHECK(ticket_ >= 0, "task '", name(), "' records a collective (", kind,
             ") outside its body's ticket (in init()?)");
  core_->record_collective(task_, kind, stream, num_bytes);
}

Batch& TaskContext::batch() {
  WEFT_CHECK(batch_ != nullptr, "task '", name(), "': no batch in init()");
  return *batch_;
}

const std::any& TaskContext::readable(std::string_view slot) const {
  WEFT_CHECK(batch_ != nullptr, "task '", name(), "': no batch in init()");
  const CompiledSchedule& s = core_->schedule();
  const auto id = s.find_slot(slot);
  const bool declared =
      id && (std::ranges::find(s.reads_of(task_), *id) != s.reads_of(task_).end() ||
             std::ranges::find(s.writes_of(task_), *id) != s.writes_of(task_).end());
  WEFT_CHECK(declared, "task '", name(), "' reads slot '", slot,
             "' without declaring it in reads() or writes()");
  return batch_->values_[*id];
}

std::any& TaskContext::writable(std::string_view slot) {
  WEFT_CHECK(batch_ != nullptr, "task '", name(), "': no batch in init()");
  const CompiledSchedule& s = core_->schedule();
  const auto id = s.find_slot(slot);
  const bool declared =
      id && std::ranges::find(s.writes_of(task_), *id) != s.writes_of(task_).end();
  WEFT_CHECK(declared, "task '", name(), "' writes slot '", slot,
             "' without declaring it in writes()");
  return batch_->values_[*id];
}

}  // namespace weft::pipeline
