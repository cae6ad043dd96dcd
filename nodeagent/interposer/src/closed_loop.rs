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
//!   the smoothed time between its step starts) or within the launch's own expected duration,
//!   whichever is longer (*fit*: a launch goes only if it should end before the next step
//!   starts); with `exclusive`, while a latency tenant is
//!   active at all. A guard's or Exclusive's hold lasts while the agent keeps it in force (the
//!   decision is read again while waiting), at most `HOLD_WAIT_MAX_NS` per launch. With
//!   `inflight = N` and a latency tenant active on the GPU, a launch waits until its stream has
//!   fewer than N launches queued (an event recorded after each launch, at most
//!   `EVENT_WAIT_MAX_NS` per wait); `sms` is applied by `spatial::redirect`. A launch held by
//!   a bound is checked against the holds again once it may go: a kernel that passed the guard
//!   while another was still running would otherwise start into the step the guard protects.
//! - **Durations are measured, per kind of launch** (a kernel's function, a graph, a copy of a
//!   size: [`LaunchKey`]), by the bound's own events: a launch that found its stream empty
//!   started at once, and when a later launch of the process waits for it, the wait sees it end
//!   (to within a look, 10-60 us); one found already done bounds its duration from above. The
//!   expected duration is a decaying maximum of those ([`Durations`]): it rises at once with a
//!   slower run and falls by an eighth per faster one. A kind never measured waits for nothing
//!   more than the guard. So the guard stretches to what each neighbour actually launches: on
//!   an H200 a bf16 GEMM of 1.7 ms launched at a guard of half a 3 ms period ran into the
//!   decoder's next step half the time, and the controller held the GEMM at 1% of its speed one
//!   level up (docs/benchmarks.md, thirtieth session).
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
/// Kinds of launch per device whose durations are kept; further kinds are not measured (their
/// launches wait for the guard alone).
const DURATIONS_MAX: usize = 4096;
/// Added to a launch's expected duration when it must end before the latency tenant's next
/// step: the launch's own way to the GPU and a switch between the two contexts (tens of us).
pub const FIT_MARGIN_NS: u64 = 50_000;
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

/// A squeezed process's launches still queued, per (context, stream), oldest first, and what
/// their ends taught of each kind's duration.
#[derive(Default)]
struct Queued {
    streams: HashMap<(usize, (usize, u64)), VecDeque<InFlight>>,
    pool: Vec<usize>,
    durations: Durations,
}

/// One bounded launch on the GPU: the event recorded behind it, and what its end measures.
struct InFlight {
    event: usize,
    key: LaunchKey,
    launched_ns: u64,
    /// Its stream had nothing queued when it went: it started at once, so its end minus
    /// `launched_ns` is its duration (else it also waited for the launches before it).
    started_at_once: bool,
}

/// What kind of launch a duration belongs to: a kernel's function, a graph's executable, or
/// a copy's size (with the top bit set: a size is no handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchKey(pub usize);

impl LaunchKey {
    pub fn copy(bytes: usize) -> LaunchKey {
        LaunchKey(bytes | 1 << (usize::BITS - 1))
    }

    /// A memset of `bytes` (writes only: about half a copy's time, so a key of its own).
    pub fn memset(bytes: usize) -> LaunchKey {
        LaunchKey(bytes | 0b11 << (usize::BITS - 2))
    }
}

/// The expected duration of each kind of launch: a decaying maximum of its measured runs.
#[derive(Debug, Default)]
pub struct Durations {
    by_key: HashMap<LaunchKey, u64>,
}

impl Durations {
    /// A run of `key` took `ns`: the expectation rises to it at once, or falls by an eighth
    /// toward it.
    pub fn measured(&mut self, key: LaunchKey, ns: u64) {
        let full = self.by_key.len() >= DURATIONS_MAX;
        match self.by_key.get_mut(&key) {
            Some(expected) => *expected = ns.max(*expected - *expected / 8),
            None if !full => {
                self.by_key.insert(key, ns);
            }
            None => {}
        }
    }

    /// A run of `key` took at most `ns` (it was found done that long after it went): the
    /// expectation is no longer than that.
    pub fn at_most(&mut self, key: LaunchKey, ns: u64) {
        if let Some(expected) = self.by_key.get_mut(&key) {
            *expected = (*expected).min(ns);
        }
    }

    /// How long a launch of `key` is expected to run (0: never measured).
    pub fn expected(&self, key: LaunchKey) -> u64 {
        self.by_key.get(&key).copied().unwrap_or(0)
    }
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
    launch: LaunchKey,
    started_at_once: bool,
}

/// Before a launch of a tenant that is not a latency tenant: obeys the decision in force (may
/// wait). `launch` is the kind of launch, for its expected duration. Returns what to count
/// after the launch when its stream's queue is bounded.
pub fn before_launch(gpu: &dyn Gpu, stream: StreamRef, launch: LaunchKey) -> Option<Bounded> {
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
    // The launch's expected duration matters only at a guard (the fit); elsewhere the lock is
    // not taken for it.
    let expected = |decision: tenant_abi::control::Decision| {
        if !(decision.pause && decision.guard_us > 0) {
            return 0;
        }
        let queued = device
            .closed_loop
            .queued
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        queued.durations.expected(launch)
    };
    hold(gpu, device, spatial.hold_ns, now, expected(decision));
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
    let Queued {
        streams,
        pool,
        durations,
    } = &mut *queued;
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
    retire_finished(gpu, ring, pool, durations);
    let mut waited = false;
    while ring.len() >= usize::from(decision.inflight) {
        let Some(oldest) = ring.front() else {
            break;
        };
        let (event, key, launched_ns, at_once) = (
            oldest.event,
            oldest.key,
            oldest.launched_ns,
            oldest.started_at_once,
        );
        waited = true;
        let start = monotonic_ns();
        let (_, done) = wait_until(start, EVENT_WAIT_MAX_NS, u64::MAX, || {
            gpu.event_query(event) != EventState::Pending
        });
        if !done {
            // A kernel that waits for another process or a later launch of this one may not
            // finish without it: stop bounding this launch rather than stall.
            break;
        }
        if at_once {
            // Seen ending by this wait: its duration, to within a look.
            durations.measured(key, monotonic_ns().saturating_sub(launched_ns));
        }
        retire_finished(gpu, ring, pool, durations);
    }
    let started_at_once = ring.is_empty();
    drop(queued);
    if waited {
        control.count_bounded();
        // The launch held by the bound may go now; the holds are asked again, with what the
        // wait just measured: a launch that passed the guard while another ran would
        // otherwise start into the step the guard protects.
        let now = monotonic_ns();
        let expected_ns = expected(control.decision(now));
        hold(gpu, device, spatial.hold_ns, now, expected_ns);
    }
    Some(Bounded {
        device,
        context,
        key,
        app_handle,
        launch,
        started_at_once,
    })
}

/// Waits while the decision in force holds a launch expected to run `expected_ns` back: a
/// latency step in flight (pause), a step due within the guard or within the launch's expected
/// duration (fit), or any latency activity (exclusive).
fn hold(gpu: &dyn Gpu, device: &Device, hold_ns: u64, now: u64, expected_ns: u64) {
    let control = &device.region.control;
    let decision = control.decision(now);
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
    // The guard stretches to the launch's own expected duration (fit): it must end before the
    // next step starts.
    let fit_ns = if expected_ns == 0 {
        0
    } else {
        expected_ns.saturating_add(FIT_MARGIN_NS)
    };
    let guard_held = |decision: tenant_abi::control::Decision, now: u64| {
        decision.pause
            && decision.guard_us > 0
            && control.step_due(now, (u64::from(decision.guard_us) * 1_000).max(fit_ns))
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
        decision.exclusive && device.region.latency_active(now, hold_ns)
    };
    if !(exclusive_held(decision, now) || step_held(decision, now) || guard_held(decision, now)) {
        return;
    }
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
    let Queued { streams, pool, .. } = &mut *queued;
    let Some(event) = pool.pop().or_else(|| gpu.event_create()) else {
        return;
    };
    if !gpu.event_record(event, bounded.app_handle) {
        gpu.event_destroy(event);
        return;
    }
    let ring = streams.entry((bounded.context, bounded.key)).or_default();
    ring.push_back(InFlight {
        event,
        key: bounded.launch,
        launched_ns: monotonic_ns(),
        started_at_once: bounded.started_at_once && ring.is_empty(),
    });
    assert!(
        ring.len() <= usize::from(u8::MAX) + 1,
        "a ring holds at most the cap"
    );
}

/// Retires the launches at the front of `ring` that are over; one that started at once and is
/// found done bounds its kind's duration from above.
fn retire_finished(
    gpu: &dyn Gpu,
    ring: &mut VecDeque<InFlight>,
    pool: &mut Vec<usize>,
    durations: &mut Durations,
) {
    while let Some(front) = ring.front() {
        let state = gpu.event_query(front.event);
        match state {
            EventState::Pending => break,
            EventState::Done if pool.len() < EVENT_POOL_MAX => pool.push(front.event),
            EventState::Done | EventState::Failed => gpu.event_destroy(front.event),
        }
        if state == EventState::Done && front.started_at_once {
            durations.at_most(front.key, monotonic_ns().saturating_sub(front.launched_ns));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_durations_expectation_rises_at_once_and_falls_by_eighths() {
        let mut durations = Durations::default();
        let gemm = LaunchKey(0x7f00_1000);
        assert_eq!(durations.expected(gemm), 0, "never measured: no fit");
        durations.measured(gemm, 1_600_000);
        assert_eq!(durations.expected(gemm), 1_600_000);
        // One slow run (it waited behind the other context): the expectation takes it at once.
        durations.measured(gemm, 3_200_000);
        assert_eq!(durations.expected(gemm), 3_200_000);
        // Faster runs bring it back an eighth at a time, never below what they measure.
        durations.measured(gemm, 1_600_000);
        assert_eq!(durations.expected(gemm), 2_800_000);
        for _ in 0..20 {
            durations.measured(gemm, 1_600_000);
        }
        assert_eq!(durations.expected(gemm), 1_600_000);
        // A run found done 1 ms after it went took at most that.
        durations.at_most(gemm, 1_000_000);
        assert_eq!(durations.expected(gemm), 1_000_000);
        // An upper bound says nothing of a kind never measured.
        let copy = LaunchKey::copy(1 << 30);
        durations.at_most(copy, 5_000);
        assert_eq!(durations.expected(copy), 0);
        assert_ne!(copy, LaunchKey(1 << 30), "a size is no handle");
    }

    #[test]
    fn durations_keep_a_bounded_number_of_kinds() {
        let mut durations = Durations::default();
        for key in 0..DURATIONS_MAX + 10 {
            durations.measured(LaunchKey(key), 1_000);
        }
        assert_eq!(durations.by_key.len(), DURATIONS_MAX);
        assert_eq!(durations.expected(LaunchKey(DURATIONS_MAX + 5)), 0);
        // Kinds already kept still learn.
        durations.measured(LaunchKey(3), 9_000);
        assert_eq!(durations.expected(LaunchKey(3)), 9_000);
    }
}
