#!/usr/bin/env bash
# Issue 17's three jobs (tests/gpu/memory_jobs.sh) REPEATS (3) times in one device call: the first
# run in full (alone, plain, vgpu), the later ones only the vgpu phase against the first run's
# alone phase (ALONE_LOGS, PLAIN=0), each under what is left of DEADLINE_S (570). One passing run
# is no evidence that the jobs never hang (two of three hung before the schedule fix of
# dccdfb9); this gives three data points for about 7 minutes of device time. With ALONE_LOGS set
# (an earlier run's memory_jobs directory on the same machine), every run is a vgpu phase only.
# Each run's table is in its output.txt, all logs in $OUT/logs.tar.gz; a summary table is
# printed last. Exit status 0 when every run passed.
#
#   VGPU_BIN=dist tests/gpu/memory_jobs_repeat.sh
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
OUT_ROOT=${OUT:-$(mktemp -d)}
REPEATS=${REPEATS:-3}
DEADLINE_S=${DEADLINE_S:-570}
began=$(date +%s)
alone=${ALONE_LOGS:-}
rows=()
failed=0
# got RESULTS CHECK-PREFIX: the "got" column of the row whose check starts with CHECK-PREFIX
got() { awk -F'\t' -v p="$2" 'index($1, p) == 1 {print $3}' "$1" 2>/dev/null | head -n1; }
for r in $(seq 1 "$REPEATS"); do
  left=$((DEADLINE_S - ($(date +%s) - began)))
  need=$([ -n "$alone" ] && echo 150 || echo 300)
  if [ "$left" -lt "$need" ]; then
    rows+=("| $r | not run: ${left} s left of ${DEADLINE_S} s | | | |")
    failed=1
    break
  fi
  out="$OUT_ROOT/run$r"
  mkdir -p "$out"
  extra=()
  [ -n "$alone" ] && extra=(ALONE_LOGS="$alone" PLAIN=0)
  echo "=== run $r (at most $((left - 10)) s) ==="
  env OUT="$out" VGPU_PORT=$((7480 + r)) JOB_TIMEOUT="${JOB_TIMEOUT:-130}" "${extra[@]}" \
    timeout -k 15 $((left - 10)) "$ROOT/tests/gpu/memory_jobs.sh" >"$out/output.txt" 2>&1
  status=$?
  tail -n 12 "$out/output.txt"
  results="$out/memory_jobs/results.tsv"
  [ -n "$alone" ] || alone="$out/memory_jobs"
  [ "$status" = 0 ] || failed=1
  rows+=("| $r | $([ "$status" = 0 ] && echo PASS || echo "FAIL (exit $status)") | $(got "$results" "through vgpu, the three at once") | $(got "$results" "through vgpu: results identical") | $(got "$results" "total time") |")
done
pack_logs "$OUT_ROOT" $(seq -f 'run%g' 1 "$REPEATS")
echo
echo "| run | result | finished | identical digests | vgpu against one after another |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit "$failed"
