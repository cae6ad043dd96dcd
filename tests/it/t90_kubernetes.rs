//! Issue 18, a Kubernetes-managed node: an agent joined with `--kubernetes-managed` registers
//! its node so; `vgpuctl get nodes` says so, and the control plane never places a tenant there
//! itself (the kube-scheduler allocates its GPUs through the DRA driver).

use anyhow::{Result, ensure};
use tests::{Cluster, json};

#[test]
fn vgpuctl_placements_never_land_on_a_kubernetes_managed_node() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    cluster.start_agent_with("k8s-node", "1xH100-80GB", &["--kubernetes-managed"])?;
    cluster.start_agent("plain-node", "1xH100-80GB")?;
    cluster.wait_nodes_ready(2)?;

    let nodes = json(&cluster.vgpuctl(&["get", "nodes", "-o", "json"])?)?;
    let managed = |name: &str| {
        nodes
            .as_array()
            .and_then(|nodes| nodes.iter().find(|node| node["name"] == name))
            .map(|node| node["kubernetes_managed"] == true)
    };
    ensure!(
        managed("k8s-node") == Some(true) && managed("plain-node") == Some(false),
        "{nodes}"
    );
    let table = cluster.vgpuctl(&["get", "nodes"])?;
    let table = String::from_utf8_lossy(&table.stdout);
    ensure!(table.contains("ready (kubernetes)"), "{table}");

    // One whole GPU free on each node: the first placement takes the ordinary node's, the
    // second finds none it may use and waits.
    let placed = cluster.vgpuctl(&["place", "first", "--gpus", "1"])?;
    ensure!(placed.status.success(), "{placed:?}");
    let pending = cluster.vgpuctl(&["place", "second", "--gpus", "1", "--no-wait"])?;
    ensure!(pending.status.success(), "{pending:?}");
    let tenants = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    let tenant = |name: &str| {
        tenants
            .as_array()
            .and_then(|tenants| tenants.iter().find(|t| t["name"] == name))
            .cloned()
            .unwrap_or_default()
    };
    ensure!(
        tenant("first")["slices"][0]["node"] == "plain-node",
        "{tenants}"
    );
    ensure!(tenant("second")["state"] == "pending", "{tenants}");
    Ok(())
}
