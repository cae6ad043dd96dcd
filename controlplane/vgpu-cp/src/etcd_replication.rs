//! The etcd store (issue 20, `docs/design/etcd-store.md`): this member's replicated state lives
//! in an etcd cluster the operator runs, under one key prefix.
//!
//! - Applying: an `etcd_store::Applier` follows the log and applies every entry to the shared
//!   `PoolState` through `etcd_entry::apply_etcd_entry` (the entry's fence is its
//!   `EntryLeader`), or replaces the state with a snapshot; every member applies the same
//!   entries in the same order.
//! - Writing: the batcher makes one `EtcdEntry` of what queued up, appends it (unfenced; etcd's
//!   transaction cannot fork the log), then waits until its own apply task has applied that
//!   entry, found by `(origin, batch)`, and hands every caller its result. `ControlPlane`
//!   forwards writes to the leader's batcher as on the Raft store; with no leader known a member
//!   appends itself, so a write never waits for an election.
//! - Linearizable reads: a quorum read of the log's head, then wait until applied that far.
//! - Leadership: an election task campaigns in a loop (`etcd_store::Election`) and publishes
//!   what it holds; the leader loop asks `leadership`, and its decisions are appended with
//!   `append_fenced` on that leadership, so a deposed leader's decision writes nothing. The
//!   `leader` key's value is `<id>@<address>`, so followers know where to forward heartbeats.
//! - Snapshots: the leader stores the state every `snapshot_every_entries` entries, which
//!   compacts the log under it.
//! - Members: each member keeps `members/<id>` (its address) on a lease of its own
//!   (`etcd_store::Presence`), so `Cluster.Status` lists who is up; there is no vote to change.

use crate::control_plane::{BatchItem, LocalWrite};
use crate::etcd_entry::{EtcdEntry, apply_etcd_entry};
use crate::pool::{Command, CommandResult};
use crate::raft_types::NodeId;
use crate::replication::{MemberFacts, ReplicationFacts};
use crate::store::Shared;
use api::ErrorCode;
use etcd_store::{Applied, Applier, Election, ElectionConfig, EtcdLog, Fence, Presence};
use openraft::BasicNode;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::Status;

/// How long one campaign waits for the current leader to go before the election task looks
/// again at who leads (followers refresh where to forward at least this often).
const CAMPAIGN_WAIT: Duration = Duration::from_millis(500);
/// How often the election task re-checks a leadership it holds. The leader loop may act on a
/// leadership up to this long after its deadline passed locally: `Election`'s deadline is two
/// thirds of the lease's TTL, so this member still stops acting well before the lease can
/// expire and another member be elected (a third of the TTL, at least 666 ms, against 50 ms).
/// etcd's fence refuses every decision appended after the leadership ended anyway.
const LEADERSHIP_CHECK: Duration = Duration::from_millis(50);
/// Pause after the election failed (etcd unreachable) before campaigning again.
const ELECTION_FAILURE_PAUSE: Duration = Duration::from_millis(200);
/// How often the leader looks whether a snapshot is due.
const SNAPSHOT_CHECK: Duration = Duration::from_secs(1);
/// Longest a resignation may take on shutdown.
const RESIGN_WAIT: Duration = Duration::from_secs(2);

/// The settings of the etcd store for one member.
#[derive(Clone, Debug)]
pub struct EtcdSettings {
    /// The election lease's TTL (whole seconds, at least 2): how long after a leader's death
    /// another member takes over.
    pub lease_ttl: Duration,
    /// Entries between two snapshots (each compacts the log under it).
    pub snapshot_every_entries: u64,
}

/// Who leads, as this member last learned it from etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LeaderView {
    id: NodeId,
    address: String,
    /// The `leader` key's create revision: the leadership's identity (the "term").
    revision: i64,
}

/// What the batcher, the apply task and the election task share.
struct Core {
    id: NodeId,
    /// Where the other members reach this one (what the `leader` key names).
    address: String,
    log: EtcdLog,
    /// The applied state (for how far this member applied).
    shared: Arc<Shared>,
    request_deadline: Duration,
    next_batch: AtomicU64,
    /// This member's appended batches whose results a caller waits for, by batch number.
    waiters: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<CommandResult>>>,
    /// The leadership this member holds, published by the election task.
    leading: watch::Sender<Option<etcd_store::Leadership>>,
    /// Who leads (this member included), published by the election task.
    leader: watch::Sender<Option<LeaderView>>,
    /// Set by a fenced append that found the leadership gone; the election task steps down.
    deposed: AtomicBool,
    /// The members registered under `members/` (id, address), refreshed by the presence task.
    members: watch::Sender<Vec<(NodeId, String)>>,
    /// One append of this member at a time: etcd takes appends one after another anyway, and
    /// the batcher's concurrent batches raced each other for the log's head until one gave up
    /// (`Error::Contended` after 32 tries, at 16 clients in `cluster-bench --store etcd`);
    /// what queues meanwhile goes into the next batch.
    append_turn: tokio::sync::Mutex<()>,
}

/// The etcd store of one member: its apply task, election task, batcher and snapshotter.
pub struct EtcdReplication {
    core: Arc<Core>,
    applier: Arc<Applier>,
    batcher: tokio::sync::mpsc::Sender<BatchItem>,
    /// The batcher and snapshot tasks, aborted on shutdown.
    tasks: Vec<JoinHandle<()>>,
    /// The election and presence tasks: told to stop through `stop`, they resign, leave and
    /// end.
    stoppable: Mutex<Vec<JoinHandle<()>>>,
    stop: watch::Sender<bool>,
}

impl EtcdReplication {
    /// Starts following `log` (claimed for this cluster) into `shared`, campaigning as member
    /// `id` reachable at `address`.
    pub fn start(
        id: NodeId,
        address: &str,
        log: EtcdLog,
        shared: Arc<Shared>,
        settings: &EtcdSettings,
        request_deadline: Duration,
    ) -> EtcdReplication {
        assert!(settings.snapshot_every_entries > 0);
        assert!(!address.is_empty(), "followers forward to this address");
        let core = Arc::new(Core {
            id,
            address: address.to_owned(),
            log: log.clone(),
            shared: shared.clone(),
            request_deadline,
            next_batch: AtomicU64::new(1),
            waiters: Mutex::new(HashMap::new()),
            leading: watch::channel(None).0,
            leader: watch::channel(None).0,
            deposed: AtomicBool::new(false),
            members: watch::channel(Vec::new()).0,
            append_turn: tokio::sync::Mutex::new(()),
        });
        let applier = Arc::new(spawn_applier(Arc::clone(&core), shared.clone()));
        let (batcher, queue) = tokio::sync::mpsc::channel(crate::replication::BATCH_QUEUE_MAX);
        let election = Election::new(
            log.connection().clone(),
            ElectionConfig::new(&format!("{id}@{address}"), settings.lease_ttl),
        );
        let (stop, stopping) = watch::channel(false);
        let presence = Presence::new(log.connection().clone(), id, address, settings.lease_ttl);
        let stoppable = vec![
            tokio::spawn(run_presence(Arc::clone(&core), presence, stopping.clone())),
            tokio::spawn(run_election(Arc::clone(&core), election, stopping)),
        ];
        let tasks = vec![
            tokio::spawn(crate::replication::run_batcher(
                crate::replication::Proposer::Etcd(EtcdProposer {
                    core: Arc::clone(&core),
                }),
                queue,
            )),
            tokio::spawn(run_snapshots(
                Arc::clone(&core),
                shared,
                settings.snapshot_every_entries,
            )),
        ];
        EtcdReplication {
            core,
            applier,
            batcher,
            tasks,
            stoppable: Mutex::new(stoppable),
            stop,
        }
    }

    /// Who leads, as it changes (for the dashboard's list of elections).
    pub(crate) fn leader_changes(&self) -> watch::Receiver<Option<LeaderView>> {
        self.core.leader.subscribe()
    }

    pub(crate) fn batcher(&self) -> &tokio::sync::mpsc::Sender<BatchItem> {
        &self.batcher
    }

    pub fn health(&self) -> Result<(), String> {
        self.applier.health()
    }

    pub fn is_leader(&self) -> bool {
        self.leadership().is_some()
    }

    /// The leadership as `leader::Leadership`: the term is the `leader` key's create revision.
    pub fn leadership(&self) -> Option<crate::leader::Leadership> {
        let leading = (*self.core.leading.borrow())?;
        Some(crate::leader::Leadership {
            term: leading.fence.leader_revision as u64,
            leader: self.core.id,
        })
    }

    pub fn leader_node(&self) -> Option<BasicNode> {
        self.core
            .leader
            .borrow()
            .as_ref()
            .map(|view| BasicNode::new(&view.address))
    }

    pub fn other_leader_node(&self) -> Option<BasicNode> {
        self.core
            .leader
            .borrow()
            .as_ref()
            .filter(|view| view.id != self.core.id)
            .map(|view| BasicNode::new(&view.address))
    }

    /// Every append acknowledged before the call is applied here when this returns.
    pub async fn linearize(&self) -> Result<(), Status> {
        self.applier
            .linearize(self.core.request_deadline)
            .await
            .map(|_| ())
            .map_err(|error| status_of(&error))
    }

    /// Appends one leader decision fenced by `leadership` and returns what applying it gave.
    /// `Ok(Err(None))` when the leadership ended (nothing was written; the new leader decides).
    pub async fn propose_decision(
        &self,
        leadership: crate::leader::Leadership,
        decision: Command,
    ) -> LocalWrite {
        assert!(matches!(decision, Command::LeaderDecision { .. }));
        assert_eq!(leadership.leader, self.core.id);
        let fence = Fence {
            leader_revision: leadership.term as i64,
        };
        match self.core.append(vec![decision], Some(fence)).await {
            Err(etcd_store::Error::Deposed { .. }) => {
                self.core.deposed.store(true, Ordering::SeqCst);
                Ok(Err(None))
            }
            Err(error) => Err(status_of(&error)),
            Ok(mut results) => {
                assert_eq!(results.len(), 1, "one result per command");
                Ok(Ok(results.remove(0)))
            }
        }
    }

    pub fn facts(&self) -> ReplicationFacts {
        let leader = self.core.leader.borrow().clone();
        let applied = self.applier.applied();
        let registered = self.core.members.borrow().clone();
        if !registered.is_empty() {
            return ReplicationFacts {
                leader: leader.as_ref().map_or(0, |view| view.id),
                term: leader.as_ref().map_or(0, |view| view.revision as u64),
                last_log_index: applied,
                last_applied: applied,
                members: registered
                    .into_iter()
                    .map(|(id, address)| MemberFacts {
                        id,
                        address,
                        voter: true,
                        // Only this member's own progress is known here.
                        matched_index: if id == self.core.id { applied } else { 0 },
                    })
                    .collect(),
            };
        }
        // Before the first read of `members/`: this member and the leader.
        let mut members = vec![MemberFacts {
            id: self.core.id,
            address: String::new(),
            voter: true,
            matched_index: applied,
        }];
        if let Some(view) = &leader {
            if view.id == self.core.id {
                members[0].address = view.address.clone();
            } else {
                members.push(MemberFacts {
                    id: view.id,
                    address: view.address.clone(),
                    voter: true,
                    matched_index: 0,
                });
            }
        }
        ReplicationFacts {
            leader: leader.as_ref().map_or(0, |view| view.id),
            term: leader.as_ref().map_or(0, |view| view.revision as u64),
            last_log_index: applied,
            last_applied: applied,
            members,
        }
    }

    /// Stops the tasks and resigns the leadership (bounded), so another member takes over at
    /// once rather than after the lease's TTL.
    pub async fn shutdown(&self) {
        for task in &self.tasks {
            task.abort();
        }
        self.core.leading.send_replace(None);
        self.stop.send_replace(true);
        let stoppable = std::mem::take(&mut *self.stoppable.lock().expect("tasks lock"));
        for task in stoppable {
            if tokio::time::timeout(RESIGN_WAIT * 2, task).await.is_err() {
                tracing::warn!("an etcd task (election, presence) did not end in time");
            }
        }
    }

    /// Waits until the apply task stops for good, and says why.
    pub async fn stopped(&self) -> String {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if let Err(problem) = self.applier.health() {
                return problem;
            }
        }
    }
}

impl Drop for EtcdReplication {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        for task in self.stoppable.lock().expect("tasks lock").iter() {
            task.abort();
        }
    }
}

impl Core {
    /// Appends `commands` as one entry (fenced when `fence` is given) and waits until this
    /// member applied it: one result per command.
    async fn append(
        &self,
        commands: Vec<Command>,
        fence: Option<Fence>,
    ) -> Result<Vec<CommandResult>, etcd_store::Error> {
        let count = commands.len();
        assert!(count > 0);
        let batch = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let entry = EtcdEntry::new(
            self.id,
            batch,
            fence.map(|fence| fence.leader_revision),
            Command::Batch(commands),
        );
        let bytes = entry.encode();
        let (done, applied) = tokio::sync::oneshot::channel();
        // Registered before the append, so the apply task cannot apply it unseen.
        self.waiters
            .lock()
            .expect("waiters lock")
            .insert(batch, done);
        let appended = {
            let _turn = self.append_turn.lock().await;
            match fence {
                Some(fence) => self.log.append_fenced(&[bytes], fence).await,
                None => self.log.append(&[bytes]).await,
            }
        };
        let forget = || {
            self.waiters.lock().expect("waiters lock").remove(&batch);
        };
        let seqs = match appended {
            Ok(seqs) => seqs,
            Err(error) => {
                forget();
                return Err(error);
            }
        };
        let result = match tokio::time::timeout(self.request_deadline, applied).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) | Err(_) => {
                forget();
                return Err(etcd_store::Error::Lagging {
                    applied: *self.shared.applied_index.borrow(),
                    wanted: *seqs.end(),
                    waited: self.request_deadline,
                });
            }
        };
        match result {
            CommandResult::Batch(results) => {
                assert_eq!(results.len(), count, "one result per batched command");
                Ok(results)
            }
            other => panic!("a batch applied as {other:?}"),
        }
    }
}

/// The etcd store's side of the batcher: appends a batch and hands every caller its result.
#[derive(Clone)]
pub(crate) struct EtcdProposer {
    core: Arc<Core>,
}

impl EtcdProposer {
    pub(crate) async fn propose(&self, items: Vec<BatchItem>) {
        let (commands, callers): (Vec<Command>, Vec<_>) = items
            .into_iter()
            .map(|(command, _, caller)| (command, caller))
            .unzip();
        match self.core.append(commands, None).await {
            Ok(results) => {
                for (caller, result) in callers.into_iter().zip(results) {
                    let _ = caller.send(Ok(Ok(result)));
                }
            }
            Err(error) => {
                for caller in callers {
                    let _ = caller.send(Err(status_of(&error)));
                }
            }
        }
    }
}

/// The API status of an etcd failure: what the caller can do about it.
fn status_of(error: &etcd_store::Error) -> Status {
    use etcd_store::Error;
    let code = match error {
        Error::Unavailable { .. } | Error::Contended { .. } | Error::Lagging { .. } => {
            ErrorCode::Unavailable
        }
        Error::Deposed { .. } => ErrorCode::NoLeader,
        Error::TooLarge { .. } => ErrorCode::InvalidArgument,
        _ => ErrorCode::Storage,
    };
    code.status(error.to_string())
}

/// Starts the apply task: entries through `apply_etcd_entry`, snapshots replace the state;
/// the results of this member's own batches go to their waiters.
fn spawn_applier(core: Arc<Core>, shared: Arc<Shared>) -> Applier {
    let log = core.log.clone();
    Applier::spawn(log, 1, move |applied| {
        let mut finished = Vec::new();
        let last = {
            let mut state = shared.applied.write().expect("state lock");
            match applied {
                Applied::Entries(entries) => {
                    for entry in entries {
                        let (decoded, result) = apply_etcd_entry(
                            &mut state.pool,
                            entry.seq,
                            entry.revision,
                            &entry.bytes,
                        )
                        .map_err(|error| error.to_string())?;
                        state.last_applied = Some(etcd_log_id(entry.seq));
                        if decoded.origin == core.id {
                            finished.push((decoded.batch, result));
                        }
                    }
                }
                Applied::Snapshot(snapshot) => {
                    let (seq, pool) = crate::store::decode_pool_snapshot(&snapshot.bytes)
                        .map_err(|error| error.to_string())?;
                    if seq != snapshot.seq {
                        return Err(format!(
                            "the snapshot at {} holds the state at {seq}",
                            snapshot.seq
                        ));
                    }
                    state.pool = pool;
                    state.last_applied = Some(etcd_log_id(seq));
                    tracing::info!(seq, "loaded the pool's snapshot from etcd");
                }
            }
            state.last_applied.map_or(0, |id| id.index)
        };
        shared.applied_index.send_replace(last);
        if !finished.is_empty() {
            let mut waiters = core.waiters.lock().expect("waiters lock");
            for (batch, result) in finished {
                if let Some(waiter) = waiters.remove(&batch) {
                    let _ = waiter.send(result);
                }
            }
        }
        Ok(())
    })
}

/// The etcd log's sequence number as the applied state's log id (no terms on etcd).
fn etcd_log_id(seq: u64) -> crate::raft_types::LogId {
    crate::raft_types::LogId::new(openraft::CommittedLeaderId::new(0, 0), seq)
}

/// Campaigns in a loop; while leading, re-checks the leadership every [`LEADERSHIP_CHECK`] and
/// publishes it; while following, publishes who leads. Resigns when `stop` says so.
async fn run_election(core: Arc<Core>, mut election: Election, mut stop: watch::Receiver<bool>) {
    while !*stop.borrow() {
        let campaign = tokio::select! {
            result = election.campaign(CAMPAIGN_WAIT) => result,
            _ = stop.changed() => break,
        };
        match campaign {
            Ok(Some(leadership)) => {
                core.deposed.store(false, Ordering::SeqCst);
                // Who leads is known without asking etcd: this member, under this leadership.
                core.leader.send_replace(Some(LeaderView {
                    id: core.id,
                    address: core.address.clone(),
                    revision: leadership.fence.leader_revision,
                }));
                core.leading.send_replace(Some(leadership));
                tracing::info!(
                    id = core.id,
                    leader_revision = leadership.fence.leader_revision,
                    "leads the pool on etcd"
                );
                while election.is_leader() == Some(leadership)
                    && !core.deposed.load(Ordering::SeqCst)
                    && !*stop.borrow()
                {
                    tokio::select! {
                        () = tokio::time::sleep(LEADERSHIP_CHECK) => {}
                        _ = stop.changed() => {}
                    }
                }
                core.leading.send_replace(None);
                if core.deposed.swap(false, Ordering::SeqCst) {
                    election.step_down();
                }
                tracing::warn!(id = core.id, "no longer leads the pool on etcd");
            }
            Ok(None) => publish_leader(&core, &election).await,
            Err(error) => {
                core.leading.send_replace(None);
                tracing::warn!(%error, "campaigning on etcd failed; trying again");
                tokio::select! {
                    () = tokio::time::sleep(ELECTION_FAILURE_PAUSE) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }
    core.leading.send_replace(None);
    match tokio::time::timeout(RESIGN_WAIT, election.resign()).await {
        Ok(Ok(())) => tracing::info!(id = core.id, "resigned from the etcd election"),
        Ok(Err(error)) => tracing::warn!(%error, "could not resign the etcd leadership"),
        Err(_) => tracing::warn!("resigning the etcd leadership took too long"),
    }
}

/// Keeps this member registered under `members/` and refreshes the list of registered members,
/// every `Presence::renew_interval`; leaves (revokes its lease) when `stop` says so.
async fn run_presence(core: Arc<Core>, mut presence: Presence, mut stop: watch::Receiver<bool>) {
    while !*stop.borrow() {
        if let Err(error) = presence.renew().await {
            tracing::warn!(%error, "could not renew this member's registration in etcd");
        }
        match Presence::members(core.log.connection()).await {
            Ok(members) => {
                core.members.send_if_modified(|current| {
                    let changed = *current != members;
                    *current = members;
                    changed
                });
            }
            Err(error) => tracing::debug!(%error, "could not list the members in etcd"),
        }
        tokio::select! {
            () = tokio::time::sleep(presence.renew_interval()) => {}
            _ = stop.changed() => {}
        }
    }
    match tokio::time::timeout(RESIGN_WAIT, presence.leave()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "could not remove this member's registration"),
        Err(_) => tracing::warn!("removing this member's registration took too long"),
    }
}

/// Reads who leads from the `leader` key (`<id>@<address>`) and publishes it.
async fn publish_leader(core: &Core, election: &Election) {
    match election.current_leader().await {
        Ok(Some((member, fence))) => match parse_member(&member) {
            Some((id, address)) => {
                let view = LeaderView {
                    id,
                    address,
                    revision: fence.leader_revision,
                };
                core.leader.send_if_modified(|current| {
                    let changed = current.as_ref() != Some(&view);
                    *current = Some(view);
                    changed
                });
            }
            None => tracing::warn!(
                member,
                "the etcd leader key does not name a vgpu-cp member (<id>@<address>)"
            ),
        },
        Ok(None) => {
            core.leader.send_replace(None);
        }
        Err(error) => tracing::debug!(%error, "could not read who leads on etcd"),
    }
}

/// The leadership (its revision, the "term") and the leader's id; zeros without a leader.
pub(crate) fn term_and_leader(view: &Option<LeaderView>) -> (u64, u64) {
    view.as_ref()
        .map_or((0, 0), |view| (view.revision as u64, view.id))
}

/// `<id>@<address>`, the `leader` key's value.
fn parse_member(member: &str) -> Option<(NodeId, String)> {
    let (id, address) = member.split_once('@')?;
    let id = id.parse().ok()?;
    (!address.is_empty()).then(|| (id, address.to_owned()))
}

/// Every [`SNAPSHOT_CHECK`], while this member leads: stores the state when
/// `snapshot_every_entries` entries were applied since the last snapshot it stored.
async fn run_snapshots(core: Arc<Core>, shared: Arc<Shared>, snapshot_every_entries: u64) {
    let mut last_snapshot = 0u64;
    let mut tick = tokio::time::interval(SNAPSHOT_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if core.leading.borrow().is_none() {
            continue;
        }
        let (seq, bytes) = {
            let state = shared.read();
            let seq = state.last_applied.map_or(0, |id| id.index);
            if seq < last_snapshot + snapshot_every_entries {
                continue;
            }
            (seq, crate::store::encode_pool_snapshot(seq, &state.pool))
        };
        match core.log.put_snapshot(seq, &bytes).await {
            Ok(stored) => {
                last_snapshot = seq;
                tracing::info!(
                    seq,
                    bytes = bytes.len(),
                    stored,
                    "snapshotted the pool to etcd"
                );
            }
            Err(error) => tracing::warn!(%error, seq, "could not snapshot the pool to etcd"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_key_names_a_member_and_its_address() {
        assert_eq!(
            parse_member("3@10.0.0.7:7000"),
            Some((3, "10.0.0.7:7000".to_owned()))
        );
        assert_eq!(parse_member("3"), None);
        assert_eq!(parse_member("x@10.0.0.7:7000"), None);
        assert_eq!(parse_member("3@"), None);
    }
}
