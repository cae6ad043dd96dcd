//! GPU health and per-tenant usage that agents send with their heartbeats: soft state, kept in
//! the leader's memory next to the heartbeat times and never written to the Raft log (it changes
//! every second and is rebuilt within one heartbeat interval after an election).
//!
//! * Agents send a report only when it changed, or as a refresh every 30 beats
//!   (`ReportKind` in the proto); other beats name the generation of the report they stand by.
//!   The leader records each node's latest full report ([`Reports::record`]), trimmed to
//!   `api::usage` bounds and stamped with the time it arrived, and keeps it on the beats without
//!   one ([`Reports::apply`]): an "unchanged" beat re-stamps it (its values are current), a "held
//!   back" beat (usage counters moved, sent at most every few seconds) leaves the stamp alone. A
//!   beat naming a generation the leader does not hold (a new leader after a failover holds
//!   none) is answered `report_wanted`, and the agent sends its full report on the next beat.
//! * A follower forwards heartbeats to the leader in batches (`crate::beats`); a leader too old
//!   to decode a batch gets each beat on its own (`ForwardRequest::HeartbeatReport`), and one
//!   too old for that a plain heartbeat, so a rolling upgrade never makes nodes look silent.
//! * Reads (`GetTenant`, `GetNode`, `ListNodes`) on a follower ask the leader for the reports
//!   they need over the internal `Forward` call, with a short timeout; if the leader cannot be
//!   reached they answer without usage (best effort, like the heartbeat times).
//! * `/metrics` shows the usage and health series on the leader only ([`render`]), so that a
//!   Prometheus scraping every member sees each series exactly once.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::ErrorCode;
use api::v1::{GpuHealth, HeartbeatRequest, ReportKind, TenantUsage};
use prost::Message;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::beats::{BeatAnswer, BeatOutcome};
use crate::control_plane::{ControlPlane, ForwardRequest, ForwardResponse, unix_ms};

/// How long a follower waits for the leader's reports before answering without them.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(1);

/// One node's latest report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeReport {
    /// When the leader received it, or a beat saying it is unchanged (unix ms).
    pub received_unix_ms: i64,
    /// The agent's number for this report (`HeartbeatRequest.report_generation`).
    pub generation: u64,
    pub gpus: Vec<GpuHealth>,
    pub usage: Vec<TenantUsage>,
}

/// Which reports a read needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Filter {
    All,
    /// Only the usage entries of this tenant (and no GPU health).
    Tenant(String),
    /// Only this node's report.
    Node(String),
    /// The reports of these nodes (the first [`NODES_FILTER_MAX`]), and, when `unhealthy`, the
    /// GPU health (no usage) of every node with a GPU that [`gpu_unhealthy`]: what one page of
    /// the dashboard needs, whatever the size of the pool. (New variants go last: the variant
    /// index is the wire tag.)
    Nodes {
        names: Vec<String>,
        unhealthy: bool,
    },
}

/// Nodes one [`Filter::Nodes`] names at most (the dashboard's pages name at most a few hundred).
pub const NODES_FILTER_MAX: usize = 1024;

/// Whether a GPU's health shows a problem: an XID, an uncorrected ECC error or throttling.
pub fn gpu_unhealthy(health: &GpuHealth) -> bool {
    health.xid_errors > 0
        || health.ecc_uncorrected.unwrap_or(0) > 0
        || !health.throttle_reasons.is_empty()
}

/// The leader's reports, by node.
#[derive(Debug, Default)]
pub struct Reports {
    nodes: Mutex<HashMap<String, NodeReport>>,
}

impl Reports {
    /// Takes the report part of a heartbeat received at `now_unix_ms`: records a full report,
    /// keeps the held one for the other kinds. Returns whether the leader now holds the report
    /// the beat refers to; `false` means "send a full report" (`report_wanted`).
    pub fn apply(&self, request: HeartbeatRequest, now_unix_ms: i64) -> bool {
        match ReportKind::try_from(request.report) {
            Ok(ReportKind::Full) => {
                self.record(request, now_unix_ms);
                true
            }
            Ok(ReportKind::Unchanged) => {
                self.keep(&request.node, request.report_generation, Some(now_unix_ms))
            }
            Ok(ReportKind::HeldBack) => self.keep(&request.node, request.report_generation, None),
            // A kind from a newer agent: whatever it means, a full report settles it.
            Err(_) => false,
        }
    }

    /// Keeps `node`'s report if it is the one of `generation` (re-stamped at `stamp_unix_ms`
    /// when given); `false` when the leader holds another or none.
    pub fn keep(&self, node: &str, generation: u64, stamp_unix_ms: Option<i64>) -> bool {
        let mut nodes = self.nodes.lock().expect("reports lock");
        match nodes.get_mut(node) {
            Some(report) if report.generation == generation => {
                if let Some(now) = stamp_unix_ms {
                    debug_assert!(now >= 0);
                    report.received_unix_ms = report.received_unix_ms.max(now);
                }
                true
            }
            _ => false,
        }
    }

    /// Keeps `request` as its node's latest report, received at `now_unix_ms`.
    pub fn record(&self, mut request: HeartbeatRequest, now_unix_ms: i64) {
        let trimmed = api::usage::bound_heartbeat(&mut request);
        if trimmed.any() {
            tracing::debug!(
                "node {}: report trimmed to its bounds: {trimmed:?}",
                request.node
            );
        }
        for gpu in &mut request.gpus {
            gpu.reported_unix_ms = now_unix_ms;
        }
        for usage in &mut request.usage {
            usage.reported_unix_ms = now_unix_ms;
            // The node is the one that reported, whatever the entry says.
            usage.node.clone_from(&request.node);
        }
        let report = NodeReport {
            received_unix_ms: now_unix_ms,
            generation: request.report_generation,
            gpus: request.gpus,
            usage: request.usage,
        };
        self.nodes
            .lock()
            .expect("reports lock")
            .insert(request.node, report);
    }

    /// Calls `visit` with every usage entry held and the time its report was last stamped,
    /// under the lock and without copying (the dashboard's usage history samples this way).
    pub fn visit_usage(&self, mut visit: impl FnMut(i64, &TenantUsage)) {
        let nodes = self.nodes.lock().expect("reports lock");
        for report in nodes.values() {
            for usage in &report.usage {
                visit(report.received_unix_ms, usage);
            }
        }
    }

    /// The reports `filter` asks for, by node; each entry stamped with its report's time.
    pub fn snapshot(&self, filter: &Filter) -> BTreeMap<String, NodeReport> {
        let nodes = self.nodes.lock().expect("reports lock");
        let mut taken: BTreeMap<String, NodeReport> = match filter {
            Filter::All => nodes
                .iter()
                .map(|(node, report)| (node.clone(), report.clone()))
                .collect(),
            Filter::Node(name) => nodes
                .get(name)
                .map(|report| (name.clone(), report.clone()))
                .into_iter()
                .collect(),
            Filter::Nodes { names, unhealthy } => {
                let mut taken: BTreeMap<String, NodeReport> = names
                    .iter()
                    .take(NODES_FILTER_MAX)
                    .filter_map(|name| Some((name.clone(), nodes.get(name)?.clone())))
                    .collect();
                if *unhealthy {
                    for (node, report) in nodes.iter() {
                        if !taken.contains_key(node) && report.gpus.iter().any(gpu_unhealthy) {
                            let health = NodeReport {
                                received_unix_ms: report.received_unix_ms,
                                generation: report.generation,
                                gpus: report.gpus.clone(),
                                usage: Vec::new(),
                            };
                            taken.insert(node.clone(), health);
                        }
                    }
                }
                taken
            }
            Filter::Tenant(tenant) => nodes
                .iter()
                .filter_map(|(node, report)| {
                    let usage: Vec<TenantUsage> = report
                        .usage
                        .iter()
                        .filter(|usage| &usage.tenant == tenant)
                        .cloned()
                        .collect();
                    (!usage.is_empty()).then(|| {
                        let report = NodeReport {
                            received_unix_ms: report.received_unix_ms,
                            generation: report.generation,
                            gpus: Vec::new(),
                            usage,
                        };
                        (node.clone(), report)
                    })
                })
                .collect(),
        };
        drop(nodes);
        // A report kept by "unchanged" beats is as current as the last of them.
        for report in taken.values_mut() {
            let stamp = report.received_unix_ms;
            report
                .gpus
                .iter_mut()
                .for_each(|g| g.reported_unix_ms = stamp);
            report
                .usage
                .iter_mut()
                .for_each(|u| u.reported_unix_ms = stamp);
        }
        taken
    }
}

/// Reports as they travel in a `Forward` answer: node, receive time, and the report as an
/// encoded `HeartbeatRequest` (prost messages are not serde).
pub type Encoded = Vec<(String, i64, Vec<u8>)>;

pub fn encode(reports: &BTreeMap<String, NodeReport>) -> Encoded {
    reports
        .iter()
        .map(|(node, report)| {
            let message = HeartbeatRequest {
                node: node.clone(),
                gpus: report.gpus.clone(),
                usage: report.usage.clone(),
                report_generation: report.generation,
                ..HeartbeatRequest::default()
            };
            (
                node.clone(),
                report.received_unix_ms,
                message.encode_to_vec(),
            )
        })
        .collect()
}

pub fn decode(encoded: Encoded) -> Result<BTreeMap<String, NodeReport>, prost::DecodeError> {
    encoded
        .into_iter()
        .map(|(node, received_unix_ms, bytes)| {
            let message = HeartbeatRequest::decode(bytes.as_slice())?;
            let report = NodeReport {
                received_unix_ms,
                generation: message.report_generation,
                gpus: message.gpus,
                usage: message.usage,
            };
            Ok((node, report))
        })
        .collect()
}

impl ControlPlane {
    /// Records a heartbeat with its report here (leader) or at the leader: a follower queues it
    /// for the next batch it forwards (`crate::beats`). Returns whether the node is known and
    /// whether the leader wants the node's full report; an unknown node's report is dropped.
    pub async fn heartbeat_report(
        self: &Arc<Self>,
        request: HeartbeatRequest,
    ) -> Result<BeatAnswer, Status> {
        if self.is_leader() {
            return Ok(self.record_heartbeat_report(request));
        }
        match self.queue_beat(request.encode_to_vec()).await {
            BeatOutcome::Answered(answer) => Ok(answer),
            BeatOutcome::Failed(status) => Err(status),
            BeatOutcome::Single => self.heartbeat_report_single(request).await,
        }
    }

    /// One heartbeat forwarded on its own: the path before batching, still taken when the
    /// leader cannot take a batch (an older version during a rolling upgrade).
    async fn heartbeat_report_single(
        &self,
        request: HeartbeatRequest,
    ) -> Result<BeatAnswer, Status> {
        let node = request.node.clone();
        let forwarded = ForwardRequest::HeartbeatReport(request.encode_to_vec());
        let mut request = Some(request);
        self.until_leader("a heartbeat", || {
            let local = self.is_leader().then(|| request.take()).flatten();
            let forwarded = &forwarded;
            let node = &node;
            async move {
                if let Some(request) = local {
                    return Ok(Some(self.record_heartbeat_report(request)));
                }
                let leader = self.leader_node();
                let answer = match self.forward_once(leader.clone(), forwarded).await {
                    Ok(answer) => answer,
                    // A leader of an older version cannot decode a report (during a rolling
                    // upgrade): beat without it rather than let the node be marked lost.
                    Err(status) => {
                        tracing::debug!(
                            "the leader refused the report of {node} ({}); plain heartbeat",
                            status.message()
                        );
                        let plain = ForwardRequest::Heartbeat { node: node.clone() };
                        self.forward_once(leader, &plain).await?
                    }
                };
                match answer {
                    Some(ForwardResponse::Heartbeat { known }) => Ok(Some(BeatAnswer {
                        known,
                        report_wanted: false,
                    })),
                    Some(other) => Err(ErrorCode::Internal
                        .status(format!("unexpected forward answer {other:?} for {node}"))),
                    None => Ok(None),
                }
            }
        })
        .await
    }

    /// Leader side of [`ControlPlane::heartbeat_report`].
    pub(crate) fn record_heartbeat_report(&self, request: HeartbeatRequest) -> BeatAnswer {
        let known = self.record_heartbeat(&request.node);
        if !known {
            return BeatAnswer {
                known: false,
                report_wanted: false,
            };
        }
        let held = self.reports.apply(request, unix_ms());
        BeatAnswer {
            known: true,
            report_wanted: !held,
        }
    }

    /// Leader side of a forwarded batch: one answer per beat, in order; a beat that does not
    /// decode gets its error and spoils none of the others.
    pub(crate) fn record_heartbeat_batch(
        &self,
        beats: &[Vec<u8>],
    ) -> Vec<Result<BeatAnswer, String>> {
        let answers: Vec<Result<BeatAnswer, String>> = beats
            .iter()
            .map(|bytes| match HeartbeatRequest::decode(bytes.as_slice()) {
                Ok(request) if api::names::validate("node", &request.node).is_ok() => {
                    Ok(self.record_heartbeat_report(request))
                }
                Ok(request) => Err(format!(
                    "a forwarded heartbeat names an invalid node {:?}",
                    request.node
                )),
                Err(error) => Err(format!("the forwarded heartbeat does not decode: {error}")),
            })
            .collect();
        assert_eq!(answers.len(), beats.len());
        answers
    }

    /// The leader's reports that `filter` asks for; empty when the leader cannot be reached
    /// within [`FORWARD_TIMEOUT`] (reads then show no usage rather than fail).
    pub async fn reports(&self, filter: Filter) -> BTreeMap<String, NodeReport> {
        if self.is_leader() {
            return self.reports.snapshot(&filter);
        }
        let request = ForwardRequest::Reports(filter);
        let attempt = self.forward_once(self.leader_node(), &request);
        match tokio::time::timeout(FORWARD_TIMEOUT, attempt).await {
            Ok(Ok(Some(ForwardResponse::Reports(encoded)))) => {
                decode(encoded).unwrap_or_else(|error| {
                    tracing::warn!("the leader's usage reports do not decode: {error}");
                    BTreeMap::new()
                })
            }
            _ => BTreeMap::new(),
        }
    }
}

/// Fills in each GPU's health from its node's report (matched by uuid).
pub fn attach_health(node: &mut api::v1::Node, report: Option<&NodeReport>) {
    let Some(report) = report else {
        return;
    };
    for gpu in &mut node.gpus {
        gpu.health = report.gpus.iter().find(|h| h.uuid == gpu.uuid).cloned();
    }
}

/// Label values are escaped as the text format wants (`\`, `"` and newlines).
fn label(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// Appends the usage and health families (leader only; see the module docs). `known` says
/// whether a node is still registered: removed nodes' last reports are not shown.
pub fn render(
    out: &mut String,
    reports: &BTreeMap<String, NodeReport>,
    known: impl Fn(&str) -> bool,
) {
    let reports: Vec<(&String, &NodeReport)> =
        reports.iter().filter(|(node, _)| known(node)).collect();
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let usage = || {
        reports
            .iter()
            .flat_map(|(node, report)| report.usage.iter().map(move |usage| (node.as_str(), usage)))
    };
    let tenant_labels = |node: &str, usage: &TenantUsage| {
        format!(
            "tenant=\"{}\",node=\"{}\",gpu=\"{}\"",
            label(&usage.tenant),
            label(node),
            label(&usage.gpu)
        )
    };
    family(
        out,
        "vgpu_tenant_memory_bytes",
        "gauge",
        "GPU memory held by a tenant's live processes on a GPU (the interposer's ledger).",
    );
    for (node, usage) in usage() {
        let _ = writeln!(
            out,
            "vgpu_tenant_memory_bytes{{{}}} {}",
            tenant_labels(node, usage),
            usage.memory_used_bytes
        );
    }
    family(
        out,
        "vgpu_tenant_memory_limit_bytes",
        "gauge",
        "The memory limit the interposer enforces for a tenant on a GPU (0: none).",
    );
    for (node, usage) in usage() {
        let _ = writeln!(
            out,
            "vgpu_tenant_memory_limit_bytes{{{}}} {}",
            tenant_labels(node, usage),
            usage.memory_limit_bytes
        );
    }
    // Elastic memory (issue 17), from the GPU's memory board where the node keeps one: only
    // entries with board figures, so nodes without boards add no series.
    type Family = (&'static str, &'static str, fn(&TenantUsage) -> u64);
    let elastic: [Family; 6] = [
        (
            "vgpu_tenant_memory_request_bytes",
            "A tenant's memory request on a GPU (booked by placement), from the GPU's memory board.",
            |u| u.memory_request_bytes,
        ),
        (
            "vgpu_tenant_memory_board_limit_bytes",
            "What a tenant may hold on a GPU, resident and swapped (its memory limit), from the GPU's memory board.",
            |u| u.memory_board_limit_bytes,
        ),
        (
            "vgpu_tenant_memory_resident_bytes",
            "GPU memory a tenant's processes hold resident on a GPU, from the GPU's memory board.",
            |u| u.memory_resident_bytes,
        ),
        (
            "vgpu_tenant_memory_borrowed_bytes",
            "What a tenant holds resident above its request on a GPU (borrowed), from the GPU's memory board.",
            |u| u.memory_borrowed_bytes,
        ),
        (
            "vgpu_tenant_memory_swapped_bytes",
            "A tenant's GPU memory swapped out to host memory, from the GPU's memory board.",
            |u| u.memory_swapped_bytes,
        ),
        (
            "vgpu_tenant_memory_staging_bytes",
            "Pinned host memory a tenant's swapped-out GPU memory holds, against the node's swap_host_memory, from the GPU's memory board.",
            |u| u.memory_staging_bytes,
        ),
    ];
    // The reclaim history: counters since the tenant came to the GPU.
    let reclaims: [Family; 2] = [
        (
            "vgpu_tenant_memory_reclaims_total",
            "Times a tenant's processes moved borrowed GPU memory to host memory for other tenants' requests, from the GPU's memory board.",
            |u| u.memory_reclaims,
        ),
        (
            "vgpu_tenant_memory_reclaimed_bytes_total",
            "Borrowed GPU memory a tenant's processes moved to host memory for other tenants' requests, from the GPU's memory board.",
            |u| u.memory_reclaimed_bytes,
        ),
    ];
    // The line: who waits for GPU memory now, and for how long.
    let line: [Family; 2] = [
        (
            "vgpu_tenant_memory_waiting_processes",
            "A tenant's processes waiting in the GPU's line for memory (their swapped-out memory to come back, or room to borrow), from the GPU's memory board.",
            |u| u64::from(u.memory_waiting_processes),
        ),
        (
            "vgpu_tenant_memory_longest_wait_seconds",
            "How long the longest waiting of a tenant's processes has waited in the GPU's line for memory (0: none waits), from the GPU's memory board.",
            |u| u.memory_longest_wait_ms / 1000,
        ),
    ];
    let families = elastic
        .iter()
        .chain(line.iter())
        .map(|family| (family, "gauge"))
        .chain(reclaims.iter().map(|family| (family, "counter")));
    for ((name, help, value), kind) in families {
        family(out, name, kind, help);
        for (node, usage) in usage().filter(|(_, u)| u.memory_board_limit_bytes > 0) {
            let _ = writeln!(
                out,
                "{name}{{{}}} {}",
                tenant_labels(node, usage),
                value(usage)
            );
        }
    }
    family(
        out,
        "vgpu_tenant_gpu_time_seconds_total",
        "counter",
        "Turn time charged to a tenant by a GPU's compute schedule.",
    );
    for (node, usage) in usage() {
        let _ = writeln!(
            out,
            "vgpu_tenant_gpu_time_seconds_total{{{}}} {}",
            tenant_labels(node, usage),
            usage.gpu_time_ns as f64 / 1e9
        );
    }
    family(
        out,
        "vgpu_tenant_processes",
        "gauge",
        "Live processes of a tenant on a GPU.",
    );
    for (node, usage) in usage() {
        let _ = writeln!(
            out,
            "vgpu_tenant_processes{{{}}} {}",
            tenant_labels(node, usage),
            usage.process_count
        );
    }
    render_latency(out, &mut usage().filter(|(_, usage)| has_latency(usage)));
    render_redistribution(
        out,
        &mut usage().filter(|(_, usage)| usage.sm_cap_permille > 0),
    );
    let gpus = || {
        reports
            .iter()
            .flat_map(|(node, report)| report.gpus.iter().map(move |gpu| (node.as_str(), gpu)))
    };
    let gpu_labels = |node: &str, gpu: &GpuHealth| {
        format!("node=\"{}\",gpu=\"{}\"", label(node), label(&gpu.uuid))
    };
    let supports = |gpu: &GpuHealth, query: &str| !gpu.unsupported.iter().any(|q| q == query);
    family(
        out,
        "vgpu_gpu_xid_errors_total",
        "counter",
        "XID errors (NVML critical XID events) since the node's agent started.",
    );
    for (node, gpu) in gpus().filter(|(_, gpu)| supports(gpu, "xid")) {
        let _ = writeln!(
            out,
            "vgpu_gpu_xid_errors_total{{{}}} {}",
            gpu_labels(node, gpu),
            gpu.xid_errors
        );
    }
    family(
        out,
        "vgpu_gpu_last_xid",
        "gauge",
        "The most recent XID code (0: none).",
    );
    for (node, gpu) in gpus().filter(|(_, gpu)| supports(gpu, "xid")) {
        let _ = writeln!(
            out,
            "vgpu_gpu_last_xid{{{}}} {}",
            gpu_labels(node, gpu),
            gpu.last_xid
        );
    }
    family(
        out,
        "vgpu_gpu_ecc_errors_total",
        "counter",
        "Volatile ECC errors since the driver loaded, by kind (corrected, uncorrected).",
    );
    for (node, gpu) in gpus() {
        for (kind, count) in [
            ("corrected", gpu.ecc_corrected),
            ("uncorrected", gpu.ecc_uncorrected),
        ] {
            if let Some(count) = count {
                let _ = writeln!(
                    out,
                    "vgpu_gpu_ecc_errors_total{{{},kind=\"{kind}\"}} {count}",
                    gpu_labels(node, gpu)
                );
            }
        }
    }
    family(
        out,
        "vgpu_gpu_throttled",
        "gauge",
        "1 for each clock throttle reason active on a GPU now.",
    );
    for (node, gpu) in gpus() {
        for reason in &gpu.throttle_reasons {
            let _ = writeln!(
                out,
                "vgpu_gpu_throttled{{{},reason=\"{}\"}} 1",
                gpu_labels(node, gpu),
                label(reason)
            );
        }
    }
    type Gauge = fn(&GpuHealth) -> Option<f64>;
    let optional_gauges: [(&str, &str, Gauge); 3] = [
        (
            "vgpu_gpu_temperature_celsius",
            "GPU die temperature.",
            |gpu| gpu.temperature_celsius.map(f64::from),
        ),
        (
            "vgpu_gpu_utilization_percent",
            "GPU utilisation over the driver's last sample period.",
            |gpu| gpu.utilization_percent.map(f64::from),
        ),
        (
            "vgpu_gpu_memory_used_bytes",
            "Device memory in use on a GPU, all processes.",
            |gpu| gpu.memory_used_bytes.map(|bytes| bytes as f64),
        ),
    ];
    for (name, help, value) in optional_gauges {
        family(out, name, "gauge", help);
        for (node, gpu) in gpus() {
            if let Some(value) = value(gpu) {
                let _ = writeln!(out, "{name}{{{}}} {value}", gpu_labels(node, gpu));
            }
        }
    }
    family(
        out,
        "vgpu_node_report_age_seconds",
        "gauge",
        "Seconds since the leader received a node's health and usage report.",
    );
    let now = unix_ms();
    for (node, report) in &reports {
        let age = (now - report.received_unix_ms).max(0) as f64 / 1000.0;
        let _ = writeln!(
            out,
            "vgpu_node_report_age_seconds{{node=\"{}\"}} {age}",
            label(node)
        );
    }
}

/// Whether a usage entry carries a latency tenant's target or measurements (the agent puts
/// them on the tenant's first entry of the node only).
fn has_latency(usage: &TenantUsage) -> bool {
    usage.latency_target_us > 0 || usage.latency_steps > 0 || usage.latency_p99_us > 0
}

/// The latency families, for the entries of `usage` that have latency numbers: the target, the
/// p50 and p99 of the node's controller (absent until measured), and the violations counter.
fn render_latency<'a>(
    out: &mut String,
    usage: &mut dyn Iterator<Item = (&'a str, &'a TenantUsage)>,
) {
    let entries: Vec<(&str, &TenantUsage)> = usage.collect();
    let seconds = |microseconds: u64| microseconds as f64 / 1e6;
    type Value = fn(&TenantUsage) -> Option<u64>;
    let families: [(&str, &str, &str, Value); 4] = [
        (
            "vgpu_tenant_latency_target_seconds",
            "gauge",
            "The step latency a latency tenant is held to (its request's target, or the one its node derived from its latency alone).",
            |usage| (usage.latency_target_us > 0).then_some(usage.latency_target_us),
        ),
        (
            "vgpu_tenant_latency_p50_seconds",
            "gauge",
            "A latency tenant's median step latency over its node controller's recent window.",
            |usage| (usage.latency_steps > 0).then_some(usage.latency_p50_us),
        ),
        (
            "vgpu_tenant_latency_p99_seconds",
            "gauge",
            "A latency tenant's p99 step latency over its node controller's recent window.",
            |usage| (usage.latency_steps > 0).then_some(usage.latency_p99_us),
        ),
        (
            "vgpu_tenant_latency_violations_total",
            "counter",
            "Steps of a latency tenant slower than its target, since its node's agent started.",
            |usage| (usage.latency_steps > 0).then_some(usage.latency_violations),
        ),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (node, usage) in &entries {
            let Some(value) = value(usage) else { continue };
            let labels = format!(
                "tenant=\"{}\",node=\"{}\",gpu=\"{}\"",
                label(&usage.tenant),
                label(node),
                label(&usage.gpu)
            );
            let value = if kind == "counter" {
                value.to_string()
            } else {
                seconds(value).to_string()
            };
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// The SM redistribution's families (issue 15 point 4), for the entries of `usage` whose tenant
/// an MPS node's redistribution follows (the agent puts the numbers on the tenant's first entry
/// of the node): the share of the SMs its cap leaves it (1: uncapped), and its progress rate
/// when measured, labelled with its unit (`units`: the application's own, through
/// `vgpu_progress`; `steps`: kernel steps).
fn render_redistribution<'a>(
    out: &mut String,
    usage: &mut dyn Iterator<Item = (&'a str, &'a TenantUsage)>,
) {
    let entries: Vec<(&str, &TenantUsage)> = usage.collect();
    debug_assert!(entries.iter().all(|(_, usage)| usage.sm_cap_permille > 0));
    let labels = |node: &str, usage: &TenantUsage| {
        format!(
            "tenant=\"{}\",node=\"{}\",gpu=\"{}\"",
            label(&usage.tenant),
            label(node),
            label(&usage.gpu)
        )
    };
    let name = "vgpu_tenant_sm_cap_ratio";
    let _ = writeln!(
        out,
        "# HELP {name} The share of a GPU's SMs a best-effort MPS tenant's cap leaves it under its node's SM redistribution (1: uncapped); only tenants the redistribution follows.\n# TYPE {name} gauge"
    );
    for (node, usage) in &entries {
        let ratio = f64::from(usage.sm_cap_permille.min(api::usage::SM_CAP_PERMILLE_FULL))
            / f64::from(api::usage::SM_CAP_PERMILLE_FULL);
        debug_assert!(ratio > 0.0 && ratio <= 1.0);
        let _ = writeln!(out, "{name}{{{}}} {ratio}", labels(node, usage));
    }
    let name = "vgpu_tenant_side_by_side";
    let _ = writeln!(
        out,
        "# HELP {name} 1 when a best-effort MPS tenant's group shares its GPU side by side (its node's SM redistribution found more work without turns between them), 0 when by turns; only tenants the redistribution follows.\n# TYPE {name} gauge"
    );
    for (node, usage) in &entries {
        let sided = u8::from(usage.redistribution_side_by_side);
        let _ = writeln!(out, "{name}{{{}}} {sided}", labels(node, usage));
    }
    // The two progress rates, each only where known, in the unit the tenant counts in.
    type Rate = fn(&TenantUsage) -> f64;
    let rates: [(&str, &str, Rate); 2] = [
        (
            "vgpu_tenant_progress_per_second",
            "A best-effort MPS tenant's progress per second in its node's SM redistribution's last period at the kept caps, in the application's own units (unit=\"units\", through vgpu_progress) or in steps (unit=\"steps\"); only when measured.",
            |usage| usage.progress_per_s,
        ),
        (
            "vgpu_tenant_progress_alone_per_second",
            "A best-effort MPS tenant's progress per second alone, as its node's SM redistribution last probed it (the others at their floors for one period), in the unit of vgpu_tenant_progress_per_second; only when probed.",
            |usage| usage.progress_alone_per_s,
        ),
    ];
    for (name, help, rate) in rates {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        let known = entries
            .iter()
            .filter(|(_, usage)| rate(usage).is_finite() && rate(usage) > 0.0);
        for (node, usage) in known {
            let unit = if usage.progress_hinted {
                "units"
            } else {
                "steps"
            };
            let _ = writeln!(
                out,
                "{name}{{{},unit=\"{unit}\"}} {}",
                labels(node, usage),
                rate(usage)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(tenant: &str, gpu: &str, memory: u64, time_ns: u64) -> TenantUsage {
        TenantUsage {
            tenant: tenant.into(),
            node: "spoofed".into(),
            gpu: gpu.into(),
            memory_used_bytes: memory,
            memory_limit_bytes: 10 << 30,
            gpu_time_ns: time_ns,
            process_count: 1,
            ..TenantUsage::default()
        }
    }

    fn sample_reports() -> Reports {
        let reports = Reports::default();
        let mut gpu = api::usage::empty_health("GPU-a0", 0);
        gpu.xid_errors = 2;
        gpu.last_xid = 79;
        gpu.ecc_corrected = Some(5);
        gpu.ecc_uncorrected = Some(1);
        gpu.throttle_reasons = vec!["hw_slowdown".into()];
        gpu.temperature_celsius = Some(61);
        let mut unsupported = api::usage::empty_health("GPU-a1", 1);
        unsupported.unsupported = vec!["xid".into(), "ecc".into()];
        reports.record(
            HeartbeatRequest {
                node: "node-a".into(),
                gpus: vec![gpu, unsupported],
                usage: vec![
                    usage("train", "GPU-a0", 3 << 30, 2_500_000_000),
                    usage("infer", "GPU-a1", 1 << 30, 0),
                ],
                report_generation: 7,
                ..HeartbeatRequest::default()
            },
            1_000,
        );
        reports.record(
            HeartbeatRequest {
                node: "node-b".into(),
                gpus: vec![],
                usage: vec![usage("train", "GPU-b0", 7, 1)],
                ..HeartbeatRequest::default()
            },
            2_000,
        );
        reports
    }

    fn beat(node: &str, kind: ReportKind, generation: u64) -> HeartbeatRequest {
        HeartbeatRequest {
            node: node.into(),
            report: kind as i32,
            report_generation: generation,
            ..HeartbeatRequest::default()
        }
    }

    #[test]
    fn beats_without_a_report_keep_the_held_one_or_ask_for_it() {
        let reports = sample_reports();
        let memory = |reports: &Reports| {
            reports.snapshot(&Filter::Node("node-a".into()))["node-a"].usage[0].memory_used_bytes
        };
        // "Unchanged" with the held generation: kept, and stamped as current now.
        assert!(reports.apply(beat("node-a", ReportKind::Unchanged, 7), 5_000));
        let held = reports.snapshot(&Filter::Node("node-a".into()));
        assert_eq!(held["node-a"].received_unix_ms, 5_000);
        assert_eq!(held["node-a"].usage[0].reported_unix_ms, 5_000);
        assert_eq!(held["node-a"].gpus[0].reported_unix_ms, 5_000);
        assert_eq!(memory(&reports), 3 << 30, "the empty beat replaced nothing");
        // "Held back": kept, but the stamp stays (the values are not current).
        assert!(reports.apply(beat("node-a", ReportKind::HeldBack, 7), 6_000));
        assert_eq!(
            reports.snapshot(&Filter::Node("node-a".into()))["node-a"].received_unix_ms,
            5_000
        );
        // Another generation (a report this leader never got), or a node without a report (a
        // new leader has none): the agent must send it.
        assert!(!reports.apply(beat("node-a", ReportKind::Unchanged, 6), 7_000));
        assert!(!reports.apply(beat("node-c", ReportKind::Unchanged, 1), 7_000));
        assert!(!reports.apply(
            HeartbeatRequest {
                report: 99,
                ..beat("node-a", ReportKind::Full, 8)
            },
            7_000
        ));
        assert_eq!(memory(&reports), 3 << 30);
        // A full report replaces the held one, with its generation.
        assert!(reports.apply(beat("node-a", ReportKind::Full, 8), 8_000));
        assert!(
            reports.snapshot(&Filter::Node("node-a".into()))["node-a"]
                .usage
                .is_empty()
        );
        assert!(reports.apply(beat("node-a", ReportKind::Unchanged, 8), 9_000));
    }

    #[test]
    fn reports_are_stamped_and_filtered_by_tenant_or_node() {
        let reports = sample_reports();
        let all = reports.snapshot(&Filter::All);
        assert_eq!(all.len(), 2);
        assert_eq!(all["node-a"].received_unix_ms, 1_000);
        assert_eq!(all["node-a"].gpus[0].reported_unix_ms, 1_000);
        assert_eq!(
            all["node-a"].usage[0].node, "node-a",
            "the reporter names the node"
        );
        assert_eq!(all["node-a"].usage[0].reported_unix_ms, 1_000);

        let train = reports.snapshot(&Filter::Tenant("train".into()));
        let entries: Vec<(&str, &str)> = train
            .iter()
            .flat_map(|(node, r)| r.usage.iter().map(move |u| (node.as_str(), u.gpu.as_str())))
            .collect();
        assert_eq!(entries, [("node-a", "GPU-a0"), ("node-b", "GPU-b0")]);
        assert!(train.values().all(|r| r.gpus.is_empty()));
        assert!(
            reports
                .snapshot(&Filter::Tenant("nobody".into()))
                .is_empty()
        );
        let node_b = reports.snapshot(&Filter::Node("node-b".into()));
        assert_eq!(node_b.keys().collect::<Vec<_>>(), ["node-b"]);

        // A newer report replaces the node's previous one.
        reports.record(
            HeartbeatRequest {
                node: "node-b".into(),
                ..HeartbeatRequest::default()
            },
            3_000,
        );
        assert!(
            reports.snapshot(&Filter::Node("node-b".into()))["node-b"]
                .usage
                .is_empty()
        );
    }

    #[test]
    fn reports_survive_the_forwarding_encoding() {
        let all = sample_reports().snapshot(&Filter::All);
        assert_eq!(decode(encode(&all)).unwrap(), all);
        assert!(decode(vec![("x".into(), 0, vec![0xff, 0xff])]).is_err());
    }

    #[test]
    fn metrics_show_usage_and_health_of_known_nodes() {
        let all = sample_reports().snapshot(&Filter::All);
        let mut out = String::new();
        render(&mut out, &all, |node| node == "node-a");
        for line in [
            "vgpu_tenant_memory_bytes{tenant=\"train\",node=\"node-a\",gpu=\"GPU-a0\"} 3221225472",
            "vgpu_tenant_gpu_time_seconds_total{tenant=\"train\",node=\"node-a\",gpu=\"GPU-a0\"} 2.5",
            "vgpu_tenant_memory_limit_bytes{tenant=\"infer\",node=\"node-a\",gpu=\"GPU-a1\"} 10737418240",
            "vgpu_gpu_xid_errors_total{node=\"node-a\",gpu=\"GPU-a0\"} 2",
            "vgpu_gpu_last_xid{node=\"node-a\",gpu=\"GPU-a0\"} 79",
            "vgpu_gpu_ecc_errors_total{node=\"node-a\",gpu=\"GPU-a0\",kind=\"uncorrected\"} 1",
            "vgpu_gpu_ecc_errors_total{node=\"node-a\",gpu=\"GPU-a0\",kind=\"corrected\"} 5",
            "vgpu_gpu_throttled{node=\"node-a\",gpu=\"GPU-a0\",reason=\"hw_slowdown\"} 1",
            "vgpu_gpu_temperature_celsius{node=\"node-a\",gpu=\"GPU-a0\"} 61",
            "# TYPE vgpu_tenant_gpu_time_seconds_total counter",
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "missing `{line}` in:\n{out}"
            );
        }
        // Unsupported queries have no series; a removed node has none at all.
        assert!(
            !out.contains("gpu=\"GPU-a1\"} 0\nvgpu_gpu_last_xid"),
            "{out}"
        );
        assert!(!out.contains("vgpu_gpu_xid_errors_total{node=\"node-a\",gpu=\"GPU-a1\"}"));
        assert!(!out.contains("GPU-a1\",kind="), "{out}");
        assert!(!out.contains("node-b"), "{out}");
    }

    /// Issue 17: entries with board figures have the elastic memory gauges; others have none.
    #[test]
    fn metrics_show_elastic_memory_from_the_boards() {
        let reports = Reports::default();
        let elastic = TenantUsage {
            tenant: "elastic".into(),
            node: "node-a".into(),
            gpu: "GPU-a0".into(),
            memory_request_bytes: 20 << 30,
            memory_board_limit_bytes: 60 << 30,
            memory_resident_bytes: 26 << 30,
            memory_borrowed_bytes: 6 << 30,
            memory_swapped_bytes: 2 << 30,
            memory_staging_bytes: 2 << 30,
            memory_reclaims: 3,
            memory_reclaimed_bytes: 7 << 30,
            memory_waiting_processes: 2,
            memory_longest_wait_ms: 95_400,
            ..TenantUsage::default()
        };
        let plain = TenantUsage {
            tenant: "plain".into(),
            node: "node-a".into(),
            gpu: "GPU-a0".into(),
            ..TenantUsage::default()
        };
        reports.record(
            HeartbeatRequest {
                node: "node-a".into(),
                usage: vec![elastic, plain],
                ..HeartbeatRequest::default()
            },
            1_000,
        );
        let mut out = String::new();
        render(&mut out, &reports.snapshot(&Filter::All), |_| true);
        let labels = "tenant=\"elastic\",node=\"node-a\",gpu=\"GPU-a0\"";
        for (name, value) in [
            ("vgpu_tenant_memory_request_bytes", 20u64 << 30),
            ("vgpu_tenant_memory_board_limit_bytes", 60 << 30),
            ("vgpu_tenant_memory_resident_bytes", 26 << 30),
            ("vgpu_tenant_memory_borrowed_bytes", 6 << 30),
            ("vgpu_tenant_memory_swapped_bytes", 2 << 30),
            ("vgpu_tenant_memory_staging_bytes", 2 << 30),
            ("vgpu_tenant_memory_reclaims_total", 3),
            ("vgpu_tenant_memory_reclaimed_bytes_total", 7 << 30),
            ("vgpu_tenant_memory_waiting_processes", 2),
            ("vgpu_tenant_memory_longest_wait_seconds", 95),
        ] {
            let line = format!("{name}{{{labels}}} {value}\n");
            assert!(out.contains(&line), "missing `{line}` in:\n{out}");
        }
        assert!(
            !out.contains("vgpu_tenant_memory_request_bytes{tenant=\"plain\""),
            "{out}"
        );
    }

    #[test]
    fn metrics_show_latency_targets_and_what_latency_tenants_achieved() {
        let reports = Reports::default();
        let measured = TenantUsage {
            latency_target_us: 2_000,
            latency_baseline_us: 1_400,
            latency_p50_us: 900,
            latency_p99_us: 1_800,
            latency_steps: 12_000,
            latency_violations: 7,
            ..usage("chat", "GPU-a0", 1 << 30, 0)
        };
        let not_yet = TenantUsage {
            latency_target_us: 500,
            ..usage("voice", "GPU-a0", 0, 0)
        };
        reports.record(
            HeartbeatRequest {
                node: "node-a".into(),
                usage: vec![measured, not_yet, usage("train", "GPU-a1", 1, 1)],
                ..HeartbeatRequest::default()
            },
            1_000,
        );
        let mut out = String::new();
        render(&mut out, &reports.snapshot(&Filter::All), |_| true);
        let chat = "tenant=\"chat\",node=\"node-a\",gpu=\"GPU-a0\"";
        let voice = "tenant=\"voice\",node=\"node-a\",gpu=\"GPU-a0\"";
        for line in [
            format!("vgpu_tenant_latency_target_seconds{{{chat}}} 0.002"),
            format!("vgpu_tenant_latency_p50_seconds{{{chat}}} 0.0009"),
            format!("vgpu_tenant_latency_p99_seconds{{{chat}}} 0.0018"),
            format!("vgpu_tenant_latency_violations_total{{{chat}}} 7"),
            format!("vgpu_tenant_latency_target_seconds{{{voice}}} 0.0005"),
            "# TYPE vgpu_tenant_latency_violations_total counter".to_owned(),
            "# TYPE vgpu_tenant_latency_p99_seconds gauge".to_owned(),
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "missing `{line}` in:\n{out}"
            );
        }
        // Nothing measured yet: a target, but no percentiles; other tenants: no latency series.
        assert!(
            !out.contains(&format!("vgpu_tenant_latency_p99_seconds{{{voice}}}")),
            "{out}"
        );
        assert!(
            !out.contains("latency_target_seconds{tenant=\"train\""),
            "{out}"
        );
    }

    #[test]
    fn metrics_show_the_sm_redistributions_caps_and_progress() {
        let reports = Reports::default();
        let capped = TenantUsage {
            sm_cap_permille: 625,
            progress_per_s: 12.25,
            progress_hinted: true,
            progress_alone_per_s: 30.5,
            redistribution_side_by_side: true,
            ..usage("sweep", "GPU-a0", 1 << 30, 0)
        };
        let uncapped = TenantUsage {
            sm_cap_permille: 1_000,
            progress_per_s: 310.0,
            ..usage("batch", "GPU-a0", 1 << 30, 0)
        };
        let not_measured = TenantUsage {
            sm_cap_permille: 1_000,
            ..usage("fresh", "GPU-a0", 1 << 30, 0)
        };
        reports.record(
            HeartbeatRequest {
                node: "node-a".into(),
                usage: vec![
                    capped,
                    uncapped,
                    not_measured,
                    usage("train", "GPU-a1", 1, 1),
                ],
                ..HeartbeatRequest::default()
            },
            1_000,
        );
        let mut out = String::new();
        render(&mut out, &reports.snapshot(&Filter::All), |_| true);
        let labels = |tenant: &str| format!("tenant=\"{tenant}\",node=\"node-a\",gpu=\"GPU-a0\"");
        for line in [
            format!("vgpu_tenant_sm_cap_ratio{{{}}} 0.625", labels("sweep")),
            format!("vgpu_tenant_sm_cap_ratio{{{}}} 1", labels("batch")),
            format!("vgpu_tenant_sm_cap_ratio{{{}}} 1", labels("fresh")),
            format!(
                "vgpu_tenant_progress_per_second{{{},unit=\"units\"}} 12.25",
                labels("sweep")
            ),
            format!(
                "vgpu_tenant_progress_per_second{{{},unit=\"steps\"}} 310",
                labels("batch")
            ),
            format!(
                "vgpu_tenant_progress_alone_per_second{{{},unit=\"units\"}} 30.5",
                labels("sweep")
            ),
            format!("vgpu_tenant_side_by_side{{{}}} 1", labels("sweep")),
            format!("vgpu_tenant_side_by_side{{{}}} 0", labels("batch")),
            "# TYPE vgpu_tenant_sm_cap_ratio gauge".to_owned(),
            "# TYPE vgpu_tenant_side_by_side gauge".to_owned(),
            "# TYPE vgpu_tenant_progress_per_second gauge".to_owned(),
            "# TYPE vgpu_tenant_progress_alone_per_second gauge".to_owned(),
        ] {
            assert!(
                out.contains(&format!("{line}\n")),
                "missing `{line}` in:\n{out}"
            );
        }
        // Not measured yet: a cap, no rate; not followed: neither.
        assert!(
            !out.contains("vgpu_tenant_progress_per_second{tenant=\"fresh\""),
            "{out}"
        );
        // Probed alone: only "sweep".
        assert_eq!(
            out.matches("vgpu_tenant_progress_alone_per_second{")
                .count(),
            1,
            "{out}"
        );
        for name in [
            "vgpu_tenant_sm_cap_ratio",
            "vgpu_tenant_side_by_side",
            "vgpu_tenant_progress_per_second",
            "vgpu_tenant_progress_alone_per_second",
        ] {
            assert!(!out.contains(&format!("{name}{{tenant=\"train\"")), "{out}");
        }
        assert_eq!(
            out.matches("# HELP vgpu_tenant_sm_cap_ratio ").count(),
            1,
            "{out}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
