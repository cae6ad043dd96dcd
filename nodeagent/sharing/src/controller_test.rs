//! Scenario tests of the controller: one event in, the exact output (or the exact decision and
//! change) out. No clock, no I/O.

use super::*;
use tenant_abi::control::{LatencySnapshot, bucket_floor_ns, latency_bucket};

const MS: u64 = 1_000_000;
const PERIOD: u64 = 10 * MS;

/// A window of one step per latency.
fn steps(latencies_ns: &[u64]) -> LatencySnapshot {
    let mut window = LatencySnapshot::default();
    for &latency in latencies_ns {
        window.buckets[latency_bucket(latency)] += 1;
        window.steps += 1;
        window.total_ns += latency;
    }
    window
}

/// `count` steps of `latency_ns`.
fn repeat(count: usize, latency_ns: u64) -> LatencySnapshot {
    steps(&vec![latency_ns; count])
}

/// What a quantile of steps of `latency_ns` reads as (its bucket's upper edge).
fn reads_as(latency_ns: u64) -> u64 {
    bucket_floor_ns(latency_bucket(latency_ns) + 1)
}

/// A baseline learnt from steps of `latency_ns`: read within their bucket
/// (`LatencySnapshot::quantile_within_ns`), so between its edges.
#[track_caller]
fn assert_baseline(baseline_ns: Option<u64>, latency_ns: u64) {
    let baseline = baseline_ns.expect("a baseline");
    let floor = bucket_floor_ns(latency_bucket(latency_ns));
    assert!(
        (floor..=reads_as(latency_ns)).contains(&baseline),
        "baseline {baseline} ns for steps of {latency_ns} ns"
    );
}

fn window(now_ns: u64, tenant: &str, window: LatencySnapshot, target_ns: Option<u64>) -> Event {
    Event::Window {
        now_ns,
        tenants: vec![TenantWindow {
            name: tenant.into(),
            window,
            target_ns,
        }],
        neighbours_active: true,
        open_step_since_ns: None,
    }
}

fn alone(event: Event) -> Event {
    match event {
        Event::Window {
            now_ns,
            tenants,
            open_step_since_ns,
            ..
        } => Event::Window {
            now_ns,
            tenants,
            neighbours_active: false,
            open_step_since_ns,
        },
        other => other,
    }
}

fn decision(sms: u16, inflight: u8, pause: bool, level: u8) -> Decision {
    Decision {
        sms,
        inflight,
        pause,
        level,
        ..Decision::default()
    }
}

/// Level `level` of the guards: pause and a guard of `guard_us`.
fn guarded(sms: u16, inflight: u8, guard_us: u32, level: u8) -> Decision {
    Decision {
        guard_us,
        ..decision(sms, inflight, true, level)
    }
}

/// The top: Exclusive (with pause and whatever else is in force below it).
fn exclusive(sms: u16, inflight: u8, level: u8) -> Decision {
    Decision {
        exclusive: true,
        ..decision(sms, inflight, true, level)
    }
}

/// A driver that keeps the clock, one period per event.
struct Driver {
    controller: Controller,
    now_ns: u64,
}

impl Driver {
    fn new(config: Config) -> Driver {
        Driver {
            controller: Controller::new(config),
            now_ns: 0,
        }
    }

    fn next(&mut self, tenant: &str, steps: LatencySnapshot, target_ns: Option<u64>) -> Output {
        self.now_ns += PERIOD;
        self.controller
            .handle(window(self.now_ns, tenant, steps, target_ns))
    }

    fn next_alone(&mut self, tenant: &str, steps: LatencySnapshot) -> Output {
        self.now_ns += PERIOD;
        self.controller
            .handle(alone(window(self.now_ns, tenant, steps, None)))
    }

    /// A window beside active neighbours with a latency step open since `open_since_ns`.
    fn next_open(
        &mut self,
        tenant: &str,
        steps: LatencySnapshot,
        target_ns: Option<u64>,
        open_since_ns: Option<u64>,
    ) -> Output {
        self.now_ns += PERIOD;
        let mut event = window(self.now_ns, tenant, steps, target_ns);
        if let Event::Window {
            open_step_since_ns, ..
        } = &mut event
        {
            *open_step_since_ns = open_since_ns;
        }
        self.controller.handle(event)
    }

    /// Ten clean windows at level 0, one slow step that spends the banked violation, then a
    /// step open for 5 ms past a 2 ms `target`: over budget and starving, to the top.
    fn starve_to_top(&mut self, target: Option<u64>) {
        for _ in 0..10 {
            self.next("infer", repeat(3, MS), target);
        }
        self.next("infer", steps(&[MS, 3 * MS]), target);
        let since = self.now_ns + 5 * MS;
        self.next_open("infer", LatencySnapshot::default(), target, Some(since));
    }

    /// `tenant` over budget at 0 and 1 beside a neighbour: level 2, which holds for 40
    /// windows; then 20 windows without steps, idle: released.
    fn settle_at_2_then_idle(&mut self, tenant: &str, target: Option<u64>) {
        self.next(tenant, repeat(3, 3 * MS), target);
        self.next(tenant, repeat(3, 3 * MS), target);
        assert_eq!(self.level(), 2);
        for _ in 0..40 {
            self.next(tenant, repeat(3, MS), target);
        }
        for _ in 0..20 {
            self.next(tenant, LatencySnapshot::default(), target);
        }
    }

    fn level(&self) -> u8 {
        self.controller.decision().level
    }
}

fn changed(output: &Output) -> Option<(Decision, Reason)> {
    output
        .change
        .as_ref()
        .map(|change| (change.to, change.reason.clone()))
}

fn over(tenant: &str, steps: u64, violations: u64) -> Reason {
    Reason::OverBudget {
        tenant: tenant.into(),
        steps,
        violations,
    }
}

#[test]
fn a_tenant_without_steps_restricts_nothing() {
    let mut controller = Controller::new(Config::new(true, 132));
    let output = controller.handle(window(PERIOD, "infer", LatencySnapshot::default(), None));
    assert_eq!(
        output,
        Output {
            decision: Decision::default(),
            change: None,
            tenants: vec![TenantStatus {
                name: "infer".into(),
                target_ns: None,
                baseline_p99_ns: None,
                p50_ns: None,
                p99_ns: None,
                steps: 0,
                violations: 0,
            }],
        }
    );
}

#[test]
fn without_a_target_the_top_is_held_until_the_latency_alone_is_learnt() {
    let mut driver = Driver::new(Config::new(true, 132));
    let output = driver.next("infer", repeat(5, 2 * MS), None);
    assert_eq!(
        output,
        Output {
            decision: exclusive(8, 1, 17),
            change: Some(Change {
                from: Decision::default(),
                to: exclusive(8, 1, 17),
                reason: Reason::NoTarget {
                    tenant: "infer".into()
                },
            }),
            tenants: vec![TenantStatus {
                name: "infer".into(),
                target_ns: None,
                baseline_p99_ns: None,
                p50_ns: Some(reads_as(2 * MS)),
                p99_ns: Some(reads_as(2 * MS)),
                steps: 5,
                violations: 0,
            }],
        }
    );
    // 99 steps alone: not yet a p99.
    for _ in 0..9 {
        driver.next_alone("infer", repeat(11, MS));
    }
    assert_eq!(driver.controller.statuses()[0].baseline_p99_ns, None);
    // The 100th: the baseline is its p99, the target 1.2 times that. The level stays (no
    // neighbour: nothing to learn about the levers).
    let output = driver.next_alone("infer", repeat(1, MS));
    assert_eq!(output.change, None);
    assert_eq!(output.decision, exclusive(8, 1, 17));
    assert_baseline(output.tenants[0].baseline_p99_ns, MS);
    let baseline = output.tenants[0].baseline_p99_ns.unwrap();
    assert_eq!(
        output.tenants[0].target_ns,
        Some((baseline as f64 * 1.2).round() as u64)
    );
}

#[test]
fn never_alone_the_baseline_comes_from_exclusive_and_is_then_frozen() {
    let mut driver = Driver::new(Config::new(false, 0));
    // The first window was at level 0, the second the first at Exclusive (the neighbours' queued
    // work may still run in it): neither counts; 40 more make two blocks of 100 steps that agree.
    for _ in 0..41 {
        let output = driver.next("infer", repeat(5, 3 * MS), None);
        assert_eq!(output.decision, exclusive(0, 1, 10));
    }
    assert_eq!(driver.controller.statuses()[0].baseline_p99_ns, None);
    driver.next("infer", repeat(5, 3 * MS), None);
    let status = &driver.controller.statuses()[0];
    assert_baseline(status.baseline_p99_ns, 3 * MS);
    // Slower steps at the top do not move it (they are not the tenant alone).
    for _ in 0..40 {
        driver.next("infer", repeat(5, 9 * MS), None);
    }
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 3 * MS);
    // A real alone baseline replaces it once it has 100 steps.
    for _ in 0..10 {
        driver.next_alone("infer", repeat(10, 2 * MS));
    }
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 2 * MS);
}

#[test]
fn a_baseline_at_exclusive_waits_until_the_queued_work_has_drained() {
    let mut driver = Driver::new(Config::new(false, 0));
    // Level 0, then the first window at Exclusive: not counted.
    driver.next("infer", repeat(5, 3 * MS), None);
    driver.next("infer", repeat(5, 3 * MS), None);
    // The first block still waits behind queued neighbour work now and then (3 slow steps of
    // 100: its p99 is the slow one); the next block is clean and disagrees with it; the third
    // agrees with the second, and the lower of the two is the baseline.
    for window in 0..20 {
        let latency = if window % 7 == 0 { 6 * MS } else { 3 * MS };
        driver.next("infer", repeat(5, latency), None);
    }
    for _ in 0..39 {
        driver.next("infer", repeat(5, 3 * MS), None);
        assert_eq!(driver.controller.statuses()[0].baseline_p99_ns, None);
    }
    driver.next("infer", repeat(5, 3 * MS), None);
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 3 * MS);
}

#[test]
fn a_baseline_at_exclusive_is_taken_after_the_last_block_even_without_agreement() {
    let mut driver = Driver::new(Config::new(false, 0));
    driver.next("infer", repeat(5, 3 * MS), None);
    driver.next("infer", repeat(5, 3 * MS), None);
    // Blocks whose p99s keep jumping (the neighbours' queue never quite drains): after
    // PROTECTIVE_BLOCKS_MAX blocks, the lowest.
    let block_latency = [9 * MS, 3 * MS, 9 * MS, 6 * MS];
    for (block, latency) in block_latency.into_iter().enumerate() {
        for _ in 0..20 {
            assert_eq!(
                driver.controller.statuses()[0].baseline_p99_ns,
                None,
                "{block}"
            );
            driver.next("infer", repeat(5, latency), None);
        }
    }
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 3 * MS);
}

#[test]
fn an_isolated_slow_step_is_within_budget_and_two_close_together_are_not() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    let output = driver.next("infer", steps(&[MS, MS, 5 * MS]), target);
    assert_eq!(output.change, None);
    assert_eq!(output.decision, Decision::default());
    assert_eq!(output.tenants[0].violations, 1);
    // The allowance is spent: the next slow step, 4 steps later, is over budget. But level 0
    // has not the floor's steps yet, so it fails only on violations far beyond the budget's
    // rate (two in seven steps could be the tenant's own tail: `binomial_upper_tail`)...
    let output = driver.next("infer", steps(&[MS, MS, MS, 5 * MS]), target);
    assert_eq!(output.change, None);
    // ... and a third, three in ten, are.
    let output = driver.next("infer", steps(&[MS, MS, 5 * MS]), target);
    assert_eq!(
        changed(&output),
        Some((decision(0, 8, false, 1), over("infer", 3, 1)))
    );
}

#[test]
fn over_budget_climbs_multiplicatively() {
    // Without MPS: caps 8, 4, 2, 1, pause, guards, Exclusive (levels 1..=10). The first window
    // is slower than the rest by more than two buckets, so the caps count as helping and the
    // climb goes on. Four steps per 10 ms window: a step period of 2.5 ms, known from the fifth
    // window on, so the guards are there (4 + 2 = 6: a guard of 2.5 ms / 4).
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    let mut levels = Vec::new();
    for window in 0..8 {
        let slow = if window == 0 { 4 * MS } else { 3 * MS };
        let output = driver.next("infer", repeat(4, slow), target);
        levels.push(output.decision.level);
        if output.decision.level == 6 {
            assert_eq!(output.decision, guarded(0, 1, 640, 6));
        }
    }
    assert_eq!(levels, [1, 2, 3, 4, 6, 9, 10, 10]);
    assert_eq!(driver.controller.step_period_ns(), Some(2_500_000));
    assert_eq!(driver.controller.decision(), exclusive(0, 1, 10));
    assert_eq!(
        driver.controller.lever_state(Lever::Inflight),
        LeverState::Needed
    );

    // Under MPS: +1 up to 4, then +2, +3, +4 and the top (17).
    let mut driver = Driver::new(Config::new(true, 132));
    let mut levels = Vec::new();
    for window in 0..9 {
        let slow = if window == 0 { 4 * MS } else { 3 * MS };
        levels.push(driver.next("infer", repeat(4, slow), target).decision.level);
    }
    assert_eq!(levels, [1, 2, 3, 4, 6, 9, 13, 17, 17]);
}

#[test]
fn tightening_a_lever_that_does_not_help_skips_its_kind() {
    // The same p99 whatever the level: after 3 windows at the SM levels, on to the caps.
    let mut driver = Driver::new(Config::new(true, 132));
    let target = Some(2 * MS);
    let mut levels = Vec::new();
    for _ in 0..4 {
        let output = driver.next("infer", repeat(4, 3 * MS), target);
        levels.push(output.decision.level);
    }
    assert_eq!(levels, [1, 2, 3, 8]);
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Useless
    );
}

#[test]
fn a_lever_kind_that_does_not_lower_the_p99_is_skipped_and_released() {
    let mut driver = Driver::new(Config::new(true, 132));
    let target = Some(2 * MS);
    let slow = || repeat(4, 3 * MS);
    assert_eq!(
        changed(&driver.next("infer", slow(), target)),
        Some((decision(96, 0, false, 1), over("infer", 4, 4)))
    );
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Trying {
            reference_buckets: latency_bucket(reads_as(3 * MS)) as i32
                - latency_bucket(2 * MS) as i32,
            windows: 0,
        }
    );
    driver.next("infer", slow(), target);
    driver.next("infer", slow(), target);
    let output = driver.next("infer", slow(), target);
    assert_eq!(
        output.change,
        Some(Change {
            from: decision(48, 0, false, 3),
            to: decision(0, 8, false, 8),
            reason: Reason::LeverUseless { lever: Lever::Sms },
        })
    );
    // Inflight caps helped (two buckets lower): kept; still over, the climb goes on (8 + 4).
    let output = driver.next("infer", repeat(4, 2_500_000), target);
    assert_eq!(
        driver.controller.lever_state(Lever::Inflight),
        LeverState::Needed
    );
    assert_eq!(output.decision, decision(0, 1, true, 12));
    // Relaxing halves the untried levels between 12 and the highest that failed (8): to 10,
    // then one down to 9. Level 8 failed (4 violations): going down to it, and from it, takes
    // 4 / 0.01 = 400 clean steps each; from 8 it skips the SM levels, straight to 0.
    let mut relaxed = Vec::new();
    for _ in 0..400 {
        let output = driver.next("infer", repeat(4, MS), target);
        if let Some((to, reason)) = changed(&output) {
            relaxed.push((to, reason));
        }
    }
    assert_eq!(
        relaxed,
        [
            (decision(0, 2, false, 10), Reason::Relaxed),
            (decision(0, 4, false, 9), Reason::Relaxed),
            (decision(0, 8, false, 8), Reason::Relaxed),
            (decision(0, 0, false, 0), Reason::Relaxed),
        ]
    );
}

#[test]
fn relaxing_waits_longer_for_a_level_that_failed() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    // Over budget at 0 (3 violations), then at 1 (3 violations): level 2.
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    // Clean: 10 windows would do above a failed level, but 1 failed: 3 / 0.01 = 300 clean steps,
    // and the allowance has to come back first (10 steps per window).
    let mut relaxed_after = None;
    for window in 1..=100 {
        let output = driver.next("infer", repeat(10, MS), target);
        if output.change.is_some() {
            relaxed_after = Some(window);
            break;
        }
    }
    assert_eq!(relaxed_after, Some(30));
    assert_eq!(driver.level(), 1);
    // Level 0 failed too (3 violations): down to it takes 300 clean steps as well.
    let mut relaxed_after = None;
    for window in 1..=100 {
        if driver
            .next("infer", repeat(10, MS), target)
            .change
            .is_some()
        {
            relaxed_after = Some(window);
            break;
        }
    }
    assert_eq!(relaxed_after, Some(30));
    assert_eq!(driver.level(), 0);
}

#[test]
fn a_level_that_fails_again_is_probed_twice_as_rarely() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.next("infer", repeat(1, MS), target);
    // Level 0 fails (2 violations, past the banked one): level 1.
    driver.next("infer", repeat(2, 3 * MS), target);
    let mut waits = Vec::new();
    for _ in 0..3 {
        assert_eq!(driver.level(), 1);
        let mut waited = 0;
        while driver.level() == 1 {
            driver.next("infer", repeat(10, MS), target);
            waited += 1;
            assert!(waited < 1_000);
        }
        waits.push(waited);
        // Level 0 fails again at once.
        driver.next("infer", repeat(2, 3 * MS), target);
    }
    // 2 violations / 0.01 = 200 clean steps, then 400, then 800 (10 per window).
    assert_eq!(waits, [20, 40, 80]);
}

#[test]
fn below_a_needed_level_lower_levers_are_probed_one_at_a_time() {
    // A neighbour that hurts unless it is both paused and squeezed.
    let hurts = |decision: Decision| !decision.pause || decision.sms == 0;
    let mut driver = Driver::new(Config::new(true, 132));
    let mut changes = Vec::new();
    let mut target = None;
    for _ in 0..400 {
        let latency = if hurts(driver.controller.decision()) {
            3 * MS
        } else {
            MS
        };
        if let Some(change) = changed(&driver.next("infer", repeat(5, latency), target)) {
            changes.push(change);
        }
        target = Some(2 * MS);
    }
    let over5 = || over("infer", 5, 5);
    let expected = vec![
        // No target yet: the top.
        (
            exclusive(8, 1, 17),
            Reason::NoTarget {
                tenant: "infer".into(),
            },
        ),
        // The target learnt: level 0 first (the floor), over budget, back to the top at once.
        (decision(0, 0, false, 0), Reason::ProbeUnrestricted),
        (exclusive(8, 1, 17), over5()),
        // Clean there: halfway down between the failed level 0 and the top, to the in-flight
        // cap of 4 without the pause: over, and up multiplicatively (9 + 4), to the first guard.
        (decision(8, 4, false, 9), Reason::Relaxed),
        (guarded(8, 1, 512, 13), over5()),
        // The guard holds; halfway between it and the level that failed: 11, over, back to 13
        // (known to hold, so no higher); then 12, the last untried level: Pause, which holds.
        (decision(8, 1, false, 11), Reason::Relaxed),
        (guarded(8, 1, 512, 13), over5()),
        (decision(8, 1, true, 12), Reason::Relaxed),
        // Clean again and in allowance, but level 11 failed (it takes 500 clean steps): the
        // pause is needed; are the SMs? Releasing them costs violations.
        (
            decision(0, 1, true, 12),
            Reason::ProbeLever { lever: Lever::Sms },
        ),
        (
            decision(8, 1, true, 12),
            Reason::LeverNeeded { lever: Lever::Sms },
        ),
        // The in-flight cap is not probed at Pause (its bound of 1 is part of the pause there:
        // a pause holds back new launches, not queued ones), so nothing is left to probe: once
        // level 11 has waited out its failure it is tried again, fails, and is back at Pause.
        (decision(8, 1, false, 11), Reason::Relaxed),
    ];
    assert_eq!(changes[..expected.len()], expected);
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Needed
    );
    // Never entered from below, never probed: untried, and in force from Pause up.
    assert_eq!(
        driver.controller.lever_state(Lever::Inflight),
        LeverState::Untried
    );
    assert!(driver.controller.decision().pause);
    assert_eq!(driver.controller.decision().inflight, 1);
}

#[test]
fn beside_a_neighbour_where_only_pause_and_bound_help_inflight_learnt_useless_below_pause_still_comes_with_pause()
 {
    // Without MPS: caps 8, 4, 2, 1 (levels 1..=4), pause (5). The neighbour's queued kernels
    // delay every step unless it is both bounded to 1 and paused: the caps alone do not lower
    // the p99, so after 3 windows at their levels the in-flight lever is learnt useless and
    // the climb goes on at Pause, which still brings the bound (the H200 run's defect: Pause
    // with an unbounded queue failed, and so did every guard, up to Exclusive).
    let hurts = |decision: Decision| !(decision.pause && decision.inflight == 1);
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    let mut changes = Vec::new();
    for _ in 0..300 {
        let latency = if hurts(driver.controller.decision()) {
            3 * MS
        } else {
            MS
        };
        let output = driver.next("infer", repeat(4, latency), target);
        if let Some(change) = changed(&output) {
            changes.push(change);
        }
        // From Pause up the bound is there whatever was learnt.
        if output.decision.pause {
            assert_eq!(output.decision.inflight, 1, "{:?}", output.decision);
        }
    }
    assert_eq!(
        changes[..4],
        [
            (decision(0, 8, false, 1), over("infer", 4, 4)),
            (decision(0, 4, false, 2), over("infer", 4, 4)),
            (decision(0, 2, false, 3), over("infer", 4, 4)),
            (
                decision(0, 1, true, 5),
                Reason::LeverUseless {
                    lever: Lever::Inflight
                }
            ),
        ]
    );
    assert_eq!(
        driver.controller.lever_state(Lever::Inflight),
        LeverState::Useless
    );
    // Pause holds: no guard, no Exclusive. Level 0 failed (4 violations): relaxing to it waits
    // for 400 clean steps (100 windows), then it fails and Pause comes back, bound and all.
    assert!(changes.iter().all(|(to, _)| to.level <= 5), "{changes:?}");
    assert_eq!(driver.controller.decision(), decision(0, 1, true, 5));
}

#[test]
fn over_budget_at_the_top_without_some_levers_brings_them_all_back() {
    let mut driver = Driver::new(Config::new(true, 132));
    let target = Some(2 * MS);
    for _ in 0..4 {
        driver.next("infer", repeat(4, 3 * MS), target);
    }
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Useless
    );
    // 8 -> 12 -> 17 (the top, without SMs), then over budget there: every lever back.
    let mut levels = Vec::new();
    for _ in 0..2 {
        let output = driver.next("infer", repeat(4, 3 * MS), target);
        levels.push(output.decision.level);
    }
    assert_eq!(levels, [12, 17]);
    assert_eq!(driver.controller.decision(), exclusive(0, 1, 17));
    let output = driver.next("infer", repeat(4, 3 * MS), target);
    assert_eq!(
        changed(&output),
        Some((exclusive(8, 1, 17), over("infer", 4, 4)))
    );
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Untried
    );
}

#[test]
fn an_idle_tenant_releases_everything_after_four_of_its_gaps() {
    let mut driver = Driver::new(Config::new(true, 132));
    let target = Some(2 * MS);
    for _ in 0..3 {
        driver.next("infer", repeat(4, 3 * MS), target);
    }
    assert_eq!(driver.level(), 3);
    // Its rhythm is learnt (a new tenant is assumed to step rarely): after 30 windows with steps
    // it steps every period, and is idle after max(4 x 10 ms, 50 ms) = 50 ms.
    for _ in 0..30 {
        driver.next("infer", repeat(4, MS), target);
    }
    assert_eq!(driver.level(), 3);
    let mut outputs = Vec::new();
    for _ in 0..5 {
        outputs.push(driver.next("infer", LatencySnapshot::default(), target));
    }
    assert!(outputs[..4].iter().all(|o| o.change.is_none()));
    assert_eq!(
        outputs[4].change,
        Some(Change {
            from: decision(48, 0, false, 3),
            to: Decision::default(),
            reason: Reason::Idle,
        })
    );
    assert_eq!(
        driver.controller.lever_state(Lever::Sms),
        LeverState::Untried
    );
}

#[test]
fn a_tenant_with_sparse_steps_is_not_idle_between_them() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    // A step every 100 ms, over target at first.
    for round in 0..20 {
        let slow = if round < 2 { 3 * MS } else { MS };
        driver.next("infer", repeat(2, slow), target);
        for _ in 0..9 {
            driver.next("infer", LatencySnapshot::default(), target);
            assert_ne!(driver.level(), 0, "round {round}");
        }
    }
    // Silent for 4 x 100 ms: released.
    for _ in 0..40 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.level(), 0);
}

#[test]
fn windows_without_neighbours_change_no_level() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    let output = driver.controller.handle(Event::Window {
        now_ns: PERIOD,
        tenants: vec![TenantWindow {
            name: "infer".into(),
            window: repeat(4, 5 * MS),
            target_ns: target,
        }],
        neighbours_active: false,
        open_step_since_ns: None,
    });
    assert_eq!(output.change, None);
    assert_eq!(output.tenants[0].violations, 4);
}

#[test]
fn two_tenants_share_one_level_and_the_last_one_gone_releases_it() {
    let mut controller = Controller::new(Config::new(false, 0));
    let tenants = |a: LatencySnapshot, b: LatencySnapshot| {
        vec![
            TenantWindow {
                name: "a".into(),
                window: a,
                target_ns: Some(2 * MS),
            },
            TenantWindow {
                name: "b".into(),
                window: b,
                target_ns: Some(5 * MS),
            },
        ]
    };
    let output = controller.handle(Event::Window {
        now_ns: PERIOD,
        tenants: tenants(repeat(2, MS), repeat(3, 6 * MS)),
        neighbours_active: true,
        open_step_since_ns: None,
    });
    assert_eq!(
        changed(&output),
        Some((decision(0, 8, false, 1), over("b", 3, 3)))
    );
    let names: Vec<&str> = output.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let output = controller.handle(Event::TenantGone { name: "b".into() });
    assert_eq!(output.change, None);
    assert_eq!(output.tenants.len(), 1);
    let output = controller.handle(Event::TenantGone { name: "a".into() });
    assert_eq!(
        output,
        Output {
            decision: Decision::default(),
            change: Some(Change {
                from: decision(0, 8, false, 1),
                to: Decision::default(),
                reason: Reason::Idle,
            }),
            tenants: vec![],
        }
    );
}

#[test]
fn the_status_covers_the_last_second_of_steps() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(50 * MS);
    for _ in 0..100 {
        driver.next("infer", repeat(1, 4 * MS), target);
    }
    for _ in 0..100 {
        driver.next("infer", repeat(1, MS), target);
    }
    let status = &driver.controller.statuses()[0];
    assert_eq!(status.p99_ns, Some(reads_as(MS)));
    assert_eq!(status.p50_ns, Some(reads_as(MS)));
    assert_eq!((status.steps, status.violations), (200, 0));
}

#[test]
fn a_step_open_past_the_target_is_a_violation_at_once_and_keeps_the_tenant_active() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    for _ in 0..10 {
        driver.next("infer", repeat(3, MS), target);
    }
    // One slow step spends the banked violation.
    driver.next("infer", steps(&[MS, 3 * MS]), target);
    // A step opens 1 ms into the next window and does not end (a starving tenant): 9 ms open
    // at the window's end, past the 2 ms target, one violation, over budget. Past twice the
    // target too: starving, so the top at once (before this rule, it stayed at 0 here and
    // climbed one level per starving step).
    let top = driver.controller.ladder().top() as u8;
    let since = driver.now_ns + MS;
    let output = driver.next_open("infer", LatencySnapshot::default(), target, Some(since));
    let starving = Reason::Starving {
        tenant: "infer".into(),
    };
    assert_eq!(
        changed(&output).map(|(to, reason)| (to.level, to.exclusive, reason)),
        Some((top, true, starving))
    );
    assert_eq!(output.tenants[0].violations, 2);
    let top_decision = output.decision;
    // Counted once per open step; and never idle while it is open (200 ms: four of its gaps
    // and the 50 ms floor long past): the top holds.
    for _ in 0..20 {
        let output = driver.next_open("infer", LatencySnapshot::default(), target, Some(since));
        assert_eq!(output.tenants[0].violations, 2);
        assert_eq!((output.decision, output.change), (top_decision, None));
    }
    // It ends, 205 ms long: the same step, not counted again.
    let output = driver.next_open("infer", repeat(1, 205 * MS), target, None);
    assert_eq!(
        (output.tenants[0].steps, output.tenants[0].violations),
        (33, 2)
    );
    // The next one is open past the target too (3 ms, not yet starving): a violation within
    // the window, before it ends (over budget, but already at the top: no change).
    let since = driver.now_ns + 7 * MS;
    let output = driver.next_open("infer", LatencySnapshot::default(), target, Some(since));
    assert_eq!(output.tenants[0].violations, 3);
    assert_eq!((output.decision, output.change), (top_decision, None));
    // The agent stops reporting the step (open for longer than it reports, or ended unseen):
    // with no step ended since it was seen open, the silent tenant is idle only after 1 s.
    let mut released = None;
    for window in 1..=100 {
        let output = driver.next_open("infer", LatencySnapshot::default(), target, None);
        if output.change.is_some() {
            released = Some((window, changed(&output)));
            break;
        }
    }
    assert_eq!(
        released,
        Some((100, Some((Decision::default(), Reason::Idle))))
    );
}

#[test]
fn with_several_tenants_an_open_step_keeps_those_active_when_it_began() {
    let controller_top = || Ladder::new(&Config::new(false, 0)).top() as u8;
    let mut controller = Controller::new(Config::new(false, 0));
    let tenants = |a: LatencySnapshot| {
        vec![
            TenantWindow {
                name: "a".into(),
                window: a,
                target_ns: Some(2 * MS),
            },
            TenantWindow {
                name: "b".into(),
                window: LatencySnapshot::default(),
                target_ns: Some(50 * MS),
            },
        ]
    };
    let mut now_ns = 0;
    let mut event = |a: LatencySnapshot, open_step_since_ns: Option<u64>| {
        now_ns += PERIOD;
        let output = controller.handle(Event::Window {
            now_ns,
            tenants: tenants(a),
            neighbours_active: true,
            open_step_since_ns,
        });
        (now_ns, output)
    };
    // `a` steps every period (its rhythm is learnt), then goes over budget beyond chance (six
    // steps of 96 over the target, against a 1% budget; level 0 is not measured yet): level 1.
    for _ in 0..30 {
        event(repeat(3, MS), None);
    }
    let (now_ns, output) = event(repeat(6, 3 * MS), None);
    assert_eq!(output.decision.level, 1);
    // A step opens: `a` was active then, `b` never was (the step is a's). It stays active while
    // the step is open, 300 ms, long past its 50 ms idle bound; 3 ms open, past a's target
    // (the loosest of the active tenants): over budget, but level 1's first violation is within
    // its trial's grace, so it stays. One window later, 13 ms open, past twice a's target: `a`
    // is starving, the top at once (before that rule, the open step was counted once and the
    // level stayed), and held while the step is open.
    let top = controller_top();
    let since = now_ns + 7 * MS;
    let mut levels = Vec::new();
    let mut reasons = Vec::new();
    for _ in 0..30 {
        let (_, output) = event(LatencySnapshot::default(), Some(since));
        levels.push(output.decision.level);
        reasons.extend(changed(&output).map(|(_, reason)| reason));
    }
    assert_eq!(levels[0], 1);
    assert!(levels[1..].iter().all(|&level| level == top), "{levels:?}");
    assert_eq!(reasons, [Reason::Starving { tenant: "a".into() }]);
    // The step is no longer reported and no new one of a's comes: both idle, `idle_max_ns` after it was
    // last seen open: 1 s, as none of a's steps ended since it was seen open.
    let mut released = None;
    for window in 1..=150 {
        let (_, output) = event(LatencySnapshot::default(), None);
        if output.change.is_some() {
            released = Some((window, changed(&output)));
            break;
        }
    }
    assert_eq!(
        released,
        Some((100, Some((Decision::default(), Reason::Idle))))
    );
}

#[test]
fn a_level_that_failed_right_after_relaxing_into_it_is_not_relaxed_into_10_windows_later() {
    // Without MPS, a neighbour that hurts below level 6 (the first guard). The first window is
    // slower, so the caps count as helping: the climb goes 1, 2, 3, 4, 6 (three steps a window,
    // a period of 3.3 ms known by then).
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    let mut levels = Vec::new();
    for window in 0..3_000 {
        let latency = match (window, driver.level()) {
            (0, _) => 4 * MS,
            (_, level) if level < 6 => 3 * MS,
            _ => MS,
        };
        let output = driver.next("infer", repeat(3, latency), target);
        if output.change.is_some() {
            levels.push(output.decision.level);
        }
    }
    // 6 holds; 5 never failed, so it is tried after 10 clean windows, and fails at once (3
    // steps over): back up to 6, no higher (6 held for a whole wait: known to be enough). Then
    // 5 waits for 3 / 0.01 = 300 clean steps (100 windows) at 6, doubled each time it fails
    // again.
    assert_eq!(&levels[..9], [1, 2, 3, 4, 6, 5, 6, 5, 6]);
    let probes = levels.iter().filter(|&&level| level == 5).count();
    // 3000 windows: tries of 5 after 10, 100, 200, 400, 800 and 1600 windows at 6 (plus the
    // climbs back), not every 20 windows.
    assert!(probes <= 6, "{probes} tries of level 5: {levels:?}");
    assert!(levels.len() <= 5 + 3 * probes, "{levels:?}");
}

#[test]
fn a_long_step_within_the_tenants_own_tail_and_allowance_is_a_violation_not_starving() {
    // Alone: 300 steps of 1 ms and one of 6 ms (the tenant's own rare hiccup, as an eager
    // PyTorch tenant's p99.9 runs past twice its target): a target of 1.2 ms.
    let mut driver = Driver::new(Config::new(false, 0));
    for window in 0..30 {
        let steps = if window == 7 {
            steps(&[MS, MS, MS, MS, MS, MS, MS, MS, MS, 6 * MS])
        } else {
            repeat(10, MS)
        };
        driver.next_alone("infer", steps);
    }
    let target = driver.controller.statuses()[0].target_ns.expect("learnt");
    assert!(target < 2 * MS, "{target}");
    // Held at the top while it had no target; the first window beside a neighbour tries
    // level 0 (the target was learnt in a window without one).
    let output = driver.next("infer", repeat(3, MS), None);
    assert_eq!(
        output.change.map(|change| (change.to.level, change.reason)),
        Some((0, Reason::ProbeUnrestricted))
    );
    for _ in 0..10 {
        driver.next("infer", repeat(3, MS), None);
    }
    assert_eq!(driver.level(), 0);
    // A step open for 4 ms: past twice the target, but no longer than the tenant's own
    // slowest step alone, and the banked violation pays for it: nothing climbs.
    let since = driver.now_ns + 6 * MS;
    let output = driver.next_open("infer", LatencySnapshot::default(), None, Some(since));
    assert_eq!(output.change, None);
    driver.next_open("infer", steps(&[4 * MS, MS]), None, None);
    assert_eq!(driver.level(), 0);
    for _ in 0..5 {
        driver.next("infer", repeat(3, MS), None);
    }
    // Open for 10 ms, longer than anything the tenant did alone: starving at once (before,
    // a decoder behind GEMMs queued at level 0 stayed open for 680 ms, counted once).
    let since = driver.now_ns;
    let output = driver.next_open("infer", LatencySnapshot::default(), None, Some(since));
    assert_eq!(
        output.change.map(|change| change.reason),
        Some(Reason::Starving {
            tenant: "infer".into()
        })
    );
}

#[test]
fn a_starving_open_step_goes_to_the_top_in_one_window_and_relaxes_later() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    for _ in 0..10 {
        assert_eq!(driver.next("infer", repeat(3, MS), target).change, None);
    }
    // One slow step spends the banked violation.
    assert_eq!(
        driver.next("infer", steps(&[MS, 3 * MS]), target).change,
        None
    );
    assert_eq!(driver.level(), 0);
    // A step open for 5 ms at the window's end, past twice the 2 ms target, over budget:
    // starving now.
    let since = driver.now_ns + 5 * MS;
    let output = driver.next_open("infer", LatencySnapshot::default(), target, Some(since));
    let top = driver.controller.ladder().top() as u8;
    let change = output.change.expect("a change");
    assert_eq!(change.from, Decision::default());
    assert_eq!((change.to.level, change.to.exclusive), (top, true));
    assert_eq!(
        change.reason,
        Reason::Starving {
            tenant: "infer".into()
        }
    );
    // It ends, then the tenant is served: down by the usual relaxation, to 0 in the end.
    driver.next_open("infer", repeat(1, 30 * MS), target, None);
    let mut reasons = Vec::new();
    for _ in 0..3_000 {
        let output = driver.next("infer", repeat(3, MS), target);
        reasons.extend(changed(&output).map(|(_, reason)| reason));
    }
    assert_eq!(driver.level(), 0);
    assert!(!reasons.is_empty());
    assert!(
        reasons.iter().all(|reason| *reason == Reason::Relaxed),
        "{reasons:?}"
    );
}

#[test]
fn starving_windows_are_no_samples_of_the_step_period() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    for _ in 0..20 {
        driver.next("infer", repeat(3, MS), target);
    }
    let period = driver.controller.step_period_ns();
    assert_eq!(period, Some(PERIOD / 3));
    // A starving episode: a step open for 150 ms (the top at once), then it ends with two
    // steps of the tenant's own pace; 160 ms since the last steps over 3 steps would be a
    // 53 ms "period".
    let since = driver.now_ns + MS;
    for _ in 0..15 {
        driver.next_open("infer", LatencySnapshot::default(), target, Some(since));
    }
    driver.next_open("infer", steps(&[150 * MS, MS, MS]), target, None);
    assert_eq!(driver.controller.step_period_ns(), period);
    // A window with a step over twice the target, its gap as usual: not a sample either.
    driver.next("infer", steps(&[MS, 9 * MS]), target);
    assert_eq!(driver.controller.step_period_ns(), period);
    // The tenant's own rhythm is measured again.
    driver.next("infer", repeat(2, MS), target);
    assert_eq!(
        driver.controller.step_period_ns(),
        Some((3 * (PERIOD / 3) + PERIOD / 2) / 4)
    );
}

#[test]
fn after_starving_the_relaxation_halves_its_way_down_to_the_level_that_holds() {
    // Without MPS (top 10): a neighbour that starves the tenant below Pause (level 5) and does
    // not hurt from there up. One level at a time, from the top to Pause took five waits of
    // 100 clean steps; halving takes two (10 -> 5 directly: 0 failed, 1..=9 untried, the
    // middle of them is 5), and the tenant is served at Pause from then on.
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.starve_to_top(target);
    assert_eq!(driver.level(), 10);
    let mut levels = Vec::new();
    let mut windows_to_pause = None;
    for window in 1..=1_000 {
        let latency = if driver.level() < 5 { 30 * MS } else { MS };
        let output = driver.next("infer", repeat(3, latency), target);
        if output.change.is_some() {
            levels.push(output.decision.level);
        }
        if windows_to_pause.is_none() && driver.level() == 5 {
            windows_to_pause = Some(window);
        }
    }
    // 100 clean steps at 3 a window: 34 windows per wait.
    assert_eq!(windows_to_pause, Some(34));
    // Below Pause: 3 (the middle of 1..=4), over, up by one to 4 (the climb is multiplicative
    // from the level that failed, and never above 5, known to hold), over, 5; later probes wait
    // out their failures, and the level never goes above 5 again.
    assert_eq!(levels[..4], [5, 3, 4, 5]);
    assert!(levels.iter().all(|&level| level <= 5), "{levels:?}");
}

#[test]
fn a_tenant_back_from_idle_resumes_at_the_level_its_last_episode_settled_on() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    // Over budget at 0 and 1: level 2, which holds.
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    for _ in 0..40 {
        driver.next("infer", repeat(3, MS), target);
    }
    // Idle: released.
    let mut released = false;
    for _ in 0..20 {
        let output = driver.next("infer", LatencySnapshot::default(), target);
        released |= changed(&output).is_some_and(|(_, reason)| reason == Reason::Idle);
    }
    assert!(released);
    assert_eq!(driver.level(), 0);
    // Back beside an active neighbour: level 2 from the first window, not a climb from 0.
    let output = driver.next("infer", repeat(3, MS), target);
    assert_eq!(
        changed(&output),
        Some((decision(0, 4, false, 2), Reason::Resumed))
    );
    // Back without a neighbour: nothing to protect from; the resume waits.
    let mut driver = Driver::new(Config::new(false, 0));
    driver.next("infer", repeat(3, 3 * MS), target);
    // (One window of steps teaches no rhythm: idle after the longest bound, 1 s.)
    for _ in 0..120 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.level(), 0);
    driver.now_ns += PERIOD;
    let now_ns = driver.now_ns;
    let output = driver
        .controller
        .handle(alone(window(now_ns, "infer", repeat(3, MS), target)));
    assert_eq!(output.change, None, "no restriction without neighbours");
    // The neighbour comes: the resume, at the level the episode ended on (it never relaxed).
    assert_eq!(
        changed(&driver.next("infer", repeat(3, MS), target))
            .map(|(to, reason)| (to.level, reason)),
        Some((1, Reason::Resumed))
    );
    // An episode that ended unrestricted resumes at 0.
    let mut driver = Driver::new(Config::new(false, 0));
    for _ in 0..5 {
        driver.next("infer", repeat(3, MS), target);
    }
    for _ in 0..120 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.next("infer", repeat(3, MS), target).change, None);
}

#[test]
fn a_rare_step_between_the_margin_and_the_target_does_not_hold_the_level_up() {
    // Target 2 ms, margin 1.8 ms: one step in 90 (three a window) at 1.99 ms, under the target
    // but over the margin (its bucket reads 1.92-2.05 ms). The margin is judged on the p99 of the run of clean windows, not on
    // each window's slowest step: the level relaxes after its 100 clean steps.
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    let mut relaxed_after = None;
    for window in 1..=200 {
        let steps = if window % 30 == 0 {
            steps(&[MS, MS, 1_990_000])
        } else {
            repeat(3, MS)
        };
        if driver.next("infer", steps, target).change.is_some() {
            relaxed_after = Some(window);
            break;
        }
    }
    // Level 1 failed (3 violations: 300 clean steps, 100 windows) and the allowance comes back
    // first; the two windows with a step at 1.99 ms do not restart the count.
    assert_eq!(relaxed_after, Some(100));
    // A run whose p99 is over the margin does not relax: one step in ten at 1.99 ms.
    let mut driver = Driver::new(Config::new(false, 0));
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    for window in 1..=200 {
        let steps = if window % 3 == 0 {
            steps(&[MS, MS, 1_990_000])
        } else {
            repeat(3, MS)
        };
        assert_eq!(
            driver.next("infer", steps, target).change,
            None,
            "window {window}"
        );
    }
}

#[test]
fn a_level_below_that_has_not_failed_is_probed_without_headroom_under_the_target() {
    // Steps at 1.99 ms against a 2 ms target (its bucket reads 1.92-2.05 ms: over the 1.8 ms
    // margin, under the target) whatever the level: the restriction buys nothing. In an episode
    // where the levels below have not failed, they are probed anyway, and level 0 holds.
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    // Idle: the episode ends; the next one resumes at level 2 with no failure remembered.
    for _ in 0..120 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.level(), 0);
    driver.next("infer", repeat(3, 1_990_000), target);
    assert_eq!(driver.level(), 2, "resumed where the last episode settled");
    let mut reached_zero = None;
    for window in 1..=100 {
        driver.next("infer", repeat(3, 1_990_000), target);
        if driver.level() == 0 {
            reached_zero = Some(window);
            break;
        }
    }
    assert!(reached_zero.is_some(), "still at level {}", driver.level());
    for window in 1..=200 {
        assert_eq!(
            driver.next("infer", repeat(3, 1_990_000), target).change,
            None,
            "window {window} at level 0"
        );
    }
}

#[test]
fn an_idle_spell_is_no_sample_of_the_step_period() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    for _ in 0..20 {
        driver.next("infer", repeat(3, MS), target);
    }
    let period = driver.controller.step_period_ns();
    assert_eq!(period, Some(PERIOD / 3));
    // 250 ms without steps (idle after 50 ms), then the same rhythm again: 260 ms over 3 steps
    // would be an 87 ms "period" and guards thirty times too wide.
    for _ in 0..25 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    driver.next("infer", repeat(3, MS), target);
    assert_eq!(driver.controller.step_period_ns(), period);
    driver.next("infer", repeat(3, MS), target);
    assert_eq!(driver.controller.step_period_ns(), period);
}

#[test]
fn a_resume_is_for_the_first_window_beside_neighbours_only() {
    // An episode that settles at level 2, then idles; the next one starts without a target for
    // a new tenant (the top), and when it comes down to 0 on its own, no stale resume follows.
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.settle_at_2_then_idle("infer", target);
    assert_eq!(driver.level(), 0);
    let mut reasons = Vec::new();
    for _ in 0..2_000 {
        let output = driver.next("other", repeat(3, MS), None);
        reasons.extend(changed(&output).map(|(_, reason)| reason));
    }
    assert_eq!(
        reasons.first(),
        Some(&Reason::NoTarget {
            tenant: "other".into()
        })
    );
    assert!(!reasons.contains(&Reason::Resumed), "{reasons:?}");
}

#[test]
fn another_tenants_episode_does_not_resume_at_the_level_the_last_one_settled_on() {
    // "infer" settles at level 2 beside its neighbour, then idles; "other", with a target of
    // its own, comes next beside a neighbour: a pair of its own, from level 0, no resume.
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.settle_at_2_then_idle("infer", target);
    assert_eq!(driver.level(), 0);
    let mut reasons = Vec::new();
    for _ in 0..50 {
        let output = driver.next("other", repeat(3, MS), target);
        reasons.extend(changed(&output).map(|(_, reason)| reason));
    }
    assert_eq!(
        reasons,
        Vec::<Reason>::new(),
        "within its target at 0: nothing to do"
    );
    // Its episode ended unrestricted; "infer" back: its own last level is forgotten with it
    // (the resume is the last episode's, and that was "other"'s, at 0).
    for _ in 0..20 {
        driver.next("other", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.next("infer", repeat(3, MS), target).change, None);
    // A resume stays for the same tenant: "infer" settles at 2 again, idles, comes back.
    driver.settle_at_2_then_idle("infer", target);
    assert_eq!(
        changed(&driver.next("infer", repeat(3, MS), target))
            .map(|(to, reason)| (to.level, reason)),
        Some((2, Reason::Resumed))
    );
}

#[test]
fn a_pair_within_its_target_unrestricted_is_left_unrestricted() {
    // Beside this neighbour the tenant is 10% slower at level 0 than at Exclusive: within the
    // 1.2x target, so no restriction is worth its cost to the neighbour.
    let mut driver = Driver::new(Config::new(false, 132));
    let mut changes = Vec::new();
    for _ in 0..500 {
        let latency = if driver.level() == 0 {
            MS + MS / 10
        } else {
            MS
        };
        if let Some(change) = changed(&driver.next("infer", repeat(5, latency), None)) {
            changes.push(change);
        }
    }
    assert_eq!(
        changes,
        vec![
            (
                exclusive(0, 1, 10),
                Reason::NoTarget {
                    tenant: "infer".into()
                }
            ),
            (Decision::default(), Reason::ProbeUnrestricted),
        ]
    );
}

#[test]
fn a_resumed_episode_whose_floor_failed_last_time_finds_level_0_by_halves() {
    // The last episode settled at Pause, level 0 failing there; this one's neighbour needs
    // nothing: level 0 is not tried first (the pair is most likely the same), the relaxation
    // halves its way down to it.
    let hurts = |decision: Decision| !decision.pause;
    let mut driver = Driver::new(Config::new(false, 132));
    let target = Some(2 * MS);
    for _ in 0..400 {
        let latency = if hurts(driver.controller.decision()) {
            3 * MS
        } else {
            MS
        };
        driver.next("infer", repeat(5, latency), target);
    }
    let settled = driver.level();
    assert!(settled > 0);
    // Idle, then back beside a gentler neighbour.
    for _ in 0..200 {
        driver.next("infer", LatencySnapshot::default(), target);
    }
    assert_eq!(driver.level(), 0);
    let mut changes = Vec::new();
    for _ in 0..100 {
        if let Some(change) = changed(&driver.next("infer", repeat(5, MS), target)) {
            changes.push(change.1);
        }
    }
    assert_eq!(
        changes,
        vec![
            Reason::Resumed,
            Reason::Relaxed,
            Reason::Relaxed,
            Reason::Relaxed
        ]
    );
    assert_eq!(driver.level(), 0);
}

#[test]
fn levels_that_buy_no_latency_are_left_for_level_0() {
    // The tenant's own hiccups (one step in 25 at 3x, whatever the neighbours do): over budget
    // at every level. The controller climbs, finds the top over budget too, measures level 0
    // as long, sees the top no better, and leaves the neighbours unrestricted for the episode.
    let mut driver = Driver::new(Config::new(false, 132));
    let target = Some(2 * MS);
    let mut reasons = Vec::new();
    let mut step = 0u64;
    let mut levels = Vec::new();
    for _ in 0..1_500 {
        let latencies: Vec<u64> = (0..5)
            .map(|_| {
                step += 1;
                if step.is_multiple_of(25) { 6 * MS } else { MS }
            })
            .collect();
        if let Some(change) = changed(&driver.next("infer", steps(&latencies), target)) {
            reasons.push(change.1);
        }
        levels.push(driver.level());
    }
    let top = driver.controller.ladder().top();
    assert!(
        reasons.contains(&Reason::NoBetterThanUnrestricted { level: top }),
        "{reasons:?}"
    );
    // From then on: level 0, for good.
    let last = reasons.len() - 1;
    assert_eq!(
        reasons[last],
        Reason::NoBetterThanUnrestricted { level: top }
    );
    assert!(levels[levels.len() - 300..].iter().all(|&level| level == 0));
}

#[test]
fn a_starving_floor_is_not_sampled_again() {
    // Level 0 starves the tenant; every level above is over budget too but far better: the
    // controller samples level 0 once, a step starves there, and it stays protected.
    let mut driver = Driver::new(Config::new(false, 132));
    let target = Some(2 * MS);
    let mut step = 0u64;
    let mut at_zero = 0;
    for window in 0..2_000 {
        let level = driver.level();
        let (latencies, open) = if level == 0 {
            (Vec::new(), Some(driver.now_ns.saturating_sub(10 * MS)))
        } else {
            let latencies = (0..5)
                .map(|_| {
                    step += 1;
                    if step.is_multiple_of(25) { 6 * MS } else { MS }
                })
                .collect();
            (latencies, None)
        };
        if window >= 1_000 && level == 0 {
            at_zero += 1;
        }
        driver.next_open("infer", steps(&latencies), target, open);
    }
    assert_eq!(at_zero, 0, "level 0 starves this tenant");
}

#[test]
fn the_hypergeometric_tail_is_exact() {
    // 10 items, 4 marked, 5 drawn: P(X >= 3) = (C(4,3) C(6,2) + C(4,4) C(6,1)) / C(10,5).
    let tail = hypergeometric_upper_tail(10, 4, 5, 3);
    assert!((tail - (4.0 * 15.0 + 6.0) / 252.0).abs() < 1e-12, "{tail}");
    assert_eq!(hypergeometric_upper_tail(10, 4, 5, 0), 1.0);
    assert_eq!(hypergeometric_upper_tail(10, 4, 5, 5), 0.0);
    // Every item drawn: all the marked ones are.
    assert_eq!(hypergeometric_upper_tail(10, 4, 10, 4), 1.0);
    // Large samples stay probabilities, and a lopsided split is unlikely.
    let tail = hypergeometric_upper_tail(40_000, 400, 20_000, 260);
    assert!(tail > 0.0 && tail < 1e-6, "{tail}");
}

#[test]
fn few_violations_are_not_called_a_higher_rate() {
    // 4 of 40 against 7 of 400: 3.2 standard errors by the normal approximation, but a 1.2%
    // chance by the exact test: not far worse.
    assert!(!rate_higher((40, 4), (400, 7), FLOOR_FAR_WORSE_P));
    assert!(rate_higher((40, 4), (400, 7), 0.05));
    // Clear differences are called at both thresholds; equal or lower rates never.
    assert!(rate_higher((200, 40), (400, 4), FLOOR_FAR_WORSE_P));
    assert!(rate_higher((300, 15), (300, 3), FLOOR_BETTER_P));
    assert!(!rate_higher((300, 3), (300, 3), 0.5));
    assert!(!rate_higher((300, 3), (300, 15), 0.5));
    assert!(!rate_higher((0, 0), (300, 15), 0.5));
}

#[test]
fn steps_behind_the_work_queued_before_a_climb_are_not_the_new_levels() {
    // To the top by a starving step (the banked violation spent first).
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.starve_to_top(target);
    let top = driver.controller.ladder().top();
    assert_eq!(driver.level(), top as u8);
    // The neighbour's work queued at level 0 still drains: slow steps for a few windows, then
    // the tenant's own pace. Only the steps from the first clean window on are the top's.
    driver.next_open("infer", steps(&[9 * MS]), target, None);
    for _ in 0..3 {
        driver.next("infer", repeat(3, 4 * MS), target);
    }
    for _ in 0..20 {
        driver.next("infer", repeat(3, MS), target);
    }
    assert_eq!(driver.level(), top as u8);
    assert_eq!(driver.controller.violations_at(top, "infer"), (57, 0));
    // A level never clean is measured after SETTLE_MAX_NS all the same.
    let mut driver = Driver::new(Config::new(false, 0));
    driver.starve_to_top(target);
    let settle_windows = SETTLE_MAX_NS / PERIOD;
    for _ in 0..settle_windows + 10 {
        driver.next("infer", repeat(3, 3 * MS), target);
    }
    let (steps, violations) = driver.controller.violations_at(top, "infer");
    assert!(
        (27..=33).contains(&steps) && steps == violations,
        "{steps} {violations}"
    );
}

#[test]
fn a_baseline_the_tenant_misses_even_at_exclusive_is_replaced() {
    // Alone, a warm-up of short synchronisations: a baseline of ~0.7 ms.
    let mut driver = Driver::new(Config::new(false, 0));
    for _ in 0..20 {
        driver.next_alone("infer", repeat(10, 700_000));
    }
    let stale = driver.controller.statuses()[0].target_ns.expect("learnt");
    assert!(stale < MS, "{stale}");
    // Its real steps take 3 ms: beside a neighbour every one is a violation, the level goes
    // to the top, and there too (nothing else runs) the steps are 3 ms. After the climb's
    // settling (never within the target: SETTLE_MAX_NS, 50 windows) and a block of 100 steps
    // at Exclusive, they are the baseline: within a second.
    let top = driver.controller.ladder().top() as u8;
    let mut replaced_after = None;
    for window in 1..=200 {
        driver.next("infer", repeat(3, 3 * MS), None);
        let target = driver.controller.statuses()[0].target_ns.expect("a target");
        if target > 3 * MS {
            replaced_after = Some(window);
            break;
        }
        assert_eq!(target, stale);
    }
    let windows = replaced_after.expect("the baseline replaced");
    assert!(windows <= 100, "{windows} windows");
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 3 * MS);
    // And then the tenant is within its target: the level comes down again.
    for _ in 0..300 {
        driver.next("infer", repeat(3, 3 * MS), None);
    }
    assert!(driver.level() < top, "{}", driver.level());
}

#[test]
fn the_trace_summary_names_the_levels_that_failed_and_the_levers() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    assert_eq!(
        driver.controller.trace_summary(),
        "clean 0w/0s trial 0v/0s settling false known_good None failed [] levers \
         [Inflight=untried Pause=untried Guard=untried Exclusive=untried] floor probed false \
         worse false"
    );
    driver.next("infer", repeat(3, 3 * MS), target);
    let summary = driver.controller.trace_summary();
    assert!(summary.contains("failed [0:1/"), "{summary}");
    assert!(summary.contains("Inflight=trying"), "{summary}");
}

#[test]
fn the_drain_of_a_failed_probe_does_not_fail_the_level_known_to_hold() {
    let mut driver = Driver::new(Config::new(false, 0));
    let target = Some(2 * MS);
    driver.next("infer", repeat(3, 3 * MS), target);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    // Level 2 holds for its wait and the controller probes level 1 (it failed: 300 clean steps).
    let mut probed = false;
    for _ in 0..120 {
        driver.next("infer", repeat(3, MS), target);
        if driver.level() == 1 {
            probed = true;
            break;
        }
    }
    assert!(probed, "still at level {}", driver.level());
    // The probe fails; back at level 2, the work it let start still drains for one window.
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 2);
    driver.next("infer", repeat(3, 3 * MS), target);
    assert_eq!(driver.level(), 3, "the climb goes on");
    // Level 2 did not fail: relaxing back to it waits the usual 100 clean steps, not the 300 a
    // failure of 3 violations would cost.
    let mut back_at = None;
    for window in 1..=60 {
        driver.next("infer", repeat(3, MS), target);
        if driver.level() == 2 {
            back_at = Some(window);
            break;
        }
    }
    assert!(back_at.is_some(), "still at level {}", driver.level());
}

#[test]
fn a_slow_spell_shorter_than_the_alone_record_does_not_move_a_learnt_target() {
    // Alone long enough for a record of 1600 steps of 3 ms: the baseline.
    let mut driver = Driver::new(Config::new(false, 0));
    for _ in 0..200 {
        driver.next_alone("infer", repeat(8, 3 * MS));
    }
    let learnt = driver.controller.statuses()[0].target_ns.expect("learnt");
    // Beside a neighbour, the tenant's own steps double for 300 steps (a CPU-side slow spell:
    // on an H200 an eager tenant ran steps twice its alone time at Exclusive for 0.8-2 s, with
    // the neighbour held and the GPU idle), whatever the level; then they are as before.
    for _ in 0..100 {
        driver.next("infer", repeat(3, 6 * MS), None);
        assert_eq!(
            driver.controller.statuses()[0].target_ns,
            Some(learnt),
            "a spell of a fifth of the record moved the target"
        );
    }
    for _ in 0..100 {
        driver.next("infer", repeat(3, 3 * MS), None);
    }
    assert_eq!(driver.controller.statuses()[0].target_ns, Some(learnt));
}

#[test]
fn a_lasting_change_replaces_a_long_learnt_baseline_after_a_quarter_of_its_steps() {
    let mut driver = Driver::new(Config::new(false, 0));
    for _ in 0..200 {
        driver.next_alone("infer", repeat(8, 3 * MS));
    }
    let learnt = driver.controller.statuses()[0].target_ns.expect("learnt");
    // The tenant now takes 6 ms a step for good (another model): beside a neighbour every step
    // misses, the level goes to the top, and there too the steps take 6 ms.
    let mut replaced_after = None;
    for window in 1..=1000 {
        driver.next("infer", repeat(3, 6 * MS), None);
        if driver.controller.statuses()[0].target_ns != Some(learnt) {
            replaced_after = Some(window);
            break;
        }
    }
    // The floor finds the top no better than level 0 before a quarter of the record (400
    // steps) is in at Exclusive, and that is evidence enough: within two seconds.
    let windows = replaced_after.expect("the baseline replaced");
    assert!(windows <= 200, "{windows} windows");
    assert_baseline(driver.controller.statuses()[0].baseline_p99_ns, 6 * MS);
}

#[test]
fn steps_over_the_target_inside_its_bucket_count_when_the_tenant_counted_them() {
    // An explicit 1.229 ms target (the bucket 1.152-1.28 ms): steps of 1.25 ms are over it,
    // which the histogram alone cannot see (their bucket is not all slower).
    let target = 1_229_000;
    let over = |counted: bool| {
        let mut driver = Driver::new(Config::new(false, 0));
        let mut violations = 0;
        for _ in 0..20 {
            let mut steps = repeat(5, 1_250_000);
            if counted {
                steps.counted_against_ns = target;
                steps.over_target = 5;
            }
            driver.next("infer", steps, Some(target));
            violations = driver.controller.statuses()[0].violations;
        }
        violations
    };
    assert_eq!(over(false), 0, "the histogram's slack");
    assert_eq!(over(true), 100);
    // Counted against another target (it changed during the window): the histogram decides.
    let mut driver = Driver::new(Config::new(false, 0));
    let mut steps = repeat(5, 1_250_000);
    steps.counted_against_ns = 2 * MS;
    steps.over_target = 5;
    driver.next("infer", steps, Some(target));
    assert_eq!(driver.controller.statuses()[0].violations, 0);
}

#[test]
fn latency_tenants_busy_at_once_learn_no_baseline_from_each_other() {
    let mut controller = Controller::new(Config::new(false, 0));
    let mut now_ns = 0;
    let mut both = |controller: &mut Controller, a: LatencySnapshot, b: LatencySnapshot| {
        now_ns += PERIOD;
        let tenants = [("a", a), ("b", b)]
            .into_iter()
            .map(|(name, window)| TenantWindow {
                name: name.into(),
                window,
                target_ns: None,
            })
            .collect();
        controller.handle(Event::Window {
            now_ns,
            tenants,
            neighbours_active: false,
            open_step_since_ns: None,
        })
    };
    // Warming up together, slowed by each other: no neighbour, but neither is alone.
    for _ in 0..40 {
        both(&mut controller, repeat(5, 4 * MS), repeat(5, 4 * MS));
    }
    let baselines: Vec<_> = controller
        .statuses()
        .iter()
        .map(|s| s.baseline_p99_ns)
        .collect();
    assert_eq!(baselines, [None, None]);
    // Then each alone in turn (the other idle, with no steps): that is the baseline.
    for _ in 0..20 {
        both(
            &mut controller,
            repeat(5, 3 * MS),
            LatencySnapshot::default(),
        );
    }
    for _ in 0..20 {
        both(
            &mut controller,
            LatencySnapshot::default(),
            repeat(5, 2 * MS),
        );
    }
    let statuses = controller.statuses();
    assert_baseline(statuses[0].baseline_p99_ns, 3 * MS);
    assert_baseline(statuses[1].baseline_p99_ns, 2 * MS);
}
