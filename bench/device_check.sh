#!/usr/bin/env bash
# Everything qcomm checks and times on a lent GPU machine, in about 8 minutes
# (the lease is 15 minutes, start included). Run from the repository root:
#
#     OUT=/some/folder bash bench/device_check.sh
#
# Phases, each under its own time limit so one slow phase cannot lose the others:
#   1. the Triton kernels on CUDA == the eager torch reference on CPU, byte for byte
#      (tests/test_kernels.py; qcomm.fsdp's stateful collectives likewise), and, at the
#      same time, the CPU suite on this machine's torch (not the CI's version) with CUDA
#      hidden;
#   2. the "qcomm" backend on CUDA tensors == on CPU tensors, bit for bit (bench.crossdevice);
#      2b. torch's contracts on CUDA: device_id binding, native NCCL AVG/PREMUL_SUM,
#      functional ops, async calls across streams (bench.cuda_contracts);
#      2c. codec calls, kernel launches and time per compressed call against the exact
#      one, W = 1 over NCCL and W = 2 over gloo on CUDA tensors (bench launches);
#   3. codec throughput: Triton and torch.compile of the reference next to a same-run copy
#      (fp32, every scheme, 2/4/8 bits), then Triton alone for bf16/fp16;
#      3c. a collective's codec per piece, one launch for all payloads (the row kernels)
#      against one per payload, W = 2, 8, 16, and against a same-run copy of the bytes
#      they move (bench rows), and qcomm.fsdp's fused state
#      update against the three launches it replaces (bench rows --ops delta-update);
#      3d. peak torch.cuda.max_memory_allocated of FSDP2 training, plain against
#      qcomm.fsdp's state (bench memory --device cuda, world 1 on NCCL);
#   4. the same for 1, 2 and 4 warps per bucket program (the kernels' one tuning knob).
# Results and logs go to $OUT/results.tgz (re-packed after every phase) and $OUT/log.txt.
#
# The phases' time limits add up to ~15 minutes, and one device command runs at most 10:
# PART=1 runs phases 1-2c (~6.7 minutes at most), PART=2 phases 3-4 (~9.5), each packing
# its results as it goes; run them as two calls back to back (the machine stays warm).
#
# QUICK=1 runs a 3-minute subset (a second look within the same lease): the kernel tests,
# the backend check for two configs, and Triton codec throughput for fp32 and bf16.
set -u
OUT=${OUT:-/tmp/qcomm-device-out}
R=/tmp/qcomm-results
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
PY=${PY:-python3}
log() { echo "== $(date +%T) $*"; }
pack() { tar czf "$OUT/results.tgz" -C "$R" . ; }

{
log machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name(0))"

log install
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  || { echo "pip failed: linking kernels/ as qcomm/kernels instead"; ln -sfn ../kernels qcomm/kernels; }
$PY -c "import qcomm, qcomm.kernels.quantize; print('qcomm', qcomm.__version__, 'from', qcomm.__file__)"

if [ "${QUICK:-0}" = 1 ]; then
  log "quick: kernels on CUDA vs reference"
  timeout 70 $PY -m pytest -q --maxfail=10 -n 14 -p no:cacheprovider tests/test_kernels.py \
    -k "not compiled_torch_path" > "$R/test_kernels_cuda.log" 2>&1
  echo "exit $?" >> "$R/test_kernels_cuda.log"; tail -n 3 "$R/test_kernels_cuda.log"; pack
  log "quick: qcomm backend, CUDA vs CPU tensors"
  timeout 40 $PY -m bench.crossdevice --configs w8g8,w4g4-nuq --out "$R/crossdevice.json" \
    > "$R/crossdevice.log" 2>&1
  echo "exit $?" >> "$R/crossdevice.log"; tail -n 12 "$R/crossdevice.log"; pack
  log "quick: codec, triton vs copy"
  timeout -s INT 60 $PY -m bench codec --impls triton --dtypes float32,bfloat16 \
    --schemes all --bits 2,4,8 --sizes 24..28:2 --out "$R/codec-quick" > "$R/codec-quick.log" 2>&1
  echo "exit $?" >> "$R/codec-quick.log"; grep "^# triton\|exit" "$R/codec-quick.log"; pack
  log done
  exit 0
fi

if [ "${PART:-all}" != 2 ]; then
log "phase 1: kernels on CUDA vs reference; CPU suite on this torch (parallel)"
( timeout 170 $PY -m pytest -q --maxfail=10 -n 8 -p no:cacheprovider tests/test_kernels.py \
    tests/test_rows.py tests/test_update_state.py \
    "tests/test_weight_deltas.py::test_stateful_collectives_same_bits_on_cuda_and_cpu" \
    > "$R/test_kernels_cuda.log" 2>&1; echo "exit $?" >> "$R/test_kernels_cuda.log" ) &
( CUDA_VISIBLE_DEVICES= timeout 170 $PY -m pytest -q -n 6 -p no:cacheprovider \
    tests/test_config.py tests/test_codec.py tests/test_collectives.py \
    tests/test_process_group.py tests/test_contracts.py tests/test_fsdp.py \
    tests/test_weight_deltas.py tests/test_train.py \
    > "$R/test_cpu_suite_local_torch.log" 2>&1; echo "exit $?" >> "$R/test_cpu_suite_local_torch.log" ) &
wait
tail -n 4 "$R/test_kernels_cuda.log" "$R/test_cpu_suite_local_torch.log"
pack

log "phase 2: qcomm backend, CUDA vs CPU tensors"
timeout 60 $PY -m bench.crossdevice --out "$R/crossdevice.json" > "$R/crossdevice.log" 2>&1
echo "exit $?" >> "$R/crossdevice.log"
grep -v "^\s*return func\|FutureWarning" "$R/crossdevice.log" | tail -n 12
pack

log "phase 2b: torch's contracts on CUDA (device_id, NCCL ops, functional ops, streams)"
timeout 90 $PY -m bench.cuda_contracts > "$R/cuda_contracts.log" 2>&1
echo "exit $?" >> "$R/cuda_contracts.log"
grep -v "^\s*return func\|FutureWarning" "$R/cuda_contracts.log" | tail -n 12
pack

log "phase 2c: codec calls, launches and time per call, W = 1 NCCL and W = 2 gloo (CUDA)"
timeout 80 $PY -m bench launches --device cuda --worlds 1,2 --sizes 10..22:4 --iters 10 \
  --no-plot --out "$R/launches" > "$R/launches.log" 2>&1
echo "exit $?" >> "$R/launches.log"
grep -v "^\s*return func\|FutureWarning" "$R/launches.log" | tail -n 30
pack

fi
if [ "${PART:-all}" != 1 ]; then
log "phase 3a: codec fp32, triton vs torch.compile vs copy"
timeout -s INT 150 $PY -m bench codec --impls triton,torch --dtypes float32 --schemes all \
  --bits 2,4,8 --sizes 22..28:2 --out "$R/codec-fp32" > "$R/codec-fp32.log" 2>&1
echo "exit $?" >> "$R/codec-fp32.log"
pack
log "phase 3b: codec bf16/fp16, triton vs copy"
timeout -s INT 60 $PY -m bench codec --impls triton --dtypes bfloat16,float16 --schemes all \
  --bits 2,4,8 --sizes 20..28:2 --out "$R/codec-half" > "$R/codec-half.log" 2>&1
echo "exit $?" >> "$R/codec-half.log"
pack
log "phase 3c: one launch per piece (row kernels) vs one per payload, W = 2-16"
timeout 60 $PY -m bench rows --device cuda --worlds 2,8,16 --sizes 16..24:4 \
  --out "$R/rows" > "$R/rows.log" 2>&1
echo "exit $?" >> "$R/rows.log"; tail -n 30 "$R/rows.log"
# qcomm.fsdp's state update: the fused kernel against the three launches it replaces
timeout 40 $PY -m bench rows --device cuda --ops delta-update --bits 4 --worlds 2,8,16 \
  --sizes 16..24:4 --out "$R/rows" > "$R/rows-delta.log" 2>&1
echo "exit $?" >> "$R/rows-delta.log"; tail -n 12 "$R/rows-delta.log"
pack
log "phase 3d: peak GPU memory per rank, plain FSDP2 vs qcomm.fsdp's state (NCCL, world 1)"
timeout 120 $PY -m bench memory --device cuda --world 1 --no-plot --out "$R/memory" \
  > "$R/memory-cuda.log" 2>&1
echo "exit $?" >> "$R/memory-cuda.log"; tail -n 8 "$R/memory-cuda.log"
pack
log "phase 4: warps per bucket program (QCOMM_TRITON_WARPS), triton vs copy"
for w in 1 2 4; do
  QCOMM_TRITON_WARPS=$w timeout -s INT 45 $PY -m bench codec --impls triton \
    --dtypes float32,bfloat16 --schemes minmax,nuq --bits 4,8 --sizes 24..28:2 --no-plot \
    --out "$R/warps-$w" > "$R/warps-$w.log" 2>&1
  echo "exit $?" >> "$R/warps-$w.log"
  grep "^# triton" "$R/warps-$w.log" | sed "s/^/warps $w /"
done
pack
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
log done
grep "^# triton\|^# torch\|exit" "$R"/codec-*.log
} 2>&1 | tee "$OUT/log.txt"
pack
