//! The log: the cluster identity key, conflict-free appends from concurrent writers, and a
//! connection to nothing failing within its bound.

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_store::{Error, EtcdConfig, EtcdLog};
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, REQUEST_TIMEOUT, free_ports, required};

#[tokio::test]
async fn a_prefix_of_another_cluster_is_refused() {
    let Some(etcd) =
        EtcdCluster::start("a_prefix_of_another_cluster_is_refused", 1, required()).await
    else {
        return;
    };
    let mut first = EtcdLog::connect(&etcd.config("/pool/"))
        .await
        .expect("connect");
    assert!(matches!(
        first.append(&[b"x".to_vec()]).await,
        Err(Error::Unclaimed { .. })
    ));
    first
        .claim_cluster("cluster-a")
        .await
        .expect("claim a fresh prefix");
    first
        .claim_cluster("cluster-a")
        .await
        .expect("claim it again");

    let mut other = EtcdLog::connect(&etcd.config("/pool/"))
        .await
        .expect("connect");
    let error = other
        .claim_cluster("cluster-b")
        .await
        .expect_err("claiming another cluster's prefix");
    assert!(matches!(error, Error::OtherCluster { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("/pool/") && message.contains("cluster-a"),
        "{message}"
    );
    assert!(matches!(
        other.append(&[b"x".to_vec()]).await,
        Err(Error::Unclaimed { .. })
    ));

    // Another prefix in the same etcd is another cluster's to claim.
    let mut elsewhere = EtcdLog::connect(&etcd.config("/pool2/"))
        .await
        .expect("connect");
    elsewhere
        .claim_cluster("cluster-b")
        .await
        .expect("a separate prefix");
    assert_eq!(first.append(&[b"a".to_vec()]).await.expect("append"), 1..=1);
    assert_eq!(
        elsewhere.append(&[b"b".to_vec()]).await.expect("append"),
        1..=1
    );
}

#[tokio::test]
async fn concurrent_appenders_never_fork() {
    let Some(etcd) = EtcdCluster::start("concurrent_appenders_never_fork", 1, required()).await
    else {
        return;
    };
    const APPENDS: usize = 40;
    let mut writers = Vec::new();
    for writer in 0..2 {
        // Separate connections, as two vgpu-cp members would have.
        let log = etcd.claimed_log("/fork/", "c").await;
        writers.push(tokio::spawn(async move {
            let mut written = Vec::new();
            for append in 0..APPENDS {
                let entries: Vec<Vec<u8>> = (0..=append % 3)
                    .map(|k| format!("w{writer}-{append}-{k}").into_bytes())
                    .collect();
                let seqs = log.append(&entries).await.expect("append");
                assert_eq!(seqs.clone().count(), entries.len());
                written.push((seqs, entries));
            }
            written
        }));
    }
    let mut expected = Vec::new();
    for writer in writers {
        expected.extend(writer.await.expect("writer task"));
    }

    let reader = etcd.claimed_log("/fork/", "c").await;
    let (log, head) = etcd_store::testing::read_whole_log(&reader).await;
    assert_eq!(head, log.len() as u64);
    // Dense from 1, and each writer's acknowledged numbers hold exactly what it wrote.
    for (index, entry) in log.iter().enumerate() {
        assert_eq!(entry.seq, index as u64 + 1);
    }
    let total: usize = expected.iter().map(|(_, entries)| entries.len()).sum();
    assert_eq!(log.len(), total, "every appended entry once, nothing else");
    let mut seen = BTreeSet::new();
    for (seqs, entries) in &expected {
        for (seq, bytes) in seqs.clone().zip(entries) {
            assert!(seen.insert(seq), "sequence number {seq} acknowledged twice");
            assert_eq!(&log[seq as usize - 1].bytes, bytes, "entry {seq}");
        }
    }
}

#[tokio::test]
async fn connecting_to_nothing_fails_within_its_bound() {
    let port = free_ports(1)[0];
    let mut config = EtcdConfig::new(vec![format!("http://127.0.0.1:{port}")], "/vgpu/");
    config.connect_timeout = REQUEST_TIMEOUT;
    config.request_timeout = REQUEST_TIMEOUT;
    let started = Instant::now();
    let Err(error) = EtcdLog::connect(&config).await else {
        panic!("connected to a closed port");
    };
    let elapsed = started.elapsed();
    assert!(matches!(error, Error::Unavailable { .. }), "{error}");
    assert!(
        elapsed < 2 * REQUEST_TIMEOUT + Duration::from_secs(1),
        "took {elapsed:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(&port.to_string()) && message.contains("quorum"),
        "{message}"
    );
}

#[tokio::test]
async fn settings_that_cannot_work_are_refused_before_any_request() {
    let no_endpoint = EtcdConfig::new(Vec::new(), "/vgpu/");
    let error = EtcdLog::connect(&no_endpoint)
        .await
        .err()
        .expect("no endpoint");
    assert!(matches!(error, Error::Config(_)), "{error}");
    let no_slash = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()], "/vgpu");
    let error = EtcdLog::connect(&no_slash)
        .await
        .err()
        .expect("a prefix without '/'");
    assert!(
        error.to_string().contains("must be a path ending with '/'"),
        "{error}"
    );
    let not_a_url = EtcdConfig::new(vec!["http://[::1".into()], "/vgpu/");
    let error = EtcdLog::connect(&not_a_url).await.err().expect("not a URL");
    assert!(matches!(error, Error::Config(_)), "{error}");
}
