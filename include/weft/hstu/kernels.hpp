// The HSTU step's CUDA kernels (src/hstu/kernels.cu). Each takes a params struct of raw device
// pointers and a stream, enqueues its work and returns; none synchronises. Every reduction is in
// a fixed order (no floating-point atomics), so results are bit-identical run to run: the engine
// may change when work runs, never what it computes.
//
// Layouts: ids are int64 item ids; embedding rows are `dim` floats (dim a multiple of 128, one
// warp per row, float4 per lane); activations are row-major [tokens, width] bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "weft/cuda/device_error.hpp"

namespace weft::hstu {

// Device error codes (DeviceErrorRecord::code) raised by these kernels.
enum HstuDeviceError : std::uint32_t {
  kErrorForeignId = 1,      // args: id, world_size, rank: an id this rank does not own
  kErrorLengthMismatch = 2  // args: peer, sum of its lengths, its value count
};

// out[0] = float(sum of lengths[0, num_samples)), summed as integers.
struct CountTokensParams {
  const std::int64_t* lengths;  // [num_samples]
  int num_samples;              // >= 0
  float* out;                   // [1], device
};
void launch_count_tokens(const CountTokensParams& p, cudaStream_t stream);

// The balanced shuffle's local selection: for each selected sample j, plan[3j..3j+2] = (global
// sample index, offset of its ids in all_ids, offset in out_ids). Copies its length and ids.
struct SelectSamplesParams {
  const std::int64_t* all_lengths;  // [world * local_batch], gathered
  const std::int64_t* all_ids;      // gathered values
  const std::int64_t* plan;         // [num_samples * 3], on the device
  int num_samples;                  // samples this rank selects
  std::int64_t* out_lengths;        // [num_samples]
  std::int64_t* out_ids;            // the selected samples' ids, sample after sample
};
void launch_select_samples(const SelectSamplesParams& p, cudaStream_t stream);

// Input distribution's send side: groups the tokens by owner rank (id % world_size), keeping the
// token order within each owner. send_lengths[d * num_samples + s] = tokens of sample s owned by
// d; send_counts[d] = all tokens owned by d; send_ids = the ids grouped by owner; position[t] =
// where token t went in send_ids (and, later, where its embedding row comes back).
struct PartitionParams {
  const std::int64_t* ids;      // [num_tokens]
  const std::int64_t* lengths;  // [num_samples]
  std::int64_t num_tokens;      // sum of lengths
  int num_samples;              // <= 1024
  int world_size;               // owners, >= 1
  std::int64_t* send_counts;    // [world_size]
  std::int64_t* send_lengths;   // [world_size * num_samples]
  std::int64_t* send_ids;       // [num_tokens]
  std::int64_t* position;       // [num_tokens]
};
void launch_partition_by_owner(const PartitionParams& p, cudaStream_t stream);

// Checks the two input-distribution all-to-alls against each other: the lengths each peer sent
// must add up to the number of ids it sent (kErrorLengthMismatch otherwise).
struct CheckLengthsParams {
  const std::int64_t* recv_lengths;  // [world_size * num_samples]
  const std::int64_t* recv_counts;   // [world_size]
  int world_size;                    // peers, this rank included
  int num_samples;                   // samples per peer in recv_lengths
  int rank;                          // this rank, named in the error
  cuda::DeviceErrorRecord* error;    // where kErrorLengthMismatch is raised
};
void launch_check_lengths(const CheckLengthsParams& p, cudaStream_t stream);

// Embedding-cache prefetch (owner side): sorts the received ids (stable radix sort, so equal ids
// keep their arrival order), numbers the distinct ids u = 0..U-1 in sorted order, writes
// inverse[k] = u of received id k, and gathers cache[u] = table row of distinct id u.
// Local row of id = id / world_size; an id with id % world_size != rank raises kErrorForeignId.
struct PrefetchParams {
  const std::int64_t* recv_ids;    // [num_ids]
  std::int64_t num_ids;            // ids received from every peer
  int world_size;                  // ranks the table is sharded over
  int rank;                        // this rank: owns the ids with id % world_size == rank
  int key_bits;                    // ids < 2^key_bits
  int dim;                         // floats per row, a multiple of 128
  const float* table;              // [num_local_rows, dim]
  std::int64_t num_local_rows;     // rows of this rank's shard
  void* temp;                      // temp_bytes bytes of scratch
  std::size_t temp_bytes;          // >= prefetch_temp_bytes(num_ids, key_bits)
  std::int32_t* arrival;           // [num_ids] scratch: 0..num_ids-1
  std::int64_t* sorted_ids;        // [num_ids]
  std::int32_t* sorted_arrival;    // [num_ids]: received index of sorted position j
  std::int32_t* distinct_rank;     // [num_ids]: 1 + u of sorted position j
  std::int32_t* inverse;           // [num_ids]
  float* cache;                    // [num_ids, dim] (U rows used)
  cuda::DeviceErrorRecord* error;  // where kErrorForeignId is raised
};
std::size_t prefetch_temp_bytes(std::int64_t max_ids, int key_bits);
void launch_prefetch(const PrefetchParams& p, cudaStream_t stream);

// rows[k] = cache[inverse[k]] (the owner's answer to every received id).
struct LookupParams {
  const float* cache;           // [U, dim] (PrefetchParams::cache)
  const std::int32_t* inverse;  // [num_rows], each in [0, U)
  std::int64_t num_rows;        // received ids
  int dim;                      // floats per row, a multiple of 128
  float* rows;                  // [num_rows, dim]
};
void launch_lookup(const LookupParams& p, cudaStream_t stream);

// x[t] = bf16(rows[position[t]]): the embedding rows, back in token order.
struct GatherRowsParams {
  const float* rows;             // [num_tokens, dim], in send order
  const std::int64_t* position;  // [num_tokens] (PartitionParams::position)
  std::int64_t num_tokens;       // this rank's tokens
  int dim;                       // floats per row, a multiple of 128
  __nv_bfloat16* x;              // [num_tokens, dim]
};
void launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream);

// rows[position[t]] = grad[t]: the embedding gradients, in the order the owners sent the rows.
struct ScatterRowsParams {
  const float* grad;             // [num_tokens, dim], in token order
  const std::int64_t* position;  // [num_tokens] (PartitionParams::position)
  std::int64_t num_tokens;       // this rank's tokens
  int dim;                       // floats per row, a multiple of 128
  float* rows;                   // [num_tokens, dim], in send order
};
void launch_scatter_rows(const ScatterRowsParams& p, cudaStream_t stream);

// Sparse SGD on the owner's table: for every distinct id, the gradients of its occurrences are
// summed in sorted (= arrival) order, then table[row] -= lr * sum. Uses the prefetch's outputs.
struct EmbeddingSgdParams {
  const std::int64_t* sorted_ids;      // [num_ids] (PrefetchParams::sorted_ids)
  const std::int32_t* sorted_arrival;  // [num_ids] (PrefetchParams::sorted_arrival)
  std::int64_t num_ids;                // ids received
  const float* grad_rows;              // [num_ids, dim], in arrival order
  int world_size;                      // local row of an id = id / world_size
  int dim;                             // floats per row, a multiple of 128
  float lr;                            // the SGD step (HstuConfig::embedding_lr)
  float* table;                        // [num_local_rows, dim], updated in place
};
void launch_embedding_sgd(const EmbeddingSgdParams& p, cudaStream_t stream);

// x = max(x, 0) in place.
void launch_relu(__nv_bfloat16* x, std::int64_t n, cudaStream_t stream);
// grad *= (activation > 0), in place (activation is the ReLU output).
void launch_relu_backward(__nv_bfloat16* grad, const __nv_bfloat16* activation, std::int64_t n,
                          cudaStream_t stream);

// diff[t] = prediction[t] - target[ids[t]]; loss_sum[0] = sum of diff^2 (fixed-order reduction).
struct LossForwardParams {
  const float* prediction;  // [num_tokens]
  const std::int64_t* ids;  // [num_tokens]
  const float* target;      // [num_items]
  std::int64_t num_tokens;  // this rank's tokens
  float* diff;              // [num_tokens]
  float* loss_sum;          // [1], device
};
void launch_loss_forward(const LossForwardParams& p, cudaStream_t stream);

// The loss is sum(diff^2) / global_tokens: d_prediction[t] = bf16(2 diff[t] / global_tokens) and
// loss_out[0] = loss_sum / global_tokens (this rank's share of the global loss).
struct LossBackwardParams {
  const float* diff;            // [num_tokens] (LossForwardParams::diff)
  const float* loss_sum;        // [1] (LossForwardParams::loss_sum)
  const float* global_tokens;   // [1]: tokens of every rank, summed
  std::int64_t num_tokens;      // this rank's tokens
  __nv_bfloat16* d_prediction;  // [num_tokens]
  float* loss_out;              // [1], device
};
void launch_loss_backward(const LossBackwardParams& p, cudaStream_t stream);

// master -= lr * grad; weights = bf16(master).
struct SgdParams {
  float* master;           // [n] fp32 weights, updated in place
  const float* grad;       // [n]
  std::int64_t n;          // elements of each array
  float lr;                // the SGD step
  __nv_bfloat16* weights;  // [n], the bf16 copy the GEMMs read
};
void launch_sgd(const SgdParams& p, cudaStream_t stream);

}  // namespace weft::hstu
