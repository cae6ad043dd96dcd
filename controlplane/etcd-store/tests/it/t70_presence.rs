//! Presence: members registered under `members/` are listed; one that leaves drops out at once,
//! one that stops renewing drops out when its lease expires, and renewing after that registers
//! it again.

use std::time::Duration;

use etcd_store::{Connection, Presence};
use tokio::time::Instant;

use crate::etcd_cluster::{EtcdCluster, required};

const TTL: Duration = Duration::from_secs(2);

/// Polls (bounded) until the listed member ids are `wanted`.
async fn wait_members(connection: &Connection, wanted: &[u64]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let members = Presence::members(connection).await.expect("list");
        let ids: Vec<u64> = members.iter().map(|(id, _)| *id).collect();
        if ids == wanted {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "members {ids:?}, wanted {wanted:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn members_are_listed_while_their_leases_live() {
    let Some(etcd) = EtcdCluster::start("members_are_listed", 1, required()).await else {
        return;
    };
    let connection = Connection::connect(&etcd.config("/presence/"))
        .await
        .expect("connect");
    let mut one = Presence::new(connection.clone(), 1, "10.0.0.1:7401", TTL);
    let mut two = Presence::new(connection.clone(), 2, "10.0.0.2:7401", TTL);
    one.renew().await.expect("register 1");
    two.renew().await.expect("register 2");
    let members = Presence::members(&connection).await.expect("list");
    assert_eq!(
        members,
        [
            (1, "10.0.0.1:7401".to_owned()),
            (2, "10.0.0.2:7401".to_owned())
        ]
    );
    // Renewing keeps a registration; leaving removes it at once.
    one.renew().await.expect("renew 1");
    two.leave().await.expect("leave");
    wait_members(&connection, &[1]).await;
    // Member 1 stops renewing: its registration lapses with the lease, then comes back.
    wait_members(&connection, &[]).await;
    one.renew().await.expect("register again");
    wait_members(&connection, &[1]).await;
}
