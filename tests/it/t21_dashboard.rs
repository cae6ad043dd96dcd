//! The pool dashboard of a live pool (issue 21): three members, two agents with simulated GPUs
//! and labels, placed and pending tenants, one of them using memory; a follower serves `/ui/`
//! and its JSON views, with the leader's heartbeat times and usage history, paged and
//! filtered, and headless Chromium draws its pages (DOM checked, screenshots kept under
//! `target/artefacts/`). Under mTLS the views follow the API's roles. At 1,000 simulated
//! nodes the pool page stays small and quick.

mod browser;

use anyhow::{Context, Result, bail, ensure};
use browser::{Browser, count};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};
use tests::{Cluster, Process, binary, get_as, wait_for};

const GIB: u64 = 1 << 30;

fn get_json(address: &str, path: &str) -> Result<Value> {
    let body = tests::http_get(address, path)?;
    serde_json::from_str(&body).with_context(|| format!("GET {path}: not JSON: {body}"))
}

fn place(cluster: &Cluster, args: &[&str]) -> Result<()> {
    let output = cluster.vgpuctl(&[&["place"], args].concat())?;
    ensure!(
        output.status.success(),
        "place {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

#[test]
fn a_follower_serves_the_dashboard_and_its_json_views() -> Result<()> {
    let mut cluster = Cluster::start(3, &tests::FAST_FLAGS)?;
    let shm_dir = cluster.dir.path().join("shm");
    let shm = shm_dir.to_str().context("a UTF-8 path")?.to_owned();
    cluster.start_agent_with(
        "node-a",
        "2xH100-80GB",
        &["--labels", "zone=a", "--shm-dir", &shm],
    )?;
    cluster.start_agent_with("node-b", "1xA100-40GB", &["--labels", "zone=b"])?;
    cluster.wait_nodes_ready(2)?;
    place(&cluster, &["train", "--gpus", "2"])?;
    place(&cluster, &["infer", "--gpus", "0.25"])?;
    // Neither node has two free GPUs left: it waits.
    place(&cluster, &["wait", "--gpus", "2"])?;
    let leader = cluster.leader()?;
    let follower = cluster
        .members
        .iter()
        .find(|m| m.id != leader)
        .context("a follower")?
        .address
        .clone();

    // The page and its assets, with nothing from elsewhere.
    let (status, head, page) = tests::http_request(&follower, "/ui/")?;
    ensure!(
        status == 200 && head.contains("content-security-policy: default-src 'self'"),
        "{status} {head}"
    );
    ensure!(
        page.contains("<script src=\"app.js\">") && page.contains("app.css"),
        "{page}"
    );
    let script = tests::http_get(&follower, "/ui/app.js")?;
    ensure!(script.contains("api/${view}"), "the script polls the views");
    tests::http_get(&follower, "/ui/app.css")?;

    // The pool: tiles with segments, and the leader's heartbeat times through the follower.
    let pool = wait_for("the pool view", Duration::from_secs(20), || {
        let pool = get_json(&follower, "/ui/api/pool").ok()?;
        let nodes = pool["nodes"].as_array()?;
        let heard = nodes
            .iter()
            .all(|node| node["last_heartbeat_unix_ms"].as_i64() > Some(0));
        (nodes.len() == 2 && heard && pool["overview"]["tenants_placed"] == 2).then_some(pool)
    })
    .with_context(|| cluster.logs())?;
    let overview = &pool["overview"];
    ensure!(
        overview["gpus"] == 3 && overview["nodes"] == 2,
        "{overview}"
    );
    ensure!(
        overview["gpus_by_model"].as_object().map(|m| m.len()) == Some(2),
        "{overview}"
    );
    ensure!(overview["tenants_pending"] == 1, "{overview}");
    let node_a = &pool["nodes"][0];
    ensure!(
        node_a["name"] == "node-a" && node_a["labels"]["zone"] == "a",
        "{node_a}"
    );
    for gpu in node_a["gpus"].as_array().context("GPUs")? {
        ensure!(gpu["compute_allocated_percent"] == 100, "{gpu}");
        ensure!(gpu["segments"][0]["tenant"] == "train", "{gpu}");
    }
    ensure!(
        pool["nodes"][1]["gpus"][0]["segments"][0]["tenant"] == "infer",
        "{pool}"
    );

    // Filters before paging, and pages that follow tokens.
    let zone_b = get_json(&follower, "/ui/api/pool?label=zone%3Db")?;
    ensure!(
        zone_b["nodes_matched"] == 1 && zone_b["nodes"][0]["name"] == "node-b",
        "{zone_b}"
    );
    let first = get_json(&follower, "/ui/api/pool?limit=1")?;
    ensure!(first["next_page_token"] == "node-a", "{first}");
    let second = get_json(&follower, "/ui/api/pool?limit=1&page_token=node-a")?;
    ensure!(
        second["nodes"][0]["name"] == "node-b" && second["next_page_token"] == "",
        "{second}"
    );

    // Tenants: states, placement, why one waits.
    let tenants = get_json(&follower, "/ui/api/tenants")?;
    ensure!(
        tenants["counts"]["placed"] == 2 && tenants["counts"]["pending"] == 1,
        "{tenants}"
    );
    let rows = tenants["tenants"].as_array().context("rows")?;
    let names: Vec<&str> = rows.iter().filter_map(|row| row["name"].as_str()).collect();
    ensure!(names == ["infer", "train", "wait"], "{names:?}");
    let waiting = &rows[2];
    ensure!(
        waiting["state"] == "pending" && waiting["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{waiting}"
    );
    ensure!(
        rows[1]["placement"].as_array().map(Vec::len) == Some(2),
        "{}",
        rows[1]
    );
    let pending = get_json(&follower, "/ui/api/tenants?state=pending")?;
    ensure!(
        pending["tenants"].as_array().map(Vec::len) == Some(1),
        "{pending}"
    );

    // One tenant: its whole history, and its usage over time from the leader's samples (a
    // tenant process charges 3 GiB, through the interposer's protocol code, as in t60).
    charge_memory(&shm_dir, "train", 3 * GIB)?;
    let train = wait_for("train's usage history", Duration::from_secs(20), || {
        let page = get_json(&follower, "/ui/api/tenant?name=train").ok()?;
        let samples = page["usage_history"]["samples"].as_array()?;
        let last = samples.last()?;
        (last["memory_used_bytes"] == 3 * GIB).then_some(page)
    })
    .with_context(|| cluster.logs())?;
    ensure!(
        train["tenant"]["state"] == "placed"
            && train["tenant"]["history"]
                .as_array()
                .is_some_and(|h| !h.is_empty())
            && train["usage_history"]["window_ms"] == 3_600_000,
        "{train}"
    );
    let (status, _, body) = tests::http_request(&follower, "/ui/api/tenant?name=nobody")?;
    ensure!(status == 404 && body.contains("nobody"), "{status} {body}");

    // The cluster: members, the leader, agents heard from, the elections this member saw.
    let view = wait_for("the cluster view", Duration::from_secs(20), || {
        let view = get_json(&follower, "/ui/api/cluster").ok()?;
        (view["agents"]["heartbeat_age"]["<5s"] == 2).then_some(view)
    })
    .with_context(|| cluster.logs())?;
    ensure!(view["leader"] == leader, "{view}");
    ensure!(
        view["members"].as_array().map(Vec::len) == Some(3),
        "{view}"
    );
    ensure!(view["last_log_index"].as_u64() > Some(0), "{view}");
    let newest = &view["elections"][0];
    ensure!(
        newest["term"] == view["term"] && newest["leader"] == leader,
        "{view}"
    );

    // A malformed query is refused with a reason.
    let (status, _, body) = tests::http_request(&follower, "/ui/api/pool?limit=0")?;
    ensure!(status == 400 && body.contains("limit"), "{status} {body}");

    browser_draws_the_pages(&follower, leader)
}

/// A tenant process's memory charge on its device 0, written where the agent reads it.
fn charge_memory(shm_dir: &std::path::Path, tenant: &str, bytes: u64) -> Result<()> {
    let private = shm_dir.join("tenants").join(tenant);
    wait_for(
        "the agent to make the tenant's directory",
        Duration::from_secs(20),
        || private.is_dir().then_some(()),
    )?;
    let mut limits = [None; tenant_abi::DEVICES_MAX];
    limits[0] = Some(10 * GIB);
    let ledger =
        tenant_abi::writer::ledger(&tenant_abi::layout::ledger_path(&private, tenant), &limits)?;
    let start_time = tenant_abi::ledger::own_start_time();
    tenant_abi::writer::charge_memory(&ledger, std::process::id(), start_time, 0, bytes)
        .map_err(anyhow::Error::msg)
}

/// Headless Chromium loads the pool, tenants, one tenant's and cluster pages from `address`
/// (all four at once); each DOM shows what the JSON views hold.
fn browser_draws_the_pages(address: &str, leader: u64) -> Result<()> {
    let Some(browser) = Browser::find("t21_dashboard")? else {
        return Ok(());
    };
    let pages = [
        ("pool", ""),
        ("tenants", "#tenants"),
        ("tenant", "#tenant/train"),
        ("cluster", "#cluster"),
    ];
    let loading: Vec<_> = pages
        .iter()
        .map(|(name, fragment)| browser.start(&format!("http://{address}/ui/{fragment}"), name))
        .collect::<Result<_>>()?;
    let mut rendered = Vec::new();
    for ((name, _), loading) in pages.iter().zip(loading) {
        let page = loading.finish()?;
        let dom = &page.dom;
        // Drawn from a successful answer, and the view the fragment named.
        ensure!(
            dom.contains(&format!("data-drawn=\"{name}\"")) && !dom.contains("class=\"error\""),
            "{name} was not drawn ({}):\n{dom}",
            page.screenshot.display()
        );
        rendered.push(page);
    }
    let [pool, tenants, tenant, cluster] = &rendered[..] else {
        bail!("four pages")
    };
    // The pool: both nodes as tiles, three GPUs, tenants as segments, the overview.
    ensure!(
        count(&pool.dom, "class=\"node ready\"") == 2 && count(&pool.dom, "data-gpu=") == 3,
        "{}",
        pool.dom
    );
    ensure!(
        count(&pool.dom, "class=\"seg\"") == 3 && pool.dom.contains("title=\"infer: 25%"),
        "{}",
        pool.dom
    );
    ensure!(pool.dom.contains("<b class=\"\">3</b>GPUs"), "{}", pool.dom);
    // Tenants: a row each, the waiting one with its reason, links to their pages.
    ensure!(
        count(&tenants.dom, "<tr data-tenant=") == 3
            && tenants.dom.contains("href=\"#tenant/train\"")
            && tenants.dom.contains("<td class=\"pending\">pending</td>"),
        "{}",
        tenants.dom
    );
    // One tenant: its facts, the plot of its memory, its events.
    ensure!(
        tenant.dom.contains("<h2 id=\"tenant-name\">train</h2>")
            && tenant.dom.contains("<svg id=\"usage-plot\"")
            && tenant.dom.contains("data-series=\"memory\"")
            && tenant.dom.contains("peak 3.0 GiB"),
        "{}",
        tenant.dom
    );
    ensure!(count(&tenant.dom, "<td>placed</td>") >= 1, "{}", tenant.dom);
    // The cluster: three members, the leader, the elections.
    ensure!(
        count(&cluster.dom, "<td>voter</td>") + count(&cluster.dom, "<td>leader</td>") == 3
            && cluster
                .dom
                .contains(&format!("<b class=\"\">{leader}</b>leader"))
            && cluster.dom.contains("<tr data-term="),
        "{}",
        cluster.dom
    );
    for page in &rendered {
        eprintln!(
            "t21: {} drawn in {:?} (browser start included)",
            page.screenshot.display(),
            page.wall
        );
    }
    Ok(())
}

#[test]
fn under_mtls_the_views_follow_the_roles_of_the_api() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    cluster.start_agent("node-a", "1xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let alice = pki.issue("tenant:alice", "alice", &[])?;
    let bob = pki.issue("tenant:bob", "bob", &[])?;
    let as_user = |flags: &[String], args: &[&str]| cluster.vgpuctl_as(flags, args);
    for (flags, name) in [(&alice, "a1"), (&bob, "b1")] {
        let placed = as_user(flags, &["place", name, "--gpus", "0.25"])?;
        ensure!(
            placed.status.success(),
            "{}",
            String::from_utf8_lossy(&placed.stderr)
        );
    }
    let address = cluster.members[0].address.clone();
    let admin = &pki.admin;

    // Admins see everything.
    let (status, body) = get_as(admin, &address, "/ui/api/pool")?;
    ensure!(status == 200, "{status} {body}");
    let (status, body) = get_as(admin, &address, "/ui/api/tenants")?;
    ensure!(
        status == 200 && body.contains("a1") && body.contains("b1"),
        "{body}"
    );
    let cluster_view: Value = serde_json::from_str(&get_as(admin, &address, "/ui/api/cluster")?.1)?;
    ensure!(cluster_view["agents"].is_object(), "{cluster_view}");

    // A tenant certificate: no pool (as `ListNodes`), its own tenants, the cluster without agents.
    let (status, body) = get_as(&alice, &address, "/ui/api/pool")?;
    ensure!(status == 403 && body.contains("alice"), "{status} {body}");
    let (status, body) = get_as(&alice, &address, "/ui/api/tenants")?;
    let view: Value = serde_json::from_str(&body)?;
    let names: Vec<&str> = view["tenants"]
        .as_array()
        .context("rows")?
        .iter()
        .filter_map(|row| row["name"].as_str())
        .collect();
    ensure!(status == 200 && names == ["a1"], "{status} {body}");
    // One tenant's page as `GetTenant`: its own, not another owner's.
    let (status, body) = get_as(&alice, &address, "/ui/api/tenant?name=a1")?;
    ensure!(
        status == 200 && body.contains("usage_history"),
        "{status} {body}"
    );
    let (status, body) = get_as(&alice, &address, "/ui/api/tenant?name=b1")?;
    ensure!(status == 403 && body.contains("b1"), "{status} {body}");
    let (status, body) = get_as(&alice, &address, "/ui/api/cluster")?;
    let view: Value = serde_json::from_str(&body)?;
    ensure!(
        status == 200 && view["agents"].is_null() && view["leader"] == 1,
        "{body}"
    );

    // The page itself holds no data: served to any certificate.
    let (status, page) = get_as(&bob, &address, "/ui/")?;
    ensure!(status == 200 && page.contains("app.js"), "{status} {page}");
    Ok(())
}

/// Simulated nodes of the responsiveness test.
const FLEET_NODES: usize = 1_000;
/// Requests timed per view.
const TIMED_REQUESTS: usize = 10;

/// Times `TIMED_REQUESTS` GETs of `path`: the body's size, the median and the slowest.
fn timed_get(address: &str, path: &str) -> Result<(usize, Duration, Duration)> {
    let mut times = Vec::with_capacity(TIMED_REQUESTS);
    let mut bytes = 0;
    for _ in 0..TIMED_REQUESTS {
        let started = Instant::now();
        let (status, _, body) = tests::http_request(address, path)?;
        times.push(started.elapsed());
        ensure!(status == 200, "GET {path}: {status} {body}");
        bytes = body.len();
    }
    times.sort();
    Ok((bytes, times[TIMED_REQUESTS / 2], times[TIMED_REQUESTS - 1]))
}

/// 1,000 simulated nodes of 8 GPUs and 100 tenants on three members: each view a browser polls
/// is bounded in size (a page of nodes, aggregates of the rest) and answered quickly by the
/// leader and by a follower (which fetches the leader's soft state at most once a second), and
/// Chromium draws the pool page. The numbers are printed (docs/benchmarks.md has a run) and the
/// bounds are loose enough for a busy 2-core CI machine.
#[test]
fn at_a_thousand_simulated_nodes_the_pool_page_stays_small_and_quick() -> Result<()> {
    let started = Instant::now();
    let cluster = Cluster::start(3, &[])?;
    let leader = cluster.leader()?;
    let address_of = |leading: bool| {
        cluster
            .members
            .iter()
            .find(|m| (m.id == leader) == leading)
            .map(|m| m.address.clone())
            .context("a member")
    };
    let (address, follower) = (address_of(true)?, address_of(false)?);
    let mut command = Command::new(binary("vgpu-agent"));
    command
        .arg("simulate-fleet")
        .args(["--control-plane", &cluster.endpoints()])
        .args(["--count", &FLEET_NODES.to_string(), "--spec", "8xH100-80GB"])
        .args(["--nodes-per-connection", "50", "--name-prefix", "sim"])
        .args(["--duration", "300", "--insecure"]);
    let fleet = Process::spawn(command, cluster.dir.path().join("fleet.log"))?;
    let members_up = started.elapsed();
    let registered = format!("all {FLEET_NODES} nodes registered");
    wait_for(
        "the fleet's registrations",
        Duration::from_secs(120),
        || fleet.log_text().contains(&registered).then_some(()),
    )?;
    let all_registered = started.elapsed();
    // Registered and heard from: the cluster view counts heartbeats younger than 5 s.
    wait_for("the fleet's heartbeats", Duration::from_secs(60), || {
        let view = get_json(&address, "/ui/api/cluster").ok()?;
        (view["agents"]["heartbeat_age"]["<5s"] == FLEET_NODES).then_some(())
    })
    .with_context(|| fleet.log_text())?;
    let heard = started.elapsed();
    for tenant in 0..100 {
        let gpus = if tenant % 4 == 0 { "1" } else { "0.5" };
        place(&cluster, &[&format!("job-{tenant:03}"), "--gpus", gpus])?;
    }

    let mut lines = vec![format!(
        "members up {members_up:?} after the start, all registered at {all_registered:?}, all heard from within 5 s at {heard:?}, 100 tenants placed at {:?}",
        started.elapsed()
    )];
    for (path, bytes_max) in [
        ("/ui/", 8 << 10),
        ("/ui/app.js", 32 << 10),
        ("/ui/api/pool", 256 << 10),
        ("/ui/api/pool?limit=200", 1 << 20),
        ("/ui/api/tenants", 256 << 10),
        ("/ui/api/cluster", 16 << 10),
    ] {
        for (member, at) in [("leader", &address), ("follower", &follower)] {
            let (bytes, median, slowest) = timed_get(at, path)?;
            lines.push(format!(
                "GET {path} from the {member}: {bytes} bytes, median {median:?}, slowest {slowest:?}"
            ));
            ensure!(bytes <= bytes_max, "{path}: {bytes} bytes");
            ensure!(median < Duration::from_secs(1), "{path}: median {median:?}");
        }
    }
    let pool = get_json(&address, "/ui/api/pool")?;
    ensure!(
        pool["overview"]["nodes"] == FLEET_NODES
            && pool["overview"]["gpus"] == 8 * FLEET_NODES
            && pool["overview"]["tenants_placed"] == 100
            && pool["nodes"].as_array().map(Vec::len) == Some(50)
            && pool["next_page_token"] == "sim-00049",
        "{}",
        pool["overview"]
    );

    if let Some(browser) = Browser::find("t21_dashboard")? {
        // The browser's own start and exit, for comparison.
        let blank = browser.render("about:blank", "blank")?;
        lines.push(format!("Chromium: about:blank in {:?}", blank.wall));
        let page = browser.render(&format!("http://{address}/ui/"), "pool-1000-nodes")?;
        ensure!(
            page.dom.contains("data-drawn=\"pool\"")
                && count(&page.dom, "class=\"node ready\"") == 50
                && page.dom.contains("<b class=\"\">1000</b>nodes"),
            "{}",
            page.dom
        );
        lines.push(format!(
            "Chromium: /ui/ loaded and drawn in {:?} (browser start included), {}",
            page.wall,
            page.screenshot.display()
        ));
        ensure!(page.wall < Duration::from_secs(30), "{:?}", page.wall);
    }
    lines.push(format!("the whole test: {:?}", started.elapsed()));
    for line in &lines {
        eprintln!("t21 at {FLEET_NODES} nodes: {line}");
    }
    Ok(())
}
