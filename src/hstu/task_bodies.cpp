// The bodies of the HSTU schedule's tasks (docs/hstu.md "What each task does"), one function per
// task, over the rank's state (rank_state.hpp).
#include <span>

#include "rank_state.hpp"
#include "weft/core/error.hpp"
#include "weft/hstu/kernels.hpp"
#include "weft/pipeline/cuda_backend.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::hstu::detail {
namespace {

using pipeline::TaskContext;

// What every body works with: the rank's state, the buffer set of the batch the task works on,
// the task's stream and its context, and the step's sizes (from the rank's HstuConfig).
struct BodyArgs {
  HstuRankState* s;
  BatchBuffers& b;
  cudaStream_t stream;
  TaskContext& c;
  int B;     // local batch (samples)
  int W;     // world size
  int dim;   // embedding dim
  int rank;  // this rank
};
using Body = void (*)(const BodyArgs&);

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
    WEFT_NCCL_CHECK(ncclRecv(
        static_cast<char*>(recv) + recv_offsets[i] * row_elements * std::int64_t(element_bytes),
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
                                  " sent add up to ", r.args[1], " but it sent ", r.args[2],
                                  " ids");
    default:
      return weft::detail::concat("hstu: device error code ", r.code, " on rank ", r.rank);
  }
}

// Queues a copy of `count` values to pinned host memory and records `ready` after it: the task
// that needs them on the host (a later one, so this task's host thread does not wait) waits there.
void start_read_back(const std::int64_t* device, std::int64_t* host, std::int64_t count,
                     cudaEvent_t ready, cudaStream_t stream) {
  WEFT_CUDA_CHECK(cudaMemcpyAsync(host, device, std::size_t(count) * sizeof(std::int64_t),
                                  cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(cudaEventRecord(ready, stream));
}

// One side of a row all-to-all: rows (of embedding_dim floats) to or from each peer.
struct RowExchange {
  float* rows;
  const std::vector<std::int64_t>& counts;   // rows per peer
  const std::vector<std::int64_t>& offsets;  // first row of each peer
};

// The all-to-all of embedding rows on the output-dist comm stream, ordered after the work queued
// so far on the task's stream (through `queued`); `done` is recorded on the comm stream after it
// for whoever joins it. Records the collective with the bytes this rank sends.
void exchange_rows_on_comm_stream(const BodyArgs& args, cudaStream_t comm_stream,
                                  cudaEvent_t queued, cudaEvent_t done, const RowExchange& send,
                                  const RowExchange& recv, const char* collective,
                                  std::int64_t num_rows_sent) {
  HstuRankState* s = args.s;
  const int dim = args.dim;
  WEFT_CUDA_CHECK(cudaEventRecord(queued, args.stream));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, queued, 0));
  all_to_all(send.rows, send.counts, send.offsets, recv.rows, recv.counts, recv.offsets, dim,
             ncclFloat, 4, s->output_comm, comm_stream);
  args.c.record_collective(collective, "output_dist_comm",
                           std::size_t(num_rows_sent) * std::size_t(dim) * 4);
  WEFT_CUDA_CHECK(cudaEventRecord(done, comm_stream));
}

void h2d(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  const auto& host = c.get<HostBatchView>("batch_cpu");
  pipeline::wait_event(c, b.released);  // the set's previous batch is done with it
  WEFT_CUDA_CHECK(cudaMemcpyAsync(b.lengths, host.lengths, std::size_t(B) * sizeof(std::int64_t),
                                  cudaMemcpyHostToDevice, stream));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(b.ids, host.ids,
                                  std::size_t(host.num_tokens) * sizeof(std::int64_t),
                                  cudaMemcpyHostToDevice, stream));
  c.set("batch_gpu", &b);
  c.set("ctx", &b);
}

// Workload of a sample = its token count (the per-token model's cost).
void start_shuffle(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  WEFT_NCCL_CHECK(
      ncclAllGather(b.lengths, b.all_workloads, std::size_t(B), ncclInt64, s->input_comm, stream));
  c.record_collective("AllGather (workloads)", "memcpy", std::size_t(B) * 8);
  start_read_back(b.all_workloads, b.host_workloads, W * B, b.workloads_ready, stream);
  c.set("shuffle_handle", &b);
}

void finish_shuffle(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
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
  WEFT_NCCL_CHECK(
      ncclAllGather(b.lengths, b.all_lengths, std::size_t(B), ncclInt64, s->input_comm, stream));
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
  launch_select_samples({.all_lengths = b.all_lengths,
                         .all_ids = b.all_ids,
                         .plan = b.plan,
                         .num_samples = B,
                         .out_lengths = b.sh_lengths,
                         .out_ids = b.sh_ids},
                        stream);
  c.set("shuffled_batch", &b);
}

void start_input_dist(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  launch_partition_by_owner({.ids = b.sh_ids,
                             .lengths = b.sh_lengths,
                             .num_tokens = b.num_sh_tokens,
                             .num_samples = B,
                             .world_size = W,
                             .send_counts = b.counts,
                             .send_lengths = b.send_lengths,
                             .send_ids = b.send_ids,
                             .position = b.position},
                            stream);
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
  const std::vector<std::int64_t> peers = peer_indices(W);
  all_to_all(b.counts, ones, peers, b.counts + W, ones, peers, 1, ncclInt64, 8, s->input_comm,
             stream);
  c.record_collective("SendRecv (a2a splits)", "data_dist", std::size_t(W) * 8);
  start_read_back(b.counts, b.host_counts, 2 * W, b.counts_ready, stream);
  c.set("dist_request", &b);
}

void wait_input_dist(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  WEFT_CUDA_CHECK(cudaEventSynchronize(b.counts_ready));
  b.send_counts.assign(b.host_counts, b.host_counts + W);
  b.recv_counts.assign(b.host_counts + W, b.host_counts + 2 * W);
  b.send_offsets = exclusive_offsets(b.send_counts);
  b.recv_offsets = exclusive_offsets(b.recv_counts);
  b.num_recv = b.recv_offsets.back() + b.recv_counts.back();
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
  const std::vector<std::int64_t> peers = peer_indices(W);
  all_to_all(b.send_lengths, ones, peers, b.recv_lengths, ones, peers, B, ncclInt64, 8,
             s->input_comm, stream);
  c.record_collective("SendRecv (a2a lengths)", "data_dist", std::size_t(W) * std::size_t(B) * 8);
  all_to_all(b.send_ids, b.send_counts, b.send_offsets, b.recv_ids, b.recv_counts, b.recv_offsets,
             1, ncclInt64, 8, s->input_comm, stream);
  c.record_collective("SendRecv (a2a values)", "data_dist", std::size_t(b.num_sh_tokens) * 8);
  launch_check_lengths({.recv_lengths = b.recv_lengths,
                        .recv_counts = b.counts + W,
                        .world_size = W,
                        .num_samples = B,
                        .rank = rank,
                        .error = s->error.device_record()},
                       stream);
}

void prefetch_embeddings(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  // The table as updated by batch <= i - 2 (see the header's contract).
  pipeline::wait_event(c, s->table_updated);
  launch_prefetch({.recv_ids = b.recv_ids,
                   .num_ids = b.num_recv,
                   .world_size = W,
                   .rank = rank,
                   .key_bits = s->key_bits,
                   .dim = dim,
                   .table = s->table,
                   .num_local_rows = s->config.num_local_rows(),
                   .temp = b.temp,
                   .temp_bytes = b.temp_bytes,
                   .arrival = b.arrival,
                   .sorted_ids = b.sorted_ids,
                   .sorted_arrival = b.sorted_arrival,
                   .distinct_rank = b.distinct_rank,
                   .inverse = b.inverse,
                   .cache = b.cache,
                   .error = s->error.device_record()},
                  stream);
}

void zero_grad(const BodyArgs& args) { args.s->mlp.zero_grads(args.stream); }

void global_tokens_allreduce(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  launch_count_tokens({.lengths = b.lengths, .num_samples = B, .out = s->token_count}, stream);
  WEFT_NCCL_CHECK(
      ncclAllReduce(s->token_count, s->global_tokens, 1, ncclFloat, ncclSum, s->comm, stream));
  c.record_collective("AllReduce (global tokens)", "default", 4);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(s->tokens_history + c.batch_index(), s->global_tokens,
                                  sizeof(float), cudaMemcpyDeviceToDevice, stream));
  c.set("global_tokens", s->global_tokens);
}

void compute_output_dist(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  const cudaStream_t comm_stream = pipeline::cuda_stream(c, "output_dist_comm");
  launch_lookup({.cache = b.cache,
                 .inverse = b.inverse,
                 .num_rows = b.num_recv,
                 .dim = dim,
                 .rows = s->send_rows},
                stream);
  // Owner side answers what each peer asked for; the rows come back in send order.
  exchange_rows_on_comm_stream(
      args, comm_stream, s->cod_in, s->cod_out, {s->send_rows, b.recv_counts, b.recv_offsets},
      {s->recv_rows, b.send_counts, b.send_offsets}, "SendRecv (a2a embedding fwd)", b.num_recv);
  s->mark(c.batch_index(), kMarkCodJoinBegin, stream);
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s->cod_out, 0));
  s->mark(c.batch_index(), kMarkCodJoinEnd, stream);
}

void forward(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  launch_gather_rows({.rows = s->recv_rows,
                      .position = b.position,
                      .num_tokens = b.num_sh_tokens,
                      .dim = dim,
                      .x = s->x0},
                     stream);
  s->mlp.forward(s->x0, b.num_sh_tokens, s->prediction, stream);
  launch_loss_forward({.prediction = s->prediction,
                       .ids = b.sh_ids,
                       .target = s->target,
                       .num_tokens = b.num_sh_tokens,
                       .diff = s->diff,
                       .loss_sum = s->loss_sum},
                      stream);
  c.set("losses", s->loss_sum);
  c.set("output", s->prediction);
}

void backward(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  const cudaStream_t comm_stream = pipeline::cuda_stream(c, "output_dist_comm");
  launch_loss_backward({.diff = s->diff,
                        .loss_sum = s->loss_sum,
                        .global_tokens = s->global_tokens,
                        .num_tokens = b.num_sh_tokens,
                        .d_prediction = s->d_prediction,
                        .loss_out = s->loss_history + c.batch_index()},
                       stream);
  s->mlp.backward(s->x0, s->d_prediction, b.num_sh_tokens, s->d_x0, stream);
  launch_scatter_rows({.grad = s->d_x0,
                       .position = b.position,
                       .num_tokens = b.num_sh_tokens,
                       .dim = dim,
                       .rows = s->grad_send},
                      stream);
  // Joined where the gradient rows are consumed (optimizer_step's embedding update), not here:
  // the all-to-all then runs under finalize_model_grads and the dense update.
  exchange_rows_on_comm_stream(args, comm_stream, s->bwd_in, s->bwd_out,
                               {s->grad_send, b.send_counts, b.send_offsets},
                               {s->grad_recv, b.recv_counts, b.recv_offsets},
                               "SendRecv (a2a embedding bwd)", b.num_sh_tokens);
}

void finalize_model_grads(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  for (int k : {1, 2}) {
    const GradientBucket bucket = s->mlp.bucket(k);
    WEFT_NCCL_CHECK(ncclAllReduce(bucket.data, bucket.data, std::size_t(bucket.num_elements),
                                  ncclFloat, ncclSum, s->comm, stream));
    c.record_collective(k == 1 ? "AllReduce (grad bucket 1)" : "AllReduce (grad bucket 2)",
                        "default", std::size_t(bucket.num_elements) * 4);
  }
}

void optimizer_step(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  s->mlp.sgd(s->config.dense_lr, stream);
  s->mark(c.batch_index(), kMarkBwdJoinBegin, stream);
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s->bwd_out, 0));  // backward's gradient a2a
  s->mark(c.batch_index(), kMarkBwdJoinEnd, stream);
  launch_embedding_sgd({.sorted_ids = b.sorted_ids,
                        .sorted_arrival = b.sorted_arrival,
                        .num_ids = b.num_recv,
                        .grad_rows = s->grad_recv,
                        .world_size = W,
                        .dim = dim,
                        .lr = s->config.embedding_lr,
                        .table = s->table},
                       stream);
  WEFT_CUDA_CHECK(cudaEventRecord(s->table_updated, stream));
  c.set("step_result", s->loss_history + c.batch_index());
}

// Releases the batch's buffers and surfaces device-side errors (read without blocking).
void watchdog(const BodyArgs& args) {
  [[maybe_unused]] const auto& [s, b, stream, c, B, W, dim, rank] = args;
  WEFT_CUDA_CHECK(cudaEventRecord(b.released, pipeline::cuda_stream(c)));
  s->error.throw_if_raised(describe_device_error);
}

// `body` as a TaskBody over the rank's state.
pipeline::TaskBody bind_body(HstuRankState* s, Body body) {
  return [s, body](TaskContext& c) {
    const HstuConfig& config = s->config;
    body({s, s->set_of(c.batch_index()), pipeline::cuda_stream(c), c, config.local_batch,
          config.world_size, config.embedding_dim, config.rank});
  };
}

// Records the task's begin and end marks on the default stream around `body` (step timings).
pipeline::TaskBody marked_on_default(HstuRankState* s, std::string_view name,
                                     pipeline::TaskBody body) {
  const int index = default_task_index(name);
  return [s, index, body = std::move(body)](TaskContext& c) {
    const cudaStream_t stream = pipeline::cuda_stream(c);
    s->mark(c.batch_index(), 2 * index, stream);
    body(c);
    s->mark(c.batch_index(), 2 * index + 1, stream);
  };
}

}  // namespace

std::map<std::string, pipeline::TaskBody, std::less<>> task_bodies(HstuRankState* s) {
  std::map<std::string, pipeline::TaskBody, std::less<>> bodies = {
      {"h2d", bind_body(s, &h2d)},
      {"start_shuffle", bind_body(s, &start_shuffle)},
      {"finish_shuffle", bind_body(s, &finish_shuffle)},
      {"start_input_dist", bind_body(s, &start_input_dist)},
      {"wait_input_dist", bind_body(s, &wait_input_dist)},
      {"prefetch_embeddings", bind_body(s, &prefetch_embeddings)},
      {"zero_grad", bind_body(s, &zero_grad)},
      {"global_tokens_allreduce", bind_body(s, &global_tokens_allreduce)},
      {"compute_output_dist", bind_body(s, &compute_output_dist)},
      {"forward", bind_body(s, &forward)},
      {"backward", bind_body(s, &backward)},
      {"finalize_model_grads", bind_body(s, &finalize_model_grads)},
      {"optimizer_step", bind_body(s, &optimizer_step)},
      {"watchdog", bind_body(s, &watchdog)},
  };
  for (std::string_view name : kDefaultTasks) {
    auto& body = bodies.find(name)->second;
    body = marked_on_default(s, name, std::move(body));
  }
  return bodies;
}

}  // namespace weft::hstu::detail
