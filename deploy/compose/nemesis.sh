#!/usr/bin/env bash
# Breaks the compose cluster on purpose and checks what clients saw: builds the images (debug
# binaries, deploy/docker/build.sh), starts three members and two simulated agents under a
# unique compose project (with mutual TLS, as docker-compose.yml runs it; the clients use the
# cluster's admin certificate, copied out of cp1), runs the `nemesis` binary of the tests crate
# (clients place, release and read tenants through the members' published ports while the leader
# is cut off the network, paused, members are killed with SIGKILL and restarted, and every member
# is restarted in turn), and always tears the project down (`down -v`).
#
# The run fails on a linearizability violation, a lost acknowledged write, or a request that
# failed for good during the rolling restart. It then keeps the history (history.jsonl), the
# summary and `docker logs` of every container in a directory it prints; a passing run deletes it
# unless VGPU_NEMESIS_KEEP=1.
#
#   deploy/compose/nemesis.sh
#   VGPU_SKIP_BUILD=1 deploy/compose/nemesis.sh        # images vgpu/*:nemesis already built
#   deploy/compose/nemesis.sh --doctor-stale-read       # self-test: must fail with a violation
#   deploy/compose/nemesis.sh --clients 8 --fault-seconds 12   # other arguments go to the binary
#   VGPU_NEMESIS_INSECURE=1 deploy/compose/nemesis.sh   # plain text (compose/insecure.yml), to compare
#
# Works with `docker compose` (v2) and `docker-compose` (v1).
set -euo pipefail
cd "$(dirname "$0")/../.."

file=deploy/compose/docker-compose.yml
# Each member also gets a network of its own for its published port (see the file).
override=deploy/compose/nemesis.override.yml
files=(-f "$file" -f "$override")
if [ -n "${VGPU_NEMESIS_INSECURE:-}" ]; then
  files+=(-f deploy/compose/insecure.yml)
fi
project="vgpu-nemesis-$$-$(date +%s)"
export VGPU_TAG="${VGPU_TAG:-nemesis}"
started=$(date +%s)

if docker compose version >/dev/null 2>&1; then
  compose=(docker compose "${files[@]}" -p "$project")
elif command -v docker-compose >/dev/null 2>&1; then
  compose=(docker-compose "${files[@]}" -p "$project")
else
  echo "nemesis.sh: neither 'docker compose' nor 'docker-compose' is installed" >&2
  exit 1
fi

step() { echo "[nemesis.sh $(($(date +%s) - started))s] $*" >&2; }

# Three free loopback ports for the members' published API ports.
read -r port1 port2 port3 < <(python3 -c '
import socket
sockets = [socket.socket() for _ in range(3)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))
')
export VGPU_COMPOSE_PORT="$port1" VGPU_COMPOSE_PORT_CP2="$port2" VGPU_COMPOSE_PORT_CP3="$port3"

out="${VGPU_NEMESIS_OUT:-$PWD/target/nemesis/$project}"
mkdir -p "$out"

finish() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    step "collecting docker logs of every container into $out/logs"
    mkdir -p "$out/logs"
    "${compose[@]}" ps >"$out/logs/ps.txt" 2>&1 || true
    for id in $(docker ps -aq --filter "label=com.docker.compose.project=$project"); do
      name="$(docker inspect --format '{{.Name}}' "$id" | tr -d /)"
      docker logs --timestamps "$id" >"$out/logs/$name.log" 2>&1 || true
    done
  fi
  step "tearing down project $project"
  "${compose[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
  if [ "$status" -ne 0 ]; then
    echo "nemesis.sh: FAILED (exit $status); history, summary and container logs kept in $out" >&2
  elif [ -n "${VGPU_NEMESIS_KEEP:-}" ]; then
    echo "nemesis.sh: passed; history and summary kept in $out" >&2
  else
    rm -rf "$out"
    echo "nemesis.sh: passed" >&2
  fi
  exit "$status"
}
trap finish EXIT

step "building the nemesis binary"
cargo build --quiet -p tests --bin nemesis
if [ -z "${VGPU_SKIP_BUILD:-}" ]; then
  step "building images vgpu/*:$VGPU_TAG (debug binaries)"
  TAG="$VGPU_TAG" PROFILE=debug deploy/docker/build.sh >"$out/build.log" 2>&1 ||
    { cat "$out/build.log" >&2; exit 1; }
fi

step "starting project $project (members published on 127.0.0.1:$port1, $port2, $port3)"
"${compose[@]}" up -d

if [ -n "${VGPU_NEMESIS_INSECURE:-}" ]; then
  transport=(--insecure)
else
  # The admin certificate from the cluster's `tls` volume (mounted in cp1 at /etc/vgpu/tls); the
  # members' certificates name 127.0.0.1, the address the clients use.
  step "copying the CA certificate and the admin certificate out of cp1"
  cp1="$("${compose[@]}" ps -q cp1)"
  mkdir -p "$out/tls"
  for path in ca/ca.crt admin.crt admin.key; do
    docker cp "$cp1:/etc/vgpu/tls/$path" "$out/tls/"
  done
  transport=(--tls-ca-cert "$out/tls/ca.crt" --tls-cert "$out/tls/admin.crt" --tls-key "$out/tls/admin.key")
fi

step "running the nemesis"
"${CARGO_TARGET_DIR:-target}/debug/nemesis" \
  --project "$project" \
  --members "cp1=127.0.0.1:$port1,cp2=127.0.0.1:$port2,cp3=127.0.0.1:$port3" \
  --out "$out" \
  "${transport[@]}" \
  "$@"
step "the nemesis found no violation"
