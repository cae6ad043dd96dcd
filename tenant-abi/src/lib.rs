//! The contract between the node agent and the processes of a tenant: everything the agent hands
//! a tenant process, and everything they share through files.
//!
//! - `env`: the `VGPU_*` environment. Every variable name is a constant in [`env::var`]; the
//!   agent writes a [`TenantEnv`] with [`TenantEnv::to_env`], the interposer and the NCCL plugin
//!   read their part of it with the views' `from_lookup` ([`MemoryEnv`], [`ComputeEnv`],
//!   [`SpatialEnv`], [`NcclEnv`], [`NetshareEnv`]), which share one parser per kind of value.
//! - `layout`: the file names of a tenant's private directory (memory ledger, compute
//!   schedules, the NCCL tuners' activity table, the token-bucket table).
//! - `size`: the one parser and formatter of byte sizes (`20GiB`), used by the API and the
//!   environment alike.
//! - `ledger` and `compute`: the `#[repr(C)]` layouts of the memory ledger and of a GPU's compute
//!   schedule, and the lock-free protocols over them. Pure: no FFI, no clock, no globals.
//! - `control`: the closed-loop part of a GPU's schedule: latency tenants' step histograms, the
//!   agent's `Decision` for the other tenants on the GPU.
//! - `reclaim` (pure; the interposer's swap follows it, off outside tests): elastic memory's rule for which borrowers give memory back
//!   when a tenant needs its request (`docs/design/elastic-memory.md`). `board`:
//!   elastic memory's per-GPU memory board (the agent writes it, the interposer reserves against
//!   it), the `#[repr(C)]` layout every tenant on a GPU shares
//!   and the lock-free reserve protocol against the GPU's capacity and each tenant's limit.
//! - `slabs`: the slab table of a GPU's shared swap staging file (claimed by swap-outs, freed by
//!   swap-ins, reclaimed from dead owners); pure, not wired in yet.
//! - `shm` (with `map`): mapping those files from outside a tenant (the agent's usage report reads
//!   them; the agent creates a GPU's schedule before any tenant runs). `writer` (feature
//!   `writer`) plays a tenant process against them for tests and tools.
//!
//! **Architecture Invariant:** this crate depends on nothing but libc and thiserror: it is
//! linked into every tenant process (`libvgpu_cuda.so`, `libvgpu_nccl.so`), so it never pulls in
//! an async runtime, gRPC or the API. `unsafe` lives only in `map`.
//!
//! **API Boundary:** what crosses between the agent and a tenant is plain data: environment
//! variables and `#[repr(C)]` regions of atomics. A format change bumps the region's version
//! (`ledger::VERSION`, `compute::VERSION`); a renamed variable keeps its old name as an alias for
//! one release (`env::var::NCCL_SHARE_FILE_OLD`).

pub mod board;
pub mod compute;
pub mod control;
pub mod env;
pub mod layout;
pub mod ledger;
mod map;
pub mod reclaim;
pub mod shm;
pub mod size;
pub mod slabs;
#[cfg(any(test, feature = "writer"))]
pub mod writer;

pub use compute::TenantTime;
pub use env::{ComputeEnv, EnvError, MemoryEnv, NcclEnv, NetshareEnv, SpatialEnv, TenantEnv};
pub use ledger::{LedgerUsage, ProcLiveness, ProcessCharge};
pub use shm::{ReadError, create_schedule, read_ledger, read_schedule};

/// The most devices a tenant process's ledger and environment describe; higher ordinals are
/// passed through unlimited.
pub const DEVICES_MAX: usize = 16;
