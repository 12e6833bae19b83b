#!/usr/bin/env bash
# Runs DeepEP's own intranode test (tests/test_intranode.py of a DeepEP checkout, unchanged)
# against weft.ep: `import deep_ep` resolves to weft.ep through `python -m weft.ep.as_deep_ep`,
# in the processes the test spawns too. Fetches nothing: give it the checkout. weft must be
# importable by python3 (installed, or on PYTHONPATH).
#   scripts/deepep-intranode-test.sh DEEPEP_DIR [NUM_PROCESSES] [test_intranode.py args...]
# NUM_PROCESSES defaults to the GPUs present; the exit status is the test's.
set -euo pipefail
deepep=${1:?usage: scripts/deepep-intranode-test.sh DEEPEP_DIR [NUM_PROCESSES] [args...]}
shift
num_processes=${1:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
(($#)) && shift
tests="$deepep/tests"
[[ -f "$tests/test_intranode.py" ]] || { echo "no tests/test_intranode.py in $deepep" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0
cd "$tests"
# DeepEP's test rendezvous on MASTER_ADDR:MASTER_PORT (default 127.0.0.1:8361).
exec timeout --kill-after=30 "${DEEPEP_TEST_TIMEOUT:-900}" \
  python3 -m weft.ep.as_deep_ep test_intranode.py --num-processes "$num_processes" "$@"
