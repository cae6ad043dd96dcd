//! A linearizability checker for histories of vgpu tenant operations.
//!
//! Clients place, release and read tenants by name; each name is a register (absent, or present
//! with a request) and each recorded [`Operation`] says what was asked, when it was invoked and
//! returned, and what came back, including "unknown" for requests whose answer never came.
//! [`check_linearizable`] searches each name's operations for a legal order (Wing and Gong's
//! algorithm with Lowe's memoisation, as porcupine and Knossos do), and
//! [`check_acknowledged_writes`] requires every acknowledged placement to survive in the final
//! states.
//!
//! Two users record histories: the control plane's deterministic simulation
//! (`controlplane/vgpu-cp/tests/sim`, virtual time) and the nemesis test against the compose
//! cluster (`tests/src/bin/nemesis.rs`, real time, histories kept as JSON lines).
//!
//! **Invariant:** the crate does no I/O and reads no clock: callers stamp operations.

pub mod checker;
pub mod history;

pub use checker::{Register, check_acknowledged_writes, check_linearizable, check_register};
pub use history::{Call, History, Operation, Outcome, by_name, fingerprint};
