//! The monitor thread: samples GPU health ([`crate::health`]) and tenant usage
//! ([`crate::usage`]) once per interval and keeps the latest [`Report`], which the heartbeat loop
//! copies into each beat. NVML calls and file reads therefore never delay a heartbeat; a beat
//! carries the report of at most one interval ago.
//!
//! The thread ends within one interval after the [`Monitor`] is dropped. Nothing is queued: the
//! newest report replaces the previous one.
//!
//! Latency tenants' step latencies come from a [`LatencySource`] (the node's closed-loop
//! controller), set with [`Monitor::set_latency_source`]; until one is set, usage entries carry
//! only the targets the tenants asked for. The SM redistribution's members (an MPS node's
//! best-effort tenants) come from a [`RedistributionSource`], set with
//! [`Monitor::set_redistribution_source`]; until one is set, entries carry none.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::v1::{GpuHealth, TenantUsage};

use crate::health::{HealthSource, SimulatedHealth};
use crate::inventory::{Inventory, InventorySource};
use crate::state::read_assignments_file;
use crate::usage::{LatencySource, RedistributionSource, TenantSources};

/// The newest sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub gpus: Vec<GpuHealth>,
    pub usage: Vec<TenantUsage>,
}

/// What the monitor reads.
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    pub node: String,
    /// The interposers' shared-memory directory.
    pub shm_dir: PathBuf,
    /// The agent's state directory (assignments; simulated health overrides).
    pub state_dir: PathBuf,
    pub interval: Duration,
}

/// The handle of the monitor thread.
pub struct Monitor {
    latest: Arc<Mutex<Report>>,
    /// What the thread asks for latency tenants' and redistributed tenants' numbers at each
    /// sample.
    tenant_sources: Arc<Mutex<TenantSources>>,
    /// Dropping it stops the thread.
    _stop: Sender<()>,
}

pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Monitor {
    /// Starts sampling `inventory`'s GPUs (through NVML for [`InventorySource::Nvml`], simulated
    /// otherwise). The first report is taken before this returns, so the first heartbeat
    /// already carries one.
    pub fn start(
        config: MonitorConfig,
        inventory: &Inventory,
        source: &InventorySource,
    ) -> std::io::Result<Monitor> {
        assert!(!config.interval.is_zero(), "a monitor interval");
        let latest = Arc::new(Mutex::new(Report::default()));
        let tenant_sources = Arc::new(Mutex::new(TenantSources::default()));
        let (stop, stopped) = channel();
        let (first_done, first) = channel();
        let shared = latest.clone();
        let tenant_sources_shared = tenant_sources.clone();
        let inventory = inventory.clone();
        let nvml = matches!(source, InventorySource::Nvml);
        std::thread::Builder::new()
            .name("vgpu-monitor".into())
            .spawn(move || {
                let mut health: Box<dyn HealthSource> = if nvml {
                    match crate::health::nvml::NvmlHealth::open(&inventory) {
                        Ok(source) => Box::new(source),
                        Err(error) => {
                            tracing::warn!(
                                "GPU health is not reported: {error}; heartbeats carry usage only"
                            );
                            Box::new(NoHealth)
                        }
                    }
                } else {
                    Box::new(SimulatedHealth::new(&inventory, &config.state_dir))
                };
                let mut reserves = BoardReserves::new(
                    &config.shm_dir,
                    inventory
                        .gpus
                        .iter()
                        .map(|gpu| (gpu.uuid.clone(), gpu.memory_bytes))
                        .collect(),
                );
                let sources = Sources {
                    health: health.as_mut(),
                    tenant_sources: &tenant_sources_shared,
                    reserves: &mut reserves,
                };
                run(&config, sources, &shared, &stopped, first_done);
            })?;
        // Bounded: the first sample reads a few files and asks NVML a few questions.
        let _ = first.recv_timeout(Duration::from_secs(10));
        Ok(Monitor {
            latest,
            tenant_sources,
            _stop: stop,
        })
    }

    /// Takes latency tenants' numbers from `source` from the next sample on (the node's
    /// closed-loop controller: `LatencySource::new(move |tenant| ...)`).
    pub fn set_latency_source(&self, source: LatencySource) {
        self.tenant_sources
            .lock()
            .expect("monitor tenant sources lock")
            .latency = source;
    }

    /// Takes the SM redistribution's members from `source` from the next sample on (the node's
    /// closed-loop thread: `RedistributionSource::new(move |tenant| ...)`).
    pub fn set_redistribution_source(&self, source: RedistributionSource) {
        self.tenant_sources
            .lock()
            .expect("monitor tenant sources lock")
            .redistribution = source;
    }

    /// The newest report.
    pub fn latest(&self) -> Report {
        self.latest.lock().expect("monitor lock").clone()
    }
}

/// A node whose NVML could not be opened for health.
struct NoHealth;

impl HealthSource for NoHealth {
    fn sample(&mut self) -> Vec<GpuHealth> {
        Vec::new()
    }
}

/// What the monitor thread samples besides the files.
struct Sources<'a> {
    health: &'a mut dyn HealthSource,
    tenant_sources: &'a Mutex<TenantSources>,
    reserves: &'a mut BoardReserves,
}

/// The GPUs' memory boards' measured reserves (`crate::reserve`): around each health sample, the
/// boards' resident totals are read before and after NVML's used memory, and each board's
/// capacity follows the GPU's memory less its reserve.
pub struct BoardReserves {
    layout: crate::private::Layout,
    /// uuid -> the GPU's memory in bytes.
    memory: std::collections::BTreeMap<String, u64>,
    trackers: std::collections::BTreeMap<String, crate::reserve::Tracker>,
    /// Boards whose read or write failed, said once each.
    said: std::collections::BTreeSet<String>,
}

impl BoardReserves {
    pub fn new(shm_dir: &std::path::Path, memory: std::collections::BTreeMap<String, u64>) -> Self {
        BoardReserves {
            layout: crate::private::Layout::new(shm_dir),
            memory,
            trackers: Default::default(),
            said: Default::default(),
        }
    }

    /// Each existing board's resident total now (uuid -> bytes); GPUs without a board (no
    /// elastic memory on them yet) are left out.
    pub fn resident(&self) -> std::collections::BTreeMap<String, u64> {
        self.memory
            .keys()
            .filter_map(|uuid| {
                let (_, resident) = tenant_abi::shm::board_counts(&self.layout.board(uuid)).ok()?;
                Some((uuid.clone(), resident))
            })
            .collect()
    }

    /// After a health sample (`gpus`) taken between `before` and now's reads of the boards:
    /// updates each GPU's reserve and writes its board's capacity when it moved by a step.
    pub fn apply(
        &mut self,
        gpus: &[GpuHealth],
        before: &std::collections::BTreeMap<String, u64>,
        now_ns: u64,
    ) {
        for gpu in gpus {
            let (Some(used), Some(&memory), Some(&resident_before)) = (
                gpu.memory_used_bytes,
                self.memory.get(&gpu.uuid),
                before.get(&gpu.uuid),
            ) else {
                continue;
            };
            let path = self.layout.board(&gpu.uuid);
            let (current, resident_after) = match tenant_abi::shm::board_counts(&path) {
                Ok(counts) => counts,
                Err(error) => {
                    self.say_once(&gpu.uuid, format!("{error}"));
                    continue;
                }
            };
            let tracker = self.trackers.entry(gpu.uuid.clone()).or_default();
            let reserve = tracker.observe(now_ns, used, resident_before, resident_after);
            let resident = resident_before.max(resident_after);
            tracing::debug!(
                gpu = %gpu.uuid,
                used_bytes = used,
                resident_bytes = resident,
                reserve_bytes = reserve,
                capacity_bytes = current,
                "memory board reserve sample"
            );
            // A board not written yet (capacity 0) is the follower's to fill first.
            if current == 0 {
                continue;
            }
            let Some(capacity) = crate::reserve::capacity_change(memory, reserve, current) else {
                continue;
            };
            match tenant_abi::shm::set_board_capacity(&path, capacity) {
                Ok(()) => tracing::info!(
                    gpu = %gpu.uuid,
                    outside_bytes = used.saturating_sub(resident),
                    reserve_bytes = reserve,
                    capacity_bytes = capacity,
                    "the GPU's memory board now lends up to its memory less {} GiB kept back: \
                     memory used outside the board's accounting (contexts, libraries, other \
                     processes) that lasted {} s, plus headroom",
                    reserve >> 30,
                    crate::reserve::SETTLE_NS / 1_000_000_000
                ),
                Err(error) => self.say_once(&gpu.uuid, format!("{error}")),
            }
        }
    }

    fn say_once(&mut self, uuid: &str, message: String) {
        if self.said.insert(uuid.to_owned()) {
            tracing::warn!("the memory board of GPU {uuid}: {message}; its reserve stays as it is");
        } else {
            tracing::debug!("the memory board of GPU {uuid}: {message}");
        }
    }
}

fn run(
    config: &MonitorConfig,
    sources: Sources<'_>,
    latest: &Mutex<Report>,
    stopped: &Receiver<()>,
    first_done: Sender<()>,
) {
    let mut first_done = Some(first_done);
    let mut logged_problems = std::collections::BTreeSet::new();
    loop {
        // Cloned out, so that a slow lookup never holds the lock `set_latency_source` and
        // `set_redistribution_source` take.
        let tenant_sources = sources
            .tenant_sources
            .lock()
            .expect("monitor tenant sources lock")
            .clone();
        let before = sources.reserves.resident();
        let report = sample(
            config,
            sources.health,
            &tenant_sources,
            &mut logged_problems,
        );
        sources
            .reserves
            .apply(&report.gpus, &before, crate::closed_loop::monotonic_ns());
        *latest.lock().expect("monitor lock") = report;
        if let Some(done) = first_done.take() {
            let _ = done.send(());
        }
        match stopped.recv_timeout(config.interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Problem lines remembered so that each is logged once (bounded: past this many, new ones are
/// logged at debug level only).
const LOGGED_PROBLEMS_MAX: usize = 256;

/// One report: health from `health`, usage from the files of the assigned tenants, latency
/// tenants' step latencies and the SM redistribution's members from `tenant_sources`.
pub fn sample(
    config: &MonitorConfig,
    health: &mut dyn HealthSource,
    tenant_sources: &TenantSources,
    logged_problems: &mut std::collections::BTreeSet<String>,
) -> Report {
    let mut gpus = health.sample();
    let assignments = match read_assignments_file(&config.state_dir) {
        Ok(Some(file)) => file.assignments,
        Ok(None) => Vec::new(),
        Err(error) => {
            tracing::debug!("no usage this time: {error}");
            Vec::new()
        }
    };
    let (files, problems) = crate::usage::read_files(&config.shm_dir, &assignments);
    for problem in problems {
        if logged_problems.len() < LOGGED_PROBLEMS_MAX && logged_problems.insert(problem.clone()) {
            tracing::warn!("usage: {problem}");
        } else {
            tracing::debug!("usage: {problem}");
        }
    }
    let owners = crate::usage::tenants_by_pid(&files);
    for gpu in &mut gpus {
        for process in &mut gpu.processes {
            if let Some(tenant) = owners.get(&process.pid) {
                process.tenant = tenant.clone();
            }
        }
    }
    let usage = crate::usage::combine(
        &config.node,
        &assignments,
        &files,
        &|tenant| tenant_sources.latency.get(tenant),
        &|tenant| tenant_sources.redistribution.get(tenant),
    );
    let mut report = Report { gpus, usage };
    let mut request = api::v1::HeartbeatRequest {
        node: config.node.clone(),
        gpus: std::mem::take(&mut report.gpus),
        usage: std::mem::take(&mut report.usage),
        ..api::v1::HeartbeatRequest::default()
    };
    let trimmed = api::usage::bound_heartbeat(&mut request);
    if trimmed.any() {
        tracing::debug!("the report was trimmed to its bounds: {trimmed:?}");
    }
    report.gpus = request.gpus;
    report.usage = request.usage;
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::StateDir;

    #[test]
    fn a_report_names_the_owners_of_processes_and_covers_assigned_tenants() {
        struct OneGpu;
        impl HealthSource for OneGpu {
            fn sample(&mut self) -> Vec<GpuHealth> {
                let mut gpu = api::usage::empty_health("GPU-0", 0);
                gpu.processes = vec![
                    api::v1::ProcessUsage {
                        pid: std::process::id(),
                        memory_bytes: 5,
                        tenant: String::new(),
                    },
                    api::v1::ProcessUsage {
                        pid: 1,
                        memory_bytes: 7,
                        tenant: String::new(),
                    },
                ];
                vec![gpu]
            }
        }
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(&directory.path().join("state"), "node-a").unwrap();
        let message = api::v1::Assignments {
            revision: 3,
            node_state: api::v1::NodeState::Ready as i32,
            assignments: vec![api::v1::Assignment {
                tenant: "train".into(),
                priority: 0,
                bandwidth_weight: 0,
                latency: true,
                latency_target_us: 2_000,
                slices: vec![api::v1::Slice {
                    node: "node-a".into(),
                    gpu: "GPU-0".into(),
                    gpu_index: 0,
                    compute_percent: 50,
                    memory_bytes: 8 << 30,
                    guaranteed: true,
                    burst: false,
                    memory_limit_bytes: 0,
                }],
            }],
        };
        let mut follower = crate::follower::Follower::restore(state, "node-a").unwrap();
        follower.on_message(&message, "cp").unwrap();
        let shm_dir = directory.path().join("shm");
        let ledger = tenant_abi::writer::ledger(
            &crate::private::Layout::new(&shm_dir).ledger("train"),
            &[None; tenant_abi::DEVICES_MAX],
        )
        .unwrap();
        let start_time = tenant_abi::ledger::own_start_time();
        tenant_abi::writer::charge_memory(&ledger, std::process::id(), start_time, 0, 1 << 30)
            .unwrap();
        let config = MonitorConfig {
            node: "node-a".into(),
            shm_dir,
            state_dir: directory.path().join("state"),
            interval: Duration::from_millis(50),
        };
        let report = sample(
            &config,
            &mut OneGpu,
            &TenantSources::default(),
            &mut Default::default(),
        );
        assert_eq!(report.usage.len(), 1);
        assert_eq!(report.usage[0].memory_used_bytes, 1 << 30);
        // No controller: the target the tenant asked for, nothing measured.
        assert_eq!(report.usage[0].latency_target_us, 2_000);
        assert_eq!(report.usage[0].latency_steps, 0);
        assert_eq!(report.usage[0].sm_cap_permille, 0);
        let controller = LatencySource::new(|tenant| {
            (tenant == "train").then(|| {
                crate::usage::LatencyReport::from_ns(
                    Some(2_000_000),
                    Some(1_000_000),
                    Some(700_000),
                    Some(1_900_000),
                    40,
                    1,
                )
            })
        });
        // The monitor reports what the sources say (a latency tenant is never a redistribution's
        // member on a real node; here it only carries the numbers through).
        let redistribution = RedistributionSource::new(|tenant| {
            (tenant == "train").then_some(crate::usage::RedistributionReport {
                sm_cap_permille: 625,
                progress_per_s: 12.5,
                hinted: true,
                alone_per_s: 40.0,
                side_by_side: true,
            })
        });
        let sources = TenantSources {
            latency: controller,
            redistribution,
        };
        let report = sample(&config, &mut OneGpu, &sources, &mut Default::default());
        let usage = &report.usage[0];
        assert_eq!(
            (
                usage.sm_cap_permille,
                usage.progress_per_s,
                usage.progress_hinted,
                usage.progress_alone_per_s,
                usage.redistribution_side_by_side
            ),
            (625, 12.5, true, 40.0, true)
        );
        assert_eq!(
            (
                usage.latency_p99_us,
                usage.latency_steps,
                usage.latency_violations
            ),
            (1_900, 40, 1)
        );
        // No limit in the ledger: 0, as the interposer enforces none.
        assert_eq!(report.usage[0].memory_limit_bytes, 0);
        let owners: Vec<(u32, &str)> = report.gpus[0]
            .processes
            .iter()
            .map(|p| (p.pid, p.tenant.as_str()))
            .collect();
        assert_eq!(owners, [(1, ""), (std::process::id(), "train")]);
    }

    #[test]
    fn a_started_monitor_has_a_report_at_once_and_stops_when_dropped() {
        let directory = tempfile::tempdir().unwrap();
        let source = InventorySource::from_simulate_arg("2xA100-40GB").unwrap();
        let inventory = source.discover("node-b").unwrap();
        let config = MonitorConfig {
            node: "node-b".into(),
            shm_dir: directory.path().join("shm"),
            state_dir: directory.path().to_owned(),
            interval: Duration::from_millis(20),
        };
        let monitor = Monitor::start(config, &inventory, &source).unwrap();
        let report = monitor.latest();
        assert_eq!(report.gpus.len(), 2);
        assert!(report.usage.is_empty(), "no assignments yet");
        monitor.set_latency_source(LatencySource::new(|_| None));
        monitor.set_redistribution_source(RedistributionSource::new(|_| None));
        drop(monitor);
    }
}
