//! Tests of the schedule protocol: the weights, slot claiming, and a simulated GPU on which
//! simulated processes launch kernels through the protocol, as the interposer does.

use super::*;
use crate::ledger::test_liveness::Fake;

const MS: u64 = 1_000_000;

fn region() -> Box<Region> {
    let region = Region::new_boxed();
    region.initialise(QUANTUM_NS_DEFAULT);
    region.check_layout().unwrap();
    region
}

fn guaranteed(share_pct: u32) -> TenantConfig {
    TenantConfig {
        share_pct,
        burst: false,
        guaranteed: true,
        priority: 0,
    }
}

fn config(share_pct: u32, burst: bool, guaranteed: bool, priority: i32) -> TenantConfig {
    TenantConfig {
        share_pct,
        burst,
        guaranteed,
        priority,
    }
}

#[test]
fn configs_and_turns_round_trip() {
    for c in [
        config(1, false, false, -1000),
        config(100, true, true, 1000),
        config(37, true, false, 0),
    ] {
        assert_eq!(TenantConfig::unpack(c.pack()), c);
    }
    for t in [
        Turn::NONE,
        Turn {
            owner: OWNER_IDLE,
            start_us: 5,
        },
        Turn {
            owner: 31,
            start_us: START_MASK_US,
        },
    ] {
        assert_eq!(Turn::unpack(t.pack()), t);
    }
    assert_eq!(name_words("ab")[0], u64::from_le_bytes(*b"ab\0\0\0\0\0\0"));
}

#[test]
fn weights_guarantee_then_best_effort_by_priority_then_burst() {
    let w = |active: &[(usize, TenantConfig)]| weights(active);
    // Shares of guaranteed tenants, the rest idle without burst.
    assert_eq!(
        w(&[(0, guaranteed(70)), (1, guaranteed(20))]),
        (vec![(0, 700_000), (1, 200_000)], 100_000)
    );
    // A non-burst tenant alone is capped at its share.
    assert_eq!(w(&[(3, guaranteed(30))]), (vec![(3, 300_000)], 700_000));
    // A burst tenant alone gets everything.
    assert_eq!(w(&[(3, config(30, true, true, 0))]), (vec![(3, PPM)], 0));
    // Idle time goes to the burst tenants of the highest priority only.
    assert_eq!(
        w(&[
            (0, config(30, true, false, 5)),
            (1, config(30, true, false, 0)),
        ]),
        (vec![(0, 700_000), (1, 300_000)], 0)
    );
    assert_eq!(
        w(&[
            (0, config(20, true, true, 1)),
            (1, config(20, true, true, 1)),
            (2, guaranteed(20)),
        ]),
        (vec![(0, 400_000), (1, 400_000), (2, 200_000)], 0)
    );
    // Overcommitted best effort: guarantees first, then higher priority first.
    assert_eq!(
        w(&[
            (0, guaranteed(80)),
            (1, config(50, false, false, 0)),
            (2, config(50, false, false, 1)),
        ]),
        (vec![(0, 800_000), (1, 0), (2, 200_000)], 0)
    );
    // Guarantees past 100% (a hand-set environment) are scaled down together.
    assert_eq!(
        w(&[(0, guaranteed(100)), (1, guaranteed(100))]),
        (vec![(0, 500_000), (1, 500_000)], 0)
    );
    assert_eq!(w(&[]), (vec![], 0));
}

#[test]
fn processes_of_a_tenant_share_one_slot_and_slots_are_reused() {
    let region = region();
    let live = Fake::with(&[10, 11, 12, 13]);
    let s = Schedule::new(&region, &live);
    let a1 = s.join("a", guaranteed(70), 10, 1, 0).unwrap();
    let a2 = s.join("a", guaranteed(70), 11, 1, 0).unwrap();
    let b = s.join("b", guaranteed(30), 12, 1, 0).unwrap();
    assert_eq!(a1.tenant, a2.tenant);
    assert_ne!(a1.proc, a2.proc);
    assert_ne!(a1.tenant, b.tenant);
    // Fill the table with other tenants; the next one is refused while everyone lives.
    let mut pid = 100;
    for i in 0..TENANTS - 2 {
        live.add(pid);
        s.join(&format!("t{i}"), guaranteed(1), pid, 1, 0).unwrap();
        pid += 1;
    }
    live.add(pid);
    assert!(s.join("late", guaranteed(1), pid, 1, 0).is_err());
    // b's only process dies: its slot is reclaimed for the newcomer.
    live.kill(12);
    let late = s.join("late", guaranteed(1), pid, 1, 0).unwrap();
    assert_eq!(late.tenant, b.tenant);
    // a keeps its slot while one of its processes lives.
    live.kill(10);
    live.add(pid + 1);
    assert!(s.join("later", guaranteed(1), pid + 1, 1, 0).is_err());
    assert_eq!(
        s.join("a", guaranteed(70), 13, 1, 0).unwrap().tenant,
        a1.tenant
    );
}

#[test]
fn racing_joins_of_one_tenant_agree_on_its_slot() {
    for _ in 0..50 {
        let region = region();
        let pids: Vec<u32> = (1..=8).collect();
        let live = Fake::with(&pids);
        let s = Schedule::new(&region, &live);
        let tenants: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = pids
                .iter()
                .map(|&pid| {
                    let s = &s;
                    scope.spawn(move || s.join("same", guaranteed(50), pid, 1, 0).unwrap().tenant)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(tenants.iter().all(|&t| t == tenants[0]), "{tenants:?}");
        let live_slots = region
            .tenants
            .iter()
            .filter(|t| phase_of(t.state.load(SeqCst)) != PHASE_FREE)
            .count();
        assert_eq!(live_slots, 1);
    }
}

/// A simulated process: launches kernels of `kernel_ns` back to back, as fast as the protocol
/// lets it, with at most `depth` kernels queued (the interposer's event bound).
struct SimProc {
    member: Member,
    kernel_ns: u64,
    depth: usize,
    queued: Vec<u64>,
    from_ns: u64,
    until_ns: u64,
    longest_wait_ns: u64,
    first_wait_ns: Option<u64>,
    waiting_since: Option<u64>,
    /// Windows `[from, until)` in which the process makes no call at all (blocked outside the
    /// gate: a synchronisation, CPU work, elastic memory's line), whatever it held.
    blocked: Vec<(u64, u64)>,
}

/// A GPU that runs kernels one at a time in launch order (across processes), and a clock.
struct Sim<'r, 'l> {
    schedule: Schedule<'r, &'l Fake>,
    busy_until_ns: u64,
    procs: Vec<SimProc>,
    /// Per tenant: GPU time its kernels ran inside `window`.
    used_ns: Vec<u64>,
    window: (u64, u64),
    live: &'l Fake,
}

impl<'r, 'l> Sim<'r, 'l> {
    fn new(region: &'r Region, live: &'l Fake, window: (u64, u64)) -> Self {
        Sim {
            schedule: Schedule::new(region, live),
            busy_until_ns: 0,
            procs: Vec::new(),
            used_ns: vec![0; TENANTS],
            window,
            live,
        }
    }

    fn add(&mut self, pid: u32, tenant: &str, c: TenantConfig, from_ns: u64, until_ns: u64) {
        self.live.add(pid);
        let member = self.schedule.join(tenant, c, pid, 1, from_ns).unwrap();
        self.procs.push(SimProc {
            member,
            kernel_ns: MS,
            depth: 3,
            queued: Vec::new(),
            from_ns,
            until_ns,
            longest_wait_ns: 0,
            first_wait_ns: None,
            waiting_since: None,
            blocked: Vec::new(),
        });
    }

    fn run(&mut self, until_ns: u64, tick_ns: u64) {
        let mut now = 0;
        let mut rotate = 0;
        while now < until_ns {
            let n = self.procs.len();
            for k in 0..n {
                let i = (k + rotate) % n;
                self.act(i, now);
            }
            rotate += 1;
            now += tick_ns;
        }
    }

    fn act(&mut self, i: usize, now: u64) {
        let p = &mut self.procs[i];
        if now < p.from_ns || now >= p.until_ns || !self.live.contains(p.member.pid) {
            return;
        }
        if p.blocked
            .iter()
            .any(|&(from, until)| from <= now && now < until)
        {
            // Not waiting for the gate meanwhile: its wait starts again when it calls.
            p.waiting_since = None;
            return;
        }
        p.queued.retain(|&end| end > now);
        if p.queued.len() >= p.depth {
            return;
        }
        let s = &self.schedule;
        let go = if s.fast_ok(&p.member, now) {
            s.demand(&p.member, now);
            true
        } else {
            match s.step(&p.member, now) {
                Step::Go { contended } => {
                    if contended {
                        s.mark_busy(&p.member, now);
                    }
                    true
                }
                Step::Drain => {
                    if p.queued.is_empty() {
                        s.drained(&p.member);
                    }
                    false
                }
                Step::Wait => false,
            }
        };
        if !go {
            p.waiting_since.get_or_insert(now);
            return;
        }
        if p.first_wait_ns.is_none() {
            p.first_wait_ns = Some(now - p.waiting_since.unwrap_or(now));
        }
        if let Some(since) = p.waiting_since.take() {
            if now - since > p.longest_wait_ns && std::env::var("SIMDEBUG").is_ok() {
                eprintln!(
                    "proc {i} waited {} ms until {} ms",
                    (now - since) / MS,
                    now / MS
                );
            }
            p.longest_wait_ns = p.longest_wait_ns.max(now - since);
        }
        let start = now.max(self.busy_until_ns);
        let end = start + p.kernel_ns;
        self.busy_until_ns = end;
        p.queued.push(end);
        let (w0, w1) = self.window;
        let overlap = end.min(w1).saturating_sub(start.max(w0));
        self.used_ns[p.member.tenant] += overlap;
    }

    /// Each tenant's share of the window, in percent.
    fn shares(&self, tenants: &[usize]) -> Vec<f64> {
        let window = (self.window.1 - self.window.0) as f64;
        tenants
            .iter()
            .map(|&t| self.used_ns[t] as f64 * 100.0 / window)
            .collect()
    }

    fn tenant_of(&self, proc: usize) -> usize {
        self.procs[proc].member.tenant
    }
}

fn assert_close(got: &[f64], want: &[f64], points: f64) {
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= points,
            "got {got:?}, want {want:?} ± {points}"
        );
    }
}

#[test]
fn two_tenants_get_70_30() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (500 * MS, 10_500 * MS));
    sim.add(1, "a", guaranteed(70), 0, u64::MAX);
    sim.add(2, "b", guaranteed(30), 0, u64::MAX);
    sim.run(10_600 * MS, 50_000);
    let shares = sim.shares(&[sim.tenant_of(0), sim.tenant_of(1)]);
    assert_close(&shares, &[70.0, 30.0], 2.0);
}

#[test]
fn four_tenants_get_40_30_20_10_with_several_processes_each() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (500 * MS, 10_500 * MS));
    for (i, (name, share)) in [("a", 40), ("b", 30), ("c", 20), ("d", 10)]
        .into_iter()
        .enumerate()
    {
        sim.add(10 + i as u32, name, guaranteed(share), 0, u64::MAX);
        sim.add(20 + i as u32, name, guaranteed(share), 0, u64::MAX);
    }
    sim.run(10_600 * MS, 50_000);
    let tenants: Vec<usize> = (0..4).map(|i| sim.tenant_of(2 * i)).collect();
    assert_close(&sim.shares(&tenants), &[40.0, 30.0, 20.0, 10.0], 2.0);
}

#[test]
fn a_non_burst_tenant_alone_is_capped_and_a_burst_one_is_not() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (500 * MS, 5_500 * MS));
    sim.add(1, "capped", guaranteed(30), 0, u64::MAX);
    sim.run(5_600 * MS, 50_000);
    assert_close(&sim.shares(&[sim.tenant_of(0)]), &[30.0], 2.0);

    let region = super::tests::region();
    let mut sim = Sim::new(&region, &live, (500 * MS, 5_500 * MS));
    sim.add(2, "bursty", config(30, true, true, 0), 0, u64::MAX);
    sim.run(5_600 * MS, 50_000);
    assert_close(&sim.shares(&[sim.tenant_of(0)]), &[100.0], 1.0);
}

#[test]
fn a_bursting_tenant_gives_the_time_back_within_a_quantum() {
    let region = region();
    let live = Fake::default();
    let arrival = 3_000 * MS;
    let mut sim = Sim::new(&region, &live, (arrival + 500 * MS, arrival + 10_500 * MS));
    sim.add(1, "bursty", config(30, true, true, 0), 0, u64::MAX);
    sim.add(2, "guaranteed", guaranteed(70), arrival, u64::MAX);
    sim.run(arrival + 10_600 * MS, 50_000);
    let shares = sim.shares(&[sim.tenant_of(0), sim.tenant_of(1)]);
    assert_close(&shares, &[30.0, 70.0], 2.0);
    // The newcomer's first launch waited at most one quantum (plus the drain of 3 queued 1 ms
    // kernels and a tick); later, it never waits more than two of the other's turns.
    let first = sim.procs[1].first_wait_ns.expect("the newcomer launched");
    let quantum = sim.schedule.quantum_ns();
    assert!(first <= quantum + 4 * MS, "first wait {first} ns");
    let longest = sim.procs[1].longest_wait_ns;
    assert!(
        longest <= 2 * (quantum + 4 * MS),
        "longest wait {longest} ns"
    );
}

#[test]
fn idle_time_goes_to_the_higher_priority_burst_tenant() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (500 * MS, 10_500 * MS));
    sim.add(1, "high", config(30, true, false, 5), 0, u64::MAX);
    sim.add(2, "low", config(30, true, false, 0), 0, u64::MAX);
    sim.run(10_600 * MS, 50_000);
    let shares = sim.shares(&[sim.tenant_of(0), sim.tenant_of(1)]);
    assert_close(&shares, &[70.0, 30.0], 2.0);
}

#[test]
fn an_idle_owner_is_taken_over_early() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (1_000 * MS, 6_000 * MS));
    // "a" stops launching at 1 s; its guaranteed 50% goes to the burst tenant right away.
    sim.add(1, "a", guaranteed(50), 0, 1_000 * MS);
    sim.add(2, "b", config(50, true, true, 0), 0, u64::MAX);
    sim.run(6_100 * MS, 50_000);
    let shares = sim.shares(&[sim.tenant_of(0), sim.tenant_of(1)]);
    assert_close(&shares, &[0.0, 100.0], 1.5);
}

#[test]
fn a_killed_owner_stalls_the_others_at_most_a_grace_period() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (0, 1));
    sim.add(1, "a", guaranteed(50), 0, u64::MAX);
    sim.add(2, "b", config(50, true, true, 0), 0, u64::MAX);
    // Run until "a" owns the GPU with work queued, then kill it.
    let mut now = 0;
    loop {
        sim.act(0, now);
        sim.act(1, now);
        now += 50_000;
        if now > 500 * MS
            && sim.schedule.turn().owner == sim.tenant_of(0)
            && !sim.procs[0].queued.is_empty()
        {
            break;
        }
    }
    live.kill(1);
    sim.procs[1].longest_wait_ns = 0;
    sim.procs[1].waiting_since = None;
    while now < 2_000 * MS {
        sim.act(1, now);
        now += 50_000;
    }
    let waited = sim.procs[1].longest_wait_ns;
    let bound = sim.schedule.quantum_ns() + sim.schedule.grace_ns() + MS;
    assert!(waited <= bound, "waited {waited} ns > {bound}");
    // Its process slot was reclaimed on the way.
    assert_eq!(region.procs[sim.procs[0].member.proc].pid.load(SeqCst), 0);
}

/// The coverage run's bug: a tenant queued more than a grace period of work and blocked in its
/// own (ungated) synchronize; the waiting tenant took the turn for its silence while those
/// kernels still ran.
#[test]
fn a_silent_live_owner_keeps_its_turn_until_deadline_plus_grace_and_a_dead_one_does_not() {
    let region = region();
    let live = Fake::with(&[1, 2]);
    let s = Schedule::new(&region, &live);
    let a = s.join("a", guaranteed(70), 1, 1, 0).unwrap();
    let b = s.join("b", guaranteed(30), 2, 1, 0).unwrap();
    s.demand(&b, 0);
    assert_eq!(s.step(&a, 0), Step::Go { contended: true });
    s.mark_busy(&a, 0);
    let (quantum, grace) = (s.quantum_ns(), s.grace_ns());
    assert!(
        grace < quantum,
        "the case needs silence past grace before the deadline"
    );
    // "a" queued ~19 ms of work and waits for it, silent.
    for now in [grace + MS, quantum - MS, quantum + grace - MS] {
        assert_eq!(s.step(&b, now), Step::Wait, "at {} ms", now / MS);
        assert_eq!(s.turn().owner, a.tenant);
    }
    let handover = quantum + grace + MS;
    assert_eq!(s.step(&b, handover), Step::Go { contended: true });
    assert_eq!(s.turn().owner, b.tenant);

    // "b" owns the turn with work queued and dies: taken over once idle, long before its
    // deadline.
    s.mark_busy(&b, handover);
    live.kill(2);
    let at = handover + IDLE_GAP_NS;
    assert!(at < handover + quantum);
    assert_eq!(s.step(&a, at - 1), Step::Wait);
    assert_eq!(s.turn().owner, b.tenant);
    // The next turn is "a"'s or an idle one ("a" alone is capped at 70%).
    s.step(&a, at);
    assert_ne!(s.turn().owner, b.tenant);
    assert_eq!(
        region.procs[b.proc].pid.load(SeqCst),
        0,
        "its slot is reclaimed"
    );
}

#[test]
fn latency_stamps_are_fresh_within_the_hold_only() {
    let hold = 50 * MS;
    assert!(!latency_fresh(0, 10 * MS, hold), "never stamped");
    assert!(latency_fresh(100 * MS, 100 * MS, hold));
    assert!(latency_fresh(100 * MS, 149 * MS, hold));
    assert!(!latency_fresh(100 * MS, 150 * MS, hold));
    assert!(
        latency_fresh(100 * MS, 99 * MS, hold),
        "a stamp racing ahead of our clock read is fresh"
    );
    let region = region();
    assert!(!region.latency_active(5 * MS, hold));
    region.stamp_latency(5 * MS);
    assert!(region.latency_active(6 * MS, hold));
    assert!(!region.latency_active(60 * MS, hold));
}

#[test]
fn compatible_schedules_are_read_and_others_refused() {
    let region = region();
    assert_eq!(region.header.version.load(SeqCst), VERSION);
    region.header.version.store(VERSION_COMPATIBLE_MIN, SeqCst);
    region.check_layout().unwrap();
    region.header.version.store(VERSION + 1, SeqCst);
    assert!(region.check_layout().is_err());
    region.header.version.store(0, SeqCst);
    assert!(region.check_layout().is_err());
}

#[test]
fn a_reader_sees_live_tenants_with_their_time_and_processes() {
    let region = region();
    let live = Fake::with(&[10, 11, 12]);
    let schedule = Schedule::new(&region, &live);
    let a = schedule.join("train-a", guaranteed(50), 10, 1, MS).unwrap();
    schedule.join("train-a", guaranteed(50), 11, 1, MS).unwrap();
    schedule.join("infer-b", guaranteed(50), 12, 1, MS).unwrap();
    assert!(matches!(schedule.step(&a, MS), Step::Go { .. }));
    // Past the deadline the turn is handed over (to `a` or an idle turn) and charged to `a`.
    let later = MS + schedule.quantum_ns() + 5 * MS;
    schedule.step(&a, later);
    let times = region.tenant_times(&&live);
    let names: Vec<&str> = times.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["train-a", "infer-b"]);
    assert_eq!(times[0].processes, 2);
    assert_eq!(times[1].processes, 1);
    // A process that died (and was not reclaimed yet) no longer counts.
    live.kill(11);
    assert_eq!(region.tenant_times(&&live)[0].processes, 1);
    assert_eq!(
        times[0].used_ns,
        region.tenants[a.tenant].used_ns.load(SeqCst)
    );
    assert!(times[0].used_ns >= schedule.quantum_ns(), "{times:?}");
    assert_eq!(times[1].used_ns, 0);
    // A slot being written is not shown.
    region.tenants[5]
        .state
        .store(state(PHASE_WRITING, 12), SeqCst);
    assert_eq!(region.tenant_times(&&live).len(), 2);
}

#[test]
fn an_owner_that_went_quiet_is_not_charged_for_the_gap_before_the_next_launch() {
    let region = region();
    let live = Fake::default();
    let mut sim = Sim::new(&region, &live, (0, 8_000 * MS));
    // "a" (bursting, so it holds the turn alone) runs for 0.5 s and stops, keeping the turn;
    // "b" launches 4.5 s later.
    sim.add(1, "a", config(50, true, true, 0), 0, 500 * MS);
    sim.add(2, "b", guaranteed(50), 5_000 * MS, 6_000 * MS);
    sim.run(6_100 * MS, 50_000);
    let charged = region.tenants[sim.tenant_of(0)].used_ns.load(SeqCst);
    // its kernels ran ~0.5 s; at most one active window (two quanta) more may be charged, never
    // the 4.5 s gap
    assert!(
        charged <= 500 * MS + 2 * QUANTUM_NS_DEFAULT,
        "charged {} ms for 0.5 s of use",
        charged / MS
    );
    // "b" was not held back by a's stale turn: it got its share while it ran
    let b = sim.shares(&[sim.tenant_of(1)])[0];
    assert!(b > 5.0, "b got {b}% of the window");
}

#[test]
fn a_turn_held_past_its_deadline_without_launches_is_charged_one_quantum_at_most() {
    // A capped tenant (issue 16: DDP ranks of a `--gpus 0.5` tenant) takes the GPU, then only
    // copies for seconds (NCCL setting up its connections: demand stamps, no launches), so its
    // turn runs on past the deadline. Its next launch must wait an idle turn or two, not the
    // seconds of idle turns that charging the whole stretch to it would owe the cap (4.4 s on an
    // H100).
    let region = region();
    let live = Fake::with(&[10]);
    let s = Schedule::new(&region, &live);
    let m = s.join("trainer", guaranteed(50), 10, 1, 0).unwrap();
    assert!(matches!(s.step(&m, MS), Step::Go { .. }));
    s.drained(&m);
    let mut now = MS;
    while now < 5_000 * MS {
        s.demand(&m, now);
        now += MS;
    }
    let began = now;
    loop {
        match s.step(&m, now) {
            Step::Go { .. } => break,
            Step::Drain => s.drained(&m),
            Step::Wait => {}
        }
        now += 100_000;
        assert!(
            now - began < 5 * s.quantum_ns(),
            "the launch after the copies waited {} ms",
            (now - began) / MS
        );
    }
    // what the turn was charged (quantum plus grace) is owed to the idle pseudo-tenant: two idle
    // turns at most
    let quantum = s.quantum_ns();
    assert!(
        now - began <= 2 * quantum + MS,
        "waited {} ms",
        (now - began) / MS
    );
    // and the tenant's GPU time counts the turn it had, not the 5 s
    let used = region.tenants[m.tenant].used_ns.load(SeqCst);
    assert!(used <= quantum + s.grace_ns(), "charged {} ms", used / MS);
}

#[test]
fn an_owner_that_went_silent_is_not_chosen_again_over_a_tenant_that_launches() {
    // Three training jobs through vgpu (2026-11-29, H200): "job3" took a turn, queued work and
    // then blocked outside the gate for minutes (waiting in elastic memory's line); its virtual
    // time was the floor, below "job2"'s. At every deadline plus grace "job2" took the turn over
    // and chose... "job3" again: the old owner stays in the active set to be charged for its turn,
    // was charged nothing (silent since before the turn began) and, lowest, won every time. Every
    // launch of "job2" waited 5 s and went ahead anyway; the jobs hung.
    let region = region();
    let live = Fake::with(&[1, 2]);
    let s = Schedule::new(&region, &live);
    let a = s.join("a", config(30, true, true, 0), 1, 1, 0).unwrap();
    let b = s.join("b", config(30, true, true, 0), 2, 1, 0).unwrap();
    let mut now = 10_000 * MS;
    // "a" demanded last at 1 s and owns a turn begun 25 ms ago, with work queued; its virtual
    // time is the floor, "b"'s is ahead.
    s.demand(&a, 1_000 * MS);
    s.demand(&b, now);
    s.mark_busy(&a, 1_000 * MS);
    region.header.turn.store(
        Turn {
            owner: a.tenant,
            start_us: (now - 25 * MS) / 1000,
        }
        .pack(),
        SeqCst,
    );
    region.header.floor_vt.store(1_000, SeqCst);
    region.tenants[a.tenant].vt.store(1_000, SeqCst);
    region.tenants[b.tenant].vt.store(5_000_000, SeqCst);
    let began = now;
    let got = loop {
        match s.step(&b, now) {
            Step::Go { .. } => break now,
            Step::Drain => s.drained(&b),
            Step::Wait => {}
        }
        now += MS;
        assert!(
            now - began < 1_000 * MS,
            "b waited 1 s behind a silent owner; the turn: {}",
            s.explain_wait(&b, now)
        );
    };
    assert!(
        got - began <= s.quantum_ns() + s.grace_ns(),
        "b waited {} ms",
        (got - began) / MS
    );
    // "a" is no longer active (it has not demanded for 9 s): "b" keeps the GPU.
    for _ in 0..200 {
        now += MS;
        assert!(
            matches!(s.step(&b, now), Step::Go { .. } | Step::Drain),
            "b waited again at +{} ms: {}",
            (now - began) / MS,
            s.explain_wait(&b, now)
        );
        if s.is_busy(&b) {
            s.drained(&b);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 48,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Burst tenants of any shares, some of which block outside the gate for a while (holding
    /// whatever turn they had, with work queued): a tenant that launches never waits much more
    /// than a round of the others' turns. Before a silent old owner was left out of the choice
    /// at a hand-over, one waited until the silent one came back (seconds on an H200).
    #[test]
    fn a_tenant_that_launches_never_waits_long_behind_one_that_went_silent(
        tenants in proptest::collection::vec(
            (25u32..=50, proptest::collection::vec((0u64..2_500, 400u64..1_500), 0..3)),
            2..=4,
        )
    ) {
        let region = region();
        let live = Fake::default();
        let mut sim = Sim::new(&region, &live, (0, 3_000 * MS));
        for (i, (share, blocked)) in tenants.iter().enumerate() {
            sim.add(10 + i as u32, &format!("t{i}"), config(*share, true, true, 0), 0, 3_000 * MS);
            sim.procs[i].blocked = blocked
                .iter()
                .map(|&(from, len)| (from * MS, (from + len) * MS))
                .collect();
        }
        sim.run(3_000 * MS, 100_000);
        // A tenant's turns come in proportion to its share: it may wait while the others have
        // theirs, each at most a quantum plus grace (twice that round: the virtual times are
        // only roughly even), and once more for each tenant that went silent holding a turn
        // (taken over at its deadline plus grace).
        let turn = QUANTUM_NS_DEFAULT + QUANTUM_NS_DEFAULT / 2;
        let shares: u64 = tenants.iter().map(|&(share, _)| u64::from(share)).sum();
        let silent = tenants.iter().filter(|(_, blocked)| !blocked.is_empty()).count() as u64;
        for (i, p) in sim.procs.iter().enumerate() {
            let bound = 2 * shares * turn / u64::from(tenants[i].0) + silent * turn + 5 * MS;
            proptest::prop_assert!(
                p.longest_wait_ns <= bound,
                "t{} waited {} ms (bound {} ms); tenants {:?}",
                i,
                p.longest_wait_ns / MS,
                bound / MS,
                tenants
            );
        }
    }
}
