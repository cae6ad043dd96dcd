//! What a GPU's memory board keeps back from its tenants, from measurement (issue 17): the
//! memory the GPU uses outside the board's accounting (each process's context and the kernels
//! it loads, 0.5-0.7 GiB measured on an H100; libraries' own allocations; processes that are not
//! tenants) is NVML's used memory less what the board counts resident. A fixed 2 GiB reserve was
//! too little for three PyTorch jobs on an H200: the board lent memory the driver did not have,
//! and a job within its request got the driver's out-of-memory.
//!
//! Pure: samples in, the reserve out. The monitor samples once a second and sets the board's
//! capacity to the GPU's memory less the reserve ([`capacity_change`]).
//!
//! **Only what lasts counts.** The two counts are read at slightly different instants and each
//! runs ahead of the other at times: the board counts an exited process's memory free before the
//! driver has released it (up to a few hundred ms on an H200), which reads as memory outside the
//! board. A reserve raised on such a sample would take the room back from borrowers, by swapping
//! them to host memory, for nothing. So the outside is the least of the samples over
//! [`SETTLE_NS`]: it rises only once it has lasted that long (a within-request allocation the
//! driver refuses meanwhile asks the borrowers and retries, `interposer::hooks`), and falls at
//! the first sample that shows it lower.
use std::collections::VecDeque;

/// The least a board keeps back: headroom for fragmentation and the driver's own use, and what
/// every board kept before it was measured.
pub const FLOOR_BYTES: u64 = 2 << 30;

/// Kept back on top of the outside use that lasted: a process starting on the GPU in the
/// meantime (a context and its first kernels, 0.5-0.7 GiB measured on an H100) before the next
/// samples show it.
pub const MARGIN_BYTES: u64 = 1 << 30;

/// How long the outside use must last before the reserve rises to it.
pub const SETTLE_NS: u64 = 3_000_000_000;

/// The samples a tracker keeps (bounded whatever the sampling rate).
const SAMPLES_MAX: usize = 64;

/// The least change of a board's capacity worth writing ([`capacity_change`]): smaller moves
/// would only churn the borrowers' room.
pub const STEP_MIN_BYTES: u64 = 256 << 20;

/// One GPU's reserve, from its samples.
#[derive(Debug, Default)]
pub struct Tracker {
    /// (monotonic ns, bytes outside the board), oldest first.
    samples: VecDeque<(u64, u64)>,
}

impl Tracker {
    /// A sample at `now_ns`: NVML's used memory, read between two reads of the board's resident
    /// total (`resident_before`, `resident_after`: the larger counts, so that an allocation
    /// granted between the reads is not taken for outside use). Returns the reserve.
    pub fn observe(
        &mut self,
        now_ns: u64,
        used_bytes: u64,
        resident_before: u64,
        resident_after: u64,
    ) -> u64 {
        let outside = used_bytes.saturating_sub(resident_before.max(resident_after));
        if self.samples.back().is_some_and(|&(at, _)| at > now_ns) {
            // A clock that went back: start again rather than mix two timelines.
            self.samples.clear();
        }
        self.samples.push_back((now_ns, outside));
        // Keep the newest sample at or before the window's start (the window then spans it) and
        // everything after.
        while self.samples.len() > SAMPLES_MAX
            || self
                .samples
                .get(1)
                .is_some_and(|&(at, _)| now_ns.saturating_sub(at) >= SETTLE_NS)
        {
            self.samples.pop_front();
        }
        self.reserve(now_ns)
    }

    /// The reserve at `now_ns`: the floor, or the outside use that lasted [`SETTLE_NS`] (the
    /// least over samples spanning at least that long) plus the margin. The floor while the
    /// samples span less.
    pub fn reserve(&self, now_ns: u64) -> u64 {
        let Some(&(oldest, _)) = self.samples.front() else {
            return FLOOR_BYTES;
        };
        if now_ns.saturating_sub(oldest) < SETTLE_NS {
            // Not lasted long enough to raise the reserve; a low sample may still lower it to
            // the floor, which it is at already.
            return FLOOR_BYTES;
        }
        let lasting = self
            .samples
            .iter()
            .map(|&(_, outside)| outside)
            .min()
            .expect("a sample");
        FLOOR_BYTES.max(lasting.saturating_add(MARGIN_BYTES))
    }
}

/// The capacity to write on a board whose GPU has `memory_bytes` and whose capacity is
/// `current` now, for a reserve of `reserve` bytes; `None` when the move is under
/// [`STEP_MIN_BYTES`].
pub fn capacity_change(memory_bytes: u64, reserve: u64, current: u64) -> Option<u64> {
    let wanted = memory_bytes.saturating_sub(reserve);
    (wanted.abs_diff(current) >= STEP_MIN_BYTES).then_some(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const S: u64 = 1_000_000_000;

    /// Samples a second apart from t = 0 of (used, resident); the reserve after each.
    fn run(samples: &[(u64, u64)]) -> Vec<u64> {
        let mut tracker = Tracker::default();
        samples
            .iter()
            .enumerate()
            .map(|(i, &(used, resident))| tracker.observe(i as u64 * S, used, resident, resident))
            .collect()
    }

    #[test]
    fn outside_use_that_lasts_raises_the_reserve_to_it_plus_the_margin() {
        // Three contexts' worth (2.5 GiB) outside a board holding 60 GiB, for five seconds.
        let reserves = run(&[(62 * GIB + GIB / 2, 60 * GIB); 5]);
        assert_eq!(reserves[..3], [FLOOR_BYTES; 3], "not lasted 3 s yet");
        assert_eq!(reserves[3], 2 * GIB + GIB / 2 + MARGIN_BYTES);
        assert_eq!(reserves[4], reserves[3]);
    }

    #[test]
    fn a_spike_shorter_than_the_settle_time_leaves_the_reserve_alone() {
        // An exited process's 20 GiB off the board before the driver released it, for two
        // samples: never lasted.
        let mut samples = vec![(61 * GIB, 60 * GIB); 4];
        samples.extend([(61 * GIB, 40 * GIB); 2]);
        samples.extend([(41 * GIB, 40 * GIB); 4]);
        let reserves = run(&samples);
        assert!(reserves.iter().all(|&r| r == FLOOR_BYTES), "{reserves:?}");
    }

    #[test]
    fn the_reserve_falls_at_the_first_sample_that_shows_less_outside() {
        let mut samples = vec![(66 * GIB, 60 * GIB); 5];
        samples.push((61 * GIB, 60 * GIB));
        let reserves = run(&samples);
        assert_eq!(reserves[4], 6 * GIB + MARGIN_BYTES);
        assert_eq!(reserves[5], FLOOR_BYTES);
    }

    #[test]
    fn an_allocation_between_the_two_reads_of_the_board_is_not_outside_use() {
        let mut tracker = Tracker::default();
        for i in 0..5 {
            // NVML saw 8 GiB more than the board's first read: granted in between.
            assert_eq!(
                tracker.observe(i * S, 68 * GIB, 60 * GIB, 68 * GIB),
                FLOOR_BYTES
            );
        }
    }

    #[test]
    fn used_below_resident_is_no_outside_use_and_the_samples_stay_bounded() {
        let mut tracker = Tracker::default();
        for i in 0..1_000 {
            assert_eq!(
                tracker.observe(i * S / 100, 10 * GIB, 12 * GIB, 12 * GIB),
                FLOOR_BYTES
            );
        }
        assert!(tracker.samples.len() <= SAMPLES_MAX);
        // A clock that went back starts again.
        assert_eq!(
            tracker.observe(0, 30 * GIB, 12 * GIB, 12 * GIB),
            FLOOR_BYTES
        );
        assert_eq!(tracker.samples.len(), 1);
    }

    #[test]
    fn the_capacity_moves_only_by_a_step_worth_writing() {
        assert_eq!(capacity_change(80 * GIB, 2 * GIB, 78 * GIB), None);
        assert_eq!(
            capacity_change(80 * GIB, 2 * GIB + 100 * (1 << 20), 78 * GIB),
            None
        );
        assert_eq!(capacity_change(80 * GIB, 4 * GIB, 78 * GIB), Some(76 * GIB));
        assert_eq!(capacity_change(80 * GIB, 2 * GIB, 76 * GIB), Some(78 * GIB));
        assert_eq!(
            capacity_change(GIB, 2 * GIB, 0),
            None,
            "nothing to lend either way"
        );
    }
}
