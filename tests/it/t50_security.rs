//! Mutual TLS end to end: a cluster CA, members whose Raft traffic runs over mTLS, an agent that
//! joins with a bootstrap token, vgpuctl with an admin certificate; then the roles: every refusal
//! is PERMISSION_DENIED (or UNAUTHENTICATED) with a `[VGPU-...]` message and leaves the log as
//! it was.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use api::tls::{TlsFiles, Transport};
use tests::{Cluster, binary, json, wait_for};

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A transport with the certificate `flags` (as `Pki::issue` returns them).
fn transport(flags: &[String]) -> Result<Transport> {
    let files = TlsFiles {
        ca_cert: flags[1].clone().into(),
        cert: flags[3].clone().into(),
        key: flags[5].clone().into(),
    };
    Ok(Transport::choose(false, Some(&files), "")?)
}

fn last_applied(cluster: &Cluster) -> Result<u64> {
    cluster.status_json()?["last_applied"]
        .as_u64()
        .context("last_applied")
}

#[test]
fn a_cluster_runs_with_mutual_tls_and_an_agent_joins_with_a_token() -> Result<()> {
    let mut cluster = Cluster::start_secure(3, &[])?;
    cluster.start_agent("node-a", "4xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;

    // The agent kept the certificate it was given, its key private.
    let tls = cluster.agent("node-a").state_dir.join("tls");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(tls.join("agent.key"))?
        .permissions()
        .mode();
    ensure!(mode & 0o777 == 0o600, "agent key mode {mode:o}");
    let der = api::pki::first_certificate_der(&std::fs::read_to_string(tls.join("agent.crt"))?)?;
    let peer = api::tls::Peer::from_der(&der).map_err(anyhow::Error::msg)?;
    ensure!(
        peer.role == api::tls::Role::Agent && peer.name == "node-a",
        "{peer:?}"
    );

    let placed = cluster.vgpuctl(&["place", "infer-a", "--gpus", "0.5"])?;
    ensure!(placed.status.success(), "{}", stderr(&placed));
    let described = cluster.vgpuctl(&["describe", "tenant", "infer-a"])?;
    ensure!(described.status.success(), "{}", stderr(&described));
    ensure!(
        String::from_utf8_lossy(&described.stdout).contains("node-a"),
        "{described:?}"
    );

    // A restarted agent reconnects with its certificate; the token is not needed again.
    cluster.agent("node-a").security.clear();
    cluster.agent("node-a").process = None;
    cluster.restart_agent("node-a")?;
    let placed = cluster.vgpuctl(&["place", "infer-b", "--gpus", "0.25"])?;
    ensure!(placed.status.success(), "{}", stderr(&placed));
    let assignments = cluster.agent("node-a").state_dir.join("assignments.json");
    wait_for(
        "the restarted agent to see infer-b",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&assignments)
                .ok()
                .filter(|text| text.contains("infer-b"))
        },
    )
    .with_context(|| cluster.logs())?;

    // Without credentials vgpuctl refuses to start, and says what to do.
    let bare = Command::new(binary("vgpuctl"))
        .args(["--endpoints", &cluster.endpoints(), "get", "tenants"])
        .env_remove("VGPUCTL_INSECURE")
        .output()?;
    ensure!(bare.status.code() == Some(2), "{bare:?}");
    let text = stderr(&bare);
    ensure!(
        text.contains("--insecure") && text.contains("vgpu-cp cert issue"),
        "{text}"
    );
    // Plain text does not reach an mTLS member.
    let plain = tests::vgpuctl(&cluster.endpoints(), &["--timeout", "2s", "get", "tenants"])?;
    ensure!(!plain.status.success(), "{plain:?}");
    // A member refuses to start with neither certificates nor --insecure.
    let refused = Command::new(binary("vgpu-cp"))
        .args(["bootstrap", "--id", "9", "--listen", "127.0.0.1:1"])
        .arg("--data-dir")
        .arg(cluster.dir.path().join("refused"))
        .env_remove("VGPU_CP_INSECURE")
        .output()?;
    ensure!(!refused.status.success());
    ensure!(
        stderr(&refused).contains("--insecure") && stderr(&refused).contains("vgpu-cp ca init"),
        "{}",
        stderr(&refused)
    );
    Ok(())
}

#[test]
fn roles_limit_what_a_certificate_may_do_and_refusals_leave_no_trace() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    cluster.start_agent("node-a", "4xH100-80GB")?;
    cluster.wait_nodes_ready(1)?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let alice = pki.issue("tenant:alice", "alice", &[])?;
    let bob = pki.issue("tenant:bob", "bob", &[])?;
    let as_user = |flags: &[String], args: &[&str]| cluster.vgpuctl_as(flags, args);

    let placed = as_user(&alice, &["place", "a1", "--gpus", "0.25"])?;
    ensure!(placed.status.success(), "{}", stderr(&placed));
    let tenant = json(&as_user(&alice, &["get", "tenants", "a1", "-o", "json"])?)?;
    ensure!(tenant["state"] == "placed", "{tenant}");
    let admin_view = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    ensure!(
        admin_view.as_array().map(Vec::len) == Some(1),
        "{admin_view}"
    );

    let before = last_applied(&cluster)?;
    let denied = |output: std::process::Output, what: &str| -> Result<()> {
        ensure!(!output.status.success(), "{what} was allowed: {output:?}");
        let text = stderr(&output);
        ensure!(text.contains("VGPU-PERMISSION-DENIED"), "{what}: {text}");
        Ok(())
    };
    denied(as_user(&bob, &["get", "tenants", "a1"])?, "bob reading a1")?;
    denied(as_user(&bob, &["release", "a1"])?, "bob releasing a1")?;
    denied(
        as_user(&bob, &["set", "tenant", "a1", "--priority", "1"])?,
        "bob changing a1",
    )?;
    denied(
        as_user(&bob, &["place", "a1", "--gpus", "0.25"])?,
        "bob placing over a1",
    )?;
    denied(as_user(&alice, &["drain", "node-a"])?, "alice draining")?;
    denied(as_user(&alice, &["get", "nodes"])?, "alice listing nodes")?;
    let bobs = json(&as_user(&bob, &["get", "tenants", "-o", "json"])?)?;
    ensure!(
        bobs.as_array().is_some_and(Vec::is_empty),
        "bob sees {bobs}"
    );

    // Calls outside vgpuctl: an agent for another node, a tenant on the Raft and admin calls.
    let runtime = tokio::runtime::Runtime::new()?;
    let address = cluster.members[0].address.clone();
    let other_agent = transport(&pki.issue("agent", "node-x", &[])?)?;
    let tenant = transport(&alice)?;
    runtime.block_on(async {
        let channel = |transport: &Transport| -> Result<tonic::transport::Channel> {
            Ok(transport.endpoint(&address)?.connect_lazy())
        };
        let mut agent = api::v1::agent_client::AgentClient::new(channel(&other_agent)?);
        let status = agent
            .heartbeat(api::v1::HeartbeatRequest {
                node: "node-a".into(),
                ..Default::default()
            })
            .await
            .expect_err("an agent heartbeats only for its own node");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        ensure!(status.message().contains("own node"), "{status:?}");
        let status = agent
            .watch_assignments(api::v1::WatchAssignmentsRequest {
                node: "node-a".into(),
            })
            .await
            .expect_err("an agent watches only its own node");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        let status = agent
            .register(api::v1::RegisterRequest {
                node: Some(api::v1::Node {
                    name: "node-a".into(),
                    ..Default::default()
                }),
            })
            .await
            .expect_err("an agent registers only its own node");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        let mut pool = api::v1::pool_client::PoolClient::new(channel(&other_agent)?);
        let status = pool
            .list_tenants(api::v1::ListRequest::default())
            .await
            .expect_err("an agent has no tenants");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");

        let mut raft = api::v1::raft_client::RaftClient::new(channel(&tenant)?);
        let status = raft
            .append_entries(api::v1::RaftPayload::default())
            .await
            .expect_err("a tenant is no Raft peer");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        let mut cluster_client = api::v1::cluster_client::ClusterClient::new(channel(&tenant)?);
        let status = cluster_client
            .create_join_token(api::v1::CreateJoinTokenRequest { ttl_seconds: 60 })
            .await
            .expect_err("only admins create tokens");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        let status = cluster_client
            .add_member(api::v1::AddMemberRequest {
                id: 7,
                address: "127.0.0.1:9".into(),
            })
            .await
            .expect_err("a tenant adds no members");
        ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");
        anyhow::Ok(())
    })?;
    ensure!(
        last_applied(&cluster)? == before,
        "a refused request changed the log"
    );
    let admin_view = json(&cluster.vgpuctl(&["get", "tenants", "a1", "-o", "json"])?)?;
    ensure!(admin_view["state"] == "placed", "{admin_view}");

    // Alice may change and release her own tenant.
    let changed = as_user(&alice, &["set", "tenant", "a1", "--priority", "2"])?;
    ensure!(changed.status.success(), "{}", stderr(&changed));
    let released = as_user(&alice, &["release", "a1"])?;
    ensure!(released.status.success(), "{}", stderr(&released));
    Ok(())
}

#[test]
fn unknown_and_expired_tokens_are_refused() -> Result<()> {
    let cluster = Cluster::start_secure(1, &[])?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let address = cluster.members[0].address.clone();
    // The refusal, or `None` when the token was accepted.
    let join = |token: &str| -> Result<Option<tonic::Status>> {
        let runtime = tokio::runtime::Runtime::new()?;
        runtime.block_on(async {
            let endpoint = api::tls::pinned_endpoint(&address, &pki.ca_cert_hash)?;
            let mut agent = api::v1::agent_client::AgentClient::new(endpoint.connect().await?);
            let (csr_pem, _) = api::pki::new_csr("node-t")?;
            let answer = agent
                .join_node(api::v1::JoinNodeRequest {
                    token: token.to_owned(),
                    node: "node-t".into(),
                    csr_pem,
                })
                .await;
            anyhow::Ok(answer.err())
        })
    };
    let unknown = join("abcdef.0123456789abcdef")?.context("an unknown token is refused")?;
    ensure!(
        unknown.code() == tonic::Code::Unauthenticated,
        "{unknown:?}"
    );
    ensure!(
        unknown.message().starts_with("[VGPU-TOKEN-INVALID]")
            && unknown.message().contains("unknown"),
        "{unknown:?}"
    );

    let short = cluster.create_token("1s")?;
    let expired = wait_for("the token to expire", Duration::from_secs(10), || {
        let status = join(&short).ok()??;
        status.message().contains("expired").then_some(status)
    })?;
    ensure!(
        expired.code() == tonic::Code::Unauthenticated,
        "{expired:?}"
    );

    // The agent binary stops with the refusal instead of retrying.
    let state_dir = cluster.dir.path().join("agent-t");
    let output = Command::new(binary("vgpu-agent"))
        .args(["join", "--control-plane", &address, "--name", "node-t"])
        .args(["--simulate", "1xH100-80GB", "--token", &short])
        .args(["--ca-cert-hash", &pki.ca_cert_hash])
        .arg("--state-dir")
        .arg(&state_dir)
        .output()?;
    ensure!(!output.status.success(), "{output:?}");
    ensure!(stderr(&output).contains("expired"), "{}", stderr(&output));
    ensure!(!state_dir.join("tls/agent.crt").exists());
    Ok(())
}

#[test]
fn a_revoked_certificate_is_refused_by_every_member_and_after_a_restart() -> Result<()> {
    let mut cluster = Cluster::start_secure(3, &[])?;
    let pki = cluster.pki.as_ref().context("secure")?;
    let alice = pki.issue("tenant:alice", "alice", &[])?;
    let bob = pki.issue("tenant:bob", "bob", &[])?;
    let admin = pki.admin.clone();
    let as_user = |flags: &[String], endpoint: &str, args: &[&str]| {
        let mut all: Vec<&str> = flags.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        tests::vgpuctl(endpoint, &all)
    };
    let first = cluster.members[0].address.clone();
    let listed = as_user(&alice, &first, &["get", "tenants"])?;
    ensure!(listed.status.success(), "{}", stderr(&listed));

    // The revocation itself, as an operator runs it: the certificate file and an admin's.
    let revoke = |who: &[String], file: &str| -> Result<std::process::Output> {
        Ok(Command::new(binary("vgpu-cp"))
            .args(["cert", "revoke", "--file", file, "--endpoint", &first])
            .args(["--ca-cert", &who[1], "--cert", &who[3], "--key", &who[5]])
            .output()?)
    };
    // A tenant cannot revoke (not even another tenant's certificate).
    let refused = revoke(&alice, &bob[3])?;
    ensure!(!refused.status.success(), "a tenant revoked: {refused:?}");
    ensure!(
        stderr(&refused).contains("VGPU-PERMISSION-DENIED"),
        "{}",
        stderr(&refused)
    );
    let revoked = revoke(&admin, &alice[3])?;
    ensure!(revoked.status.success(), "{}", stderr(&revoked));
    let text = String::from_utf8_lossy(&revoked.stdout).into_owned();
    ensure!(text.contains("revoked; 1 revoked in all"), "{text}");
    let again = revoke(&admin, &alice[3])?;
    ensure!(
        String::from_utf8_lossy(&again.stdout).contains("was already revoked"),
        "{again:?}"
    );

    // Every member refuses alice now (followers apply the entry a moment later); bob is fine.
    let refused_everywhere = |cluster: &Cluster| -> Result<()> {
        for member in &cluster.members {
            wait_for(
                "a member to refuse the revoked certificate",
                Duration::from_secs(10),
                || {
                    let output = as_user(&alice, &member.address, &["get", "tenants"]).ok()?;
                    let text = stderr(&output);
                    (!output.status.success() && text.contains("was revoked")).then_some(())
                },
            )?;
        }
        Ok(())
    };
    refused_everywhere(&cluster)?;
    let listed = as_user(&bob, &first, &["get", "tenants"])?;
    ensure!(listed.status.success(), "{}", stderr(&listed));

    // A member that restarts rebuilds the list from its log and snapshot.
    cluster.member(2).kill();
    cluster.member(2).start()?;
    refused_everywhere(&cluster)?;
    Ok(())
}
