//! The redistribution against a simulated GPU under MPS. The GPU has [`FULL`] units of SMs;
//! caps are nested from its first SM. On each stretch of SMs, the tenants whose cap covers it
//! share it equally up to what their blocks occupy (`demand`: a tenant with small grids
//! occupies few SMs; a compute- or bandwidth-bound loop occupies all it can get), water-filled
//! from the GPU's start. A tenant's speed is `min(SMs, useful) / useful` of its speed alone:
//! `useful` is how many SMs it turns into progress (a compute-bound loop: all; a bandwidth-bound
//! one: the SMs that saturate memory bandwidth, past which more SMs only hold blocks that wait).
//! Each 10 ms tick adds `speed x rate alone x noise` units (fractions carried), with the noise
//! drawn per tenant and second from a seeded generator.
//!
//! The properties: a bandwidth-bound loop beside a compute-bound one is capped near the best
//! cap and the group's work rises over the fallback; equal tenants stay at the fallback (and so
//! does a group where capping costs more than it gives); no cap goes under the floor and one
//! member always stays uncapped; the caps come off at once when the group changes; a group
//! whose bandwidth-bound phase ends finds its way back up; the same run gives the same caps.

use super::*;
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const TICK: u64 = 10 * MS;

#[derive(Debug, Clone, Copy)]
struct Tenant {
    /// SM units its blocks occupy when they can.
    demand: f64,
    /// SM units it turns into progress.
    useful: f64,
    /// Units per second alone.
    rate: f64,
}

const COMPUTE: Tenant = Tenant {
    demand: 128.0,
    useful: 128.0,
    rate: 50.0,
};

/// Small grids: it occupies 24 units, all useful (a launch-bound tenant: the hardware gives
/// the rest away side by side; taking turns, the GPU idles through most of its turns).
const SMALL: Tenant = Tenant {
    demand: 24.0,
    useful: 24.0,
    rate: 80.0,
};

fn bandwidth(useful: f64) -> Tenant {
    Tenant {
        demand: 128.0,
        useful,
        rate: 30.0,
    }
}

/// Each tenant's SM units under `caps` (nested from SM 0).
fn sms(tenants: &[Tenant], caps: &[u8]) -> Vec<f64> {
    let mut edges: Vec<u8> = caps.to_vec();
    edges.push(0);
    edges.sort_unstable();
    edges.dedup();
    let mut got = vec![0.0; tenants.len()];
    for pair in edges.windows(2) {
        let (from, to) = (f64::from(pair[0]), f64::from(pair[1]));
        let mut left = to - from;
        // Water-fill the stretch among those covering it with demand left.
        loop {
            let wanting: Vec<usize> = (0..tenants.len())
                .filter(|&i| caps[i] >= pair[1] && tenants[i].demand - got[i] > 1e-9)
                .collect();
            if wanting.is_empty() || left <= 1e-9 {
                break;
            }
            let even = left / wanting.len() as f64;
            let mut used = 0.0;
            for &i in &wanting {
                let take = even.min(tenants[i].demand - got[i]);
                got[i] += take;
                used += take;
            }
            left -= used;
            if used < 1e-9 {
                break;
            }
        }
    }
    got
}

/// Each tenant's speed (a fraction of its speed alone) as the group shares the GPU: side by side,
/// by the SMs its cap and the others leave it; taking turns, a turn in `n` each, at its speed
/// alone, whatever the caps (a capped tenant runs alone in its own turns).
fn speeds_in(tenants: &[Tenant], caps: &[u8], side_by_side: bool) -> Vec<f64> {
    if side_by_side {
        speeds(tenants, caps)
    } else {
        vec![1.0 / tenants.len() as f64; tenants.len()]
    }
}

fn speeds(tenants: &[Tenant], caps: &[u8]) -> Vec<f64> {
    sms(tenants, caps)
        .iter()
        .zip(tenants)
        .map(|(sms, tenant)| sms.min(tenant.useful) / tenant.useful)
        .collect()
}

/// The group's work at `caps` side by side against side by side uncapped: each tenant's speed
/// is already a fraction of its speed alone, so their sum is the work in units of one tenant's
/// work alone.
fn objective(tenants: &[Tenant], caps: &[u8]) -> f64 {
    objective_in(tenants, caps, true)
}

/// The same, sharing as given (turns: every tenant a turn in `n`).
fn objective_in(tenants: &[Tenant], caps: &[u8], side_by_side: bool) -> f64 {
    let work = speeds_in(tenants, caps, side_by_side).iter().sum::<f64>();
    work / speeds(tenants, &vec![FULL; tenants.len()])
        .iter()
        .sum::<f64>()
}

struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

/// A run: the tenants (a scenario may change them at a time), the caps in force each tick.
struct Run {
    redistributor: Redistributor,
    names: Vec<String>,
    progress: Vec<f64>,
    noise: Noise,
    sigma: f64,
    factors: Vec<f64>,
    now: u64,
    caps: Vec<u8>,
    changes: Vec<RedistributeChange>,
    /// Each tick's objective (against side by side uncapped) and caps.
    trace: Vec<(f64, Vec<u8>)>,
    floors: Vec<u8>,
    /// Whether the members share side by side this tick (else they take turns).
    side_by_side: bool,
}

impl Run {
    fn new(count: usize, sigma: f64, seed: u64) -> Run {
        Run {
            redistributor: Redistributor::new(RedistributeConfig::default()),
            names: (0..count).map(|i| format!("t{i}")).collect(),
            progress: vec![0.0; count],
            noise: Noise(seed | 1),
            sigma,
            factors: vec![1.0; count],
            now: 1_000 * MS,
            caps: vec![FULL; count],
            changes: Vec::new(),
            trace: Vec::new(),
            floors: vec![0; count],
            side_by_side: false,
        }
    }

    fn members(&self) -> Vec<Member> {
        self.names
            .iter()
            .zip(&self.progress)
            .zip(&self.floors)
            .map(|((name, progress), floor)| Member {
                name: name.clone(),
                progress: *progress as u64,
                hinted: false,
                floor: *floor,
            })
            .collect()
    }

    fn step(&mut self, tenants: &[Tenant], restricted: bool) {
        if self.now.is_multiple_of(1_000_000_000) {
            for factor in &mut self.factors {
                *factor = 1.0 + self.sigma * self.noise.next();
            }
        }
        let speeds = speeds_in(tenants, &self.caps, self.side_by_side);
        for i in 0..tenants.len() {
            self.progress[i] += tenants[i].rate * speeds[i] * self.factors[i] * TICK as f64 / 1e9;
        }
        self.now += TICK;
        let members = self.members();
        let output = self.redistributor.handle(self.now, &members, restricted);
        self.caps = self
            .names
            .iter()
            .map(|name| output.caps.get(name).copied().unwrap_or(FULL))
            .collect();
        self.side_by_side = output.side_by_side;
        if let Some(change) = output.change {
            self.changes.push(change);
        }
        self.trace.push((
            objective_in(tenants, &self.caps, self.side_by_side),
            self.caps.clone(),
        ));
    }

    fn run(&mut self, tenants: &[Tenant], seconds: u64) {
        for _ in 0..seconds * 1_000_000_000 / TICK {
            self.step(tenants, false);
        }
    }

    fn kept(&self) -> Vec<u8> {
        self.redistributor
            .status()
            .iter()
            .map(|status| status.cap)
            .collect()
    }

    /// The mean objective over the last `seconds`.
    fn mean_objective(&self, seconds: u64) -> f64 {
        let ticks = (seconds * 1_000_000_000 / TICK) as usize;
        let tail = &self.trace[self.trace.len() - ticks..];
        tail.iter().map(|(o, _)| o).sum::<f64>() / tail.len() as f64
    }
}

/// The best caps a judge could keep (the floor, a member uncapped), by brute force over steps.
fn best_objective(tenants: &[Tenant]) -> f64 {
    let config = RedistributeConfig::default();
    let floor = config.floor(tenants.len());
    let levels: Vec<u8> = (floor..=FULL).step_by(usize::from(config.step)).collect();
    let mut best: f64 = 1.0;
    let count = tenants.len();
    let mut caps = vec![0usize; count];
    loop {
        let chosen: Vec<u8> = caps.iter().map(|&i| levels[i]).collect();
        if chosen.contains(&FULL) {
            best = best.max(objective(tenants, &chosen));
        }
        let mut i = 0;
        while i < count {
            caps[i] += 1;
            if caps[i] < levels.len() {
                break;
            }
            caps[i] = 0;
            i += 1;
        }
        if i == count {
            return best;
        }
    }
}

#[test]
fn the_model_rewards_capping_a_bandwidth_bound_loop() {
    let pair = [bandwidth(40.0), COMPUTE];
    // Uncapped each holds half: the loop saturates (1.0), the compute-bound one runs at 0.5.
    let uncapped = speeds(&pair, &[FULL, FULL]);
    assert!((uncapped[0] - 1.0).abs() < 1e-9 && (uncapped[1] - 0.5).abs() < 1e-9);
    // Capped at 80 (of 128): the loop keeps its 40, the other gets 88.
    let capped = speeds(&pair, &[80, FULL]);
    assert!((capped[0] - 1.0).abs() < 1e-9, "{capped:?}");
    assert!((capped[1] - 88.0 / 128.0).abs() < 1e-9, "{capped:?}");
    assert!(best_objective(&pair) > 1.1, "{}", best_objective(&pair));
    // Equal compute-bound tenants: every cap moves as much from one as to the other.
    assert!((best_objective(&[COMPUTE, COMPUTE]) - 1.0).abs() < 1e-9);
}

#[test]
fn a_bandwidth_bound_loop_beside_a_compute_bound_one_is_capped_near_the_best_cap() {
    let pair = [bandwidth(40.0), COMPUTE];
    let mut run = Run::new(2, 0.03, 7);
    run.run(&pair, 240);
    let kept = run.kept();
    assert_eq!(kept[1], FULL, "{kept:?}");
    // The best cap is 80 (the loop's 40 SMs are its half of the stretch it shares).
    assert!((64..=96).contains(&kept[0]), "{kept:?}: {:?}", run.changes);
    let best = best_objective(&pair);
    let reached = run.mean_objective(60);
    assert!(
        reached > 1.0 + 0.7 * (best - 1.0),
        "objective {reached:.3} of a best {best:.3}: {:?}",
        run.changes
    );
}

#[test]
fn equal_tenants_stay_at_the_fallback() {
    let mut ended_capped = Vec::new();
    for seed in (1..=25).step_by(2) {
        let mut run = Run::new(2, 0.03, seed);
        run.run(&[COMPUTE, COMPUTE], 600);
        // Noise may keep a cap for a while (what one gains the other loses: nothing is lost
        // overall), and every trial caps one member for half its periods; the caps come off
        // when their move up is tried. A known cost, not a target: over ten minutes, across 61
        // seeds, one member got 0.96-1.11 of the other's work (2 off by more than 5%), and 3
        // of 61 runs ended with a cap kept by noise (before the counts' resolution bounded the
        // standard error from below: 0.91-1.11, 3 off; with relative gains and periods ended
        // by the slowest member's count: 0.90-1.11, 17 off by more than 5%, 4 capped).
        if run.kept() != vec![FULL, FULL] {
            ended_capped.push((seed, run.kept()));
        }
        let (a, b) = (run.progress[0], run.progress[1]);
        assert!(
            (a / b - 1.0).abs() < 0.12,
            "seed {seed}: {a} against {b}: {:?}",
            run.changes
        );
        let capped = run
            .trace
            .iter()
            .filter(|(_, caps)| caps.iter().any(|&cap| cap < FULL))
            .count();
        assert!(capped < run.trace.len() / 2, "seed {seed}: capped {capped}");
    }
    assert!(ended_capped.len() <= 2, "ended capped: {ended_capped:?}");
}

#[test]
fn a_small_tenant_that_leaves_sms_free_is_not_capped_for_nothing() {
    // Small grids: it occupies 24 units, all useful; the hardware already gives the rest away.
    let mut run = Run::new(2, 0.03, 11);
    run.run(&[SMALL, COMPUTE], 240);
    assert!(run.mean_objective(60) > 0.97, "{:?}", run.changes);
    assert_eq!(run.kept()[1], FULL);
}

#[test]
fn the_group_changing_takes_every_cap_off_at_once() {
    let pair = [bandwidth(40.0), COMPUTE];
    let mut run = Run::new(2, 0.02, 3);
    run.run(&pair, 120);
    assert!(run.kept()[0] < FULL, "capped by now: {:?}", run.changes);
    // A third tenant joins: uncapped in the same period.
    run.names.push("t2".into());
    run.floors.push(0);
    run.progress.push(0.0);
    run.factors.push(1.0);
    run.caps.push(FULL);
    let trio = [bandwidth(40.0), COMPUTE, COMPUTE];
    run.step(&trio, false);
    assert_eq!(run.caps, vec![FULL; 3]);
    assert_eq!(
        run.changes.last(),
        Some(&RedistributeChange::Reset {
            reason: ResetReason::Members
        })
    );
    // A member alone: nothing to share.
    run.names.truncate(1);
    run.floors.truncate(1);
    run.progress.truncate(1);
    run.factors.truncate(1);
    run.caps.truncate(1);
    for _ in 0..500 {
        run.step(&trio[..1], false);
        assert_eq!(run.caps, vec![FULL]);
    }
}

#[test]
fn a_member_without_progress_leaves_the_group_uncapped() {
    let stalled = Tenant {
        demand: 128.0,
        useful: 128.0,
        rate: 0.0,
    };
    let mut run = Run::new(2, 0.0, 5);
    run.run(&[stalled, COMPUTE], 30);
    assert!(
        run.changes.iter().any(|change| matches!(
            change,
            RedistributeChange::Reset {
                reason: ResetReason::Unmeasured { tenant }
            } if tenant == "t0"
        )),
        "{:?}",
        run.changes
    );
    // Uncapped while it waits (it was the trials' only subject before).
    let last_second = &run.trace[run.trace.len() - 100..];
    assert!(
        last_second
            .iter()
            .all(|(_, caps)| caps == &vec![FULL, FULL])
    );
}

#[test]
fn a_restricted_gpu_measures_nothing_and_keeps_the_caps_kept() {
    let pair = [bandwidth(40.0), COMPUTE];
    let mut run = Run::new(2, 0.02, 9);
    run.run(&pair, 120);
    let kept = run.kept();
    assert!(kept[0] < FULL);
    let judged = run.changes.len();
    for _ in 0..3_000 {
        run.step(&pair, true);
        assert_eq!(run.caps, kept, "the kept caps, no trial");
    }
    assert_eq!(run.changes.len(), judged, "nothing judged while restricted");
}

#[test]
fn a_counter_that_goes_back_resets_the_group() {
    let pair = [bandwidth(40.0), COMPUTE];
    let mut run = Run::new(2, 0.02, 13);
    run.run(&pair, 120);
    run.progress[1] = 0.0;
    run.step(&pair, false);
    assert_eq!(run.caps, vec![FULL, FULL]);
    assert!(matches!(
        run.changes.last(),
        Some(RedistributeChange::Reset {
            reason: ResetReason::CounterRestarted { .. }
        })
    ));
}

#[test]
fn a_member_that_starts_counting_its_own_units_resets_the_group() {
    let mut redistributor = Redistributor::new(RedistributeConfig::default());
    let member = |name: &str, progress, hinted| Member {
        name: name.into(),
        progress,
        hinted,
        floor: 0,
    };
    let out = redistributor.handle(
        MS,
        &[
            member("a", 0, false),
            member("b", 0, false),
            member("a", 9, false),
        ],
        false,
    );
    assert!(out.caps.is_empty());
    assert_eq!(
        redistributor.status().len(),
        2,
        "a name given twice counts once"
    );
    redistributor.handle(
        2 * MS,
        &[member("a", 5, true), member("b", 5, false)],
        false,
    );
    assert!(redistributor.status()[0].hinted);
}

#[test]
fn a_group_with_a_guaranteed_share_keeps_its_turns_and_no_cap() {
    // A guaranteed share is held by the turns (its weight in the schedule); side by side the
    // hardware would split the GPU, so such a group is never tried side by side, and a cap
    // there binds only where turns overlap: nothing is tried. (Before side by side was a move,
    // the share was a floor for the caps, which then acted on members taking turns.)
    let pair = [bandwidth(40.0), COMPUTE];
    let mut run = Run::new(2, 0.02, 7);
    run.floors = vec![96, 0];
    run.run(&pair, 240);
    // (The probes cap the other member to its floor for a period each; nothing else.)
    assert_eq!(run.kept(), vec![FULL, FULL], "{:?}", run.changes);
    assert!(!run.side_by_side);
    assert!(
        run.changes
            .iter()
            .all(|change| matches!(change, RedistributeChange::Probed { .. })),
        "{:?}",
        run.changes
    );
}

#[test]
fn the_floor_is_half_an_equal_slice_in_steps() {
    let config = RedistributeConfig::default();
    assert_eq!(config.floor(2), 32);
    assert_eq!(config.floor(3), 32);
    assert_eq!(config.floor(4), 16);
    assert_eq!(config.floor(32), 16, "never under one step");
}

#[test]
fn a_bandwidth_bound_phase_that_ends_gives_the_sms_back() {
    let mut run = Run::new(2, 0.02, 17);
    run.run(&[bandwidth(40.0), COMPUTE], 180);
    assert!(run.kept()[0] <= 96, "capped: {:?}", run.changes);
    // The loop turns compute-bound: its cap now costs it more than the other gains.
    let now_compute = Tenant {
        rate: 30.0,
        ..COMPUTE
    };
    run.run(&[now_compute, COMPUTE], 900);
    assert_eq!(run.kept(), vec![FULL, FULL], "{:?}", run.changes);
}

fn tenant_strategy() -> impl Strategy<Value = Tenant> {
    (16.0f64..=128.0, 0.2f64..=1.0, 5.0f64..100.0).prop_map(|(demand, useful_share, rate)| Tenant {
        demand,
        useful: (demand * useful_share).max(8.0),
        rate,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any group: no cap under the floor, one member always uncapped, the work never
    /// measurably under the fallback's once judged, and the same run gives the same caps.
    #[test]
    fn caps_stay_in_bounds_and_never_cost_the_group(
        tenants in proptest::collection::vec(tenant_strategy(), 2..=4),
        sigma in 0.0f64..0.04,
        seed in 1u64..1_000,
    ) {
        let count = tenants.len();
        let floor = RedistributeConfig::default().floor(count);
        let mut run = Run::new(count, sigma, seed);
        run.run(&tenants, 240);
        // Under the group's floor only in probes: one member uncapped, the others at one
        // granule (their own floors are 0), one probe per member in a run shorter than
        // `probe_every_ns`, each at most a longest period.
        let mut probing = 0;
        for (_, caps) in &run.trace {
            prop_assert!(caps.contains(&FULL), "{caps:?}");
            if caps.iter().any(|&cap| cap < floor) {
                probing += 1;
                prop_assert_eq!(caps.iter().filter(|&&cap| cap == FULL).count(), 1, "{:?}", caps);
                prop_assert!(caps.iter().all(|&cap| cap == FULL || cap == 1), "{:?}", caps);
            }
        }
        let config = RedistributeConfig::default();
        prop_assert!(240 * 1_000_000_000 < config.probe_every_ns);
        prop_assert!(
            probing as u64 * TICK <= count as u64 * config.period_max_ns,
            "probes took {probing} ticks"
        );
        let kept = run.kept();
        prop_assert!(
            objective(&tenants, &kept) > 0.97,
            "kept {kept:?}: {:.3} ({:?})",
            objective(&tenants, &kept),
            run.changes
        );
        let mut again = Run::new(count, sigma, seed);
        again.run(&tenants, 240);
        prop_assert_eq!(&again.trace, &run.trace);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Two tenants that make 20 units a second or more: the caps kept reach at least half of
    /// the best caps' gain (or stay within 2% of the fallback where there is little to gain),
    /// and trials cost the group at most 5% over the last two minutes of ten.
    #[test]
    fn two_tenants_reach_half_the_best_gain_and_trials_cost_little(
        a in tenant_strategy(),
        b in tenant_strategy(),
        sigma in 0.0f64..0.04,
        seed in 1u64..1_000,
    ) {
        let measurable = |tenant: Tenant| Tenant {
            rate: tenant.rate.max(20.0),
            ..tenant
        };
        let tenants = vec![measurable(a), measurable(b)];
        let best = best_objective(&tenants);
        let mut run = Run::new(tenants.len(), sigma, seed);
        run.run(&tenants, 600);
        let reached = objective(&tenants, &run.kept());
        prop_assert!(run.mean_objective(120) >= 0.95, "{:?}", run.changes);
        prop_assert!(
            reached >= (1.0 + 0.5 * (best - 1.0)).min(0.98),
            "best {best:.3} reached {reached:.3} kept {:?}",
            run.kept()
        );
    }
}

/// How a driven pair's rates wander: by a factor drawn each tick, or each second.
#[derive(Clone, Copy)]
enum Wander {
    PerTick(f64),
    PerSecond(f64),
}

/// A pair `names` driven for `seconds` at the rates `rates(caps)` (units a second), as the
/// rates wander; what the redistributor did, and the group's work each tick (each rate over
/// `alone`, summed), summed over the run.
struct Driven {
    redistributor: Redistributor,
    changes: Vec<RedistributeChange>,
    work: f64,
    ticks: u64,
}

/// `rates`: the pair's rates side by side at the caps; `turns`: each one's speed (a fraction of
/// `alone`) taking turns, whatever the caps.
fn drive_pair(
    names: [&str; 2],
    rates: impl Fn(&[u8]) -> [f64; 2],
    turns: [f64; 2],
    alone: [f64; 2],
    seconds: u64,
    wander: Wander,
    seed: u64,
) -> Driven {
    let mut redistributor = Redistributor::new(RedistributeConfig::default());
    let mut progress = [0.0f64; 2];
    let mut caps = vec![FULL, FULL];
    let mut side_by_side = false;
    let mut noise = Noise(seed);
    let mut factors = [1.0f64; 2];
    let mut now = 1_000 * MS;
    let mut changes = Vec::new();
    let mut work = 0.0;
    let ticks = seconds * 1_000_000_000 / TICK;
    for _ in 0..ticks {
        let now_rates = if side_by_side {
            rates(&caps)
        } else {
            [turns[0] * alone[0], turns[1] * alone[1]]
        };
        work += now_rates[0] / alone[0] + now_rates[1] / alone[1];
        if let Wander::PerSecond(sigma) = wander
            && now.is_multiple_of(1_000_000_000)
        {
            for factor in &mut factors {
                *factor = 1.0 + sigma * noise.next();
            }
        }
        for (i, (p, rate)) in progress.iter_mut().zip(now_rates).enumerate() {
            let factor = match wander {
                Wander::PerTick(sigma) => 1.0 + sigma * noise.next(),
                Wander::PerSecond(_) => factors[i],
            };
            *p += rate * factor * TICK as f64 / 1e9;
        }
        now += TICK;
        let members: Vec<Member> = names
            .iter()
            .zip(progress)
            .map(|(name, progress)| Member {
                name: (*name).into(),
                progress: progress as u64,
                hinted: false,
                floor: 0,
            })
            .collect();
        let output = redistributor.handle(now, &members, false);
        caps = names
            .iter()
            .map(|name| output.caps.get(*name).copied().unwrap_or(FULL))
            .collect();
        side_by_side = output.side_by_side;
        changes.extend(output.change);
    }
    Driven {
        redistributor,
        changes,
        work,
        ticks,
    }
}

/// The pair measured on an H200 (docs/benchmarks.md, twenty-ninth session): a bf16 GEMM (600
/// units/s alone) beside a 1 GiB copy loop (1965 alone) as MPS clients, uncapped at 0.27 and
/// 0.735 of their speeds alone; the copy loop at 75% of the SMs: 0.32 and 0.64 (its SMs are
/// not idle: the copies need them to keep HBM busy); the GEMM capped: it loses 12% per step
/// and the loop gains 1.5%. Each tenant's rates in between are interpolated; a probe (the other
/// at one granule) reads each alone. Relative speed-ups called the loop's cap a gain (+19% for
/// the GEMM, -13% for the loop: +4.5% measured on the GPU) and kept it; in work alone it costs
/// 4.3%, and the rule must leave the pair uncapped.
fn h200_pair_rates(caps: &[u8]) -> [f64; 2] {
    const ALONE: [f64; 2] = [600.0, 1965.0];
    if caps[1] <= 8 {
        return [ALONE[0], 0.02 * ALONE[1]];
    }
    if caps[0] <= 8 {
        return [0.02 * ALONE[0], ALONE[1]];
    }
    let loop_down = f64::from(FULL - caps[1]) / 32.0;
    let gemm_down = f64::from(FULL - caps[0]) / 16.0;
    let gemm = (0.27 + 0.05 * loop_down) * (1.0 - 0.12 * gemm_down).max(0.0);
    let copy = (0.735 - 0.095 * loop_down).max(0.0) * (1.0 + 0.015 * gemm_down);
    [gemm * ALONE[0], copy * ALONE[1]]
}

#[test]
fn a_cap_that_speeds_a_slow_member_up_but_costs_the_group_work_is_not_kept() {
    let Driven {
        redistributor,
        changes,
        ..
    } = drive_pair(
        ["gemm", "stream"],
        h200_pair_rates,
        // Turns that leave the GPU idle part of the time (0.8 of a tenant's work), so that side
        // by side is kept first and the caps are judged: what this test is about.
        [0.4, 0.4],
        [600.0, 1965.0],
        240,
        Wander::PerTick(0.02),
        29,
    );
    let alone: Vec<Option<f64>> = redistributor.status().iter().map(|s| s.alone).collect();
    assert!(
        alone[0].is_some_and(|rate| (rate / 600.0 - 1.0).abs() < 0.06)
            && alone[1].is_some_and(|rate| (rate / 1965.0 - 1.0).abs() < 0.06),
        "probed rates alone: {alone:?}"
    );
    let kept_down = changes.iter().any(|change| {
        matches!(change, RedistributeChange::Judged { tenant, kept: true, to, from, .. }
            if tenant == "stream" && to < from)
    });
    assert!(!kept_down, "{changes:?}");
    assert_eq!(
        redistributor
            .status()
            .iter()
            .map(|s| s.cap)
            .collect::<Vec<_>>(),
        vec![FULL, FULL],
        "{changes:?}"
    );
}

/// The same pair as an H200 measured it in the thirty-first session (docs/benchmarks.md,
/// "turns or concurrent MPS clients"): taking turns, the GEMM at 0.577 and the copy loop at 0.493
/// of their speeds alone (1.07 of a tenant's work); side by side 1.005 at best. The group stays
/// with its turns, and no cap is tried (under turns a cap moves nothing; on the GPU the GEMM's
/// cap trials cost 12-15% each).
#[test]
fn turns_stay_where_they_do_more_work_and_no_cap_is_tried() {
    let Driven {
        redistributor,
        changes,
        work,
        ticks,
    } = drive_pair(
        ["gemm", "stream"],
        h200_pair_rates,
        [0.577, 0.493],
        [600.0, 1965.0],
        600,
        Wander::PerSecond(0.03),
        37,
    );
    assert!(!redistributor.side_by_side(), "{changes:?}");
    assert!(
        changes.iter().all(|change| matches!(
            change,
            RedistributeChange::Probed { .. } | RedistributeChange::SidesJudged { kept: false, .. }
        )),
        "{changes:?}"
    );
    // The trials side by side (rejected, then waiting 1, 4, 16, ... judgements) cost little.
    let turns = 0.577 + 0.493;
    let mean = work / ticks as f64;
    assert!(mean > 0.97 * turns, "{mean:.3} of {turns:.3}: {changes:?}");
}

/// A launch-bound tenant (small grids, the GPU idle while it launches the next) beside a
/// compute-bound one: taking turns, each runs half the time and the GPU idles through most of
/// the small one's turns; side by side the small one runs at nearly its speed alone and the
/// other takes what it leaves. The group goes side by side within a minute.
#[test]
fn a_launch_bound_tenant_beside_a_compute_bound_one_goes_side_by_side() {
    let mut run = Run::new(2, 0.03, 13);
    run.run(&[SMALL, COMPUTE], 60);
    assert!(run.side_by_side, "{:?}", run.changes);
    assert!(
        run.changes.iter().any(|change| matches!(
            change,
            RedistributeChange::SidesJudged {
                side_by_side: true,
                kept: true,
                ..
            }
        )),
        "{:?}",
        run.changes
    );
    run.run(&[SMALL, COMPUTE], 120);
    // Side by side uncapped is this model's best for the pair (the small one leaves 104 of 128
    // units to the other): the group stays near it.
    assert!(run.mean_objective(60) > 0.95, "{:?}", run.changes);
}

/// The same pair as the H200 ran it in the thirtieth session (docs/benchmarks.md): capping the
/// GEMM to any share below the whole GPU halved it (cuBLAS sizes its persistent grid to every
/// SM of the device, and a green context with fewer SMs runs it in two waves: -12% to -17% of
/// the group's work at 88% and 75%, the GEMM at 0.27 of its speed alone; beside a histogram at
/// 0.51, -25%). Nothing is worth keeping, and trials of a move that measurably costs must not
/// repeat at once: the three pairs of a first judgement read -12% +- 2% as flat (Student's t at
/// 99% with two degrees of freedom is 7) and a twice longer stride was tried straight after,
/// then the single step again, five trials of the GEMM in 100 s (the group lost 5%).
#[test]
fn a_move_that_measurably_costs_is_not_lengthened_or_repeated_at_once() {
    let rates = |caps: &[u8]| {
        let [_, copy] = h200_pair_rates(&[FULL, caps[1]]);
        let [gemm, _] = h200_pair_rates(&[FULL, caps[1]]);
        let halved = if caps[0] < FULL && caps[0] > 8 {
            0.5
        } else {
            1.0
        };
        [gemm * halved, copy]
    };
    // The GPU's rates drift from second to second (the judgements' standard errors there were
    // 1-2% of a member's work): each member's factor is drawn again every second.
    let Driven {
        redistributor,
        changes,
        work,
        ticks,
    } = drive_pair(
        ["gemm", "stream"],
        rates,
        // As above: turns at 0.8 of a tenant's work, so that the caps are judged.
        [0.4, 0.4],
        [600.0, 1965.0],
        300,
        Wander::PerSecond(0.08),
        31,
    );
    let uncapped = {
        let [gemm, copy] = rates(&[FULL, FULL]);
        gemm / 600.0 + copy / 1965.0
    };
    let gemm_trials = changes
        .iter()
        .filter(|change| {
            matches!(change, RedistributeChange::Judged { tenant, to, from, .. }
                if tenant == "gemm" && to < from)
        })
        .count();
    let mean = work / ticks as f64 / uncapped;
    assert!(
        gemm_trials <= 4,
        "{gemm_trials} trials of capping the GEMM in 300 s: {changes:?}"
    );
    assert!(
        mean >= 0.97,
        "the group's work {mean:.3} of uncapped: {changes:?}"
    );
    assert_eq!(
        redistributor
            .status()
            .iter()
            .map(|s| s.cap)
            .collect::<Vec<_>>(),
        vec![FULL, FULL]
    );
}
