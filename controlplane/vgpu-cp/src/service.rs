//! The gRPC services (`vgpu.v1.Pool`, `Agent`, `Cluster`, `Raft`) over one [`ControlPlane`].
//!
//! Handlers validate input before anything reaches the log, so bad input is refused with a clear
//! message and changes nothing.

use crate::control_plane::{ControlPlane, ForwardRequest, unix_ms};
use crate::pool::{Command, CommandResult, node_spec_from_proto, validate_node_spec};
use crate::raft_types::{decode, encode};
use api::ErrorCode;
use api::v1::{self, RaftPayload};
use prost::Message;
use std::sync::Arc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Assignment updates buffered per watcher before the sender waits.
const WATCH_BUFFER_MAX: usize = 4;

#[derive(Clone)]
pub struct Service {
    pub control_plane: Arc<ControlPlane>,
}

fn invalid(message: impl std::fmt::Display) -> Status {
    ErrorCode::InvalidArgument.status(message)
}

fn result_to_tenant(result: CommandResult, service: &Service) -> Result<v1::Tenant, Status> {
    match result {
        CommandResult::Tenant(record) => Ok(service
            .control_plane
            .shared
            .read()
            .pool
            .tenant_to_proto(&record)),
        CommandResult::Failed { code, message } => Err(code.status(message)),
        CommandResult::Done | CommandResult::Batch(_) => {
            Err(ErrorCode::Internal.status("the write returned no tenant"))
        }
    }
}

fn result_to_unit(result: CommandResult) -> Result<(), Status> {
    match result {
        CommandResult::Failed { code, message } => Err(code.status(message)),
        _ => Ok(()),
    }
}

impl Service {
    async fn read_prepare(&self, stale: bool) -> Result<(), Status> {
        if stale {
            Ok(())
        } else {
            self.control_plane.linearize().await
        }
    }

    async fn node(&self, name: &str) -> Result<v1::Node, Status> {
        let node = self.control_plane.shared.read().pool.node_to_proto(name);
        let Some(mut node) = node else {
            return Err(ErrorCode::NodeNotFound.status(format!(
                "no node is named `{name}`; `vgpuctl get nodes` lists them"
            )));
        };
        node.last_heartbeat_unix_ms = self
            .control_plane
            .last_heartbeats()
            .await
            .get(name)
            .copied()
            .unwrap_or(0);
        Ok(node)
    }

    fn check_cluster(&self, cluster_id: &str) -> Result<(), Status> {
        if cluster_id != self.control_plane.cluster_id {
            return Err(ErrorCode::ClusterMismatch.status(format!(
                "this node belongs to cluster {} but the peer belongs to cluster {cluster_id}; a data directory of another cluster is in use",
                self.control_plane.cluster_id
            )));
        }
        Ok(())
    }

    fn status(&self) -> v1::ClusterStatus {
        let metrics = self.control_plane.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let matched = metrics.replication.clone().unwrap_or_default();
        let members = membership
            .nodes()
            .map(|(id, node)| v1::Member {
                id: *id,
                address: node.addr.clone(),
                voter: membership.voter_ids().any(|voter| voter == *id),
                matched_index: matched
                    .get(id)
                    .copied()
                    .flatten()
                    .map_or(0, |log_id| log_id.index),
            })
            .collect();
        v1::ClusterStatus {
            leader: metrics.current_leader.unwrap_or(0),
            term: metrics.current_term,
            members,
            responder: self.control_plane.id,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            last_applied: metrics.last_applied.map_or(0, |id| id.index),
            cluster_id: self.control_plane.cluster_id.clone(),
        }
    }
}

#[tonic::async_trait]
impl v1::pool_server::Pool for Service {
    async fn place(
        &self,
        request: Request<v1::PlaceRequest>,
    ) -> Result<Response<v1::PlaceResponse>, Status> {
        let request = request.into_inner();
        api::names::validate("tenant", &request.name).map_err(invalid)?;
        let placement = request
            .request
            .ok_or_else(|| invalid("the placement request is missing"))?;
        api::validate::validate_request(&placement).map_err(invalid)?;
        let command = Command::Place {
            name: request.name,
            request: placement.encode_to_vec(),
            unix_ms: unix_ms(),
        };
        let result = self.control_plane.write(command).await?;
        let tenant = result_to_tenant(result, self)?;
        Ok(Response::new(v1::PlaceResponse {
            tenant: Some(tenant),
        }))
    }

    async fn release(
        &self,
        request: Request<v1::ReleaseRequest>,
    ) -> Result<Response<v1::ReleaseResponse>, Status> {
        let name = request.into_inner().name;
        api::names::validate("tenant", &name).map_err(invalid)?;
        result_to_unit(
            self.control_plane
                .write(Command::Release {
                    name,
                    unix_ms: unix_ms(),
                })
                .await?,
        )?;
        Ok(Response::new(v1::ReleaseResponse {}))
    }

    async fn get_tenant(
        &self,
        request: Request<v1::GetTenantRequest>,
    ) -> Result<Response<v1::Tenant>, Status> {
        let request = request.into_inner();
        self.read_prepare(request.stale).await?;
        let applied = self.control_plane.shared.read();
        let record = applied.pool.tenants.get(&request.name).ok_or_else(|| {
            ErrorCode::TenantNotFound.status(format!(
                "no tenant is named `{}`; `vgpuctl get tenants` lists them",
                request.name
            ))
        })?;
        Ok(Response::new(applied.pool.tenant_to_proto(record)))
    }

    async fn list_tenants(
        &self,
        request: Request<v1::ListRequest>,
    ) -> Result<Response<v1::ListTenantsResponse>, Status> {
        self.read_prepare(request.into_inner().stale).await?;
        let applied = self.control_plane.shared.read();
        let tenants = applied
            .pool
            .tenants
            .values()
            .map(|record| applied.pool.tenant_to_proto(record))
            .collect();
        Ok(Response::new(v1::ListTenantsResponse { tenants }))
    }

    async fn get_node(
        &self,
        request: Request<v1::GetNodeRequest>,
    ) -> Result<Response<v1::Node>, Status> {
        let request = request.into_inner();
        self.read_prepare(request.stale).await?;
        Ok(Response::new(self.node(&request.name).await?))
    }

    async fn list_nodes(
        &self,
        request: Request<v1::ListRequest>,
    ) -> Result<Response<v1::ListNodesResponse>, Status> {
        self.read_prepare(request.into_inner().stale).await?;
        let heartbeats = self.control_plane.last_heartbeats().await;
        let applied = self.control_plane.shared.read();
        let nodes = applied
            .pool
            .nodes
            .keys()
            .filter_map(|name| {
                let mut node = applied.pool.node_to_proto(name)?;
                node.last_heartbeat_unix_ms = heartbeats.get(name).copied().unwrap_or(0);
                Some(node)
            })
            .collect();
        Ok(Response::new(v1::ListNodesResponse { nodes }))
    }

    async fn drain(
        &self,
        request: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        self.set_state(
            request.into_inner().node,
            placement::NodeState::Draining,
            "drained by an operator",
        )
        .await
    }

    async fn uncordon(
        &self,
        request: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        self.set_state(
            request.into_inner().node,
            placement::NodeState::Ready,
            "made schedulable by an operator",
        )
        .await
    }
}

impl Service {
    async fn set_state(
        &self,
        node: String,
        state: placement::NodeState,
        reason: &str,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        api::names::validate("node", &node).map_err(invalid)?;
        let command = Command::SetNodeState {
            node: node.clone(),
            state,
            reason: reason.to_owned(),
            unix_ms: unix_ms(),
        };
        result_to_unit(self.control_plane.write(command).await?)?;
        Ok(Response::new(v1::DrainResponse {
            node: Some(self.node(&node).await?),
        }))
    }
}

#[tonic::async_trait]
impl v1::agent_server::Agent for Service {
    async fn register(
        &self,
        request: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        let node = request
            .into_inner()
            .node
            .ok_or_else(|| invalid("the node is missing"))?;
        let spec = node_spec_from_proto(&node);
        validate_node_spec(&spec).map_err(invalid)?;
        let command = Command::RegisterNode {
            spec,
            address: node.address,
            unix_ms: unix_ms(),
        };
        result_to_unit(self.control_plane.write(command).await?)?;
        self.control_plane.heartbeat(&node.name).await?;
        let interval = self.control_plane.timings.heartbeat_interval.as_millis() as u32;
        Ok(Response::new(v1::RegisterResponse {
            heartbeat_interval_ms: interval,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        let node = request.into_inner().node;
        api::names::validate("node", &node).map_err(invalid)?;
        let known = self.control_plane.heartbeat(&node).await?;
        Ok(Response::new(v1::HeartbeatResponse { known }))
    }

    type WatchAssignmentsStream = ReceiverStream<Result<v1::Assignments, Status>>;

    async fn watch_assignments(
        &self,
        request: Request<v1::WatchAssignmentsRequest>,
    ) -> Result<Response<Self::WatchAssignmentsStream>, Status> {
        let node = request.into_inner().node;
        api::names::validate("node", &node).map_err(invalid)?;
        if !self
            .control_plane
            .shared
            .read()
            .pool
            .nodes
            .contains_key(&node)
        {
            return Err(ErrorCode::NodeNotFound.status(format!(
                "node `{node}` is not registered; register it first"
            )));
        }
        let (sender, receiver) = tokio::sync::mpsc::channel(WATCH_BUFFER_MAX);
        let shared = self.control_plane.shared.clone();
        tokio::spawn(async move {
            let mut applied_index = shared.applied_index.subscribe();
            let mut last_sent: Option<u64> = None;
            loop {
                let message = {
                    let applied = shared.read();
                    let (revision, assignments) = applied.pool.assignments(&node);
                    let state = applied.pool.engine.node(&node).map(|view| view.state);
                    (last_sent != Some(revision)).then(|| v1::Assignments {
                        revision,
                        assignments,
                        node_state: state
                            .map_or(v1::NodeState::Unspecified, crate::pool::node_state_to_proto)
                            as i32,
                    })
                };
                if let Some(message) = message {
                    last_sent = Some(message.revision);
                    if sender.send(Ok(message)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = applied_index.changed() => if changed.is_err() { return },
                    () = sender.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}

#[tonic::async_trait]
impl v1::cluster_server::Cluster for Service {
    async fn status(
        &self,
        _: Request<v1::ClusterStatusRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        Ok(Response::new(self.status()))
    }

    async fn add_member(
        &self,
        request: Request<v1::AddMemberRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        let request = request.into_inner();
        if request.id == 0 {
            return Err(invalid("member ids start at 1"));
        }
        if request.address.parse::<std::net::SocketAddr>().is_err()
            && !request.address.contains(':')
        {
            return Err(invalid(format!(
                "`{}` is not a HOST:PORT address",
                request.address
            )));
        }
        self.control_plane
            .add_member(request.id, request.address)
            .await?;
        Ok(Response::new(self.status()))
    }

    async fn remove_member(
        &self,
        request: Request<v1::RemoveMemberRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        self.control_plane
            .remove_member(request.into_inner().id)
            .await?;
        Ok(Response::new(self.status()))
    }
}

fn reply<T: serde::Serialize>(
    value: &T,
    cluster_id: &str,
) -> Result<Response<RaftPayload>, Status> {
    let data = encode(value).map_err(|e| ErrorCode::Internal.status(e))?;
    Ok(Response::new(RaftPayload {
        data,
        cluster_id: cluster_id.to_owned(),
    }))
}

fn undecodable(error: impl std::fmt::Display) -> Status {
    invalid(format!("undecodable peer message: {error}"))
}

#[tonic::async_trait]
impl v1::raft_server::Raft for Service {
    async fn append_entries(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let raft = &self.control_plane.raft;
        self.peer_call(request, |message| raft.append_entries(message))
            .await
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let raft = &self.control_plane.raft;
        self.peer_call(request, |message| raft.vote(message)).await
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let raft = &self.control_plane.raft;
        self.peer_call(request, |message| raft.install_snapshot(message))
            .await
    }

    async fn forward(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let control_plane = &self.control_plane;
        self.peer_call(request, |message: ForwardRequest| {
            control_plane.handle_forwarded(message)
        })
        .await
    }
}

impl Service {
    /// One peer-to-peer call: refuse other clusters, decode the message, handle it, encode the
    /// answer.
    async fn peer_call<Message, Answer, Handling>(
        &self,
        request: Request<RaftPayload>,
        handle: impl FnOnce(Message) -> Handling,
    ) -> Result<Response<RaftPayload>, Status>
    where
        Message: serde::de::DeserializeOwned,
        Answer: serde::Serialize,
        Handling: std::future::Future<Output = Answer>,
    {
        let payload = request.into_inner();
        self.check_cluster(&payload.cluster_id)?;
        let message = decode(&payload.data).map_err(undecodable)?;
        let answer = handle(message).await;
        reply(&answer, &self.control_plane.cluster_id)
    }
}
