//! The nemesis test of the compose cluster (`deploy/compose/nemesis.sh` runs it): clients keep
//! placing, releasing and reading tenants through the members' published ports while a nemesis
//! cuts the leader off the network, pauses it, kills members with SIGKILL and restarts every
//! member in turn. Afterwards:
//!
//! - every tenant name's history must be linearizable (the Wing–Gong checker of the
//!   `linearizability` crate, the one the control plane's simulation uses);
//! - every acknowledged placement that no release may have undone must be in every member's final
//!   state (no lost acknowledged write);
//! - no request invoked during the rolling restart may fail for good (clients fail over between
//!   members, as vgpuctl does);
//! - tenants nobody releases keep their placement through every fault, a leader paused during
//!   a churn load included ([`stability`]);
//! - a follower paused after registrations as large as admission allows catches up
//!   ([`registrations`]).
//!
//! The history is written to `history.jsonl` (one [`linearizability::Operation`] per line) and
//! the outcome to `summary.txt` in the output directory; `--check FILE` checks a kept history
//! again.

pub mod client;
pub mod docker;
pub mod phase;
pub mod registrations;
pub mod stability;

use anyhow::{Context, Result, bail};
use api::v1::ListRequest;
use api::v1::cluster_client::ClusterClient;
use api::v1::pool_client::PoolClient;
use client::{Client, Endpoint, Request};
use docker::Project;
use linearizability::{Call, History, Operation, Outcome};
use phase::{Phase, PhaseClock};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the cluster may take to have one leader that every member agrees on.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(90);
/// How long one status probe of a member may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Tasks of the churn load while the leader is paused (`Phase::ChurnPause`).
const CHURN_TASKS: usize = 4;

/// Settings of one run.
#[derive(Clone, Debug)]
pub struct Config {
    pub project: Project,
    /// The members, in compose service order (`cp1`, `cp2`, `cp3`) with published addresses.
    pub endpoints: Vec<Endpoint>,
    pub clients: u32,
    /// Tenant names clients use (`nemesis-00`, ...). More names: a smaller search per name.
    pub names: usize,
    /// How long each fault lasts.
    pub fault_duration: Duration,
    /// How long the cluster runs without faults between two of them.
    pub quiet_duration: Duration,
    pub seed: u64,
    pub out_dir: PathBuf,
    /// Add a made-up stale read to the history before checking it: the run must then fail. A
    /// self-test of the runner.
    pub doctor_stale_read: bool,
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Report {
    pub violations: Vec<String>,
    pub summary: String,
}

/// A fault the nemesis injected, for the summary.
struct Fault {
    at_s: f64,
    healed_s: f64,
    what: String,
}

/// Runs the clients and the nemesis against a started compose cluster, then checks the history.
pub async fn run(config: Config) -> Result<Report> {
    assert!(config.clients > 0 && config.names > 0, "clients and names");
    std::fs::create_dir_all(&config.out_dir)
        .with_context(|| format!("creating {}", config.out_dir.display()))?;
    let started = Instant::now();
    let clock = PhaseClock::default();
    let history = Arc::new(History::default());
    let names: Vec<String> = (0..config.names)
        .map(|index| format!("nemesis-{index:02}"))
        .collect();

    tracing::info!(endpoints = ?config.endpoints, "waiting for one leader on every member");
    wait_healthy(&config.endpoints).await?;
    let stable = stability::place(&config.endpoints).await?;
    tracing::info!(
        tenants = stable.len(),
        "placed the tenants that must not move"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for id in 0..config.clients {
        let client = Client::new(
            id,
            config.seed,
            config.endpoints.clone(),
            names.clone(),
            history.clone(),
            clock.clone(),
        );
        tasks.push(tokio::spawn(client.run(stop.clone())));
    }

    let mut unstable = Vec::new();
    let nemesis = nemesis(&config, &clock, &stable, &mut unstable).await;
    clock.set_phase(Phase::Quiet);
    stop.store(true, Ordering::Relaxed);
    let mut requests: Vec<Request> = Vec::new();
    for task in tasks {
        requests.extend(task.await.context("a client task panicked")?);
    }
    let faults = nemesis?;
    let clients_done_s = clock.elapsed_s();

    tracing::info!("reading every member's final state");
    wait_healthy(&config.endpoints).await?;
    let finals = final_reads(&config.endpoints, &names, &history, &clock).await?;
    unstable.extend(stability::check(&config.endpoints, &stable, "at the end").await?);

    let mut operations = history.operations();
    if config.doctor_stale_read {
        let doctored = doctor_stale_read(&operations, &history, &clock)
            .context("no placed-then-released tenant to doctor a stale read from")?;
        tracing::warn!(
            ?doctored,
            "added a doctored stale read (--doctor-stale-read)"
        );
        operations.push(doctored);
    }
    write_history(&config.out_dir.join("history.jsonl"), &operations)?;

    let check_started = Instant::now();
    let mut violations = check(&operations, &finals);
    let check_s = check_started.elapsed().as_secs_f64();
    let rolling_failures: Vec<&Request> = requests
        .iter()
        .filter(|request| request.phase == Phase::RollingRestart && request.answered.is_none())
        .collect();
    let stable_held = unstable.is_empty();
    violations.append(&mut unstable);
    for request in &rolling_failures {
        violations.push(format!(
            "client {} request `{}` invoked during the rolling restart failed for good after {} attempts in {:?}",
            request.client, request.description, request.attempts, request.elapsed
        ));
    }
    let summary = summarize(&Summary {
        config: &config,
        operations: &operations,
        requests: &requests,
        faults: &faults,
        duration_s: started.elapsed().as_secs_f64(),
        clients_done_s,
        check_s,
        violations: violations.len(),
        stable: stable.len(),
        stable_held,
    });
    std::fs::write(config.out_dir.join("summary.txt"), &summary)?;
    Ok(Report {
        violations,
        summary,
    })
}

/// Checks a history: linearizability per name and no lost acknowledged write.
pub fn check(
    operations: &[Operation],
    finals: &BTreeMap<u64, BTreeMap<String, u32>>,
) -> Vec<String> {
    let mut violations = linearizability::check_linearizable(operations);
    violations.extend(linearizability::check_acknowledged_writes(
        operations, finals,
    ));
    violations
}

/// The fault schedule: each fault lasts `fault_duration`, then the cluster gets
/// `quiet_duration` without faults and must have one leader again before the next.
/// After each, the stable tenants must be where they were (`unstable` collects who moved).
async fn nemesis(
    config: &Config,
    clock: &PhaseClock,
    stable: &BTreeMap<String, stability::Placement>,
    unstable: &mut Vec<String>,
) -> Result<Vec<Fault>> {
    let project = &config.project;
    let hold = config.fault_duration;
    let quiet = config.quiet_duration;
    let mut faults = Vec::new();
    let mut record = |at_s: f64, what: String| {
        tracing::info!(at_s, %what, "fault healed");
        faults.push(Fault {
            at_s,
            healed_s: clock.elapsed_s(),
            what,
        });
    };
    tokio::time::sleep(quiet).await;

    clock.set_phase(Phase::Partition);
    let leader = leader_service(&config.endpoints).await?;
    let at = clock.elapsed_s();
    tracing::info!(%leader, "cutting the leader off the network");
    project.disconnect(&leader).await?;
    let elected = wait_other_leader(&config.endpoints, &leader, hold).await?;
    project.connect(&leader).await?;
    record(
        at,
        format!("network disconnect of the leader {leader} ({elected})"),
    );
    settle(config, clock).await?;
    let when = "after the partition of the leader healed";
    unstable.extend(stability::check(&config.endpoints, stable, when).await?);

    clock.set_phase(Phase::Pause);
    let leader = leader_service(&config.endpoints).await?;
    let at = clock.elapsed_s();
    tracing::info!(%leader, "pausing the leader");
    project.act("pause", &[], &leader).await?;
    let elected = wait_other_leader(&config.endpoints, &leader, hold).await?;
    project.act("unpause", &[], &leader).await?;
    record(
        at,
        format!("docker pause of the leader {leader} ({elected})"),
    );
    settle(config, clock).await?;
    let when = "after the leader's pause";
    unstable.extend(stability::check(&config.endpoints, stable, when).await?);

    // Churn while the leader is paused: a load of places and releases before, during and after
    // the pause (issue 22: churn made nodes lost; a paused leader evicted every tenant).
    clock.set_phase(Phase::ChurnPause);
    let stop_churn = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let churners: Vec<_> = (0..CHURN_TASKS)
        .map(|_| {
            tokio::spawn(stability::churn(
                config.endpoints.clone(),
                stop_churn.clone(),
                answered.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(hold / 2).await;
    let leader = leader_service(&config.endpoints).await?;
    let at = clock.elapsed_s();
    tracing::info!(%leader, "pausing the leader during churn");
    project.act("pause", &[], &leader).await?;
    let elected = wait_other_leader(&config.endpoints, &leader, hold).await;
    project.act("unpause", &[], &leader).await?;
    let elected = elected?;
    tokio::time::sleep(hold / 2).await;
    stop_churn.store(true, Ordering::Relaxed);
    for churner in churners {
        churner.await.context("a churn task panicked")?;
    }
    record(
        at,
        format!(
            "docker pause of the leader {leader} during churn ({elected}; {} churn calls answered)",
            answered.load(Ordering::Relaxed)
        ),
    );
    settle(config, clock).await?;
    let when = "after the leader's pause during churn";
    unstable.extend(stability::check(&config.endpoints, stable, when).await?);

    // A follower paused while registrations as large as admission allows go into the log: once
    // awake it must catch up on them and serve a linearizable read (issue 22, point 1: a
    // follower behind such a batch never caught up).
    clock.set_phase(Phase::BulkRegistration);
    let leader = leader_service(&config.endpoints).await?;
    let follower = config
        .endpoints
        .iter()
        .find(|endpoint| endpoint.service != leader)
        .expect("three members")
        .clone();
    let others: Vec<Endpoint> = config
        .endpoints
        .iter()
        .filter(|endpoint| endpoint.service != follower.service)
        .cloned()
        .collect();
    let at = clock.elapsed_s();
    tracing::info!(follower = %follower.service, "pausing a follower, then registering the bulk nodes");
    project.act("pause", &[], &follower.service).await?;
    let paused = Instant::now();
    let registered = registrations::register(&others).await;
    tokio::time::sleep(hold.saturating_sub(paused.elapsed())).await;
    project.act("unpause", &[], &follower.service).await?;
    let bytes = registered?;
    let unpaused = Instant::now();
    wait_healthy(&config.endpoints).await?;
    wait_caught_up(&follower).await?;
    let caught_up_s = unpaused.elapsed().as_secs_f64();
    registrations::remove(&config.endpoints).await?;
    record(
        at,
        format!(
            "docker pause of the follower {2} while {0} registrations of {1:.1} MiB in all were committed (it served a linearizable read {caught_up_s:.1} s after it woke; nodes removed)",
            registrations::BULK_NODES,
            bytes as f64 / f64::from(1u32 << 20),
            follower.service
        ),
    );
    settle(config, clock).await?;
    let when = "after the bulk registrations and the follower's pause";
    unstable.extend(stability::check(&config.endpoints, stable, when).await?);

    for role in ["follower", "leader"] {
        clock.set_phase(Phase::Kill);
        let leader = leader_service(&config.endpoints).await?;
        let victim = if role == "leader" {
            leader
        } else {
            config
                .endpoints
                .iter()
                .map(|endpoint| endpoint.service.clone())
                .find(|service| *service != leader)
                .expect("three members")
        };
        let at = clock.elapsed_s();
        tracing::info!(%victim, role, "kill -9");
        project.act("kill", &["-s", "KILL"], &victim).await?;
        tokio::time::sleep(hold / 2).await;
        project.act("start", &[], &victim).await?;
        record(at, format!("kill -9 of the {role} {victim}, started again"));
        settle(config, clock).await?;
        let when = format!("after the kill of the {role}");
        unstable.extend(stability::check(&config.endpoints, stable, &when).await?);
    }

    clock.set_phase(Phase::RollingRestart);
    let at = clock.elapsed_s();
    for endpoint in &config.endpoints {
        tracing::info!(service = %endpoint.service, "rolling restart");
        let stop_timeout = docker::STOP_TIMEOUT_S.to_string();
        project
            .act("restart", &["-t", &stop_timeout], &endpoint.service)
            .await?;
        // The next member goes only once this one is back in the cluster and has caught up.
        wait_healthy(&config.endpoints).await?;
        wait_caught_up(endpoint).await?;
    }
    record(at, "rolling restart of every member".to_owned());
    clock.set_phase(Phase::Quiet);
    tokio::time::sleep(quiet).await;
    Ok(faults)
}

/// After a fault: one leader again, then `quiet_duration` without faults.
async fn settle(config: &Config, clock: &PhaseClock) -> Result<()> {
    wait_healthy(&config.endpoints).await?;
    clock.set_phase(Phase::Quiet);
    tokio::time::sleep(config.quiet_duration).await;
    Ok(())
}

/// One member's `Cluster.Status` through its published port.
async fn status(endpoint: &Endpoint) -> Result<api::v1::ClusterStatus> {
    let channel = endpoint
        .transport
        .endpoint(&endpoint.address)?
        .connect_timeout(PROBE_TIMEOUT)
        .timeout(PROBE_TIMEOUT)
        .connect()
        .await?;
    let status = ClusterClient::new(channel)
        .status(api::v1::ClusterStatusRequest {})
        .await?;
    Ok(status.into_inner())
}

/// Waits until every member answers and all name the same leader, a voter of three.
pub async fn wait_healthy(endpoints: &[Endpoint]) -> Result<()> {
    let deadline = Instant::now() + HEALTHY_TIMEOUT;
    let mut last = String::new();
    loop {
        let mut leaders = Vec::new();
        for endpoint in endpoints {
            match status(endpoint).await {
                Ok(status) => {
                    let voters = status.members.iter().filter(|m| m.voter).count();
                    if voters == endpoints.len() && status.leader != 0 {
                        leaders.push(status.leader);
                    } else {
                        last = format!(
                            "{} sees leader {} and {voters} voters",
                            endpoint.service, status.leader
                        );
                    }
                }
                Err(error) => last = format!("{}: {error:#}", endpoint.service),
            }
        }
        if leaders.len() == endpoints.len() && leaders.iter().all(|id| *id == leaders[0]) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "the cluster did not agree on a leader within {HEALTHY_TIMEOUT:?} (leaders seen {leaders:?}; last: {last})"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// While `old` is cut off or frozen: waits until the other members elect another leader (the
/// fault took effect; a nemesis whose faults do nothing would pass every run), then for the rest
/// of `hold`. Says who was elected and when.
async fn wait_other_leader(endpoints: &[Endpoint], old: &str, hold: Duration) -> Result<String> {
    let started = Instant::now();
    let deadline = started + hold.max(HEALTHY_TIMEOUT / 3);
    let others: Vec<Endpoint> = endpoints
        .iter()
        .filter(|endpoint| endpoint.service != old)
        .cloned()
        .collect();
    loop {
        if let Ok(leader) = leader_service(&others).await
            && leader != old
        {
            let elected = format!(
                "{leader} elected after {:.1} s",
                started.elapsed().as_secs_f64()
            );
            tokio::time::sleep(hold.saturating_sub(started.elapsed())).await;
            return Ok(elected);
        }
        if Instant::now() >= deadline {
            bail!(
                "the members other than {old} elected no other leader within {:?}: the fault did not take effect",
                deadline - started
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `endpoint` serves a linearizable read: it reached the leader and applied
/// everything committed before the read. A restarted member names its old leader at once (from
/// its persisted vote), so agreeing on a leader alone does not show it is back.
async fn wait_caught_up(endpoint: &Endpoint) -> Result<()> {
    let deadline = Instant::now() + HEALTHY_TIMEOUT;
    loop {
        let read = async {
            let channel = endpoint
                .transport
                .endpoint(&endpoint.address)?
                .connect_timeout(PROBE_TIMEOUT)
                .timeout(client::ATTEMPT_TIMEOUT)
                .connect()
                .await?;
            PoolClient::new(channel)
                .list_tenants(ListRequest { stale: false })
                .await?;
            anyhow::Ok(())
        };
        match read.await {
            Ok(()) => return Ok(()),
            Err(error) if Instant::now() >= deadline => bail!(
                "{} did not serve a linearizable read within {HEALTHY_TIMEOUT:?}: {error:#}",
                endpoint.service
            ),
            Err(error) => {
                tracing::debug!(service = %endpoint.service, error = %format!("{error:#}"), "not caught up yet");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// The compose service of the current leader (from the address it advertises, `cp2:7401`).
async fn leader_service(endpoints: &[Endpoint]) -> Result<String> {
    for endpoint in endpoints {
        let Ok(status) = status(endpoint).await else {
            continue;
        };
        let Some(leader) = status.members.iter().find(|m| m.id == status.leader) else {
            continue;
        };
        let host = leader.address.split(':').next().unwrap_or_default();
        if let Some(service) = endpoints.iter().find(|e| e.service == host) {
            return Ok(service.service.clone());
        }
        bail!(
            "the leader advertises {}, which is no compose service of {:?}",
            leader.address,
            endpoints.iter().map(|e| &e.service).collect::<Vec<_>>()
        );
    }
    bail!("no member knows a leader")
}

/// Reads every member's final state (a linearizable list at each member, so each has applied
/// everything acknowledged before), records the reads in the history and returns the states by
/// member (1, 2, 3 in endpoint order): name -> milli-GPUs.
async fn final_reads(
    endpoints: &[Endpoint],
    names: &[String],
    history: &History,
    clock: &PhaseClock,
) -> Result<BTreeMap<u64, BTreeMap<String, u32>>> {
    let mut finals = BTreeMap::new();
    for (index, endpoint) in endpoints.iter().enumerate() {
        let channel = endpoint
            .transport
            .endpoint(&endpoint.address)?
            .connect_timeout(PROBE_TIMEOUT)
            .timeout(client::ATTEMPT_TIMEOUT)
            .connect_lazy();
        let mut pool = PoolClient::new(channel);
        let deadline = Instant::now() + client::REQUEST_DEADLINE;
        let (tenants, invoked, invoked_us) = loop {
            let invoked = history.event();
            let invoked_us = clock.now_us();
            match pool.list_tenants(ListRequest { stale: false }).await {
                Ok(list) => break (list.into_inner().tenants, invoked, invoked_us),
                Err(status) if Instant::now() < deadline => {
                    tracing::debug!(service = %endpoint.service, %status, "final read failed; again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(status) => bail!(
                    "the final read at {} failed: {status}; see its docker logs",
                    endpoint.service
                ),
            }
        };
        let returned = history.event();
        let returned_us = clock.now_us();
        let state: BTreeMap<String, u32> = tenants
            .into_iter()
            .filter(|tenant| names.contains(&tenant.name))
            .map(|tenant| {
                let milli = tenant.request.map_or(0, |request| request.milli_gpus);
                (tenant.name, milli)
            })
            .collect();
        for name in names {
            let outcome = match state.get(name) {
                Some(milli) => Outcome::Present(*milli),
                None => Outcome::Absent,
            };
            history.record(Operation {
                client: u32::MAX,
                name: name.clone(),
                call: Call::Read,
                invoked,
                returned,
                invoked_us,
                returned_us,
                outcome,
                note: format!("final read at {}", endpoint.service),
            });
        }
        finals.insert(index as u64 + 1, state);
    }
    Ok(finals)
}

/// A read, after everything else, that sees a placement some release already undid: a stale
/// read no correct cluster could give. Picks a name and request that ended released and that no
/// placement with an unknown outcome could bring back.
pub fn doctor_stale_read(
    operations: &[Operation],
    history: &History,
    clock: &PhaseClock,
) -> Option<Operation> {
    let by_name = linearizability::by_name(operations);
    for (name, operations) in &by_name {
        let last_final = operations
            .iter()
            .rfind(|op| op.note.starts_with("final read"));
        if last_final.is_none_or(|read| read.outcome != Outcome::Absent) {
            continue;
        }
        for placed in operations.iter().filter(|op| op.outcome == Outcome::Placed) {
            let Call::Place(milli) = placed.call else {
                continue;
            };
            let may_come_back = operations
                .iter()
                .any(|op| op.call == Call::Place(milli) && op.outcome == Outcome::Unknown);
            if may_come_back {
                continue;
            }
            let invoked = history.event();
            let returned = history.event();
            return Some(Operation {
                client: u32::MAX - 1,
                name: name.clone(),
                call: Call::Read,
                invoked,
                returned,
                invoked_us: clock.now_us(),
                returned_us: clock.now_us(),
                outcome: Outcome::Present(milli),
                note: "doctored stale read (--doctor-stale-read)".to_owned(),
            });
        }
    }
    None
}

fn write_history(path: &Path, operations: &[Operation]) -> Result<()> {
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for operation in operations {
        serde_json::to_writer(&mut file, operation)?;
        file.write_all(b"\n")?;
    }
    file.flush()?;
    Ok(())
}

/// Reads a `history.jsonl` written by a run.
pub fn read_history(path: &Path) -> Result<Vec<Operation>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not an operation", path.display(), number + 1))
        })
        .collect()
}

/// The final states recorded in a history (its final reads), by member, for `--check`.
pub fn finals_of(operations: &[Operation]) -> BTreeMap<u64, BTreeMap<String, u32>> {
    let mut finals: BTreeMap<u64, BTreeMap<String, u32>> = BTreeMap::new();
    for operation in operations {
        let Some(service) = operation.note.strip_prefix("final read at ") else {
            continue;
        };
        let member = service
            .trim_start_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .unwrap_or(0);
        let state = finals.entry(member).or_default();
        if let Outcome::Present(milli) = operation.outcome {
            state.insert(operation.name.clone(), milli);
        }
    }
    finals
}

struct Summary<'a> {
    config: &'a Config,
    operations: &'a [Operation],
    requests: &'a [Request],
    faults: &'a [Fault],
    duration_s: f64,
    clients_done_s: f64,
    check_s: f64,
    violations: usize,
    /// Tenants that must not move, and whether every one kept its placement.
    stable: usize,
    stable_held: bool,
}

fn summarize(summary: &Summary) -> String {
    let mut text = String::new();
    let config = summary.config;
    let _ = writeln!(
        text,
        "nemesis run: project {}, {} clients, {} tenant names, seed {}, {:.0} s in all ({:.0} s of client load, checked in {:.2} s)",
        config.project.name,
        config.clients,
        config.names,
        config.seed,
        summary.duration_s,
        summary.clients_done_s,
        summary.check_s
    );
    let _ = writeln!(text, "faults:");
    for fault in summary.faults {
        let _ = writeln!(
            text,
            "  {:>6.1} s .. {:>6.1} s  {}",
            fault.at_s, fault.healed_s, fault.what
        );
    }
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for operation in summary.operations {
        let call = match operation.call {
            Call::Place(_) => "place",
            Call::Release => "release",
            Call::Read => "read",
        };
        let outcome = match operation.outcome {
            Outcome::Present(_) => "Present".to_owned(),
            other => format!("{other:?}"),
        };
        *outcomes.entry(format!("{call} {outcome}")).or_default() += 1;
    }
    let _ = writeln!(
        text,
        "operations recorded (attempts that may have reached the cluster): {}",
        summary.operations.len()
    );
    for (what, count) in &outcomes {
        let _ = writeln!(text, "  {what:<20} {count}");
    }
    let mut phases: BTreeMap<Phase, (usize, usize, Duration, u32)> = BTreeMap::new();
    for request in summary.requests {
        let entry = phases.entry(request.phase).or_default();
        entry.0 += 1;
        if request.answered.is_none() {
            entry.1 += 1;
        }
        entry.2 = entry.2.max(request.elapsed);
        entry.3 = entry.3.max(request.attempts);
    }
    let _ = writeln!(
        text,
        "client requests by phase (invoked during): total, failed for good, slowest, most attempts"
    );
    for (phase, (total, failed, slowest, attempts)) in &phases {
        let _ = writeln!(
            text,
            "  {:<16} {total:>6} {failed:>4} {:>8.2} s {attempts:>3}",
            format!("{phase:?}"),
            slowest.as_secs_f64()
        );
    }
    let _ = writeln!(
        text,
        "placement stability: {} tenants nobody releases {} their placement after every fault",
        summary.stable,
        if summary.stable_held {
            "kept"
        } else {
            "did NOT keep"
        }
    );
    let verdict = if summary.violations == 0 {
        "PASS: linearizable, no acknowledged write lost, no request failed for good during the rolling restart, no stable tenant moved".to_owned()
    } else {
        format!("FAIL: {} violations", summary.violations)
    };
    let _ = writeln!(text, "{verdict}");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(history: &History, name: &str, call: Call, outcome: Outcome, note: &str) -> Operation {
        let invoked = history.event();
        let returned = if outcome == Outcome::Unknown {
            u64::MAX
        } else {
            history.event()
        };
        Operation {
            client: 0,
            name: name.to_owned(),
            call,
            invoked,
            returned,
            invoked_us: invoked,
            returned_us: returned,
            outcome,
            note: note.to_owned(),
        }
    }

    /// A clean run's history passes; the same history with the doctored stale read fails, and
    /// the violation names the read.
    #[test]
    fn a_doctored_stale_read_fails_the_check() {
        let history = History::default();
        let clock = PhaseClock::default();
        let mut operations = vec![
            op(&history, "a", Call::Place(200), Outcome::Placed, ""),
            op(&history, "b", Call::Place(300), Outcome::Placed, ""),
            op(&history, "a", Call::Release, Outcome::Released, ""),
            op(
                &history,
                "a",
                Call::Read,
                Outcome::Absent,
                "final read at cp1",
            ),
            op(
                &history,
                "b",
                Call::Read,
                Outcome::Present(300),
                "final read at cp1",
            ),
            op(
                &history,
                "a",
                Call::Read,
                Outcome::Absent,
                "final read at cp2",
            ),
            op(
                &history,
                "b",
                Call::Read,
                Outcome::Present(300),
                "final read at cp2",
            ),
        ];
        let finals = finals_of(&operations);
        assert_eq!(finals.len(), 2);
        assert_eq!(finals[&1], BTreeMap::from([("b".to_owned(), 300)]));
        assert_eq!(check(&operations, &finals), Vec::<String>::new());

        let doctored = doctor_stale_read(&operations, &history, &clock).expect("a is released");
        assert_eq!(doctored.name, "a");
        assert_eq!(doctored.outcome, Outcome::Present(200));
        operations.push(doctored);
        let violations = check(&operations, &finals);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("tenant `a`"), "{violations:?}");
        assert!(violations[0].contains("doctored"), "{violations:?}");
    }

    /// A placement whose outcome is unknown may still take effect, so the doctor does not pick
    /// a request that could legitimately come back.
    #[test]
    fn the_doctor_avoids_requests_that_may_come_back() {
        let history = History::default();
        let clock = PhaseClock::default();
        let operations = vec![
            op(&history, "a", Call::Place(200), Outcome::Placed, ""),
            op(&history, "a", Call::Release, Outcome::Released, ""),
            op(&history, "a", Call::Place(200), Outcome::Unknown, ""),
            op(
                &history,
                "a",
                Call::Read,
                Outcome::Absent,
                "final read at cp1",
            ),
        ];
        assert!(doctor_stale_read(&operations, &history, &clock).is_none());
    }

    /// A lost acknowledged write fails the check even when each read alone looks fine.
    #[test]
    fn a_member_missing_an_acknowledged_placement_fails_the_check() {
        let history = History::default();
        let operations = vec![
            op(&history, "a", Call::Place(200), Outcome::Placed, ""),
            op(
                &history,
                "a",
                Call::Read,
                Outcome::Present(200),
                "final read at cp1",
            ),
        ];
        let mut finals = finals_of(&operations);
        finals.insert(3, BTreeMap::new());
        let violations = check(&operations, &finals);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("member 3"), "{violations:?}");
    }

    #[test]
    fn a_history_round_trips_through_its_file() {
        let history = History::default();
        let operations = vec![
            op(
                &history,
                "a",
                Call::Place(200),
                Outcome::Placed,
                "cp1 answered",
            ),
            op(
                &history,
                "a",
                Call::Release,
                Outcome::Unknown,
                "cp2: no answer",
            ),
        ];
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("history.jsonl");
        write_history(&path, &operations).expect("written");
        assert_eq!(read_history(&path).expect("read"), operations);
    }
}
