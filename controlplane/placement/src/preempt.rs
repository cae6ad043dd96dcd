//! Preemption: a guaranteed (non-preemptible) request that does not fit may evict tenants of
//! lower priority, or preemptible tenants of at most its priority.
//!
//! Per node, the search finds a small victim set that makes the request fit there: the cheapest
//! single victim, else the cheapest pair (while the node has at most [`PAIR_SEARCH_VICTIMS_MAX`]
//! candidates), else a greedy set (lowest priority first, largest first) pruned of victims it does
//! not need. Nodes are then ranked by (victims, priority sum, capacity, name). The eviction is
//! applied and the request placed on exactly the chosen nodes; if that fails the evictions are
//! undone, so a preemption happens only when it yields a placement.
//!
//! No ping-pong: a victim has a lower priority than its preemptor, or is preemptible (and a
//! preemptible tenant never preempts), so it can never evict the tenant that evicted it.

use crate::engine::{Engine, Placement};
use crate::node::Node;
use crate::search::{Need, selector_matches};
use crate::topology::{bit, positions};
use crate::types::{Command, Constraints, NodeName, Request, SliceAssignment, TenantName};
use std::collections::BTreeSet;

/// Pairs are searched exhaustively up to this many candidate victims on a node (276 pairs).
const PAIR_SEARCH_VICTIMS_MAX: usize = 24;

/// A victim candidate on one node.
#[derive(Clone, Debug)]
struct Candidate {
    tenant: TenantName,
    priority: i64,
    /// Compute percent over all of its slices (what evicting it costs the pool).
    capacity_percent: u64,
}

/// Victims that make the request fit on one node.
#[derive(Clone, Debug)]
struct NodePlan {
    /// (victims, priority sum, capacity sum, node): lower is better.
    key: (usize, i64, u64, NodeName),
    victims: Vec<TenantName>,
}

/// Free capacity of one GPU in a what-if evaluation.
#[derive(Clone, Copy, Debug)]
struct WhatIfGpu {
    compute_free_percent: u32,
    memory_free_bytes: u64,
    slices: usize,
}

impl Engine {
    fn can_preempt(&self, preemptor_priority: i32, victim: &str) -> bool {
        let record = &self.tenants[victim];
        // A pinned tenant holds what Kubernetes allocated: never a victim.
        record.pin.is_none()
            && matches!(record.placement, Placement::Placed { .. })
            && (record.request.priority < preemptor_priority
                || (record.request.preemptible && record.request.priority <= preemptor_priority))
    }

    /// Places `tenant` (pending, guaranteed) by evicting victims; the commands, or `None` when no
    /// eviction would make it fit (the state is then unchanged).
    pub(crate) fn try_preempt(&mut self, tenant: &str) -> Option<Vec<Command>> {
        let request = self.tenants[tenant].request.clone();
        let constraints = self.tenants[tenant].constraints.clone();
        assert!(!request.preemptible, "preemptible tenants never preempt");
        assert!(matches!(
            self.tenants[tenant].placement,
            Placement::Pending { .. }
        ));
        let need = Need::of(&request).expect("validated at submit");
        let any_victim = self.placed_by_priority.range(..=request.priority).any(
            |(&priority, &(guaranteed, preemptible))| {
                preemptible > 0 || (priority < request.priority && guaranteed > 0)
            },
        );
        if !any_victim {
            return None;
        }
        let nodes_needed = match need {
            Need::Fraction { .. } => 1,
            Need::Whole { nodes, .. } => nodes as usize,
        };
        // Bounded: stop after scoring `max(nodes_scored_max, nodes)` nodes with a plan.
        let plans_max = self.config.nodes_scored_max.max(nodes_needed);
        let mut plans: Vec<NodePlan> = Vec::new();
        for (name, node) in &self.nodes {
            if !node.schedulable() || !selector_matches(node, &request) {
                continue;
            }
            if !node.host_could_fit(&constraints) || node.model_mask(&constraints) == 0 {
                continue;
            }
            if let Some(plan) = self.node_plan(name, node, &request, &constraints, need) {
                plans.push(plan);
                if plans.len() >= plans_max {
                    break;
                }
            }
        }
        if plans.len() < nodes_needed {
            return None;
        }
        plans.sort_by(|a, b| a.key.cmp(&b.key));
        plans.truncate(nodes_needed);
        let victims: BTreeSet<TenantName> = plans
            .iter()
            .flat_map(|plan| plan.victims.iter().cloned())
            .collect();
        if victims.is_empty() {
            // Only reachable when the normal search skipped a node the plan found; never evict for it.
            return None;
        }
        let chosen: BTreeSet<NodeName> = plans.iter().map(|plan| plan.key.3.clone()).collect();
        let reason = format!("preempted by {tenant} (priority {})", request.priority);
        let mut evicted: Vec<(TenantName, Vec<SliceAssignment>)> =
            Vec::with_capacity(victims.len());
        for victim in &victims {
            assert!(self.can_preempt(request.priority, victim));
            let slices = self.unbind(victim, &reason);
            evicted.push((victim.clone(), slices));
        }
        let Some(found) = self.find(&request, &constraints, need, Some(&chosen)) else {
            // The what-if said it fits; if the real search disagrees, undo rather than evict for
            // nothing.
            for (victim, slices) in evicted {
                self.bind(&victim, slices);
            }
            return None;
        };
        let mut commands: Vec<Command> = victims
            .iter()
            .map(|victim| Command::Preempted {
                tenant: victim.clone(),
                by: tenant.to_string(),
                reason: reason.clone(),
            })
            .collect();
        self.bind(tenant, found.slices.clone());
        commands.push(Command::Bind {
            tenant: tenant.to_string(),
            slices: found.slices,
        });
        Some(commands)
    }

    /// The cheapest small victim set on `node` that makes `need` fit there; an empty set when it
    /// fits already; `None` when even evicting every candidate would not do.
    fn node_plan(
        &self,
        name: &NodeName,
        node: &Node,
        request: &Request,
        constraints: &Constraints,
        need: Need,
    ) -> Option<NodePlan> {
        let mut candidates: Vec<Candidate> = node
            .tenants()
            .into_iter()
            .filter(|victim| self.can_preempt(request.priority, victim))
            .map(|victim| {
                let record = &self.tenants[&victim];
                let Placement::Placed { slices } = &record.placement else {
                    unreachable!("can_preempt checked")
                };
                let capacity_percent = slices
                    .iter()
                    .map(|slice| u64::from(slice.compute_percent))
                    .sum();
                Candidate {
                    tenant: victim,
                    priority: i64::from(record.request.priority),
                    capacity_percent,
                }
            })
            .collect();
        let plan = |victims: &[&Candidate]| NodePlan {
            key: (
                victims.len(),
                victims.iter().map(|victim| victim.priority).sum(),
                victims.iter().map(|victim| victim.capacity_percent).sum(),
                name.clone(),
            ),
            victims: victims.iter().map(|victim| victim.tenant.clone()).collect(),
        };
        let multi_node = matches!(need, Need::Whole { nodes, .. } if nodes > 1);
        if candidates.is_empty() && !multi_node {
            // Cheap exit for the common case (nothing to evict here); a single-node request that
            // fits without victims was already placed by the normal search.
            return None;
        }
        if self.fits_without(node, request, constraints, need, &[]) {
            return Some(plan(&[]));
        }
        if candidates.is_empty()
            || !self.fits_without(
                node,
                request,
                constraints,
                need,
                &candidates.iter().collect::<Vec<_>>(),
            )
        {
            return None;
        }
        // Cheapest first: lowest priority, then least capacity, then name.
        candidates.sort_by(|a, b| {
            (a.priority, a.capacity_percent, &a.tenant).cmp(&(
                b.priority,
                b.capacity_percent,
                &b.tenant,
            ))
        });
        if let Some(single) = candidates
            .iter()
            .find(|victim| self.fits_without(node, request, constraints, need, &[victim]))
        {
            return Some(plan(&[single]));
        }
        if candidates.len() <= PAIR_SEARCH_VICTIMS_MAX {
            let mut best: Option<NodePlan> = None;
            for (i, first) in candidates.iter().enumerate() {
                for second in &candidates[i + 1..] {
                    if self.fits_without(node, request, constraints, need, &[first, second]) {
                        let pair = plan(&[first, second]);
                        if best.as_ref().is_none_or(|best| pair.key < best.key) {
                            best = Some(pair);
                        }
                    }
                }
            }
            if best.is_some() {
                return best;
            }
        }
        // Greedy: lowest priority first, largest first (fewer victims), then prune the unneeded.
        let mut greedy: Vec<&Candidate> = candidates.iter().collect();
        greedy.sort_by(|a, b| {
            (a.priority, std::cmp::Reverse(a.capacity_percent), &a.tenant).cmp(&(
                b.priority,
                std::cmp::Reverse(b.capacity_percent),
                &b.tenant,
            ))
        });
        let mut chosen: Vec<&Candidate> = Vec::new();
        for victim in greedy {
            chosen.push(victim);
            if self.fits_without(node, request, constraints, need, &chosen) {
                break;
            }
        }
        assert!(
            self.fits_without(node, request, constraints, need, &chosen),
            "all candidates together fit"
        );
        for at in (0..chosen.len()).rev() {
            let mut fewer = chosen.clone();
            fewer.remove(at);
            if self.fits_without(node, request, constraints, need, &fewer) {
                chosen = fewer;
            }
        }
        Some(plan(&chosen))
    }

    /// Whether `need` (one node's share) would fit on `node` with `victims` gone.
    fn fits_without(
        &self,
        node: &Node,
        request: &Request,
        constraints: &Constraints,
        need: Need,
        victims: &[&Candidate],
    ) -> bool {
        let mut host_free = node.host_free();
        let mut gpus: Vec<WhatIfGpu> = (0..node.usage.len())
            .map(|position| {
                let free = node.gpu_free(position);
                WhatIfGpu {
                    compute_free_percent: free.compute_free_percent,
                    memory_free_bytes: free.memory_free_bytes,
                    slices: node.usage[position].tenants.len(),
                }
            })
            .collect();
        for victim in victims {
            let record = &self.tenants[&victim.tenant];
            let Placement::Placed { slices } = &record.placement else {
                unreachable!("victims are placed")
            };
            // Charged once per node (`Engine::bind`); a victim here has a slice here.
            host_free.cpu_milli = host_free
                .cpu_milli
                .saturating_add(record.constraints.cpu_milli);
            host_free.memory_bytes = host_free
                .memory_bytes
                .saturating_add(record.constraints.host_memory_bytes);
            for slice in slices.iter().filter(|slice| slice.node == node.spec.name) {
                let gpu = &mut gpus[node.position_of[&slice.gpu_index]];
                gpu.compute_free_percent += slice.compute_percent;
                gpu.memory_free_bytes += slice.memory_bytes;
                gpu.slices -= 1;
            }
        }
        assert!(gpus.iter().all(|gpu| gpu.compute_free_percent <= 100));
        if constraints.cpu_milli > host_free.cpu_milli
            || constraints.host_memory_bytes > host_free.memory_bytes
        {
            return false;
        }
        match need {
            Need::Fraction {
                compute_percent,
                memory,
            } => gpus.iter().enumerate().any(|(position, gpu)| {
                constraints.allows_model(&node.spec.gpus[position].model)
                    && gpu.compute_free_percent >= compute_percent
                    && gpu.memory_free_bytes
                        >= memory.bytes_on(node.spec.gpus[position].memory_bytes)
            }),
            Need::Whole {
                gpus: gpu_count,
                memory_bytes,
                ..
            } => {
                let eligible = gpus.iter().enumerate().fold(0u64, |mask, (position, gpu)| {
                    let memory_ok = memory_bytes
                        .is_none_or(|bytes| node.spec.gpus[position].memory_bytes >= bytes);
                    let model_ok = constraints.allows_model(&node.spec.gpus[position].model);
                    if gpu.slices == 0 && memory_ok && model_ok {
                        mask | bit(position)
                    } else {
                        mask
                    }
                });
                debug_assert!(
                    positions(eligible).all(|position| gpus[position].compute_free_percent == 100)
                );
                node.topology
                    .choose(eligible, gpu_count, request.nvlink)
                    .is_some()
            }
        }
    }
}
