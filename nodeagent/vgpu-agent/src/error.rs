//! The one error type of the agent library. Every message says what happened and what to do next;
//! `main` wraps it in `anyhow` only to print it.

use std::path::PathBuf;

use crate::inventory::MAX_GPUS_PER_NODE;

/// Everything the agent library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no NVIDIA GPU found (NVML: {reason}); pass --simulate SPEC to run with simulated GPUs"
    )]
    NoGpu { reason: String },
    #[error("no usable NVIDIA GPU ({details}); pass --simulate SPEC to run with simulated GPUs")]
    NoUsableGpu { details: String },

    #[error(
        "cannot read the GPU spec `{spec}`; write COUNTxMODEL-MEMORY such as `8xH100-80GB`, or the path of a .toml or .json topology file"
    )]
    SpecMalformed { spec: String },
    #[error(
        "the GPU count `{count}` in `{spec}` is not a number; write COUNTxMODEL-MEMORY such as `8xH100-80GB`"
    )]
    SpecBadCount { spec: String, count: String },
    #[error("the GPU spec `{spec}` asks for 0 GPUs; a node needs at least 1, e.g. `1xH100-80GB`")]
    SpecZeroGpus { spec: String },
    #[error(
        "the GPU spec `{spec}` asks for {count} GPUs; the limit is {MAX_GPUS_PER_NODE} per node"
    )]
    SpecTooManyGpus { spec: String, count: u64 },
    #[error(
        "the model `{model}` in `{spec}` has no memory size; end it with the memory in GB, e.g. `{model}-80GB`"
    )]
    SpecNoMemory { spec: String, model: String },
    #[error(
        "the memory `{memory}` in `{spec}` is not a size in GB; write e.g. `80GB` (a whole number of GB, more than 0 and at most 16384)"
    )]
    SpecBadMemory { spec: String, memory: String },

    #[error("the topology file `{path}` has an unknown extension; name it `*.toml` or `*.json`")]
    TopologyExtension { path: PathBuf },
    #[error("cannot read the topology file `{path}`: {source}")]
    TopologyRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse the topology file `{path}`: {message}")]
    TopologyParse { path: PathBuf, message: String },
    #[error("the topology file `{path}` is invalid: {problem}")]
    TopologyInvalid {
        path: PathBuf,
        problem: TopologyProblem,
    },

    #[error(
        "tenant {tenant} is not placed on this node ({node}); `vgpuctl describe tenant {tenant}` shows where it runs"
    )]
    TenantNotPlaced { tenant: String, node: String },
    #[error(
        "no agent state in `{path}`; run this on a node where `vgpu-agent join` runs, and pass its --state-dir (or set VGPU_AGENT_STATE_DIR)"
    )]
    NoAgentState { path: PathBuf },
    #[error(
        "the interposer `{path}` does not exist; install libvgpu_cuda.so there or beside vgpu-agent, pass --interposer PATH, or pass --no-interposer to run without enforcement"
    )]
    InterposerMissing { path: PathBuf },
    #[error(
        "tenant {tenant}'s private directory `{path}` is not ready; the agent makes it when it takes the placement: check that `vgpu-agent join` runs with the same --shm-dir and look for a warning about it in its log"
    )]
    TenantDirMissing { tenant: String, path: PathBuf },
    #[error(
        "tenant {tenant}'s processes run as {owner}, not as {caller}; run this as that user (or as root, which switches to it)"
    )]
    NotTenantUser {
        tenant: String,
        owner: String,
        caller: String,
    },
    #[error(transparent)]
    Mps(#[from] crate::mps::MpsError),
    #[error(transparent)]
    Private(#[from] crate::private::PrivateError),
    #[error(
        "cannot start the thread that applies assignments: {0}; the node is short of threads or memory"
    )]
    WorkerThread(std::io::Error),
    #[error(
        "the thread that applies assignments stopped; this is a bug in vgpu-agent (its panic is in the log above), restart the agent"
    )]
    WorkerGone,
    #[error("cannot start the health and usage monitor thread: {0}")]
    Monitor(String),
    #[error("cannot run `{program}`: {source}")]
    Exec {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot use `{path}` as the CDI spec directory ({source}); pass --cdi-dir DIR")]
    CdiDir {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error(transparent)]
    Name(#[from] api::names::NameError),
    #[error(transparent)]
    Config(#[from] api::config::ConfigError),
    #[error("the label `{0}` is not KEY=VALUE with a non-empty key, e.g. `zone=a`")]
    BadLabel(String),
    #[error("the control plane at {address} refused to register this node: {message}")]
    RegisterRefused { address: String, message: String },
    #[error(
        "node `{node}` is no longer this agent's: {message}. Another agent holds the name (another machine with the same --name, or a copy of this state directory). If this machine is `{node}`, an admin removes the other registration (`vgpuctl node remove {node}`) and this agent is started again; otherwise start this one with its own --name"
    )]
    NodeNameTaken { node: String, message: String },
    #[error(
        "the node key `{path}` is damaged (it must hold 64 hex digits); the control plane knows this node by it. Restore it from a backup, or delete it and have an admin remove the node (`vgpuctl node remove NAME`) so that it registers as a new identity"
    )]
    NodeKeyDamaged { path: PathBuf },
    #[error("cannot simulate this fleet: {problem}")]
    FleetSettings { problem: String },
    #[error("no control-plane address given; pass --control-plane HOST:PORT[,HOST:PORT...]")]
    NoControlPlane,
    /// Certificates, the bootstrap token, or the TLS settings.
    #[error("{0}")]
    Tls(String),
    #[error("the control-plane address `{address}` is not usable: {source_message}")]
    BadEndpoint {
        address: String,
        source_message: String,
    },

    #[error(
        "no usable state directory: `{path}` cannot be created or written ({source}); pass --state-dir DIR or set VGPU_AGENT_STATE_DIR"
    )]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot {action} `{path}`: {source}")]
    StateIo {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the state file `{path}` belongs to node `{found}`, not `{expected}`; give each node its own --state-dir"
    )]
    StateOtherNode {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(
        "the state file `{path}` is damaged ({message}); it is ignored and rebuilt from the control plane's assignments"
    )]
    StateCorrupt { path: PathBuf, message: String },
    #[error(
        "the state file `{path}` has format {found}; this agent reads format {expected}. Move it away to start afresh (the control plane re-sends the assignments)"
    )]
    StateFormat {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "{flag} {reserved} is all of this node's {total} or more, which would leave tenants nothing; lower {flag} (it is what work outside vgpu keeps)"
    )]
    HostReserveTooLarge {
        flag: &'static str,
        reserved: String,
        total: String,
    },
}

/// What is wrong inside a topology file, after it parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyProblem {
    #[error("it lists no GPUs; add at least one [[gpus]] entry")]
    NoGpus,
    #[error("it lists {0} GPUs; the limit is {MAX_GPUS_PER_NODE} per node")]
    TooManyGpus(usize),
    #[error("GPU index {0} appears twice; every GPU needs its own index")]
    DuplicateIndex(u32),
    #[error("GPU {index}: the model is empty; name it, e.g. `H100-80GB`")]
    EmptyModel { index: u32 },
    #[error("GPU {index}: bad memory size: {source}")]
    BadMemory {
        index: u32,
        source: api::size::SizeError,
    },
    #[error("GPU {index}: the memory is 0; give the GPU's memory, e.g. `80GiB`")]
    ZeroMemory { index: u32 },
    #[error(
        "GPU {index}: the memory is {bytes} bytes; the limit is {limit} (16 TiB) per GPU",
        limit = api::validate::GPU_MEMORY_BYTES_MAX
    )]
    TooMuchMemory { index: u32, bytes: u64 },
    #[error("GPU {index}: `{value}` appears on two GPUs as {what}; each GPU needs its own")]
    Duplicate {
        index: u32,
        what: &'static str,
        value: String,
    },
    #[error("GPU {index}: NVLink peer {peer} is not a GPU of this file")]
    UnknownPeer { index: u32, peer: u32 },
    #[error("GPU {index} lists itself as an NVLink peer")]
    SelfPeer { index: u32 },
    #[error("GPU {index}: NVLink peer {peer} has 0 links; give 1 or more, or leave the peer out")]
    ZeroLinks { index: u32, peer: u32 },
    #[error(
        "GPUs {index} and {peer} disagree on their NVLink link count ({forward} against {backward}); make both sides equal"
    )]
    LinkCountMismatch {
        index: u32,
        peer: u32,
        forward: u32,
        backward: u32,
    },
    #[error("NVLink island {island} names GPU {index}, which is not a GPU of this file")]
    UnknownIslandMember { island: usize, index: u32 },
    #[error("GPU {index} is in more than one NVLink island; islands do not overlap")]
    OverlappingIslands { index: u32 },
    #[error("`links_per_pair` is 0; give the NVLink links between each pair, e.g. 18")]
    ZeroLinksPerPair,
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
