#!/usr/bin/env bash
# The EP benchmarks where no GPU is visible (CUDA_VISIBLE_DEVICES empty, so the same on a GPU
# machine): a clear error and a non-zero exit, never an uncaught exception (abort); the GPU count
# reported is the one found; a bad --num-sms is refused in a short message.
#   ep_bench_no_gpu_test.sh EP_BENCH OVERLAP_BENCH
set -uo pipefail
export CUDA_VISIBLE_DEVICES=
passed=0 failures=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

expect_error() {  # name, expected message fragment, command...
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

for bench in "$1" "$2"; do
  name=$(basename "$bench")
  expect_error "$name" "needs 2 GPUs, found 0" "$bench"
  expect_error "$name --gpus 1" "needs 2 GPUs, found 0" "$bench" --gpus 1
  expect_error "$name --gpus 2" "--gpus 2 asks for 2 GPUs, found 0" "$bench" --gpus 2
  expect_error "$name --gpus -1" "--gpus" "$bench" --gpus -1
done
expect_error "$(basename "$2") --num-sms 0" "--num-sms" "$2" --num-sms 0
expect_error "$(basename "$1") --num-sms -1" "--num-sms" "$1" --num-sms -1

echo "$passed passed, $failures failed"
exit $((failures > 0))
