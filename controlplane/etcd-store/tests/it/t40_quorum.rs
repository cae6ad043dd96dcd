//! Losing a quorum of etcd: appends fail within their bound with an error that says what to
//! check, and succeed again once the members return.

use std::time::Duration;

use etcd_store::Error;
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, REQUEST_TIMEOUT};

#[tokio::test]
async fn without_a_quorum_appends_fail_within_the_bound_and_resume_after() {
    let Some(mut etcd) = EtcdCluster::start("without_a_quorum_appends_fail", 3).await else {
        return;
    };
    let log = etcd.claimed_log("/quorum/", "c").await;
    assert_eq!(
        log.append(&[b"before".to_vec()]).await.expect("append"),
        1..=1
    );

    etcd.kill(1);
    assert_eq!(
        log.append(&[b"one member down".to_vec()])
            .await
            .expect("append"),
        2..=2
    );
    etcd.kill(2);
    let started = Instant::now();
    let error = log
        .append(&[b"no quorum".to_vec()])
        .await
        .expect_err("an append without a quorum");
    let elapsed = started.elapsed();
    // The head read and the transaction are each bounded; the first already fails.
    assert!(
        elapsed <= 2 * REQUEST_TIMEOUT + Duration::from_millis(500),
        "took {elapsed:?}"
    );
    assert!(matches!(error, Error::Unavailable { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("quorum") && message.contains("--etcd-endpoints"),
        "{message}"
    );

    etcd.restart(1).await;
    etcd.restart(2).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let appended = loop {
        match log.append(&[b"after".to_vec()]).await {
            Ok(seqs) => break seqs,
            Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("append after the quorum returned: {error}"),
        }
    };
    // The failed append never committed: no quorum, no commit.
    assert_eq!(appended, 3..=3);
    let batch = log.read_from(1, 10).await.expect("read");
    let written: Vec<&[u8]> = batch
        .entries
        .iter()
        .map(|entry| entry.bytes.as_slice())
        .collect();
    assert_eq!(written, [&b"before"[..], b"one member down", b"after"]);
}
