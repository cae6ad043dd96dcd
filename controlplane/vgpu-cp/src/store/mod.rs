//! Durable storage for Raft: the log and vote ([`LogStore`], redb) and the state machine with its
//! snapshots ([`StateMachineStore`]).

mod log_store;
mod state_machine;

pub use log_store::{LogStore, WriteFault, WriteMode};

/// Counters of the log writer.
pub mod log_store_counters {
    pub use super::log_store::{LOG_APPEND_CALLS, LOG_ENTRIES_APPENDED, LOG_TRANSACTIONS};
}
pub use state_machine::{
    Applied, Shared, StateMachineStore, decode_pool_snapshot, encode_pool_snapshot,
    write_first_snapshot,
};

#[cfg(test)]
mod conformance_test;
