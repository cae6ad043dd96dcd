//! The pool dashboard of a live pool (issue 21): three members, two agents with simulated GPUs
//! and labels, placed and pending tenants; a follower serves `/ui/` and its JSON views, with the
//! leader's heartbeat times, paged and filtered.

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use std::time::Duration;
use tests::{Cluster, wait_for};

/// A plain HTTP/1.1 GET: the status code and the body.
fn get(address: &str, path: &str) -> Result<(u16, String)> {
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
    Ok((status, body.to_owned()))
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
    let page = tests::http_get(&follower, "/ui/")?;
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
    let (status, body) = get(&follower, "/ui/api/pool?limit=0")?;
    ensure!(status == 400 && body.contains("limit"), "{status} {body}");
    Ok(())
}
