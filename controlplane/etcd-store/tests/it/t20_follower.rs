//! The apply stream: every entry in order across an etcd restart, and a fresh member catching up
//! from a snapshot after compaction.

use std::time::Duration;

use etcd_store::{Applied, Entry, Error, EtcdLog, Follower, SNAPSHOT_CHUNK_BYTES, Snapshot};
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, required};

/// Bound on a test's waits for its follower.
const FOLLOW_BOUND: Duration = Duration::from_secs(30);

/// Follows until `count` entries arrived (bounded), tolerating etcd being away meanwhile.
async fn follow(follower: &mut Follower, count: usize, into: &mut Vec<Entry>) {
    let deadline = Instant::now() + FOLLOW_BOUND;
    while into.len() < count {
        assert!(
            Instant::now() < deadline,
            "only {} of {count} entries arrived",
            into.len()
        );
        match follower.next(Duration::from_millis(500)).await {
            Ok(Some(Applied::Entries(entries))) => into.extend(entries),
            Ok(Some(Applied::Snapshot(snapshot))) => panic!("a snapshot at {}", snapshot.seq),
            Ok(None) => {}
            Err(Error::Unavailable { .. }) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(error) => panic!("following: {error}"),
        }
    }
}

/// Appends `entry-<n>` for each n, retrying (bounded) while etcd restarts. A retried append
/// whose first try committed would show as a duplicate payload, which the test would see.
async fn append_each(log: &EtcdLog, numbers: std::ops::Range<usize>) {
    for number in numbers {
        let deadline = Instant::now() + FOLLOW_BOUND;
        loop {
            match log.append(&[format!("entry-{number}").into_bytes()]).await {
                Ok(_) => break,
                Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("append {number}: {error}"),
            }
        }
    }
}

#[tokio::test]
async fn the_follower_sees_every_entry_in_order_across_an_etcd_restart() {
    let Some(mut etcd) = EtcdCluster::start(
        "the_follower_sees_every_entry_in_order_across_an_etcd_restart",
        1,
        required(),
    )
    .await
    else {
        return;
    };
    let writer = etcd.claimed_log("/follow/", "c").await;
    let mut follower = Follower::new(etcd.claimed_log("/follow/", "c").await, 1);
    let mut seen = Vec::new();
    append_each(&writer, 0..10).await;
    follow(&mut follower, 10, &mut seen).await;

    // The follower is now waiting on its watch; take etcd away under it and bring it back.
    etcd.kill(0);
    assert!(
        follower
            .next(Duration::from_millis(300))
            .await
            .ok()
            .flatten()
            .is_none()
    );
    etcd.restart(0).await;
    append_each(&writer, 10..30).await;
    follow(&mut follower, 30, &mut seen).await;

    assert_eq!(seen.len(), 30);
    for (index, entry) in seen.iter().enumerate() {
        assert_eq!(entry.seq, index as u64 + 1);
        assert_eq!(
            entry.bytes,
            format!("entry-{index}").into_bytes(),
            "entry {}",
            entry.seq
        );
    }
    assert_eq!(follower.next_seq(), 31);
}

#[tokio::test]
async fn a_fresh_member_catches_up_from_the_snapshot() {
    let Some(etcd) =
        EtcdCluster::start("a_fresh_member_catches_up_from_the_snapshot", 1, required()).await
    else {
        return;
    };
    let log = etcd.claimed_log("/snap/", "c").await;
    append_each(&log, 0..30).await;
    // Larger than one chunk, so the snapshot spans several keys.
    let state: Vec<u8> = (0..2 * SNAPSHOT_CHUNK_BYTES + 17)
        .map(|i| (i % 251) as u8)
        .collect();
    assert!(log.put_snapshot(20, &state).await.expect("snapshot"));
    assert!(
        !log.put_snapshot(10, b"older")
            .await
            .expect("an older snapshot")
    );

    let compacted = log
        .read_from(5, 10)
        .await
        .expect_err("entries under the snapshot");
    assert!(
        matches!(
            compacted,
            Error::Compacted {
                seq: 5,
                snapshot_seq: 20
            }
        ),
        "{compacted}"
    );
    let after = log
        .read_from(21, 64)
        .await
        .expect("entries after the snapshot");
    assert_eq!(after.entries.len(), 10);

    let mut follower = Follower::new(etcd.claimed_log("/snap/", "c").await, 1);
    match follower.next(Duration::from_secs(5)).await.expect("next") {
        Some(Applied::Snapshot(snapshot)) => {
            assert_eq!(snapshot.seq, 20);
            assert!(
                snapshot.bytes == state,
                "the snapshot's bytes came back changed"
            );
        }
        other => panic!("expected the snapshot, got {other:?}"),
    }
    let mut seen = Vec::new();
    follow(&mut follower, 10, &mut seen).await;
    let seqs: Vec<u64> = seen.iter().map(|entry| entry.seq).collect();
    assert_eq!(seqs, (21..=30).collect::<Vec<u64>>());
    assert_eq!(seen[0].bytes, b"entry-20".to_vec());

    // A newer snapshot replaces the old one, whose chunks go.
    assert!(
        log.put_snapshot(30, b"state at 30")
            .await
            .expect("snapshot")
    );
    let snapshot = log
        .read_snapshot()
        .await
        .expect("read")
        .expect("a snapshot");
    assert_eq!(
        (snapshot.seq, snapshot.bytes),
        (30, b"state at 30".to_vec())
    );
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("client");
    let chunks = raw
        .get(
            "/snap/snapshots/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .expect("list chunks");
    assert_eq!(
        chunks.kvs().len(),
        1,
        "only the newest snapshot's one chunk is left"
    );
    let log_keys = raw
        .get(
            "/snap/log/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .expect("count log keys");
    assert_eq!(
        log_keys.count(),
        0,
        "the log is compacted up to the snapshot"
    );
}

#[tokio::test]
async fn followers_and_snapshots_survive_etcd_compacting_its_revisions() {
    let Some(etcd) = EtcdCluster::start("followers_survive_etcd_compaction", 1, required()).await
    else {
        return;
    };
    let log = etcd.claimed_log("/compact/", "c").await;
    append_each(&log, 0..10).await;
    assert!(
        log.put_snapshot(10, b"state at 10")
            .await
            .expect("snapshot")
    );
    // A follower waiting on its watch from an old revision while etcd compacts past it.
    let mut watching = Follower::new(etcd.claimed_log("/compact/", "c").await, 11);
    assert!(
        watching
            .next(Duration::from_millis(200))
            .await
            .expect("next")
            .is_none()
    );
    append_each(&log, 10..20).await;

    // What an operator's --auto-compaction does: forget every revision before now.
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("client");
    let now = raw.get("/compact/head", None).await.expect("get");
    let revision = now.header().expect("a header").revision();
    raw.compact(revision, None)
        .await
        .expect("compact etcd's revisions");

    // The snapshot's pointer was written long before that revision; it still loads.
    let snapshot = log
        .read_snapshot()
        .await
        .expect("read")
        .expect("a snapshot");
    assert_eq!(
        (snapshot.seq, snapshot.bytes),
        (10, b"state at 10".to_vec())
    );
    let mut fresh = Follower::new(etcd.claimed_log("/compact/", "c").await, 1);
    assert!(matches!(
        fresh.next(Duration::from_secs(5)).await.expect("next"),
        Some(Applied::Snapshot(Snapshot { seq: 10, .. }))
    ));
    let mut seen = Vec::new();
    follow(&mut fresh, 10, &mut seen).await;
    assert_eq!(seen.first().map(|entry| entry.seq), Some(11));

    let mut resumed = Vec::new();
    follow(&mut watching, 10, &mut resumed).await;
    let seqs: Vec<u64> = resumed.iter().map(|entry| entry.seq).collect();
    assert_eq!(seqs, (11..=20).collect::<Vec<u64>>());
}

#[tokio::test]
async fn the_follower_sees_every_entry_in_order_while_etcd_members_die_and_return() {
    let Some(mut etcd) =
        EtcdCluster::start("the_follower_while_etcd_members_die", 3, required()).await
    else {
        return;
    };
    let writer = etcd.claimed_log("/rolling/", "c").await;
    let mut follower = Follower::new(etcd.claimed_log("/rolling/", "c").await, 1);
    let mut seen = Vec::new();
    // A rolling restart of etcd under the follower's watch, appends between the steps.
    for (step, member) in [0, 1, 2].into_iter().enumerate() {
        append_each(&writer, step * 10..step * 10 + 5).await;
        follow(&mut follower, step * 10 + 5, &mut seen).await;
        etcd.kill(member);
        append_each(&writer, step * 10 + 5..step * 10 + 10).await;
        etcd.restart(member).await;
    }
    follow(&mut follower, 30, &mut seen).await;
    let seqs: Vec<u64> = seen.iter().map(|entry| entry.seq).collect();
    assert_eq!(seqs, (1..=30).collect::<Vec<u64>>());
    for (index, entry) in seen.iter().enumerate() {
        assert_eq!(entry.bytes, format!("entry-{index}").into_bytes());
    }
}

/// Two members that snapshot the same state at once (a leadership changing hands mid-snapshot,
/// phase 2): the snapshot stays readable, its chunks intact.
#[tokio::test]
async fn two_members_snapshotting_one_state_at_once_leave_a_readable_snapshot() {
    let Some(etcd) = EtcdCluster::start("two_members_snapshotting_at_once", 1, required()).await
    else {
        return;
    };
    let one = etcd.claimed_log("/twice/", "c").await;
    let two = etcd.claimed_log("/twice/", "c").await;
    append_each(&one, 0..5).await;
    let bytes = vec![7u8; SNAPSHOT_CHUNK_BYTES + 10];
    for round in 0..5u64 {
        let seq = 1 + round;
        let (first, second) =
            tokio::join!(one.put_snapshot(seq, &bytes), two.put_snapshot(seq, &bytes));
        // Both may say `true`: the loser finds a pointer equal to its own (same state, same
        // bytes) and takes it for its retried transaction's; either way nothing is deleted
        // from under the pointer.
        first.expect("snapshot");
        second.expect("snapshot");

        let snapshot = one
            .read_snapshot()
            .await
            .expect("read")
            .expect("a snapshot");
        assert_eq!(snapshot.seq, seq);
        assert_eq!(snapshot.bytes, bytes);
    }
}

/// An imported pool: a first snapshot at 40 in an empty prefix, which a follower loads before the
/// entries appended after it (numbered from 41); a prefix that holds a log or a snapshot is
/// refused.
#[tokio::test]
async fn a_first_snapshot_starts_a_new_log_after_it() {
    let Some(etcd) = EtcdCluster::start("a_first_snapshot_starts_a_new_log", 1, required()).await
    else {
        return;
    };
    let fresh = EtcdLog::connect(&etcd.config("/import/"))
        .await
        .expect("connect");
    assert_eq!(fresh.count_keys().await.expect("count"), 0);
    assert_eq!(fresh.stored_cluster_id().await.expect("read"), None);
    let log = etcd.claimed_log("/import/", "c").await;
    assert_eq!(
        log.stored_cluster_id().await.expect("read").as_deref(),
        Some("c")
    );
    let state: Vec<u8> = (0..SNAPSHOT_CHUNK_BYTES + 5)
        .map(|i| (i % 13) as u8)
        .collect();
    log.install_first_snapshot(40, &state)
        .await
        .expect("install");
    assert_eq!(log.head().await.expect("head").seq, 40);
    let again = log
        .install_first_snapshot(40, b"other")
        .await
        .expect_err("a second first snapshot");
    assert!(matches!(again, Error::NotEmpty { .. }), "{again}");
    assert!(again.to_string().contains("--etcd-prefix"), "{again}");
    let appended = log.append(&[b"after".to_vec()]).await.expect("append");
    assert_eq!(appended, 41..=41);

    let mut follower = Follower::new(etcd.claimed_log("/import/", "c").await, 1);
    match follower.next(Duration::from_secs(5)).await.expect("next") {
        Some(Applied::Snapshot(Snapshot { seq, bytes })) => {
            assert_eq!(seq, 40);
            assert!(bytes == state, "the snapshot's bytes came back changed");
        }
        other => panic!("expected the snapshot, got {other:?}"),
    }
    let mut seen = Vec::new();
    follow(&mut follower, 1, &mut seen).await;
    assert_eq!(
        (seen[0].seq, seen[0].bytes.clone()),
        (41, b"after".to_vec())
    );

    // A prefix with a log (and no snapshot) is refused too, and keeps its log.
    let used = etcd.claimed_log("/used/", "d").await;
    append_each(&used, 0..3).await;
    let refused = used
        .install_first_snapshot(9, b"state")
        .await
        .expect_err("a prefix with a log");
    assert!(matches!(refused, Error::NotEmpty { .. }), "{refused}");
    assert_eq!(used.head().await.expect("head").seq, 3);
    assert!(used.count_keys().await.expect("count") >= 5);
}
