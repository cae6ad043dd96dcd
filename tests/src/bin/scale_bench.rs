//! `scale-bench`: a three-member control plane of real processes under a simulated fleet
//! (`vgpu-agent simulate-fleet`, N nodes heartbeating every second and watching their
//! assignments) while placements and releases run at a steady rate. Measures, over a fixed
//! window: each member's CPU (from `/proc/PID/stat`) and memory, heartbeat handling latency as
//! the members see it (`vgpu_heartbeat_handling_seconds` on `/metrics`) and as the simulated
//! agents see it (the fleet's summary), and end-to-end placement and release latency as a
//! vgpuctl-like client sees it (any member; followers forward).
//!
//! Run: `cargo run --release -p tests --bin scale-bench -- --nodes 1000` (builds the release
//! binaries first); `tests/scale.sh` runs the recorded configurations.

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tests::{Cluster, Process, binary, fraction, http_get, pool_client, wait_for};

#[derive(Parser)]
struct Args {
    /// Simulated nodes.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// GPUs of each node.
    #[arg(long, default_value = "8xH100-80GB")]
    spec: String,
    /// Seconds of the measurement window (placements run throughout).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Placements per second (each also releases the tenant placed `--live-tenants` earlier).
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Tenants kept placed: once this many exist, every placement releases the oldest.
    #[arg(long, default_value_t = 500)]
    live_tenants: usize,
    /// Seconds to let the fleet settle after the last node registered.
    #[arg(long, default_value_t = 5)]
    settle: u64,
    /// Record the leader with `perf record -g` during the window (needs perf).
    #[arg(long)]
    perf: bool,
    /// Where logs, the fleet's summary and perf data go [default: a new directory under /tmp].
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Extra arguments for `vgpu-agent simulate-fleet`, e.g. `--nodes-per-connection=100`.
    #[arg(long, allow_hyphen_values = true)]
    fleet_arg: Vec<String>,
    /// Extra arguments for every `vgpu-cp` member, e.g. `--member-arg=--election-timeout-ms=1000`.
    #[arg(long, allow_hyphen_values = true)]
    member_arg: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.rate > 0.0 && args.rate <= 1000.0,
        "--rate is 0 < rate <= 1000"
    );
    let out_dir = match &args.out_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("scale-bench-{}", std::process::id())),
    };
    std::fs::create_dir_all(&out_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let load_before = std::fs::read_to_string("/proc/loadavg")?;
    let uptime_before = uptime();

    let member_args: Vec<&str> = args.member_arg.iter().map(String::as_str).collect();
    let cluster = Cluster::start(3, &member_args)?;
    let endpoints: Vec<String> = cluster.members.iter().map(|m| m.address.clone()).collect();
    let summary_path = out_dir.join("fleet-summary.json");
    let mut fleet_command = Command::new(binary("vgpu-agent"));
    fleet_command
        .arg("simulate-fleet")
        .args(["--control-plane", &endpoints.join(",")])
        .args(["--count", &args.nodes.to_string(), "--spec", &args.spec])
        .args(["--progress-ms", "2000", "--insecure"])
        .arg("--summary-json")
        .arg(&summary_path)
        .args(&args.fleet_arg)
        .env("RUST_LOG", "info,h2=warn,tower=warn,hyper=warn");
    let mut fleet = Process::spawn(fleet_command, out_dir.join("fleet.log"))?;
    let fleet_pid = fleet.id().context("the fleet runs")?;

    let started = Instant::now();
    let gpus_expected = args.nodes * gpus_in_spec(&args.spec)?;
    let ramp_patience = Duration::from_secs(120 + args.nodes as u64 / 20);
    // The fleet says when every node's Register call returned (each returns once its entry is
    // committed); the leader's state confirms it. Polling the leader's `/metrics` instead, every
    // 50 ms, made it render the health series of every registered GPU each time (at 10,000
    // nodes an estimated 40-60 MB of text per scrape), which loaded the leader more than the
    // fleet did.
    let registered_line = format!("all {} nodes registered", args.nodes);
    wait_for(
        &format!("{} nodes registered", args.nodes),
        ramp_patience,
        || {
            std::thread::sleep(Duration::from_millis(200));
            std::fs::read_to_string(&fleet.log)
                .ok()?
                .contains(&registered_line)
                .then_some(())
        },
    )
    .with_context(|| format!("fleet log: {}", fleet.log.display()))?;
    wait_for(
        "the leader's state to show every GPU",
        Duration::from_secs(60),
        || {
            std::thread::sleep(Duration::from_millis(500));
            let leader = cluster.leader().ok()?;
            let address = &cluster.members[leader as usize - 1].address;
            let gpus = metric(&http_get(address, "/metrics").ok()?, "vgpu_pool_gpus")?;
            (gpus as usize >= gpus_expected).then_some(())
        },
    )?;
    let ramp = started.elapsed();
    println!(
        "{} nodes x {} registered in {:.1} s (as the fleet saw it, confirmed by the leader's state)",
        args.nodes,
        args.spec,
        ramp.as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(args.settle));

    // Every member's own view, not one member's answer: right after an election a member may
    // still name the old leader, and the CPU columns would be labelled wrongly.
    let leader = wait_for(
        "a leader every member agrees on",
        Duration::from_secs(30),
        || {
            let texts = scrape_all(&cluster).ok()?;
            let leaders: std::collections::BTreeSet<u64> = texts
                .values()
                .map(|text| metric(text, "vgpu_raft_leader_id").unwrap_or(0.0) as u64)
                .collect();
            (leaders.len() == 1)
                .then(|| leaders.into_iter().next())?
                .filter(|&id| id > 0)
        },
    )?;
    let leader_member = &cluster.members[leader as usize - 1];
    let mut pids: Vec<(String, u32)> = cluster
        .members
        .iter()
        .map(|member| {
            let role = if member.id == leader {
                "leader"
            } else {
                "follower"
            };
            let pid = member
                .process
                .as_ref()
                .and_then(Process::id)
                .expect("members run");
            (format!("vgpu-cp {} ({role})", member.id), pid)
        })
        .collect();
    pids.push(("simulate-fleet".to_owned(), fleet_pid));
    let metrics_before = scrape_all(&cluster)?;
    let cpu_before: Vec<f64> = pids.iter().map(|(_, pid)| cpu_seconds(*pid)).collect();
    let perf = if args.perf {
        let leader_pid = pids[leader as usize - 1].1;
        let mut command = Command::new("perf");
        command
            .args(["record", "-g", "-p", &leader_pid.to_string(), "-o"])
            .arg(out_dir.join("leader.perf.data"))
            .args(["--", "sleep", &args.seconds.to_string()]);
        Some(Process::spawn(command, out_dir.join("perf.log"))?)
    } else {
        None
    };
    let window = Instant::now();
    let rss_peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let rss_peak = rss_peak.clone();
        let pid = pids[leader as usize - 1].1;
        let seconds = args.seconds;
        std::thread::spawn(move || {
            let end = Instant::now() + Duration::from_secs(seconds);
            while Instant::now() < end {
                if let Some(kib) = status_kib(pid, "VmRSS") {
                    rss_peak.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let load = runtime.block_on(placements(
        &endpoints,
        args.rate,
        Duration::from_secs(args.seconds),
        args.live_tenants,
    ))?;
    let elapsed = window.elapsed().as_secs_f64();
    let cpu_after: Vec<f64> = pids.iter().map(|(_, pid)| cpu_seconds(*pid)).collect();
    let metrics_after = scrape_all(&cluster)?;
    sampler.join().expect("the sampler does not panic");
    let rss: Vec<Option<u64>> = pids
        .iter()
        .map(|(_, pid)| status_kib(*pid, "VmRSS"))
        .collect();
    let leader_pid = pids[leader as usize - 1].1;
    let leader_hwm = status_kib(leader_pid, "VmHWM");
    if let Some(mut perf) = perf {
        wait_for("perf to finish", Duration::from_secs(30), || {
            (!perf.is_running()).then_some(())
        })?;
    }
    let fleet_ok = fleet.terminate(Duration::from_secs(20))?;
    let load_after = std::fs::read_to_string("/proc/loadavg")?;
    let uptime_after = uptime();

    println!();
    println!(
        "window: {elapsed:.1} s; leader: member {leader} at {}",
        leader_member.address
    );
    println!("uptime before: {uptime_before}");
    println!("uptime after:  {uptime_after}");
    println!("| process | CPU (cores, mean over the window) | RSS at the end (MiB) |");
    println!("| --- | --: | --: |");
    for (index, (name, _)) in pids.iter().enumerate() {
        let cores = (cpu_after[index] - cpu_before[index]) / elapsed;
        let mib = rss[index].map_or("-".to_owned(), |kib| format!("{:.0}", kib as f64 / 1024.0));
        println!("| {name} | {cores:.2} | {mib} |");
    }
    println!(
        "leader RSS peak during the window: {:.0} MiB (sampled), VmHWM {:.0} MiB",
        rss_peak.load(Ordering::Relaxed) as f64 / 1024.0,
        leader_hwm.unwrap_or(0) as f64 / 1024.0
    );
    println!();
    println!(
        "heartbeat handling as the members saw it (window, `vgpu_heartbeat_handling_seconds`):"
    );
    println!("| path | heartbeats | per second | p50 ms | p99 ms |");
    println!("| --- | --: | --: | --: | --: |");
    for path in ["leader", "forwarded"] {
        let delta = histogram_delta(&metrics_before, &metrics_after, path);
        let count = delta.last().map_or(0.0, |(_, count)| *count);
        println!(
            "| {path} | {count:.0} | {:.0} | {} | {} |",
            count / elapsed,
            format_ms(histogram_quantile(&delta, 0.5)),
            format_ms(histogram_quantile(&delta, 0.99))
        );
    }
    let sum = |texts: &BTreeMap<u64, String>, name: &str| -> f64 {
        texts.values().filter_map(|text| metric(text, name)).sum()
    };
    let batches = sum(&metrics_after, "vgpu_heartbeat_batches_forwarded_total")
        - sum(&metrics_before, "vgpu_heartbeat_batches_forwarded_total");
    let forwarded = histogram_delta(&metrics_before, &metrics_after, "forwarded")
        .last()
        .map_or(0.0, |(_, count)| *count);
    println!(
        "forwarded heartbeats went to the leader in {batches:.0} batches ({:.0} calls/s, {:.1} beats per call)",
        batches / elapsed,
        forwarded / batches.max(1.0)
    );
    let terms = |texts: &BTreeMap<u64, String>| -> Vec<f64> {
        texts
            .values()
            .filter_map(|text| metric(text, "vgpu_raft_term"))
            .collect()
    };
    println!(
        "Raft terms before / after the window: {:?} / {:?} (a change is an election)",
        terms(&metrics_before),
        terms(&metrics_after)
    );
    println!();
    println!(
        "placements: {} at {:.1}/s ({} placed at once, {} pending, {} failed); releases: {} ({} failed)",
        load.place.len(),
        load.place.len() as f64 / elapsed,
        load.placed,
        load.pending,
        load.place_failures,
        load.release.len(),
        load.release_failures
    );
    println!("| call | p50 ms | p90 ms | p99 ms | max ms |");
    println!("| --- | --: | --: | --: | --: |");
    for (name, latencies) in [("place", &load.place), ("release", &load.release)] {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            percentile(latencies, 0.5),
            percentile(latencies, 0.9),
            percentile(latencies, 0.99),
            percentile(latencies, 1.0)
        );
    }
    if let Some(error) = &load.first_error {
        println!("first failure: {error}");
    }
    println!();
    match std::fs::read_to_string(&summary_path) {
        Ok(json) => {
            let summary: serde_json::Value = serde_json::from_str(&json)?;
            let steady = &summary["heartbeat_latency_steady"];
            println!(
                "fleet (client view, after ramp-up): {} heartbeats sent, {} failed; p50 {} ms, p99 {} ms, max {} ms; {} assignment messages",
                summary["heartbeats_sent"],
                summary["heartbeat_failures"],
                steady["p50_ms"],
                steady["p99_ms"],
                steady["max_ms"],
                summary["assignment_messages"]
            );
            println!(
                "fleet, whole run: {} heartbeats with a full health report, {} answered `report wanted`; registration p50 {} ms, p99 {} ms",
                summary["reports_sent"],
                summary["reports_wanted"],
                summary["register_latency"]["p50_ms"],
                summary["register_latency"]["p99_ms"]
            );
        }
        Err(error) => println!(
            "no fleet summary ({error}; the fleet {} cleanly)",
            if fleet_ok { "exited" } else { "did not exit" }
        ),
    }
    println!("load average before: {}", load_before.trim());
    println!("load average after:  {}", load_after.trim());
    println!("logs: {}", out_dir.display());
    let member_logs = out_dir.join("members");
    std::fs::create_dir_all(&member_logs)?;
    for member in &cluster.members {
        std::fs::write(
            member_logs.join(format!("cp{}.log", member.id)),
            member.log_text(),
        )?;
    }
    Ok(())
}

fn gpus_in_spec(spec: &str) -> Result<usize> {
    let count = spec
        .split_once(['x', 'X'])
        .and_then(|(count, _)| count.parse().ok())
        .with_context(|| format!("`{spec}` is not COUNTxMODEL-MEMORY"))?;
    Ok(count)
}

fn uptime() -> String {
    Command::new("uptime")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The value of an unlabelled sample in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Every member's `/metrics`, by member id.
fn scrape_all(cluster: &Cluster) -> Result<BTreeMap<u64, String>> {
    cluster
        .members
        .iter()
        .map(|member| Ok((member.id, http_get(&member.address, "/metrics")?)))
        .collect()
}

/// Cumulative `(le, count)` buckets of `vgpu_heartbeat_handling_seconds{path}`, summed over the
/// members, after minus before.
fn histogram_delta(
    before: &BTreeMap<u64, String>,
    after: &BTreeMap<u64, String>,
    path: &str,
) -> Vec<(f64, f64)> {
    let prefix = format!("vgpu_heartbeat_handling_seconds_bucket{{path=\"{path}\",le=\"");
    let buckets = |texts: &BTreeMap<u64, String>| {
        let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for text in texts.values() {
            for line in text.lines() {
                let Some(rest) = line.strip_prefix(&prefix) else {
                    continue;
                };
                let Some((le, count)) = rest.split_once("\"} ") else {
                    continue;
                };
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                let count: f64 = count.trim().parse().unwrap_or(0.0);
                let entry = sums.entry(le.to_bits()).or_insert((le, 0.0));
                entry.1 += count;
            }
        }
        let mut list: Vec<(f64, f64)> = sums.into_values().collect();
        list.sort_by(|a, b| a.0.total_cmp(&b.0));
        list
    };
    let before = buckets(before);
    buckets(after)
        .into_iter()
        .map(|(le, count)| {
            let old = before
                .iter()
                .find(|(bound, _)| *bound == le)
                .map_or(0.0, |(_, count)| *count);
            (le, count - old)
        })
        .collect()
}

/// A quantile of cumulative buckets, interpolated linearly inside the bucket (as Prometheus'
/// `histogram_quantile` does). `None` when empty.
fn histogram_quantile(buckets: &[(f64, f64)], quantile: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = quantile * total;
    let mut lower = (0.0, 0.0);
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower.0);
            }
            let within = if count > lower.1 {
                (rank - lower.1) / (count - lower.1)
            } else {
                1.0
            };
            return Some(lower.0 + (bound - lower.0) * within);
        }
        lower = (bound, count);
    }
    None
}

fn format_ms(seconds: Option<f64>) -> String {
    seconds.map_or("-".to_owned(), |s| format!("{:.2}", s * 1e3))
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let ticks_per_second = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0);
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name (which may hold spaces) start at field 3, the state.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |number: usize| fields.get(number - 3).and_then(|f| f.parse::<f64>().ok());
    match (field(14), field(15)) {
        (Some(user), Some(system)) => (user + system) / ticks_per_second,
        _ => f64::NAN,
    }
}

/// A `kB` line of `/proc/PID/status`.
fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| {
        line.strip_prefix(key)?
            .strip_prefix(':')?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    })
}

fn percentile(latencies: &[Duration], quantile: f64) -> f64 {
    if latencies.is_empty() {
        return f64::NAN;
    }
    let index = ((latencies.len() as f64 - 1.0) * quantile).round() as usize;
    latencies[index].as_secs_f64() * 1e3
}

#[derive(Default)]
struct Load {
    place: Vec<Duration>,
    release: Vec<Duration>,
    placed: usize,
    pending: usize,
    place_failures: usize,
    release_failures: usize,
    first_error: Option<String>,
}

enum Outcome {
    Placed(Duration, bool),
    Released(Duration),
    Failed(&'static str, String),
}

/// Calls in flight at once; beyond it the schedule slips (and the report says so by its rate).
const CALLS_IN_FLIGHT_MAX: usize = 256;

/// Places a tenant every `1/rate` s for `window` (open loop: a slow answer does not delay the
/// next call), three fractional tenants for every whole-GPU one, each on the next member in
/// turn; once `live` tenants exist, each placement also releases the oldest.
async fn placements(
    endpoints: &[String],
    rate: f64,
    window: Duration,
    live: usize,
) -> Result<Load> {
    let mut clients = Vec::new();
    for endpoint in endpoints {
        clients.push(pool_client(endpoint).await?);
    }
    let permits = Arc::new(tokio::sync::Semaphore::new(CALLS_IN_FLIGHT_MAX));
    let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let start = Instant::now();
    let mut sequence: usize = 0;
    while start.elapsed() < window {
        ticker.tick().await;
        let permit = permits.clone().acquire_owned().await?;
        let mut client = clients[sequence % clients.len()].clone();
        let sender = sender.clone();
        let index = sequence;
        sequence += 1;
        tokio::spawn(async move {
            let request = if index % 4 == 3 {
                api::v1::PlacementRequest {
                    whole_gpus: 1 + (index as u32 / 4) % 2,
                    ..Default::default()
                }
            } else {
                fraction(250, 10)
            };
            let begun = Instant::now();
            let placed = client
                .place(api::v1::PlaceRequest {
                    name: format!("s{index}"),
                    request: Some(request),
                })
                .await;
            let outcome = match placed {
                Ok(response) => {
                    let state = response.into_inner().tenant.map_or(0, |t| t.state);
                    Outcome::Placed(
                        begun.elapsed(),
                        state == api::v1::TenantState::Placed as i32,
                    )
                }
                Err(status) => Outcome::Failed("place", status.message().to_owned()),
            };
            let _ = sender.send(outcome);
            if let Some(old) = index.checked_sub(live) {
                let begun = Instant::now();
                let released = client
                    .release(api::v1::ReleaseRequest {
                        name: format!("s{old}"),
                    })
                    .await;
                let outcome = match released {
                    Ok(_) => Outcome::Released(begun.elapsed()),
                    Err(status) => Outcome::Failed("release", status.message().to_owned()),
                };
                let _ = sender.send(outcome);
            }
            drop(permit);
        });
    }
    drop(sender);
    let mut load = Load::default();
    while let Some(outcome) = receiver.recv().await {
        match outcome {
            Outcome::Placed(latency, placed) => {
                load.place.push(latency);
                if placed {
                    load.placed += 1;
                } else {
                    load.pending += 1;
                }
            }
            Outcome::Released(latency) => load.release.push(latency),
            Outcome::Failed(call, message) => {
                if call == "place" {
                    load.place_failures += 1;
                } else {
                    load.release_failures += 1;
                }
                load.first_error.get_or_insert(format!("{call}: {message}"));
            }
        }
    }
    load.place.sort();
    load.release.sort();
    if load.place.is_empty() {
        bail!("no placement succeeded: {:?}", load.first_error);
    }
    Ok(load)
}
