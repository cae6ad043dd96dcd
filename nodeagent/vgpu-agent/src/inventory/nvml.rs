//! [`GpuDiscovery`] through NVML (`nvml-wrapper`, which `dlopen`s `libnvidia-ml.so.1` at run
//! time, so the agent still starts on machines without the driver and says why it found no GPU).
//!
//! The library is looked for as `$VGPU_NVML_LIBRARY` when set, else under its usual names and
//! locations ([`NVML_LIBRARY_CANDIDATES`]). SM counts come from the CUDA driver ([`super::cuda`]).
//!
//! Unsafe: one call, `nvmlDeviceGetNvLinkRemoteDeviceType`, which nvml-wrapper 0.13 wraps
//! incorrectly (its `remote_device_type` writes the answer into a temporary and always returns
//! `Unknown`), so it is made here through the wrapper's own loaded symbol.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use crate::inventory::cuda;
use crate::inventory::discovery::{
    DiscoveryError, GpuDiscovery, LinkRemote, MigState, RawGpu, RawLink,
};

/// Where NVML is looked for, in order, when `$VGPU_NVML_LIBRARY` is not set.
pub const NVML_LIBRARY_CANDIDATES: &[&str] = &[
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
];

/// `NVML_NVLINK_MAX_LINKS` of the NVML headers (Hopper and Blackwell have 18).
pub const NVLINK_LINKS_MAX: u32 = 18;

// `nvmlIntNvLinkDeviceType_t` values.
const NVLINK_DEVICE_TYPE_GPU: u32 = 0;
const NVLINK_DEVICE_TYPE_IBMNPU: u32 = 1;
const NVLINK_DEVICE_TYPE_SWITCH: u32 = 2;
const NVLINK_DEVICE_TYPE_UNKNOWN: u32 = 255;
const NVML_SUCCESS: u32 = 0;

/// An initialised NVML session.
pub struct NvmlDiscovery {
    nvml: Nvml,
    /// The name or path NVML was loaded from.
    library: String,
}

impl NvmlDiscovery {
    /// Loads and initialises NVML. The error says what was tried.
    pub fn open() -> Result<NvmlDiscovery, DiscoveryError> {
        let from_environment = std::env::var(tenant_abi::env::var::NVML_LIBRARY)
            .ok()
            .filter(|path| !path.is_empty());
        let candidates: Vec<String> = match from_environment {
            Some(path) => vec![path],
            None => NVML_LIBRARY_CANDIDATES
                .iter()
                .map(|name| (*name).to_owned())
                .collect(),
        };
        let mut first_load_error = None;
        for candidate in &candidates {
            match Nvml::builder().lib_path(OsStr::new(candidate)).init() {
                Ok(nvml) => {
                    return Ok(NvmlDiscovery {
                        nvml,
                        library: candidate.clone(),
                    });
                }
                // The library is not there: try the next place.
                Err(NvmlError::LibloadingError(error)) => {
                    first_load_error.get_or_insert_with(|| error.to_string());
                }
                // The library loaded but the driver said no: that is the answer.
                Err(error) => {
                    return Err(DiscoveryError(format!(
                        "{candidate} loaded but nvmlInit failed: {error}"
                    )));
                }
            }
        }
        let tried = candidates.len();
        Err(DiscoveryError(format!(
            "cannot load the NVML library: {}{}",
            first_load_error.unwrap_or_default(),
            if tried > 1 {
                format!(" (tried {tried} locations; set VGPU_NVML_LIBRARY to its path)")
            } else {
                String::new()
            }
        )))
    }

    /// Where NVML was loaded from.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The NVML session, for the health monitor ([`crate::health::nvml`]).
    pub fn into_nvml(self) -> Nvml {
        self.nvml
    }

    fn read_gpu(&self, index: u32) -> Result<RawGpu, NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        let mig = match device.mig_mode() {
            Ok(mode) if mode.current == 1 => MigState::Enabled {
                pending_enabled: mode.pending == 1,
            },
            Ok(mode) => MigState::Disabled {
                pending_enabled: mode.pending == 1,
            },
            Err(_) => MigState::Unsupported,
        };
        Ok(RawGpu {
            index,
            uuid: device.uuid()?,
            name: device.name()?,
            memory_bytes: device.memory_info()?.total,
            pci_bus_id: device.pci_info()?.bus_id,
            device_minor: device.minor_number().ok(),
            mig,
            numa_node: device.numa_node_id().ok(),
            links: active_links(&device),
        })
    }
}

impl GpuDiscovery for NvmlDiscovery {
    fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    fn device_count(&self) -> Result<u32, DiscoveryError> {
        self.nvml
            .device_count()
            .map_err(|error| DiscoveryError(format!("nvmlDeviceGetCount failed: {error}")))
    }

    fn gpu(&self, index: u32) -> Result<RawGpu, DiscoveryError> {
        self.read_gpu(index)
            .map_err(|error| DiscoveryError(error.to_string()))
    }

    fn sm_counts(&self) -> Result<BTreeMap<String, u32>, DiscoveryError> {
        cuda::sm_counts_by_bus_id()
    }
}

/// The active NVLinks of `device` and their far ends. A GPU without NVLink answers
/// `NotSupported` for link 0; links past the last answer `InvalidArg`.
fn active_links(device: &Device<'_>) -> Vec<RawLink> {
    let mut links = Vec::new();
    for link in 0..NVLINK_LINKS_MAX {
        let wrapper = device.link_wrapper_for(link);
        match wrapper.is_active() {
            Ok(true) => {}
            Ok(false) => continue,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
            Err(error) => {
                tracing::debug!("NVLink {link}: cannot read its state: {error}");
                continue;
            }
        }
        let remote_bus = wrapper.remote_pci_info().ok().map(|info| info.bus_id);
        let remote = match remote_device_type(device, link) {
            Some(NVLINK_DEVICE_TYPE_SWITCH) => LinkRemote::Switch,
            Some(NVLINK_DEVICE_TYPE_IBMNPU) => LinkRemote::Other,
            Some(NVLINK_DEVICE_TYPE_GPU) => match remote_bus {
                Some(bus) => LinkRemote::Gpu(bus),
                None => LinkRemote::Unknown(None),
            },
            _ => LinkRemote::Unknown(remote_bus),
        };
        links.push(RawLink { link, remote });
    }
    links
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`, or `None` when the driver lacks it or says no.
fn remote_device_type(device: &Device<'_>, link: u32) -> Option<u32> {
    let function = device
        .nvml()
        .lib()
        .nvmlDeviceGetNvLinkRemoteDeviceType
        .as_ref()
        .ok()?;
    let mut kind: u32 = NVLINK_DEVICE_TYPE_UNKNOWN;
    // SAFETY: `function` is the symbol nvml-wrapper resolved from the loaded NVML library, with
    // the C signature `(nvmlDevice_t, unsigned int, nvmlIntNvLinkDeviceType_t *)`. The handle comes
    // from `device`, which borrows the initialised `Nvml`, so it is live for the call; `link` is
    // validated by NVML; `kind` is a valid, writable `unsigned int` for the call's duration.
    let status = unsafe { function(device.handle(), link, &mut kind) };
    (status == NVML_SUCCESS).then_some(kind)
}
