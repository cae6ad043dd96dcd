//! What the dashboard remembers beyond the current state, in memory only and bounded:
//!
//! * [`UsageHistory`]: each tenant's usage over the last hour, one [`UsageSample`] per
//!   [`SAMPLE_BUCKET_MS`] (at most [`SAMPLES_PER_TENANT_MAX`] per tenant, for at most
//!   [`TENANTS_TRACKED_MAX`] tenants: at most 983,040 samples of 32 bytes in rings allocated
//!   whole, 30 MiB, plus the tenants' names, however large the pool). The leader fills it from
//!   the reports it holds (`crate::usage::Reports`), every [`SAMPLE_TICK`]; the newest sample
//!   of a bucket is replaced until the bucket is over, so the last point of a plot is at most
//!   one tick old.
//!   Like the reports it is soft state: a new leader starts an empty history.
//! * [`Elections`]: the last [`ELECTIONS_MAX`] changes of term or leader that this member saw
//!   in its Raft metrics, each with the time it saw it.
//!
//! Both are plain data with pure methods (time is passed in), tested without a runtime.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use api::v1::TenantUsage;
use serde::{Deserialize, Serialize};

/// One sample per tenant and bucket of this length (15 s).
pub const SAMPLE_BUCKET_MS: i64 = 15_000;
/// Samples kept per tenant: one hour of buckets.
pub const SAMPLES_PER_TENANT_MAX: usize = 240;
/// Tenants with a history at once; a new tenant beyond it replaces the one whose newest sample
/// is oldest, if that one is older than the newest bucket, and is not tracked otherwise.
pub const TENANTS_TRACKED_MAX: usize = 4096;
/// How often the leader samples its reports.
pub const SAMPLE_TICK: Duration = Duration::from_secs(2);
/// A node's report older than this is left out of a sample (its node stopped beating).
pub const REPORT_FRESH_MS: i64 = 30_000;
/// The span of a whole history.
pub const HISTORY_WINDOW_MS: i64 = SAMPLE_BUCKET_MS * SAMPLES_PER_TENANT_MAX as i64;
/// Changes of term or leader kept per member.
pub const ELECTIONS_MAX: usize = 20;

/// A tenant's usage summed over its GPUs at one time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSample {
    pub unix_ms: i64,
    pub memory_used_bytes: u64,
    /// Turn time charged so far, summed over GPUs: a counter (the plot shows its rate).
    pub gpu_time_ns: u64,
    pub process_count: u32,
    /// The worst node's p99 step latency (µs, saturated); 0 when not measured.
    pub latency_p99_us: u32,
}

const _: () = assert!(
    std::mem::size_of::<UsageSample>() == 32,
    "the bound in the doc"
);

/// Every tenant's usage in the reports visited, summed (see [`UsageHistory::record`]).
#[derive(Debug, Default)]
pub struct Totals {
    tenants: BTreeMap<String, UsageSample>,
}

impl Totals {
    /// Adds one usage entry of a report the leader received at `received_unix_ms`; entries of
    /// reports older than [`REPORT_FRESH_MS`] at `now_unix_ms` are left out.
    pub fn add(&mut self, now_unix_ms: i64, received_unix_ms: i64, usage: &TenantUsage) {
        if now_unix_ms.saturating_sub(received_unix_ms) > REPORT_FRESH_MS {
            return;
        }
        let total = self.tenants.entry(usage.tenant.clone()).or_default();
        total.memory_used_bytes = total
            .memory_used_bytes
            .saturating_add(usage.memory_used_bytes);
        total.gpu_time_ns = total.gpu_time_ns.saturating_add(usage.gpu_time_ns);
        total.process_count = total.process_count.saturating_add(usage.process_count);
        let p99 = u32::try_from(usage.latency_p99_us).unwrap_or(u32::MAX);
        total.latency_p99_us = total.latency_p99_us.max(p99);
    }

    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }
}

/// Each tenant's ring of samples (see the module doc for the bounds).
#[derive(Debug, Default)]
pub struct UsageHistory {
    tenants: HashMap<String, VecDeque<UsageSample>>,
    /// Tenants that found no room (since start), for the log and tests.
    pub untracked: u64,
}

fn bucket(unix_ms: i64) -> i64 {
    unix_ms.div_euclid(SAMPLE_BUCKET_MS)
}

impl UsageHistory {
    /// Takes `totals` as the samples at `now_unix_ms`: each replaces its tenant's newest sample
    /// when that is of the same bucket, and is appended otherwise (the oldest falls out of a
    /// full ring). Tenants whose newest sample left the window are forgotten.
    pub fn record(&mut self, now_unix_ms: i64, totals: Totals) {
        let horizon = now_unix_ms - HISTORY_WINDOW_MS;
        self.tenants
            .retain(|_, ring| ring.back().is_some_and(|last| last.unix_ms > horizon));
        for (tenant, mut sample) in totals.tenants {
            sample.unix_ms = now_unix_ms;
            if !self.tenants.contains_key(&tenant) && !self.make_room(now_unix_ms) {
                self.untracked += 1;
                continue;
            }
            let ring = self
                .tenants
                .entry(tenant)
                .or_insert_with(|| VecDeque::with_capacity(SAMPLES_PER_TENANT_MAX));
            match ring.back_mut() {
                Some(last) if bucket(last.unix_ms) == bucket(now_unix_ms) => *last = sample,
                // A clock stepped back: keep the ring in time order.
                Some(last) if last.unix_ms > now_unix_ms => *last = sample,
                _ => {
                    if ring.len() == SAMPLES_PER_TENANT_MAX {
                        ring.pop_front();
                    }
                    ring.push_back(sample);
                }
            }
            assert!(ring.len() <= SAMPLES_PER_TENANT_MAX, "a ring is bounded");
        }
        assert!(
            self.tenants.len() <= TENANTS_TRACKED_MAX,
            "tenants are bounded"
        );
    }

    /// Frees a place for a new tenant if all are taken: the tenant heard from least recently
    /// goes, unless it has a sample in the current bucket (then the pool has more tenants with
    /// usage than the history holds, and the newcomer waits).
    fn make_room(&mut self, now_unix_ms: i64) -> bool {
        if self.tenants.len() < TENANTS_TRACKED_MAX {
            return true;
        }
        let stalest = self
            .tenants
            .iter()
            .map(|(tenant, ring)| (ring.back().map_or(i64::MIN, |s| s.unix_ms), tenant))
            .min();
        match stalest {
            Some((newest, tenant)) if bucket(newest) < bucket(now_unix_ms) => {
                let tenant = tenant.clone();
                self.tenants.remove(&tenant);
                true
            }
            _ => false,
        }
    }

    /// `tenant`'s samples, oldest first (empty when it has none).
    pub fn samples(&self, tenant: &str) -> Vec<UsageSample> {
        let samples: Vec<UsageSample> = self
            .tenants
            .get(tenant)
            .map(|ring| ring.iter().copied().collect())
            .unwrap_or_default();
        debug_assert!(samples.windows(2).all(|w| w[0].unix_ms <= w[1].unix_ms));
        samples
    }

    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }
}

/// One change of term or leader, as this member saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Election {
    /// When this member saw it.
    pub unix_ms: i64,
    pub term: u64,
    /// 0: no leader known (yet) in this term.
    pub leader: u64,
}

/// The last [`ELECTIONS_MAX`] changes, oldest first.
#[derive(Debug, Default)]
pub struct Elections {
    changes: VecDeque<Election>,
}

impl Elections {
    /// Takes the member's current term and leader; records them when they differ from the last
    /// change. A leader found in the same term completes a change that had none. Term 0 (before
    /// any election) is not recorded.
    pub fn observe(&mut self, now_unix_ms: i64, term: u64, leader: u64) {
        // A member that has not voted yet (term 0) saw no election.
        if term == 0 {
            return;
        }
        let change = Election {
            unix_ms: now_unix_ms,
            term,
            leader,
        };
        match self.changes.back_mut() {
            Some(last) if last.term == term && last.leader == leader => return,
            Some(last) if last.term == term && last.leader == 0 => {
                last.leader = leader;
                return;
            }
            _ => {}
        }
        if self.changes.len() == ELECTIONS_MAX {
            self.changes.pop_front();
        }
        self.changes.push_back(change);
        assert!(self.changes.len() <= ELECTIONS_MAX);
    }

    /// The changes, newest first.
    pub fn newest_first(&self) -> Vec<Election> {
        self.changes.iter().rev().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(tenant: &str, memory: u64, gpu_time_ns: u64) -> TenantUsage {
        TenantUsage {
            tenant: tenant.to_owned(),
            memory_used_bytes: memory,
            gpu_time_ns,
            process_count: 1,
            ..TenantUsage::default()
        }
    }

    fn totals(now: i64, entries: &[TenantUsage]) -> Totals {
        let mut totals = Totals::default();
        for entry in entries {
            totals.add(now, now, entry);
        }
        totals
    }

    #[test]
    fn a_sample_sums_a_tenants_gpus_and_leaves_out_stale_reports() {
        let now = 1_000_000;
        let mut totals = Totals::default();
        totals.add(now, now, &usage("a", 10, 5));
        totals.add(now, now - 1_000, &usage("a", 20, 7));
        totals.add(now, now - REPORT_FRESH_MS - 1, &usage("a", 1_000, 1_000));
        totals.add(now, now, &usage("b", 1, 1));
        let mut history = UsageHistory::default();
        history.record(now, totals);
        let a = history.samples("a");
        assert_eq!(a.len(), 1);
        assert_eq!(
            a[0],
            UsageSample {
                unix_ms: now,
                memory_used_bytes: 30,
                gpu_time_ns: 12,
                process_count: 2,
                latency_p99_us: 0,
            }
        );
        assert_eq!(history.samples("b").len(), 1);
        assert!(history.samples("c").is_empty());
    }

    #[test]
    fn one_sample_per_bucket_and_an_hour_per_ring() {
        let mut history = UsageHistory::default();
        let start = 10 * SAMPLE_BUCKET_MS;
        // Two ticks in one bucket: the second replaces the first.
        history.record(start, totals(start, &[usage("a", 1, 0)]));
        history.record(start + 2_000, totals(start, &[usage("a", 2, 0)]));
        let samples = history.samples("a");
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].memory_used_bytes, 2);
        assert_eq!(samples[0].unix_ms, start + 2_000);
        // More than an hour of buckets: the ring keeps the newest hour.
        let buckets = SAMPLES_PER_TENANT_MAX as i64 + 10;
        for at in 1..=buckets {
            let now = start + at * SAMPLE_BUCKET_MS;
            history.record(now, totals(now, &[usage("a", at as u64, 0)]));
        }
        let samples = history.samples("a");
        assert_eq!(samples.len(), SAMPLES_PER_TENANT_MAX);
        assert_eq!(
            samples.last().map(|s| s.memory_used_bytes),
            Some(buckets as u64)
        );
        assert_eq!(
            samples.first().map(|s| s.memory_used_bytes),
            Some((buckets - SAMPLES_PER_TENANT_MAX as i64 + 1) as u64)
        );
    }

    #[test]
    fn tenants_are_bounded_and_silent_ones_are_forgotten() {
        let mut history = UsageHistory::default();
        let now = 100 * SAMPLE_BUCKET_MS;
        let full: Vec<TenantUsage> = (0..TENANTS_TRACKED_MAX)
            .map(|i| usage(&format!("t{i:05}"), 1, 0))
            .collect();
        history.record(now, totals(now, &full));
        assert_eq!(history.tenants(), TENANTS_TRACKED_MAX);
        // All current: a newcomer finds no room.
        history.record(now + 1, totals(now, &[usage("new", 1, 0)]));
        assert_eq!(history.untracked, 1);
        assert!(history.samples("new").is_empty());
        // A bucket later it replaces one heard from before.
        let later = now + SAMPLE_BUCKET_MS;
        history.record(later, totals(later, &[usage("new", 1, 0)]));
        assert_eq!(history.samples("new").len(), 1);
        assert_eq!(history.tenants(), TENANTS_TRACKED_MAX);
        // After an hour of silence only the one still reporting is left.
        let much_later = later + HISTORY_WINDOW_MS - 1;
        history.record(much_later, totals(much_later, &[usage("new", 2, 0)]));
        assert_eq!(history.tenants(), 1);
        assert_eq!(history.samples("new").len(), 2);
    }

    #[test]
    fn elections_record_changes_of_term_and_leader() {
        let mut elections = Elections::default();
        elections.observe(0, 0, 0);
        elections.observe(1, 1, 0);
        elections.observe(2, 1, 1);
        elections.observe(3, 1, 1);
        elections.observe(4, 2, 0);
        elections.observe(5, 2, 3);
        elections.observe(6, 3, 3);
        let seen: Vec<(u64, u64)> = elections
            .newest_first()
            .iter()
            .map(|e| (e.term, e.leader))
            .collect();
        assert_eq!(seen, [(3, 3), (2, 3), (1, 1)]);
        assert_eq!(elections.newest_first()[2].unix_ms, 1);
        for term in 4..100 {
            elections.observe(term as i64, term, 1);
        }
        let newest = elections.newest_first();
        assert_eq!(newest.len(), ELECTIONS_MAX);
        assert_eq!(newest[0].term, 99);
    }
}
