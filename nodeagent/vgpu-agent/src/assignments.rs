//! The agent's own model of what runs on its node: the set of tenants with their GPU slices, as
//! last received from the control plane. It is what the state directory persists and what
//! [`crate::reconcile`] compares.
//!
//! Pure data: no I/O here, so the reconcile logic can be tested without a disk or a network.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Most tenants the agent accepts on one node (64 GPUs cut into thousandths, with room to spare).
/// A larger set is a control-plane bug; the agent keeps the first ones by name and warns.
pub const TENANTS_PER_NODE_MAX: usize = 65_536;

/// All tenants on this node at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AssignmentSet {
    /// Raft log index at which the control plane computed this set; 0 before the first one.
    pub revision: u64,
    /// The node's state as the control plane sees it: `ready`, `lost`, `draining` or `unknown`.
    pub node_state: String,
    /// By tenant name.
    pub tenants: BTreeMap<String, TenantAssignment>,
}

/// One tenant's share of this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantAssignment {
    pub tenant: String,
    pub priority: i32,
    /// Sorted by GPU index.
    pub slices: Vec<SliceAssignment>,
    /// The bandwidth weight the tenant asked for; 0 = derived from its compute share.
    #[serde(default)]
    pub bandwidth_weight: u32,
    /// Latency-sensitive (`vgpuctl place --latency`): matters on nodes that run MPS.
    #[serde(default)]
    pub latency: bool,
    /// A latency tenant's step-latency target in µs (`vgpuctl place --latency-target`); `None`
    /// when it gave none (its node then derives one from its latency alone). Only ever `Some`
    /// with `latency`, within the API's bounds ([`AssignmentSet::from_proto`] drops others).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_target_us: Option<u64>,
}

/// One tenant's share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SliceAssignment {
    pub gpu_index: u32,
    pub gpu_uuid: String,
    pub compute_percent: u32,
    pub memory_bytes: u64,
    /// Whether the compute share is guaranteed (a reservation) rather than best effort.
    pub guaranteed: bool,
    /// Whether the tenant may use idle compute beyond its share.
    pub burst: bool,
    /// Elastic memory (issue 17): what the tenant may hold on the GPU, at least `memory_bytes`;
    /// 0 (a control plane or a state file from before limits): `memory_bytes`.
    #[serde(default)]
    pub memory_limit_bytes: u64,
}

impl SliceAssignment {
    /// The tenant's memory limit on this GPU: never below its request.
    pub fn limit_bytes(&self) -> u64 {
        self.memory_limit_bytes.max(self.memory_bytes)
    }
}

impl AssignmentSet {
    /// Converts a message of the `WatchAssignments` stream. Entries that the agent cannot act on
    /// (a tenant name unfit for a file name, slices of another node, a repeated tenant) are left
    /// out and described in the returned warnings.
    pub fn from_proto(message: &api::v1::Assignments, node: &str) -> (AssignmentSet, Vec<String>) {
        let mut warnings = Vec::new();
        let mut tenants = BTreeMap::new();
        for assignment in &message.assignments {
            if let Err(error) = api::names::validate("tenant", &assignment.tenant) {
                warnings.push(format!(
                    "ignoring an assignment with an unusable tenant name: {error}"
                ));
                continue;
            }
            let mut slices: Vec<SliceAssignment> = assignment
                .slices
                .iter()
                .filter(|slice| slice.node.is_empty() || slice.node == node)
                .map(|slice| SliceAssignment {
                    gpu_index: slice.gpu_index,
                    gpu_uuid: slice.gpu.clone(),
                    compute_percent: slice.compute_percent,
                    memory_bytes: slice.memory_bytes,
                    guaranteed: slice.guaranteed,
                    burst: slice.burst,
                    memory_limit_bytes: slice.memory_limit_bytes,
                })
                .collect();
            if slices.len() != assignment.slices.len() {
                warnings.push(format!(
                    "tenant {}: ignoring {} slices addressed to other nodes",
                    assignment.tenant,
                    assignment.slices.len() - slices.len()
                ));
            }
            if slices.is_empty() {
                continue;
            }
            slices.sort();
            let latency_target_us = match api::validate::check_latency_target(
                assignment.latency,
                assignment.latency_target_us,
            ) {
                Ok(()) => {
                    (assignment.latency_target_us > 0).then_some(assignment.latency_target_us)
                }
                Err(error) => {
                    warnings.push(format!(
                        "tenant {}: ignoring its latency target: {error}",
                        assignment.tenant
                    ));
                    None
                }
            };
            let entry = TenantAssignment {
                tenant: assignment.tenant.clone(),
                priority: assignment.priority,
                slices,
                bandwidth_weight: assignment.bandwidth_weight,
                latency: assignment.latency,
                latency_target_us,
            };
            if tenants.len() >= TENANTS_PER_NODE_MAX {
                warnings.push(format!(
                    "more than {TENANTS_PER_NODE_MAX} tenants on this node; ignoring tenant {}",
                    assignment.tenant
                ));
                continue;
            }
            if tenants.insert(assignment.tenant.clone(), entry).is_some() {
                warnings.push(format!(
                    "tenant {} appears twice; keeping the last entry",
                    assignment.tenant
                ));
            }
        }
        let node_state = node_state_name(message.node_state).to_owned();
        let set = AssignmentSet {
            revision: message.revision,
            node_state,
            tenants,
        };
        set.assert_consistent();
        (set, warnings)
    }

    /// Checks the invariants every constructor keeps.
    pub fn assert_consistent(&self) {
        assert!(self.tenants.len() <= TENANTS_PER_NODE_MAX);
        for (name, assignment) in &self.tenants {
            assert_eq!(name, &assignment.tenant, "tenants are keyed by their name");
            assert!(
                !assignment.slices.is_empty(),
                "tenant {name} has slices on this node"
            );
            assert!(
                assignment.slices.is_sorted(),
                "tenant {name}: slices are sorted"
            );
            assert!(
                assignment.latency_target_us.is_none() || assignment.latency,
                "tenant {name}: only a latency tenant has a latency target"
            );
        }
    }
}

/// The lower-case name of a `NodeState` value.
pub fn node_state_name(state: i32) -> &'static str {
    match api::v1::NodeState::try_from(state) {
        Ok(api::v1::NodeState::Ready) => "ready",
        Ok(api::v1::NodeState::Lost) => "lost",
        Ok(api::v1::NodeState::Draining) => "draining",
        Ok(api::v1::NodeState::Unspecified) | Err(_) => "unknown",
    }
}

impl fmt::Display for SliceAssignment {
    /// `GPU 0 (25%, 20GiB)`, with `, burst` and `, best effort` when they apply.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "GPU {} ({}%, {}",
            self.gpu_index,
            self.compute_percent,
            api::size::format_bytes(self.memory_bytes)
        )?;
        if self.burst {
            formatter.write_str(", burst")?;
        }
        if !self.guaranteed {
            formatter.write_str(", best effort")?;
        }
        formatter.write_str(")")
    }
}

impl TenantAssignment {
    /// `GPU 0 (25%, 20GiB), GPU 1 (100%, 80GiB)`.
    pub fn describe_slices(&self) -> String {
        self.slices
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(node: &str, gpu_index: u32) -> api::v1::Slice {
        api::v1::Slice {
            node: node.into(),
            gpu: format!("GPU-{gpu_index}"),
            gpu_index,
            compute_percent: 25,
            memory_bytes: 20 << 30,
            guaranteed: true,
            burst: false,
            memory_limit_bytes: 0,
        }
    }

    #[test]
    fn converts_a_stream_message_and_drops_what_it_cannot_use() {
        let message = api::v1::Assignments {
            revision: 7,
            node_state: api::v1::NodeState::Draining as i32,
            assignments: vec![
                api::v1::Assignment {
                    tenant: "infer-a".into(),
                    slices: vec![slice("node-a", 3), slice("node-b", 0), slice("node-a", 1)],
                    priority: 5,
                    bandwidth_weight: 0,
                    latency: false,
                    latency_target_us: 0,
                },
                api::v1::Assignment {
                    tenant: "../escape".into(),
                    slices: vec![slice("node-a", 0)],
                    priority: 0,
                    bandwidth_weight: 0,
                    latency: false,
                    latency_target_us: 0,
                },
                api::v1::Assignment {
                    tenant: "elsewhere".into(),
                    slices: vec![slice("node-b", 0)],
                    priority: 0,
                    bandwidth_weight: 0,
                    latency: false,
                    latency_target_us: 0,
                },
            ],
        };
        let (set, warnings) = AssignmentSet::from_proto(&message, "node-a");
        assert_eq!(set.revision, 7);
        assert_eq!(set.node_state, "draining");
        assert_eq!(set.tenants.keys().collect::<Vec<_>>(), ["infer-a"]);
        let indexes: Vec<u32> = set.tenants["infer-a"]
            .slices
            .iter()
            .map(|slice| slice.gpu_index)
            .collect();
        assert_eq!(indexes, [1, 3]);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
    }

    #[test]
    fn a_latency_target_is_kept_for_latency_tenants_only() {
        let assignment = |tenant: &str, latency, latency_target_us| api::v1::Assignment {
            tenant: tenant.into(),
            slices: vec![slice("node-a", 0)],
            latency,
            latency_target_us,
            ..api::v1::Assignment::default()
        };
        let message = api::v1::Assignments {
            revision: 3,
            node_state: api::v1::NodeState::Ready as i32,
            assignments: vec![
                assignment("chat", true, 2_000),
                assignment("derived", true, 0),
                assignment("batch", false, 2_000),
                assignment("tiny", true, 1),
            ],
        };
        let (set, warnings) = AssignmentSet::from_proto(&message, "node-a");
        let targets: Vec<(&str, Option<u64>)> = set
            .tenants
            .values()
            .map(|t| (t.tenant.as_str(), t.latency_target_us))
            .collect();
        assert_eq!(
            targets,
            [
                ("batch", None),
                ("chat", Some(2_000)),
                ("derived", None),
                ("tiny", None)
            ]
        );
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("tenant batch"), "{warnings:?}");
    }

    #[test]
    fn slices_read_well_in_logs() {
        let mut slice = SliceAssignment {
            gpu_index: 0,
            gpu_uuid: "GPU-0".into(),
            compute_percent: 25,
            memory_bytes: 20 << 30,
            guaranteed: true,
            burst: false,
            memory_limit_bytes: 0,
        };
        assert_eq!(slice.to_string(), "GPU 0 (25%, 20GiB)");
        slice.burst = true;
        slice.guaranteed = false;
        assert_eq!(slice.to_string(), "GPU 0 (25%, 20GiB, burst, best effort)");
    }
}
