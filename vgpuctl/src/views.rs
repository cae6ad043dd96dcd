//! The JSON/YAML shapes vgpuctl prints, built from the protobuf messages.
//!
//! **API Boundary:** these field names are a contract with scripts and the end-to-end tests:
//! fields are only ever added. They are our own serde structs rather than serde on the prost types,
//! so that enums print as lowercase words (`placed`, `ready`, `require`), maps print sorted, and a
//! change to the generated code cannot silently change the output.

use std::collections::BTreeMap;

use api::v1::{
    ClusterStatus, Gpu, GpuHealth, Member, Node, NodeState, NvlinkPeer, NvlinkPolicy,
    PlacementRequest, ProcessUsage, Slice, Tenant, TenantEvent, TenantState, TenantUsage,
};
use serde::{Deserialize, Serialize};

/// A tenant: `vgpuctl get tenants -o json` prints an array of these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantView {
    pub name: String,
    /// `pending`, `placed` or `preempted`.
    pub state: String,
    /// Why a pending tenant does not fit now; empty when placed.
    pub reason: String,
    pub slices: Vec<SliceView>,
    pub request: RequestView,
    pub priority: i32,
    pub created_unix_ms: i64,
    pub revision: u64,
    /// Most recent last.
    pub history: Vec<EventView>,
    /// Who owns the tenant (`tenant:OWNER` certificates' owner, or `k8s:<namespace>/<claim>` for
    /// a Kubernetes claim's tenant); absent when none was recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub owner: String,
    /// Usage per GPU as the node agents last reported it (`describe tenant` only; absent when
    /// none was reported).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub usage: Vec<UsageView>,
}

/// What a tenant uses of one GPU (from the interposer's files, reported by the node's agent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageView {
    pub node: String,
    /// The GPU's uuid.
    pub gpu: String,
    pub gpu_index: u32,
    pub memory_used_bytes: u64,
    /// 0 when not limited.
    pub memory_limit_bytes: u64,
    pub gpu_time_ns: u64,
    pub process_count: u32,
    pub processes: Vec<ProcessView>,
    /// When the control-plane leader received the report.
    pub reported_unix_ms: i64,
    /// A latency tenant's step latency as the node's controller measures it, in microseconds:
    /// the target it aims at, the tenant's p99 alone, and the recent p50 and p99. Per tenant and
    /// node, on the tenant's first GPU of the node; 0 without measurements.
    #[serde(default)]
    pub latency_target_us: u64,
    #[serde(default)]
    pub latency_baseline_us: u64,
    #[serde(default)]
    pub latency_p50_us: u64,
    #[serde(default)]
    pub latency_p99_us: u64,
    /// Steps measured, and steps slower than the target, since the node's agent started.
    #[serde(default)]
    pub latency_steps: u64,
    #[serde(default)]
    pub latency_violations: u64,
    /// Elastic memory (issue 17), from the GPU's memory board: the request and limit the agent
    /// wrote, what the tenant holds resident, the part above its request, and what it swapped
    /// out. All 0 from agents without boards.
    #[serde(default)]
    pub memory_request_bytes: u64,
    #[serde(default)]
    pub memory_board_limit_bytes: u64,
    #[serde(default)]
    pub memory_resident_bytes: u64,
    #[serde(default)]
    pub memory_borrowed_bytes: u64,
    #[serde(default)]
    pub memory_swapped_bytes: u64,
    #[serde(default)]
    pub memory_staging_bytes: u64,
    #[serde(default)]
    pub memory_reclaims: u64,
    #[serde(default)]
    pub memory_reclaimed_bytes: u64,
    #[serde(default)]
    pub memory_last_reclaim_unix_ms: i64,
    #[serde(default)]
    pub memory_waiting_processes: u32,
    #[serde(default)]
    pub memory_longest_wait_ms: u64,
    /// The SM redistribution on an MPS node (issue 15 point 4), for a best-effort tenant it
    /// follows; per tenant and node like the latency numbers. The SM cap it keeps in thousandths
    /// of the GPU's SMs (1000: uncapped; 0: not followed), its progress per second at the kept
    /// caps (0: not measured yet), whether that is in the application's own units
    /// (`vgpu_progress`) rather than steps, and its progress alone from the redistribution's
    /// last probe of it (0: not probed yet).
    #[serde(default)]
    pub sm_cap_permille: u32,
    #[serde(default)]
    pub progress_per_s: f64,
    #[serde(default)]
    pub progress_hinted: bool,
    #[serde(default)]
    pub progress_alone_per_s: f64,
    /// Its group shares the GPU side by side rather than by turns.
    #[serde(default)]
    pub redistribution_side_by_side: bool,
}

impl UsageView {
    /// Whether the entry carries the GPU's memory board figures.
    pub fn has_board(&self) -> bool {
        self.memory_request_bytes > 0 || self.memory_board_limit_bytes > 0
    }

    /// Whether the entry carries a latency target or measurements.
    pub fn has_latency(&self) -> bool {
        self.latency_target_us > 0 || self.latency_steps > 0 || self.latency_p99_us > 0
    }

    /// Whether the node's SM redistribution follows the tenant (the entry carries its cap).
    pub fn is_redistributed(&self) -> bool {
        self.sm_cap_permille > 0
    }
}

/// A process on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessView {
    pub pid: u32,
    pub memory_bytes: u64,
    /// Empty when no tenant's ledger holds the process.
    pub tenant: String,
}

/// A GPU's health as its agent last reported it. `None` fields are queries the GPU does not
/// support (also listed in `unsupported`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthView {
    pub xid_errors: u64,
    pub last_xid: u32,
    pub last_xid_unix_ms: i64,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    pub throttle_reasons: Vec<String>,
    pub temperature_celsius: Option<u32>,
    pub utilization_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub unsupported: Vec<String>,
    pub processes: Vec<ProcessView>,
    pub reported_unix_ms: i64,
}

/// One GPU share of a placed tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceView {
    pub node: String,
    /// The GPU's uuid.
    pub gpu: String,
    pub gpu_index: u32,
    pub compute_percent: u32,
    pub memory_bytes: u64,
    pub guaranteed: bool,
    pub burst: bool,
    /// What the tenant may hold on the GPU; `memory_bytes` when it does not borrow.
    #[serde(default)]
    pub memory_limit_bytes: u64,
}

/// What the tenant asked for, as sent (0 means "the default" as in the API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestView {
    pub whole_gpus: u32,
    pub milli_gpus: u32,
    pub memory_bytes_per_gpu: u64,
    /// Elastic memory: what the tenant may grow to per GPU; 0 = the request.
    #[serde(default)]
    pub memory_limit_bytes_per_gpu: u64,
    pub compute_percent: u32,
    pub burst: bool,
    pub priority: i32,
    pub preemptible: bool,
    /// `prefer`, `require`, `ignore` or `unspecified`.
    pub nvlink: String,
    pub nodes: u32,
    pub node_selector: BTreeMap<String, String>,
    /// NCCL bandwidth weight; 0 = follows the compute share.
    pub bandwidth_weight: u32,
    /// Latency-sensitive (spatial partitioning on MPS nodes).
    pub latency: bool,
    /// The latency tenant's step-latency target in microseconds; 0 = none (1.2x its latency
    /// alone, as the node measures it).
    #[serde(default)]
    pub latency_target_us: u64,
    /// CPU needed on each node of the placement, in millicores; 0 = none.
    #[serde(default)]
    pub cpu_milli: u64,
    /// Host memory needed on each node of the placement; 0 = none.
    #[serde(default)]
    pub host_memory_bytes: u64,
    /// GPU models allowed; empty = any.
    #[serde(default)]
    pub gpu_models: Vec<String>,
}

/// One entry of a tenant's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventView {
    pub unix_ms: i64,
    pub state: String,
    pub message: String,
}

/// A GPU node: `vgpuctl get nodes -o json` prints an array of these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    /// `ready`, `lost` or `draining`.
    pub state: String,
    pub address: String,
    pub labels: BTreeMap<String, String>,
    /// 0 when no heartbeat was seen yet.
    pub last_heartbeat_unix_ms: i64,
    pub gpus: Vec<GpuView>,
    /// CPU for tenants as the node's agent reports it, in millicores; 0 = not reported
    /// (unbounded).
    #[serde(default)]
    pub cpu_milli: u64,
    /// Host memory for tenants as the agent reports it; 0 = not reported (unbounded).
    #[serde(default)]
    pub host_memory_bytes: u64,
    /// What placed tenants' requests take of them.
    #[serde(default)]
    pub cpu_milli_allocated: u64,
    #[serde(default)]
    pub host_memory_allocated_bytes: u64,
    /// The kube-scheduler allocates this node's GPUs (DRA); `vgpuctl place` never lands here.
    #[serde(default)]
    pub kubernetes_managed: bool,
}

/// One GPU with its topology and allocation; `vgpuctl get gpus -o json` prints an array of these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuView {
    pub node: String,
    pub uuid: String,
    pub index: u32,
    pub model: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub nvlink_peers: Vec<NvlinkPeerView>,
    /// -1 when unknown.
    pub numa_node: i32,
    pub pci_bus_id: String,
    pub nearest_nics: Vec<String>,
    pub compute_allocated_percent: u32,
    pub memory_allocated_bytes: u64,
    /// Names of the tenants with a share of this GPU.
    pub tenants: Vec<String>,
    /// Absent until the node's agent reported it to the current leader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvlinkPeerView {
    pub gpu_index: u32,
    pub link_count: u32,
}

/// `vgpuctl cluster status -o json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterView {
    /// Id of the leader; 0 when none is known.
    pub leader: u64,
    pub term: u64,
    pub members: Vec<MemberView>,
    /// Id of the member that answered.
    pub responder: u64,
    pub last_log_index: u64,
    pub last_applied: u64,
    pub cluster_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    pub id: u64,
    pub address: String,
    pub voter: bool,
    /// Last log index the leader knows this member has (only when the responder leads).
    pub matched_index: u64,
}

/// `placed`, `pending`, `preempted`; `unspecified` or `unknown` should never show.
pub fn tenant_state_name(state: i32) -> &'static str {
    match TenantState::try_from(state) {
        Ok(TenantState::Placed) => "placed",
        Ok(TenantState::Pending) => "pending",
        Ok(TenantState::Preempted) => "preempted",
        Ok(TenantState::Unspecified) => "unspecified",
        Err(_) => "unknown",
    }
}

/// `ready`, `lost`, `draining`.
pub fn node_state_name(state: i32) -> &'static str {
    match NodeState::try_from(state) {
        Ok(NodeState::Ready) => "ready",
        Ok(NodeState::Lost) => "lost",
        Ok(NodeState::Draining) => "draining",
        Ok(NodeState::Unspecified) => "unspecified",
        Err(_) => "unknown",
    }
}

/// `prefer`, `require`, `ignore`.
pub fn nvlink_policy_name(policy: i32) -> &'static str {
    match NvlinkPolicy::try_from(policy) {
        Ok(NvlinkPolicy::Prefer) => "prefer",
        Ok(NvlinkPolicy::Require) => "require",
        Ok(NvlinkPolicy::Ignore) => "ignore",
        Ok(NvlinkPolicy::Unspecified) => "unspecified",
        Err(_) => "unknown",
    }
}

impl From<&Tenant> for TenantView {
    fn from(tenant: &Tenant) -> TenantView {
        let request = RequestView::from(&tenant.request.clone().unwrap_or_default());
        TenantView {
            name: tenant.name.clone(),
            state: tenant_state_name(tenant.state).to_owned(),
            reason: tenant.reason.clone(),
            slices: tenant.slices.iter().map(SliceView::from).collect(),
            priority: request.priority,
            request,
            created_unix_ms: tenant.created_unix_ms,
            revision: tenant.revision,
            history: tenant.history.iter().map(EventView::from).collect(),
            owner: tenant.owner.clone(),
            usage: tenant.usage.iter().map(UsageView::from).collect(),
        }
    }
}

impl From<&TenantUsage> for UsageView {
    fn from(usage: &TenantUsage) -> UsageView {
        UsageView {
            node: usage.node.clone(),
            gpu: usage.gpu.clone(),
            gpu_index: usage.gpu_index,
            memory_used_bytes: usage.memory_used_bytes,
            memory_limit_bytes: usage.memory_limit_bytes,
            gpu_time_ns: usage.gpu_time_ns,
            process_count: usage.process_count,
            processes: usage.processes.iter().map(ProcessView::from).collect(),
            reported_unix_ms: usage.reported_unix_ms,
            latency_target_us: usage.latency_target_us,
            latency_baseline_us: usage.latency_baseline_us,
            latency_p50_us: usage.latency_p50_us,
            latency_p99_us: usage.latency_p99_us,
            latency_steps: usage.latency_steps,
            latency_violations: usage.latency_violations,
            memory_request_bytes: usage.memory_request_bytes,
            memory_board_limit_bytes: usage.memory_board_limit_bytes,
            memory_resident_bytes: usage.memory_resident_bytes,
            memory_borrowed_bytes: usage.memory_borrowed_bytes,
            memory_swapped_bytes: usage.memory_swapped_bytes,
            memory_staging_bytes: usage.memory_staging_bytes,
            memory_reclaims: usage.memory_reclaims,
            memory_reclaimed_bytes: usage.memory_reclaimed_bytes,
            memory_last_reclaim_unix_ms: usage.memory_last_reclaim_unix_ms,
            memory_waiting_processes: usage.memory_waiting_processes,
            memory_longest_wait_ms: usage.memory_longest_wait_ms,
            sm_cap_permille: usage.sm_cap_permille,
            progress_per_s: usage.progress_per_s,
            progress_hinted: usage.progress_hinted,
            progress_alone_per_s: usage.progress_alone_per_s,
            redistribution_side_by_side: usage.redistribution_side_by_side,
        }
    }
}

impl From<&ProcessUsage> for ProcessView {
    fn from(process: &ProcessUsage) -> ProcessView {
        ProcessView {
            pid: process.pid,
            memory_bytes: process.memory_bytes,
            tenant: process.tenant.clone(),
        }
    }
}

impl From<&GpuHealth> for HealthView {
    fn from(health: &GpuHealth) -> HealthView {
        HealthView {
            xid_errors: health.xid_errors,
            last_xid: health.last_xid,
            last_xid_unix_ms: health.last_xid_unix_ms,
            ecc_corrected: health.ecc_corrected,
            ecc_uncorrected: health.ecc_uncorrected,
            throttle_reasons: health.throttle_reasons.clone(),
            temperature_celsius: health.temperature_celsius,
            utilization_percent: health.utilization_percent,
            memory_used_bytes: health.memory_used_bytes,
            unsupported: health.unsupported.clone(),
            processes: health.processes.iter().map(ProcessView::from).collect(),
            reported_unix_ms: health.reported_unix_ms,
        }
    }
}

impl From<&Slice> for SliceView {
    fn from(slice: &Slice) -> SliceView {
        SliceView {
            node: slice.node.clone(),
            gpu: slice.gpu.clone(),
            gpu_index: slice.gpu_index,
            compute_percent: slice.compute_percent,
            memory_bytes: slice.memory_bytes,
            guaranteed: slice.guaranteed,
            burst: slice.burst,
            memory_limit_bytes: slice.memory_limit_bytes.max(slice.memory_bytes),
        }
    }
}

impl From<&PlacementRequest> for RequestView {
    fn from(request: &PlacementRequest) -> RequestView {
        RequestView {
            whole_gpus: request.whole_gpus,
            milli_gpus: request.milli_gpus,
            memory_bytes_per_gpu: request.memory_bytes_per_gpu,
            memory_limit_bytes_per_gpu: request.memory_limit_bytes_per_gpu,
            compute_percent: request.compute_percent,
            burst: request.burst,
            priority: request.priority,
            preemptible: request.preemptible,
            nvlink: nvlink_policy_name(request.nvlink).to_owned(),
            nodes: request.nodes,
            bandwidth_weight: request.bandwidth_weight,
            latency: request.latency,
            latency_target_us: request.latency_target_us,
            cpu_milli: request.cpu_milli,
            host_memory_bytes: request.host_memory_bytes,
            gpu_models: request.gpu_models.clone(),
            node_selector: request
                .node_selector
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }
}

impl From<&TenantEvent> for EventView {
    fn from(event: &TenantEvent) -> EventView {
        EventView {
            unix_ms: event.unix_ms,
            state: tenant_state_name(event.state).to_owned(),
            message: event.message.clone(),
        }
    }
}

impl From<&Node> for NodeView {
    fn from(node: &Node) -> NodeView {
        NodeView {
            name: node.name.clone(),
            state: node_state_name(node.state).to_owned(),
            address: node.address.clone(),
            labels: node
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            last_heartbeat_unix_ms: node.last_heartbeat_unix_ms,
            gpus: node
                .gpus
                .iter()
                .map(|gpu| GpuView::of(gpu, &node.name))
                .collect(),
            cpu_milli: node.cpu_milli,
            host_memory_bytes: node.host_memory_bytes,
            cpu_milli_allocated: node.cpu_milli_allocated,
            host_memory_allocated_bytes: node.host_memory_allocated_bytes,
            kubernetes_managed: node.kubernetes_managed,
        }
    }
}

impl GpuView {
    /// `node_name` fills in `node` when the control plane left it empty.
    pub fn of(gpu: &Gpu, node_name: &str) -> GpuView {
        let node = if gpu.node.is_empty() {
            node_name.to_owned()
        } else {
            gpu.node.clone()
        };
        GpuView {
            node,
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            model: gpu.model.clone(),
            memory_bytes: gpu.memory_bytes,
            sm_count: gpu.sm_count,
            nvlink_peers: gpu.nvlink_peers.iter().map(NvlinkPeerView::from).collect(),
            numa_node: gpu.numa_node,
            pci_bus_id: gpu.pci_bus_id.clone(),
            nearest_nics: gpu.nearest_nics.clone(),
            compute_allocated_percent: gpu.compute_allocated_percent,
            memory_allocated_bytes: gpu.memory_allocated_bytes,
            tenants: gpu.tenants.clone(),
            health: gpu.health.as_ref().map(HealthView::from),
        }
    }
}

impl From<&NvlinkPeer> for NvlinkPeerView {
    fn from(peer: &NvlinkPeer) -> NvlinkPeerView {
        NvlinkPeerView {
            gpu_index: peer.gpu_index,
            link_count: peer.link_count,
        }
    }
}

impl From<&ClusterStatus> for ClusterView {
    fn from(status: &ClusterStatus) -> ClusterView {
        ClusterView {
            leader: status.leader,
            term: status.term,
            members: status.members.iter().map(MemberView::from).collect(),
            responder: status.responder,
            last_log_index: status.last_log_index,
            last_applied: status.last_applied,
            cluster_id: status.cluster_id.clone(),
        }
    }
}

impl From<&Member> for MemberView {
    fn from(member: &Member) -> MemberView {
        MemberView {
            id: member.id,
            address: member.address.clone(),
            voter: member.voter,
            matched_index: member.matched_index,
        }
    }
}

#[cfg(test)]
pub(crate) mod samples {
    //! Sample protobuf messages shared by the unit tests of several modules.

    use api::v1::*;

    pub fn placed_tenant() -> Tenant {
        Tenant {
            name: "infer-a".into(),
            request: Some(PlacementRequest {
                milli_gpus: 250,
                memory_bytes_per_gpu: 20 << 30,
                compute_percent: 25,
                burst: true,
                priority: 5,
                nvlink: NvlinkPolicy::Prefer as i32,
                node_selector: [("zone".to_owned(), "a".to_owned())].into_iter().collect(),
                ..Default::default()
            }),
            state: TenantState::Placed as i32,
            reason: String::new(),
            slices: vec![Slice {
                node: "node-a".into(),
                gpu: "GPU-0003".into(),
                gpu_index: 3,
                compute_percent: 25,
                memory_bytes: 20 << 30,
                guaranteed: true,
                burst: true,
                memory_limit_bytes: 0,
            }],
            history: vec![
                TenantEvent {
                    unix_ms: 1_700_000_000_000,
                    state: TenantState::Pending as i32,
                    message: "queued".into(),
                },
                TenantEvent {
                    unix_ms: 1_700_000_000_500,
                    state: TenantState::Placed as i32,
                    message: "placed on node-a".into(),
                },
            ],
            created_unix_ms: 1_700_000_000_000,
            revision: 42,
            usage: vec![TenantUsage {
                tenant: "infer-a".into(),
                node: "node-a".into(),
                gpu: "GPU-0003".into(),
                gpu_index: 3,
                memory_used_bytes: 3 << 30,
                memory_limit_bytes: 20 << 30,
                gpu_time_ns: 12_345_000_000,
                process_count: 2,
                processes: vec![ProcessUsage {
                    pid: 4242,
                    memory_bytes: 3 << 30,
                    tenant: "infer-a".into(),
                }],
                reported_unix_ms: 1_700_000_010_000,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A latency tenant with a target and a usage report of its node's controller.
    pub fn latency_tenant() -> Tenant {
        let mut tenant = placed_tenant();
        tenant.name = "chat".into();
        let request = tenant.request.as_mut().expect("a request");
        request.latency = true;
        request.latency_target_us = 2_000;
        let usage = &mut tenant.usage[0];
        usage.tenant = "chat".into();
        usage.latency_target_us = 2_000;
        usage.latency_baseline_us = 1_400;
        usage.latency_p50_us = 900;
        usage.latency_p99_us = 1_800;
        usage.latency_steps = 12_000;
        usage.latency_violations = 7;
        tenant
    }

    /// A best-effort tenant that its node's SM redistribution follows: its group side by side,
    /// capped to 80/128 of the SMs, with its progress in its own units, probed alone at 30.85
    /// units a second.
    pub fn redistributed_tenant() -> Tenant {
        let mut tenant = placed_tenant();
        tenant.name = "sweep".into();
        let usage = &mut tenant.usage[0];
        usage.tenant = "sweep".into();
        usage.sm_cap_permille = 625;
        usage.progress_per_s = 12.34;
        usage.progress_hinted = true;
        usage.progress_alone_per_s = 30.85;
        usage.redistribution_side_by_side = true;
        tenant
    }

    pub fn pending_tenant() -> Tenant {
        Tenant {
            name: "train-b".into(),
            request: Some(PlacementRequest {
                whole_gpus: 8,
                nodes: 2,
                nvlink: NvlinkPolicy::Require as i32,
                ..Default::default()
            }),
            state: TenantState::Pending as i32,
            reason: "no node has 8 free NVLink-connected GPUs".into(),
            created_unix_ms: 1_700_000_001_000,
            revision: 43,
            ..Default::default()
        }
    }

    pub fn node() -> Node {
        Node {
            name: "node-a".into(),
            address: "10.0.0.5:7402".into(),
            labels: [("zone".to_owned(), "a".to_owned())].into_iter().collect(),
            state: NodeState::Ready as i32,
            last_heartbeat_unix_ms: 1_700_000_002_000,
            gpus: (0..2)
                .map(|index| Gpu {
                    uuid: format!("GPU-000{index}"),
                    index,
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_bytes: 80 << 30,
                    sm_count: 132,
                    nvlink_peers: vec![NvlinkPeer {
                        gpu_index: 1 - index,
                        link_count: 18,
                    }],
                    numa_node: 0,
                    pci_bus_id: format!("0000:1{index}:00.0"),
                    nearest_nics: vec!["mlx5_0".into()],
                    compute_allocated_percent: if index == 0 { 25 } else { 0 },
                    memory_allocated_bytes: if index == 0 { 20 << 30 } else { 0 },
                    tenants: if index == 0 {
                        vec!["infer-a".into()]
                    } else {
                        vec![]
                    },
                    node: String::new(),
                    health: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    pub fn cluster() -> ClusterStatus {
        ClusterStatus {
            leader: 2,
            term: 7,
            members: (1..=3)
                .map(|id| Member {
                    id,
                    address: format!("cp-{id}:7401"),
                    voter: true,
                    matched_index: 100,
                })
                .collect(),
            responder: 1,
            last_log_index: 100,
            last_applied: 99,
            cluster_id: "c-123".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn keys(value: &Value) -> Vec<&str> {
        let mut keys: Vec<&str> = value
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        keys
    }

    #[test]
    fn a_tenants_owner_is_shown_when_recorded() {
        let mut tenant = samples::placed_tenant();
        tenant.owner = String::new();
        let json = serde_json::to_value(TenantView::from(&tenant)).unwrap();
        assert!(json.get("owner").is_none(), "{json}");
        tenant.owner = "k8s:ml/train".into();
        let view = TenantView::from(&tenant);
        assert_eq!(
            serde_json::to_value(&view).unwrap()["owner"],
            "k8s:ml/train"
        );
        assert!(crate::describe::tenant_text(&view, 0).contains("k8s:ml/train"));
    }

    #[test]
    fn tenant_json_has_the_contract_fields() {
        let json = serde_json::to_value(TenantView::from(&samples::placed_tenant())).unwrap();
        for key in [
            "name",
            "state",
            "reason",
            "slices",
            "request",
            "priority",
            "created_unix_ms",
            "revision",
        ] {
            assert!(json.get(key).is_some(), "missing {key} in {json}");
        }
        assert_eq!(json["state"], "placed");
        assert_eq!(json["priority"], 5);
        assert_eq!(
            keys(&json["slices"][0]),
            [
                "burst",
                "compute_percent",
                "gpu",
                "gpu_index",
                "guaranteed",
                "memory_bytes",
                "memory_limit_bytes",
                "node"
            ]
        );
        assert_eq!(json["slices"][0]["gpu"], "GPU-0003");
        let request = &json["request"];
        assert_eq!(
            keys(request),
            [
                "bandwidth_weight",
                "burst",
                "compute_percent",
                "cpu_milli",
                "gpu_models",
                "host_memory_bytes",
                "latency",
                "latency_target_us",
                "memory_bytes_per_gpu",
                "memory_limit_bytes_per_gpu",
                "milli_gpus",
                "node_selector",
                "nodes",
                "nvlink",
                "preemptible",
                "priority",
                "whole_gpus"
            ]
        );
        assert_eq!(request["milli_gpus"], 250);
        assert_eq!(request["nvlink"], "prefer");
        assert_eq!(request["node_selector"]["zone"], "a");
        assert_eq!(json["history"][1]["state"], "placed");
        assert_eq!(
            keys(&json["usage"][0]),
            [
                "gpu",
                "gpu_index",
                "gpu_time_ns",
                "latency_baseline_us",
                "latency_p50_us",
                "latency_p99_us",
                "latency_steps",
                "latency_target_us",
                "latency_violations",
                "memory_board_limit_bytes",
                "memory_borrowed_bytes",
                "memory_last_reclaim_unix_ms",
                "memory_limit_bytes",
                "memory_longest_wait_ms",
                "memory_reclaimed_bytes",
                "memory_reclaims",
                "memory_request_bytes",
                "memory_resident_bytes",
                "memory_staging_bytes",
                "memory_swapped_bytes",
                "memory_used_bytes",
                "memory_waiting_processes",
                "node",
                "process_count",
                "processes",
                "progress_alone_per_s",
                "progress_hinted",
                "progress_per_s",
                "redistribution_side_by_side",
                "reported_unix_ms",
                "sm_cap_permille"
            ]
        );
    }

    #[test]
    fn a_latency_tenant_shows_its_target_and_what_it_achieved() {
        let json = serde_json::to_value(TenantView::from(&samples::latency_tenant())).unwrap();
        assert_eq!(json["request"]["latency"], true);
        assert_eq!(json["request"]["latency_target_us"], 2_000);
        let usage = &json["usage"][0];
        assert_eq!(usage["latency_target_us"], 2_000);
        assert_eq!(usage["latency_baseline_us"], 1_400);
        assert_eq!(usage["latency_p50_us"], 900);
        assert_eq!(usage["latency_p99_us"], 1_800);
        assert_eq!(usage["latency_steps"], 12_000);
        assert_eq!(usage["latency_violations"], 7);
        // Views written before the fields existed still read.
        let mut old = json.clone();
        for field in ["latency_target_us", "latency_p99_us", "latency_steps"] {
            old["usage"][0].as_object_mut().unwrap().remove(field);
        }
        old["request"]
            .as_object_mut()
            .unwrap()
            .remove("latency_target_us");
        let read: TenantView = serde_json::from_value(old).unwrap();
        assert_eq!(read.request.latency_target_us, 0);
        assert!(!read.usage[0].has_latency());
        assert_eq!(read.usage[0].latency_p50_us, 900);
    }

    #[test]
    fn a_redistributed_tenant_shows_its_sm_cap_and_progress() {
        let json =
            serde_json::to_value(TenantView::from(&samples::redistributed_tenant())).unwrap();
        let usage = &json["usage"][0];
        assert_eq!(usage["sm_cap_permille"], 625);
        assert_eq!(usage["progress_per_s"], 12.34);
        assert_eq!(usage["progress_hinted"], true);
        assert_eq!(usage["redistribution_side_by_side"], true);
        let plain = serde_json::to_value(TenantView::from(&samples::placed_tenant())).unwrap();
        assert_eq!(plain["usage"][0]["sm_cap_permille"], 0);
        // Views written before the fields existed still read.
        let mut old = json.clone();
        for field in ["sm_cap_permille", "progress_per_s", "progress_hinted"] {
            old["usage"][0].as_object_mut().unwrap().remove(field);
        }
        let read: TenantView = serde_json::from_value(old).unwrap();
        assert!(!read.usage[0].is_redistributed());
        assert_eq!(read.usage[0].progress_per_s, 0.0);
    }

    #[test]
    fn states_and_policies_are_lowercase_words() {
        let pending = serde_json::to_value(TenantView::from(&samples::pending_tenant())).unwrap();
        assert_eq!(pending["state"], "pending");
        assert_eq!(pending["request"]["nvlink"], "require");
        assert_eq!(pending["slices"], Value::Array(vec![]));
        assert_eq!(
            tenant_state_name(TenantState::Preempted as i32),
            "preempted"
        );
        assert_eq!(node_state_name(NodeState::Lost as i32), "lost");
        assert_eq!(node_state_name(NodeState::Draining as i32), "draining");
        assert_eq!(nvlink_policy_name(NvlinkPolicy::Ignore as i32), "ignore");
        assert_eq!(tenant_state_name(99), "unknown");
    }

    #[test]
    fn node_json_nests_gpus_with_topology() {
        let json = serde_json::to_value(NodeView::from(&samples::node())).unwrap();
        assert_eq!(
            keys(&json),
            [
                "address",
                "cpu_milli",
                "cpu_milli_allocated",
                "gpus",
                "host_memory_allocated_bytes",
                "host_memory_bytes",
                "kubernetes_managed",
                "labels",
                "last_heartbeat_unix_ms",
                "name",
                "state"
            ]
        );
        assert_eq!(json["state"], "ready");
        let gpu = &json["gpus"][0];
        assert_eq!(
            keys(gpu),
            [
                "compute_allocated_percent",
                "index",
                "memory_allocated_bytes",
                "memory_bytes",
                "model",
                "nearest_nics",
                "node",
                "numa_node",
                "nvlink_peers",
                "pci_bus_id",
                "sm_count",
                "tenants",
                "uuid"
            ]
        );
        // The node name is filled in when the control plane left it empty.
        assert_eq!(gpu["node"], "node-a");
        assert_eq!(gpu["nvlink_peers"][0]["gpu_index"], 1);
        assert_eq!(gpu["nvlink_peers"][0]["link_count"], 18);
        assert_eq!(gpu["tenants"][0], "infer-a");
    }

    #[test]
    fn cluster_json_has_the_contract_fields() {
        let json = serde_json::to_value(ClusterView::from(&samples::cluster())).unwrap();
        assert_eq!(
            keys(&json),
            [
                "cluster_id",
                "last_applied",
                "last_log_index",
                "leader",
                "members",
                "responder",
                "term"
            ]
        );
        assert_eq!(
            keys(&json["members"][0]),
            ["address", "id", "matched_index", "voter"]
        );
        assert_eq!(json["leader"], 2);
    }

    #[test]
    fn views_round_trip_through_json_and_yaml() {
        let view = TenantView::from(&samples::placed_tenant());
        let json = serde_json::to_string(&view).unwrap();
        assert_eq!(serde_json::from_str::<TenantView>(&json).unwrap(), view);
        let yaml = serde_yaml::to_string(&view).unwrap();
        assert_eq!(serde_yaml::from_str::<TenantView>(&yaml).unwrap(), view);
    }
}
