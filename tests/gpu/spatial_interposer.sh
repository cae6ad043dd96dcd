#!/usr/bin/env bash
# Spatial partitioning by the interposer on a real GPU (issue 3, "Guarantee";
# docs/design/spatial-partitioning.md): a latency tenant (6-layer fp16 MLP, batch 8, a step every
# 2 ms; tests/gpu/spatial/spatial.py mlp) next to a best-effort trainer (bf16 8192^3 matmuls;
# spatial.py trainer), both under MPS. Run from the repository root on a GPU machine (one GPU):
#
#   tests/gpu/spatial_interposer.sh [path/to/libvgpu_cuda.so]
#
# The library defaults to dist-spatial/libvgpu_cuda.so, then target/release/libvgpu_cuda.so.
# Variants, each the two processes started together and measured over the same WINDOW seconds:
#   alone_latency, alone_trainer         no MPS, no interposer (the baselines)
#   mps                                  MPS, no interposer
#   mps_latency_alone                    the latency tenant alone under MPS, no interposer
#   mps_vgpu_latency_alone               the latency tenant alone under MPS and the interposer
#   mps_vgpu<N>                          MPS + the interposer: the latency tenant with
#                                        VGPU_SPATIAL=1 VGPU_LATENCY=1, the trainer with
#                                        VGPU_SPATIAL=1 VGPU_SPATIAL_SMS=N (N in SMS, "default"
#                                        for the interposer's default: all but 28)
#   mps_vgpu_trainer_alone               the squeezable trainer without a latency tenant
# REPEAT=n runs the mps_vgpu<N> rows n times (suffix _r2, _r3, ...); VARIANTS is a regex of names.
# Target: p99 <= 1.15x alone_latency and the trainer >= 80% of alone_trainer.
# The MPS control daemon runs with its pipe and log directories in a temporary directory and is
# always told to `quit` on exit. No GPU setting is changed. Logs: $OUT/spatial_interposer.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=${1:-$ROOT/dist-spatial/libvgpu_cuda.so}
[ -f "$SO" ] || SO=$ROOT/target/release/libvgpu_cuda.so
SO=$(realpath "$SO")
HELPER="$ROOT/tests/gpu/spatial/spatial.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WINDOW=${WINDOW:-10}
LEAD=${LEAD:-8}
SMS=${SMS:-"default 112"}
LOGS="${OUT:-$(mktemp -d)}/spatial_interposer"
mkdir -p "$LOGS"
RESULTS="$LOGS/results.tsv"
: >"$RESULTS"
MPS_DIR=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
SHM=""
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
    sleep 2
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
  [ -n "$SHM" ] && rm -rf "$SHM"
  rm -rf "$MPS_DIR"
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

# variant NAME MPS(0|1) LATENCY_ENV... -- TRAINER_ENV... ; an env list of "none" skips that process.
variant() {
  local name=$1 mps=$2
  [[ "$name" =~ ^(${VARIANTS:-.*})$ ]] || return 0
  shift 2
  local lenv=() tenv=()
  while [ "$1" != "--" ]; do lenv+=("$1"); shift; done; shift
  tenv=("$@")
  [ -n "$SHM" ] && rm -rf "$SHM"
  SHM=$(mktemp -d /dev/shm/vgpu-spatial.XXXXXX)
  [ "$mps" = 1 ] && mps_start
  local T
  T=$(start_at "$LEAD")
  if [ "${lenv[0]:-}" != none ]; then
    env VGPU_SHM_DIR="$SHM" "${lenv[@]}" "$PY" "$HELPER" mlp --start-at "$T" --window "$WINDOW" >"$LOGS/$name.mlp.log" 2>&1 &
    PIDS+=($!)
  fi
  if [ "${tenv[0]:-}" != none ]; then
    env VGPU_SHM_DIR="$SHM" "${tenv[@]}" "$PY" "$HELPER" trainer --start-at "$T" --window "$WINDOW" >"$LOGS/$name.trainer.log" 2>&1 &
    PIDS+=($!)
  fi
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
  [ "$mps" = 1 ] && mps_stop
  local p50 p99 tf green notes
  p50=$(field "$LOGS/$name.mlp.log" p50_ms); p99=$(field "$LOGS/$name.mlp.log" p99_ms)
  tf=$(field "$LOGS/$name.trainer.log" tflops)
  # The interposer's debug line says when (and with how many SMs) it made the green context.
  green=$(grep -ho 'green context of [0-9]* SMs[^;]*' "$LOGS/$name.trainer.log" 2>/dev/null | head -n1)
  notes=$(grep -h 'spatial partitioning' "$LOGS/$name".*.log 2>/dev/null | grep -v 'green context of' | head -n1)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "${p50:--}" "${p99:--}" "${tf:--}" "${green:-}${notes:+ $notes}" >>"$RESULTS"
  log "$name: p50 $p50 p99 $p99 ms, trainer $tf TFLOP/s ${green:-} $notes"
}

log "window ${WINDOW}s; interposer $SO; logs in $LOGS"
nvidia-smi -L 2>&1 | tee -a "$LOGS/run.log"
nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv 2>&1 | tee -a "$LOGS/run.log"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$LOGS/run.log"

PRE=(LD_PRELOAD="$SO" VGPU_LOG=2 VGPU_SPATIAL=1)
LAT=("${PRE[@]}" VGPU_TENANT=inference VGPU_LATENCY=1)
TRAIN=("${PRE[@]}" VGPU_TENANT=trainer)

variant alone_latency 0 CUDA_MPS_X=0 -- none
variant alone_trainer 0 none -- CUDA_MPS_X=0
variant mps 1 CUDA_MPS_X=0 -- CUDA_MPS_X=0
variant mps_latency_alone 1 CUDA_MPS_X=0 -- none
variant mps_vgpu_latency_alone 1 "${LAT[@]}" -- none
for r in $(seq "${REPEAT:-1}"); do
  suffix=""
  [ "$r" -gt 1 ] && suffix="_r$r"
  for sms in $SMS; do
    if [ "$sms" = default ]; then
      variant "mps_vgpu_default$suffix" 1 "${LAT[@]}" -- "${TRAIN[@]}"
    else
      variant "mps_vgpu$sms$suffix" 1 "${LAT[@]}" -- "${TRAIN[@]}" VGPU_SPATIAL_SMS="$sms"
    fi
  done
done
variant mps_vgpu_trainer_alone 1 none -- "${TRAIN[@]}"

ALONE_P99=$(awk -F'\t' '$1=="alone_latency"{print $3}' "$RESULTS")
ALONE_TF=$(awk -F'\t' '$1=="alone_trainer"{print $4}' "$RESULTS")
echo
printf '| %-24s | %-8s | %-8s | %-9s | %-9s | %-9s | %-6s | %s\n' variant "p50 ms" "p99 ms" "p99/alone" "TFLOP/s" "% alone" target notes
while IFS=$'\t' read -r name p50 p99 tf notes; do
  ratio=""; pct=""; ok="-"
  [ "$p99" != - ] && [ -n "$ALONE_P99" ] && ratio=$(calc "round($p99 / $ALONE_P99, 2)")
  [ "$tf" != - ] && [ -n "$ALONE_TF" ] && pct=$(calc "round(100 * $tf / $ALONE_TF, 1)")
  if [ -n "$ratio" ] && [ -n "$pct" ]; then ok=$(calc "'MET' if $ratio <= 1.15 and $pct >= 80 else 'no'"); fi
  printf '| %-24s | %-8s | %-8s | %-9s | %-9s | %-9s | %-6s | %s\n' "$name" "$p50" "$p99" "$ratio" "$tf" "$pct" "$ok" "$notes"
done <"$RESULTS"
