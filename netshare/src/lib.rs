//! netshare: how the tenants on a node share its links (NVLink per GPU pair, NIC ports, PCIe).
//!
//! Two halves:
//! - [`Allocator`], a pure engine: links, flows (a tenant's traffic over a path of links, with a
//!   weight, an optional guaranteed minimum and an optional cap) and measured demands go in as
//!   [`Event`]s; [`Command::SetRate`]s come out. Rates are weighted max-min fair above the
//!   guarantees, work-conserving and capped (see `fill` for the algorithm).
//! - [`TableOwner`] / [`Table`], the node-local mechanism: one shared-memory file of token buckets
//!   that the agent configures from those `SetRate`s and that the NCCL plugin instances of every
//!   tenant charge before they send ([`Bucket::try_consume`]). The bucket arithmetic
//!   ([`bucket`]) is pure; [`shm`] is the only module with `unsafe` code.
//!
//! **Architecture Invariant:** this crate must not depend on tokio, nor on anything NCCL or CUDA;
//! its dependencies are std, libc and thiserror, so the NCCL plugin can link it without pulling a
//! runtime into every tenant process. The allocator (`allocator`, `fill`) and the bucket arithmetic
//! (`bucket`) do no I/O, read no clock and draw no random numbers: time comes in as `now_ns`, maps
//! are `BTreeMap`s, and the same events give the same commands on every run. Only `table` and
//! `shm` touch files, and only `shm` reads the clock ([`shm::monotonic_now_ns`], for runtimes).

mod allocator;
pub mod bucket;
mod fill;
pub mod shm;
mod table;
mod types;

#[cfg(test)]
mod allocator_test;
#[cfg(test)]
mod property_test;

pub use allocator::{Allocator, FlowView, LinkView};
pub use bucket::{Admission, BucketConfig};
pub use table::{
    Bucket, BucketStats, Error, FILE_MODE, MAGIC, REGION_BYTES, SLOTS, Table, TableOwner, VERSION,
};
pub use types::*;
