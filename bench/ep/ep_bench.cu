// weft-ep-bench: nccl-tests-style benchmark of weft::ep dispatch and combine (one process driving
// every local GPU), against a baseline built on NCCL's own collectives, on the same inputs.
//
//   weft-ep-bench --tokens 128,8192 --hidden 7168 --topk 8 --experts 256 --num-sms 0
//                 --tokens-per-block 4 --send-warps 4 --warmup 20 --iters 100
//                 [--fp8] [--cached] [--stats] [--expand [--expert-alignment N] [--zero-padding]]
//
// --fp8: dispatch moves packed fp8 rows (made once by weft::ep::cast_to_fp8, not timed; the
// logical/nvlink GB/s of dispatch then count the packed row bytes, padding included); combine
// takes bf16 expert outputs (the bf16 dispatch's rows, from the reference). --cached: dispatch is
// timed as a cached dispatch (handle= of one uncached dispatch before the loop: no layout
// phase). --stats: every dispatch also accumulates cumulative_local_expert_recv_stats (the
// kernel variant with the accumulation). --expand: the expanded layout (one row per (token, local
// expert) in segments aligned to --expert-alignment rows, padding zeroed with --zero-padding);
// each configuration's Buffer gets the smallest expand_factor its routing fits in (printed);
// dispatch's rows are the real ones (not padding), combine's the (token, rank) sums it sends
// back; no NCCL baseline (it has no expanded layout); with --cached, the handle's expanded layout.
//
// The `blk` column is the blocks of each kernel: ceil(T / tokens-per-block), at most num-sms.
//
// Columns, per call (the slowest rank): time_us, host_us (the issuing thread's time per call),
// logical GB/s = received rows x row bytes / time
// (counts rows a rank sends to itself; DeepEP's figure), nvlink GB/s = rows that crossed to a peer
// x row bytes / time, #wrong = elements that differ from the CPU reference after the timed loop.
// Dispatch is timed in the no-host-sync mode (CountMode::kOnDevice), layout included: back-to-back
// calls, events around the loop. Baseline (NCCL): layout kernel, counts exchange (grouped
// ncclSend/ncclRecv), host sync, permute kernel, grouped ncclSend/ncclRecv of the rows; combine:
// the reverse send/recv and an un-permute + fp32 reduce kernel. Exit status 1 on any wrong element
// or error, 2 when fewer than 2 GPUs are found (or fewer than --gpus asks for).
//
//   weft-ep-bench --virtual-team 2,4,8 --tokens 128,8192 [--hidden/--topk/--experts/--mask-ratio
//                 --warmup --iters]
//
// --virtual-team: R simulated ranks on GPU 0 instead of one rank per GPU (virtual_team_bench.hpp:
// one GPU's memory standing in for NVLink, so the protocol's cost as R grows shows, not link
// bandwidth); per (R, T) the device time of an uncached dispatch, a cached one, their difference
// (the layout phase) and a combine; bf16, deduplicated layout, no NCCL baseline.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <barrier>
#include <thread>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/reference.hpp"
#include "bench_inputs.hpp"
#include "device_buffer.hpp"
#include "bench_main.hpp"
#include "virtual_team_bench.hpp"

namespace {

using weft::ep::DType;
using weft::ep::bench::DeviceBuffer;
namespace ref = weft::ep::reference;

// ---- baseline kernels ----------------------------------------------------------------------
// pos[t*R+d] = position of token t among the rows this rank sends to d (or -1); counts[d].
__global__ void baseline_layout(const int64_t* idx, int64_t T, int K, int epr, int R,
                                int32_t* pos, int32_t* counts) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < T;
       t += int64_t(gridDim.x) * blockDim.x) {
    uint32_t mask = 0;
    for (int k = 0; k < K; ++k) {
      const int64_t e = idx[t * K + k];
      if (e >= 0) mask |= 1u << (e / epr);
    }
    for (int d = 0; d < R; ++d) pos[t * R + d] = (mask >> d & 1u) ? atomicAdd(&counts[d], 1) : -1;
  }
}
// Warp per (token, destination): row to send[offset[d] + pos].
__global__ void baseline_permute(const int4* x, int64_t T, int R, int64_t n16, const int32_t* pos,
                                 const int32_t* offsets, int4* send) {
  const int lane = threadIdx.x % 32;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < T * R;
       w += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t t = w / R;
    const int d = int(w % R);
    const int32_t p = pos[t * R + d];
    if (p < 0) continue;
    for (int64_t i = lane; i < n16; i += 32) send[(offsets[d] + p) * n16 + i] = x[t * n16 + i];
  }
}
// Warp per token: out[t] = sum over d of back[offset[d] + pos] in fp32.
__global__ void baseline_unpermute(const uint32_t* back, int64_t T, int R, int64_t n2,
                                   const int32_t* pos, const int32_t* offsets, uint32_t* out) {
  const int lane = threadIdx.x % 32;
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < T;
       t += int64_t(gridDim.x) * blockDim.x / 32) {
    for (int64_t i = lane; i < n2; i += 32) {
      float a = 0.f, b = 0.f;
      for (int d = 0; d < R; ++d) {
        const int32_t p = pos[t * R + d];
        if (p < 0) continue;
        const uint32_t w = back[(offsets[d] + p) * n2 + i];
        a += __uint_as_float(w << 16);
        b += __uint_as_float(w & 0xffff0000u);
      }
      const uint32_t lo = __float_as_uint(a), hi = __float_as_uint(b);
      const uint32_t rl = (lo + 0x7FFFu + ((lo >> 16) & 1u)) >> 16;
      const uint32_t rh = (hi + 0x7FFFu + ((hi >> 16) & 1u)) >> 16;
      out[t * n2 + i] = rl | (rh << 16);
    }
  }
}

struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  weft::ep::bench::DeviceInputs in;
  DeviceBuffer out;
  DeviceBuffer x_fp8;       // --fp8: [T, fp8 row bytes]
  DeviceBuffer expert_out;  // --fp8: [num_recv, H] bf16 for combine
  DeviceBuffer stats;       // --stats: [E / R] uint32
  // baseline: pos, counts, offsets int32
  DeviceBuffer pos, counts, offsets, send, recv, back;
  cudaEvent_t start = nullptr, stop = nullptr;
};

// --expand: the rows the most loaded rank needs (aligned segments), as the reference counts them.
int64_t expanded_rows_needed(const weft::ep::BufferConfig& c, int R,
                             const std::vector<ref::RankInput>& inputs, int alignment) {
  std::vector<int64_t> count(std::size_t(c.num_experts), 0);
  for (const auto& in : inputs) {
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int k = 0; k < c.top_k; ++k) {
        const int64_t e = in.topk_idx[std::size_t(t * c.top_k + k)];
        bool repeated = false;
        for (int k2 = 0; k2 < k; ++k2) repeated |= in.topk_idx[std::size_t(t * c.top_k + k2)] == e;
        if (e >= 0 && !repeated) ++count[std::size_t(e)];
      }
    }
  }
  const int epr = c.num_experts / R;
  int64_t most = 0;
  for (int d = 0; d < R; ++d) {
    int64_t rows = 0;
    for (int e = 0; e < epr; ++e) {
      rows += (count[std::size_t(d * epr + e)] + alignment - 1) / alignment * alignment;
    }
    most = std::max(most, rows);
  }
  return most;
}

// What the command line asks for (see the file comment).
struct BenchOptions {
  std::vector<int64_t> tokens_list{128, 8192};
  std::vector<int64_t> hidden_list{7168};
  std::vector<int> topk_list{8};
  std::vector<int> experts_list{256};
  std::vector<int> sms_list{0};
  std::vector<int> send_warps_list{weft::ep::BufferOptions{}.combine_send_warps};
  std::vector<int> tpb_list{weft::ep::BufferOptions{}.tokens_per_block};
  bool send_warps_given = false;  // --send-warps was on the command line
  int warmup = 20, iters = 100, num_gpus = 0;
  double mask_ratio = 0.0;
  bool no_baseline = false, fp8 = false, cached = false, stats = false;
  weft::ep::ExpandOptions expand;
  std::vector<int> virtual_team;  // --virtual-team: the team sizes; empty: one rank per GPU
};

// One point of the sweep.
struct Shape {
  int64_t num_tokens = 0;  // T per rank
  int64_t hidden = 0;
  int top_k = 0;
  int num_experts = 0;
  int num_sms = 0;
  int tokens_per_block = 0;
  int send_warps = 0;  // combine_send_warps, or expanded_combine_send_warps with --expand
};

// The rows of the most loaded rank (each maximum taken on its own): rows received and those of
// them from peers (padding rows do not count), and the rows combine sends back, one per
// (token, rank) pair, which expanded is fewer than the rows received.
struct RowsMoved {
  int64_t max_recv = 0, max_remote = 0, max_back = 0, max_back_remote = 0;
};

RowsMoved count_rows_moved(const std::vector<ref::RankLayout>& layouts, int R, int64_t T) {
  RowsMoved m;
  for (int r = 0; r < R; ++r) {
    const auto& L = layouts[std::size_t(r)];
    int64_t recv = 0, remote = 0, back = 0, back_remote = 0;
    std::vector<std::vector<bool>> seen(static_cast<std::size_t>(R));
    for (int s = 0; s < R; ++s) seen[std::size_t(s)].assign(std::size_t(T), false);
    for (int64_t j = 0; j < L.num_recv; ++j) {
      const int s = L.recv_src_rank[std::size_t(j)];
      if (s < 0) continue;
      ++recv;
      remote += s != r;
      const auto t = std::size_t(L.recv_src_token[std::size_t(j)]);
      if (seen[std::size_t(s)][t]) continue;
      seen[std::size_t(s)][t] = true;
      ++back;
      back_remote += s != r;
    }
    m.max_recv = std::max(m.max_recv, recv);
    m.max_remote = std::max(m.max_remote, remote);
    m.max_back = std::max(m.max_back, back);
    m.max_back_remote = std::max(m.max_back_remote, back_remote);
  }
  return m;
}

// Every rank's stream, timing events, inputs on its device and combine's output.
std::vector<Rank> make_ranks(const std::vector<ref::RankInput>& inputs, int64_t T, int64_t H,
                             int K) {
  std::vector<Rank> ranks(inputs.size());
  for (int r = 0; r < int(inputs.size()); ++r) {
    auto& d = ranks[std::size_t(r)];
    d.device = r;
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.start));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.stop));
    d.in = weft::ep::bench::upload_inputs(inputs[std::size_t(r)], H, K);
    d.out = DeviceBuffer(std::size_t(T * H * 2));
  }
  return ranks;
}

void destroy_ranks(std::vector<Rank>& ranks) {
  for (auto& d : ranks) {
    cudaSetDevice(d.device);
    cudaEventDestroy(d.start);
    cudaEventDestroy(d.stop);
    cudaStreamDestroy(d.stream);
  }
}

// --fp8: each rank's packed rows (cast on the GPU) and combine's bf16 expert outputs (the bf16
// dispatch's rows, from the reference). --stats: each rank's zeroed accumulator.
void upload_fp8_and_stats(std::vector<Rank>& ranks, const std::vector<ref::RankLayout>& layouts,
                          const BenchOptions& options, int64_t T, int64_t H,
                          int64_t fp8_row_bytes, int num_local_experts) {
  for (int r = 0; r < int(ranks.size()); ++r) {
    auto& d = ranks[std::size_t(r)];
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    if (options.fp8) {
      d.x_fp8 = DeviceBuffer(std::size_t(T * fp8_row_bytes));
      weft::ep::cast_to_fp8(d.in.x.get(), T, H, d.x_fp8.get(), d.stream);
      const auto& recv = layouts[std::size_t(r)].recv_x;
      d.expert_out = DeviceBuffer(std::max<std::size_t>(recv.size() * 2, 16));
      WEFT_CUDA_CHECK(cudaMemcpy(d.expert_out.get(), recv.data(), recv.size() * 2, cudaMemcpyHostToDevice));
    }
    if (options.stats) {
      d.stats = DeviceBuffer(std::size_t(num_local_experts) * 4);
      WEFT_CUDA_CHECK(cudaMemset(d.stats.get(), 0, std::size_t(num_local_experts) * 4));
    }
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  }
}

// weft::ep is timed as it is deployed: one host thread per GPU (a process per GPU has the same),
// each issuing its rank's calls back to back; events on each rank's stream. Returns the slowest
// rank's device time per call, in µs; host_us[r]: rank r's issuing thread's time per call (launch
// cost; a time near it means the figure is bound by the host, not by the device).
template <typename Op>
double time_per_rank(std::vector<Rank>& ranks, int warmup, int iters, Op&& op,
                     std::vector<double>& host_us) {
  const auto R = ranks.size();
  host_us.assign(R, 0.0);
  std::vector<float> ms(R, 0.f);
  std::barrier sync_point(static_cast<std::ptrdiff_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < int(R); ++r) {
    threads.emplace_back([&, r] {
      auto& d = ranks[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(d.device));
      for (int i = 0; i < warmup; ++i) op(r);
      WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
      sync_point.arrive_and_wait();
      WEFT_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
      const auto issue_begin = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) op(r);
      host_us[std::size_t(r)] = std::chrono::duration<double, std::micro>(
                                    std::chrono::steady_clock::now() - issue_begin).count() / iters;
      WEFT_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
      WEFT_CUDA_CHECK(cudaEventSynchronize(d.stop));
      WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms[std::size_t(r)], d.start, d.stop));
    });
  }
  for (auto& t : threads) t.join();
  return 1e3 * double(*std::max_element(ms.begin(), ms.end())) / iters;
}

// The baseline's timing: one host thread issues every rank's calls (NCCL's grouped calls over
// several communicators need one thread, and its host sync per call dominates its host cost
// anyway). Returns the slowest rank's device time per call, in µs.
template <typename Body>
double time_loop(std::vector<Rank>& ranks, int warmup, int iters, Body&& body) {
  for (int i = 0; i < warmup; ++i) body();
  for (auto& d : ranks) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
    WEFT_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
  }
  for (int i = 0; i < iters; ++i) body();
  float worst_ms = 0.f;
  for (auto& d : ranks) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    WEFT_CUDA_CHECK(cudaEventRecord(d.stop, d.stream));
    WEFT_CUDA_CHECK(cudaEventSynchronize(d.stop));
    float ms = 0.f;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, d.start, d.stop));
    worst_ms = std::max(worst_ms, ms);
  }
  return 1e3 * double(worst_ms) / iters;
}

// Elements of combine's output on rank r that differ from the reference's.
long count_wrong_combine(const Rank& d, const weft::ep::BufferConfig& config, int r,
                         const std::vector<ref::RankLayout>& layouts,
                         const std::vector<std::vector<uint16_t>>& expert_out) {
  const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
  std::vector<uint16_t> got(want.size());
  WEFT_CUDA_CHECK(cudaMemcpy(got.data(), d.out.get(), got.size() * 2, cudaMemcpyDeviceToHost));
  long wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
  return wrong;
}

// Elements of rank r's dispatch result (rows and sources) that differ from the reference's; a
// received count that differs counts its missing or extra rows. Padding rows of an expanded
// dispatch without zero padding hold whatever was there and are not compared.
long count_wrong_dispatch(const weft::ep::DispatchResult& res, const ref::RankLayout& L,
                          const ref::RankLayout& fp8_layout, const BenchOptions& options,
                          int64_t H, int64_t fp8_row_bytes) {
  int32_t n = 0;
  WEFT_CUDA_CHECK(cudaMemcpy(&n, res.num_recv_device, 4, cudaMemcpyDeviceToHost));
  if (n != L.num_recv) return 1 + std::abs(n - L.num_recv) * H;
  auto compared = [&](int64_t j) {
    return options.expand.zero_padding || L.recv_src_rank[std::size_t(j)] >= 0;
  };
  long wrong = 0;
  if (options.fp8) {  // packed rows, byte for byte
    const auto& want_rows = fp8_layout.recv_x_fp8;
    std::vector<uint8_t> got(want_rows.size());
    WEFT_CUDA_CHECK(cudaMemcpy(got.data(), res.recv_x_fp8, got.size(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < got.size(); ++i) {
      wrong += compared(int64_t(i) / fp8_row_bytes) && got[i] != want_rows[i];
    }
  } else {
    std::vector<uint16_t> got(std::size_t(n * H));
    WEFT_CUDA_CHECK(cudaMemcpy(got.data(), res.recv_x, got.size() * 2, cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < got.size(); ++i) {
      wrong += compared(int64_t(i) / H) && got[i] != L.recv_x[i];
    }
  }
  std::vector<int32_t> src(std::size_t(n * 2));
  WEFT_CUDA_CHECK(cudaMemcpy(src.data(), res.recv_src, src.size() * 4, cudaMemcpyDeviceToHost));
  for (int64_t j = 0; j < n; ++j) {
    wrong += src[std::size_t(2 * j)] != L.recv_src_rank[std::size_t(j)];
    wrong += src[std::size_t(2 * j + 1)] != L.recv_src_token[std::size_t(j)];
  }
  return wrong;
}

struct BaselineTimes {
  double dispatch_us = 0, combine_us = 0;
};

// The baseline on NCCL collectives, same inputs: layout kernel, counts exchange, host sync,
// permute kernel, grouped send/recv of the rows; combine the reverse and an un-permute + fp32
// reduce. Its round trip is checked against the reference too (sanity of the comparison).
BaselineTimes time_nccl_baseline(std::vector<Rank>& rk, const weft::ep::BufferConfig& config,
                                 const std::vector<ref::RankLayout>& layouts,
                                 const std::vector<std::vector<uint16_t>>& expert_out,
                                 const BenchOptions& options) {
  const int R = int(rk.size());
  const int64_t T = config.max_tokens, H = config.hidden;
  const int K = config.top_k, epr = config.num_experts / R;
  const int64_t n16 = H * 2 / 16;
  auto nccl = weft::cuda::Communicators::init_all(R);
  const int64_t cap = T * R;
  for (auto& d : rk) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    d.pos = DeviceBuffer(std::size_t(T * R * 4));
    d.counts = DeviceBuffer(std::size_t(2 * R * 4));
    d.offsets = DeviceBuffer(std::size_t(R * 4));
    d.send = DeviceBuffer(std::size_t(cap * H * 2));
    d.recv = DeviceBuffer(std::size_t(cap * H * 2));
    d.back = DeviceBuffer(std::size_t(cap * H * 2));
  }
  std::vector<std::vector<int32_t>> send_counts(static_cast<std::size_t>(R), std::vector<int32_t>(static_cast<std::size_t>(R)));
  std::vector<std::vector<int32_t>> recv_counts = send_counts;
  // Grouped ncclSend/ncclRecv of exact-size row blocks, one per peer in rank order: the
  // dispatch direction sends `send` and receives `recv`; back = true returns `recv` into `back`.
  auto exchange_rows = [&](bool back) {
    WEFT_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < R; ++r) {
      auto& d = rk[std::size_t(r)];
      const auto& out_counts = back ? recv_counts[std::size_t(r)] : send_counts[std::size_t(r)];
      const auto& in_counts = back ? send_counts[std::size_t(r)] : recv_counts[std::size_t(r)];
      char* out = (back ? d.recv : d.send).as<char>();
      char* in = (back ? d.back : d.recv).as<char>();
      int64_t out_rows = 0, in_rows = 0;
      for (int p = 0; p < R; ++p) {
        const int64_t num_out = out_counts[std::size_t(p)], num_in = in_counts[std::size_t(p)];
        WEFT_NCCL_CHECK(ncclSend(out + out_rows * H * 2, std::size_t(num_out * H), ncclBfloat16, p,
                                 nccl[std::size_t(r)], d.stream));
        WEFT_NCCL_CHECK(ncclRecv(in + in_rows * H * 2, std::size_t(num_in * H), ncclBfloat16, p,
                                 nccl[std::size_t(r)], d.stream));
        out_rows += num_out;
        in_rows += num_in;
      }
    }
    WEFT_NCCL_CHECK(ncclGroupEnd());
  };
  auto base_dispatch = [&] {
    for (int r = 0; r < R; ++r) {
      auto& d = rk[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      WEFT_CUDA_CHECK(cudaMemsetAsync(d.counts.as<int32_t>(), 0, std::size_t(2 * R * 4), d.stream));
      baseline_layout<<<132, 256, 0, d.stream>>>(d.in.idx.as<const int64_t>(), T, K, epr, R, d.pos.as<int32_t>(), d.counts.as<int32_t>());
      WEFT_CUDA_CHECK_LAUNCH();
    }
    WEFT_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < R; ++r) {
      auto& d = rk[std::size_t(r)];
      for (int p = 0; p < R; ++p) {
        WEFT_NCCL_CHECK(ncclSend(d.counts.as<int32_t>() + p, 1, ncclInt32, p, nccl[std::size_t(r)], d.stream));
        WEFT_NCCL_CHECK(ncclRecv(d.counts.as<int32_t>() + R + p, 1, ncclInt32, p, nccl[std::size_t(r)], d.stream));
      }
    }
    WEFT_NCCL_CHECK(ncclGroupEnd());
    for (int r = 0; r < R; ++r) {  // the host sync the baseline needs for its sizes
      auto& d = rk[std::size_t(r)];
      std::vector<int32_t> c(std::size_t(2 * R));
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      WEFT_CUDA_CHECK(cudaMemcpyAsync(c.data(), d.counts.as<int32_t>(), c.size() * 4, cudaMemcpyDeviceToHost, d.stream));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
      for (int p = 0; p < R; ++p) {
        send_counts[std::size_t(r)][std::size_t(p)] = c[std::size_t(p)];
        recv_counts[std::size_t(r)][std::size_t(p)] = c[std::size_t(R + p)];
      }
      std::vector<int32_t> off(static_cast<std::size_t>(R));
      for (int p = 1; p < R; ++p) off[std::size_t(p)] = off[std::size_t(p - 1)] + c[std::size_t(p - 1)];
      WEFT_CUDA_CHECK(cudaMemcpyAsync(d.offsets.as<int32_t>(), off.data(), off.size() * 4, cudaMemcpyHostToDevice, d.stream));
      baseline_permute<<<132, 512, 0, d.stream>>>(d.in.x.as<const int4>(), T, R, n16, d.pos.as<int32_t>(), d.offsets.as<int32_t>(), d.send.as<int4>());
      WEFT_CUDA_CHECK_LAUNCH();
    }
    exchange_rows(false);
  };
  auto base_combine = [&] {
    exchange_rows(true);
    for (int r = 0; r < R; ++r) {
      auto& d = rk[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(r));
      baseline_unpermute<<<132, 512, 0, d.stream>>>(d.back.as<const uint32_t>(), T, R, H / 2, d.pos.as<int32_t>(), d.offsets.as<int32_t>(), d.out.as<uint32_t>());
      WEFT_CUDA_CHECK_LAUNCH();
    }
  };
  BaselineTimes times;
  times.dispatch_us = time_loop(rk, options.warmup, options.iters, base_dispatch);
  times.combine_us = time_loop(rk, options.warmup, options.iters, base_combine);
  base_dispatch();
  base_combine();
  long base_wrong = 0;
  for (int r = 0; r < R; ++r) {
    auto& d = rk[std::size_t(r)];
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
    base_wrong += count_wrong_combine(d, config, r, layouts, expert_out);
    for (DeviceBuffer* b : {&d.pos, &d.counts, &d.offsets, &d.send, &d.recv, &d.back}) *b = {};
  }
  if (base_wrong != 0) std::printf("# baseline round trip: %ld wrong elements (baseline only)\n", base_wrong);
  return times;
}

// What the sweep prints of one call of one configuration.
struct CallFigures {
  double us = 0;           // device time per call, the slowest rank
  double host_us = 0;      // the issuing thread's time per call, the slowest rank
  long num_wrong = 0;      // elements that differ from the reference
  double baseline_us = 0;  // the NCCL baseline's time per call; 0: not run
};

// The dispatch and combine lines of one configuration (the columns of the file comment).
void print_shape_lines(const BenchOptions& options, const Shape& shape, int num_blocks,
                       const RowsMoved& rows, int64_t fp8_row_bytes, const CallFigures& dispatch,
                       const CallFigures& combine) {
  auto line = [&](const char* op, double num_rows, double num_remote_rows, double row_bytes,
                  const CallFigures& f) {
    std::printf("  %-6ld %6ld %4d %5d %4d %3d | %-8s %9.1f %8.1f %8.1f %8.1f %7ld | %9.1f %8.2f\n",
                long(shape.num_tokens), long(shape.hidden), shape.top_k, shape.num_experts,
                num_blocks, shape.send_warps, op, f.us, f.host_us,
                num_rows * row_bytes / f.us / 1e3, num_remote_rows * row_bytes / f.us / 1e3,
                f.num_wrong, f.baseline_us, f.baseline_us > 0 ? f.baseline_us / f.us : 0.0);
  };
  const bool expanded = options.expand.enabled, fp8 = options.fp8;
  const double bf16_row_bytes = double(shape.hidden) * 2;
  line(expanded ? (fp8 ? "dexp-fp8" : "disp-exp") : (fp8 ? "disp-fp8" : "dispatch"),
       double(rows.max_recv), double(rows.max_remote),
       fp8 ? double(fp8_row_bytes) : bf16_row_bytes, dispatch);
  line(expanded ? "comb-exp" : "combine", double(rows.max_back), double(rows.max_back_remote),
       bf16_row_bytes, combine);
  std::fflush(stdout);
}

// One configuration: weft::ep's dispatch and combine timed, then checked against the reference,
// then the baseline; prints the two lines. Returns the wrong elements of weft::ep's results.
long bench_shape(const BenchOptions& options, const Shape& shape, int R) {
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const int K = shape.top_k;
  const bool fp8 = options.fp8;
  const weft::ep::ExpandOptions& expand = options.expand;
  weft::ep::BufferConfig config{.max_tokens = T, .hidden = H, .num_experts = shape.num_experts,
                                .top_k = K};
  std::mt19937 rng(12345 + uint32_t(T));
  auto inputs = weft::ep::bench::make_inputs(config, R, T, options.mask_ratio, rng);
  std::vector<Rank> rk = make_ranks(inputs, T, H, K);
  if (expand.enabled) {  // the smallest capacity this routing fits in
    const int64_t rows = expanded_rows_needed(config, R, inputs, expand.expert_alignment);
    config.expand_factor = int(std::max<int64_t>((rows + R * T - 1) / (R * T), 1));
    std::printf("# tokens %ld: expand_factor %d (%ld rows needed at the most loaded rank)\n",
                long(T), config.expand_factor, long(rows));
  }
  weft::ep::BufferOptions buffer_options{.num_sms = shape.num_sms,
                                         .tokens_per_block = shape.tokens_per_block};
  (expand.enabled ? buffer_options.expanded_combine_send_warps
                  : buffer_options.combine_send_warps) = shape.send_warps;
  auto eps = weft::ep::Buffer::create_local(R, config, buffer_options);
  const auto layouts = ref::dispatch(config, inputs, {.expand = expand});
  if (fp8) {  // the reference moves the same packed rows the GPU cast makes (bit-identical)
    for (auto& in : inputs) in.x_fp8 = ref::cast_to_fp8(H, T, in.x);
  }
  const int64_t fp8_row_bytes = fp8 ? weft::ep::fp8_row_layout(H).row_bytes : 0;
  const auto fp8_layouts =
      fp8 ? ref::dispatch(config, inputs, {.fp8 = true, .expand = expand}) : layouts;
  upload_fp8_and_stats(rk, layouts, options, T, H, fp8_row_bytes, config.num_experts / R);
  const RowsMoved rows = count_rows_moved(layouts, R, T);

  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  std::vector<weft::ep::Handle> handles;  // --cached: the layout every timed call reuses
  auto dispatch_rank = [&](int r) {
    auto& d = rk[std::size_t(r)];
    weft::ep::DispatchInputs din;
    if (fp8) {
      din.x = {d.x_fp8.get(), DType::kUInt8, T, fp8_row_bytes};
    } else {
      din.x = {d.in.x.get(), DType::kBFloat16, T, H};
    }
    if (handles.empty()) {
      din.topk_idx = {d.in.idx.get(), DType::kInt64, T, K};
      din.topk_weights = {d.in.w.get(), DType::kFloat32, T, K};
    } else {
      din.handle = &handles[std::size_t(r)];
    }
    din.cumulative_local_expert_recv_stats = d.stats.as<uint32_t>();
    din.expand = expand;
    res[std::size_t(r)] = eps[std::size_t(r)]->dispatch(din, d.stream);
  };
  auto combine_rank = [&](int r) {
    auto& d = rk[std::size_t(r)];
    const auto& rr = res[std::size_t(r)];
    weft::ep::CombineInputs cin;
    if (fp8) {
      cin.expert_out = {d.expert_out.get(), DType::kBFloat16, layouts[std::size_t(r)].num_recv, H};
    } else {
      cin.expert_out = {rr.recv_x, DType::kBFloat16, rr.capacity, H};
    }
    eps[std::size_t(r)]->combine(cin, rr.handle, d.out.get(), d.stream);
  };
  if (options.cached) {  // one uncached dispatch computes the layout the timed calls reuse
    for (int r = 0; r < R; ++r) dispatch_rank(r);
    for (const auto& rr : res) handles.push_back(rr.handle);
  }

  std::vector<double> host_us;
  const double dispatch_us = time_per_rank(rk, options.warmup, options.iters, dispatch_rank, host_us);
  const double dispatch_host_us = *std::max_element(host_us.begin(), host_us.end());
  for (int r = 0; r < R; ++r) dispatch_rank(r);
  for (auto& d : rk) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  }
  const double combine_us = time_per_rank(rk, options.warmup, options.iters, combine_rank, host_us);
  const double combine_host_us = *std::max_element(host_us.begin(), host_us.end());

  // Correctness of what the timed calls produce: one more round, every element checked.
  for (auto& d : rk) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    WEFT_CUDA_CHECK(cudaMemsetAsync(d.out.get(), 0xFF, std::size_t(T * H * 2), d.stream));
  }
  for (int r = 0; r < R; ++r) dispatch_rank(r);
  for (int r = 0; r < R; ++r) combine_rank(r);
  long wrong_dispatch = 0, wrong_combine = 0;
  std::vector<std::vector<uint16_t>> expert_out;
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  for (int r = 0; r < R; ++r) {
    auto& d = rk[std::size_t(r)];
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.stream));
    eps[std::size_t(r)]->check();
    wrong_dispatch += count_wrong_dispatch(res[std::size_t(r)], layouts[std::size_t(r)],
                                           fp8_layouts[std::size_t(r)], options, H, fp8_row_bytes);
    wrong_combine += count_wrong_combine(d, config, r, layouts, expert_out);
  }

  BaselineTimes baseline;
  if (!options.no_baseline && !expand.enabled) {
    baseline = time_nccl_baseline(rk, config, layouts, expert_out, options);
  }
  print_shape_lines(options, shape, eps[0]->num_blocks(T), rows, fp8_row_bytes,
                    {dispatch_us, dispatch_host_us, wrong_dispatch, baseline.dispatch_us},
                    {combine_us, combine_host_us, wrong_combine, baseline.combine_us});
  destroy_ranks(rk);
  return wrong_dispatch + wrong_combine;
}

// --virtual-team: every (team size, T) of every shape on GPU 0 (virtual_team_bench.hpp).
int bench_virtual_teams(const BenchOptions& options) {
  WEFT_CHECK(!options.fp8 && !options.cached && !options.stats && !options.expand.enabled &&
                 !options.send_warps_given,
             "--virtual-team times bf16 deduplicated dispatch, cached dispatch and combine with "
             "the default options; --fp8, --cached, --stats, --expand and --send-warps do not "
             "apply");
  if (weft::cuda::device_count() < 1) {
    std::fprintf(stderr, "weft-ep-bench --virtual-team needs a GPU, found none\n");
    return weft::ep::bench::kExitTooFewGpus;
  }
  long wrong = 0;
  for (int64_t H : options.hidden_list)
  for (int K : options.topk_list)
  for (int E : options.experts_list) {
    wrong += weft::ep::bench::run_virtual_team(
        options.virtual_team, options.tokens_list,
        {.hidden = H, .top_k = K, .num_experts = E, .mask_ratio = options.mask_ratio,
         .warmup = options.warmup, .iters = options.iters});
  }
  std::printf("# total wrong elements: %ld\n", wrong);
  return wrong == 0 ? 0 : 1;
}

// One rank per GPU: every combination of the lists, one bench_shape each.
int bench_sweep(const BenchOptions& options) {
  const int R = weft::ep::bench::gpus_to_drive("weft-ep-bench", options.num_gpus);
  if (R == 0) return weft::ep::bench::kExitTooFewGpus;
  std::printf("# weft-ep-bench: %d ranks, warmup %d, iters %d, mask %.2f%s%s%s\n", R,
              options.warmup, options.iters, options.mask_ratio, options.fp8 ? ", fp8" : "",
              options.cached ? ", cached" : "", options.stats ? ", stats" : "");
  if (options.expand.enabled) {
    std::printf("# expanded layout: expert alignment %d, zero padding %s, no NCCL baseline\n",
                options.expand.expert_alignment, options.expand.zero_padding ? "on" : "off");
  }
  std::printf("# %-6s %6s %4s %5s %4s %3s | %-8s %9s %8s %8s %8s %7s | %9s %8s\n", "tokens", "hidden",
              "topk", "exp", "blk", "sw", "op", "time_us", "host_us", "logGB/s", "nvlGB/s", "#wrong",
              "nccl_us", "ratio");
  std::vector<int> send_warps_list = options.send_warps_list;
  if (options.expand.enabled && !options.send_warps_given) {
    send_warps_list = {weft::ep::BufferOptions{}.expanded_combine_send_warps};
  }
  long total_wrong = 0;
  for (int64_t T : options.tokens_list)
  for (int64_t H : options.hidden_list)
  for (int K : options.topk_list)
  for (int E : options.experts_list)
  for (int sms : options.sms_list)
  for (int tpb : options.tpb_list)
  for (int send_warps : send_warps_list) {
    total_wrong += bench_shape(options, {.num_tokens = T, .hidden = H, .top_k = K,
                                         .num_experts = E, .num_sms = sms,
                                         .tokens_per_block = tpb, .send_warps = send_warps},
                               R);
  }
  std::printf("# total wrong elements: %ld\n", total_wrong);
  return total_wrong == 0 ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"weft-ep-bench: weft::ep dispatch/combine vs an NCCL all-to-all baseline"};
  BenchOptions o;
  app.add_option("--tokens", o.tokens_list, "tokens per rank (list)")->delimiter(',');
  app.add_option("--hidden", o.hidden_list, "hidden size (list)")->delimiter(',');
  app.add_option("--topk", o.topk_list, "top-k (list)")->delimiter(',');
  app.add_option("--experts", o.experts_list, "experts (list)")->delimiter(',');
  app.add_option("--num-sms", o.sms_list, "blocks per kernel, 0 = all SMs (list)")
      ->delimiter(',')
      ->check(CLI::Range(0, weft::ep::bench::kMaxNumSms));
  app.add_option("--tokens-per-block", o.tpb_list, "tokens per block (list)")->delimiter(',');
  auto* send_warps_option =
      app.add_option("--send-warps", o.send_warps_list,
                     "combine store-back warps per block (list; with --expand: "
                     "expanded_combine_send_warps)")
          ->delimiter(',');
  app.add_option("--warmup", o.warmup, "untimed calls before timing");
  app.add_option("--iters", o.iters, "timed calls");
  app.add_option("--gpus", o.num_gpus, "GPUs (0 = all visible)")->check(CLI::Range(0, 1024));
  app.add_option("--mask-ratio", o.mask_ratio, "fraction of selections set to -1");
  app.add_flag("--no-baseline", o.no_baseline, "skip the NCCL baseline");
  app.add_flag("--fp8", o.fp8, "dispatch packed fp8 rows (hidden a multiple of 128)");
  app.add_flag("--cached", o.cached, "time dispatch with handle= (no layout phase)");
  app.add_flag("--stats", o.stats, "accumulate cumulative_local_expert_recv_stats in dispatch");
  app.add_flag("--expand", o.expand.enabled, "the expanded layout (one row per token and expert)");
  app.add_option("--expert-alignment", o.expand.expert_alignment,
                 "--expand: rows per segment are rounded up to this");
  app.add_flag("--zero-padding", o.expand.zero_padding, "--expand: zero the padding rows");
  app.add_option("--virtual-team", o.virtual_team,
                 "ranks of a virtual team on GPU 0 (list, each 1..32): one GPU's memory stands in "
                 "for NVLink")
      ->delimiter(',')
      ->check(CLI::Range(1, 32));
  CLI11_PARSE(app, argc, argv);
  o.send_warps_given = send_warps_option->count() != 0;
  return o.virtual_team.empty() ? bench_sweep(o) : bench_virtual_teams(o);
}

}  // namespace

int main(int argc, char** argv) {
  // A virtual team's ranks share one device's hardware work queues: ask for the most (read when
  // the CUDA context is made, so before any CUDA call; virtual_team_bench.hpp).
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).starts_with("--virtual-team")) {
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
    }
  }
  return weft::ep::bench::run_main("weft-ep-bench", [&] { return run(argc, argv); });
}
