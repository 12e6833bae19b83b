#!/usr/bin/env bash
# `weft run hstu` checks its arguments before it touches a GPU: with no GPU visible
# (CUDA_VISIBLE_DEVICES empty, so the same on a GPU machine), a bad argument is reported as
# itself, not as a CUDA or NCCL failure.
#   run_args_test.sh WEFT_BINARY
set -uo pipefail
weft=$1
export CUDA_VISIBLE_DEVICES=
passed=0 failures=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

expect_error() {  # name, expected message fragment, arguments...
  local name=$1 fragment=$2
  shift 2
  timeout 60 "$weft" run hstu "$@" >"$log" 2>&1
  local status=$?
  if [[ $status -eq 0 || $status -ge 124 ]]; then
    echo "FAIL $name: exit status $status"; cat "$log"; failures=$((failures + 1))
  elif ! grep -qF -- "$fragment" "$log"; then
    echo "FAIL $name: expected '$fragment':"; cat "$log"; failures=$((failures + 1))
  else
    echo "ok $name: $(head -1 "$log")"; passed=$((passed + 1))
  fi
}

expect_error variant "unknown HSTU variant 'no_such_variant'" --variant no_such_variant
expect_error variant_after_all "unknown HSTU variant 'no_such_variant'" --variant all --variant no_such_variant
expect_error calibrate_from "--calibrate-from: unknown HSTU variant 'nope'" --calibrate-from nope
expect_error hidden "--hidden 7: expected a multiple of 8, >= 8" --hidden 7
expect_error layers "--layers 0: expected >= 1" --layers 0
expect_error layers_below_bucket_split "--layers 2: expected >= 3" --layers 2
expect_error local_gpus "--local-gpus -1: expected >= 0" --local-gpus -1
expect_error local_batch "--local-batch 0: expected >= 1" --local-batch 0
# A good command line gets as far as the GPUs, and says there are none.
expect_error no_gpu "CUDA" --variant legacy_none --local-gpus 2

echo "$passed passed, $failures failed"
exit $((failures > 0))
