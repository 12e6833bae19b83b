#!/usr/bin/env bash
# weft's main job on a fresh machine: set up, build the tools, and draw the planner's report of the
# nine HSTU thread-map presets (simulated; no GPU needed) into weft-plan.html.
#   bash scripts/demo.sh [extra `weft plan` options, e.g. --variant full_split_d6]
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target weft_cli
"$build_dir/tools/weft" info
"$build_dir/tools/weft" plan -o weft-plan.html "$@"
echo "open weft-plan.html in a browser"
