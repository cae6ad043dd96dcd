//! Waiting in a GPU's line (`tenant_abi::board`, "The line"; issue 17): the pacing of one wait
//! of this process for room past its request, whether for its borrowed memory that went to host
//! memory (a launch, a copy or an allocation held until it is back) or for a borrow that found
//! the GPU full and was retried. `hooks` does the waiting; this module says how often to look,
//! when to ask the other waiters for their borrowed memory (`tenant_abi::reclaim::unstall`),
//! when to say how long it has waited, and when (if ever) to give up.
//!
//! **No bound by default.** Memory taken back for another tenant's request comes back when that
//! tenant frees it; refusing the borrower's launches after a while would crash its application,
//! which is a kill by another name (issue 17: reclaimed by swapping, never by killing). So a
//! held process waits as long as its memory is taken, says so after [`REPORT_FIRST`] and then
//! every [`REPORT_EVERY`] (how long, for how much, and what would end it), and the agent reports
//! its swapped bytes. `VGPU_MEMORY_WAIT_S` bounds the wait for those who prefer an
//! out-of-memory error (the launch or allocation then fails with one line saying why).

use std::time::{Duration, Instant};

/// When a waiting process first says that it waits.
pub const REPORT_FIRST: Duration = Duration::from_secs(10);
/// How often it says so again.
pub const REPORT_EVERY: Duration = Duration::from_secs(60);
/// How often the first in line asks the other waiters again for what it lacks (what an earlier
/// round asked and nobody took is withdrawn first): a swap-out takes a drain and a copy, well
/// under a second for the sizes a GPU holds.
pub const UNSTALL_EVERY: Duration = Duration::from_secs(1);
/// A borrow that finds the GPU full is refused at once the first time, so that a caching
/// allocator frees what it caches and tries again (PyTorch's does, after synchronising the
/// device: that can take as long as the work it has queued); a borrow of the same process on the
/// same GPU within this long of that refusal waits in line instead.
pub const RETRY_WINDOW: Duration = Duration::from_secs(10);
/// How long a line must look stuck (`tenant_abi::reclaim::stuck`) before its last borrow is
/// refused: two rounds of asking, so that a process between two looks, or a want being acted on,
/// is not taken for a deadlock.
pub const STUCK_GRACE: Duration = Duration::from_secs(2);
/// The looks are 1 ms apart for this long, then [`SLOW_LOOK`] apart: a short wait (a swap-in as
/// soon as the room is there) is answered at once, a long one costs a hundred wake-ups a second.
pub const FAST_LOOKS_FOR: Duration = Duration::from_millis(100);
pub const FAST_LOOK: Duration = Duration::from_millis(1);
pub const SLOW_LOOK: Duration = Duration::from_millis(10);
/// The longest bound `VGPU_MEMORY_WAIT_S` may set (a week).
pub const WAIT_S_MAX: u64 = 7 * 24 * 3600;

/// The bound on one wait (`VGPU_MEMORY_WAIT_S`, read once): `None` waits as long as it takes. A
/// value that is not a whole number of seconds up to [`WAIT_S_MAX`] is said once and ignored.
pub fn wait_max() -> Option<Duration> {
    static MAX: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let name = tenant_abi::env::var::MEMORY_WAIT_S;
        let text = std::env::var(name).ok();
        match parse_wait_s(text.as_deref()) {
            Ok(seconds) => seconds.map(Duration::from_secs),
            Err(text) => {
                crate::log::error(format_args!(
                    "{name}={text} is not a whole number of seconds from 0 to {WAIT_S_MAX}; a \
                     process waits for its memory as long as it takes"
                ));
                None
            }
        }
    })
}

/// `VGPU_MEMORY_WAIT_S`: unset, empty or 0 is no bound; else whole seconds up to the maximum.
pub fn parse_wait_s(text: Option<&str>) -> Result<Option<u64>, &str> {
    let Some(text) = text else {
        return Ok(None);
    };
    if text.trim().is_empty() {
        return Ok(None);
    }
    match text.trim().parse::<u64>() {
        Ok(0) => Ok(None),
        Ok(seconds) if seconds <= WAIT_S_MAX => Ok(Some(seconds)),
        _ => Err(text),
    }
}

/// How a wait in line ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End<T> {
    Done(T),
    /// `VGPU_MEMORY_WAIT_S` passed.
    TimedOut,
    /// The line was stuck and this borrow was the one refused (rule 6 of `tenant_abi::reclaim`).
    Yielded,
}

/// The pacing of one wait, from when it began.
#[derive(Debug, Clone)]
pub struct Pace {
    began: Instant,
    max: Option<Duration>,
    next_report: Duration,
    next_unstall: Duration,
}

impl Pace {
    pub fn new(began: Instant, max: Option<Duration>) -> Pace {
        Pace {
            began,
            max,
            next_report: REPORT_FIRST,
            next_unstall: Duration::ZERO,
        }
    }

    /// How long it has waited at `now`.
    pub fn waited(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.began)
    }

    /// How long to sleep before the next look.
    pub fn look_after(&self, now: Instant) -> Duration {
        if self.waited(now) < FAST_LOOKS_FOR {
            FAST_LOOK
        } else {
            SLOW_LOOK
        }
    }

    /// Whether to say now that it waits (once at [`REPORT_FIRST`], then every
    /// [`REPORT_EVERY`]).
    pub fn report_due(&mut self, now: Instant) -> bool {
        if self.waited(now) < self.next_report {
            return false;
        }
        self.next_report = self.waited(now) + REPORT_EVERY;
        true
    }

    /// Whether to ask the other waiters now (at once, then every [`UNSTALL_EVERY`]).
    pub fn unstall_due(&mut self, now: Instant) -> bool {
        if self.waited(now) < self.next_unstall {
            return false;
        }
        self.next_unstall = self.waited(now) + UNSTALL_EVERY;
        true
    }

    /// Whether the bound (if any) has passed.
    pub fn expired(&self, now: Instant) -> bool {
        self.max.is_some_and(|max| self.waited(now) >= max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_off_unless_given_in_whole_seconds() {
        assert_eq!(parse_wait_s(None), Ok(None));
        assert_eq!(parse_wait_s(Some("")), Ok(None));
        assert_eq!(parse_wait_s(Some("0")), Ok(None));
        assert_eq!(parse_wait_s(Some(" 600 ")), Ok(Some(600)));
        assert_eq!(parse_wait_s(Some("10m")), Err("10m"));
        assert_eq!(parse_wait_s(Some("-1")), Err("-1"));
        assert_eq!(parse_wait_s(Some("999999999")), Err("999999999"));
    }

    #[test]
    fn a_wait_looks_fast_then_slow_reports_at_10_s_then_every_minute_and_ends_only_at_its_bound() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut pace = Pace::new(start, None);
        assert_eq!(pace.look_after(at(0)), FAST_LOOK);
        assert_eq!(pace.look_after(at(100)), SLOW_LOOK);
        assert!(pace.unstall_due(at(0)), "the first in line asks at once");
        assert!(!pace.unstall_due(at(999)));
        assert!(pace.unstall_due(at(1_000)));
        assert!(!pace.report_due(at(9_999)));
        assert!(pace.report_due(at(10_000)));
        assert!(!pace.report_due(at(10_001)));
        assert!(!pace.report_due(at(69_999)));
        assert!(pace.report_due(at(70_000)));
        assert!(!pace.expired(at(u64::from(u32::MAX))), "no bound: never");
        let bounded = Pace::new(start, Some(Duration::from_secs(30)));
        assert!(!bounded.expired(at(29_999)));
        assert!(bounded.expired(at(30_000)));
    }
}

/// How long an ask that a borrower took may still be on its way ([`still_giving`]): its quiet and
/// drain bounds (`swap::QUIESCE_WAIT_MAX_MS`, `swap::DRAIN_WAIT_MAX_MS`) and a few seconds of
/// copies and pinning.
pub const GIVING_MAX: Duration = Duration::from_secs(10);

/// Whether a borrower that took `taken` bytes of an ask (its tenant held `resident_then` when
/// asked, `resident_now` now) is still giving them, `age` after the ask: then the first in line
/// does not ask again, which would take the same memory twice (an H200 borrower asked for 21 GiB
/// gave 42: the ask was repeated a second later, while its first swap-out was still copying).
pub fn still_giving(taken: u64, resident_then: u64, resident_now: u64, age: Duration) -> bool {
    taken > 0 && resident_then.saturating_sub(resident_now) < taken && age < GIVING_MAX
}

#[cfg(test)]
mod giving_tests {
    use super::*;

    #[test]
    fn an_ask_taken_is_given_until_its_bytes_left_or_the_bound_passed() {
        let s = Duration::from_secs(1);
        assert!(!still_giving(0, 10, 10, s), "nothing taken: ask again");
        assert!(still_giving(4, 10, 10, s), "taken, nothing left yet");
        assert!(still_giving(4, 10, 7, s), "3 of 4 left");
        assert!(!still_giving(4, 10, 6, s), "all 4 left");
        assert!(!still_giving(4, 10, 10, GIVING_MAX), "past the bound");
    }
}
