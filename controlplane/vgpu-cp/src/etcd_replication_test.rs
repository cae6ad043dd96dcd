//! `ControlPlane` on the etcd store (issue 20, phase 2), in process against 3 real etcd members
//! (`etcd_store::testing`): members bootstrap and join on one prefix, writes through either
//! member reach the same applied state, exactly one member leads, and when it stops another
//! takes over and runs the leader loop (it marks the nodes lost, which have no agents here); the
//! cluster status lists the members registered under `members/`. A member of another cluster is
//! refused the prefix. Skipped without `etcd` unless
//! `VGPU_ETCD_REQUIRED` is set.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use etcd_store::testing::EtcdCluster;

use crate::control_plane::{ControlPlane, Timings};
use crate::pool::{Command, CommandResult};
use crate::{Config, EtcdStore, Mode, RaftTimings, Security, Started, start};

/// Bound on every wait of these tests.
const WAIT: Duration = Duration::from_secs(20);

fn config(etcd: &EtcdCluster, id: u64, mode: Mode, data_dir: &Path) -> Config {
    Config {
        mode,
        id,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: "127.0.0.1:0".to_owned(),
        data_dir: data_dir.to_owned(),
        timings: Timings {
            node_lost_timeout: Duration::from_secs(1),
            request_deadline: Duration::from_secs(10),
            ..Timings::default()
        },
        raft: RaftTimings {
            snapshot_logs_since_last: 5,
            ..RaftTimings::default()
        },
        etcd: Some(EtcdStore {
            endpoints: etcd.endpoints(),
            prefix: "/pool/".to_owned(),
            tls: None,
            lease_ttl: Duration::from_secs(2),
        }),
        security: Security {
            insecure: true,
            ..Security::default()
        },
    }
}

/// Polls `check` every 20 ms until it holds, at most [`WAIT`].
async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A plain HTTP/1.1 GET's body.
async fn get(address: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: member\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

fn leaders(members: &[&Arc<ControlPlane>]) -> Vec<u64> {
    members
        .iter()
        .filter(|member| member.is_leader())
        .map(|member| member.id)
        .collect()
}

fn place(name: &str) -> Command {
    use prost::Message as _;
    let request = api::v1::PlacementRequest {
        whole_gpus: 4,
        ..Default::default()
    };
    Command::Place {
        name: name.to_owned(),
        request: request.encode_to_vec(),
        unix_ms: 2,
    }
}

async fn pool_bytes(member: &ControlPlane) -> Vec<u8> {
    member.linearize().await.expect("linearize");
    crate::raft_types::encode(&member.shared.read().pool).expect("encode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_on_etcd_share_the_pool_and_hand_over_the_leader_loop() {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) = EtcdCluster::start("members_on_etcd_share_the_pool", 3, required).await else {
        return;
    };
    let dirs = [(); 3].map(|()| tempfile::tempdir().unwrap());
    let one: Started = start(config(&etcd, 1, Mode::Bootstrap, dirs[0].path()))
        .await
        .expect("bootstrap on etcd");
    let peer = one.local_address.to_string();
    let two: Started = start(config(
        &etcd,
        2,
        Mode::Join { peers: vec![peer] },
        dirs[1].path(),
    ))
    .await
    .expect("join on etcd");
    let (a, b) = (&one.control_plane, &two.control_plane);
    wait_until("one leader", || leaders(&[a, b]).len() == 1).await;
    // Both registered themselves under `members/`: the cluster status lists them.
    let member_ids = |member: &ControlPlane| -> Vec<u64> {
        member
            .replication
            .facts()
            .members
            .iter()
            .map(|member| member.id)
            .collect()
    };
    wait_until("both members listed", || member_ids(a) == [1, 2]).await;

    // Writes through either member; both apply the same entries to the same state.
    for (member, node) in [(b, "node-a"), (a, "node-b")] {
        let result = member
            .write(crate::etcd_store_test::register(node))
            .await
            .expect("register");
        assert!(
            !matches!(result, CommandResult::Failed { .. }),
            "{result:?}"
        );
    }
    let placed = b.write(place("train")).await.expect("place");
    assert!(matches!(placed, CommandResult::Tenant(_)), "{placed:?}");
    let view = pool_bytes(a).await;
    assert_eq!(pool_bytes(b).await, view);
    assert!(a.shared.read().pool.tenants.contains_key("train"));

    // A member of another cluster (a fresh data directory bootstraps a new one) is refused.
    let other = start(config(&etcd, 3, Mode::Bootstrap, dirs[2].path()))
        .await
        .err()
        .expect("another cluster's member is refused the prefix");
    let message = other.to_string();
    assert!(
        message.contains("/pool/") && message.contains("--etcd-prefix"),
        "{message}"
    );

    // The leader stops (resigning); the other member leads and runs the leader loop: the
    // nodes have no agents, so after the lost timeout it marks them lost, by fenced decisions.
    let (leader, follower) = if a.is_leader() {
        (one, two)
    } else {
        (two, one)
    };
    let survivor = follower.control_plane.clone();
    leader.control_plane.replication.shutdown().await;
    drop(leader);
    wait_until("the survivor leads", || survivor.is_leader()).await;
    // The dashboard's cluster view lists the survivor's leadership among its elections.
    // (The dashboard records it on its own task: poll, bounded.)
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let cluster = get(follower.local_address, "/ui/api/cluster").await;
        let cluster: serde_json::Value = serde_json::from_str(&cluster).expect("the cluster view");
        let elections = cluster["elections"].as_array().expect("elections");
        if elections
            .iter()
            .any(|election| election["leader"] == survivor.id)
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{cluster}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The stopped member left `members/` (it revoked its registration's lease).
    wait_until("only the survivor listed", || {
        member_ids(&survivor) == [survivor.id]
    })
    .await;
    wait_until("the new leader marks the silent nodes lost", || {
        let applied = survivor.shared.read();
        let states: Vec<_> = applied.pool.engine.node_states().collect();
        states.len() == 2
            && states
                .iter()
                .all(|(_, state)| *state == placement::NodeState::Lost)
    })
    .await;
    // The leader snapshots every 5 entries (and compacts the log under the snapshot).
    let log = etcd_store::EtcdLog::connect(&etcd.config("/pool/"))
        .await
        .expect("connect");
    let deadline = tokio::time::Instant::now() + WAIT;
    while log
        .read_snapshot()
        .await
        .expect("read the snapshot")
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no snapshot within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    survivor.replication.shutdown().await;
}
