#!/usr/bin/env bash
# Builds the `weft` wheel for the torch of a Python environment and gives it its manylinux tag.
#   scripts/wheel.sh OUT_DIR [PYTHON]     # PYTHON: default that of scripts/python-env.sh
#   WEFT_WHEEL_BUILD_ROOT  where the CMake build folders are kept, one per NCCL version,
#                          nccl-<version> (default build/python): a second wheel for the same
#                          NCCL rebuilds nothing
# The wheel is built against the NCCL beside that environment's torch, and weft.ep runs only with
# that NCCL version (docs/python.md lists the torch versions that ship it). It needs no CUDA
# toolkit where it is installed: the CUDA runtime is linked statically and NCCL is bound at run
# time; auditwheel checks that it needs no library outside the manylinux policy (it would say
# so) and names the oldest glibc it runs on, which becomes the wheel's platform tag.
# Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/wheel.sh OUT_DIR [PYTHON]}
python=${2:-$(bash scripts/python-env.sh)}
tools=$(bash scripts/python-env.sh --tools)

nccl=$("$python" - <<'EOF'
import importlib.util, os, re
spec = importlib.util.find_spec("torch")
site = os.path.dirname(list(spec.submodule_search_locations)[0])
text = open(os.path.join(site, "nvidia", "nccl", "include", "nccl.h")).read()
print(".".join(re.search(rf"#define NCCL_{p}\s+(\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")))
EOF
)
build_dir=${WEFT_WHEEL_BUILD_ROOT:-build/python}/nccl-$nccl
raw="$out/raw"
rm -rf "$raw" "$out"/weft-*.whl
mkdir -p "$raw"
"$python" -m pip wheel -q --no-build-isolation --no-deps -C build-dir="$build_dir" -w "$raw" . >&2
wheel=$(ls "$raw"/weft-*.whl)
"$tools" -m auditwheel show "$wheel" >&2
PATH="$(dirname "$tools"):$PATH" "$tools" -m auditwheel repair -w "$out" "$wheel" >&2
rm -rf "$raw"
ls "$out"/weft-*manylinux*.whl | tail -1
