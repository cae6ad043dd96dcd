//! Whole-node placement across a real cluster (issue 19): agents register CPU and host memory
//! (simulated capacity, less `--reserved-cpu`), `vgpuctl place --cpu --host-memory --gpu-model`
//! places against them, every member decides alike, and the decisions and the host state survive
//! a leader kill and a restart of every member from its snapshot.

use anyhow::{Context, Result, ensure};
use std::collections::BTreeMap;
use std::time::Duration;
use tests::{Cluster, json, wait_for};

/// What a member decided for each tenant: state, reason and slices (node, GPU, share, memory).
type Decisions = BTreeMap<String, String>;

fn decisions(tenants: &serde_json::Value) -> Decisions {
    tenants
        .as_array()
        .into_iter()
        .flatten()
        .map(|tenant| {
            let slices: Vec<String> = tenant["slices"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| {
                    format!(
                        "{}/{}/{}%/{}",
                        s["node"], s["gpu"], s["compute_percent"], s["memory_bytes"]
                    )
                })
                .collect();
            let decided = format!(
                "{} [{}] {}",
                tenant["state"],
                slices.join(" "),
                tenant["reason"]
            );
            (
                tenant["name"].as_str().unwrap_or_default().to_owned(),
                decided,
            )
        })
        .collect()
}

/// The decisions of the member at `address`, from its own state (`--stale`).
fn local_decisions(address: &str) -> Option<Decisions> {
    let tenants =
        json(&tests::vgpuctl(address, &["get", "tenants", "--stale", "-o", "json"]).ok()?).ok()?;
    Some(decisions(&tenants))
}

/// Waits until every running member holds `expected`.
fn every_member_holds(cluster: &mut Cluster, expected: &Decisions, when: &str) -> Result<()> {
    let live = cluster.live_endpoints();
    for address in live.split(',') {
        wait_for(
            &format!("member {address} to hold the decisions {when}"),
            Duration::from_secs(20),
            || (local_decisions(address).as_ref() == Some(expected)).then_some(()),
        )
        .with_context(|| {
            format!(
                "expected {expected:#?}\ngot {:#?}\n{}",
                local_decisions(address),
                cluster.logs()
            )
        })?;
    }
    Ok(())
}

fn place(cluster: &Cluster, args: &[&str]) -> Result<serde_json::Value> {
    let mut all = vec!["place"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--no-wait", "-o", "json"]);
    json(&cluster.vgpuctl(&all)?)
}

fn node_of(tenant: &serde_json::Value) -> &str {
    tenant["slices"][0]["node"].as_str().unwrap_or_default()
}

#[test]
fn constrained_placements_agree_on_every_member_and_survive_failover_and_restart() -> Result<()> {
    let flags = ["--snapshot-every", "10", "--snapshot-keep-logs", "2"];
    let mut cluster = Cluster::start(3, &flags)?;
    // Simulated nodes have 16 CPUs and 128 GiB a GPU: node-h keeps 24 of its 32 CPUs for other
    // work and offers 8.
    cluster.start_agent_with("node-h", "2xH100-80GB", &["--reserved-cpu", "24"])?;
    cluster.start_agent("node-a", "2xA100-80GB")?;
    cluster.wait_nodes_ready(2)?;
    let node = json(&cluster.vgpuctl(&["get", "nodes", "node-h", "-o", "json"])?)?;
    ensure!(
        node["cpu_milli"] == 8_000 && node["host_memory_bytes"] == 256u64 << 30,
        "{node}"
    );

    // Bad input is refused before any call, with what to write.
    for (flag, value, says) in [
        ("--cpu", "-1", "negative"),
        ("--host-memory", "300TiB", "--host-memory"),
    ] {
        let refused = cluster.vgpuctl(&["place", "bad", "--gpus", "1", flag, value])?;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        ensure!(
            refused.status.code() == Some(2) && stderr.contains(says),
            "{flag} {value}: {refused:?}"
        );
    }

    let cpu_heavy = place(&cluster, &["cpu-heavy", "--gpus", "1", "--cpu", "16"])?;
    ensure!(node_of(&cpu_heavy) == "node-a", "{cpu_heavy}");
    let h100 = place(
        &cluster,
        &[
            "h100",
            "--gpus",
            "1",
            "--cpu",
            "4",
            "--host-memory",
            "64GiB",
            "--gpu-model",
            "H100-80GB",
        ],
    )?;
    ensure!(node_of(&h100) == "node-h", "{h100}");
    // node-h has 4 CPUs left and a free GPU: an H100 tenant asking 8 CPUs waits, and says why.
    let waiting = place(
        &cluster,
        &[
            "waiting",
            "--gpus",
            "1",
            "--cpu",
            "8",
            "--gpu-model",
            "H100-80GB",
        ],
    )?;
    ensure!(
        waiting["state"] == "pending"
            && waiting["reason"]
                .as_str()
                .is_some_and(|r| r.contains("8 CPUs")),
        "{waiting}"
    );
    // Either model, but only node-a has 12 CPUs left: node-h keeps its free GPU.
    let either = place(
        &cluster,
        &[
            "either",
            "--gpus",
            "0.5",
            "--cpu",
            "12",
            "--gpu-model",
            "H100-80GB",
            "--gpu-model",
            "A100-80GB",
        ],
    )?;
    ensure!(node_of(&either) == "node-a", "{either}");
    // Enough entries for a snapshot on every member (on node-a, so node-h's CPUs stay as they
    // are).
    for index in 0..8 {
        let name = format!("small-{index}");
        let small = place(
            &cluster,
            &[
                &name,
                "--gpus",
                "0.05",
                "--cpu",
                "250m",
                "--gpu-model",
                "A100-80GB",
            ],
        )?;
        ensure!(node_of(&small) == "node-a", "{small}");
    }
    let before = decisions(&json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?);
    ensure!(before.len() == 12, "{before:#?}");
    every_member_holds(&mut cluster, &before, "after placing")?;

    // Failover: the survivors hold the same decisions and keep deciding with the host state.
    let leader = cluster.leader()?;
    cluster.member(leader).kill();
    let survivors = cluster.live_endpoints();
    wait_for("a new leader", Duration::from_secs(20), || {
        let status =
            json(&tests::vgpuctl(&survivors, &["cluster", "status", "-o", "json"]).ok()?).ok()?;
        status["leader"].as_u64().filter(|&l| l > 0 && l != leader)
    })?;
    every_member_holds(&mut cluster, &before, "after the leader's kill")?;
    cluster.member(leader).start()?;
    every_member_holds(&mut cluster, &before, "after the old leader's return")?;

    // Every member restarts from its snapshot and log.
    for member in &mut cluster.members {
        member.kill();
    }
    for member in &mut cluster.members {
        member.start()?;
    }
    cluster.wait_nodes_ready(2)?;
    every_member_holds(&mut cluster, &before, "after a restart of every member")?;
    let restored = cluster
        .members
        .iter()
        .filter(|m| {
            m.log_text()
                .contains("restored the state machine from its snapshot")
        })
        .count();
    ensure!(
        restored > 0,
        "no member restored a snapshot\n{}",
        cluster.logs()
    );

    // The restored host state decides: node-h still has 4 CPUs left (and a free GPU), so a
    // second tenant asking 8 waits too, and releasing `h100` gives its CPUs to the older one.
    let probe = place(
        &cluster,
        &[
            "probe",
            "--gpus",
            "1",
            "--cpu",
            "8",
            "--gpu-model",
            "H100-80GB",
        ],
    )?;
    ensure!(
        probe["state"] == "pending"
            && probe["reason"]
                .as_str()
                .is_some_and(|r| r.contains("8 CPUs")),
        "{probe}"
    );
    let released = cluster.vgpuctl(&["release", "h100"])?;
    ensure!(released.status.success(), "{released:?}");
    wait_for(
        "`waiting` to be placed on node-h",
        Duration::from_secs(20),
        || {
            let tenant = json(
                &cluster
                    .vgpuctl(&["get", "tenants", "waiting", "-o", "json"])
                    .ok()?,
            )
            .ok()?;
            (tenant["state"] == "placed" && node_of(&tenant) == "node-h").then_some(())
        },
    )?;
    let node = json(&cluster.vgpuctl(&["get", "nodes", "node-h", "-o", "json"])?)?;
    ensure!(
        node["cpu_milli_allocated"]
            .as_u64()
            .is_some_and(|cpu| cpu >= 8_000),
        "{node}"
    );
    let after = decisions(&json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?);
    ensure!(after["probe"].starts_with("\"pending\""), "{after:#?}");
    every_member_holds(&mut cluster, &after, "after the release")?;
    let described = cluster.vgpuctl(&["describe", "tenant", "waiting"])?;
    let text = String::from_utf8_lossy(&described.stdout);
    ensure!(
        text.contains("CPU:            8 per node") && text.contains("GPU models:     H100-80GB"),
        "{text}"
    );
    Ok(())
}
