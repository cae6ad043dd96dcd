//! Per-tenant node-local state, readable and writable only by the tenant and the agent.
//!
//! Everything a tenant's processes share with the agent lives in the tenant's own directory
//! under the shared-memory directory (`shm_dir`: `/dev/shm/vgpu` by default, `STATE_DIR/shm` for
//! a simulated agent so that several on one host keep apart; the agent records it in
//! `STATE_DIR/shm-dir`, where `exec` and `env` find it):
//!
//! | path | mode, owner | what |
//! | --- | --- | --- |
//! | `./`, `tenants/` | 0711, agent | search only: a tenant reaches its own directory by name and can list nothing |
//! | `tenants/<t>/` | 0700, the tenant's user | the tenant's `VGPU_SHM_DIR`, and the only path to anything below |
//! | `tenants/<t>/<t>.mem` | 0600, created by the interposer | the tenant's memory ledger |
//! | `tenants/<t>/netshare` | 0666, agent | the tenant's token bucket: the agent sets its rate, the NCCL plugin takes from it |
//! | `tenants/<t>/<gpu uuid>.compute` | hard link to `gpus/<gpu uuid>.compute` | the compute schedule of each GPU the tenant is on |
//! | `tenants/<t>/nccl-activity` | hard link to `node/nccl-activity` | the NCCL tuners' activity table |
//! | `gpus/`, `node/` | 0700, agent | the originals of the tables tenants share |
//! | `tenants/<t>/<gpu uuid>.memory` | hard link to `gpus/<gpu uuid>.memory` | the memory board of each GPU the tenant is on, where the agent keeps boards |
//! | `gpus/<gpu uuid>.memory` | 0666, agent | the GPU's memory board (elastic memory: capacity, the tenants' requests and limits, what their processes hold; [`publish_boards`]) |
//!
//! The tenant's user is `vgpu-<tenant>` when the node has such a user ([`crate::users`]), else
//! the agent's own user. A file's permission bits only matter to whoever can reach a path to it,
//! so a tenant's files are out of reach of every other tenant and user (root and the agent
//! aside). The two tables that several tenants must write to coordinate (a GPU's compute
//! schedule among the tenants placed on that GPU; the tuners' activity table among the tenants
//! of the node) are hard-linked into exactly those tenants' directories and nowhere else, and
//! unlinked when a tenant leaves; they hold shares, timestamps, process ids and name hashes,
//! never a tenant's data. Containers get only their tenant's directory (see [`crate::cdi`]).
//!
//! One program keeps a shared-memory directory's tenants ([`Keeper`], recorded in
//! [`KEEPER_FILE`] by [`claim_keeper`]): the agent, or on a Kubernetes-managed node the DRA
//! driver.
//!
//! [`prepare`] is idempotent and runs before every assignment set is committed, so a tenant's
//! directory exists before `vgpu-agent exec` or a container can see the tenant as placed, and
//! a released tenant's directory goes with its placement.

use std::collections::BTreeSet;
use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::assignments::AssignmentSet;
use crate::users::{self, Identity};

use tenant_abi::layout::{
    NCCL_ACTIVITY_FILE, NCCL_ACTIVITY_FILE_OLD, NETSHARE_FILE, NETSHARE_LOCK_FILE,
};

const ROOT_MODE: u32 = 0o711;
const TENANT_MODE: u32 = 0o700;
const AGENT_ONLY_MODE: u32 = 0o700;

/// Where everything is, under the shared-memory directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    pub fn new(root: &Path) -> Layout {
        Layout {
            root: root.to_owned(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn tenants(&self) -> PathBuf {
        self.root.join("tenants")
    }

    /// The tenant's private directory: its `VGPU_SHM_DIR`.
    pub fn tenant_dir(&self, tenant: &str) -> PathBuf {
        self.tenants().join(tenant)
    }

    /// The tenant's memory ledger (the interposer's own naming rule, in the tenant's directory).
    pub fn ledger(&self, tenant: &str) -> PathBuf {
        tenant_abi::layout::ledger_path(&self.tenant_dir(tenant), tenant)
    }

    /// The original of GPU `uuid`'s compute schedule.
    pub fn schedule(&self, uuid: &str) -> PathBuf {
        tenant_abi::layout::schedule_path(&self.root.join("gpus"), uuid)
    }

    /// The original of GPU `uuid`'s memory board (elastic memory, issue 17), linked into the
    /// directories of its tenants by [`publish_boards`].
    pub fn board(&self, uuid: &str) -> PathBuf {
        tenant_abi::layout::board_path(&self.root.join("gpus"), uuid)
    }

    /// The GPU's swap staging file (`tenant_abi::slabs`), beside its board.
    pub fn staging(&self, uuid: &str) -> PathBuf {
        tenant_abi::layout::staging_path(&self.root.join("gpus"), uuid)
    }

    fn node_activity(&self) -> PathBuf {
        self.root.join("node").join(NCCL_ACTIVITY_FILE)
    }

    /// The tenant's link to the tuners' activity table.
    pub fn nccl_activity(&self, tenant: &str) -> PathBuf {
        self.tenant_dir(tenant).join(NCCL_ACTIVITY_FILE)
    }

    /// The tenant's token-bucket table.
    pub fn netshare(&self, tenant: &str) -> PathBuf {
        self.tenant_dir(tenant).join(NETSHARE_FILE)
    }
}

/// The file in the shared-memory directory that names who keeps its tenant directories.
pub const KEEPER_FILE: &str = "keeper";

/// Who keeps the tenant directories of a shared-memory directory. Each of them removes the
/// directories of tenants it does not know ([`prepare`]), so there is exactly one per node: a
/// node is Kubernetes-managed (the DRA driver keeps its pods' claims) or vgpu-managed (the agent
/// keeps the control plane's tenants), never both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keeper {
    /// `vgpu-agent join`.
    Agent,
    /// `vgpu-dra run`, the Kubernetes DRA driver.
    KubernetesDriver,
}

impl Keeper {
    /// The name written into [`KEEPER_FILE`].
    pub fn name(self) -> &'static str {
        match self {
            Keeper::Agent => "vgpu-agent",
            Keeper::KubernetesDriver => "vgpu-dra",
        }
    }
}

/// Records `keeper` as the keeper of `layout`'s tenant directories, or refuses when the other
/// keeper is recorded there. The record is made atomically (a hard link of a complete file), so
/// of two keepers starting at once exactly one wins; it stays until someone removes it (the
/// error says when to), or until the reboot that empties `/dev/shm`.
pub fn claim_keeper(layout: &Layout, keeper: Keeper) -> Result<(), PrivateError> {
    directory(layout.root(), ROOT_MODE)?;
    let path = layout.root().join(KEEPER_FILE);
    let recorded = |path: &Path| -> Result<String, PrivateError> {
        let text = std::fs::read_to_string(path).map_err(io("read", path))?;
        Ok(text.trim().to_owned())
    };
    if !path.exists() {
        let temporary = layout
            .root()
            .join(format!(".{KEEPER_FILE}.{}.tmp", std::process::id()));
        std::fs::write(&temporary, format!("{}\n", keeper.name()))
            .map_err(io("write", &temporary))?;
        let linked = std::fs::hard_link(&temporary, &path);
        let _ = std::fs::remove_file(&temporary);
        match linked {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(error) => return Err(io("create", &path)(error)),
        }
    }
    let holder = recorded(&path)?;
    if holder == keeper.name() {
        return Ok(());
    }
    Err(PrivateError::OtherKeeper {
        path,
        holder,
        wanted: keeper.name(),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum PrivateError {
    #[error(
        "{path} says the tenant directories here are kept by {holder}, so {wanted} must not keep them too (each removes the other's tenants): a node is Kubernetes-managed (vgpu-dra) or vgpu-managed (vgpu-agent join), never both. To hand the node over, stop {holder} and remove {path}"
    )]
    OtherKeeper {
        path: PathBuf,
        holder: String,
        wanted: &'static str,
    },
    #[error(
        "cannot {action} {path}: {source}; tenants' node-local state is not private until this is fixed (is the shared-memory directory on a local filesystem, and does the agent run as root or as the directory's owner?)"
    )]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot give tenant {tenant}'s directory {path} to uid {uid}: {source}; only an agent running as root can hand directories to `{prefix}<tenant>` users",
        prefix = users::USER_PREFIX
    )]
    Chown {
        tenant: String,
        path: PathBuf,
        uid: u32,
        source: std::io::Error,
    },
    #[error("cannot create the compute schedule of GPU {uuid}: {message}")]
    Schedule { uuid: String, message: String },
    #[error("cannot write the memory board of GPU {uuid}: {message}")]
    Board { uuid: String, message: String },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PrivateError {
    let path = path.to_owned();
    move |source| PrivateError::Io {
        action,
        path,
        source,
    }
}

/// What [`prepare`] did.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Tenants whose directory was created.
    pub created: Vec<String>,
    /// Directories of tenants no longer placed, removed.
    pub removed: Vec<String>,
    /// Files of the layout before private directories (directly in the root), removed.
    pub old_files: Vec<String>,
    /// Per-tenant problems; the other tenants were prepared.
    pub problems: Vec<PrivateError>,
}

/// Brings the directories in line with `set`: every placed tenant has its directory, owned by
/// its user, with links to the schedules of exactly its GPUs and to the activity table; every
/// other tenant directory is gone. `owner` says whose a tenant's directory is (in the agent:
/// [`users::tenant_identity`] with the agent's own identity as the fallback).
/// Errors about the shared directories fail the whole call; a tenant's own problem is reported
/// in [`Prepared::problems`] and the others go on.
pub fn prepare(
    layout: &Layout,
    set: &AssignmentSet,
    owner: &dyn Fn(&str) -> Identity,
    quantum_ns: u64,
) -> Result<Prepared, PrivateError> {
    let mut prepared = Prepared::default();
    directory(layout.root(), ROOT_MODE)?;
    prepared.old_files = remove_old_layout(layout.root())?;
    directory(&layout.root.join("gpus"), AGENT_ONLY_MODE)?;
    directory(&layout.root.join("node"), AGENT_ONLY_MODE)?;
    directory(&layout.tenants(), ROOT_MODE)?;
    rename_old_activity_table(layout)?;
    shared_file(&layout.node_activity())?;
    let gpus: BTreeSet<&str> = set
        .tenants
        .values()
        .flat_map(|t| t.slices.iter().map(|s| s.gpu_uuid.as_str()))
        .collect();
    for uuid in &gpus {
        tenant_abi::create_schedule(&layout.schedule(uuid), quantum_ns).map_err(|error| {
            PrivateError::Schedule {
                uuid: (*uuid).to_owned(),
                message: error.to_string(),
            }
        })?;
    }
    for (name, assignment) in &set.tenants {
        let own: BTreeSet<&str> = assignment
            .slices
            .iter()
            .map(|s| s.gpu_uuid.as_str())
            .collect();
        match tenant_directory(layout, name, &own, owner(name)) {
            Ok(true) => prepared.created.push(name.clone()),
            Ok(false) => {}
            Err(error) => prepared.problems.push(error),
        }
    }
    let tenants = layout.tenants();
    for entry in std::fs::read_dir(&tenants).map_err(io("list", &tenants))? {
        let entry = entry.map_err(io("list", &tenants))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if set.tenants.contains_key(&name) {
            continue;
        }
        let path = entry.path();
        let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Ok(()) => prepared.removed.push(name),
            Err(error) => prepared.problems.push(io("remove", &path)(error)),
        }
    }
    Ok(prepared)
}

/// The least a GPU's memory board keeps back from its tenants (contexts, NCCL's buffers and
/// fragmentation headroom, `docs/design/elastic-memory.md`): what a new board starts with; the
/// monitor raises it to what it measures outside the board (`crate::reserve`).
pub const BOARD_RESERVE_BYTES: u64 = crate::reserve::FLOOR_BYTES;

/// The node's GPUs as their memory boards see them.
#[derive(Debug, Clone, Copy)]
pub struct BoardGpus<'g> {
    /// uuid -> the GPU's memory in bytes.
    pub memory_bytes: &'g std::collections::BTreeMap<String, u64>,
    /// The node's pinned host memory for swapped-out borrowed memory (`swap_host_memory`).
    pub swap_host_memory_bytes: u64,
    /// One staging file per GPU shared by its processes (the agent's `shared_staging`).
    pub shared_staging: bool,
}

impl BoardGpus<'_> {
    /// Each GPU's share of the node's swap staging: an even split, so that the boards (one per
    /// GPU, each with its own lock-free budget) together never pass the node's.
    pub fn staging_budget_per_gpu(&self) -> u64 {
        let count = self.memory_bytes.len().max(1) as u64;
        let share = self.swap_host_memory_bytes / count;
        assert!(share.saturating_mul(count) <= self.swap_host_memory_bytes);
        share
    }
}

/// Creates (once) and writes the memory board of every GPU of `gpus` (uuid -> its memory in
/// bytes): what the tenants may hold in all (the memory less [`BOARD_RESERVE_BYTES`]), its share
/// of the node's swap staging ([`BoardGpus::staging_budget_per_gpu`]) and one
/// entry per tenant of `set` placed on it (request: its slice's memory; limit: the slice's
/// memory limit; its priority; whether the slice is guaranteed), and links each board into the
/// directories of the tenants on its GPU. Elastic memory on the node (issue 17): the agent reads
/// the boards back for usage reports (`usage`); the tenants' interposers reserve against them. Returns
/// what could not be written or linked; the rest is. Call after [`prepare`] (which makes `gpus/`
/// and the tenants' directories, and unlinks boards of GPUs a tenant left).
pub fn publish_boards(
    layout: &Layout,
    set: &AssignmentSet,
    gpus: &BoardGpus<'_>,
) -> Vec<PrivateError> {
    let mut problems = Vec::new();
    let staging_budget_bytes = gpus.staging_budget_per_gpu();
    for (uuid, memory_bytes) in gpus.memory_bytes {
        let specs: Vec<tenant_abi::board::TenantSpec> = set
            .tenants
            .values()
            .flat_map(|tenant| {
                tenant
                    .slices
                    .iter()
                    .filter(|slice| &slice.gpu_uuid == uuid)
                    .map(|slice| tenant_abi::board::TenantSpec {
                        name: tenant.tenant.clone(),
                        request_bytes: slice.memory_bytes,
                        limit_bytes: slice.limit_bytes(),
                        priority: tenant.priority,
                        guaranteed: slice.guaranteed,
                    })
            })
            .collect();
        let path = layout.board(uuid);
        // A board the monitor already lowered to its measured reserve keeps that capacity (it
        // is never above this one; the monitor raises it again when the outside use falls).
        let floor_capacity = memory_bytes.saturating_sub(BOARD_RESERVE_BYTES);
        let measured = tenant_abi::shm::board_counts(&path)
            .ok()
            .map(|(capacity, _)| capacity)
            .filter(|&capacity| capacity > 0);
        let gpu = tenant_abi::board::GpuSpec {
            capacity_bytes: measured.map_or(floor_capacity, |c| c.min(floor_capacity)),
            staging_budget_bytes,
        };
        let write = || {
            tenant_abi::shm::create_board(&path)
                .map_err(tenant_abi::shm::BoardWriteError::Read)
                .and_then(|_| tenant_abi::shm::write_board(&path, gpu, &specs))
        };
        let written = match write() {
            Err(tenant_abi::shm::BoardWriteError::Read(error)) if error.is_other_version() => {
                // Left by another vgpu version (an upgraded agent): replaced. Processes started
                // before keep the old file, unlinked, until they exit; their memory shows as
                // used outside the board meanwhile, which the measured reserve keeps back
                // (`crate::reserve`).
                tracing::warn!(
                    "GPU {uuid}: replacing its memory board, written by another vgpu version \
                     ({error}); tenant processes started before keep the old one until they exit"
                );
                std::fs::remove_file(&path)
                    .map_err(|error| error.to_string())
                    .and_then(|()| write().map_err(|error| error.to_string()))
            }
            other => other.map_err(|error| error.to_string()),
        };
        if let Err(message) = written {
            problems.push(PrivateError::Board {
                uuid: uuid.clone(),
                message,
            });
            continue;
        }
        let staging = gpus
            .shared_staging
            .then(|| publish_staging(layout, uuid, staging_budget_bytes))
            .and_then(|made| match made {
                Ok(path) => path,
                Err(message) => {
                    problems.push(PrivateError::Board {
                        uuid: uuid.clone(),
                        message,
                    });
                    None
                }
            });
        // Linked into the directory of each tenant on the GPU, as its compute schedule is
        // (`prepare` unlinks the boards of GPUs a tenant left).
        for spec in &specs {
            let tenant_dir = layout.tenant_dir(&spec.name);
            if !tenant_dir.is_dir() {
                continue;
            }
            if let Err(error) = link(&path, &tenant_abi::layout::board_path(&tenant_dir, uuid)) {
                problems.push(error);
            }
            let staging_link = tenant_abi::layout::staging_path(&tenant_dir, uuid);
            let linked = match &staging {
                Some(staging) => link(staging, &staging_link),
                // Off (or no file): a link left from when it was on goes, so that the tenant's
                // new processes pin their own staging.
                None => unlink_if_there(&staging_link),
            };
            if let Err(error) = linked {
                problems.push(error);
            }
        }
        if staging.is_none()
            && let Err(error) = unlink_if_there(&layout.staging(uuid))
        {
            problems.push(error);
        }
    }
    problems
}

/// Creates the GPU's swap staging file for `budget_bytes` (replacing one of another budget or
/// version) and allocates its pages in the background, once per file; `Ok(None)` when the budget
/// holds no slab. A file whose pages cannot be allocated (a full `/dev/shm`) is removed again,
/// with a warning: processes then pin their own staging, as without the file.
fn publish_staging(
    layout: &Layout,
    uuid: &str,
    budget_bytes: u64,
) -> Result<Option<PathBuf>, String> {
    if budget_bytes < tenant_abi::slabs::SLAB_BYTES_MIN {
        return Ok(None);
    }
    let path = layout.staging(uuid);
    if unallocatable().contains(&path) {
        // Its pages could not be allocated before (said then): not again until the agent
        // restarts, so that every assignment change does not fill `/dev/shm` and warn anew.
        return Ok(None);
    }
    let created = match tenant_abi::shm::create_staging(&path, budget_bytes) {
        Err(error) if error.is_other_version() => {
            tracing::warn!(
                "GPU {uuid}: replacing its swap staging file ({error}); processes started before \
                 keep the old one until they exit"
            );
            std::fs::remove_file(&path)
                .map_err(|error| format!("cannot remove {}: {error}", path.display()))?;
            tenant_abi::shm::create_staging(&path, budget_bytes).map_err(|e| e.to_string())?
        }
        other => other.map_err(|e| e.to_string())?,
    };
    // A file there already whose allocation never finished (an agent stopped in the middle of
    // it) is allocated again: processes register only an allocated file.
    let unfinished = !created && !tenant_abi::shm::staging_allocated(&path).unwrap_or(true);
    if (created || unfinished) && allocating().insert(path.clone()) {
        let (uuid, path) = (uuid.to_owned(), path.clone());
        let in_flight = path.clone();
        std::thread::Builder::new()
            .name("vgpu-staging".into())
            .spawn(move || {
                let began = std::time::Instant::now();
                let allocated = tenant_abi::shm::allocate_staging(&path);
                allocating().remove(&path);
                match allocated {
                    Ok(()) => tracing::info!(
                        "GPU {uuid}: swap staging file {} allocated ({:.1} GiB in {:.1} s)",
                        path.display(),
                        budget_bytes as f64 / (1u64 << 30) as f64,
                        began.elapsed().as_secs_f64()
                    ),
                    Err(error) => {
                        tracing::warn!(
                            "GPU {uuid}: the swap staging file cannot hold its budget ({error}); \
                             removed: tenant processes pin their own staging (give /dev/shm room \
                             for swap_host_memory, or turn shared_staging off)"
                        );
                        let _ = std::fs::remove_file(&path);
                        unallocatable().insert(path);
                    }
                }
            })
            .map_err(|error| {
                allocating().remove(&in_flight);
                format!("cannot start the staging file's allocation: {error}")
            })?;
    }
    Ok(Some(path))
}

/// A process-wide set of staging files' paths.
type PathSet = std::sync::Mutex<std::collections::BTreeSet<PathBuf>>;

fn locked(
    set: &'static PathSet,
) -> std::sync::MutexGuard<'static, std::collections::BTreeSet<PathBuf>> {
    set.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The staging files being allocated now (by a thread of `publish_staging`).
fn allocating() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<PathBuf>> {
    static ALLOCATING: PathSet = std::sync::Mutex::new(std::collections::BTreeSet::new());
    locked(&ALLOCATING)
}

/// The staging files whose pages could not be allocated since the agent started (at most one
/// per GPU of the node).
fn unallocatable() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<PathBuf>> {
    static FAILED: PathSet = std::sync::Mutex::new(std::collections::BTreeSet::new());
    locked(&FAILED)
}

/// Removes `path` if it is there.
fn unlink_if_there(path: &Path) -> Result<(), PrivateError> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(PrivateError::Io {
            action: "unlink",
            path: path.to_owned(),
            source: error,
        }),
        _ => Ok(()),
    }
}

/// Creates `path` (and its parents) if missing and sets `mode`.
fn directory(path: &Path, mode: u32) -> Result<(), PrivateError> {
    DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(io("create", path))?;
    let metadata = std::fs::symlink_metadata(path).map_err(io("inspect", path))?;
    if !metadata.is_dir() {
        return Err(PrivateError::Io {
            action: "use",
            path: path.to_owned(),
            source: std::io::Error::other("it is not a directory"),
        });
    }
    if metadata.mode() & 0o7777 != mode {
        std::fs::set_permissions(path, Permissions::from_mode(mode))
            .map_err(io("set the mode of", path))?;
    }
    Ok(())
}

/// Creates an empty shared table file (its users initialise an empty file) if missing.
fn shared_file(path: &Path) -> Result<(), PrivateError> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o666)
        .open(path)
        .map_err(io("create", path))?;
    file.set_permissions(Permissions::from_mode(0o666))
        .map_err(io("set the mode of", path))
}

/// What agents before private directories left directly in the root (tenants' ledgers, GPU
/// schedules, the shared tables, all reachable by name) goes; nothing else is touched, in case
/// the directory is shared with something else.
fn remove_old_layout(root: &Path) -> Result<Vec<String>, PrivateError> {
    let old = |name: &str| {
        [NCCL_ACTIVITY_FILE_OLD, NETSHARE_FILE, NETSHARE_LOCK_FILE].contains(&name)
            || name.ends_with(".mem")
            || name.ends_with(".compute")
    };
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io("list", root))? {
        let entry = entry.map_err(io("list", root))?;
        if entry.file_type().is_ok_and(|t| t.is_file()) && old(&entry.file_name().to_string_lossy())
        {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io("remove", &path))?;
            removed.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(removed)
}

/// One tenant's directory; says whether it was created.
fn tenant_directory(
    layout: &Layout,
    tenant: &str,
    gpus: &BTreeSet<&str>,
    owner: Identity,
) -> Result<bool, PrivateError> {
    let path = layout.tenant_dir(tenant);
    let created = !path.exists();
    directory(&path, TENANT_MODE)?;
    let metadata = std::fs::metadata(&path).map_err(io("inspect", &path))?;
    if (metadata.uid(), metadata.gid()) != (owner.uid, owner.gid) {
        std::os::unix::fs::chown(&path, Some(owner.uid), Some(owner.gid)).map_err(|source| {
            PrivateError::Chown {
                tenant: tenant.to_owned(),
                path: path.clone(),
                uid: owner.uid,
                source,
            }
        })?;
    }
    link(&layout.node_activity(), &layout.nccl_activity(tenant))?;
    let old_link = path.join(NCCL_ACTIVITY_FILE_OLD);
    if std::fs::symlink_metadata(&old_link).is_ok() {
        std::fs::remove_file(&old_link).map_err(io("unlink", &old_link))?;
    }
    for uuid in gpus {
        link(
            &layout.schedule(uuid),
            &tenant_abi::layout::schedule_path(&path, uuid),
        )?;
    }
    // Schedules and memory boards of GPUs the tenant is no longer on.
    for entry in std::fs::read_dir(&path).map_err(io("list", &path))? {
        let entry = entry.map_err(io("list", &path))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(uuid) = name
            .strip_suffix(".compute")
            .or_else(|| name.strip_suffix(".memory"))
            .or_else(|| name.strip_suffix(".staging"))
            && !gpus.contains(uuid)
        {
            let stale = entry.path();
            std::fs::remove_file(&stale).map_err(io("unlink", &stale))?;
        }
    }
    Ok(created)
}

/// The activity table's original under its name before agents called it `nccl-activity` is
/// renamed, not replaced: it is the same file (inode) the tenants' links of an older agent reach,
/// so running tuners and new ones keep seeing each other across the upgrade.
fn rename_old_activity_table(layout: &Layout) -> Result<(), PrivateError> {
    let old = layout.root.join("node").join(NCCL_ACTIVITY_FILE_OLD);
    let new = layout.node_activity();
    if std::fs::symlink_metadata(&old).is_ok() && std::fs::symlink_metadata(&new).is_err() {
        std::fs::rename(&old, &new).map_err(io("rename", &old))?;
    }
    Ok(())
}

/// Makes `link` a hard link to `original` (replacing whatever else is there).
fn link(original: &Path, link: &Path) -> Result<(), PrivateError> {
    let want = std::fs::metadata(original).map_err(io("inspect", original))?;
    if let Ok(have) = std::fs::symlink_metadata(link) {
        if (have.dev(), have.ino()) == (want.dev(), want.ino()) {
            return Ok(());
        }
        std::fs::remove_file(link).map_err(io("replace", link))?;
    }
    std::fs::hard_link(original, link).map_err(io("link", link))
}

/// The owner rule of the agent: `vgpu-<tenant>` when the node has that user, else the agent.
pub fn agent_owner(tenant: &str) -> Identity {
    users::tenant_identity(tenant, users::current())
}

/// Whether tenant `tenant`'s directory is ready for its processes (for `exec` and `env`).
pub fn is_prepared(layout: &Layout, tenant: &str) -> bool {
    layout.nccl_activity(tenant).exists()
}

#[cfg(test)]
#[path = "private_test.rs"]
mod tests;
