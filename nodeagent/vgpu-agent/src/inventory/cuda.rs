//! SM counts from the CUDA driver: NVML has no multiprocessor count for a whole GPU, so the agent
//! `dlopen`s `libcuda.so.1` and asks `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)`
//! for each device, keyed by `cuDeviceGetPCIBusId` (CUDA's device order need not be NVML's, and
//! `CUDA_VISIBLE_DEVICES` may hide some).
//!
//! `cuInit` creates no context and allocates no GPU memory. The library stays loaded for the life
//! of the process: unloading an initialised CUDA driver is not something it supports.
//!
//! Unsafe: the FFI calls below, each with its `// SAFETY:` reasoning; nothing else in the agent
//! calls CUDA.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_int, c_uint};

use libloading::{Library, Symbol};

use crate::inventory::discovery::{DiscoveryError, normalize_bus_id};

/// Where the CUDA driver is looked for, in order, when `$VGPU_CUDA_LIBRARY` is not set.
pub const CUDA_LIBRARY_CANDIDATES: &[&str] = &[
    "libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
];

const CUDA_SUCCESS: c_int = 0;
const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
/// `cuDeviceGetPCIBusId` needs 13 bytes for `0000:18:00.0`; room for an 8-digit domain.
const BUS_ID_BYTES: usize = 32;
/// More CUDA devices than this is a broken answer.
const CUDA_DEVICES_MAX: c_int = 1024;

type CuInit = unsafe extern "C" fn(flags: c_uint) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(device: *mut c_int, ordinal: c_int) -> c_int;
type CuDeviceGetAttribute =
    unsafe extern "C" fn(value: *mut c_int, attribute: c_int, device: c_int) -> c_int;
type CuDeviceGetPciBusId =
    unsafe extern "C" fn(bus_id: *mut c_char, length: c_int, device: c_int) -> c_int;

/// SM counts by normalised PCI bus id, for every device CUDA sees.
pub fn sm_counts_by_bus_id() -> Result<BTreeMap<String, u32>, DiscoveryError> {
    let library = load()?;
    let counts = query(&library);
    // Never unloaded; see the module docs.
    std::mem::forget(library);
    counts
}

fn load() -> Result<Library, DiscoveryError> {
    let candidates: Vec<String> = match std::env::var(tenant_abi::env::var::CUDA_LIBRARY) {
        Ok(path) if !path.is_empty() => vec![path],
        _ => CUDA_LIBRARY_CANDIDATES
            .iter()
            .map(|name| (*name).to_owned())
            .collect(),
    };
    let mut first_error = None;
    for candidate in &candidates {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions
        // beyond a normal process; the library is never unloaded while its symbols are in use.
        match unsafe { Library::new(candidate) } {
            Ok(library) => return Ok(library),
            Err(error) => {
                first_error.get_or_insert_with(|| error.to_string());
            }
        }
    }
    Err(DiscoveryError(format!(
        "cannot load the CUDA driver: {}",
        first_error.unwrap_or_default()
    )))
}

fn symbol<'library, T>(
    library: &'library Library,
    name: &str,
) -> Result<Symbol<'library, T>, DiscoveryError> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    // SAFETY: every `T` used below is the exact C signature of the named CUDA driver function
    // (cuda.h, CUDA 12 and 13), and the symbols do not outlive `library`.
    unsafe { library.get::<T>(&bytes) }
        .map_err(|error| DiscoveryError(format!("the CUDA driver lacks {name}: {error}")))
}

fn check(call: &str, status: c_int) -> Result<(), DiscoveryError> {
    if status == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DiscoveryError(format!(
            "{call} failed with CUresult {status}"
        )))
    }
}

fn query(library: &Library) -> Result<BTreeMap<String, u32>, DiscoveryError> {
    let cu_init = symbol::<CuInit>(library, "cuInit")?;
    let cu_device_get_count = symbol::<CuDeviceGetCount>(library, "cuDeviceGetCount")?;
    let cu_device_get = symbol::<CuDeviceGet>(library, "cuDeviceGet")?;
    let cu_device_get_attribute = symbol::<CuDeviceGetAttribute>(library, "cuDeviceGetAttribute")?;
    let cu_device_get_pci_bus_id = symbol::<CuDeviceGetPciBusId>(library, "cuDeviceGetPCIBusId")?;

    // SAFETY: `cuInit(0)` has no preconditions; 0 is the only valid flag value.
    check("cuInit", unsafe { cu_init(0) })?;
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid, writable `int` for the duration of the call.
    check("cuDeviceGetCount", unsafe {
        cu_device_get_count(&mut count)
    })?;
    if !(0..=CUDA_DEVICES_MAX).contains(&count) {
        return Err(DiscoveryError(format!(
            "cuDeviceGetCount reported {count} devices"
        )));
    }
    let mut counts = BTreeMap::new();
    for ordinal in 0..count {
        let mut device: c_int = 0;
        // SAFETY: `device` is a valid, writable `CUdevice` (an `int`); `ordinal` is below the
        // count the driver reported.
        check("cuDeviceGet", unsafe {
            cu_device_get(&mut device, ordinal)
        })?;
        let mut sm_count: c_int = 0;
        // SAFETY: `sm_count` is a valid, writable `int`; `device` came from `cuDeviceGet`.
        check("cuDeviceGetAttribute", unsafe {
            cu_device_get_attribute(
                &mut sm_count,
                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                device,
            )
        })?;
        let mut buffer = [0u8; BUS_ID_BYTES];
        // SAFETY: `buffer` is writable for `BUS_ID_BYTES` bytes, the length passed; the driver
        // writes a NUL-terminated string no longer than that.
        check("cuDeviceGetPCIBusId", unsafe {
            cu_device_get_pci_bus_id(
                buffer.as_mut_ptr().cast::<c_char>(),
                BUS_ID_BYTES as c_int,
                device,
            )
        })?;
        let bus_id = CStr::from_bytes_until_nul(&buffer)
            .map(|text| text.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (Some(bus_id), Ok(sm_count)) = (normalize_bus_id(&bus_id), u32::try_from(sm_count))
        else {
            continue;
        };
        if sm_count > 0 {
            counts.insert(bus_id, sm_count);
        }
    }
    Ok(counts)
}
