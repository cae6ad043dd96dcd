//! Losing a quorum of etcd: appends fail within their bound with an error that says what to
//! check, and succeed again once the members return.

use std::time::Duration;

use etcd_store::Error;
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, REQUEST_TIMEOUT, required};

#[tokio::test]
async fn without_a_quorum_appends_fail_within_the_bound_and_resume_after() {
    let Some(mut etcd) = EtcdCluster::start("without_a_quorum_appends_fail", 3, required()).await
    else {
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
    // Tries start within the retry window (1.5 request timeouts) and each ends within one.
    assert!(
        elapsed <= REQUEST_TIMEOUT * 5 / 2 + Duration::from_millis(500),
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
    let mut attempt = 0;
    let (appended, payload) = loop {
        // A distinct payload per try: a try that timed out may still commit.
        attempt += 1;
        let payload = format!("after, try {attempt}").into_bytes();
        match log.append(std::slice::from_ref(&payload)).await {
            Ok(seqs) => break (seqs, payload),
            Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("append after the quorum returned: {error}"),
        }
    };
    // The append without a quorum had an unknown outcome: etcd may have taken it into its own
    // log and committed it once the quorum returned. It is there once or not at all, and the
    // rest is exactly what was acknowledged, in order.
    let batch = log.read_from(1, 10).await.expect("read");
    let written: Vec<&[u8]> = batch
        .entries
        .iter()
        .map(|entry| entry.bytes.as_slice())
        .collect();
    assert_eq!(written[..2], [&b"before"[..], b"one member down"]);
    let rest: Vec<&[u8]> = written[2..]
        .iter()
        .copied()
        .filter(|bytes| *bytes != b"no quorum")
        .collect();
    assert!(
        written.len() - 2 - rest.len() <= 1,
        "\"no quorum\" at most once: {written:?}"
    );
    let tries: std::collections::BTreeSet<&[u8]> = rest.iter().copied().collect();
    assert_eq!(tries.len(), rest.len(), "no try twice: {written:?}");
    assert!(
        rest.iter().all(|bytes| bytes.starts_with(b"after, try")),
        "{written:?}"
    );
    assert_eq!(written[*appended.start() as usize - 1], payload.as_slice());
    assert_eq!(written.last().copied(), Some(payload.as_slice()));
}

#[tokio::test]
async fn appends_while_etcd_members_die_and_return_never_fork_or_duplicate() {
    let Some(mut etcd) = EtcdCluster::start("appends_while_etcd_members_die", 3, required()).await
    else {
        return;
    };
    const APPENDS: usize = 60;
    let mut writers = Vec::new();
    for writer in 0..2 {
        let log = etcd.claimed_log("/churn/", "c").await;
        writers.push(tokio::spawn(async move {
            // (payload, Some(numbers) when acknowledged, None when the outcome is unknown)
            let mut outcomes = Vec::new();
            for append in 0..APPENDS {
                let payload = format!("w{writer}-{append}").into_bytes();
                match log.append(std::slice::from_ref(&payload)).await {
                    Ok(seqs) => outcomes.push((payload, Some(seqs))),
                    // No retry here: a second append of the payload could duplicate it, and
                    // the test checks that `append`'s own retries never do.
                    Err(Error::Unavailable { .. }) => outcomes.push((payload, None)),
                    // Nothing was written: the payload must not be in the log.
                    Err(Error::Contended { .. }) => outcomes.push((payload, Some(0..=0))),
                    Err(error) => panic!("append: {error}"),
                }
            }
            outcomes
        }));
    }
    // Kill and restart each member in turn while the writers run: answers get lost mid-call.
    for member in [0, 1, 2, 0] {
        tokio::time::sleep(Duration::from_millis(150)).await;
        etcd.kill(member);
        tokio::time::sleep(Duration::from_millis(150)).await;
        etcd.restart(member).await;
    }
    let mut outcomes = Vec::new();
    for writer in writers {
        outcomes.extend(writer.await.expect("writer task"));
    }

    let reader = etcd.claimed_log("/churn/", "c").await;
    let (log, _) = etcd_store::testing::read_whole_log(&reader).await;
    for (index, entry) in log.iter().enumerate() {
        assert_eq!(entry.seq, index as u64 + 1, "the log is dense");
    }
    let mut seen = std::collections::BTreeSet::new();
    for entry in &log {
        assert!(
            seen.insert(entry.bytes.clone()),
            "{:?} appended twice",
            entry.bytes
        );
    }
    let acknowledged = outcomes
        .iter()
        .filter(|(_, seqs)| seqs.as_ref().is_some_and(|seqs| *seqs.start() > 0))
        .count();
    for (payload, seqs) in &outcomes {
        match seqs {
            Some(seqs) if *seqs.start() == 0 => {
                assert!(!seen.contains(payload), "a contended append was written");
            }
            Some(seqs) => {
                let at = &log[*seqs.start() as usize - 1].bytes;
                assert_eq!(at, payload, "acknowledged at {seqs:?}");
            }
            None => {}
        }
    }
    assert!(
        acknowledged >= APPENDS,
        "most appends went through ({acknowledged})"
    );
    eprintln!(
        "{} appends, {acknowledged} acknowledged, {} in the log",
        outcomes.len(),
        log.len()
    );
}
