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
    /// The pinned host staging (`staging::acquire`) holding its bytes while swapped
    /// out; 0 while it is mapped.
    staging: usize,
    /// The staging buffer's size (at least `size`: a pooled buffer may be larger).
    staging_bytes: u64,
    /// The staging was pinned by `cuMemHostRegister` (else `cuMemHostAlloc`): how it is freed.
    staging_registered: bool,
    /// The staging is a run of slabs of the GPU's shared staging file (`staging::Buffer`).
    staging_shared: bool,
    /// A copy of it did not complete within its bound (`COPY_WAIT_BASE_MS`): its mapping and
    /// staging may still be in use by the copy engine, so neither is touched again, and the
    /// swap leaves it where it is (logged).
    stranded: bool,
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
            staging_bytes: 0,
            staging_registered: false,
            staging_shared: false,
            stranded: false,
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
    if found.stranded {
        // A copy of it may still be running (`SwapBacking`): its memory, mapping and staging are
        // left as they are, to the process's end.
        crate::log::error(format_args!(
            "freeing {address:#x}, whose swap copy never completed: its device memory and host \
             staging stay allocated until the process exits"
        ));
        return Some(CUDA_SUCCESS);
    }
    if found.staging != 0 {
        // Swapped out: its bytes are in the staging and its range is reserved, unmapped. The
        // staging goes to the pool, still reserved on the board (`staging`).
        crate::staging::recycle(
            usize::try_from(found.device).unwrap_or(0),
            crate::staging::Buffer {
                host: found.staging,
                bytes: found.staging_bytes,
                registered: found.staging_registered,
                shared: found.staging_shared,
            },
        );
        // SAFETY: the range was reserved by `alloc` with `found.size` bytes and is unmapped.
        return Some(unsafe { (vmm.free_range)(address, found.size) });
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

/// The swap's driver work (`swap::Backing`) on the real driver, for borrowed allocations, a batch
/// of chunks at a time. Out: for each chunk a pinned staging buffer (`staging::acquire`: pooled,
/// else reserved on the board and pinned by `cuMemHostAlloc`) and a `cuMemcpyDtoHAsync_v2` on a
/// stream of its own, all queued back to back; then, once the stream completed (bounded,
/// [`copy_wait_max`]), `cuMemUnmap` and `cuMemRelease` of each (the range stays reserved). In:
/// for each chunk `cuMemCreate`, `cuMemMap` at the same address, `cuMemSetAccess` and a
/// `cuMemcpyHtoDAsync_v2`, all queued; once the stream completed, each chunk is back and its
/// staging goes to the pool (`staging::recycle`). A chunk never loses its mapping before its
/// copy out completed, and is never back (so never lets the process run) before its copy in
/// completed. The copies need a current context on the calling thread, as the stream does.
///
/// The stream is created for each batch (`cuStreamCreate`, non-blocking, so that it waits for
/// no other stream of the process) and destroyed after it: a stream kept per context would
/// outlive a context the application destroys (the interposer does not watch `cuCtxDestroy`),
/// and a later context at the same address would meet a stale handle; a stream costs
/// microseconds against copies of gigabytes.
pub struct SwapBacking<'d> {
    pub driver: &'d Driver,
}

/// The longest a batch's copies may take before the swap gives up on them: a fixed part plus the
/// bytes at [`COPY_RATE_FLOOR_BYTES_PER_S`], far below the 45-55 GB/s a host link moves, so only a
/// hung copy engine reaches it.
pub const COPY_WAIT_BASE_MS: u64 = 2_000;
/// The rate [`copy_wait_max`] allows for: 1 GB/s.
pub const COPY_RATE_FLOOR_BYTES_PER_S: u64 = 1_000_000_000;

/// The wait bound of a batch copying `bytes`.
pub fn copy_wait_max(bytes: u64) -> std::time::Duration {
    std::time::Duration::from_millis(COPY_WAIT_BASE_MS)
        + std::time::Duration::from_nanos(
            bytes.saturating_mul(1_000_000_000) / COPY_RATE_FLOOR_BYTES_PER_S,
        )
}

/// The functions a swap needs besides `Vmm`'s and the staging's.
struct Copies {
    stream_create: FnStreamCreate,
    stream_destroy: FnStreamDestroy,
    stream_query: FnStreamSync,
    dtoh: FnMemcpyAsync,
    htod: FnMemcpyAsync,
    /// Per-chunk completion of a swap-out's copies; without them a chunk lands when the whole
    /// stream completed.
    events: Option<Events>,
}

/// The event functions (`cuEventCreate`, `cuEventRecord`, `cuEventQuery`, `cuEventDestroy_v2`).
#[derive(Clone, Copy)]
struct Events {
    create: FnEventCreate,
    record: FnEventRecord,
    query: FnEventQuery,
    destroy: FnEventDestroy,
}

impl Events {
    /// An event recorded on `stream` after what is queued there now; `None` when the driver
    /// refused (the caller then waits for the stream).
    fn after(&self, stream: CUstream) -> Option<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: `event` is valid for a write; a flag the driver defines.
        if unsafe { (self.create)(&mut event, CU_EVENT_DISABLE_TIMING) } != CUDA_SUCCESS
            || event.is_null()
        {
            return None;
        }
        // SAFETY: both created by this process's driver on the current context.
        if unsafe { (self.record)(event, stream) } != CUDA_SUCCESS {
            // SAFETY: created above, destroyed once.
            unsafe { (self.destroy)(event) };
            return None;
        }
        Some(event)
    }
}

impl Copies {
    fn of(driver: &Driver) -> Option<Copies> {
        let f = &driver.fns;
        let events = (|| {
            Some(Events {
                create: f.event_create?,
                record: f.event_record?,
                query: f.event_query?,
                destroy: f.event_destroy?,
            })
        })();
        Some(Copies {
            stream_create: f.stream_create?,
            stream_destroy: f.stream_destroy?,
            stream_query: f.stream_query?,
            dtoh: f.memcpy_dtoh_async?,
            htod: f.memcpy_htod_async?,
            events,
        })
    }

    /// A non-blocking stream of the current context for one batch.
    fn stream(&self) -> Result<CUstream, CUresult> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is valid for a write; a flag the driver defines.
        let rc = unsafe { (self.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING) };
        if rc != CUDA_SUCCESS || stream.is_null() {
            return Err(if rc == CUDA_SUCCESS {
                CUDA_ERROR_UNKNOWN
            } else {
                rc
            });
        }
        Ok(stream)
    }

    /// Waits, polling `cuStreamQuery` for at most `bound`, until the copies queued on `stream`
    /// completed. `Ok(true)`: completed; `Ok(false)`: not within the bound; `Err`: the driver's
    /// error for them (the copies did not all happen).
    fn wait(&self, stream: CUstream, bound: std::time::Duration) -> Result<bool, CUresult> {
        // SAFETY: `stream` was created by `stream` and is destroyed only after this.
        poll(|| unsafe { (self.stream_query)(stream) }, bound)
    }

    /// Waits like [`Copies::wait`] for the copies queued before `event` (`None`: for the whole
    /// stream).
    fn wait_for(
        &self,
        stream: CUstream,
        event: Option<CUevent>,
        bound: std::time::Duration,
    ) -> Result<bool, CUresult> {
        match (event, self.events) {
            // SAFETY: the event was recorded on `stream` by `Events::after` and is destroyed
            // only after this.
            (Some(event), Some(events)) => poll(|| unsafe { (events.query)(event) }, bound),
            _ => self.wait(stream, bound),
        }
    }

    /// Queues `copy` of `bytes` from `src` to `dst` on `stream` in pieces of at most `piece`
    /// bytes (a copy through the shared staging may not span two of its registrations). On an
    /// error, what was queued before it has completed when this returns (bounded), so that the
    /// caller may reuse the buffer or unmap the range.
    ///
    /// # Safety
    /// `dst` and `src` must be valid for `bytes` of such a copy and stay so until the stream
    /// completed, and every piece must lie within one registration of the host side.
    unsafe fn queue_pieces(
        &self,
        copy: FnMemcpyAsync,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: u64,
        piece: u64,
        stream: CUstream,
    ) -> CUresult {
        let mut queued = 0u64;
        while queued < bytes {
            let n = piece.min(bytes - queued);
            // SAFETY: within `dst` and `src` as the caller promises.
            let rc = unsafe { copy(dst + queued, src + queued, n as usize, stream) };
            if rc != CUDA_SUCCESS {
                if queued > 0 {
                    let _ = self.wait(stream, copy_wait_max(queued));
                }
                return rc;
            }
            queued += n;
        }
        CUDA_SUCCESS
    }

    fn destroy_event(&self, event: Option<CUevent>) {
        if let (Some(event), Some(events)) = (event, self.events) {
            // SAFETY: created by `Events::after`, destroyed once.
            unsafe { (events.destroy)(event) };
        }
    }

    fn destroy(&self, stream: CUstream) {
        // SAFETY: created by `stream`, destroyed once; work still queued on it (a copy past its
        // bound) completes first, as the driver defines it.
        unsafe { (self.stream_destroy)(stream) };
    }
}

impl SwapBacking<'_> {
    /// The table entry of a borrowed allocation at `address` of `size` bytes.
    fn lookup(&self, address: u64, size: u64, out: bool) -> Result<Backed, crate::swap::SwapError> {
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
        if found.stranded {
            return Err(error(CUDA_ERROR_NOT_READY));
        }
        assert_eq!(
            found.staging == 0,
            !out,
            "a chunk moves out once and back once"
        );
        assert!(found.staging == 0 || found.staging_bytes >= size);
        Ok(found)
    }

    /// The functions, or the error every chunk of a batch gets without them.
    fn functions(&self) -> Result<(Vmm, Copies), CUresult> {
        let vmm = Vmm::of(self.driver).ok_or(CUDA_ERROR_UNKNOWN)?;
        let copies = Copies::of(self.driver).ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        Ok((vmm, copies))
    }

    /// Marks `address` stranded: its copy did not complete within the bound.
    fn strand(&self, address: u64, handle: CUmemGenericAllocationHandle) {
        let mut table = backed();
        let entry = table.get_mut(&address).expect("a chunk being moved");
        entry.stranded = true;
        if handle != 0 {
            entry.handle = handle;
        }
    }
}

/// A chunk whose copy is queued on a batch's stream.
struct Queued {
    index: usize,
    address: u64,
    found: Backed,
    /// Out: its new staging; in: the staging its bytes come from.
    buffer: crate::staging::Buffer,
    /// In: the physical memory mapped for it.
    handle: CUmemGenericAllocationHandle,
}

/// Polls `query` (`cuStreamQuery` or `cuEventQuery`) for at most `bound` until it says done.
/// `Ok(true)`: done; `Ok(false)`: not within the bound; `Err`: the driver's error for the work
/// (it did not all happen).
fn poll(query: impl Fn() -> CUresult, bound: std::time::Duration) -> Result<bool, CUresult> {
    poll_between(query, || bound)
}

/// As [`poll`], with `between` called before every look: it may queue more work behind what is
/// awaited, and returns the bound in force (measured from the first look).
fn poll_between(
    query: impl Fn() -> CUresult,
    mut between: impl FnMut() -> std::time::Duration,
) -> Result<bool, CUresult> {
    let began = std::time::Instant::now();
    loop {
        let bound = between();
        match query() {
            CUDA_SUCCESS => return Ok(true),
            CUDA_ERROR_NOT_READY if began.elapsed() < bound => {
                // Copies of a gigabyte take tens of milliseconds: a short pause between looks
                // costs at most that much of it.
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            CUDA_ERROR_NOT_READY => return Ok(false),
            error => return Err(error),
        }
    }
}

fn copy_timed_out(direction: &str, bytes: u64, bound: std::time::Duration) {
    crate::log::error(format_args!(
        "the swap's copies {direction} ({}) did not complete within {} ms: the GPU's copy engine \
         may be hung; the chunks stay where they were, with their memory and host staging held \
         until the process exits (restart it if the GPU recovers)",
        crate::elastic::human(bytes),
        bound.as_millis()
    ));
}

/// A swap-out's chunks whose copies are queued on its stream, landing in order.
struct Landing<'f> {
    vmm: &'f Vmm,
    copies: &'f Copies,
    stream: CUstream,
    /// In the order of their copies, each with the event recorded after its copy (`None`: the
    /// driver had none, the stream tells).
    queued: std::collections::VecDeque<(Queued, Option<CUevent>)>,
    /// When the first copy was queued.
    began: Option<std::time::Instant>,
    /// Bytes whose copies completed.
    copied: u64,
    /// Bytes landed (unmapped, released) not yet counted free on the board.
    uncounted: u64,
    /// Count free on the board every this many bytes landed (`Backing::swap_out`).
    count_every: Option<u64>,
}

impl Landing<'_> {
    /// Counts free on the board what landed and is not counted yet.
    fn flush(&mut self, counters: &mut impl crate::swap::Counters) {
        if self.uncounted > 0 {
            counters.swapped_out(std::mem::take(&mut self.uncounted));
        }
    }
}

impl SwapBacking<'_> {
    /// Lands the queued chunks whose copies completed, in order: each is unmapped and released
    /// and its room counted free when a piece's worth landed. With `wait`, waits for every one
    /// (each bounded by [`copy_wait_max`] of its bytes); without, stops at the first still
    /// copying. A copy past its bound strands its chunk and every later one (their copies are
    /// behind it); a copy the driver failed leaves its chunk and every later one resident.
    fn land(
        &self,
        landing: &mut Landing,
        results: &mut [Option<crate::swap::OutResult>],
        counters: &mut impl crate::swap::Counters,
        wait: bool,
    ) {
        use crate::swap::{OutResult, SwapError};
        let (vmm, copies, stream) = (landing.vmm, landing.copies, landing.stream);
        while let Some(&(ref q, event)) = landing.queued.front() {
            let size = q.found.size as u64;
            let bound = if wait {
                copy_wait_max(size)
            } else {
                std::time::Duration::ZERO
            };
            let waited = copies.wait_for(stream, event, bound);
            if !wait && waited == Ok(false) {
                return;
            }
            let (q, event) = landing.queued.pop_front().expect("looked at above");
            if waited != Ok(true) {
                // This chunk and those behind it on the stream did not all land. Past the bound,
                // their copies may still write their buffers and read their chunks: all stay as
                // they are (the buffers stay reserved, never reused). On the driver's error, they
                // are still mapped with their contents and their staging goes back to the pool.
                if waited == Ok(false) {
                    let behind: u64 = landing
                        .queued
                        .iter()
                        .map(|(q, _)| q.found.size as u64)
                        .sum();
                    copy_timed_out("to host memory", size + behind, bound);
                }
                let rest = std::iter::once((q, event)).chain(landing.queued.drain(..));
                for (q, event) in rest {
                    copies.destroy_event(event);
                    let result = match waited {
                        Err(rc) => {
                            let device = usize::try_from(q.found.device).unwrap_or(0);
                            crate::staging::recycle(device, q.buffer);
                            rc
                        }
                        _ => {
                            self.strand(q.address, 0);
                            CUDA_ERROR_NOT_READY
                        }
                    };
                    results[q.index] = Some(OutResult::Failed(SwapError {
                        address: q.address,
                        result,
                    }));
                }
                return;
            }
            copies.destroy_event(event);
            landing.copied += size;
            let device = usize::try_from(q.found.device).unwrap_or(0);
            // SAFETY: mapped by `alloc` (or the last `swap_in`) with this size; its copy out
            // completed (its event or the stream said so), and nothing else of the process runs.
            let rc = unsafe { (vmm.unmap)(q.address, q.found.size) };
            if rc != CUDA_SUCCESS {
                // Still mapped, with its contents: the staging goes back to the pool.
                crate::staging::recycle(device, q.buffer);
                results[q.index] = Some(OutResult::Failed(SwapError {
                    address: q.address,
                    result: rc,
                }));
                continue;
            }
            // SAFETY: the handle is no longer mapped anywhere; released once.
            let released = unsafe { (vmm.release)(q.found.handle) };
            if released != CUDA_SUCCESS {
                crate::log::error(format_args!(
                    "cuMemRelease of a swapped-out chunk failed ({released}); its memory may \
                     stay on the GPU until the process exits"
                ));
            }
            {
                let mut table = backed();
                let entry = table
                    .get_mut(&q.address)
                    .expect("looked up before its copy");
                entry.handle = 0;
                entry.staging = q.buffer.host;
                entry.staging_bytes = q.buffer.bytes;
                entry.staging_registered = q.buffer.registered;
                entry.staging_shared = q.buffer.shared;
            }
            results[q.index] = Some(OutResult::Moved);
            if let Some(piece) = landing.count_every {
                landing.uncounted += size;
                if landing.uncounted >= piece {
                    counters.swapped_out(landing.uncounted);
                    crate::log::debug(format_args!(
                        "{} out counted free {:.1} ms after the first copy ({} landed, {} \
                         chunk(s) still copying)",
                        crate::elastic::human(landing.uncounted),
                        landing
                            .began
                            .map_or(0.0, |began| began.elapsed().as_secs_f64() * 1e3),
                        crate::elastic::human(landing.copied),
                        landing.queued.len()
                    ));
                    landing.uncounted = 0;
                }
            }
        }
    }

    /// A chunk of `device` about to go out gets `size` bytes of staging (`staging::acquire`).
    /// A fresh pin while earlier chunks' copies are queued runs on a thread of its own, and this
    /// one lands and counts those chunks meanwhile: on an H200 a 1 GiB pin blocked their
    /// counting 132 ms, and the swap-in waiting for that room started as much later.
    fn staging_for(
        &self,
        landing: &mut Landing,
        results: &mut [Option<crate::swap::OutResult>],
        counters: &mut impl crate::swap::Counters,
        device: usize,
        size: u64,
    ) -> Result<crate::staging::Acquired, crate::staging::Unavailable> {
        if landing.queued.is_empty() {
            // Nothing to land meanwhile.
            return crate::staging::acquire(self.driver, device, size, counters);
        }
        match crate::staging::reserve(self.driver, device, size, counters)? {
            crate::staging::Reserved::Ready(acquired) => Ok(acquired),
            crate::staging::Reserved::ToPin(reservation) => {
                let pinned = self.pin_while_landing(&reservation, landing, results, counters);
                reservation.settle(pinned, counters)
            }
        }
    }

    /// Pins `reservation` on a thread of its own (with this thread's context current there)
    /// while this one lands the queued chunks whose copies complete and counts them free; then
    /// waits for the pin. Pins here instead when no thread can be started or no context is
    /// current. A pinning thread that panicked is the chunk's error (`CUDA_ERROR_UNKNOWN`): no
    /// panic reaches the application. The registration may hold the driver's other calls, this
    /// thread's looks among them, as the shared file's registration does
    /// (`staging::REGISTER_REST`); the touching before it (0.13 of 0.30 s for 4 GiB on an H200
    /// host) does not.
    fn pin_while_landing(
        &self,
        reservation: &crate::staging::Reservation,
        landing: &mut Landing,
        results: &mut [Option<crate::swap::OutResult>],
        counters: &mut impl crate::swap::Counters,
    ) -> Result<(crate::staging::Buffer, std::time::Duration), CUresult> {
        assert!(!landing.queued.is_empty(), "copies to land meanwhile");
        let driver = self.driver;
        let (Some(get_current), Some(set_current)) =
            (driver.fns.ctx_get_current, driver.fns.ctx_set_current)
        else {
            return reservation.pin(driver);
        };
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: `context` is valid for a write.
        if unsafe { get_current(&mut context) } != CUDA_SUCCESS || context.is_null() {
            return reservation.pin(driver);
        }
        let context = context as usize;
        std::thread::scope(|scope| {
            let spawned = std::thread::Builder::new()
                .name("vgpu-staging-pin".into())
                .spawn_scoped(scope, move || {
                    // SAFETY: `context` is the swapping thread's current context, which lives
                    // on while it waits for this thread; making it current takes no pointer.
                    match unsafe { set_current(context as CUcontext) } {
                        CUDA_SUCCESS => reservation.pin(driver),
                        rc => Err(rc),
                    }
                });
            let Ok(pinning) = spawned else {
                return reservation.pin(driver);
            };
            // Bounded by the pin: once every queued chunk landed there is nothing to look at,
            // and the join below waits for the pin alone.
            let began = crate::shm::monotonic_ns();
            while !pinning.is_finished() && !landing.queued.is_empty() {
                self.land(landing, results, counters, false);
                crate::launch::between_looks(began, crate::shm::monotonic_ns(), PIN_LOOK_SLEEP);
            }
            pinning.join().unwrap_or_else(|_| {
                crate::log::error(format_args!(
                    "pinning swap staging panicked; the chunk stays resident"
                ));
                Err(CUDA_ERROR_UNKNOWN)
            })
        })
    }
}

/// The pause between two looks at the queued copies while a chunk's staging is pinned on
/// another thread ([`SwapBacking::pin_while_landing`]), after the first looks only yield: a
/// gigabyte copies in about 20 ms, and a landed chunk is counted free within about this long
/// (a sleep wakes 50 us or more late), at a few percent of a CPU.
const PIN_LOOK_SLEEP: std::time::Duration = std::time::Duration::from_micros(50);

impl crate::swap::Backing for SwapBacking<'_> {
    fn swap_out(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut impl crate::swap::Counters,
        count_every: Option<u64>,
    ) -> (Vec<crate::swap::OutResult>, crate::swap::SwapTimes) {
        use crate::swap::{OutResult, SwapError, SwapTimes};
        let mut times = SwapTimes::default();
        let mut results: Vec<Option<OutResult>> = vec![None; chunks.len()];
        let fail_all = |result| {
            let all = chunks
                .iter()
                .map(|&(address, _)| OutResult::Failed(SwapError { address, result }))
                .collect();
            (all, SwapTimes::default())
        };
        let (vmm, copies) = match self.functions() {
            Ok(functions) => functions,
            Err(result) => return fail_all(result),
        };
        let stream = match copies.stream() {
            Ok(stream) => stream,
            Err(result) => return fail_all(result),
        };
        let (mut staging_gave_up, mut copied_at_wait) = (false, None::<u64>);
        let mut landing = Landing {
            vmm: &vmm,
            copies: &copies,
            stream,
            queued: std::collections::VecDeque::with_capacity(chunks.len()),
            began: None,
            copied: 0,
            uncounted: 0,
            count_every,
        };
        for (index, &(address, size)) in chunks.iter().enumerate() {
            let error = |result| OutResult::Failed(SwapError { address, result });
            let found = match self.lookup(address, size, false) {
                Ok(found) => found,
                Err(e) => {
                    results[index] = Some(OutResult::Failed(e));
                    continue;
                }
            };
            let device = usize::try_from(found.device).unwrap_or(0);
            if landing.began.is_none() {
                crate::staging::trim(self.driver, device, counters);
            }
            let mut acquired = self.staging_for(&mut landing, &mut results, counters, device, size);
            if matches!(acquired, Err(crate::staging::Unavailable::Budget))
                && count_every.is_some()
                && landing.began.is_some()
                && !staging_gave_up
            {
                // In pieces, short of staging with copies already queued: they land and are
                // counted first, so that the process taking the room back brings those chunks
                // in and frees the staging they emptied, and other processes free what they
                // keep idle (`Counters::wait_for_staging`); then, bounded, again. Only after
                // something landed since the last wait (so at most once per landed chunk), and
                // never again once a wait found nothing.
                self.land(&mut landing, &mut results, counters, true);
                landing.flush(counters);
                if copied_at_wait != Some(landing.copied) {
                    copied_at_wait = Some(landing.copied);
                    if counters.wait_for_staging(size) {
                        acquired =
                            self.staging_for(&mut landing, &mut results, counters, device, size);
                    } else {
                        staging_gave_up = true;
                    }
                }
            }
            let buffer = match acquired {
                Ok(acquired) => {
                    if !acquired.pinning.is_zero() {
                        times.pinning_ns += acquired.pinning.as_nanos() as u64;
                        times.pinned_bytes += acquired.buffer.bytes;
                    }
                    times.staging_wait_ns += acquired.waited.as_nanos() as u64;
                    acquired.buffer
                }
                Err(crate::staging::Unavailable::Budget) => {
                    results[index] = Some(OutResult::StagingRefused);
                    continue;
                }
                Err(crate::staging::Unavailable::Driver(rc)) => {
                    results[index] = Some(error(rc));
                    continue;
                }
            };
            landing.began.get_or_insert_with(std::time::Instant::now);
            // SAFETY: the buffer holds at least `found.size` bytes and no other copy uses it;
            // `address` is mapped with that many (the process is quiet and drained).
            let rc = unsafe {
                copies.queue_pieces(
                    copies.dtoh,
                    buffer.host as CUdeviceptr,
                    address,
                    size,
                    crate::staging::copy_piece_bytes(buffer.host, buffer.shared),
                    stream,
                )
            };
            if rc != CUDA_SUCCESS {
                crate::staging::recycle(device, buffer);
                results[index] = Some(error(rc));
                continue;
            }
            let event = copies.events.and_then(|events| events.after(stream));
            landing.queued.push_back((
                Queued {
                    index,
                    address,
                    found,
                    buffer,
                    handle: 0,
                },
                event,
            ));
            // What landed while this one was queued (or its staging pinned) is counted now, not
            // after the whole batch.
            self.land(&mut landing, &mut results, counters, false);
        }
        self.land(&mut landing, &mut results, counters, true);
        landing.flush(counters);
        if let Some(began) = landing.began {
            times.copy_ns = began.elapsed().as_nanos() as u64;
        }
        times.copied_bytes = landing.copied;
        copies.destroy(stream);
        let results: Vec<OutResult> = results
            .into_iter()
            .map(|r| r.expect("every chunk has its result"))
            .collect();
        assert_eq!(results.len(), chunks.len());
        (results, times)
    }

    fn swap_in<C: crate::swap::Counters>(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut C,
        more: &mut dyn FnMut(&mut C) -> Vec<(u64, u64)>,
    ) -> (
        Vec<Result<(), crate::swap::SwapError>>,
        crate::swap::InTimes,
    ) {
        use crate::swap::SwapError;
        let began = std::time::Instant::now();
        let mut results: Vec<Option<Result<(), SwapError>>> = vec![None; chunks.len()];
        let fail_all = |result| {
            (
                chunks
                    .iter()
                    .map(|&(address, _)| Err(SwapError { address, result }))
                    .collect(),
                crate::swap::InTimes::default(),
            )
        };
        let (vmm, copies) = match self.functions() {
            Ok(functions) => functions,
            Err(result) => return fail_all(result),
        };
        let stream = match copies.stream() {
            Ok(stream) => stream,
            Err(result) => return fail_all(result),
        };
        let mut queued: Vec<Queued> = Vec::with_capacity(chunks.len());
        // Maps chunk `index` (of `results`) again and queues its copy on `stream`.
        let queue = |backing: &mut Self,
                     counters: &mut C,
                     queued: &mut Vec<Queued>,
                     results: &mut Vec<Option<Result<(), SwapError>>>,
                     index: usize,
                     (address, size): (u64, u64)| {
            let found = match backing.lookup(address, size, true) {
                Ok(found) => found,
                Err(e) => {
                    results[index] = Some(Err(e));
                    return;
                }
            };
            if queued.is_empty() {
                let device = usize::try_from(found.device).unwrap_or(0);
                crate::staging::trim(backing.driver, device, counters);
            }
            match map_again(&vmm, &copies, stream, address, &found) {
                Ok(handle) => queued.push(Queued {
                    index,
                    address,
                    found,
                    buffer: crate::staging::Buffer {
                        host: found.staging,
                        bytes: found.staging_bytes,
                        registered: found.staging_registered,
                        shared: found.staging_shared,
                    },
                    handle,
                }),
                Err(result) => results[index] = Some(Err(SwapError { address, result })),
            }
        };
        for (index, &chunk) in chunks.iter().enumerate() {
            queue(self, counters, &mut queued, &mut results, index, chunk);
        }
        let mut bytes: u64 = queued.iter().map(|q| q.found.size as u64).sum();
        let queued_at = std::time::Instant::now();
        // Waits for the copies, and meanwhile queues behind them the chunks whose room freed
        // (`more`); the bound grows with what joins.
        let waited = poll_between(
            // SAFETY: `stream` was created above and is destroyed only after this.
            || unsafe { (copies.stream_query)(stream) },
            || {
                for chunk in more(counters) {
                    results.push(None);
                    let index = results.len() - 1;
                    queue(self, counters, &mut queued, &mut results, index, chunk);
                    if let Some(q) = queued.last().filter(|q| q.index == index) {
                        bytes += q.found.size as u64;
                    }
                }
                copy_wait_max(bytes)
            },
        );
        let bound = copy_wait_max(bytes);
        let times = crate::swap::InTimes {
            mapping_ns: u64::try_from(queued_at.duration_since(began).as_nanos())
                .unwrap_or(u64::MAX),
            copies_ns: u64::try_from(queued_at.elapsed().as_nanos()).unwrap_or(u64::MAX),
        };
        copies.destroy(stream);
        if waited == Ok(false) {
            copy_timed_out("back to the GPU", bytes, bound);
        }
        for q in queued {
            let rc = match waited {
                Ok(true) => CUDA_SUCCESS,
                Ok(false) => {
                    // The copy may still read the staging and write the mapping: the chunk stays
                    // out (the process stays held), and neither is touched again.
                    self.strand(q.address, q.handle);
                    results[q.index] = Some(Err(SwapError {
                        address: q.address,
                        result: CUDA_ERROR_NOT_READY,
                    }));
                    continue;
                }
                Err(rc) => rc,
            };
            if rc != CUDA_SUCCESS {
                // SAFETY: mapped and created by `map_again`, undone once; its copy is over (the
                // stream reported its error), and the staging keeps the bytes.
                unsafe {
                    (vmm.unmap)(q.address, q.found.size);
                    (vmm.release)(q.handle);
                }
                results[q.index] = Some(Err(SwapError {
                    address: q.address,
                    result: rc,
                }));
                continue;
            }
            let device = usize::try_from(q.found.device).unwrap_or(0);
            crate::staging::recycle(device, q.buffer);
            let mut table = backed();
            let entry = table.get_mut(&q.address).expect("looked up above");
            entry.handle = q.handle;
            entry.staging = 0;
            entry.staging_bytes = 0;
            entry.staging_registered = false;
            entry.staging_shared = false;
            results[q.index] = Some(Ok(()));
        }
        let results: Vec<Result<(), SwapError>> = results
            .into_iter()
            .map(|r| r.expect("every chunk has its result"))
            .collect();
        assert!(results.len() >= chunks.len());
        (results, times)
    }

    fn trim(&mut self, device: usize, counters: &mut impl crate::swap::Counters) {
        crate::staging::trim(self.driver, device, counters);
    }

    fn release_idle(&mut self, device: usize, counters: &mut impl crate::swap::Counters) {
        crate::staging::free_idle(self.driver, device, counters);
    }

    fn driver_free(&mut self, address: u64) -> Option<u64> {
        let device = backed().get(&address)?.device;
        let f = &self.driver.fns;
        let (get_device, get_info) = (f.ctx_get_device?, f.mem_get_info?);
        let mut current: CUdevice = -1;
        // SAFETY: a valid out-pointer for cuCtxGetDevice.
        if unsafe { get_device(&mut current) } != CUDA_SUCCESS || current != device {
            // cuMemGetInfo tells about the current context's device only.
            return None;
        }
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers for cuMemGetInfo; the driver's own function, not the
        // tenant's view of it (`hooks`).
        (unsafe { get_info(&mut free, &mut total) } == CUDA_SUCCESS).then_some(free as u64)
    }

    fn warm(
        &mut self,
        device: usize,
        chunks: &[u64],
        cap: u64,
        counters: &mut impl crate::swap::Counters,
    ) -> u64 {
        crate::staging::warm(self.driver, device, chunks, cap, counters)
    }
}

/// Creates physical memory for the swapped-out chunk at `address`, maps it there, makes it
/// accessible and queues the copy of its staging on `stream`; the new handle, or the driver's
/// error with everything undone.
fn map_again(
    vmm: &Vmm,
    copies: &Copies,
    stream: CUstream,
    address: u64,
    found: &Backed,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let prop = device_memory(found.device);
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` and `prop` are valid; the real driver's `cuMemCreate`.
    let rc = unsafe { (vmm.create)(&mut handle, found.size, &prop, 0) };
    if rc != CUDA_SUCCESS {
        return Err(rc);
    }
    // SAFETY: the range is reserved with `found.size` bytes and unmapped since the swap-out.
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
            // SAFETY: the staging holds at least `found.size` bytes and stays untouched until
            // the stream completed; the range is mapped and accessible.
            rc = unsafe {
                copies.queue_pieces(
                    copies.htod,
                    address,
                    found.staging as CUdeviceptr,
                    found.size as u64,
                    crate::staging::copy_piece_bytes(found.staging, found.staging_shared),
                    stream,
                )
            };
        }
        if rc != CUDA_SUCCESS {
            // SAFETY: mapped just above; whatever was queued on it has completed
            // (`Copies::queue_pieces`).
            unsafe { (vmm.unmap)(address, found.size) };
        }
    }
    if rc != CUDA_SUCCESS {
        // SAFETY: created above, released once; the staging keeps the bytes.
        unsafe { (vmm.release)(handle) };
        return Err(rc);
    }
    Ok(handle)
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
