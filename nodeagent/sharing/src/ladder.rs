//! The ladder of levels, built from the [`Config`]: level 0 restricts nothing, each level above
//! tightens one lever one notch, and a level's decision holds every tighter notch below it too
//! (cumulative), so the top level is the most protective there is.
//!
//! - Under MPS with a known SM count, SM squeezes come first: each keeps about 3/4 of the SMs
//!   of the one before, rounded down to a granule, down to `sm_min`. Equal relative steps: on a
//!   132-SM H100 with 8-SM granules, 96, 72, 48, 32, 24, 16, 8. (Linear steps of one granule
//!   would spend many levels near "all SMs", where a squeeze changes little.)
//! - Then in-flight caps, halving from `inflight_max` to 1 (8, 4, 2, 1).
//! - Then pause, always last: with in-flight 1 and pause a neighbour has at most one launch per
//!   stream on the GPU while a latency step runs, the nearest thing to being alone.
//!
//! A lever kind can be switched off (`enabled` in [`Ladder::decision`]): its levels are then
//! skipped and its restriction left out of every level's decision. Pause is never switched off.

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
}

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
                    lever: Lever::Sms,
                    sms: next,
                    inflight: 0,
                });
                kept = next;
            }
            if kept > floor {
                rungs.push(Rung {
                    lever: Lever::Sms,
                    sms: floor,
                    inflight: 0,
                });
            }
        }
        let mut cap = config.inflight_max;
        while cap > 0 {
            rungs.push(Rung {
                lever: Lever::Inflight,
                sms: 0,
                inflight: cap,
            });
            cap /= 2;
        }
        rungs.push(Rung {
            lever: Lever::Pause,
            sms: 0,
            inflight: 0,
        });
        assert!(rungs.len() <= usize::from(u8::MAX), "levels fit a u8");
        assert_eq!(rungs.last().map(|r| r.lever), Some(Lever::Pause));
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

    /// What level `level` asks of the neighbours, leaving out the levers `enabled` refuses.
    pub fn decision(&self, level: usize, enabled: impl Fn(Lever) -> bool) -> Decision {
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
            }
        }
        debug_assert!(level == 0 || decision.restricts() || !enabled(Lever::Pause));
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rungs(ladder: &Ladder) -> Vec<(Lever, u16, u8)> {
        ladder
            .rungs
            .iter()
            .map(|r| (r.lever, r.sms, r.inflight))
            .collect()
    }

    #[test]
    fn an_h100_under_mps_squeezes_sms_then_caps_then_pauses() {
        let ladder = Ladder::new(&Config::new(true, 132));
        let sms: Vec<u16> = ladder.rungs.iter().map(|r| r.sms).collect();
        assert_eq!(&sms[..7], [96, 72, 48, 32, 24, 16, 8]);
        assert_eq!(ladder.top(), 12);
        assert_eq!(ladder.levels(Lever::Sms), Some(1..=7));
        assert_eq!(ladder.levels(Lever::Inflight), Some(8..=11));
        assert_eq!(ladder.levels(Lever::Pause), Some(12..=12));
        assert_eq!(ladder.decision(0, |_| true), Decision::default());
        let top = ladder.decision(12, |_| true);
        assert_eq!(
            (top.sms, top.inflight, top.pause, top.level),
            (8, 1, true, 12)
        );
        let without_sms = ladder.decision(9, |lever| lever != Lever::Sms);
        assert_eq!((without_sms.sms, without_sms.inflight), (0, 4));
    }

    #[test]
    fn without_mps_or_sm_count_there_are_caps_and_pause_only() {
        for config in [Config::new(false, 132), Config::new(true, 0)] {
            let ladder = Ladder::new(&config);
            assert_eq!(
                rungs(&ladder),
                [
                    (Lever::Inflight, 0, 8),
                    (Lever::Inflight, 0, 4),
                    (Lever::Inflight, 0, 2),
                    (Lever::Inflight, 0, 1),
                    (Lever::Pause, 0, 0)
                ]
            );
            assert_eq!(ladder.levels(Lever::Sms), None);
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
        assert_eq!(ladder.top(), 2);
    }
}
