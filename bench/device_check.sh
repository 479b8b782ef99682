#!/usr/bin/env bash
# Everything qcomm checks and times on a lent GPU machine, in one call of at most ~8
# minutes (the lease is 15 minutes, start included). Run from the repository root:
#
#     OUT=/some/folder bash bench/device_check.sh
#
# Phases, each under its own time limit so one slow phase cannot lose the others:
#   1. the GPU test tier, `pytest -m gpu` (the Triton kernels on CUDA against the oracle,
#      byte for byte; the "qcomm" backend on CUDA tensors == on CPU tensors, compressed,
#      tests/crossdevice.py; torch's contracts on CUDA, tests/cuda_contracts.py; FSDP2 on
#      CUDA through both routes), and beside it the CPU suite's collective files on this
#      machine's torch (not CI's) with CUDA hidden. pytest is interrupted with SIGINT at
#      its limit, so it still prints its short summary, and writes -rf lines and JUnit
#      XML: every failure is named even when cut;
#   2. W = 2, 8 and 64 ranks simulated on the GPU: codec calls, kernel launches, host
#      and device time per compressed call, and the break-even link (bench breakeven);
#   3. codec throughput against a same-run copy: fp32 Triton and torch.compile, then
#      bf16/fp16 Triton; 3c. peak GPU memory of FSDP2, plain against qcomm.fsdp's state,
#      2 ranks (gloo on one GPU, each rank a node: compressed).
# WARPS=1 adds 4. the codec for 1, 2 and 4 warps per bucket program (~2.5 minutes more).
#
# Output: $OUT/summary.txt (one line a phase: its exit code and verdict; the names of
# failed tests), $OUT/log.txt, and $OUT/results.tgz (re-packed after every phase). Its
# benchmark JSON/CSV go to bench/results/nvidia-h200/ as `python -m bench report` reads
# them: codec-fp32/codec.* as codec.*, codec-half/codec.* as codec-half.*, warps-N/codec.*
# as codec-warps-N.*, memory/memory-cuda.* as memory.*, breakeven/* as they are.
set -u
OUT=${OUT:-/tmp/qcomm-device-out}
R=/tmp/qcomm-results
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
log() { echo "== $(date +%T) $*"; }
pack() { tar czf "$OUT/results.tgz" -C "$R" . ; }
# verdict NAME EXIT [LOG]: one summary line; the failed tests a pytest log names
verdict() {
  local name=$1 code=$2 file=${3:-}
  local word=ok
  [ "$code" = 0 ] || word=FAILED
  [ "$code" = 124 ] || [ "$code" = 130 ] && word="CUT (time limit)"
  echo "$name: exit $code, $word" >> "$SUMMARY"
  if [ -n "$file" ] && [ -f "$file" ]; then
    grep -E "^(FAILED|ERROR) " "$file" | sed 's/^/    /' >> "$SUMMARY"
    grep -E "^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s" "$file" | tail -n 1 \
      | sed 's/^/    /' >> "$SUMMARY"
  fi
}
# run NAME LIMIT LOG CMD...: CMD under LIMIT seconds (SIGINT, then KILL 10 s later)
run() {
  local name=$1 limit=$2 file=$3
  shift 3
  timeout -s INT -k 10 "$limit" "$@" > "$file" 2>&1
  local code=$?
  echo "exit $code" >> "$file"
  verdict "$name" "$code" "$file"
  return 0
}
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"

{
log machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name(0))"

log install
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  || { echo "pip failed: linking kernels/ as qcomm/kernels instead"; ln -sfn ../kernels qcomm/kernels; }
$PY -c "import qcomm, qcomm.kernels.quantize; print('qcomm', qcomm.__version__, 'from', qcomm.__file__)"

log "phase 1: the GPU tier (pytest -m gpu); the CPU collective tests on this torch (parallel)"
run "1 gpu tier" 140 "$R/test_gpu.log" $PY -m pytest -q -m gpu $XDIST -rf -p no:cacheprovider \
  --junitxml="$R/test_gpu.xml" tests/ &
CUDA_VISIBLE_DEVICES= run "1 cpu suite, local torch" 140 "$R/test_cpu_local.log" \
  $PY -m pytest -q -m "not gpu" ${XDIST:+-n 6} -rf -p no:cacheprovider --junitxml="$R/test_cpu_local.xml" \
  tests/test_collectives.py tests/test_process_group.py tests/test_contracts.py \
  tests/test_hooks.py tests/test_wire.py tests/test_topology.py &
wait
tail -n 3 "$R/test_gpu.log" "$R/test_cpu_local.log"
pack

log "phase 2: W ranks simulated on the GPU: codec calls, launches, time, the break-even link"
run "2 breakeven" 60 "$R/breakeven.log" $PY -m bench breakeven --device cuda \
  --sizes 20..24:2 --worlds 2,8,64 --bits 8,4 --no-plot --out "$R/breakeven"
grep "^#  " "$R/breakeven.log"
pack

log "phase 3a: codec fp32, triton vs torch.compile vs copy"
run "3a codec fp32" 45 "$R/codec-fp32.log" $PY -m bench codec --impls triton,torch \
  --dtypes float32 --schemes all --bits 2,4,8 --sizes 24..28:2 --no-plot --out "$R/codec-fp32"
log "phase 3b: codec bf16/fp16, triton vs copy"
run "3b codec half" 25 "$R/codec-half.log" $PY -m bench codec --impls triton \
  --dtypes bfloat16,float16 --schemes all --bits 2,4,8 --sizes 24..28:2 --no-plot \
  --out "$R/codec-half"
log "phase 3c: peak GPU memory per rank, plain FSDP2 vs qcomm.fsdp's state (2 ranks)"
run "3c memory" 60 "$R/memory-cuda.log" $PY -m bench memory --device cuda --world 2 \
  --no-plot --out "$R/memory"
tail -n 8 "$R/memory-cuda.log"
pack

if [ "${WARPS:-0}" = 1 ]; then
  log "phase 4: warps per bucket program (QCOMM_TRITON_WARPS), triton vs copy"
  for w in 1 2 4; do
    QCOMM_TRITON_WARPS=$w run "4 warps $w" 45 "$R/warps-$w.log" $PY -m bench codec \
      --impls triton --dtypes float32,bfloat16 --schemes minmax,nuq --bits 4,8 \
      --sizes 24..28:2 --no-plot --out "$R/warps-$w"
    grep "^# triton" "$R/warps-$w.log" | sed "s/^/warps $w /"
  done
  pack
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
grep "^# triton\|^# torch" "$R"/codec-*.log
log done
echo "== summary"
cat "$SUMMARY"
} 2>&1 | tee "$OUT/log.txt"
cp "$SUMMARY" "$R/summary.txt"
pack
