#include "weft/hstu/rank.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <deque>
#include <mutex>

#include "rank_state.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.hpp"
#include "weft/hstu/data.hpp"
#include "weft/hstu/dense_mlp.hpp"
#include "weft/hstu/kernels.hpp"
#include "weft/pipeline/cuda_backend.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::hstu {
namespace {

// Buffer sets made with the rank: enough for the deepest preset cascade (d6 keeps 6 batches in
// flight, one more lets h2d fill a set while the oldest batch finishes). A schedule that keeps
// more in flight gets more when its engine is built (h2d's init).
constexpr int kNumInitialBufferSets = 7;

template <typename T>
T* device_alloc(std::int64_t count) {
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&p, std::size_t(std::max<std::int64_t>(count, 1)) * sizeof(T)));
  return static_cast<T*>(p);
}
template <typename T>
T* pinned_alloc(std::int64_t count) {
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaHostAlloc(&p, std::size_t(std::max<std::int64_t>(count, 1)) * sizeof(T),
                                cudaHostAllocDefault));
  return static_cast<T*>(p);
}

cudaEvent_t new_event(bool timing) {
  cudaEvent_t e = nullptr;
  WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}

}  // namespace

using detail::BatchBuffers;
using detail::default_task_index;
using detail::HstuRankState;
using detail::kDefaultTasks;
using detail::kMarkBwdJoinBegin;
using detail::kMarkBwdJoinEnd;
using detail::kMarkCodJoinBegin;
using detail::kMarkCodJoinEnd;
using detail::kNumMarks;

void HstuRankState::ensure_buffer_sets(std::size_t num_sets) {
  const int W = config.world_size, B = config.local_batch, dim = config.embedding_dim;
  const std::int64_t max_local = config.max_local_tokens(), max_global = config.max_global_tokens();
  while (sets.size() < num_sets) {
    BatchBuffers& b = sets.emplace_back();
    b.lengths = device_alloc<std::int64_t>(B);
    b.ids = device_alloc<std::int64_t>(max_local);
    b.all_workloads = device_alloc<std::int64_t>(W * B);
    b.host_workloads = pinned_alloc<std::int64_t>(W * B);
    b.workloads_ready = new_event(false);
    b.all_lengths = device_alloc<std::int64_t>(W * B);
    b.all_ids = device_alloc<std::int64_t>(max_global);
    b.host_plan = pinned_alloc<std::int64_t>(B * 3);
    b.plan = device_alloc<std::int64_t>(B * 3);
    b.sh_lengths = device_alloc<std::int64_t>(B);
    b.sh_ids = device_alloc<std::int64_t>(max_local);
    b.counts = device_alloc<std::int64_t>(2 * W);
    b.host_counts = pinned_alloc<std::int64_t>(2 * W);
    b.counts_ready = new_event(false);
    b.send_lengths = device_alloc<std::int64_t>(W * B);
    b.recv_lengths = device_alloc<std::int64_t>(W * B);
    b.send_ids = device_alloc<std::int64_t>(max_local);
    b.position = device_alloc<std::int64_t>(max_local);
    b.recv_ids = device_alloc<std::int64_t>(max_global);
    b.temp_bytes = prefetch_temp_bytes(max_global, key_bits);
    b.temp = device_alloc<char>(std::int64_t(b.temp_bytes));
    b.arrival = device_alloc<std::int32_t>(max_global);
    b.sorted_arrival = device_alloc<std::int32_t>(max_global);
    b.distinct_rank = device_alloc<std::int32_t>(max_global);
    b.inverse = device_alloc<std::int32_t>(max_global);
    b.sorted_ids = device_alloc<std::int64_t>(max_global);
    b.cache = device_alloc<float>(max_global * dim);
    b.released = new_event(false);
  }
}

HstuRank::HstuRank(const HstuConfig& config, ncclComm_t comm, int device, std::int64_t num_steps)
    : config_(config) {
  config.validate();
  WEFT_CHECK(num_steps >= 1, "HstuRank: num_steps must be >= 1");
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  state_ = std::make_unique<HstuRankState>(config, comm, device, num_steps);
  HstuRankState& s = *state_;
  if (config.communicator_per_role) {
    // Collective over the ranks of comm, in the same order on each. The split keeps the ranks'
    // order only if the key is the rank within comm.
    int comm_rank = -1;
    WEFT_NCCL_CHECK(ncclCommUserRank(comm, &comm_rank));
    WEFT_CHECK(comm_rank == config.rank, "HstuRank: config.rank ", config.rank,
               " is not the communicator's rank ", comm_rank);
    for (ncclComm_t* role : {&s.input_comm, &s.output_comm}) {
      WEFT_NCCL_CHECK(ncclCommSplit(comm, 0, config.rank, role, nullptr));
      s.owned_comms.push_back(*role);
    }
  }
  const int W = config.world_size, dim = config.embedding_dim;
  const std::int64_t max_local = config.max_local_tokens(), max_global = config.max_global_tokens();
  s.key_bits = std::max(1, int(std::bit_width(std::uint64_t(config.num_items - 1))));
  s.ensure_buffer_sets(kNumInitialBufferSets);
  const std::int64_t rows = config.num_local_rows();
  s.table = device_alloc<float>(rows * dim);
  s.initial_table.resize(std::size_t(rows * dim));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (int k = 0; k < dim; ++k) {
      s.initial_table[std::size_t(r * dim + k)] =
          initial_embedding_value(config.seed, r * W + config.rank, k);
    }
  }
  std::vector<float> target(std::size_t(config.num_items));
  for (std::int64_t id = 0; id < config.num_items; ++id) target[std::size_t(id)] = target_value(config, id);
  s.target = device_alloc<float>(config.num_items);
  WEFT_CUDA_CHECK(cudaMemcpy(s.target, target.data(), target.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  s.send_rows = device_alloc<float>(max_global * dim);
  s.grad_recv = device_alloc<float>(max_global * dim);
  s.recv_rows = device_alloc<float>(max_local * dim);
  s.grad_send = device_alloc<float>(max_local * dim);
  s.d_x0 = device_alloc<float>(max_local * dim);
  s.prediction = device_alloc<float>(max_local);
  s.diff = device_alloc<float>(max_local);
  s.x0 = device_alloc<__nv_bfloat16>(max_local * dim);
  s.d_prediction = device_alloc<__nv_bfloat16>(max_local);
  s.loss_sum = device_alloc<float>(1);
  s.token_count = device_alloc<float>(1);
  s.global_tokens = device_alloc<float>(1);
  s.loss_history = device_alloc<float>(num_steps);
  s.tokens_history = device_alloc<float>(num_steps);
  s.table_updated = new_event(false);
  s.cod_in = new_event(false);
  s.cod_out = new_event(false);
  s.bwd_in = new_event(false);
  s.bwd_out = new_event(false);
  s.marks.resize(std::size_t(num_steps * kNumMarks));
  for (auto& e : s.marks) e = new_event(true);
  reset();
}

// Device memory and events are released with the process's CUDA context in tools; tests create
// few ranks. Freed here all the same, after the GPU finished.
HstuRank::~HstuRank() {
  if (!state_) return;
  HstuRankState& s = *state_;
  cudaSetDevice(s.device);
  cudaDeviceSynchronize();
  for (BatchBuffers& b : s.sets) {
    for (void* p : {static_cast<void*>(b.lengths), static_cast<void*>(b.ids),
                    static_cast<void*>(b.all_workloads), static_cast<void*>(b.all_lengths),
                    static_cast<void*>(b.all_ids), static_cast<void*>(b.plan),
                    static_cast<void*>(b.sh_lengths), static_cast<void*>(b.sh_ids),
                    static_cast<void*>(b.counts), static_cast<void*>(b.send_lengths),
                    static_cast<void*>(b.recv_lengths), static_cast<void*>(b.send_ids),
                    static_cast<void*>(b.position), static_cast<void*>(b.recv_ids), b.temp,
                    static_cast<void*>(b.arrival), static_cast<void*>(b.sorted_arrival),
                    static_cast<void*>(b.distinct_rank), static_cast<void*>(b.inverse),
                    static_cast<void*>(b.sorted_ids), static_cast<void*>(b.cache)}) {
      cudaFree(p);
    }
    cudaFreeHost(b.host_workloads);
    cudaFreeHost(b.host_plan);
    cudaFreeHost(b.host_counts);
    for (cudaEvent_t e : {b.workloads_ready, b.counts_ready, b.released}) cudaEventDestroy(e);
  }
  for (void* p : {static_cast<void*>(s.table), static_cast<void*>(s.target),
                  static_cast<void*>(s.send_rows), static_cast<void*>(s.grad_recv),
                  static_cast<void*>(s.recv_rows), static_cast<void*>(s.grad_send),
                  static_cast<void*>(s.d_x0), static_cast<void*>(s.prediction),
                  static_cast<void*>(s.diff), static_cast<void*>(s.x0),
                  static_cast<void*>(s.d_prediction), static_cast<void*>(s.loss_sum),
                  static_cast<void*>(s.token_count), static_cast<void*>(s.global_tokens),
                  static_cast<void*>(s.loss_history), static_cast<void*>(s.tokens_history)}) {
    cudaFree(p);
  }
  for (cudaEvent_t e : {s.table_updated, s.cod_in, s.cod_out, s.bwd_in, s.bwd_out}) {
    cudaEventDestroy(e);
  }
  for (cudaEvent_t e : s.marks) cudaEventDestroy(e);
}

std::int64_t HstuRank::num_steps() const noexcept { return state_->num_steps; }

void HstuRank::reset() {
  HstuRankState& s = *state_;
  WEFT_CUDA_CHECK(cudaSetDevice(s.device));
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  s.mlp.init_parameters(nullptr);
  WEFT_CUDA_CHECK(cudaMemcpy(s.table, s.initial_table.data(), s.initial_table.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemset(s.loss_history, 0xff, std::size_t(s.num_steps) * sizeof(float)));
  WEFT_CUDA_CHECK(cudaMemset(s.tokens_history, 0xff, std::size_t(s.num_steps) * sizeof(float)));
  // Fresh events: a wait on a never-recorded event is a no-op, as on the very first run.
  for (cudaEvent_t* e : {&s.table_updated, &s.cod_in, &s.cod_out, &s.bwd_in, &s.bwd_out}) {
    WEFT_CUDA_CHECK(cudaEventDestroy(*e));
    *e = new_event(false);
  }
  for (BatchBuffers& b : s.sets) {
    WEFT_CUDA_CHECK(cudaEventDestroy(b.released));
    b.released = new_event(false);
  }
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  s.error.clear();
}

pipeline::Source HstuRank::source() {
  auto next = std::make_shared<std::int64_t>(0);
  HstuRankState* s = state_.get();
  return [s, next](pipeline::Batch& batch) {
    if (*next == s->num_steps) return false;
    batch.set("batch_cpu", s->data.batch((*next)++));
    return true;
  };
}
pipeline::Schedule HstuRank::schedule(hstu::HstuCascade cascade) {
  detail::HstuRankState* s = state_.get();
  pipeline::Schedule schedule =
      hstu::hstu_schedule({.cascade = cascade, .prefetch = true, .bodies = detail::task_bodies(s)});
  // Runs when the engine is built, after any edit of the schedule (e.g. a ScheduleConfig's
  // lookaheads): as many buffer sets as the schedule keeps batches in flight.
  schedule.task("h2d").init([s](pipeline::TaskContext& c) {
    s->ensure_buffer_sets(std::size_t(c.schedule().in_flight()));
  });
  return schedule;
}

namespace {

// A per-step record ([num_steps] floats on `device`) copied to the host.
std::vector<float> download_history(int device, const float* history, std::int64_t num_steps) {
  std::vector<float> out(static_cast<std::size_t>(num_steps));
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  WEFT_CUDA_CHECK(
      cudaMemcpy(out.data(), history, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace

std::vector<float> HstuRank::losses() const {
  return download_history(state_->device, state_->loss_history, state_->num_steps);
}

std::vector<float> HstuRank::global_tokens() const {
  return download_history(state_->device, state_->tokens_history, state_->num_steps);
}

std::vector<float> HstuRank::parameters() const {
  const HstuRankState& s = *state_;
  WEFT_CUDA_CHECK(cudaSetDevice(s.device));
  std::vector<float> out(std::size_t(s.mlp.num_parameters()) + s.initial_table.size());
  WEFT_CUDA_CHECK(cudaMemcpy(out.data(), s.mlp.master(),
                             std::size_t(s.mlp.num_parameters()) * sizeof(float),
                             cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(out.data() + s.mlp.num_parameters(), s.table,
                             s.initial_table.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

float HstuRank::wait_loss(std::int64_t step) const {
  const HstuRankState& s = *state_;
  WEFT_CHECK(step >= 0 && step < s.num_steps, "wait_loss: step ", step);
  WEFT_CUDA_CHECK(cudaSetDevice(s.device));
  const int watchdog_end = 2 * default_task_index("watchdog") + 1;
  WEFT_CUDA_CHECK(cudaEventSynchronize(s.marks[std::size_t(step * kNumMarks + watchdog_end)]));
  float loss = 0;
  WEFT_CUDA_CHECK(cudaMemcpy(&loss, s.loss_history + step, sizeof(float), cudaMemcpyDeviceToHost));
  return loss;
}

std::span<const std::string_view> HstuRank::default_stream_tasks() noexcept {
  return kDefaultTasks;
}

std::vector<StepTiming> HstuRank::step_timings() const {
  const HstuRankState& s = *state_;
  WEFT_CUDA_CHECK(cudaSetDevice(s.device));
  auto ms = [&](std::int64_t step_a, int a, std::int64_t step_b, int b) {
    float out = 0;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&out, s.marks[std::size_t(step_a * kNumMarks + a)],
                                         s.marks[std::size_t(step_b * kNumMarks + b)]));
    return double(out) * 1e3;
  };
  const int n = int(kDefaultTasks.size());
  const int last_end = 2 * (n - 1) + 1;
  std::vector<StepTiming> out;
  for (std::int64_t i = 1; i < s.num_steps; ++i) {
    StepTiming t;
    t.step_us = ms(i - 1, last_end, i, last_end);
    t.idle_before_us.push_back(ms(i - 1, last_end, i, 0));
    for (int k = 1; k < n; ++k) t.idle_before_us.push_back(ms(i, 2 * (k - 1) + 1, i, 2 * k));
    for (double gap : t.idle_before_us) t.idle_us += gap;
    t.cod_join_us = ms(i, kMarkCodJoinBegin, i, kMarkCodJoinEnd);
    t.bwd_join_us = ms(i, kMarkBwdJoinBegin, i, kMarkBwdJoinEnd);
    t.join_stall_us = t.cod_join_us + t.bwd_join_us;
    const int tokens = default_task_index("global_tokens_allreduce");
    const int grads = default_task_index("finalize_model_grads");
    t.comm_on_default_us = ms(i, 2 * tokens, i, 2 * tokens + 1) + ms(i, 2 * grads, i, 2 * grads + 1);
    out.push_back(t);
  }
  return out;
}


}  // namespace weft::hstu
