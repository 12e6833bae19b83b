#include "weft/cuda/nccl.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <utility>

#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"

namespace weft::cuda {
namespace {

// Ends an NCCL group on scope exit, also when a call inside it threw.
class GroupGuard {
 public:
  GroupGuard() { WEFT_NCCL_CHECK(ncclGroupStart()); }
  void end() {
    open_ = false;
    WEFT_NCCL_CHECK(ncclGroupEnd());
  }
  ~GroupGuard() {
    if (open_) ncclGroupEnd();
  }
  GroupGuard(const GroupGuard&) = delete;
  GroupGuard& operator=(const GroupGuard&) = delete;

 private:
  bool open_ = true;
};

int comm_device(ncclComm_t comm) {
  int device = -1;
  WEFT_NCCL_CHECK(ncclCommCuDevice(comm, &device));
  return device;
}

}  // namespace

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int nccl_compiled_version() noexcept { return NCCL_VERSION_CODE; }

int nccl_runtime_version() {
  int version = 0;
  WEFT_NCCL_CHECK(ncclGetVersion(&version));
  return version;
}

void check_nccl_runtime() {
  const int runtime = nccl_runtime_version();
  WEFT_CHECK(runtime == NCCL_VERSION_CODE, "NCCL loaded at run time is version ", runtime,
             " but weft was compiled against ", NCCL_VERSION_CODE,
             "; the device API needs the same library (point LD_LIBRARY_PATH at it)");
}

std::optional<LoadedNccl> loaded_nccl() {
  void* handle = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return std::nullopt;
  LoadedNccl result;
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    result.path = map->l_name;
  }
  // Asked through dlsym: in a program that binds NCCL at run time, the ncclGetVersion it links is
  // weft's forwarder, which answers only once a library is bound.
  using GetVersion = ncclResult_t (*)(int*);
  auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "ncclGetVersion"));
  if (get_version == nullptr || get_version(&result.version) != ncclSuccess) result.version = 0;
  dlclose(handle);  // the reference taken above; the library stays with its other users
  return result;
}

// ---------------------------------------------------------------------------------------------
Communicators Communicators::init_all(int num_devices) {
  WEFT_CHECK(num_devices >= 1, "init_all needs at least one device, got ", num_devices);
  const int available = device_count();
  WEFT_CHECK(num_devices <= available, "init_all asked for ", num_devices,
             " devices but only ", available, " are visible");
  check_nccl_runtime();
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(num_devices), nullptr);
  std::vector<int> devices(comms.size());
  for (int i = 0; i < num_devices; ++i) devices[static_cast<std::size_t>(i)] = i;
  WEFT_NCCL_CHECK(ncclCommInitAll(comms.data(), num_devices, devices.data()));
  return Communicators(std::move(comms));
}

Communicators::Communicators(std::vector<ncclComm_t> comms, bool owned)
    : comms_(std::move(comms)), owned_(owned) {}

Communicators::Communicators(Communicators&& other) noexcept
    : comms_(std::exchange(other.comms_, {})), owned_(other.owned_) {}

Communicators& Communicators::operator=(Communicators&& other) noexcept {
  if (this != &other) {
    release();
    comms_ = std::exchange(other.comms_, {});
    owned_ = other.owned_;
  }
  return *this;
}

Communicators::~Communicators() { release(); }

void Communicators::release() noexcept {
  if (!owned_ || comms_.empty()) return;
  // ncclCommDestroy of one rank can wait for its peers; destroying all local ranks in one group
  // keeps a process that drives several GPUs from waiting on itself.
  ncclGroupStart();
  for (ncclComm_t comm : comms_) {
    if (comm != nullptr) ncclCommDestroy(comm);
  }
  ncclGroupEnd();
  comms_.clear();
}

int Communicators::rank(std::size_t i) const {
  int rank = -1;
  WEFT_NCCL_CHECK(ncclCommUserRank(comms_.at(i), &rank));
  return rank;
}

int Communicators::num_ranks() const {
  WEFT_CHECK(!comms_.empty(), "no communicators");
  int count = 0;
  WEFT_NCCL_CHECK(ncclCommCount(comms_.front(), &count));
  return count;
}

int Communicators::device(std::size_t i) const { return comm_device(comms_.at(i)); }

// ---------------------------------------------------------------------------------------------
DevComms DevComms::create(const Communicators& comms, const DevCommOptions& options) {
  WEFT_CHECK(options.num_lsa_barriers >= 1, "num_lsa_barriers must be >= 1, got ",
             options.num_lsa_barriers);
  DevComms result;
  result.comms_.assign(comms.comms().begin(), comms.comms().end());
  result.dev_comms_.resize(result.comms_.size());
  // NCCL 2.28 has no initializer macro for the requirements: zero it. From 2.29 the struct
  // starts with its size, a magic number and the header's version, which ncclDevCommCreate
  // checks: the initializer sets them. No GIN resources are requested (GIN switches on with
  // signals/counters and fails without a NIC).
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements requirements = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements requirements;
  std::memset(&requirements, 0, sizeof(requirements));
#endif
  requirements.lsaBarrierCount = options.num_lsa_barriers;
  {
    GroupGuard group;
    for (std::size_t i = 0; i < result.comms_.size(); ++i) {
      DeviceGuard device(comm_device(result.comms_[i]));
      WEFT_NCCL_CHECK(ncclDevCommCreate(result.comms_[i], &requirements, &result.dev_comms_[i]));
    }
    group.end();
  }
  for (std::size_t i = 0; i < result.dev_comms_.size(); ++i) {
    const ncclDevComm& dc = result.dev_comms_[i];
    WEFT_CHECK(dc.lsaSize == dc.nRanks, "symmetric memory is not usable on this machine: rank ",
               dc.rank, " reaches ", dc.lsaSize, " of ", dc.nRanks,
               " ranks through load/store (LSA); weft needs all ranks on one NVLink domain");
  }
  return result;
}

DevComms::DevComms(DevComms&& other) noexcept
    : comms_(std::exchange(other.comms_, {})), dev_comms_(std::exchange(other.dev_comms_, {})) {}

DevComms& DevComms::operator=(DevComms&& other) noexcept {
  if (this != &other) {
    release();
    comms_ = std::exchange(other.comms_, {});
    dev_comms_ = std::exchange(other.dev_comms_, {});
  }
  return *this;
}

DevComms::~DevComms() { release(); }

void DevComms::release() noexcept {
  if (dev_comms_.empty()) return;
  ncclGroupStart();
  for (std::size_t i = 0; i < dev_comms_.size(); ++i) ncclDevCommDestroy(comms_[i], &dev_comms_[i]);
  ncclGroupEnd();
  dev_comms_.clear();
  comms_.clear();
}

// ---------------------------------------------------------------------------------------------
SymmetricWindows SymmetricWindows::allocate(const Communicators& comms, std::size_t num_bytes) {
  WEFT_CHECK(num_bytes > 0, "a symmetric window needs a positive size");
  // Windows are registered in whole pages of NCCL's required alignment.
  const std::size_t aligned =
      (num_bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
      NCCL_WIN_REQUIRED_ALIGNMENT;
  SymmetricWindows result;
  result.num_bytes_ = aligned;
  result.comms_.assign(comms.comms().begin(), comms.comms().end());
  for (std::size_t i = 0; i < result.comms_.size(); ++i) {
    result.devices_.push_back(comm_device(result.comms_[i]));
    DeviceGuard device(result.devices_.back());
    void* buffer = nullptr;
    WEFT_NCCL_CHECK(ncclMemAlloc(&buffer, aligned));
    result.buffers_.push_back(buffer);
  }
  result.windows_.assign(result.comms_.size(), nullptr);
  GroupGuard group;
  for (std::size_t i = 0; i < result.comms_.size(); ++i) {
    DeviceGuard device(result.devices_[i]);
    WEFT_NCCL_CHECK(ncclCommWindowRegister(result.comms_[i], result.buffers_[i], aligned,
                                           &result.windows_[i], NCCL_WIN_COLL_SYMMETRIC));
  }
  group.end();
  for (std::size_t i = 0; i < result.windows_.size(); ++i) {
    // NCCL returns success without a window where the communicator has no symmetric memory.
    WEFT_CHECK(result.windows_[i] != nullptr, "ncclCommWindowRegister gave rank ",
               comms.rank(i), " no window: symmetric memory is not supported on this "
               "communicator (NCCL_WIN_ENABLE=0, or no CUDA P2P / cuMem)");
  }
  return result;
}

SymmetricWindows::SymmetricWindows(SymmetricWindows&& other) noexcept
    : comms_(std::exchange(other.comms_, {})),
      devices_(std::exchange(other.devices_, {})),
      buffers_(std::exchange(other.buffers_, {})),
      windows_(std::exchange(other.windows_, {})),
      num_bytes_(other.num_bytes_) {}

SymmetricWindows& SymmetricWindows::operator=(SymmetricWindows&& other) noexcept {
  if (this != &other) {
    release();
    comms_ = std::exchange(other.comms_, {});
    devices_ = std::exchange(other.devices_, {});
    buffers_ = std::exchange(other.buffers_, {});
    windows_ = std::exchange(other.windows_, {});
    num_bytes_ = other.num_bytes_;
  }
  return *this;
}

SymmetricWindows::~SymmetricWindows() { release(); }

void SymmetricWindows::release() noexcept {
  if (!windows_.empty()) {
    ncclGroupStart();
    for (std::size_t i = 0; i < windows_.size(); ++i) {
      if (windows_[i] != nullptr) ncclCommWindowDeregister(comms_[i], windows_[i]);
    }
    ncclGroupEnd();
  }
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(devices_[i]);
    ncclMemFree(buffers_[i]);
    cudaSetDevice(previous);
  }
  windows_.clear();
  buffers_.clear();
  devices_.clear();
  comms_.clear();
}

}  // namespace weft::cuda
