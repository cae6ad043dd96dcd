//! Elastic memory in the tenant's process (issue 17, `docs/design/elastic-memory.md`): the GPU's
//! memory board as `hooks` uses it, the rule of which allocation paths may go past the tenant's
//! request, what a refusal tells the tenant, and what `cuMemGetInfo` and NVML report as free;
//! for the swap, the board's counters of a process (`SlotCounters`) and the needy side's bounded
//! wait (`wait_for_room`). Safe code; the board is mapped by `shm`, the borrowed memory backed by
//! `vmm`, and moved by `swap`.
//!
//! How the two shared files divide the work: the tenant's ledger (`tenant_abi::ledger`) keeps
//! everything the tenant holds on a device (allocations, borrowed ones included, and each
//! process's context overhead), and its limit is the tenant's **request**: an allocation the
//! ledger grants is within the request. The GPU's board (`tenant_abi::board`) keeps what every
//! tenant's allocations hold on the GPU (contexts are not on it: its capacity leaves room for
//! them, `BOARD_RESERVE_BYTES` in the agent), so an allocation past the request is granted only
//! while the GPU has that much free and the tenant stays within its **limit**. Every allocation
//! of a device with a board is on both; a borrowed one is charged to the ledger without its
//! limit check once the board granted it. Without a board file (or with a board that does not
//! describe the tenant) nothing changes: the request is a hard quota, as before elastic memory.

use crate::ledger::ProcLiveness;
use tenant_abi::board::{Board, Refusal};

/// How an allocation path may go past the tenant's request (the design's table).
#[derive(Clone, Copy)]
pub enum Borrow<'a> {
    /// `cuMemAlloc_v2`, `cuMemAllocPitch_v2`: borrowed memory is VMM-backed by the interposer,
    /// so that it can be swapped out and back under the same address. The function says what
    /// such an allocation takes (its size rounded to the driver's granularity), `None` when the
    /// driver cannot back it (then it may not borrow).
    Backed(&'a dyn Fn() -> Option<u64>),
    /// `cuMemCreate` by the application: allowed and counted as borrowed, but never swapped (the
    /// application owns the handle and maps it itself).
    Counted,
    /// May not borrow: the allocator's name, for the refusal's log line.
    Never(&'static str),
}

/// One GPU's board as this process uses it: the protocol over the mapping, and the index of the
/// tenant's entry.
pub struct DeviceBoard {
    pub board: Board<'static, ProcLiveness>,
    pub tenant: usize,
    /// The GPU's shared swap staging file, when the agent keeps one (mapped, not registered).
    pub staging: Option<crate::shm::StagingFile>,
}

impl DeviceBoard {
    /// The tenant's request and limit on this GPU, as the agent wrote them.
    pub fn request_and_limit(&self) -> (u64, u64) {
        self.board.region.request_and_limit(self.tenant)
    }
}

/// Maps the board of GPU `uuid` in `shm_dir` and finds `tenant` on it. `Ok(None)`: no board
/// there (no elastic memory on this GPU). An error says why a board that is there is not used.
pub fn open(
    shm_dir: &std::path::Path,
    tenant: &str,
    uuid: &str,
) -> Result<Option<DeviceBoard>, String> {
    let Some(region) = crate::shm::open_board(shm_dir, uuid)? else {
        return Ok(None);
    };
    let Some(index) = region.find(tenant) else {
        return Err(format!(
            "the memory board of GPU {uuid} does not describe tenant {tenant}"
        ));
    };
    let staging = crate::shm::open_staging(shm_dir, uuid).unwrap_or_else(|e| {
        crate::log::error(format_args!("{e}; this process pins its own swap staging"));
        None
    });
    Ok(Some(DeviceBoard {
        board: Board::new(region, ProcLiveness),
        tenant: index,
        staging,
    }))
}

/// The board's counters of this process's slot, as the swap moves chunks (`swap::Counters`).
pub struct SlotCounters<'b> {
    pub board: &'b DeviceBoard,
    pub slot: usize,
}

impl crate::swap::Counters for SlotCounters<'_> {
    fn swapped_out(&mut self, bytes: u64) {
        self.board.board.swapped_out(self.slot, bytes);
        // Given while in line: to the back of it (`Board::requeue`).
        self.board
            .board
            .requeue(self.slot, crate::shm::monotonic_ns());
    }

    fn room_for(&mut self, bytes: u64) -> bool {
        self.board
            .board
            .region
            .room_in_line(self.slot, bytes, crate::shm::monotonic_ns())
    }

    fn swap_in(&mut self, bytes: u64) -> bool {
        // Looked at first, so that a process retrying while the GPU is full does not count its
        // bytes resident for an instant at every try (others and the agent would see it).
        // Nor while other tenants' claims hold the room (`Board::claim`): the memory this
        // tenant gave back is theirs for a while.
        // And not past the waiters ahead of this process in the GPU's line (`line`).
        self.board
            .board
            .region
            .room_in_line(self.slot, bytes, crate::shm::monotonic_ns())
            && self.board.board.swap_in(self.slot, bytes)
    }

    fn swap_in_failed(&mut self, bytes: u64) {
        self.board.board.swapped_out(self.slot, bytes);
    }

    fn reserve_staging(&mut self, bytes: u64) -> bool {
        self.board.board.reserve_staging(self.slot, bytes)
    }

    fn release_staging(&mut self, bytes: u64) {
        self.board.board.release_staging(self.slot, bytes);
    }

    fn piece(&mut self) -> Option<u64> {
        let now = crate::shm::monotonic_ns();
        // No other tenant waits for a reclaim within its request (this one is never asked for
        // its own: rule 1 of `tenant_abi::reclaim`), or what their claims still hold is free
        // already: the pieces' room is not what they wait for.
        let region = self.board.board.region;
        (region.claimed_by_others(self.board.tenant, now) <= region.free())
            .then_some(crate::swap::PIECE_BYTES)
    }

    fn wait_for_staging(&mut self, bytes: u64) -> bool {
        let region = self.board.board.region;
        if region.staging_left() < bytes {
            // The other processes' watchers free the staging they keep idle (`hooks`).
            self.board.board.want_staging();
        }
        let began = std::time::Instant::now();
        loop {
            if region.staging_left() >= bytes {
                return true;
            }
            if began.elapsed() >= crate::swap::STAGING_WAIT {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn staging_short(&mut self) -> bool {
        staging_short(self.board.board.region)
    }

    fn staging_left_for(&mut self, bytes: u64) -> bool {
        self.board.board.region.staging_left() >= bytes
    }

    fn first_in_line(&mut self) -> bool {
        let (served, _) = self.board.board.region.served(crate::shm::monotonic_ns());
        served.is_some_and(|w| w.slot == self.slot)
    }
}

/// Whether the GPU's staging budget is short: less than a piece (`swap::PIECE_BYTES`, or a
/// quarter of a smaller budget) left. Then what is left is for swap-outs under way (an
/// exchange), not for pinning ahead, and a process waiting for its own chunks frees its idle
/// staging.
pub fn staging_short(region: &tenant_abi::board::Region) -> bool {
    region.staging_left() < crate::swap::PIECE_BYTES.min(region.staging_budget() / 4)
}

/// How long a tenant allocating within its request waits for the borrowers it asked to give the
/// memory back: their next hook call, then copies at tens of GB/s (`VGPU_MEMORY_SWAP=1`).
pub const RECLAIM_WAIT_MAX_MS: u64 = 5_000;
// A claim outlasts the wait it was made in (`tenant_abi::board::CLAIM_LAPSE_NS`).
const _: () = assert!(tenant_abi::board::CLAIM_LAPSE_NS >= RECLAIM_WAIT_MAX_MS * 1_000_000);

/// After this long without the room, the borrowers that have not given back what they were asked
/// (a kernel of theirs runs longer than that, or the process is stopped) are passed over and the
/// others asked for the rest (`reclaim::asks_past`): past the longest hint budget
/// (`VGPU_MEMORY_HINT_MS` is at most 2000), so that a helper still freeing is not passed over.
pub const RECLAIM_ESCALATE_MS: u64 = 2_500;
const _: () = assert!(RECLAIM_ESCALATE_MS < RECLAIM_WAIT_MAX_MS);

/// How a wait for a reclaim ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The room is there.
    Room,
    /// A borrower could not move its memory out: the node's swap staging is spent.
    SwapSpaceFull,
    /// Neither within [`RECLAIM_WAIT_MAX_MS`].
    TimedOut,
}

/// Polls `granted` every millisecond for at most [`RECLAIM_WAIT_MAX_MS`], giving up early when
/// `swap_space_full` says a borrower was refused staging (the room will not come from it), and
/// calling `escalate` once after [`RECLAIM_ESCALATE_MS`] without the room.
pub fn wait_for_room(
    mut granted: impl FnMut() -> bool,
    mut swap_space_full: impl FnMut() -> bool,
    mut escalate: impl FnMut(),
) -> Waited {
    for ms in 0..RECLAIM_WAIT_MAX_MS {
        if granted() {
            return Waited::Room;
        }
        if ms == RECLAIM_ESCALATE_MS {
            escalate();
        }
        if swap_space_full() {
            // Another borrower may still have made the room meanwhile.
            return if granted() {
                Waited::Room
            } else {
                Waited::SwapSpaceFull
            };
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if granted() {
        Waited::Room
    } else {
        Waited::TimedOut
    }
}

/// The line of an allocation within the tenant's request that a reclaim could not serve because
/// the borrowers' memory had nowhere to go: the node's swap staging is spent.
pub fn swap_space_full(what: &str, device: usize, tenant: &str) -> String {
    format!(
        "refused {what} on device {device}: it is within tenant {tenant}'s request, but other \
         tenants borrowed the GPU's memory and the node's swap space is full (their memory could \
         not be moved to host memory); raise the agent's swap_host_memory, or wait for the \
         borrowers to free memory (out of memory)"
    )
}

/// The borrower's line when the staging budget keeps `kept` bytes of its borrowed memory on the
/// GPU although other tenants asked for them.
pub fn staging_refused(tenant: &str, kept: u64, budget: u64, held: u64) -> String {
    format!(
        "other tenants asked tenant {tenant} for memory back, but the node's swap space is full: \
         {} of this process's borrowed memory stays on the GPU ({} of the {} this GPU may stage \
         in host memory are in use); raise the agent's swap_host_memory (VGPU_AGENT_SWAP_HOST_MEMORY) \
         so that borrowed memory can be swapped out",
        human(kept),
        human(held),
        human(budget)
    )
}

/// What a tenant may still allocate on a GPU now, as `cuMemGetInfo` and NVML report it free:
/// `min(limit, request + lendable now) - used`, where what is lendable to it now is what it
/// borrowed already plus what the GPU has free beyond the unused part of its own request. So:
/// within the request its unused request (a guaranteed request; the swap gives it back) or what
/// the GPU has free, whichever is more; past it, what the GPU has free; never past the limit.
pub fn allocatable(request: u64, limit: u64, used: u64, gpu_free: u64) -> u64 {
    assert!(limit >= request, "a limit is at least the request");
    let shown = limit
        .saturating_sub(used)
        .min(request.saturating_sub(used).max(gpu_free));
    assert!(used.saturating_add(shown) <= limit.max(used));
    shown
}

/// The log line of an allocation within the tenant's request that the board refused.
pub fn within_request_refused(what: &str, device: usize, tenant: &str, why: Refusal) -> String {
    match why {
        Refusal::NeedsReclaim { shortfall } => format!(
            "refused {what} on device {device}: it is within tenant {tenant}'s request, but \
             other tenants borrowed the GPU's memory ({} short) and taking borrowed memory back \
             (the swap) is off, or did not get it in time; wait for them to free it, or run the \
             tenants with the swap on (VGPU_MEMORY_SWAP unset or 1, and the agent's \
             swap_host_memory not 0) (out of memory)",
            human(shortfall)
        ),
        other => format!("refused {what} on device {device}: {other} (out of memory)"),
    }
}

/// The log line of an allocation past the tenant's request (`request`) that was refused.
pub fn borrow_refused(
    what: &str,
    device: usize,
    tenant: &str,
    request: u64,
    why: Refusal,
    swap_on: bool,
) -> String {
    match why {
        Refusal::NothingFree { free, .. } if swap_on => format!(
            "refused {what} on device {device}: past tenant {tenant}'s request of {} it borrows \
             what the GPU has free, and {} is free for it now (out of memory); a retry within {} \
             s waits in the GPU's line until there is room (as a caching allocator's retry after \
             freeing its cache does), or raise the request (--memory)",
            human(request),
            human(free),
            crate::line::RETRY_WINDOW.as_secs()
        ),
        Refusal::OverLimit { held, limit } => format!(
            "refused {what} on device {device}: tenant {tenant} holds {} of its memory limit of \
             {} (out of memory); raise the limit (--memory-limit) or allocate less",
            human(held),
            human(limit)
        ),
        Refusal::NothingFree { free, .. } => format!(
            "refused {what} on device {device}: past tenant {tenant}'s request of {} it borrows \
             what the GPU has free, and {} is free now (out of memory); wait for other tenants \
             to free memory, or raise the request (--memory)",
            human(request),
            human(free)
        ),
        Refusal::NeedsReclaim { shortfall } => format!(
            "refused {what} on device {device}: past tenant {tenant}'s request of {} the GPU is \
             {} short (out of memory); wait for other tenants to free memory, or raise the \
             request (--memory)",
            human(request),
            human(shortfall)
        ),
    }
}

/// The line a process waiting in its GPU's line says every so often: how long, for how much, how
/// many wait, and what ends it.
pub fn waiting_in_line(
    tenant: &str,
    device: usize,
    bytes: &str,
    waited: std::time::Duration,
    waiters: usize,
    bound: Option<std::time::Duration>,
) -> String {
    let end = match bound {
        Some(bound) => format!("it fails with out of memory after {} s", bound.as_secs()),
        None => format!(
            "it waits as long as it takes ({} bounds it)",
            tenant_abi::env::var::MEMORY_WAIT_S
        ),
    };
    format!(
        "tenant {tenant} has waited {} s on device {device} for {bytes} of borrowed memory (in \
         line with {} other process(es)): other tenants hold the GPU's memory, within their \
         requests or borrowed while they run; it goes on when they free it; {end}; to borrow \
         less, raise the request (--memory)",
        waited.as_secs(),
        waiters.saturating_sub(1)
    )
}

/// The line of a borrow refused because the GPU's line was stuck (`reclaim::stuck`).
pub fn stuck_line(what: &str, device: usize, tenant: &str) -> String {
    format!(
        "refused {what} on device {device} (out of memory): every process holding memory on \
         this GPU waits in its line for memory the others hold within their requests or have in \
         host memory, so nothing would ever be freed; this borrow of tenant {tenant}, the last in \
         line, is refused so that the others can go on; lower the requests of the GPU's tenants \
         (--memory) so that the GPU has memory to lend, or raise this tenant's request"
    )
}

/// The log line of an allocation past the request through a path that may not borrow.
pub fn may_not_borrow(what: &str, device: usize, tenant: &str, request: u64, path: &str) -> String {
    format!(
        "refused {what} on device {device}: past tenant {tenant}'s request of {} memory is \
         borrowed, and {path} cannot borrow (vgpu cannot move its memory out and back); use the \
         default allocator (cuMemAlloc) or raise the request (--memory) (out of memory)",
        human(request)
    )
}

/// The log line of memory the application maps itself (`cuMemCreate`) refused past the
/// tenant's request because it would overbook the GPU's requests (`left`: what it may still
/// borrow so).
pub fn unswappable_refused(
    what: &str,
    device: usize,
    tenant: &str,
    request: u64,
    left: u64,
) -> String {
    format!(
        "refused {what} on device {device}: memory the application maps itself (cuMemCreate, as \
         PyTorch's expandable_segments does) cannot be swapped out, so past tenant {tenant}'s \
         request of {} it borrows only memory that no tenant's request books and no one has \
         borrowed: {} is left (out of memory); raise the request (--memory), or allocate with \
         cuMemAlloc (PyTorch: expandable_segments:False), whose borrowed memory can be swapped",
        human(request),
        human(left)
    )
}

/// `10.00 GiB`, for messages.
pub fn human(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn free_is_the_unused_request_or_what_the_gpu_has_free_within_the_limit() {
        // Request 10, limit 40, nothing used: the GPU's 50 free are capped at the limit.
        assert_eq!(allocatable(10 * GIB, 40 * GIB, 0, 50 * GIB), 40 * GIB);
        // Others borrowed the GPU full: the unused request is still the tenant's.
        assert_eq!(allocatable(10 * GIB, 40 * GIB, 4 * GIB, GIB), 6 * GIB);
        // Past the request, only what is free.
        assert_eq!(allocatable(10 * GIB, 40 * GIB, 20 * GIB, 5 * GIB), 5 * GIB);
        assert_eq!(allocatable(10 * GIB, 40 * GIB, 38 * GIB, 5 * GIB), 2 * GIB);
        // A tenant without a limit of its own: its request, as a hard quota.
        assert_eq!(allocatable(10 * GIB, 10 * GIB, 3 * GIB, 70 * GIB), 7 * GIB);
        // Over (a context charged past the request): nothing, never an underflow.
        assert_eq!(allocatable(10 * GIB, 10 * GIB, 11 * GIB, 70 * GIB), 0);
    }

    #[test]
    fn refusals_say_what_to_do() {
        let over = borrow_refused(
            "1 GiB",
            0,
            "a",
            GIB,
            Refusal::OverLimit {
                held: 4 * GIB,
                limit: 4 * GIB,
            },
            true,
        );
        assert!(over.contains("raise the limit (--memory-limit)"), "{over}");
        let full = borrow_refused(
            "1 GiB",
            0,
            "a",
            GIB,
            Refusal::NothingFree {
                asked: GIB,
                free: 0,
            },
            false,
        );
        assert!(full.contains("wait for other tenants"), "{full}");
        let once = borrow_refused(
            "1 GiB",
            0,
            "a",
            GIB,
            Refusal::NothingFree {
                asked: GIB,
                free: 0,
            },
            true,
        );
        assert!(once.contains("a retry within 10 s waits"), "{once}");
        let waiting = waiting_in_line("a", 0, "1 GiB", std::time::Duration::from_secs(70), 3, None);
        assert!(
            waiting.contains("waited 70 s") && waiting.contains("2 other process(es)"),
            "{waiting}"
        );
        assert!(
            waiting.contains("VGPU_MEMORY_WAIT_S bounds it"),
            "{waiting}"
        );
        assert!(full.contains("raise the request (--memory)"), "{full}");
        let reclaim =
            within_request_refused("1 GiB", 0, "a", Refusal::NeedsReclaim { shortfall: GIB });
        assert!(reclaim.contains("(the swap) is off"), "{reclaim}");
        let never = may_not_borrow("1 GiB", 0, "a", GIB, "cuMemAllocAsync");
        assert!(never.contains("use the default allocator"), "{never}");
    }
}
