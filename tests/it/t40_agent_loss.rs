//! Agent loss: `kill -9` of a node agent makes the control plane mark the node lost and re-place
//! its tenants on other nodes; a restarted agent re-registers and the node is ready again.

use anyhow::{Result, ensure};
use std::time::Duration;
use tests::{Cluster, json, wait_for};

fn nodes_of(cluster: &Cluster, tenant: &str) -> Option<Vec<String>> {
    let tenant = json(
        &cluster
            .vgpuctl(&["get", "tenants", tenant, "-o", "json"])
            .ok()?,
    )
    .ok()?;
    if tenant["state"] != "placed" {
        return None;
    }
    Some(
        tenant["slices"]
            .as_array()?
            .iter()
            .filter_map(|s| s["node"].as_str().map(str::to_owned))
            .collect(),
    )
}

#[test]
fn tenants_of_a_lost_node_are_replaced() -> Result<()> {
    let mut cluster = Cluster::start(1, &tests::FAST_FLAGS)?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    for name in ["t1", "t2"] {
        let output = cluster.vgpuctl(&["place", name, "--gpus", "4"])?;
        ensure!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    cluster.start_agent("node-b", "8xH100-80GB")?;
    cluster.wait_nodes_ready(2)?;
    ensure!(
        nodes_of(&cluster, "t1") == Some(vec!["node-a".to_owned(); 4]),
        "t1 starts on node-a"
    );

    cluster
        .agent("node-a")
        .process
        .as_mut()
        .expect("running")
        .kill();
    wait_for(
        "node-a lost and its tenants re-placed",
        Duration::from_secs(15),
        || {
            let nodes = json(
                &cluster
                    .vgpuctl(&["get", "nodes", "node-a", "-o", "json"])
                    .ok()?,
            )
            .ok()?;
            let lost = nodes["state"] == "lost";
            let moved = ["t1", "t2"]
                .iter()
                .all(|t| nodes_of(&cluster, t).is_some_and(|n| n.iter().all(|n| n == "node-b")));
            (lost && moved).then_some(())
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.logs()))?;
    let describe = cluster.vgpuctl(&["describe", "tenant", "t1"])?;
    let text = String::from_utf8_lossy(&describe.stdout);
    ensure!(
        text.contains("node-a"),
        "history should mention the lost node: {text}"
    );

    cluster.restart_agent("node-a")?;
    wait_for("node-a ready again", Duration::from_secs(15), || {
        let node = json(
            &cluster
                .vgpuctl(&["get", "nodes", "node-a", "-o", "json"])
                .ok()?,
        )
        .ok()?;
        (node["state"] == "ready").then_some(())
    })?;
    // The restarted agent restored its two assignments from its state directory, then
    // reconciled with the control plane, which had moved both tenants away meanwhile.
    let log_path = cluster.agent("node-a").state_dir.with_extension("log");
    wait_for("the agent to reconcile", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(&log_path).ok()?;
        (log.contains("restored 2 assignments") && log.contains("2 stopped")).then_some(())
    })
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}: {}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        )
    })?;
    let tenants = std::fs::read_dir(cluster.agent("node-a").state_dir.join("tenants"))?.count();
    ensure!(
        tenants == 0,
        "stale tenant files left in the state dir: {tenants}"
    );
    Ok(())
}

#[test]
fn a_drained_node_hands_its_tenants_over_and_takes_none() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let output = cluster.vgpuctl(&["place", "t1", "--gpus", "8"])?;
    ensure!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    cluster.start_agent("node-b", "8xH100-80GB")?;
    cluster.wait_nodes_ready(2)?;

    let drained = cluster.vgpuctl(&["drain", "node-a"])?;
    ensure!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    wait_for("t1 to move to node-b", Duration::from_secs(10), || {
        nodes_of(&cluster, "t1").filter(|nodes| nodes.iter().all(|n| n == "node-b"))
    })?;
    let node = json(&cluster.vgpuctl(&["get", "nodes", "node-a", "-o", "json"])?)?;
    ensure!(node["state"] == "draining", "{node}");
    // Nothing new lands on a draining node: a second 8-GPU tenant waits.
    let output = cluster.vgpuctl(&["place", "t2", "--gpus", "8", "--no-wait"])?;
    ensure!(output.status.success());
    let t2 = json(&cluster.vgpuctl(&["get", "tenants", "t2", "-o", "json"])?)?;
    ensure!(t2["state"] == "pending", "{t2}");

    let uncordoned = cluster.vgpuctl(&["uncordon", "node-a"])?;
    ensure!(uncordoned.status.success());
    wait_for("t2 to be placed on node-a", Duration::from_secs(10), || {
        nodes_of(&cluster, "t2").filter(|nodes| nodes.iter().all(|n| n == "node-a"))
    })?;
    Ok(())
}
