#!/usr/bin/env bash
# Sets up, builds everything (warnings are errors) and runs every test. On a machine without a
# GPU the GPU tests report themselves skipped; every .cu file is still compiled when nvcc and
# NCCL are found.
#   scripts/test.sh            # build into build/, run all tests
#   BUILD_DIR=out scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"

# The Python package: built by `pip install .` (the same CMake project, through scikit-build-core)
# into the environment of scripts/python-env.sh, then its pytest suite. Without a GPU the tests
# that need one report themselves skipped.
python=$(bash scripts/python-env.sh)
"$python" -m pip install -q --no-build-isolation .
"$python" -m pytest python/tests -q -rs
