//! Closed-loop sharing inside tenant processes, in safe code (spatial mode, `VGPU_SPATIAL=1`;
//! the words are `tenant_abi::control`, the controller is the agent's).
//!
//! - **A latency tenant measures its steps.** A step opens at a launch (kernel or graph) when the
//!   process has none open, and closes when a synchronisation or completion query of the process
//!   returns `CUDA_SUCCESS` (`cuStreamSynchronize`, `cuEventSynchronize`, `cuCtxSynchronize`,
//!   `cuStreamQuery`, `cuEventQuery`, `_ptsz` included): what the application waited for, from
//!   launch to the moment it saw the result. That covers eager frameworks (`.item()`, `.cpu()` end
//!   in a stream synchronisation), CUDA graph replays, and engines that never synchronise the
//!   device but poll events. Each step's latency goes into the tenant's histogram in the GPU's
//!   schedule file (the tenant joins the schedule for a slot, never for turns), and the open and
//!   close stamps tell the GPU's other tenants that a latency step is in flight.
//! - **The others obey the agent's decision** while it is in force (`Control::decision`; none in
//!   force: nothing is restricted, fail open): with `pause`, a launch waits while a latency step
//!   is in flight (at most `PAUSE_WAIT_MAX_NS` per launch, then it goes), and with a guard also
//!   while the latency tenant's next step is due within the guard (its process predicts it from
//!   the smoothed time between its step starts); with `exclusive`, while a latency tenant is
//!   active at all. A guard's or Exclusive's hold lasts while the agent keeps it in force (the
//!   decision is read again while waiting), at most `HOLD_WAIT_MAX_NS` per launch. With
//!   `inflight = N` and a latency tenant active on the GPU, a launch waits until its stream has
//!   fewer than N launches queued (an event recorded after each launch, at most
//!   `EVENT_WAIT_MAX_NS` per wait); `sms` is applied by `spatial::redirect`.
//!
//! - **Every gated tenant's progress** (`docs/design/utility-redistribution.md`): a closed
//!   latency step also counts as a step of the tenant's progress (`Region::count_steps`), and in
//!   any other process `synchronised` hands the same event to the launch gate, which counts a
//!   step when the process launched a kernel, graph or copy on the device since its last counted
//!   step (`launch::synchronised`): one definition of a step for every tenant, launch to the
//!   synchronisation or completion query that sees it done. An application that counts its own
//!   units (`vgpu_progress`, `count_progress` here for a latency tenant and in `launch` for the
//!   others) replaces the steps for its whole tenant. Steps are a proxy: a query that some
//!   other thread polls (NCCL's watchdog in PyTorch polls its collectives' events) counts as a
//!   step when it finds work done, so steps compare a tenant with itself over time, never two
//!   tenants, and the application's own units are the better measure.
//!
//! Costs: a process that is neither pays one `OnceLock` load per launch and per synchronisation;
//! a squeezable process pays two relaxed loads per launch while no decision is in force. A gated
//! process pays nothing more per launch for its steps, and a swap and a relaxed load and add per
//! synchronisation that counts one (plus `cuCtxGetDevice` where it sees several GPUs).

use crate::launch::{EventState, Gpu, StreamRef};
use crate::shm::monotonic_ns;
use crate::spatial::{Device, spatial};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tenant_abi::compute::{Schedule, TenantConfig};
use tenant_abi::{ComputeEnv, ProcLiveness};

/// The longest one launch waits for latency steps to end before it goes anyway.
pub const PAUSE_WAIT_MAX_NS: u64 = 50_000_000;
/// A latency tenant's steps further apart than this have no rhythm to predict.
const PERIOD_MAX_NS: u64 = 1_000_000_000;
/// The longest one launch waits for its stream's oldest queued launch: as long as it would wait
/// for latency steps. A kernel that takes longer holds the GPU anyway, and is often one that
/// waits for another process (a collective waiting for a peer that may be waiting for us) or for
/// a later launch of this one: waiting longer only stalls the neighbour (1 s, before: issue 16).
pub const EVENT_WAIT_MAX_NS: u64 = PAUSE_WAIT_MAX_NS;
/// Streams per device whose queued launches are counted; launches on further streams are not
/// bounded (logged once).
const STREAMS_MAX: usize = 256;
/// Events kept for reuse per device.
const EVENT_POOL_MAX: usize = 64;
/// Sleep between two looks while pausing or waiting for an event.
const POLL_SLEEP: Duration = Duration::from_micros(10);
/// A launch held at Exclusive for longer than this looks again only every [`HOLD_POLL_SLEEP`]:
/// Exclusive lasts while a latency tenant is active at all (tens of ms at least), so a release
/// a fraction of a millisecond late costs nothing, while a look every 10-60 us woke the held
/// thread some 20,000 times a second for the whole hold (on an H200, seconds at a time, on
/// CPUs beside the latency tenant's; whether that is what slowed an eager tenant at Exclusive
/// there is not known yet).
const HOLD_PATIENT_AFTER_NS: u64 = 1_000_000;
const HOLD_POLL_SLEEP: Duration = Duration::from_micros(500);

/// This process's closed-loop state on one device.
#[derive(Default)]
pub struct DeviceLoop {
    /// When this process's open latency step began (0: none open).
    step_open_ns: AtomicU64,
    /// When this process's last latency step began, and the smoothed time between two step
    /// starts (0: not known yet), for the prediction of the next step (`Control::predict_step`).
    last_start_ns: AtomicU64,
    period_ns: AtomicU64,
    /// The tenant's slot in the GPU's schedule (a latency tenant's histogram); `None`: none
    /// could be had (logged once).
    slot: OnceLock<Option<usize>>,
    queued: Mutex<Queued>,
    streams_full_logged: AtomicBool,
    pause_logged: AtomicBool,
}

/// A squeezed process's launches still queued, per (context, stream), oldest first.
#[derive(Default)]
struct Queued {
    streams: HashMap<(usize, (usize, u64)), VecDeque<usize>>,
    pool: Vec<usize>,
}

/// A latency tenant launched on `device` at `now_ns`: opens a step unless one is open.
pub(crate) fn latency_launched(device: &Device, now_ns: u64) {
    let opened = device
        .closed_loop
        .step_open_ns
        .compare_exchange(0, now_ns, Relaxed, Relaxed)
        .is_ok();
    if opened {
        let control = &device.region.control;
        control.open_step(now_ns);
        let state = &device.closed_loop;
        let last = state.last_start_ns.swap(now_ns, Relaxed);
        let gap = now_ns.saturating_sub(last);
        if last != 0 && gap <= PERIOD_MAX_NS {
            // An exponential average over about eight steps: a rhythm that changes is followed
            // within a few steps, one late step moves it by an eighth.
            let old = state.period_ns.load(Relaxed);
            let period = if old == 0 {
                gap
            } else {
                old - old / 8 + gap / 8
            };
            state.period_ns.store(period, Relaxed);
            control.predict_step(now_ns + period);
        }
    }
}

/// A synchronisation or completion query returned `CUDA_SUCCESS` (every sync hook calls this):
/// a latency tenant's open step on the current device closes, its latency is recorded and it
/// counts as a step of the tenant's progress; in any other process the gate counts a step when
/// the sync waited for work launched since the last one (`launch::synchronised`).
pub fn synchronised(gpu: &dyn Gpu) {
    let Some(spatial) = spatial().filter(|spatial| spatial.config.latency) else {
        crate::launch::synchronised(gpu);
        return;
    };
    let Some(device) = spatial.device(gpu) else {
        return;
    };
    let opened = device.closed_loop.step_open_ns.swap(0, Relaxed);
    if opened == 0 {
        return;
    }
    let now = monotonic_ns().max(opened);
    device.region.control.close_step(now);
    if let Some(slot) = latency_slot(device, &spatial.config.tenant) {
        device.region.control.record_step(slot, now - opened);
        device.region.count_steps(slot, 1);
    }
}

/// Adds `n` of the application's own units of progress (`vgpu_progress`) to a latency tenant's
/// slot on every device this process launched on (joining the schedule there if no step did
/// yet); returns on how many. 0 in any other process (its slots are the gate's: `launch::count_progress`).
pub fn count_progress(n: u64) -> usize {
    let Some(spatial) = spatial().filter(|spatial| spatial.config.latency) else {
        return 0;
    };
    let mut counted = 0;
    for device in spatial.devices() {
        if let Some(slot) = latency_slot(device, &spatial.config.tenant) {
            device.region.count_progress(slot, n);
            counted += 1;
        }
    }
    counted
}

/// The tenant's slot in the device's schedule, joined on first use (for its histogram only: a
/// latency tenant never waits for turns).
fn latency_slot(device: &Device, tenant: &str) -> Option<usize> {
    *device.closed_loop.slot.get_or_init(|| {
        let compute = ComputeEnv::from_lookup(|name| std::env::var(name).ok())
            .ok()
            .flatten();
        let config = TenantConfig {
            share_pct: compute
                .as_ref()
                .and_then(|c| c.percent[device.index])
                .unwrap_or(1),
            burst: compute.as_ref().is_some_and(|c| c.burst),
            guaranteed: compute.as_ref().is_none_or(|c| c.guaranteed),
            priority: compute.as_ref().map_or(0, |c| c.priority),
        };
        let schedule = Schedule::new(device.region, ProcLiveness);
        match schedule.join(
            tenant,
            config,
            std::process::id(),
            tenant_abi::ledger::own_start_time(),
            monotonic_ns(),
        ) {
            Ok(member) => Some(member.tenant),
            Err(e) => {
                crate::log::error(format_args!(
                    "closed loop on device {}: {e}; this latency tenant's steps are not reported",
                    device.index
                ));
                None
            }
        }
    })
}

/// A squeezed launch that must be counted once the driver accepted it.
#[must_use]
pub struct Bounded {
    device: &'static Device,
    context: usize,
    key: (usize, u64),
    app_handle: usize,
}

/// Before a launch of a tenant that is not a latency tenant: obeys the decision in force (may
/// wait). Returns what to count after the launch when its stream's queue is bounded.
pub fn before_launch(gpu: &dyn Gpu, stream: StreamRef) -> Option<Bounded> {
    let spatial = spatial()?;
    if spatial.config.latency {
        return None;
    }
    let device = spatial.device(gpu)?;
    let control = &device.region.control;
    let now = monotonic_ns();
    let decision = control.decision(now);
    if !decision.restricts() {
        return None;
    }
    // Held by a step in flight: at most `PAUSE_WAIT_MAX_NS` (steps back to back leave no gap
    // to launch in; the bound lets one launch through per period of it). Held by a guard (a
    // step predicted within it): as long as the agent keeps the guard in force, like
    // Exclusive. A guard at least as long as the gap between two steps leaves no gap either,
    // and a launch let through every 50 ms there put one neighbour kernel into every 16th step
    // of a decoder (an H200 beside bf16 GEMMs: the guard levels failed, and the controller
    // ended at Exclusive).
    let step_held = |decision: tenant_abi::control::Decision, now: u64| {
        decision.pause && control.step_in_flight(now)
    };
    let guard_held = |decision: tenant_abi::control::Decision, now: u64| {
        decision.pause
            && decision.guard_us > 0
            && control.step_due(now, u64::from(decision.guard_us) * 1_000)
    };
    // A held launch still wants the GPU: its tenant's demand stays fresh while it waits (the
    // gate stamps it only once the launch goes). Silent for longer than the agent's neighbour
    // window (250 ms), a neighbour held at Exclusive read as gone: the latency tenant's windows
    // then counted as alone (its baseline learnt the held launch's interference), and nothing
    // was relaxed until the neighbour's next launch, up to `HOLD_WAIT_MAX_NS` later.
    let wanting = |done: bool| {
        if !done {
            crate::launch::stamp_demand(gpu);
        }
        done
    };
    // Exclusive holds while a latency tenant is active at all. One wait for every hold, the
    // decision read again at each look: a launch held at Exclusive that the agent relaxes to a
    // guard is held by the guard next, not let go (it was: each relaxation from Exclusive let
    // the held launches through at once, a 12 ms kernel into four decoder steps, and the level
    // below failed at its first window, every time, in every H100 and H200 run).
    let exclusive_held = |decision: tenant_abi::control::Decision, now: u64| {
        decision.exclusive && device.region.latency_active(now, spatial.hold_ns)
    };
    if exclusive_held(decision, now) || step_held(decision, now) || guard_held(decision, now) {
        let pause_over = std::cell::Cell::new(false);
        let patient_after = if decision.exclusive {
            HOLD_PATIENT_AFTER_NS
        } else {
            u64::MAX
        };
        let waited = wait_until(
            now,
            tenant_abi::control::HOLD_WAIT_MAX_NS,
            patient_after,
            || {
                let at = monotonic_ns();
                let decision = control.decision(at);
                if exclusive_held(decision, at) || guard_held(decision, at) {
                    return wanting(false);
                }
                let stepping = step_held(decision, at);
                pause_over.set(stepping && at.saturating_sub(now) >= PAUSE_WAIT_MAX_NS);
                wanting(!stepping || pause_over.get())
            },
        );
        control.count_pause(waited.0);
        if (pause_over.get() || !waited.1) && !device.closed_loop.pause_logged.swap(true, Relaxed) {
            crate::log::error(format_args!(
                "closed loop on device {}: a launch waited {} ms for latency steps and went \
                 ahead (logged once)",
                device.index,
                waited.0 / 1_000_000
            ));
        }
    }
    if decision.inflight == 0
        || crate::launch::captures_in_progress()
        || !device.region.latency_active(now, spatial.hold_ns)
    {
        return None;
    }
    let context = gpu.current_context();
    let (app_handle, key) = stream.resolve();
    let mut queued = device
        .closed_loop
        .queued
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Queued { streams, pool } = &mut *queued;
    if !streams.contains_key(&(context, key)) && streams.len() >= STREAMS_MAX {
        if !device.closed_loop.streams_full_logged.swap(true, Relaxed) {
            crate::log::error(format_args!(
                "closed loop on device {}: {STREAMS_MAX} streams are bounded already; launches on \
                 further streams are not",
                device.index
            ));
        }
        return None;
    }
    let ring = streams.entry((context, key)).or_default();
    retire_finished(gpu, ring, pool);
    let mut waited = false;
    while ring.len() >= usize::from(decision.inflight) {
        let Some(&oldest) = ring.front() else {
            break;
        };
        waited = true;
        let start = monotonic_ns();
        let (_, done) = wait_until(start, EVENT_WAIT_MAX_NS, u64::MAX, || {
            gpu.event_query(oldest) != EventState::Pending
        });
        if !done {
            // A kernel that waits for another process or a later launch of this one may not
            // finish without it: stop bounding this launch rather than stall.
            break;
        }
        retire_finished(gpu, ring, pool);
    }
    if waited {
        control.count_bounded();
    }
    Some(Bounded {
        device,
        context,
        key,
        app_handle,
    })
}

/// After a bounded launch: counts it, by an event recorded behind it on the application's stream
/// (which also orders behind a launch moved to a green stream).
pub fn after_launch(gpu: &dyn Gpu, bounded: Bounded, launched: bool) {
    if !launched || crate::launch::captures_in_progress() {
        return;
    }
    let mut queued = bounded
        .device
        .closed_loop
        .queued
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Queued { streams, pool } = &mut *queued;
    let Some(event) = pool.pop().or_else(|| gpu.event_create()) else {
        return;
    };
    if !gpu.event_record(event, bounded.app_handle) {
        gpu.event_destroy(event);
        return;
    }
    let ring = streams.entry((bounded.context, bounded.key)).or_default();
    ring.push_back(event);
    assert!(
        ring.len() <= usize::from(u8::MAX) + 1,
        "a ring holds at most the cap"
    );
}

fn retire_finished(gpu: &dyn Gpu, ring: &mut VecDeque<usize>, pool: &mut Vec<usize>) {
    while let Some(&front) = ring.front() {
        match gpu.event_query(front) {
            EventState::Pending => break,
            EventState::Done if pool.len() < EVENT_POOL_MAX => pool.push(front),
            EventState::Done | EventState::Failed => gpu.event_destroy(front),
        }
        ring.pop_front();
    }
}

/// Polls `done` until it holds or `limit_ns` passed since `start`; returns the time waited and
/// whether it held. Past `patient_after_ns` of waiting it looks every [`HOLD_POLL_SLEEP`].
fn wait_until(
    start: u64,
    limit_ns: u64,
    patient_after_ns: u64,
    done: impl Fn() -> bool,
) -> (u64, bool) {
    loop {
        if done() {
            return (monotonic_ns().saturating_sub(start), true);
        }
        let now = monotonic_ns();
        if now.saturating_sub(start) >= limit_ns {
            return (now - start, false);
        }
        if now.saturating_sub(start) >= patient_after_ns {
            std::thread::sleep(HOLD_POLL_SLEEP);
            continue;
        }
        // Yields first: a cap of N launches in flight leaves N - 1 queued behind the awaited one,
        // which a late wake-up would let run dry.
        crate::launch::between_looks(start, now, POLL_SLEEP);
    }
}
