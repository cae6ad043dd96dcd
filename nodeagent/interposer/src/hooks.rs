//! The memory policy behind the hooks, in safe code: whether an allocation may proceed, what it
//! charged, what a free credits, and what the tenant is told about memory. `exports` calls these
//! around each real driver call; this module never calls the driver itself (the device, its uuid
//! and the swap's driver work come in through `Devices`, asked only when needed).
//!
//! Policy on failures:
//! - no `VGPU_TENANT`: everything passes through untouched;
//! - a broken configuration or an unusable ledger file: every allocation is refused with
//!   `CUDA_ERROR_OUT_OF_MEMORY` and a clear message (fail closed: running without the limit would
//!   take memory from the other tenants of the GPU); reporting shows the real figures;
//! - a panic inside this module: caught by `ffi_boundary!` in `exports`, which lets the call
//!   through to the real driver untracked (fail open, logged as a bug);
//! - over the limit: `CUDA_ERROR_OUT_OF_MEMORY`.
//!
//! Elastic memory (`elastic`): where the agent put a memory board for the GPU, an allocation past
//! the tenant's request (the ledger's limit) borrows what the GPU has free, up to the tenant's
//! limit, through the paths that may borrow; a borrowed `cuMemAlloc_v2` is VMM-backed
//! (`Ticket::borrowed` tells `exports`). With `VGPU_MEMORY_SWAP=1` (off by default) each
//! allocation, `cuMemGetInfo`, kernel launch and copy also runs the swap (`swap`): a want on the
//! tenant moves borrowed chunks out (after the process's launches and copies in progress reached
//! the driver and its queued work drained), a request that others borrowed asks them back and
//! waits, bounded, and a launch or copy of a process with a chunk out waits until every chunk is
//! back (`enter_work`, the hold rule).
//!
//! The compute side (launch gating) is `launch`, with its own failure policy (fail open).

use crate::elastic::{self, Borrow, DeviceBoard};
use crate::hint;
use crate::ledger::{Ledger, ProcLiveness, own_start_time};
use crate::line;
use crate::swap;
use crate::tracker::{Charge, Key, Tracker};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use tenant_abi::{DEVICES_MAX, MemoryEnv};

/// How often the swap's watcher looks at what staging to pin ahead (`warm_staging`) when
/// nothing was borrowed since its last look and that look pinned all it planned.
const WARM_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A borrowed chunk was added, or the last look stopped at `staging::WARM_STEP_MAX`: the
/// watcher's next look (10 ms later) pins ahead again, without waiting for [`WARM_EVERY`].
/// On an H200, borrowers asked 0.3-0.8 s after borrowing had nothing pinned ahead yet and
/// pinned during the reclaim, while a tenant within its request waited 1.2-2.5 s.
static WARM_NOW: AtomicBool = AtomicBool::new(false);

/// Each GPU's count of asks for idle staging (`Region::staging_wanted`) this process answered
/// (`free_wanted_staging`).
static STAGING_WANTED_SEEN: [std::sync::atomic::AtomicU64; DEVICES_MAX] =
    [const { std::sync::atomic::AtomicU64::new(0) }; DEVICES_MAX];

/// What `admit` decided.
#[derive(Debug)]
pub enum Admission {
    /// Not accounted (pass-through, or a device we do not limit or cannot name).
    Untracked,
    /// Charged; the caller reports the outcome with `commit` or `abort`.
    Charged(Ticket),
    /// Refused: the caller returns `CUDA_ERROR_OUT_OF_MEMORY` without calling the driver.
    Refused,
}

/// A reservation that the real allocation has not yet confirmed.
#[derive(Debug)]
#[must_use]
pub struct Ticket {
    slot: usize,
    device: usize,
    /// Charged to the ledger, and to the board when `on_board`.
    bytes: u64,
    /// The context's overhead charged with it to the ledger (the process's first charge on the
    /// device), and to the board too when `on_board` and within the request.
    overhead_bytes: u64,
    on_board: bool,
    borrowed: bool,
}

impl Ticket {
    /// What the ticket holds on the board: its bytes, and a context's overhead charged within
    /// the request (a borrow charges the overhead to the ledger only).
    fn board_bytes(&self) -> u64 {
        if self.borrowed {
            self.bytes
        } else {
            self.bytes.saturating_add(self.overhead_bytes)
        }
    }
}

impl Ticket {
    /// Past the tenant's request: a `cuMemAlloc_v2` or `cuMemAllocPitch_v2` must then be
    /// VMM-backed, and a driver that cannot back it refuses it.
    pub fn borrowed(&self) -> bool {
        self.borrowed
    }
}

/// Where an allocation goes, as `exports` learns it from the driver (asked only when needed).
pub trait Devices {
    /// The CUDA ordinal of the device the allocation or query is for.
    fn current(&self) -> Option<i32>;
    /// The uuid (`GPU-...`) of the device with this CUDA ordinal: names its memory board.
    fn uuid(&self, ordinal: usize) -> Option<String>;
    /// The swap's driver work (`VGPU_MEMORY_SWAP=1`), if this call may do it.
    type Backing: swap::Backing;
    fn backing(&self) -> Option<Self::Backing>;
    /// The current context (0: none), recorded with a borrowed chunk: what a swap-out drains.
    fn context(&self) -> usize;
    /// Waits, at most `swap::DRAIN_WAIT_MAX_MS`, for the work queued in `contexts` (the current
    /// context if empty) to finish; whether it did.
    fn drain(&self, contexts: &[usize]) -> bool;
    /// Makes `context` current on the calling thread (the watcher's: the swap's copies need a
    /// current context); whether it is.
    fn make_current(&self, _context: usize) -> bool {
        false
    }
}

enum Mode {
    PassThrough,
    Broken(String),
    Enforcing(Box<Enforcer>),
}

struct Enforcer {
    config: MemoryEnv,
    ledger: OnceLock<Result<Ledger<'static, ProcLiveness>, String>>,
    /// Each GPU's memory board, looked for once (`None`: no elastic memory on it).
    boards: [OnceLock<Option<DeviceBoard>>; DEVICES_MAX],
    /// `VGPU_MEMORY_SWAP=1`: borrowed chunks go out when others want memory back, and a request
    /// that others borrowed asks them (off by default; see `swap_on`).
    swap: bool,
    process: Mutex<Process>,
}

/// This process's view: its slots, its live allocations, which devices paid the context overhead.
struct Process {
    pid: u32,
    slot: Option<usize>,
    /// Its slot on each GPU's board, claimed at its first allocation there.
    board_slots: [Option<usize>; DEVICES_MAX],
    /// Its borrowed, VMM-backed allocations on each GPU: what the swap may move.
    chunks: [swap::Chunks; DEVICES_MAX],
    /// The contexts its borrowed chunks were allocated in: what a swap-out drains first.
    chunk_contexts: BTreeSet<usize>,
    tracker: Tracker,
    overhead_charged: [bool; DEVICES_MAX],
    /// A want handed to this process's hint helper, waiting for it (`hint`).
    hint: Option<hint::Phase>,
    /// Until when a helper of a process without swappable chunks takes no want: its last hint
    /// left a rest this process could not swap, given back to the tenant's other processes,
    /// and taking it again at once would only ask the helper again and again.
    hint_rest_until: Option<std::time::Instant>,
    /// When a borrow of this process last found each GPU full and was refused: a borrow within
    /// `line::RETRY_WINDOW` of it waits in line instead.
    borrow_refused_at: [Option<std::time::Instant>; DEVICES_MAX],
    /// Its place in each GPU's line (since when, CLOCK_MONOTONIC ns) and when its last wait
    /// there ended: a wait within `line::RETRY_WINDOW` of that keeps the place, so that a
    /// process allocating piece after piece is not put behind the waiters it was ahead of at
    /// every piece (they would then ask it for the memory it just got).
    line_place: [Option<(u64, std::time::Instant)>; DEVICES_MAX],
    /// What its last borrow in line stood in line for on each GPU: the next one within
    /// `line::RETRY_WINDOW` stands for twice that (at most what the tenant may borrow), so that a
    /// framework growing piece by piece asks the other waiters in a few rounds, not one a piece.
    line_need: [u64; DEVICES_MAX],
    /// The watcher stood this process in the GPU's line for its chunks out while it made no hook
    /// call (`Enforcer::watch_once`): it leaves the line when they are back.
    watcher_in_line: [bool; DEVICES_MAX],
}

/// Whether the watcher stands this process in a GPU's line (`Process::watcher_in_line` on any
/// device): its looks go on until it has left, after the chunks came back.
static WATCHER_STOOD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Process {
    fn new() -> Process {
        Process {
            pid: std::process::id(),
            slot: None,
            board_slots: [None; DEVICES_MAX],
            chunks: std::array::from_fn(|_| swap::Chunks::default()),
            chunk_contexts: BTreeSet::new(),
            tracker: Tracker::default(),
            overhead_charged: [false; DEVICES_MAX],
            hint: None,
            hint_rest_until: None,
            borrow_refused_at: [None; DEVICES_MAX],
            line_place: [None; DEVICES_MAX],
            line_need: [0; DEVICES_MAX],
            watcher_in_line: [false; DEVICES_MAX],
        }
    }
}

fn mode() -> &'static Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    MODE.get_or_init(
        || match MemoryEnv::from_lookup(|name| std::env::var(name).ok()) {
            Ok(None) => Mode::PassThrough,
            Ok(Some(config)) => {
                crate::log::debug(format_args!(
                    "tenant {} limits {:?}",
                    config.tenant, config.limits_bytes
                ));
                Mode::Enforcing(Box::new(Enforcer {
                    config,
                    ledger: OnceLock::new(),
                    boards: [const { OnceLock::new() }; DEVICES_MAX],
                    swap: swap::Asked::from_env().on(),
                    process: Mutex::new(Process::new()),
                }))
            }
            Err(e) => Mode::Broken(format!(
                "{e}; every GPU allocation of this process is refused"
            )),
        },
    )
}

/// Whether a tenant is configured (hooks then substitute themselves in `dlsym` and
/// `cuGetProcAddress` answers).
pub fn enabled() -> bool {
    !matches!(mode(), Mode::PassThrough)
}

/// Logs `message` the first time only (a broken setup would otherwise log on every call).
fn error_once(message: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        crate::log::error(format_args!("{message}"));
    }
}

impl Enforcer {
    /// Whether the swap is on: asked for (`VGPU_MEMORY_SWAP` is not `0`) and every copy path of the
    /// driver held (`swap::copy_paths_held`, checked at load; said once there if not).
    fn swap_on(&self) -> bool {
        self.swap && swap::copy_paths_held()
    }

    fn ledger(&self) -> Result<&Ledger<'static, ProcLiveness>, &str> {
        self.ledger
            .get_or_init(|| {
                crate::shm::open(&self.config).map(|region| Ledger::new(region, ProcLiveness))
            })
            .as_ref()
            .map_err(String::as_str)
    }

    /// The process state, reset after a `fork` (the child owns none of the parent's charges).
    fn process(&self) -> MutexGuard<'_, Process> {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        if process.pid != std::process::id() {
            *process = Process::new();
            swap::forked();
            hint::forked();
        }
        process
    }

    fn slot(&self, ledger: &Ledger<'static, ProcLiveness>, process: &mut Process) -> Option<usize> {
        if process.slot.is_none() {
            process.slot = ledger.claim_slot(process.pid, own_start_time());
            if process.slot.is_none() {
                error_once(&format!(
                    "all {} process slots of tenant {} are in use by live processes; GPU \
                     allocations of this process are refused",
                    crate::ledger::SLOTS,
                    self.config.tenant
                ));
            }
        }
        process.slot
    }

    /// The board of `device` if an earlier [`Enforcer::board`] opened one (no lookup now).
    fn opened_board(&self, device: usize) -> Option<&DeviceBoard> {
        self.boards[device].get()?.as_ref()
    }

    /// The board of `device` if the agent put one in the tenant's directory and the device is
    /// limited; looked for once per process (`uuid` is asked then).
    fn board(&self, device: usize, uuid: impl FnOnce() -> Option<String>) -> Option<&DeviceBoard> {
        self.config.limits_bytes[device]?;
        self.boards[device]
            .get_or_init(|| {
                let uuid = uuid()?;
                match elastic::open(&self.config.shm_dir, &self.config.tenant, &uuid) {
                    Ok(found) => found,
                    Err(e) => {
                        crate::log::error(format_args!(
                            "{e}; memory past the request is not lent on device {device} (the \
                             request is a hard quota there)"
                        ));
                        None
                    }
                }
            })
            .as_ref()
    }

    /// This process's slot on `board`, claimed on first use.
    fn board_slot(
        &self,
        board: &DeviceBoard,
        device: usize,
        process: &mut Process,
    ) -> Option<usize> {
        if process.board_slots[device].is_none() {
            process.board_slots[device] =
                board
                    .board
                    .claim_slot(process.pid, own_start_time(), board.tenant);
            if process.board_slots[device].is_none() {
                error_once(&format!(
                    "all {} process slots of the memory board of device {device} are in use by \
                     live processes; GPU allocations of this process there are refused",
                    tenant_abi::board::SLOTS
                ));
            }
        }
        process.board_slots[device]
    }

    fn admit(
        &self,
        devices: &impl Devices,
        device: usize,
        bytes: u64,
        borrow: Borrow<'_>,
    ) -> Admission {
        let ledger = match self.ledger() {
            Ok(ledger) => ledger,
            Err(e) => {
                error_once(&format!(
                    "{e}; every GPU allocation of this process is refused"
                ));
                return Admission::Refused;
            }
        };
        // A context's overhead (bytes 0) goes on the board too: the GPU must have the room
        // for it, taken back from borrowers if need be, before the driver creates the context.
        let board = self.board(device, || devices.uuid(device));
        // Held in an `Option` so that a wait in the GPU's line can let go of it between looks
        // (`wait_in_line`): the process's other threads allocate and free meanwhile.
        let mut locked = Some(self.process());
        let process = locked.as_mut().expect("locked above");
        let Some(slot) = self.slot(ledger, process) else {
            return Admission::Refused;
        };
        let board_slot = match board {
            Some(board) => match self.board_slot(board, device, process) {
                Some(board_slot) => Some((board, board_slot)),
                None => return Admission::Refused,
            },
            None => None,
        };
        if let Some((board, board_slot)) = board_slot {
            self.poll_swap(devices, board, (device, board_slot), process);
        }
        let overhead_bytes = if process.overhead_charged[device] {
            0
        } else {
            self.config.context_overhead_bytes[device]
        };
        if bytes == 0 && overhead_bytes == 0 {
            // A context already paid for (or charged nothing): nothing to reserve, and nothing
            // to refuse even if the tenant is at its limit.
            return Admission::Untracked;
        }
        let refused = match ledger.reserve(slot, device, bytes.saturating_add(overhead_bytes)) {
            Ok(()) => {
                return self.within_request(
                    ledger,
                    process,
                    (slot, board_slot),
                    device,
                    (bytes, overhead_bytes),
                );
            }
            Err(refused) => refused,
        };
        if let Some((board, board_slot)) = board_slot
            && board.request_and_limit().1 > refused.limit_bytes
        {
            if !matches!(borrow, Borrow::Never(_))
                && !self.held_back(devices, board, (device, board_slot), &mut locked)
            {
                return Admission::Refused;
            }
            return self.borrow(
                devices,
                ledger,
                &mut locked,
                (slot, board, board_slot),
                device,
                (bytes, overhead_bytes),
                borrow,
            );
        }
        let what = if bytes == 0 {
            format!(
                "a CUDA context ({} charged per process and GPU, VGPU_CONTEXT_OVERHEAD)",
                human(overhead_bytes)
            )
        } else {
            human(bytes.saturating_add(overhead_bytes))
        };
        crate::log::error(format_args!(
            "refused {what} on device {device}: tenant {} holds {} of its {} (out of memory)",
            self.config.tenant,
            human(refused.used_bytes),
            human(refused.limit_bytes),
        ));
        Admission::Refused
    }

    /// A process with borrowed memory in host memory borrows more only once all of it is back
    /// (the hold rule): it waits in the GPU's line for it (`line`; no bound unless
    /// `VGPU_MEMORY_WAIT_S`); whether it is back (always, without the swap).
    fn held_back<'s>(
        &'s self,
        devices: &impl Devices,
        board: &DeviceBoard,
        (device, board_slot): (usize, usize),
        locked: &mut Option<MutexGuard<'s, Process>>,
    ) -> bool {
        let process = locked.as_mut().expect("locked by the caller");
        if !self.swap_on() || !process.chunks[device].held() {
            return true;
        }
        let back = self.wait_in_line(
            devices,
            board,
            (device, board_slot),
            locked,
            false,
            |process| process.chunks[device].out_bytes(),
            |_, process| (!process.chunks[device].held()).then_some(()),
        );
        let back = back == line::End::Done(());
        if !back {
            crate::log::error(format_args!(
                "refused to borrow more on device {device}: this process's borrowed memory is \
                 still in host memory after {} s in line ({}); other tenants hold the GPU's \
                 memory (out of memory)",
                line::wait_max().unwrap_or_default().as_secs(),
                tenant_abi::env::var::MEMORY_WAIT_S
            ));
        }
        back
    }

    /// Waits in the GPU's line (`tenant_abi::board`, "The line") for `need` more bytes resident,
    /// until `done` says the wait is over, or `VGPU_MEMORY_WAIT_S` passed, or (a `borrow` only)
    /// the line is stuck and this borrow is the one refused (`reclaim::stuck`, for
    /// `line::STUCK_GRACE`). At each look: stands in line, acts on wants posted on this tenant
    /// and brings its chunks back when there is room for them (`poll_swap`), and, first in line,
    /// asks the other waiters for the borrowed memory it lacks (`reclaim::unstall`); says how
    /// long it has waited after `line::REPORT_FIRST` and every `line::REPORT_EVERY`. Leaves the
    /// line, and withdraws what it asked that nobody took, when it ends.
    #[allow(clippy::too_many_arguments)]
    fn wait_in_line<'s, T>(
        &'s self,
        devices: &impl Devices,
        board: &DeviceBoard,
        (device, board_slot): (usize, usize),
        locked: &mut Option<MutexGuard<'s, Process>>,
        borrow: bool,
        need: impl Fn(&Process) -> u64,
        mut done: impl FnMut(&Self, &mut Process) -> Option<T>,
    ) -> line::End<T> {
        let mut pace = line::Pace::new(std::time::Instant::now(), line::wait_max());
        let mut asked = Vec::new();
        let mut stuck_since = None;
        let mut movement = None;
        let since_ns = match locked.as_ref().expect("locked").line_place[device] {
            Some((since_ns, left)) if left.elapsed() < line::RETRY_WINDOW => since_ns,
            _ => crate::shm::monotonic_ns(),
        };
        let ended = loop {
            let process = locked.get_or_insert_with(|| self.process());
            board
                .board
                .wait(board_slot, need(process), borrow, since_ns);
            self.poll_swap(devices, board, (device, board_slot), process);
            if let Some(ended) = done(self, process) {
                break line::End::Done(ended);
            }
            let now = std::time::Instant::now();
            if pace.unstall_due(now) {
                // A process that died holding memory frees it here, not only at the agent's
                // next look (room is judged from the slots before anything is reserved).
                board.board.reclaim_dead(std::process::id());
                unstall(board, board_slot, &mut asked);
                // A line where memory moved since the last look is not stuck, whatever the
                // rule's arithmetic says: the grace starts again (on an H200 a job's borrow was
                // refused while another's swap-out was still landing its pieces).
                let moved = board.board.region.movement();
                if movement.replace(moved) != Some(moved) {
                    stuck_since = None;
                }
                if borrow && refused_by_stuck_line(board, board_slot) {
                    let since = *stuck_since.get_or_insert(now);
                    if now.saturating_duration_since(since) >= line::STUCK_GRACE {
                        break line::End::Yielded;
                    }
                } else {
                    stuck_since = None;
                }
            }
            if pace.report_due(now) {
                self.report_waiting(board, device, need(process), pace.waited(now));
            }
            if pace.expired(now) {
                break line::End::TimedOut;
            }
            // Unlocked while it sleeps: another thread of the process may free what it waits for.
            *locked = None;
            std::thread::sleep(pace.look_after(now));
        };
        let process = locked.get_or_insert_with(|| self.process());
        // The place it stood at (later than `since_ns` if it gave memory back meanwhile:
        // `Board::requeue`), kept for its next wait.
        let place = board.board.wait_since(board_slot).unwrap_or(since_ns);
        board.board.stop_waiting(board_slot);
        withdraw_asks(board, &asked);
        process.line_place[device] = Some((place, std::time::Instant::now()));
        ended
    }

    /// One line: this process has waited `waited` in line on `device` for `bytes`, why, and
    /// what would end it.
    fn report_waiting(
        &self,
        board: &DeviceBoard,
        device: usize,
        bytes: u64,
        waited: std::time::Duration,
    ) {
        crate::log::error(format_args!(
            "{}",
            elastic::waiting_in_line(
                &self.config.tenant,
                device,
                &human(bytes),
                waited,
                board.board.region.waiters().len(),
                line::wait_max(),
            )
        ));
    }

    /// An allocation the ledger granted (within the request): on a GPU with a board, reserved
    /// there too, or (the board refused: others borrowed the memory) given back to the ledger
    /// and refused unless a reclaim gets it (`reclaimed`).
    fn within_request(
        &self,
        ledger: &Ledger<'static, ProcLiveness>,
        process: &mut Process,
        (slot, board_slot): (usize, Option<(&DeviceBoard, usize)>),
        device: usize,
        (bytes, overhead_bytes): (u64, u64),
    ) -> Admission {
        if let Some((board, _)) = board_slot {
            // Growing within the request: a room claim of this tenant lasts on.
            board
                .board
                .refresh_claim(board.tenant, crate::shm::monotonic_ns());
        }
        // The context's overhead with it: contexts hold GPU memory that the board must see, or
        // a new process of a tenant finds the GPU full of borrowed memory and its context
        // creation fails (the third of three jobs on an H200 did).
        let on_board = bytes.saturating_add(overhead_bytes);
        if let Some((board, board_slot)) = board_slot
            && let Err(why) = board.board.reserve(board_slot, on_board)
        {
            let waited = self.reclaimed(board, board_slot, on_board, why);
            if waited != Some(elastic::Waited::Room) {
                ledger.release(slot, device, bytes.saturating_add(overhead_bytes));
                let tenant = &self.config.tenant;
                let what = if bytes == 0 {
                    format!("a CUDA context ({})", human(overhead_bytes))
                } else {
                    human(on_board)
                };
                let line = match waited {
                    Some(elastic::Waited::SwapSpaceFull) => {
                        elastic::swap_space_full(&what, device, tenant)
                    }
                    _ => elastic::within_request_refused(&what, device, tenant, why),
                };
                crate::log::error(format_args!("{line}"));
                return Admission::Refused;
            }
        }
        process.overhead_charged[device] |= overhead_bytes > 0;
        Admission::Charged(Ticket {
            slot,
            device,
            bytes,
            overhead_bytes,
            on_board: board_slot.is_some(),
            borrowed: false,
        })
    }

    /// An allocation of `bytes` past the tenant's request (the ledger refused it) on a GPU with a
    /// board that lends past it: granted when the path may borrow, the board has that much free
    /// and the tenant stays within its limit; then charged to the ledger without its check.
    #[allow(clippy::too_many_arguments)]
    fn borrow<'s>(
        &'s self,
        devices: &impl Devices,
        ledger: &Ledger<'static, ProcLiveness>,
        locked: &mut Option<MutexGuard<'s, Process>>,
        (slot, board, board_slot): (usize, &DeviceBoard, usize),
        device: usize,
        (bytes, overhead_bytes): (u64, u64),
        borrow: Borrow<'_>,
    ) -> Admission {
        let tenant = &self.config.tenant;
        let (request, _) = board.request_and_limit();
        let charged = match borrow {
            Borrow::Never(path) => {
                crate::log::error(format_args!(
                    "{}",
                    elastic::may_not_borrow(&human(bytes), device, tenant, request, path)
                ));
                return Admission::Refused;
            }
            Borrow::Counted => bytes,
            Borrow::Backed(rounded) => match rounded() {
                Some(rounded) => rounded,
                None => {
                    crate::log::error(format_args!(
                        "{}",
                        elastic::may_not_borrow(
                            &human(bytes),
                            device,
                            tenant,
                            request,
                            "this driver (it lacks virtual memory management)"
                        )
                    ));
                    return Admission::Refused;
                }
            },
        };
        assert!(
            charged >= bytes,
            "a borrowed allocation is charged at least its size"
        );
        // A context this process has not paid for yet stays within the request.
        if overhead_bytes > 0 && ledger.reserve(slot, device, overhead_bytes).is_err() {
            crate::log::error(format_args!(
                "refused {} on device {device}: the CUDA context's {} does not fit in tenant \
                 {tenant}'s request (out of memory)",
                human(bytes),
                human(overhead_bytes)
            ));
            return Admission::Refused;
        }
        // Paid for now, so that another thread of the process allocating on this GPU while this
        // borrow waits in line (unlocked) does not pay for the context again; undone if refused.
        let overhead_was = {
            let process = locked.as_mut().expect("locked by the caller");
            let was = process.overhead_charged[device];
            process.overhead_charged[device] |= overhead_bytes > 0;
            was
        };
        let region = board.board.region;
        // Memory the swap cannot take back must not overbook the GPU's requests: borrowed only
        // from what no request books and no one borrowed (`Region::booked_or_lent_with`).
        if matches!(borrow, Borrow::Counted) {
            let after = region.booked_or_lent_with(board.tenant, charged);
            if after > region.capacity() {
                ledger.release(slot, device, overhead_bytes);
                locked.as_mut().expect("locked").overhead_charged[device] = overhead_was;
                let left = region
                    .capacity()
                    .saturating_sub(region.booked_or_lent_with(board.tenant, 0));
                crate::log::error(format_args!(
                    "{}",
                    elastic::unswappable_refused(&human(bytes), device, tenant, request, left)
                ));
                return Admission::Refused;
            }
        }
        // Room another tenant's request holds after a reclaim is not lent again (`Board::claim`);
        // a GPU full without claims is the board's refusal below.
        // One look at the claims first: without any, no scan of the slots here.
        let claimed = region.claimed_by_others(board.tenant, crate::shm::monotonic_ns());
        // With the swap on, the borrow waits in the GPU's line instead (`room_in_line` leaves
        // the claims their room): refused here, a caching allocator's retry after freeing its
        // cache failed too, and the job with it (the second of three jobs on an H200).
        let held_for_others = !self.swap_on() && claimed > 0 && {
            let after = region.resident_total().saturating_add(charged);
            after <= region.capacity() && after.saturating_add(claimed) > region.capacity()
        };
        if held_for_others {
            ledger.release(slot, device, overhead_bytes);
            locked.as_mut().expect("locked").overhead_charged[device] = overhead_was;
            crate::log::error(format_args!(
                "refused {} on device {device}: it is past tenant {tenant}'s request ({}), and \
                 the memory the GPU has free is held for other tenants' requests, which they \
                 took back from borrowers moments ago; allocate within the request, or try again \
                 later (out of memory)",
                human(bytes),
                human(request)
            ));
            return Admission::Refused;
        }
        let reserved = if self.swap_on() {
            self.borrow_in_line(devices, board, (device, board_slot), locked, charged)
        } else {
            board.board.reserve(board_slot, charged)
        };
        let process = locked.get_or_insert_with(|| self.process());
        match reserved {
            Ok(_) => {
                ledger.charge(slot, device, charged);
                Admission::Charged(Ticket {
                    slot,
                    device,
                    bytes: charged,
                    overhead_bytes,
                    on_board: true,
                    borrowed: true,
                })
            }
            Err(why) => {
                ledger.release(slot, device, overhead_bytes);
                process.overhead_charged[device] = overhead_was;
                crate::log::error(format_args!(
                    "{}",
                    elastic::borrow_refused(
                        &human(charged),
                        device,
                        tenant,
                        request,
                        why,
                        self.swap_on()
                    )
                ));
                Admission::Refused
            }
        }
    }

    /// A borrow of `bytes` with the swap on: granted when there is room for it beside the
    /// waiters ahead of it in the GPU's line and other tenants' claims. Without room, the first
    /// time it is refused at once (a caching allocator then frees what it caches and tries
    /// again); a borrow of this process on this GPU within `line::RETRY_WINDOW` of that waits in
    /// line until there is room, or its limit refuses it, or `VGPU_MEMORY_WAIT_S` passed.
    fn borrow_in_line<'s>(
        &'s self,
        devices: &impl Devices,
        board: &DeviceBoard,
        (device, board_slot): (usize, usize),
        locked: &mut Option<MutexGuard<'s, Process>>,
        bytes: u64,
    ) -> Result<tenant_abi::board::Grant, tenant_abi::board::Refusal> {
        let process = locked.as_mut().expect("locked by the caller");
        let region = board.board.region;
        let attempt = || {
            if region.room_in_line(board_slot, bytes, crate::shm::monotonic_ns()) {
                match board.board.reserve(board_slot, bytes) {
                    Err(tenant_abi::board::Refusal::NothingFree { .. }) => None,
                    reserved => Some(reserved),
                }
            } else {
                // Past the limit no room serves it: refused now, not after a wait for room.
                board.board.over_limit(board_slot, bytes).map(Err)
            }
        };
        if let Some(reserved) = attempt() {
            return reserved;
        }
        // The room may be held by a process that died and nobody reclaimed yet (the agent looks
        // once a second, the waiters at their looks): freed here, it is no reason to refuse (a
        // caching allocator that does not retry would get out of memory for free memory).
        if board.board.reclaim_dead(std::process::id()) > 0
            && let Some(reserved) = attempt()
        {
            return reserved;
        }
        let now = std::time::Instant::now();
        let retried = process.borrow_refused_at[device]
            .is_some_and(|at| now.saturating_duration_since(at) < line::RETRY_WINDOW);
        let nothing_free = || tenant_abi::board::Refusal::NothingFree {
            asked: bytes,
            free: region.free_in_line(board_slot, crate::shm::monotonic_ns()),
        };
        if !retried {
            process.borrow_refused_at[device] = Some(now);
            process.line_need[device] = 0;
            return Err(nothing_free());
        }
        let (request, limit) = board.request_and_limit();
        let appetite = process.line_need[device]
            .saturating_mul(2)
            .min(limit.saturating_sub(request));
        let stand_for = bytes.max(appetite);
        let waited = self.wait_in_line(
            devices,
            board,
            (device, board_slot),
            locked,
            true,
            |process| stand_for.saturating_add(process.chunks[device].out_bytes()),
            |_, _| attempt(),
        );
        // A borrow that waited keeps the process in waiting mode: its next one within the
        // window waits at once (a framework growing piece by piece is refused once, not at
        // every piece).
        let process = locked.get_or_insert_with(|| self.process());
        process.borrow_refused_at[device] = Some(std::time::Instant::now());
        process.line_need[device] = stand_for;
        if !matches!(waited, line::End::Done(_)) {
            process.borrow_refused_at[device] = None;
            process.line_need[device] = 0;
        }
        match waited {
            line::End::Done(reserved) => reserved,
            line::End::TimedOut => Err(nothing_free()),
            line::End::Yielded => {
                crate::log::error(format_args!(
                    "{}",
                    elastic::stuck_line(&human(bytes), device, &self.config.tenant)
                ));
                Err(nothing_free())
            }
        }
    }

    /// The swap's part of every hook call on a GPU with a board (`VGPU_MEMORY_SWAP=1`): gives
    /// back what other tenants want of this tenant (its borrowed chunks, largest first, to host
    /// memory), and brings chunks back when the GPU has room again. A swap-out happens at a
    /// kernel boundary: new launches and copies of the process are stopped and those in progress
    /// reach the driver first (`swap::quiesce`), then its queued work drains (`Devices::drain`,
    /// bounded); if either does not in time, nothing moves and the want stays posted.
    fn poll_swap(
        &self,
        devices: &impl Devices,
        board: &DeviceBoard,
        (device, board_slot): (usize, usize),
        process: &mut Process,
    ) {
        if !self.swap_on() {
            return;
        }
        let mut want = self.want_after_hints(board, device, process);
        if want > 0 && !process.chunks[device].any_resident() {
            // Nothing of this process to swap (its helper took the want): for its tenant's
            // other processes, and not taken again by this one for a while.
            board.board.post_want(board.tenant, want);
            process.hint_rest_until = Some(std::time::Instant::now() + hint::REST_AFTER_UNMET);
            want = 0;
        }
        let chunks = &process.chunks[device];
        if want == 0 && !chunks.held() {
            if crate::staging::any_pooled()
                && let Some(mut backing) = devices.backing()
            {
                // Staging kept for reuse that idled too long is freed (`staging`).
                swap::Backing::trim(
                    &mut backing,
                    device,
                    &mut elastic::SlotCounters {
                        board,
                        slot: board_slot,
                    },
                );
            }
            return;
        }
        let Some(mut backing) = devices.backing() else {
            if want > 0 {
                board.board.post_want(board.tenant, want);
            }
            return;
        };
        let mut counters = elastic::SlotCounters {
            board,
            slot: board_slot,
        };
        if want > 0 {
            self.give_back(
                devices,
                (board, device),
                want,
                process,
                &mut backing,
                &mut counters,
            );
        } else if process.chunks[device].held() {
            // Not in the call that gave chunks back: that room is the needy tenant's.
            process.chunks[device].take_back(&mut backing, &mut counters);
            // Still held (its chunks come back piece by piece, or not yet): on a short budget the
            // staging its swap-ins emptied goes back to it, for the giver's next pieces (the
            // process waits anyway, and another process cannot use its pool).
            if process.chunks[device].held() && swap::Counters::staging_short(&mut counters) {
                swap::Backing::release_idle(&mut backing, device, &mut counters);
            }
        }
        swap::publish(&process.chunks);
    }

    /// What of a want on the tenant this process should swap out on `device` now, hints first:
    /// with a hint helper registered (`hint`), a want taken from the board goes to the helper
    /// (nothing is swapped now); once the helper met it, nothing is swapped; once its budget ran
    /// out (or it said it is done), what it did not free is. Without a helper, the want as taken.
    /// While a stream captures a graph, a synchronisation would invalidate the capture: a want
    /// to swap waits for the next call.
    fn want_after_hints(&self, board: &DeviceBoard, device: usize, process: &mut Process) -> u64 {
        let capturing = crate::launch::captures_in_progress();
        if let Some(phase) = process.hint {
            if phase.device != device {
                // One hint at a time; a want on this device waits on the board.
                return 0;
            }
            let next = phase.next(
                std::time::Instant::now(),
                hint::budget(),
                hint::Phase::helper_done(),
            );
            let remaining = match next {
                hint::Next::Wait => return 0,
                hint::Next::Met { freed } => {
                    crate::log::error(format_args!(
                        "other tenants asked tenant {} for {} of the GPU's memory back: this \
                         process's hint helper freed {} within {} ms, so nothing was swapped",
                        self.config.tenant,
                        human(phase.asked),
                        human(freed),
                        phase.started.elapsed().as_millis()
                    ));
                    0
                }
                hint::Next::Swap { freed, remaining } => {
                    crate::log::error(format_args!(
                        "other tenants asked tenant {} for {} of the GPU's memory back: this \
                         process's hint helper freed {} in {} ms (its budget is {} ms, \
                         {}); the swap moves the rest",
                        self.config.tenant,
                        human(phase.asked),
                        human(freed),
                        phase.started.elapsed().as_millis(),
                        hint::budget().as_millis(),
                        tenant_abi::env::var::MEMORY_HINT_MS
                    ));
                    remaining
                }
            };
            process.hint = None;
            phase.end();
            if remaining > 0 && capturing {
                board.board.post_want(board.tenant, remaining);
                return 0;
            }
            return remaining;
        }
        let swappable = process.chunks[device].any_resident();
        let resting = process
            .hint_rest_until
            .is_some_and(|until| std::time::Instant::now() < until);
        let helper = hint::registered() && (swappable || !resting);
        let take = (swappable && !capturing) || helper;
        let want = if take {
            board.board.take_want(board.tenant)
        } else {
            0
        };
        if want > 0 && helper {
            process.hint = Some(hint::Phase::start(device, want, std::time::Instant::now()));
            return 0;
        }
        want
    }

    /// Moves chunks of `device` out for a want of `want` bytes, at a kernel boundary (see
    /// `poll_swap`); a want it could not act on (or met only in part) goes back on the board.
    fn give_back<B: swap::Backing>(
        &self,
        devices: &impl Devices<Backing = B>,
        (board, device): (&DeviceBoard, usize),
        want: u64,
        process: &mut Process,
        backing: &mut B,
        counters: &mut elastic::SlotCounters<'_>,
    ) {
        assert!(want > 0);
        let began = std::time::Instant::now();
        let Some(quiet) = swap::quiesce() else {
            board.board.post_want(board.tenant, want);
            return;
        };
        let quiet_at = began.elapsed();
        let contexts: Vec<usize> = process.chunk_contexts.iter().copied().collect();
        let drained = devices.drain(&contexts);
        let drained_at = began.elapsed();
        if !drained {
            drop(quiet);
            board.board.post_want(board.tenant, want);
            crate::log::error(format_args!(
                "other tenants asked tenant {} for {} of the GPU's memory back, but this \
                 process's queued GPU work did not finish within {} ms; nothing was moved (it is \
                 tried again at its next launch, copy or allocation)",
                self.config.tenant,
                human(want),
                swap::DRAIN_WAIT_MAX_MS
            ));
            return;
        }
        let given_back = process.chunks[device].give_back(want, backing, counters);
        let given = given_back.bytes;
        let moved_at = began.elapsed();
        if given > 0 {
            let unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            board.board.record_reclaim(board.tenant, given, unix_ms);
        }
        // Published before new launches may enter again (`quiet` dropped below).
        swap::publish(&process.chunks);
        drop(quiet);
        if given_back.refused_for_staging > 0 {
            // The staging budget is per GPU, so the tenant's other processes would be refused
            // too: the want is dropped, and the tenant waiting for it is told (`reclaimed`).
            board.board.swap_refused();
            let region = board.board.region;
            crate::log::error(format_args!(
                "{}",
                elastic::staging_refused(
                    &self.config.tenant,
                    given_back.refused_for_staging,
                    region.staging_budget(),
                    region.staging_total()
                )
            ));
        } else if given < want {
            // The rest is for the tenant's other processes.
            board.board.post_want(board.tenant, want - given);
        }
        if given == 0 {
            return;
        }
        // Each phase's time, so that a slow reclaim says where its time went.
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let times = given_back.times;
        crate::log::error(format_args!(
            "other tenants asked tenant {} for {} of the GPU's memory back: {} of this \
             process's borrowed memory went to host memory after its queued work finished (it \
             comes back when the GPU has room; its launches and copies wait until then); \
             quiet after {:.1} ms, drained after {:.1} ms more, moved in {:.1} ms more \
             (pinning {:.1} ms for {} of new staging, copies at {:.1} GB/s); waiting {:.1} ms \
             of it for staging being pinned ahead",
            self.config.tenant,
            human(want),
            human(given),
            ms(quiet_at),
            ms(drained_at - quiet_at),
            ms(moved_at - drained_at),
            times.pinning_ns as f64 / 1e6,
            human(times.pinned_bytes),
            times.copy_gb_per_s(),
            times.staging_wait_ns as f64 / 1e6,
        ));
    }

    /// The hold rule at a launch or copy of a process with swappable chunks (`enter_work`):
    /// acts on a want posted for it (once: a want it cannot act on now does not hold the call),
    /// then, while a chunk is out, waits in the line of each GPU where one is (`line`: its
    /// chunks come back when there is room for them; first in line, it asks the other waiters
    /// for their borrowed memory), as long as it takes unless `VGPU_MEMORY_WAIT_S` bounds it:
    /// `None` after that bound (the caller refuses the launch or copy).
    fn enter_work(&self, devices: &impl Devices) -> Option<swap::InFlight> {
        let mut pace = line::Pace::new(std::time::Instant::now(), line::wait_max());
        let mut asked: [Asked; DEVICES_MAX] = std::array::from_fn(|_| Vec::new());
        let mut in_line = [false; DEVICES_MAX];
        let entered = loop {
            if let Some(entered) = swap::try_enter(|| !self.want_posted()) {
                break Some(entered);
            }
            let now = std::time::Instant::now();
            let unstall_due = pace.unstall_due(now);
            let report_due = pace.report_due(now);
            let mut out_bytes = 0u64;
            let mut coming_back = false;
            {
                let mut process = self.process();
                for (device, board, board_slot) in self.board_slots(&process) {
                    self.poll_swap(devices, board, (device, board_slot), &mut process);
                    coming_back |= process.chunks[device].coming_back();
                    let out = process.chunks[device].out_bytes();
                    if out == 0 {
                        if in_line[device] {
                            board.board.stop_waiting(board_slot);
                            in_line[device] = false;
                        }
                        continue;
                    }
                    out_bytes += out;
                    board
                        .board
                        .wait(board_slot, out, false, crate::shm::monotonic_ns());
                    in_line[device] = true;
                    if unstall_due {
                        board.board.reclaim_dead(process.pid);
                        unstall(board, board_slot, &mut asked[device]);
                    }
                    if report_due {
                        self.report_waiting(board, device, out, pace.waited(now));
                    }
                }
            }
            // Acted on (or could not act on: a capture in progress, a drain that did not finish,
            // and the want is posted again): only a chunk out holds the call now.
            if let Some(entered) = swap::try_enter(|| true) {
                break Some(entered);
            }
            if pace.expired(now) && out_bytes > 0 {
                break None;
            }
            // While its chunks come back piece by piece (an exchange: the next piece lands every
            // ~20 ms), it looks every millisecond, not at the slow pace of a long wait.
            std::thread::sleep(if coming_back {
                line::FAST_LOOK
            } else {
                pace.look_after(now)
            });
        };
        let process = self.process();
        for (device, board, board_slot) in self.board_slots(&process) {
            if in_line[device] {
                board.board.stop_waiting(board_slot);
            }
            withdraw_asks(board, &asked[device]);
        }
        entered
    }

    /// One look of the watcher (`watch`): a want posted on this tenant while this process makes
    /// no hook call (idle, or computing on the CPU) is acted on here, and chunks out come back
    /// when there is room, as the process's own next call would; nothing when the process's lock
    /// is taken (its own thread is in a hook call, and acts itself).
    fn watch_once(&self, devices: &impl Devices) {
        if !self.swap_on() {
            return;
        }
        self.warm_staging(devices);
        self.free_wanted_staging(devices);
        if !self.want_posted() && !swap::any_out() && !WATCHER_STOOD.load(Ordering::Relaxed) {
            return;
        }
        let Some((mut process, context)) = self.watched_process() else {
            return;
        };
        if !devices.make_current(context) {
            return;
        }
        for (device, board, board_slot) in self.board_slots(&process) {
            self.poll_swap(devices, board, (device, board_slot), &mut process);
            // A process with chunks out can run nothing until they are back: it waits, calls or
            // not. Standing in the GPU's line for them, its resident borrowed memory is idle
            // memory the line may ask for (`reclaim::unstall`: waiters give); an idle process
            // not in line was a runner, never asked, and a waiter for its memory waited for
            // ever. Not when it stands there already (its own wait, whose bytes are its own).
            let out = process.chunks[device].out_bytes();
            if out > 0 {
                if board.board.wait_since(board_slot).is_none() {
                    board
                        .board
                        .wait(board_slot, out, false, crate::shm::monotonic_ns());
                    process.watcher_in_line[device] = true;
                }
            } else if std::mem::take(&mut process.watcher_in_line[device]) {
                board.board.stop_waiting(board_slot);
            }
        }
        WATCHER_STOOD.store(
            process.watcher_in_line.iter().any(|&stood| stood),
            Ordering::Relaxed,
        );
    }

    /// The process's state for the watcher thread, if it is free now (the watcher never waits
    /// for the application's calls), this process's (not a child's after `fork` that has not
    /// called a hook yet), and with a context its chunks were allocated in: the one to make
    /// current for the copies.
    fn watched_process(&self) -> Option<(MutexGuard<'_, Process>, usize)> {
        let process = match self.process.try_lock() {
            Ok(process) => process,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if process.pid != std::process::id() {
            return None;
        }
        let context = *process.chunk_contexts.iter().next()?;
        Some((process, context))
    }

    /// Staging pinned ahead for this process's resident borrowed chunks, once a
    /// [`WARM_EVERY`] at most, from the watcher (`staging::warm`): the plan is made under the
    /// process's lock (which chunks are resident), the pinning without it (so that the
    /// application's calls do not wait for it). The process's share of the GPU's swap budget:
    /// half of what the other processes of the GPU leave of it, so that each next borrower
    /// still finds room, and a swap-out that needs more than what was pinned ahead still can.
    fn warm_staging(&self, devices: &impl Devices) {
        static NEXT_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let any_staging_file = || {
            (0..DEVICES_MAX).any(|device| {
                self.opened_board(device)
                    .is_some_and(|board| board.staging.is_some())
            })
        };
        if !swap::any_chunk() || !(crate::staging::warm_on() || any_staging_file()) {
            return;
        }
        let now = crate::shm::monotonic_ns();
        if now < NEXT_NS.load(std::sync::atomic::Ordering::Relaxed)
            && !WARM_NOW.load(Ordering::Relaxed)
        {
            return;
        }
        let (context, plans) = {
            // A look that finds the process's lock taken is not spent: the next one (10 ms
            // later) tries again. Spent, the next try came a second later, and a busy PyTorch
            // job registered 960 MiB of the staging file while it borrowed 28 GiB, then pinned
            // 5 GiB of its own in the reclaim (H200, docs/benchmarks.md).
            let Some((process, context)) = self.watched_process() else {
                return;
            };
            WARM_NOW.store(false, Ordering::Relaxed);
            NEXT_NS.store(
                now + WARM_EVERY.as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            let plans: Vec<_> = self
                .board_slots(&process)
                .into_iter()
                .map(|(device, board, slot)| {
                    (
                        device,
                        board,
                        slot,
                        process.chunks[device].resident_in_giving_order(),
                    )
                })
                .filter(|(_, _, _, chunks)| !chunks.is_empty())
                .collect();
            (context, plans)
        };
        if plans.is_empty() || !devices.make_current(context) {
            return;
        }
        let Some(mut backing) = devices.backing() else {
            return;
        };
        for (device, board, slot, chunks) in plans {
            let region = board.board.region;
            let mine = region.slots[slot]
                .staging_bytes
                .load(std::sync::atomic::Ordering::SeqCst);
            let others = region.staging_total().saturating_sub(mine);
            let cap = region.staging_budget().saturating_sub(others) / 2;
            // The GPU's shared staging file, registered on a thread of its own from the first
            // borrow on, as far as this process's resident borrowed chunks need past the slabs
            // others hold; once a slab is, swap-outs claim its slabs, and pinning ahead (below)
            // is for what its free registered slabs do not cover. Not capped as pinning ahead
            // is: registering the file's pages takes none of the budget, and a giver registered
            // only half of what the others left pinned 6 GiB of its own in the middle of an
            // exchange on an H200, at a third of the link's rate (docs/benchmarks.md).
            if let (Some(file), Some(driver)) = (board.staging, crate::real::driver()) {
                let need: u64 = chunks
                    .iter()
                    .map(|&bytes| crate::staging::whole_slabs(bytes, file.slab_bytes))
                    .sum();
                let want = crate::staging::shared_want(&file, slot, need);
                crate::staging::register_shared(driver, device, file, slot, context, want);
            }
            if !crate::staging::warm_on() {
                continue;
            }
            // With the file ready, pinning ahead is for the chunks its registered free slabs do
            // not cover (a registration behind the borrowing, or slabs others hold).
            let chunks = match crate::staging::shared_free_registered(device) {
                Some((free, slab)) => crate::staging::uncovered_by_shared(&chunks, free, slab),
                None => chunks,
            };
            if chunks.is_empty() {
                continue;
            }
            if elastic::staging_short(region) {
                // A short budget is for swap-outs under way (an exchange), not for pinning ahead.
                continue;
            }
            let mut counters = elastic::SlotCounters { board, slot };
            let pinned = swap::Backing::warm(&mut backing, device, &chunks, cap, &mut counters);
            if pinned >= crate::staging::WARM_STEP_MAX {
                // Perhaps more to pin: again at the next look, after the watcher has acted on
                // any want in between.
                WARM_NOW.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Frees the staging this process keeps idle (pooled for reuse, or pinned ahead) on each GPU
    /// where another process's swap-out asked for idle staging since the last look
    /// (`Board::want_staging`): without it, that swap-out was refused, and the tenant waiting for
    /// the memory got an out-of-memory error, while staging sat idle here for up to
    /// `VGPU_MEMORY_STAGING_IDLE_MS`. Each ask is answered once; when the process's lock is
    /// taken, at the next look.
    fn free_wanted_staging(&self, devices: &impl Devices) {
        let wanted: Vec<(usize, u64)> = (0..DEVICES_MAX)
            .filter_map(|device| {
                let now = self.opened_board(device)?.board.region.staging_wanted();
                (now != STAGING_WANTED_SEEN[device].load(Ordering::Relaxed))
                    .then_some((device, now))
            })
            .collect();
        if wanted.is_empty() {
            return;
        }
        if !crate::staging::any_pooled() {
            // Nothing idle here: the asks are answered.
            for &(device, now) in &wanted {
                STAGING_WANTED_SEEN[device].store(now, Ordering::Relaxed);
            }
            return;
        }
        // The slots under the process's lock; the unpinning without it, as the pinning ahead.
        let (slots, context) = {
            let Some((process, context)) = self.watched_process() else {
                return;
            };
            (process.board_slots, context)
        };
        if !devices.make_current(context) {
            return;
        }
        let Some(mut backing) = devices.backing() else {
            return;
        };
        for (device, now) in wanted {
            STAGING_WANTED_SEEN[device].store(now, Ordering::Relaxed);
            let (Some(board), Some(slot)) = (self.opened_board(device), slots[device]) else {
                continue;
            };
            let mut counters = elastic::SlotCounters { board, slot };
            swap::Backing::release_idle(&mut backing, device, &mut counters);
        }
    }

    /// The GPUs where this process holds a board slot: (CUDA ordinal, board, slot).
    fn board_slots(&self, process: &Process) -> Vec<(usize, &DeviceBoard, usize)> {
        (0..DEVICES_MAX)
            .filter_map(|device| {
                let board = self.opened_board(device)?;
                Some((device, board, process.board_slots[device]?))
            })
            .collect()
    }

    /// Whether a want is posted on this tenant on a GPU where this process has a resident chunk
    /// (shared loads only; no lock).
    fn want_posted(&self) -> bool {
        if hint::in_progress() {
            // Driven to its end by the process's calls (`want_after_hints`).
            return true;
        }
        let resident_on = swap::resident_on();
        (0..DEVICES_MAX)
            .filter(|d| resident_on & (1 << d) != 0)
            .any(|device| {
                self.opened_board(device).is_some_and(|board| {
                    board.board.region.tenants[board.tenant]
                        .want_bytes
                        .load(std::sync::atomic::Ordering::SeqCst)
                        != 0
                })
            })
    }

    /// An allocation within the request that the board refused because others borrowed the
    /// memory (`VGPU_MEMORY_SWAP=1`): asks the borrowers the reclaim planner picks for the rest
    /// of the tenant's request (`tenant_abi::reclaim::owed` and `plan`, wants on the board) and
    /// waits, bounded, until they gave this allocation's room back, or a borrower says the
    /// node's swap space is full. `None`: no reclaim was tried; `Some(Waited::Room)`: granted
    /// (then it is reserved on the board).
    fn reclaimed(
        &self,
        board: &DeviceBoard,
        board_slot: usize,
        bytes: u64,
        why: tenant_abi::board::Refusal,
    ) -> Option<elastic::Waited> {
        if !self.swap_on() || !matches!(why, tenant_abi::board::Refusal::NeedsReclaim { .. }) {
            return None;
        }
        let region = board.board.region;
        let holders = region.holders();
        // The rest of the request is asked for at once and held for this tenant (rule 4 of
        // `tenant_abi::reclaim`, `Board::claim`): one round at the borrowers, not one per piece.
        let owed = tenant_abi::reclaim::owed(&holders, &self.config.tenant, bytes);
        // The claim goes up before the plan, and the plan counts as free only the room other
        // tenants' claims leave: two tenants reclaiming at once each saw the same free room,
        // each asked the borrower for its own need less that room, the borrower gave the sum,
        // and each then found the room it counted on held by the other's claim (on the fake
        // driver both waited out their 2.5 s bound and asked again).
        let now = crate::shm::monotonic_ns();
        board.board.claim_from(board_slot, board.tenant, owed, now);
        let unclaimed = region
            .free()
            .saturating_sub(region.claimed_by_others(board.tenant, now));
        // And from what the borrowers hold net of what others asked them for and they have not
        // taken yet (`reclaim::net_of_untaken`).
        let givers = tenant_abi::reclaim::net_of_untaken(
            &holders,
            &region.untaken_wants(),
            &self.config.tenant,
        );
        let asks = match tenant_abi::reclaim::plan(&givers, &self.config.tenant, owed, unclaimed) {
            Ok(asks) => asks,
            Err(e) => {
                board.board.drop_claim(board.tenant);
                crate::log::error(format_args!("no reclaim: {e}"));
                return None;
            }
        };
        if asks.is_empty() {
            board.board.drop_claim(board.tenant);
        }
        // Read before the wants go out: a borrower refused staging for them counts after.
        let refusals = region.swap_refusals();
        let resident_of = |name: &str| {
            region
                .holders()
                .into_iter()
                .find(|h| h.name == name)
                .map_or(0, |h| h.resident)
        };
        // What each asked borrower held when asked, to tell later who gave nothing back.
        let mut asks: Vec<(String, u64, u64)> = asks
            .into_iter()
            .map(|(name, asked)| {
                let held = resident_of(&name);
                (name, asked, held)
            })
            .collect();
        for (name, asked, _) in &asks {
            if let Some(index) = region.find(name) {
                board.board.post_want(index, *asked);
            }
        }
        // Charged before the room is there, so that the room the borrowers make is this
        // tenant's: a borrower swapping back in, or a new borrow, sees the GPU full until then.
        // The process's other threads wait for its state meanwhile (bounded, like this wait).
        board.board.charge(board_slot, bytes);
        let mut passed_over = Vec::new();
        let waited = elastic::wait_for_room(
            || region.fits(),
            || region.swap_refusals() != refusals,
            || {
                // Rule 8 of `tenant_abi::reclaim`: the borrowers that gave nothing back yet are
                // passed over (their untaken wants withdrawn) and the others asked for what is
                // still short and asked of nobody: also when every borrower gave something (two
                // needy tenants asking at once may both have asked one borrower for all it had).
                let slow: Vec<String> = asks
                    .iter()
                    .filter(|(name, _, held)| resident_of(name) >= *held)
                    .map(|(name, _, _)| name.clone())
                    .collect();
                let short = region.resident_total().saturating_sub(region.capacity());
                if short == 0 {
                    return;
                }
                for (name, asked, _) in asks.iter().filter(|(name, _, _)| slow.contains(name)) {
                    if let Some(index) = region.find(name) {
                        board.board.withdraw_want(index, *asked);
                    }
                }
                let more = tenant_abi::reclaim::asks_past(
                    &region.holders(),
                    &self.config.tenant,
                    short,
                    &slow,
                    &region.untaken_wants(),
                );
                if slow.is_empty() {
                    if more.is_empty() {
                        return;
                    }
                    crate::log::error(format_args!(
                        "tenant {}'s reclaim is {} short after {} ms although every borrower \
                         asked gave (another tenant asked them for the same memory at once); \
                         asking {} for it",
                        self.config.tenant,
                        human(short),
                        elastic::RECLAIM_ESCALATE_MS,
                        more.iter()
                            .map(|(name, _)| name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                    for (name, asked) in more {
                        if let Some(index) = region.find(&name) {
                            board.board.post_want(index, asked);
                            let held = resident_of(&name);
                            asks.push((name, asked, held));
                        }
                    }
                    return;
                }
                // A stopped process gives nothing until it continues: say which, so that the
                // wait has a cause a person can act on.
                let stopped: Vec<String> = slow
                    .iter()
                    .filter_map(|name| Some((name, region.find(name)?)))
                    .flat_map(|(name, index)| {
                        region
                            .holding_pids(index)
                            .into_iter()
                            .filter(|&pid| tenant_abi::ledger::is_stopped(pid))
                            .map(move |pid| format!("{pid} (tenant {name})"))
                    })
                    .collect();
                if !stopped.is_empty() {
                    crate::log::error(format_args!(
                        "process(es) {} are stopped (a stop signal or a debugger) and hold \
                         borrowed memory tenant {} asked for: it comes back only when they \
                         continue (kill -CONT)",
                        stopped.join(", "),
                        self.config.tenant
                    ));
                }
                crate::log::error(format_args!(
                    "tenant(s) {} gave nothing back of what tenant {} asked for within {} ms (a \
                     kernel running longer, or a stopped process); asking {} for the {} still \
                     missing",
                    slow.join(", "),
                    self.config.tenant,
                    elastic::RECLAIM_ESCALATE_MS,
                    if more.is_empty() {
                        "nobody else (no other tenant borrowed)".to_owned()
                    } else {
                        more.iter()
                            .map(|(name, _)| name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                    human(short)
                ));
                for (name, asked) in more {
                    if let Some(index) = region.find(&name) {
                        board.board.post_want(index, asked);
                        let held = resident_of(&name);
                        asks.push((name, asked, held));
                    }
                }
                passed_over = slow;
            },
        );
        if waited != elastic::Waited::Room {
            board.board.release(board_slot, bytes);
            // Nothing is coming: the room held for this tenant is of no use to it, nor are the
            // wants no borrower has taken yet.
            board.board.drop_claim(board.tenant);
            for (name, asked, _) in &asks {
                if passed_over.contains(name) {
                    continue;
                }
                if let Some(index) = region.find(name) {
                    board.board.withdraw_want(index, *asked);
                }
            }
        }
        if waited == elastic::Waited::TimedOut {
            crate::log::error(format_args!(
                "asked {} borrower(s) for {} of tenant {}'s request; it was not given back \
                 within {} ms",
                asks.len(),
                human(bytes),
                self.config.tenant,
                elastic::RECLAIM_WAIT_MAX_MS
            ));
        }
        Some(waited)
    }

    /// The board slot of `device` for crediting, if this process charged that board.
    fn charged_board(&self, device: usize) -> Option<(&DeviceBoard, usize)> {
        let board = self.opened_board(device)?;
        let slot = self.process().board_slots[device]?;
        Some((board, slot))
    }
}

/// One ask of a process first in line (`unstall`) on another tenant's processes.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// The tenant's index on the board.
    tenant: usize,
    /// Posted as a want and not known to be taken.
    posted: u64,
    /// Taken by the tenant's processes (being given, or given).
    taken: u64,
    /// What the tenant held resident when asked.
    resident_then: u64,
    at: std::time::Instant,
}

/// What a process first in line asked of other tenants and may still withdraw.
pub type Asked = Vec<Ask>;

/// Withdraws what `asked` posted that nobody took (a wait ended).
fn withdraw_asks(board: &DeviceBoard, asked: &[Ask]) {
    for ask in asked {
        board.board.withdraw_want(ask.tenant, ask.posted);
    }
}

/// First in the GPU's line, this process asks the other waiters' tenants for the borrowed memory
/// it lacks (`tenant_abi::reclaim::unstall`): wants on the board, recorded in `asked`. What the
/// previous round asked and nobody took yet is withdrawn first, so that a want is never posted
/// twice for one need; while what was taken is still on its way (`line::still_giving`), nothing
/// is asked again.
fn unstall(board: &DeviceBoard, board_slot: usize, asked: &mut Asked) {
    let region = board.board.region;
    let now = crate::shm::monotonic_ns();
    let (served, waiters) = region.served(now);
    let Some(first) = served.filter(|first| first.slot == board_slot) else {
        return;
    };
    let holders = region.holders();
    let resident_of = |index: usize| {
        holders
            .iter()
            .find(|h| region.find(&h.name) == Some(index))
            .map_or(0, |h| h.resident)
    };
    // Untaken asks withdrawn; taken ones kept while their bytes are on their way.
    asked.retain_mut(|ask| {
        ask.taken += ask.posted - board.board.withdraw_want(ask.tenant, ask.posted);
        ask.posted = 0;
        line::still_giving(
            ask.taken,
            ask.resident_then,
            resident_of(ask.tenant),
            ask.at.elapsed(),
        )
    });
    if !asked.is_empty() {
        return;
    }
    let room = region.free_in_line(board_slot, now);
    for (name, bytes) in tenant_abi::reclaim::unstall(&holders, &waiters, &first, room) {
        if let Some(index) = region.find(&name) {
            board.board.post_want(index, bytes);
            asked.push(Ask {
                tenant: index,
                posted: bytes,
                taken: 0,
                resident_then: resident_of(index),
                at: std::time::Instant::now(),
            });
        }
    }
}

/// Whether this process swaps (a tenant's, `VGPU_MEMORY_SWAP=1`, every copy path held).
pub fn swap_enabled() -> bool {
    matches!(mode(), Mode::Enforcing(enforcer) if enforcer.swap_on())
}

/// One look of the swap's watcher thread (`exports::watch`), started at a process's first
/// swappable chunk: see `Enforcer::watch_once`.
pub fn watch_once(devices: &impl Devices) {
    if let Mode::Enforcing(enforcer) = mode() {
        enforcer.watch_once(devices);
    }
}

/// Whether the GPU's line is stuck (`tenant_abi::reclaim::stuck`) and the borrow of this
/// process's `board_slot` is the one to refuse.
fn refused_by_stuck_line(board: &DeviceBoard, board_slot: usize) -> bool {
    // Whether a swap-out was refused for want of staging since this process last looked.
    static SEEN_REFUSALS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let region = board.board.region;
    let refusals = region.swap_refusals();
    let refused_since = SEEN_REFUSALS.swap(refusals, Ordering::SeqCst) != refusals;
    region.stuck(crate::shm::monotonic_ns(), refused_since) == Some(board_slot)
}

/// The hold rule at a kernel launch or a copy (`exports`, before the driver call): a process
/// with a chunk of borrowed memory in host memory launches and copies nothing until every chunk
/// is back, and a want posted on its tenant is acted on here (at a kernel boundary) as at an
/// allocation. `Some`: go ahead, and keep the guard until the driver call returned; `None`: a
/// chunk is still out after `VGPU_MEMORY_WAIT_S` in the GPU's line, if that is set (logged; the
/// caller refuses the call with `CUDA_ERROR_OUT_OF_MEMORY`, never lets it through). A process
/// without swappable chunks pays one relaxed load.
pub fn enter_work(devices: &impl Devices, what: &str) -> Option<swap::InFlight> {
    if !swap::any_chunk() {
        return Some(swap::InFlight::uncounted());
    }
    let Mode::Enforcing(enforcer) = mode() else {
        return Some(swap::InFlight::uncounted());
    };
    if swap::inherited() {
        // A child after `fork`: its parent's counts are not its own (reset with its state).
        drop(enforcer.process());
        if !swap::any_chunk() {
            return Some(swap::InFlight::uncounted());
        }
    }
    let entered = enforcer.enter_work(devices);
    if entered.is_none() {
        crate::log::error(format_args!(
            "refused {what} (out of memory): this process's borrowed memory is still in host \
             memory after {} s in line ({}), and a kernel or copy must not run while it is (it \
             could touch it); other tenants hold the GPU's memory; retry later, unset {} to wait \
             as long as it takes, or raise tenant {}'s request (--memory) so that it borrows less",
            line::wait_max().unwrap_or_default().as_secs(),
            tenant_abi::env::var::MEMORY_WAIT_S,
            tenant_abi::env::var::MEMORY_WAIT_S,
            enforcer.config.tenant
        ));
    }
    entered
}

/// Decides whether an allocation of `bytes` on `devices.current()` (asked only when a tenant is
/// configured) may go to the driver; `borrow` says whether and how it may go past the request.
pub fn admit(devices: &impl Devices, bytes: u64, borrow: Borrow<'_>) -> Admission {
    match mode() {
        Mode::PassThrough => Admission::Untracked,
        Mode::Broken(message) => {
            error_once(message);
            Admission::Refused
        }
        Mode::Enforcing(enforcer) => {
            match devices.current().and_then(|d| usize::try_from(d).ok()) {
                Some(device) if device < DEVICES_MAX => {
                    enforcer.admit(devices, device, bytes, borrow)
                }
                _ => Admission::Untracked,
            }
        }
    }
}

/// The driver refused, for want of memory, an allocation within the tenant's request that the
/// GPU's board granted: the GPU holds more than the board counts (contexts, libraries' workspaces
/// and the driver's own use past what the agent keeps back), while borrowers hold memory past their
/// requests. The request is guaranteed, so the borrowers are asked for its bytes (rule 2's order,
/// as for a reclaim) and the caller tries the driver again while they give it. Returns the asks
/// posted (board tenant index, bytes), for [`withdraw_driver_asks`]; empty when there is nobody
/// to ask (no board, the swap off, a borrow, or no borrower).
pub fn ask_borrowers_for_driver(ticket: &Ticket) -> Vec<(usize, u64)> {
    let Mode::Enforcing(enforcer) = mode() else {
        return Vec::new();
    };
    if ticket.borrowed || !ticket.on_board || !enforcer.swap_on() {
        return Vec::new();
    }
    let Some(board) = enforcer.opened_board(ticket.device) else {
        return Vec::new();
    };
    let region = board.board.region;
    let tenant = &enforcer.config.tenant;
    // Its own charge for this allocation is on the board already: the plan sees it as wanted.
    let mut holders = region.holders();
    if let Some(me) = holders.iter_mut().find(|h| &h.name == tenant) {
        me.resident = me.resident.saturating_sub(ticket.board_bytes());
    }
    let Ok(asks) = tenant_abi::reclaim::plan(&holders, tenant, ticket.bytes, 0) else {
        return Vec::new();
    };
    let mut posted = Vec::new();
    for (name, bytes) in asks {
        if let Some(index) = region.find(&name) {
            board.board.post_want(index, bytes);
            posted.push((index, bytes));
        }
    }
    if !posted.is_empty() {
        crate::log::error(format_args!(
            "the driver has no memory for {} within tenant {tenant}'s request on device {}, \
             though the GPU's board counts it free (contexts and libraries use more than the \
             board reserves for them): asking the borrowers for it",
            human(ticket.bytes),
            ticket.device
        ));
    }
    posted
}

/// Withdraws what [`ask_borrowers_for_driver`] posted and nobody took.
pub fn withdraw_driver_asks(ticket: &Ticket, asks: &[(usize, u64)]) {
    let Mode::Enforcing(enforcer) = mode() else {
        return;
    };
    if let Some(board) = enforcer.opened_board(ticket.device) {
        for &(index, bytes) in asks {
            board.board.withdraw_want(index, bytes);
        }
    }
}

/// Decides whether this process may create a CUDA context on `device`: charges the device's
/// context overhead (once per process and device, like the first allocation would) and refuses
/// with `CUDA_ERROR_OUT_OF_MEMORY` when the context would not fit in the slice. So a tenant
/// cannot exceed its slice by starting many processes whose contexts it was never charged for.
///
/// Only a full slice (or a full process table) refuses: a broken configuration or ledger lets the
/// context be created (every allocation is refused anyway, with the message that says why). The caller reports the outcome
/// with `context_created` or `abort`.
pub fn admit_context(devices: &impl Devices, device: i32) -> Admission {
    let Mode::Enforcing(enforcer) = mode() else {
        return Admission::Untracked;
    };
    let Some(device) = usize::try_from(device).ok().filter(|&d| d < DEVICES_MAX) else {
        return Admission::Untracked;
    };
    if enforcer.ledger().is_err() {
        return Admission::Untracked;
    }
    // On the GPU's board too, within the request: a GPU full of borrowed memory gives the
    // context's room back first (`within_request`).
    enforcer.admit(devices, device, 0, Borrow::Never("a CUDA context"))
}

/// The driver created (or retained) the context `admit_context` charged for: the charge stays
/// until the process exits (its slot is then reclaimed), since the context's memory does too.
pub fn context_created(ticket: Ticket) {
    assert_eq!(
        ticket.bytes, 0,
        "a context ticket charges only the overhead"
    );
}

/// The driver allocated `key`; `bytes` is what it really took (it may differ from the ticket,
/// e.g. a pitched allocation), charged without a limit check since it already exists.
pub fn commit(ticket: Ticket, key: Key, bytes: u64, context: usize) {
    let Mode::Enforcing(enforcer) = mode() else {
        unreachable!("a ticket exists only while enforcing")
    };
    let Ok(ledger) = enforcer.ledger() else {
        unreachable!("a ticket exists only with a ledger")
    };
    let board = ticket
        .on_board
        .then(|| enforcer.charged_board(ticket.device))
        .flatten();
    assert_eq!(
        board.is_some(),
        ticket.on_board,
        "a board ticket has a board slot"
    );
    if bytes > ticket.bytes {
        ledger.charge(ticket.slot, ticket.device, bytes - ticket.bytes);
        if let Some((board, slot)) = board {
            board.board.charge(slot, bytes - ticket.bytes);
        }
    } else {
        ledger.release(ticket.slot, ticket.device, ticket.bytes - bytes);
        if let Some((board, slot)) = board {
            board.board.release(slot, ticket.bytes - bytes);
        }
    }
    let charge = Charge {
        device: ticket.device,
        bytes,
        on_board: ticket.on_board,
        borrowed: ticket.borrowed,
    };
    let stale = {
        let mut process = enforcer.process();
        if let (true, true, Key::Pointer(address)) = (enforcer.swap_on(), ticket.borrowed, key) {
            // A borrowed pointer is VMM-backed (`exports`): the swap may move it.
            process.chunks[ticket.device].add(address, bytes);
            // Its staging is pinned ahead from the watcher's next look, not a second later: a
            // borrower may be asked for it at once (`warm_staging`).
            WARM_NOW.store(true, Ordering::Relaxed);
            if context != 0 {
                process.chunk_contexts.insert(context);
            }
            swap::publish(&process.chunks);
        }
        process.tracker.insert(key, charge)
    };
    if let Some(stale) = stale {
        // Freed through a path we do not see; the driver reuses the address now.
        credit_to(enforcer, ledger, ticket.slot, stale, false);
    }
}

/// Credits `charge` to the ledger's `slot` and, if it was on the board, to the board: to its
/// swapped bytes if it was `out` (freed while in host memory), else to its resident bytes.
fn credit_to(
    enforcer: &Enforcer,
    ledger: &Ledger<'static, ProcLiveness>,
    slot: usize,
    charge: Charge,
    out: bool,
) {
    ledger.release(slot, charge.device, charge.bytes);
    if charge.on_board
        && let Some((board, board_slot)) = enforcer.charged_board(charge.device)
    {
        if out {
            // Its staging went to the process's pool, still reserved (`vmm::free`, `staging`).
            board.board.release_swapped(board_slot, charge.bytes);
        } else {
            board.board.release_freed(board_slot, charge.bytes);
        }
    }
}

/// The driver refused the allocation: give the reservation back.
pub fn abort(ticket: Ticket) {
    let Mode::Enforcing(enforcer) = mode() else {
        unreachable!("a ticket exists only while enforcing")
    };
    let Ok(ledger) = enforcer.ledger() else {
        unreachable!("a ticket exists only with a ledger")
    };
    ledger.release(
        ticket.slot,
        ticket.device,
        ticket.bytes + ticket.overhead_bytes,
    );
    if ticket.on_board
        && let Some((board, slot)) = enforcer.charged_board(ticket.device)
    {
        board.board.release(slot, ticket.board_bytes());
    }
    if ticket.overhead_bytes > 0 {
        enforcer.process().overhead_charged[ticket.device] = false;
    }
}

/// Takes `key` out of the tracker before the driver frees it (so that an allocation reusing the
/// address right after the free cannot be confused with it).
pub fn forget(key: Key) -> Option<Charge> {
    match mode() {
        Mode::Enforcing(enforcer) => enforcer.process().tracker.remove(key),
        _ => None,
    }
}

/// The driver refused to free `key`: it is still allocated.
pub fn restore(key: Key, charge: Charge) {
    if let Mode::Enforcing(enforcer) = mode() {
        enforcer.process().tracker.insert(key, charge);
    }
}

/// The driver freed `key`: credit it back.
pub fn credit(key: Key, charge: Charge) {
    let Mode::Enforcing(enforcer) = mode() else {
        return;
    };
    let Ok(ledger) = enforcer.ledger() else {
        return;
    };
    let (slot, chunk) = {
        let mut process = enforcer.process();
        let chunk = match key {
            Key::Pointer(address) => process.chunks[charge.device].remove(address),
            _ => None,
        };
        if chunk.is_some() {
            swap::publish(&process.chunks);
        }
        let out = chunk.is_some_and(|c| c.out);
        if let Some(phase) = process.hint.as_mut()
            && phase.device == charge.device
            && charge.on_board
            && !out
        {
            // Freed while the hint helper is asked for memory: GPU memory given back, so less
            // to swap (the board is credited below).
            phase.credit(charge.bytes);
        }
        (process.slot, chunk)
    };
    if let Some(slot) = slot {
        credit_to(enforcer, ledger, slot, charge, chunk.is_some_and(|c| c.out));
    }
}

/// The application marks `[ptr, ptr + bytes)` cold (or not) (`vgpu_memory_cold`): this
/// process's borrowed chunks there go first when memory is asked back (and are pinned ahead
/// first). `None` when this process's memory is never asked back (no tenant, no board, the swap
/// off); else the bytes of the chunks marked (0: no borrowed memory there).
pub fn mark_cold(ptr: u64, bytes: u64, cold: bool) -> Option<u64> {
    let Mode::Enforcing(enforcer) = mode() else {
        return None;
    };
    if !enforcer.swap_on() {
        return None;
    }
    let mut process = enforcer.process();
    let marked = process
        .chunks
        .iter_mut()
        .map(|chunks| chunks.mark_cold(ptr, bytes, cold))
        .fold(0u64, u64::saturating_add);
    crate::log::debug(format_args!(
        "{} of borrowed memory at {ptr:#x} (+{bytes}) marked {}",
        human(marked),
        if cold { "cold" } else { "not cold" }
    ));
    Some(marked)
}

/// A hint helper registers (`vgpu_memory_hint_register`): from now on a want on the tenant goes
/// to it first (`hint`). Whether this process is one whose memory can be asked back (a tenant
/// with the swap on); the helper may poll either way (it is then asked nothing).
pub fn hint_register() -> bool {
    hint::register();
    let active = match mode() {
        Mode::Enforcing(enforcer) => enforcer.swap_on(),
        _ => false,
    };
    crate::log::debug(format_args!(
        "a hint helper registered (memory may be asked back from this process: {active})"
    ));
    active
}

/// The helper's poll (`vgpu_memory_want`): what this process is asked to free now. A want posted
/// on the tenant while nothing of the process calls into the driver is handed to the helper
/// here (taking the process's lock only when a want is there: one load per GPU otherwise).
pub fn hint_poll() -> u64 {
    if !hint::registered() {
        return 0;
    }
    let Mode::Enforcing(enforcer) = mode() else {
        return 0;
    };
    if !enforcer.swap_on() {
        return 0;
    }
    if hint::in_progress() {
        if hint::met() {
            // The frees met the want: ended here, so that a process that calls nothing else
            // into the driver does not keep its hint open.
            let mut process = enforcer.process();
            // Looked at again under the lock: the hint may have ended, and another begun.
            if let Some(phase) = process.hint
                && phase.freed >= phase.asked
                && let Some(board) = enforcer.opened_board(phase.device)
            {
                let want = enforcer.want_after_hints(board, phase.device, &mut process);
                assert_eq!(want, 0, "a met hint swaps nothing");
            }
        }
        return hint::asked();
    }
    for device in 0..DEVICES_MAX {
        let Some(board) = enforcer.opened_board(device) else {
            continue;
        };
        if board.board.region.tenants[board.tenant]
            .want_bytes
            .load(Ordering::SeqCst)
            == 0
        {
            continue;
        }
        let mut process = enforcer.process();
        if process.board_slots[device].is_some() {
            let want = enforcer.want_after_hints(board, device, &mut process);
            // A want handed back to the swap right away (a budget of 0): for the process's
            // next call.
            if want > 0 {
                board.board.post_want(board.tenant, want);
            }
        }
        if hint::in_progress() {
            break;
        }
    }
    hint::asked()
}

/// The helper did what it could for the hint in progress (`vgpu_memory_hint_done`; `freed` is
/// its own estimate, for the log): the rest may be swapped without waiting out the budget.
pub fn hint_done(freed: u64) {
    if hint::in_progress() {
        crate::log::debug(format_args!(
            "the hint helper is done (it says it freed {})",
            human(freed)
        ));
        hint::done();
    }
}

/// What a tenant sees of a limited device (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Its limit: the request, or past it the limit it may borrow up to (elastic memory).
    pub limit_bytes: u64,
    /// What its processes hold there (context overheads included).
    pub used_bytes: u64,
    /// What it may still allocate now (`elastic::allocatable`).
    pub allocatable_bytes: u64,
}

/// The tenant's slice of `device`, if it is limited (`uuid` names its board, asked once). Dead
/// processes are reclaimed first, so the figures are current.
fn limited(device: Option<i32>, uuid: impl FnOnce(usize) -> Option<String>) -> Option<Slice> {
    let Mode::Enforcing(enforcer) = mode() else {
        return None;
    };
    let device = usize::try_from(device?).ok().filter(|&d| d < DEVICES_MAX)?;
    let ledger = enforcer.ledger().ok()?;
    let request_bytes = ledger.region.limit(device)?;
    ledger.reclaim_dead(std::process::id());
    let used_bytes = ledger.region.used_total(device);
    let slice = match enforcer.board(device, || uuid(device)) {
        Some(board) => {
            board.board.reclaim_dead(std::process::id());
            let limit_bytes = board.request_and_limit().1.max(request_bytes);
            Slice {
                limit_bytes,
                used_bytes,
                allocatable_bytes: elastic::allocatable(
                    request_bytes,
                    limit_bytes,
                    used_bytes,
                    board.board.region.free(),
                ),
            }
        }
        None => Slice {
            limit_bytes: request_bytes,
            used_bytes,
            allocatable_bytes: request_bytes.saturating_sub(used_bytes),
        },
    };
    assert!(slice.allocatable_bytes <= slice.limit_bytes);
    Some(slice)
}

/// `cuMemGetInfo` as the tenant should see it: total = min(limit, real total), free = min(real
/// free, what it may still allocate). Unlimited devices get the real figures.
pub fn report_mem_info(devices: &impl Devices, free: u64, total: u64) -> (u64, u64) {
    if !enabled() {
        return (free, total);
    }
    poll(devices);
    match limited(devices.current(), |d| devices.uuid(d)) {
        Some(slice) => (
            free.min(slice.allocatable_bytes),
            total.min(slice.limit_bytes),
        ),
        None => (free, total),
    }
}

/// The swap's part of a query (`cuMemGetInfo`): a process that allocates nothing more still
/// gives back what others want and takes back what it may (`Enforcer::poll_swap`).
fn poll(devices: &impl Devices) {
    let Mode::Enforcing(enforcer) = mode() else {
        return;
    };
    if !enforcer.swap_on() {
        return;
    }
    let Some(device) = devices
        .current()
        .and_then(|d| usize::try_from(d).ok())
        .filter(|&d| d < DEVICES_MAX)
    else {
        return;
    };
    let Some(board) = enforcer.board(device, || devices.uuid(device)) else {
        return;
    };
    let mut process = enforcer.process();
    if let Some(board_slot) = process.board_slots[device] {
        enforcer.poll_swap(devices, board, (device, board_slot), &mut process);
    }
}

/// The tenant's slice of the device with this CUDA ordinal and `uuid`, if that device is
/// limited: what NVML memory queries report.
pub fn slice_of(ordinal: usize, uuid: &str) -> Option<Slice> {
    if !enabled() {
        return None;
    }
    limited(i32::try_from(ordinal).ok(), |_| Some(uuid.to_owned()))
}

/// The pids of this tenant's live processes, as its ledger records them, and this process's own,
/// if the device with this CUDA ordinal is limited: whose entries NVML's process lists show.
/// `None`: not a limited device (or no usable ledger), and the list is NVML's own.
///
/// The pids are the ones the tenant's processes see; NVML reports pids of the host's namespace,
/// so in a container with a PID namespace of its own nothing matches and the lists are empty.
pub fn tenant_pids(ordinal: usize) -> Option<BTreeSet<u32>> {
    let Mode::Enforcing(enforcer) = mode() else {
        return None;
    };
    let device = Some(ordinal).filter(|&d| d < DEVICES_MAX)?;
    let ledger = enforcer.ledger().ok()?;
    ledger.region.limit(device)?;
    let usage = ledger.region.usage(&ProcLiveness);
    let mut pids: BTreeSet<u32> = usage.processes.iter().map(|p| p.pid).collect();
    // This process may hold a context without a slot yet (`cuCtxCreate`, nothing allocated).
    pids.insert(std::process::id());
    assert!(pids.len() <= crate::ledger::SLOTS + 1);
    Some(pids)
}

/// `cuDeviceTotalMem` as the tenant should see it: min(limit, real).
pub fn report_total(devices: &impl Devices, device: i32, total: u64) -> u64 {
    match limited(Some(device), |d| devices.uuid(d)) {
        Some(slice) => total.min(slice.limit_bytes),
        None => total,
    }
}

/// `10.00 GiB`, for messages.
fn human(bytes: u64) -> String {
    elastic::human(bytes)
}
