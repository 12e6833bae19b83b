// Where a Buffer's ranks, windows and peer pointers come from (internal): the one seam between
// weft::ep on NCCL (one rank per GPU, windows registered as NCCL symmetric memory, peers reached
// through NCCL's LSA pointers) and the virtual team (one GPU, R simulated ranks, R plain
// allocations as their windows: docs/ep.md "Virtual team"). The Buffer logic and the kernels are
// the same for both; they see only a rank id, a window and CommParams::peers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "weft/cuda/nccl.hpp"

namespace weft::ep::detail {

// The members of a team that this process drives (index 0..size()-1), each one rank with one
// window of window_bytes() bytes, zeroed before the team is handed out.
class Team {
 public:
  virtual ~Team() = default;
  virtual std::size_t size() const = 0;
  virtual int num_ranks() const = 0;
  virtual int rank(std::size_t i) const = 0;
  virtual int device(std::size_t i) const = 0;
  // Member i's own window, as its host code and kernels address it.
  virtual char* window(std::size_t i) const = 0;
  virtual std::size_t window_bytes() const = 0;
  // True where several ranks run on one device: then every rank's grid must leave room for the
  // others' (all of them are resident at once), so a call may not take more blocks than the
  // rank's share (BufferOptions::num_sms) instead of every SM of the device.
  virtual bool ranks_share_device() const = 0;
  // Writes [num_ranks()] window bases, as member i's kernels address them (peers[r] = rank r's
  // window), into `peers` (device memory of member i's device). Complete once the device is
  // synchronised.
  virtual void fill_peers(std::size_t i, char** peers) const = 0;
  // A host barrier over every rank of the team, entered once for all of this process's members:
  // on return no rank is still zeroing its window, so a peer may write flags into it.
  // scratch[i]: one zero int32 on member i's device (left zero).
  virtual void barrier(const std::vector<int32_t*>& scratch) const = 0;
};

// Over NCCL communicators: creates the device communicators (which check that every rank is
// reachable by load/store) and the symmetric windows; collective over the communicators.
std::unique_ptr<Team> make_nccl_team(cuda::Communicators comms, std::size_t window_bytes);

// num_ranks ranks on `device`, each window one cudaMalloc of window_bytes (zeroed); ranks i = 0..
// num_ranks - 1 are members i.
std::unique_ptr<Team> make_virtual_team(int device, int num_ranks, std::size_t window_bytes);

}  // namespace weft::ep::detail
