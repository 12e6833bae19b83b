// weft-ep-overlap-bench: how much of a weft::ep dispatch (and of a dispatch + combine) a
// concurrent bf16 GEMM hides. One process drives every local GPU, one host thread per GPU.
//
//   weft-ep-overlap-bench --tokens 8192 --hidden 7168 --topk 8 --experts 256
//                         --num-sms 16,24,32,48 --gemm-m 8192 --gemm-n 7168 --gemm-k 7168
//                         --warmup 5 --iters 20 [--no-combine]
//
// Per num_sms (the blocks of each EP kernel: the SMs the communication takes from the GEMM) and
// op (dispatch; disp+comb = dispatch then combine of the received rows), per iteration, the
// slowest rank, events around `iters` back-to-back iterations on the compute stream:
//   gemm_us    the GEMM alone (cuBLAS, bf16 in/out, fp32 accumulation) on the compute stream
//   comm_us    the op alone (synchronous form, on the compute stream)
//   serial_us  GEMM then op, one stream
//   ovl_us     GEMM on the compute stream and the op on the Buffer's comm stream, concurrently:
//              per iteration an Event of the compute stream (previous_event: the op waits for
//              the previous iteration, not for this iteration's GEMM), the async op
//              (async_finish), the GEMM, and the compute stream's wait on the op's Event. The
//              GEMM here is told to leave the op its SMs (cublasSetSmCountTarget: the device's
//              SMs minus the op's blocks, column gemm_sms): Hopper cuBLAS kernels are persistent
//              (one CTA per SM for the whole GEMM), so a GEMM sized for every SM keeps the op's
//              cooperative launch waiting until it ends. --no-sm-target shows that case.
//              --gemm-split: the GEMM is issued as two GEMMs over row blocks, the first (about as
//              long as the op: m * --split-factor * comm_us / gemm_us rows) on the SMs the op leaves,
//              the rest on every SM, so the GEMM gives up SMs only while the op runs.
//   hidden%    (serial - overlapped) / comm alone
//   hid_alone% (gemm alone + comm alone - overlapped) / comm alone: the same against the sum of
//              the two timed alone; serial can exceed that sum (each rank's op waits for the
//              slower rank's GEMM), which pushes hidden% up, even past 100%
//   gemm_sms   the SM count target of the overlapped GEMM (its first part with --gemm-split)
//   m_ovl      the rows of that part (all m without --gemm-split)
//   gemm_ovl   the GEMM's own time inside the overlapped loop (events around each GEMM)
//   slow%      gemm_ovl / gemm alone - 1
//   #wrong     after the overlapped loop, the window and the combine output are poisoned and
//              one more overlapped iteration runs: received rows, their sources and (disp+comb)
//              the combine output, element by element against the CPU reference.
// Exit status 1 on any wrong element or error, 2 when fewer than 2 GPUs are found (or fewer than
// --gpus asks for).
#include <CLI/CLI.hpp>
#include <cublas_v2.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/cublas_check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/event.hpp"
#include "weft/ep/reference.hpp"
#include "bench_inputs.hpp"
#include "bench_main.hpp"

namespace {

using weft::ep::DType;
using weft::ep::bench::DeviceBuffer;
using weft::ep::Event;
namespace ref = weft::ep::reference;

struct GemmShape {
  int m = 0, n = 0, k = 0;
};

// One GPU: its streams, cuBLAS handle, GEMM operands, EP inputs and timing events.
struct Rank {
  int device = 0;
  cudaStream_t compute = nullptr;
  cublasHandle_t cublas = nullptr;
  cublasHandle_t cublas_ovl = nullptr;  // the overlapped GEMM's: SM count target set per config
  DeviceBuffer a, b, c;  // [m, k], [k, n], [m, n] bf16 (column-major)
  weft::ep::bench::DeviceInputs in;
  DeviceBuffer out;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<cudaEvent_t> gemm_begin, gemm_end;  // per timed overlapped iteration
  weft::ep::DispatchResult last;                  // the latest dispatch's results

  // Rows [m0, m1) of C = A B (column-major, leading dimension m); the overlapped handle leaves
  // the op its SMs.
  void gemm(const GemmShape& s, bool overlapped = false, int m0 = 0, int m1 = -1) const {
    const float alpha = 1.0f, beta = 0.0f;
    if (m1 < 0) m1 = s.m;
    if (m1 <= m0) return;
    const auto* a_rows = a.as<const uint16_t>() + m0;
    auto* c_rows = c.as<uint16_t>() + m0;
    WEFT_CUBLAS_CHECK(cublasGemmEx(overlapped ? cublas_ovl : cublas, CUBLAS_OP_N, CUBLAS_OP_N,
                                   m1 - m0, s.n, s.k, &alpha, a_rows, CUDA_R_16BF, s.m, b.get(),
                                   CUDA_R_16BF, s.k, &beta, c_rows, CUDA_R_16BF, s.m,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

// What the command line asks for (see the file comment).
struct OverlapOptions {
  int64_t T = 8192, H = 7168;
  int K = 8, E = 256, warmup = 5, iters = 20, num_gpus = 0;
  std::vector<int> sms_list{16, 24, 32, 48};
  GemmShape shape{8192, 7168, 7168};
  bool no_combine = false, no_sm_target = false, gemm_split = false;
  double split_factor = 1.15;
};

std::size_t bf16_bytes(int64_t rows, int64_t cols) { return std::size_t(rows * cols * 2); }

// Every rank's compute stream, cuBLAS handles, GEMM operands, EP inputs and timing events.
std::vector<Rank> make_ranks(const OverlapOptions& o, const std::vector<ref::RankInput>& inputs) {
  const GemmShape& shape = o.shape;
  std::vector<Rank> rk(inputs.size());
  for (int r = 0; r < int(inputs.size()); ++r) {
    auto& d = rk[std::size_t(r)];
    d.device = r;
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&d.compute, cudaStreamNonBlocking));
    WEFT_CUBLAS_CHECK(cublasCreate(&d.cublas));
    WEFT_CUBLAS_CHECK(cublasSetStream(d.cublas, d.compute));
    WEFT_CUBLAS_CHECK(cublasCreate(&d.cublas_ovl));
    WEFT_CUBLAS_CHECK(cublasSetStream(d.cublas_ovl, d.compute));
    d.a = DeviceBuffer(bf16_bytes(shape.m, shape.k));
    d.b = DeviceBuffer(bf16_bytes(shape.k, shape.n));
    d.c = DeviceBuffer(bf16_bytes(shape.m, shape.n));
    // bf16 0x3C3C (about 0.0115): finite operands, the output cannot overflow.
    WEFT_CUDA_CHECK(cudaMemset(d.a.get(), 0x3C, bf16_bytes(shape.m, shape.k)));
    WEFT_CUDA_CHECK(cudaMemset(d.b.get(), 0x3C, bf16_bytes(shape.k, shape.n)));
    d.in = weft::ep::bench::upload_inputs(inputs[std::size_t(r)], o.H, o.K);
    d.out = DeviceBuffer(bf16_bytes(o.T, o.H));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.start));
    WEFT_CUDA_CHECK(cudaEventCreate(&d.stop));
    d.gemm_begin.resize(std::size_t(o.iters));
    d.gemm_end.resize(std::size_t(o.iters));
    for (int i = 0; i < o.iters; ++i) {
      WEFT_CUDA_CHECK(cudaEventCreate(&d.gemm_begin[std::size_t(i)]));
      WEFT_CUDA_CHECK(cudaEventCreate(&d.gemm_end[std::size_t(i)]));
    }
  }
  return rk;
}

void destroy_ranks(std::vector<Rank>& rk) {
  for (auto& d : rk) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    for (cudaEvent_t e : d.gemm_begin) WEFT_CUDA_CHECK(cudaEventDestroy(e));
    for (cudaEvent_t e : d.gemm_end) WEFT_CUDA_CHECK(cudaEventDestroy(e));
    WEFT_CUDA_CHECK(cudaEventDestroy(d.start));
    WEFT_CUDA_CHECK(cudaEventDestroy(d.stop));
    WEFT_CUBLAS_CHECK(cublasDestroy(d.cublas));
    WEFT_CUBLAS_CHECK(cublasDestroy(d.cublas_ovl));
    WEFT_CUDA_CHECK(cudaStreamDestroy(d.compute));
  }
}

// One host thread per GPU, each issuing its rank's iterations back to back (iteration(rank,
// i): i = -1 in the warmup); per iteration, the slowest rank's time (us).
template <typename Iteration>
double time_per_rank(std::vector<Rank>& rk, int warmup, int iters, Iteration&& iteration) {
  const auto R = rk.size();
  std::vector<float> ms(R, 0.f);
  std::barrier sync_point(static_cast<std::ptrdiff_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < int(R); ++r) {
    threads.emplace_back([&, r] {
      auto& d = rk[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaSetDevice(d.device));
      for (int i = 0; i < warmup; ++i) iteration(r, -1);
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      sync_point.arrive_and_wait();
      WEFT_CUDA_CHECK(cudaEventRecord(d.start, d.compute));
      for (int i = 0; i < iters; ++i) iteration(r, i);
      WEFT_CUDA_CHECK(cudaEventRecord(d.stop, d.compute));
      WEFT_CUDA_CHECK(cudaEventSynchronize(d.stop));
      WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms[std::size_t(r)], d.start, d.stop));
    });
  }
  for (auto& t : threads) t.join();
  return 1e3 * double(*std::max_element(ms.begin(), ms.end())) / iters;
}

// The GEMM's own time per iteration inside the overlapped loop (its events), the slowest rank.
double overlapped_gemm_us(const std::vector<Rank>& rk, int iters) {
  double slowest_us = 0.0;
  for (const auto& d : rk) {
    double sum_ms = 0.0;
    for (int i = 0; i < iters; ++i) {
      float ms = 0.f;
      WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, d.gemm_begin[std::size_t(i)], d.gemm_end[std::size_t(i)]));
      sum_ms += double(ms);
    }
    slowest_us = std::max(slowest_us, 1e3 * sum_ms / iters);
  }
  return slowest_us;
}

// Overwrites what the op writes (the received rows and sources, combine's output), so that the
// check after one more iteration sees only what that iteration wrote.
void poison_outputs(std::vector<Rank>& rk, int64_t T, int64_t H) {
  for (auto& d : rk) {
    WEFT_CUDA_CHECK(cudaSetDevice(d.device));
    WEFT_CUDA_CHECK(cudaMemset(const_cast<uint16_t*>(d.last.recv_x), 0xFF,
                               bf16_bytes(d.last.capacity, H)));
    WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(d.last.recv_src), 0x7F,
                               std::size_t(d.last.capacity * 8)));
    WEFT_CUDA_CHECK(cudaMemset(d.out.get(), 0xFF, bf16_bytes(T, H)));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

// Elements of the latest op's results that differ from the reference, every rank: received
// rows, their sources and (with_combine) combine's output; a received count that differs counts
// its missing or extra rows.
long count_wrong(std::vector<Rank>& rk, const std::vector<std::unique_ptr<weft::ep::Buffer>>& eps,
                 const std::vector<ref::RankLayout>& layouts,
                 const std::vector<std::vector<uint16_t>>& combined, bool with_combine,
                 int64_t H) {
  long wrong = 0;
  for (int r = 0; r < int(rk.size()); ++r) {
    auto& d = rk[std::size_t(r)];
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(d.compute));
    eps[std::size_t(r)]->check();
    const auto& L = layouts[std::size_t(r)];
    int32_t n = 0;
    WEFT_CUDA_CHECK(cudaMemcpy(&n, d.last.num_recv_device, 4, cudaMemcpyDeviceToHost));
    if (n != L.num_recv) {
      wrong += 1 + std::abs(int64_t(n) - L.num_recv) * H;
      continue;
    }
    std::vector<uint16_t> rows(L.recv_x.size());
    WEFT_CUDA_CHECK(cudaMemcpy(rows.data(), d.last.recv_x, rows.size() * 2, cudaMemcpyDeviceToHost));
    for (std::size_t j = 0; j < rows.size(); ++j) wrong += rows[j] != L.recv_x[j];
    std::vector<int32_t> src(std::size_t(n) * 2);
    WEFT_CUDA_CHECK(cudaMemcpy(src.data(), d.last.recv_src, src.size() * 4, cudaMemcpyDeviceToHost));
    for (std::size_t j = 0; j < std::size_t(n); ++j) {
      wrong += src[2 * j] != L.recv_src_rank[j];
      wrong += src[2 * j + 1] != L.recv_src_token[j];
    }
    if (with_combine) {
      const auto& want = combined[std::size_t(r)];
      std::vector<uint16_t> got(want.size());
      WEFT_CUDA_CHECK(cudaMemcpy(got.data(), d.out.get(), got.size() * 2, cudaMemcpyDeviceToHost));
      for (std::size_t j = 0; j < got.size(); ++j) wrong += got[j] != want[j];
    }
  }
  return wrong;
}

// One line of the table: the op (dispatch, or dispatch then combine) of `sms` blocks timed
// alone, after the GEMM and beside it, then checked. Returns its wrong elements.
long bench_op(const OverlapOptions& o, std::vector<Rank>& rk,
              const std::vector<std::unique_ptr<weft::ep::Buffer>>& eps,
              const std::vector<ref::RankLayout>& layouts,
              const std::vector<std::vector<uint16_t>>& combined, int sms, int gemm_sms,
              bool with_combine, double gemm_us) {
  const int64_t T = o.T, H = o.H;
  const int K = o.K;
  const GemmShape& shape = o.shape;
  const auto dispatch_inputs = [&](int r) {
    const auto& d = rk[std::size_t(r)];
    return weft::ep::DispatchInputs{.x = {d.in.x.get(), DType::kBFloat16, T, H},
                                    .topk_idx = {d.in.idx.get(), DType::kInt64, T, K},
                                    .topk_weights = {d.in.w.get(), DType::kFloat32, T, K},
                                    .num_sms = sms};
  };
  const auto combine_inputs = [&](const weft::ep::DispatchResult& res) {
    return weft::ep::CombineInputs{
        .expert_out = {res.recv_x, DType::kBFloat16, res.capacity, H}, .num_sms = sms};
  };
  // The op, synchronous, on the compute stream.
  const auto op_on_compute = [&](int r) {
    auto& d = rk[std::size_t(r)];
    auto& ep = *eps[std::size_t(r)];
    d.last = ep.dispatch(dispatch_inputs(r), d.compute);
    if (with_combine) ep.combine(combine_inputs(d.last), d.last.handle, d.out.get(), d.compute);
  };
  // The op on the comm stream next to the GEMM; i >= 0: the GEMM is timed with events.
  // Rows [0, split_rows) run on the SMs the op leaves, the rest (--gemm-split) on every SM.
  int split_rows = shape.m;
  const auto overlapped = [&](int r, int i) {
    auto& d = rk[std::size_t(r)];
    auto& ep = *eps[std::size_t(r)];
    const Event before = Event::record(d.compute);
    auto [res, done] = ep.dispatch(dispatch_inputs(r), d.compute,
                                   {.previous_event = before, .async_finish = true});
    d.last = res;
    if (with_combine) {
      done = ep.combine(combine_inputs(res), res.handle, d.out.get(), d.compute,
                        {.previous_event = done, .async_finish = true});
    }
    if (i >= 0) WEFT_CUDA_CHECK(cudaEventRecord(d.gemm_begin[std::size_t(i)], d.compute));
    d.gemm(shape, /*overlapped=*/true, 0, split_rows);
    d.gemm(shape, /*overlapped=*/false, split_rows, shape.m);
    if (i >= 0) WEFT_CUDA_CHECK(cudaEventRecord(d.gemm_end[std::size_t(i)], d.compute));
    done.wait();
  };
  const double comm_us = time_per_rank(rk, o.warmup, o.iters, [&](int r, int) { op_on_compute(r); });
  if (o.gemm_split) {  // a first part about as long as the op (split_factor: its fewer SMs)
    const double rows = double(shape.m) * std::min(1.0, o.split_factor * comm_us / gemm_us);
    split_rows = std::min(shape.m, (int(rows) + 127) / 128 * 128);
  }
  const double serial_us = time_per_rank(rk, o.warmup, o.iters, [&](int r, int) {
    rk[std::size_t(r)].gemm(shape);
    op_on_compute(r);
  });
  const double ovl_us = time_per_rank(rk, o.warmup, o.iters, overlapped);
  const double gemm_ovl = overlapped_gemm_us(rk, o.iters);

  poison_outputs(rk, T, H);
  for (int r = 0; r < int(rk.size()); ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(r));
    overlapped(r, -1);
  }
  const long wrong = count_wrong(rk, eps, layouts, combined, with_combine, H);
  std::printf("  %4d %-9s | %9.1f %9.1f %9.1f %9.1f %7.1f %10.1f | %8d %6d %9.1f %6.1f %7ld\n",
              eps[0]->num_blocks(T, sms), with_combine ? "disp+comb" : "dispatch", gemm_us,
              comm_us, serial_us, ovl_us, 100.0 * (serial_us - ovl_us) / comm_us,
              100.0 * (gemm_us + comm_us - ovl_us) / comm_us, gemm_sms, split_rows, gemm_ovl,
              100.0 * (gemm_ovl / gemm_us - 1.0), wrong);
  std::fflush(stdout);
  return wrong;
}

int run(int argc, char** argv) {
  CLI::App app{"weft-ep-overlap-bench: a weft::ep dispatch (and combine) hidden behind a GEMM"};
  OverlapOptions o;
  app.add_option("--tokens", o.T, "tokens per rank");
  app.add_option("--hidden", o.H, "hidden size");
  app.add_option("--topk", o.K, "top-k");
  app.add_option("--experts", o.E, "experts");
  app.add_option("--num-sms", o.sms_list, "blocks of each EP kernel (list)")
      ->delimiter(',')
      // 0 (every SM) would leave the GEMM no SMs to target.
      ->check(CLI::Range(1, weft::ep::bench::kMaxNumSms));
  app.add_option("--gemm-m", o.shape.m, "GEMM m");
  app.add_option("--gemm-n", o.shape.n, "GEMM n");
  app.add_option("--gemm-k", o.shape.k, "GEMM k");
  app.add_option("--warmup", o.warmup, "untimed iterations before each timing");
  app.add_option("--iters", o.iters, "timed iterations");
  app.add_option("--gpus", o.num_gpus, "GPUs (0 = all visible)")->check(CLI::Range(0, 1024));
  app.add_flag("--no-combine", o.no_combine, "only the dispatch rows");
  app.add_flag("--gemm-split", o.gemm_split,
               "overlapped GEMM in two parts: the op's length on the SMs it leaves, then all SMs");
  app.add_option("--split-factor", o.split_factor,
                 "--gemm-split: the first part's rows are m * factor * op time / GEMM time")
      ->check(CLI::Range(0.1, 4.0));
  app.add_flag("--no-sm-target", o.no_sm_target,
               "the overlapped GEMM may use every SM (no cublasSetSmCountTarget)");
  CLI11_PARSE(app, argc, argv);

  const int R = weft::ep::bench::gpus_to_drive("weft-ep-overlap-bench", o.num_gpus);
  if (R == 0) return weft::ep::bench::kExitTooFewGpus;
  const weft::ep::BufferConfig config{.max_tokens = o.T, .hidden = o.H, .num_experts = o.E,
                                      .top_k = o.K};
  auto eps = weft::ep::Buffer::create_local(R, config);
  std::mt19937 rng(12345);
  const auto inputs = weft::ep::bench::make_inputs(config, R, o.T, /*mask_ratio=*/0.0, rng);
  std::vector<Rank> rk = make_ranks(o, inputs);
  const auto layouts = ref::dispatch(config, inputs);
  std::vector<std::vector<uint16_t>> expert_out;  // combine's inputs: the received rows
  for (const auto& L : layouts) expert_out.push_back(L.recv_x);
  std::vector<std::vector<uint16_t>> combined;
  if (!o.no_combine) {
    for (int r = 0; r < R; ++r) combined.push_back(ref::combine(config, r, layouts, expert_out, {}, {}));
  }

  std::printf("# weft-ep-overlap-bench: %d ranks, T %ld, H %ld, top-%d of %d, GEMM %dx%dx%d bf16, "
              "warmup %d, iters %d\n", R, long(o.T), long(o.H), o.K, o.E, o.shape.m, o.shape.n,
              o.shape.k, o.warmup, o.iters);
  std::printf("# goal (2x H200, T 8192, H 7168, top-8 of 256): hidden >= 85%%\n");
  std::printf("# %4s %-9s | %9s %9s %9s %9s %7s %10s | %8s %6s %9s %6s %7s\n", "sms", "op",
              "gemm_us", "comm_us", "serial_us", "ovl_us", "hidden%", "hid_alone%", "gemm_sms",
              "m_ovl", "gemm_ovl", "slow%", "#wrong");
  long total_wrong = 0;
  const double gemm_us =
      time_per_rank(rk, o.warmup, o.iters, [&](int r, int) { rk[std::size_t(r)].gemm(o.shape); });
  int device_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0));
  for (int sms : o.sms_list) {
    const int gemm_sms = o.no_sm_target ? device_sms : device_sms - eps[0]->num_blocks(o.T, sms);
    for (auto& d : rk) {
      WEFT_CUBLAS_CHECK(cublasSetSmCountTarget(d.cublas_ovl, o.no_sm_target ? 0 : gemm_sms));
    }
    for (bool with_combine : {false, true}) {
      if (with_combine && o.no_combine) continue;
      total_wrong += bench_op(o, rk, eps, layouts, combined, sms, gemm_sms, with_combine, gemm_us);
    }
  }
  destroy_ranks(rk);
  std::printf("# total wrong elements: %ld\n", total_wrong);
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return weft::ep::bench::run_main("weft-ep-overlap-bench", [&] { return run(argc, argv); });
}
