//! `Error`: what went wrong talking to etcd, each variant saying what the operator or caller
//! should do next.

use std::time::Duration;

/// Everything `etcd-store` can fail with. Operating errors only: misuse of the API is an
/// assertion.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The settings cannot work (no endpoint, a prefix without a trailing `/`, unreadable TLS).
    #[error("invalid etcd settings: {0}")]
    Config(String),

    /// No answer within the bound. For a write the outcome is unknown: the transaction may have
    /// committed just before the connection failed.
    #[error(
        "etcd at {endpoints} unreachable within {} ms during {operation} ({reason}): check \
         --etcd-endpoints and that a quorum of etcd members is up",
        timeout.as_millis()
    )]
    Unavailable {
        endpoints: String,
        operation: &'static str,
        timeout: Duration,
        reason: String,
    },

    /// The TLS handshake failed: a certificate one side does not trust, or TLS on one side only.
    #[error(
        "TLS to etcd at {endpoints} failed during {operation} ({reason}): check that the CA file \
         signed etcd's server certificate, that etcd trusts the CA of the client certificate \
         (its --trusted-ca-file), and that the endpoints say https://"
    )]
    Tls {
        endpoints: String,
        operation: &'static str,
        reason: String,
    },

    /// etcd answered, and refused (permission denied, a request past its size limit, ...).
    #[error("etcd at {endpoints} refused {operation}: {source}")]
    Rejected {
        endpoints: String,
        operation: &'static str,
        #[source]
        source: etcd_client::Error,
    },

    /// The prefix is another cluster's: its `cluster` key names a different cluster id.
    #[error(
        "etcd prefix {prefix} holds the state of cluster {found}, not {expected}: choose another \
         --etcd-prefix, or point this member at cluster {found}"
    )]
    OtherCluster {
        prefix: String,
        found: String,
        expected: String,
    },

    /// A first snapshot (an imported pool) may go only into a prefix that holds no log and no
    /// snapshot yet.
    #[error(
        "etcd prefix {prefix} already holds {what}: an imported pool starts only in a new, empty \
         prefix; choose another --etcd-prefix"
    )]
    NotEmpty { prefix: String, what: String },

    /// A log operation before `EtcdLog::claim_cluster`.
    #[error("etcd prefix {prefix} is not claimed by this member yet: call claim_cluster first")]
    Unclaimed { prefix: String },

    /// Every attempt found another writer's entry at the head; none of this append was written.
    #[error(
        "append lost the race for the log's head {attempts} times in a row (another writer \
         appends at the same time); nothing was written, retry"
    )]
    Contended { attempts: u32 },

    /// A leader-only write whose leadership has ended; nothing was written.
    #[error(
        "not the leader any more (the leadership created at etcd revision {revision} has ended): \
         nothing was written; the current leader decides"
    )]
    Deposed { revision: i64 },

    /// Entries were deleted under a snapshot: load the snapshot, then read on after it.
    #[error(
        "log entries from {seq} were compacted into the snapshot at {snapshot_seq}: load the \
         snapshot and read on from {}",
        snapshot_seq + 1
    )]
    Compacted { seq: u64, snapshot_seq: u64 },

    /// This member has not applied far enough within the wait (it is catching up, or cut off
    /// from etcd).
    #[error(
        "this member applied the log up to {applied}, not yet {wanted}, within {} ms: it is \
         catching up with etcd; retry, and check its connection to etcd if this lasts",
        waited.as_millis()
    )]
    Lagging {
        applied: u64,
        wanted: u64,
        waited: Duration,
    },

    /// The member's apply task stopped for good (its state machine refused an entry).
    #[error("{reason}")]
    Stopped { reason: String },

    /// A key under the prefix does not hold what this crate writes there.
    #[error("etcd key {key} is corrupt ({reason}): restore the prefix from a backup")]
    Corrupt { key: String, reason: String },

    /// A write past the limits etcd accepts by default (`--max-request-bytes`, `--max-txn-ops`).
    #[error("{what} of {size} passes the limit of {limit}")]
    TooLarge {
        what: &'static str,
        size: usize,
        limit: usize,
    },
}

/// This crate's `Result`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
