#include "weft/pipeline/wait_edges.hpp"

#include <algorithm>
#include <string>

namespace weft::pipeline {

std::string_view to_string(WaitRule rule) noexcept {
  switch (rule) {
    case WaitRule::kOrderingSameProgress: return "ordering_same_progress";
    case WaitRule::kOrderingEarlierProgress: return "ordering_earlier_progress";
    case WaitRule::kSameProgressSync: return "same_progress_sync";
    case WaitRule::kStreamOrder: return "stream_order";
  }
  return "?";
}

std::vector<WaitEdge> wait_edges(const CompiledSchedule& schedule,
                                 const ThreadAssignment& threads) {
  std::vector<WaitEdge> out;
  const auto edges = schedule.edges();
  auto cross_thread = [&](TaskId a, TaskId b) {
    return !threads.sequential && threads.thread_of_task[a] != threads.thread_of_task[b];
  };
  for (std::size_t i = 0; i < edges.size(); ++i) {
    const Edge& e = edges[i];
    WaitEdge w;
    w.producer = e.producer;
    w.consumer = e.consumer;
    w.edge_index = static_cast<int>(i);
    w.progress_distance = e.progress_distance;
    w.batch_offset = e.batch_offset;
    const bool cross_stream = schedule.stream_of(e.producer) != schedule.stream_of(e.consumer);
    if (e.is_ordering()) {
      w.rule = e.within_progress() ? WaitRule::kOrderingSameProgress
                                   : WaitRule::kOrderingEarlierProgress;
      w.stream_wait = cross_stream;
    } else {
      w.rule = WaitRule::kSameProgressSync;
      w.stream_wait = cross_stream && e.side != SyncSide::kCpu;
    }
    w.host_wait = e.within_progress() && cross_thread(e.producer, e.consumer);
    out.push_back(w);
  }
  // One stream fed by several threads: consecutive tasks in run order, on different threads.
  std::vector<TaskId> last_on_stream(schedule.num_streams(), ~TaskId{0});
  for (TaskId t : schedule.run_order()) {
    const StreamId s = schedule.stream_of(t);
    const TaskId previous = last_on_stream[s];
    last_on_stream[s] = t;
    if (previous == ~TaskId{0} || !cross_thread(previous, t)) continue;
    WaitEdge w;
    w.producer = previous;
    w.consumer = t;
    w.rule = WaitRule::kStreamOrder;
    w.host_wait = true;
    w.batch_offset = schedule.task(previous).lookahead() - schedule.task(t).lookahead();
    out.push_back(w);
  }
  std::stable_sort(out.begin(), out.end(), [&](const WaitEdge& a, const WaitEdge& b) {
    return schedule.run_position(a.consumer) < schedule.run_position(b.consumer);
  });
  return out;
}

std::vector<WaitEdge> cross_thread_waits(const CompiledSchedule& schedule,
                                         const ThreadAssignment& threads) {
  std::vector<WaitEdge> all = wait_edges(schedule, threads);
  std::erase_if(all, [](const WaitEdge& e) { return !e.host_wait; });
  return all;
}

std::string describe(const WaitEdge& w, const CompiledSchedule& schedule,
                     const ThreadAssignment& threads) {
  const Task& p = schedule.task(w.producer);
  const Task& c = schedule.task(w.consumer);
  std::string out = p.name() + " -> " + c.name() + " [" + std::string(to_string(w.rule)) + "]";
  if (w.edge_index >= 0) {
    const Edge& e = schedule.edges()[static_cast<std::size_t>(w.edge_index)];
    out += " ";
    out += to_string(e.kind);
    for (std::size_t i = 0; i < e.slots.size(); ++i) {
      out += (i == 0 ? " " : ",") + schedule.slot_name(e.slots[i]);
    }
    if (e.kind == EdgeKind::kCrossIter) out += " offset " + std::to_string(e.offset);
    if (e.kind == EdgeKind::kSameProgressSync) out += " side " + std::string(to_string(e.side));
  }
  out += ", la " + std::to_string(p.lookahead()) + (p.lookahead() == c.lookahead() ? " == " : " vs ") +
         std::to_string(c.lookahead());
  out += ", thread " + threads.thread_names[threads.thread_of_task[w.producer]] + " -> " +
         threads.thread_names[threads.thread_of_task[w.consumer]];
  out += ", stream " + p.stream() + " -> " + c.stream();
  if (w.host_wait) out += ", host wait";
  if (w.stream_wait) out += ", stream wait";
  return out;
}

}  // namespace weft::pipeline
