#!/usr/bin/env bash
# Compute sharing by the interposer on a real GPU (issue 3, "Verified on a real GPU" items 2-4),
# with PyTorch. Run from the repository root on a GPU machine:
#
#   tests/gpu/compute_shares.sh [path/to/libvgpu_cuda.so]
#
# The library defaults to target/release/libvgpu_cuda.so (built on a development machine with
# `cargo build --release -p interposer` and carried along). Tenants get their VGPU_* environment
# directly (distinct VGPU_TENANT, VGPU_COMPUTE_SHARES=0:<pct>, one VGPU_SHM_DIR). Checks:
#   1. a tenant alone with the interposer (share 100) vs without: throughput within 2%;
#   2. 2 and 4 compute-bound tenants (bf16 8192^3 matmuls) with shares 50/50, 70/30 and
#      40/30/20/10, all started together, throughput over a WINDOW-second window converted to
#      GPU-time shares (throughput / throughput alone): within 5 points of the target;
#   3. launch overhead: an empty-kernel cuLaunchKernel loop with and without the interposer
#      (goal: at most 0.3 us added per launch);
#   4. latency (informational): a 6-layer fp16 MLP at batch 8, p50/p99 alone, next to a matmul
#      trainer without the interposer, and with it (shares 50/50, both may burst).
# Logs go to $OUT/compute_shares (or a temporary directory); the table is printed last.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=$(realpath "${1:-$ROOT/target/release/libvgpu_cuda.so}")
HELPER="$ROOT/tests/gpu/compute_shares.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WINDOW=${WINDOW:-20}
LOGS="${OUT:-$(mktemp -d)}/compute_shares"
mkdir -p "$LOGS"
RESULTS="$LOGS/results.tsv"
: >"$RESULTS"
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
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"; log "$4: $1 (target $2, got $3)"; }
field() { # field LOG NAME
  local json
  json=$(grep '^RESULT ' "$1" 2>/dev/null | tail -n1 | sed 's/^RESULT //')
  [ -n "$json" ] || json='{}'
  "$PY" -c 'import json,sys; v=json.loads(sys.argv[1]).get(sys.argv[2]); print("" if v is None else v)' "$json" "$2"
}
calc() { "$PY" -c "import sys; print($1)"; }
start_at() { "$PY" -c "import time; print(time.monotonic() + $1)"; }
fresh_shm() { [ -n "$SHM" ] && rm -rf "$SHM"; SHM=$(mktemp -d /dev/shm/vgpu-compute.XXXXXX); }

# run_tenant LOG NAME SHARE EXTRA_ENV... -- ARGS: a helper process inside a tenant (background).
run_tenant() {
  local logname=$1 name=$2 share=$3
  shift 3
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  env LD_PRELOAD="$SO" VGPU_TENANT="$name" VGPU_COMPUTE_SHARES="0:$share" VGPU_SHM_DIR="$SHM" \
    VGPU_LOG="${VGPU_LOG:-1}" "${extra[@]}" "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1 &
  PIDS+=($!)
}
run_plain() { # run_plain LOG -- ARGS (background, no interposer)
  local logname=$1
  shift 2
  "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1 &
  PIDS+=($!)
}
wait_all() { wait "${PIDS[@]}" 2>/dev/null; PIDS=(); }

log "interposer $SO; window ${WINDOW}s"
nvidia-smi -L >"$LOGS/gpu.txt" 2>&1; cat "$LOGS/gpu.txt" | tee -a "$LOGS/run.log"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$LOGS/run.log"
ldd "$SO" >>"$LOGS/run.log" 2>&1

# ---- 1. alone, without and with the interposer ----
fresh_shm
T=$(start_at 12); run_plain alone_plain -- matmul --start-at "$T" --window "$WINDOW"; wait_all
ALONE=$(field "$LOGS/alone_plain.log" tflops)
T=$(start_at 12); run_tenant alone_vgpu solo 100 VGPU_BURST=1 -- matmul --start-at "$T" --window "$WINDOW"; wait_all
ALONE_VGPU=$(field "$LOGS/alone_vgpu.log" tflops)
if [ -n "$ALONE" ] && [ -n "$ALONE_VGPU" ]; then
  loss=$(calc "round(100 * (1 - $ALONE_VGPU / $ALONE), 2)")
  verdict=$(calc "'PASS' if $loss <= 2 else 'FAIL'")
  record "alone: throughput loss with interposer (%) [$ALONE vs $ALONE_VGPU TFLOP/s]" "<= 2" "$loss" "$verdict"
else
  record "alone throughput" "measured" "missing" FAIL
fi

# ---- 2. shares ----
shares_case() { # shares_case LABEL PCT...
  local label=$1
  shift
  fresh_shm
  local T i=0
  T=$(start_at 15)
  for pct in "$@"; do
    run_tenant "${label}_t$i" "t$i" "$pct" VGPU_BURST=0 VGPU_GUARANTEED=1 -- matmul --start-at "$T" --window "$WINDOW"
    i=$((i + 1))
  done
  wait_all
  i=0
  local worst=0 got_all=""
  for pct in "$@"; do
    local tf share
    tf=$(field "$LOGS/${label}_t$i.log" tflops)
    [ -n "$tf" ] || tf=0
    share=$(calc "round(100 * $tf / $ALONE, 1)")
    got_all="$got_all${got_all:+/}$share"
    worst=$(calc "max($worst, abs($share - $pct))")
    i=$((i + 1))
  done
  local verdict
  verdict=$(calc "'PASS' if $worst <= 5 else 'FAIL'")
  record "shares $label (% of GPU time; worst error $worst points)" "$(IFS=/; echo "$*")" "$got_all" "$verdict"
}
if [ -n "$ALONE" ]; then
  shares_case 50_50 50 50
  shares_case 70_30 70 30
  shares_case 40_30_20_10 40 30 20 10
fi

# ---- 3. launch overhead ----
BENCH="$LOGS/launch_bench"
if cc -O2 "$ROOT/tests/gpu/launch_bench.c" -o "$BENCH" -L/usr/local/nvidia/lib64 -l:libcuda.so.1 >"$LOGS/bench_build.log" 2>&1; then
  fresh_shm
  for run in 1 2 3; do
    "$BENCH" >"$LOGS/bench_plain_$run.log" 2>&1
    env LD_PRELOAD="$SO" VGPU_TENANT=bench VGPU_SHM_DIR="$SHM" "$BENCH" >"$LOGS/bench_noshare_$run.log" 2>&1
    env LD_PRELOAD="$SO" VGPU_TENANT=bench VGPU_COMPUTE_SHARES=0:100 VGPU_SHM_DIR="$SHM" "$BENCH" >"$LOGS/bench_gated_$run.log" 2>&1
  done
  best() { for r in 1 2 3; do field "$LOGS/bench_$1_$r.log" us_per_launch; done | sort -g | head -n1; }
  P=$(best plain); NS=$(best noshare); G=$(best gated)
  if [ -n "$P" ] && [ -n "$G" ]; then
    added=$(calc "round($G - $P, 3)")
    record "launch: us per cuLaunchKernel, plain $P / hooked, no share $NS / gated alone $G (best of 3)" "added <= 0.3" "$added" "$(calc "'PASS' if $added <= 0.3 else 'FAIL'")"
  else
    record "launch overhead" "measured" "missing" FAIL
  fi
else
  record "launch overhead (cc failed, see bench_build.log)" "measured" "not run" FAIL
fi

# ---- 4. latency (informational: spatial partitioning is the next part) ----
LWIN=10
fresh_shm
T=$(start_at 10); run_plain mlp_alone -- mlp --start-at "$T" --window "$LWIN"; wait_all
T=$(start_at 12)
run_plain mlp_plain_hog -- hog --until "$(calc "$T + $LWIN + 1")"
run_plain mlp_plain -- mlp --start-at "$T" --window "$LWIN"; wait_all
T=$(start_at 12)
run_tenant mlp_vgpu_hog trainer 50 VGPU_BURST=1 -- hog --until "$(calc "$T + $LWIN + 1")"
run_tenant mlp_vgpu latency 50 VGPU_BURST=1 -- mlp --start-at "$T" --window "$LWIN"; wait_all
for case in alone plain vgpu; do
  record "latency MLP p50/p99 ms ($case)" "-" "$(field "$LOGS/mlp_$case.log" p50_ms)/$(field "$LOGS/mlp_$case.log" p99_ms)" INFO
done
for case in plain vgpu; do
  record "trainer matmuls in latency run ($case)" "-" "$(field "$LOGS/mlp_${case}_hog.log" matmuls)" INFO
done

grep -h "vgpu\[" "$LOGS"/*.log | sed -E 's/vgpu\[[0-9]*\]( [0-9:.]+)?/vgpu[pid]/' | sort | uniq -c | sort -rn | head -20 >"$LOGS/interposer_messages.txt"
echo
echo "interposer messages (top): $(wc -l <"$LOGS/interposer_messages.txt") distinct"
head -5 "$LOGS/interposer_messages.txt"
echo
printf '%-90s | %-14s | %-24s | %s\n' check target got verdict
printf '%s\n' "$(printf -- '-%.0s' {1..145})"
while IFS=$'\t' read -r check target got verdict; do
  printf '%-90s | %-14s | %-24s | %s\n' "$check" "$target" "$got" "$verdict"
done <"$RESULTS"
! grep -q $'\tFAIL$' "$RESULTS"
