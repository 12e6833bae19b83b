// Host side of the HSTU step: the jagged batch generator, the balanced shuffle's partition, the
// synthetic learnable target and the deterministic parameter initialisation.
//
// Everything is a pure function of (seed, rank, batch index, ...): the same seed gives the same
// data on every run, every variant and every thread map (the bit-identity tests rely on it).
//
//   HostDataset data(config, num_steps);          // pinned, generated once
//   HostBatchView b = data.batch(step);            // lengths[local_batch], ids[num_tokens]
//   auto parts = balanced_partition(all_workloads, world_size, local_batch);
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weft/hstu/config.hpp"

namespace weft::hstu {

// splitmix64: a counter-based generator, so any value is addressable without a stream state.
std::uint64_t mix64(std::uint64_t x) noexcept;
// A uniform double in [0, 1) from the key (seed, a, b, c).
double uniform(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t c) noexcept;

// Zipf(alpha) over [1, max_value] by inverse CDF.
class ZipfSampler {
 public:
  ZipfSampler(double alpha, int max_value);
  int sample(double u) const;  // u in [0, 1)
  double mean() const noexcept { return mean_; }

 private:
  std::vector<double> cdf_;  // cdf_[k - 1] = P(value <= k)
  double mean_ = 0;
};

// One rank's batch as it comes from the data loader (host memory).
struct HostBatchView {
  std::int64_t index = 0;                 // the batch's index in the run, from 0
  const std::int64_t* lengths = nullptr;  // [local_batch]
  const std::int64_t* ids = nullptr;      // [num_tokens], sample after sample
  std::int64_t num_tokens = 0;            // sum of lengths, <= HstuConfig::max_local_tokens()
};

// Fills lengths[local_batch] and ids (capacity max_local_tokens); returns the number of tokens.
// Item ids are skewed (id = floor(num_items * u^4)), so popular items recur across steps.
std::int64_t generate_batch(const HstuConfig& config, const ZipfSampler& zipf, int rank,
                            std::int64_t batch_index, std::int64_t* lengths, std::int64_t* ids);

// All batches of one rank for a run, generated once into pinned host memory (cudaHostAlloc), so
// the copies to the device are asynchronous and the loader costs nothing inside the steps.
class HostDataset {
 public:
  HostDataset(const HstuConfig& config, std::int64_t num_batches);
  ~HostDataset();
  HostDataset(const HostDataset&) = delete;
  HostDataset& operator=(const HostDataset&) = delete;

  std::int64_t num_batches() const noexcept { return std::int64_t(offsets_.size()) - 1; }
  HostBatchView batch(std::int64_t index) const;

 private:
  int local_batch_;                  // samples per batch (HstuConfig::local_batch)
  std::int64_t* lengths_ = nullptr;  // [num_batches * local_batch]
  std::int64_t* ids_ = nullptr;      // all batches' ids back to back
  std::vector<std::int64_t> offsets_;  // batch b's ids are ids_[offsets_[b], offsets_[b + 1])
};

// The balanced shuffle's partition: `workloads` holds every sample of the step, rank-major
// (world_size * per_rank entries). Returns, per rank, exactly per_rank global sample indices in
// increasing order. Greedy longest-processing-time: samples by workload descending (index
// ascending on ties) go to the least-loaded rank with room (lowest rank on ties).
std::vector<std::vector<int>> balanced_partition(std::span<const std::int64_t> workloads,
                                                 int world_size, int per_rank);

// The learnable target of item `id`: tanh(<e0(id), w*> / sqrt(dim)) where e0 is the item's
// initial embedding (initial_embedding_value) and w* a fixed random direction; in (-1, 1).
float target_value(const HstuConfig& config, std::int64_t id);
// Initial embedding of item `id`, component k: uniform in [-1, 1).
float initial_embedding_value(std::uint64_t seed, std::int64_t id, int k) noexcept;
// Initial weight w[i][j] of dense layer `layer` (fan_in rows): He-uniform for the ReLU layers,
// 0.1 x that for the head, so the first losses are near E[target^2].
float initial_weight(const HstuConfig& config, int layer, int fan_in, std::int64_t i,
                     std::int64_t j) noexcept;

}  // namespace weft::hstu
