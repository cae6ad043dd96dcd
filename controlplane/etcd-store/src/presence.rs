//! `Presence`: which members are up. Each member keeps `members/<id>` (its address) on a lease of
//! its own, renewed by `renew`; a member that stops renewing disappears after the lease's TTL,
//! one that leaves revokes it at once. `members` lists them with one range read.
//!
//! This is not a vote: etcd's own membership is the operator's, and any member may append. It is
//! what `vgpuctl cluster status` shows on the etcd store.

use std::time::Duration;

use etcd_client::{GetOptions, PutOptions};

use crate::connection::Connection;
use crate::error::{Error, Result};
use crate::keys::prefix_end;

/// Members one `members` read lists at most.
pub const MEMBERS_MAX: i64 = 1024;

/// One member's registration under `members/<id>`.
pub struct Presence {
    connection: Connection,
    id: u64,
    value: String,
    ttl: Duration,
    lease_id: Option<i64>,
}

impl Presence {
    /// Registers member `id` with `value` (its address) on a lease of `ttl` (whole seconds, at
    /// least 2) once `renew` is called.
    pub fn new(connection: Connection, id: u64, value: &str, ttl: Duration) -> Presence {
        assert!(
            ttl >= Duration::from_secs(2),
            "etcd leases are whole seconds"
        );
        assert!(!value.is_empty());
        Presence {
            connection,
            id,
            value: value.to_string(),
            ttl,
            lease_id: None,
        }
    }

    /// How often to call `renew` so the key never lapses while this member runs.
    pub fn renew_interval(&self) -> Duration {
        self.ttl / 3
    }

    /// Renews the lease, or (none yet, or it expired) grants a new one and puts the key on it.
    pub async fn renew(&mut self) -> Result<()> {
        if let Some(lease_id) = self.lease_id {
            let answer = self
                .connection
                .call("renew the member's lease", |mut client| async move {
                    let (mut keeper, mut answers) = client.lease_keep_alive(lease_id).await?;
                    keeper.keep_alive().await?;
                    answers.message().await
                })
                .await;
            match answer {
                Ok(Some(answer)) if answer.ttl() > 0 => return Ok(()),
                // Expired (etcd answers a TTL of 0, or "lease not found"), or unreachable: a new
                // lease and a put on it. If etcd is unreachable the grant fails too; if the old
                // lease still lived, the key moves to the new one and the old one lapses alone.
                Ok(_) => tracing::info!(member = self.id, "the member's lease expired"),
                Err(error) => {
                    tracing::info!(member = self.id, %error, "could not renew the member's lease");
                }
            }
            self.lease_id = None;
        }
        let ttl_s = self.ttl.as_secs() as i64;
        let granted = self
            .connection
            .call("grant the member's lease", |mut client| async move {
                client.lease_grant(ttl_s, None).await
            })
            .await?;
        let lease_id = granted.id();
        let (key, value) = (self.connection.keys().member(self.id), self.value.clone());
        self.connection
            .call_retrying("register the member", |mut client| {
                let (key, value) = (key.clone(), value.clone());
                let options = PutOptions::new().with_lease(lease_id);
                async move { client.put(key, value, Some(options)).await }
            })
            .await?;
        self.lease_id = Some(lease_id);
        Ok(())
    }

    /// Removes the registration at once (revokes its lease).
    pub async fn leave(&mut self) -> Result<()> {
        let Some(lease_id) = self.lease_id.take() else {
            return Ok(());
        };
        match self
            .connection
            .call_retrying("revoke the member's lease", |mut client| async move {
                client.lease_revoke(lease_id).await
            })
            .await
        {
            Ok(_) | Err(Error::Rejected { .. }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// The registered members, by id: `(id, value)`.
    pub async fn members(connection: &Connection) -> Result<Vec<(u64, String)>> {
        let keys = connection.keys().clone();
        let prefix = keys.members_prefix();
        let response = connection
            .call_retrying("list the members", |mut client| {
                let options = GetOptions::new()
                    .with_range(prefix_end(&prefix))
                    .with_limit(MEMBERS_MAX);
                let prefix = prefix.clone();
                async move { client.get(prefix, Some(options)).await }
            })
            .await?;
        let mut members: Vec<(u64, String)> = response
            .kvs()
            .iter()
            .filter_map(|kv| {
                let id = keys.member_id(kv.key())?;
                Some((id, String::from_utf8_lossy(kv.value()).into_owned()))
            })
            .collect();
        members.sort();
        assert!(members.len() <= MEMBERS_MAX as usize);
        Ok(members)
    }
}
