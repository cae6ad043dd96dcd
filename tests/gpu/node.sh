# One vgpu node for the GPU scripts (sourced after procs.sh, not run): a control plane and an agent
# named gpu-node on loopback, plain text. `gpu_paths` needs ROOT; the others need BIN, EP, WORK,
# SHM and LOGS, and keep their processes in the caller's globals CP and AGENT (start them empty),
# AGENT_MPS (0) and PIDS.
# shellcheck shell=bash disable=SC2034

gpu_paths() { # sets PY (the GPU machines' torch venv, else python3, unless set) and BIN (VGPU_BIN, default dist, made absolute)
  if [ -z "${PY:-}" ]; then
    PY=python3
    [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3
  fi
  BIN=${VGPU_BIN:-dist}
  case "$BIN" in
  /*) ;;
  *) if [ -d "$PWD/$BIN" ]; then BIN="$PWD/$BIN"; else BIN="$ROOT/$BIN"; fi ;;
  esac
}
ctl() { "$BIN/vgpuctl" --insecure --endpoints "$EP" "$@"; }
node_listed() { ctl get nodes 2>/dev/null | grep -q gpu-node; }
cp_answers() { ctl cluster status >/dev/null 2>&1; }
vgpu_cp_up() { # the control plane, started once
  [ -n "$CP" ] && return 0
  "$BIN/vgpu-cp" bootstrap --insecure --id 1 --listen "$EP" --data-dir "$WORK/cp" 2>"$LOGS/cp.log" &
  CP=$!
  PIDS+=("$CP")
  bounded_wait 10 "the control plane on $EP" cp_answers
}
vgpu_agent_up() { # vgpu_agent_up [JOIN FLAGS...]: (re)starts the agent with the same state; with --mps among the flags, waits for its MPS daemon
  [ -n "$AGENT" ] && stop_pid "$AGENT"
  "$BIN/vgpu-agent" join --insecure --control-plane "$EP" --name gpu-node --state-dir "$WORK/agent" \
    --shm-dir "$SHM" --cdi-dir "$WORK/cdi" "$@" 2>>"$LOGS/agent.log" &
  AGENT=$!
  PIDS+=("$AGENT")
  bounded_wait 10 "node gpu-node in vgpuctl get nodes" node_listed || return 1
  if [[ " $* " == *" --mps "* ]]; then
    AGENT_MPS=1
    bounded_wait 10 "the agent's MPS daemon ($SHM/mps/control)" test -e "$SHM/mps/control" || return 1
  fi
}
agent_mps_down() { # the agent never stops the MPS daemon it started: stops the agent, then the daemon
  [ "$AGENT_MPS" = 1 ] || return 0
  [ -n "$AGENT" ] && stop_pid "$AGENT"
  AGENT=""
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$SHM/mps" nvidia-cuda-mps-control >/dev/null 2>&1
  AGENT_MPS=0
  bounded_wait 15 "the agent's MPS daemon to quit" mps_gone
}
