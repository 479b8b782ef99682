#!/usr/bin/env bash
# Everything qcomm checks and times on a lent GPU machine, in one call that ends within
# 7 minutes at its own limits, kill graces included (the lease is 15 minutes, the
# machine's start included). Run from the repository root:
#
#     OUT=/some/folder bash bench/device_check.sh
#
# It refuses to start, naming why, where torch sees no CUDA device (the GPU tier would
# run under Triton's interpreter and skip its CUDA tests; the codec would time nothing).
#
# Phases, each under its own limit (SIGINT at the limit, so pytest prints its summary and
# a benchmark writes what it measured; KILL GRACE seconds later), seconds limit + grace:
#   cuda        20+5   torch sees a GPU, or the run is refused
#   setup       30+5   nvidia-smi, versions, `pip install -e .` (qcomm.kernels)
#   gpu-tier    80+10  pytest -m gpu on CUDA but tests/test_gpu.py: the Triton kernels
#                      against the oracle, byte for byte; rows; the state update (the CPU
#                      path's compiles and the sm_90 compile skip there: redundant)
#   gpu-own     70+10  pytest tests/test_gpu.py: the backend on CUDA tensors == on CPU
#                      tensors, compressed (tests/crossdevice.py); torch's contracts on
#                      CUDA (tests/cuda_contracts.py); FSDP2 on CUDA through both routes.
#                      Every test must run: a skip fails the phase
#   cpu-suite  160+10  beside gpu-tier and gpu-own, with CUDA hidden: the CPU suite's
#                      collective files on this machine's torch (not CI's)
#   breakeven   35+5   W = 8, 2 and 64 ranks simulated on the GPU: codec calls, launches,
#                      time a call, the break-even link (8-bit W = 8 at 2^24 first), and
#                      the exact path's cost over the inner call
#   codec-fp32  40+5   Triton quantize/dequantize against a same-run copy, fp32, every
#                      scheme, 2, 4, 8 bits, 2^24..2^28 elements
#   codec-half  35+5   the same in bf16
#   memory      40+5   peak GPU memory of FSDP2 a rank, plain against qcomm (4 bits, with
#                      and without weight differences), 2 ranks on one GPU over gloo, each
#                      its own node: compressed (a variant that compresses nothing fails)
#   targets and packing: 12 + 3. Sum: 25+35+90+80+40+45+40+45+15 = 415 s (cpu-suite rides
#   beside gpu-tier and gpu-own).
# WARPS=1 adds warps-1, warps-2, warps-4 (40+5 each, past the 7 minutes): the codec at
# 1, 2 and 4 warps per bucket program. (The torch.compile provider and fp16 left the
# codec phases: their compiles do not fit the lease.)
#
# Output, in $OUT (emptied of earlier runs' summary and archive first):
#   summary.txt  the result, one verdict a phase (ok, FAILED, CUT, KILLED, SKIPPED,
#                STOPPED) with what it named: every failed, erroring or XPASS test, the
#                test running when cut, a stuck test's place (faulthandler), what a cut
#                benchmark wrote; then one line a target (value, target, met or not);
#   log.txt      everything printed;
#   results.tgz  logs, JUnit XML, verdicts and benchmark folders, as
#                `python -m bench report` reads them once in bench/results/nvidia-h200/:
#                codec-fp32/codec.* as codec.*, codec-half/codec.* as codec-half.*,
#                warps-N/codec.* as codec-warps-N.*, memory/memory-cuda.* as memory.*,
#                breakeven/* as they are. Packed after every phase, and on SIGTERM or
#                SIGINT (the running phases get SIGINT, then the summary is written).
# Exit status 0 only when every phase is ok; 2 when refused; 143/130 when stopped.
#
# For tests and reruns (environment): QCOMM_CHECK_ONLY="gpu-own memory" runs those
# phases (the others read SKIPPED: the run is not ok); QCOMM_CHECK_LIMITS="memory=60"
# sets limits; QCOMM_CHECK_GRACE sets every grace; QCOMM_CHECK_TESTS_GPU_TIER (and
# _GPU_OWN, _CPU_SUITE) replaces a pytest phase's test paths; QCOMM_CHECK_SELFTEST=1
# skips the CUDA refusal and the install (a self-test, said so in the summary: not a
# device run) and QCOMM_CHECK_DEVICE=cpu runs the benchmarks on the CPU
# (tests/test_device_check.py drives the phase machinery that way).
set -u
OUT=${OUT:-/tmp/qcomm-device-out}
PY=${PY:-python3}
DEV=${QCOMM_CHECK_DEVICE:-cuda}
SELFTEST=${QCOMM_CHECK_SELFTEST:-0}
ONLY=${QCOMM_CHECK_ONLY:-}
mkdir -p "$OUT"
rm -f "$OUT/summary.txt" "$OUT/results.tgz"
R=$(mktemp -d "${TMPDIR:-/tmp}/qcomm-results.XXXXXX")  # fresh: a rerun packs its own
mkdir -p "$R/verdicts" "$R/running"
SUMMARY="$OUT/summary.txt"
T0=$(date +%s)
COMMIT=$(git describe --always --dirty --abbrev=10 2>/dev/null || echo "(no git here)")
# tee ignores the signals, so a SIGTERM to the whole group still leaves the log whole
exec > >(trap '' INT TERM; exec tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning

log() { echo "== $(date +%T) $*"; }
pack() { cp "$SUMMARY" "$R/summary.txt" 2>/dev/null; tar czf "$OUT/results.tgz" -C "$R" . ; }

# limit ID DEFAULT: QCOMM_CHECK_LIMITS's value for ID, else DEFAULT
limit() {
  local kv
  for kv in ${QCOMM_CHECK_LIMITS:-}; do
    [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }
  done
  echo "$2"
}
grace() { echo "${QCOMM_CHECK_GRACE:-$1}"; }
# tests ID DEFAULT...: QCOMM_CHECK_TESTS_<ID> (ID upper case, - as _), else DEFAULT
tests() {
  local var="QCOMM_CHECK_TESTS_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  shift
  if [ -n "${!var:-}" ]; then echo "${!var}"; else echo "$@"; fi
}
selected() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

# the phases in the summary's order; one without a verdict reads "not run"
ORDER=(cuda setup cpu-suite gpu-tier gpu-own breakeven codec-fp32 codec-half memory)
[ "$SELFTEST" = 1 ] && ORDER=("${ORDER[@]:2}")
[ "${WARPS:-0}" = 1 ] && ORDER+=(warps-1 warps-2 warps-4)
# record ID TEXT...: the verdict file of phase ID (its first line the verdict)
record() {
  local id=$1 line
  shift
  for line in "$@"; do [ -n "$line" ] && printf '%s\n' "$line"; done > "$R/verdicts/$id.txt"
}

# start ID LIMIT GRACE KIND CMD...: run CMD in the background under LIMIT seconds
# (SIGINT at the limit, KILL GRACE seconds later), its output in $R/ID.log. KIND says
# how to judge it: plain, pytest, pytest-all (a skip fails it) or bench:FILE (the JSON
# it must write, relative to $R).
start() {
  local id=$1 lim=$2 gr=$3 kind=$4
  shift 4
  if ! selected "$id"; then
    record "$id" "$id: SKIPPED (not in QCOMM_CHECK_ONLY)"
    return
  fi
  log "phase $id (limit ${lim} s, then SIGINT; KILL ${gr} s later): $*"
  echo "$*" > "$R/$id.cmd"
  timeout -s INT -k "$gr" "$lim" "$@" > "$R/$id.log" 2>&1 &
  echo "$! $(date +%s) $lim $gr $kind" > "$R/running/$id"
}

# finish ID: wait for phase ID and write its verdict
finish() {
  local id=$1
  [ -f "$R/running/$id" ] || return 0
  local pid t lim gr kind
  read -r pid t lim gr kind < "$R/running/$id"
  wait "$pid"
  local code=$?
  judge "$id" "$code" "$(( $(date +%s) - t ))" "$lim" "$gr" "$kind" ""
  rm -f "$R/running/$id"
  join_summary
  pack
}

phase() { start "$@"; finish "$1"; }

# judge ID CODE WALL LIMIT GRACE KIND STOPPED: the verdict and what the phase named
judge() {
  local id=$1 code=$2 wall=$3 lim=$4 gr=$5 kind=$6 stopped=$7
  local file="$R/$id.log" word detail=() named=() outcome counts nrows nexact
  if [ -n "$stopped" ]; then
    word="STOPPED by SIG$stopped to device_check.sh after ${wall} s (exit $code)"
  elif [ "$code" = 0 ]; then
    word=ok
  elif [ "$code" = 124 ]; then
    word="CUT at its limit of ${lim} s (SIGINT; it stopped within ${gr} s)"
  elif [ "$code" = 137 ]; then
    word="KILLED: still running ${gr} s after the SIGINT at its limit of ${lim} s"
  else
    word="FAILED (exit $code)"
  fi
  case $kind in
    pytest*)
      outcome=$(grep -E "^(=+ )?([0-9]+ [a-z]+|no tests ran).* in [0-9.]+s" "$file" \
                | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
      [ -n "$outcome" ] && detail+=("$outcome") \
        || detail+=("no pytest summary; the log's last lines:" "$(tail -n 3 "$file")")
      mapfile -t named < <(grep -E "^(FAILED|ERROR|XPASS) " "$file")
      detail+=("${named[@]}")
      # the test a SIGINT or KILL stopped: -v prints a test's id as it starts and its
      # outcome as it ends (under xdist, which prints only outcomes, a worker's crash
      # names it); and any test faulthandler found stuck
      mapfile -t named < <(grep -E "^[^ []+::" "$file" \
                           | grep -vE " (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)" \
                           | sed 's/ *$//; s/^/running when cut: /')
      if [ ${#named[@]} = 0 ]; then
        mapfile -t named < <(grep -E ": KeyboardInterrupt$" "$file" | sed 's/^/interrupted at: /')
      fi
      detail+=("${named[@]}")
      mapfile -t named < <(grep -E "crashed while running" "$file")
      detail+=("${named[@]}")
      mapfile -t named < <(grep -A40 -E "^Timeout \(" "$file" \
                           | grep -E '^ *File ".*/tests/.*", line [0-9]+ in test_' \
                           | sed 's/^ */stuck (faulthandler): /' | sort -u)
      detail+=("${named[@]}")
      if [ "$word" = ok ] && [ "$kind" = pytest-all ] && grep -qE "^SKIPPED " "$file"; then
        word="FAILED: tests skipped where every one must run"
        mapfile -t named < <(grep -E "^SKIPPED " "$file")
        detail+=("${named[@]}")
      fi
      if [ "$word" = ok ] && [ -z "$outcome" ]; then
        word="FAILED: no pytest summary"
      fi
      ;;
    bench:*)
      local json="$R/${kind#bench:}"
      if [ -f "$json" ]; then
        counts=$($PY -c 'import json, sys; d = json.load(open(sys.argv[1])); \
print(len(d["rows"]), len(d["header"].get("exact_path", [])))' "$json" 2>/dev/null)
        read -r nrows nexact <<< "${counts:-0 0}"
        detail+=("wrote ${kind#bench:}: $nrows rows$([ "$nexact" != 0 ] \
          && echo ", $nexact exact-path points")")
        if [ "$word" = ok ] && [ "$nrows" = 0 ]; then
          word="FAILED: measured nothing"
        fi
      else
        detail+=("wrote nothing (no ${kind#bench:})")
        [ "$word" = ok ] && word="FAILED: measured nothing"
      fi
      mapfile -t named < <(grep -E "^# .*(interrupted|measured nothing|compressed nothing|saved no bytes|FAILED|failed)" "$file")
      detail+=("${named[@]}")
      ;;
    *)
      [ "$word" = ok ] || detail+=("the log's last lines:" "$(tail -n 3 "$file")")
      ;;
  esac
  record "$id" "$id: $word (${wall} s of ${lim})" \
    "$(printf '%s\n' "${detail[@]}" | sed '/^$/d; s/^/    /')"
}

# targets [SECONDS]: the targets, one line each, from what the phases wrote
targets() {
  local gpu="NOT met" tier own
  # each phase's verdict word: ok, FAILED, CUT, ...
  tier=$(head -n 1 "$R/verdicts/gpu-tier.txt" 2>/dev/null | sed 's/^gpu-tier: \([A-Za-z]*\).*/\1/')
  own=$(head -n 1 "$R/verdicts/gpu-own.txt" 2>/dev/null | sed 's/^gpu-own: \([A-Za-z]*\).*/\1/')
  [ "$tier" = ok ] && [ "$own" = ok ] && gpu=met
  echo "TARGET pytest -m gpu green: gpu-tier ${tier:-not run}, gpu-own ${own:-not run}: $gpu"
  local f found=""
  for f in "$R"/breakeven/*.json "$R"/codec-*/codec.json; do [ -f "$f" ] && found=1; done
  if [ -z "$found" ]; then  # (no Python to start: it costs seconds)
    echo "TARGET codec, break-even and exact path: no benchmark wrote results: NOT met"
    return
  fi
  timeout "${1:-12}" "$PY" - "$R" "$DEV" <<'PYEOF' 2>&1
import json
import sys
from pathlib import Path

from bench import auto_choices, breakeven, codec

results, device = Path(sys.argv[1]), sys.argv[2]


def load(path):
    try:
        data = json.loads(path.read_text())
        return data["rows"], data["header"]
    except (OSError, ValueError, KeyError):
        return [], {}


rows, header = load(results / "breakeven" / f"breakeven-{device}.json")
lines = (codec.target_lines(load(results / "codec-fp32" / "codec.json")[0], ["float32"])
         + codec.target_lines(load(results / "codec-half" / "codec.json")[0], ["bfloat16"])
         + breakeven.target_lines(rows, header.get("exact_path", []))
         + auto_choices.target_lines(load(results / "codec-fp32" / "codec.json")[0]))
print("\n".join(lines))
PYEOF
}

# join_summary [NOTE]: the summary from the verdicts so far (and the targets, once known)
join_summary() {
  local bad=0 id first
  for id in "${ORDER[@]}"; do
    first=$(head -n 1 "$R/verdicts/$id.txt" 2>/dev/null)
    [[ "$first" == "$id: ok "* ]] || bad=$((bad + 1))
  done
  {
    if [ "$SELFTEST" = 1 ]; then
      echo "SELF-TEST (QCOMM_CHECK_SELFTEST=1): no CUDA check, device $DEV: not a device run"
    fi
    if [ $bad = 0 ] && [ ${#ORDER[@]} -gt 0 ] && [ -z "${1:-}" ]; then
      echo "RESULT: ok, all ${#ORDER[@]} phases"
    else
      echo "RESULT: NOT ok: $bad of ${#ORDER[@]} phases not ok${1:+; $1}"
    fi
    echo "qcomm $COMMIT, $(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s"
    for id in "${ORDER[@]}"; do
      if [ -f "$R/verdicts/$id.txt" ]; then
        cat "$R/verdicts/$id.txt"
      elif [ -f "$R/running/$id" ]; then
        echo "$id: running"
      else
        echo "$id: not run"
      fi
    done
    [ -f "$R/targets.txt" ] && cat "$R/targets.txt"
  } > "$SUMMARY"
  return $bad
}

# on SIGTERM/SIGINT: pack what there is, SIGINT the running phases, give them a moment
# to print and write, then the verdicts, the summary and the archive once more
on_signal() {
  local sig=$1 f pid t lim gr kind id waited=0
  trap '' INT TERM
  echo "== $(date +%T) SIG$sig: stopping the running phases, then packing"
  join_summary "stopped by SIG$sig"
  pack
  for f in "$R"/running/*; do
    [ -f "$f" ] || continue
    read -r pid t lim gr kind < "$f"
    kill -INT "$pid" 2>/dev/null  # timeout passes it on to the phase's command
  done
  while [ $waited -lt 8 ] && [ -n "$(ls -A "$R/running")" ]; do
    for f in "$R"/running/*; do
      [ -f "$f" ] || continue
      id=$(basename "$f")
      read -r pid t lim gr kind < "$f"
      if ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"
        judge "$id" "$?" "$(( $(date +%s) - t ))" "$lim" "$gr" "$kind" "$sig"
        rm -f "$f"
      fi
    done
    sleep 1
    waited=$((waited + 1))
  done
  for f in "$R"/running/*; do  # still running: KILL, and say so
    [ -f "$f" ] || continue
    id=$(basename "$f")
    read -r pid t lim gr kind < "$f"
    kill -KILL "$pid" 2>/dev/null
    judge "$id" 137 "$(( $(date +%s) - t ))" "$lim" "$gr" "$kind" "$sig"
  done
  join_summary "stopped by SIG$sig"
  pack
  targets 10 > "$R/targets.txt"
  join_summary "stopped by SIG$sig"
  pack
  cat "$SUMMARY"
  [ "$sig" = TERM ] && exit 143
  exit 130
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# ------------------------------------------------------------------------ the phases

if [ "$SELFTEST" != 1 ]; then
  log "phase cuda: does torch see a GPU?"
  why=$(timeout -k 5 "$(limit cuda 20)" "$PY" -c 'import os
import torch
if not torch.cuda.is_available():
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise SystemExit(f"torch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES="
                     f"{seen!r}, built for CUDA {torch.version.cuda})")
print(torch.cuda.get_device_name(0))' 2>&1)
  code=$?
  if [ $code != 0 ]; then
    record cuda "cuda: REFUSED (exit $code): no usable CUDA, so no device check: the GPU tier" \
      "    would run under Triton's interpreter and the codec would time nothing" \
      "$(echo "$why" | tail -n 3 | sed 's/^/    /')"
    join_summary "refused: no CUDA"
    pack
    cat "$SUMMARY"
    exit 2
  fi
  record cuda "cuda: ok ($why)"
fi

if [ "$SELFTEST" != 1 ]; then
  phase setup "$(limit setup 30)" "$(grace 5)" plain bash -c "
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      || { echo 'pip failed: linking kernels/ as qcomm/kernels instead'; ln -sfn ../kernels qcomm/kernels; }
    $PY -c \"import sys, torch, triton, qcomm, qcomm.kernels.quantize; print(sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'qcomm', qcomm.__version__, \
torch.cuda.get_device_name(0))\""
  cat "$R/setup.log"
fi

XDIST=0
$PY -c "import xdist" 2>/dev/null && XDIST=1
PYTEST_TIMEOUT=0
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=1
# pytest_args ID WORKERS PER_TEST_S: the arguments every pytest phase shares. -rfEsxX
# names failures, errors, skips, xfails and XPASSes (the project's -ra is replaced by
# -r); -v names each test as it starts; faulthandler dumps a test stuck PER_TEST_S - 15
# s, pytest-timeout fails it at PER_TEST_S; JUnit XML written on SIGINT too.
pytest_args() {
  local id=$1 workers=$2 per=$3
  echo "-m pytest -v -p no:cacheprovider -rfEsxX -o faulthandler_timeout=$((per - 15))" \
    "--junitxml=$R/$id.xml" \
    "$([ $XDIST = 1 ] && [ "$workers" -gt 1 ] && echo "-n $workers")" \
    "$([ $PYTEST_TIMEOUT = 1 ] && echo "--timeout=$per --timeout-method=signal")"
}

# shellcheck disable=SC2046  # the argument lists split on purpose
CUDA_VISIBLE_DEVICES= start cpu-suite "$(limit cpu-suite 160)" "$(grace 10)" pytest \
  "$PY" $(pytest_args cpu-suite 6 120) -m "not gpu" \
  $(tests cpu-suite tests/test_collectives.py tests/test_process_group.py \
    tests/test_contracts.py tests/test_hooks.py tests/test_wire.py tests/test_topology.py)
# shellcheck disable=SC2046
phase gpu-tier "$(limit gpu-tier 80)" "$(grace 10)" pytest \
  "$PY" $(pytest_args gpu-tier 8 60) -m gpu $(tests gpu-tier tests/ --ignore=tests/test_gpu.py)
# shellcheck disable=SC2046
phase gpu-own "$(limit gpu-own 70)" "$(grace 10)" pytest-all \
  "$PY" $(pytest_args gpu-own 3 60) -m gpu $(tests gpu-own tests/test_gpu.py)
finish cpu-suite
tail -n 4 "$R"/gpu-tier.log "$R"/gpu-own.log "$R"/cpu-suite.log 2>/dev/null

phase breakeven "$(limit breakeven 35)" "$(grace 5)" "bench:breakeven/breakeven-$DEV.json" \
  "$PY" -m bench breakeven --device "$DEV" --sizes 2^24,2^20 --worlds 8,2,64 --bits 8,4 \
  --no-plot --out "$R/breakeven"
grep "^#  " "$R/breakeven.log"
phase codec-fp32 "$(limit codec-fp32 40)" "$(grace 5)" bench:codec-fp32/codec.json \
  "$PY" -m bench codec --device "$DEV" --impls triton --dtypes float32 --schemes all \
  --bits 2,4,8 --sizes 24..28:2 --no-plot --out "$R/codec-fp32"
phase codec-half "$(limit codec-half 35)" "$(grace 5)" bench:codec-half/codec.json \
  "$PY" -m bench codec --device "$DEV" --impls triton --dtypes bfloat16 --schemes all \
  --bits 2,4,8 --sizes 24..28:2 --no-plot --out "$R/codec-half"
Q4=bits=4,ag_rounding=nearest,ag_bucket=128
phase memory "$(limit memory 40)" "$(grace 5)" \
  "bench:memory/memory$([ "$DEV" = cuda ] && echo -cuda).json" \
  "$PY" -m bench memory --device "$DEV" --world 2 --config exact --config "$Q4" \
  --config "$Q4,deltas=1" --no-plot --out "$R/memory"
tail -n 6 "$R/memory.log"

if [ "${WARPS:-0}" = 1 ]; then
  for w in 1 2 4; do
    QCOMM_TRITON_WARPS=$w phase "warps-$w" "$(limit "warps-$w" 40)" "$(grace 5)" \
      "bench:warps-$w/codec.json" "$PY" -m bench codec --device "$DEV" --impls triton \
      --dtypes float32,bfloat16 --schemes minmax,nuq --bits 4,8 --sizes 24..28:2 \
      --no-plot --out "$R/warps-$w"
  done
fi

log targets
targets > "$R/targets.txt"
[ "$DEV" = cuda ] && timeout 5 nvidia-smi \
  --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
join_summary
code=$?
pack
log done
echo "== summary"
cat "$SUMMARY"
[ $code = 0 ] || exit 1
exit 0
