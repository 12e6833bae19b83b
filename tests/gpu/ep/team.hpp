// The team every weft::ep GPU test runs on: every visible GPU one rank (Buffer::create_local), or,
// with WEFT_EP_VIRTUAL_RANKS=R set, a virtual team of R simulated ranks on GPU 0
// (Buffer::create_virtual_team; CMakeLists.txt registers every test binary at R = 2, 4 and 8
// too). Tests address rank r's memory on rank_device(r) and size everything by team_size().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep::testing {

// On a virtual team the ranks' streams share one device's hardware work queues; a stream waiting
// at the head of a shared queue holds back the launches behind it, a peer's kernel among them.
// More queues (CUDA_DEVICE_MAX_CONNECTIONS, read when the CUDA context is made: set here during
// static initialisation, before any CUDA call) give each of a test's streams its own. See
// docs/ep.md "Virtual team" for the launch order that makes shared queues harmless.
inline const bool kVirtualTeamQueuesSet = [] {
  if (std::getenv("WEFT_EP_VIRTUAL_RANKS") != nullptr) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  }
  return true;
}();

// 0: real ranks (one per GPU); else the virtual team's size.
inline int virtual_ranks() {
  const char* v = std::getenv("WEFT_EP_VIRTUAL_RANKS");
  return v != nullptr ? std::atoi(v) : 0;
}
inline bool is_virtual_team() { return virtual_ranks() > 0; }

// Ranks of the team (0 without a GPU).
inline int team_size() {
  const int gpus = weft::cuda::device_count();
  if (gpus < 1) return 0;
  return is_virtual_team() ? virtual_ranks() : gpus;
}

// The device of rank r.
inline int rank_device(int r) { return is_virtual_team() ? 0 : r; }

// One Buffer per rank of the team, element r rank r.
inline std::vector<std::unique_ptr<weft::ep::Buffer>> make_team(
    const weft::ep::BufferConfig& config, const weft::ep::BufferOptions& options = {}) {
  if (!is_virtual_team()) return weft::ep::Buffer::create_local(team_size(), config, options);
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  return weft::ep::Buffer::create_virtual_team(virtual_ranks(), config, options);
}

}  // namespace weft::ep::testing
