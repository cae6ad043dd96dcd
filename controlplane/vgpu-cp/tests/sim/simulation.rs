//! One seeded run: start the cluster, register a simulated GPU node, let clients work while the
//! nemesis partitions, drops, delays and crashes, then heal, wait for every member to converge,
//! and check the history and the final states.

use crate::checker;
use crate::client::{Client, Clock, REQUEST_TIMEOUT};
use crate::cluster::{Cluster, MEMBER_IDS, leader};
use crate::history::{self, Call, History, Operation, Outcome};
use crate::network::{DELAY_MS_MAX, FAIL_RATE_MAX, Router};
use openraft::error::RaftError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use vgpu_cp::pool::{Command, CommandResult};
use vgpu_cp::raft_types::NodeId;

/// Tenant names the clients share: few, so operations on one name overlap often.
const TENANT_NAMES: usize = 4;
const CLIENTS_MIN: u32 = 2;
const CLIENTS_MAX: u32 = 4;
/// How long setup (first election, registering the GPU node) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);
/// Virtual time one run may take in all; only a hang gets near it.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the healed cluster may take to converge.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(20);

#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Virtual time the clients and the nemesis run for.
    pub duration: Duration,
}

/// What a passing run did, for the log.
#[derive(Debug)]
pub struct Summary {
    pub operations: usize,
    pub acknowledged: usize,
    pub unknown: usize,
    pub faults: BTreeMap<&'static str, u32>,
    pub network: crate::network::NetworkStats,
    pub last_applied: u64,
    pub virtual_ms: u128,
    /// Over the history and the final applied log id, to compare two runs of one seed.
    pub fingerprint: u64,
}

/// Runs seed `seed`; the errors say what went wrong (the caller prefixes the seed).
pub async fn run(seed: u64, settings: Settings) -> Result<Summary, Vec<String>> {
    let clock = Clock {
        start: Instant::now(),
    };
    let router = Arc::new(Router::new(seed ^ 0x6e65_7477_6f72_6b00));
    let mut cluster = Cluster::start(router.clone()).await.map_err(|e| vec![e])?;
    let result = exercise(seed, settings, clock, &mut cluster).await;
    cluster.shutdown().await;
    result
}

async fn exercise(
    seed: u64,
    settings: Settings,
    clock: Clock,
    cluster: &mut Cluster,
) -> Result<Summary, Vec<String>> {
    let router = cluster.router.clone();
    register_gpu_node(&router, clock)
        .await
        .map_err(|e| vec![e])?;

    let history = Arc::new(History::default());
    let mut rng = StdRng::seed_from_u64(seed);
    let names: Vec<String> = (0..TENANT_NAMES)
        .map(|index| format!("tenant-{index}"))
        .collect();
    let deadline = Instant::now() + settings.duration;
    let clients: Vec<_> = (0..rng.gen_range(CLIENTS_MIN..=CLIENTS_MAX))
        .map(|id| {
            let client = Client {
                id,
                router: router.clone(),
                history: history.clone(),
                rng: StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(u64::from(id))),
                clock,
                names: names.clone(),
                members: MEMBER_IDS.to_vec(),
            };
            client.run(deadline)
        })
        .collect();
    let mut nemesis = Nemesis {
        rng: StdRng::seed_from_u64(seed ^ 0x6e65_6d65_7369_7300),
        faults: BTreeMap::new(),
    };
    let (nemesis_result, _) = tokio::join!(
        nemesis.run(cluster, deadline),
        futures::future::join_all(clients)
    );
    nemesis_result.map_err(|e| vec![e])?;

    router.heal();
    cluster.restart_all().await.map_err(|e| vec![e])?;
    let last_applied = converge(&router).await.map_err(|e| vec![e])?;

    // The final states, read once every member has applied everything: they join the history as
    // reads after every other operation, so the linearizability check also covers them.
    let members = router.members();
    let mut finals: BTreeMap<u64, BTreeMap<String, u32>> = BTreeMap::new();
    let mut failures = Vec::new();
    for (&id, member) in &members {
        let applied = member.shared.read();
        let tenants = applied
            .pool
            .tenants
            .iter()
            .map(|(name, record)| {
                let milli = vgpu_cp::pool::decode_request(&record.request).milli_gpus;
                (name.clone(), milli)
            })
            .collect();
        finals.insert(id, tenants);
        if let Err(fatal) = &member.raft.metrics().borrow().running_state {
            failures.push(format!("member {id} stopped with a fatal error: {fatal}"));
        }
    }
    failures.extend(cluster.fatal.iter().cloned());
    failures.extend(check_agreement(&members));
    let mut operations = history.operations();
    let now_us = clock.now_us();
    for (&id, tenants) in &finals {
        for name in &names {
            let outcome = tenants
                .get(name)
                .map_or(Outcome::Absent, |&milli| Outcome::Present(milli));
            operations.push(Operation {
                client: u32::MAX,
                name: name.clone(),
                call: Call::Read,
                invoked: history.event(),
                returned: history.event(),
                invoked_us: now_us,
                returned_us: now_us,
                outcome,
                note: format!("final state of member {id}"),
            });
        }
    }
    failures.extend(checker::check_acknowledged_writes(&operations, &finals));
    failures.extend(checker::check_linearizable(&operations));
    if !failures.is_empty() {
        return Err(failures);
    }
    let unknown = operations.iter().filter(|op| !op.is_complete()).count();
    Ok(Summary {
        operations: operations.len(),
        acknowledged: operations
            .iter()
            .filter(|op| op.call != Call::Read && op.is_complete())
            .count(),
        unknown,
        faults: nemesis.faults,
        network: router.stats(),
        last_applied,
        virtual_ms: clock.start.elapsed().as_millis(),
        fingerprint: history::fingerprint(&operations) ^ last_applied,
    })
}

/// Registers the one simulated GPU node: 8 GPUs of 80 GiB.
async fn register_gpu_node(router: &Router, clock: Clock) -> Result<(), String> {
    let gpus = (0..8)
        .map(|index| placement::GpuSpec {
            uuid: format!("GPU-sim-{index}"),
            index,
            model: "H100".to_owned(),
            memory_bytes: 80 << 30,
            sm_count: 132,
            nvlink_peers: BTreeMap::new(),
            numa_node: 0,
            pci_bus_id: format!("0000:{:02x}:00.0", index + 1),
            nearest_nics: Vec::new(),
        })
        .collect();
    let spec = placement::NodeSpec {
        name: "gpu-node-1".to_owned(),
        labels: BTreeMap::new(),
        gpus,
    };
    let command = Command::RegisterNode {
        spec,
        address: "sim-gpu-node-1".to_owned(),
        unix_ms: clock.unix_ms(),
    };
    let deadline = Instant::now() + SETUP_TIMEOUT;
    while Instant::now() < deadline {
        if let Some(member) = leader(router).and_then(|id| router.member(id)) {
            match tokio::time::timeout(REQUEST_TIMEOUT, member.raft.client_write(command.clone()))
                .await
            {
                Ok(Ok(response)) if response.data == CommandResult::Done => return Ok(()),
                Ok(Ok(response)) => {
                    return Err(format!(
                        "registering the GPU node failed: {:?}",
                        response.data
                    ));
                }
                Ok(Err(RaftError::Fatal(fatal))) => {
                    return Err(format!("registering the GPU node: {fatal}"));
                }
                Ok(Err(_)) | Err(_) => {}
            }
        }
        tokio::time::sleep(POLL).await;
    }
    Err(format!(
        "no leader registered the GPU node within {SETUP_TIMEOUT:?}"
    ))
}

/// Waits until one leader is acknowledged by every member and every member has applied its whole
/// log. Returns the last applied index.
async fn converge(router: &Router) -> Result<u64, String> {
    let deadline = Instant::now() + CONVERGE_TIMEOUT;
    loop {
        let members = router.members();
        let metrics: BTreeMap<NodeId, _> = members
            .iter()
            .map(|(&id, member)| (id, member.raft.metrics().borrow().clone()))
            .collect();
        if let Some(leader) = leader(router) {
            let last_log_index = metrics[&leader].last_log_index;
            let converged = metrics.len() == MEMBER_IDS.len()
                && metrics.values().all(|m| {
                    m.current_leader == Some(leader)
                        && m.last_applied.map(|id| id.index) == last_log_index
                });
            if converged {
                return Ok(last_log_index.unwrap_or(0));
            }
        }
        if Instant::now() >= deadline {
            let summary: Vec<String> = metrics
                .iter()
                .map(|(id, m)| {
                    format!(
                        "member {id}: {:?} term {} leader {:?} last log {:?} applied {:?} running {:?}",
                        m.state, m.current_term, m.current_leader, m.last_log_index, m.last_applied, m.running_state
                    )
                })
                .collect();
            return Err(format!(
                "the healed cluster did not converge within {CONVERGE_TIMEOUT:?}: {}",
                summary.join("; ")
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Every member applied the same log to the same pool.
fn check_agreement(members: &BTreeMap<NodeId, crate::network::Member>) -> Vec<String> {
    let mut failures = Vec::new();
    let mut reference: Option<(NodeId, String)> = None;
    for (&id, member) in members {
        let applied = member.shared.read();
        // Debug output of ordered maps: equal states print equally.
        let digest = format!(
            "last applied {:?}\nmembership {:?}\ntenants {:?}\nnodes {:?}\nnode revisions {:?}\ncounters {:?}",
            applied.last_applied,
            applied.membership,
            applied.pool.tenants,
            applied.pool.nodes,
            applied.pool.node_revisions,
            applied.pool.counters
        );
        if !applied.pool.nodes.contains_key("gpu-node-1") {
            failures.push(format!("member {id} lost the registered GPU node"));
        }
        match &reference {
            None => reference = Some((id, digest)),
            Some((first, expected)) if *expected != digest => {
                failures.push(format!(
                    "members {first} and {id} disagree:\n{expected}\n--- versus ---\n{digest}"
                ));
            }
            Some(_) => {}
        }
    }
    failures
}

/// Injects one bounded fault at a time, then heals it.
struct Nemesis {
    rng: StdRng,
    faults: BTreeMap<&'static str, u32>,
}

impl Nemesis {
    async fn hold(&mut self, ms: std::ops::Range<u64>) {
        tokio::time::sleep(Duration::from_millis(self.rng.gen_range(ms))).await;
    }

    fn other_members(id: NodeId) -> Vec<NodeId> {
        MEMBER_IDS
            .iter()
            .copied()
            .filter(|&other| other != id)
            .collect()
    }

    async fn run(&mut self, cluster: &mut Cluster, deadline: Instant) -> Result<(), String> {
        let router = cluster.router.clone();
        while Instant::now() < deadline {
            self.hold(100..600).await;
            // A background delay that lasts through the fault.
            router.set_delay_ms_max(self.rng.gen_range(0..=DELAY_MS_MAX / 3));
            let fault = match self.rng.gen_range(0..8) {
                0 | 7 => {
                    let Some(isolated) = cluster.leader() else {
                        continue;
                    };
                    router.partition(&[isolated], &Self::other_members(isolated));
                    self.hold(200..1500).await;
                    "isolate the leader"
                }
                1 => {
                    let alone = MEMBER_IDS[self.rng.gen_range(0..MEMBER_IDS.len())];
                    router.partition(&[alone], &Self::other_members(alone));
                    self.hold(200..1500).await;
                    "split 1|2"
                }
                2 => {
                    let from = MEMBER_IDS[self.rng.gen_range(0..MEMBER_IDS.len())];
                    let others = Self::other_members(from);
                    router.cut_one_way(from, others[self.rng.gen_range(0..others.len())]);
                    self.hold(200..1500).await;
                    "cut one direction of a link"
                }
                3 => {
                    router.set_fail_rate(self.rng.gen_range(0.05..FAIL_RATE_MAX));
                    self.hold(300..1500).await;
                    "drop messages"
                }
                4 => {
                    router.set_delay_ms_max(self.rng.gen_range(DELAY_MS_MAX / 2..=DELAY_MS_MAX));
                    self.hold(300..1500).await;
                    "long delays"
                }
                5 => {
                    let Some(victim) = cluster.leader() else {
                        continue;
                    };
                    cluster.crash(victim).await;
                    self.hold(50..1500).await;
                    cluster.restart(victim).await?;
                    "crash and restart the leader"
                }
                _ => {
                    let victim = MEMBER_IDS[self.rng.gen_range(0..MEMBER_IDS.len())];
                    cluster.crash(victim).await;
                    self.hold(50..1500).await;
                    cluster.restart(victim).await?;
                    "crash and restart a member"
                }
            };
            router.heal();
            *self.faults.entry(fault).or_default() += 1;
        }
        Ok(())
    }
}
