#!/usr/bin/env bash
# Sets up, builds everything (warnings are errors) and runs every test. On a machine without a
# GPU the GPU tests report themselves skipped; every .cu file is still compiled when nvcc and
# NCCL are found. Then the CPU tests once more under AddressSanitizer and
# UndefinedBehaviorSanitizer, from a second build without CUDA in BUILD_DIR-asan. Then the Python
# package under two torch versions, every .cu file against the second one's NCCL headers, and
# the wheel in a user's environment (see the Python part below). Prints each stage's time last.
#   scripts/test.sh            # build into build/ and build-asan/, run all tests
#   BUILD_DIR=out scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
times=()
stage_start=$(date +%s)
stage_done() {
  local now
  now=$(date +%s)
  times+=("$1: $((now - stage_start)) s")
  stage_start=$now
}

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
stage_done "C++ build and tests"

# Any sanitizer report fails its test (the build makes undefined behaviour fatal too). The package
# test is left out: its consumer links the installed, instrumented library without the
# sanitizers' runtimes, which a sanitized build is not meant for.
sanitize_dir="${build_dir}-asan"
cmake -S . -B "$sanitize_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON \
  -DWEFT_ENABLE_CUDA=OFF -DWEFT_SANITIZE=address,undefined
cmake --build "$sanitize_dir" -j "$jobs"
UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir "$sanitize_dir" --output-on-failure -j "$jobs" \
  -LE package
stage_done "sanitizer build and tests"

# The Python package, under the pinned torch (the GPU machine's) and the newest on PyPI, each in an
# environment of scripts/python-env.sh: a wheel built by pip against the NCCL beside that torch
# (scripts/wheel.sh; its CMake build is kept per NCCL version, so a rerun rebuilds nothing),
# installed there, then the pytest suite. Without a GPU the tests that need one report themselves
# skipped.
wheels="$build_dir/wheels"
rm -rf "$wheels"
declare -A python wheel
for torch in pinned newest; do
  python[$torch]=$(bash scripts/python-env.sh --torch "$torch")
  wheel[$torch]=$(WEFT_WHEEL_BUILD_ROOT="$build_dir/python" \
                  bash scripts/wheel.sh "$wheels/$torch" "${python[$torch]}")
  "${python[$torch]}" -m pip install -q --no-deps --force-reinstall "${wheel[$torch]}"
  "${python[$torch]}" -m pytest python/tests -q -rs -p no:cacheprovider
  stage_done "Python package, torch $("${python[$torch]}" -c 'import torch; print(torch.__version__)')"
done

# Every .cu file compiled against the other NCCL versions of the supported range too (the C++
# build above used the CUDA toolkit's NCCL, 2.28.9, the pinned torch's version): the newest
# torch's (2.30) and 2.29 (torch 2.12 and 2.13, which CI does not install: its nvidia-nccl wheel,
# downloaded once into ~/.cache/weft/nccl). Object files only, nothing linked or run.
compile_cu() {  # NCCL_ROOT BUILD_DIR
  cmake -S . -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEFT_WERROR=ON \
    -DNCCL_ROOT="$1" >/dev/null
  local objects
  mapfile -t objects < <(ninja -C "$2" -t targets all | sed -n 's/^\([^:]*\.cu\.o\): .*/\1/p')
  ninja -C "$2" -j "$jobs" "${objects[@]}"
  stage_done "${#objects[@]} .cu files against NCCL $(
    sed -n 's/^WEFT_NCCL_VERSION:STRING=//p' "$2/CMakeCache.txt")'s headers"
}
compile_cu "$("${python[newest]}" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')" \
  "$build_dir-nccl-newest"
nccl_cache=${WEFT_NCCL_CACHE:-$HOME/.cache/weft/nccl}
for version in 2.29.7; do
  if [[ ! -f "$nccl_cache/$version/nvidia/nccl/include/nccl_device.h" ]]; then
    download=$(mktemp -d)
    "${python[pinned]}" -m pip download -q --no-deps "nvidia-nccl-cu13==$version" -d "$download"
    "${python[pinned]}" -m zipfile -e "$download"/nvidia_nccl_cu13-*.whl "$nccl_cache/$version"
    rm -rf "$download"
  fi
  compile_cu "$nccl_cache/$version/nvidia/nccl" "$build_dir-nccl-$version"
done

# The wheel as a user meets it: installed by pip into an environment that has only torch and
# pytest (the pinned torch; pip must add nothing: torch is its one dependency), its tests run there
# with no CUDA toolkit on PATH or LD_LIBRARY_PATH. Then the same wheel beside the newest torch,
# whose NCCL is another: weft.ep must refuse with the fix, and torch, weft.pipeline and weft.plan
# keep working (test_nccl_loading.py).
runtime=$(bash scripts/python-env.sh --runtime --torch pinned)
"$runtime" -m pip uninstall -q -y weft 2>/dev/null || true
installed=$("$runtime" -m pip install "${wheel[pinned]}" | grep '^Successfully installed' || true)
echo "$installed"
[[ "$installed" =~ ^Successfully\ installed\ weft-[0-9.]+$ ]] ||
  { echo "test.sh: installing the wheel did not add weft alone"; exit 1; }
root=$PWD
(cd "$wheels" && env -u CUDA_HOME -u CUDA_PATH -u LD_LIBRARY_PATH PATH=/usr/bin:/bin \
   "$runtime" -m pytest "$root/python/tests" -q -rs -p no:cacheprovider)
cross="$wheels/cross"
"${python[newest]}" -m pip install -q --no-deps --target "$cross" "${wheel[pinned]}"
WEFT_TEST_CROSS_NCCL=1 PYTHONPATH="$cross" "${python[newest]}" -m pytest \
  python/tests/test_nccl_loading.py -q -rs -p no:cacheprovider
stage_done "the wheel in a user's environment, and beside another NCCL"

printf '%s\n' "${times[@]}"
