# Sourced by the command-line tests of programs that must fail cleanly where no GPU is visible
# (CUDA_VISIBLE_DEVICES empty: the same on a GPU machine). expect_error NAME FRAGMENT COMMAND...
# passes when COMMAND exits non-zero on its own (no signal, no timeout, no uncaught exception)
# with a short message that contains FRAGMENT. `finish` prints the tally and sets the status.
set -uo pipefail
export CUDA_VISIBLE_DEVICES=
passed=0 failures=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

expect_error() {
  local name=$1 fragment=$2
  shift 2
  timeout 60 "$@" >"$log" 2>&1
  local status=$?
  if [[ $status -eq 0 || $status -ge 124 ]]; then
    echo "FAIL $name: exit status $status"; cat "$log"; failures=$((failures + 1))
  elif grep -q "terminate called" "$log" || ! grep -qF -- "$fragment" "$log"; then
    echo "FAIL $name: expected '$fragment':"; cat "$log"; failures=$((failures + 1))
  elif grep -qE '[0-9]{30}' "$log" || [[ $(wc -c <"$log") -gt 600 ]]; then
    echo "FAIL $name: a long message:"; cat "$log"; failures=$((failures + 1))
  else
    echo "ok $name (exit $status): $(head -1 "$log")"; passed=$((passed + 1))
  fi
}

finish() {
  echo "$passed passed, $failures failed"
  exit $((failures > 0))
}
