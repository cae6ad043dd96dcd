//! The launch gate, in safe code: every kernel launch (`cuLaunchKernel[Ex]`, cooperative
//! launches, `cuGraphLaunch`, and their `_ptsz` variants), every asynchronous copy within the
//! GPU's memory (`cuMemcpyDtoDAsync_v2`, `cuMemcpyAsync` between device addresses) and every
//! asynchronous memset (both run on the SMs) passes `before` and, when it is sampled, `after`.
//! `exports` supplies the driver through the `Gpu` trait; the schedule protocol is `compute`.
//!
//! - **Fast path** (our turn, nobody else active): the `OnceLock`s of the configuration and the
//!   device's gate, a vDSO clock read, two relaxed loads of the schedule, a throttled demand stamp
//!   (one shared store every `DEMAND_EVERY_NS`) and a thread-local counter. No lock, no system
//!   call, no driver call (in a process that sees one GPU; otherwise one `cuCtxGetDevice`).
//! - **Queue bound**: every `SAMPLE_ALONE`-th launch of a thread (every `SAMPLE_CONTENDED`-th
//!   while other tenants are active) records an event on the launch's stream; a stream with more
//!   than `EVENTS_PER_STREAM_MAX` unfinished events makes the launching thread wait for the
//!   oldest. That bounds the work a tenant has queued, hence how long its turn takes to drain.
//! - **Side by side**: where the agent publishes the tenant side by side
//!   (`control::Control::side_by_side`, the redistribution's first lever) or the process runs
//!   with `VGPU_COMPUTE_TURNS=0`, a launch that missed the fast path waits for no turn either
//!   (one more relaxed load on that path only).
//! - **Slow path**: not our turn. The thread asks `Schedule::step` what to do, sleeping
//!   `POLL_SLEEP` between asks; when its own turn is over and another tenant is next, it drains
//!   (waits, at most a grace period, for its recorded events) and reports it. After `WAIT_MAX`
//!   it launches anyway (one log line): the gate never blocks forever.
//!
//! - **Stream capture**: a launch into a stream that is capturing a CUDA graph does not run now,
//!   so it goes straight to the driver, ungated and untracked (an event record or query on a
//!   capturing stream would invalidate the capture; the graph is gated at `cuGraphLaunch`).
//!   `exports` counts the captures in progress (`capture_began`, `capture_ended`); while the
//!   count is zero the only cost is one relaxed load. While it is not, each launch asks the
//!   driver whether its stream captures (`Gpu::stream_capturing`), and the gate still waits for
//!   turns but neither records nor queries events on any stream (in the global capture mode a
//!   `cuEventQuery` from any thread invalidates the capture), so nothing bounds the queue then.
//!
//! - **Steps** (the measure of progress of `docs/design/utility-redistribution.md`): a
//!   synchronisation that waited for work launched since the last one counts a step in the
//!   tenant's slot (`synchronised`, from the sync hooks through `closed_loop::synchronised`),
//!   until the application counts its own units (`count_progress`, `vgpu_progress`). It reads the
//!   demand stamp the launch path already keeps, so launches pay nothing for it.
//!
//! Failures fail open: no configuration, an unparsable one, an unusable schedule file, a GPU
//! without uuid, or a full table: the launch goes to the driver ungated, with one log line.
//!
//! Elastic memory's hold rule is not here but in `exports` (`hooks::enter_work`), after this
//! gate's turn and before the driver call of every launch and copy: it must hold a process that
//! has no compute share, a latency tenant and every copy too, which this gate does not see, and
//! it fails closed where this gate fails open.

use crate::compute::{Member, QUANTUM_NS_DEFAULT, Schedule, Step, TenantConfig};
use crate::ledger::{ProcLiveness, own_start_time};
use crate::shm::monotonic_ns;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tenant_abi::{ComputeEnv, DEVICES_MAX};

/// Record an event every this many launches of a thread while alone on the GPU...
pub const SAMPLE_ALONE: u32 = 16;
/// ... and while other tenants are active (a tighter bound, for sharp turn boundaries).
pub const SAMPLE_CONTENDED: u32 = 2;
/// Unfinished events per stream before a launch waits.
pub const EVENTS_PER_STREAM_MAX: usize = 2;
/// Pooled events kept for reuse.
const EVENT_POOL_MAX: usize = 64;
/// How often the tenant's demand stamp is refreshed from the fast path.
const DEMAND_EVERY_NS: u64 = 200_000;
/// Sleep between two looks at the schedule while waiting for a turn.
const POLL_SLEEP: Duration = Duration::from_micros(50);
/// Sleep between two looks at an event while bounding the queue or draining.
const EVENT_POLL_SLEEP: Duration = Duration::from_micros(20);
/// How long a wait for an event yields between looks before it sleeps between them: about what
/// the queue left behind the awaited event holds of small kernels (32 launches of a few
/// microseconds each), so that the waiting thread is back before that queue runs dry.
const EVENT_SPIN_NS: u64 = 200_000;
/// The longest a launch waits for its turn before it goes ahead anyway (logged).
const WAIT_MAX_NS: u64 = 5_000_000_000;
/// How often a process says that launches waited `WAIT_MAX_NS` (with the schedule's state).
const WAIT_MAX_SAID_EVERY_NS: u64 = 30_000_000_000;
/// The longest a launch waits for its own stream's oldest event, and at most one turn (the
/// schedule's quantum): the bound exists to keep turn boundaries sharp, which a longer wait cannot
/// do, and an event that takes longer is usually a kernel waiting for another process (a
/// collective whose peer has not launched yet, which may be waiting for us: two DDP ranks of one
/// tenant without MPS stalled 1 s each time, three times in their first step on an H100) or for a
/// later launch of this one.
const EVENT_WAIT_MAX_NS: u64 = 1_000_000_000;

/// Where this process's launches waited, for diagnosis: reported at `VGPU_LOG=2` at most every
/// `STATS_EVERY_NS` from the slow paths.
/// A job that runs slower inside a slice than bare shows here whether it waited for turns, for
/// its own queued kernels (the queue bound) or at handovers (drains).
struct Stats {
    turn_waits: AtomicU64,
    turn_wait_ns: AtomicU64,
    /// Of `turn_waits`: those that found the GPU in an idle turn (a capped tenant's share).
    idle_turn_waits: AtomicU64,
    turn_wait_max_ns: AtomicU64,
    queue_waits: AtomicU64,
    queue_wait_ns: AtomicU64,
    queue_timeouts: AtomicU64,
    drains: AtomicU64,
    drain_ns: AtomicU64,
    drain_timeouts: AtomicU64,
    reported_ns: AtomicU64,
}

static STATS: Stats = Stats {
    turn_waits: AtomicU64::new(0),
    turn_wait_ns: AtomicU64::new(0),
    idle_turn_waits: AtomicU64::new(0),
    turn_wait_max_ns: AtomicU64::new(0),
    queue_waits: AtomicU64::new(0),
    queue_wait_ns: AtomicU64::new(0),
    queue_timeouts: AtomicU64::new(0),
    drains: AtomicU64::new(0),
    drain_ns: AtomicU64::new(0),
    drain_timeouts: AtomicU64::new(0),
    reported_ns: AtomicU64::new(0),
};

/// How often the statistics are reported at most (debug level).
const STATS_EVERY_NS: u64 = 2_000_000_000;

impl Stats {
    fn turn_wait(&self, waited_ns: u64) {
        self.turn_waits.fetch_add(1, Relaxed);
        self.turn_wait_ns.fetch_add(waited_ns, Relaxed);
        self.turn_wait_max_ns.fetch_max(waited_ns, Relaxed);
        self.maybe_report();
    }

    fn queue_wait(&self, waited_ns: u64, timed_out: bool) {
        self.queue_waits.fetch_add(1, Relaxed);
        self.queue_wait_ns.fetch_add(waited_ns, Relaxed);
        if timed_out {
            self.queue_timeouts.fetch_add(1, Relaxed);
        }
        self.maybe_report();
    }

    fn drain(&self, waited_ns: u64, timed_out: bool) {
        self.drains.fetch_add(1, Relaxed);
        self.drain_ns.fetch_add(waited_ns, Relaxed);
        if timed_out {
            self.drain_timeouts.fetch_add(1, Relaxed);
        }
        self.maybe_report();
    }

    fn maybe_report(&self) {
        let now = monotonic_ns();
        let last = self.reported_ns.load(Relaxed);
        if now.saturating_sub(last) < STATS_EVERY_NS
            || self
                .reported_ns
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        let ms = |a: &AtomicU64| a.load(Relaxed) / 1_000_000;
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        crate::log::debug(format_args!(
            "gate at unix {}.{:03}: {} turn waits ({} in idle turns) {} ms, longest {} ms; {} queue-bound waits {} \
             ms ({} at the bound); {} drains {} ms ({} at the grace bound)",
            unix_ms / 1000,
            unix_ms % 1000,
            self.turn_waits.load(Relaxed),
            self.idle_turn_waits.load(Relaxed),
            ms(&self.turn_wait_ns),
            ms(&self.turn_wait_max_ns),
            self.queue_waits.load(Relaxed),
            ms(&self.queue_wait_ns),
            self.queue_timeouts.load(Relaxed),
            self.drains.load(Relaxed),
            ms(&self.drain_ns),
            self.drain_timeouts.load(Relaxed),
        ));
    }
}

/// The driver, as the gate needs it. Implemented by `exports` over the real driver and by fakes
/// in tests.
pub trait Gpu {
    fn current_device(&self) -> Option<i32>;
    fn device_count(&self) -> Option<i32>;
    /// The 16 bytes of `cuDeviceGetUuid_v2`.
    fn uuid(&self, device: i32) -> Option<[u8; 16]>;
    fn current_context(&self) -> usize;
    fn event_create(&self) -> Option<usize>;
    /// Records `event` on the stream handle `stream`.
    fn event_record(&self, event: usize, stream: usize) -> bool;
    fn event_query(&self, event: usize) -> EventState;
    fn event_destroy(&self, event: usize);
    /// Whether the stream handle `stream` is capturing a graph; a failed query counts as
    /// capturing (the safe answer: nothing is recorded on it).
    fn stream_capturing(&self, stream: usize) -> bool;
}

/// Stream captures begun and not yet ended, in this process (all devices).
static CAPTURES_IN_PROGRESS: AtomicU32 = AtomicU32::new(0);

/// A `cuStreamBeginCapture*` call succeeded.
pub fn capture_began() {
    CAPTURES_IN_PROGRESS.fetch_add(1, Relaxed);
}

/// A `cuStreamEndCapture*` call returned, whatever its result (a failed end still ends the
/// capture). Never goes below zero: an end without a begin we saw (one begun through an entry
/// point we do not hook) is ignored.
pub fn capture_ended() {
    decrement_to_zero(&CAPTURES_IN_PROGRESS);
}

fn decrement_to_zero(count: &AtomicU32) {
    let _ = count.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
}

/// Whether some stream of this process may be capturing: one relaxed load.
#[inline]
pub fn captures_in_progress() -> bool {
    CAPTURES_IN_PROGRESS.load(Relaxed) != 0
}

/// Whether a launch into `stream` is being captured into a graph (then it must bypass the gate,
/// the queue bound and spatial redirection). Asks the driver only while a capture is in progress.
pub fn is_captured(gpu: &dyn Gpu, stream: StreamRef) -> bool {
    captures_in_progress() && gpu.stream_capturing(stream.resolve().0)
}

/// What `cuEventQuery` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventState {
    Done,
    Pending,
    /// An error (a destroyed context, a sticky error): the event is dropped from tracking.
    Failed,
}

/// The stream a launch went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRef {
    pub handle: usize,
    /// Launched through a `_ptsz` entry point: the null stream is the per-thread default stream.
    pub per_thread: bool,
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
const STREAM_LEGACY: usize = 1;
const STREAM_PER_THREAD: usize = 2;

impl StreamRef {
    /// The handle to record an event on and the key of the stream in the tracker (the
    /// per-thread default stream is a different stream in every thread).
    pub(crate) fn resolve(self) -> (usize, (usize, u64)) {
        let handle = match self.handle {
            0 if self.per_thread => STREAM_PER_THREAD,
            STREAM_LEGACY => 0,
            other => other,
        };
        let thread = if handle == STREAM_PER_THREAD {
            thread_id()
        } else {
            0
        };
        (handle, (handle, thread))
    }
}

/// A launch to track once the driver accepted it.
pub struct Pending {
    gate: &'static Gate,
    stream: StreamRef,
}

thread_local! {
    static LAUNCHES: Cell<u32> = const { Cell::new(0) };
}

fn thread_id() -> u64 {
    thread_local! {
        static ID: u64 = {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            NEXT.fetch_add(1, Relaxed)
        };
    }
    ID.with(|id| *id)
}

/// Gates a launch on the current device: returns once the launch may go to the driver, and
/// whether it must be tracked (`after`) when the driver accepts it.
pub fn before(gpu: &dyn Gpu, stream: StreamRef) -> Option<Pending> {
    let gates = gates()?;
    let device = gates.device(gpu)?;
    let gate = gates.gate(device, gpu)?;
    let now = monotonic_ns();
    let contended = if !gates.config.turns
        || gate.schedule.fast_ok(&gate.member, now)
        || gate.schedule.side_by_side(&gate.member, now)
    {
        // Side by side (the agent's redistribution, or `VGPU_COMPUTE_TURNS=0`): the demand
        // shows, the turns are not waited for, and the queue is bounded as alone's (no turn
        // to hand over).
        gate.demand(now);
        false
    } else {
        gate.wait_for_turn(gpu, now)
    };
    if captures_in_progress() {
        // No event record or query anywhere while a capture is in progress (see the module doc).
        return None;
    }
    let every = if contended {
        SAMPLE_CONTENDED
    } else {
        SAMPLE_ALONE
    };
    let n = LAUNCHES.with(|count| {
        let n = count.get().wrapping_add(1);
        count.set(n);
        n
    });
    n.is_multiple_of(every).then_some(Pending { gate, stream })
}

/// Stamps the tenant's demand on the current device (throttled to `DEMAND_EVERY_NS`) without
/// gating anything: for an asynchronous copy to or from host memory in an explicit direction
/// (not gated by turns: the copy engines are not what the turns share, but a tenant whose work
/// is copies must show as active to the schedule and to the closed loop), and for a launch the
/// closed loop holds back. A copy within the GPU's memory runs on its SMs and passes the turns
/// like a kernel (`exports`, `Placement::SmCopy`).
pub fn stamp_demand(gpu: &dyn Gpu) {
    let Some(gates) = gates() else {
        return;
    };
    let Some(device) = gates.device(gpu) else {
        return;
    };
    if let Some(gate) = gates.gate(device, gpu) {
        gate.demand(monotonic_ns());
    }
}

/// A synchronisation or completion query returned `CUDA_SUCCESS` in a process that is not a
/// latency tenant (`closed_loop::synchronised` calls this): when the process launched work on the
/// current device since its last counted step (a kernel, a graph or a copy stamped its demand),
/// the sync is a *step* of its tenant there (`Region::count_steps`). The same definition as a
/// latency tenant's steps: opened by a launch, closed by the synchronisation that sees it done.
///
/// "Launched since" is the gate's process-local demand stamp, which every launch and copy already
/// refreshes: a counted step sets it to 0, so the next launch refreshes it (and the shared demand
/// stamp) at once instead of after `DEMAND_EVERY_NS`. Nothing is added to the launch path; a
/// counted step costs a swap of the local word and a relaxed load and add in the schedule.
pub fn synchronised(gpu: &dyn Gpu) {
    let Some(gates) = gates() else {
        return;
    };
    let Some(device) = gates.device(gpu) else {
        return;
    };
    // Not opened: this process never launched on the device (a sync never joins the schedule).
    let Some(Some(gate)) = gates.devices[device].get() else {
        return;
    };
    if gate.demand_stamp_ns.load(Relaxed) == 0 {
        return;
    }
    if gate.demand_stamp_ns.swap(0, Relaxed) != 0 {
        gate.schedule.region.count_steps(gate.member.tenant, 1);
    }
}

/// Adds `n` of the application's own units of progress (`vgpu_progress`) to its tenant's slot
/// on every GPU whose schedule this process joined through the gate; returns on how many.
pub fn count_progress(n: u64) -> usize {
    let Some(gates) = gates() else {
        return 0;
    };
    let mut counted = 0;
    for gate in gates.devices.iter().filter_map(|d| d.get()?.as_ref()) {
        gate.schedule.region.count_progress(gate.member.tenant, n);
        counted += 1;
    }
    assert!(counted <= DEVICES_MAX);
    counted
}

/// This process's tenant slot in the schedule of device `index` (the index `spatial` and the gate
/// both use), if the gate joined it; never joins. Two `OnceLock` loads.
pub fn member_slot(index: usize) -> Option<usize> {
    let gate = gates()?.devices.get(index)?.get()?.as_ref()?;
    Some(gate.member.tenant)
}

/// The driver accepted (`launched`) or refused a sampled launch.
pub fn after(gpu: &dyn Gpu, pending: Pending, launched: bool) {
    // A capture that began since `before` (on another thread) forbids the record too.
    if launched && !captures_in_progress() {
        pending.gate.track(gpu, pending.stream);
    }
}

struct Gates {
    config: ComputeEnv,
    single_device: OnceLock<bool>,
    devices: [OnceLock<Option<Gate>>; DEVICES_MAX],
}

/// Whether this process's launches are gated at all (it has compute shares).
pub fn is_gated() -> bool {
    gates().is_some()
}

fn gates() -> Option<&'static Gates> {
    static GATES: OnceLock<Option<Gates>> = OnceLock::new();
    GATES
        .get_or_init(
            || match ComputeEnv::from_lookup(|name| std::env::var(name).ok()) {
                Ok(Some(config)) => {
                    crate::log::debug(format_args!(
                        "tenant {} compute shares {:?}, burst {}, guaranteed {}, priority {}",
                        config.tenant,
                        config.percent,
                        config.burst,
                        config.guaranteed,
                        config.priority
                    ));
                    Some(Gates {
                        config,
                        single_device: OnceLock::new(),
                        devices: std::array::from_fn(|_| OnceLock::new()),
                    })
                }
                Ok(None) => None,
                Err(e) => {
                    crate::log::error(format_args!(
                        "{e}; kernel launches of this process are not gated"
                    ));
                    None
                }
            },
        )
        .as_ref()
}

impl Gates {
    /// The device of the launch: the current context's, skipped when the process sees one GPU.
    fn device(&self, gpu: &dyn Gpu) -> Option<usize> {
        let single = *self
            .single_device
            .get_or_init(|| gpu.device_count() == Some(1));
        if single {
            return Some(0);
        }
        gpu.current_device()
            .and_then(|d| usize::try_from(d).ok())
            .filter(|&d| d < DEVICES_MAX)
    }

    fn gate(&self, device: usize, gpu: &dyn Gpu) -> Option<&Gate> {
        self.devices[device]
            .get_or_init(|| {
                let share_pct = self.config.percent[device]?;
                match Gate::open(&self.config, device, share_pct, gpu) {
                    Ok(gate) => Some(gate),
                    Err(e) => {
                        crate::log::error(format_args!(
                            "compute sharing on device {device} is off: {e}; its kernel launches \
                             are not gated"
                        ));
                        None
                    }
                }
            })
            .as_ref()
    }
}

/// This process's membership of one GPU's schedule.
struct Gate {
    schedule: Schedule<'static, ProcLiveness>,
    member: Member,
    /// When the demand stamp was last refreshed (process-local, to keep shared stores rare); 0
    /// once a synchronisation counted a step and nothing was launched since (`synchronised`).
    demand_stamp_ns: AtomicU64,
    tracker: Mutex<Tracker>,
    /// Launches that waited `WAIT_MAX` for their turn since the last line about it, and when
    /// that line was written (at most one every `WAIT_MAX_SAID_EVERY_NS`).
    waited_too_long: AtomicU32,
    waited_too_long_said_ns: AtomicU64,
    /// Unfinished sampled launches per stream before a launch waits (`EVENTS_PER_STREAM_MAX`,
    /// or `VGPU_COMPUTE_QUEUE_EVENTS`).
    queue_most: usize,
}

/// The events this process recorded on this GPU, per stream, oldest first; and a pool.
#[derive(Default)]
struct Tracker {
    streams: HashMap<(usize, u64), VecDeque<Event>>,
    pool: Vec<Event>,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    handle: usize,
    context: usize,
}

impl Gate {
    fn open(
        config: &ComputeEnv,
        device: usize,
        share_pct: u32,
        gpu: &dyn Gpu,
    ) -> Result<Gate, String> {
        let uuid = gpu
            .uuid(device as i32)
            .ok_or("cuDeviceGetUuid failed".to_owned())?;
        let quantum_ns = config
            .quantum_ms
            .saturating_mul(1_000_000)
            .max(QUANTUM_NS_DEFAULT / 20);
        let region = crate::shm::open_schedule(&config.shm_dir, &uuid_text(&uuid), quantum_ns)?;
        let schedule = Schedule::new(region, ProcLiveness);
        let tenant_config = TenantConfig {
            share_pct,
            burst: config.burst,
            guaranteed: config.guaranteed,
            priority: config.priority,
        };
        let now = monotonic_ns();
        let member = schedule.join(
            &config.tenant,
            tenant_config,
            std::process::id(),
            own_start_time(),
            now,
        )?;
        crate::log::debug(format_args!(
            "device {device} ({}): tenant slot {}, process slot {}, quantum {} ms",
            uuid_text(&uuid),
            member.tenant,
            member.proc,
            schedule.quantum_ns() / 1_000_000
        ));
        Ok(Gate {
            schedule,
            member,
            demand_stamp_ns: AtomicU64::new(now),
            tracker: Mutex::new(Tracker::default()),
            waited_too_long: AtomicU32::new(0),
            waited_too_long_said_ns: AtomicU64::new(0),
            queue_most: config.queue_events.unwrap_or(EVENTS_PER_STREAM_MAX),
        })
    }

    #[inline]
    fn demand(&self, now: u64) {
        if now.saturating_sub(self.demand_stamp_ns.load(Relaxed)) >= DEMAND_EVERY_NS {
            self.demand_stamp_ns.store(now, Relaxed);
            self.schedule.demand(&self.member, now);
        }
    }

    /// The slow path: waits for the tenant's turn; returns whether other tenants are active.
    fn wait_for_turn(&self, gpu: &dyn Gpu, start: u64) -> bool {
        let mut now = start;
        let mut waited = false;
        loop {
            match self.schedule.step(&self.member, now) {
                Step::Go { contended } => {
                    if contended {
                        self.schedule.mark_busy(&self.member, now);
                    }
                    self.demand_stamp_ns.store(now, Relaxed);
                    if waited {
                        STATS.turn_wait(now.saturating_sub(start));
                    }
                    return contended;
                }
                Step::Drain => {
                    // While a capture is in progress, querying our events could invalidate it:
                    // report the drain unobserved (the next tenant's kernels may then overlap
                    // ours for up to the queue we had).
                    if !captures_in_progress() {
                        let deadline = now.saturating_add(self.schedule.grace_ns());
                        let drained = self.drain(gpu, deadline);
                        STATS.drain(monotonic_ns().saturating_sub(now), !drained);
                    }
                    self.schedule.drained(&self.member);
                }
                Step::Wait => {
                    if !waited && self.schedule.turn().owner == crate::compute::OWNER_IDLE {
                        STATS.idle_turn_waits.fetch_add(1, Relaxed);
                    }
                    waited = true;
                    if now.saturating_sub(start) >= WAIT_MAX_NS {
                        STATS.turn_wait(now.saturating_sub(start));
                        let hits = self.waited_too_long.fetch_add(1, Relaxed) + 1;
                        let said = self.waited_too_long_said_ns.load(Relaxed);
                        if (said == 0 || now.saturating_sub(said) >= WAIT_MAX_SAID_EVERY_NS)
                            && self
                                .waited_too_long_said_ns
                                .compare_exchange(said, now, Relaxed, Relaxed)
                                .is_ok()
                        {
                            self.waited_too_long.fetch_sub(hits, Relaxed);
                            crate::log::error(format_args!(
                                "{hits} kernel launch(es) waited {} s for their turn on the GPU \
                                 and went ahead anyway (said at most every {} s); the \
                                 schedule: {}",
                                WAIT_MAX_NS / 1_000_000_000,
                                WAIT_MAX_SAID_EVERY_NS / 1_000_000_000,
                                self.schedule.explain_wait(&self.member, now)
                            ));
                        }
                        return true;
                    }
                    std::thread::sleep(POLL_SLEEP);
                }
            }
            now = monotonic_ns();
        }
    }

    fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records an event after a sampled launch and bounds the stream's unfinished events.
    fn track(&self, gpu: &dyn Gpu, stream: StreamRef) {
        let (handle, key) = stream.resolve();
        let context = gpu.current_context();
        let oldest = {
            let mut tracker = self.tracker();
            let pooled = tracker.pool.iter().rposition(|e| e.context == context);
            let event = match pooled {
                Some(index) => tracker.pool.swap_remove(index),
                None => match gpu.event_create() {
                    Some(handle) => Event { handle, context },
                    None => return,
                },
            };
            if !gpu.event_record(event.handle, handle) {
                gpu.event_destroy(event.handle);
                return;
            }
            let Tracker { streams, pool } = &mut *tracker;
            let ring = streams.entry(key).or_default();
            ring.push_back(event);
            retire_finished(gpu, ring, pool);
            if ring.len() <= self.queue_most {
                return;
            }
            ring.pop_front()
        };
        let Some(oldest) = oldest else { return };
        // Wait without holding the tracker: other threads keep launching on other streams.
        let began = monotonic_ns();
        let bound = EVENT_WAIT_MAX_NS.min(self.schedule.quantum_ns());
        let state = wait_event(gpu, oldest, began.saturating_add(bound));
        STATS.queue_wait(
            monotonic_ns().saturating_sub(began),
            state == EventState::Pending,
        );
        self.give_back(gpu, oldest, state);
    }

    /// Waits (until `deadline`) for every recorded event of this process on this GPU; whether
    /// they all finished.
    fn drain(&self, gpu: &dyn Gpu, deadline: u64) -> bool {
        loop {
            let unfinished = {
                let mut tracker = self.tracker();
                let Tracker { streams, pool } = &mut *tracker;
                for ring in streams.values_mut() {
                    retire_finished(gpu, ring, pool);
                }
                streams.retain(|_, ring| !ring.is_empty());
                !streams.is_empty()
            };
            if !unfinished {
                return true;
            }
            if monotonic_ns() >= deadline {
                return false;
            }
            std::thread::sleep(EVENT_POLL_SLEEP);
        }
    }

    fn give_back(&self, gpu: &dyn Gpu, event: Event, state: EventState) {
        let mut tracker = self.tracker();
        if state == EventState::Failed || tracker.pool.len() >= EVENT_POOL_MAX {
            drop(tracker);
            gpu.event_destroy(event.handle);
        } else {
            tracker.pool.push(event);
        }
    }
}

/// Moves the finished events at the front of `ring` to `pool` (failed ones are destroyed).
fn retire_finished(gpu: &dyn Gpu, ring: &mut VecDeque<Event>, pool: &mut Vec<Event>) {
    while let Some(&front) = ring.front() {
        match gpu.event_query(front.handle) {
            EventState::Pending => break,
            EventState::Done if pool.len() < EVENT_POOL_MAX => pool.push(front),
            EventState::Done | EventState::Failed => gpu.event_destroy(front.handle),
        }
        ring.pop_front();
    }
}

/// Polls `event` until it completes, fails, or `deadline` passes (then `Pending`).
fn wait_event(gpu: &dyn Gpu, event: Event, deadline: u64) -> EventState {
    let began = monotonic_ns();
    loop {
        let state = gpu.event_query(event.handle);
        let now = monotonic_ns();
        if state != EventState::Pending || now >= deadline {
            return state;
        }
        between_looks(began, now, EVENT_POLL_SLEEP);
    }
}

/// Between two looks of a wait for the GPU that began at `began` (monotonic ns, `now` the
/// latest look): yields while the wait is younger than `EVENT_SPIN_NS`, then sleeps `sleep`. A
/// sleep wakes 50 us or more late, and the work left queued behind what is awaited (a queue
/// bound's other samples, a closed-loop cap's other launches) may run dry in that time, idling
/// the GPU between small kernels: 2.1x the kernels' time at 1 us kernels on the fake driver.
pub fn between_looks(began: u64, now: u64, sleep: Duration) {
    if now.saturating_sub(began) < EVENT_SPIN_NS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(sleep);
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` and NVML print it.
pub fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capture_count_never_goes_below_zero() {
        let count = AtomicU32::new(0);
        decrement_to_zero(&count);
        assert_eq!(count.load(Relaxed), 0);
        count.store(2, Relaxed);
        decrement_to_zero(&count);
        decrement_to_zero(&count);
        decrement_to_zero(&count);
        assert_eq!(count.load(Relaxed), 0);
    }

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let bytes: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(
            uuid_text(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn default_streams_resolve_per_thread_and_legacy() {
        let legacy = StreamRef {
            handle: 0,
            per_thread: false,
        };
        assert_eq!(legacy.resolve(), (0, (0, 0)));
        let explicit_legacy = StreamRef {
            handle: STREAM_LEGACY,
            per_thread: true,
        };
        assert_eq!(explicit_legacy.resolve(), (0, (0, 0)));
        let ptsz = StreamRef {
            handle: 0,
            per_thread: true,
        };
        let (handle, key) = ptsz.resolve();
        assert_eq!(handle, STREAM_PER_THREAD);
        let other_thread = std::thread::spawn(move || ptsz.resolve().1).join().unwrap();
        assert_ne!(key, other_thread);
        let user = StreamRef {
            handle: 0x5000,
            per_thread: true,
        };
        assert_eq!(user.resolve(), (0x5000, (0x5000, 0)));
    }
}
