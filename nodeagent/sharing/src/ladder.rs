//! The ladder of levels, built from the [`Config`]: level 0 restricts nothing, each level above
//! tightens one lever one notch, and a level's decision holds every tighter notch below it too
//! (cumulative), so the top level is the most protective there is.
//!
//! - Under MPS with a known SM count, SM squeezes come first: each keeps about 3/4 of the SMs
//!   of the one before, rounded down to a granule, down to `sm_min`. Equal relative steps: on a
//!   132-SM H100 with 8-SM granules, 96, 72, 48, 32, 24, 16, 8. (Linear steps of one granule
//!   would spend many levels near "all SMs", where a squeeze changes little.)
//! - Then in-flight caps, halving from `inflight_max` to 1 (8, 4, 2, 1).
//! - Then pause: with in-flight 1 and pause a neighbour has at most one launch per stream on
//!   the GPU while a latency step runs.
//! - Then guards: the neighbours also wait when the latency tenant's next step is predicted
//!   within 1/4, 1/2, 1 and 2 of its step period (the time between its step starts), so that a
//!   step does not start behind a neighbour's kernel launched just before it: the answer to a
//!   neighbour kernel longer than the latency budget. In quarters of the period the controller
//!   measures, so the levels scale with the tenant rather than with constants fitted to one
//!   workload; without a known period they are skipped. A neighbour's interposer stretches the
//!   guard to each launch's own measured duration (*fit*, `interposer::closed_loop`): a launch
//!   goes only if it should end before the next step.
//! - Then Exclusive, always last: the neighbours do not launch while a latency tenant is active
//!   at all. Nothing else runs, so the tenant's latency there is its latency alone.
//!
//! A lever kind can be switched off (`enabled` in [`Ladder::decision`]): its levels are then
//! skipped and its restriction left out of every level's decision. Pause and Exclusive are
//! never switched off. One exception: from Pause up, the in-flight cap of 1 is always in force
//! (when the ladder has the in-flight lever), switched off or not: a pause or a guard holds
//! back new launches, not work already queued, so the queue bound is their prerequisite (on an
//! H200 without MPS, the cap learnt away left eight queued kernels running into every step at
//! Pause and at the guards, and the controller ended at Exclusive).

use crate::types::{Config, Lever};
use tenant_abi::control::Decision;

/// One notch: the lever it tightens and how far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rung {
    pub lever: Lever,
    /// For `Lever::Sms`: the SMs a neighbour keeps.
    pub sms: u16,
    /// For `Lever::Inflight`: the cap.
    pub inflight: u8,
    /// For `Lever::Guard`: the guard in quarters of the latency tenant's step period.
    pub guard_quarters: u8,
}

/// The guard levels, in quarters of the step period: 1/4, 1/2, 1 and 2 periods.
pub const GUARD_QUARTERS: [u8; 4] = [1, 2, 4, 8];

/// Levels `0..=top()`; `rungs[i]` is level `i + 1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladder {
    rungs: Vec<Rung>,
}

impl Ladder {
    pub fn new(config: &Config) -> Ladder {
        let mut rungs = Vec::new();
        let granule = config.sm_granularity;
        let floor = config.sm_min.div_ceil(granule).saturating_mul(granule);
        if config.mps && config.sm_count > floor {
            let mut kept = config.sm_count;
            loop {
                let mut next = (u32::from(kept) * 3 / 4) as u16 / granule * granule;
                if next >= kept {
                    next = kept.saturating_sub(granule);
                }
                if next < floor {
                    break;
                }
                rungs.push(Rung {
                    sms: next,
                    ..Rung::of(Lever::Sms)
                });
                kept = next;
            }
            if kept > floor {
                rungs.push(Rung {
                    sms: floor,
                    ..Rung::of(Lever::Sms)
                });
            }
        }
        let mut cap = config.inflight_max;
        while cap > 0 {
            rungs.push(Rung {
                inflight: cap,
                ..Rung::of(Lever::Inflight)
            });
            cap /= 2;
        }
        rungs.push(Rung::of(Lever::Pause));
        for quarters in GUARD_QUARTERS {
            rungs.push(Rung {
                guard_quarters: quarters,
                ..Rung::of(Lever::Guard)
            });
        }
        rungs.push(Rung::of(Lever::Exclusive));
        assert!(rungs.len() <= usize::from(u8::MAX), "levels fit a u8");
        assert_eq!(rungs.last().map(|r| r.lever), Some(Lever::Exclusive));
        Ladder { rungs }
    }

    /// The most protective level.
    pub fn top(&self) -> usize {
        self.rungs.len()
    }

    /// The lever that level `level` tightens (`None` for level 0).
    pub fn lever(&self, level: usize) -> Option<Lever> {
        assert!(level <= self.top(), "level {level} of {}", self.top());
        level.checked_sub(1).map(|i| self.rungs[i].lever)
    }

    /// The levels of `lever` (`None` when the ladder has none).
    pub fn levels(&self, lever: Lever) -> Option<std::ops::RangeInclusive<usize>> {
        let first = self.rungs.iter().position(|r| r.lever == lever)?;
        let last = self.rungs.iter().rposition(|r| r.lever == lever)?;
        Some(first + 1..=last + 1)
    }

    /// What level `level` asks of the neighbours, leaving out the levers `enabled` refuses;
    /// `step_period_ns` sizes the guards (none without it). Exclusive leaves the guard out: a
    /// neighbour waits for the whole activity of the latency tenant, the guard adds nothing.
    pub fn decision(
        &self,
        level: usize,
        enabled: impl Fn(Lever) -> bool,
        step_period_ns: Option<u64>,
    ) -> Decision {
        assert!(level <= self.top(), "level {level} of {}", self.top());
        let mut decision = Decision {
            level: level as u8,
            ..Decision::default()
        };
        for rung in &self.rungs[..level] {
            if !enabled(rung.lever) {
                continue;
            }
            match rung.lever {
                Lever::Sms => decision.sms = rung.sms,
                Lever::Inflight => decision.inflight = rung.inflight,
                Lever::Pause => decision.pause = true,
                Lever::Guard => {
                    if let Some(period_ns) = step_period_ns {
                        decision.guard_us = guard_us(period_ns, rung.guard_quarters);
                    }
                }
                Lever::Exclusive => {
                    decision.exclusive = true;
                    decision.pause = true;
                    decision.guard_us = 0;
                }
            }
        }
        // The queue bound is a prerequisite of Pause, Guard and Exclusive, not a lever of its
        // own there: they hold back new launches, not work already queued, so with the cap
        // learnt away a neighbour's queued kernels would still run into every latency step.
        let held_back = self.rungs[..level].iter().any(|r| r.lever >= Lever::Pause);
        if held_back && let Some(bound) = self.inflight_bound() {
            decision.inflight = bound;
        }
        debug_assert!(!decision.exclusive || level == self.top());
        debug_assert!(level == 0 || decision.restricts() || !enabled(Lever::Pause));
        decision
    }
}

impl Ladder {
    /// The tightest in-flight cap (1), which every level from Pause up holds whatever was
    /// learnt of the in-flight lever; `None` when the ladder has no in-flight lever.
    pub fn inflight_bound(&self) -> Option<u8> {
        self.rungs
            .iter()
            .filter(|r| r.lever == Lever::Inflight)
            .map(|r| r.inflight)
            .min()
    }
}

impl Rung {
    fn of(lever: Lever) -> Rung {
        Rung {
            lever,
            sms: 0,
            inflight: 0,
            guard_quarters: 0,
        }
    }
}

/// The guard of `quarters` quarters of a step period of `period_ns`, in µs, rounded up to the
/// decision word's unit (so that it reads back as published): at least one unit (a guard of 0
/// is none), at most what the word holds.
pub fn guard_us(period_ns: u64, quarters: u8) -> u32 {
    assert!(quarters > 0);
    let unit = u64::from(tenant_abi::control::GUARD_UNIT_US);
    let us = (period_ns / 1_000).saturating_mul(u64::from(quarters)) / 4;
    let guard = us.div_ceil(unit).clamp(1, 0xFFFF) * unit;
    debug_assert!(guard % unit == 0 && guard <= u64::from(u32::MAX));
    guard as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn rungs(ladder: &Ladder) -> Vec<(Lever, u16, u8, u8)> {
        ladder
            .rungs
            .iter()
            .map(|r| (r.lever, r.sms, r.inflight, r.guard_quarters))
            .collect()
    }

    #[test]
    fn an_h100_under_mps_squeezes_caps_pauses_guards_then_goes_exclusive() {
        let ladder = Ladder::new(&Config::new(true, 132));
        let sms: Vec<u16> = ladder.rungs.iter().map(|r| r.sms).collect();
        assert_eq!(&sms[..7], [96, 72, 48, 32, 24, 16, 8]);
        assert_eq!(ladder.top(), 17);
        assert_eq!(ladder.levels(Lever::Sms), Some(1..=7));
        assert_eq!(ladder.levels(Lever::Inflight), Some(8..=11));
        assert_eq!(ladder.levels(Lever::Pause), Some(12..=12));
        assert_eq!(ladder.levels(Lever::Guard), Some(13..=16));
        assert_eq!(ladder.levels(Lever::Exclusive), Some(17..=17));
        assert_eq!(ladder.decision(0, |_| true, None), Decision::default());
        let pause = ladder.decision(12, |_| true, Some(3 * MS));
        assert_eq!(
            (pause.sms, pause.inflight, pause.pause, pause.guard_us),
            (8, 1, true, 0)
        );
        // Guards in quarters of a 3 ms step period: 750 µs, 1.5 ms, 3 ms, 6 ms (in 16 µs units).
        let guards: Vec<u32> = (13..=16)
            .map(|level| ladder.decision(level, |_| true, Some(3 * MS)).guard_us)
            .collect();
        assert_eq!(guards, [752, 1504, 3008, 6000]);
        let top = ladder.decision(17, |_| true, Some(3 * MS));
        assert_eq!(
            (
                top.sms,
                top.inflight,
                top.pause,
                top.exclusive,
                top.guard_us,
                top.level
            ),
            (8, 1, true, true, 0, 17)
        );
        let without_sms = ladder.decision(9, |lever| lever != Lever::Sms, None);
        assert_eq!((without_sms.sms, without_sms.inflight), (0, 4));
        // Without a period, a guard level asks for no guard (the controller skips it).
        assert_eq!(ladder.decision(14, |_| true, None).guard_us, 0);
    }

    #[test]
    fn without_mps_or_sm_count_there_are_caps_pause_guards_and_exclusive() {
        for config in [Config::new(false, 132), Config::new(true, 0)] {
            let ladder = Ladder::new(&config);
            assert_eq!(
                rungs(&ladder),
                [
                    (Lever::Inflight, 0, 8, 0),
                    (Lever::Inflight, 0, 4, 0),
                    (Lever::Inflight, 0, 2, 0),
                    (Lever::Inflight, 0, 1, 0),
                    (Lever::Pause, 0, 0, 0),
                    (Lever::Guard, 0, 0, 1),
                    (Lever::Guard, 0, 0, 2),
                    (Lever::Guard, 0, 0, 4),
                    (Lever::Guard, 0, 0, 8),
                    (Lever::Exclusive, 0, 0, 0),
                ]
            );
            assert_eq!(ladder.levels(Lever::Sms), None);
        }
    }

    #[test]
    fn guards_are_whole_units_of_the_decision_word() {
        use tenant_abi::control::GUARD_UNIT_US;
        assert_eq!(guard_us(1_000, 1), GUARD_UNIT_US);
        assert_eq!(guard_us(64_000, 1), GUARD_UNIT_US);
        assert_eq!(guard_us(80_000, 4), 80);
        assert_eq!(guard_us(u64::MAX, 8), GUARD_UNIT_US * 0xFFFF);
        for period_ns in [1, 999_999, 3 * MS, 185 * MS] {
            for quarters in GUARD_QUARTERS {
                let guard = guard_us(period_ns, quarters);
                let decision = Decision {
                    pause: true,
                    guard_us: guard,
                    ..Decision::default()
                };
                assert_eq!(Decision::unpack(decision.pack()), decision);
            }
        }
    }

    #[test]
    fn small_gpus_and_odd_floors_end_on_the_floor() {
        let mut config = Config::new(true, 20);
        config.sm_min = 12;
        let ladder = Ladder::new(&config);
        let sms: Vec<u16> = ladder
            .rungs
            .iter()
            .filter(|r| r.lever == Lever::Sms)
            .map(|r| r.sms)
            .collect();
        // 20 * 3/4 = 15 -> 8 in granules, below the floor of 16 (12 rounded up): the floor only.
        assert_eq!(sms, [16]);
        config.inflight_max = 0;
        let ladder = Ladder::new(&config);
        assert_eq!(ladder.levels(Lever::Inflight), None);
        assert_eq!(ladder.top(), 7);
    }
}
