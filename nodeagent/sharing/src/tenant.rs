//! One latency tenant as the controller follows it: its baseline (latency alone), its target,
//! its violation allowance, whether it is idle, its step period, a step of it still open past
//! its target, and the sliding window of its status.

use std::collections::VecDeque;

use crate::types::{Config, TenantStatus};
use tenant_abi::control::{LatencySnapshot, bucket_floor_ns, latency_bucket};

/// Steps before a histogram's p99 means something: with fewer than 1 / (1 - 0.99) steps, the
/// 99th percentile is simply the slowest step.
pub const BASELINE_STEPS_MIN: u64 = 100;
/// The alone histogram is halved past this many steps, so that it follows a tenant whose own
/// latency drifts (a new model, another batch size) and its counts stay bounded.
pub const BASELINE_STEPS_MAX: u64 = 10_000;
/// The slots of the status window (the p50 and p99 cover the last 7/8 to 8/8 of
/// `status_window_ns`, plus the current slot).
pub const STATUS_SLOTS: u64 = 8;
/// One violation, in the allowance's unit (integers, so that the arithmetic is exact).
pub const VIOLATION_PPM: i64 = 1_000_000;
/// Violations a tenant may bank: its allowance grows by `violation_budget` per step up to this,
/// and each violation spends one. One banked violation lets an isolated slow step pass; two
/// within `1 / violation_budget` steps are over budget.
pub const ALLOWANCE_MAX_PPM: i64 = VIOLATION_PPM;
/// A debt is remembered down to this (a burst long ago is not paid for ever).
pub const ALLOWANCE_MIN_PPM: i64 = -VIOLATION_PPM;
/// A tenant is idle after this many of its usual gaps between steps without one.
pub const IDLE_GAPS: u64 = 4;
/// Windows with steps measured before a tenant's step period counts as known (the guards are
/// sized by it).
pub const PERIOD_SAMPLES_MIN: u32 = 4;
/// Blocks of `BASELINE_STEPS_MIN` steps at Exclusive after which the protective baseline is
/// taken even if no two blocks in a row agreed (the lowest block's p99).
pub const PROTECTIVE_BLOCKS_MAX: u32 = 4;
/// Histogram buckets (about 9% each) by which a block's p99 at Exclusive must miss a learnt
/// target to count against the baseline (two: one is the histogram's rounding).
pub const STALE_BASELINE_BUCKETS: i32 = 2;
/// The steps at Exclusive, in consecutive missing blocks, that replace a baseline: at least this
/// share of the steps the baseline was learnt from (and at least one block). Evidence in
/// proportion to what it overturns: a baseline of a warm-up's 200 steps falls to one block, one
/// of 1600 steps alone to 400, so that a slow spell of the tenant's own (an eager tenant on an
/// H200 ran steps twice its alone time at Exclusive for 0.8-2 s) does not become its target.
pub const STALE_EVIDENCE_SHARE: u64 = 4;
/// A tenant whose step has been open (or took) longer than this many times its target is
/// starving: the controller goes to the top at once, and the window's steps say nothing about
/// the tenant's rhythm (its period is not measured from them).
pub const STARVING_TARGETS: u64 = 2;

/// What one window of one tenant says about the level that was in force during it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judgement {
    pub steps: u64,
    /// Steps over the target.
    pub violations: u64,
    /// Violations in this window, and more than the allowance covers.
    pub over_budget: bool,
    /// Steps, and none over the target (the margin is judged over the run of clean windows:
    /// `TenantState::streak_in_margin`).
    pub clean: bool,
    /// The window's p99 above the target, in histogram buckets (about 9% each; negative below).
    pub excess_buckets: i32,
}

/// What the neighbours did during a window, for the baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// No neighbour was active: the tenant alone.
    Alone,
    /// Neighbours were active and held off by Exclusive for the whole window: as good as
    /// alone.
    Exclusive,
    /// Neighbours were active and ran.
    Shared,
    /// No neighbour was active, but another latency tenant had steps too: not alone (three
    /// latency tenants warming up at once on an H200 gave an eager tenant a "baseline" 1.14x
    /// its alone p99, kept for the whole run), and nothing the levers hold back.
    AmongLatency,
}

#[derive(Debug, Clone)]
pub struct TenantState {
    pub explicit_target_ns: Option<u64>,
    /// Steps with no neighbour active (decayed, see `BASELINE_STEPS_MAX`).
    alone: LatencySnapshot,
    /// Steps at Exclusive while the tenant had no target: the block taken as its baseline
    /// (see `learn_protective`), empty until one is.
    protective: LatencySnapshot,
    /// The block of steps at Exclusive being collected, the last complete one, and how many
    /// were complete.
    protective_block: LatencySnapshot,
    protective_last: Option<LatencySnapshot>,
    protective_blocks: u32,
    /// Steps at Exclusive once the tenant has a learnt target, in blocks of
    /// `BASELINE_STEPS_MIN`: a block whose p99 misses the target by `STALE_BASELINE_BUCKETS`
    /// shows the baseline no longer describes the tenant (see `check_baseline`).
    exclusive_block: LatencySnapshot,
    /// The consecutive blocks at Exclusive that missed the learnt target, in this stay there
    /// (see `check_baseline`).
    stale_run: LatencySnapshot,
    /// The last complete block at Exclusive, if it missed the learnt target (kept across levels,
    /// for the floor: `replace_stale_baseline`).
    last_missed: Option<LatencySnapshot>,
    /// `(slot start, steps)`, oldest first, at most `STATUS_SLOTS + 1`.
    recent: VecDeque<(u64, LatencySnapshot)>,
    steps: u64,
    violations: u64,
    /// Banked violations, in millionths.
    allowance_ppm: i64,
    last_step_ns: Option<u64>,
    /// The last window that ended with a step of it in flight.
    last_open_ns: Option<u64>,
    /// A step was seen in flight and no step has ended since: it may still run, unreported (the
    /// agent stops reporting a step open for longer than
    /// `tenant_abi::control::STEP_OPEN_MAX_NS`), so the tenant is idle only after
    /// `idle_max_ns`, not after its usual gaps.
    open_unended: bool,
    /// A moving average (weight 1/4 for the newest) of the time between windows with steps.
    gap_ns: u64,
    /// A moving average (weight 1/4) of the time between step starts: the time since the last
    /// window with steps over the steps of this one. Known after `PERIOD_SAMPLES_MIN` samples.
    period_ns: u64,
    period_samples: u32,
    /// A step of it was seen open for longer than `STARVING_TARGETS` times its target since
    /// its last window with steps: the next window with steps is not a period sample.
    starved: bool,
    /// The start of the open step counted as a violation before it ended (each open step is
    /// counted once), and whether its own end is still to be taken out of a later window's
    /// violations (it is the same step).
    open_counted_ns: Option<u64>,
    open_credit_due: bool,
    /// The steps of the current run of clean windows (see `streak_in_margin`).
    streak: LatencySnapshot,
}

impl TenantState {
    pub fn new(config: &Config, explicit_target_ns: Option<u64>) -> TenantState {
        TenantState {
            explicit_target_ns,
            alone: LatencySnapshot::default(),
            protective: LatencySnapshot::default(),
            protective_block: LatencySnapshot::default(),
            protective_last: None,
            protective_blocks: 0,
            exclusive_block: LatencySnapshot::default(),
            stale_run: LatencySnapshot::default(),
            last_missed: None,
            recent: VecDeque::new(),
            steps: 0,
            violations: 0,
            allowance_ppm: ALLOWANCE_MAX_PPM,
            last_step_ns: None,
            last_open_ns: None,
            open_unended: false,
            // Until its rhythm is measured, a tenant is assumed to step rarely: releasing the
            // neighbours between its first steps would hit exactly those steps.
            gap_ns: config.idle_max_ns / IDLE_GAPS,
            period_ns: 0,
            period_samples: 0,
            starved: false,
            open_counted_ns: None,
            open_credit_due: false,
            streak: LatencySnapshot::default(),
        }
    }

    /// The time between the tenant's step starts, once measured.
    pub fn step_period_ns(&self) -> Option<u64> {
        (self.period_samples >= PERIOD_SAMPLES_MIN && self.period_ns > 0).then_some(self.period_ns)
    }

    /// Whether a step open since `since_ns` (charged to this tenant) has been open for longer
    /// than `STARVING_TARGETS` times its target at `now_ns`.
    pub fn starving(&self, config: &Config, now_ns: u64, since_ns: u64) -> bool {
        self.target_ns(config).is_some_and(|target| {
            now_ns.saturating_sub(since_ns) > target.saturating_mul(STARVING_TARGETS)
        })
    }

    /// Whether a step open since `since_ns` has been open for longer than every step the
    /// tenant took alone (its baseline's histogram: alone, else at Exclusive; the upper end of
    /// the slowest bucket). `true` when no baseline was measured (an explicit target).
    pub fn beyond_own_tail(&self, now_ns: u64, since_ns: u64) -> bool {
        let Some(histogram) = [&self.alone, &self.protective]
            .into_iter()
            .find(|histogram| histogram.steps >= BASELINE_STEPS_MIN)
        else {
            return true;
        };
        let slowest = histogram
            .buckets
            .iter()
            .rposition(|&count| count > 0)
            .map_or(0, |bucket| {
                tenant_abi::control::bucket_floor_ns(
                    (bucket + 1).min(tenant_abi::control::LATENCY_BUCKETS - 1),
                )
            });
        now_ns.saturating_sub(since_ns) > slowest
    }

    /// The p99 alone; until `BASELINE_STEPS_MIN` steps alone were seen, the p99 at the most
    /// protective level.
    /// Read within its bucket (`LatencySnapshot::quantile_within_ns`): the bucket's upper edge,
    /// times the target ratio, made a 1.2x target up to 1.31x the p99 alone.
    pub fn baseline_p99_ns(&self) -> Option<u64> {
        [&self.alone, &self.protective]
            .into_iter()
            .find(|histogram| histogram.steps >= BASELINE_STEPS_MIN)
            .and_then(|histogram| histogram.quantile_within_ns(0.99))
    }

    pub fn target_ns(&self, config: &Config) -> Option<u64> {
        self.explicit_target_ns.or_else(|| {
            let baseline = self.baseline_p99_ns()?;
            Some((baseline as f64 * config.target_ratio).round() as u64)
        })
    }

    /// Whether the tenant has had no step for `IDLE_GAPS` of its usual gaps (clamped). A latency
    /// step open on the GPU since `open_step_since_ns` keeps it active: when it is the GPU's
    /// `sole` latency tenant, the step is its own; else it is active if it was when the step
    /// began (the step is one of the active tenants').
    pub fn is_idle(
        &self,
        config: &Config,
        now_ns: u64,
        open_step_since_ns: Option<u64>,
        sole: bool,
    ) -> bool {
        match open_step_since_ns {
            Some(_) if sole => false,
            Some(since) => self.idle_at(config, since.min(now_ns)),
            None => self.idle_at(config, now_ns),
        }
    }

    fn idle_at(&self, config: &Config, now_ns: u64) -> bool {
        let idle_after_ns = if self.open_unended {
            config.idle_max_ns
        } else {
            self.gap_ns
                .saturating_mul(IDLE_GAPS)
                .clamp(config.idle_min_ns, config.idle_max_ns)
        };
        self.last_step_ns
            .max(self.last_open_ns)
            .is_none_or(|last| now_ns.saturating_sub(last) >= idle_after_ns)
    }

    /// Takes one window: judges it against the target in force before it (`None` without steps
    /// or target), then learns from it. `alone`: no neighbour was active; `protective`:
    /// Exclusive was in force with neighbours active for the whole window; `open_step_since_ns`:
    /// a latency step open on the GPU since then, charged to this tenant (it counts as a
    /// violation once it is open for longer than the target, once per open step).
    pub fn observe(
        &mut self,
        config: &Config,
        now_ns: u64,
        window: &LatencySnapshot,
        seen: Seen,
        open_step_since_ns: Option<u64>,
    ) -> Option<Judgement> {
        let target = self.target_ns(config);
        // Back from idle: the silence before these steps is no gap between steps and no step
        // period (after 250 ms idle, one sample made a 3 ms tenant's period 47 ms on an H100,
        // and the guards sized by it held the neighbour back like Exclusive).
        let back_from_idle = window.steps > 0
            && open_step_since_ns.is_none()
            && self.last_step_ns.is_some()
            && self.idle_at(config, now_ns);
        if let Some(since) = open_step_since_ns {
            // Its step is in flight: the tenant is active now.
            debug_assert!(since <= now_ns);
            self.last_open_ns = Some(now_ns);
            self.open_unended = true;
            self.starved |= self.starving(config, now_ns, since);
        } else if window.steps > 0 {
            self.open_unended = false;
        }
        let open_ns = open_step_since_ns
            .filter(|&since| self.open_counted_ns != Some(since))
            .map(|since| now_ns.saturating_sub(since))
            .filter(|&open| target.is_some_and(|target| open > target));
        if let Some(since) = open_step_since_ns
            && open_ns.is_some()
        {
            self.open_counted_ns = Some(since);
            self.open_credit_due = true;
        }
        // The counted step ended: its end, in this window's histogram, is not counted again.
        let credit = u64::from(
            self.open_credit_due && window.steps > 0 && open_step_since_ns != self.open_counted_ns,
        );
        if credit == 1 {
            self.open_credit_due = false;
        }
        if window.steps == 0 {
            self.forget_old_slots(config, now_ns);
            return target
                .zip(open_ns)
                .map(|(target, open)| self.judge(config, window, target, Some(open), 0));
        }
        let judgement = target.map(|target| self.judge(config, window, target, open_ns, credit));
        self.steps += window.steps;
        // Steps that starved (one took, or was seen open for, longer than `STARVING_TARGETS`
        // times the target) came at the neighbour's pace, not the tenant's: a period measured
        // from them (31-44 ms for a 3 ms tenant on the H100) would size the guards wrongly.
        let starved = std::mem::take(&mut self.starved)
            || target.is_some_and(|target| {
                window.slower_than(target.saturating_mul(STARVING_TARGETS)) > 0
            });
        if let Some(last) = self.last_step_ns.filter(|_| !back_from_idle) {
            let gap = now_ns.saturating_sub(last);
            self.gap_ns = (self.gap_ns.saturating_mul(3).saturating_add(gap)) / 4;
        }
        if let Some(last) = self.last_step_ns.filter(|_| !starved && !back_from_idle) {
            let gap = now_ns.saturating_sub(last);
            let period = gap / window.steps;
            self.period_ns = if self.period_samples == 0 {
                period
            } else {
                (self.period_ns.saturating_mul(3).saturating_add(period)) / 4
            };
            self.period_samples = self.period_samples.saturating_add(1);
        }
        self.last_step_ns = Some(now_ns);
        if seen == Seen::Alone {
            self.alone.add(window);
            if self.alone.steps > BASELINE_STEPS_MAX {
                halve(&mut self.alone);
            }
        } else if seen == Seen::Exclusive && target.is_none() {
            self.learn_protective(window);
        } else if seen == Seen::Exclusive && self.explicit_target_ns.is_none() {
            self.check_baseline(config, window);
        }
        if seen != Seen::Exclusive {
            // Blocks "in a row" are blocks of one stay at Exclusive: two slow spells of the
            // tenant's own, each of which sent the level to the top, are not one lasting change.
            self.exclusive_block = LatencySnapshot::default();
            self.stale_run = LatencySnapshot::default();
        }
        self.record_recent(config, now_ns, window);
        debug_assert!((ALLOWANCE_MIN_PPM..=ALLOWANCE_MAX_PPM).contains(&self.allowance_ppm));
        judgement
    }

    /// Learns the baseline at Exclusive, in blocks of `BASELINE_STEPS_MIN` steps: a block is
    /// taken once the next one agrees with it (their p99s within one histogram bucket: the lower
    /// of the two), or after `PROTECTIVE_BLOCKS_MAX` blocks the lowest. The first steps at
    /// Exclusive can still wait behind the neighbours' work queued before it (an H100 run: a
    /// decoder's baseline learnt from its first 100 steps beside GEMMs was 2.05 ms against
    /// 1.45 ms alone, a target 1.7x too loose, held through the whole run); interference only
    /// slows a step, so a later block that is lower is the truer one.
    fn learn_protective(&mut self, window: &LatencySnapshot) {
        self.protective_block.add(window);
        if self.protective_block.steps < BASELINE_STEPS_MIN {
            return;
        }
        let block = std::mem::take(&mut self.protective_block);
        self.protective_blocks += 1;
        let p99 = |h: &LatencySnapshot| h.quantile_ns(0.99).map_or(usize::MAX, latency_bucket);
        let Some(last) = self.protective_last.take() else {
            self.protective_last = Some(block);
            return;
        };
        let (lower, higher) = if p99(&block) <= p99(&last) {
            (block, last)
        } else {
            (last, block)
        };
        if p99(&higher) <= p99(&lower) + 1 || self.protective_blocks >= PROTECTIVE_BLOCKS_MAX {
            self.protective = lower;
            self.protective_last = None;
        } else {
            // Keep the lower one: the next block is compared with it, and after the last
            // block the lowest is taken.
            self.protective_last = Some(lower);
        }
    }

    /// At Exclusive (nothing else runs: as good as alone) a tenant must be able to meet a
    /// learnt target. Blocks of `BASELINE_STEPS_MIN` steps there whose p99 is
    /// `STALE_BASELINE_BUCKETS` over the target say the baseline describes another tenant than
    /// the one running now (an H100 run: an eager tenant's baseline learnt from its warm-up's
    /// short synchronisations was 0.7 ms against 3-4 ms steps; every step was a violation, the
    /// level sat at Exclusive and its neighbour made no step for a whole window), once they
    /// hold `1 / STALE_EVIDENCE_SHARE` of the steps the baseline was learnt from, in a row: then
    /// they become the baseline. A block within it ends the run. A single block replaced it
    /// before, and an eager tenant's slow spells at Exclusive on an H200 (its own, the GPU idle)
    /// loosened its target to 1.9-2.5x its alone p99 for the rest of the run.
    fn check_baseline(&mut self, config: &Config, window: &LatencySnapshot) {
        self.exclusive_block.add(window);
        if self.exclusive_block.steps < BASELINE_STEPS_MIN {
            return;
        }
        let block = std::mem::take(&mut self.exclusive_block);
        let (Some(target), Some(p99)) = (self.target_ns(config), block.quantile_ns(0.99)) else {
            return;
        };
        if latency_bucket(p99) as i32 - latency_bucket(target) as i32 >= STALE_BASELINE_BUCKETS {
            self.stale_run.add(&block);
            self.last_missed = Some(block);
            if self.stale_run.steps >= self.stale_evidence_needed() {
                self.alone = std::mem::take(&mut self.stale_run);
                self.protective = LatencySnapshot::default();
                self.last_missed = None;
            }
        } else {
            self.stale_run = LatencySnapshot::default();
            self.last_missed = None;
        }
    }

    /// The floor found the top no better than level 0, this tenant's last block at Exclusive
    /// missed its learnt target, and so do its steps at level 0 (`unrestricted`, this episode's):
    /// it misses everywhere, restricted or not, so the baseline is what is wrong, which more
    /// blocks at Exclusive would show too (the floor does not leave time for them). Replaces it
    /// with that block; whether it did. A tenant within its target at level 0 is not: its misses
    /// at the top are then a slow spell of its own that sent the level there (the top's steps
    /// are the slow ones by selection).
    pub fn replace_stale_baseline(
        &mut self,
        config: &Config,
        unrestricted: Option<&LatencySnapshot>,
    ) -> bool {
        let (Some(target), Some(level0)) = (
            self.target_ns(config),
            unrestricted.and_then(|h| h.quantile_ns(0.99)),
        ) else {
            return false;
        };
        if self.explicit_target_ns.is_some()
            || (latency_bucket(level0) as i32 - latency_bucket(target) as i32)
                < STALE_BASELINE_BUCKETS
        {
            return false;
        }
        let Some(block) = self.last_missed.take() else {
            return false;
        };
        self.alone = block;
        self.protective = LatencySnapshot::default();
        self.stale_run = LatencySnapshot::default();
        true
    }

    /// The steps of consecutive missing blocks at Exclusive that replace the baseline
    /// (`STALE_EVIDENCE_SHARE`).
    fn stale_evidence_needed(&self) -> u64 {
        let record = [&self.alone, &self.protective]
            .into_iter()
            .find(|histogram| histogram.steps >= BASELINE_STEPS_MIN)
            .map_or(0, |histogram| histogram.steps);
        BASELINE_STEPS_MIN.max(record / STALE_EVIDENCE_SHARE)
    }

    /// Judges `window` against `target`, with a step open for `open_ns` (past the target) as
    /// one more violation and `credit` violations taken out (a counted open step that ended).
    fn judge(
        &mut self,
        config: &Config,
        window: &LatencySnapshot,
        target: u64,
        open_ns: Option<u64>,
        credit: u64,
    ) -> Judgement {
        assert!(window.steps > 0 || open_ns.is_some());
        assert!(open_ns.is_none_or(|open| open > target));
        // Exact where the tenant's processes counted against this target (`over`), else from
        // the histogram, which let tenants run up to a bucket (9%) over their target.
        let violations = window.over(target).saturating_sub(credit) + u64::from(open_ns.is_some());
        self.violations += violations;
        let budget_ppm = (config.violation_budget * VIOLATION_PPM as f64).round() as i64;
        let earned = budget_ppm.saturating_mul(window.steps.min(i64::MAX as u64) as i64);
        let spent = VIOLATION_PPM.saturating_mul(violations.min(i64::MAX as u64) as i64);
        self.allowance_ppm = self
            .allowance_ppm
            .saturating_add(earned)
            .min(ALLOWANCE_MAX_PPM)
            .saturating_sub(spent);
        let over_budget = violations > 0 && self.allowance_ppm < 0;
        self.allowance_ppm = self.allowance_ppm.max(ALLOWANCE_MIN_PPM);
        let p99 = window.quantile_ns(0.99).max(open_ns);
        // Like the violations, read at the bucket's lower edge: the upper edge would put a p99
        // a hair above the baseline's bucket a whole bucket (9-12%) higher, and make the margin
        // unreachable for a tenant sitting well within its target.
        // Clean: nothing over the target. The margin is judged on the whole run of clean
        // windows (`streak_in_margin`), not per window: a window's p99 is the max of its two or
        // three steps, and requiring every step under the margin for 100 steps in a row held
        // a level up on a few percent of steps between the margin and the target (a decoder
        // beside a bandwidth hog sat at Exclusive for whole 4 s windows on an H100).
        let clean = violations == 0 && window.steps > 0;
        if clean {
            self.streak.add(window);
        } else {
            self.streak = LatencySnapshot::default();
        }
        let excess_buckets = p99.map_or(0, |p99| {
            latency_bucket(p99) as i32 - latency_bucket(target) as i32
        });
        Judgement {
            steps: window.steps,
            violations,
            over_budget,
            clean,
            excess_buckets,
        }
    }

    /// Whether the tenant owes no violations (relaxing waits until it does not).
    pub fn in_allowance(&self) -> bool {
        self.allowance_ppm >= 0
    }

    /// Whether the p99 of the steps of its current run of clean windows (read at its bucket's
    /// lower edge, like the violations: the upper edge would put a p99 a hair above the
    /// baseline's bucket a whole bucket higher) is under `relax_margin` of the target: the
    /// headroom that makes the level below worth a try. True without such steps.
    pub fn streak_in_margin(&self, config: &Config) -> bool {
        let Some(target) = self.target_ns(config) else {
            return false;
        };
        self.streak.quantile_ns(0.99).is_none_or(|p99| {
            (bucket_floor_ns(latency_bucket(p99) - 1) as f64) < config.relax_margin * target as f64
        })
    }

    /// Starts a new run of clean windows (the level changed, or the controller's run broke).
    pub fn reset_streak(&mut self) {
        self.streak = LatencySnapshot::default();
    }

    fn slot_ns(config: &Config) -> u64 {
        (config.status_window_ns / STATUS_SLOTS).max(1)
    }

    fn forget_old_slots(&mut self, config: &Config, now_ns: u64) {
        while self
            .recent
            .front()
            .is_some_and(|(start, _)| start.saturating_add(config.status_window_ns) <= now_ns)
        {
            self.recent.pop_front();
        }
    }

    fn record_recent(&mut self, config: &Config, now_ns: u64, window: &LatencySnapshot) {
        self.forget_old_slots(config, now_ns);
        let slot_ns = TenantState::slot_ns(config);
        match self.recent.back_mut() {
            Some((start, slot)) if now_ns < start.saturating_add(slot_ns) => slot.add(window),
            _ => self.recent.push_back((now_ns, window.clone())),
        }
        while self.recent.len() as u64 > STATUS_SLOTS + 1 {
            self.recent.pop_front();
        }
    }

    pub fn status(&self, config: &Config, name: &str) -> TenantStatus {
        let mut recent = LatencySnapshot::default();
        for (_, slot) in &self.recent {
            recent.add(slot);
        }
        TenantStatus {
            name: name.to_owned(),
            target_ns: self.target_ns(config),
            baseline_p99_ns: self.baseline_p99_ns(),
            p50_ns: recent.quantile_ns(0.5),
            p99_ns: recent.quantile_ns(0.99),
            steps: self.steps,
            violations: self.violations,
        }
    }
}

/// Halves every count, keeping the shape.
pub(crate) fn halve(histogram: &mut LatencySnapshot) {
    histogram.steps /= 2;
    histogram.total_ns /= 2;
    histogram.over_target /= 2;
    for count in &mut histogram.buckets {
        *count /= 2;
    }
}
