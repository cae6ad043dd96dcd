//! Spatial partitioning, in safe code (`VGPU_SPATIAL=1`; `docs/design/spatial-partitioning.md`).
//! Off by default: without `VGPU_SPATIAL=1` every function here returns at its first `OnceLock`.
//!
//! Two roles share one word of the per-GPU schedule file, `compute::Header::latency_ns`:
//! - A **latency tenant** (`VGPU_LATENCY=1`) stores "a latency tenant launched at `now`" at every
//!   launch, and its launches skip the turn scheduler (`exports` does not call `launch::before`
//!   for it): its guarantee is what the closed loop holds the others to (`closed_loop`), not a
//!   turn.
//! - Every other tenant with `VGPU_SPATIAL=1` is **squeezable**: while that stamp is fresher than
//!   `VGPU_SPATIAL_HOLD_MS`, its launches go to a stream of a green context with the SMs the
//!   agent's decision leaves it (`squeeze_sms`; without a decision in force only an explicit
//!   `VGPU_SPATIAL_SMS` squeezes), paired with the application's
//!   stream by two events so that the application's stream order holds:
//!   record A on the application's stream → the green stream waits for A → the launch on the
//!   green stream → record B on the green stream → the application's stream waits for B.
//! - **Per-tenant caps** (`docs/design/utility-redistribution.md`: under MPS, idle SMs among
//!   best-effort tenants go to the one that turns them into the most work): the agent publishes
//!   an SM cap per tenant slot (`Control::cap`, in `CAP_UNITS`ths of the GPU, expiring like a
//!   decision). A squeezable tenant's launch keeps `cap_sms`: its share of the device's SMs
//!   (`Green::sm_resource`, read once) rounded down to the partition granularity, at least one
//!   partition; beside an active latency tenant, the smaller of that and the decision's count
//!   (`launch_sms`). A cap applies with or without a latency tenant: a fresh cap alone redirects.
//!   It reaches only processes that have both `VGPU_SPATIAL=1` (the agent gives it to tenants
//!   with a fraction of a GPU, and to latency tenants: `vgpu-agent`'s
//!   `concurrent_sharing_mode`) and a slot in the GPU's schedule, which is the launch gate's
//!   (`launch::member_slot`: a compute share on that device, joined at the first launch); a cap
//!   0 or `CAP_UNITS` is none. A latency tenant is never capped.
//!
//! With neither a fresh stamp nor a cap in force the cost is a clock read, two relaxed loads
//! and the `OnceLock` loads that find the tenant's slot.
//!
//! The green context is made lazily (about 1.2 ms on an H100) per application context and
//! device, and kept; one green stream and one event pair per application stream, kept in a
//! bounded map. The events are reused for every launch: `cuStreamWaitEvent` waits for the record
//! that precedes it, so re-recording the event for the next launch does not disturb an earlier
//! wait. The five driver calls of one redirected launch run under the device's mutex (it also
//! keeps two threads from interleaving their records of one pair's events); nothing is
//! allocated on that path once a stream has its pair.
//!
//! Failures fail open, logged once: a driver without green contexts (or without an SM resource:
//! no cap applies), a creation that fails, a full map, or a launch that the driver refuses on the green stream but accepts on the
//! application's (then that context is never redirected again) all launch on the application's
//! stream unchanged.
//!
//! Not redirected: cooperative launches (`cuLaunchCooperativeKernel[_ptsz]`, `cuLaunchKernelEx`
//! with `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`, the multi-device one). Their grid must be co-resident
//! and the application sized it for the whole GPU (occupancy × all SMs), so on a partition the
//! driver would refuse it (`CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`). They stay on the
//! application's stream, after the redirected work (the event pair orders them).

use crate::compute::{QUANTUM_NS_DEFAULT, Region};
use crate::launch::{Gpu, StreamRef, uuid_text};
use crate::shm::monotonic_ns;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, OnceLock};
use tenant_abi::control::{CAP_UNITS, Decision};
use tenant_abi::{DEVICES_MAX, SpatialEnv};

/// SMs left to the latency tenant by `partition_sms` when no count is requested (the static split
/// of the earlier design; the interposer now always requests the decided or configured count, so
/// only `partition_sms`'s own tests reach it). Measured through
/// the agent on an H100 (132 SMs, docs/benchmarks.md): the trainer on 104 SMs (28 free) met
/// both targets in 8 of 8 runs of one call (p99 0.82-1.04x of alone, trainer 83.3-83.8%); in
/// the same session 96 SMs (36 free) kept the p99 (0.63-1.08x) but left the trainer at
/// 79.5-80.5%, under its 80% target in 6 of 8 runs; 112 SMs held the p99 in 4 of 5 runs and 80
/// SMs left the trainer at 71%.
pub const SMS_RESERVED_DEFAULT: u32 = 28;
/// The SM granularity of a partition when the driver does not report one (H100: 8).
pub const SM_GRANULARITY_DEFAULT: u32 = 8;
/// Green contexts per device (application contexts x the SM counts the controller asked for).
const CONTEXTS_MAX: usize = 32;
/// Application streams per device that get a green stream and an event pair.
const STREAMS_MAX: usize = 256;

/// The driver's green-context functions, as spatial partitioning needs them. Implemented by
/// `exports` over the real driver.
pub trait Green: Gpu {
    /// The SM resource of `device` (`cuDeviceGetDevResource`).
    fn sm_resource(&self, device: i32) -> Result<SmResource, String>;
    /// Creates a green context on `device` with the SM count `choose` picks from the device's
    /// SM resource; returns its handle and the SMs granted.
    fn green_context_create(
        &self,
        device: i32,
        choose: &dyn Fn(SmResource) -> Result<u32, String>,
    ) -> Result<(usize, u32), String>;
    /// A non-blocking stream of the green context `green`.
    fn green_stream_create(&self, green: usize) -> Result<usize, String>;
    /// Makes `stream` wait for the last record of `event`.
    fn stream_wait_event(&self, stream: usize, event: usize) -> bool;
}

/// A device's SM resource (`CUdevSmResource`); 0 where the driver does not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmResource {
    pub count: u32,
    pub min_partition: u32,
    pub alignment: u32,
}

/// The SMs a squeezed tenant keeps: `requested`, or all but `SMS_RESERVED_DEFAULT`, rounded down
/// to the partition granularity and at least the minimum partition. `Err` when that leaves
/// nothing free (there is nothing to squeeze).
pub fn partition_sms(resource: SmResource, requested: Option<u32>) -> Result<u32, String> {
    let (alignment, minimum) = granularity(resource);
    let wanted = requested.unwrap_or(resource.count.saturating_sub(SMS_RESERVED_DEFAULT));
    let sms = (wanted / alignment * alignment).max(minimum);
    debug_assert!(sms % alignment == 0 || sms == minimum);
    if wanted >= resource.count || sms >= resource.count {
        return Err(format!(
            "a partition of {sms} SMs leaves none of the device's {} free",
            resource.count
        ));
    }
    Ok(sms)
}

/// The SMs an agent's cap of `cap` [`CAP_UNITS`]ths of the GPU leaves a tenant: its share of the
/// device's SMs rounded down to the partition granularity, at least the minimum partition.
/// `None` when even that leaves no SM free (a device too small to partition).
pub fn cap_sms(resource: SmResource, cap: u8) -> Option<u32> {
    assert!(
        cap > 0 && cap < CAP_UNITS,
        "a cap in force is 1..{CAP_UNITS}"
    );
    let (alignment, minimum) = granularity(resource);
    let share = u64::from(resource.count) * u64::from(cap) / u64::from(CAP_UNITS);
    let share = u32::try_from(share).expect("below the device's count");
    let sms = (share / alignment * alignment).max(minimum);
    assert!(sms >= minimum && (sms % alignment == 0 || sms == minimum));
    (sms < resource.count).then_some(sms)
}

/// The SMs a launch keeps, from the closed loop's count (`squeeze_sms`, while a latency tenant is
/// active) and the tenant's own cap (`cap_sms`): the smaller of those that restrict; `None`
/// when neither does.
pub fn launch_sms(squeezed: Option<u32>, capped: Option<u32>) -> Option<u32> {
    match (squeezed, capped) {
        (Some(squeezed), Some(capped)) => Some(squeezed.min(capped)),
        (squeezed, capped) => squeezed.or(capped),
    }
}

/// A partition's alignment and minimum size (`SM_GRANULARITY_DEFAULT` where the driver does not
/// say).
fn granularity(resource: SmResource) -> (u32, u32) {
    let alignment = if resource.alignment == 0 {
        SM_GRANULARITY_DEFAULT
    } else {
        resource.alignment
    };
    (alignment, resource.min_partition.max(alignment))
}

/// Whether this process is a latency tenant; if it is, stamps the current device's schedule.
/// Called at every launch before the turn gate, which a latency tenant skips.
pub fn stamp_if_latency(gpu: &dyn Gpu) -> bool {
    let Some(spatial) = spatial() else {
        return false;
    };
    if !spatial.config.latency {
        return false;
    }
    if let Some(device) = spatial.device(gpu) {
        let now = monotonic_ns().max(1);
        device.region.stamp_latency(now);
        crate::closed_loop::latency_launched(device, now);
    }
    true
}

/// Where a squeezable tenant's launch on `stream` goes: `None` for the application's stream
/// (spatial mode off, a latency tenant, neither a fresh latency stamp nor a cap of the tenant's
/// in force, or a failure), else a green stream whose first event pair half is already queued.
/// The caller launches on `Redirect::stream` and reports with `launched` or `refused`.
pub fn redirect(gpu: &dyn Green, stream: StreamRef) -> Option<Redirect> {
    let spatial = spatial()?;
    if spatial.config.latency {
        return None;
    }
    let device = spatial.device(gpu)?;
    let now = monotonic_ns();
    let latency = device.region.latency_active(now, spatial.hold_ns);
    let capped = device.capped_sms(gpu, now);
    if !(latency || capped.is_some()) || device.off.load(Relaxed) {
        return None;
    }
    let squeezed = if latency {
        squeeze_sms(device.region.control.decision(now), spatial.config.sms)
    } else {
        None
    };
    let sms = launch_sms(squeezed, capped)?;
    device.redirect(gpu, sms, stream)
}

/// The SMs a squeezed launch keeps: the agent's decision while it has one in force (`None`: it
/// asks for all of them); without one, only an explicit `VGPU_SPATIAL_SMS` squeezes (an agent
/// that stopped leaves the GPU unrestricted: fail open).
pub fn squeeze_sms(decision: Decision, configured: Option<u32>) -> Option<u32> {
    if decision != Decision::default() {
        return (decision.sms != 0).then_some(u32::from(decision.sms));
    }
    configured
}

/// A launch moved to a green stream; holds the device's mutex until reported.
#[must_use]
pub struct Redirect {
    state: MutexGuard<'static, State>,
    device: &'static Device,
    context: usize,
    pair: Pair,
    app_handle: usize,
}

impl Redirect {
    /// The green stream to launch on.
    pub fn stream(&self) -> usize {
        self.pair.green
    }

    /// The driver accepted the launch on the green stream: the application's stream waits for it.
    pub fn launched(self, gpu: &dyn Green) {
        let ordered = gpu.event_record(self.pair.to_app, self.pair.green)
            && gpu.stream_wait_event(self.app_handle, self.pair.to_app);
        if !ordered {
            // The launch is queued and cannot be taken back; later work of the application's
            // stream may overlap it. Report it and stop redirecting on this device.
            self.device.off.store(true, Relaxed);
            crate::log::error(format_args!(
                "spatial partitioning on device {}: cannot order a green stream back into the \
                 application's stream; launches stay on the application's streams from now on",
                self.device.index
            ));
        }
    }

    /// The driver refused the launch on the green stream, and the application's stream then
    /// accepted (`app_ok`) or refused it too. A refusal on green alone means green streams do not
    /// work for this context (a non-primary context, a graph the driver cannot move): this
    /// context is not redirected again.
    pub fn refused(mut self, green_rc: i32, app_ok: bool) {
        if !app_ok {
            return;
        }
        let context = self.context;
        for entry in self.state.contexts.iter_mut().filter(|c| c.0 == context) {
            entry.2 = None;
        }
        crate::log::error(format_args!(
            "spatial partitioning on device {}: a launch on the green stream failed (CUresult \
             {green_rc}) but succeeded on the application's stream; context {context:#x} is not \
             redirected from now on",
            self.device.index
        ));
    }
}

pub(crate) struct Spatial {
    pub(crate) config: SpatialEnv,
    pub(crate) hold_ns: u64,
    single_device: OnceLock<bool>,
    devices: [OnceLock<Option<Device>>; DEVICES_MAX],
}

pub(crate) fn spatial() -> Option<&'static Spatial> {
    static SPATIAL: OnceLock<Option<Spatial>> = OnceLock::new();
    SPATIAL
        .get_or_init(
            || match SpatialEnv::from_lookup(|name| std::env::var(name).ok()) {
                Ok(Some(config)) => {
                    crate::log::debug(format_args!(
                        "tenant {} spatial mode: {}, hold {} ms, SMs {:?}",
                        config.tenant,
                        if config.latency {
                            "latency"
                        } else {
                            "squeezable"
                        },
                        config.hold_ms,
                        config.sms
                    ));
                    Some(Spatial {
                        hold_ns: config.hold_ms.saturating_mul(1_000_000),
                        config,
                        single_device: OnceLock::new(),
                        devices: std::array::from_fn(|_| OnceLock::new()),
                    })
                }
                Ok(None) => None,
                Err(e) => {
                    crate::log::error(format_args!("{e}; spatial partitioning is off"));
                    None
                }
            },
        )
        .as_ref()
}

impl Spatial {
    /// The devices this process opened (launched on) so far.
    pub(crate) fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices
            .iter()
            .filter_map(|device| device.get()?.as_ref())
    }

    /// The current device's state, opened on first use (`None`: not usable, logged once).
    pub(crate) fn device(&'static self, gpu: &dyn Gpu) -> Option<&'static Device> {
        let single = *self
            .single_device
            .get_or_init(|| gpu.device_count() == Some(1));
        let index = if single {
            0
        } else {
            gpu.current_device()
                .and_then(|d| usize::try_from(d).ok())
                .filter(|&d| d < DEVICES_MAX)?
        };
        self.devices[index]
            .get_or_init(|| match Device::open(&self.config, index, gpu) {
                Ok(device) => Some(device),
                Err(e) => {
                    crate::log::error(format_args!(
                        "spatial partitioning on device {index} is off: {e}"
                    ));
                    None
                }
            })
            .as_ref()
    }
}

/// One device of this process.
pub(crate) struct Device {
    pub(crate) index: usize,
    pub(crate) region: &'static Region,
    /// Set after a failure that makes redirection unsafe on this device.
    off: AtomicBool,
    /// The device's SM resource, read at the first cap in force (`None`: the driver has none,
    /// logged once; caps are not applied).
    resource: OnceLock<Option<SmResource>>,
    state: Mutex<State>,
    /// The closed loop's per-process state on this device (`closed_loop`).
    pub(crate) closed_loop: crate::closed_loop::DeviceLoop,
}

#[derive(Default)]
struct State {
    /// (application context, SMs) → its green context of that size (`None`: creation or a
    /// launch failed).
    contexts: Vec<(usize, u32, Option<usize>)>,
    /// (application context, stream key, SMs) → green stream and events.
    pairs: HashMap<(usize, (usize, u64), u32), Pair>,
    full_logged: bool,
}

#[derive(Debug, Clone, Copy)]
struct Pair {
    green: usize,
    /// Recorded on the application's stream, waited for by the green stream.
    to_green: usize,
    /// Recorded on the green stream, waited for by the application's stream.
    to_app: usize,
}

impl Device {
    fn open(config: &SpatialEnv, index: usize, gpu: &dyn Gpu) -> Result<Device, String> {
        let uuid = gpu
            .uuid(index as i32)
            .ok_or("cuDeviceGetUuid failed".to_owned())?;
        let region =
            crate::shm::open_schedule(&config.shm_dir, &uuid_text(&uuid), QUANTUM_NS_DEFAULT)?;
        Ok(Device {
            index,
            region,
            off: AtomicBool::new(false),
            resource: OnceLock::new(),
            state: Mutex::new(State::default()),
            closed_loop: crate::closed_loop::DeviceLoop::default(),
        })
    }

    /// The SMs the agent's cap of this process's tenant leaves it at `now` (`Control::cap`; the
    /// tenant's slot is the gate's: a tenant without a compute share on the device has none, and
    /// no cap). While the agent publishes no caps: two `OnceLock` loads and one relaxed load.
    fn capped_sms(&self, gpu: &dyn Green, now: u64) -> Option<u32> {
        let slot = crate::launch::member_slot(self.index)?;
        let cap = self.region.control.cap(slot, now)?;
        let resource = self
            .resource
            .get_or_init(|| match gpu.sm_resource(self.index as i32) {
                Ok(resource) => Some(resource),
                Err(e) => {
                    crate::log::error(format_args!(
                        "spatial partitioning on device {}: no SM resource ({e}); the agent's \
                         SM caps are not applied",
                        self.index
                    ));
                    None
                }
            });
        cap_sms((*resource)?, cap)
    }

    fn redirect(&'static self, gpu: &dyn Green, sms: u32, stream: StreamRef) -> Option<Redirect> {
        let context = gpu.current_context();
        if context == 0 {
            return None;
        }
        let (app_handle, key) = stream.resolve();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let pair = match state.pairs.get(&(context, key, sms)) {
            Some(&pair) => pair,
            None => {
                let green = self.green_context(&mut state, gpu, sms, context)?;
                if state.pairs.len() >= STREAMS_MAX {
                    if !state.full_logged {
                        state.full_logged = true;
                        crate::log::error(format_args!(
                            "spatial partitioning on device {}: {STREAMS_MAX} streams already \
                             have a green stream; launches on further streams are not redirected",
                            self.index
                        ));
                    }
                    return None;
                }
                let pair = self.new_pair(gpu, green)?;
                state.pairs.insert((context, key, sms), pair);
                pair
            }
        };
        // The green context of this context may have been given up since the pair was made.
        if !state
            .contexts
            .iter()
            .any(|c| c.0 == context && c.1 == sms && c.2.is_some())
        {
            return None;
        }
        if !(gpu.event_record(pair.to_green, app_handle)
            && gpu.stream_wait_event(pair.green, pair.to_green))
        {
            return None;
        }
        Some(Redirect {
            state,
            device: self,
            context,
            pair,
            app_handle,
        })
    }

    /// The green context of `sms` SMs for `context`, created on first use.
    fn green_context(
        &self,
        state: &mut State,
        gpu: &dyn Green,
        sms: u32,
        context: usize,
    ) -> Option<usize> {
        if let Some(&(_, _, green)) = state.contexts.iter().find(|c| c.0 == context && c.1 == sms) {
            return green;
        }
        if state.contexts.len() >= CONTEXTS_MAX {
            return None;
        }
        let started = monotonic_ns();
        let created = gpu.green_context_create(self.index as i32, &|resource| {
            partition_sms(resource, Some(sms))
        });
        let green = match created {
            Ok((green, sms)) => {
                crate::log::debug(format_args!(
                    "spatial partitioning on device {}: green context of {sms} SMs for context \
                     {context:#x} in {} us",
                    self.index,
                    monotonic_ns().saturating_sub(started) / 1000
                ));
                Some(green)
            }
            Err(e) => {
                crate::log::error(format_args!(
                    "spatial partitioning on device {}: no green context ({e}); launches stay on \
                     the application's streams",
                    self.index
                ));
                None
            }
        };
        state.contexts.push((context, sms, green));
        green
    }

    fn new_pair(&self, gpu: &dyn Green, green_context: usize) -> Option<Pair> {
        let green = match gpu.green_stream_create(green_context) {
            Ok(stream) => stream,
            Err(e) => {
                crate::log::error(format_args!(
                    "spatial partitioning on device {}: {e}",
                    self.index
                ));
                self.off.store(true, Relaxed);
                return None;
            }
        };
        let to_green = gpu.event_create()?;
        let Some(to_app) = gpu.event_create() else {
            gpu.event_destroy(to_green);
            return None;
        };
        Some(Pair {
            green,
            to_green,
            to_app,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: SmResource = SmResource {
        count: 132,
        min_partition: 8,
        alignment: 8,
    };

    #[test]
    fn partitions_leave_the_reserve_and_round_down_to_the_granularity() {
        assert_eq!(partition_sms(H100, None), Ok(104));
        assert_eq!(partition_sms(H100, Some(104)), Ok(104));
        assert_eq!(partition_sms(H100, Some(110)), Ok(104));
        assert_eq!(partition_sms(H100, Some(3)), Ok(8), "at least the minimum");
        assert!(partition_sms(H100, Some(128)).is_ok());
        assert!(partition_sms(H100, Some(132)).is_err(), "nothing left free");
        assert!(partition_sms(H100, Some(500)).is_err());
        let old_driver = SmResource {
            count: 132,
            min_partition: 0,
            alignment: 0,
        };
        assert_eq!(partition_sms(old_driver, None), Ok(104));
        assert_eq!(partition_sms(old_driver, Some(100)), Ok(96));
        let coarse = SmResource {
            count: 78,
            min_partition: 16,
            alignment: 4,
        };
        assert_eq!(partition_sms(coarse, None), Ok(48));
        assert_eq!(partition_sms(coarse, Some(10)), Ok(16));
        let small = SmResource {
            count: 8,
            min_partition: 8,
            alignment: 8,
        };
        assert!(partition_sms(small, None).is_err());
    }

    #[test]
    fn a_cap_is_its_share_of_the_sms_rounded_down_to_the_granularity() {
        assert_eq!(cap_sms(H100, 64), Some(64), "66 SMs, rounded down");
        assert_eq!(cap_sms(H100, 96), Some(96), "99 SMs");
        assert_eq!(
            cap_sms(H100, 127),
            Some(128),
            "131 SMs: one granule short of all"
        );
        assert_eq!(cap_sms(H100, 1), Some(8), "at least the minimum partition");
        assert_eq!(cap_sms(H100, 8), Some(8));
        let old_driver = SmResource {
            count: 132,
            min_partition: 0,
            alignment: 0,
        };
        assert_eq!(cap_sms(old_driver, 64), Some(64));
        let coarse = SmResource {
            count: 78,
            min_partition: 16,
            alignment: 4,
        };
        assert_eq!(cap_sms(coarse, 64), Some(36));
        assert_eq!(cap_sms(coarse, 10), Some(16));
        let small = SmResource {
            count: 8,
            min_partition: 8,
            alignment: 8,
        };
        assert_eq!(cap_sms(small, 100), None, "nothing to leave free");
        // Every cap in force gives a partition the driver can make.
        for cap in 1..CAP_UNITS {
            let sms = cap_sms(H100, cap).expect("an H100 partitions");
            assert_eq!(partition_sms(H100, Some(sms)), Ok(sms));
        }
    }

    #[test]
    fn a_launch_keeps_the_smaller_of_what_restricts() {
        assert_eq!(launch_sms(None, None), None);
        assert_eq!(launch_sms(Some(40), None), Some(40));
        assert_eq!(launch_sms(None, Some(64)), Some(64));
        assert_eq!(launch_sms(Some(40), Some(64)), Some(40));
        assert_eq!(launch_sms(Some(104), Some(64)), Some(64));
    }
}
