// weft::hstu::DenseMlp: the HSTU step's dense model, a per-token MLP of `num_layers` ReLU layers
// of width `hidden` and a 1-wide head, on cuBLAS (bf16 inputs, fp32 accumulation and fp32 weight
// gradients). fp32 master weights, bf16 copies for the GEMMs, SGD.
//
// Contracts:
//  - one cuBLAS handle with a fixed workspace, so a given shape always runs the same algorithm:
//    results are bit-identical run to run and whatever stream the calls go to;
//  - backward() accumulates into the gradients (beta = 1): zero_grads() must run first each step;
//  - parameters, gradients and masters are contiguous, layer after layer (layer l is
//    [in_l, out_l] row-major), so the two gradient AllReduce buckets are two plain ranges.
//
//   DenseMlp mlp(config, config.max_local_tokens());
//   mlp.forward(x0, num_tokens, prediction, stream);
//   mlp.zero_grads(stream); mlp.backward(x0, d_prediction, num_tokens, d_x0, stream);
//   mlp.sgd(config.dense_lr, stream);
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "weft/hstu/config.hpp"

namespace weft::hstu {

struct GradientBucket {
  float* data;                // device fp32 gradients, contiguous
  std::int64_t num_elements;  // floats at data
};

class DenseMlp {
 public:
  DenseMlp(const HstuConfig& config, std::int64_t max_tokens);
  ~DenseMlp();
  DenseMlp(const DenseMlp&) = delete;
  DenseMlp& operator=(const DenseMlp&) = delete;

  // Writes the initial parameters (initial_weight(), the same on every rank) and zero gradients.
  void init_parameters(cudaStream_t stream);

  // prediction[t] (fp32) for x0 [num_tokens, embedding_dim] bf16.
  void forward(const __nv_bfloat16* x0, std::int64_t num_tokens, float* prediction,
               cudaStream_t stream);
  // From d_prediction [num_tokens] bf16: accumulates the weight gradients and writes
  // d_x0 [num_tokens, embedding_dim] fp32. Uses the activations of the last forward().
  void backward(const __nv_bfloat16* x0, const __nv_bfloat16* d_prediction,
                std::int64_t num_tokens, float* d_x0, cudaStream_t stream);
  void zero_grads(cudaStream_t stream);
  void sgd(float lr, cudaStream_t stream);

  // Bucket 1: layers [bucket_split_layer, num_layers] (their gradients are ready first in
  // backward); bucket 2: layers [0, bucket_split_layer).
  GradientBucket bucket(int index) const;
  std::int64_t num_parameters() const noexcept { return offsets_.back(); }
  const float* master() const noexcept { return master_; }
  const float* grads() const noexcept { return grads_; }
  int num_layers() const noexcept { return int(in_.size()); }  // including the head
  int fan_in(int layer) const { return in_.at(std::size_t(layer)); }
  int fan_out(int layer) const { return out_.at(std::size_t(layer)); }

 private:
  void release() noexcept;
  void gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const void* a,
            int lda, const void* b, int ldb, void* c, cudaDataType c_type, int ldc, float beta,
            cudaStream_t stream);

  HstuConfig config_;
  std::int64_t max_tokens_;
  std::vector<int> in_, out_;
  std::vector<std::int64_t> offsets_;  // [layer] element offset; back() = total
  std::vector<float> initial_;         // host copy of the initial parameters
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  float* master_ = nullptr;
  float* grads_ = nullptr;
  __nv_bfloat16* weights_ = nullptr;
  std::vector<__nv_bfloat16*> activations_;  // [num_layers][max_tokens, hidden], post-ReLU
  __nv_bfloat16* grad_a_ = nullptr;          // [max_tokens, hidden] backward ping-pong
  __nv_bfloat16* grad_b_ = nullptr;
};

}  // namespace weft::hstu
