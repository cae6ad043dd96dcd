#!/usr/bin/env bash
# Fault isolation under the interposer on a real GPU (issue 3, "Fault isolation"). Run from the
# repository root on a GPU machine:
#
#   tests/gpu/isolation.sh [path/to/libvgpu_cuda.so]
#
# Three tenants share GPU 0 under LD_PRELOAD of libvgpu_cuda.so, each with its own VGPU_TENANT,
# VGPU_MEMORY_LIMIT and VGPU_COMPUTE_SHARES, all with one VGPU_SHM_DIR: bystanders a and b (30%
# each, 8 GiB, 2 GiB held) run checked fp32 matmuls (exact small integers against a float64
# reference) the whole time, while tenant v (40%, 6 GiB, 4 GiB held, checked matmuls) crashes,
# inside its own compute turn and with work queued, in three ways one after another:
#   illegal  a kernel stores through a null pointer (CUDA_ERROR_ILLEGAL_ADDRESS in v's context)
#   abort    os.abort() with matmuls queued
#   kill     SIGKILL from outside, sent when the schedule file shows v holding the turn
# After each crash a new v process starts and allocates its whole 6 GiB quota (less its context
# charge) in one tensor (so the dead process's memory was credited back), and becomes the next
# victim. Per crash: a and b still correct (no mismatch), their longest stretch without a
# completed iteration from the crash to WINDOW s after it (bound: BOUND s; the takeover of a dead
# owner's turn should take about one quantum), and the quota check. Logs go to a temporary
# directory, tarred into $OUT/isolation.tar.gz when OUT is set; the table is printed last (and
# written to $OUT/isolation_results.tsv). Exit status 0 when every row passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=$(realpath "${1:-$ROOT/target/release/libvgpu_cuda.so}")
HELPER="$ROOT/tests/gpu/isolation.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WINDOW=${WINDOW:-3}
BOUND=${BOUND:-2}
LOGS="$(mktemp -d)/isolation"
mkdir -p "$LOGS"
SHM=$(mktemp -d /dev/shm/vgpu-isolation.XXXXXX)
GIB=$((1 << 30))
V_LIMIT=$((6 * GIB))
# The interposer charges each process's CUDA context to its slice (VGPU_CONTEXT_OVERHEAD, default
# 640 MiB), so "the whole quota in one tensor" is the slice less that charge.
V_QUOTA=$((V_LIMIT - ${CONTEXT_CHARGE_BYTES:-$((640 << 20))}))
STOP="$LOGS/stop"
EVENTS="$LOGS/events.tsv"
rm -f "$STOP"
: >"$EVENTS"
PIDS=()
ulimit -c 0 # os.abort() must not write a core of a process holding GiBs

cleanup() {
  # every background job of this script, tracked in PIDS or not (a build, a sampler), and then
  # a wait for exactly those: a bare `wait` would block on anything left running
  local pid left
  left=$(jobs -p)
  for pid in "${PIDS[@]}" $left; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}" $left; do wait "$pid" 2>/dev/null; done
  rm -rf "$SHM"
}
trap cleanup EXIT

log() { echo "[$(date +%T.%N | cut -c1-12)] $*" | tee -a "$LOGS/run.log"; }
# alive PID: the process exists and is not a zombie.
alive() {
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)
  [ -n "$st" ] && [ "$st" != Z ]
}
# wait_bounded PID SECONDS: waits for a child, SIGKILLs it past SECONDS; returns its status.
wait_bounded() {
  local pid=$1 deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ] && alive "$pid"; do sleep 0.05; done
  [ $SECONDS -lt $deadline ] || { log "pid $pid still running after $2 s: SIGKILL"; kill -9 "$pid" 2>/dev/null; }
  wait "$pid"
}
wait_for() { # wait_for LOG WORD SECONDS [PID]: gives up early once PID has ended
  local deadline=$((SECONDS + $3))
  until grep -q "^$2" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || return 1
    [ -z "${4:-}" ] || alive "$4" || return 1
    sleep 0.1
  done
}
# tenant NAME LIMIT SHARE LOG -- helper args (background; $! is the Python process)
tenant() {
  local name=$1 limit=$2 share=$3 logname=$4
  shift 5
  env LD_PRELOAD="$SO" VGPU_TENANT="$name" VGPU_MEMORY_LIMIT="$limit" \
    VGPU_COMPUTE_SHARES="0:$share" VGPU_BURST=1 VGPU_SHM_DIR="$SHM" VGPU_LOG="${VGPU_LOG:-1}" \
    PYTHONUNBUFFERED=1 "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1 &
}

log "interposer: $SO"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOGS/run.log"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$LOGS/run.log"

tenant a 8GiB 30 tenant_a -- worker --times "$LOGS/a_times.json" --stop "$STOP" --gib 2
A=$!
tenant b 8GiB 30 tenant_b -- worker --times "$LOGS/b_times.json" --stop "$STOP" --gib 2
B=$!
PIDS+=("$A" "$B")
wait_for "$LOGS/tenant_a.log" RUNNING 120 "$A" || log "tenant a did not start (tenant_a.log)"
wait_for "$LOGS/tenant_b.log" RUNNING 120 "$B" || log "tenant b did not start (tenant_b.log)"
log "bystanders running: a=$A b=$B"

# v1 .. v3 crash; v4 only checks the quota after the last crash.
tenant v 6GiB 40 v1_illegal -- victim --mode illegal --limit "$V_QUOTA" --gib 4 --after 1.5
V=$!
PIDS+=("$V")
n=1
for kind in illegal abort kill; do
  vlog="v${n}_$kind"
  wait_for "$LOGS/$vlog.log" VICTIM_RUNNING 90 "$V" || log "victim $vlog did not start"
  log "victim $vlog running (pid $V)"
  klog=-
  if [ "$kind" = kill ]; then
    sleep 1.5
    klog="killer_$n"
    "$PY" "$HELPER" killer --pid "$V" --tenant v --shm "$SHM" --timeout 5 >"$LOGS/$klog.log" 2>&1
  fi
  wait_bounded "$V" 60
  rc=$?
  log "victim $vlog ended with status $rc"
  # The next v starts at once; its first act is the quota check that shows the memory came back.
  next=$((n + 1))
  case $kind in
    illegal) nextkind=abort ;;
    abort) nextkind=kill ;;
    *) nextkind=none ;;
  esac
  nextlog="v${next}_$nextkind"
  tenant v 6GiB 40 "$nextlog" -- victim --mode "$nextkind" --limit "$V_QUOTA" --gib 4 --after 1.5
  V=$!
  PIDS+=("$V")
  printf '%s\t%s\t%s\t%s\t%s\n' "$kind" "$rc" "$vlog.log" "$( [ "$klog" = - ] && echo - || echo "$klog.log")" "$nextlog.log" >>"$EVENTS"
  wait_for "$LOGS/$nextlog.log" QUOTA 90 "$V" || log "next victim $nextlog printed no QUOTA line"
  sleep "$WINDOW"
  n=$next
done
wait_bounded "$V" 60
sleep 1
touch "$STOP"
wait_bounded "$A" 60; log "tenant a ended with status $?"
wait_bounded "$B" 60; log "tenant b ended with status $?"
PIDS=()

"$PY" "$HELPER" analyze --logs "$LOGS" --window "$WINDOW" --bound "$BOUND" >"$LOGS/analyze.log" 2>&1 ||
  { log "analysis failed:"; cat "$LOGS/analyze.log"; }
waits=$(cat "$LOGS"/tenant_*.log | grep -c 'waited .* for its turn' || true)
panics=$(cat "$LOGS"/*.log | grep -c 'internal error (panic)' || true)
printf '%s\t%s\t%s\t%s\t%s\n' "no launch of a or b hit the 5 s turn-wait fallback; no panic" \
  "$waits fallbacks, $panics panics" "-" "-" "$([ "$waits" = 0 ] && [ "$panics" = 0 ] && echo PASS || echo FAIL)" >>"$LOGS/results.tsv"
grep -h "vgpu\[" "$LOGS"/*.log | sed -E 's/vgpu\[[0-9]*\]( [0-9:.]+)?/vgpu[pid]/' | sort | uniq -c | sort -rn | head -20 >"$LOGS/interposer_messages.txt"
echo
echo "interposer messages (top 8 of $(wc -l <"$LOGS/interposer_messages.txt") distinct):"
head -8 "$LOGS/interposer_messages.txt"
echo
echo "logs: $LOGS"
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/isolation.tar.gz" -C "$LOGS/.." "$(basename "$LOGS")" 2>/dev/null
  cp "$LOGS/results.tsv" "$OUT/isolation_results.tsv"
  echo "tarred into $OUT/isolation.tar.gz"
fi
{
  printf 'crash kind\tothers still correct (after the crash)\tothers stall after crash, ms (before)\tmemory credited\tresult\n'
  cat "$LOGS/results.tsv"
} | awk -F'\t' '
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END { for (r = 1; r <= NR; r++) printf "%-*s | %-*s | %-*s | %-*s | %s\n", w[1], cell[r, 1], w[2], cell[r, 2], w[3], cell[r, 3], w[4], cell[r, 4], cell[r, 5] }'
! grep -q $'\tFAIL$' "$LOGS/results.tsv" && [ -s "$LOGS/results.tsv" ]
