// weft-ep-bench --virtual-team R[,R...]: weft::ep on a virtual team (Buffer::create_virtual_team):
// R simulated ranks on GPU 0, one GPU's memory standing in for NVLink. What it shows is the
// protocol's cost as R grows (count exchange, prefixes, barriers, flags: everything but the
// payload's link time), not NVLink bandwidth or link contention (docs/ep.md "Virtual team").
//
// Per (R, T) it times, per call (the slowest rank): an uncached dispatch, a cached dispatch of
// the same layout (no layout phase: the difference is the layout phase, count exchange and
// prefixes included), and a combine. Timing is of the device alone: every rank's stream first
// waits on a gate (a kernel spinning on a pinned host word), one host thread enqueues a batch of
// every rank's calls behind it, call i of every rank before call i + 1 of any (ranks' streams
// may share a hardware queue), then the gate opens; events after the gate and after the batch's
// last call; batches of at most kGatedRounds rounds, so that what waits behind a gate stays far
// below the device's queue of pending launches (a host blocked on a full queue would never open
// the gate; the gate also opens itself after kGateTimeoutNs). After the timed loops one more
// round is checked against the CPU reference (#wrong).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "bench_inputs.hpp"

namespace weft::ep::bench {

constexpr int kGatedRounds = 25;
constexpr uint64_t kGateTimeoutNs = 30'000'000'000ull;

// Holds its stream until *open (pinned host memory) is non-zero, or kGateTimeoutNs passed.
__global__ inline void gate_kernel(const volatile int* open) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*open == 0 && now - start < kGateTimeoutNs);
}

struct VirtualTeamShape {
  int64_t hidden = 7168;
  int top_k = 8;
  int num_experts = 256;
  double mask_ratio = 0.0;
  int warmup = 20;
  int iters = 100;
};

// One simulated rank: its stream, timing events, inputs and combine's output.
struct TeamRank {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  DeviceInputs in;
  DeviceBuffer out;
};

// The gate every rank's stream waits on while one batch of calls is enqueued (see the file
// comment): hold() closes it and puts it in front of every stream, release() opens it.
class Gate {
 public:
  Gate() {
    WEFT_CUDA_CHECK(cudaHostAlloc(&open_, sizeof(int), cudaHostAllocMapped));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&closed_, cudaEventDisableTiming));
  }
  ~Gate() {
    cudaEventDestroy(closed_);
    cudaStreamDestroy(stream_);
    cudaFreeHost(open_);
  }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  // Every rank's stream waits for the gate, then records its start event.
  void hold(std::vector<TeamRank>& ranks) {
    *reinterpret_cast<volatile int*>(open_) = 0;
    gate_kernel<<<1, 1, 0, stream_>>>(open_);
    WEFT_CUDA_CHECK_LAUNCH();
    WEFT_CUDA_CHECK(cudaEventRecord(closed_, stream_));
    for (auto& d : ranks) {
      WEFT_CUDA_CHECK(cudaStreamWaitEvent(d.stream, closed_, 0));
      WEFT_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    }
  }
  void release() { *reinterpret_cast<volatile int*>(open_) = 1; }

 private:
  int* open_ = nullptr;  // pinned, mapped: the gate kernel polls it
  cudaStream_t stream_ = nullptr;
  cudaEvent_t closed_ = nullptr;  // completes when the gate opens
};

inline std::vector<TeamRank> make_team_ranks(const std::vector<reference::RankInput>& inputs,
                                             int64_t T, int64_t H, int K) {
  std::vector<TeamRank> ranks(inputs.size());
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    auto& d = ranks[r];
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.start));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.stop));
    d.in = upload_inputs(inputs[r], H, K);
    d.out = DeviceBuffer(std::size_t(T * H * 2));
  }
  return ranks;
}

inline void destroy_team_ranks(std::vector<TeamRank>& ranks) {
  for (auto& d : ranks) {
    cudaEventDestroy(d.start);
    cudaEventDestroy(d.stop);
    cudaStreamDestroy(d.stream);
  }
}

// One call of every rank, round after round (op(r) enqueues rank r's call).
template <typename Op>
void run_rounds(int num_rounds, int num_ranks, Op&& op) {
  for (int i = 0; i < num_rounds; ++i) {
    for (int r = 0; r < num_ranks; ++r) op(r);
  }
}

// Per call, in µs: the sum over gated batches of the slowest rank's batch time, over the calls.
template <typename Op>
double time_gated(std::vector<TeamRank>& ranks, Gate& gate, const VirtualTeamShape& s, Op&& op) {
  const int R = int(ranks.size());
  run_rounds(s.warmup, R, op);
  for (auto& d : ranks) WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  double total_ms = 0;
  for (int done = 0; done < s.iters; done += kGatedRounds) {
    gate.hold(ranks);
    run_rounds(std::min(kGatedRounds, s.iters - done), R, op);
    for (auto& d : ranks) WEFT_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
    gate.release();
    float worst_ms = 0.f;
    for (auto& d : ranks) {
      WEFT_CUDA_CHECK(cudaEventSynchronize(d.stop));
      float ms = 0.f;
      WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, d.start, d.stop));
      worst_ms = std::max(worst_ms, ms);
    }
    total_ms += worst_ms;
  }
  return 1e3 * total_ms / s.iters;
}

// Elements of the latest round's results that differ from the reference, every rank: the
// count, every received row, every combined token.
inline long count_wrong_team(const std::vector<TeamRank>& ranks,
                             const std::vector<std::unique_ptr<Buffer>>& eps,
                             const std::vector<DispatchResult>& res, const BufferConfig& config,
                             const std::vector<reference::RankLayout>& layouts) {
  const int64_t H = config.hidden;
  std::vector<std::vector<uint16_t>> expert_out;
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  long wrong = 0;
  for (int r = 0; r < int(ranks.size()); ++r) {
    eps[std::size_t(r)]->check();
    const auto& L = layouts[std::size_t(r)];
    int32_t n = 0;
    WEFT_CUDA_CHECK(cudaMemcpy(&n, res[std::size_t(r)].num_recv_device, 4, cudaMemcpyDeviceToHost));
    std::vector<uint16_t> got(std::size_t(std::min<int64_t>(n, L.num_recv) * H));
    WEFT_CUDA_CHECK(cudaMemcpy(got.data(), res[std::size_t(r)].recv_x, got.size() * 2,
                               cudaMemcpyDeviceToHost));
    wrong += n != L.num_recv;
    for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != L.recv_x[i];
    const auto want = reference::combine(config, r, layouts, expert_out, {}, {});
    got.resize(want.size());
    WEFT_CUDA_CHECK(cudaMemcpy(got.data(), ranks[std::size_t(r)].out.get(), got.size() * 2,
                               cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
  }
  return wrong;
}

// One line of the table: a team of R ranks at T tokens per rank. Returns its wrong elements.
inline long bench_team(int R, int64_t T, const VirtualTeamShape& s, Gate& gate) {
  const BufferConfig config{.max_tokens = T, .hidden = s.hidden, .num_experts = s.num_experts,
                            .top_k = s.top_k};
  const int64_t H = s.hidden;
  const int K = s.top_k;
  std::mt19937 rng(12345 + uint32_t(T));
  const auto inputs = make_inputs(config, R, T, s.mask_ratio, rng);
  const auto layouts = reference::dispatch(config, inputs);
  auto eps = Buffer::create_virtual_team(R, config);
  std::vector<TeamRank> rk = make_team_ranks(inputs, T, H, K);
  std::vector<DispatchResult> res(static_cast<std::size_t>(R));
  std::vector<Handle> handles(static_cast<std::size_t>(R));
  auto dispatch = [&](int r, bool cached) {
    auto& d = rk[std::size_t(r)];
    DispatchInputs din{.x = {d.in.x.get(), DType::kBFloat16, T, H}};
    if (cached) {
      din.handle = &handles[std::size_t(r)];
    } else {
      din.topk_idx = {d.in.idx.get(), DType::kInt64, T, K};
      din.topk_weights = {d.in.w.get(), DType::kFloat32, T, K};
    }
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din, d.stream);
  };
  auto combine = [&](int r) {
    const auto& rr = res[std::size_t(r)];
    eps[std::size_t(r)]->combine({.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H}},
                                 rr.handle, rk[std::size_t(r)].out.get(), rk[std::size_t(r)].stream);
  };
  auto sync = [&] {
    for (auto& d : rk) WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  };
  const double dispatch_us = time_gated(rk, gate, s, [&](int r) { dispatch(r, false); });
  sync();
  for (int r = 0; r < R; ++r) handles[std::size_t(r)] = res[std::size_t(r)].handle;
  const double cached_us = time_gated(rk, gate, s, [&](int r) { dispatch(r, true); });
  const double combine_us = time_gated(rk, gate, s, combine);
  // One more round, checked.
  for (auto& d : rk) WEFT_CUDA_CHECK(cudaMemsetAsync(d.out.get(), 0xFF, std::size_t(T * H * 2), d.stream));
  run_rounds(1, R, [&](int r) { dispatch(r, false); });
  run_rounds(1, R, combine);
  sync();
  const long wrong = count_wrong_team(rk, eps, res, config, layouts);
  std::printf("  %4d %6ld %4d | %11.1f %11.1f %11.1f %11.1f | %7ld\n", R, long(T),
              eps[0]->num_blocks(T), dispatch_us, cached_us, dispatch_us - cached_us, combine_us,
              wrong);
  std::fflush(stdout);
  destroy_team_ranks(rk);
  return wrong;
}

// Runs the table for every R of team_sizes and T of tokens_list; returns the wrong elements.
inline long run_virtual_team(const std::vector<int>& team_sizes,
                             const std::vector<int64_t>& tokens_list, const VirtualTeamShape& s) {
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# virtual team on one %s (%d SMs): every rank's window in this GPU's memory, "
              "standing in for NVLink; no link bandwidth or contention is measured\n",
              prop.name, prop.multiProcessorCount);
  std::printf("# hidden %ld, topk %d, experts %d, mask %.2f, warmup %d, iters %d\n",
              long(s.hidden), s.top_k, s.num_experts, s.mask_ratio, s.warmup, s.iters);
  std::printf("# %4s %6s %4s | %11s %11s %11s %11s | %7s\n", "R", "tokens", "blk", "dispatch_us",
              "cached_us", "layout_us", "combine_us", "#wrong");
  Gate gate;
  long total_wrong = 0;
  for (int R : team_sizes) {
    for (int64_t T : tokens_list) total_wrong += bench_team(R, T, s, gate);
  }
  return total_wrong;
}

}  // namespace weft::ep::bench
