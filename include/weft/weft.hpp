// Umbrella header: the CPU core of weft. CUDA parts are opt-in includes under weft/cuda and weft/ep.
#pragma once

#include "weft/core/error.hpp"
#include "weft/core/version.hpp"
