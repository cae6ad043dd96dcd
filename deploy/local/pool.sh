#!/usr/bin/env bash
# Starts a local vgpu pool on this machine: one control-plane member and one node agent with
# simulated GPUs (8 x H100 80GB, all NVLink-connected). Ctrl-C stops both.
#
#   ./deploy/local/pool.sh                 # build (release) and start
#   VGPU_SIMULATE=path/to/topology.toml ./deploy/local/pool.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

port="${VGPU_PORT:-7401}"
# A development pool on loopback: plain text, no certificates (docs/security.md for mTLS).
export VGPU_CP_INSECURE=true VGPU_AGENT_INSECURE=true VGPUCTL_INSECURE=true
state="${VGPU_LOCAL_DIR:-$PWD/.vgpu-local}"
simulate="${VGPU_SIMULATE:-8xH100-80GB}"

# vgpu-cp's etcd client compiles etcd's protos with a system protoc (README, "Build").
if [ -z "${PROTOC:-}" ] && ! command -v protoc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing protoc (Debian's protobuf-compiler)..." >&2
    apt-get install -y -qq protobuf-compiler >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq protobuf-compiler >/dev/null; }
  else
    echo "pool.sh: building vgpu-cp needs protoc: install it (Debian/Ubuntu: sudo apt-get install protobuf-compiler) or set PROTOC to one" >&2
    exit 1
  fi
fi
echo "building vgpu (release)..." >&2
cargo build --release --quiet --bins -p vgpu-cp -p vgpu-agent -p vgpuctl
target_dir="${CARGO_TARGET_DIR:-target}"
case "$target_dir" in /*) ;; *) target_dir="$PWD/$target_dir" ;; esac
bin="$target_dir/release"
mkdir -p "$state"

if "$bin/vgpuctl" --endpoints "127.0.0.1:$port" --timeout 1s cluster status >/dev/null 2>&1; then
  echo "something already answers on 127.0.0.1:$port (another pool?); stop it or set VGPU_PORT" >&2
  exit 1
fi
"$bin/vgpu-cp" bootstrap --id 1 --listen "127.0.0.1:$port" --data-dir "$state/cp1" 2>"$state/cp1.log" &
cp_pid=$!
trap 'kill $cp_pid ${agent_pid:-} 2>/dev/null; wait 2>/dev/null' EXIT INT TERM

for _ in $(seq 100); do
  if ! kill -0 "$cp_pid" 2>/dev/null; then
    echo "vgpu-cp exited; its log ($state/cp1.log) ends with:" >&2
    tail -n 5 "$state/cp1.log" >&2
    exit 1
  fi
  "$bin/vgpuctl" --endpoints "127.0.0.1:$port" cluster status >/dev/null 2>&1 && break
  sleep 0.1
done
"$bin/vgpu-agent" join --control-plane "127.0.0.1:$port" --name node-a --simulate "$simulate" \
  --state-dir "$state/agent-node-a" 2>"$state/agent.log" &
agent_pid=$!

for _ in $(seq 100); do
  "$bin/vgpuctl" --endpoints "127.0.0.1:$port" get nodes 2>/dev/null | grep -q node-a && break
  sleep 0.1
done
"$bin/vgpuctl" --endpoints "127.0.0.1:$port" get nodes

cat <<TXT

vgpu pool running: control plane at 127.0.0.1:$port, node-a with simulated GPUs ($simulate).
It runs with --insecure (plain text, everyone an admin): for this machine only.
Logs and data: $state

Try:
  export PATH="$bin:\$PATH" VGPU_ENDPOINTS=127.0.0.1:$port VGPUCTL_INSECURE=true
  vgpuctl place infer-a --gpus 0.25 --memory 20GiB
  vgpuctl place train-b --gpus 4 --nvlink
  vgpuctl get tenants
  vgpuctl describe node node-a
  curl -s http://127.0.0.1:$port/metrics | grep vgpu_pool

Ctrl-C stops the pool (its state stays in $state; run again to restart from it).
TXT
wait
