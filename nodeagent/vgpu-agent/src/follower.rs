//! Follows the node's assignments: takes each message of the `WatchAssignments` stream, works out
//! what changed since the set the agent last acted on, applies that to the state directory and
//! logs it. After a restart the first set it acts on is the one restored from disk, so the first
//! message reconciles whatever happened while the agent was down. When CDI specs are on
//! ([`Follower::with_cdi`]), the spec follows every applied set; a spec that cannot be written is
//! logged, never a reason to refuse the assignments. With [`Follower::with_private`], the
//! tenants' private directories ([`crate::private`]) are brought in line with each set before
//! it is committed, so a tenant is never seen as placed before its directory exists.
//!
//! A damaged `assignments.json` at start (issue 22: a truncated one made the agent delete every
//! tenant's private directory, ledger and schedule links included, before the control plane's
//! set brought them back empty) is moved aside and the restored set is *unknown*: until the
//! first message is applied, no private directory is removed and the CDI spec is left as it is.
//! The first message then removes only the directories of tenants the control plane no longer
//! places here.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::assignments::AssignmentSet;
use crate::cdi::CdiWriter;
use crate::error::{Error, Result};
use crate::private::{self, Layout};
use crate::reconcile::{Change, ChangeCounts, reconcile};
use crate::state::StateDir;

/// The assignments the agent acts on, and where they are persisted.
#[derive(Debug)]
pub struct Follower {
    state: StateDir,
    node: String,
    current: AssignmentSet,
    /// False while `current` stands for a damaged file: what the node runs is unknown until the
    /// control plane's first set is applied, so nothing is removed on its strength.
    known: bool,
    reconciled: bool,
    cdi: Option<CdiWriter>,
    private: Option<Layout>,
    /// The node's GPUs (uuid -> memory bytes) whose memory boards are kept with the private
    /// directories (`private::publish_boards`); empty: none.
    gpu_memory: std::collections::BTreeMap<String, u64>,
    /// The node's swap staging budget (`swap_host_memory`), split evenly over `gpu_memory`'s
    /// boards.
    swap_host_memory: u64,
    /// One swap staging file per GPU (`shared_staging`).
    shared_staging: bool,
}

impl Follower {
    /// Loads the persisted assignments. A damaged file is moved aside and logged, and the set is
    /// unknown until the control plane's first message, which rebuilds everything; tenant files
    /// that do not read back are removed (the first message writes them again).
    pub fn restore(state: StateDir, node: &str) -> Result<Follower> {
        let (current, known) = match state.load() {
            Ok(set) => (set, true),
            Err(error @ Error::StateCorrupt { .. }) => {
                let aside = state.quarantine_assignments()?;
                warn!(
                    "{error}; moved it to {} and keeping every tenant's private directory until the control plane's assignments arrive",
                    aside.display()
                );
                (AssignmentSet::default(), false)
            }
            Err(error) => return Err(error),
        };
        for tenant in state.remove_damaged_tenant_files()? {
            warn!(
                "tenant {tenant}: its state file was damaged; removed it until the control plane's assignments rewrite it"
            );
        }
        if known {
            info!(
                "restored {} assignments (revision {}) from {}",
                current.tenants.len(),
                current.revision,
                state.root().display()
            );
        }
        Ok(Follower {
            state,
            node: node.to_owned(),
            current,
            known,
            reconciled: false,
            cdi: None,
            private: None,
            gpu_memory: Default::default(),
            swap_host_memory: 0,
            shared_staging: false,
        })
    }

    /// Keeps a memory board for each of these GPUs (uuid -> memory bytes) beside the private
    /// directories, from the next preparation on (set it before [`Follower::with_private`]).
    pub fn with_gpu_memory(mut self, gpus: std::collections::BTreeMap<String, u64>) -> Follower {
        self.gpu_memory = gpus;
        self
    }

    /// The node's pinned host memory for swapped-out borrowed memory, written into the boards
    /// (set it before [`Follower::with_private`]).
    /// Keeps one swap staging file per GPU, shared by its processes.
    pub fn with_shared_staging(mut self, on: bool) -> Follower {
        self.shared_staging = on;
        self
    }

    pub fn with_swap_host_memory(mut self, bytes: u64) -> Follower {
        self.swap_host_memory = bytes;
        self
    }

    /// Keeps a CDI spec in step with the assignments, starting with the restored set.
    pub fn with_cdi(mut self, writer: CdiWriter) -> Follower {
        self.cdi = Some(writer);
        self.update_cdi();
        self
    }

    /// Keeps the tenants' private directories under `layout` in step with the assignments,
    /// starting with the restored set.
    pub fn with_private(mut self, layout: Layout) -> Follower {
        self.private = Some(layout);
        let current = self.current.clone();
        self.prepare_private(&current);
        self
    }

    /// Best effort: a directory that cannot be made is logged (the tenant's processes then
    /// fail to open their files with a message), never a reason to refuse the assignments.
    fn prepare_private(&self, set: &AssignmentSet) {
        let Some(layout) = &self.private else { return };
        if !self.known {
            // Preparing for an empty set would remove every tenant's directory.
            return;
        }
        let quantum = tenant_abi::compute::QUANTUM_NS_DEFAULT;
        match private::prepare(layout, set, &private::agent_owner, quantum) {
            Ok(prepared) => {
                for tenant in &prepared.created {
                    info!(
                        "tenant {tenant}: private directory {}",
                        layout.tenant_dir(tenant).display()
                    );
                }
                for tenant in &prepared.removed {
                    info!("tenant {tenant}: removed its private directory (no longer placed)");
                }
                if !prepared.old_files.is_empty() {
                    warn!(
                        "removed {} files of the shared layout before private directories from {}: {:?}",
                        prepared.old_files.len(),
                        layout.root().display(),
                        prepared.old_files
                    );
                }
                for problem in &prepared.problems {
                    warn!("{problem}");
                }
                let gpus = private::BoardGpus {
                    memory_bytes: &self.gpu_memory,
                    swap_host_memory_bytes: self.swap_host_memory,
                    shared_staging: self.shared_staging,
                };
                for problem in private::publish_boards(layout, set, &gpus) {
                    warn!("{problem}");
                }
            }
            Err(error) => warn!("{error}"),
        }
    }

    /// Gives the running processes of each changed tenant its new compute share and priority:
    /// for every slice that stays on the same GPU with another compute percent, or on a tenant
    /// whose priority changed, rewrites the tenant's config word in that GPU's schedule
    /// ([`ScheduleControl::set_share`](tenant_abi::shm::ScheduleControl::set_share)); their turn
    /// logic reads it at the next handover. New processes get the same values from their
    /// environment. A GPU without a schedule file, or without a live slot of the tenant, has no
    /// running process to change. Best effort: a file that cannot be opened is logged.
    fn retune_running(&self, changes: &[Change]) {
        let Some(layout) = &self.private else { return };
        for change in changes {
            let Change::Changed { before, after } = change else {
                continue;
            };
            for slice in &after.slices {
                let Some(old_slice) = before
                    .slices
                    .iter()
                    .find(|old| old.gpu_uuid == slice.gpu_uuid)
                else {
                    continue;
                };
                if old_slice.compute_percent == slice.compute_percent
                    && before.priority == after.priority
                {
                    continue;
                }
                let path = layout.schedule(&slice.gpu_uuid);
                let control = match tenant_abi::shm::ScheduleControl::open(&path) {
                    Ok(control) => control,
                    Err(error) if error.is_not_found() => continue,
                    Err(error) => {
                        warn!(
                            "tenant {}: cannot give its running processes on GPU {} the new share: {error}",
                            after.tenant, slice.gpu_uuid
                        );
                        continue;
                    }
                };
                let tenant = &after.tenant;
                match control.set_share(tenant, slice.compute_percent, after.priority) {
                    Some((old, new)) => info!(
                        "tenant {tenant}: running processes on GPU {} now at {}% priority {} (were {}% priority {})",
                        slice.gpu_uuid, new.share_pct, new.priority, old.share_pct, old.priority
                    ),
                    None => debug!(
                        "tenant {tenant}: no running process on GPU {} to give the new share",
                        slice.gpu_uuid
                    ),
                }
            }
        }
    }

    fn update_cdi(&mut self) {
        let Some(writer) = &mut self.cdi else {
            return;
        };
        if !self.known {
            // The spec of the last good set stays until the control plane's set replaces it.
            return;
        }
        match writer.update(&self.current) {
            Ok(true) => info!(
                "CDI spec {} now lists {} tenants",
                writer.path().display(),
                self.current.tenants.len()
            ),
            Ok(false) => {}
            Err(error) => warn!("cannot update the CDI spec: {error}"),
        }
    }

    /// The set last applied (or restored).
    pub fn current(&self) -> &AssignmentSet {
        &self.current
    }

    /// Whether [`Follower::current`] is what the node runs: false after a damaged state file,
    /// until the control plane's first set is applied.
    pub fn is_known(&self) -> bool {
        self.known
    }

    /// Applies one stream message from the control-plane node at `source`. On error nothing is
    /// taken as applied, so the next message (after a reconnect) tries again from the same base.
    pub fn on_message(
        &mut self,
        message: &api::v1::Assignments,
        source: &str,
    ) -> Result<Vec<Change>> {
        let (new, warnings) = AssignmentSet::from_proto(message, &self.node);
        for warning in warnings {
            warn!("{warning}");
        }
        if new.revision < self.current.revision {
            warn!(
                "assignments revision went backwards from {} to {} (control plane {source}); following the newest set of the current stream",
                self.current.revision, new.revision
            );
        }
        let changes = reconcile(&self.current, &new);
        // The control plane's set is what the node runs, whatever the restored one was.
        self.known = true;
        self.prepare_private(&new);
        let report = self.state.apply(&new, &changes)?;
        for change in &changes {
            info!("{change}");
        }
        self.retune_running(&changes);
        for tenant in &report.rewritten {
            warn!("tenant {tenant}: its state file was missing; rewrote it");
        }
        for tenant in &report.removed_stale {
            warn!("tenant {tenant}: removed a state file that no current assignment owns");
        }
        if new.node_state != self.current.node_state {
            info!("node state: {}", new.node_state);
        }
        info!(
            "assignments revision {}: {} tenants",
            new.revision,
            new.tenants.len()
        );
        if !self.reconciled {
            let counts = ChangeCounts::of(&changes);
            info!(
                "reconciled with the control plane: {} started, {} stopped, {} changed",
                counts.started, counts.stopped, counts.changed
            );
            self.reconciled = true;
        }
        self.current = new;
        self.update_cdi();
        Ok(changes)
    }
}

/// Failures the [`Worker`] holds for its owner to collect; more are logged and dropped (the
/// owner is dropping the stream by then anyway).
pub const WORKER_FAILURES_MAX: usize = 4;

/// One stream message handed to the [`Worker`].
#[derive(Debug)]
struct Offered {
    message: api::v1::Assignments,
    /// The control-plane address it came from, for the log.
    source: String,
    /// The number of the stream it came on ([`Failure::stream`]).
    stream: u64,
}

/// A message the [`Worker`] could not apply.
#[derive(Debug)]
pub struct Failure {
    /// The stream it came on, as numbered by [`Worker::offer`]'s caller.
    pub stream: u64,
    pub revision: u64,
    pub error: Error,
}

/// What a [`Worker`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerCounts {
    /// Messages offered.
    pub offered: u64,
    /// Messages replaced by a newer one before they were applied.
    pub coalesced: u64,
    /// Applications (successful or not).
    pub applied: u64,
}

#[derive(Debug, Default)]
struct Slot {
    /// The newest message not yet taken; a newer one replaces it.
    pending: Option<Offered>,
    stopping: bool,
    counts: WorkerCounts,
}

#[derive(Debug, Default)]
struct Shared {
    slot: Mutex<Slot>,
    wake: Condvar,
}

/// Applies assignment messages on a thread of its own, so that the heartbeat lane never waits
/// for a file write (issue 22, point 3: a node under churn went silent while its one task wrote
/// files). Messages are coalesced: each stream message is the node's whole set, so only the
/// newest matters, and at most one waits while another is applied ([`Worker::offer`]); a burst
/// of updates becomes a few applications of the latest set. A message that cannot be applied
/// comes back as a [`Failure`] ([`Worker::failure`]), and the owner drops the stream it came on,
/// so the next stream's first message tries again from the same base.
pub struct Worker {
    shared: Arc<Shared>,
    failures: tokio::sync::mpsc::Receiver<Failure>,
    finished: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Worker {
    /// Starts the thread; `apply` takes each message and the address it came from.
    pub fn spawn(
        mut apply: impl FnMut(&api::v1::Assignments, &str) -> Result<()> + Send + 'static,
    ) -> Result<Worker> {
        let shared = Arc::new(Shared::default());
        let (failure_sender, failures) = tokio::sync::mpsc::channel(WORKER_FAILURES_MAX);
        let (finished_sender, finished) = tokio::sync::oneshot::channel();
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("vgpu-assignments".into())
            .spawn(move || {
                while let Some(offered) = thread_shared.take() {
                    let result = apply(&offered.message, &offered.source);
                    thread_shared.slot().counts.applied += 1;
                    let Err(error) = result else { continue };
                    let failure = Failure {
                        stream: offered.stream,
                        revision: offered.message.revision,
                        error,
                    };
                    if let Err(dropped) = failure_sender.try_send(failure) {
                        warn!("an assignment failure was not passed on: {dropped}");
                    }
                }
                // Dropping `failure_sender` too tells the owner the thread is gone.
                let _ = finished_sender.send(());
            })
            .map_err(Error::WorkerThread)?;
        Ok(Worker {
            shared,
            failures,
            finished: Some(finished),
        })
    }

    /// Hands over the newest message of stream number `stream`, replacing one that waits; says
    /// whether it replaced one. Never blocks on the application.
    pub fn offer(&self, message: api::v1::Assignments, source: &str, stream: u64) -> bool {
        let mut slot = self.shared.slot();
        assert!(!slot.stopping, "no offers after stop");
        let replaced = slot
            .pending
            .replace(Offered {
                message,
                source: source.to_owned(),
                stream,
            })
            .is_some();
        slot.counts.offered += 1;
        slot.counts.coalesced += u64::from(replaced);
        assert!(slot.counts.coalesced + slot.counts.applied <= slot.counts.offered);
        drop(slot);
        self.shared.wake.notify_one();
        replaced
    }

    /// The next message that could not be applied; `None` once the thread is gone (it ended
    /// after [`Worker::stop`], or panicked). Cancel-safe.
    pub async fn failure(&mut self) -> Option<Failure> {
        self.failures.recv().await
    }

    pub fn counts(&self) -> WorkerCounts {
        self.shared.slot().counts
    }

    /// Drops what waits and stops the thread once the application in progress is done; says
    /// whether that happened within `limit`. State files are written atomically, so a process
    /// that exits without waiting leaves the old or the new file, never a mix.
    pub async fn stop(mut self, limit: Duration) -> bool {
        {
            let mut slot = self.shared.slot();
            slot.stopping = true;
            slot.pending = None;
        }
        self.shared.wake.notify_one();
        let finished = self.finished.take().expect("stopped once");
        tokio::time::timeout(limit, finished).await.is_ok()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shared.slot().stopping = true;
        self.shared.wake.notify_one();
    }
}

impl Shared {
    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().expect("the assignment slot")
    }

    /// Waits for the next message; `None` when stopping.
    fn take(&self) -> Option<Offered> {
        let mut slot = self.slot();
        loop {
            if slot.stopping {
                return None;
            }
            if let Some(offered) = slot.pending.take() {
                return Some(offered);
            }
            slot = self.wake.wait(slot).expect("the assignment slot");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(revision: u64, tenants: &[(&str, u32)]) -> api::v1::Assignments {
        api::v1::Assignments {
            revision,
            node_state: api::v1::NodeState::Ready as i32,
            assignments: tenants
                .iter()
                .map(|(tenant, gpu_index)| api::v1::Assignment {
                    tenant: (*tenant).into(),
                    priority: 0,
                    bandwidth_weight: 0,
                    latency: false,
                    latency_target_us: 0,
                    slices: vec![api::v1::Slice {
                        node: "node-a".into(),
                        gpu: format!("GPU-{gpu_index}"),
                        gpu_index: *gpu_index,
                        compute_percent: 100,
                        memory_bytes: 80 << 30,
                        guaranteed: true,
                        burst: false,
                        memory_limit_bytes: 0,
                    }],
                })
                .collect(),
        }
    }

    #[test]
    fn a_restart_reconciles_against_the_restored_set() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let mut follower = Follower::restore(state.clone(), "node-a").unwrap();
        let changes = follower
            .on_message(&message(5, &[("a", 0), ("b", 1)]), "cp-1")
            .unwrap();
        assert_eq!(changes.len(), 2);
        // The same set again (a reconnect) changes nothing.
        assert_eq!(
            follower
                .on_message(&message(5, &[("a", 0), ("b", 1)]), "cp-2")
                .unwrap(),
            []
        );
        drop(follower);

        // While the agent was down, `a` moved to GPU 2, `b` left and `c` arrived.
        let mut restarted = Follower::restore(state.clone(), "node-a").unwrap();
        assert_eq!(restarted.current().revision, 5);
        assert_eq!(restarted.current().tenants.len(), 2);
        let changes = restarted
            .on_message(&message(8, &[("a", 2), ("c", 3)]), "cp-1")
            .unwrap();
        let lines: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [
                "tenant b: stopped",
                "tenant a: changed from GPU 0 (100%, 80GiB) to GPU 2 (100%, 80GiB)",
                "tenant c: started on GPU 3 (100%, 80GiB)",
            ]
        );
        assert_eq!(state.load().unwrap().revision, 8);
        assert!(state.load_tenant("b").unwrap().is_none());
        assert_eq!(
            state.load_tenant("a").unwrap().unwrap().slices[0].gpu_index,
            2
        );
    }

    #[test]
    fn a_tenant_changed_in_place_is_rewritten_for_new_processes() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let mut follower = Follower::restore(state.clone(), "node-a").unwrap();
        let mut first = message(5, &[("chat", 0)]);
        first.assignments[0].latency = true;
        first.assignments[0].latency_target_us = 2_000;
        first.assignments[0].slices[0].compute_percent = 25;
        follower.on_message(&first, "cp-1").unwrap();
        // `vgpuctl set tenant chat --compute 40 --latency-target 1.5ms --priority 5`.
        let mut second = first.clone();
        second.revision = 6;
        second.assignments[0].latency_target_us = 1_500;
        second.assignments[0].priority = 5;
        second.assignments[0].slices[0].compute_percent = 40;
        let changes = follower.on_message(&second, "cp-1").unwrap();
        assert_eq!(changes.len(), 1);
        assert!(matches!(changes[0], Change::Changed { .. }));
        assert_eq!(
            changes[0].to_string(),
            "tenant chat: changed from GPU 0 (25%, 80GiB) to GPU 0 (40%, 80GiB) priority 0 to 5 latency target 2000us to 1500us"
        );
        // What `vgpu-agent exec` and `env` read from now on.
        let placement = crate::tenant::load_placement(directory.path(), "chat", "node-a").unwrap();
        let assignment = &placement.assignment;
        assert_eq!(
            (
                assignment.slices[0].compute_percent,
                assignment.priority,
                assignment.latency_target_us
            ),
            (40, 5, Some(1_500))
        );
        let file = state.load_tenant("chat").unwrap().unwrap();
        assert_eq!(
            (file.revision, file.priority, file.latency_target_us),
            (6, 5, Some(1_500))
        );
    }

    #[test]
    fn a_changed_share_and_priority_reach_the_running_processes_schedule_slots() {
        use tenant_abi::compute::{QUANTUM_NS_DEFAULT, Schedule, TenantConfig};
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(&directory.path().join("state"), "node-a").unwrap();
        let layout = Layout::new(&directory.path().join("shm"));
        let mut follower = Follower::restore(state, "node-a")
            .unwrap()
            .with_private(layout.clone());
        let mut first = message(5, &[("chat", 0), ("train", 0), ("idle", 1)]);
        first.assignments[0].slices[0].compute_percent = 25;
        first.assignments[1].slices[0].compute_percent = 50;
        first.assignments[2].slices[0].compute_percent = 30;
        follower.on_message(&first, "cp-1").unwrap();

        // Processes of `chat` and `train` run on GPU 0; none of `idle` has run on GPU 1, whose
        // schedule the agent made but where `idle` has no slot yet.
        let mapping =
            tenant_abi::writer::schedule(&layout.schedule("GPU-0"), QUANTUM_NS_DEFAULT).unwrap();
        let schedule = Schedule::new(mapping.region(), tenant_abi::ProcLiveness);
        let (pid, start_time) = (std::process::id(), tenant_abi::ledger::own_start_time());
        let joined = |share_pct| TenantConfig {
            share_pct,
            burst: true,
            guaranteed: false,
            priority: 0,
        };
        schedule
            .join("chat", joined(25), pid, start_time, 1_000)
            .unwrap();
        schedule
            .join("train", joined(50), pid, start_time, 1_000)
            .unwrap();

        // `vgpuctl set tenant chat --compute 40 --priority 5`, `... idle --compute 60`, and a
        // change of `train` that touches neither its share nor its priority.
        let mut second = first.clone();
        second.revision = 6;
        second.assignments[0].priority = 5;
        second.assignments[0].slices[0].compute_percent = 40;
        second.assignments[1].slices[0].memory_bytes = 40 << 30;
        second.assignments[2].slices[0].compute_percent = 60;
        let changes = follower.on_message(&second, "cp-1").unwrap();
        assert_eq!(changes.len(), 3);

        let control = tenant_abi::shm::ScheduleControl::open(&layout.schedule("GPU-0")).unwrap();
        // The share and priority are the new ones; burst and guaranteed stay as the slot had them.
        assert_eq!(
            control.tenant_config("chat"),
            Some(TenantConfig {
                share_pct: 40,
                priority: 5,
                ..joined(25)
            })
        );
        assert_eq!(control.tenant_config("train"), Some(joined(50)));
        let gpu_1 = tenant_abi::shm::ScheduleControl::open(&layout.schedule("GPU-1")).unwrap();
        assert_eq!(gpu_1.tenant_config("idle"), None, "no slot is made for it");

        // Moving to another GPU changes nothing on the old one (its processes keep their slot
        // until they exit); the new GPU's processes join with the new environment.
        let mut third = second.clone();
        third.revision = 7;
        third.assignments[0].slices[0].gpu = "GPU-1".into();
        third.assignments[0].slices[0].gpu_index = 1;
        third.assignments[0].slices[0].compute_percent = 10;
        follower.on_message(&third, "cp-1").unwrap();
        assert_eq!(control.tenant_config("chat").unwrap().share_pct, 40);
    }

    #[test]
    fn an_older_revision_from_another_control_plane_node_is_still_followed() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let mut follower = Follower::restore(state, "node-a").unwrap();
        follower
            .on_message(&message(10, &[("a", 0)]), "cp-1")
            .unwrap();
        let changes = follower.on_message(&message(9, &[]), "cp-2").unwrap();
        assert_eq!(changes.len(), 1);
        assert_eq!(follower.current().revision, 9);
    }

    /// A worker whose application of each message waits for the test's word, and tells which
    /// revision it started on.
    fn gated_worker() -> (
        Worker,
        std::sync::mpsc::Receiver<u64>,
        std::sync::mpsc::SyncSender<Result<()>>,
    ) {
        let (started_sender, started) = std::sync::mpsc::channel();
        let (gate, gate_receiver) = std::sync::mpsc::sync_channel::<Result<()>>(0);
        let worker = Worker::spawn(move |message, _| {
            started_sender.send(message.revision).unwrap();
            gate_receiver.recv().unwrap()
        })
        .unwrap();
        (worker, started, gate)
    }

    #[tokio::test]
    async fn a_burst_of_updates_becomes_two_applications_of_the_latest_set() {
        let (worker, started, gate) = gated_worker();
        assert!(!worker.offer(message(1, &[("a", 0)]), "cp-1", 1));
        assert_eq!(started.recv().unwrap(), 1, "the first is being applied");
        // 199 more while it is: each replaces the one that waits, and `offer` never blocks.
        for revision in 2..=200 {
            let replaced = worker.offer(message(revision, &[("a", 0)]), "cp-1", 1);
            assert_eq!(replaced, revision > 2);
        }
        assert_eq!(
            worker.counts(),
            WorkerCounts {
                offered: 200,
                coalesced: 198,
                applied: 0
            }
        );
        gate.send(Ok(())).unwrap();
        assert_eq!(started.recv().unwrap(), 200, "then only the newest");
        gate.send(Ok(())).unwrap();
        assert!(worker.stop(Duration::from_secs(10)).await);
        assert!(started.try_recv().is_err(), "nothing else was applied");
    }

    #[tokio::test]
    async fn a_message_that_cannot_be_applied_comes_back_with_its_stream() {
        let (mut worker, started, gate) = gated_worker();
        worker.offer(message(7, &[]), "cp-1", 3);
        assert_eq!(started.recv().unwrap(), 7);
        gate.send(Err(Error::BadLabel("x".into()))).unwrap();
        let failure = worker.failure().await.unwrap();
        assert_eq!((failure.stream, failure.revision), (3, 7));
        assert!(matches!(failure.error, Error::BadLabel(_)));
        // Stopping while nothing is applied ends the thread at once; its failures end too.
        assert!(worker.stop(Duration::from_secs(10)).await);
    }

    #[tokio::test]
    async fn a_worker_whose_thread_died_says_so() {
        let mut worker = Worker::spawn(|_, _| panic!("a programmer error")).unwrap();
        worker.offer(message(1, &[]), "cp-1", 1);
        assert!(worker.failure().await.is_none());
    }

    #[test]
    fn a_damaged_state_file_is_replaced_by_the_control_plane_set() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        std::fs::write(state.assignments_path(), "garbage").unwrap();
        let mut follower = Follower::restore(state.clone(), "node-a").unwrap();
        assert_eq!(follower.current(), &AssignmentSet::default());
        assert!(!follower.is_known());
        // Moved aside as it was, for people to look at.
        let aside = directory.path().join("assignments.json.damaged");
        assert_eq!(std::fs::read_to_string(aside).unwrap(), "garbage");
        assert!(!state.assignments_path().exists());
        follower
            .on_message(&message(3, &[("a", 0)]), "cp-1")
            .unwrap();
        assert!(follower.is_known());
        assert_eq!(state.load().unwrap().tenants.len(), 1);
    }

    /// Issue 22: an agent restarted with a truncated `assignments.json` deleted every tenant's
    /// private directory (ledger, schedule links) before the control plane's set came.
    #[test]
    fn a_truncated_state_file_keeps_the_private_directories_until_the_control_plane_speaks() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(&directory.path().join("state"), "node-a").unwrap();
        let layout = Layout::new(&directory.path().join("shm"));
        let mut follower = Follower::restore(state.clone(), "node-a")
            .unwrap()
            .with_private(layout.clone());
        follower
            .on_message(&message(5, &[("stays", 0), ("leaves", 1)]), "cp-1")
            .unwrap();
        drop(follower);
        // The tenants' processes keep state in their directories (here: the ledger's place).
        for tenant in ["stays", "leaves"] {
            std::fs::write(layout.ledger(tenant), tenant).unwrap();
        }
        let text = std::fs::read(state.assignments_path()).unwrap();
        std::fs::write(state.assignments_path(), &text[..text.len() / 2]).unwrap();
        // And one tenant file is damaged too.
        std::fs::write(state.tenant_path("stays"), "{\"format\": 1, \"no").unwrap();

        let mut restarted = Follower::restore(state.clone(), "node-a")
            .unwrap()
            .with_private(layout.clone());
        assert!(!restarted.is_known());
        for tenant in ["stays", "leaves"] {
            assert_eq!(
                std::fs::read_to_string(layout.ledger(tenant)).unwrap(),
                tenant,
                "{tenant}'s directory is kept while the set is unknown"
            );
        }
        assert_eq!(
            state.load_tenant("stays").unwrap(),
            None,
            "damaged: removed"
        );

        // The control plane's set: `stays` keeps its directory and ledger, `leaves` goes.
        restarted
            .on_message(&message(6, &[("stays", 0)]), "cp-1")
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(layout.ledger("stays")).unwrap(),
            "stays"
        );
        assert!(!layout.tenant_dir("leaves").exists());
        assert_eq!(state.load().unwrap().revision, 6);
        assert_eq!(state.load_tenant("stays").unwrap().unwrap().revision, 6);
    }
}
