#!/usr/bin/env bash
# Spatial partitioning on one GPU, feasibility (issue 3, "Guarantee"): a latency tenant (6-layer
# fp16 MLP, batch 8, a step every 2 ms) next to a best-effort trainer (bf16 8192^3 matmuls).
# Run from the repository root on a GPU machine (one GPU, MIG off):
#
#   tests/gpu/spatial/run.sh            # everything, about 6 minutes (WINDOW=8)
#   VARIANTS='alone_latency|mps' PROBE=0 tests/gpu/spatial/run.sh   # a subset (regex on names)
#
# It builds probe, greenstream.so (cc, cuda.h of the CUDA toolkit), answers the driver questions
# with `probe` without and with MPS, then runs every variant for WINDOW seconds and prints
# one table: latency p50/p99 (and p99 against alone), trainer TFLOP/s (and % of alone), and
# whether the target holds (p99 <= 1.15x alone, trainer >= 80% of alone).
# The MPS control daemon is started here (pipe and log directories in a temporary directory) and
# always stopped on exit. No GPU setting is changed. Logs: $OUT/spatial (or a temporary dir).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
HERE="$ROOT/tests/gpu/spatial"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WINDOW=${WINDOW:-6}
LEAD=${LEAD:-8}
GREEN_SMS=${GREEN_SMS:-"104 112 120"}
MPS_PCTS=${MPS_PCTS:-"50 70 80 90"}
LOGS="${OUT:-$(mktemp -d)}/spatial"
mkdir -p "$LOGS"
BUILD=$(mktemp -d)
export GREENSTREAM_SO="$BUILD/greenstream.so"
RESULTS="$LOGS/results.tsv"
: >"$RESULTS"
MPS_DIR=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
PIDS=()
MPS_ON=0

mps_start() {
  nvidia-cuda-mps-control -d && MPS_ON=1
  sleep 1
}
mps_stop() {
  if [ "$MPS_ON" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
    MPS_ON=0
    for _ in $(seq 50); do pgrep -f nvidia-cuda-mps >/dev/null || break; sleep 0.2; done
  fi
}
cleanup() {
  # every background job of this script, tracked in PIDS or not (a build, a sampler), and then
  # a wait for exactly those: a bare `wait` would block on anything left running
  local pid left
  left=$(jobs -p)
  for pid in "${PIDS[@]}" $left; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}" $left; do wait "$pid" 2>/dev/null; done
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$LOGS/mps-log" 2>/dev/null
  rm -rf "$BUILD"
}
trap cleanup EXIT

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
field() { # field LOG NAME
  local json
  json=$(grep '^RESULT ' "$1" 2>/dev/null | tail -n1 | sed 's/^RESULT //')
  [ -n "$json" ] || json='{}'
  "$PY" -c 'import json,sys; v=json.loads(sys.argv[1]).get(sys.argv[2]); print("" if v is None else v)' "$json" "$2"
}
calc() { "$PY" -c "import sys; print($1)"; }
start_at() { "$PY" -c "import time; print(time.monotonic() + $1)"; }

# ---- environment and build ----
log "window ${WINDOW}s; logs in $LOGS"
nvidia-smi -L 2>&1 | tee -a "$LOGS/run.log"
nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv 2>&1 | tee -a "$LOGS/run.log"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$LOGS/run.log"
INC=/usr/local/cuda/include
LIBS="-L/usr/local/nvidia/lib64 -l:libcuda.so.1"
if cc -O2 -I$INC "$HERE/probe.c" -o "$BUILD/probe" $LIBS >"$LOGS/build.log" 2>&1 &&
  cc -O2 -shared -fPIC -I$INC "$HERE/greenstream.c" -o "$BUILD/greenstream.so" $LIBS >>"$LOGS/build.log" 2>&1; then
  log "built probe and greenstream.so"
else
  log "build failed:"; cat "$LOGS/build.log"
fi

# ---- 1. driver questions ----
if [ -x "$BUILD/probe" ] && [ "${PROBE:-1}" = 1 ]; then
  log "probe without MPS"; "$BUILD/probe" 64 >"$LOGS/probe_plain.log" 2>&1; cat "$LOGS/probe_plain.log"
  mps_start
  log "probe under MPS"; "$BUILD/probe" 64 >"$LOGS/probe_mps.log" 2>&1; cat "$LOGS/probe_mps.log"
  log "probe under MPS, client at 50% active threads"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 "$BUILD/probe" 64 >"$LOGS/probe_mps50.log" 2>&1; cat "$LOGS/probe_mps50.log"
  mps_stop
fi

# ---- 2. variants ----
# variant NAME MPS(0|1) LATENCY_ENV -- TRAINER_ENV -- TRAINER_ARGS ; MLP or TRAINER may be "none"
variant() {
  local name=$1 mps=$2
  [[ "$name" =~ ^(${VARIANTS:-.*})$ ]] || return 0
  shift 2
  local lenv=() tenv=() targs=()
  while [ "$1" != "--" ]; do lenv+=("$1"); shift; done; shift
  while [ "$1" != "--" ]; do tenv+=("$1"); shift; done; shift
  targs=("$@")
  [ "$mps" = 1 ] && mps_start
  local stamp="$LOGS/stamp.$name"
  "$PY" -c "open('$stamp','wb').write(bytes(8))"
  local T
  T=$(start_at "$LEAD")
  if [ "${lenv[0]:-}" != none ]; then
    env "${lenv[@]}" "$PY" "$HERE/spatial.py" mlp --start-at "$T" --window "$WINDOW" --stamp "$stamp" --burst-s "${BURST:-0}" >"$LOGS/$name.mlp.log" 2>&1 &
    PIDS+=($!)
  fi
  if [ "${tenv[0]:-}" != none ]; then
    env "${tenv[@]}" "$PY" "$HERE/spatial.py" trainer --start-at "$T" --window "$WINDOW" "${targs[@]}" >"$LOGS/$name.trainer.log" 2>&1 &
    PIDS+=($!)
  fi
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
  [ "$mps" = 1 ] && mps_stop
  local p50 p99 tf extra
  p50=$(field "$LOGS/$name.mlp.log" p50_ms); p99=$(field "$LOGS/$name.mlp.log" p99_ms)
  tf=$(field "$LOGS/$name.trainer.log" tflops)
  extra=""
  if [ -n "$(field "$LOGS/$name.trainer.log" green_sms)" ]; then
    extra="green $(field "$LOGS/$name.trainer.log" green_sms) SMs: $(field "$LOGS/$name.trainer.log" ms_per_matmul_green) vs $(field "$LOGS/$name.trainer.log" ms_per_matmul_full) ms/matmul, same result $(field "$LOGS/$name.trainer.log" green_matches_full), on green $(field "$LOGS/$name.trainer.log" green_chunk_fraction)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "${p50:--}" "${p99:--}" "${tf:--}" "${extra:--}" >>"$RESULTS"
  log "$name: p50 $p50 p99 $p99 ms, trainer $tf TFLOP/s $extra"
}

variant alone_latency 0 CUDA_MPS_X=0 -- none --
variant alone_trainer 0 none -- CUDA_MPS_X=0 --
variant plain 0 CUDA_MPS_X=0 -- CUDA_MPS_X=0 --
variant plain_green112 0 CUDA_MPS_X=0 -- CUDA_MPS_X=0 -- --green-sms 112 --stamp "$LOGS/stamp.plain_green112"
variant mps 1 CUDA_MPS_X=0 -- CUDA_MPS_X=0 --
for pct in $MPS_PCTS; do
  variant "mps_trainer${pct}pct" 1 CUDA_MPS_X=0 -- CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct --
done
variant mps_priority 1 CUDA_MPS_CLIENT_PRIORITY=0 -- CUDA_MPS_CLIENT_PRIORITY=1 --
for sms in $GREEN_SMS; do
  variant "mps_green${sms}_dynamic" 1 CUDA_MPS_X=0 -- CUDA_MPS_X=0 -- --green-sms "$sms" --stamp "$LOGS/stamp.mps_green${sms}_dynamic"
done
BURST=1 variant mps_green112_dynamic_bursty 1 CUDA_MPS_X=0 -- CUDA_MPS_X=0 -- --green-sms 112 --stamp "$LOGS/stamp.mps_green112_dynamic_bursty"
BURST=1 variant mps_trainer80pct_bursty 1 CUDA_MPS_X=0 -- CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80 --
variant mps_green112_trainer_alone 1 none -- CUDA_MPS_X=0 -- --green-sms 112 --stamp "$LOGS/stamp.mps_green112_trainer_alone"
variant mps_trainer_alone 1 none -- CUDA_MPS_X=0 --
variant mps_trainer80pct_trainer_alone 1 none -- CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80 --

# ---- 3. cross-context memory in an SM-count context (may fault: last, alone) ----
if [ -x "$BUILD/probe" ] && [ "${PROBE:-1}" = 1 ]; then
  mps_start
  log "probe xctx under MPS"; "$BUILD/probe" xctx 66 >"$LOGS/probe_xctx.log" 2>&1; cat "$LOGS/probe_xctx.log"
  mps_stop
fi

# ---- table ----
ALONE_P99=$(awk -F'\t' '$1=="alone_latency"{print $3}' "$RESULTS")
ALONE_TF=$(awk -F'\t' '$1=="alone_trainer"{print $4}' "$RESULTS")
echo
printf '| %-28s | %-8s | %-8s | %-9s | %-9s | %-9s | %-6s | %s\n' variant "p50 ms" "p99 ms" "p99/alone" "TFLOP/s" "% alone" target notes
while IFS=$'\t' read -r name p50 p99 tf extra; do
  ratio=""; pct=""; ok="-"
  [ "$p99" != - ] && [ -n "$ALONE_P99" ] && ratio=$(calc "round($p99 / $ALONE_P99, 2)")
  [ "$tf" != - ] && [ -n "$ALONE_TF" ] && pct=$(calc "round(100 * $tf / $ALONE_TF, 1)")
  if [ -n "$ratio" ] && [ -n "$pct" ]; then ok=$(calc "'MET' if $ratio <= 1.15 and $pct >= 80 else 'no'"); fi
  printf '| %-28s | %-8s | %-8s | %-9s | %-9s | %-9s | %-6s | %s\n' "$name" "$p50" "$p99" "$ratio" "$tf" "$pct" "$ok" "$extra"
done <"$RESULTS"
