//! Compute time-sharing of one physical GPU between tenants: the `#[repr(C)]` layout of the
//! per-GPU schedule file (`$VGPU_SHM_DIR/<gpu uuid>.compute`, mapped `MAP_SHARED` by every gated
//! process on that GPU) and the lock-free protocol over it. Pure: no FFI, no clock (the caller
//! passes `now_ns`, CLOCK_MONOTONIC), liveness injected, unit-tested here with a simulated GPU.
//!
//! **Model.** Time on the GPU is handed out in *turns*. The turn word names the tenant that owns
//! the GPU and when its turn started; the owner's processes launch freely until the turn's
//! deadline (`start + quantum`), everyone else's launches wait. Who gets the next turn is decided
//! by stride scheduling: each tenant has a virtual time `vt` that grows by
//! `turn length / weight`; the active tenant with the smallest `vt` goes next. Weights come from
//! the active set (`weights`): guaranteed shares first, best-effort shares by priority, the rest
//! (idle time) to the burst-allowed tenants of the highest priority, or to nobody (an *idle*
//! turn: the GPU stays free so that non-burst tenants stay capped at their share).
//!
//! **Handover.** When a turn expires, the owner's processes stop launching and *drain* (wait for
//! their queued kernels, which the caller tracks with events), then clear their `busy` flag.
//! Any process that sees an expired turn whose owner has drained (or `grace` past the deadline,
//! whatever the owner reports) computes the next owner and CASes the turn word; only the CAS
//! winner charges the old owner's `vt`. An owner that went idle before its deadline is taken
//! over early (work conservation) if it has drained, or at once if none of its processes is
//! alive; a live owner that is silent but has work queued (blocked in an ungated synchronize)
//! keeps its turn until deadline plus grace. Nothing is ever locked: a process killed at any
//! instruction leaves at worst a `busy` flag and a stale demand stamp, which expire after
//! `grace`; its slot is reclaimed like the memory ledger's.
//!
//! **Tenant slots** are claimed without locks and without duplicates: a claimer writes the name,
//! publishes `NAMED`, then looks for other slots with the same name (Dekker-style: of two
//! claimers, at least the later one sees the earlier) and yields or cancels, before CASing its
//! own slot to `LIVE`. A `LIVE` slot is reclaimed (when the table is full) by CAS to
//! `RECLAIMING`, re-checking that no live process refers to it, and restored otherwise; a
//! joining process publishes its reference first and then re-checks the slot, so either side
//! sees the other.

use crate::ledger::{Liveness, RECLAIMING_BIT};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};

/// `VGPUCMP1`, little-endian: written last when a schedule file is initialised.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUCMP1");
/// Bumped on any layout change; a process refuses a schedule file of another version, except
/// the compatible ones from `VERSION_COMPATIBLE_MIN` on. Version 3 appended the closed-loop
/// words (`Region::control`), so files of versions 1 and 2 are too short to map; version 4 put
/// a target and an exact count of the steps over it in each latency histogram.
pub const VERSION: u32 = 4;
/// The oldest layout this build reads and writes unchanged.
pub const VERSION_COMPATIBLE_MIN: u32 = 4;
/// Tenants per GPU (one bit each in `Header::active`).
pub const TENANTS: usize = 32;
/// Gated processes per GPU.
pub const PROCS: usize = 256;
/// Bytes of a tenant name (names are at most 63 bytes, `config::TENANT_NAME_LEN_MAX`).
pub const NAME_BYTES: usize = 64;

/// The turn word's owner when nobody holds the GPU.
pub const OWNER_NONE: usize = 0xFF;
/// The turn word's owner during an idle turn (nobody may launch).
pub const OWNER_IDLE: usize = 0xFE;
const START_MASK_US: u64 = (1 << 56) - 1;

/// Default turn length.
pub const QUANTUM_NS_DEFAULT: u64 = 20_000_000;
/// A tenant whose processes have not launched (or waited to launch) for this long is idle: its
/// turn may be taken before the deadline.
pub const IDLE_GAP_NS: u64 = 2_000_000;
/// Weights are in parts per million of the GPU.
pub const PPM: u64 = 1_000_000;
/// `TenantSlot::progress`: set once the tenant's application counts its own units.
pub const PROGRESS_HINTED: u64 = 1 << 63;

/// Tenant slot phases (high 32 bits of `TenantSlot::state`; the low 32 bits are the pid of the
/// process that claims or reclaims it).
const PHASE_FREE: u64 = 0;
const PHASE_WRITING: u64 = 1;
const PHASE_NAMED: u64 = 2;
const PHASE_LIVE: u64 = 3;
const PHASE_RECLAIMING: u64 = 4;

fn state(phase: u64, pid: u32) -> u64 {
    phase << 32 | u64::from(pid)
}
fn phase_of(state: u64) -> u64 {
    state >> 32
}
fn pid_of(state: u64) -> u32 {
    state as u32
}

/// The start of the schedule file.
#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub tenant_count: AtomicU32,
    pub proc_count: AtomicU32,
    /// Turn length in µs; set by the file's creator, read by everyone at join.
    pub quantum_us: AtomicU32,
    /// `owner << 56 | start_us`; see `Turn`.
    pub turn: AtomicU64,
    /// Bit `i`: tenant `i` wanted to launch recently. Set by the tenant's processes, cleared at
    /// handovers once the tenant's demand stamp is older than the active window.
    pub active: AtomicU64,
    /// Virtual time of the most recent turn winner: tenants that were idle re-enter here.
    pub floor_vt: AtomicU64,
    /// Virtual time of the idle pseudo-tenant.
    pub idle_vt: AtomicU64,
    /// Number of turns handed over (statistics).
    pub handovers: AtomicU64,
    /// Spatial partitioning (version 2): when (CLOCK_MONOTONIC ns) a latency tenant last launched
    /// on this GPU; 0 never. Latency tenants store it at every launch; squeezable tenants load it
    /// at every launch (`latency_active`). Its own cache line, away from the turn word.
    pub latency_ns: AtomicU64,
    pub reserved: [AtomicU64; 1],
}

/// One tenant sharing the GPU.
#[repr(C)]
pub struct TenantSlot {
    /// `phase << 32 | pid` (see the `PHASE_*` constants).
    pub state: AtomicU64,
    /// `TenantConfig::pack`.
    pub config: AtomicU64,
    /// Virtual time: turn nanoseconds × `PPM` / weight.
    pub vt: AtomicU64,
    /// Last time (ns) one of its processes launched or waited to launch.
    pub demand_ns: AtomicU64,
    /// Turn time charged to it, in ns (statistics: GPU time).
    pub used_ns: AtomicU64,
    /// What its processes achieved (in version 4's word that was reserved and zero, so older
    /// processes leave it 0: unmeasured): the low 63 bits count its *steps* (synchronisations
    /// that waited for work it launched) until one of its processes counts its own units
    /// (`vgpu_progress`); from then on bit 63 ([`PROGRESS_HINTED`]) is set and only those
    /// units are counted. Read by the agent's redistribution of idle SMs (`sharing::redistribute`).
    /// Cleared when the slot is claimed.
    pub progress: AtomicU64,
    pub name: [AtomicU64; NAME_BYTES / 8],
}

/// One gated process.
#[repr(C)]
pub struct ProcSlot {
    pub pid: AtomicU32,
    /// Tenant slot index + 1; 0 while joining.
    pub tenant: AtomicU32,
    pub start_time: AtomicU64,
    /// Non-zero (the time it became so) while the process may have launched work that has not
    /// drained; 0 once it drained.
    pub busy_ns: AtomicU64,
}

/// The whole schedule file.
#[repr(C)]
pub struct Region {
    pub header: Header,
    pub tenants: [TenantSlot; TENANTS],
    pub procs: [ProcSlot; PROCS],
    /// Closed-loop sharing (version 3): latency tenants' step histograms and the agent's
    /// decision for the others.
    pub control: crate::control::Control,
}

/// The file size; part of the on-disk format (checked so a field change bumps `VERSION`).
pub const REGION_BYTES: usize = 80 + TENANTS * 112 + PROCS * 24 + crate::control::CONTROL_BYTES;
const _: () = assert!(std::mem::size_of::<Region>() == REGION_BYTES);
const _: () = assert!(std::mem::align_of::<Region>() == 8);
const _: () = assert!(TENANTS <= 64 && TENANTS < OWNER_IDLE);

impl Region {
    /// A zeroed region on the heap (tests; the real one is a mapped file).
    pub fn new_boxed() -> Box<Region> {
        let zero = || AtomicU64::new(0);
        Box::new(Region {
            header: Header {
                magic: zero(),
                version: AtomicU32::new(0),
                tenant_count: AtomicU32::new(0),
                proc_count: AtomicU32::new(0),
                quantum_us: AtomicU32::new(0),
                turn: zero(),
                active: zero(),
                floor_vt: zero(),
                idle_vt: zero(),
                handovers: zero(),
                latency_ns: zero(),
                reserved: std::array::from_fn(|_| zero()),
            },
            tenants: std::array::from_fn(|_| TenantSlot {
                state: zero(),
                config: zero(),
                vt: zero(),
                demand_ns: zero(),
                used_ns: zero(),
                progress: zero(),
                name: std::array::from_fn(|_| zero()),
            }),
            procs: std::array::from_fn(|_| ProcSlot {
                pid: AtomicU32::new(0),
                tenant: AtomicU32::new(0),
                start_time: zero(),
                busy_ns: zero(),
            }),
            control: crate::control::Control {
                decision: zero(),
                decision_ns: zero(),
                step_open_ns: zero(),
                step_close_ns: zero(),
                paused_ns: zero(),
                bounded_launches: zero(),
                next_step_ns: zero(),
                caps: std::array::from_fn(|_| zero()),
                caps_ns: zero(),
                side_by_side: zero(),
                side_by_side_ns: zero(),
                reserved: std::array::from_fn(|_| zero()),
                latency: std::array::from_fn(|_| crate::control::LatencyStats {
                    steps: zero(),
                    total_ns: zero(),
                    target_ns: zero(),
                    over_target: zero(),
                    buckets: std::array::from_fn(|_| zero()),
                }),
            },
        })
    }

    /// Writes the header and publishes the magic. Only the file's creator calls it (or a process
    /// taking over from a creator that died before publishing): the turn word is reset.
    pub fn initialise(&self, quantum_ns: u64) {
        let h = &self.header;
        h.version.store(VERSION, SeqCst);
        h.tenant_count.store(TENANTS as u32, SeqCst);
        h.proc_count.store(PROCS as u32, SeqCst);
        let quantum_us = (quantum_ns / 1000).clamp(1000, 1_000_000);
        h.quantum_us.store(quantum_us as u32, SeqCst);
        h.turn.store(Turn::NONE.pack(), SeqCst);
        h.magic.store(MAGIC, SeqCst);
    }

    pub fn is_initialised(&self) -> bool {
        self.header.magic.load(SeqCst) == MAGIC
    }

    /// Checks an initialised header against this build's layout.
    pub fn check_layout(&self) -> Result<(), String> {
        let h = &self.header;
        let (version, tenants, procs) = (
            h.version.load(SeqCst),
            h.tenant_count.load(SeqCst),
            h.proc_count.load(SeqCst),
        );
        let known = (VERSION_COMPATIBLE_MIN..=VERSION).contains(&version);
        if !known || tenants as usize != TENANTS || procs as usize != PROCS {
            return Err(format!(
                "the schedule file has version {version} ({tenants} tenants, {procs} processes); \
                 this interposer writes version {VERSION} ({TENANTS}, {PROCS}): processes of two \
                 vgpu versions share a GPU"
            ));
        }
        Ok(())
    }

    /// A latency tenant launches now (`now_ns` > 0).
    #[inline]
    pub fn stamp_latency(&self, now_ns: u64) {
        debug_assert!(now_ns > 0);
        self.header.latency_ns.store(now_ns, Relaxed);
    }

    /// Whether a latency tenant launched within `hold_ns` of `now_ns`: one relaxed load.
    #[inline]
    pub fn latency_active(&self, now_ns: u64, hold_ns: u64) -> bool {
        latency_fresh(self.header.latency_ns.load(Relaxed), now_ns, hold_ns)
    }

    pub fn quantum_ns(&self) -> u64 {
        u64::from(self.header.quantum_us.load(Relaxed).clamp(1000, 1_000_000)) * 1000
    }

    /// Counts `n` steps of tenant slot `tenant` (a synchronisation that waited for its work),
    /// unless its application counts its own units: then steps are not its measure.
    #[inline]
    pub fn count_steps(&self, tenant: usize, n: u64) {
        let progress = &self.tenants[tenant].progress;
        if progress.load(Relaxed) & PROGRESS_HINTED == 0 {
            progress.fetch_add(n, Relaxed);
        }
    }

    /// Counts `n` of the application's own units of progress for tenant slot `tenant`
    /// (`vgpu_progress`); the first such count marks the slot [`PROGRESS_HINTED`], and from
    /// then on steps are not counted.
    #[inline]
    pub fn count_progress(&self, tenant: usize, n: u64) {
        let progress = &self.tenants[tenant].progress;
        if progress.load(Relaxed) & PROGRESS_HINTED == 0 {
            progress.fetch_or(PROGRESS_HINTED, Relaxed);
        }
        progress.fetch_add(n, Relaxed);
    }

    /// Tenant slot `tenant`'s progress: its count (without the flag) and whether the count is
    /// the application's own units.
    pub fn progress(&self, tenant: usize) -> (u64, bool) {
        let word = self.tenants[tenant].progress.load(Relaxed);
        (word & !PROGRESS_HINTED, word & PROGRESS_HINTED != 0)
    }

    /// Rewrites the config word of the live tenant slot named `name` with `change` applied to
    /// the config in it (normalised the way `TenantConfig::pack` stores it), and returns the
    /// config before and after; `None` when no live slot has that name. The running processes'
    /// turn logic unpacks this word at every selection (`Schedule::select`), so the change takes
    /// effect at the next handover. A compare-and-swap: a process joining meanwhile (which
    /// stores its own environment's config) wins or loses as a whole, and `change` is applied
    /// again to what it wrote. An unchanged config is not stored, so `|config| config` reads.
    pub fn update_tenant_config(
        &self,
        name: &str,
        change: impl Fn(TenantConfig) -> TenantConfig,
    ) -> Option<(TenantConfig, TenantConfig)> {
        if name.is_empty() || name.len() >= NAME_BYTES {
            return None;
        }
        let words = name_words(name);
        let index = (0..TENANTS).find(|&index| {
            self.tenants[index].state.load(SeqCst) == state(PHASE_LIVE, 0)
                && self.name_matches(index, &words)
        })?;
        let word = &self.tenants[index].config;
        for _ in 0..1000 {
            let old_word = word.load(SeqCst);
            let old = TenantConfig::unpack(old_word);
            let new_word = change(old).pack();
            let new = TenantConfig::unpack(new_word);
            debug_assert_eq!(new.pack(), new_word, "a packed config round-trips");
            if new_word == old_word
                || word
                    .compare_exchange(old_word, new_word, SeqCst, SeqCst)
                    .is_ok()
            {
                // The slot may have been reclaimed and claimed by another name in between (only
                // once none of its processes is alive); then the claimer's own store decides.
                let still_ours = self.tenants[index].state.load(SeqCst) == state(PHASE_LIVE, 0)
                    && self.name_matches(index, &words);
                return still_ours.then_some((old, new));
            }
            std::thread::yield_now();
        }
        None
    }

    fn name_matches(&self, index: usize, name: &[u64; NAME_BYTES / 8]) -> bool {
        self.tenants[index]
            .name
            .iter()
            .zip(name)
            .all(|(stored, word)| stored.load(SeqCst) == *word)
    }
}

/// One tenant's GPU time on this GPU, as a reader outside the tenants sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantTime {
    pub name: String,
    /// Turn time charged to the tenant (`TenantSlot::used_ns`).
    pub used_ns: u64,
    /// Live processes of the tenant with a slot on this GPU.
    pub processes: u32,
}

impl Region {
    /// Reads the live tenants' GPU time without writing or waiting: atomic loads only, like the
    /// schedule's own readers. Slots being claimed or reclaimed are skipped; a name whose bytes
    /// changed while being read (a slot reused at that instant) is read again, at most twice.
    /// Process slots count when `liveness` says their process runs (dead ones wait for a
    /// launching process to reclaim them).
    pub fn tenant_times(&self, liveness: &impl Liveness) -> Vec<TenantTime> {
        let mut processes = [0u32; TENANTS];
        for proc in &self.procs {
            let tenant = proc.tenant.load(SeqCst) as usize;
            let pid = proc.pid.load(SeqCst);
            if pid != 0
                && pid & RECLAIMING_BIT == 0
                && (1..=TENANTS).contains(&tenant)
                && liveness.is_alive(pid, proc.start_time.load(SeqCst))
            {
                processes[tenant - 1] += 1;
            }
        }
        let times: Vec<TenantTime> = self
            .live_slots_with(|slot| slot.used_ns.load(SeqCst))
            .into_iter()
            .map(|(index, name, used_ns)| TenantTime {
                name,
                used_ns,
                processes: processes[index],
            })
            .collect();
        debug_assert!(times.len() <= TENANTS);
        times
    }

    /// The live tenant slots with what the agent's redistribution reads of each: atomic loads
    /// only, skipping slots being claimed or reclaimed (as [`Region::live_slots`]).
    pub fn activity(&self) -> Vec<Activity> {
        self.live_slots_with(|slot| {
            let word = slot.progress.load(Relaxed);
            (
                TenantConfig::unpack(slot.config.load(Relaxed)),
                slot.demand_ns.load(Relaxed),
                word & !PROGRESS_HINTED,
                word & PROGRESS_HINTED != 0,
            )
        })
        .into_iter()
        .map(
            |(slot, name, (config, demand_ns, progress, hinted))| Activity {
                slot,
                name,
                config,
                demand_ns,
                progress,
                hinted,
            },
        )
        .collect()
    }

    /// The live tenant slots and their names (slots being claimed or reclaimed skipped, as
    /// [`Region::tenant_times`] skips them): atomic loads only.
    pub fn live_slots(&self) -> Vec<(usize, String)> {
        self.live_slots_with(|_| ())
            .into_iter()
            .map(|(index, name, ())| (index, name))
            .collect()
    }

    /// Each live slot's index, name and `read(slot)`, read between two checks that the slot is
    /// live under the same name; a name whose bytes changed while being read (a slot reused at
    /// that instant) is read again, at most twice.
    fn live_slots_with<T>(&self, read: impl Fn(&TenantSlot) -> T) -> Vec<(usize, String, T)> {
        let live = state(PHASE_LIVE, 0);
        let mut slots = Vec::new();
        for (index, slot) in self.tenants.iter().enumerate() {
            for _ in 0..3 {
                if slot.state.load(SeqCst) != live {
                    break;
                }
                let words: [u64; NAME_BYTES / 8] =
                    std::array::from_fn(|i| slot.name[i].load(SeqCst));
                let value = read(slot);
                if slot.state.load(SeqCst) != live || !self.name_matches(index, &words) {
                    continue;
                }
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                let name = String::from_utf8_lossy(&bytes[..end]).into_owned();
                if !name.is_empty() {
                    slots.push((index, name, value));
                }
                break;
            }
        }
        debug_assert!(slots.len() <= TENANTS);
        slots
    }
}

/// Whether a latency stamp `stamp_ns` (0: never) is within `hold_ns` of `now_ns`. A stamp slightly
/// in the future (another process's clock read raced ours) counts as fresh.
pub fn latency_fresh(stamp_ns: u64, now_ns: u64, hold_ns: u64) -> bool {
    stamp_ns != 0 && now_ns.saturating_sub(stamp_ns) < hold_ns
}

/// One live tenant slot as the agent's redistribution reads it ([`Region::activity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    pub slot: usize,
    pub name: String,
    pub config: TenantConfig,
    /// `TenantSlot::demand_ns`: when one of its processes last launched or waited to.
    pub demand_ns: u64,
    /// `TenantSlot::progress` without the flag.
    pub progress: u64,
    /// The count is the application's own units (`PROGRESS_HINTED`), not steps.
    pub hinted: bool,
}

/// A tenant's scheduling parameters on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantConfig {
    /// Guaranteed share in percent, 1..=100.
    pub share_pct: u32,
    /// May use idle time beyond its share.
    pub burst: bool,
    /// Its share is reserved for it (otherwise best effort: it gets its share only from what the
    /// guaranteed tenants leave, higher priority first).
    pub guaranteed: bool,
    /// Higher first.
    pub priority: i32,
}

impl TenantConfig {
    fn pack(self) -> u64 {
        let flags = u64::from(self.burst) | u64::from(self.guaranteed) << 1;
        u64::from(self.share_pct.clamp(1, 100)) | flags << 8 | u64::from(self.priority as u32) << 32
    }

    fn unpack(word: u64) -> TenantConfig {
        TenantConfig {
            share_pct: (word & 0xFF) as u32,
            burst: word >> 8 & 1 == 1,
            guaranteed: word >> 9 & 1 == 1,
            priority: (word >> 32) as u32 as i32,
        }
    }
}

/// Who holds the GPU, since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    /// A tenant index, `OWNER_IDLE` or `OWNER_NONE`.
    pub owner: usize,
    pub start_us: u64,
}

impl Turn {
    pub const NONE: Turn = Turn {
        owner: OWNER_NONE,
        start_us: 0,
    };

    pub fn pack(self) -> u64 {
        debug_assert!(self.owner <= OWNER_NONE);
        (self.owner as u64) << 56 | self.start_us & START_MASK_US
    }

    pub fn unpack(word: u64) -> Turn {
        Turn {
            owner: (word >> 56) as usize,
            start_us: word & START_MASK_US,
        }
    }

    fn start_ns(self) -> u64 {
        self.start_us.saturating_mul(1000)
    }
}

/// Splits the GPU between the active tenants (`(index, config)`); returns each one's weight in
/// parts per million and the idle weight, summing to `PPM`.
///
/// 1. Guaranteed tenants get their share (scaled down together if they add up past 100%, which
///    placement never does but a hand-set environment might).
/// 2. Best-effort tenants get their share out of what is left, higher priority first; within a
///    priority, in proportion to their shares.
/// 3. What is still left goes to the burst-allowed tenants of the highest priority among them,
///    in proportion to their shares; with none, it stays idle (non-burst tenants are capped).
pub fn weights(active: &[(usize, TenantConfig)]) -> (Vec<(usize, u64)>, u64) {
    let mut weight: Vec<f64> = vec![0.0; active.len()];
    let share = |i: usize| f64::from(active[i].1.share_pct.clamp(1, 100));
    let guaranteed_sum: f64 = (0..active.len())
        .filter(|&i| active[i].1.guaranteed)
        .map(share)
        .sum();
    let scale = if guaranteed_sum > 100.0 {
        100.0 / guaranteed_sum
    } else {
        1.0
    };
    for i in (0..active.len()).filter(|&i| active[i].1.guaranteed) {
        weight[i] = share(i) * scale;
    }
    let mut left = (100.0 - weight.iter().sum::<f64>()).max(0.0);
    let tiers = |members: &dyn Fn(usize) -> bool| {
        let mut priorities: Vec<i32> = (0..active.len())
            .filter(|&i| members(i))
            .map(|i| active[i].1.priority)
            .collect();
        priorities.sort_unstable_by(|a, b| b.cmp(a));
        priorities.dedup();
        priorities
    };
    for priority in tiers(&|i| !active[i].1.guaranteed) {
        let tier: Vec<usize> = (0..active.len())
            .filter(|&i| !active[i].1.guaranteed && active[i].1.priority == priority)
            .collect();
        let tier_sum: f64 = tier.iter().map(|&i| share(i)).sum();
        let given = tier_sum.min(left);
        for &i in &tier {
            weight[i] += given * share(i) / tier_sum;
        }
        left -= given;
    }
    if left > 0.0
        && let Some(&top) = tiers(&|i| active[i].1.burst).first()
    {
        let tier: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].1.burst && active[i].1.priority == top)
            .collect();
        let tier_sum: f64 = tier.iter().map(|&i| share(i)).sum();
        for &i in &tier {
            weight[i] += left * share(i) / tier_sum;
        }
        left = 0.0;
    }
    if active.is_empty() {
        return (Vec::new(), 0);
    }
    let to_ppm = |percent: f64| (percent * (PPM as f64 / 100.0)).round() as u64;
    let result: Vec<(usize, u64)> = active
        .iter()
        .zip(&weight)
        .map(|(&(index, _), &w)| (index, to_ppm(w)))
        .collect();
    let given: u64 = result.iter().map(|&(_, w)| w).sum();
    let idle = if left > 0.0 {
        PPM.saturating_sub(given)
    } else {
        0
    };
    debug_assert!(given <= PPM + active.len() as u64, "weights {result:?}");
    (result, idle)
}

/// A process's membership of a GPU's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub tenant: usize,
    pub proc: usize,
    pub pid: u32,
    /// Whether the tenant can ever have the whole GPU (burst-allowed, or a 100% share); a capped
    /// tenant alone still shares with idle turns, so it never takes the fast path.
    pub uncapped: bool,
}

impl Member {
    fn bit(&self) -> u64 {
        1 << self.tenant
    }
}

/// What a process about to launch should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Launch. `contended`: other tenants are active, so the caller bounds its queued work.
    Go { contended: bool },
    /// Not our turn: sleep briefly and ask again.
    Wait,
    /// Our turn is over and another tenant is next: drain our queued work, call `drained`, ask
    /// again.
    Drain,
}

/// The protocol over a region.
pub struct Schedule<'r, L> {
    pub region: &'r Region,
    pub liveness: L,
    quantum_ns: u64,
}

impl<'r, L: Liveness> Schedule<'r, L> {
    pub fn new(region: &'r Region, liveness: L) -> Self {
        Schedule {
            quantum_ns: region.quantum_ns(),
            region,
            liveness,
        }
    }

    pub fn quantum_ns(&self) -> u64 {
        self.quantum_ns
    }

    /// How long after a deadline (or after an owner's last sign of life) a silent owner is taken
    /// over without having reported its drain.
    pub fn grace_ns(&self) -> u64 {
        self.quantum_ns / 2
    }

    /// A tenant whose demand stamp is older than this no longer counts as active.
    fn active_window_ns(&self) -> u64 {
        2 * self.quantum_ns
    }

    /// Joins tenant `name` (creating its slot if needed) as process `pid`.
    pub fn join(
        &self,
        name: &str,
        config: TenantConfig,
        pid: u32,
        start_time: u64,
        now_ns: u64,
    ) -> Result<Member, String> {
        assert!(
            pid != 0 && pid & RECLAIMING_BIT == 0,
            "pid {pid} cannot join"
        );
        assert!(name.len() < NAME_BYTES, "tenant name too long");
        let proc = self.claim_proc(pid, start_time).ok_or_else(|| {
            format!("all {PROCS} process slots of this GPU's schedule are in use by live processes")
        })?;
        let words = name_words(name);
        for _ in 0..1000 {
            let Some(tenant) = self.find_or_claim_tenant(&words, config, pid, now_ns) else {
                break;
            };
            let slot = &self.region.procs[proc];
            slot.tenant.store(tenant as u32 + 1, SeqCst);
            let t = &self.region.tenants[tenant];
            if t.state.load(SeqCst) == state(PHASE_LIVE, 0)
                && self.region.name_matches(tenant, &words)
            {
                t.config.store(config.pack(), SeqCst);
                return Ok(Member {
                    tenant,
                    proc,
                    pid,
                    uncapped: config.burst || config.share_pct >= 100,
                });
            }
            slot.tenant.store(0, SeqCst);
            std::thread::yield_now();
        }
        self.leave(Member {
            tenant: 0,
            proc,
            pid,
            uncapped: false,
        });
        Err(format!(
            "all {TENANTS} tenant slots of this GPU's schedule are in use by live tenants"
        ))
    }

    /// Gives the process slot back (a clean exit; a dead process's slot is reclaimed anyway).
    pub fn leave(&self, member: Member) {
        let slot = &self.region.procs[member.proc];
        if slot.pid.load(SeqCst) == member.pid {
            slot.busy_ns.store(0, SeqCst);
            slot.tenant.store(0, SeqCst);
            slot.start_time.store(0, SeqCst);
            slot.pid.store(0, SeqCst);
        }
    }

    fn claim_proc(&self, pid: u32, start_time: u64) -> Option<usize> {
        for attempt in 0..2 {
            for (index, slot) in self.region.procs.iter().enumerate() {
                if slot.pid.compare_exchange(0, pid, SeqCst, SeqCst).is_ok() {
                    slot.tenant.store(0, SeqCst);
                    slot.busy_ns.store(0, SeqCst);
                    slot.start_time.store(start_time, SeqCst);
                    return Some(index);
                }
            }
            if attempt == 0 && self.reclaim_dead(pid) == 0 {
                break;
            }
        }
        None
    }

    /// The index of the `LIVE` slot named `words`, claiming one if there is none.
    fn find_or_claim_tenant(
        &self,
        words: &[u64; NAME_BYTES / 8],
        config: TenantConfig,
        pid: u32,
        now_ns: u64,
    ) -> Option<usize> {
        for _ in 0..1000 {
            let mut someone_claiming = false;
            for (index, slot) in self.region.tenants.iter().enumerate() {
                let s = slot.state.load(SeqCst);
                match phase_of(s) {
                    PHASE_LIVE if self.region.name_matches(index, words) => return Some(index),
                    PHASE_NAMED if self.region.name_matches(index, words) => {
                        if self.liveness.is_alive(pid_of(s), 0) {
                            someone_claiming = true;
                        } else {
                            let _ = slot.state.compare_exchange(s, 0, SeqCst, SeqCst);
                        }
                    }
                    _ => {}
                }
            }
            if someone_claiming {
                std::thread::yield_now();
                continue;
            }
            match self.claim_tenant(words, config, pid, now_ns) {
                Claim::Mine(index) | Claim::Theirs(index) => return Some(index),
                Claim::Retry => std::thread::yield_now(),
                Claim::Full => {
                    if self.reclaim_tenants(pid) == 0 {
                        return None;
                    }
                }
            }
        }
        None
    }

    fn claim_tenant(
        &self,
        words: &[u64; NAME_BYTES / 8],
        config: TenantConfig,
        pid: u32,
        now_ns: u64,
    ) -> Claim {
        let Some(mine) = self.region.tenants.iter().position(|slot| {
            slot.state
                .compare_exchange(0, state(PHASE_WRITING, pid), SeqCst, SeqCst)
                .is_ok()
        }) else {
            return Claim::Full;
        };
        let slot = &self.region.tenants[mine];
        for (stored, word) in slot.name.iter().zip(words) {
            stored.store(*word, SeqCst);
        }
        slot.config.store(config.pack(), SeqCst);
        slot.vt
            .store(self.region.header.floor_vt.load(SeqCst), SeqCst);
        slot.demand_ns.store(now_ns, SeqCst);
        slot.used_ns.store(0, SeqCst);
        slot.progress.store(0, SeqCst);
        self.region.control.clear_latency(mine);
        let named = state(PHASE_NAMED, pid);
        slot.state.store(named, SeqCst);
        let free_mine = || slot.state.store(0, SeqCst);
        for (other, other_slot) in self.region.tenants.iter().enumerate() {
            if other == mine || !self.region.name_matches(other, words) {
                continue;
            }
            let s = other_slot.state.load(SeqCst);
            match phase_of(s) {
                PHASE_LIVE => {
                    free_mine();
                    return Claim::Theirs(other);
                }
                PHASE_NAMED if other < mine => {
                    free_mine();
                    return Claim::Retry;
                }
                PHASE_NAMED => {
                    // A later claimer of the same name: cancel its claim, unless it went live.
                    let cancelled = other_slot
                        .state
                        .compare_exchange(s, 0, SeqCst, SeqCst)
                        .is_ok();
                    if !cancelled && other_slot.state.load(SeqCst) == state(PHASE_LIVE, 0) {
                        free_mine();
                        return Claim::Theirs(other);
                    }
                }
                _ => {}
            }
        }
        if slot
            .state
            .compare_exchange(named, state(PHASE_LIVE, 0), SeqCst, SeqCst)
            .is_ok()
        {
            Claim::Mine(mine)
        } else {
            Claim::Retry
        }
    }

    /// Frees tenant slots without live processes (and claims abandoned half-way); returns how
    /// many.
    pub fn reclaim_tenants(&self, reclaimer_pid: u32) -> usize {
        self.reclaim_dead(reclaimer_pid);
        let mut freed = 0;
        for (index, slot) in self.region.tenants.iter().enumerate() {
            let s = slot.state.load(SeqCst);
            let phase = phase_of(s);
            if phase == PHASE_FREE {
                continue;
            }
            if phase != PHASE_LIVE {
                if !self.liveness.is_alive(pid_of(s), 0)
                    && slot.state.compare_exchange(s, 0, SeqCst, SeqCst).is_ok()
                {
                    freed += 1;
                }
                continue;
            }
            let reclaiming = state(PHASE_RECLAIMING, reclaimer_pid);
            if slot
                .state
                .compare_exchange(s, reclaiming, SeqCst, SeqCst)
                .is_err()
            {
                continue;
            }
            if self.has_processes(index) {
                slot.state.store(s, SeqCst);
                continue;
            }
            self.region
                .header
                .active
                .fetch_and(!(1u64 << index), SeqCst);
            for word in &slot.name {
                word.store(0, SeqCst);
            }
            slot.state.store(0, SeqCst);
            freed += 1;
        }
        freed
    }

    /// Bit `i`: tenant `i` has a process slot (live, or dead and not yet reclaimed).
    fn tenants_with_processes(&self) -> u64 {
        self.region.procs.iter().fold(0, |mask, p| {
            let tenant = p.tenant.load(SeqCst) as usize;
            if p.pid.load(SeqCst) != 0 && (1..=TENANTS).contains(&tenant) {
                mask | 1 << (tenant - 1)
            } else {
                mask
            }
        })
    }

    /// Whether a process of `tenant` still runs (a slot being reclaimed does not count).
    fn has_live_processes(&self, tenant: usize) -> bool {
        self.region.procs.iter().any(|p| {
            let pid = p.pid.load(SeqCst);
            pid != 0
                && pid & RECLAIMING_BIT == 0
                && p.tenant.load(SeqCst) == tenant as u32 + 1
                && self.liveness.is_alive(pid, p.start_time.load(SeqCst))
        })
    }

    fn has_processes(&self, tenant: usize) -> bool {
        self.region.procs.iter().any(|p| {
            let pid = p.pid.load(SeqCst);
            pid != 0 && p.tenant.load(SeqCst) == tenant as u32 + 1
        })
    }

    /// Reclaims the process slots of processes that no longer run; returns how many.
    pub fn reclaim_dead(&self, reclaimer_pid: u32) -> usize {
        crate::ledger::reclaim_dead_slots(
            &self.region.procs,
            &self.liveness,
            reclaimer_pid,
            |slot| (&slot.pid, &slot.start_time),
            |slot| {
                slot.busy_ns.store(0, SeqCst);
                slot.tenant.store(0, SeqCst);
            },
        )
    }

    /// The launch fast path: our turn, before its deadline, and nobody else active. A few relaxed
    /// loads.
    #[inline]
    pub fn fast_ok(&self, member: &Member, now_ns: u64) -> bool {
        let turn = Turn::unpack(self.region.header.turn.load(Relaxed));
        member.uncapped
            && turn.owner == member.tenant
            && now_ns < turn.start_ns().saturating_add(self.quantum_ns)
            && self.region.header.active.load(Relaxed) == member.bit()
    }

    /// Whether the agent has `member`'s tenant launch side by side now (no turns to wait for:
    /// `control::Control::side_by_side`). Asked on the slow path only.
    #[inline]
    pub fn side_by_side(&self, member: &Member, now_ns: u64) -> bool {
        self.region.control.side_by_side(member.tenant, now_ns)
    }

    /// Records that the tenant wants the GPU now (callers throttle this to every few hundred µs).
    pub fn demand(&self, member: &Member, now_ns: u64) {
        let h = &self.region.header;
        self.region.tenants[member.tenant]
            .demand_ns
            .store(now_ns, Relaxed);
        if h.active.load(Relaxed) & member.bit() == 0 {
            h.active.fetch_or(member.bit(), SeqCst);
        }
    }

    /// Whether this process reported undrained work.
    pub fn is_busy(&self, member: &Member) -> bool {
        self.region.procs[member.proc].busy_ns.load(Relaxed) != 0
    }

    /// This process launches work that will need draining.
    pub fn mark_busy(&self, member: &Member, now_ns: u64) {
        let busy = &self.region.procs[member.proc].busy_ns;
        if busy.load(Relaxed) == 0 {
            busy.store(now_ns.max(1), SeqCst);
        }
    }

    /// This process's queued work has completed.
    pub fn drained(&self, member: &Member) {
        self.region.procs[member.proc].busy_ns.store(0, SeqCst);
    }

    /// The slow path: what a process of `member`'s tenant that wants to launch should do now.
    pub fn step(&self, member: &Member, now_ns: u64) -> Step {
        self.demand(member, now_ns);
        let word = self.region.header.turn.load(SeqCst);
        let turn = Turn::unpack(word);
        let deadline = turn.start_ns().saturating_add(self.quantum_ns);
        let others_active =
            self.region.header.active.load(SeqCst) & !member.bit() != 0 || !member.uncapped;
        if turn.owner == member.tenant && now_ns < deadline {
            return Step::Go {
                contended: others_active,
            };
        }
        if turn.owner == member.tenant {
            // Our turn is over. Keep it if we are next anyway; otherwise drain, then hand over.
            let next = self.select(now_ns, turn).next;
            if next != member.tenant && self.is_busy(member) {
                return Step::Drain;
            }
            return self.hand_over(member, word, now_ns);
        }
        match self.may_take_over(turn, now_ns) {
            TakeOver::No => Step::Wait,
            TakeOver::Yes => self.hand_over(member, word, now_ns),
            TakeOver::FromSilent => {
                // The owner died: reclaim dead processes first, so that a tenant with none left
                // is not chosen again.
                self.reclaim_dead(member.pid);
                self.hand_over(member, word, now_ns)
            }
        }
    }

    /// Whether the turn `turn` (not ours) may be taken now.
    fn may_take_over(&self, turn: Turn, now_ns: u64) -> TakeOver {
        let deadline = turn.start_ns().saturating_add(self.quantum_ns);
        let expired = now_ns >= deadline;
        let yes = |condition: bool| {
            if condition {
                TakeOver::Yes
            } else {
                TakeOver::No
            }
        };
        match turn.owner {
            OWNER_NONE => return TakeOver::Yes,
            OWNER_IDLE => return yes(expired || self.active_weights(now_ns, None).1 == 0),
            owner if owner >= TENANTS => return TakeOver::Yes,
            _ => {}
        }
        let slot = &self.region.tenants[turn.owner];
        if slot.state.load(SeqCst) != state(PHASE_LIVE, 0) {
            return TakeOver::Yes;
        }
        let silent_ns = now_ns.saturating_sub(slot.demand_ns.load(SeqCst));
        let drained = !self.has_queued_work(turn.owner);
        // A silent owner may be blocked on its queued work (a `cudaDeviceSynchronize`, which is
        // not gated): taking its turn then would overlap the next tenant's kernels with its own.
        // So only a dead owner is taken over for its silence, as soon as it is idle; a live one
        // keeps its turn until the deadline plus grace, while its queue (bounded by the gate)
        // drains. Checked only once it is idle: liveness reads `/proc`.
        if silent_ns >= IDLE_GAP_NS && !self.has_live_processes(turn.owner) {
            return TakeOver::FromSilent;
        }
        let grace = self.grace_ns();
        if expired {
            yes(drained || now_ns >= deadline.saturating_add(grace))
        } else {
            yes(silent_ns >= IDLE_GAP_NS && drained)
        }
    }

    /// The active tenants (dropping stale bits from `active`, except `keep`) with their weights,
    /// and the idle weight.
    fn active_weights(&self, now_ns: u64, keep: Option<usize>) -> (Vec<(usize, u64)>, u64) {
        let h = &self.region.header;
        let bits = h.active.load(SeqCst);
        let with_processes = self.tenants_with_processes();
        let mut active = Vec::new();
        for (index, slot) in self.region.tenants.iter().enumerate() {
            if bits & 1 << index == 0 {
                continue;
            }
            let live =
                slot.state.load(SeqCst) == state(PHASE_LIVE, 0) && with_processes & 1 << index != 0;
            let recent =
                now_ns.saturating_sub(slot.demand_ns.load(SeqCst)) < self.active_window_ns();
            if live && (recent || keep == Some(index)) {
                active.push((index, TenantConfig::unpack(slot.config.load(SeqCst))));
            } else if !live || !recent {
                h.active.fetch_and(!(1u64 << index), SeqCst);
                // A tenant that demanded again in between sets its bit again on its next launch.
                if live
                    && now_ns.saturating_sub(slot.demand_ns.load(SeqCst)) < self.active_window_ns()
                {
                    h.active.fetch_or(1u64 << index, SeqCst);
                }
            }
        }
        weights(&active)
    }

    /// The next owner after turn `old` (a tenant, `OWNER_IDLE`, or `OWNER_NONE` if nobody is
    /// active), its virtual time (raised to the floor), and the charge for `old` so far, which
    /// counts in the choice (keeping `old.owner` in the active set to compute it).
    fn select(&self, now_ns: u64, old: Turn) -> Selection {
        let keep = (old.owner < TENANTS).then_some(old.owner);
        let (weights, idle) = self.active_weights(now_ns, keep);
        // A turn ends when it is handed over, or, for an owner that stopped asking for the GPU,
        // one active window after its last demand: the time in between was not its use, and
        // charging it would skew its GPU time and push its virtual time ahead (so it would wait
        // longer once it comes back).
        let end = match old.owner {
            owner if owner < TENANTS => {
                let quiet_since = self.region.tenants[owner]
                    .demand_ns
                    .load(SeqCst)
                    .saturating_add(self.active_window_ns());
                now_ns.min(quiet_since.max(old.start_ns()))
            }
            _ => now_ns,
        };
        // Nor is a turn charged past its deadline plus grace: an owner that launches after its
        // deadline re-selects itself (a new turn), so a turn runs on only while its owner does
        // not launch (copies, CPU work, a synchronisation), and its queue (bounded by the gate)
        // drains within the grace. Charging such a stretch (NCCL setting up connections for
        // seconds) to a capped tenant would owe the idle pseudo-tenant as much: seconds of idle
        // turns (issue 16).
        let end = end.min(
            old.start_ns()
                .saturating_add(self.quantum_ns)
                .saturating_add(self.grace_ns()),
        );
        let elapsed = if old.start_us == 0 {
            0
        } else {
            end.saturating_sub(old.start_ns())
        };
        let charge = match old.owner {
            OWNER_IDLE if idle > 0 => stride(elapsed, idle),
            owner if owner < TENANTS => {
                let weight = weights
                    .iter()
                    .find(|&&(index, _)| index == owner)
                    .map(|&(_, w)| w)
                    .filter(|&w| w > 0)
                    .unwrap_or_else(|| {
                        let config =
                            TenantConfig::unpack(self.region.tenants[owner].config.load(SeqCst));
                        u64::from(config.share_pct.clamp(1, 100)) * (PPM / 100)
                    });
                stride(elapsed, weight)
            }
            _ => 0,
        };
        let floor = self.region.header.floor_vt.load(SeqCst);
        let pending = |index: usize| if index == old.owner { charge } else { 0 };
        // The old owner is in `weights` to be charged (`keep`), not to be chosen again once it
        // has stopped asking for the GPU: silent since before its turn began, it is charged
        // nothing, and with the lowest virtual time it won every hand-over for as long as it
        // stayed silent (a process blocked outside the gate, in elastic memory's line, kept the
        // GPU from the others for minutes).
        let silent_owner = old.owner < TENANTS
            && now_ns.saturating_sub(self.region.tenants[old.owner].demand_ns.load(SeqCst))
                >= self.active_window_ns();
        let mut best: Option<(u64, usize)> = None;
        for &(index, weight) in &weights {
            if weight == 0 || (silent_owner && index == old.owner) {
                continue;
            }
            let vt = self.region.tenants[index].vt.load(SeqCst).max(floor) + pending(index);
            if best.is_none_or(|(v, _)| vt < v) {
                best = Some((vt, index));
            }
        }
        if idle > 0 {
            let vt = self.region.header.idle_vt.load(SeqCst).max(floor) + pending(OWNER_IDLE);
            if best.is_none_or(|(v, _)| vt < v) {
                best = Some((vt, OWNER_IDLE));
            }
        }
        let (vt, next) = best.unwrap_or((floor, OWNER_NONE));
        Selection {
            next,
            vt,
            elapsed,
            charge,
        }
    }

    /// Ends the turn `word` and starts the next one (CAS); the winner charges the old owner.
    fn hand_over(&self, member: &Member, word: u64, now_ns: u64) -> Step {
        let old = Turn::unpack(word);
        let selection = self.select(now_ns, old);
        let next = if selection.next == OWNER_NONE {
            member.tenant
        } else {
            selection.next
        };
        let new = Turn {
            owner: next,
            start_us: (now_ns / 1000).max(old.start_us + 1),
        };
        let h = &self.region.header;
        if h.turn
            .compare_exchange(word, new.pack(), SeqCst, SeqCst)
            .is_err()
        {
            return Step::Wait;
        }
        h.handovers.fetch_add(1, Relaxed);
        let floor = h.floor_vt.load(SeqCst);
        if old.owner < TENANTS {
            let slot = &self.region.tenants[old.owner];
            slot.vt.fetch_max(floor, SeqCst);
            slot.vt.fetch_add(selection.charge, SeqCst);
            slot.used_ns.fetch_add(selection.elapsed, Relaxed);
        } else if old.owner == OWNER_IDLE {
            h.idle_vt.fetch_max(floor, SeqCst);
            h.idle_vt.fetch_add(selection.charge, SeqCst);
        }
        let next_vt = if next == OWNER_IDLE {
            &h.idle_vt
        } else {
            &self.region.tenants[next].vt
        };
        // The winner's virtual time becomes the floor at which tenants that were idle re-enter
        // (when the winner is the old owner, that includes this turn's charge).
        next_vt.fetch_max(selection.vt, SeqCst);
        h.floor_vt.fetch_max(selection.vt, SeqCst);
        if next == member.tenant {
            Step::Go {
                contended: h.active.load(SeqCst) & !member.bit() != 0 || !member.uncapped,
            }
        } else {
            Step::Wait
        }
    }

    /// Whether a live process of the tenant at `tenant` reported work it has not drained.
    fn has_queued_work(&self, tenant: usize) -> bool {
        self.region.procs.iter().any(|p| {
            p.pid.load(SeqCst) != 0
                && p.tenant.load(SeqCst) == tenant as u32 + 1
                && p.busy_ns.load(SeqCst) != 0
        })
    }

    /// The current turn (for diagnostics and tests).
    pub fn turn(&self) -> Turn {
        Turn::unpack(self.region.header.turn.load(SeqCst))
    }

    /// Why a process of `member` waits at `now_ns`, in one line for a log: the turn's owner, how
    /// long its turn has run, its last demand, whether its processes have queued work, and the
    /// virtual times the next owner is chosen by.
    pub fn explain_wait(&self, member: &Member, now_ns: u64) -> String {
        let turn = self.turn();
        let names: std::collections::HashMap<usize, String> = self
            .region
            .live_slots_with(|_| ())
            .into_iter()
            .map(|(index, name, ())| (index, name))
            .collect();
        let name = |index: usize| match index {
            OWNER_IDLE => "an idle turn".to_owned(),
            OWNER_NONE => "nobody".to_owned(),
            i => names
                .get(&i)
                .cloned()
                .unwrap_or_else(|| format!("slot {i}")),
        };
        let ms = |ns: u64| ns as f64 / 1e6;
        let mut line = format!(
            "turn of {} for {:.1} ms (quantum {:.0} ms)",
            name(turn.owner),
            ms(now_ns.saturating_sub(turn.start_ns())),
            ms(self.quantum_ns)
        );
        if turn.owner < TENANTS {
            let owner = &self.region.tenants[turn.owner];
            let busy = self.has_queued_work(turn.owner);
            line.push_str(&format!(
                ", its last demand {:.1} ms ago, queued work {}, virtual time {}",
                ms(now_ns.saturating_sub(owner.demand_ns.load(SeqCst))),
                if busy { "yes" } else { "no" },
                owner.vt.load(SeqCst)
            ));
        }
        let h = &self.region.header;
        line.push_str(&format!(
            "; {}'s virtual time {}, floor {}, idle {}, active tenants {:#x}",
            name(member.tenant),
            self.region.tenants[member.tenant].vt.load(SeqCst),
            h.floor_vt.load(SeqCst),
            h.idle_vt.load(SeqCst),
            h.active.load(SeqCst)
        ));
        line
    }
}

enum TakeOver {
    No,
    Yes,
    /// The owner is silent and has no live process left.
    FromSilent,
}

struct Selection {
    next: usize,
    vt: u64,
    elapsed: u64,
    charge: u64,
}

enum Claim {
    Mine(usize),
    Theirs(usize),
    Retry,
    Full,
}

/// Virtual time for `elapsed_ns` at `weight_ppm`.
fn stride(elapsed_ns: u64, weight_ppm: u64) -> u64 {
    let v = u128::from(elapsed_ns) * u128::from(PPM) / u128::from(weight_ppm.max(1));
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn name_words(name: &str) -> [u64; NAME_BYTES / 8] {
    let mut bytes = [0u8; NAME_BYTES];
    bytes[..name.len()].copy_from_slice(name.as_bytes());
    std::array::from_fn(|i| {
        u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
    })
}

#[cfg(test)]
#[path = "compute_test.rs"]
mod tests;
