#include "weft/hstu/data.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"

namespace weft::hstu {

void HstuConfig::validate() const {
  WEFT_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "hstu: rank ", rank,
             " of world ", world_size);
  WEFT_CHECK(local_batch >= 1, "hstu: local_batch must be >= 1");
  WEFT_CHECK(max_seq_len >= 1, "hstu: max_seq_len must be >= 1");
  WEFT_CHECK(zipf_alpha > 0, "hstu: zipf_alpha must be > 0");
  WEFT_CHECK(embedding_dim >= 128 && embedding_dim % 128 == 0,
             "hstu: embedding_dim must be a multiple of 128, got ", embedding_dim);
  WEFT_CHECK(num_items >= world_size, "hstu: num_items must be >= world_size");
  WEFT_CHECK(num_layers >= 1 && hidden >= 8 && hidden % 8 == 0,
             "hstu: num_layers >= 1 and hidden a multiple of 8");
  WEFT_CHECK(bucket_split_layer >= 1 && bucket_split_layer <= num_layers,
             "hstu: bucket_split_layer must be in [1, num_layers]");
}

std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double uniform(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t c) noexcept {
  const std::uint64_t h = mix64(mix64(mix64(mix64(seed) ^ a) ^ b) ^ c);
  return double(h >> 11) * 0x1.0p-53;
}

ZipfSampler::ZipfSampler(double alpha, int max_value) {
  WEFT_CHECK(max_value >= 1, "ZipfSampler: max_value must be >= 1");
  cdf_.resize(std::size_t(max_value));
  double total = 0, weighted = 0;
  for (int k = 1; k <= max_value; ++k) {
    const double p = std::pow(double(k), -alpha);
    total += p;
    weighted += p * k;
    cdf_[std::size_t(k - 1)] = total;
  }
  for (double& c : cdf_) c /= total;
  cdf_.back() = 1.0;
  mean_ = weighted / total;
}

int ZipfSampler::sample(double u) const {
  return int(std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin()) + 1;
}

namespace {
// Key spaces of uniform(): keep the streams of different uses apart.
enum : std::uint64_t { kKeyLength = 1, kKeyItem = 2, kKeyEmbedding = 3, kKeyTarget = 4, kKeyWeight = 5 };
}  // namespace

std::int64_t generate_batch(const HstuConfig& config, const ZipfSampler& zipf, int rank,
                            std::int64_t batch_index, std::int64_t* lengths, std::int64_t* ids) {
  const std::uint64_t stream = (std::uint64_t(batch_index) << 20) ^ std::uint64_t(rank);
  std::int64_t num_tokens = 0;
  for (int s = 0; s < config.local_batch; ++s) {
    const int length = zipf.sample(uniform(config.seed, kKeyLength, stream, std::uint64_t(s)));
    lengths[s] = length;
    for (int t = 0; t < length; ++t) {
      const double u = uniform(config.seed, kKeyItem, stream,
                               (std::uint64_t(s) << 32) | std::uint64_t(t));
      const auto id = std::int64_t(double(config.num_items) * u * u * u * u);
      ids[num_tokens++] = std::min<std::int64_t>(id, config.num_items - 1);
    }
  }
  return num_tokens;
}

HostDataset::HostDataset(const HstuConfig& config, std::int64_t num_batches)
    : local_batch_(config.local_batch) {
  WEFT_CHECK(num_batches >= 1, "HostDataset: num_batches must be >= 1");
  const ZipfSampler zipf(config.zipf_alpha, config.max_seq_len);
  // Generate into pageable memory first (the total is known only afterwards), then pin.
  std::vector<std::int64_t> lengths(std::size_t(num_batches * local_batch_));
  std::vector<std::int64_t> ids;
  std::vector<std::int64_t> scratch(std::size_t(config.max_local_tokens()));
  offsets_.push_back(0);
  for (std::int64_t b = 0; b < num_batches; ++b) {
    const std::int64_t n = generate_batch(config, zipf, config.rank, b,
                                          lengths.data() + b * local_batch_, scratch.data());
    ids.insert(ids.end(), scratch.begin(), scratch.begin() + n);
    offsets_.push_back(offsets_.back() + n);
  }
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaHostAlloc(&p, lengths.size() * sizeof(std::int64_t), cudaHostAllocDefault));
  lengths_ = static_cast<std::int64_t*>(p);
  std::copy(lengths.begin(), lengths.end(), lengths_);
  try {
    WEFT_CUDA_CHECK(cudaHostAlloc(&p, ids.size() * sizeof(std::int64_t), cudaHostAllocDefault));
  } catch (...) {
    cudaFreeHost(lengths_);
    throw;
  }
  ids_ = static_cast<std::int64_t*>(p);
  std::copy(ids.begin(), ids.end(), ids_);
}

HostDataset::~HostDataset() {
  cudaFreeHost(ids_);
  cudaFreeHost(lengths_);
}

HostBatchView HostDataset::batch(std::int64_t index) const {
  WEFT_CHECK(index >= 0 && index < num_batches(), "HostDataset: batch ", index, " of ",
             num_batches());
  const auto i = std::size_t(index);
  return {.index = index,
          .lengths = lengths_ + index * local_batch_,
          .ids = ids_ + offsets_[i],
          .num_tokens = offsets_[i + 1] - offsets_[i]};
}

std::vector<std::vector<int>> balanced_partition(std::span<const std::int64_t> workloads,
                                                 int world_size, int per_rank) {
  WEFT_CHECK(world_size >= 1 && per_rank >= 1 &&
                 workloads.size() == std::size_t(world_size) * std::size_t(per_rank),
             "balanced_partition: ", workloads.size(), " workloads for ", world_size, " x ",
             per_rank);
  std::vector<int> order(workloads.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return workloads[std::size_t(a)] > workloads[std::size_t(b)]; });
  std::vector<std::vector<int>> parts(static_cast<std::size_t>(world_size));
  std::vector<std::int64_t> load(std::size_t(world_size), 0);
  for (const int sample : order) {
    int best = -1;
    for (int r = 0; r < world_size; ++r) {
      if (int(parts[std::size_t(r)].size()) == per_rank) continue;
      if (best < 0 || load[std::size_t(r)] < load[std::size_t(best)]) best = r;
    }
    parts[std::size_t(best)].push_back(sample);
    load[std::size_t(best)] += workloads[std::size_t(sample)];
  }
  for (auto& p : parts) std::sort(p.begin(), p.end());
  return parts;
}

float initial_embedding_value(std::uint64_t seed, std::int64_t id, int k) noexcept {
  return float(2.0 * uniform(seed, kKeyEmbedding, std::uint64_t(id), std::uint64_t(k)) - 1.0);
}

float target_value(const HstuConfig& config, std::int64_t id) {
  double dot = 0;
  for (int k = 0; k < config.embedding_dim; ++k) {
    const double w = 2.0 * uniform(config.seed, kKeyTarget, 0, std::uint64_t(k)) - 1.0;
    dot += double(initial_embedding_value(config.seed, id, k)) * w;
  }
  // <e0, w*> has variance dim / 9 (two independent U[-1,1)); scale it to about 1 before tanh.
  return float(std::tanh(3.0 * dot / std::sqrt(double(config.embedding_dim))));
}

float initial_weight(const HstuConfig& config, int layer, int fan_in, std::int64_t i,
                     std::int64_t j) noexcept {
  // He-uniform: U[-b, b) with b = sqrt(6 / fan_in) keeps the ReLU activations' scale.
  double bound = std::sqrt(6.0 / fan_in);
  if (layer == config.num_layers) bound *= 0.1;  // the head
  const double u = uniform(config.seed, kKeyWeight, std::uint64_t(layer),
                           (std::uint64_t(i) << 32) | std::uint64_t(j));
  return float((2.0 * u - 1.0) * bound);
}

}  // namespace weft::hstu
