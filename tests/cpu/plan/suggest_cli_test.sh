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

# --gpu-wait: b's body waited in the trace for a's GPU work of its batch (100 us) and then
# worked 30 us. Read as 130 us of host work, b bounds every schedule (130 us, on a thread of its
# own); with the wait left out and simulated, a one batch ahead spares b the wait: a step is
# a's 100 us of GPU work (one thread ranks first among the maps that reach it).
gw=$work/gpu_wait
printf '%s\n' '{"streams": ["s1", "s2"], "tasks": [{"name": "a", "stream": "s1", "writes": ["x"]},' \
  '{"name": "b", "stream": "s2", "reads": ["x"]}], "thread_maps": ["legacy"]}' >"$gw.schedule.json"
python3 - "$gw.trace.json" <<'PY'
import json, sys
events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "host"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "main"}},
          {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "gpu"}},
          {"ph": "M", "name": "thread_name", "pid": 2, "tid": 0, "args": {"name": "s1"}},
          {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "s2"}}]
for b in range(4):
    t, run = 200 * b, {"batch": b, "lookahead": 0, "iteration": b}
    events += [{"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": t, "dur": 10, "args": run},
               {"ph": "X", "name": "a", "pid": 2, "tid": 0, "ts": t + 10, "dur": 100, "args": run},
               {"ph": "X", "name": "b", "pid": 1, "tid": 0, "ts": t + 10, "dur": 130, "args": run},
               {"ph": "X", "name": "b", "pid": 2, "tid": 1, "ts": t + 140, "dur": 50, "args": run}]
json.dump({"traceEvents": events}, open(sys.argv[1], "w"))
PY
gw_best() {  # extra flags...; prints the best suggestion's step and thread map
  "$weft" plan --suggest --schedule "$gw.schedule.json" --trace "$gw.trace.json" --max-lookahead 1 \
    --max-threads 2 "$@" --config-out "$gw" -o "$gw.html" --json "$gw.json" >"$gw.log" 2>&1 &&
    python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))["suggestions"][0]
print(s["step_us"], s["config"]["thread_map"] == "legacy")' "$gw.json"
}
if [[ "$(gw_best)" == "130.0 False" && "$(gw_best --gpu-wait b=a)" == "100.0 True" ]]; then
  pass "--gpu-wait: the wait simulated, not charged: 100 us on one thread instead of 130"
else
  fail "--gpu-wait: $(gw_best) / $(gw_best --gpu-wait b=a)"; cat "$gw.log"
fi
expect_refusal() {  # message, then the command's arguments
  local message=$1
  shift
  if "$weft" plan "$@" -o "$gw-bad.html" >"$gw-bad.log" 2>&1; then
    fail "accepted: $*"
  elif grep -qF -e "$message" "$gw-bad.log"; then
    pass "refused: $*"
  else
    fail "refused without '$message': $*"; cat "$gw-bad.log"
  fi
}
expect_refusal "--gpu-wait is for --suggest --trace" --gpu-wait b=a --schedule "$gw.schedule.json"
expect_refusal "--gpu-wait applies to the costs the first --trace measures" --suggest \
  --gpu-wait b=a --schedule "$gw.schedule.json"
expect_refusal "--gpu-wait applies to the costs the first --trace measures" --suggest \
  --gpu-wait b=a --schedule "$gw.schedule.json" --trace "$gw.trace.json" \
  --costs "$data/costs_forward.json"
expect_refusal "--gpu-wait names task 'b' twice" --suggest --gpu-wait b=b --gpu-wait b=a \
  --schedule "$gw.schedule.json" --trace "$gw.trace.json"
expect_refusal "--gpu-wait takes TASK=PRODUCER, got 'b'" --suggest --gpu-wait b \
  --schedule "$gw.schedule.json" --trace "$gw.trace.json"
expect_refusal "gpu_waits producer 'c' is not a task of the trace" --suggest --gpu-wait b=c \
  --schedule "$gw.schedule.json" --trace "$gw.trace.json"

echo "$passed passed, $failures failed"
((failures == 0))
