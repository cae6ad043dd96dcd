//! The interposer's shared-memory formats, read from outside the tenants' processes (the node
//! agent's usage report).
//!
//! The layouts and their lock-free protocols are the interposer's own source files
//! (`nodeagent/interposer/src/{config,ledger,compute}.rs`), compiled into this crate as well
//! (`#[path]`), so there is one definition of each format and no copy that could drift. The agent
//! cannot link the interposer's rlib instead: that crate exports `#[no_mangle]` driver hooks and
//! a `dlsym` override, which would be linked into the agent and catch its own `dlsym` calls.
//!
//! Reading ([`read_ledger`], [`read_schedule`]) maps an existing file read-only and performs
//! atomic loads only, the way the interposer's processes read each other's words: it never
//! creates, writes, initialises or reclaims, and never waits on a process of a tenant (there is
//! nothing to wait on: the formats have no locks).
//!
//! **Architecture Invariant:** this crate depends on nothing but libc and thiserror; `unsafe`
//! lives only in `map`.

#[path = "../../interposer/src/compute.rs"]
#[allow(dead_code)]
pub mod compute;
#[path = "../../interposer/src/config.rs"]
#[allow(dead_code)]
pub mod config;
#[path = "../../interposer/src/ledger.rs"]
#[allow(dead_code)]
pub mod ledger;
mod map;

use std::path::{Path, PathBuf};

pub use compute::TenantTime;
pub use config::DEVICES_MAX;
pub use ledger::{LedgerUsage, ProcLiveness, ProcessCharge};

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is {found} bytes, not the {expected} of this vgpu version's layout; is it another version's file?"
    )]
    Size {
        path: PathBuf,
        found: u64,
        expected: usize,
    },
    #[error("cannot map {path}: {source}")]
    Map {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The creator has not published the magic yet (it is being created, or its creator died).
    #[error("{path} is not initialised yet")]
    Uninitialised { path: PathBuf },
    #[error("{path}: {message}")]
    Layout { path: PathBuf, message: String },
}

impl ReadError {
    /// Whether the file does not exist (nothing to report rather than a problem).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReadError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// The memory ledger of `tenant` under `shm_dir` (`<shm_dir>/<tenant>.mem`).
pub fn ledger_path(shm_dir: &Path, tenant: &str) -> PathBuf {
    // The interposer's own rule (`config::Config::ledger_path`), from the environment a tenant
    // process would have; a name it would refuse still gets the plain `<tenant>.mem`.
    let environment = |key: &str| match key {
        "VGPU_TENANT" => Some(tenant.to_owned()),
        "VGPU_SHM_DIR" => Some(shm_dir.to_string_lossy().into_owned()),
        _ => None,
    };
    match config::Config::from_lookup(environment) {
        Ok(Some(config)) => config.ledger_path(),
        _ => shm_dir.join(format!("{tenant}.mem")),
    }
}

/// The compute schedule of the GPU `uuid` under `shm_dir` (`<shm_dir>/<uuid>.compute`).
pub fn schedule_path(shm_dir: &Path, uuid: &str) -> PathBuf {
    shm_dir.join(format!("{uuid}.compute"))
}

/// Reads a tenant's memory ledger: limits and the live processes' charges per device ordinal
/// (as the tenant's processes number their devices).
pub fn read_ledger(path: &Path) -> Result<LedgerUsage, ReadError> {
    let mapped = map::ReadOnly::<ledger::Region>::open(path, ledger::REGION_BYTES)?;
    let region = mapped.region();
    if !region.is_initialised() {
        return Err(ReadError::Uninitialised {
            path: path.to_owned(),
        });
    }
    region.check_layout().map_err(|message| ReadError::Layout {
        path: path.to_owned(),
        message,
    })?;
    Ok(region.usage(&ProcLiveness))
}

/// Reads a GPU's compute schedule: each live tenant's GPU time.
pub fn read_schedule(path: &Path) -> Result<Vec<TenantTime>, ReadError> {
    let mapped = map::ReadOnly::<compute::Region>::open(path, compute::REGION_BYTES)?;
    let region = mapped.region();
    if !region.is_initialised() {
        return Err(ReadError::Uninitialised {
            path: path.to_owned(),
        });
    }
    region.check_layout().map_err(|message| ReadError::Layout {
        path: path.to_owned(),
        message,
    })?;
    Ok(region.tenant_times(&ProcLiveness))
}

#[cfg(test)]
mod reader_tests;
#[cfg(any(test, feature = "writer"))]
pub mod writer;
