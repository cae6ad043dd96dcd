//! Token-bucket arithmetic on a single 64-bit word, so that a bucket shared between processes
//! needs nothing but compare-and-swap.
//!
//! A classic token bucket keeps two numbers, the tokens and the time of the last refill, and must
//! update them together: across processes that needs a lock (which a `kill -9` can leave held) or
//! a 128-bit CAS. Instead the bucket keeps one number, `tat_ns` (the "theoretical arrival time" of
//! the generic cell rate algorithm): the instant at which the bucket will be full again. At time
//! `now` it holds `(now + burst_ns − max(tat_ns, now)) × rate` bytes, where `burst_ns` is the time
//! the rate takes to send `burst_bytes`. Sending `bytes` costs `cost_ns = ⌈bytes / rate⌉` and is
//! admitted when `max(tat_ns, now) + cost_ns ≤ now + burst_ns`; then
//! `tat_ns ← max(tat_ns, now) + cost_ns`. Refill is implicit, so there is no refill arithmetic to
//! overflow and no second word to keep consistent.
//!
//! **Bound.** Over any interval of length `Δt` the bytes admitted are at most
//! `rate × Δt + burst_bytes`: each admission moves `max(tat_ns, now)` forward by its cost, time
//! moves it forward by at most `Δt`, and it never passes `now + burst_ns`. A request larger than
//! the whole burst would otherwise wait forever, so it is admitted when the bucket is full and
//! drives it into debt; with such requests the bound is `rate × Δt + max(burst, request)`.
//!
//! **Rate changes** take effect at the next request: the debt is kept in nanoseconds, so a flow
//! that was 1 ms ahead of its old rate stays 1 ms ahead.
//!
//! This module reads no clock: callers pass `now_ns` (CLOCK_MONOTONIC, the same clock in every
//! process of a node).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A rate that admits everything without touching the bucket word (no sharing configured).
pub const RATE_UNLIMITED: u64 = u64::MAX;
/// The smallest default burst: a few of NCCL's largest network requests (512 KiB to 1 MiB
/// steps), so that one request never waits for a bucket that can never hold it.
pub const BURST_BYTES_MIN: u64 = 4 << 20;
/// The largest burst a bucket may be configured with.
pub const BURST_BYTES_MAX: u64 = 1 << 30;
/// The default burst, as time at the bucket's rate.
pub const BURST_NS_DEFAULT: u64 = 2_000_000;
/// Compare-and-swap attempts before a contended caller is told to come back shortly.
pub const CAS_ATTEMPTS_MAX: u32 = 64;
/// The wait reported after [`CAS_ATTEMPTS_MAX`] failed attempts.
pub const CONTENDED_WAIT_NS: u64 = 1_000;
/// The wait reported by a bucket whose rate is 0; the rate may change, so callers re-poll.
pub const RATE_ZERO_WAIT_NS: u64 = 1_000_000;
/// The longest wait ever reported; longer debts are re-polled (the rate may have changed).
pub const WAIT_NS_MAX: u64 = 1_000_000_000;

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// A bucket's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketConfig {
    /// Bytes per second; 0 stops the flow, [`RATE_UNLIMITED`] lets everything through.
    pub rate_bytes_per_second: u64,
    /// At most [`BURST_BYTES_MAX`].
    pub burst_bytes: u64,
}

impl BucketConfig {
    /// The default for a rate: [`BURST_NS_DEFAULT`] worth of bytes, within
    /// [`BURST_BYTES_MIN`]..=[`BURST_BYTES_MAX`].
    pub fn for_rate(rate_bytes_per_second: u64) -> BucketConfig {
        let burst =
            u128::from(rate_bytes_per_second) * u128::from(BURST_NS_DEFAULT) / NANOS_PER_SECOND;
        let burst_bytes = burst.clamp(u128::from(BURST_BYTES_MIN), u128::from(BURST_BYTES_MAX));
        let config = BucketConfig {
            rate_bytes_per_second,
            burst_bytes: burst_bytes as u64,
        };
        assert!(config.is_valid());
        config
    }

    pub fn is_valid(&self) -> bool {
        self.burst_bytes > 0 && self.burst_bytes <= BURST_BYTES_MAX
    }
}

/// What a sender may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Send now; the bytes are charged.
    Admitted,
    /// Nothing was charged; ask again after this long (at most [`WAIT_NS_MAX`]).
    WaitFor(Duration),
    /// The bucket no longer belongs to this flow (the agent freed or reassigned its slot): look
    /// it up again.
    Gone,
}

/// The pure decision for one request: admit (and the new word) or wait (and for how long).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Admit { tat_ns: u64 },
    Wait { wait_ns: u64 },
}

/// How long `bytes` take at `rate` (> 0), rounded up so the bucket never admits above its rate;
/// saturates at `u64::MAX` ns (585 years).
pub fn cost_ns(bytes: u64, rate_bytes_per_second: u64) -> u64 {
    assert!(rate_bytes_per_second > 0);
    let rate = u128::from(rate_bytes_per_second);
    let cost = (u128::from(bytes) * NANOS_PER_SECOND).div_ceil(rate);
    u64::try_from(cost).unwrap_or(u64::MAX)
}

/// The burst as time, rounded down (a smaller burst is the safe side).
fn burst_ns(config: BucketConfig) -> u64 {
    assert!(config.rate_bytes_per_second > 0);
    let burst = u128::from(config.burst_bytes) * NANOS_PER_SECOND
        / u128::from(config.rate_bytes_per_second);
    u64::try_from(burst).unwrap_or(u64::MAX)
}

/// Decides a request of `bytes` at `now_ns` against the bucket word `tat_ns`.
pub fn decide(tat_ns: u64, now_ns: u64, bytes: u64, config: BucketConfig) -> Decision {
    assert!(config.is_valid());
    if config.rate_bytes_per_second == RATE_UNLIMITED || bytes == 0 {
        return Decision::Admit { tat_ns };
    }
    if config.rate_bytes_per_second == 0 {
        return Decision::Wait {
            wait_ns: RATE_ZERO_WAIT_NS,
        };
    }
    let burst = burst_ns(config);
    let cost = cost_ns(bytes, config.rate_bytes_per_second);
    let start = tat_ns.max(now_ns);
    let debt = start - now_ns;
    // A request larger than the whole burst only needs a full bucket (debt 0).
    let needed = debt.saturating_add(cost.min(burst));
    if needed <= burst {
        let tat_ns = start.saturating_add(cost);
        assert!(tat_ns >= now_ns);
        Decision::Admit { tat_ns }
    } else {
        let wait_ns = needed - burst;
        assert!(wait_ns > 0);
        Decision::Wait { wait_ns }
    }
}

/// Charges `bytes` to the bucket word `tat_ns` if the bucket allows it, with a bounded CAS loop.
///
/// One word is the whole protocol, so relaxed ordering suffices: compare-and-swap on one location
/// is linearizable whatever the ordering, and no other memory is published through it.
pub fn try_consume(tat_ns: &AtomicU64, config: BucketConfig, bytes: u64, now_ns: u64) -> Admission {
    let mut current = tat_ns.load(Ordering::Relaxed);
    for _ in 0..CAS_ATTEMPTS_MAX {
        match decide(current, now_ns, bytes, config) {
            Decision::Admit { tat_ns: next } if next == current => return Admission::Admitted,
            Decision::Admit { tat_ns: next } => {
                match tat_ns.compare_exchange_weak(
                    current,
                    next,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Admission::Admitted,
                    Err(actual) => current = actual,
                }
            }
            Decision::Wait { wait_ns } => {
                return Admission::WaitFor(Duration::from_nanos(wait_ns.min(WAIT_NS_MAX)));
            }
        }
    }
    Admission::WaitFor(Duration::from_nanos(CONTENDED_WAIT_NS))
}

#[cfg(test)]
#[path = "bucket_test.rs"]
mod bucket_test;
