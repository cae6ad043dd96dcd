//! The bucket arithmetic over simulated time: rate accuracy, the burst bound, rate changes, and
//! the edges (zero and unlimited rates, oversized requests, overflow).

use super::*;

/// A small deterministic generator (splitmix64), so the simulations are reproducible.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

const SECOND_NS: u64 = 1_000_000_000;

/// A sender that always has data: it asks, and on `WaitFor` advances simulated time by exactly
/// the wait plus `lateness_ns_max` of random lateness. Returns the bytes admitted in `[start,
/// end)` and the time it stopped.
fn simulate(
    word: &AtomicU64,
    config: BucketConfig,
    start_ns: u64,
    end_ns: u64,
    sizes: (u64, u64),
    lateness_ns_max: u64,
    sequence: &mut Sequence,
) -> u64 {
    let mut now = start_ns;
    let mut admitted = 0u64;
    let mut steps = 0u64;
    let mut size = sequence.between(sizes.0, sizes.1);
    while now < end_ns {
        steps += 1;
        assert!(steps < 100_000_000, "the simulation does not progress");
        match try_consume(word, config, size, now) {
            Admission::Admitted => {
                admitted += size;
                size = sequence.between(sizes.0, sizes.1);
            }
            Admission::WaitFor(wait) => {
                let wait = u64::try_from(wait.as_nanos()).unwrap();
                assert!(wait > 0);
                now += wait + sequence.between(0, lateness_ns_max);
            }
            Admission::Gone => unreachable!("a plain word has no owner"),
        }
    }
    admitted
}

fn assert_within(actual: u64, expected: u64, tolerance: f64, what: &str) {
    let error = (actual as f64 - expected as f64).abs() / expected as f64;
    assert!(
        error <= tolerance,
        "{what}: {actual} vs {expected} ({:.4}% off)",
        error * 100.0
    );
}

#[test]
fn rate_is_accurate_over_ten_simulated_seconds() {
    let mut sequence = Sequence(7);
    for rate in [100_000_000, 3_000_000_000, 25_000_000_000, 150_000_000_000] {
        for sizes in [(4 << 10, 1 << 20), (1, 4 << 20), (512 << 10, 512 << 10)] {
            let word = AtomicU64::new(0);
            let config = BucketConfig::for_rate(rate);
            let admitted = simulate(&word, config, 0, 10 * SECOND_NS, sizes, 0, &mut sequence);
            assert_within(admitted, rate * 10, 0.01, &format!("{rate} B/s, {sizes:?}"));
            // Never above rate × time + burst.
            assert!(admitted <= rate * 10 + config.burst_bytes);
        }
    }
}

#[test]
fn late_senders_still_get_their_rate_while_lateness_fits_the_burst() {
    // 2 ms of burst at 1 GB/s; waking up to 100 µs late is absorbed by the burst.
    let mut sequence = Sequence(11);
    let rate = 1_000_000_000;
    let word = AtomicU64::new(0);
    let config = BucketConfig::for_rate(rate);
    let admitted = simulate(
        &word,
        config,
        5 * SECOND_NS,
        15 * SECOND_NS,
        (4 << 10, 1 << 20),
        100_000,
        &mut sequence,
    );
    assert_within(admitted, rate * 10, 0.01, "late sender");
}

#[test]
fn a_full_bucket_admits_at_most_the_burst_at_once() {
    let config = BucketConfig {
        rate_bytes_per_second: 1_000_000,
        burst_bytes: 10_000,
    };
    let word = AtomicU64::new(0);
    let now = 50 * SECOND_NS;
    let mut admitted = 0;
    while let Admission::Admitted = try_consume(&word, config, 1_000, now) {
        admitted += 1_000;
        assert!(admitted <= 10_000);
    }
    assert_eq!(admitted, 10_000);
    // The next kilobyte takes 1 ms at 1 MB/s.
    assert_eq!(
        try_consume(&word, config, 1_000, now),
        Admission::WaitFor(Duration::from_millis(1))
    );
    assert_eq!(try_consume(&word, config, 1_000, now + 999_999), {
        Admission::WaitFor(Duration::from_nanos(1))
    });
    assert_eq!(
        try_consume(&word, config, 1_000, now + 1_000_000),
        Admission::Admitted
    );
}

#[test]
fn burst_bound_holds_for_every_window() {
    // Random sizes, random lateness: in every window the bytes admitted stay under
    // rate × window + burst.
    let mut sequence = Sequence(3);
    let config = BucketConfig {
        rate_bytes_per_second: 10_000_000,
        burst_bytes: 1 << 20,
    };
    let word = AtomicU64::new(0);
    let mut now = SECOND_NS;
    let mut log: Vec<(u64, u64)> = Vec::new();
    while log.len() < 5_000 {
        let size = sequence.between(1, 1 << 20);
        match try_consume(&word, config, size, now) {
            Admission::Admitted => log.push((now, size)),
            Admission::WaitFor(wait) => {
                now += u64::try_from(wait.as_nanos()).unwrap() + sequence.between(0, 1_000_000)
            }
            Admission::Gone => unreachable!(),
        }
        if sequence.between(0, 9) == 0 {
            now += sequence.between(0, 300_000_000);
        }
    }
    for (first, &(start, _)) in log.iter().enumerate().step_by(37) {
        let mut bytes = 0u64;
        for &(at, size) in &log[first..] {
            bytes += size;
            let allowed = u128::from(at - start) * u128::from(config.rate_bytes_per_second)
                / u128::from(SECOND_NS)
                + u128::from(config.burst_bytes);
            assert!(u128::from(bytes) <= allowed, "{bytes} > {allowed}");
        }
    }
}

#[test]
fn rate_change_takes_effect() {
    let mut sequence = Sequence(5);
    let word = AtomicU64::new(0);
    let fast = BucketConfig::for_rate(10_000_000_000);
    let slow = BucketConfig::for_rate(200_000_000);
    let sizes = (64 << 10, 1 << 20);
    let first = simulate(&word, fast, 0, 2 * SECOND_NS, sizes, 0, &mut sequence);
    assert_within(first, 20_000_000_000, 0.01, "fast");
    let second = simulate(
        &word,
        slow,
        2 * SECOND_NS,
        4 * SECOND_NS,
        sizes,
        0,
        &mut sequence,
    );
    assert_within(second, 400_000_000, 0.02, "slowed down");
    let third = simulate(
        &word,
        fast,
        4 * SECOND_NS,
        6 * SECOND_NS,
        sizes,
        0,
        &mut sequence,
    );
    assert_within(third, 20_000_000_000, 0.01, "sped up again");
}

#[test]
fn zero_and_unlimited_rates() {
    let word = AtomicU64::new(123);
    let stopped = BucketConfig::for_rate(0);
    assert_eq!(
        try_consume(&word, stopped, 1, 1_000),
        Admission::WaitFor(Duration::from_nanos(RATE_ZERO_WAIT_NS))
    );
    let unlimited = BucketConfig::for_rate(RATE_UNLIMITED);
    assert_eq!(unlimited.burst_bytes, BURST_BYTES_MAX);
    for _ in 0..1000 {
        assert_eq!(
            try_consume(&word, unlimited, u64::MAX, 1_000),
            Admission::Admitted
        );
    }
    assert_eq!(word.load(Ordering::Relaxed), 123, "unlimited never writes");
}

#[test]
fn oversized_requests_need_a_full_bucket_then_go_into_debt() {
    let config = BucketConfig {
        rate_bytes_per_second: 1_000_000,
        burst_bytes: 1_000,
    };
    let word = AtomicU64::new(0);
    let now = SECOND_NS;
    // 10 KB is ten bursts: admitted from a full bucket, and then the bucket owes 10 ms.
    assert_eq!(try_consume(&word, config, 10_000, now), Admission::Admitted);
    assert_eq!(
        try_consume(&word, config, 1, now),
        Admission::WaitFor(Duration::from_nanos(9_000_000 + 1_000))
    );
    // Another oversized request waits until the debt is paid.
    assert_eq!(
        try_consume(&word, config, 10_000, now + 9_000_000),
        Admission::WaitFor(Duration::from_millis(1))
    );
    assert_eq!(
        try_consume(&word, config, 10_000, now + 10_000_000),
        Admission::Admitted
    );
}

#[test]
fn arithmetic_saturates_instead_of_overflowing() {
    let config = BucketConfig {
        rate_bytes_per_second: 1,
        burst_bytes: BURST_BYTES_MAX,
    };
    assert_eq!(cost_ns(u64::MAX, 1), u64::MAX);
    let word = AtomicU64::new(0);
    assert_eq!(
        try_consume(&word, config, u64::MAX, 1 << 62),
        Admission::Admitted
    );
    assert_eq!(word.load(Ordering::Relaxed), u64::MAX);
    assert_eq!(
        try_consume(&word, config, 1, 1 << 62),
        Admission::WaitFor(Duration::from_nanos(WAIT_NS_MAX))
    );
    assert_eq!(cost_ns(0, 5), 0);
    assert_eq!(cost_ns(3, 2), 1_500_000_000);
    assert_eq!(cost_ns(1, 3), 333_333_334);
}

#[test]
fn default_bursts_are_bounded() {
    assert_eq!(BucketConfig::for_rate(1).burst_bytes, BURST_BYTES_MIN);
    assert_eq!(
        BucketConfig::for_rate(100_000_000_000).burst_bytes,
        200_000_000
    );
    assert_eq!(
        BucketConfig::for_rate(u64::MAX - 1).burst_bytes,
        BURST_BYTES_MAX
    );
}
