// weft::pipeline::CompiledSchedule: a validated Schedule with everything the engine, the wait
// rules and the planner derive from it, computed once.
//
// Validation rules (each error is a ScheduleError, schedule_error.hpp: its message names the task
// and the rule broken, its task() and field() say the same as data):
//   unique non-empty task names; the task's stream and its movable_to streams are declared
//   (movable_to: other streams, once each); one writer per
//   slot (a task or the source's inputs); every read has a writer and no task reads what it
//   writes; every edge names another task; a producer appears in at most one edge kind of a
//   consumer; an ordering edge never points forward in time (the producer must run no later than
//   its consumer, i.e. progress distance >= 0); a cross-stream ordering edge reaches back at most
//   max_lookahead progresses (its event must still be in the ring); no cycle in the
//   within-progress graph. (cross_iter offsets < 0 is the Task's own rule, task.hpp.)
//
// Progress distance of an ordering edge (slot, depends_on, cross_iter with offset o, 0 otherwise):
//   d = la(producer) - la(consumer) - o.
// d = 0: the producer runs in the same progress as its consumer (a within-progress edge);
// d > 0: it ran d progresses earlier, so the ring has satisfied it on the host.
// same_progress_sync edges are always within-progress.
//
// Run order = topological order of the within-progress graph, declaration order breaking ties.
// in_flight = max_lookahead + 1 ring slots.
//
// Thread safety: immutable once constructed (every public member function is const), so the
// engine's threads and the planner read one CompiledSchedule concurrently without locks.
//
//   CompiledSchedule c(hstu::hstu_schedule({.cascade = hstu::HstuCascade::kD3}));
//   for (auto id : c.run_order()) std::puts(c.task(id).name().c_str());
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/schedule_error.hpp"
#include "weft/pipeline/task.hpp"

namespace weft::pipeline {

using TaskId = std::uint32_t;
using StreamId = std::uint32_t;
using SlotId = std::uint32_t;

enum class EdgeKind : std::uint8_t { kSlot, kDependsOn, kCrossIter, kSameProgressSync };
std::string_view to_string(EdgeKind kind) noexcept;

// One resolved edge producer -> consumer. Several slots read from one producer form one edge.
struct Edge {
  TaskId producer = 0;
  TaskId consumer = 0;              // != producer
  EdgeKind kind = EdgeKind::kSlot;
  std::vector<SlotId> slots;        // kSlot only: every slot the consumer reads from producer
  int offset = 0;                   // kCrossIter only (< 0)
  SyncSide side = SyncSide::kBoth;  // kSameProgressSync only
  int progress_distance = 0;        // 0 = same progress; see the file comment
  // Producer's batch minus consumer's batch (offset for ordering edges, la_p - la_c for syncs).
  int batch_offset = 0;

  bool is_ordering() const noexcept { return kind != EdgeKind::kSameProgressSync; }
  bool within_progress() const noexcept { return progress_distance == 0; }
};

class CompiledSchedule {
 public:
  // Validates; throws weft::Error on the first rule broken.
  explicit CompiledSchedule(Schedule schedule);

  std::size_t num_tasks() const noexcept { return tasks_.size(); }
  const Task& task(TaskId id) const { return tasks_.at(id); }
  const std::vector<Task>& tasks() const noexcept { return tasks_; }
  std::optional<TaskId> find_task(std::string_view name) const;
  TaskId task_id(std::string_view name) const;  // throws weft::Error for an unknown name

  std::span<const TaskId> run_order() const noexcept { return run_order_; }
  // Position of a task in run order.
  std::uint32_t run_position(TaskId id) const { return run_position_.at(id); }
  // Collective tasks in run order: the order tickets are handed out in every progress.
  std::span<const TaskId> collective_order() const noexcept { return collective_order_; }

  int max_lookahead() const noexcept { return max_lookahead_; }
  int in_flight() const noexcept { return max_lookahead_ + 1; }

  std::size_t num_streams() const noexcept { return streams_.size(); }
  const StreamSpec& stream(StreamId id) const { return streams_.at(id); }
  std::optional<StreamId> find_stream(std::string_view name) const;
  StreamId stream_of(TaskId id) const { return stream_of_.at(id); }

  std::size_t num_slots() const noexcept { return slot_names_.size(); }
  const std::string& slot_name(SlotId id) const { return slot_names_.at(id); }
  std::optional<SlotId> find_slot(std::string_view name) const;
  std::span<const SlotId> reads_of(TaskId id) const { return reads_of_.at(id); }
  std::span<const SlotId> writes_of(TaskId id) const { return writes_of_.at(id); }

  // Every edge, grouped by consumer in declaration order of the consumer's edges.
  std::span<const Edge> edges() const noexcept { return edges_; }

  // The schedule as given (for re-serialisation and for the planner's descriptions).
  const Schedule& source() const noexcept { return schedule_; }

 private:
  // The constructor's steps, in order; each throws ScheduleError for the rules it checks.
  void index_streams();
  void check_task_fields();             // names, streams, collective inventories
  std::vector<TaskId> resolve_slots();  // returns the writer of each slot
  void add_edges_of(TaskId consumer, const std::vector<TaskId>& writer);
  void set_progress_distances(TaskId consumer, std::size_t first_edge);
  void compute_run_order();

  Schedule schedule_;
  std::vector<Task> tasks_;
  std::map<std::string, TaskId, std::less<>> task_ids_;
  std::vector<StreamSpec> streams_;
  std::map<std::string, StreamId, std::less<>> stream_ids_;
  std::vector<StreamId> stream_of_;
  std::vector<std::string> slot_names_;
  std::map<std::string, SlotId, std::less<>> slot_ids_;
  std::vector<std::vector<SlotId>> reads_of_;
  std::vector<std::vector<SlotId>> writes_of_;
  std::vector<Edge> edges_;
  std::vector<TaskId> run_order_;
  std::vector<std::uint32_t> run_position_;
  std::vector<TaskId> collective_order_;
  int max_lookahead_ = 0;
};

}  // namespace weft::pipeline
