// weft::ep's asynchronous calls on 2+ GPUs (one process driving all of them): the comm stream,
// previous_event / async_finish / allocate_on_comm_stream, Event and EventScope, and the bounded
// host run-ahead (pipeline_depth). Ordering is tested with work that would make a result wrong if
// an event did not order the streams: a slow kernel (a spin on the global timer) delays the
// producer of an input, so a call that did not wait for it reads poisoned memory, and a consumer
// that did not wait for a call reads the poisoned window. Every result is checked element by
// element against the CPU reference.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"
#include "weft/ep/event.hpp"
#include "weft/ep/reference.hpp"
#include "device_array.hpp"
#include "team.hpp"

namespace {

using weft::ep::AsyncOptions;
using weft::ep::BufferConfig;
using weft::ep::DType;
using weft::ep::Event;
namespace ref = weft::ep::reference;
using weft::ep::testing::DeviceArray;
using weft::ep::testing::download;
using weft::ep::testing::upload;

using weft::ep::testing::make_team;
using weft::ep::testing::rank_device;
using weft::ep::testing::team_size;

// Holds its stream for `ns` nanoseconds of the device's global timer (one thread).
__global__ void sleep_kernel(uint64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void sleep_on(int device, cudaStream_t stream, double ms) {
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  sleep_kernel<<<1, 1, 0, stream>>>(uint64_t(ms * 1e6));
  WEFT_CUDA_CHECK_LAUNCH();
}

// A finite bf16 that names (round, rank, token, column): a row from another round or rank, or
// misrouted, cannot look plausible.
uint16_t identity_value(uint64_t round, int rank, int64_t token, int64_t col) {
  uint64_t x = (round << 44) ^ (uint64_t(rank) << 56) ^ (uint64_t(token) << 20) ^ uint64_t(col);
  x ^= x >> 31;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return uint16_t(((x & 1u) << 15) | ((118u + (x >> 1) % 16u) << 7) | ((x >> 8) & 0x7Fu));
}

// Random T per rank in [1, max_tokens], distinct random experts, masked with probability 0.1.
std::vector<ref::RankInput> make_inputs(const BufferConfig& c, int R, uint64_t round,
                                        std::mt19937& rng) {
  std::vector<ref::RankInput> inputs(static_cast<std::size_t>(R));
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<int> experts(static_cast<std::size_t>(c.num_experts));
  for (int r = 0; r < R; ++r) {
    auto& in = inputs[std::size_t(r)];
    in.num_tokens = 1 + int64_t(rng() % uint32_t(c.max_tokens));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < c.hidden; ++h) in.x.push_back(identity_value(round, r, t, h));
      for (int e = 0; e < c.num_experts; ++e) experts[std::size_t(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < c.top_k; ++k) {
        in.topk_idx.push_back(uni(rng) < 0.1f ? -1 : experts[std::size_t(k)]);
        in.topk_weights.push_back(uni(rng));
      }
    }
  }
  return inputs;
}

// Copies of one rank's dispatch results (the window is overwritten by the next call) and its
// combine output, made on the compute stream.
struct Received {
  DeviceArray num_recv, recv_x, recv_src, recv_expert_idx, recv_weights, tokens_per_expert, out;
};

class EpAsyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (team_size() < 1) GTEST_SKIP() << "needs a GPU";
  }
  void make(const BufferConfig& c, const weft::ep::BufferOptions& o = {}) {
    config = c;
    R = team_size();
    eps = make_team(c, o);
    if (!compute.empty()) return;  // a test may make several Buffers in turn
    compute.resize(std::size_t(R));
    producer.resize(std::size_t(R));
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&compute[std::size_t(r)], cudaStreamNonBlocking));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&producer[std::size_t(r)], cudaStreamNonBlocking));
    }
  }
  void TearDown() override {
    for (auto s : compute) cudaStreamDestroy(s);
    for (auto s : producer) cudaStreamDestroy(s);
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      eps[std::size_t(r)]->check();
    }
  }
  int64_t capacity() const { return eps[0]->capacity(); }

  // Inputs of every rank on the device: x, idx (int64), weights.
  struct Inputs {
    DeviceArray x, idx, weights;
    int64_t T = 0;
  };
  std::vector<Inputs> upload_inputs(const std::vector<ref::RankInput>& inputs) {
    std::vector<Inputs> d(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      const auto& in = inputs[std::size_t(r)];
      d[std::size_t(r)] = {upload(rank_device(r), in.x), upload(rank_device(r), in.topk_idx), upload(rank_device(r), in.topk_weights),
                           in.num_tokens};
    }
    return d;
  }
  weft::ep::DispatchInputs dispatch_inputs(const Inputs& in) const {
    return {.x = {in.x.ptr, DType::kBFloat16, in.T, config.hidden},
            .topk_idx = {in.idx.ptr, DType::kInt64, in.T, config.top_k},
            .topk_weights = {in.weights.ptr, DType::kFloat32, in.T, config.top_k}};
  }  // A kernel's first launch in a process loads its module (lazily; from a cold disk that can
  // outlast a test's sleeps): a dispatch and a combine once, before the timed checks.
  void warm_up(const std::vector<Inputs>& dev) {
    std::vector<weft::ep::DispatchResult> res;
    std::vector<DeviceArray> out;
    for (int r = 0; r < R; ++r) {  // every rank's dispatch before any combine (team.hpp)
      res.push_back(eps[std::size_t(r)]->dispatch(dispatch_inputs(dev[std::size_t(r)]),
                                                  compute[std::size_t(r)]));
      out.emplace_back(rank_device(r), std::size_t(dev[std::size_t(r)].T * config.hidden * 2));
    }
    for (int r = 0; r < R; ++r) {
      const auto& rr = res[std::size_t(r)];
      eps[std::size_t(r)]->combine(
          {.expert_out = {rr.recv_x, DType::kBFloat16, capacity(), config.hidden}}, rr.handle,
          out[std::size_t(r)].ptr, compute[std::size_t(r)]);
    }
    sync_all();
  }

  // Poisoned copies for rank r's results (T: its tokens, the combine output's rows).
  Received make_received(int r, int64_t T) const {
    const auto cap = std::size_t(capacity());
    const auto K = std::size_t(config.top_k);
    const auto poisoned = [r](std::size_t bytes) {
      DeviceArray a(rank_device(r), bytes);
      WEFT_CUDA_CHECK(cudaMemset(a.ptr, 0xFF, bytes));
      return a;
    };
    Received d{poisoned(4),
               poisoned(cap * std::size_t(config.row_bytes())),
               poisoned(cap * 8),
               poisoned(cap * K * 4),
               poisoned(cap * K * 4),
               poisoned(std::size_t(config.num_local_experts(R)) * 4),
               poisoned(std::size_t(T * config.hidden * 2))};
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    return d;
  }
  // Copies the window results of `res` on `stream` (which must be ordered after the dispatch).
  void copy_results(const weft::ep::DispatchResult& res, Received& d, cudaStream_t stream) const {
    const auto cap = std::size_t(capacity());
    const auto K = std::size_t(config.top_k);
    const auto copy = [&](void* dst, const void* src, std::size_t bytes) {
      WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    };
    copy(d.num_recv.ptr, res.num_recv_device, 4);
    copy(d.recv_x.ptr, res.recv_x, cap * std::size_t(config.row_bytes()));
    copy(d.recv_src.ptr, res.recv_src, cap * 8);
    copy(d.recv_expert_idx.ptr, res.recv_expert_idx, cap * K * 4);
    copy(d.recv_weights.ptr, res.recv_weights, cap * K * 4);
    copy(d.tokens_per_expert.ptr, res.tokens_per_local_expert,
         std::size_t(config.num_local_experts(R)) * 4);
  }
  // The copies of rank r against the reference (combine: expert outputs = the received rows).
  void check(int r, const std::vector<ref::RankLayout>& layouts, const Received& d) const {
    const auto& L = layouts[std::size_t(r)];
    const int64_t H = config.hidden;
    const auto K = std::size_t(config.top_k);
    const auto n = download<int32_t>(rank_device(r), d.num_recv.ptr, 1)[0];
    ASSERT_EQ(n, L.num_recv) << "rank " << r;
    const auto nn = std::size_t(n);
    ASSERT_EQ(download<uint16_t>(rank_device(r), d.recv_x.ptr, nn * std::size_t(H)), L.recv_x)
        << "rank " << r << ": received rows differ";
    const auto src = download<int32_t>(rank_device(r), d.recv_src.ptr, nn * 2);
    for (std::size_t j = 0; j < nn; ++j) {
      ASSERT_EQ(src[2 * j], L.recv_src_rank[j]) << "rank " << r << " row " << j;
      ASSERT_EQ(src[2 * j + 1], L.recv_src_token[j]) << "rank " << r << " row " << j;
    }
    ASSERT_EQ(download<int32_t>(rank_device(r), d.recv_expert_idx.ptr, nn * K), L.recv_expert_idx);
    ASSERT_EQ(download<float>(rank_device(r), d.recv_weights.ptr, nn * K), L.recv_weights);
    ASSERT_EQ(download<int32_t>(rank_device(r), d.tokens_per_expert.ptr, L.tokens_per_local_expert.size()),
              L.tokens_per_local_expert);
    std::vector<std::vector<uint16_t>> expert_out;
    for (const auto& l : layouts) expert_out.push_back(l.recv_x);
    const auto want = ref::combine(config, r, layouts, expert_out, {}, {});
    const auto got = download<uint16_t>(rank_device(r), d.out.ptr, want.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    ASSERT_EQ(wrong, 0u) << "rank " << r << ": combine output differs from the reference";
  }

  // How the round trip is ordered.
  enum class Mode {
    kPreviousEventWait,   // producers on another stream, previous_event; consumers event.wait()
    kPreviousEventScope,  // ... consumers behind event.scope()
    kPreviousEventSyncFinish,  // ... async_finish = false: the call orders the caller's stream
    kCallerStream,        // producers on the caller's stream, no previous_event
  };

  // dispatch -> (expert stand-in: the received rows, copied late) -> combine, every producer
  // delayed by a slow kernel and every input poisoned until its producer writes it.
  void round_trip(Mode mode, weft::ep::CountMode count_mode = weft::ep::CountMode::kOnDevice) {
    make({.max_tokens = 512, .hidden = 1024, .num_experts = 32, .top_k = 4});
    std::mt19937 rng(std::random_device{}());
    const auto inputs = make_inputs(config, R, 1, rng);
    const auto layouts = ref::dispatch(config, inputs);
    auto good = upload_inputs(inputs);
    auto dev = upload_inputs(inputs);  // x is poisoned below, written late by its producer
    std::vector<DeviceArray> expert_out;
    std::vector<Received> got;
    // The window views (fixed per Buffer): one synchronous call, then the window is poisoned.
    std::vector<weft::ep::DispatchResult> views(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      views[std::size_t(r)] =
          eps[std::size_t(r)]->dispatch(dispatch_inputs(good[std::size_t(r)]), compute[std::size_t(r)]);
    }
    sync_all();
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      const auto& v = views[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaMemset(const_cast<uint16_t*>(v.recv_x), 0xFF,
                                 std::size_t(capacity() * config.row_bytes())));
      WEFT_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(v.recv_src), 0x7F, std::size_t(capacity() * 8)));
      WEFT_CUDA_CHECK(cudaMemset(dev[std::size_t(r)].x.ptr, 0xFF,
                                 std::size_t(dev[std::size_t(r)].T * config.row_bytes())));
      expert_out.emplace_back(rank_device(r), std::size_t(capacity() * config.row_bytes()));
      WEFT_CUDA_CHECK(cudaMemset(expert_out.back().ptr, 0xFF, std::size_t(capacity() * config.row_bytes())));
      got.push_back(make_received(r, inputs[std::size_t(r)].num_tokens));
    }
    sync_all();

    const bool on_caller = mode == Mode::kCallerStream;
    const bool finish = mode != Mode::kPreviousEventSyncFinish && !on_caller;
    // Orders the caller's stream after an async call, as the mode says.
    const auto consume = [&](const Event& done, int r, auto&& body) {
      if (mode == Mode::kPreviousEventScope) {
        {
          auto scope = done.scope();
        }
      } else if (finish) {
        done.wait();
      } else {
        EXPECT_TRUE(done.empty()) << "async_finish = false returns an empty Event";
      }
      body(r);
    };
    std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
      const cudaStream_t s = compute[std::size_t(r)];
      const cudaStream_t p = on_caller ? s : producer[std::size_t(r)];
      sleep_on(rank_device(r), p, 200.0);
      const auto& src = good[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaMemcpyAsync(dev[std::size_t(r)].x.ptr, src.x.ptr,
                                      std::size_t(src.T * config.row_bytes()),
                                      cudaMemcpyDeviceToDevice, p));
      AsyncOptions async{.async_finish = finish};
      if (!on_caller) async.previous_event = Event::record(p);
      auto [result, done] = eps[std::size_t(r)]->dispatch(dispatch_inputs(dev[std::size_t(r)]), s,
                                                          async, count_mode);
      res[std::size_t(r)] = result;
      consume(done, r, [&](int rr) { copy_results(res[std::size_t(rr)], got[std::size_t(rr)], s); });
    }
    if (count_mode == weft::ep::CountMode::kExact) {
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(eps[std::size_t(r)]->wait_num_recv(res[std::size_t(r)]),
                  layouts[std::size_t(r)].num_recv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const cudaStream_t s = compute[std::size_t(r)];
      const cudaStream_t p = on_caller ? s : producer[std::size_t(r)];
      // The expert stand-in: the received rows, written late into expert_out. Its producer must
      // come after the dispatch (the window) on the producer stream too.
      if (!on_caller) Event::record(s).wait(p);
      sleep_on(rank_device(r), p, 100.0);
      const auto& rr = res[std::size_t(r)];
      WEFT_CUDA_CHECK(cudaMemcpyAsync(expert_out[std::size_t(r)].ptr, rr.recv_x,
                                      std::size_t(capacity() * config.row_bytes()),
                                      cudaMemcpyDeviceToDevice, p));
      AsyncOptions async{.async_finish = finish};
      if (!on_caller) async.previous_event = Event::record(p);
      const Event done = eps[std::size_t(r)]->combine(
          {.expert_out = {expert_out[std::size_t(r)].ptr, DType::kBFloat16, capacity(), config.hidden}},
          rr.handle, got[std::size_t(r)].out.ptr, s, async);
      consume(done, r, [&](int) {});
    }
    // Only the compute streams are synchronised: what they copied must already be complete.
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(compute[std::size_t(r)]));
      check(r, layouts, got[std::size_t(r)]);
    }
    sync_all();
  }

  BufferConfig config;
  int R = 0;
  std::vector<std::unique_ptr<weft::ep::Buffer>> eps;
  std::vector<cudaStream_t> compute, producer;
};

TEST_F(EpAsyncTest, CommStreamHasTheDevicesGreatestPriority) {
  make({.max_tokens = 16, .hidden = 256, .num_experts = 8, .top_k = 2});
  for (int r = 0; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    int least = 0, greatest = 0, priority = 1, device = -1;
    unsigned flags = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    const cudaStream_t comm = eps[std::size_t(r)]->comm_stream();
    ASSERT_NE(comm, nullptr);
    WEFT_CUDA_CHECK(cudaStreamGetPriority(comm, &priority));
    EXPECT_EQ(priority, greatest) << "rank " << r;
    WEFT_CUDA_CHECK(cudaStreamGetFlags(comm, &flags));
    EXPECT_EQ(flags & cudaStreamNonBlocking, unsigned(cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaStreamGetDevice(comm, &device));
    EXPECT_EQ(device, eps[std::size_t(r)]->device());
    if (r > 0) EXPECT_NE(comm, eps[0]->comm_stream());
  }
}

TEST_F(EpAsyncTest, RoundTripOrderedByPreviousEventAndWait) {
  round_trip(Mode::kPreviousEventWait);
}

TEST_F(EpAsyncTest, RoundTripOrderedByPreviousEventAndScope) {
  round_trip(Mode::kPreviousEventScope);
}

TEST_F(EpAsyncTest, RoundTripWithoutAsyncFinishOrdersTheCallersStream) {
  round_trip(Mode::kPreviousEventSyncFinish);
}

TEST_F(EpAsyncTest, RoundTripOrderedAfterTheCallersStream) {
  round_trip(Mode::kCallerStream);
}

TEST_F(EpAsyncTest, ExactCountOnTheCommStream) {
  round_trip(Mode::kPreviousEventWait, weft::ep::CountMode::kExact);
}

TEST_F(EpAsyncTest, EventAndScopeSemantics) {
  const Event empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_TRUE(empty.query());
  EXPECT_EQ(empty.native(), nullptr);
  empty.wait(nullptr);  // nothing enqueued
  empty.synchronize();
  { auto scope = empty.scope(nullptr); }

  make({.max_tokens = 64, .hidden = 256, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  const auto inputs = make_inputs(config, R, 2, rng);
  const auto dev = upload_inputs(inputs);
  // A kernel's first launch in a process loads its module (lazily; from a cold disk that can
  // outlast the sleeps below): launch the dispatch once before the timed checks.
  for (int r = 0; r < R; ++r) {
    eps[std::size_t(r)]->dispatch(dispatch_inputs(dev[std::size_t(r)]), compute[std::size_t(r)]);
  }
  for (int r = 0; r < R; ++r) WEFT_CUDA_CHECK(cudaStreamSynchronize(compute[std::size_t(r)]));
  // Every rank's dispatch behind a slow producer; returns the events.
  const auto slow_dispatch = [&](double ms) {
    std::vector<Event> done;
    for (int r = 0; r < R; ++r) {
      sleep_on(rank_device(r), producer[std::size_t(r)], ms);
      Event event = eps[std::size_t(r)]->dispatch(
          dispatch_inputs(dev[std::size_t(r)]), compute[std::size_t(r)],
          {.previous_event = Event::record(producer[std::size_t(r)]), .async_finish = true}).event;
      EXPECT_FALSE(event.empty());
      EXPECT_EQ(event.stream(), compute[std::size_t(r)]);
      done.push_back(std::move(event));
    }
    return done;
  };
  // Completes once the work queued so far on rank r's compute stream has.
  const auto drain_compute = [&](int r) { Event::record(compute[std::size_t(r)]).synchronize(); };

  // The ranks' calls complete together (each waits for its peers), so every check of "still
  // pending" is made for all ranks before any host wait for a completion.
  {  // a scope orders the stream at its end, not at its start; copies share the event
    auto done = slow_dispatch(300.0);
    std::vector<weft::ep::EventScope> scopes;
    for (int r = 0; r < R; ++r) {
      const Event copy = done[std::size_t(r)];
      EXPECT_EQ(copy.native(), done[std::size_t(r)].native());
      scopes.push_back(copy.scope());
    }
    for (int r = 0; r < R; ++r) {
      drain_compute(r);  // inside the scope: not ordered after the dispatch
      EXPECT_FALSE(done[std::size_t(r)].query()) << "rank " << r;
    }
    scopes.clear();  // ends every scope
    for (int r = 0; r < R; ++r) {
      drain_compute(r);
      EXPECT_TRUE(done[std::size_t(r)].query()) << "rank " << r;
    }
  }
  {  // close() orders at once; a moved-from scope and a scope left by an exception order nothing
    auto done = slow_dispatch(300.0);
    std::vector<weft::ep::EventScope> moved;
    for (int r = 0; r < R; ++r) {
      auto scope = done[std::size_t(r)].scope();
      moved.push_back(std::move(scope));
      try {
        auto abandoned = done[std::size_t(r)].scope();
        throw std::runtime_error("leave the scope by an exception");
      } catch (const std::runtime_error&) {
      }
    }
    for (int r = 0; r < R; ++r) {
      drain_compute(r);
      EXPECT_FALSE(done[std::size_t(r)].query()) << "rank " << r;
    }
    for (auto& scope : moved) scope.close();
    for (int r = 0; r < R; ++r) {
      drain_compute(r);
      EXPECT_TRUE(done[std::size_t(r)].query()) << "rank " << r;
    }
  }
  {  // dropping a pending Event orders nothing and frees it safely; later calls are unaffected
    for (int r = 0; r < R; ++r) sleep_on(rank_device(r), producer[std::size_t(r)], 300.0);
    std::vector<Event> probes;
    for (int r = 0; r < R; ++r) {
      const Event event = eps[std::size_t(r)]->dispatch(
          dispatch_inputs(dev[std::size_t(r)]), compute[std::size_t(r)],
          {.previous_event = Event::record(producer[std::size_t(r)]), .async_finish = true}).event;
      EXPECT_FALSE(event.query());
      probes.push_back(Event::record(eps[std::size_t(r)]->comm_stream()));
    }  // every call's Event is destroyed here, pending
    for (int r = 0; r < R; ++r) {
      drain_compute(r);
      EXPECT_FALSE(probes[std::size_t(r)].query()) << "rank " << r;
    }
  }
  // allocate_on_comm_stream requires previous_event and async_finish (DeepEP's contract).
  EXPECT_THROW(eps[0]->dispatch(dispatch_inputs(dev[0]), compute[0],
                                {.async_finish = true, .allocate_on_comm_stream = true}),
               weft::Error);
  EXPECT_THROW(eps[0]->dispatch(dispatch_inputs(dev[0]), compute[0],
                                {.previous_event = Event::record(compute[0]),
                                 .allocate_on_comm_stream = true}),
               weft::Error);
  // ... and with both, the results are those of the synchronous form.
  const auto layouts = ref::dispatch(config, inputs);
  std::vector<Received> got;
  for (int r = 0; r < R; ++r) got.push_back(make_received(r, inputs[std::size_t(r)].num_tokens));
  for (int r = 0; r < R; ++r) {
    const cudaStream_t s = compute[std::size_t(r)];
    auto [result, done] = eps[std::size_t(r)]->dispatch(
        dispatch_inputs(dev[std::size_t(r)]), s,
        {.previous_event = Event::record(s), .async_finish = true, .allocate_on_comm_stream = true});
    done.wait();
    copy_results(result, got[std::size_t(r)], s);
    const Event combined = eps[std::size_t(r)]->combine(
        {.expert_out = {result.recv_x, DType::kBFloat16, capacity(), config.hidden}}, result.handle,
        got[std::size_t(r)].out.ptr, s,
        {.previous_event = Event::record(s), .async_finish = true, .allocate_on_comm_stream = true});
    combined.wait();
  }
  for (int r = 0; r < R; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(compute[std::size_t(r)]));
    check(r, layouts, got[std::size_t(r)]);
  }
  sync_all();
}

// The Buffer's run-ahead wait is on an event recorded right after the call's kernel; the call's
// own Event is recorded just after that one, so it may complete a moment later.
bool completes_soon(const Event& event) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  while (!event.query()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
  }
  return true;
}

// The host may be at most pipeline_depth calls ahead: with the device held by a slow kernel, the
// first pipeline_depth calls return at once, and each later one only after the call
// pipeline_depth before it completed.
TEST_F(EpAsyncTest, PipelineDepthBoundsHostRunAhead) {
  constexpr int kDepth = 2;
  constexpr int kCalls = 7;
  make({.max_tokens = 64, .hidden = 256, .num_experts = 16, .top_k = 4}, {.pipeline_depth = kDepth});
  std::mt19937 rng(std::random_device{}());
  const auto inputs = make_inputs(config, R, 3, rng);
  const auto dev = upload_inputs(inputs);
  std::vector<DeviceArray> out;
  for (int r = 0; r < R; ++r) out.emplace_back(rank_device(r), std::size_t(inputs[std::size_t(r)].num_tokens * config.hidden * 2));
  warm_up(dev);
  for (int r = 0; r < R; ++r) sleep_on(rank_device(r), compute[std::size_t(r)], 300.0);
  std::vector<std::vector<Event>> done(kCalls);
  std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
  for (int i = 0; i < kCalls; ++i) {
    for (int r = 0; r < R; ++r) {  // alternately dispatch and combine, all behind the sleep
      auto& ep = *eps[std::size_t(r)];
      const cudaStream_t s = compute[std::size_t(r)];
      if (i % 2 == 0) {
        auto [result, event] = ep.dispatch(dispatch_inputs(dev[std::size_t(r)]), s, {.async_finish = true});
        res[std::size_t(r)] = result;
        done[std::size_t(i)].push_back(std::move(event));
      } else {
        const auto& rr = res[std::size_t(r)];
        done[std::size_t(i)].push_back(ep.combine(
            {.expert_out = {rr.recv_x, DType::kBFloat16, capacity(), config.hidden}}, rr.handle,
            out[std::size_t(r)].ptr, s, {.async_finish = true}));
      }
    }
    for (int r = 0; r < R; ++r) {
      if (i + 1 == kDepth) {  // no host wait yet: the device is still held by the sleep
        EXPECT_FALSE(done[0][std::size_t(r)].query()) << "call " << i << " rank " << r;
      }
      if (i >= kDepth) {  // launching call i waited for call i - kDepth
        EXPECT_TRUE(completes_soon(done[std::size_t(i - kDepth)][std::size_t(r)]))
            << "call " << i << " rank " << r;
      }
    }
  }
  sync_all();
}

TEST_F(EpAsyncTest, PipelineDepthZeroNeverWaits) {
  make({.max_tokens = 64, .hidden = 256, .num_experts = 16, .top_k = 4});
  std::mt19937 rng(std::random_device{}());
  const auto inputs = make_inputs(config, R, 4, rng);
  const auto dev = upload_inputs(inputs);
  warm_up(dev);
  for (int r = 0; r < R; ++r) sleep_on(rank_device(r), compute[std::size_t(r)], 300.0);
  std::vector<Event> first;
  for (int i = 0; i < 8; ++i) {
    for (int r = 0; r < R; ++r) {
      Event event = eps[std::size_t(r)]->dispatch(dispatch_inputs(dev[std::size_t(r)]),
                                                  compute[std::size_t(r)], {.async_finish = true}).event;
      if (i == 0) first.push_back(std::move(event));
    }
  }
  for (int r = 0; r < R; ++r) EXPECT_FALSE(first[std::size_t(r)].query()) << "rank " << r;
  sync_all();
}

// Thousands of async rounds with no host wait inside a batch: fresh random inputs per round (a
// stale row from any other round differs), the ordering modes mixed, pipeline_depth 2. The window
// results of each round are copied on the compute stream before the next call, which the next
// call (ordered after the compute stream) must not overtake.
TEST_F(EpAsyncTest, ThousandsOfBackToBackAsyncRounds) {
  constexpr int kBatches = 128;
  constexpr int kRoundsPerBatch = 16;
  make({.max_tokens = 64, .hidden = 256, .num_experts = 16, .top_k = 4}, {.pipeline_depth = 2});
  std::mt19937 rng(std::random_device{}());
  uint64_t round = 100;
  for (int b = 0; b < kBatches; ++b) {
    std::vector<std::vector<ref::RankInput>> inputs;
    std::vector<std::vector<Inputs>> dev;
    std::vector<std::vector<Received>> got;
    for (int i = 0; i < kRoundsPerBatch; ++i) {
      inputs.push_back(make_inputs(config, R, round++, rng));
      dev.push_back(upload_inputs(inputs.back()));
      got.emplace_back();
      for (int r = 0; r < R; ++r) {
        got.back().push_back(make_received(r, inputs.back()[std::size_t(r)].num_tokens));
      }
    }
    for (int i = 0; i < kRoundsPerBatch; ++i) {
      const int variant = (b * kRoundsPerBatch + i) % 6;
      const bool with_previous = variant % 2 == 0;
      const bool finish = variant < 4;
      const bool scoped = variant >= 2;
      std::vector<weft::ep::DispatchResult> res(static_cast<std::size_t>(R));
      for (int r = 0; r < R; ++r) {
        const cudaStream_t s = compute[std::size_t(r)];
        AsyncOptions async{.async_finish = finish};
        if (with_previous) async.previous_event = Event::record(s);
        auto [result, done] = eps[std::size_t(r)]->dispatch(
            dispatch_inputs(dev[std::size_t(i)][std::size_t(r)]), s, async);
        res[std::size_t(r)] = result;
        Received& d = got[std::size_t(i)][std::size_t(r)];
        if (scoped) {
          auto scope = done.scope();
        } else {
          done.wait();  // an empty Event (async_finish = false) waits for nothing
        }
        copy_results(result, d, s);
      }
      for (int r = 0; r < R; ++r) {
        const cudaStream_t s = compute[std::size_t(r)];
        const auto& rr = res[std::size_t(r)];
        Received& d = got[std::size_t(i)][std::size_t(r)];
        AsyncOptions async{.async_finish = finish};
        if (with_previous) async.previous_event = Event::record(s);
        // Zero copy: the expert outputs are the received rows themselves (in the window).
        const Event done = eps[std::size_t(r)]->combine(
            {.expert_out = {rr.recv_x, DType::kBFloat16, capacity(), config.hidden}}, rr.handle,
            d.out.ptr, s, async);
        if (scoped) {
          auto scope = done.scope();
        } else {
          done.wait();
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(rank_device(r)));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(compute[std::size_t(r)]));
    }
    for (int i = 0; i < kRoundsPerBatch; ++i) {
      const auto layouts = ref::dispatch(config, inputs[std::size_t(i)]);
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE(testing::Message() << "batch " << b << " round " << i);
        check(r, layouts, got[std::size_t(i)][std::size_t(r)]);
        if (HasFatalFailure()) return;
      }
    }
  }
  sync_all();
}

}  // namespace
