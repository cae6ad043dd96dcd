//! Semantic hints of elastic memory (issue 17, `docs/design/elastic-memory.md`, "Reclaim", step
//! 1): before the swap moves a borrower's chunks to host memory for a want, a hint helper
//! registered in the borrower's process (`vgpu.torch`, or an engine's own hook) gets a bounded
//! budget to free memory its framework caches but does not use. Frees during that budget are
//! credited at once (`hooks::credit`) and reduce what must be swapped; a want they meet swaps
//! nothing. Processes without a helper swap at once, as before.
//!
//! The helper talks to this module through three exported C functions (`exports`):
//! `vgpu_memory_hint_register()`, `vgpu_memory_want(uint64_t *bytes)` (polled: what this process
//! is asked to give back now) and `vgpu_memory_hint_done(uint64_t freed)` (it did what it could;
//! the rest may be swapped without waiting out the budget). The process-wide words here are what
//! the helper's poll reads without a lock; a hint in progress ([`Phase`]) lives under the
//! process's lock in `hooks`, which starts it at a want and acts on [`Phase::next`].
//!
//! Safe code; no driver calls.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// How long a registered helper has to free memory before the swap takes the rest, unless
/// `VGPU_MEMORY_HINT_MS` says otherwise.
pub const BUDGET_MS_DEFAULT: u64 = 100;
/// The longest budget `VGPU_MEMORY_HINT_MS` may give: well under the 5 s a tenant waits for a
/// reclaim (`elastic::RECLAIM_WAIT_MAX_MS`), so that the swap still has time to move the rest.
pub const BUDGET_MS_MAX: u64 = 2_000;

/// How long a helper of a process without swappable chunks takes no want after a hint it did
/// not meet (the rest went to the tenant's other processes).
pub const REST_AFTER_UNMET: Duration = Duration::from_secs(1);

/// The process whose helper registered (0: none). A pid, so that a child after `fork` (where
/// the helper's thread does not exist) is not taken for a process with a helper.
static REGISTERED_BY: AtomicU32 = AtomicU32::new(0);
/// Bytes the helper is asked to free now and has not yet (0: nothing asked).
static ASKED: AtomicU64 = AtomicU64::new(0);
/// The helper said it finished the hint in progress.
static DONE: AtomicBool = AtomicBool::new(false);
/// A hint is in progress (a [`Phase`] exists): the launch and copy paths then call in to end it.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The helper registers: from now on a want on this process's tenant waits for it first.
pub fn register() {
    REGISTERED_BY.store(std::process::id(), SeqCst);
}

/// Whether a helper of this process registered.
pub fn registered() -> bool {
    REGISTERED_BY.load(SeqCst) == std::process::id()
}

/// What the helper is asked to free now (its poll): nothing once it said it is done.
pub fn asked() -> u64 {
    if registered() && !DONE.load(SeqCst) {
        ASKED.load(SeqCst)
    } else {
        0
    }
}

/// Whether a hint is in progress in this process (one load).
pub fn in_progress() -> bool {
    ACTIVE.load(SeqCst)
}

/// Whether the hint in progress is met by the frees (it can end without a swap).
pub fn met() -> bool {
    ACTIVE.load(SeqCst) && ASKED.load(SeqCst) == 0
}

/// The helper finished what it could do for the hint in progress.
pub fn done() {
    DONE.store(true, SeqCst);
}

/// The budget a helper has (`VGPU_MEMORY_HINT_MS`, read once; a value that is not a number of
/// milliseconds up to [`BUDGET_MS_MAX`] is said once and the default used).
pub fn budget() -> Duration {
    static BUDGET: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let name = tenant_abi::env::var::MEMORY_HINT_MS;
        let text = std::env::var(name).ok();
        let ms = match parse_budget_ms(text.as_deref()) {
            Ok(ms) => ms,
            Err(text) => {
                crate::log::error(format_args!(
                    "{name}={text} is not a number of milliseconds from 0 to {BUDGET_MS_MAX}; \
                     hint helpers get {BUDGET_MS_DEFAULT} ms"
                ));
                BUDGET_MS_DEFAULT
            }
        };
        Duration::from_millis(ms)
    })
}

/// `VGPU_MEMORY_HINT_MS`: unset is the default; else whole milliseconds up to the maximum.
pub fn parse_budget_ms(text: Option<&str>) -> Result<u64, &str> {
    let Some(text) = text else {
        return Ok(BUDGET_MS_DEFAULT);
    };
    match text.trim().parse::<u64>() {
        Ok(ms) if ms <= BUDGET_MS_MAX => Ok(ms),
        _ => Err(text),
    }
}

/// A child after `fork`: no helper, nothing asked.
pub fn forked() {
    ASKED.store(0, SeqCst);
    DONE.store(false, SeqCst);
    ACTIVE.store(false, SeqCst);
}

/// A hint in progress on one device: what was asked, what the process freed since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phase {
    pub device: usize,
    pub asked: u64,
    pub freed: u64,
    pub started: Instant,
}

/// What to do about a hint in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The helper still has time: nothing moves, launches and copies go on.
    Wait,
    /// The frees met the want: nothing is swapped.
    Met { freed: u64 },
    /// The budget ran out (or the helper is done) short of the want: `remaining` may be swapped.
    Swap { freed: u64, remaining: u64 },
}

impl Phase {
    /// A want of `asked` bytes on `device`, handed to the helper now.
    pub fn start(device: usize, asked: u64, now: Instant) -> Phase {
        assert!(asked > 0, "a hint asks for bytes");
        DONE.store(false, SeqCst);
        ASKED.store(asked, SeqCst);
        ACTIVE.store(true, SeqCst);
        Phase {
            device,
            asked,
            freed: 0,
            started: now,
        }
    }

    /// The process freed `bytes` on the device while the hint is in progress.
    pub fn credit(&mut self, bytes: u64) {
        self.freed = self.freed.saturating_add(bytes);
        ASKED.store(self.asked.saturating_sub(self.freed), SeqCst);
    }

    /// Whether the helper said it is done.
    pub fn helper_done() -> bool {
        DONE.load(SeqCst)
    }

    /// What to do now, `budget` after `started` at the latest (`done`: the helper finished).
    pub fn next(&self, now: Instant, budget: Duration, done: bool) -> Next {
        if self.freed >= self.asked {
            return Next::Met { freed: self.freed };
        }
        if done || now.saturating_duration_since(self.started) >= budget {
            let remaining = self.asked - self.freed;
            assert!(remaining > 0 && remaining <= self.asked);
            return Next::Swap {
                freed: self.freed,
                remaining,
            };
        }
        Next::Wait
    }

    /// The hint is over (met, or handed to the swap): the helper is asked nothing.
    pub fn end(self) {
        ASKED.store(0, SeqCst);
        DONE.store(false, SeqCst);
        ACTIVE.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_hint_waits_for_its_budget_then_hands_the_rest_to_the_swap() {
        let began = Instant::now();
        let budget = Duration::from_millis(100);
        let mut phase = Phase::start(0, 8 * MIB, began);
        assert_eq!(phase.next(began, budget, false), Next::Wait);
        phase.credit(2 * MIB);
        assert_eq!(
            phase.next(began + Duration::from_millis(99), budget, false),
            Next::Wait
        );
        assert_eq!(
            phase.next(began + budget, budget, false),
            Next::Swap {
                freed: 2 * MIB,
                remaining: 6 * MIB
            }
        );
        // The helper said it is done: no need to wait out the budget.
        assert_eq!(
            phase.next(began, budget, true),
            Next::Swap {
                freed: 2 * MIB,
                remaining: 6 * MIB
            }
        );
        // Frees that meet the want: nothing to swap, whatever the clock says.
        phase.credit(7 * MIB);
        assert_eq!(
            phase.next(began + budget * 10, budget, true),
            Next::Met { freed: 9 * MIB }
        );
    }

    #[test]
    fn the_budget_is_read_from_the_environment_within_bounds() {
        assert_eq!(parse_budget_ms(None), Ok(BUDGET_MS_DEFAULT));
        assert_eq!(parse_budget_ms(Some("250")), Ok(250));
        assert_eq!(parse_budget_ms(Some("0")), Ok(0));
        assert_eq!(parse_budget_ms(Some("5000")), Err("5000"));
        assert_eq!(parse_budget_ms(Some("fast")), Err("fast"));
    }
}
