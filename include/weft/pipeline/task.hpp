// weft::pipeline::Task: one unit of a training step, described by a builder.
//
// A task is bound to a stream (where its GPU work goes; movable_to lists other streams it may run
// on, which a ScheduleConfig may move it to and the planner may search), to a lookahead la >= 0 (it works on the
// batch la steps ahead of the one la = 0 tasks work on) and to its edges:
//  - reads/writes: named slots of the batch it works on (one writer per slot; a read makes the
//    slot's writer a producer of this task for the same batch);
//  - depends_on: a producer for the same batch without a slot in between;
//  - cross_iter_depends_on: a producer working on an older batch (offset < 0);
//  - same_progress_sync: a producer that must have run in this very progress() call, whatever its
//    lookahead, on the host (kCpu), on the GPU (kGpu) or both.
// A producer may appear in at most one edge kind of a consumer. The body runs once per progress
// in which the task is active; the optional init runs once, on the task's engine thread, when the
// engine is constructed.
//
//   Task("h2d").stream("memcpy").lookahead(2).reads("batch_cpu").writes("batch_gpu", "ctx")
//       .body([](TaskContext& c) { c.set("batch_gpu", copy(c.get<HostBatch>("batch_cpu"))); });
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace weft::pipeline {

class TaskContext;

// Runs on an engine thread; throwing aborts the progress() call (see Engine).
using TaskBody = std::function<void(TaskContext&)>;

// Which side of a same_progress_sync consumer waits for the producer of this progress.
//  kCpu:  the consumer's body starts after the producer's body returned; no stream wait.
//  kGpu:  the consumer's stream waits for the producer's stream work of this progress; the bodies
//         are not ordered. On a backend whose streams can wait for a record yet to come
//         (Backend::waits_for_future_records(), the host backend) the consumer's thread does not
//         wait at all; elsewhere (CUDA: a stream waits on an event's latest record) it waits
//         until the producer's event is recorded, at the end of the producer's body.
//  kBoth: both: the bodies are ordered and the stream waits.
enum class SyncSide : std::uint8_t { kCpu, kGpu, kBoth };

std::string_view to_string(SyncSide side) noexcept;
// Accepts "cpu", "gpu", "both"; throws weft::Error otherwise.
SyncSide parse_sync_side(std::string_view text);

// The largest lookahead a task may have, wherever it is set (Task, ScheduleConfig, Python): the
// engine keeps max lookahead + 1 batches in flight and its prefill runs max lookahead internal
// iterations, each looking at every lookahead up to the largest; more in flight than this is a
// mistake, not a tuning, and this bound keeps the prefill within milliseconds.
inline constexpr int kMaxLookahead = 1000;

// One collective a task enqueues per run (the per-task inventory the planner and reports read).
// `stream` names the stream the collective's kernel lands on, which may be a comm stream used
// inside the task rather than the task's own stream; it must be a stream of the schedule.
struct CollectiveOp {
  std::string kind;             // e.g. "AllGather", "SendRecv", "AllReduce"; non-empty
  std::string stream;           // a stream of the schedule (see above)
  std::size_t num_bytes = 0;    // payload per rank and call, an estimate where it varies
  int count = 1;                // calls per run of the task, >= 1

  bool operator==(const CollectiveOp&) const = default;
};

struct CrossIterEdge {
  std::string producer;  // another task's name
  int offset = -1;  // the producer's batch is the consumer's batch + offset; offset < 0
  bool operator==(const CrossIterEdge&) const = default;
};

struct SyncEdge {
  std::string producer;             // another task's name
  SyncSide side = SyncSide::kBoth;  // where the producer must have run in this progress()
  bool operator==(const SyncEdge&) const = default;
};

template <typename T>
concept NameLike = std::convertible_to<const T&, std::string_view>;

class Task {
 public:
  explicit Task(std::string name);

  Task& stream(std::string name);
  // Declares that the task's work may go on these streams instead of its own (its body enqueues
  // on the stream it is given, not on a stream named in its code): a ScheduleConfig may move it
  // there, and `weft plan --suggest` searches them. CompiledSchedule checks that each is a
  // declared stream, listed once and not the task's own.
  Task& movable_to(std::vector<std::string> streams);
  // Throws weft::Error unless 0 <= la <= kMaxLookahead: a Task never holds another lookahead,
  // so nothing downstream (CompiledSchedule, the engine, the planner) checks it again.
  Task& lookahead(int la);
  template <NameLike... Slots>
    requires(sizeof...(Slots) > 0)
  Task& reads(const Slots&... slots) {
    (reads_.emplace_back(std::string_view(slots)), ...);
    return *this;
  }
  template <NameLike... Slots>
    requires(sizeof...(Slots) > 0)
  Task& writes(const Slots&... slots) {
    (writes_.emplace_back(std::string_view(slots)), ...);
    return *this;
  }
  template <NameLike... Producers>
    requires(sizeof...(Producers) > 0)
  Task& depends_on(const Producers&... producers) {
    (depends_on_.emplace_back(std::string_view(producers)), ...);
    return *this;
  }
  // Throws weft::Error unless offset < 0 (the same batch is depends_on): the one place the rule
  // is checked, so CompiledSchedule and the bindings rely on it.
  Task& cross_iter_depends_on(std::string producer, int offset);
  Task& same_progress_sync(std::string producer, SyncSide side = SyncSide::kBoth);
  // Marks the task as enqueuing collectives: it runs holding this progress's ticket for it.
  Task& collective(std::vector<CollectiveOp> inventory = {});
  Task& body(TaskBody body);
  Task& init(TaskBody init);

  const std::string& name() const noexcept { return name_; }
  const std::string& stream() const noexcept { return stream_; }
  const std::vector<std::string>& movable_to() const noexcept { return movable_to_; }
  // True for the task's own stream and the streams it is movable_to.
  bool may_run_on(std::string_view stream) const noexcept;
  int lookahead() const noexcept { return lookahead_; }
  const std::vector<std::string>& reads() const noexcept { return reads_; }
  const std::vector<std::string>& writes() const noexcept { return writes_; }
  const std::vector<std::string>& depends_on() const noexcept { return depends_on_; }
  const std::vector<CrossIterEdge>& cross_iter_depends_on() const noexcept { return cross_iter_; }
  const std::vector<SyncEdge>& same_progress_sync() const noexcept { return sync_; }
  bool is_collective() const noexcept { return collective_; }
  const std::vector<CollectiveOp>& collectives() const noexcept { return inventory_; }
  const TaskBody& body() const noexcept { return body_; }
  const TaskBody& init() const noexcept { return init_; }

  // Adds or replaces the same_progress_sync edge from `producer` (used by ScheduleConfig).
  void set_same_progress_sync(std::string producer, SyncSide side);
  // Moves the task to a stream it may_run_on (used by ScheduleConfig); the stream it leaves takes
  // the new one's place in movable_to, so the streams it may run on stay the same. Throws
  // weft::Error naming the task, the field "movable_to" and the streams it may run on otherwise.
  void move_to_stream(const std::string& stream);

 private:
  std::string name_;
  std::string stream_ = "default";
  std::vector<std::string> movable_to_;
  int lookahead_ = 0;
  std::vector<std::string> reads_;
  std::vector<std::string> writes_;
  std::vector<std::string> depends_on_;
  std::vector<CrossIterEdge> cross_iter_;
  std::vector<SyncEdge> sync_;
  bool collective_ = false;
  std::vector<CollectiveOp> inventory_;
  TaskBody body_;
  TaskBody init_;
};

}  // namespace weft::pipeline
