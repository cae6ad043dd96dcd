#!/usr/bin/env bash
# Issue 4 on 2 x H200: libvgpu_nccl.so against NCCL without it, in one run. Prints a table last.
#   tests/gpu/nccl/plugin.sh [path/to/libvgpu_nccl.so]      (OUT=dir keeps the logs there)
# ONLY=<regex> runs only the jobs whose label matches. NPROC=4 on 4 x H200 (one rank per GPU).
# Sections (SECTIONS="transport slices isolation overhead" by default):
#   transport  2 ranks, P2P and SHM off: NCCL's socket transport vs ours (same-host GPU path,
#              and our TCP path); all-reduce correctness on random data and bus bandwidth;
#              TRANSPORT_PROBES=1 adds the socket `Fin` instead of the completion ring, the
#              copy thread publishing completions instead of the GPU, a copy thread per
#              connection, 16 channels, 16 MiB buffers, NCCL's socket transport again
#              (PROBES_OLD=1: copies in pieces, the TCP path with GPU buffers).
#              ONE_GPU=1: every rank on GPU 0, each its own slice (NCCL_HOSTID), under MPS, so
#              the transport runs on a one-GPU machine (copies inside one GPU, not NVLink)
#   slices     4 ranks on 2 GPUs (two slices per GPU, one NCCL_HOSTID each) in one communicator:
#              all-reduce, all-gather, reduce-scatter, broadcast, send/recv on random data
#              (SLICES_MPS=1 adds the GPU path under MPS)
#   isolation  two jobs at once on the GPU pair, bandwidth weights 75/25: without vgpu (driver
#              time slicing), MPS alone, and MPS + our tuner; the 75 job alone for reference.
#              ISO_CONFIGS="CHANNELS:EXPONENT ..." (default "24:1.2") runs the tuner pair once per
#              setting, to compare channel budgets and split exponents in one run; then A
#              guaranteed next to B best effort (the guarantee against a noisy neighbour).
#              The two jobs of a pair measure the same wall-clock window, PAIR_DELAY (30) s
#              after the pair starts (bench.py --start-at)
#   overhead   one job on NCCL's own NVLink path with and without the plugin loaded, no sharing
#   identity   ranks of one tenant on one GPU in one communicator, given only what the agent
#              hands a fractional tenant (one NCCL_HOSTID for all its ranks, NCCL_NET=vgpu):
#              without NCCL_ENV_PLUGIN NCCL refuses them ("Duplicate GPU detected"); with our
#              env plugin each rank takes a slot on its GPU and its own identity: 2 and 3 ranks
#              on GPU 0 under MPS, all five collectives on random data. Not in the default
#              SECTIONS.
#   interposer (issue 3, point 5) one tenant's all-reduce across both GPUs with libvgpu_cuda.so
#              preloaded (memory limit, compute share with burst), against the same job without;
#              correctness on random data. INTERPOSER=path (default libvgpu_cuda.so beside the
#              plugin's default: dist-nccl/, else dist/).
#              Not in the default SECTIONS.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
# the artefacts: dist-nccl/ if it exists, else dist/ (tests/gpu/README.md builds dist/)
DIST="$ROOT/dist-nccl"
[ -d "$DIST" ] || DIST="$ROOT/dist"
SO=$(realpath "${1:-$DIST/libvgpu_nccl.so}")
PY=${PYTHON:-python3}
BENCH="$ROOT/tests/gpu/nccl/bench.py"
WRAP="$ROOT/tests/gpu/nccl/slice_rank.sh"
LOGS="${OUT:-$(mktemp -d)}/nccl_plugin"
mkdir -p "$LOGS"
RES="$LOGS/results.jsonl"
: >"$RES"
SECTIONS=${SECTIONS:-"transport slices isolation overhead"}
# ranks per job outside the slices section: one per GPU (4 on the 4 x H200 machine)
NPROC=${NPROC:-2}
# ONE_GPU=1: all ranks on GPU 0 (slices of one GPU), for machines with one GPU
if [ "${ONE_GPU:-0}" = 1 ]; then
  BENCH_GPU_OF_RANK=$(printf '0,%.0s' $(seq 1 4)); export BENCH_GPU_OF_RANK=${BENCH_GPU_OF_RANK%,}
fi
SECS=${SECS:-6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,TUNING
MPS_DIR=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
SHARE=/dev/shm/vgpu-nccl-activity-$$
cleanup() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; rm -rf "$MPS_DIR" "$SHARE"; }
trap cleanup EXIT
log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }

PLUG=(NCCL_NET_PLUGIN="$SO" NCCL_TUNER_PLUGIN="$SO")
NOPATH=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
# job LABEL PORT NPROC [env...] -- [bench args...]
job() {
  local label=$1 port=$2 nproc=$3; shift 3
  [ -n "${ONLY:-}" ] && ! [[ $label =~ $ONLY ]] && return 0
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout "${JOB_TIMEOUT:-120}" "$PY" -m torch.distributed.run --nproc_per_node="$nproc" \
    --master_port="$port" --no-python "$WRAP" "$BENCH" --label "$label" --seconds "$SECS" \
    --out "$RES" "$@" >"$LOGS/$label.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || log "$label failed (rc $rc): $(grep -m3 -E 'Error|error|WARN' "$LOGS/$label.log" | tr '\n' ' ')"
}
mps() { nvidia-cuda-mps-control -d; sleep 1; }
# the start of a pair's common measuring window: both jobs warm up until then (PAIR_DELAY
# seconds from now covers both jobs' start-up), so neither measures while the other is gone
pair_start() { echo $(( $(date +%s) + ${PAIR_DELAY:-30} )); }
nomps() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 2; }
CHECK=all_reduce,all_gather,reduce_scatter,broadcast,send_recv

for s in $SECTIONS; do
  case $s in
  transport)
    log "transport"
    # slices of one GPU run their kernels side by side only under MPS (time-sliced, each
    # rank's kernel would wait for a peer that is not running): every job here, NCCL's socket
    # transport too
    [ "${ONE_GPU:-0}" = 1 ] && mps
    job socket 29500 "$NPROC" "${NOPATH[@]}" NCCL_NET=Socket SLICE_PREFIX=a -- --check all_reduce --mib 256 --lead 2
    job vgpu_tcp 29500 "$NPROC" "${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu VGPU_NCCL_LOCAL=0 SLICE_PREFIX=a -- --check "$CHECK" --mib 256 --lead 2
    job vgpu_local_host 29500 "$NPROC" "${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu SLICE_PREFIX=a -- --check all_reduce --mib 256 --lead 2
    # GPU-to-GPU copies (NCCL hands GPU buffers with NCCL_NET_GDR_LEVEL=SYS)
    JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job vgpu_gpu 29500 "$NPROC" "${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS SLICE_PREFIX=a -- --check "$CHECK" --mib 256 --lead 2
    # both again with larger NCCL buffers (BIGBUF bytes; 2 MiB steps instead of 512 KiB): the
    # GPU path is bound by per-step latency, NCCL's socket transport is not helped much
    if [ -n "${BIGBUF-16777216}" ]; then
      job socket_bigbuf 29500 "$NPROC" "${NOPATH[@]}" NCCL_NET=Socket NCCL_BUFFSIZE="${BIGBUF:-16777216}" SLICE_PREFIX=a -- --check all_reduce --mib 256 --lead 2
      JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job vgpu_gpu_bigbuf 29500 "$NPROC" "${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS NCCL_BUFFSIZE="${BIGBUF:-16777216}" SLICE_PREFIX=a -- --check "$CHECK" --mib 256 --lead 2
    fi
    # TRANSPORT_PROBES=1: what bounds the GPU path at NCCL's default buffers. At 4 channels it
    # is per-step latency (each channel's CTA waits on each hop). The defaults now: the
    # completion ring, published by the GPU (a stream write behind each copy), one copy thread
    # per device and process, polling 5 ms before it sleeps. The probes: the old socket
    # `Fin`, the copy thread publishing after the copy's event (the previous default), a
    # copy thread per connection (4 threads at 4 channels), 16 channels (GPU- and
    # thread-published), 16 channels with 16 MiB buffers. PROBES_OLD=1 adds the ones already
    # measured (copies in pieces, our TCP path handed GPU buffers).
    if [ "${TRANSPORT_PROBES:-0}" = 1 ]; then
      GPU=("${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS SLICE_PREFIX=a)
      probe() { local label=$1; shift; JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job "$label" 29500 "$NPROC" "${GPU[@]}" "$@" -- --check "$CHECK" --mib 256 --lead 2; }
      probe vgpu_gpu_noring VGPU_NCCL_FIN_RING=0
      probe vgpu_gpu_threadfin VGPU_NCCL_GPU_FIN=0
      probe vgpu_gpu_threads4 VGPU_NCCL_COPY_THREADS=4
      probe vgpu_gpu_ch16 NCCL_MIN_NCHANNELS=16
      probe vgpu_gpu_ch16_threadfin NCCL_MIN_NCHANNELS=16 VGPU_NCCL_GPU_FIN=0
      # NCCL's legacy cudaMalloc buffers instead of cuMem: the receiver exports them as legacy
      # IPC handles
      probe vgpu_gpu_legacy_ipc NCCL_CUMEM_ENABLE=0
      probe vgpu_gpu_ch16_threads4 NCCL_MIN_NCHANNELS=16 VGPU_NCCL_COPY_THREADS=4
      probe vgpu_gpu_ch16_bigbuf NCCL_MIN_NCHANNELS=16 NCCL_BUFFSIZE=16777216
      # NCCL's socket transport once more: how much the reference moves between runs
      job socket_again 29500 "$NPROC" "${NOPATH[@]}" NCCL_NET=Socket SLICE_PREFIX=a -- --check all_reduce --mib 256 --lead 2
      if [ "${PROBES_OLD:-0}" = 1 ]; then
        probe vgpu_gpu_pieces4 VGPU_NCCL_COPY_PIECES=4
        JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job vgpu_tcp_gdr 29500 "$NPROC" "${NOPATH[@]}" "${PLUG[@]}" NCCL_NET=vgpu VGPU_NCCL_LOCAL=0 NCCL_NET_GDR_LEVEL=SYS SLICE_PREFIX=a -- --check "$CHECK" --mib 256 --lead 2
      fi
    fi
    [ "${ONE_GPU:-0}" = 1 ] && nomps
    ;;
  slices)
    log "slices"
    job slices4 29500 4 "${PLUG[@]}" NCCL_NET=vgpu BENCH_GPU_OF_RANK=0,0,1,1 SLICE_PREFIX=s -- \
      --check "$CHECK" --ops all_reduce,all_gather --mib 128 --lead 2
    JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job slices4_gpu 29500 4 "${PLUG[@]}" NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS BENCH_GPU_OF_RANK=0,0,1,1 SLICE_PREFIX=s -- \
      --check "$CHECK" --ops all_reduce --mib 128 --lead 2
    # SLICES_MPS=1: the GPU path again under MPS, where the two ranks of each GPU run their
    # kernels side by side instead of being time-sliced (the suspected cause of its slowness)
    if [ "${SLICES_MPS:-0}" = 1 ]; then
      mps
      JOB_TIMEOUT=${GPU_PATH_TIMEOUT:-60} job slices4_gpu_mps 29500 4 "${PLUG[@]}" NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS BENCH_GPU_OF_RANK=0,0,1,1 SLICE_PREFIX=s -- \
        --check "$CHECK" --ops all_reduce --mib 128 --lead 2
      nomps
    fi
    ;;
  isolation)
    log "isolation"
    A=(VGPU_TENANT=train VGPU_NCCL_WEIGHT=75 VGPU_NCCL_ACTIVITY_FILE="$SHARE")
    B=(VGPU_TENANT=noisy VGPU_NCCL_WEIGHT=25 VGPU_NCCL_ACTIVITY_FILE="$SHARE")
    job alone_plain 29500 "$NPROC" -- --mib 256
    T0=$(pair_start)
    job tsl_A 29500 "$NPROC" -- --mib 256 --start-at "$T0" & job tsl_B 29501 "$NPROC" -- --mib 256 --start-at "$T0"; wait
    mps
    job mps_alone_A 29500 "$NPROC" "${PLUG[@]}" "${A[@]}" -- --mib 256
    T0=$(pair_start)
    job mps_A 29500 "$NPROC" -- --mib 256 --start-at "$T0" & job mps_B 29501 "$NPROC" -- --mib 256 --start-at "$T0"; wait
    # ISO_CONFIGS: tuner settings to compare, each CHANNELS:EXPONENT (the total channel budget
    # split by weight^EXPONENT); the first is labelled vgpu_A/vgpu_B, the others vgpu_A_cC_eE.
    first=1
    for cfg in ${ISO_CONFIGS:-24:1.2}; do
      c=${cfg%%:*} e=${cfg##*:} sfx=""
      [ $first = 1 ] || sfx="_c${c}_e${e}"
      first=0
      T=(VGPU_NCCL_CHANNELS="$c" VGPU_NCCL_SHARE_EXPONENT="$e")
      T0=$(pair_start)
      job "vgpu_A$sfx" 29500 "$NPROC" "${PLUG[@]}" "${A[@]}" "${T[@]}" -- --mib 256 --start-at "$T0" &
      job "vgpu_B$sfx" 29501 "$NPROC" "${PLUG[@]}" "${B[@]}" "${T[@]}" -- --mib 256 --start-at "$T0"; wait
    done
    # the guarantee against a noisy best-effort neighbour: A guaranteed, B best effort (the
    # agent's VGPU_GUARANTEED); B keeps VGPU_NCCL_BEST_EFFORT_CHANNELS (1) while A is active
    # GBE_FLOORS="1 2": B's channel floor per pair (the first labelled gbe_A/gbe_B)
    first=1
    for fl in ${GBE_FLOORS:-1}; do
      sfx=""
      [ $first = 1 ] || sfx="_f$fl"
      first=0
      T0=$(pair_start)
      job "gbe_A$sfx" 29500 "$NPROC" "${PLUG[@]}" "${A[@]}" VGPU_GUARANTEED=1 -- --mib 256 --start-at "$T0" &
      job "gbe_B$sfx" 29501 "$NPROC" "${PLUG[@]}" "${B[@]}" VGPU_GUARANTEED=0 VGPU_NCCL_BEST_EFFORT_CHANNELS="$fl" -- --mib 256 --start-at "$T0"; wait
    done
    nomps
    ;;
  identity)
    log "identity"
    mps
    IDENV=("${PLUG[@]}" NCCL_DEBUG_SUBSYS=INIT,NET,ENV NCCL_NET=vgpu NCCL_NET_GDR_LEVEL=SYS NCCL_HOSTID=vgpu-node-a-tenant BENCH_GPU_OF_RANK=0,0,0,0 VGPU_SHM_DIR="$MPS_DIR")
    JOB_TIMEOUT=60 job ident_none 29500 2 "${IDENV[@]}" -- --check "$CHECK" --mib 64 --lead 1
    grep -m1 -o "Duplicate GPU detected.*" "$LOGS/ident_none.log" | head -c 200 >"$LOGS/ident_none_refusal.txt"
    JOB_TIMEOUT=90 job ident_env2 29500 2 "${IDENV[@]}" NCCL_ENV_PLUGIN="$SO" -- --check "$CHECK" --mib 256 --lead 2
    JOB_TIMEOUT=90 job ident_env3 29500 3 "${IDENV[@]}" NCCL_ENV_PLUGIN="$SO" -- --check "$CHECK" --mib 128 --lead 2
    grep -h "NCCL_HOSTID set by environment\|vgpu env plugin" "$LOGS"/ident_env*.log | sed 's/^.*NCCL INFO //' | sort | uniq -c >"$LOGS/ident_lines.txt"
    nomps
    ;;
  interposer)
    log "interposer"
    IP=$(realpath "${INTERPOSER:-$DIST/libvgpu_cuda.so}")
    IPSHM=$(mktemp -d /dev/shm/vgpu-nccl-ip.XXXXXX)
    job ip_none 29500 "$NPROC" -- --check "$CHECK" --mib 256 --lead 2
    job ip_tenant 29500 "$NPROC" LD_PRELOAD="$IP" VGPU_TENANT=one VGPU_MEMORY_LIMIT=40GiB \
      VGPU_COMPUTE_SHARES=0:50,1:50 VGPU_BURST=1 VGPU_SHM_DIR="$IPSHM" VGPU_LOG=2 -- --check "$CHECK" --mib 256 --lead 2
    grep -h "^vgpu\[" "$LOGS/ip_tenant.log" | sed -E 's/vgpu\[[0-9]*\]( [0-9:.]+)?/vgpu[pid]/' | sort | uniq -c | sort -rn | head -20 >"$LOGS/ip_tenant_interposer_lines.txt"
    rm -rf "$IPSHM"
    ;;
  overhead)
    log "overhead"
    for r in 1 2; do
      job "noplugin_r$r" 29500 "$NPROC" -- --mib 256
      job "plugin_r$r" 29500 "$NPROC" "${PLUG[@]}" -- --mib 256
    done
    ;;
  esac
done

grep -h "vgpu" "$LOGS"/*.log | grep -E "tuner|connected|net plugin ready" | sort | uniq -c | sort -rn | head -20 >"$LOGS/plugin_lines.txt"
# per job: NCCL's channel count and the same-host path's per-step timing (logged at close)
for f in "$LOGS"/*.log; do
  [ "$(basename "$f")" = run.log ] && continue
  echo "== $(basename "$f" .log): $(grep -m1 -oE 'Channel [0-9]+/[0-9]+' "$f")"
  grep -h -oE 'same-host send closed.*' "$f" | head -2
  grep -h -oE 'same-host recv closed.*' "$f" | head -2
done >"$LOGS/steps.txt"
"$PY" - "$RES" <<'PYEOF' | tee "$LOGS/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| job | ranks | checks | op | busbw GB/s | p50 ms | p99 ms |")
print("| --- | --- | --- | --- | --- | --- | --- |")
by = {}
for r in rows:
    checks = ",".join(f"{k}:{'ok' if v else 'FAIL'}" for k, v in r["checks"].items()) or "-"
    for op, o in r["ops"].items():
        by[r["label"]] = o["busbw_gbs"]
        print(f"| {r['label']} | {r['world']} | {checks} | {op} | {o['busbw_gbs']:.1f} | {o['p50_ms']:.2f} | {o['p99_ms']:.2f} |")
def ratio(a, b):
    return f"{by[a] / by[b]:.2f}" if a in by and b in by and by[b] else "n/a"
print()
win = {r["label"]: (o["start_unix"], o["start_unix"] + o["wall_s"]) for r in rows for o in r["ops"].values() if "start_unix" in o}
for la in sorted(l for l in win if l.endswith("_A") or "_A_" in l):
    lb = la.replace("_A", "_B", 1)
    if lb in win:
        (a0, a1), (b0, b1) = win[la], win[lb]
        both = max(0.0, min(a1, b1) - max(a0, b0))
        print(f"pair {la}/{lb}: measured windows overlap {both:.1f} s of {a1 - a0:.1f} / {b1 - b0:.1f} s")
if "slices4_gpu" in by:
    print(f"slices (4 ranks on 2 GPUs): host path {by.get('slices4', 0):.1f} GB/s, GPU-to-GPU path {by['slices4_gpu']:.1f} GB/s" + (f", GPU-to-GPU under MPS {by['slices4_gpu_mps']:.1f} GB/s" if "slices4_gpu_mps" in by else ""))
print("transport vs NCCL socket: ours TCP", ratio("vgpu_tcp", "socket"), "x; ours same-host (host buffers)", ratio("vgpu_local_host", "socket"), "x; ours GPU-to-GPU", ratio("vgpu_gpu", "socket"), "x")
if "vgpu_gpu_bigbuf" in by:
    print("with larger NCCL buffers (NCCL_BUFFSIZE, both sides): ours GPU-to-GPU", ratio("vgpu_gpu_bigbuf", "socket_bigbuf"), "x NCCL socket; against NCCL socket at its default buffers", ratio("vgpu_gpu_bigbuf", "socket"), "x")
for p in ["tsl", "mps", "vgpu"]:
    a, b = by.get(f"{p}_A"), by.get(f"{p}_B")
    if a and b and by.get("alone_plain"):
        print(f"isolation {p}: A/B = {a/b:.2f} (target 3.00), together {a+b:.1f} = {(a+b)/by['alone_plain']*100:.0f}% of one job alone ({by['alone_plain']:.1f})")
lat = {r["label"]: r["ops"]["all_reduce"]["p50_ms"] for r in rows if "all_reduce" in r["ops"]}
for la in sorted(l for l in lat if l.startswith("vgpu_A")):
    lb = "vgpu_B" + la[len("vgpu_A"):]
    if "mps_alone_A" not in lat or lb not in by:
        continue
    a, b = by[la], by[lb]
    together = f"{(a + b) / by['alone_plain'] * 100:.0f}%" if by.get("alone_plain") else "n/a"
    print(f"guarantee {la[7:] or 'default'}: A/B = {a/b:.2f}, together {together} of one alone; A's p50 next to B {lat[la]:.2f} ms vs alone under MPS {lat['mps_alone_A']:.2f} = {lat[la]/lat['mps_alone_A']:.2f}x; vs alone without MPS {lat.get('alone_plain', 0):.2f} = {lat[la]/lat.get('alone_plain', 1):.2f}x (target 1.15x)")
for la in sorted(l for l in lat if l.startswith("gbe_A")):
    if "mps_alone_A" not in lat:
        continue
    lb = "gbe_B" + la[len("gbe_A"):]
    print(f"guarantee next to a best-effort neighbour{la[5:]}: A's p50 {lat[la]:.2f} ms vs alone under MPS {lat['mps_alone_A']:.2f} = {lat[la]/lat['mps_alone_A']:.2f}x (target 1.15x); A {by.get(la, 0):.1f} GB/s, B {by.get(lb, 0):.1f} GB/s")
for probe in ["vgpu_gpu_noring", "vgpu_gpu_threadfin", "vgpu_gpu_legacy_ipc", "vgpu_gpu_threads4", "vgpu_gpu_ch16", "vgpu_gpu_ch16_threadfin", "vgpu_gpu_ch16_threads4", "vgpu_gpu_ch16_bigbuf", "vgpu_gpu_pieces4", "vgpu_tcp_gdr", "socket_again"]:
    if probe in by:
        print(f"probe {probe}: {by[probe]:.1f} GB/s ({ratio(probe, 'socket')}x NCCL socket)")
import os
refusal = os.path.join(os.path.dirname(sys.argv[1]), "ident_none_refusal.txt")
if os.path.exists(refusal):
    ref = open(refusal).read().strip()
    without = "refused: " + ref if ref else ("ran" if "ident_none" in by else "failed without the refusal message (see ident_none.log)")
    print(f"identity: 2 ranks on one GPU, one NCCL_HOSTID, no env plugin: {without}; with the env plugin: 2 ranks {by.get('ident_env2', 0):.1f} GB/s, 3 ranks {by.get('ident_env3', 0):.1f} GB/s (checks in the table)")
if "ip_tenant" in by:
    print(f"interposer: one tenant's collectives across 2 GPUs under libvgpu_cuda.so: {by['ip_tenant']:.1f} GB/s vs {by.get('ip_none', 0):.1f} without (checks in the table)")
if "plugin_r1" in by:
    n = (by.get("noplugin_r1", 0) + by.get("noplugin_r2", 0)) / 2
    p = (by.get("plugin_r1", 0) + by.get("plugin_r2", 0)) / 2
    print(f"overhead: plugin loaded, no sharing: {p:.1f} vs {n:.1f} without = {(1 - p / n) * 100:.1f}% cost")
PYEOF
