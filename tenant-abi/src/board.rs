//! The per-GPU memory board of elastic memory (issue 17, `docs/design/elastic-memory.md`): one
//! `#[repr(C)]` file per GPU (`<uuid>.memory`, [`crate::layout::board_path`]) mapped by the agent
//! and by every process of every tenant on that GPU, and the lock-free protocol that lets a
//! tenant use memory past its request (up to its limit) while no one else needs it, and get its
//! request back when it does.
//!
//! **Who writes what.** The agent writes the board's static part: the capacity (what tenants may
//! hold on the GPU in all: the card's memory less what the agent keeps back for contexts, NCCL
//! and headroom) and one entry per tenant (name, request, limit, priority, guaranteed), published
//! by its `present` word last. Each tenant process owns one slot and counts in it what it holds
//! resident on the GPU and what it swapped out. A tenant that needs memory within its request
//! that the GPU no longer has posts a *want* on the borrowers `reclaim::plan` chose; their
//! interposers take it and give memory back (hints, then swap).
//!
//! **Reserve protocol** for `bytes` by the process of slot `s`, tenant `t`:
//! 1. `slot[s].resident += bytes` (published before checking);
//! 2. sum what `t` holds (resident and swapped, its limit covers both) and what every slot holds
//!    resident on the GPU;
//! 3. over `t`'s limit, or over the capacity: reclaim the slots of dead processes and sum again;
//!    if still over, `slot[s].resident -= bytes` and refuse, saying whether a reclaim can help
//!    (the bytes are within `t`'s request: others borrowed them) or not.
//!
//! All `SeqCst`, so as in `ledger`, of two processes racing near the capacity at least one sees
//! the other's step 1: both may be refused, but what is granted never passes the capacity or a
//! limit. Swapping in is the same protocol against the capacity only (the limit already counts
//! swapped bytes).
//!
//! **Swap staging.** Memory swapped out sits in pinned host memory (staging) until it comes
//! back. The agent writes the GPU's share of the node's staging budget (`swap_host_memory`) in
//! the header; a process reserves staging on its slot before it copies a chunk out, by the same
//! protocol against that budget ([`Board::reserve_staging`]), and gives it back once the chunk
//! is back or freed. A swap-out the budget refuses does not happen (the chunk stays resident);
//! the borrower counts the refusal in the header ([`Board::swap_refused`]) so that the tenant
//! waiting for that memory stops waiting and is told that the node's swap space is full. Before
//! it refuses, a swap-out short of staging asks the GPU's other processes for their *idle*
//! staging (pooled for reuse or pinned ahead, holding no chunk: [`Board::want_staging`]) and
//! waits for it, bounded; each process's watcher frees its idle staging when the count moves.
//!
//! **The line.** A process that waits for room past its request (a borrow the GPU has no room
//! for, retried; or its swapped-out memory, to come back) stands in the GPU's line: its slot
//! says since when and for how many bytes ([`Board::wait`]). Room goes in line order
//! (`reclaim::line_order`: higher priority first, then the longest waiting): a borrow or a
//! swap-in leaves free what the waiters ahead of it wait for ([`Region::room_in_line`]; a process
//! not in line is behind every waiter). A wait within a request is not in line: it reclaims
//! (above). Waiters that hold borrowed memory while they wait are stalled anyway, so the first
//! in line may ask them for it (`reclaim::unstall`): two borrowers that each wait for the memory
//! the other holds do not wait for ever. A waiter the line cannot serve is passed over
//! (`reclaim::served`) and holds no room ahead of the others; one that gave memory back while it
//! waited goes to the back of the line ([`Board::requeue`]).
//!
//! The file starts zeroed; a zero capacity lends nothing and refuses everything, and a zero
//! staging budget swaps nothing, so a board the agent has not written yet is safe.

use crate::ledger::{Liveness, RECLAIMING_BIT, claim_free_slot, reclaim_dead_slots};
use crate::reclaim::{Holder, Waiter};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering::SeqCst};

/// `VGPUBRD1`, little-endian: written last when a board is initialised.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUBRD1");
/// Bumped on any layout change; a process refuses a board of another version (2: the swap
/// staging budget in the header, staging bytes in each slot, the tenants' claims,
/// `Tenant::claim_bytes` and `Tenant::claim_until_ns`, and their reclaim history; 3: the line,
/// `Slot::wait_since_ns`, `Slot::wait_bytes` and `Slot::wait_borrow`; 4:
/// `Header::staging_wanted`).
pub const VERSION: u32 = 4;
/// Tenants one GPU's board describes at once.
pub const TENANTS: usize = 64;
/// Process slots per GPU: the most processes of all tenants on one GPU alive at once.
pub const SLOTS: usize = 512;
/// Bytes of a tenant's name in its entry; tenant names are at most 63 bytes (`api::names`).
pub const NAME_BYTES: usize = 64;
/// A tenant entry's flag: its request is guaranteed (never overbooked by placement).
pub const GUARANTEED: u32 = 1;
/// How long a claim lasts after the claiming tenant last allocated within its request (see
/// [`Board::claim`]): as long as a tenant waits for a reclaim (the interposer's bound on it).
pub const CLAIM_LAPSE_NS: u64 = 5_000_000_000;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub tenant_count: AtomicU32,
    pub slot_count: AtomicU32,
    /// Counts every swap-out refused because the staging budget was spent (wraps), so that a
    /// tenant waiting for a reclaim notices with one load that it will not come.
    pub swap_refusals: AtomicU32,
    /// What the tenants may hold resident on the GPU in all (bytes).
    pub capacity_bytes: AtomicU64,
    /// The pinned host memory all processes on the GPU may hold for swapped-out chunks (bytes):
    /// this GPU's share of the node's `swap_host_memory`.
    pub staging_budget_bytes: AtomicU64,
    /// Counts every ask for idle staging (wraps): a swap-out the budget would refuse asks the
    /// GPU's other processes to free what they keep idle ([`Board::want_staging`]).
    pub staging_wanted: AtomicU64,
}

/// One tenant of the GPU, written by the agent.
#[repr(C)]
pub struct Tenant {
    /// The name, NUL-padded, as little-endian words.
    pub name: [AtomicU64; NAME_BYTES / 8],
    /// 1 when the entry describes a tenant; stored last when written, first when removed.
    pub present: AtomicU32,
    pub flags: AtomicU32,
    pub priority: AtomicI32,
    /// The board slot + 1 of the process whose reclaim made the tenant's claim (see
    /// [`Board::claim_from`]); 0: not known (the word was reserved before, so a board written by
    /// an older build reads 0 here, and the claim ends as it did then).
    pub claimer: AtomicU32,
    pub request_bytes: AtomicU64,
    /// What the tenant may hold, resident and swapped; 0 = its request.
    pub limit_bytes: AtomicU64,
    /// Bytes other tenants asked it to give back and it has not taken yet.
    pub want_bytes: AtomicU64,
    /// Counts every want posted, so a borrower notices one with one load.
    pub want_epoch: AtomicU64,
    /// Room held for this tenant's request after it asked borrowers for memory back (see
    /// [`Board::claim`]), and until when (CLOCK_MONOTONIC ns; 0: no claim).
    pub claim_bytes: AtomicU64,
    pub claim_until_ns: AtomicU64,
    /// The tenant's reclaim history on this GPU: how many times its processes moved borrowed
    /// memory to host memory for others, how many bytes in all, and when last (Unix ms).
    pub reclaims: AtomicU64,
    pub reclaimed_bytes: AtomicU64,
    pub last_reclaim_unix_ms: AtomicU64,
}

/// One process's memory on the GPU.
#[repr(C)]
pub struct Slot {
    pub pid: AtomicU32,
    /// The index of its tenant's entry.
    pub tenant: AtomicU32,
    pub start_time: AtomicU64,
    pub resident_bytes: AtomicU64,
    pub swapped_bytes: AtomicU64,
    /// Pinned host staging reserved for its swapped-out chunks (and for one on its way out).
    pub staging_bytes: AtomicU64,
    /// In the GPU's line since (CLOCK_MONOTONIC ns; 0: not waiting), for `wait_bytes` more
    /// resident (see "The line" above).
    pub wait_since_ns: AtomicU64,
    pub wait_bytes: AtomicU64,
    /// 1 while the wait is a borrow (which a stuck line may refuse), 0 for a process waiting for
    /// its swapped-out memory.
    pub wait_borrow: AtomicU64,
}

/// The whole board file.
#[repr(C)]
pub struct Region {
    pub header: Header,
    pub tenants: [Tenant; TENANTS],
    pub slots: [Slot; SLOTS],
}

/// The file size; part of the on-disk format (checked so a field change bumps `VERSION`).
pub const REGION_BYTES: usize = 48 + TENANTS * 152 + SLOTS * 64;
const _: () = assert!(std::mem::size_of::<Header>() == 48);
const _: () = assert!(std::mem::size_of::<Tenant>() == 152);
const _: () = assert!(std::mem::size_of::<Slot>() == 64);
const _: () = assert!(std::mem::size_of::<Region>() == REGION_BYTES);
const _: () = assert!(std::mem::align_of::<Region>() == 8);

/// What the agent writes for the whole GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuSpec {
    /// What tenants may hold resident on the GPU in all: its memory less what the agent keeps
    /// back.
    pub capacity_bytes: u64,
    /// The pinned host memory swapped-out chunks of this GPU may hold: its share of the node's
    /// `swap_host_memory`.
    pub staging_budget_bytes: u64,
}

/// A tenant entry the agent writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSpec {
    pub name: String,
    pub request_bytes: u64,
    /// At least the request; equal to it for a tenant that does not borrow.
    pub limit_bytes: u64,
    pub priority: i32,
    pub guaranteed: bool,
}

/// Why the agent could not write an entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("tenant name `{0}` is empty or longer than {max} bytes", max = NAME_BYTES - 1)]
    Name(String),
    #[error("tenant `{name}`: limit {limit} bytes is below its request {request} bytes")]
    LimitBelowRequest {
        name: String,
        request: u64,
        limit: u64,
    },
    #[error(
        "the board of this GPU describes {TENANTS} tenants already; remove a tenant that left first"
    )]
    Full,
}

/// What a granted reservation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Within the tenant's request.
    Within,
    /// Past its request: borrowed, so it may be asked back.
    Borrowed,
}

/// A refused reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the tenant holds {held} of its limit of {limit} bytes")]
    OverLimit { held: u64, limit: u64 },
    /// Within the request, but others borrowed the memory: ask them (`reclaim::plan` with
    /// [`Region::holders`]), then try again.
    #[error("within the request, but the GPU is short of {shortfall} bytes that others borrowed")]
    NeedsReclaim { shortfall: u64 },
    /// Past the request, and the GPU does not have that much free.
    #[error("past the request, {asked} bytes asked and {free} free on the GPU")]
    NothingFree { asked: u64, free: u64 },
}

impl Region {
    /// A zeroed region on the heap (tests; the real one is a mapped file).
    pub fn new_boxed() -> Box<Region> {
        let tenant = || Tenant {
            name: std::array::from_fn(|_| AtomicU64::new(0)),
            present: AtomicU32::new(0),
            flags: AtomicU32::new(0),
            priority: AtomicI32::new(0),
            claimer: AtomicU32::new(0),
            request_bytes: AtomicU64::new(0),
            limit_bytes: AtomicU64::new(0),
            want_bytes: AtomicU64::new(0),
            want_epoch: AtomicU64::new(0),
            claim_bytes: AtomicU64::new(0),
            claim_until_ns: AtomicU64::new(0),
            reclaims: AtomicU64::new(0),
            reclaimed_bytes: AtomicU64::new(0),
            last_reclaim_unix_ms: AtomicU64::new(0),
        };
        let slot = || Slot {
            pid: AtomicU32::new(0),
            tenant: AtomicU32::new(0),
            start_time: AtomicU64::new(0),
            resident_bytes: AtomicU64::new(0),
            swapped_bytes: AtomicU64::new(0),
            staging_bytes: AtomicU64::new(0),
            wait_since_ns: AtomicU64::new(0),
            wait_bytes: AtomicU64::new(0),
            wait_borrow: AtomicU64::new(0),
        };
        Box::new(Region {
            header: Header {
                magic: AtomicU64::new(0),
                version: AtomicU32::new(0),
                tenant_count: AtomicU32::new(0),
                slot_count: AtomicU32::new(0),
                swap_refusals: AtomicU32::new(0),
                capacity_bytes: AtomicU64::new(0),
                staging_budget_bytes: AtomicU64::new(0),
                staging_wanted: AtomicU64::new(0),
            },
            tenants: std::array::from_fn(|_| tenant()),
            slots: std::array::from_fn(|_| slot()),
        })
    }

    /// Writes the constant header fields and publishes the magic (idempotent).
    pub fn initialise(&self) {
        self.header.version.store(VERSION, SeqCst);
        self.header.tenant_count.store(TENANTS as u32, SeqCst);
        self.header.slot_count.store(SLOTS as u32, SeqCst);
        self.header.magic.store(MAGIC, SeqCst);
    }

    pub fn is_initialised(&self) -> bool {
        self.header.magic.load(SeqCst) == MAGIC
    }

    /// Checks an initialised header against this build's layout.
    pub fn check_layout(&self) -> Result<(), String> {
        let h = &self.header;
        let (version, tenants, slots) = (
            h.version.load(SeqCst),
            h.tenant_count.load(SeqCst),
            h.slot_count.load(SeqCst),
        );
        if version != VERSION || tenants as usize != TENANTS || slots as usize != SLOTS {
            return Err(format!(
                "the memory board has version {version} ({tenants} tenants, {slots} slots); this \
                 build uses version {VERSION} ({TENANTS}, {SLOTS}): the agent and a tenant \
                 process are of two vgpu versions"
            ));
        }
        Ok(())
    }

    pub fn capacity(&self) -> u64 {
        self.header.capacity_bytes.load(SeqCst)
    }

    /// The agent: what tenants may hold on the GPU in all.
    pub fn set_capacity(&self, bytes: u64) {
        self.header.capacity_bytes.store(bytes, SeqCst);
    }

    /// The agent: the pinned host memory swapped-out chunks of this GPU may hold in all.
    pub fn set_staging_budget(&self, bytes: u64) {
        self.header.staging_budget_bytes.store(bytes, SeqCst);
    }

    pub fn staging_budget(&self) -> u64 {
        self.header.staging_budget_bytes.load(SeqCst)
    }

    /// Staging held now over the live slots (dead processes' included until reclaimed).
    pub fn staging_total(&self) -> u64 {
        self.slots
            .iter()
            .filter(|slot| slot.pid.load(SeqCst) != 0)
            .fold(0u64, |sum, slot| {
                sum.saturating_add(slot.staging_bytes.load(SeqCst))
            })
    }

    /// What the staging budget has left beside what the live slots hold.
    pub fn staging_left(&self) -> u64 {
        self.staging_budget().saturating_sub(self.staging_total())
    }

    /// How many swap-outs were refused for want of staging so far (wraps).
    pub fn swap_refusals(&self) -> u32 {
        self.header.swap_refusals.load(SeqCst)
    }

    /// Where the GPU's memory is: a fingerprint of every slot's resident and swapped bytes,
    /// which changes when any chunk moves out or back, or any memory is allocated or freed
    /// (an exchange whose two sides balance included). A line whose fingerprint changed between
    /// two looks moved, and is not stuck then, whatever the stuck rule's arithmetic says.
    pub fn movement(&self) -> u64 {
        self.slots.iter().fold(0u64, |hash, slot| {
            let resident = slot.resident_bytes.load(SeqCst);
            let swapped = slot.swapped_bytes.load(SeqCst);
            (hash.rotate_left(11) ^ resident)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(23)
                ^ swapped
        })
    }

    /// How many times a swap-out asked for the other processes' idle staging so far (wraps).
    pub fn staging_wanted(&self) -> u64 {
        self.header.staging_wanted.load(SeqCst)
    }

    /// The agent: writes (or rewrites) `spec`'s entry; returns its index.
    pub fn set_tenant(&self, spec: &TenantSpec) -> Result<usize, SpecError> {
        let words = name_words(&spec.name).ok_or_else(|| SpecError::Name(spec.name.clone()))?;
        if spec.limit_bytes < spec.request_bytes {
            return Err(SpecError::LimitBelowRequest {
                name: spec.name.clone(),
                request: spec.request_bytes,
                limit: spec.limit_bytes,
            });
        }
        let index = match self.find(&spec.name) {
            Some(index) => index,
            None => {
                let index = self
                    .tenants
                    .iter()
                    .position(|t| t.present.load(SeqCst) == 0)
                    .ok_or(SpecError::Full)?;
                // A new tenant in a free entry: no history of the tenant that had it.
                let entry = &self.tenants[index];
                for counter in [
                    &entry.reclaims,
                    &entry.reclaimed_bytes,
                    &entry.last_reclaim_unix_ms,
                    &entry.claim_until_ns,
                ] {
                    counter.store(0, SeqCst);
                }
                entry.claimer.store(0, SeqCst);
                index
            }
        };
        let entry = &self.tenants[index];
        for (stored, word) in entry.name.iter().zip(words) {
            stored.store(word, SeqCst);
        }
        entry.request_bytes.store(spec.request_bytes, SeqCst);
        entry.limit_bytes.store(spec.limit_bytes, SeqCst);
        entry.priority.store(spec.priority, SeqCst);
        entry
            .flags
            .store(if spec.guaranteed { GUARANTEED } else { 0 }, SeqCst);
        entry.present.store(1, SeqCst);
        Ok(index)
    }

    /// The agent: the tenant left the GPU. Its processes' slots keep their counts until they
    /// exit (the driver holds that memory until then).
    pub fn remove_tenant(&self, name: &str) -> bool {
        let Some(index) = self.find(name) else {
            return false;
        };
        let entry = &self.tenants[index];
        entry.present.store(0, SeqCst);
        entry.want_bytes.store(0, SeqCst);
        entry.claim_until_ns.store(0, SeqCst);
        entry.claimer.store(0, SeqCst);
        true
    }

    /// What each tenant was asked to give back and has not taken yet (`Board::post_want`, not
    /// yet `Board::take_want`), by name: memory that is coming without another ask.
    pub fn untaken_wants(&self) -> Vec<(String, u64)> {
        self.holders()
            .into_iter()
            .filter_map(|holder| {
                let index = self.find(&holder.name)?;
                let bytes = self.tenants[index].want_bytes.load(SeqCst);
                (bytes > 0).then_some((holder.name, bytes))
            })
            .collect()
    }

    /// The index of `name`'s entry.
    pub fn find(&self, name: &str) -> Option<usize> {
        let words = name_words(name)?;
        self.tenants.iter().position(|t| {
            t.present.load(SeqCst) == 1
                && t.name.iter().zip(&words).all(|(a, b)| a.load(SeqCst) == *b)
        })
    }

    /// The names of the tenants the board describes.
    pub fn tenant_names(&self) -> Vec<String> {
        (0..TENANTS)
            .filter(|&i| self.tenants[i].present.load(SeqCst) == 1)
            .map(|i| self.name_of(i))
            .collect()
    }

    fn name_of(&self, index: usize) -> String {
        let bytes: Vec<u8> = self.tenants[index]
            .name
            .iter()
            .flat_map(|w| w.load(SeqCst).to_le_bytes())
            .take_while(|b| *b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Sums over the slots: (what `tenant` holds resident and swapped, what all hold resident).
    fn sums(&self, tenant: u32) -> (u64, u64) {
        let (mut held, mut resident) = (0u64, 0u64);
        for slot in &self.slots {
            if slot.pid.load(SeqCst) == 0 {
                continue;
            }
            let r = slot.resident_bytes.load(SeqCst);
            resident = resident.saturating_add(r);
            if slot.tenant.load(SeqCst) == tenant {
                held = held
                    .saturating_add(r)
                    .saturating_add(slot.swapped_bytes.load(SeqCst));
            }
        }
        (held, resident)
    }

    /// The processes of the tenant at `tenant` that hold memory resident on the GPU.
    pub fn holding_pids(&self, tenant: usize) -> Vec<u32> {
        let tenant = u32::try_from(tenant).unwrap_or(u32::MAX);
        self.slots
            .iter()
            .filter(|slot| slot.tenant.load(SeqCst) == tenant)
            .filter(|slot| slot.resident_bytes.load(SeqCst) > 0)
            .map(|slot| slot.pid.load(SeqCst))
            .filter(|&pid| pid != 0)
            .collect()
    }

    /// Whether `slot` belongs to the live process `pid` (the one that claimed it: a slot being
    /// reclaimed, freed or reused by another process is not).
    pub fn slot_owned_by(&self, slot: usize, pid: u32, liveness: &impl Liveness) -> bool {
        self.slots.get(slot).is_some_and(|s| {
            pid != 0
                && s.pid.load(SeqCst) == pid
                && liveness.is_alive(pid, s.start_time.load(SeqCst))
        })
    }

    /// The request and the limit (at least the request) of the tenant at `tenant`.
    pub fn request_and_limit(&self, tenant: usize) -> (u64, u64) {
        let entry = &self.tenants[tenant];
        let request = entry.request_bytes.load(SeqCst);
        (request, entry.limit_bytes.load(SeqCst).max(request))
    }

    /// Bytes resident on the GPU now, dead processes' included until reclaimed.
    pub fn resident_total(&self) -> u64 {
        self.sums(u32::MAX).1
    }

    /// What the capacity leaves free now.
    pub fn free(&self) -> u64 {
        self.capacity().saturating_sub(self.resident_total())
    }

    /// Whether what every slot holds resident fits in the capacity: the needy side of a reclaim
    /// charges its bytes first ([`Board::charge`]), so that nobody else (a borrower swapping in,
    /// a new borrow) takes the room the borrowers make, and waits for this.
    pub fn fits(&self) -> bool {
        self.resident_total() <= self.capacity()
    }

    /// The room claims of tenants other than `tenant` hold at `now_ns`: for each live claim of
    /// a tenant with a process on the GPU, what is left of it within the claimer's request (`min(claim, request - held)`: it shrinks
    /// as the claimer allocates). Borrowing and swapping in leave this much free (see
    /// [`Board::claim`]).
    pub fn claimed_by_others(&self, tenant: usize, now_ns: u64) -> u64 {
        (0..TENANTS)
            .filter(|&i| i != tenant && self.tenants[i].present.load(SeqCst) == 1)
            .filter(|&i| self.tenants[i].claim_until_ns.load(SeqCst) > now_ns)
            // A claim holds room for a process waiting to allocate: none of its tenant's
            // processes left (they exited, or died and were reclaimed), nobody will.
            .filter(|&i| {
                self.slots
                    .iter()
                    .any(|s| s.pid.load(SeqCst) != 0 && s.tenant.load(SeqCst) == i as u32)
            })
            .map(|i| {
                let entry = &self.tenants[i];
                let (held, _) = self.sums(i as u32);
                entry
                    .claim_bytes
                    .load(SeqCst)
                    .min(entry.request_bytes.load(SeqCst).saturating_sub(held))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Whether `bytes` more fit for the tenant at `tenant` beside what every slot holds and what
    /// others' claims hold (a borrower's swap-in or new borrow at `now_ns`).
    pub fn room_beside_claims(&self, tenant: usize, bytes: u64, now_ns: u64) -> bool {
        self.resident_total()
            .saturating_add(self.claimed_by_others(tenant, now_ns))
            .saturating_add(bytes)
            <= self.capacity()
    }

    /// Whether every live process that holds memory on the GPU (resident or swapped out) is in
    /// its line: then nobody frees anything unless the line itself moves (`reclaim::stuck`).
    pub fn every_holder_waits(&self) -> bool {
        self.slots
            .iter()
            .filter(|s| s.pid.load(SeqCst) != 0)
            .filter(|s| s.resident_bytes.load(SeqCst) != 0 || s.swapped_bytes.load(SeqCst) != 0)
            .all(|s| s.wait_since_ns.load(SeqCst) != 0)
    }

    /// The processes in the GPU's line, in no order (`reclaim::line_order` sorts them).
    pub fn waiters(&self) -> Vec<Waiter> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.pid.load(SeqCst) != 0)
            .filter_map(|(index, s)| {
                let since_ns = s.wait_since_ns.load(SeqCst);
                (since_ns != 0).then(|| {
                    let tenant = s.tenant.load(SeqCst) as usize;
                    Waiter {
                        tenant: self.name_of(tenant),
                        slot: index,
                        since_ns,
                        bytes: s.wait_bytes.load(SeqCst),
                        priority: self.tenants[tenant].priority.load(SeqCst),
                        borrow: s.wait_borrow.load(SeqCst) == 1,
                    }
                })
            })
            .collect()
    }

    /// What is free for `tenant` at `now_ns`, the line aside: the capacity less what every slot
    /// holds and what other tenants' claims hold. The line serves its waiters from it
    /// (`reclaim::served`).
    pub fn free_beside_claims(&self, tenant: usize, now_ns: u64) -> u64 {
        self.capacity()
            .saturating_sub(self.resident_total())
            .saturating_sub(self.claimed_by_others(tenant, now_ns))
    }

    /// What is free for waiter `w` at `now_ns`, the line aside ([`Region::free_beside_claims`]
    /// of its tenant).
    fn free_for(&self, w: &Waiter, now_ns: u64) -> u64 {
        self.free_beside_claims(self.slots[w.slot].tenant.load(SeqCst) as usize, now_ns)
    }

    /// The waiter the line serves at `now_ns` (`reclaim::served`, rule 7: the first in line that
    /// it can serve), with the line it was chosen from.
    pub fn served(&self, now_ns: u64) -> (Option<Waiter>, Vec<Waiter>) {
        let waiters = self.waiters();
        let holders = self.holders();
        let served =
            crate::reclaim::served(&holders, &waiters, |w| self.free_for(w, now_ns)).cloned();
        (served, waiters)
    }

    /// Rule 6 on this board at `now_ns` (`reclaim::stuck`): the slot whose borrow the stuck line
    /// refuses, if any. The swap room is what the node's staging budget has left plus the staging
    /// the other waiters' processes keep idle (theirs to reuse), or nothing when
    /// `swap_refused_since` (a swap-out was refused for staging since the caller last looked: the
    /// swap takes whole chunks, which the budget's bytes left may not hold, so the unstall's asks
    /// were refused and would be for ever).
    pub fn stuck(&self, now_ns: u64, swap_refused_since: bool) -> Option<usize> {
        let (served, waiters) = self.served(now_ns);
        if waiters.is_empty() {
            return None;
        }
        let (room, swap_room) = match &served {
            Some(first) => {
                let idle_elsewhere = waiters
                    .iter()
                    .filter(|w| w.tenant != first.tenant)
                    .map(|w| {
                        let slot = &self.slots[w.slot];
                        slot.staging_bytes
                            .load(SeqCst)
                            .saturating_sub(slot.swapped_bytes.load(SeqCst))
                    })
                    .fold(0u64, u64::saturating_add);
                // The first's own staging frees as its chunks come back piece by piece
                // (`Counters::first_in_line` in the interposer; on a short budget it frees what
                // its swap-ins emptied): room for the givers' next pieces. Without it, a first
                // with 40 GiB out on a budget nearly spent looked stuck while its exchange moved,
                // and the last borrow, a job's, was refused (an H200 run).
                let (own, idle_first) = {
                    let slot = &self.slots[first.slot];
                    let (staging, swapped) = (
                        slot.staging_bytes.load(SeqCst),
                        slot.swapped_bytes.load(SeqCst),
                    );
                    (staging.min(swapped), staging.saturating_sub(swapped))
                };
                // The first's idle staging (pinned ahead for its resident borrowed chunks) is
                // freed for another process's swap-out like anyone's (the watcher answers
                // `staging_wanted`, and a first waiting on a short budget frees it itself): room
                // for the givers' first pieces too. Uncounted, a first holding 34 GiB pinned
                // ahead on an 84 GiB budget may have made a moving line look stuck, and a job's
                // borrow was refused (an H200 run of the three jobs; the logs do not say).
                let base = self
                    .staging_left()
                    .saturating_add(idle_elsewhere)
                    .saturating_add(idle_first);
                // Only once the givers have room for a first piece: nothing comes back before.
                let swap_room = if swap_refused_since || base == 0 {
                    0
                } else {
                    base.saturating_add(own)
                };
                (self.free_in_line(first.slot, now_ns), swap_room)
            }
            None => (0, 0),
        };
        crate::reclaim::stuck(
            &self.holders(),
            &waiters,
            served.as_ref(),
            room,
            swap_room,
            self.every_holder_waits(),
        )
    }

    /// Bytes the waiters ahead of `slot` in the line wait for (every waiter's, if `slot` is not
    /// in line), counting only those the line serves (`reclaim::line_serves`): a waiter passed
    /// over holds no room ahead of others (rule 7).
    pub fn ahead_in_line(&self, slot: usize, now_ns: u64) -> u64 {
        let waiters = self.waiters();
        let me = waiters.iter().find(|w| w.slot == slot);
        if waiters.iter().all(|w| {
            w.slot == slot || me.is_some_and(|me| !crate::reclaim::line_order(w, me).is_lt())
        }) {
            return 0;
        }
        let holders = self.holders();
        crate::reclaim::line_serves(&holders, &waiters, |w| self.free_for(w, now_ns))
            .into_iter()
            .filter(|w| w.slot != slot)
            .filter(|w| me.is_none_or(|me| crate::reclaim::line_order(w, me).is_lt()))
            .fold(0u64, |sum, w| sum.saturating_add(w.bytes))
    }

    /// Whether `bytes` more fit for the process of `slot` (a borrow, or a swap-in) beside what
    /// every slot holds, what other tenants' claims hold and what the waiters ahead of it in
    /// line wait for.
    pub fn room_in_line(&self, slot: usize, bytes: u64, now_ns: u64) -> bool {
        let tenant = self.slots[slot].tenant.load(SeqCst) as usize;
        self.resident_total()
            .saturating_add(self.claimed_by_others(tenant, now_ns))
            .saturating_add(self.ahead_in_line(slot, now_ns))
            .saturating_add(bytes)
            <= self.capacity()
    }

    /// What is free for the process of `slot` at `now_ns`: the capacity less what every slot
    /// holds, what other tenants' claims hold and what the waiters ahead of it wait for.
    pub fn free_in_line(&self, slot: usize, now_ns: u64) -> u64 {
        let tenant = self.slots[slot].tenant.load(SeqCst) as usize;
        self.capacity()
            .saturating_sub(self.resident_total())
            .saturating_sub(self.claimed_by_others(tenant, now_ns))
            .saturating_sub(self.ahead_in_line(slot, now_ns))
    }

    /// What the tenants' requests book and their borrowers hold beyond them, with `extra` bytes
    /// more for the tenant at `tenant`: the sum over the tenants present of
    /// `max(request, resident)`. Memory the swap cannot take back (the application's own
    /// `cuMemCreate`) may be borrowed only while this stays within the capacity: then every
    /// tenant can still get its request by swapping out the rest (guaranteed requests are never
    /// overbooked, and such memory must not overbook them either).
    pub fn booked_or_lent_with(&self, tenant: usize, extra: u64) -> u64 {
        let me = self.name_of(tenant);
        self.holders()
            .iter()
            .map(|h| {
                let resident = if h.name == me {
                    h.resident.saturating_add(extra)
                } else {
                    h.resident
                };
                h.request.max(resident)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The tenants as the reclaim planner sees them.
    pub fn holders(&self) -> Vec<Holder> {
        (0..TENANTS)
            .filter(|&i| self.tenants[i].present.load(SeqCst) == 1)
            .map(|i| {
                let entry = &self.tenants[i];
                let resident = self
                    .slots
                    .iter()
                    .filter(|s| s.pid.load(SeqCst) != 0 && s.tenant.load(SeqCst) == i as u32)
                    .fold(0u64, |sum, s| {
                        sum.saturating_add(s.resident_bytes.load(SeqCst))
                    });
                Holder {
                    name: self.name_of(i),
                    request: entry.request_bytes.load(SeqCst),
                    resident,
                    priority: entry.priority.load(SeqCst),
                    guaranteed: entry.flags.load(SeqCst) & GUARANTEED != 0,
                }
            })
            .collect()
    }
}

/// What one tenant holds on a GPU, as the agent reports it (bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantUsage {
    pub name: String,
    pub request_bytes: u64,
    /// At least the request (an entry's 0 reads as the request).
    pub limit_bytes: u64,
    /// Resident on the GPU now, over the tenant's live slots.
    pub resident_bytes: u64,
    /// Swapped out to host memory, over the tenant's live slots.
    pub swapped_bytes: u64,
    /// Pinned host staging its processes hold for swapped-out chunks (as much as
    /// `swapped_bytes`, plus a chunk on its way out).
    pub staging_bytes: u64,
    /// Its reclaim history on the GPU (see `Tenant::reclaims`): times, bytes, last (Unix ms,
    /// 0: never).
    pub reclaims: u64,
    pub reclaimed_bytes: u64,
    pub last_reclaim_unix_ms: u64,
    /// Its processes in the GPU's line now (see "The line"), and since when the longest waiting
    /// one waits (CLOCK_MONOTONIC ns; 0: none waits).
    pub waiting_processes: u32,
    pub waiting_since_ns: u64,
}

impl TenantUsage {
    /// What it holds resident above its request: what may be taken back (as
    /// [`Holder::borrowed`]).
    pub fn borrowed_bytes(&self) -> u64 {
        self.resident_bytes.saturating_sub(self.request_bytes)
    }
}

impl Region {
    /// Every tenant the board describes, with what its processes' slots hold.
    pub fn tenant_usage(&self) -> Vec<TenantUsage> {
        (0..TENANTS)
            .filter(|&i| self.tenants[i].present.load(SeqCst) == 1)
            .map(|i| {
                let entry = &self.tenants[i];
                let (mut resident, mut swapped, mut staging) = (0u64, 0u64, 0u64);
                let (mut waiting_processes, mut waiting_since_ns) = (0u32, 0u64);
                for slot in &self.slots {
                    if slot.pid.load(SeqCst) != 0 && slot.tenant.load(SeqCst) == i as u32 {
                        resident = resident.saturating_add(slot.resident_bytes.load(SeqCst));
                        swapped = swapped.saturating_add(slot.swapped_bytes.load(SeqCst));
                        staging = staging.saturating_add(slot.staging_bytes.load(SeqCst));
                        let since = slot.wait_since_ns.load(SeqCst);
                        if since != 0 {
                            waiting_processes += 1;
                            if waiting_since_ns == 0 || since < waiting_since_ns {
                                waiting_since_ns = since;
                            }
                        }
                    }
                }
                let request_bytes = entry.request_bytes.load(SeqCst);
                TenantUsage {
                    name: self.name_of(i),
                    request_bytes,
                    limit_bytes: entry.limit_bytes.load(SeqCst).max(request_bytes),
                    resident_bytes: resident,
                    swapped_bytes: swapped,
                    staging_bytes: staging,
                    reclaims: entry.reclaims.load(SeqCst),
                    reclaimed_bytes: entry.reclaimed_bytes.load(SeqCst),
                    last_reclaim_unix_ms: entry.last_reclaim_unix_ms.load(SeqCst),
                    waiting_processes,
                    waiting_since_ns,
                }
            })
            .collect()
    }
}

/// `name` as NUL-padded little-endian words, if it fits with at least one NUL.
fn name_words(name: &str) -> Option<[u64; NAME_BYTES / 8]> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= NAME_BYTES || bytes.contains(&0) {
        return None;
    }
    let mut padded = [0u8; NAME_BYTES];
    padded[..bytes.len()].copy_from_slice(bytes);
    Some(std::array::from_fn(|i| {
        u64::from_le_bytes(padded[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
    }))
}

/// The protocol over a board, for one process.
pub struct Board<'r, L> {
    pub region: &'r Region,
    pub liveness: L,
}

impl<'r, L: Liveness> Board<'r, L> {
    pub fn new(region: &'r Region, liveness: L) -> Self {
        Board { region, liveness }
    }

    /// Claims a free slot for `pid` of the tenant at `tenant`, reclaiming dead processes' slots
    /// once if all are taken.
    pub fn claim_slot(&self, pid: u32, start_time: u64, tenant: usize) -> Option<usize> {
        assert!(
            pid != 0 && pid & RECLAIMING_BIT == 0,
            "pid {pid} cannot own a slot"
        );
        assert!(tenant < TENANTS);
        claim_free_slot(
            &self.region.slots,
            pid,
            start_time,
            |slot| (&slot.pid, &slot.start_time),
            |slot| {
                slot.wait_since_ns.store(0, SeqCst);
                slot.wait_bytes.store(0, SeqCst);
                slot.tenant.store(tenant as u32, SeqCst);
            },
            || self.reclaim_dead(pid),
        )
    }

    /// The refusal `bytes` more for `slot` would get from its tenant's limit alone, whatever the
    /// GPU has free: a borrow that no room can serve must not wait in the line for room.
    pub fn over_limit(&self, slot: usize, bytes: u64) -> Option<Refusal> {
        let tenant = self.region.slots[slot].tenant.load(SeqCst);
        let (_, limit) = self.region.request_and_limit(tenant as usize);
        let (held, _) = self.region.sums(tenant);
        (held.saturating_add(bytes) > limit).then_some(Refusal::OverLimit { held, limit })
    }

    /// Charges `bytes` to `slot` if its tenant's limit and the GPU's capacity allow.
    pub fn reserve(&self, slot: usize, bytes: u64) -> Result<Grant, Refusal> {
        let me = &self.region.slots[slot];
        let tenant = me.tenant.load(SeqCst);
        let entry = &self.region.tenants[tenant as usize];
        let request = entry.request_bytes.load(SeqCst);
        let limit = entry.limit_bytes.load(SeqCst).max(request);
        let capacity = self.region.capacity();
        me.resident_bytes.fetch_add(bytes, SeqCst);
        let mut sums = self.region.sums(tenant);
        let over = |(held, resident): (u64, u64)| held > limit || resident > capacity;
        if over(sums) && self.reclaim_dead(me.pid.load(SeqCst)) > 0 {
            sums = self.region.sums(tenant);
        }
        let (held, resident) = sums;
        if !over(sums) {
            return Ok(if held > request {
                Grant::Borrowed
            } else {
                Grant::Within
            });
        }
        self.credit(&me.resident_bytes, bytes);
        let held_before = held.saturating_sub(bytes);
        if held > limit {
            return Err(Refusal::OverLimit {
                held: held_before,
                limit,
            });
        }
        if held <= request {
            return Err(Refusal::NeedsReclaim {
                shortfall: resident - capacity,
            });
        }
        Err(Refusal::NothingFree {
            asked: bytes,
            free: capacity.saturating_sub(resident.saturating_sub(bytes)),
        })
    }

    /// Charges `bytes` to `slot` without a check: a correction after the driver chose the size
    /// of an allocation the board granted already (the pitch of `cuMemAllocPitch`).
    pub fn charge(&self, slot: usize, bytes: u64) {
        self.region.slots[slot]
            .resident_bytes
            .fetch_add(bytes, SeqCst);
    }

    /// Credits `bytes` freed by `slot`.
    pub fn release(&self, slot: usize, bytes: u64) {
        self.credit(&self.region.slots[slot].resident_bytes, bytes);
    }

    /// The application of `slot` freed `bytes`: credited, and its tenant's room claim ends
    /// unless one of its processes still waits in the GPU's line. A claim holds room for a
    /// tenant growing into its request; one that frees is done growing (the claim's bytes are
    /// "what is left of the request", which a free would otherwise make room for again: on
    /// the fake driver, two tenants that took their requests back and freed them kept the
    /// borrower's memory in host memory for the claim's whole lapse, 5 s, and a borrower that
    /// came back was asked for the room again).
    pub fn release_freed(&self, slot: usize, bytes: u64) {
        self.release(slot, bytes);
        let tenant = self.region.slots[slot].tenant.load(SeqCst);
        // No claim to end (most frees): no look at the line.
        if self.region.tenants[tenant as usize]
            .claim_until_ns
            .load(SeqCst)
            == 0
        {
            return;
        }
        // A claim another live process of the tenant made is that process's to end (by its own
        // free, its allocation's lapse or a failed reclaim): a rank that frees says nothing of
        // whether another rank of its tenant on the GPU still grows.
        let claimer = self.region.tenants[tenant as usize].claimer.load(SeqCst) as usize;
        if claimer != 0 && claimer - 1 != slot && claimer <= SLOTS {
            let other = &self.region.slots[claimer - 1];
            let pid = other.pid.load(SeqCst);
            if pid != 0 && pid & RECLAIMING_BIT == 0 && other.tenant.load(SeqCst) == tenant {
                return;
            }
        }
        let waiting = self.region.slots.iter().any(|s| {
            s.pid.load(SeqCst) != 0
                && s.tenant.load(SeqCst) == tenant
                && s.wait_since_ns.load(SeqCst) != 0
        });
        if !waiting {
            self.drop_claim(tenant as usize);
        }
    }

    /// `bytes` of `slot` went to host memory: no longer resident, still held.
    pub fn swapped_out(&self, slot: usize, bytes: u64) {
        let me = &self.region.slots[slot];
        me.swapped_bytes.fetch_add(bytes, SeqCst);
        self.credit(&me.resident_bytes, bytes);
    }

    /// Makes `bytes` of `slot`'s swapped memory resident again if the capacity allows; `false`
    /// when it does not (try again when others free memory).
    pub fn swap_in(&self, slot: usize, bytes: u64) -> bool {
        let me = &self.region.slots[slot];
        let capacity = self.region.capacity();
        me.resident_bytes.fetch_add(bytes, SeqCst);
        let mut resident = self.region.resident_total();
        if resident > capacity && self.reclaim_dead(me.pid.load(SeqCst)) > 0 {
            resident = self.region.resident_total();
        }
        if resident > capacity {
            self.credit(&me.resident_bytes, bytes);
            return false;
        }
        self.credit(&me.swapped_bytes, bytes);
        true
    }

    /// Freed while swapped out (the application freed a swapped allocation).
    pub fn release_swapped(&self, slot: usize, bytes: u64) {
        self.credit(&self.region.slots[slot].swapped_bytes, bytes);
    }

    /// Reserves `bytes` of pinned host staging for a chunk of `slot` about to go out, if the
    /// GPU's staging budget allows (the reserve protocol against the budget: published, summed,
    /// dead slots reclaimed once when over, taken back when still over). `false`: the chunk must
    /// stay resident; the caller says so ([`Board::swap_refused`]).
    pub fn reserve_staging(&self, slot: usize, bytes: u64) -> bool {
        let me = &self.region.slots[slot];
        let budget = self.region.staging_budget();
        me.staging_bytes.fetch_add(bytes, SeqCst);
        let mut held = self.region.staging_total();
        if held > budget && self.reclaim_dead(me.pid.load(SeqCst)) > 0 {
            held = self.region.staging_total();
        }
        if held > budget {
            self.credit(&me.staging_bytes, bytes);
            return false;
        }
        debug_assert!(me.staging_bytes.load(SeqCst) >= bytes);
        true
    }

    /// Gives back `bytes` of `slot`'s staging: its chunk is back on the GPU, or was freed.
    pub fn release_staging(&self, slot: usize, bytes: u64) {
        self.credit(&self.region.slots[slot].staging_bytes, bytes);
    }

    /// A swap-out is short of staging: asks every process of the GPU to free the staging it keeps
    /// idle ([`Region::staging_wanted`]), before the swap-out waits for it (bounded) or is refused.
    pub fn want_staging(&self) {
        self.region.header.staging_wanted.fetch_add(1, SeqCst);
    }

    /// A swap-out was refused for want of staging: counted, so that a tenant waiting for the
    /// memory stops waiting ([`Region::swap_refusals`]).
    pub fn swap_refused(&self) {
        self.region.header.swap_refusals.fetch_add(1, SeqCst);
    }

    fn credit(&self, counter: &AtomicU64, bytes: u64) {
        let update = counter.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_sub(bytes)));
        debug_assert!(update.unwrap_or_else(|v| v) >= bytes, "credited past zero");
    }

    /// The tenant at `tenant` asked borrowers for `bytes` of its request back at `now_ns`: that
    /// much room is held for it until [`CLAIM_LAPSE_NS`] after the last allocation within its
    /// request ([`Board::refresh_claim`]), shrinking as it allocates, so that borrowers do not
    /// take back at once the memory they gave (on the fake driver a want of 7.35 GiB moved 8,
    /// then 4, 3 and 2 GiB in four rounds, the borrower swapping the rest straight back in). A
    /// hold, not a reservation: a tenant within its own request allocates past it, and the
    /// capacity alone bounds what is resident.
    pub fn claim(&self, tenant: usize, bytes: u64, now_ns: u64) {
        let entry = &self.region.tenants[tenant];
        entry.claim_bytes.store(bytes, SeqCst);
        entry
            .claim_until_ns
            .fetch_max(now_ns.saturating_add(CLAIM_LAPSE_NS), SeqCst);
    }

    /// [`Board::claim`] by the process of `slot`: the claim is then that process's, and a free
    /// by another process of the tenant does not end it ([`Board::release_freed`]).
    pub fn claim_from(&self, slot: usize, tenant: usize, bytes: u64, now_ns: u64) {
        assert!(slot < SLOTS, "a board slot");
        self.region.tenants[tenant]
            .claimer
            .store(slot as u32 + 1, SeqCst);
        self.claim(tenant, bytes, now_ns);
    }

    /// The tenant at `tenant` no longer waits for the room it claimed (its reclaim failed):
    /// others may use it at once.
    pub fn drop_claim(&self, tenant: usize) {
        let entry = &self.region.tenants[tenant];
        entry.claim_until_ns.store(0, SeqCst);
        entry.claimer.store(0, SeqCst);
    }

    /// The tenant at `tenant` allocated within its request at `now_ns`: a live claim of it lasts
    /// [`CLAIM_LAPSE_NS`] from now.
    pub fn refresh_claim(&self, tenant: usize, now_ns: u64) {
        let until = &self.region.tenants[tenant].claim_until_ns;
        let _ = until.fetch_update(SeqCst, SeqCst, |u| {
            (u > now_ns).then(|| u.max(now_ns.saturating_add(CLAIM_LAPSE_NS)))
        });
    }

    /// A process of the tenant at `tenant` moved `bytes` of borrowed memory to host memory for
    /// others at `unix_ms`: its reclaim history.
    pub fn record_reclaim(&self, tenant: usize, bytes: u64, unix_ms: u64) {
        let entry = &self.region.tenants[tenant];
        entry.reclaims.fetch_add(1, SeqCst);
        entry.reclaimed_bytes.fetch_add(bytes, SeqCst);
        entry.last_reclaim_unix_ms.fetch_max(unix_ms, SeqCst);
    }

    /// The process of `slot` waits for `bytes` more resident (a `borrow`, or its swapped-out
    /// memory): it stands in the GPU's line with the place `since_ns` (when it began to wait, or
    /// an earlier place it keeps), or keeps the place it has if it stands there already.
    pub fn wait(&self, slot: usize, bytes: u64, borrow: bool, since_ns: u64) {
        let me = &self.region.slots[slot];
        me.wait_bytes.store(bytes, SeqCst);
        me.wait_borrow.store(u64::from(borrow), SeqCst);
        let _ = me
            .wait_since_ns
            .compare_exchange(0, since_ns.max(1), SeqCst, SeqCst);
    }

    /// The process of `slot` gave memory back while it stood in line (a want it met by a
    /// swap-out): it goes to the back of the line, with the place `now_ns` (rule 7 of
    /// `reclaim`). The line may have passed over it and asked it for memory for a waiter behind
    /// it; kept in front, it would take that memory straight back (its swap-in fits once the
    /// chunk is out) and the one it gave to would never get it. Nothing when it is not in line.
    pub fn requeue(&self, slot: usize, now_ns: u64) {
        let me = &self.region.slots[slot];
        let since = me.wait_since_ns.load(SeqCst);
        if since != 0 {
            let _ = me
                .wait_since_ns
                .compare_exchange(since, now_ns.max(since), SeqCst, SeqCst);
        }
    }

    /// The place of `slot` in the GPU's line (since when it waits, CLOCK_MONOTONIC ns), if it
    /// stands in it: what a process keeps for its next wait (a [`Board::requeue`] moves it).
    pub fn wait_since(&self, slot: usize) -> Option<u64> {
        let since = self.region.slots[slot].wait_since_ns.load(SeqCst);
        (since != 0).then_some(since)
    }

    /// The process of `slot` no longer waits: it leaves the line.
    pub fn stop_waiting(&self, slot: usize) {
        let me = &self.region.slots[slot];
        me.wait_since_ns.store(0, SeqCst);
        me.wait_bytes.store(0, SeqCst);
        me.wait_borrow.store(0, SeqCst);
    }

    /// A needy tenant asks the tenant at `tenant` for `bytes` back; returns the new epoch.
    pub fn post_want(&self, tenant: usize, bytes: u64) -> u64 {
        let entry = &self.region.tenants[tenant];
        entry.want_bytes.fetch_add(bytes, SeqCst);
        entry.want_epoch.fetch_add(1, SeqCst) + 1
    }

    /// A needy tenant no longer waits for the `bytes` it asked the tenant at `tenant` for (its
    /// reclaim failed or timed out): what of that want is still untaken goes, so that the
    /// borrower does not move memory to host memory later for nobody.
    /// Returns what it withdrew: the rest of `bytes` was taken by the tenant's processes (being
    /// given, or given).
    pub fn withdraw_want(&self, tenant: usize, bytes: u64) -> u64 {
        let before = self.region.tenants[tenant]
            .want_bytes
            .fetch_update(SeqCst, SeqCst, |w| Some(w.saturating_sub(bytes)))
            .unwrap_or_else(|w| w);
        before.min(bytes)
    }

    /// A borrower's process takes what it was asked to give back (0 when nothing), so that two
    /// of its processes do not both act on one want.
    pub fn take_want(&self, tenant: usize) -> u64 {
        self.region.tenants[tenant].want_bytes.swap(0, SeqCst)
    }

    /// Reclaims the slots of processes that no longer run; returns how many.
    pub fn reclaim_dead(&self, reclaimer_pid: u32) -> usize {
        reclaim_dead_slots(
            &self.region.slots,
            &self.liveness,
            reclaimer_pid,
            |slot| (&slot.pid, &slot.start_time),
            |slot| {
                slot.resident_bytes.store(0, SeqCst);
                slot.swapped_bytes.store(0, SeqCst);
                // The staging was the dead process's pinned host memory: the OS freed it.
                slot.staging_bytes.store(0, SeqCst);
                slot.wait_since_ns.store(0, SeqCst);
                slot.wait_bytes.store(0, SeqCst);
                slot.tenant.store(0, SeqCst);
            },
        )
    }
}

#[cfg(test)]
#[path = "board_test.rs"]
mod tests;

#[cfg(test)]
#[path = "line_sim_test.rs"]
mod line_sim;
