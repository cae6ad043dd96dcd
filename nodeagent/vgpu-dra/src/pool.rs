//! The second stage (docs/design/dra-control-plane.md, step 5): each prepared claim is a tenant
//! of the control plane, pinned to the slices the scheduler allocated, and the node's agent
//! (`vgpu-agent join --kubernetes-managed`) makes it a tenant on the node as it does every
//! tenant. The driver:
//!
//! * prepare: `Pool.Place` with the pin ([`pin_request`]), under the node's agent certificate and
//!   with the agent's node key (the control plane refuses a pin without the key that holds the
//!   node's name); the same request again is answered with the tenant, so a retry repeats it.
//!   Then it waits, bounded, for the agent's `tenants/<tenant>.json` (and its commit point,
//!   `assignments.json`), and the CDI spec is written from what the agent wrote.
//! * unprepare: `Pool.Release` (a tenant not found is released already), then it waits, bounded,
//!   for the tenant's file to go.
//!
//! Every call and every wait is bounded; an error says what to do, since the kubelet shows it
//! in the pod's events and retries.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::codes::ErrorCode;
use api::tls::{TlsFiles, Transport};
use api::v1::pool_client::PoolClient;
use tonic::transport::Channel;
use vgpu_agent::assignments::TenantAssignment;

use crate::claim::ClaimRef;
use crate::error::{Error, Result};

/// How long the driver waits for the agent by default (the kubelet retries after).
pub const PLACEMENT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// The bound on one call to one control-plane member.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection to a member may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the agent's files are looked at while waiting.
pub const POLL_PERIOD: Duration = Duration::from_millis(100);
/// Most control-plane addresses.
pub const ENDPOINTS_MAX: usize = vgpu_agent::endpoints::ENDPOINTS_MAX;
/// The node key's file in the agent's state directory.
pub const NODE_KEY_FILE: &str = "node-key";

/// The second stage's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlaneConfig {
    /// The control-plane members (`HOST:PORT`); any of them takes any call.
    pub endpoints: Vec<String>,
    /// The node's agent certificate, its key and the cluster CA; `None`: plain text
    /// (a control plane started with `--insecure`).
    pub tls: Option<TlsFiles>,
    /// The agent's state directory: its node key, and the tenant files the driver waits for.
    pub agent_state_dir: PathBuf,
    /// How long prepare waits for the agent's tenant file (and unprepare for it to go).
    pub placement_timeout: Duration,
}

/// The control plane as the driver calls it.
#[derive(Debug, Clone)]
pub struct ControlPlane {
    config: ControlPlaneConfig,
    node: String,
    channels: Vec<(String, Channel)>,
}

impl ControlPlane {
    /// Reads the certificate files and makes one lazily connected channel per member, so a
    /// control plane that is down now is no error here (a call says so).
    pub fn new(config: ControlPlaneConfig, node: &str) -> Result<ControlPlane> {
        let transport = match &config.tls {
            None => Transport::Insecure,
            Some(files) => {
                Transport::choose(false, Some(files), "").map_err(|error| Error::ControlPlaneSetup {
                    reason: format!(
                        "{error}; the driver uses the node's agent certificate (vgpu-agent's STATE_DIR/tls/agent.crt, agent.key, ca.crt), which the agent writes when it first joins: start `vgpu-agent join --kubernetes-managed` on this node and mount its state directory into the driver (--agent-state-dir), or pass --insecure for a control plane started with --insecure"
                    ),
                })?
            }
        };
        let mut channels: Vec<(String, Channel)> = Vec::new();
        for address in config
            .endpoints
            .iter()
            .map(|address| address.trim())
            .filter(|address| !address.is_empty())
        {
            if channels.iter().any(|(known, _)| known == address) {
                continue;
            }
            if channels.len() == ENDPOINTS_MAX {
                return Err(Error::ControlPlaneSetup {
                    reason: format!("more than {ENDPOINTS_MAX} control-plane addresses"),
                });
            }
            let endpoint = transport
                .endpoint(address)
                .map_err(|error| Error::ControlPlaneSetup {
                    reason: error.to_string(),
                })?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(CALL_TIMEOUT);
            channels.push((address.to_owned(), endpoint.connect_lazy()));
        }
        if channels.is_empty() {
            return Err(Error::ControlPlaneSetup {
                reason: "no control-plane address; pass --control-plane HOST:PORT[,HOST:PORT...]"
                    .to_owned(),
            });
        }
        Ok(ControlPlane {
            config,
            node: node.to_owned(),
            channels,
        })
    }

    pub fn config(&self) -> &ControlPlaneConfig {
        &self.config
    }

    /// Pins `assignment` (the tenant `claim` becomes) on this node, or learns that it is pinned
    /// already; then waits for the agent to write it, and returns what the agent wrote.
    pub async fn place(
        &self,
        claim: &ClaimRef,
        assignment: &TenantAssignment,
    ) -> Result<TenantAssignment> {
        let request = pin_request(&self.node, claim, assignment);
        let key = self.node_key()?;
        self.call(claim, "place", |mut client| {
            let mut call = tonic::Request::new(request.clone());
            insert_key(&mut call, &key);
            async move { client.place(call).await.map(|_| ()) }
        })
        .await?;
        tracing::info!(
            "the control plane pinned tenant {} for claim {claim}; waiting for the agent",
            assignment.tenant
        );
        self.wait_placed(claim, &assignment.tenant).await
    }

    /// Releases the tenant of `claim` (one not found is released already) and waits for the
    /// agent to remove its file.
    pub async fn release(&self, claim: &ClaimRef, tenant: &str) -> Result<()> {
        let key = self.node_key()?;
        let request = api::v1::ReleaseRequest {
            name: tenant.to_owned(),
        };
        let released = self
            .call(claim, "release", |mut client| {
                let mut call = tonic::Request::new(request.clone());
                insert_key(&mut call, &key);
                async move { client.release(call).await.map(|_| ()) }
            })
            .await;
        match released {
            Ok(()) => {}
            Err(Error::PinRefused {
                code: tonic::Code::NotFound,
                ..
            }) => {
                tracing::info!("tenant {tenant} of claim {claim} was released already");
            }
            Err(error) => return Err(error),
        }
        self.wait_gone(claim, tenant).await
    }

    /// The agent's node key, read on every call (the agent draws it when it first runs).
    fn node_key(&self) -> Result<String> {
        let path = self.config.agent_state_dir.join(NODE_KEY_FILE);
        let bad = |reason: String| Error::NodeKey {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|error| bad(error.to_string()))?;
        let key = text.trim_end();
        if !api::metadata::is_node_key(key) {
            return Err(bad("it holds no node key".to_owned()));
        }
        Ok(key.to_owned())
    }

    /// Tries `call` on each member in turn until one answers; a member that cannot be reached
    /// (or has no leader) passes the call on to the next. The answer of the first that answers
    /// is the result.
    async fn call<F, Fut>(&self, claim: &ClaimRef, what: &'static str, call: F) -> Result<()>
    where
        F: Fn(PoolClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<(), tonic::Status>>,
    {
        let mut last = String::new();
        for (address, channel) in &self.channels {
            let client = PoolClient::new(channel.clone());
            let answer = tokio::time::timeout(CALL_TIMEOUT, call(client)).await;
            let status = match answer {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(status)) => status,
                Err(_) => tonic::Status::deadline_exceeded(format!(
                    "no answer within {} s",
                    CALL_TIMEOUT.as_secs()
                )),
            };
            if unreachable(&status) {
                tracing::warn!(
                    "control plane {address} did not take the {what} of claim {claim}: {status}"
                );
                last = format!("{address}: {}", status.message());
                continue;
            }
            return Err(Error::PinRefused {
                claim: claim.clone(),
                what,
                code: status.code(),
                reason: status.message().to_owned(),
                hint: hint(&status),
            });
        }
        Err(Error::ControlPlaneUnreachable {
            claim: claim.clone(),
            what,
            endpoints: self
                .channels
                .iter()
                .map(|(address, _)| address.as_str())
                .collect::<Vec<_>>()
                .join(","),
            reason: last,
        })
    }

    async fn wait_placed(&self, claim: &ClaimRef, tenant: &str) -> Result<TenantAssignment> {
        let state_dir = &self.config.agent_state_dir;
        let deadline = tokio::time::Instant::now() + self.config.placement_timeout;
        loop {
            match vgpu_agent::tenant::load_placement(state_dir, tenant, &self.node) {
                Ok(placement) => return Ok(placement.assignment),
                Err(
                    vgpu_agent::Error::TenantNotPlaced { .. }
                    | vgpu_agent::Error::NoAgentState { .. },
                ) => {}
                Err(error) => return Err(error.into()),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::AgentTimeout {
                    claim: claim.clone(),
                    tenant: tenant.to_owned(),
                    waiting_for: "write",
                    path: tenant_file(state_dir, tenant),
                    seconds: self.config.placement_timeout.as_secs(),
                });
            }
            tokio::time::sleep(POLL_PERIOD).await;
        }
    }

    async fn wait_gone(&self, claim: &ClaimRef, tenant: &str) -> Result<()> {
        let state_dir = &self.config.agent_state_dir;
        let deadline = tokio::time::Instant::now() + self.config.placement_timeout;
        loop {
            if vgpu_agent::state::read_tenant_file(state_dir, tenant)?.is_none() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::AgentTimeout {
                    claim: claim.clone(),
                    tenant: tenant.to_owned(),
                    waiting_for: "remove",
                    path: tenant_file(state_dir, tenant),
                    seconds: self.config.placement_timeout.as_secs(),
                });
            }
            tokio::time::sleep(POLL_PERIOD).await;
        }
    }
}

/// The agent's file of tenant `tenant`.
pub fn tenant_file(agent_state_dir: &Path, tenant: &str) -> PathBuf {
    agent_state_dir
        .join("tenants")
        .join(format!("{tenant}.json"))
}

/// The `Pool.Place` request that pins `assignment` (the tenant of `claim`) on `node`: its owner
/// is the claim (`k8s:<namespace>/<claim>`), one GPU per slice, priority 0, never preemptible.
pub fn pin_request(
    node: &str,
    claim: &ClaimRef,
    assignment: &TenantAssignment,
) -> api::v1::PlaceRequest {
    assert!(!assignment.slices.is_empty(), "a claim's tenant has slices");
    let gpus = assignment
        .slices
        .iter()
        .map(|slice| api::v1::PinnedGpu {
            uuid: slice.gpu_uuid.clone(),
            compute_percent: slice.compute_percent,
            memory_bytes: slice.memory_bytes,
        })
        .collect::<Vec<_>>();
    api::v1::PlaceRequest {
        name: assignment.tenant.clone(),
        request: Some(api::v1::PlacementRequest {
            whole_gpus: u32::try_from(gpus.len()).expect("a node's GPUs"),
            owner: api::names::claim_owner(&claim.namespace, &claim.name),
            pin: Some(api::v1::Pin {
                node: node.to_owned(),
                gpus,
            }),
            ..Default::default()
        }),
    }
}

fn insert_key<T>(call: &mut tonic::Request<T>, key: &str) {
    call.metadata_mut().insert(
        api::metadata::NODE_KEY,
        key.parse().expect("a node key is hex digits"),
    );
}

/// Whether `status` says the member could not take the call (down, no leader, too slow), so
/// another member may.
fn unreachable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
    ) || matches!(
        ErrorCode::of(status),
        Some(ErrorCode::NotLeader | ErrorCode::NoLeader | ErrorCode::Unavailable)
    ) || (status.code() == tonic::Code::Unknown && status.message().contains("transport"))
}

/// What to do about a refusal.
fn hint(status: &tonic::Status) -> &'static str {
    match (ErrorCode::of(status), status.code()) {
        (Some(ErrorCode::PermissionDenied | ErrorCode::Unauthenticated), _)
        | (_, tonic::Code::PermissionDenied | tonic::Code::Unauthenticated) => {
            "the driver must use this node's agent certificate (vgpu-agent's STATE_DIR/tls, role agent, named after the node: check --node-name) and the agent's node key"
        }
        (Some(ErrorCode::NodeNameTaken), _) => {
            "the node key the driver read is not the one that holds this node's name: mount the state directory of the agent running on this node (--agent-state-dir)"
        }
        (Some(ErrorCode::NodeNotFound), _) | (_, tonic::Code::NotFound) => {
            "the node is not registered: start `vgpu-agent join --kubernetes-managed` on it"
        }
        (Some(ErrorCode::Unplaceable), _) | (_, tonic::Code::FailedPrecondition) => {
            "the node must be registered with `vgpu-agent join --kubernetes-managed`, and the pinned slices free: `vgpuctl describe node` shows who holds them"
        }
        (Some(ErrorCode::TenantExists), _) | (_, tonic::Code::AlreadyExists) => {
            "another tenant holds this name with other slices: `vgpuctl get tenants` shows it; release it, then the kubelet's retry places the claim"
        }
        _ => "check the control plane's log; the kubelet will retry",
    }
}
