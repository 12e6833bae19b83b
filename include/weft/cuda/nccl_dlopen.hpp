// Run-time binding of NCCL, for programs that link weft::cuda with the target property
// WEFT_NCCL_DLOPEN (the Python extension): they do not link libnccl; the NCCL functions weft calls
// are defined by weft_nccl_dlopen and forward to the library that bind() chose.
//
// Contracts:
//  - bind(path) binds to the libnccl.so.2 already in the process when there is one (matched by its
//    soname, as the dynamic linker matches a later program's dependency: a process holds one
//    NCCL, and a torch imported first has loaded its own), else loads the file at path. It binds
//    only a library of the version weft was compiled against (NCCL_VERSION_CODE: the device API's
//    structs are shared verbatim) that has every function weft calls; otherwise it binds nothing,
//    releases what it loaded (a library that was in the process already stays), and the result
//    says why. Once bound, every later call returns that binding and loads nothing.
//  - Before a binding, every forwarded NCCL call returns ncclInvalidUsage, ncclGetLastError says
//    that no NCCL is bound, and ncclGetErrorString answers from a table of its own.
//  - Thread-safe; a binding is never undone.
#pragma once

#include <string>

namespace weft::cuda::nccl_dlopen {

struct BindResult {
  bool bound = false;  // weft's NCCL calls now go to the library at path
  std::string path;   // the library bound or examined ("" when none could be loaded)
  int version = 0;    // its NCCL_VERSION_CODE (0 when unknown)
  std::string error;  // why nothing was bound ("" when bound)
};

BindResult bind(const std::string& path);

// Whether NCCL calls are forwarded (a bind() succeeded).
bool is_bound() noexcept;

}  // namespace weft::cuda::nccl_dlopen
