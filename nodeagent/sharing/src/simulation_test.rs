//! The controller against a simulated GPU: a latency tenant's step takes
//! `base x (1 + interference(decision, neighbour)) x noise`, where the neighbour's interference
//! has one dial per mechanism, and each lever acts on some of them:
//!
//! - `sm`: competition for SMs (a compute-bound neighbour). Scales with the share of SMs the
//!   neighbour keeps; a pause removes most of it (the neighbour launches nothing new during the
//!   step, though its running kernels keep their SMs).
//! - `queue`: waiting behind the neighbour's queued kernels (a long-kernel neighbour). Scales
//!   with the queue depth the neighbour may keep (16 unbounded, else the in-flight cap); a pause
//!   halves it (what is already queued still runs first).
//! - `bandwidth`: competition for memory bandwidth (a bandwidth-bound neighbour). SMs and queue
//!   caps do not touch it; a pause removes most of it.
//!
//! - `kernel_ns`: one neighbour kernel longer than the latency budget (time slicing, or a
//!   bandwidth-bound kernel). A step that starts while it runs waits for its rest: up to the
//!   whole kernel without a guard, nothing under a guard or Exclusive (at a guard the
//!   neighbour's interposer holds a launch whose measured duration would run into the predicted
//!   step: the fit; the rhythm here is exact, so the prediction is too).
//! - `queued`: waiting behind kernels the neighbour queued before the step (the H200 run
//!   without MPS: bf16 GEMMs beside a decoder). Gone only with both the in-flight bound of 1
//!   and the pause (or Exclusive): a cap alone still lets a kernel start during the step, a
//!   pause alone still lets the queued ones run into it. So tightening the caps alone does not
//!   help, the in-flight lever is learnt useless below Pause, and Pause must still bring the
//!   bound.
//! - `starve`: while the neighbours are not paused, a step takes this many times its latency
//!   alone (a latency tenant starving under MPS beside a bandwidth hog); its steps then end
//!   rarely, and are seen as open steps first.
//!
//! So a compute-bound neighbour is answered by SM squeezes, a bandwidth-bound one only by pause,
//! a long-kernel one needs in-flight 1 and pause, a kernel longer than the budget a guard or
//! Exclusive. The tenant steps on a timeline (a step starts every `period / steps_per_window`,
//! or when the one before ends), so a window holds the steps that ended in it and reports the
//! one still open. The properties: the target is held (violations within the budget once
//! converged), the neighbours are released when the latency tenant idles, the level is stable,
//! and the same scenario gives the same decisions.

use super::*;
use proptest::prelude::*;
use tenant_abi::control::{LatencySnapshot, latency_bucket};

const MS: u64 = 1_000_000;

/// Queue depth of a neighbour without an in-flight cap.
const QUEUE_UNBOUNDED: f64 = 16.0;

#[derive(Debug, Clone, Copy)]
struct Neighbour {
    sm: f64,
    queue: f64,
    bandwidth: f64,
    kernel_ns: u64,
    queued: f64,
    starve: f64,
}

impl Neighbour {
    fn interference(&self, decision: Decision, sm_count: u16) -> f64 {
        let kept = if decision.sms == 0 {
            1.0
        } else {
            f64::from(decision.sms) / f64::from(sm_count)
        };
        let depth = if decision.inflight == 0 {
            QUEUE_UNBOUNDED
        } else {
            f64::from(decision.inflight)
        };
        let (sm_left, queue_left, bandwidth_left) = if decision.pause {
            (0.1, 0.5, 0.05)
        } else {
            (1.0, 1.0, 1.0)
        };
        let bounded_and_paused = decision.exclusive || (decision.pause && decision.inflight == 1);
        let queued = if bounded_and_paused { 0.0 } else { self.queued };
        self.sm * kept * sm_left
            + self.queue * depth / QUEUE_UNBOUNDED * queue_left
            + self.bandwidth * bandwidth_left
            + queued
    }

    /// The wait behind the long kernel, for a step starting at `phase` (uniform in [0, 1)) of it.
    fn kernel_wait_ns(&self, decision: Decision, phase: f64) -> u64 {
        if decision.exclusive || self.kernel_ns == 0 || (decision.pause && decision.guard_us > 0) {
            return 0;
        }
        (self.kernel_ns as f64 * phase) as u64
    }
}

/// splitmix64: deterministic noise from a seed, without a dependency.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Debug, Clone, Copy)]
enum Start {
    /// `--latency-target` of this many times the base latency.
    Explicit(f64),
    /// Alone for a while first: the baseline is learnt without neighbours.
    Alone,
    /// Neighbours from the first window: the baseline comes from the protective level.
    Crowded,
}

#[derive(Debug, Clone)]
struct Scenario {
    neighbour: Neighbour,
    base_ns: u64,
    /// Uniform relative noise of a step, +-.
    noise: f64,
    /// Share of steps 1.5 times slower whatever the level (the tenant's own hiccups).
    spikes: f64,
    /// Slow spells of the tenant's own, whatever the level: every `.0` ns for `.1` ns its steps
    /// take `.2` times as long (an eager PyTorch tenant on an H200 ran twice its alone time for
    /// 0.8-2 s at Exclusive, the GPU idle).
    spells: Option<(u64, u64, f64)>,
    steps_per_window: u64,
    start: Start,
    seed: u64,
    mps: bool,
}

struct Gpu {
    scenario: Scenario,
    controller: Controller,
    noise: Noise,
    now_ns: u64,
    period_ns: u64,
    /// When the tenant's next step may start, and its step in flight: (start, end).
    next_start_ns: u64,
    open: Option<(u64, u64)>,
    /// The target the agent published after the last window (0: none), which the tenant's
    /// interposer counts its steps against (`tenant_abi::control::Control::record_step`).
    published_target_ns: u64,
}

/// What one stretch of windows gave.
#[derive(Debug, Default)]
struct Stretch {
    steps: u64,
    violations: u64,
    changes: u64,
    /// Windows whose decision restricted the neighbours.
    restricted: u64,
    windows_to_release: Option<u64>,
    last: Option<Decision>,
}

impl Gpu {
    fn new(scenario: Scenario) -> Gpu {
        let config = Config::new(scenario.mps, if scenario.mps { 132 } else { 0 });
        Gpu {
            noise: Noise(scenario.seed),
            period_ns: config.period_ns,
            controller: Controller::new(config),
            scenario,
            now_ns: 0,
            next_start_ns: 0,
            open: None,
            published_target_ns: 0,
        }
    }

    fn target_ns(&self) -> Option<u64> {
        match self.scenario.start {
            Start::Explicit(ratio) => Some((self.scenario.base_ns as f64 * ratio) as u64),
            Start::Alone | Start::Crowded => None,
        }
    }

    fn step_ns(&mut self, decision: Decision, neighbours: bool) -> u64 {
        let s = &self.scenario;
        let interference = if neighbours {
            s.neighbour.interference(decision, 132)
        } else {
            0.0
        };
        let (noise, spike, phase) = (self.noise.unit(), self.noise.unit(), self.noise.unit());
        let mut latency =
            s.base_ns as f64 * (1.0 + interference) * (1.0 + s.noise * (2.0 * noise - 1.0));
        if spike < s.spikes {
            latency *= 1.5;
        }
        if let Some((every_ns, length_ns, factor)) = s.spells
            && self.now_ns % every_ns < length_ns
        {
            latency *= factor;
        }
        if neighbours {
            if !decision.pause {
                latency *= s.neighbour.starve.max(1.0);
            }
            latency += s.neighbour.kernel_wait_ns(decision, phase) as f64;
        }
        latency as u64
    }

    /// The steps that end in the window `(now_ns, now_ns + period]` at `decision`, and the
    /// start of the one open at its end (as the agent reports it: at most
    /// `tenant_abi::control::STEP_OPEN_MAX_NS` open).
    fn steps_in_window(
        &mut self,
        decision: Decision,
        neighbours: bool,
        steps: bool,
    ) -> (LatencySnapshot, Option<u64>) {
        let end_ns = self.now_ns + self.period_ns;
        let gap_ns = self.period_ns / self.scenario.steps_per_window;
        let mut snapshot = LatencySnapshot {
            counted_against_ns: self.published_target_ns,
            ..LatencySnapshot::default()
        };
        loop {
            if self.open.is_none() {
                if !steps {
                    self.next_start_ns = self.next_start_ns.max(end_ns);
                    break;
                }
                let start = self.next_start_ns.max(self.now_ns);
                if start >= end_ns {
                    break;
                }
                let latency = self.step_ns(decision, neighbours);
                self.open = Some((start, start + latency.max(1)));
            }
            let (start, end) = self.open.expect("a step in flight");
            if end > end_ns {
                break;
            }
            let latency = end - start;
            snapshot.buckets[latency_bucket(latency)] += 1;
            if self.published_target_ns != 0 && latency > self.published_target_ns {
                snapshot.over_target += 1;
            }
            snapshot.steps += 1;
            snapshot.total_ns += latency;
            self.open = None;
            self.next_start_ns = (start + gap_ns).max(end);
        }
        let open = self
            .open
            .map(|(start, _)| start)
            .filter(|&start| end_ns - start < tenant_abi::control::STEP_OPEN_MAX_NS);
        (snapshot, open)
    }

    /// Runs `windows` periods; `steps`: whether the latency tenant steps.
    fn run(&mut self, windows: u64, neighbours: bool, steps: bool) -> Stretch {
        let mut stretch = Stretch::default();
        let before = self
            .controller
            .statuses()
            .first()
            .map(|s| (s.steps, s.violations));
        for window in 1..=windows {
            let decision = self.controller.decision();
            let (snapshot, open_step_since_ns) = self.steps_in_window(decision, neighbours, steps);
            self.now_ns += self.period_ns;
            let output = self.controller.handle(Event::Window {
                now_ns: self.now_ns,
                tenants: vec![TenantWindow {
                    name: "infer".into(),
                    window: snapshot,
                    target_ns: self.target_ns(),
                }],
                neighbours_active: neighbours,
                open_step_since_ns,
            });
            self.published_target_ns = output
                .tenants
                .first()
                .and_then(|status| status.target_ns)
                .unwrap_or(0);
            if output.change.is_some() {
                stretch.changes += 1;
            }
            if output.decision.restricts() {
                stretch.restricted += 1;
            }
            if output.decision == Decision::default() && stretch.windows_to_release.is_none() {
                stretch.windows_to_release = Some(window);
            }
            stretch.last = Some(output.decision);
        }
        let after = &self.controller.statuses()[0];
        let (steps, violations) = before.unwrap_or((0, 0));
        stretch.steps = after.steps - steps;
        stretch.violations = after.violations - violations;
        stretch
    }
}

/// A neighbour that does not interfere.
const QUIET: Neighbour = Neighbour {
    sm: 0.0,
    queue: 0.0,
    bandwidth: 0.0,
    kernel_ns: 0,
    queued: 0.0,
    starve: 1.0,
};

fn neighbour() -> impl Strategy<Value = Neighbour> {
    prop_oneof![
        // Compute-bound: SMs matter.
        (0.5..2.0f64, 0.0..0.2f64).prop_map(|(sm, queue)| Neighbour {
            sm,
            queue,
            bandwidth: 0.0,
            ..QUIET
        }),
        // Bandwidth-bound: only a pause helps.
        (0.3..1.0f64, 0.0..0.1f64).prop_map(|(bandwidth, queue)| Neighbour {
            sm: 0.0,
            queue,
            bandwidth,
            ..QUIET
        }),
        // Long kernels: the queue depth matters.
        (1.0..3.0f64, 0.0..0.3f64).prop_map(|(queue, sm)| Neighbour {
            sm,
            queue,
            bandwidth: 0.0,
            ..QUIET
        }),
        // A mix.
        (0.0..1.0f64, 0.0..1.5f64, 0.0..0.5f64).prop_map(|(sm, queue, bandwidth)| Neighbour {
            sm,
            queue,
            bandwidth,
            ..QUIET
        }),
        // A kernel longer than the budget: only a guard or Exclusive hides it.
        (1_000_000..15_000_000u64, 0.0..0.3f64).prop_map(|(kernel_ns, queue)| Neighbour {
            queue,
            kernel_ns,
            ..QUIET
        }),
        // Queued kernels that delay a step unless both the bound and the pause are in force.
        (0.5..2.0f64, 0.0..0.2f64).prop_map(|(queued, sm)| Neighbour {
            sm,
            queued,
            ..QUIET
        }),
        // Starving unless paused: steps 100 times their latency alone.
        (0.0..0.3f64).prop_map(|bandwidth| Neighbour {
            bandwidth,
            starve: 100.0,
            ..QUIET
        }),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        neighbour(),
        500_000..5_000_000u64,
        0.0..0.05f64,
        prop_oneof![Just(0.0), 0.0..0.002f64],
        1..8u64,
        prop_oneof![
            (1.3..3.0f64).prop_map(Start::Explicit),
            Just(Start::Alone),
            Just(Start::Crowded)
        ],
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(neighbour, base_ns, noise, spikes, steps_per_window, start, seed, mps)| Scenario {
                neighbour,
                base_ns,
                noise,
                spikes,
                spells: None,
                steps_per_window,
                start,
                seed,
                mps,
            },
        )
}

/// Runs the scenario's start, then `converge` windows beside the neighbour; returns the GPU.
fn started(scenario: &Scenario, converge: u64) -> Gpu {
    let mut gpu = Gpu::new(scenario.clone());
    if matches!(scenario.start, Start::Alone) {
        gpu.run(200, false, true);
    }
    gpu.run(converge, true, true);
    gpu
}

/// `cases` scenarios drawn from a fixed seed, so that every run (CI's too) checks the same ones:
/// a property that fails only on some draws must show up here as a named case, not as a
/// failure now and then.
fn seeded(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x76_67_70_75),
        ..ProptestConfig::default()
    }
}

/// A scenario the controller once missed its budget on (1.08% of the steady steps over the
/// target against 1%), found by a random draw on 2026-11-28: a long-kernel neighbour without MPS
/// that only in-flight 1 with pause holds. The level's trial (`Controller::adapt`) credited the
/// budget's share of every step since the level was set, so a level held for thousands of steps
/// banked enough credit to run at 1.08% unanswered; the credit now stops after one relaxation
/// wait of steps.
#[test]
fn a_level_held_long_banks_no_credit_past_its_trial() {
    let scenario = Scenario {
        neighbour: Neighbour {
            sm: 0.23985450345993006,
            queue: 2.9413994487263087,
            ..QUIET
        },
        base_ns: 3_068_757,
        noise: 0.013690483288536774,
        spikes: 0.001504471415104736,
        spells: None,
        steps_per_window: 3,
        start: Start::Crowded,
        seed: 14077154795252051699,
        mps: false,
    };
    let mut gpu = started(&scenario, 1_000);
    let steady = gpu.run(3_000, true, true);
    let rate = steady.violations as f64 / steady.steps.max(1) as f64;
    assert!(rate <= gpu.controller.config().violation_budget, "{rate}");
}

/// Level changes allowed in the 3000 steady windows (30 s): one per 50 windows on average.
/// Probes of a level that fails get rarer (the waits double), so what remains are answers to the
/// tenant's own hiccups (the spikes); 300 generated scenarios needed at most 30.
const CHANGES_STEADY_MAX: u64 = 60;

proptest! {
    #![proptest_config(seeded(64))]

    #[test]
    fn the_target_is_held_the_level_is_stable_and_idling_releases(scenario in scenario()) {
        let mut gpu = started(&scenario, 1_000);
        let steady = gpu.run(3_000, true, true);
        // Violations as the controller counts them: steps in buckets wholly over the target
        // (the histogram's resolution is about 9%).
        let rate = steady.violations as f64 / steady.steps.max(1) as f64;
        prop_assert!(
            rate <= gpu.controller.config().violation_budget,
            "violations {} of {} steps ({rate:.4}); {:?}", steady.violations, steady.steps,
            gpu.controller.statuses()
        );
        prop_assert!(
            steady.changes <= CHANGES_STEADY_MAX,
            "{} changes in 3000 windows", steady.changes
        );
        // The latency tenant idles beside a busy neighbour: released within the idle bound after
        // its last step ends (a starving one may still run for a while).
        let remaining_ns = gpu
            .open
            .map_or(0, |(_, end)| end.saturating_sub(gpu.now_ns))
            .max(tenant_abi::control::STEP_OPEN_MAX_NS);
        let idle = gpu.run(200, true, false);
        let config = gpu.controller.config();
        let bound = (config.idle_max_ns + remaining_ns) / config.period_ns + 2;
        prop_assert!(
            idle.windows_to_release.is_some_and(|w| w <= bound),
            "released after {:?} windows", idle.windows_to_release
        );
        prop_assert_eq!(idle.last, Some(Decision::default()));
    }

    #[test]
    fn the_same_windows_give_the_same_decisions(scenario in scenario()) {
        let decisions = |scenario: &Scenario| {
            let mut gpu = Gpu::new(scenario.clone());
            (0..300)
                .map(|_| {
                    gpu.run(1, true, true);
                    gpu.controller.decision()
                })
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(decisions(&scenario), decisions(&scenario));
    }
}

#[test]
fn each_kind_of_neighbour_gets_its_lever() {
    let base = Scenario {
        neighbour: Neighbour {
            sm: 0.0,
            queue: 0.0,
            bandwidth: 0.0,
            ..QUIET
        },
        base_ns: 2 * MS,
        noise: 0.02,
        spikes: 0.0,
        spells: None,
        steps_per_window: 5,
        start: Start::Alone,
        seed: 7,
        mps: true,
    };
    let run = |neighbour: Neighbour| {
        let mut gpu = started(
            &Scenario {
                neighbour,
                ..base.clone()
            },
            2_000,
        );
        let steady = gpu.run(2_000, true, true);
        let budget = gpu.controller.config().violation_budget;
        assert!(
            steady.violations as f64 <= budget * steady.steps as f64,
            "{neighbour:?}: {steady:?}"
        );
        // A few probes of a level that failed, each rarer than the one before. Up to 7 changes
        // a probe: relaxing from Pause goes to the cap of 1 without the pause (the in-flight
        // lever is no longer probed away at Pause, where its bound is part of the pause), a
        // failure there climbs multiplicatively (11 -> 16), the window after still holds steps
        // that began at 11 (-> 17), and the guards come down one by one; the bandwidth-bound
        // neighbour's probes fall twice in these 2000 windows (16 changes; 10 held before).
        assert!(steady.changes <= 16, "{neighbour:?}: {steady:?}");
        steady.last.unwrap()
    };
    // SM squeezes answer a compute-bound neighbour: no pause.
    let compute = run(Neighbour {
        sm: 1.5,
        queue: 0.1,
        bandwidth: 0.0,
        ..QUIET
    });
    assert!(compute.sms != 0 && !compute.pause, "{compute:?}");
    // Only a pause answers a bandwidth-bound one: its SMs and queue are left alone.
    let bandwidth = run(Neighbour {
        sm: 0.0,
        queue: 0.05,
        bandwidth: 0.8,
        ..QUIET
    });
    assert!(bandwidth.pause && bandwidth.sms == 0, "{bandwidth:?}");
    // Long kernels need in-flight 1 and pause.
    let long = run(Neighbour {
        sm: 0.2,
        queue: 4.0,
        bandwidth: 0.0,
        ..QUIET
    });
    assert!(long.pause && long.inflight == 1, "{long:?}");
    // A 6 ms kernel beside 2 ms steps every 2 ms: a guard, which the neighbour stretches to
    // its kernel (the fit), so Exclusive is not needed.
    let kernel = run(Neighbour {
        kernel_ns: 6 * MS,
        ..QUIET
    });
    assert!(kernel.guard_us > 0 && !kernel.exclusive, "{kernel:?}");
    // Starving unless paused: the pause comes, and holds.
    let starving = run(Neighbour {
        starve: 100.0,
        ..QUIET
    });
    assert!(starving.pause, "{starving:?}");
}

#[test]
fn a_starving_tenant_is_answered_before_its_steps_end() {
    // Steps of 1.2 ms every ~3 ms alone, 120 ms while the neighbour runs unpaused: without
    // open steps, a window would hold a step every 12 windows and the tenant look idle.
    let scenario = Scenario {
        neighbour: Neighbour {
            starve: 100.0,
            ..QUIET
        },
        base_ns: 1_200_000,
        noise: 0.02,
        spikes: 0.0,
        spells: None,
        steps_per_window: 3,
        start: Start::Alone,
        seed: 11,
        mps: true,
    };
    let mut gpu = started(&scenario, 0);
    let mut paused_after = None;
    for window in 1..=200 {
        let stretch = gpu.run(1, true, true);
        if stretch.last.is_some_and(|decision| decision.pause) {
            paused_after = Some(window);
            break;
        }
    }
    // A few open steps (one per ~12 windows) climb the ladder to pause.
    let windows = paused_after.expect("paused");
    assert!(windows <= 100, "paused after {windows} windows");
    let steady = gpu.run(2_000, true, true);
    let budget = gpu.controller.config().violation_budget;
    assert!(
        steady.violations as f64 <= budget * steady.steps as f64,
        "{steady:?}"
    );
}

#[test]
fn queued_kernels_are_answered_at_pause_with_the_bound() {
    // The H200 run without MPS: a decoder step every ~3 ms beside a neighbour whose queued
    // kernels delay it unless both the bound of 1 and the pause are in force, climbing from
    // level 0 (an explicit target). The caps alone do not help: learnt useless below Pause.
    // Pause brings the bound anyway, so the level holds there rather than failing the guards
    // and ending at Exclusive (the defect: Pause with the cap learnt away left it unbounded).
    let scenario = Scenario {
        neighbour: Neighbour {
            queued: 1.0,
            ..QUIET
        },
        base_ns: 2 * MS,
        noise: 0.02,
        spikes: 0.0,
        spells: None,
        steps_per_window: 3,
        start: Start::Explicit(1.5),
        seed: 5,
        mps: false,
    };
    let mut gpu = started(&scenario, 1_000);
    assert_eq!(
        gpu.controller.lever_state(Lever::Inflight),
        LeverState::Useless
    );
    let steady = gpu.run(2_000, true, true);
    let budget = gpu.controller.config().violation_budget;
    assert!(
        steady.violations as f64 <= budget * steady.steps as f64,
        "{steady:?}"
    );
    let last = steady.last.unwrap();
    assert!(
        last.pause && last.inflight == 1 && last.guard_us == 0 && !last.exclusive,
        "{last:?}"
    );
}

proptest! {
    #![proptest_config(seeded(32))]

    /// The floor: beside a neighbour the tenant lives with unrestricted (at most 5% slower,
    /// within its 1.2x target), or one whose harm no lever reduces (the tenant's own hiccups,
    /// 1.5x in 2-3% of its steps against a 1.3x target: over budget at every level, Exclusive
    /// included), the neighbours are left unrestricted in the steady windows: a restriction
    /// would cost them without buying the tenant anything.
    #[test]
    fn a_neighbour_no_restriction_helps_against_is_left_unrestricted(
        mild in any::<bool>(),
        interference in 0.0..0.05f64,
        spikes in 0.02..0.03f64,
        base_ns in 500_000..5_000_000u64,
        steps_per_window in 1..8u64,
        seed in any::<u64>(),
        mps in any::<bool>(),
    ) {
        let scenario = Scenario {
            neighbour: Neighbour { sm: interference, ..QUIET },
            base_ns,
            noise: 0.02,
            spikes: if mild { 0.0 } else { spikes },
            spells: None,
            steps_per_window,
            start: if mild { Start::Alone } else { Start::Explicit(1.3) },
            seed,
            mps,
        };
        // Each level's trial takes a few violations, so at 2% and one step a window the climb
        // to the top, the top's 200 steps and level 0's take up to ~2,000 windows.
        let mut gpu = started(&scenario, 3_000);
        let steady = gpu.run(3_000, true, true);
        prop_assert!(
            steady.restricted <= 3_000 / 20,
            "{} of 3000 steady windows restricted the neighbour", steady.restricted
        );
    }
}

/// The tenant's own slow spells (twice as slow for 1 s in every 10, at every level) beside a
/// compute-bound neighbour: its target stays the one learnt alone, from a record four times as
/// long as a spell. A spell is not evidence that
/// the baseline is stale (`TenantState::check_baseline`): before, one block of 100 steps at
/// Exclusive inside a spell replaced it, and the target followed the spell for the rest of the
/// run.
#[test]
fn a_tenants_own_slow_spells_do_not_loosen_its_learnt_target() {
    let neighbours = [
        Neighbour {
            sm: 1.0,
            queue: 0.2,
            ..QUIET
        },
        Neighbour {
            bandwidth: 0.6,
            queue: 0.1,
            ..QUIET
        },
    ];
    for (seed, (neighbour, spell_ms)) in neighbours
        .into_iter()
        .flat_map(|n| [(n, 500), (n, 1_500)])
        .enumerate()
    {
        let scenario = Scenario {
            neighbour,
            base_ns: 3 * MS,
            noise: 0.05,
            spikes: 0.0,
            spells: Some((10_000 * MS, spell_ms * MS, 2.0)),
            steps_per_window: 2,
            start: Start::Alone,
            seed: seed as u64,
            mps: false,
        };
        let mut gpu = Gpu::new(scenario.clone());
        // Alone for 8 s between spells: the record the target is learnt from (1600 steps,
        // over four times a spell's).
        gpu.now_ns = 1_600 * MS;
        gpu.next_start_ns = gpu.now_ns;
        gpu.run(800, false, true);
        let learnt = gpu.controller.statuses()[0]
            .target_ns
            .expect("learnt alone");
        assert!(learnt < 4 * MS, "learnt outside a spell: {learnt}");
        let mut highest = learnt;
        for _ in 0..3_000 {
            gpu.run(1, true, true);
            highest = highest.max(gpu.controller.statuses()[0].target_ns.unwrap_or(0));
        }
        assert_eq!(
            highest, learnt,
            "{neighbour:?}, spells of {spell_ms} ms: the target went from {learnt} ns to \
             {highest} ns over three spells"
        );
    }
}

/// A 3 ms tenant under MPS whose own tail reaches its 1.3x target nearly as often as the budget
/// allows: 0.7% of its steps 1.5x slower, two steps a window.
fn at_its_own_tail(neighbour: Neighbour, seed: u64) -> Scenario {
    Scenario {
        neighbour,
        base_ns: 3 * MS,
        noise: 0.05,
        spikes: 0.007,
        spells: None,
        steps_per_window: 2,
        start: Start::Explicit(1.3),
        seed,
        mps: true,
    }
}

/// A tenant whose own tail reaches its target nearly as often as the budget allows (0.7% of its
/// steps 1.5x slower against a 1.3x target) beside a neighbour that does not slow it at all:
/// until level 0 has the floor's 200 steps, the neighbour is left unrestricted, and afterwards
/// it is restricted at most a third of the time (`Controller::free_failed`; before it, up to
/// 45%: each burst climbed to the next level not yet judged). Two violations
/// within 100 steps come by chance at that rate, and the short trial climbed on them before the
/// floor could compare anything (an eager PyTorch loop beside a trainer on an H200 held the
/// trainer at 0.47 for the pair's 8 s, for a p99 no better than plain co-location's). Beside a
/// neighbour that does slow it (a compute-bound one, 60% slower unrestricted), the climb still
/// comes within the first 20 windows.
#[test]
fn a_tenant_at_its_own_tail_leaves_a_harmless_neighbour_unrestricted() {
    for seed in 0..16u64 {
        let scenario = |neighbour| at_its_own_tail(neighbour, seed);
        let mut gpu = Gpu::new(scenario(QUIET));
        let first = gpu.run(100, true, true);
        assert_eq!(
            first.restricted, 0,
            "seed {seed}: the first 100 windows (200 steps) restricted a neighbour that does not \
             slow the tenant ({} of {} steps over the target)",
            first.violations, first.steps
        );
        // Then a burst may climb (the lever kinds are learnt useless in turn) until the floor
        // finds a level no better than level 0; from there level 0 is judged statistically
        // too, and a p99 lower by chance does not keep a level (before both, up to 45% of these
        // 7 s were restricted; now at most about a third).
        let rest = gpu.run(700, true, true);
        assert!(
            rest.restricted <= 700 / 3,
            "seed {seed}: {} of the next 700 windows restricted a neighbour that does not slow \
             the tenant ({} of {} steps over the target)",
            rest.restricted,
            rest.violations,
            rest.steps
        );
        let mut gpu = Gpu::new(scenario(Neighbour { sm: 0.6, ..QUIET }));
        let early = gpu.run(20, true, true);
        assert!(
            early.restricted > 0,
            "seed {seed}: a neighbour that slows every step 60% was not restricted in 20 windows"
        );
    }
}

/// Level 0 judged statistically (`Controller::free_failed`) still answers a neighbour that
/// starts to interfere: after 8 s beside a harmless neighbour (a level found no better than
/// level 0 on the tenant's own tail), the neighbour turns compute-bound (every step twice as
/// slow unrestricted), the controller restricts it within 10 windows, and it does not give the
/// tenant up: once climbed, at most 5% of its steps are over the target. Without
/// `Controller::free_changed` one seed ran at 100%: every level was found no better than the
/// old, harmless level 0's steps, and nothing was restricted. Holding the 1% budget across such
/// a change is not achieved: up to 2.1% here, while the floor's stale verdicts are undone one
/// at a time.
#[test]
fn level_0_judged_statistically_still_answers_a_neighbour_that_turns_harmful() {
    for seed in 0..8u64 {
        let mut gpu = Gpu::new(at_its_own_tail(QUIET, seed));
        gpu.run(800, true, true);
        gpu.scenario.neighbour = Neighbour { sm: 1.0, ..QUIET };
        let turned = gpu.run(10, true, true);
        assert!(
            turned.restricted > 0,
            "seed {seed}: not restricted within 10 windows of the neighbour turning harmful"
        );
        gpu.run(300, true, true);
        let after = gpu.run(500, true, true);
        assert!(
            after.violations * 100 <= after.steps * 5,
            "seed {seed}: {} of {} steps over the target once climbed",
            after.violations,
            after.steps
        );
    }
}
