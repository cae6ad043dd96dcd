//! Issue 22, point 4: priority is bounded by role. A tenant certificate may place and set
//! priorities only up to the members' tenant ceiling (100 by default), the refusal says the
//! ceiling and leaves the log as it was, and an admin may go above it. (That a tenant's release
//! or change is checked against the owner where it is applied is `vgpu-cp`'s
//! `pool::tests::a_release_for_another_owner_is_refused_where_it_is_applied`.)

use anyhow::{Context, Result, ensure};
use tests::{Cluster, json};

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_tenant_certificate_is_held_below_the_priority_ceiling() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    cluster.start_agent("node-a", "4xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let alice = pki.issue("tenant:alice", "alice", &[])?;
    let as_alice = |args: &[&str]| {
        let mut all: Vec<&str> = alice.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        tests::vgpuctl(&cluster.endpoints(), &all)
    };
    let last_applied = || -> Result<u64> {
        cluster.status_json()?["last_applied"]
            .as_u64()
            .context("last_applied")
    };

    // An admin's tenant above the ceiling.
    let admins = cluster.vgpuctl(&["place", "prod", "--gpus", "1", "--priority", "500"])?;
    ensure!(admins.status.success(), "{}", stderr(&admins));

    let before = last_applied()?;
    let refused = as_alice(&["place", "a1", "--gpus", "1", "--priority", "1000"])?;
    ensure!(!refused.status.success(), "{refused:?}");
    let text = stderr(&refused);
    ensure!(
        text.contains("VGPU-PERMISSION-DENIED") && text.contains("up to 100"),
        "{text}"
    );
    ensure!(
        last_applied()? == before,
        "a refused placement changed the log"
    );

    // At the ceiling it is placed; raising it past the ceiling is refused as well.
    let placed = as_alice(&["place", "a1", "--gpus", "0.25", "--priority", "100"])?;
    ensure!(placed.status.success(), "{}", stderr(&placed));
    let raised = as_alice(&["set", "tenant", "a1", "--priority", "101"])?;
    ensure!(!raised.status.success(), "{raised:?}");
    ensure!(stderr(&raised).contains("up to 100"), "{}", stderr(&raised));
    let tenant = json(&as_alice(&["get", "tenants", "a1", "-o", "json"])?)?;
    ensure!(tenant["request"]["priority"] == 100, "{tenant}");

    // The admin's tenant was never preempted, and an admin may set any priority.
    let prod = json(&cluster.vgpuctl(&["get", "tenants", "prod", "-o", "json"])?)?;
    ensure!(prod["state"] == "placed", "{prod}");
    let admin_set = cluster.vgpuctl(&["set", "tenant", "a1", "--priority", "900"])?;
    ensure!(admin_set.status.success(), "{}", stderr(&admin_set));
    Ok(())
}
