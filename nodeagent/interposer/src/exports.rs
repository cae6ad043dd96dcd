//! The driver functions this library exports under their real names. Each one forwards to the
//! real driver (`real`) around the policy in `hooks`, inside `ffi_boundary!`.
//!
//! Shape of an allocation hook: `admit` (may refuse with `CUDA_ERROR_OUT_OF_MEMORY` before the
//! driver is called) → real call → `commit` or `abort`. A panic in `admit` lets the call through
//! untracked (fail open); a panic after the real call keeps the driver's result. Frees take the
//! allocation out of the tracker first, then credit it only if the driver freed it.
//!
//! Shape of a launch hook: `launch::before` (may wait for the tenant's turn on the GPU) → real
//! call → `launch::after` for the sampled launches that record an event. A panic in either lets
//! the launch through ungated (fail open).
//!
//! Which device an allocation belongs to: the current context's (`cuCtxGetDevice`), except
//! `cuMemCreate`, whose properties name it. Stream-ordered allocations go to the stream's device,
//! which is the current one in every framework we know of; a stream of another device would be
//! charged to the current device (documented limitation).
#![allow(unsafe_code, non_snake_case)]

use crate::elastic::Borrow;
use crate::hooks::{self, Admission};
use crate::launch::{self, EventState, Gpu, StreamRef};
use crate::real::{self, Driver};
use crate::spatial;
use crate::sys::*;
use crate::tracker::{Key, array_bytes};
use crate::vmm;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};

/// Every hook, by the driver symbol it replaces.
pub fn hooks() -> [(&'static CStr, *const c_void); 137] {
    macro_rules! table {
        ($($name:ident),* $(,)?) => {
            [$((
                // `stringify!` of an identifier has no interior NUL byte.
                match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                    Ok(name) => name,
                    Err(_) => unreachable!(),
                },
                $name as *const c_void,
            )),*]
        };
    }
    table![
        cuMemAlloc_v2,
        cuMemAllocPitch_v2,
        cuMemAllocManaged,
        cuMemFree_v2,
        cuMemCreate,
        cuMemRelease,
        cuMemAllocAsync,
        cuMemAllocAsync_ptsz,
        cuMemAllocFromPoolAsync,
        cuMemAllocFromPoolAsync_ptsz,
        cuMemFreeAsync,
        cuMemFreeAsync_ptsz,
        cuArrayCreate_v2,
        cuArray3DCreate_v2,
        cuArrayDestroy,
        cuMemGetInfo_v2,
        cuDeviceTotalMem_v2,
        cuIpcGetMemHandle,
        cuDevicePrimaryCtxRetain,
        cuGetProcAddress,
        cuGetProcAddress_v2,
        cuLaunchKernel,
        cuLaunchKernel_ptsz,
        cuLaunchKernelEx,
        cuLaunchKernelEx_ptsz,
        cuLaunchCooperativeKernel,
        cuLaunchCooperativeKernel_ptsz,
        cuLaunchCooperativeKernelMultiDevice,
        cuGraphLaunch,
        cuGraphLaunch_ptsz,
        cuStreamBeginCapture,
        cuStreamBeginCapture_ptsz,
        cuStreamBeginCapture_v2,
        cuStreamBeginCapture_v2_ptsz,
        cuStreamEndCapture,
        cuStreamEndCapture_ptsz,
        cuStreamSynchronize,
        cuStreamSynchronize_ptsz,
        cuStreamQuery,
        cuStreamQuery_ptsz,
        cuEventSynchronize,
        cuEventQuery,
        cuCtxSynchronize,
        cuCtxSynchronize_v2,
        cuMemcpyAsync,
        cuMemcpyAsync_ptsz,
        cuMemcpyDtoDAsync_v2,
        cuMemcpyDtoDAsync_v2_ptsz,
        cuMemcpyHtoDAsync_v2,
        cuMemcpyHtoDAsync_v2_ptsz,
        cuMemcpyDtoHAsync_v2,
        cuMemcpyDtoHAsync_v2_ptsz,
        cuMemcpyHtoD_v2,
        cuMemcpyDtoH_v2,
        cuMemcpy,
        cuMemcpy_ptds,
        cuMemcpyPeer,
        cuMemcpyPeer_ptds,
        cuMemcpyHtoD_v2_ptds,
        cuMemcpyDtoH_v2_ptds,
        cuMemcpyDtoD_v2,
        cuMemcpyDtoD_v2_ptds,
        cuMemcpyDtoA_v2,
        cuMemcpyDtoA_v2_ptds,
        cuMemcpyAtoD_v2,
        cuMemcpyAtoD_v2_ptds,
        cuMemcpy2D_v2,
        cuMemcpy2D_v2_ptds,
        cuMemcpy2DUnaligned_v2,
        cuMemcpy2DUnaligned_v2_ptds,
        cuMemcpy3D_v2,
        cuMemcpy3D_v2_ptds,
        cuMemcpy3DPeer,
        cuMemcpy3DPeer_ptds,
        cuMemcpyPeerAsync,
        cuMemcpyPeerAsync_ptsz,
        cuMemcpy2DAsync_v2,
        cuMemcpy2DAsync_v2_ptsz,
        cuMemcpy3DAsync_v2,
        cuMemcpy3DAsync_v2_ptsz,
        cuMemcpy3DPeerAsync,
        cuMemcpy3DPeerAsync_ptsz,
        cuMemcpyBatchAsync,
        cuMemcpyBatchAsync_ptsz,
        cuMemcpyBatchAsync_v2,
        cuMemcpyBatchAsync_v2_ptsz,
        cuMemcpy3DBatchAsync,
        cuMemcpy3DBatchAsync_ptsz,
        cuMemcpy3DBatchAsync_v2,
        cuMemcpy3DBatchAsync_v2_ptsz,
        cuMemsetD8_v2,
        cuMemsetD8_v2_ptds,
        cuMemsetD2D8_v2,
        cuMemsetD2D8_v2_ptds,
        cuMemsetD8Async,
        cuMemsetD8Async_ptsz,
        cuMemsetD2D8Async,
        cuMemsetD2D8Async_ptsz,
        cuMemsetD16_v2,
        cuMemsetD16_v2_ptds,
        cuMemsetD2D16_v2,
        cuMemsetD2D16_v2_ptds,
        cuMemsetD16Async,
        cuMemsetD16Async_ptsz,
        cuMemsetD2D16Async,
        cuMemsetD2D16Async_ptsz,
        cuMemsetD32_v2,
        cuMemsetD32_v2_ptds,
        cuMemsetD2D32_v2,
        cuMemsetD2D32_v2_ptds,
        cuMemsetD32Async,
        cuMemsetD32Async_ptsz,
        cuMemsetD2D32Async,
        cuMemsetD2D32Async_ptsz,
        cuStreamWriteValue32,
        cuStreamWriteValue32_ptsz,
        cuStreamWriteValue32_v2,
        cuStreamWriteValue32_v2_ptsz,
        cuStreamWriteValue64,
        cuStreamWriteValue64_ptsz,
        cuStreamWriteValue64_v2,
        cuStreamWriteValue64_v2_ptsz,
        cuStreamWaitValue32,
        cuStreamWaitValue32_ptsz,
        cuStreamWaitValue32_v2,
        cuStreamWaitValue32_v2_ptsz,
        cuStreamWaitValue64,
        cuStreamWaitValue64_ptsz,
        cuStreamWaitValue64_v2,
        cuStreamWaitValue64_v2_ptsz,
        cuStreamBatchMemOp,
        cuStreamBatchMemOp_ptsz,
        cuStreamBatchMemOp_v2,
        cuStreamBatchMemOp_v2_ptsz,
        cuLaunch,
        cuLaunchGrid,
        cuLaunchGridAsync,
    ]
}

/// Our hook for a driver symbol name, if we have one.
pub fn hook_by_name(name: &CStr) -> Option<*const c_void> {
    hooks()
        .into_iter()
        .find(|(hooked, _)| *hooked == name)
        .map(|(_, hook)| hook)
}

/// The hook for a `cuGetProcAddress` base name ("cuMemAlloc") on CUDA 12+, where every hooked
/// entry point resolves to its newest version (`_v2`), or `_ptsz` with per-thread default
/// streams. Used only when the driver's answer is not an address we know.
pub(crate) fn hook_by_base_name(base: &CStr, flags: cuuint64_t) -> Option<*const c_void> {
    let base = base.to_str().ok()?;
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    // `_v2_ptsz` first: "cuStreamBeginCapture" per-thread is `cuStreamBeginCapture_v2_ptsz`, and
    // `cuStreamBeginCapture_ptsz` is the older signature.
    // Synchronous copies and memsets name their per-thread variant `_ptds`.
    let candidates = [
        per_thread.then(|| format!("{base}_v2_ptsz")),
        per_thread.then(|| format!("{base}_ptsz")),
        per_thread.then(|| format!("{base}_v2_ptds")),
        per_thread.then(|| format!("{base}_ptds")),
        Some(format!("{base}_v2")),
        Some(base.to_owned()),
    ];
    candidates.into_iter().flatten().find_map(|name| {
        let name = std::ffi::CString::new(name).ok()?;
        hook_by_name(&name)
    })
}

/// The real driver and one of its functions, or the CUDA error that says why not.
macro_rules! real_fn {
    ($field:ident) => {{
        let Some(driver) = real::driver() else {
            return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
        };
        let Some(function) = driver.fns.$field else {
            return CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND;
        };
        (driver, function)
    }};
}

/// The current context's device, if there is one.
fn current_device(driver: &Driver) -> Option<CUdevice> {
    let get = driver.fns.ctx_get_device?;
    let mut device: CUdevice = -1;
    // SAFETY: `device` is a valid out-pointer for cuCtxGetDevice.
    let rc = unsafe { get(&mut device) };
    (rc == CUDA_SUCCESS).then_some(device)
}

/// Reads an out-parameter the driver wrote on success.
///
/// # Safety
/// `pointer` is null or valid for reads of `T`.
unsafe fn read<T: Copy>(pointer: *const T) -> Option<T> {
    // SAFETY: non-null, and valid for reads by the caller's contract.
    (!pointer.is_null()).then(|| unsafe { pointer.read() })
}

/// The devices an allocation or query is for, from the driver.
struct DriverDevices<'d> {
    driver: &'d Driver,
    /// `None`: the current context's device; `Some`: the one the call names (`Some(None)`: none,
    /// as for `cuMemCreate` of host memory).
    named: Option<Option<CUdevice>>,
}

impl<'d> DriverDevices<'d> {
    fn current(driver: &'d Driver) -> Self {
        DriverDevices {
            driver,
            named: None,
        }
    }

    fn named(driver: &'d Driver, device: Option<CUdevice>) -> Self {
        DriverDevices {
            driver,
            named: Some(device),
        }
    }
}

impl<'d> hooks::Devices for DriverDevices<'d> {
    fn current(&self) -> Option<i32> {
        match self.named {
            Some(named) => named,
            None => current_device(self.driver),
        }
    }

    fn uuid(&self, ordinal: usize) -> Option<String> {
        let uuid = RealGpu(self.driver).uuid(i32::try_from(ordinal).ok()?)?;
        Some(launch::uuid_text(&uuid))
    }

    type Backing = vmm::SwapBacking<'d>;
    fn backing(&self) -> Option<vmm::SwapBacking<'d>> {
        Some(vmm::SwapBacking {
            driver: self.driver,
        })
    }

    fn context(&self) -> usize {
        RealGpu(self.driver).current_context()
    }

    fn make_current(&self, context: usize) -> bool {
        let Some(set_current) = self.driver.fns.ctx_set_current else {
            return false;
        };
        // SAFETY: `context` is a context this process created allocations in; making it current
        // on the calling thread is the driver's call for that, with no pointer arguments.
        unsafe { set_current(context as CUcontext) == CUDA_SUCCESS }
    }

    fn drain(&self, contexts: &[usize]) -> bool {
        let contexts = if contexts.is_empty() {
            vec![self.context()]
        } else {
            contexts.to_vec()
        };
        vmm::drain(contexts)
    }
}

/// The hold rule before a launch or copy reaches the driver (`hooks::enter_work`): `Ok` with the
/// guard to keep until the driver call returned, `Err` with the result to answer instead (a chunk
/// is still in host memory; a panic in the policy refuses too, since letting the call through
/// could touch an unmapped chunk). One relaxed load in a process without swappable chunks.
fn enter_work(what: &'static str, driver: &Driver) -> Result<crate::swap::InFlight, CUresult> {
    if !crate::swap::any_chunk() {
        return Ok(crate::swap::InFlight::uncounted());
    }
    ffi_boundary!(what, fallback = Err(CUDA_ERROR_UNKNOWN), {
        hooks::enter_work(&DriverDevices::current(driver), what).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
    })
}

/// Runs an allocation through `admit` → `call` → `commit`/`abort`; `call` is told whether the
/// allocation is borrowed (past the tenant's request: it must then be VMM-backed, if `borrow`
/// allowed it), and `allocated` names the result and its real size after a successful call.
fn accounted_alloc(
    what: &'static str,
    devices: &DriverDevices<'_>,
    bytes: u64,
    borrow: Borrow<'_>,
    mut call: impl FnMut(bool) -> CUresult,
    allocated: impl FnOnce() -> Option<(Key, u64)>,
) -> CUresult {
    let admission = ffi_boundary!(what, fallback = Admission::Untracked, {
        hooks::admit(devices, bytes, borrow)
    });
    let ticket = match admission {
        Admission::Refused => return CUDA_ERROR_OUT_OF_MEMORY,
        Admission::Untracked => return call(false),
        Admission::Charged(ticket) => ticket,
    };
    let mut rc = call(ticket.borrowed());
    if rc == CUDA_ERROR_OUT_OF_MEMORY {
        // Within the request, the driver short of memory that the board counts free: the
        // borrowers give it back (`hooks::ask_borrowers_for_driver`), for a bounded while.
        let asks = ffi_boundary!(what, fallback = Vec::new(), {
            hooks::ask_borrowers_for_driver(&ticket)
        });
        if !asks.is_empty() {
            let began = std::time::Instant::now();
            let bound = std::time::Duration::from_millis(crate::elastic::RECLAIM_WAIT_MAX_MS);
            rc = retry_out_of_memory(rc, bound, || call(false));
            ffi_boundary!(what, fallback = (), {
                hooks::withdraw_driver_asks(&ticket, &asks);
                crate::log::error(format_args!(
                    "{what}: {} after {} ms",
                    if rc == CUDA_SUCCESS {
                        "the driver had the memory"
                    } else {
                        "the driver still had no memory; refused (out of memory)"
                    },
                    began.elapsed().as_millis()
                ));
            });
        }
    }
    ffi_boundary!(what, fallback = (), {
        match allocated().filter(|_| rc == CUDA_SUCCESS) {
            Some((key, real_bytes)) => {
                hooks::commit(ticket, key, real_bytes, hooks::Devices::context(devices))
            }
            None => hooks::abort(ticket),
        }
    });
    rc
}

/// `rc` of a first try, and then `call` again every millisecond while it answers out of memory,
/// for at most `bound` from now: memory the board counts free that the driver has not (yet).
fn retry_out_of_memory(
    mut rc: CUresult,
    bound: std::time::Duration,
    mut call: impl FnMut() -> CUresult,
) -> CUresult {
    let began = std::time::Instant::now();
    while rc == CUDA_ERROR_OUT_OF_MEMORY && began.elapsed() < bound {
        std::thread::sleep(std::time::Duration::from_millis(1));
        rc = call();
    }
    rc
}

/// A borrowed allocation of `bytes`, VMM-backed on the current device; a driver that cannot back
/// it refuses it (`vmm` said why, once).
///
/// # Safety
/// `out` is valid for a write of one `CUdeviceptr`.
unsafe fn borrowed_alloc(driver: &Driver, bytes: usize, out: *mut CUdeviceptr) -> CUresult {
    let try_once = || {
        current_device(driver)
            // SAFETY: `out` is valid for a write under the caller's contract.
            .and_then(|device| unsafe {
                vmm::alloc(driver, device, bytes, out, vmm::Purpose::Borrowed)
            })
            .unwrap_or(CUDA_ERROR_OUT_OF_MEMORY)
    };
    // The board granted it, but the driver may not have released yet what a process that just
    // exited held (the board counts it free as soon as the process is gone): tried again for a
    // bounded while before the out-of-memory reaches the application.
    let began = std::time::Instant::now();
    let rc = retry_out_of_memory(try_once(), crate::swap::DRIVER_LAG_MAX, try_once);
    if rc == CUDA_SUCCESS && began.elapsed() >= std::time::Duration::from_millis(10) {
        crate::log::error(format_args!(
            "a borrow of {} waited {} ms for the driver to release memory the GPU's board \
             already counted free (a process that exited)",
            crate::elastic::human(bytes as u64),
            began.elapsed().as_millis()
        ));
    }
    if rc == CUDA_SUCCESS && hooks::swap_enabled() {
        start_watcher();
    }
    rc
}

/// How often the swap's watcher looks at the board.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// Starts this process's swap watcher once (again in a child after `fork`, which has no threads
/// but the forking one): a thread that looks every `WATCH_EVERY` whether other tenants want
/// memory back from this process while it makes no hook call (an idle borrower, whose memory is
/// the first a reclaim wants, or one computing on the CPU), and acts on it as the process's own
/// next call would (`hooks::watch_once`). A panic in a look is caught and said once; the
/// process never sees it.
fn start_watcher() {
    static STARTED_BY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let pid = std::process::id();
    if STARTED_BY.swap(pid, std::sync::atomic::Ordering::SeqCst) == pid {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("vgpu-swap-watch".to_owned())
        .spawn(|| {
            let mut said = false;
            loop {
                std::thread::sleep(WATCH_EVERY);
                let Some(driver) = real::driver() else {
                    continue;
                };
                let looked = std::panic::catch_unwind(|| {
                    hooks::watch_once(&DriverDevices::current(driver));
                });
                if looked.is_err() && !said {
                    said = true;
                    crate::log::error(format_args!(
                        "the swap's watcher failed; wants on this process are acted on at its \
                         next allocation, launch or copy only"
                    ));
                }
            }
        });
    if spawned.is_err() {
        crate::log::error(format_args!(
            "could not start the swap's watcher thread; wants on this process are acted on at \
             its next allocation, launch or copy only"
        ));
    }
}

/// What a VMM-backed allocation of `bytes` on the current device takes, if the driver can back
/// one.
fn vmm_rounded(driver: &Driver, bytes: u64) -> Option<u64> {
    let device = current_device(driver)?;
    let rounded = vmm::rounded(driver, device, usize::try_from(bytes).ok()?)?;
    u64::try_from(rounded).ok()
}

/// Runs a free: forget `key`, `call`, then credit (or restore if the driver refused).
fn accounted_free(what: &'static str, key: Key, call: impl FnOnce() -> CUresult) -> CUresult {
    let charge = ffi_boundary!(what, fallback = None, { hooks::forget(key) });
    let rc = call();
    if let Some(charge) = charge {
        ffi_boundary!(what, fallback = (), {
            if rc == CUDA_SUCCESS {
                hooks::credit(key, charge);
            } else {
                hooks::restore(key, charge);
            }
        });
    }
    rc
}

/// # Safety
/// The driver's contract for `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    ffi_boundary!("cuMemAlloc_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc);
        let rounded = || vmm_rounded(driver, bytesize as u64);
        accounted_alloc(
            "cuMemAlloc_v2",
            &DriverDevices::current(driver),
            bytesize as u64,
            Borrow::Backed(&rounded),
            |borrowed| {
                if borrowed {
                    // SAFETY: `dptr` is valid for a write under the caller's contract.
                    return unsafe { borrowed_alloc(driver, bytesize, dptr) };
                }
                // `VGPU_MEMORY_VMM=1`: backed by VMM where it can be (`vmm`).
                let backed = if vmm::enabled() {
                    current_device(driver).and_then(|device| {
                        // SAFETY: `dptr` is valid for a write under the caller's contract.
                        unsafe {
                            vmm::alloc(driver, device, bytesize, dptr, vmm::Purpose::Everything)
                        }
                    })
                } else {
                    None
                };
                // SAFETY: forwarded unchanged under the caller's contract.
                backed.unwrap_or_else(|| unsafe { real(dptr, bytesize) })
            },
            || {
                // SAFETY: the driver (or `vmm::alloc`) wrote `*dptr` on success.
                unsafe { read(dptr) }.map(|p| {
                    let size = vmm::size_of(p).unwrap_or(bytesize as u64);
                    (Key::Pointer(p), size)
                })
            },
        )
    })
}

/// Pitched allocations: reserved as `roundup(width, 512) × height` before the call (the pitch
/// is the driver's choice), then corrected to `pitch × height`.
///
/// # Safety
/// The driver's contract for `cuMemAllocPitch_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_bytes: usize,
    height: usize,
    element_size_bytes: c_uint,
) -> CUresult {
    ffi_boundary!("cuMemAllocPitch_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc_pitch);
        let estimate = (width_bytes as u64)
            .div_ceil(512)
            .saturating_mul(512)
            .saturating_mul(height as u64);
        let rounded = || vmm_rounded(driver, estimate);
        accounted_alloc(
            "cuMemAllocPitch_v2",
            &DriverDevices::current(driver),
            estimate,
            Borrow::Backed(&rounded),
            |borrowed| {
                if !borrowed {
                    // SAFETY: forwarded unchanged under the caller's contract.
                    return unsafe { real(dptr, pitch, width_bytes, height, element_size_bytes) };
                }
                // Borrowed: VMM-backed rows of the pitch the estimate assumed (512-byte aligned,
                // what the driver chooses on the GPUs we know), checked as the driver checks.
                if pitch.is_null() || !matches!(element_size_bytes, 4 | 8 | 16) {
                    return CUDA_ERROR_INVALID_VALUE;
                }
                let Ok(bytes) = usize::try_from(estimate) else {
                    return CUDA_ERROR_OUT_OF_MEMORY;
                };
                // SAFETY: `dptr` is valid for a write under the caller's contract.
                let rc = unsafe { borrowed_alloc(driver, bytes, dptr) };
                if rc == CUDA_SUCCESS {
                    // SAFETY: checked non-null above; valid for a write by the caller's contract.
                    unsafe { pitch.write(width_bytes.div_ceil(512).saturating_mul(512)) };
                }
                rc
            },
            || {
                // SAFETY: the driver (or the borrowed path) wrote `*dptr` and `*pitch` on success.
                let (p, pitch) = unsafe { (read(dptr)?, read(pitch)?) };
                let size =
                    vmm::size_of(p).unwrap_or_else(|| (pitch as u64).saturating_mul(height as u64));
                Some((Key::Pointer(p), size))
            },
        )
    })
}

/// Managed memory counts against device memory in full (it can migrate there entirely).
///
/// # Safety
/// The driver's contract for `cuMemAllocManaged`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    ffi_boundary!("cuMemAllocManaged", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc_managed);
        accounted_alloc(
            "cuMemAllocManaged",
            &DriverDevices::current(driver),
            bytesize as u64,
            Borrow::Never("cuMemAllocManaged (managed memory)"),
            // SAFETY: forwarded unchanged under the caller's contract.
            |_| unsafe { real(dptr, bytesize, flags) },
            // SAFETY: the driver wrote `*dptr` on success.
            || unsafe { read(dptr) }.map(|p| (Key::Pointer(p), bytesize as u64)),
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    ffi_boundary!("cuMemFree_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_free);
        accounted_free("cuMemFree_v2", Key::Pointer(dptr), || {
            // SAFETY: forwarded unchanged under the caller's contract.
            vmm::free(driver, dptr).unwrap_or_else(|| unsafe { real(dptr) })
        })
    })
}

/// VMM physical memory: charged per handle when it lives on a device; mapping it (`cuMemMap`)
/// takes no further memory, so mappings are not charged.
///
/// # Safety
/// The driver's contract for `cuMemCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    ffi_boundary!("cuMemCreate", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_create);
        // SAFETY: the caller passes a valid property struct or null (which the driver rejects).
        let location = unsafe { prop.as_ref() }.map(|p| (p.location.type_, p.location.id));
        let device = match location {
            Some((CU_MEM_LOCATION_TYPE_DEVICE, id)) => Some(id),
            _ => None,
        };
        // Past the request: allowed and counted as borrowed, never swapped (the application maps
        // the handle itself). Not on a device: not charged.
        accounted_alloc(
            "cuMemCreate",
            &DriverDevices::named(driver, device),
            size as u64,
            Borrow::Counted,
            // SAFETY: forwarded unchanged under the caller's contract.
            |_| unsafe { real(handle, size, prop, flags) },
            // SAFETY: the driver wrote `*handle` on success.
            || unsafe { read(handle) }.map(|h| (Key::Handle(h), size as u64)),
        )
    })
}

/// Credited at release. The driver frees the memory once the handle is released and every
/// mapping of it is unmapped, so usage is briefly under-counted when a mapping outlives it.
///
/// # Safety
/// The driver's contract for `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    ffi_boundary!("cuMemRelease", fallback = CUDA_ERROR_UNKNOWN, {
        let (_, real) = real_fn!(mem_release);
        // SAFETY: forwarded unchanged under the caller's contract.
        accounted_free("cuMemRelease", Key::Handle(handle), || unsafe {
            real(handle)
        })
    })
}

/// Shared body of the stream-ordered allocations: the requested size is charged at allocation
/// and credited at free. Memory the pool keeps reserved after a free is not charged.
fn alloc_async(
    what: &'static str,
    driver: &Driver,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    mut call: impl FnMut() -> CUresult,
) -> CUresult {
    accounted_alloc(
        what,
        &DriverDevices::current(driver),
        bytesize as u64,
        Borrow::Never("the stream-ordered allocator (cuMemAllocAsync, cudaMallocAsync)"),
        |_| call(),
        // SAFETY: the driver wrote `*dptr` on success.
        || unsafe { read(dptr) }.map(|p| (Key::Pointer(p), bytesize as u64)),
    )
}

/// # Safety
/// The driver's contract for `cuMemAllocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    ffi_boundary!("cuMemAllocAsync", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc_async);
        // SAFETY: forwarded unchanged under the caller's contract.
        alloc_async("cuMemAllocAsync", driver, dptr, bytesize, || unsafe {
            real(dptr, bytesize, stream)
        })
    })
}

/// # Safety
/// The driver's contract for `cuMemAllocAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    ffi_boundary!("cuMemAllocAsync_ptsz", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc_async_ptsz);
        // SAFETY: forwarded unchanged under the caller's contract.
        alloc_async("cuMemAllocAsync_ptsz", driver, dptr, bytesize, || unsafe {
            real(dptr, bytesize, stream)
        })
    })
}

/// # Safety
/// The driver's contract for `cuMemAllocFromPoolAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    ffi_boundary!("cuMemAllocFromPoolAsync", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_alloc_from_pool_async);
        // SAFETY: forwarded unchanged under the caller's contract.
        alloc_async(
            "cuMemAllocFromPoolAsync",
            driver,
            dptr,
            bytesize,
            || unsafe { real(dptr, bytesize, pool, stream) },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemAllocFromPoolAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    ffi_boundary!(
        "cuMemAllocFromPoolAsync_ptsz",
        fallback = CUDA_ERROR_UNKNOWN,
        {
            let (driver, real) = real_fn!(mem_alloc_from_pool_async_ptsz);
            // SAFETY: forwarded unchanged under the caller's contract.
            alloc_async(
                "cuMemAllocFromPoolAsync_ptsz",
                driver,
                dptr,
                bytesize,
                || unsafe { real(dptr, bytesize, pool, stream) },
            )
        }
    )
}

/// # Safety
/// The driver's contract for `cuMemFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    ffi_boundary!("cuMemFreeAsync", fallback = CUDA_ERROR_UNKNOWN, {
        let (_, real) = real_fn!(mem_free_async);
        // SAFETY: forwarded unchanged under the caller's contract.
        accounted_free("cuMemFreeAsync", Key::Pointer(dptr), || unsafe {
            real(dptr, stream)
        })
    })
}

/// # Safety
/// The driver's contract for `cuMemFreeAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    ffi_boundary!("cuMemFreeAsync_ptsz", fallback = CUDA_ERROR_UNKNOWN, {
        let (_, real) = real_fn!(mem_free_async_ptsz);
        // SAFETY: forwarded unchanged under the caller's contract.
        accounted_free("cuMemFreeAsync_ptsz", Key::Pointer(dptr), || unsafe {
            real(dptr, stream)
        })
    })
}

/// Arrays are charged an estimate from their descriptor (`tracker::array_bytes`).
///
/// # Safety
/// The driver's contract for `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    handle: *mut CUarray,
    descriptor: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    ffi_boundary!("cuArrayCreate_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(array_create);
        // SAFETY: the caller passes a valid descriptor or null (which the driver rejects).
        let bytes = unsafe { descriptor.as_ref() }.map_or(0, |d| {
            array_bytes(d.width, d.height, 0, d.format, d.num_channels)
        });
        accounted_alloc(
            "cuArrayCreate_v2",
            &DriverDevices::current(driver),
            bytes,
            Borrow::Never("a CUDA array"),
            // SAFETY: forwarded unchanged under the caller's contract.
            |_| unsafe { real(handle, descriptor) },
            // SAFETY: the driver wrote `*handle` on success.
            || unsafe { read(handle) }.map(|a| (Key::Array(a as usize), bytes)),
        )
    })
}

/// # Safety
/// The driver's contract for `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    handle: *mut CUarray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    ffi_boundary!("cuArray3DCreate_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(array_3d_create);
        // SAFETY: the caller passes a valid descriptor or null (which the driver rejects).
        let bytes = unsafe { descriptor.as_ref() }.map_or(0, |d| {
            array_bytes(d.width, d.height, d.depth, d.format, d.num_channels)
        });
        accounted_alloc(
            "cuArray3DCreate_v2",
            &DriverDevices::current(driver),
            bytes,
            Borrow::Never("a CUDA array"),
            // SAFETY: forwarded unchanged under the caller's contract.
            |_| unsafe { real(handle, descriptor) },
            // SAFETY: the driver wrote `*handle` on success.
            || unsafe { read(handle) }.map(|a| (Key::Array(a as usize), bytes)),
        )
    })
}

/// # Safety
/// The driver's contract for `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: CUarray) -> CUresult {
    ffi_boundary!("cuArrayDestroy", fallback = CUDA_ERROR_UNKNOWN, {
        let (_, real) = real_fn!(array_destroy);
        // SAFETY: forwarded unchanged under the caller's contract.
        accounted_free("cuArrayDestroy", Key::Array(array as usize), || unsafe {
            real(array)
        })
    })
}

/// Reports the tenant's slice: total = min(its limit, real), free = min(real free, what it may
/// still allocate) (`hooks::report_mem_info`).
///
/// # Safety
/// The driver's contract for `cuMemGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    ffi_boundary!("cuMemGetInfo_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(mem_get_info);
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(free, total) };
        // SAFETY: on success the driver wrote both (non-null) out-parameters.
        let Some((real_free, real_total)) = (rc == CUDA_SUCCESS)
            .then(|| unsafe { read(free).zip(read(total)) })
            .flatten()
        else {
            return rc;
        };
        let (shown_free, shown_total) = ffi_boundary!(
            "cuMemGetInfo_v2",
            fallback = (real_free as u64, real_total as u64),
            {
                hooks::report_mem_info(
                    &DriverDevices::current(driver),
                    real_free as u64,
                    real_total as u64,
                )
            }
        );
        // SAFETY: both pointers were read above, so they are non-null and valid.
        unsafe {
            free.write(shown_free as usize);
            total.write(shown_total as usize);
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuDeviceTotalMem_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    ffi_boundary!("cuDeviceTotalMem_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(device_total_mem);
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(bytes, device) };
        // SAFETY: on success the driver wrote the (non-null) out-parameter.
        let Some(real_total) = (rc == CUDA_SUCCESS)
            .then(|| unsafe { read(bytes) })
            .flatten()
        else {
            return rc;
        };
        let shown = ffi_boundary!("cuDeviceTotalMem_v2", fallback = real_total as u64, {
            hooks::report_total(
                &DriverDevices::named(driver, Some(device)),
                device,
                real_total as u64,
            )
        });
        // SAFETY: read above, so non-null and valid.
        unsafe { bytes.write(shown as usize) };
        rc
    })
}

/// Legacy IPC does not work on VMM-backed memory, and a borrowed allocation must not leave the
/// process unnoticed: for a pointer into one of the interposer's VMM-backed allocations the
/// answer is `CUDA_ERROR_NOT_SUPPORTED`, with a line saying what to do; others go to the driver.
///
/// # Safety
/// The driver's contract for `cuIpcGetMemHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    ffi_boundary!("cuIpcGetMemHandle", fallback = CUDA_ERROR_UNKNOWN, {
        let (_, real) = real_fn!(ipc_get_mem_handle);
        let backed = ffi_boundary!("cuIpcGetMemHandle", fallback = None, {
            vmm::purpose_at(dptr)
        });
        if let Some(purpose) = backed {
            let why = match purpose {
                vmm::Purpose::Borrowed => "it is borrowed past the tenant's request, and borrowed \
                                           memory is VMM-backed; raise the request (--memory) so \
                                           that it fits within it"
                    .to_owned(),
                vmm::Purpose::Everything => format!(
                    "{}=1 backs every cuMemAlloc with VMM; unset it to use legacy IPC",
                    tenant_abi::env::var::MEMORY_VMM
                ),
            };
            crate::log::error(format_args!(
                "cuIpcGetMemHandle({dptr:#x}): not supported: {why}"
            ));
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        // SAFETY: forwarded unchanged under the caller's contract.
        unsafe { real(handle, dptr) }
    })
}

/// The primary context (how the CUDA runtime, hence PyTorch, JAX and vLLM, gets its context):
/// the device's context overhead is charged before the driver creates it (on the GPU's memory
/// board too, taken back from borrowers first if the GPU is full), and a context that does not
/// fit in the slice is refused with `CUDA_ERROR_OUT_OF_MEMORY`. Charged once per process and
/// device (a retain of an existing context costs nothing more). Contexts made with `cuCtxCreate`
/// are charged at their first allocation instead.
///
/// # Safety
/// The driver's contract for `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    pctx: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    ffi_boundary!("cuDevicePrimaryCtxRetain", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(device_primary_ctx_retain);
        let admission = ffi_boundary!(
            "cuDevicePrimaryCtxRetain",
            fallback = Admission::Untracked,
            { hooks::admit_context(&DriverDevices::named(driver, Some(device)), device) }
        );
        let ticket = match admission {
            Admission::Refused => return CUDA_ERROR_OUT_OF_MEMORY,
            // SAFETY: forwarded unchanged under the caller's contract.
            Admission::Untracked => return unsafe { real(pctx, device) },
            Admission::Charged(ticket) => ticket,
        };
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(pctx, device) };
        ffi_boundary!("cuDevicePrimaryCtxRetain", fallback = (), {
            if rc == CUDA_SUCCESS {
                hooks::context_created(ticket);
            } else {
                hooks::abort(ticket);
            }
        });
        rc
    })
}

/// The CUDA ordinals this process sees and their GPU uuids (`GPU-...`), if the real driver is
/// loaded already and initialised; `None` otherwise (it is never loaded or initialised here).
pub fn visible_gpu_uuids() -> Option<Vec<String>> {
    let driver = real::driver_if_loaded()?;
    let gpu = RealGpu(driver);
    let count = gpu.device_count()?;
    (0..count)
        .map(|device| gpu.uuid(device).map(|uuid| launch::uuid_text(&uuid)))
        .collect()
}

/// After the real `cuGetProcAddress*` answered, replaces a real function we wrap with our hook.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `pfn` is null or valid for reads and writes.
unsafe fn substitute_proc(
    driver: &Driver,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) {
    if symbol.is_null() || pfn.is_null() || !hooks::enabled() {
        return;
    }
    // SAFETY: non-null and valid by the caller's contract.
    let found = unsafe { pfn.read() };
    if found.is_null() {
        return;
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    let name = unsafe { CStr::from_ptr(symbol) };
    let hook = if let Some(hook) = driver.substitute(found) {
        crate::log::debug(format_args!("cuGetProcAddress({name:?}) -> hook"));
        hook
    } else if cuda_version >= 12000
        && let Some(hook) = hook_by_base_name(name, flags)
    {
        crate::log::error(format_args!(
            "cuGetProcAddress({name:?}, {cuda_version}) returned a function this interposer \
             does not know; substituting its hook by name"
        ));
        hook as *mut c_void
    } else {
        return;
    };
    // SAFETY: valid for writes by the caller's contract.
    unsafe { pfn.write(hook) };
}

/// # Safety
/// The driver's contract for `cuGetProcAddress` (CUDA 11.3+ signature).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CUresult {
    ffi_boundary!("cuGetProcAddress", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(get_proc_address);
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(symbol, pfn, cuda_version, flags) };
        if rc == CUDA_SUCCESS {
            let _: () = ffi_boundary!("cuGetProcAddress", fallback = (), {
                // SAFETY: the driver accepted `symbol` and wrote `*pfn`.
                unsafe { substitute_proc(driver, symbol, pfn, cuda_version, flags) }
            });
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuGetProcAddress_v2` (CUDA 12.0+).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    symbol_status: *mut c_int,
) -> CUresult {
    ffi_boundary!("cuGetProcAddress_v2", fallback = CUDA_ERROR_UNKNOWN, {
        let (driver, real) = real_fn!(get_proc_address_v2);
        // SAFETY: forwarded unchanged under the caller's contract.
        let rc = unsafe { real(symbol, pfn, cuda_version, flags, symbol_status) };
        if rc == CUDA_SUCCESS {
            let _: () = ffi_boundary!("cuGetProcAddress_v2", fallback = (), {
                // SAFETY: the driver accepted `symbol` and wrote `*pfn`.
                unsafe { substitute_proc(driver, symbol, pfn, cuda_version, flags) }
            });
        }
        rc
    })
}

/// The real driver as the launch gate sees it.
struct RealGpu<'d>(&'d Driver);

impl Gpu for RealGpu<'_> {
    fn current_device(&self) -> Option<i32> {
        current_device(self.0)
    }

    fn device_count(&self) -> Option<i32> {
        let get = self.0.fns.device_get_count?;
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        (unsafe { get(&mut count) } == CUDA_SUCCESS).then_some(count)
    }

    fn uuid(&self, device: i32) -> Option<[u8; 16]> {
        let get = self
            .0
            .fns
            .device_get_uuid_v2
            .or(self.0.fns.device_get_uuid)?;
        let mut uuid = [0u8; 16];
        // SAFETY: `uuid` is a valid 16-byte out-parameter (`CUuuid`).
        (unsafe { get(&mut uuid, device) } == CUDA_SUCCESS).then_some(uuid)
    }

    fn current_context(&self) -> usize {
        let Some(get) = self.0.fns.ctx_get_current else {
            return 0;
        };
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer.
        unsafe { get(&mut context) };
        context as usize
    }

    fn event_create(&self) -> Option<usize> {
        let create = self.0.fns.event_create?;
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer; the flags are a documented value.
        let rc = unsafe { create(&mut event, CU_EVENT_DISABLE_TIMING) };
        (rc == CUDA_SUCCESS && !event.is_null()).then_some(event as usize)
    }

    fn event_record(&self, event: usize, stream: usize) -> bool {
        let Some(record) = self.0.fns.event_record else {
            return false;
        };
        // SAFETY: `event` came from cuEventCreate and is not destroyed; `stream` is the handle the
        // application just launched on (or a special handle), which the driver validates.
        unsafe { record(event as CUevent, stream as CUstream) == CUDA_SUCCESS }
    }

    fn event_query(&self, event: usize) -> EventState {
        let Some(query) = self.0.fns.event_query else {
            return EventState::Failed;
        };
        // SAFETY: `event` came from cuEventCreate and is not destroyed.
        match unsafe { query(event as CUevent) } {
            CUDA_SUCCESS => EventState::Done,
            CUDA_ERROR_NOT_READY => EventState::Pending,
            _ => EventState::Failed,
        }
    }

    fn event_destroy(&self, event: usize) {
        if let Some(destroy) = self.0.fns.event_destroy {
            // SAFETY: `event` came from cuEventCreate and is destroyed once (it leaves tracking).
            unsafe { destroy(event as CUevent) };
        }
    }

    fn stream_capturing(&self, stream: usize) -> bool {
        let Some(query) = self.0.fns.stream_is_capturing else {
            return true;
        };
        let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-pointer; `stream` is the application's stream handle
        // (or a special handle), which the driver validates.
        let rc = unsafe { query(stream as CUstream, &mut status) };
        rc != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE
    }
}

impl RealGpu<'_> {
    /// Device `device`'s handle and its whole SM resource, as the driver describes it.
    fn device_sm_resource(&self, device: i32) -> Result<(CUdevice, CUdevResource), String> {
        let fns = &self.0.fns;
        let missing = |name: &str| format!("the driver has no {name}");
        let device_get = fns.device_get.ok_or_else(|| missing("cuDeviceGet"))?;
        let get_resource = fns
            .device_get_dev_resource
            .ok_or_else(|| missing("cuDeviceGetDevResource"))?;
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; the ordinal is validated by the driver.
        let rc = unsafe { device_get(&mut dev, device) };
        if rc != CUDA_SUCCESS {
            return Err(format!("cuDeviceGet failed with CUresult {rc}"));
        }
        let mut all = CUdevResource::zeroed();
        // SAFETY: `all` is a zeroed buffer larger than the driver's `CUdevResource`.
        let rc = unsafe { get_resource(dev, &mut all, CU_DEV_RESOURCE_TYPE_SM) };
        if rc != CUDA_SUCCESS {
            return Err(format!("cuDeviceGetDevResource failed with CUresult {rc}"));
        }
        Ok((dev, all))
    }
}

impl spatial::Green for RealGpu<'_> {
    fn sm_resource(&self, device: i32) -> Result<spatial::SmResource, String> {
        let (_, all) = self.device_sm_resource(device)?;
        Ok(spatial::SmResource {
            count: all.word(DEV_RESOURCE_SM_COUNT),
            min_partition: all.word(DEV_RESOURCE_SM_MIN_PARTITION),
            alignment: all.word(DEV_RESOURCE_SM_ALIGNMENT),
        })
    }

    fn green_context_create(
        &self,
        device: i32,
        choose: &dyn Fn(spatial::SmResource) -> Result<u32, String>,
    ) -> Result<(usize, u32), String> {
        let fns = &self.0.fns;
        let missing = |name: &str| format!("the driver has no {name}");
        let split = fns
            .dev_sm_resource_split_by_count
            .ok_or_else(|| missing("cuDevSmResourceSplitByCount"))?;
        let generate = fns
            .dev_resource_generate_desc
            .ok_or_else(|| missing("cuDevResourceGenerateDesc"))?;
        let create = fns
            .green_ctx_create
            .ok_or_else(|| missing("cuGreenCtxCreate"))?;
        if fns.green_ctx_stream_create.is_none() || fns.stream_wait_event.is_none() {
            return Err(missing("cuGreenCtxStreamCreate or cuStreamWaitEvent"));
        }
        let check = |rc: CUresult, name: &str| {
            if rc == CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("{name} failed with CUresult {rc}"))
            }
        };
        let (dev, all) = self.device_sm_resource(device)?;
        let resource = spatial::SmResource {
            count: all.word(DEV_RESOURCE_SM_COUNT),
            min_partition: all.word(DEV_RESOURCE_SM_MIN_PARTITION),
            alignment: all.word(DEV_RESOURCE_SM_ALIGNMENT),
        };
        let sms = choose(resource)?;
        let (mut part, mut rest) = (CUdevResource::zeroed(), CUdevResource::zeroed());
        let mut groups: c_uint = 1;
        // SAFETY: one result group (`groups` = 1) and the remainder, each an oversized zeroed
        // buffer; `all` is the resource the driver filled in above.
        let rc = unsafe { split(&mut part, &mut groups, &all, &mut rest, 0, sms) };
        check(rc, "cuDevSmResourceSplitByCount")?;
        if groups != 1 {
            return Err(format!("{sms} SMs split into {groups} groups"));
        }
        let granted = part.word(DEV_RESOURCE_SM_COUNT);
        let mut desc: CUdevResourceDesc = std::ptr::null_mut();
        // SAFETY: `desc` is a valid out-pointer; `part` is one resource the driver made.
        let rc = unsafe { generate(&mut desc, &mut part, 1) };
        check(rc, "cuDevResourceGenerateDesc")?;
        let mut green: CUgreenCtx = std::ptr::null_mut();
        // SAFETY: `green` is a valid out-pointer, `desc` came from the driver, the flag is the
        // documented one (required).
        let rc = unsafe { create(&mut green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM) };
        check(rc, "cuGreenCtxCreate")?;
        if green.is_null() {
            return Err("cuGreenCtxCreate returned no context".to_owned());
        }
        Ok((green as usize, granted))
    }

    fn green_stream_create(&self, green: usize) -> Result<usize, String> {
        let create = self
            .0
            .fns
            .green_ctx_stream_create
            .ok_or("the driver has no cuGreenCtxStreamCreate")?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer, `green` a live green context of ours; the
        // driver requires CU_STREAM_NON_BLOCKING.
        let rc = unsafe { create(&mut stream, green as CUgreenCtx, CU_STREAM_NON_BLOCKING, 0) };
        if rc != CUDA_SUCCESS || stream.is_null() {
            return Err(format!("cuGreenCtxStreamCreate failed with CUresult {rc}"));
        }
        Ok(stream as usize)
    }

    fn stream_wait_event(&self, stream: usize, event: usize) -> bool {
        let Some(wait) = self.0.fns.stream_wait_event else {
            return false;
        };
        // SAFETY: `event` is one of our live events; `stream` is a green stream of ours or the
        // handle the application launches on (or a special handle), which the driver validates.
        unsafe { wait(stream as CUstream, event as CUevent, 0) == CUDA_SUCCESS }
    }
}

/// How a launch may be placed by spatial partitioning.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// May run on a green stream (`spatial`).
    Movable,
    /// Stays on the application's stream (cooperative launches: see `spatial`).
    Fixed,
    /// An asynchronous copy to or from host memory: on the application's stream, and past no turn
    /// (the copy engines are shared neither by turns nor by SMs), but it counts as the tenant's
    /// demand and obeys the closed loop like a launch, so a neighbour made of copies is held back
    /// too.
    Copy,
    /// An asynchronous copy within the GPU's memory (`cuMemcpyDtoDAsync`, and `cuMemcpyAsync`
    /// between two device addresses, `copy_placement`): gated by turns and moved to a green
    /// stream while the tenant is squeezed or capped, like a kernel. A copy within one
    /// GPU's memory runs on its SMs at HBM speed (an H200 copied 4.2 TB/s, far past any copy
    /// engine), so without the move a neighbour made of such copies escaped both the squeeze and
    /// the cap (twenty-ninth session: capping one to 75% changed nothing), and without the turns
    /// it ran through the other tenants' turns (on the fake driver a tenant of copies with a 30%
    /// share took 94% of the GPU beside one of kernels with 70%: ABI test
    /// `compute::device_to_device_copies_take_turns_like_kernels`). A `cuMemcpyAsync` with host
    /// memory on either side is a `Copy` (and where the driver cannot say, an `SmCopy`).
    SmCopy,
}

/// Runs a launch through the gate: wait for the tenant's turn (not for a latency tenant), pick
/// the stream (the application's, or a green one while squeezed), launch, track if sampled.
/// `call` launches on the stream it is given.
fn gated_launch(
    what: &'static str,
    driver: &Driver,
    stream: CUstream,
    per_thread: bool,
    placement: Placement,
    launch: crate::closed_loop::LaunchKey,
    call: impl Fn(CUstream) -> CUresult,
) -> CUresult {
    let gpu = RealGpu(driver);
    let stream_ref = StreamRef {
        handle: stream as usize,
        per_thread,
    };
    let captured = ffi_boundary!(what, fallback = false, {
        launch::is_captured(&gpu, stream_ref)
    });
    if captured {
        // Recorded into a graph, not run: the gate applies when the graph is launched.
        return call(stream);
    }
    let latency = ffi_boundary!(what, fallback = false, { spatial::stamp_if_latency(&gpu) });
    // The closed loop's decision for a tenant beside a latency tenant (may wait).
    let bounded = if latency {
        None
    } else {
        ffi_boundary!(what, fallback = None, {
            crate::closed_loop::before_launch(&gpu, stream_ref, launch)
        })
    };
    let pending = if latency {
        None
    } else if placement == Placement::Copy {
        ffi_boundary!(what, fallback = (), { launch::stamp_demand(&gpu) });
        None
    } else {
        ffi_boundary!(what, fallback = None, { launch::before(&gpu, stream_ref) })
    };
    // The hold rule (a chunk of borrowed memory in host memory): after the turn, before the
    // stream is picked (a redirection holds the device's lock until reported).
    let (in_flight, held_rc) = match enter_work(what, driver) {
        Ok(in_flight) => (Some(in_flight), None),
        Err(rc) => (None, Some(rc)),
    };
    // No redirection while a capture is in progress: its event records and waits would touch
    // streams while a global-mode capture forbids it.
    let redirect = if held_rc.is_none()
        && matches!(placement, Placement::Movable | Placement::SmCopy)
        && !latency
        && !launch::captures_in_progress()
    {
        ffi_boundary!(what, fallback = None, {
            spatial::redirect(&gpu, stream_ref)
        })
    } else {
        None
    };
    let rc = match (held_rc, redirect) {
        (Some(rc), _) => rc,
        (None, None) => call(stream),
        (None, Some(redirect)) => {
            let rc = call(redirect.stream() as CUstream);
            if rc == CUDA_SUCCESS {
                ffi_boundary!(what, fallback = (), { redirect.launched(&gpu) });
                rc
            } else {
                // Nothing ran: launch where the application asked.
                let rc_app = call(stream);
                ffi_boundary!(what, fallback = (), {
                    redirect.refused(rc, rc_app == CUDA_SUCCESS)
                });
                rc_app
            }
        }
    };
    drop(in_flight);
    if let Some(pending) = pending {
        ffi_boundary!(what, fallback = (), {
            launch::after(&gpu, pending, rc == CUDA_SUCCESS)
        });
    }
    if let Some(bounded) = bounded {
        ffi_boundary!(what, fallback = (), {
            crate::closed_loop::after_launch(&gpu, bounded, rc == CUDA_SUCCESS)
        });
    }
    rc
}

macro_rules! launch_kernel_hook {
    ($name:ident, $field:ident, $per_thread:expr) => {
        /// # Safety
        /// The driver's contract for this launch function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            grid_x: c_uint,
            grid_y: c_uint,
            grid_z: c_uint,
            block_x: c_uint,
            block_y: c_uint,
            block_z: c_uint,
            shared_mem_bytes: c_uint,
            stream: CUstream,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                let placement = Placement::Movable;
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    placement,
                    crate::closed_loop::LaunchKey(f as usize),
                    |s| {
                        // SAFETY: forwarded under the caller's contract; `s` is the caller's stream
                        // or a green stream of the current context's device.
                        unsafe {
                            real(
                                f,
                                grid_x,
                                grid_y,
                                grid_z,
                                block_x,
                                block_y,
                                block_z,
                                shared_mem_bytes,
                                s,
                                params,
                                extra,
                            )
                        }
                    },
                )
            })
        }
    };
}

launch_kernel_hook!(cuLaunchKernel, launch_kernel, false);
launch_kernel_hook!(cuLaunchKernel_ptsz, launch_kernel_ptsz, true);

macro_rules! launch_kernel_ex_hook {
    ($name:ident, $field:ident, $per_thread:expr) => {
        /// # Safety
        /// The driver's contract for this launch function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            config: *const CUlaunchConfig,
            f: CUfunction,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                // SAFETY: the caller passes a valid configuration or null (the driver rejects
                // null).
                let given = unsafe { config.as_ref() };
                let stream = given.map_or(std::ptr::null_mut(), |c| c.h_stream);
                let placement = match given {
                    // SAFETY: `c` is the caller's valid configuration.
                    Some(c) if !unsafe { is_cooperative(c) } => Placement::Movable,
                    _ => Placement::Fixed,
                };
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    placement,
                    crate::closed_loop::LaunchKey(f as usize),
                    |s| {
                        match given {
                            Some(c) if s != c.h_stream => {
                                let moved = CUlaunchConfig {
                                    grid_dim: c.grid_dim,
                                    block_dim: c.block_dim,
                                    shared_mem_bytes: c.shared_mem_bytes,
                                    h_stream: s,
                                    attrs: c.attrs,
                                    num_attrs: c.num_attrs,
                                };
                                // SAFETY: the caller's configuration with a green stream of the
                                // current context's device, under the caller's contract.
                                unsafe { real(&moved, f, params, extra) }
                            }
                            // SAFETY: forwarded unchanged under the caller's contract.
                            _ => unsafe { real(config, f, params, extra) },
                        }
                    },
                )
            })
        }
    };
}

/// Whether a `cuLaunchKernelEx` configuration asks for a cooperative launch.
///
/// # Safety
/// `config.attrs` points to `config.num_attrs` attributes (or is null), as the driver requires.
unsafe fn is_cooperative(config: &CUlaunchConfig) -> bool {
    if config.attrs.is_null() || config.num_attrs == 0 {
        return false;
    }
    // SAFETY: the caller's contract: `num_attrs` valid attributes at `attrs`.
    let attrs = unsafe {
        std::slice::from_raw_parts(
            config.attrs.cast::<CUlaunchAttribute>(),
            config.num_attrs as usize,
        )
    };
    attrs
        .iter()
        .any(|a| a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value[..4] != [0, 0, 0, 0])
}

launch_kernel_ex_hook!(cuLaunchKernelEx, launch_kernel_ex, false);
launch_kernel_ex_hook!(cuLaunchKernelEx_ptsz, launch_kernel_ex_ptsz, true);

macro_rules! launch_cooperative_hook {
    ($name:ident, $field:ident, $per_thread:expr) => {
        /// # Safety
        /// The driver's contract for this launch function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            grid_x: c_uint,
            grid_y: c_uint,
            grid_z: c_uint,
            block_x: c_uint,
            block_y: c_uint,
            block_z: c_uint,
            shared_mem_bytes: c_uint,
            stream: CUstream,
            params: *mut *mut c_void,
        ) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                let placement = Placement::Fixed;
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    placement,
                    crate::closed_loop::LaunchKey(f as usize),
                    |s| {
                        // SAFETY: forwarded unchanged under the caller's contract (`Fixed`: `s` is
                        // the caller's stream).
                        unsafe {
                            real(
                                f,
                                grid_x,
                                grid_y,
                                grid_z,
                                block_x,
                                block_y,
                                block_z,
                                shared_mem_bytes,
                                s,
                                params,
                            )
                        }
                    },
                )
            })
        }
    };
}

launch_cooperative_hook!(cuLaunchCooperativeKernel, launch_cooperative_kernel, false);
launch_cooperative_hook!(
    cuLaunchCooperativeKernel_ptsz,
    launch_cooperative_kernel_ptsz,
    true
);

/// Gated on the current device only (the launch may span several); its streams are not tracked.
///
/// # Safety
/// The driver's contract for `cuLaunchCooperativeKernelMultiDevice`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    launch_params_list: *mut c_void,
    num_devices: c_uint,
    flags: c_uint,
) -> CUresult {
    ffi_boundary!(
        "cuLaunchCooperativeKernelMultiDevice",
        fallback = CUDA_ERROR_UNKNOWN,
        {
            let (driver, real) = real_fn!(launch_cooperative_kernel_multi_device);
            let gpu = RealGpu(driver);
            let stream = StreamRef {
                handle: 0,
                per_thread: false,
            };
            let latency =
                ffi_boundary!("cuLaunchCooperativeKernelMultiDevice", fallback = false, {
                    spatial::stamp_if_latency(&gpu)
                });
            if !latency {
                let _untracked: Option<launch::Pending> =
                    ffi_boundary!("cuLaunchCooperativeKernelMultiDevice", fallback = None, {
                        launch::before(&gpu, stream)
                    });
            }
            let _in_flight = match enter_work("cuLaunchCooperativeKernelMultiDevice", driver) {
                Ok(in_flight) => in_flight,
                Err(rc) => return rc,
            };
            // SAFETY: forwarded unchanged under the caller's contract.
            unsafe { real(launch_params_list, num_devices, flags) }
        }
    )
}

macro_rules! graph_launch_hook {
    ($name:ident, $field:ident, $per_thread:expr) => {
        /// A graph launch is one launch unit: gated, tracked and moved like a kernel.
        ///
        /// # Safety
        /// The driver's contract for this launch function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(exec: CUgraphExec, stream: CUstream) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                let placement = Placement::Movable;
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    placement,
                    crate::closed_loop::LaunchKey(exec as usize),
                    |s| {
                        // SAFETY: forwarded under the caller's contract; `s` is the caller's stream
                        // or a green stream of the current context's device.
                        unsafe { real(exec, s) }
                    },
                )
            })
        }
    };
}

graph_launch_hook!(cuGraphLaunch, graph_launch, false);
graph_launch_hook!(cuGraphLaunch_ptsz, graph_launch_ptsz, true);

/// How a copy hook knows its direction: from its name (`Copy`: to or from host memory; `SmCopy`:
/// within the GPU's memory), or from its pointers (`Unified`: `cuMemcpyAsync`).
#[derive(Clone, Copy)]
enum CopyKind {
    Copy,
    SmCopy,
    Unified,
}

/// Where a copy goes: `cuMemcpyAsync` between two device addresses runs on the SMs
/// (`Placement::SmCopy`: turns and green contexts, like a kernel); with a host address on
/// either side it runs on the copy engines (`Placement::Copy`), and must not wait for turns
/// (NCCL's and frameworks' small host copies would each wait for one). Asked of the driver
/// (`CU_POINTER_ATTRIBUTE_MEMORY_TYPE`: pageable host memory is no CUDA pointer, an error);
/// a driver without the query leaves it `SmCopy` (the conservative side).
fn copy_placement(driver: &Driver, kind: CopyKind, dst: u64, src: u64) -> Placement {
    match kind {
        CopyKind::Copy => Placement::Copy,
        CopyKind::SmCopy => Placement::SmCopy,
        CopyKind::Unified => {
            // Neither turns nor green contexts in this process: the placement changes nothing,
            // and the copy's path pays no query.
            if !launch::is_gated() && spatial::spatial().is_none() {
                return Placement::SmCopy;
            }
            let Some(query) = driver.fns.pointer_get_attribute else {
                return Placement::SmCopy;
            };
            let on_device = |pointer: u64| {
                let mut memory_type: c_uint = 0;
                // SAFETY: `memory_type` is a valid out-pointer for the attribute's c_uint; the
                // driver validates `pointer` (any value may be passed).
                let rc = unsafe {
                    query(
                        (&raw mut memory_type).cast::<c_void>(),
                        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                        pointer,
                    )
                };
                rc == CUDA_SUCCESS && memory_type == CU_MEMORYTYPE_DEVICE
            };
            if on_device(dst) && on_device(src) {
                Placement::SmCopy
            } else {
                Placement::Copy
            }
        }
    }
}

macro_rules! copy_hook {
    ($name:ident, $field:ident, $per_thread:expr, $placement:ident) => {
        /// # Safety
        /// The driver's contract for this copy.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dst: u64,
            src: u64,
            bytes: usize,
            stream: CUstream,
        ) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                let placement = copy_placement(driver, CopyKind::$placement, dst, src);
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    placement,
                    crate::closed_loop::LaunchKey::copy(bytes),
                    // SAFETY: forwarded under the caller's contract; `s` is the caller's stream
                    // or, for `Placement::SmCopy`, a green stream of the current context's device.
                    |s| unsafe { real(dst, src, bytes, s) },
                )
            })
        }
    };
}

copy_hook!(cuMemcpyAsync, memcpy_async, false, Unified);
copy_hook!(cuMemcpyAsync_ptsz, memcpy_async_ptsz, true, Unified);
copy_hook!(cuMemcpyDtoDAsync_v2, memcpy_dtod_async, false, SmCopy);
copy_hook!(
    cuMemcpyDtoDAsync_v2_ptsz,
    memcpy_dtod_async_ptsz,
    true,
    SmCopy
);
copy_hook!(cuMemcpyHtoDAsync_v2, memcpy_htod_async, false, Copy);
copy_hook!(
    cuMemcpyHtoDAsync_v2_ptsz,
    memcpy_htod_async_ptsz,
    true,
    Copy
);
copy_hook!(cuMemcpyDtoHAsync_v2, memcpy_dtoh_async, false, Copy);
copy_hook!(
    cuMemcpyDtoHAsync_v2_ptsz,
    memcpy_dtoh_async_ptsz,
    true,
    Copy
);

/// An asynchronous memset: the driver runs it as a kernel on the GPU's SMs at HBM speed, so it
/// takes turns and moves to a green stream while its tenant is squeezed or capped, as a copy
/// within the GPU's memory does (`Placement::SmCopy`; ABI test
/// `compute::memsets_take_turns_like_kernels`). `$bytes` is what it writes (the closed loop's
/// duration key).
macro_rules! memset_hook {
    ($name:ident, $field:ident, $per_thread:expr, ($($arg:ident: $ty:ty),*), $bytes:expr) => {
        /// # Safety
        /// The driver's contract for this memset.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty,)* stream: CUstream) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                gated_launch(
                    stringify!($name),
                    driver,
                    stream,
                    $per_thread,
                    Placement::SmCopy,
                    crate::closed_loop::LaunchKey::memset($bytes),
                    // SAFETY: forwarded under the caller's contract; `s` is the caller's stream
                    // or a green stream of the current context's device.
                    |s| unsafe { real($($arg,)* s) },
                )
            })
        }
    };
}

/// A copy that the compute gate does not see (synchronous, on the legacy or per-thread default
/// stream): held while a chunk of borrowed memory is in host memory (`enter_work`), then
/// forwarded unchanged.
macro_rules! held_copy_hook {
    ($name:ident, $field:ident, ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// The driver's contract for this copy.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                let _in_flight = match enter_work(stringify!($name), driver) {
                    Ok(in_flight) => in_flight,
                    Err(rc) => return rc,
                };
                // SAFETY: forwarded unchanged under the caller's contract.
                unsafe { real($($arg),*) }
            })
        }
    };
}

held_copy_hook!(cuMemcpyHtoD_v2, memcpy_htod, (dst: CUdeviceptr, src: *const c_void, bytes: usize));
held_copy_hook!(cuMemcpyDtoH_v2, memcpy_dtoh, (dst: *mut c_void, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpy, memcpy, (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpy_ptds, memcpy_ptds, (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyPeer, memcpy_peer, (dst: CUdeviceptr, dst_context: CUcontext, src: CUdeviceptr, src_context: CUcontext, bytes: usize));
held_copy_hook!(cuMemcpyPeer_ptds, memcpy_peer_ptds, (dst: CUdeviceptr, dst_context: CUcontext, src: CUdeviceptr, src_context: CUcontext, bytes: usize));
held_copy_hook!(cuMemcpyHtoD_v2_ptds, memcpy_htod_ptds, (dst: CUdeviceptr, src: *const c_void, bytes: usize));
held_copy_hook!(cuMemcpyDtoH_v2_ptds, memcpy_dtoh_ptds, (dst: *mut c_void, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyDtoD_v2, memcpy_dtod, (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyDtoD_v2_ptds, memcpy_dtod_ptds, (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyDtoA_v2, memcpy_dtoa, (dst: CUarray, offset: usize, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyDtoA_v2_ptds, memcpy_dtoa_ptds, (dst: CUarray, offset: usize, src: CUdeviceptr, bytes: usize));
held_copy_hook!(cuMemcpyAtoD_v2, memcpy_atod, (dst: CUdeviceptr, src: CUarray, offset: usize, bytes: usize));
held_copy_hook!(cuMemcpyAtoD_v2_ptds, memcpy_atod_ptds, (dst: CUdeviceptr, src: CUarray, offset: usize, bytes: usize));
held_copy_hook!(cuMemcpy2D_v2, memcpy_2d, (copy: *const c_void));
held_copy_hook!(cuMemcpy2D_v2_ptds, memcpy_2d_ptds, (copy: *const c_void));
held_copy_hook!(cuMemcpy2DUnaligned_v2, memcpy_2d_unaligned, (copy: *const c_void));
held_copy_hook!(cuMemcpy2DUnaligned_v2_ptds, memcpy_2d_unaligned_ptds, (copy: *const c_void));
held_copy_hook!(cuMemcpy3D_v2, memcpy_3d, (copy: *const c_void));
held_copy_hook!(cuMemcpy3D_v2_ptds, memcpy_3d_ptds, (copy: *const c_void));
held_copy_hook!(cuMemcpy3DPeer, memcpy_3d_peer, (copy: *const c_void));
held_copy_hook!(cuMemcpy3DPeer_ptds, memcpy_3d_peer_ptds, (copy: *const c_void));
held_copy_hook!(cuMemcpyPeerAsync, memcpy_peer_async, (dst: CUdeviceptr, dst_context: CUcontext, src: CUdeviceptr, src_context: CUcontext, bytes: usize, stream: CUstream));
held_copy_hook!(cuMemcpyPeerAsync_ptsz, memcpy_peer_async_ptsz, (dst: CUdeviceptr, dst_context: CUcontext, src: CUdeviceptr, src_context: CUcontext, bytes: usize, stream: CUstream));
held_copy_hook!(cuMemcpy2DAsync_v2, memcpy_2d_async, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpy2DAsync_v2_ptsz, memcpy_2d_async_ptsz, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpy3DAsync_v2, memcpy_3d_async, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpy3DAsync_v2_ptsz, memcpy_3d_async_ptsz, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpy3DPeerAsync, memcpy_3d_peer_async, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpy3DPeerAsync_ptsz, memcpy_3d_peer_async_ptsz, (copy: *const c_void, stream: CUstream));
held_copy_hook!(cuMemcpyBatchAsync, memcpy_batch_async, (dsts: *mut c_void, srcs: *mut c_void, sizes: *mut c_void, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, fail_idx: *mut c_void, stream: CUstream));
held_copy_hook!(cuMemcpyBatchAsync_ptsz, memcpy_batch_async_ptsz, (dsts: *mut c_void, srcs: *mut c_void, sizes: *mut c_void, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, fail_idx: *mut c_void, stream: CUstream));
held_copy_hook!(cuMemcpyBatchAsync_v2, memcpy_batch_async_v2, (dsts: *mut c_void, srcs: *mut c_void, sizes: *mut c_void, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, stream: CUstream));
held_copy_hook!(cuMemcpyBatchAsync_v2_ptsz, memcpy_batch_async_v2_ptsz, (dsts: *mut c_void, srcs: *mut c_void, sizes: *mut c_void, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, stream: CUstream));
held_copy_hook!(cuMemcpy3DBatchAsync, memcpy_3d_batch_async, (num_ops: usize, ops: *mut c_void, fail_idx: *mut c_void, flags: u64, stream: CUstream));
held_copy_hook!(cuMemcpy3DBatchAsync_ptsz, memcpy_3d_batch_async_ptsz, (num_ops: usize, ops: *mut c_void, fail_idx: *mut c_void, flags: u64, stream: CUstream));
held_copy_hook!(cuMemcpy3DBatchAsync_v2, memcpy_3d_batch_async_v2, (num_ops: usize, ops: *mut c_void, flags: u64, stream: CUstream));
held_copy_hook!(cuMemcpy3DBatchAsync_v2_ptsz, memcpy_3d_batch_async_v2_ptsz, (num_ops: usize, ops: *mut c_void, flags: u64, stream: CUstream));
held_copy_hook!(cuMemsetD8_v2, memset_d8, (dst: CUdeviceptr, value: u8, count: usize));
held_copy_hook!(cuMemsetD8_v2_ptds, memset_d8_ptds, (dst: CUdeviceptr, value: u8, count: usize));
held_copy_hook!(cuMemsetD2D8_v2, memset_d2d8, (dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize));
held_copy_hook!(cuMemsetD2D8_v2_ptds, memset_d2d8_ptds, (dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize));
memset_hook!(cuMemsetD8Async, memset_d8_async, false, (dst: CUdeviceptr, value: u8, count: usize), count);
memset_hook!(cuMemsetD8Async_ptsz, memset_d8_async_ptsz, true, (dst: CUdeviceptr, value: u8, count: usize), count);
memset_hook!(cuMemsetD2D8Async, memset_d2d8_async, false, (dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize), width.saturating_mul(height));
memset_hook!(cuMemsetD2D8Async_ptsz, memset_d2d8_async_ptsz, true, (dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize), width.saturating_mul(height));
held_copy_hook!(cuMemsetD16_v2, memset_d16, (dst: CUdeviceptr, value: u16, count: usize));
held_copy_hook!(cuMemsetD16_v2_ptds, memset_d16_ptds, (dst: CUdeviceptr, value: u16, count: usize));
held_copy_hook!(cuMemsetD2D16_v2, memset_d2d16, (dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize));
held_copy_hook!(cuMemsetD2D16_v2_ptds, memset_d2d16_ptds, (dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize));
memset_hook!(cuMemsetD16Async, memset_d16_async, false, (dst: CUdeviceptr, value: u16, count: usize), count.saturating_mul(2));
memset_hook!(cuMemsetD16Async_ptsz, memset_d16_async_ptsz, true, (dst: CUdeviceptr, value: u16, count: usize), count.saturating_mul(2));
memset_hook!(cuMemsetD2D16Async, memset_d2d16_async, false, (dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize), width.saturating_mul(height).saturating_mul(2));
memset_hook!(cuMemsetD2D16Async_ptsz, memset_d2d16_async_ptsz, true, (dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize), width.saturating_mul(height).saturating_mul(2));
held_copy_hook!(cuMemsetD32_v2, memset_d32, (dst: CUdeviceptr, value: u32, count: usize));
held_copy_hook!(cuMemsetD32_v2_ptds, memset_d32_ptds, (dst: CUdeviceptr, value: u32, count: usize));
held_copy_hook!(cuMemsetD2D32_v2, memset_d2d32, (dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize));
held_copy_hook!(cuMemsetD2D32_v2_ptds, memset_d2d32_ptds, (dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize));
memset_hook!(cuMemsetD32Async, memset_d32_async, false, (dst: CUdeviceptr, value: u32, count: usize), count.saturating_mul(4));
memset_hook!(cuMemsetD32Async_ptsz, memset_d32_async_ptsz, true, (dst: CUdeviceptr, value: u32, count: usize), count.saturating_mul(4));
memset_hook!(cuMemsetD2D32Async, memset_d2d32_async, false, (dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize), width.saturating_mul(height).saturating_mul(4));
memset_hook!(cuMemsetD2D32Async_ptsz, memset_d2d32_async_ptsz, true, (dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize), width.saturating_mul(height).saturating_mul(4));
held_copy_hook!(cuStreamWriteValue32, stream_write_value32, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWriteValue32_ptsz, stream_write_value32_ptsz, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWriteValue32_v2, stream_write_value32_v2, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWriteValue32_v2_ptsz, stream_write_value32_v2_ptsz, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWriteValue64, stream_write_value64, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWriteValue64_ptsz, stream_write_value64_ptsz, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWriteValue64_v2, stream_write_value64_v2, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWriteValue64_v2_ptsz, stream_write_value64_v2_ptsz, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWaitValue32, stream_wait_value32, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWaitValue32_ptsz, stream_wait_value32_ptsz, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWaitValue32_v2, stream_wait_value32_v2, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWaitValue32_v2_ptsz, stream_wait_value32_v2_ptsz, (stream: CUstream, address: CUdeviceptr, value: u32, flags: c_uint));
held_copy_hook!(cuStreamWaitValue64, stream_wait_value64, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWaitValue64_ptsz, stream_wait_value64_ptsz, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWaitValue64_v2, stream_wait_value64_v2, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamWaitValue64_v2_ptsz, stream_wait_value64_v2_ptsz, (stream: CUstream, address: CUdeviceptr, value: u64, flags: c_uint));
held_copy_hook!(cuStreamBatchMemOp, stream_batch_mem_op, (stream: CUstream, count: c_uint, ops: *mut c_void, flags: c_uint));
held_copy_hook!(cuStreamBatchMemOp_ptsz, stream_batch_mem_op_ptsz, (stream: CUstream, count: c_uint, ops: *mut c_void, flags: c_uint));
held_copy_hook!(cuStreamBatchMemOp_v2, stream_batch_mem_op_v2, (stream: CUstream, count: c_uint, ops: *mut c_void, flags: c_uint));
held_copy_hook!(cuStreamBatchMemOp_v2_ptsz, stream_batch_mem_op_v2_ptsz, (stream: CUstream, count: c_uint, ops: *mut c_void, flags: c_uint));
held_copy_hook!(cuLaunch, launch_legacy, (function: CUfunction));
held_copy_hook!(cuLaunchGrid, launch_grid, (function: CUfunction, width: c_int, height: c_int));
held_copy_hook!(cuLaunchGridAsync, launch_grid_async, (function: CUfunction, width: c_int, height: c_int, stream: CUstream));

/// A synchronisation or completion query: forwarded unchanged; when it says the work it waited
/// for is done (`CUDA_SUCCESS`), a latency tenant's open step closes, and any other gated
/// tenant's sync that waited for work it launched counts a step of its progress
/// (`closed_loop::synchronised`); when it says the context is lost, the process is told why once
/// (`fault`).
macro_rules! sync_hook {
    ($name:ident, $field:ident, ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// The driver's contract for this function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (driver, real) = real_fn!($field);
                // SAFETY: forwarded unchanged under the caller's contract.
                let rc = unsafe { real($($arg),*) };
                if rc == CUDA_SUCCESS {
                    ffi_boundary!(stringify!($name), fallback = (), {
                        crate::closed_loop::synchronised(&RealGpu(driver))
                    });
                } else {
                    ffi_boundary!(stringify!($name), fallback = (), {
                        crate::fault::sync_failed(rc)
                    });
                }
                rc
            })
        }
    };
}

sync_hook!(cuStreamSynchronize, stream_synchronize, (stream: CUstream));
sync_hook!(cuStreamSynchronize_ptsz, stream_synchronize_ptsz, (stream: CUstream));
sync_hook!(cuStreamQuery, stream_query, (stream: CUstream));
sync_hook!(cuStreamQuery_ptsz, stream_query_ptsz, (stream: CUstream));
sync_hook!(cuEventSynchronize, event_synchronize, (event: CUevent));
sync_hook!(cuEventQuery, event_query, (event: CUevent));
sync_hook!(cuCtxSynchronize, ctx_synchronize, ());
// CUDA 13: what `cuGetProcAddress("cuCtxSynchronize", 13000)` resolves to (a context argument).
sync_hook!(cuCtxSynchronize_v2, ctx_synchronize_v2, (context: CUcontext));

macro_rules! begin_capture_hook {
    ($name:ident, $field:ident $(, $mode:ident: $mode_ty:ty)?) => {
        /// Counts the capture (`launch::capture_began`) once the driver began it.
        ///
        /// # Safety
        /// The driver's contract for this function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: CUstream $(, $mode: $mode_ty)?) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (_, real) = real_fn!($field);
                // SAFETY: forwarded unchanged under the caller's contract.
                let rc = unsafe { real(stream $(, $mode)?) };
                if rc == CUDA_SUCCESS {
                    launch::capture_began();
                }
                rc
            })
        }
    };
}

begin_capture_hook!(cuStreamBeginCapture, stream_begin_capture);
begin_capture_hook!(cuStreamBeginCapture_ptsz, stream_begin_capture_ptsz);
begin_capture_hook!(cuStreamBeginCapture_v2, stream_begin_capture_v2, mode: c_int);
begin_capture_hook!(
    cuStreamBeginCapture_v2_ptsz,
    stream_begin_capture_v2_ptsz,
    mode: c_int
);

macro_rules! end_capture_hook {
    ($name:ident, $field:ident) => {
        /// Ends the capture's count (`launch::capture_ended`) whatever the driver answers: a
        /// failed end (an invalidated capture) ends the capture too.
        ///
        /// # Safety
        /// The driver's contract for this function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: CUstream, graph: *mut CUgraph) -> CUresult {
            ffi_boundary!(stringify!($name), fallback = CUDA_ERROR_UNKNOWN, {
                let (_, real) = real_fn!($field);
                // SAFETY: forwarded unchanged under the caller's contract.
                let rc = unsafe { real(stream, graph) };
                launch::capture_ended();
                rc
            })
        }
    };
}

end_capture_hook!(cuStreamEndCapture, stream_end_capture);
end_capture_hook!(cuStreamEndCapture_ptsz, stream_end_capture_ptsz);

// The hint helper's C ABI (issue 17, `hint`): what `vgpu.torch` (deploy/python/vgpu/torch.py)
// calls through ctypes. Return codes: 0 done; 1 (`vgpu_memory_hint_register` only) registered, but
// this process's memory is never asked back (no tenant, no memory board, or the swap is off);
// -1 a NULL pointer; -2 an internal error (logged).

/// The hint helper's calls succeeded.
pub const VGPU_HINT_OK: c_int = 0;
/// Registered, but nothing will be asked of this process.
pub const VGPU_HINT_INACTIVE: c_int = 1;
/// A NULL out-pointer, or an argument out of range.
pub const VGPU_HINT_INVALID: c_int = -1;
/// A bug of the interposer (caught and logged).
pub const VGPU_HINT_ERROR: c_int = -2;

/// `int vgpu_memory_hint_register(void)`: the calling process has a hint helper; wants on its
/// tenant are handed to it for `VGPU_MEMORY_HINT_MS` (100 ms) before its memory is swapped.
#[unsafe(no_mangle)]
pub extern "C" fn vgpu_memory_hint_register() -> c_int {
    ffi_boundary!("vgpu_memory_hint_register", fallback = VGPU_HINT_ERROR, {
        if hooks::hint_register() {
            VGPU_HINT_OK
        } else {
            VGPU_HINT_INACTIVE
        }
    })
}

/// `int vgpu_memory_want(uint64_t *bytes)`: writes how many bytes of GPU memory this process is
/// asked to give back now (0: nothing); cheap enough to poll every few milliseconds.
///
/// # Safety
/// `bytes` is NULL or valid for a write of one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vgpu_memory_want(bytes: *mut u64) -> c_int {
    ffi_boundary!("vgpu_memory_want", fallback = VGPU_HINT_ERROR, {
        if bytes.is_null() {
            return VGPU_HINT_INVALID;
        }
        let asked = hooks::hint_poll();
        // SAFETY: non-null, and valid for a write by the caller's contract.
        unsafe { bytes.write(asked) };
        VGPU_HINT_OK
    })
}

/// `int vgpu_memory_hint_done(uint64_t freed)`: the helper freed what it could (`freed`: its
/// estimate, logged); what it did not free may be swapped without waiting out the budget.
#[unsafe(no_mangle)]
pub extern "C" fn vgpu_memory_hint_done(freed: u64) -> c_int {
    ffi_boundary!("vgpu_memory_hint_done", fallback = VGPU_HINT_ERROR, {
        hooks::hint_done(freed);
        VGPU_HINT_OK
    })
}

/// `int vgpu_memory_cold(uint64_t ptr, uint64_t bytes, int cold, uint64_t *marked)`: the
/// application says the GPU memory `[ptr, ptr + bytes)` is cold (`cold` 1; 0 takes it back):
/// borrowed memory there is given back first when other tenants need theirs (an engine's
/// offloaded experts, a cache it will not read soon). Memory within the tenant's request is
/// never taken, so marking it does nothing: `marked` (if not NULL) gets the bytes of the
/// borrowed allocations marked. 0 done; 1 this process's memory is never asked back (no tenant,
/// no board, or the swap off); -1 `cold` not 0 or 1; -2 an internal error (logged).
///
/// # Safety
/// `marked` is NULL or valid for a write of one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vgpu_memory_cold(
    ptr: u64,
    bytes: u64,
    cold: c_int,
    marked: *mut u64,
) -> c_int {
    ffi_boundary!("vgpu_memory_cold", fallback = VGPU_HINT_ERROR, {
        if cold != 0 && cold != 1 {
            return VGPU_HINT_INVALID;
        }
        let Some(bytes_marked) = hooks::mark_cold(ptr, bytes, cold == 1) else {
            return VGPU_HINT_INACTIVE;
        };
        if !marked.is_null() {
            // SAFETY: non-null, and valid for a write by the caller's contract.
            unsafe { marked.write(bytes_marked) };
        }
        VGPU_HINT_OK
    })
}

/// `vgpu_progress` counted `n` on every GPU where this process is a member of the schedule.
pub const VGPU_PROGRESS_OK: c_int = 0;
/// This process has no slot in any GPU's schedule: it is not a vgpu tenant with a compute
/// share, or it has launched nothing yet (it joins a GPU's schedule at its first launch there).
/// Nothing was counted.
pub const VGPU_PROGRESS_NO_SLOT: c_int = 1;
/// `n` does not fit the count (2^63 or more: bit 63 of the word is the flag).
pub const VGPU_PROGRESS_INVALID: c_int = -1;
/// A bug of the interposer (caught and logged).
pub const VGPU_PROGRESS_ERROR: c_int = -2;

/// `int vgpu_progress(uint64_t n)`: the application made `n` of its own units of progress
/// (training steps, tokens, requests; `vgpu.torch.progress`), added to its tenant's slot in the
/// schedule of every GPU where this process is a member (`Region::count_progress`). From the
/// first call on, the tenant's progress is counted in these units only, not in steps (`n` = 0
/// just says so). What the agent's redistribution of idle SMs measures each tenant by
/// (`docs/design/utility-redistribution.md`): a relaxed add per GPU, cheap enough per step or
/// per token. Returns [`VGPU_PROGRESS_OK`] (0), [`VGPU_PROGRESS_NO_SLOT`] (1),
/// [`VGPU_PROGRESS_INVALID`] (-1) or [`VGPU_PROGRESS_ERROR`] (-2).
#[unsafe(no_mangle)]
pub extern "C" fn vgpu_progress(n: u64) -> c_int {
    ffi_boundary!("vgpu_progress", fallback = VGPU_PROGRESS_ERROR, {
        if n & tenant_abi::compute::PROGRESS_HINTED != 0 {
            return VGPU_PROGRESS_INVALID;
        }
        let counted = launch::count_progress(n) + crate::closed_loop::count_progress(n);
        if counted == 0 {
            VGPU_PROGRESS_NO_SLOT
        } else {
            VGPU_PROGRESS_OK
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hook_is_found_by_name_and_base_name() {
        for (name, hook) in hooks() {
            assert_eq!(hook_by_name(name), Some(hook));
        }
        let by_base = |base: &CStr, flags| hook_by_base_name(base, flags);
        assert_eq!(
            by_base(c"cuMemAlloc", 0),
            Some(cuMemAlloc_v2 as *const c_void)
        );
        assert_eq!(
            by_base(c"cuGetProcAddress", 0),
            Some(cuGetProcAddress_v2 as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuMemAllocAsync",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuMemAllocAsync_ptsz as *const c_void)
        );
        assert_eq!(
            by_base(c"cuMemAllocAsync", 0),
            Some(cuMemAllocAsync as *const c_void)
        );
        assert_eq!(
            by_base(c"cuLaunchKernel", 0),
            Some(cuLaunchKernel as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuGraphLaunch",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuGraphLaunch_ptsz as *const c_void)
        );
        assert_eq!(
            by_base(c"cuStreamBeginCapture", 0),
            Some(cuStreamBeginCapture_v2 as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuStreamBeginCapture",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuStreamBeginCapture_v2_ptsz as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuStreamEndCapture",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuStreamEndCapture_ptsz as *const c_void)
        );
        assert_eq!(
            by_base(c"cuMemcpyHtoD", 0),
            Some(cuMemcpyHtoD_v2 as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuMemcpyHtoD",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuMemcpyHtoD_v2_ptds as *const c_void)
        );
        assert_eq!(
            by_base(
                c"cuMemsetD8Async",
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some(cuMemsetD8Async_ptsz as *const c_void)
        );
        assert_eq!(by_base(c"cuMemcpyHtoA", 0), None);
    }
}
