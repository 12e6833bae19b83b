#!/usr/bin/env bash
# On the GPU machine: the two-rank runs of issue #27 in one command, weft beside DeepEP V1
# (intranode) where DeepEP can run. Every step has a timeout and a log in OUT_DIR; summary.txt
# has one line per step: its name, its status and rc, its time, the key figures, and the exact
# command (so that a figure can be recorded with the command that produced it).
#
#   scripts/two-gpu-runs.sh OUT_DIR [--deepep-src DIR] [--mcore-site DIR] [--num-gpus N]
#                           [--steps REGEX] [--dry-run]
#
# --deepep-src DIR  a DeepEP source checkout (V1, e.g. commit 567632d), outside this repository:
#                   built here, intranode only (no NVSHMEM), into DEEPEP_SITE (default under
#                   ~/.cache; reused while it holds a build of the same known commit), never into the
#                   repository (that folder is emptied before a build); its tests/ are run
#                   against DeepEP and against weft.ep.
# --mcore-site DIR  a folder with megatron-core (megatron/core) to put on PYTHONPATH, for
#                   Megatron's fused_a2a on weft.ep (python/tests/test_ep_megatron.py).
# --num-gpus N      ranks = min(N, 2) (default: the GPUs present). At one rank every step that
#                   can runs at one rank and the steps that need two are reported as skipped, so
#                   that the script can be checked on one GPU; at zero every step is skipped.
# --steps REGEX     run only the steps whose names match (the others: "not selected"); e.g. a
#                   second call after the builds.
# --dry-run         print every step's command, run none.
#
# BUDGET (seconds, default 560): a step
# gets its own timeout or what is left of the budget, whichever is less; once the budget is spent
# the remaining steps are reported as skipped. The steps come in order of what the issue needs
# most: the builds, DeepEP's tests and the side-by-side tables, then weft's own two-rank tests,
# Megatron, the MoE step, the C++ benchmark.
# Exit status: non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

usage="usage: scripts/two-gpu-runs.sh OUT_DIR [--deepep-src DIR] [--mcore-site DIR] [--num-gpus N] [--steps REGEX] [--dry-run]"
out=${1:?$usage}
shift
deepep_src=""
mcore_site=""
num_gpus=""
steps_regex=""
dry_run=0
while (($#)); do
  case "$1" in
    --deepep-src) deepep_src=$(cd "$2" && pwd -P) || exit 2; shift ;;
    --mcore-site) mcore_site=$(cd "$2" && pwd -P) || exit 2; shift ;;
    --num-gpus) num_gpus=$2; shift ;;
    --steps) steps_regex=$2; shift ;;
    --dry-run) dry_run=1 ;;
    *) echo "unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$num_gpus" ]]; then
  num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
ranks=$((num_gpus < 2 ? num_gpus : 2))
# Every step sees the first num_gpus GPUs only (the tests and benchmarks use all they see).
if ((num_gpus > 0)) && [[ -z "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((num_gpus - 1)))
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

budget=${BUDGET:-560}
start=$(date +%s)
build_dir=${BUILD_DIR:-build-gpu}
# The NCCL of the build, for the programs that link it (weft-ep-bench); gpu-test.sh finds the same.
if source scripts/nccl-env.sh; then
  nccl="NCCL_ROOT=$NCCL_ROOT"
else
  nccl="no NCCL with nccl_device.h found (set NCCL_ROOT)"
fi
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared machines

deepep_commit=""
site=""
if [[ -n "$deepep_src" ]]; then
  # Its own commit only: a checkout without .git inside another repository must not take that one's.
  deepep_commit=unknown
  if [[ "$(git -C "$deepep_src" rev-parse --show-toplevel 2>/dev/null)" == "$deepep_src" ]]; then
    deepep_commit=$(git -C "$deepep_src" rev-parse --short HEAD)
  fi
  site=${DEEPEP_SITE:-${XDG_CACHE_HOME:-$HOME/.cache}/weft-two-gpu/deepep-$deepep_commit}
fi
note "# two-gpu-runs: $(date -u +%Y-%m-%dT%H:%M:%SZ), weft $(git rev-parse --short HEAD 2>/dev/null)," \
     "$num_gpus GPU(s), $ranks rank(s), budget $budget s; $nccl;" \
     "DeepEP: ${deepep_src:-not given}${deepep_commit:+ at $deepep_commit}; megatron-core: ${mcore_site:-not given}"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >"$out/machine.txt" 2>&1
nvidia-smi topo -m >>"$out/machine.txt" 2>&1

status=0

# Key figures, from a step's log.
figures_gpu_test() {  # gpu-test.sh's own summary
  grep -E '^(build|gpu tests|python|FAIL)' "$1/summary.txt" 2>/dev/null | paste -sd';' -
}
figures_pytest() { tail -1 "$1/log"; }
figures_deepep_test() {  # DeepEP's harness: its checks, its tuned bests ("[tuning] Best ...")
  echo "$(grep -c ' passed' "$1/log") checks passed; $(grep -o 'Best .*' "$1/log" | paste -sd'|' -)"
}
figures_low_latency() {  # DeepEP's low-latency harness: rank 0's timings, else the last error
  local f
  f=$(grep -E '^\[rank 0\] (Dispatch|Combine)' "$1/log" | sed 's/^\[rank 0\] //' | paste -sd'|' -)
  if [[ -n "$f" ]]; then echo "$f" | cut -c1-300; else grep -E 'Error|error' "$1/log" | tail -1 | cut -c1-200; fi
}
figures_ep_bench() {  # ep_bench.py's table: GPU us per call (range) of the DeepEP-API forms
  awk '/^DeepEP dispatch, owned tensors/ {f[1] = "owned " $(NF-1)}
       /^DeepEP dispatch, owned, num_worst/ {f[2] = "num_worst_tokens " $(NF-1)}
       /^DeepEP dispatch, fp8/ {f[3] = "fp8 " $(NF-1)}
       /^DeepEP cached dispatch/ {f[4] = "cached " $(NF-1)}
       /^DeepEP combine/ {f[5] = "combine " $(NF-1)}
       /^native dispatch, zero-copy, count read/ {f[6] = "native host-synced " $(NF-1)}
       END {line = "GPU us/call:"; for (i = 1; i <= 6; i++) if (i in f) line = line " " f[i] ",";
            sub(/,$/, "", line); print line}' "$1/log"
}
figures_moe() {  # moe_pipeline.py's rows: shape, T, schedule, step ms (range); the bits check;
  # the engine threads each pipelined family ran on
  sed -nE 's/^(comm|dsv3) +([0-9]+) +(.*[^ ]) +([0-9.]+-[0-9.]+) +[0-9.]+-[0-9.]+x$/\1 T=\2 \3 \4 ms/p
           s/^(comm|dsv3) +([0-9]+) +the first step.s loss and every gradient bit-identical across schedules: (.*)$/\1 T=\2 bits identical: \3/p
           s/^(comm|dsv3) +([0-9]+) engine threads: (.*)$/\1 T=\2 engine threads: \3/p' \
    "$1/log" | paste -sd'|' -
}
figures_deepep_build() {  # which kernels were built (an internode*.cu among them: NVSHMEM was on)
  local cu
  cu=$(grep -h 'Sources:' "$1/log" | grep -o '[a-z_]*\.cu' | paste -sd' ' -)
  [[ -n "$cu" ]] && echo "kernels: $cu$([[ "$cu" == *internode* ]] && echo ' (NVSHMEM ON)')"
}
figures_weft_ep_bench() {  # weft-ep-bench's rows and its check
  { grep -E '^  ' "$1/log" | tr -s ' ' | paste -sd'|' -; grep 'total wrong' "$1/log"; } | paste -sd';' -
}

# step NAME TIMEOUT RANKS FIGURES COMMAND [expect-fail]
#   RANKS: 1 runs at any rank count (at the ranks present), 2 needs two ranks; "deepep" and
#   "mcore" in a step's name also need --deepep-src / --mcore-site. COMMAND runs under bash in
#   the repository root; its output goes to OUT_DIR/NAME/log.
step() {
  local name=$1 limit=$2 need=$3 figures=$4 cmd=$5 expect_fail=${6:-}
  local dir="$out/$name" why="" left rc seconds t0 result figs
  if [[ -n "$steps_regex" && ! "$name" =~ $steps_regex ]]; then why="not selected (--steps)"
  elif ((ranks == 0)); then why="needs a GPU, found none"
  elif ((need > ranks)); then why="needs 2 ranks, $ranks here"
  elif [[ "$name" == *deepep* && -z "$deepep_src" ]]; then why="no --deepep-src"
  elif [[ "$name" == megatron* && -z "$mcore_site" ]] &&
       ! python3 -c 'import megatron.core' 2>/dev/null; then why="no --mcore-site, no megatron-core"
  fi
  if ((dry_run)); then
    note "$name: dry run${why:+ (would skip: $why)}; timeout $limit s; \$ $cmd"
    return
  fi
  if [[ -n "$why" ]]; then
    note "$name: skipped: $why; \$ $cmd"
    return
  fi
  left=$((budget - ($(date +%s) - start)))
  if ((left < 15)); then
    note "$name: skipped: budget spent ($budget s); \$ $cmd"
    return
  fi
  ((limit > left)) && limit=$left
  mkdir -p "$dir"
  echo "\$ $cmd" >"$dir/log"
  t0=$(date +%s)
  (cd "$repo" && timeout --kill-after=20 "$limit" bash -c "$cmd") </dev/null >>"$dir/log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - t0))
  figs=$("figures_$figures" "$dir" 2>/dev/null)
  if ((rc == 124 || rc == 137)); then result="FAIL: timed out after $limit s"; status=1
  elif [[ -n "$expect_fail" ]]; then  # a failure, but not a hang
    ((rc == 0)) && result="passed (a failure was expected: $expect_fail)" ||
      result="failed as expected ($expect_fail)"
  elif ((rc == 0)); then result=ok
  else result="FAIL"; status=1
  fi
  note "$name: $result, rc $rc, $seconds s${figs:+; $figs}; \$ $cmd"
}

# --- weft: the C++ build (tests and benchmarks) and the Python package, by gpu-test.sh.
step weft-build 480 1 gpu_test \
  "scripts/gpu-test.sh '$out/weft-build' --no-cpp-tests --no-sanitize --no-bench --no-pytest"

# --- DeepEP, intranode only. Its setup.py builds the internode and low-latency kernels whenever
# it finds NVSHMEM: through NVSHMEM_DIR, or through the nvidia-nvshmem wheel that torch may have
# brought. So NVSHMEM_DIR is unset and an import hook hides the wheel from setup.py; the build
# log's "Sources:" line says which kernels were built. `setup.py build --build-lib` puts the
# package and its extension into the site folder, outside the repository.
setup_no_nvshmem="$out/setup-no-nvshmem.py"
cat >"$setup_no_nvshmem" <<'PY'
# Runs the setup.py of the current folder with the nvidia.nvshmem package hidden.
import importlib.abc
import runpy
import sys


class NoNvshmem(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.nvshmem" or name.startswith("nvidia.nvshmem."):
            raise ModuleNotFoundError(f"hidden: {name}")
        return None


sys.meta_path.insert(0, NoNvshmem())
sys.argv[0] = "setup.py"
runpy.run_path("setup.py", run_name="__main__")
PY
# The stamp keeps the build's "Sources:" line, shown again when the build is reused; a checkout
# whose commit is unknown is built every time (no stamp can say it is the same one).
stamp="$site/.built-$deepep_commit"
[[ "$deepep_commit" == unknown ]] && stamp="$site/.never-reused"
step deepep-build 480 1 deepep_build \
  "if [[ -f '$stamp' ]]; then echo 'reused $site:'; cat '$stamp'; else cd '$deepep_src' && rm -rf '$site' '$site.tmp' && env -u NVSHMEM_DIR MAX_JOBS=\$(nproc) python3 '$setup_no_nvshmem' build --build-base '$site.tmp' --build-lib '$site' && grep -h 'Sources:' '$out/deepep-build/log' >'$stamp'; fi"
deepep_env="PYTHONPATH='$site'\${PYTHONPATH:+:\$PYTHONPATH}"

# --- DeepEP's own tests: test_intranode.py on DeepEP, then on weft.ep with only the import
# changed (scripts/deepep-test.sh intranode); test_low_latency.py on weft.ep
# (scripts/deepep-test.sh low_latency). DeepEP's intranode kernels need 2, 4 or 8 ranks.
step deepep-intranode-on-deepep 300 2 deepep_test \
  "cd '$deepep_src/tests' && $deepep_env python3 test_intranode.py --num-processes $ranks"
step deepep-intranode-on-weft 300 1 deepep_test \
  "bash scripts/deepep-test.sh intranode '$deepep_src' $ranks"
step deepep-low-latency-on-weft 300 1 low_latency \
  "bash scripts/deepep-test.sh low_latency '$deepep_src' $ranks"

# --- "weft.ep at weft's speed" beside DeepEP: the same script, the same forms, each library
# (DeepEP first, so that its figures and weft's come from one run of the machine).
for tokens in 8192 128; do
  step "ep-bench-deepep-T$tokens" 180 2 ep_bench \
    "$deepep_env torchrun --nproc-per-node $ranks bench/python/ep_bench.py --backend deep_ep --tokens $tokens --repeats 3"
  step "ep-bench-weft-T$tokens" 180 1 ep_bench \
    "torchrun --nproc-per-node $ranks bench/python/ep_bench.py --tokens $tokens --repeats 3"
done

# --- weft's tests that need two ranks. C++: every test that spans ranks (EP on a team of all
# visible GPUs, the LSA window, the HSTU step), not the virtual-team copies; pytest: the
# multi-rank EP tests and the one that needs a second GPU.
step cpp-tests-2rank 400 1 gpu_test \
  "scripts/gpu-test.sh '$out/cpp-tests-2rank' --no-python --no-bench --no-sanitize --exclude-label ep-virtual --only '^(Ep|LsaWindow|HstuStep)'"
step pytest-2rank 300 1 pytest \
  "python3 -m pytest -v -rs python/tests/test_ep_ranks.py python/tests/test_ep_gpu.py::test_a_tensor_on_another_gpu_is_refused"

# --- Megatron-core's fused_a2a, forward and backward, on weft.ep (at one rank and, with two
# GPUs, at two).
mcore_env=${mcore_site:+"PYTHONPATH='$mcore_site'\${PYTHONPATH:+:\$PYTHONPATH} "}
step megatron-fused-a2a 300 1 pytest \
  "${mcore_env}python3 -m pytest -v -rs python/tests/test_ep_megatron.py"

# --- The MoE training step, forward and backward, both shapes, under torchrun; each run writes
# an engine trace of one pipelined step into its own bench-out/.
for tokens in 4096 8192; do
  step "moe-step-T$tokens" 300 1 moe \
    "mkdir -p '$out/moe-step-T$tokens/bench-out' && cd '$out/moe-step-T$tokens' && torchrun --nproc-per-node $ranks '$repo/bench/python/moe_pipeline.py' --shapes comm,dsv3 --tokens $tokens"
done

# --- weft-ep-bench: the real ranks (one process, one GPU per rank) and the virtual team of two
# on GPU 0 at the same shapes, to set the virtual team's figures beside the real ones.
shape="--tokens 128,8192 --hidden 7168 --topk 8 --experts 256 --warmup 20 --iters 100"
step weft-ep-bench-real 180 2 weft_ep_bench \
  "'$build_dir/bench/ep/weft-ep-bench' --gpus $ranks $shape && '$build_dir/bench/ep/weft-ep-bench' --gpus $ranks $shape --cached --no-baseline"
step weft-ep-bench-virtual-2 180 1 weft_ep_bench \
  "'$build_dir/bench/ep/weft-ep-bench' --virtual-team 2 $shape"

note "total: $(($(date +%s) - start)) s, status $status"
exit $status
