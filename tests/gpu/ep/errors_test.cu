// weft::ep's errors on every visible GPU (one process driving all of them): arguments the host
// can check (alignment, the device of every pointer, a modified Handle) throw before anything is
// launched; errors found on the device are of two kinds (docs/ep.md "Errors"): bad data leaves
// the Buffer usable, a timeout makes it refuse every later call, on the host and on the device.
// Results that are still produced are checked against the CPU reference element by element.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
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

namespace {

using weft::ep::BufferConfig;
using weft::ep::DType;
namespace ref = weft::ep::reference;
using weft::ep::testing::contains;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::EpTest;
using weft::ep::testing::error_of;
using weft::ep::testing::make_inputs;
using weft::ep::testing::make_team;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;
using weft::ep::testing::RankDevice;
using weft::ep::testing::RoutingSpec;
using weft::ep::testing::upload;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

class EpErrorsTest : public EpTest {
 protected:
  RoutingSpec spec_of(int64_t T, double mask_ratio = 0.0) const {
    return {.tokens = std::vector<int64_t>(std::size_t(R), T), .mask_ratio = mask_ratio};
  }
};

TEST_F(EpTest, BadInputIsAClearErrorAndTheBufferStaysUsable) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 8, .top_k = 2});
  std::mt19937 rng(5);
  RoutingSpec spec{.tokens = std::vector<int64_t>(std::size_t(R), 64)};
  auto inputs = make_inputs(config, R, spec, rng);
  const int64_t H = config.hidden;
  std::vector<RankDevice>& rd = ranks;
  for (int r = 0; r < R; ++r) {
    auto in = inputs[std::size_t(r)];
    if (r == 0) in.topk_idx[5] = 8;  // out of range
    rd[std::size_t(r)].x = upload(rank_device(r), in.x);
    rd[std::size_t(r)].idx = upload(rank_device(r), in.topk_idx);
    rd[std::size_t(r)].weights = upload(rank_device(r), in.topk_weights);
  }
  auto din = [&](int r, int64_t T) {
    return weft::ep::DispatchInputs{
        .x = {rd[std::size_t(r)].x.ptr, DType::kBFloat16, T, H},
        .topk_idx = {rd[std::size_t(r)].idx.ptr, DType::kInt64, T, 2},
        .topk_weights = {rd[std::size_t(r)].weights.ptr, DType::kFloat32, T, 2}};
  };
  // Host-visible errors: nothing is launched.
  auto& ep0 = *eps[0];
  auto bad = din(0, 64);
  bad.x.dtype = DType::kFloat32;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.topk_weights.dtype = DType::kBFloat16;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  // T above max_tokens is a result (tokens_overflow_test.cu); above int32 rows, refused.
  bad.x.rows = bad.topk_idx.rows = bad.topk_weights.rows = weft::ep::kMaxDispatchTokens + 1;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.x.rows = bad.topk_idx.rows = bad.topk_weights.rows = 65;
  bad.expand.enabled = true;  // the expanded dispatch keeps the host-side check of max_tokens
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  bad = din(0, 64);
  bad.x.cols = 120;
  EXPECT_THROW(ep0.dispatch(bad, rd[0].stream), weft::Error);
  EXPECT_THROW(make_team({.max_tokens = 8, .hidden = 12, .num_experts = 8, .top_k = 2}),
               weft::Error);

  // Device-found error: rank 0's out-of-range expert is reported, the call still completes.
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din(r, 64), rd[std::size_t(r)].stream,
                                                       weft::ep::CountMode::kExact);
  }
  try {
    eps[0]->wait_num_recv(res[0]);
    ADD_FAILURE() << "no error for an expert id out of range";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 8, out of range"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
  for (int r = 1; r < R; ++r) EXPECT_NO_THROW(eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]));
  // Handles: another Buffer's (at one rank: one whose Buffer id was changed), then a stale one.
  DeviceArray out(0, 64 * H * 2);
  weft::ep::Handle foreign = R > 1 ? res[1].handle : res[0].handle;
  if (R == 1) foreign.buffer_id += 1000;
  EXPECT_THROW(eps[0]->combine({.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, H}},
                               foreign, out.ptr, rd[0].stream),
               weft::Error);
  auto wrong_dtype = weft::ep::CombineInputs{.expert_out = {res[0].recv_x, DType::kFloat32, res[0].capacity, H}};
  EXPECT_THROW(eps[0]->combine(wrong_dtype, res[0].handle, out.ptr, rd[0].stream), weft::Error);
  // The Buffers still agree: a clean round works.
  inputs = make_inputs(config, R, spec, rng);
  round(inputs, false, 1, true, true);
  const auto old_handle = res[0].handle;
  EXPECT_THROW(eps[0]->combine({.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, H}},
                               old_handle, out.ptr, rd[0].stream),
               weft::Error);
}

// One rank never enters (rank 5 of 8, else the last): every other rank dispatches, times out
// waiting for that rank's counts and names it (not some live peer), and the call costs each of
// them one timeout, all at once. Every rank's tokens go to every rank (top-1 of two experts per
// rank, expert t mod E), so every live rank has work that needs the missing one.
TEST_F(EpTest, AMissingPeerTimesOutWithRankAndReason) {
  REQUIRE_PEERS();
  const double timeout_s = 0.3;
  const int num_experts = 2 * team_size();
  make({.max_tokens = 64, .hidden = 64, .num_experts = num_experts, .top_k = 1},
       {.timeout_s = timeout_s});
  const int missing = R > 5 ? 5 : R - 1;
  std::vector<int64_t> idx(64);
  for (std::size_t t = 0; t < idx.size(); ++t) idx[t] = int64_t(t) % num_experts;
  std::vector<float> w(64, 1.0f);
  std::vector<uint16_t> x(64 * 64, 0);
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    auto& rd = ranks[std::size_t(r)];
    rd.x = upload(rank_device(r), x);
    rd.idx = upload(rank_device(r), idx);
    rd.weights = upload(rank_device(r), w);
  }
  const auto start = Clock::now();
  for (int r = 0; r < R; ++r) {
    if (r == missing) continue;
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
        inputs_of(r, 64), ranks[std::size_t(r)].stream, weft::ep::CountMode::kExact);
  }
  for (int r = 0; r < R; ++r) {
    if (r == missing) continue;
    SCOPED_TRACE(testing::Message() << "rank " << r << " of " << R << ", rank " << missing
                                    << " missing");
    const std::string what =
        error_of([&] { eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]); });
    EXPECT_TRUE(contains(what, "rank " + std::to_string(r) + " timed out")) << what;
    EXPECT_TRUE(contains(what, "count vector")) << what;
    EXPECT_TRUE(contains(what, "from rank " + std::to_string(missing) + " in call")) << what;
  }
  EXPECT_LT(seconds_since(start), 3 * timeout_s) << "more than one timeout per call";
}

// Pointers the kernels could not use are refused before any launch, naming the argument: topk_idx
// misaligned for its element (8 bytes for int64, 4 for int32), topk_weights, x, the statistics,
// expert_out, out and biases misaligned; host memory (pageable or pinned); another GPU's memory.
// The Buffers stay usable.
TEST_F(EpErrorsTest, MisalignedOrForeignPointersAreClearErrors) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 8, .top_k = 2});
  std::mt19937 rng(3);
  const int64_t T = 64, H = config.hidden;
  const auto inputs = make_inputs(config, R, spec_of(T), rng);
  put_inputs(inputs);
  auto& ep0 = *eps[0];
  DeviceArray spare(0, std::size_t(T * H * 2 + 64));  // base + a few bytes stays inside it
  auto* at = static_cast<char*>(spare.ptr);
  std::vector<int64_t> pageable(std::size_t(T * H), 0);
  void* pinned = nullptr;
  WEFT_CUDA_CHECK(cudaMallocHost(&pinned, std::size_t(T * H * 2)));
  auto dispatch_error = [&](const weft::ep::DispatchInputs& in) {
    return error_of([&] { ep0.dispatch(in, ranks[0].stream); });
  };
  auto in = inputs_of(0, T);
  in.topk_idx.data = at + 4;
  EXPECT_TRUE(contains(dispatch_error(in), "topk_idx must be 8-byte aligned"));
  in = inputs_of(0, T);
  in.topk_idx = {at + 2, DType::kInt32, T, config.top_k};
  EXPECT_TRUE(contains(dispatch_error(in), "topk_idx must be 4-byte aligned"));
  in = inputs_of(0, T);
  in.topk_weights.data = at + 2;
  EXPECT_TRUE(contains(dispatch_error(in), "topk_weights must be 4-byte aligned"));
  in = inputs_of(0, T);
  in.x.data = at + 8;
  EXPECT_TRUE(contains(dispatch_error(in), "x must be 16-byte aligned"));
  in = inputs_of(0, T);
  in.cumulative_local_expert_recv_stats = reinterpret_cast<uint32_t*>(at + 2);
  EXPECT_TRUE(contains(dispatch_error(in), "cumulative_local_expert_recv_stats must be 4-byte"));
  in = inputs_of(0, T);
  in.topk_idx.data = pageable.data();
  std::string what = dispatch_error(in);
  EXPECT_TRUE(contains(what, "topk_idx") && contains(what, "host (not registered with CUDA)"))
      << what;
  in = inputs_of(0, T);
  in.x.data = pinned;
  what = dispatch_error(in);
  EXPECT_TRUE(contains(what, "x (") && contains(what, "pinned host memory")) << what;
  if (weft::cuda::device_count() > 1) {  // another GPU (on a virtual team: besides rank 0's)
    DeviceArray other(1, std::size_t(T * config.top_k * 8));
    in = inputs_of(0, T);
    in.topk_idx.data = other.ptr;
    what = dispatch_error(in);
    EXPECT_TRUE(contains(what, "is memory of device 1, not of the Buffer's device 0")) << what;
  }
  what = error_of([&] { weft::ep::cast_to_fp8(pageable.data(), 1, 128, at, nullptr); });
  EXPECT_TRUE(contains(what, "cast_to_fp8: x")) << what;

  const auto res = dispatch_all(inputs, weft::ep::CountMode::kExact);
  DeviceArray out(0, std::size_t(T * H * 2));
  auto combine_error = [&](const void* expert_out, const void* bias, void* out_ptr) {
    weft::ep::CombineInputs cin{.expert_out = {expert_out, DType::kBFloat16, res[0].capacity, H}};
    if (bias != nullptr) cin.bias0 = {bias, DType::kBFloat16, T, H};
    return error_of([&] { ep0.combine(cin, res[0].handle, out_ptr, ranks[0].stream); });
  };
  what = combine_error(at + 8, nullptr, out.ptr);
  EXPECT_TRUE(contains(what, "expert_out must be 16-byte aligned")) << what;
  what = combine_error(res[0].recv_x, at + 8, out.ptr);
  EXPECT_TRUE(contains(what, "bias0 must be 16-byte aligned")) << what;
  what = combine_error(res[0].recv_x, nullptr, pageable.data());
  EXPECT_TRUE(contains(what, "out (") && contains(what, "host (not registered")) << what;
  WEFT_CUDA_CHECK(cudaFreeHost(pinned));
  // Nothing was launched: the Buffers agree, a clean round works.
  round(make_inputs(config, R, spec_of(T, 0.2), rng), true, 1, true, true);
}

// A Handle whose fields were changed is refused by combine and cached dispatch (they take T and
// the kernel from the layout the Buffer keeps): T, num_recv, the expand options, the sequence, the
// Buffer. Nothing runs, the Buffers agree afterwards.
TEST_F(EpErrorsTest, AModifiedHandleIsRefused) {
  REQUIRE_GPUS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 8, .top_k = 2, .expand_factor = 4});
  std::mt19937 rng(11);
  const int64_t T = 64, H = config.hidden;
  auto inputs = make_inputs(config, R, spec_of(T), rng);
  put_inputs(inputs);
  DeviceArray out(0, std::size_t(T * H * 2));
  auto refused = [&](const weft::ep::DispatchResult& res, const weft::ep::Handle& h,
                     const std::string& reason) {
    SCOPED_TRACE(reason);
    weft::ep::CombineInputs cin{.expert_out = {res.recv_x, DType::kBFloat16, res.capacity, H}};
    EXPECT_TRUE(contains(error_of([&] { eps[0]->combine(cin, h, out.ptr, ranks[0].stream); }),
                         reason));
    weft::ep::DispatchInputs cached{.x = {ranks[0].x.ptr, DType::kBFloat16, h.num_tokens, H},
                                    .handle = &h};
    EXPECT_TRUE(contains(error_of([&] { eps[0]->dispatch(cached, ranks[0].stream); }), reason));
  };
  for (bool expanded : {false, true}) {
    SCOPED_TRACE(testing::Message() << "expanded " << expanded);
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      auto din = inputs_of(r, T);
      if (expanded) din.expand = {.enabled = true, .expert_alignment = 4, .zero_padding = true};
      res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din, ranks[std::size_t(r)].stream,
                                                         weft::ep::CountMode::kExact);
    }
    for (int r = 0; r < R; ++r) eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]);
    const weft::ep::Handle good = res[0].handle;
    weft::ep::Handle h = good;
    h.num_tokens -= 1;
    refused(res[0], h, "does not match the layout");
    h = good;
    h.num_recv += 1;
    refused(res[0], h, "does not match the layout");
    h = good;
    h.expand.enabled = !expanded;  // the other kernel
    refused(res[0], h, "does not match the layout");
    h = good;
    h.expand.zero_padding = !h.expand.zero_padding;
    if (expanded) refused(res[0], h, "does not match the layout");
    h = good;
    h.sequence += 1;
    refused(res[0], h, "stale");
    h = good;
    h.buffer_id += 1000;
    refused(res[0], h, "another Buffer");
  }
  round(make_inputs(config, R, spec_of(T, 0.1), rng), true, 1, true, true);
}

// The device keeps the number of the layout in place and checks it: a combine captured in a CUDA
// graph for one layout and replayed after a new dispatch (which the host cannot see) is skipped
// on every rank with an error, out unwritten; the Buffers stay usable.
TEST_F(EpErrorsTest, AGraphReplayedOverAnotherLayoutIsSkipped) {
  REQUIRE_GPUS();
  make({.max_tokens = 256, .hidden = 256, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(17);
  const int64_t H = config.hidden;
  const auto first = make_inputs(config, R, spec_of(256), rng);
  put_inputs(first);
  const auto res1 = dispatch_all(first, weft::ep::CountMode::kExact);
  std::vector<DeviceArray> out(static_cast<std::size_t>(R));
  std::vector<cudaGraphExec_t> replay(std::size_t(R), nullptr);
  for (int r = 0; r < R; ++r) {
    const auto& rr = res1[std::size_t(r)];
    out[std::size_t(r)] = DeviceArray(rank_device(r), std::size_t(256 * H * 2));
    WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(256 * H * 2)));
    cudaStream_t s = ranks[std::size_t(r)].stream;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                 rr.handle, out[std::size_t(r)].ptr, s);
    cudaGraph_t graph = nullptr;
    WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&replay[std::size_t(r)], graph, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  auto second = make_inputs(config, R, spec_of(100, 0.1), rng);
  put_inputs(second);
  const auto res2 = dispatch_all(second, weft::ep::CountMode::kExact);
  for (int r = 0; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaGraphLaunch(replay[std::size_t(r)], ranks[std::size_t(r)].stream));
  }
  wait_all();
  for (int r = 0; r < R; ++r) {
    const std::string what = error_of([&] { eps[std::size_t(r)]->check(); });
    EXPECT_TRUE(contains(what, "layout of dispatch " + std::to_string(res1[0].handle.sequence) +
                                   " ran while the layout of dispatch " +
                                   std::to_string(res2[0].handle.sequence)))
        << what;
    const auto got = download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, std::size_t(256 * H));
    EXPECT_EQ(std::count(got.begin(), got.end(), uint16_t(0xFFFF)), std::ptrdiff_t(got.size()))
        << "rank " << r << ": out was written";
    WEFT_CUDA_CHECK(cudaGraphExecDestroy(replay[std::size_t(r)]));
  }
  // The layout in place combines as ever.
  const auto layouts = ref::dispatch(config, second);
  std::vector<std::vector<uint16_t>> expert_out;
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  for (int r = 0; r < R; ++r) {
    const auto& rr = res2[std::size_t(r)];
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(256 * H * 2)));
    eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                 rr.handle, out[std::size_t(r)].ptr, ranks[std::size_t(r)].stream);
  }
  sync_all();
  for (int r = 0; r < R; ++r) {
    eps[std::size_t(r)]->check();
    const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
    EXPECT_EQ(download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, want.size()), want) << "rank " << r;
  }
}

// Rank 0's expert_out has half the rows it received (CountMode::kOnDevice: only the device
// knows the count). Rank 0 reads none of them and reports it; it marks the rows it would have
// sent as failed, so every peer reports rank 0 at once (no timeout) and writes the tokens rank 0
// does not contribute to; no rank writes a token it lacks a row for. The Buffers stay usable.
TEST_F(EpErrorsTest, CombineWithTooFewExpertOutRowsIsOneClearError) {
  REQUIRE_GPUS();
  const double timeout_s = 5.0;
  make({.max_tokens = 256, .hidden = 256, .num_experts = 16, .top_k = 4}, {.timeout_s = timeout_s});
  std::mt19937 rng(23);
  const int64_t H = config.hidden;
  const auto inputs = make_inputs(config, R, spec_of(256, 0.1), rng);
  const auto layouts = ref::dispatch(config, inputs);
  put_inputs(inputs);
  const auto res = dispatch_all(inputs, weft::ep::CountMode::kOnDevice);
  sync_all();
  std::vector<std::vector<uint16_t>> expert_out(static_cast<std::size_t>(R));
  std::vector<DeviceArray> expert_dev(static_cast<std::size_t>(R));
  std::vector<DeviceArray> out(static_cast<std::size_t>(R));
  const int64_t short_rows = layouts[0].num_recv / 2;
  ASSERT_GT(layouts[0].num_recv, short_rows);
  for (int r = 0; r < R; ++r) {
    auto& e = expert_out[std::size_t(r)];
    e.resize(std::size_t(layouts[std::size_t(r)].num_recv * H));
    for (auto& v : e) v = ref::identity_bf16(40 + r, int64_t(rng() % 100000), 1);
    // Rank 0's device array holds exactly its short_rows rows: a read past them is out of bounds.
    const int64_t given_elements = r == 0 ? short_rows * H : int64_t(e.size());
    const std::vector<uint16_t> given(e.begin(), e.begin() + given_elements);
    expert_dev[std::size_t(r)] = upload(rank_device(r), given);
    out[std::size_t(r)] = DeviceArray(rank_device(r), std::size_t(256 * H * 2));
    WEFT_CUDA_CHECK(cudaMemset(out[std::size_t(r)].ptr, 0xFF, std::size_t(256 * H * 2)));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const auto start = Clock::now();
  for (int r = 0; r < R; ++r) {
    const int64_t rows = r == 0 ? short_rows : layouts[std::size_t(r)].num_recv;
    eps[std::size_t(r)]->combine(
        {.expert_out = {expert_dev[std::size_t(r)].ptr, DType::kBFloat16, rows, H}},
        res[std::size_t(r)].handle, out[std::size_t(r)].ptr, ranks[std::size_t(r)].stream);
  }
  wait_all();
  EXPECT_LT(seconds_since(start), timeout_s / 2) << "a rank waited out its timeout";
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    const auto& L = layouts[std::size_t(r)];
    bool needs_rank0 = false;  // some token of rank r has a row at rank 0
    for (int64_t t = 0; t < L.num_tokens; ++t) needs_rank0 |= L.send_slot[std::size_t(t * R)] >= 0;
    const std::string what =
        r == 0 || needs_rank0 ? error_of([&] { eps[std::size_t(r)]->check(); }) : std::string();
    if (r == 0) {
      EXPECT_TRUE(contains(what, " rows were received but expert_out has only " +
                                     std::to_string(short_rows) + " rows"))
          << what;
    } else if (needs_rank0) {
      EXPECT_TRUE(contains(what, "rank 0 sent no rows")) << what;
    }
    const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
    const auto got = download<uint16_t>(rank_device(r), out[std::size_t(r)].ptr, want.size());
    for (int64_t t = 0; t < L.num_tokens; ++t) {
      const bool written = r != 0 && L.send_slot[std::size_t(t * R)] < 0;
      for (int64_t h = 0; h < H; ++h) {
        const auto i = std::size_t(t * H + h);
        ASSERT_EQ(got[i], written ? want[i] : uint16_t(0xFFFF)) << "token " << t << " column " << h;
      }
    }
  }
  round(make_inputs(config, R, spec_of(256, 0.2), rng), true, 1, true, true);
}

// Rank 0 dispatches alone (T = 2048: grid mode) with a bad expert id and times out waiting for
// its peers. The timeout is what the host sees (the earlier bad-data error does not hide it), and
// from then on every call on that Buffer throws it: on the host, and on the device a call
// launched before the host could know does nothing (it neither waits again nor runs on the
// counts and barrier arrivals the failed call left).
TEST_F(EpErrorsTest, ATimeoutMakesTheBufferRefuseEveryLaterCall) {
  REQUIRE_PEERS();
  const double timeout_s = 1.0;
  make({.max_tokens = 2048, .hidden = 128, .num_experts = 2 * team_size(), .top_k = 2},
       {.timeout_s = timeout_s});
  std::mt19937 rng(29);
  auto inputs = make_inputs(config, R, spec_of(2048), rng);
  inputs[0].topk_idx[10] = config.num_experts;  // out of range, found before the wait
  put_inputs(inputs);
  const auto in0 = inputs_of(0, 2048);
  const auto start = Clock::now();
  auto first = eps[0]->dispatch(in0, ranks[0].stream, weft::ep::CountMode::kExact);
  const auto second = eps[0]->dispatch(in0, ranks[0].stream);  // queued behind the failing call
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[0].stream));
  EXPECT_LT(seconds_since(start), 1.8 * timeout_s) << "the queued call waited for its peers too";
  const std::string what = error_of([&] { eps[0]->wait_num_recv(first); });
  EXPECT_TRUE(contains(what, "rank 0 timed out")) << what;
  EXPECT_TRUE(contains(what, "refuses every call")) << what;
  DeviceArray out(0, std::size_t(2048 * config.hidden * 2));
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(contains(error_of([&] { eps[0]->check(); }), "rank 0 timed out"));
    EXPECT_TRUE(
        contains(error_of([&] { eps[0]->dispatch(in0, ranks[0].stream); }), "rank 0 timed out"));
    EXPECT_TRUE(contains(error_of([&] {
                           eps[0]->combine({.expert_out = {second.recv_x, DType::kBFloat16,
                                                           second.capacity, config.hidden}},
                                           second.handle, out.ptr, ranks[0].stream);
                         }),
                         "rank 0 timed out"));
  }
}

// One rank (5 of 8, else the last) times out waiting for its peers, which call late (after its
// timeout): every one of them finds that rank's failure in its done flags and reports it,
// instead of returning rows that rank never wrote.
TEST_F(EpErrorsTest, ARankThatTimedOutFailsItsLatePeers) {
  REQUIRE_PEERS();
  make({.max_tokens = 64, .hidden = 128, .num_experts = 2 * team_size(), .top_k = 2},
       {.timeout_s = 0.5});
  const int failed = R > 5 ? 5 : R - 1;
  std::mt19937 rng(31);
  const auto inputs = make_inputs(config, R, spec_of(64), rng);
  put_inputs(inputs);
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  const auto f = std::size_t(failed);
  res[f] = eps[f]->dispatch(inputs_of(failed, 64), ranks[f].stream, weft::ep::CountMode::kExact);
  // The peers call once that rank's kernel has ended (at its first wait's timeout): a fixed sleep
  // is not enough where the kernel starts late (a sanitizer, a GPU shared with other processes),
  // and a late start lets it meet its peers in time and fail only in a later wait.
  WEFT_CUDA_CHECK(cudaSetDevice(rank_device(failed)));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[f].stream));
  for (int r = 0; r < R; ++r) {
    if (r == failed) continue;
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(
        inputs_of(r, 64), ranks[std::size_t(r)].stream, weft::ep::CountMode::kExact);
  }
  const std::string name = "rank " + std::to_string(failed);
  std::string what = error_of([&] { eps[f]->wait_num_recv(res[f]); });
  EXPECT_TRUE(contains(what, name + " timed out")) << what;
  // A peer's counts reach the host when its count exchange ends, which the failed rank took
  // part in: wait_num_recv may return before the payload phase finds the failure, so the
  // failure is thrown there or else by check() after the stream (the Buffer's contract).
  for (int r = 0; r < R; ++r) {
    if (r == failed) continue;
    const auto i = std::size_t(r);
    what = error_of([&] {
      eps[i]->wait_num_recv(res[i]);
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[i].stream));
      eps[i]->check();
    });
    EXPECT_TRUE(contains(what, name + " failed call")) << "rank " << r << ": " << what;
  }
}

// Rank 0 combines alone and times out waiting for its peers' entry; they combine late (after
// its timeout), find rank 0's rows marked as failed by a broken rank and report rank 0 at once,
// instead of timing out on rows that never come or returning tokens they lack.
TEST_F(EpErrorsTest, ARankWhoseCombineTimedOutFailsItsLatePeers) {
  REQUIRE_PEERS();
  const double timeout_s = 0.5;
  make({.max_tokens = 64, .hidden = 128, .num_experts = 2 * team_size(), .top_k = 2},
       {.timeout_s = timeout_s});
  std::mt19937 rng(41);
  const auto inputs = make_inputs(config, R, spec_of(64), rng);
  put_inputs(inputs);
  const auto res = dispatch_all(inputs, weft::ep::CountMode::kExact);
  std::vector<DeviceArray> out;
  for (int r = 0; r < R; ++r) out.emplace_back(rank_device(r), std::size_t(64 * config.hidden * 2));
  auto combine = [&](int r) {
    const auto& d = res[std::size_t(r)];
    eps[std::size_t(r)]->combine(
        {.expert_out = {d.recv_x, DType::kBFloat16, d.capacity, config.hidden}}, d.handle,
        out[std::size_t(r)].ptr, ranks[std::size_t(r)].stream);
  };
  combine(0);
  // The peers combine once rank 0's kernel has ended at its timeout (not after a fixed sleep: a
  // kernel that starts late would meet them in time).
  WEFT_CUDA_CHECK(cudaSetDevice(rank_device(0)));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[0].stream));
  const auto start = Clock::now();
  for (int r = 1; r < R; ++r) combine(r);
  for (int r = 1; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[std::size_t(r)].stream));
  }
  EXPECT_LT(seconds_since(start), 0.5 * timeout_s) << "a late peer waited out a timeout";
  std::string what = error_of([&] { eps[0]->check(); });
  EXPECT_TRUE(contains(what, "rank 0 timed out")) << what;
  for (int r = 1; r < R; ++r) {
    what = error_of([&] { eps[std::size_t(r)]->check(); });
    EXPECT_TRUE(contains(what, "rank 0 failed call")) << "rank " << r << ": " << what;
  }
}

// Only rank 0 combines: its peers never store back. With 4 blocks, 2048 tokens of 2 pieces each
// are about 37 rounds of reduce units per warp; the first wait that times out breaks the rank for
// the rest of the call, so the call costs one timeout, not one per round nor one per missing peer
// (R - 1 of them here).
TEST_F(EpErrorsTest, ADeadPeerCostsCombineOneTimeout) {
  REQUIRE_PEERS();
  const double timeout_s = 0.5;
  make({.max_tokens = 2048, .hidden = 2048, .num_experts = 2 * team_size(), .top_k = 4},
       {.num_sms = 4, .timeout_s = timeout_s});
  std::mt19937 rng(37);
  const auto inputs = make_inputs(config, R, spec_of(2048), rng);
  put_inputs(inputs);
  const auto res = dispatch_all(inputs, weft::ep::CountMode::kExact);
  DeviceArray out(0, std::size_t(2048 * config.hidden * 2));
  const auto start = Clock::now();
  eps[0]->combine({.expert_out = {res[0].recv_x, DType::kBFloat16, res[0].capacity, config.hidden}},
                  res[0].handle, out.ptr, ranks[0].stream);
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(ranks[0].stream));
  EXPECT_LT(seconds_since(start), 6 * timeout_s) << "more than one timeout per call";
  const std::string what = error_of([&] { eps[0]->check(); });
  EXPECT_TRUE(contains(what, "rank 0 timed out")) << what;
}

}  // namespace
