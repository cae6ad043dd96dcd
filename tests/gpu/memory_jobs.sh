#!/usr/bin/env bash
# Issue 17's second check on a real GPU: three training jobs whose footprints add up to 1.5x the
# GPU's memory (tests/gpu/memory_jobs.py: Adam on a stack of linear layers, seeded and
# deterministic; each footprint of weights and Adam's state FOOT_PCT, default 42, % of the card
# from nvidia-smi: with PyTorch's temporaries each job's peak is about 1.2x that, so that the three
# peaks add up to about 1.5x the card). One run,
# three phases:
#   1. alone: each job alone, one after another, without vgpu: its result digest and seconds, and
#      the serial total;
#   2. plain: the three at once without vgpu (what hard limits give: the GPU has room for two, so
#      at least one fails with out of memory);
#   3. vgpu: the three at once through vgpu (vgpu-cp and vgpu-agent on loopback, the swap on as by default),
#      each placed with a request of REQUEST_PCT (20) % of the card and a limit of the largest
#      peak the jobs had alone (PyTorch's max_memory_reserved) plus LIMIT_MARGIN_GIB (3) for the
#      context, in whole GiB (a limit from the model's size alone was too small: Adam's
#      temporaries are not in it, and every job hit its limit), and a compute share of 30% with
#      `--burst` (COMPUTE_FLAGS: without it each job is capped at 30% of the GPU's time even while
#      the others wait, which measures the compute cap, not the memory): all three must finish
#      with the digests they had alone (the GPU's line: docs/design/elastic-memory.md). The table
#      compares the total time with the serial total.
# ALONE_LOGS=DIR reuses an earlier run's alone phase (DIR/alone-<i>.log and DIR/serial_s, from the
# same machine and settings) and PLAIN=0 skips the plain phase: the vgpu phase again in about
# 2 minutes of device time. Never allocates managed memory. Run from the repository root with release binaries built
# elsewhere (VGPU_BIN, default dist: vgpu-cp, vgpu-agent, vgpuctl, libvgpu_cuda.so); PY (default
# /opt/torch/.venv/bin/python3, else python3) must have PyTorch with CUDA. Logs go to
# $OUT/memory_jobs (or a temporary directory); the result table is printed last. Exit status 0
# when every check passed. About 3-5 minutes on an H200 with the defaults (STEPS=100: about 18 s
# of training per job alone, so that the jobs overlap through vgpu; with 30 steps each job's
# start (about 8 s of Python and CUDA) was longer than its training, and the jobs through vgpu
# ran almost one after another without a reclaim).
#
#   VGPU_BIN=dist tests/gpu/memory_jobs.sh
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
# shellcheck source=tests/gpu/node.sh
source "$ROOT/tests/gpu/node.sh"
gpu_paths
JOB="$ROOT/tests/gpu/memory_jobs.py"
LOGS="${OUT:-$(mktemp -d)}/memory_jobs"
mkdir -p "$LOGS"
WORK=$(mktemp -d)
EP="127.0.0.1:${VGPU_PORT:-7475}"
SHM=/dev/shm/vgpu-jobs.$$
CP=""
AGENT=""
AGENT_MPS=0
GIB=$((1 << 30))
RESULTS="$LOGS/results.tsv"
FOOT_PCT=${FOOT_PCT:-42}
REQUEST_PCT=${REQUEST_PCT:-20}
STEPS=${STEPS:-100}
JOB_TIMEOUT=${JOB_TIMEOUT:-300}
COMPUTE_FLAGS=${COMPUTE_FLAGS:---burst}
: >"$RESULTS"
PIDS=()
# shellcheck source=tests/gpu/checks.sh
source "$ROOT/tests/gpu/checks.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM
gib() { "$PY" -c 'import sys; print(f"{int(sys.argv[1] or 0)/2**30:.1f} GiB")' "${1:-0}"; }
now() { date +%s.%N; }
elapsed() { "$PY" -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$1" "$2"; }
# wait_jobs PID...: waits for each (each is bounded by its own `timeout`), then forgets it.
wait_jobs() {
  local pid
  for pid in "$@"; do
    wait "$pid" 2>/dev/null
    forget "$pid"
  done
}

for artefact in vgpu-cp vgpu-agent vgpuctl libvgpu_cuda.so; do
  [ -e "$BIN/$artefact" ] || { echo "missing $BIN/$artefact (set VGPU_BIN)" >&2; exit 2; }
done
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -n1 | tr -d ' ')
[ -n "$total_mib" ] || { echo "nvidia-smi gave no memory.total" >&2; exit 2; }
total=$((total_mib << 20))
footprint=$((total * FOOT_PCT / 100))
request=$((total * REQUEST_PCT / 100 / GIB * GIB))
host_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
log "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader -i 0)"
log "three jobs of $(gib $footprint) of weights and Adam's state each ($FOOT_PCT% of $(gib $total)), $STEPS steps"

# 1. Alone, one after another (or, with ALONE_LOGS, an earlier run's alone-<i>.log and serial_s
# on the same machine, to repeat the vgpu phase within less device time).
if [ -n "${ALONE_LOGS:-}" ]; then
  for i in 1 2 3; do cp "$ALONE_LOGS/alone-$i.log" "$LOGS/alone-$i.log" || exit 2; done
  serial=$(cat "$ALONE_LOGS/serial_s") || exit 2
  log "alone: the results of $ALONE_LOGS (serial total $serial s), not run again"
else
  serial_begin=$(now)
  for i in 1 2 3; do
    timeout "$JOB_TIMEOUT" "$PY" "$JOB" "$footprint" "$STEPS" "$i" >"$LOGS/alone-$i.log" 2>&1
    log "alone job $i: $(grep '^RESULT ' "$LOGS/alone-$i.log" | tail -n1)"
  done
  serial=$(elapsed "$serial_begin" "$(now)")
  # for a later ALONE_LOGS run (tests/gpu/memory_jobs_repeat.sh)
  echo "$serial" >"$LOGS/serial_s"
fi
alone_ok=1
for i in 1 2 3; do [ -n "$(field "$LOGS/alone-$i.log" digest)" ] || alone_ok=0; done
peak=0
for i in 1 2 3; do
  p=$(field "$LOGS/alone-$i.log" peak_reserved)
  [ "${p:-0}" -gt "$peak" ] && peak=$p
done
# The limit: the largest peak plus the context's margin, rounded up to whole GiB, at most the card.
limit=$(((peak + ${LIMIT_MARGIN_GIB:-3} * GIB + GIB - 1) / GIB * GIB))
[ "$limit" -le "$total" ] || limit=$total
record "each job alone, one after another: finished, serial total (largest peak)" "3 of 3" \
  "$(for i in 1 2 3; do [ -n "$(field "$LOGS/alone-$i.log" digest)" ] && echo -n "ok " || echo -n "FAILED "; done)in ${serial} s (peak $(gib $peak), $("$PY" -c 'import sys; print(f"{3 * int(sys.argv[1]) / int(sys.argv[2]):.2f}")' "$peak" "$total")x the card for three)" \
  "$(verdict $alone_ok)"
# Host memory for swapped-out memory: at least what the three peaks need beyond the GPU (the
# board's capacity: the card less 2 GiB) plus 8 GiB, at least half the host, at most three
# quarters of it (the jobs' own host memory needs the rest). Too little and the line refuses
# borrows once the swap space is full (rule 6): some job fails with out of memory.
need_gib=$(((3 * peak - (total - 2 * GIB)) / GIB + 8))
swap_gib=$((host_kib / 2 / 1024 / 1024))
[ "$need_gib" -le "$swap_gib" ] || swap_gib=$need_gib
[ "$swap_gib" -le $((host_kib * 3 / 4 / 1024 / 1024)) ] || swap_gib=$((host_kib * 3 / 4 / 1024 / 1024))
log "vgpu: request $(gib $request), limit $(gib $limit), compute 30% ${COMPUTE_FLAGS:-(capped)}, swap host memory ${swap_gib} GiB (the peaks need about ${need_gib} GiB of it)"

# 2. Plain: the three at once, no vgpu (PLAIN=0 skips it).
plain=-
plain_done=-
if [ "${PLAIN:-1}" != 0 ]; then
  plain_begin=$(now)
  pids=()
  for i in 1 2 3; do
    timeout "$JOB_TIMEOUT" "$PY" "$JOB" "$footprint" "$STEPS" "$i" >"$LOGS/plain-$i.log" 2>&1 &
    pids+=("$!")
    PIDS+=("$!")
  done
  wait_jobs "${pids[@]}"
  plain=$(elapsed "$plain_begin" "$(now)")
  plain_done=0
  plain_oom=0
  for i in 1 2 3; do
    [ -n "$(field "$LOGS/plain-$i.log" digest)" ] && plain_done=$((plain_done + 1))
    [ -n "$(field "$LOGS/plain-$i.log" oom)" ] && plain_oom=$((plain_oom + 1))
  done
  record "plain, the three at once (no vgpu): finished / out of memory (the peer)" "some fail" \
    "$plain_done / $plain_oom in ${plain} s" "$(verdict $([ "$plain_oom" -ge 1 ] && echo 1))"
fi

# 3. Through vgpu.
vgpu_cp_up || exit 1
vgpu_agent_up --swap-host-memory "${swap_gib}GiB" || exit 1
for i in 1 2 3; do
  # shellcheck disable=SC2086 # COMPUTE_FLAGS is a list of flags
  timeout 60 "$BIN/vgpuctl" --insecure --endpoints "$EP" place "job$i" --gpus 0.3 --memory "$request" \
    --memory-limit "$limit" $COMPUTE_FLAGS 2>&1 | tee -a "$LOGS/run.log"
done
placed() { for i in 1 2 3; do [ -f "$WORK/agent/tenants/job$i.json" ] || return 1; done; }
bounded_wait 30 "the three jobs placed on the node" placed || { log "the jobs were not placed on the node"; exit 1; }
vgpu_begin=$(now)
pids=()
for i in 1 2 3; do
  VGPU_LOG=${JOBS_VGPU_LOG:-1} timeout "$JOB_TIMEOUT" "$BIN/vgpu-agent" exec --tenant "job$i" --name gpu-node \
    --state-dir "$WORK/agent" --interposer "$BIN/libvgpu_cuda.so" -- \
    "$PY" "$JOB" "$footprint" "$STEPS" "$i" >"$LOGS/vgpu-$i.log" 2>&1 &
  pids+=("$!")
  PIDS+=("$!")
  # One after another, as jobs arrive: each holds its weights before the next starts (bounded:
  # a job waiting in line for room may print it only much later).
  model_built() { grep -q '^MODEL' "$LOGS/vgpu-$1.log" 2>/dev/null; }
  [ "$i" = 3 ] || bounded_wait 60 "job $i to hold its weights" model_built "$i" ||
    log "job $i does not hold its weights yet; the next starts all the same"
done
for i in 1 2 3; do
  timeout 30 "$BIN/vgpuctl" --insecure --endpoints "$EP" describe tenant "job$i" >"$LOGS/describe-job$i-running.txt" 2>&1
done
# A monitor while they run (monitor.log): every MONITOR_S (10) seconds each job's elastic memory
# row and usage (describe) and its threads' states and kernel wait channels; a job still running
# after STALL_S (3x the longest alone run) prints its Python stacks (SIGUSR1, faulthandler) once.
longest=0
for i in 1 2 3; do
  s=$(field "$LOGS/alone-$i.log" seconds)
  s=${s%.*}
  [ "${s:-0}" -gt "$longest" ] && longest=$s
done
STALL_S=${STALL_S:-$((3 * longest + 30))}
monitor() {
  local began=$SECONDS dumped=0 i pid py task
  while :; do
    sleep "${MONITOR_S:-10}"
    echo "--- $(date +%T.%N | cut -c1-12) (+$((SECONDS - began)) s)"
    for i in 1 2 3; do
      timeout 10 "$BIN/vgpuctl" --insecure --endpoints "$EP" describe tenant "job$i" 2>/dev/null |
        awk -v j="job$i" '/^(Usage|Elastic memory):/ {grab = 2; next} grab > 0 && /gpu-node/ {print j ": " $0; grab--}'
      pid=${pids[$((i - 1))]}
      py=$(pgrep -P "$pid" -f memory_jobs.py 2>/dev/null | head -n1)
      [ -n "$py" ] || py=$(pgrep -f "memory_jobs.py $footprint $STEPS $i\$" 2>/dev/null | head -n1)
      [ -n "$py" ] || continue
      for task in /proc/"$py"/task/*; do
        printf '  job%s tid %s %s %s\n' "$i" "${task##*/}" "$(awk '{print $3}' "$task/stat" 2>/dev/null)" \
          "$(cat "$task/wchan" 2>/dev/null)"
      done | sort | uniq -c -f 3 | head -n 12
      if [ "$dumped" = 0 ] && [ $((SECONDS - began)) -ge "$STALL_S" ]; then
        echo "  job$i still runs after ${STALL_S} s: its Python stacks go to vgpu-$i.log"
        kill -USR1 "$py" 2>/dev/null
      fi
    done
    [ $((SECONDS - began)) -ge "$STALL_S" ] && dumped=1
  done
}
monitor >"$LOGS/monitor.log" 2>&1 &
monitor_pid=$!
PIDS+=("$monitor_pid")
wait_jobs "${pids[@]}"
kill "$monitor_pid" 2>/dev/null
wait "$monitor_pid" 2>/dev/null
forget "$monitor_pid"
vgpu=$(elapsed "$vgpu_begin" "$(now)")
vgpu_done=0
same=0
for i in 1 2 3; do
  d=$(field "$LOGS/vgpu-$i.log" digest)
  [ -n "$d" ] && vgpu_done=$((vgpu_done + 1))
  [ -n "$d" ] && [ "$d" = "$(field "$LOGS/alone-$i.log" digest)" ] && same=$((same + 1))
  log "vgpu job $i: $(grep '^RESULT ' "$LOGS/vgpu-$i.log" | tail -n1)"
done
record "through vgpu, the three at once: finished" "3 of 3" "$vgpu_done of 3 in ${vgpu} s" \
  "$(verdict $([ "$vgpu_done" = 3 ] && echo 1))"
record "through vgpu: results identical to alone (digests)" "3 of 3" "$same of 3" \
  "$(verdict $([ "$same" = 3 ] && echo 1))"
# What the swap did: rounds and bytes out and back, over the three jobs' interposer lines.
swaps=$("$PY" - "$LOGS"/vgpu-*.log <<'PYEOF'
import re, sys
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
outs, out_bytes, ins, in_bytes, in_ms = 0, 0.0, 0, 0.0, 0.0
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        m = re.search(r"([0-9.]+) (B|KiB|MiB|GiB|TiB) of this process's borrowed memory went to host memory", line)
        if m:
            outs, out_bytes = outs + 1, out_bytes + float(m.group(1)) * units[m.group(2)]
        m = re.search(r"([0-9.]+) (B|KiB|MiB|GiB|TiB) of this process's borrowed memory came back from host memory in ([0-9.]+) ms", line)
        if m:
            ins, in_bytes, in_ms = ins + 1, in_bytes + float(m.group(1)) * units[m.group(2)], in_ms + float(m.group(3))
print(f"{outs} round(s) out, {out_bytes / 2**30:.1f} GiB; {ins} back, {in_bytes / 2**30:.1f} GiB in {in_ms / 1e3:.2f} s")
PYEOF
)
record "through vgpu: what the swap moved (the jobs' interposer lines)" "reported" "$swaps" PASS
record "total time: vgpu against one after another (and plain)" "reported" \
  "${vgpu} s against ${serial} s (plain ${plain} s, $plain_done finished)" PASS
for i in 1 2 3; do
  timeout 30 "$BIN/vgpuctl" --insecure --endpoints "$EP" describe tenant "job$i" >"$LOGS/describe-job$i.txt" 2>&1
done
log "describe tenant job1 (after):"; tee -a "$LOGS/run.log" <"$LOGS/describe-job1.txt"
log "interposer lines:"; grep -h 'vgpu' "$LOGS"/vgpu-*.log | head -n 30 | tee -a "$LOGS/run.log"
echo
echo "| check | expected | got | result |"
echo "| --- | --- | --- | --- |"
while IFS=$'\t' read -r check expected got result; do
  echo "| $check | $expected | $got | $result |"
done <"$RESULTS"
! grep -q FAIL "$RESULTS"
