//! The closed-loop thread: every period, for each GPU of the node with a live latency tenant,
//! it reads the latency tenants' step histograms from the GPU's schedule file
//! (`<shm_dir>/gpus/<uuid>.compute`, [`crate::private::Layout::schedule`]), takes their
//! difference with the previous period's as windows, feeds them (with when the GPU's oldest
//! latency step still in flight began, so that a starving tenant is seen) to the GPU's
//! [`sharing::Controller`], and publishes the controller's decision in the file for the
//! neighbours' interposers (`tenant_abi::shm::ScheduleControl`). The latency tenants' statuses
//! are kept in [`ClosedLoopShared`] for the usage report.
//!
//! A thread, like [`crate::monitor`], not a task: a period is 10 ms and must not queue behind
//! the runtime's network work. [`spawn`] starts it, the [`ClosedLoopHandle`] stops it when
//! dropped (and waits at most [`JOIN_WAIT`]); [`ClosedLoop::tick`] is one period, for tests.
//!
//! **The period, 10 ms** ([`PERIOD_DEFAULT`]): inference steps take from about a millisecond
//! to tens of them, so a period holds a few steps, and the controller answers a violation
//! within a step or two. A decision is void after `tenant_abi::control::DECISION_TTL_NS`
//! (500 ms), 50 periods: a stalled agent frees the GPU quickly, and a busy node's late period
//! does not. One period reads about 130 words per latency tenant and writes two per GPU.
//!
//! On a node that runs MPS, the same period also runs each GPU's redistribution of SMs among
//! its best-effort tenants ([`crate::redistribution`]), with the latency tenants left out and
//! nothing measured while the closed loop's decision restricts.
//!
//! Which tenants are latency tenants, and their explicit targets, come from the agent's
//! assignments through [`ClosedLoopShared::set_tenants`]; whether the node runs MPS and each
//! GPU's SM count come from the [`ClosedLoopConfig`]. Everything is bounded (GPUs, tenants,
//! remembered errors, the join), each file's error is logged once until it goes away, and no
//! panic leaves the thread: a panicking period is logged, its state dropped (the decisions
//! expire: fail open), and the loop starts again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sharing::{Controller, Decision, Event, LatencySnapshot, TenantStatus, TenantWindow};
use tenant_abi::shm::ScheduleControl;

use crate::inventory::Inventory;

/// The control period (see the module's docs).
pub const PERIOD_DEFAULT: Duration = Duration::from_millis(10);
/// A tenant that is not a latency tenant counts as an active neighbour while its demand stamp
/// is this fresh. Its processes stamp every few hundred µs while they launch, and a paused
/// launch waits at most 50 ms, so a working neighbour is never missed; a neighbour that
/// stopped is seen gone after this long, which keeps the tail of its queued work out of the
/// latency tenant's windows alone (its baseline).
pub const NEIGHBOUR_WINDOW_DEFAULT: Duration = Duration::from_millis(250);
/// GPU schedule files followed (a node reports at most 64 GPUs).
pub const GPUS_MAX: usize = crate::inventory::MAX_GPUS_PER_NODE;
/// Latency tenants whose specs and statuses are kept.
pub const TENANTS_MAX: usize = 1024;
/// How long dropping the handle waits for the thread.
pub const JOIN_WAIT: Duration = Duration::from_secs(2);
/// How often the `gpus/` directory is listed again (files are mapped once and kept).
pub const RESCAN_NS: u64 = 1_000_000_000;
/// After a panicking period, the thread waits this long before the next.
const PANIC_PAUSE: Duration = Duration::from_secs(1);
/// Panics logged at error level; later ones at debug level.
const PANICS_LOGGED_MAX: u32 = 8;

/// A latency tenant as the agent's assignments describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySpec {
    /// An explicit step-latency target; `None`: learnt from the tenant's latency alone.
    pub target_ns: Option<u64>,
}

/// What the closed loop reads and how often.
#[derive(Debug, Clone, PartialEq)]
pub struct ClosedLoopConfig {
    /// The interposers' shared-memory directory (the agent's `shm_dir`).
    pub shm_dir: PathBuf,
    /// Whether the latency tenants and their neighbours are clients of one MPS daemon, so that
    /// the neighbours' SMs are a lever (`mps_tenants = "all"`); with latency tenants in contexts
    /// of their own, the GPU time-slices between them and the MPS server, and fewer SMs for the
    /// neighbours would only cost them.
    pub mps: bool,
    /// SMs per GPU uuid; a GPU missing here (or with 0) gets no SM lever.
    pub sm_counts: BTreeMap<String, u16>,
    /// The redistribution of each GPU's SMs among its best-effort tenants
    /// ([`crate::redistribution`]), on a node whose best-effort tenants are MPS clients; `None`
    /// (without MPS: the turns already give back what a tenant leaves unused): off.
    pub redistribute: Option<sharing::RedistributeConfig>,
    pub period: Duration,
    pub neighbour_window: Duration,
}

impl ClosedLoopConfig {
    /// The defaults for the GPUs of `inventory`; `node_mps`: the node runs MPS at all (its
    /// best-effort tenants are clients), which turns the redistribution on.
    pub fn new(
        shm_dir: PathBuf,
        mps: bool,
        node_mps: bool,
        inventory: &Inventory,
    ) -> ClosedLoopConfig {
        let sm_counts = inventory
            .gpus
            .iter()
            .map(|gpu| {
                let sms = u16::try_from(gpu.sm_count).unwrap_or(u16::MAX);
                (gpu.uuid.clone(), sms)
            })
            .collect();
        ClosedLoopConfig {
            shm_dir,
            mps,
            sm_counts,
            redistribute: node_mps.then(sharing::RedistributeConfig::default),
            period: PERIOD_DEFAULT,
            neighbour_window: NEIGHBOUR_WINDOW_DEFAULT,
        }
    }

    /// The controller's settings for GPU `uuid`.
    pub fn controller_config(&self, uuid: &str) -> sharing::Config {
        let sm_count = self.sm_counts.get(uuid).copied().unwrap_or(0);
        let mut config = sharing::Config::new(self.mps, sm_count);
        config.period_ns = duration_ns(self.period).max(1);
        config
    }
}

/// What the caller and the thread share: the latency tenants (in) and their statuses (out).
#[derive(Debug, Default)]
pub struct ClosedLoopShared {
    tenants: Mutex<BTreeMap<String, LatencySpec>>,
    statuses: Mutex<BTreeMap<String, TenantStatus>>,
    /// The redistribution's members (out), by tenant name.
    members: Mutex<BTreeMap<String, sharing::MemberStatus>>,
}

impl ClosedLoopShared {
    pub fn new() -> Arc<ClosedLoopShared> {
        Arc::new(ClosedLoopShared::default())
    }

    /// The latency tenants placed on the node, by name (the first [`TENANTS_MAX`] are kept).
    pub fn set_tenants(&self, mut tenants: BTreeMap<String, LatencySpec>) {
        if tenants.len() > TENANTS_MAX {
            tracing::warn!(
                "closed loop: {} latency tenants, only the first {TENANTS_MAX} are followed",
                tenants.len()
            );
            while tenants.len() > TENANTS_MAX {
                tenants.pop_last();
            }
        }
        *lock(&self.tenants) = tenants;
    }

    pub fn tenants(&self) -> BTreeMap<String, LatencySpec> {
        lock(&self.tenants).clone()
    }

    /// The best-effort tenants the redistribution follows now, by name, with the SM cap each
    /// keeps (in `sharing::redistribute::FULL`ths) and its progress rate. A tenant on several
    /// GPUs: the GPU where its cap is lowest.
    pub fn members(&self) -> BTreeMap<String, sharing::MemberStatus> {
        lock(&self.members).clone()
    }

    /// The latency tenants' newest statuses, by name. A tenant on several GPUs: its steps and
    /// violations summed, the rest from the GPU where its p99 is highest.
    pub fn statuses(&self) -> BTreeMap<String, TenantStatus> {
        lock(&self.statuses).clone()
    }
}

/// A poisoned lock only means a panic elsewhere; the maps are always whole.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Stops the thread when dropped.
pub struct ClosedLoopHandle {
    stop: Option<Sender<()>>,
    done: Option<Receiver<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ClosedLoopHandle {
    fn drop(&mut self) {
        drop(self.stop.take());
        let (Some(done), Some(thread)) = (self.done.take(), self.thread.take()) else {
            return;
        };
        match done.recv_timeout(JOIN_WAIT) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
            }
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "the closed-loop thread did not stop within {JOIN_WAIT:?}; left behind"
                );
            }
        }
    }
}

/// Starts the closed-loop thread. If the thread cannot start, that is logged and the handle
/// does nothing: no decision is published, so the GPUs stay unrestricted (fail open).
pub fn spawn(config: ClosedLoopConfig, shared: Arc<ClosedLoopShared>) -> ClosedLoopHandle {
    assert!(!config.period.is_zero(), "a closed-loop period");
    let (stop, stopped) = channel::<()>();
    let (done_sender, done) = channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("vgpu-closed-loop".into())
        .spawn(move || {
            run(config, &shared, &stopped);
            let _ = done_sender.send(());
        });
    match spawned {
        Ok(thread) => ClosedLoopHandle {
            stop: Some(stop),
            done: Some(done),
            thread: Some(thread),
        },
        Err(error) => {
            tracing::error!(
                "cannot start the closed-loop thread: {error}; GPUs are not shared by latency"
            );
            ClosedLoopHandle {
                stop: None,
                done: None,
                thread: None,
            }
        }
    }
}

fn run(config: ClosedLoopConfig, shared: &ClosedLoopShared, stopped: &Receiver<()>) {
    let mut state = ClosedLoop::new(config.clone());
    let mut panics = 0u32;
    loop {
        let started = Instant::now();
        let ticked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            state.tick(shared, monotonic_ns());
        }));
        let mut wait = config.period.saturating_sub(started.elapsed());
        if ticked.is_err() {
            panics = panics.saturating_add(1);
            if panics <= PANICS_LOGGED_MAX {
                tracing::error!("a closed-loop period panicked; starting again from scratch");
            } else {
                tracing::debug!("a closed-loop period panicked ({panics} so far)");
            }
            state = ClosedLoop::new(config.clone());
            wait = PANIC_PAUSE;
        }
        match stopped.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of the interposers' stamps and of the decision's
/// expiry (`std::time::Instant` reads the same clock but does not show its value).
#[allow(unsafe_code)]
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux, and
    // the call writes nothing else.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(result, 0, "CLOCK_MONOTONIC");
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
        .max(1)
}

fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// One GPU's schedule file, mapped, and its controller while it has a latency tenant.
struct GpuLoop {
    path: PathBuf,
    /// The file's inode when mapped (a file made anew is mapped anew).
    inode: u64,
    control: ScheduleControl,
    controller: Option<Controller>,
    /// Each latency tenant's last histogram, with its slot (a slot given to another tenant
    /// starts its histogram again).
    previous: BTreeMap<String, (usize, LatencySnapshot)>,
    /// Latency tenants still assigned whose slot did not read as live, since when (see
    /// [`TENANT_GONE_NS`]).
    missing_since_ns: BTreeMap<String, u64>,
    /// The squeezed side's counters at the last period (`ScheduleControl::squeezed_counters`),
    /// for the per-window trace.
    squeezed: (u64, u64),
    /// The GPU's redistribution among best-effort tenants, when the node runs it.
    redistribution: Option<crate::redistribution::GpuRedistribution>,
}

/// The target of the per-window trace: one line per GPU and control period with each latency
/// tenant's steps and window p50/p99, the level, and how long the neighbours waited
/// (`RUST_LOG=vgpu_agent::closed_loop::window=debug`; off by default: about 100 lines a second).
const WINDOW_TRACE: &str = "vgpu_agent::closed_loop::window";

/// How long a latency tenant that is still assigned may be missing from the GPU's live slots
/// before the controller forgets it (its baseline and target with it). A slot reads as not
/// live for an instant while a process of the GPU checks it in `Schedule::reclaim_tenants`;
/// forgetting the tenant then made it learn its target again at Exclusive, beside busy
/// neighbours (an H100 run: a decoder's target relearnt so, 1.7x too loose, for the rest of
/// the run). A tenant that leaves the assignments is forgotten at once.
pub const TENANT_GONE_NS: u64 = 100_000_000;

/// The closed loop's state: the GPUs' files and controllers. [`ClosedLoop::tick`] is one period.
pub struct ClosedLoop {
    config: ClosedLoopConfig,
    gpus: BTreeMap<String, GpuLoop>,
    last_scan_ns: Option<u64>,
    /// The last error logged per path, so that each is logged once until it changes or clears.
    logged: BTreeMap<PathBuf, String>,
}

impl ClosedLoop {
    pub fn new(config: ClosedLoopConfig) -> ClosedLoop {
        ClosedLoop {
            config,
            gpus: BTreeMap::new(),
            last_scan_ns: None,
            logged: BTreeMap::new(),
        }
    }

    /// One period at `now_ns` (CLOCK_MONOTONIC): for every GPU with a live latency tenant,
    /// windows in, decision out; returns the decisions published, by GPU uuid.
    pub fn tick(&mut self, shared: &ClosedLoopShared, now_ns: u64) -> BTreeMap<String, Decision> {
        assert!(now_ns > 0);
        let due = self
            .last_scan_ns
            .is_none_or(|last| now_ns.saturating_sub(last) >= RESCAN_NS);
        if due {
            self.scan();
            self.last_scan_ns = Some(now_ns);
        }
        let specs = shared.tenants();
        let neighbour_window_ns = duration_ns(self.config.neighbour_window);
        let mut published = BTreeMap::new();
        let mut statuses: BTreeMap<String, TenantStatus> = BTreeMap::new();
        let mut members: BTreeMap<String, sharing::MemberStatus> = BTreeMap::new();
        for (uuid, gpu) in &mut self.gpus {
            let decision = gpu.tick(&self.config, uuid, &specs, now_ns, neighbour_window_ns);
            if let Some((decision, gpu_statuses)) = decision {
                published.insert(uuid.clone(), decision);
                for status in gpu_statuses {
                    merge_status(&mut statuses, status);
                }
            }
            if let Some(config) = &self.config.redistribute {
                let restricted = gpu.control.decision(now_ns).restricts();
                gpu.redistribution
                    .get_or_insert_with(|| {
                        crate::redistribution::GpuRedistribution::new(config.clone())
                    })
                    .tick(
                        &gpu.control,
                        uuid,
                        |name| specs.contains_key(name),
                        restricted,
                        now_ns,
                    );
            }
            for member in gpu.redistribution.iter().flat_map(|r| r.status()) {
                let lower = members
                    .get(&member.name)
                    .is_none_or(|known| member.cap < known.cap);
                let room = members.contains_key(&member.name) || members.len() < TENANTS_MAX;
                if lower && room {
                    members.insert(member.name.clone(), member);
                }
            }
        }
        *lock(&shared.members) = members;
        statuses.retain(|name, _| specs.contains_key(name));
        debug_assert!(statuses.len() <= TENANTS_MAX);
        *lock(&shared.statuses) = statuses;
        debug_assert!(published.len() <= GPUS_MAX);
        published
    }

    /// Lists `gpus/`: maps new schedule files, drops vanished ones, remaps replaced ones.
    fn scan(&mut self) {
        let directory = self.config.shm_dir.join("gpus");
        let files = match list_schedules(&directory) {
            Ok(files) => {
                self.logged.remove(&directory);
                files
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(error) => {
                self.log_once(
                    &directory,
                    format!("cannot list {}: {error}", directory.display()),
                );
                return;
            }
        };
        self.gpus.retain(|uuid, gpu| {
            files
                .get(uuid)
                .is_some_and(|(_, inode)| *inode == gpu.inode)
        });
        self.logged
            .retain(|path, _| *path == directory || files.values().any(|(p, _)| p == path));
        for (uuid, (path, inode)) in files {
            if self.gpus.contains_key(&uuid) {
                continue;
            }
            if self.gpus.len() >= GPUS_MAX {
                self.log_once(&directory, format!("more than {GPUS_MAX} GPU schedules"));
                break;
            }
            match ScheduleControl::open(&path) {
                Ok(control) => {
                    self.logged.remove(&path);
                    let gpu = GpuLoop {
                        path,
                        inode,
                        control,
                        controller: None,
                        previous: BTreeMap::new(),
                        missing_since_ns: BTreeMap::new(),
                        squeezed: (0, 0),
                        redistribution: None,
                    };
                    self.gpus.insert(uuid, gpu);
                }
                Err(error) if error.is_not_found() => {}
                Err(error) => self.log_once(&path, error.to_string()),
            }
        }
    }

    fn log_once(&mut self, path: &Path, message: String) {
        if self.logged.get(path) == Some(&message) {
            return;
        }
        tracing::warn!("closed loop: {message}");
        if self.logged.len() < GPUS_MAX + 1 || self.logged.contains_key(path) {
            self.logged.insert(path.to_owned(), message);
        }
    }
}

/// The schedule files of `directory`, by GPU uuid, with their inodes (at most [`GPUS_MAX`];
/// temporaries of `tenant_abi::create_schedule` are skipped).
fn list_schedules(directory: &Path) -> std::io::Result<BTreeMap<String, (PathBuf, u64)>> {
    use std::os::unix::fs::MetadataExt;
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(directory)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(uuid) = name.to_str().and_then(|name| name.strip_suffix(".compute")) else {
            continue;
        };
        if uuid.is_empty() || files.len() >= GPUS_MAX {
            continue;
        }
        let Ok(metadata) = entry.metadata() else {
            continue;
        };
        files.insert(uuid.to_owned(), (entry.path(), metadata.ino()));
    }
    Ok(files)
}

impl GpuLoop {
    /// One period of this GPU; `None` when it has no live latency tenant (nothing published
    /// then, unless a restriction of an earlier period is withdrawn).
    fn tick(
        &mut self,
        config: &ClosedLoopConfig,
        uuid: &str,
        specs: &BTreeMap<String, LatencySpec>,
        now_ns: u64,
        neighbour_window_ns: u64,
    ) -> Option<(Decision, Vec<TenantStatus>)> {
        let live: Vec<(usize, String, LatencySnapshot)> = self
            .control
            .latency_tenants()
            .into_iter()
            .filter(|(_, name, _)| specs.contains_key(name))
            .collect();
        let missing: Vec<String> = self
            .previous
            .keys()
            .filter(|name| specs.contains_key(*name) && !live.iter().any(|(_, n, _)| n == *name))
            .cloned()
            .collect();
        self.missing_since_ns
            .retain(|name, _| missing.contains(name));
        for name in missing {
            self.missing_since_ns.entry(name).or_insert(now_ns);
        }
        let forgotten = |since: &u64| now_ns.saturating_sub(*since) >= TENANT_GONE_NS;
        if live.is_empty() {
            if self.controller.is_some() && !self.missing_since_ns.values().all(forgotten) {
                // Only missing for an instant, most likely: the decision in force stays.
                return None;
            }
            self.missing_since_ns.clear();
            if let Some(controller) = self.controller.take()
                && controller.decision().restricts()
            {
                self.control.publish(Decision::default(), now_ns);
                tracing::info!("closed loop on GPU {uuid}: no latency tenant left; unrestricted");
            }
            self.previous.clear();
            return None;
        }
        let controller = self
            .controller
            .get_or_insert_with(|| Controller::new(config.controller_config(uuid)));
        let live_slots: BTreeMap<String, usize> = live
            .iter()
            .map(|(slot, name, _)| (name.clone(), *slot))
            .collect();
        let mut windows = Vec::with_capacity(live.len());
        for (slot, name, snapshot) in live {
            let window = match self.previous.get(&name) {
                Some((previous_slot, previous)) if *previous_slot == slot => {
                    snapshot.since(previous)
                }
                // First seen, or in another slot: this period's steps are unknown.
                _ => LatencySnapshot::default(),
            };
            let target_ns = specs.get(&name).and_then(|spec| spec.target_ns);
            self.previous.insert(name.clone(), (slot, snapshot));
            windows.push(TenantWindow {
                name,
                window,
                target_ns,
            });
        }
        let gone: Vec<String> = self
            .previous
            .keys()
            .filter(|name| !windows.iter().any(|window| &window.name == *name))
            .filter(|name| self.missing_since_ns.get(*name).is_none_or(forgotten))
            .cloned()
            .collect();
        for name in gone {
            self.previous.remove(&name);
            self.missing_since_ns.remove(&name);
            controller.handle(Event::TenantGone { name });
        }
        let neighbours_active =
            self.control
                .neighbours_active(now_ns, neighbour_window_ns, |name| specs.contains_key(name));
        // A step opened after `now_ns` (the clocks of this thread and the tenants' race) is
        // not open yet for this period.
        let open_step_since_ns = self
            .control
            .open_step_since(now_ns)
            .filter(|&since| since <= now_ns);
        let trace = tracing::enabled!(target: WINDOW_TRACE, tracing::Level::DEBUG)
            .then(|| trace_windows(&windows));
        let output = controller.handle(Event::Window {
            now_ns,
            tenants: windows,
            neighbours_active,
            open_step_since_ns,
        });
        self.control.publish(output.decision, now_ns);
        // Each tenant's target in force, for its processes' exact counts of the steps over it.
        for status in &output.tenants {
            if let Some(&slot) = live_slots.get(&status.name) {
                self.control
                    .publish_target(slot, status.target_ns.unwrap_or(0));
            }
        }
        if let Some(windows) = trace {
            let squeezed = self.control.squeezed_counters();
            let tenants = format!(
                "{windows}{} controller {}",
                trace_statuses(&output.tenants),
                controller.trace_summary()
            );
            tracing::debug!(
                target: WINDOW_TRACE,
                "{uuid} level {} neighbours {} open {:?} paused {:.1} ms bounded {}:{tenants}",
                output.decision.level,
                neighbours_active,
                open_step_since_ns.map(|since| now_ns.saturating_sub(since) / 1_000),
                squeezed.0.saturating_sub(self.squeezed.0) as f64 / 1e6,
                squeezed.1.saturating_sub(self.squeezed.1),
            );
            self.squeezed = squeezed;
        }
        if let Some(change) = &output.change {
            tracing::info!(
                "closed loop on GPU {uuid}: level {} -> {} ({:?}): {:?}",
                change.from.level,
                change.to.level,
                change.to,
                change.reason
            );
        }
        debug_assert!(self.previous.len() <= tenant_abi::compute::TENANTS);
        debug_assert_eq!(self.control.path(), self.path);
        Some((output.decision, output.tenants))
    }
}

/// The per-window trace's part on each latency tenant's window: its steps, p50 and p99.
fn trace_windows(windows: &[TenantWindow]) -> String {
    let ms =
        |window: &LatencySnapshot, q: f64| window.quantile_ns(q).map_or(0.0, |ns| ns as f64 / 1e6);
    windows
        .iter()
        .map(|tenant| {
            format!(
                " {}: {} steps p50 {:.3} p99 {:.3} ms;",
                tenant.name,
                tenant.window.steps,
                ms(&tenant.window, 0.5),
                ms(&tenant.window, 0.99)
            )
        })
        .collect()
}

/// The per-window trace's part on each latency tenant's target and violations so far.
fn trace_statuses(statuses: &[TenantStatus]) -> String {
    statuses
        .iter()
        .map(|status| {
            format!(
                " {} target {:.3} violations {};",
                status.name,
                status.target_ns.map_or(0.0, |ns| ns as f64 / 1e6),
                status.violations
            )
        })
        .collect()
}

/// Adds one GPU's status of a tenant to the node's.
fn merge_status(statuses: &mut BTreeMap<String, TenantStatus>, status: TenantStatus) {
    if statuses.len() >= TENANTS_MAX && !statuses.contains_key(&status.name) {
        return;
    }
    match statuses.get_mut(&status.name) {
        None => {
            statuses.insert(status.name.clone(), status);
        }
        Some(known) => {
            let (steps, violations) = (
                known.steps + status.steps,
                known.violations + status.violations,
            );
            if status.p99_ns > known.p99_ns {
                *known = status;
            }
            known.steps = steps;
            known.violations = violations;
        }
    }
}

#[cfg(test)]
#[path = "closed_loop_test.rs"]
mod tests;
