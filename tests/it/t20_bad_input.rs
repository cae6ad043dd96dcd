//! Bad input is refused with a clear message, without a panic, and changes nothing.

use anyhow::Result;
use tests::{Cluster, json};

fn assert_refused(cluster: &Cluster, args: &[&str], expected: &str) -> Result<()> {
    let output = cluster.vgpuctl(args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{args:?} should fail");
    assert!(
        stderr.to_lowercase().contains(&expected.to_lowercase()),
        "{args:?}: expected `{expected}` in: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    Ok(())
}

#[test]
fn bad_input_is_refused_and_changes_nothing() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let placed = cluster.vgpuctl(&["place", "keep", "--gpus", "0.5"])?;
    assert!(placed.status.success());
    let before = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    let status_before = cluster.status_json()?;

    assert_refused(&cluster, &["place", "a", "--gpus", "0"], "gpu")?;
    assert_refused(
        &cluster,
        &["place", "a", "--gpus", "1", "--memory", "-5GiB"],
        "negative",
    )?;
    assert_refused(
        &cluster,
        &["place", "a", "--gpus", "1", "--compute", "250"],
        "250",
    )?;
    assert_refused(&cluster, &["place", "", "--gpus", "1"], "empty")?;
    assert_refused(&cluster, &["place", "Bad Name", "--gpus", "1"], "name")?;
    assert_refused(&cluster, &["place", "a", "--gpus", "16"], "")?;
    assert_refused(
        &cluster,
        &["place", "a", "--gpus", "1", "--memory", "200GiB"],
        "",
    )?;
    assert_refused(&cluster, &["release", "no-such-tenant"], "no tenant")?;
    assert_refused(
        &cluster,
        &["describe", "tenant", "no-such-tenant"],
        "no tenant",
    )?;
    assert_refused(&cluster, &["drain", "no-such-node"], "no node")?;
    assert_refused(&cluster, &["place", "keep", "--gpus", "0.75"], "exists")?;

    let after = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    assert_eq!(before, after, "refused requests changed the tenants");
    // Refused requests that never reached the log leave the log as it was (the impossible
    // requests are the only ones decided by the replicated engine, and they keep no tenant).
    let status_after = cluster.status_json()?;
    assert_eq!(status_before["leader"], status_after["leader"]);

    // A data directory of another cluster is refused at start.
    let mut other = Cluster::start(1, &[])?;
    other.members[0].kill();
    let foreign_dir = other.members[0].data_dir.clone();
    let output = std::process::Command::new(tests::binary("vgpu-cp"))
        .args([
            "join",
            "--id",
            "1",
            "--listen",
            &format!("127.0.0.1:{}", tests::free_port()),
        ])
        .arg("--data-dir")
        .arg(&foreign_dir)
        .args(["--peer", &cluster.members[0].address, "--insecure"])
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "joining with a foreign data dir must fail"
    );
    assert!(stderr.contains("belongs to cluster"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}
