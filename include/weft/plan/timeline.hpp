// What the planner draws: one progress() of a schedule laid out in time, on host threads and on
// GPU streams, with the cross-thread waits and the rule that caused each. Produced by the
// simulator (simulate.hpp) or read from a real run's Chrome trace (trace_reader.hpp).
#pragma once

#include <string>
#include <vector>

namespace weft::plan {

// Why a task waited for a task on another host thread (or stream) inside one progress().
enum class WaitRule {
  kSameLookahead,  // ordering edge (slot read-after-write or depends_on), producer.la == consumer.la
  kSyncCpu,        // same_progress_sync edge, CPU side
  kSyncGpu,        // same_progress_sync edge, GPU side (the consumer's stream waits)
  kSyncBoth,       // same_progress_sync edge, both sides
  kTicket,         // collective ticket order: an earlier collective of this progress still enqueuing
  kStreamOrder,    // two threads feed one stream: run order kept on that stream
  kGpuWait,        // the body waits for a producer's GPU work (CostModel's waits_for_gpu_of)
};

const char* to_string(WaitRule rule) noexcept;

// True for the waits the schedule's lookahead rules cause (same-lookahead ordering, same-progress
// sync); false for the engine's own orderings (collective tickets, stream order) and a body's
// own wait for the GPU.
bool is_lookahead_rule(WaitRule rule) noexcept;

// The placement of one task: which stream it enqueues on, which thread runs it, how far ahead.
struct TaskPlacement {
  std::string task;
  std::string stream;        // after any move a config made
  std::string thread;        // the engine thread's name under the variant's thread map
  int lookahead = 0;
  bool collective = false;   // runs holding a collective ticket
};

// Times of the spans and waits below: microseconds from the start of the drawn progress().
struct HostSpan {
  std::string task;
  std::string thread;
  double start_us = 0;
  double end_us = 0;     // >= start_us
  long long batch = -1;  // the batch index the task worked on; -1 when unknown
  int ticket = -1;       // collective ticket, -1 for non-collective tasks
};

struct GpuSpan {
  std::string task;
  std::string stream;
  double start_us = 0;
  double end_us = 0;     // >= start_us
};

struct WaitEdge {
  std::string producer;
  std::string consumer;
  std::string producer_thread;  // the engine thread of each side (a GPU wait: the producer's
  std::string consumer_thread;  // stream, "stream NAME")
  WaitRule rule = WaitRule::kSameLookahead;
  double released_at_us = 0;  // when the producer side finished and the consumer could go on
  double waited_us = 0;       // how long the consumer's thread (or stream) sat idle for it
  // The edge behind the wait, e.g. "slot shuffled_batch, la 3 == 3, thread io -> data_dist,
  // stream memcpy -> data_dist" (empty where unknown, as for waits read from a trace).
  std::string cause;
};

// One progress() in steady state. Times are relative to the start of that progress().
struct Timeline {
  std::vector<std::string> threads;  // host threads, in drawing order
  std::vector<std::string> streams;  // GPU streams, in drawing order
  std::vector<HostSpan> host;        // every task run of the progress()
  std::vector<GpuSpan> gpu;          // every GPU segment of those runs
  std::vector<WaitEdge> waits;       // the cross-thread waits that held a consumer up
  double host_step_us = 0;  // makespan of the host threads in this progress()
  double step_us = 0;       // steady-state period of a training step (host or GPU bound)
};

// Per-thread accounting of one progress().
struct ThreadLoad {
  std::string thread;  // one of Timeline::threads
  double busy_us = 0;  // running task bodies
  double wait_us = 0;  // idle before one of its tasks could start (waiting for other threads)
};

std::vector<ThreadLoad> thread_loads(const Timeline& timeline);

}  // namespace weft::plan
