#!/usr/bin/env bash
# The compatibility suite (issue 16): real jobs run bare and inside a vgpu slice through
# `vgpu-agent exec`, on an agent without MPS (the default) and with `--mps`; results compared with
# the bare run (bit for bit where the job is deterministic, within a stated tolerance otherwise),
# and the time each took. One GPU. Jobs are tests/gpu/compat.py's.
#
# Rows (ROWS, default all):
#   ddp2 ddp3      DDP ResNet-18 (224x224, batch 32), 2 / 3 ranks of one tenant on its GPU (NCCL);
#                  bare reference: NCCL with a host identity per rank (its socket transport), for
#                  ddp2 also checked against the gloo backend. 2 ranks: bit for bit. 3 ranks: the
#                  sum's order differs between transports and training amplifies it (1.4% after
#                  20 steps on an H100): first loss exact, the others within 5%
#   ddp2-static    DDP with 4 MiB gradient buckets and static_graph
#   fsdp2          FSDP full sharding, 2 ranks; bare reference: bare NCCL (host identity per rank)
#   compile        torch.compile (inductor, triton kernels)
#   graphs         a CUDA graph of a whole training step captured by the application
#   malloc-async   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
#   expandable     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   generate       a decoder generating text with a KV cache (transformers when installed)
#   cupy jax       allocation, kernels, reductions
#   oom            a job that hits its memory quota: a clean framework OOM, while a neighbour
#                  tenant's checked matmuls go on unharmed
#   kill9          DDP 2 ranks, one rank SIGKILLed mid-training: the others fail fast, and the
#                  tenant's memory is released
#   cumem0         DDP 2 ranks with NCCL_CUMEM_ENABLE=0
# Modes (MODES, default `bare vgpu vgpu-mps`). In the vgpu modes the job runs in tenant `trainer`
# (`place trainer --gpus 0.5 --memory 30GiB`, or TRAINER_GPUS instead of 0.5), the oom row's
# neighbour in `neighbour` (`--gpus 0.25 --memory 8GiB`). Ranks go to GPU LOCAL_RANK mod the GPUs
# the process sees: on a two-GPU machine `TRAINER_GPUS=2` (or `1.5`: slices of two GPUs) runs the
# distributed rows across GPUs (not part of issue 16's one-GPU acceptance).
#
# Verdicts: PASS (ran, result as bare), SKIP (its library is not installed: cupy, JAX), FAIL
# (error or wrong result), REFUSED (vgpu refused it at
# the start with a message naming what to change), HUNG (no end within ROW_TIMEOUT: its Python
# stacks (py-spy when carried as $VGPU_BIN/tools/py-spy, else faulthandler) and nvidia-smi are kept
# in the row's log directory, then it is killed). No row may hang.
#
#   VGPU_BIN=dist tests/gpu/compat.sh           # ~15 min on an H100 for all rows and modes
#
# Knobs: ROWS, MODES, ROW_TIMEOUT (150 s), STEPS (20), VGPU_BIN (dist), PY, OUT (/tmp/compat-out),
# VGPU_PORT (7477), TENANT_FLAGS (extra `vgpuctl place` flags for trainer), EXEC_WRAP (a command
# put between `vgpu-agent exec --` and the job, e.g. `env -u LD_PRELOAD`, for diagnosis), JOB_ARGS
# (extra arguments of the distributed jobs, e.g. `--bare-nccl`), AGENT_FLAGS (extra `vgpu-agent
# join` flags; `--simulate 1xH100` with a stand-in PY checks this script on a machine without a
# GPU).
# No GPU setting is changed; every process started here is killed and reaped on exit, and the
# agent's MPS daemon is told to quit. Exit: 0 no row failed or hung, 1 some did, 2 usage, 3 wrong
# machine.
# shellcheck disable=SC2317 # cleanup and wait tests are called indirectly (trap, bounded_wait)
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HELPER="$ROOT/tests/gpu/compat.py"
# forget, bounded_wait, gone, stop_pid, mps_gone; gpu_paths, ctl, vgpu_cp_up, vgpu_agent_up,
# agent_mps_down
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
# shellcheck source=tests/gpu/node.sh
source "$ROOT/tests/gpu/node.sh"
gpu_paths
ALL_ROWS="ddp2 ddp3 ddp2-static fsdp2 compile graphs malloc-async expandable generate cupy jax oom kill9 cumem0"
ROWS=${ROWS:-$ALL_ROWS}
MODES=${MODES:-bare vgpu vgpu-mps}
ROW_TIMEOUT=${ROW_TIMEOUT:-150}
STEPS=${STEPS:-20}
TENANT_FLAGS=${TENANT_FLAGS:-}
EXEC_WRAP=${EXEC_WRAP:-}
JOB_ARGS=${JOB_ARGS:-}
AGENT_FLAGS=${AGENT_FLAGS:-}
TRAINER_GPUS=${TRAINER_GPUS:-0.5}
# ImageNet-sized inputs, as the job that hung in issue 16 (ResNet-18, 224x224)
DDP_SHAPE=${DDP_SHAPE:---image 224 --batch 32}
OUT=${OUT:-/tmp/compat-out}
LOGS="$OUT/compat"
PORT=${VGPU_PORT:-7477}
EP="127.0.0.1:$PORT"
SHM=/dev/shm/vgpu-compat.$$
PYSPY="$BIN/tools/py-spy"
# how vgpu's refusals read: a stable code, or the NCCL plugin's refusal of legacy buffers
REFUSALS='\[VGPU-[A-Z0-9-]+\]|\(VGPU-[A-Z0-9-]+\)|unset NCCL_CUMEM_ENABLE' 
export PYTHONUNBUFFERED=1
for r in $ROWS; do
  [[ " $ALL_ROWS " == *" $r "* ]] || { echo "ROWS: unknown row $r (rows: $ALL_ROWS)" >&2; exit 2; }
done
for m in $MODES; do
  case "$m" in bare | vgpu | vgpu-mps) ;; *) echo "MODES: unknown mode $m" >&2; exit 2 ;; esac
done
if [[ " $MODES " == *" vgpu"* ]]; then
  for f in vgpu-cp vgpu-agent vgpuctl libvgpu_cuda.so libvgpu_nccl.so; do
    [ -e "$BIN/$f" ] || { echo "$BIN/$f is missing: build and carry it (VGPU_BIN)" >&2; exit 2; }
  done
fi

rm -rf "$LOGS"
mkdir -p "$LOGS"
WORK=$(mktemp -d /tmp/compat.XXXXXX)
RESULTS="$LOGS/results.tsv"
: >"$RESULTS"
PIDS=()
CP=""
AGENT=""
AGENT_MPS=0
PLACED=0
MODE=""

cleanup() {
  local rc=$? pid
  trap - EXIT
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  kill_tagged "compat-$$-.*"
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [ "$AGENT_MPS" = 1 ] && echo quit | CUDA_MPS_PIPE_DIRECTORY="$SHM/mps" nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r "$WORK/agent/mps-log" "$LOGS/agent-mps-log" 2>/dev/null
  rm -rf "$WORK" "$SHM"
  tar -czf "$OUT/compat.tgz" -C "$OUT" compat 2>/dev/null
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP

log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
has() { grep -q "$2" "$1" 2>/dev/null; }
record() { # record ROW MODE VERDICT SECONDS NOTE
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$RESULTS"
  log "$1 / $2: $3 (${4}s) $5"
}

# Every process of a row carries COMPAT_TAG=<row tag> in its environment (torchrun's workers start
# sessions of their own, so process groups do not find them): tagged PIDs are what a hung row's
# diagnosis reads and what is killed.
tagged() { # tagged TAG: the PIDs whose environment holds COMPAT_TAG=TAG
  local f
  for f in /proc/[0-9]*/environ; do
    { tr '\0' '\n' <"$f"; } 2>/dev/null | grep -qx "COMPAT_TAG=$1" && { f=${f#/proc/}; echo "${f%/environ}"; }
  done
}
kill_tagged() { # kill_tagged TAG: SIGKILL every tagged process, until none is left (10 s)
  local i p
  for i in $(seq 20); do
    p=$(tagged "$1")
    [ -z "$p" ] && return 0
    # shellcheck disable=SC2086
    kill -9 $p 2>/dev/null
    sleep 0.5
  done
  log "processes tagged $1 survived SIGKILL: $(tagged "$1" | tr '\n' ' ')"
}
TAGS=()

# launch TENANT DIR ARGS...: the command ARGS as the current mode runs a tenant's job, tagged
# (see `tagged`); sets LAST and TAG
launch() {
  local tenant=$1 dir=$2
  shift 2
  mkdir -p "$dir"
  TAG="compat-$$-$RANDOM$RANDOM"
  TAGS+=("$TAG")
  case "$MODE" in
  bare) COMPAT_TAG=$TAG "$@" >"$dir/out.log" 2>&1 & ;;
  *)
    local flag=false
    [ "$MODE" = vgpu-mps ] && flag=true
    # shellcheck disable=SC2086 # EXEC_WRAP is words on purpose
    COMPAT_TAG=$TAG VGPU_AGENT_MPS=$flag "$BIN/vgpu-agent" exec --name gpu-node --state-dir "$WORK/agent" \
      --shm-dir "$SHM" --interposer "$BIN/libvgpu_cuda.so" --tenant "$tenant" -- $EXEC_WRAP "$@" \
      >"$dir/out.log" 2>&1 &
    ;;
  esac
  LAST=$!
  PIDS+=("$LAST")
}

# finish PID DIR [TAG]: waits up to ROW_TIMEOUT for PID; on timeout keeps the Python stacks of
# every process of the row and nvidia-smi, then kills them all. Either way no process of the row
# outlives it. Sets RC (the exit status, or `hung`) and ELAPSED.
finish() {
  local pid=$1 dir=$2 tag=${3:-$TAG} t0=$SECONDS p
  if bounded_wait "$ROW_TIMEOUT" "row in $dir" gone "$pid"; then
    wait "$pid"
    RC=$?
  else
    RC=hung
    nvidia-smi >"$dir/nvidia-smi.txt" 2>&1
    for p in $(tagged "$tag"); do
      tr '\0' ' ' <"/proc/$p/cmdline" >"$dir/cmd-$p.txt" 2>/dev/null
      if [ -x "$PYSPY" ]; then
        timeout 30 "$PYSPY" dump --native --pid "$p" >"$dir/stack-$p.txt" 2>&1
      else
        kill -USR1 "$p" 2>/dev/null
      fi
    done
  fi
  kill_tagged "$tag"
  wait "$pid" 2>/dev/null
  forget "$pid"
  ELAPSED=$((SECONDS - t0))
}

torchrun() { # torchrun NPROC ARGS...
  local n=$1
  shift
  echo "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" "$HELPER" "$@"
}

# run_row ROW: runs the row's job the current mode's way and records a verdict
run_row() {
  local row=$1 D="$LOGS/$MODE/$1" ref="$LOGS/bare/$1/result.json" rtol=0 cmd=() note=""
  local res="$D/result.json"
  mkdir -p "$D"
  log "$row / $MODE"
  local bare_nccl=()
  [ "$MODE" = bare ] && bare_nccl=(--bare-nccl)
  case "$row" in
  ddp2) read -ra cmd <<<"$(torchrun 2 ddp --steps "$STEPS" $DDP_SHAPE)" ;;
  ddp3) read -ra cmd <<<"$(torchrun 3 ddp --steps "$STEPS" $DDP_SHAPE)"; rtol=5e-2 ;;
  ddp2-static) read -ra cmd <<<"$(torchrun 2 ddp --steps "$STEPS" $DDP_SHAPE --static-graph --bucket-mb 4)" ;;
  fsdp2) read -ra cmd <<<"$(torchrun 2 fsdp --steps "$STEPS")"; rtol=1e-5 ;;
  compile) cmd=("$PY" "$HELPER" compile --steps "$STEPS") ;;
  graphs) cmd=("$PY" "$HELPER" graphs --steps "$STEPS") ;;
  malloc-async) cmd=(env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "$PY" "$HELPER" alloc --steps "$STEPS") ;;
  expandable) cmd=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" "$HELPER" alloc --steps "$STEPS") ;;
  generate) cmd=("$PY" "$HELPER" generate) ;;
  # cuBLAS and XLA pick algorithms by heuristics and autotuning, which may differ with the memory
  # a slice reports: values within 1e-5
  cupy) cmd=("$PY" "$HELPER" cupy); rtol=1e-5 ;;
  jax) cmd=(env XLA_PYTHON_CLIENT_MEM_FRACTION=.5 "$PY" "$HELPER" jax); rtol=1e-5 ;;
  oom) run_oom "$D"; return ;;
  kill9) run_kill9 "$D"; return ;;
  cumem0) read -ra cmd <<<"$(torchrun 2 ddp --steps "$STEPS" $DDP_SHAPE)"; cmd=(env NCCL_CUMEM_ENABLE=0 "${cmd[@]}") ;;
  esac
  # shellcheck disable=SC2206 # JOB_ARGS is words on purpose
  case "$row" in ddp* | fsdp* | cumem0) cmd+=($JOB_ARGS) ;; esac
  local base=("${cmd[@]}")
  case "$row" in ddp* | fsdp* | cumem0) cmd+=("${bare_nccl[@]}") ;; esac
  cmd+=(--out "$res")
  launch trainer "$D" "${cmd[@]}"
  finish "$LAST" "$D"
  local secs=$ELAPSED
  if [ "$RC" = hung ]; then
    record "$row" "$MODE" HUNG "$secs" "killed after ${ROW_TIMEOUT}s; stacks in $MODE/$row"
    return
  fi
  if [ "$RC" = 77 ]; then
    record "$row" "$MODE" SKIP "$secs" "$(grep -m1 '^SKIP' "$D/out.log")"
    return
  fi
  if [ "$RC" != 0 ] || [ ! -s "$res" ]; then
    local why
    why=$(grep -m1 -oE "$REFUSALS" "$D/out.log" 2>/dev/null)
    if [ "$MODE" != bare ] && [ -n "$why" ]; then
      record "$row" "$MODE" REFUSED "$secs" "$(grep -m1 -F "$why" "$D/out.log" | cut -c1-200)"
    else
      record "$row" "$MODE" FAIL "$secs" "exit $RC: $(grep -v '^\[' "$D/out.log" | grep -iE 'error|exception' | tail -n1 | cut -c1-160)"
    fi
    return
  fi
  local job_s
  job_s=$("$PY" "$HELPER" summary "$res")
  if [ "$MODE" = bare ]; then
    # the reference is the bare run (NCCL over its socket transport); for ddp2 also gloo's,
    # which must be identical
    case "$row" in
    ddp2)
      launch trainer "$D/gloo" "${base[@]}" --backend gloo --out "$D/gloo.json"
      finish "$LAST" "$D/gloo"
      if [ "$RC" = 0 ] && [ -s "$D/gloo.json" ]; then
        note="bare NCCL vs gloo: $("$PY" "$HELPER" compare "$D/gloo.json" "$res" --rtol "$rtol")"
      else
        note="the gloo run failed (see bare/$row/gloo)"
      fi
      cp "$res" "$D/reference.json"
      ;;
    *) cp "$res" "$D/reference.json" ;;
    esac
    record "$row" bare PASS "$secs" "job ${job_s}; $note"
    return
  fi
  ref="$LOGS/bare/$row/reference.json"
  if [ ! -s "$ref" ]; then
    record "$row" "$MODE" PASS "$secs" "job ${job_s}; no bare reference to compare"
    return
  fi
  local cmp
  if cmp=$("$PY" "$HELPER" compare "$ref" "$res" --rtol "$rtol"); then
    record "$row" "$MODE" PASS "$secs" "job ${job_s}; vs bare: $cmp"
  else
    record "$row" "$MODE" FAIL "$secs" "job ${job_s}; vs bare: $cmp"
  fi
}

run_oom() { # the trainer fills its quota while the neighbour's checked matmuls run
  local D=$1 nb
  if [ "$MODE" != bare ] &&
    ! bounded_wait 15 "the neighbour's directory" test -e "$SHM/tenants/neighbour/nccl-activity"; then
    record oom "$MODE" SKIP 0 "the neighbour tenant found no room beside trainer (TRAINER_GPUS=$TRAINER_GPUS)"
    return
  fi
  launch neighbour "$D/neighbour" "$PY" "$HELPER" loop --seconds 40 --out "$D/neighbour.json"
  nb=$LAST
  local nb_tag=$TAG
  bounded_wait 60 "neighbour warm" has "$D/neighbour/out.log" READY
  launch trainer "$D" "$PY" "$HELPER" oom --out "$D/result.json"
  finish "$LAST" "$D"
  local rc=$RC secs=$ELAPSED
  finish "$nb" "$D/neighbour" "$nb_tag"
  local nb_ok
  nb_ok=$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("yes" if r["wrong"]==0 and r["steps"]>0 else "no")' "$D/neighbour.json" 2>/dev/null || echo no)
  if [ "$rc" = hung ]; then
    record oom "$MODE" HUNG "$secs" "killed after ${ROW_TIMEOUT}s"
  elif [ "$rc" = 0 ] && [ -s "$D/result.json" ] && [ "$nb_ok" = yes ]; then
    record oom "$MODE" PASS "$secs" "$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("OOM after %s GiB (reports %s GiB), then computes; neighbour unharmed" % (r["gib_before_oom"], r["reported_total"] >> 30))' "$D/result.json")"
  else
    record oom "$MODE" FAIL "$secs" "job exit $rc, neighbour ok: $nb_ok"
  fi
}

tenant_memory_used() { # the trainer's memory in use as the agent last reported it (MiB), or empty
  ctl describe tenant trainer -o json 2>/dev/null | "$PY" -c '
import json,sys
print(sum(int(u.get("memory_used_bytes",0)) for u in json.load(sys.stdin).get("usage",[]))>>20)' 2>/dev/null
}

memory_released() { [ "$(tenant_memory_used)" = 0 ]; }

run_kill9() { # rank 1 of a 2-rank DDP job SIGKILLed mid-training
  local D=$1 cmd victim="" t_kill p
  local bare_nccl=()
  [ "$MODE" = bare ] && bare_nccl=(--bare-nccl)
  read -ra cmd <<<"$(torchrun 2 ddp --steps 400 $DDP_SHAPE)"
  launch trainer "$D" "${cmd[@]}" "${bare_nccl[@]}" --out "$D/result.json"
  local job=$LAST
  if ! bounded_wait 120 "step 5 of the job" has "$D/out.log" "rank 1 unix [0-9.]*\] STEP 5 "; then
    finish "$job" "$D"
    record kill9 "$MODE" FAIL "$ELAPSED" "the job did not reach step 5 (rc $RC)"
    return
  fi
  for p in $(tagged "$TAG"); do
    { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | grep -qx 'RANK=1' && victim=$p
  done
  t_kill=$SECONDS
  [ -n "$victim" ] && kill -9 "$victim"
  finish "$job" "$D"
  local after=$((SECONDS - t_kill))
  if [ -z "$victim" ]; then
    record kill9 "$MODE" FAIL "$ELAPSED" "rank 1 not found"
  elif [ "$RC" = hung ]; then
    record kill9 "$MODE" HUNG "$ELAPSED" "the other rank did not end within ${ROW_TIMEOUT}s of the kill"
  else
    local used=""
    if [ "$MODE" != bare ]; then
      bounded_wait 20 "the trainer's memory to be released" memory_released || true
      used=", trainer memory after: $(tenant_memory_used) MiB"
    fi
    record kill9 "$MODE" PASS "$ELAPSED" "job ended ${after}s after the kill (exit $RC)$used"
  fi
}

# shellcheck disable=SC2086 # AGENT_FLAGS is words on purpose
vgpu_up() { # vgpu_up [--mps]
  vgpu_cp_up || return 1
  vgpu_agent_up $AGENT_FLAGS "$@" || return 1
  if [ "$PLACED" = 0 ]; then
    # shellcheck disable=SC2086 # TENANT_FLAGS is words on purpose
    ctl place trainer --gpus "$TRAINER_GPUS" --memory 30GiB $TENANT_FLAGS 2>&1 | tee -a "$LOGS/run.log"
    # the oom row's neighbour; with TRAINER_GPUS filling the node it stays pending (oom: SKIP)
    ctl place neighbour --gpus 0.25 --memory 8GiB --no-wait 2>&1 | tee -a "$LOGS/run.log"
    PLACED=1
  fi
  bounded_wait 15 "the trainer's directory" test -e "$SHM/tenants/trainer/nccl-activity"
}

gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current --format=csv,noheader 2>&1 | head -n1)
log "machine: $gpu; modes: $MODES; rows: $ROWS; ROW_TIMEOUT=$ROW_TIMEOUT STEPS=$STEPS TENANT_FLAGS='$TENANT_FLAGS' EXEC_WRAP='$EXEC_WRAP'"
cmode=$(echo "$gpu" | awk -F', *' '{ print $3 }')
mig=$(echo "$gpu" | awk -F', *' '{ print $4 }')
if [ "$cmode" != Default ] || [ "$mig" = Enabled ]; then
  log "this needs one GPU in compute mode Default with MIG off; nothing is changed here, stopping"
  exit 3
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOGS/run.log"
import importlib
for m in ("torch", "triton", "transformers", "cupy", "jax", "jaxlib"):
    try:
        print(f"{m} {importlib.import_module(m).__version__}")
    except Exception as e:
        print(f"{m}: not available ({type(e).__name__})")
EOF

for MODE in $MODES; do
  case "$MODE" in
  bare) ;;
  vgpu) agent_mps_down; vgpu_up || { log "vgpu did not come up: mode skipped"; continue; } ;;
  vgpu-mps) vgpu_up --mps || { log "vgpu-mps did not come up: mode skipped"; continue; } ;;
  esac
  for row in $ROWS; do run_row "$row"; done
done
agent_mps_down
[ -n "$AGENT" ] && stop_pid "$AGENT"
[ -n "$CP" ] && stop_pid "$CP"
log "done after ${SECONDS}s"
echo
printf '%-13s %-9s %-8s %6s  %s\n' row mode verdict secs note
awk -F'\t' '{ printf "%-13s %-9s %-8s %6s  %s\n", $1, $2, $3, $4, $5 }' "$RESULTS"
! grep -qP '\t(FAIL|HUNG)\t' "$RESULTS"
