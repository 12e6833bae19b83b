// The NCCL team (team.hpp): one rank per GPU, windows registered as NCCL symmetric memory, peers
// reached through NCCL's LSA pointers.
#include "team.hpp"

#include <utility>

#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"

namespace weft::ep::detail {
namespace {

using cuda::DeviceGuard;

class NcclTeam final : public Team {
 public:
  NcclTeam(cuda::Communicators comms, cuda::DevComms dev_comms, cuda::SymmetricWindows windows)
      : comms_(std::move(comms)), dev_comms_(std::move(dev_comms)), windows_(std::move(windows)) {}

  std::size_t size() const override { return comms_.size(); }
  int num_ranks() const override { return comms_.num_ranks(); }
  int rank(std::size_t i) const override { return comms_.rank(i); }
  int device(std::size_t i) const override { return comms_.device(i); }
  char* window(std::size_t i) const override {
    return static_cast<char*>(windows_.local_ptr(i));
  }
  std::size_t window_bytes() const override { return windows_.num_bytes(); }
  bool ranks_share_device() const override { return false; }

  void fill_peers(std::size_t i, char** peers) const override {
    DeviceGuard guard(comms_.device(i));
    launch_peer_table(windows_.window(i), comms_.num_ranks(), peers, nullptr);
  }

  // An NCCL all-reduce (of zeros) over every rank, every local member in one group.
  void barrier(const std::vector<int32_t*>& scratch) const override {
    WEFT_CHECK(scratch.size() == comms_.size(), "barrier: one scratch word per member");
    std::vector<cudaStream_t> streams(scratch.size());
    for (std::size_t i = 0; i < scratch.size(); ++i) {
      DeviceGuard guard(comms_.device(i));
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    }
    WEFT_NCCL_CHECK(ncclGroupStart());
    for (std::size_t i = 0; i < scratch.size(); ++i) {
      DeviceGuard guard(comms_.device(i));
      WEFT_NCCL_CHECK(ncclAllReduce(scratch[i], scratch[i], 1, ncclInt32, ncclSum, comms_[i],
                                    streams[i]));
    }
    WEFT_NCCL_CHECK(ncclGroupEnd());
    for (std::size_t i = 0; i < scratch.size(); ++i) {
      DeviceGuard guard(comms_.device(i));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
      WEFT_CUDA_CHECK(cudaStreamDestroy(streams[i]));
      WEFT_CUDA_CHECK(cudaMemset(scratch[i], 0, sizeof(int32_t)));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }

 private:
  cuda::Communicators comms_;
  cuda::DevComms dev_comms_;  // kept for the windows' lifetime (created before them)
  cuda::SymmetricWindows windows_;
};

}  // namespace

std::unique_ptr<Team> make_nccl_team(cuda::Communicators comms, std::size_t window_bytes) {
  cuda::check_nccl_runtime();
  // The device communicator first: its creation checks that every rank is reachable by
  // load/store, which ncclCommWindowRegister would not (it "succeeds" with a garbage window).
  auto dev_comms = cuda::DevComms::create(comms, {.num_lsa_barriers = 1});
  auto windows = cuda::SymmetricWindows::allocate(comms, window_bytes);
  for (std::size_t i = 0; i < comms.size(); ++i) {
    DeviceGuard guard(comms.device(i));
    WEFT_CUDA_CHECK(cudaMemset(windows.local_ptr(i), 0, windows.num_bytes()));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return std::make_unique<NcclTeam>(std::move(comms), std::move(dev_comms), std::move(windows));
}

}  // namespace weft::ep::detail
