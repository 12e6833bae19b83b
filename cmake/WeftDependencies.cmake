# Third-party dependencies, all from the system (scripts/setup.sh installs Debian's packages).
# Header-only libraries fall back to a plain header search where no CMake package config exists.

function(_weft_header_only_target target header)
  if(TARGET ${target})
    return()
  endif()
  find_path(_dir ${header} REQUIRED NO_CACHE)
  add_library(${target} INTERFACE IMPORTED GLOBAL)
  set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_dir}")
endfunction()

find_package(nlohmann_json 3.10 CONFIG QUIET)
_weft_header_only_target(nlohmann_json::nlohmann_json nlohmann/json.hpp)

if(WEFT_BUILD_TOOLS OR WEFT_BUILD_BENCHMARKS)
  find_package(CLI11 CONFIG QUIET)
  _weft_header_only_target(CLI11::CLI11 CLI/CLI.hpp)
endif()

if(WEFT_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(Threads REQUIRED)
endif()
if(WEFT_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
