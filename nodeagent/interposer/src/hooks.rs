//! The memory policy behind the hooks, in safe code: whether an allocation may proceed, what it
//! charged, what a free credits, and what the tenant is told about memory. `exports` calls these
//! around each real driver call; this module never calls the driver itself (the current device
//! is passed in as a closure, evaluated only when needed).
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
//! The compute side (launch gating) is `launch`, with its own failure policy (fail open).

use crate::ledger::{Ledger, ProcLiveness, own_start_time};
use crate::tracker::{Charge, Key, Tracker};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use tenant_abi::{DEVICES_MAX, MemoryEnv};

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
    bytes: u64,
    overhead_bytes: u64,
}

enum Mode {
    PassThrough,
    Broken(String),
    Enforcing(Box<Enforcer>),
}

struct Enforcer {
    config: MemoryEnv,
    ledger: OnceLock<Result<Ledger<'static, ProcLiveness>, String>>,
    process: Mutex<Process>,
}

/// This process's view: its slot, its live allocations, which devices paid the context overhead.
struct Process {
    pid: u32,
    slot: Option<usize>,
    tracker: Tracker,
    overhead_charged: [bool; DEVICES_MAX],
}

impl Process {
    fn new() -> Process {
        Process {
            pid: std::process::id(),
            slot: None,
            tracker: Tracker::default(),
            overhead_charged: [false; DEVICES_MAX],
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

    fn admit(&self, device: usize, bytes: u64) -> Admission {
        let ledger = match self.ledger() {
            Ok(ledger) => ledger,
            Err(e) => {
                error_once(&format!(
                    "{e}; every GPU allocation of this process is refused"
                ));
                return Admission::Refused;
            }
        };
        let mut process = self.process();
        let Some(slot) = self.slot(ledger, &mut process) else {
            return Admission::Refused;
        };
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
        match ledger.reserve(slot, device, bytes.saturating_add(overhead_bytes)) {
            Ok(()) => {
                process.overhead_charged[device] |= overhead_bytes > 0;
                Admission::Charged(Ticket {
                    slot,
                    device,
                    bytes,
                    overhead_bytes,
                })
            }
            Err(refused) => {
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
        }
    }
}

/// Decides whether an allocation of `bytes` on the current device (`device()`, asked only when a
/// tenant is configured) may go to the driver.
pub fn admit(device: impl FnOnce() -> Option<i32>, bytes: u64) -> Admission {
    match mode() {
        Mode::PassThrough => Admission::Untracked,
        Mode::Broken(message) => {
            error_once(message);
            Admission::Refused
        }
        Mode::Enforcing(enforcer) => match device().and_then(|d| usize::try_from(d).ok()) {
            Some(device) if device < DEVICES_MAX => enforcer.admit(device, bytes),
            _ => Admission::Untracked,
        },
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
pub fn admit_context(device: i32) -> Admission {
    let Mode::Enforcing(enforcer) = mode() else {
        return Admission::Untracked;
    };
    let Some(device) = usize::try_from(device).ok().filter(|&d| d < DEVICES_MAX) else {
        return Admission::Untracked;
    };
    if enforcer.ledger().is_err() {
        return Admission::Untracked;
    }
    enforcer.admit(device, 0)
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
pub fn commit(ticket: Ticket, key: Key, bytes: u64) {
    let Mode::Enforcing(enforcer) = mode() else {
        unreachable!("a ticket exists only while enforcing")
    };
    let Ok(ledger) = enforcer.ledger() else {
        unreachable!("a ticket exists only with a ledger")
    };
    if bytes > ticket.bytes {
        ledger.charge(ticket.slot, ticket.device, bytes - ticket.bytes);
    } else {
        ledger.release(ticket.slot, ticket.device, ticket.bytes - bytes);
    }
    let charge = Charge {
        device: ticket.device,
        bytes,
    };
    let stale = enforcer.process().tracker.insert(key, charge);
    if let Some(stale) = stale {
        // Freed through a path we do not see; the driver reuses the address now.
        ledger.release(ticket.slot, stale.device, stale.bytes);
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

/// The driver freed an allocation: credit it back.
pub fn credit(charge: Charge) {
    let Mode::Enforcing(enforcer) = mode() else {
        return;
    };
    let Ok(ledger) = enforcer.ledger() else {
        return;
    };
    let slot = enforcer.process().slot;
    if let Some(slot) = slot {
        ledger.release(slot, charge.device, charge.bytes);
    }
}

/// The limit and current usage of the tenant on a device, if it is limited. Dead processes are
/// reclaimed first, so the figure is current.
fn limited(device: Option<i32>) -> Option<(u64, u64)> {
    let Mode::Enforcing(enforcer) = mode() else {
        return None;
    };
    let device = usize::try_from(device?).ok().filter(|&d| d < DEVICES_MAX)?;
    let ledger = enforcer.ledger().ok()?;
    let limit_bytes = ledger.region.limit(device)?;
    ledger.reclaim_dead(std::process::id());
    Some((limit_bytes, ledger.region.used_total(device)))
}

/// `cuMemGetInfo` as the tenant should see it: total = min(limit, real total), free = min(real
/// free, limit − tenant's usage). Unlimited devices get the real figures.
pub fn report_mem_info(device: impl FnOnce() -> Option<i32>, free: u64, total: u64) -> (u64, u64) {
    if !enabled() {
        return (free, total);
    }
    match limited(device()) {
        Some((limit_bytes, used_bytes)) => (
            free.min(limit_bytes.saturating_sub(used_bytes)),
            total.min(limit_bytes),
        ),
        None => (free, total),
    }
}

/// The tenant's limit and usage (every process, context overheads included) on the device with
/// this CUDA ordinal, if that device is limited: what NVML memory queries report.
pub fn slice_of(ordinal: usize) -> Option<(u64, u64)> {
    if !enabled() {
        return None;
    }
    limited(i32::try_from(ordinal).ok())
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
pub fn report_total(device: i32, total: u64) -> u64 {
    match limited(Some(device)) {
        Some((limit_bytes, _)) => total.min(limit_bytes),
        None => total,
    }
}

/// `10.0 GiB`, for messages.
fn human(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}
