//! Tests of the closed loop against real schedule files in a temporary directory, written the
//! way tenant processes write them (`tenant_abi::writer`, `compute::Schedule`).

use super::*;
use std::sync::atomic::Ordering::Relaxed;
use tenant_abi::ProcLiveness;
use tenant_abi::compute::{Member, QUANTUM_NS_DEFAULT, Region, Schedule, TenantConfig};
use tenant_abi::control::DECISION_TTL_NS;

const MS: u64 = 1_000_000;
/// A start far from 0, like a real CLOCK_MONOTONIC.
const T0: u64 = 1_000_000 * MS;

const SHARE: TenantConfig = TenantConfig {
    share_pct: 50,
    burst: true,
    guaranteed: true,
    priority: 0,
};

fn latency(target_ns: Option<u64>) -> BTreeMap<String, LatencySpec> {
    BTreeMap::from([("infer".to_owned(), LatencySpec { target_ns })])
}

/// A node with GPU-0's schedule, the latency tenant `infer` and the neighbour `train` joined.
struct Node {
    _directory: tempfile::TempDir,
    shm_dir: PathBuf,
    /// The schedule as the tenants map it (leaked, as it lives as long as the test process).
    region: &'static Region,
    infer: Member,
    train: Member,
}

impl Node {
    fn new(now_ns: u64) -> Node {
        let directory = tempfile::tempdir().unwrap();
        let shm_dir = directory.path().join("shm");
        let layout = crate::private::Layout::new(&shm_dir);
        let mapping =
            tenant_abi::writer::schedule(&layout.schedule("GPU-0"), QUANTUM_NS_DEFAULT).unwrap();
        let region: &'static Region = Box::leak(Box::new(mapping)).region();
        let schedule = Schedule::new(region, ProcLiveness);
        let (pid, start_time) = (std::process::id(), tenant_abi::ledger::own_start_time());
        let infer = schedule
            .join("infer", SHARE, pid, start_time, now_ns)
            .unwrap();
        let train = schedule
            .join("train", SHARE, pid, start_time, now_ns)
            .unwrap();
        Node {
            _directory: directory,
            shm_dir,
            region,
            infer,
            train,
        }
    }

    fn config(&self) -> ClosedLoopConfig {
        ClosedLoopConfig {
            shm_dir: self.shm_dir.clone(),
            mps: false,
            sm_counts: BTreeMap::new(),
            redistribute: None,
            period: PERIOD_DEFAULT,
            neighbour_window: NEIGHBOUR_WINDOW_DEFAULT,
        }
    }

    /// `infer` finishes steps of these latencies; `train` launches at `now_ns`.
    fn period(&self, latencies_ns: &[u64], now_ns: u64) {
        let region = self.region;
        for &latency in latencies_ns {
            region.control.record_step(self.infer.tenant, latency);
        }
        Schedule::new(region, ProcLiveness).demand(&self.train, now_ns);
    }

    /// The decision the tenants read at `now_ns`.
    fn decision(&self, now_ns: u64) -> Decision {
        self.region.control.decision(now_ns)
    }
}

#[test]
fn a_gpu_with_a_latency_tenant_gets_a_decision_every_period() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let mut closed_loop = ClosedLoop::new(node.config());

    // First sight: the histogram is the reference, no steps yet: nothing restricted.
    node.period(&[MS], T0);
    let published = closed_loop.tick(&shared, T0);
    assert_eq!(
        published,
        BTreeMap::from([("GPU-0".to_owned(), Decision::default())])
    );
    assert_eq!(node.region.control.decision_ns.load(Relaxed), T0);

    // Four steps over the 2 ms target beside a busy neighbour: over budget, one level up
    // (no MPS: the first in-flight cap).
    let t1 = T0 + 10 * MS;
    node.period(&[3 * MS; 4], t1);
    let published = closed_loop.tick(&shared, t1);
    let expected = Decision {
        inflight: 8,
        level: 1,
        ..Decision::default()
    };
    assert_eq!(published["GPU-0"], expected);
    assert_eq!(node.decision(t1), expected);
    let status = &shared.statuses()["infer"];
    assert_eq!((status.steps, status.violations), (4, 4));
    assert_eq!(status.target_ns, Some(2 * MS));

    // Republished every period, so it stays in force; a stopped agent's expires.
    let t2 = t1 + 10 * MS;
    node.period(&[MS], t2);
    closed_loop.tick(&shared, t2);
    assert_eq!(node.decision(t2 + DECISION_TTL_NS), expected);
    assert_eq!(node.decision(t2 + DECISION_TTL_NS + 1), Decision::default());
}

#[test]
fn a_latency_step_still_open_past_its_target_counts_before_it_ends() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let mut closed_loop = ClosedLoop::new(node.config());
    node.period(&[], T0);
    closed_loop.tick(&shared, T0);
    // A step opened 5 ms before the period's end and has not ended: one violation already.
    let t1 = T0 + 10 * MS;
    node.region.control.open_step(t1 - 5 * MS);
    node.period(&[], t1);
    closed_loop.tick(&shared, t1);
    let status = &shared.statuses()["infer"];
    assert_eq!((status.steps, status.violations), (0, 1));
    // It ends, 12 ms long: the same step, not counted again.
    let t2 = t1 + 10 * MS;
    node.region.control.close_step(t2 - 3 * MS);
    node.period(&[12 * MS], t2);
    closed_loop.tick(&shared, t2);
    let status = &shared.statuses()["infer"];
    assert_eq!((status.steps, status.violations), (1, 1));
}

#[test]
fn tenants_that_are_not_latency_tenants_get_no_controller() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    let mut closed_loop = ClosedLoop::new(node.config());
    node.period(&[3 * MS; 4], T0);
    assert_eq!(closed_loop.tick(&shared, T0), BTreeMap::new());
    assert!(shared.statuses().is_empty());
    let stamp = node.region.control.decision_ns.load(Relaxed);
    assert_eq!(stamp, 0, "nothing published");
}

#[test]
fn a_latency_tenant_that_leaves_the_assignments_releases_its_gpu() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let mut closed_loop = ClosedLoop::new(node.config());
    node.period(&[], T0);
    closed_loop.tick(&shared, T0);
    let t1 = T0 + 10 * MS;
    node.period(&[3 * MS; 4], t1);
    closed_loop.tick(&shared, t1);
    assert!(node.decision(t1).restricts());

    shared.set_tenants(BTreeMap::new());
    let t2 = t1 + 10 * MS;
    assert_eq!(closed_loop.tick(&shared, t2), BTreeMap::new());
    assert_eq!(node.decision(t2), Decision::default());
    assert!(shared.statuses().is_empty());
}

#[test]
fn a_latency_tenant_missing_from_the_live_slots_for_an_instant_is_not_forgotten() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let mut closed_loop = ClosedLoop::new(node.config());
    node.period(&[], T0);
    closed_loop.tick(&shared, T0);
    let mut now = T0 + 10 * MS;
    node.period(&[3 * MS; 4], now);
    closed_loop.tick(&shared, now);
    let restricted = node.decision(now);
    assert!(restricted.restricts());
    let steps = shared.statuses()["infer"].steps;

    // The slot reads as not live (as while a process checks it in `reclaim_tenants`) for a few
    // periods: the decision in force stays, and so does what the controller knows of `infer`.
    let slot = &node.region.tenants[node.infer.tenant].state;
    let live = slot.load(Relaxed);
    slot.store(live | 1 << 40, Relaxed);
    for _ in 0..3 {
        now += 10 * MS;
        node.period(&[], now);
        assert_eq!(closed_loop.tick(&shared, now), BTreeMap::new());
        assert_eq!(node.decision(now), restricted);
    }
    slot.store(live, Relaxed);
    now += 10 * MS;
    node.period(&[3 * MS; 4], now);
    closed_loop.tick(&shared, now);
    assert!(node.decision(now).restricts());
    assert_eq!(shared.statuses()["infer"].steps, steps + 4);

    // Missing for longer than TENANT_GONE_NS: forgotten, and the GPU released.
    slot.store(live | 1 << 40, Relaxed);
    let since = now + 10 * MS;
    while now < since + TENANT_GONE_NS {
        now += 10 * MS;
        node.period(&[], now);
        closed_loop.tick(&shared, now);
    }
    assert_eq!(node.decision(now), Decision::default());
    slot.store(live, Relaxed);
}

#[test]
fn files_that_are_not_schedules_are_skipped_or_logged_without_stopping_the_others() {
    let node = Node::new(T0);
    let gpus = node.shm_dir.join("gpus");
    std::fs::write(gpus.join("GPU-1.compute"), b"short").unwrap();
    std::fs::write(gpus.join("GPU-2.compute.tmp.42"), b"").unwrap();
    std::fs::write(gpus.join("notes"), b"").unwrap();
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(None));
    let mut closed_loop = ClosedLoop::new(node.config());
    let published = closed_loop.tick(&shared, T0);
    assert_eq!(published.keys().collect::<Vec<_>>(), ["GPU-0"]);
    assert_eq!(closed_loop.logged.len(), 1, "{:?}", closed_loop.logged);
    assert!(closed_loop.logged.contains_key(&gpus.join("GPU-1.compute")));
    // Listed again after the rescan period: logged once still, and GPU-0 kept.
    let later = T0 + RESCAN_NS;
    assert_eq!(closed_loop.tick(&shared, later).len(), 1);
    assert_eq!(closed_loop.logged.len(), 1);
}

#[test]
fn statuses_of_a_tenant_on_two_gpus_add_up() {
    let status = |p99_ns: u64, steps: u64| TenantStatus {
        name: "infer".into(),
        target_ns: Some(2 * MS),
        baseline_p99_ns: None,
        p50_ns: Some(p99_ns / 2),
        p99_ns: Some(p99_ns),
        steps,
        violations: steps / 10,
    };
    let mut statuses = BTreeMap::new();
    merge_status(&mut statuses, status(3 * MS, 100));
    merge_status(&mut statuses, status(5 * MS, 50));
    merge_status(&mut statuses, status(MS, 20));
    assert_eq!(
        statuses["infer"],
        TenantStatus {
            p50_ns: Some(5 * MS / 2),
            p99_ns: Some(5 * MS),
            steps: 170,
            violations: 17,
            ..status(0, 0)
        }
    );
}

#[test]
fn the_thread_publishes_and_stops_when_its_handle_is_dropped() {
    let node = Node::new(monotonic_ns());
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let handle = spawn(node.config(), shared.clone());
    // Wait (bounded) for the first period's decision and status.
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared.statuses().is_empty() {
        assert!(Instant::now() < deadline, "no period ran");
        std::thread::yield_now();
    }
    let stamp = node.region.control.decision_ns.load(Relaxed);
    assert!(stamp > 0);
    let dropped = Instant::now();
    drop(handle);
    assert!(dropped.elapsed() < JOIN_WAIT);
    let stopped_at = node.region.control.decision_ns.load(Relaxed);
    // No period after the handle is gone: the stamp stays.
    let deadline = Instant::now() + 3 * PERIOD_DEFAULT;
    while Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(node.region.control.decision_ns.load(Relaxed), stopped_at);
}

#[test]
fn the_target_is_published_for_the_tenants_exact_counts() {
    let node = Node::new(T0);
    let shared = ClosedLoopShared::new();
    shared.set_tenants(latency(Some(2 * MS)));
    let mut closed_loop = ClosedLoop::new(node.config());
    node.period(&[MS], T0);
    closed_loop.tick(&shared, T0);
    let slot = node.infer.tenant;
    assert_eq!(
        node.region.control.latency[slot].target_ns.load(Relaxed),
        2 * MS
    );
    // The first window after the target was published began before it (its count mixes no
    // target and this one): the histogram judges it.
    let t1 = T0 + 10 * MS;
    node.period(&[2_040_000], t1);
    closed_loop.tick(&shared, t1);
    assert_eq!(shared.statuses()["infer"].violations, 0);
    // Steps of 2.04 ms share the 2 ms target's histogram bucket (1.792-2.048 ms): the tenant's
    // processes count them over the published target, and the controller takes that count.
    let t2 = t1 + 10 * MS;
    node.period(&[2_040_000; 4], t2);
    closed_loop.tick(&shared, t2);
    let status = &shared.statuses()["infer"];
    assert_eq!((status.steps, status.violations), (5, 4));
}

/// Two best-effort tenants sharing GPU-0 under MPS, as their interposers write the file: each
/// period both launch (demand) and count steps at a rate that depends on the SM cap of `loop`
/// the file holds (`loop` is bandwidth-bound: 40 of its SMs do its work; `gemm` gets the rest).
struct Pair {
    node: Node,
    gemm: Member,
    bandwidth: Member,
    carried: [f64; 2],
}

const BEST_EFFORT: TenantConfig = TenantConfig {
    share_pct: 25,
    burst: true,
    guaranteed: false,
    priority: 0,
};

impl Pair {
    fn new() -> Pair {
        let node = Node::new(T0);
        let schedule = Schedule::new(node.region, ProcLiveness);
        let (pid, start_time) = (std::process::id(), tenant_abi::ledger::own_start_time());
        let gemm = schedule
            .join("gemm", BEST_EFFORT, pid, start_time, T0)
            .unwrap();
        let bandwidth = schedule
            .join("loop", BEST_EFFORT, pid, start_time, T0)
            .unwrap();
        Pair {
            node,
            gemm,
            bandwidth,
            carried: [0.0; 2],
        }
    }

    fn config(&self) -> ClosedLoopConfig {
        ClosedLoopConfig {
            redistribute: Some(sharing::RedistributeConfig {
                period_min_ns: 100 * MS,
                period_max_ns: 800 * MS,
                settle_ns: 20 * MS,
                ..sharing::RedistributeConfig::default()
            }),
            ..self.node.config()
        }
    }

    /// One period at `now_ns`: both launch and make progress under the caps in the file.
    fn period(&mut self, now_ns: u64) {
        let region = self.node.region;
        let cap = f64::from(
            region
                .control
                .cap(self.bandwidth.tenant, now_ns)
                .unwrap_or(128),
        );
        // Side by side, nested caps: `loop` shares its `cap` with `gemm`, which has the rest
        // alone. Taking turns, each runs alone half the time, whatever the caps.
        let sides = region.control.side_by_side(self.bandwidth.tenant, now_ns)
            && region.control.side_by_side(self.gemm.tenant, now_ns);
        let (loop_speed, gemm_speed) = if sides {
            ((cap / 2.0).min(40.0) / 40.0, (128.0 - cap / 2.0) / 128.0)
        } else {
            (0.5, 0.5)
        };
        let schedule = Schedule::new(region, ProcLiveness);
        for (i, (member, speed)) in [(&self.gemm, gemm_speed), (&self.bandwidth, loop_speed)]
            .into_iter()
            .enumerate()
        {
            schedule.demand(member, now_ns);
            self.carried[i] += 3.0 * speed;
            let whole = self.carried[i].floor();
            self.carried[i] -= whole;
            region.count_steps(member.tenant, whole as u64);
        }
    }
}

#[test]
fn on_an_mps_node_a_bandwidth_bound_tenant_is_capped_in_the_file_and_uncapped_when_it_stops() {
    let mut pair = Pair::new();
    let shared = ClosedLoopShared::new();
    let mut closed_loop = ClosedLoop::new(pair.config());
    let mut now = T0;
    for _ in 0..6_000 {
        now += 10 * MS;
        pair.period(now);
        closed_loop.tick(&shared, now);
    }
    let control = &pair.node.region.control;
    // Side by side first (it does half a tenant's work more than taking turns), then the cap.
    assert!(control.side_by_side(pair.bandwidth.tenant, now));
    assert!(control.side_by_side(pair.gemm.tenant, now));
    let cap = control.cap(pair.bandwidth.tenant, now);
    assert!(
        matches!(cap, Some(64..=96)),
        "the bandwidth-bound tenant keeps 64-96 of 128: {cap:?}"
    );
    assert_eq!(
        control.cap(pair.gemm.tenant, now),
        None,
        "one stays uncapped"
    );
    // `loop` stops launching: its periods have no progress (unmeasured) and after the member
    // window it leaves the group; its cap is cleared in the file (not left to expire).
    let stop = now;
    while now < stop + crate::redistribution::MEMBER_LEAVE_NS + 20 * MS {
        now += 10 * MS;
        Schedule::new(pair.node.region, ProcLiveness).demand(&pair.gemm, now);
        closed_loop.tick(&shared, now);
    }
    assert_eq!(control.cap(pair.bandwidth.tenant, now), None);
    let cleared = control.caps_ns.load(Relaxed);
    assert!(
        cleared > stop,
        "cleared after it stopped, not left to expire: {cleared}"
    );
    assert_eq!(control.cap(pair.bandwidth.tenant, cleared), None);
    // And back to turns, published at once (not left to lapse).
    assert!(!control.side_by_side(pair.gemm.tenant, now));
    assert!(control.side_by_side_ns.load(Relaxed) > stop);
}

#[test]
fn without_mps_or_beside_latency_tenants_only_best_effort_tenants_are_redistributed() {
    // Off (no MPS): nothing is written.
    let mut pair = Pair::new();
    let shared = ClosedLoopShared::new();
    let mut closed_loop = ClosedLoop::new(pair.node.config());
    let mut now = T0;
    for _ in 0..2_000 {
        now += 10 * MS;
        pair.period(now);
        closed_loop.tick(&shared, now);
    }
    assert_eq!(pair.node.region.control.caps_ns.load(Relaxed), 0);
    // On, with `loop` a latency tenant: one member left, nothing to share.
    let mut closed_loop = ClosedLoop::new(pair.config());
    shared.set_tenants(BTreeMap::from([(
        "loop".to_owned(),
        LatencySpec::default(),
    )]));
    for _ in 0..2_000 {
        now += 10 * MS;
        pair.period(now);
        closed_loop.tick(&shared, now);
    }
    assert_eq!(pair.node.region.control.caps_ns.load(Relaxed), 0);
}
