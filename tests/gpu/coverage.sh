#!/usr/bin/env bash
# CUDA features under the interposer on a real GPU (issue 3, "Verified on a real GPU" item 5,
# all but the NCCL all-reduce, which needs two GPUs). Run from the repository root on a GPU
# machine:
#
#   tests/gpu/coverage.sh [path/to/libvgpu_cuda.so]
#
# Every tenant runs under LD_PRELOAD of libvgpu_cuda.so with a memory limit and a compute share
# (VGPU_MEMORY_LIMIT, VGPU_COMPUTE_SHARES=0:<pct>, VGPU_BURST=0: capped at the share even when
# alone, so every launch goes through the gate). Each feature is checked for correct results
# (exact fp32 matmuls of small integers against a float64 reference, or a grid-synchronized
# kernel checked on the host) and for the memory limit holding (allocations until the first
# failure: torch's OutOfMemoryError / cudaErrorMemoryAllocation at or below the limit); where two
# tenants run at once, their achieved shares of the GPU (work done in a common window, the same
# work per unit for both) must be within TOL points of the targets:
#   CUDA graphs       capture (torch's default capture_error_mode "global") with gated launches,
#                     and with the memory limit only; then 2 tenants 70/30 replaying a captured
#                     graph (launches via cuGraphLaunch), captured with GRAPH_CAPTURE_MODE
#                     (default global)
#   cooperative       nvcc-built tests/gpu/coop.cu: grid.sync kernels via the runtime and via
#                     cuLaunchCooperativeKernel, checked; then 2 tenants 70/30 of busy
#                     cooperative kernels, 4 per synchronize: short ones (1.3 ms), and long ones
#                     (5 ms: each tenant blocks in its synchronize longer than the grace period)
#   cudaMallocAsync   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: checked, OOM at the limit,
#                     checked again after
#   4 streams         one process, checked matmuls interleaved on 4 streams; then OOM
#   3 processes       of tenant mx (40%) against tenant my (60%, one process): together under
#                     mx's limit, and mx's combined work at its share
# Logs go to a temporary directory, tarred into $OUT/coverage.tar.gz when OUT is set; the table
# is printed last (and written to $OUT/coverage_results.tsv). Exit status 0 when all passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=$(realpath "${1:-$ROOT/target/release/libvgpu_cuda.so}")
HELPER="$ROOT/tests/gpu/coverage.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WINDOW=${WINDOW:-8}
TOL=${TOL:-5}
LOGS="$(mktemp -d)/coverage"
mkdir -p "$LOGS"
GIB=$((1 << 30))
SHM=""
PIDS=()

cleanup() {
  # every background job of this script, tracked in PIDS or not (a build, a sampler), and then
  # a wait for exactly those: a bare `wait` would block on anything left running
  local pid left
  left=$(jobs -p)
  for pid in "${PIDS[@]}" $left; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}" $left; do wait "$pid" 2>/dev/null; done
  [ -n "$SHM" ] && rm -rf "$SHM"
}
trap cleanup EXIT

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
start_at() { "$PY" -c "import time; print(time.monotonic() + $1)"; }
fresh_shm() { [ -n "$SHM" ] && rm -rf "$SHM"; SHM=$(mktemp -d /dev/shm/vgpu-coverage.XXXXXX); }
# run_tenant LOG NAME LIMIT SHARE [VAR=VALUE...] -- COMMAND...: in the background
run_tenant() {
  local logname=$1 name=$2 limit=$3 share=$4
  shift 4
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  env LD_PRELOAD="$SO" VGPU_TENANT="$name" VGPU_MEMORY_LIMIT="$limit" \
    VGPU_COMPUTE_SHARES="0:$share" VGPU_BURST=0 VGPU_GUARANTEED=1 VGPU_SHM_DIR="$SHM" \
    VGPU_LOG="${VGPU_LOG:-1}" PYTHONUNBUFFERED=1 "${extra[@]}" "$@" >"$LOGS/$logname.log" 2>&1 &
  PIDS+=($!)
}
# wait_all SECONDS: waits for every background run, SIGKILLs what is left after SECONDS.
wait_all() {
  local deadline=$((SECONDS + $1)) pid
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; do
      if [ $SECONDS -ge $deadline ]; then log "pid $pid overran: SIGKILL"; kill -9 "$pid"; break; fi
      sleep 0.1
    done
  done
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
}
schedstat() { "$PY" "$HELPER" schedstat --shm "$SHM" >"$LOGS/schedstat_$1.log" 2>&1; }

log "interposer $SO; window ${WINDOW}s, tolerance $TOL points"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOGS/run.log"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$LOGS/run.log"
cat >"$LOGS/config.json" <<EOF
{"tolerance_points": $TOL, "graph_limit": $((4 * GIB)), "graph_shares": [70, 30],
 "coop_limit": $((2 * GIB)), "coop_shares": [70, 30], "async_limit": $((4 * GIB)),
 "streams_limit": $((4 * GIB)), "mp_limit": $((6 * GIB)), "mp_procs": 3, "mp_shares": [40, 60]}
EOF

# The cooperative test program, built while the graph test runs.
COOP="$LOGS/coop"
(
  NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  STUBS="$(dirname "$(dirname "$(realpath "$NVCC")")")/lib64/stubs"
  for libs in "-lcuda" "-L$STUBS -lcuda" "-Xlinker /usr/local/nvidia/lib64/libcuda.so.1"; do
    for rdc in "" "-rdc=true"; do
      echo "+ nvcc -O2 -arch=sm_90 $rdc coop.cu $libs"
      # shellcheck disable=SC2086
      "$NVCC" -O2 -arch=sm_90 $rdc "$ROOT/tests/gpu/coop.cu" -o "$COOP" $libs && exit 0
    done
  done
  exit 1
) >"$LOGS/coop_build.log" 2>&1 &
BUILD=$!

# ---- CUDA graphs ----
# Capture with torch's default capture_error_mode ("global") with gated launches, and the same
# with the memory limit only (no share: launches not gated), each alone on its own schedule.
fresh_shm
run_tenant graph_capture_gated gcap 4GiB 50 -- "$PY" "$HELPER" graph --check-only --capture-mode global
SHM_GATED=$SHM
SHM=$(mktemp -d /dev/shm/vgpu-coverage.XXXXXX)
env LD_PRELOAD="$SO" VGPU_TENANT=gfree VGPU_MEMORY_LIMIT=4GiB VGPU_SHM_DIR="$SHM" PYTHONUNBUFFERED=1 \
  "$PY" "$HELPER" graph --check-only --capture-mode global >"$LOGS/graph_capture_ungated.log" 2>&1 &
PIDS+=($!)
wait_all 120
rm -rf "$SHM_GATED"
# Replays 70/30, captured with GRAPH_CAPTURE_MODE (torch's default, global, unless set).
fresh_shm
T=$(start_at 14)
for t in hi lo; do
  pct=70; [ $t = lo ] && pct=30
  run_tenant "graph_g_$t" "g$t" 4GiB $pct -- "$PY" "$HELPER" graph --start-at "$T" --window "$WINDOW" \
    --capture-mode "${GRAPH_CAPTURE_MODE:-global}"
done
wait_all 120
schedstat graph
log "graphs done"

# ---- cooperative kernels ----
if wait "$BUILD"; then
  fresh_shm
  run_tenant coop_check coop 2GiB 50 -- "$COOP" check
  wait_all 60
  # 70/30 with 4 short (about 1.3 ms) kernels per synchronize ...
  T=$(start_at 2)
  run_tenant coop_c_hi chi 2GiB 70 -- "$COOP" spin "$T" 6 50000 4
  run_tenant coop_c_lo clo 2GiB 30 -- "$COOP" spin "$T" 6 50000 4
  wait_all 60
  schedstat coop
  # ... and with 4 long (about 5 ms) kernels per synchronize: each tenant then blocks in
  # cudaDeviceSynchronize for about 20 ms, longer than the schedule's grace period (10 ms).
  fresh_shm
  T=$(start_at 2)
  run_tenant coop_long_c_hi chi 2GiB 70 -- "$COOP" spin "$T" 6 200000 4
  run_tenant coop_long_c_lo clo 2GiB 30 -- "$COOP" spin "$T" 6 200000 4
  wait_all 60
  schedstat coop_long
else
  log "nvcc failed: $(tail -n 5 "$LOGS/coop_build.log")"
fi
log "cooperative done"

# ---- cudaMallocAsync and 4 streams (one after the other, each alone) ----
fresh_shm
run_tenant mallocasync ma 4GiB 50 PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync -- "$PY" "$HELPER" mallocasync
wait_all 120
fresh_shm
run_tenant streams st 4GiB 50 -- "$PY" "$HELPER" streams
wait_all 120
log "mallocasync, streams done"

# ---- 3 processes of tenant mx (40%) against tenant my (60%) ----
fresh_shm
BAR=$(mktemp -d)
T=$(start_at 16)
for i in 0 1 2; do
  run_tenant "mp_x$i" mx 6GiB 40 -- "$PY" "$HELPER" mp --start-at "$T" --window "$WINDOW" --barrier "$BAR/x" --procs 3
done
run_tenant mp_y my 6GiB 60 -- "$PY" "$HELPER" mp --start-at "$T" --window "$WINDOW" --barrier "$BAR/y" --procs 1
wait_all 150
schedstat mp
rm -rf "$BAR"
log "several processes done"

"$PY" "$HELPER" report --logs "$LOGS" >"$LOGS/report.log" 2>&1 || { log "report failed:"; cat "$LOGS/report.log"; }
waits=$(cat "$LOGS"/*.log | grep -c 'waited .* for its turn' || true)
ungated=$(cat "$LOGS"/*.log | grep -c 'not gated' || true)
panics=$(cat "$LOGS"/*.log | grep -c 'internal error (panic)' || true)
printf '%s\t%s\t%s\t%s\t%s\n' "interposer log: no 5 s turn-wait fallback, no ungated launches, no panic" \
  "$waits fallbacks, $ungated ungated, $panics panics" "-" "-" \
  "$([ "$waits" = 0 ] && [ "$ungated" = 0 ] && [ "$panics" = 0 ] && echo PASS || echo FAIL)" >>"$LOGS/results.tsv"
grep -h "vgpu\[" "$LOGS"/*.log | sed -E 's/vgpu\[[0-9]*\]( [0-9:.]+)?/vgpu[pid]/' | sort | uniq -c | sort -rn | head -20 >"$LOGS/interposer_messages.txt"
echo
echo "interposer messages (top 8 of $(wc -l <"$LOGS/interposer_messages.txt") distinct):"
head -8 "$LOGS/interposer_messages.txt"
echo
echo "logs: $LOGS"
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/coverage.tar.gz" --exclude=coop -C "$LOGS/.." "$(basename "$LOGS")" 2>/dev/null
  cp "$LOGS/results.tsv" "$OUT/coverage_results.tsv"
  echo "tarred into $OUT/coverage.tar.gz"
fi
{
  printf 'feature\tcorrect\tlimit held\tshare %% (if measured)\tresult\n'
  cat "$LOGS/results.tsv"
} | awk -F'\t' '
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END { for (r = 1; r <= NR; r++) printf "%-*s | %-*s | %-*s | %-*s | %s\n", w[1], cell[r, 1], w[2], cell[r, 2], w[3], cell[r, 3], w[4], cell[r, 4], cell[r, 5] }'
! grep -q $'\tFAIL$' "$LOGS/results.tsv" && [ -s "$LOGS/results.tsv" ]
