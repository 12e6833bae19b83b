#pragma once

namespace weft {

// The library's version, "major.minor.patch".
const char* version() noexcept;
// True when this build of weft includes weft::cuda (CUDA kernels, NCCL, weft::ep).
bool built_with_cuda() noexcept;

}  // namespace weft
