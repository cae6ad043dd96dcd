//! A three-member cluster of real processes: placements through any member, `kill -9` of the
//! leader during a stream of placements, catch-up after restart, and a whole-cluster crash.

use anyhow::{Result, ensure};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tests::{Cluster, fraction, json, pool_client, wait_for};

/// Places `prefix-0..count` through the members in turn; returns the names acknowledged.
async fn place_stream(
    endpoints: Vec<String>,
    prefix: &str,
    count: usize,
    deadline: Duration,
) -> BTreeSet<String> {
    let mut acknowledged = BTreeSet::new();
    let started = Instant::now();
    let mut next = 0;
    let mut attempt = 0;
    while next < count && started.elapsed() < deadline {
        let name = format!("{prefix}-{next}");
        // Rotate on every attempt, so a dead member is skipped on the retry.
        let endpoint = &endpoints[attempt % endpoints.len()];
        attempt += 1;
        let Ok(mut client) = pool_client(endpoint).await else {
            continue;
        };
        let request = api::v1::PlaceRequest {
            name: name.clone(),
            request: Some(fraction(10, 1)),
        };
        match client.place(request).await {
            Ok(_) => {
                acknowledged.insert(name);
                next += 1;
            }
            // Not acknowledged: try the same name again (placing is idempotent) elsewhere.
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    acknowledged
}

fn tenant_names(cluster: &Cluster, endpoint: &str, stale: bool) -> Result<BTreeSet<String>> {
    let mut args = vec!["get", "tenants", "-o", "json"];
    if stale {
        args.push("--stale");
    }
    let tenants = json(&tests::vgpuctl(endpoint, &args)?)?;
    let _ = cluster;
    Ok(tenants
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect())
}

#[test]
fn leader_kill_loses_no_acknowledged_placement() -> Result<()> {
    let mut cluster = Cluster::start(3, &[])?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let endpoints: Vec<String> = cluster.members.iter().map(|m| m.address.clone()).collect();

    // Placements through every member, while the leader is killed part-way.
    let stream = runtime.spawn(place_stream(
        endpoints.clone(),
        "a",
        120,
        Duration::from_secs(60),
    ));
    std::thread::sleep(Duration::from_millis(400));
    let leader = cluster.leader()?;
    cluster.member(leader).kill();
    let killed_at = Instant::now();
    let acknowledged = runtime.block_on(stream)?;
    ensure!(
        acknowledged.len() == 120,
        "placements did not resume after the election: {} of 120\n{}",
        acknowledged.len(),
        cluster.logs()
    );

    let survivors = cluster.live_endpoints();
    let new_leader = wait_for("a new leader", Duration::from_secs(10), || {
        let status =
            json(&tests::vgpuctl(&survivors, &["cluster", "status", "-o", "json"]).ok()?).ok()?;
        status["leader"].as_u64().filter(|&l| l > 0 && l != leader)
    })?;
    eprintln!(
        "new leader {new_leader}, {:?} after the kill",
        killed_at.elapsed()
    );
    let present = tenant_names(&cluster, &survivors, false)?;
    let missing: Vec<_> = acknowledged.difference(&present).collect();
    ensure!(
        missing.is_empty(),
        "acknowledged placements lost: {missing:?}"
    );

    // The agent's assignment stream resumed on a surviving member: every acknowledged tenant
    // reached its state directory.
    let agent_tenants = cluster.agent("node-a").state_dir.join("tenants");
    wait_for(
        "the agent to see every acknowledged tenant",
        Duration::from_secs(20),
        || {
            let files: BTreeSet<String> = std::fs::read_dir(&agent_tenants)
                .ok()?
                .filter_map(|entry| {
                    entry
                        .ok()?
                        .file_name()
                        .to_str()?
                        .strip_suffix(".json")
                        .map(str::to_owned)
                })
                .collect();
            acknowledged.is_subset(&files).then_some(())
        },
    )?;

    // The killed member restarts from its data directory and catches up.
    cluster.member(leader).start()?;
    let address = cluster.member(leader).address.clone();
    wait_for(
        "the restarted member to catch up",
        Duration::from_secs(20),
        || {
            let local = tenant_names(&cluster, &address, true).ok()?;
            (local == present).then_some(())
        },
    )?;

    // Every member killed at once and restarted: nothing acknowledged is lost.
    let more = runtime.block_on(place_stream(
        endpoints.clone(),
        "b",
        30,
        Duration::from_secs(30),
    ));
    ensure!(more.len() == 30, "placements before the full crash failed");
    for member in &mut cluster.members {
        member.kill();
    }
    for member in &mut cluster.members {
        member.start()?;
    }
    cluster.leader()?;
    let after = tenant_names(&cluster, &cluster.endpoints(), false)?;
    let lost: Vec<_> = acknowledged
        .union(&more)
        .filter(|name| !after.contains(*name))
        .collect();
    ensure!(
        lost.is_empty(),
        "lost after a whole-cluster crash: {lost:?}\n{}",
        cluster.logs()
    );
    Ok(())
}

#[test]
fn membership_remove_and_rejoin_refusal() -> Result<()> {
    let cluster = Cluster::start(3, &[])?;
    let removed = cluster.vgpuctl(&["cluster", "remove", "3"])?;
    ensure!(
        removed.status.success(),
        "{}",
        String::from_utf8_lossy(&removed.stderr)
    );
    let status = cluster.status_json()?;
    let ids: Vec<u64> = status["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_u64())
        .collect();
    ensure!(ids == vec![1, 2], "member 3 still listed: {status}");
    let unknown = cluster.vgpuctl(&["cluster", "remove", "9"])?;
    ensure!(
        !unknown.status.success(),
        "removing an unknown member must fail"
    );
    Ok(())
}

#[test]
fn a_lagging_member_catches_up_from_a_snapshot() -> Result<()> {
    let flags = ["--snapshot-every", "20", "--snapshot-keep-logs", "2"];
    let mut cluster = Cluster::start(3, &flags)?;
    cluster.start_agent("node-a", "8xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let leader = cluster.leader()?;
    let lagging = cluster
        .members
        .iter()
        .map(|m| m.id)
        .find(|&id| id != leader)
        .expect("a follower");
    cluster.member(lagging).kill();
    let runtime = tokio::runtime::Runtime::new()?;
    let endpoints: Vec<String> = cluster
        .members
        .iter()
        .filter(|m| m.id != lagging)
        .map(|m| m.address.clone())
        .collect();
    let acknowledged = runtime.block_on(place_stream(endpoints, "s", 80, Duration::from_secs(60)));
    ensure!(
        acknowledged.len() == 80,
        "placements failed with one member down"
    );
    cluster.member(lagging).start()?;
    let address = cluster.member(lagging).address.clone();
    wait_for(
        "the lagging member to catch up",
        Duration::from_secs(20),
        || {
            let local = tenant_names(&cluster, &address, true).ok()?;
            acknowledged.is_subset(&local).then_some(())
        },
    )?;
    let log = cluster.member(lagging).log_text();
    ensure!(
        log.contains("installed a snapshot"),
        "expected catch-up through a snapshot:\n{log}"
    );
    Ok(())
}

#[test]
fn two_members_joining_at_once_both_become_voters() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    let peer = cluster.members[0].address.clone();
    for id in [2u64, 3] {
        let mut member = tests::Member {
            id,
            address: format!("127.0.0.1:{}", tests::free_port()),
            data_dir: cluster.dir.path().join(format!("cp{id}")),
            process: None,
            peer: Some(peer.clone()),
            extra: Vec::new(),
        };
        member.start()?;
        cluster.members.push(member);
    }
    wait_for("three voters", Duration::from_secs(30), || {
        let status = cluster.status_json().ok()?;
        let voters = status["members"]
            .as_array()?
            .iter()
            .filter(|m| m["voter"] == true)
            .count();
        (voters == 3).then_some(())
    })
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.logs()))?;
    for member in &mut cluster.members {
        ensure!(
            member
                .process
                .as_mut()
                .is_some_and(tests::Process::is_running),
            "member {} exited",
            member.id
        );
    }
    Ok(())
}
