// weft::pipeline::wait_edges: the wait rules, one implementation for the engine and the planner.
//
// For a schedule and a thread assignment, every edge is classified by the rule that applies:
//  - kOrderingSameProgress: an ordering edge (slot, depends_on, cross_iter) whose producer runs in
//    the same progress (progress distance 0; for slot and depends_on edges exactly when
//    la(producer) == la(consumer)). The consumer's thread waits if the producer is on another
//    thread.
//  - kOrderingEarlierProgress: an ordering edge whose producer ran in an earlier progress; the
//    ring has satisfied it on the host, nobody's thread waits.
//  - kSameProgressSync: a same_progress_sync edge; always a within-progress wait, whatever the
//    lookaheads (side kGpu: the engine skips the host wait on a backend that waits for future
//    records, see SyncSide).
//  - kStreamOrder: two tasks on one stream, consecutive in run order, fed by different threads:
//    the later one waits on the host so the stream sees them in run order.
// Stream waits (the consumer's stream waits on the producer's event for the producer's batch)
// apply to ordering edges between different streams and to same_progress_sync edges of side kGpu
// or kBoth between different streams.
//
//   for (const WaitEdge& e : cross_thread_waits(schedule, ThreadMap::preset("default_d6")...))
//     std::puts(describe(e, schedule, assignment).c_str());
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/thread_map.hpp"

namespace weft::pipeline {

enum class WaitRule : std::uint8_t {
  kOrderingSameProgress,
  kOrderingEarlierProgress,
  kSameProgressSync,
  kStreamOrder,
};
std::string_view to_string(WaitRule rule) noexcept;

struct WaitEdge {
  TaskId producer = 0;
  TaskId consumer = 0;
  WaitRule rule = WaitRule::kOrderingSameProgress;
  // Index into schedule.edges() of the edge this came from; -1 for kStreamOrder.
  int edge_index = -1;
  bool host_wait = false;    // the consumer's thread blocks in this progress until the producer ran
  bool stream_wait = false;  // the consumer's stream waits on the producer's event
  int progress_distance = 0;  // >= 0: how many progresses earlier the producer ran (Edge's)
  int batch_offset = 0;       // producer's batch minus consumer's batch
};

// Every edge of the schedule, classified, then the kStreamOrder edges; in consumer run order.
std::vector<WaitEdge> wait_edges(const CompiledSchedule& schedule,
                                 const ThreadAssignment& threads);
// The subset with host_wait: every cross-thread wait inside one progress, with its rule.
std::vector<WaitEdge> cross_thread_waits(const CompiledSchedule& schedule,
                                         const ThreadAssignment& threads);
// One line, e.g. "finish_shuffle -> start_input_dist [ordering_same_progress] slot
// shuffled_batch, la 3 == 3, thread io -> data_dist, stream memcpy -> data_dist".
std::string describe(const WaitEdge& edge, const CompiledSchedule& schedule,
                     const ThreadAssignment& threads);

}  // namespace weft::pipeline
