// NCCL's headers (host API and device API), as weft includes them.
//
// The folder of the NCCL that CMake chose comes first on the include path as a plain -I
// (weft_add_nccl_target says why), so NCCL's headers would be compiled with weft's warnings; this
// header makes them system headers instead (GCC and nvcc's front end treat what a system header
// includes as system headers too). Where the build defines WEFT_NCCL_EXPECTED_VERSION_CODE (the
// version CMake chose; weft::nccl_headers carries it), a translation unit whose compiler found
// another nccl.h fails to compile instead of building weft against a second NCCL.
#pragma once
#pragma GCC system_header

#include <nccl.h>
#include <nccl_device.h>

#if defined(WEFT_NCCL_EXPECTED_VERSION_CODE) && NCCL_VERSION_CODE != WEFT_NCCL_EXPECTED_VERSION_CODE
#error "the nccl.h found is not the NCCL version CMake chose: another include folder shadows it"
#endif
