#include "weft/hstu/rank.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <deque>
#include <mutex>

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

using pipeline::TaskContext;

// Buffer sets made with the rank: enough for the deepest preset cascade (d6 keeps 6 batches in
// flight, one more lets h2d fill a set while the oldest batch finishes). A schedule that keeps
// more in flight gets more when its engine is built (h2d's init).
constexpr int kNumInitialBufferSets = 7;

// Default-stream tasks in run order; each records a begin and an end mark per step.
constexpr std::array<std::string_view, 8> kDefaultTasks = {
    "zero_grad",  "global_tokens_allreduce", "compute_output_dist", "forward",
    "backward",   "finalize_model_grads",    "optimizer_step",      "watchdog"};
constexpr int kMarkCodJoinBegin = 16, kMarkCodJoinEnd = 17, kMarkBwdJoinBegin = 18,
              kMarkBwdJoinEnd = 19, kNumMarks = 20;

constexpr int default_task_index(std::string_view name) {
  for (std::size_t i = 0; i < kDefaultTasks.size(); ++i) {
    if (kDefaultTasks[i] == name) return int(i);
  }
  return -1;
}

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

// The device buffers of one batch in flight (the lookahead tasks' data).
struct BatchBuffers {
  std::int64_t* lengths;        // [B] h2d
  std::int64_t* ids;            // [max_local]
  std::int64_t* all_workloads;  // [W * B] start_shuffle
  std::int64_t* host_workloads; // pinned [W * B]
  cudaEvent_t workloads_ready;
  std::int64_t* all_lengths;    // [W * B] finish_shuffle
  std::int64_t* all_ids;        // [max_global]
  std::int64_t* host_plan;      // pinned [B * 3]
  std::int64_t* plan;           // [B * 3]
  std::int64_t* sh_lengths;     // [B]
  std::int64_t* sh_ids;         // [max_local]
  std::int64_t num_sh_tokens = 0;
  std::int64_t* counts;         // [2W]: send counts, then receive counts (start_input_dist)
  std::int64_t* host_counts;    // pinned [2W]
  cudaEvent_t counts_ready;
  std::int64_t* send_lengths;   // [W * B]
  std::int64_t* recv_lengths;   // [W * B]
  std::int64_t* send_ids;       // [max_local]
  std::int64_t* position;       // [max_local]
  std::int64_t* recv_ids;       // [max_global]
  std::vector<std::int64_t> send_counts, recv_counts, send_offsets, recv_offsets;  // host
  std::int64_t num_recv = 0;
  void* temp;                   // prefetch
  std::size_t temp_bytes;
  std::int32_t *arrival, *sorted_arrival, *distinct_rank, *inverse;
  std::int64_t* sorted_ids;
  float* cache;                 // [max_global, dim]
  cudaEvent_t released;         // recorded by watchdog: the set may be reused
};

}  // namespace

struct HstuRank::State {
  HstuConfig config;
  ncclComm_t comm;          // the default stream's AllReduces (global tokens, gradients)
  ncclComm_t input_comm;    // shuffle and input distribution (io / data_dist streams)
  ncclComm_t output_comm;   // embedding all-to-alls (output_dist_comm stream)
  std::vector<ncclComm_t> owned_comms;  // split here (communicator_per_role), destroyed with us
  int device;
  std::int64_t num_steps;
  HostDataset data;
  DenseMlp mlp;
  // Batch b uses sets[b % sets.size()]; at least the schedule's in_flight of them, so that a
  // set is reused only by a batch that enters the ring after the set's batch left it. A deque:
  // growing keeps the sets' addresses (slots hold pointers to them).
  std::deque<BatchBuffers> sets;
  float* table = nullptr;        // [num_local_rows, dim]
  std::vector<float> initial_table;
  float* target = nullptr;       // [num_items]
  // la-0 buffers (the default stream orders them step after step).
  float *send_rows, *recv_rows, *grad_send, *grad_recv, *d_x0, *prediction, *diff;
  __nv_bfloat16 *x0, *d_prediction;
  float *loss_sum, *token_count, *global_tokens;
  float *loss_history, *tokens_history;  // [num_steps]
  cudaEvent_t table_updated, cod_in, cod_out, bwd_in, bwd_out;
  std::vector<cudaEvent_t> marks;  // [num_steps * kNumMarks]
  cuda::DeviceErrorFlag error;
  int key_bits;

  State(const HstuConfig& c, ncclComm_t comm_, int device_, std::int64_t steps)
      : config(c), comm(comm_), input_comm(comm_), output_comm(comm_), device(device_),
        num_steps(steps), data(c, steps),
        mlp(c, c.max_local_tokens()) {}

  ~State() {
    for (ncclComm_t c : owned_comms) ncclCommDestroy(c);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  BatchBuffers& set_of(std::int64_t batch) { return sets[std::size_t(batch) % sets.size()]; }
  // Allocates sets until there are num_sets (the GPU must be idle: between runs).
  void ensure_buffer_sets(std::size_t num_sets);

  void mark(std::int64_t step, int id, cudaStream_t stream) {
    if (step < 0 || step >= num_steps) return;
    WEFT_CUDA_CHECK(cudaEventRecord(marks[std::size_t(step * kNumMarks + id)], stream));
  }

};

namespace {

// Grouped send/recv all-to-all: to peer p `send_counts[p]` elements from send + send_offsets[p].
void all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                const std::vector<std::int64_t>& send_offsets, void* recv,
                const std::vector<std::int64_t>& recv_counts,
                const std::vector<std::int64_t>& recv_offsets, std::int64_t row_elements,
                ncclDataType_t type, std::size_t element_bytes, ncclComm_t comm,
                cudaStream_t stream) {
  const int world = int(send_counts.size());
  WEFT_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < world; ++p) {
    const auto i = std::size_t(p);
    WEFT_NCCL_CHECK(ncclSend(static_cast<const char*>(send) +
                                 send_offsets[i] * row_elements * std::int64_t(element_bytes),
                             std::size_t(send_counts[i] * row_elements), type, p, comm, stream));
    WEFT_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) +
                                 recv_offsets[i] * row_elements * std::int64_t(element_bytes),
                             std::size_t(recv_counts[i] * row_elements), type, p, comm, stream));
  }
  WEFT_NCCL_CHECK(ncclGroupEnd());
}

std::vector<std::int64_t> exclusive_offsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> offsets(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
  return offsets;
}

// 0, 1, ..., world - 1: the offsets of a one-row-per-peer all-to-all.
std::vector<std::int64_t> peer_indices(int world) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(world));
  for (int p = 0; p < world; ++p) out[static_cast<std::size_t>(p)] = p;
  return out;
}

std::string describe_device_error(const cuda::DeviceErrorRecord& r) {
  switch (r.code) {
    case kErrorForeignId:
      return weft::detail::concat("hstu: rank ", r.rank, " received item id ", r.args[0],
                          " which it does not own (world ", r.args[1], ")");
    case kErrorLengthMismatch:
      return weft::detail::concat("hstu: rank ", r.rank, ": the lengths peer ", r.args[0],
                          " sent add up to ", r.args[1], " but it sent ", r.args[2], " ids");
    default:
      return weft::detail::concat("hstu: device error code ", r.code, " on rank ", r.rank);
  }
}

}  // namespace

void HstuRank::State::ensure_buffer_sets(std::size_t num_sets) {
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
  state_ = std::make_unique<State>(config, comm, device, num_steps);
  State& s = *state_;
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
  State& s = *state_;
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
  State& s = *state_;
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
  State* s = state_.get();
  return [s, next](pipeline::Batch& batch) {
    if (*next == s->num_steps) return false;
    batch.set("batch_cpu", s->data.batch((*next)++));
    return true;
  };
}

pipeline::Schedule HstuRank::schedule(pipeline::HstuCascade cascade) {
  State* s = state_.get();
  const HstuConfig& cfg = config_;
  const int W = cfg.world_size, B = cfg.local_batch, dim = cfg.embedding_dim;
  std::map<std::string, pipeline::TaskBody, std::less<>> bodies;

  // Default-stream tasks mark their begin and end for the step timings.
  auto on_default = [s](std::string_view name, pipeline::TaskBody body) {
    const int index = default_task_index(name);
    return [s, index, body = std::move(body)](TaskContext& c) {
      const cudaStream_t stream = pipeline::cuda_stream(c);
      s->mark(c.batch_index(), 2 * index, stream);
      body(c);
      s->mark(c.batch_index(), 2 * index + 1, stream);
    };
  };

  bodies["h2d"] = [s, B](TaskContext& c) {
    const auto& host = c.get<HostBatchView>("batch_cpu");
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    pipeline::wait_event(c, b.released);  // the set's previous batch is done with it
    WEFT_CUDA_CHECK(cudaMemcpyAsync(b.lengths, host.lengths, std::size_t(B) * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(b.ids, host.ids,
                                    std::size_t(host.num_tokens) * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream));
    c.set("batch_gpu", &b);
    c.set("ctx", &b);
  };

  // Workload of a sample = its token count (the per-token model's cost).
  bodies["start_shuffle"] = [s, B, W](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    WEFT_NCCL_CHECK(ncclAllGather(b.lengths, b.all_workloads, std::size_t(B), ncclInt64, s->input_comm, stream));
    c.record_collective("AllGather (workloads)", "memcpy", std::size_t(B) * 8);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(b.host_workloads, b.all_workloads,
                                    std::size_t(W * B) * sizeof(std::int64_t),
                                    cudaMemcpyDeviceToHost, stream));
    WEFT_CUDA_CHECK(cudaEventRecord(b.workloads_ready, stream));
    c.set("shuffle_handle", &b);
  };

  bodies["finish_shuffle"] = [s, B, W, rank = cfg.rank](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    WEFT_CUDA_CHECK(cudaEventSynchronize(b.workloads_ready));
    const std::span<const std::int64_t> workloads(b.host_workloads, std::size_t(W * B));
    const auto parts = balanced_partition(workloads, W, B);
    // Values of rank r sit at value_offset[r] in all_ids; sample g at sample_offset[g].
    std::vector<std::int64_t> sample_offset(std::size_t(W * B) + 1, 0), per_rank(std::size_t(W), 0);
    for (int g = 0; g < W * B; ++g) {
      sample_offset[std::size_t(g) + 1] = sample_offset[std::size_t(g)] + workloads[std::size_t(g)];
      per_rank[std::size_t(g / B)] += workloads[std::size_t(g)];
    }
    std::int64_t dst = 0;
    const auto& mine = parts[std::size_t(rank)];
    for (std::size_t j = 0; j < mine.size(); ++j) {
      const int g = mine[j];
      b.host_plan[3 * j] = g;
      b.host_plan[3 * j + 1] = sample_offset[std::size_t(g)];
      b.host_plan[3 * j + 2] = dst;
      dst += workloads[std::size_t(g)];
    }
    b.num_sh_tokens = dst;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(b.plan, b.host_plan, std::size_t(B * 3) * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream));
    WEFT_NCCL_CHECK(ncclAllGather(b.lengths, b.all_lengths, std::size_t(B), ncclInt64, s->input_comm, stream));
    c.record_collective("AllGather (lengths)", "memcpy", std::size_t(B) * 8);
    // AllGatherV: one broadcast per root, grouped (NCCL runs them as one kernel).
    WEFT_NCCL_CHECK(ncclGroupStart());
    std::int64_t offset = 0;
    for (int r = 0; r < W; ++r) {
      WEFT_NCCL_CHECK(ncclBroadcast(b.ids, b.all_ids + offset, std::size_t(per_rank[std::size_t(r)]),
                                    ncclInt64, r, s->input_comm, stream));
      offset += per_rank[std::size_t(r)];
    }
    WEFT_NCCL_CHECK(ncclGroupEnd());
    c.record_collective("AllGatherV (values)", "memcpy",
                        std::size_t(per_rank[std::size_t(rank)]) * 8);
    launch_select_samples({.all_lengths = b.all_lengths, .all_ids = b.all_ids, .plan = b.plan,
                           .num_samples = B, .out_lengths = b.sh_lengths, .out_ids = b.sh_ids},
                          stream);
    c.set("shuffled_batch", &b);
  };

  bodies["start_input_dist"] = [s, B, W](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    launch_partition_by_owner({.ids = b.sh_ids, .lengths = b.sh_lengths,
                               .num_tokens = b.num_sh_tokens, .num_samples = B, .world_size = W,
                               .send_counts = b.counts, .send_lengths = b.send_lengths,
                               .send_ids = b.send_ids, .position = b.position},
                              stream);
    const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
    const std::vector<std::int64_t> peers = peer_indices(W);
    all_to_all(b.counts, ones, peers, b.counts + W, ones, peers, 1, ncclInt64, 8, s->input_comm, stream);
    c.record_collective("SendRecv (a2a splits)", "data_dist", std::size_t(W) * 8);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(b.host_counts, b.counts, std::size_t(2 * W) * sizeof(std::int64_t),
                                    cudaMemcpyDeviceToHost, stream));
    WEFT_CUDA_CHECK(cudaEventRecord(b.counts_ready, stream));
    c.set("dist_request", &b);
  };

  bodies["wait_input_dist"] = [s, B, W, rank = cfg.rank](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    WEFT_CUDA_CHECK(cudaEventSynchronize(b.counts_ready));
    b.send_counts.assign(b.host_counts, b.host_counts + W);
    b.recv_counts.assign(b.host_counts + W, b.host_counts + 2 * W);
    b.send_offsets = exclusive_offsets(b.send_counts);
    b.recv_offsets = exclusive_offsets(b.recv_counts);
    b.num_recv = b.recv_offsets.back() + b.recv_counts.back();
    const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
    const std::vector<std::int64_t> peers = peer_indices(W);
    all_to_all(b.send_lengths, ones, peers, b.recv_lengths, ones, peers, B,
               ncclInt64, 8, s->input_comm, stream);
    c.record_collective("SendRecv (a2a lengths)", "data_dist", std::size_t(W) * std::size_t(B) * 8);
    all_to_all(b.send_ids, b.send_counts, b.send_offsets, b.recv_ids, b.recv_counts,
               b.recv_offsets, 1, ncclInt64, 8, s->input_comm, stream);
    c.record_collective("SendRecv (a2a values)", "data_dist", std::size_t(b.num_sh_tokens) * 8);
    launch_check_lengths({.recv_lengths = b.recv_lengths, .recv_counts = b.counts + W,
                          .world_size = W, .num_samples = B, .rank = rank,
                          .error = s->error.device_record()},
                         stream);
  };

  bodies["prefetch_embeddings"] = [s, W, dim, rank = cfg.rank](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    // The table as updated by batch <= i - 2 (see the header's contract).
    pipeline::wait_event(c, s->table_updated);
    launch_prefetch({.recv_ids = b.recv_ids, .num_ids = b.num_recv, .world_size = W, .rank = rank,
                     .key_bits = s->key_bits, .dim = dim, .table = s->table,
                     .num_local_rows = s->config.num_local_rows(), .temp = b.temp,
                     .temp_bytes = b.temp_bytes, .arrival = b.arrival,
                     .sorted_ids = b.sorted_ids, .sorted_arrival = b.sorted_arrival,
                     .distinct_rank = b.distinct_rank, .inverse = b.inverse, .cache = b.cache,
                     .error = s->error.device_record()},
                    stream);
  };

  bodies["zero_grad"] = on_default("zero_grad", [s](TaskContext& c) {
    s->mlp.zero_grads(pipeline::cuda_stream(c));
  });

  bodies["global_tokens_allreduce"] = on_default("global_tokens_allreduce", [s, B](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    launch_count_tokens({.lengths = b.lengths, .num_samples = B, .out = s->token_count}, stream);
    WEFT_NCCL_CHECK(ncclAllReduce(s->token_count, s->global_tokens, 1, ncclFloat, ncclSum, s->comm, stream));
    c.record_collective("AllReduce (global tokens)", "default", 4);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(s->tokens_history + c.batch_index(), s->global_tokens,
                                    sizeof(float), cudaMemcpyDeviceToDevice, stream));
    c.set("global_tokens", s->global_tokens);
  });

  bodies["compute_output_dist"] = on_default("compute_output_dist", [s, dim](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    const cudaStream_t comm_stream = pipeline::cuda_stream(c, "output_dist_comm");
    launch_lookup({.cache = b.cache, .inverse = b.inverse, .num_rows = b.num_recv, .dim = dim,
                   .rows = s->send_rows}, stream);
    WEFT_CUDA_CHECK(cudaEventRecord(s->cod_in, stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, s->cod_in, 0));
    // Owner side answers what each peer asked for; the rows come back in send order.
    all_to_all(s->send_rows, b.recv_counts, b.recv_offsets, s->recv_rows, b.send_counts,
               b.send_offsets, dim, ncclFloat, 4, s->output_comm, comm_stream);
    c.record_collective("SendRecv (a2a embedding fwd)", "output_dist_comm",
                        std::size_t(b.num_recv) * std::size_t(dim) * 4);
    WEFT_CUDA_CHECK(cudaEventRecord(s->cod_out, comm_stream));
    s->mark(c.batch_index(), kMarkCodJoinBegin, stream);
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s->cod_out, 0));
    s->mark(c.batch_index(), kMarkCodJoinEnd, stream);
  });

  bodies["forward"] = on_default("forward", [s, dim](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    launch_gather_rows({.rows = s->recv_rows, .position = b.position,
                        .num_tokens = b.num_sh_tokens, .dim = dim, .x = s->x0}, stream);
    s->mlp.forward(s->x0, b.num_sh_tokens, s->prediction, stream);
    launch_loss_forward({.prediction = s->prediction, .ids = b.sh_ids, .target = s->target,
                         .num_tokens = b.num_sh_tokens, .diff = s->diff, .loss_sum = s->loss_sum},
                        stream);
    c.set("losses", s->loss_sum);
    c.set("output", s->prediction);
  });

  bodies["backward"] = on_default("backward", [s, dim](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    const cudaStream_t comm_stream = pipeline::cuda_stream(c, "output_dist_comm");
    launch_loss_backward({.diff = s->diff, .loss_sum = s->loss_sum,
                          .global_tokens = s->global_tokens, .num_tokens = b.num_sh_tokens,
                          .d_prediction = s->d_prediction,
                          .loss_out = s->loss_history + c.batch_index()},
                         stream);
    s->mlp.backward(s->x0, s->d_prediction, b.num_sh_tokens, s->d_x0, stream);
    launch_scatter_rows({.grad = s->d_x0, .position = b.position, .num_tokens = b.num_sh_tokens,
                         .dim = dim, .rows = s->grad_send}, stream);
    WEFT_CUDA_CHECK(cudaEventRecord(s->bwd_in, stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, s->bwd_in, 0));
    all_to_all(s->grad_send, b.send_counts, b.send_offsets, s->grad_recv, b.recv_counts,
               b.recv_offsets, dim, ncclFloat, 4, s->output_comm, comm_stream);
    c.record_collective("SendRecv (a2a embedding bwd)", "output_dist_comm",
                        std::size_t(b.num_sh_tokens) * std::size_t(dim) * 4);
    // Joined where the gradient rows are consumed (optimizer_step's embedding update), not here:
    // the all-to-all then runs under finalize_model_grads and the dense update.
    WEFT_CUDA_CHECK(cudaEventRecord(s->bwd_out, comm_stream));
  });

  bodies["finalize_model_grads"] = on_default("finalize_model_grads", [s](TaskContext& c) {
    const cudaStream_t stream = pipeline::cuda_stream(c);
    for (int k : {1, 2}) {
      const GradientBucket bucket = s->mlp.bucket(k);
      WEFT_NCCL_CHECK(ncclAllReduce(bucket.data, bucket.data, std::size_t(bucket.num_elements),
                                    ncclFloat, ncclSum, s->comm, stream));
      c.record_collective(k == 1 ? "AllReduce (grad bucket 1)" : "AllReduce (grad bucket 2)",
                          "default", std::size_t(bucket.num_elements) * 4);
    }
  });

  bodies["optimizer_step"] = on_default("optimizer_step", [s, W, dim](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    const cudaStream_t stream = pipeline::cuda_stream(c);
    s->mlp.sgd(s->config.dense_lr, stream);
    s->mark(c.batch_index(), kMarkBwdJoinBegin, stream);
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s->bwd_out, 0));  // backward's gradient a2a
    s->mark(c.batch_index(), kMarkBwdJoinEnd, stream);
    launch_embedding_sgd({.sorted_ids = b.sorted_ids, .sorted_arrival = b.sorted_arrival,
                          .num_ids = b.num_recv, .grad_rows = s->grad_recv, .world_size = W,
                          .dim = dim, .lr = s->config.embedding_lr, .table = s->table},
                         stream);
    WEFT_CUDA_CHECK(cudaEventRecord(s->table_updated, stream));
    c.set("step_result", s->loss_history + c.batch_index());
  });

  // Releases the batch's buffers and surfaces device-side errors (read without blocking).
  bodies["watchdog"] = on_default("watchdog", [s](TaskContext& c) {
    BatchBuffers& b = s->set_of(c.batch_index());
    WEFT_CUDA_CHECK(cudaEventRecord(b.released, pipeline::cuda_stream(c)));
    s->error.throw_if_raised(describe_device_error);
  });

  pipeline::Schedule schedule =
      pipeline::hstu_schedule({.cascade = cascade, .prefetch = true, .bodies = std::move(bodies)});
  // Runs when the engine is built, after any edit of the schedule (e.g. a ScheduleConfig's
  // lookaheads): as many buffer sets as the schedule keeps batches in flight.
  schedule.task("h2d").init([s](TaskContext& c) {
    s->ensure_buffer_sets(std::size_t(c.schedule().in_flight()));
  });
  return schedule;
}

std::vector<float> HstuRank::losses() const {
  std::vector<float> out(std::size_t(state_->num_steps));
  WEFT_CUDA_CHECK(cudaSetDevice(state_->device));
  WEFT_CUDA_CHECK(cudaMemcpy(out.data(), state_->loss_history, out.size() * sizeof(float),
                             cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> HstuRank::global_tokens() const {
  std::vector<float> out(std::size_t(state_->num_steps));
  WEFT_CUDA_CHECK(cudaSetDevice(state_->device));
  WEFT_CUDA_CHECK(cudaMemcpy(out.data(), state_->tokens_history, out.size() * sizeof(float),
                             cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> HstuRank::parameters() const {
  const State& s = *state_;
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
  const State& s = *state_;
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
  const State& s = *state_;
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
