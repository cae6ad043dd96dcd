//! Prometheus metrics at `GET /metrics` on the API port, in the text exposition format.
//!
//! Gauges about the pool are computed from the applied state at scrape time (so they are never
//! stale or double-counted); the commit-latency histogram is recorded by the leader as writes
//! commit, the heartbeat histogram by whichever member an agent's heartbeat reaches.

use crate::store::Shared;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the commit-latency buckets, in seconds.
const COMMIT_BUCKETS_SECONDS: [f64; 12] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

/// Upper bounds of the heartbeat-handling buckets, in seconds.
const HEARTBEAT_BUCKETS_SECONDS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

/// A Prometheus histogram with fixed buckets (cumulative counts, as the format wants them).
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum_seconds: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        assert!(bounds.is_sorted(), "bucket bounds ascend");
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum_seconds: 0.0,
        }
    }

    fn observe(&mut self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        for (bucket, bound) in self.bounds.iter().enumerate() {
            if seconds <= *bound {
                self.counts[bucket] += 1;
            }
        }
        self.count += 1;
        self.sum_seconds += seconds;
    }

    /// Writes the samples of one series; `labels` is empty or `key="value",...`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bucket, bound) in self.bounds.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                self.counts[bucket]
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = |labels: &str| {
            if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            }
        };
        let _ = writeln!(
            out,
            "{name}_sum{} {}\n{name}_count{} {}",
            braces(labels),
            self.sum_seconds,
            braces(labels),
            self.count
        );
    }
}

pub struct Metrics {
    commit: Mutex<Histogram>,
    /// Heartbeats answered while this member led, and heartbeats it forwarded to the leader.
    heartbeat_on_leader: Mutex<Histogram>,
    heartbeat_forwarded: Mutex<Histogram>,
    /// Batches of heartbeats this member forwarded to the leader (`crate::beats`).
    heartbeat_batches: std::sync::atomic::AtomicU64,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            commit: Mutex::new(Histogram::new(&COMMIT_BUCKETS_SECONDS)),
            heartbeat_on_leader: Mutex::new(Histogram::new(&HEARTBEAT_BUCKETS_SECONDS)),
            heartbeat_forwarded: Mutex::new(Histogram::new(&HEARTBEAT_BUCKETS_SECONDS)),
            heartbeat_batches: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// Raft facts for the scrape, read from openraft's metrics by the caller.
pub struct RaftFacts {
    pub id: u64,
    pub term: u64,
    pub leader: Option<u64>,
    pub last_log_index: u64,
    pub last_applied: u64,
    /// Why this member's Raft core stopped, if it did (`ControlPlane::health`).
    pub storage_failure: Option<String>,
}

impl Metrics {
    pub fn observe_commit(&self, elapsed: Duration) {
        self.commit.lock().expect("metrics lock").observe(elapsed);
    }

    /// One heartbeat handled by this member, from the request to the answer: recorded here
    /// (`on_leader`) or forwarded to the leader and answered.
    pub fn observe_heartbeat(&self, elapsed: Duration, on_leader: bool) {
        let histogram = if on_leader {
            &self.heartbeat_on_leader
        } else {
            &self.heartbeat_forwarded
        };
        histogram.lock().expect("metrics lock").observe(elapsed);
    }

    /// Counts one batch of heartbeats forwarded to the leader.
    pub fn count_heartbeat_batch(&self) {
        self.heartbeat_batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Renders every metric.
    pub fn render(&self, raft: &RaftFacts, shared: &Shared) -> String {
        let mut out = String::with_capacity(4096);
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        gauge(
            &mut out,
            "vgpu_raft_node_id",
            "This control-plane node's Raft id.",
            raft.id as f64,
        );
        gauge(
            &mut out,
            "vgpu_member_up",
            "1 while this member's Raft core runs; 0 once it stopped (a storage failure such as a full disk: the member exits, see /healthz and its log).",
            f64::from(u8::from(raft.storage_failure.is_none())),
        );
        gauge(
            &mut out,
            "vgpu_raft_term",
            "Current Raft term.",
            raft.term as f64,
        );
        gauge(
            &mut out,
            "vgpu_raft_leader_id",
            "Id of the current leader (0: none known).",
            raft.leader.unwrap_or(0) as f64,
        );
        let is_leader = f64::from(u8::from(raft.leader == Some(raft.id)));
        gauge(
            &mut out,
            "vgpu_raft_is_leader",
            "1 if this node is the leader.",
            is_leader,
        );
        gauge(
            &mut out,
            "vgpu_raft_last_log_index",
            "Index of the last log entry.",
            raft.last_log_index as f64,
        );
        gauge(
            &mut out,
            "vgpu_raft_last_applied_index",
            "Index of the last applied entry.",
            raft.last_applied as f64,
        );
        {
            let name = "vgpu_raft_commit_latency_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} Time from proposal to applied, for writes led by this node.\n# TYPE {name} histogram"
            );
            let histogram = self.commit.lock().expect("metrics lock");
            histogram.render(&mut out, name, "");
        }
        {
            let name = "vgpu_heartbeat_handling_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} Agent heartbeats as this member handled them, from request to answer; path=\"leader\": recorded here as the leader, path=\"forwarded\": forwarded to the leader.\n# TYPE {name} histogram"
            );
            let on_leader = self.heartbeat_on_leader.lock().expect("metrics lock");
            on_leader.render(&mut out, name, "path=\"leader\"");
            drop(on_leader);
            let forwarded = self.heartbeat_forwarded.lock().expect("metrics lock");
            forwarded.render(&mut out, name, "path=\"forwarded\"");
            drop(forwarded);
            let name = "vgpu_heartbeat_batches_forwarded_total";
            let _ = writeln!(
                out,
                "# HELP {name} Batches of agent heartbeats this member forwarded to the leader, one call each.\n# TYPE {name} counter\n{name} {}",
                self.heartbeat_batches
                    .load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        {
            use crate::store::log_store_counters as c;
            let relaxed = std::sync::atomic::Ordering::Relaxed;
            let counter = |out: &mut String, name: &str, help: &str, value: u64| {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
                );
            };
            counter(
                &mut out,
                "vgpu_raft_log_transactions_total",
                "fsync'd log transactions (group commit batches).",
                c::LOG_TRANSACTIONS.load(relaxed),
            );
            counter(
                &mut out,
                "vgpu_raft_log_append_calls_total",
                "append calls from openraft.",
                c::LOG_APPEND_CALLS.load(relaxed),
            );
            counter(
                &mut out,
                "vgpu_raft_log_entries_appended_total",
                "Entries appended to the log.",
                c::LOG_ENTRIES_APPENDED.load(relaxed),
            );
            counter(
                &mut out,
                "vgpu_connections_refused_total",
                "Connections closed at accept because their address already held the most connections one peer may (limits::CONNECTIONS_PER_PEER_MAX).",
                crate::limits::CONNECTIONS_REFUSED.load(relaxed),
            );
            counter(
                &mut out,
                "vgpu_anonymous_connections_closed_total",
                "Connections closed because no request on them showed a client certificate within limits::ANONYMOUS_CONNECTION_MAX (under mTLS).",
                crate::limits::ANONYMOUS_CONNECTIONS_CLOSED.load(relaxed),
            );
            counter(
                &mut out,
                "vgpu_anonymous_requests_refused_total",
                "Requests without a client certificate refused because their connection had limits::ANONYMOUS_REQUESTS_PER_CONNECTION_MAX in flight (under mTLS).",
                crate::limits::ANONYMOUS_REQUESTS_REFUSED.load(relaxed),
            );
        }
        let applied = shared.read();
        let pool = &applied.pool;
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        counter(
            &mut out,
            "vgpu_placements_total",
            "Tenants bound to slices (placements and re-placements).",
            pool.counters.placements,
        );
        counter(
            &mut out,
            "vgpu_preemptions_total",
            "Tenants preempted.",
            pool.counters.preemptions,
        );
        counter(
            &mut out,
            "vgpu_rejections_total",
            "Requests rejected as impossible.",
            pool.counters.rejections,
        );
        counter(
            &mut out,
            "vgpu_releases_total",
            "Tenants released.",
            pool.counters.releases,
        );
        let summary = pool.engine.summary();
        gauge(
            &mut out,
            "vgpu_tenants_placed",
            "Tenants holding slices.",
            summary.tenants_placed as f64,
        );
        gauge(
            &mut out,
            "vgpu_tenants_pending",
            "Tenants waiting for capacity (pending or preempted).",
            summary.tenants_pending as f64,
        );
        gauge(
            &mut out,
            "vgpu_pool_gpus",
            "GPUs registered in the pool.",
            summary.gpus_total as f64,
        );
        gauge(
            &mut out,
            "vgpu_pool_compute_allocated_percent",
            "Sum over GPUs of allocated compute (100 = one GPU).",
            summary.compute_allocated_percent as f64,
        );
        gauge(
            &mut out,
            "vgpu_pool_memory_bytes",
            "GPU memory registered in the pool.",
            summary.memory_total_bytes as f64,
        );
        gauge(
            &mut out,
            "vgpu_pool_memory_allocated_bytes",
            "GPU memory allocated to tenants.",
            summary.memory_allocated_bytes as f64,
        );
        let per_node = pool.engine.node_summaries();
        let families = [
            ("vgpu_node_gpus", "GPUs of a node."),
            (
                "vgpu_node_compute_allocated_percent",
                "Allocated compute on a node (100 = one GPU).",
            ),
            (
                "vgpu_node_memory_allocated_bytes",
                "GPU memory allocated on a node.",
            ),
        ];
        for (family, (name, help)) in families.iter().enumerate() {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (node, summary) in &per_node {
                let value = match family {
                    0 => summary.gpus_total,
                    1 => summary.compute_allocated_percent,
                    _ => summary.memory_allocated_bytes,
                };
                let _ = writeln!(out, "{name}{{node=\"{node}\"}} {value}");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_histograms_render_cumulative_buckets_per_path() {
        let metrics = Metrics::default();
        metrics.observe_heartbeat(Duration::from_micros(80), true);
        metrics.observe_heartbeat(Duration::from_millis(3), true);
        metrics.observe_heartbeat(Duration::from_millis(30), false);
        let mut out = String::new();
        metrics
            .heartbeat_on_leader
            .lock()
            .unwrap()
            .render(&mut out, "h", "path=\"leader\"");
        let line = |le: &str| {
            out.lines()
                .find(|line| line.starts_with(&format!("h_bucket{{path=\"leader\",le=\"{le}\"}} ")))
                .unwrap_or_else(|| panic!("no bucket {le} in {out}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_owned()
        };
        assert_eq!(line("0.00005"), "0");
        assert_eq!(line("0.0001"), "1");
        assert_eq!(line("0.005"), "2");
        assert_eq!(line("+Inf"), "2");
        assert!(out.contains("h_count{path=\"leader\"} 2"), "{out}");
        let forwarded = metrics.heartbeat_forwarded.lock().unwrap();
        // 30 ms: above the 25 ms bound, within the 50 ms one.
        assert_eq!(
            (forwarded.count, forwarded.counts[8], forwarded.counts[9]),
            (1, 0, 1)
        );
    }
}
