#!/usr/bin/env bash
# The interposer's memory enforcement on a real GPU (issue 3, "Verified on a real GPU" item 1),
# with PyTorch. Run from the repository root on a GPU machine:
#
#   tests/gpu/interposer_memory.sh [path/to/libvgpu_cuda.so]
#
# The library defaults to target/release/libvgpu_cuda.so, built on a development machine with
# `cargo build --release -p interposer` and carried along. Logs go to $OUT/interposer_memory (or a
# temporary directory); the result table (check | expected | got | PASS/FAIL) is printed last and
# also written to results.tsv there. Exit status: 0 when every check passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SO=$(realpath "${1:-$ROOT/target/release/libvgpu_cuda.so}")
HELPER="$ROOT/tests/gpu/interposer_memory.py"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
LOGS="${OUT:-$(mktemp -d)}/interposer_memory"
mkdir -p "$LOGS"
SHM=$(mktemp -d /dev/shm/vgpu-test.XXXXXX)
GIB=$((1 << 30))
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
# record CHECK EXPECTED GOT VERDICT
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"
  log "$4: $1 (expected $2, got $3)"
}
verdict() { if [ "${1:-}" = 1 ]; then echo PASS; else echo FAIL; fi; }
# The RESULT json of a log file, or {} if the run printed none.
result_of() { grep '^RESULT ' "$1" | tail -n1 | sed 's/^RESULT //' || true; }
# field LOG NAME: one field of a run's RESULT ("" if absent).
field() {
  local json
  json=$(result_of "$1")
  [ -n "$json" ] || json='{}'
  "$PY" -c 'import json,sys; v=json.loads(sys.argv[1]).get(sys.argv[2]); print("" if v is None else v)' "$json" "$2"
}
gib() { "$PY" -c 'import sys; print(f"{int(sys.argv[1] or 0)/2**30:.2f} GiB")' "${1:-0}"; }

# tenant NAME LIMIT LOGNAME -- helper args: runs the helper inside a tenant's slice (bounded, so
# a deadlock shows up as a failed check rather than a hung script).
tenant() {
  local name=$1 limit=$2 logname=$3
  shift 4
  timeout 300 env LD_PRELOAD="$SO" VGPU_TENANT="$name" VGPU_MEMORY_LIMIT="$limit" \
    VGPU_SHM_DIR="$SHM" VGPU_LOG="${VGPU_LOG:-1}" "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1
}
# tenant_bg: the same in the background; $! is then the Python process itself (env execs it).
tenant_bg() {
  local name=$1 limit=$2 logname=$3
  shift 4
  env LD_PRELOAD="$SO" VGPU_TENANT="$name" VGPU_MEMORY_LIMIT="$limit" VGPU_SHM_DIR="$SHM" \
    VGPU_LOG="${VGPU_LOG:-1}" "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1 &
}
# plain LOGNAME -- helper args: the same without the interposer.
plain() {
  local logname=$1
  shift 2
  timeout 300 "$PY" "$HELPER" "$@" >"$LOGS/$logname.log" 2>&1
}
# wait_for LOG WORD SECONDS: waits until a background run prints WORD.
wait_for() {
  local deadline=$((SECONDS + $3))
  until grep -q "^$2" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

log "interposer: $SO"
log "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1))"
log "glibc: $(ldd --version 2>&1 | head -n1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOGS/run.log"
[ -f "$SO" ] || { log "missing $SO"; exit 2; }
nm -D --defined-only "$SO" 2>/dev/null | grep -c ' T cu' | xargs -I{} echo "exported cu* hooks: {}" | tee -a "$LOGS/run.log"

# (e) Without the interposer, for comparison: the whole GPU, and 12 GiB fits.
plain e_meminfo -- meminfo
real_total=$(field "$LOGS/e_meminfo.log" total)
record "(e) no preload: mem_get_info total" "the GPU's (> 10 GiB)" "$(gib "$real_total")" \
  "$(verdict $([ "${real_total:-0}" -gt $((10 * GIB)) ] && echo 1))"
plain e_alloc12 -- alloc_one 12
record "(e) no preload: 12 GiB tensor" "ok" "ok=$(field "$LOGS/e_alloc12.log" ok)" \
  "$(verdict $([ "$(field "$LOGS/e_alloc12.log" ok)" = True ] && echo 1))"

# (d, started first) Tenant b (20 GiB) holds 4 GiB and runs checked matmuls while tenant a hits
# its limit below.
tenant_bg b 20GiB d_tenant_b -- matmul_loop 60 4
b_pid=$!
PIDS+=("$b_pid")
wait_for "$LOGS/d_tenant_b.log" RUNNING 120 || log "tenant b did not start (see d_tenant_b.log)"

# (a) The slice is what torch sees.
VGPU_LOG=2 tenant a 10GiB a_meminfo -- meminfo
total=$(field "$LOGS/a_meminfo.log" total)
record "(a) tenant a 10GiB: mem_get_info total" "10.00 GiB" "$(gib "$total")" \
  "$(verdict $([ "${total:-0}" = $((10 * GIB)) ] && echo 1))"
free=$(field "$LOGS/a_meminfo.log" free)
record "(a) tenant a 10GiB: mem_get_info free" "<= 10.00 GiB" "$(gib "$free")" \
  "$(verdict $([ -n "$free" ] && [ "$free" -le $((10 * GIB)) ] && echo 1))"

# (b) One 12 GiB tensor: torch's own OOM error.
tenant a 10GiB b_alloc12 -- alloc_one 12
etype=$(field "$LOGS/b_alloc12.log" error_type)
record "(b) tenant a: 12 GiB tensor" "OutOfMemoryError" "${etype:-none}" \
  "$(verdict $([ "$etype" = OutOfMemoryError ] && echo 1))"
log "torch said: $(field "$LOGS/b_alloc12.log" message)"

# (b') The same through the VMM allocator (cuMemCreate) and the stream-ordered one.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tenant a 10GiB b_alloc12_vmm -- alloc_one 12
etype=$(field "$LOGS/b_alloc12_vmm.log" error_type)
record "(b') expandable_segments (cuMemCreate): 12 GiB" "OutOfMemoryError" "${etype:-none}" \
  "$(verdict $([ "$etype" = OutOfMemoryError ] && echo 1))"
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync tenant a 10GiB b_alloc12_async -- alloc_one 12
etype=$(field "$LOGS/b_alloc12_async.log" error_type)
record "(b') cudaMallocAsync backend: 12 GiB" "OutOfMemoryError" "${etype:-none}" \
  "$(verdict $([ "$etype" = OutOfMemoryError ] && echo 1))"

# (c) Chunks of 256 MiB until the first failure: at most the limit, and close to it.
tenant a 10GiB c_chunks -- alloc_chunks 256
allocated=$(field "$LOGS/c_chunks.log" allocated)
record "(c) tenant a: 256 MiB chunks until OOM" "8..10 GiB (the slice less the context charge), then OOM" \
  "$(gib "$allocated"), $(field "$LOGS/c_chunks.log" error_type)" \
  "$(verdict $([ -n "$allocated" ] && [ "$allocated" -le $((10 * GIB)) ] &&
    [ "$allocated" -ge $((8 * GIB)) ] && [ "$(field "$LOGS/c_chunks.log" error_type)" = OutOfMemoryError ] && echo 1))"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tenant a 10GiB c_chunks_vmm -- alloc_chunks 256
allocated=$(field "$LOGS/c_chunks_vmm.log" allocated)
record "(c') expandable_segments: chunks until OOM" "<= 10 GiB" "$(gib "$allocated")" \
  "$(verdict $([ -n "$allocated" ] && [ "$allocated" -le $((10 * GIB)) ] &&
    [ "$allocated" -ge $((8 * GIB)) ] && echo 1))"

# (f) kill -9 of a tenant-a process holding 6 GiB: a new process gets 8 GiB.
tenant_bg a 10GiB f_holder -- hold 6
holder=$!
PIDS+=("$holder")
if wait_for "$LOGS/f_holder.log" HOLDING 120; then
  tenant a 10GiB f_before -- alloc_one 8
  etype=$(field "$LOGS/f_before.log" error_type)
  record "(f) 8 GiB while another tenant-a process holds 6" "OutOfMemoryError" "${etype:-none}" \
    "$(verdict $([ "$etype" = OutOfMemoryError ] && echo 1))"
  # What the driver charges the holder beyond its 6 GiB: the CUDA context, which the interposer
  # charges as VGPU_CONTEXT_OVERHEAD (default 640 MiB; tests/gpu/nvml_slice.sh compares the two).
  used_mib=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
    awk -F', *' -v p="$holder" '$1 == p {print $2}')
  if [ -n "$used_mib" ]; then
    overhead="$used_mib MiB used by pid $holder => $((used_mib - 6144)) MiB"
  else
    overhead="pid $holder not listed by nvidia-smi"
  fi
  record "(info) holder's GPU memory beyond its 6 GiB (context overhead)" "measured" "$overhead" INFO
  kill -9 "$holder"
  wait "$holder" 2>/dev/null
  start=$SECONDS
  tenant a 10GiB f_after -- alloc_one 8
  ok=$(field "$LOGS/f_after.log" ok)
  record "(f) after kill -9 of the holder: 8 GiB" "ok, no hang" "ok=$ok in $((SECONDS - start)) s" \
    "$(verdict $([ "$ok" = True ] && echo 1))"
else
  record "(f) holder of 6 GiB" "HOLDING" "never held (see f_holder.log)" FAIL
fi

# (d) Tenant b ran all along with correct results.
wait "$b_pid"
record "(d) tenant b 20GiB: matmul loop beside tenant a's OOMs" "ok, 0 mismatches" \
  "ok=$(field "$LOGS/d_tenant_b.log" ok), $(field "$LOGS/d_tenant_b.log" iterations) iterations, $(field "$LOGS/d_tenant_b.log" mismatches) mismatches" \
  "$(verdict $([ "$(field "$LOGS/d_tenant_b.log" ok)" = True ] && echo 1))"

# How the hooks were reached (VGPU_LOG=2 run), and whether the by-name fallback was needed.
record "(info) hooks reached via cuGetProcAddress / dlsym" "> 0" \
  "$(grep -c 'cuGetProcAddress(.*-> hook' "$LOGS/a_meminfo.log") / $(grep -c 'dlsym(.*-> hook' "$LOGS/a_meminfo.log")" INFO
fallbacks=$(cat "$LOGS"/*.log | grep -c 'does not know' || true)
record "(info) cuGetProcAddress answers hooked by name (unknown address)" "0" "$fallbacks" INFO
panics=$(cat "$LOGS"/*.log | grep -c 'internal error (panic)' || true)
record "no panic caught at the C boundary" "0" "$panics" "$(verdict $([ "$panics" = 0 ] && echo 1))"

echo
echo "logs: $LOGS"
# An aligned table (the GPU machines have no `column`).
{
  printf 'check\texpected\tgot\tresult\n'
  cat "$RESULTS"
} | awk -F'\t' '
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END { for (r = 1; r <= NR; r++) printf "%-*s | %-*s | %-*s | %s\n", w[1], cell[r, 1], w[2], cell[r, 2], w[3], cell[r, 3], cell[r, 4] }'
! grep -q $'\tFAIL$' "$RESULTS"
