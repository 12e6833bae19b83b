#!/usr/bin/env bash
# The EP benchmarks where no GPU is visible: a clear error and a non-zero exit, never an uncaught
# exception (abort); the GPU count reported is the one found; a bad --num-sms is refused in a
# short message.
#   ep_bench_no_gpu_test.sh EP_BENCH OVERLAP_BENCH
source "$(dirname "$0")/../expect_error.sh"

for bench in "$1" "$2"; do
  name=$(basename "$bench")
  expect_error "$name" "needs 2 GPUs, found 0" "$bench"
  expect_error "$name --gpus 1" "needs 2 GPUs, found 0" "$bench" --gpus 1
  expect_error "$name --gpus 2" "--gpus 2 asks for 2 GPUs, found 0" "$bench" --gpus 2
  expect_error "$name --gpus -1" "--gpus" "$bench" --gpus -1
done
expect_error "$(basename "$2") --num-sms 0" "--num-sms" "$2" --num-sms 0
expect_error "$(basename "$1") --num-sms -1" "--num-sms" "$1" --num-sms -1
finish
