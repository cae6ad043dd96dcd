#!/usr/bin/env bash
# NVML memory queries inside a tenant, and the context overhead the interposer charges (issue 3:
# "NVML memory queries inside the tenant report the slice"; memory quota "and context overhead").
# Run from the repository root on a GPU machine:
#
#   tests/gpu/nvml_slice.sh [path/to/libvgpu_cuda.so]
#
# The tenant environment is the one `vgpu-agent env` prints (CUDA_VISIBLE_DEVICES = the GPU's
# uuid, VGPU_MEMORY_LIMITS per ordinal), set directly. Checks:
#   (n1) torch + pynvml in a tenant with a 10 GiB slice: NVML v1 and v2 report 10 GiB total, NVML
#        used tracks a torch allocation exactly, and torch.cuda.mem_get_info agrees with NVML;
#   (n2) a pynvml-only process of the tenant (no CUDA) reports the slice and the tenant's usage;
#   (n3) what a process really loses on the GPU beyond what PyTorch reserved, per stage, without
#        the interposer, against the overhead charged (VGPU_CONTEXT_OVERHEAD's default);
#   (n4) processes of a 4 GiB tenant, 256 MiB each, started one by one: with the default overhead
#        the contexts that do not fit are refused and the processes' real GPU memory stays inside
#        the slice; with VGPU_CONTEXT_OVERHEAD=0 (the old default) it does not.
# Logs go to $OUT/nvml_slice (or a temporary directory); the table is printed last (also
# results.tsv). Exit status 0 when every check passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=$(realpath "${1:-$ROOT/target/release/libvgpu_cuda.so}")
HELPER="$ROOT/tests/gpu/nvml_slice.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
LOGS="${OUT:-$(mktemp -d)}/nvml_slice"
mkdir -p "$LOGS"
SHM=$(mktemp -d /dev/shm/vgpu-nvml.XXXXXX)
GIB=$((1 << 30))
MIB=$((1 << 20))
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
  rm -rf "$SHM"
}
trap cleanup EXIT

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"
  log "$4: $1 (expected $2, got $3)"
}
verdict() { if [ "${1:-}" = 1 ]; then echo PASS; else echo FAIL; fi; }
result_of() { grep '^RESULT ' "$1" | tail -n1 | sed 's/^RESULT //' || true; }
# field LOG PATH: a field of a run's RESULT, PATH like `nvml_held.used` ("" if absent).
field() {
  local json
  json=$(result_of "$1")
  [ -n "$json" ] || json='{}'
  "$PY" -c '
import json, sys
v = json.loads(sys.argv[1])
for k in sys.argv[2].split("."):
    v = v.get(k) if isinstance(v, dict) else (v[int(k)] if isinstance(v, list) and k.isdigit() and int(k) < len(v) else None)
    if v is None:
        break
print("" if v is None else v)' "$json" "$2"
}
mib() { "$PY" -c 'import sys; v=sys.argv[1]; print(f"{int(v)/2**20:.0f} MiB" if v.lstrip("-").isdigit() else "none")' "${1:-x}"; }
gib() { "$PY" -c 'import sys; v=sys.argv[1]; print(f"{int(v)/2**30:.2f} GiB" if v.lstrip("-").isdigit() else "none")' "${1:-x}"; }

UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1 | tr -d ' ')
export NVML_UUID=$UUID

# tenant NAME LIMIT LOGNAME [VAR=VALUE...] -- helper args: a process of the tenant, as
# `vgpu-agent exec` starts it (bounded: a hang is a failed check, not a hung script).
tenant() {
  local name=$1 limit=$2 logname=$3
  shift 3
  local extra=()
  while [ "$1" != -- ]; do extra+=("$1"); shift; done
  shift
  timeout 120 env LD_PRELOAD="$SO" CUDA_VISIBLE_DEVICES="$UUID" VGPU_TENANT="$name" \
    VGPU_MEMORY_LIMITS="0:$limit" VGPU_SHM_DIR="$SHM" VGPU_LOG="${VGPU_LOG:-1}" "${extra[@]}" \
    "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1
}
tenant_bg() {
  local name=$1 limit=$2 logname=$3
  shift 3
  local extra=()
  while [ "$1" != -- ]; do extra+=("$1"); shift; done
  shift
  env LD_PRELOAD="$SO" CUDA_VISIBLE_DEVICES="$UUID" VGPU_TENANT="$name" \
    VGPU_MEMORY_LIMITS="0:$limit" VGPU_SHM_DIR="$SHM" VGPU_LOG="${VGPU_LOG:-1}" "${extra[@]}" \
    "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1 &
}
# wait_started LOG SECONDS: until the background run holds (0) or has failed (1).
wait_started() {
  local deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    grep -q '^HOLDING' "$1" 2>/dev/null && return 0
    grep -q '^RESULT ' "$1" 2>/dev/null && return 1
    sleep 0.2
  done
  return 1
}
# real_used PID...: the driver's figure for these processes together, in bytes.
real_used() {
  local sum=0 pid used
  for pid in "$@"; do
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      awk -F', *' -v p="$pid" '$1 == p {print $2}')
    sum=$((sum + ${used:-0} * MIB))
  done
  echo "$sum"
}

log "interposer: $SO"
log "python: $PY ($("$PY" -c 'import torch, pynvml; print(torch.__version__, torch.version.cuda, "pynvml", getattr(pynvml, "__version__", "?"))' 2>&1))"
nvidia-smi --query-gpu=name,memory.total,driver_version,uuid --format=csv,noheader 2>&1 | tee -a "$LOGS/run.log"
[ -f "$SO" ] || { log "missing $SO"; exit 2; }
nm -D --defined-only "$SO" 2>/dev/null | grep -E ' T (nvml|cuDevicePrimaryCtxRetain)' | tee -a "$LOGS/run.log"

# (n1) torch and pynvml in one process of a 10 GiB tenant.
VGPU_LOG=2 tenant a $((10 * GIB)) n1_track -- track 2
t=$LOGS/n1_track.log
record "(n1) NVML v1 total, 10 GiB slice" "10.00 GiB" "$(gib "$(field "$t" nvml_start.total)")" \
  "$(verdict $([ "$(field "$t" nvml_start.total)" = $((10 * GIB)) ] && echo 1))"
record "(n1) NVML v2 total / reserved" "10.00 GiB / 0" \
  "$(gib "$(field "$t" nvml_start.v2_total)") / $(field "$t" nvml_start.v2_reserved)" \
  "$(verdict $([ "$(field "$t" nvml_start.v2_total)" = $((10 * GIB)) ] && [ "$(field "$t" nvml_start.v2_reserved)" = 0 ] && echo 1))"
charged=$(field "$t" nvml_start.used)
record "(n1) NVML used before any allocation (the context charge)" "640 MiB (the default)" \
  "$(mib "$charged")" "$(verdict $([ "$charged" = $((640 * MIB)) ] && echo 1))"
held=$(field "$t" nvml_held.used)
delta=$((${held:-0} - ${charged:-0}))
record "(n1) NVML used after a 2 GiB tensor, minus before" "2.00 GiB" "$(gib "$delta")" \
  "$(verdict $([ "$delta" = $((2 * GIB)) ] && echo 1))"
record "(n1) NVML used after freeing it (empty_cache)" "$(mib "$charged")" \
  "$(mib "$(field "$t" nvml_freed.used)")" \
  "$(verdict $([ "$(field "$t" nvml_freed.used)" = "$charged" ] && echo 1))"
record "(n1) NVML v2 used = v1 used (held)" "$(gib "$(field "$t" nvml_held.used)")" \
  "$(gib "$(field "$t" nvml_held.v2_used)")" \
  "$(verdict $([ "$(field "$t" nvml_held.v2_used)" = "$(field "$t" nvml_held.used)" ] && echo 1))"
tf=$(field "$t" torch_held.0)
tt=$(field "$t" torch_held.1)
record "(n1) torch.cuda.mem_get_info = NVML (free, total), held" \
  "$(gib "$(field "$t" nvml_held.free)"), $(gib "$(field "$t" nvml_held.total)")" "$(gib "$tf"), $(gib "$tt")" \
  "$(verdict $([ "$tf" = "$(field "$t" nvml_held.free)" ] && [ "$tt" = "$(field "$t" nvml_held.total)" ] && echo 1))"
record "(info) hooks reached: cuDevicePrimaryCtxRetain via cuGetProcAddress / NVML via dlsym" "> 0" \
  "$(grep -c 'cuGetProcAddress("cuDevicePrimaryCtxRetain") -> hook' "$t") / $(grep -c 'dlsym("nvmlDeviceGetMemoryInfo.*-> hook' "$t")" INFO

# (n2) A pynvml-only process of the tenant, while another of its processes holds 3 GiB.
tenant_bg a $((10 * GIB)) n2_holder -- hold 3072
PIDS+=($!)
if wait_started "$LOGS/n2_holder.log" 90; then
  tenant a $((10 * GIB)) n2_nvml_only -- nvml_only
  t=$LOGS/n2_nvml_only.log
  used=$(field "$t" nvml.used)
  record "(n2) pynvml-only process: NVML total" "10.00 GiB" "$(gib "$(field "$t" nvml.total)")" \
    "$(verdict $([ "$(field "$t" nvml.total)" = $((10 * GIB)) ] && echo 1))"
  record "(n2) pynvml-only process: NVML used = the holder's 3 GiB + its context" "3712 MiB" \
    "$(mib "$used") (libcuda loaded: $(field "$t" cuda_loaded))" \
    "$(verdict $([ "$used" = $((3072 * MIB + 640 * MIB)) ] && echo 1))"
else
  record "(n2) holder of 3 GiB" "HOLDING" "never held (see n2_holder.log)" FAIL
fi
kill -9 "${PIDS[@]}" 2>/dev/null
for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
PIDS=()

# (n3) What a process really loses beyond PyTorch's reservation, without the interposer.
timeout 120 "$PY" "$HELPER" footprint >"$LOGS/n3_footprint.log" 2>&1
for i in 0 1 2 3 4; do
  name=$(field "$LOGS/n3_footprint.log" "stages.$i.stage")
  [ -n "$name" ] || continue
  record "(n3) no interposer, after $name: process's GPU memory beyond torch's reserved" "<= 640 MiB charged" \
    "$(mib "$(field "$LOGS/n3_footprint.log" "stages.$i.beyond_reserved")") (device used +$(mib "$(field "$LOGS/n3_footprint.log" "stages.$i.device_delta")"), reserved $(mib "$(field "$LOGS/n3_footprint.log" "stages.$i.reserved")"))" INFO
done

# (n4) Many small processes of a 4 GiB tenant: contexts cannot take it past its slice.
many() { # many TENANT LOGPREFIX [VAR=VALUE...]: starts up to 8 holders of 256 MiB, one by one
  local name=$1 prefix=$2 admitted=0 refused="" k pids=()
  shift 2
  for k in 1 2 3 4 5 6 7 8; do
    tenant_bg "$name" $((4 * GIB)) "${prefix}_$k" "$@" -- hold 256
    if wait_started "$LOGS/${prefix}_$k.log" 90; then
      pids+=($!)
      PIDS+=($!)
      admitted=$((admitted + 1))
    else
      refused="$(field "$LOGS/${prefix}_$k.log" error_type): $(field "$LOGS/${prefix}_$k.log" message | cut -c1-80)"
      break
    fi
  done
  echo "$admitted|$(real_used "${pids[@]}")|$refused"
  kill -9 "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
}
IFS='|' read -r admitted real refused < <(many m n4_default)
record "(n4) 4 GiB tenant, 256 MiB processes, default overhead: admitted, then" "4, then refused" \
  "$admitted, then ${refused:-none}" "$(verdict $([ "$admitted" = 4 ] && [ -n "$refused" ] && echo 1))"
record "(n4) ... their real GPU memory (nvidia-smi)" "<= 4.00 GiB" "$(gib "$real")" \
  "$(verdict $([ "${real:-0}" -gt 0 ] && [ "$real" -le $((4 * GIB)) ] && echo 1))"
IFS='|' read -r admitted real refused < <(many z n4_zero VGPU_CONTEXT_OVERHEAD=0)
record "(n4) the same with VGPU_CONTEXT_OVERHEAD=0: admitted / real GPU memory" "8 / > 4 GiB (what the charge prevents)" \
  "$admitted / $(gib "$real")" INFO

panics=$(cat "$LOGS"/*.log | grep -c 'internal error (panic)' || true)
record "no panic caught at the C boundary" "0" "$panics" "$(verdict $([ "$panics" = 0 ] && echo 1))"

echo
echo "logs: $LOGS"
{
  printf 'check\texpected\tgot\tresult\n'
  cat "$RESULTS"
} | awk -F'\t' '
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END { for (r = 1; r <= NR; r++) printf "%-*s | %-*s | %-*s | %s\n", w[1], cell[r, 1], w[2], cell[r, 2], w[3], cell[r, 3], cell[r, 4] }'
! grep -q $'\tFAIL$' "$RESULTS"
