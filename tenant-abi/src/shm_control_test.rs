//! Tests of `ScheduleControl`, the agent's read-write handle on a GPU's schedule file, against
//! real files written the way tenant processes write them (`crate::writer`, `compute::Schedule`).

use super::*;
use crate::compute::{Schedule, TenantConfig};
use crate::control::{DECISION_TTL_NS, Decision};

const CONFIG: TenantConfig = TenantConfig {
    share_pct: 50,
    burst: true,
    guaranteed: true,
    priority: 0,
};

#[test]
fn only_an_existing_initialised_file_of_this_layout_opens() {
    let directory = tempfile::tempdir().unwrap();
    let missing = directory.path().join("GPU-0.compute");
    assert!(
        ScheduleControl::open(&missing)
            .err()
            .unwrap()
            .is_not_found()
    );
    assert!(!missing.exists(), "never created");

    let short = directory.path().join("short.compute");
    std::fs::write(&short, [0u8; 64]).unwrap();
    assert!(matches!(
        ScheduleControl::open(&short),
        Err(ReadError::Size { found: 64, .. })
    ));

    let blank = directory.path().join("blank.compute");
    std::fs::File::create(&blank)
        .unwrap()
        .set_len(compute::REGION_BYTES as u64)
        .unwrap();
    assert!(matches!(
        ScheduleControl::open(&blank),
        Err(ReadError::Uninitialised { .. })
    ));

    let made = directory.path().join("made.compute");
    assert!(create_schedule(&made, compute::QUANTUM_NS_DEFAULT).unwrap());
    let control = ScheduleControl::open(&made).unwrap();
    assert_eq!(control.path(), made);
    assert!(control.latency_tenants().is_empty());
}

#[test]
fn live_tenants_come_with_their_slot_and_histogram() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-0.compute");
    let mapping = crate::writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let schedule = Schedule::new(mapping.region(), ProcLiveness);
    let (pid, start_time) = (std::process::id(), ledger::own_start_time());
    let train = schedule
        .join("train", CONFIG, pid, start_time, 1_000)
        .unwrap();
    let infer = schedule
        .join("infer", CONFIG, pid, start_time, 1_000)
        .unwrap();
    assert_ne!(train.tenant, infer.tenant);
    let control = &mapping.region().control;
    control.record_step(infer.tenant, 2_000_000);
    control.record_step(infer.tenant, 3_000_000);

    let agent = ScheduleControl::open(&path).unwrap();
    let tenants = agent.latency_tenants();
    let slots: Vec<(usize, &str, u64)> = tenants
        .iter()
        .map(|(slot, name, histogram)| (*slot, name.as_str(), histogram.steps))
        .collect();
    assert_eq!(
        slots,
        [(train.tenant, "train", 0), (infer.tenant, "infer", 2)]
    );
    assert_eq!(tenants[1].2.total_ns, 5_000_000);
    assert_eq!(tenants[1].2, control.latency(infer.tenant));

    // A slot that is freed keeps its old name but is no longer live.
    mapping.region().tenants[train.tenant]
        .state
        .store(0, std::sync::atomic::Ordering::SeqCst);
    let names: Vec<String> = agent
        .latency_tenants()
        .into_iter()
        .map(|(_, name, _)| name)
        .collect();
    assert_eq!(names, ["infer"]);
}

#[test]
fn neighbours_are_active_while_their_demand_stamps_are_fresh() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-0.compute");
    let mapping = crate::writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let schedule = Schedule::new(mapping.region(), ProcLiveness);
    let (pid, start_time) = (std::process::id(), ledger::own_start_time());
    let infer = schedule
        .join("infer", CONFIG, pid, start_time, 1_000)
        .unwrap();
    let train = schedule
        .join("train", CONFIG, pid, start_time, 1_000)
        .unwrap();
    let agent = ScheduleControl::open(&path).unwrap();
    let is_latency = |name: &str| name == "infer";
    let window_ns = 100_000_000;

    // Joining stamps demand: fresh for a window, stale after.
    assert!(agent.neighbours_active(50_000_000, window_ns, is_latency));
    assert!(!agent.neighbours_active(200_000_000, window_ns, is_latency));
    schedule.demand(&train, 300_000_000);
    assert!(agent.neighbours_active(350_000_000, window_ns, is_latency));
    // The latency tenant's own stamps never count.
    schedule.demand(&infer, 900_000_000);
    assert!(!agent.neighbours_active(950_000_000, window_ns, is_latency));
    assert!(agent.neighbours_active(950_000_000, window_ns, |_| false));
}

#[test]
fn a_published_decision_is_what_tenants_read_until_it_expires() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-0.compute");
    let mapping = crate::writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let agent = ScheduleControl::open(&path).unwrap();
    let decision = Decision {
        sms: 48,
        inflight: 2,
        pause: false,
        level: 9,
        ..Decision::default()
    };
    assert_eq!(agent.decision(1_000), Decision::default());
    agent.publish(decision, 1_000);
    let tenants_view = &mapping.region().control;
    assert_eq!(tenants_view.decision(2_000), decision);
    assert_eq!(agent.decision(2_000), decision);
    assert_eq!(
        tenants_view.decision(1_001 + DECISION_TTL_NS),
        Decision::default()
    );
    // Through a read-only mapping too (the file, not a copy).
    let reader = map::ReadOnly::<compute::Region>::open(&path, compute::REGION_BYTES).unwrap();
    assert_eq!(reader.region().control.decision(2_000), decision);
}

/// Two always-busy tenants' processes launching through the protocol on one GPU, with a tick
/// of 100 µs, until `handovers` more turns have been handed over; returns each tenant's turn
/// time charged meanwhile (`TenantSlot::used_ns`), in ns.
fn run_turns(
    region: &compute::Region,
    members: &[compute::Member],
    now_ns: &mut u64,
    handovers: u64,
) -> Vec<u64> {
    use std::sync::atomic::Ordering::SeqCst;
    let schedule = Schedule::new(region, ProcLiveness);
    let used = |member: &compute::Member| region.tenants[member.tenant].used_ns.load(SeqCst);
    let before: Vec<u64> = members.iter().map(used).collect();
    let target = region.header.handovers.load(SeqCst) + handovers;
    let mut ticks = 0u64;
    while region.header.handovers.load(SeqCst) < target {
        ticks += 1;
        assert!(ticks < 1_000_000, "the turns stopped moving");
        *now_ns += 100_000;
        let count = members.len();
        for k in 0..count {
            let member = &members[(k + ticks as usize) % count];
            if schedule.fast_ok(member, *now_ns) {
                schedule.demand(member, *now_ns);
                continue;
            }
            match schedule.step(member, *now_ns) {
                compute::Step::Go { contended: true } => schedule.mark_busy(member, *now_ns),
                compute::Step::Go { contended: false } | compute::Step::Wait => {}
                // The simulated kernels end within the tick.
                compute::Step::Drain => schedule.drained(member),
            }
        }
    }
    members
        .iter()
        .zip(before)
        .map(|(member, before)| used(member) - before)
        .collect()
}

fn split_percent(used: &[u64]) -> Vec<f64> {
    let total: u64 = used.iter().sum();
    assert!(total > 0);
    used.iter()
        .map(|&ns| ns as f64 * 100.0 / total as f64)
        .collect()
}

#[test]
fn a_share_set_by_the_agent_moves_the_running_tenants_split_within_a_few_turns() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-0.compute");
    let mapping = crate::writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let region = mapping.region();
    let schedule = Schedule::new(region, ProcLiveness);
    let (pid, start_time) = (std::process::id(), ledger::own_start_time());
    let share = |share_pct| TenantConfig {
        share_pct,
        burst: false,
        guaranteed: true,
        priority: 0,
    };
    let mut now_ns = 1_000;
    let train = schedule
        .join("train", share(70), pid, start_time, now_ns)
        .unwrap();
    let infer = schedule
        .join("infer", share(30), pid, start_time, now_ns)
        .unwrap();
    let members = [train, infer];
    let split = split_percent(&run_turns(region, &members, &mut now_ns, 100));
    assert!((split[0] - 70.0).abs() <= 3.0, "before: {split:?}");

    // `vgpuctl set tenant train --compute 30`, `... infer --compute 70 --priority 2`.
    let agent = ScheduleControl::open(&path).unwrap();
    assert_eq!(
        agent.set_share("train", 30, 0),
        Some((share(70), share(30)))
    );
    let (old, new) = agent.set_share("infer", 70, 2).unwrap();
    assert_eq!((old, new.share_pct, new.priority), (share(30), 70, 2));
    assert_eq!(agent.tenant_config("infer"), Some(new));
    // The members keep what they joined with; only their slots' config words changed.
    assert_eq!(members, [train, infer]);

    // A few turns to settle (the virtual times charged at the old weights), then the new split.
    let settling = run_turns(region, &members, &mut now_ns, 4);
    assert_eq!(settling.len(), 2);
    let split = split_percent(&run_turns(region, &members, &mut now_ns, 100));
    assert!((split[0] - 30.0).abs() <= 3.0, "after: {split:?}");
    assert!((split[1] - 70.0).abs() <= 3.0, "after: {split:?}");
}

#[test]
fn setting_a_share_keeps_the_slots_flags_and_needs_a_live_slot() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-0.compute");
    let mapping = crate::writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let agent = ScheduleControl::open(&path).unwrap();
    // No process has joined: nothing to change, and nothing is created.
    assert_eq!(agent.set_share("train", 40, 1), None);
    assert_eq!(agent.tenant_config("train"), None);

    let schedule = Schedule::new(mapping.region(), ProcLiveness);
    let (pid, start_time) = (std::process::id(), ledger::own_start_time());
    let best_effort = TenantConfig {
        share_pct: 25,
        burst: true,
        guaranteed: false,
        priority: -3,
    };
    let train = schedule
        .join("train", best_effort, pid, start_time, 1_000)
        .unwrap();
    assert_eq!(agent.tenant_config("train"), Some(best_effort));
    let raised = TenantConfig {
        share_pct: 100,
        priority: 7,
        ..best_effort
    };
    assert_eq!(
        agent.set_share("train", 250, 7),
        Some((best_effort, raised))
    );
    assert_eq!(agent.tenant_config("train"), Some(raised));
    // The same values again store nothing and report no difference.
    assert_eq!(agent.set_share("train", 100, 7), Some((raised, raised)));
    assert_eq!(agent.set_share("other", 10, 0), None);

    // The remaining race: a process joining later with a stale environment stores the config
    // it was started with, over the agent's (the agent writes the environment first, so only a
    // process started before the change but joining after it does this).
    schedule
        .join("train", best_effort, pid, start_time, 2_000)
        .unwrap();
    assert_eq!(agent.tenant_config("train"), Some(best_effort));

    // A freed slot keeps its name but is no longer changed.
    mapping.region().tenants[train.tenant]
        .state
        .store(0, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(agent.set_share("train", 50, 0), None);
}
