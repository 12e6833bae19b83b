#!/usr/bin/env bash
# The report opens in a real browser: render `weft plan`'s default report headless to a PNG,
# check the picture is not blank, and that the rendered DOM holds every variant's two SVGs.
#   browser_test.sh WEFT_BINARY WORK_DIR PNG_STATS_PY
set -euo pipefail
weft=$1 work=$2 png_stats=$3
rm -rf "$work" && mkdir -p "$work"

browser=$(command -v chromium || command -v chromium-browser || true)
if [[ -z "$browser" ]]; then
  echo "FAIL: no chromium on this machine (scripts/setup.sh installs it)"
  exit 1
fi

"$weft" plan -o "$work/report.html" --json "$work/report.json"
flags=(--headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$work/profile")
timeout 120 "$browser" "${flags[@]}" --window-size=1400,2400 --screenshot="$work/report.png" \
  "file://$work/report.html" >"$work/chromium.log" 2>&1
timeout 120 "$browser" "${flags[@]}" --dump-dom "file://$work/report.html" >"$work/dom.html" \
  2>>"$work/chromium.log"

python3 "$png_stats" "$work/report.png" 12 0.02

num_variants=9
gantts=$(grep -o '<svg class="gantt"' "$work/dom.html" | wc -l)
topologies=$(grep -o '<svg class="topology"' "$work/dom.html" | wc -l)
echo "rendered DOM: $gantts Gantt and $topologies topology SVGs"
[[ "$gantts" -eq "$num_variants" && "$topologies" -eq "$num_variants" ]] || {
  echo "FAIL: expected $num_variants of each"; exit 1; }
for v in legacy_none default_d3 by_stream_d3 per_task_d3 io_prefetch_compute_d3 \
         io_data_dist_compute_d3 full_split_d3 default_d6 full_split_d6; do
  grep -q "id=\"$v\"" "$work/dom.html" || { echo "FAIL: variant $v missing"; exit 1; }
done
echo "browser render ok"
