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
