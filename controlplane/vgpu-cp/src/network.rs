//! Raft traffic between control-plane peers over gRPC (`vgpu.v1.Raft`), openraft messages
//! bincode-encoded inside `RaftPayload`. Every payload carries the cluster id; a peer of another
//! cluster refuses it. Under mTLS each member presents its `member` certificate, and peers refuse
//! Raft calls from any other role (`security`).

use crate::raft_types::{NodeId, TypeConfig, decode, encode};
use api::tls::Transport;
use api::v1::RaftPayload;
use api::v1::raft_client::RaftClient;
use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

/// Time to open a TCP connection to a peer before it counts as unreachable.
pub const CONNECT_TIMEOUT_MS: u64 = 500;
/// Largest message a peer accepts (snapshot chunks, batches of entries).
pub const MESSAGE_BYTES_MAX: usize = 64 << 20;
/// Largest message a client (vgpuctl, an agent) may send: requests are bounded field by field
/// on admission far below it (a heartbeat's report is at most about 1 MiB).
pub const CLIENT_MESSAGE_BYTES_MAX: usize = 4 << 20;
/// AppendEntries and Vote calls per peer that may run on past openraft's timeout (see
/// [`PeerConnection`]); past this many, calls are cancelled at the timeout as before.
pub const DETACHED_CALLS_MAX: usize = 4;
/// Longest a detached call of a small message runs before it is abandoned; a larger one gets
/// as much more as it takes at [`PEER_BYTES_PER_SECOND_MIN`].
pub const DETACHED_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The slowest a peer link is assumed to carry a message, for its send timeout.
pub const PEER_BYTES_PER_SECOND_MIN: u64 = 1 << 20;
/// Largest AppendEntries sent: a larger one is split (openraft sends fewer entries when told
/// `PayloadTooLarge`). A single entry is at most `control_plane::ENTRY_BYTES_MAX`, below it.
pub const APPEND_BYTES_MAX: usize = 2 << 20;

// One entry always fits one AppendEntries, and one AppendEntries a peer message.
const _: () = assert!(crate::control_plane::ENTRY_BYTES_MAX < APPEND_BYTES_MAX);
const _: () = assert!(APPEND_BYTES_MAX < MESSAGE_BYTES_MAX);

/// How long a detached call of `bytes` may run: sized to the payload, so that a large entry
/// is delivered however long it takes at the floor rate, and never cut off at Raft's heartbeat.
pub fn detached_call_timeout(bytes: usize) -> Duration {
    DETACHED_CALL_TIMEOUT + Duration::from_millis(bytes as u64 * 1000 / PEER_BYTES_PER_SECOND_MIN)
}

/// How many of the leading entries, of these encoded sizes, fit [`APPEND_BYTES_MAX`] (at least
/// one).
pub fn entries_hint(sizes: impl IntoIterator<Item = usize>) -> u64 {
    let mut total = 0;
    let mut fitting = 0u64;
    for size in sizes {
        total += size;
        if total > APPEND_BYTES_MAX && fitting > 0 {
            break;
        }
        fitting += 1;
    }
    fitting.max(1)
}

/// The answer to an AppendEntries that arrived after openraft had stopped waiting for it: the
/// follower holds the leader's log up to `matched` as of `vote`.
#[derive(Clone, Debug, PartialEq)]
pub struct LateAck {
    pub vote: openraft::Vote<NodeId>,
    pub matched: Option<crate::raft_types::LogId>,
}

/// What a late answer says about `request`: `Success` when it covers all of its entries,
/// `PartialSuccess` when it covers some, `None` when it says nothing about them (another vote,
/// or a match outside the request's range). A delayed answer is what the network may always do
/// to an answer, so using it is as safe as waiting for it.
pub fn late_answer(
    late: &LateAck,
    request: &AppendEntriesRequest<TypeConfig>,
) -> Option<AppendEntriesResponse<NodeId>> {
    if late.vote != request.vote {
        return None;
    }
    let matched = late.matched?;
    let last = request.entries.last()?.log_id;
    if matched == last {
        return Some(AppendEntriesResponse::Success);
    }
    request
        .entries
        .iter()
        .any(|entry| entry.log_id == matched)
        .then_some(AppendEntriesResponse::PartialSuccess(Some(matched)))
}

/// Opens a gRPC channel to a peer lazily (the first call connects; failures are retried by tonic
/// on the next call).
pub fn channel(transport: &Transport, address: &str) -> Result<Channel, api::tls::TlsError> {
    let endpoint = transport
        .endpoint(address)?
        .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5));
    Ok(endpoint.connect_lazy())
}

pub fn raft_client(
    transport: &Transport,
    address: &str,
) -> Result<RaftClient<Channel>, api::tls::TlsError> {
    Ok(RaftClient::new(channel(transport, address)?)
        .max_decoding_message_size(MESSAGE_BYTES_MAX)
        .max_encoding_message_size(MESSAGE_BYTES_MAX))
}

pub struct NetworkFactory {
    pub cluster_id: String,
    pub transport: Transport,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerConnection {
        PeerConnection {
            target,
            client: raft_client(&self.transport, &node.addr).ok(),
            address: node.addr.clone(),
            cluster_id: self.cluster_id.clone(),
            detached: Arc::new(Semaphore::new(DETACHED_CALLS_MAX)),
            appending: Arc::default(),
        }
    }
}

/// One peer's Raft calls.
///
/// openraft gives an AppendEntries call the Raft heartbeat interval (50 ms by default) and drops
/// it when that passes. On a starved machine (10,000 nodes heartbeating on 2 shared cores) a call
/// dropped that early had often not even been written to the connection, so a follower could go
/// its whole election timeout without one heartbeat and start an election (twice in one
/// 10,000-node run). AppendEntries and Vote calls therefore run in their own task: openraft still
/// gets its timeout error at the interval and retries, but the message already on its way is
/// delivered, and the follower's election timer is reset by it. At most [`DETACHED_CALLS_MAX`]
/// such calls per peer run at once, each for at most [`DETACHED_CALL_TIMEOUT`]; both messages
/// are idempotent for the follower (it checks the vote and the log ids).
pub struct PeerConnection {
    target: NodeId,
    address: String,
    client: Option<RaftClient<Channel>>,
    cluster_id: String,
    detached: Arc<Semaphore>,
    appending: Arc<Appending>,
}

/// A detached AppendEntries still on its way, and the late answer of the last one.
#[derive(Default)]
struct Appending {
    state: std::sync::Mutex<AppendingState>,
    done: tokio::sync::Notify,
}

#[derive(Default)]
struct AppendingState {
    /// The vote and first log id of the AppendEntries being sent detached.
    sending: Option<(openraft::Vote<NodeId>, Option<crate::raft_types::LogId>)>,
    late: Option<LateAck>,
}

#[derive(Clone, Copy)]
enum Rpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl PeerConnection {
    /// Sends one message and decodes the peer's `Result<Response, RaftError<E>>`.
    async fn call<Request, Response, E>(
        &mut self,
        rpc: Rpc,
        request: &Request,
        option: &RPCOption,
    ) -> Result<Response, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Request: serde::Serialize,
        Response: serde::de::DeserializeOwned,
        E: std::error::Error + serde::de::DeserializeOwned,
    {
        let data = encode(request).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        self.call_encoded(rpc, data, option, None).await
    }

    /// Sends one encoded message. `append` names an AppendEntries (its vote, first and last log
    /// ids), whose answer is kept as a [`LateAck`] when it arrives after openraft stopped
    /// waiting.
    async fn call_encoded<Response, E>(
        &mut self,
        rpc: Rpc,
        data: Vec<u8>,
        option: &RPCOption,
        append: Option<AppendKey>,
    ) -> Result<Response, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Response: serde::de::DeserializeOwned,
        E: std::error::Error + serde::de::DeserializeOwned,
    {
        let Some(client) = self.client.as_ref() else {
            let error = std::io::Error::other(format!("bad peer address `{}`", self.address));
            return Err(RPCError::Unreachable(Unreachable::new(&error)));
        };
        let timeout = detached_call_timeout(data.len());
        let payload = RaftPayload {
            data,
            cluster_id: self.cluster_id.clone(),
        };
        let mut client = client.clone();
        let call = async move {
            match rpc {
                Rpc::AppendEntries => client.append_entries(payload).await,
                Rpc::Vote => client.vote(payload).await,
                Rpc::InstallSnapshot => client.install_snapshot(payload).await,
            }
        };
        let detached = match rpc {
            Rpc::AppendEntries | Rpc::Vote => self.detached.clone().try_acquire_owned().ok(),
            Rpc::InstallSnapshot => None,
        };
        let outcome = match detached {
            Some(permit) => {
                let (sender, receiver) = tokio::sync::oneshot::channel();
                let appending = self.appending.clone();
                if let Some(key) = &append {
                    let mut state = appending.state.lock().expect("append state lock");
                    state.sending = Some((key.vote, key.prev));
                }
                tokio::spawn(async move {
                    let outcome = tokio::time::timeout(timeout, call).await;
                    drop(permit);
                    // openraft may have stopped waiting: then nobody reads the answer, and an
                    // AppendEntries' answer is kept for its next attempt.
                    let unread = sender.send(outcome).err();
                    if let Some(key) = append {
                        let late = unread.and_then(|outcome| late_ack_of(&outcome, &key));
                        let mut state = appending.state.lock().expect("append state lock");
                        state.sending = None;
                        if late.is_some() {
                            state.late = late;
                        }
                        drop(state);
                        appending.done.notify_waiters();
                    }
                });
                match tokio::time::timeout(option.hard_ttl(), receiver).await {
                    Ok(Ok(outcome)) => outcome,
                    Ok(Err(_dropped)) => {
                        let error = std::io::Error::other("the detached Raft call was dropped");
                        return Err(RPCError::Network(NetworkError::new(&error)));
                    }
                    Err(elapsed) => return Err(RPCError::Network(NetworkError::new(&elapsed))),
                }
            }
            None => tokio::time::timeout(option.hard_ttl(), call).await,
        };
        // A peer that answers late is slow, not unreachable: openraft pauses replication to an
        // `Unreachable` peer for 500 ms, which under load (a busy or shared CPU, 10,000 nodes
        // heartbeating) turned one late answer into a half-second stall of every commit. Late
        // answers are network errors, retried at the next heartbeat.
        let response = match outcome {
            Err(elapsed) => return Err(RPCError::Network(NetworkError::new(&elapsed))),
            Ok(Err(status)) => {
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Cancelled => {
                        RPCError::Unreachable(Unreachable::new(&status))
                    }
                    _ => RPCError::Network(NetworkError::new(&status)),
                });
            }
            Ok(Ok(response)) => response.into_inner(),
        };
        let result: Result<Response, RaftError<NodeId, E>> =
            decode(&response.data).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|error| RPCError::RemoteError(RemoteError::new(self.target, error)))
    }
}

impl PeerConnection {
    /// Takes the late answer that covers `rpc`, if one arrived.
    fn take_late_answer(
        &self,
        rpc: &AppendEntriesRequest<TypeConfig>,
    ) -> Option<AppendEntriesResponse<NodeId>> {
        let mut state = self.appending.state.lock().expect("append state lock");
        let answer = late_answer(state.late.as_ref()?, rpc);
        if answer.is_some() {
            state.late = None;
        }
        answer
    }
}

/// Which AppendEntries a detached call carries.
struct AppendKey {
    vote: openraft::Vote<NodeId>,
    prev: Option<crate::raft_types::LogId>,
    last: Option<crate::raft_types::LogId>,
}

type CallOutcome =
    Result<Result<tonic::Response<RaftPayload>, tonic::Status>, tokio::time::error::Elapsed>;

/// The late acknowledgement an AppendEntries' unread answer gives, if it was a success.
fn late_ack_of(outcome: &CallOutcome, key: &AppendKey) -> Option<LateAck> {
    let Ok(Ok(response)) = outcome else {
        return None;
    };
    let answer: Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>> =
        decode(&response.get_ref().data).ok()?;
    // Only an answer that matched entries is worth keeping (not a heartbeat's).
    let matched = match answer.ok()? {
        AppendEntriesResponse::Success => key.last?,
        AppendEntriesResponse::PartialSuccess(matched) => matched?,
        _ => return None,
    };
    Some(LateAck {
        vote: key.vote,
        matched: Some(matched),
    })
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        if let Some(answer) = self.take_late_answer(&rpc) {
            return Ok(answer);
        }
        // The same entries are still on their way (a large batch past openraft's timeout, which
        // is the Raft heartbeat): wait for that send rather than send them again.
        let appending = self.appending.clone();
        let done = appending.done.notified();
        let same = self
            .appending
            .state
            .lock()
            .expect("append state lock")
            .sending
            == Some((rpc.vote, rpc.prev_log_id));
        if same {
            let _ = tokio::time::timeout(option.hard_ttl(), done).await;
            if let Some(answer) = self.take_late_answer(&rpc) {
                return Ok(answer);
            }
            let error = std::io::Error::other("the previous send of these entries is under way");
            return Err(RPCError::Network(NetworkError::new(&error)));
        }
        drop(done);
        let data = encode(&rpc).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        if data.len() > APPEND_BYTES_MAX && rpc.entries.len() > 1 {
            let sizes = rpc
                .entries
                .iter()
                .map(|entry| encode(entry).map_or(APPEND_BYTES_MAX, |bytes| bytes.len()));
            let hint = entries_hint(sizes);
            tracing::debug!(
                bytes = data.len(),
                entries = rpc.entries.len(),
                hint,
                "splitting a large AppendEntries"
            );
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(hint),
            ));
        }
        let key = AppendKey {
            vote: rpc.vote,
            prev: rpc.prev_log_id,
            last: rpc.entries.last().map(|entry| entry.log_id),
        };
        self.call_encoded(Rpc::AppendEntries, data, &option, Some(key))
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
        self.call(Rpc::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Vote, &rpc, &option).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload, LogId, Vote};

    fn log_id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    fn append(vote: Vote<NodeId>, prev: u64, last: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote,
            prev_log_id: Some(log_id(2, prev)),
            leader_commit: None,
            entries: (prev + 1..=last)
                .map(|index| crate::raft_types::Entry {
                    log_id: log_id(2, index),
                    payload: EntryPayload::Blank,
                })
                .collect(),
        }
    }

    /// Issue 22, point 1: a batch that took longer than the Raft heartbeat to deliver was sent
    /// again and again, and the follower never caught up. Its late answer now counts for the
    /// next attempt: all of it, or the part it covers.
    #[test]
    fn a_late_answer_acknowledges_the_entries_it_covered() {
        let vote = Vote::new_committed(2, 1);
        let late = LateAck {
            vote,
            matched: Some(log_id(2, 20)),
        };
        assert_eq!(
            late_answer(&late, &append(vote, 10, 20)),
            Some(AppendEntriesResponse::Success)
        );
        assert_eq!(
            late_answer(&late, &append(vote, 10, 30)),
            Some(AppendEntriesResponse::PartialSuccess(Some(log_id(2, 20))))
        );
        // Says nothing about later entries, another vote, or a heartbeat.
        assert_eq!(late_answer(&late, &append(vote, 20, 30)), None);
        assert_eq!(
            late_answer(&late, &append(Vote::new_committed(3, 2), 10, 20)),
            None
        );
        assert_eq!(late_answer(&late, &append(vote, 20, 20)), None);
    }

    #[test]
    fn large_appends_are_split_and_their_timeout_grows_with_them() {
        assert_eq!(entries_hint([100; 5]), 5);
        assert_eq!(entries_hint([APPEND_BYTES_MAX / 2; 5]), 2);
        // A single entry larger than the bound still goes, alone.
        assert_eq!(entries_hint([APPEND_BYTES_MAX * 2, 10]), 1);
        assert_eq!(detached_call_timeout(0), DETACHED_CALL_TIMEOUT);
        assert_eq!(
            detached_call_timeout(8 << 20),
            DETACHED_CALL_TIMEOUT + Duration::from_secs(8)
        );
    }
}
