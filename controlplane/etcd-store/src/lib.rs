//! vgpu-cp's replicated state on an existing etcd cluster: the command log (`EtcdLog`), every
//! member's apply stream (`Follower`) and apply task (`Applier`, with linearizable reads),
//! snapshots with log compaction, leader election with fencing (`Election`), and which members
//! are up (`Presence`). See
//! `docs/design/etcd-store.md` for how this maps onto what the Raft store guarantees.
//!
//! The crate knows bytes and sequence numbers, not `PoolState`: vgpu-cp encodes its commands and
//! snapshots and applies them. It does not depend on openraft or vgpu-cp, so it builds and tests
//! on its own against a real etcd.

mod applier;
mod connection;
mod election;
mod error;
mod follower;
mod keys;
mod log;
mod presence;
mod snapshot;
pub mod testing;

pub use applier::Applier;
pub use connection::{Connection, DECODE_BYTES_MAX, EtcdConfig, TlsPem};
pub use election::{Election, ElectionConfig, Leadership};
pub use error::{Error, Result};
pub use follower::{Applied, Follower};
pub use keys::{Keys, SEQ_DIGITS};
pub use log::{
    APPEND_ATTEMPTS_MAX, APPEND_BYTES_MAX, APPEND_ENTRIES_MAX, Entry, EtcdLog, Fence, Head,
    READ_ENTRIES_MAX, ReadBatch,
};
pub use presence::{MEMBERS_MAX, Presence};
pub use snapshot::{SNAPSHOT_CHUNK_BYTES, SNAPSHOT_CHUNKS_MAX, Snapshot, SnapshotPointer};
