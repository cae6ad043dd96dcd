//! The fleet simulator against a real three-member cluster: 20 simulated nodes register (spread
//! over the members, so followers forward), heartbeat, and follow their assignments; a tenant
//! placed meanwhile reaches exactly one simulated node's stream.

use anyhow::{Context, Result, ensure};
use std::process::Command;
use std::time::Duration;
use tests::{Cluster, Process, binary, json, wait_for};

const NODES: usize = 20;

#[test]
fn twenty_simulated_nodes_register_heartbeat_and_follow_assignments() -> Result<()> {
    let cluster = Cluster::start(3, &[])?;
    let summary_path = cluster.dir.path().join("fleet-summary.json");
    let mut command = Command::new(binary("vgpu-agent"));
    command
        .arg("simulate-fleet")
        .args(["--control-plane", &cluster.endpoints()])
        .args(["--count", &NODES.to_string(), "--spec", "8xH100-80GB"])
        // Three nodes per connection: the 20 nodes share several connections to each member.
        .args(["--nodes-per-connection", "3", "--name-prefix", "fleet"])
        .args(["--duration", "4", "--progress-ms", "200", "--insecure"])
        .arg("--summary-json")
        .arg(&summary_path);
    let mut fleet = Process::spawn(command, cluster.dir.path().join("fleet.log"))?;

    cluster
        .wait_nodes_ready(NODES)
        .with_context(|| fleet.log_text())?;
    let nodes = json(&cluster.vgpuctl(&["get", "nodes", "-o", "json"])?)?;
    let names: Vec<&str> = nodes
        .as_array()
        .context("a node list")?
        .iter()
        .filter_map(|node| node["name"].as_str())
        .collect();
    ensure!(names.first() == Some(&"fleet-00000"), "{names:?}");
    ensure!(names.last() == Some(&"fleet-00019"), "{names:?}");
    // The leader holds each node's health report (sent in full once, then named by the beats).
    wait_for(
        "a simulated node's GPU health in describe",
        Duration::from_secs(10),
        || {
            let output = cluster.vgpuctl(&["describe", "node", "fleet-00001"]).ok()?;
            String::from_utf8_lossy(&output.stdout)
                .contains("Temperature:  41 C")
                .then_some(())
        },
    )
    .with_context(|| fleet.log_text())?;
    let placed = cluster.vgpuctl(&["place", "whole-node", "--gpus", "8"])?;
    ensure!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );

    wait_for(
        "the fleet to stop after --duration",
        Duration::from_secs(30),
        || (!fleet.is_running()).then_some(()),
    )?;
    let log = fleet.log_text();
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&summary_path).with_context(|| log.clone())?,
    )?;
    ensure!(summary["registered"] == NODES, "{summary}");
    ensure!(summary["gpus_per_node"] == 8, "{summary}");
    ensure!(summary["heartbeat_failures"] == 0, "{summary}\n{log}");
    ensure!(summary["registration_failures"] == 0, "{summary}\n{log}");
    // Each node's first beat falls within its first interval (1 s), then about one a second
    // for the 4 s after the last registration.
    let sent = summary["heartbeats_sent"].as_u64().context("a count")?;
    ensure!(sent >= 3 * NODES as u64, "{sent} heartbeats: {summary}");
    // Every heartbeat was answered, but for at most one per node in flight at the stop.
    let answered = summary["heartbeat_latency"]["count"]
        .as_u64()
        .context("a count")?;
    ensure!(
        answered + NODES as u64 >= sent,
        "{answered} of {sent} answered: {summary}"
    );
    // Full health reports went out once per node (plus any the leader asked for again), not
    // with every beat: the 30-beat refresh lies beyond this run.
    let reports = summary["reports_sent"].as_u64().context("a count")?;
    let wanted = summary["reports_wanted"].as_u64().context("a count")?;
    ensure!(
        reports >= NODES as u64 && reports <= NODES as u64 + wanted,
        "{reports} full reports, {wanted} wanted: {summary}"
    );
    ensure!(reports < sent, "{reports} of {sent} beats carried a report");
    // The 8-GPU tenant landed on one simulated node, whose stream carried it.
    ensure!(summary["tenants_assigned"] == 1, "{summary}\n{log}");
    let messages = summary["assignment_messages"].as_u64().context("a count")?;
    ensure!(messages > NODES as u64, "{messages} messages: {summary}");
    ensure!(
        log.contains(&format!("all {NODES} nodes registered")),
        "progress is logged: {log}"
    );
    ensure!(
        log.contains(&format!(
            "fleet: {NODES} nodes x 8 GPUs, {NODES} registered"
        )),
        "the summary is printed: {log}"
    );
    Ok(())
}
