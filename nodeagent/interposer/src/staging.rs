//! The swap's pinned host staging, pinned fast, ahead, and kept and reused within the process
//! (issue 17, "Swap at the speed of the link"). Pinning was 99% of the first reclaims on an H200
//! (`cuMemHostAlloc` at 1.6 GB/s): so new staging is huge-page memory touched by several threads
//! and registered ([`pin`], about 14 GB/s), a borrower's watcher pins it ahead for its resident
//! borrowed chunks ([`warm`]), and a buffer whose chunk came back, or was freed while out, goes
//! to a per-GPU pool of this process: a later swap-out takes the smallest pooled buffer that
//! holds its chunk (a chunk may use a larger buffer) before it pins anything.
//!
//! **Accounting stays exact:** every buffer this process holds, pooled or holding a chunk's bytes,
//! is reserved for its whole size on its GPU's board as staging of this process's slot
//! (`Board::reserve_staging`), from its pinning until it is really freed, so what the board says
//! this process stages is what it has pinned, and the node's `swap_host_memory` bounds the pool.
//! A pooled buffer is really freed (unpinned, then `Board::release_staging`):
//! - when no swap-out reused it for [`IDLE_MAX_MS_DEFAULT`] (`VGPU_MEMORY_STAGING_IDLE_MS`),
//!   looked at by the process's next swap call or allocation ([`trim`]), unless it is kept warm
//!   for a resident borrowed chunk ([`Pool::plan_warm`]);
//! - when the budget has no room for a chunk that no pooled buffer fits: idle buffers, largest
//!   first, make room before the swap-out is refused ([`acquire`]);
//! - never at exit: the OS frees a dead process's pinned memory, and the board's dead-slot reclaim
//!   (the agent's sampling, any tenant process's query) zeroes its staging; calling the driver from
//!   an exit handler is not safe (it may be torn down already).
//!
//! A child after `fork` forgets the pool without a driver call or a release: the buffers and their
//! reservations are its parent's.
//!
//! **The GPU's shared staging file** (the agent's `shared_staging`, off by default): where the
//! agent keeps one, the watcher has it registered on a thread of its own, slab by slab, as far as
//! the process's borrowed chunks need ([`register_shared`], [`registration_want`]); a swap-out
//! then takes a run of its registered slabs ([`claim_shared`]) instead of pinning, reserved on the
//! board in whole slabs like any staging, copied a slab at a time ([`copy_piece_bytes`]), pooled
//! like any buffer, and given back when freed. No run free: the chunk's own buffer, as before;
//! and the watcher pins ahead for the chunks the registered free slabs do not cover
//! ([`uncovered_by_shared`]), so a registration behind the process's borrowing costs no more
//! than having no file, within the budget: the file's pages are resident whether or not a slab
//! is claimed, so a buffer of the process's own (pinned ahead or in a swap-out) fits only beside
//! the file's unclaimed slabs ([`room_beside_file`]), and the file and the pins together stay
//! within the node's `swap_host_memory` (a file as large as the budget leaves no room for any).
//!
//! [`Pool`] is the bookkeeping (which buffer serves which chunk, which have idled too long), pure
//! and unit tested; the functions below make the driver calls around it.
#![allow(unsafe_code)]

use crate::real::Driver;
use crate::swap::Counters;
use crate::sys::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use tenant_abi::DEVICES_MAX;

/// How long a pooled buffer no swap-out reused is kept before it is freed, unless
/// `VGPU_MEMORY_STAGING_IDLE_MS` says otherwise. The rounds of one reclaim come within seconds of
/// each other (a needy tenant waits at most 5 s, and its claim lapses 5 s after its last
/// allocation), and a framework taking memory back and forth (one reclaim per training step or
/// per batch of requests) comes back within tens of seconds: 30 s covers those several times
/// over. Longer, and host memory pinned for nobody stays out of the node's `swap_host_memory`
/// that the GPU's other processes share (a pooled buffer counts against it).
pub const IDLE_MAX_MS_DEFAULT: u64 = 30_000;
/// The longest idle time `VGPU_MEMORY_STAGING_IDLE_MS` may ask for: 10 minutes.
pub const IDLE_MAX_MS_MAX: u64 = 600_000;

/// One pinned host buffer: its address, its size, and how it was pinned (so that it is freed
/// the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub host: usize,
    pub bytes: u64,
    /// Memory this module mapped and pinned with `cuMemHostRegister` (freed by unregistering and
    /// unmapping it); else `cuMemHostAlloc`'s (freed by `cuMemFreeHost`).
    pub registered: bool,
    /// A run of slabs of the GPU's shared staging file ([`register_shared`]; freed by giving the
    /// slabs back): neither of the above.
    pub shared: bool,
}

/// The idle buffers of one GPU's pool, each with when it went idle and whether it is kept warm
/// for a resident borrowed chunk ([`Pool::plan_warm`]: it does not idle out). Pure: time comes in
/// as monotonic nanoseconds.
#[derive(Debug, Default)]
pub struct Pool {
    idle: Vec<(Buffer, u64, bool)>,
}

impl Pool {
    /// The buffer that serves a chunk of `bytes`, taken out of the pool: the smallest that holds
    /// it (best fit, so that large buffers stay for large chunks), the one idle longest among
    /// equals (so that the others may idle out). `None`: none holds it.
    pub fn take(&mut self, bytes: u64) -> Option<Buffer> {
        assert!(bytes > 0, "a chunk has bytes");
        let best = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, (buffer, _, _))| buffer.bytes >= bytes)
            .min_by_key(|(_, (buffer, since, _))| (buffer.bytes, *since, buffer.host))
            .map(|(index, _)| index)?;
        let (buffer, _, _) = self.idle.swap_remove(best);
        assert!(buffer.bytes >= bytes);
        Some(buffer)
    }

    /// `buffer` is idle from `now_ns`: its chunk came back or was freed.
    pub fn put(&mut self, buffer: Buffer, now_ns: u64) {
        self.put_as(buffer, now_ns, false);
    }

    /// `buffer` was pinned ahead for a resident borrowed chunk ([`Pool::plan_warm`]).
    pub fn put_warm(&mut self, buffer: Buffer, now_ns: u64) {
        self.put_as(buffer, now_ns, true);
    }

    fn put_as(&mut self, buffer: Buffer, now_ns: u64, warm: bool) {
        assert!(buffer.host != 0 && buffer.bytes > 0, "a pinned buffer");
        assert!(
            self.idle.iter().all(|(b, _, _)| b.host != buffer.host),
            "buffer {:#x} pooled twice",
            buffer.host
        );
        self.idle.push((buffer, now_ns, warm));
    }

    /// Which buffers to keep warm for the resident borrowed chunks of `chunks` (their sizes, in
    /// the order a swap-out takes them: largest first), within `cap` bytes of pooled buffers in
    /// all: each chunk in turn is matched with the buffer a swap-out would take for it (the
    /// smallest idle one that holds it, not matched yet), or else needs one of its size pinned;
    /// the first chunk past the cap ends the plan (a swap-out takes the largest first: those
    /// are the ones worth having ready). The matched buffers are marked warm (they do not idle
    /// out), the others unmarked (they idle out as before); returns the sizes to pin.
    pub fn plan_warm(&mut self, chunks: &[u64], cap: u64) -> Vec<u64> {
        for entry in &mut self.idle {
            entry.2 = false;
        }
        let mut planned = 0u64;
        let mut to_pin = Vec::new();
        for &size in chunks {
            assert!(size > 0, "a chunk has bytes");
            let matched = self
                .idle
                .iter()
                .enumerate()
                .filter(|(_, (buffer, _, warm))| !warm && buffer.bytes >= size)
                .min_by_key(|(_, (buffer, since, _))| (buffer.bytes, *since, buffer.host))
                .map(|(index, _)| index);
            let bytes = matched.map_or(size, |index| self.idle[index].0.bytes);
            if planned.saturating_add(bytes) > cap {
                break;
            }
            planned += bytes;
            match matched {
                Some(index) => self.idle[index].2 = true,
                None => to_pin.push(size),
            }
        }
        to_pin
    }

    /// Takes out the buffers idle for `idle_max_ns` or more at `now_ns` and not kept warm: to be
    /// freed.
    pub fn expired(&mut self, now_ns: u64, idle_max_ns: u64) -> Vec<Buffer> {
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .idle
            .drain(..)
            .partition(|(_, since, warm)| !warm && now_ns.saturating_sub(*since) >= idle_max_ns);
        self.idle = kept;
        gone.into_iter().map(|(buffer, _, _)| buffer).collect()
    }

    /// Takes out every idle buffer, those pinned ahead included.
    pub fn drain_idle(&mut self) -> Vec<Buffer> {
        self.idle.drain(..).map(|(buffer, _, _)| buffer).collect()
    }

    /// Takes out the largest idle buffer: freed to make room on the budget.
    pub fn take_largest(&mut self) -> Option<Buffer> {
        let largest = self
            .idle
            .iter()
            .enumerate()
            .max_by_key(|(_, (buffer, since, _))| (buffer.bytes, std::cmp::Reverse(*since)))
            .map(|(index, _)| index)?;
        Some(self.idle.swap_remove(largest).0)
    }

    /// Bytes pooled: reserved on the board, holding no chunk.
    #[cfg(test)]
    pub fn idle_bytes(&self) -> u64 {
        self.idle.iter().map(|(buffer, _, _)| buffer.bytes).sum()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.idle.is_empty()
    }
}

/// The process's pools, one per GPU (a buffer is reserved on one board, so it serves that GPU's
/// chunks only), and the process they belong to.
struct Pools {
    pid: u32,
    pools: [Pool; DEVICES_MAX],
}

/// Buffers pooled now, all GPUs: what [`any_pooled`] reads without the lock.
static POOLED: AtomicUsize = AtomicUsize::new(0);

fn pools() -> MutexGuard<'static, Pools> {
    static POOLS: OnceLock<Mutex<Pools>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(|| {
            Mutex::new(Pools {
                pid: std::process::id(),
                pools: std::array::from_fn(|_| Pool::default()),
            })
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if pools.pid != std::process::id() {
        // A child after `fork`: the buffers and their reservations are its parent's.
        pools.pid = std::process::id();
        pools.pools = std::array::from_fn(|_| Pool::default());
        POOLED.store(0, Ordering::SeqCst);
    }
    pools
}

fn publish(pools: &Pools) {
    let count = pools.pools.iter().map(|p| p.idle.len()).sum();
    POOLED.store(count, Ordering::SeqCst);
}

/// Whether any buffer is pooled (one load): whether [`trim`] has anything to look at.
pub fn any_pooled() -> bool {
    POOLED.load(Ordering::SeqCst) != 0
}

/// The idle bound, `VGPU_MEMORY_STAGING_IDLE_MS` (read once; a value that is not a number of
/// milliseconds up to [`IDLE_MAX_MS_MAX`] is said once and the default serves).
pub fn idle_max_ns() -> u64 {
    static IDLE: OnceLock<u64> = OnceLock::new();
    *IDLE.get_or_init(|| {
        let name = tenant_abi::env::var::MEMORY_STAGING_IDLE_MS;
        let ms = match std::env::var(name) {
            Err(_) => IDLE_MAX_MS_DEFAULT,
            Ok(text) => match text.trim().parse::<u64>() {
                Ok(ms) if ms <= IDLE_MAX_MS_MAX => ms,
                _ => {
                    crate::log::error(format_args!(
                        "{name}={text} is not a number of milliseconds from 0 to \
                         {IDLE_MAX_MS_MAX}; pooled swap staging is freed after \
                         {IDLE_MAX_MS_DEFAULT} ms unused"
                    ));
                    IDLE_MAX_MS_DEFAULT
                }
            },
        };
        ms * 1_000_000
    })
}

/// Why [`acquire`] found no buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// The GPU's staging budget (the node's `swap_host_memory`) has no room, even with this
    /// process's idle buffers freed.
    Budget,
    /// The driver has no `cuMemHostAlloc`/`cuMemFreeHost`, or refused to pin (its `CUresult`).
    Driver(CUresult),
}

/// A staging buffer for one chunk ([`acquire`]).
#[derive(Debug)]
pub struct Acquired {
    pub buffer: Buffer,
    /// Spent pinning it now (zero when the pool served).
    pub pinning: std::time::Duration,
    /// Spent waiting for staging being pinned ahead by the watcher, or freeing idle buffers.
    pub waited: std::time::Duration,
}

/// A buffer of at least `bytes` for a chunk of `device` about to go out: pooled if one holds it
/// (nothing pinned, nothing reserved: it is reserved already), else reserved on the board
/// through `counters` and pinned; with the time pinning took (zero when pooled). The three
/// steps apart ([`reserve`], [`Reservation::pin`], [`Reservation::settle`]) let a swap-out pin
/// on a thread of its own while it counts the chunks that landed meanwhile.
pub fn acquire(
    driver: &Driver,
    device: usize,
    bytes: u64,
    counters: &mut impl Counters,
) -> Result<Acquired, Unavailable> {
    match reserve(driver, device, bytes, counters)? {
        Reserved::Ready(acquired) => Ok(acquired),
        Reserved::ToPin(reservation) => {
            let pinned = reservation.pin(driver);
            reservation.settle(pinned, counters)
        }
    }
}

/// What [`reserve`] found for a chunk's staging.
#[derive(Debug)]
pub enum Reserved {
    /// A buffer to copy into now: pooled, or a run of the GPU's shared file.
    Ready(Acquired),
    /// Room reserved on the board for a buffer still to be pinned.
    ToPin(Reservation),
}

/// Staging reserved on the board for one chunk, not pinned yet: [`Reservation::pin`] pins it
/// (slow, and needs no counters, so it may run on another thread), and
/// [`Reservation::settle`] makes the outcome a buffer or gives the reservation back.
#[must_use = "the board's reservation is given back only by `settle`"]
#[derive(Debug)]
pub struct Reservation {
    /// The bytes reserved on the board, and pinned.
    bytes: u64,
    /// Spent waiting before the reservation (staging pinned ahead, idle buffers freed).
    waited: std::time::Duration,
}

impl Reservation {
    /// Pins the reserved bytes of fresh host memory (`pin`: 100 ms to 2 s per GiB on an H200
    /// host); the buffer and the time it took. Touches no board and no pool.
    pub fn pin(&self, driver: &Driver) -> Result<(Buffer, std::time::Duration), CUresult> {
        let size = usize::try_from(self.bytes).expect("a chunk fits the address space");
        let began = std::time::Instant::now();
        let buffer = pin(driver, size)?;
        assert_eq!(buffer.bytes, self.bytes, "pinned as reserved");
        Ok((buffer, began.elapsed()))
    }

    /// The staging for the chunk from what [`Reservation::pin`] gave (or a caller's error in its
    /// place, such as a pinning thread that panicked): on an error the reservation is given
    /// back and the chunk stays resident.
    pub fn settle(
        self,
        pinned: Result<(Buffer, std::time::Duration), CUresult>,
        counters: &mut impl Counters,
    ) -> Result<Acquired, Unavailable> {
        match pinned {
            Ok((buffer, pinning)) => {
                assert!(buffer.bytes >= self.bytes && !buffer.shared);
                Ok(Acquired {
                    buffer,
                    pinning,
                    waited: self.waited,
                })
            }
            Err(rc) => {
                counters.release_staging(self.bytes);
                Err(Unavailable::Driver(rc))
            }
        }
    }
}

/// The part of [`acquire`] that needs `counters`: a pooled buffer or a run of the GPU's shared
/// file if one holds the chunk ([`Reserved::Ready`]), else room reserved on the board for a
/// buffer to pin ([`Reserved::ToPin`]).
pub fn reserve(
    driver: &Driver,
    device: usize,
    bytes: u64,
    counters: &mut impl Counters,
) -> Result<Reserved, Unavailable> {
    assert!(device < DEVICES_MAX && bytes > 0);
    // In the shared file a chunk takes whole slabs: those are what it reserves and holds.
    let chunk_bytes = bytes;
    let bytes = staged_bytes(device, bytes);
    if !can_register(driver) && !can_host_alloc(driver) {
        return Err(Unavailable::Driver(CUDA_ERROR_NOT_SUPPORTED));
    }
    // A buffer being pinned ahead ([`warm`]) is reserved on the board already but not pooled
    // yet: wait for it (one buffer's pinning) rather than pin a second one, when it is about this
    // chunk's size. A much larger one is not waited for while the budget lets this chunk have its
    // own: on an H200 busy with three jobs, a 64 MiB swap-out waited 2.9 s for 4 GiB being
    // pinned at 2 GB/s (its own would have taken 30 ms).
    let began_waiting = std::time::Instant::now();
    let mut waited = waits_for_warming(WARMING_BYTES.load(Ordering::SeqCst), bytes);
    if waited {
        drop(warming());
    }
    loop {
        {
            let mut pools = pools();
            let taken = pools.pools[device].take(chunk_bytes);
            publish(&pools);
            if let Some(buffer) = taken {
                return Ok(Reserved::Ready(Acquired {
                    buffer,
                    pinning: std::time::Duration::ZERO,
                    waited: began_waiting.elapsed(),
                }));
            }
        }
        if counters.reserve_staging(bytes) {
            break;
        }
        if !waited {
            // The budget's room may be the buffer being pinned ahead: wait for it, look again.
            drop(warming());
            waited = true;
            continue;
        }
        // Nothing pooled fits and the budget has no room: free idle buffers (all smaller than
        // this chunk) until it has.
        let largest = {
            let mut pools = pools();
            let largest = pools.pools[device].take_largest();
            publish(&pools);
            largest
        };
        let Some(buffer) = largest else {
            return Err(Unavailable::Budget);
        };
        really_free(driver, buffer, counters);
    }
    let waited_for = began_waiting.elapsed();
    if let Some(buffer) = claim_shared(device, bytes) {
        return Ok(Reserved::Ready(Acquired {
            buffer,
            pinning: std::time::Duration::ZERO,
            waited: waited_for,
        }));
    }
    if shared_ready(device) {
        // Reserved, but no run of slabs that long is free (the file's free slabs are scattered,
        // or a dead process's are not reclaimed yet): this chunk's own staging, as without the
        // file, within the same reservation.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            crate::log::debug(format_args!(
                "no run of {} free in the GPU's shared swap staging: pinning this chunk's own \
                 (said once)",
                crate::elastic::human(bytes)
            ))
        });
    }
    if !room_beside_file(device, counters) {
        // The GPU's shared file holds the budget's host memory already: pinning more of this
        // process's own would take the node past `swap_host_memory` (the host ran out with it on
        // an H200, and a job died). The chunk stays resident, as at any budget's end.
        counters.release_staging(bytes);
        return Err(Unavailable::Budget);
    }
    Ok(Reserved::ToPin(Reservation {
        bytes,
        waited: waited_for,
    }))
}

/// This process's registration of a GPU's shared staging file (`shm::StagingFile`), once it
/// is registered: a swap-out's staging is then a run of its slabs, claimed in one pass over the
/// table, with nothing to pin and nothing to unpin.
#[derive(Clone, Copy)]
struct SharedPool {
    file: crate::shm::StagingFile,
    /// This process's owner token (`tenant_abi::slabs::owner_token`: its board slot and pid).
    owner: u64,
    pid: u32,
}

const SHARED_NONE: u8 = 0;
const SHARED_REGISTERING: u8 = 1;
const SHARED_READY: u8 = 2;
const SHARED_FAILED: u8 = 3;

/// Per GPU: how many of the shared file's first slabs this process has registered (each slab
/// is a registration of its own: one of the whole file holds the process's other driver calls,
/// the swap's included, for as long as it takes, 4-11 s for 32 GiB on an H200). Only those
/// slabs are claimed.
static SHARED_REGISTERED: [AtomicUsize; DEVICES_MAX] = [const { AtomicUsize::new(0) }; DEVICES_MAX];

/// Per GPU: where this process's registration of the shared staging file stands.
static SHARED_STATE: [std::sync::atomic::AtomicU8; DEVICES_MAX] =
    [const { std::sync::atomic::AtomicU8::new(SHARED_NONE) }; DEVICES_MAX];
static SHARED: [OnceLock<SharedPool>; DEVICES_MAX] = [const { OnceLock::new() }; DEVICES_MAX];

/// The GPU's shared staging, once this process registered a slab of it (not in a child after
/// `fork`: the registration and the owner token are the parent's).
fn shared(device: usize) -> Option<&'static SharedPool> {
    known_file(device).filter(|_| SHARED_REGISTERED[device].load(Ordering::Acquire) > 0)
}

/// The GPU's shared staging as this process knows it, registered or not yet (not in a child
/// after `fork`).
fn known_file(device: usize) -> Option<&'static SharedPool> {
    SHARED
        .get(device)?
        .get()
        .filter(|pool| pool.pid == std::process::id())
}

/// The bytes of each copy to or from the staging at `host` (`shared`: a run of the GPU's shared
/// file): a slab at most, since each slab is a registration of its own and a copy may not span
/// two (`CUDA_ERROR_INVALID_VALUE`); a buffer of its own is copied whole.
pub fn copy_piece_bytes(host: usize, shared: bool) -> u64 {
    if !shared {
        return u64::MAX;
    }
    (0..DEVICES_MAX)
        .filter_map(|device| SHARED[device].get())
        .find(|pool| {
            (pool.file.data..pool.file.data + pool.file.data_bytes as usize).contains(&host)
        })
        .map_or(u64::MAX, |pool| pool.file.slab_bytes)
}

/// Whether swap-outs on `device` stage in the GPU's shared file.
pub fn shared_ready(device: usize) -> bool {
    shared(device).is_some()
}

/// The bytes of the GPU's shared file on `device` that this process's swap-outs could claim
/// now (free slabs among those it has registered), and the slab size; `None` without a file
/// ready here.
pub fn shared_free_registered(device: usize) -> Option<(u64, u64)> {
    let pool = shared(device)?;
    let registered = SHARED_REGISTERED[device].load(Ordering::Acquire);
    let free = pool.file.table.free_among_first(registered) as u64;
    Some((free * pool.file.slab_bytes, pool.file.slab_bytes))
}

/// Of `chunks` (bytes, in giving order), those the shared file's `free_bytes` of registered free
/// slabs (`slab` each) do not cover, taken in order: what pinning ahead is still for. A process
/// whose registration lags its borrowing is then no worse off than without the file (on an
/// H200 a busy job registered 960 MiB of the file while it borrowed 28 GiB, pinned nothing
/// ahead, and its swap-out pinned 5 GiB at 2 GB/s; docs/benchmarks.md).
pub fn uncovered_by_shared(chunks: &[u64], free_bytes: u64, slab: u64) -> Vec<u64> {
    assert!(slab > 0);
    let mut left = free_bytes;
    chunks
        .iter()
        .copied()
        .filter(|&bytes| {
            let staged = whole_slabs(bytes, slab);
            if staged <= left {
                left -= staged;
                false
            } else {
                true
            }
        })
        .collect()
}

/// Per GPU: how many of the shared file's first slabs this process wants registered
/// ([`registration_want`]); the registering thread goes as far and waits for more.
static SHARED_WANT: [AtomicUsize; DEVICES_MAX] = [const { AtomicUsize::new(0) }; DEVICES_MAX];
/// Per GPU: the registering thread, woken when the want grows.
static SHARED_THREAD: [OnceLock<std::thread::Thread>; DEVICES_MAX] =
    [const { OnceLock::new() }; DEVICES_MAX];
/// How long the registering thread waits for the want to grow (or the agent to finish
/// allocating the file) before it looks again.
const REGISTER_IDLE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
/// After each slab's registration the registering thread rests this long. A registration holds
/// the process's other driver calls, and back to back the registering thread takes the driver
/// again before they do: three busy processes registering a 32 GiB file slab by slab at once saw
/// their `cuMemAlloc` wait up to 560 ms and a 64 MiB pin of their own up to 800 ms. A 2 ms rest
/// after each slab let them in (allocations at most 29 ms, pins 19 ms) and registered at
/// 5.7-6.1 GB/s, faster than back to back under that contention (2.1 GB/s) and than resting as
/// long as each slab took (3.3-4.6 GB/s, at most 26 and 16 ms; H200,
/// `tests/gpu/shared_register_busy.py`, docs/benchmarks.md).
pub const REGISTER_REST: std::time::Duration = std::time::Duration::from_millis(2);

/// How many of the shared file's first slabs a process should have registered: the slabs other
/// processes hold now (a run is claimed among the registered ones, and theirs are not free),
/// plus slabs for `need_bytes` of its own staging, at most the file's `total_slabs`. The need is
/// the process's resident borrowed chunks in whole slabs: a process that borrows little
/// registers little.
pub fn registration_want(
    total_slabs: usize,
    held_by_others: usize,
    need_bytes: u64,
    slab_bytes: u64,
) -> usize {
    assert!(slab_bytes > 0);
    let own = usize::try_from(need_bytes.div_ceil(slab_bytes)).unwrap_or(usize::MAX);
    held_by_others.saturating_add(own).min(total_slabs)
}

/// The want of this process on `device` for `file` ([`registration_want`]), from its board slot
/// `slot`, its staging need and the file's table now.
pub fn shared_want(file: &crate::shm::StagingFile, slot: usize, need_bytes: u64) -> usize {
    let owner = tenant_abi::slabs::owner_token(slot, std::process::id());
    let total = (file.data_bytes / file.slab_bytes) as usize;
    let held_by_others = total
        .saturating_sub(file.table.free())
        .saturating_sub(file.table.owned_by(owner));
    registration_want(total, held_by_others, need_bytes, file.slab_bytes)
}

/// Registers the first `want` slabs of the GPU's shared staging file `file` for this process
/// (board slot `slot`), on a thread of its own with `context` made current there, started on the
/// first call and woken by later ones that want more: registering is slow (1.7 s for 16 GiB on
/// an idle H200 host, `tests/gpu/shared_staging.py`), so it is never on a swap's path. Each slab
/// is a registration of its own, claimable once registered, and the thread rests after each
/// ([`REGISTER_REST`]) so that the process's own driver calls are not held for long; it starts
/// only once the agent has allocated the file (`SlabTable::is_allocated`). Until the first slab
/// is registered (or if registering fails, said once), swap-outs pin their own staging as before.
pub fn register_shared(
    driver: &'static Driver,
    device: usize,
    file: crate::shm::StagingFile,
    slot: usize,
    context: usize,
    want: usize,
) {
    let Some(state) = SHARED_STATE.get(device) else {
        return;
    };
    let before = SHARED_WANT[device].fetch_max(want, Ordering::SeqCst);
    if state
        .compare_exchange(
            SHARED_NONE,
            SHARED_REGISTERING,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
        .is_err()
    {
        if want > before
            && let Some(thread) = SHARED_THREAD[device].get()
        {
            thread.unpark();
        }
        return;
    }
    let (Some(register), Some(set_current)) =
        (driver.fns.mem_host_register, driver.fns.ctx_set_current)
    else {
        state.store(SHARED_FAILED, Ordering::SeqCst);
        return;
    };
    let pid = std::process::id();
    // Known before a slab is registered: the file's pages count against the budget from the
    // start ([`room_beside_file`]), so that pinning ahead beside it stops at once.
    let owner = tenant_abi::slabs::owner_token(slot, pid);
    let _ = SHARED[device].set(SharedPool { file, owner, pid });
    let spawned = std::thread::Builder::new()
        .name("vgpu-staging-register".into())
        .spawn(move || {
            // SAFETY: `context` is a context of this process (the watcher's current one); making
            // it current on this thread takes no pointer.
            if unsafe { set_current(context as CUcontext) } != CUDA_SUCCESS {
                crate::log::error(format_args!(
                    "device {device}: cannot make the process's context current to register the \
                     GPU's shared swap staging; this process pins its own staging"
                ));
                state.store(SHARED_FAILED, Ordering::SeqCst);
                return;
            }
            let slabs = (file.data_bytes / file.slab_bytes) as usize;
            let slab = file.slab_bytes as usize;
            let mut index = 0;
            let mut said_unallocated = false;
            while index < slabs {
                let want = SHARED_WANT[device].load(Ordering::SeqCst).min(slabs);
                if !file.table.is_allocated() {
                    // The agent is still allocating the file's pages (`SlabTable::allocated`):
                    // registering them now would fault them here, against that allocation.
                    if !said_unallocated {
                        said_unallocated = true;
                        crate::log::debug(format_args!(
                            "device {device}: the GPU's shared swap staging is still being \
                             allocated by the node agent; registering it once it is (until then \
                             swap-outs pin their own staging only where the budget has room \
                             beside the file)"
                        ));
                    }
                    std::thread::park_timeout(REGISTER_IDLE_WAIT);
                    continue;
                }
                if index >= want {
                    // As far as wanted: until the watcher wants more (a process exiting ends
                    // the thread with it).
                    std::thread::park_timeout(REGISTER_IDLE_WAIT);
                    continue;
                }
                let began = std::time::Instant::now();
                let from = index;
                while index < want {
                    // SAFETY: slab `index` of the staging file, mapped shared for the process's
                    // life (`shm::open_staging`) and registered once here, a registration of its
                    // own (never unregistered: the process's end undoes it).
                    let rc = unsafe {
                        register(
                            (file.data + index * slab) as *mut c_void,
                            slab,
                            CU_MEMHOSTREGISTER_PORTABLE,
                        )
                    };
                    if rc != CUDA_SUCCESS {
                        crate::log::error(format_args!(
                            "device {device}: registering the GPU's shared swap staging failed \
                             at slab {index} of {slabs} ({rc}); {}",
                            if index > 0 {
                                "swap-outs use the slabs registered before it"
                            } else {
                                "this process pins its own staging"
                            }
                        ));
                        state.store(
                            if index > 0 {
                                SHARED_READY
                            } else {
                                SHARED_FAILED
                            },
                            Ordering::SeqCst,
                        );
                        return;
                    }
                    index += 1;
                    // From now on its slabs up to this one may be claimed.
                    SHARED_REGISTERED[device].store(index, Ordering::Release);
                    std::thread::sleep(REGISTER_REST);
                }
                state.store(SHARED_READY, Ordering::SeqCst);
                crate::log::debug(format_args!(
                    "device {device}: {} more of the GPU's shared swap staging registered in \
                     {:.2} s ({} of {} in all); swap-outs stage in its slabs",
                    crate::elastic::human((index - from) as u64 * file.slab_bytes),
                    began.elapsed().as_secs_f64(),
                    crate::elastic::human(index as u64 * file.slab_bytes),
                    crate::elastic::human(file.data_bytes),
                ));
            }
        });
    match spawned {
        Ok(handle) => {
            let _ = SHARED_THREAD[device].set(handle.thread().clone());
        }
        Err(_) => state.store(SHARED_FAILED, Ordering::SeqCst),
    }
}

/// The bytes a chunk of `bytes` reserves on `device`: whole slabs when it stages in the shared
/// file, else its own size.
fn staged_bytes(device: usize, bytes: u64) -> u64 {
    shared(device).map_or(bytes, |pool| whole_slabs(bytes, pool.file.slab_bytes))
}

/// `bytes` in whole slabs of `slab`: what a chunk takes in the shared file.
pub fn whole_slabs(bytes: u64, slab: u64) -> u64 {
    bytes.div_ceil(slab) * slab
}

/// A run of slabs holding `bytes` (a multiple of the slab size) in the GPU's shared staging,
/// if one is free now.
fn claim_shared(device: usize, bytes: u64) -> Option<Buffer> {
    let pool = shared(device)?;
    let slab = pool.file.slab_bytes;
    if !bytes.is_multiple_of(slab) {
        // Sized before the file's first slab was registered (`staged_bytes`): reserved for a
        // buffer of its own, which it gets.
        return None;
    }
    let count = usize::try_from(bytes / slab).ok()?;
    let usable = SHARED_REGISTERED[device].load(Ordering::Acquire);
    let first = pool.file.table.claim_run(pool.owner, count, usable)?;
    Some(Buffer {
        host: pool.file.data + first * slab as usize,
        bytes,
        registered: false,
        shared: true,
    })
}

/// Whether a buffer of this process's own (reserved already) fits the node's staging budget
/// beside `device`'s shared staging file: the file's pages are resident whether or not a slab of
/// it is claimed, and a claimed slab is reserved like any staging, so its unclaimed slabs count
/// against the budget too. Without a file mapped here: yes.
fn room_beside_file(device: usize, counters: &mut impl Counters) -> bool {
    let Some(pool) = known_file(device) else {
        return true;
    };
    let unclaimed = (pool.file.table.free() as u64).saturating_mul(pool.file.slab_bytes);
    counters.staging_left_for(unclaimed)
}

/// Gives a shared buffer's slabs back to the GPU's file.
fn release_shared(device: usize, buffer: Buffer) {
    let Some(pool) = shared(device) else {
        return;
    };
    let slab = pool.file.slab_bytes as usize;
    let first = (buffer.host - pool.file.data) / slab;
    let count = (buffer.bytes / slab as u64) as usize;
    if let Err(e) = pool.file.table.release_run(pool.owner, first, count) {
        crate::log::error(format_args!("giving shared swap staging back: {e}"));
    }
}

/// The GPU whose shared file holds `buffer`.
fn shared_device(buffer: Buffer) -> Option<usize> {
    (0..DEVICES_MAX).find(|&device| {
        shared(device).is_some_and(|pool| {
            (pool.file.data..pool.file.data + pool.file.data_bytes as usize).contains(&buffer.host)
        })
    })
}

fn can_register(driver: &Driver) -> bool {
    driver.fns.mem_host_register.is_some() && driver.fns.mem_host_unregister.is_some()
}

fn can_host_alloc(driver: &Driver) -> bool {
    driver.fns.mem_host_alloc.is_some() && driver.fns.mem_free_host.is_some()
}

/// Pins `size` bytes of fresh host memory, portable so that a chunk of any context of the process
/// may use it. The fast way first: anonymous memory mapped here with transparent huge pages asked
/// for, first touched by several threads ([`touch`]), then registered with the driver. On an H200
/// host (tests/gpu/host_staging_bench.py, docs/benchmarks.md) 4 GiB took 0.13 s to touch with 8
/// threads and 0.17 s to register, against 2.7 s for `cuMemHostAlloc`, which pins page by page
/// and zeroes on one thread. `cuMemHostAlloc` when the driver lacks registration or refuses it.
fn pin(driver: &Driver, size: usize) -> Result<Buffer, CUresult> {
    let began = std::time::Instant::now();
    if let (Some(register), Some(_)) =
        (driver.fns.mem_host_register, driver.fns.mem_host_unregister)
        && let Some(host) = map_touched(size)
    {
        let touched = began.elapsed();
        // SAFETY: `host..host + size` is a private mapping made by `map_touched`, owned by this
        // module and registered once; it is unregistered before it is unmapped (`really_free`).
        let rc = unsafe { register(host as *mut c_void, size, CU_MEMHOSTREGISTER_PORTABLE) };
        if rc == CUDA_SUCCESS {
            say_slow_pin(size, touched, began.elapsed());
            return Ok(Buffer {
                host,
                bytes: size as u64,
                registered: true,
                shared: false,
            });
        }
        unmap(host, size);
        if rc == CUDA_ERROR_DEINITIALIZED {
            // The process is exiting (a warm-up on the watcher's thread raced its end): no
            // fallback and nothing to say.
            return Err(rc);
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            crate::log::error(format_args!(
                "cuMemHostRegister refused swap staging ({rc}); pinning it with \
                     cuMemHostAlloc instead (slower: about 1.6 GB/s)"
            ))
        });
    }
    let Some(host_alloc) = driver.fns.mem_host_alloc.filter(|_| can_host_alloc(driver)) else {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    };
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: `host` is valid for a write; pinned host memory of `size` bytes.
    let rc = unsafe { host_alloc(&mut host, size, CU_MEMHOSTALLOC_PORTABLE) };
    if rc != CUDA_SUCCESS || host.is_null() {
        return Err(if rc == CUDA_SUCCESS {
            CUDA_ERROR_OUT_OF_MEMORY
        } else {
            rc
        });
    }
    Ok(Buffer {
        host: host as usize,
        bytes: size as u64,
        registered: false,
        shared: false,
    })
}

/// A debug line (`VGPU_LOG=2`) for a pin slower than [`SLOW_PIN_BYTES_PER_S`], at most one a
/// second: where its time went (mapping and touching on how many threads, registering), for the
/// reclaims that pinned at 2.4-3.0 GB/s inside three PyTorch jobs on an H200 while the same
/// buffers pin at 9-11 GB/s alone (`tests/gpu/pin_sizes.py`).
fn say_slow_pin(size: usize, touched: std::time::Duration, took: std::time::Duration) {
    static LAST_NS: AtomicU64 = AtomicU64::new(0);
    if (size as f64) / took.as_secs_f64().max(1e-9) >= SLOW_PIN_BYTES_PER_S {
        return;
    }
    let now = crate::shm::monotonic_ns();
    let last = LAST_NS.load(Ordering::Relaxed);
    if now.saturating_sub(last) < 1_000_000_000
        || LAST_NS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    crate::log::debug(format_args!(
        "pinning {} of swap staging took {:.1} ms: mapping and touching {:.1} ms on {} \
         thread(s) (this thread may run on {} CPU(s)), registering {:.1} ms",
        crate::elastic::human(size as u64),
        took.as_secs_f64() * 1e3,
        touched.as_secs_f64() * 1e3,
        touch_threads(size),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        (took - touched).as_secs_f64() * 1e3
    ));
}

/// The pinning rate below which [`say_slow_pin`] speaks: 5 GB/s, half what 64 MiB buffers pin at
/// alone on an H200 host.
const SLOW_PIN_BYTES_PER_S: f64 = 5e9;

/// A fresh private anonymous mapping of `size` bytes, huge pages asked for, left out of a forked
/// child (its bytes are this process's staging), every page touched; `None` if it cannot be
/// mapped.
fn map_touched(size: usize) -> Option<usize> {
    // SAFETY: a new private anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: advice on the mapping just made. Either may fail (no transparent huge pages on this
    // kernel): then the pages are small, or a child copies them on fork, and nothing else changes.
    unsafe {
        libc::madvise(p, size, libc::MADV_HUGEPAGE);
        libc::madvise(p, size, libc::MADV_DONTFORK);
    }
    if touch_on() {
        touch(p as usize, size);
    }
    Some(p as usize)
}

/// Whether new staging is touched before it is registered: unless `VGPU_MEMORY_STAGING_TOUCH=0`
/// (read once), for dry runs on the fake driver, whose chunk sizes are simulated and whose
/// registration touches nothing.
fn touch_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| not_off(tenant_abi::env::var::MEMORY_STAGING_TOUCH))
}

/// Writes one byte of every page of `host..host + size` (a mapping of this module), on up to
/// [`TOUCH_THREADS_MAX`] threads of at least [`TOUCH_PIECE_MIN`] bytes each: the kernel's page
/// faults (zeroing each page) scale with the threads, where one thread faulted 4 GiB at 1.6-2.5
/// GB/s on the H200 host and 8 threads at 11-32 GB/s (small or huge pages).
fn touch(host: usize, size: usize) {
    const PAGE: usize = 4096;
    let touch_piece = move |start: usize, end: usize| {
        for offset in (start..end).step_by(PAGE) {
            // SAFETY: `host + offset` is inside the mapping (`offset < size`), which nothing else
            // uses yet.
            unsafe { std::ptr::write_volatile((host + offset) as *mut u8, 0) };
        }
    };
    let threads = touch_threads(size);
    // Pieces on huge-page boundaries, so that no huge page is split between two threads.
    let piece = size.div_ceil(threads).next_multiple_of(2 << 20);
    std::thread::scope(|scope| {
        for start in (piece..size).step_by(piece) {
            let end = (start + piece).min(size);
            let spawned = std::thread::Builder::new()
                .name("vgpu-staging".into())
                .spawn_scoped(scope, move || touch_piece(start, end));
            if spawned.is_err() {
                touch_piece(start, end);
            }
        }
        touch_piece(0, piece.min(size));
    });
}

/// How many threads touch a buffer of `size` bytes: one per [`TOUCH_PIECE_MIN`], at most
/// [`TOUCH_THREADS_MAX`] and the CPUs this thread may run on.
fn touch_threads(size: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(TOUCH_THREADS_MAX)
        .min(size.div_ceil(TOUCH_PIECE_MIN))
        .max(1)
}

/// The most threads that touch one buffer's pages.
const TOUCH_THREADS_MAX: usize = 8;
/// The least bytes a touching thread takes (smaller buffers take fewer threads): four huge
/// pages, about 3 ms of faulting for one thread against tens of microseconds to start it. At
/// 64 MiB, a PyTorch job's 64 MiB chunks were touched by one thread each: a swap-out of 8 GiB of
/// them on an H200 spent 2.5 s pinning (3 GB/s) while a tenant within its request waited.
const TOUCH_PIECE_MIN: usize = 8 << 20;

fn unmap(host: usize, size: usize) {
    // SAFETY: `host..host + size` is a mapping made by `map_touched`, not registered, and no
    // longer used.
    unsafe { libc::munmap(host as *mut c_void, size) };
}

/// Whether staging is pinned ahead for resident borrowed chunks: unless
/// `VGPU_MEMORY_STAGING_WARM=0` (read once).
pub fn warm_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| not_off(tenant_abi::env::var::MEMORY_STAGING_WARM))
}

/// Whether the switch `name` is on: unless it says `0`.
fn not_off(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v.trim() != "0")
}

/// Bytes of the buffer [`warm`] is pinning now (0: none), for [`acquire`]'s choice.
static WARMING_BYTES: AtomicU64 = AtomicU64::new(0);

/// Whether a swap-out needing `bytes` of staging waits for the buffer being pinned ahead
/// (`warming_bytes`, 0: none) rather than pin its own (budget permitting): only when that
/// buffer is at most twice its need, so that the wait is about as long as its own pinning.
fn waits_for_warming(warming_bytes: u64, bytes: u64) -> bool {
    warming_bytes != 0 && warming_bytes <= bytes.saturating_mul(2)
}

/// Held by [`warm`] while it pins a buffer: a swap-out that needs staging meanwhile may wait for
/// that buffer to be pooled (one buffer's pinning at most; see [`acquire`]).
fn warming() -> MutexGuard<'static, ()> {
    static WARMING: Mutex<()> = Mutex::new(());
    WARMING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The most bytes one look pins ahead ([`warm`]): a borrower of tens of GiB is made ready over
/// several looks, each short (1 GiB takes 60-100 ms to touch and register on an H200 host, up
/// to ~0.4 s inside busy jobs), so that the watcher that pins also acts on wants in between;
/// a look that pinned this much is followed by another at the watcher's next tick.
pub const WARM_STEP_MAX: u64 = 1 << 30;

/// Pins staging ahead for this process's resident borrowed chunks of `device` (`chunks`: their
/// sizes, largest first), within `cap` bytes pooled for them (the caller's share of the node's
/// `swap_host_memory`): a reclaim then copies at the link's speed instead of pinning first
/// (pinning was 99% of the first reclaim on an H200). Each buffer is reserved on the board
/// before it is pinned, like any staging; stops at the budget, at a driver refusal, or after
/// [`WARM_STEP_MAX`] bytes. Returns the bytes pinned.
pub fn warm(
    driver: &Driver,
    device: usize,
    chunks: &[u64],
    cap: u64,
    counters: &mut impl Counters,
) -> u64 {
    assert!(device < DEVICES_MAX);
    let to_pin = {
        let mut pools = pools();
        let to_pin = pools.pools[device].plan_warm(chunks, cap);
        publish(&pools);
        to_pin
    };
    let mut pinned = 0u64;
    for size in to_pin {
        // Held for one buffer at a time: a swap-out waits for at most one pin.
        let _warming = warming();
        if pinned >= WARM_STEP_MAX || !counters.reserve_staging(size) {
            break;
        }
        if !room_beside_file(device, counters) {
            counters.release_staging(size);
            break;
        }
        let Ok(bytes) = usize::try_from(size) else {
            counters.release_staging(size);
            break;
        };
        WARMING_BYTES.store(size, Ordering::SeqCst);
        let result = pin(driver, bytes);
        WARMING_BYTES.store(0, Ordering::SeqCst);
        match result {
            Ok(buffer) => {
                let mut pools = pools();
                pools.pools[device].put_warm(buffer, crate::shm::monotonic_ns());
                publish(&pools);
                pinned += size;
            }
            Err(_) => {
                counters.release_staging(size);
                break;
            }
        }
    }
    pinned
}

/// `buffer` (of `device`'s pool) holds no chunk any more: pooled, still reserved. No copy may
/// still read or write it (the caller waited for its stream).
pub fn recycle(device: usize, buffer: Buffer) {
    assert!(device < DEVICES_MAX);
    let mut pools = pools();
    pools.pools[device].put(buffer, crate::shm::monotonic_ns());
    publish(&pools);
}

/// Frees every idle buffer of `device`'s pool, those pinned ahead for resident chunks included:
/// the budget is short, this process waits for its own chunks, and another process's swap-out
/// needs the room (`Backing::release_idle`).
pub fn free_idle(driver: &Driver, device: usize, counters: &mut impl Counters) {
    free_taken(driver, device, counters, Pool::drain_idle);
}

/// Frees the buffers of `device`'s pool that no swap-out reused for the idle bound, and releases
/// their staging on the board through `counters`. No driver call while nothing has idled out.
pub fn trim(driver: &Driver, device: usize, counters: &mut impl Counters) {
    free_taken(driver, device, counters, |pool| {
        pool.expired(crate::shm::monotonic_ns(), idle_max_ns())
    });
}

/// Frees the buffers `take` takes out of `device`'s pool (nothing while nothing is pooled).
fn free_taken(
    driver: &Driver,
    device: usize,
    counters: &mut impl Counters,
    take: impl FnOnce(&mut Pool) -> Vec<Buffer>,
) {
    if !any_pooled() || device >= DEVICES_MAX {
        return;
    }
    let taken = {
        let mut pools = pools();
        let taken = take(&mut pools.pools[device]);
        publish(&pools);
        taken
    };
    for buffer in taken {
        really_free(driver, buffer, counters);
    }
}

/// Unpinned and freed the way it was pinned, then the staging released on the board: the
/// reservation outlives the memory by the call, never the other way round.
fn really_free(driver: &Driver, buffer: Buffer, counters: &mut impl Counters) {
    if buffer.shared {
        // Slabs of the shared file: given back, nothing unpinned.
        release_shared(shared_device(buffer).unwrap_or(0), buffer);
        counters.release_staging(buffer.bytes);
        return;
    }
    let host = buffer.host as *mut c_void;
    let size = usize::try_from(buffer.bytes).expect("a buffer fits the address space");
    // SAFETY: `buffer` came from `pin` in `acquire`, was taken out of the pool (so no chunk and
    // no other caller holds it) and no copy uses it; freed once, the way it was pinned (a
    // registered buffer's functions were there when it was pinned, and stay).
    let rc = unsafe {
        if buffer.registered {
            let rc = driver
                .fns
                .mem_host_unregister
                .map_or(CUDA_ERROR_NOT_SUPPORTED, |unregister| unregister(host));
            if rc == CUDA_SUCCESS {
                unmap(buffer.host, size);
            }
            rc
        } else {
            driver
                .fns
                .mem_free_host
                .map_or(CUDA_ERROR_NOT_SUPPORTED, |free_host| free_host(host))
        }
    };
    if rc != CUDA_SUCCESS {
        crate::log::error(format_args!(
            "freeing {} of swap staging failed ({rc}); it is released on the board anyway (the \
             OS frees it with the process)",
            crate::elastic::human(buffer.bytes)
        ));
    }
    counters.release_staging(buffer.bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's staging budget and what is reserved on it: enough of a board for the pool's
    /// reservations and [`room_beside_file`].
    struct Budget {
        budget: u64,
        reserved: u64,
    }

    impl Counters for Budget {
        fn swapped_out(&mut self, _: u64) {}
        fn room_for(&mut self, _: u64) -> bool {
            true
        }
        fn swap_in(&mut self, _: u64) -> bool {
            true
        }
        fn swap_in_failed(&mut self, _: u64) {}
        fn reserve_staging(&mut self, bytes: u64) -> bool {
            let fits = self.reserved + bytes <= self.budget;
            self.reserved += if fits { bytes } else { 0 };
            fits
        }
        fn release_staging(&mut self, bytes: u64) {
            self.reserved -= bytes;
        }
        fn staging_left_for(&mut self, bytes: u64) -> bool {
            self.budget - self.reserved >= bytes
        }
    }

    /// The GPU's shared file holds its pages whether or not a slab is claimed: a buffer of the
    /// process's own fits only beside the unclaimed slabs (an H200's host ran out when the file
    /// and the processes' own pins each took the budget).
    #[test]
    fn a_buffer_of_its_own_fits_the_budget_only_beside_the_files_unclaimed_slabs() {
        let dir = tempfile::tempdir().expect("a directory");
        let uuid = "GPU-00000000-0000-0000-0000-00000000000f";
        let path = tenant_abi::layout::staging_path(dir.path(), uuid);
        let slab = tenant_abi::slabs::SLAB_BYTES_MIN;
        assert!(tenant_abi::shm::create_staging(&path, 4 * slab).expect("the file"));
        let file = crate::shm::open_staging(dir.path(), uuid)
            .expect("mapped")
            .expect("there");
        let device = DEVICES_MAX - 1;
        // No file known on this device yet: as without one.
        let mut board = Budget {
            budget: 6 * slab,
            reserved: 5 * slab,
        };
        assert!(room_beside_file(device, &mut board));
        let pid = std::process::id();
        let owner = tenant_abi::slabs::owner_token(1, pid);
        assert!(SHARED[device].set(SharedPool { file, owner, pid }).is_ok());
        // A budget of 6 slabs, the file's 4 unclaimed: 2 for the process's own, whether or not
        // it registered a slab.
        board.reserved = 2 * slab;
        assert!(room_beside_file(device, &mut board));
        board.reserved = 3 * slab;
        assert!(!room_beside_file(device, &mut board));
        // A claimed slab is reserved like any staging: claiming one moves its bytes from the
        // file's unclaimed to the reserved, and the room is the same.
        assert!(file.table.claim_run(owner, 1, 4).is_some());
        board.reserved += slab;
        assert!(!room_beside_file(device, &mut board));
        board.reserved = 3 * slab;
        assert!(room_beside_file(device, &mut board));
        // A file as large as the budget leaves no room for any buffer of its own: reserved, the
        // claimed slab and the buffer.
        let mut whole = Budget {
            budget: 4 * slab,
            reserved: 2 * slab,
        };
        assert!(!room_beside_file(device, &mut whole));
        whole.reserved = slab;
        assert!(
            room_beside_file(device, &mut whole),
            "the slab alone: nothing of its own"
        );
    }

    fn buffer(host: usize, bytes: u64) -> Buffer {
        Buffer {
            host,
            bytes,
            registered: false,
            shared: false,
        }
    }

    #[test]
    fn pinning_ahead_is_for_what_the_registered_free_slabs_do_not_cover() {
        const SLAB: u64 = 64 << 20;
        // Nothing registered free: every chunk, as without the file.
        assert_eq!(
            uncovered_by_shared(&[3 * SLAB, SLAB], 0, SLAB),
            [3 * SLAB, SLAB]
        );
        // Room for the first in whole slabs (a 1-byte chunk takes a slab), not the second.
        assert_eq!(
            uncovered_by_shared(&[3 * SLAB, SLAB + 1], 4 * SLAB, SLAB),
            [SLAB + 1]
        );
        // A larger chunk that does not fit leaves the room to a smaller one after it.
        assert_eq!(
            uncovered_by_shared(&[8 * SLAB, 2 * SLAB], 3 * SLAB, SLAB),
            [8 * SLAB]
        );
        assert!(uncovered_by_shared(&[SLAB, SLAB], 2 * SLAB, SLAB).is_empty());
    }

    #[test]
    fn a_process_registers_what_it_needs_past_the_slabs_others_hold() {
        const SLAB: u64 = 64 << 20;
        // Nothing held elsewhere: its own need, in whole slabs.
        assert_eq!(registration_want(8, 0, 1, SLAB), 1);
        assert_eq!(registration_want(8, 0, 2 * SLAB, SLAB), 2);
        assert_eq!(registration_want(8, 0, 0, SLAB), 0);
        // Others' slabs are not free to it: it registers past them.
        assert_eq!(registration_want(8, 3, 2 * SLAB + 1, SLAB), 6);
        // Never past the file.
        assert_eq!(registration_want(8, 7, 4 * SLAB, SLAB), 8);
        assert_eq!(registration_want(8, 0, u64::MAX, SLAB), 8);
    }

    #[test]
    fn a_chunk_takes_the_smallest_buffer_that_holds_it() {
        let mut pool = Pool::default();
        pool.put(buffer(0x1000, 8), 1);
        pool.put(buffer(0x2000, 4), 2);
        pool.put(buffer(0x3000, 16), 3);
        assert_eq!(pool.take(3), Some(buffer(0x2000, 4)));
        assert_eq!(pool.take(5), Some(buffer(0x1000, 8)));
        assert_eq!(pool.take(17), None, "none holds it");
        assert_eq!(pool.idle_bytes(), 16);
        assert_eq!(pool.take(16), Some(buffer(0x3000, 16)));
        assert!(pool.is_empty());
    }

    #[test]
    fn among_equal_buffers_the_one_idle_longest_serves() {
        let mut pool = Pool::default();
        pool.put(buffer(0x2000, 4), 20);
        pool.put(buffer(0x1000, 4), 10);
        assert_eq!(pool.take(4), Some(buffer(0x1000, 4)));
        assert_eq!(pool.take(4), Some(buffer(0x2000, 4)));
    }

    #[test]
    fn buffers_idle_past_the_bound_expire_and_the_rest_stay() {
        let mut pool = Pool::default();
        pool.put(buffer(0x1000, 8), 100);
        pool.put(buffer(0x2000, 4), 150);
        assert!(pool.expired(149, 50).is_empty(), "49 ns idle is under 50");
        assert_eq!(pool.expired(150, 50), [buffer(0x1000, 8)]);
        assert_eq!(pool.idle_bytes(), 4);
        // A bound of zero frees everything at the next look.
        assert_eq!(pool.expired(150, 0), [buffer(0x2000, 4)]);
        assert!(pool.is_empty());
    }

    #[test]
    fn a_swap_out_waits_only_for_a_warm_buffer_about_its_size() {
        const MIB: u64 = 1 << 20;
        assert!(!waits_for_warming(0, 64 * MIB), "nothing is being pinned");
        assert!(waits_for_warming(64 * MIB, 64 * MIB));
        assert!(waits_for_warming(128 * MIB, 64 * MIB));
        assert!(
            !waits_for_warming(4096 * MIB, 64 * MIB),
            "4 GiB being pinned: a 64 MiB chunk pins its own"
        );
        assert!(waits_for_warming(4096 * MIB, 4000 * MIB));
    }

    #[test]
    fn warm_buffers_are_planned_largest_chunk_first_within_the_cap() {
        let mut pool = Pool::default();
        // Chunks of 8, 4, 4 and 2 (largest first), a cap of 14: 8 and 4 are pinned, the second 4
        // would pass the cap and ends the plan (the 2 after it is not planned either).
        assert_eq!(pool.plan_warm(&[8, 4, 4, 2], 14), [8, 4]);
        pool.put_warm(buffer(0x1000, 8), 1);
        pool.put_warm(buffer(0x2000, 4), 1);
        // Both matched at the next look: nothing more to pin; a larger cap pins the rest.
        assert_eq!(pool.plan_warm(&[8, 4, 4, 2], 14), Vec::<u64>::new());
        assert_eq!(pool.plan_warm(&[8, 4, 4, 2], 100), [4, 2]);
        // Warm buffers never idle out, however long they idle.
        assert!(pool.expired(u64::MAX, 0).is_empty());
    }

    #[test]
    fn a_warm_buffer_whose_chunk_went_away_idles_out_as_before() {
        let mut pool = Pool::default();
        pool.put_warm(buffer(0x1000, 8), 10);
        pool.put_warm(buffer(0x2000, 4), 10);
        // The 8 chunk was freed: only the 4 is matched; the 8 idles out (since it was pooled).
        assert_eq!(pool.plan_warm(&[4], 100), Vec::<u64>::new());
        assert_eq!(pool.expired(10 + 50, 50), [buffer(0x1000, 8)]);
        assert_eq!(pool.idle_bytes(), 4);
        // A swap-out takes a warm buffer like any other.
        assert_eq!(pool.take(4), Some(buffer(0x2000, 4)));
    }

    #[test]
    fn a_larger_idle_buffer_serves_a_smaller_chunk_and_counts_its_size() {
        let mut pool = Pool::default();
        pool.put(buffer(0x1000, 16), 1);
        // The 4 chunk is matched with the 16 buffer (what a swap-out would take): 16 counts
        // toward the cap, so a cap of 18 leaves room for no 4 more.
        assert_eq!(pool.plan_warm(&[4, 4], 18), Vec::<u64>::new());
        assert_eq!(pool.plan_warm(&[4, 4], 20), [4]);
        // A cap of 0 plans nothing, and every buffer is unmarked.
        assert_eq!(pool.plan_warm(&[4, 4], 0), Vec::<u64>::new());
        assert_eq!(pool.expired(1, 0), [buffer(0x1000, 16)]);
    }

    #[test]
    fn room_is_made_from_the_largest_idle_buffer_first() {
        let mut pool = Pool::default();
        pool.put(buffer(0x1000, 4), 1);
        pool.put(buffer(0x2000, 8), 2);
        pool.put(buffer(0x3000, 8), 3);
        assert_eq!(pool.take_largest(), Some(buffer(0x2000, 8)));
        assert_eq!(pool.take_largest(), Some(buffer(0x3000, 8)));
        assert_eq!(pool.take_largest(), Some(buffer(0x1000, 4)));
        assert_eq!(pool.take_largest(), None);
    }

    /// A buffer reused, put back and reused again keeps its reservation: the board's counters see
    /// one reservation for its whole life, released once when it is really freed.
    #[test]
    fn a_pooled_buffer_stays_reserved_until_it_is_freed() {
        type Staging = Budget;
        // The pure part of `acquire` and `trim`, on a pool: reserve only what is not pooled.
        let mut staging = Staging {
            reserved: 0,
            budget: 12,
        };
        let mut pool = Pool::default();
        let acquire = |pool: &mut Pool, staging: &mut Staging, bytes: u64, host: usize| {
            if let Some(buffer) = pool.take(bytes) {
                return Some(buffer);
            }
            while !staging.reserve_staging(bytes) {
                let freed = pool.take_largest()?;
                staging.release_staging(freed.bytes);
            }
            Some(buffer(host, bytes))
        };
        let first = acquire(&mut pool, &mut staging, 8, 0x1000).expect("room");
        assert_eq!(staging.reserved, 8);
        pool.put(first, 0);
        assert_eq!(staging.reserved, 8, "pooled: still reserved");
        let again = acquire(&mut pool, &mut staging, 4, 0x2000).expect("pooled");
        assert_eq!(again, first, "a smaller chunk uses the larger buffer");
        assert_eq!(staging.reserved, 8);
        pool.put(again, 1);
        // 10 do not fit beside the pooled 8 (budget 12): the idle buffer makes room.
        let other = acquire(&mut pool, &mut staging, 10, 0x3000).expect("room made");
        assert_eq!((other.bytes, staging.reserved), (10, 10));
        assert!(pool.is_empty());
        pool.put(other, 2);
        for freed in pool.expired(2, 0) {
            staging.release_staging(freed.bytes);
        }
        assert_eq!(staging.reserved, 0);
    }
}
