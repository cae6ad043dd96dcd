//! Tests of the dashboard's JSON building, over a real `PoolState` and made-up reports.

use super::*;
use crate::pool::{Command, CommandResult};
use api::v1;
use prost::Message;

fn node(name: &str, model: &str, zone: &str) -> placement::NodeSpec {
    placement::NodeSpec {
        name: name.to_owned(),
        labels: [("zone".to_owned(), zone.to_owned())].into(),
        gpus: (0..2)
            .map(|index| placement::GpuSpec {
                uuid: format!("GPU-{name}-{index}"),
                index,
                model: model.to_owned(),
                memory_bytes: 80 << 30,
                sm_count: 132,
                nvlink_peers: BTreeMap::new(),
                numa_node: 0,
                pci_bus_id: format!("0000:{index:02x}:00.0"),
                nearest_nics: Vec::new(),
            })
            .collect(),
    }
}

/// Nodes `n0..n{count}` (even: H100 in zone a, odd: A100 in zone b), then `tenants` tenants of a
/// quarter GPU each (`t00`, `t01`, ...), owned by `alice` (even) and `bob` (odd).
fn pool(nodes: usize, tenants: usize) -> PoolState {
    let mut state = PoolState::default();
    let mut index = 0;
    for n in 0..nodes {
        index += 1;
        let (model, zone) = if n % 2 == 0 {
            ("H100", "a")
        } else {
            ("A100", "b")
        };
        let result = state.apply(
            index,
            Command::RegisterNode {
                spec: node(&format!("n{n}"), model, zone),
                address: String::new(),
                unix_ms: 0,
            },
        );
        assert_eq!(result, CommandResult::Done);
    }
    for t in 0..tenants {
        index += 1;
        let request = v1::PlacementRequest {
            milli_gpus: 250,
            memory_bytes_per_gpu: 10 << 30,
            owner: if t % 2 == 0 { "alice" } else { "bob" }.to_owned(),
            ..Default::default()
        };
        state.apply(
            index,
            Command::Place {
                name: format!("t{t:02}"),
                request: request.encode_to_vec(),
                unix_ms: index as i64,
            },
        );
    }
    state
}

fn all() -> PageQuery {
    PageQuery::default()
}

#[test]
fn queries_parse_filters_and_refuse_what_is_malformed() {
    let query = PageQuery::parse("page_token=n1&limit=5&label=zone%3Da&model=H100&state=Ready&x=y")
        .expect("valid");
    assert_eq!(query.page_token, "n1");
    assert_eq!(query.limit, Some(5));
    assert_eq!(query.label, Some(("zone".to_owned(), Some("a".to_owned()))));
    assert_eq!(query.model.as_deref(), Some("H100"));
    assert_eq!(query.state.as_deref(), Some("ready"));
    assert_eq!(PageQuery::parse("").expect("empty"), PageQuery::default());
    assert_eq!(
        PageQuery::parse("label=gpu&model=").expect("valid").label,
        Some(("gpu".to_owned(), None))
    );
    assert!(matches!(
        PageQuery::parse("limit=0"),
        Err(QueryError::Invalid { .. })
    ));
    assert!(matches!(
        PageQuery::parse("model=%zz"),
        Err(QueryError::Invalid { .. })
    ));
    let value = format!("model={}", "x".repeat(QUERY_VALUE_BYTES_MAX + 1));
    assert!(matches!(
        PageQuery::parse(&value),
        Err(QueryError::Invalid {
            why: "too long",
            ..
        })
    ));
    let long = format!("model={}", "x".repeat(QUERY_BYTES_MAX));
    assert_eq!(PageQuery::parse(&long), Err(QueryError::TooLong));
}

#[test]
fn the_pool_page_shows_tiles_with_tenant_segments_and_whole_pool_aggregates() {
    let state = pool(2, 3);
    let page = pool_page(&state, &SoftState::default(), &all());
    assert_eq!(page.nodes.len(), 2);
    assert_eq!(page.nodes_matched, 2);
    assert!(page.next_page_token.is_empty());
    let overview = &page.overview;
    assert_eq!((overview.nodes, overview.gpus), (2, 4));
    assert_eq!(overview.gpus_by_model["H100"], 2);
    assert_eq!(overview.gpus_by_model["A100"], 2);
    assert_eq!(overview.nodes_by_state["ready"], 2);
    assert_eq!((overview.tenants_placed, overview.tenants_pending), (3, 0));
    assert_eq!(overview.compute_allocated_percent, 75);
    // Every placed tenant is a segment of exactly one GPU, with its slice's share.
    let segments: Vec<&Segment> = page
        .nodes
        .iter()
        .flat_map(|node| &node.gpus)
        .flat_map(|gpu| &gpu.segments)
        .collect();
    assert_eq!(segments.len(), 3);
    assert!(
        segments
            .iter()
            .all(|s| s.compute_percent == 25 && s.memory_bytes == 10 << 30)
    );
    for gpu in page.nodes.iter().flat_map(|node| &node.gpus) {
        let summed: u32 = gpu.segments.iter().map(|s| s.compute_percent).sum();
        assert_eq!(summed, gpu.compute_allocated_percent, "{gpu:?}");
        assert_eq!(gpu.health, None, "no report yet");
    }
}

#[test]
fn pool_pages_are_bounded_follow_tokens_and_filter_before_paging() {
    let state = pool(7, 0);
    let query = PageQuery {
        limit: Some(3),
        ..all()
    };
    let mut seen = Vec::new();
    let mut query = query;
    for _ in 0..10 {
        let page = pool_page(&state, &SoftState::default(), &query);
        assert!(page.nodes.len() <= 3);
        seen.extend(page.nodes.iter().map(|node| node.name.clone()));
        if page.next_page_token.is_empty() {
            break;
        }
        query.page_token = page.next_page_token;
    }
    assert_eq!(seen, ["n0", "n1", "n2", "n3", "n4", "n5", "n6"]);
    // A limit above the cap is held to it.
    let huge = PageQuery {
        limit: Some(1 << 20),
        ..all()
    };
    assert!(pool_page(&state, &SoftState::default(), &huge).nodes.len() <= POOL_PAGE_NODES_MAX);
    // Filters: zone b holds the odd nodes (A100).
    let zone_b = PageQuery::parse("label=zone=b").expect("valid");
    let page = pool_page(&state, &SoftState::default(), &zone_b);
    let names: Vec<&str> = page.nodes.iter().map(|node| node.name.as_str()).collect();
    assert_eq!(names, ["n1", "n3", "n5"]);
    assert_eq!(page.nodes_matched, 3);
    assert_eq!(page.overview.nodes, 7, "the overview is the whole pool's");
    let h100 = PageQuery::parse("model=H100&limit=2").expect("valid");
    let page = pool_page(&state, &SoftState::default(), &h100);
    assert_eq!(page.nodes_matched, 4);
    assert_eq!(page.next_page_token, "n2");
    let lost = PageQuery::parse("state=lost").expect("valid");
    assert!(
        pool_page(&state, &SoftState::default(), &lost)
            .nodes
            .is_empty()
    );
}

fn report(tenant: &str, gpu: &str) -> NodeReport {
    NodeReport {
        received_unix_ms: 1_000,
        generation: 1,
        gpus: vec![GpuHealth {
            uuid: gpu.to_owned(),
            xid_errors: 2,
            last_xid: 79,
            throttle_reasons: vec!["hw_slowdown".to_owned()],
            utilization_percent: Some(40),
            memory_used_bytes: Some(7 << 30),
            reported_unix_ms: 1_000,
            ..Default::default()
        }],
        usage: vec![TenantUsage {
            tenant: tenant.to_owned(),
            node: "n0".to_owned(),
            gpu: gpu.to_owned(),
            memory_used_bytes: 6 << 30,
            process_count: 2,
            latency_target_us: 5_000,
            latency_p99_us: 4_200,
            reported_unix_ms: 1_000,
            ..Default::default()
        }],
    }
}

#[test]
fn reports_fill_in_health_utilisation_and_usage() {
    let state = pool(1, 1);
    let slice = &state.tenants["t00"].slices[0];
    let soft = SoftState {
        heartbeats: [("n0".to_owned(), 900)].into(),
        reports: [("n0".to_owned(), report("t00", &slice.gpu_uuid))].into(),
    };
    let page = pool_page(&state, &soft, &all());
    assert_eq!(page.overview.gpus_unhealthy, 1);
    let tile = &page.nodes[0];
    assert_eq!(tile.last_heartbeat_unix_ms, 900);
    assert!(!tile.kubernetes_managed);
    let gpu = &tile.gpus[slice.gpu_index as usize];
    assert_eq!(gpu.utilization_percent, Some(40));
    assert_eq!(gpu.memory_used_bytes, Some(7 << 30));
    let health = gpu.health.as_ref().expect("reported");
    assert_eq!((health.xid_errors, health.last_xid), (2, 79));
    assert_eq!(gpu.segments[0].memory_used_bytes, Some(6 << 30));
    let tenants = tenants_page(&state, &soft, &all(), &TenantScope::All);
    let usage = tenants.tenants[0].usage.as_ref().expect("reported");
    assert_eq!(usage.memory_used_bytes, 6 << 30);
    assert_eq!(
        (usage.latency_p99_us, usage.latency_target_us),
        (4_200, 5_000)
    );
    assert_eq!(usage.process_count, 2);
}

#[test]
fn tenants_pages_are_scoped_counted_filtered_and_bounded() {
    // One node of two GPUs holds eight quarters; the ninth and tenth wait.
    let state = pool(1, 10);
    let everyone = tenants_page(&state, &SoftState::default(), &all(), &TenantScope::All);
    assert_eq!(everyone.tenants.len(), 10);
    assert_eq!(everyone.counts["placed"], 8);
    assert_eq!(everyone.counts["pending"], 2);
    let waiting = &everyone.tenants[9];
    assert_eq!(waiting.state, "pending");
    assert!(!waiting.reason.is_empty(), "a pending tenant says why");
    assert!(waiting.placement.is_empty() && waiting.usage.is_none());
    assert!(waiting.history.len() <= TENANT_HISTORY_SHOWN_MAX);
    assert_eq!(everyone.tenants[0].request.milli_gpus, 250);
    let alice = TenantScope::Owner("alice".to_owned());
    let own = tenants_page(&state, &SoftState::default(), &all(), &alice);
    assert!(own.tenants.iter().all(|t| t.owner == "alice"));
    assert_eq!(own.counts.values().sum::<u64>(), 5);
    let pending = PageQuery::parse("state=pending&limit=1").expect("valid");
    let first = tenants_page(&state, &SoftState::default(), &pending, &TenantScope::All);
    assert_eq!(first.tenants.len(), 1);
    assert_eq!(first.next_page_token, first.tenants[0].name);
    let next = PageQuery {
        page_token: first.next_page_token.clone(),
        ..pending
    };
    let second = tenants_page(&state, &SoftState::default(), &next, &TenantScope::All);
    assert_eq!(second.tenants.len(), 1);
    assert!(second.next_page_token.is_empty());
    assert_ne!(second.tenants[0].name, first.tenants[0].name);
}

#[test]
fn the_cluster_view_buckets_agents_and_hides_them_from_non_admins() {
    let state = pool(4, 0);
    let now = 1_700_000_000_000;
    let soft = SoftState {
        heartbeats: [
            ("n0".to_owned(), now - 1_000),
            ("n1".to_owned(), now - 10_000),
            ("n2".to_owned(), now - 3_600_000),
        ]
        .into(),
        reports: BTreeMap::new(),
    };
    let facts = ClusterFacts {
        cluster_id: "c".to_owned(),
        responder: 1,
        leader: 1,
        term: 3,
        last_log_index: 10,
        last_applied: 10,
        members: vec![MemberView {
            id: 1,
            address: "m1:7000".to_owned(),
            voter: true,
            matched_index: 10,
        }],
        elections: vec![history::Election {
            unix_ms: now - 5_000,
            term: 3,
            leader: 1,
        }],
    };
    let view = cluster_view(facts.clone(), &state, &soft, now, true);
    let agents = view.agents.as_ref().expect("admins see agents");
    assert_eq!(agents.nodes, 4);
    let age = |bucket: &str| agents.heartbeat_age.get(bucket).copied().unwrap_or(0);
    assert_eq!(
        (age("<5s"), age("<30s"), age("older"), age("never")),
        (1, 1, 1, 1)
    );
    assert_eq!(agents.stalest[0].node, "n3", "never heard from comes first");
    assert_eq!(agents.stalest[1].node, "n2");
    assert_eq!(view.members.len(), 1);
    assert_eq!(view.elections[0].term, 3);
    assert!(
        cluster_view(facts, &state, &soft, now, false)
            .agents
            .is_none()
    );
}

#[test]
fn a_page_of_a_large_pool_stays_small() {
    // 1,000 nodes of two GPUs: the page is bounded, the overview counts them all.
    let state = pool(1_000, 0);
    let page = pool_page(&state, &SoftState::default(), &all());
    assert_eq!(page.nodes.len(), POOL_PAGE_NODES_DEFAULT);
    assert_eq!(page.overview.gpus, 2_000);
    let bytes = serde_json::to_string(&page).expect("serializes").len();
    assert!(bytes < 64 << 10, "a default page is {bytes} bytes");
    let parsed: PoolPage =
        serde_json::from_str(&serde_json::to_string(&page).expect("json")).expect("parses back");
    assert_eq!(parsed, page);
}

#[test]
fn the_page_is_self_contained() {
    // No external assets: everything the page loads is served next to it.
    for asset in [INDEX_HTML, APP_JS, APP_CSS] {
        assert!(!asset.contains("http://") && !asset.contains("https://"));
    }
    assert!(INDEX_HTML.contains("app.js") && INDEX_HTML.contains("app.css"));
    for view in ["pool", "tenants", "cluster"] {
        assert!(
            APP_JS.contains(&format!("{view}:")),
            "the script draws {view}"
        );
    }
}

/// Every metric `deploy/grafana/vgpu-pool.json` queries is one that `/metrics` renders (with a
/// leader's reports), so the Grafana dashboard cannot drift from the names silently.
#[test]
fn the_grafana_dashboard_queries_only_metrics_that_exist() {
    const GRAFANA: &str = include_str!("../../../deploy/grafana/vgpu-pool.json");
    let dashboard: serde_json::Value = serde_json::from_str(GRAFANA).expect("valid JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().expect("an expr").to_owned());
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = variable["query"].as_str() {
            exprs.push(query.to_owned());
        }
    }
    assert!(exprs.len() >= 20, "the dashboard has its panels: {exprs:?}");
    // Render what a leader serves: a pool with a placed tenant, and a report with everything.
    let state = pool(1, 1);
    let slice = state.tenants["t00"].slices[0].clone();
    let mut report = report("t00", &slice.gpu_uuid);
    report.gpus[0].ecc_uncorrected = Some(1);
    report.gpus[0].ecc_corrected = Some(3);
    report.gpus[0].temperature_celsius = Some(60);
    report.usage[0].memory_limit_bytes = 10 << 30;
    report.usage[0].latency_p50_us = 3_000;
    report.usage[0].latency_violations = 4;
    report.usage[0].latency_steps = 100;
    report.usage[0].sm_cap_permille = 625;
    report.usage[0].progress_per_s = 12.5;
    let shared = crate::store::Shared {
        applied: std::sync::RwLock::new(crate::store::Applied {
            pool: state,
            ..Default::default()
        }),
        applied_index: tokio::sync::watch::channel(0).0,
        watchers: crate::watchers::NodeWatchers::default(),
    };
    let facts = crate::metrics::RaftFacts {
        id: 1,
        term: 1,
        leader: Some(1),
        last_log_index: 1,
        last_applied: 1,
        storage_failure: None,
    };
    let metrics = crate::metrics::Metrics::default();
    metrics.observe_commit(Duration::from_millis(1));
    let mut out = metrics.render(&facts, &shared);
    let reports: BTreeMap<String, NodeReport> = [("n0".to_owned(), report)].into();
    crate::usage::render(&mut out, &reports, |_| true);
    let rendered = |name: &str| {
        out.lines().any(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
    };
    let mut names: Vec<&str> = Vec::new();
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("vgpu_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.push(&tail[..end]);
            rest = &tail[end..];
        }
    }
    names.sort_unstable();
    names.dedup();
    assert!(
        names.len() >= 30,
        "the dashboard uses the metrics: {names:?}"
    );
    let missing: Vec<&&str> = names.iter().filter(|name| !rendered(name)).collect();
    assert!(missing.is_empty(), "not in /metrics: {missing:?}\n{out}");
}

#[test]
fn a_tenants_own_view_has_its_whole_history_and_follows_the_owner() {
    let state = pool(1, 12);
    let query = |name: &str| PageQuery::parse(&format!("name={name}")).expect("valid");
    let soft = SoftState::default();
    let row = tenant_page(&state, &soft, &query("t00"), &TenantScope::All).expect("found");
    assert_eq!(row.name, "t00");
    assert_eq!(row.owner, "alice");
    assert_eq!(row.history.len(), state.tenants["t00"].history.len());
    let alice = TenantScope::Owner("alice".to_owned());
    assert!(tenant_page(&state, &soft, &query("t00"), &alice).is_ok());
    assert_eq!(
        tenant_page(&state, &soft, &query("t01"), &alice),
        Err(TenantPageError::NotYours("t01".to_owned()))
    );
    assert_eq!(
        tenant_page(&state, &soft, &query("nobody"), &TenantScope::All),
        Err(TenantPageError::NotFound("nobody".to_owned()))
    );
    assert_eq!(
        tenant_page(&state, &soft, &all(), &TenantScope::All),
        Err(TenantPageError::NoName)
    );
}

#[test]
fn a_page_asks_the_leader_for_its_nodes_and_the_unhealthy_ones_only() {
    let state = pool(5, 0);
    let (names, more) = pool_page_nodes(&state, &PageQuery::parse("limit=2").expect("valid"));
    assert_eq!(
        (names.as_slice(), more),
        (&["n0".to_owned(), "n1".to_owned()][..], true)
    );
    let (names, more) = pool_page_nodes(&state, &PageQuery::parse("label=zone%3Db").expect("ok"));
    assert_eq!(
        (names.as_slice(), more),
        (&["n1".to_owned(), "n3".to_owned()][..], false)
    );
    // The leader's reports: n4's GPU is unhealthy, the others are well.
    let reports = crate::usage::Reports::default();
    for node in ["n0", "n1", "n2", "n3", "n4"] {
        let mut gpu = GpuHealth {
            uuid: format!("GPU-{node}-0"),
            ..Default::default()
        };
        if node == "n4" {
            gpu.xid_errors = 1;
        }
        let usage = TenantUsage {
            tenant: "t".to_owned(),
            gpu: gpu.uuid.clone(),
            ..Default::default()
        };
        let beat = v1::HeartbeatRequest {
            node: node.to_owned(),
            gpus: vec![gpu],
            usage: vec![usage],
            ..Default::default()
        };
        reports.record(beat, 1_000);
    }
    let filter = crate::usage::Filter::Nodes {
        names: vec!["n0".to_owned(), "n1".to_owned()],
        unhealthy: true,
    };
    let taken = reports.snapshot(&filter);
    assert_eq!(taken.keys().collect::<Vec<_>>(), ["n0", "n1", "n4"]);
    assert_eq!(taken["n0"].usage.len(), 1, "the page's nodes in full");
    assert!(
        taken["n4"].usage.is_empty(),
        "only the health of the others"
    );
    // The overview still counts the whole pool's unhealthy GPUs from it.
    let soft = SoftState {
        heartbeats: BTreeMap::new(),
        reports: taken,
    };
    let page = pool_page(&state, &soft, &PageQuery::parse("limit=2").expect("valid"));
    assert_eq!(page.overview.gpus_unhealthy, 1);
    assert_eq!(page.nodes.len(), 2);
    let without = crate::usage::Filter::Nodes {
        names: vec!["n2".to_owned()],
        unhealthy: false,
    };
    assert_eq!(reports.snapshot(&without).len(), 1);
}

/// Issue 15 point 4: a best-effort tenant followed by the SM redistribution on two nodes shows its
/// lowest cap and its rates summed; a tenant followed nowhere shows none.
#[test]
fn a_tenants_usage_has_its_lowest_sm_cap_and_its_summed_progress() {
    let mut state = pool(2, 0);
    let request = v1::PlacementRequest {
        whole_gpus: 1,
        nodes: 2,
        owner: "alice".to_owned(),
        ..Default::default()
    };
    let result = state.apply(
        10,
        Command::Place {
            name: "sweep".to_owned(),
            request: request.encode_to_vec(),
            unix_ms: 10,
        },
    );
    assert!(matches!(result, CommandResult::Tenant(_)), "{result:?}");
    let slices = state.tenants["sweep"].slices.clone();
    assert_eq!(slices.len(), 2, "{slices:?}");
    let sweep = PageQuery::parse("name=sweep").expect("valid");
    let followed = |slice: &placement::SliceAssignment, permille, rate, hinted| {
        let mut report = report("sweep", &slice.gpu_uuid);
        let usage = &mut report.usage[0];
        usage.node = slice.node.clone();
        (usage.latency_target_us, usage.latency_p99_us) = (0, 0);
        usage.sm_cap_permille = permille;
        usage.progress_per_s = rate;
        usage.progress_hinted = hinted;
        usage.redistribution_side_by_side = hinted;
        (slice.node.clone(), report)
    };
    let soft = SoftState {
        heartbeats: BTreeMap::new(),
        reports: [
            followed(&slices[0], 625, 12.5, true),
            followed(&slices[1], 1_000, 7.5, true),
        ]
        .into(),
    };
    let row = tenant_page(&state, &soft, &sweep, &TenantScope::All).expect("found");
    let usage = row.usage.as_ref().expect("reported");
    assert_eq!(
        (
            usage.sm_cap_permille,
            usage.progress_per_s,
            usage.progress_hinted,
            usage.side_by_side
        ),
        (625, 20.0, true, true)
    );
    // One node stops following it: what the other says.
    let soft = SoftState {
        heartbeats: BTreeMap::new(),
        reports: [
            followed(&slices[0], 0, 0.0, false),
            followed(&slices[1], 1_000, 7.5, false),
        ]
        .into(),
    };
    let row = tenant_page(&state, &soft, &sweep, &TenantScope::All).expect("found");
    let usage = row.usage.as_ref().expect("reported");
    assert_eq!(
        (
            usage.sm_cap_permille,
            usage.progress_per_s,
            usage.progress_hinted,
            usage.side_by_side
        ),
        (1_000, 7.5, false, false)
    );
    // Followed nowhere: zeros, and a view written before the fields existed still reads.
    let soft = SoftState {
        heartbeats: BTreeMap::new(),
        reports: [followed(&slices[0], 0, 0.0, false)].into(),
    };
    let row = tenant_page(&state, &soft, &sweep, &TenantScope::All).expect("found");
    let usage = row.usage.clone().expect("reported");
    assert_eq!(usage.sm_cap_permille, 0);
    let mut json = serde_json::to_value(&usage).expect("json");
    for field in [
        "sm_cap_permille",
        "progress_per_s",
        "progress_hinted",
        "progress_alone_per_s",
        "side_by_side",
    ] {
        json.as_object_mut().expect("an object").remove(field);
    }
    let read: UsageView = serde_json::from_value(json).expect("old views read");
    assert_eq!(read, usage);
}
