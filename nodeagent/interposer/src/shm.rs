//! Maps the tenant's ledger file (`$VGPU_SHM_DIR/<tenant>.mem`, mode 0600), the per-GPU
//! compute schedule (`$VGPU_SHM_DIR/<gpu uuid>.compute`, mode 0666: every tenant of the GPU
//! writes it) and the per-GPU memory board (`<gpu uuid>.memory`, the agent's: elastic memory)
//! `MAP_SHARED`; and reads the clock those files are stamped with. Under the agent,
//! `VGPU_SHM_DIR` is the tenant's private directory and the schedule a hard link the agent made
//! there to the GPU's one schedule (`vgpu_agent::private`); without the agent, whatever creates
//! a file first creates it here.
//!
//! Creation race: the creator opens with `O_EXCL`, sizes the file, initialises the header and
//! publishes the magic last. Everyone else waits (bounded) for the magic. Because every header
//! field is a constant and the slots start zeroed, initialisation is idempotent: if the creator
//! died before publishing, a waiter initialises the file itself after the wait instead of
//! failing forever.
#![allow(unsafe_code)]

use crate::compute;
use crate::ledger::{REGION_BYTES, Region};
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};
use tenant_abi::MemoryEnv;
use tenant_abi::board;

/// How long a process waits for another to publish a new ledger file.
pub const INIT_WAIT: Duration = Duration::from_secs(1);

/// Opens (creating if needed) and maps the ledger of `config`'s tenant, then stores the limits.
pub fn open(config: &MemoryEnv) -> Result<&'static Region, String> {
    let path = config.ledger_path();
    let shown = path.display();
    let (file, created) = create_or_open(&config.shm_dir, &path, 0o600, REGION_BYTES, "ledger")?;
    let region = map::<Region>(&file, REGION_BYTES)
        .map_err(|e| format!("cannot map the ledger {shown}: {e}"))?;
    if created {
        region.initialise();
    } else {
        let deadline = Instant::now() + INIT_WAIT;
        while !region.is_initialised() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !region.is_initialised() {
            crate::log::error(format_args!(
                "the ledger {shown} was never initialised (its creator died?); initialising it"
            ));
            region.initialise();
        }
    }
    region.check_layout().map_err(|e| format!("{shown}: {e}"))?;
    region.set_limits(&config.limits_bytes);
    Ok(region)
}

/// Opens (creating if needed) and maps the compute schedule of the GPU `uuid`.
pub fn open_schedule(
    shm_dir: &Path,
    uuid: &str,
    quantum_ns: u64,
) -> Result<&'static compute::Region, String> {
    let path = shm_dir.join(format!("{uuid}.compute"));
    let shown = path.display();
    let bytes = compute::REGION_BYTES;
    let (file, created) = create_or_open(shm_dir, &path, 0o666, bytes, "compute schedule")?;
    let region = map::<compute::Region>(&file, bytes)
        .map_err(|e| format!("cannot map the compute schedule {shown}: {e}"))?;
    if created {
        region.initialise(quantum_ns);
    } else {
        let deadline = Instant::now() + INIT_WAIT;
        while !region.is_initialised() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !region.is_initialised() {
            crate::log::error(format_args!(
                "the compute schedule {shown} was never initialised (its creator died?); \
                 initialising it"
            ));
            region.initialise(quantum_ns);
        }
    }
    region.check_layout().map_err(|e| format!("{shown}: {e}"))?;
    Ok(region)
}

/// Maps the memory board of the GPU `uuid` (`<shm_dir>/<uuid>.memory`, elastic memory) if the
/// agent put one there: `Ok(None)` when there is none (the tenant then keeps today's hard quota).
/// A board is the agent's to create and initialise, so this never creates or initialises one; a
/// board that is there but unusable (unreadable, not initialised, another layout) is an error.
pub fn open_board(shm_dir: &Path, uuid: &str) -> Result<Option<&'static board::Region>, String> {
    let path = tenant_abi::layout::board_path(shm_dir, uuid);
    let shown = path.display();
    let Some((file, len)) = open_agents_file(&path, "the memory board")? else {
        return Ok(None);
    };
    if len != board::REGION_BYTES as u64 {
        return Err(format!(
            "the memory board {shown} has {len} bytes, this build's layout {}: the agent and \
             this process are of two vgpu versions",
            board::REGION_BYTES
        ));
    }
    let region = map::<board::Region>(&file, board::REGION_BYTES)
        .map_err(|e| format!("cannot map the memory board {shown}: {e}"))?;
    if !region.is_initialised() {
        return Err(format!(
            "the memory board {shown} was never initialised by the agent"
        ));
    }
    region.check_layout().map_err(|e| format!("{shown}: {e}"))?;
    Ok(Some(region))
}

/// A file the agent made (`what`, for errors) opened read-write with its size; `Ok(None)` when
/// it is not there.
fn open_agents_file(path: &Path, what: &str) -> Result<Option<(File, u64)>, String> {
    let shown = path.display();
    let file = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open {what} {shown}: {e}")),
    };
    let len = file
        .metadata()
        .map_err(|e| format!("cannot read the size of {what} {shown}: {e}"))?
        .len();
    Ok(Some((file, len)))
}

/// A GPU's swap staging file mapped whole (`tenant_abi::slabs`): its slab table and the slabs.
#[derive(Clone, Copy)]
pub struct StagingFile {
    pub table: &'static tenant_abi::slabs::SlabTable,
    /// The address of the first slab, and the bytes of all of them.
    pub data: usize,
    pub data_bytes: u64,
    pub slab_bytes: u64,
}

/// Maps the swap staging file of the GPU `uuid` (`<shm_dir>/<uuid>.staging`) if the agent put
/// one there (`VGPU_AGENT_SHARED_STAGING=1`): `Ok(None)` when there is none (the process pins its
/// own staging). Maps only; the pages are registered later, off the critical path
/// (`staging::register_shared`).
pub fn open_staging(shm_dir: &Path, uuid: &str) -> Result<Option<StagingFile>, String> {
    let path = tenant_abi::layout::staging_path(shm_dir, uuid);
    let shown = path.display();
    let Some((file, len)) = open_agents_file(&path, "the swap staging file")? else {
        return Ok(None);
    };
    let offset = tenant_abi::slabs::SlabTable::data_offset();
    if len <= offset {
        return Err(format!(
            "the swap staging file {shown} holds no slab ({len} bytes)"
        ));
    }
    let bytes = usize::try_from(len).map_err(|_| format!("{shown} is too large to map"))?;
    let table: &'static tenant_abi::slabs::SlabTable = map_at_head(&file, bytes)
        .map_err(|e| format!("cannot map the swap staging file {shown}: {e}"))?;
    let address = std::ptr::from_ref(table) as usize;
    let (slab_bytes, count) = table.geometry().map_err(|e| format!("{shown}: {e}"))?;
    let data_bytes = slab_bytes * count as u64;
    if count == 0 || offset + data_bytes > len {
        return Err(format!(
            "the swap staging file {shown} ({len} bytes) does not hold its {count} slabs of \
             {slab_bytes} bytes: the agent and this process are of two vgpu versions"
        ));
    }
    Ok(Some(StagingFile {
        table,
        data: address + offset as usize,
        data_bytes,
        slab_bytes,
    }))
}

/// Creates `path` exclusively with `mode` (whatever the umask) and size `bytes`, or opens the
/// existing file; says whether it was created.
fn create_or_open(
    dir: &Path,
    path: &Path,
    mode: u32,
    bytes: usize,
    what: &str,
) -> Result<(File, bool), String> {
    let shown = path.display();
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let (file, created) = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
    {
        Ok(file) => {
            file.set_permissions(std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("cannot set the mode of the {what} {shown}: {e}"))?;
            (file, true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| format!("cannot open the {what} {shown}: {e}"))?;
            (file, false)
        }
        Err(e) => return Err(format!("cannot create the {what} {shown}: {e}")),
    };
    ensure_size(&file, created, bytes)
        .map_err(|e| format!("cannot size the {what} {shown}: {e}"))?;
    Ok((file, created))
}

/// CLOCK_MONOTONIC in nanoseconds: the clock every process on the node shares (through the
/// vDSO: no system call).
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

/// Grows the file to the region size. The creator always sizes it; others size it too if the
/// creator has not yet (same size, so racing `ftruncate`s agree); a file larger than ours belongs
/// to another layout and is caught by the version check.
fn ensure_size(file: &File, created: bool, bytes: usize) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if created || len < bytes as u64 {
        file.set_len(bytes as u64)?;
    }
    Ok(())
}

/// Maps the file for the life of the process (never unmapped: hooks may run until exit).
///
/// `T` is `ledger::Region`, `compute::Region`, `board::Region` or the staging file's `SlabTable`: `#[repr(C)]` structs of atomics only, for
/// which every bit pattern is valid, `bytes` long.
fn map<T: SharedRegion>(file: &File, bytes: usize) -> std::io::Result<&'static T> {
    assert_eq!(std::mem::size_of::<T>(), bytes);
    map_at_head(file, bytes)
}

/// Maps the first `bytes` of `file` (at least a `T`) for the life of the process; the `T` at its
/// head. The rest of the mapping is the caller's (a staging file's slabs after its table).
fn map_at_head<T: SharedRegion>(file: &File, bytes: usize) -> std::io::Result<&'static T> {
    assert!(std::mem::size_of::<T>() <= bytes);
    // SAFETY: a fresh shared mapping of an open file of at least `bytes` bytes; the kernel
    // picks the address. Failure is reported as MAP_FAILED and checked below.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    assert_eq!(address as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: the mapping is page-aligned, at least a `T` long, readable and writable, and lives
    // until exit. `T` consists only of atomics (the `SharedRegion` contract), for
    // which every bit pattern is valid, and all access (from this and other processes) goes
    // through atomic operations.
    Ok(unsafe { &*address.cast::<T>() })
}

/// A `#[repr(C)]` region made only of atomics, so any bytes are a valid value.
trait SharedRegion {}
impl SharedRegion for Region {}
impl SharedRegion for compute::Region {}
impl SharedRegion for board::Region {}
impl SharedRegion for tenant_abi::slabs::SlabTable {}
