//! A tenant's settings reach its processes: a latency tenant's target (`vgpuctl place
//! --latency-target`) becomes `VGPU_LATENCY_TARGET_US` in `vgpu-agent env`, shows in `describe`,
//! comes back in the agent's usage report and in the leader's `/metrics`; and a change of a
//! running tenant (`vgpuctl set tenant`) reaches `vgpu-agent env` without moving it.

use anyhow::{Context, Result, bail, ensure};
use std::process::Command;
use std::time::{Duration, Instant};
use tests::{Cluster, binary, json, wait_for};

/// The value of `name` in `vgpu-agent env` output (`export NAME='VALUE'` lines).
fn variable(environment: &str, name: &str) -> Option<String> {
    environment.lines().find_map(|line| {
        let value = line.strip_prefix(&format!("export {name}="))?;
        Some(value.trim_matches('\'').to_owned())
    })
}

/// `vgpu-agent env --tenant TENANT` of node-a, on an MPS node (where latency tenants run in
/// their latency mode), once `ready` accepts its output.
fn tenant_env_until(
    cluster: &Cluster,
    tenant: &str,
    shm_dir: &str,
    what: &str,
    ready: impl Fn(&str) -> bool,
) -> Result<String> {
    let state_dir = &cluster.agents[0].state_dir;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new(binary("vgpu-agent"))
            .args(["env", "--tenant", tenant, "--name", "node-a"])
            .args(["--shm-dir", shm_dir])
            .arg("--state-dir")
            .arg(state_dir)
            .env("VGPU_AGENT_MPS", "true")
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        if out.status.success() && ready(&text) {
            return Ok(text);
        }
        if Instant::now() > deadline {
            bail!(
                "vgpu-agent env --tenant {tenant}: no {what} within 20 s; last output:\n{text}{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                cluster.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn succeeded(output: &std::process::Output) -> Result<String> {
    ensure!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn a_latency_target_reaches_the_tenant_environment_and_describe() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    let shm = tempfile::tempdir()?;
    let shm_dir = shm.path().to_string_lossy().into_owned();
    cluster.start_agent_with("node-a", "1xH100-80GB", &["--shm-dir", &shm_dir])?;
    cluster.wait_nodes_ready(1)?;

    // Without `--latency` the target is refused before anything is sent.
    let refused =
        cluster.vgpuctl(&["place", "chat", "--gpus", "0.25", "--latency-target", "2ms"])?;
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(message.contains("add `--latency`"), "{message}");

    succeeded(&cluster.vgpuctl(&[
        "place",
        "chat",
        "--gpus",
        "0.25",
        "--latency",
        "--latency-target",
        "2ms",
    ])?)?;
    let environment = tenant_env_until(&cluster, "chat", &shm_dir, "latency target", |text| {
        text.contains("VGPU_LATENCY_TARGET_US")
    })?;
    assert_eq!(
        variable(&environment, "VGPU_LATENCY_TARGET_US").as_deref(),
        Some("2000"),
        "{environment}"
    );
    assert_eq!(variable(&environment, "VGPU_LATENCY").as_deref(), Some("1"));

    let text = succeeded(&cluster.vgpuctl(&["describe", "tenant", "chat"])?)?;
    assert!(text.contains("  Latency target: 2ms\n"), "{text}");
    let tenant = json(&cluster.vgpuctl(&["get", "tenants", "chat", "-o", "json"])?)?;
    assert_eq!(tenant["request"]["latency_target_us"], 2_000, "{tenant}");

    // The agent reports the target with the tenant's usage; nothing is measured without a
    // tenant process, so only the target shows.
    let usage = wait_for(
        "the agent to report the target",
        Duration::from_secs(20),
        || {
            let tenant = json(
                &cluster
                    .vgpuctl(&["describe", "tenant", "chat", "-o", "json"])
                    .ok()?,
            )
            .ok()?;
            (tenant["usage"][0]["latency_target_us"] == 2_000).then_some(tenant)
        },
    )
    .with_context(|| cluster.logs())?;
    assert_eq!(usage["usage"][0]["latency_steps"], 0, "{usage}");
    let gpu = usage["usage"][0]["gpu"]
        .as_str()
        .context("a GPU")?
        .to_owned();
    let metrics = tests::http_get(&cluster.members[0].address, "/metrics")?;
    let line = format!(
        "vgpu_tenant_latency_target_seconds{{tenant=\"chat\",node=\"node-a\",gpu=\"{gpu}\"}} 0.002\n"
    );
    assert!(metrics.contains(&line), "missing `{line}` in:\n{metrics}");

    // A tenant without a target: the variable is not set (its node derives one).
    succeeded(&cluster.vgpuctl(&["place", "voice", "--gpus", "0.25", "--latency"])?)?;
    let environment = tenant_env_until(&cluster, "voice", &shm_dir, "latency mode", |text| {
        text.contains("VGPU_LATENCY=")
    })?;
    assert_eq!(variable(&environment, "VGPU_LATENCY_TARGET_US"), None);
    drop(cluster.agents.drain(..));
    Ok(())
}

#[test]
fn a_running_tenant_is_changed_in_place_and_its_node_follows() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    let shm = tempfile::tempdir()?;
    let shm_dir = shm.path().to_string_lossy().into_owned();
    cluster.start_agent_with("node-a", "1xH100-80GB", &["--shm-dir", &shm_dir])?;
    cluster.wait_nodes_ready(1)?;
    succeeded(&cluster.vgpuctl(&[
        "place",
        "chat",
        "--gpus",
        "0.25",
        "--latency",
        "--latency-target",
        "2ms",
    ])?)?;
    // Half of the one GPU next to it: chat may grow to 50%, not more.
    succeeded(&cluster.vgpuctl(&["place", "batch", "--gpus", "0.5"])?)?;
    let before = tenant_env_until(&cluster, "chat", &shm_dir, "placement", |_| true)?;
    assert_eq!(
        variable(&before, "VGPU_COMPUTE_SHARES").as_deref(),
        Some("0:25")
    );
    let gpu = variable(&before, "CUDA_VISIBLE_DEVICES");

    let out = succeeded(&cluster.vgpuctl(&[
        "set",
        "tenant",
        "chat",
        "--compute",
        "40",
        "--latency-target",
        "1.5ms",
        "--priority",
        "5",
    ])?)?;
    assert!(
        out.starts_with("tenant chat set: node-a GPU 0 (40%"),
        "{out}"
    );
    let after = tenant_env_until(&cluster, "chat", &shm_dir, "new values", |text| {
        variable(text, "VGPU_COMPUTE_SHARES").as_deref() == Some("0:40")
    })?;
    assert_eq!(
        variable(&after, "VGPU_LATENCY_TARGET_US").as_deref(),
        Some("1500"),
        "{after}"
    );
    assert_eq!(variable(&after, "VGPU_PRIORITY").as_deref(), Some("5"));
    assert_eq!(variable(&after, "CUDA_VISIBLE_DEVICES"), gpu, "not moved");

    // More than its GPU has room for: refused with the reason, nothing changes.
    let refused = cluster.vgpuctl(&["set", "tenant", "chat", "--compute", "60"])?;
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(message.contains("room for 50%"), "{message}");
    assert!(message.contains("VGPU-UNPLACEABLE"), "{message}");
    // A target for a tenant that is not a latency tenant; an unknown tenant; nothing to change.
    let refused = cluster.vgpuctl(&["set", "tenant", "batch", "--latency-target", "2ms"])?;
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not a latency tenant"),
        "{refused:?}"
    );
    let refused = cluster.vgpuctl(&["set", "tenant", "ghost", "--priority", "1"])?;
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("VGPU-TENANT-NOT-FOUND"),
        "{refused:?}"
    );
    let refused = cluster.vgpuctl(&["set", "tenant", "chat"])?;
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");

    let text = succeeded(&cluster.vgpuctl(&["describe", "tenant", "chat"])?)?;
    assert!(
        text.contains(
            "changed: compute 25% -> 40%, priority 0 -> 5, latency target 2000us -> 1500us"
        ),
        "{text}"
    );
    assert!(text.contains("  Latency target: 1.5ms\n"), "{text}");
    let tenant = json(&cluster.vgpuctl(&["get", "tenants", "chat", "-o", "json"])?)?;
    assert_eq!(tenant["slices"][0]["compute_percent"], 40, "{tenant}");
    let still = tenant_env_until(&cluster, "chat", &shm_dir, "placement", |_| true)?;
    assert_eq!(
        variable(&still, "VGPU_COMPUTE_SHARES").as_deref(),
        Some("0:40")
    );
    drop(cluster.agents.drain(..));
    Ok(())
}
