//! One node's allocation state: its spec, schedulability, per-GPU usage, derived topology, and
//! the summary the search reads to skip infeasible nodes without looking at their GPUs.

use crate::engine::GpuUsage;
use crate::topology::{Topology, bit};
use crate::types::{Constraints, HostCapacity, NodeSpec, NodeState, TenantName};
use crate::workload::GpuFree;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most slices one GPU can hold: every slice takes at least 1% compute.
pub(crate) const SLICES_PER_GPU_MAX: usize = 100;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Node {
    pub spec: NodeSpec,
    pub state: NodeState,
    /// Same order as `spec.gpus`.
    pub usage: Vec<GpuUsage>,
    pub topology: Topology,
    /// GPU index -> position in `spec.gpus`.
    pub position_of: BTreeMap<u32, usize>,
    pub summary: NodeSummary,
    /// Host capacity; not in the serde encoding (see [`HostCapacity`]): restored by
    /// `Engine::restore_host_state`.
    #[serde(skip)]
    pub host: HostCapacity,
    /// CPU and host memory taken by the placed tenants' constraints (once per tenant on this
    /// node); derived, so also left out of the encoding.
    #[serde(skip)]
    pub host_used: HostUse,
    /// The model of every GPU when they all have one (the common case), so that a model
    /// constraint is one lookup per node rather than one per GPU. Derived from the spec: left out
    /// of the encoding, recomputed on decoding (`Engine`'s `From<EngineFields>`).
    #[serde(skip)]
    pub model_of_all: Option<String>,
    /// Registered as Kubernetes-managed (`Event::RegisterKubernetesNode`): only pinned tenants
    /// hold slices here. Not in the serde encoding, like `host`: restored by
    /// `Engine::restore_host_state`.
    #[serde(skip)]
    pub kubernetes_managed: bool,
}

/// CPU and host memory allocated on one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostUse {
    pub cpu_milli: u64,
    pub memory_bytes: u64,
}

/// Kept up to date on every allocation change (O(GPUs per node)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeSummary {
    /// GPUs with nothing allocated, as a bitmask over positions.
    pub fully_free_mask: u64,
    pub compute_free_sum_percent: u64,
    /// Over all GPUs; compute and memory may be on different GPUs (a filter, not a fit).
    pub compute_free_max_percent: u32,
    pub memory_free_max_bytes: u64,
    /// Smallest GPU memory on the node: lower bound of a proportional fraction's memory.
    pub memory_gpu_min_bytes: u64,
}

impl NodeSummary {
    pub(crate) fn fully_free_count(&self) -> u32 {
        self.fully_free_mask.count_ones()
    }
}

impl Node {
    /// Whether the engine may choose this node: Ready and not Kubernetes-managed (its GPUs are
    /// the kube-scheduler's). Search, preemption and re-placement look only at these nodes, and
    /// the free-GPU index holds exactly these.
    pub(crate) fn schedulable(&self) -> bool {
        self.state == NodeState::Ready && !self.kubernetes_managed
    }

    pub(crate) fn new(spec: NodeSpec) -> Node {
        let topology = Topology::new(&spec);
        let position_of = spec
            .gpus
            .iter()
            .enumerate()
            .map(|(position, gpu)| (gpu.index, position))
            .collect();
        let usage = vec![GpuUsage::default(); spec.gpus.len()];
        let mut node = Node {
            spec,
            state: NodeState::Ready,
            usage,
            topology,
            position_of,
            summary: NodeSummary::default(),
            host: HostCapacity::default(),
            host_used: HostUse::default(),
            model_of_all: None,
            kubernetes_managed: false,
        };
        node.refresh_models();
        node.refresh_summary();
        assert_eq!(
            node.summary.fully_free_count() as usize,
            node.spec.gpus.len()
        );
        node
    }

    /// Free CPU and host memory; `u64::MAX` where the capacity is not reported.
    pub(crate) fn host_free(&self) -> HostUse {
        let free = |capacity: Option<u64>, used: u64| {
            capacity.map_or(u64::MAX, |capacity| {
                assert!(used <= capacity, "{}: host over-committed", self.spec.name);
                capacity - used
            })
        };
        HostUse {
            cpu_milli: free(self.host.cpu_milli, self.host_used.cpu_milli),
            memory_bytes: free(self.host.memory_bytes, self.host_used.memory_bytes),
        }
    }

    /// Whether `constraints`' CPU and host memory fit what is free here now.
    pub(crate) fn host_fits(&self, constraints: &Constraints) -> bool {
        if !constraints.asks_host() {
            return true;
        }
        let free = self.host_free();
        constraints.cpu_milli <= free.cpu_milli
            && constraints.host_memory_bytes <= free.memory_bytes
    }

    /// Whether `constraints`' CPU and host memory fit this node when empty.
    pub(crate) fn host_could_fit(&self, constraints: &Constraints) -> bool {
        self.host
            .cpu_milli
            .is_none_or(|cpu| constraints.cpu_milli <= cpu)
            && self
                .host
                .memory_bytes
                .is_none_or(|memory| constraints.host_memory_bytes <= memory)
    }

    pub(crate) fn refresh_models(&mut self) {
        let first = self.spec.gpus.first().map(|gpu| &gpu.model);
        self.model_of_all = first
            .filter(|first| self.spec.gpus.iter().all(|gpu| &gpu.model == *first))
            .cloned();
    }

    /// GPUs (a bitmask over positions) of a model `constraints` allows.
    pub(crate) fn model_mask(&self, constraints: &Constraints) -> u64 {
        let all = || (0..self.spec.gpus.len()).fold(0, |mask, position| mask | bit(position));
        if constraints.gpu_models.is_empty() {
            return all();
        }
        if let Some(model) = &self.model_of_all {
            return if constraints.gpu_models.contains(model) {
                all()
            } else {
                0
            };
        }
        self.spec
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, gpu)| constraints.gpu_models.contains(&gpu.model))
            .fold(0, |mask, (position, _)| mask | bit(position))
    }

    pub(crate) fn host_allocate(&mut self, constraints: &Constraints) {
        assert!(
            self.host_fits(constraints),
            "{}: host over-committed",
            self.spec.name
        );
        self.host_used.cpu_milli += constraints.cpu_milli;
        self.host_used.memory_bytes += constraints.host_memory_bytes;
    }

    pub(crate) fn host_free_of(&mut self, constraints: &Constraints) {
        assert!(
            self.host_used.cpu_milli >= constraints.cpu_milli
                && self.host_used.memory_bytes >= constraints.host_memory_bytes
        );
        self.host_used.cpu_milli -= constraints.cpu_milli;
        self.host_used.memory_bytes -= constraints.host_memory_bytes;
    }

    pub(crate) fn gpu_free(&self, position: usize) -> GpuFree {
        let usage = &self.usage[position];
        let memory_total_bytes = self.spec.gpus[position].memory_bytes;
        assert!(
            usage.compute_allocated_percent <= 100
                && usage.memory_allocated_bytes <= memory_total_bytes
        );
        GpuFree {
            compute_free_percent: 100 - usage.compute_allocated_percent,
            memory_free_bytes: memory_total_bytes - usage.memory_allocated_bytes,
            memory_total_bytes,
        }
    }

    pub(crate) fn is_fully_free(&self, position: usize) -> bool {
        self.usage[position].tenants.is_empty()
    }

    /// Distinct tenants holding a slice here, sorted.
    pub(crate) fn tenants(&self) -> Vec<TenantName> {
        let mut tenants: Vec<TenantName> = self
            .usage
            .iter()
            .flat_map(|usage| usage.tenants.iter().cloned())
            .collect();
        tenants.sort();
        tenants.dedup();
        tenants
    }

    pub(crate) fn allocate(
        &mut self,
        position: usize,
        tenant: &str,
        compute_percent: u32,
        memory_bytes: u64,
    ) {
        let memory_total_bytes = self.spec.gpus[position].memory_bytes;
        let usage = &mut self.usage[position];
        assert!(compute_percent >= 1, "every slice takes compute");
        assert!(
            usage.compute_allocated_percent + compute_percent <= 100,
            "compute over-committed"
        );
        assert!(
            usage.memory_allocated_bytes + memory_bytes <= memory_total_bytes,
            "memory over-committed"
        );
        assert!(usage.tenants.len() < SLICES_PER_GPU_MAX);
        let at = usage
            .tenants
            .binary_search_by(|known| known.as_str().cmp(tenant))
            .expect_err("one slice per GPU per tenant");
        usage.tenants.insert(at, tenant.to_string());
        usage.compute_allocated_percent += compute_percent;
        usage.memory_allocated_bytes += memory_bytes;
        self.refresh_summary();
    }

    pub(crate) fn free(
        &mut self,
        position: usize,
        tenant: &str,
        compute_percent: u32,
        memory_bytes: u64,
    ) {
        let usage = &mut self.usage[position];
        let at = usage
            .tenants
            .binary_search_by(|known| known.as_str().cmp(tenant))
            .expect("tenant holds this GPU");
        usage.tenants.remove(at);
        assert!(
            usage.compute_allocated_percent >= compute_percent
                && usage.memory_allocated_bytes >= memory_bytes
        );
        usage.compute_allocated_percent -= compute_percent;
        usage.memory_allocated_bytes -= memory_bytes;
        assert_eq!(
            usage.tenants.is_empty(),
            usage.compute_allocated_percent == 0
        );
        self.refresh_summary();
    }

    pub(crate) fn refresh_summary(&mut self) {
        let mut summary = NodeSummary {
            memory_gpu_min_bytes: u64::MAX,
            ..NodeSummary::default()
        };
        for position in 0..self.usage.len() {
            let free = self.gpu_free(position);
            if self.is_fully_free(position) {
                summary.fully_free_mask |= bit(position);
            }
            summary.compute_free_sum_percent += u64::from(free.compute_free_percent);
            summary.compute_free_max_percent = summary
                .compute_free_max_percent
                .max(free.compute_free_percent);
            summary.memory_free_max_bytes =
                summary.memory_free_max_bytes.max(free.memory_free_bytes);
            summary.memory_gpu_min_bytes =
                summary.memory_gpu_min_bytes.min(free.memory_total_bytes);
        }
        if self.usage.is_empty() {
            summary.memory_gpu_min_bytes = 0;
        }
        assert!(summary.compute_free_sum_percent <= 100 * self.usage.len() as u64);
        self.summary = summary;
    }
}
