//! The NVML queries a tenant must see through, exported under NVML's names (`nvml` holds the
//! policy): `nvmlDeviceGetMemoryInfo` and `nvmlDeviceGetMemoryInfo_v2` report the tenant's slice
//! of a limited device, and the process lists (`nvmlDeviceGet{Compute,Graphics,MPSCompute}
//! RunningProcesses`, unversioned, `_v2` and `_v3`) show only the tenant's own processes on it.
//! Both ways in are caught: a program linked against `libnvidia-ml.so.1` binds to these
//! exports (the preloaded library comes first), and one that does
//! `dlsym(dlopen("libnvidia-ml.so.1"), ...)` (pynvml through ctypes, PyTorch's c10) gets them from
//! our `dlsym` (`dlsym_shim`), which substitutes a hook for the real function's address.
//!
//! The real library is `dlopen(VGPU_REAL_LIBNVML or "libnvidia-ml.so.1")`, only when one of these
//! paths is taken, so a process that never uses NVML never loads it; if it cannot be loaded the
//! exports answer `NVML_ERROR_LIBRARY_NOT_FOUND`, as NVML's own loader stubs do. The real call
//! always runs first and its error is returned unchanged; only a successful answer about a
//! limited device of this tenant is rewritten. A panic in the policy keeps the real answer.
//!
//! Process lists follow NVML's calling convention, `(device, unsigned int *infoCount, infos)`:
//! for a limited device the real list is read whole into a bounded buffer of our own, filtered,
//! and then answered as NVML would have answered the filtered list (`NVML_ERROR_INSUFFICIENT_SIZE`
//! with the filtered count when the caller's room is too small). The entry layouts are nvml.h's:
//! the unversioned symbols take `nvmlProcessInfo_v1_t` (nvml.h maps the unversioned *names* to
//! `_v3` by macro unless `NVML_NO_UNVERSIONED_FUNC_DEFS`, but the exported unversioned symbols
//! keep the v1 layout for old binaries), `_v2` and `_v3` take `nvmlProcessInfo_v2_t`
//! (= `nvmlProcessInfo_t`).
#![allow(unsafe_code, non_snake_case, non_camel_case_types)]

use crate::nvml::{self, Memory};
use crate::real::{lookup, with_guard};
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

pub type nvmlReturn_t = c_int;
pub type nvmlDevice_t = *mut c_void;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
const UUID_BUFFER_BYTES: usize = 96;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlMemory_t {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`: `used` excludes `reserved` (driver and firmware memory).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlProcessInfo_v1_t`: what the unversioned process-list symbols fill in.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
}

/// `nvmlProcessInfo_v2_t`, which is `nvmlProcessInfo_t`: what the `_v2` and `_v3` process-list
/// symbols fill in. The instance ids are `0xFFFFFFFF` outside MIG.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nvmlProcessInfo_v2_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// An entry of a process list, of either layout.
pub trait ProcessInfo: Copy + Default {
    fn pid(&self) -> u32;
}

impl ProcessInfo for nvmlProcessInfo_v1_t {
    fn pid(&self) -> u32 {
        self.pid
    }
}

impl ProcessInfo for nvmlProcessInfo_v2_t {
    fn pid(&self) -> u32 {
        self.pid
    }
}

const _: () = assert!(std::mem::size_of::<nvmlMemory_t>() == 24);
const _: () = assert!(std::mem::size_of::<nvmlProcessInfo_v1_t>() == 16);
const _: () = assert!(std::mem::size_of::<nvmlProcessInfo_v2_t>() == 24);
const _: () = assert!(std::mem::offset_of!(nvmlProcessInfo_v2_t, gpuInstanceId) == 16);
const _: () = assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);

/// `nvmlMemory_v2`: `NVML_STRUCT_VERSION(Memory, 2)`, the struct size with the version in the
/// top byte. The only layout this library rewrites.
pub const NVML_MEMORY_V2: c_uint = std::mem::size_of::<nvmlMemory_v2_t>() as c_uint | (2 << 24);

type FnGetMemoryInfo = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
type FnGetMemoryInfoV2 = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
type FnGetUuid = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
/// A process-list query: `(device, unsigned int *infoCount, T *infos)`.
type FnGetProcesses<T> = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut T) -> nvmlReturn_t;
type FnGetProcessesV1 = FnGetProcesses<nvmlProcessInfo_v1_t>;
type FnGetProcessesV2 = FnGetProcesses<nvmlProcessInfo_v2_t>;

/// Every NVML hook, by the symbol it replaces.
pub fn hooks() -> [(&'static CStr, *const c_void); 11] {
    [
        (
            c"nvmlDeviceGetMemoryInfo",
            nvmlDeviceGetMemoryInfo as *const c_void,
        ),
        (
            c"nvmlDeviceGetMemoryInfo_v2",
            nvmlDeviceGetMemoryInfo_v2 as *const c_void,
        ),
        (
            c"nvmlDeviceGetComputeRunningProcesses",
            nvmlDeviceGetComputeRunningProcesses as *const c_void,
        ),
        (
            c"nvmlDeviceGetComputeRunningProcesses_v2",
            nvmlDeviceGetComputeRunningProcesses_v2 as *const c_void,
        ),
        (
            c"nvmlDeviceGetComputeRunningProcesses_v3",
            nvmlDeviceGetComputeRunningProcesses_v3 as *const c_void,
        ),
        (
            c"nvmlDeviceGetGraphicsRunningProcesses",
            nvmlDeviceGetGraphicsRunningProcesses as *const c_void,
        ),
        (
            c"nvmlDeviceGetGraphicsRunningProcesses_v2",
            nvmlDeviceGetGraphicsRunningProcesses_v2 as *const c_void,
        ),
        (
            c"nvmlDeviceGetGraphicsRunningProcesses_v3",
            nvmlDeviceGetGraphicsRunningProcesses_v3 as *const c_void,
        ),
        (
            c"nvmlDeviceGetMPSComputeRunningProcesses",
            nvmlDeviceGetMPSComputeRunningProcesses as *const c_void,
        ),
        (
            c"nvmlDeviceGetMPSComputeRunningProcesses_v2",
            nvmlDeviceGetMPSComputeRunningProcesses_v2 as *const c_void,
        ),
        (
            c"nvmlDeviceGetMPSComputeRunningProcesses_v3",
            nvmlDeviceGetMPSComputeRunningProcesses_v3 as *const c_void,
        ),
    ]
}

/// Our hook for an NVML symbol name, if we have one.
pub fn hook_by_name(name: &CStr) -> Option<*const c_void> {
    hooks()
        .into_iter()
        .find(|(hooked, _)| *hooked == name)
        .map(|(_, hook)| hook)
}

/// The loaded real NVML.
pub struct Nvml {
    get_memory_info: Option<FnGetMemoryInfo>,
    get_memory_info_v2: Option<FnGetMemoryInfoV2>,
    get_uuid: Option<FnGetUuid>,
    compute_processes: Option<FnGetProcessesV1>,
    compute_processes_v2: Option<FnGetProcessesV2>,
    compute_processes_v3: Option<FnGetProcessesV2>,
    graphics_processes: Option<FnGetProcessesV1>,
    graphics_processes_v2: Option<FnGetProcessesV2>,
    graphics_processes_v3: Option<FnGetProcessesV2>,
    mps_processes: Option<FnGetProcessesV1>,
    mps_processes_v2: Option<FnGetProcessesV2>,
    mps_processes_v3: Option<FnGetProcessesV2>,
    /// (real function address, our hook address), for every hook the library exports.
    substitutes: Vec<(usize, usize)>,
}

impl Nvml {
    /// Our hook for a real NVML function, if we wrap it.
    pub fn substitute(&self, real: *mut c_void) -> Option<*mut c_void> {
        let real = real as usize;
        self.substitutes
            .iter()
            .find(|(r, _)| *r == real)
            .map(|&(_, hook)| hook as *mut c_void)
    }

    /// The device's uuid as NVML prints it (`GPU-...`).
    fn uuid(&self, device: nvmlDevice_t) -> Option<String> {
        let get = self.get_uuid?;
        let mut buffer = [0 as c_char; UUID_BUFFER_BYTES];
        // SAFETY: `buffer` is writable for its full length, which is passed; `device` is the
        // handle the caller just queried successfully.
        let rc = unsafe { get(device, buffer.as_mut_ptr(), UUID_BUFFER_BYTES as c_uint) };
        if rc != NVML_SUCCESS {
            return None;
        }
        buffer[UUID_BUFFER_BYTES - 1] = 0;
        // SAFETY: NUL-terminated within the buffer (the last byte was just set to 0).
        let text = unsafe { CStr::from_ptr(buffer.as_ptr()) };
        text.to_str().ok().map(str::to_owned)
    }
}

/// The real NVML, loaded on first use; `None` if it cannot be loaded.
pub fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    if let Some(loaded) = NVML.get() {
        return loaded.as_ref();
    }
    if crate::real::in_resolution() {
        // Re-entered from our own loading (a constructor of the library): not loaded yet.
        return None;
    }
    NVML.get_or_init(|| with_guard(load)).as_ref()
}

fn load() -> Option<Nvml> {
    let (handle, path) = crate::real::open_library(
        tenant_abi::env::var::REAL_LIBNVML,
        "libnvidia-ml.so.1",
        |path| crate::log::debug(format_args!("no NVML library `{path}`")),
    )?;
    let resolve = |name: &CStr| {
        let found = lookup(handle, name);
        (!found.is_null()).then_some(found)
    };
    let nvml = Nvml {
        // SAFETY: NVML's `nvmlDeviceGetMemoryInfo` has the C signature `FnGetMemoryInfo`.
        get_memory_info: resolve(c"nvmlDeviceGetMemoryInfo")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetMemoryInfo>(f) }),
        // SAFETY: NVML's `nvmlDeviceGetMemoryInfo_v2` has the C signature `FnGetMemoryInfoV2`.
        get_memory_info_v2: resolve(c"nvmlDeviceGetMemoryInfo_v2")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetMemoryInfoV2>(f) }),
        // SAFETY: NVML's `nvmlDeviceGetUUID` has the C signature `FnGetUuid`.
        get_uuid: resolve(c"nvmlDeviceGetUUID")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetUuid>(f) }),
        // SAFETY: nvml.h declares the unversioned process-list functions with
        // `nvmlProcessInfo_v1_t *infos` (under `NVML_NO_UNVERSIONED_FUNC_DEFS`, the exported
        // symbols' ABI) and the `_v2` / `_v3` ones with `nvmlProcessInfo_v2_t` /
        // `nvmlProcessInfo_t` (the same struct); all take `(nvmlDevice_t, unsigned int *, ...)`.
        // The eight below likewise.
        compute_processes: resolve(c"nvmlDeviceGetComputeRunningProcesses")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV1>(f) }),
        // SAFETY: as above.
        compute_processes_v2: resolve(c"nvmlDeviceGetComputeRunningProcesses_v2")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        // SAFETY: as above.
        compute_processes_v3: resolve(c"nvmlDeviceGetComputeRunningProcesses_v3")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        // SAFETY: as above.
        graphics_processes: resolve(c"nvmlDeviceGetGraphicsRunningProcesses")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV1>(f) }),
        // SAFETY: as above.
        graphics_processes_v2: resolve(c"nvmlDeviceGetGraphicsRunningProcesses_v2")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        // SAFETY: as above.
        graphics_processes_v3: resolve(c"nvmlDeviceGetGraphicsRunningProcesses_v3")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        // SAFETY: as above.
        mps_processes: resolve(c"nvmlDeviceGetMPSComputeRunningProcesses")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV1>(f) }),
        // SAFETY: as above.
        mps_processes_v2: resolve(c"nvmlDeviceGetMPSComputeRunningProcesses_v2")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        // SAFETY: as above.
        mps_processes_v3: resolve(c"nvmlDeviceGetMPSComputeRunningProcesses_v3")
            .map(|f| unsafe { std::mem::transmute::<*mut c_void, FnGetProcessesV2>(f) }),
        substitutes: hooks()
            .iter()
            .filter_map(|&(name, hook)| resolve(name).map(|real| (real as usize, hook as usize)))
            .collect(),
    };
    if nvml.substitutes.iter().any(|&(real, hook)| real == hook) {
        crate::log::error(format_args!(
            "{} `{path}` is the interposer itself; point it at libnvidia-ml",
            tenant_abi::env::var::REAL_LIBNVML
        ));
        return None;
    }
    crate::log::debug(format_args!(
        "loaded {path}: {} of {} NVML hooks exported",
        nvml.substitutes.len(),
        hooks().len()
    ));
    Some(nvml)
}

/// The uuid of an NVML device and its CUDA ordinal in this process, if a tenant is configured and
/// the device maps to one.
fn ordinal_of_device(nvml: &Nvml, device: nvmlDevice_t) -> Option<(String, usize)> {
    if !crate::hooks::enabled() {
        return None;
    }
    let uuid = nvml.uuid(device)?;
    let cuda_uuids = crate::exports::visible_gpu_uuids();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = nvml::ordinal_of(&uuid, cuda_uuids.as_deref(), visible.as_deref())?;
    Some((uuid, ordinal))
}

/// The figures to report for `device` instead of `real`, if it is a limited device of this
/// tenant; `None`: report `real`.
fn slice_view(nvml: &Nvml, device: nvmlDevice_t, real: Memory) -> Option<Memory> {
    let (uuid, ordinal) = ordinal_of_device(nvml, device)?;
    let slice = crate::hooks::slice_of(ordinal, &uuid)?;
    let shown = nvml::slice_memory(real, slice);
    crate::log::debug(format_args!(
        "NVML memory of {uuid} (ordinal {ordinal}): {shown:?} instead of {real:?}"
    ));
    Some(shown)
}

/// The real NVML and one of its functions, or the NVML error that says why not.
macro_rules! real_nvml_fn {
    ($field:ident) => {{
        let Some(nvml) = nvml() else {
            return NVML_ERROR_LIBRARY_NOT_FOUND;
        };
        let Some(function) = nvml.$field else {
            return NVML_ERROR_FUNCTION_NOT_FOUND;
        };
        (nvml, function)
    }};
}

/// Reports the slice of a limited device: total = the limit, used = the tenant's usage, free =
/// the rest (at most what the GPU has free).
///
/// # Safety
/// NVML's contract for `nvmlDeviceGetMemoryInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    ffi_boundary!("nvmlDeviceGetMemoryInfo", fallback = NVML_ERROR_UNKNOWN, {
        let (nvml, real) = real_nvml_fn!(get_memory_info);
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(device, memory) };
        if rc != NVML_SUCCESS || memory.is_null() {
            return rc;
        }
        // SAFETY: non-null, and NVML filled it in on success.
        let seen = unsafe { memory.read() };
        let real_figures = Memory {
            total: seen.total,
            free: seen.free,
            used: seen.used,
        };
        let shown = ffi_boundary!("nvmlDeviceGetMemoryInfo", fallback = None, {
            slice_view(nvml, device, real_figures)
        });
        if let Some(shown) = shown {
            // SAFETY: non-null and valid for writes (NVML just wrote it).
            unsafe {
                memory.write(nvmlMemory_t {
                    total: shown.total,
                    free: shown.free,
                    used: shown.used,
                });
            }
        }
        rc
    })
}

/// As `nvmlDeviceGetMemoryInfo`, for the `nvmlMemory_v2` layout only (another version is passed
/// through as NVML answers it); `reserved` is 0 in the slice (the context overheads are in
/// `used`), so total = reserved + used + free as NVML documents.
///
/// # Safety
/// NVML's contract for `nvmlDeviceGetMemoryInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    ffi_boundary!(
        "nvmlDeviceGetMemoryInfo_v2",
        fallback = NVML_ERROR_UNKNOWN,
        {
            let (nvml, real) = real_nvml_fn!(get_memory_info_v2);
            // The version is the caller's input: read it before NVML can touch the struct. Only the
            // first 4 bytes are read, which every version of the struct has.
            // SAFETY: the caller passes a struct that starts with its `unsigned int version`, or null.
            let version = (!memory.is_null()).then(|| unsafe { memory.cast::<c_uint>().read() });
            // SAFETY: forwarded unchanged under the caller's contract.
            let rc = unsafe { real(device, memory) };
            if rc != NVML_SUCCESS || version != Some(NVML_MEMORY_V2) {
                return rc;
            }
            // SAFETY: non-null, of the v2 layout (checked version), and filled in by NVML.
            let seen = unsafe { memory.read() };
            let real_figures = Memory {
                total: seen.total,
                free: seen.free,
                used: seen.used.saturating_add(seen.reserved),
            };
            let shown = ffi_boundary!("nvmlDeviceGetMemoryInfo_v2", fallback = None, {
                slice_view(nvml, device, real_figures)
            });
            if let Some(shown) = shown {
                // SAFETY: non-null, of the v2 layout, valid for writes (NVML just wrote it).
                unsafe {
                    memory.write(nvmlMemory_v2_t {
                        version: seen.version,
                        total: shown.total,
                        reserved: 0,
                        free: shown.free,
                        used: shown.used,
                    });
                }
            }
            rc
        }
    )
}

/// What a process-list hook answers with, decided before anything is written to the caller.
enum ProcessList<T> {
    /// Not a limited device of this tenant, or the list could not be read whole: NVML answers
    /// the caller's own call.
    PassThrough,
    /// NVML refused our read of the list: its error, unchanged.
    Failed(nvmlReturn_t),
    /// The tenant's own entries, in NVML's order.
    Own(Vec<T>),
}

/// The tenant's entries of `device`'s list, if it is a limited device of this tenant.
fn own_process_list<T: ProcessInfo>(
    what: &str,
    nvml: &Nvml,
    real: FnGetProcesses<T>,
    device: nvmlDevice_t,
) -> ProcessList<T> {
    let Some((uuid, ordinal)) = ordinal_of_device(nvml, device) else {
        return ProcessList::PassThrough;
    };
    let Some(tenant_pids) = crate::hooks::tenant_pids(ordinal) else {
        return ProcessList::PassThrough;
    };
    let entries = match read_process_list(real, device) {
        Ok(entries) => entries,
        Err(Some(rc)) => return ProcessList::Failed(rc),
        Err(None) => {
            crate::log::error(format_args!(
                "{what}: the process list of {uuid} did not fit in {} entries after {} reads; \
                 NVML's own answer is passed through",
                nvml::PROCESS_ENTRIES_MAX,
                nvml::PROCESS_LIST_READS_MAX
            ));
            return ProcessList::PassThrough;
        }
    };
    let kept = nvml::own_processes(&entries, ProcessInfo::pid, &tenant_pids);
    crate::log::debug(format_args!(
        "{what} of {uuid} (ordinal {ordinal}): {} of {} processes are the tenant's",
        kept.len(),
        entries.len()
    ));
    ProcessList::Own(kept)
}

/// The whole process list of `device`, read into a buffer of our own that grows (bounded) while
/// NVML says it is too small. `Err(Some(rc))`: NVML's error; `Err(None)`: still too small at the
/// bound.
fn read_process_list<T: ProcessInfo>(
    real: FnGetProcesses<T>,
    device: nvmlDevice_t,
) -> Result<Vec<T>, Option<nvmlReturn_t>> {
    let mut capacity = nvml::PROCESS_ENTRIES_START;
    for _ in 0..nvml::PROCESS_LIST_READS_MAX {
        let mut entries = vec![T::default(); capacity];
        let mut count = c_uint::try_from(capacity).expect("the bound fits in an unsigned int");
        // SAFETY: `count` is a valid `unsigned int`, and `entries` has room for exactly `count`
        // entries of the layout this function takes (`T` is the one `real` was resolved with).
        let rc = unsafe { real(device, &mut count, entries.as_mut_ptr()) };
        match rc {
            NVML_SUCCESS => {
                let count = usize::try_from(count).expect("a u32 fits in usize");
                assert!(count <= capacity, "NVML wrote past the room it was given");
                entries.truncate(count);
                return Ok(entries);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => match nvml::next_capacity(capacity, count) {
                Some(next) => capacity = next,
                None => return Err(None),
            },
            error => return Err(Some(error)),
        }
    }
    Err(None)
}

/// A process-list hook: for a limited device of this tenant, the tenant's entries answered by
/// NVML's convention; otherwise (and after a panic in the policy) NVML's own answer.
///
/// # Safety
/// NVML's contract for the process-list queries: `info_count` is null or valid for reads and
/// writes, and `infos` is null or valid for writes of `*info_count` entries of `T`; `real` is
/// the real NVML function of the same name, resolved with `T`.
unsafe fn process_list_hook<T: ProcessInfo>(
    what: &str,
    nvml: &Nvml,
    real: FnGetProcesses<T>,
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut T,
) -> nvmlReturn_t {
    if info_count.is_null() {
        // SAFETY: forwarded unchanged under the caller's contract (NVML refuses it).
        return unsafe { real(device, info_count, infos) };
    }
    // SAFETY: non-null, and the caller's contract makes it valid for reads.
    let room = (!infos.is_null()).then(|| unsafe { info_count.read() });
    let list = ffi_boundary!(what, fallback = ProcessList::PassThrough, {
        own_process_list(what, nvml, real, device)
    });
    let kept = match list {
        // SAFETY: forwarded unchanged under the caller's contract.
        ProcessList::PassThrough => return unsafe { real(device, info_count, infos) },
        ProcessList::Failed(rc) => return rc,
        ProcessList::Own(kept) => kept,
    };
    match nvml::list_answer(kept.len(), room) {
        nvml::ListAnswer::Filled { count } => {
            assert_eq!(usize::try_from(count).ok(), Some(kept.len()));
            if count > 0 {
                assert!(!infos.is_null(), "entries are written only into a buffer");
                // SAFETY: `count` entries fit: `list_answer` fills only when `count` ≤ `room`,
                // the caller's `*info_count` for its non-null `infos`; `kept` holds `count`
                // entries, and our buffer cannot overlap the caller's.
                unsafe { std::ptr::copy_nonoverlapping(kept.as_ptr(), infos, kept.len()) };
            }
            // SAFETY: non-null and valid for writes (the caller's contract).
            unsafe { info_count.write(count) };
            NVML_SUCCESS
        }
        nvml::ListAnswer::TooSmall { needed } => {
            // SAFETY: non-null and valid for writes (the caller's contract).
            unsafe { info_count.write(needed) };
            NVML_ERROR_INSUFFICIENT_SIZE
        }
    }
}

/// Exports one process-list hook under NVML's name, with the entry layout nvml.h gives it.
macro_rules! process_list_export {
    ($name:ident, $field:ident, $entry:ty) => {
        /// NVML's process list of `device`; for a limited device of this tenant, only its own
        /// processes (`process_list_hook`).
        ///
        /// # Safety
        /// NVML's contract for this function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            infoCount: *mut c_uint,
            infos: *mut $entry,
        ) -> nvmlReturn_t {
            ffi_boundary!(stringify!($name), fallback = NVML_ERROR_UNKNOWN, {
                let (nvml, real) = real_nvml_fn!($field);
                // SAFETY: the caller's arguments under NVML's contract for this function, and
                // its real counterpart, resolved with the same entry layout.
                unsafe {
                    process_list_hook(stringify!($name), nvml, real, device, infoCount, infos)
                }
            })
        }
    };
}

process_list_export!(
    nvmlDeviceGetComputeRunningProcesses,
    compute_processes,
    nvmlProcessInfo_v1_t
);
process_list_export!(
    nvmlDeviceGetComputeRunningProcesses_v2,
    compute_processes_v2,
    nvmlProcessInfo_v2_t
);
process_list_export!(
    nvmlDeviceGetComputeRunningProcesses_v3,
    compute_processes_v3,
    nvmlProcessInfo_v2_t
);
process_list_export!(
    nvmlDeviceGetGraphicsRunningProcesses,
    graphics_processes,
    nvmlProcessInfo_v1_t
);
process_list_export!(
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    graphics_processes_v2,
    nvmlProcessInfo_v2_t
);
process_list_export!(
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    graphics_processes_v3,
    nvmlProcessInfo_v2_t
);
process_list_export!(
    nvmlDeviceGetMPSComputeRunningProcesses,
    mps_processes,
    nvmlProcessInfo_v1_t
);
process_list_export!(
    nvmlDeviceGetMPSComputeRunningProcesses_v2,
    mps_processes_v2,
    nvmlProcessInfo_v2_t
);
process_list_export!(
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    mps_processes_v3,
    nvmlProcessInfo_v2_t
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nvml_hook_is_found_by_name() {
        for (name, hook) in hooks() {
            assert_eq!(hook_by_name(name), Some(hook));
        }
        assert_eq!(hook_by_name(c"nvmlDeviceGetBAR1MemoryInfo"), None);
        assert_eq!(
            hook_by_name(c"nvmlDeviceGetComputeRunningProcesses_v4"),
            None
        );
        assert_eq!(NVML_MEMORY_V2, 0x0200_0028);
    }
}
