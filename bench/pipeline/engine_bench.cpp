// Host overhead per progress() of the HSTU schedule on the host backend (empty bodies).
//   build/bench/pipeline/weft_engine_bench --benchmark_repetitions=5
#include "engine_overhead.hpp"

int main(int argc, char** argv) {
  using namespace weft::pipeline;
  bench::register_engine_overhead("host", [] { return std::make_unique<HostBackend>(); });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
