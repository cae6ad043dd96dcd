//! [`HealthSource`] through NVML (nvml-wrapper, loaded at run time like discovery).
//!
//! * XID errors: one NVML event set per GPU, registered for `CRITICAL_XID_ERROR` where the GPU
//!   supports it, drained at each sample with a zero timeout (`nvmlEventSetWait` returns at once
//!   when nothing is pending), so sampling never waits for an event. Counts start at 0 when the
//!   agent starts (NVML keeps no history).
//! * ECC: `nvmlDeviceGetTotalEccErrors`, volatile counters (since the driver loaded); GPUs with
//!   ECC off or without ECC answer `NotSupported`.
//! * Throttling: `nvmlDeviceGetCurrentClocksThrottleReasons`, named by
//!   [`super::throttle_reason_names`].
//! * Temperature, utilisation, memory in use, and the running compute processes.
//!
//! `NotSupported` (and `FunctionNotFound`, an older driver) lists the query in `unsupported`;
//! any other failure is logged once per GPU and query and leaves the field absent.
//!
//! The NVML session lives as long as the process (it is leaked on purpose: event sets borrow it,
//! and the agent samples until it exits). Every value here is created and used on the monitor
//! thread (NVML handles are not `Send`).

use std::collections::BTreeSet;

use api::v1::{GpuHealth, ProcessUsage};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};

use super::{HealthSource, mark_unsupported, throttle_reason_names};
use crate::inventory::Inventory;

/// Events drained per GPU per sample (an XID storm must not stall the monitor).
const EVENTS_PER_SAMPLE_MAX: usize = 256;

struct Gpu {
    uuid: String,
    index: u32,
    device: Device<'static>,
    /// `None`: XID events are not supported (or could not be registered) on this GPU.
    events: Option<EventSet<'static>>,
    xid_errors: u64,
    last_xid: u32,
    last_xid_unix_ms: i64,
}

/// Health of the registered GPUs through NVML.
pub struct NvmlHealth {
    gpus: Vec<Gpu>,
    /// `(uuid, query)` pairs whose failure was already logged.
    logged: BTreeSet<(String, &'static str)>,
}

impl NvmlHealth {
    /// Opens NVML and finds `inventory`'s GPUs by uuid. The error says why health cannot be
    /// sampled at all (heartbeats then carry no health).
    pub fn open(inventory: &Inventory) -> Result<NvmlHealth, String> {
        let nvml = crate::inventory::nvml::NvmlDiscovery::open()
            .map_err(|error| error.0)?
            .into_nvml();
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let mut gpus = Vec::new();
        for info in &inventory.gpus {
            let device = match nvml.device_by_uuid(info.uuid.as_str()) {
                Ok(device) => device,
                Err(error) => {
                    tracing::warn!("GPU {} ({}): no health: {error}", info.index, info.uuid);
                    continue;
                }
            };
            let events = xid_events(nvml, &device, info.index);
            gpus.push(Gpu {
                uuid: info.uuid.clone(),
                index: info.index,
                device,
                events,
                xid_errors: 0,
                last_xid: 0,
                last_xid_unix_ms: 0,
            });
        }
        Ok(NvmlHealth {
            gpus,
            logged: BTreeSet::new(),
        })
    }
}

/// An event set for the XID errors of `device`, or `None` where it does not support them.
fn xid_events(
    nvml: &'static Nvml,
    device: &Device<'static>,
    index: u32,
) -> Option<EventSet<'static>> {
    match device.supported_event_types() {
        Ok(types) if types.contains(EventTypes::CRITICAL_XID_ERROR) => {}
        Ok(_) | Err(NvmlError::NotSupported) => return None,
        Err(error) => {
            tracing::warn!("GPU {index}: cannot ask which NVML events it supports: {error}");
            return None;
        }
    }
    let set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(error) => {
            tracing::warn!("GPU {index}: cannot create an NVML event set: {error}");
            return None;
        }
    };
    match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
        Ok(set) => Some(set),
        Err(error) => {
            tracing::warn!("GPU {index}: cannot register for XID events: {error:?}");
            None
        }
    }
}

fn is_unsupported(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::NotSupported | NvmlError::FunctionNotFound | NvmlError::NotFound
    )
}

impl NvmlHealth {
    /// Files the answer of `query`: `Some` on success; on failure lists it as unsupported or
    /// logs it (once per GPU and query).
    fn answer<T>(
        logged: &mut BTreeSet<(String, &'static str)>,
        health: &mut GpuHealth,
        query: &'static str,
        result: Result<T, NvmlError>,
    ) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(error) if is_unsupported(&error) => {
                mark_unsupported(health, query);
                None
            }
            Err(error) => {
                if logged.insert((health.uuid.clone(), query)) {
                    tracing::warn!(
                        "GPU {} ({}): NVML cannot answer `{query}`: {error}",
                        health.index,
                        health.uuid
                    );
                }
                None
            }
        }
    }
}

impl HealthSource for NvmlHealth {
    fn sample(&mut self) -> Vec<GpuHealth> {
        let now = crate::monitor::unix_ms();
        let mut entries = Vec::with_capacity(self.gpus.len());
        for gpu in &mut self.gpus {
            let mut health = api::usage::empty_health(&gpu.uuid, gpu.index);
            match &gpu.events {
                Some(events) => {
                    for _ in 0..EVENTS_PER_SAMPLE_MAX {
                        match events.wait(0) {
                            Ok(event)
                                if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) =>
                            {
                                gpu.xid_errors += 1;
                                gpu.last_xid = match event.event_data {
                                    Some(XidError::Value(xid)) => {
                                        u32::try_from(xid).unwrap_or(u32::MAX)
                                    }
                                    _ => 0,
                                };
                                gpu.last_xid_unix_ms = now;
                            }
                            Ok(_) => {}
                            Err(NvmlError::Timeout) => break,
                            Err(error) => {
                                if self.logged.insert((gpu.uuid.clone(), "xid")) {
                                    tracing::warn!(
                                        "GPU {}: reading XID events failed: {error}",
                                        gpu.index
                                    );
                                }
                                break;
                            }
                        }
                    }
                    health.xid_errors = gpu.xid_errors;
                    health.last_xid = gpu.last_xid;
                    health.last_xid_unix_ms = gpu.last_xid_unix_ms;
                }
                None => mark_unsupported(&mut health, "xid"),
            }
            let device = &gpu.device;
            let logged = &mut self.logged;
            let corrected = device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile);
            if let Some(count) = Self::answer(logged, &mut health, "ecc", corrected) {
                health.ecc_corrected = Some(count);
                let uncorrected =
                    device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile);
                health.ecc_uncorrected = Self::answer(logged, &mut health, "ecc", uncorrected);
            }
            let reasons = device.current_throttle_reasons().map(|r| r.bits());
            if let Some(bits) = Self::answer(logged, &mut health, "throttle", reasons) {
                health.throttle_reasons = throttle_reason_names(bits);
            }
            let temperature = device.temperature(TemperatureSensor::Gpu);
            health.temperature_celsius =
                Self::answer(logged, &mut health, "temperature", temperature);
            let utilization = device.utilization_rates().map(|u| u.gpu);
            health.utilization_percent =
                Self::answer(logged, &mut health, "utilization", utilization);
            // Everything not free: NVML's v2 `used` leaves out `reserved`, and with it the
            // CUDA contexts (an H200 with seven processes' contexts said 16.36 GB used while
            // their allocations on the memory board came to 16.55 GB, so the board's measured
            // reserve, `crate::reserve`, never rose above its floor).
            let memory = device.memory_info().map(|m| m.total.saturating_sub(m.free));
            health.memory_used_bytes = Self::answer(logged, &mut health, "memory", memory);
            let processes = device.running_compute_processes();
            if let Some(processes) = Self::answer(logged, &mut health, "processes", processes) {
                health.processes = processes
                    .into_iter()
                    .map(|process| ProcessUsage {
                        pid: process.pid,
                        memory_bytes: match process.used_gpu_memory {
                            UsedGpuMemory::Used(bytes) => bytes,
                            UsedGpuMemory::Unavailable => 0,
                        },
                        tenant: String::new(),
                    })
                    .collect();
                api::usage::bound_processes(&mut health.processes);
            }
            entries.push(health);
        }
        entries
    }
}
