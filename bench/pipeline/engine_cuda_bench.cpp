// Host overhead per progress() of the HSTU schedule on the CUDA backend (empty bodies: only the
// engine's own event records and stream waits reach the driver). Needs one GPU.
//   build/bench/pipeline/weft_engine_cuda_bench --benchmark_repetitions=5
#include <cstdio>

#include "engine_overhead.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/pipeline/cuda_backend.hpp"

int main(int argc, char** argv) {
  using namespace weft::pipeline;
  if (weft::cuda::device_count() < 1) {
    std::fprintf(stderr, "weft_engine_cuda_bench: no GPU\n");
    return 1;
  }
  bench::register_engine_overhead("cuda", [] { return std::make_unique<CudaBackend>(0); });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
