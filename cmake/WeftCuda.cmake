# Decides whether the CUDA half of weft (weft::cuda) is built.
#
# WEFT_ENABLE_CUDA defaults to ON when both nvcc and NCCL >= 2.28 (with its device API) are found.
# NCCL is looked for, in this order, in: NCCL_ROOT (CMake or environment variable), the CUDA
# toolkit folder, and the nvidia/nccl folder of the Python environment that `python3` runs; with
# WEFT_BUILD_PYTHON, the Python environment being built for (its torch's NCCL) comes before the
# toolkit (cmake/WeftNccl.cmake).
include(CheckLanguage)
include(WeftNccl)

set(WEFT_NCCL_MIN_VERSION 2.28.0)

check_language(CUDA)
set(_weft_cuda_found OFF)
if(CMAKE_CUDA_COMPILER)
  # The toolkit folder is where nvcc lives, one level up from bin/.
  get_filename_component(_weft_nvcc_dir "${CMAKE_CUDA_COMPILER}" DIRECTORY)
  get_filename_component(_weft_cuda_root "${_weft_nvcc_dir}" DIRECTORY)
  # The Python package builds against the NCCL of the environment it installs into (the one
  # torch loads, beside torch), the C++ build against the toolkit's when it has one.
  if(WEFT_BUILD_PYTHON)
    weft_find_nccl(CUDA_ROOT "${_weft_cuda_root}" MIN_VERSION ${WEFT_NCCL_MIN_VERSION}
                   PYTHON "${Python_EXECUTABLE}" PYTHON_FIRST)
  else()
    weft_find_nccl(CUDA_ROOT "${_weft_cuda_root}" MIN_VERSION ${WEFT_NCCL_MIN_VERSION})
  endif()
  if(WEFT_NCCL_FOUND)
    set(_weft_cuda_found ON)
    if(WEFT_BUILD_PYTHON AND NOT WEFT_NCCL_ORIGIN MATCHES "torch|nvidia.nccl|NCCL_ROOT")
      message(WARNING "weft: ${Python_EXECUTABLE} has no torch with an NCCL >= "
                      "${WEFT_NCCL_MIN_VERSION} (nor nvidia.nccl): building against "
                      "${WEFT_NCCL_ORIGIN}'s NCCL ${WEFT_NCCL_VERSION}; weft.ep will refuse any "
                      "other NCCL. Build in the environment of the torch it is for.")
    endif()
    message(STATUS "weft: nvcc found at ${CMAKE_CUDA_COMPILER}")
  else()
    message(STATUS "weft: nvcc found, but no NCCL >= ${WEFT_NCCL_MIN_VERSION} with nccl_device.h "
                   "(set NCCL_ROOT to its install folder)")
  endif()
else()
  message(STATUS "weft: no CUDA compiler (nvcc) found")
endif()

option(WEFT_ENABLE_CUDA "Build weft::cuda (needs nvcc and NCCL >= ${WEFT_NCCL_MIN_VERSION})"
       ${_weft_cuda_found})

if(WEFT_ENABLE_CUDA)
  if(NOT _weft_cuda_found)
    message(FATAL_ERROR "weft: WEFT_ENABLE_CUDA is ON but nvcc and NCCL >= ${WEFT_NCCL_MIN_VERSION} "
                        "were not both found (see the messages above)")
  endif()
  # Hopper by default, but only when the caller has not chosen.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  weft_add_nccl_target("${WEFT_NCCL_INCLUDE_DIR}" "${WEFT_NCCL_LIBRARY}" "${WEFT_NCCL_VERSION}")
  message(STATUS "weft: building weft::cuda for CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")
else()
  message(STATUS "weft: weft::cuda is OFF; only weft::core and the CPU tests are built")
endif()
