//! Usage and health reporting end to end: a real agent (simulated GPUs) reads the interposer's
//! shared files, written here through the interposer's own protocol code (`tenant_abi::writer`)
//! as a tenant process would, and reports them with its heartbeats; `vgpuctl describe` (on a
//! follower too) and the leader's `/metrics` show the numbers.

use anyhow::{Context, Result, ensure};
use std::time::Duration;
use tests::{Cluster, json, wait_for};

const GIB: u64 = 1 << 30;

#[test]
fn agents_report_tenant_usage_and_gpu_health() -> Result<()> {
    let mut cluster = Cluster::start(3, &tests::FAST_FLAGS)?;
    let shm_dir = cluster.dir.path().join("shm");
    let shm = shm_dir.to_str().context("a UTF-8 path")?.to_owned();
    cluster.start_agent_with("node-a", "2xH100-80GB", &["--shm-dir", &shm])?;
    cluster.wait_nodes_ready(1)?;
    let placed = cluster.vgpuctl(&["place", "train", "--gpus", "0.5", "--memory", "10GiB"])?;
    ensure!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );
    let tenant = json(&cluster.vgpuctl(&["get", "tenants", "train", "-o", "json"])?)?;
    let gpu = tenant["slices"][0]["gpu"]
        .as_str()
        .context("a placed slice")?
        .to_owned();
    let gpu_index = tenant["slices"][0]["gpu_index"]
        .as_u64()
        .context("an index")?;

    // Before any tenant process ran: zeros, and the limit the agent hands out.
    wait_for(
        "the agent to report the idle tenant",
        Duration::from_secs(20),
        || {
            let text = describe(&cluster, &["describe", "tenant", "train"])?;
            text.contains("0B/10GiB").then_some(())
        },
    )
    .with_context(|| cluster.logs())?;

    // A tenant process: 3 GiB charged on its device 0, and 2.5 s of turns on the GPU.
    let pid = std::process::id();
    let start_time = tenant_abi::ledger::own_start_time();
    let mut limits = [None; tenant_abi::DEVICES_MAX];
    limits[0] = Some(10 * GIB);
    // The layout the agent made: the tenant's private directory, the GPU's schedule.
    let private = shm_dir.join("tenants/train");
    ensure!(
        private.join(format!("{gpu}.compute")).exists(),
        "the agent did not link {gpu}'s schedule into {}",
        private.display()
    );
    let ledger =
        tenant_abi::writer::ledger(&tenant_abi::layout::ledger_path(&private, "train"), &limits)?;
    tenant_abi::writer::charge_memory(&ledger, pid, start_time, 0, 3 * GIB)
        .map_err(anyhow::Error::msg)?;
    let schedule = tenant_abi::writer::schedule(
        &tenant_abi::layout::schedule_path(&private, &gpu),
        tenant_abi::compute::QUANTUM_NS_DEFAULT,
    )?;
    tenant_abi::writer::charge_time(
        &schedule,
        "train",
        pid,
        start_time,
        1_000_000,
        2_500_000_000,
    )
    .map_err(anyhow::Error::msg)?;
    // GPU 0 has an XID, ECC errors and hardware slowdown; GPU 1 cannot report ECC.
    std::fs::write(
        cluster
            .agent("node-a")
            .state_dir
            .join("simulated-health.json"),
        r#"{"0": {"xid_errors": 1, "last_xid": 79, "ecc_corrected": 4, "ecc_uncorrected": 2,
                  "throttle_reasons": ["hw_slowdown"]},
            "1": {"unsupported": ["ecc"]}}"#,
    )?;

    let leader = cluster.leader()?;
    let follower = cluster
        .members
        .iter()
        .find(|m| m.id != leader)
        .context("a follower")?
        .address
        .clone();
    // Through a follower: the describe reads are forwarded to the leader's reports.
    let text = wait_for("the usage in describe", Duration::from_secs(20), || {
        let text = describe_at(&follower, &["describe", "tenant", "train"])?;
        text.contains("3GiB/10GiB").then_some(text)
    })
    .with_context(|| cluster.logs())?;
    let row = text
        .lines()
        .find(|line| line.contains("3GiB/10GiB"))
        .context("a usage row")?;
    for cell in [
        "node-a",
        &gpu_index.to_string(),
        "2.5s",
        &format!("{pid} 3GiB"),
        "ago",
    ] {
        ensure!(
            row.contains(cell),
            "`{cell}` missing from the usage row: {row}\n{text}"
        );
    }
    let as_json = json(&tests::vgpuctl(
        &follower,
        &["describe", "tenant", "train", "-o", "json"],
    )?)?;
    ensure!(
        as_json["usage"][0]["memory_used_bytes"] == 3 * GIB,
        "{as_json}"
    );
    ensure!(
        as_json["usage"][0]["gpu_time_ns"] == 2_500_000_000u64,
        "{as_json}"
    );

    let node = describe_at(&follower, &["describe", "node", "node-a"]).context("describe node")?;
    for line in [
        "XID errors:   1 (last XID 79,",
        "ECC errors:   4 corrected, 2 uncorrected (volatile)",
        "Throttled:    hw_slowdown",
        "ECC errors:   unsupported",
        "Temperature:  41 C",
    ] {
        ensure!(node.contains(line), "`{line}` missing from:\n{node}");
    }

    let leader_address = cluster
        .members
        .iter()
        .find(|m| m.id == leader)
        .context("the leader")?
        .address
        .clone();
    let metrics = tests::http_get(&leader_address, "/metrics")?;
    let gpu0 =
        json(&cluster.vgpuctl(&["get", "nodes", "node-a", "-o", "json"])?)?["gpus"][0]["uuid"]
            .as_str()
            .context("GPU 0")?
            .to_owned();
    let labels = format!("tenant=\"train\",node=\"node-a\",gpu=\"{gpu}\"");
    for line in [
        format!("vgpu_tenant_memory_bytes{{{labels}}} {}", 3 * GIB),
        format!("vgpu_tenant_memory_limit_bytes{{{labels}}} {}", 10 * GIB),
        format!("vgpu_tenant_gpu_time_seconds_total{{{labels}}} 2.5"),
        format!("vgpu_tenant_processes{{{labels}}} 1"),
        format!("vgpu_gpu_xid_errors_total{{node=\"node-a\",gpu=\"{gpu0}\"}} 1"),
        format!(
            "vgpu_gpu_ecc_errors_total{{node=\"node-a\",gpu=\"{gpu0}\",kind=\"uncorrected\"}} 2"
        ),
        format!("vgpu_gpu_throttled{{node=\"node-a\",gpu=\"{gpu0}\",reason=\"hw_slowdown\"}} 1"),
    ] {
        ensure!(
            metrics.contains(&format!("{line}\n")),
            "`{line}` missing from the leader's /metrics:\n{metrics}"
        );
    }
    // Followers leave the soft-state series to the leader (each series once per cluster).
    let on_follower = tests::http_get(&follower, "/metrics")?;
    ensure!(
        !on_follower.contains("vgpu_tenant_memory_bytes{"),
        "a follower exported usage:\n{on_follower}"
    );

    // The process exits (its slot stays until the interposer reclaims it): not counted.
    drop(schedule);
    ledger.region().slots[0]
        .pid
        .store(0x7fff_fff0, std::sync::atomic::Ordering::SeqCst);
    wait_for(
        "the dead process to drop out",
        Duration::from_secs(20),
        || {
            let metrics = tests::http_get(&leader_address, "/metrics").ok()?;
            metrics
                .contains(&format!("vgpu_tenant_memory_bytes{{{labels}}} 0\n"))
                .then_some(())
        },
    )
    .with_context(|| cluster.logs())?;

    // The leader goes away. The agent's report is unchanged, so its beats carry none; the new
    // leader holds no reports (soft state), answers `report_wanted`, and gets the full report on
    // the agent's next beat: within the 12 s waited here, where the agent's 30-beat refresh
    // would take about 30 s.
    cluster.member(leader).kill();
    let new_leader = wait_for("a new leader", Duration::from_secs(15), || {
        let status =
            json(&tests::vgpuctl(&follower, &["cluster", "status", "-o", "json"]).ok()?).ok()?;
        status["leader"]
            .as_u64()
            .filter(|&id| id > 0 && id != leader)
    })
    .with_context(|| cluster.logs())?;
    let new_leader_address = cluster
        .members
        .iter()
        .find(|m| m.id == new_leader)
        .context("the new leader")?
        .address
        .clone();
    wait_for(
        "the new leader to hold the node's report",
        Duration::from_secs(12),
        || {
            let metrics = tests::http_get(&new_leader_address, "/metrics").ok()?;
            metrics
                .contains(&format!(
                    "vgpu_tenant_memory_limit_bytes{{{labels}}} {}\n",
                    10 * GIB
                ))
                .then_some(())
        },
    )
    .with_context(|| cluster.logs())?;
    Ok(())
}

/// Issue 17: a tenant placed with a memory limit gets it on its GPU's memory board, linked into
/// its private directory; what its process holds there (here reserved through the board's own
/// protocol, as the interposer will) comes back as request, limit, resident and borrowed bytes in
/// `describe tenant` and `/metrics`.
#[test]
fn a_memory_limit_reaches_the_board_and_borrowed_bytes_come_back() -> Result<()> {
    let mut cluster = Cluster::start(1, &tests::FAST_FLAGS)?;
    let shm_dir = cluster.dir.path().join("shm");
    let shm = shm_dir.to_str().context("a UTF-8 path")?.to_owned();
    cluster.start_agent_with("node-a", "1xH100-80GB", &["--shm-dir", &shm])?;
    cluster.wait_nodes_ready(1)?;
    let placed = cluster.vgpuctl(&[
        "place",
        "kv",
        "--gpus",
        "0.25",
        "--memory",
        "10GiB",
        "--memory-limit",
        "30GiB",
    ])?;
    ensure!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );
    let tenant = json(&cluster.vgpuctl(&["get", "tenants", "kv", "-o", "json"])?)?;
    ensure!(
        tenant["slices"][0]["memory_limit_bytes"] == 30 * GIB,
        "{tenant}"
    );
    let gpu = tenant["slices"][0]["gpu"]
        .as_str()
        .context("a placed slice")?
        .to_owned();
    let board = tenant_abi::layout::board_path(&shm_dir.join("tenants/kv"), &gpu);
    wait_for(
        "the agent to link the board",
        Duration::from_secs(20),
        || board.exists().then_some(()),
    )
    .with_context(|| cluster.logs())?;
    let (_held, grant) = tenant_abi::writer::reserve_board(
        &board,
        "kv",
        std::process::id(),
        tenant_abi::ledger::own_start_time(),
        12 * GIB,
    )
    .map_err(anyhow::Error::msg)?;
    ensure!(grant == tenant_abi::board::Grant::Borrowed, "{grant:?}");

    let text = wait_for("the board in describe", Duration::from_secs(20), || {
        let text = describe(&cluster, &["describe", "tenant", "kv"])?;
        text.contains("Elastic memory:").then_some(text)
    })
    .with_context(|| cluster.logs())?;
    let row = text
        .lines()
        .skip_while(|line| !line.starts_with("Elastic memory:"))
        .nth(2)
        .context("an elastic memory row")?;
    let cells: Vec<&str> = row.split_whitespace().collect();
    ensure!(
        cells[2..] == ["10GiB", "30GiB", "12GiB", "2GiB", "0B", "0B", "-", "-"],
        "{row}\n{text}"
    );
    let metrics = tests::http_get(&cluster.members[0].address, "/metrics")?;
    let labels = format!("tenant=\"kv\",node=\"node-a\",gpu=\"{gpu}\"");
    for line in [
        format!("vgpu_tenant_memory_request_bytes{{{labels}}} {}", 10 * GIB),
        format!(
            "vgpu_tenant_memory_board_limit_bytes{{{labels}}} {}",
            30 * GIB
        ),
        format!("vgpu_tenant_memory_borrowed_bytes{{{labels}}} {}", 2 * GIB),
        format!("vgpu_tenant_memory_staging_bytes{{{labels}}} 0"),
    ] {
        ensure!(
            metrics.contains(&format!("{line}\n")),
            "`{line}` missing from /metrics:\n{metrics}"
        );
    }
    Ok(())
}

fn describe(cluster: &Cluster, args: &[&str]) -> Option<String> {
    let output = cluster.vgpuctl(args).ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

fn describe_at(endpoint: &str, args: &[&str]) -> Option<String> {
    let output = tests::vgpuctl(endpoint, args).ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}
