#!/usr/bin/env bash
# Runs DeepEP's own low-latency test (tests/test_low_latency.py of a DeepEP checkout, unchanged)
# against weft.ep: `import deep_ep` resolves to weft.ep through `python -m weft.ep.as_deep_ep`,
# in the processes the test spawns too. Fetches nothing: give it the checkout. weft must be
# importable by python3 (installed, or on PYTHONPATH).
#   scripts/deepep-low-latency-test.sh DEEPEP_DIR [NUM_PROCESSES] [test_low_latency.py args...]
# NUM_PROCESSES defaults to the GPUs present (the test's own default is 8); the exit status is
# the test's. What the test needs of weft.ep (docs/python.md, "DeepEP's low-latency API"): the
# handle's [0] src_info [E_local, M * R] int32 and [1] layout_range [E_local, R] int64
# (begin << 32 | count), and kernels whose names contain "::dispatch" and "::combine"
# (bench_kineto). --use-logfmt and --shrink-test are refused by weft.ep (weft.Error).
set -euo pipefail
deepep=${1:?usage: scripts/deepep-low-latency-test.sh DEEPEP_DIR [NUM_PROCESSES] [args...]}
shift
num_processes=${1:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
(($#)) && shift
tests="$deepep/tests"
[[ -f "$tests/test_low_latency.py" ]] || { echo "no tests/test_low_latency.py in $deepep" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0
cd "$tests"
# DeepEP's test rendezvous on MASTER_ADDR:MASTER_PORT (default 127.0.0.1:8361).
exec timeout --kill-after=30 "${DEEPEP_TEST_TIMEOUT:-900}" \
  python3 -m weft.ep.as_deep_ep test_low_latency.py --num-processes "$num_processes" "$@"
