# Result-table and process helpers shared by the GPU scripts that run tenants under one vgpu node
# (sourced after procs.sh, not run). The caller sets LOGS, RESULTS (a TSV file), PY, and for
# `usage_field` BIN and EP; `cleanup` stops every process in PIDS (and any other background job),
# then removes WORK and SHM.
# shellcheck shell=bash

# exited PID: the process is gone or a zombie (ours, not reaped yet).
exited() { ! kill -0 "$1" 2>/dev/null || [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ]; }
cleanup() {
  # every process this script started (tracked in PIDS, and any other background job): TERM
  # first, which `timeout` passes on to a tenant's Python (so its GPU memory goes with it), KILL
  # after 10 s, then a wait for exactly those: a bare `wait` would block on anything left
  local rc=$? pid all
  trap - EXIT
  all="${PIDS[*]} $(jobs -p)"
  for pid in $all; do kill "$pid" 2>/dev/null; done
  for pid in $all; do
    bounded_wait 10 "process $pid to exit after TERM" exited "$pid" || kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  rm -rf "$WORK" "$SHM"
  exit "$rc"
}
log() { echo "[$(date +%T)] $*" | tee -a "$LOGS/run.log"; }
# record CHECK EXPECTED GOT VERDICT: a row of the result table.
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"; log "$4: $1 (expected $2, got $3)"; }
verdict() { if [ "${1:-}" = 1 ]; then echo PASS; else echo FAIL; fi; }
# field LOG KEY: a field of a run's last RESULT json ("a.b" for nested), "" if absent.
field() {
  local json
  json=$(grep '^RESULT ' "$1" 2>/dev/null | tail -n1 | sed 's/^RESULT //')
  [ -n "$json" ] || json='{}'
  "$PY" -c '
import json, sys
v = json.loads(sys.argv[1])
for k in sys.argv[2].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print("" if v is None else v)' "$json" "$2"
}
# usage_field TENANT FIELD: the tenant's first usage entry, from `describe tenant -o json`.
usage_field() {
  timeout 30 "$BIN/vgpuctl" --insecure --endpoints "$EP" describe tenant "$1" -o json 2>/dev/null | "$PY" -c '
import json, sys
try:
    u = (json.load(sys.stdin).get("usage") or [{}])[0]
except ValueError:
    u = {}
print(u.get(sys.argv[1], ""))' "$2"
}
