//! vgpu-cp on the etcd store (issue 20), as operators run it: three `vgpu-cp` processes started
//! with `--etcd-endpoints` against three real etcd members (`etcd_store::testing`), driven
//! through the normal gRPC API. Skipped without `etcd` unless `VGPU_ETCD_REQUIRED` is set.
//!
//! Checked: placements acknowledged before and during a `kill -9` of the leading member are all
//! there afterwards; another member takes the lead and runs the leader loop (heartbeats reach
//! it through the `leader` key's address, so the beating node stays ready, and the node that
//! stops beating is marked lost by it); the cluster status lists the members that are up (the
//! killed one drops out when its lease expires); a prefix of another cluster is refused. And
//! under etcd failures: placements go on through a `kill -9` of one etcd member; with two of
//! three killed a placement fails within its bounds with a message about etcd, and placements
//! resume once they return; every acknowledged placement is there. And a leader paused past its
//! lease (`kill -STOP`): the other member takes over and re-places the tenant of a silent node
//! once; when the paused one resumes it does not act as leader again, so the tenant moved once.
//! And clients placing, releasing and reading tenants through every member while the leader is
//! killed: the history is linearizable (`controlplane/linearizability`) and every acknowledged
//! placement is in the survivors' final states. And a pool moved from the Raft store to etcd and
//! back (`transfer`: `vgpu-cp export` and `import`) keeps its nodes, tenants, owners and cluster
//! id, and serves placements after each move.
//!
//! Every wait polls with a bound ([`WAIT`]); nothing sleeps to synchronise.

mod transfer;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::v1;
use etcd_store::testing::{EtcdCluster, free_ports};
use tonic::transport::Channel;

/// Bound on every wait, far above a failover (the leader's etcd lease is 2 s here).
const WAIT: Duration = Duration::from_secs(60);
/// How often the test's stand-in agents beat (the members are told to expect it).
const BEAT_EVERY: Duration = Duration::from_millis(200);
const PREFIX: &str = "/it-pool/";
/// A node silent this long is lost (members started by `Member::spawn`).
const NODE_LOST_TIMEOUT_MS: u64 = 1500;
/// The node-lost timeout of the paused-leader test: longer than a heartbeat batch that a
/// follower forwarded to the paused leader may hang before HTTP/2's keepalive gives up on it
/// (about 10 s), during which that follower's later beats wait behind it. Shorter, and the
/// member that takes over can mark a beating node lost because its beats were stuck.
const PAUSED_NODE_LOST_TIMEOUT_MS: u64 = 12_000;

/// One `vgpu-cp` process, killed (SIGKILL) when dropped.
struct Member {
    id: u64,
    address: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Member {
    fn spawn(id: u64, port: u16, mode: &[&str], etcd: &EtcdCluster, dir: &Path) -> Member {
        Member::spawn_with(id, port, mode, etcd, dir, NODE_LOST_TIMEOUT_MS)
    }

    /// `spawn` with another node-lost timeout.
    fn spawn_with(
        id: u64,
        port: u16,
        mode: &[&str],
        etcd: &EtcdCluster,
        dir: &Path,
        node_lost_timeout_ms: u64,
    ) -> Member {
        let address = format!("127.0.0.1:{port}");
        let log = dir.join(format!("member-{id}.log"));
        let data_dir = dir.join(format!("member-{id}"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_vgpu-cp"));
        command
            .args(mode)
            .args(["--id", &id.to_string(), "--listen", &address, "--insecure"])
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--etcd-endpoints", &etcd.endpoints().join(",")])
            .args(["--etcd-prefix", PREFIX])
            // A dead or paused leader is replaced within 2 s.
            .args(["--etcd-lease-ttl-s", "2"])
            .args(["--node-lost-timeout-ms", &node_lost_timeout_ms.to_string()])
            .args(["--agent-heartbeat-ms", "200"])
            .env("RUST_LOG", "info,openraft=warn,h2=warn,tower=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("member log"));
        let child = command.spawn().expect("start vgpu-cp");
        Member {
            id,
            address,
            child: Some(child),
            log,
        }
    }

    /// `kill -9`: no resignation, the lease expires on its own.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            child.wait().expect("reap");
        }
    }

    /// `kill -STOP` or `kill -CONT`: a paused process (a VM freeze, a long GC-like stall).
    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(3000);
        format!("--- member {} ---\n{}", self.id, &text[start..])
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // It may have exited on its own already.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn logs(members: &[Member]) -> String {
    members.iter().map(Member::log_tail).collect()
}

async fn channel(member: &Member) -> Option<Channel> {
    let endpoint = Channel::from_shared(member.endpoint())
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        // Longer than a write may take while etcd has no quorum (its bounds, then the answer).
        .timeout(Duration::from_secs(40));
    endpoint.connect().await.ok()
}

async fn status(member: &Member) -> Option<v1::ClusterStatus> {
    let mut client = v1::cluster_client::ClusterClient::new(channel(member).await?);
    let status = client.status(v1::ClusterStatusRequest {}).await.ok()?;
    Some(status.into_inner())
}

/// Polls `probe` every 100 ms until it yields, at most [`WAIT`].
async fn wait_for<T, F, Fut>(what: &str, members: &[Member], mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}\n{}",
            logs(members)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn node(name: &str) -> v1::Node {
    let gpu = |index: u32| v1::Gpu {
        uuid: format!("GPU-{name}-{index}"),
        index,
        model: "H100-80GB".to_owned(),
        memory_bytes: 80 << 30,
        sm_count: 132,
        numa_node: 0,
        pci_bus_id: format!("0000:{index:02x}:00.0"),
        ..Default::default()
    };
    v1::Node {
        name: name.to_owned(),
        gpus: (0..4).map(gpu).collect(),
        ..Default::default()
    }
}

/// Places `name` (one whole GPU) through `member`; `true` when acknowledged.
async fn place(member: &Member, name: &str) -> bool {
    place_answer(member, name).await.is_ok()
}

/// Places `name` (one whole GPU) through `member`: `Err` with the message when not acknowledged.
async fn place_answer(member: &Member, name: &str) -> Result<(), String> {
    let Some(channel) = channel(member).await else {
        return Err(format!("member {} cannot be reached", member.id));
    };
    let request = v1::PlaceRequest {
        name: name.to_owned(),
        request: Some(v1::PlacementRequest {
            whole_gpus: 1,
            ..Default::default()
        }),
    };
    v1::pool_client::PoolClient::new(channel)
        .place(request)
        .await
        .map(|_| ())
        .map_err(|status| status.message().to_owned())
}

async fn get_node(member: &Member, name: &str) -> Option<v1::Node> {
    let mut client = v1::pool_client::PoolClient::new(channel(member).await?);
    let request = v1::GetNodeRequest {
        name: name.to_owned(),
        stale: false,
    };
    Some(client.get_node(request).await.ok()?.into_inner())
}

/// Stand-in agents: every [`BEAT_EVERY`], a heartbeat for each node in `beating`, sent to the
/// first of `endpoints` that answers (as an agent moves on from a dead member).
fn beat(
    endpoints: Vec<String>,
    beating: Arc<Mutex<BTreeSet<String>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(BEAT_EVERY);
        loop {
            tick.tick().await;
            let nodes: Vec<String> = beating.lock().unwrap().iter().cloned().collect();
            for node in nodes {
                for endpoint in &endpoints {
                    let Ok(endpoint) = Channel::from_shared(endpoint.clone()) else {
                        continue;
                    };
                    let endpoint = endpoint
                        .connect_timeout(Duration::from_millis(300))
                        .timeout(Duration::from_secs(2));
                    let Ok(channel) = endpoint.connect().await else {
                        continue;
                    };
                    let request = v1::HeartbeatRequest {
                        node: node.clone(),
                        ..Default::default()
                    };
                    let mut client = v1::agent_client::AgentClient::new(channel);
                    if client.heartbeat(request).await.is_ok() {
                        break;
                    }
                }
            }
        }
    })
}

/// Members 1 (bootstrap, leading), 2 and 3 (joined through it) on `ports[0..3]`, each answering.
async fn start_three(etcd: &EtcdCluster, dir: &Path, ports: &[u16]) -> Vec<Member> {
    let mut members = vec![Member::spawn(1, ports[0], &["bootstrap"], etcd, dir)];
    wait_for("member 1 leads", &members, || async {
        status(&members[0])
            .await
            .filter(|status| status.leader == 1)
    })
    .await;
    let peer = members[0].address.clone();
    for (id, port) in [(2, ports[1]), (3, ports[2])] {
        members.push(Member::spawn(
            id,
            port,
            &["join", "--peer", &peer],
            etcd,
            dir,
        ));
    }
    for index in 1..3 {
        wait_for("the member answers", &members, || async {
            status(&members[index]).await
        })
        .await;
    }
    members
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_placements_survive_kill_9_of_the_leader_and_a_new_leader_runs_the_leader_loop()
 {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) = EtcdCluster::start("vgpu_cp_on_etcd", 3, required).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(4);
    let mut members = start_three(&etcd, dir.path(), &ports).await;

    // Every member lists all three (each keeps `members/<id>` on a lease of its own).
    wait_for("three members listed", &members, || async {
        let status = status(&members[0]).await?;
        let ids: Vec<u64> = status.members.iter().map(|member| member.id).collect();
        (ids == [1, 2, 3]).then_some(())
    })
    .await;

    // Two nodes register through a follower; stand-in agents beat for both.
    for name in ["node-a", "node-b"] {
        let channel = channel(&members[1]).await.expect("member 2");
        v1::agent_client::AgentClient::new(channel)
            .register(v1::RegisterRequest {
                node: Some(node(name)),
            })
            .await
            .expect("register");
    }
    let beating = Arc::new(Mutex::new(BTreeSet::from([
        "node-a".to_owned(),
        "node-b".to_owned(),
    ])));
    let endpoints: Vec<String> = members.iter().map(Member::endpoint).collect();
    let beats = beat(endpoints, beating.clone());

    // Placements through every member, all acknowledged.
    let mut acknowledged = Vec::new();
    for index in 0..4 {
        let name = format!("before-{index}");
        assert!(
            place(&members[index % 3], &name).await,
            "{name}\n{}",
            logs(&members)
        );
        acknowledged.push(name);
    }

    // kill -9 of the leader; placements go on through the others meanwhile (a write that fails
    // during the failover is not acknowledged, and need not be there).
    let old_leader = status(&members[1]).await.expect("status").leader;
    assert!(old_leader >= 1, "a leader is known");
    let killed = members
        .iter()
        .position(|member| member.id == old_leader)
        .expect("the leader is one of ours");
    members[killed].kill();
    let survivors: Vec<usize> = (0..3).filter(|&index| index != killed).collect();
    for index in 0..2 {
        let name = format!("during-{index}");
        if place(&members[survivors[index % 2]], &name).await {
            acknowledged.push(name);
        }
    }
    let new_leader = wait_for("a surviving member leads", &members, || async {
        let status = status(&members[survivors[0]]).await?;
        (status.leader != 0 && status.leader != old_leader).then_some(status.leader)
    })
    .await;
    assert!(members.iter().any(|member| member.id == new_leader));
    eprintln!(
        "member {old_leader} led and was killed; member {new_leader} leads; acknowledged: {acknowledged:?}"
    );

    // The new leader runs the leader loop: node-b stops beating and is marked lost; node-a's
    // beats reach the new leader (forwarded through the `leader` key's address) and keep it
    // ready.
    beating.lock().unwrap().remove("node-b");
    wait_for("the new leader marks node-b lost", &members, || async {
        let node = get_node(&members[survivors[1]], "node-b").await?;
        (node.state == v1::NodeState::Lost as i32).then_some(())
    })
    .await;
    // The killed member's registration lapses with its lease.
    let killed_id = members[killed].id;
    wait_for(
        "the killed member is no longer listed",
        &members,
        || async {
            let status = status(&members[survivors[0]]).await?;
            let listed = status.members.iter().any(|member| member.id == killed_id);
            (!listed && status.members.len() == 2).then_some(())
        },
    )
    .await;
    let node_a = get_node(&members[survivors[0]], "node-a")
        .await
        .expect("node-a");
    assert_eq!(
        node_a.state,
        v1::NodeState::Ready as i32,
        "{}",
        logs(&members)
    );

    // Every acknowledged placement is there, read linearizably through both survivors.
    for &index in &survivors {
        let mut client =
            v1::pool_client::PoolClient::new(channel(&members[index]).await.expect("survivor"));
        let tenants = client
            .list_tenants(v1::ListRequest { stale: false })
            .await
            .expect("list")
            .into_inner()
            .tenants;
        let names: BTreeSet<&str> = tenants.iter().map(|tenant| tenant.name.as_str()).collect();
        for name in &acknowledged {
            assert!(
                names.contains(name.as_str()),
                "{name} lost\n{}",
                logs(&members)
            );
        }
    }

    // A member of another cluster (bootstrap with a fresh data directory) is refused the prefix.
    let mut other = Member::spawn(9, ports[3], &["bootstrap"], &etcd, dir.path());
    let exited = wait_for("the other cluster's member exits", &members, || {
        let child = other.child.as_mut().expect("running");
        let exited = child.try_wait().expect("wait");
        async move { exited }
    })
    .await;
    assert!(!exited.success());
    let log = std::fs::read_to_string(&other.log).unwrap();
    assert!(
        log.contains(PREFIX) && log.contains("--etcd-prefix"),
        "{log}"
    );
    beats.abort();
}

/// Places one tenant through `member`, retrying (bounded) until one attempt is acknowledged.
async fn place_eventually(members: &[Member], member: usize, name: &str) {
    wait_for("a placement is acknowledged", members, || async {
        place(&members[member], name).await.then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_go_on_through_etcd_member_loss_and_fail_clearly_without_a_quorum() {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(mut etcd) = EtcdCluster::start("vgpu_cp_etcd_failures", 3, required).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let mut members = vec![Member::spawn(
        1,
        ports[0],
        &["bootstrap"],
        &etcd,
        dir.path(),
    )];
    wait_for("member 1 leads", &members, || async {
        status(&members[0])
            .await
            .filter(|status| status.leader == 1)
    })
    .await;
    let peer = members[0].address.clone();
    members.push(Member::spawn(
        2,
        ports[1],
        &["join", "--peer", &peer],
        &etcd,
        dir.path(),
    ));
    wait_for("both members listed", &members, || async {
        let status = status(&members[1]).await?;
        (status.members.len() == 2).then_some(())
    })
    .await;
    let channel_2 = channel(&members[1]).await.expect("member 2");
    v1::agent_client::AgentClient::new(channel_2)
        .register(v1::RegisterRequest {
            node: Some(node("node-a")),
        })
        .await
        .expect("register");
    let mut acknowledged = Vec::new();
    place_eventually(&members, 1, "first").await;
    acknowledged.push("first");

    // kill -9 of one etcd member: placements go on (through a follower, forwarded).
    etcd.kill(0);
    place_eventually(&members, 1, "after-one-etcd-member").await;
    acknowledged.push("after-one-etcd-member");

    // Two of three gone: no quorum. A placement fails within its bounds and says why.
    etcd.kill(1);
    let started = tokio::time::Instant::now();
    let refused = place_answer(&members[1], "without-quorum").await;
    let message = refused.expect_err("no etcd quorum, no acknowledged write");
    assert!(message.contains("etcd"), "{message}\n{}", logs(&members));
    assert!(started.elapsed() < WAIT, "took {:?}", started.elapsed());

    // The quorum returns: placements resume.
    etcd.restart(0).await;
    etcd.restart(1).await;
    place_eventually(&members, 0, "after-quorum").await;
    acknowledged.push("after-quorum");
    let channel_1 = channel(&members[0]).await.expect("member 1");
    let tenants = v1::pool_client::PoolClient::new(channel_1)
        .list_tenants(v1::ListRequest { stale: false })
        .await
        .expect("list")
        .into_inner()
        .tenants;
    let names: BTreeSet<&str> = tenants.iter().map(|tenant| tenant.name.as_str()).collect();
    for name in acknowledged {
        assert!(names.contains(name), "{name} lost\n{}", logs(&members));
    }
    eprintln!("without a quorum: {message}");
}

async fn get_tenant(member: &Member, name: &str) -> Option<v1::Tenant> {
    let mut client = v1::pool_client::PoolClient::new(channel(member).await?);
    let request = v1::GetTenantRequest {
        name: name.to_owned(),
        stale: false,
    };
    Some(client.get_tenant(request).await.ok()?.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_paused_past_its_lease_does_not_act_again_and_a_tenant_moves_once() {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) = EtcdCluster::start("vgpu_cp_etcd_paused_leader", 3, required).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let lost_ms = PAUSED_NODE_LOST_TIMEOUT_MS;
    let bootstrap = ["bootstrap"];
    let mut members = vec![Member::spawn_with(
        1,
        ports[0],
        &bootstrap,
        &etcd,
        dir.path(),
        lost_ms,
    )];
    wait_for("member 1 leads", &members, || async {
        status(&members[0])
            .await
            .filter(|status| status.leader == 1)
    })
    .await;
    let peer = members[0].address.clone();
    let join = ["join", "--peer", &peer];
    members.push(Member::spawn_with(
        2,
        ports[1],
        &join,
        &etcd,
        dir.path(),
        lost_ms,
    ));
    wait_for("member 2 answers", &members, || async {
        status(&members[1]).await
    })
    .await;
    for name in ["node-a", "node-b"] {
        let channel = channel(&members[1]).await.expect("member 2");
        v1::agent_client::AgentClient::new(channel)
            .register(v1::RegisterRequest {
                node: Some(node(name)),
            })
            .await
            .expect("register");
    }
    let beating = Arc::new(Mutex::new(BTreeSet::from([
        "node-a".to_owned(),
        "node-b".to_owned(),
    ])));
    // Beats go to member 2 only: member 1 will be paused.
    let beats = beat(vec![members[1].endpoint()], beating.clone());
    let channel_2 = channel(&members[1]).await.expect("member 2");
    v1::pool_client::PoolClient::new(channel_2)
        .place(v1::PlaceRequest {
            name: "train".to_owned(),
            request: Some(v1::PlacementRequest {
                whole_gpus: 4,
                ..Default::default()
            }),
        })
        .await
        .expect("place");
    let first = get_tenant(&members[1], "train").await.expect("train");
    let first_node = first.slices[0].node.clone();

    // Member 1 (the leader) pauses; its node goes silent. Member 2 takes over once member 1's
    // lease expires, marks the node lost and moves the tenant.
    members[0].signal("-STOP");
    beating.lock().unwrap().remove(&first_node);
    let moved = wait_for("member 2 moves the tenant", &members, || async {
        let tenant = get_tenant(&members[1], "train").await?;
        let node = &tenant.slices.first()?.node;
        (*node != first_node).then_some(tenant)
    })
    .await;
    assert_eq!(status(&members[1]).await.expect("status").leader, 2);

    // Member 1 resumes. Once it sees member 2 lead, whatever it decided on its stale view is
    // behind it: the tenant moved exactly once (two placements in its history).
    members[0].signal("-CONT");
    wait_for("member 1 sees member 2 lead", &members, || async {
        status(&members[0])
            .await
            .filter(|status| status.leader == 2)
    })
    .await;
    let tenant = get_tenant(&members[0], "train").await.expect("train");
    assert_eq!(tenant.slices, moved.slices, "{}", logs(&members));
    let placements = tenant
        .history
        .iter()
        .filter(|event| event.state == v1::TenantState::Placed as i32)
        .count();
    assert_eq!(placements, 2, "{:?}\n{}", tenant.history, logs(&members));
    beats.abort();
}

/// A client's operations: a small linear congruential generator, so a run is reproducible from
/// its seed without a random-number dependency.
struct Steps(u64);

impl Steps {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

/// One operation of the register model through the gRPC API, sent to `members` starting at
/// `first`: a member that cannot be reached or finds no leader did not take it, so the next one
/// is tried (bounded); an answer lost mid-call is an unknown outcome.
async fn operate(
    endpoints: &[String],
    first: usize,
    name: &str,
    call: linearizability::Call,
) -> (linearizability::Outcome, String) {
    use api::ErrorCode;
    use linearizability::{Call, Outcome};
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut attempt = 0;
    loop {
        let endpoint = &endpoints[(first + attempt) % endpoints.len()];
        attempt += 1;
        let connected = match Channel::from_shared(endpoint.clone()) {
            Ok(channel) => channel
                .connect_timeout(Duration::from_millis(500))
                .timeout(Duration::from_secs(20))
                .connect()
                .await
                .ok(),
            Err(_) => None,
        };
        let answer = match connected {
            None => Err(None),
            Some(channel) => {
                let mut pool = v1::pool_client::PoolClient::new(channel);
                let result = match call {
                    Call::Place(milli_gpus) => pool
                        .place(v1::PlaceRequest {
                            name: name.to_owned(),
                            request: Some(v1::PlacementRequest {
                                milli_gpus,
                                ..Default::default()
                            }),
                        })
                        .await
                        .map(|answer| {
                            match answer.into_inner().tenant.and_then(|tenant| tenant.request) {
                                Some(request) if request.milli_gpus == milli_gpus => {
                                    Outcome::Placed
                                }
                                _ => Outcome::Unexpected,
                            }
                        }),
                    Call::Release => pool
                        .release(v1::ReleaseRequest {
                            name: name.to_owned(),
                        })
                        .await
                        .map(|_| Outcome::Released),
                    Call::Read => pool
                        .get_tenant(v1::GetTenantRequest {
                            name: name.to_owned(),
                            stale: false,
                        })
                        .await
                        .map(|answer| match answer.into_inner().request {
                            Some(request) => Outcome::Present(request.milli_gpus),
                            None => Outcome::Unexpected,
                        }),
                };
                result.map_err(Some)
            }
        };
        let status = match answer {
            Ok(outcome) => return (outcome, endpoint.clone()),
            Err(status) => status,
        };
        let not_delivered = match &status {
            None => true,
            Some(status) => match ErrorCode::of(status) {
                Some(ErrorCode::NoLeader | ErrorCode::NotLeader) => true,
                Some(ErrorCode::Unavailable | ErrorCode::Storage) => {
                    return (
                        Outcome::Unknown,
                        format!("{endpoint}: {}", status.message()),
                    );
                }
                Some(ErrorCode::TenantExists) if matches!(call, Call::Place(_)) => {
                    return (Outcome::Exists, endpoint.clone());
                }
                Some(ErrorCode::Unplaceable) if matches!(call, Call::Place(_)) => {
                    return (Outcome::Unplaceable, endpoint.clone());
                }
                Some(ErrorCode::TenantNotFound) if call == Call::Release => {
                    return (Outcome::NotFound, endpoint.clone());
                }
                Some(ErrorCode::TenantNotFound) if call == Call::Read => {
                    return (Outcome::Absent, endpoint.clone());
                }
                Some(_) => {
                    return (
                        Outcome::Unexpected,
                        format!("{endpoint}: {}", status.message()),
                    );
                }
                None => false,
            },
        };
        if !not_delivered || tokio::time::Instant::now() >= deadline {
            let detail = status.map_or("unreachable".to_owned(), |status| status.to_string());
            return (Outcome::Unknown, format!("{endpoint}: {detail}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_through_a_leader_kill_are_linearizable() {
    use linearizability::{Call, History, Operation, Outcome};
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) = EtcdCluster::start("vgpu_cp_etcd_linearizable", 3, required).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(3);
    let mut members = start_three(&etcd, dir.path(), &ports).await;
    let channel_2 = channel(&members[1]).await.expect("member 2");
    v1::agent_client::AgentClient::new(channel_2)
        .register(v1::RegisterRequest {
            node: Some(node("node-a")),
        })
        .await
        .expect("register");
    let beating = Arc::new(Mutex::new(BTreeSet::from(["node-a".to_owned()])));
    let endpoints: Vec<String> = members.iter().map(Member::endpoint).collect();
    let beats = beat(endpoints.clone(), beating);

    const CLIENTS: u32 = 4;
    const OPERATIONS: u32 = 20;
    let history = Arc::new(History::default());
    let started = tokio::time::Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (history, endpoints) = (history.clone(), endpoints.clone());
            tokio::spawn(async move {
                let mut steps = Steps(0x5eed + u64::from(client));
                for _ in 0..OPERATIONS {
                    let name = format!("t{}", steps.next(3));
                    let call = match steps.next(3) {
                        0 => Call::Place(100 * (1 + steps.next(2) as u32)),
                        1 => Call::Release,
                        _ => Call::Read,
                    };
                    let first = steps.next(endpoints.len() as u64) as usize;
                    let invoked = history.event();
                    let invoked_us = started.elapsed().as_micros() as u64;
                    let (outcome, note) = operate(&endpoints, first, &name, call).await;
                    if outcome == Outcome::Unknown && call == Call::Read {
                        continue;
                    }
                    let (returned, returned_us) = if outcome == Outcome::Unknown {
                        (u64::MAX, u64::MAX)
                    } else {
                        (history.event(), started.elapsed().as_micros() as u64)
                    };
                    history.record(Operation {
                        client,
                        name,
                        call,
                        invoked,
                        returned,
                        invoked_us,
                        returned_us,
                        outcome,
                        note,
                    });
                }
            })
        })
        .collect();

    // The leader dies while the clients run.
    wait_for("some operations done", &members, || async {
        (history.operations().len() >= 10).then_some(())
    })
    .await;
    let leader = status(&members[1]).await.expect("status").leader;
    let killed = members
        .iter()
        .position(|member| member.id == leader)
        .expect("the leader is one of ours");
    members[killed].kill();
    for client in clients {
        client.await.expect("client");
    }
    beats.abort();

    let operations = history.operations();
    let failures = linearizability::check_linearizable(&operations);
    assert!(failures.is_empty(), "{failures:#?}\n{}", logs(&members));
    let mut finals = std::collections::BTreeMap::new();
    for (index, member) in members.iter().enumerate() {
        if index == killed {
            continue;
        }
        let mut client = v1::pool_client::PoolClient::new(channel(member).await.expect("survivor"));
        let tenants = client
            .list_tenants(v1::ListRequest { stale: false })
            .await
            .expect("list")
            .into_inner()
            .tenants;
        let state: std::collections::BTreeMap<String, u32> = tenants
            .into_iter()
            .filter_map(|tenant| Some((tenant.name, tenant.request?.milli_gpus)))
            .collect();
        finals.insert(member.id, state);
    }
    let lost = linearizability::check_acknowledged_writes(&operations, &finals);
    assert!(lost.is_empty(), "{lost:#?}");
    let unknown = operations.iter().filter(|op| !op.is_complete()).count();
    eprintln!(
        "{} operations ({unknown} of unknown outcome), member {leader} killed mid-run: linearizable",
        operations.len()
    );
}
