// CUDA backend of the engine: events per (task, ring slot), cross-stream waits on one event,
// priorities, GPU spans. Needs one GPU; skips without.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/pipeline/cuda_backend.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline {
namespace {

__global__ void spin_kernel(std::uint64_t duration_ns) {
  std::uint64_t start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  std::uint64_t now = start;
  while (now - start < duration_ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

__global__ void write_kernel(int* target, int value) { *target = value; }
__global__ void copy_kernel(const int* source, int* target) { *target = *source; }

class DeviceInts {
 public:
  explicit DeviceInts(std::size_t n) : n_(n) {
    WEFT_CUDA_CHECK(cudaMalloc(&data_, n * sizeof(int)));
    WEFT_CUDA_CHECK(cudaMemset(data_, 0, n * sizeof(int)));
  }
  ~DeviceInts() { cudaFree(data_); }
  int* get() const { return data_; }
  std::vector<int> read() const {
    std::vector<int> out(n_);
    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), data_, n_ * sizeof(int), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  int* data_ = nullptr;
  std::size_t n_;
};

#define WEFT_NEED_GPUS(n) \
  if (weft::cuda::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s)"

TEST(CudaBackendTest, OneEventPerTaskPerRingSlotReused) {
  WEFT_NEED_GPUS(1);
  Schedule s;
  s.add_stream("side");
  s.add(Task("a").lookahead(1).stream("side").writes("x"));
  s.add(Task("b").reads("x"));
  s.add(Task("c").depends_on("b"));
  auto backend = std::make_unique<CudaBackend>(0);
  CudaBackend* cuda = backend.get();
  Engine engine(std::move(s), ThreadMap::per_task(), std::move(backend));
  ASSERT_EQ(cuda->num_events(), 3u * 2u);
  std::vector<cudaEvent_t> before;
  for (TaskId t = 0; t < 3; ++t) {
    for (std::uint32_t slot = 0; slot < 2; ++slot) before.push_back(cuda->event(t, slot));
  }
  engine.set_source([n = 0](Batch&) mutable { return n++ < 100; });
  int num_steps = 0;
  while (engine.progress()) ++num_steps;
  EXPECT_EQ(num_steps, 100);
  engine.synchronize();
  EXPECT_EQ(cuda->num_events(), 6u);
  std::size_t i = 0;
  for (TaskId t = 0; t < 3; ++t) {
    for (std::uint32_t slot = 0; slot < 2; ++slot) EXPECT_EQ(cuda->event(t, slot), before[i++]);
  }
}

// q (stream b) depends on p (stream a); "later" runs 300 ms on stream a after p's event. q must
// see p's write, and must finish while "later" still runs: it waited on p's event, not stream a.
TEST(CudaBackendTest, CrossStreamWaitIsOnTheProducersEventNotTheStream) {
  WEFT_NEED_GPUS(1);
  {
    // Load the kernels first: with lazy module loading, a kernel's first launch waits for the
    // device, which would make q wait for "later" whatever the engine does.
    DeviceInts scratch(2);
    spin_kernel<<<1, 1>>>(0);
    write_kernel<<<1, 1>>>(scratch.get(), 1);
    copy_kernel<<<1, 1>>>(scratch.get(), scratch.get() + 1);
    WEFT_CUDA_CHECK_LAUNCH();
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  for (const char* map : {"legacy", "per_task"}) {
    SCOPED_TRACE(map);
    constexpr int kNumBatches = 3;
    DeviceInts x(kNumBatches);
    DeviceInts out(kNumBatches);
    Schedule s;
    s.add_stream("a").add_stream("b");
    s.add(Task("p").stream("a").writes("x").body([&](TaskContext& c) {
      spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(20'000'000);  // 20 ms, then write
      write_kernel<<<1, 1, 0, cuda_stream(c)>>>(x.get() + c.batch_index(),
                                                static_cast<int>(c.batch_index()) + 1);
      WEFT_CUDA_CHECK_LAUNCH();
    }));
    s.add(Task("later").stream("a").depends_on("p").body([&](TaskContext& c) {
      spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(300'000'000);
      WEFT_CUDA_CHECK_LAUNCH();
    }));
    s.add(Task("q").stream("b").reads("x").body([&](TaskContext& c) {
      copy_kernel<<<1, 1, 0, cuda_stream(c)>>>(x.get() + c.batch_index(),
                                               out.get() + c.batch_index());
      WEFT_CUDA_CHECK_LAUNCH();
    }));
    auto backend = std::make_unique<CudaBackend>(0);
    CudaBackend* cuda = backend.get();
    Engine engine(std::move(s), ThreadMap::preset(map), std::move(backend));
    const StreamId a = *engine.schedule().find_stream("a");
    const StreamId b = *engine.schedule().find_stream("b");
    engine.set_source([n = 0](Batch&) mutable { return n++ < kNumBatches; });
    int step = 0;
    while (engine.progress()) {
      WEFT_CUDA_CHECK(cudaStreamSynchronize(cuda->stream(b)));
      EXPECT_EQ(out.read()[static_cast<std::size_t>(step)], step + 1);
      EXPECT_EQ(cudaStreamQuery(cuda->stream(a)), cudaErrorNotReady)
          << "q waited for the whole producer stream";
      ++step;
    }
    engine.synchronize();
    EXPECT_EQ(step, kNumBatches);
  }
}

// A same_progress_sync edge of side kGpu from a larger-lookahead consumer: the consumer's stream
// waits on the producer's event of this progress.
TEST(CudaBackendTest, SameProgressSyncGpuSideWaitsOnThisProgressEvent) {
  WEFT_NEED_GPUS(1);
  DeviceInts flag(1);
  DeviceInts seen(64);
  Schedule s;
  s.add_stream("a").add_stream("b");
  s.add(Task("p").stream("a").body([&](TaskContext& c) {
    spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(2'000'000);
    write_kernel<<<1, 1, 0, cuda_stream(c)>>>(flag.get(), static_cast<int>(c.iteration()) + 1);
    WEFT_CUDA_CHECK_LAUNCH();
  }));
  s.add(Task("c").stream("b").lookahead(1).same_progress_sync("p", SyncSide::kGpu)
            .body([&](TaskContext& c) {
              copy_kernel<<<1, 1, 0, cuda_stream(c)>>>(flag.get(),
                                                       seen.get() + c.iteration());
              WEFT_CUDA_CHECK_LAUNCH();
            }));
  Engine engine(std::move(s), ThreadMap::per_task(), CudaBackend(0));
  engine.set_source([n = 0](Batch&) mutable { return n++ < 20; });
  while (engine.progress()) {
  }
  engine.synchronize();
  const auto values = seen.read();
  // Iteration 0 is prefill (p does not run): c sees nothing. From then on p of the same
  // iteration has written iteration + 1 before c copies.
  for (int i = 1; i < 20; ++i) EXPECT_EQ(values[static_cast<std::size_t>(i)], i + 1) << i;
}

TEST(CudaBackendTest, StreamPrioritiesFollowTheSchedule) {
  WEFT_NEED_GPUS(1);
  Schedule s;
  s.add_stream("urgent", 1).add_stream("most_urgent", 100);
  s.add(Task("a").stream("urgent")).add(Task("b").stream("most_urgent")).add(Task("c"));
  auto backend = std::make_unique<CudaBackend>(0);
  CudaBackend* cuda = backend.get();
  Engine engine(std::move(s), ThreadMap::legacy(), std::move(backend));
  int least = 0;
  int greatest = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const auto& c = engine.schedule();
  const StreamId normal = *c.find_stream("default");
  const StreamId urgent = *c.find_stream("urgent");
  const StreamId most = *c.find_stream("most_urgent");
  EXPECT_EQ(cuda->cuda_priority(normal), least);
  EXPECT_EQ(cuda->cuda_priority(urgent), std::max(greatest, least - 1));
  EXPECT_EQ(cuda->cuda_priority(most), greatest);
  for (StreamId id : {normal, urgent, most}) {
    int actual = 0;
    WEFT_CUDA_CHECK(cudaStreamGetPriority(cuda->stream(id), &actual));
    EXPECT_EQ(actual, cuda->cuda_priority(id));
  }
}

TEST(CudaBackendTest, TraceHasGpuSpans) {
  WEFT_NEED_GPUS(1);
  Schedule s;
  s.add_stream("a");
  s.add(Task("p").stream("a").writes("x").body([](TaskContext& c) {
    spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(100'000);
  }));
  s.add(Task("q").reads("x").body([](TaskContext& c) {
    spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(100'000);
  }));
  Engine engine(std::move(s), ThreadMap::per_task(), CudaBackend(0), {.trace = true});
  engine.set_source([n = 0](Batch&) mutable { return n++ < 5; });
  while (engine.progress()) {
  }
  const Trace trace = engine.take_trace();
  ASSERT_EQ(trace.gpu_spans.size(), 10u);
  for (const GpuSpan& g : trace.gpu_spans) {
    EXPECT_GE(g.end_us - g.begin_us, 90.0);  // the 100 us kernel is inside the span
  }
  EXPECT_NE(trace.to_chrome_json().find("\"gpu\""), std::string::npos);
}

__global__ void fill_kernel(int* data, int n, int value) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) data[i] = value;
}

// Waits, then counts the elements that are not `expected` (a reader that comes late).
__global__ void late_check_kernel(const int* data, int n, int expected, std::uint64_t delay_ns,
                                  int* num_wrong) {
  std::uint64_t start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  std::uint64_t now = start;
  while (now - start < delay_ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (data[i] != expected) atomicAdd(num_wrong, 1);
  }
}

// A slot value from a stream-ordered allocator (cudaMallocAsync / cudaFreeAsync on the producer's
// stream, as PyTorch's caching allocator frees to the stream it allocated on): once freed, the
// memory goes to the next allocation on that stream at once, whatever other streams still read.
class StreamOrderedInts {
 public:
  StreamOrderedInts(int n, cudaStream_t stream) : n_(n), stream_(stream) {
    WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&data_), std::size_t(n) * sizeof(int),
                                    stream));
  }
  StreamOrderedInts(const StreamOrderedInts&) = delete;
  ~StreamOrderedInts() { cudaFreeAsync(data_, stream_); }
  int* get() const { return data_; }
  int size() const { return n_; }

 private:
  int* data_ = nullptr;
  int n_;
  cudaStream_t stream_;
};

constexpr int kNumInts = 1 << 16;  // per slot value

// The engine keeps a batch's slot values until the work that reads them has finished on every
// stream: the freed memory is not handed to a newer batch under a reader that is still queued.
TEST(CudaBackendTest, SlotValuesFromAStreamOrderedAllocatorOutliveTheirReaders) {
  WEFT_NEED_GPUS(1);
  constexpr int kNumBatches = 12;
  DeviceInts num_wrong(1);
  Schedule s;
  s.add_stream("copy");
  s.add(Task("make").stream("copy").lookahead(1).writes("x").body([](TaskContext& c) {
    auto x = std::make_shared<StreamOrderedInts>(kNumInts, cuda_stream(c));
    fill_kernel<<<1, 256, 0, cuda_stream(c)>>>(x->get(), kNumInts, int(c.batch_index()));
    WEFT_CUDA_CHECK(cudaGetLastError());
    c.set("x", std::move(x));
  }));
  s.add(Task("use").reads("x").body([&](TaskContext& c) {
    const auto& x = c.get<std::shared_ptr<StreamOrderedInts>>("x");
    late_check_kernel<<<1, 256, 0, cuda_stream(c)>>>(x->get(), x->size(), int(c.batch_index()),
                                                     2'000'000, num_wrong.get());
    WEFT_CUDA_CHECK(cudaGetLastError());
  }));
  for (const char* map : {"legacy", "per_task"}) {
    SCOPED_TRACE(map);
    Engine engine(s, ThreadMap::preset(map), CudaBackend(0));
    engine.set_source([n = 0](Batch&) mutable { return n++ < kNumBatches; });
    int num_steps = 0;
    while (engine.progress()) ++num_steps;
    engine.synchronize();
    EXPECT_EQ(num_steps, kNumBatches);
    EXPECT_EQ(num_wrong.read()[0], 0);
  }
}

// The caller's streams serve the schedule streams they are given for: bodies get them, work on
// them is ordered by the engine's events, and they outlive the engine. Other streams are created.
TEST(CudaBackendTest, AdoptsTheCallersStreamsAndLeavesThemAlive) {
  WEFT_NEED_GPUS(1);
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t mine_default = nullptr;
  cudaStream_t mine_side = nullptr;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&mine_default, cudaStreamNonBlocking));
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&mine_side, cudaStreamNonBlocking));
  DeviceInts cell(2);
  {
    Schedule s;
    s.add_stream("side").add_stream("made");
    // p writes on the side stream behind a 50 ms kernel; q copies it on the default stream.
    s.add(Task("p").stream("side").writes("x").body([&](TaskContext& c) {
      EXPECT_EQ(cuda_stream(c), mine_side);
      spin_kernel<<<1, 1, 0, cuda_stream(c)>>>(50'000'000);
      write_kernel<<<1, 1, 0, cuda_stream(c)>>>(cell.get(), 7);
    }));
    s.add(Task("q").reads("x").body([&](TaskContext& c) {
      EXPECT_EQ(cuda_stream(c), mine_default);
      copy_kernel<<<1, 1, 0, cuda_stream(c)>>>(cell.get(), cell.get() + 1);
    }));
    s.add(Task("r").stream("made").body([&](TaskContext& c) {
      EXPECT_NE(cuda_stream(c), mine_default);
      EXPECT_NE(cuda_stream(c), mine_side);
    }));
    Engine engine(std::move(s), ThreadMap::per_task(),
                  CudaBackend(0, {{"default", mine_default}, {"side", mine_side}}));
    engine.set_source([n = 0](Batch&) mutable { return n++ < 1; });
    while (engine.progress()) {
    }
    engine.synchronize();
    EXPECT_EQ(cell.read(), (std::vector<int>{7, 7}));
  }
  // Still valid streams after the engine (and its backend) are gone.
  EXPECT_EQ(cudaStreamQuery(mine_default), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(mine_side), cudaSuccess);
  WEFT_CUDA_CHECK(cudaStreamDestroy(mine_default));
  WEFT_CUDA_CHECK(cudaStreamDestroy(mine_side));
}

// A new source after a clean end of data joins the streams on the device: work queued on the
// default stream between the two sources (a slow kernel, then a flag) precedes the new source's
// first task on another stream, though the host does not wait for it.
TEST(CudaBackendTest, ANewSourceJoinsTheStreamsOnTheDevice) {
  WEFT_NEED_GPUS(1);
  DeviceInts flag(1), seen(2);
  Schedule s;
  s.add_stream("side");
  s.add_input("input");
  s.add(Task("late").lookahead(1).stream("side").reads("input").writes("x").body(
      [&](TaskContext& c) {
        copy_kernel<<<1, 1, 0, cuda_stream(c)>>>(flag.get(), seen.get() + c.batch_index());
      }));
  s.add(Task("early").reads("x"));
  auto backend = std::make_unique<CudaBackend>(0);
  CudaBackend* cuda = backend.get();
  Engine engine(std::move(s), ThreadMap::per_task(), std::move(backend));
  const auto two_batches = [] {
    return [n = std::int64_t{0}](Batch& b) mutable {
      if (n == 2) return false;
      b.set("input", n++);
      return true;
    };
  };
  engine.set_source(two_batches());
  while (engine.progress()) {
  }
  auto* def = static_cast<cudaStream_t>(
      cuda->stream_handle(engine.schedule().find_stream("default").value()));
  spin_kernel<<<1, 1, 0, def>>>(50'000'000);  // 50 ms, then the flag
  write_kernel<<<1, 1, 0, def>>>(flag.get(), 1);
  engine.set_source(two_batches());
  while (engine.progress()) {
  }
  engine.synchronize();
  EXPECT_EQ(seen.read(), (std::vector<int>{1, 1}));
}

TEST(CudaBackendTest, AdoptingAStreamTheScheduleLacksIsAnError) {
  WEFT_NEED_GPUS(1);
  Schedule s;
  s.add(Task("a"));
  try {
    Engine engine(std::move(s), ThreadMap::legacy(), CudaBackend(0, {{"ghost", nullptr}}));
    ADD_FAILURE() << "no error";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'ghost'"), std::string::npos) << e.what();
  }
}

TEST(CudaBackendTest, CudaStreamNeedsTheCudaBackend) {
  Schedule s;
  s.add(Task("a").body([](TaskContext& c) { cuda_stream(c); }));
  Engine engine(std::move(s), ThreadMap::legacy());  // host backend
  engine.set_source([n = 0](Batch&) mutable { return n++ < 1; });
  EXPECT_THROW(engine.progress(), weft::Error);
}

}  // namespace
}  // namespace weft::pipeline
