//! An in-memory Raft network: a [`Router`] between the in-process members, which calls the target
//! member's `Raft` directly, with per-link cuts, message loss and delays drawn from a seeded RNG.
//!
//! A message is lost (the sender sees `Unreachable`) when its link is cut, when either end is
//! down, when the sender's incarnation has crashed since it was started, or with probability
//! `fail_rate`. A cut or a drop on the way back loses the *response* only: the target has handled
//! the request, as with a real network.

use openraft::BasicNode;
use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vgpu_cp::raft_types::{NodeId, Raft, TypeConfig};
use vgpu_cp::store::Shared;

/// Highest message loss probability the nemesis may set.
pub const FAIL_RATE_MAX: f64 = 0.3;
/// Longest one-way delay the nemesis may set, in milliseconds.
pub const DELAY_MS_MAX: u64 = 60;

/// A running member, as the router and the clients see it.
#[derive(Clone)]
pub struct Member {
    pub raft: Raft,
    pub shared: Arc<Shared>,
    /// Bumped on every start; messages from an older incarnation are dropped.
    pub incarnation: u64,
}

/// What the network did, for the per-seed summary.
#[derive(Clone, Copy, Debug, Default)]
pub struct NetworkStats {
    pub delivered: u64,
    pub dropped: u64,
    pub responses_lost: u64,
    /// Snapshot chunks sent (delivered or not): shows that lagging members catch up by snapshot.
    pub snapshot_chunks: u64,
}

struct RouterState {
    members: BTreeMap<NodeId, Member>,
    /// Cut directed links (from, to).
    cut: BTreeSet<(NodeId, NodeId)>,
    fail_rate: f64,
    delay_ms_max: u64,
    rng: StdRng,
    stats: NetworkStats,
}

pub struct Router {
    state: Mutex<RouterState>,
}

impl Router {
    pub fn new(seed: u64) -> Router {
        Router {
            state: Mutex::new(RouterState {
                members: BTreeMap::new(),
                cut: BTreeSet::new(),
                fail_rate: 0.0,
                delay_ms_max: 0,
                rng: StdRng::seed_from_u64(seed),
                stats: NetworkStats::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RouterState> {
        self.state
            .lock()
            .expect("a panic while holding the router lock is a bug")
    }

    pub fn add_member(&self, id: NodeId, member: Member) {
        let previous = self.lock().members.insert(id, member);
        assert!(previous.is_none(), "member {id} started twice");
    }

    pub fn remove_member(&self, id: NodeId) -> Option<Member> {
        self.lock().members.remove(&id)
    }

    pub fn member(&self, id: NodeId) -> Option<Member> {
        self.lock().members.get(&id).cloned()
    }

    pub fn members(&self) -> BTreeMap<NodeId, Member> {
        self.lock().members.clone()
    }

    /// Cuts both directions between every node of `a` and every node of `b`.
    pub fn partition(&self, a: &[NodeId], b: &[NodeId]) {
        let mut state = self.lock();
        for &x in a {
            for &y in b {
                state.cut.insert((x, y));
                state.cut.insert((y, x));
            }
        }
    }

    /// Cuts one direction only (`from` can no longer reach `to`).
    pub fn cut_one_way(&self, from: NodeId, to: NodeId) {
        self.lock().cut.insert((from, to));
    }

    pub fn set_fail_rate(&self, fail_rate: f64) {
        assert!(
            (0.0..=FAIL_RATE_MAX).contains(&fail_rate),
            "fail rate {fail_rate} out of bounds"
        );
        self.lock().fail_rate = fail_rate;
    }

    pub fn set_delay_ms_max(&self, delay_ms_max: u64) {
        assert!(
            delay_ms_max <= DELAY_MS_MAX,
            "delay {delay_ms_max} ms out of bounds"
        );
        self.lock().delay_ms_max = delay_ms_max;
    }

    /// Restores every link, and turns loss and delays off.
    pub fn heal(&self) {
        let mut state = self.lock();
        state.cut.clear();
        state.fail_rate = 0.0;
        state.delay_ms_max = 0;
    }

    fn count_snapshot_chunk(&self) {
        self.lock().stats.snapshot_chunks += 1;
    }

    pub fn stats(&self) -> NetworkStats {
        self.lock().stats
    }

    /// Decides the fate of one message from `from` (incarnation `incarnation`) to `to`: the
    /// target and the delay, or `None` when it is lost.
    fn send(&self, from: NodeId, incarnation: u64, to: NodeId) -> Option<(Raft, Duration)> {
        let mut state = self.lock();
        let reachable = state
            .members
            .get(&from)
            .is_some_and(|m| m.incarnation == incarnation)
            && !state.cut.contains(&(from, to));
        let target = state.members.get(&to).map(|m| m.raft.clone());
        let fail_rate = state.fail_rate;
        let lost = state.rng.gen_bool(fail_rate);
        let delay = draw_delay(&mut state);
        match target {
            Some(raft) if reachable && !lost => {
                state.stats.delivered += 1;
                Some((raft, delay))
            }
            _ => {
                state.stats.dropped += 1;
                None
            }
        }
    }

    /// Decides whether the response to a delivered message gets back, and its delay.
    fn respond(&self, from: NodeId, to: NodeId) -> Option<Duration> {
        let mut state = self.lock();
        let fail_rate = state.fail_rate;
        let lost = state.rng.gen_bool(fail_rate)
            || state.cut.contains(&(to, from))
            || !state.members.contains_key(&to);
        let delay = draw_delay(&mut state);
        if lost {
            state.stats.responses_lost += 1;
            return None;
        }
        Some(delay)
    }
}

fn draw_delay(state: &mut RouterState) -> Duration {
    let delay_ms_max = state.delay_ms_max;
    Duration::from_millis(if delay_ms_max == 0 {
        0
    } else {
        state.rng.gen_range(0..=delay_ms_max)
    })
}

/// The network factory of one member incarnation.
pub struct NetworkFactory {
    pub router: Arc<Router>,
    pub source: NodeId,
    pub incarnation: u64,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> Connection {
        Connection {
            router: self.router.clone(),
            source: self.source,
            incarnation: self.incarnation,
            target,
        }
    }
}

pub struct Connection {
    router: Arc<Router>,
    source: NodeId,
    incarnation: u64,
    target: NodeId,
}

fn unreachable<E: std::error::Error>(
    why: &str,
) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
    RPCError::Unreachable(Unreachable::new(&std::io::Error::other(why.to_owned())))
}

impl Connection {
    async fn call<Response, E, F, Fut>(
        &self,
        option: &RPCOption,
        handle: F,
    ) -> Result<Response, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        E: std::error::Error,
        F: FnOnce(Raft) -> Fut,
        Fut: Future<Output = Result<Response, RaftError<NodeId, E>>>,
    {
        let Some((raft, delay)) = self.router.send(self.source, self.incarnation, self.target)
        else {
            return Err(unreachable("the message was lost"));
        };
        let exchange = async {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let result = handle(raft).await;
            let back = self.router.respond(self.source, self.target);
            if let Some(delay) = back
                && !delay.is_zero()
            {
                tokio::time::sleep(delay).await;
            }
            back.map(|_| result)
        };
        match tokio::time::timeout(option.hard_ttl(), exchange).await {
            Err(_elapsed) => Err(unreachable("no response before the deadline")),
            Ok(None) => Err(unreachable("the response was lost")),
            // The target shut down while handling the message: to the sender it is just gone.
            Ok(Some(Err(RaftError::Fatal(_)))) => Err(unreachable("the target stopped")),
            Ok(Some(Err(error))) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, error)))
            }
            Ok(Some(Ok(response))) => Ok(response),
        }
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(
            &option,
            |raft| async move { raft.append_entries(rpc).await },
        )
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.router.count_snapshot_chunk();
        self.call(
            &option,
            |raft| async move { raft.install_snapshot(rpc).await },
        )
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(&option, |raft| async move { raft.vote(rpc).await })
            .await
    }
}
