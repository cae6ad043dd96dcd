//! Redistribution of a GPU's SMs among its burst tenants (issue 15, point 4;
//! `docs/design/utility-redistribution.md`): capacity that the latency tenants leave idle goes to
//! the tenants allowed to burst, and when several want it, to the one that turns it into the most
//! work, with turns (max-min fair time shares) as the fallback.
//!
//! **Where it acts.** Among the burst tenants of an MPS node's GPU. Members take turns there
//! like anywhere (the agent gives every fractional tenant its compute shares), and the **first
//! lever is the way they share**: taking turns (the fallback) or *side by side*, launching
//! without waiting for each other's turns (`tenant_abi::control::Control::side_by_side`, which
//! the agent publishes and the interposer reads on its slow path). An H200 measured turns as
//! the better sharing for two GPU-bound tenants (6-7% more of the group's work than the same
//! clients side by side: docs/benchmarks.md, "Utility redistribution: turns or concurrent MPS
//! clients"), while a tenant that leaves the GPU idle in its own turns (launch-bound: small
//! kernels, Python between them) wastes what a neighbour side by side would use. So it is
//! measured per group, like a cap. The **second lever is each member's SM cap**, tried only
//! side by side: between tenants that alternate turns a cap binds only where their work
//! overlaps (the hand-overs), and on the H200 every trial of a GEMM's cap under turns cost it
//! 12-15% for nothing. Side by side, the hardware hands SMs to whichever client has blocks
//! waiting, so a tenant whose blocks stall on memory holds SMs it cannot use (a bandwidth-bound
//! loop beside a compute-bound one keeps half the GPU and gains nothing from it).
//! A group with a guaranteed member (a floor) keeps its turns: its share is held by them, and
//! side by side the hardware would split the GPU. Without MPS the turns alone share the GPU,
//! and this core is not run. A cap (`tenant_abi::control::Control::caps`, in [`FULL`]ths of
//! the GPU) sends the member's launches to a green context of that many SMs. Caps are nested
//! (every green context starts at the GPU's first SMs), so a capped tenant shares its SMs with
//! the others and the rest of the GPU goes to the uncapped: at least one member always stays
//! uncapped.
//!
//! **The measure.** Each member's *progress*: the application's own units where it counts them
//! (`vgpu_progress`), else its steps (synchronisations that waited for its work). Units differ
//! between tenants, so rates are never compared across tenants: each is compared with its own
//! rate **alone**. A move's gain is the **sum over members of `(rate with the move - rate
//! without it) / rate alone`**: the group's extra work in units of one member's work alone
//! (the weighted speedup), which capacity moved to the tenant that turns it into more work
//! raises, and moved away from one that needed it lowers. A sum, not a mean: one member's move
//! would otherwise be diluted by the group's size. Not each member's *relative* speed-up (with
//! / without - 1, what this rule used first): that weighs a member by how slowly it runs now,
//! which is proportional fairness, not work; on an H200 it kept a copy loop at 75% of the SMs
//! because the GEMM beside it, at 27% of its speed alone, gained 19%, while the loop, at 73%,
//! lost 13%: the group lost 4% of a GPU's work (docs/benchmarks.md, twenty-ninth session).
//!
//! **Rates alone** are measured, not assumed: before any move, and again every
//! [`RedistributeConfig::probe_every_ns`], each member gets one *probe* period with every other
//! member capped to its own floor (a guaranteed share stays; the others keep one granule of
//! SMs), its rate then read as its rate alone. Where guaranteed shares keep the others running,
//! the probe reads less than alone and the member's work weighs more than it should: the probe
//! is as alone as the guarantees allow. Probes cost the others one period each, per member, per
//! `probe_every_ns` (under 1% at the defaults for periods of 1-2 s).
//!
//! **The rule.** Start taking turns, uncapped. The first move tried is *side by side*, judged
//! like a cap's move down (kept on a gain of at least the least gain, beyond chance; rejected
//! moves wait 1, 4, 16, ... judgements); once side by side, *back to turns* is tried whenever
//! no cap is kept, judged like a move up (kept unless side by side surely pays). A probe runs
//! side by side (taking turns, the member probed would run in its own turns only and read about
//! half its rate alone, doubling every gain measured against it). Side by side, the caps' moves,
//! one at a time, in turn over the members: *down* (a
//! member's cap one [`RedistributeConfig::step`] lower, never below
//! [`RedistributeConfig::floor`], half its equal slice, nor below its own [`Member::floor`], a
//! guaranteed share) or *up* (a capped member's cap one step higher). A move is judged by
//! periods with and without it, alternated in pairs whose order flips (`B T`, `T B`, `B T`, ...:
//! a drifting rate favours neither side), each period long enough for
//! [`RedistributeConfig::units_min`] units of every member, after the caps settle; the verdict
//! is drawn after [`RedistributeConfig::pairs`] pairs, or another pair is measured while it is
//! unclear, up to [`RedistributeConfig::pairs_max`]. Chance is judged with Student's t at 99%
//! over the pairs' gains. A cap stays only while it measurably pays:
//! - a move *down* is **kept** when its gain is at least [`RedistributeConfig::gain_min`] and
//!   beyond chance; *worse* when it surely costs; *flat* when it cannot reach the least gain but
//!   does not surely cost either (the cap may not bind yet): tried again at once with twice the
//!   stride (up to [`FLAT_STRIDE_MAX`] steps), unless its mean loss is already past the least
//!   gain (the cap binds and costs; three pairs just cannot call it sure): then it waits like a
//!   worse move, and so does the single step after a longer stride that surely cost;
//! - a move *up* is kept unless it surely costs half the least gain (ties go back to the
//!   fallback), so a cap that does not measurably pay comes off, and a cap just kept is not
//!   undone by the same measurement read backwards.
//!
//! A kept move is tried again with twice the stride (up to [`STRIDE_MAX`] steps: the climb goes
//! on while it pays), and its opposite waits; a longer stride that surely costs falls back to
//! one step; one step further down that surely costs has the move up tried next (does the cap
//! kept still pay?). A rejected move waits 1, 4, 16, ... judgements' time (up to
//! [`RedistributeConfig::backoff_max`]; waits pass only while no move is tried, so trials take a
//! falling share of the time), so a group that changed (a bandwidth-bound phase ends) finds its
//! way back. Equal slopes (two compute-bound tenants: what one gains the other loses) gain
//! nothing, and the group stays uncapped; the trials themselves cost the member tried (see
//! `redistribute_test.rs`: over ten minutes, 0.90-1.07 of an equal member's work).
//!
//! **Resets** to the fallback (turns, every cap off, everything learnt forgotten): a member joins or
//! leaves, starts counting its own units or changes its floor, its counter restarts (its slot
//! was reused), or a member makes no progress for a whole [`RedistributeConfig::period_max_ns`]
//! (*unmeasured*: nothing can be judged; the group waits
//! [`RedistributeConfig::unmeasured_wait_ns`] uncapped before trying again). While the closed
//! loop restricts the neighbours for a latency tenant (`restricted`), nothing is measured: the
//! judgement under way is dropped, the caps kept stay, and it starts again after.
//!
//! A sans-IO core like [`crate::Controller`]: the time comes in, no clock, no randomness; the
//! same events give the same outputs.

use std::collections::BTreeMap;

/// A cap of the whole GPU: uncapped (`tenant_abi::control::CAP_UNITS`).
pub const FULL: u8 = tenant_abi::control::CAP_UNITS;

/// Settings of one GPU's redistribution; [`RedistributeConfig::default`] gives the defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct RedistributeConfig {
    /// The shortest measured period.
    pub period_min_ns: u64,
    /// The longest: a period ends here even with fewer than `units_min` units of a member, and
    /// a member with none is unmeasured.
    pub period_max_ns: u64,
    /// Units of progress each member should make in a period (the rates' quantisation is then
    /// under 1/`units_min`).
    pub units_min: u64,
    /// Time left out of the measure after the caps change (the work queued under the old caps
    /// drains).
    pub settle_ns: u64,
    /// How far one move shifts a cap, in [`FULL`]ths of the GPU.
    pub step: u8,
    /// Pairs of periods (with and without the move) before a move is judged, and the most: a
    /// move whose gain is not yet clear either way gets another pair, up to `pairs_max`.
    pub pairs: u32,
    pub pairs_max: u32,
    /// The least gain that keeps a move, in members' work alone (2%: the group does 2% of one
    /// member's work alone more).
    pub gain_min: f64,
    /// The longest wait, in judgements, of a move that was rejected again and again.
    pub backoff_max: u32,
    /// How long an unmeasured group stays uncapped before it is tried again.
    pub unmeasured_wait_ns: u64,
    /// How long a member's rate alone (its probe) stands before it is measured again.
    pub probe_every_ns: u64,
}

impl Default for RedistributeConfig {
    /// Periods of 1-8 s holding at least 20 units per member, 200 ms to settle, moves of 1/8 of
    /// the GPU, 3 to 6 pairs per judgement, a 2% gain needed, waits of up to 32 judgements, 60 s
    /// uncapped after an unmeasured period, and each member's rate alone measured again every
    /// 5 minutes.
    fn default() -> RedistributeConfig {
        RedistributeConfig {
            period_min_ns: 1_000_000_000,
            period_max_ns: 8_000_000_000,
            units_min: 20,
            settle_ns: 200_000_000,
            step: 16,
            pairs: 3,
            pairs_max: 6,
            gain_min: 0.02,
            backoff_max: 32,
            unmeasured_wait_ns: 60_000_000_000,
            probe_every_ns: 300_000_000_000,
        }
    }
}

impl RedistributeConfig {
    /// Asserts that the settings make sense together (programmer errors).
    pub fn assert_valid(&self) {
        assert!(0 < self.period_min_ns && self.period_min_ns <= self.period_max_ns);
        assert!(self.units_min > 0, "a period holds some progress");
        assert!(0 < self.step && self.step < FULL, "a step within the GPU");
        assert!(self.pairs >= 2, "a spread needs two pairs at least");
        assert!(self.pairs <= self.pairs_max);
        assert!(
            self.gain_min.is_finite() && self.gain_min > 0.0,
            "a positive least gain: {}",
            self.gain_min
        );
        assert!(self.backoff_max >= 1);
    }

    /// The lowest cap a member of a group of `members` may get: half its equal slice of the GPU,
    /// rounded up to a step (never below one step).
    pub fn floor(&self, members: usize) -> u8 {
        let half_slice = u32::from(FULL).div_ceil(2 * members.max(1) as u32);
        let step = u32::from(self.step);
        (half_slice.div_ceil(step) * step).clamp(step, u32::from(FULL)) as u8
    }
}

/// A burst tenant sharing the GPU, as the agent reads its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// Its progress counter (`tenant_abi::compute::TenantSlot::progress`, without the flag).
    pub progress: u64,
    /// The counter holds the application's own units, not steps.
    pub hinted: bool,
    /// The lowest cap it may get, in [`FULL`]ths (a guaranteed share); the group's floor
    /// applies too.
    pub floor: u8,
}

/// Which way a move shifts a member's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Down,
    Up,
}

/// Why every cap came off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetReason {
    /// A member joined or left, or started counting its own units.
    Members,
    /// `tenant` made no progress in a whole period: the group cannot be judged.
    Unmeasured { tenant: String },
    /// `tenant`'s counter went back (its slot was given to another process group).
    CounterRestarted { tenant: String },
}

/// What changed in one call.
#[derive(Debug, Clone, PartialEq)]
pub enum RedistributeChange {
    /// A move was judged: `tenant`'s cap `from` -> `to`, the mean gain of the objective and
    /// its standard error over the pairs; `kept`: the caps now hold it.
    Judged {
        tenant: String,
        from: u8,
        to: u8,
        gain: f64,
        stderr: f64,
        kept: bool,
    },
    /// Every cap came off.
    Reset { reason: ResetReason },
    /// `tenant`'s rate alone was measured (a probe): `rate` units or steps per second, with
    /// every other member at its floor.
    Probed { tenant: String, rate: f64 },
    /// The members side by side (`side_by_side: true`: launching without waiting for turns)
    /// or back to turns was judged: the mean gain and its standard error; `kept`: the group now
    /// shares that way.
    SidesJudged {
        side_by_side: bool,
        gain: f64,
        stderr: f64,
        kept: bool,
    },
}

/// One member as the agent reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberStatus {
    pub name: String,
    /// The cap it keeps (not a move under trial), in [`FULL`]ths; [`FULL`]: uncapped.
    pub cap: u8,
    /// Its progress per second in the last period measured at the kept caps (units or steps).
    pub rate: Option<f64>,
    /// Its rate alone, from its last probe (same unit).
    pub alone: Option<f64>,
    pub hinted: bool,
    /// Its group shares the GPU side by side (kept, not a trial); `false`: by turns.
    pub side_by_side: bool,
}

/// What one call leads to.
#[derive(Debug, Clone, PartialEq)]
pub struct RedistributeOutput {
    /// The caps in force now, by member name; a member not named is uncapped. Published every
    /// period (caps expire).
    pub caps: BTreeMap<String, u8>,
    /// Whether the members launch side by side now (without waiting for each other's turns);
    /// `false`: they take turns, the fallback.
    pub side_by_side: bool,
    pub change: Option<RedistributeChange>,
}

/// A move's wait after rejections.
#[derive(Debug, Clone, Copy, Default)]
struct Backoff {
    /// Judgements it still sits out.
    skip: u32,
    /// Its next wait when rejected (0: 1).
    length: u32,
    /// Steps its next trial moves (0: 1): doubled after each kept move, to at most
    /// [`STRIDE_MAX`], back to 1 after a rejection.
    stride: u8,
    /// A longer stride surely cost since the last wait: a flat verdict waits instead of
    /// lengthening the stride again.
    shortened: bool,
    /// The stride was lengthened after a flat verdict (not after a kept move): if the longer
    /// one surely costs, the single step, already judged flat, waits instead of being tried
    /// again at once.
    after_flat: bool,
}

impl Backoff {
    /// Rejected: it sits out its next wait, and the one after is four times longer (to at most
    /// `max` judgements).
    fn rejected(&mut self, max: u32) {
        self.skip = self.length.max(1);
        self.length = (self.skip * 4).min(max);
        self.shortened = false;
        self.after_flat = false;
    }
}

/// The most steps one move shifts a cap (after moves that kept paying).
pub const STRIDE_MAX: u8 = 4;
/// The most steps a move is lengthened to after flat verdicts: a cap that does not bind one
/// step down is tried two steps down, no further (each trial costs the capped member).
pub const FLAT_STRIDE_MAX: u8 = 2;

#[derive(Debug, Clone)]
enum Stage {
    /// Fewer than two members: nothing to share.
    Idle,
    /// Uncapped until then (after an unmeasured period).
    Waiting { until_ns: u64 },
    /// The caps of the next period are in force; measured from then.
    Settling { until_ns: u64 },
    Measuring {
        since_ns: u64,
        start: Vec<u64>,
        /// The period's length, fixed when it starts (`Redistributor::period_ns`); `None`
        /// until every member's rate is known: then it ends once each made `units_min` units.
        length_ns: Option<u64>,
    },
}

/// The move under judgement and the rates measured for it.
#[derive(Debug, Clone)]
struct Judgement {
    /// `None`: a hold (every move waits): periods at the kept caps, then the waits shrink.
    member: Option<usize>,
    /// A probe of `member`'s rate alone (one period, every other member at its floor), not a
    /// move.
    probe: bool,
    /// The move is the group's way of sharing (`member` is `None`): side by side when the
    /// direction is `Down` (away from the fallback), back to turns when `Up`.
    sides: bool,
    direction: Direction,
    to: u8,
    /// The periods' kinds in order (true: with the move).
    order: Vec<bool>,
    /// Each measured period's rates, in order.
    rates: Vec<Vec<f64>>,
    /// Each measured period's length, in seconds (its rates' resolution: one unit in it).
    seconds: Vec<f64>,
}

/// One GPU's redistribution (see the module's docs).
#[derive(Debug, Clone)]
pub struct Redistributor {
    config: RedistributeConfig,
    /// The members' names, sorted, whether each counts its own units, and its own floor.
    names: Vec<String>,
    hinted: Vec<bool>,
    floors: Vec<u8>,
    /// The caps kept, per member.
    kept: Vec<u8>,
    /// Per member, per direction (`Direction as usize`).
    backoff: Vec<[Backoff; 2]>,
    /// Whether the members share side by side (kept; `false`: turns, the fallback), and the
    /// waits of the moves there (`Down`) and back (`Up`).
    side_by_side: bool,
    sides: [Backoff; 2],
    /// The next move to try, over `2 * members` moves (member `i / 2`, down when even).
    cursor: usize,
    judgement: Option<Judgement>,
    stage: Stage,
    last_progress: Vec<u64>,
    last_rates: Vec<Option<f64>>,
    /// Per member: its rate alone and when its probe ended.
    alone: Vec<Option<(f64, u64)>>,
    /// The time of the last call.
    now_ns: u64,
}

impl Redistributor {
    pub fn new(config: RedistributeConfig) -> Redistributor {
        config.assert_valid();
        Redistributor {
            config,
            names: Vec::new(),
            hinted: Vec::new(),
            floors: Vec::new(),
            kept: Vec::new(),
            backoff: Vec::new(),
            side_by_side: false,
            sides: [Backoff::default(); 2],
            cursor: 0,
            judgement: None,
            stage: Stage::Idle,
            last_progress: Vec::new(),
            last_rates: Vec::new(),
            alone: Vec::new(),
            now_ns: 0,
        }
    }

    pub fn config(&self) -> &RedistributeConfig {
        &self.config
    }

    /// One period of the agent at `now_ns` with the GPU's burst `members` (any order;
    /// a name given twice counts once) and whether the closed loop restricts them now.
    pub fn handle(
        &mut self,
        now_ns: u64,
        members: &[Member],
        restricted: bool,
    ) -> RedistributeOutput {
        let mut members: Vec<&Member> = members.iter().collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        members.dedup_by(|a, b| a.name == b.name);
        self.now_ns = now_ns;
        let mut change = None;
        let same_group = members.len() == self.names.len()
            && members
                .iter()
                .zip(self.names.iter().zip(&self.hinted))
                .all(|(member, (name, hinted))| member.name == *name && member.hinted == *hinted)
            && members
                .iter()
                .zip(&self.floors)
                .all(|(member, floor)| member.floor == *floor);
        if !same_group {
            let capped = self.kept.iter().any(|&cap| cap < FULL) || self.trial_in_force();
            self.regroup(&members, now_ns);
            if capped {
                change = Some(RedistributeChange::Reset {
                    reason: ResetReason::Members,
                });
            }
        } else if let Some(index) =
            (0..members.len()).find(|&index| members[index].progress < self.last_progress[index])
        {
            let tenant = self.names[index].clone();
            self.regroup(&members, now_ns);
            change = Some(RedistributeChange::Reset {
                reason: ResetReason::CounterRestarted { tenant },
            });
        }
        self.last_progress = members.iter().map(|member| member.progress).collect();
        if matches!(self.stage, Stage::Idle) {
            return self.output(change);
        }
        if restricted {
            // Nothing measured beside a restricted GPU; the judgement starts again after it.
            self.judgement = None;
            self.stage = Stage::Settling {
                until_ns: now_ns.saturating_add(self.config.settle_ns),
            };
            return self.output(change);
        }
        match &self.stage {
            Stage::Idle => unreachable!("returned above"),
            Stage::Waiting { until_ns } if now_ns < *until_ns => {}
            Stage::Waiting { .. } => self.settle(now_ns),
            Stage::Settling { until_ns } if now_ns < *until_ns => {}
            Stage::Settling { .. } => {
                self.stage = Stage::Measuring {
                    since_ns: now_ns,
                    start: self.last_progress.clone(),
                    length_ns: self.period_ns(),
                };
            }
            Stage::Measuring {
                since_ns,
                start,
                length_ns,
            } => {
                let elapsed_ns = now_ns.saturating_sub(*since_ns);
                let units: Vec<u64> = self
                    .last_progress
                    .iter()
                    .zip(start)
                    .map(|(now, start)| now - start)
                    .collect();
                // A probe measures its member alone; the others, at their floors, may make
                // nothing in it.
                let probed = self.probed_now();
                let counted = |index: usize| probed.is_none_or(|member| member == index);
                let enough = (0..units.len())
                    .filter(|&index| counted(index))
                    .all(|index| units[index] >= self.config.units_min);
                if elapsed_ns >= self.config.period_max_ns
                    && let Some(index) =
                        (0..units.len()).find(|&index| counted(index) && units[index] == 0)
                {
                    let tenant = self.names[index].clone();
                    self.regroup_unmeasured(now_ns);
                    return self.output(Some(RedistributeChange::Reset {
                        reason: ResetReason::Unmeasured { tenant },
                    }));
                }
                let ended = match length_ns {
                    Some(length_ns) => elapsed_ns >= *length_ns,
                    None => elapsed_ns >= self.config.period_min_ns && enough,
                };
                if ended || elapsed_ns >= self.config.period_max_ns {
                    let seconds = elapsed_ns as f64 / 1e9;
                    let rates: Vec<f64> = units.iter().map(|&u| u as f64 / seconds).collect();
                    if let Some(judged) = self.period_ended(rates, seconds, now_ns) {
                        change = Some(judged);
                    }
                }
            }
        }
        self.output(change)
    }

    /// How long the next period runs: long enough for `units_min` units of the slowest member
    /// at its last rate with a quarter to spare, within the periods' bounds. Fixed in advance,
    /// not "until the slowest made `units_min`": a period that stops when a member's count
    /// crosses a mark reads that member's rate high (by up to one unit in `units_min`), and
    /// the member slowed by a cap is the one that stops it, so such periods made a cap look
    /// cheaper than it was (in simulation, equal tenants kept caps on 3-5% "gains").
    /// A probe's period still ends once its member made `units_min` units: only that member
    /// counts there, its rate alone is unknown until then, and the rate it reads is high by at
    /// most one unit in `units_min`.
    fn period_ns(&self) -> Option<u64> {
        if self.probed_now().is_some() {
            return None;
        }
        let slowest = self
            .last_rates
            .iter()
            .map(|rate| rate.filter(|rate| *rate > 0.0))
            .collect::<Option<Vec<f64>>>()?
            .into_iter()
            .fold(f64::INFINITY, f64::min);
        let seconds = self.config.units_min as f64 / slowest * 1.25;
        let length_ns = (seconds * 1e9).min(self.config.period_max_ns as f64) as u64;
        Some(length_ns.clamp(self.config.period_min_ns, self.config.period_max_ns))
    }

    /// Each member's kept cap and last rate at the kept caps.
    pub fn status(&self) -> Vec<MemberStatus> {
        self.names
            .iter()
            .enumerate()
            .map(|(index, name)| MemberStatus {
                name: name.clone(),
                cap: self.kept[index],
                rate: self.last_rates[index],
                alone: self.alone[index].map(|(rate, _)| rate),
                hinted: self.hinted[index],
                side_by_side: self.side_by_side,
            })
            .collect()
    }

    /// A new group: every cap off, everything learnt forgotten, measured after the settling.
    fn regroup(&mut self, members: &[&Member], now_ns: u64) {
        let count = members.len();
        self.names = members.iter().map(|member| member.name.clone()).collect();
        self.hinted = members.iter().map(|member| member.hinted).collect();
        self.floors = members.iter().map(|member| member.floor).collect();
        self.forget(count);
        self.last_rates = vec![None; count];
        self.alone = vec![None; count];
        self.stage = if count < 2 {
            Stage::Idle
        } else {
            Stage::Settling {
                until_ns: now_ns.saturating_add(self.config.settle_ns),
            }
        };
    }

    /// Every cap off and everything learnt of the moves forgotten, for `count` members.
    fn forget(&mut self, count: usize) {
        self.kept = vec![FULL; count];
        self.backoff = vec![[Backoff::default(); 2]; count];
        self.side_by_side = false;
        self.sides = [Backoff::default(); 2];
        self.cursor = 0;
        self.judgement = None;
    }

    fn regroup_unmeasured(&mut self, now_ns: u64) {
        self.forget(self.names.len());
        self.stage = Stage::Waiting {
            until_ns: now_ns.saturating_add(self.config.unmeasured_wait_ns),
        };
    }

    fn settle(&mut self, now_ns: u64) {
        self.stage = Stage::Settling {
            until_ns: now_ns.saturating_add(self.config.settle_ns),
        };
    }

    /// The member whose probe is in force in the period under way, if one is.
    fn probed_now(&self) -> Option<usize> {
        let judgement = self.judgement.as_ref()?;
        (judgement.probe && self.trial_in_force())
            .then_some(judgement.member)
            .flatten()
    }

    /// Whether the period under way runs with a move under trial.
    fn trial_in_force(&self) -> bool {
        let Some(judgement) = &self.judgement else {
            return false;
        };
        (judgement.member.is_some() || judgement.sides)
            && judgement
                .order
                .get(judgement.rates.len())
                .copied()
                .unwrap_or(false)
    }

    /// The caps in force now, by name (uncapped members left out).
    fn output(&mut self, change: Option<RedistributeChange>) -> RedistributeOutput {
        if !matches!(self.stage, Stage::Idle | Stage::Waiting { .. }) && self.judgement.is_none() {
            self.judgement = Some(self.next_judgement());
        }
        let mut caps: Vec<u8> = self.kept.clone();
        if self.trial_in_force()
            && let Some(judgement) = &self.judgement
            && let Some(member) = judgement.member
        {
            if judgement.probe {
                for (other, cap) in caps.iter_mut().enumerate() {
                    *cap = if other == member {
                        FULL
                    } else {
                        self.floors[other].max(1)
                    };
                }
            } else {
                caps[member] = judgement.to;
            }
        }
        let caps = self
            .names
            .iter()
            .zip(caps)
            .filter(|(_, cap)| *cap < FULL)
            .map(|(name, cap)| (name.clone(), cap))
            .collect();
        let sides_tried = self.trial_in_force() && self.judgement.as_ref().is_some_and(|j| j.sides);
        // A probe runs side by side: taking turns, the member probed would run in its own turns
        // only (the others, at their floors, still take theirs) and read about half its rate
        // alone, which doubles every gain measured against it (in simulation, noise then kept
        // moves that cost 10%).
        let probing = self.probed_now().is_some() && self.sides_allowed();
        RedistributeOutput {
            caps,
            side_by_side: (self.side_by_side != sides_tried) || probing,
            change,
        }
    }

    /// Whether member `index` may move `direction` from the kept caps, and to what cap.
    fn allowed(&self, index: usize, direction: Direction) -> Option<u8> {
        let cap = u16::from(self.kept[index]);
        let shift = u16::from(self.config.step)
            * u16::from(self.backoff[index][direction as usize].stride.max(1));
        match direction {
            Direction::Up => {
                (cap < u16::from(FULL)).then(|| (cap + shift).min(u16::from(FULL)) as u8)
            }
            Direction::Down => {
                // A long stride past the floor stops at it.
                let floor = u16::from(self.config.floor(self.kept.len()).max(self.floors[index]));
                let to = cap.saturating_sub(shift).max(floor);
                let others_uncapped = self
                    .kept
                    .iter()
                    .enumerate()
                    .any(|(other, &cap)| other != index && cap == FULL);
                (to < cap && others_uncapped).then_some(to as u8)
            }
        }
    }

    /// Periods without and with a move, in pairs whose order flips.
    fn pairs_order(pairs: u32) -> Vec<bool> {
        (0..pairs)
            .flat_map(|pair| {
                if pair % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                }
            })
            .collect()
    }

    /// Whether the group may try side by side: two members or more, none with a guaranteed
    /// share (a share is held by turns; side by side the hardware splits the GPU).
    fn sides_allowed(&self) -> bool {
        self.names.len() >= 2 && self.floors.iter().all(|&floor| floor == 0)
    }

    /// Whether the members share side by side (kept, not a trial).
    pub fn side_by_side(&self) -> bool {
        self.side_by_side
    }

    /// The next move not sitting out a wait, from the cursor on; a hold when there is none.
    fn next_judgement(&mut self) -> Judgement {
        let now_ns = self.now_ns;
        let every_ns = self.config.probe_every_ns;
        if let Some(index) = self.alone.iter().position(|alone| match alone {
            None => true,
            Some((_, at_ns)) => now_ns.saturating_sub(*at_ns) >= every_ns,
        }) {
            return Judgement {
                member: Some(index),
                probe: true,
                sides: false,
                direction: Direction::Down,
                to: FULL,
                // A period at the kept caps first: a group just formed starts uncapped.
                order: vec![false, true],
                rates: Vec::new(),
                seconds: Vec::new(),
            };
        }
        // The way of sharing first: side by side (away from turns), or back to turns once no
        // cap is kept (caps bind only side by side).
        let direction = if self.side_by_side {
            Direction::Up
        } else {
            Direction::Down
        };
        if self.sides_allowed()
            && self.sides[direction as usize].skip == 0
            && self.kept.iter().all(|&cap| cap == FULL)
        {
            return Judgement {
                member: None,
                probe: false,
                sides: true,
                direction,
                to: FULL,
                order: Self::pairs_order(self.config.pairs_max),
                rates: Vec::new(),
                seconds: Vec::new(),
            };
        }
        let moves = if self.side_by_side {
            2 * self.names.len()
        } else {
            0
        };
        for offset in 0..moves {
            let candidate = (self.cursor + offset) % moves;
            let (index, direction) = (
                candidate / 2,
                if candidate.is_multiple_of(2) {
                    Direction::Down
                } else {
                    Direction::Up
                },
            );
            if self.backoff[index][direction as usize].skip > 0 {
                continue;
            }
            if let Some(to) = self.allowed(index, direction) {
                self.cursor = candidate;
                let order = Self::pairs_order(self.config.pairs_max);
                return Judgement {
                    member: Some(index),
                    probe: false,
                    sides: false,
                    direction,
                    to,
                    order,
                    rates: Vec::new(),
                    seconds: Vec::new(),
                };
            }
        }
        // As long as a judgement's first pairs: a wait of n judgements lasts about n
        // judgements' time, so that trials take a bounded share of the time however long the
        // group stays.
        Judgement {
            member: None,
            probe: false,
            sides: false,
            direction: Direction::Down,
            to: FULL,
            order: vec![false; 2 * self.config.pairs as usize],
            rates: Vec::new(),
            seconds: Vec::new(),
        }
    }

    /// A period ended with `rates`: the judgement is made once its pairs say enough, else the
    /// next period starts (after settling if the caps change).
    fn period_ended(
        &mut self,
        rates: Vec<f64>,
        seconds: f64,
        now_ns: u64,
    ) -> Option<RedistributeChange> {
        let judgement = self.judgement.as_mut().expect("a judgement under way");
        let with_move = judgement.order[judgement.rates.len()];
        let is_move = judgement.member.is_some() || judgement.sides;
        if !with_move || !is_move {
            self.last_rates = rates.iter().map(|&rate| Some(rate)).collect();
        }
        if judgement.probe && with_move {
            let member = judgement.member.expect("a probe has a member");
            let rate = rates[member];
            self.judgement = None;
            // A member that made nothing alone is unmeasured: the period's own rule (a member
            // without progress for a whole period) resets the group; here it waits for that.
            if rate > 0.0 {
                self.alone[member] = Some((rate, now_ns));
            }
            self.settle(now_ns);
            return (rate > 0.0).then(|| RedistributeChange::Probed {
                tenant: self.names[member].clone(),
                rate,
            });
        }
        judgement.rates.push(rates);
        judgement.seconds.push(seconds);
        let measured = judgement.rates.len();
        let verdict = if !is_move {
            (measured == judgement.order.len()).then_some(Verdict::Hold)
        } else if measured.is_multiple_of(2) && measured / 2 >= self.config.pairs as usize {
            Self::verdict(&self.config, judgement, &self.alone)
        } else {
            None
        };
        let Some(verdict) = verdict else {
            let next = judgement.order[measured];
            if next == with_move {
                self.stage = Stage::Measuring {
                    since_ns: now_ns,
                    start: self.last_progress.clone(),
                    length_ns: self.period_ns(),
                };
            } else {
                self.settle(now_ns);
            }
            return None;
        };
        let judgement = self.judgement.take().expect("a judgement under way");
        let change = self.judge(&judgement, verdict);
        // The next judgement starts from the kept caps: settle if the last period had others.
        let kept = matches!(change, Some(RedistributeChange::Judged { kept: true, .. }));
        if with_move != kept && is_move {
            self.settle(now_ns);
        } else {
            self.stage = Stage::Measuring {
                since_ns: now_ns,
                start: self.last_progress.clone(),
                length_ns: self.period_ns(),
            };
        }
        change
    }

    /// The gain of each measured pair: the sum over members of `(rate with the move - rate
    /// without it) / rate alone` (in units of one member's work alone; a member not yet probed
    /// counts by its rate without the move).
    fn gains(judgement: &Judgement, alone: &[Option<(f64, u64)>]) -> Vec<f64> {
        judgement
            .rates
            .chunks_exact(2)
            .zip(judgement.order.chunks_exact(2))
            .map(|(pair, kinds)| {
                let (with, without) = if kinds[0] {
                    (&pair[0], &pair[1])
                } else {
                    (&pair[1], &pair[0])
                };
                with.iter()
                    .zip(without)
                    .zip(alone)
                    .map(|((with, without), alone)| {
                        let scale = alone.map_or(*without, |(rate, _)| rate);
                        if scale > 0.0 {
                            (with - without) / scale
                        } else {
                            0.0
                        }
                    })
                    .sum::<f64>()
            })
            .collect()
    }

    /// The mean gain of the pairs measured so far, its standard error (at least the counts'
    /// resolution), and how many pairs.
    fn estimate(judgement: &Judgement, alone: &[Option<(f64, u64)>]) -> (f64, f64, usize) {
        let gains = Redistributor::gains(judgement, alone);
        let (gain, stderr) = mean_and_stderr(&gains);
        let stderr = stderr.max(Redistributor::resolution(judgement, alone));
        (gain, stderr, gains.len())
    }

    /// The standard error that the counts' own resolution leaves in the mean gain, whatever
    /// the pairs' spread: a rate counted over a period of `T` s is off by up to one unit, a
    /// rounding with a variance of `1 / 12` unit, so each member adds `(1/T_with^2 +
    /// 1/T_without^2) / 12 / alone^2` to a pair's variance. Periods hold some 20 units, so two
    /// pairs of steady rates can agree to the digit and a 2% gain read "beyond chance" with a
    /// standard error of 0 was noise in 1 of 20 counts (in simulation, an equal pair kept a
    /// cap for minutes on it).
    fn resolution(judgement: &Judgement, alone: &[Option<(f64, u64)>]) -> f64 {
        let pairs = judgement.seconds.len() / 2;
        if pairs == 0 {
            return 0.0;
        }
        let variance: f64 = judgement
            .seconds
            .chunks_exact(2)
            .zip(judgement.rates.chunks_exact(2))
            .map(|(lengths, pair)| {
                let per_unit = (lengths[0].powi(-2) + lengths[1].powi(-2)) / 12.0;
                pair[0]
                    .iter()
                    .zip(&pair[1])
                    .zip(alone)
                    .map(|((first, second), alone)| {
                        let scale = alone.map_or(first.max(*second), |(rate, _)| rate);
                        if scale > 0.0 {
                            per_unit / (scale * scale)
                        } else {
                            0.0
                        }
                    })
                    .sum::<f64>()
            })
            .sum();
        variance.sqrt() / pairs as f64
    }

    /// What the pairs measured so far say of the move under judgement; `None`: another pair.
    fn verdict(
        config: &RedistributeConfig,
        judgement: &Judgement,
        alone: &[Option<(f64, u64)>],
    ) -> Option<Verdict> {
        let (gain, stderr, pairs) = Redistributor::estimate(judgement, alone);
        let margin = t_critical(pairs - 1) * stderr;
        let least = config.gain_min;
        let last = pairs >= config.pairs_max as usize;
        match judgement.direction {
            // Kept on a gain of at least `gain_min`, beyond chance; worse when it surely
            // costs; flat when it cannot reach the least gain but does not surely cost (the
            // cap may not bind yet: a longer stride).
            Direction::Down => {
                if gain >= least && gain > margin {
                    Some(Verdict::Keep)
                } else if gain + margin < 0.0 {
                    Some(Verdict::Worse)
                } else if gain + margin < least || last {
                    Some(Verdict::Flat)
                } else {
                    None
                }
            }
            // Towards the fallback: the cap stays only if it surely pays half the least gain;
            // kept once that is out of reach, or at the last look (ties go to the fallback).
            Direction::Up => {
                let cost = -gain;
                if cost >= least / 2.0 && cost > margin {
                    Some(Verdict::Worse)
                } else if cost + margin < least / 2.0 || last {
                    Some(Verdict::Keep)
                } else {
                    None
                }
            }
        }
    }

    /// Applies a verdict: the caps, strides and waits; what to report.
    fn judge(&mut self, judgement: &Judgement, verdict: Verdict) -> Option<RedistributeChange> {
        // Waits pass only in holds (not in other moves' trials), so that however many members
        // there are, trials take a share of the time that falls as they keep failing.
        if verdict == Verdict::Hold {
            for wait in self
                .backoff
                .iter_mut()
                .flatten()
                .chain(self.sides.iter_mut())
            {
                wait.skip = wait.skip.saturating_sub(1);
            }
        }
        if judgement.sides {
            let (gain, stderr, _) = Self::estimate(judgement, &self.alone);
            let direction = judgement.direction as usize;
            let kept = verdict == Verdict::Keep;
            if kept {
                self.side_by_side = !self.side_by_side;
                self.sides[direction] = Backoff::default();
                let opposite = &mut self.sides[1 - direction];
                opposite.skip = opposite.skip.max(2);
            } else {
                self.sides[direction].rejected(self.config.backoff_max);
            }
            return Some(RedistributeChange::SidesJudged {
                side_by_side: judgement.direction == Direction::Down,
                gain,
                stderr,
                kept,
            });
        }
        let member = judgement.member?;
        let (gain, stderr, _) = Self::estimate(judgement, &self.alone);
        let from = self.kept[member];
        let direction = judgement.direction as usize;
        let stride = self.backoff[member][direction].stride.max(1);
        let kept = verdict == Verdict::Keep;
        match verdict {
            Verdict::Keep => {
                self.kept[member] = judgement.to;
                self.backoff[member][direction] = Backoff {
                    stride: (stride * 2).min(STRIDE_MAX),
                    ..Backoff::default()
                };
                let opposite = &mut self.backoff[member][1 - direction];
                opposite.skip = opposite.skip.max(2);
                opposite.stride = 1;
            }
            // The cap may not bind yet (what it changed is within the least gain either way):
            // a longer stride next, at once. A mean loss past the least gain says the cap binds
            // and costs, though three pairs cannot call it sure: it waits like a worse one (on
            // an H200, -12% +- 2% read as flat, and the twice longer stride tried straight after
            // cost the group more).
            Verdict::Flat
                if stride < FLAT_STRIDE_MAX
                    && !self.backoff[member][direction].shortened
                    && gain > -self.config.gain_min =>
            {
                let backoff = &mut self.backoff[member][direction];
                backoff.stride = (stride * 2).min(STRIDE_MAX);
                backoff.after_flat = true;
            }
            // Too far at once after a kept move: the single step next, at once.
            Verdict::Worse if stride > 1 && !self.backoff[member][direction].after_flat => {
                self.backoff[member][direction].stride = 1;
                self.backoff[member][direction].shortened = true;
            }
            // One step further down surely costs: whether the cap kept still pays is tried next.
            Verdict::Worse if judgement.direction == Direction::Down && from < FULL => {
                self.backoff[member][direction].rejected(self.config.backoff_max);
                self.backoff[member][1 - direction].skip = 0;
            }
            Verdict::Flat | Verdict::Worse | Verdict::Hold => {
                let wait = &mut self.backoff[member][direction];
                wait.rejected(self.config.backoff_max);
                wait.stride = 1;
                self.cursor = (self.cursor + 1) % (2 * self.names.len());
            }
        }
        Some(RedistributeChange::Judged {
            tenant: self.names[member].clone(),
            from,
            to: judgement.to,
            gain,
            stderr,
            kept,
        })
    }
}

/// What the pairs of a judgement said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Keep,
    /// Rejected: it surely costs.
    Worse,
    /// Rejected: it does not reach the least gain, and does not surely cost.
    Flat,
    /// No move was judged (every move waits).
    Hold,
}

/// The mean of `values` and its standard error (0 with one value).
fn mean_and_stderr(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (variance / n).sqrt())
}

/// Student's t at 99% (one side) for `freedom` degrees of freedom: a mean this many standard
/// errors from a value is beyond chance at 1% (a judgement looks up to four times, and a group
/// that stays for hours is judged hundreds of times: noise must seldom move a cap).
fn t_critical(freedom: usize) -> f64 {
    const TABLE: [f64; 10] = [
        31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764,
    ];
    TABLE
        .get(freedom.saturating_sub(1))
        .copied()
        .unwrap_or(2.33)
}

#[cfg(test)]
#[path = "redistribute_test.rs"]
mod tests;
