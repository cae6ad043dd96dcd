//! `Election`: which member runs the leader loop, by an etcd lease and a compare-and-create of
//! the `leader` key attached to it.
//!
//! Fencing has two halves. Locally, `is_leader` answers only until `deadline` past the last
//! keepalive that etcd answered, measured from when that keepalive was *sent*; etcd keeps the
//! lease at least `ttl` past when it *received* it, so with `deadline < ttl` this member stops
//! acting before the lease (and with it the `leader` key) can expire and another member can be
//! elected. In etcd, every leader-only write compares the `leader` key's create revision with
//! the one this member created (`Fence`), so a leader that was paused past its deadline and
//! acts anyway writes nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::connection::{Connection, RETRY_PAUSE};
use crate::error::{Error, Result};
use crate::log::{Fence, get_kv};

/// The lease's TTL and this member's own deadline inside it.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// Names the holder in the `leader` key (for operators: `etcdctl get <prefix>leader`).
    pub member: String,
    /// The etcd lease's TTL, whole seconds (etcd's unit), at least 2.
    pub lease_ttl: Duration,
    /// How long after sending an answered keepalive this member still acts as leader. Must be
    /// below `lease_ttl`; the gap covers clock-rate differences and etcd's own timing.
    pub deadline: Duration,
}

impl ElectionConfig {
    /// A lease of `lease_ttl`, acting for two thirds of it after each answered keepalive.
    pub fn new(member: &str, lease_ttl: Duration) -> ElectionConfig {
        ElectionConfig {
            member: member.to_string(),
            lease_ttl,
            deadline: lease_ttl * 2 / 3,
        }
    }

    fn keepalive_interval(&self) -> Duration {
        // Three tries inside the deadline before it passes.
        self.deadline / 4
    }
}

/// Held while this member leads: `fence` conditions its leader-only writes, and its
/// `leader_revision` is the leadership's identity (what the Raft store calls the term).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leadership {
    pub fence: Fence,
    pub lease_id: i64,
}

#[derive(Debug)]
struct LeaseState {
    lease_id: i64,
    /// The member may act as leader until then; `None` once the lease is known lost.
    valid_until: Option<Instant>,
}

/// One member's candidacy. Dropping it stops the keepalives: the lease then expires after its
/// TTL and another member takes over (`resign` hands over at once).
pub struct Election {
    connection: Connection,
    config: ElectionConfig,
    lease: Option<Arc<Mutex<LeaseState>>>,
    keepalive: Option<JoinHandle<()>>,
    leadership: Option<Leadership>,
}

impl Election {
    pub fn new(connection: Connection, config: ElectionConfig) -> Election {
        assert!(
            config.lease_ttl >= Duration::from_secs(2),
            "etcd leases are whole seconds"
        );
        assert!(
            config.deadline < config.lease_ttl,
            "the deadline must fall inside the lease"
        );
        assert!(!config.member.is_empty());
        Election {
            connection,
            config,
            lease: None,
            keepalive: None,
            leadership: None,
        }
    }

    /// `Some` while this member may act as leader: it won, and its lease was confirmed alive
    /// within `deadline`. Call before every leader action; pass its fence to the writes.
    pub fn is_leader(&self) -> Option<Leadership> {
        let leadership = self.leadership?;
        let lease = self.lease.as_ref()?;
        let state = lease
            .lock()
            .expect("the lease state lock is never poisoned");
        let valid = state.lease_id == leadership.lease_id
            && state
                .valid_until
                .is_some_and(|until| Instant::now() < until);
        valid.then_some(leadership)
    }

    /// Stops acting as leader at once, keeping the lease: for when a fenced write said
    /// `Error::Deposed` while the lease still looked alive (the `leader` key was deleted or
    /// replaced behind this member's back). `campaign` may win again, under a new fence.
    pub fn step_down(&mut self) {
        if let Some(leadership) = self.leadership.take() {
            tracing::warn!(
                member = self.config.member,
                leader_revision = leadership.fence.leader_revision,
                "stepped down: the leadership ended in etcd"
            );
        }
    }

    /// Who leads now, as etcd has it: the leader key's value (the member's name) and its
    /// leadership. Followers use it to find where to forward what only the leader keeps.
    pub async fn current_leader(&self) -> Result<Option<(String, Fence)>> {
        let key = self.connection.keys().leader();
        let response = self
            .connection
            .call_retrying("read the leader key", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        Ok(response.kvs().first().map(|kv| {
            let member = String::from_utf8_lossy(kv.value()).into_owned();
            let fence = Fence {
                leader_revision: kv.create_revision(),
            };
            (member, fence)
        }))
    }

    /// Tries to become leader, waiting up to `wait` for the current leader to go. `Ok(None)`
    /// when another member still leads at the end of `wait`. etcd being unreachable is retried
    /// until then too (an etcd election after a member died takes a moment); the error is
    /// returned only when it lasts past `wait`.
    pub async fn campaign(&mut self, wait: Duration) -> Result<Option<Leadership>> {
        if let Some(leadership) = self.is_leader() {
            return Ok(Some(leadership));
        }
        let deadline = Instant::now() + wait;
        loop {
            match self.campaign_until(deadline).await {
                Err(Error::Unavailable { reason, .. })
                    if Instant::now() + RETRY_PAUSE < deadline =>
                {
                    tracing::debug!(reason, "etcd unavailable while campaigning; trying again");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                other => return other,
            }
        }
    }

    async fn campaign_until(&mut self, deadline: Instant) -> Result<Option<Leadership>> {
        loop {
            let lease_id = self.live_lease().await?;
            let keys = self.connection.keys().clone();
            let txn = Txn::new()
                .when([Compare::create_revision(keys.leader(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    keys.leader(),
                    self.config.member.clone(),
                    Some(PutOptions::new().with_lease(lease_id)),
                )])
                .or_else([TxnOp::get(keys.leader(), None)]);
            let response = self
                .connection
                // Safe to repeat: a retry of a campaign that won finds its own lease's key.
                .call_retrying("campaign for leader", |mut client| {
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                })
                .await?;
            let revision = response
                .header()
                .map(|header| header.revision())
                .unwrap_or(0);
            let holder = response.op_responses().first().and_then(get_kv).cloned();
            let leader_revision = match (&holder, response.succeeded()) {
                (_, true) => Some(revision),
                // Our own key from an earlier campaign on this lease: still ours.
                (Some(kv), false) if kv.lease() == lease_id => Some(kv.create_revision()),
                _ => None,
            };
            if let Some(leader_revision) = leader_revision {
                assert!(leader_revision > 0);
                let leadership = Leadership {
                    fence: Fence { leader_revision },
                    lease_id,
                };
                self.leadership = Some(leadership);
                tracing::info!(
                    member = self.config.member,
                    leader_revision,
                    "became leader"
                );
                return Ok(self.is_leader());
            }
            let holder_name = holder
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                .unwrap_or_default();
            tracing::debug!(holder = holder_name, "another member leads; waiting");
            if !self.wait_for_vacancy(revision + 1, deadline).await? {
                return Ok(None);
            }
        }
    }

    /// Waits until the `leader` key is deleted (after `from_revision`) or `deadline` passes.
    async fn wait_for_vacancy(&self, from_revision: i64, deadline: Instant) -> Result<bool> {
        let key = self.connection.keys().leader();
        let options = WatchOptions::new().with_start_revision(from_revision);
        let mut watch = self
            .connection
            .call_retrying("watch the leader key", |mut client| {
                let (key, options) = (key.clone(), options.clone());
                async move { client.watch(key, Some(options)).await }
            })
            .await?;
        loop {
            match tokio::time::timeout_at(deadline, watch.message()).await {
                Err(_) => return Ok(false),
                Ok(Ok(Some(response))) => {
                    let deleted = response
                        .events()
                        .iter()
                        .any(|event| event.event_type() == EventType::Delete);
                    if deleted || response.canceled() || response.compact_revision() > 0 {
                        return Ok(true);
                    }
                }
                // A broken watch: campaign again, which re-reads the key.
                Ok(Ok(None)) | Ok(Err(_)) => return Ok(Instant::now() < deadline),
            }
        }
    }

    /// The current lease if it is still alive, else a fresh one with its keepalive task.
    async fn live_lease(&mut self) -> Result<i64> {
        if let Some(lease) = &self.lease {
            let state = lease
                .lock()
                .expect("the lease state lock is never poisoned");
            if state
                .valid_until
                .is_some_and(|until| Instant::now() < until)
            {
                return Ok(state.lease_id);
            }
        }
        self.stop_keepalive();
        self.leadership = None;
        let ttl_s = self.config.lease_ttl.as_secs() as i64;
        let sent = Instant::now();
        let granted = self
            .connection
            .call("grant a lease", |mut client| async move {
                client.lease_grant(ttl_s, None).await
            })
            .await?;
        let lease_id = granted.id();
        let state = Arc::new(Mutex::new(LeaseState {
            lease_id,
            valid_until: Some(sent + self.config.deadline),
        }));
        self.keepalive = Some(tokio::spawn(keep_alive(
            self.connection.clone(),
            self.config.clone(),
            Arc::clone(&state),
        )));
        self.lease = Some(state);
        Ok(lease_id)
    }

    /// Gives up leadership now: deletes the `leader` key if it is still ours and revokes the
    /// lease, so another member is elected without waiting for the TTL.
    pub async fn resign(&mut self) -> Result<()> {
        let leadership = self.leadership.take();
        self.stop_keepalive();
        let lease_id = self.lease.take().map(|lease| {
            lease
                .lock()
                .expect("the lease state lock is never poisoned")
                .lease_id
        });
        if let Some(leadership) = leadership {
            let key = self.connection.keys().leader();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    key.clone(),
                    CompareOp::Equal,
                    leadership.fence.leader_revision,
                )])
                .and_then([TxnOp::delete(key, None)]);
            self.connection
                .call_retrying("resign", |mut client| {
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                })
                .await?;
        }
        if let Some(lease_id) = lease_id {
            let revoked = self
                .connection
                .call_retrying("revoke the lease", |mut client| async move {
                    client.lease_revoke(lease_id).await
                })
                .await;
            match revoked {
                Ok(_) => {}
                // Already gone (expired, or a retried revoke whose first try worked): the goal.
                Err(Error::Rejected { source, .. }) => {
                    tracing::debug!(lease_id, %source, "the lease was already gone");
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    fn stop_keepalive(&mut self) {
        if let Some(task) = self.keepalive.take() {
            task.abort();
        }
        if let Some(lease) = &self.lease {
            lease
                .lock()
                .expect("the lease state lock is never poisoned")
                .valid_until = None;
        }
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        self.stop_keepalive();
    }
}

/// Renews the lease every `keepalive_interval`, moving `valid_until` to `sent + deadline` on
/// each answer. Ends (marking the lease lost) when etcd says the lease is gone, or when the
/// deadline passes without an answer: a late answer must not revive a leadership this member
/// may already have stopped acting on.
async fn keep_alive(connection: Connection, config: ElectionConfig, state: Arc<Mutex<LeaseState>>) {
    let lease_id = state
        .lock()
        .expect("the lease state lock is never poisoned")
        .lease_id;
    let mut stream = None;
    loop {
        tokio::time::sleep(config.keepalive_interval()).await;
        let valid_until = state
            .lock()
            .expect("the lease state lock is never poisoned")
            .valid_until;
        let Some(valid_until) = valid_until else {
            return;
        };
        if Instant::now() >= valid_until {
            tracing::warn!(
                lease_id,
                "no keepalive answered within the deadline; leadership ends"
            );
            break;
        }
        let sent = Instant::now();
        if stream.is_none() {
            stream = connection
                .call("keep the lease alive", |mut client| async move {
                    client.lease_keep_alive(lease_id).await
                })
                .await
                .ok();
        }
        let Some((keeper, answers)) = stream.as_mut() else {
            continue;
        };
        let answer = tokio::time::timeout_at(valid_until, async {
            keeper.keep_alive().await?;
            answers.message().await
        })
        .await;
        match answer {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                let mut state = state
                    .lock()
                    .expect("the lease state lock is never poisoned");
                if state.valid_until.is_some() {
                    state.valid_until = Some(sent + config.deadline);
                }
            }
            Ok(Ok(Some(_))) => {
                tracing::warn!(lease_id, "etcd says the lease expired; leadership ends");
                break;
            }
            Ok(Ok(None)) | Ok(Err(_)) => stream = None,
            Err(_) => {}
        }
    }
    state
        .lock()
        .expect("the lease state lock is never poisoned")
        .valid_until = None;
}

impl From<Leadership> for Fence {
    fn from(leadership: Leadership) -> Fence {
        leadership.fence
    }
}
