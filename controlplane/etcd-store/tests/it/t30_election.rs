//! Election: one leader among candidates; revoking its lease, resigning or dropping it hands
//! over; a deposed leader's fenced append writes nothing.

use std::time::Duration;

use etcd_store::{Connection, Election, ElectionConfig, Error};
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, required};

const LEASE_TTL: Duration = Duration::from_secs(2);

async fn candidate(etcd: &EtcdCluster, member: &str) -> Election {
    let connection = Connection::connect(&etcd.config("/elect/"))
        .await
        .expect("connect");
    Election::new(connection, ElectionConfig::new(member, LEASE_TTL))
}

/// Polls (bounded) until `election` no longer believes it leads.
async fn wait_not_leader(election: &Election, bound: Duration) {
    let deadline = Instant::now() + bound;
    while election.is_leader().is_some() {
        assert!(
            Instant::now() < deadline,
            "still acting as leader after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn one_leader_and_a_revoked_lease_hands_over_and_fences_the_old_leader() {
    let Some(etcd) =
        EtcdCluster::start("one_leader_and_a_revoked_lease_hands_over", 1, required()).await
    else {
        return;
    };
    let log = etcd.claimed_log("/elect/", "c").await;
    let mut candidates = Vec::new();
    for member in ["a", "b", "c"] {
        candidates.push(candidate(&etcd, member).await);
    }
    let mut won = Vec::new();
    for (index, election) in candidates.iter_mut().enumerate() {
        if let Some(leadership) = election
            .campaign(Duration::from_millis(200))
            .await
            .expect("campaign")
        {
            won.push((index, leadership));
        }
    }
    assert_eq!(won.len(), 1, "exactly one leader: {won:?}");
    let (leader, leadership) = won[0];
    let named = candidates[(leader + 1) % 3]
        .current_leader()
        .await
        .expect("read the leader");
    let names = ["a", "b", "c"];
    assert_eq!(named, Some((names[leader].to_string(), leadership.fence)));
    log.append_fenced(&[b"decided by the leader".to_vec()], leadership.fence)
        .await
        .expect("the leader's fenced append");

    // The leader's etcd session ends: its lease is revoked (as if it expired).
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("client");
    raw.lease_revoke(leadership.lease_id).await.expect("revoke");
    let next = (leader + 1) % candidates.len();
    let started = Instant::now();
    let successor = candidates[next]
        .campaign(Duration::from_secs(5))
        .await
        .expect("campaign")
        .expect("a successor once the lease is gone");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(successor.fence.leader_revision > leadership.fence.leader_revision);

    // The old leader's writes fail in etcd whatever it believes; and it stops believing.
    let deposed = log
        .append_fenced(&[b"late decision".to_vec()], leadership.fence)
        .await
        .expect_err("a deposed leader's append");
    assert!(matches!(deposed, Error::Deposed { .. }), "{deposed}");
    wait_not_leader(&candidates[leader], LEASE_TTL).await;
    log.append_fenced(&[b"the successor decides".to_vec()], successor.fence)
        .await
        .expect("the successor's fenced append");
    let batch = log.read_from(1, 10).await.expect("read");
    let written: Vec<&[u8]> = batch
        .entries
        .iter()
        .map(|entry| entry.bytes.as_slice())
        .collect();
    assert_eq!(
        written,
        [&b"decided by the leader"[..], b"the successor decides"]
    );
}

#[tokio::test]
async fn resigning_hands_over_at_once_and_dropping_after_the_ttl() {
    let Some(etcd) = EtcdCluster::start("resigning_hands_over_at_once", 1, required()).await else {
        return;
    };
    let mut a = candidate(&etcd, "a").await;
    let mut b = candidate(&etcd, "b").await;
    let first = a
        .campaign(Duration::ZERO)
        .await
        .expect("campaign")
        .expect("a leads");
    assert!(
        b.campaign(Duration::from_millis(100))
            .await
            .expect("campaign")
            .is_none()
    );

    a.resign().await.expect("resign");
    assert!(a.is_leader().is_none());
    let started = Instant::now();
    let second = b
        .campaign(Duration::from_secs(5))
        .await
        .expect("campaign")
        .expect("b leads");
    // At once: before the lease could have run out (a resignation that only waited for the
    // lease would take at least its TTL); the bound leaves a busy CI machine room.
    assert!(
        started.elapsed() < LEASE_TTL,
        "a resignation hands over at once, not at the lease's expiry: {:?}",
        started.elapsed()
    );
    assert!(second.fence.leader_revision > first.fence.leader_revision);

    // A leader that vanishes without resigning (a crash): its lease runs out, then `a` wins.
    drop(b);
    let started = Instant::now();
    let third = a
        .campaign(Duration::from_secs(20))
        .await
        .expect("campaign")
        .expect("a leads again");
    let waited = started.elapsed();
    // The lease's TTL and etcd's expiry check; generous, for a busy CI machine.
    assert!(
        waited < LEASE_TTL + Duration::from_secs(10),
        "handed over after {waited:?}"
    );
    assert!(third.fence.leader_revision > second.fence.leader_revision);
}

#[tokio::test]
async fn a_leader_cut_off_from_etcd_stops_acting_before_a_successor_is_elected() {
    let Some(mut etcd) =
        EtcdCluster::start("a_leader_cut_off_from_etcd_stops_acting", 3, required()).await
    else {
        return;
    };
    // `a` reaches etcd only through member 2; `b` through members 0 and 1.
    let mut only_member_2 = etcd.config("/elect/");
    only_member_2.endpoints = vec![etcd.endpoint(2)];
    let connection = Connection::connect(&only_member_2).await.expect("connect");
    let mut a = Election::new(connection, ElectionConfig::new("a", LEASE_TTL));
    let mut others = etcd.config("/elect/");
    others.endpoints = vec![etcd.endpoint(0), etcd.endpoint(1)];
    let connection = Connection::connect(&others).await.expect("connect");
    let mut b = Election::new(connection, ElectionConfig::new("b", LEASE_TTL));
    let leadership = a
        .campaign(Duration::ZERO)
        .await
        .expect("campaign")
        .expect("a leads");

    etcd.kill(2);
    let cut_off = Instant::now();
    let a_stops = async {
        while a.is_leader().is_some() {
            assert!(
                cut_off.elapsed() < Duration::from_secs(10),
                "a never stopped leading"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Instant::now()
    };
    let b_wins = async {
        let won = b.campaign(Duration::from_secs(15)).await.expect("campaign");
        (Instant::now(), won.expect("b leads once a's lease expired"))
    };
    let (stopped, (elected, successor)) = tokio::join!(a_stops, b_wins);
    assert!(
        stopped < elected,
        "a acted as leader until {:?} after the cut, b was elected at {:?}",
        stopped - cut_off,
        elected - cut_off
    );
    // a stops within its deadline (two thirds of the TTL) of its last answered keepalive.
    assert!(
        stopped - cut_off <= LEASE_TTL,
        "a stopped {:?} after the cut",
        stopped - cut_off
    );
    assert!(successor.fence.leader_revision > leadership.fence.leader_revision);
}

#[tokio::test]
async fn a_leader_whose_key_was_deleted_behind_its_back_steps_down_and_campaigns_again() {
    let Some(etcd) = EtcdCluster::start("a_leader_whose_key_was_deleted", 1, required()).await
    else {
        return;
    };
    let log = etcd.claimed_log("/elect/", "c").await;
    let mut a = candidate(&etcd, "a").await;
    let first = a
        .campaign(Duration::ZERO)
        .await
        .expect("campaign")
        .expect("a leads");
    // Someone deletes the key (an operator, a script): the lease lives on.
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("client");
    raw.delete("/elect/leader", None).await.expect("delete");
    assert!(a.is_leader().is_some(), "the lease alone cannot tell");
    let deposed = log
        .append_fenced(&[b"decision".to_vec()], first.fence)
        .await
        .expect_err("the fence is gone");
    assert!(matches!(deposed, Error::Deposed { .. }), "{deposed}");
    a.step_down();
    assert!(a.is_leader().is_none());
    let again = a
        .campaign(Duration::ZERO)
        .await
        .expect("campaign")
        .expect("a leads again");
    assert_eq!(again.lease_id, first.lease_id, "the same lease");
    assert!(again.fence.leader_revision > first.fence.leader_revision);
    log.append_fenced(&[b"decision".to_vec()], again.fence)
        .await
        .expect("fenced on the new leadership");
}
