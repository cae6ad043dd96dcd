//! The apply task and linearizable reads: after another member's append is acknowledged, a
//! linearizable read on this member sees it; a state machine that refuses an entry stops the
//! task with its reason.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_store::{Applied, Applier, Error};

use crate::etcd_cluster::{EtcdCluster, required};

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_linearizable_read_sees_every_append_acknowledged_before_it() {
    let Some(etcd) =
        EtcdCluster::start("a_linearizable_read_sees_every_append", 3, required()).await
    else {
        return;
    };
    // Two members: `writer` appends, `reader` applies into its state and reads linearizably.
    let writer = etcd.claimed_log("/lin/", "c").await;
    let mut reader_config = etcd.config("/lin/");
    reader_config.endpoints = vec![etcd.endpoint(2)];
    let mut reader_log = etcd_store::EtcdLog::connect(&reader_config)
        .await
        .expect("connect");
    reader_log.claim_cluster("c").await.expect("claim");
    let state: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let applied_state = Arc::clone(&state);
    let applier = Applier::spawn(reader_log, 1, move |applied| {
        let Applied::Entries(entries) = applied else {
            return Err("no snapshot was taken".into());
        };
        let mut state = applied_state.lock().expect("state lock");
        for entry in entries {
            assert_eq!(entry.seq as usize, state.len() + 1, "applied in order");
            state.push(entry.bytes.clone());
        }
        Ok(())
    });
    for round in 0..20u32 {
        let bytes = format!("write {round}").into_bytes();
        let seqs = writer
            .append(std::slice::from_ref(&bytes))
            .await
            .expect("append");
        let head = applier.linearize(WAIT).await.expect("linearize");
        assert!(head >= *seqs.end());
        // Read right after `linearize`, without waiting: the write must be there.
        let state = state.lock().expect("state lock");
        assert_eq!(
            state.get(*seqs.end() as usize - 1),
            Some(&bytes),
            "round {round}"
        );
    }
    assert!(applier.health().is_ok());
    assert_eq!(applier.applied(), 20);
}

#[tokio::test]
async fn a_refused_entry_stops_the_apply_task_with_its_reason() {
    let Some(etcd) =
        EtcdCluster::start("a_refused_entry_stops_the_apply_task", 1, required()).await
    else {
        return;
    };
    let log = etcd.claimed_log("/stop/", "c").await;
    log.append(&[b"good".to_vec()]).await.expect("append");
    log.append(&[b"corrupt".to_vec()]).await.expect("append");
    let applier = Applier::spawn(log.clone(), 1, |applied| match applied {
        Applied::Entries(entries) if entries.iter().any(|entry| entry.bytes == b"corrupt") => {
            Err("entry does not decode".into())
        }
        _ => Ok(()),
    });
    let error = applier
        .wait_applied(2, WAIT)
        .await
        .expect_err("the task stopped");
    assert!(matches!(error, Error::Stopped { .. }), "{error}");
    let health = applier.health().expect_err("unhealthy");
    assert!(health.contains("entry does not decode"), "{health}");

    // And a member that cannot catch up in time says how far it got.
    let fresh = Applier::spawn(log, 1, |_| Ok(()));
    fresh.wait_applied(2, WAIT).await.expect("catches up");
    let lagging = fresh
        .wait_applied(99, Duration::from_millis(200))
        .await
        .expect_err("no entry 99");
    assert!(
        matches!(
            lagging,
            Error::Lagging {
                applied: 2,
                wanted: 99,
                ..
            }
        ),
        "{lagging}"
    );
}
