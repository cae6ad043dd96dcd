#!/usr/bin/env bash
# The whole vgpu stack on a real GPU node: vgpu-cp and vgpu-agent (NVML discovery) on loopback,
# tenants placed with vgpuctl, PyTorch workloads started with `vgpu-agent exec` (which preloads
# libvgpu_cuda.so with the tenant's limits). Run from the repository root on a GPU machine, with
# release binaries built on a development machine and carried along:
#
#   cargo build --release -p vgpu-cp -p vgpu-agent -p vgpuctl -p interposer
#   tests/gpu/stack.sh
#
# Logs go to $OUT/stack (or a temporary directory); a result table is printed last.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="${VGPU_BIN:-$ROOT/target/release}"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
HELPER="$ROOT/tests/gpu/interposer_memory.py"
LOGS="${OUT:-$(mktemp -d)}/stack"
mkdir -p "$LOGS"
WORK=$(mktemp -d)
PORT=${VGPU_PORT:-7471}
EP="127.0.0.1:$PORT"
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
  rm -rf "$WORK" /dev/shm/vgpu-stack
}
trap cleanup EXIT
log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"; log "$4: $1 (expected $2, got $3)"; }
verdict() { if [ "${1:-}" = 1 ]; then echo PASS; else echo FAIL; fi; }
result_of() { grep '^RESULT ' "$1" | tail -n1 | sed 's/^RESULT //'; }
field() { "$PY" -c 'import json,sys; v=json.loads(sys.argv[1] or "{}").get(sys.argv[2]); print("" if v is None else v)' "$(result_of "$1")" "$2"; }
ctl() { "$BIN/vgpuctl" --insecure --endpoints "$EP" "$@"; }

log "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n1)"
"$BIN/vgpu-agent" inventory -o json >"$LOGS/inventory.json" 2>"$LOGS/inventory.err"
gpus=$("$PY" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["gpus"]))' "$LOGS/inventory.json" 2>/dev/null || echo 0)
smi=$(nvidia-smi -L | wc -l)
record "NVML inventory finds the GPUs" "$smi" "$gpus" "$(verdict $([ "$gpus" = "$smi" ] && echo 1))"

"$BIN/vgpu-cp" bootstrap --insecure --id 1 --listen "$EP" --data-dir "$WORK/cp" 2>"$LOGS/cp.log" &
PIDS+=($!)
for _ in $(seq 100); do ctl cluster status >/dev/null 2>&1 && break; sleep 0.1; done
"$BIN/vgpu-agent" join --insecure --control-plane "$EP" --name gpu-node --state-dir "$WORK/agent" \
  --shm-dir /dev/shm/vgpu-stack --cdi-dir "$WORK/cdi" 2>"$LOGS/agent.log" &
PIDS+=($!)
for _ in $(seq 100); do ctl get nodes 2>/dev/null | grep -q gpu-node && break; sleep 0.1; done
ctl get nodes | tee -a "$LOGS/run.log"
ctl describe node gpu-node >"$LOGS/node.txt" 2>&1

ctl place tenant-a --gpus 0.5 --memory 10GiB 2>&1 | tee -a "$LOGS/run.log"
ctl place tenant-b --gpus 0.5 --memory 20GiB 2>&1 | tee -a "$LOGS/run.log"
ctl get tenants | tee -a "$LOGS/run.log"
# The agent writes the tenants' files when the assignment stream delivers them.
for _ in $(seq 100); do [ -f "$WORK/agent/tenants/tenant-b.json" ] && break; sleep 0.1; done
"$BIN/vgpu-agent" env --tenant tenant-a --name gpu-node --state-dir "$WORK/agent" >"$LOGS/env-a.txt" 2>&1
cp "$WORK/cdi/vgpu.dev-tenant.json" "$LOGS/cdi.json" 2>/dev/null

run_as() { # run_as TENANT LOGNAME -- helper args
  local tenant=$1 name=$2; shift 3
  timeout 300 env VGPU_SHM_DIR=/dev/shm/vgpu-stack "$BIN/vgpu-agent" exec --tenant "$tenant" --name gpu-node \
    --state-dir "$WORK/agent" --interposer "$BIN/libvgpu_cuda.so" -- "$PY" "$HELPER" "$@" >"$LOGS/$name.log" 2>&1
}

# tenant-b keeps computing (and checking its results) while tenant-a hits its limit.
timeout 300 env VGPU_SHM_DIR=/dev/shm/vgpu-stack "$BIN/vgpu-agent" exec --tenant tenant-b --name gpu-node \
  --state-dir "$WORK/agent" --interposer "$BIN/libvgpu_cuda.so" -- "$PY" "$HELPER" matmul_loop 25 4 \
  >"$LOGS/b-matmul.log" 2>&1 &
b_pid=$!
PIDS+=($b_pid)

run_as tenant-a a-meminfo -- meminfo
total=$(field "$LOGS/a-meminfo.log" total)
record "tenant-a (10GiB slice) sees 10GiB in mem_get_info" "$((10 << 30))" "$total" "$(verdict $([ "$total" = "$((10 << 30))" ] && echo 1))"

run_as tenant-a a-alloc12 -- alloc_one 12
kind=$(field "$LOGS/a-alloc12.log" error_type)
record "tenant-a allocating 12GiB raises torch's OOM" "OutOfMemoryError" "${kind:-no error}" "$(verdict $([ "$kind" = OutOfMemoryError ] && echo 1))"

run_as tenant-a a-chunks -- alloc_chunks 512
got=$(field "$LOGS/a-chunks.log" allocated)
record "tenant-a allocates at most 10GiB in 512MiB chunks" "<= $((10 << 30))" "$got" "$(verdict $([ -n "$got" ] && [ "$got" -le $((10 << 30)) ] && [ "$got" -ge $((8 << 30)) ] && echo 1))"

wait "$b_pid"
b_ok=$(field "$LOGS/b-matmul.log" ok)
b_steps=$(field "$LOGS/b-matmul.log" iterations)
record "tenant-b kept running with correct results meanwhile" "ok, iterations > 0" "ok=$b_ok iterations=$b_steps" "$(verdict $([ "$b_ok" = True ] && [ "${b_steps:-0}" -gt 0 ] && echo 1))"

out=$("$BIN/vgpu-agent" exec --tenant nobody --name gpu-node --state-dir "$WORK/agent" -- true 2>&1)
record "exec refuses a tenant not placed here" "refused" "$(echo "$out" | head -c 80)" "$(verdict $(echo "$out" | grep -q "not placed" && echo 1))"

echo
echo "| check | expected | got | result |"
echo "| --- | --- | --- | --- |"
while IFS=$'\t' read -r check expected got result; do
  echo "| $check | $expected | $got | $result |"
done <"$RESULTS"
! grep -q FAIL "$RESULTS"
