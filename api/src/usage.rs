//! Bounds on what a heartbeat carries besides the node's name: per-GPU health and per-tenant
//! usage. The agent trims its report with [`bound_heartbeat`] before sending it, and the control
//! plane trims again on receipt (an older or misbehaving agent must not grow the leader's memory
//! without bound).

use crate::v1::{GpuHealth, HeartbeatRequest, ProcessUsage, TenantUsage};

/// GPUs with a health entry per heartbeat (as many as a node may register).
pub const HEALTH_GPUS_MAX: usize = 64;
/// Tenant-GPU usage entries per heartbeat (32 tenants on each of 32 GPUs).
pub const USAGE_ENTRIES_MAX: usize = 1024;
/// Processes listed per usage entry or per GPU; the largest are kept.
pub const PROCESSES_MAX: usize = 16;
/// Throttle reasons and `unsupported` names per GPU (NVML defines fewer).
pub const NAMES_MAX: usize = 16;
/// Longest name (throttle reason, query) kept.
pub const NAME_LENGTH_MAX: usize = 32;
/// Largest step latency (baseline, p50, p99) a usage entry may report, in µs: an hour. A step
/// that long is a hung tenant, not a latency; larger values are clamped to it.
pub const LATENCY_REPORTED_US_MAX: u64 = 3_600_000_000;
/// An SM cap of the whole GPU (uncapped), in the thousandths `TenantUsage.sm_cap_permille`
/// counts; larger values are clamped to it.
pub const SM_CAP_PERMILLE_FULL: u32 = 1000;

/// What [`bound_heartbeat`] dropped, for a log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trimmed {
    pub gpus: usize,
    pub usage: usize,
    pub processes: usize,
    pub names: usize,
    /// Usage entries whose latency numbers were clamped.
    pub latency: usize,
    /// Usage entries whose SM redistribution numbers were clamped or cleared.
    pub redistribution: usize,
}

impl Trimmed {
    pub fn any(&self) -> bool {
        *self != Trimmed::default()
    }
}

/// Trims `request` to the bounds above; keeps the largest processes. Idempotent.
pub fn bound_heartbeat(request: &mut HeartbeatRequest) -> Trimmed {
    let mut trimmed = Trimmed {
        gpus: request.gpus.len().saturating_sub(HEALTH_GPUS_MAX),
        usage: request.usage.len().saturating_sub(USAGE_ENTRIES_MAX),
        ..Trimmed::default()
    };
    request.gpus.truncate(HEALTH_GPUS_MAX);
    request.usage.truncate(USAGE_ENTRIES_MAX);
    for gpu in &mut request.gpus {
        trimmed.processes += bound_processes(&mut gpu.processes);
        trimmed.names += bound_names(&mut gpu.throttle_reasons);
        trimmed.names += bound_names(&mut gpu.unsupported);
    }
    for usage in &mut request.usage {
        trimmed.processes += bound_processes(&mut usage.processes);
        trimmed.latency += usize::from(bound_latency(usage));
        trimmed.redistribution += usize::from(bound_redistribution(usage));
    }
    debug_assert!(request.gpus.len() <= HEALTH_GPUS_MAX);
    debug_assert!(request.usage.len() <= USAGE_ENTRIES_MAX);
    trimmed
}

/// Keeps the [`PROCESSES_MAX`] largest processes, largest first (ties by pid); returns how many
/// were dropped.
pub fn bound_processes(processes: &mut Vec<ProcessUsage>) -> usize {
    processes.sort_by(|a, b| b.memory_bytes.cmp(&a.memory_bytes).then(a.pid.cmp(&b.pid)));
    let dropped = processes.len().saturating_sub(PROCESSES_MAX);
    processes.truncate(PROCESSES_MAX);
    for process in processes.iter_mut() {
        truncate_name(&mut process.tenant, crate::names::NAME_LENGTH_MAX);
    }
    dropped
}

/// Clamps a usage entry's latency numbers: the target to the range a request may ask for, the
/// measured ones to [`LATENCY_REPORTED_US_MAX`], and the violations to the steps (a violation is
/// a step). Returns whether anything changed.
pub fn bound_latency(usage: &mut TenantUsage) -> bool {
    let before = (
        usage.latency_target_us,
        usage.latency_baseline_us,
        usage.latency_p50_us,
        usage.latency_p99_us,
        usage.latency_violations,
    );
    usage.latency_target_us = usage
        .latency_target_us
        .min(crate::validate::LATENCY_TARGET_US_MAX);
    for measured in [
        &mut usage.latency_baseline_us,
        &mut usage.latency_p50_us,
        &mut usage.latency_p99_us,
    ] {
        *measured = (*measured).min(LATENCY_REPORTED_US_MAX);
    }
    usage.latency_violations = usage.latency_violations.min(usage.latency_steps);
    debug_assert!(usage.latency_violations <= usage.latency_steps);
    let after = (
        usage.latency_target_us,
        usage.latency_baseline_us,
        usage.latency_p50_us,
        usage.latency_p99_us,
        usage.latency_violations,
    );
    before != after
}

/// Makes a usage entry's SM redistribution numbers sane: the cap at most
/// [`SM_CAP_PERMILLE_FULL`]; a progress rate (with the others, or alone) that is not a finite
/// non-negative number is unknown (0); and an entry the redistribution does not follow (cap 0)
/// carries no rate and no hint.
/// Returns whether anything changed.
pub fn bound_redistribution(usage: &mut TenantUsage) -> bool {
    let before = (
        usage.sm_cap_permille,
        usage.progress_per_s.to_bits(),
        usage.progress_hinted,
        usage.progress_alone_per_s.to_bits(),
        usage.redistribution_side_by_side,
    );
    usage.sm_cap_permille = usage.sm_cap_permille.min(SM_CAP_PERMILLE_FULL);
    let sane = |rate: f64| rate.is_finite() && rate >= 0.0;
    if !sane(usage.progress_per_s) || usage.sm_cap_permille == 0 {
        usage.progress_per_s = 0.0;
    }
    if !sane(usage.progress_alone_per_s) || usage.sm_cap_permille == 0 {
        usage.progress_alone_per_s = 0.0;
    }
    if usage.sm_cap_permille == 0 {
        usage.progress_hinted = false;
        usage.redistribution_side_by_side = false;
    }
    debug_assert!(usage.progress_per_s.is_finite() && usage.progress_per_s >= 0.0);
    debug_assert!(
        usage.sm_cap_permille > 0 || (usage.progress_per_s == 0.0 && !usage.progress_hinted)
    );
    let after = (
        usage.sm_cap_permille,
        usage.progress_per_s.to_bits(),
        usage.progress_hinted,
        usage.progress_alone_per_s.to_bits(),
        usage.redistribution_side_by_side,
    );
    before != after
}

fn bound_names(names: &mut Vec<String>) -> usize {
    let dropped = names.len().saturating_sub(NAMES_MAX);
    names.truncate(NAMES_MAX);
    for name in names.iter_mut() {
        truncate_name(name, NAME_LENGTH_MAX);
    }
    dropped
}

fn truncate_name(name: &mut String, max: usize) {
    if name.len() > max {
        let mut end = max;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
}

/// Whether a usage entry says anything (memory held, time used or processes alive).
pub fn is_active(usage: &TenantUsage) -> bool {
    usage.memory_used_bytes > 0 || usage.gpu_time_ns > 0 || usage.process_count > 0
}

/// A health entry with every optional field absent (the shape of a GPU whose driver answered
/// nothing), for callers that fill it in.
pub fn empty_health(uuid: &str, index: u32) -> GpuHealth {
    GpuHealth {
        uuid: uuid.to_owned(),
        index,
        ..GpuHealth::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: u32, memory_bytes: u64) -> ProcessUsage {
        ProcessUsage {
            pid,
            memory_bytes,
            tenant: "t".repeat(100),
        }
    }

    #[test]
    fn a_heartbeat_is_trimmed_to_its_bounds_keeping_the_largest_processes() {
        let mut gpu = empty_health("GPU-1", 0);
        gpu.processes = (0..40)
            .map(|pid| process(pid, u64::from(pid) * 10))
            .collect();
        gpu.throttle_reasons = (0..20)
            .map(|i| format!("reason-{i}-{}", "x".repeat(40)))
            .collect();
        let mut request = HeartbeatRequest {
            node: "a".into(),
            gpus: vec![gpu; HEALTH_GPUS_MAX + 3],
            usage: vec![TenantUsage::default(); USAGE_ENTRIES_MAX + 5],
            ..HeartbeatRequest::default()
        };
        let trimmed = bound_heartbeat(&mut request);
        assert_eq!(trimmed.gpus, 3);
        assert_eq!(trimmed.usage, 5);
        assert_eq!(trimmed.processes, HEALTH_GPUS_MAX * (40 - PROCESSES_MAX));
        assert_eq!(trimmed.names, HEALTH_GPUS_MAX * 4);
        assert!(trimmed.any());
        let first = &request.gpus[0];
        assert_eq!(first.processes.len(), PROCESSES_MAX);
        assert_eq!(first.processes[0].pid, 39, "largest first");
        assert_eq!(
            first.processes[0].tenant.len(),
            crate::names::NAME_LENGTH_MAX
        );
        assert!(
            first
                .throttle_reasons
                .iter()
                .all(|n| n.len() <= NAME_LENGTH_MAX)
        );
        assert_eq!(bound_heartbeat(&mut request), Trimmed::default());
    }

    #[test]
    fn latency_numbers_are_clamped_and_violations_never_exceed_steps() {
        let mut request = HeartbeatRequest {
            usage: vec![
                TenantUsage {
                    latency_target_us: 2_000,
                    latency_baseline_us: 1_500,
                    latency_p50_us: 1_000,
                    latency_p99_us: 1_900,
                    latency_steps: 100,
                    latency_violations: 3,
                    ..TenantUsage::default()
                },
                TenantUsage {
                    latency_target_us: u64::MAX,
                    latency_p99_us: u64::MAX,
                    latency_steps: 5,
                    latency_violations: 9,
                    ..TenantUsage::default()
                },
            ],
            ..HeartbeatRequest::default()
        };
        let sane = request.usage[0].clone();
        let trimmed = bound_heartbeat(&mut request);
        assert_eq!(trimmed.latency, 1);
        assert_eq!(request.usage[0], sane, "sane numbers are kept");
        let clamped = &request.usage[1];
        assert_eq!(
            clamped.latency_target_us,
            crate::validate::LATENCY_TARGET_US_MAX
        );
        assert_eq!(clamped.latency_p99_us, LATENCY_REPORTED_US_MAX);
        assert_eq!(clamped.latency_violations, 5);
        assert_eq!(bound_heartbeat(&mut request), Trimmed::default());
    }

    #[test]
    fn redistribution_numbers_are_clamped_and_nonsense_rates_are_unknown() {
        let followed = |sm_cap_permille, progress_per_s, progress_hinted| TenantUsage {
            sm_cap_permille,
            progress_per_s,
            progress_hinted,
            ..TenantUsage::default()
        };
        let mut request = HeartbeatRequest {
            usage: vec![
                followed(625, 12.5, true),
                followed(SM_CAP_PERMILLE_FULL, 0.0, false),
                followed(5_000, 3.0, false),
                followed(500, f64::NAN, true),
                followed(500, f64::INFINITY, false),
                followed(500, -1.0, false),
                // Not followed: a rate or a hint means nothing.
                followed(0, 7.0, true),
            ],
            ..HeartbeatRequest::default()
        };
        let sane = request.usage[..2].to_vec();
        let trimmed = bound_heartbeat(&mut request);
        assert_eq!(trimmed.redistribution, 5);
        assert_eq!(request.usage[..2], sane[..], "sane numbers are kept");
        let numbers: Vec<(u32, f64, bool)> = request.usage[2..]
            .iter()
            .map(|u| (u.sm_cap_permille, u.progress_per_s, u.progress_hinted))
            .collect();
        assert_eq!(
            numbers,
            [
                (SM_CAP_PERMILLE_FULL, 3.0, false),
                (500, 0.0, true),
                (500, 0.0, false),
                (500, 0.0, false),
                (0, 0.0, false),
            ]
        );
        assert_eq!(bound_heartbeat(&mut request), Trimmed::default());
        // The rate alone: kept when sane, unknown when not, nothing when not followed.
        let alone = |sm_cap_permille, progress_alone_per_s| {
            let mut usage = TenantUsage {
                sm_cap_permille,
                progress_alone_per_s,
                ..TenantUsage::default()
            };
            bound_redistribution(&mut usage);
            usage.progress_alone_per_s
        };
        assert_eq!(alone(625, 30.5), 30.5);
        assert_eq!(alone(625, f64::NAN), 0.0);
        assert_eq!(alone(625, -2.0), 0.0);
        assert_eq!(alone(0, 30.5), 0.0);
        // Side by side: kept for a followed tenant, nothing when not followed.
        let sided = |sm_cap_permille| {
            let mut usage = TenantUsage {
                sm_cap_permille,
                redistribution_side_by_side: true,
                ..TenantUsage::default()
            };
            let changed = bound_redistribution(&mut usage);
            (usage.redistribution_side_by_side, changed)
        };
        assert_eq!(sided(625), (true, false));
        assert_eq!(sided(0), (false, true));
    }

    #[test]
    fn activity_means_memory_time_or_processes() {
        let mut usage = TenantUsage::default();
        assert!(!is_active(&usage));
        usage.gpu_time_ns = 1;
        assert!(is_active(&usage));
    }
}
