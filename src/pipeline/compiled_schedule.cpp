#include "weft/pipeline/compiled_schedule.hpp"

#include <algorithm>
#include <functional>
#include <queue>
#include <string>
#include <utility>

#include "weft/core/error.hpp"
#include "weft/pipeline/schedule_error.hpp"

namespace weft::pipeline {

std::string_view to_string(EdgeKind kind) noexcept {
  switch (kind) {
    case EdgeKind::kSlot: return "slot";
    case EdgeKind::kDependsOn: return "depends_on";
    case EdgeKind::kCrossIter: return "cross_iter_depends_on";
    case EdgeKind::kSameProgressSync: return "same_progress_sync";
  }
  return "?";
}

namespace {

constexpr TaskId kInputWriter = ~TaskId{0};
constexpr TaskId kNoWriter = kInputWriter - 1;

}  // namespace

// Throws ScheduleError about (task, field) unless `condition`; the message is built only then.
#define WEFT_RULE_CHECK(condition, task, field, ...)                         \
  do {                                                                       \
    if (!(condition)) [[unlikely]] {                                         \
      throw ScheduleError(task, field, ::weft::detail::concat(__VA_ARGS__)); \
    }                                                                        \
  } while (0)

CompiledSchedule::CompiledSchedule(Schedule schedule) : schedule_(std::move(schedule)) {
  tasks_ = schedule_.tasks();
  streams_ = schedule_.streams();
  WEFT_RULE_CHECK(!tasks_.empty(), std::nullopt, "tasks",
                  "schedule: no tasks (rule: a schedule has at least one task)");
  index_streams();
  check_task_fields();
  const std::vector<TaskId> writer = resolve_slots();
  for (TaskId c = 0; c < tasks_.size(); ++c) {
    const std::size_t first = edges_.size();
    add_edges_of(c, writer);
    set_progress_distances(c, first);
  }
  compute_run_order();
}

void CompiledSchedule::index_streams() {
  for (StreamId s = 0; s < streams_.size(); ++s) {
    WEFT_RULE_CHECK(!streams_[s].name.empty(), std::nullopt, "streams",
                    "schedule: a stream has an empty name");
    const bool fresh = stream_ids_.emplace(streams_[s].name, s).second;
    WEFT_RULE_CHECK(fresh, std::nullopt, "streams", "schedule: stream '", streams_[s].name,
                    "' declared twice (rule: unique stream names)");
  }
}

void CompiledSchedule::check_task_fields() {
  for (TaskId t = 0; t < tasks_.size(); ++t) {
    const Task& task = tasks_[t];
    WEFT_RULE_CHECK(!task.name().empty(), t, "name", "schedule: task #", t,
                    " has an empty name (rule: every task has a name)");
    const bool fresh = task_ids_.emplace(task.name(), t).second;
    WEFT_RULE_CHECK(fresh, t, "name", "schedule: task '", task.name(),
                    "' declared twice (rule: unique task names)");
    // Task::lookahead() refuses a lookahead outside [0, kMaxLookahead]; a Task always holds one
    // within it.
    const auto stream = stream_ids_.find(task.stream());
    WEFT_RULE_CHECK(stream != stream_ids_.end(), t, "stream", "schedule: task '", task.name(),
                    "' uses stream '", task.stream(),
                    "' which is not declared (rule: known stream; add_stream() it)");
    for (std::size_t i = 0; i < task.movable_to().size(); ++i) {
      const std::string& other = task.movable_to()[i];
      WEFT_RULE_CHECK(stream_ids_.contains(other), t, "movable_to", "schedule: task '",
                      task.name(), "' is movable to stream '", other,
                      "' which is not declared (rule: known stream; add_stream() it)");
      WEFT_RULE_CHECK(other != task.stream() &&
                          std::find(task.movable_to().begin(), task.movable_to().begin() + i,
                                    other) == task.movable_to().begin() + i,
                      t, "movable_to", "schedule: task '", task.name(), "' lists stream '", other,
                      "' in movable_to twice or as its own stream (rule: other streams, once each)");
    }
    for (const CollectiveOp& op : task.collectives()) {
      WEFT_RULE_CHECK(!op.kind.empty(), t, "collective", "schedule: task '", task.name(),
                      "': collective inventory: an op with no kind (rule: each op names its kind)");
      WEFT_RULE_CHECK(op.count >= 1, t, "collective", "schedule: task '", task.name(),
                      "': collective inventory: ", op.kind, " with count ", op.count,
                      " (rule: count >= 1 call per run)");
      WEFT_RULE_CHECK(stream_ids_.contains(op.stream), t, "collective", "schedule: task '",
                      task.name(), "': collective inventory: ", op.kind, " on stream '", op.stream,
                      "' which is not declared (rule: known stream; add_stream() it)");
    }
    stream_of_.push_back(stream->second);
    max_lookahead_ = std::max(max_lookahead_, task.lookahead());
  }
}

std::vector<TaskId> CompiledSchedule::resolve_slots() {
  // One writer per slot, the source's inputs count as a writer.
  std::vector<TaskId> writer;
  auto slot_of = [&](const std::string& name) {
    auto [it, fresh] = slot_ids_.emplace(name, static_cast<SlotId>(slot_names_.size()));
    if (fresh) {
      slot_names_.push_back(name);
      writer.push_back(kNoWriter);
    }
    return it->second;
  };
  for (const std::string& input : schedule_.inputs()) {
    WEFT_RULE_CHECK(!input.empty(), std::nullopt, "inputs",
                    "schedule: an input slot has an empty name");
    const SlotId s = slot_of(input);
    WEFT_RULE_CHECK(writer[s] == kNoWriter, std::nullopt, "inputs", "schedule: input slot '", input,
                    "' declared twice (rule: one writer per slot)");
    writer[s] = kInputWriter;
  }
  const auto num = static_cast<TaskId>(tasks_.size());
  writes_of_.resize(num);
  reads_of_.resize(num);
  for (TaskId t = 0; t < num; ++t) {
    for (const std::string& name : tasks_[t].writes()) {
      WEFT_RULE_CHECK(!name.empty(), t, "writes", "schedule: task '", tasks_[t].name(),
                      "' writes an empty slot name");
      const SlotId s = slot_of(name);
      WEFT_RULE_CHECK(writer[s] == kNoWriter, t, "writes", "schedule: slot '", name,
                      "' is written by task '", tasks_[t].name(), "' and by ",
                      writer[s] == kInputWriter ? std::string("the source (an input)")
                                                : "task '" + tasks_[writer[s]].name() + "'",
                      " (rule: one writer per slot)");
      writer[s] = t;
      writes_of_[t].push_back(s);
    }
  }
  for (TaskId t = 0; t < num; ++t) {
    for (const std::string& name : tasks_[t].reads()) {
      const auto it = slot_ids_.find(name);
      WEFT_RULE_CHECK(it != slot_ids_.end(), t, "reads", "schedule: task '", tasks_[t].name(),
                      "' reads slot '", name,
                      "' which no task writes and is no input (rule: every read has a writer)");
      WEFT_RULE_CHECK(writer[it->second] != t, t, "reads", "schedule: task '", tasks_[t].name(),
                      "' reads slot '", name, "' which it writes itself (rule: no self edge)");
      reads_of_[t].push_back(it->second);
    }
  }
  return writer;
}

void CompiledSchedule::add_edges_of(TaskId c, const std::vector<TaskId>& writer) {
  const Task& task = tasks_[c];
  const std::size_t first = edges_.size();
  auto producer_id = [&](const std::string& name, EdgeKind kind) {
    const auto field = std::string(to_string(kind));
    const auto it = task_ids_.find(name);
    WEFT_RULE_CHECK(it != task_ids_.end(), c, field, "schedule: task '", task.name(), "' has a ",
                    field, " edge to unknown task '", name, "' (rule: every edge names a task)");
    WEFT_RULE_CHECK(it->second != c || kind == EdgeKind::kCrossIter, c, field, "schedule: task '",
                    task.name(), "' has a ", field, " edge to itself (rule: no self edge)");
    return it->second;
  };
  // A slot edge is about the task's reads, every other kind about the field of its name.
  auto field_of = [](EdgeKind kind) {
    return kind == EdgeKind::kSlot ? std::string("reads") : std::string(to_string(kind));
  };
  auto add_edge = [&](TaskId producer, EdgeKind kind) -> Edge& {
    for (std::size_t e = first; e < edges_.size(); ++e) {
      Edge& existing = edges_[e];
      if (existing.producer != producer) continue;
      if (existing.kind == EdgeKind::kSlot && kind == EdgeKind::kSlot) return existing;
      WEFT_RULE_CHECK(false, c, field_of(kind), "schedule: task '", task.name(),
                      "' names producer '", tasks_[producer].name(), "' in a ", to_string(kind),
                      " edge and in a ", to_string(existing.kind),
                      " edge (rule: a producer appears in at most one edge kind of a consumer)");
    }
    Edge& edge = edges_.emplace_back();
    edge.producer = producer;
    edge.consumer = c;
    edge.kind = kind;
    return edge;
  };
  for (SlotId s : reads_of_[c]) {
    if (writer[s] != kInputWriter) add_edge(writer[s], EdgeKind::kSlot).slots.push_back(s);
  }
  for (const std::string& name : task.depends_on()) {
    add_edge(producer_id(name, EdgeKind::kDependsOn), EdgeKind::kDependsOn);
  }
  for (const CrossIterEdge& x : task.cross_iter_depends_on()) {
    add_edge(producer_id(x.producer, EdgeKind::kCrossIter), EdgeKind::kCrossIter).offset = x.offset;
  }
  for (const SyncEdge& x : task.same_progress_sync()) {
    add_edge(producer_id(x.producer, EdgeKind::kSameProgressSync), EdgeKind::kSameProgressSync)
        .side = x.side;
  }
}

void CompiledSchedule::set_progress_distances(TaskId c, std::size_t first) {
  const Task& task = tasks_[c];
  for (std::size_t e = first; e < edges_.size(); ++e) {
    Edge& edge = edges_[e];
    const Task& producer = tasks_[edge.producer];
    const int la_p = producer.lookahead();
    const int la_c = task.lookahead();
    if (!edge.is_ordering()) {
      edge.progress_distance = 0;
      edge.batch_offset = la_p - la_c;
      continue;
    }
    const std::string field =
        edge.kind == EdgeKind::kSlot ? std::string("reads") : std::string(to_string(edge.kind));
    edge.batch_offset = edge.offset;
    edge.progress_distance = la_p - la_c - edge.offset;
    WEFT_RULE_CHECK(edge.progress_distance >= 0, c, field, "schedule: task '", task.name(),
                    "' (lookahead ", la_c, ") has a ", to_string(edge.kind), " edge from '",
                    producer.name(), "' (lookahead ", la_p,
                    edge.kind == EdgeKind::kCrossIter ? ", offset " : "",
                    edge.kind == EdgeKind::kCrossIter ? std::to_string(edge.offset) : "",
                    ") that would need the producer to run later than the consumer (rule: "
                    "la(producer) - la(consumer) - offset >= 0)");
    WEFT_RULE_CHECK(
        edge.progress_distance <= max_lookahead_ || stream_of_[edge.producer] == stream_of_[c], c,
        field, "schedule: task '", task.name(), "' waits on the event of '", producer.name(),
        "' from ", edge.progress_distance, " progresses back, but the ring keeps only ",
        max_lookahead_ + 1,
        " (rule: a cross-stream ordering edge reaches back at most max lookahead "
        "progresses; put both tasks on one stream or raise a lookahead)");
  }
}

void CompiledSchedule::compute_run_order() {
  // Kahn over the within-progress edges, declaration order breaking ties.
  const auto num = static_cast<TaskId>(tasks_.size());
  std::vector<std::vector<TaskId>> successors(num);
  std::vector<std::uint32_t> num_preds(num, 0);
  for (const Edge& e : edges_) {
    if (!e.within_progress()) continue;
    successors[e.producer].push_back(e.consumer);
    ++num_preds[e.consumer];
  }
  std::priority_queue<TaskId, std::vector<TaskId>, std::greater<>> ready;
  for (TaskId t = 0; t < num; ++t) {
    if (num_preds[t] == 0) ready.push(t);
  }
  while (!ready.empty()) {
    const TaskId t = ready.top();
    ready.pop();
    run_order_.push_back(t);
    for (TaskId s : successors[t]) {
      if (--num_preds[s] == 0) ready.push(s);
    }
  }
  if (run_order_.size() != num) {
    std::string names;
    for (TaskId t = 0; t < num; ++t) {
      if (num_preds[t] == 0) continue;
      names += names.empty() ? "" : ", ";
      names += "'" + tasks_[t].name() + "'";
    }
    throw ScheduleError(std::nullopt, "tasks",
                        detail::concat("schedule: cycle in the within-progress graph among tasks ",
                                       names, " (rule: same-progress edges form no cycle)"));
  }
  run_position_.resize(num);
  for (std::uint32_t i = 0; i < num; ++i) run_position_[run_order_[i]] = i;
  for (TaskId t : run_order_) {
    if (tasks_[t].is_collective()) collective_order_.push_back(t);
  }
}

#undef WEFT_RULE_CHECK

std::optional<TaskId> CompiledSchedule::find_task(std::string_view name) const {
  const auto it = task_ids_.find(name);
  if (it == task_ids_.end()) return std::nullopt;
  return it->second;
}

TaskId CompiledSchedule::task_id(std::string_view name) const {
  const auto id = find_task(name);
  WEFT_CHECK(id.has_value(), "schedule has no task '", name, "'");
  return *id;
}

std::optional<StreamId> CompiledSchedule::find_stream(std::string_view name) const {
  const auto it = stream_ids_.find(name);
  if (it == stream_ids_.end()) return std::nullopt;
  return it->second;
}

std::optional<SlotId> CompiledSchedule::find_slot(std::string_view name) const {
  const auto it = slot_ids_.find(name);
  if (it == slot_ids_.end()) return std::nullopt;
  return it->second;
}

}  // namespace weft::pipeline
