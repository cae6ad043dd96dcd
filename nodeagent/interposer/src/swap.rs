//! The swap of elastic memory (issue 17, `docs/design/elastic-memory.md`, "Reclaim"), the pure
//! part: which of this process's borrowed chunks go to host memory when other tenants want memory
//! back, and bringing them all back, at the same addresses, when the GPU has room again. The
//! driver work (copy to pinned staging, unmap and release; create, map and copy back; a batch of
//! chunks at a time, and the staging's reservation on the board) is behind [`Backing`]
//! (`vmm::SwapBacking` for the real driver, a byte-vector model in the tests), and the board's
//! counters behind [`Counters`].
//!
//! **The hold rule**: a process with any chunk out must launch nothing and copy nothing until
//! every chunk is back ([`Chunks::held`]), since a kernel may touch any allocation of its
//! process. `hooks` holds a borrowing allocation until then, and the launch and copy hooks go
//! through [`try_enter`] (`hooks::enter_work`): both wait in the GPU's line (`line`) for room to
//! bring the chunks back, and a swap-out first makes the process quiet
//! ([`quiesce`]: no launch or copy between its check and its driver call) and drains its queued
//! work. The process-wide counters here are what the launch and copy paths read: a process with
//! no swappable chunk pays one relaxed load ([`any_chunk`]).
//!
//! Only borrowed chunks that the interposer backs itself are here (`vmm::Purpose::Borrowed`):
//! the application's own `cuMemCreate` memory and memory within the request are never swapped.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// A driver step of a swap failed: the chunk is left as it was (resident, or out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapError {
    pub address: u64,
    /// The driver's `CUresult`.
    pub result: i32,
}

impl std::fmt::Display for SwapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "swapping the chunk at {:#x} failed with CUresult {}",
            self.address, self.result
        )
    }
}

impl std::error::Error for SwapError {}

/// What became of one chunk of a batch moved out ([`Backing::swap_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutResult {
    /// In host staging, unmapped and released; the range stays reserved.
    Moved,
    /// The staging budget (the node's `swap_host_memory`) had no room: it stays resident.
    StagingRefused,
    /// A driver step failed: it stays resident with its contents.
    Failed(SwapError),
}

/// Where a batch moved out spent its time, for the swap-out's log line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SwapTimes {
    /// Time spent pinning fresh host staging (`cuMemHostAlloc`); 0 when the pool served.
    pub pinning_ns: u64,
    /// Bytes of fresh staging pinned.
    pub pinned_bytes: u64,
    /// Time spent waiting for staging the watcher was pinning ahead (`staging::acquire`).
    pub staging_wait_ns: u64,
    /// From the first copy queued to the last one seen complete (the pinning of a batch's later
    /// chunks runs meanwhile, so a rate from it is a lower bound when staging was pinned).
    pub copy_ns: u64,
    /// Bytes the completed copies moved.
    pub copied_bytes: u64,
}

/// Where a swap-in's time went (the real backing's; the tests' model reports none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InTimes {
    /// Creating the physical memory again, mapping it at its address and queueing the copies
    /// (the copies of the first chunks run meanwhile).
    pub mapping_ns: u64,
    /// Waiting for the copies after the first batch was queued (the chunks whose room freed
    /// meanwhile mapped and queued within it).
    pub copies_ns: u64,
}

impl SwapTimes {
    fn add(&mut self, other: SwapTimes) {
        self.pinning_ns += other.pinning_ns;
        self.pinned_bytes += other.pinned_bytes;
        self.staging_wait_ns += other.staging_wait_ns;
        self.copy_ns += other.copy_ns;
        self.copied_bytes += other.copied_bytes;
    }

    /// The copies' rate in GB/s (0 when nothing was copied or no time was measured).
    pub fn copy_gb_per_s(&self) -> f64 {
        if self.copy_ns == 0 {
            return 0.0;
        }
        self.copied_bytes as f64 / self.copy_ns as f64
    }
}

/// The driver side of moving chunks out and back in, a batch at a time so that the copies of
/// several chunks are queued back to back. The backing owns the staging: it reserves it on the
/// board through the counters before it pins any (a buffer it kept may serve without a new
/// reservation, `staging`), and releases it when it frees it.
pub trait Backing {
    /// Copies each chunk's `(address, size)` bytes to host staging, then (once its copy
    /// completed) unmaps and releases its physical memory; the address range stays reserved.
    /// One result per chunk, in order; a chunk not [`OutResult::Moved`] is as it was. With
    /// `count_every` (`Some(piece)`), the moved chunks' room is counted free on the board
    /// ([`Counters::swapped_out`]) as their copies complete, whenever at least `piece` bytes
    /// landed uncounted, and the rest before it returns: the caller counts none of them again.
    fn swap_out(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut impl Counters,
        count_every: Option<u64>,
    ) -> (Vec<OutResult>, SwapTimes);
    /// Creates physical memory for each chunk, maps it at its address again and copies the
    /// staging back; a chunk is back (`Ok`) only once its copy completed. On an error the chunk is
    /// still out, its staging kept. While it waits for the copies it may ask `more` for chunks
    /// whose room freed meanwhile (their bytes already taken on the board) and queue them behind
    /// the others: the results are for `chunks`, then for what `more` gave, in order.
    fn swap_in<C: Counters>(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut C,
        more: &mut dyn FnMut(&mut C) -> Vec<(u64, u64)>,
    ) -> (Vec<Result<(), SwapError>>, InTimes);
    /// Frees the staging it kept that has idled too long on `device` (nothing by default).
    fn trim(&mut self, _device: usize, _counters: &mut impl Counters) {}
    /// Pins staging ahead for resident chunks of `device` (`chunks`: sizes, largest first),
    /// within `cap` bytes; the bytes pinned (nothing by default).
    fn warm(
        &mut self,
        _device: usize,
        _chunks: &[u64],
        _cap: u64,
        _counters: &mut impl Counters,
    ) -> u64 {
        0
    }
    /// What the driver says is free now on the device of the chunk at `address`, if it can
    /// tell (`None`: unknown, for example the current context is on another device). The board
    /// runs ahead of the driver: a process that exited is off the board before the driver has
    /// released its memory.
    fn driver_free(&mut self, _address: u64) -> Option<u64> {
        None
    }
    /// Frees the idle staging this process keeps for reuse on `device` (nothing by default).
    fn release_idle(&mut self, _device: usize, _counters: &mut impl Counters) {}
}

/// The board's counters of this process's slot.
pub trait Counters {
    /// `bytes` went to host memory: no longer resident, still held.
    fn swapped_out(&mut self, bytes: u64);
    /// Whether the GPU has room for `bytes` more of this process now (a look, nothing taken):
    /// `take_back` brings chunks back only when all of them fit.
    fn room_for(&mut self, bytes: u64) -> bool;
    /// Makes `bytes` resident again if the GPU has room (`Board::swap_in`); `false` if not.
    fn swap_in(&mut self, bytes: u64) -> bool;
    /// Undoes a `swap_in` whose driver work failed: the bytes are out again.
    fn swap_in_failed(&mut self, bytes: u64);
    /// Reserves `bytes` of pinned host staging before the backing pins it, within the node's
    /// swap staging budget (`Board::reserve_staging`); `false`: the chunk must stay resident.
    fn reserve_staging(&mut self, bytes: u64) -> bool;
    /// Gives back `bytes` of staging: the backing freed that much pinned memory (the real
    /// driver's keeps buffers for reuse, `staging`; the tests' model frees one per chunk back).
    fn release_staging(&mut self, bytes: u64);
    /// The bytes of a piece whose room a swap-out may count free as soon as it is out
    /// ([`PIECE_BYTES`] for the real board), so that a process waiting for its own chunks brings
    /// them back meanwhile ([`Chunks::give_back`]); `None`: the room is counted at the end of the
    /// round, as while a tenant waits for a reclaim within its request (its allocations would
    /// take the first pieces' room and ask again for the rest, which is on its way).
    fn piece(&mut self) -> Option<u64> {
        None
    }
    /// Whether this process is the one the GPU's line serves now: it may bring its chunks back
    /// a piece at a time as room frees ([`Chunks::take_back`]).
    fn first_in_line(&mut self) -> bool {
        false
    }
    /// Asks the GPU's other processes for the staging they keep idle, then waits, bounded
    /// ([`STAGING_WAIT`]), until the staging budget has `bytes` left; whether it has.
    fn wait_for_staging(&mut self, _bytes: u64) -> bool {
        false
    }
    /// Whether the staging budget has `bytes` left beside what is reserved now (a look, nothing
    /// taken): a buffer of the process's own beside the GPU's shared staging file asks it for
    /// the file's unclaimed slabs ([`crate::staging`]).
    fn staging_left_for(&mut self, _bytes: u64) -> bool {
        true
    }
    /// Whether the staging budget has less than a piece left: the process taking its chunks
    /// back piece by piece then frees the staging they emptied, for the giver's next pieces.
    fn staging_short(&mut self) -> bool {
        false
    }
}

/// What a [`Chunks::give_back`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GivenBack {
    /// Bytes that went to host memory.
    pub bytes: u64,
    /// Bytes that would have gone but stayed resident because the staging budget (the node's
    /// `swap_host_memory`) was spent.
    pub refused_for_staging: u64,
    /// Where the time went.
    pub times: SwapTimes,
}

/// One borrowed chunk of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub size: u64,
    /// In host staging, unmapped.
    pub out: bool,
    /// The application said it is cold (`vgpu_memory_cold`: an engine's offloaded experts, a
    /// cache it will not read soon): it goes first when memory is asked back.
    pub cold: bool,
}

/// The most a swap-out moves before it counts the room free, when pieces count
/// ([`Counters::piece`]): at the 45-55 GB/s of a host link a piece takes about
/// 20 ms, against well under a millisecond to wait for its copies and unmap it; a process taking
/// its chunks back starts after the first piece, so an exchange takes about one piece longer than
/// its larger direction instead of the sum of both.
pub const PIECE_BYTES: u64 = 1 << 30;

/// How long [`Chunks::take_back`] waits for the driver to have free what the board says is free
/// (an exiting process's memory is released a little after it is off the board) before it tries
/// anyway; a chunk the driver then has no memory for stays out and is tried again.
pub const DRIVER_LAG_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a swap-out waits for staging to free when the budget refused it
/// ([`Counters::wait_for_staging`]): the other processes' watchers look every 10 ms and unpin
/// their idle staging, and the other side of an exchange frees what its swap-ins emptied within a
/// piece's time (about 20 ms) plus its unpinning.
pub const STAGING_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A bringing back in pieces under way ([`Chunks::take_back`]), for its one log line at the end.
#[derive(Debug, Clone, Copy)]
struct Pieces {
    began: std::time::Instant,
    bytes: u64,
    rounds: u32,
    mapping_ns: u64,
    copies_ns: u64,
}

/// This process's swappable chunks, by address.
#[derive(Debug, Default)]
pub struct Chunks {
    chunks: BTreeMap<u64, Chunk>,
    /// Since when the board has had room that the driver did not have free.
    driver_behind_since: Option<std::time::Instant>,
    /// Chunks coming back a piece at a time.
    pieces: Option<Pieces>,
}

impl Chunks {
    /// A new borrowed chunk, resident.
    pub fn add(&mut self, address: u64, size: u64) {
        assert!(size > 0, "a chunk has bytes");
        let replaced = self.chunks.insert(
            address,
            Chunk {
                size,
                out: false,
                cold: false,
            },
        );
        assert!(replaced.is_none(), "chunk {address:#x} added twice");
    }

    /// The chunk at `address` was freed; what it was (the caller credits it resident or out).
    pub fn remove(&mut self, address: u64) -> Option<Chunk> {
        self.chunks.remove(&address)
    }

    /// Whether a chunk is out: launches and copies must wait.
    pub fn held(&self) -> bool {
        self.chunks.values().any(|c| c.out)
    }

    /// Bytes out now.
    pub fn out_bytes(&self) -> u64 {
        self.chunks.values().filter(|c| c.out).map(|c| c.size).sum()
    }

    /// Whether chunks are coming back piece by piece ([`Chunks::take_back`]): the next piece
    /// is worth looking for often.
    pub fn coming_back(&self) -> bool {
        self.pieces.is_some()
    }

    /// Whether a chunk is resident: something a want could be met with.
    pub fn any_resident(&self) -> bool {
        self.chunks.values().any(|c| !c.out)
    }

    /// Marks the chunks that overlap `[start, start + len)` cold (`true`: given back first) or
    /// not; returns their bytes (0: no borrowed chunk there, for example memory within the
    /// request, which is never swapped).
    pub fn mark_cold(&mut self, start: u64, len: u64, cold: bool) -> u64 {
        let end = start.saturating_add(len.max(1));
        let mut marked = 0;
        // A chunk that begins before `start` may reach into the range: from the last one that
        // begins at or before it.
        let first = self
            .chunks
            .range(..=start)
            .next_back()
            .map_or(start, |(&address, _)| address);
        for (&address, chunk) in self.chunks.range_mut(first..end) {
            if address.saturating_add(chunk.size) > start {
                chunk.cold = cold;
                marked += chunk.size;
            }
        }
        marked
    }

    /// The sizes of the resident chunks in the order [`Chunks::give_back`] takes them (the
    /// cold ones first, then largest first, then by address).
    pub fn resident_in_giving_order(&self) -> Vec<u64> {
        self.giving_order()
            .into_iter()
            .map(|(_, size)| size)
            .collect()
    }

    fn giving_order(&self) -> Vec<(u64, u64)> {
        let mut order: Vec<(u64, u64, bool)> = self
            .chunks
            .iter()
            .filter(|(_, c)| !c.out)
            .map(|(&address, c)| (address, c.size, c.cold))
            .collect();
        order.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.cmp(&a.1)).then(a.0.cmp(&b.0)));
        order
            .into_iter()
            .map(|(address, size, _)| (address, size))
            .collect()
    }

    /// Bytes resident now.
    #[cfg(test)]
    pub fn resident_bytes(&self) -> u64 {
        self.chunks
            .values()
            .filter(|c| !c.out)
            .map(|c| c.size)
            .sum()
    }

    /// Gives back at least `want` bytes if it has them: resident chunks go out largest first
    /// (fewest copies), as many as cover `want` in one batch (their copies queued back to back),
    /// then more batches while some did not go. A chunk the driver could not move, or for which
    /// the staging budget has no room, stays and the next is tried. When pieces count
    /// ([`Counters::piece`]) the backing counts the room free a piece at a time as the copies
    /// land (the copy engine never idles between pieces); otherwise at the end of the round.
    pub fn give_back(
        &mut self,
        want: u64,
        backing: &mut impl Backing,
        counters: &mut impl Counters,
    ) -> GivenBack {
        let mut order = self.giving_order();
        let piece = counters.piece();
        let mut staging_waited = false;
        let mut moved_at: Vec<u64> = Vec::new();
        let mut given = 0u64;
        let mut refused_for_staging = 0u64;
        let mut times = SwapTimes::default();
        let mut next = 0;
        while given < want && next < order.len() {
            let mut batch = Vec::new();
            let mut planned = 0u64;
            while given + planned < want && next < order.len() {
                batch.push(order[next]);
                planned += order[next].1;
                next += 1;
            }
            let (results, batch_times) = backing.swap_out(&batch, counters, piece);
            assert_eq!(results.len(), batch.len(), "one result per chunk");
            times.add(batch_times);
            let mut refused_now = 0u64;
            for (&(address, size), result) in batch.iter().zip(results) {
                match result {
                    OutResult::Moved => {
                        self.chunks.get_mut(&address).expect("listed above").out = true;
                        given += size;
                        moved_at.push(address);
                    }
                    OutResult::StagingRefused => refused_now += size,
                    OutResult::Failed(e) => {
                        crate::log::error(format_args!("{e}; it stays resident"));
                    }
                }
            }
            // Short of staging: the GPU's other processes free what they keep idle, and in
            // pieces the one taking the room back frees what its swap-ins emptied
            // (`Backing::release_idle`): wait for it, once, bounded, and go on with the chunks
            // still resident.
            if refused_now > 0 && given < want && !staging_waited {
                staging_waited = true;
                let smallest = batch.iter().map(|&(_, size)| size).min().unwrap_or(0);
                if counters.wait_for_staging(smallest) {
                    order = self.giving_order();
                    next = 0;
                    continue;
                }
            }
            refused_for_staging += refused_now;
        }
        // Without pieces, counted out on the board once the round is over, not chunk by chunk:
        // a tenant waiting within its request for the room then sees all of it at once. Chunk by
        // chunk, its next allocations took the first chunks' room while the rest was still on
        // its way, found the GPU full again and asked the borrower a second time (two rounds for
        // one request in the dry run).
        // (In pieces the backing counted each piece as it landed.)
        if piece.is_none() && given > 0 {
            counters.swapped_out(given);
        }
        if given > 0 {
            // Which chunks went (for a check that cold ones go first: tests/gpu, `COLD=1`).
            let shown: Vec<String> = moved_at.iter().map(|a| format!("{a:#x}")).collect();
            crate::log::debug(format_args!("chunks out: {}", shown.join(" ")));
        }
        assert!(given <= self.out_bytes());
        GivenBack {
            bytes: given,
            refused_for_staging: if given >= want {
                0
            } else {
                refused_for_staging
            },
            times,
        }
    }

    /// Brings every chunk back when the GPU has room for all of them, in address order, in one
    /// batch; returns whether none is out any more. A process held for one chunk gains nothing
    /// from the others, and room taken piecemeal is room another waiter lacks, with one
    /// exception: the process the GPU's line serves ([`Counters::first_in_line`]: the room that
    /// frees is its own) brings back what fits as it frees, so that its swap-in runs while
    /// another process's swap-out makes the room (both directions of the host link at once).
    /// Nothing starts while the driver has less free than the board says, for at most
    /// [`DRIVER_LAG_MAX`].
    pub fn take_back(&mut self, backing: &mut impl Backing, counters: &mut impl Counters) -> bool {
        let out: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|(_, c)| c.out)
            .map(|(&address, c)| (address, c.size))
            .collect();
        if out.is_empty() {
            self.pieces = None;
            return true;
        }
        let total: u64 = out.iter().map(|&(_, size)| size).sum();
        let all_fit = counters.room_for(total);
        let plan: Vec<(u64, u64)> = if all_fit {
            out
        } else if counters.first_in_line() {
            let mut planned = 0u64;
            out.into_iter()
                .filter(|&(_, size)| {
                    let fits = counters.room_for(planned + size);
                    if fits {
                        planned += size;
                    }
                    fits
                })
                .collect()
        } else {
            return false;
        };
        let Some(&(first, _)) = plan.first() else {
            return false;
        };
        let need: u64 = plan.iter().map(|&(_, size)| size).sum();
        if backing.driver_free(first).is_some_and(|free| free < need) {
            let since = *self
                .driver_behind_since
                .get_or_insert_with(std::time::Instant::now);
            if since.elapsed() < DRIVER_LAG_MAX {
                return false;
            }
            crate::log::error(format_args!(
                "the GPU's board has had room for {} of this process's borrowed memory for {} ms, \
                 but the driver still has less free (memory outside vgpu's accounting, or a \
                 process's memory not yet released): bringing it back anyway",
                crate::elastic::human(need),
                DRIVER_LAG_MAX.as_millis()
            ));
        }
        self.driver_behind_since = None;
        let mut batch = Vec::new();
        for &(address, size) in &plan {
            if !counters.swap_in(size) {
                break;
            }
            batch.push((address, size));
        }
        if batch.is_empty() {
            return false;
        }
        // In pieces (not all of it fitted), the chunks whose room the giver frees while this
        // batch copies join it (`more`): the copy engine never waits for this process to return,
        // look again and map the next piece. (On an H200 that left the taker's rate where it
        // was, 42.8 GB/s beside a giver's 51.8: what slows it is elsewhere, docs/benchmarks.md.)
        let mut rest: Vec<(u64, u64)> = if !all_fit {
            self.chunks
                .iter()
                .filter(|(address, c)| c.out && !batch.iter().any(|&(a, _)| a == **address))
                .map(|(&address, c)| (address, c.size))
                .collect()
        } else {
            Vec::new()
        };
        let mut joined: Vec<(u64, u64)> = Vec::new();
        let began = std::time::Instant::now();
        let (results, times) = backing.swap_in(&batch, counters, &mut |counters| {
            let mut next = Vec::new();
            rest.retain(|&(address, size)| {
                let taken = counters.swap_in(size);
                if taken {
                    next.push((address, size));
                }
                !taken
            });
            joined.extend_from_slice(&next);
            next
        });
        let joined_count = joined.len();
        batch.extend(joined);
        let took = began.elapsed();
        assert_eq!(results.len(), batch.len(), "one result per chunk");
        let mut back = 0u64;
        for (&(address, size), result) in batch.iter().zip(results) {
            match result {
                Ok(()) => {
                    self.chunks.get_mut(&address).expect("listed above").out = false;
                    back += size;
                }
                Err(e) => {
                    counters.swap_in_failed(size);
                    crate::log::error(format_args!("{e}; it stays in host memory"));
                }
            }
        }
        let done = !self.held();
        let whole_round = done && self.pieces.is_none();
        if back > 0 && whole_round {
            let how = if joined_count > 0 {
                format!(
                    "{} chunk(s), {joined_count} of them joining as the room freed",
                    batch.len()
                )
            } else {
                format!("{} chunk(s)", batch.len())
            };
            log_back(back, took, &how, times);
        } else if back > 0 || self.pieces.is_some() {
            let pieces = self.pieces.get_or_insert(Pieces {
                began,
                bytes: 0,
                rounds: 0,
                mapping_ns: 0,
                copies_ns: 0,
            });
            pieces.bytes += back;
            pieces.rounds += 1;
            pieces.mapping_ns += times.mapping_ns;
            pieces.copies_ns += times.copies_ns;
            crate::log::debug(format_args!(
                "a piece of {} came back in {:.1} ms ({} still out)",
                crate::elastic::human(back),
                took.as_secs_f64() * 1e3,
                crate::elastic::human(self.out_bytes())
            ));
            if done {
                let pieces = self.pieces.take().expect("set above");
                log_back(
                    pieces.bytes,
                    pieces.began.elapsed(),
                    &format!("in {} pieces as the room freed", pieces.rounds),
                    InTimes {
                        mapping_ns: pieces.mapping_ns,
                        copies_ns: pieces.copies_ns,
                    },
                );
            }
        }
        done
    }
}

/// The line of a swap-in that brought everything back, `how` (one batch of chunks, or pieces
/// as the room freed: then `took` runs from the first piece's start to the last's end).
fn log_back(back: u64, took: std::time::Duration, how: &str, times: InTimes) {
    let seconds = took.as_secs_f64();
    crate::log::error(format_args!(
        "{} of this process's borrowed memory came back from host memory in {:.1} ms \
         (mapped and copied at {:.1} GB/s: {how}, creating, mapping and queueing {:.1} ms, then \
         waiting for the copies {:.1} ms); its launches and copies go on",
        crate::elastic::human(back),
        seconds * 1e3,
        if seconds > 0.0 {
            back as f64 / seconds / 1e9
        } else {
            0.0
        },
        times.mapping_ns as f64 / 1e6,
        times.copies_ns as f64 / 1e6
    ));
}

/// The longest a swap-out waits for the launches and copies other threads are submitting to
/// reach the driver ([`quiesce`]); past it the swap-out is given up (the want stays posted).
pub const QUIESCE_WAIT_MAX_MS: u64 = 2_000;

/// The longest a swap-out waits for the process's queued work (`cuCtxSynchronize`) before it
/// gives up: a kernel that never ends keeps its chunks (logged; the want stays posted).
pub const DRAIN_WAIT_MAX_MS: u64 = 5_000;

/// Swappable chunks of this process (resident or out), all devices: 0 in every process that never
/// borrowed with the swap on, which is what the launch and copy paths' fast path reads.
static CHUNKS: AtomicUsize = AtomicUsize::new(0);
/// Chunks of this process in host memory now.
static CHUNKS_OUT: AtomicUsize = AtomicUsize::new(0);
/// The devices (bit per CUDA ordinal) where this process has a resident chunk: where a want on
/// its tenant can be met, so where a launch looks for one.
static RESIDENT_ON: AtomicU32 = AtomicU32::new(0);
/// Launches and copies between their check ([`try_enter`]) and the end of their driver call.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// A swap-out is under way: no launch or copy may enter.
static SWAPPING: AtomicBool = AtomicBool::new(false);

/// Whether this process has any swappable chunk: the launch and copy paths' fast path, one
/// relaxed load. A process that never borrowed (or runs without the swap) stops here.
#[inline]
pub fn any_chunk() -> bool {
    CHUNKS.load(Ordering::Relaxed) != 0
}

/// Whether a chunk of this process is in host memory now.
pub fn any_out() -> bool {
    CHUNKS_OUT.load(Ordering::SeqCst) != 0
}

/// The devices where this process has a resident chunk (bit per ordinal).
pub fn resident_on() -> u32 {
    RESIDENT_ON.load(Ordering::SeqCst)
}

/// Publishes this process's chunks (`per_device[d]` is device `d`'s) to the counters above;
/// called, under the process's lock, after every change of a chunk's state.
pub fn publish(per_device: &[Chunks]) {
    assert!(per_device.len() <= 32, "one bit per device");
    let (mut all, mut out, mut resident_on) = (0usize, 0usize, 0u32);
    for (device, chunks) in per_device.iter().enumerate() {
        all += chunks.chunks.len();
        out += chunks.chunks.values().filter(|c| c.out).count();
        if chunks.any_resident() {
            resident_on |= 1 << device;
        }
    }
    assert!(out <= all);
    // Out first, so that a launch that sees the chunk count sees what is out too.
    CHUNKS_OUT.store(out, Ordering::SeqCst);
    RESIDENT_ON.store(resident_on, Ordering::SeqCst);
    CHUNKS.store(all, Ordering::SeqCst);
    PUBLISHED_BY.store(std::process::id(), Ordering::SeqCst);
}

/// Forgets every count (a child after `fork` holds none of its parent's chunks, and none of its
/// parent's launches are in flight in it); `hooks` calls it when it resets the process state.
pub fn forked() {
    CHUNKS.store(0, Ordering::SeqCst);
    CHUNKS_OUT.store(0, Ordering::SeqCst);
    RESIDENT_ON.store(0, Ordering::SeqCst);
    IN_FLIGHT.store(0, Ordering::SeqCst);
    SWAPPING.store(false, Ordering::SeqCst);
    PUBLISHED_BY.store(std::process::id(), Ordering::SeqCst);
}

/// The process that last published the counts: another one is a child after `fork`.
static PUBLISHED_BY: AtomicU32 = AtomicU32::new(0);

/// Whether the counts were published by another process (this one is a child after `fork`).
pub fn inherited() -> bool {
    PUBLISHED_BY.load(Ordering::SeqCst) != std::process::id()
}

/// A launch or copy admitted by [`try_enter`]: counted until its driver call returned (drop).
#[must_use]
pub struct InFlight {
    counted: bool,
}

impl InFlight {
    /// Nothing counted: the fast path (no swappable chunk), or the swap not involved.
    pub fn uncounted() -> InFlight {
        InFlight { counted: false }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.counted {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A launch or copy of a process with swappable chunks: admitted (counted in flight) when no
/// chunk is out, no swap-out is under way and `no_want` says nobody asked for memory back;
/// `None`: the caller must act (`hooks::enter_work`) and try again. Counting before looking
/// closes the race with [`quiesce`]: a swap-out either sees this call in flight and waits for it,
/// or this call sees the swap-out and does not enter.
pub fn try_enter(no_want: impl FnOnce() -> bool) -> Option<InFlight> {
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    let entered = InFlight { counted: true };
    if !SWAPPING.load(Ordering::SeqCst) && !any_out() && no_want() {
        return Some(entered);
    }
    drop(entered);
    None
}

/// A swap-out under way: no launch or copy enters until it is dropped.
#[must_use]
pub struct Quiet {
    _private: (),
}

impl Drop for Quiet {
    fn drop(&mut self) {
        SWAPPING.store(false, Ordering::SeqCst);
    }
}

/// Stops new launches and copies from entering and waits (bounded by [`QUIESCE_WAIT_MAX_MS`])
/// for those in flight to have reached the driver; `None` (and nothing stopped) when they did not
/// in time. Called under the process's lock, by a thread that is not in flight itself.
pub fn quiesce() -> Option<Quiet> {
    let was = SWAPPING.swap(true, Ordering::SeqCst);
    assert!(!was, "one swap-out at a time (under the process's lock)");
    let quiet = Quiet { _private: () };
    let began = std::time::Instant::now();
    while IN_FLIGHT.load(Ordering::SeqCst) != 0 {
        if began.elapsed() >= std::time::Duration::from_millis(QUIESCE_WAIT_MAX_MS) {
            crate::log::error(format_args!(
                "a swap-out waited {QUIESCE_WAIT_MAX_MS} ms for this process's launches and \
                 copies in progress to reach the driver; it is given up for now"
            ));
            return None;
        }
        std::thread::yield_now();
    }
    Some(quiet)
}

/// The copy and memset entry points of the driver API that the interposer does not hold (no hook
/// of ours waits for chunks to come back before them). A driver that exports any of them could
/// let a kernel or copy touch a chunk in host memory, so the swap stays off in a process whose
/// driver does (`real::load` checks at load; `copy_paths_checked`).
pub const UNHELD_COPY_ENTRY_POINTS: &[&std::ffi::CStr] = &[
    // Copies with attributes, which a newer driver may export: not wrapped (no header here to
    // check their signatures against, nor whether they exist), so a driver that exports them
    // keeps the swap off.
    c"cuMemcpyWithAttributesAsync",
    c"cuMemcpyWithAttributesAsync_ptsz",
    c"cuMemcpy3DWithAttributesAsync",
    c"cuMemcpy3DWithAttributesAsync_ptsz",
];

/// What the load-time check found: the unheld entry points this process's driver exports.
static UNHELD_EXPORTED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// How the environment sets the swap (`VGPU_MEMORY_SWAP`): on unless it says `0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// Unset (or another value than `0` and `1`): on.
    Default,
    /// `1`.
    On,
    /// `0`.
    Off,
}

impl Asked {
    /// This process's setting.
    pub fn from_env() -> Asked {
        Asked::from_value(std::env::var_os(tenant_abi::env::var::MEMORY_SWAP).as_deref())
    }

    fn from_value(value: Option<&std::ffi::OsStr>) -> Asked {
        match value.and_then(|v| v.to_str()) {
            Some("0") => Asked::Off,
            Some("1") => Asked::On,
            _ => Asked::Default,
        }
    }

    /// Whether the swap is asked for (anything but `0`).
    pub fn on(self) -> bool {
        self != Asked::Off
    }
}

/// Records, once at load (`real::load`), which of [`UNHELD_COPY_ENTRY_POINTS`] the driver
/// exports, and says in one line (an error if the swap was asked for with `1`, a debug line if
/// it is on by default) that the swap stays off.
pub fn copy_paths_checked(exported: Vec<String>, asked: Asked) {
    if asked.on() && !exported.is_empty() {
        let shown: Vec<&str> = exported.iter().take(6).map(String::as_str).collect();
        let line = format!(
            "the swap ({}) is off in this process: the driver exports {} copy, memset or launch \
             entry points that vgpu does not hold while borrowed memory is in host memory ({}{}), \
             so borrowed memory is given back only when it is freed; this driver needs them \
             hooked before the swap can be on",
            tenant_abi::env::var::MEMORY_SWAP,
            exported.len(),
            shown.join(", "),
            if exported.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
        if asked == Asked::On {
            crate::log::error(format_args!("{line}"));
        } else {
            crate::log::debug(format_args!("{line}"));
        }
    }
    let _ = UNHELD_EXPORTED.set(exported);
}

/// Whether every copy path of this process's driver is held (the load-time check ran and found
/// none unheld): the swap may be on. `false` before the driver is loaded.
pub fn copy_paths_held() -> bool {
    UNHELD_EXPORTED.get().is_some_and(Vec::is_empty)
}

#[cfg(test)]
#[path = "swap_test.rs"]
mod tests;
