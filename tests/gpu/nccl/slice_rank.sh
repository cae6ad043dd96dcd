#!/usr/bin/env bash
# torchrun --no-python wrapper: gives each local rank its own NCCL host identity, as the agent
# does for each GPU slice (so NCCL treats every slice as its own device instead of failing with
# "Duplicate GPU detected"), then runs python with the remaining arguments.
# Without SLICE_PREFIX the ranks keep the host identity NCCL derives (one host, NVLink P2P).
[ -n "${SLICE_PREFIX:-}" ] && export NCCL_HOSTID="vgpu-slice-${SLICE_PREFIX}-${LOCAL_RANK}"
exec "${PYTHON:-python3}" "$@"
