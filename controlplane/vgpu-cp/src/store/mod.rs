//! Durable storage for Raft: the log and vote ([`LogStore`], redb) and the state machine with its
//! snapshots ([`StateMachineStore`]).

mod log_store;
mod state_machine;

pub use log_store::LogStore;
pub use state_machine::{Applied, Shared, StateMachineStore};

#[cfg(test)]
mod conformance_test;
