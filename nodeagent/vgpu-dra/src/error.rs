//! The driver's errors. Each says what happened and what to do next; the kubelet shows a
//! claim's error in the pod's events, so that is where a user reads them.

use std::path::PathBuf;

use crate::claim::ClaimRef;

/// Why a claim cannot become a tenant on this node.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "claim {0} has no allocation yet; the kubelet prepares only allocated claims, so this is a scheduler or kubelet problem: check `kubectl describe resourceclaim`"
    )]
    NotAllocated(ClaimRef),
    #[error(
        "claim {claim} was replaced: the apiserver has uid `{uid}` under that name; the kubelet will retry with the new claim"
    )]
    Replaced { claim: ClaimRef, uid: String },
    #[error(
        "claim {0} asks for admin access, which vgpu.dev does not give: a slice is a tenant with a share, and admin access takes none; to watch the GPUs use `vgpuctl describe` or the agent's metrics"
    )]
    AdminAccess(ClaimRef),
    #[error("claim {0} has no device of driver vgpu.dev; check its DeviceClass is `vgpu.dev`")]
    NoDevices(ClaimRef),
    #[error(
        "claim {claim} holds {count} vgpu.dev devices; a claim may hold at most {max} on one node",
        max = crate::claim::CLAIM_DEVICES_MAX
    )]
    TooManyDevices { claim: ClaimRef, count: usize },
    #[error(
        "claim {claim} was allocated a device of pool `{pool}`, but this is node `{node}`; is the driver running with the right --node-name?"
    )]
    OtherNode {
        claim: ClaimRef,
        pool: String,
        node: String,
    },
    #[error(
        "claim {claim} was allocated device `{device}`, which this node does not publish; the node's GPUs changed since the ResourceSlice was written: restart the driver so it publishes them again"
    )]
    UnknownDevice { claim: ClaimRef, device: String },
    #[error(
        "claim {claim} consumes capacity {capacity} = `{value}`, which vgpu cannot read ({reason}); ask for whole bytes of memory (`20Gi`) and whole percent of compute (`25`)"
    )]
    BadCapacity {
        claim: ClaimRef,
        capacity: String,
        value: String,
        reason: String,
    },
    #[error(
        "claim {claim} consumes {memory_bytes} bytes and {compute_percent}% of {device}, which has {gpu_memory_bytes} bytes; ask for 1 byte to all of its memory and 1 to 100 percent of compute"
    )]
    OutOfRange {
        claim: ClaimRef,
        device: String,
        memory_bytes: u64,
        compute_percent: u64,
        gpu_memory_bytes: u64,
    },
}

/// Errors of the driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Agent(#[from] vgpu_agent::Error),
    #[error(transparent)]
    Private(#[from] vgpu_agent::private::PrivateError),
    #[error(
        "the checkpoint {path} cannot be read ({reason}); move it away to start from nothing (the kubelet prepares running pods' claims again), or restore it"
    )]
    Checkpoint { path: PathBuf, reason: String },
    #[error("cannot {action} {path}: {source}; check the path exists and the driver may write it")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read claim {claim} from the apiserver: {reason}")]
    Apiserver { claim: ClaimRef, reason: String },
    #[error(
        "the apiserver did not answer about claim {claim} within {seconds} s; the kubelet will retry"
    )]
    ApiserverTimeout { claim: ClaimRef, seconds: u64 },
    #[error("cannot publish the ResourceSlice {name}: {reason}")]
    Publish { name: String, reason: String },
    #[error("the control-plane settings do not work: {reason}")]
    ControlPlaneSetup { reason: String },
    #[error(
        "cannot {what} claim {claim}: no control-plane member at {endpoints} answered (last: {reason}); check vgpu-cp runs and the driver's --control-plane addresses reach it from this node; the kubelet will retry"
    )]
    ControlPlaneUnreachable {
        claim: ClaimRef,
        what: &'static str,
        endpoints: String,
        reason: String,
    },
    #[error("the control plane refused to {what} claim {claim} ({code:?}): {reason}; {hint}")]
    PinRefused {
        claim: ClaimRef,
        what: &'static str,
        code: tonic::Code,
        reason: String,
        hint: &'static str,
    },
    #[error(
        "the agent's node key {path} cannot be read ({reason}); the control plane takes a claim's pin only with the key of the agent that registered the node: start `vgpu-agent join --kubernetes-managed` on this node first, and mount its state directory into the driver (--agent-state-dir)"
    )]
    NodeKey { path: PathBuf, reason: String },
    #[error(
        "the control plane holds tenant {tenant} of claim {claim}, but the agent did not {waiting_for} {path} within {seconds} s; check `vgpu-agent join --kubernetes-managed` runs on this node with the state directory the driver reads (--agent-state-dir) and reaches the control plane; the kubelet will retry"
    )]
    AgentTimeout {
        claim: ClaimRef,
        tenant: String,
        waiting_for: &'static str,
        path: PathBuf,
        seconds: u64,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
