// The virtual team (team.hpp; docs/ep.md "Virtual team"): R simulated ranks on one device, each
// window a plain allocation there, every rank's peer table the R allocations' addresses. The
// kernels' loads and stores to "peers" are then ordinary accesses to the same device's memory,
// with the same ordering instructions (ld.acquire.sys, fences) as over NVLink.
#include <cuda_runtime_api.h>

#include <vector>

#include "kernels/params.hpp"
#include "team.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"

namespace weft::ep::detail {
namespace {

using cuda::DeviceGuard;

class VirtualTeam final : public Team {
 public:
  VirtualTeam(int device, int num_ranks, std::size_t window_bytes)
      : device_(device), window_bytes_(window_bytes) {
    DeviceGuard guard(device_);
    windows_.reserve(std::size_t(num_ranks));
    try {
      for (int r = 0; r < num_ranks; ++r) {
        void* window = nullptr;
        const cudaError_t status = cudaMalloc(&window, window_bytes_);
        if (status != cudaSuccess) cudaGetLastError();  // not to surface as a later call's error
        WEFT_CHECK(status == cudaSuccess, "virtual team: cannot allocate the window of rank ", r,
                   " of ", num_ranks, " (", window_bytes_, " bytes each, on device ", device_,
                   "): ", cudaGetErrorString(status));
        windows_.push_back(static_cast<char*>(window));
        WEFT_CUDA_CHECK(cudaMemset(window, 0, window_bytes_));
      }
    } catch (...) {
      release();  // the destructor does not run for a constructor that threw
      throw;
    }
    // Every window is zero before any Buffer of the team exists (what barrier() relies on).
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~VirtualTeam() override { release(); }
  VirtualTeam(const VirtualTeam&) = delete;
  VirtualTeam& operator=(const VirtualTeam&) = delete;

  std::size_t size() const override { return windows_.size(); }
  int num_ranks() const override { return int(windows_.size()); }
  int rank(std::size_t i) const override { return int(i); }
  int device(std::size_t) const override { return device_; }
  char* window(std::size_t i) const override { return windows_.at(i); }
  std::size_t window_bytes() const override { return window_bytes_; }
  bool ranks_share_device() const override { return true; }

  void fill_peers(std::size_t, char** peers) const override {
    DeviceGuard guard(device_);
    WEFT_CUDA_CHECK(cudaMemcpy(peers, windows_.data(), windows_.size() * sizeof(char*),
                               cudaMemcpyHostToDevice));
  }

  // Nothing to wait for: the windows were zeroed and the device synchronised when the team was
  // made, before any of its Buffers existed, and one host thread makes them all.
  void barrier(const std::vector<int32_t*>& scratch) const override {
    WEFT_CHECK(scratch.size() == windows_.size(), "barrier: one scratch word per member");
  }

 private:
  void release() noexcept {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    for (char* w : windows_) cudaFree(w);
    cudaSetDevice(previous);
    windows_.clear();
  }

  int device_ = 0;
  std::size_t window_bytes_ = 0;
  std::vector<char*> windows_;
};

}  // namespace

std::unique_ptr<Team> make_virtual_team(int device, int num_ranks, std::size_t window_bytes) {
  WEFT_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "a virtual team has 1..", kMaxRanks,
             " ranks, got ", num_ranks);
  WEFT_CHECK(window_bytes > 0, "a window needs a positive size");
  return std::make_unique<VirtualTeam>(device, num_ranks, window_bytes);
}

}  // namespace weft::ep::detail
