#include "weft/hstu/dense_mlp.hpp"

#include <utility>

#include "weft/cuda/cublas_check.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/hstu/data.hpp"
#include "weft/hstu/kernels.hpp"

namespace weft::hstu {
namespace {
constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;

template <typename T>
T* device_alloc(std::int64_t count) {
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&p, std::size_t(count) * sizeof(T)));
  return static_cast<T*>(p);
}
}  // namespace

DenseMlp::DenseMlp(const HstuConfig& config, std::int64_t max_tokens)
    : config_(config), max_tokens_(max_tokens) {
  config.validate();
  for (int l = 0; l < config.num_layers; ++l) {
    in_.push_back(l == 0 ? config.embedding_dim : config.hidden);
    out_.push_back(config.hidden);
  }
  in_.push_back(config.hidden);  // the head
  out_.push_back(1);
  offsets_.push_back(0);
  for (std::size_t l = 0; l < in_.size(); ++l) {
    offsets_.push_back(offsets_.back() + std::int64_t(in_[l]) * out_[l]);
  }
  initial_.resize(std::size_t(offsets_.back()));
  for (std::size_t l = 0; l < in_.size(); ++l) {
    for (std::int64_t i = 0; i < in_[l]; ++i) {
      for (std::int64_t j = 0; j < out_[l]; ++j) {
        initial_[std::size_t(offsets_[l] + i * out_[l] + j)] =
            initial_weight(config, int(l), in_[l], i, j);
      }
    }
  }
  try {
    WEFT_CUBLAS_CHECK(cublasCreate(&handle_));
    // Tensor-core math on bf16 inputs with fp32 accumulation; the algorithm cuBLAS picks for a
    // shape is fixed, so results are reproducible.
    WEFT_CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
    workspace_bytes_ = kWorkspaceBytes;
    WEFT_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    master_ = device_alloc<float>(num_parameters());
    grads_ = device_alloc<float>(num_parameters());
    weights_ = device_alloc<__nv_bfloat16>(num_parameters());
    for (int l = 0; l < config.num_layers; ++l) {
      activations_.push_back(device_alloc<__nv_bfloat16>(max_tokens * config.hidden));
    }
    grad_a_ = device_alloc<__nv_bfloat16>(max_tokens * config.hidden);
    grad_b_ = device_alloc<__nv_bfloat16>(max_tokens * config.hidden);
  } catch (...) {
    release();
    throw;
  }
}

DenseMlp::~DenseMlp() { release(); }

void DenseMlp::release() noexcept {
  for (void* p : {static_cast<void*>(grad_b_), static_cast<void*>(grad_a_),
                  static_cast<void*>(weights_), static_cast<void*>(grads_),
                  static_cast<void*>(master_), workspace_}) {
    if (p != nullptr) cudaFree(p);
  }
  for (auto* a : activations_) cudaFree(a);
  activations_.clear();
  grad_a_ = grad_b_ = weights_ = nullptr;
  grads_ = master_ = nullptr;
  workspace_ = nullptr;
  if (handle_ != nullptr) cublasDestroy(handle_);
  handle_ = nullptr;
}

void DenseMlp::init_parameters(cudaStream_t stream) {
  // A synchronous copy: the host vector is pageable and this runs once per run, outside steps.
  WEFT_CUDA_CHECK(cudaMemcpyAsync(master_, initial_.data(), initial_.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
  WEFT_CUDA_CHECK(cudaMemsetAsync(grads_, 0, initial_.size() * sizeof(float), stream));
  launch_sgd({.master = master_, .grad = grads_, .n = num_parameters(), .lr = 0.f,
              .weights = weights_}, stream);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DenseMlp::gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k,
                    const void* a, int lda, const void* b, int ldb, void* c, cudaDataType c_type,
                    int ldc, float beta, cudaStream_t stream) {
  const float alpha = 1.f;
  // cublasSetStream resets the workspace to cuBLAS's pool, so it is set again after every change.
  WEFT_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  WEFT_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, workspace_bytes_));
  WEFT_CUBLAS_CHECK(cublasGemmEx(handle_, op_a, op_b, m, n, k, &alpha, a, CUDA_R_16BF, lda, b,
                                 CUDA_R_16BF, ldb, &beta, c, c_type, ldc, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
}

// Row-major [rows, cols] is column-major [cols, rows]: every GEMM below is written on the
// column-major views, Y^T = W^T X^T and so on.
void DenseMlp::forward(const __nv_bfloat16* x0, std::int64_t num_tokens, float* prediction,
                       cudaStream_t stream) {
  WEFT_CHECK(num_tokens >= 0 && num_tokens <= max_tokens_, "DenseMlp: ", num_tokens,
             " tokens, sized for ", max_tokens_);
  if (num_tokens == 0) return;
  const int t = int(num_tokens);
  const __nv_bfloat16* x = x0;
  const int hidden_layers = config_.num_layers;
  for (int l = 0; l < hidden_layers; ++l) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, out_[l], t, in_[l], weights_ + offsets_[l], out_[l], x, in_[l],
         activations_[std::size_t(l)], CUDA_R_16BF, out_[l], 0.f, stream);
    launch_relu(activations_[std::size_t(l)], num_tokens * out_[l], stream);
    x = activations_[std::size_t(l)];
  }
  const int head = hidden_layers;
  gemm(CUBLAS_OP_N, CUBLAS_OP_N, 1, t, in_[head], weights_ + offsets_[head], 1, x, in_[head],
       prediction, CUDA_R_32F, 1, 0.f, stream);
}

void DenseMlp::backward(const __nv_bfloat16* x0, const __nv_bfloat16* d_prediction,
                        std::int64_t num_tokens, float* d_x0, cudaStream_t stream) {
  WEFT_CHECK(num_tokens >= 0 && num_tokens <= max_tokens_, "DenseMlp: ", num_tokens,
             " tokens, sized for ", max_tokens_);
  if (num_tokens == 0) return;
  const int t = int(num_tokens);
  const int head = config_.num_layers;
  const int hidden = config_.hidden;
  // Head: dW_head += H^T dp; dH = dp W_head^T.
  gemm(CUBLAS_OP_N, CUBLAS_OP_T, 1, hidden, t, d_prediction, 1, activations_[std::size_t(head - 1)],
       hidden, grads_ + offsets_[head], CUDA_R_32F, 1, 1.f, stream);
  gemm(CUBLAS_OP_T, CUBLAS_OP_N, hidden, t, 1, weights_ + offsets_[head], 1, d_prediction, 1,
       grad_a_, CUDA_R_16BF, hidden, 0.f, stream);
  __nv_bfloat16* g = grad_a_;
  __nv_bfloat16* g_next = grad_b_;
  for (int l = head - 1; l >= 0; --l) {
    launch_relu_backward(g, activations_[std::size_t(l)], num_tokens * hidden, stream);
    const __nv_bfloat16* x = l == 0 ? x0 : activations_[std::size_t(l - 1)];
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, out_[l], in_[l], t, g, out_[l], x, in_[l],
         grads_ + offsets_[l], CUDA_R_32F, out_[l], 1.f, stream);
    if (l == 0) {
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, in_[l], t, out_[l], weights_ + offsets_[l], out_[l], g,
           out_[l], d_x0, CUDA_R_32F, in_[l], 0.f, stream);
    } else {
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, in_[l], t, out_[l], weights_ + offsets_[l], out_[l], g,
           out_[l], g_next, CUDA_R_16BF, in_[l], 0.f, stream);
      std::swap(g, g_next);
    }
  }
}

void DenseMlp::zero_grads(cudaStream_t stream) {
  WEFT_CUDA_CHECK(cudaMemsetAsync(grads_, 0, std::size_t(num_parameters()) * sizeof(float), stream));
}

void DenseMlp::sgd(float lr, cudaStream_t stream) {
  launch_sgd({.master = master_, .grad = grads_, .n = num_parameters(), .lr = lr,
              .weights = weights_}, stream);
}

GradientBucket DenseMlp::bucket(int index) const {
  const std::int64_t split = offsets_[std::size_t(config_.bucket_split_layer)];
  WEFT_CHECK(index == 1 || index == 2, "DenseMlp: bucket ", index, " (1 or 2)");
  if (index == 1) return {grads_ + split, num_parameters() - split};
  return {grads_, split};
}

}  // namespace weft::hstu
