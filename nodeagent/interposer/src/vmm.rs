//! Allocations backed by the driver's virtual memory management (issue 17,
//! `docs/design/elastic-memory.md`): an address range reserved (`cuMemAddressReserve`), physical
//! memory created on the device (`cuMemCreate`), mapped into the range and made accessible
//! (`cuMemMap`, `cuMemSetAccess`). Elastic memory backs borrowed allocations this way, because
//! only memory the interposer maps itself can be swapped out and back under the same address.
//!
//! It serves two callers. Borrowed allocations ([`Purpose::Borrowed`]: a `cuMemAlloc_v2` or
//! `cuMemAllocPitch_v2` past the tenant's request, `hooks`) are always backed so; a driver
//! without one of the functions, or a call that fails, refuses them (the caller answers
//! `CUDA_ERROR_OUT_OF_MEMORY`): borrowed memory that could not be swapped must not exist. And
//! `VGPU_MEMORY_VMM=1` ([`Purpose::Everything`]) backs every `cuMemAlloc_v2` of the process, to
//! prove on real jobs that frameworks run unchanged on such memory; there a driver that cannot
//! leaves the allocation to the real `cuMemAlloc_v2` (logged once). Sizes round up to the
//! driver's granularity (2 MiB on an H100), and that rounded size is what the allocation is
//! charged.
//!
//! The physical memory is created through the real `cuMemCreate`, not our hook, so the
//! allocation is charged once, as the pointer `cuMemAlloc_v2` returned.
#![allow(unsafe_code)]

use crate::real::Driver;
use crate::sys::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Whether `VGPU_MEMORY_VMM=1` asks for every `cuMemAlloc_v2` to be VMM-backed.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os(tenant_abi::env::var::MEMORY_VMM).is_some_and(|value| value == "1")
    })
}

/// Why an allocation is VMM-backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// `VGPU_MEMORY_VMM=1`: every `cuMemAlloc_v2`; the real call serves when this path cannot.
    Everything,
    /// Past the tenant's request (elastic memory): this path or nothing.
    Borrowed,
}

/// One VMM-backed allocation: its physical memory, the (rounded) size of its range, and why.
#[derive(Clone, Copy)]
struct Backed {
    /// 0 while swapped out (the physical memory was released).
    handle: CUmemGenericAllocationHandle,
    size: usize,
    purpose: Purpose,
    device: CUdevice,
    /// The pinned host staging (`cuMemHostAlloc`) holding its bytes while swapped out; 0 while
    /// it is mapped.
    staging: usize,
}

/// How many allocations the table holds: every `cuMemFree_v2` asks it, so while it is 0 (no
/// borrowing, no `VGPU_MEMORY_VMM`) no lock is taken.
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn backed() -> std::sync::MutexGuard<'static, BTreeMap<CUdeviceptr, Backed>> {
    static BACKED: OnceLock<Mutex<BTreeMap<CUdeviceptr, Backed>>> = OnceLock::new();
    BACKED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The functions this path needs, if the driver has them all.
struct Vmm {
    create: FnMemCreate,
    release: FnMemRelease,
    reserve: FnMemAddressReserve,
    free_range: FnMemAddressFree,
    map: FnMemMap,
    unmap: FnMemUnmap,
    set_access: FnMemSetAccess,
    granularity: FnMemGetAllocationGranularity,
}

impl Vmm {
    fn of(driver: &Driver) -> Option<Vmm> {
        let f = &driver.fns;
        Some(Vmm {
            create: f.mem_create?,
            release: f.mem_release?,
            reserve: f.mem_address_reserve?,
            free_range: f.mem_address_free?,
            map: f.mem_map?,
            unmap: f.mem_unmap?,
            set_access: f.mem_set_access?,
            granularity: f.mem_get_allocation_granularity?,
        })
    }
}

fn unavailable_once(purpose: Purpose, why: &str) {
    static SAID: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    if SAID[purpose as usize].swap(true, Ordering::Relaxed) {
        return;
    }
    match purpose {
        Purpose::Everything => crate::log::error(format_args!(
            "{}=1: {why}; allocations use cuMemAlloc_v2 instead (said once)",
            tenant_abi::env::var::MEMORY_VMM
        )),
        Purpose::Borrowed => crate::log::error(format_args!(
            "{why}: memory past the tenant's request cannot be borrowed on this driver (it must \
             be VMM-backed); allocations past the request are refused (said once)"
        )),
    }
}

fn device_memory(device: CUdevice) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: 0,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// The driver's allocation granularity on `device` (2 MiB on an H100), if it has the VMM
/// functions; asked once per device.
pub fn granularity(driver: &Driver, device: CUdevice) -> Option<usize> {
    static ASKED: [OnceLock<Option<usize>>; tenant_abi::DEVICES_MAX] =
        [const { OnceLock::new() }; tenant_abi::DEVICES_MAX];
    let ask = || {
        let vmm = Vmm::of(driver)?;
        let prop = device_memory(device);
        let mut granularity = 0usize;
        // SAFETY: both pointers are valid for the call; the driver's contract.
        let rc =
            unsafe { (vmm.granularity)(&mut granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) };
        (rc == CUDA_SUCCESS && granularity > 0).then_some(granularity)
    };
    match usize::try_from(device).ok().and_then(|d| ASKED.get(d)) {
        Some(cached) => *cached.get_or_init(ask),
        None => ask(),
    }
}

/// `bytes` rounded up to the granularity of `device`: what a VMM-backed allocation takes.
pub fn rounded(driver: &Driver, device: CUdevice, bytes: usize) -> Option<usize> {
    bytes.checked_next_multiple_of(granularity(driver, device)?)
}

/// Backs an allocation of `bytes` on `device` with VMM and writes its address to `out`. `None`
/// when this path cannot serve it (the caller then calls the real `cuMemAlloc_v2`, or refuses a
/// borrowed allocation); otherwise the driver's answer (`CUDA_ERROR_OUT_OF_MEMORY` included: the
/// device has no room either way).
///
/// # Safety
/// `out` is valid for a write of one `CUdeviceptr` (the caller's `cuMemAlloc_v2` contract).
pub unsafe fn alloc(
    driver: &Driver,
    device: CUdevice,
    bytes: usize,
    out: *mut CUdeviceptr,
    purpose: Purpose,
) -> Option<CUresult> {
    if out.is_null() || bytes == 0 {
        return None;
    }
    let Some(vmm) = Vmm::of(driver) else {
        unavailable_once(
            purpose,
            "the driver lacks a virtual memory management function",
        );
        return None;
    };
    let Some(size) = rounded(driver, device, bytes) else {
        unavailable_once(purpose, "cuMemGetAllocationGranularity failed");
        return None;
    };
    let prop = device_memory(device);
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` and `prop` are valid; the real driver's `cuMemCreate`.
    let rc = unsafe { (vmm.create)(&mut handle, size, &prop, 0) };
    if rc != CUDA_SUCCESS {
        return Some(rc);
    }
    let mut address: CUdeviceptr = 0;
    // SAFETY: `address` is valid for a write; no fixed address or alignment asked.
    let rc = unsafe { (vmm.reserve)(&mut address, size, 0, 0, 0) };
    if rc != CUDA_SUCCESS {
        // SAFETY: `handle` came from `cuMemCreate` above and is released once.
        unsafe { (vmm.release)(handle) };
        return Some(rc);
    }
    // SAFETY: the range was reserved above with `size` bytes, `handle` holds `size` bytes.
    let mut rc = unsafe { (vmm.map)(address, size, 0, handle, 0) };
    if rc == CUDA_SUCCESS {
        let access = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor.
        rc = unsafe { (vmm.set_access)(address, size, &access, 1) };
        if rc != CUDA_SUCCESS {
            // SAFETY: mapped just above.
            unsafe { (vmm.unmap)(address, size) };
        }
    }
    if rc != CUDA_SUCCESS {
        // SAFETY: reserved and created above, each undone once.
        unsafe {
            (vmm.free_range)(address, size);
            (vmm.release)(handle);
        }
        return Some(rc);
    }
    static FIRST: [AtomicBool; 2] = [AtomicBool::new(true), AtomicBool::new(true)];
    if FIRST[purpose as usize].swap(false, Ordering::Relaxed) {
        crate::log::debug(format_args!(
            "the first VMM-backed allocation ({purpose:?}: {bytes} bytes on device {device}): \
             {size} bytes mapped at {address:#x}"
        ));
    }
    let replaced = backed().insert(
        address,
        Backed {
            handle,
            size,
            purpose,
            device,
            staging: 0,
        },
    );
    assert!(replaced.is_none(), "the driver reserved {address:#x} twice");
    LIVE.fetch_add(1, Ordering::SeqCst);
    // SAFETY: `out` is valid for a write by the caller's contract.
    unsafe { out.write(address) };
    Some(CUDA_SUCCESS)
}

/// The size a VMM-backed allocation at `address` takes on the device, if it is one.
pub fn size_of(address: CUdeviceptr) -> Option<u64> {
    if LIVE.load(Ordering::SeqCst) == 0 {
        return None;
    }
    backed().get(&address).map(|b| b.size as u64)
}

/// Why the VMM-backed allocation that `address` lies in (its start or inside it) is backed so,
/// if it lies in one of ours.
pub fn purpose_at(address: CUdeviceptr) -> Option<Purpose> {
    if LIVE.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let table = backed();
    let (start, found) = table.range(..=address).next_back()?;
    (address - start < found.size as u64).then_some(found.purpose)
}

/// Frees `address` if it is a VMM-backed allocation: unmaps it, releases its memory and its
/// range. `None` when it is not one of ours (the caller calls the real `cuMemFree_v2`).
pub fn free(driver: &Driver, address: CUdeviceptr) -> Option<CUresult> {
    // Every `cuMemFree_v2` passes here: while nothing is VMM-backed no lock is taken.
    if LIVE.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let found = backed().remove(&address)?;
    LIVE.fetch_sub(1, Ordering::SeqCst);
    let Some(vmm) = Vmm::of(driver) else {
        // Only allocated when every function was there.
        return Some(CUDA_ERROR_UNKNOWN);
    };
    if found.staging != 0 {
        // Swapped out: its bytes are in the staging and its range is reserved, unmapped.
        let staging_freed = driver.fns.mem_free_host.map_or(CUDA_SUCCESS, |free_host| {
            // SAFETY: the staging came from `cuMemHostAlloc` in `swap_out` and is freed once.
            unsafe { free_host(found.staging as *mut std::ffi::c_void) }
        });
        // SAFETY: the range was reserved by `alloc` with `found.size` bytes and is unmapped.
        let freed = unsafe { (vmm.free_range)(address, found.size) };
        return Some(if freed != CUDA_SUCCESS {
            freed
        } else {
            staging_freed
        });
    }
    // SAFETY: `address` was mapped by `alloc` with `found.size` bytes and `found.handle`, and was
    // just removed from the table, so it is undone once.
    unsafe {
        let unmapped = (vmm.unmap)(address, found.size);
        let released = (vmm.release)(found.handle);
        let freed = (vmm.free_range)(address, found.size);
        Some(
            [unmapped, released, freed]
                .into_iter()
                .find(|rc| *rc != CUDA_SUCCESS)
                .unwrap_or(CUDA_SUCCESS),
        )
    }
}

/// The swap's driver work (`swap::Backing`) on the real driver, for borrowed allocations: out is
/// `cuMemHostAlloc` staging, `cuMemcpyDtoH_v2`, `cuMemUnmap`, `cuMemRelease` (the range stays
/// reserved); in is `cuMemCreate`, `cuMemMap` at the same address, `cuMemSetAccess`,
/// `cuMemcpyHtoD_v2`, `cuMemFreeHost`. Synchronous copies on the calling thread, one chunk at a
/// time (the design's two streams each way are not built); the copies need a current context.
pub struct SwapBacking<'d> {
    pub driver: &'d Driver,
}

/// The functions a swap needs besides `Vmm`'s.
struct Staging {
    host_alloc: FnMemHostAlloc,
    free_host: FnMemFreeHost,
    dtoh: FnMemcpyDtoH,
    htod: FnMemcpyHtoD,
}

impl Staging {
    fn of(driver: &Driver) -> Option<Staging> {
        let f = &driver.fns;
        Some(Staging {
            host_alloc: f.mem_host_alloc?,
            free_host: f.mem_free_host?,
            dtoh: f.memcpy_dtoh?,
            htod: f.memcpy_htod?,
        })
    }
}

impl SwapBacking<'_> {
    /// The table entry of a borrowed allocation at `address` of `size` bytes, and the functions.
    fn lookup(
        &self,
        address: u64,
        size: u64,
        out: bool,
    ) -> Result<(Backed, Vmm, Staging), crate::swap::SwapError> {
        let error = |result| crate::swap::SwapError { address, result };
        let found = backed()
            .get(&address)
            .copied()
            .ok_or(error(CUDA_ERROR_INVALID_VALUE))?;
        assert_eq!(
            found.size as u64, size,
            "a chunk's size is its allocation's"
        );
        assert_eq!(
            found.purpose,
            Purpose::Borrowed,
            "only borrowed chunks swap"
        );
        assert_eq!(
            found.staging == 0,
            !out,
            "a chunk moves out once and back once"
        );
        let vmm = Vmm::of(self.driver).ok_or(error(CUDA_ERROR_UNKNOWN))?;
        let staging = Staging::of(self.driver).ok_or(error(CUDA_ERROR_NOT_SUPPORTED))?;
        Ok((found, vmm, staging))
    }
}

impl crate::swap::Backing for SwapBacking<'_> {
    fn swap_out(&mut self, address: u64, size: u64) -> Result<(), crate::swap::SwapError> {
        let (found, vmm, staging) = self.lookup(address, size, false)?;
        let error = |result| crate::swap::SwapError { address, result };
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `host` is valid for a write; pinned host memory of the chunk's size.
        let rc = unsafe { (staging.host_alloc)(&mut host, found.size, 0) };
        if rc != CUDA_SUCCESS || host.is_null() {
            return Err(error(rc));
        }
        // SAFETY: `host` holds `found.size` bytes; `address` is mapped with that many.
        let mut rc = unsafe { (staging.dtoh)(host, address, found.size) };
        if rc == CUDA_SUCCESS {
            // SAFETY: mapped by `alloc` (or the last `swap_in`) with this size.
            rc = unsafe { (vmm.unmap)(address, found.size) };
        }
        if rc != CUDA_SUCCESS {
            // SAFETY: allocated above, freed once; the chunk is still mapped.
            unsafe { (staging.free_host)(host) };
            return Err(error(rc));
        }
        // SAFETY: the handle is no longer mapped anywhere; released once.
        let released = unsafe { (vmm.release)(found.handle) };
        if released != CUDA_SUCCESS {
            crate::log::error(format_args!(
                "cuMemRelease of a swapped-out chunk failed ({released}); its memory may stay \
                 on the GPU until the process exits"
            ));
        }
        let mut table = backed();
        let entry = table.get_mut(&address).expect("looked up above");
        entry.handle = 0;
        entry.staging = host as usize;
        Ok(())
    }

    fn swap_in(&mut self, address: u64, size: u64) -> Result<(), crate::swap::SwapError> {
        let (found, vmm, staging) = self.lookup(address, size, true)?;
        let error = |result| crate::swap::SwapError { address, result };
        let prop = device_memory(found.device);
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` and `prop` are valid; the real driver's `cuMemCreate`.
        let rc = unsafe { (vmm.create)(&mut handle, found.size, &prop, 0) };
        if rc != CUDA_SUCCESS {
            return Err(error(rc));
        }
        // SAFETY: the range is reserved with `found.size` bytes and unmapped since `swap_out`.
        let mut rc = unsafe { (vmm.map)(address, found.size, 0, handle, 0) };
        if rc == CUDA_SUCCESS {
            let access = CUmemAccessDesc {
                location: CUmemLocation {
                    type_: CU_MEM_LOCATION_TYPE_DEVICE,
                    id: found.device,
                },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is mapped; one descriptor.
            rc = unsafe { (vmm.set_access)(address, found.size, &access, 1) };
            if rc == CUDA_SUCCESS {
                // SAFETY: the staging holds `found.size` bytes; the range is mapped, accessible.
                rc = unsafe { (staging.htod)(address, found.staging as *const _, found.size) };
            }
            if rc != CUDA_SUCCESS {
                // SAFETY: mapped just above.
                unsafe { (vmm.unmap)(address, found.size) };
            }
        }
        if rc != CUDA_SUCCESS {
            // SAFETY: created above, released once; the staging keeps the bytes.
            unsafe { (vmm.release)(handle) };
            return Err(error(rc));
        }
        // SAFETY: the staging came from `cuMemHostAlloc` in `swap_out`; its bytes are copied back.
        unsafe { (staging.free_host)(found.staging as *mut std::ffi::c_void) };
        let mut table = backed();
        let entry = table.get_mut(&address).expect("looked up above");
        entry.handle = handle;
        entry.staging = 0;
        Ok(())
    }
}

/// Waits for the work queued in each of `contexts` (`cuCtxSetCurrent` + `cuCtxSynchronize` on a
/// thread of its own, so that the wait is bounded by `swap::DRAIN_WAIT_MAX_MS` even for a kernel
/// that never ends: that thread is then left waiting). Whether all of it finished. A swap-out
/// calls it before it unmaps anything, so that no kernel in flight touches a chunk being moved.
pub fn drain(contexts: Vec<usize>) -> bool {
    let Some(driver) = crate::real::driver() else {
        return false;
    };
    let (Some(set_current), Some(synchronize)) =
        (driver.fns.ctx_set_current, driver.fns.ctx_synchronize)
    else {
        return false;
    };
    let (done, finished) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("vgpu-drain".to_owned())
        .spawn(move || {
            let drained = contexts.iter().all(|&context| {
                // SAFETY: `context` is a context this process created allocations in (or the
                // current one); setting it current on this thread and synchronising it are the
                // driver's calls for that, with no pointer arguments.
                context == 0
                    || unsafe {
                        set_current(context as CUcontext) == CUDA_SUCCESS
                            && synchronize() == CUDA_SUCCESS
                    }
            });
            let _ = done.send(drained);
        });
    if spawned.is_err() {
        return false;
    }
    finished
        .recv_timeout(std::time::Duration::from_millis(
            crate::swap::DRAIN_WAIT_MAX_MS,
        ))
        .unwrap_or(false)
}
