//! A lock-free latency histogram for the fleet simulator: thousands of tasks record into it at
//! once, and percentiles come out with a bounded relative error.
//!
//! Buckets are log-linear in microseconds: exact below 16 µs, then 16 buckets per power of two,
//! so a percentile is within 1/16 (6.25%) of the true value. Values above
//! [`LATENCY_MICROS_MAX`] land in the last bucket (and still count in `max`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Sub-buckets per power of two (and the exact range below it).
const SUB_BUCKETS: u64 = 16;
const SUB_BUCKET_BITS: u32 = 4;
/// Largest exponent tracked: 2^27 µs is about 134 s, beyond any call timeout.
const EXPONENT_MAX: u32 = 27;
const BUCKETS: usize =
    (SUB_BUCKETS + (EXPONENT_MAX - SUB_BUCKET_BITS + 1) as u64 * SUB_BUCKETS) as usize;
/// Values above this many microseconds share the last bucket.
pub const LATENCY_MICROS_MAX: u64 = (1 << (EXPONENT_MAX + 1)) - 1;

/// Counts of latencies, updated with relaxed atomics (a summary read while tasks record is a
/// snapshot that may be off by the calls in flight, which is fine for reporting).
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_micros: AtomicU64,
    max_micros: AtomicU64,
}

/// Percentiles of a histogram, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Default for LatencyHistogram {
    fn default() -> LatencyHistogram {
        LatencyHistogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
            max_micros: AtomicU64::new(0),
        }
    }
}

impl LatencyHistogram {
    pub fn record(&self, elapsed: Duration) {
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = bucket_of(micros);
        assert!(bucket < BUCKETS);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
        self.max_micros.fetch_max(micros, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The value below which a fraction `quantile` of the recorded latencies lie (the upper
    /// bound of the bucket that holds it, capped at the largest value seen); zero when empty.
    pub fn quantile(&self, quantile: f64) -> Duration {
        assert!((0.0..=1.0).contains(&quantile), "a quantile is in [0, 1]");
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|bucket| bucket.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return Duration::ZERO;
        }
        let rank = ((quantile * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (bucket, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                let upper = bucket_upper_micros(bucket);
                let max = self.max_micros.load(Ordering::Relaxed);
                return Duration::from_micros(upper.min(max.max(1)));
            }
        }
        unreachable!("the rank is at most the total")
    }

    pub fn summary(&self) -> LatencySummary {
        let count = self.count();
        let ms = |duration: Duration| duration.as_secs_f64() * 1e3;
        let mean_ms = if count == 0 {
            0.0
        } else {
            self.sum_micros.load(Ordering::Relaxed) as f64 / count as f64 / 1e3
        };
        LatencySummary {
            count,
            mean_ms,
            p50_ms: ms(self.quantile(0.50)),
            p90_ms: ms(self.quantile(0.90)),
            p99_ms: ms(self.quantile(0.99)),
            p999_ms: ms(self.quantile(0.999)),
            max_ms: self.max_micros.load(Ordering::Relaxed) as f64 / 1e3,
        }
    }
}

impl std::fmt::Display for LatencySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms ({} calls)",
            self.p50_ms, self.p90_ms, self.p99_ms, self.p999_ms, self.max_ms, self.count
        )
    }
}

fn bucket_of(micros: u64) -> usize {
    let micros = micros.min(LATENCY_MICROS_MAX);
    if micros < SUB_BUCKETS {
        return micros as usize;
    }
    let exponent = 63 - micros.leading_zeros();
    assert!((SUB_BUCKET_BITS..=EXPONENT_MAX).contains(&exponent));
    let sub = (micros >> (exponent - SUB_BUCKET_BITS)) & (SUB_BUCKETS - 1);
    (SUB_BUCKETS + u64::from(exponent - SUB_BUCKET_BITS) * SUB_BUCKETS + sub) as usize
}

/// The largest value (µs) that falls into `bucket`.
fn bucket_upper_micros(bucket: usize) -> u64 {
    let bucket = bucket as u64;
    if bucket < SUB_BUCKETS {
        return bucket;
    }
    let exponent = (bucket - SUB_BUCKETS) / SUB_BUCKETS + u64::from(SUB_BUCKET_BITS);
    let sub = (bucket - SUB_BUCKETS) % SUB_BUCKETS;
    let width = 1 << (exponent - u64::from(SUB_BUCKET_BITS));
    (SUB_BUCKETS + sub) * width + width - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_lies_in_its_bucket_within_one_sixteenth() {
        for micros in (0..5000).chain([65_535, 65_536, 1_000_000, LATENCY_MICROS_MAX]) {
            let bucket = bucket_of(micros);
            let upper = bucket_upper_micros(bucket);
            assert!(upper >= micros, "{micros} above its bucket's bound {upper}");
            assert!(
                (upper - micros) as f64 <= micros as f64 / 16.0,
                "{micros}: bound {upper}"
            );
            if bucket > 0 {
                assert!(bucket_upper_micros(bucket - 1) < micros, "{micros}");
            }
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let histogram = LatencyHistogram::default();
        assert_eq!(histogram.quantile(0.99), Duration::ZERO);
        // 1 ms .. 100 ms, one call each.
        for ms in 1..=100 {
            histogram.record(Duration::from_millis(ms));
        }
        let within = |got: Duration, want_ms: f64| {
            let got = got.as_secs_f64() * 1e3;
            assert!(
                got >= want_ms && got <= want_ms * 1.0625,
                "{got} vs {want_ms}"
            );
        };
        within(histogram.quantile(0.5), 50.0);
        within(histogram.quantile(0.99), 99.0);
        assert_eq!(histogram.quantile(1.0), Duration::from_millis(100));
        let summary = histogram.summary();
        assert_eq!(summary.count, 100);
        assert!((summary.mean_ms - 50.5).abs() < 0.01, "{summary:?}");
        assert_eq!(summary.max_ms, 100.0);
    }
}
