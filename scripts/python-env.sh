#!/usr/bin/env bash
# Makes the Python environment that builds and tests the `weft` package, and prints its python.
# Idempotent: an environment already made with the same requirements is reused.
#   WEFT_VENV   where it lives (default: ~/.cache/weft/venv, outside the checkout, so that a new
#               clone does not download torch again)
# torch comes from PyPI (its default wheel, with CUDA libraries: ~3 GB, minutes to install the
# first time); the GPU machine instead uses its own python3, which has torch (scripts/gpu-test.sh).
set -euo pipefail
venv=${WEFT_VENV:-$HOME/.cache/weft/venv}
requirements=(torch==2.11.0 nanobind scikit-build-core pytest pytest-timeout numpy)
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
