#!/usr/bin/env bash
# `weft plan --suggest`: the printed table, the report and the schedule configs are written; the
# same input twice gives byte-identical configs and JSON; a schedule the search cannot move is
# refused with a clear error and leaves no file behind.
#   suggest_cli_test.sh WEFT_BINARY DATA_DIR WORK_DIR
set -uo pipefail
weft=$1 data=$2 work=$3
rm -rf "$work" && mkdir -p "$work/one" "$work/two" "$work/bad"
passed=0 failures=0
pass() { echo "ok $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }

for run in one two; do
  if ! (cd "$work/$run" && "$weft" plan --suggest -o s.html --json s.json >out.txt 2>err.txt); then
    fail "HSTU suggest ($run):"; cat "$work/$run/err.txt"
  fi
done
if [[ -s "$work/one/s.html" && -s "$work/one/weft-suggest-3.json" ]] &&
   grep -q '^#1  step' "$work/one/out.txt" && grep -q 'not searched: streams' "$work/one/out.txt"
then
  pass "HSTU suggest writes the report, three configs and the table"
else
  fail "HSTU suggest output:"; cat "$work/one/out.txt"
fi
identical=1
for f in s.json weft-suggest-1.json weft-suggest-2.json weft-suggest-3.json out.txt; do
  cmp -s "$work/one/$f" "$work/two/$f" || { identical=0; echo "differs: $f"; }
done
((identical)) && pass "the same input gives byte-identical output" || fail "determinism"

# Cannot move: one task, lookaheads fixed.
printf '%s\n' '{"tasks": [{"name": "only"}], "thread_maps": ["legacy"]}' >"$work/one_task.json"
if (cd "$work/bad" && "$weft" plan --suggest --schedule ../one_task.json --max-lookahead 0 \
      -o s.html >out.txt 2>err.txt); then
  fail "a schedule the search cannot move: exit 0"
elif ! grep -qF "the search cannot move this schedule: it has one task" "$work/bad/err.txt"; then
  fail "a schedule the search cannot move: message:"; cat "$work/bad/err.txt"
elif compgen -G "$work/bad/s.html*" >/dev/null || compgen -G "$work/bad/weft-suggest*" >/dev/null
then
  fail "a schedule the search cannot move: left a file behind"
else
  pass "a schedule the search cannot move: $(tail -1 "$work/bad/err.txt")"
fi

# A schedule file: its own costs, --config-out.
if "$weft" plan --suggest --schedule "$data/schedule_ok.json" --max-threads 3 \
     --config-out "$work/mine" -o "$work/mine.html" >"$work/mine.log" 2>&1 &&
   [[ -s "$work/mine-1.json" ]] && grep -q '^search: exact' "$work/mine.log"; then
  pass "a schedule file, searched exactly"
else
  fail "a schedule file:"; cat "$work/mine.log"
fi

# Host-bound HSTU costs: the suggestion is no slower than any preset map drawn beside it (each is
# a start of the search) and the report draws them all.
hb=$work/host_bound
if "$weft" plan --suggest --costs "$data/costs_hstu_host_bound.json" --config-out "$hb" \
     -o "$hb.html" --json "$hb.json" >"$hb.log" 2>&1 &&
   python3 - "$hb.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
best = r["suggestions"][0]["step_us"]
assert r["given"] and all(best <= g["step_us"] for g in r["given"]), (best, r["given"])
assert best < r["start"]["step_us"] and r["suggestions"][0]["bound"] == "host", r["suggestions"][0]
PY
then
  pass "host-bound HSTU: the suggestion beats the legacy map and is no slower than the presets"
else
  fail "host-bound HSTU:"; cat "$hb.log"
fi

# Costs from a real run's trace: a and b took 40 us each on one thread; apart, a step is 40 us.
tr=$work/from_trace
printf '%s\n' '{"streams": ["s1", "s2"], "tasks": [{"name": "a", "stream": "s1"},' \
  '{"name": "b", "stream": "s2"}], "thread_maps": ["legacy"]}' >"$tr.schedule.json"
if "$weft" plan --suggest --schedule "$tr.schedule.json" --trace "$data/trace_small.json" \
     --config-out "$tr" -o "$tr.html" --json "$tr.json" >"$tr.log" 2>&1 &&
   python3 - "$tr.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["start"]["step_us"] == 80 and r["suggestions"][0]["step_us"] == 40, r
assert r["suggestions"][0]["num_threads"] == 2 and r["method"] == "exact", r
PY
then
  pass "costs from a trace: the two 40 us tasks go on two threads"
else
  fail "costs from a trace:"; cat "$tr.log"
fi

# The same with every body holding the GIL: no overlap, one thread is as fast and ranks first.
if "$weft" plan --suggest --schedule "$tr.schedule.json" --trace "$data/trace_small.json" \
     --gil all --config-out "$tr-gil" -o "$tr-gil.html" --json "$tr-gil.json" \
     >"$tr-gil.log" 2>&1 &&
   python3 - "$tr-gil.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["suggestions"][0]["step_us"] == 80 and r["suggestions"][0]["num_threads"] == 1, r
PY
then
  pass "--gil all: the two tasks stay on one thread"
else
  fail "--gil all:"; cat "$tr-gil.log"
fi

echo "$passed passed, $failures failed"
((failures == 0))
