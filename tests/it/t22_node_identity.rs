//! A node's name belongs to the agent that registered it first (issue 22, point 5): under mTLS,
//! a second `vgpu-agent join` with the same `--name`, its own state directory (so its own node
//! key) and its own bootstrap token (which signs a certificate for any name) is refused by the
//! control plane and exits non-zero with `[VGPU-NODE-NAME-TAKEN]` and the remedy; the first
//! agent's node stays ready and keeps beating. Once an admin removes the node, the name is free
//! for the other machine.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use tests::{Cluster, binary, json, wait_for};

/// A child killed and reaped when dropped; its exit status stays readable.
struct Agent {
    child: Child,
    log: std::path::PathBuf,
}

impl Agent {
    /// `vgpu-agent join --name NAME` with its own state directory and bootstrap token.
    fn join(cluster: &Cluster, name: &str, state: &str) -> Result<Agent> {
        let pki = cluster.pki.as_ref().context("an mTLS cluster")?;
        let state_dir = cluster.dir.path().join(state);
        let log = state_dir.with_extension("log");
        let file = std::fs::File::create(&log)?;
        let child = Command::new(binary("vgpu-agent"))
            .args(["join", "--control-plane", &cluster.endpoints()])
            .args(["--name", name, "--simulate", "4xH100-80GB"])
            .arg("--state-dir")
            .arg(&state_dir)
            .args(["--token", &cluster.create_token("10m")?])
            .args(["--ca-cert-hash", &pki.ca_cert_hash])
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .context("spawning vgpu-agent")?;
        Ok(Agent { child, log })
    }

    fn exited(&mut self, within: Duration) -> Result<ExitStatus> {
        wait_for("the agent to exit", within, || {
            self.child.try_wait().ok().flatten()
        })
        .with_context(|| self.log_text())
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn node(cluster: &Cluster, name: &str) -> Option<serde_json::Value> {
    json(
        &cluster
            .vgpuctl(&["get", "nodes", name, "-o", "json"])
            .ok()?,
    )
    .ok()
}

#[test]
fn a_second_agent_with_the_same_name_is_refused_and_the_first_keeps_its_node() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;

    let mut intruder = Agent::join(&cluster, "node-a", "intruder")?;
    let status = intruder.exited(Duration::from_secs(30))?;
    let log = intruder.log_text();
    ensure!(!status.success(), "the second agent exited {status}: {log}");
    ensure!(
        log.contains("[VGPU-NODE-NAME-TAKEN] node `node-a` is registered by another node key")
            && log.contains("vgpuctl node remove node-a"),
        "the second agent says why and what to do: {log}"
    );
    let refused_at = node(&cluster, "node-a")
        .and_then(|node| node["last_heartbeat_unix_ms"].as_i64())
        .context("node-a's last heartbeat")?;

    // The first agent runs on: its node is ready, with its 8 GPUs, and beats after the refusal.
    ensure!(
        cluster
            .agent("node-a")
            .process
            .as_mut()
            .is_some_and(|process| process.is_running()),
        "the first agent stopped: {}",
        cluster.logs()
    );
    wait_for(
        "node-a to beat again after the refusal",
        Duration::from_secs(15),
        || {
            let node = node(&cluster, "node-a")?;
            let beat = node["last_heartbeat_unix_ms"].as_i64()?;
            let gpus = node["gpus"].as_array()?.len();
            (node["state"] == "ready" && beat > refused_at && gpus == 8).then_some(())
        },
    )
    .with_context(|| cluster.logs())?;

    // An admin removes the node (its agent stopped for good): the other machine may take the
    // name.
    cluster.agent("node-a").process = None;
    let removed = cluster.vgpuctl(&["node", "remove", "node-a"])?;
    ensure!(
        removed.status.success(),
        "{}",
        String::from_utf8_lossy(&removed.stderr)
    );
    let mut replacement = Agent::join(&cluster, "node-a", "intruder")?;
    wait_for(
        "the replacement to hold node-a",
        Duration::from_secs(30),
        || {
            let node = node(&cluster, "node-a")?;
            (node["state"] == "ready" && node["gpus"].as_array()?.len() == 4).then_some(())
        },
    )
    .with_context(|| replacement.log_text())?;
    ensure!(
        replacement.child.try_wait()?.is_none(),
        "{}",
        replacement.log_text()
    );
    Ok(())
}
