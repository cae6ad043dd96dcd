//! Plays a tenant process against the shared files, through the interposer's own protocol code
//! (`Ledger`, `Schedule`): for tests and tools on machines without a GPU (the agent's usage
//! report, the integration tests). Behind the `writer` feature; the agent never writes.
//!
//! Creating a file here is simpler than the interposer's `shm::open` (no exclusive create, no
//! wait for another creator): callers are single test processes.

use std::fs::OpenOptions;
use std::path::Path;

pub use crate::map::Mapping;
use crate::{ReadError, board, compute, ledger};

/// Opens (creating and initialising if needed) a read-write mapping of a region file.
fn open_writable<T: crate::map::SharedRegion>(
    path: &Path,
    bytes: usize,
) -> Result<Mapping<T>, ReadError> {
    let open_error = |source| ReadError::Open {
        path: path.to_owned(),
        source,
    };
    if let Some(directory) = path.parent() {
        std::fs::create_dir_all(directory).map_err(open_error)?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(open_error)?;
    if file.metadata().map_err(open_error)?.len() == 0 {
        file.set_len(bytes as u64).map_err(open_error)?;
    }
    Mapping::writable(path, &file, bytes)
}

/// A tenant's ledger, mapped read-write, initialised, with `limits_bytes` stored.
pub fn ledger(
    path: &Path,
    limits_bytes: &[Option<u64>; crate::DEVICES_MAX],
) -> Result<Mapping<ledger::Region>, ReadError> {
    let mapping = open_writable::<ledger::Region>(path, ledger::REGION_BYTES)?;
    let region = mapping.region();
    if !region.is_initialised() {
        region.initialise();
    }
    region.check_layout().map_err(|message| ReadError::Layout {
        path: path.to_owned(),
        message,
    })?;
    region.set_limits(limits_bytes);
    Ok(mapping)
}

/// A GPU's compute schedule, mapped read-write and initialised with `quantum_ns`.
pub fn schedule(path: &Path, quantum_ns: u64) -> Result<Mapping<compute::Region>, ReadError> {
    let mapping = open_writable::<compute::Region>(path, compute::REGION_BYTES)?;
    let region = mapping.region();
    if !region.is_initialised() {
        region.initialise(quantum_ns);
    }
    region.check_layout().map_err(|message| ReadError::Layout {
        path: path.to_owned(),
        message,
    })?;
    Ok(mapping)
}

/// Charges `bytes` on `device` of `tenant`'s ledger to the live process `pid` (started at
/// `start_time`, field 22 of its `/proc/<pid>/stat`), as the interposer does on an allocation.
pub fn charge_memory(
    mapping: &Mapping<ledger::Region>,
    pid: u32,
    start_time: u64,
    device: usize,
    bytes: u64,
) -> Result<(), String> {
    let ledger = ledger::Ledger::new(mapping.region(), ledger::ProcLiveness);
    let slot = ledger
        .claim_slot(pid, start_time)
        .ok_or_else(|| "every slot of the ledger is taken".to_owned())?;
    ledger
        .reserve(slot, device, bytes)
        .map_err(|refused| format!("refused: {refused:?}"))
}

/// Gives `tenant` (as the live process `pid`) `held_ns` of turn time on the GPU of `mapping`, as
/// the launch gate does: a turn at `start_ns`, renewed by launches every half quantum until
/// `held_ns` later (the tenant joins with a 100% burst share, so each turn goes back to it and is
/// charged). Times are on the schedule's
/// clock (CLOCK_MONOTONIC in real use).
pub fn charge_time(
    mapping: &Mapping<compute::Region>,
    tenant: &str,
    pid: u32,
    start_time: u64,
    start_ns: u64,
    held_ns: u64,
) -> Result<(), String> {
    let schedule = compute::Schedule::new(mapping.region(), ledger::ProcLiveness);
    let config = compute::TenantConfig {
        share_pct: 100,
        burst: true,
        guaranteed: true,
        priority: 0,
    };
    let member = schedule.join(tenant, config, pid, start_time, start_ns)?;
    // launches every half quantum, as a busy tenant's: each turn is charged at its renewal (a
    // turn without launches is charged one quantum plus grace at most)
    let every = (schedule.quantum_ns() / 2).max(1);
    let mut now = start_ns;
    while now < start_ns + held_ns {
        schedule.step(&member, now);
        now = (now + every).min(start_ns + held_ns);
    }
    schedule.step(&member, start_ns + held_ns);
    Ok(())
}

/// Reserves `bytes` for `tenant` (as the live process `pid`, started at `start_time`) on the
/// memory board at `path`, which the agent created and wrote, as the interposer will on an
/// allocation (`board::Board::reserve`). Returns the mapping (the slot stays while it is held)
/// and whether the bytes were within the request or borrowed.
pub fn reserve_board(
    path: &Path,
    tenant: &str,
    pid: u32,
    start_time: u64,
    bytes: u64,
) -> Result<(Mapping<board::Region>, board::Grant), String> {
    let mapping = open_writable::<board::Region>(path, board::REGION_BYTES)
        .map_err(|error| error.to_string())?;
    let region = mapping.region();
    if !region.is_initialised() {
        return Err(format!(
            "{}: the agent has not written this board",
            path.display()
        ));
    }
    region.check_layout()?;
    let index = region
        .find(tenant)
        .ok_or_else(|| format!("tenant {tenant} is not on the board {}", path.display()))?;
    let board = board::Board::new(region, ledger::ProcLiveness);
    let slot = board
        .claim_slot(pid, start_time, index)
        .ok_or_else(|| "every slot of the board is taken".to_owned())?;
    let grant = board
        .reserve(slot, bytes)
        .map_err(|refused| format!("refused: {refused:?}"))?;
    Ok((mapping, grant))
}
