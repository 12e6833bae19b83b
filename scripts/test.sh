#!/usr/bin/env bash
# Sets up, builds everything (warnings are errors) and runs every test. On a machine without a
# GPU the GPU tests report themselves skipped; every .cu file is still compiled when nvcc and
# NCCL are found. Then the CPU tests once more under AddressSanitizer and
# UndefinedBehaviorSanitizer, from a second build without CUDA in BUILD_DIR-asan.
#   scripts/test.sh            # build into build/ and build-asan/, run all tests
#   BUILD_DIR=out scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"

# Any sanitizer report fails its test (the build makes undefined behaviour fatal too). The package
# test is left out: its consumer links the installed, instrumented library without the
# sanitizers' runtimes, which a sanitized build is not meant for.
sanitize_dir="${build_dir}-asan"
cmake -S . -B "$sanitize_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON \
  -DWEFT_ENABLE_CUDA=OFF -DWEFT_SANITIZE=address,undefined
cmake --build "$sanitize_dir" -j "$jobs"
UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir "$sanitize_dir" --output-on-failure -j "$jobs" \
  -LE package

# The Python package: built by `pip install .` (the same CMake project, through scikit-build-core)
# into the environment of scripts/python-env.sh, then its pytest suite. Without a GPU the tests
# that need one report themselves skipped.
python=$(bash scripts/python-env.sh)
"$python" -m pip install -q --no-build-isolation .
"$python" -m pytest python/tests -q -rs
