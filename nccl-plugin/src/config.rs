//! The plugin's settings, read once from the environment the agent hands a tenant process.
//! Every variable is documented in the crate README; a bad value is logged and the default used
//! (a tenant's training job must not fail because of a typo in a tuning knob).

use std::net::IpAddr;

use tenant_abi::NetshareEnv;
use tenant_abi::env::var;

#[derive(Clone, Debug)]
pub struct Config {
    /// `VGPU_NCCL_SOCKETS`: TCP streams (each with its own thread) per connection, 1..=16.
    pub sockets: usize,
    /// `VGPU_NCCL_LOCAL`: use the same-host path (GPU-to-GPU copies) when both ends share a host.
    pub local: bool,
    /// `VGPU_NCCL_GDR`: offer GPU pointers to NCCL (needs libcuda; NCCL also needs
    /// `NCCL_NET_GDR_LEVEL` to reach our virtual NIC).
    pub gdr: bool,
    /// `VGPU_NCCL_ADDR`: the address to listen on and advertise.
    pub addr: Option<IpAddr>,
    /// `VGPU_NCCL_SPEED_MBPS`: the port speed reported to NCCL's model.
    pub speed_mbps: i32,
    /// `VGPU_NCCL_MIN_PART`: smallest piece of a request given to one TCP stream.
    pub min_part: u64,
    /// `VGPU_NCCL_OWN_CONTEXT`: the plugin's threads (same-host copy workers, TCP stream
    /// threads staging GPU buffers) issue their copies from a CUDA context of the plugin's own
    /// instead of the application's (default on). With the application's
    /// context and CUDA's lazy module loading, a kernel the application loads while NCCL's
    /// kernel waits for one of our copies deadlocks the process (the loader holds the context
    /// while it waits for the GPU to go idle); measured on 2 x H200.
    pub own_context: bool,
    /// `VGPU_NCCL_COPY_PIECES`: the same-host path cuts each step's GPU copy into up to this
    /// many pieces (of at least 128 KiB), one stream each, 1..=8 (default 1: one copy). An
    /// experiment: more streams may use more copy engines.
    pub copy_pieces: usize,
    /// `VGPU_NCCL_SPIN_US`: how long an idle same-host copy thread polls for its next job before
    /// it sleeps (0..=100000, default 5000). A sleeping thread costs the next step a wake-up;
    /// a polling one costs a CPU core (one per device and process while traffic flows, since
    /// the copy threads are shared: 63.9 against 59.8 GB/s with 100 us on 2 x H200).
    pub spin_ns: u64,
    /// `VGPU_NCCL_FIN_RING`: the same-host path's GPU copies complete through a ring in shared
    /// memory that the sender's copy thread writes and the receiver polls, not through a `Fin`
    /// message on the socket (default on: 60.2 against 50.2 GB/s on 2 x H200 at NCCL's
    /// defaults; `0` turns it off; the receiving side decides).
    pub fin_ring: bool,
    /// `VGPU_NCCL_GPU_FIN`: with the completion ring, the GPU itself publishes each finished
    /// copy (a `cuStreamWriteValue64` into the ring's page right behind the copy on its
    /// stream) instead of the copy thread after polling the copy's event (default on where the
    /// driver allows; `0` turns it off; the sending side decides).
    pub gpu_fin: bool,
    /// `VGPU_NCCL_COPY_THREADS`: the copy threads per device and process that serve every
    /// same-host sender's GPU copies (1..=16, default 1; connections take them in turn).
    pub copy_threads: usize,
    /// `VGPU_NCCL_IB`: use the RDMA path (ibverbs) for connections that do not take the
    /// same-host path, where libibverbs loads and a device has an ACTIVE port (default on; `0`
    /// never: TCP).
    pub ib: bool,
    /// `VGPU_NCCL_IB_DEV`: the RDMA device to use (default: the first with an ACTIVE port).
    pub ib_dev: Option<String>,
    /// `VGPU_NCCL_IB_GID_INDEX`: the GID table index of the port (RoCE needs the right one;
    /// default 0).
    pub ib_gid_index: u8,
    /// `VGPU_NCCL_IBVERBS_LIB`: the library to open as libibverbs (default `libibverbs.so.1`;
    /// the tests name one that does not exist to play a host without it).
    pub ibverbs_lib: String,
    /// `VGPU_NETSHARE_TABLE` and `VGPU_NETSHARE_FLOW`: the node's token-bucket table and this
    /// tenant's flow in it; sends wait for tokens when both are set.
    pub netshare: Option<(std::path::PathBuf, u64)>,
}

fn var<T: std::str::FromStr>(name: &str, default: T, ok: impl Fn(&T) -> bool) -> T {
    match std::env::var(name) {
        Ok(v) => match v.trim().parse::<T>() {
            Ok(x) if ok(&x) => x,
            _ => {
                crate::log::warn!(
                    crate::abi::NCCL_INIT,
                    "ignoring {name}={v:?}: out of range or not a number"
                );
                default
            }
        },
        Err(_) => default,
    }
}

fn flag(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref() {
        Ok("0") | Ok("false") | Ok("no") => false,
        Ok("1") | Ok("true") | Ok("yes") => true,
        Ok(other) => {
            crate::log::warn!(
                crate::abi::NCCL_INIT,
                "ignoring {name}={other:?}: use 0 or 1"
            );
            default
        }
        Err(_) => default,
    }
}

impl Config {
    pub fn from_env() -> Config {
        let addr = std::env::var(var::NCCL_ADDR)
            .ok()
            .and_then(|v| match v.parse() {
                Ok(a) => Some(a),
                Err(_) => {
                    crate::log::warn!(
                        crate::abi::NCCL_INIT,
                        "ignoring {}={v:?}: not an IP address",
                        var::NCCL_ADDR
                    );
                    None
                }
            });
        let netshare = match NetshareEnv::from_lookup(|name| std::env::var(name).ok()) {
            Ok(netshare) => netshare.map(|netshare| (netshare.table, netshare.flow)),
            Err(error) => {
                crate::log::warn!(crate::abi::NCCL_INIT, "ignoring {error}");
                None
            }
        };
        Config {
            sockets: var(var::NCCL_SOCKETS, 4usize, |n| (1..=16).contains(n)),
            local: flag(var::NCCL_LOCAL, true),
            gdr: flag(var::NCCL_GDR, true),
            addr,
            speed_mbps: var(var::NCCL_SPEED_MBPS, 400_000i32, |n| *n > 0),
            min_part: var(var::NCCL_MIN_PART, 256u64 << 10, |n| *n >= 4096),
            own_context: flag(var::NCCL_OWN_CONTEXT, true),
            copy_pieces: var(var::NCCL_COPY_PIECES, 1usize, |n| (1..=8).contains(n)),
            spin_ns: var(var::NCCL_SPIN_US, 5000u64, |n| *n <= 100_000) * 1000,
            fin_ring: flag(var::NCCL_FIN_RING, true),
            gpu_fin: flag(var::NCCL_GPU_FIN, true),
            copy_threads: var(var::NCCL_COPY_THREADS, 1usize, |n| (1..=16).contains(n)),
            ib: flag(var::NCCL_IB, true),
            ib_dev: std::env::var(var::NCCL_IB_DEV)
                .ok()
                .filter(|v| !v.trim().is_empty()),
            ib_gid_index: var(var::NCCL_IB_GID_INDEX, 0u8, |_| true),
            ibverbs_lib: std::env::var(var::NCCL_IBVERBS_LIB)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| "libibverbs.so.1".to_owned()),
            netshare,
        }
    }
}

/// The host's identity: the kernel's boot id, so two containers on one host match and two hosts
/// never do. Falls back to the hostname.
pub fn host_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().replace('-', ""))
        .filter(|s| s.len() == 32);
    let mut id = [0u8; 16];
    match text {
        Some(hex) => {
            for (i, b) in id.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
            }
        }
        None => {
            let name = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
            for (i, c) in name.trim().bytes().enumerate() {
                id[i % 16] ^= c;
            }
        }
    }
    id
}
