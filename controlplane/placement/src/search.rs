//! Finding a placement for one request on the current state (read-only), and saying why there is
//! none: the `Pending` reason (nothing fits now) and the `Reject` reason (nothing could ever fit
//! this pool as built).
//!
//! Fractions scan nodes from the engine's rotating cursor, skip a node by its summary when no GPU
//! could hold the fraction, and score the GPUs of at most `nodes_scored_max` feasible nodes.
//! Whole-GPU requests walk the free-GPU index from the smallest sufficient count upward, so nodes
//! that fit exactly are seen first, and score at most `nodes_scored_max` feasible nodes
//! (`max(nodes_scored_max, nodes)` for gangs).

use crate::engine::Engine;
use crate::node::{HostUse, Node};
use crate::topology::{SetScore, Topology, bit, positions};
use crate::types::{
    Constraints, GpuCount, NodeName, NvlinkPolicy, Request, Scorer, SliceAssignment,
};
use crate::units::{format_bytes, format_cpu, format_selector, plural};
use crate::workload::{Shape, ShapeMemory};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

/// A request reduced to what placement needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    Fraction {
        compute_percent: u32,
        memory: ShapeMemory,
    },
    Whole {
        gpus: u32,
        nodes: u32,
        memory_bytes: Option<u64>,
    },
}

impl Need {
    /// `Err` is the reason an ill-formed request is rejected.
    pub(crate) fn of(request: &Request) -> Result<Need, String> {
        if request.nodes == 0 {
            return Err("invalid request: nodes must be at least 1".to_string());
        }
        if request
            .compute_percent
            .is_some_and(|percent| percent == 0 || percent > 100)
        {
            return Err("invalid request: compute_percent must be 1..=100".to_string());
        }
        match request.gpus {
            GpuCount::Whole(0) => Err("invalid request: Whole(0) GPUs".to_string()),
            GpuCount::Whole(gpus) => {
                // Whole GPUs are exclusive: compute is always 100%, `compute_percent` is ignored.
                Ok(Need::Whole {
                    gpus,
                    nodes: request.nodes,
                    memory_bytes: request.memory_bytes_per_gpu,
                })
            }
            GpuCount::Milli(milli) if milli == 0 || milli >= 1000 => {
                Err(format!("invalid request: Milli({milli}) must be 1..=999"))
            }
            GpuCount::Milli(_) if request.nodes != 1 => {
                Err("invalid request: a GPU fraction runs on one node".to_string())
            }
            GpuCount::Milli(milli) => {
                let compute_percent = request
                    .compute_percent
                    .unwrap_or(milli.div_ceil(10))
                    .clamp(1, 100);
                let memory = match request.memory_bytes_per_gpu {
                    Some(bytes) => ShapeMemory::Bytes(bytes),
                    None => ShapeMemory::Permille(milli),
                };
                Ok(Need::Fraction {
                    compute_percent,
                    memory,
                })
            }
        }
    }

    pub(crate) fn shape(self) -> Shape {
        match self {
            Need::Fraction {
                compute_percent,
                memory,
            } => Shape::Fraction {
                compute_percent,
                memory,
            },
            Need::Whole { gpus, .. } => Shape::Whole { gpus },
        }
    }
}

/// A placement found on the current state, not yet applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    /// Sorted by node name, then GPU index.
    pub slices: Vec<SliceAssignment>,
    /// Where the next scan starts.
    pub cursor_next: NodeName,
}

/// Lower is better: the change of GPUs stranded behind CPU or host memory plus the scarcity cost
/// of the set's models (Fragmentation only; 0 for BestFit and whenever no tenant asks for host
/// capacity or a model), whether the set opens an empty
/// node (Fragmentation only; always `false` for BestFit), then topology (Prefer/Require), then fully free GPUs left, then free compute left.
type WholeKey = (i64, bool, Reverse<SetScore>, u32, u64);

pub(crate) fn selector_matches(node: &Node, request: &Request) -> bool {
    request
        .node_selector
        .iter()
        .all(|(key, value)| node.spec.labels.get(key) == Some(value))
}

impl Engine {
    /// Nodes from the cursor onward, then from the start up to the cursor; or only `only`.
    fn rotation<'a>(
        &'a self,
        only: Option<&'a BTreeSet<NodeName>>,
    ) -> Box<dyn Iterator<Item = (&'a NodeName, &'a Node)> + 'a> {
        match only {
            Some(names) => Box::new(
                names
                    .iter()
                    .filter_map(|name| self.nodes.get_key_value(name)),
            ),
            None => {
                let cursor = self.scan_cursor.as_str();
                let after = self
                    .nodes
                    .range::<str, _>((Bound::Included(cursor), Bound::Unbounded));
                let before = self
                    .nodes
                    .range::<str, _>((Bound::Unbounded, Bound::Excluded(cursor)));
                Box::new(after.chain(before))
            }
        }
    }

    fn cursor_after(&self, name: &str) -> NodeName {
        let next = self
            .nodes
            .range::<str, _>((Bound::Excluded(name), Bound::Unbounded))
            .next();
        next.or_else(|| self.nodes.iter().next())
            .map(|(next_name, _)| next_name.clone())
            .unwrap_or_default()
    }

    /// The best placement on the current state, if any. `only`: consider just these nodes
    /// (preemption places on the nodes it freed).
    pub(crate) fn find(
        &self,
        request: &Request,
        constraints: &Constraints,
        need: Need,
        only: Option<&BTreeSet<NodeName>>,
    ) -> Option<Found> {
        match need {
            Need::Fraction {
                compute_percent,
                memory,
            } => self.find_fraction(request, constraints, compute_percent, memory, only),
            Need::Whole {
                gpus,
                nodes,
                memory_bytes,
            } => self.find_whole(request, constraints, gpus, nodes, memory_bytes, only),
        }
    }

    fn find_fraction(
        &self,
        request: &Request,
        constraints: &Constraints,
        compute_percent: u32,
        memory: ShapeMemory,
        only: Option<&BTreeSet<NodeName>>,
    ) -> Option<Found> {
        assert!((1..=100).contains(&compute_percent));
        // (key, node, position); key: lower is better.
        let mut best: Option<((i64, u32, u64), &str, usize)> = None;
        let mut feasible_nodes = 0usize;
        let mut last_examined: Option<&str> = None;
        for (name, node) in self.rotation(only) {
            last_examined = Some(name);
            if !node.schedulable()
                || !selector_matches(node, request)
                || !node.host_fits(constraints)
            {
                continue;
            }
            // Every GPU when no model is asked for (the common case: no per-node work).
            let models_allowed = if constraints.gpu_models.is_empty() {
                u64::MAX
            } else {
                node.model_mask(constraints)
            };
            if models_allowed == 0 {
                continue;
            }
            let summary = &node.summary;
            if summary.compute_free_max_percent < compute_percent
                || summary.memory_free_max_bytes < memory.bytes_on(summary.memory_gpu_min_bytes)
            {
                continue;
            }
            let mut feasible = false;
            // The whole-shape part of the fragmentation change depends only on the node and on
            // whether the GPU is fully free: computed at most once per node and case.
            let node_totals = (summary.fully_free_count(), summary.compute_free_sum_percent);
            let mut whole_parts: [Option<i64>; 2] = [None, None];
            let mut stranding: Option<i64> = None;
            let mut scarcity_memo: Option<(&str, i64)> = None;
            for position in 0..node.usage.len() {
                let free = node.gpu_free(position);
                let memory_bytes = memory.bytes_on(free.memory_total_bytes);
                if free.compute_free_percent < compute_percent
                    || free.memory_free_bytes < memory_bytes
                    || models_allowed & bit(position) == 0
                {
                    continue;
                }
                feasible = true;
                let delta = match self.config.scorer {
                    Scorer::Fragmentation => {
                        let fully_free = node.is_fully_free(position);
                        let whole =
                            *whole_parts[usize::from(fully_free)].get_or_insert_with(|| {
                                self.workload
                                    .whole_part(node_totals, fully_free, compute_percent)
                            });
                        let stranded = *stranding.get_or_insert_with(|| {
                            self.stranding_delta(node, constraints, u64::from(compute_percent))
                        });
                        // Only read when some tenant is constrained to a model: the model's name
                        // is another cache line per GPU.
                        let scarcity = if self.models.demand_milli.is_empty() {
                            0
                        } else {
                            let model = node.spec.gpus[position].model.as_str();
                            match scarcity_memo {
                                Some((known, value)) if known == model => value,
                                _ => {
                                    let value =
                                        self.scarcity_cost(model, u64::from(compute_percent));
                                    scarcity_memo = Some((model, value));
                                    value
                                }
                            }
                        };
                        whole
                            + stranded
                            + scarcity
                            + self
                                .workload
                                .fraction_part(free, compute_percent, memory_bytes)
                    }
                    Scorer::BestFit => 0,
                };
                let key = (
                    delta,
                    free.compute_free_percent - compute_percent,
                    free.memory_free_bytes - memory_bytes,
                );
                let better = match best {
                    None => true,
                    Some((best_key, best_name, best_position)) => {
                        (key, name.as_str(), position) < (best_key, best_name, best_position)
                    }
                };
                if better {
                    best = Some((key, name, position));
                }
            }
            if feasible {
                feasible_nodes += 1;
                if feasible_nodes >= self.config.nodes_scored_max.max(1) {
                    break;
                }
            }
        }
        let (_, name, position) = best?;
        let node = &self.nodes[name];
        let gpu = &node.spec.gpus[position];
        let slice = SliceAssignment {
            node: name.to_string(),
            gpu_uuid: gpu.uuid.clone(),
            gpu_index: gpu.index,
            compute_percent,
            memory_bytes: memory.bytes_on(gpu.memory_bytes),
            guaranteed: !request.preemptible,
            burst: request.burst,
        };
        assert!(node.gpu_free(position).compute_free_percent >= compute_percent);
        let cursor_next =
            self.cursor_after(last_examined.expect("a best GPU means a node was examined"));
        Some(Found {
            slices: vec![slice],
            cursor_next,
        })
    }

    /// Change of the GPU compute stranded on `node` behind its CPU and host memory when a task
    /// with `constraints` takes `compute_percent` there, scaled like the workload model's deltas
    /// (a stranded GPU is a fragment for every shape). 0 when no kept tenant asks for host
    /// capacity.
    fn stranding_delta(&self, node: &Node, constraints: &Constraints, compute_percent: u64) -> i64 {
        if !self.host_mix.asks_host() {
            return 0;
        }
        let sum = node.summary.compute_free_sum_percent;
        assert!(sum >= compute_percent, "the search checked the fit");
        let free = node.host_free();
        // `u64::MAX` is unbounded, and stays so.
        let take = |free: u64, asked: u64| {
            if free == u64::MAX {
                free
            } else {
                free.saturating_sub(asked)
            }
        };
        let after = HostUse {
            cpu_milli: take(free.cpu_milli, constraints.cpu_milli),
            memory_bytes: take(free.memory_bytes, constraints.host_memory_bytes),
        };
        let before = self.host_mix.stranded_percent(sum, free) as i64;
        let later = self.host_mix.stranded_percent(sum - compute_percent, after) as i64;
        (later - before) * self.workload.weight_total() as i64
    }

    /// What taking `compute_percent` of a GPU of `model` costs the tenants constrained to that
    /// model, on the workload model's scale: the compute taken times the model's scarcity
    /// (`ModelBook::scarcity_permille`), so an unconstrained task (or one allowing
    /// several models) leaves a model in demand to the tasks that need it. 0 when no kept
    /// tenant is constrained to a model.
    fn scarcity_cost(&self, model: &str, compute_percent: u64) -> i64 {
        if self.models.demand_milli.is_empty() {
            return 0;
        }
        let permille = self.models.scarcity_permille(model);
        assert!(permille <= 1000);
        (compute_percent * permille * self.workload.weight_total() / 1000) as i64
    }

    /// GPUs of `node` a whole-GPU request could take now: fully free, of an allowed model, with
    /// enough memory.
    pub(crate) fn whole_eligible(
        node: &Node,
        memory_bytes: Option<u64>,
        constraints: &Constraints,
    ) -> u64 {
        let mut eligible = node.summary.fully_free_mask;
        if !constraints.gpu_models.is_empty() {
            eligible &= node.model_mask(constraints);
        }
        if let Some(memory_bytes) = memory_bytes {
            for position in positions(eligible) {
                if node.spec.gpus[position].memory_bytes < memory_bytes {
                    eligible &= !bit(position);
                }
            }
        }
        eligible
    }

    fn find_whole(
        &self,
        request: &Request,
        constraints: &Constraints,
        gpus: u32,
        nodes: u32,
        memory_bytes: Option<u64>,
        only: Option<&BTreeSet<NodeName>>,
    ) -> Option<Found> {
        assert!(gpus >= 1 && nodes >= 1);
        let candidates_max = self.config.nodes_scored_max.max(nodes as usize);
        let mut candidates: Vec<(WholeKey, &str, u64)> = Vec::new();
        let mut last_examined: Option<&str> = None;
        let cursor = self.scan_cursor.as_str();
        let mut choose_memo = ChooseMemo::default();
        'buckets: for (_, bucket) in self.free_index.range(gpus..) {
            let names: Box<dyn Iterator<Item = &NodeName>> = match only {
                Some(only) => Box::new(bucket.intersection(only)),
                None => Box::new(
                    bucket
                        .range::<str, _>((Bound::Included(cursor), Bound::Unbounded))
                        .chain(bucket.range::<str, _>((Bound::Unbounded, Bound::Excluded(cursor)))),
                ),
            };
            for name in names {
                last_examined = Some(name);
                let node = &self.nodes[name];
                assert!(
                    node.schedulable(),
                    "the free index holds schedulable nodes only"
                );
                if !selector_matches(node, request) || !node.host_fits(constraints) {
                    continue;
                }
                let eligible = Self::whole_eligible(node, memory_bytes, constraints);
                let Some((set, score)) =
                    choose_memo.choose(&node.topology, eligible, gpus, request.nvlink)
                else {
                    continue;
                };
                let summary = &node.summary;
                let fully_free_after = summary.fully_free_count() - gpus;
                let free_sum_after = summary.compute_free_sum_percent - 100 * u64::from(gpus);
                // Opening an empty node turns all of it into a fragment for node-sized tasks (the
                // FGD fragment of the largest whole shape), and a `Prefer` topology score must not
                // buy a better pair at that price: an empty node always scores best, so without
                // this key scattered free GPUs on used nodes lose to it. Among the rest, fewest
                // fully free GPUs left (best fit): the FGD delta of a whole-GPU set depends only
                // on the node's free-GPU count, and ordering those counts by it measured no
                // better than best fit (docs/benchmarks.md).
                let fragmentation = self.config.scorer == Scorer::Fragmentation;
                let opens_empty_node =
                    fragmentation && summary.fully_free_count() as usize == node.usage.len();
                // GPUs the set would strand behind this node's CPU or host memory (0 unless some
                // tenant asks for them), plus the GPUs it would take from tenants constrained to
                // their model (0 unless some tenant is): first, as a stranded GPU is lost to every
                // shape, and a task that needs little CPU belongs on a node whose GPUs only such
                // tasks can use, even an empty one.
                let stranding = if fragmentation {
                    let scarcity: i64 = if self.models.demand_milli.is_empty() {
                        0
                    } else {
                        positions(set)
                            .map(|position| {
                                self.scarcity_cost(&node.spec.gpus[position].model, 100)
                            })
                            .sum()
                    };
                    self.stranding_delta(node, constraints, 100 * u64::from(gpus)) + scarcity
                } else {
                    0
                };
                candidates.push((
                    (
                        stranding,
                        opens_empty_node,
                        Reverse(score),
                        fully_free_after,
                        free_sum_after,
                    ),
                    name,
                    set,
                ));
                if candidates.len() >= candidates_max {
                    break 'buckets;
                }
            }
        }
        if candidates.len() < nodes as usize {
            return None;
        }
        candidates.sort();
        candidates.truncate(nodes as usize);
        candidates.sort_by(|a, b| a.1.cmp(b.1));
        let mut slices = Vec::with_capacity((gpus * nodes) as usize);
        for (_, name, set) in &candidates {
            let node = &self.nodes[*name];
            for position in positions(*set) {
                let gpu = &node.spec.gpus[position];
                slices.push(SliceAssignment {
                    node: name.to_string(),
                    gpu_uuid: gpu.uuid.clone(),
                    gpu_index: gpu.index,
                    compute_percent: 100,
                    memory_bytes: memory_bytes.unwrap_or(gpu.memory_bytes),
                    guaranteed: !request.preemptible,
                    burst: request.burst,
                });
            }
        }
        slices.sort_by(|a, b| (&a.node, a.gpu_index).cmp(&(&b.node, b.gpu_index)));
        assert_eq!(slices.len(), (gpus * nodes) as usize);
        let cursor_next = self.cursor_after(last_examined.expect("candidates were examined"));
        Some(Found {
            slices,
            cursor_next,
        })
    }

    /// Why `request` does not fit now (it may later): for the `Pending` command.
    pub(crate) fn unfit_reason(
        &self,
        request: &Request,
        constraints: &Constraints,
        need: Need,
    ) -> String {
        let mut ready: Vec<(&NodeName, &Node)> = self
            .nodes
            .iter()
            .filter(|(_, node)| node.schedulable() && selector_matches(node, request))
            .collect();
        if ready.is_empty() {
            return if request.node_selector.is_empty() {
                "no node is Ready".to_string()
            } else {
                format!(
                    "no Ready node matches selector {}",
                    format_selector(&request.node_selector)
                )
            };
        }
        if !constraints.gpu_models.is_empty() {
            ready.retain(|(_, node)| node.model_mask(constraints) != 0);
            if ready.is_empty() {
                return format!(
                    "no Ready node has a GPU of model {}",
                    models_text(constraints)
                );
            }
        }
        if constraints.asks_host() {
            let host_ready: Vec<(&NodeName, &Node)> = ready
                .iter()
                .filter(|(_, node)| node.host_fits(constraints))
                .copied()
                .collect();
            if host_ready.is_empty() {
                let (name, free) = ready
                    .iter()
                    .map(|(name, node)| (name.as_str(), node.host_free()))
                    .max_by_key(|(name, free)| (free.cpu_milli, free.memory_bytes, Reverse(*name)))
                    .expect("ready is not empty");
                return format!(
                    "no Ready node has {} free; the most free is {name} with {}",
                    host_text(
                        constraints,
                        constraints.cpu_milli,
                        constraints.host_memory_bytes
                    ),
                    host_text(constraints, free.cpu_milli, free.memory_bytes),
                );
            }
            ready = host_ready;
        }
        match need {
            Need::Fraction {
                compute_percent,
                memory,
            } => {
                // The most free GPU: most compute, then most memory, then first by name/index.
                let mut most_free: Option<((u32, u64), &str, usize)> = None;
                for (name, node) in &ready {
                    for position in 0..node.usage.len() {
                        if !constraints.allows_model(&node.spec.gpus[position].model) {
                            continue;
                        }
                        let free = node.gpu_free(position);
                        let key = (free.compute_free_percent, free.memory_free_bytes);
                        if most_free.is_none_or(|(best_key, _, _)| key > best_key) {
                            most_free = Some((key, name, position));
                        }
                    }
                }
                let Some(((compute_free, memory_free), name, position)) = most_free else {
                    return "no Ready node has GPUs".to_string();
                };
                let gpu = &self.nodes[name].spec.gpus[position];
                format!(
                    "no GPU has {compute_percent}% compute and {} memory free; the most free is {name} GPU {} with {compute_free}% compute and {}",
                    format_bytes(memory.bytes_on(gpu.memory_bytes)),
                    gpu.index,
                    format_bytes(memory_free),
                )
            }
            Need::Whole {
                gpus,
                nodes,
                memory_bytes,
            } => {
                let require = request.nvlink == NvlinkPolicy::Require && gpus >= 2;
                let usable = |node: &Node| {
                    let eligible = Self::whole_eligible(node, memory_bytes, constraints);
                    if require {
                        node.topology.max_clique(eligible)
                    } else {
                        eligible.count_ones()
                    }
                };
                let what = whole_gpus_text(gpus, require, memory_bytes);
                if nodes == 1 {
                    let (best_name, best_usable) = ready
                        .iter()
                        .map(|(name, node)| (name.as_str(), usable(node)))
                        .fold(("", 0), |best, candidate| {
                            if candidate.1 > best.1 || best.0.is_empty() {
                                candidate
                            } else {
                                best
                            }
                        });
                    format!("no node has {what} free; the best is {best_name} with {best_usable}")
                } else {
                    let fitting = ready
                        .iter()
                        .filter(|(_, node)| usable(node) >= gpus)
                        .count() as u64;
                    format!(
                        "{} x {} needed, {} {} free",
                        plural(u64::from(nodes), "node"),
                        plural(u64::from(gpus), "GPU"),
                        plural(fitting, "node"),
                        if fitting == 1 {
                            format!("has {what}")
                        } else {
                            format!("have {what}")
                        },
                    )
                }
            }
        }
    }

    /// Why `request` can never fit this pool as built, counting every node whatever its state;
    /// `None` when it could fit an empty pool.
    pub(crate) fn never_fits_reason(
        &self,
        request: &Request,
        constraints: &Constraints,
        need: Need,
    ) -> Option<String> {
        // Kubernetes-managed nodes are never the engine's to fill, whatever their state.
        let mut matching: Vec<(&NodeName, &Node)> = self
            .nodes
            .iter()
            .filter(|(_, node)| !node.kubernetes_managed && selector_matches(node, request))
            .collect();
        let selector_text = format_selector(&request.node_selector);
        if matching.is_empty() {
            let managed = self
                .nodes
                .values()
                .filter(|node| node.kubernetes_managed)
                .count();
            return Some(if request.node_selector.is_empty() && managed > 0 {
                format!(
                    "every node of the pool ({managed}) is Kubernetes-managed: pods get their GPUs through DRA (docs/kubernetes.md), and vgpuctl places only on nodes whose agent runs without --kubernetes-managed"
                )
            } else if request.node_selector.is_empty() {
                "the pool has no nodes".to_string()
            } else {
                format!("no node matches selector {selector_text}")
            });
        }
        if !constraints.gpu_models.is_empty() {
            matching.retain(|(_, node)| node.model_mask(constraints) != 0);
            if matching.is_empty() {
                return Some(format!(
                    "no node has a GPU of model {}",
                    models_text(constraints)
                ));
            }
        }
        if constraints.asks_host() {
            let host_matching: Vec<(&NodeName, &Node)> = matching
                .iter()
                .filter(|(_, node)| node.host_could_fit(constraints))
                .copied()
                .collect();
            if host_matching.len() < needed_nodes(need) {
                let (name, largest) = matching
                    .iter()
                    .map(|(name, node)| {
                        let host = node.host;
                        let cpu = host.cpu_milli.unwrap_or(u64::MAX);
                        let memory = host.memory_bytes.unwrap_or(u64::MAX);
                        (name.as_str(), (cpu, memory))
                    })
                    .max_by_key(|(name, capacity)| (*capacity, Reverse(*name)))
                    .expect("matching is not empty");
                let asked = host_text(
                    constraints,
                    constraints.cpu_milli,
                    constraints.host_memory_bytes,
                );
                return Some(if needed_nodes(need) == 1 {
                    format!(
                        "no node has {asked}; the largest is {name} with {}",
                        host_text(constraints, largest.0, largest.1)
                    )
                } else {
                    format!(
                        "{} needed with {asked}, {} {}",
                        plural(needed_nodes(need) as u64, "node"),
                        plural(host_matching.len() as u64, "node"),
                        if host_matching.len() == 1 {
                            "has it"
                        } else {
                            "have it"
                        },
                    )
                });
            }
            matching = host_matching;
        }
        match need {
            Need::Fraction { memory, .. } => {
                // Compute (at most 100%) always fits an empty GPU; memory may not.
                let mut largest: Option<(u64, &str, u32)> = None;
                for (name, node) in &matching {
                    for gpu in &node.spec.gpus {
                        if !constraints.allows_model(&gpu.model) {
                            continue;
                        }
                        if memory.bytes_on(gpu.memory_bytes) <= gpu.memory_bytes {
                            return None;
                        }
                        if largest.is_none_or(|(bytes, _, _)| gpu.memory_bytes > bytes) {
                            largest = Some((gpu.memory_bytes, name, gpu.index));
                        }
                    }
                }
                let Some((bytes, name, index)) = largest else {
                    return Some("no matching node has GPUs".to_string());
                };
                Some(format!(
                    "no GPU has {} memory; the largest is {} ({name} GPU {index})",
                    format_bytes(memory.bytes_on(bytes)),
                    format_bytes(bytes)
                ))
            }
            Need::Whole {
                gpus,
                nodes,
                memory_bytes,
            } => {
                let require = request.nvlink == NvlinkPolicy::Require && gpus >= 2;
                let capacity: BTreeMap<&str, u32> = matching
                    .iter()
                    .map(|(name, node)| {
                        let mut eligible = node.model_mask(constraints);
                        for (position, gpu) in node.spec.gpus.iter().enumerate() {
                            if memory_bytes.is_some_and(|bytes| gpu.memory_bytes < bytes) {
                                eligible &= !bit(position);
                            }
                        }
                        let usable = if require {
                            node.topology.max_clique(eligible)
                        } else {
                            eligible.count_ones()
                        };
                        (name.as_str(), usable)
                    })
                    .collect();
                let fitting = capacity.values().filter(|&&usable| usable >= gpus).count() as u64;
                if fitting >= u64::from(nodes) {
                    return None;
                }
                let what = whole_gpus_text(gpus, require, memory_bytes);
                if nodes == 1 {
                    let (best_name, best_usable) =
                        capacity.iter().fold(("", 0), |best, (&name, &usable)| {
                            if usable > best.1 || best.0.is_empty() {
                                (name, usable)
                            } else {
                                best
                            }
                        });
                    return Some(format!(
                        "no node has {what}; the best is {best_name} with {best_usable}"
                    ));
                }
                let needed = format!(
                    "{} x {} needed",
                    plural(u64::from(nodes), "node"),
                    plural(u64::from(gpus), "GPU")
                );
                if !request.node_selector.is_empty() && (matching.len() as u64) < u64::from(nodes) {
                    let verb = if matching.len() == 1 {
                        "matches"
                    } else {
                        "match"
                    };
                    return Some(format!(
                        "{needed}, {} {verb} selector {selector_text}",
                        plural(matching.len() as u64, "node")
                    ));
                }
                let verb = if fitting == 1 { "has" } else { "have" };
                Some(format!(
                    "{needed}, {} {verb} {what}",
                    plural(fitting, "node")
                ))
            }
        }
    }
}

/// A chosen GPU set and its score, or none.
type SetChoice = Option<(u64, SetScore)>;

/// Most set choices remembered during one search.
const CHOOSE_MEMO_ENTRIES_MAX: usize = 32;

/// Set choices of one search, keyed by topology and eligible GPUs: on a pool of identical
/// machines most candidate nodes repeat a handful of free-GPU patterns, and the choice is a pure
/// function of them (so reusing it changes nothing but the time taken).
#[derive(Default)]
struct ChooseMemo<'a> {
    entries: Vec<(&'a Topology, u64, SetChoice)>,
}

impl<'a> ChooseMemo<'a> {
    fn choose(
        &mut self,
        topology: &'a Topology,
        eligible: u64,
        gpus: u32,
        policy: NvlinkPolicy,
    ) -> SetChoice {
        let hit = self.entries.iter().find(|(known, known_eligible, _)| {
            *known_eligible == eligible
                && known.fingerprint == topology.fingerprint
                && *known == topology
        });
        if let Some((_, _, choice)) = hit {
            return *choice;
        }
        let choice = topology.choose(eligible, gpus, policy);
        if self.entries.len() < CHOOSE_MEMO_ENTRIES_MAX {
            self.entries.push((topology, eligible, choice));
        }
        assert!(self.entries.len() <= CHOOSE_MEMO_ENTRIES_MAX);
        choice
    }
}

fn needed_nodes(need: Need) -> usize {
    match need {
        Need::Fraction { .. } => 1,
        Need::Whole { nodes, .. } => nodes as usize,
    }
}

/// `H100-80GB or A100-40GB`.
fn models_text(constraints: &Constraints) -> String {
    let models: Vec<&str> = constraints.gpu_models.iter().map(String::as_str).collect();
    models.join(" or ")
}

/// The CPU and host memory `constraints` asks for, with these amounts: `8 CPUs and 64GiB host
/// memory`, `2.5 CPUs`, `16GiB host memory`; `unbounded` for an amount not reported.
fn host_text(constraints: &Constraints, cpu_milli: u64, memory_bytes: u64) -> String {
    let mut parts = Vec::new();
    if constraints.cpu_milli > 0 {
        parts.push(if cpu_milli == u64::MAX {
            "unbounded CPU".to_string()
        } else {
            format_cpu(cpu_milli)
        });
    }
    if constraints.host_memory_bytes > 0 {
        parts.push(if memory_bytes == u64::MAX {
            "unbounded host memory".to_string()
        } else {
            format!("{} host memory", format_bytes(memory_bytes))
        });
    }
    assert!(
        !parts.is_empty(),
        "only for constraints that ask for host capacity"
    );
    parts.join(" and ")
}

/// `2 NVLink-connected GPUs with 40GiB`, `1 GPU`.
fn whole_gpus_text(gpus: u32, require: bool, memory_bytes: Option<u64>) -> String {
    let linked = if require { "NVLink-connected " } else { "" };
    let noun = if gpus == 1 { "GPU" } else { "GPUs" };
    match memory_bytes {
        Some(bytes) => format!("{gpus} {linked}{noun} with {}", format_bytes(bytes)),
        None => format!("{gpus} {linked}{noun}"),
    }
}
