#!/usr/bin/env bash
# The latency-guarantee matrix (issue 15: "a latency guarantee that holds on workloads we have not
# tuned for"). Three latency tenants x four neighbours on ONE GPU (tests/gpu/closed_loop.py):
#   latency tenants  decoder (CUDA-graph decoder step, bf16, batch 4), eager (ResNet-18-like CNN,
#                    batch 1, fp16, eager launches, .item()), bert (6 encoder layers, d 1024,
#                    seq 128, batch 8, fp16); each steps, synchronises, sleeps to its next period
#                    (also `launches`, only when PAIRS names it: 400 tiny in-place adds and one
#                    synchronisation a step, the launch path's own cost)
#   neighbours       gemm (bf16 8192^3, TFLOP/s), train (small transformer fwd+bwd+AdamW,
#                    steps/s), stream (3 GiB copies, GB/s), long (bf16 16384^3, ~12 ms kernels,
#                    kernels/s)
# For every pair, in one run, the modes:
#   alone     each latency tenant alone (its p50/p99) and each neighbour alone (its throughput)
#   plain     both as plain processes (the driver's time slicing)
#   mps       both as clients of an MPS daemon started here (pipe and log dirs in the work dir)
#   mps50     the same, the neighbour at CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
#   vgpu-mps  through vgpu: vgpu-cp, `vgpu-agent join --mps`, `vgpuctl place lat-L --gpus 0.08
#             --memory 10GiB --latency` for each latency workload L (each its own tenant, so
#             each has its own learnt target), `vgpuctl place nb --gpus 0.75 --memory 40GiB
#             --burst`, all run with `vgpu-agent exec --tenant lat-L|nb`
#   vgpu-mps-all  the same through an agent with `--mps-tenants all`: the latency tenants MPS
#             clients too (they give up their own fault domain; the neighbours' SMs become a
#             lever), with a fresh agent and MPS daemon, in the same run as vgpu-mps
#   vgpu      the same through an agent without --mps (the default node setting)
#   cost, cost-mps  vgpu's own cost (issue 15, point 7): every workload alone, as a bare process
#             and through vgpu (latency workloads twice: in their latency tenant, and in `be`, a
#             best-effort tenant with --burst, which tells the step measurement's cost from the
#             rest), in ROUNDS interleaved rounds (the arms' order flips every round) so that the
#             machine's drift over a minute falls on both arms alike; through an agent without
#             (cost) or with (cost-mps) --mps. Its own table: per workload and arm, the median
#             over rounds of p50/p99 (or work/s) and of the per-round ratio to bare, with the
#             rounds' range
# The table printed last has one row per (latency, neighbour, mode): p50, p99, p99 against that
# tenant alone, the neighbour's throughput and its ratio to the neighbour alone, and for the vgpu
# rows a verdict: `ok` when p99 <= 1.2x alone AND the neighbour is at least as fast as the best
# of plain/mps/mps50 of that pair that also kept p99 <= 1.2x (or there is none), else `miss`;
# then one summary line per mode. The vgpu rows also show the p99 against the latency tenant's
# target in force (from `vgpuctl describe` during the window; learnt from the tenant's own steps
# unless LAT_TARGETS gives one): how well the controller held what it was asked to hold, apart
# from how the tenant's alone windows moved.
#
# Run from the repository root on a GPU machine (one GPU, MIG off, compute mode Default), with
# the release binaries carried in dist/ (tests/gpu/README.md, "Build and carry"):
#
#   WINDOW=6 VGPU_BIN=dist tests/gpu/closed_loop.sh          # the full matrix, ~8.7 min
#   PAIRS="decoder:gemm decoder:stream eager:train bert:long" VGPU_BIN=dist tests/gpu/closed_loop.sh
#
# Knobs: PAIRS (latency:neighbour ..., default all 12), MODES (default "alone plain mps mps50
# vgpu-mps vgpu"; also vgpu-mps-alone and vgpu-alone: each workload alone through vgpu, its own
# cost against "alone"; mps-out-alone: each alone beside idle MPS clients, the latency workloads
# outside MPS, without vgpu), WINDOW (measured seconds per window, 8), VGPU_WINDOW (the windows of
# the vgpu groups, default WINDOW: a pair's first seconds are the controller's learning, and a
# longer window weighs them as a pair that stays together longer would), SETTLE (seconds a window's processes
# run before it, unmeasured, 0.75), GAP (idle seconds between windows, 0.25), PERIODS (step
# periods in ms, e.g. "eager=6 bert=2.5"; defaults decoder 3, eager 6, bert 4: about twice each step alone on an H100 and an H200;
# before the twenty-fourth session eager 5 and bert 2), VGPU_BIN (dist),
# PIN (1: every workload process runs pinned, the latency workloads to 4 CPUs of the GPU's own
# NUMA node and the neighbours to 4 others of it, in every mode alike; 0: wherever the kernel puts
# them. A launch-bound Python loop's p50 moved 2.2-3.3 ms between processes of one run with the
# CPU it happened to run on, which no ratio between two processes survives), ROUNDS (3, the cost
# modes' rounds), PAIR_ROUNDS (1: the matrix's windows, alone and pairs, once per group; N: N
# rounds in each group, each round's alone windows before its pairs, round r > 1 tagged
# `MODE@r`; the report then takes each pair's ratios per round, against that round's alone
# windows, and shows their median [min-max]: a launch-bound tenant's own p99 moved 1.5-2.2x
# between two alone windows of one call, which no single window's verdict survives),
# LAT_TARGETS (e.g. "decoder=1.3ms eager=4.5ms"; a workload not named has its target learnt from
# its own steps): explicit targets take the learning out of a comparison (the learnt targets of
# eager and bert moved with their 30% noise and with slow spells at Exclusive on an H200),
# PY (python3, or /opt/torch/.venv/bin/python3 where it exists), OUT (/tmp/closed-loop-out),
# VGPU_PORT (7474), MPS_TENANTS (the agent's `--mps-tenants`: non-latency, its default, keeps the
# latency tenants out of MPS; all makes them MPS clients too, with the SM lever), DEADLINE_S (570:
# a group that would end later is skipped, so that the table and the tar still come back inside a
# 10-minute command; 0: never skip. The plan is estimated before anything starts, and a plan that
# would skip a group stops there with exit status 2, unless SKIP_OK=1: a call whose last group is
# skipped spends its device time on the peers alone).
#
# How the device time is kept small: the processes of a mode are started ONCE (a "group") and warm
# up together (import, CUDA context, model, CUDA graph), each touches a ready file, then
# `closed_loop.py schedule` writes back-to-back windows and each process runs only in the windows
# that name it, idle (context and memory kept) in between, and leaves after the group's last one.
# Groups: plain (alone + plain windows), mps (mps + mps50 windows; the mps50 neighbours are
# separate processes), vgpu-mps (agent with --mps), vgpu (the agent restarted without --mps,
# after its MPS daemon was told to quit). The cp is started once, the two tenants placed once;
# every workload is `vgpu-agent exec`ed into the same two tenants. "Alone" thus means the only
# process with work on the GPU: the group's other processes sit idle beside it, as in every mode.
# Time: windows x (SETTLE + WINDOW + GAP) + groups x ~8-10 s (import, warm-up, exit) + ~12 s
# (MPS daemon, cp, agent twice, placement):
#   full matrix, WINDOW=6:  (3 + 4 alone + 12 pairs x 5 modes) = 67 windows x 7.0 s = 469 s
#                           + 4 groups x ~10 s + ~12 s = ~520 s (8.7 min)
#   PAIRS="decoder:gemm decoder:stream eager:train bert:long", WINDOW=6: (3 + 4 + 4 x 5) = 27
#                           windows x 7.0 s = 189 s + ~52 s = ~240 s (4 min); WINDOW=8: ~300 s
#   The full matrix at the default WINDOW=8 needs ~660 s: more than one 10-minute command, so
#   DEADLINE_S skips the groups that would not end in time (vgpu first: the groups run in the
#   order plain, mps, vgpu-mps, vgpu). Run it with WINDOW=6, or split it with MODES.
# Logs: $OUT/closed_loop (one folder per group: one log per process, the schedule, clocks,
# `vgpuctl describe tenant lat|nb` taken during every vgpu window), tarred into
# $OUT/closed_loop.tgz at exit; $OUT/closed_loop keeps only table.txt and results.tsv.
# No GPU setting is changed and nothing is reset; the MPS daemons are told to quit on exit.
# Exit: 0 done, 3 wrong machine (compute mode not Default, or MIG on), 2 usage, 4 windows without
# data, 5 a disturbed baseline (a latency tenant alone with p99 > 2x its p50: the machine was not
# quiet, the ratios of this run are not to be compared; see the "problem:" lines under the table).
# shellcheck disable=SC2317 # cleanup and the wait tests are called indirectly (trap, bounded_wait)
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HELPER="$ROOT/tests/gpu/closed_loop.py"
# forget, bounded_wait, gone, stop_pid, mps_gone; gpu_paths, ctl, vgpu_cp_up, vgpu_agent_up,
# agent_mps_down
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
# shellcheck source=tests/gpu/node.sh
source "$ROOT/tests/gpu/node.sh"
gpu_paths
WINDOW=${WINDOW:-8}
VGPU_WINDOW=${VGPU_WINDOW:-$WINDOW}
SETTLE=${SETTLE:-0.75}
GAP=${GAP:-0.25}
ALL_PAIRS=""
for l in decoder eager bert; do for n in gemm train stream long; do ALL_PAIRS+="$l:$n "; done; done
PAIRS=${PAIRS:-$ALL_PAIRS}
MODES=${MODES:-alone plain mps mps50 vgpu-mps vgpu}
ROUNDS=${ROUNDS:-3}
PAIR_ROUNDS=${PAIR_ROUNDS:-1}
[[ "$PAIR_ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "PAIR_ROUNDS must be a whole number >= 1" >&2; exit 2; }
# the tag of MODE's windows in round R: MODE in the first, MODE@R after
round_tag() { if [ "$2" = 1 ]; then echo "$1"; else echo "$1@$2"; fi; }
PIN=${PIN:-1}
PERIODS=${PERIODS:-}
DEADLINE_S=${DEADLINE_S:-570}
MPS_TENANTS=${MPS_TENANTS:-non-latency}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-120}
OUT=${OUT:-/tmp/closed-loop-out}
LOGS="$OUT/closed_loop"
PORT=${VGPU_PORT:-7474}
EP="127.0.0.1:$PORT"
SHM=/dev/shm/vgpu-closed-loop.$$
export PYTHONUNBUFFERED=1

for m in $MODES; do
  case "$m" in alone | plain | mps | mps50 | vgpu-mps | vgpu-mps-all | vgpu | vgpu-mps-alone | vgpu-mps-all-alone | vgpu-alone | mps-out-alone | cost | cost-mps) ;; *)
    echo "MODES: unknown mode $m (alone plain mps mps50 vgpu-mps vgpu-mps-all vgpu vgpu-mps-alone vgpu-mps-all-alone vgpu-alone mps-out-alone cost cost-mps)" >&2
    exit 2
    ;;
  esac
done
LATS=()
NBS=()
for p in $PAIRS; do
  l=${p%%:*}
  n=${p#*:}
  case "$l" in decoder | eager | bert | launches) ;; *) echo "PAIRS: unknown latency tenant in $p" >&2; exit 2 ;; esac
  case "$n" in gemm | train | stream | long) ;; *) echo "PAIRS: unknown neighbour in $p" >&2; exit 2 ;; esac
  [[ " ${LATS[*]} " == *" $l "* ]] || LATS+=("$l")
  [[ " ${NBS[*]} " == *" $n "* ]] || NBS+=("$n")
done
has_mode() { [[ " $MODES " == *" $1 "* ]]; }
if has_mode vgpu || has_mode vgpu-mps || has_mode vgpu-mps-all || has_mode vgpu-alone || has_mode vgpu-mps-alone || has_mode vgpu-mps-all-alone || has_mode cost || has_mode cost-mps; then
  for f in vgpu-cp vgpu-agent vgpuctl libvgpu_cuda.so; do
    [ -e "$BIN/$f" ] || { echo "$BIN/$f is missing: build and carry it (VGPU_BIN), or leave the vgpu modes out of MODES" >&2; exit 2; }
  done
fi

rm -rf "$LOGS"
mkdir -p "$LOGS"
WORK=$(mktemp -d /tmp/closed-loop.XXXXXX)
MPS_PIPE="$WORK/mps/pipe"
MPS_LOG="$WORK/mps/log"
PIDS=() # every process this script started and has not reaped yet (cp and agent included)
CP=""
AGENT=""
MPS_OWN=0   # our MPS daemon runs
AGENT_MPS=0 # the agent was started with --mps (its daemon outlives it)

cleanup() {
  local rc=$? pid
  trap - EXIT
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [ "$MPS_OWN" = 1 ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
  [ "$AGENT_MPS" = 1 ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$SHM/mps" nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r "$MPS_LOG" "$LOGS/mps-log" 2>/dev/null
  cp -r "$WORK/agent/mps-log" "$LOGS/agent-mps-log" 2>/dev/null
  rm -rf "$WORK" "$SHM"
  # one file back: the tar; beside it only the table and the results
  if tar -czf "$OUT/closed_loop.tgz" -C "$OUT" closed_loop 2>/dev/null; then
    find "$LOGS" -mindepth 1 -maxdepth 1 ! -name table.txt ! -name results.tsv -exec rm -rf {} +
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
window_of() { # window_of GROUP: its window in seconds (VGPU_WINDOW for the vgpu groups)
  case "$1" in vgpu | vgpu-mps | vgpu-mps-all) echo "$VGPU_WINDOW" ;; *) echo "$WINDOW" ;; esac
}
group_s() { # group_s WINDOWS [WINDOW_S]: the estimated seconds of a group (warm-up and exit ~8 s)
  awk -v n="$1" -v w="${2:-$WINDOW}" -v s="$SETTLE" -v g="$GAP" 'BEGIN { printf "%d", n * (s + w + g) + 8 }'
}
fits() { # fits NAME WINDOWS EXTRA_S: whether the group ends before DEADLINE_S (else a message)
  local est
  est=$(($(group_s "$2" "$(window_of "$1")") + $3))
  [ "$DEADLINE_S" = 0 ] || [ $((SECONDS + est)) -le "$DEADLINE_S" ] && return 0
  log "$1: SKIPPED: $2 windows, ~${est}s, would end after DEADLINE_S=$DEADLINE_S (now ${SECONDS}s)"
  return 1
}
# seconds from now until REF (a `date +%s.%N`) + OFFSET, never negative
until_rel() { awk -v r="$1" -v o="$2" -v n="$(date +%s.%N)" 'BEGIN { d = r + o - n; printf "%.3f\n", (d > 0 ? d : 0) }'; }
period_of() { # period_of WORKLOAD: its step period in ms from PERIODS, or nothing
  local kv
  for kv in $PERIODS; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done
  return 0
}

# ---------------------------------------------------------------- one group of processes

# run_group NAME: starts every process of GROUP_PROCS ("id workload how"; how: plain, mps, mps50,
# vgpu:TENANT), waits for each to be warm, writes the schedule of GROUP_WINS ("tag=id,id"), takes
# `vgpuctl describe` during the windows of a vgpu group, and waits for the processes to leave.
run_group() {
  local name=$1 G="$LOGS/$1" spec id wl how tenant pid i t_ref sched_out per
  local gp=() gid=() gw
  gw=$(window_of "$name")
  mkdir -p "$G"
  fits "$name" "${#GROUP_WINS[@]}" 0 || return 1
  log "$name: ${#GROUP_PROCS[@]} processes, ${#GROUP_WINS[@]} windows of ${gw}s (~$(group_s "${#GROUP_WINS[@]}" "$gw")s)"
  for spec in "${GROUP_PROCS[@]}"; do
    read -r id wl how <<<"$spec"
    local args=("$HELPER" "$wl" --name "$id" --schedule "$G/schedule.json" --ready "$G/ready.$id")
    per=$(period_of "$wl")
    [ -n "$per" ] && args+=(--period-ms "$per")
    local pin=()
    if [[ " ${LATS[*]} " == *" $wl "* ]]; then
      [ -n "$LAT_CPUS" ] && pin=(taskset -c "$LAT_CPUS")
    else
      [ -n "$NB_CPUS" ] && pin=(taskset -c "$NB_CPUS")
    fi
    case "$how" in
    plain) "${pin[@]}" "$PY" "${args[@]}" >"$G/$id.log" 2>&1 & ;;
    mps) CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" "${pin[@]}" "$PY" "${args[@]}" >"$G/$id.log" 2>&1 & ;;
    mps50) CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 \
      "${pin[@]}" "$PY" "${args[@]}" >"$G/$id.log" 2>&1 & ;;
    vgpu:*)
      tenant=${how#vgpu:}
      VGPU_LOG="${VGPU_LOG:-2}" "${pin[@]}" "${EXEC[@]}" --tenant "$tenant" -- "$PY" "${args[@]}" >"$G/$id.log" 2>&1 &
      ;;
    esac
    pid=$!
    PIDS+=("$pid")
    gp+=("$pid")
    gid+=("$id")
  done
  # what the GPU's clocks and power did meanwhile (read only), to tell a throttled run apart
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 500 >"$G/clocks.csv" 2>/dev/null &
  local sampler=$!
  PIDS+=("$sampler")

  # every process warm (ready file) or gone
  # the cost groups start 17 processes, 9 of them pinned to 4 CPUs (PIN): importing PyTorch
  # there took more than 120 s on an H200 machine
  local ready_s=$READY_TIMEOUT_S
  case "$name" in cost | cost-mps) [ "$ready_s" -ge 300 ] || ready_s=300 ;; esac
  local deadline=$((SECONDS + ready_s)) pending
  while :; do
    pending=()
    for i in "${!gp[@]}"; do
      [ -e "$G/ready.${gid[$i]}" ] || gone "${gp[$i]}" || pending+=("${gid[$i]}")
    done
    [ ${#pending[@]} = 0 ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$name: not warm after ${ready_s}s: ${pending[*]}; scheduling without them (they start late)"
      break
    fi
    sleep 0.1
  done
  for i in "${!gp[@]}"; do
    if [ ! -e "$G/ready.${gid[$i]}" ] && gone "${gp[$i]}"; then
      log "$name: ${gid[$i]} exited during its warm-up; its log ends:"
      tail -n 5 "$G/${gid[$i]}.log" | sed 's/^/    /' | tee -a "$LOGS/run.log"
    fi
  done
  log "$name: warm after $((SECONDS - deadline + ready_s))s"

  sched_out=$("$PY" "$HELPER" schedule --out "$G/schedule.json" --window "$gw" --settle "$SETTLE" \
    --gap "$GAP" "${GROUP_WINS[@]}")
  t_ref=$(date +%s.%N)
  echo "$sched_out" >"$G/schedule.txt"
  local tag off last_end=0
  while read -r tag off; do
    [ -n "$tag" ] || continue
    last_end=$(awk -v o="$off" -v w="$gw" 'BEGIN { print o + w }')
    if [ "$name" = vgpu ] || [ "$name" = vgpu-mps ] || [ "$name" = vgpu-mps-all ]; then
      # the agent's view of the pair, near the end of its window
      sleep "$(until_rel "$t_ref" "$(awk -v o="$off" -v w="$gw" 'BEGIN { print o + w - 1 }')")"
      local l=${tag#*:}
      l=${l%%:*}
      { ctl describe tenant "lat-$l"; echo; ctl describe tenant nb; } >"$G/describe.${tag//:/_}.txt" 2>&1
    fi
  done <<<"$sched_out"
  sleep "$(until_rel "$t_ref" "$last_end")"
  # the processes leave right after the last window; bound the wait for stragglers
  local left=()
  for i in "${!gp[@]}"; do
    if ! bounded_wait 60 "${gid[$i]} to leave after the last window" gone "${gp[$i]}"; then
      left+=("${gid[$i]}")
      kill -9 "${gp[$i]}" 2>/dev/null
    fi
    wait "${gp[$i]}" 2>/dev/null
    forget "${gp[$i]}"
  done
  [ ${#left[@]} -gt 0 ] && log "$name: killed after the bound: ${left[*]}"
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  forget "$sampler"
  log "$name: GPU meanwhile: $("$PY" - "$G/clocks.csv" <<'PYEOF'
import statistics, sys
rows = [l.split(",") for l in open(sys.argv[1]) if l.count(",") == 4]
try:
    sm = [float(r[1]) for r in rows]
    watts = [float(r[2]) for r in rows]
    reasons = sorted({r[4].strip() for r in rows})
    print(f"SM clock median {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), power max {max(watts):.0f} W, clock event reasons {reasons}")
except (ValueError, statistics.StatisticsError):
    print("no clock samples")
PYEOF
)"
  # every window's line of every process, in time order
  grep -h '^\[[0-9.]*\] [a-z0-9-]*:[a-z0-9-]*:[a-z0-9-]*: ' "$G"/*.log 2>/dev/null | sort -t']' -k1,1 | sed 's/^/    /' >>"$LOGS/run.log"
  return 0
}

# ---------------------------------------------------------------- MPS and vgpu

mps_start() {
  mkdir -p "$MPS_PIPE" "$MPS_LOG"
  if CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$MPS_LOG" nvidia-cuda-mps-control -d; then
    MPS_OWN=1
    bounded_wait 10 "the MPS daemon's control pipe" test -e "$MPS_PIPE/control"
  else
    log "nvidia-cuda-mps-control -d failed"
    return 1
  fi
}
mps_stop() {
  [ "$MPS_OWN" = 1 ] || return 0
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" nvidia-cuda-mps-control >/dev/null 2>&1
  MPS_OWN=0
  # its server must be gone before the agent's daemon starts one
  bounded_wait 15 "the MPS daemon and server to quit" mps_gone
}

PLACED=0
vgpu_up() { # vgpu_up [--mps]: cp once, the agent in the wanted mode, the two tenants placed once
  vgpu_cp_up || return 1
  vgpu_agent_up --mps-tenants "$MPS_TENANTS" "$@" || return 1
  # one latency tenant per latency workload: each has its own target, learnt from its own steps
  if [ "$PLACED" = 0 ]; then
    for l in "${LATS[@]}"; do
      local target=() kv
      for kv in ${LAT_TARGETS:-}; do [ "${kv%%=*}" = "$l" ] && target=(--latency-target "${kv#*=}"); done
      ctl place "lat-$l" --gpus 0.08 --memory 10GiB --latency "${target[@]}" 2>&1 | tee -a "$LOGS/run.log"
    done
    # with the cost modes' best-effort tenant beside, the neighbour's share leaves it room (a
    # burst tenant alone uses the whole GPU whatever its share)
    local nb_gpus=0.75
    if has_mode cost || has_mode cost-mps; then nb_gpus=0.6; fi
    ctl place nb --gpus "$nb_gpus" --memory 40GiB --burst 2>&1 | tee -a "$LOGS/run.log"
    if has_mode cost || has_mode cost-mps; then
      # the latency workloads once more as best effort (burst: alone it may use the whole GPU)
      ctl place be --gpus 0.08 --memory 20GiB --burst 2>&1 | tee -a "$LOGS/run.log"
    fi
    PLACED=1
  fi
  local t
  local tenants=("${LATS[@]/#/lat-}" nb)
  if has_mode cost || has_mode cost-mps; then tenants+=(be); fi
  for t in "${tenants[@]}"; do
    bounded_wait 15 "tenant $t's private directory ($SHM/tenants/$t/nccl-activity)" \
      test -e "$SHM/tenants/$t/nccl-activity" || return 1
  done
  for t in "${tenants[@]}"; do
    ctl describe tenant "$t" >"$LOGS/describe-$t${1:-}.txt" 2>&1
  done
}

# ---------------------------------------------------------------- the run

gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv,noheader 2>&1 | head -n1)
log "machine: $gpu"
log "python: $PY; binaries: $BIN; pairs: $PAIRS; modes: $MODES; WINDOW=$WINDOW VGPU_WINDOW=$VGPU_WINDOW SETTLE=$SETTLE GAP=$GAP PERIODS='$PERIODS'"
cmode=$(echo "$gpu" | awk -F', *' '{ print $3 }')
mig=$(echo "$gpu" | awk -F', *' '{ print $4 }')
if [ "$cmode" != Default ] || [ "$mig" = Enabled ]; then
  log "this needs one GPU in compute mode Default with MIG off (compute mode '$cmode', MIG '$mig'); no setting is changed here, stopping"
  exit 3
fi
# PIN: 4 CPUs of the GPU's NUMA node for the latency workloads, 4 others for the neighbours
LAT_CPUS=""
NB_CPUS=""
if [ "$PIN" = 1 ]; then
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 2>/dev/null | head -n1 | tr -d ' ' | tr 'A-F' 'a-f')
  local_list=$(cat "/sys/bus/pci/devices/${bus#0000}/local_cpulist" 2>/dev/null ||
    cat "/sys/bus/pci/devices/${bus:4}/local_cpulist" 2>/dev/null)
  # the list (e.g. 0-47,96-143) expanded, the CPUs this script may use
  cpus=$("$PY" - "$local_list" <<'PYEOF'
import os, sys
allowed = os.sched_getaffinity(0)
cpus = []
for part in (sys.argv[1] or "").split(","):
    if "-" in part:
        a, b = part.split("-")
        cpus += range(int(a), int(b) + 1)
    elif part.strip():
        cpus.append(int(part))
cpus = [c for c in cpus if c in allowed] or sorted(allowed)
print(" ".join(map(str, cpus)))
PYEOF
)
  read -ra cpu_arr <<<"$cpus"
  if [ "${#cpu_arr[@]}" -ge 8 ]; then
    LAT_CPUS=$(IFS=,; echo "${cpu_arr[*]:0:4}")
    NB_CPUS=$(IFS=,; echo "${cpu_arr[*]:4:4}")
  else
    log "PIN=1: only ${#cpu_arr[@]} CPUs near the GPU ('$local_list'); not pinning"
  fi
fi
log "pinning: latency workloads to CPUs '${LAT_CPUS:-any}', neighbours to '${NB_CPUS:-any}' (PIN=$PIN)"
n_pairs=$(echo "$PAIRS" | wc -w)
n_win=0
has_mode alone && n_win=$((n_win + PAIR_ROUNDS * (${#LATS[@]} + ${#NBS[@]}) + ${#LATS[@]}))
for m in plain mps mps50 vgpu-mps vgpu-mps-all vgpu; do has_mode "$m" && n_win=$((n_win + PAIR_ROUNDS * n_pairs)); done
for m in vgpu-mps-alone vgpu-mps-all-alone vgpu-alone; do has_mode "$m" && n_win=$((n_win + PAIR_ROUNDS * (${#LATS[@]} + ${#NBS[@]}))); done
for m in cost cost-mps; do has_mode "$m" && n_win=$((n_win + ROUNDS * (3 * ${#LATS[@]} + 2 * ${#NBS[@]}))); done
log "plan: $n_win windows of ${WINDOW}s (the vgpu groups' ${VGPU_WINDOW}s) (+${SETTLE}s settle, ${GAP}s gap): ~$(awk -v n="$n_win" -v w="$WINDOW" -v s="$SETTLE" -v g="$GAP" 'BEGIN { printf "%d", n * (s + w + g) }')s of windows, plus ~8s per group"

# The groups' estimated seconds, in the order they run: a group that would end past DEADLINE_S is
# skipped when its turn comes, which wastes the device time of the groups before it when the one
# that matters is the one skipped. So the plan is checked now, before anything starts.
n_lat=${#LATS[@]}
n_nb=${#NBS[@]}
plan_total=12 # the MPS daemon, the cp, the agent twice, the placements
plan_skipped=()
plan_group() { # plan_group NAME WINDOWS: adds the group's estimate to the plan
  [ "$2" -gt 0 ] || return 0
  local est
  est=$(($(group_s "$2" "$(window_of "$1")") + 10))
  plan_total=$((plan_total + est))
  log "plan: group $1, $2 windows, ~${est}s (ends at ~${plan_total}s)"
  if [ "$DEADLINE_S" != 0 ] && [ "$plan_total" -gt "$DEADLINE_S" ]; then plan_skipped+=("$1"); fi
}
w=0
has_mode alone && w=$((w + PAIR_ROUNDS * (n_lat + n_nb) + n_lat))
has_mode plain && w=$((w + PAIR_ROUNDS * n_pairs))
plan_group plain "$w"
w=0
for m in mps mps50; do has_mode "$m" && w=$((w + PAIR_ROUNDS * n_pairs)); done
plan_group mps "$w"
has_mode mps-out-alone && plan_group mps-out $((n_lat + n_nb))
for g in vgpu-mps vgpu-mps-all vgpu; do
  w=0
  has_mode "$g-alone" && w=$((w + PAIR_ROUNDS * (n_lat + n_nb)))
  has_mode "$g" && w=$((w + PAIR_ROUNDS * n_pairs))
  plan_group "$g" "$w"
done
for g in cost cost-mps; do
  w=0
  has_mode "$g" && w=$((ROUNDS * (3 * n_lat + 2 * n_nb)))
  plan_group "$g" "$w"
done
if [ "${#plan_skipped[@]}" -gt 0 ]; then
  log "plan: ~${plan_total}s in all, past DEADLINE_S=$DEADLINE_S: ${plan_skipped[*]} would be skipped"
  if [ "${SKIP_OK:-0}" != 1 ]; then
    log "not starting: raise DEADLINE_S (and the caller's time limit), run fewer MODES or PAIRS, \
or set SKIP_OK=1 to run what fits"
    exit 2
  fi
fi

# plain: the alone windows and the plain pairs
GROUP_PROCS=()
GROUP_WINS=()
if has_mode alone || has_mode plain; then
  for l in "${LATS[@]}"; do GROUP_PROCS+=("$l $l plain"); done
  for n in "${NBS[@]}"; do GROUP_PROCS+=("$n $n plain"); done
  for r in $(seq 1 "$PAIR_ROUNDS"); do
    if has_mode alone; then
      for l in "${LATS[@]}"; do GROUP_WINS+=("$(round_tag alone "$r"):$l:-=$l"); done
      for n in "${NBS[@]}"; do GROUP_WINS+=("$(round_tag alone "$r"):-:$n=$n"); done
    fi
    if has_mode plain; then
      for p in $PAIRS; do GROUP_WINS+=("$(round_tag plain "$r"):$p=${p%%:*},${p#*:}"); done
    fi
  done
  # each latency tenant alone once more at the end: the quieter of its two alone windows is its
  # baseline (the first ones, right after the warm-up, were slow in their first seconds in every
  # call of the eleventh session for eager and bert)
  if has_mode alone; then
    for l in "${LATS[@]}"; do GROUP_WINS+=("alone2:$l:-=$l"); done
  fi
  run_group plain
fi

# mps: both as MPS clients; mps50: the neighbour at 50% of the SMs (processes of their own)
if has_mode mps || has_mode mps50; then
  GROUP_PROCS=()
  GROUP_WINS=()
  for l in "${LATS[@]}"; do GROUP_PROCS+=("$l $l mps"); done
  has_mode mps && for n in "${NBS[@]}"; do GROUP_PROCS+=("$n $n mps"); done
  has_mode mps50 && for n in "${NBS[@]}"; do GROUP_PROCS+=("$n-50 $n mps50"); done
  for r in $(seq 1 "$PAIR_ROUNDS"); do
    if has_mode mps; then
      for p in $PAIRS; do GROUP_WINS+=("$(round_tag mps "$r"):$p=${p%%:*},${p#*:}"); done
    fi
    if has_mode mps50; then
      for p in $PAIRS; do GROUP_WINS+=("$(round_tag mps50 "$r"):$p=${p%%:*},${p#*:}-50"); done
    fi
  done
  mps_start && run_group mps
  mps_stop
fi

# mps-out-alone: each workload alone, the latency workloads as plain processes while the
# neighbours are MPS clients of a daemon started here (idle, their contexts kept), and each
# neighbour alone as an MPS client beside them: what an MPS node costs a latency tenant kept out of
# MPS (the agent's default with --mps), without vgpu. Measured through vgpu, eager's window alone
# was 1.25-1.37x its plain alone (vgpu-mps-alone, sixteenth and twenty-third sessions).
if has_mode mps-out-alone; then
  GROUP_PROCS=()
  GROUP_WINS=()
  for l in "${LATS[@]}"; do GROUP_PROCS+=("$l $l plain"); done
  for n in "${NBS[@]}"; do GROUP_PROCS+=("$n $n mps"); done
  for l in "${LATS[@]}"; do GROUP_WINS+=("mps-out-alone:$l:-=$l"); done
  for n in "${NBS[@]}"; do GROUP_WINS+=("mps-out-alone:-:$n=$n"); done
  mps_start && run_group mps-out
  mps_stop
fi

export VGPU_AGENT_MPS_TENANTS="$MPS_TENANTS"
EXEC_BASE=("$BIN/vgpu-agent" exec --name gpu-node --state-dir "$WORK/agent" --shm-dir "$SHM"
  --interposer "$BIN/libvgpu_cuda.so")
vgpu_group() { # vgpu_group MODE: the pairs through the agent (vgpu: without MPS, vgpu-mps: with)
  local t
  for t in "${LATS[@]/#/lat-}" nb; do
    "${EXEC[@]:0:2}" "$BIN/vgpu-agent" env --tenant "$t" --name gpu-node --state-dir "$WORK/agent" \
      --shm-dir "$SHM" >"$LOGS/env-$t-$1.txt" 2>&1
  done
  GROUP_PROCS=()
  GROUP_WINS=()
  for l in "${LATS[@]}"; do GROUP_PROCS+=("$l $l vgpu:lat-$l"); done
  for n in "${NBS[@]}"; do GROUP_PROCS+=("$n $n vgpu:nb"); done
  # each workload alone through vgpu first (vgpu's own cost), then the pairs, each round
  local r
  for r in $(seq 1 "$PAIR_ROUNDS"); do
    if has_mode "$1-alone"; then
      for l in "${LATS[@]}"; do GROUP_WINS+=("$(round_tag "$1-alone" "$r"):$l:-=$l"); done
      for n in "${NBS[@]}"; do GROUP_WINS+=("$(round_tag "$1-alone" "$r"):-:$n=$n"); done
    fi
    if has_mode "$1"; then
      for p in $PAIRS; do GROUP_WINS+=("$(round_tag "$1" "$r"):$p=${p%%:*},${p#*:}"); done
    fi
  done
  run_group "$1"
}
# with MPS first (the mode that matters most comes before the deadline can bite); `exec` and `env`
# read the node's settings like the agent, hence VGPU_AGENT_MPS beside them
if { has_mode vgpu-mps || has_mode vgpu-mps-alone; } && fits vgpu-mps "$((PAIR_ROUNDS * n_pairs))" 8; then
  EXEC=(env VGPU_AGENT_MPS=true "${EXEC_BASE[@]}")
  if vgpu_up --mps; then
    vgpu_group vgpu-mps
  else
    log "vgpu-mps: the control plane or agent did not come up (cp.log, agent.log); mode skipped"
  fi
fi
# vgpu-mps-all: the same with the latency tenants MPS clients too (`--mps-tenants all`: they
# share the neighbours' fault domain, and the neighbours' SMs become a lever), through a fresh
# agent and MPS daemon, in the same run as vgpu-mps and the peers
if { has_mode vgpu-mps-all || has_mode vgpu-mps-all-alone; } && fits vgpu-mps-all "$((PAIR_ROUNDS * n_pairs))" 8; then
  EXEC=(env VGPU_AGENT_MPS=true VGPU_AGENT_MPS_TENANTS=all "${EXEC_BASE[@]}")
  [ "$AGENT_MPS" = 1 ] && agent_mps_down
  if MPS_TENANTS=all vgpu_up --mps; then
    AGENT_ALL=1
    vgpu_group vgpu-mps-all
  else
    log "vgpu-mps-all: the control plane or agent did not come up (cp.log, agent.log); mode skipped"
  fi
fi
if { has_mode vgpu || has_mode vgpu-alone; } && fits vgpu "$((PAIR_ROUNDS * n_pairs))" 8; then
  EXEC=(env VGPU_AGENT_MPS=false "${EXEC_BASE[@]}")
  if [ "$AGENT_MPS" = 1 ]; then
    # no tenant process is left: the agent without --mps shares the GPU by turns only
    agent_mps_down
  fi
  if vgpu_up; then
    vgpu_group vgpu
  else
    log "vgpu: the control plane or agent did not come up (cp.log, agent.log); mode skipped"
  fi
fi
# vgpu's own cost: each workload alone, bare and through vgpu by turns (see the header)
cost_group() { # cost_group MODE
  local r w a arms
  GROUP_PROCS=()
  GROUP_WINS=()
  for l in "${LATS[@]}"; do GROUP_PROCS+=("$l-bare $l plain" "$l-vgpu $l vgpu:lat-$l" "$l-be $l vgpu:be"); done
  for n in "${NBS[@]}"; do GROUP_PROCS+=("$n-bare $n plain" "$n-vgpu $n vgpu:nb"); done
  for r in $(seq 1 "$ROUNDS"); do
    for w in "${LATS[@]}" "${NBS[@]}"; do
      if [[ " ${LATS[*]} " == *" $w "* ]]; then arms="bare vgpu be"; else arms="bare vgpu"; fi
      # the order flips every round: neither arm is always the one right after the other
      [ $((r % 2)) = 0 ] && arms=$(echo "$arms" | tr ' ' '\n' | tac | tr '\n' ' ')
      for a in $arms; do GROUP_WINS+=("$1:r$r-$a:$w=$w-$a"); done
    done
  done
  run_group "$1"
}
for m in cost-mps cost; do
  has_mode "$m" || continue
  if [ "$m" = cost-mps ]; then
    EXEC=(env VGPU_AGENT_MPS=true "${EXEC_BASE[@]}")
    # the vgpu-mps group's agent, when it ran, is the one wanted here (not vgpu-mps-all's)
    if [ "${AGENT_ALL:-0}" = 1 ]; then
      agent_mps_down
      AGENT_ALL=0
    fi
    if [ "$AGENT_MPS" != 1 ]; then
      vgpu_up --mps || { log "$m: the control plane or agent did not come up; mode skipped"; continue; }
    fi
  else
    EXEC=(env VGPU_AGENT_MPS=false "${EXEC_BASE[@]}")
    [ "$AGENT_MPS" = 1 ] && agent_mps_down
    vgpu_up || { log "$m: the control plane or agent did not come up; mode skipped"; continue; }
  fi
  cost_group "$m"
done
[ -n "$AGENT" ] && stop_pid "$AGENT"
[ -n "$CP" ] && stop_pid "$CP"

log "done after ${SECONDS}s"
echo
rc=0
matrix_modes=$(for m in $MODES; do case "$m" in cost | cost-mps) ;; *) echo "$m" ;; esac; done | xargs)
if [ -n "$matrix_modes" ]; then
  "$PY" "$HELPER" report --logs "$LOGS" --pairs "$PAIRS" --modes "$matrix_modes" --window "$WINDOW" \
    --vgpu-window "$VGPU_WINDOW" --rounds "$PAIR_ROUNDS"
  rc=$?
fi
if has_mode cost || has_mode cost-mps; then
  echo
  "$PY" "$HELPER" cost-report --logs "$LOGS" || [ "$rc" != 0 ] || rc=$?
fi
exit "$rc"
