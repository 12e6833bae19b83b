#!/usr/bin/env bash
# `weft run hstu` checks its arguments before it touches a GPU: with no GPU visible, a bad
# argument is reported as itself, not as a CUDA or NCCL failure. A schedule config (--config) is
# checked against the HSTU schedule the same way: a bad file is named with the field; the configs
# `weft plan --suggest` writes load as they are.
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

configs=$(mktemp -d)
trap 'rm -rf "$configs" "$log"' EXIT
echo '{"lookahead": {"h2d": -1}}' >"$configs/negative.json"
expect_error config_value "negative.json: \$.lookahead.h2d: expected an integer in [0, 1000]" \
  "$weft" run hstu --config "$configs/negative.json"
echo '{"lookahead": {"ghost": 1}}' >"$configs/ghost.json"
expect_error config_task "ghost.json: \$.lookahead.ghost: the schedule has no task 'ghost'" \
  "$weft" run hstu --config "$configs/ghost.json"
echo '{"thread_map": {"groups": {"io": ["h2d"]}}}' >"$configs/uncovered.json"
expect_error config_thread_map "uncovered.json: \$.thread_map: thread map 'explicit': task 'start_shuffle' is mapped to no thread" \
  "$weft" run hstu --config "$configs/uncovered.json"
echo '{"lookahead": {"forward": 3}}' >"$configs/forward_in_time.json"
expect_error config_rule "forward_in_time.json: task 'forward', field 'reads': the HSTU schedule refuses this config" \
  "$weft" run hstu --config "$configs/forward_in_time.json"
echo '{"thread_map": "legacy", "lookahead": {"h2d": 1}, "oops": 1}' >"$configs/unknown_key.json"
expect_error config_key "unknown_key.json: \$.oops: unknown key" \
  "$weft" run hstu --config "$configs/unknown_key.json"
expect_error config_missing "cannot read schedule config '$configs/missing.json'" \
  "$weft" run hstu --config "$configs/missing.json"
echo '{}' >"$configs/default_d3.json"
expect_error config_name "default_d3.json: its variant name 'default_d3' (the file's stem) is taken" \
  "$weft" run hstu --variant default_d3 --config "$configs/default_d3.json"
# The configs `weft plan --suggest` writes load as they are (and --calibrate-from may name one):
# the run gets as far as the GPUs.
"$weft" plan --suggest -o "$configs/suggest.html" --config-out "$configs/suggest" >/dev/null 2>&1
expect_error suggested_config "CUDA" "$weft" run hstu --config "$configs/suggest-1.json" \
  --config "$configs/suggest-2.json" --calibrate-from suggest-2 --local-gpus 2
finish
