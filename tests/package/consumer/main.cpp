#include <cstdio>

#include <weft/weft.hpp>
#ifdef CONSUMER_WITH_CUDA
#include <weft/cuda/nccl.hpp>
#endif

int main() {
  try {
    WEFT_CHECK(false, "expected");
  } catch (const weft::Error& e) {
    if (e.message() != "expected") return 1;
  }
#ifdef CONSUMER_WITH_CUDA
  if (!weft::built_with_cuda() || weft::cuda::nccl_compiled_version() < 22800) return 2;
#endif
  std::printf("consumer ok, weft %s\n", weft::version());
  return 0;
}
