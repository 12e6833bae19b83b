// NCCL plumbing shared by weft's CUDA parts: communicators, device communicators (ncclDevComm)
// and symmetric memory windows, for one process per GPU or one process driving all local GPUs.
//
// One process, all GPUs (tests, single-node tools):
//   auto comms = weft::cuda::Communicators::init_all(2);
//   auto dev_comms = weft::cuda::DevComms::create(comms, {.num_lsa_barriers = 1});
//   auto windows = weft::cuda::SymmetricWindows::allocate(comms, 64 << 20);
//
// Contracts (NCCL 2.28 device API):
//  - every rank creates the same device communicators and windows, of equal sizes, in the same
//    order; with one process driving several GPUs all ranks' calls sit in one NCCL group;
//  - DevComms::create checks that every rank of the communicator is reachable through load/store
//    (LSA): ncclCommWindowRegister does not fail where symmetric memory is unsupported, it hands
//    back a window that is garbage on the device, so the check has to come first;
//  - the library loaded at run time must be the NCCL whose headers weft was compiled with, since
//    the device-side structs are shared verbatim (check_nccl_runtime()).
#pragma once

#include "weft/cuda/nccl_include.hpp"

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace weft::cuda {

// Number of CUDA devices visible; 0 (never an exception) where there is no driver or no GPU.
int device_count() noexcept;

// NCCL_VERSION_CODE of the headers weft was compiled with, and of the library loaded now.
int nccl_compiled_version() noexcept;
int nccl_runtime_version();
// Throws weft::Error unless the two are equal.
void check_nccl_runtime();

// The libnccl.so.2 this process holds, if any (the dynamic linker matches it by its soname, so a
// process holds at most one): its file and NCCL_VERSION_CODE. Loads nothing, binds nothing.
struct LoadedNccl {
  std::string path;  // the file the dynamic linker mapped
  int version = 0;   // its NCCL_VERSION_CODE, e.g. 22809 for 2.28.9
};
std::optional<LoadedNccl> loaded_nccl();

// Owns ncclComm_t handles, one per local rank. Destroys them (in one group) on destruction.
class Communicators {
 public:
  // One process drives devices 0..num_devices-1 (ncclCommInitAll).
  static Communicators init_all(int num_devices);
  // Takes ownership of communicators created elsewhere (e.g. one per process by ncclCommInitRank).
  explicit Communicators(std::vector<ncclComm_t> comms, bool owned = true);
  Communicators(Communicators&&) noexcept;
  Communicators& operator=(Communicators&&) noexcept;
  ~Communicators();

  std::span<const ncclComm_t> comms() const noexcept { return comms_; }
  std::size_t size() const noexcept { return comms_.size(); }
  ncclComm_t operator[](std::size_t i) const { return comms_.at(i); }
  int rank(std::size_t i) const;     // rank of local communicator i in its world
  int num_ranks() const;             // world size
  int device(std::size_t i) const;   // CUDA device of local communicator i

 private:
  void release() noexcept;
  std::vector<ncclComm_t> comms_;
  bool owned_ = true;
};

struct DevCommOptions {
  int num_lsa_barriers = 1;  // ncclLsaBarrierSession indices available: [0, num_lsa_barriers)
};

// One ncclDevComm per local communicator, created in one group; destroyed on destruction.
class DevComms {
 public:
  static DevComms create(const Communicators& comms, const DevCommOptions& options);
  DevComms(DevComms&&) noexcept;
  DevComms& operator=(DevComms&&) noexcept;
  ~DevComms();

  const ncclDevComm& operator[](std::size_t i) const { return dev_comms_.at(i); }
  std::size_t size() const noexcept { return dev_comms_.size(); }

 private:
  DevComms() = default;
  void release() noexcept;
  std::vector<ncclComm_t> comms_;
  std::vector<ncclDevComm> dev_comms_;
};

// One symmetric window per local communicator: ncclMemAlloc'd (cuMem) memory of num_bytes,
// registered with NCCL_WIN_COLL_SYMMETRIC in one group. Freed on destruction.
class SymmetricWindows {
 public:
  static SymmetricWindows allocate(const Communicators& comms, std::size_t num_bytes);
  SymmetricWindows(SymmetricWindows&&) noexcept;
  SymmetricWindows& operator=(SymmetricWindows&&) noexcept;
  ~SymmetricWindows();

  ncclWindow_t window(std::size_t i) const { return windows_.at(i); }
  void* local_ptr(std::size_t i) const { return buffers_.at(i); }
  std::size_t num_bytes() const noexcept { return num_bytes_; }
  std::size_t size() const noexcept { return windows_.size(); }

 private:
  SymmetricWindows() = default;
  void release() noexcept;
  std::vector<ncclComm_t> comms_;
  std::vector<int> devices_;
  std::vector<void*> buffers_;
  std::vector<ncclWindow_t> windows_;
  std::size_t num_bytes_ = 0;
};

}  // namespace weft::cuda
