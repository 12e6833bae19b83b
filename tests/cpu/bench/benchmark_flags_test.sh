#!/usr/bin/env bash
# The Google Benchmark flags that a benchmark list gives the engine benchmark are accepted by the
# Google Benchmark this build links (it exits non-zero on a flag it refuses). Nothing is timed:
# --benchmark_list_tests only lists the benchmarks.
#   benchmark_flags_test.sh ENGINE_BENCH_BINARY LIST...
set -uo pipefail
binary=$1
shift
failures=0 checked=0
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
for list in "$@"; do
  while read -r command args; do
    [[ "$command" == bench/pipeline/weft_engine_bench ]] || continue
    checked=$((checked + 1))
    # shellcheck disable=SC2086  # the list's arguments, split as the shell running it would
    if "$binary" $args --benchmark_list_tests=true >/dev/null 2>"$errors"; then
      echo "ok $(basename "$list"): $args"
    else
      echo "FAIL $(basename "$list"): $args"; cat "$errors"; failures=$((failures + 1))
    fi
  done <"$list"
done
[[ $checked -gt 0 ]] || { echo "FAIL: no weft_engine_bench line in $*"; exit 1; }
echo "$checked checked, $failures failed"
exit $((failures > 0))
