#!/usr/bin/env bash
# Checks the systemd units without installing them:
#   1. `systemd-analyze verify` (ExecStart pointed at the built binaries); any message fails,
#      except systemd < 254 not knowing RestartSteps/RestartMaxDelaySec (it ignores them);
#   2. `systemd-analyze security --offline` prints each unit's exposure level;
#   3. sd_notify: vgpu-cp sends READY=1 once it serves and STOPPING=1 on SIGTERM, as Type=notify
#      needs (a Python datagram socket stands in for systemd).
# Needs: systemd-analyze (Debian package `systemd`), python3, and the binaries built
# (`cargo build --release -p vgpu-cp -p vgpu-agent`; PROFILE=debug uses target/debug).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "verify.sh: systemd-analyze is missing; install it with 'apt-get install systemd'" >&2
  exit 1
fi
profile="${PROFILE:-release}"
bin="${CARGO_TARGET_DIR:-$PWD/target}/$profile"
for binary in vgpu-cp vgpu-agent; do
  [ -x "$bin/$binary" ] || { echo "verify.sh: $bin/$binary is missing; build it first" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for unit in vgpu-cp vgpu-agent; do
  sed "s#/usr/local/bin/$unit#$bin/$unit#" "deploy/systemd/$unit.service" >"$work/$unit.service"
done

messages="$(systemd-analyze verify "$work"/*.service 2>&1 || true)"
version="$(systemd-analyze --version | awk 'NR==1 {print $2}')"
if [ "$version" -lt 254 ]; then
  messages="$(grep -v -E "Unknown key '(RestartSteps|RestartMaxDelaySec)'" <<<"$messages" || true)"
fi
if [ -n "$messages" ]; then
  echo "$messages" >&2
  echo "verify.sh: systemd-analyze verify complained (systemd $version)" >&2
  exit 1
fi
echo "systemd-analyze verify: both units clean (systemd $version)"

for unit in vgpu-cp vgpu-agent; do
  systemd-analyze security --offline=yes "$work/$unit.service" 2>/dev/null | tail -1 || true
done

# sd_notify: READY=1 after start, STOPPING=1 after SIGTERM.
socket="$work/notify"
python3 - "$socket" >"$work/notify.log" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(30)
for _ in range(2):
    print(s.recv(4096).decode(), flush=True)
PY
listener=$!
for _ in $(seq 50); do [ -S "$socket" ] && break; sleep 0.1; done
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
NOTIFY_SOCKET="$socket" "$bin/vgpu-cp" bootstrap --id 1 --listen "127.0.0.1:$port" \
  --data-dir "$work/cp" --insecure 2>"$work/cp.log" &
member=$!
for _ in $(seq 100); do grep -q READY=1 "$work/notify.log" && break; sleep 0.1; done
kill -TERM "$member"
wait "$member" || true
wait "$listener" || true
if ! grep -q '^READY=1$' "$work/notify.log" || ! grep -q '^STOPPING=1$' "$work/notify.log"; then
  cat "$work/notify.log" "$work/cp.log" >&2
  echo "verify.sh: vgpu-cp did not send READY=1 and STOPPING=1" >&2
  exit 1
fi
echo "sd_notify: vgpu-cp sent READY=1 and STOPPING=1"
