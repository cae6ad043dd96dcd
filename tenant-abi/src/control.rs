//! Closed-loop sharing of one GPU: the part of the GPU's schedule file (`compute::Region::control`)
//! through which latency tenants report what their steps took, the node agent's controller
//! decides how far the other tenants on the GPU are held back, and those tenants' interposers
//! obey. Pure: no FFI, no clock (callers pass `now_ns`, CLOCK_MONOTONIC), atomics only.
//!
//! **Roles.**
//! - A latency tenant's process (`VGPU_LATENCY=1`) opens a *step* at a launch when it has none
//!   open and closes it when a synchronisation returns ([`Control::open_step`],
//!   [`Control::close_step`]); each closed step's latency goes into the tenant's histogram
//!   ([`Control::record_step`]). The open/close stamps tell the others "a latency step is in
//!   flight now".
//! - The agent reads the histograms ([`Control::latency`]), runs the controller and writes a
//!   [`Decision`] with its time ([`Control::publish`]).
//! - Every other tenant's launch reads the decision ([`Control::decision`], two relaxed loads)
//!   and, while a latency step is in flight, waits, bounds its queued work or moves to fewer SMs
//!   as decided. A decision older than [`DECISION_TTL_NS`] is ignored: an agent that died or
//!   stopped leaves the GPU unrestricted (fail open), never paused.
//!
//! **Histograms.** Log buckets, 8 per doubling (each about 9% wide) from 8 µs: bucket
//! `LATENCY_BUCKETS - 1` holds everything from about 0.5 s on. Counts only grow; a reader takes
//! the difference of two snapshots for a window. A process killed mid-update loses at most one
//! count.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Buckets per latency histogram.
pub const LATENCY_BUCKETS: usize = 128;
/// The lower bound of bucket 1 (bucket 0 holds everything below it).
pub const LATENCY_BUCKET_MIN_NS: u64 = 8_000;
/// Buckets per doubling of latency.
pub const LATENCY_BUCKETS_PER_DOUBLING: u32 = 8;
/// A decision older than this is void (the agent writes one every control period).
pub const DECISION_TTL_NS: u64 = 500_000_000;
/// A step open for longer than this is taken for one whose process died (the agent stops seeing
/// it).
pub const STEP_VISIBLE_MAX_NS: u64 = 10_000_000_000;
/// The unit of `Decision::guard_us` in the packed word.
pub const GUARD_UNIT_US: u32 = 16;
/// The longest one launch of a squeezed tenant waits under `Decision::exclusive`, or under a
/// guard (`Decision::guard_us`), before it goes anyway. The hold ends before that as soon as
/// the agent stops asking for it (it relaxed, or it stopped publishing and the decision lapsed
/// after [`DECISION_TTL_NS`]), so this bounds only a hold the agent keeps asking for: a latency
/// tenant that never goes idle while the controller stays at the top. 1 s at Exclusive and
/// 50 ms at the guards, before: one 12 ms neighbour kernel went through every second of a
/// decoder's run at Exclusive (about 4 steps in 330, over a 1% budget), and a GEMM every 50 ms
/// at the guards.
pub const HOLD_WAIT_MAX_NS: u64 = 10_000_000_000;
/// A step open for longer than this no longer holds anyone back (its process may have died, or
/// it never synchronises): the bound on how long a neighbour can be paused by one step.
pub const STEP_OPEN_MAX_NS: u64 = 100_000_000;

/// What the controller asks of the squeezable tenants of a GPU while a latency tenant is active.
/// `Decision::default()` asks nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decision {
    /// SMs a squeezed tenant keeps (under MPS, through a green context); 0: all.
    pub sms: u16,
    /// Launches a squeezed tenant may have queued on the GPU per stream; 0: unbounded.
    pub inflight: u8,
    /// Whether a squeezed tenant waits before launching while a latency step is in flight.
    pub pause: bool,
    /// With `pause`: a squeezed tenant also waits when the latency tenant's next step is
    /// predicted to start within this many microseconds (`Control::next_step_ns`), so that the
    /// step does not start behind a kernel just launched; 0: no guard.
    pub guard_us: u32,
    /// A squeezed tenant waits while a latency tenant is active at all (launched within the
    /// hold time): the GPU is the latency tenant's alone, up to `HOLD_WAIT_MAX_NS` per
    /// launch. The top of the ladder, where a tenant's latency alone is learnt.
    pub exclusive: bool,
    /// The controller's level (statistics and logs; the levers above are what counts).
    pub level: u8,
}

impl Decision {
    /// One word: `guard / 16 µs << 40 | level << 32 | exclusive << 25 | pause << 24 |
    /// inflight << 16 | sms`. The guard is kept in 16 µs units (at most about 1 s).
    pub fn pack(self) -> u64 {
        let guard = u64::from(self.guard_us.div_ceil(GUARD_UNIT_US)).min(0xFFFF);
        guard << 40
            | u64::from(self.level) << 32
            | u64::from(self.exclusive) << 25
            | u64::from(self.pause) << 24
            | u64::from(self.inflight) << 16
            | u64::from(self.sms)
    }

    pub fn unpack(word: u64) -> Decision {
        Decision {
            sms: word as u16,
            inflight: (word >> 16) as u8,
            pause: (word >> 24) & 1 == 1,
            exclusive: (word >> 25) & 1 == 1,
            level: (word >> 32) as u8,
            guard_us: ((word >> 40) & 0xFFFF) as u32 * GUARD_UNIT_US,
        }
    }

    /// Whether the decision restricts anything.
    pub fn restricts(self) -> bool {
        self.sms != 0 || self.inflight != 0 || self.pause || self.exclusive
    }
}

/// One tenant's step latencies since the file was made.
#[repr(C)]
pub struct LatencyStats {
    pub steps: AtomicU64,
    pub total_ns: AtomicU64,
    /// The tenant's target in force (ns), written by the agent (`Control::publish_target`);
    /// 0: none yet (version 4).
    pub target_ns: AtomicU64,
    /// Steps slower than `target_ns` as it was when each step ended, counted by the tenant's
    /// own processes from the step's exact latency (version 4): the controller judges these,
    /// not the histogram, whose buckets are 9% wide.
    pub over_target: AtomicU64,
    pub buckets: [AtomicU64; LATENCY_BUCKETS],
}

/// The closed-loop words of one GPU.
#[repr(C)]
pub struct Control {
    /// `Decision::pack`, written by the agent.
    pub decision: AtomicU64,
    /// When the agent wrote `decision` (0: never).
    pub decision_ns: AtomicU64,
    /// When a latency process last opened a step, and last closed one (0: never).
    pub step_open_ns: AtomicU64,
    pub step_close_ns: AtomicU64,
    /// Statistics of the squeezed side: time its launches waited for latency steps, and
    /// launches that waited for their stream's queue to shrink.
    pub paused_ns: AtomicU64,
    pub bounded_launches: AtomicU64,
    /// When a latency process expects its next step to start (its last step's start plus its
    /// usual period between starts; 0: unknown), for `Decision::guard_us`.
    pub next_step_ns: AtomicU64,
    /// The agent's SM cap of each tenant slot (`sharing::redistribute`), one byte per slot
    /// (slot `i`: byte `i % 8` of word `i / 8`), in [`CAP_UNITS`]ths of the GPU's SMs; 0 (and
    /// `CAP_UNITS` or more): uncapped. In version 4's words that were reserved and zero: an
    /// older agent leaves every tenant uncapped, an older interposer ignores the caps.
    pub caps: [AtomicU64; CAP_WORDS],
    /// When the agent last wrote `caps` (0: never); caps expire like a decision
    /// ([`DECISION_TTL_NS`]), so a dead agent leaves every tenant uncapped.
    pub caps_ns: AtomicU64,
    /// The tenant slots (bit `i`: slot `i`) whose processes launch without waiting for turns,
    /// side by side (`sharing::redistribute`: the group's way of sharing), and when the agent
    /// last wrote them (0: never); they lapse like the caps ([`DECISION_TTL_NS`]), so a dead
    /// agent leaves every tenant taking turns. In words that were reserved and zero: an older
    /// agent writes none, an older interposer takes turns.
    pub side_by_side: AtomicU64,
    pub side_by_side_ns: AtomicU64,
    pub reserved: [AtomicU64; 2],
    /// Per tenant slot of the schedule (`compute::Region::tenants`).
    pub latency: [LatencyStats; crate::compute::TENANTS],
}

/// An SM cap's unit: a cap of `c` leaves a tenant `c / CAP_UNITS` of the GPU's SMs.
pub const CAP_UNITS: u8 = 128;
/// Words of `Control::caps` (a byte per tenant slot).
pub const CAP_WORDS: usize = crate::compute::TENANTS / 8;

/// The bytes of [`Control`]; part of the schedule file's size.
pub const CONTROL_BYTES: usize = 16 * 8 + crate::compute::TENANTS * (32 + LATENCY_BUCKETS * 8);
const _: () = assert!(std::mem::size_of::<Control>() == CONTROL_BYTES);

/// The histogram bucket of a latency.
pub fn latency_bucket(latency_ns: u64) -> usize {
    if latency_ns < LATENCY_BUCKET_MIN_NS {
        return 0;
    }
    // log2(latency / min) in units of 1/8, from the integer part and the next bits.
    let ratio = latency_ns / LATENCY_BUCKET_MIN_NS;
    let whole = 63 - ratio.leading_zeros();
    let scaled = (latency_ns << 3) / (LATENCY_BUCKET_MIN_NS << whole); // 8..16
    let fraction = (scaled.clamp(8, 15) - 8) as u32;
    let bucket = 1 + whole * LATENCY_BUCKETS_PER_DOUBLING + fraction;
    (bucket as usize).min(LATENCY_BUCKETS - 1)
}

/// The lower bound of bucket `bucket` (0 for bucket 0).
pub fn bucket_floor_ns(bucket: usize) -> u64 {
    if bucket == 0 {
        return 0;
    }
    let index = (bucket - 1) as u32;
    let whole = index / LATENCY_BUCKETS_PER_DOUBLING;
    let fraction = u64::from(index % LATENCY_BUCKETS_PER_DOUBLING);
    (LATENCY_BUCKET_MIN_NS << whole) * (8 + fraction) / 8
}

/// A copy of one tenant's histogram, or the difference of two (a window).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencySnapshot {
    pub steps: u64,
    pub total_ns: u64,
    /// Steps over `counted_against_ns`, counted exactly where they ended.
    pub over_target: u64,
    /// The target `over_target` was counted against: the target published when the snapshot
    /// was taken; for a window, the target of both its ends, 0 when they differ (the target
    /// changed during the window: its count mixes two targets) or none was published.
    pub counted_against_ns: u64,
    pub buckets: [u64; LATENCY_BUCKETS],
}

impl Default for LatencySnapshot {
    fn default() -> Self {
        LatencySnapshot {
            steps: 0,
            total_ns: 0,
            over_target: 0,
            counted_against_ns: 0,
            buckets: [0; LATENCY_BUCKETS],
        }
    }
}

impl LatencySnapshot {
    /// What happened between `earlier` and `self` (counts that went backwards, from a file that
    /// was made anew, count from zero).
    pub fn since(&self, earlier: &LatencySnapshot) -> LatencySnapshot {
        if self.steps < earlier.steps {
            return self.clone();
        }
        let same_target = self.counted_against_ns == earlier.counted_against_ns;
        LatencySnapshot {
            steps: self.steps - earlier.steps,
            total_ns: self.total_ns.saturating_sub(earlier.total_ns),
            over_target: self.over_target.saturating_sub(earlier.over_target),
            counted_against_ns: if same_target {
                self.counted_against_ns
            } else {
                0
            },
            buckets: std::array::from_fn(|i| self.buckets[i].saturating_sub(earlier.buckets[i])),
        }
    }

    /// Adds another window (the exact counts stay exact only when both were counted against
    /// one target).
    pub fn add(&mut self, other: &LatencySnapshot) {
        if self.steps == 0 && self.over_target == 0 {
            self.counted_against_ns = other.counted_against_ns;
        } else if other.steps > 0 && other.counted_against_ns != self.counted_against_ns {
            self.counted_against_ns = 0;
        }
        self.over_target += other.over_target;
        self.steps += other.steps;
        self.total_ns += other.total_ns;
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
    }

    /// Where quantile `q` (0..=1) falls: its bucket, the steps in the buckets below it, and its
    /// rank among all steps (1-based); `None` without steps.
    fn locate(&self, q: f64) -> Option<(usize, u64, u64)> {
        assert!((0.0..=1.0).contains(&q), "a quantile is within 0..=1");
        let counted: u64 = self.buckets.iter().sum();
        if counted == 0 {
            return None;
        }
        let rank = ((q * counted as f64).ceil() as u64).clamp(1, counted);
        let mut below = 0;
        for (bucket, &count) in self.buckets.iter().enumerate() {
            if below + count >= rank {
                return Some((bucket, below, rank));
            }
            below += count;
        }
        unreachable!("the ranks add up to the count")
    }

    /// The latency at quantile `q` (0..=1), as the upper edge of its bucket (so a reported p99
    /// is never below the true one by more than a bucket); `None` without steps.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        self.locate(q)
            .map(|(bucket, _, _)| bucket_floor_ns(bucket + 1))
    }

    /// The latency at quantile `q` (0..=1), placed within its bucket by rank: the `k`-th of the
    /// bucket's `n` steps at `(k - 1/2) / n` of its width, as if its steps were spread evenly
    /// (never past the bucket's upper edge, which `quantile_ns` reports and which reads a p99 of
    /// 4.9 ms as 5.12 ms; within a few percent where the steps spread over the bucket); `None`
    /// without steps. For baselines, which targets multiply: the upper edge made a tenant's
    /// learnt 1.2x target up to 1.31x its true p99.
    pub fn quantile_within_ns(&self, q: f64) -> Option<u64> {
        let (bucket, below, rank) = self.locate(q)?;
        let floor = bucket_floor_ns(bucket);
        if bucket + 1 >= LATENCY_BUCKETS {
            return Some(floor);
        }
        let width = bucket_floor_ns(bucket + 1) - floor;
        let share = ((rank - below) as f64 - 0.5) / self.buckets[bucket] as f64;
        Some(floor + (width as f64 * share).round() as u64)
    }

    /// Steps slower than `target_ns`: exactly, when the window's steps were counted against
    /// that target where they ended (`counted_against_ns`), else from the histogram (a bucket
    /// counted only when all of it is slower, so up to a bucket, 9%, of slack).
    pub fn over(&self, target_ns: u64) -> u64 {
        if target_ns != 0 && self.counted_against_ns == target_ns {
            return self.over_target.min(self.steps);
        }
        self.slower_than(target_ns)
    }

    /// Steps slower than `threshold_ns` (counting a bucket only when all of it is slower).
    pub fn slower_than(&self, threshold_ns: u64) -> u64 {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(bucket, _)| bucket_floor_ns(*bucket) >= threshold_ns)
            .map(|(_, count)| count)
            .sum()
    }
}

impl Control {
    /// A latency process launches with no step open: it opens one at `now_ns`.
    #[inline]
    pub fn open_step(&self, now_ns: u64) {
        debug_assert!(now_ns > 0);
        self.step_open_ns.store(now_ns, Relaxed);
    }

    /// A latency process's synchronisation returned at `now_ns`: its open step closed.
    #[inline]
    pub fn close_step(&self, now_ns: u64) {
        debug_assert!(now_ns > 0);
        self.step_close_ns.store(now_ns, Relaxed);
    }

    /// Whether a latency step is in flight at `now_ns`: opened after the last close, at most
    /// [`STEP_OPEN_MAX_NS`] ago.
    #[inline]
    pub fn step_in_flight(&self, now_ns: u64) -> bool {
        let opened = self.step_open_ns.load(Relaxed);
        opened != 0
            && opened > self.step_close_ns.load(Relaxed)
            && now_ns.saturating_sub(opened) < STEP_OPEN_MAX_NS
    }

    /// Adds one step of `latency_ns` to tenant slot `tenant`'s histogram, and counts it when
    /// it is slower than the tenant's target in force.
    pub fn record_step(&self, tenant: usize, latency_ns: u64) {
        let stats = &self.latency[tenant];
        let target = stats.target_ns.load(Relaxed);
        if target != 0 && latency_ns > target {
            stats.over_target.fetch_add(1, Relaxed);
        }
        stats.buckets[latency_bucket(latency_ns)].fetch_add(1, Relaxed);
        stats.total_ns.fetch_add(latency_ns, Relaxed);
        stats.steps.fetch_add(1, Relaxed);
    }

    /// A copy of tenant slot `tenant`'s histogram.
    pub fn latency(&self, tenant: usize) -> LatencySnapshot {
        let stats = &self.latency[tenant];
        LatencySnapshot {
            steps: stats.steps.load(Relaxed),
            total_ns: stats.total_ns.load(Relaxed),
            over_target: stats.over_target.load(Relaxed),
            counted_against_ns: stats.target_ns.load(Relaxed),
            buckets: std::array::from_fn(|i| stats.buckets[i].load(Relaxed)),
        }
    }

    /// The agent publishes tenant slot `tenant`'s target in force (0: none): its processes
    /// count the steps slower than it from then on.
    pub fn publish_target(&self, tenant: usize, target_ns: u64) {
        self.latency[tenant].target_ns.store(target_ns, Relaxed);
    }

    /// Publishes every tenant slot's SM cap at `now_ns` (`caps[i]`: slot `i`'s, in
    /// [`CAP_UNITS`]ths; 0: uncapped).
    pub fn publish_caps(&self, caps: &[u8; crate::compute::TENANTS], now_ns: u64) {
        for (word, bytes) in self.caps.iter().zip(caps.chunks_exact(8)) {
            let packed = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
            word.store(packed, Relaxed);
        }
        self.caps_ns.store(now_ns, Relaxed);
    }

    /// Tenant slot `tenant`'s SM cap in force at `now_ns`, in [`CAP_UNITS`]ths of the GPU's
    /// SMs (`1..CAP_UNITS`); `None`: uncapped (no cap, or caps older than
    /// [`DECISION_TTL_NS`]).
    #[inline]
    pub fn cap(&self, tenant: usize, now_ns: u64) -> Option<u8> {
        let at = self.caps_ns.load(Relaxed);
        if at == 0 || now_ns.saturating_sub(at) > DECISION_TTL_NS {
            return None;
        }
        let word = self.caps[tenant / 8].load(Relaxed);
        let cap = (word >> (8 * (tenant % 8))) as u8;
        (cap != 0 && cap < CAP_UNITS).then_some(cap)
    }

    /// Publishes at `now_ns` the tenant slots that launch side by side (bit `i`: slot `i`; 0:
    /// everyone takes turns).
    pub fn publish_side_by_side(&self, slots: u64, now_ns: u64) {
        self.side_by_side.store(slots, Relaxed);
        self.side_by_side_ns.store(now_ns, Relaxed);
    }

    /// Whether tenant slot `tenant` launches side by side at `now_ns` (`false` once the agent's
    /// word is older than [`DECISION_TTL_NS`]).
    #[inline]
    pub fn side_by_side(&self, tenant: usize, now_ns: u64) -> bool {
        let at = self.side_by_side_ns.load(Relaxed);
        at != 0
            && now_ns.saturating_sub(at) <= DECISION_TTL_NS
            && self.side_by_side.load(Relaxed) & (1u64 << (tenant % 64)) != 0
    }

    /// Clears tenant slot `tenant`'s histogram (its slot was given to another tenant).
    pub fn clear_latency(&self, tenant: usize) {
        let stats = &self.latency[tenant];
        stats.steps.store(0, Relaxed);
        stats.total_ns.store(0, Relaxed);
        stats.target_ns.store(0, Relaxed);
        stats.over_target.store(0, Relaxed);
        for bucket in &stats.buckets {
            bucket.store(0, Relaxed);
        }
    }

    /// The agent's decision at `now_ns` (published `at_ns`).
    pub fn publish(&self, decision: Decision, now_ns: u64) {
        debug_assert!(now_ns > 0);
        self.decision.store(decision.pack(), Relaxed);
        self.decision_ns.store(now_ns, Relaxed);
    }

    /// The decision in force at `now_ns`: the last one published, unless it is older than
    /// [`DECISION_TTL_NS`] (then none).
    #[inline]
    pub fn decision(&self, now_ns: u64) -> Decision {
        let at = self.decision_ns.load(Relaxed);
        if at == 0 || now_ns.saturating_sub(at) > DECISION_TTL_NS {
            return Decision::default();
        }
        Decision::unpack(self.decision.load(Relaxed))
    }

    /// A squeezed launch waited `waited_ns` for a latency step.
    pub fn count_pause(&self, waited_ns: u64) {
        self.paused_ns.fetch_add(waited_ns, Relaxed);
    }

    /// A squeezed launch waited for its stream's queue.
    pub fn count_bounded(&self) {
        self.bounded_launches.fetch_add(1, Relaxed);
    }

    /// A latency process expects its next step at `at_ns`.
    pub fn predict_step(&self, at_ns: u64) {
        self.next_step_ns.store(at_ns, Relaxed);
    }

    /// Whether a latency step is predicted to start within `guard_ns` of `now_ns` (and the
    /// prediction is not stale: a step predicted more than `guard_ns` ago that never came does
    /// not hold anyone back).
    #[inline]
    pub fn step_due(&self, now_ns: u64, guard_ns: u64) -> bool {
        let due = self.next_step_ns.load(Relaxed);
        due != 0 && now_ns + guard_ns >= due && now_ns <= due.saturating_add(guard_ns)
    }

    /// When the oldest latency step still in flight began, if one is (the agent's view of a
    /// step that has not ended yet: a starving latency tenant shows here before any step of it
    /// closes).
    pub fn open_step_since(&self, now_ns: u64) -> Option<u64> {
        // Not `step_in_flight`: its bound is how long a step may hold a neighbour back, and a
        // starving step (hundreds of ms) must stay visible to the agent until it ends.
        let opened = self.step_open_ns.load(Relaxed);
        (opened != 0
            && opened > self.step_close_ns.load(Relaxed)
            && now_ns.saturating_sub(opened) < STEP_VISIBLE_MAX_NS)
            .then_some(opened)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_about_nine_percent_wide() {
        let mut previous = 0;
        for ns in (1_000..2_000_000_000u64).step_by(7_919) {
            let bucket = latency_bucket(ns);
            assert!(bucket >= previous, "{ns}");
            previous = bucket;
            assert!(bucket_floor_ns(bucket) <= ns, "{ns} in {bucket}");
            if bucket + 1 < LATENCY_BUCKETS {
                assert!(ns < bucket_floor_ns(bucket + 1), "{ns} in {bucket}");
            }
        }
        for bucket in 2..LATENCY_BUCKETS {
            let width = bucket_floor_ns(bucket) as f64 / bucket_floor_ns(bucket - 1) as f64;
            assert!((1.05..=1.13).contains(&width), "{bucket}: {width}");
        }
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_window() {
        let mut window = LatencySnapshot::default();
        for ms in 1..=100u64 {
            window.buckets[latency_bucket(ms * 1_000_000)] += 1;
            window.steps += 1;
        }
        let p50 = window.quantile_ns(0.5).unwrap();
        let p99 = window.quantile_ns(0.99).unwrap();
        assert!((50_000_000..=56_000_000).contains(&p50), "{p50}");
        assert!((99_000_000..=109_000_000).contains(&p99), "{p99}");
        assert_eq!(LatencySnapshot::default().quantile_ns(0.99), None);
        assert!(window.slower_than(90_000_000) <= 10);
    }

    #[test]
    fn caps_are_per_slot_and_expire_like_a_decision() {
        let region = crate::compute::Region::new_boxed();
        let control = &region.control;
        let now = 5_000_000_000;
        assert_eq!(control.cap(0, now), None, "never published: uncapped");
        let mut caps = [0u8; crate::compute::TENANTS];
        caps[0] = 64;
        caps[9] = 1;
        caps[31] = 127;
        caps[5] = CAP_UNITS;
        control.publish_caps(&caps, now);
        assert_eq!(control.cap(0, now), Some(64));
        assert_eq!(control.cap(9, now + DECISION_TTL_NS), Some(1));
        assert_eq!(control.cap(31, now), Some(127));
        assert_eq!(control.cap(5, now), None, "the whole GPU is no cap");
        assert_eq!(control.cap(1, now), None);
        assert_eq!(control.cap(8, now), None);
        assert_eq!(control.cap(0, now + DECISION_TTL_NS + 1), None, "expired");
        // Published again without it: uncapped at once.
        caps[0] = 0;
        control.publish_caps(&caps, now + 1);
        assert_eq!(control.cap(0, now + 1), None);
        assert_eq!(control.cap(9, now + 1), Some(1));
    }

    #[test]
    fn steps_count_until_the_application_counts_its_own_units() {
        let region = crate::compute::Region::new_boxed();
        region.count_steps(3, 2);
        assert_eq!(region.progress(3), (2, false));
        region.count_progress(3, 10);
        assert_eq!(region.progress(3), (12, true));
        region.count_steps(3, 5);
        assert_eq!(region.progress(3), (12, true), "steps no longer count");
        region.count_progress(3, 1);
        assert_eq!(region.progress(3), (13, true));
        assert_eq!(region.progress(4), (0, false));
    }

    #[test]
    fn steps_over_the_published_target_are_counted_exactly() {
        let region = crate::compute::Region::new_boxed();
        let control = &region.control;
        // No target yet: nothing counted, the histogram answers.
        control.record_step(2, 1_240_000);
        let before = control.latency(2);
        assert_eq!((before.over_target, before.counted_against_ns), (0, 0));
        control.publish_target(2, 1_229_000);
        let start = control.latency(2);
        // 1.240 ms and 1.230 ms share a bucket with the 1.229 ms target (1.152-1.28 ms): the
        // histogram cannot tell them from 1.2 ms; the exact count can.
        for latency in [1_200_000, 1_229_000, 1_230_000, 1_240_000, 1_500_000] {
            control.record_step(2, latency);
        }
        let window = control.latency(2).since(&start);
        assert_eq!(window.steps, 5);
        assert_eq!(window.counted_against_ns, 1_229_000);
        assert_eq!(window.over(1_229_000), 3);
        assert_eq!(
            window.slower_than(1_229_000),
            1,
            "only 1.5 ms's bucket is all slower"
        );
        // Judged against another target, the count does not apply.
        assert_eq!(window.over(1_100_000), window.slower_than(1_100_000));
        // A window across a change of target mixes two targets: the histogram answers.
        control.publish_target(2, 2_000_000);
        control.record_step(2, 1_500_000);
        let mixed = control.latency(2).since(&start);
        assert_eq!(mixed.counted_against_ns, 0);
        assert_eq!(mixed.over(1_229_000), mixed.slower_than(1_229_000));
        // The slot's next tenant starts clean.
        control.clear_latency(2);
        let cleared = control.latency(2);
        assert_eq!((cleared.over_target, cleared.counted_against_ns), (0, 0));
    }

    #[test]
    fn a_quantile_within_its_bucket_stays_in_it_and_near_the_truth() {
        for (low_ms, high_ms) in [(1.0, 1.3), (3.0, 5.0), (0.9, 0.95), (10.0, 40.0)] {
            let mut window = LatencySnapshot::default();
            let mut exact = Vec::new();
            for i in 0..1_000u64 {
                let ns = ((low_ms + (high_ms - low_ms) * i as f64 / 999.0) * 1e6) as u64;
                window.buckets[latency_bucket(ns)] += 1;
                window.steps += 1;
                exact.push(ns);
            }
            for q in [0.5, 0.9, 0.99] {
                let truth = exact[((q * 1_000.0) as usize).saturating_sub(1)] as f64;
                let within = window.quantile_within_ns(q).unwrap() as f64;
                let edge = window.quantile_ns(q).unwrap() as f64;
                // Never past the bucket's edges; close where the steps spread over the bucket
                // (a range that ends inside a bucket crowds its steps at the bucket's start).
                let floor = bucket_floor_ns(latency_bucket(truth as u64)) as f64;
                assert!(
                    within >= floor && edge >= within,
                    "{q}: {edge} {within} {truth}"
                );
                if high_ms / low_ms >= 1.6 {
                    assert!(
                        (within / truth - 1.0).abs() <= 0.05,
                        "{q}: {within} vs {truth}"
                    );
                }
            }
        }
        // One step: the middle of its bucket.
        let mut one = LatencySnapshot::default();
        one.buckets[latency_bucket(5_000_000)] += 1;
        let bucket = latency_bucket(5_000_000);
        let middle = (bucket_floor_ns(bucket) + bucket_floor_ns(bucket + 1)) / 2;
        assert!(one.quantile_within_ns(0.99).unwrap().abs_diff(middle) <= 1);
        assert_eq!(LatencySnapshot::default().quantile_within_ns(0.5), None);
    }

    #[test]
    fn a_decision_round_trips_and_expires() {
        let decision = Decision {
            sms: 96,
            inflight: 2,
            pause: true,
            guard_us: 480,
            exclusive: true,
            level: 7,
        };
        assert_eq!(Decision::unpack(decision.pack()), decision);
        let region = crate::compute::Region::new_boxed();
        let control = &region.control;
        assert_eq!(control.decision(1), Decision::default());
        control.publish(decision, 1_000);
        assert_eq!(control.decision(1_000 + DECISION_TTL_NS), decision);
        assert_eq!(
            control.decision(2_000 + DECISION_TTL_NS),
            Decision::default()
        );
    }

    #[test]
    fn a_step_holds_others_back_only_while_open_and_never_for_ever() {
        let region = crate::compute::Region::new_boxed();
        let control = &region.control;
        assert!(!control.step_in_flight(10));
        control.open_step(100);
        assert!(control.step_in_flight(200));
        control.close_step(300);
        assert!(!control.step_in_flight(400));
        control.open_step(500);
        assert!(!control.step_in_flight(500 + STEP_OPEN_MAX_NS));
        control.record_step(3, 1_500_000);
        let snapshot = control.latency(3);
        assert_eq!((snapshot.steps, snapshot.total_ns), (1, 1_500_000));
        let later = control.latency(3);
        assert_eq!(later.since(&snapshot).steps, 0);
    }
}
