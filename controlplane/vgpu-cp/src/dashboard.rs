//! The pool dashboard (issue 21): a JSON read API under `/ui/api/` and a small single-page
//! dashboard at `/ui/` (HTML, CSS and JavaScript embedded from `dashboard/`, no build step),
//! served by every member on the API listener.
//!
//! * Authentication is the API's: under mTLS the caller's client certificate decides, with the
//!   same role rules as the gRPC reads (`crate::security::Guard`): the pool view is for admins
//!   (like `ListNodes`), the tenants view shows admins every tenant and `tenant:OWNER` its own
//!   (like `ListTenants`), the cluster view is for any authenticated caller (like
//!   `Cluster.Status`), its agents' heartbeats for admins only. Under `--insecure` all is open.
//!   The page itself (`/ui/`, its script and style) holds no data and is served to anyone.
//!   One tenant's view (`/ui/api/tenant?name=`) follows `GetTenant`: 403 for another owner's.
//! * Reads are stale reads of this member's applied state (a dashboard does not need
//!   linearizability), plus the leader's soft state: heartbeat times, and only the health and
//!   usage reports the page shows (its nodes', its tenants' nodes', and the health of nodes
//!   with an unhealthy GPU for the overview's count: `usage::Filter::Nodes`), never every
//!   node's. Each is fetched at most once per [`SOFT_STATE_MAX_AGE`] per member and page
//!   however many browsers poll it, and is empty when the leader cannot be reached (as
//!   `ListNodes` does).
//! * Every answer is bounded: pages of at most [`POOL_PAGE_NODES_MAX`] nodes or
//!   [`TENANTS_PAGE_MAX`] tenants, in name order with a `next_page_token`, plus whole-pool
//!   aggregates computed on the fly; never the whole pool at once.
//! * The JSON is built by pure functions ([`pool_page`], [`tenants_page`], [`tenant_page`],
//!   [`cluster_view`]) from the applied `PoolState` and [`SoftState`], tested without sockets.
//! * Two bounded memories ([`history`]): the leader samples each tenant's usage (one hour, for
//!   the tenant's plot; followers ask the leader for it), and every member keeps the last
//!   changes of term and leader it saw (the cluster view's elections).

pub mod history;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use api::tls::Role;
use api::v1::{GpuHealth, TenantUsage};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::control_plane::{ControlPlane, ForwardRequest, ForwardResponse, unix_ms};
use crate::pool::{PoolState, TenantState, decode_request};
use crate::security::{Guard, TenantScope};
use crate::usage::{Filter, NodeReport};

/// Nodes in one pool page unless the caller asks for fewer (`limit`), and the most it may ask.
pub const POOL_PAGE_NODES_DEFAULT: usize = 50;
pub const POOL_PAGE_NODES_MAX: usize = 200;
/// Tenants in one tenants page by default, and the most.
pub const TENANTS_PAGE_DEFAULT: usize = 100;
pub const TENANTS_PAGE_MAX: usize = 500;
/// History events shown per tenant (the newest; the state keeps `pool::TENANT_HISTORY_MAX`).
pub const TENANT_HISTORY_SHOWN_MAX: usize = 5;
/// Agents listed by the cluster view: the ones whose heartbeat is oldest.
pub const STALEST_AGENTS_MAX: usize = 20;
/// Distinct GPU models counted in the overview; the rest are summed under `other`.
pub const MODELS_MAX: usize = 32;
/// Longest query string taken, in bytes.
pub const QUERY_BYTES_MAX: usize = 2048;
/// Longest value of one parameter, decoded, in bytes (names and labels are shorter).
pub const QUERY_VALUE_BYTES_MAX: usize = 256;
/// How old the leader's soft state may be before a request fetches it again.
pub const SOFT_STATE_MAX_AGE: Duration = Duration::from_secs(1);
/// Fetches of the leader's soft state (for different pages) kept at once.
pub const SOFT_STATE_CACHED_MAX: usize = 16;

/// What is wrong with a request to the JSON API.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueryError {
    #[error("the query string is longer than {QUERY_BYTES_MAX} bytes")]
    TooLong,
    #[error("`{key}` has an invalid value {value:?}: {why}")]
    Invalid {
        key: String,
        value: String,
        why: &'static str,
    },
}

/// The parameters of a page: where it starts, how long it is, and the filters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageQuery {
    /// The `next_page_token` of the previous page: the last name it held (empty: the first).
    pub page_token: String,
    pub limit: Option<usize>,
    /// `label=KEY=VALUE` (or `label=KEY`: any value): nodes carrying it.
    pub label: Option<(String, Option<String>)>,
    /// GPU model, exactly.
    pub model: Option<String>,
    /// A node state (`ready`, `lost`, `draining`) or a tenant state (`pending`, `placed`,
    /// `preempted`).
    pub state: Option<String>,
    /// One tenant's name (`/ui/api/tenant`).
    pub name: Option<String>,
}

impl PageQuery {
    /// Parses `a=b&c=d` (percent-encoded; `+` is a space). Unknown keys are ignored.
    pub fn parse(query: &str) -> Result<PageQuery, QueryError> {
        if query.len() > QUERY_BYTES_MAX {
            return Err(QueryError::TooLong);
        }
        let mut parsed = PageQuery::default();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value).ok_or_else(|| QueryError::Invalid {
                key: key.to_owned(),
                value: value.to_owned(),
                why: "bad percent-encoding",
            })?;
            let invalid = |why| QueryError::Invalid {
                key: key.to_owned(),
                value: value.clone(),
                why,
            };
            if value.len() > QUERY_VALUE_BYTES_MAX {
                return Err(invalid("too long"));
            }
            match key {
                "page_token" => parsed.page_token = value,
                "limit" => match value.parse::<usize>() {
                    Ok(limit) if limit > 0 => parsed.limit = Some(limit),
                    _ => return Err(invalid("a positive number")),
                },
                "label" if value.is_empty() => {}
                "label" => {
                    parsed.label = Some(match value.split_once('=') {
                        Some((key, value)) => (key.to_owned(), Some(value.to_owned())),
                        None => (value, None),
                    });
                }
                "model" if !value.is_empty() => parsed.model = Some(value),
                "state" if !value.is_empty() => parsed.state = Some(value.to_ascii_lowercase()),
                "name" if !value.is_empty() => parsed.name = Some(value),
                _ => {}
            }
        }
        Ok(parsed)
    }

    fn limit(&self, default: usize, max: usize) -> usize {
        self.limit.unwrap_or(default).clamp(1, max)
    }

    fn start(&self) -> std::ops::Bound<&str> {
        if self.page_token.is_empty() {
            std::ops::Bound::Unbounded
        } else {
            std::ops::Bound::Excluded(self.page_token.as_str())
        }
    }
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(at + 1..at + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                at += 3;
            }
            b'+' => {
                out.push(b' ');
                at += 1;
            }
            byte => {
                out.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The leader's soft state that the views need (see `crate::usage`).
#[derive(Debug, Clone, Default)]
pub struct SoftState {
    /// Node -> last heartbeat the leader saw (unix ms).
    pub heartbeats: BTreeMap<String, i64>,
    /// Node -> its latest health and usage report.
    pub reports: BTreeMap<String, NodeReport>,
}

// ---------------------------------------------------------------------------------------------
// The JSON types. Field names are the API: the page's script and any client read them.

/// `GET /ui/api/pool`: the overview of the whole pool and one page of nodes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PoolPage {
    pub overview: PoolOverview,
    /// Nodes that pass the filters, in the whole pool.
    pub nodes_matched: u64,
    pub nodes: Vec<NodeTile>,
    /// Pass as `page_token` for the next page; empty on the last.
    pub next_page_token: String,
}

/// Aggregates over the whole pool (not only the page).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PoolOverview {
    pub nodes: u64,
    /// Nodes by state (`ready`, `lost`, `draining`).
    pub nodes_by_state: BTreeMap<String, u64>,
    pub gpus: u64,
    /// GPUs by model (at most [`MODELS_MAX`] models; the rest under `other`).
    pub gpus_by_model: BTreeMap<String, u64>,
    /// Sum over GPUs (100 = one GPU).
    pub compute_allocated_percent: u64,
    pub memory_bytes: u64,
    pub memory_allocated_bytes: u64,
    pub tenants_placed: u64,
    pub tenants_pending: u64,
    /// GPUs whose latest report shows an XID, an uncorrected ECC error or throttling.
    pub gpus_unhealthy: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeTile {
    pub name: String,
    pub state: String,
    pub labels: BTreeMap<String, String>,
    /// 0: the leader saw none (or could not be asked).
    pub last_heartbeat_unix_ms: i64,
    pub gpus: Vec<GpuTile>,
    /// The kube-scheduler allocates this node's GPUs (issue 18): its tenants are claims.
    pub kubernetes_managed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuTile {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_bytes: u64,
    pub memory_allocated_bytes: u64,
    pub compute_allocated_percent: u32,
    /// As the agent last reported; `None` when not reported or not supported.
    pub utilization_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub temperature_celsius: Option<u32>,
    pub health: Option<HealthView>,
    /// The tenants holding slices of this GPU, by name.
    pub segments: Vec<Segment>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HealthView {
    pub xid_errors: u64,
    pub last_xid: u32,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    pub throttle_reasons: Vec<String>,
    pub reported_unix_ms: i64,
}

/// One tenant's slice of one GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Segment {
    pub tenant: String,
    pub compute_percent: u32,
    pub memory_bytes: u64,
    /// Memory its processes hold on the GPU, as reported.
    pub memory_used_bytes: Option<u64>,
}

/// `GET /ui/api/tenants`: counts over the caller's tenants and one page of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantsPage {
    /// The caller's tenants by state (`pending`, `placed`, `preempted`).
    pub counts: BTreeMap<String, u64>,
    pub tenants: Vec<TenantRow>,
    pub next_page_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantRow {
    pub name: String,
    pub owner: String,
    pub state: String,
    /// Why it waits (pending, preempted), or the last change.
    pub reason: String,
    pub request: RequestView,
    pub placement: Vec<SliceView>,
    /// Summed over the tenant's GPUs as their nodes last reported; `None` when none reported.
    pub usage: Option<UsageView>,
    /// The newest events, oldest first.
    pub history: Vec<EventView>,
    pub created_unix_ms: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RequestView {
    pub whole_gpus: u32,
    pub milli_gpus: u32,
    pub nodes: u32,
    pub memory_bytes_per_gpu: u64,
    pub compute_percent: u32,
    pub priority: i32,
    pub preemptible: bool,
    pub latency: bool,
    pub latency_target_us: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SliceView {
    pub node: String,
    pub gpu_index: u32,
    pub compute_percent: u32,
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct UsageView {
    pub memory_used_bytes: u64,
    pub gpu_time_ns: u64,
    pub process_count: u32,
    /// The latency controller's target and measured p99 (µs); 0 when not measured.
    pub latency_target_us: u64,
    pub latency_p99_us: u64,
    pub latency_violations: u64,
    /// The SM redistribution on MPS nodes (issue 15 point 4), for a best-effort tenant it follows:
    /// the lowest SM cap any of its nodes keeps, in thousandths of the GPU's SMs (1000: uncapped;
    /// 0: not followed anywhere), and its progress per second summed over those nodes (0: not
    /// measured yet), in the application's own units when `progress_hinted` (some node says so),
    /// else steps; and its progress alone as those nodes' last probes read it, summed the same way
    /// (0: not probed yet).
    #[serde(default)]
    pub sm_cap_permille: u32,
    #[serde(default)]
    pub progress_per_s: f64,
    #[serde(default)]
    pub progress_hinted: bool,
    #[serde(default)]
    pub progress_alone_per_s: f64,
    /// Some node that follows it has its group side by side (rather than taking turns).
    #[serde(default)]
    pub side_by_side: bool,
    /// The oldest of the reports summed (unix ms).
    pub reported_unix_ms: i64,
}

/// `GET /ui/api/tenant?name=NAME`: one tenant, its whole recorded history, and its usage
/// over the last hour.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantPage {
    pub tenant: TenantRow,
    /// `None` when the leader, which keeps it, could not be asked.
    pub usage_history: Option<UsageHistoryView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UsageHistoryView {
    /// One sample per bucket of this many milliseconds, over at most `window_ms`.
    pub bucket_ms: i64,
    pub window_ms: i64,
    /// The answering member's clock, for the plot's time axis.
    pub now_unix_ms: i64,
    /// Oldest first (`gpu_time_ns` is a counter: plot its rate).
    pub samples: Vec<history::UsageSample>,
}

/// Why one tenant's view is refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TenantPageError {
    #[error("the query names no tenant (`name=`)")]
    NoName,
    #[error("no tenant is named `{0}`")]
    NotFound(String),
    #[error("tenant `{0}` belongs to another owner")]
    NotYours(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EventView {
    pub unix_ms: i64,
    pub state: String,
    pub message: String,
}

/// `GET /ui/api/cluster`: the members as this member sees them, and the agents.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterView {
    pub cluster_id: String,
    /// The member that answered.
    pub responder: u64,
    /// 0: none known.
    pub leader: u64,
    pub term: u64,
    pub last_log_index: u64,
    pub last_applied: u64,
    pub members: Vec<MemberView>,
    /// The last changes of term or leader this member saw, newest first (at most
    /// [`history::ELECTIONS_MAX`]; since it started).
    pub elections: Vec<history::Election>,
    /// Admins only (`None` for other callers).
    pub agents: Option<AgentsView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MemberView {
    pub id: u64,
    pub address: String,
    pub voter: bool,
    /// The leader's replication progress to it (0 when this member does not lead).
    pub matched_index: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AgentsView {
    pub nodes: u64,
    /// Nodes by the age of their last heartbeat: `<5s`, `<30s`, `<5m`, `older`, `never`.
    pub heartbeat_age: BTreeMap<String, u64>,
    /// The nodes heard from least recently (at most [`STALEST_AGENTS_MAX`]).
    pub stalest: Vec<AgentView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AgentView {
    pub node: String,
    /// 0: never (as far as the leader knows).
    pub last_heartbeat_unix_ms: i64,
}

// ---------------------------------------------------------------------------------------------
// Building the views (pure).

fn node_state_name(state: placement::NodeState) -> &'static str {
    match state {
        placement::NodeState::Ready => "ready",
        placement::NodeState::Lost => "lost",
        placement::NodeState::Draining => "draining",
    }
}

fn tenant_state_name(state: TenantState) -> &'static str {
    match state {
        TenantState::Pending => "pending",
        TenantState::Placed => "placed",
        TenantState::Preempted => "preempted",
    }
}

fn unhealthy(health: &GpuHealth) -> bool {
    crate::usage::gpu_unhealthy(health)
}

fn overview(pool: &PoolState, soft: &SoftState) -> PoolOverview {
    let summary = pool.engine.summary();
    let mut overview = PoolOverview {
        nodes: pool.nodes.len() as u64,
        gpus: summary.gpus_total,
        compute_allocated_percent: summary.compute_allocated_percent,
        memory_bytes: summary.memory_total_bytes,
        memory_allocated_bytes: summary.memory_allocated_bytes,
        tenants_placed: summary.tenants_placed,
        tenants_pending: summary.tenants_pending,
        ..PoolOverview::default()
    };
    for view in pool.engine.nodes() {
        *overview
            .nodes_by_state
            .entry(node_state_name(view.state).to_owned())
            .or_default() += 1;
        for gpu in &view.spec.gpus {
            let known = overview.gpus_by_model.contains_key(&gpu.model);
            let model = if known || overview.gpus_by_model.len() < MODELS_MAX {
                gpu.model.clone()
            } else {
                "other".to_owned()
            };
            *overview.gpus_by_model.entry(model).or_default() += 1;
        }
    }
    overview.gpus_unhealthy = soft
        .reports
        .iter()
        .filter(|(node, _)| pool.nodes.contains_key(*node))
        .flat_map(|(_, report)| &report.gpus)
        .filter(|health| unhealthy(health))
        .count() as u64;
    assert_eq!(
        overview.gpus_by_model.values().sum::<u64>(),
        overview.gpus,
        "every GPU is counted under one model"
    );
    overview
}

fn node_matches(view: &placement::NodeView<'_>, query: &PageQuery) -> bool {
    let label_ok = match &query.label {
        None => true,
        Some((key, None)) => view.spec.labels.contains_key(key),
        Some((key, Some(value))) => view.spec.labels.get(key) == Some(value),
    };
    let model_ok = query
        .model
        .as_ref()
        .is_none_or(|model| view.spec.gpus.iter().any(|gpu| &gpu.model == model));
    let state_ok = query
        .state
        .as_ref()
        .is_none_or(|state| node_state_name(view.state) == state);
    label_ok && model_ok && state_ok
}

fn node_tile(pool: &PoolState, soft: &SoftState, view: &placement::NodeView<'_>) -> NodeTile {
    let name = &view.spec.name;
    let report = soft.reports.get(name);
    let gpus = view
        .spec
        .gpus
        .iter()
        .zip(&view.usage)
        .map(|(gpu, usage)| {
            let health = report.and_then(|r| r.gpus.iter().find(|h| h.uuid == gpu.uuid));
            let used_by = |tenant: &str| {
                let entries = report?
                    .usage
                    .iter()
                    .filter(|u| u.tenant == tenant && u.gpu == gpu.uuid);
                entries.map(|u| u.memory_used_bytes).reduce(|a, b| a + b)
            };
            let segments = usage
                .tenants
                .iter()
                .filter_map(|tenant| {
                    let record = pool.tenants.get(tenant)?;
                    let slice = record
                        .slices
                        .iter()
                        .find(|s| &s.node == name && s.gpu_index == gpu.index)?;
                    Some(Segment {
                        tenant: tenant.clone(),
                        compute_percent: slice.compute_percent,
                        memory_bytes: slice.memory_bytes,
                        memory_used_bytes: used_by(tenant),
                    })
                })
                .collect();
            GpuTile {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: gpu.model.clone(),
                memory_bytes: gpu.memory_bytes,
                memory_allocated_bytes: usage.memory_allocated_bytes,
                compute_allocated_percent: usage.compute_allocated_percent,
                utilization_percent: health.and_then(|h| h.utilization_percent),
                memory_used_bytes: health.and_then(|h| h.memory_used_bytes),
                temperature_celsius: health.and_then(|h| h.temperature_celsius),
                health: health.map(|h| HealthView {
                    xid_errors: h.xid_errors,
                    last_xid: h.last_xid,
                    ecc_corrected: h.ecc_corrected,
                    ecc_uncorrected: h.ecc_uncorrected,
                    throttle_reasons: h.throttle_reasons.clone(),
                    reported_unix_ms: h.reported_unix_ms,
                }),
                segments,
            }
        })
        .collect();
    NodeTile {
        name: name.clone(),
        state: node_state_name(view.state).to_owned(),
        labels: view.spec.labels.clone(),
        last_heartbeat_unix_ms: soft.heartbeats.get(name).copied().unwrap_or(0),
        gpus,
        kubernetes_managed: view.kubernetes_managed,
    }
}

/// The names of the nodes on the pool page for `query`, and whether more follow: the soft
/// state a page needs is these nodes' reports (see [`Dashboard::soft_state`]).
pub fn pool_page_nodes(pool: &PoolState, query: &PageQuery) -> (Vec<String>, bool) {
    let limit = query.limit(POOL_PAGE_NODES_DEFAULT, POOL_PAGE_NODES_MAX);
    let mut names = pool
        .nodes
        .range::<str, _>((query.start(), std::ops::Bound::Unbounded))
        .map(|(name, _)| name)
        .filter_map(|name| pool.engine.node(name))
        .filter(|view| node_matches(view, query))
        .map(|view| view.spec.name.clone())
        .peekable();
    let mut page = Vec::with_capacity(limit);
    while let Some(name) = names.next_if(|_| page.len() < limit) {
        page.push(name);
    }
    let more = names.peek().is_some();
    assert!(page.len() <= POOL_PAGE_NODES_MAX, "pages are bounded");
    (page, more)
}

/// The pool page for `query`: the overview of the whole pool, and up to `limit` (at most
/// [`POOL_PAGE_NODES_MAX`]) nodes that pass its filters, after `page_token` in name order.
pub fn pool_page(pool: &PoolState, soft: &SoftState, query: &PageQuery) -> PoolPage {
    let nodes_matched = pool
        .engine
        .nodes()
        .iter()
        .filter(|view| node_matches(view, query))
        .count() as u64;
    let (names, more) = pool_page_nodes(pool, query);
    let nodes: Vec<NodeTile> = names
        .iter()
        .filter_map(|name| pool.engine.node(name))
        .map(|view| node_tile(pool, soft, &view))
        .collect();
    assert_eq!(nodes.len(), names.len(), "the page's nodes are registered");
    let next_page_token = match (more, nodes.last()) {
        (true, Some(last)) => last.name.clone(),
        _ => String::new(),
    };
    assert!(nodes.len() <= POOL_PAGE_NODES_MAX, "pages are bounded");
    assert!(nodes.len() as u64 <= nodes_matched);
    PoolPage {
        overview: overview(pool, soft),
        nodes_matched,
        nodes,
        next_page_token,
    }
}

fn usage_of(record: &crate::pool::TenantRecord, soft: &SoftState) -> Option<UsageView> {
    let mut nodes: Vec<&str> = record.slices.iter().map(|s| s.node.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let entries: Vec<&TenantUsage> = nodes
        .iter()
        .filter_map(|node| soft.reports.get(*node))
        .flat_map(|report| report.usage.iter().filter(|u| u.tenant == record.name))
        .collect();
    let oldest = entries.iter().map(|u| u.reported_unix_ms).min()?;
    let mut usage = UsageView {
        reported_unix_ms: oldest,
        ..UsageView::default()
    };
    for entry in entries {
        usage.memory_used_bytes += entry.memory_used_bytes;
        usage.gpu_time_ns += entry.gpu_time_ns;
        usage.process_count += entry.process_count;
        // Per tenant and node (on its first entry): the worst node's figures.
        usage.latency_target_us = usage.latency_target_us.max(entry.latency_target_us);
        usage.latency_p99_us = usage.latency_p99_us.max(entry.latency_p99_us);
        usage.latency_violations += entry.latency_violations;
        // Per tenant and node too: the lowest cap of the nodes that follow it, their rates summed.
        if entry.sm_cap_permille > 0 {
            usage.sm_cap_permille = match usage.sm_cap_permille {
                0 => entry.sm_cap_permille,
                lowest => lowest.min(entry.sm_cap_permille),
            };
            usage.progress_per_s += entry.progress_per_s;
            usage.progress_hinted |= entry.progress_hinted;
            usage.progress_alone_per_s += entry.progress_alone_per_s;
            usage.side_by_side |= entry.redistribution_side_by_side;
        }
    }
    debug_assert!(usage.sm_cap_permille <= api::usage::SM_CAP_PERMILLE_FULL);
    debug_assert!(usage.sm_cap_permille > 0 || usage.progress_per_s == 0.0);
    Some(usage)
}

fn tenant_row(
    record: &crate::pool::TenantRecord,
    soft: &SoftState,
    history_max: usize,
) -> TenantRow {
    let request = decode_request(&record.request);
    let skip = record.history.len().saturating_sub(history_max);
    TenantRow {
        name: record.name.clone(),
        owner: request.owner.clone(),
        state: tenant_state_name(record.state).to_owned(),
        reason: record.reason.clone(),
        request: RequestView {
            whole_gpus: request.whole_gpus,
            milli_gpus: request.milli_gpus,
            nodes: request.nodes,
            memory_bytes_per_gpu: request.memory_bytes_per_gpu,
            compute_percent: request.compute_percent,
            priority: request.priority,
            preemptible: request.preemptible,
            latency: request.latency,
            latency_target_us: request.latency_target_us,
        },
        placement: record
            .slices
            .iter()
            .map(|s| SliceView {
                node: s.node.clone(),
                gpu_index: s.gpu_index,
                compute_percent: s.compute_percent,
                memory_bytes: s.memory_bytes,
            })
            .collect(),
        usage: usage_of(record, soft),
        history: record
            .history
            .iter()
            .skip(skip)
            .map(|event| EventView {
                unix_ms: event.unix_ms,
                state: tenant_state_name(event.state).to_owned(),
                message: event.message.clone(),
            })
            .collect(),
        created_unix_ms: record.created_unix_ms,
    }
}

/// The tenants page for `query`: counts over the tenants in `scope`, and up to `limit` (at most
/// [`TENANTS_PAGE_MAX`]) of them that pass the state filter, after `page_token`.
pub fn tenants_page(
    pool: &PoolState,
    soft: &SoftState,
    query: &PageQuery,
    scope: &TenantScope,
) -> TenantsPage {
    let limit = query.limit(TENANTS_PAGE_DEFAULT, TENANTS_PAGE_MAX);
    let owner_of = |record: &crate::pool::TenantRecord| decode_request(&record.request).owner;
    let in_scope = |record: &&crate::pool::TenantRecord| match scope {
        TenantScope::All => true,
        TenantScope::Owner(_) => scope.covers(&owner_of(record)),
    };
    let mut counts = BTreeMap::new();
    for record in pool.tenants.values().filter(in_scope) {
        *counts
            .entry(tenant_state_name(record.state).to_owned())
            .or_default() += 1;
    }
    let state_ok = |record: &&crate::pool::TenantRecord| {
        query
            .state
            .as_ref()
            .is_none_or(|state| tenant_state_name(record.state) == state)
    };
    let mut records = pool
        .tenants
        .range::<str, _>((query.start(), std::ops::Bound::Unbounded))
        .map(|(_, record)| record)
        .filter(in_scope)
        .filter(state_ok)
        .peekable();
    let mut tenants = Vec::with_capacity(limit.min(pool.tenants.len()));
    while let Some(record) = records.next_if(|_| tenants.len() < limit) {
        tenants.push(tenant_row(record, soft, TENANT_HISTORY_SHOWN_MAX));
    }
    let next_page_token = match (records.peek(), tenants.last()) {
        (Some(_), Some(last)) => last.name.clone(),
        _ => String::new(),
    };
    assert!(tenants.len() <= TENANTS_PAGE_MAX, "pages are bounded");
    TenantsPage {
        counts,
        tenants,
        next_page_token,
    }
}

/// The tenant `query.name` with all its recorded events, if it is in `scope`; its usage
/// history is the caller's to add.
pub fn tenant_page(
    pool: &PoolState,
    soft: &SoftState,
    query: &PageQuery,
    scope: &TenantScope,
) -> Result<TenantRow, TenantPageError> {
    let name = query.name.as_deref().ok_or(TenantPageError::NoName)?;
    let record = pool
        .tenants
        .get(name)
        .ok_or_else(|| TenantPageError::NotFound(name.to_owned()))?;
    if !scope.covers(&decode_request(&record.request).owner) {
        return Err(TenantPageError::NotYours(name.to_owned()));
    }
    let row = tenant_row(record, soft, usize::MAX);
    assert_eq!(row.name, name);
    assert_eq!(
        row.history.len(),
        record.history.len(),
        "every recorded event"
    );
    Ok(row)
}

/// The Raft facts of the cluster view, read from openraft's metrics by the caller.
#[derive(Debug, Clone, Default)]
pub struct ClusterFacts {
    pub cluster_id: String,
    pub responder: u64,
    pub leader: u64,
    pub term: u64,
    pub last_log_index: u64,
    pub last_applied: u64,
    pub members: Vec<MemberView>,
    pub elections: Vec<history::Election>,
}

/// The cluster view; `agents` only when `show_agents` (admins), over the registered nodes.
pub fn cluster_view(
    facts: ClusterFacts,
    pool: &PoolState,
    soft: &SoftState,
    now_unix_ms: i64,
    show_agents: bool,
) -> ClusterView {
    let agents = show_agents.then(|| {
        let mut agents = AgentsView {
            nodes: pool.nodes.len() as u64,
            ..AgentsView::default()
        };
        let mut all: Vec<AgentView> = pool
            .nodes
            .keys()
            .map(|node| AgentView {
                node: node.clone(),
                last_heartbeat_unix_ms: soft.heartbeats.get(node).copied().unwrap_or(0),
            })
            .collect();
        for agent in &all {
            let age_ms = now_unix_ms.saturating_sub(agent.last_heartbeat_unix_ms);
            let bucket = match agent.last_heartbeat_unix_ms {
                0 => "never",
                _ if age_ms < 5_000 => "<5s",
                _ if age_ms < 30_000 => "<30s",
                _ if age_ms < 300_000 => "<5m",
                _ => "older",
            };
            *agents.heartbeat_age.entry(bucket.to_owned()).or_default() += 1;
        }
        all.sort_by(|a, b| {
            (a.last_heartbeat_unix_ms, &a.node).cmp(&(b.last_heartbeat_unix_ms, &b.node))
        });
        all.truncate(STALEST_AGENTS_MAX);
        agents.stalest = all;
        assert_eq!(agents.heartbeat_age.values().sum::<u64>(), agents.nodes);
        agents
    });
    ClusterView {
        cluster_id: facts.cluster_id,
        responder: facts.responder,
        leader: facts.leader,
        term: facts.term,
        last_log_index: facts.last_log_index,
        last_applied: facts.last_applied,
        members: facts.members,
        elections: facts.elections,
        agents,
    }
}

// ---------------------------------------------------------------------------------------------
// Serving.

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const APP_CSS: &str = include_str!("dashboard/app.css");
/// The page loads only its own script and style (the bars' widths and colours are inline style
/// attributes), and is not framed by other sites.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'";

/// Fetched soft state: when, for which reports, and what came.
type SoftStateEntry = (Instant, Option<Filter>, Arc<SoftState>);

/// What the routes share: the member, its guard, and the cached soft state.
struct Dashboard {
    control_plane: Arc<ControlPlane>,
    guard: Arc<Guard>,
    /// The leader's soft state by the reports asked for, and when it was fetched (at most
    /// [`SOFT_STATE_CACHED_MAX`]); the lock also keeps fetches to one at a time per member.
    soft: tokio::sync::Mutex<std::collections::VecDeque<SoftStateEntry>>,
    /// The changes of term and leader this member saw (filled by [`watch_elections`]).
    elections: Arc<Mutex<history::Elections>>,
}

impl Dashboard {
    /// The heartbeat times and the reports `filter` asks for (none without one), fetched at
    /// most once per [`SOFT_STATE_MAX_AGE`] per filter: browsers polling the same page share
    /// one fetch.
    async fn soft_state(&self, filter: Option<Filter>) -> Arc<SoftState> {
        let mut cached = self.soft.lock().await;
        cached.retain(|(at, _, _)| at.elapsed() < SOFT_STATE_MAX_AGE);
        if let Some((_, _, soft)) = cached.iter().find(|(_, held, _)| *held == filter) {
            return soft.clone();
        }
        // Each fetch is bounded (one second each, `crate::usage::FORWARD_TIMEOUT`).
        let heartbeats = self.control_plane.last_heartbeats().await;
        let reports = match &filter {
            Some(filter) => self.control_plane.reports(filter.clone()).await,
            None => BTreeMap::new(),
        };
        let soft = Arc::new(SoftState {
            heartbeats,
            reports,
        });
        if cached.len() == SOFT_STATE_CACHED_MAX {
            cached.pop_front();
        }
        cached.push_back((Instant::now(), filter, soft.clone()));
        assert!(cached.len() <= SOFT_STATE_CACHED_MAX);
        soft
    }

    fn cluster_facts(&self) -> ClusterFacts {
        let facts = self.control_plane.replication.facts();
        ClusterFacts {
            cluster_id: self.control_plane.cluster_id.clone(),
            responder: self.control_plane.id,
            leader: facts.leader,
            term: facts.term,
            last_log_index: facts.last_log_index,
            last_applied: facts.last_applied,
            members: facts
                .members
                .into_iter()
                .map(|member| MemberView {
                    id: member.id,
                    address: member.address,
                    voter: member.voter,
                    matched_index: member.matched_index,
                })
                .collect(),
            elections: self
                .elections
                .lock()
                .expect("elections lock")
                .newest_first(),
        }
    }
}

/// Records every change of term or leader this member sees (in its Raft metrics, or on etcd in
/// who leads and under which leadership), until its store stops. `read` gives the term and the
/// leader (0: none).
async fn watch_elections<T>(
    mut metrics: tokio::sync::watch::Receiver<T>,
    read: impl Fn(&T) -> (u64, u64),
    elections: Arc<Mutex<history::Elections>>,
) {
    loop {
        let (term, leader) = read(&metrics.borrow_and_update());
        elections
            .lock()
            .expect("elections lock")
            .observe(unix_ms(), term, leader);
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// Adds the leader's reports to its usage history at `now_unix_ms` (see [`history`]).
pub fn sample_usage(control_plane: &ControlPlane, now_unix_ms: i64) {
    let mut totals = history::Totals::default();
    control_plane
        .reports
        .visit_usage(|received_unix_ms, usage| totals.add(now_unix_ms, received_unix_ms, usage));
    let mut usage_history = control_plane
        .usage_history
        .lock()
        .expect("usage history lock");
    usage_history.record(now_unix_ms, totals);
    assert!(usage_history.tenants() <= history::TENANTS_TRACKED_MAX);
}

/// Samples every [`history::SAMPLE_TICK`] while this member leads, until it is dropped.
async fn sample_usage_while_leading(control_plane: Weak<ControlPlane>) {
    let mut tick = tokio::time::interval(history::SAMPLE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(control_plane) = control_plane.upgrade() else {
            return;
        };
        if control_plane.is_leader() {
            sample_usage(&control_plane, unix_ms());
        }
    }
}

/// `tenant`'s usage history from the leader; `None` when it cannot be asked within
/// `crate::usage::FORWARD_TIMEOUT` (or is too old to know the request).
async fn usage_history(
    control_plane: &ControlPlane,
    tenant: &str,
) -> Option<Vec<history::UsageSample>> {
    if control_plane.is_leader() {
        let usage_history = control_plane
            .usage_history
            .lock()
            .expect("usage history lock");
        return Some(usage_history.samples(tenant));
    }
    let request = ForwardRequest::UsageHistory(tenant.to_owned());
    let attempt = control_plane.forward_once(control_plane.leader_node(), &request);
    match tokio::time::timeout(crate::usage::FORWARD_TIMEOUT, attempt).await {
        Ok(Ok(Some(ForwardResponse::UsageHistory(samples)))) => Some(samples),
        _ => None,
    }
}

/// Which JSON view a request asks for.
#[derive(Debug, Clone, Copy)]
enum View {
    Pool,
    Tenants,
    Tenant,
    Cluster,
}

/// The `/ui/` routes, to merge into the API's router.
pub fn router(control_plane: Arc<ControlPlane>, guard: Arc<Guard>) -> axum::Router {
    let elections = Arc::new(Mutex::new(history::Elections::default()));
    match &control_plane.replication {
        crate::replication::Replication::Raft(raft) => {
            tokio::spawn(watch_elections(
                raft.raft.metrics(),
                |metrics| (metrics.current_term, metrics.current_leader.unwrap_or(0)),
                elections.clone(),
            ));
        }
        crate::replication::Replication::Etcd(etcd) => {
            tokio::spawn(watch_elections(
                etcd.leader_changes(),
                crate::etcd_replication::term_and_leader,
                elections.clone(),
            ));
        }
    }
    tokio::spawn(sample_usage_while_leading(Arc::downgrade(&control_plane)));
    let dashboard = Arc::new(Dashboard {
        control_plane,
        guard,
        soft: tokio::sync::Mutex::new(std::collections::VecDeque::new()),
        elections,
    });
    let json = |view: View| {
        let dashboard = dashboard.clone();
        axum::routing::get(move |request: axum::extract::Request| {
            let dashboard = dashboard.clone();
            async move { answer(&dashboard, view, request).await }
        })
    };
    let asset = |content_type: &'static str, body: &'static str| {
        axum::routing::get(move || async move {
            let headers = [
                (header::CONTENT_TYPE, content_type),
                (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ];
            (headers, body).into_response()
        })
    };
    axum::Router::new()
        .route(
            "/ui",
            axum::routing::get(|| async {
                (StatusCode::PERMANENT_REDIRECT, [(header::LOCATION, "/ui/")]).into_response()
            }),
        )
        .route("/ui/", asset("text/html; charset=utf-8", INDEX_HTML))
        .route(
            "/ui/app.js",
            asset("text/javascript; charset=utf-8", APP_JS),
        )
        .route("/ui/app.css", asset("text/css; charset=utf-8", APP_CSS))
        .route("/ui/api/pool", json(View::Pool))
        .route("/ui/api/tenants", json(View::Tenants))
        .route("/ui/api/tenant", json(View::Tenant))
        .route("/ui/api/cluster", json(View::Cluster))
}

/// The reports a page of tenants needs: those of the nodes they are placed on.
fn placement_nodes(rows: &[TenantRow]) -> Filter {
    let names: std::collections::BTreeSet<&str> = rows
        .iter()
        .flat_map(|row| row.placement.iter().map(|slice| slice.node.as_str()))
        .collect();
    Filter::Nodes {
        names: names.into_iter().map(str::to_owned).collect(),
        unhealthy: false,
    }
}

fn error_response(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "error": message }).to_string();
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

fn status_response(status: &tonic::Status) -> Response {
    let code = match status.code() {
        tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        tonic::Code::PermissionDenied => StatusCode::FORBIDDEN,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error_response(code, status.message())
}

async fn answer(dashboard: &Dashboard, view: View, request: axum::extract::Request) -> Response {
    let query = match PageQuery::parse(request.uri().query().unwrap_or("")) {
        Ok(query) => query,
        Err(error) => return error_response(StatusCode::BAD_REQUEST, &error.to_string()),
    };
    // The guard reads the caller's certificate from the connection, as for a gRPC call.
    let (_, extensions, _) = tonic::Request::from_http(request).into_parts();
    let caller = tonic::Request::from_parts(tonic::metadata::MetadataMap::new(), extensions, ());
    let guard = &dashboard.guard;
    let json = match view {
        View::Pool => {
            if let Err(status) = guard.admin(&caller, "reading the pool dashboard") {
                return status_response(&status);
            }
            // Only the page's nodes' reports, and the health of every unhealthy node (for the
            // overview's count): what a page needs, not the whole pool.
            let (names, _) = pool_page_nodes(&dashboard.control_plane.shared.read().pool, &query);
            let filter = Filter::Nodes {
                names,
                unhealthy: true,
            };
            let soft = dashboard.soft_state(Some(filter)).await;
            let applied = dashboard.control_plane.shared.read();
            serde_json::to_string(&pool_page(&applied.pool, &soft, &query))
        }
        View::Tenants => {
            let scope = match guard.tenants(&caller, "reading the tenants dashboard") {
                Ok((_, scope)) => scope,
                Err(status) => return status_response(&status),
            };
            // The reports of the nodes that the page's tenants are placed on.
            let nodes = {
                let applied = dashboard.control_plane.shared.read();
                let rows = tenants_page(&applied.pool, &SoftState::default(), &query, &scope);
                placement_nodes(&rows.tenants)
            };
            let soft = dashboard.soft_state(Some(nodes)).await;
            let applied = dashboard.control_plane.shared.read();
            serde_json::to_string(&tenants_page(&applied.pool, &soft, &query, &scope))
        }
        View::Tenant => {
            let scope = match guard.tenants(&caller, "reading a tenant's dashboard") {
                Ok((_, scope)) => scope,
                Err(status) => return status_response(&status),
            };
            let nodes = {
                let applied = dashboard.control_plane.shared.read();
                tenant_page(&applied.pool, &SoftState::default(), &query, &scope)
                    .map(|row| placement_nodes(std::slice::from_ref(&row)))
            };
            let row = match nodes {
                Ok(nodes) => {
                    let soft = dashboard.soft_state(Some(nodes)).await;
                    let applied = dashboard.control_plane.shared.read();
                    tenant_page(&applied.pool, &soft, &query, &scope)
                }
                Err(error) => Err(error),
            };
            let tenant = match row {
                Ok(row) => row,
                Err(error) => {
                    let status = match error {
                        TenantPageError::NoName => StatusCode::BAD_REQUEST,
                        TenantPageError::NotFound(_) => StatusCode::NOT_FOUND,
                        TenantPageError::NotYours(_) => StatusCode::FORBIDDEN,
                    };
                    return error_response(status, &error.to_string());
                }
            };
            let samples = usage_history(&dashboard.control_plane, &tenant.name).await;
            serde_json::to_string(&TenantPage {
                tenant,
                usage_history: samples.map(|samples| UsageHistoryView {
                    bucket_ms: history::SAMPLE_BUCKET_MS,
                    window_ms: history::HISTORY_WINDOW_MS,
                    now_unix_ms: unix_ms(),
                    samples,
                }),
            })
        }
        View::Cluster => {
            let peer = match guard.caller(&caller) {
                Ok(peer) => peer,
                Err(status) => return status_response(&status),
            };
            let show_agents = peer.role == Role::Admin;
            let soft = if show_agents {
                dashboard.soft_state(None).await
            } else {
                Arc::default()
            };
            let facts = dashboard.cluster_facts();
            let applied = dashboard.control_plane.shared.read();
            serde_json::to_string(&cluster_view(
                facts,
                &applied.pool,
                &soft,
                unix_ms(),
                show_agents,
            ))
        }
    };
    match json {
        Ok(body) => (
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            body,
        )
            .into_response(),
        Err(error) => error_response(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string()),
    }
}

#[cfg(test)]
#[path = "dashboard_test.rs"]
mod tests;
