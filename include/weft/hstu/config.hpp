// weft::hstu::HstuConfig: the shape of the HSTU-style training step weft runs on real GPUs
// (docs/hstu.md). Defaults are the HSTU benchmark's (balanced_ranking_benchmark.gin): local batch
// 32, sequence lengths Zipf(1.2) up to 4096, item embedding dim 128, 10 dense layers of 1024.
//
//   weft::hstu::HstuConfig config{.world_size = 2, .rank = 0};
//   config.validate();   // throws weft::Error naming the bad field
#pragma once

#include <cstdint>

namespace weft::hstu {

struct HstuConfig {
  int world_size = 1;            // ranks of the step, >= 1
  int rank = 0;                  // this rank, in [0, world_size)
  int local_batch = 32;          // samples per rank per step, before and after the shuffle
  int max_seq_len = 4096;        // Zipf lengths are drawn from [1, max_seq_len]
  double zipf_alpha = 1.2;       // the length distribution's exponent, > 0
  int embedding_dim = 128;       // must be a multiple of 128 (one warp of float4 per row)
  std::int64_t num_items = 1 << 16;  // item ids in [0, num_items); row-wise sharded by id % world
  int num_layers = 10;           // dense layers (ReLU) of width `hidden`, then a 1-wide head
  int hidden = 1024;             // multiple of 8 (tensor-core GEMMs)
  // Gradient AllReduce buckets: bucket 1 holds layers [bucket_split_layer, num_layers] (and the
  // head), the last to get gradients; bucket 2 layers [0, bucket_split_layer).
  int bucket_split_layer = 3;
  float dense_lr = 0.02f;        // SGD step of the dense layers (master fp32 weights)
  float embedding_lr = 2.0f;     // SGD step of the embedding rows
  std::uint64_t seed = 1;        // data, initial parameters and target all derive from it
  // One NCCL communicator per role (split from the given one): the default stream's AllReduces,
  // the input pipeline (shuffle, input distribution), the embedding all-to-alls. NCCL runs the
  // operations of one communicator one after another whatever their streams, so with a single
  // communicator the input pipeline's tiny AllGathers queue behind the gradient AllReduce and
  // nothing communicates concurrently. false: everything on the given communicator.
  bool communicator_per_role = true;

  // Upper bounds the device buffers are sized for.
  std::int64_t max_local_tokens() const noexcept {
    return std::int64_t(local_batch) * max_seq_len;
  }
  std::int64_t max_global_tokens() const noexcept { return max_local_tokens() * world_size; }
  std::int64_t num_local_rows() const noexcept {
    return (num_items - rank + world_size - 1) / world_size;
  }

  void validate() const;
};

}  // namespace weft::hstu
