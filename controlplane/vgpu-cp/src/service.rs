//! The gRPC services (`vgpu.v1.Pool`, `Agent`, `Cluster`, `Raft`) over one [`ControlPlane`].
//!
//! Handlers check the caller's role (`security::Guard`) and validate input before anything
//! reaches the log, so a refused or bad request gets a clear message and changes nothing.

use crate::control_plane::{ControlPlane, ForwardRequest, unix_ms};
use crate::pool::{
    Command, CommandResult, host_capacity_from_proto, node_spec_from_proto, validate_host_capacity,
    validate_node_spec,
};
use crate::raft_types::{decode, encode};
use crate::security::{Guard, TOKEN_TTL_MAX_SECONDS, TenantScope, denied};
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
    pub guard: Arc<Guard>,
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
        CommandResult::Done
        | CommandResult::Batch(_)
        | CommandResult::Revoked { .. }
        | CommandResult::Registered { .. } => {
            Err(ErrorCode::Internal.status("the write returned no tenant"))
        }
    }
}

/// Keeps only the usage a node may report: its own tenants' on itself (issue 22: an agent could
/// report usage for tenants of other nodes). A tenant released meanwhile loses its last report,
/// which is what its release does anyway.
fn own_usage_only(shared: &crate::store::Shared, request: &mut v1::HeartbeatRequest) {
    if request.usage.is_empty() {
        return;
    }
    let applied = shared.read();
    let node = request.node.as_str();
    let before = request.usage.len();
    request.usage.retain(|usage| {
        usage.node == node
            && applied
                .pool
                .tenants
                .get(&usage.tenant)
                .is_some_and(|tenant| tenant.slices.iter().any(|slice| slice.node == node))
    });
    if request.usage.len() < before {
        tracing::debug!(
            node,
            dropped = before - request.usage.len(),
            "dropped usage reported for tenants not on the reporting node"
        );
    }
}

/// What a call for a node says about the agent making it (`api::metadata`): the SHA-256 of its
/// node key (`None`: an agent without a key) and, for a beat, the registration it is for.
struct NodeClaim {
    key_sha256: Option<String>,
    registration: Option<u64>,
}

impl NodeClaim {
    /// Reads the claim of `request`, refusing malformed metadata (`INVALID_ARGUMENT`). A beat
    /// always names a registration: one without the metadata names none (0).
    fn of<T>(request: &Request<T>, beat: bool) -> Result<NodeClaim, Status> {
        let metadata = request.metadata();
        let key = api::metadata::node_key(metadata).map_err(invalid)?;
        let registration = if beat {
            Some(
                api::metadata::registration(metadata)
                    .map_err(invalid)?
                    .unwrap_or(0),
            )
        } else {
            None
        };
        Ok(NodeClaim {
            key_sha256: key.map(api::metadata::node_key_sha256),
            registration,
        })
    }
}

/// A write a tenant certificate asked for carries its owner into the log (`Command::AsOwner`):
/// applying it checks the owner again on the state it meets. Admins' writes go as they are.
fn as_owner(scope: &TenantScope, command: Command) -> Command {
    match scope {
        TenantScope::All => command,
        TenantScope::Owner(owner) => Command::AsOwner {
            owner: owner.clone(),
            command: Box::new(command),
        },
    }
}

/// Checks a joining member's address before anything is proposed: HOST:PORT with a port of
/// 1..=65535 and a host of DNS-name characters (or an IP literal), at most
/// `api::validate::NODE_ADDRESS_TEXT_MAX` long. A bad one was added as a learner before, which
/// the leader then tried to reach for good.
pub fn check_member_address(address: &str) -> Result<(), String> {
    let quoted = api::validate::excerpt(address, 64);
    let bad = || {
        format!("`{quoted}` is not a HOST:PORT address (`cp4.example.net:7401`, `10.0.0.4:7401`)")
    };
    if address.len() > api::validate::NODE_ADDRESS_TEXT_MAX {
        return Err(bad());
    }
    if address.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
    let port_ok = port.parse::<u16>().is_ok_and(|port| port > 0);
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
    if !(port_ok && host_ok) {
        return Err(bad());
    }
    Ok(())
}

/// Most items in one page of a list, and about the most bytes (a page stops after the item
/// that passes it; one item is at most a registration, `api::validate::REGISTER_BYTES_MAX`, plus
/// what the control plane adds), so a page stays far below any client's message limit.
pub const PAGE_ITEMS_MAX: usize = 1000;
pub const PAGE_BYTES_MAX: usize = 1 << 20;

/// Where a page starts: after the name in `token` (empty: at the first).
/// The first page of a list, asked with the caller's metadata and extensions (its certificate):
/// what the unpaged `ListTenants`/`ListNodes` return.
fn first_page(request: &Request<v1::ListRequest>) -> Request<v1::ListPageRequest> {
    Request::from_parts(
        request.metadata().clone(),
        request.extensions().clone(),
        v1::ListPageRequest {
            stale: request.get_ref().stale,
            page_token: String::new(),
        },
    )
}

fn page_start(token: &str) -> Result<std::ops::Bound<&str>, Status> {
    if token.is_empty() {
        return Ok(std::ops::Bound::Unbounded);
    }
    if token.len() > api::names::NAME_LENGTH_MAX {
        return Err(invalid(
            "the page token is not one this control plane gave; list again from the first page",
        ));
    }
    Ok(std::ops::Bound::Excluded(token))
}

/// Takes one page of `items` (in name order): up to [`PAGE_ITEMS_MAX`] items and about
/// [`PAGE_BYTES_MAX`] bytes. The token is the page's last name when more items follow.
fn page<T: Message>(
    items: impl Iterator<Item = T>,
    name: impl Fn(&T) -> &String,
) -> (Vec<T>, String) {
    let mut items = items.peekable();
    let mut taken = Vec::new();
    let mut bytes = 0;
    while let Some(item) = items.next_if(|_| taken.len() < PAGE_ITEMS_MAX && bytes < PAGE_BYTES_MAX)
    {
        bytes += item.encoded_len();
        taken.push(item);
    }
    let token = match (items.peek(), taken.last()) {
        (Some(_), Some(last)) => name(last).clone(),
        _ => String::new(),
    };
    assert!(taken.len() <= PAGE_ITEMS_MAX, "pages are bounded");
    (taken, token)
}

fn result_to_unit(result: CommandResult) -> Result<(), Status> {
    match result {
        CommandResult::Failed { code, message } => Err(code.status(message)),
        _ => Ok(()),
    }
}

impl Service {
    /// Holds one tenant owner's writes to its rate (`crate::limits`); admins are not limited.
    fn limit_owner(&self, scope: &TenantScope) -> Result<(), Status> {
        let TenantScope::Owner(owner) = scope else {
            return Ok(());
        };
        let taken = self
            .control_plane
            .owner_writes
            .lock()
            .expect("owner limits lock")
            .take(owner, std::time::Instant::now());
        taken.map_err(|wait| {
            ErrorCode::Unavailable.status(format!(
                "owner `{owner}` writes faster than {} a second through this member; slow down (retry in {} ms)",
                crate::limits::OWNER_WRITES_PER_SECOND,
                wait.as_millis().max(1)
            ))
        })
    }

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
        let reports = self
            .control_plane
            .reports(crate::usage::Filter::Node(name.to_owned()))
            .await;
        crate::usage::attach_health(&mut node, reports.get(name));
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
        let facts = self.control_plane.replication.facts();
        let members = facts
            .members
            .into_iter()
            .map(|member| v1::Member {
                id: member.id,
                address: member.address,
                voter: member.voter,
                matched_index: member.matched_index,
            })
            .collect();
        v1::ClusterStatus {
            leader: facts.leader,
            term: facts.term,
            members,
            responder: self.control_plane.id,
            last_log_index: facts.last_log_index,
            last_applied: facts.last_applied,
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
        if let Some(pin) = request
            .get_ref()
            .request
            .as_ref()
            .and_then(|placement| placement.pin.as_ref())
        {
            let node = pin.node.clone();
            return self.place_pinned(request, &node).await;
        }
        let (peer, scope) = self.guard.tenants(&request, "placing tenants")?;
        self.limit_owner(&scope)?;
        let request = request.into_inner();
        api::names::validate("tenant", &request.name).map_err(invalid)?;
        let mut placement = request
            .request
            .ok_or_else(|| invalid("the placement request is missing"))?;
        api::validate::admit_request(&placement).map_err(invalid)?;
        let largest_gpu_bytes = self
            .control_plane
            .shared
            .read()
            .pool
            .largest_gpu_memory_bytes();
        placement::memory::check_limit(placement.memory_limit_bytes_per_gpu, largest_gpu_bytes)
            .map_err(invalid)?;
        self.guard
            .check_priority(&peer, &scope, placement.priority)?;
        if let TenantScope::Owner(owner) = &scope {
            if !placement.owner.is_empty() && placement.owner != *owner {
                return Err(denied(
                    &peer,
                    &format!("placing tenants for owner `{}`", placement.owner),
                ));
            }
            placement.owner = owner.clone();
            self.check_owner(&peer, &scope, &request.name, "replacing")?;
        }
        if !placement.owner.is_empty() {
            api::names::validate("owner", &placement.owner).map_err(invalid)?;
        }
        let constrained = placement.cpu_milli > 0
            || placement.host_memory_bytes > 0
            || !placement.gpu_models.is_empty();
        let (name, request, unix_ms) = (request.name, placement.encode_to_vec(), unix_ms());
        let place = if constrained {
            Command::PlaceConstrained {
                name,
                request,
                unix_ms,
            }
        } else {
            Command::Place {
                name,
                request,
                unix_ms,
            }
        };
        let command = as_owner(&scope, place);
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
        if !self.guard.insecure && self.guard.caller(&request)?.role == api::tls::Role::Agent {
            return self.release_pinned(request).await;
        }
        let (peer, scope) = self.guard.tenants(&request, "releasing tenants")?;
        self.limit_owner(&scope)?;
        let name = request.into_inner().name;
        api::names::validate("tenant", &name).map_err(invalid)?;
        if scope != TenantScope::All {
            // Up to date, so that the owner checked is the owner the release would meet.
            self.control_plane.linearize().await?;
            self.check_owner(&peer, &scope, &name, "releasing")?;
        }
        let command = as_owner(
            &scope,
            Command::Release {
                name,
                unix_ms: unix_ms(),
            },
        );
        result_to_unit(self.control_plane.write(command).await?)?;
        Ok(Response::new(v1::ReleaseResponse {}))
    }

    async fn set_tenant(
        &self,
        request: Request<v1::SetTenantRequest>,
    ) -> Result<Response<v1::SetTenantResponse>, Status> {
        let (peer, scope) = self.guard.tenants(&request, "changing tenants")?;
        self.limit_owner(&scope)?;
        let change = request.into_inner();
        api::names::validate("tenant", &change.name).map_err(invalid)?;
        api::validate::validate_change(&change).map_err(invalid)?;
        if let Some(priority) = change.priority {
            self.guard.check_priority(&peer, &scope, priority)?;
        }
        let owner = match &scope {
            TenantScope::All => None,
            TenantScope::Owner(owner) => {
                // Up to date, so that the owner checked is the owner the change would meet; the
                // change carries the owner too, and applying it checks again.
                self.control_plane.linearize().await?;
                self.check_owner(&peer, &scope, &change.name, "changing")?;
                Some(owner.clone())
            }
        };
        let command = Command::SetTenant {
            name: change.name,
            compute_percent: change.compute_percent,
            priority: change.priority,
            latency_target_us: change.latency_target_us,
            owner,
            unix_ms: unix_ms(),
        };
        let result = self.control_plane.write(command).await?;
        let tenant = result_to_tenant(result, self)?;
        Ok(Response::new(v1::SetTenantResponse {
            tenant: Some(tenant),
        }))
    }

    async fn get_tenant(
        &self,
        request: Request<v1::GetTenantRequest>,
    ) -> Result<Response<v1::Tenant>, Status> {
        let (peer, scope) = self.guard.tenants(&request, "reading tenants")?;
        let request = request.into_inner();
        api::names::validate("tenant", &request.name).map_err(invalid)?;
        self.read_prepare(request.stale).await?;
        self.check_owner(&peer, &scope, &request.name, "reading")?;
        let mut tenant = {
            let applied = self.control_plane.shared.read();
            let record = applied.pool.tenants.get(&request.name).ok_or_else(|| {
                ErrorCode::TenantNotFound.status(format!(
                    "no tenant is named `{}`; `vgpuctl get tenants` lists them",
                    request.name
                ))
            })?;
            applied.pool.tenant_to_proto(record)
        };
        let reports = self
            .control_plane
            .reports(crate::usage::Filter::Tenant(request.name.clone()))
            .await;
        tenant.usage = reports
            .into_values()
            .flat_map(|report| report.usage)
            .collect();
        Ok(Response::new(tenant))
    }

    async fn list_tenants(
        &self,
        request: Request<v1::ListRequest>,
    ) -> Result<Response<v1::ListTenantsResponse>, Status> {
        self.list_tenants_page(first_page(&request)).await
    }

    async fn list_tenants_page(
        &self,
        request: Request<v1::ListPageRequest>,
    ) -> Result<Response<v1::ListTenantsResponse>, Status> {
        let (_, scope) = self.guard.tenants(&request, "listing tenants")?;
        let request = request.into_inner();
        let after = page_start(&request.page_token)?;
        self.read_prepare(request.stale).await?;
        let applied = self.control_plane.shared.read();
        let tenants = applied
            .pool
            .tenants
            .range::<str, _>((after, std::ops::Bound::Unbounded))
            .map(|(_, record)| applied.pool.tenant_to_proto(record))
            .filter(|tenant| scope.covers(&tenant.owner));
        let (tenants, next_page_token) = page(tenants, |tenant| &tenant.name);
        Ok(Response::new(v1::ListTenantsResponse {
            tenants,
            next_page_token,
        }))
    }

    async fn get_node(
        &self,
        request: Request<v1::GetNodeRequest>,
    ) -> Result<Response<v1::Node>, Status> {
        self.guard.admin(&request, "reading nodes")?;
        let request = request.into_inner();
        api::names::validate("node", &request.name).map_err(invalid)?;
        self.read_prepare(request.stale).await?;
        Ok(Response::new(self.node(&request.name).await?))
    }

    async fn list_nodes(
        &self,
        request: Request<v1::ListRequest>,
    ) -> Result<Response<v1::ListNodesResponse>, Status> {
        self.list_nodes_page(first_page(&request)).await
    }

    async fn list_nodes_page(
        &self,
        request: Request<v1::ListPageRequest>,
    ) -> Result<Response<v1::ListNodesResponse>, Status> {
        self.guard.admin(&request, "listing nodes")?;
        let request = request.into_inner();
        let after = page_start(&request.page_token)?;
        self.read_prepare(request.stale).await?;
        let heartbeats = self.control_plane.last_heartbeats().await;
        let reports = self.control_plane.reports(crate::usage::Filter::All).await;
        let applied = self.control_plane.shared.read();
        let nodes = applied
            .pool
            .nodes
            .range::<str, _>((after, std::ops::Bound::Unbounded))
            .filter_map(|(name, _)| {
                let mut node = applied.pool.node_to_proto(name)?;
                node.last_heartbeat_unix_ms = heartbeats.get(name).copied().unwrap_or(0);
                crate::usage::attach_health(&mut node, reports.get(name));
                Some(node)
            });
        let (nodes, next_page_token) = page(nodes, |node| &node.name);
        Ok(Response::new(v1::ListNodesResponse {
            nodes,
            next_page_token,
        }))
    }

    async fn remove_node(
        &self,
        request: Request<v1::RemoveNodeRequest>,
    ) -> Result<Response<v1::RemoveNodeResponse>, Status> {
        self.guard.admin(&request, "removing nodes")?;
        let node = request.into_inner().node;
        api::names::validate("node", &node).map_err(invalid)?;
        let command = Command::RemoveNode {
            node: node.clone(),
            unix_ms: unix_ms(),
        };
        result_to_unit(self.control_plane.write(command).await?)?;
        tracing::warn!(%node, "an admin removed the node");
        Ok(Response::new(v1::RemoveNodeResponse {}))
    }

    async fn drain(
        &self,
        request: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        self.guard.admin(&request, "draining nodes")?;
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
        self.guard.admin(&request, "uncordoning nodes")?;
        self.set_state(
            request.into_inner().node,
            placement::NodeState::Ready,
            "made schedulable by an operator",
        )
        .await
    }
}

impl Service {
    /// `Pool.Place` of a request with a pin on `node` (issue 18): only that node's agent
    /// certificate may ask (`Guard::pin`), with the node's key where its name is bound to one
    /// (`vgpu-node-key` metadata, as for beats), for a tenant named after the claim its owner names
    /// (`api::validate::admit_claim_tenant`), within the request bounds
    /// (`api::validate::admit_request`). Proposed as `Command::PlacePinned`; the engine binds the
    /// pin or refuses it, and the same request again is answered with the tenant (the driver
    /// retries by repeating it).
    async fn place_pinned(
        &self,
        request: Request<v1::PlaceRequest>,
        node: &str,
    ) -> Result<Response<v1::PlaceResponse>, Status> {
        self.guard.pin(&request, node)?;
        // A node name bound to a node key (issue 22) takes pins only from the agent holding
        // that key, as it takes beats and watches: a second machine with the same name and a
        // certificate of its own (a clone) must not place on the first one's GPUs.
        let claim = NodeClaim::of(&request, false)?;
        self.check_node_claim(node, &claim).await?;
        let request = request.into_inner();
        api::names::validate("tenant", &request.name).map_err(invalid)?;
        let placement = request
            .request
            .ok_or_else(|| invalid("the placement request is missing"))?;
        api::validate::admit_request(&placement).map_err(invalid)?;
        api::validate::admit_claim_tenant(&request.name, &placement).map_err(invalid)?;
        assert!(placement.pin.is_some(), "only pinned requests come here");
        let command = Command::PlacePinned {
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

    /// `Pool.Release` by an agent certificate (issue 18): only a tenant pinned to the agent's
    /// node (`PoolState::pinned_release_owner`), proposed as the tenant's owner
    /// (`Command::AsOwner`), so that apply refuses it if the name meanwhile holds another
    /// claim's tenant.
    async fn release_pinned(
        &self,
        request: Request<v1::ReleaseRequest>,
    ) -> Result<Response<v1::ReleaseResponse>, Status> {
        let peer = self.guard.caller(&request)?;
        assert_eq!(peer.role, api::tls::Role::Agent, "only agents come here");
        let claim = NodeClaim::of(&request, false)?;
        self.check_node_claim(&peer.name, &claim).await?;
        let name = request.into_inner().name;
        api::names::validate("tenant", &name).map_err(invalid)?;
        // Up to date, so that the pin checked is the one the release would meet.
        self.control_plane.linearize().await?;
        let owner = self
            .control_plane
            .shared
            .read()
            .pool
            .pinned_release_owner(&peer.name, &name)
            .map_err(|(code, message)| code.status(message))?;
        let command = Command::AsOwner {
            owner,
            command: Box::new(Command::Release {
                name,
                unix_ms: unix_ms(),
            }),
        };
        result_to_unit(self.control_plane.write(command).await?)?;
        Ok(Response::new(v1::ReleaseResponse {}))
    }

    /// Refuses a tenant-scoped caller `what`ing the tenant `name` when it exists under another
    /// owner (a tenant that does not exist is left to the call's own answer).
    fn check_owner(
        &self,
        peer: &api::tls::Peer,
        scope: &TenantScope,
        name: &str,
        what: &str,
    ) -> Result<(), Status> {
        if *scope == TenantScope::All {
            return Ok(());
        }
        let applied = self.control_plane.shared.read();
        match applied.pool.tenants.get(name) {
            Some(record) => {
                let owner = crate::pool::decode_request(&record.request).owner;
                if scope.covers(&owner) {
                    Ok(())
                } else {
                    Err(denied(
                        peer,
                        &format!("{what} tenant `{name}`, which another owner holds"),
                    ))
                }
            }
            None => Ok(()),
        }
    }

    /// Refuses a call for `node` whose claim does not hold the name (`PoolState::check_node_claim`)
    /// with `[VGPU-NODE-NAME-TAKEN]`. A mismatch is judged again after a linearizable read
    /// before it is refused: this member may not have applied the registration the agent just
    /// made through another member (a refusal stops the agent for good).
    async fn check_node_claim(&self, node: &str, claim: &NodeClaim) -> Result<(), Status> {
        let check = || {
            self.control_plane.shared.read().pool.check_node_claim(
                node,
                claim.key_sha256.as_deref(),
                claim.registration,
            )
        };
        if check().is_ok() {
            return Ok(());
        }
        self.control_plane.linearize().await?;
        check().map_err(|crate::pool::NameTaken(message)| {
            tracing::warn!(%node, %message, "refused a call for a node whose name another registration holds");
            ErrorCode::NodeNameTaken.status(message)
        })
    }

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
        let name = request
            .get_ref()
            .node
            .as_ref()
            .map(|node| node.name.clone())
            .unwrap_or_default();
        self.guard.agent(&request, &name, "registering nodes")?;
        let claim = NodeClaim::of(&request, false)?;
        api::validate::admit_node(request.get_ref().node.as_ref()).map_err(invalid)?;
        let node = request
            .into_inner()
            .node
            .ok_or_else(|| invalid("the node is missing"))?;
        let spec = node_spec_from_proto(&node);
        validate_node_spec(&spec).map_err(invalid)?;
        let host = host_capacity_from_proto(&node);
        validate_host_capacity(&spec.name, &host).map_err(invalid)?;
        // Whether the name is free for this key is decided where the registration is applied,
        // so that of two racing registrations only the first binds it. A node that reports no
        // host capacity registers with the entries members of earlier versions read.
        let command = match claim.key_sha256 {
            // Only a Kubernetes-managed node registers with the entry this version introduced.
            key_sha256 if node.kubernetes_managed => Command::RegisterKubernetesNode {
                spec,
                host,
                address: node.address,
                key_sha256,
                unix_ms: unix_ms(),
            },
            key_sha256 if host != placement::HostCapacity::default() => Command::RegisterHostNode {
                spec,
                host,
                address: node.address,
                key_sha256,
                unix_ms: unix_ms(),
            },
            Some(key_sha256) => Command::RegisterKeyedNode {
                spec,
                address: node.address,
                key_sha256,
                unix_ms: unix_ms(),
            },
            None => Command::RegisterNode {
                spec,
                address: node.address,
                unix_ms: unix_ms(),
            },
        };
        let registration = match self.control_plane.write(command).await? {
            CommandResult::Registered { registration } => Some(registration),
            CommandResult::Failed { code, message } => return Err(code.status(message)),
            _ => None,
        };
        self.control_plane.heartbeat(&node.name).await?;
        let interval = self.control_plane.timings.heartbeat_interval.as_millis() as u32;
        let mut response = Response::new(v1::RegisterResponse {
            heartbeat_interval_ms: interval,
        });
        if let Some(registration) = registration {
            response
                .metadata_mut()
                .insert(api::metadata::REGISTRATION, registration.into());
        }
        Ok(response)
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        self.guard
            .agent(&request, &request.get_ref().node, "heartbeats")?;
        let started = std::time::Instant::now();
        let claim = NodeClaim::of(&request, true)?;
        let mut request = request.into_inner();
        api::names::validate("node", &request.node).map_err(invalid)?;
        self.check_node_claim(&request.node, &claim).await?;
        own_usage_only(&self.control_plane.shared, &mut request);
        let answer = self.control_plane.heartbeat_report(request).await?;
        self.control_plane
            .metrics
            .observe_heartbeat(started.elapsed(), self.control_plane.is_leader());
        Ok(Response::new(v1::HeartbeatResponse {
            known: answer.known,
            report_wanted: answer.report_wanted,
        }))
    }

    async fn join_node(
        &self,
        request: Request<v1::JoinNodeRequest>,
    ) -> Result<Response<v1::JoinNodeResponse>, Status> {
        // No certificate needed: the token is the credential.
        let request = request.into_inner();
        api::names::validate("node", &request.node).map_err(invalid)?;
        if request.csr_pem.len() > api::validate::CSR_PEM_TEXT_MAX {
            return Err(invalid(format!(
                "the certificate signing request is {} bytes; the limit is {}",
                request.csr_pem.len(),
                api::validate::CSR_PEM_TEXT_MAX
            )));
        }
        if self.guard.insecure {
            return Err(invalid(
                "this member runs with --insecure: agents join without a token (pass --insecure to vgpu-agent)",
            ));
        }
        if !api::pki::is_token_shaped(&request.token) {
            return Err(ErrorCode::TokenInvalid.status(
                "the bootstrap token is malformed (it looks like `abcdef.0123456789abcdef`); copy it from `vgpu-cp token create`",
            ));
        }
        let (Some(ca), Some(ca_cert_pem)) = (&self.guard.ca_signer, &self.guard.ca_cert_pem) else {
            return Err(ErrorCode::Unavailable.status(
                "this member holds no CA key (tls_ca_key), so it cannot sign certificates; join through a member that does",
            ));
        };
        // A token this member knows, unexpired, is good (tokens are never withdrawn, only
        // expire): no read. Only an unknown one costs a linearizable read (it may be newer than
        // this member's state), and those are rate-limited, so that unauthenticated calls cannot
        // load the leader.
        let hash = api::pki::token_hash(&request.token);
        let now = unix_ms();
        let known = self.control_plane.shared.read().pool.token_expiry(&hash);
        if known.is_none_or(|expires| expires <= now) {
            let taken = self
                .control_plane
                .join_reads
                .lock()
                .expect("join limit lock")
                .take(std::time::Instant::now());
            if taken.is_err() {
                return Err(ErrorCode::Unavailable.status(
                    "too many joins with unknown bootstrap tokens reach this member; retry in a second",
                ));
            }
            self.control_plane.linearize().await?;
        }
        let expiry = self.control_plane.shared.read().pool.token_expiry(&hash);
        match expiry {
            None => {
                return Err(ErrorCode::TokenInvalid.status(
                    "the bootstrap token is unknown to the cluster; create one with `vgpu-cp token create --ttl 1h` (as an admin)",
                ));
            }
            Some(expires) if expires <= now => {
                return Err(ErrorCode::TokenInvalid.status(format!(
                    "the bootstrap token expired {} s ago; create a new one with `vgpu-cp token create --ttl 1h` (as an admin)",
                    (now - expires) / 1000
                )));
            }
            Some(_) => {}
        }
        let subject = api::pki::Subject {
            name: request.node.clone(),
            role: api::tls::Role::Agent,
            hosts: Vec::new(),
        };
        let certificate_pem =
            api::pki::sign_csr(ca, &request.csr_pem, &subject, api::pki::CERT_DAYS_DEFAULT)
                .map_err(invalid)?;
        tracing::info!(node = %request.node, "issued an agent certificate for a bootstrap token");
        Ok(Response::new(v1::JoinNodeResponse {
            certificate_pem,
            ca_certificate_pem: ca_cert_pem.clone(),
        }))
    }

    type WatchAssignmentsStream = ReceiverStream<Result<v1::Assignments, Status>>;

    async fn watch_assignments(
        &self,
        request: Request<v1::WatchAssignmentsRequest>,
    ) -> Result<Response<Self::WatchAssignmentsStream>, Status> {
        let peer = self
            .guard
            .agent(&request, &request.get_ref().node, "watching assignments")?;
        let claim = NodeClaim::of(&request, false)?;
        let node = request.into_inner().node;
        api::names::validate("node", &node).map_err(invalid)?;
        self.check_node_claim(&node, &claim).await?;
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
        let guard = self.guard.clone();
        tokio::spawn(async move {
            // Subscribed before the first read, so no change after it is missed.
            let mut changes = crate::watchers::subscribe(&shared, &node);
            let mut last_sent: Option<u64> = None;
            loop {
                // A stream lives only as long as its caller's certificate: a revocation applied
                // here wakes it (`watchers`) and closes it with the reason.
                if let Some(at) = guard.revoked.revoked_at(&peer.serial) {
                    let refusal = ErrorCode::PermissionDenied.status(format!(
                        "the certificate of `{}` (role {}, serial {}) was revoked at unix ms {at}; this stream is closed; ask an admin for a new certificate (`vgpu-cp cert issue`)",
                        peer.name, peer.role, peer.serial
                    ));
                    // Never waits: with the buffer full, dropping the sender ends the stream.
                    let _ = sender.try_send(Err(refusal));
                    return;
                }
                let message = {
                    let applied = shared.read();
                    // Every applied entry wakes every watcher: look at the node's revision
                    // first, and build the (tenant-scanning) message only when it moved.
                    let revision = applied.pool.node_revisions.get(&node).copied().unwrap_or(0);
                    (last_sent != Some(revision)).then(|| {
                        let (revision, assignments) = applied.pool.assignments(&node);
                        let state = applied.pool.engine.node(&node).map(|view| view.state);
                        v1::Assignments {
                            revision,
                            assignments,
                            node_state: state.map_or(
                                v1::NodeState::Unspecified,
                                crate::pool::node_state_to_proto,
                            ) as i32,
                        }
                    })
                };
                if let Some(message) = message {
                    last_sent = Some(message.revision);
                    if sender.send(Ok(message)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = changes.changed() => if !changed { return },
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
        request: Request<v1::ClusterStatusRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        // Any authenticated caller: clients use it to find a live member, so a member whose
        // Raft core stopped says so instead of answering as if healthy.
        self.guard.caller(&request)?;
        self.control_plane
            .health()
            .map_err(|problem| ErrorCode::Unavailable.status(problem))?;
        Ok(Response::new(self.status()))
    }

    async fn add_member(
        &self,
        request: Request<v1::AddMemberRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        self.guard.member(&request, "adding members")?;
        let request = request.into_inner();
        if request.id == 0 {
            return Err(invalid("member ids start at 1"));
        }
        check_member_address(&request.address).map_err(invalid)?;
        self.control_plane
            .add_member(request.id, request.address)
            .await?;
        Ok(Response::new(self.status()))
    }

    async fn remove_member(
        &self,
        request: Request<v1::RemoveMemberRequest>,
    ) -> Result<Response<v1::ClusterStatus>, Status> {
        self.guard.admin(&request, "removing members")?;
        self.control_plane
            .remove_member(request.into_inner().id)
            .await?;
        Ok(Response::new(self.status()))
    }

    async fn revoke_certificate(
        &self,
        request: Request<v1::RevokeCertificateRequest>,
    ) -> Result<Response<v1::RevokeCertificateResponse>, Status> {
        self.guard.admin(&request, "revoking certificates")?;
        let text = request.into_inner().serial;
        let serial = (text.len() <= api::validate::SERIAL_TEXT_MAX)
            .then(|| api::tls::normalize_serial(&text))
            .flatten();
        let Some(serial) = serial else {
            return Err(invalid(format!(
                "`{}` is not a certificate serial; give its hex digits (`vgpu-cp cert serial --cert FILE` prints them)",
                api::validate::excerpt(&text, 64)
            )));
        };
        let command = Command::RevokeCertificate {
            serial,
            unix_ms: unix_ms(),
        };
        match self.control_plane.write(command).await? {
            CommandResult::Revoked { newly, total } => {
                Ok(Response::new(v1::RevokeCertificateResponse {
                    newly_revoked: newly,
                    revoked_total: total,
                }))
            }
            CommandResult::Failed { code, message } => Err(code.status(message)),
            _ => Err(ErrorCode::Internal.status("the revocation returned no result")),
        }
    }

    async fn create_join_token(
        &self,
        request: Request<v1::CreateJoinTokenRequest>,
    ) -> Result<Response<v1::CreateJoinTokenResponse>, Status> {
        self.guard.admin(&request, "creating bootstrap tokens")?;
        let ttl_seconds = request.into_inner().ttl_seconds;
        if ttl_seconds == 0 || ttl_seconds > TOKEN_TTL_MAX_SECONDS {
            return Err(invalid(format!(
                "a token lifetime of {ttl_seconds} s is out of range; give 1 s to {TOKEN_TTL_MAX_SECONDS} s (`--ttl 1h`)"
            )));
        }
        let Some(ca_cert_pem) = &self.guard.ca_cert_pem else {
            return Err(ErrorCode::InvalidArgument.status(
                "this member runs with --insecure: there is no cluster CA, and agents join without tokens",
            ));
        };
        let ca_cert_hash = api::pki::ca_cert_hash(ca_cert_pem)
            .map_err(|error| ErrorCode::Internal.status(error))?;
        let token = api::pki::new_token();
        let now = unix_ms();
        let expires_unix_ms = now.saturating_add(ttl_seconds as i64 * 1000);
        let command = Command::CreateToken {
            hash: api::pki::token_hash(&token),
            expires_unix_ms,
            unix_ms: now,
        };
        result_to_unit(self.control_plane.write(command).await?)?;
        Ok(Response::new(v1::CreateJoinTokenResponse {
            token,
            expires_unix_ms,
            ca_cert_hash,
        }))
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
        let raft = self.raft()?;
        self.peer_call(request, |message| raft.append_entries(message))
            .await
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let raft = self.raft()?;
        self.peer_call(request, |message| raft.vote(message)).await
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let raft = self.raft()?;
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
    /// The Raft handle for a Raft peer call; a member on the etcd store has none.
    fn raft(&self) -> Result<&crate::raft_types::Raft, Status> {
        self.control_plane.raft().ok_or_else(|| {
            ErrorCode::Membership.status(
                "this member keeps the pool's state in etcd, not in a Raft group; it takes no Raft traffic",
            )
        })
    }

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
        self.guard.member(&request, "Raft traffic")?;
        let payload = request.into_inner();
        self.check_cluster(&payload.cluster_id)?;
        let message = decode(&payload.data).map_err(undecodable)?;
        let answer = handle(message).await;
        reply(&answer, &self.control_plane.cluster_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, padding: usize) -> v1::Node {
        v1::Node {
            name: name.to_owned(),
            address: "x".repeat(padding),
            ..Default::default()
        }
    }

    /// Issue 22, point 1: `vgpuctl get nodes` failed with "decoded message length too large"
    /// once junk nodes filled the pool. Lists come in pages bounded by count and bytes.
    #[test]
    fn pages_are_bounded_by_items_and_bytes_and_chain() {
        let names: Vec<String> = (0..2500).map(|i| format!("n{i:05}")).collect();
        let (first, token) = page(names.iter().map(|n| node(n, 0)), |n| &n.name);
        assert_eq!(first.len(), PAGE_ITEMS_MAX);
        assert_eq!(token, "n00999");
        let rest = names.iter().filter(|n| n.as_str() > token.as_str());
        let (second, _) = page(rest.map(|n| node(n, 0)), |n| &n.name);
        assert_eq!(second[0].name, "n01000");
        // Large items: a page stops after the item that passes the byte bound.
        let (large, token) = page(names.iter().map(|n| node(n, 256 << 10)), |n| &n.name);
        assert_eq!(large.len(), 4);
        assert_eq!(token, "n00003");
        let (all, token) = page(names[..3].iter().map(|n| node(n, 0)), |n| &n.name);
        assert_eq!((all.len(), token.as_str()), (3, ""));
        assert!(page_start(&"y".repeat(64)).is_err());
        assert_eq!(page_start("").unwrap(), std::ops::Bound::Unbounded);
    }

    /// Issue 22: `AddMember` with a bad address added a learner anyway.
    #[test]
    fn a_member_address_is_host_and_port() {
        for good in [
            "10.0.0.4:7401",
            "[::1]:7401",
            "cp4.example.net:7401",
            "cp_4:1",
        ] {
            assert!(check_member_address(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "cp4",
            "cp4:",
            ":7401",
            "cp4:0",
            "cp4:99999",
            "cp 4:7401",
            "a/b:1",
            &format!("{}:1", "h".repeat(300)),
        ] {
            let message = check_member_address(bad).expect_err(bad);
            assert!(message.len() < 200, "{message}");
        }
    }
}

#[cfg(test)]
#[path = "service_test.rs"]
mod node_identity_tests;
