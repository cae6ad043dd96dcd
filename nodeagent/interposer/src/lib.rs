//! `libvgpu_cuda.so`: the CUDA driver-API interposer loaded (through `LD_PRELOAD`) into every
//! process of a tenant. It enforces the tenant's memory slice per GPU, accounted across all of the
//! tenant's processes through a lock-free shared-memory ledger, and its compute share per GPU:
//! kernel launches wait for the tenant's turn in a lock-free per-GPU schedule (`compute`,
//! `launch`).
//!
//! Layers, from the C boundary inwards:
//! - `dlsym_shim` exports `dlsym`, so that `dlsym(libcuda, "cuMemAlloc_v2")` finds our hooks.
//! - `exports` holds every `extern "C"` hook of the driver; each body is wrapped in
//!   `ffi_boundary!`. `nvml_exports` does the same for NVML's memory queries and process lists
//!   (policy in `nvml`).
//! - `real` reaches the real driver (`dlopen` + `dlsym`) and is the only caller of it.
//! - `shm` maps the tenant's ledger file.
//! - `sys` declares the few CUDA driver types and constants we use, by hand (no `cuda.h` on the
//!   machines that build this crate; the layouts are the driver API's public ABI).
//! - `closed_loop`: a latency tenant measures its steps (launch to the synchronisation that waits
//!   for it) into the GPU's schedule file; the others obey the agent's decision while a latency
//!   step is in flight (pause, a bound on queued launches; fewer SMs through `spatial`).
//! - `hooks` is the memory policy glue, in safe code: what to charge, when to refuse, what to
//!   report; `elastic` is its part for elastic memory (the GPU's memory board, which paths may
//!   borrow past the request, what a refusal says), `vmm` backs borrowed allocations, and `swap`
//!   moves borrowed chunks to host memory and back when other tenants want their request (its
//!   pinned host staging kept and reused by `staging`; off by default, `VGPU_MEMORY_SWAP=1`;
//!   every launch and copy hook holds while a chunk is out,
//!   `hooks::enter_work`); `hint` gives a hint helper registered in the process (`vgpu.torch`,
//!   through `vgpu_memory_hint_register`, `vgpu_memory_want` and `vgpu_memory_hint_done` in
//!   `exports`) a bounded budget to free memory before the swap takes the rest. `launch` is the
//!   launch gate, in safe code (the driver behind a trait), which also counts the tenant's steps
//!   at synchronisations (its progress; `vgpu_progress` in `exports` counts the application's own
//!   units instead); `spatial` moves launches to a green context with fewer SMs while a latency
//!   tenant is active or the agent caps the tenant's SMs (opt-in, `VGPU_SPATIAL=1`).
//! - `compat` judges, once at load, whether the driver is one the hooks were written for (its
//!   API version; what its `cuGetProcAddress` answers for every entry point we wrap) and says
//!   what does not match; `real::check` asks the driver.
//! - `tracker` is pure: no FFI, no globals, unit-tested here. The environment it reads
//!   (`tenant_abi::env`), the ledger's and the compute schedule's layouts and protocols
//!   (`tenant_abi::ledger`, `tenant_abi::compute`) are the tenant contract's, shared with the
//!   agent; `crate::ledger` and `crate::compute` name them here.
//!
//! **Invariant:** `unsafe` appears only in `sys`, `real`, `shm`, `exports`, `nvml_exports`,
//! `dlsym_shim`, `vmm` and `staging`, and no panic crosses the C boundary.

#[macro_use]
mod boundary;
mod closed_loop;
mod compat;
mod dlsym_shim;
mod elastic;
mod exports;
mod fault;
mod hint;
mod hooks;
mod launch;
mod line;
mod log;
mod nvml;
mod nvml_exports;
mod real;
mod shm;
mod spatial;
mod staging;
mod swap;
mod sys;
mod vmm;
use tenant_abi::{compute, ledger};
pub mod tracker;
