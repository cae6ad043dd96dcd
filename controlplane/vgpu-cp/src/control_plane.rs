//! One control-plane node at run time: its replication (`crate::replication`: the Raft store),
//! the applied state, and the paths every API call takes.
//!
//! - Writes: through this member's batcher if it leads, otherwise forwarded to the leader over
//!   the internal `Raft.Forward` call; retried (bounded) while an election is under way. On
//!   etcd a member that knows no reachable leader appends itself.
//! - Linearizable reads: the leader confirms its leadership (`ensure_linearizable`); a follower
//!   asks the leader for its read index, waits until it has applied that far, then reads locally
//!   (the ReadIndex protocol).
//! - Heartbeats: kept in the leader's memory only (not logged); the leader loop turns missed
//!   heartbeats into `SetNodeState` commands, and proposes `Retry` while tenants are pending.
//!   Followers forward the heartbeats they receive in batches (`crate::beats`).

use crate::beats::{BatchLimits, BeatOutcome, QueuedBeat};
use crate::metrics::Metrics;
use crate::network;
use crate::pool::{Command, CommandResult};
use crate::raft_types::{NodeId, decode, encode};
use crate::replication::Replication;
use crate::store::Shared;
use api::ErrorCode;
use api::v1::RaftPayload;
use api::v1::raft_client::RaftClient;
use openraft::BasicNode;
use openraft::error::{CheckIsLeaderError, RaftError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Status;
use tonic::transport::Channel;

/// Timings of one control-plane node.
#[derive(Clone, Debug)]
pub struct Timings {
    /// A node whose agent has not heartbeated for this long is marked lost.
    pub node_lost_timeout: Duration,
    /// What agents are told to use.
    pub heartbeat_interval: Duration,
    /// How often the leader loop looks at heartbeats and the pending queue.
    pub leader_loop_interval: Duration,
    /// How often the leader retries pending tenants (besides on every release or node change).
    pub retry_interval: Duration,
    /// Longest a write or read waits for a leader before failing.
    pub request_deadline: Duration,
    /// Longest the API server waits for a call's answer, its request body included
    /// (`crate::REQUEST_TIMEOUT`; tests shorten it).
    pub request_timeout: Duration,
    /// Under mTLS, how long a connection may stay open before a request on it shows a client
    /// certificate (`limits::ANONYMOUS_CONNECTION_MAX`; tests shorten it).
    pub anonymous_connection_max: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            node_lost_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(1000),
            leader_loop_interval: Duration::from_millis(200),
            retry_interval: Duration::from_secs(2),
            request_deadline: Duration::from_secs(10),
            request_timeout: crate::REQUEST_TIMEOUT,
            anonymous_connection_max: crate::limits::ANONYMOUS_CONNECTION_MAX,
        }
    }
}

/// A request one control-plane node sends the leader on behalf of a client.
#[derive(Debug, Serialize, Deserialize)]
pub enum ForwardRequest {
    Write(Command),
    ReadIndex,
    Heartbeat {
        node: String,
    },
    HeartbeatTimes,
    AddMember {
        id: NodeId,
        address: String,
    },
    RemoveMember {
        id: NodeId,
    },
    /// A heartbeat with its health and usage report: an encoded `HeartbeatRequest`. Answered
    /// with `Heartbeat { known }`.
    HeartbeatReport(Vec<u8>),
    /// The leader's usage and health reports (`crate::usage`).
    Reports(crate::usage::Filter),
    /// Heartbeats a follower received, each an encoded `HeartbeatRequest`. Answered with
    /// `HeartbeatBatch`, one answer per beat in order. (New variants go last: the variant index
    /// is the wire tag.)
    HeartbeatBatch(Vec<Vec<u8>>),
    /// The leader's usage history of one tenant (`crate::dashboard::history`). Answered with
    /// `UsageHistory`.
    UsageHistory(String),
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ForwardResponse {
    Write(CommandResult),
    ReadIndex(u64),
    Heartbeat {
        known: bool,
    },
    HeartbeatTimes(BTreeMap<String, i64>),
    Membership,
    Reports(crate::usage::Encoded),
    /// The receiver is not (or no longer) the leader; the sender retries.
    NotLeader,
    Failed {
        code: ErrorCode,
        message: String,
    },
    HeartbeatBatch(Vec<Result<crate::beats::BeatAnswer, String>>),
    UsageHistory(Vec<crate::dashboard::history::UsageSample>),
}

pub struct ControlPlane {
    pub id: NodeId,
    pub cluster_id: String,
    /// Where the replicated state lives, and the batcher that writes to it.
    pub replication: Replication,
    pub shared: Arc<Shared>,
    pub timings: Timings,
    pub metrics: Metrics,
    /// Leader only: node name -> (when, unix ms) of its last heartbeat.
    heartbeats: Mutex<HashMap<String, (Instant, i64)>>,
    /// Leader only: each node's latest health and usage report (soft state, not logged).
    pub reports: crate::usage::Reports,
    /// Leader only: each tenant's usage over the last hour, sampled from `reports` (soft state).
    pub usage_history: Mutex<crate::dashboard::history::UsageHistory>,
    /// Cached channels to peers, by address.
    peers: Mutex<HashMap<String, RaftClient<Channel>>>,
    /// Plain text or mTLS, for forwarding to peers.
    transport: api::tls::Transport,
    /// Follower only: heartbeats waiting to be forwarded in a batch; the batcher task starts
    /// with the first beat (it holds a weak reference to this member).
    beat_queue: std::sync::OnceLock<tokio::sync::mpsc::Sender<crate::beats::QueuedBeat>>,
    /// Writes of each tenant owner through this member (`crate::limits`).
    pub owner_writes: Mutex<crate::limits::PerKey>,
    /// Linearizable reads that `JoinNode` calls with tokens this member does not know may cost.
    pub join_reads: Mutex<crate::limits::TokenBucket>,
}

/// What a local write gets back: the result, or the leader to forward to.
pub(crate) type LocalWrite = Result<Result<CommandResult, Option<BasicNode>>, Status>;
/// A queued write: the command, its encoded size, and where its result goes.
pub(crate) type BatchItem = (Command, usize, tokio::sync::oneshot::Sender<LocalWrite>);

/// Largest command one write may propose, encoded. Admission bounds every field of every
/// request well below it (a registration is at most `api::validate::REGISTER_BYTES_MAX`); this
/// is the last line, so that no entry can be larger than replication can carry.
pub const COMMAND_BYTES_MAX: usize = 512 << 10;
/// Largest log entry the batcher builds (a batch stops before the command that would pass it;
/// a lone command is at most [`COMMAND_BYTES_MAX`]).
pub const ENTRY_BYTES_MAX: usize = 1 << 20;

pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn unavailable(message: impl std::fmt::Display) -> Status {
    ErrorCode::Unavailable.status(message)
}

/// Waits between attempts while the cluster has no reachable leader.
const RETRY_PAUSE_MS: u64 = 50;
/// Longest a batch of heartbeats waits for a leader; agents give up on a beat after about a
/// second and send the next one anyway.
const BEAT_BATCH_DEADLINE: Duration = Duration::from_secs(2);

impl ControlPlane {
    pub fn new(
        id: NodeId,
        cluster_id: String,
        replication: Replication,
        shared: Arc<Shared>,
        timings: Timings,
        transport: api::tls::Transport,
    ) -> ControlPlane {
        ControlPlane {
            id,
            cluster_id,
            replication,
            shared,
            timings,
            metrics: Metrics::default(),
            heartbeats: Mutex::new(HashMap::new()),
            reports: crate::usage::Reports::default(),
            usage_history: Mutex::default(),
            peers: Mutex::new(HashMap::new()),
            transport,
            beat_queue: std::sync::OnceLock::new(),
            owner_writes: Mutex::new(crate::limits::PerKey::new(
                crate::limits::OWNER_WRITES_PER_SECOND,
                crate::limits::OWNER_WRITES_BURST,
            )),
            join_reads: Mutex::new(crate::limits::TokenBucket::new(
                crate::limits::JOIN_READS_PER_SECOND,
                crate::limits::JOIN_READS_BURST,
                Instant::now(),
            )),
        }
    }

    /// Queues a heartbeat (an encoded `HeartbeatRequest`) for the next batch to the leader and
    /// waits for its answer. Waits for room when the queue is full.
    pub(crate) async fn queue_beat(self: &Arc<Self>, request: Vec<u8>) -> BeatOutcome {
        let queue = self.beat_queue.get_or_init(|| {
            let limits = BatchLimits::default();
            let (sender, receiver) = crate::beats::queue(&limits);
            let member = Arc::downgrade(self);
            let forward = move |beats: Vec<Vec<u8>>| {
                let member = member.clone();
                async move {
                    match member.upgrade() {
                        Some(member) => member.forward_beats(beats).await,
                        None => Err(BeatOutcome::Failed(unavailable("the member is stopping"))),
                    }
                }
            };
            tokio::spawn(crate::beats::run(receiver, limits, forward));
            sender
        });
        let (answer, answered) = tokio::sync::oneshot::channel();
        let beat = QueuedBeat { request, answer };
        if queue.send(beat).await.is_err() {
            return BeatOutcome::Failed(unavailable("the heartbeat batcher stopped"));
        }
        answered.await.unwrap_or_else(|_| {
            BeatOutcome::Failed(ErrorCode::Internal.status("the heartbeat batch was dropped"))
        })
    }

    /// Sends one batch of heartbeats to the leader (or records them here if this member leads
    /// by now), retrying while there is no leader for at most [`BEAT_BATCH_DEADLINE`].
    async fn forward_beats(&self, beats: Vec<Vec<u8>>) -> crate::beats::BatchResult {
        let deadline = Instant::now() + BEAT_BATCH_DEADLINE;
        let request = ForwardRequest::HeartbeatBatch(beats);
        loop {
            if self.is_leader() {
                let ForwardRequest::HeartbeatBatch(beats) = &request else {
                    unreachable!("built above");
                };
                return Ok(self.record_heartbeat_batch(beats));
            }
            // Bounded: a leader that stopped answering (paused, not gone) keeps the call open
            // until HTTP/2 keepalive gives up, about 10 s, and this follower's later beats queue
            // behind it; a new leader could then take its nodes for lost.
            let remaining = deadline.saturating_duration_since(Instant::now());
            let Ok(sent) =
                tokio::time::timeout(remaining, self.forward_once(self.leader_node(), &request))
                    .await
            else {
                return Err(BeatOutcome::Failed(ErrorCode::NoLeader.status(format!(
                    "the control-plane leader did not answer a heartbeat within {BEAT_BATCH_DEADLINE:?}; check `vgpuctl cluster status`"
                ))));
            };
            if matches!(sent, Ok(Some(_))) {
                self.metrics.count_heartbeat_batch();
            }
            match sent {
                Ok(Some(ForwardResponse::HeartbeatBatch(answers))) => return Ok(answers),
                Ok(Some(other)) => {
                    return Err(BeatOutcome::Failed(
                        ErrorCode::Internal.status(format!("unexpected forward answer {other:?}")),
                    ));
                }
                Ok(None) => {}
                // An older leader cannot decode a batch; after a failure mid-call the outcome
                // is unknown. Either way each beat goes on its own (beats are idempotent).
                Err(status) => {
                    tracing::debug!(
                        "a heartbeat batch failed ({}); forwarding singly",
                        status.message()
                    );
                    return Err(BeatOutcome::Single);
                }
            }
            if Instant::now() >= deadline {
                return Err(BeatOutcome::Failed(ErrorCode::NoLeader.status(format!(
                    "no control-plane leader could be reached within {BEAT_BATCH_DEADLINE:?} for a heartbeat; check `vgpuctl cluster status`"
                ))));
            }
            tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
        }
    }

    /// Whether this member can serve: `Err` once its core stopped (on the Raft store, a storage
    /// failure such as a full disk; `Started::run_until`, and so `vgpu-cp run`, then ends), with
    /// what happened and what to do.
    pub fn health(&self) -> Result<(), String> {
        self.replication.health()
    }

    pub fn is_leader(&self) -> bool {
        self.replication.is_leader()
    }

    /// The Raft handle, on the Raft store only.
    pub fn raft(&self) -> Option<&crate::raft_types::Raft> {
        self.replication.raft()
    }

    /// The leader's node when it is known and is not this member.
    fn other_leader_node(&self) -> Option<BasicNode> {
        self.replication.other_leader_node()
    }

    pub(crate) fn leader_node(&self) -> Option<BasicNode> {
        self.replication.leader_node()
    }

    /// The leadership this member holds now (`None`: it does not lead).
    fn leadership(&self) -> Option<crate::leader::Leadership> {
        self.replication.leadership()
    }

    fn peer(&self, address: &str) -> Result<RaftClient<Channel>, Status> {
        let mut peers = self.peers.lock().expect("peers lock");
        if let Some(client) = peers.get(address) {
            return Ok(client.clone());
        }
        let client = network::raft_client(&self.transport, address)
            .map_err(|e| unavailable(format!("bad peer address {address}: {e}")))?;
        peers.insert(address.to_owned(), client.clone());
        Ok(client)
    }

    /// Sends `request` to the leader `leader`. `Ok(None)` means: try again (no leader yet, the
    /// target is not the leader any more, or it could not be reached before the request was sent).
    pub(crate) async fn forward_once(
        &self,
        leader: Option<BasicNode>,
        request: &ForwardRequest,
    ) -> Result<Option<ForwardResponse>, Status> {
        let Some(leader) = leader else {
            return Ok(None);
        };
        let mut client = self.peer(&leader.addr)?;
        let payload = RaftPayload {
            data: encode(request).map_err(|e| ErrorCode::Internal.status(e))?,
            cluster_id: self.cluster_id.clone(),
        };
        match client.forward(payload).await {
            Ok(response) => {
                let response: ForwardResponse = decode(&response.into_inner().data)
                    .map_err(|e| ErrorCode::Internal.status(e))?;
                match response {
                    ForwardResponse::NotLeader => Ok(None),
                    ForwardResponse::Failed { code, message } => Err(code.status(message)),
                    other => Ok(Some(other)),
                }
            }
            // The connection could not be made: the request was never delivered.
            Err(status)
                if status.code() == tonic::Code::Unavailable && is_connect_failure(&status) =>
            {
                Ok(None)
            }
            Err(status) => Err(unavailable(format!(
                "the leader at {} failed while handling the request (its outcome is unknown; read before retrying): {}",
                leader.addr,
                status.message()
            ))),
        }
    }

    /// Runs `attempt` until it yields, retrying while there is no leader, up to the deadline.
    pub(crate) async fn until_leader<T, F, Fut>(
        &self,
        what: &str,
        mut attempt: F,
    ) -> Result<T, Status>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, Status>>,
    {
        let deadline = Instant::now() + self.timings.request_deadline;
        loop {
            if let Some(value) = attempt().await? {
                return Ok(value);
            }
            if Instant::now() >= deadline {
                return Err(ErrorCode::NoLeader.status(format!(
                    "no control-plane leader could be reached within {:?} for {what}; check `vgpuctl cluster status` and that a majority of members is up",
                    self.timings.request_deadline
                )));
            }
            tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
        }
    }

    /// Commits a command through Raft (here or at the leader) and returns what applying it gave.
    pub async fn write(&self, command: Command) -> Result<CommandResult, Status> {
        command_size(&command)?;
        let request = ForwardRequest::Write(command);
        self.until_leader("a write", || async {
            let ForwardRequest::Write(command) = &request else {
                unreachable!()
            };
            // When this member knows another leader, go there directly instead of asking the
            // local Raft core first (one round trip less per forwarded write).
            let known_leader = self.other_leader_node();
            let local = match known_leader {
                Some(leader) => Err(Some(leader)),
                None => self.write_local(command.clone()).await?,
            };
            match local {
                Ok(result) => Ok(Some(result)),
                Err(leader) => {
                    match self.forward_once(leader, &request).await? {
                        Some(ForwardResponse::Write(result)) => Ok(Some(result)),
                        Some(other) => Err(ErrorCode::Internal
                            .status(format!("unexpected forward answer {other:?}"))),
                        // On etcd any member may append: a leader that cannot be reached (it
                        // died, its lease has not expired yet) does not hold the write up.
                        None if matches!(self.replication, Replication::Etcd(_)) => {
                            match self.write_local(command.clone()).await? {
                                Ok(result) => Ok(Some(result)),
                                Err(_) => Ok(None),
                            }
                        }
                        None => Ok(None),
                    }
                }
            }
        })
        .await
    }

    /// Writes on this node if it leads. `Err(leader)` when it does not. Concurrent writes are
    /// batched into one log entry (see `replication::run_batcher`).
    async fn write_local(&self, command: Command) -> LocalWrite {
        let started = Instant::now();
        let size = command_size(&command)?;
        let result = self.replication.submit(command, size).await;
        if matches!(result, Ok(Ok(_))) {
            self.metrics.observe_commit(started.elapsed());
        }
        result
    }

    /// Makes sure this node's applied state includes every write acknowledged before the call.
    pub async fn linearize(&self) -> Result<(), Status> {
        match &self.replication {
            Replication::Raft(replication) => self.linearize_raft(&replication.raft).await,
            Replication::Etcd(etcd) => etcd.linearize().await,
        }
    }

    /// ReadIndex: the leader confirms its leadership; a follower asks the leader for its read
    /// index and waits until it has applied that far.
    async fn linearize_raft(&self, raft: &crate::raft_types::Raft) -> Result<(), Status> {
        let index = self
            .until_leader("a linearizable read", || async {
                match raft.ensure_linearizable().await {
                    Ok(_) => Ok(Some(None)),
                    Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(forward))) => {
                        match self
                            .forward_once(forward.leader_node, &ForwardRequest::ReadIndex)
                            .await?
                        {
                            Some(ForwardResponse::ReadIndex(index)) => Ok(Some(Some(index))),
                            Some(other) => Err(ErrorCode::Internal
                                .status(format!("unexpected forward answer {other:?}"))),
                            None => Ok(None),
                        }
                    }
                    Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_))) => Ok(None),
                    Err(RaftError::Fatal(fatal)) => Err(ErrorCode::Storage.status(fatal)),
                }
            })
            .await?;
        if let Some(index) = index {
            raft.wait(Some(self.timings.request_deadline))
                .applied_index_at_least(Some(index), "linearizable read")
                .await
                .map_err(|e| {
                    unavailable(format!("this node did not catch up with the leader: {e}"))
                })?;
        }
        Ok(())
    }

    /// Answers a request forwarded by another node; this node must be the leader.
    pub async fn handle_forwarded(&self, request: ForwardRequest) -> ForwardResponse {
        match request {
            ForwardRequest::Write(command) => match self.write_local(command).await {
                Ok(Ok(result)) => ForwardResponse::Write(result),
                Ok(Err(_)) => ForwardResponse::NotLeader,
                Err(status) => failed_from(&status),
            },
            ForwardRequest::ReadIndex => match self.replication.raft() {
                Some(raft) => match raft.ensure_linearizable().await {
                    Ok(read_log_id) => {
                        ForwardResponse::ReadIndex(read_log_id.map_or(0, |id| id.index))
                    }
                    Err(_) => ForwardResponse::NotLeader,
                },
                None => ForwardResponse::NotLeader,
            },
            ForwardRequest::Heartbeat { node } => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                ForwardResponse::Heartbeat {
                    known: self.record_heartbeat(&node),
                }
            }
            ForwardRequest::HeartbeatReport(bytes) => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                match <api::v1::HeartbeatRequest as prost::Message>::decode(bytes.as_slice()) {
                    // This answer has no room for `report_wanted` (it predates it); the
                    // agent's periodic full report makes up for that.
                    Ok(request) => ForwardResponse::Heartbeat {
                        known: self.record_heartbeat_report(request).known,
                    },
                    Err(error) => ForwardResponse::Failed {
                        code: ErrorCode::InvalidArgument,
                        message: format!("the forwarded heartbeat does not decode: {error}"),
                    },
                }
            }
            ForwardRequest::Reports(filter) => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                ForwardResponse::Reports(crate::usage::encode(&self.reports.snapshot(&filter)))
            }
            ForwardRequest::HeartbeatBatch(beats) => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                ForwardResponse::HeartbeatBatch(self.record_heartbeat_batch(&beats))
            }
            ForwardRequest::UsageHistory(tenant) => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                let history = self.usage_history.lock().expect("usage history lock");
                ForwardResponse::UsageHistory(history.samples(&tenant))
            }
            ForwardRequest::HeartbeatTimes => {
                if !self.is_leader() {
                    return ForwardResponse::NotLeader;
                }
                ForwardResponse::HeartbeatTimes(self.heartbeat_times())
            }
            ForwardRequest::AddMember { id, address } => {
                match self
                    .replication
                    .add_member_local(id, address, self.timings.request_deadline)
                    .await
                {
                    Ok(true) => ForwardResponse::Membership,
                    Ok(false) => ForwardResponse::NotLeader,
                    Err(status) => failed_from(&status),
                }
            }
            ForwardRequest::RemoveMember { id } => {
                match self
                    .replication
                    .remove_member_local(id, self.timings.request_deadline)
                    .await
                {
                    Ok(true) => ForwardResponse::Membership,
                    Ok(false) => ForwardResponse::NotLeader,
                    Err(status) => failed_from(&status),
                }
            }
        }
    }

    pub(crate) fn record_heartbeat(&self, node: &str) -> bool {
        let known = self.shared.read().pool.nodes.contains_key(node);
        if known {
            let beat = (Instant::now(), unix_ms());
            let mut heartbeats = self.heartbeats.lock().expect("heartbeats lock");
            // Thousands of beats a second: allocate the name only for a node's first beat.
            match heartbeats.get_mut(node) {
                Some(last) => *last = beat,
                None => {
                    heartbeats.insert(node.to_owned(), beat);
                }
            }
        }
        known
    }

    fn heartbeat_times(&self) -> BTreeMap<String, i64> {
        self.heartbeats
            .lock()
            .expect("heartbeats lock")
            .iter()
            .map(|(name, (_, ms))| (name.clone(), *ms))
            .collect()
    }

    /// Records a heartbeat here (leader) or at the leader. Returns whether the node is known.
    pub async fn heartbeat(&self, node: &str) -> Result<bool, Status> {
        let request = ForwardRequest::Heartbeat {
            node: node.to_owned(),
        };
        self.until_leader("a heartbeat", || async {
            if self.is_leader() {
                return Ok(Some(self.record_heartbeat(node)));
            }
            let leader = self.leader_node();
            match self.forward_once(leader, &request).await? {
                Some(ForwardResponse::Heartbeat { known }) => Ok(Some(known)),
                Some(other) => {
                    Err(ErrorCode::Internal.status(format!("unexpected forward answer {other:?}")))
                }
                None => Ok(None),
            }
        })
        .await
    }

    /// Last heartbeat per node as the leader saw it (best effort: empty if the leader is away).
    pub async fn last_heartbeats(&self) -> BTreeMap<String, i64> {
        if self.is_leader() {
            return self.heartbeat_times();
        }
        let attempt = self.forward_once(self.leader_node(), &ForwardRequest::HeartbeatTimes);
        match tokio::time::timeout(Duration::from_secs(1), attempt).await {
            Ok(Ok(Some(ForwardResponse::HeartbeatTimes(times)))) => times,
            _ => BTreeMap::new(),
        }
    }

    /// Adds a member: as a learner first, then as a voter once it has caught up.
    pub async fn add_member(&self, id: NodeId, address: String) -> Result<(), Status> {
        let request = ForwardRequest::AddMember {
            id,
            address: address.clone(),
        };
        self.until_leader("adding a member", || async {
            if self
                .replication
                .add_member_local(id, address.clone(), self.timings.request_deadline)
                .await?
            {
                return Ok(Some(()));
            }
            match self.forward_once(self.leader_node(), &request).await? {
                Some(_) => Ok(Some(())),
                None => Ok(None),
            }
        })
        .await
    }

    pub async fn remove_member(&self, id: NodeId) -> Result<(), Status> {
        let request = ForwardRequest::RemoveMember { id };
        self.until_leader("removing a member", || async {
            if self
                .replication
                .remove_member_local(id, self.timings.request_deadline)
                .await?
            {
                return Ok(Some(()));
            }
            match self.forward_once(self.leader_node(), &request).await? {
                Some(_) => Ok(Some(())),
                None => Ok(None),
            }
        })
        .await
    }

    /// The leader's periodic duties: mark nodes lost or back, retry pending tenants. Both are
    /// decided by this member's clock, so both are proposed as `Command::LeaderDecision` under
    /// the leadership they were decided in, and only here (never forwarded): a member that lost
    /// the lead meanwhile proposes nothing, and an entry of a newer leader refuses them.
    pub async fn leader_loop(self: Arc<Self>) {
        // A tick later than this (the process paused or starved) restarts the watch: nodes get a
        // full timeout again (`leader`).
        let gap_max =
            (self.timings.node_lost_timeout / 5).max(self.timings.leader_loop_interval * 2);
        let mut watch = crate::leader::LeaderWatch::new(gap_max);
        // Ready nodes without a heartbeat yet, and when this leader first saw them: a node's
        // registration is applied before its first heartbeat is recorded (the register call
        // records one after the write, the agent beats within an interval), and judging such a
        // node against the watch's start marked hundreds of freshly registered nodes lost (and
        // ready again) during a 10,000-node ramp-up, each a log entry and a re-placement.
        let mut first_seen: HashMap<String, Instant> = HashMap::new();
        let mut last_retry = Instant::now();
        let mut interval = tokio::time::interval(self.timings.leader_loop_interval);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let leadership = self.leadership();
            let Some(tick) = watch.tick(Instant::now(), leadership) else {
                first_seen.clear();
                continue;
            };
            let leadership = leadership.expect("a watch is kept only while leading");
            match tick.started {
                Some(crate::leader::WatchStart::Elected) => tracing::info!(
                    id = self.id,
                    term = leadership.term,
                    "became leader; giving every node one lost-timeout of grace"
                ),
                Some(crate::leader::WatchStart::Gap(gap)) => tracing::warn!(
                    id = self.id,
                    term = leadership.term,
                    gap_ms = gap.as_millis() as u64,
                    "the leader loop did not run for a while (paused or starved); it did not observe the nodes meanwhile, so every node gets one lost-timeout of grace again"
                ),
                None => {}
            }
            let changes = self.node_state_changes(tick.since, &mut first_seen);
            for (node, state, reason) in changes {
                tracing::warn!(%node, ?state, %reason, "node state change");
                let command = Command::SetNodeState {
                    node,
                    state,
                    reason,
                    unix_ms: unix_ms(),
                };
                if let Err(message) = self.propose_decision(leadership, command).await {
                    tracing::warn!(%message, "did not record a node state change");
                }
            }
            let pending = self.shared.read().pool.engine.pending_count();
            if pending > 0 && last_retry.elapsed() >= self.timings.retry_interval {
                last_retry = Instant::now();
                let command = Command::Retry { unix_ms: unix_ms() };
                if let Err(message) = self.propose_decision(leadership, command).await {
                    tracing::warn!(%message, "did not retry the pending queue");
                }
            }
        }
    }

    /// Proposes a leader decision on this member only, fenced by `leadership`. `Err` says why it
    /// was not applied (no longer the leader, a stale term, a failure).
    async fn propose_decision(
        &self,
        leadership: crate::leader::Leadership,
        command: Command,
    ) -> Result<(), String> {
        let fenced = Command::LeaderDecision {
            term: leadership.term,
            leader: leadership.leader,
            command: Box::new(command),
        };
        let proposed = match &self.replication {
            Replication::Raft(_) => self.write_local(fenced).await,
            // Appended with `append_fenced` on this leadership, never through the batcher: etcd
            // commits it only while the leadership lasts.
            Replication::Etcd(etcd) => etcd.propose_decision(leadership, fenced).await,
        };
        match proposed {
            Ok(Ok(CommandResult::Failed { message, .. })) => Err(message),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err("this member no longer leads; the new leader decides".to_owned()),
            Err(status) => Err(status.message().to_owned()),
        }
    }

    fn node_state_changes(
        &self,
        since: Instant,
        first_seen: &mut HashMap<String, Instant>,
    ) -> Vec<crate::leader::NodeChange> {
        let applied = self.shared.read();
        // Looked up under the lock rather than cloned: with thousands of nodes a copy of the map
        // every loop tick costs more than the lookups. Lock order: state, then heartbeats
        // (`record_heartbeat` never holds both).
        let mut heartbeats = self.heartbeats.lock().expect("heartbeats lock");
        let forgotten =
            crate::leader::prune_beats(&mut heartbeats, applied.pool.nodes.len(), |name| {
                applied.pool.nodes.contains_key(name)
            });
        if forgotten > 0 {
            tracing::debug!(forgotten, "forgot the heartbeats of removed nodes");
        }
        let changes = crate::leader::judge_nodes(
            Instant::now(),
            since,
            self.timings.node_lost_timeout,
            applied.pool.engine.node_states(),
            |name| heartbeats.get(name).map(|(at, _)| *at),
            first_seen,
        );
        debug_assert!(first_seen.len() <= applied.pool.nodes.len());
        changes
    }
}

/// The encoded size of `command`, refused past [`COMMAND_BYTES_MAX`].
fn command_size(command: &Command) -> Result<usize, Status> {
    let size = crate::raft_types::encode(command)
        .map_err(|error| ErrorCode::Internal.status(error))?
        .len();
    if size > COMMAND_BYTES_MAX {
        return Err(ErrorCode::InvalidArgument.status(format!(
            "the write is {size} bytes, more than a log entry may hold ({COMMAND_BYTES_MAX}); send less (a node's labels and inventory, a tenant's selector)"
        )));
    }
    Ok(size)
}

fn failed_from(status: &Status) -> ForwardResponse {
    let code = ErrorCode::of(status).unwrap_or(ErrorCode::Internal);
    let message = status.message();
    let message = message.find("] ").map_or(message, |at| &message[at + 2..]);
    ForwardResponse::Failed {
        code,
        message: message.to_owned(),
    }
}

/// True when a status says that a connection could not be opened (so nothing was sent).
fn is_connect_failure(status: &Status) -> bool {
    let text = format!("{status:?}").to_ascii_lowercase();
    text.contains("connect")
        || text.contains("connection refused")
        || text.contains("transport error")
}
