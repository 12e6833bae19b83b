#!/usr/bin/env bash
# On the GPU machine: configure against the NCCL that the machine's PyTorch ships (the device API
# needs the library and the headers to be the same version), build with all cores, run the
# `gpu`-labelled tests, the engine's concurrency tests (a many-core machine exposes races that the
# 2-core CI machine cannot), the GPU tests that fit one GPU under compute-sanitizer, and the GPU
# benchmarks; keep full logs in OUT_DIR, print a summary last.
#
#   scripts/gpu-test.sh OUT_DIR [--no-bench] [--no-cpp-tests] [--no-sanitize] [--no-python]
#                       [--no-pytest] [--only REGEX] [--exclude-label LABEL] [--bench-list FILE]
#                       [--sanitize-only]
#
# OUT_DIR receives: build.log, gpu-tests.log, cpu-stress.log, sanitizer-memcheck.log,
# sanitizer-racecheck.log, sanitizer-synccheck.log, python-build.log, pytest.log, bench.log,
# machine.txt, summary.txt, deepep-intranode.log and deepep-low-latency.log (with DEEPEP_DIR:
# DeepEP's test_intranode.py and test_low_latency.py run on weft.ep by
# scripts/deepep-test.sh intranode and scripts/deepep-test.sh low_latency), megatron-install.log
# (with MEGATRON_WHEELS: megatron-core installed from that folder, so that Megatron-core's DeepEP
# integration test runs), and bench-files.tar.gz (what the benchmarks wrote under the build
# folder's bench-out/). The sanitizer stage (not run with --only or --no-cpp-tests) runs the tests
# of sanitize_tests below on GPU 0 alone under memcheck, racecheck and synccheck; any report, a
# failed test, or a run past SANITIZER_TIMEOUT seconds (default 600, per tool and test program)
# fails it; SANITIZER_TOOLS picks the tools (default "memcheck racecheck synccheck"), and
# --sanitize-only runs the build and this stage alone. The Python package is built by pip from this checkout against the
# machine's python3 (its torch) and the same NCCL, and its pytest suite runs on the GPUs present
# (--no-pytest: installed, not tested; scripts/two-gpu-runs.sh runs the tests it picks).
# The benchmarks run are the lines of bench/gpu-benchmarks.txt, or of the --bench-list FILEs (one
# or more; e.g. bench/gpu-sweeps.txt, the parameter sweeps behind the defaults): commands relative
# to the build folder, '#' starts a comment, each stopped after BENCH_TIMEOUT seconds (default 300).
# Exit status: non-zero when the build, a test or a benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/gpu-test.sh OUT_DIR [--no-bench] [--no-cpp-tests] [--no-sanitize] [--no-python] [--no-pytest] [--only REGEX] [--exclude-label LABEL] [--bench-list FILE] [--sanitize-only]}
shift
run_bench=1
run_cpp_tests=1
run_sanitize=1
run_python=1
run_pytest=1
sanitize_only=0
only=""
exclude_label=""  # e.g. ep-virtual: the EP tests again on virtual teams of 2, 4 and 8 ranks
bench_lists=()
while (($#)); do
  case "$1" in
    --no-bench) run_bench=0 ;;
    --no-cpp-tests) run_cpp_tests=0 ;;
    --no-sanitize) run_sanitize=0 ;;
    --no-python) run_python=0 ;;
    --no-pytest) run_pytest=0 ;;
    --only) only=$2; shift ;;
    --exclude-label) exclude_label=$2; shift ;;
    --bench-list) bench_lists+=("$2"); shift ;;
    --sanitize-only) sanitize_only=1; run_bench=0; run_python=0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

source scripts/nccl-env.sh || { note "FAIL: no NCCL with nccl_device.h (set NCCL_ROOT)"; exit 1; }
build_dir=${BUILD_DIR:-build-gpu}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  echo "nvcc: $(nvcc --version | tail -1)"
  echo "cmake: $(cmake --version | head -1)"
  echo "NCCL_ROOT=$NCCL_ROOT"
  # What the engine's automatic spinning sees (EngineOptions::spin_us) and what may throttle it:
  # the affinity mask, a CPU quota of the container, SMT siblings.
  echo "nproc: $(nproc); $(grep Cpus_allowed_list /proc/self/status)"
  echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null ||
                          cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || echo n/a)"
  lscpu | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|CPU max MHz)'
} >"$out/machine.txt" 2>&1

start=$(date +%s)
if ! { cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DWEFT_WERROR=ON \
         -DNCCL_ROOT="$NCCL_ROOT" -DWEFT_BUILD_BENCHMARKS=ON &&
       cmake --build "$build_dir" -j "$(nproc)"; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  note "FAIL: build (see build.log)"
  exit 1
fi
note "build: ok in $(( $(date +%s) - start )) s"

status=0
if ((run_cpp_tests && !sanitize_only)); then
  ctest_args=(--test-dir "$build_dir" -L gpu --output-on-failure --timeout 900)
  [[ -n "$only" ]] && ctest_args+=(-R "$only")
  [[ -n "$exclude_label" ]] && ctest_args+=(-LE "$exclude_label")
  ctest "${ctest_args[@]}" >"$out/gpu-tests.log" 2>&1 || status=1
  note "gpu tests: $(grep -E 'tests passed|No tests were found' "$out/gpu-tests.log" | tail -1)"
  grep -E '\(Failed\)|\(Timeout\)|\(Subprocess' "$out/gpu-tests.log" | sed 's/^/  /' | tee -a "$summary"
fi

if ((run_python)); then
  if python3 -m pip install --no-build-isolation --no-deps -v . >"$out/python-build.log" 2>&1; then
    # Megatron-core's DeepEP integration test (test_ep_megatron.py) runs only where megatron-core
    # is importable, and skips otherwise: the summary says which. A machine without PyPI installs
    # it from MEGATRON_WHEELS, a folder of its wheels (one per Python version: pip takes this
    # python's).
    if [[ -n "${MEGATRON_WHEELS:-}" ]]; then
      python3 -m pip install --no-deps --no-index --find-links "$MEGATRON_WHEELS" megatron-core \
        >"$out/megatron-install.log" 2>&1 || note "megatron-core: no wheel for this python in $MEGATRON_WHEELS (see megatron-install.log)"
    fi
    if python3 -c 'import importlib.util as u, sys
sys.exit(0 if u.find_spec("megatron") and u.find_spec("megatron.core") else 1)'; then
      note "megatron-core: importable, test_ep_megatron.py runs"
    else
      note "megatron-core: not installed, test_ep_megatron.py skips"
    fi
    if ((run_pytest)); then
      python3 -m pytest python/tests -v -rs >"$out/pytest.log" 2>&1 || status=1
      note "python tests: $(tail -1 "$out/pytest.log")"
      grep -E '^(FAILED|ERROR)' "$out/pytest.log" | sed 's/^/  /' | tee -a "$summary"
    else
      note "python package: installed (no pytest: --no-pytest)"
    fi
  else
    tail -30 "$out/python-build.log"
    note "FAIL: python package build (see python-build.log)"
    status=1
  fi
fi

# DeepEP's own intranode test against weft.ep, when DEEPEP_DIR names a DeepEP checkout (its
# tests/ folder is all it needs; nothing is fetched here).
if ((run_python)) && [[ -n "${DEEPEP_DIR:-}" ]]; then
  if bash scripts/deepep-test.sh intranode "$DEEPEP_DIR" >"$out/deepep-intranode.log" 2>&1; then
    note "DeepEP test_intranode.py on weft.ep: ok ($(grep -c ' passed' "$out/deepep-intranode.log") checks passed)"
  else
    note "FAIL: DeepEP test_intranode.py on weft.ep (see deepep-intranode.log)"
    tail -20 "$out/deepep-intranode.log" | sed 's/^/  /' | tee -a "$summary"
    status=1
  fi
  if bash scripts/deepep-test.sh low_latency "$DEEPEP_DIR" >"$out/deepep-low-latency.log" 2>&1; then
    note "DeepEP test_low_latency.py on weft.ep: ok"
  else
    note "FAIL: DeepEP test_low_latency.py on weft.ep (see deepep-low-latency.log)"
    tail -20 "$out/deepep-low-latency.log" | sed 's/^/  /' | tee -a "$summary"
    status=1
  fi
fi

if ((run_cpp_tests && !sanitize_only)) && [[ -z "$only" ]]; then
  # The engine's CPU tests (stress, multi-rank, failure injection) on all of this machine's cores.
  ctest --test-dir "$build_dir" -L cpu -R 'Pipeline|Engine|Stress|MultiRank|Failure|Wait|Step' \
    --output-on-failure --timeout 300 -j 4 >"$out/cpu-stress.log" 2>&1 || status=1
  note "engine tests on $(nproc) cores: $(grep -E 'tests passed' "$out/cpu-stress.log" | tail -1)"
fi

# The GPU tests under compute-sanitizer, each program on GPU 0 alone (the EP tests then run at one
# rank; those that need a peer skip), one gtest filter per program. Left out: the long loops and
# the largest shapes (thousands of back-to-back calls, 8192 tokens, the 2500-token random sweep;
# smaller tests cover the same kernels in local and grid mode), tests that start processes of
# their own (EpOneProcessPerGpu), and
# CudaBackendTest.CrossStreamWaitIsOnTheProducersEventNotTheStream, which needs two kernels to run
# at once while the sanitizer runs them one after the other.
# A failed CUDA API call is not a report (--report-api-errors no): NCCL's initialisation fails some
# on purpose and handles them, and weft checks every call it makes, so an unexpected one fails the
# test instead.
sanitize_tests=(
  "weft_cuda_tests *"
  "weft_pipeline_gpu_tests -CudaBackendTest.CrossStreamWaitIsOnTheProducersEventNotTheStream"
  "weft_hstu_kernel_tests *"
  "weft_ep_gpu_tests -*ThousandsOf*:*EightThousand*:*BackToBackPairs*:*RandomRouting*:EpOneProcess*"
  "weft_ep_errors_gpu_tests *"
  "weft_ep_feature_gpu_tests *"
  "weft_ep_async_gpu_tests -*ThousandsOf*"
  "weft_ep_expanded_gpu_tests -*ThousandsOf*"
  "weft_ep_copy_out_gpu_tests *"
  "weft_ep_all_to_all_layout_gpu_tests *"
)
sanitizer_report_status=86  # compute-sanitizer's exit status when it reported anything
if ((run_cpp_tests && run_sanitize)) && [[ -z "$only" ]]; then
  sanitizer=$(command -v compute-sanitizer ||
              echo "$(dirname "$(command -v nvcc)")/compute-sanitizer")
  if [[ ! -x "$sanitizer" ]]; then
    note "FAIL: sanitizer: no compute-sanitizer next to nvcc"
    status=1
  else
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
      log="$out/sanitizer-$tool.log"
      : >"$log"
      failed=()
      tool_start=$(date +%s)
      for entry in "${sanitize_tests[@]}"; do
        read -r program filter <<<"$entry"
        binary=$(find "$build_dir/tests" -type f -name "$program" -perm -u+x | head -1)
        if [[ -z "$binary" ]]; then
          failed+=("$program (not built)")
          continue
        fi
        echo "==== $tool: $program --gtest_filter=$filter" >>"$log"
        program_start=$(date +%s)
        CUDA_VISIBLE_DEVICES=0 timeout --kill-after=30 "${SANITIZER_TIMEOUT:-600}" \
          "$sanitizer" --tool "$tool" --error-exitcode "$sanitizer_report_status" --print-limit 20 \
          --report-api-errors no "$binary" --gtest_filter="$filter" </dev/null >>"$log" 2>&1
        rc=$?
        case $rc in
          0) ;;
          "$sanitizer_report_status") failed+=("$program (reports)") ;;
          124 | 137) failed+=("$program (timed out)") ;;
          *) failed+=("$program (exit $rc)") ;;
        esac
        echo "==== $tool: $program: exit $rc in $(( $(date +%s) - program_start )) s" >>"$log"
      done
      seconds=$(( $(date +%s) - tool_start ))
      if ((${#failed[@]})); then
        note "sanitizer $tool: FAIL in $seconds s: ${failed[*]} (see sanitizer-$tool.log)"
        status=1
      else
        note "sanitizer $tool: ok in $seconds s, ${#sanitize_tests[@]} programs, no report"
      fi
    done
  fi
fi

if ((run_bench)); then
  ((${#bench_lists[@]})) || bench_lists=(bench/gpu-benchmarks.txt)
  for list in "${bench_lists[@]}"; do
    [[ -f "$list" ]] || { note "FAIL: no benchmark list $list"; exit 1; }
  done
  : >"$out/bench.log"
  rm -rf "$build_dir/bench-out" && mkdir -p "$build_dir/bench-out"
  while IFS= read -r line; do
    line=${line%%#*}
    [[ -z "${line// }" ]] && continue
    [[ -n "$only" && ! "$line" =~ $only ]] && continue
    echo "==== $line  [load: $(cut -d' ' -f1-3 /proc/loadavg)]" >>"$out/bench.log"
    if (cd "$build_dir" && timeout "${BENCH_TIMEOUT:-300}" bash -c "$line") </dev/null >>"$out/bench.log" 2>&1; then
      note "bench ok:   $line"
    else
      note "bench FAIL: $line"
      status=1
    fi
  done < <(cat "${bench_lists[@]}")
  if [[ -n "$(ls -A "$build_dir/bench-out")" ]]; then
    tar -czf "$out/bench-files.tar.gz" -C "$build_dir/bench-out" .
  fi
fi

note "total: $(( $(date +%s) - start )) s, status $status"
exit $status
