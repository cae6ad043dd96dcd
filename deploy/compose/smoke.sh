#!/usr/bin/env bash
# Runs the compose cluster end to end and checks it: builds the images (deploy/docker/build.sh),
# starts three control-plane members and two simulated agents with mutual TLS (the compose file's
# certificate services make the CA and certificates, the agents join with a bootstrap token),
# waits for 3 voters and 2 ready nodes, places a tenant (a 2-node gang, so both agents get
# slices), checks the placement from the control plane and from each agent's state, checks that a
# plain-text client and a client certificate of another CA are refused, releases the tenants, and
# tears everything down (`down -v`). Exits non-zero on any failure, after printing the
# containers' logs.
#
#   deploy/compose/smoke.sh
#   VGPU_SKIP_BUILD=1 deploy/compose/smoke.sh     # use images already built
#
# Works with `docker compose` (v2) and `docker-compose` (v1).
set -euo pipefail
cd "$(dirname "$0")/../.."

file=deploy/compose/docker-compose.yml
project="${VGPU_COMPOSE_PROJECT:-vgpu-smoke}"
export VGPU_COMPOSE_PORT="${VGPU_COMPOSE_PORT:-17401}"
started=$(date +%s)
stranger=""

if docker compose version >/dev/null 2>&1; then
  compose=(docker compose -f "$file" -p "$project")
elif command -v docker-compose >/dev/null 2>&1; then
  compose=(docker-compose -f "$file" -p "$project")
else
  echo "smoke.sh: neither 'docker compose' nor 'docker-compose' is installed" >&2
  exit 1
fi

step() { echo "[$(($(date +%s) - started))s] $*" >&2; }
# vgpuctl inside cp1's container (the image has no shell; exec runs the binary directly), with
# the admin certificate that the compose file gives it (VGPUCTL_TLS_*).
vgpuctl() { "${compose[@]}" exec -T cp1 /usr/local/bin/vgpuctl "$@"; }
agent() { local node="$1"; shift; "${compose[@]}" exec -T "$node" /usr/local/bin/vgpu-agent "$@"; }
json() { python3 -c "import json, sys; data = json.load(sys.stdin); print($1)"; }

# wait_until WHAT SECONDS COMMAND...: polls COMMAND until it succeeds.
wait_until() {
  local what="$1" seconds="$2"
  shift 2
  local deadline=$(($(date +%s) + seconds))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "smoke.sh: timed out after ${seconds}s waiting for $what" >&2
      return 1
    fi
    sleep 1
  done
  step "$what"
}

finish() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    echo "smoke.sh: FAILED (exit $status); container logs follow" >&2
    "${compose[@]}" ps >&2 || true
    "${compose[@]}" logs --no-color --tail 60 >&2 || true
  fi
  step "tearing down"
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  if [ -n "$stranger" ]; then rm -rf "$stranger"; fi
  step "done (exit $status)"
  exit "$status"
}
trap finish EXIT

if [ -z "${VGPU_SKIP_BUILD:-}" ]; then
  step "building images"
  deploy/docker/build.sh
fi

step "starting the cluster"
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
"${compose[@]}" up -d

three_voters() {
  [ "$(vgpuctl cluster status -o json | json "sum(1 for m in data['members'] if m['voter'])")" = 3 ]
}
two_ready_nodes() {
  [ "$(vgpuctl get nodes -o json | json "sum(1 for n in data if n['state'] == 'ready')")" = 2 ]
}
wait_until "3 voters" 120 three_voters
wait_until "2 ready nodes" 60 two_ready_nodes
vgpuctl cluster status
vgpuctl get nodes

step "placing a tenant: 2 nodes x 4 NVLink-connected GPUs"
vgpuctl place smoke-gang --gpus 4 --nodes 2 --nvlink
state="$(vgpuctl get tenants smoke-gang -o json | json "data['state']")"
[ "$state" = placed ] || { echo "smoke.sh: smoke-gang is $state, not placed" >&2; exit 1; }
nodes="$(vgpuctl get tenants smoke-gang -o json | json "' '.join(sorted({s['node'] for s in data['slices']}))")"
[ "$nodes" = "node-a node-b" ] || { echo "smoke.sh: smoke-gang is on '$nodes'" >&2; exit 1; }

# Each agent followed the assignment into its state directory: its `env` shows 4 GPUs.
for node in node-a node-b; do
  gpus_on_node() {
    agent "$1" env --tenant smoke-gang -o json |
      json "len(data['CUDA_VISIBLE_DEVICES'].split(','))" | grep -qx 4
  }
  wait_until "$node holds its 4 GPUs of smoke-gang" 30 gpus_on_node "$node"
done

step "placing a fractional tenant on zone=b"
vgpuctl place smoke-frac --gpus 0.25 --memory 20GiB --selector zone=b
[ "$(vgpuctl get tenants smoke-frac -o json | json "data['slices'][0]['node']")" = node-b ]
step "reading through the published port 127.0.0.1:$VGPU_COMPOSE_PORT with the admin certificate"
# The vgpuctl image (uid 65532, as the certificate services) with cp1's volumes: the `tls` one
# at /etc/vgpu/tls.
host_vgpuctl() {
  docker run --rm --network host --volumes-from "$("${compose[@]}" ps -q cp1):ro" \
    "vgpu/vgpuctl:${VGPU_TAG:-dev}" --endpoints "127.0.0.1:$VGPU_COMPOSE_PORT" --timeout 5s "$@"
}
tls=(--tls-ca-cert /etc/vgpu/tls/ca/ca.crt --tls-cert /etc/vgpu/tls/admin.crt --tls-key /etc/vgpu/tls/admin.key)
host_vgpuctl "${tls[@]}" get tenants

step "checking that plain text and a certificate of another CA are refused"
if refused="$(host_vgpuctl --insecure get tenants 2>&1)"; then
  echo "smoke.sh: a plain-text client (--insecure) was answered; the cluster is not running TLS" >&2
  exit 1
fi
step "plain text refused: $refused"
# An admin certificate from a throw-away CA (made with the vgpu-cp image, uid 65532, in a
# directory of this host) must fail the handshake.
stranger="$(mktemp -d)"
chmod 0777 "$stranger"
vgpu_cp_in_stranger() {
  docker run --rm -v "$stranger:/var/lib/vgpu-cp" --entrypoint /usr/local/bin/vgpu-cp \
    "vgpu/vgpu-cp:${VGPU_TAG:-dev}" "$@" >/dev/null
}
vgpu_cp_in_stranger ca init --dir /var/lib/vgpu-cp
vgpu_cp_in_stranger cert issue --ca-dir /var/lib/vgpu-cp --role admin --name stranger \
  --out-dir /var/lib/vgpu-cp
if refused="$(docker run --rm --network host --volumes-from "$("${compose[@]}" ps -q cp1):ro" \
  -v "$stranger:/stranger:ro" "vgpu/vgpuctl:${VGPU_TAG:-dev}" \
  --endpoints "127.0.0.1:$VGPU_COMPOSE_PORT" --timeout 5s --tls-ca-cert /etc/vgpu/tls/ca/ca.crt \
  --tls-cert /stranger/stranger.crt --tls-key /stranger/stranger.key get tenants 2>&1)"; then
  echo "smoke.sh: an admin certificate of another CA was accepted" >&2
  exit 1
fi
# Refused in the handshake, not for an unreadable file.
case "$refused" in
  *"transport error"*) step "foreign certificate refused: $refused" ;;
  *) echo "smoke.sh: the foreign-certificate client failed for another reason: $refused" >&2; exit 1 ;;
esac

step "releasing"
vgpuctl release smoke-gang
vgpuctl release smoke-frac
[ "$(vgpuctl get tenants -o json | json "len(data)")" = 0 ]
step "smoke test passed"
