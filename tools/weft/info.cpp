// `weft info`: what this build of weft contains and what the machine offers it.
#include <cstdio>

#include "command.hpp"
#include "weft/core/version.hpp"

#ifdef WEFT_TOOLS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#endif

namespace weft::tools {
namespace {

void print_info() {
  std::printf("weft %s\n", weft::version());
  std::printf("weft::cuda: %s\n", weft::built_with_cuda() ? "built" : "not built");
#ifdef WEFT_TOOLS_WITH_CUDA
  const int compiled = weft::cuda::nccl_compiled_version();
  std::printf("NCCL headers: %d.%d.%d\n", compiled / 10000, compiled / 100 % 100, compiled % 100);
  const int num_devices = weft::cuda::device_count();
  std::printf("CUDA devices: %d\n", num_devices);
  if (num_devices > 0) {
    const int runtime = weft::cuda::nccl_runtime_version();
    std::printf("NCCL library: %d.%d.%d%s\n", runtime / 10000, runtime / 100 % 100,
                runtime % 100, runtime == compiled ? "" : "  (MISMATCH: device API unusable)");
  }
  for (int d = 0; d < num_devices; ++d) {
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
    std::printf("  device %d: %s, %d SMs, %.1f GiB, compute %d.%d\n", d, prop.name,
                prop.multiProcessorCount, prop.totalGlobalMem / double(1ull << 30), prop.major,
                prop.minor);
  }
#endif
}

}  // namespace

void register_info(CLI::App& app) {
  auto* command = app.add_subcommand("info", "Show what this build contains and which GPUs it sees");
  command->callback(print_info);
}

}  // namespace weft::tools
