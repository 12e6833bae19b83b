// weft::hstu::detail: what HstuRank keeps per rank (HstuRankState) and the bodies of the HSTU
// schedule's 14 tasks over it (task_bodies.cpp). Private to src/hstu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.hpp"
#include "weft/cuda/nccl_include.hpp"
#include "weft/hstu/config.hpp"
#include "weft/hstu/data.hpp"
#include "weft/hstu/dense_mlp.hpp"
#include "weft/pipeline/task.hpp"

namespace weft::hstu::detail {

// Default-stream tasks in run order; each records a begin and an end mark per step.
constexpr std::array<std::string_view, 8> kDefaultTasks = {
    "zero_grad", "global_tokens_allreduce", "compute_output_dist", "forward",
    "backward",  "finalize_model_grads",    "optimizer_step",      "watchdog"};
constexpr int kMarkCodJoinBegin = 16, kMarkCodJoinEnd = 17, kMarkBwdJoinBegin = 18,
              kMarkBwdJoinEnd = 19, kNumMarks = 20;

constexpr int default_task_index(std::string_view name) {
  for (std::size_t i = 0; i < kDefaultTasks.size(); ++i) {
    if (kDefaultTasks[i] == name) return int(i);
  }
  return -1;
}

// The device buffers of one batch in flight (the lookahead tasks' data).
struct BatchBuffers {
  std::int64_t* lengths;         // [B] h2d
  std::int64_t* ids;             // [max_local]
  std::int64_t* all_workloads;   // [W * B] start_shuffle
  std::int64_t* host_workloads;  // pinned [W * B]
  cudaEvent_t workloads_ready;
  std::int64_t* all_lengths;  // [W * B] finish_shuffle
  std::int64_t* all_ids;      // [max_global]
  std::int64_t* host_plan;    // pinned [B * 3]
  std::int64_t* plan;         // [B * 3]
  std::int64_t* sh_lengths;   // [B]
  std::int64_t* sh_ids;       // [max_local]
  std::int64_t num_sh_tokens = 0;
  std::int64_t* counts;       // [2W]: send counts, then receive counts (start_input_dist)
  std::int64_t* host_counts;  // pinned [2W]
  cudaEvent_t counts_ready;
  std::int64_t* send_lengths;                                                      // [W * B]
  std::int64_t* recv_lengths;                                                      // [W * B]
  std::int64_t* send_ids;                                                          // [max_local]
  std::int64_t* position;                                                          // [max_local]
  std::int64_t* recv_ids;                                                          // [max_global]
  std::vector<std::int64_t> send_counts, recv_counts, send_offsets, recv_offsets;  // host
  std::int64_t num_recv = 0;
  void* temp;  // prefetch
  std::size_t temp_bytes;
  std::int32_t *arrival, *sorted_arrival, *distinct_rank, *inverse;
  std::int64_t* sorted_ids;
  float* cache;          // [max_global, dim]
  cudaEvent_t released;  // recorded by watchdog: the set may be reused
};

struct HstuRankState {
  HstuConfig config;
  ncclComm_t comm;         // the default stream's AllReduces (global tokens, gradients)
  ncclComm_t input_comm;   // shuffle and input distribution (io / data_dist streams)
  ncclComm_t output_comm;  // embedding all-to-alls (output_dist_comm stream)
  std::vector<ncclComm_t> owned_comms;  // split here (communicator_per_role), destroyed with us
  int device;
  std::int64_t num_steps;
  HostDataset data;
  DenseMlp mlp;
  // Batch b uses sets[b % sets.size()]; at least the schedule's in_flight of them, so that a
  // set is reused only by a batch that enters the ring after the set's batch left it. A deque:
  // growing keeps the sets' addresses (slots hold pointers to them).
  std::deque<BatchBuffers> sets;
  float* table = nullptr;  // [num_local_rows, dim]
  std::vector<float> initial_table;
  float* target = nullptr;  // [num_items]
  // la-0 buffers (the default stream orders them step after step).
  float *send_rows, *recv_rows, *grad_send, *grad_recv, *d_x0, *prediction, *diff;
  __nv_bfloat16 *x0, *d_prediction;
  float *loss_sum, *token_count, *global_tokens;
  float *loss_history, *tokens_history;  // [num_steps]
  cudaEvent_t table_updated, cod_in, cod_out, bwd_in, bwd_out;
  std::vector<cudaEvent_t> marks;  // [num_steps * kNumMarks]
  cuda::DeviceErrorFlag error;
  int key_bits;

  HstuRankState(const HstuConfig& c, ncclComm_t comm_, int device_, std::int64_t steps)
      : config(c),
        comm(comm_),
        input_comm(comm_),
        output_comm(comm_),
        device(device_),
        num_steps(steps),
        data(c, steps),
        mlp(c, c.max_local_tokens()) {}

  ~HstuRankState() {
    for (ncclComm_t c : owned_comms) ncclCommDestroy(c);
  }
  HstuRankState(const HstuRankState&) = delete;
  HstuRankState& operator=(const HstuRankState&) = delete;

  BatchBuffers& set_of(std::int64_t batch) { return sets[std::size_t(batch) % sets.size()]; }
  // Allocates sets until there are num_sets (the GPU must be idle: between runs).
  void ensure_buffer_sets(std::size_t num_sets);

  void mark(std::int64_t step, int id, cudaStream_t stream) {
    if (step < 0 || step >= num_steps) return;
    WEFT_CUDA_CHECK(cudaEventRecord(marks[std::size_t(step * kNumMarks + id)], stream));
  }
};

// The body of every task of the HSTU schedule, over this rank's state (which must outlive the
// engine that runs them). Default-stream tasks record their begin and end marks around the body.
std::map<std::string, pipeline::TaskBody, std::less<>> task_bodies(HstuRankState* s);

}  // namespace weft::hstu::detail
