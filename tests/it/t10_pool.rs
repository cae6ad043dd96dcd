//! A one-member pool with one simulated node: place, read back, release, through vgpuctl.

use anyhow::Result;
use tests::{Cluster, json};

#[test]
fn place_read_and_release_through_vgpuctl() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;

    let nodes = json(&cluster.vgpuctl(&["get", "nodes", "-o", "json"])?)?;
    assert_eq!(nodes[0]["name"], "node-a");
    assert_eq!(nodes[0]["gpus"].as_array().map(Vec::len), Some(8));

    let placed = cluster.vgpuctl(&["place", "infer-a", "--gpus", "0.25", "--memory", "20GiB"])?;
    assert!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );
    assert!(
        String::from_utf8_lossy(&placed.stdout).contains("placed"),
        "{placed:?}"
    );

    let tenants = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    let tenant = &tenants[0];
    assert_eq!(tenant["name"], "infer-a");
    assert_eq!(tenant["state"], "placed");
    let slice = &tenant["slices"][0];
    assert_eq!(slice["node"], "node-a");
    assert_eq!(slice["compute_percent"], 25);
    assert_eq!(slice["memory_bytes"], 20u64 << 30);
    assert!(
        slice["gpu"]
            .as_str()
            .is_some_and(|uuid| uuid.starts_with("GPU-")),
        "{slice}"
    );

    // A whole-GPU gang of 8 no longer fits next to the fraction: it waits, with a reason.
    let pending = cluster.vgpuctl(&["place", "train-b", "--gpus", "8", "--no-wait"])?;
    assert!(
        pending.status.success(),
        "{}",
        String::from_utf8_lossy(&pending.stderr)
    );
    let train = json(&cluster.vgpuctl(&["get", "tenants", "train-b", "-o", "json"])?)?;
    assert_eq!(train["state"], "pending");
    assert!(
        !train["reason"].as_str().unwrap_or_default().is_empty(),
        "{train}"
    );

    // Releasing the fraction frees the GPU and the gang is placed automatically.
    let released = cluster.vgpuctl(&["release", "infer-a"])?;
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    tests::wait_for(
        "train-b to be placed",
        std::time::Duration::from_secs(10),
        || {
            let train = json(
                &cluster
                    .vgpuctl(&["get", "tenants", "train-b", "-o", "json"])
                    .ok()?,
            )
            .ok()?;
            (train["state"] == "placed").then_some(())
        },
    )?;
    let train = json(&cluster.vgpuctl(&["get", "tenants", "train-b", "-o", "json"])?)?;
    assert_eq!(train["slices"].as_array().map(Vec::len), Some(8));
    let describe = cluster.vgpuctl(&["describe", "tenant", "train-b"])?;
    assert!(
        String::from_utf8_lossy(&describe.stdout).contains("pending"),
        "history shows the wait"
    );

    let text = tests::http_get(&cluster.members[0].address, "/metrics")?;
    assert!(text.contains("vgpu_raft_is_leader 1"), "{text}");
    assert!(
        text.contains("vgpu_node_compute_allocated_percent{node=\"node-a\"} 800"),
        "{text}"
    );
    assert!(
        text.contains("vgpu_raft_commit_latency_seconds_count"),
        "{text}"
    );
    drop(cluster.agents.drain(..));
    Ok(())
}
