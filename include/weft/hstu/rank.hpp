// weft::hstu::HstuRank: one rank's HSTU training step as the 14 task bodies of
// weft::hstu::hstu_schedule, on one GPU, over one NCCL communicator it is given (and, by
// default, three it splits from it: HstuConfig::communicator_per_role) (docs/hstu.md).
//
//   HstuRank rank(config, comm, device, num_steps);
//   for (const auto& variant : hstu::hstu_variants()) {
//     rank.reset();                                  // same initial parameters every run
//     pipeline::Engine engine(rank.schedule(variant.cascade),
//                             pipeline::ThreadMap::preset(variant.thread_map),
//                             pipeline::CudaBackend(device));
//     engine.set_source(rank.source());
//     while (engine.progress()) {}
//     engine.synchronize();
//     auto losses = rank.losses();
//   }
//
// Contracts:
//  - every rank of the communicator runs the same schedule over the same number of steps; the
//    engine's tickets give every rank the same collective order whatever the thread map;
//  - the computation does not depend on the thread map or the cascade: the embedding-cache
//    prefetch of batch i always reads the table as updated by batches <= i - 2 (it runs one step
//    ahead, before batch i - 1's update, which waits for it), and everything else is ordered by
//    the schedule's edges, so every variant gives bit-identical losses and parameters;
//  - device buffers of batch i are reused by batch i + num_buffer_sets only after batch i's last
//    task (watchdog) finished on the GPU; num_buffer_sets >= the schedule's in_flight (7 are made
//    with the rank, and h2d's init adds what a deeper schedule needs when its engine is built,
//    e.g. after a ScheduleConfig raised a lookahead);
//  - collectives are NCCL calls on the rank's communicators: grouped send/recv for the
//    all-to-alls, grouped broadcasts for the AllGatherV. Each body records its calls through
//    TaskContext::record_collective, so Engine::collective_inventory() gives the measured
//    inventory (kind, stream, bytes per call, calls per step).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weft/cuda/nccl_include.hpp"
#include "weft/hstu/config.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/engine.hpp"

namespace weft::hstu {

namespace detail {
struct HstuRankState;  // src/hstu/rank_state.hpp
}  // namespace detail

// The default stream over one steady-state step (from CUDA events recorded inside the bodies).
struct StepTiming {
  double step_us = 0;          // previous step's end to this step's end on the default stream
  double idle_us = 0;          // gaps between default-stream tasks (waiting on inputs or host)
  // The gap before each default-stream task (HstuRank::default_stream_tasks() order; the first
  // is measured from the previous step's last task): idle_us is their sum.
  std::vector<double> idle_before_us;
  double join_stall_us = 0;    // cod_join_us + bwd_join_us
  double cod_join_us = 0;      // compute_output_dist waiting for the forward embedding a2a
  double bwd_join_us = 0;      // optimizer_step waiting for backward's gradient a2a
  double comm_on_default_us = 0;  // global-token and gradient AllReduces (on the default stream)
  double busy_fraction() const { return step_us > 0 ? 1.0 - (idle_us + join_stall_us) / step_us : 0; }
  double exposed_comm_us() const { return join_stall_us + comm_on_default_us; }
};

class HstuRank {
 public:
  // `num_steps`: batches per run (the data is generated once for them). `device` must be the
  // communicator's device.
  HstuRank(const HstuConfig& config, ncclComm_t comm, int device, std::int64_t num_steps);
  ~HstuRank();
  HstuRank(const HstuRank&) = delete;
  HstuRank& operator=(const HstuRank&) = delete;

  // Back to the initial parameters and empty records; call before each run.
  void reset();
  // hstu::hstu_schedule with this rank's bodies (and prefetch on).
  pipeline::Schedule schedule(hstu::HstuCascade cascade);
  // Gives the run's num_steps batches, then end of data.
  pipeline::Source source();

  // After a run (engine synchronized). Loss: this rank's share of the global loss per step (the
  // global loss is the sum over ranks).
  std::vector<float> losses() const;
  std::vector<float> global_tokens() const;
  // Dense fp32 master weights, then this rank's embedding-table shard.
  std::vector<float> parameters() const;
  // Steps 1..num_steps-1 (step 0 has no predecessor).
  std::vector<StepTiming> step_timings() const;
  // The tasks that run on the default stream, in run order.
  static std::span<const std::string_view> default_stream_tasks() noexcept;
  // Waits for step `step`'s last task on the GPU and returns its loss share.
  float wait_loss(std::int64_t step) const;

  const HstuConfig& config() const noexcept { return config_; }
  std::int64_t num_steps() const noexcept;

 private:
  std::unique_ptr<detail::HstuRankState> state_;
  HstuConfig config_;
};

}  // namespace weft::hstu
