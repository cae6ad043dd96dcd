//! The vgpu placement engine: a pure, deterministic core. It takes [`Event`]s and returns
//! [`Command`]s; it owns the pool's capacity bookkeeping (nodes, GPUs, who holds which slice) and
//! the pending queue.
//!
//! **Architecture Invariant:** this crate does no I/O, reads no clock and draws no random numbers,
//! and must not depend on tokio, openraft or tonic. The same sequence of events gives the same
//! commands and the same state on every replica; that is what lets the control plane run it inside
//! the Raft state machine's `apply`.

mod engine;
pub mod memory;
mod node;
mod preempt;
mod search;
mod topology;
mod types;
mod units;
mod update;
mod workload;

#[cfg(test)]
mod engine_test;
#[cfg(test)]
mod host_test;
#[cfg(test)]
mod pin_test;
#[cfg(test)]
mod property_test;
#[cfg(test)]
mod testing;

pub use engine::{Engine, GpuUsage, NodeHost, NodeView, PoolSummary};
pub use types::*;
