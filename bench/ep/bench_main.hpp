// How the EP benchmarks start and fail: the GPUs they drive are checked against those found, and
// any error is one message and a non-zero exit status, never an uncaught exception.
//
//   int main(int argc, char** argv) {
//     return weft::ep::bench::run_main("weft-ep-bench", [&] { return run(argc, argv); });
//   }
#pragma once

#include <cstdio>
#include <exception>

#include "weft/core/error.hpp"
#include "weft/cuda/nccl.hpp"

namespace weft::ep::bench {

// Exit status when the machine has fewer GPUs than the benchmark needs or was asked to drive.
constexpr int kExitTooFewGpus = 2;
// The largest --num-sms: more SMs than any GPU has.
constexpr int kMaxNumSms = 1024;

// The number of GPUs to drive: `requested` (--gpus; 0 = every GPU found), at least 2 and at most
// the GPUs found. 0 when that cannot be (the reason printed).
inline int gpus_to_drive(const char* program, int requested) {
  const int found = weft::cuda::device_count();
  if (requested == 1) {
    std::fprintf(stderr, "%s needs 2 GPUs, found %d (--gpus 1 asks for one)\n", program, found);
  } else if (requested > found) {
    std::fprintf(stderr, "%s: --gpus %d asks for %d GPUs, found %d\n", program, requested,
                 requested, found);
  } else if (requested == 0 && found < 2) {
    std::fprintf(stderr, "%s needs 2 GPUs, found %d\n", program, found);
  } else {
    return requested > 0 ? requested : found;
  }
  return 0;
}

// Runs `body` (which returns the exit status); an exception becomes a message and status 1.
template <typename Body>
int run_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n  (reported at %s:%u)\n", program, e.message().c_str(),
                 e.file(), e.line());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
  }
  return 1;
}

}  // namespace weft::ep::bench
