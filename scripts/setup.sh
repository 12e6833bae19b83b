#!/usr/bin/env bash
# Installs what weft needs to build and test on a Debian/Ubuntu machine. Idempotent, never prompts.
# The CUDA toolkit (nvcc) and NCCL >= 2.28 are not installed here: weft::cuda is built when they
# are found (see README), and weft::core with its tests builds without them.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev
  clang-format
)
# The planner's report test renders the HTML page in a real browser.
if [[ "${WEFT_SETUP_BROWSER:-1}" == 1 ]]; then
  packages+=(chromium)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "setup: all packages present"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "setup: installing ${missing[*]}"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
echo "setup: done"
