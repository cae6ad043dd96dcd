# Process bookkeeping shared by the GPU scripts (sourced, not run): the caller keeps every process
# it started and has not reaped in the array PIDS, and defines `log MESSAGE`.
# shellcheck shell=bash disable=SC2034

forget() { # forget PID: reaped, no longer ours to kill
  local p keep=()
  for p in "${PIDS[@]}"; do [ "$p" != "$1" ] && keep+=("$p"); done
  PIDS=("${keep[@]}")
}
bounded_wait() { # bounded_wait SECONDS WHAT TEST...: poll TEST every 0.1 s; a message on timeout
  local limit=$1 what=$2 i
  shift 2
  for i in $(seq $((limit * 10))); do "$@" && return 0; sleep 0.1; done
  log "timed out after ${limit}s waiting for $what"
  return 1
}
gone() { ! kill -0 "$1" 2>/dev/null; }
stop_pid() { # stop_pid PID: TERM, up to 10 s, then KILL; reap it
  kill "$1" 2>/dev/null
  bounded_wait 10 "process $1 to exit after TERM" gone "$1" || kill -9 "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  forget "$1"
}
pack_logs() { # pack_logs ROOT DIR...: the DIRs under ROOT into ROOT/logs.tar.gz, then removed
  # (the device tool brings back only a few files); nothing when no DIR exists
  local root=$1 d dirs=()
  shift
  for d in "$@"; do [ -d "$root/$d" ] && dirs+=("$d"); done
  if [ "${#dirs[@]}" -gt 0 ] && tar czf "$root/logs.tar.gz" -C "$root" "${dirs[@]}"; then
    for d in "${dirs[@]}"; do rm -rf "${root:?}/$d"; done
    echo "logs: $root/logs.tar.gz"
  fi
}
mps_gone() { ! pgrep -f 'nvidia-cuda-mps-(control|server)' >/dev/null; }
