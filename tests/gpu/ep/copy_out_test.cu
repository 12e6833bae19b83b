// weft::ep's owned results (Buffer::copy_out), above all a dispatch that defers its own rows
// (DispatchInputs::defer_own_rows: the rows a rank sends to itself are written once, by copy_out
// from x): every form of x (bf16, packed fp8 rows, the fp8 pair with row- and column-major
// scales), uncached and cached, padding rows, and the misuse copy_out refuses. Every element of
// the owned arrays is checked against the CPU reference, in arrays poisoned before each call.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"
#include "ep_fixture.hpp"
#include "payload.hpp"
#include "team.hpp"

namespace {

using weft::ep::CopyOutTargets;
using weft::ep::CountMode;
using weft::ep::DispatchInputs;
using weft::ep::DispatchResult;
using weft::ep::DType;
using weft::ep::Handle;
using weft::ep::TensorView;
namespace ref = weft::ep::reference;
using weft::ep::testing::contains;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::EpTest;
using weft::ep::testing::error_of;
using weft::ep::testing::make_inputs;
using weft::ep::testing::rank_device;
using weft::ep::testing::refill_x;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::team_size;
using weft::ep::testing::upload;

enum class Form { kBf16, kPacked, kPairRowMajor, kPairColumnMajor };

const char* name_of(Form f) {
  switch (f) {
    case Form::kBf16: return "bf16";
    case Form::kPacked: return "packed fp8";
    case Form::kPairRowMajor: return "fp8 pair, row-major scales";
    case Form::kPairColumnMajor: return "fp8 pair, column-major scales";
  }
  return "";
}

constexpr uint8_t kPoison = 0xa5;
constexpr int kPaddingRows = 3;  // owned rows past the count (a worst-case num_rows)

class EpCopyOutTest : public EpTest {
 protected:
  // One rank's x in a form, on its device.
  struct RankX {
    DeviceArray x, scales;
    DispatchInputs::Fp8Scales view{};
    TensorView x_view{};
  };
  RankX upload_x(int r, const ref::RankInput& in, Form form) const {
    RankX o;
    const int64_t T = in.num_tokens;
    const int64_t H = config.hidden;
    const int dev = rank_device(r);
    if (form == Form::kBf16) {
      o.x = upload(dev, in.x);
      o.x_view = {o.x.ptr, DType::kBFloat16, T, H};
      return o;
    }
    if (form == Form::kPacked) {
      o.x = upload(dev, in.x_fp8);
      o.x_view = {o.x.ptr, DType::kUInt8, T, weft::ep::fp8_row_layout(H).row_bytes};
      return o;
    }
    const auto u = ref::unpack_fp8(H, T, in.x_fp8);
    const int64_t G = H / weft::ep::kFp8GroupElements;
    o.x = upload(dev, u.payload);
    o.x_view = {o.x.ptr, DType::kUInt8, T, H};
    if (form == Form::kPairRowMajor) {
      o.scales = upload(dev, u.scales);
      o.view = {static_cast<const float*>(o.scales.ptr), G, 1};
    } else {
      std::vector<float> column(u.scales.size());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t g = 0; g < G; ++g) column[std::size_t(g * T + t)] = u.scales[std::size_t(t * G + g)];
      }
      o.scales = upload(dev, column);
      o.view = {static_cast<const float*>(o.scales.ptr), 1, T};
    }
    return o;
  }

  // Owned arrays of one rank, poisoned.
  struct Owned {
    DeviceArray x, scales, src, idx, w, prefix;
    int64_t rows = 0;
    bool fp8 = false;
    std::array<DeviceArray*, 6> arrays() { return {&x, &scales, &src, &idx, &w, &prefix}; }
  };
  // The bytes of each of Owned::arrays() for rows rows (scales: 0 without fp8).
  std::array<std::size_t, 6> owned_bytes(int64_t rows, bool fp8) const {
    const int64_t H = config.hidden;
    const int K = config.top_k;
    return {std::size_t(rows * H * (fp8 ? 1 : 2)),
            fp8 ? std::size_t(rows * (H / weft::ep::kFp8GroupElements) * 4) : 0,
            std::size_t(rows * 8), std::size_t(rows * K * 8), std::size_t(rows * K * 4),
            std::size_t(R * R * 4)};
  }
  Owned poisoned(int r, int64_t rows, bool fp8) const {
    Owned o;
    o.rows = rows;
    o.fp8 = fp8;
    const auto bytes = owned_bytes(rows, fp8);
    const auto arrays = o.arrays();
    for (std::size_t i = 0; i < arrays.size(); ++i) {
      if (i != 1 || fp8) *arrays[i] = DeviceArray(rank_device(r), bytes[i]);
    }
    poison(r, o);
    return o;
  }
  // Poisons o's arrays again, in place (a captured graph writes these very arrays).
  void poison(int r, Owned& o) const {
    const auto bytes = owned_bytes(o.rows, o.fp8);
    const auto arrays = o.arrays();
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    for (std::size_t i = 0; i < arrays.size(); ++i) {
      if (arrays[i]->ptr != nullptr) {
        WEFT_CUDA_CHECK(cudaMemset(arrays[i]->ptr, kPoison, bytes[i] > 0 ? bytes[i] : 16));
      }
    }
  }

  CopyOutTargets targets(const Owned& o, bool fp8, bool metadata, const RankX* own) const {
    CopyOutTargets t;
    t.num_rows = o.rows;
    t.x = o.x.ptr;
    t.x_scales = fp8 ? static_cast<float*>(o.scales.ptr) : nullptr;
    if (metadata) {
      t.src = static_cast<int32_t*>(o.src.ptr);
      t.pad_token = 7;
      t.topk_idx = o.idx.ptr;
      t.topk_idx_int64 = true;
      t.topk_weights = static_cast<float*>(o.w.ptr);
      t.num_topk = config.top_k;
      t.rank_prefix_matrix = static_cast<int32_t*>(o.prefix.ptr);
    }
    if (own != nullptr) {
      t.deferred_own_rows = true;
      t.own_x = own->x_view;
      t.own_x_scales = own->view;
    }
    return t;
  }

  // Rank r's owned arrays against its layout L (payload of the received rows; with metadata,
  // every row's source, selections and weights, padding rows included, and the prefix matrix).
  void check_owned(int r, const Owned& o, const ref::RankLayout& L, bool fp8, bool metadata) {
    const int64_t n = L.num_recv;
    const int64_t H = config.hidden;
    const int K = config.top_k;
    const int dev = rank_device(r);
    ASSERT_EQ(o.rows, n + kPaddingRows);
    if (!fp8) {
      auto x = download<uint16_t>(dev, o.x.ptr, std::size_t(n * H));
      EXPECT_EQ(x, L.recv_x) << "rank " << r << ": owned rows differ";
    } else {
      const auto want = ref::unpack_fp8(H, n, L.recv_x_fp8);
      EXPECT_EQ(download<uint8_t>(dev, o.x.ptr, std::size_t(n * H)), want.payload)
          << "rank " << r << ": owned e4m3 rows differ";
      EXPECT_EQ(download<float>(dev, o.scales.ptr, want.scales.size()), want.scales)
          << "rank " << r << ": owned scales differ";
    }
    if (!metadata) return;
    const auto src = download<int32_t>(dev, o.src.ptr, std::size_t(o.rows * 2));
    const auto idx = download<int64_t>(dev, o.idx.ptr, std::size_t(o.rows * K));
    const auto w = download<float>(dev, o.w.ptr, std::size_t(o.rows * K));
    for (int64_t row = 0; row < o.rows; ++row) {
      const bool received = row < n;
      ASSERT_EQ(src[std::size_t(2 * row)], received ? L.recv_src_rank[std::size_t(row)] : 0)
          << "rank " << r << " row " << row;
      ASSERT_EQ(src[std::size_t(2 * row + 1)], received ? L.recv_src_token[std::size_t(row)] : 7)
          << "rank " << r << " row " << row;
      for (int k = 0; k < K; ++k) {
        const std::size_t i = std::size_t(row * K + k);
        ASSERT_EQ(idx[i], received ? L.recv_expert_idx[i] : -1) << "rank " << r << " row " << row;
        ASSERT_EQ(w[i], received ? L.recv_weights[i] : 0.0f) << "rank " << r << " row " << row;
      }
    }
    EXPECT_EQ(download<int32_t>(dev, o.prefix.ptr, std::size_t(R * R)), L.rank_prefix_matrix);
  }

  // An uncached then a cached dispatch of T tokens (new payload each) in one form, deferred or
  // not, each followed by copy_out into poisoned arrays: the owned arrays against the reference,
  // element by element, at every rank. With stats, both dispatches add to a zeroed
  // cumulative_local_expert_recv_stats, which then holds twice the tokens per local expert.
  void owned_round(Form form, bool defer, int64_t T, std::mt19937& rng, bool stats = false) {
    SCOPED_TRACE(testing::Message() << name_of(form) << ", defer " << defer << ", T " << T
                                    << ", top_k " << config.top_k);
    const bool fp8 = form != Form::kBf16;
    RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = 0.2};
    for (int r = 1; r < R; ++r) spec.tokens[std::size_t(r)] -= (r * 37) % std::max<int64_t>(T, 1);
    auto inputs = make_inputs(config, R, spec, rng);
    for (auto& in : inputs) in.x_fp8 = ref::cast_to_fp8(config.hidden, in.num_tokens, in.x);
    put_inputs(inputs);  // the selections (x is per form, below)
    const int64_t num_local = config.num_experts / R;
    std::vector<DeviceArray> counters;
    for (int r = 0; r < R && stats; ++r) {
      counters.push_back(upload(rank_device(r), std::vector<uint32_t>(std::size_t(num_local), 0)));
    }
    std::vector<Handle> handles;
    for (int pass = 0; pass < 2; ++pass) {  // 0: uncached, 1: cached with new payload
      SCOPED_TRACE(pass == 0 ? "uncached" : "cached");
      if (pass == 1) refill_x(config, inputs, 5);
      const auto layouts = ref::dispatch(config, inputs, {.fp8 = fp8});
      std::vector<RankX> xs;
      std::vector<DispatchResult> res;
      for (int r = 0; r < R; ++r) {
        xs.push_back(upload_x(r, inputs[std::size_t(r)], form));
        DispatchInputs in = inputs_of(r, inputs[std::size_t(r)].num_tokens);
        in.x = xs.back().x_view;
        in.x_scales = xs.back().view;
        in.defer_own_rows = defer;
        if (stats) {
          in.cumulative_local_expert_recv_stats = static_cast<uint32_t*>(counters[std::size_t(r)].ptr);
        }
        if (pass == 1) {
          in.topk_idx = {};
          in.topk_weights = {};
          in.handle = &handles[std::size_t(r)];
        }
        res.push_back(eps[std::size_t(r)]->dispatch(
            in, ranks[std::size_t(r)].stream, pass == 0 ? CountMode::kExact : CountMode::kOnDevice));
      }
      if (pass == 0) {
        for (int r = 0; r < R; ++r) {
          eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]);
          handles.push_back(res[std::size_t(r)].handle);
          ASSERT_EQ(res[std::size_t(r)].num_recv, layouts[std::size_t(r)].num_recv);
        }
      }
      std::vector<Owned> owned;
      for (int r = 0; r < R; ++r) {
        owned.push_back(poisoned(r, layouts[std::size_t(r)].num_recv + kPaddingRows, fp8));
        eps[std::size_t(r)]->copy_out(
            targets(owned.back(), fp8, pass == 0, defer ? &xs[std::size_t(r)] : nullptr),
            ranks[std::size_t(r)].stream);
      }
      sync_all();
      for (int r = 0; r < R; ++r) {
        eps[std::size_t(r)]->check();
        check_owned(r, owned[std::size_t(r)], layouts[std::size_t(r)], fp8, pass == 0);
      }
      if (pass == 1 && stats) {
        for (int r = 0; r < R; ++r) {
          std::vector<uint32_t> want;
          for (int32_t n : layouts[std::size_t(r)].tokens_per_local_expert) want.push_back(2 * uint32_t(n));
          EXPECT_EQ(download<uint32_t>(rank_device(r), counters[std::size_t(r)].ptr, std::size_t(num_local)),
                    want) << "rank " << r << ": cumulative stats";
        }
      }
    }
  }
};

// Uncached then cached dispatches (new payload each), every form, deferred or not: the owned
// arrays equal the reference, element by element, at every rank.
TEST_F(EpCopyOutTest, DeferredOwnRowsMatchTheReferenceInEveryForm) {
  REQUIRE_GPUS();
  make({.max_tokens = 384, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 6});
  std::mt19937 rng(std::random_device{}());
  for (Form form : {Form::kBf16, Form::kPacked, Form::kPairRowMajor, Form::kPairColumnMajor}) {
    for (bool defer : {true, false}) {
      for (int64_t T : {int64_t(1), int64_t(200), int64_t(384)}) owned_round(form, defer, T, rng);
    }
  }
}

// The deferred rows' metadata is sent by groups of top_k lanes rounded up to a power of two
// (from 32 groups of one lane to one group of a warp), in the local count's mode and the grid's
// (T > 1024), and a deferring cached dispatch at one rank runs as one block: every top_k's
// metadata, and the statistics of both calls, against the reference.
TEST_F(EpCopyOutTest, DeferredMetadataOfEveryTopK) {
  REQUIRE_GPUS();
  std::mt19937 rng(std::random_device{}());
  for (int top_k : {1, 3, 8, 17, 32}) {
    make({.max_tokens = 1500, .hidden = 128, .num_experts = 32 * team_size(), .top_k = top_k});
    for (int64_t T : {int64_t(300), int64_t(1500)}) owned_round(Form::kBf16, true, T, rng, true);
  }
}

// A cached dispatch and its copy_out captured in a CUDA graph for one layout and replayed after
// a dispatch of another: the replay writes padding rows only and raises the layout mismatch at
// every rank (at one rank the deferring cached dispatch launches no kernel, so its copy_out
// makes that check); replayed over its own layout it gives the reference's rows.
TEST_F(EpCopyOutTest, ACopyReplayedOverAnotherLayoutWritesPaddingOnly) {
  REQUIRE_GPUS();
  make({.max_tokens = 128, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  const int K = config.top_k;
  const int64_t H = config.hidden;
  const auto first = make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), 100)},
                                 rng);
  put_inputs(first);
  const auto layouts = ref::dispatch(config, first);
  std::vector<DispatchResult> res1;
  for (int r = 0; r < R; ++r) {
    DispatchInputs in = inputs_of(r, 100);
    in.defer_own_rows = true;
    res1.push_back(eps[std::size_t(r)]->dispatch(in, ranks[std::size_t(r)].stream, CountMode::kExact));
  }
  for (int r = 0; r < R; ++r) eps[std::size_t(r)]->wait_num_recv(res1[std::size_t(r)]);
  std::vector<RankX> xs;
  std::vector<Owned> owned;
  std::vector<cudaGraphExec_t> replay(std::size_t(R), nullptr);
  for (int r = 0; r < R; ++r) {
    xs.push_back(upload_x(r, first[std::size_t(r)], Form::kBf16));
    owned.push_back(poisoned(r, layouts[std::size_t(r)].num_recv + kPaddingRows, false));
    DispatchInputs in{.x = xs.back().x_view, .handle = &res1[std::size_t(r)].handle};
    in.defer_own_rows = true;
    cudaStream_t s = ranks[std::size_t(r)].stream;
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    eps[std::size_t(r)]->dispatch(in, s);
    eps[std::size_t(r)]->copy_out(targets(owned.back(), false, true, &xs.back()), s);
    cudaGraph_t graph = nullptr;
    WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    std::size_t num_nodes = 0;
    WEFT_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
    EXPECT_EQ(num_nodes, R == 1 ? 1u : 2u)
        << "rank " << r << ": a deferring cached dispatch launches a kernel only with peers";
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&replay[std::size_t(r)], graph, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  auto replay_all = [&] {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaGraphLaunch(replay[std::size_t(r)], ranks[std::size_t(r)].stream));
    }
    wait_all();
  };
  replay_all();
  for (int r = 0; r < R; ++r) {
    eps[std::size_t(r)]->check();
    check_owned(r, owned[std::size_t(r)], layouts[std::size_t(r)], false, true);
  }

  const auto second = make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), 60)},
                                  rng);
  put_inputs(second);
  const auto res2 = dispatch_all(second, CountMode::kExact);
  for (int r = 0; r < R; ++r) poison(r, owned[std::size_t(r)]);
  replay_all();
  for (int r = 0; r < R; ++r) {
    const std::string what = error_of([&] { eps[std::size_t(r)]->check(); });
    EXPECT_TRUE(contains(what, "layout of dispatch " + std::to_string(res1[0].handle.sequence) +
                                   " ran while the layout of dispatch " +
                                   std::to_string(res2[0].handle.sequence)))
        << "rank " << r << ": " << what;
    const Owned& o = owned[std::size_t(r)];
    const int dev = rank_device(r);
    const auto x = download<uint8_t>(dev, o.x.ptr, std::size_t(o.rows * H * 2));
    EXPECT_EQ(std::count(x.begin(), x.end(), kPoison), std::ptrdiff_t(x.size()))
        << "rank " << r << ": a payload row was written";
    const auto prefix = download<uint8_t>(dev, o.prefix.ptr, std::size_t(R * R * 4));
    EXPECT_EQ(std::count(prefix.begin(), prefix.end(), kPoison), std::ptrdiff_t(prefix.size()))
        << "rank " << r << ": rank_prefix_matrix was written";
    const auto src = download<int32_t>(dev, o.src.ptr, std::size_t(o.rows * 2));
    const auto idx = download<int64_t>(dev, o.idx.ptr, std::size_t(o.rows * K));
    const auto w = download<float>(dev, o.w.ptr, std::size_t(o.rows * K));
    for (int64_t row = 0; row < o.rows; ++row) {
      ASSERT_EQ(src[std::size_t(2 * row)], 0) << "rank " << r << " row " << row;
      ASSERT_EQ(src[std::size_t(2 * row + 1)], 7) << "rank " << r << " row " << row;
      for (int k = 0; k < K; ++k) {
        ASSERT_EQ(idx[std::size_t(row * K + k)], -1) << "rank " << r << " row " << row;
        ASSERT_EQ(w[std::size_t(row * K + k)], 0.0f) << "rank " << r << " row " << row;
      }
    }
    WEFT_CUDA_CHECK(cudaGraphExecDestroy(replay[std::size_t(r)]));
  }
  // The layout in place still copies out as ever.
  const auto layouts2 = ref::dispatch(config, second);
  for (int r = 0; r < R; ++r) {
    Owned o = poisoned(r, layouts2[std::size_t(r)].num_recv + kPaddingRows, false);
    eps[std::size_t(r)]->copy_out(targets(o, false, true, nullptr), ranks[std::size_t(r)].stream);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[std::size_t(r)].stream));
    eps[std::size_t(r)]->check();
    check_owned(r, o, layouts2[std::size_t(r)], false, true);
  }
}

// copy_out refuses what would leave rows unwritten or read the wrong source: no own_x after a
// deferring dispatch, own_x after one that did not defer, own_x of another T or row size; a
// deferring cached dispatch checks its num_sms as every call does, also at one rank, where it runs
// one block or none whatever num_sms says; and a deferring expanded dispatch is refused before
// anything is launched.
TEST_F(EpCopyOutTest, RefusesAMismatchedOwnSource) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 256, .num_experts = 8 * team_size(), .top_k = 4,
        .expand_factor = 1});
  std::mt19937 rng(std::random_device{}());
  const int64_t T = 48;
  auto inputs = make_inputs(config, R, {.tokens = std::vector<int64_t>(std::size_t(R), T)}, rng);
  for (auto& in : inputs) in.x_fp8 = ref::cast_to_fp8(config.hidden, in.num_tokens, in.x);
  put_inputs(inputs);
  const auto layouts = ref::dispatch(config, inputs);
  auto dispatch_all_ranks = [&](bool defer) {
    std::vector<DispatchResult> res;
    for (int r = 0; r < R; ++r) {
      DispatchInputs in = inputs_of(r, T);
      in.defer_own_rows = defer;
      res.push_back(eps[std::size_t(r)]->dispatch(in, ranks[std::size_t(r)].stream));
    }
    sync_all();
    return res;
  };
  const auto deferring = dispatch_all_ranks(true);
  const RankX bf16 = upload_x(0, inputs[0], Form::kBf16);
  const RankX packed = upload_x(0, inputs[0], Form::kPacked);
  Owned o = poisoned(0, layouts[0].num_recv, false);
  std::string what = error_of([&] { eps[0]->copy_out(targets(o, false, true, nullptr), nullptr); });
  EXPECT_TRUE(contains(what, "deferred its own rows")) << what;
  what = error_of([&] { eps[0]->copy_out(targets(o, false, true, &packed), nullptr); });
  EXPECT_TRUE(contains(what, "-byte rows")) << what;
  RankX shorter = upload_x(0, inputs[0], Form::kBf16);
  shorter.x_view.rows = T - 1;
  what = error_of([&] { eps[0]->copy_out(targets(o, false, true, &shorter), nullptr); });
  EXPECT_TRUE(contains(what, "tokens")) << what;
  RankX null_x = upload_x(0, inputs[0], Form::kBf16);
  null_x.x_view.data = nullptr;
  what = error_of([&] { eps[0]->copy_out(targets(o, false, true, &null_x), nullptr); });
  EXPECT_TRUE(contains(what, "x is null")) << what;
  // The refusals launched nothing: the right copy still gives every row.
  eps[0]->copy_out(targets(o, false, false, &bf16), ranks[0].stream);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[0].stream));
  EXPECT_EQ(download<uint16_t>(rank_device(0), o.x.ptr, layouts[0].recv_x.size()), layouts[0].recv_x);
  for (int num_sms : {-1, 1 << 20}) {
    DispatchInputs cached = inputs_of(0, T);
    cached.defer_own_rows = true;
    cached.topk_idx = {};
    cached.topk_weights = {};
    cached.handle = &deferring[0].handle;
    cached.num_sms = num_sms;
    what = error_of([&] { eps[0]->dispatch(cached, ranks[0].stream); });
    EXPECT_TRUE(contains(what, "num_sms")) << num_sms << ": " << what;
  }

  dispatch_all_ranks(false);
  what = error_of([&] { eps[0]->copy_out(targets(o, false, true, &bf16), nullptr); });
  EXPECT_TRUE(contains(what, "only for a dispatch that deferred")) << what;

  DispatchInputs in = inputs_of(0, T);
  in.defer_own_rows = true;
  in.expand = {.enabled = true};
  what = error_of([&] { eps[0]->dispatch(in, ranks[0].stream); });
  EXPECT_TRUE(contains(what, "deduplicated layout")) << what;
}

}  // namespace
