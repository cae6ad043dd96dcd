//! Issue 22, round two, the degraded items with real processes under mTLS:
//!
//! - `/metrics` names every owner's tenants and nodes, so it needs a certificate of role
//!   `metrics`, `member` or `admin`; tenants, agents and callers without a certificate are
//!   refused, and `/healthz` (no certificate, no names) answers every one.
//! - A watch stream opened before its certificate was revoked is closed, at every member, with
//!   the reason, once the revocation is applied there.
//! - `bootstrap` on the data directory of a member that joined another cluster is refused with
//!   what to do, and that member still restarts in join mode.
//! - Half-open requests without a certificate cannot make a member hold much memory: a flood
//!   of them costs the member's resident memory a bounded amount, measured.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use api::tls::{TlsFiles, Transport};
use tests::{Cluster, binary, get_as, get_through, wait_for};

#[test]
fn metrics_need_a_metrics_member_or_admin_certificate() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    cluster.start_agent("node-secret", "1xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let address = cluster.members[0].address.clone();
    let scraper = pki.issue("metrics", "prometheus", &[])?;
    let alice = pki.issue("tenant:alice", "alice", &[])?;
    let agent = pki.issue("agent", "node-secret", &[])?;
    let member = pki.issue("member", "9", &["127.0.0.1"])?;

    for (who, flags) in [
        ("a metrics certificate", &scraper),
        ("an admin", &pki.admin),
        ("a member", &member),
    ] {
        let (status, body) = get_as(flags, &address, "/metrics")?;
        ensure!(
            status == 200 && body.contains("vgpu_pool_gpus") && body.contains("node-secret"),
            "{who}: {status} {body}"
        );
        ensure!(body.contains("vgpu_member_up 1"), "{who}: {body}");
    }
    for (who, flags) in [("a tenant", &alice), ("an agent", &agent)] {
        let (status, body) = get_as(flags, &address, "/metrics")?;
        ensure!(
            status == 403
                && body.contains("[VGPU-PERMISSION-DENIED]")
                && body.contains("--role metrics")
                && !body.contains("vgpu_pool"),
            "{who}: {status} {body}"
        );
    }
    // TLS that authenticates the server only, as a scraper without a certificate would.
    let anonymous = || api::tls::pinned_endpoint(&address, &pki.ca_cert_hash);
    let (status, body) = get_through(anonymous()?, "/metrics")?;
    ensure!(
        status == 401 && body.contains("[VGPU-UNAUTHENTICATED]") && !body.contains("node-secret"),
        "{status} {body}"
    );
    let (status, body) = get_through(anonymous()?, "/healthz")?;
    ensure!((status, body.as_str()) == (200, "ok\n"), "{status} {body}");

    // The metrics role allows nothing else of the API but the cluster's status.
    let listed = cluster.vgpuctl_as(&scraper, &["get", "tenants"])?;
    let refusal = String::from_utf8_lossy(&listed.stderr);
    ensure!(
        !listed.status.success() && refusal.contains("VGPU-PERMISSION-DENIED"),
        "a metrics certificate listed tenants: {refusal}"
    );
    let status = cluster.vgpuctl_as(&scraper, &["cluster", "status"])?;
    ensure!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );

    // A revoked scraper is refused like any revoked certificate.
    let revoked = Command::new(binary("vgpu-cp"))
        .args([
            "cert",
            "revoke",
            "--file",
            &scraper[3],
            "--endpoint",
            &address,
        ])
        .args(["--ca-cert", &pki.admin[1], "--cert", &pki.admin[3]])
        .args(["--key", &pki.admin[5]])
        .output()?;
    ensure!(
        revoked.status.success(),
        "{}",
        String::from_utf8_lossy(&revoked.stderr)
    );
    let (status, body) = get_as(&scraper, &address, "/metrics")?;
    ensure!(
        status == 403 && body.contains("was revoked"),
        "{status} {body}"
    );
    Ok(())
}

/// Reads the next message of `stream`, within what is left of `deadline`.
async fn next(
    stream: &mut tonic::Streaming<api::v1::Assignments>,
    deadline: tokio::time::Instant,
) -> Result<Result<Option<api::v1::Assignments>, tonic::Status>> {
    match tokio::time::timeout_at(deadline, stream.message()).await {
        Ok(message) => Ok(message),
        Err(_) => bail!("no message and no end of the stream in time"),
    }
}

#[test]
fn a_watch_stream_is_closed_when_its_certificate_is_revoked() -> Result<()> {
    let mut cluster = Cluster::start_secure(3, &tests::FAST_FLAGS)?;
    cluster.start_agent("node-a", "1xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let state_dir = cluster.agent("node-a").state_dir.clone();
    let tls = state_dir.join("tls");
    let files = TlsFiles {
        ca_cert: tls.join("ca.crt"),
        cert: tls.join("agent.crt"),
        key: tls.join("agent.key"),
    };
    let transport = Transport::choose(false, Some(&files), "")?;
    // The agent's node key holds the name; a stream for it must carry the key.
    let key = std::fs::read_to_string(state_dir.join("node-key"))?
        .trim()
        .to_owned();
    let pki = cluster.pki.as_ref().context("secure")?;
    let admin = pki.admin.clone();
    let first = cluster.members[0].address.clone();
    let addresses: Vec<String> = cluster.members.iter().map(|m| m.address.clone()).collect();

    let runtime = tokio::runtime::Runtime::new()?;
    let elapsed = runtime.block_on(async {
        // One stream at every member, each opened and answered before the revocation.
        let mut streams = Vec::new();
        for address in &addresses {
            let channel = transport.endpoint(address)?.connect().await?;
            let mut client = api::v1::agent_client::AgentClient::new(channel);
            let mut request = tonic::Request::new(api::v1::WatchAssignmentsRequest {
                node: "node-a".to_owned(),
            });
            request
                .metadata_mut()
                .insert(api::metadata::NODE_KEY, key.parse()?);
            let mut stream = client.watch_assignments(request).await?.into_inner();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let message = next(&mut stream, deadline).await??;
            ensure!(message.is_some(), "{address}: the stream ended at once");
            streams.push((address.clone(), stream));
        }

        let revoke = Command::new(binary("vgpu-cp"))
            .args(["cert", "revoke", "--file"])
            .arg(&files.cert)
            .args(["--endpoint", &first])
            .args([
                "--ca-cert",
                &admin[1],
                "--cert",
                &admin[3],
                "--key",
                &admin[5],
            ])
            .output()?;
        ensure!(
            revoke.status.success(),
            "{}",
            String::from_utf8_lossy(&revoke.stderr)
        );
        // The revocation is committed: every member applies it within a heartbeat or two. The
        // bound here is generous for a loaded machine; the measured times go to the report.
        let revoked_at = Instant::now();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut elapsed = Vec::new();
        for (address, stream) in &mut streams {
            loop {
                match next(stream, deadline)
                    .await
                    .with_context(|| format!("{address}: the stream stayed open"))?
                {
                    // An update that was already on its way.
                    Ok(Some(_)) => continue,
                    Ok(None) => bail!("{address}: the stream ended without a reason"),
                    Err(status) => {
                        ensure!(
                            status.code() == tonic::Code::PermissionDenied
                                && status.message().contains("was revoked")
                                && status.message().contains("stream is closed"),
                            "{address}: {status:?}"
                        );
                        elapsed.push(revoked_at.elapsed());
                        break;
                    }
                }
            }
        }
        anyhow::Ok(elapsed)
    })?;
    eprintln!("streams closed after the revocation returned: {elapsed:?}");
    Ok(())
}

#[test]
fn bootstrap_refuses_the_data_directory_of_a_member_that_joined() -> Result<()> {
    let mut cluster = Cluster::start(2, &[])?;
    let data_dir = cluster.members[1].data_dir.clone();
    cluster.member(2).kill();
    let address = format!("127.0.0.1:{}", tests::free_port());
    let output = Command::new(binary("vgpu-cp"))
        .args(["bootstrap", "--id", "2", "--insecure", "--listen", &address])
        .arg("--data-dir")
        .arg(&data_dir)
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success()
            && stderr.contains("joined that cluster")
            && stderr.contains("vgpu-cp join --peer")
            && stderr.contains("empty --data-dir"),
        "{}: {stderr}",
        output.status
    );
    // The member itself restarts as what it is.
    cluster.member(2).start()?;
    wait_for("member 2 to answer again", Duration::from_secs(30), || {
        let output = tests::vgpuctl(&cluster.members[1].address, &["cluster", "status"]).ok()?;
        output.status.success().then_some(())
    })
    .with_context(|| cluster.logs())?;
    Ok(())
}

/// The member's resident memory in KiB (`VmRSS` of /proc/PID/status).
fn resident_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/PID/status")
}

/// Issue 22: half-open requests without a client certificate grew a member to 1.93 GB, kept
/// after the attacker left. Here 16 connections that show no certificate each open 32 calls of
/// `Pool.Place`, announce a 4 MiB message and send 1 MiB of it, then hold the connections open:
/// 512 MiB offered. A connection without a certificate has at most 4 requests in flight (the
/// others are answered at once) and a body of at most 64 KiB, so the member's resident memory
/// grows by a small part of that; without those bounds it buffered all of it until the request
/// timeout (a minute). The growth while the attacker holds on and after it left is printed
/// (docs/robustness.md records it).
#[test]
fn half_open_requests_without_a_certificate_cost_little_memory() -> Result<()> {
    use tonic::codegen::{Bytes, Service as _, http};
    const CONNECTIONS: usize = 16;
    const STREAMS: usize = 32;
    const SENT: usize = 1 << 20;
    let cluster = Cluster::start_secure(1, &[])?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let address = cluster.members[0].address.clone();
    let pid = cluster.members[0]
        .process
        .as_ref()
        .and_then(|process| process.id())
        .context("the member runs")?;
    let before = resident_kib(pid)?;
    let started = Instant::now();
    let runtime = tokio::runtime::Runtime::new()?;
    let body = {
        // The gRPC prefix announces 4 MiB (uncompressed); 1 MiB of it follows.
        let mut data = vec![0, 0x00, 0x40, 0x00, 0x00];
        data.extend(std::iter::repeat_n(0x0a, SENT));
        Bytes::from(data)
    };
    let (held, answered, refused) = runtime.block_on(async {
        let mut channels = Vec::new();
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..CONNECTIONS {
            let channel = api::tls::pinned_endpoint(&address, &pki.ca_cert_hash)?
                .connect()
                .await?;
            for _ in 0..STREAMS {
                // A body that never ends: its sender stays with the call.
                let (mut sender, half_open) =
                    http_body_util::Channel::<Bytes, std::io::Error>::new(1);
                sender.send_data(body.clone()).await?;
                let request = http::Request::post("/vgpu.v1.Pool/Place")
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(tonic::body::Body::new(half_open))?;
                let mut channel = channel.clone();
                calls.spawn(async move {
                    let _sender = sender;
                    std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
                    let response = channel.call(request).await?;
                    let message = response
                        .headers()
                        .get("grpc-message")
                        .and_then(|value| value.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    anyhow::Ok(message)
                });
            }
            channels.push(channel);
        }
        // Every call is answered long before the request timeout (a minute): most are refused
        // at once, the others when their body passes its bound.
        let (mut answered, mut refused) = (0, 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while let Ok(Some(call)) = tokio::time::timeout_at(deadline, calls.join_next()).await {
            if let Ok(Ok(message)) = call {
                answered += 1;
                refused += usize::from(message.contains("requests%20in%20flight"));
            }
        }
        eprintln!(
            "half-open flood: every call answered after {:?}",
            started.elapsed()
        );
        // The attacker holds on while the member's memory is read.
        let mut held = 0u64;
        for _ in 0..10 {
            held = held.max(resident_kib(pid)?);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(channels);
        anyhow::Ok((held, answered, refused))
    })?;
    let calls = CONNECTIONS * STREAMS;
    let offered_mib = (calls * SENT) >> 20;
    let grown_mib = held.saturating_sub(before) / 1024;
    // Read once the connections closed; printed, not asserted (the allocator decides when freed
    // pages go back to the system).
    let after = wait_for("the member to read again", Duration::from_secs(5), || {
        resident_kib(pid).ok()
    })?;
    eprintln!(
        "half-open flood: {offered_mib} MiB offered on {CONNECTIONS} connections; member resident {} MiB before, {} MiB while held ({grown_mib} MiB more), {} MiB after the attacker left; {answered} of {calls} calls answered, {refused} refused at once",
        before / 1024,
        held / 1024,
        after / 1024
    );
    ensure!(
        answered == calls,
        "{answered} of {calls} half-open calls answered within 30 s"
    );
    // How many are refused depends on how fast the admitted ones are cut (each frees its
    // place), so only that some were.
    ensure!(
        refused > 0,
        "none of {calls} refused for too many requests in flight"
    );
    // The bound: a small part of what was offered. Without the per-connection bounds the
    // member held all of it.
    ensure!(
        grown_mib * 4 < offered_mib as u64,
        "the member grew by {grown_mib} MiB under {offered_mib} MiB of half-open requests"
    );
    Ok(())
}
