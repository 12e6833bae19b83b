#!/usr/bin/env bash
# `weft plan` on bad input: a clear error naming the problem, a non-zero exit, and no report
# (partial or otherwise) left behind. On good input: the report and the JSON are written.
#   cli_test.sh WEFT_BINARY DATA_DIR WORK_DIR
set -uo pipefail
weft=$1 data=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
failures=0

expect_failure() {  # name, expected message fragment, args...
  local name=$1 fragment=$2
  shift 2
  local out="$work/$name.html"
  if "$weft" plan -o "$out" --json "$work/$name.json" "$@" >"$work/$name.log" 2>&1; then
    echo "FAIL $name: exit 0"; failures=$((failures + 1)); return
  fi
  if ! grep -qF -- "$fragment" "$work/$name.log"; then
    echo "FAIL $name: message lacks '$fragment':"; cat "$work/$name.log"; failures=$((failures + 1))
  fi
  if compgen -G "$work/$name.*html*" >/dev/null || compgen -G "$work/$name.json*" >/dev/null; then
    echo "FAIL $name: left a file behind"; failures=$((failures + 1))
  fi
  echo "ok $name: $(tail -1 "$work/$name.log")"
}

expect_failure unknown_task "the schedule has no task of that name" \
  --schedule "$data/schedule_ok.json" --costs "$data/costs_unknown_task.json"
expect_failure negative_cost "expected a cost >= 0" \
  --schedule "$data/schedule_ok.json" --costs "$data/costs_negative.json"
expect_failure cycle "cycle" --schedule "$data/schedule_cycle.json"
expect_failure unknown_variant "unknown HSTU variant" --variant no_such_variant
expect_failure hstu_unknown_cost_task "warp_drive" --costs "$data/costs_unknown_task.json"

if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/ok.html" --json "$work/ok.json" \
     >"$work/ok.log" 2>&1 && [[ -s "$work/ok.html" && -s "$work/ok.json" ]]; then
  echo "ok good schedule"
else
  echo "FAIL good schedule:"; cat "$work/ok.log"; failures=$((failures + 1))
fi
echo "$((6 - failures)) passed, $failures failed"
exit $((failures > 0))
