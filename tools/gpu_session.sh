#!/usr/bin/env bash
# One call on the lent GPU machine: build, GPU tests, demo, benchmarks; logs and tables under $OUT.
# Usage: tools/gpu_session.sh [build] [tests[=PYTEST_ARGS]] [cpu-tests] [one-gpu[=WORLD]] [doctor] [demo]
#        [bench-allreduce] [bench-decode] [bench-norm] [bench-attention] [bench-ulysses] [eager-breakdown]
# cpu-tests runs the CI suite on the machine's torch; it needs expecttest, e.g. wheels carried in .whl/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export GRAPHAR_CUDA_ARCHS="${GRAPHAR_CUDA_ARCHS:-90a}"
OUT="${OUT:-/tmp/graphar-out}"
mkdir -p "$OUT"
log="$OUT/session.log"
start_mark=$(mktemp)  # the tables and plots this call writes are those newer than it
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log, report status
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc" | tee -a "$log"
  # Each step's tables and plots go to $OUT at once: a call cut at its limit still returns them.
  find bench/results -newer "$start_mark" \( -name '*.md' -o -name '*.png' \) -exec cp {} "$OUT/" \;
}
for stage in "$@"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$log"
      nvidia-smi topo -m >>"$log" 2>&1
      step build 400 python -m pip install --no-build-isolation --no-deps -e . ;;
    tests=*) step tests 560 python -m pytest -q -x -rs ${stage#tests=} ;;
    tests) step tests 560 python -m pytest -q -rs --durations=10 tests/gpu ;;  # about 480 s on 2 H200
    cpu-tests)
      [ -d .whl ] && python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      step cpu-tests 400 python -m pytest -q -p no:cacheprovider --ignore=tests/gpu tests ;;
    one-gpu|one-gpu=*) world=${stage#one-gpu=}; [ "$world" = one-gpu ] && world=2
      step "$stage" 400 python tools/one_gpu_check.py --world "$world" ;;
    doctor) step doctor 240 python -m graphar doctor ;;
    eager-breakdown) step eager-breakdown 240 python tools/eager_breakdown.py --algo push-oneshot ;;
    demo) step demo 240 python -m graphar demo ;;
    bench-*)
      limit=300; [ "$stage" = bench-decode ] && limit=540  # decode compiles 5 variants x 2 batches
      step "$stage" "$limit" python "bench/${stage#bench-}.py" ;;
  esac
done
ls "$OUT"
