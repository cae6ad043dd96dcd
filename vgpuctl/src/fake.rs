//! An in-process fake control plane for the unit tests: a real tonic server on a loopback port
//! serving Pool and Cluster from a small in-memory state, with switches that make it fail the way
//! real members do (no leader, unknown outcome, hanging), so failover can be tested without vgpu-cp.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::ErrorCode;
use api::v1::cluster_server::{Cluster, ClusterServer};
use api::v1::pool_server::{Pool, PoolServer};
use api::v1::*;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::views::samples;

/// How the fake answers every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Serve,
    /// `[VGPU-NO-LEADER]`: nothing was done.
    NoLeader,
    /// `[VGPU-UNAVAILABLE]`: the outcome is unknown.
    Unavailable,
    /// Never answers (within a test's patience).
    Hang,
}

pub struct State {
    pub mode: Mutex<Mode>,
    pub tenants: Mutex<BTreeMap<String, Tenant>>,
    /// A new tenant is placed after this many GetTenant calls; `None`: stays pending.
    pub placed_after_polls: Option<u32>,
    pub calls: AtomicU32,
    polls: AtomicU32,
}

impl State {
    pub fn new(mode: Mode, placed_after_polls: Option<u32>) -> Arc<State> {
        Arc::new(State {
            mode: Mutex::new(mode),
            tenants: Mutex::new(BTreeMap::new()),
            placed_after_polls,
            calls: AtomicU32::new(0),
            polls: AtomicU32::new(0),
        })
    }

    /// Counts the call and fails it as the mode says.
    async fn enter(&self) -> Result<(), Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mode = *self.mode.lock().unwrap();
        match mode {
            Mode::Serve => Ok(()),
            Mode::NoLeader => {
                Err(ErrorCode::NoLeader.status("no control-plane leader could be reached"))
            }
            Mode::Unavailable => {
                Err(ErrorCode::Unavailable.status("the leader failed while handling the request"))
            }
            Mode::Hang => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Err(Status::deadline_exceeded("hung"))
            }
        }
    }

    fn place_now(tenant: &mut Tenant) {
        tenant.state = TenantState::Placed as i32;
        tenant.reason.clear();
        tenant.slices = samples::placed_tenant().slices;
    }
}

/// A running fake; the server stops when this is dropped.
pub struct Running {
    pub address: String,
    pub state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Fake(Arc<State>);

pub fn start(state: Arc<State>) -> Running {
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let address = incoming.local_addr().unwrap().to_string();
    let fake = Fake(state.clone());
    let router = Server::builder()
        .add_service(PoolServer::new(fake.clone()))
        .add_service(ClusterServer::new(fake));
    let task = tokio::spawn(async move {
        router.serve_with_incoming(incoming).await.unwrap();
    });
    Running {
        address,
        state,
        task,
    }
}

/// An address where nothing listens.
pub fn dead_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

#[tonic::async_trait]
impl Pool for Fake {
    async fn place(
        &self,
        request: Request<PlaceRequest>,
    ) -> Result<Response<PlaceResponse>, Status> {
        self.0.enter().await?;
        let PlaceRequest { name, request } = request.into_inner();
        let mut tenants = self.0.tenants.lock().unwrap();
        if let Some(existing) = tenants.get(&name) {
            if existing.request == request {
                return Ok(Response::new(PlaceResponse {
                    tenant: Some(existing.clone()),
                }));
            }
            return Err(ErrorCode::TenantExists
                .status(format!("tenant {name} exists with another request")));
        }
        let mut tenant = Tenant {
            name: name.clone(),
            request,
            state: TenantState::Pending as i32,
            reason: "no GPU has 25% compute free".into(),
            created_unix_ms: 1_700_000_000_000,
            revision: 1,
            ..Default::default()
        };
        if self.0.placed_after_polls == Some(0) {
            State::place_now(&mut tenant);
        }
        tenants.insert(name, tenant.clone());
        Ok(Response::new(PlaceResponse {
            tenant: Some(tenant),
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        self.0.enter().await?;
        let name = request.into_inner().name;
        match self.0.tenants.lock().unwrap().remove(&name) {
            Some(_) => Ok(Response::new(ReleaseResponse {})),
            None => Err(ErrorCode::TenantNotFound.status(format!(
                "there is no tenant {name}; list them with `vgpuctl get tenants`"
            ))),
        }
    }

    /// Changes the stored tenant; a share above 75% does not fit its (shared) GPU.
    async fn set_tenant(
        &self,
        request: Request<SetTenantRequest>,
    ) -> Result<Response<SetTenantResponse>, Status> {
        self.0.enter().await?;
        let change = request.into_inner();
        let mut tenants = self.0.tenants.lock().unwrap();
        let tenant = tenants.get_mut(&change.name).ok_or_else(|| {
            ErrorCode::TenantNotFound.status(format!("there is no tenant {}", change.name))
        })?;
        if let Some(percent) = change.compute_percent {
            if percent > 75 {
                return Err(ErrorCode::Unplaceable.status(format!(
                    "GPU 3 of node node-a has room for 75% for tenant {}",
                    change.name
                )));
            }
            tenant
                .slices
                .iter_mut()
                .for_each(|slice| slice.compute_percent = percent);
        }
        let request = tenant.request.get_or_insert_default();
        if let Some(percent) = change.compute_percent {
            request.compute_percent = percent;
        }
        if let Some(priority) = change.priority {
            request.priority = priority;
        }
        if let Some(target) = change.latency_target_us {
            request.latency_target_us = target;
        }
        Ok(Response::new(SetTenantResponse {
            tenant: Some(tenant.clone()),
        }))
    }

    async fn get_tenant(
        &self,
        request: Request<GetTenantRequest>,
    ) -> Result<Response<Tenant>, Status> {
        self.0.enter().await?;
        let name = request.into_inner().name;
        let polls = self.0.polls.fetch_add(1, Ordering::SeqCst) + 1;
        let mut tenants = self.0.tenants.lock().unwrap();
        let tenant = tenants.get_mut(&name).ok_or_else(|| {
            ErrorCode::TenantNotFound.status(format!("there is no tenant {name}"))
        })?;
        if self
            .0
            .placed_after_polls
            .is_some_and(|after| polls >= after)
        {
            State::place_now(tenant);
        }
        Ok(Response::new(tenant.clone()))
    }

    async fn list_tenants(
        &self,
        _: Request<ListRequest>,
    ) -> Result<Response<ListTenantsResponse>, Status> {
        self.0.enter().await?;
        let tenants = self.0.tenants.lock().unwrap().values().cloned().collect();
        Ok(Response::new(ListTenantsResponse {
            tenants,
            next_page_token: String::new(),
        }))
    }

    /// Pages of one tenant each, so that vgpuctl's paging is exercised.
    async fn list_tenants_page(
        &self,
        request: Request<ListPageRequest>,
    ) -> Result<Response<ListTenantsResponse>, Status> {
        self.0.enter().await?;
        let after = request.into_inner().page_token;
        let tenants = self.0.tenants.lock().unwrap();
        let mut rest = tenants
            .iter()
            .filter(|(name, _)| after.is_empty() || **name > after);
        let tenants: Vec<Tenant> = rest.next().map(|(_, t)| t.clone()).into_iter().collect();
        let next_page_token = match (rest.next(), tenants.first()) {
            (Some(_), Some(last)) => last.name.clone(),
            _ => String::new(),
        };
        Ok(Response::new(ListTenantsResponse {
            tenants,
            next_page_token,
        }))
    }

    async fn list_nodes_page(
        &self,
        _: Request<ListPageRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        self.0.enter().await?;
        Ok(Response::new(ListNodesResponse {
            nodes: vec![samples::node()],
            next_page_token: String::new(),
        }))
    }

    async fn remove_node(
        &self,
        request: Request<RemoveNodeRequest>,
    ) -> Result<Response<RemoveNodeResponse>, Status> {
        self.0.enter().await?;
        let name = request.into_inner().node;
        if name != samples::node().name {
            return Err(ErrorCode::NodeNotFound.status(format!("there is no node {name}")));
        }
        Ok(Response::new(RemoveNodeResponse {}))
    }

    async fn get_node(&self, request: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        self.0.enter().await?;
        let name = request.into_inner().name;
        if name != samples::node().name {
            return Err(ErrorCode::NodeNotFound.status(format!("there is no node {name}")));
        }
        Ok(Response::new(samples::node()))
    }

    async fn list_nodes(
        &self,
        _: Request<ListRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        self.0.enter().await?;
        Ok(Response::new(ListNodesResponse {
            nodes: vec![samples::node()],
            next_page_token: String::new(),
        }))
    }

    async fn drain(
        &self,
        request: Request<DrainRequest>,
    ) -> Result<Response<DrainResponse>, Status> {
        self.0.enter().await?;
        let mut node = samples::node();
        node.name = request.into_inner().node;
        node.state = NodeState::Draining as i32;
        Ok(Response::new(DrainResponse { node: Some(node) }))
    }

    async fn uncordon(
        &self,
        request: Request<DrainRequest>,
    ) -> Result<Response<DrainResponse>, Status> {
        self.0.enter().await?;
        let mut node = samples::node();
        node.name = request.into_inner().node;
        Ok(Response::new(DrainResponse { node: Some(node) }))
    }
}

#[tonic::async_trait]
impl Cluster for Fake {
    /// Answered from local state like a real member: only a hanging member fails it, and it is
    /// not counted in `calls`, so tests count data calls only.
    async fn status(
        &self,
        _: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatus>, Status> {
        if *self.0.mode.lock().unwrap() == Mode::Hang {
            self.0.enter().await?;
        }
        Ok(Response::new(samples::cluster()))
    }

    async fn add_member(
        &self,
        request: Request<AddMemberRequest>,
    ) -> Result<Response<ClusterStatus>, Status> {
        self.0.enter().await?;
        let AddMemberRequest { id, address } = request.into_inner();
        let mut status = samples::cluster();
        status.members.push(Member {
            id,
            address,
            voter: true,
            matched_index: 0,
        });
        Ok(Response::new(status))
    }

    async fn remove_member(
        &self,
        request: Request<RemoveMemberRequest>,
    ) -> Result<Response<ClusterStatus>, Status> {
        self.0.enter().await?;
        let id = request.into_inner().id;
        let mut status = samples::cluster();
        status.members.retain(|member| member.id != id);
        Ok(Response::new(status))
    }

    async fn create_join_token(
        &self,
        _: Request<api::v1::CreateJoinTokenRequest>,
    ) -> Result<Response<api::v1::CreateJoinTokenResponse>, Status> {
        Err(Status::unimplemented("vgpuctl does not create tokens"))
    }

    async fn revoke_certificate(
        &self,
        _: Request<api::v1::RevokeCertificateRequest>,
    ) -> Result<Response<api::v1::RevokeCertificateResponse>, Status> {
        Err(Status::unimplemented(
            "vgpuctl does not revoke certificates",
        ))
    }
}
