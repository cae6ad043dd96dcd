//! Changing a tenant in place (`Event::Update`): a new guaranteed compute share on the GPUs it
//! holds, or a new priority. A placed tenant is never moved: a share that does not fit its GPU
//! is refused with the reason, and nothing changes. Whole GPUs are exclusive, so their share is
//! not theirs to change, and a pinned tenant's slices are its Kubernetes claim's. After a change the pending queue is tried again (a smaller share or
//! another priority may let a waiting tenant in).

use crate::engine::{Engine, Placement, QueueKey};
use crate::search::Need;
use crate::types::{Command, SliceAssignment};

impl Engine {
    pub(crate) fn update(
        &mut self,
        tenant: &str,
        compute_percent: Option<u32>,
        priority: Option<i32>,
        commands: &mut Vec<Command>,
    ) {
        let pinned = self
            .tenants
            .get(tenant)
            .is_some_and(|record| record.pin.is_some());
        let checked = match compute_percent {
            // Kubernetes allocated a pinned tenant's slices: a change belongs in its claim.
            _ if pinned => Err(format!(
                "tenant {tenant} holds a Kubernetes claim's slices; change the claim (its ResourceClaim), not the tenant"
            )),
            Some(percent) => self.check_share(tenant, percent),
            None if self.tenants.contains_key(tenant) => Ok(()),
            None => Err(format!("no tenant is named {tenant}")),
        };
        if let Err(reason) = checked {
            commands.push(Command::Refused {
                tenant: tenant.to_string(),
                reason,
            });
            return;
        }
        if let Some(priority) = priority {
            self.set_priority(tenant, priority);
        }
        if let Some(percent) = compute_percent {
            self.set_share(tenant, percent);
        }
        let record = &self.tenants[tenant];
        assert!(
            Need::of(&record.request).is_ok(),
            "a changed request stays valid"
        );
        let slices = match &record.placement {
            Placement::Placed { slices } => slices.clone(),
            Placement::Pending { .. } => Vec::new(),
        };
        commands.push(Command::Updated {
            tenant: tenant.to_string(),
            slices,
        });
        self.retry_pending(commands);
    }

    /// Whether `tenant` may hold `percent` of each of its GPUs: a fraction of a GPU, and, when
    /// placed, the share fits next to the GPU's other tenants. `Err` says why not.
    fn check_share(&self, tenant: &str, percent: u32) -> Result<(), String> {
        let Some(record) = self.tenants.get(tenant) else {
            return Err(format!("no tenant is named {tenant}"));
        };
        if !(1..=100).contains(&percent) {
            return Err(format!(
                "a compute share is between 1% and 100%, not {percent}%"
            ));
        }
        match Need::of(&record.request) {
            Ok(Need::Fraction { .. }) => {}
            Ok(Need::Whole { .. }) => {
                return Err(format!(
                    "tenant {tenant} holds whole GPUs, which are its alone (100% compute); a compute share applies to a fraction of a GPU"
                ));
            }
            Err(reason) => unreachable!("kept tenants are valid: {reason}"),
        }
        let Placement::Placed { slices } = &record.placement else {
            return Ok(());
        };
        for slice in slices {
            let node = &self.nodes[&slice.node];
            let position = node.position_of[&slice.gpu_index];
            let others = node.usage[position].compute_allocated_percent - slice.compute_percent;
            let room = 100 - others;
            if percent > room {
                return Err(format!(
                    "GPU {} of node {} has room for {room}% for tenant {tenant} ({}% now, {}% unallocated); a placed tenant is not moved: ask for at most {room}%, or release it and place it again",
                    slice.gpu_index,
                    slice.node,
                    slice.compute_percent,
                    room - slice.compute_percent
                ));
            }
        }
        Ok(())
    }

    /// The tenant's new priority: its queue position if pending, its count if placed.
    fn set_priority(&mut self, tenant: &str, priority: i32) {
        let record = &self.tenants[tenant];
        let old = record.request.priority;
        if old == priority {
            return;
        }
        let preemptible = record.request.preemptible;
        match record.placement {
            Placement::Pending { .. } => {
                let key = QueueKey::of(tenant, record);
                assert!(self.queue.remove(&key), "a pending tenant is queued");
                let record = self.tenants.get_mut(tenant).expect("known tenant");
                record.request.priority = priority;
                let key = QueueKey::of(tenant, record);
                assert!(self.queue.insert(key));
            }
            Placement::Placed { .. } => {
                let counts = self
                    .placed_by_priority
                    .get_mut(&old)
                    .expect("placed tenants are counted");
                let count = if preemptible {
                    &mut counts.1
                } else {
                    &mut counts.0
                };
                assert!(*count >= 1);
                *count -= 1;
                if *counts == (0, 0) {
                    self.placed_by_priority.remove(&old);
                }
                let counts = self.placed_by_priority.entry(priority).or_default();
                if preemptible {
                    counts.1 += 1;
                } else {
                    counts.0 += 1;
                }
                self.tenants
                    .get_mut(tenant)
                    .expect("known tenant")
                    .request
                    .priority = priority;
            }
        }
    }

    /// The tenant's new share: in its request, and on its GPUs if placed (checked to fit).
    fn set_share(&mut self, tenant: &str, percent: u32) {
        let record = self.tenants.get_mut(tenant).expect("known tenant");
        record.request.compute_percent = Some(percent);
        let Placement::Placed { slices } = &mut record.placement else {
            return;
        };
        let before: Vec<SliceAssignment> = slices.clone();
        for slice in slices.iter_mut() {
            slice.compute_percent = percent;
        }
        for slice in &before {
            self.index_remove(&slice.node);
            let node = self
                .nodes
                .get_mut(&slice.node)
                .expect("slices name known nodes");
            let position = node.position_of[&slice.gpu_index];
            node.free(position, tenant, slice.compute_percent, slice.memory_bytes);
            node.allocate(position, tenant, percent, slice.memory_bytes);
            let model = &node.spec.gpus[position].model;
            self.models
                .take(model, i64::from(percent) - i64::from(slice.compute_percent));
            self.index_insert(&slice.node);
        }
    }
}
