//! The data the placement engine reasons about: node and GPU inventories, requests, and the
//! commands it emits. Plain data, serde-serialisable, ordered maps only (iteration order reaches
//! the output, and the output must be the same on every replica).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

pub type NodeName = String;
pub type TenantName = String;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub uuid: String,
    /// Index on its node, 0-based, unique per node.
    pub index: u32,
    pub model: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    /// Peer GPU index on the same node -> number of NVLinks. Symmetric in well-formed input.
    pub nvlink_peers: BTreeMap<u32, u32>,
    /// -1 when unknown.
    pub numa_node: i32,
    pub pci_bus_id: String,
    pub nearest_nics: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: NodeName,
    pub labels: BTreeMap<String, String>,
    pub gpus: Vec<GpuSpec>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum NodeState {
    Ready,
    /// Missed heartbeats: unschedulable, its tenants are re-placed.
    Lost,
    /// Cordoned by an operator: unschedulable, its tenants are re-placed.
    Draining,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuCount {
    /// Whole GPUs per node (>= 1).
    Whole(u32),
    /// A fraction of one GPU, in thousandths (1..=999).
    Milli(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NvlinkPolicy {
    /// Prefer NVLink-connected GPU sets for multi-GPU gangs.
    #[default]
    Prefer,
    /// Every pair of the gang's GPUs on a node must share at least one NVLink.
    Require,
    /// Ignore NVLink when choosing GPUs.
    Ignore,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub gpus: GpuCount,
    /// Nodes of a multi-node gang (>= 1); `gpus` is then per node. Always 1 for fractions.
    pub nodes: u32,
    /// Memory per GPU. `None`: the whole GPU (whole requests) or the fraction of the GPU's memory.
    pub memory_bytes_per_gpu: Option<u64>,
    /// Guaranteed compute per GPU in percent. `None`: 100 (whole) or the fraction.
    pub compute_percent: Option<u32>,
    pub burst: bool,
    pub priority: i32,
    pub preemptible: bool,
    pub nvlink: NvlinkPolicy,
    /// Only nodes whose labels contain all of these pairs.
    pub node_selector: BTreeMap<String, String>,
}

/// A node's host (non-GPU) capacity. `None`: not reported, so not a constraint (the default, and
/// what every node registered by [`Event::AddNode`] has).
///
/// Not part of [`NodeSpec`]: the spec is stored in the control plane's Raft log and snapshots with
/// bincode, where an added field would make older entries undecodable. It travels in
/// [`Event::RegisterNode`] and is carried across snapshots by [`HostState`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCapacity {
    pub cpu_milli: Option<u64>,
    pub memory_bytes: Option<u64>,
}

/// What a request asks of every node it is placed on beyond GPU capacity. The default asks
/// nothing (what [`Event::Submit`] means). Kept beside [`Request`], not in it, for the same reason
/// as [`HostCapacity`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraints {
    /// CPU per node of the placement, in millicores; 0: none.
    pub cpu_milli: u64,
    /// Host memory per node of the placement, in bytes; 0: none.
    pub host_memory_bytes: u64,
    /// GPU models allowed (`GpuSpec::model`, exact); empty: any.
    pub gpu_models: BTreeSet<String>,
}

impl Constraints {
    pub fn allows_model(&self, model: &str) -> bool {
        self.gpu_models.is_empty() || self.gpu_models.contains(model)
    }

    pub fn asks_host(&self) -> bool {
        self.cpu_milli > 0 || self.host_memory_bytes > 0
    }
}

/// The engine state that its serde encoding leaves out (so that an engine without it encodes
/// exactly as before): host capacities of nodes and constraints of tenants that are not the
/// default. The control plane carries it beside the engine in its snapshots and gives it back
/// with [`Engine::restore_host_state`](crate::Engine::restore_host_state) after decoding.
///
/// `kubernetes_nodes` and `pins` came later (issue 18): a decoder of the earlier layout fills
/// them empty. The control plane writes them only in a snapshot format that has them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostState {
    pub nodes: BTreeMap<NodeName, HostCapacity>,
    pub tenants: BTreeMap<TenantName, Constraints>,
    /// The Kubernetes-managed nodes ([`Event::RegisterKubernetesNode`]).
    pub kubernetes_nodes: BTreeSet<NodeName>,
    /// The pinned tenants' pins ([`Event::SubmitPinned`]).
    pub pins: BTreeMap<TenantName, Pin>,
}

/// One GPU of a [`Pin`]: the slice Kubernetes allocated on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedGpu {
    pub uuid: String,
    pub compute_percent: u32,
    pub memory_bytes: u64,
}

/// The exact slices a tenant holds, decided outside vgpu (by the kube-scheduler for a DRA
/// claim): one node, each GPU at most once. The engine binds them or refuses; it never searches,
/// queues at submission, preempts for or moves a pinned tenant. Kept beside [`Request`], not in
/// it, for the same reason as [`Constraints`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub node: NodeName,
    pub gpus: Vec<PinnedGpu>,
}

/// One GPU (or part of one) given to a tenant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceAssignment {
    pub node: NodeName,
    pub gpu_uuid: String,
    pub gpu_index: u32,
    pub compute_percent: u32,
    pub memory_bytes: u64,
    /// False for preemptible tenants.
    pub guaranteed: bool,
    pub burst: bool,
}

/// Everything that changes the engine's state. Applied in log order on every replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A node registers. A node already known with the same GPUs only becomes Ready again (its
    /// tenants stay); a node with a changed inventory has its tenants re-placed first.
    AddNode(NodeSpec),
    /// Forget a node; its tenants are re-placed.
    RemoveNode(NodeName),
    SetNodeState {
        node: NodeName,
        state: NodeState,
    },
    /// A new tenant. `seq` orders tenants of equal priority in the pending queue (older first);
    /// the caller passes a strictly increasing number such as the log index.
    Submit {
        tenant: TenantName,
        request: Request,
        seq: u64,
    },
    /// Remove a tenant (placed or pending) and free its slices.
    Release {
        tenant: TenantName,
    },
    /// Try the pending queue again (the leader sends it periodically).
    Retry,
    /// Change a tenant in place: its guaranteed compute share per GPU (a fraction's, 1..=100)
    /// and/or its priority. A placed tenant keeps its GPUs: a share that does not fit them is
    /// refused. Answered by `Updated` (then the pending queue is tried again) or `Refused`.
    Update {
        tenant: TenantName,
        compute_percent: Option<u32>,
        priority: Option<i32>,
    },
    /// [`Event::AddNode`] with the node's host capacity (appended: the control plane may number
    /// variants by position). The same GPUs with tenants whose CPU and host memory still fit keep
    /// their tenants; otherwise as a changed inventory.
    RegisterNode {
        spec: NodeSpec,
        host: HostCapacity,
    },
    /// [`Event::Submit`] with constraints: hard, on every node of the placement.
    SubmitConstrained {
        tenant: TenantName,
        request: Request,
        constraints: Constraints,
        seq: u64,
    },
    /// [`Event::RegisterNode`] of a Kubernetes-managed node (appended, like `SubmitConstrained`):
    /// its GPUs are the kube-scheduler's, so the engine's search, preemption and re-placement
    /// never use it; only pinned tenants ([`Event::SubmitPinned`]) hold slices there. A node
    /// registered again with the other kind of registration changes kind as a changed
    /// inventory does (its tenants are unbound first).
    RegisterKubernetesNode {
        spec: NodeSpec,
        host: HostCapacity,
    },
    /// A tenant whose slices were decided outside vgpu (a DRA claim): it is bound to exactly
    /// `pin` at once, or rejected at once (`Reject`): never pending, never preempting. The pin
    /// must be on a Kubernetes-managed node and its GPU count must be the request's. A pinned
    /// tenant is never preempted or moved, and stays bound while its node is Lost or Draining
    /// (the kubelet, not vgpu, decides what becomes of the pod). Only when its node is removed
    /// or re-registered with other GPUs does it lose its slices; it then waits, pending, until
    /// its node comes back with the pinned GPUs, or until it is released.
    SubmitPinned {
        tenant: TenantName,
        request: Request,
        pin: Pin,
        seq: u64,
    },
}

/// What the engine decided. The caller updates its tenant records (state, reason, history) from
/// these; the engine has already updated its own allocation state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// The tenant now holds these slices (a new placement or a re-placement).
    Bind {
        tenant: TenantName,
        slices: Vec<SliceAssignment>,
    },
    /// The tenant waits in the pending queue; `reason` says, for a person, why it does not fit.
    Pending { tenant: TenantName, reason: String },
    /// The tenant lost its slices to `by` and waits in the pending queue.
    Preempted {
        tenant: TenantName,
        by: TenantName,
        reason: String,
    },
    /// The tenant lost its slices because its node is lost, drained or removed; it is pending
    /// again (a `Bind` or `Pending` for it follows in the same batch).
    Unbound { tenant: TenantName, reason: String },
    /// The request can never fit this pool as it is built (regardless of what runs on it); the
    /// tenant is not kept.
    Reject { tenant: TenantName, reason: String },
    /// The release of this tenant is done (also emitted for a tenant the engine did not know).
    Released { tenant: TenantName },
    /// The tenant was changed in place (`Event::Update`); `slices` are what it holds now (empty
    /// while pending), on the same GPUs as before.
    Updated {
        tenant: TenantName,
        slices: Vec<SliceAssignment>,
    },
    /// The change was not made (an unknown tenant, whole GPUs, a share that does not fit); the
    /// engine's state is as before.
    Refused { tenant: TenantName, reason: String },
}

/// How the engine scores candidate GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Scorer {
    /// Fragmentation-gradient-descent style (FGD, USENIX ATC'23): a fraction goes where it adds
    /// the least expected fragmentation for the observed workload mix; whole GPUs never open an
    /// empty node while a used node fits them (not even for a better `Prefer` topology), then
    /// go by best fit.
    #[default]
    Fragmentation,
    /// Classic best fit: the GPU (node) left with the least free capacity. The baseline.
    BestFit,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineConfig {
    pub scorer: Scorer,
    /// Most pending tenants tried per event (bounds the work of one log entry's apply).
    pub retry_per_event_max: usize,
    /// Most feasible nodes scored per decision (the rest are skipped, as kube-scheduler's
    /// percentageOfNodesToScore does); the scan start rotates deterministically. 128 is about
    /// what kube-scheduler scores in a 300-node cluster; against 256 it halves the scoring work per
    /// decision (docs/benchmarks.md).
    pub nodes_scored_max: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scorer: Scorer::Fragmentation,
            retry_per_event_max: 64,
            nodes_scored_max: 128,
        }
    }
}
