//! The tenant's memory ledger: a fixed `#[repr(C)]` layout that lives in a file mapped
//! `MAP_SHARED` by every process of the tenant, and the lock-free protocol that keeps the sum of
//! their allocations under the limit.
//!
//! **Why lock-free.** A lock in shared memory (HAMi-core uses a `sem_t`) is held by a process that
//! can be `kill -9`ed while holding it, and then every other process of the tenant waits forever.
//! Here every update is a single atomic operation on the process's own slot, so a process that
//! dies at any instruction leaves at worst a slot with stale counts, which the next process near
//! the limit reclaims.
//!
//! **Reserve protocol** for `bytes` on device `d` by the process owning slot `s`:
//! 1. `slot[s].used[d] += bytes` (published before checking);
//! 2. `sum = Σ slot[i].used[d]` over all slots;
//! 3. if `sum > limit`: reclaim the slots of dead processes and sum again; if still over,
//!    `slot[s].used[d] -= bytes` and refuse.
//!
//! All of these are `SeqCst`, so of two processes racing near the limit at least one sees the
//! other's step 1: both may be refused (conservative), but the sum of what was granted never
//! exceeds the limit.
//!
//! **Slot life.** A process claims a slot by CAS of `pid` from 0 to its pid, then stores its start
//! time (field 22 of `/proc/<pid>/stat`, so a recycled pid is not taken for the dead process). A
//! slot is reclaimed by CAS of `pid` to `RECLAIMING_BIT | reclaimer pid`, zeroing the counters, and
//! storing `pid = 0`. Only the CAS winner zeroes, so a slot is never zeroed after a new owner has
//! claimed it; a reclaimer that dies mid-way leaves a slot the next reclaimer takes over.
//!
//! The file starts zeroed (`ftruncate`); a zero limit means "no limit on this device", so a
//! zeroed header is a valid one.

use crate::DEVICES_MAX;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

/// `VGPUMEM1`, little-endian: written last when a ledger file is initialised.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUMEM1");
/// Bumped on any layout change; a process refuses a ledger of another version.
pub const VERSION: u32 = 1;
/// Process slots per tenant: the most processes of one tenant alive at once on a node.
pub const SLOTS: usize = 256;
/// Marks a slot being reclaimed; the low bits are the reclaimer's pid.
pub const RECLAIMING_BIT: u32 = 1 << 31;

/// The start of the ledger file.
#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub device_count: AtomicU32,
    pub slot_count: AtomicU32,
    pub reserved: AtomicU32,
    /// Per-device limit in bytes; 0 = not limited. Authoritative: every process enforces what is
    /// here, so the agent can resize a live tenant by rewriting it.
    pub limits_bytes: [AtomicU64; DEVICES_MAX],
}

/// One process's share of the tenant's usage.
#[repr(C)]
pub struct Slot {
    pub pid: AtomicU32,
    pub reserved: AtomicU32,
    pub start_time: AtomicU64,
    pub used_bytes: [AtomicU64; DEVICES_MAX],
}

/// The whole ledger file.
#[repr(C)]
pub struct Region {
    pub header: Header,
    pub slots: [Slot; SLOTS],
}

/// The file size; part of the on-disk format (checked so a field change bumps `VERSION`).
pub const REGION_BYTES: usize = 152 + SLOTS * 144;
const _: () = assert!(std::mem::size_of::<Region>() == REGION_BYTES);
const _: () = assert!(std::mem::align_of::<Region>() == 8);

impl Region {
    /// A zeroed region on the heap (tests; the real one is a mapped file).
    pub fn new_boxed() -> Box<Region> {
        let zero_slot = || Slot {
            pid: AtomicU32::new(0),
            reserved: AtomicU32::new(0),
            start_time: AtomicU64::new(0),
            used_bytes: std::array::from_fn(|_| AtomicU64::new(0)),
        };
        Box::new(Region {
            header: Header {
                magic: AtomicU64::new(0),
                version: AtomicU32::new(0),
                device_count: AtomicU32::new(0),
                slot_count: AtomicU32::new(0),
                reserved: AtomicU32::new(0),
                limits_bytes: std::array::from_fn(|_| AtomicU64::new(0)),
            },
            slots: std::array::from_fn(|_| zero_slot()),
        })
    }

    /// Writes the constant header fields and publishes the magic. Idempotent (every value is a
    /// constant), so a process may take over the initialisation of a creator that died.
    pub fn initialise(&self) {
        self.header.version.store(VERSION, SeqCst);
        self.header.device_count.store(DEVICES_MAX as u32, SeqCst);
        self.header.slot_count.store(SLOTS as u32, SeqCst);
        self.header.magic.store(MAGIC, SeqCst);
    }

    pub fn is_initialised(&self) -> bool {
        self.header.magic.load(SeqCst) == MAGIC
    }

    /// Checks an initialised header against this build's layout.
    pub fn check_layout(&self) -> Result<(), String> {
        let h = &self.header;
        let (version, devices, slots) = (
            h.version.load(SeqCst),
            h.device_count.load(SeqCst),
            h.slot_count.load(SeqCst),
        );
        if version != VERSION || devices as usize != DEVICES_MAX || slots as usize != SLOTS {
            return Err(format!(
                "the ledger file has version {version} ({devices} devices, {slots} slots); this \
                 interposer writes version {VERSION} ({DEVICES_MAX}, {SLOTS}): processes of two \
                 vgpu versions share a tenant"
            ));
        }
        Ok(())
    }

    /// Stores the per-device limits (`None` = not limited).
    pub fn set_limits(&self, limits_bytes: &[Option<u64>; DEVICES_MAX]) {
        for (stored, limit) in self.header.limits_bytes.iter().zip(limits_bytes) {
            stored.store(limit.unwrap_or(0), SeqCst);
        }
    }

    /// The limit of `device`, if it has one.
    pub fn limit(&self, device: usize) -> Option<u64> {
        let stored = self.header.limits_bytes.get(device)?.load(SeqCst);
        (stored != 0).then_some(stored)
    }

    /// What the tenant's processes hold on `device`, dead ones included until reclaimed.
    pub fn used_total(&self, device: usize) -> u64 {
        assert!(device < DEVICES_MAX);
        let sum: u128 = self
            .slots
            .iter()
            .map(|slot| u128::from(slot.used_bytes[device].load(SeqCst)))
            .sum();
        u64::try_from(sum).unwrap_or(u64::MAX)
    }
}

/// Tells whether the process that owns a slot still runs.
pub trait Liveness {
    /// `start_time == 0` asks only whether `pid` exists (a slot being claimed, a reclaimer).
    fn is_alive(&self, pid: u32, start_time: u64) -> bool;
}

/// A refused reservation: what the tenant holds and what it may hold on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub used_bytes: u64,
    pub limit_bytes: u64,
}

/// The protocol over a region.
pub struct Ledger<'r, L> {
    pub region: &'r Region,
    pub liveness: L,
}

impl<'r, L: Liveness> Ledger<'r, L> {
    pub fn new(region: &'r Region, liveness: L) -> Self {
        Ledger { region, liveness }
    }

    /// Claims a free slot for `pid`, reclaiming dead processes' slots once if all are taken.
    pub fn claim_slot(&self, pid: u32, start_time: u64) -> Option<usize> {
        assert!(
            pid != 0 && pid & RECLAIMING_BIT == 0,
            "pid {pid} cannot own a slot"
        );
        claim_free_slot(
            &self.region.slots,
            pid,
            start_time,
            |slot| (&slot.pid, &slot.start_time),
            |slot| debug_assert!(slot.used_bytes.iter().all(|u| u.load(SeqCst) == 0)),
            || self.reclaim_dead(pid),
        )
    }

    /// Charges `bytes` on `device` to `slot`, unless that takes the tenant past its limit.
    pub fn reserve(&self, slot: usize, device: usize, bytes: u64) -> Result<(), Refused> {
        assert!(device < DEVICES_MAX);
        let me = &self.region.slots[slot];
        let Some(limit_bytes) = self.region.limit(device) else {
            me.used_bytes[device].fetch_add(bytes, SeqCst);
            return Ok(());
        };
        if bytes > limit_bytes {
            return Err(Refused {
                used_bytes: self.region.used_total(device),
                limit_bytes,
            });
        }
        me.used_bytes[device].fetch_add(bytes, SeqCst);
        let mut used_bytes = self.region.used_total(device);
        if used_bytes > limit_bytes && self.reclaim_dead(me.pid.load(SeqCst)) > 0 {
            used_bytes = self.region.used_total(device);
        }
        if used_bytes <= limit_bytes {
            return Ok(());
        }
        self.release(slot, device, bytes);
        Err(Refused {
            used_bytes: used_bytes.saturating_sub(bytes),
            limit_bytes,
        })
    }

    /// Charges `bytes` without checking the limit (a correction after the driver chose the size,
    /// such as the pitch of `cuMemAllocPitch`).
    pub fn charge(&self, slot: usize, device: usize, bytes: u64) {
        self.region.slots[slot].used_bytes[device].fetch_add(bytes, SeqCst);
    }

    /// Credits `bytes` back; saturates at zero rather than wrapping (HAMi #1181 showed 17 TB used
    /// after an underflow).
    pub fn release(&self, slot: usize, device: usize, bytes: u64) {
        let counter = &self.region.slots[slot].used_bytes[device];
        let update = counter.fetch_update(SeqCst, SeqCst, |used| Some(used.saturating_sub(bytes)));
        let before = update.unwrap_or_else(|used| used);
        debug_assert!(before >= bytes, "released {bytes} of {before} bytes");
    }

    /// Reclaims the slots of processes that no longer run; returns how many.
    pub fn reclaim_dead(&self, reclaimer_pid: u32) -> usize {
        reclaim_dead_slots(
            &self.region.slots,
            &self.liveness,
            reclaimer_pid,
            |slot| (&slot.pid, &slot.start_time),
            |slot| {
                for used in &slot.used_bytes {
                    used.store(0, SeqCst);
                }
            },
        )
    }
}

/// The claim protocol shared by the memory ledger and the memory board: the first slot whose pid
/// is 0 is taken by CAS to `pid`, `claimed` fills the slot's own fields, then its start time is
/// stored; when every slot is taken, `reclaim_dead` frees dead processes' slots once and the
/// search runs again. Returns the slot's index.
pub fn claim_free_slot<S>(
    slots: &[S],
    pid: u32,
    start_time: u64,
    identity: impl Fn(&S) -> (&AtomicU32, &AtomicU64),
    claimed: impl Fn(&S),
    reclaim_dead: impl Fn() -> usize,
) -> Option<usize> {
    for attempt in 0..2 {
        for (index, slot) in slots.iter().enumerate() {
            let (pid_word, start) = identity(slot);
            if pid_word.compare_exchange(0, pid, SeqCst, SeqCst).is_ok() {
                claimed(slot);
                start.store(start_time, SeqCst);
                return Some(index);
            }
        }
        if attempt == 0 && reclaim_dead() == 0 {
            break;
        }
    }
    None
}

/// The reclaim protocol shared by the memory ledger, the memory board and the compute schedule: for each slot of a
/// process that no longer runs, take the slot by CAS of its pid to `RECLAIMING_BIT | reclaimer`
/// (so only one reclaimer zeroes it, and a reclaimer that dies half-way is itself reclaimed
/// later), zero its payload with `clear`, then its start time, and free it (pid 0) last.
/// Returns how many slots were reclaimed.
pub fn reclaim_dead_slots<S>(
    slots: &[S],
    liveness: &impl Liveness,
    reclaimer_pid: u32,
    identity: impl Fn(&S) -> (&AtomicU32, &AtomicU64),
    clear: impl Fn(&S),
) -> usize {
    assert!(reclaimer_pid & RECLAIMING_BIT == 0);
    let mut reclaimed = 0;
    for slot in slots {
        let (pid_word, start_time) = identity(slot);
        let pid = pid_word.load(SeqCst);
        if pid == 0 || pid == reclaimer_pid {
            continue;
        }
        let alive = if pid & RECLAIMING_BIT != 0 {
            liveness.is_alive(pid & !RECLAIMING_BIT, 0)
        } else {
            liveness.is_alive(pid, start_time.load(SeqCst))
        };
        if alive {
            continue;
        }
        let marker = RECLAIMING_BIT | reclaimer_pid;
        if pid_word
            .compare_exchange(pid, marker, SeqCst, SeqCst)
            .is_err()
        {
            continue;
        }
        clear(slot);
        start_time.store(0, SeqCst);
        pid_word.store(0, SeqCst);
        reclaimed += 1;
    }
    reclaimed
}

/// One live process's charges, as a reader outside the tenant sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessCharge {
    pub pid: u32,
    pub used_bytes: [u64; DEVICES_MAX],
}

/// A read-only look at a ledger (the node agent's usage report): the limits, the live processes'
/// charges, and how many slots belong to dead processes that nobody reclaimed yet (their bytes
/// are not counted: the driver gave that memory back when the process died).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerUsage {
    pub limits_bytes: [Option<u64>; DEVICES_MAX],
    pub processes: Vec<ProcessCharge>,
    pub dead_slots: usize,
}

impl LedgerUsage {
    /// What the live processes hold on `device`.
    pub fn used_bytes(&self, device: usize) -> u64 {
        assert!(device < DEVICES_MAX);
        self.processes
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.used_bytes[device]))
    }
}

impl Region {
    /// Reads the ledger without writing to it or waiting on anyone: one atomic load per word, as
    /// the processes' own `used_total` does. Slots being claimed or reclaimed, and slots of dead
    /// processes, are skipped.
    pub fn usage(&self, liveness: &impl Liveness) -> LedgerUsage {
        let limits_bytes = std::array::from_fn(|device| self.limit(device));
        let mut processes = Vec::new();
        let mut dead_slots = 0;
        for slot in &self.slots {
            let pid = slot.pid.load(SeqCst);
            if pid == 0 || pid & RECLAIMING_BIT != 0 {
                continue;
            }
            let used_bytes: [u64; DEVICES_MAX] =
                std::array::from_fn(|device| slot.used_bytes[device].load(SeqCst));
            if !liveness.is_alive(pid, slot.start_time.load(SeqCst)) {
                dead_slots += 1;
                continue;
            }
            processes.push(ProcessCharge { pid, used_bytes });
        }
        debug_assert!(processes.len() + dead_slots <= SLOTS);
        LedgerUsage {
            limits_bytes,
            processes,
            dead_slots,
        }
    }
}

/// Liveness from `/proc`: the pid exists, is not a zombie (a killed process that was not yet
/// reaped has already given its GPU memory back), and has the recorded start time.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcLiveness;

impl Liveness for ProcLiveness {
    fn is_alive(&self, pid: u32, start_time: u64) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => match parse_stat(&stat) {
                Some((state, started)) => {
                    !matches!(state, 'Z' | 'X') && (start_time == 0 || started == start_time)
                }
                // Unreadable but present: keep it (never credit memory back by mistake).
                None => true,
            },
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        }
    }
}

/// Whether process `pid` is stopped (`T`: a stop signal, `t`: a debugger's stop): it runs nothing,
/// so it gives nothing back until it continues. `false` when it cannot be read (gone, or hidden).
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| parse_stat(&stat))
        .is_some_and(|(state, _)| matches!(state, 'T' | 't'))
}

/// This process's start time, in clock ticks since boot (field 22 of `/proc/self/stat`).
pub fn own_start_time() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| parse_stat(&stat))
        .map_or(0, |(_, started)| started)
}

/// Reads the state (field 3) and start time (field 22) of a `/proc/<pid>/stat` line. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted after the last `)`.
pub fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let start_time = fields.nth(18)?.parse().ok()?;
    Some((state, start_time))
}

/// Liveness decided by a test (the ledger's, the schedule's and the board's tests): the set of
/// live pids.
#[cfg(test)]
pub(crate) mod test_liveness {
    use super::Liveness;
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Fake(Mutex<BTreeSet<u32>>);

    impl Liveness for &Fake {
        fn is_alive(&self, pid: u32, _start_time: u64) -> bool {
            self.0.lock().unwrap().contains(&pid)
        }
    }

    impl Fake {
        pub fn with(pids: &[u32]) -> Fake {
            Fake(Mutex::new(pids.iter().copied().collect()))
        }
        pub fn kill(&self, pid: u32) {
            self.0.lock().unwrap().remove(&pid);
        }
        pub fn add(&self, pid: u32) {
            self.0.lock().unwrap().insert(pid);
        }
        pub fn contains(&self, pid: u32) -> bool {
            self.0.lock().unwrap().contains(&pid)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    use crate::ledger::test_liveness::Fake;

    fn region_with_limit(device: usize, bytes: u64) -> Box<Region> {
        let region = Region::new_boxed();
        region.initialise();
        let mut limits = [None; DEVICES_MAX];
        limits[device] = Some(bytes);
        region.set_limits(&limits);
        region
    }

    #[test]
    fn a_zeroed_header_is_uninitialised_and_unlimited() {
        let region = Region::new_boxed();
        assert!(!region.is_initialised());
        assert_eq!(region.limit(0), None);
        region.initialise();
        region.initialise();
        assert!(region.is_initialised());
        region.check_layout().unwrap();
        region.header.version.store(VERSION + 1, SeqCst);
        assert!(region.check_layout().unwrap_err().contains("version 2"));
    }

    #[test]
    fn parse_stat_reads_state_and_start_time() {
        let stat = "1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 12345678 100 18446744073709551615";
        assert_eq!(parse_stat(stat), Some(('S', 987654)));
        assert_eq!(parse_stat("garbage"), None);
        assert!(own_start_time() > 0);
        assert!(ProcLiveness.is_alive(std::process::id(), own_start_time()));
        assert!(!ProcLiveness.is_alive(std::process::id(), own_start_time() + 1));
    }

    #[test]
    fn limit_is_enforced_across_slots() {
        let region = region_with_limit(0, 10 * GIB);
        let live = Fake::with(&[10, 11]);
        let ledger = Ledger::new(&region, &live);
        let a = ledger.claim_slot(10, 1).unwrap();
        let b = ledger.claim_slot(11, 1).unwrap();
        assert_ne!(a, b);
        ledger.reserve(a, 0, 6 * GIB).unwrap();
        let refused = ledger.reserve(b, 0, 6 * GIB).unwrap_err();
        assert_eq!(
            refused,
            Refused {
                used_bytes: 6 * GIB,
                limit_bytes: 10 * GIB
            }
        );
        ledger.reserve(b, 0, 4 * GIB).unwrap();
        assert_eq!(region.used_total(0), 10 * GIB);
        // Another device has no limit.
        ledger.reserve(b, 1, 100 * GIB).unwrap();
        ledger.release(a, 0, 6 * GIB);
        ledger.reserve(b, 0, 6 * GIB).unwrap();
        assert!(ledger.reserve(a, 0, 11 * GIB).is_err());
    }

    #[test]
    fn a_dead_process_is_credited_back() {
        let region = region_with_limit(0, 10 * GIB);
        let live = Fake::with(&[10, 11]);
        let ledger = Ledger::new(&region, &live);
        let a = ledger.claim_slot(10, 1).unwrap();
        let b = ledger.claim_slot(11, 1).unwrap();
        ledger.reserve(a, 0, 6 * GIB).unwrap();
        assert!(ledger.reserve(b, 0, 8 * GIB).is_err());
        live.kill(10);
        ledger.reserve(b, 0, 8 * GIB).unwrap();
        assert_eq!(region.used_total(0), 8 * GIB);
        assert_eq!(region.slots[a].pid.load(SeqCst), 0);
        // The slot is free for a new process.
        live.add(12);
        assert_eq!(ledger.claim_slot(12, 1), Some(a));
    }

    #[test]
    fn a_reclaimer_that_died_mid_way_is_taken_over() {
        let region = region_with_limit(0, GIB);
        let live = Fake::with(&[11]);
        let ledger = Ledger::new(&region, &live);
        region.slots[3].pid.store(RECLAIMING_BIT | 99, SeqCst);
        region.slots[3].used_bytes[0].store(GIB, SeqCst);
        let b = ledger.claim_slot(11, 1).unwrap();
        ledger.reserve(b, 0, GIB).unwrap();
        assert_eq!(region.slots[3].pid.load(SeqCst), 0);
    }

    #[test]
    fn full_slots_are_reclaimed_or_refused() {
        let region = region_with_limit(0, GIB);
        let pids: Vec<u32> = (1..=SLOTS as u32).collect();
        let live = Fake::with(&pids);
        let ledger = Ledger::new(&region, &live);
        for &pid in &pids {
            ledger.claim_slot(pid, 1).unwrap();
        }
        live.add(5000);
        assert_eq!(ledger.claim_slot(5000, 1), None);
        live.kill(7);
        assert_eq!(ledger.claim_slot(5000, 1), Some(6));
    }

    #[test]
    fn release_saturates_instead_of_wrapping() {
        let region = region_with_limit(0, GIB);
        let live = Fake::with(&[10]);
        let ledger = Ledger::new(&region, &live);
        let a = ledger.claim_slot(10, 1).unwrap();
        ledger.charge(a, 0, 5);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ledger.release(a, 0, 7);
        }));
        // Debug builds assert; either way the counter does not wrap.
        assert_eq!(result.is_err(), cfg!(debug_assertions));
        assert_eq!(region.used_total(0), 0);
    }

    #[test]
    fn a_reader_sees_live_charges_and_skips_dead_and_reclaiming_slots() {
        let region = region_with_limit(1, 10 * GIB);
        let live = Fake::with(&[10, 11, 12]);
        let ledger = Ledger::new(&region, &live);
        let a = ledger.claim_slot(10, 1).unwrap();
        let b = ledger.claim_slot(11, 1).unwrap();
        let c = ledger.claim_slot(12, 1).unwrap();
        ledger.reserve(a, 1, 3 * GIB).unwrap();
        ledger.reserve(b, 1, 2 * GIB).unwrap();
        ledger.reserve(c, 0, GIB).unwrap();
        live.kill(12);
        region.slots[7].pid.store(RECLAIMING_BIT | 99, SeqCst);
        region.slots[7].used_bytes[1].store(GIB, SeqCst);
        let usage = region.usage(&&live);
        assert_eq!(usage.limits_bytes[1], Some(10 * GIB));
        assert_eq!(usage.limits_bytes[0], None);
        assert_eq!(usage.dead_slots, 1);
        let pids: Vec<u32> = usage.processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [10, 11]);
        assert_eq!(usage.used_bytes(1), 5 * GIB);
        assert_eq!(
            usage.used_bytes(0),
            0,
            "the dead process's GiB is not counted"
        );
        // Reading changed nothing.
        assert_eq!(region.used_total(1), 6 * GIB);
        assert_eq!(region.slots[c].pid.load(SeqCst), 12);
    }

    /// Many threads, each its own "process", racing near the limit: the granted total never
    /// exceeds the limit at any moment.
    #[test]
    fn racing_reservations_never_exceed_the_limit() {
        let limit = 64 * GIB;
        let region = region_with_limit(0, limit);
        let pids: Vec<u32> = (1..=8).collect();
        let live = Fake::with(&pids);
        let ledger = Ledger::new(&region, &live);
        let granted = AtomicU64::new(0);
        let slots: Vec<usize> = pids
            .iter()
            .map(|&p| ledger.claim_slot(p, 1).unwrap())
            .collect();
        std::thread::scope(|s| {
            for (i, &slot) in slots.iter().enumerate() {
                let (ledger, granted) = (&ledger, &granted);
                s.spawn(move || {
                    let mut held = Vec::new();
                    for round in 0..2000u64 {
                        let bytes = GIB + (round * 7 + i as u64) % 3 * GIB;
                        if ledger.reserve(slot, 0, bytes).is_ok() {
                            let now = granted.fetch_add(bytes, SeqCst) + bytes;
                            assert!(now <= limit, "granted {now} > {limit}");
                            held.push(bytes);
                        }
                        if held.len() > 3 || (round % 5 == 0 && !held.is_empty()) {
                            let bytes = held.remove(0);
                            granted.fetch_sub(bytes, SeqCst);
                            ledger.release(slot, 0, bytes);
                        }
                    }
                    for bytes in held {
                        granted.fetch_sub(bytes, SeqCst);
                        ledger.release(slot, 0, bytes);
                    }
                });
            }
        });
        assert_eq!(region.used_total(0), 0);
    }
}
