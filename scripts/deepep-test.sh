#!/usr/bin/env bash
# Runs one of DeepEP's own tests (tests/test_intranode.py or tests/test_low_latency.py of a DeepEP
# checkout, unchanged) against weft.ep: `import deep_ep` resolves to weft.ep through
# `python -m weft.ep.as_deep_ep`, in the processes the test spawns too. Fetches nothing: give it
# the checkout. weft must be importable by python3 (installed, or on PYTHONPATH).
#   scripts/deepep-test.sh intranode|low_latency DEEPEP_DIR [NUM_PROCESSES] [the test's args...]
# NUM_PROCESSES defaults to the GPUs present; the exit status is the test's (DEEPEP_TEST_TIMEOUT
# seconds at most, default 900). What test_low_latency.py needs of weft.ep (docs/python.md,
# "DeepEP's low-latency API"): the handle's [0] src_info [E_local, M * R] int32 and [1]
# layout_range [E_local, R] int64 (begin << 32 | count), and kernels whose names contain
# "::dispatch" and "::combine" (bench_kineto); --use-logfmt and --shrink-test are refused by
# weft.ep (weft.Error).
set -euo pipefail
usage="usage: scripts/deepep-test.sh intranode|low_latency DEEPEP_DIR [NUM_PROCESSES] [args...]"
which=${1:?$usage}
deepep=${2:?$usage}
shift 2
[[ "$which" == intranode || "$which" == low_latency ]] || { echo "$usage" >&2; exit 2; }
num_processes=${1:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
(($#)) && shift
tests="$deepep/tests"
[[ -f "$tests/test_$which.py" ]] || { echo "no tests/test_$which.py in $deepep" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0
cd "$tests"
# DeepEP's tests rendezvous on MASTER_ADDR:MASTER_PORT (default 127.0.0.1:8361).
exec timeout --kill-after=30 "${DEEPEP_TEST_TIMEOUT:-900}" \
  python3 -m weft.ep.as_deep_ep "test_$which.py" --num-processes "$num_processes" "$@"
