//! What changed between two assignment sets: the pure core of the agent's follow loop.
//!
//! [`reconcile`] compares the set the agent last acted on (restored from disk after a restart)
//! with the newest one from the control plane and returns the tenants to stop, change and start.
//! The runtime applies the list to the per-tenant files and logs each entry. No I/O here.

use std::fmt;

use crate::assignments::{AssignmentSet, TenantAssignment};

/// One tenant's change on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The tenant was not on this node and now is.
    Started(TenantAssignment),
    /// The tenant was on this node and no longer is.
    Stopped(TenantAssignment),
    /// The tenant stays, with other slices, another priority or latency target, or another
    /// bandwidth weight.
    Changed {
        before: TenantAssignment,
        after: TenantAssignment,
    },
}

impl Change {
    /// The tenant's name.
    pub fn tenant(&self) -> &str {
        match self {
            Change::Started(assignment) | Change::Stopped(assignment) => &assignment.tenant,
            Change::Changed { after, .. } => &after.tenant,
        }
    }
}

/// Counts of each kind of change, for the summary line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChangeCounts {
    pub started: usize,
    pub stopped: usize,
    pub changed: usize,
}

impl ChangeCounts {
    pub fn of(changes: &[Change]) -> ChangeCounts {
        let mut counts = ChangeCounts::default();
        for change in changes {
            match change {
                Change::Started(_) => counts.started += 1,
                Change::Stopped(_) => counts.stopped += 1,
                Change::Changed { .. } => counts.changed += 1,
            }
        }
        counts
    }
}

/// The changes that turn `old` into `new`: first every stopped tenant, then every changed one,
/// then every started one, each group by tenant name. Stops come first so that an enforcement
/// layer applying the list in order frees capacity before it hands capacity out.
pub fn reconcile(old: &AssignmentSet, new: &AssignmentSet) -> Vec<Change> {
    let mut stopped = Vec::new();
    let mut changed = Vec::new();
    let mut started = Vec::new();
    for (name, before) in &old.tenants {
        match new.tenants.get(name) {
            None => stopped.push(Change::Stopped(before.clone())),
            Some(after) if after != before => changed.push(Change::Changed {
                before: before.clone(),
                after: after.clone(),
            }),
            Some(_) => {}
        }
    }
    for (name, after) in &new.tenants {
        if !old.tenants.contains_key(name) {
            started.push(Change::Started(after.clone()));
        }
    }
    let mut changes = stopped;
    changes.append(&mut changed);
    changes.append(&mut started);
    assert!(changes.len() <= old.tenants.len() + new.tenants.len());
    changes
}

impl fmt::Display for Change {
    /// `tenant a: started on GPU 0 (25%, 20GiB)`, `tenant b: stopped`,
    /// `tenant c: changed from GPU 0 (25%, 20GiB) to GPU 1 (50%, 40GiB)`.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::Started(assignment) => {
                write!(
                    formatter,
                    "tenant {}: started on {}",
                    assignment.tenant,
                    assignment.describe_slices()
                )
            }
            Change::Stopped(assignment) => {
                write!(formatter, "tenant {}: stopped", assignment.tenant)
            }
            Change::Changed { before, after } => {
                write!(formatter, "tenant {}: changed", after.tenant)?;
                if before.slices != after.slices {
                    write!(
                        formatter,
                        " from {} to {}",
                        before.describe_slices(),
                        after.describe_slices()
                    )?;
                }
                if before.priority != after.priority {
                    write!(
                        formatter,
                        " priority {} to {}",
                        before.priority, after.priority
                    )?;
                }
                if before.latency_target_us != after.latency_target_us {
                    let target = |microseconds: Option<u64>| {
                        microseconds.map_or_else(|| "none".to_owned(), |us| format!("{us}us"))
                    };
                    write!(
                        formatter,
                        " latency target {} to {}",
                        target(before.latency_target_us),
                        target(after.latency_target_us)
                    )?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignments::SliceAssignment;

    fn tenant(
        name: &str,
        gpu_index: u32,
        compute_percent: u32,
        memory_gib: u64,
    ) -> TenantAssignment {
        TenantAssignment {
            tenant: name.into(),
            priority: 0,
            bandwidth_weight: 0,
            latency: false,
            latency_target_us: None,
            slices: vec![SliceAssignment {
                gpu_index,
                gpu_uuid: format!("GPU-{gpu_index}"),
                compute_percent,
                memory_bytes: memory_gib << 30,
                guaranteed: true,
                burst: false,
                memory_limit_bytes: 0,
            }],
        }
    }

    fn set(revision: u64, tenants: &[TenantAssignment]) -> AssignmentSet {
        AssignmentSet {
            revision,
            node_state: "ready".into(),
            tenants: tenants
                .iter()
                .map(|t| (t.tenant.clone(), t.clone()))
                .collect(),
        }
    }

    #[test]
    fn nothing_changes_between_equal_sets() {
        let a = set(3, &[tenant("a", 0, 25, 20)]);
        assert_eq!(reconcile(&a, &a), []);
        // A new revision with the same tenants changes nothing on the node.
        assert_eq!(reconcile(&a, &set(9, &[tenant("a", 0, 25, 20)])), []);
        assert_eq!(
            reconcile(&AssignmentSet::default(), &AssignmentSet::default()),
            []
        );
    }

    #[test]
    fn finds_started_stopped_and_changed_tenants_in_order() {
        let old = set(
            3,
            &[
                tenant("keep", 0, 25, 20),
                tenant("move", 1, 50, 40),
                tenant("zzz-gone", 2, 100, 80),
            ],
        );
        let mut reprioritised = tenant("keep", 0, 25, 20);
        reprioritised.priority = 10;
        let new = set(
            4,
            &[
                reprioritised.clone(),
                tenant("move", 3, 50, 40),
                tenant("aaa-new", 0, 25, 20),
            ],
        );
        let changes = reconcile(&old, &new);
        assert_eq!(
            changes,
            [
                Change::Stopped(tenant("zzz-gone", 2, 100, 80)),
                Change::Changed {
                    before: tenant("keep", 0, 25, 20),
                    after: reprioritised
                },
                Change::Changed {
                    before: tenant("move", 1, 50, 40),
                    after: tenant("move", 3, 50, 40)
                },
                Change::Started(tenant("aaa-new", 0, 25, 20)),
            ]
        );
        assert_eq!(
            ChangeCounts::of(&changes),
            ChangeCounts {
                started: 1,
                stopped: 1,
                changed: 2
            }
        );
        let lines: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [
                "tenant zzz-gone: stopped",
                "tenant keep: changed priority 0 to 10",
                "tenant move: changed from GPU 1 (50%, 40GiB) to GPU 3 (50%, 40GiB)",
                "tenant aaa-new: started on GPU 0 (25%, 20GiB)",
            ]
        );
    }

    #[test]
    fn a_new_latency_target_or_share_changes_the_tenant_in_place() {
        let mut before = tenant("chat", 0, 25, 20);
        before.latency = true;
        let mut after = before.clone();
        after.latency_target_us = Some(1_500);
        after.slices[0].compute_percent = 40;
        let changes = reconcile(&set(3, &[before.clone()]), &set(4, &[after.clone()]));
        assert_eq!(changes, [Change::Changed { before, after }]);
        assert_eq!(
            changes[0].to_string(),
            "tenant chat: changed from GPU 0 (25%, 20GiB) to GPU 0 (40%, 20GiB) latency target none to 1500us"
        );
    }

    #[test]
    fn a_restart_with_an_empty_disk_starts_everything_and_an_empty_set_stops_everything() {
        let full = set(5, &[tenant("a", 0, 25, 20), tenant("b", 1, 100, 80)]);
        let empty = AssignmentSet::default();
        let up = reconcile(&empty, &full);
        assert_eq!(
            ChangeCounts::of(&up),
            ChangeCounts {
                started: 2,
                stopped: 0,
                changed: 0
            }
        );
        let down = reconcile(&full, &empty);
        assert_eq!(
            down.iter().map(Change::tenant).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(
            down.iter()
                .all(|change| matches!(change, Change::Stopped(_)))
        );
    }

    #[test]
    fn multi_gpu_tenants_list_every_slice() {
        let mut wide = tenant("wide", 0, 100, 80);
        wide.slices.push(SliceAssignment {
            gpu_index: 1,
            gpu_uuid: "GPU-1".into(),
            ..wide.slices[0].clone()
        });
        let changes = reconcile(&AssignmentSet::default(), &set(1, &[wide]));
        assert_eq!(
            changes[0].to_string(),
            "tenant wide: started on GPU 0 (100%, 80GiB), GPU 1 (100%, 80GiB)"
        );
    }
}
