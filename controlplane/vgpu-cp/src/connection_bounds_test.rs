//! Half-open requests (issue 22): a client without a certificate that sends a call's headers and
//! the length prefix of its message, then nothing, held the request (and what it had buffered)
//! for good. Now the server answers every call within `Timings::request_timeout` and drops the
//! request with it. The member runs with mTLS; the client authenticates the server only (as an
//! agent joining with a token does) and sends `Pool.Place` as HTTP/2 headers and one DATA frame
//! (a 5-byte prefix announcing 1 MiB, then 100 bytes), without ending the stream.

use crate::control_plane::Timings;
use crate::{Config, Mode, RaftTimings, Security, start};
use api::tls::{Role, TlsFiles};
use std::time::{Duration, Instant};
use tonic::codegen::{Bytes, Service as _, http};

/// A member under mTLS in `directory`, with `timings`; the CA (to issue clients' certificates),
/// its certificate file and its pin.
async fn member_under_mtls(
    directory: &std::path::Path,
    timings: Timings,
) -> (
    crate::Started,
    api::pki::CertAndKey,
    std::path::PathBuf,
    String,
) {
    let pki = directory.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    let (ca_cert, ca_key, pin) = crate::certs::ca_init(&pki, "test", 1).unwrap();
    let ca = crate::certs::load_ca(&ca_cert, &ca_key).unwrap();
    let hosts = vec!["127.0.0.1".to_owned()];
    let (cert, key) = crate::certs::cert_issue(&ca, Role::Member, "1", hosts, 1, &pki).unwrap();
    let started = start(Config {
        mode: Mode::Bootstrap,
        id: 1,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: "127.0.0.1:1".to_owned(),
        data_dir: directory.join("data"),
        timings,
        raft: RaftTimings::default(),
        etcd: None,
        security: Security {
            insecure: false,
            tls: Some(TlsFiles {
                ca_cert: ca_cert.clone(),
                cert,
                key,
            }),
            ..Security::default()
        },
    })
    .await
    .unwrap();
    (started, ca, ca_cert, pin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_request_without_a_certificate_is_answered_within_the_request_timeout() {
    let directory = tempfile::tempdir().unwrap();
    let request_timeout = Duration::from_secs(1);
    let timings = Timings {
        request_timeout,
        ..Timings::default()
    };
    let (started, _, _, pin) = member_under_mtls(directory.path(), timings).await;

    let address = started.local_address.to_string();
    let mut channel = api::tls::pinned_endpoint(&address, &pin)
        .unwrap()
        .connect()
        .await
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    // A message of 1 MiB announced (uncompressed), 100 bytes of it sent, then silence.
    let mut data = vec![0, 0x00, 0x10, 0x00, 0x00];
    data.extend_from_slice(&[0x0a; 100]);
    let sent_part = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from(data))]);
    let silence = futures::stream::pending();
    let body = axum::body::Body::from_stream(futures::StreamExt::chain(sent_part, silence));
    let request = http::Request::post("/vgpu.v1.Pool/Place")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(body))
        .unwrap();
    // Taken before the call: the server's clock for it starts after this.
    let sent = Instant::now();
    let bound = request_timeout + Duration::from_secs(10);
    let response = tokio::time::timeout(bound, channel.call(request))
        .await
        .expect("the server answers a half-open request within its request timeout")
        .expect("an answer, not a broken connection");
    let waited = sent.elapsed();
    assert!(
        waited >= request_timeout,
        "nothing but the timeout ends it: {waited:?}"
    );
    let code = response
        .headers()
        .get("grpc-status")
        .and_then(|code| code.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        !code.is_empty() && code != "0",
        "a gRPC error ends the call: {:?}",
        response.headers()
    );
    started.control_plane.replication.shutdown().await;
}

/// Idle TLS connections without a certificate were never closed (issue 22). Now a connection on
/// which no request showed a client certificate is closed `anonymous_connection_max` after it was
/// accepted, at its next read; one whose requests carry a certificate stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_shows_no_certificate_is_closed_after_its_time() {
    let directory = tempfile::tempdir().unwrap();
    let anonymous_max = Duration::from_secs(1);
    let timings = Timings {
        anonymous_connection_max: anonymous_max,
        ..Timings::default()
    };
    let (started, ca, ca_cert, pin) = member_under_mtls(directory.path(), timings).await;
    let admin_dir = directory.path().join("admin");
    std::fs::create_dir_all(&admin_dir).unwrap();
    let (admin_cert, admin_key) =
        crate::certs::cert_issue(&ca, Role::Admin, "ops", Vec::new(), 1, &admin_dir).unwrap();
    let address = started.local_address.to_string();
    let status = |channel: tonic::transport::Channel| async move {
        api::v1::cluster_client::ClusterClient::new(channel)
            .status(api::v1::ClusterStatusRequest {})
            .await
    };

    // Without a certificate: answered (refused) at first, the connection closed once its time
    // is up; the next call on it finds it gone.
    let anonymous = api::tls::pinned_endpoint(&address, &pin)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let first = status(anonymous.clone()).await.unwrap_err();
    assert!(
        matches!(
            first.code(),
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
        ),
        "an answer, not a closed connection: {first:?}"
    );
    // the time passing is what is tested here, not a synchronisation
    tokio::time::sleep(anonymous_max + Duration::from_millis(300)).await;
    let later = status(anonymous).await.unwrap_err();
    assert!(
        !matches!(
            later.code(),
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
        ),
        "the connection should be closed, not answered: {later:?}"
    );

    // With a certificate: the connection stays past the time.
    let files = TlsFiles {
        ca_cert,
        cert: admin_cert,
        key: admin_key,
    };
    let admin = api::tls::Transport::choose(false, Some(&files), "test")
        .unwrap()
        .endpoint(&address)
        .unwrap()
        .connect()
        .await
        .unwrap();
    status(admin.clone()).await.unwrap();
    tokio::time::sleep(anonymous_max + Duration::from_millis(300)).await;
    status(admin)
        .await
        .expect("an authenticated connection stays");
    started.control_plane.replication.shutdown().await;
}
