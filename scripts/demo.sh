#!/usr/bin/env bash
# weft's main job on a fresh machine: set up, build the tools, and run the best demo that exists.
# Today: show what this build contains and which GPUs it sees (`weft info`).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target weft_cli
"$build_dir/tools/weft" info
