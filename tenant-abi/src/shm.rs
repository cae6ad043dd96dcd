//! The shared files read from outside the tenants' processes (the node agent's usage report),
//! through the same layout code ([`crate::ledger`], [`crate::compute`]) the interposer uses
//! inside them, so there is one definition of each format and no copy that could drift.
//!
//! Reading ([`read_ledger`], [`read_schedule`]) maps an existing file read-only and performs
//! atomic loads only, the way the interposer's processes read each other's words: it never
//! creates, writes, initialises or reclaims, and never waits on a process of a tenant (there is
//! nothing to wait on: the formats have no locks).
//!
//! The writes: [`create_schedule`] makes a GPU's compute schedule, initialised, before any
//! tenant process runs, so that the agent can hand the same file to every tenant placed on that
//! GPU through the tenants' private directories (`vgpu_agent::private`); [`create_board`] and
//! [`write_board`] make and fill a GPU's memory board (`crate::board`) the same way.

use std::path::{Path, PathBuf};

use crate::board;
use crate::compute::{self, TenantTime};
use crate::ledger::{self, LedgerUsage, ProcLiveness};
use crate::map;

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
    /// Whether the file is another vgpu version's (its size or its header's layout differ).
    pub fn is_other_version(&self) -> bool {
        matches!(self, ReadError::Size { .. } | ReadError::Layout { .. })
    }

    /// Whether the file does not exist (nothing to report rather than a problem).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReadError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// The checks every reader makes of a mapped region: its creator has published it, and its
/// layout is this build's.
fn checked(path: &Path, initialised: bool, layout: Result<(), String>) -> Result<(), ReadError> {
    if !initialised {
        return Err(ReadError::Uninitialised {
            path: path.to_owned(),
        });
    }
    layout.map_err(|message| ReadError::Layout {
        path: path.to_owned(),
        message,
    })
}

/// Reads a tenant's memory ledger: limits and the live processes' charges per device ordinal
/// (as the tenant's processes number their devices).
pub fn read_ledger(path: &Path) -> Result<LedgerUsage, ReadError> {
    let mapped = map::ReadOnly::<ledger::Region>::open(path, ledger::REGION_BYTES)?;
    let region = mapped.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    Ok(region.usage(&ProcLiveness))
}

/// Reads a GPU's compute schedule: each live tenant's GPU time.
pub fn read_schedule(path: &Path) -> Result<Vec<TenantTime>, ReadError> {
    let mapped = map::ReadOnly::<compute::Region>::open(path, compute::REGION_BYTES)?;
    let region = mapped.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    Ok(region.tenant_times(&ProcLiveness))
}

/// Creates the compute schedule of a GPU at `path`, initialised with `quantum_ns`, unless a file
/// is already there; says whether it created one. The file is built and initialised under a
/// temporary name and then linked into place (`link(2)` never replaces), so no process ever
/// sees a half-made schedule, and a concurrent creator's file is kept. Mode 0666: who may open
/// it is decided by the directories it is reachable through.
pub fn create_schedule(path: &Path, quantum_ns: u64) -> Result<bool, ReadError> {
    create_region::<compute::Region>(path, compute::REGION_BYTES, |region| {
        region.initialise(quantum_ns)
    })
}

/// Creates the memory board of a GPU at `path` (`crate::board`), initialised with nothing lent
/// (capacity 0, no tenants) until [`write_board`] fills it, unless a file is already there; as
/// [`create_schedule`].
pub fn create_board(path: &Path) -> Result<bool, ReadError> {
    create_region::<board::Region>(path, board::REGION_BYTES, board::Region::initialise)
}

/// The agent writes a GPU's board: what tenants may hold in all and the swap staging budget
/// (`gpu`), and one entry per tenant placed on the GPU (`specs`); entries of tenants no longer
/// in `specs` are removed (their processes' slots keep their counts until those processes exit).
/// The board must exist ([`create_board`]).
pub fn write_board(
    path: &Path,
    gpu: board::GpuSpec,
    specs: &[board::TenantSpec],
) -> Result<(), BoardWriteError> {
    let mapping = open_writable::<board::Region>(path, board::REGION_BYTES)?;
    let region = mapping.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    region.set_capacity(gpu.capacity_bytes);
    region.set_staging_budget(gpu.staging_budget_bytes);
    for name in region.tenant_names() {
        if !specs.iter().any(|spec| spec.name == name) {
            region.remove_tenant(&name);
        }
    }
    for spec in specs {
        region
            .set_tenant(spec)
            .map_err(|source| BoardWriteError::Spec {
                path: path.to_owned(),
                source,
            })?;
    }
    Ok(())
}

/// Why the agent could not write a board.
#[derive(Debug, thiserror::Error)]
pub enum BoardWriteError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{path}: {source}")]
    Spec {
        path: PathBuf,
        source: board::SpecError,
    },
}

/// Reads a GPU's memory board: its capacity and its tenants as the reclaim planner sees them.
pub fn read_board(path: &Path) -> Result<(u64, Vec<crate::reclaim::Holder>), ReadError> {
    let mapped = map::ReadOnly::<board::Region>::open(path, board::REGION_BYTES)?;
    let region = mapped.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    Ok((region.capacity(), region.holders()))
}

/// A GPU's board's capacity and what its processes hold resident in all, for the agent's
/// measured reserve (`vgpu_agent::reserve`).
pub fn board_counts(path: &Path) -> Result<(u64, u64), ReadError> {
    let mapped = map::ReadOnly::<board::Region>::open(path, board::REGION_BYTES)?;
    let region = mapped.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    Ok((region.capacity(), region.resident_total()))
}

/// Sets what a GPU's board lets its tenants hold in all (the GPU's memory less what the agent
/// measured it keeps back); the board must exist and be written ([`write_board`]).
pub fn set_board_capacity(path: &Path, bytes: u64) -> Result<(), ReadError> {
    let mapping = open_writable::<board::Region>(path, board::REGION_BYTES)?;
    let region = mapping.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    region.set_capacity(bytes);
    Ok(())
}

/// The agent's periodic look at a GPU's board: reclaims the slots of processes that died without
/// giving their memory back (so their bytes no longer count against the capacity, their tenant's
/// limit or the report), then reads what each tenant holds. Returns the usage and how many slots
/// were reclaimed.
pub fn sample_board(path: &Path) -> Result<(Vec<board::TenantUsage>, usize), ReadError> {
    let mapping = open_writable::<board::Region>(path, board::REGION_BYTES)?;
    let region = mapping.region();
    checked(path, region.is_initialised(), region.check_layout())?;
    let reclaimed = board::Board::new(region, crate::ProcLiveness).reclaim_dead(std::process::id());
    Ok((region.tenant_usage(), reclaimed))
}

/// Maps the existing region file `path` (exactly `bytes` long) read-write; the caller checks its
/// header.
fn open_writable<R: map::SharedRegion>(
    path: &Path,
    bytes: usize,
) -> Result<map::Mapping<R>, ReadError> {
    map::Mapping::<R>::writable(path, &open_rw(path)?, bytes)
}

/// The existing file `path`, opened read-write.
fn open_rw(path: &Path) -> Result<std::fs::File, ReadError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| ReadError::Open {
            path: path.to_owned(),
            source,
        })
}

/// The size of the file at `path`.
fn file_len(path: &Path) -> Result<u64, ReadError> {
    std::fs::metadata(path)
        .map(|metadata| metadata.len())
        .map_err(|source| ReadError::Open {
            path: path.to_owned(),
            source,
        })
}

/// Creates the region file `path` of `bytes`, initialised by `initialise`, unless one is there:
/// built under a temporary name and linked into place.
fn create_region<R: map::SharedRegion>(
    path: &Path,
    bytes: usize,
    initialise: impl FnOnce(&R),
) -> Result<bool, ReadError> {
    if path.exists() {
        return Ok(false);
    }
    create_linked(path, bytes as u64, |temporary, file| {
        let mapping = map::Mapping::<R>::writable(temporary, file, bytes)?;
        initialise(mapping.region());
        Ok(())
    })
}

/// Makes a file of `bytes` (mode 0666) under a temporary name beside `path`, lets `fill` write
/// it, and links it into place; `Ok(false)` when another creator linked one first.
fn create_linked(
    path: &Path,
    bytes: u64,
    fill: impl FnOnce(&Path, &std::fs::File) -> Result<(), ReadError>,
) -> Result<bool, ReadError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
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
        file.set_len(bytes).map_err(open_error(&temporary))?;
        fill(&temporary, &file)?;
        match std::fs::hard_link(&temporary, path) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(open_error(path)(error)),
        }
    })();
    let _ = std::fs::remove_file(&temporary);
    made
}

/// The size of a GPU's swap staging file for a staging budget of `budget_bytes`
/// (`crate::slabs`): the slab table, then as many whole slabs as the budget holds.
pub fn staging_file_bytes(budget_bytes: u64) -> u64 {
    let slab = crate::slabs::slab_bytes_for(budget_bytes);
    let count = (budget_bytes / slab).min(crate::slabs::SLABS_MAX as u64);
    crate::slabs::SlabTable::data_offset() + count * slab
}

/// Creates the swap staging file of a GPU at `path` for `budget_bytes` (the GPU's share of the
/// node's `swap_host_memory`), its slab table initialised and every slab free, unless a file of
/// that budget is there. `Ok(true)`: created (its pages are not allocated yet:
/// [`allocate_staging`]). A file of another size (another budget or version) is an error that
/// [`ReadError::is_other_version`] recognises: the agent replaces it. No file for a budget of
/// less than one slab.
pub fn create_staging(path: &Path, budget_bytes: u64) -> Result<bool, ReadError> {
    let bytes = staging_file_bytes(budget_bytes);
    if path.exists() {
        let found = file_len(path)?;
        if found != bytes {
            return Err(ReadError::Size {
                path: path.to_owned(),
                found,
                expected: bytes as usize,
            });
        }
        return match staging_table(path)?.region().geometry() {
            Err(error @ crate::slabs::SlabError::Version { .. }) => Err(ReadError::Layout {
                path: path.to_owned(),
                message: error.to_string(),
            }),
            _ => Ok(false),
        };
    }
    create_linked(path, bytes, |temporary, file| {
        let mapping =
            map::Mapping::<crate::slabs::SlabTable>::writable_header(temporary, file, bytes)?;
        mapping.region().initialise(budget_bytes);
        Ok(())
    })
}

/// Allocates every page of the staging file at `path` (the agent, once, in the background:
/// 4 KiB shared-memory pages fault at about 4 GB/s, so a process registering the file later
/// does not pay for them), then marks the table allocated: processes register the file only
/// after that (`SlabTable::is_allocated`). An error (a full `/dev/shm`) says the file cannot
/// hold its budget: the agent removes it, and processes pin their own staging as before.
pub fn allocate_staging(path: &Path) -> Result<(), ReadError> {
    let file = open_rw(path)?;
    map::allocate(&file, file_len(path)?).map_err(|source| ReadError::Map {
        path: path.to_owned(),
        source,
    })?;
    staging_table(path)?.region().mark_allocated();
    Ok(())
}

/// Whether every page of the staging file at `path` is allocated (`allocate_staging` finished on
/// it): an agent that stopped in the middle of the allocation left a file that processes never
/// register, which the next agent allocates again.
pub fn staging_allocated(path: &Path) -> Result<bool, ReadError> {
    Ok(staging_table(path)?.region().is_allocated())
}

/// The slab table at the head of the existing staging file `path`, mapped read-write.
fn staging_table(path: &Path) -> Result<map::Mapping<crate::slabs::SlabTable>, ReadError> {
    map::Mapping::<crate::slabs::SlabTable>::writable_header(path, &open_rw(path)?, 0)
}

/// Frees the slabs of the staging file at `staging` held by processes that no longer own their
/// slot on the GPU's board at `board` (dead, or their slot reclaimed and reused); returns how
/// many. The agent's sampling calls it after the board's dead-slot reclaim.
pub fn reclaim_staging(staging: &Path, board_path: &Path) -> Result<usize, ReadError> {
    let table = staging_table(staging)?;
    let board = map::Mapping::<board::Region>::open(board_path, board::REGION_BYTES)?;
    let region = board.region();
    checked(board_path, region.is_initialised(), region.check_layout())?;
    if table.region().geometry().is_err() {
        return Ok(0);
    }
    Ok(table.region().reclaim(|token| {
        crate::slabs::token_owner(token)
            .is_none_or(|(slot, pid)| !region.slot_owned_by(slot, pid, &crate::ProcLiveness))
    }))
}

#[cfg(test)]
#[path = "shm_test.rs"]
mod tests;

/// A GPU's schedule file mapped read-write for the node agent's closed loop
/// (`vgpu_agent::closed_loop`): it reads the latency tenants' step histograms and the other
/// tenants' demand stamps, and writes the decision ([`ScheduleControl::publish`]) and, when an
/// assignment changes, a running tenant's share and priority ([`ScheduleControl::set_share`]).
/// Like the readers above it never creates, sizes, initialises or reclaims, and never waits on
/// a tenant's process.
pub struct ScheduleControl {
    path: PathBuf,
    mapping: map::Mapping<compute::Region>,
}

impl ScheduleControl {
    /// Maps the existing, initialised schedule file `path` read-write, after the checks of
    /// [`read_schedule`] (this build's size, magic and layout).
    pub fn open(path: &Path) -> Result<ScheduleControl, ReadError> {
        let mapping = open_writable::<compute::Region>(path, compute::REGION_BYTES)?;
        let region = mapping.region();
        checked(path, region.is_initialised(), region.check_layout())?;
        Ok(ScheduleControl {
            path: path.to_owned(),
            mapping,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The live tenant slots (as [`read_schedule`] finds them: slots being claimed or
    /// reclaimed are skipped) with their name and step histogram. Only latency tenants record
    /// steps; every other tenant's histogram stays empty. Atomic loads only.
    pub fn latency_tenants(&self) -> Vec<(usize, String, crate::control::LatencySnapshot)> {
        let region = self.mapping.region();
        region
            .live_slots()
            .into_iter()
            .map(|(slot, name)| (slot, name, region.control.latency(slot)))
            .collect()
    }

    /// Whether a live tenant for which `is_latency` is false wanted to launch within
    /// `window_ns` of `now_ns`: reads each live slot's demand stamp (`TenantSlot::demand_ns`,
    /// refreshed by a gated tenant's processes every few hundred µs while they launch, see
    /// `compute::Schedule::demand`).
    pub fn neighbours_active(
        &self,
        now_ns: u64,
        window_ns: u64,
        is_latency: impl Fn(&str) -> bool,
    ) -> bool {
        let region = self.mapping.region();
        region.live_slots().into_iter().any(|(slot, name)| {
            let stamp = region.tenants[slot]
                .demand_ns
                .load(std::sync::atomic::Ordering::Relaxed);
            !is_latency(&name) && compute::latency_fresh(stamp, now_ns, window_ns)
        })
    }

    /// Every live tenant slot with its config, demand stamp and progress
    /// (`compute::Region::activity`), for the redistribution of idle SMs. Atomic loads only.
    pub fn activity(&self) -> Vec<crate::compute::Activity> {
        self.mapping.region().activity()
    }

    /// Publishes every tenant slot's SM cap at `now_ns` (`control::Control::publish_caps`;
    /// `caps[i]` for slot `i`, in `control::CAP_UNITS`ths, 0: uncapped). Caps expire after
    /// `control::DECISION_TTL_NS` unless published again.
    pub fn publish_caps(&self, caps: &[u8; compute::TENANTS], now_ns: u64) {
        assert!(now_ns > 0, "a cap's time is never 0 (0: never published)");
        self.mapping.region().control.publish_caps(caps, now_ns);
    }

    /// Publishes at `now_ns` the tenant slots that launch side by side, without waiting for
    /// turns (bit `i`: slot `i`; `control::Control::publish_side_by_side`); it lapses after
    /// `control::DECISION_TTL_NS` unless published again.
    pub fn publish_side_by_side(&self, slots: u64, now_ns: u64) {
        assert!(
            now_ns > 0,
            "a publication's time is never 0 (0: never published)"
        );
        self.mapping
            .region()
            .control
            .publish_side_by_side(slots, now_ns);
    }

    /// Tenant slot `slot`'s SM cap in force at `now_ns`, as its processes read it.
    pub fn cap(&self, slot: usize, now_ns: u64) -> Option<u8> {
        assert!(slot < compute::TENANTS, "tenant slot {slot}");
        self.mapping.region().control.cap(slot, now_ns)
    }

    /// Publishes latency tenant slot `slot`'s target in force (0: none): its processes count
    /// the steps slower than it (`control::Control::record_step`).
    pub fn publish_target(&self, slot: usize, target_ns: u64) {
        assert!(slot < compute::TENANTS, "tenant slot {slot}");
        self.mapping
            .region()
            .control
            .publish_target(slot, target_ns);
    }

    /// Publishes the agent's decision at `now_ns` (CLOCK_MONOTONIC, the tenants' clock).
    pub fn publish(&self, decision: crate::control::Decision, now_ns: u64) {
        assert!(
            now_ns > 0,
            "a decision's time is never 0 (0: never published)"
        );
        let control = &self.mapping.region().control;
        control.publish(decision, now_ns);
        debug_assert_eq!(control.decision(now_ns), decision);
    }

    /// The decision in force at `now_ns`, as the tenants read it.
    pub fn decision(&self, now_ns: u64) -> crate::control::Decision {
        self.mapping.region().control.decision(now_ns)
    }

    /// The squeezed side's counters (`Control::paused_ns`, `Control::bounded_launches`): the
    /// time its launches waited for latency steps and the launches that waited for their
    /// stream's queue, since the file was made.
    pub fn squeezed_counters(&self) -> (u64, u64) {
        let control = &self.mapping.region().control;
        (
            control.paused_ns.load(std::sync::atomic::Ordering::Relaxed),
            control
                .bounded_launches
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// When the oldest latency step still in flight on the GPU began, at `now_ns`
    /// (`Control::open_step_since`): a starving latency tenant shows here before its steps end.
    pub fn open_step_since(&self, now_ns: u64) -> Option<u64> {
        self.mapping.region().control.open_step_since(now_ns)
    }

    /// The config of the live tenant `tenant` on this GPU, as its processes' turn logic reads it
    /// now; `None` when none of its processes has joined (or its slot was freed).
    pub fn tenant_config(&self, tenant: &str) -> Option<crate::compute::TenantConfig> {
        self.mapping
            .region()
            .update_tenant_config(tenant, |config| config)
            .map(|(config, _)| config)
    }

    /// Gives the running processes of `tenant` on this GPU a new share and priority: rewrites
    /// the config word of its live slot, keeping its burst and guaranteed bits. Returns the config
    /// before and after (the share as stored: clamped to 1..=100), or `None` when the tenant has no live
    /// slot here (no process of it has joined yet: its processes will join with their
    /// environment, which the agent already rewrote). The turn logic reads the word at every
    /// handover, so the new split applies from the next turn on; `Member::uncapped` (the fast
    /// path) is a copy taken at join and does not follow (`compute::Region::update_tenant_config`).
    pub fn set_share(
        &self,
        tenant: &str,
        share_pct: u32,
        priority: i32,
    ) -> Option<(crate::compute::TenantConfig, crate::compute::TenantConfig)> {
        let changed = self
            .mapping
            .region()
            .update_tenant_config(tenant, |config| crate::compute::TenantConfig {
                share_pct,
                priority,
                ..config
            });
        if let Some((old, new)) = changed {
            debug_assert_eq!((old.burst, old.guaranteed), (new.burst, new.guaranteed));
            debug_assert_eq!(
                (new.share_pct, new.priority),
                (share_pct.clamp(1, 100), priority)
            );
        }
        changed
    }
}

#[cfg(test)]
#[path = "shm_control_test.rs"]
mod control_tests;
