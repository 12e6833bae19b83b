// What a Buffer keeps beyond its public members (internal to weft::ep's Buffer files): the state
// its ranks share, its own allocations, and the kernels' communication parameters built from them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/params.hpp"
#include "team.hpp"
#include "weft/cuda/device_error.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep::detail {

// What the Buffers of one process (one per local rank) share: the team (team.hpp: the ranks,
// their windows and peer pointers, NCCL's or a virtual team's) and the window layout.
struct BufferGroup {
  std::unique_ptr<Team> team;
  WindowLayout layout;
};

// Per-Buffer device allocations (on the Buffer's device) and host-side sync objects.
struct BufferState {
  int device = 0;
  DeviceState* state = nullptr;  // one cudaMalloc holding everything below, zeroed
  int32_t* block_counts = nullptr;
  int32_t* expert_counts = nullptr;
  int32_t* send_slot = nullptr;
  int32_t* tokens_per_local_expert = nullptr;
  int32_t* rank_prefix_matrix = nullptr;  // [R][R] (DispatchParams::rank_prefix_matrix)
  // Expanded dispatch only (BufferConfig::expand_factor > 0), one cudaMalloc:
  // expand_info [E/R + 3] int64, expand_rows [max_tokens][top_k] int2 (ExpandDispatchParams),
  // sparse_heads [R * max_tokens] int2 (CombineParams), block_expert_counts [SMs][E] int32.
  int64_t* expand_info = nullptr;
  int2* expand_rows = nullptr;
  int2* sparse_heads = nullptr;
  int32_t* block_expert_counts = nullptr;
  // Pinned, 16 bytes: the count and tokens_required (one 8-byte copy of DeviceState::num_recv
  // and the word after it), then at byte 8 an expanded dispatch's rows_required.
  int32_t* host_count = nullptr;
  int32_t* host_tokens_required = nullptr;
  int64_t* host_rows_required = nullptr;
  char** peers = nullptr;         // [kMaxRanks] CommParams::peers of this rank (device)
  // Mapped pinned memory (kernels/params.hpp kPublishedHeaderWords): the counts an uncached
  // deduplicated dispatch with CountMode::kExact publishes early; its device address.
  int32_t* published = nullptr;
  int32_t* published_device = nullptr;
  bool count_published = false;   // the count_sequence dispatch publishes there
  int64_t latest_row_bytes = 0;   // of the latest dispatch (copy_out)
  // The latest dispatch deferred its own rows (DispatchInputs::defer_own_rows): copy_out must
  // be given its x (layout.num_tokens rows: a cached dispatch moves its handle's T).
  bool latest_deferred_own = false;
  // The latest dispatch was a cached one that launched no kernel (one rank, own rows deferred,
  // no statistics): the next copy_out makes its checks (CopyOutParams::cached_call).
  bool unlaunched_cached_call = false;
  cudaEvent_t count_event = nullptr;
  uint64_t count_sequence = 0;    // dispatch whose count the pinned word will hold
  cuda::DeviceErrorFlag error;    // bad data: thrown once, the Buffer stays usable
  cuda::DeviceErrorFlag fatal;    // timeouts (kErrTimeout, kErrPeerFailed): unusable after
  std::string unusable;           // the fatal error's message, thrown by every later call
  // The layout in place (the last uncached dispatch launched): what a handle must match.
  Handle layout;

  ~BufferState() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (count_event != nullptr) cudaEventDestroy(count_event);
    if (host_count != nullptr) cudaFreeHost(host_count);
    if (state != nullptr) cudaFree(state);
    if (expand_info != nullptr) cudaFree(expand_info);
    if (peers != nullptr) cudaFree(peers);
    if (published != nullptr) cudaFreeHost(published);
    cudaSetDevice(previous);
  }
};

inline CommParams comm_params(const BufferGroup& group, int rank, int num_ranks,
                              BufferState& state, double timeout_s) {
  return {state.peers, group.layout, rank, num_ranks, state.state,
          state.error.device_record(), state.fatal.device_record(), uint64_t(timeout_s * 1e9)};
}

}  // namespace weft::ep::detail
