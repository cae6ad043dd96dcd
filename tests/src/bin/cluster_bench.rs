//! `cluster-bench`: committed placements per second through a three-member control plane of real
//! processes on loopback (durable: every entry fsynced on a majority), and two failover times
//! after `kill -9` of the leader: to the next committed placement, and to the moment a surviving
//! member reports that it holds the leadership (`vgpu_raft_is_leader 1` in its `/metrics`), from
//! which its leader loop (node loss, pending retries) acts at its next tick. On the Raft store the
//! two wait for the same election; on the etcd store any member appends without a leader, so the
//! first is quick, and the second waits for the dead leader's etcd lease to expire.
//!
//! Run: `cargo run --release -p tests --bin cluster-bench` (builds the release binaries first).
//! `--store etcd` runs the same members on the etcd store (issue 20) against three real etcd
//! members started on loopback (Debian's `etcd-server`), so the two stores compare in one run.

use anyhow::{Context, Result, ensure};
use clap::Parser;
use std::time::{Duration, Instant};
use tests::{Cluster, fraction, pool_client};

#[derive(Parser)]
struct Args {
    /// Seconds per throughput run.
    #[arg(long, default_value = "10")]
    seconds: u64,
    /// Concurrent client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    clients: Vec<usize>,
    /// Simulated nodes (8 x H100 each) registered for capacity.
    #[arg(long, default_value = "300")]
    nodes: usize,
    /// Send placements to every member (followers forward to the leader) or only to the leader.
    #[arg(long, value_enum, default_value = "all")]
    target: Target,
    /// Leader kills for the failover measurement.
    #[arg(long, default_value = "5")]
    failovers: usize,
    /// Where the members keep the pool's state: their own Raft group, or an etcd cluster.
    #[arg(long, value_enum, default_value = "raft")]
    store: Store,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Store {
    Raft,
    Etcd,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Target {
    All,
    Leader,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn register_nodes(endpoint: &str, count: usize) -> Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))?
        .connect()
        .await?;
    let mut client = api::v1::agent_client::AgentClient::new(channel);
    for n in 0..count {
        let gpus = (0..8)
            .map(|i| api::v1::Gpu {
                uuid: format!("GPU-bench-{n:05}-{i}"),
                index: i,
                model: "H100-80GB".into(),
                memory_bytes: 80 << 30,
                sm_count: 132,
                nvlink_peers: (0..8)
                    .filter(|&p| p != i)
                    .map(|p| api::v1::NvlinkPeer {
                        gpu_index: p,
                        link_count: 18,
                    })
                    .collect(),
                numa_node: (i / 4) as i32,
                ..Default::default()
            })
            .collect();
        let node = api::v1::Node {
            name: format!("bench-{n:05}"),
            gpus,
            ..Default::default()
        };
        client
            .register(api::v1::RegisterRequest { node: Some(node) })
            .await?;
    }
    Ok(())
}

/// Runs `clients` concurrent placement loops for `seconds`; returns latencies of committed ones.
async fn throughput(
    endpoints: &[String],
    clients: usize,
    seconds: u64,
    run: usize,
) -> Result<(usize, Vec<Duration>)> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for client_index in 0..clients {
        let endpoint = endpoints[client_index % endpoints.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut client = pool_client(&endpoint).await?;
            let mut latencies = Vec::new();
            let mut sequence = 0;
            while Instant::now() < deadline {
                let name = format!("r{run}-c{client_index}-{sequence}");
                sequence += 1;
                let started = Instant::now();
                client
                    .place(api::v1::PlaceRequest {
                        name,
                        request: Some(fraction(10, 1)),
                    })
                    .await?;
                latencies.push(started.elapsed());
            }
            anyhow::Ok(latencies)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    all.sort();
    Ok((all.len(), all))
}

/// The two failover times of one kill: to the next committed placement, and to a surviving
/// member holding the leadership (the leader loop's hand-over).
struct Failover {
    placement: Duration,
    leader_loop: Duration,
}

/// Longest either failover time may take before the benchmark gives up.
const FAILOVER_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often the survivors' `/metrics` are read while waiting for a new leader.
const LEADER_POLL: Duration = Duration::from_millis(10);

/// Whether the member at `address` says, in its `/metrics`, that it holds the leadership.
fn reports_leading(address: &str) -> bool {
    tests::http_get(address, "/metrics").is_ok_and(|metrics| {
        metrics
            .lines()
            .any(|line| line.trim() == "vgpu_raft_is_leader 1")
    })
}

/// Reads the survivors' `/metrics` from `killed` on until one of them holds the leadership;
/// returns the time since `killed` (a thread of its own, so the placement loop is not delayed).
fn watch_leader_loop(
    survivors: Vec<String>,
    killed: Instant,
) -> std::thread::JoinHandle<Result<Duration>> {
    std::thread::spawn(move || {
        loop {
            if survivors.iter().any(|address| reports_leading(address)) {
                return Ok(killed.elapsed());
            }
            ensure!(
                killed.elapsed() < FAILOVER_WAIT_MAX,
                "no surviving member held the leadership within {} s of the kill",
                FAILOVER_WAIT_MAX.as_secs()
            );
            std::thread::sleep(LEADER_POLL);
        }
    })
}

/// Kills the leader during a placement stream; returns the time to the next committed placement
/// and the time until a survivor holds the leadership.
async fn failover(cluster: &mut Cluster, round: usize) -> Result<Failover> {
    // Every member (including the one restarted in the previous round) answers first.
    for member in &cluster.members {
        let address = member.address.clone();
        tests::wait_for(
            &format!("member {} to answer", member.id),
            Duration::from_secs(30),
            || {
                tests::vgpuctl(&address, &["cluster", "status", "-o", "json"])
                    .ok()
                    .filter(|output| output.status.success())
                    .and_then(|output| tests::json(&output).ok())
                    .filter(|status| status["leader"].as_u64().unwrap_or(0) > 0)
            },
        )?;
    }
    // The member that holds the leadership by its own account (what the survivors are then
    // watched for), rather than by another member's view, which may lag.
    let leader = tests::wait_for("a member holding the leadership", FAILOVER_WAIT_MAX, || {
        cluster
            .members
            .iter()
            .find(|member| reports_leading(&member.address))
            .map(|member| member.id)
    })?;
    let survivors: Vec<String> = cluster
        .members
        .iter()
        .filter(|m| m.id != leader)
        .map(|m| m.address.clone())
        .collect();
    let mut clients = Vec::new();
    for endpoint in &survivors {
        clients.push(pool_client(endpoint).await?);
    }
    // Warm the connections.
    for (i, client) in clients.iter_mut().enumerate() {
        client
            .place(api::v1::PlaceRequest {
                name: format!("warm-{round}-{i}"),
                request: Some(fraction(10, 1)),
            })
            .await?;
    }
    cluster.member(leader).kill();
    let killed = Instant::now();
    let leader_watch = watch_leader_loop(survivors, killed);
    let mut attempt = 0;
    let placement = loop {
        let count = clients.len();
        let client = &mut clients[attempt % count];
        attempt += 1;
        let request = api::v1::PlaceRequest {
            name: format!("fo-{round}-{attempt}"),
            request: Some(fraction(10, 1)),
        };
        if client.place(request).await.is_ok() {
            break killed.elapsed();
        }
        ensure!(
            killed.elapsed() < FAILOVER_WAIT_MAX,
            "no placement committed within {} s of the kill",
            FAILOVER_WAIT_MAX.as_secs()
        );
    };
    let leader_loop = tokio::task::spawn_blocking(move || leader_watch.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the leader watch panicked"))??;
    cluster.member(leader).start()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(Failover {
        placement,
        leader_loop,
    })
}

fn milliseconds(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Agents are not run: the nodes are registered directly, so they must not time out.
    let mut extra = vec!["--node-lost-timeout-ms".to_owned(), "86400000".to_owned()];
    // Kept until the end: dropping it stops the etcd members.
    let etcd = match args.store {
        Store::Raft => None,
        Store::Etcd => {
            let etcd = runtime
                .block_on(etcd_store::testing::EtcdCluster::start(
                    "cluster_bench",
                    3,
                    true,
                ))
                .context("no etcd to run on: install Debian's etcd-server")?;
            extra.extend([
                "--etcd-endpoints".to_owned(),
                etcd.endpoints().join(","),
                "--etcd-prefix".to_owned(),
                "/vgpu-bench/".to_owned(),
            ]);
            Some(etcd)
        }
    };
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut cluster = Cluster::start(3, &extra)?;
    let endpoints: Vec<String> = cluster.members.iter().map(|m| m.address.clone()).collect();
    runtime
        .block_on(register_nodes(&endpoints[0], args.nodes))
        .context("registering nodes")?;
    println!(
        "three-member cluster on loopback ({}), {} nodes x 8 GPUs registered",
        match args.store {
            Store::Raft => "built-in Raft store",
            Store::Etcd => "etcd store, three etcd members",
        },
        args.nodes
    );
    println!("| clients | committed placements/s | p50 ms | p99 ms |");
    println!("| --: | --: | --: | --: |");
    for (run, &clients) in args.clients.iter().enumerate() {
        let (count, latencies) =
            runtime.block_on(throughput(&endpoints, clients, args.seconds, run))?;
        println!(
            "| {clients} | {:.0} | {:.2} | {:.2} |",
            count as f64 / args.seconds as f64,
            percentile(&latencies, 0.50).as_secs_f64() * 1e3,
            percentile(&latencies, 0.99).as_secs_f64() * 1e3
        );
    }
    let mut placements = Vec::new();
    let mut leader_loops = Vec::new();
    for round in 0..args.failovers {
        let failover = runtime.block_on(failover(&mut cluster, round))?;
        println!(
            "failover {round}: {:.0} ms from kill -9 of the leader to the next committed placement, {:.0} ms to a survivor holding the leadership (leader loop)",
            milliseconds(failover.placement),
            milliseconds(failover.leader_loop)
        );
        placements.push(failover.placement);
        leader_loops.push(failover.leader_loop);
    }
    placements.sort();
    leader_loops.sort();
    if let (Some(placement_max), Some(leader_loop_max)) = (placements.last(), leader_loops.last()) {
        println!(
            "failover over {} kills, to the next committed placement: median {:.0} ms, max {:.0} ms",
            placements.len(),
            milliseconds(percentile(&placements, 0.5)),
            milliseconds(*placement_max)
        );
        println!(
            "failover over {} kills, to a survivor holding the leadership (leader loop): median {:.0} ms, max {:.0} ms",
            leader_loops.len(),
            milliseconds(percentile(&leader_loops, 0.5)),
            milliseconds(*leader_loop_max)
        );
    }
    drop(cluster);
    drop(etcd);
    Ok(())
}
