#!/usr/bin/env bash
# The fault matrix (issue 15, point 6): what a fatal fault of one tenant does to the other tenant of
# the same GPU, under each way of sharing it. One GPU, two processes per case
# (tests/gpu/fault_matrix.py):
#   victim   a latency tenant: checked fp32 matmuls synchronised every step, one every 3 ms, 14 s;
#            after a CUDA error it lingers LINGER s with its broken context (as a server catching
#            the exception would), then exits
#   faulter  bf16 8192^3 matmuls, work always queued; 2 s after it is warm it faults:
#              illegal  a kernel stores through a null pointer (CUDA_ERROR_ILLEGAL_ADDRESS)
#              kill     SIGKILL from this script with kernels in flight
#   probe    a new client started 0.5 s after the fault: CUDA init and one checked matmul (MPS
#            refuses new clients until every client of a faulted server has exited), and another
#            one PROBE2_AFTER (25) s after the fault (after the agent's grace for lingering clients of a
#            faulted MPS server, 10 s: it terminates them so that new clients are accepted)
# Modes: plain (two processes, the driver's time slicing), mps (both clients of an MPS daemon
# started here), vgpu (vgpu-cp + `vgpu-agent join`, the victim placed with --latency, the faulter
# and the probe in a --burst tenant, all through `vgpu-agent exec`), vgpu-mps (the same with
# `join --mps`).
# Table printed last: per mode and fault, the victim's outcome (survived / died with its error /
# wrong results / hung), its steps after the fault, its p50 before and its worst step around the
# fault, and what the new client got.
#
#   VGPU_BIN=dist tests/gpu/fault_matrix.sh          # ~3 min on an H100
#
# Knobs: MODES (plain mps vgpu vgpu-mps), FAULTS (illegal kill), LINGER (5), VGPU_BIN (dist), PY,
# OUT (/tmp/fault-matrix-out), VGPU_PORT (7475), MPS_TENANTS (the agent's `--mps-tenants`:
# non-latency, its default, or all: the latency tenant an MPS client too).
# No GPU setting is changed and nothing is reset; every process started here is killed and reaped
# on exit, and the MPS daemons are told to quit. Exit: 0 done, 2 usage, 3 wrong machine.
# shellcheck disable=SC2317 # cleanup and the wait tests are called indirectly (trap, bounded_wait)
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HELPER="$ROOT/tests/gpu/fault_matrix.py"
# forget, bounded_wait, gone, stop_pid, mps_gone; gpu_paths, ctl, vgpu_cp_up, vgpu_agent_up,
# agent_mps_down
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
# shellcheck source=tests/gpu/node.sh
source "$ROOT/tests/gpu/node.sh"
gpu_paths
MODES=${MODES:-plain mps vgpu vgpu-mps}
FAULTS=${FAULTS:-illegal kill}
LINGER=${LINGER:-5}
PROBE2_AFTER=${PROBE2_AFTER:-25}
MPS_TENANTS=${MPS_TENANTS:-non-latency}
OUT=${OUT:-/tmp/fault-matrix-out}
LOGS="$OUT/fault_matrix"
PORT=${VGPU_PORT:-7475}
EP="127.0.0.1:$PORT"
SHM=/dev/shm/vgpu-fault-matrix.$$
export PYTHONUNBUFFERED=1
for m in $MODES; do
  case "$m" in plain | mps | vgpu | vgpu-mps) ;; *) echo "MODES: unknown mode $m" >&2; exit 2 ;; esac
done
for f in $FAULTS; do
  case "$f" in illegal | kill) ;; *) echo "FAULTS: unknown fault $f" >&2; exit 2 ;; esac
done
if [[ " $MODES " == *" vgpu"* ]]; then
  for f in vgpu-cp vgpu-agent vgpuctl libvgpu_cuda.so; do
    [ -e "$BIN/$f" ] || { echo "$BIN/$f is missing: build and carry it (VGPU_BIN)" >&2; exit 2; }
  done
fi

rm -rf "$LOGS"
mkdir -p "$LOGS"
WORK=$(mktemp -d /tmp/fault-matrix.XXXXXX)
MPS_PIPE="$WORK/mps/pipe"
PIDS=()
CP=""
AGENT=""
MPS_OWN=0
AGENT_MPS=0
PLACED=0
LAST=""

cleanup() {
  local rc=$? pid
  trap - EXIT
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [ "$MPS_OWN" = 1 ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
  [ "$AGENT_MPS" = 1 ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$SHM/mps" nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r "$WORK/mps/log" "$LOGS/mps-log" 2>/dev/null
  cp -r "$WORK/agent/mps-log" "$LOGS/agent-mps-log" 2>/dev/null
  rm -rf "$WORK" "$SHM"
  tar -czf "$OUT/fault_matrix.tgz" -C "$OUT" fault_matrix 2>/dev/null
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
has() { grep -q "^$2 " "$1" 2>/dev/null; }
reap() { # reap PID SECONDS: wait up to SECONDS for it to exit, else KILL; returns 1 if killed
  local killed=0
  bounded_wait "$2" "process $1 to exit" gone "$1" || { kill -9 "$1" 2>/dev/null; killed=1; }
  wait "$1" 2>/dev/null
  forget "$1"
  return $killed
}

# start ROLE TENANT LOG ARGS...: runs the helper the way the current mode runs a tenant process
start() {
  local tenant=$1 logf=$2
  shift 2
  case "$MODE" in
  plain) "$PY" "$HELPER" "$@" >"$logf" 2>&1 & ;;
  mps) CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" "$PY" "$HELPER" "$@" >"$logf" 2>&1 & ;;
  vgpu | vgpu-mps)
    local flag=false
    [ "$MODE" = vgpu-mps ] && flag=true
    VGPU_AGENT_MPS=$flag VGPU_AGENT_MPS_TENANTS=$MPS_TENANTS VGPU_LOG="${VGPU_LOG:-2}" "$BIN/vgpu-agent" exec --name gpu-node \
      --state-dir "$WORK/agent" --shm-dir "$SHM" --interposer "$BIN/libvgpu_cuda.so" \
      --tenant "$tenant" -- "$PY" "$HELPER" "$@" >"$logf" 2>&1 &
    ;;
  esac
  LAST=$!
  PIDS+=("$LAST")
}

run_case() { # run_case FAULT
  local fault=$1 D="$LOGS/$MODE:$1" victim faulter probe
  mkdir -p "$D"
  log "$MODE / $fault"
  start lat "$D/victim.log" victim --out "$D/victim.json" --seconds 14 --linger "$LINGER"
  victim=$LAST
  start nb "$D/faulter.log" faulter --mode "$fault" --after 2
  faulter=$LAST
  bounded_wait 90 "victim warm" has "$D/victim.log" READY || log "victim not warm (see $D/victim.log)"
  bounded_wait 90 "faulter warm" has "$D/faulter.log" READY || log "faulter not warm (see $D/faulter.log)"
  if [ "$fault" = kill ]; then
    if bounded_wait 30 "KILL_ME" has "$D/faulter.log" KILL_ME; then
      sleep 0.3
      date +%s.%N >"$D/killed_at"
      kill -9 "$faulter" 2>/dev/null
    fi
  else
    bounded_wait 30 "the fault" has "$D/faulter.log" FAULT
  fi
  reap "$faulter" 30 || log "faulter did not exit within 30 s after its fault: killed"
  sleep 0.5
  date +%s.%N >"$D/probe_at"
  start nb "$D/probe.log" probe
  probe=$LAST
  reap "$probe" 45 || log "new client did not finish within 45 s: killed (HUNG)"
  local wait_s
  wait_s=$(awk -v t="$(cat "$D/probe_at")" -v a="$PROBE2_AFTER" -v n="$(date +%s.%N)" 'BEGIN { d = t - 0.5 + a - n; printf "%.2f", (d > 0 ? d : 0) }')
  sleep "$wait_s"
  date +%s.%N >"$D/probe2_at"
  start nb "$D/probe2.log" probe
  reap "$LAST" 45 || log "the later new client did not finish within 45 s: killed (HUNG)"
  reap "$victim" $((20 + LINGER + 20)) || log "victim did not exit in time: killed (HUNG)"
  if [ "$MODE" = vgpu ] || [ "$MODE" = vgpu-mps ]; then
    ctl describe tenant lat >"$D/describe-lat.txt" 2>&1
  fi
}

vgpu_up() { # vgpu_up [--mps]
  vgpu_cp_up || return 1
  vgpu_agent_up --mps-tenants "$MPS_TENANTS" "$@" || return 1
  if [ "$PLACED" = 0 ]; then
    ctl place lat --gpus 0.25 --memory 8GiB --latency 2>&1 | tee -a "$LOGS/run.log"
    ctl place nb --gpus 0.5 --memory 30GiB --burst 2>&1 | tee -a "$LOGS/run.log"
    PLACED=1
  fi
  bounded_wait 15 "tenant directories" test -e "$SHM/tenants/nb/nccl-activity"
}

gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv,noheader 2>&1 | head -n1)
log "machine: $gpu; modes: $MODES; faults: $FAULTS; LINGER=$LINGER MPS_TENANTS=$MPS_TENANTS"
cmode=$(echo "$gpu" | awk -F', *' '{ print $3 }')
mig=$(echo "$gpu" | awk -F', *' '{ print $4 }')
if [ "$cmode" != Default ] || [ "$mig" = Enabled ]; then
  log "this needs one GPU in compute mode Default with MIG off; nothing is changed here, stopping"
  exit 3
fi

for MODE in $MODES; do
  case "$MODE" in
  mps)
    mkdir -p "$MPS_PIPE" "$WORK/mps/log"
    if CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$WORK/mps/log" nvidia-cuda-mps-control -d; then
      MPS_OWN=1
      bounded_wait 10 "the MPS control pipe" test -e "$MPS_PIPE/control"
    else
      log "nvidia-cuda-mps-control -d failed: mode skipped"
      continue
    fi
    ;;
  vgpu) agent_mps_down; vgpu_up || { log "vgpu did not come up: mode skipped"; continue; } ;;
  vgpu-mps) vgpu_up --mps || { log "vgpu-mps did not come up: mode skipped"; continue; } ;;
  esac
  for fault in $FAULTS; do run_case "$fault"; done
  if [ "$MODE" = mps ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
    MPS_OWN=0
    bounded_wait 15 "the MPS daemon to quit" mps_gone
  fi
done
agent_mps_down
[ -n "$AGENT" ] && stop_pid "$AGENT"
[ -n "$CP" ] && stop_pid "$CP"
log "done after ${SECONDS}s"
echo
"$PY" "$HELPER" analyze --logs "$LOGS"
