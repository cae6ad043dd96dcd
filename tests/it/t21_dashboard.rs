//! The pool dashboard of a live pool (issue 21): three members, two agents with simulated GPUs
//! and labels, placed and pending tenants; a follower serves `/ui/` and its JSON views, with the
//! leader's heartbeat times, paged and filtered. Under mTLS the views follow the API's roles.

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use std::time::Duration;
use tests::{Cluster, get_as, wait_for};

/// A plain HTTP/1.1 GET: the status code, the head (lower case) and the body.
fn get(address: &str, path: &str) -> Result<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let Some((head, body)) = response.split_once("\r\n\r\n") else {
        bail!("malformed HTTP response: {response}")
    };
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {head}"))?;
    Ok((status, head.to_ascii_lowercase(), body.to_owned()))
}

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
    cluster.start_agent_with("node-a", "2xH100-80GB", &["--labels", "zone=a"])?;
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
    let (status, head, page) = get(&follower, "/ui/")?;
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

    // The cluster: members, the leader, agents heard from.
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

    // A malformed query is refused with a reason.
    let (status, _, body) = get(&follower, "/ui/api/pool?limit=0")?;
    ensure!(status == 400 && body.contains("limit"), "{status} {body}");
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
