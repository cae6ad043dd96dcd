//! The engine: applies one [`Event`] at a time to the pool state and returns the [`Command`]s it
//! decided, in a deterministic order. The state is plain ordered data (serde), so the control
//! plane snapshots it inside Raft snapshots and a restored engine continues identically.
//!
//! State: nodes by name (each with its usage and summary), tenants by name (placed or pending),
//! the pending queue (priority high to low, then `seq`), an index of Ready nodes by number of
//! fully free GPUs (for whole-GPU requests), the workload model the fragmentation scorer reads,
//! and the rotating scan cursor. The search lives in `search.rs`, preemption in `preempt.rs`,
//! changes to a tenant in place in `update.rs`.

use crate::node::{HostUse, Node};
use crate::search::Need;
use crate::types::*;
use crate::workload::WorkloadModel;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(from = "EngineFields")]
pub struct Engine {
    pub(crate) config: EngineConfig,
    pub(crate) nodes: BTreeMap<NodeName, Node>,
    pub(crate) tenants: BTreeMap<TenantName, TenantRecord>,
    pub(crate) queue: BTreeSet<QueueKey>,
    /// Ready nodes by number of fully free GPUs.
    pub(crate) free_index: BTreeMap<u32, BTreeSet<NodeName>>,
    pub(crate) workload: WorkloadModel,
    /// Placed tenants by priority: (guaranteed, preemptible) counts. Lets preemption return at
    /// once when nothing placed could be a victim (a pool of one priority, the common case).
    pub(crate) placed_by_priority: BTreeMap<i32, (u64, u64)>,
    /// The next scan starts at the first node at or after this name (kube-scheduler rotates its
    /// start the same way, so the first nodes are not always the ones filled).
    pub(crate) scan_cursor: NodeName,
    /// What kept tenants (placed or pending) that ask for host capacity ask in all: read by the fragmentation scorer to tell
    /// GPUs stranded behind exhausted CPU or host memory. Derived from the tenants, so left out
    /// of the serde encoding and recomputed by [`Engine::restore_host_state`].
    #[serde(skip)]
    pub(crate) host_mix: HostMix,
    /// GPUs per model and what model-constrained tenants ask of each: read by the
    /// fragmentation scorer to keep GPUs of a model in demand for the tenants that need it.
    /// Derived, so left out of the serde encoding; recomputed on decoding and by
    /// [`Engine::restore_host_state`].
    #[serde(skip)]
    pub(crate) models: ModelBook,
}

/// The encoded fields of [`Engine`], in the same order and with the same types (the encoding is
/// unchanged): decoding goes through it so that what derives from the nodes is recomputed.
#[derive(Deserialize)]
#[serde(rename = "Engine")]
struct EngineFields {
    config: EngineConfig,
    nodes: BTreeMap<NodeName, Node>,
    tenants: BTreeMap<TenantName, TenantRecord>,
    queue: BTreeSet<QueueKey>,
    free_index: BTreeMap<u32, BTreeSet<NodeName>>,
    workload: WorkloadModel,
    placed_by_priority: BTreeMap<i32, (u64, u64)>,
    scan_cursor: NodeName,
}

impl From<EngineFields> for Engine {
    fn from(fields: EngineFields) -> Engine {
        let mut engine = Engine {
            config: fields.config,
            nodes: fields.nodes,
            tenants: fields.tenants,
            queue: fields.queue,
            free_index: fields.free_index,
            workload: fields.workload,
            placed_by_priority: fields.placed_by_priority,
            scan_cursor: fields.scan_cursor,
            host_mix: HostMix::default(),
            models: ModelBook::default(),
        };
        for node in engine.nodes.values_mut() {
            node.refresh_models();
        }
        // The Kubernetes-managed flags and pins are not decoded yet: this counts as if there were
        // none, and `Engine::restore_host_state` counts again with them.
        engine.models = ModelBook::of_nodes(engine.nodes.values());
        for record in engine.tenants.values() {
            engine.models.kept_milli += HostMix::gpu_milli_of(&record.request);
        }
        assert!(engine.models.demand_milli.is_empty());
        engine
    }
}

/// Per GPU model: how many GPUs the pool has and how much of their compute is free (every node
/// the engine places on, whatever its state: not the Kubernetes-managed ones), and the GPUs
/// (thousandths) that kept model-constrained tenants ask of it, a tenant allowing k models
/// counting 1/k for each (a model nobody constrains to has no demand entry); and the GPUs all
/// kept tenants but the pinned ones ask. Pods' GPUs are the kube-scheduler's, so they weigh
/// nothing in the engine's scoring.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ModelBook {
    pub capacity: BTreeMap<String, u64>,
    pub free_percent: BTreeMap<String, u64>,
    pub free_percent_total: u64,
    pub demand_milli: BTreeMap<String, u128>,
    pub kept_milli: u128,
}

impl ModelBook {
    /// Capacity and free compute from the nodes; no demand.
    fn of_nodes<'a>(nodes: impl Iterator<Item = &'a Node> + Clone) -> ModelBook {
        let nodes = nodes.filter(|node| !node.kubernetes_managed);
        let mut book = ModelBook {
            capacity: Self::capacity_of(nodes.clone()),
            ..ModelBook::default()
        };
        for node in nodes {
            for position in 0..node.usage.len() {
                let free = u64::from(node.gpu_free(position).compute_free_percent);
                *book
                    .free_percent
                    .entry(node.spec.gpus[position].model.clone())
                    .or_default() += free;
                book.free_percent_total += free;
            }
        }
        book
    }

    /// `percent` of a GPU of `model` taken (positive) or given back (negative).
    pub(crate) fn take(&mut self, model: &str, percent: i64) {
        let free = self
            .free_percent
            .get_mut(model)
            .expect("known nodes' models are counted");
        assert!(*free as i64 >= percent && self.free_percent_total as i64 >= percent);
        *free = (*free as i64 - percent) as u64;
        self.free_percent_total = (self.free_percent_total as i64 - percent) as u64;
    }

    fn capacity_of<'a>(nodes: impl Iterator<Item = &'a Node>) -> BTreeMap<String, u64> {
        let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
        for node in nodes {
            for gpu in &node.spec.gpus {
                *capacity.entry(gpu.model.clone()).or_default() += 1;
            }
        }
        capacity
    }

    fn add_node(&mut self, node: &Node) {
        if node.kubernetes_managed {
            return;
        }
        for gpu in &node.spec.gpus {
            *self.capacity.entry(gpu.model.clone()).or_default() += 1;
            *self.free_percent.entry(gpu.model.clone()).or_default() += 100;
            self.free_percent_total += 100;
        }
    }

    fn remove_node(&mut self, node: &Node) {
        if node.kubernetes_managed {
            return;
        }
        for gpu in &node.spec.gpus {
            let count = self
                .capacity
                .get_mut(&gpu.model)
                .expect("known nodes' models are counted");
            assert!(*count >= 1);
            *count -= 1;
            if *count == 0 {
                self.capacity.remove(&gpu.model);
            }
            // A node is removed empty.
            self.take(&gpu.model, 100);
            if self.free_percent[&gpu.model] == 0 && !self.capacity.contains_key(&gpu.model) {
                self.free_percent.remove(&gpu.model);
            }
        }
    }

    /// Each allowed model's share of the tenant's GPUs.
    fn demand_of(request: &Request, constraints: &Constraints) -> u128 {
        let allowed = constraints.gpu_models.len() as u128;
        assert!(allowed >= 1);
        HostMix::gpu_milli_of(request) / allowed
    }

    fn add_demand(&mut self, request: &Request, constraints: &Constraints) {
        if constraints.gpu_models.is_empty() {
            return;
        }
        let share = Self::demand_of(request, constraints);
        for model in &constraints.gpu_models {
            *self.demand_milli.entry(model.clone()).or_default() += share;
        }
    }

    fn remove_demand(&mut self, request: &Request, constraints: &Constraints) {
        if constraints.gpu_models.is_empty() {
            return;
        }
        let share = Self::demand_of(request, constraints);
        for model in &constraints.gpu_models {
            let demand = self
                .demand_milli
                .get_mut(model)
                .expect("kept tenants' models are counted");
            assert!(*demand >= share);
            *demand -= share;
            if *demand == 0 {
                self.demand_milli.remove(model);
            }
        }
    }

    /// How scarce `model` is for the tenants constrained to it, in thousandths (at most 1000):
    /// half the ratio of its share of the kept tenants' GPUs (what constrained arrivals are
    /// expected to ask of it) to its share of the pool's free compute, so 500 when the two shares
    /// are equal and 1000 once its free share is half its demand share. The share of a GPU of
    /// this model that an unconstrained task would take from the tenants that need it. (Half:
    /// on the bench's Constrained mix the full ratio cost a point with CPU in the trace, a
    /// threshold at equal shares lost to BestFit without it; docs/benchmarks.md.)
    pub(crate) fn scarcity_permille(&self, model: &str) -> u64 {
        let Some(&demand) = self.demand_milli.get(model) else {
            return 0;
        };
        let free = u128::from(self.free_percent.get(model).copied().unwrap_or(0));
        let free_total = u128::from(self.free_percent_total);
        if self.kept_milli == 0 || free_total == 0 {
            return 0;
        }
        // demand share / free share, in thousandths: (demand / kept) / (free / free_total).
        let ratio_permille = if free == 0 {
            u128::MAX
        } else {
            1000 * demand * free_total / (self.kept_milli * free)
        };
        (ratio_permille / 2).min(1000) as u64
    }
}

/// Totals over kept tenants that ask for CPU or host memory: GPUs (thousandths), CPU
/// (millicores) and host memory asked. Tenants that ask for neither count nothing, so an engine
/// without constraints has all zeros, decoded or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostMix {
    pub gpu_milli: u128,
    pub cpu_milli: u128,
    pub memory_bytes: u128,
}

impl HostMix {
    fn gpu_milli_of(request: &Request) -> u128 {
        let nodes = u128::from(request.nodes.max(1));
        match request.gpus {
            GpuCount::Whole(gpus) => 1000 * u128::from(gpus) * nodes,
            GpuCount::Milli(milli) => u128::from(milli),
        }
    }

    fn of(request: &Request, constraints: &Constraints) -> HostMix {
        if !constraints.asks_host() {
            return HostMix::default();
        }
        let nodes = u128::from(request.nodes.max(1));
        HostMix {
            gpu_milli: Self::gpu_milli_of(request),
            cpu_milli: u128::from(constraints.cpu_milli) * nodes,
            memory_bytes: u128::from(constraints.host_memory_bytes) * nodes,
        }
    }

    /// Whether any kept tenant asks for CPU or host memory (else nothing is ever stranded).
    pub(crate) fn asks_host(&self) -> bool {
        self.cpu_milli > 0 || self.memory_bytes > 0
    }

    /// GPU compute (percent) of `compute_free_sum` that `host_free` cannot feed at the CPU and
    /// host memory per GPU of the kept tenants that ask for them: stranded behind exhausted CPU or host memory, a
    /// fragment for every shape. 0 when nothing asks for host capacity.
    pub(crate) fn stranded_percent(&self, compute_free_sum: u64, host_free: HostUse) -> u64 {
        // Percent of a GPU that `free` can feed when `per_gpu_total` is needed per `gpu_milli`.
        let feedable = |free: u64, asked_total: u128| -> u128 {
            if asked_total == 0 || free == u64::MAX {
                return u128::MAX;
            }
            u128::from(free) * self.gpu_milli / asked_total / 10
        };
        let feedable_percent = feedable(host_free.cpu_milli, self.cpu_milli)
            .min(feedable(host_free.memory_bytes, self.memory_bytes));
        let stranded = u128::from(compute_free_sum).saturating_sub(feedable_percent);
        assert!(stranded <= u128::from(compute_free_sum));
        stranded as u64
    }

    fn add(&mut self, other: HostMix) {
        self.gpu_milli += other.gpu_milli;
        self.cpu_milli += other.cpu_milli;
        self.memory_bytes += other.memory_bytes;
    }

    fn remove(&mut self, other: HostMix) {
        assert!(
            self.gpu_milli >= other.gpu_milli
                && self.cpu_milli >= other.cpu_milli
                && self.memory_bytes >= other.memory_bytes
        );
        self.gpu_milli -= other.gpu_milli;
        self.cpu_milli -= other.cpu_milli;
        self.memory_bytes -= other.memory_bytes;
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TenantRecord {
    pub request: Request,
    pub seq: u64,
    pub placement: Placement,
    /// Not in the serde encoding (see [`Constraints`]): restored by `Engine::restore_host_state`.
    #[serde(skip)]
    pub constraints: Constraints,
    /// The slices Kubernetes allocated (`Event::SubmitPinned`); `None` for the engine's own
    /// tenants. Not in the serde encoding either, for the same reason: restored by
    /// `Engine::restore_host_state`.
    #[serde(skip)]
    pub pin: Option<Pin>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Placement {
    Placed {
        slices: Vec<SliceAssignment>,
    },
    /// `reason`: the last reason sent in a command, so an unchanged reason is not sent again.
    Pending {
        reason: String,
    },
}

/// Queue order: priority high to low (`priority_negated` ascending), then oldest `seq`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct QueueKey {
    pub priority_negated: i64,
    pub seq: u64,
    pub tenant: TenantName,
}

impl QueueKey {
    pub(crate) fn of(tenant: &str, record: &TenantRecord) -> QueueKey {
        QueueKey {
            priority_negated: -i64::from(record.request.priority),
            seq: record.seq,
            tenant: tenant.to_string(),
        }
    }
}

/// What is allocated on one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuUsage {
    pub compute_allocated_percent: u32,
    pub memory_allocated_bytes: u64,
    /// Tenants holding a slice of this GPU, sorted by name.
    pub tenants: Vec<TenantName>,
}

/// A node as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView<'a> {
    pub spec: &'a NodeSpec,
    pub state: NodeState,
    /// Registered by `Event::RegisterKubernetesNode`: only pinned tenants hold slices here.
    pub kubernetes_managed: bool,
    /// Same order as `spec.gpus`.
    pub usage: Vec<GpuUsage>,
}

/// A node's CPU and host memory: capacity (unset: unbounded) and what placed tenants ask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeHost {
    pub capacity: HostCapacity,
    pub cpu_milli_used: u64,
    pub memory_bytes_used: u64,
}

/// Pool-wide and per-node totals, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSummary {
    pub gpus_total: u64,
    /// Sum over GPUs of allocated compute percent (100 per full GPU).
    pub compute_allocated_percent: u64,
    pub memory_total_bytes: u64,
    pub memory_allocated_bytes: u64,
    pub tenants_placed: u64,
    pub tenants_pending: u64,
}

/// The result of trying to place one pending tenant.
enum Attempt {
    Bound(Vec<Command>),
    Rejected(String),
    Unfit(String),
}

impl Engine {
    pub fn new(config: EngineConfig) -> Engine {
        assert!(
            config.nodes_scored_max >= 1,
            "nodes_scored_max must be at least 1"
        );
        Engine {
            config,
            nodes: BTreeMap::new(),
            tenants: BTreeMap::new(),
            queue: BTreeSet::new(),
            free_index: BTreeMap::new(),
            workload: WorkloadModel::default(),
            placed_by_priority: BTreeMap::new(),
            scan_cursor: NodeName::new(),
            host_mix: HostMix::default(),
            models: ModelBook::default(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Applies one event and returns what was decided, in a deterministic order.
    pub fn handle(&mut self, event: Event) -> Vec<Command> {
        let mut commands = Vec::new();
        match event {
            Event::AddNode(spec) => {
                self.add_node(spec, HostCapacity::default(), false, &mut commands)
            }
            Event::RegisterNode { spec, host } => self.add_node(spec, host, false, &mut commands),
            Event::RegisterKubernetesNode { spec, host } => {
                self.add_node(spec, host, true, &mut commands)
            }
            Event::RemoveNode(name) => self.remove_node(&name, &mut commands),
            Event::SetNodeState { node, state } => self.set_node_state(&node, state, &mut commands),
            Event::Submit {
                tenant,
                request,
                seq,
            } => self.submit(
                tenant,
                request,
                Constraints::default(),
                None,
                seq,
                &mut commands,
            ),
            Event::SubmitConstrained {
                tenant,
                request,
                constraints,
                seq,
            } => self.submit(tenant, request, constraints, None, seq, &mut commands),
            Event::SubmitPinned {
                tenant,
                request,
                pin,
                seq,
            } => {
                let constraints = Constraints::default();
                self.submit(tenant, request, constraints, Some(pin), seq, &mut commands)
            }
            Event::Release { tenant } => self.release(&tenant, &mut commands),
            Event::Retry => self.retry_pending(&mut commands),
            Event::Update {
                tenant,
                compute_percent,
                priority,
            } => self.update(&tenant, compute_percent, priority, &mut commands),
        }
        commands
    }

    /// What the serde encoding leaves out: non-default host capacities and constraints, the
    /// Kubernetes-managed nodes and the pins.
    pub fn host_state(&self) -> HostState {
        let nodes = self
            .nodes
            .iter()
            .filter(|(_, node)| node.host != HostCapacity::default())
            .map(|(name, node)| (name.clone(), node.host))
            .collect();
        let tenants = self
            .tenants
            .iter()
            .filter(|(_, record)| record.constraints != Constraints::default())
            .map(|(name, record)| (name.clone(), record.constraints.clone()))
            .collect();
        let kubernetes_nodes = self
            .nodes
            .iter()
            .filter(|(_, node)| node.kubernetes_managed)
            .map(|(name, _)| name.clone())
            .collect();
        let pins = self
            .tenants
            .iter()
            .filter_map(|(name, record)| Some((name.clone(), record.pin.clone()?)))
            .collect();
        HostState {
            nodes,
            tenants,
            kubernetes_nodes,
            pins,
        }
    }

    /// Gives a decoded engine back what [`Engine::host_state`] took from it, and recomputes what
    /// derives from it. Call it after every decode (with the default state when none was kept).
    /// Panics on names the engine does not know or on host capacity over-committed: the state
    /// must come from the same engine.
    pub fn restore_host_state(&mut self, state: HostState) {
        for node in self.nodes.values_mut() {
            node.host = state
                .nodes
                .get(&node.spec.name)
                .copied()
                .unwrap_or_default();
            node.host_used = HostUse::default();
            node.kubernetes_managed = state.kubernetes_nodes.contains(&node.spec.name);
        }
        assert!(
            state
                .nodes
                .keys()
                .chain(&state.kubernetes_nodes)
                .all(|name| self.nodes.contains_key(name)),
            "host state names an unknown node"
        );
        assert!(
            state
                .tenants
                .keys()
                .chain(state.pins.keys())
                .all(|name| self.tenants.contains_key(name)),
            "host state names an unknown tenant"
        );
        // The free index holds the schedulable nodes, which the Kubernetes-managed ones are not.
        self.free_index = BTreeMap::new();
        let schedulable: Vec<NodeName> = self
            .nodes
            .iter()
            .filter(|(_, node)| node.schedulable())
            .map(|(name, _)| name.clone())
            .collect();
        for name in schedulable {
            self.index_insert(&name);
        }
        self.host_mix = HostMix::default();
        self.models = ModelBook::of_nodes(self.nodes.values());
        for (name, record) in &mut self.tenants {
            record.constraints = state.tenants.get(name).cloned().unwrap_or_default();
            record.pin = state.pins.get(name).cloned();
            if record.pin.is_none() {
                self.models.kept_milli += HostMix::gpu_milli_of(&record.request);
            }
            self.models.add_demand(&record.request, &record.constraints);
            self.host_mix
                .add(HostMix::of(&record.request, &record.constraints));
            if let Placement::Placed { slices } = &record.placement {
                for node_name in slice_nodes(slices) {
                    let node = self
                        .nodes
                        .get_mut(node_name)
                        .expect("slices name known nodes");
                    node.host_allocate(&record.constraints);
                }
            }
        }
        assert_eq!(self.host_state(), state, "restored host state differs");
    }

    /// A node's host capacity and what the placed tenants' constraints take of it.
    pub fn node_host(&self, name: &str) -> Option<NodeHost> {
        let node = self.nodes.get(name)?;
        Some(NodeHost {
            capacity: node.host,
            cpu_milli_used: node.host_used.cpu_milli,
            memory_bytes_used: node.host_used.memory_bytes,
        })
    }

    /// A kept tenant's pin (`None` for the engine's own tenants and unknown ones).
    pub fn pin(&self, tenant: &str) -> Option<&Pin> {
        self.tenants.get(tenant)?.pin.as_ref()
    }

    /// A kept tenant's constraints (the default for one submitted without).
    pub fn constraints(&self, tenant: &str) -> Option<&Constraints> {
        Some(&self.tenants.get(tenant)?.constraints)
    }

    pub fn node(&self, name: &str) -> Option<NodeView<'_>> {
        self.nodes.get(name).map(Self::view)
    }

    /// All nodes, sorted by name.
    pub fn nodes(&self) -> Vec<NodeView<'_>> {
        self.nodes.values().map(Self::view).collect()
    }

    fn view(node: &Node) -> NodeView<'_> {
        NodeView {
            spec: &node.spec,
            state: node.state,
            kubernetes_managed: node.kubernetes_managed,
            usage: node.usage.clone(),
        }
    }

    /// The slices a tenant holds, if placed.
    pub fn slices(&self, tenant: &str) -> Option<&[SliceAssignment]> {
        match &self.tenants.get(tenant)?.placement {
            Placement::Placed { slices } => Some(slices),
            Placement::Pending { .. } => None,
        }
    }

    /// The reason last sent for a pending tenant (`None` when placed or unknown).
    pub fn pending_reason(&self, tenant: &str) -> Option<&str> {
        match &self.tenants.get(tenant)?.placement {
            Placement::Placed { .. } => None,
            Placement::Pending { reason } => Some(reason),
        }
    }

    /// Pending tenants in queue order (priority high to low, then oldest first).
    pub fn pending(&self) -> Vec<TenantName> {
        self.queue.iter().map(|key| key.tenant.clone()).collect()
    }

    /// How many tenants are pending, without listing them.
    pub fn pending_count(&self) -> usize {
        self.queue.len()
    }

    /// Every node's name and state, sorted by name, copying nothing: the control plane's leader
    /// looks at them several times a second, which [`Engine::nodes`] (a usage copy per node)
    /// makes costly with thousands of nodes.
    pub fn node_states(&self) -> impl Iterator<Item = (&str, NodeState)> + '_ {
        self.nodes
            .iter()
            .map(|(name, node)| (name.as_str(), node.state))
    }

    pub fn summary(&self) -> PoolSummary {
        let mut summary = PoolSummary::default();
        for node in self.nodes.values() {
            Self::add_node_totals(node, &mut summary);
        }
        summary.tenants_pending = self.queue.len() as u64;
        summary.tenants_placed = self.tenants.len() as u64 - summary.tenants_pending;
        summary
    }

    /// Per-node summaries, sorted by node name. `tenants_placed` counts tenants with a slice on
    /// the node; `tenants_pending` is always 0 (pending tenants have no node).
    pub fn node_summaries(&self) -> Vec<(NodeName, PoolSummary)> {
        self.nodes
            .iter()
            .map(|(name, node)| {
                let mut summary = PoolSummary {
                    tenants_placed: node.tenants().len() as u64,
                    ..PoolSummary::default()
                };
                Self::add_node_totals(node, &mut summary);
                (name.clone(), summary)
            })
            .collect()
    }

    fn add_node_totals(node: &Node, summary: &mut PoolSummary) {
        summary.gpus_total += node.spec.gpus.len() as u64;
        // Saturating: GPU memory comes from agents, and a total that overflowed panicked the
        // `/metrics` handler (the control plane bounds each GPU; this holds without it too).
        for (gpu, usage) in node.spec.gpus.iter().zip(&node.usage) {
            summary.compute_allocated_percent = summary
                .compute_allocated_percent
                .saturating_add(u64::from(usage.compute_allocated_percent));
            summary.memory_total_bytes =
                summary.memory_total_bytes.saturating_add(gpu.memory_bytes);
            summary.memory_allocated_bytes = summary
                .memory_allocated_bytes
                .saturating_add(usage.memory_allocated_bytes);
        }
    }

    // ---- events ----

    fn add_node(
        &mut self,
        spec: NodeSpec,
        host: HostCapacity,
        kubernetes_managed: bool,
        commands: &mut Vec<Command>,
    ) {
        let name = spec.name.clone();
        if let Some(existing) = self.nodes.get(&name) {
            let host_still_fits = host
                .cpu_milli
                .is_none_or(|cpu| existing.host_used.cpu_milli <= cpu)
                && host
                    .memory_bytes
                    .is_none_or(|memory| existing.host_used.memory_bytes <= memory);
            let same_kind = existing.kubernetes_managed == kubernetes_managed;
            if existing.spec.gpus == spec.gpus && host_still_fits && same_kind {
                // Same hardware: keep its tenants, take the new labels, schedulable again.
                self.index_remove(&name);
                let node = self.nodes.get_mut(&name).expect("checked above");
                node.spec = spec;
                node.refresh_models();
                node.host = host;
                node.state = NodeState::Ready;
                self.index_insert(&name);
                self.retry_pending(commands);
                return;
            }
            let reason = if !same_kind && kubernetes_managed {
                format!("node {name} re-registered as Kubernetes-managed")
            } else if !same_kind {
                format!("node {name} re-registered as no longer Kubernetes-managed")
            } else if existing.spec.gpus == spec.gpus {
                format!(
                    "node {name} re-registered with less CPU or host memory than its tenants use"
                )
            } else {
                format!("node {name} re-registered with a different GPU inventory")
            };
            self.forget_node(&name, &reason, commands);
        }
        let mut node = Node::new(spec);
        node.host = host;
        node.kubernetes_managed = kubernetes_managed;
        self.models.add_node(&node);
        assert_eq!(node.state, NodeState::Ready);
        self.nodes.insert(name.clone(), node);
        self.index_insert(&name);
        self.retry_pending(commands);
    }

    fn remove_node(&mut self, name: &str, commands: &mut Vec<Command>) {
        if !self.nodes.contains_key(name) {
            return;
        }
        self.forget_node(name, &format!("node {name} was removed"), commands);
        self.retry_pending(commands);
    }

    /// Unbinds and re-places the node's tenants, then drops the node.
    fn forget_node(&mut self, name: &str, reason: &str, commands: &mut Vec<Command>) {
        self.index_remove(name);
        // Unschedulable while its tenants are re-placed, so none lands back on it.
        self.nodes.get_mut(name).expect("known node").state = NodeState::Draining;
        // Pinned tenants too: their GPUs are gone.
        self.displace_tenants(name, reason, false, commands);
        let node = self.nodes.remove(name).expect("known node");
        self.models.remove_node(&node);
        assert!(node.usage.iter().all(|usage| usage.tenants.is_empty()));
        assert!(!self.free_index.values().any(|bucket| bucket.contains(name)));
    }

    fn set_node_state(&mut self, name: &str, state: NodeState, commands: &mut Vec<Command>) {
        let Some(node) = self.nodes.get(name) else {
            return;
        };
        let state_before = node.state;
        if state_before == state {
            return;
        }
        self.index_remove(name);
        self.nodes.get_mut(name).expect("checked above").state = state;
        self.index_insert(name);
        match (state_before, state) {
            (_, NodeState::Ready) => self.retry_pending(commands),
            (NodeState::Ready, _) => {
                let reason = format!("node {name} is {state:?}");
                // Pinned tenants stay: the kubelet, not vgpu, decides what becomes of the pod.
                self.displace_tenants(name, &reason, true, commands);
                self.retry_pending(commands);
            }
            // Lost <-> Draining: it has only pinned tenants (the others left when it stopped
            // being Ready).
            _ => assert!(
                self.nodes[name]
                    .tenants()
                    .iter()
                    .all(|tenant| self.tenants[tenant].pin.is_some())
            ),
        }
    }

    /// `Unbound` every tenant of the node (but the pinned ones when `keep_pinned`), then a
    /// `Bind` or `Pending` for each, in queue order.
    fn displace_tenants(
        &mut self,
        name: &str,
        reason: &str,
        keep_pinned: bool,
        commands: &mut Vec<Command>,
    ) {
        assert_ne!(self.nodes[name].state, NodeState::Ready);
        let mut displaced = self.nodes[name].tenants();
        if keep_pinned {
            displaced.retain(|tenant| self.tenants[tenant].pin.is_none());
        }
        for tenant in &displaced {
            self.unbind(tenant, reason);
            commands.push(Command::Unbound {
                tenant: tenant.clone(),
                reason: reason.to_string(),
            });
        }
        let mut in_queue_order: Vec<QueueKey> = displaced
            .iter()
            .map(|tenant| QueueKey::of(tenant, &self.tenants[tenant]))
            .collect();
        in_queue_order.sort();
        for key in in_queue_order {
            // An earlier displaced tenant may have preempted... only placed tenants, so this one is
            // still pending.
            assert!(matches!(
                self.tenants[&key.tenant].placement,
                Placement::Pending { .. }
            ));
            match self.attempt(&key.tenant, false) {
                Attempt::Bound(bound) => commands.extend(bound),
                Attempt::Unfit(reason) => {
                    self.set_pending_reason(&key.tenant, reason.clone());
                    commands.push(Command::Pending {
                        tenant: key.tenant,
                        reason,
                    });
                }
                Attempt::Rejected(_) => unreachable!("no reject check on re-placement"),
            }
        }
    }

    fn submit(
        &mut self,
        tenant: TenantName,
        request: Request,
        constraints: Constraints,
        pin: Option<Pin>,
        seq: u64,
        commands: &mut Vec<Command>,
    ) {
        assert!(
            !self.tenants.contains_key(&tenant),
            "duplicate tenant {tenant}: the control plane checks first"
        );
        assert!(
            pin.is_none() || constraints == Constraints::default(),
            "a pin carries no constraints"
        );
        let pinned = pin.is_some();
        let need = match Need::of(&request) {
            Ok(need) => need,
            Err(reason) => {
                commands.push(Command::Reject { tenant, reason });
                return;
            }
        };
        let mix = HostMix::of(&request, &constraints);
        // What the model book counts once the tenant is kept (after the decision, as `observe`).
        let kept_milli = HostMix::gpu_milli_of(&request);
        let model_demand =
            (!constraints.gpu_models.is_empty()).then(|| (request.clone(), constraints.clone()));
        let record = TenantRecord {
            request,
            seq,
            placement: Placement::Pending {
                reason: String::new(),
            },
            constraints,
            pin,
        };
        self.queue.insert(QueueKey::of(&tenant, &record));
        self.tenants.insert(tenant.clone(), record);
        match self.attempt(&tenant, true) {
            Attempt::Bound(bound) => commands.extend(bound),
            Attempt::Rejected(reason) => {
                let record = self.tenants.remove(&tenant).expect("inserted above");
                assert!(self.queue.remove(&QueueKey::of(&tenant, &record)));
                commands.push(Command::Reject { tenant, reason });
                return;
            }
            Attempt::Unfit(reason) => {
                assert!(!pinned, "a pinned tenant is bound or rejected at once");
                self.set_pending_reason(&tenant, reason.clone());
                commands.push(Command::Pending { tenant, reason });
            }
        }
        self.host_mix.add(mix);
        if !pinned {
            self.models.kept_milli += kept_milli;
        }
        if let Some((request, constraints)) = model_demand {
            self.models.add_demand(&request, &constraints);
        }
        // Counted after the decision: the model describes tenants kept (placed or pending). Not
        // pinned ones: the model predicts what the engine will be asked to place, and pods never
        // are.
        if !pinned {
            self.workload.observe(need.shape());
        }
    }

    fn release(&mut self, tenant: &str, commands: &mut Vec<Command>) {
        let Some(record) = self.tenants.get(tenant) else {
            commands.push(Command::Released {
                tenant: tenant.to_string(),
            });
            return;
        };
        let was_placed = matches!(record.placement, Placement::Placed { .. });
        if was_placed {
            self.unbind(tenant, "released");
        }
        let record = self.tenants.remove(tenant).expect("checked above");
        assert!(self.queue.remove(&QueueKey::of(tenant, &record)));
        self.host_mix
            .remove(HostMix::of(&record.request, &record.constraints));
        self.models
            .remove_demand(&record.request, &record.constraints);
        if record.pin.is_none() {
            let kept_milli = HostMix::gpu_milli_of(&record.request);
            assert!(self.models.kept_milli >= kept_milli);
            self.models.kept_milli -= kept_milli;
        }
        commands.push(Command::Released {
            tenant: tenant.to_string(),
        });
        if was_placed {
            self.retry_pending(commands);
        }
    }

    /// Tries pending tenants in queue order, at most `retry_per_event_max`; a tenant that does
    /// not fit does not block the ones behind it (backfill). Sends `Pending` only when a reason
    /// changes.
    pub(crate) fn retry_pending(&mut self, commands: &mut Vec<Command>) {
        let batch: Vec<TenantName> = self
            .queue
            .iter()
            .take(self.config.retry_per_event_max)
            .map(|key| key.tenant.clone())
            .collect();
        for tenant in batch {
            // Tenants preempted during this pass join the queue but are not in `batch`; tenants in
            // `batch` stay pending until their own attempt (only placed tenants are evicted).
            assert!(matches!(
                self.tenants[&tenant].placement,
                Placement::Pending { .. }
            ));
            match self.attempt(&tenant, false) {
                Attempt::Bound(bound) => commands.extend(bound),
                Attempt::Unfit(reason) => {
                    if self.pending_reason(&tenant) != Some(reason.as_str()) {
                        self.set_pending_reason(&tenant, reason.clone());
                        commands.push(Command::Pending { tenant, reason });
                    }
                }
                Attempt::Rejected(_) => unreachable!("no reject check on retry"),
            }
        }
    }

    /// Places a pending tenant if it fits now, else (guaranteed only) by preemption.
    /// A pinned tenant is bound to its pin or not at all (rejected when `reject_check`).
    fn attempt(&mut self, tenant: &str, reject_check: bool) -> Attempt {
        if let Some(pin) = self.tenants[tenant].pin.clone() {
            let request = &self.tenants[tenant].request;
            return match self.pinned_slices(request, &pin) {
                Ok(slices) => {
                    self.bind(tenant, slices.clone());
                    Attempt::Bound(vec![Command::Bind {
                        tenant: tenant.to_string(),
                        slices,
                    }])
                }
                Err(reason) if reject_check => Attempt::Rejected(reason),
                Err(reason) => Attempt::Unfit(reason),
            };
        }
        let request = self.tenants[tenant].request.clone();
        let constraints = self.tenants[tenant].constraints.clone();
        let need = Need::of(&request).expect("validated at submit");
        if let Some(found) = self.find(&request, &constraints, need, None) {
            self.scan_cursor = found.cursor_next;
            self.bind(tenant, found.slices.clone());
            return Attempt::Bound(vec![Command::Bind {
                tenant: tenant.to_string(),
                slices: found.slices,
            }]);
        }
        if reject_check && let Some(reason) = self.never_fits_reason(&request, &constraints, need) {
            return Attempt::Rejected(reason);
        }
        if !request.preemptible
            && let Some(commands) = self.try_preempt(tenant)
        {
            return Attempt::Bound(commands);
        }
        Attempt::Unfit(self.unfit_reason(&request, &constraints, need))
    }

    /// The slices of `pin` for a tenant asking `request`, if they fit now; else why not, for a
    /// person. Every check of a pin is here, so a pin the control plane admitted but the pool
    /// cannot hold is refused with a reason, never a panic.
    fn pinned_slices(&self, request: &Request, pin: &Pin) -> Result<Vec<SliceAssignment>, String> {
        let gpus_asked = match Need::of(request)? {
            Need::Fraction { .. } => 1,
            Need::Whole { gpus, nodes: 1, .. } => gpus as usize,
            Need::Whole { .. } => {
                return Err("a pin is on one node; the request asks for several".to_string());
            }
        };
        if pin.gpus.len() != gpus_asked {
            return Err(format!(
                "the pin has {} GPUs and the request asks for {gpus_asked}",
                pin.gpus.len()
            ));
        }
        let node_name = &pin.node;
        let Some(node) = self.nodes.get(node_name) else {
            return Err(format!("the pool has no node {node_name}"));
        };
        if !node.kubernetes_managed {
            return Err(format!(
                "node {node_name} is not Kubernetes-managed: vgpu places its tenants there; pin only to nodes whose agent runs with --kubernetes-managed"
            ));
        }
        if node.state != NodeState::Ready {
            return Err(format!("node {node_name} is {:?}", node.state));
        }
        let mut slices = Vec::with_capacity(pin.gpus.len());
        let mut seen = BTreeSet::new();
        for pinned in &pin.gpus {
            let Some(position) = node
                .spec
                .gpus
                .iter()
                .position(|gpu| gpu.uuid == pinned.uuid)
            else {
                return Err(format!("node {node_name} has no GPU {}", pinned.uuid));
            };
            if !seen.insert(position) {
                return Err(format!("the pin names GPU {} twice", pinned.uuid));
            }
            let gpu = &node.spec.gpus[position];
            let usage = &node.usage[position];
            if !(1..=100).contains(&pinned.compute_percent) {
                return Err(format!(
                    "the pin asks {}% of GPU {}; a slice is 1 to 100%",
                    pinned.compute_percent, gpu.uuid
                ));
            }
            let compute_free = 100 - usage.compute_allocated_percent;
            let memory_free = gpu.memory_bytes - usage.memory_allocated_bytes;
            if pinned.compute_percent > compute_free
                || pinned.memory_bytes > memory_free
                || usage.tenants.len() >= crate::node::SLICES_PER_GPU_MAX
            {
                return Err(format!(
                    "GPU {} of node {node_name} has {compute_free}% and {memory_free} bytes free, and the pin asks {}% and {} bytes (its tenants: {})",
                    gpu.uuid,
                    pinned.compute_percent,
                    pinned.memory_bytes,
                    usage.tenants.join(", ")
                ));
            }
            slices.push(SliceAssignment {
                node: node_name.clone(),
                gpu_uuid: gpu.uuid.clone(),
                gpu_index: gpu.index,
                compute_percent: pinned.compute_percent,
                memory_bytes: pinned.memory_bytes,
                guaranteed: !request.preemptible,
                burst: request.burst,
            });
        }
        assert_eq!(slices.len(), gpus_asked);
        Ok(slices)
    }

    fn set_pending_reason(&mut self, tenant: &str, reason: String) {
        let record = self.tenants.get_mut(tenant).expect("known tenant");
        assert!(matches!(record.placement, Placement::Pending { .. }));
        record.placement = Placement::Pending { reason };
    }

    // ---- allocation ----

    /// Gives `slices` to a pending tenant and takes it off the queue.
    pub(crate) fn bind(&mut self, tenant: &str, slices: Vec<SliceAssignment>) {
        assert!(!slices.is_empty());
        let key = QueueKey::of(tenant, &self.tenants[tenant]);
        assert!(self.queue.remove(&key), "only pending tenants are bound");
        for slice in &slices {
            self.index_remove(&slice.node);
            let node = self
                .nodes
                .get_mut(&slice.node)
                .expect("slices name known nodes");
            assert_eq!(node.state, NodeState::Ready);
            let position = node.position_of[&slice.gpu_index];
            node.allocate(position, tenant, slice.compute_percent, slice.memory_bytes);
            if !node.kubernetes_managed {
                let model = &node.spec.gpus[position].model;
                self.models.take(model, i64::from(slice.compute_percent));
            }
            self.index_insert(&slice.node);
        }
        let constraints = &self.tenants[tenant].constraints;
        if constraints.asks_host() {
            for node_name in slice_nodes(&slices) {
                let node = self
                    .nodes
                    .get_mut(node_name)
                    .expect("slices name known nodes");
                node.host_allocate(constraints);
            }
        }
        let record = self.tenants.get_mut(tenant).expect("known tenant");
        record.placement = Placement::Placed { slices };
        let counts = self
            .placed_by_priority
            .entry(record.request.priority)
            .or_default();
        if record.request.preemptible {
            counts.1 += 1;
        } else {
            counts.0 += 1;
        }
    }

    /// Frees a placed tenant's slices and queues it as pending with `reason`; returns the slices.
    pub(crate) fn unbind(&mut self, tenant: &str, reason: &str) -> Vec<SliceAssignment> {
        let record = self.tenants.get_mut(tenant).expect("known tenant");
        let placement = std::mem::replace(
            &mut record.placement,
            Placement::Pending {
                reason: reason.to_string(),
            },
        );
        let Placement::Placed { slices } = placement else {
            panic!("unbind of pending tenant {tenant}")
        };
        let key = QueueKey::of(tenant, record);
        let counts = self
            .placed_by_priority
            .get_mut(&record.request.priority)
            .expect("placed tenants are counted");
        if record.request.preemptible {
            assert!(counts.1 >= 1);
            counts.1 -= 1;
        } else {
            assert!(counts.0 >= 1);
            counts.0 -= 1;
        }
        if *counts == (0, 0) {
            self.placed_by_priority.remove(&record.request.priority);
        }
        for slice in &slices {
            self.index_remove(&slice.node);
            let node = self
                .nodes
                .get_mut(&slice.node)
                .expect("slices name known nodes");
            let position = node.position_of[&slice.gpu_index];
            node.free(position, tenant, slice.compute_percent, slice.memory_bytes);
            if !node.kubernetes_managed {
                let model = &node.spec.gpus[position].model;
                self.models.take(model, -i64::from(slice.compute_percent));
            }
            self.index_insert(&slice.node);
        }
        let constraints = &self.tenants[tenant].constraints;
        if constraints.asks_host() {
            for node_name in slice_nodes(&slices) {
                let node = self
                    .nodes
                    .get_mut(node_name)
                    .expect("slices name known nodes");
                node.host_free_of(constraints);
            }
        }
        assert!(self.queue.insert(key), "a placed tenant is not queued");
        slices
    }

    pub(crate) fn index_remove(&mut self, name: &str) {
        let node = &self.nodes[name];
        if !node.schedulable() {
            return;
        }
        let count = node.summary.fully_free_count();
        let bucket = self
            .free_index
            .get_mut(&count)
            .expect("Ready nodes are indexed");
        assert!(bucket.remove(name));
        if bucket.is_empty() {
            self.free_index.remove(&count);
        }
    }

    pub(crate) fn index_insert(&mut self, name: &str) {
        let node = &self.nodes[name];
        if !node.schedulable() {
            return;
        }
        let inserted = self
            .free_index
            .entry(node.summary.fully_free_count())
            .or_default()
            .insert(name.to_string());
        assert!(inserted);
    }

    /// Panics unless the bookkeeping is consistent: usage equals the sum of placed tenants'
    /// slices, nothing is over-committed, gangs are whole, the queue holds exactly the pending
    /// tenants, the free index holds exactly the schedulable nodes (Ready, not
    /// Kubernetes-managed), and only pinned tenants are on Kubernetes-managed nodes. O(pool): for
    /// tests and benches.
    pub fn check_invariants(&self) {
        let mut expected: BTreeMap<(&str, u32), GpuUsage> = BTreeMap::new();
        let mut host_expected: BTreeMap<&str, HostUse> = BTreeMap::new();
        let mut mix_expected = HostMix::default();
        let mut models_expected = ModelBook::of_nodes(self.nodes.values());
        for (tenant, record) in &self.tenants {
            let key = QueueKey::of(tenant, record);
            mix_expected.add(HostMix::of(&record.request, &record.constraints));
            models_expected.add_demand(&record.request, &record.constraints);
            if record.pin.is_none() {
                models_expected.kept_milli += HostMix::gpu_milli_of(&record.request);
            }
            match &record.placement {
                Placement::Pending { .. } => {
                    assert!(self.queue.contains(&key), "{tenant} pending but not queued")
                }
                Placement::Placed { slices } => {
                    assert!(!self.queue.contains(&key), "{tenant} placed and queued");
                    let need = Need::of(&record.request).expect("kept tenants are valid");
                    let (gpus, nodes) = match need {
                        Need::Fraction { .. } => (1, 1),
                        Need::Whole { gpus, nodes, .. } => (gpus, nodes),
                    };
                    assert_eq!(
                        slices.len(),
                        (gpus * nodes) as usize,
                        "{tenant}: gang not whole"
                    );
                    let distinct_gpus: BTreeSet<(&str, u32)> = slices
                        .iter()
                        .map(|s| (s.node.as_str(), s.gpu_index))
                        .collect();
                    assert_eq!(distinct_gpus.len(), slices.len(), "{tenant}: a GPU twice");
                    let distinct_nodes: BTreeSet<&str> =
                        slices.iter().map(|s| s.node.as_str()).collect();
                    assert_eq!(
                        distinct_nodes.len(),
                        nodes as usize,
                        "{tenant}: gang nodes not distinct"
                    );
                    for node_name in slice_nodes(slices) {
                        let node = &self.nodes[node_name];
                        assert!(
                            positions_of_slices(node, slices).all(|position| record
                                .constraints
                                .allows_model(&node.spec.gpus[position].model)),
                            "{tenant}: a GPU of a model it does not allow"
                        );
                        let host = host_expected.entry(node_name).or_default();
                        host.cpu_milli += record.constraints.cpu_milli;
                        host.memory_bytes += record.constraints.host_memory_bytes;
                    }
                    for slice in slices {
                        let node = &self.nodes[&slice.node];
                        // Pinned tenants stay on a Lost or Draining node; the others leave.
                        assert!(
                            node.state == NodeState::Ready || record.pin.is_some(),
                            "{tenant} placed on a node not Ready"
                        );
                        assert_eq!(
                            node.kubernetes_managed,
                            record.pin.is_some(),
                            "{tenant}: pinned tenants, and only they, are on Kubernetes-managed nodes"
                        );
                        let usage = expected
                            .entry((slice.node.as_str(), slice.gpu_index))
                            .or_default();
                        usage.compute_allocated_percent += slice.compute_percent;
                        usage.memory_allocated_bytes += slice.memory_bytes;
                        usage.tenants.push(tenant.clone());
                    }
                }
            }
        }
        let mut placed_by_priority: BTreeMap<i32, (u64, u64)> = BTreeMap::new();
        for record in self.tenants.values() {
            if matches!(record.placement, Placement::Placed { .. }) {
                let counts = placed_by_priority
                    .entry(record.request.priority)
                    .or_default();
                if record.request.preemptible {
                    counts.1 += 1;
                } else {
                    counts.0 += 1;
                }
            }
        }
        assert_eq!(
            placed_by_priority, self.placed_by_priority,
            "placed_by_priority is stale"
        );
        assert_eq!(
            self.queue.len(),
            self.tenants
                .values()
                .filter(|r| matches!(r.placement, Placement::Pending { .. }))
                .count()
        );
        let mut indexed = 0usize;
        for (name, node) in &self.nodes {
            assert_eq!(name, &node.spec.name);
            for (gpu, usage) in node.spec.gpus.iter().zip(&node.usage) {
                assert!(
                    usage.compute_allocated_percent <= 100,
                    "{name} GPU {}: compute over-committed",
                    gpu.index
                );
                assert!(
                    usage.memory_allocated_bytes <= gpu.memory_bytes,
                    "{name} GPU {}: memory over-committed",
                    gpu.index
                );
                let want = expected
                    .remove(&(name.as_str(), gpu.index))
                    .unwrap_or_default();
                assert_eq!(
                    usage, &want,
                    "{name} GPU {}: usage differs from the tenants' slices",
                    gpu.index
                );
            }
            assert_eq!(
                node.host_used,
                host_expected.remove(name.as_str()).unwrap_or_default(),
                "{name}: host use differs from the tenants' constraints"
            );
            let _ = node.host_free(); // Asserts nothing is over-committed.
            let mut refreshed = node.clone();
            refreshed.topology = crate::topology::Topology::new(&node.spec);
            refreshed.refresh_summary();
            refreshed.refresh_models();
            assert_eq!(
                &refreshed, node,
                "{name}: derived topology or summary is stale"
            );
            if node.schedulable() {
                indexed += 1;
                assert!(self.free_index[&node.summary.fully_free_count()].contains(name));
            }
        }
        assert!(expected.is_empty(), "slices on unknown GPUs: {expected:?}");
        assert_eq!(mix_expected, self.host_mix, "host_mix is stale");
        assert_eq!(models_expected, self.models, "models is stale");
        assert_eq!(
            indexed,
            self.free_index.values().map(BTreeSet::len).sum::<usize>()
        );
    }
}

/// The distinct nodes of `slices`, by name: a tenant's constraints are charged once per node.
pub(crate) fn slice_nodes(slices: &[SliceAssignment]) -> BTreeSet<&str> {
    slices.iter().map(|slice| slice.node.as_str()).collect()
}

/// Positions on `node` of the slices of `slices` that are on it.
fn positions_of_slices<'a>(
    node: &'a Node,
    slices: &'a [SliceAssignment],
) -> impl Iterator<Item = usize> + 'a {
    slices
        .iter()
        .filter(|slice| slice.node == node.spec.name)
        .map(|slice| node.position_of[&slice.gpu_index])
}
