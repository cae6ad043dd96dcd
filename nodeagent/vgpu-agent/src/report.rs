//! Which health and usage report a heartbeat carries: the whole report only when it changed since
//! the report the control plane acknowledged, or as a periodic refresh; otherwise none, and the
//! leader keeps the one it holds (`ReportKind` in the proto). At 10,000 nodes a full 8-GPU report
//! on every beat was most of what the control plane decoded, re-encoded (followers forward it)
//! and stored each second; idle nodes' reports never change.
//!
//! Usage counters and gauges (a tenant's memory bytes and GPU time, a GPU's utilisation,
//! temperature and memory in use, processes' memory) move on every sample of a busy node, which
//! would defeat the change detection. Rather than quantise them (GPU time only grows), a report
//! whose only changes are in those fields is *held back* for up to
//! [`ReportPolicy::usage_refresh_beats`] beats (5 s at the default 1 s interval): `vgpuctl
//! describe` then shows usage at most that much plus one monitor interval old, with the exact
//! values, and stamped with when they were sent. Any other change (a tenant or process comes or
//! goes, a limit, XID, ECC or throttle change, a query that became unsupported) goes out on the
//! next beat.
//!
//! Every full report gets a new generation number; beats without one name the generation they
//! stand by. A leader that holds another generation (or none: a new leader after a failover)
//! answers `report_wanted`, and the next beat is full. A failed beat also makes the next one
//! full, since whether a full report arrived is then unknown.
//!
//! [`ReportSender`] is pure (it counts beats and reads no clock); the `join` heartbeat loop and
//! the fleet simulator both use it.

use api::v1::{GpuHealth, HeartbeatRequest, ProcessUsage, ReportKind, TenantUsage};

use crate::monitor::Report;

/// Beats after which a report is sent in full even when unchanged (30 s at 1 s).
pub const FULL_REFRESH_BEATS_DEFAULT: u32 = 30;
/// Beats for which a report whose only changes are usage counters and gauges is held back.
pub const USAGE_REFRESH_BEATS_DEFAULT: u32 = 5;

/// How often reports go out in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportPolicy {
    /// A full report at least every this many beats.
    pub full_refresh_beats: u32,
    /// Usage-only changes wait at most this many beats; 1 sends them at once.
    pub usage_refresh_beats: u32,
}

impl Default for ReportPolicy {
    fn default() -> Self {
        ReportPolicy {
            full_refresh_beats: FULL_REFRESH_BEATS_DEFAULT,
            usage_refresh_beats: USAGE_REFRESH_BEATS_DEFAULT,
        }
    }
}

/// The report state of one node's heartbeats.
#[derive(Debug)]
pub struct ReportSender {
    policy: ReportPolicy,
    /// The last full report the control plane acknowledged, and its generation.
    acknowledged: Option<(Report, u64)>,
    /// Beats acknowledged since that report was sent.
    beats_since_full: u32,
    /// The full report of the beat in flight, until it is answered.
    in_flight: Option<(Report, u64)>,
    next_generation: u64,
}

impl ReportSender {
    /// `first_generation` should differ from anything an earlier run of the agent for the same
    /// node used (e.g. derived from the wall clock at start), so that a leader never mistakes an
    /// old report for the new run's.
    pub fn new(policy: ReportPolicy, first_generation: u64) -> ReportSender {
        assert!(policy.full_refresh_beats >= 1, "a refresh interval");
        assert!(policy.usage_refresh_beats >= 1, "a usage interval");
        ReportSender {
            policy,
            acknowledged: None,
            beats_since_full: 0,
            in_flight: None,
            next_generation: first_generation,
        }
    }

    /// A first generation for a new run: unix milliseconds times 1,000 (a run would have to
    /// send 1,000 full reports a millisecond to reach the next run's numbers).
    pub fn first_generation_now() -> u64 {
        (crate::monitor::unix_ms().max(0) as u64).saturating_mul(1000)
    }

    /// The heartbeat for `node` with `latest` (the newest sample): with the full report, or
    /// naming the acknowledged one. Call [`ReportSender::answered`] or
    /// [`ReportSender::failed`] with its outcome before the next beat.
    pub fn beat(&mut self, node: &str, latest: &Report) -> HeartbeatRequest {
        let kind = self.kind(latest);
        let mut request = HeartbeatRequest {
            node: node.to_owned(),
            report: kind as i32,
            ..HeartbeatRequest::default()
        };
        match kind {
            ReportKind::Full => {
                let generation = self.next_generation;
                self.next_generation = self.next_generation.wrapping_add(1);
                request.gpus = latest.gpus.clone();
                request.usage = latest.usage.clone();
                request.report_generation = generation;
                self.in_flight = Some((latest.clone(), generation));
            }
            ReportKind::Unchanged | ReportKind::HeldBack => {
                let (_, generation) = self.acknowledged.as_ref().expect("checked by kind()");
                request.report_generation = *generation;
                self.in_flight = None;
            }
        }
        debug_assert!(kind == ReportKind::Full || request.gpus.is_empty());
        request
    }

    fn kind(&self, latest: &Report) -> ReportKind {
        let Some((acknowledged, _)) = &self.acknowledged else {
            return ReportKind::Full;
        };
        if self.beats_since_full + 1 >= self.policy.full_refresh_beats {
            return ReportKind::Full;
        }
        if acknowledged == latest {
            return ReportKind::Unchanged;
        }
        if self.beats_since_full + 1 < self.policy.usage_refresh_beats
            && only_usage_moved(acknowledged, latest)
        {
            return ReportKind::HeldBack;
        }
        ReportKind::Full
    }

    /// The control plane answered the last beat.
    pub fn answered(&mut self, known: bool, report_wanted: bool) {
        let sent = self.in_flight.take();
        if !known {
            // The node is registered again; start over with a full report.
            self.acknowledged = None;
            return;
        }
        if report_wanted {
            self.acknowledged = None;
            return;
        }
        match sent {
            Some(full) => {
                self.acknowledged = Some(full);
                self.beats_since_full = 0;
            }
            None => self.beats_since_full = self.beats_since_full.saturating_add(1),
        }
    }

    /// The last beat failed (timeout, error): whether its report arrived is unknown.
    pub fn failed(&mut self) {
        if self.in_flight.take().is_some() {
            self.acknowledged = None;
        }
    }
}

/// Whether `old` and `new` differ only in usage counters and gauges (see the module docs).
pub fn only_usage_moved(old: &Report, new: &Report) -> bool {
    old.gpus.len() == new.gpus.len()
        && old.usage.len() == new.usage.len()
        && old
            .gpus
            .iter()
            .zip(&new.gpus)
            .all(|(a, b)| without_gauges(a) == without_gauges(b))
        && old
            .usage
            .iter()
            .zip(&new.usage)
            .all(|(a, b)| without_counters(a) == without_counters(b))
}

fn without_gauges(gpu: &GpuHealth) -> GpuHealth {
    let zero = |value: Option<u32>| value.map(|_| 0);
    GpuHealth {
        temperature_celsius: zero(gpu.temperature_celsius),
        utilization_percent: zero(gpu.utilization_percent),
        memory_used_bytes: gpu.memory_used_bytes.map(|_| 0),
        processes: without_memory(&gpu.processes),
        ..gpu.clone()
    }
}

fn without_counters(usage: &TenantUsage) -> TenantUsage {
    TenantUsage {
        memory_used_bytes: 0,
        // Elastic memory's gauges (issue 17); the request and limit are not gauges.
        memory_resident_bytes: 0,
        memory_borrowed_bytes: 0,
        memory_swapped_bytes: 0,
        memory_staging_bytes: 0,
        memory_reclaims: 0,
        memory_reclaimed_bytes: 0,
        memory_last_reclaim_unix_ms: 0,
        memory_waiting_processes: 0,
        memory_longest_wait_ms: 0,
        gpu_time_ns: 0,
        processes: without_memory(&usage.processes),
        // A latency tenant's measurements move with every step; its target does not.
        latency_baseline_us: 0,
        latency_p50_us: 0,
        latency_p99_us: 0,
        latency_steps: 0,
        latency_violations: 0,
        // The SM redistribution's progress rate is measured each period; the cap it keeps and
        // whether the tenant is followed at all are not measurements (they go at once).
        progress_per_s: 0.0,
        ..usage.clone()
    }
}

/// Processes by pid without their memory (the list is ordered by memory, which moves).
fn without_memory(processes: &[ProcessUsage]) -> Vec<ProcessUsage> {
    let mut processes: Vec<ProcessUsage> = processes
        .iter()
        .map(|process| ProcessUsage {
            memory_bytes: 0,
            ..process.clone()
        })
        .collect();
    processes.sort_by_key(|process| process.pid);
    processes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(temperature: u32, memory: u64, process_count: u32) -> Report {
        let mut gpu = api::usage::empty_health("GPU-0", 0);
        gpu.temperature_celsius = Some(temperature);
        Report {
            gpus: vec![gpu],
            usage: vec![TenantUsage {
                tenant: "train".into(),
                gpu: "GPU-0".into(),
                memory_used_bytes: memory,
                memory_limit_bytes: 10 << 30,
                gpu_time_ns: memory * 7,
                process_count,
                ..TenantUsage::default()
            }],
        }
    }

    fn kind(request: &HeartbeatRequest) -> ReportKind {
        ReportKind::try_from(request.report).unwrap()
    }

    fn policy(full: u32, usage: u32) -> ReportPolicy {
        ReportPolicy {
            full_refresh_beats: full,
            usage_refresh_beats: usage,
        }
    }

    #[test]
    fn an_acknowledged_report_is_not_sent_again_until_the_refresh() {
        let mut sender = ReportSender::new(policy(4, 2), 100);
        let idle = report(40, 0, 0);
        let first = sender.beat("node-a", &idle);
        assert_eq!(kind(&first), ReportKind::Full);
        assert_eq!(first.report_generation, 100);
        assert_eq!(first.gpus.len(), 1);
        sender.answered(true, false);
        // The second identical report is not sent: the beats name generation 100.
        let mut kinds = Vec::new();
        for _ in 0..7 {
            let beat = sender.beat("node-a", &idle);
            if kind(&beat) != ReportKind::Full {
                assert!(beat.gpus.is_empty() && beat.usage.is_empty());
            }
            kinds.push((kind(&beat), beat.report_generation));
            sender.answered(true, false);
        }
        use ReportKind::{Full, Unchanged};
        assert_eq!(
            kinds,
            [
                (Unchanged, 100),
                (Unchanged, 100),
                (Unchanged, 100),
                (Full, 101),
                (Unchanged, 101),
                (Unchanged, 101),
                (Unchanged, 101),
            ],
            "a full refresh every 4 beats"
        );
    }

    #[test]
    fn a_leader_without_the_report_gets_it_on_the_next_beat() {
        let mut sender = ReportSender::new(ReportPolicy::default(), 1);
        let idle = report(40, 0, 0);
        sender.beat("node-a", &idle);
        sender.answered(true, false);
        let beat = sender.beat("node-a", &idle);
        assert_eq!(kind(&beat), ReportKind::Unchanged);
        // A new leader after a failover holds no report.
        sender.answered(true, true);
        let beat = sender.beat("node-a", &idle);
        assert_eq!(kind(&beat), ReportKind::Full);
        assert_eq!(beat.report_generation, 2, "a new generation");
        assert_eq!(beat.gpus, idle.gpus);
        sender.answered(true, false);
        assert_eq!(kind(&sender.beat("node-a", &idle)), ReportKind::Unchanged);
    }

    #[test]
    fn usage_is_held_back_for_a_while_and_other_changes_go_at_once() {
        let mut sender = ReportSender::new(policy(30, 3), 1);
        sender.beat("node-a", &report(40, 1 << 20, 1));
        sender.answered(true, false);
        // Memory and GPU time grow, the temperature moves: held back for two beats, then sent.
        let kinds: Vec<ReportKind> = (2u32..6)
            .map(|step| {
                let beat = sender.beat("node-a", &report(40 + step, u64::from(step) << 20, 1));
                sender.answered(true, false);
                kind(&beat)
            })
            .collect();
        use ReportKind::{Full, HeldBack};
        assert_eq!(kinds, [HeldBack, HeldBack, Full, HeldBack]);
        // A process came: sent at once.
        let beat = sender.beat("node-a", &report(45, 6 << 20, 2));
        assert_eq!(kind(&beat), Full);
        assert_eq!(beat.usage[0].process_count, 2);
    }

    #[test]
    fn a_failed_full_beat_is_sent_in_full_again_and_unknown_nodes_start_over() {
        let mut sender = ReportSender::new(ReportPolicy::default(), 1);
        let idle = report(40, 0, 0);
        sender.beat("node-a", &idle);
        sender.failed();
        assert_eq!(kind(&sender.beat("node-a", &idle)), ReportKind::Full);
        sender.answered(true, false);
        // A failed beat without a report changes nothing.
        sender.beat("node-a", &idle);
        sender.failed();
        assert_eq!(kind(&sender.beat("node-a", &idle)), ReportKind::Unchanged);
        sender.answered(false, false);
        assert_eq!(kind(&sender.beat("node-a", &idle)), ReportKind::Full);
    }

    #[test]
    fn usage_changes_are_told_from_other_changes() {
        let base = report(40, 1, 1);
        assert!(only_usage_moved(&base, &report(50, 9, 1)));
        assert!(!only_usage_moved(&base, &report(40, 1, 2)));
        let mut xid = base.clone();
        xid.gpus[0].xid_errors = 1;
        assert!(!only_usage_moved(&base, &xid));
        let mut unsupported = base.clone();
        unsupported.gpus[0].temperature_celsius = None;
        assert!(
            !only_usage_moved(&base, &unsupported),
            "a query that stopped working"
        );
        let mut gone = base.clone();
        gone.usage.clear();
        assert!(!only_usage_moved(&base, &gone));
        // A latency tenant's step latencies are measurements; a new target is not.
        let mut stepped = base.clone();
        stepped.usage[0].latency_p99_us = 1_800;
        stepped.usage[0].latency_steps = 40;
        stepped.usage[0].latency_violations = 2;
        assert!(only_usage_moved(&base, &stepped));
        let mut retargeted = base.clone();
        retargeted.usage[0].latency_target_us = 1_500;
        assert!(!only_usage_moved(&base, &retargeted));
        // A redistributed tenant's progress rate is a measurement; its cap is not.
        let mut followed = base.clone();
        followed.usage[0].sm_cap_permille = 1_000;
        assert!(
            !only_usage_moved(&base, &followed),
            "joined the redistribution"
        );
        let mut progressed = followed.clone();
        progressed.usage[0].progress_per_s = 12.5;
        assert!(only_usage_moved(&followed, &progressed));
        let mut capped = progressed.clone();
        capped.usage[0].sm_cap_permille = 625;
        assert!(!only_usage_moved(&progressed, &capped));
    }
}
