//! Prometheus metrics at `GET /metrics` on the API port, in the text exposition format.
//!
//! Gauges about the pool are computed from the applied state at scrape time (so they are never
//! stale or double-counted); the commit-latency histogram is recorded by the leader as writes
//! commit.

use crate::store::Shared;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the commit-latency buckets, in seconds.
const COMMIT_BUCKETS_SECONDS: [f64; 12] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; COMMIT_BUCKETS_SECONDS.len()],
    count: u64,
    sum_seconds: f64,
}

#[derive(Default)]
pub struct Metrics {
    commit: Mutex<Histogram>,
}

/// Raft facts for the scrape, read from openraft's metrics by the caller.
pub struct RaftFacts {
    pub id: u64,
    pub term: u64,
    pub leader: Option<u64>,
    pub last_log_index: u64,
    pub last_applied: u64,
}

impl Metrics {
    pub fn observe_commit(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let mut histogram = self.commit.lock().expect("metrics lock");
        for (bucket, bound) in COMMIT_BUCKETS_SECONDS.iter().enumerate() {
            if seconds <= *bound {
                histogram.counts[bucket] += 1;
            }
        }
        histogram.count += 1;
        histogram.sum_seconds += seconds;
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
            let histogram = self.commit.lock().expect("metrics lock");
            let name = "vgpu_raft_commit_latency_seconds";
            let _ = writeln!(
                out,
                "# HELP {name} Time from proposal to applied, for writes led by this node.\n# TYPE {name} histogram"
            );
            for (bucket, bound) in COMMIT_BUCKETS_SECONDS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}_bucket{{le=\"{bound}\"}} {}",
                    histogram.counts[bucket]
                );
            }
            let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", histogram.count);
            let _ = writeln!(
                out,
                "{name}_sum {}\n{name}_count {}",
                histogram.sum_seconds, histogram.count
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
