// WEFT_HOST_DEVICE: a function of a plain header that CUDA code calls too (the same arithmetic
// on the host reference and in a kernel); empty for a host-only compiler.
#pragma once

#if defined(__CUDACC__)
#define WEFT_HOST_DEVICE __host__ __device__
#else
#define WEFT_HOST_DEVICE
#endif
