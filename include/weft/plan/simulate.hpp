// weft::plan::simulate: a discrete-event simulation of steady-state progress() calls of a
// schedule under a thread map and a cost model, following the engine's own wait rules.
//
// Model. Every progress() runs every task once (steady state). Each engine thread runs its tasks
// in run order; a task starts when its thread is free and
//  - every host-wait edge of wait_edges() (same-progress ordering across threads, same-progress
//    syncs, stream order) has its producer's body finished in this progress;
//  - if it is a collective, the previous collective in ticket order has finished (tickets are
//    held while a task enqueues).
// progress() returns when every thread is done; the next one starts then (the legacy map runs
// everything on one thread). A task's GPU segments start after its body ended, when their stream
// is free and every stream-wait producer's GPU work (of the producer's batch) has ended; with an
// overlap slowdown (SimulationOptions), one stream's work runs slower while another's runs.
// A task whose cost has waits_for_gpu_of starts its host work no earlier than the end of that
// producer's GPU work for its batch, holding its thread meanwhile (not the GIL). Such a wait can
// depend on GPU work its own progress() enqueues: each progress() with one is placed again with
// the waits' ends found until they settle (the GPU model taken back each time). A wait that could
// never end (endless_gpu_wait) is refused.
// The step time is the steady-state period of GPU completion (or of the host, without GPU work).
// The drawn timeline is the second-to-last progress(): its host spans, and the GPU activity of any
// progress during one step period from its start.
//
// A finite source (SimulationOptions::num_batches > 0) is simulated as the engine runs one: its
// internal iterations 0 .. M + L - 1 (M batches, L the largest lookahead) with the prefill and the
// drain, a task of lookahead k active at iteration i iff it works on a batch there
// (pipeline::StepRule: batch i - (L - k) in [0, M)); an inactive task takes no time and waits only
// for its stream-order producers, as the engine's skip does, and collective tickets go to the
// active ones in collective order. The step is then the whole source (e.g. a training step of M
// micro-batches): from the first iteration's start to the end of its last GPU work, which the end
// of data waits for; the timeline draws every iteration.
//
//   auto compiled = pipeline::CompiledSchedule(hstu::hstu_schedule());
//   auto threads = pipeline::ThreadMap::preset("full_split").assign(compiled);
//   Timeline t = simulate(compiled, threads, CostModel::hstu_defaults());
#pragma once

#include <string>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/plan/cost_model.hpp"
#include "weft/plan/timeline.hpp"

namespace weft::plan {

struct SimulationOptions {
  int num_progress = 12;  // progress() calls simulated; the drawn one is the second to last
  // > 0: one finite source of this many batches (above), and num_progress is not used.
  int num_batches = 0;
  // The host may start progress p only when all GPU work of progress p - max_host_runahead has
  // finished (a training loop reads some result of an earlier step, e.g. its loss). Not applied
  // within a finite source (num_batches > 0): nothing reads a result between its iterations.
  int max_host_runahead = 2;
  // A thread that blocked on a task of another thread (a host wait or a collective ticket)
  // starts its task this long after the release: the cost of waking a sleeping thread. 0 (the
  // default) models an instant wake-up; in [0, CostModel::kMaxCostUs].
  double thread_wake_up_us = 0;
  // Tasks whose bodies hold one lock shared by every thread (the GIL of Python bodies) for their
  // whole host time: such a body starts only when the lock is free, and the lock goes to the
  // task that can start first. Empty (the default): no shared lock. Waiting for it is not drawn
  // as a wait.
  std::vector<std::string> gil_tasks;
  // GPU work on slowed_stream runs overlap_slowdown times slower while work of any other stream
  // runs beside it (a concurrent kernel holds SMs the slowed stream's kernels would use), at its
  // cost alone. 1 (the default): streams never slow each other. In [1, 100]; a factor other
  // than 1 needs slowed_stream.
  std::string slowed_stream;
  double overlap_slowdown = 1;
};

Timeline simulate(const pipeline::CompiledSchedule& schedule,
                  const pipeline::ThreadAssignment& threads, const CostModel& costs,
                  const SimulationOptions& options = {});

// The first wait of `costs` (waits_for_gpu_of) that could never end under this schedule and
// thread map, described, or empty where there is none: a producer of lower lookahead than the
// waiting task (it works on the task's batch later), or one of the same lookahead whose body can
// run only after the waiting body in one progress() (after it on its thread, or behind it
// through host waits or collective tickets; every task active, as in the steady state). simulate
// throws weft::Error with this text; suggest refuses such candidates.
std::string endless_gpu_wait(const pipeline::CompiledSchedule& schedule,
                             const pipeline::ThreadAssignment& threads, const CostModel& costs);

// Where each task runs, in run order (for the report's topology).
std::vector<TaskPlacement> placement(const pipeline::CompiledSchedule& schedule,
                                     const pipeline::ThreadAssignment& threads);

}  // namespace weft::plan
