// weft::ep's pieces of DeepEP's low_latency_dispatch on the GPU: the fp8 cast with and without
// round_scale (cast_to_fp8, and DispatchInputs::cast_to_fp8 on the way) and the low-latency
// results of fixed-stride expanded dispatches (DispatchInputs::low_latency), each against the CPU
// reference, every element of outputs poisoned before the call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device_array.hpp"
#include "payload.hpp"
#include "team.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::identity_value;
using weft::ep::testing::make_team;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;
using weft::ep::testing::upload;

constexpr uint8_t kPoison = 0xa5;

DeviceArray poisoned(int dev, std::size_t bytes) {
  DeviceArray a(dev, bytes);
  WEFT_CUDA_CHECK(cudaMemset(a.ptr, kPoison, bytes));
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  return a;
}

// Random bf16 rows over a wide range, with an all-zero group, a group below the minimum amax,
// groups holding NaN, +-inf and +-448, and -0.
std::vector<uint16_t> special_rows(int64_t T, int64_t hidden, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(std::size_t(T * hidden));
  for (auto& v : x) v = weft::ep::float_to_bf16(normal(rng) * std::exp2(float(rng() % 24) - 12));
  const int64_t G = hidden / 128;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = int64_t(rng() % uint32_t(G));
    uint16_t* group = x.data() + t * hidden + g * 128;
    switch (t % 6) {
      case 0: std::fill_n(group, 128, uint16_t(0)); break;
      case 1: std::fill_n(group, 128, weft::ep::float_to_bf16(0x1p-16f)); break;
      case 2: group[3] = 0x7FC0; break;                            // NaN
      case 3: group[7] = t % 12 == 3 ? 0x7F80 : 0xFF80; break;      // +-inf
      case 4:  // +-448
        group[0] = weft::ep::float_to_bf16(448.0f);
        group[1] = weft::ep::float_to_bf16(-448.0f);
        break;
      default: group[9] = 0x8000; break;                            // -0
    }
  }
  return x;
}

TEST(EpLowLatency, CastMatchesTheReferenceWithAndWithoutRoundScale) {
  if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  std::mt19937 rng(std::random_device{}());
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  for (int64_t hidden : {128, 512, 7168}) {
    for (int64_t T : {1, 13, 130}) {
      const auto l = weft::ep::fp8_row_layout(hidden);
      const auto x = special_rows(T, hidden, rng);
      const DeviceArray xd = upload(0, x);
      DeviceArray out(0, std::size_t(T * l.row_bytes));
      for (bool round_scale : {false, true}) {
        WEFT_CUDA_CHECK(cudaMemset(out.ptr, kPoison, std::size_t(T * l.row_bytes)));
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        weft::ep::cast_to_fp8(xd.ptr, T, hidden, out.ptr, nullptr, round_scale);
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto got = download<uint8_t>(0, out.ptr, std::size_t(T * l.row_bytes));
        const auto want = ref::cast_to_fp8(hidden, T, x, round_scale);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
        EXPECT_EQ(wrong, 0u) << "hidden " << hidden << " T " << T << " round_scale "
                             << round_scale;
      }
    }
  }
}

// kFp8 / kFp8RoundScale: bf16 x cast on the way (DispatchInputs::cast_to_fp8); kFp8Packed: x
// cast first (cast_to_fp8) and its packed rows dispatched.
enum class Format { kBf16, kFp8, kFp8RoundScale, kFp8Packed };

// Per rank: the dispatch of random routing in `format` with fixed-stride segments of R * M rows
// and its low-latency results (DispatchInputs::low_latency) into poisoned arrays; every element
// is checked: received rows (fp8: the cast's bits, from rows with NaN, inf, +-448, -0, zero and
// tiny groups) and valid rows' results against the reference dispatch and
// reference::low_latency_layout, padding rows' src_info -1, and padding rows' scales not written
// (still poison). Every format and T in {0, 1, 9, M} at M = 24 tokens, hidden 1024 (UE8M0 words
// too) and 640 (5 groups: no UE8M0); and with 2 blocks (num_sms) at M = 300, hidden 7168, where
// the one sending block casts its tokens in several sub-chunks (128 tokens) of several pieces
// each (16 tokens, the most; the last pieces shorter).
void check_dispatch_results(int64_t hidden, int64_t M, int num_sms,
                            std::initializer_list<Format> formats, bool every_t) {
  const int R = team_size();
  const int epr = 3;
  const BufferConfig config{.max_tokens = M, .hidden = hidden, .num_experts = epr * R,
                            .top_k = 4, .expand_factor = epr};
  const int64_t S = R * M;
  const int64_t H = config.hidden;
  const int64_t G = H / 128;
  const auto l = weft::ep::fp8_row_layout(H);
  auto eps = make_team(config);
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[std::size_t(r)], cudaStreamNonBlocking));
  }
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (Format format : formats) {
    for (int64_t T : every_t ? std::vector<int64_t>{0, 1, 9, M} : std::vector<int64_t>{M}) {
      const bool fp8 = format != Format::kBf16;
      const bool round_scale = format == Format::kFp8RoundScale;
      SCOPED_TRACE(testing::Message() << "format " << int(format) << " T " << T);
      std::vector<ref::RankInput> inputs(static_cast<std::size_t>(R));
      for (int r = 0; r < R; ++r) {
        auto& in = inputs[std::size_t(r)];
        in.num_tokens = r == 0 && T > 0 ? T - 1 : T;
        if (fp8) in.x = special_rows(in.num_tokens, H, rng);
        for (int64_t t = 0; t < in.num_tokens; ++t) {
          for (int64_t h = 0; fp8 == false && h < H; ++h) in.x.push_back(identity_value(r, t, h));
          for (int k = 0; k < config.top_k; ++k) {
            in.topk_idx.push_back(uni(rng) < 0.2f ? -1 : int64_t(rng() % uint32_t(epr * R)));
            in.topk_weights.push_back(0.0f);
          }
        }
        if (fp8) in.x_fp8 = ref::cast_to_fp8(H, in.num_tokens, in.x, round_scale);
      }
      const auto layouts = ref::dispatch(
          config, inputs, {.fp8 = fp8, .expand = {.enabled = true, .segment_stride = S}});
      std::vector<DeviceArray> x, idx, w, packed, src_info, layout_range, scales, ue8m0;
      std::vector<weft::ep::DispatchResult> results;
      for (int r = 0; r < R; ++r) {
        const int dev = rank_device(r);
        const auto& in = inputs[std::size_t(r)];
        x.push_back(upload(dev, in.x));
        idx.push_back(upload(dev, in.topk_idx));
        w.push_back(upload(dev, in.topk_weights));
        packed.emplace_back(dev, std::size_t(M * l.row_bytes));
        src_info.push_back(poisoned(dev, std::size_t(epr * S * 4)));
        layout_range.push_back(poisoned(dev, std::size_t(epr * R * 8)));
        scales.push_back(poisoned(dev, std::size_t(epr * S * G * 4)));
        ue8m0.push_back(poisoned(dev, std::size_t(epr * S * G)));
      }
      // Each step on every rank before the next (every rank's dispatch before anything that
      // waits for one: the ranks' kernels wait for each other on the device, and a virtual
      // team's streams share the device's hardware queues).
      for (int r = 0; r < R; ++r) {
        if (format != Format::kFp8Packed) break;
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        weft::ep::cast_to_fp8(x[std::size_t(r)].ptr, inputs[std::size_t(r)].num_tokens, H,
                              packed[std::size_t(r)].ptr, streams[std::size_t(r)], round_scale);
      }
      std::vector<weft::ep::LowLatencyTargets> targets(static_cast<std::size_t>(R));
      for (int r = 0; r < R; ++r) {
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        const int64_t n = inputs[std::size_t(r)].num_tokens;
        weft::ep::DispatchInputs in;
        if (format == Format::kFp8Packed) {
          in.x = {packed[std::size_t(r)].ptr, DType::kUInt8, n, l.row_bytes};
        } else {
          in.x = {x[std::size_t(r)].ptr, DType::kBFloat16, n, H};
          in.cast_to_fp8 = {.enabled = fp8, .round_scale = round_scale};
        }
        in.topk_idx = {idx[std::size_t(r)].ptr, DType::kInt64, n, config.top_k};
        in.topk_weights = {w[std::size_t(r)].ptr, DType::kFloat32, n, config.top_k};
        in.expand = {.enabled = true, .segment_stride = S};
        in.num_sms = num_sms;
        weft::ep::LowLatencyTargets& t = targets[std::size_t(r)];
        t.src_info = static_cast<int32_t*>(src_info[std::size_t(r)].ptr);
        t.layout_range = static_cast<int64_t*>(layout_range[std::size_t(r)].ptr);
        if (fp8) {
          t.scales = static_cast<float*>(scales[std::size_t(r)].ptr);
          if (G % 4 == 0) t.ue8m0 = static_cast<int32_t*>(ue8m0[std::size_t(r)].ptr);
        }
        in.low_latency = &t;
        results.push_back(eps[std::size_t(r)]->dispatch(in, streams[std::size_t(r)]));
      }
      for (int r = 0; r < R; ++r) {
        WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[std::size_t(r)]));
        eps[std::size_t(r)]->check();
      }
      for (int r = 0; r < R; ++r) {
        const int dev = rank_device(r);
        const auto& L = layouts[std::size_t(r)];
        const auto want = ref::low_latency_layout(config, R, S, L);
        const auto got_src = download<int32_t>(dev, src_info[std::size_t(r)].ptr,
                                               std::size_t(epr * S));
        const auto got_range = download<int64_t>(dev, layout_range[std::size_t(r)].ptr,
                                                 std::size_t(epr * R));
        EXPECT_EQ(got_src, want.src_info) << "rank " << r << " src_info";
        EXPECT_EQ(got_range, want.layout_range) << "rank " << r << " layout_range";
        if (!fp8) continue;
        const auto window = download<uint8_t>(dev, results[std::size_t(r)].recv_x_fp8,
                                              std::size_t(epr * S * l.row_bytes));
        const auto got_scales = download<uint32_t>(dev, scales[std::size_t(r)].ptr,
                                                   std::size_t(epr * S * G));
        const auto got_ue8m0 = download<uint32_t>(dev, ue8m0[std::size_t(r)].ptr,
                                                  std::size_t(epr * S * G / 4));
        uint32_t poison = 0;
        std::memset(&poison, kPoison, sizeof(poison));
        std::size_t wrong = 0;
        std::size_t wrong_rows = 0;  // the device's cast, as received
        for (int64_t e = 0; e < epr; ++e) {
          const int64_t count = int64_t(L.tokens_per_local_expert[std::size_t(e)]);
          for (int64_t s = 0; s < count; ++s) {
            const auto row = std::size_t((e * S + s) * l.row_bytes);
            wrong_rows += !std::equal(window.begin() + std::ptrdiff_t(row),
                                      window.begin() + std::ptrdiff_t(row + l.row_bytes),
                                      L.recv_x_fp8.begin() + std::ptrdiff_t(row));
          }
          for (int64_t s = 0; s < S; ++s) {
            for (int64_t g = 0; g < G; ++g) {
              const auto i = std::size_t((e * G + g) * S + s);
              uint32_t expected = poison;  // padding: not written
              if (s < count) std::memcpy(&expected, &want.scales[i], 4);
              wrong += got_scales[i] != expected;
            }
            for (int64_t v = 0; G % 4 == 0 && v < G / 4; ++v) {
              const auto i = std::size_t((e * G / 4 + v) * S + s);
              wrong += got_ue8m0[i] != (s < count ? uint32_t(want.ue8m0[i]) : poison);
            }
          }
        }
        EXPECT_EQ(wrong_rows, 0u) << "rank " << r << ": received fp8 rows differ";
        EXPECT_EQ(wrong, 0u) << "rank " << r << ": scales / ue8m0 differ";
      }
    }
  }
  for (auto s : streams) cudaStreamDestroy(s);
}

TEST(EpLowLatency, DispatchResultsMatchTheReference) {
  if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  const auto all = {Format::kBf16, Format::kFp8, Format::kFp8RoundScale, Format::kFp8Packed,
                    Format::kFp8};
  for (int64_t hidden : {1024, 640}) {
    SCOPED_TRACE(testing::Message() << "hidden " << hidden);
    check_dispatch_results(hidden, 24, 0, all, true);
  }
  SCOPED_TRACE("two blocks, M = 300, hidden 7168");
  check_dispatch_results(7168, 300, 2, {Format::kFp8, Format::kFp8RoundScale}, false);
}

// Refusals, each for its own reason, on the host (nothing launched).
TEST(EpLowLatency, BadLowLatencyAndCastInputsAreRefused) {
  if (team_size() != 1) GTEST_SKIP() << "one rank";
  const int64_t M = 24;
  const int epr = 3;
  const BufferConfig config{.max_tokens = M, .hidden = 1024, .num_experts = epr, .top_k = 4,
                            .expand_factor = epr};
  const int64_t S = M;
  const int64_t H = config.hidden;
  auto eps = make_team(config);
  cudaStream_t stream = nullptr;
  WEFT_CUDA_CHECK(cudaSetDevice(rank_device(0)));
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceArray xd(0, std::size_t(H * 2)), id(0, 64), wd(0, 64), out(0, std::size_t(epr * S * 8));
  weft::ep::LowLatencyTargets t;
  t.src_info = static_cast<int32_t*>(out.ptr);
  t.layout_range = static_cast<int64_t*>(out.ptr);
  // A dispatch of no tokens of bf16 x with `in`'s other fields.
  auto empty = [&](weft::ep::DispatchInputs in) {
    in.x = {xd.ptr, DType::kBFloat16, 0, H};
    in.topk_idx = {id.ptr, DType::kInt64, 0, config.top_k};
    in.topk_weights = {wd.ptr, DType::kFloat32, 0, config.top_k};
    return in;
  };
  auto expect_refusal = [&](const weft::ep::DispatchInputs& in, const std::string& reason) {
    try {
      eps[0]->dispatch(in, stream);
      ADD_FAILURE() << "not refused: " << reason;
    } catch (const weft::Error& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  weft::ep::DispatchInputs in;
  in.expand = {.enabled = true, .segment_stride = S};
  weft::ep::LowLatencyTargets with_scales = t;
  with_scales.scales = static_cast<float*>(out.ptr);
  in.low_latency = &with_scales;
  expect_refusal(empty(in), "need a dispatch of fp8 rows");
  weft::ep::LowLatencyTargets no_src = t;
  no_src.src_info = nullptr;
  in.low_latency = &no_src;
  expect_refusal(empty(in), "src_info is null");
  in.low_latency = &t;
  in.expand = {.enabled = true};
  expect_refusal(empty(in), "fixed-stride segments");
  in.low_latency = nullptr;
  in.expand = {};
  in.cast_to_fp8.enabled = true;
  expect_refusal(empty(in), "cast_to_fp8 is for an uncached expanded dispatch");
  // A cached dispatch takes neither (its handle from a plain expanded dispatch).
  weft::ep::DispatchInputs plain;
  plain.expand = {.enabled = true, .segment_stride = S};
  const weft::ep::Handle handle = eps[0]->dispatch(empty(plain), stream).handle;
  weft::ep::DispatchInputs cached;
  cached.handle = &handle;
  cached.x = {xd.ptr, DType::kBFloat16, 0, H};
  cached.cast_to_fp8.enabled = true;
  expect_refusal(cached, "cast_to_fp8 is for an uncached");
  cached.cast_to_fp8.enabled = false;
  cached.low_latency = &t;
  expect_refusal(cached, "low_latency targets need an uncached");
  // The cast takes bf16 x only: not the fp8 pair, not packed rows.
  in.expand = {.enabled = true, .segment_stride = S};
  float scale = 1.0f;
  in.x_scales = {&scale, 1, 1};
  expect_refusal(empty(in), "cast_to_fp8 is for an uncached expanded dispatch of bf16 x");
  in.x_scales = {};
  weft::ep::DispatchInputs packed_in = empty(in);
  packed_in.x = {xd.ptr, DType::kUInt8, 0, weft::ep::fp8_row_layout(H).row_bytes};
  expect_refusal(packed_in, "x (cast to fp8) must be bfloat16");
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

}  // namespace
