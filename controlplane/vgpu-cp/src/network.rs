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
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
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
/// AppendEntries and Vote calls per peer that may run on past openraft's timeout (see
/// [`PeerConnection`]); past this many, calls are cancelled at the timeout as before.
pub const DETACHED_CALLS_MAX: usize = 4;
/// Longest a detached call runs before it is abandoned.
pub const DETACHED_CALL_TIMEOUT: Duration = Duration::from_secs(5);

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
        let Some(client) = self.client.as_ref() else {
            let error = std::io::Error::other(format!("bad peer address `{}`", self.address));
            return Err(RPCError::Unreachable(Unreachable::new(&error)));
        };
        let data = encode(request).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
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
                tokio::spawn(async move {
                    let outcome = tokio::time::timeout(DETACHED_CALL_TIMEOUT, call).await;
                    drop(permit);
                    // openraft may have stopped waiting: then nobody reads the answer.
                    let _ = sender.send(outcome);
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

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::AppendEntries, &rpc, &option).await
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
