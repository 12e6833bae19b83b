#!/usr/bin/env bash
# `weft plan` on bad input: a clear error naming the problem, a non-zero exit, and no report
# (partial or otherwise) left behind. On good input: the report and the JSON are written; an
# output path that is a FIFO or a link to a device is streamed to and left as it was.
#   cli_test.sh WEFT_BINARY DATA_DIR WORK_DIR
set -uo pipefail
weft=$1 data=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
passed=0 failures=0
pass() { echo "ok $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }

expect_failure() {  # name, expected message fragment, args...
  local name=$1 fragment=$2
  shift 2
  local out="$work/$name.html"
  if "$weft" plan -o "$out" --json "$work/$name.json" "$@" >"$work/$name.log" 2>&1; then
    fail "$name: exit 0"; return
  fi
  if ! grep -qF -- "$fragment" "$work/$name.log"; then
    fail "$name: message lacks '$fragment':"; cat "$work/$name.log"; return
  fi
  if compgen -G "$work/$name.*html*" >/dev/null || compgen -G "$work/$name.json*" >/dev/null; then
    fail "$name: left a file behind"; return
  fi
  pass "$name: $(tail -1 "$work/$name.log")"
}

expect_failure unknown_task "the schedule has no task of that name" \
  --schedule "$data/schedule_ok.json" --costs "$data/costs_unknown_task.json"
expect_failure negative_cost "expected a cost >= 0" \
  --schedule "$data/schedule_ok.json" --costs "$data/costs_negative.json"
expect_failure huge_cost "expected a cost <= 1e+09 us, got 1e+308" \
  --schedule "$data/schedule_ok.json" --costs "$data/costs_huge.json"
expect_failure cycle "cycle" --schedule "$data/schedule_cycle.json"
expect_failure unknown_variant "unknown HSTU variant" --variant no_such_variant
expect_failure hstu_unknown_cost_task "warp_drive" --costs "$data/costs_unknown_task.json"
expect_failure endless_schedule "/dev/zero: larger than" --schedule /dev/zero

# Good input: the report and the JSON.
if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/ok.html" --json "$work/ok.json" \
     >"$work/ok.log" 2>&1 && [[ -s "$work/ok.html" && -s "$work/ok.json" ]]; then
  pass "good schedule"
else
  fail "good schedule:"; cat "$work/ok.log"
fi

# A bare file name in the current folder (what scripts/demo.sh, the README's main job, passes),
# and the default output name.
if (cd "$work" && "$weft" plan -o bare.html --json bare.json >bare.log 2>&1 && "$weft" plan \
      >default.log 2>&1) && [[ -s "$work/bare.html" && -s "$work/bare.json" && \
      -s "$work/weft-plan.html" ]]; then
  pass "a bare output name in the current folder"
else
  fail "a bare output name in the current folder:"; cat "$work/bare.log" "$work/default.log"
fi

# --json to a path that cannot be written: an error, and no HTML report either.
if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/bad_json.html" \
     --json "$work/no/such/folder/x.json" >"$work/bad_json.log" 2>&1; then
  fail "bad --json path: exit 0"
elif compgen -G "$work/bad_json.html*" >/dev/null; then
  fail "bad --json path: the HTML report was written"
else
  pass "bad --json path: $(tail -1 "$work/bad_json.log")"
fi

# -o a folder: refused before anything is written.
mkdir -p "$work/a_folder"
if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/a_folder" \
     >"$work/folder.log" 2>&1; then
  fail "-o a folder: exit 0"
elif ! grep -qF "is not a regular file" "$work/folder.log" || [[ ! -d "$work/a_folder" ]]; then
  fail "-o a folder:"; cat "$work/folder.log"
else
  pass "-o a folder: $(tail -1 "$work/folder.log")"
fi

# -o a FIFO: the report is streamed through it, the FIFO stays a FIFO.
mkfifo "$work/fifo"
timeout 20 cat "$work/fifo" >"$work/fifo.read" &
reader=$!
"$weft" plan --schedule "$data/schedule_ok.json" -o "$work/fifo" >"$work/fifo.log" 2>&1
status=$?
wait "$reader"
if [[ $status -eq 0 && -p "$work/fifo" ]] && grep -q "<svg" "$work/fifo.read"; then
  pass "-o a FIFO"
else
  fail "-o a FIFO: exit $status, $(stat -c %F "$work/fifo"), $(wc -c <"$work/fifo.read") bytes read"
  cat "$work/fifo.log"
fi

# -o a symbolic link to /dev/null: written through, the link (and /dev/null) left as they were.
ln -s /dev/null "$work/null_link"
if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/null_link" \
     >"$work/link_to_null.log" 2>&1 && [[ -L "$work/null_link" ]] &&
   [[ "$(readlink "$work/null_link")" == /dev/null ]] && ! compgen -G "$work/null_link.*" >/dev/null; then
  pass "-o a link to /dev/null"
else
  fail "-o a link to /dev/null: now $(stat -c %F "$work/null_link")"; cat "$work/link_to_null.log"
fi

# -o a link to a regular file: the file is replaced, the link kept.
echo old >"$work/link_target.html"
ln -s link_target.html "$work/file_link.html"
if "$weft" plan --schedule "$data/schedule_ok.json" -o "$work/file_link.html" \
     >"$work/file_link.log" 2>&1 && [[ -L "$work/file_link.html" ]] && grep -q "<svg" "$work/link_target.html"; then
  pass "-o a link to a regular file"
else
  fail "-o a link to a regular file: now $(stat -c %F "$work/file_link.html")"; cat "$work/file_link.log"
fi

# -o a link to /dev/stdout, stdout a pipe: the report comes through the pipe.
ln -s /dev/stdout "$work/stdout_link"
"$weft" plan --schedule "$data/schedule_ok.json" -o "$work/stdout_link" 2>"$work/stdout.log" |
  cat >"$work/stdout.read"
status=${PIPESTATUS[0]}
if [[ $status -eq 0 && -L "$work/stdout_link" ]] && grep -q "<svg" "$work/stdout.read"; then
  pass "-o a link to /dev/stdout on a pipe"
else
  fail "-o a link to /dev/stdout on a pipe: exit $status, now $(stat -c %F "$work/stdout_link")"
  cat "$work/stdout.log"
fi

# --trace with --costs: the trace and the HSTU variants simulated with those costs.
if "$weft" plan --trace "$data/trace_small.json" --costs "$data/costs_forward.json" \
     -o "$work/trace_costs.html" --json "$work/trace_costs.json" >"$work/trace_costs.log" 2>&1 &&
   python3 - "$work/trace_costs.json" <<'EOF'
import json, sys
variants = json.load(open(sys.argv[1]))["variants"]
sources = [v["source"] for v in variants]
assert sources.count("simulated") == 9, sources
assert sources[-1] == "trace trace_small.json", sources
forward = [s for s in variants[0]["host"] if s["task"] == "forward"][0]
assert abs(forward["end_us"] - forward["start_us"] - 1234) < 1e-6, forward
EOF
then
  pass "--trace with --costs draws both"
else
  fail "--trace with --costs:"; cat "$work/trace_costs.log"
fi

# --batches: one finite source. The schedule is GPU-bound on the default stream (forward 900 us +
# allreduce 150 us a batch, the host 390 us), so one more batch adds exactly that 1050 us, and a
# source of 3 batches takes 3 x 1050 us plus its fill (the first batch's load and forward bodies).
for m in 3 4; do
  "$weft" plan --schedule "$data/schedule_ok.json" --batches $m -o "$work/batches$m.html" \
    --json "$work/batches$m.json" >"$work/batches$m.log" 2>&1 || cat "$work/batches$m.log"
done
if python3 - "$work/batches3.json" "$work/batches4.json" <<'EOF'
import json, sys
three, four = (json.load(open(p))["variants"] for p in sys.argv[1:])
for a, b in zip(three, four):
    assert abs(b["step_us"] - a["step_us"] - 1050) < 1e-6, (a["name"], a["step_us"], b["step_us"])
    assert a["step_us"] > 3 * 1050, (a["name"], a["step_us"])
    batches = sorted({s["batch"] for s in a["host"] if s["task"] == "forward"})
    assert batches == [0, 1, 2], (a["name"], batches)
EOF
then
  pass "--batches simulates one source"
else
  fail "--batches:"; cat "$work/batches3.log" "$work/batches4.log"
fi
expect_failure negative_batches "--batches" --schedule "$data/schedule_ok.json" --batches -1

# --slowed-stream and --overlap-slowdown: the default stream's work slower while the memcpy
# stream's load runs beside it, so every map's source takes longer; a factor below 1 is refused.
if "$weft" plan --schedule "$data/schedule_ok.json" --batches 3 --slowed-stream default --overlap-slowdown 2 \
     -o "$work/slowed.html" --json "$work/slowed.json" >"$work/slowed.log" 2>&1 &&
   python3 - "$work/batches3.json" "$work/slowed.json" <<'EOF'
import json, sys
plain, slowed = (json.load(open(p))["variants"] for p in sys.argv[1:])
for a, b in zip(plain, slowed):
    assert b["step_us"] > a["step_us"], (a["name"], a["step_us"], b["step_us"])
EOF
then
  pass "--overlap-slowdown slows the overlapped work"
else
  fail "--overlap-slowdown:"; cat "$work/slowed.log"
fi
expect_failure overlap_below_one "--overlap-slowdown: Value 0.5 not in range" \
  --schedule "$data/schedule_ok.json" --slowed-stream default --overlap-slowdown 0.5
expect_failure overlap_without_stream "--overlap-slowdown requires --slowed-stream" \
  --schedule "$data/schedule_ok.json" --overlap-slowdown 2
expect_failure slowed_stream_unknown "the schedule has no stream 'warp'" \
  --schedule "$data/schedule_ok.json" --slowed-stream warp --overlap-slowdown 2
expect_failure batches_and_steps "--steps excludes --batches" \
  --schedule "$data/schedule_ok.json" --batches 3 --steps 20
expect_failure batches_trace_alone "with --trace alone nothing is simulated" \
  --trace "$data/trace_small.json" --batches 3

echo "$passed passed, $failures failed"
exit $((failures > 0))
