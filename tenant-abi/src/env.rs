//! The environment of a tenant's processes: what the agent writes (`vgpu-agent exec`, `env`, CDI
//! specs) and what the interposer and the NCCL plugin read inside those processes.
//!
//! [`TenantEnv`] is everything the agent decides; [`TenantEnv::to_env`] writes it and
//! [`TenantEnv::from_lookup`] reads all of it back. The tenant side reads only its part, through
//! views that fail on their own (a bad spatial setting must not take away a process's memory
//! limit): [`MemoryEnv`] and [`ComputeEnv`] and [`SpatialEnv`] for the interposer, [`NcclEnv`]
//! for the NCCL tuner, [`NetshareEnv`] for the plugin's sends. Every view parses a variable with
//! the same function as every other view, so two readers cannot disagree about one value
//! (`VGPU_GUARANTEED=false` is false everywhere, an empty `VGPU_TENANT` is pass-through
//! everywhere).
//!
//! | variable | written by | meaning |
//! | --- | --- | --- |
//! | `VGPU_TENANT` | agent | tenant name; unset or empty: the process is not a tenant's (pass-through) |
//! | `VGPU_NODE` | agent | the node the tenant runs on |
//! | `VGPU_MEMORY_LIMITS` | agent | `<device>:<size>,...`, device = CUDA ordinal as the process sees it |
//! | `VGPU_MEMORY_LIMIT` | user | one size for every device not named in `VGPU_MEMORY_LIMITS` |
//! | `VGPU_COMPUTE_SHARES` | agent | `<device>:<percent>,...` (0..=100; 0 or unlisted: not gated) |
//! | `VGPU_PRIORITY` | agent | higher first, `-1000..=1000` (default 0) |
//! | `VGPU_BURST` | agent | `1`: may use idle time beyond the share (default `0`) |
//! | `VGPU_GUARANTEED` | agent | `0`: the share is best effort (default `1`) |
//! | `VGPU_SHM_DIR` | agent | the tenant's private directory (default `/dev/shm/vgpu`), names in [`crate::layout`] |
//! | `VGPU_AGENT_STATE_DIR` | agent | the agent's state directory (where `exec` finds the tenant's placement) |
//! | `VGPU_NCCL_WEIGHT` | agent | the tenant's bandwidth weight, 1..=1,000,000 |
//! | `VGPU_NCCL_ACTIVITY_FILE` | agent | the NCCL tuners' activity table (old name `VGPU_NCCL_SHARE_FILE`, read for one more release) |
//! | `VGPU_NETSHARE_TABLE`, `VGPU_NETSHARE_FLOW` | agent | the tenant's token-bucket table and its flow id in it |
//! | `VGPU_SPATIAL` | agent | `1`: spatial mode (squeezed onto fewer SMs while a latency tenant runs) |
//! | `VGPU_LATENCY` | agent | `1`: a latency tenant (implies nothing without `VGPU_SPATIAL=1`) |
//! | `VGPU_LATENCY_TARGET_US` | agent | a latency tenant's step target in µs (`vgpuctl place --latency-target`); unset: 1.2x its own latency alone, as the node measures it |
//! | `VGPU_CONTEXT_OVERHEAD` | user | charged per process per device for its CUDA context: a size, or `<device>:<size>,...` |
//! | `VGPU_COMPUTE_QUANTUM_MS` | user | turn length for a GPU whose schedule this process creates (default 20) |
//! | `VGPU_COMPUTE_QUEUE_EVENTS` | user | how many sampled launches a stream of a gated process may have unfinished before its next sampled launch waits (the queue bound; default 2, `1..=4096`); for experiments on what the bound costs a tenant alone |
//! | `VGPU_COMPUTE_TURNS` | user | `0`: the process joins its GPUs' schedules (demand, steps, progress, the closed loop's and the redistribution's levers) but never waits for a turn, so its tenant's share is not held by time; for experiments with concurrent MPS clients (`tests/gpu/redistribute.sh` `TURNS=0`). Default `1` |
//! | `VGPU_SPATIAL_HOLD_MS`, `VGPU_SPATIAL_SMS` | user | how long others stay squeezed after a latency launch; SMs they keep |
//! | `VGPU_MEMORY_VMM` | user | `1`: the interposer backs every `cuMemAlloc_v2` with the driver's virtual memory management (reserve, create, map), as elastic memory backs borrowed allocations (issue 17); for compatibility runs |
//! | `VGPU_MEMORY_SWAP` | user | on by default: the interposer swaps borrowed memory out when other tenants want it back (launches and copies hold while it is out), and asks borrowers for its request (issue 17; measured on an H200: `tests/gpu/elastic_all.sh`); `0` turns it off in the process (borrowed memory then comes back only when the borrower frees it, and a request others borrowed is refused). The node turns it off for every tenant with the agent's `swap_host_memory = 0` |
//! | `VGPU_MEMORY_STAGING_IDLE_MS` | user | how long the swap keeps a pinned staging buffer that no swap-out reused before it frees it (default 30000, at most 600000; issue 17) |
//! | `VGPU_MEMORY_STAGING_TOUCH` | user | `0` leaves the first touch of new swap staging to the driver's registration (slower: 6 against 14 GB/s on an H200 host); for dry runs on the fake driver, whose chunk sizes are simulated (default 1) |
//! | `VGPU_MEMORY_STAGING_WARM` | user | `0` turns off pinning swap staging ahead for a process's resident borrowed chunks (on by default with the swap; issue 17) |
//! | `VGPU_MEMORY_HINT_MS` | user | how long a registered hint helper (`vgpu.torch`) has to free memory for a want before the swap moves the rest (default 100, at most 2000; issue 17) |
//! | `VGPU_MEMORY_WAIT_S` | user | how long a process waits in its GPU's line for room past its request (its borrowed memory back from host memory, a retried borrow) before its launch or allocation fails with out-of-memory; unset or 0: as long as it takes, saying so every minute (issue 17) |
//!
//! The rest of [`var`] are tuning knobs read by one component each (the NCCL plugin's transport,
//! the libraries to load); they are listed there so that every `VGPU_*` name has one home.
//!
//! Pure: the `from_lookup` functions take the environment as a function, so tests need no
//! process state.

use std::path::PathBuf;

use crate::DEVICES_MAX;

/// Every `VGPU_*` variable a vgpu component reads from a process environment (the binaries'
/// own settings, `VGPU_CP_*` and `VGPU_AGENT_*`, are declared with their settings instead).
pub mod var {
    // The tenant contract: written by the agent.
    pub const TENANT: &str = "VGPU_TENANT";
    pub const NODE: &str = "VGPU_NODE";
    pub const MEMORY_LIMITS: &str = "VGPU_MEMORY_LIMITS";
    pub const COMPUTE_SHARES: &str = "VGPU_COMPUTE_SHARES";
    pub const PRIORITY: &str = "VGPU_PRIORITY";
    pub const BURST: &str = "VGPU_BURST";
    pub const GUARANTEED: &str = "VGPU_GUARANTEED";
    pub const SHM_DIR: &str = "VGPU_SHM_DIR";
    pub const AGENT_STATE_DIR: &str = "VGPU_AGENT_STATE_DIR";
    pub const NCCL_WEIGHT: &str = "VGPU_NCCL_WEIGHT";
    pub const NCCL_ACTIVITY_FILE: &str = "VGPU_NCCL_ACTIVITY_FILE";
    /// The old name of [`NCCL_ACTIVITY_FILE`], read when the new one is unset; to be removed in
    /// the release after next.
    pub const NCCL_SHARE_FILE_OLD: &str = "VGPU_NCCL_SHARE_FILE";
    pub const NETSHARE_TABLE: &str = "VGPU_NETSHARE_TABLE";
    pub const NETSHARE_FLOW: &str = "VGPU_NETSHARE_FLOW";
    pub const SPATIAL: &str = "VGPU_SPATIAL";
    pub const LATENCY: &str = "VGPU_LATENCY";
    pub const LATENCY_TARGET_US: &str = "VGPU_LATENCY_TARGET_US";

    // The interposer's knobs (set by users or scripts, never by the agent).
    pub const MEMORY_LIMIT: &str = "VGPU_MEMORY_LIMIT";
    pub const CONTEXT_OVERHEAD: &str = "VGPU_CONTEXT_OVERHEAD";
    pub const MEMORY_VMM: &str = "VGPU_MEMORY_VMM";
    pub const MEMORY_SWAP: &str = "VGPU_MEMORY_SWAP";
    pub const MEMORY_HINT_MS: &str = "VGPU_MEMORY_HINT_MS";
    pub const MEMORY_WAIT_S: &str = "VGPU_MEMORY_WAIT_S";
    pub const MEMORY_STAGING_IDLE_MS: &str = "VGPU_MEMORY_STAGING_IDLE_MS";
    pub const MEMORY_STAGING_WARM: &str = "VGPU_MEMORY_STAGING_WARM";
    pub const MEMORY_STAGING_TOUCH: &str = "VGPU_MEMORY_STAGING_TOUCH";
    pub const COMPUTE_QUANTUM_MS: &str = "VGPU_COMPUTE_QUANTUM_MS";
    pub const COMPUTE_TURNS: &str = "VGPU_COMPUTE_TURNS";
    pub const COMPUTE_QUEUE_EVENTS: &str = "VGPU_COMPUTE_QUEUE_EVENTS";
    pub const SPATIAL_HOLD_MS: &str = "VGPU_SPATIAL_HOLD_MS";
    pub const SPATIAL_SMS: &str = "VGPU_SPATIAL_SMS";
    pub const REAL_LIBCUDA: &str = "VGPU_REAL_LIBCUDA";
    pub const REAL_LIBNVML: &str = "VGPU_REAL_LIBNVML";
    pub const LOG: &str = "VGPU_LOG";

    // The NCCL plugin's knobs: the tuner, then the transport.
    pub const NCCL_CHANNELS: &str = "VGPU_NCCL_CHANNELS";
    pub const NCCL_SHARE_EXPONENT: &str = "VGPU_NCCL_SHARE_EXPONENT";
    pub const NCCL_BEST_EFFORT_CHANNELS: &str = "VGPU_NCCL_BEST_EFFORT_CHANNELS";
    pub const NCCL_ACTIVE_MS: &str = "VGPU_NCCL_ACTIVE_MS";
    pub const NCCL_ADDR: &str = "VGPU_NCCL_ADDR";
    pub const NCCL_SOCKETS: &str = "VGPU_NCCL_SOCKETS";
    pub const NCCL_LOCAL: &str = "VGPU_NCCL_LOCAL";
    pub const NCCL_GDR: &str = "VGPU_NCCL_GDR";
    pub const NCCL_SPEED_MBPS: &str = "VGPU_NCCL_SPEED_MBPS";
    pub const NCCL_MIN_PART: &str = "VGPU_NCCL_MIN_PART";
    pub const NCCL_OWN_CONTEXT: &str = "VGPU_NCCL_OWN_CONTEXT";
    pub const NCCL_COPY_PIECES: &str = "VGPU_NCCL_COPY_PIECES";
    pub const NCCL_SPIN_US: &str = "VGPU_NCCL_SPIN_US";
    pub const NCCL_FIN_RING: &str = "VGPU_NCCL_FIN_RING";
    pub const NCCL_GPU_FIN: &str = "VGPU_NCCL_GPU_FIN";
    pub const NCCL_COPY_THREADS: &str = "VGPU_NCCL_COPY_THREADS";
    pub const NCCL_IB: &str = "VGPU_NCCL_IB";
    pub const NCCL_IB_DEV: &str = "VGPU_NCCL_IB_DEV";
    pub const NCCL_IB_GID_INDEX: &str = "VGPU_NCCL_IB_GID_INDEX";
    pub const NCCL_IBVERBS_LIB: &str = "VGPU_NCCL_IBVERBS_LIB";
    pub const NCCL_LOG_STDERR: &str = "VGPU_NCCL_LOG_STDERR";
    pub const NCCL_TRACE: &str = "VGPU_NCCL_TRACE";

    // The agent's driver libraries (outside its settings table: read where the library is
    // opened, for `vgpu-agent` subcommands that take no settings).
    pub const NVML_LIBRARY: &str = "VGPU_NVML_LIBRARY";
    pub const CUDA_LIBRARY: &str = "VGPU_CUDA_LIBRARY";
}

/// Where a tenant's files live unless `VGPU_SHM_DIR` says otherwise.
pub const SHM_DIR_DEFAULT: &str = "/dev/shm/vgpu";

/// Longest accepted tenant name (a DNS label, as in `api::names`).
pub const TENANT_NAME_LEN_MAX: usize = 63;

/// What a process's CUDA context costs on a device unless `VGPU_CONTEXT_OVERHEAD` says otherwise.
/// The context's own memory (local-memory reservation, loaded kernels, driver heaps) never goes
/// through an allocation the interposer sees. Measured on an H100 (driver 580, CUDA 13.0, PyTorch
/// 2.11, `tests/gpu/nvml_slice.sh`; docs/benchmarks.md, "What a CUDA context costs"): 518 MiB for
/// a fresh context, 610 MiB after its first kernels, 676-684 MiB once cuBLAS and cuDNN kernels
/// are loaded. 640 MiB covers the common case with little waste.
pub const CONTEXT_OVERHEAD_DEFAULT_BYTES: u64 = 640 << 20;

/// Turn length for a GPU schedule a process creates unless `VGPU_COMPUTE_QUANTUM_MS` says
/// otherwise.
pub const COMPUTE_QUANTUM_MS_DEFAULT: u64 = 20;

/// How long others stay squeezed after a latency launch unless `VGPU_SPATIAL_HOLD_MS` says
/// otherwise, and its bound.
pub const SPATIAL_HOLD_MS_DEFAULT: u64 = 50;
pub const SPATIAL_HOLD_MS_MAX: u64 = 60_000;

/// Bounds of `VGPU_PRIORITY` (as placement's priorities).
pub const PRIORITY_MIN: i32 = -1000;
pub const PRIORITY_MAX: i32 = 1000;

/// Bounds of `VGPU_NCCL_WEIGHT`.
pub const NCCL_WEIGHT_MAX: u64 = 1_000_000;

/// An environment a tenant process cannot follow, with the variable named first. The interposer
/// then fails closed (a clear error on every allocation or launch) rather than run unlimited.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EnvError(pub String);

/// Everything the agent decides about a tenant's processes on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantEnv {
    pub tenant: String,
    pub node: String,
    /// The tenant's private directory.
    pub shm_dir: PathBuf,
    pub agent_state_dir: PathBuf,
    /// Per visible device ordinal; `None`: not limited.
    pub memory_limits_bytes: [Option<u64>; DEVICES_MAX],
    /// Per visible device ordinal, in percent; `None`: not gated.
    pub compute_pct: [Option<u32>; DEVICES_MAX],
    pub priority: i32,
    pub burst: bool,
    pub guaranteed: bool,
    pub nccl_weight: u64,
    pub nccl_activity_file: PathBuf,
    pub netshare: NetshareEnv,
    /// Spatial mode (only on nodes that run MPS).
    pub spatial: bool,
    /// A latency tenant (only with `spatial`).
    pub latency: bool,
    /// A latency tenant's explicit step target (only with `latency`).
    pub latency_target_us: Option<u64>,
}

impl TenantEnv {
    /// The variables, in a fixed order. Devices are listed from ordinal 0 up to the last limited
    /// one.
    pub fn to_env(&self) -> Vec<(String, String)> {
        assert!(check_tenant_name(&self.tenant).is_ok(), "a checked name");
        assert!(
            !self.latency || self.spatial,
            "a latency tenant is one in spatial mode"
        );
        let flag = |on: bool| if on { "1" } else { "0" }.to_owned();
        let path = |p: &PathBuf| p.to_string_lossy().into_owned();
        let mut environment = vec![
            (var::TENANT, self.tenant.clone()),
            (var::NODE, self.node.clone()),
            (
                var::MEMORY_LIMITS,
                per_device(&self.memory_limits_bytes, |b| b.to_string()),
            ),
            (
                var::COMPUTE_SHARES,
                per_device(&self.compute_pct, |p| p.to_string()),
            ),
            (var::PRIORITY, self.priority.to_string()),
            (var::BURST, flag(self.burst)),
            (var::GUARANTEED, flag(self.guaranteed)),
            (var::SHM_DIR, path(&self.shm_dir)),
            (var::AGENT_STATE_DIR, path(&self.agent_state_dir)),
            (var::NCCL_WEIGHT, self.nccl_weight.to_string()),
            (var::NCCL_ACTIVITY_FILE, path(&self.nccl_activity_file)),
            (var::NETSHARE_TABLE, path(&self.netshare.table)),
            (var::NETSHARE_FLOW, self.netshare.flow.to_string()),
        ];
        if self.spatial {
            environment.push((var::SPATIAL, flag(true)));
        }
        if self.latency {
            environment.push((var::LATENCY, flag(true)));
        }
        if let Some(target) = self.latency_target_us {
            assert!(self.latency, "only a latency tenant has a latency target");
            environment.push((var::LATENCY_TARGET_US, target.to_string()));
        }
        let environment: Vec<(String, String)> = environment
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value))
            .collect();
        assert!(
            environment.iter().all(|(_, value)| !value.contains('\0')),
            "environment values are C strings"
        );
        environment
    }

    /// Reads everything [`TenantEnv::to_env`] writes; `Ok(None)` without a tenant. Strict: a
    /// variable the agent always writes is required.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TenantEnv>, EnvError> {
        let Some(tenant) = tenant(&get)? else {
            return Ok(None);
        };
        let required = |name: &str| {
            nonempty(&get, name)
                .ok_or_else(|| EnvError(format!("{name} is not set; the agent always sets it")))
        };
        let memory_limits_bytes = per_device_list(
            &nonempty(&get, var::MEMORY_LIMITS).unwrap_or_default(),
            var::MEMORY_LIMITS,
            "<size>",
            |text| crate::size::parse_bytes(text).map_err(|e| e.to_string()),
        )?;
        let compute_pct = compute_percents(&get)?;
        let nccl = NcclEnv::from_lookup(&get)?.ok_or_else(|| {
            EnvError(format!(
                "{} and {} are not set; the agent always sets them",
                var::NCCL_WEIGHT,
                var::NCCL_ACTIVITY_FILE
            ))
        })?;
        let netshare = NetshareEnv::from_lookup(&get)?.ok_or_else(|| {
            EnvError(format!(
                "{} and {} are not set; the agent always sets them",
                var::NETSHARE_TABLE,
                var::NETSHARE_FLOW
            ))
        })?;
        Ok(Some(TenantEnv {
            tenant,
            node: required(var::NODE)?,
            shm_dir: PathBuf::from(required(var::SHM_DIR)?),
            agent_state_dir: PathBuf::from(required(var::AGENT_STATE_DIR)?),
            memory_limits_bytes,
            compute_pct,
            priority: priority(&get)?,
            burst: flag(&get, var::BURST, false)?,
            guaranteed: nccl.guaranteed,
            nccl_weight: nccl.weight,
            nccl_activity_file: nccl.activity_file,
            netshare,
            spatial: flag(&get, var::SPATIAL, false)?,
            latency: flag(&get, var::LATENCY, false)?,
            latency_target_us: latency_target_us(&get)?,
        }))
    }
}

/// The interposer's memory side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryEnv {
    pub tenant: String,
    /// Per-device memory limit in bytes; `None` means that device is not limited.
    pub limits_bytes: [Option<u64>; DEVICES_MAX],
    pub shm_dir: PathBuf,
    /// Charged once per process on each device where it creates a context or allocates (the
    /// CUDA context's own memory), per device.
    pub context_overhead_bytes: [u64; DEVICES_MAX],
}

impl MemoryEnv {
    /// `Ok(None)` when `VGPU_TENANT` is unset or empty (pass-through).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<MemoryEnv>, EnvError> {
        let Some(tenant) = tenant(&get)? else {
            return Ok(None);
        };
        let parse_size = |text: &str| crate::size::parse_bytes(text).map_err(|e| e.to_string());
        let mut limits_bytes = [None; DEVICES_MAX];
        if let Some(all) = nonempty(&get, var::MEMORY_LIMIT) {
            let bytes =
                parse_size(&all).map_err(|e| EnvError(format!("{}: {e}", var::MEMORY_LIMIT)))?;
            limits_bytes = [Some(bytes); DEVICES_MAX];
        }
        if let Some(list) = nonempty(&get, var::MEMORY_LIMITS) {
            let listed = per_device_list(&list, var::MEMORY_LIMITS, "<size>", parse_size)?;
            for (limit, listed) in limits_bytes.iter_mut().zip(listed) {
                if listed.is_some() {
                    *limit = listed;
                }
            }
        }
        if limits_bytes.contains(&Some(0)) {
            return Err(EnvError(
                "VGPU_MEMORY_LIMIT(S): a limit of 0 bytes would refuse every allocation; hide the \
                 device with CUDA_VISIBLE_DEVICES instead"
                    .to_owned(),
            ));
        }
        let context_overhead_bytes = match nonempty(&get, var::CONTEXT_OVERHEAD) {
            Some(text) => context_overheads(&text)?,
            None => [CONTEXT_OVERHEAD_DEFAULT_BYTES; DEVICES_MAX],
        };
        Ok(Some(MemoryEnv {
            tenant,
            limits_bytes,
            shm_dir: shm_dir(&get),
            context_overhead_bytes,
        }))
    }

    /// The ledger file of this tenant.
    pub fn ledger_path(&self) -> PathBuf {
        crate::layout::ledger_path(&self.shm_dir, &self.tenant)
    }
}

/// The interposer's compute side: per-device shares and how the tenant shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeEnv {
    pub tenant: String,
    pub shm_dir: PathBuf,
    /// Per-device share in percent; `None`: not gated on that device.
    pub percent: [Option<u32>; DEVICES_MAX],
    pub burst: bool,
    pub guaranteed: bool,
    pub priority: i32,
    pub quantum_ms: u64,
    /// `false` (`VGPU_COMPUTE_TURNS=0`): launches never wait for a turn.
    pub turns: bool,
    /// `VGPU_COMPUTE_QUEUE_EVENTS`: unfinished sampled launches per stream before a launch
    /// waits; `None`: the interposer's default.
    pub queue_events: Option<usize>,
}

impl ComputeEnv {
    /// `Ok(None)` without a tenant or without any share (nothing to gate).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<ComputeEnv>, EnvError> {
        let Some(tenant) = tenant(&get)? else {
            return Ok(None);
        };
        let percent = compute_percents(&get)?;
        if percent.iter().all(Option::is_none) {
            return Ok(None);
        }
        Ok(Some(ComputeEnv {
            tenant,
            shm_dir: shm_dir(&get),
            percent,
            burst: flag(&get, var::BURST, false)?,
            guaranteed: flag(&get, var::GUARANTEED, true)?,
            priority: priority(&get)?,
            quantum_ms: number(&get, var::COMPUTE_QUANTUM_MS, 1..=1000, "milliseconds")?
                .unwrap_or(COMPUTE_QUANTUM_MS_DEFAULT),
            turns: flag(&get, var::COMPUTE_TURNS, true)?,
            queue_events: number(&get, var::COMPUTE_QUEUE_EVENTS, 1..=4096, "events")?
                .map(|n| n as usize),
        }))
    }
}

/// Spatial partitioning: squeezing this tenant onto fewer SMs while a latency tenant is active
/// on the GPU, or marking this tenant as that latency tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpatialEnv {
    pub tenant: String,
    pub shm_dir: PathBuf,
    pub latency: bool,
    pub hold_ms: u64,
    /// `None`: squeezed only as the agent's closed-loop decision says (an explicit count
    /// squeezes to it also while no decision is in force).
    pub sms: Option<u32>,
    /// A latency tenant's explicit step target.
    pub latency_target_us: Option<u64>,
}

impl SpatialEnv {
    /// `Ok(None)` without a tenant or without `VGPU_SPATIAL=1`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<SpatialEnv>, EnvError> {
        let Some(tenant) = tenant(&get)? else {
            return Ok(None);
        };
        if !flag(&get, var::SPATIAL, false)? {
            return Ok(None);
        }
        let hold_ms = number(&get, var::SPATIAL_HOLD_MS, 1..=SPATIAL_HOLD_MS_MAX, "")?
            .unwrap_or(SPATIAL_HOLD_MS_DEFAULT);
        let sms = number(&get, var::SPATIAL_SMS, 1..=100_000, "")?.map(|n| n as u32);
        Ok(Some(SpatialEnv {
            tenant,
            shm_dir: shm_dir(&get),
            latency: flag(&get, var::LATENCY, false)?,
            hold_ms,
            sms,
            latency_target_us: latency_target_us(&get)?,
        }))
    }
}

/// The NCCL tuner's side: who the tenant is among the node's tenants running collectives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclEnv {
    pub tenant: String,
    pub weight: u64,
    pub guaranteed: bool,
    /// The tuners' activity table.
    pub activity_file: PathBuf,
}

impl NcclEnv {
    /// `Ok(None)` without a tenant, or without a weight and an activity table (the tuner then
    /// keeps NCCL's choices).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<NcclEnv>, EnvError> {
        let Some(tenant) = tenant(&get)? else {
            return Ok(None);
        };
        let file = nonempty(&get, var::NCCL_ACTIVITY_FILE)
            .or_else(|| nonempty(&get, var::NCCL_SHARE_FILE_OLD));
        let (Some(weight), Some(file)) = (
            number(&get, var::NCCL_WEIGHT, 1..=NCCL_WEIGHT_MAX, "")?,
            file,
        ) else {
            return Ok(None);
        };
        Ok(Some(NcclEnv {
            tenant,
            weight,
            guaranteed: flag(&get, var::GUARANTEED, true)?,
            activity_file: PathBuf::from(file),
        }))
    }
}

/// The tenant's token bucket, which the NCCL plugin's network sends take from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetshareEnv {
    pub table: PathBuf,
    /// The tenant's flow id in the table (never 0).
    pub flow: u64,
}

impl NetshareEnv {
    /// `Ok(None)` unless both variables are set.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<NetshareEnv>, EnvError> {
        let (Some(table), Some(flow)) = (
            nonempty(&get, var::NETSHARE_TABLE),
            nonempty(&get, var::NETSHARE_FLOW),
        ) else {
            return Ok(None);
        };
        let flow = flow
            .parse::<u64>()
            .ok()
            .filter(|&flow| flow != 0)
            .ok_or_else(|| {
                EnvError(format!(
                    "{}: `{flow}` is not a flow id (a non-zero integer)",
                    var::NETSHARE_FLOW
                ))
            })?;
        Ok(Some(NetshareEnv {
            table: PathBuf::from(table),
            flow,
        }))
    }
}

/// The tenant's private directory when `VGPU_SHM_DIR` is set and not empty.
pub fn private_dir(get: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    nonempty(&get, var::SHM_DIR).map(PathBuf::from)
}

/// A variable's value, trimmed; `None` when unset or blank.
fn nonempty(get: &impl Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    get(name)
        .map(|value| value.trim().to_owned())
        .filter(|value| !value.is_empty())
}

fn shm_dir(get: &impl Fn(&str) -> Option<String>) -> PathBuf {
    nonempty(get, var::SHM_DIR).map_or_else(|| PathBuf::from(SHM_DIR_DEFAULT), PathBuf::from)
}

/// `VGPU_TENANT`: `None` when unset or blank (pass-through), an error when not a valid name.
fn tenant(get: &impl Fn(&str) -> Option<String>) -> Result<Option<String>, EnvError> {
    let Some(tenant) = nonempty(get, var::TENANT) else {
        return Ok(None);
    };
    check_tenant_name(&tenant)?;
    Ok(Some(tenant))
}

/// `1`/`true` or `0`/`false`; unset or blank: `default`.
fn flag(
    get: &impl Fn(&str) -> Option<String>,
    name: &str,
    default: bool,
) -> Result<bool, EnvError> {
    match nonempty(get, name).as_deref() {
        None => Ok(default),
        Some("1" | "true") => Ok(true),
        Some("0" | "false") => Ok(false),
        Some(other) => Err(EnvError(format!("{name}: `{other}` is not 0 or 1"))),
    }
}

/// A whole number in `range`; unset or blank: `None`.
fn number(
    get: &impl Fn(&str) -> Option<String>,
    name: &str,
    range: std::ops::RangeInclusive<u64>,
    unit: &str,
) -> Result<Option<u64>, EnvError> {
    let Some(text) = nonempty(get, name) else {
        return Ok(None);
    };
    let unit = if unit.is_empty() {
        String::new()
    } else {
        format!(" of {unit}")
    };
    text.parse::<u64>()
        .ok()
        .filter(|n| range.contains(n))
        .map(Some)
        .ok_or_else(|| {
            EnvError(format!(
                "{name}: `{text}` is not a whole number{unit} in {}..={}",
                range.start(),
                range.end()
            ))
        })
}

/// Bounds of `VGPU_LATENCY_TARGET_US`: 10 µs to 60 s.
pub const LATENCY_TARGET_US_MIN: u64 = 10;
pub const LATENCY_TARGET_US_MAX: u64 = 60_000_000;

fn latency_target_us(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u64>, EnvError> {
    number(
        get,
        var::LATENCY_TARGET_US,
        LATENCY_TARGET_US_MIN..=LATENCY_TARGET_US_MAX,
        "microseconds",
    )
}

fn priority(get: &impl Fn(&str) -> Option<String>) -> Result<i32, EnvError> {
    let Some(text) = nonempty(get, var::PRIORITY) else {
        return Ok(0);
    };
    text.parse::<i32>()
        .ok()
        .filter(|p| (PRIORITY_MIN..=PRIORITY_MAX).contains(p))
        .ok_or_else(|| {
            EnvError(format!(
                "{}: `{text}` is not an integer in {PRIORITY_MIN}..={PRIORITY_MAX}",
                var::PRIORITY
            ))
        })
}

/// `VGPU_COMPUTE_SHARES`; a share of 0 means "not gated", as an unlisted device.
fn compute_percents(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<[Option<u32>; DEVICES_MAX], EnvError> {
    let list = nonempty(get, var::COMPUTE_SHARES).unwrap_or_default();
    let listed = per_device_list(&list, var::COMPUTE_SHARES, "<percent>", |text| {
        text.trim_end_matches('%')
            .parse::<u32>()
            .ok()
            .filter(|pct| *pct <= 100)
            .ok_or_else(|| format!("`{text}` is not a percentage in 0..=100"))
    })?;
    Ok(listed.map(|pct| pct.filter(|&pct| pct > 0)))
}

/// `<device>:<value>,...` with device ordinals below [`DEVICES_MAX`]; unlisted devices are
/// `None`.
fn per_device_list<T: Copy>(
    list: &str,
    name: &str,
    value_name: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<[Option<T>; DEVICES_MAX], EnvError> {
    let mut values = [None; DEVICES_MAX];
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (device, value) = item.split_once(':').ok_or_else(|| {
            EnvError(format!(
                "{name}: `{item}` is not `<device>:{value_name}`, e.g. `0:{}`",
                if value_name == "<size>" {
                    "10GiB"
                } else {
                    "70"
                }
            ))
        })?;
        let device = device
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&d| d < DEVICES_MAX)
            .ok_or_else(|| {
                EnvError(format!(
                    "{name}: `{}` is not a device ordinal below {DEVICES_MAX}",
                    device.trim()
                ))
            })?;
        values[device] = Some(parse(value.trim()).map_err(|e| EnvError(format!("{name}: {e}")))?);
    }
    Ok(values)
}

/// Writes `<device>:<value>` for every listed device, in ordinal order.
fn per_device<T: Copy>(values: &[Option<T>; DEVICES_MAX], show: impl Fn(T) -> String) -> String {
    values
        .iter()
        .enumerate()
        .filter_map(|(device, value)| value.map(|value| format!("{device}:{}", show(value))))
        .collect::<Vec<_>>()
        .join(",")
}

/// `VGPU_CONTEXT_OVERHEAD`: one size for every device (`640MiB`, `0`), or `<device>:<size>,...`
/// where unlisted devices keep the default.
fn context_overheads(text: &str) -> Result<[u64; DEVICES_MAX], EnvError> {
    let parse_size = |text: &str| crate::size::parse_bytes(text).map_err(|e| e.to_string());
    if !text.contains(':') {
        let bytes =
            parse_size(text).map_err(|e| EnvError(format!("{}: {e}", var::CONTEXT_OVERHEAD)))?;
        return Ok([bytes; DEVICES_MAX]);
    }
    let listed = per_device_list(text, var::CONTEXT_OVERHEAD, "<size>", parse_size)?;
    Ok(listed.map(|bytes| bytes.unwrap_or(CONTEXT_OVERHEAD_DEFAULT_BYTES)))
}

/// Tenant names become file names: only DNS-label characters, so no `/` or `..` can sneak in.
pub fn check_tenant_name(name: &str) -> Result<(), EnvError> {
    let valid = !name.is_empty()
        && name.len() <= TENANT_NAME_LEN_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && !name.starts_with('-');
    if valid {
        Ok(())
    } else {
        Err(EnvError(format!(
            "{} `{name}` is not a valid tenant name (lowercase letters, digits, `-`, `_`; at most \
             {TENANT_NAME_LEN_MAX})",
            var::TENANT
        )))
    }
}

#[cfg(test)]
#[path = "env_test.rs"]
mod tests;
