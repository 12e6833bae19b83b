// The NCCL functions weft calls, defined here for programs that bind NCCL at run time
// (weft/cuda/nccl_dlopen.hpp states the contract). Each one forwards through a pointer that
// bind() fills from the chosen library. The list is every NCCL function weft_cuda calls; a
// function missing from it shows up as an undefined symbol of the program that links this
// (python/tests/test_nccl_loading.py checks the extension for any).
#include "weft/cuda/nccl_dlopen.hpp"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <mutex>

#include "weft/cuda/nccl.hpp"

// name, parameter list, argument list
#define WEFT_NCCL_FORWARDED(X)                                                                \
  X(ncclGetVersion, (int* version), (version))                                                \
  X(ncclGetUniqueId, (ncclUniqueId * id), (id))                                               \
  X(ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank),             \
    (comm, nranks, id, rank))                                                                 \
  X(ncclCommInitAll, (ncclComm_t * comm, int ndev, const int* devlist), (comm, ndev, devlist)) \
  X(ncclCommDestroy, (ncclComm_t comm), (comm))                                               \
  X(ncclCommSplit, (ncclComm_t comm, int color, int key, ncclComm_t* newcomm,                 \
                    ncclConfig_t* config),                                                    \
    (comm, color, key, newcomm, config))                                                      \
  X(ncclCommCount, (const ncclComm_t comm, int* count), (comm, count))                        \
  X(ncclCommCuDevice, (const ncclComm_t comm, int* device), (comm, device))                   \
  X(ncclCommUserRank, (const ncclComm_t comm, int* rank), (comm, rank))                       \
  X(ncclGroupStart, (), ())                                                                   \
  X(ncclGroupEnd, (), ())                                                                     \
  X(ncclMemAlloc, (void** ptr, size_t size), (ptr, size))                                     \
  X(ncclMemFree, (void* ptr), (ptr))                                                          \
  X(ncclCommWindowRegister, (ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,     \
                             int flags),                                                      \
    (comm, buff, size, win, flags))                                                           \
  X(ncclCommWindowDeregister, (ncclComm_t comm, ncclWindow_t win), (comm, win))               \
  X(ncclDevCommCreate, (ncclComm_t comm, ncclDevCommRequirements_t const* reqs,               \
                        ncclDevComm_t* out),                                                  \
    (comm, reqs, out))                                                                        \
  X(ncclDevCommDestroy, (ncclComm_t comm, ncclDevComm_t const* dev_comm), (comm, dev_comm))   \
  X(ncclBroadcast, (const void* send, void* recv, size_t count, ncclDataType_t type, int root, \
                    ncclComm_t comm, cudaStream_t stream),                                    \
    (send, recv, count, type, root, comm, stream))                                            \
  X(ncclAllReduce, (const void* send, void* recv, size_t count, ncclDataType_t type,          \
                    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),                    \
    (send, recv, count, type, op, comm, stream))                                              \
  X(ncclAllGather, (const void* send, void* recv, size_t count, ncclDataType_t type,          \
                    ncclComm_t comm, cudaStream_t stream),                                    \
    (send, recv, count, type, comm, stream))                                                  \
  X(ncclSend, (const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, \
               cudaStream_t stream),                                                          \
    (send, count, type, peer, comm, stream))                                                  \
  X(ncclRecv, (void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,      \
               cudaStream_t stream),                                                          \
    (recv, count, type, peer, comm, stream))

namespace weft::cuda::nccl_dlopen {
namespace {

enum Function : int {
#define WEFT_X(name, params, args) k_##name,
  WEFT_NCCL_FORWARDED(WEFT_X)
#undef WEFT_X
  kGetErrorString,
  kGetLastError,
  kNumFunctions
};

constexpr const char* kNames[kNumFunctions] = {
#define WEFT_X(name, params, args) #name,
    WEFT_NCCL_FORWARDED(WEFT_X)
#undef WEFT_X
    "ncclGetErrorString",
    "ncclGetLastError"};

std::atomic<void*> g_functions[kNumFunctions];
std::mutex g_bind_mutex;
BindResult g_binding;  // guarded by g_bind_mutex; final once bound

constexpr const char* kNotBound =
    "weft: no NCCL is bound yet (import weft.ep binds the NCCL that torch uses)";

void* function(Function f) noexcept { return g_functions[f].load(std::memory_order_acquire); }

std::string library_path(void* handle) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    return map->l_name;
  }
  return {};
}

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

}  // namespace

BindResult bind(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_bind_mutex);
  if (g_binding.bound) return g_binding;
  BindResult result;
  // RTLD_NOLOAD with the soname: the NCCL the process already holds, whatever its file name.
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    if (path.empty()) {
      result.error = "no libnccl.so.2 is loaded in this process and no library was named";
      return result;
    }
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      result.path = path;
      result.error = why != nullptr ? why : "dlopen failed";
      return result;
    }
  }
  result.path = library_path(handle);
  auto get_version = reinterpret_cast<decltype(&::ncclGetVersion)>(dlsym(handle, "ncclGetVersion"));
  if (get_version == nullptr || get_version(&result.version) != ncclSuccess) {
    result.error = "it has no working ncclGetVersion";
    dlclose(handle);
    return result;
  }
  if (result.version != NCCL_VERSION_CODE) {
    result.error = "it is NCCL " + version_string(result.version) + ", weft was compiled against " +
                   version_string(NCCL_VERSION_CODE);
    dlclose(handle);
    return result;
  }
  void* resolved[kNumFunctions] = {};
  for (int f = 0; f < kNumFunctions; ++f) {
    resolved[f] = dlsym(handle, kNames[f]);
    if (resolved[f] == nullptr) {
      result.error = std::string("it has no ") + kNames[f];
      dlclose(handle);
      return result;
    }
  }
  // The handle stays open for the life of the process: the forwarded pointers point into it.
  for (int f = 0; f < kNumFunctions; ++f) {
    g_functions[f].store(resolved[f], std::memory_order_release);
  }
  result.bound = true;
  g_binding = result;
  return result;
}

bool is_bound() noexcept { return function(k_ncclGetVersion) != nullptr; }

}  // namespace weft::cuda::nccl_dlopen

namespace nd = weft::cuda::nccl_dlopen;

#define WEFT_X(name, params, args)                                        \
  extern "C" ncclResult_t name params {                                   \
    void* f = nd::function(nd::k_##name);                                 \
    if (f == nullptr) return ncclInvalidUsage;                            \
    return reinterpret_cast<decltype(&::name)>(f) args;                   \
  }
WEFT_NCCL_FORWARDED(WEFT_X)
#undef WEFT_X

extern "C" const char* ncclGetErrorString(ncclResult_t result) {
  if (void* f = nd::function(nd::kGetErrorString)) {
    return reinterpret_cast<decltype(&::ncclGetErrorString)>(f)(result);
  }
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

extern "C" const char* ncclGetLastError(ncclComm_t comm) {
  if (void* f = nd::function(nd::kGetLastError)) {
    return reinterpret_cast<decltype(&::ncclGetLastError)>(f)(comm);
  }
  return nd::kNotBound;
}
