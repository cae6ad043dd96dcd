//! The slab table of a GPU's shared swap staging (issue 17; docs/design/elastic-memory.md, "Next:
//! one staging pool per GPU"): the `#[repr(C)]` header of a file of pinned host memory that every
//! process of the GPU maps and registers once, cut into slabs that a swap-out claims and a
//! swap-in frees. A chunk's staging is a list of slabs, not one buffer, so the pool never
//! fragments; 64 MiB copies run at the host link's rate (`tests/gpu/shared_staging.py`). The agent creates the file (`crate::shm::create_staging`),
//! the interposer claims runs of slabs in it.
//!
//! **Protocol.** Each slab has an owner word: 0 free, else the claimer's token (non-zero, chosen
//! by the caller: a board slot and its process's start, so that a slot reused by a new process is
//! a new owner). A claim is a compare-and-swap from 0, a release one back to 0 from the owner's
//! token; nothing is locked, so a process killed at any instruction leaves at worst slabs owned
//! by a dead token, which [`SlabTable::reclaim`] frees (the board's dead-slot reclaim calls it).
//! Claims start at a point that moves with every claim, so that concurrent claimers rarely meet.
//!
//! Pure: no FFI, no clock; tested here with threads.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The layout version, in the header's first word. Version 2 gave the padding word its meaning
/// ([`SlabTable::allocated`]).
pub const VERSION: u32 = 2;
/// Slabs a table holds at most (64 KiB of owner words).
pub const SLABS_MAX: usize = 8192;
/// The smallest slab: copies of 64 MiB run at the H200's host-link rate, and a chunk of the
/// interposer's is never smaller.
pub const SLAB_BYTES_MIN: u64 = 64 << 20;
/// Slab sizes are multiples of this (huge pages).
pub const SLAB_ALIGN: u64 = 2 << 20;

/// The header of a shared staging file; the slabs follow it, at [`SlabTable::data_offset`].
#[repr(C)]
#[derive(Debug)]
pub struct SlabTable {
    pub version: AtomicU32,
    /// Non-zero once the agent allocated every page of the file ([`SlabTable::mark_allocated`]):
    /// processes register it only then. Registering pages not allocated yet faults them in the
    /// registering process, against the agent's allocation of the same file: on an H200, three
    /// jobs that began registering an 84 GiB file while it was allocated waited 14-46 s for it,
    /// all ending in the same millisecond, where three busy processes registering an allocated
    /// 32 GiB file at once took 4 s each (docs/benchmarks.md).
    pub allocated: AtomicU32,
    /// Bytes per slab (0 until the agent initialised the table).
    pub slab_bytes: AtomicU64,
    /// Slabs in use of `owners`.
    pub count: AtomicU64,
    /// Where the next claim starts looking (wraps): spreads concurrent claimers.
    pub hint: AtomicU64,
    pub owners: [AtomicU64; SLABS_MAX],
}

/// Why a table cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlabError {
    #[error(
        "the swap staging file has layout version {found}, this process knows {VERSION}: \
         upgrade the node agent and the interposer together"
    )]
    Version { found: u32 },
    #[error("the swap staging file is not initialised yet (the node agent writes it at start)")]
    Uninitialised,
    #[error(
        "slab {index} is not owned by this process (owner {owner:#x}): a release of staging it never claimed"
    )]
    NotOwner { index: usize, owner: u64 },
}

/// The slab size for a GPU's staging budget: at least [`SLAB_BYTES_MIN`], large enough that the
/// budget fits [`SLABS_MAX`] slabs, a multiple of [`SLAB_ALIGN`].
pub fn slab_bytes_for(budget_bytes: u64) -> u64 {
    let per = budget_bytes.div_ceil(SLABS_MAX as u64);
    per.max(SLAB_BYTES_MIN).div_ceil(SLAB_ALIGN) * SLAB_ALIGN
}

/// The owner token of the process in board slot `slot` (`crate::board::SLOTS` of them) with
/// `pid`: the slot says where to look, the pid whether the slot still belongs to that process
/// ([`token_owner`]; a slot reused by another process is another owner).
pub fn owner_token(slot: usize, pid: u32) -> u64 {
    assert!(slot < 0xffff, "slot {slot}");
    (u64::from(pid) << 32) | (slot as u64 + 1)
}

/// The board slot and pid of an owner token ([`owner_token`]); `None` for a token no slot made.
pub fn token_owner(token: u64) -> Option<(usize, u32)> {
    let slot = (token & 0xffff) as usize;
    (slot != 0 && token >> 16 & 0xffff == 0).then(|| (slot - 1, (token >> 32) as u32))
}

impl SlabTable {
    /// A zeroed table on the heap (tests, and the agent before it writes the file).
    pub fn new_boxed() -> Box<SlabTable> {
        Box::new(SlabTable {
            version: AtomicU32::new(0),
            allocated: AtomicU32::new(0),
            slab_bytes: AtomicU64::new(0),
            count: AtomicU64::new(0),
            hint: AtomicU64::new(0),
            owners: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// Where the slabs start in the file: the header rounded up to [`SLAB_ALIGN`].
    pub const fn data_offset() -> u64 {
        (std::mem::size_of::<SlabTable>() as u64).div_ceil(SLAB_ALIGN) * SLAB_ALIGN
    }

    /// The agent's first write: a table of the slabs that `budget_bytes` holds, every one free.
    /// Returns the slab size. Only on a table no process uses yet (a new file).
    pub fn initialise(&self, budget_bytes: u64) -> u64 {
        let slab = slab_bytes_for(budget_bytes);
        let count = (budget_bytes / slab).min(SLABS_MAX as u64);
        for owner in &self.owners {
            owner.store(0, Ordering::Relaxed);
        }
        self.slab_bytes.store(slab, Ordering::Relaxed);
        self.count.store(count, Ordering::Relaxed);
        self.hint.store(0, Ordering::Relaxed);
        self.allocated.store(0, Ordering::Relaxed);
        self.version.store(VERSION, Ordering::Release);
        slab
    }

    /// The agent's word once every page of the file is allocated (`crate::shm::allocate_staging`).
    pub fn mark_allocated(&self) {
        self.allocated.store(1, Ordering::Release);
    }

    /// Whether the file's pages are all allocated: registering it is worth starting.
    pub fn is_allocated(&self) -> bool {
        self.allocated.load(Ordering::Acquire) != 0
    }

    /// The table's slab size and count, once it is initialised and of this version.
    pub fn geometry(&self) -> Result<(u64, usize), SlabError> {
        match self.version.load(Ordering::Acquire) {
            0 => Err(SlabError::Uninitialised),
            VERSION => Ok((
                self.slab_bytes.load(Ordering::Relaxed),
                (self.count.load(Ordering::Relaxed) as usize).min(SLABS_MAX),
            )),
            found => Err(SlabError::Version { found }),
        }
    }

    fn slabs(&self) -> &[AtomicU64] {
        let count = (self.count.load(Ordering::Relaxed) as usize).min(SLABS_MAX);
        &self.owners[..count]
    }

    /// Claims up to `wanted` free slabs for `owner` (non-zero), wherever they are; returns their
    /// indices, fewer when fewer are free (the caller lands what it can, or releases them).
    pub fn claim(&self, owner: u64, wanted: usize) -> Vec<usize> {
        assert_ne!(owner, 0, "an owner token is non-zero");
        let slabs = self.slabs();
        let mut claimed = Vec::with_capacity(wanted.min(slabs.len()));
        if slabs.is_empty() || wanted == 0 {
            return claimed;
        }
        let start = self.hint.fetch_add(wanted as u64, Ordering::Relaxed) as usize % slabs.len();
        for step in 0..slabs.len() {
            if claimed.len() == wanted {
                break;
            }
            let index = (start + step) % slabs.len();
            if slabs[index]
                .compare_exchange(0, owner, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                claimed.push(index);
            }
        }
        claimed
    }

    /// Frees `indices`, every one owned by `owner`. A slab owned by someone else is left as it
    /// is and reported (the first one), after the others are freed.
    pub fn release(&self, owner: u64, indices: &[usize]) -> Result<(), SlabError> {
        let slabs = self.slabs();
        let mut first_wrong = None;
        for &index in indices {
            let result = slabs
                .get(index)
                .map(|slab| slab.compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed));
            match result {
                Some(Ok(_)) => {}
                Some(Err(found)) => {
                    first_wrong.get_or_insert(SlabError::NotOwner {
                        index,
                        owner: found,
                    });
                }
                None => {
                    first_wrong.get_or_insert(SlabError::NotOwner { index, owner: 0 });
                }
            }
        }
        first_wrong.map_or(Ok(()), Err)
    }

    /// Claims `count` free slabs in a row for `owner` (non-zero): the first one's index, or
    /// `None` when no run that long is free now (nothing stays claimed). A chunk's staging is
    /// one run, so that it is one contiguous range of the file (its copies go a slab at a time:
    /// each slab is a registration of its own, and a copy may not span two). One pass over the
    /// table; a run that another claimer takes a slab of meanwhile is given back and the search
    /// goes on past that slab.
    ///
    /// Only the first `usable` slabs are looked at (a process claims only slabs it has
    /// registered so far).
    pub fn claim_run(&self, owner: u64, count: usize, usable: usize) -> Option<usize> {
        assert_ne!(owner, 0, "an owner token is non-zero");
        let all = self.slabs();
        let slabs = &all[..usable.min(all.len())];
        if count == 0 || count > slabs.len() {
            return None;
        }
        let start = self.hint.fetch_add(count as u64, Ordering::Relaxed) as usize % slabs.len();
        // Runs never wrap (the file's end is not contiguous with its start): first from `start`
        // to the end, then from 0 up to `start`.
        let (mut first, mut wrapped) = (start, false);
        loop {
            if first + count > slabs.len() {
                if wrapped || start == 0 {
                    return None;
                }
                (first, wrapped) = (0, true);
            }
            if wrapped && first >= start {
                return None;
            }
            let mut taken = 0;
            while taken < count
                && slabs[first + taken]
                    .compare_exchange(0, owner, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                taken += 1;
            }
            if taken == count {
                return Some(first);
            }
            for slab in &slabs[first..first + taken] {
                slab.store(0, Ordering::Release);
            }
            // The slab at `first + taken` is someone's: no run goes through it.
            first += taken + 1;
        }
    }

    /// Frees the run of `count` slabs from `first`, all owned by `owner` ([`SlabTable::claim_run`]).
    pub fn release_run(&self, owner: u64, first: usize, count: usize) -> Result<(), SlabError> {
        let indices: Vec<usize> = (first..first.saturating_add(count)).collect();
        self.release(owner, &indices)
    }

    /// Frees every slab whose owner `is_dead` says is gone; returns how many.
    pub fn reclaim(&self, is_dead: impl Fn(u64) -> bool) -> usize {
        self.slabs()
            .iter()
            .filter(|slab| {
                let owner = slab.load(Ordering::Acquire);
                owner != 0
                    && is_dead(owner)
                    && slab
                        .compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
            })
            .count()
    }

    /// Free slabs now.
    pub fn free(&self) -> usize {
        self.free_among_first(SLABS_MAX)
    }

    /// Free slabs among the first `first` (a process's registered prefix: what its swap-outs may
    /// claim now).
    pub fn free_among_first(&self, first: usize) -> usize {
        let slabs = self.slabs();
        slabs[..first.min(slabs.len())]
            .iter()
            .filter(|slab| slab.load(Ordering::Relaxed) == 0)
            .count()
    }

    /// Slabs `owner` holds now.
    pub fn owned_by(&self, owner: u64) -> usize {
        self.slabs()
            .iter()
            .filter(|slab| slab.load(Ordering::Relaxed) == owner)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn table(slabs: u64) -> Box<SlabTable> {
        let table = SlabTable::new_boxed();
        table.initialise(slabs * 64 * MIB);
        table
    }

    #[test]
    fn a_run_is_contiguous_and_only_where_every_slab_is_free() {
        let t = table(8);
        let a = t.claim_run(1, 3, usize::MAX).expect("8 free");
        assert_eq!(t.owned_by(1), 3);
        let b = t.claim_run(2, 3, usize::MAX).expect("5 free");
        assert!(a + 3 <= b || b + 3 <= a, "{a} {b}");
        // 2 left, maybe not next to each other: a run of 3 is refused and nothing stays claimed.
        assert_eq!(t.claim_run(3, 3, usize::MAX), None);
        assert_eq!(t.owned_by(3), 0);
        assert_eq!(t.free(), 2);
        t.release_run(1, a, 3).unwrap();
        assert_eq!(
            t.release_run(2, a, 1),
            Err(SlabError::NotOwner { index: a, owner: 0 })
        );
        assert_eq!(t.claim_run(4, 9, usize::MAX), None, "longer than the table");
        assert_eq!(t.claim_run(4, 0, usize::MAX), None);
    }

    #[test]
    fn a_run_is_claimed_only_among_the_usable_slabs() {
        let t = table(8);
        assert_eq!(t.claim_run(1, 3, 2), None);
        assert_eq!(t.claim_run(1, 2, 2), Some(0));
        assert_eq!(t.claim_run(1, 1, 2), None);
        assert_eq!(t.claim_run(1, 1, 3), Some(2));
    }

    #[test]
    fn a_run_is_found_between_taken_slabs_whatever_the_hint() {
        for hint in 0..10 {
            let t = table(10);
            // Taken: 0, 4, 5, 9; free runs: 1..4 (3) and 6..9 (3).
            for i in [0, 4, 5, 9] {
                t.owners[i].store(99, Ordering::Relaxed);
            }
            t.hint.store(hint, Ordering::Relaxed);
            let first = t.claim_run(1, 3, usize::MAX).expect("a free run of 3");
            assert!(first == 1 || first == 6, "hint {hint}: {first}");
            assert_eq!(t.claim_run(2, 4, usize::MAX), None, "hint {hint}");
        }
    }

    #[test]
    fn concurrent_runs_never_overlap() {
        let t: std::sync::Arc<SlabTable> = std::sync::Arc::from(table(64));
        let threads: Vec<_> = (1..=8u64)
            .map(|owner| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut held = 0;
                    for round in 0..200 {
                        if let Some(first) = t.claim_run(owner, 1 + (round % 4), usize::MAX) {
                            for i in first..first + 1 + (round % 4) {
                                assert_eq!(t.owners[i].load(Ordering::Acquire), owner);
                            }
                            t.release_run(owner, first, 1 + (round % 4)).unwrap();
                            held += 1;
                        }
                    }
                    held
                })
            })
            .collect();
        let claimed: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(claimed > 0);
        assert_eq!(t.free(), 64);
    }

    #[test]
    fn a_token_names_its_slot_and_pid() {
        let token = owner_token(511, 4_000_000);
        assert_eq!(token_owner(token), Some((511, 4_000_000)));
        assert_eq!(token_owner(owner_token(0, 1)), Some((0, 1)));
        assert_eq!(token_owner(0), None);
        assert_eq!(token_owner(1 << 20), None);
    }

    #[test]
    fn slab_sizes_follow_the_budget() {
        assert_eq!(slab_bytes_for(32 * GIB), 64 * MIB);
        assert_eq!(slab_bytes_for(0), 64 * MIB);
        // 8192 slabs of 64 MiB hold 512 GiB; past that the slabs grow, in whole huge pages.
        assert_eq!(slab_bytes_for(512 * GIB), 64 * MIB);
        assert_eq!(slab_bytes_for(1024 * GIB), 128 * MIB);
        let odd = slab_bytes_for(600 * GIB);
        assert_eq!(odd % SLAB_ALIGN, 0);
        assert!(odd * SLABS_MAX as u64 >= 600 * GIB);
        assert_eq!(SlabTable::data_offset() % SLAB_ALIGN, 0);
        assert!(SlabTable::data_offset() >= std::mem::size_of::<SlabTable>() as u64);
    }

    #[test]
    fn an_uninitialised_or_foreign_table_says_what_to_do() {
        let table = SlabTable::new_boxed();
        assert_eq!(table.geometry(), Err(SlabError::Uninitialised));
        assert!(table.claim(1, 4).is_empty());
        table.version.store(VERSION + 1, Ordering::Release);
        let error = table.geometry().unwrap_err();
        assert!(
            error.to_string().contains("upgrade the node agent"),
            "{error}"
        );
        assert_eq!(table.initialise(32 * GIB), 64 * MIB);
        assert_eq!(table.geometry(), Ok((64 * MIB, 512)));
    }

    #[test]
    fn claims_are_all_or_what_is_free_and_releases_give_them_back() {
        let table = SlabTable::new_boxed();
        table.initialise(GIB); // 16 slabs
        let a = table.claim(1, 10);
        assert_eq!(a.len(), 10);
        let b = table.claim(2, 10);
        assert_eq!(b.len(), 6, "only what is free");
        assert!(a.iter().all(|i| !b.contains(i)));
        assert_eq!(table.free(), 0);
        assert_eq!((table.owned_by(1), table.owned_by(2)), (10, 6));
        assert_eq!(table.free_among_first(100), 0);
        // Someone else's slab is not released, the owner's are.
        let wrong = [a[0], b[0]];
        assert_eq!(
            table.release(2, &wrong),
            Err(SlabError::NotOwner {
                index: a[0],
                owner: 1
            })
        );
        assert_eq!(table.owned_by(2), 5);
        assert!(table.release(1, &a).is_ok());
        assert_eq!(table.free(), 11);
        assert_eq!(table.free_among_first(16), 11);
        assert_eq!(
            table.free_among_first(SLABS_MAX + 1),
            11,
            "past the table: all of it"
        );
        let first_four = (0..4).filter(|i| !b[1..].contains(i)).count();
        assert_eq!(table.free_among_first(4), first_four);
        assert!(matches!(
            table.release(1, &[SLABS_MAX + 1]),
            Err(SlabError::NotOwner { owner: 0, .. })
        ));
    }

    #[test]
    fn a_dead_owners_slabs_are_reclaimed_and_nobody_elses() {
        let table = SlabTable::new_boxed();
        table.initialise(2 * GIB);
        table.claim(7, 5);
        table.claim(8, 3);
        assert_eq!(table.reclaim(|owner| owner == 7), 5);
        assert_eq!((table.owned_by(7), table.owned_by(8)), (0, 3));
        assert_eq!(table.reclaim(|_| false), 0);
    }

    #[test]
    fn concurrent_claimers_never_share_a_slab() {
        let table = SlabTable::new_boxed();
        table.initialise(4 * GIB); // 64 slabs
        std::thread::scope(|scope| {
            for thread in 1..=8u64 {
                let table = &table;
                scope.spawn(move || {
                    let mut held: Vec<usize> = Vec::new();
                    for round in 0..2000u64 {
                        let wanted = ((round * 7 + thread * 3) % 9) as usize;
                        let got = table.claim(thread, wanted);
                        assert!(got.len() <= wanted);
                        held.extend(got);
                        // Every slab held reads as this thread's.
                        for &index in &held {
                            assert_eq!(table.owners[index].load(Ordering::Acquire), thread);
                        }
                        if round % 3 == 0 {
                            let keep = held.len() / 2;
                            let gone: Vec<usize> = held.drain(keep..).collect();
                            table.release(thread, &gone).expect("its own slabs");
                        }
                    }
                    table.release(thread, &held).expect("its own slabs");
                });
            }
        });
        assert_eq!(table.free(), 64);
    }
}
