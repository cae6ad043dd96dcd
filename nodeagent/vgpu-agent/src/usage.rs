//! Per-tenant usage on this node, read from the interposer's shared files under the
//! shared-memory directory (`shm_dir`; paths from [`crate::private::Layout`]):
//!
//! * `tenants/<tenant>/<tenant>.mem`, the tenant's memory ledger (in the tenant's private
//!   directory, its `VGPU_SHM_DIR`): bytes charged per process slot and per device
//!   *ordinal as the tenant's processes see it*, which is the slice's position in the tenant's
//!   slices sorted by GPU index (`CUDA_VISIBLE_DEVICES` order, see [`crate::tenant`]);
//! * `gpus/<gpu uuid>.compute`, the GPU's compute schedule (linked into its tenants'
//!   directories): turn time charged to each tenant;
//! * `gpus/<gpu uuid>.memory`, the GPU's memory board (elastic memory, issue 17, where the agent
//!   keeps one): each tenant's request and limit, and what its processes hold resident, borrowed
//!   above the request, and swapped out. Sampling a board also reclaims the slots of processes
//!   that died ([`tenant_abi::shm::sample_board`]), the one write this module makes.
//!
//! Both are read through `tenant_abi::shm` (the interposer's own layout code, mapped read-only, atomic
//! loads only), so a tenant process is never made to wait and nothing is written. Only tenants
//! assigned to this node are reported, one entry per slice, zeros included; files of tenants
//! that left are ignored. [`combine`] is pure; [`read_files`] does the reading.
//!
//! A latency tenant's step latency (target, baseline, p50, p99, steps, violations) comes from
//! the node's closed-loop controller through a [`LatencySource`]; it goes on the tenant's first
//! entry (lowest GPU index), since the controller measures per tenant, not per GPU. Without a
//! source (or before the controller knows the tenant) the entry carries the target the tenant
//! asked for, if any, and zeros.
//!
//! Likewise a best-effort tenant that an MPS node's SM redistribution follows (the closed-loop
//! thread's `sharing::Redistributor`s, issue 15 point 4) gets the cap it keeps and its progress
//! rate on its first entry, from a [`RedistributionSource`]; other tenants' entries carry zeros.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use api::v1::{ProcessUsage, TenantUsage};
use tenant_abi::{DEVICES_MAX, LedgerUsage, TenantTime};

use crate::assignments::TenantAssignment;

/// One latency tenant's numbers from the node's closed-loop controller, in microseconds: the
/// target in force (asked for, or derived from the baseline), its p99 alone, and the p50 and
/// p99 of its recent steps; with the steps seen and those slower than the target (cumulative).
/// 0 for what is not known yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyReport {
    pub target_us: u64,
    pub baseline_us: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub steps: u64,
    pub violations: u64,
}

impl LatencyReport {
    /// From the controller's nanoseconds (`None`: not known yet); rounded up to whole
    /// microseconds, so a measured latency never shows as 0.
    pub fn from_ns(
        target_ns: Option<u64>,
        baseline_ns: Option<u64>,
        p50_ns: Option<u64>,
        p99_ns: Option<u64>,
        steps: u64,
        violations: u64,
    ) -> LatencyReport {
        let microseconds = |ns: Option<u64>| ns.map_or(0, |ns| ns.div_ceil(1_000));
        LatencyReport {
            target_us: microseconds(target_ns),
            baseline_us: microseconds(baseline_ns),
            p50_us: microseconds(p50_ns),
            p99_us: microseconds(p99_ns),
            steps,
            violations: violations.min(steps),
        }
    }
}

/// A tenant the node's SM redistribution follows now (`sharing::MemberStatus`, as the usage
/// report carries it): the SM cap it keeps in thousandths of the GPU's SMs
/// ([`api::usage::SM_CAP_PERMILLE_FULL`]: uncapped; never 0, which means "not followed" on the
/// wire), its progress per second in the last period at the kept caps (0: not measured yet),
/// whether that rate is in the application's own units (`vgpu_progress`) rather than steps, and
/// its rate alone from its last probe (0: not probed yet).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RedistributionReport {
    pub sm_cap_permille: u32,
    pub progress_per_s: f64,
    pub hinted: bool,
    pub alone_per_s: f64,
    /// Its group shares the GPU side by side (no turns between its members).
    pub side_by_side: bool,
}

impl RedistributionReport {
    /// From the redistribution's member status: the cap (in `sharing::redistribute::FULL`ths)
    /// rounded to the nearest thousandth (at least 1); a rate that is unknown, not finite or
    /// negative as 0.
    pub fn from_member(member: &sharing::MemberStatus) -> RedistributionReport {
        let full = u32::from(sharing::redistribute::FULL);
        debug_assert!(u32::from(member.cap) <= full, "a cap is at most the GPU");
        let cap = u32::from(member.cap).min(full);
        let sm_cap_permille = ((cap * api::usage::SM_CAP_PERMILLE_FULL + full / 2) / full).max(1);
        let known = |rate: Option<f64>| {
            rate.filter(|rate| rate.is_finite() && *rate >= 0.0)
                .unwrap_or(0.0)
        };
        let (progress_per_s, alone_per_s) = (known(member.rate), known(member.alone));
        assert!((1..=api::usage::SM_CAP_PERMILLE_FULL).contains(&sm_cap_permille));
        assert!(progress_per_s.is_finite() && progress_per_s >= 0.0);
        RedistributionReport {
            sm_cap_permille,
            progress_per_s,
            hinted: member.hinted,
            alone_per_s,
            side_by_side: member.side_by_side,
        }
    }
}

/// A lookup of per-tenant numbers by tenant name.
pub type Lookup<T> = dyn Fn(&str) -> Option<T> + Send + Sync;

/// Where per-tenant numbers that another thread of the agent keeps come from: a lookup by tenant
/// name, shared with the monitor thread. [`TenantSource::none`] knows no tenant (the default).
pub struct TenantSource<T>(Arc<Lookup<T>>);

/// Latency tenants' numbers (the closed loop's controllers).
pub type LatencySource = TenantSource<LatencyReport>;

/// The SM redistribution's members (the closed loop's redistributors, on MPS nodes).
pub type RedistributionSource = TenantSource<RedistributionReport>;

impl<T> TenantSource<T> {
    pub fn new(lookup: impl Fn(&str) -> Option<T> + Send + Sync + 'static) -> Self {
        TenantSource(Arc::new(lookup))
    }

    pub fn none() -> Self {
        TenantSource::new(|_| None)
    }

    /// The numbers of `tenant`, if the source has them.
    pub fn get(&self, tenant: &str) -> Option<T> {
        (self.0)(tenant)
    }
}

impl<T> Clone for TenantSource<T> {
    fn clone(&self) -> Self {
        TenantSource(self.0.clone())
    }
}

impl<T> Default for TenantSource<T> {
    fn default() -> Self {
        TenantSource::none()
    }
}

impl<T> std::fmt::Debug for TenantSource<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "TenantSource<{}>", std::any::type_name::<T>())
    }
}

/// Every source the usage report takes per-tenant numbers from, as the monitor thread holds them.
#[derive(Debug, Clone, Default)]
pub struct TenantSources {
    pub latency: LatencySource,
    pub redistribution: RedistributionSource,
}

/// What the files said, keyed for [`combine`].
#[derive(Debug, Default)]
pub struct Files {
    /// Tenant name → its ledger (absent: no process of the tenant ran yet).
    pub ledgers: BTreeMap<String, LedgerUsage>,
    /// GPU uuid → its schedule's tenants (absent: no gated launch on the GPU yet).
    pub schedules: BTreeMap<String, Vec<TenantTime>>,
    /// GPU uuid → its memory board's tenants (absent: the agent keeps no board for the GPU).
    pub boards: BTreeMap<String, Vec<tenant_abi::board::TenantUsage>>,
    /// When the boards were sampled (CLOCK_MONOTONIC ns, the clock of their wait stamps).
    pub sampled_ns: u64,
}

/// Reads the files of `assignments`' tenants and GPUs under `shm_dir`. A file that is missing
/// means "nothing used yet"; any other problem is returned as a line for the log, and that
/// file's numbers are left out.
pub fn read_files(shm_dir: &Path, assignments: &[TenantAssignment]) -> (Files, Vec<String>) {
    let mut files = Files {
        sampled_ns: crate::closed_loop::monotonic_ns(),
        ..Files::default()
    };
    let mut problems = Vec::new();
    let layout = crate::private::Layout::new(shm_dir);
    for assignment in assignments {
        let path = layout.ledger(&assignment.tenant);
        match tenant_abi::read_ledger(&path) {
            Ok(ledger) => {
                files.ledgers.insert(assignment.tenant.clone(), ledger);
            }
            Err(error) if error.is_not_found() => {}
            Err(error) => problems.push(format!("tenant {}: {error}", assignment.tenant)),
        }
        for slice in &assignment.slices {
            if !files.boards.contains_key(&slice.gpu_uuid) {
                match tenant_abi::shm::sample_board(&layout.board(&slice.gpu_uuid)) {
                    Ok((tenants, _reclaimed)) => {
                        files.boards.insert(slice.gpu_uuid.clone(), tenants);
                        // The shared staging's slabs of processes whose slots the sample just
                        // reclaimed (their board staging is zeroed with the slot).
                        let staging = layout.staging(&slice.gpu_uuid);
                        match tenant_abi::shm::reclaim_staging(
                            &staging,
                            &layout.board(&slice.gpu_uuid),
                        ) {
                            Ok(_) => {}
                            Err(error) if error.is_not_found() => {}
                            Err(error) => problems.push(format!("GPU {}: {error}", slice.gpu_uuid)),
                        }
                    }
                    Err(error) if error.is_not_found() => {}
                    Err(error) => problems.push(format!("GPU {}: {error}", slice.gpu_uuid)),
                }
            }
            if files.schedules.contains_key(&slice.gpu_uuid) {
                continue;
            }
            let path = layout.schedule(&slice.gpu_uuid);
            match tenant_abi::read_schedule(&path) {
                Ok(times) => {
                    files.schedules.insert(slice.gpu_uuid.clone(), times);
                }
                Err(error) if error.is_not_found() => {}
                Err(error) => problems.push(format!("GPU {}: {error}", slice.gpu_uuid)),
            }
        }
    }
    (files, problems)
}

/// One usage entry per slice of every assigned tenant, in tenant order then slice order; the
/// latency numbers of `latency` and the SM redistribution's numbers of `redistribution` on each
/// tenant's first entry (see the module docs).
pub fn combine(
    node: &str,
    assignments: &[TenantAssignment],
    files: &Files,
    latency: &dyn Fn(&str) -> Option<LatencyReport>,
    redistribution: &dyn Fn(&str) -> Option<RedistributionReport>,
) -> Vec<TenantUsage> {
    let mut entries = Vec::new();
    for assignment in assignments {
        let mut slices = assignment.slices.clone();
        slices.sort();
        let ledger = files.ledgers.get(&assignment.tenant);
        let first_entry = entries.len();
        for (ordinal, slice) in slices.iter().enumerate() {
            let tracked = ordinal < DEVICES_MAX;
            let (memory_used_bytes, memory_limit_bytes, mut processes) = match ledger {
                Some(ledger) if tracked => (
                    ledger.used_bytes(ordinal),
                    ledger.limits_bytes[ordinal].unwrap_or(0),
                    ledger
                        .processes
                        .iter()
                        .filter(|p| p.used_bytes[ordinal] > 0)
                        .map(|p| ProcessUsage {
                            pid: p.pid,
                            memory_bytes: p.used_bytes[ordinal],
                            tenant: assignment.tenant.clone(),
                        })
                        .collect(),
                ),
                // No process ran yet: the limit is the one the agent hands out.
                _ => (0, slice.memory_bytes, Vec::new()),
            };
            let time = files
                .schedules
                .get(&slice.gpu_uuid)
                .and_then(|times| times.iter().find(|t| t.name == assignment.tenant));
            let process_count = (processes.len() as u32).max(time.map_or(0, |t| t.processes));
            api::usage::bound_processes(&mut processes);
            let board = files
                .boards
                .get(&slice.gpu_uuid)
                .and_then(|tenants| tenants.iter().find(|t| t.name == assignment.tenant));
            entries.push(TenantUsage {
                memory_request_bytes: board.map_or(0, |b| b.request_bytes),
                memory_board_limit_bytes: board.map_or(0, |b| b.limit_bytes),
                memory_resident_bytes: board.map_or(0, |b| b.resident_bytes),
                memory_borrowed_bytes: board.map_or(0, |b| b.borrowed_bytes()),
                memory_swapped_bytes: board.map_or(0, |b| b.swapped_bytes),
                memory_staging_bytes: board.map_or(0, |b| b.staging_bytes),
                memory_reclaims: board.map_or(0, |b| b.reclaims),
                memory_reclaimed_bytes: board.map_or(0, |b| b.reclaimed_bytes),
                memory_last_reclaim_unix_ms: board.map_or(0, |b| {
                    i64::try_from(b.last_reclaim_unix_ms).unwrap_or(i64::MAX)
                }),
                memory_waiting_processes: board.map_or(0, |b| b.waiting_processes),
                memory_longest_wait_ms: board.filter(|b| b.waiting_since_ns != 0).map_or(0, |b| {
                    files.sampled_ns.saturating_sub(b.waiting_since_ns) / 1_000_000
                }),
                tenant: assignment.tenant.clone(),
                node: node.to_owned(),
                gpu: slice.gpu_uuid.clone(),
                gpu_index: slice.gpu_index,
                memory_used_bytes,
                memory_limit_bytes,
                gpu_time_ns: time.map_or(0, |t| t.used_ns),
                process_count,
                processes,
                reported_unix_ms: 0,
                ..TenantUsage::default()
            });
        }
        if let Some(first) = entries.get_mut(first_entry) {
            attach_latency(first, assignment, latency);
            attach_redistribution(first, redistribution);
        }
    }
    entries
}

/// Puts a latency tenant's numbers on `entry`: the controller's, else the target it asked for.
fn attach_latency(
    entry: &mut TenantUsage,
    assignment: &TenantAssignment,
    latency: &dyn Fn(&str) -> Option<LatencyReport>,
) {
    assert_eq!(entry.tenant, assignment.tenant);
    let measured = if assignment.latency {
        latency(&assignment.tenant)
    } else {
        None
    };
    let report = measured.unwrap_or_default();
    entry.latency_target_us = match report.target_us {
        0 => assignment.latency_target_us.unwrap_or(0),
        target => target,
    };
    entry.latency_baseline_us = report.baseline_us;
    entry.latency_p50_us = report.p50_us;
    entry.latency_p99_us = report.p99_us;
    entry.latency_steps = report.steps;
    entry.latency_violations = report.violations.min(report.steps);
    debug_assert!(assignment.latency || entry.latency_target_us == 0);
}

/// Puts the SM redistribution's numbers on `entry` when the redistribution follows its tenant;
/// leaves them 0 otherwise.
fn attach_redistribution(
    entry: &mut TenantUsage,
    redistribution: &dyn Fn(&str) -> Option<RedistributionReport>,
) {
    let report = redistribution(&entry.tenant);
    debug_assert!(
        report.is_none_or(|r| r.sm_cap_permille > 0),
        "0 means not followed"
    );
    let Some(report) = report.filter(|r| r.sm_cap_permille > 0) else {
        return;
    };
    entry.sm_cap_permille = report.sm_cap_permille.min(api::usage::SM_CAP_PERMILLE_FULL);
    entry.progress_per_s = report.progress_per_s;
    entry.progress_hinted = report.hinted;
    entry.progress_alone_per_s = report.alone_per_s;
    entry.redistribution_side_by_side = report.side_by_side;
    debug_assert!(entry.progress_per_s.is_finite() && entry.progress_per_s >= 0.0);
}

/// Which tenant each live ledger process belongs to (to name NVML's processes).
pub fn tenants_by_pid(files: &Files) -> BTreeMap<u32, String> {
    files
        .ledgers
        .iter()
        .flat_map(|(tenant, ledger)| {
            ledger
                .processes
                .iter()
                .map(move |p| (p.pid, tenant.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignments::SliceAssignment;
    use tenant_abi::ProcessCharge;

    const GIB: u64 = 1 << 30;

    fn slice(gpu_index: u32, memory_bytes: u64) -> SliceAssignment {
        SliceAssignment {
            gpu_index,
            gpu_uuid: format!("GPU-{gpu_index}"),
            compute_percent: 50,
            memory_bytes,
            guaranteed: true,
            burst: false,
            memory_limit_bytes: 0,
        }
    }

    fn charge(pid: u32, per_ordinal: &[u64]) -> ProcessCharge {
        let mut used_bytes = [0; DEVICES_MAX];
        used_bytes[..per_ordinal.len()].copy_from_slice(per_ordinal);
        ProcessCharge { pid, used_bytes }
    }

    /// Issue 17: each entry carries its GPU's board figures for the tenant; a GPU without a board
    /// reports zeros.
    #[test]
    fn board_figures_go_on_each_gpus_entry() {
        let assignments = vec![TenantAssignment {
            tenant: "elastic".into(),
            priority: 0,
            slices: vec![slice(0, 20 * GIB), slice(1, 20 * GIB)],
            bandwidth_weight: 0,
            latency: false,
            latency_target_us: None,
        }];
        let mut files = Files::default();
        files.boards.insert(
            "GPU-0".into(),
            vec![tenant_abi::board::TenantUsage {
                name: "elastic".into(),
                request_bytes: 20 * GIB,
                limit_bytes: 60 * GIB,
                resident_bytes: 26 * GIB,
                swapped_bytes: 2 * GIB,
                staging_bytes: 2 * GIB,
                reclaims: 3,
                reclaimed_bytes: 7 * GIB,
                last_reclaim_unix_ms: 1_700_000_000_000,
                waiting_processes: 2,
                waiting_since_ns: 4_000_000_000,
            }],
        );
        files.sampled_ns = 9_500_000_000;
        let entries = combine("node-a", &assignments, &files, &|_| None, &|_| None);
        let figures: Vec<(u64, u64, u64, u64, u64, u64)> = entries
            .iter()
            .map(|e| {
                (
                    e.memory_request_bytes,
                    e.memory_board_limit_bytes,
                    e.memory_resident_bytes,
                    e.memory_borrowed_bytes,
                    e.memory_swapped_bytes,
                    e.memory_staging_bytes,
                )
            })
            .collect();
        assert_eq!(
            figures,
            [
                (20 * GIB, 60 * GIB, 26 * GIB, 6 * GIB, 2 * GIB, 2 * GIB),
                (0, 0, 0, 0, 0, 0)
            ]
        );
        let history: Vec<(u64, u64, i64)> = entries
            .iter()
            .map(|e| {
                (
                    e.memory_reclaims,
                    e.memory_reclaimed_bytes,
                    e.memory_last_reclaim_unix_ms,
                )
            })
            .collect();
        assert_eq!(history, [(3, 7 * GIB, 1_700_000_000_000), (0, 0, 0)]);
        let waiting: Vec<(u32, u64)> = entries
            .iter()
            .map(|e| (e.memory_waiting_processes, e.memory_longest_wait_ms))
            .collect();
        assert_eq!(waiting, [(2, 5_500), (0, 0)]);
    }

    #[test]
    fn ledger_ordinals_follow_the_sorted_slices_and_time_comes_from_each_gpu() {
        // Slices arrive out of order: ordinal 0 is GPU 2, ordinal 1 is GPU 5.
        let assignments = vec![
            TenantAssignment {
                tenant: "train".into(),
                priority: 0,
                slices: vec![slice(5, 20 * GIB), slice(2, 10 * GIB)],
                bandwidth_weight: 0,
                latency: false,
                latency_target_us: None,
            },
            TenantAssignment {
                tenant: "idle".into(),
                priority: 0,
                slices: vec![slice(2, 4 * GIB)],
                bandwidth_weight: 0,
                latency: false,
                latency_target_us: None,
            },
        ];
        let mut limits = [None; DEVICES_MAX];
        limits[0] = Some(10 * GIB);
        limits[1] = Some(20 * GIB);
        let mut files = Files::default();
        files.ledgers.insert(
            "train".into(),
            LedgerUsage {
                limits_bytes: limits,
                processes: vec![charge(100, &[3 * GIB, 0]), charge(101, &[GIB, 7 * GIB])],
                dead_slots: 0,
            },
        );
        files.schedules.insert(
            "GPU-5".into(),
            vec![TenantTime {
                name: "train".into(),
                used_ns: 9_000_000_000,
                processes: 1,
            }],
        );
        let entries = combine("node-a", &assignments, &files, &|_| None, &|_| None);
        let summary: Vec<(&str, u32, u64, u64, u64, u32)> = entries
            .iter()
            .map(|e| {
                (
                    e.tenant.as_str(),
                    e.gpu_index,
                    e.memory_used_bytes,
                    e.memory_limit_bytes,
                    e.gpu_time_ns,
                    e.process_count,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("train", 2, 4 * GIB, 10 * GIB, 0, 2),
                ("train", 5, 7 * GIB, 20 * GIB, 9_000_000_000, 1),
                ("idle", 2, 0, 4 * GIB, 0, 0),
            ]
        );
        assert_eq!(entries[0].gpu, "GPU-2");
        assert_eq!(entries[0].node, "node-a");
        let pids: Vec<(u32, u64)> = entries[0]
            .processes
            .iter()
            .map(|p| (p.pid, p.memory_bytes))
            .collect();
        assert_eq!(pids, [(100, 3 * GIB), (101, GIB)], "largest first");
        assert_eq!(
            tenants_by_pid(&files).get(&101).map(String::as_str),
            Some("train")
        );
    }

    #[test]
    fn a_latency_tenants_numbers_go_on_its_first_entry() {
        let tenant = |name: &str, latency, latency_target_us, slices| TenantAssignment {
            tenant: String::from(name),
            priority: 0,
            slices,
            bandwidth_weight: 0,
            latency,
            latency_target_us,
        };
        let assignments = vec![
            tenant(
                "chat",
                true,
                Some(2_000),
                vec![slice(3, GIB), slice(1, GIB)],
            ),
            tenant("voice", true, Some(500), vec![slice(1, GIB)]),
            tenant("derived", true, None, vec![slice(1, GIB)]),
            tenant("train", false, None, vec![slice(0, GIB)]),
        ];
        let controller = |name: &str| match name {
            "chat" => Some(LatencyReport::from_ns(
                Some(2_000_000),
                Some(1_400_000),
                Some(899_001),
                Some(1_800_000),
                12_000,
                7,
            )),
            "derived" => Some(LatencyReport::from_ns(
                Some(1_680_000),
                Some(1_400_000),
                None,
                None,
                0,
                0,
            )),
            // A controller never reports a tenant that is not a latency tenant; if it did, the
            // numbers would be left out.
            _ => Some(LatencyReport {
                p99_us: 9,
                ..LatencyReport::default()
            })
            .filter(|_| name == "train"),
        };
        let entries = combine(
            "node-a",
            &assignments,
            &Files::default(),
            &controller,
            &|_| None,
        );
        let latency: Vec<(&str, u32, [u64; 6])> = entries
            .iter()
            .map(|e| {
                (
                    e.tenant.as_str(),
                    e.gpu_index,
                    [
                        e.latency_target_us,
                        e.latency_baseline_us,
                        e.latency_p50_us,
                        e.latency_p99_us,
                        e.latency_steps,
                        e.latency_violations,
                    ],
                )
            })
            .collect();
        assert_eq!(
            latency,
            [
                ("chat", 1, [2_000, 1_400, 900, 1_800, 12_000, 7]),
                ("chat", 3, [0; 6]),
                // Not known to the controller yet: the target asked for.
                ("voice", 1, [500, 0, 0, 0, 0, 0]),
                ("derived", 1, [1_680, 1_400, 0, 0, 0, 0]),
                ("train", 0, [0; 6]),
            ]
        );
        // Without a controller, the asked-for targets alone.
        let plain = combine(
            "node-a",
            &assignments,
            &Files::default(),
            &|_| None,
            &|_| None,
        );
        assert_eq!(plain[0].latency_target_us, 2_000);
        assert_eq!(plain[0].latency_steps, 0);
        assert_eq!(LatencySource::default().get("chat"), None);
    }

    /// Issue 15 point 4: a tenant the redistribution follows gets its cap and rate on its first
    /// entry; other tenants and other entries carry zeros.
    #[test]
    fn a_redistributed_tenants_cap_and_rate_go_on_its_first_entry() {
        let tenant = |name: &str, slices| TenantAssignment {
            tenant: String::from(name),
            priority: 0,
            slices,
            bandwidth_weight: 0,
            latency: false,
            latency_target_us: None,
        };
        let assignments = vec![
            tenant("sweep", vec![slice(4, GIB), slice(2, GIB)]),
            tenant("batch", vec![slice(2, GIB)]),
            tenant("fresh", vec![slice(2, GIB)]),
            tenant("other", vec![slice(2, GIB)]),
        ];
        let member = |name: &str, cap, rate, hinted| sharing::MemberStatus {
            name: name.to_owned(),
            cap,
            rate,
            alone: None,
            hinted,
            side_by_side: false,
        };
        let members: BTreeMap<String, sharing::MemberStatus> = [
            sharing::MemberStatus {
                alone: Some(40.0),
                side_by_side: true,
                ..member("sweep", 80, Some(12.25), true)
            },
            member("batch", sharing::redistribute::FULL, Some(310.0), false),
            // Not measured yet at the kept caps.
            member("fresh", sharing::redistribute::FULL, None, false),
        ]
        .into_iter()
        .map(|member| (member.name.clone(), member))
        .collect();
        let source = RedistributionSource::new(move |tenant| {
            members.get(tenant).map(RedistributionReport::from_member)
        });
        let entries = combine(
            "node-a",
            &assignments,
            &Files::default(),
            &|_| None,
            &|tenant| source.get(tenant),
        );
        let numbers: Vec<(&str, u32, u32, f64, bool, f64)> = entries
            .iter()
            .map(|e| {
                (
                    e.tenant.as_str(),
                    e.gpu_index,
                    e.sm_cap_permille,
                    e.progress_per_s,
                    e.progress_hinted,
                    e.progress_alone_per_s,
                )
            })
            .collect();
        assert_eq!(
            numbers,
            [
                // 80/128 of the SMs: 625 thousandths; probed alone at 40 units a second.
                ("sweep", 2, 625, 12.25, true, 40.0),
                ("sweep", 4, 0, 0.0, false, 0.0),
                ("batch", 2, 1_000, 310.0, false, 0.0),
                ("fresh", 2, 1_000, 0.0, false, 0.0),
                ("other", 2, 0, 0.0, false, 0.0),
            ]
        );
        // Side by side on the entry that carries the numbers only.
        let sided: Vec<bool> = entries
            .iter()
            .map(|e| e.redistribution_side_by_side)
            .collect();
        assert_eq!(sided, [true, false, false, false, false]);
        // Whatever comes through, the report stays sane: rounded to the nearest thousandth, never
        // 0 for a member, and a rate that is not a number is unknown.
        let report = |cap, rate| RedistributionReport::from_member(&member("x", cap, rate, false));
        assert_eq!(report(1, Some(f64::NAN)).sm_cap_permille, 8);
        assert_eq!(report(1, Some(f64::NAN)).progress_per_s, 0.0);
        assert_eq!(report(0, Some(-3.0)).sm_cap_permille, 1);
        assert_eq!(report(0, Some(-3.0)).progress_per_s, 0.0);
        assert_eq!(report(127, Some(f64::INFINITY)).sm_cap_permille, 992);
        assert_eq!(report(64, None).sm_cap_permille, 500);
        let probed = |alone| {
            RedistributionReport::from_member(&sharing::MemberStatus {
                alone,
                ..member("x", 64, Some(1.0), false)
            })
            .alone_per_s
        };
        assert_eq!(probed(Some(f64::NAN)), 0.0);
        assert_eq!(probed(Some(-1.0)), 0.0);
        assert_eq!(probed(Some(7.5)), 7.5);
        assert_eq!(RedistributionSource::default().get("sweep"), None);
    }

    #[test]
    fn files_are_read_through_the_interposer_protocol() {
        let directory = tempfile::tempdir().unwrap();
        let assignments = vec![TenantAssignment {
            tenant: "train".into(),
            priority: 0,
            slices: vec![slice(0, 10 * GIB)],
            bandwidth_weight: 0,
            latency: false,
            latency_target_us: None,
        }];
        // Nothing ran yet: no files, no problems, zeros.
        let (files, problems) = read_files(directory.path(), &assignments);
        assert!(problems.is_empty(), "{problems:?}");
        let entries = combine("n", &assignments, &files, &|_| None, &|_| None);
        assert_eq!(entries.len(), 1);
        assert_eq!(
            (entries[0].memory_used_bytes, entries[0].memory_limit_bytes),
            (0, 10 * GIB)
        );

        // A damaged ledger is a problem for the log, not an error.
        let layout = crate::private::Layout::new(directory.path());
        std::fs::create_dir_all(layout.tenant_dir("train")).unwrap();
        std::fs::write(layout.ledger("train"), b"garbage").unwrap();
        let (files, problems) = read_files(directory.path(), &assignments);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("train.mem"), "{problems:?}");
        assert!(files.ledgers.is_empty());

        // Written by the interposer's protocol, as a tenant process would.
        std::fs::remove_file(layout.ledger("train")).unwrap();
        let mut limits = [None; DEVICES_MAX];
        limits[0] = Some(10 * GIB);
        let ledger = tenant_abi::writer::ledger(&layout.ledger("train"), &limits).unwrap();
        let (pid, start_time) = (std::process::id(), tenant_abi::ledger::own_start_time());
        tenant_abi::writer::charge_memory(&ledger, pid, start_time, 0, 3 * GIB).unwrap();
        let schedule = tenant_abi::writer::schedule(
            &layout.schedule("GPU-0"),
            tenant_abi::compute::QUANTUM_NS_DEFAULT,
        )
        .unwrap();
        tenant_abi::writer::charge_time(&schedule, "train", pid, start_time, 1_000, 1_500_000_000)
            .unwrap();
        let (files, problems) = read_files(directory.path(), &assignments);
        assert!(problems.is_empty(), "{problems:?}");
        let entries = combine("n", &assignments, &files, &|_| None, &|_| None);
        assert_eq!(entries[0].memory_used_bytes, 3 * GIB);
        assert_eq!(entries[0].gpu_time_ns, 1_500_000_000);
        assert_eq!(entries[0].process_count, 1);
        assert_eq!(entries[0].processes[0].pid, pid);
    }
}
