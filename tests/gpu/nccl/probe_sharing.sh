#!/usr/bin/env bash
# Design probe for issue 4 (2 x H200): how two NCCL jobs on one GPU pair share NVLink with and
# without MPS, with channel caps set through NCCL_MAX_CTAS. No vgpu code is involved: this is the
# measurement that chose the design (docs/design/nccl-sharing.md). Prints a table last.
#   tests/gpu/nccl/probe_sharing.sh            (OUT=dir keeps logs there)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-python3}
BENCH="$ROOT/tests/gpu/nccl/bench.py"
LOGS="${OUT:-$(mktemp -d)}/probe_sharing"
mkdir -p "$LOGS"
RES="$LOGS/results.jsonl"
: >"$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MPS_DIR=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
SECONDS_RUN=${SECONDS_RUN:-8}
cleanup() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; rm -rf "$MPS_DIR"; }
trap cleanup EXIT

job() { # job LABEL PORT CTAS [env...]
  local label=$1 port=$2 ctas=$3; shift 3
  env "$@" NCCL_MAX_CTAS="$ctas" timeout 120 "$PY" -m torch.distributed.run --nproc_per_node=2 \
    --master_port="$port" "$BENCH" --label "$label" --seconds "$SECONDS_RUN" --out "$RES" \
    >"$LOGS/$label.log" 2>&1
}
mps() { nvidia-cuda-mps-control -d; sleep 1; }
nomps() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 2; }

"$PY" - <<'PYEOF' | tee "$LOGS/gpu.txt"
import torch, cupy
for d in range(torch.cuda.device_count()):
    print("gpu", d, torch.cuda.get_device_name(d),
          "GPUDirectRDMASupported", cupy.cuda.runtime.deviceGetAttribute(116, d),
          "sms", torch.cuda.get_device_properties(d).multi_processor_count)
print("can_access_peer", torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None)
PYEOF

job alone24 29500 24
job alone18 29500 18
job alone6 29500 6
job pair18 29500 18 & job pair6 29501 6; wait
mps
job mps_alone24 29500 24
job mps_alone18 29500 18
job mps_pair18 29500 18 & job mps_pair6 29501 6; wait
job mps_pair24a 29500 24 & job mps_pair24b 29501 24; wait
nomps

"$PY" - "$RES" <<'PYEOF' | tee "$LOGS/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| job | busbw GB/s | p50 ms | p99 ms |")
print("| --- | --- | --- | --- |")
for r in rows:
    o = r["ops"]["all_reduce"]
    print(f"| {r['label']} | {o['busbw_gbs']:.1f} | {o['p50_ms']:.2f} | {o['p99_ms']:.2f} |")
PYEOF
