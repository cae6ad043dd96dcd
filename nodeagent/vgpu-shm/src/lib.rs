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
//! The one write: [`create_schedule`] makes a GPU's compute schedule, initialised, before any
//! tenant process runs, so that the agent can hand the same file to every tenant placed on that
//! GPU through the tenants' private directories (`vgpu_agent::private`).
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

/// Creates the compute schedule of a GPU at `path`, initialised with `quantum_ns`, unless a file
/// is already there; says whether it created one. The file is built and initialised under a
/// temporary name and then linked into place (`link(2)` never replaces), so no process ever
/// sees a half-made schedule, and a concurrent creator's file is kept. Mode 0666: who may open
/// it is decided by the directories it is reachable through.
pub fn create_schedule(path: &Path, quantum_ns: u64) -> Result<bool, ReadError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if path.exists() {
        return Ok(false);
    }
    let open_error = |path: &Path| {
        let path = path.to_owned();
        move |source| ReadError::Open { path, source }
    };
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".tmp.{}", std::process::id()));
    let temporary = PathBuf::from(temporary);
    let _ = std::fs::remove_file(&temporary);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&temporary)
        .map_err(open_error(&temporary))?;
    let made = (|| {
        file.set_permissions(std::fs::Permissions::from_mode(0o666))
            .map_err(open_error(&temporary))?;
        file.set_len(compute::REGION_BYTES as u64)
            .map_err(open_error(&temporary))?;
        let mapping =
            map::Mapping::<compute::Region>::writable(&temporary, &file, compute::REGION_BYTES)?;
        mapping.region().initialise(quantum_ns);
        drop(mapping);
        match std::fs::hard_link(&temporary, path) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(open_error(path)(error)),
        }
    })();
    let _ = std::fs::remove_file(&temporary);
    made
}

#[cfg(test)]
mod reader_tests;
#[cfg(any(test, feature = "writer"))]
pub mod writer;
