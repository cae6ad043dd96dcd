//! A member whose disk fills (issue 22): its Raft log's writes fail (an injected
//! `ErrorKind::StorageFull`, `store::WriteFault`), the Raft core stops, and from then on the
//! member says so: `/healthz` answers 503 with the reason, `/metrics` has `vgpu_member_up 0`,
//! `Cluster.Status` is `[VGPU-UNAVAILABLE]`, and `Started::run_until` (what `vgpu-cp run` runs
//! until a signal) returns `Error::CoreStopped` with the reason, the data directory and what to
//! do, which `vgpu-cp` exits with. (A restart once space is back
//! is an ordinary restart from the data directory.)

use crate::control_plane::Timings;
use crate::pool::{Command, CommandResult};
use crate::{Config, Mode, RaftTimings, Security, start};
use std::time::Duration;

fn config(data_dir: &std::path::Path) -> Config {
    Config {
        mode: Mode::Bootstrap,
        id: 1,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: "127.0.0.1:1".to_owned(),
        data_dir: data_dir.to_owned(),
        timings: Timings::default(),
        raft: RaftTimings::default(),
        etcd: None,
        security: Security {
            insecure: true,
            ..Security::default()
        },
    }
}

/// A plain HTTP/1.1 GET: the status code and the body.
async fn get(address: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: member\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

fn revoke(serial: &str) -> Command {
    Command::RevokeCertificate {
        serial: serial.to_owned(),
        unix_ms: 1,
    }
}

async fn wait_until_leader(started: &crate::Started) {
    let mut metrics = started
        .control_plane
        .raft()
        .expect("the Raft store")
        .metrics();
    tokio::time::timeout(
        Duration::from_secs(10),
        metrics.wait_for(|m| m.current_leader == Some(1)),
    )
    .await
    .expect("a one-member cluster elects itself within 10 s")
    .expect("the Raft core runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_the_member_and_it_says_so() {
    let directory = tempfile::tempdir().unwrap();
    let started = start(config(directory.path())).await.unwrap();
    wait_until_leader(&started).await;
    let address = started.local_address;
    let plane = started.control_plane.clone();
    let written = plane.write(revoke("a1")).await.unwrap();
    assert!(
        matches!(written, CommandResult::Revoked { newly: true, .. }),
        "{written:?}"
    );
    assert_eq!(get(address, "/healthz").await, (200, "ok\n".to_owned()));
    assert!(
        get(address, "/metrics")
            .await
            .1
            .contains("vgpu_member_up 1")
    );

    started.log_fault.set(true);
    let refused = plane.write(revoke("b2")).await;
    assert!(refused.is_err(), "a write on a full disk: {refused:?}");
    // What `vgpu-cp run` does: serve until a signal, or until the core stops.
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        started.run_until(std::future::pending()),
    )
    .await
    .expect("the member stops serving within 10 s of a failed write");
    let error = ended.unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, crate::Error::CoreStopped { .. })
            && message.contains("Raft core of member 1 stopped")
            && message.contains("free space")
            && message.contains(&directory.path().display().to_string())
            && message.contains("start vgpu-cp again"),
        "{message}"
    );
    let (status, body) = get(address, "/healthz").await;
    assert!(
        status == 503 && body.contains("free space") && body.contains("no space left"),
        "{status} {body}"
    );
    let (status, metrics) = get(address, "/metrics").await;
    assert!(
        status == 200 && metrics.contains("vgpu_member_up 0"),
        "{metrics}"
    );
    let service = crate::service::Service {
        control_plane: plane.clone(),
        guard: std::sync::Arc::new(
            Security {
                insecure: true,
                ..Security::default()
            }
            .load()
            .unwrap()
            .1,
        ),
    };
    let status = api::v1::cluster_server::Cluster::status(
        &service,
        tonic::Request::new(api::v1::ClusterStatusRequest {}),
    )
    .await
    .unwrap_err();
    assert!(
        status.code() == tonic::Code::Unavailable && status.message().contains("free space"),
        "{status:?}"
    );
    plane.replication.shutdown().await;
}
