//! The node's bucket table: a fixed `#[repr(C)]` layout in one file (by convention
//! `/dev/shm/vgpu/netshare.<node>`) that the agent and every NCCL plugin instance on the node map
//! `MAP_SHARED`, and the protocol around it.
//!
//! **Layout** (little-endian, 64-byte lines, [`REGION_BYTES`] in all): a header line (`magic`
//! `VGPUNSH1`, `version`, `slot_count`), then [`SLOTS`] slot lines of eight `u64`s: `flow` (0 =
//! free), `rate_bytes_per_second`, `burst_bytes`, `tat_ns` (the bucket word, see
//! [`crate::bucket`]), `admitted_bytes`, `throttled_count`, and two reserved words.
//!
//! **Writers.** The agent ([`TableOwner`], one per file, held by an advisory lock on
//! `<path>.lock`) is the only writer of `flow`, `rate_bytes_per_second` and `burst_bytes`. Plugins
//! ([`Table`]) only compare-and-swap `tat_ns` and add to the two counters.
//!
//! **Why `kill -9` is harmless.** Every write is one atomic store, add or CAS of one word, and no
//! invariant spans two words: any mix of old and new `rate` and `burst` is a valid bucket, the
//! counters are statistics, and the bucket word is self-contained. So a process that dies at any
//! instruction leaves a consistent table and holds nothing anyone waits for. The agent's lock is
//! an `flock`, which the kernel releases when the agent dies.
//!
//! **Slot life.** The agent claims a free slot by writing its configuration, zeroing `tat_ns`
//! (a full bucket) and the counters, and then publishing `flow` with release ordering; a plugin
//! loads `flow` with acquire ordering before it reads the configuration. Freeing stores `flow = 0`.
//! A plugin checks `flow` on every request and gets [`Admission::Gone`] once its slot is freed or
//! reused; a request racing with a reuse may be charged to the new flow (one request, once).
//!
//! **Creation.** The agent builds a new file under a temporary name (zeroed by `ftruncate`, header
//! written, `magic` last) and renames it into place, so no process ever maps a half-initialised
//! table. An agent that restarts reuses a valid existing file (plugins keep their mappings of it).

use crate::bucket::{self, Admission, BURST_BYTES_MAX, BucketConfig};
use crate::shm::{self, Mapping};
use crate::types::FlowId;
use std::fs::{File, OpenOptions, Permissions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// `VGPUNSH1`, little-endian: written last when a table file is initialised.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUNSH1");
/// Bumped on any layout change; a process refuses a table of another version.
pub const VERSION: u32 = 1;
/// Buckets per node: flows (tenant × link) alive at once.
pub const SLOTS: usize = crate::types::FLOWS_MAX;
/// The file size; part of the on-disk format.
pub const REGION_BYTES: usize = 64 + SLOTS * 64;
/// The file mode: every tenant's processes, whatever their user, must be able to CAS the bucket
/// words. (The buckets are cooperative: a tenant that skips the plugin is not throttled anyway.)
pub const FILE_MODE: u32 = 0o666;

const FREE: u64 = 0;

#[repr(C, align(64))]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    slot_count: AtomicU32,
    reserved: [AtomicU64; 6],
}

#[repr(C, align(64))]
pub(crate) struct Slot {
    flow: AtomicU64,
    rate_bytes_per_second: AtomicU64,
    burst_bytes: AtomicU64,
    tat_ns: AtomicU64,
    admitted_bytes: AtomicU64,
    throttled_count: AtomicU64,
    reserved: [AtomicU64; 2],
}

/// The whole table file.
#[repr(C)]
pub(crate) struct Region {
    header: Header,
    slots: [Slot; SLOTS],
}

const _: () = assert!(std::mem::size_of::<Header>() == 64);
const _: () = assert!(std::mem::size_of::<Slot>() == 64);
const _: () = assert!(std::mem::size_of::<Region>() == REGION_BYTES);
const _: () = assert!(std::mem::align_of::<Region>() == 64);

/// Why a table could not be opened or changed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a netshare table of version {VERSION}: {reason}")]
    BadLayout { path: PathBuf, reason: String },
    #[error("{path}: another agent owns this table (it holds {path}.lock)")]
    Busy { path: PathBuf },
    #[error("no free bucket slot for flow {0} (the table has {SLOTS})")]
    Full(u64),
    #[error("flow id 0 is reserved for free slots")]
    ReservedFlowId,
    #[error("burst of {0} bytes is not in 1..={BURST_BYTES_MAX}")]
    InvalidBurst(u64),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A mapped table, as a plugin sees it: it can find buckets and charge them.
pub struct Table {
    mapping: Mapping,
    path: PathBuf,
}

/// A mapped table, as its one agent sees it: it also assigns, configures and frees buckets.
pub struct TableOwner {
    table: Table,
    /// Holds the advisory lock on `<path>.lock` for as long as the owner lives.
    _lock: File,
}

/// A flow's bucket in a table.
#[derive(Clone, Copy)]
pub struct Bucket<'table> {
    slot: &'table Slot,
    flow: FlowId,
}

/// What the agent reads back from a bucket to estimate the flow's demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketStats {
    pub config: BucketConfig,
    /// Bytes admitted since the slot was assigned (wraps at 2^64).
    pub admitted_bytes: u64,
    /// Requests told to wait since the slot was assigned: a flow that is throttled is backlogged.
    pub throttled_count: u64,
}

impl Table {
    /// Maps an existing table (what a plugin does). Fails on a missing file or another layout.
    pub fn open(path: &Path) -> Result<Table, Error> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_error(path))?;
        let mapping = Mapping::map(&file).map_err(io_error(path))?;
        let table = Table {
            mapping,
            path: path.to_path_buf(),
        };
        table.check_header()?;
        Ok(table)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The flow's bucket, if the agent has assigned one. Plugins look a bucket up once and keep
    /// it until it says [`Admission::Gone`].
    pub fn bucket(&self, flow: FlowId) -> Option<Bucket<'_>> {
        if flow.0 == FREE {
            return None;
        }
        let slot = self.slot_of(flow)?;
        Some(Bucket { slot, flow })
    }

    pub fn stats(&self, flow: FlowId) -> Option<BucketStats> {
        self.bucket(flow).map(|bucket| bucket.stats())
    }

    /// The flows that have buckets, in slot order.
    pub fn flows(&self) -> Vec<FlowId> {
        self.mapping
            .slots
            .iter()
            .map(|slot| slot.flow.load(Ordering::Acquire))
            .filter(|&flow| flow != FREE)
            .map(FlowId)
            .collect()
    }

    fn slot_of(&self, flow: FlowId) -> Option<&Slot> {
        assert_ne!(flow.0, FREE);
        self.mapping
            .slots
            .iter()
            .find(|slot| slot.flow.load(Ordering::Acquire) == flow.0)
    }

    fn check_header(&self) -> Result<(), Error> {
        let header = &self.mapping.header;
        let bad = |reason: String| Error::BadLayout {
            path: self.path.clone(),
            reason,
        };
        let magic = header.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(bad(format!("magic {magic:#018x}")));
        }
        let version = header.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(bad(format!("version {version}")));
        }
        let slot_count = header.slot_count.load(Ordering::Relaxed);
        if slot_count as usize != SLOTS {
            return Err(bad(format!("{slot_count} slots")));
        }
        Ok(())
    }
}

impl TableOwner {
    /// Opens the table at `path` for its agent, creating it (and its directory) if it is missing
    /// or not a valid table. Fails with [`Error::Busy`] while another agent owns it.
    pub fn open_or_create(path: &Path) -> Result<TableOwner, Error> {
        if let Some(directory) = path.parent() {
            std::fs::create_dir_all(directory).map_err(io_error(directory))?;
        }
        let lock_path = sibling(path, ".lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io_error(&lock_path))?;
        if !shm::try_lock_exclusive(&lock).map_err(io_error(&lock_path))? {
            return Err(Error::Busy {
                path: path.to_path_buf(),
            });
        }
        let table = match Table::open(path) {
            Ok(table) => table,
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                create(path)?
            }
            // Another version, a truncated file or garbage: only the owner may replace it, and no
            // plugin can be using it (they refuse a bad header).
            Err(Error::BadLayout { .. }) => create(path)?,
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidData => {
                create(path)?
            }
            Err(error) => return Err(error),
        };
        Ok(TableOwner { table, _lock: lock })
    }

    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Sets a flow's bucket, assigning a slot (with a full bucket) if the flow has none. A rate
    /// change keeps the bucket word, so it takes effect at the flow's next request.
    pub fn set_rate(&self, flow: FlowId, config: BucketConfig) -> Result<(), Error> {
        if flow.0 == FREE {
            return Err(Error::ReservedFlowId);
        }
        if !config.is_valid() {
            return Err(Error::InvalidBurst(config.burst_bytes));
        }
        if let Some(slot) = self.table.slot_of(flow) {
            slot.rate_bytes_per_second
                .store(config.rate_bytes_per_second, Ordering::Relaxed);
            slot.burst_bytes
                .store(config.burst_bytes, Ordering::Relaxed);
            return Ok(());
        }
        let slots = &self.table.mapping.slots;
        let slot = slots
            .iter()
            .find(|slot| slot.flow.load(Ordering::Relaxed) == FREE)
            .ok_or(Error::Full(flow.0))?;
        slot.rate_bytes_per_second
            .store(config.rate_bytes_per_second, Ordering::Relaxed);
        slot.burst_bytes
            .store(config.burst_bytes, Ordering::Relaxed);
        slot.tat_ns.store(0, Ordering::Relaxed);
        slot.admitted_bytes.store(0, Ordering::Relaxed);
        slot.throttled_count.store(0, Ordering::Relaxed);
        slot.flow.store(flow.0, Ordering::Release);
        assert!(self.table.slot_of(flow).is_some());
        Ok(())
    }

    /// Frees a flow's bucket; `false` if it had none. Its plugins get [`Admission::Gone`].
    pub fn clear(&self, flow: FlowId) -> bool {
        if flow.0 == FREE {
            return false;
        }
        match self.table.slot_of(flow) {
            Some(slot) => {
                slot.flow.store(FREE, Ordering::Release);
                true
            }
            None => false,
        }
    }
}

impl Bucket<'_> {
    pub fn flow(&self) -> FlowId {
        self.flow
    }

    /// Charges `bytes` at `now_ns` (CLOCK_MONOTONIC, see [`shm::monotonic_now_ns`]) if the bucket
    /// allows it. Never blocks: at most [`bucket::CAS_ATTEMPTS_MAX`] compare-and-swaps.
    pub fn try_consume(&self, bytes: u64, now_ns: u64) -> Admission {
        if self.slot.flow.load(Ordering::Acquire) != self.flow.0 {
            return Admission::Gone;
        }
        let config = self.config();
        let admission = bucket::try_consume(&self.slot.tat_ns, config, bytes, now_ns);
        match admission {
            Admission::Admitted => {
                self.slot.admitted_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Admission::WaitFor(_) => {
                self.slot.throttled_count.fetch_add(1, Ordering::Relaxed);
            }
            Admission::Gone => unreachable!("the bucket word has no owner"),
        }
        admission
    }

    pub fn stats(&self) -> BucketStats {
        BucketStats {
            config: self.config(),
            admitted_bytes: self.slot.admitted_bytes.load(Ordering::Relaxed),
            throttled_count: self.slot.throttled_count.load(Ordering::Relaxed),
        }
    }

    /// The configuration as stored. The file is writable by every tenant, so a burst outside the
    /// valid range is clamped rather than trusted (or asserted on inside someone's NCCL).
    fn config(&self) -> BucketConfig {
        let burst_bytes = self.slot.burst_bytes.load(Ordering::Relaxed);
        BucketConfig {
            rate_bytes_per_second: self.slot.rate_bytes_per_second.load(Ordering::Relaxed),
            burst_bytes: burst_bytes.clamp(1, BURST_BYTES_MAX),
        }
    }
}

/// Builds a fresh table under a temporary name and renames it to `path`.
fn create(path: &Path) -> Result<Table, Error> {
    let temporary = sibling(path, &format!(".tmp.{}", std::process::id()));
    // A leftover from an agent of the same pid that died mid-way.
    match std::fs::remove_file(&temporary) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(io_error(&temporary)(error)),
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .open(&temporary)
        .map_err(io_error(&temporary))?;
    // The umask may have removed bits from FILE_MODE.
    file.set_permissions(Permissions::from_mode(FILE_MODE))
        .map_err(io_error(&temporary))?;
    file.set_len(REGION_BYTES as u64)
        .map_err(io_error(&temporary))?;
    let mapping = Mapping::map(&file).map_err(io_error(&temporary))?;
    let header = &mapping.header;
    header.version.store(VERSION, Ordering::Relaxed);
    header.slot_count.store(SLOTS as u32, Ordering::Relaxed);
    header.magic.store(MAGIC, Ordering::Release);
    std::fs::rename(&temporary, path).map_err(io_error(path))?;
    let table = Table {
        mapping,
        path: path.to_path_buf(),
    };
    table.check_header()?;
    assert!(table.flows().is_empty());
    Ok(table)
}

/// `path` with `suffix` appended to its file name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
#[path = "table_test.rs"]
mod table_test;
