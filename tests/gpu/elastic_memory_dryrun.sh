#!/usr/bin/env bash
# A dry run of tests/gpu/elastic_memory.sh on a machine without a GPU: the real vgpu-cp,
# vgpu-agent (simulating one H100-80GB: VGPU_AGENT_SIMULATE) and interposer, the interposer's fake
# driver (nodeagent/interposer/tests/abi/fakecuda.c, playing the simulated GPU's uuid through
# FAKE_CUDA_UUID), a stand-in for PyTorch over the driver API (tests/gpu/dryrun/torch: tensors
# hold no bytes) and an `nvidia-smi` that says 80 GiB. It checks the script's own logic and the
# agent and interposer together (the board the agent writes, the borrowing, the reports), not a
# GPU. Run from the repository root after
#
#   cargo build -p vgpu-cp -p vgpu-agent -p vgpuctl -p interposer
#   cargo test -p interposer --test abi elastic     # builds the fake driver (target/tmp/abi)
#   tests/gpu/elastic_memory_dryrun.sh              # TARGET=target/debug by default
#   RECLAIM=1 tests/gpu/elastic_memory_dryrun.sh    # the swap scenario (see below)
#   RECLAIM=1 HINT=1 tests/gpu/elastic_memory_dryrun.sh   # vgpu.torch's helper through the real .so
#   RECLAIM=1 COLD=1 tests/gpu/elastic_memory_dryrun.sh   # vgpu.torch.mark_cold: cold chunks go first
#   RECLAIM=1 FULL=1 tests/gpu/elastic_memory_dryrun.sh   # the node's swap space runs out: a clear
#                                                    # refusal (2026-11-29: every row PASS but "does not fit")
#   SCRIPT=swap_exchange.sh tests/gpu/elastic_memory_dryrun.sh   # another script of tests/gpu (its
#                                                    # torch link measurement is skipped: LINK=0)
#   SCRIPT=redistribute.sh ALONE_S=12 PAIR_S=40 EQUAL_S=30 OFF_S=15 MEASURE_S=20 OFF_MEASURE_S=10 \
#     tests/gpu/elastic_memory_dryrun.sh    # the agent with --mps (a stand-in MPS control program);
#                                           # the fake's kernels take no SMs, so no cap pays here
#
# With RECLAIM=1 the swap runs on simulated sizes (the fake's copies move no bytes, so the
# checksums are the stand-in's remembered sums, not a test of contents: the ABI tests check those),
# and this `nvidia-smi` always says 0 MiB used, so the row "does not fit in what the GPU has free"
# fails here by construction; the others check the script's path (the rates are those of copies
# that move nothing). The stand-in keeps freed tensors' blocks cached as PyTorch's allocator does,
# so with HINT=1 the hint helper (deploy/python/vgpu/torch.py) gives them back through the real
# interposer's exports, and with COLD=1 the chunks marked cold are the ones swapped out
# (2026-11-29: every row PASS but "does not fit", both).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARGET=${TARGET:-${CARGO_TARGET_DIR:-$ROOT/target}}
FAKE="$TARGET/tmp/abi/libcuda.so.1"
STUBS=$(mktemp -d)
trap 'rm -rf "$STUBS"' EXIT
for artefact in debug/vgpu-cp debug/vgpu-agent debug/vgpuctl debug/libvgpu_cuda.so tmp/abi/libcuda.so.1; do
  [ -e "$TARGET/$artefact" ] || { echo "missing $TARGET/$artefact (see the header)" >&2; exit 2; }
done
mkdir -p "$STUBS/lib"
cp "$FAKE" "$STUBS/lib/"
cat >"$STUBS/nvidia-smi" <<'STUB'
#!/bin/sh
case "$*" in
*memory.used*) echo 0 ;;
*nounits*) echo 81920 ;;
*) echo "NVIDIA H100 80GB HBM3 (dry run: fake driver), 0.0, 81920 MiB" ;;
esac
STUB
# python3 with the stand-in PyTorch; inside a tenant (VGPU_SHM_DIR set) the fake driver plays the
# GPU whose memory board the agent linked there.
cat >"$STUBS/python" <<STUB
#!/bin/sh
if [ -n "\${VGPU_SHM_DIR:-}" ]; then
  FAKE_CUDA_UUID=\$(ls "\$VGPU_SHM_DIR" | sed -n 's/\\.memory\$//p' | head -n1)
  export FAKE_CUDA_UUID
  # the chunks' sizes are simulated: their staging is mapped, never touched
  export VGPU_MEMORY_STAGING_TOUCH=0
fi
PYTHONPATH="$ROOT/tests/gpu/dryrun" exec python3 "\$@"
STUB
# nvidia-cuda-mps-control's contract for an agent started with --mps (redistribute.sh): -d makes
# the control pipe, a command on stdin answers while it exists, quit removes it.
cat >"$STUBS/nvidia-cuda-mps-control" <<'STUB'
#!/bin/sh
if [ "${1:-}" = "-d" ]; then
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" && : >"$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || exit 1
read -r command
[ "$command" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
STUB
chmod +x "$STUBS/nvidia-smi" "$STUBS/python" "$STUBS/nvidia-cuda-mps-control"
PATH="$STUBS:$PATH" PY="$STUBS/python" VGPU_BIN="$TARGET/debug" VGPU_AGENT_SIMULATE=1xH100-80GB \
  LD_LIBRARY_PATH="$STUBS/lib" VGPU_REAL_LIBCUDA="$STUBS/lib/libcuda.so.1" \
  LINK=0 "$ROOT/tests/gpu/${SCRIPT:-elastic_memory.sh}"
