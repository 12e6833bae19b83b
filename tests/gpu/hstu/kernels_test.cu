// The HSTU step's kernels and dense model against CPU references: fresh random inputs, outputs
// poisoned before each launch, every element checked. Needs one GPU.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/hstu/data.hpp"
#include "weft/hstu/dense_mlp.hpp"
#include "weft/hstu/kernels.hpp"

namespace weft::hstu {
namespace {

template <typename T>
struct DeviceVec {
  explicit DeviceVec(std::size_t n, int poison = 0x7f) : size(n) {
    WEFT_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
    WEFT_CUDA_CHECK(cudaMemset(ptr, poison, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceVec(const std::vector<T>& v) : DeviceVec(v.size()) {
    WEFT_CUDA_CHECK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceVec() { cudaFree(ptr); }
  std::vector<T> host() const {
    std::vector<T> out(size);
    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  T* ptr = nullptr;
  std::size_t size;
};

class HstuKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() < 1) GTEST_SKIP() << "needs a CUDA device";
    WEFT_CUDA_CHECK(cudaSetDevice(0));
  }
};

std::int64_t random_id(std::uint64_t seed, std::uint64_t i, std::int64_t n) {
  // Skewed, so ids repeat.
  const double u = uniform(seed, 77, 0, i);
  return std::min<std::int64_t>(n - 1, std::int64_t(double(n) * u * u * u));
}

TEST_F(HstuKernels, PartitionByOwnerMatchesReference) {
  const int world = 3, samples = 5;
  std::vector<std::int64_t> lengths = {7, 1, 300, 0, 41};
  const std::int64_t n = std::accumulate(lengths.begin(), lengths.end(), std::int64_t(0));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = random_id(1, i, 1000);
  DeviceVec<std::int64_t> d_ids(ids), d_len(lengths), counts(world), send_len(world * samples),
      send_ids(static_cast<std::size_t>(n)), position(static_cast<std::size_t>(n));
  launch_partition_by_owner({d_ids.ptr, d_len.ptr, n, samples, world, counts.ptr, send_len.ptr,
                             send_ids.ptr, position.ptr}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::int64_t> ref_ids, ref_pos(static_cast<std::size_t>(n)), ref_counts(world, 0),
      ref_len(static_cast<std::size_t>(world * samples), 0);
  for (int d = 0; d < world; ++d) {
    std::int64_t t = 0;
    for (int s = 0; s < samples; ++s) {
      for (std::int64_t k = 0; k < lengths[std::size_t(s)]; ++k, ++t) {
        if (ids[std::size_t(t)] % world != d) continue;
        ref_pos[std::size_t(t)] = std::int64_t(ref_ids.size());
        ref_ids.push_back(ids[std::size_t(t)]);
        ++ref_counts[std::size_t(d)];
        ++ref_len[std::size_t(d * samples + s)];
      }
    }
  }
  EXPECT_EQ(counts.host(), ref_counts);
  EXPECT_EQ(send_len.host(), ref_len);
  EXPECT_EQ(send_ids.host(), ref_ids);
  EXPECT_EQ(position.host(), ref_pos);
}

TEST_F(HstuKernels, PrefetchLookupAndEmbeddingSgdMatchReference) {
  const int world = 2, rank = 1, dim = 128, key_bits = 12;
  const std::int64_t rows = 1000, n = 3001;
  std::vector<float> table(static_cast<std::size_t>(rows * dim));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = float(uniform(2, 1, 0, i) - 0.5);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  // Every third id is one hot row (a run of about 1000 after sorting, as Zipf's head makes);
  // rows - 4 .. rows - 1 get runs of exactly 16, 17, 32 and 33 (the SGD kernel's 16-row load
  // batches and 32-wide steps, and one past each); the rest are random rows below those, in
  // runs of 1 to about 8.
  constexpr std::array<int, 4> kExactRuns = {16, 17, 32, 33};
  std::size_t next_exact = 0;
  int exact_left = kExactRuns[0];
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::int64_t row = random_id(3, i, rows - std::int64_t(kExactRuns.size()));
    if (i % 3 == 0) {
      row = 17;
    } else if (i % 3 == 1 && next_exact < kExactRuns.size()) {
      row = rows - std::int64_t(kExactRuns.size()) + std::int64_t(next_exact);
      if (--exact_left == 0 && ++next_exact < kExactRuns.size()) exact_left = kExactRuns[next_exact];
    }
    ids[i] = row * world + rank;
  }
  for (std::size_t e = 0; e < kExactRuns.size(); ++e) {
    const std::int64_t id = (rows - std::int64_t(kExactRuns.size()) + std::int64_t(e)) * world + rank;
    ASSERT_EQ(std::count(ids.begin(), ids.end(), id), kExactRuns[e]);
  }
  DeviceVec<float> d_table(table), cache(std::size_t(n * dim)), out_rows(std::size_t(n * dim));
  DeviceVec<std::int64_t> d_ids(ids), sorted(static_cast<std::size_t>(n));
  DeviceVec<std::int32_t> arrival(static_cast<std::size_t>(n)), sorted_arrival(static_cast<std::size_t>(n)),
      distinct(static_cast<std::size_t>(n)), inverse(static_cast<std::size_t>(n));
  const std::size_t temp_bytes = prefetch_temp_bytes(n, key_bits);
  DeviceVec<char> temp(temp_bytes);
  cuda::DeviceErrorFlag flag;
  launch_prefetch({d_ids.ptr, n, world, rank, key_bits, dim, d_table.ptr, rows, temp.ptr, temp_bytes,
                   arrival.ptr, sorted.ptr, sorted_arrival.ptr, distinct.ptr, inverse.ptr, cache.ptr,
                   flag.device_record()}, nullptr);
  launch_lookup({cache.ptr, inverse.ptr, n, dim, out_rows.ptr}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_FALSE(flag.raised());
  const auto rows_out = out_rows.host();
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t row = ids[std::size_t(k)] / world;
    for (int c = 0; c < dim; ++c) {
      ASSERT_EQ(rows_out[std::size_t(k * dim + c)], table[std::size_t(row * dim + c)]) << k;
    }
  }
  // Gradients per received id; reference: sums per id in arrival order, then SGD.
  std::vector<float> grad(static_cast<std::size_t>(n * dim));
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = float(uniform(4, 1, 0, i) - 0.5);
  DeviceVec<float> d_grad(grad);
  launch_embedding_sgd({sorted.ptr, sorted_arrival.ptr, n, d_grad.ptr, world, dim, 0.5f, d_table.ptr},
                       nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  std::map<std::int64_t, std::vector<float>> sums;
  for (std::int64_t k = 0; k < n; ++k) {
    auto& s = sums[ids[std::size_t(k)]];
    s.resize(std::size_t(dim), 0.f);
    for (int c = 0; c < dim; ++c) s[std::size_t(c)] += grad[std::size_t(k * dim + c)];
  }
  std::vector<float> ref = table;
  for (const auto& [id, s] : sums) {
    for (int c = 0; c < dim; ++c) ref[std::size_t(id / world * dim + c)] -= 0.5f * s[std::size_t(c)];
  }
  EXPECT_EQ(d_table.host(), ref);
  // A foreign id is reported, not used.
  std::vector<std::int64_t> foreign = {4};  // owned by rank 0
  DeviceVec<std::int64_t> d_foreign(foreign);
  launch_prefetch({d_foreign.ptr, 1, world, rank, key_bits, dim, d_table.ptr, rows, temp.ptr,
                   temp_bytes, arrival.ptr, sorted.ptr, sorted_arrival.ptr, distinct.ptr,
                   inverse.ptr, cache.ptr, flag.device_record()}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_TRUE(flag.raised());
  EXPECT_EQ(flag.read().code, kErrorForeignId);
  EXPECT_EQ(flag.read().args[0], 4);
}

TEST_F(HstuKernels, GatherScatterAndSelectMatchReference) {
  const int dim = 256;
  const std::int64_t n = 517;
  std::vector<std::int64_t> position(static_cast<std::size_t>(n));
  std::iota(position.begin(), position.end(), 0);
  for (std::size_t i = position.size() - 1; i > 0; --i) {
    std::swap(position[i], position[std::size_t(uniform(5, 0, 0, i) * double(i + 1))]);
  }
  std::vector<float> rows(static_cast<std::size_t>(n * dim));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = float(uniform(6, 0, 0, i) * 4 - 2);
  DeviceVec<float> d_rows(rows), scattered(rows.size());
  DeviceVec<std::int64_t> d_pos(position);
  DeviceVec<__nv_bfloat16> x(rows.size());
  launch_gather_rows({d_rows.ptr, d_pos.ptr, n, dim, x.ptr}, nullptr);
  launch_scatter_rows({d_rows.ptr, d_pos.ptr, n, dim, scattered.ptr}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto xh = x.host();
  const auto sh = scattered.host();
  for (std::int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < dim; ++c) {
      const std::size_t p = std::size_t(position[std::size_t(t)] * dim + c), q = std::size_t(t * dim + c);
      ASSERT_EQ(__bfloat162float(xh[q]), __bfloat162float(__float2bfloat16(rows[p])));
      ASSERT_EQ(sh[p], rows[q]);
    }
  }
  // select_samples: pick samples 2 and 0 of three.
  std::vector<std::int64_t> all_len = {3, 1, 2}, all_ids = {10, 11, 12, 20, 30, 31},
                            plan = {2, 4, 0, 0, 0, 2};
  DeviceVec<std::int64_t> d_len(all_len), d_ids(all_ids), d_plan(plan), out_len(2), out_ids(5);
  launch_select_samples({d_len.ptr, d_ids.ptr, d_plan.ptr, 2, out_len.ptr, out_ids.ptr}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(out_len.host(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(out_ids.host(), (std::vector<std::int64_t>{30, 31, 10, 11, 12}));
}

TEST_F(HstuKernels, LossMatchesReference) {
  const std::int64_t n = 2500, items = 100;
  std::vector<float> pred(static_cast<std::size_t>(n)), target(items);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < pred.size(); ++i) pred[i] = float(uniform(8, 0, 0, i) - 0.5);
  for (std::size_t i = 0; i < target.size(); ++i) target[i] = float(uniform(9, 0, 0, i) - 0.5);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = random_id(10, i, items);
  const std::vector<float> global = {8000.f};
  DeviceVec<float> d_pred(pred), d_target(target), diff(static_cast<std::size_t>(n)), sum(1), d_global(global), loss(1);
  DeviceVec<std::int64_t> d_ids(ids);
  DeviceVec<__nv_bfloat16> dp(static_cast<std::size_t>(n));
  launch_loss_forward({d_pred.ptr, d_ids.ptr, d_target.ptr, n, diff.ptr, sum.ptr}, nullptr);
  launch_loss_backward({diff.ptr, sum.ptr, d_global.ptr, n, dp.ptr, loss.ptr}, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  double ref_sum = 0;
  const auto dph = dp.host();
  for (std::int64_t t = 0; t < n; ++t) {
    const float d = pred[std::size_t(t)] - target[std::size_t(ids[std::size_t(t)])];
    ref_sum += double(d) * d;
    ASSERT_EQ(__bfloat162float(dph[std::size_t(t)]), __bfloat162float(__float2bfloat16(2.f / 8000.f * d)));
  }
  EXPECT_NEAR(sum.host()[0], ref_sum, 1e-4 * ref_sum);
  EXPECT_NEAR(loss.host()[0], ref_sum / 8000, 1e-4 * ref_sum / 8000);
}

float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The MLP against a CPU reference that rounds to bf16 where the GPU stores bf16.
TEST_F(HstuKernels, DenseMlpMatchesReference) {
  HstuConfig config{.embedding_dim = 128, .num_layers = 2, .hidden = 64, .bucket_split_layer = 1};
  const std::int64_t n = 37;
  DenseMlp mlp(config, 64);
  mlp.init_parameters(nullptr);
  std::vector<float> x(std::size_t(n * 128)), dp(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf(float(uniform(11, 0, 0, i) * 2 - 1));
  for (std::size_t i = 0; i < dp.size(); ++i) dp[i] = bf(float(uniform(12, 0, 0, i) - 0.5));
  std::vector<__nv_bfloat16> xb(x.size()), dpb(dp.size());
  for (std::size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(x[i]);
  for (std::size_t i = 0; i < dp.size(); ++i) dpb[i] = __float2bfloat16(dp[i]);
  DeviceVec<__nv_bfloat16> d_x(xb), d_dp(dpb);
  DeviceVec<float> pred(static_cast<std::size_t>(n)), dx(x.size());
  mlp.zero_grads(nullptr);
  mlp.forward(d_x.ptr, n, pred.ptr, nullptr);
  mlp.backward(d_x.ptr, d_dp.ptr, n, dx.ptr, nullptr);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  // Reference weights: the initial ones rounded to bf16.
  const int layers = mlp.num_layers();
  std::vector<std::vector<float>> w(static_cast<std::size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < mlp.fan_in(l); ++i)
      for (int j = 0; j < mlp.fan_out(l); ++j) w[std::size_t(l)].push_back(bf(initial_weight(config, l, mlp.fan_in(l), i, j)));
  }
  std::vector<std::vector<float>> act(static_cast<std::size_t>(layers));  // inputs of each layer
  act[0] = x;
  std::vector<float> out;
  for (int l = 0; l < layers; ++l) {
    const int in = mlp.fan_in(l), o = mlp.fan_out(l);
    out.assign(std::size_t(n * o), 0.f);
    for (std::int64_t t = 0; t < n; ++t)
      for (int j = 0; j < o; ++j) {
        float s = 0;
        for (int i = 0; i < in; ++i) s += act[std::size_t(l)][std::size_t(t * in + i)] * w[std::size_t(l)][std::size_t(i * o + j)];
        out[std::size_t(t * o + j)] = l + 1 < layers ? bf(std::max(bf(s), 0.f)) : s;
      }
    if (l + 1 < layers) act[std::size_t(l + 1)] = out;
  }
  const auto ph = pred.host();
  for (std::int64_t t = 0; t < n; ++t) EXPECT_NEAR(ph[std::size_t(t)], out[std::size_t(t)], 2e-2 * (1 + std::fabs(out[std::size_t(t)])));
  // Backward reference.
  std::vector<float> g = dp, ref_grads;
  std::vector<std::vector<float>> gw(static_cast<std::size_t>(layers));
  for (int l = layers - 1; l >= 0; --l) {
    const int in = mlp.fan_in(l), o = mlp.fan_out(l);
    if (l + 1 < layers) {
      for (std::size_t k = 0; k < g.size(); ++k) if (!(act[std::size_t(l + 1)][k] > 0)) g[k] = 0;
    }
    gw[std::size_t(l)].assign(std::size_t(in * o), 0.f);
    for (int i = 0; i < in; ++i)
      for (int j = 0; j < o; ++j)
        for (std::int64_t t = 0; t < n; ++t) gw[std::size_t(l)][std::size_t(i * o + j)] += act[std::size_t(l)][std::size_t(t * in + i)] * g[std::size_t(t * o + j)];
    std::vector<float> gx(static_cast<std::size_t>(n * in), 0.f);
    for (std::int64_t t = 0; t < n; ++t)
      for (int i = 0; i < in; ++i) {
        float s = 0;
        for (int j = 0; j < o; ++j) s += g[std::size_t(t * o + j)] * w[std::size_t(l)][std::size_t(i * o + j)];
        gx[std::size_t(t * in + i)] = l == 0 ? s : bf(s);
      }
    g = gx;
  }
  for (int l = 0; l < layers; ++l) ref_grads.insert(ref_grads.end(), gw[std::size_t(l)].begin(), gw[std::size_t(l)].end());
  std::vector<float> grads(static_cast<std::size_t>(mlp.num_parameters()));
  WEFT_CUDA_CHECK(cudaMemcpy(grads.data(), mlp.grads(), grads.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double scale = 0;
  for (float v : ref_grads) scale = std::max(scale, double(std::fabs(v)));
  for (std::size_t i = 0; i < grads.size(); ++i) ASSERT_NEAR(grads[i], ref_grads[i], 3e-2 * scale) << i;
  const auto dxh = dx.host();
  double dx_scale = 0;
  for (float v : g) dx_scale = std::max(dx_scale, double(std::fabs(v)));
  for (std::size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(dxh[i], g[i], 3e-2 * dx_scale) << i;
  // Buckets cover the gradients exactly once.
  EXPECT_EQ(mlp.bucket(1).num_elements + mlp.bucket(2).num_elements, mlp.num_parameters());
  EXPECT_EQ(mlp.bucket(2).data, mlp.grads());
}

}  // namespace
}  // namespace weft::hstu
