#!/usr/bin/env bash
# Usage and health reporting on a real GPU node: vgpu-cp and vgpu-agent (NVML) on loopback, one
# tenant placed with vgpuctl, a PyTorch workload started with `vgpu-agent exec` (interposer
# preloaded) that holds 3 GiB and runs fp16 matmuls for ~12 s. While it runs and after it ends,
# `vgpuctl describe tenant`, `vgpuctl describe node` and the leader's /metrics must show its
# memory and GPU time and the GPU's health (real NVML values). Run from the repository root with
# release binaries built elsewhere:
#
#   cargo build --release -p vgpu-cp -p vgpu-agent -p vgpuctl -p interposer
#   tests/gpu/usage.sh          # VGPU_BIN=dir of the binaries (default target/release)
#
# Logs go to $OUT/usage (or a temporary directory); a result table is printed last.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="${VGPU_BIN:-$ROOT/target/release}"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
HELPER="$ROOT/tests/gpu/usage.py"
LOGS="${OUT:-$(mktemp -d)}/usage"
mkdir -p "$LOGS"
WORK=$(mktemp -d)
PORT=${VGPU_PORT:-7472}
EP="127.0.0.1:$PORT"
export VGPU_AGENT_SHM_DIR=/dev/shm/vgpu-usage
RESULTS="$LOGS/results.tsv"
: >"$RESULTS"
PIDS=()
cleanup() {
  # every background job of this script, tracked in PIDS or not (a build, a sampler), and then
  # a wait for exactly those: a bare `wait` would block on anything left running
  local pid left
  left=$(jobs -p)
  for pid in "${PIDS[@]}" $left; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}" $left; do wait "$pid" 2>/dev/null; done
  rm -rf "$WORK" "$VGPU_AGENT_SHM_DIR"
}
trap cleanup EXIT
log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"; log "$4: $1 (expected $2, got $3)"; }
verdict() { if [ "${1:-}" = 1 ]; then echo PASS; else echo FAIL; fi; }
ctl() { "$BIN/vgpuctl" --insecure --endpoints "$EP" "$@"; }
# usage_field FIELD: the tenant's first usage entry, from `describe tenant -o json`.
usage_field() { ctl describe tenant train -o json 2>/dev/null | "$PY" -c 'import json,sys; u=json.load(sys.stdin).get("usage") or [{}]; print(u[0].get(sys.argv[1], ""))' "$1"; }
metrics_text() { "$PY" -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "http://$EP/metrics"; }
metric() { metrics_text | grep "^$1{" | head -n1 | awk '{print $2}'; }

log "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n1)"
"$BIN/vgpu-cp" bootstrap --insecure --id 1 --listen "$EP" --data-dir "$WORK/cp" 2>"$LOGS/cp.log" &
PIDS+=($!)
for _ in $(seq 100); do ctl cluster status >/dev/null 2>&1 && break; sleep 0.1; done
"$BIN/vgpu-agent" join --insecure --control-plane "$EP" --name gpu-node --state-dir "$WORK/agent" \
  --cdi-dir "$WORK/cdi" 2>"$LOGS/agent.log" &
PIDS+=($!)
for _ in $(seq 100); do ctl get nodes 2>/dev/null | grep -q gpu-node && break; sleep 0.1; done
ctl place train --gpus 0.5 --memory 10GiB 2>&1 | tee -a "$LOGS/run.log"
for _ in $(seq 100); do [ -f "$WORK/agent/tenants/train.json" ] && break; sleep 0.1; done

timeout 300 "$BIN/vgpu-agent" exec --tenant train --name gpu-node --state-dir "$WORK/agent" \
  --interposer "$BIN/libvgpu_cuda.so" -- "$PY" "$HELPER" 3 12 "$WORK/ready" >"$LOGS/workload.log" 2>&1 &
w_pid=$!
PIDS+=($w_pid)
for _ in $(seq 600); do [ -f "$WORK/ready" ] && break; sleep 0.1; done
sleep 4 # two heartbeats with the memory held and turns charged
ctl describe tenant train >"$LOGS/tenant-running.txt" 2>&1
ctl describe node gpu-node >"$LOGS/node-running.txt" 2>&1
metrics_text | grep -E '^vgpu_(tenant|gpu|node_report)' >"$LOGS/metrics-running.txt"
mem_running=$(usage_field memory_used_bytes)
limit=$(usage_field memory_limit_bytes)
time_running=$(usage_field gpu_time_ns)
metric_mem=$(metric vgpu_tenant_memory_bytes)
wait "$w_pid"
sleep 3 # a heartbeat after the exit
ctl describe tenant train >"$LOGS/tenant-after.txt" 2>&1
metrics_text | grep -E '^vgpu_(tenant|gpu|node_report)' >"$LOGS/metrics-after.txt"
mem_after=$(usage_field memory_used_bytes)
time_after=$(usage_field gpu_time_ns)
metric_time=$(metric vgpu_tenant_gpu_time_seconds_total)
loop_s=$(grep '^RESULT ' "$LOGS/workload.log" | sed 's/^RESULT //' | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["loop_seconds"])' 2>/dev/null)

record "memory in use while running (3GiB held + matmul buffers), describe" ">= $((3 << 30)), <= limit" "$mem_running" \
  "$(verdict $([ -n "$mem_running" ] && [ "$mem_running" -ge $((3 << 30)) ] && [ "$mem_running" -le "${limit:-0}" ] && echo 1))"
record "memory limit reported" "$((10 << 30))" "$limit" "$(verdict $([ "$limit" = $((10 << 30)) ] && echo 1))"
record "/metrics vgpu_tenant_memory_bytes while running" "= describe" "$metric_mem" \
  "$(verdict $([ -n "$metric_mem" ] && [ "$metric_mem" -ge $((3 << 30)) ] && echo 1))"
record "GPU time charged while running" "> 0" "${time_running:-}" "$(verdict $([ "${time_running:-0}" -gt 0 ] && echo 1))"
ok_time=$("$PY" -c 'import sys; t=float(sys.argv[1] or 0)/1e9; l=float(sys.argv[2] or 0); print(1 if 0 < t <= l * 1.1 + 0.5 else 0)' "${time_after:-0}" "${loop_s:-0}")
record "GPU time after the run (50% share, no burst; loop ${loop_s}s)" "0 < t <= loop" "$("$PY" -c 'import sys; print(f"{float(sys.argv[1] or 0)/1e9:.2f}s")' "${time_after:-0}")" "$(verdict "$ok_time")"
ok_metric=$("$PY" -c 'import sys; print(1 if sys.argv[1] and abs(float(sys.argv[1]) - float(sys.argv[2] or 0) / 1e9) < 0.05 else 0)' "${metric_time:-}" "${time_after:-0}")
record "/metrics vgpu_tenant_gpu_time_seconds_total after" "= describe" "$metric_time" "$(verdict "$ok_metric")"
record "memory after the process exited" "0" "$mem_after" "$(verdict $([ "$mem_after" = 0 ] && echo 1))"
temp=$(metric vgpu_gpu_temperature_celsius)
record "GPU temperature (NVML)" "a number" "$temp" "$(verdict $([ -n "$temp" ] && echo 1))"
xid=$(grep -c '^vgpu_gpu_xid_errors_total' "$LOGS/metrics-after.txt")
ecc=$(grep -c '^vgpu_gpu_ecc_errors_total' "$LOGS/metrics-after.txt")
unsupported=$(grep -m1 'Health\|XID errors' "$LOGS/node-running.txt")
record "XID/ECC series (or reported unsupported)" "series" "xid=$xid ecc=$ecc" "$(verdict $([ "$((xid + ecc))" -gt 0 ] || [ -n "$unsupported" ] && echo 1))"

log "describe tenant (running):"; cat "$LOGS/tenant-running.txt" | tee -a "$LOGS/run.log"
log "describe node (running):"; cat "$LOGS/node-running.txt" | tee -a "$LOGS/run.log"
log "metrics (after):"; cat "$LOGS/metrics-after.txt" | tee -a "$LOGS/run.log"
echo
echo "| check | expected | got | result |"
echo "| --- | --- | --- | --- |"
while IFS=$'\t' read -r check expected got result; do
  echo "| $check | $expected | $got | $result |"
done <"$RESULTS"
! grep -q FAIL "$RESULTS"
