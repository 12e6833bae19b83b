// An EP dispatch/combine round trip at one rank: 64 tokens of hidden 256 (bf16), each sent to two
// of 8 experts (all local at one rank), dispatched, "computed" by the identity, and combined back.
// The deduplicated layout receives one row per (token, rank), so combine returns every token as
// it was sent. Needs one GPU; exits 77 (ctest's skip code here) without one.
//
//   examples/cpp/weft_example_ep_round_trip
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"

using weft::ep::DType;

// A device copy of a host vector, freed when it goes out of scope.
template <typename T>
std::unique_ptr<void, cudaError_t (*)(void*)> to_device(const std::vector<T>& host) {
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&p, host.size() * sizeof(T)));
  std::unique_ptr<void, cudaError_t (*)(void*)> owned(p, cudaFree);
  WEFT_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return owned;
}

int main() try {
  int num_gpus = 0;
  if (cudaGetDeviceCount(&num_gpus) != cudaSuccess || num_gpus < 1) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  constexpr int64_t kTokens = 64, kHidden = 256;
  constexpr int kExperts = 8, kTopK = 2;
  std::vector<uint16_t> x(kTokens * kHidden);  // bf16 bits: 1.0, 1.0078, ... (distinct rows)
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = uint16_t(0x3f80 + (i / kHidden + i) % 128);
  std::vector<int32_t> idx;  // token t goes to experts t % 8 and (t + 3) % 8
  for (int t = 0; t < kTokens; ++t) idx.insert(idx.end(), {t % kExperts, (t + 3) % kExperts});
  const std::vector<float> weights(kTokens * kTopK, 0.5f);
  auto d_x = to_device(x), d_idx = to_device(idx), d_w = to_device(weights);
  auto d_out = to_device(std::vector<uint16_t>(x.size()));

  auto eps = weft::ep::Buffer::create_local(
      1, {.max_tokens = kTokens, .hidden = kHidden, .num_experts = kExperts, .top_k = kTopK});
  weft::ep::Buffer& ep = *eps[0];
  cudaStream_t stream = nullptr;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto recv = ep.dispatch({.x = {d_x.get(), DType::kBFloat16, kTokens, kHidden},
                           .topk_idx = {d_idx.get(), DType::kInt32, kTokens, kTopK},
                           .topk_weights = {d_w.get(), DType::kFloat32, kTokens, kTopK}},
                          stream, weft::ep::CountMode::kExact);
  const int64_t num_recv = ep.wait_num_recv(recv);  // the one host wait
  // The experts would read recv.recv_x[0, num_recv) here; the identity passes it on.
  ep.combine({.expert_out = {recv.recv_x, DType::kBFloat16, num_recv, kHidden}}, recv.handle,
             d_out.get(), stream);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  ep.check();

  std::vector<uint16_t> out(x.size());
  WEFT_CUDA_CHECK(cudaMemcpy(out.data(), d_out.get(), out.size() * 2, cudaMemcpyDeviceToHost));
  int64_t num_wrong = 0;
  for (std::size_t i = 0; i < x.size(); ++i) num_wrong += out[i] != x[i];
  std::printf("received %lld rows, combined %lld tokens, %lld wrong elements\n",
              (long long)num_recv, (long long)kTokens, (long long)num_wrong);
  WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return num_recv == kTokens && num_wrong == 0 ? 0 : 1;
} catch (const weft::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
