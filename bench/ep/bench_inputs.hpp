// The EP benchmarks' inputs, the same for weft-ep-bench and weft-ep-overlap-bench.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "device_buffer.hpp"
#include "weft/ep/reference.hpp"

namespace weft::ep::bench {

// num_tokens tokens on each of num_ranks ranks: every payload element names its (rank, token,
// column) (reference::identity_bf16); each token selects top_k distinct uniform experts (a
// router's top-k), each selection masked (-1) with probability mask_ratio; weights uniform in
// [0, 1).
inline std::vector<reference::RankInput> make_inputs(const BufferConfig& config, int num_ranks,
                                                     int64_t num_tokens, double mask_ratio,
                                                     std::mt19937& rng) {
  const int64_t H = config.hidden;
  const int E = config.num_experts, K = config.top_k;
  std::vector<reference::RankInput> inputs(static_cast<std::size_t>(num_ranks));
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  std::vector<int> experts(static_cast<std::size_t>(E));
  for (int r = 0; r < num_ranks; ++r) {
    auto& in = inputs[std::size_t(r)];
    in.num_tokens = num_tokens;
    in.x.resize(std::size_t(num_tokens * H));
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t h = 0; h < H; ++h) in.x[std::size_t(t * H + h)] = reference::identity_bf16(r, t, h);
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int e = 0; e < E; ++e) experts[std::size_t(e)] = e;
      for (int k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct experts
        std::swap(experts[std::size_t(k)], experts[std::size_t(k + int(rng() % uint32_t(E - k)))]);
        in.topk_idx.push_back(uni(rng) < mask_ratio ? -1 : experts[std::size_t(k)]);
        in.topk_weights.push_back(uni(rng));
      }
    }
  }
  return inputs;
}

// One rank's x [T, hidden] bf16, topk_idx [T, top_k] int64 and topk_weights [T, top_k] fp32 in
// new allocations on the current device.
struct DeviceInputs {
  DeviceBuffer x;
  DeviceBuffer idx;
  DeviceBuffer w;
};
inline DeviceInputs upload_inputs(const reference::RankInput& in, int64_t hidden, int top_k) {
  const auto T = std::size_t(in.num_tokens);
  const std::size_t x_bytes = T * std::size_t(hidden) * 2, idx_bytes = T * std::size_t(top_k) * 8,
                    w_bytes = T * std::size_t(top_k) * 4;
  return {upload(in.x.data(), x_bytes), upload(in.topk_idx.data(), idx_bytes),
          upload(in.topk_weights.data(), w_bytes)};
}

}  // namespace weft::ep::bench
