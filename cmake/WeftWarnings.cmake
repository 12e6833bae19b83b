# weft_warnings: an interface target every weft target links privately (never exported).
# -Wno-missing-field-initializers: options structs are filled with designated initializers
# ({.cascade = kD6}) and rely on their members' defaults, which -Wextra would flag.
add_library(weft_warnings INTERFACE)
target_compile_options(weft_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
                            -Wno-missing-field-initializers>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-missing-field-initializers>)
if(WEFT_WERROR)
  target_compile_options(weft_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
endif()

# WEFT_SANITIZE: sanitizers for weft's own C++ sources and the programs linking weft_warnings
# (tests, tools, benchmarks), e.g. "address,undefined"; empty for none. A run stops at the first
# undefined-behaviour report as at an address error. .cu files are compiled without them.
# -Wno-maybe-uninitialized: GCC's analysis of instrumented code flags the standard library's own
# members (std::function inside std::regex); the build without sanitizers keeps the warning.
set(WEFT_SANITIZE "" CACHE STRING "Sanitizers for weft's C++ code, e.g. address,undefined")
if(WEFT_SANITIZE)
  target_compile_options(weft_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${WEFT_SANITIZE} -fno-omit-frame-pointer
                              -fno-sanitize-recover=all -Wno-maybe-uninitialized>)
  target_link_options(weft_warnings INTERFACE -fsanitize=${WEFT_SANITIZE})
endif()
