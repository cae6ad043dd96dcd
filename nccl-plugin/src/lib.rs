//! `libvgpu_nccl.so`: an NCCL net plugin (`ncclNetPlugin_v11`, `_v10`) and tuner plugin
//! (`ncclTunerPlugin_v5`, `_v4`) in one library. See the crate README for how NCCL loads it,
//! the environment the agent hands a tenant, and the design.
//!
//! - `exports`: the C tables NCCL `dlsym`s and their entry points (panics caught, errors logged
//!   and returned as NCCL codes).
//! - `net`: listen/connect/accept without blocking, the per-connection transport choice.
//! - `local`: same-host transport: control over a Unix socket, GPU-to-GPU copies (CUDA IPC);
//!   `copier`: the copy threads that issue and poll those copies; `finring`: the completion
//!   ring in shared memory through which the receiver hears of them.
//! - `tcp`: cross-host transport: several streams with a thread each.
//! - `rdma`: the transport for connections that do not take the same-host path when an RDMA
//!   device is usable (one RC queue pair each, RDMA writes with immediate); `ibv`: libibverbs,
//!   opened at run time, and the few verbs.h layouts it needs.
//! - `tuner`, `activity`: channel caps by bandwidth share while other tenants are active.
//! - `identity`: the env plugin's `NCCL_HOSTID`, one per rank on a shared GPU.
//! - `wire`: every byte layout that crosses a process boundary; `cuda`: the driver calls.

pub mod abi;
mod activity;
mod config;
mod context;
mod copier;
mod cuda;
mod exports;
mod finring;
mod ibv;
mod identity;
mod local;
mod log;
mod net;
mod rdma;
mod sys;
mod tcp;
pub mod tuner;
pub mod wire;

/// A registered memory region (`mhandle`).
#[derive(Clone, Copy, Debug)]
pub struct Mr {
    pub ptr: u64,
    pub size: usize,
    pub cuda: bool,
    /// The region id the receiver exported it under, or `wire::HOST_REGION`.
    pub region: u32,
    /// Base of the GPU allocation holding `ptr` (offsets are relative to it).
    pub base: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("CUDA: {0}")]
    Cuda(#[from] cuda::CudaError),
    #[error("{0}")]
    Wire(#[from] wire::WireError),
    #[error("the peer closed the connection (did the other rank exit?)")]
    PeerClosed,
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    #[error("a send of {sent} bytes does not fit the {posted}-byte receive")]
    Truncated { sent: usize, posted: usize },
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("RDMA: {0}")]
    Verbs(#[from] ibv::VerbsError),
    #[error(
        "an RDMA work request failed with status {0} (enum ibv_wc_status; 5 means flushed after an earlier error)"
    )]
    WorkRequest(u32),
    #[error("tuner: {0}")]
    Activity(#[from] activity::Error),
    #[error(
        "GPU buffer {0:#x} is a legacy cudaMalloc allocation (NCCL_CUMEM_ENABLE=0?): the plugin copies from a CUDA context of its own, which cannot read such memory without waiting behind NCCL's kernel (it hung on an H100); unset NCCL_CUMEM_ENABLE (cuMem buffers are NCCL's default), or leave NCCL_NET_GDR_LEVEL unset so GPU buffers stay off this plugin"
    )]
    LegacyGpuBuffer(u64),
}

impl Error {
    /// The other end of the connection is gone (it closed its comm or its process ended).
    pub fn peer_gone(&self) -> bool {
        match self {
            Error::PeerClosed => true,
            Error::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::NotConnected
            ),
            _ => false,
        }
    }
}
