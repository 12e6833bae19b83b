#!/usr/bin/env bash
# `weft run hstu` checks its arguments before it touches a GPU: with no GPU visible, a bad
# argument is reported as itself, not as a CUDA or NCCL failure.
#   run_args_test.sh WEFT_BINARY
source "$(dirname "$0")/../expect_error.sh"
weft=$1

expect_error variant "unknown HSTU variant 'no_such_variant'" "$weft" run hstu --variant no_such_variant
expect_error variant_after_all "unknown HSTU variant 'no_such_variant'" \
  "$weft" run hstu --variant all --variant no_such_variant
expect_error calibrate_from "--calibrate-from: unknown HSTU variant 'nope'" \
  "$weft" run hstu --calibrate-from nope
expect_error hidden "--hidden 7: expected a multiple of 8, >= 8" "$weft" run hstu --hidden 7
expect_error layers "--layers 0: expected >= 1" "$weft" run hstu --layers 0
expect_error layers_below_bucket_split "--layers 2: expected >= 3" "$weft" run hstu --layers 2
expect_error local_gpus "--local-gpus -1: expected >= 0" "$weft" run hstu --local-gpus -1
expect_error local_batch "--local-batch 0: expected >= 1" "$weft" run hstu --local-batch 0
# A good command line gets as far as the GPUs, and says there are none.
expect_error no_gpu "CUDA" "$weft" run hstu --variant legacy_none --local-gpus 2
finish
