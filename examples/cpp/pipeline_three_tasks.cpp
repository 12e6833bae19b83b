// A pipeline of three tasks on two host threads: `load` prepares the batch one step ahead
// (lookahead 1) on its own thread and stream, `forward` computes a loss from it, `log` reads the
// loss; the thread map puts `load` on thread "io" and the rest on "compute". Runs on a CPU (the
// host backend; CudaBackend(device) gives each stream a CUDA stream).
//
//   examples/cpp/weft_example_pipeline
#include <cstdio>
#include <numeric>
#include <vector>

#include "weft/pipeline/pipeline.hpp"

using namespace weft::pipeline;

int main() {
  constexpr int kNumBatches = 20;
  double logged_sum = 0;

  Schedule schedule;
  schedule.add_stream("memcpy").add_input("batch_cpu");
  schedule.add(Task("load").stream("memcpy").lookahead(1).reads("batch_cpu").writes("batch").body(
      [](TaskContext& c) {
        std::vector<double> batch = c.get<std::vector<double>>("batch_cpu");
        for (double& x : batch) x *= 2;  // stands in for a host-to-device copy
        c.set("batch", std::move(batch));
      }));
  schedule.add(Task("forward").reads("batch").writes("loss").body([](TaskContext& c) {
    const auto& batch = c.get<std::vector<double>>("batch");
    c.set("loss", std::accumulate(batch.begin(), batch.end(), 0.0));
  }));
  // `log` runs on the compute thread after forward, on the same batch.
  schedule.add(Task("log").reads("loss").body(
      [&](TaskContext& c) { logged_sum += c.get<double>("loss"); }));

  Engine engine(std::move(schedule),
                ThreadMap::groups({{"io", {"load"}}}, /*rest=*/"compute"), HostBackend());
  int next = 0;
  engine.set_source([&](Batch& b) {  // false = no more data
    if (next == kNumBatches) return false;
    b.set("batch_cpu", std::vector<double>{double(next), double(next) + 1});
    ++next;
    return true;
  });

  int num_steps = 0;
  double expected = 0;
  while (auto step = engine.progress()) {
    const double loss = step->get<double>("loss");
    const auto i = double(step->batch_index());
    if (loss != 2 * (i + i + 1)) {
      std::fprintf(stderr, "batch %d: loss %g, expected %g\n", num_steps, loss, 2 * (i + i + 1));
      return 1;
    }
    expected += loss;
    ++num_steps;
  }
  std::printf("%d steps on threads", num_steps);
  for (const auto& name : engine.threads().thread_names) std::printf(" %s", name.c_str());
  std::printf(", sum of losses %g\n", logged_sum);
  return num_steps == kNumBatches && logged_sum == expected ? 0 : 1;
}
