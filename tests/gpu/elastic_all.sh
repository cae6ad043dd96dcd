#!/usr/bin/env bash
# Issue 17's checks on one GPU in one call (so that a session's device time goes to measuring, not
# to starting machines): runs, one after another, each under its own time limit and all within
# DEADLINE_S (default 570, under the device tool's 600 s per call):
#   1. RECLAIM=1 tests/gpu/elastic_memory.sh            the reclaim: time against bytes / 45 GB/s,
#                                                       swap-out rate, checksums, none refused
#   2. RECLAIM=1 LATENCY=1 tests/gpu/elastic_memory.sh  a latency tenant's p99 during the reclaim
#   3. tests/gpu/memory_jobs.sh                         three training jobs at 1.5x the memory
#   4. RECLAIM=1 HINT=1 tests/gpu/elastic_memory.sh     the reclaim served by the hint helper
#                                                       (vgpu.torch: empty_cache), nothing swapped
#   5. RECLAIM=1 COLD=1 tests/gpu/elastic_memory.sh     the reclaim takes the chunks marked cold
#                                                       (vgpu.torch.mark_cold) first
#   5b. RECLAIM=1 FULL=1 tests/gpu/elastic_memory.sh  the node's swap space runs out (a 1 GiB
#                                                       budget): the needy's request refused with a
#                                                       line saying so, the borrower unharmed (part
#                                                       `full`)
#   6. tests/gpu/swap_exchange.sh                       both directions of the host link at once
#                                                       (part `exchange`; `exchange32`: with
#                                                       SWAP_HOST=32GiB, a short staging budget)
#   7. tests/gpu/exchange_probe.py                      the exchange's two directions without vgpu:
#                                                       why the taker is slower (part `probe`;
#                                                       PROBE_GIB, default 16, PROBE_CHUNK_MIB 1024)
# PARTS (default "reclaim latency jobs hint cold"; also full, exchange, exchange32, probe) picks which. Each part's own table is printed as it ends;
# its logs go to $OUT/logs.tar.gz (<part>/...); a summary of the parts is printed last. Exit status 0 when every
# part that ran passed. Every part stops what it started (each script's own cleanup); a part cut
# by its limit gets TERM, then KILL 15 s later.
#
#   VGPU_BIN=dist tests/gpu/elastic_all.sh
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/gpu/procs.sh
source "$ROOT/tests/gpu/procs.sh"
OUT_ROOT=${OUT:-$(mktemp -d)}
DEADLINE_S=${DEADLINE_S:-570}
PARTS=${PARTS:-"reclaim latency jobs hint cold"}
began=$(date +%s)
summary=()
failed=0

# run_part NAME LIMIT_S ENV... -- SCRIPT: the script under `timeout` (TERM, KILL 15 s later),
# bounded by what is left of the deadline.
run_part() {
  local name=$1 limit=$2 left status
  shift 2
  left=$((DEADLINE_S - ($(date +%s) - began)))
  if [ "$left" -lt 60 ]; then
    summary+=("| $name | not run: ${left} s left of ${DEADLINE_S} s |")
    failed=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  mkdir -p "$OUT_ROOT/$name"
  echo "=== $name (at most ${limit} s) ==="
  env OUT="$OUT_ROOT/$name" "$@" timeout -k 15 "$limit" "${SCRIPT[@]}" 2>&1 | tee "$OUT_ROOT/$name/output.txt"
  status=${PIPESTATUS[0]}
  case "$status" in
  0) summary+=("| $name | PASS |") ;;
  124 | 137) summary+=("| $name | cut at ${limit} s (see $name/output.txt) |"); failed=1 ;;
  *) summary+=("| $name | FAIL (exit $status; its table above) |"); failed=1 ;;
  esac
}

for part in $PARTS; do
  case "$part" in
  reclaim)
    SCRIPT=("$ROOT/tests/gpu/elastic_memory.sh")
    run_part reclaim 180 RECLAIM=1
    ;;
  latency)
    SCRIPT=("$ROOT/tests/gpu/elastic_memory.sh")
    run_part latency 200 RECLAIM=1 LATENCY=1
    ;;
  jobs)
    SCRIPT=("$ROOT/tests/gpu/memory_jobs.sh")
    run_part jobs 300
    ;;
  hint)
    SCRIPT=("$ROOT/tests/gpu/elastic_memory.sh")
    run_part hint 180 RECLAIM=1 HINT=1
    ;;
  cold)
    SCRIPT=("$ROOT/tests/gpu/elastic_memory.sh")
    run_part cold 180 RECLAIM=1 COLD=1
    ;;
  full)
    SCRIPT=("$ROOT/tests/gpu/elastic_memory.sh")
    run_part full 180 RECLAIM=1 FULL=1
    ;;
  exchange)
    SCRIPT=("$ROOT/tests/gpu/swap_exchange.sh")
    run_part exchange 210
    ;;
  exchange32)
    SCRIPT=("$ROOT/tests/gpu/swap_exchange.sh")
    run_part exchange32 210 SWAP_HOST=32GiB
    ;;
  probe)
    SCRIPT=(python3 "$ROOT/tests/gpu/exchange_probe.py" "${PROBE_GIB:-16}" "${PROBE_CHUNK_MIB:-1024}")
    run_part probe 150
    ;;
  *)
    echo "unknown part $part (reclaim, latency, jobs, hint, cold, full, exchange, exchange32, probe)" >&2
    exit 2
    ;;
  esac
done
# The parts' logs in one archive, the directories removed.
# shellcheck disable=SC2086 # PARTS is a list of names
pack_logs "$OUT_ROOT" $PARTS
echo
echo "| part | result |"
echo "| --- | --- |"
printf '%s\n' "${summary[@]}"
exit "$failed"
