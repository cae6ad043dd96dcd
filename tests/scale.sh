#!/usr/bin/env bash
# The scale benchmark recorded in docs/benchmarks.md ("Scale: a simulated fleet"): a three-member
# control plane (release binaries) under `vgpu-agent simulate-fleet`, with placements running.
# Builds in its own target directory (so it does not hold the workspace's lock for long), then
# runs tests/src/bin/scale_bench.rs once per node count.
#
#   tests/scale.sh [OUT_DIR] [scale-bench flags...]
#   NODES="1000" WINDOW_SECONDS=30 tests/scale.sh /tmp/scale --perf
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/scale-target}"
out="${1:-/tmp/scale-bench-$(date -u +%Y%m%d-%H%M%S)}"
shift || true
nodes_list="${NODES:-1000 10000}"
window="${WINDOW_SECONDS:-60}"
mkdir -p "$out"
cargo build --release -p vgpu-cp -p vgpu-agent -p vgpuctl -p tests
for nodes in $nodes_list; do
    echo "== $nodes nodes x 8 GPUs, ${window} s window; results in $out/$nodes.txt"
    "$CARGO_TARGET_DIR/release/scale-bench" --nodes "$nodes" --seconds "$window" \
        --rate 20 --live-tenants 500 --out-dir "$out/$nodes" "$@" | tee "$out/$nodes.txt"
done
