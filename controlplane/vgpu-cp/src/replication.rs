//! How a member's writes reach the replicated log, and what it knows of the leadership: the one
//! place that knows which store holds the pool's state.
//!
//! `Replication` is a closed enum rather than a trait object: two stores, async methods, no
//! boxing (the reason the style prefers `enum Event`s). `ControlPlane` asks it to write (through
//! the batcher), to make a read linearizable, who leads, and to change the membership; every path
//! above it (forwarding to the leader, the leader loop, the API) is the same on either store.
//!
//! - `Raft`: openraft with the redb log (`crate::store`); the batcher proposes with
//!   `client_write`, and a member that does not lead answers with the leader to forward to.
//! - `Etcd`: the log, snapshots and election in an etcd cluster (`crate::etcd_replication`);
//!   any member may append, so a member that knows no leader writes itself.

use crate::control_plane::{BatchItem, LocalWrite};
use crate::pool::{Command, CommandResult};
use crate::raft_types::{NodeId, Raft};
use api::ErrorCode;
use openraft::BasicNode;
use openraft::error::{ClientWriteError, ForwardToLeader, RaftError};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Status;

/// Batches proposed to the log at the same time.
pub(crate) const BATCHES_IN_FLIGHT_MAX: usize = 4;
/// Writes waiting for the batcher before callers wait for room.
pub(crate) const BATCH_QUEUE_MAX: usize = 8192;

/// Where this member's replicated state lives.
pub enum Replication {
    /// The built-in store: openraft over the members' own redb logs.
    Raft(RaftReplication),
    /// An etcd cluster the operator runs (issue 20).
    Etcd(crate::etcd_replication::EtcdReplication),
}

/// What the cluster status and `/metrics` show of the replication, on either store.
#[derive(Clone, Debug, Default)]
pub struct ReplicationFacts {
    /// The leader's id; 0 when none is known.
    pub leader: u64,
    /// Raft's term (on etcd: the leadership's revision).
    pub term: u64,
    pub last_log_index: u64,
    pub last_applied: u64,
    pub members: Vec<MemberFacts>,
}

/// One member as the cluster status shows it.
#[derive(Clone, Debug)]
pub struct MemberFacts {
    pub id: u64,
    pub address: String,
    pub voter: bool,
    pub matched_index: u64,
}

impl Replication {
    /// Whether this member can serve: `Err` once its core stopped, with what happened and what
    /// to do.
    pub fn health(&self) -> Result<(), String> {
        match self {
            Replication::Raft(raft) => raft.health(),
            Replication::Etcd(etcd) => etcd.health(),
        }
    }

    pub fn is_leader(&self) -> bool {
        match self {
            Replication::Raft(raft) => raft.is_leader(),
            Replication::Etcd(etcd) => etcd.is_leader(),
        }
    }

    /// The leadership this member holds now (`None`: it does not lead).
    pub fn leadership(&self) -> Option<crate::leader::Leadership> {
        match self {
            Replication::Raft(raft) => raft.leadership(),
            Replication::Etcd(etcd) => etcd.leadership(),
        }
    }

    /// The leader's node when it is known and is not this member.
    pub fn other_leader_node(&self) -> Option<BasicNode> {
        match self {
            Replication::Raft(raft) => raft.other_leader_node(),
            Replication::Etcd(etcd) => etcd.other_leader_node(),
        }
    }

    /// The leader's node, where what only the leader keeps (heartbeats) is forwarded.
    pub fn leader_node(&self) -> Option<BasicNode> {
        match self {
            Replication::Raft(raft) => raft.leader_node(),
            Replication::Etcd(etcd) => etcd.leader_node(),
        }
    }

    /// Queues a write for this member's batcher and waits for its result (or the leader to
    /// forward to). `size` is the command's encoded size (`control_plane::command_size`).
    pub async fn submit(&self, command: Command, size: usize) -> LocalWrite {
        let batcher = match self {
            Replication::Raft(raft) => &raft.batcher,
            Replication::Etcd(etcd) => etcd.batcher(),
        };
        let (done, wait) = tokio::sync::oneshot::channel();
        batcher
            .send((command, size, done))
            .await
            .map_err(|_| ErrorCode::Internal.status("the write batcher stopped"))?;
        wait.await
            .map_err(|_| ErrorCode::Internal.status("the write batcher dropped a write"))?
    }

    /// `Ok(false)`: this member does not lead.
    pub async fn add_member_local(
        &self,
        id: NodeId,
        address: String,
        request_deadline: Duration,
    ) -> Result<bool, Status> {
        match self {
            Replication::Raft(raft) => raft.add_member_local(id, address, request_deadline).await,
            Replication::Etcd(_) => Err(etcd_membership()),
        }
    }

    /// `Ok(false)`: this member does not lead.
    pub async fn remove_member_local(
        &self,
        id: NodeId,
        request_deadline: Duration,
    ) -> Result<bool, Status> {
        match self {
            Replication::Raft(raft) => raft.remove_member_local(id, request_deadline).await,
            Replication::Etcd(_) => Err(etcd_membership()),
        }
    }

    /// The leader, term, log positions and members, for `vgpuctl cluster status`, the dashboard
    /// and `/metrics`.
    pub fn facts(&self) -> ReplicationFacts {
        match self {
            Replication::Raft(raft) => raft.facts(),
            Replication::Etcd(etcd) => etcd.facts(),
        }
    }

    /// The Raft handle, on the Raft store only (its peer RPCs, its metrics).
    pub fn raft(&self) -> Option<&Raft> {
        match self {
            Replication::Raft(raft) => Some(&raft.raft),
            Replication::Etcd(_) => None,
        }
    }

    /// Stops replicating (bounded by the store's own shutdown).
    pub async fn shutdown(&self) {
        match self {
            Replication::Raft(raft) => {
                raft.raft.shutdown().await.ok();
            }
            Replication::Etcd(etcd) => etcd.shutdown().await,
        }
    }

    /// Waits until this member's core stops for good, and says why.
    pub async fn stopped(&self, id: NodeId) -> String {
        match self {
            Replication::Raft(raft) => {
                let mut metrics = raft.raft.metrics();
                loop {
                    if let Err(problem) = raft.health() {
                        return problem;
                    }
                    if metrics.changed().await.is_err() {
                        return format!("the Raft core of member {id} stopped");
                    }
                }
            }
            Replication::Etcd(etcd) => etcd.stopped().await,
        }
    }
}

/// The Raft store: the openraft handle and the batcher that proposes to it.
pub struct RaftReplication {
    id: NodeId,
    pub raft: Raft,
    /// Local writes, batched into `Command::Batch` entries.
    batcher: tokio::sync::mpsc::Sender<BatchItem>,
}

impl RaftReplication {
    /// Starts the batcher (a task) for `raft`, the member `id`'s Raft handle.
    pub fn new(id: NodeId, raft: Raft) -> RaftReplication {
        let (batcher, queue) = tokio::sync::mpsc::channel(BATCH_QUEUE_MAX);
        tokio::spawn(run_batcher(Proposer::Raft(raft.clone()), queue));
        RaftReplication { id, raft, batcher }
    }

    fn facts(&self) -> ReplicationFacts {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let matched = metrics.replication.clone().unwrap_or_default();
        ReplicationFacts {
            leader: metrics.current_leader.unwrap_or(0),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            last_applied: metrics.last_applied.map_or(0, |id| id.index),
            members: membership
                .nodes()
                .map(|(id, node)| MemberFacts {
                    id: *id,
                    address: node.addr.clone(),
                    voter: membership.voter_ids().any(|voter| voter == *id),
                    matched_index: matched
                        .get(id)
                        .copied()
                        .flatten()
                        .map_or(0, |log_id| log_id.index),
                })
                .collect(),
        }
    }

    /// Whether this member can serve: `Err` once its Raft core stopped (a storage failure such
    /// as a full disk; `Started::run_until`, and so `vgpu-cp run`, then ends), with what
    /// happened and what to do.
    pub fn health(&self) -> Result<(), String> {
        match &self.raft.metrics().borrow().running_state {
            Ok(()) => Ok(()),
            Err(fatal) => Err(format!(
                "the Raft core of member {} stopped: {fatal}; this member serves nothing until it is started again (if its disk is full, free space on its data directory first; what it acknowledged is on disk)",
                self.id
            )),
        }
    }

    pub fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().current_leader == Some(self.id)
    }

    /// The leadership this member holds now, per its Raft metrics (`None`: it does not lead).
    pub fn leadership(&self) -> Option<crate::leader::Leadership> {
        let receiver = self.raft.metrics();
        let metrics = receiver.borrow();
        let vote = &metrics.vote;
        (metrics.current_leader == Some(self.id)
            && vote.committed
            && vote.leader_id.node_id == self.id)
            .then_some(crate::leader::Leadership {
                term: vote.leader_id.term,
                leader: vote.leader_id.node_id,
            })
    }

    /// The leader's node when it is known and is not this member.
    pub fn other_leader_node(&self) -> Option<BasicNode> {
        let receiver = self.raft.metrics();
        let metrics = receiver.borrow();
        let leader = metrics.current_leader.filter(|&leader| leader != self.id)?;
        metrics
            .membership_config
            .membership()
            .get_node(&leader)
            .cloned()
    }

    pub fn leader_node(&self) -> Option<BasicNode> {
        let receiver = self.raft.metrics();
        let metrics = receiver.borrow();
        let leader = metrics.current_leader?;
        metrics
            .membership_config
            .membership()
            .get_node(&leader)
            .cloned()
    }

    /// `Ok(false)`: this node is not the leader.
    pub async fn add_member_local(
        &self,
        id: NodeId,
        address: String,
        request_deadline: Duration,
    ) -> Result<bool, Status> {
        if !self.is_leader() {
            return Ok(false);
        }
        let membership = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        if membership.voter_ids().any(|voter| voter == id) {
            let known = membership.get_node(&id).map(|node| node.addr.clone());
            if known.as_deref() == Some(address.as_str()) {
                return Ok(true);
            }
            return Err(ErrorCode::Membership.status(format!(
                "member {id} already exists at {}; remove it first (`vgpuctl cluster remove {id}`) or pick another id",
                known.unwrap_or_default()
            )));
        }
        tracing::info!(id, %address, "adding a learner and waiting for it to catch up");
        let node = BasicNode::new(address);
        let deadline = Instant::now() + request_deadline * 3;
        // Another membership change in progress (several members joining at once) is waited out,
        // with a bound.
        loop {
            match self.raft.add_learner(id, node.clone(), true).await {
                Ok(_) => break,
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => return Ok(false),
                Err(error) if is_in_progress(&error) && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => return Err(ErrorCode::Membership.status(error)),
            }
        }
        loop {
            let voters: BTreeSet<NodeId> = BTreeSet::from([id]);
            match self
                .raft
                .change_membership(openraft::ChangeMembers::AddVoterIds(voters), false)
                .await
            {
                Ok(_) => {
                    tracing::info!(id, "promoted the learner to voter");
                    return Ok(true);
                }
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => return Ok(false),
                Err(error) if is_in_progress(&error) && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => return Err(ErrorCode::Membership.status(error)),
            }
        }
    }

    pub async fn remove_member_local(
        &self,
        id: NodeId,
        request_deadline: Duration,
    ) -> Result<bool, Status> {
        if !self.is_leader() {
            return Ok(false);
        }
        let membership = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        let is_voter = membership.voter_ids().any(|voter| voter == id);
        let is_learner = membership.learner_ids().any(|learner| learner == id);
        if !is_voter && !is_learner {
            return Err(ErrorCode::Membership.status(format!(
                "no member has id {id}; `vgpuctl cluster status` lists the members"
            )));
        }
        if is_voter && membership.voter_ids().count() == 1 {
            return Err(ErrorCode::Membership.status(format!(
                "member {id} is the last voter; a cluster cannot remove its last voter"
            )));
        }
        let change = if is_voter {
            openraft::ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        // A change still in progress (a member that joined a moment ago is promoted in a second
        // step) is waited out, with the same bound as a join.
        let deadline = Instant::now() + request_deadline * 3;
        loop {
            match self.raft.change_membership(change.clone(), false).await {
                Ok(_) => return Ok(true),
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => return Ok(false),
                Err(error) if is_in_progress(&error) && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) if is_in_progress(&error) => {
                    return Err(ErrorCode::Membership.status(format!(
                        "another membership change did not finish within {:?}, so member {id} was not removed ({error}); check `vgpuctl cluster status` and retry",
                        request_deadline * 3
                    )))
                }
                Err(error) => return Err(ErrorCode::Membership.status(error)),
            }
        }
    }
}

/// Proposes queued local writes to Raft, as many as are waiting in one `Command::Batch` entry.
///
/// openraft 0.9 makes each proposal's log append durable before it takes the next one, so one
/// entry per client write caps throughput at one fsync per write. Batching what queued up while
/// the previous entries were in flight turns that into one fsync per batch; a lone write is
/// proposed on its own, so it waits for nothing.
pub(crate) async fn run_batcher(
    proposer: Proposer,
    mut queue: tokio::sync::mpsc::Receiver<BatchItem>,
) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT_MAX));
    while let Some(first) = queue.recv().await {
        let permit = in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let mut bytes = first.1;
        let mut items = vec![first];
        // What does not fit this entry opens the next one.
        let mut held: Option<BatchItem> = None;
        while items.len() < crate::pool::BATCH_COMMANDS_MAX {
            match queue.try_recv() {
                Ok(item) if bytes + item.1 > crate::control_plane::ENTRY_BYTES_MAX => {
                    held = Some(item);
                    break;
                }
                Ok(item) => {
                    bytes += item.1;
                    items.push(item);
                }
                Err(_) => break,
            }
        }
        debug_assert!(items.len() == 1 || bytes <= crate::control_plane::ENTRY_BYTES_MAX);
        let batch_proposer = proposer.clone();
        tokio::spawn(async move {
            batch_proposer.propose(items).await;
            drop(permit);
        });
        if let Some(item) = held {
            let permit = in_flight
                .clone()
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            let batch_proposer = proposer.clone();
            tokio::spawn(async move {
                batch_proposer.propose(vec![item]).await;
                drop(permit);
            });
        }
    }
}

/// What the batcher hands its batches to.
#[derive(Clone)]
pub(crate) enum Proposer {
    Raft(Raft),
    Etcd(crate::etcd_replication::EtcdProposer),
}

impl Proposer {
    async fn propose(&self, items: Vec<BatchItem>) {
        match self {
            Proposer::Raft(raft) => propose(raft, items).await,
            Proposer::Etcd(etcd) => etcd.propose(items).await,
        }
    }
}

/// Membership is not a Raft vote on etcd: members register under the prefix on leases of their
/// own (`etcd_store::Presence`), so `vgpuctl cluster add`/`remove` have nothing to change; the
/// answer says what to do instead.
fn etcd_membership() -> Status {
    ErrorCode::Membership.status(ETCD_MEMBERSHIP_MESSAGE)
}

/// What `vgpuctl cluster add`/`remove` answer on the etcd store.
const ETCD_MEMBERSHIP_MESSAGE: &str = "this pool keeps its state in etcd, so there is no Raft membership for `vgpuctl cluster add`/`remove` to change: to add a vgpu-cp member, start it with `vgpu-cp join --peer ADDRESS` and the same --etcd-endpoints and --etcd-prefix (it registers itself); to remove one, stop it (it leaves `vgpuctl cluster status` at once, or when its etcd lease expires after a crash). etcd's own members are managed with etcd's tools (`etcdctl member add`/`remove`), not through vgpu-cp";

/// Proposes one batch and hands every caller its own result.
async fn propose(raft: &Raft, items: Vec<BatchItem>) {
    let (commands, callers): (Vec<Command>, Vec<_>) = items
        .into_iter()
        .map(|(command, _, caller)| (command, caller))
        .unzip();
    let single = commands.len() == 1;
    let entry = if single {
        commands.into_iter().next().expect("one command")
    } else {
        Command::Batch(commands)
    };
    let outcome: Result<Vec<LocalWrite>, LocalWrite> = match raft.client_write(entry).await {
        Ok(response) if single => Ok(vec![Ok(Ok(response.data))]),
        Ok(response) => match response.data {
            CommandResult::Batch(results) => {
                assert_eq!(
                    results.len(),
                    callers.len(),
                    "one result per batched command"
                );
                Ok(results.into_iter().map(|result| Ok(Ok(result))).collect())
            }
            other => Err(Err(
                ErrorCode::Internal.status(format!("a batch applied as {other:?}"))
            )),
        },
        Err(RaftError::APIError(ClientWriteError::ForwardToLeader(ForwardToLeader {
            leader_node,
            ..
        }))) => Err(Ok(Err(leader_node))),
        Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(error))) => {
            Err(Err(ErrorCode::Membership.status(error)))
        }
        Err(RaftError::Fatal(fatal)) => Err(Err(ErrorCode::Storage.status(format!(
            "this control-plane node stopped ({fatal}); see its log and restart it"
        )))),
    };
    match outcome {
        Ok(results) => {
            for (caller, result) in callers.into_iter().zip(results) {
                let _ = caller.send(result);
            }
        }
        Err(shared) => {
            for caller in callers {
                let _ = caller.send(clone_local_write(&shared));
            }
        }
    }
}

fn clone_local_write(write: &LocalWrite) -> LocalWrite {
    match write {
        Ok(Ok(result)) => Ok(Ok(result.clone())),
        Ok(Err(leader)) => Ok(Err(leader.clone())),
        Err(status) => Err(Status::new(status.code(), status.message())),
    }
}

/// True when a membership change was refused because another one has not finished yet.
fn is_in_progress(error: &RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>) -> bool {
    matches!(
        error,
        RaftError::APIError(ClientWriteError::ChangeMembershipError(
            openraft::error::ChangeMembershipError::InProgress(_)
        ))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_etcd_refusal_of_cluster_add_and_remove_says_what_to_do_instead() {
        let status = etcd_membership();
        let message = status.message();
        for needed in [
            "vgpu-cp join --peer",
            "--etcd-endpoints",
            "--etcd-prefix",
            "stop it",
            "etcdctl member add",
        ] {
            assert!(message.contains(needed), "{needed} missing from: {message}");
        }
    }
}
