//! The etcd clusters of these tests (`etcd_store::testing`), required where `VGPU_ETCD_REQUIRED`
//! is set (`.ci/run` sets it where it installed etcd).

pub use etcd_store::testing::{ClusterTls, EtcdCluster, REQUEST_TIMEOUT, free_ports};

/// Whether a missing `etcd` fails the tests rather than skipping them.
pub fn required() -> bool {
    std::env::var_os("VGPU_ETCD_REQUIRED").is_some()
}
