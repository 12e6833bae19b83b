#include "weft/core/version.hpp"

namespace weft {

const char* version() noexcept { return WEFT_VERSION_STRING; }

bool built_with_cuda() noexcept { return WEFT_BUILT_WITH_CUDA != 0; }

}  // namespace weft
