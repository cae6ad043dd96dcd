//! The vgpu.v1 API shared by every vgpu binary: the tonic/prost code generated from
//! `proto/vgpu/v1/vgpu.proto`, plus the input rules that every entry point applies the same way
//! (size strings, CPU amounts, names, placement-request validation, configuration files with environment
//! overrides), the stable error codes that cross the gRPC boundary, the call metadata agents and
//! the control plane exchange (`metadata`: the node key and the registration number), and
//! transport security (`tls`: mutual TLS, roles, `--insecure`; `pki`: the cluster CA,
//! certificates, bootstrap tokens).
//!
//! **API Boundary:** the `.proto` file is the contract between vgpuctl, vgpu-agent and vgpu-cp.
//! Fields are only ever added; numbers are never reused.

pub mod codes;
pub mod config;
pub mod cpu;
pub mod metadata;
pub mod names;
pub mod pki;
pub mod size;
pub mod tls;
pub mod usage;
pub mod validate;

/// Generated protobuf and gRPC code for package `vgpu.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("vgpu.v1");
}

pub use codes::ErrorCode;
