//! The real driver: `dlopen(VGPU_REAL_LIBCUDA or "libcuda.so.1", RTLD_NOW | RTLD_LOCAL)` once,
//! `dlsym` of every function we wrap on that handle, and the table that maps a real function's
//! address to our hook (used by the `dlsym` and `cuGetProcAddress` paths).
//!
//! glibc's `dlsym` is reached through `dlvsym(RTLD_NEXT, "dlsym", ...)`, never through the
//! symbol `dlsym`, which this library overrides.
//!
//! A thread-local flag marks "inside our own resolution": while it is set, our `dlsym` forwards
//! everything untouched and `driver()` does not re-enter its one-time initialisation (which would
//! deadlock on the `OnceLock`), whatever the real driver's constructors call.
#![allow(unsafe_code)]

use crate::sys::*;
use std::cell::Cell;
use std::ffi::{CStr, CString, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

/// glibc's `dlsym`, resolved on first use. Read by the `dlsym` trampoline, hence a plain static.
pub static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Resolves glibc's `dlsym` (the default version of glibc 2.34+, else the x86-64 base version).
pub fn libc_dlsym() -> Option<FnDlsym> {
    let mut found = REAL_DLSYM.load(Ordering::Acquire);
    if found.is_null() {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: both strings are NUL-terminated literals; RTLD_NEXT is a valid pseudo-handle.
            found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !found.is_null() {
                break;
            }
        }
        if found.is_null() {
            return None;
        }
        REAL_DLSYM.store(found, Ordering::Release);
    }
    // SAFETY: `found` is glibc's `dlsym`, whose C signature is `FnDlsym`.
    Some(unsafe { std::mem::transmute::<*mut c_void, FnDlsym>(found) })
}

thread_local! {
    static IN_RESOLUTION: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside the interposer's own symbol resolution.
pub fn in_resolution() -> bool {
    IN_RESOLUTION.with(Cell::get)
}

/// Runs `f` with the resolution flag set (restored even if `f` panics).
pub fn with_guard<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_RESOLUTION.with(|flag| flag.set(self.0));
        }
    }
    let _restore = Restore(IN_RESOLUTION.with(|flag| flag.replace(true)));
    f()
}

/// Calls glibc's `dlsym` with the guard set.
pub fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let Some(dlsym) = libc_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: `name` is NUL-terminated; glibc's dlsym accepts any handle value and reports an
    // invalid one through dlerror.
    with_guard(|| unsafe { dlsym(handle, name.as_ptr()) })
}

macro_rules! driver_functions {
    ($($field:ident: $ty:ty = $name:literal;)*) => {
        /// The real driver's functions that the hooks forward to (`None`: not exported by this
        /// driver).
        pub struct Fns {
            $(pub $field: Option<$ty>,)*
        }

        impl Fns {
            fn resolve(handle: *mut c_void) -> Fns {
                Fns {
                    $($field: {
                        let found = lookup(handle, $name);
                        if found.is_null() {
                            None
                        } else {
                            // SAFETY: the symbol `$name` of the CUDA driver has the C signature
                            // `$ty` (see `sys`), and `found` is not null.
                            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(found) })
                        }
                    },)*
                }
            }
        }
    };
}

driver_functions! {
    mem_alloc: FnMemAlloc = c"cuMemAlloc_v2";
    mem_alloc_pitch: FnMemAllocPitch = c"cuMemAllocPitch_v2";
    mem_alloc_managed: FnMemAllocManaged = c"cuMemAllocManaged";
    mem_free: FnMemFree = c"cuMemFree_v2";
    mem_create: FnMemCreate = c"cuMemCreate";
    mem_release: FnMemRelease = c"cuMemRelease";
    mem_address_reserve: FnMemAddressReserve = c"cuMemAddressReserve";
    mem_address_free: FnMemAddressFree = c"cuMemAddressFree";
    mem_map: FnMemMap = c"cuMemMap";
    mem_unmap: FnMemUnmap = c"cuMemUnmap";
    mem_set_access: FnMemSetAccess = c"cuMemSetAccess";
    mem_get_allocation_granularity: FnMemGetAllocationGranularity = c"cuMemGetAllocationGranularity";
    mem_host_alloc: FnMemHostAlloc = c"cuMemHostAlloc";
    mem_free_host: FnMemFreeHost = c"cuMemFreeHost";
    mem_host_register: FnMemHostRegister = c"cuMemHostRegister_v2";
    mem_host_unregister: FnMemHostUnregister = c"cuMemHostUnregister";
    memcpy_dtoh: FnMemcpyDtoH = c"cuMemcpyDtoH_v2";
    memcpy_htod: FnMemcpyHtoD = c"cuMemcpyHtoD_v2";
    stream_create: FnStreamCreate = c"cuStreamCreate";
    stream_destroy: FnStreamDestroy = c"cuStreamDestroy_v2";
    mem_alloc_async: FnMemAllocAsync = c"cuMemAllocAsync";
    mem_alloc_async_ptsz: FnMemAllocAsync = c"cuMemAllocAsync_ptsz";
    mem_alloc_from_pool_async: FnMemAllocFromPoolAsync = c"cuMemAllocFromPoolAsync";
    mem_alloc_from_pool_async_ptsz: FnMemAllocFromPoolAsync = c"cuMemAllocFromPoolAsync_ptsz";
    mem_free_async: FnMemFreeAsync = c"cuMemFreeAsync";
    mem_free_async_ptsz: FnMemFreeAsync = c"cuMemFreeAsync_ptsz";
    array_create: FnArrayCreate = c"cuArrayCreate_v2";
    array_3d_create: FnArray3DCreate = c"cuArray3DCreate_v2";
    array_destroy: FnArrayDestroy = c"cuArrayDestroy";
    mem_get_info: FnMemGetInfo = c"cuMemGetInfo_v2";
    ipc_get_mem_handle: FnIpcGetMemHandle = c"cuIpcGetMemHandle";
    device_total_mem: FnDeviceTotalMem = c"cuDeviceTotalMem_v2";
    ctx_get_device: FnCtxGetDevice = c"cuCtxGetDevice";
    device_primary_ctx_retain: FnDevicePrimaryCtxRetain = c"cuDevicePrimaryCtxRetain";
    get_proc_address: FnGetProcAddress = c"cuGetProcAddress";
    get_proc_address_v2: FnGetProcAddressV2 = c"cuGetProcAddress_v2";
    launch_kernel: FnLaunchKernel = c"cuLaunchKernel";
    launch_kernel_ptsz: FnLaunchKernel = c"cuLaunchKernel_ptsz";
    launch_kernel_ex: FnLaunchKernelEx = c"cuLaunchKernelEx";
    launch_kernel_ex_ptsz: FnLaunchKernelEx = c"cuLaunchKernelEx_ptsz";
    launch_cooperative_kernel: FnLaunchCooperativeKernel = c"cuLaunchCooperativeKernel";
    launch_cooperative_kernel_ptsz: FnLaunchCooperativeKernel = c"cuLaunchCooperativeKernel_ptsz";
    launch_cooperative_kernel_multi_device: FnLaunchCooperativeKernelMultiDevice =
        c"cuLaunchCooperativeKernelMultiDevice";
    graph_launch: FnGraphLaunch = c"cuGraphLaunch";
    graph_launch_ptsz: FnGraphLaunch = c"cuGraphLaunch_ptsz";
    stream_begin_capture: FnStreamBeginCapture = c"cuStreamBeginCapture";
    stream_begin_capture_ptsz: FnStreamBeginCapture = c"cuStreamBeginCapture_ptsz";
    stream_begin_capture_v2: FnStreamBeginCaptureV2 = c"cuStreamBeginCapture_v2";
    stream_begin_capture_v2_ptsz: FnStreamBeginCaptureV2 = c"cuStreamBeginCapture_v2_ptsz";
    stream_end_capture: FnStreamEndCapture = c"cuStreamEndCapture";
    stream_end_capture_ptsz: FnStreamEndCapture = c"cuStreamEndCapture_ptsz";
    stream_is_capturing: FnStreamIsCapturing = c"cuStreamIsCapturing";
    event_create: FnEventCreate = c"cuEventCreate";
    event_record: FnEventRecord = c"cuEventRecord";
    event_query: FnEventQuery = c"cuEventQuery";
    event_destroy: FnEventDestroy = c"cuEventDestroy_v2";
    event_synchronize: FnEventSynchronize = c"cuEventSynchronize";
    stream_synchronize: FnStreamSync = c"cuStreamSynchronize";
    stream_synchronize_ptsz: FnStreamSync = c"cuStreamSynchronize_ptsz";
    stream_query: FnStreamSync = c"cuStreamQuery";
    stream_query_ptsz: FnStreamSync = c"cuStreamQuery_ptsz";
    ctx_synchronize: FnCtxSynchronize = c"cuCtxSynchronize";
    memcpy_async: FnMemcpyAsync = c"cuMemcpyAsync";
    memcpy_async_ptsz: FnMemcpyAsync = c"cuMemcpyAsync_ptsz";
    memcpy_dtod_async: FnMemcpyAsync = c"cuMemcpyDtoDAsync_v2";
    memcpy_dtod_async_ptsz: FnMemcpyAsync = c"cuMemcpyDtoDAsync_v2_ptsz";
    memcpy_htod_async: FnMemcpyAsync = c"cuMemcpyHtoDAsync_v2";
    memcpy_htod_async_ptsz: FnMemcpyAsync = c"cuMemcpyHtoDAsync_v2_ptsz";
    memcpy_dtoh_async: FnMemcpyAsync = c"cuMemcpyDtoHAsync_v2";
    memcpy_dtoh_async_ptsz: FnMemcpyAsync = c"cuMemcpyDtoHAsync_v2_ptsz";
    pointer_get_attribute: FnPointerGetAttribute = c"cuPointerGetAttribute";
    ctx_synchronize_v2: FnCtxSynchronizeV2 = c"cuCtxSynchronize_v2";
    ctx_get_current: FnCtxGetCurrent = c"cuCtxGetCurrent";
    ctx_set_current: FnCtxSetCurrent = c"cuCtxSetCurrent";
    device_get_count: FnDeviceGetCount = c"cuDeviceGetCount";
    device_get_uuid_v2: FnDeviceGetUuid = c"cuDeviceGetUuid_v2";
    device_get_uuid: FnDeviceGetUuid = c"cuDeviceGetUuid";
    device_get: FnDeviceGet = c"cuDeviceGet";
    device_get_dev_resource: FnDeviceGetDevResource = c"cuDeviceGetDevResource";
    dev_sm_resource_split_by_count: FnDevSmResourceSplitByCount =
        c"cuDevSmResourceSplitByCount";
    dev_resource_generate_desc: FnDevResourceGenerateDesc = c"cuDevResourceGenerateDesc";
    green_ctx_create: FnGreenCtxCreate = c"cuGreenCtxCreate";
    green_ctx_stream_create: FnGreenCtxStreamCreate = c"cuGreenCtxStreamCreate";
    stream_wait_event: FnStreamWaitEvent = c"cuStreamWaitEvent";
    driver_get_version: FnDriverGetVersion = c"cuDriverGetVersion";
    // Copies, memsets, stream memory operations and legacy launches held by the swap's hold
    // (`exports::held_copy_hook!`).
    memcpy: unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize) -> CUresult = c"cuMemcpy";
    memcpy_ptds: unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpy_ptds";
    memcpy_peer: unsafe extern "C" fn(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, usize) -> CUresult =
        c"cuMemcpyPeer";
    memcpy_peer_ptds: unsafe extern "C" fn(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, usize) -> CUresult =
        c"cuMemcpyPeer_ptds";
    memcpy_htod_ptds: unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult =
        c"cuMemcpyHtoD_v2_ptds";
    memcpy_dtoh_ptds: unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpyDtoH_v2_ptds";
    memcpy_dtod: unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpyDtoD_v2";
    memcpy_dtod_ptds: unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpyDtoD_v2_ptds";
    memcpy_dtoa: unsafe extern "C" fn(CUarray, usize, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpyDtoA_v2";
    memcpy_dtoa_ptds: unsafe extern "C" fn(CUarray, usize, CUdeviceptr, usize) -> CUresult =
        c"cuMemcpyDtoA_v2_ptds";
    memcpy_atod: unsafe extern "C" fn(CUdeviceptr, CUarray, usize, usize) -> CUresult =
        c"cuMemcpyAtoD_v2";
    memcpy_atod_ptds: unsafe extern "C" fn(CUdeviceptr, CUarray, usize, usize) -> CUresult =
        c"cuMemcpyAtoD_v2_ptds";
    memcpy_2d: unsafe extern "C" fn(*const c_void) -> CUresult = c"cuMemcpy2D_v2";
    memcpy_2d_ptds: unsafe extern "C" fn(*const c_void) -> CUresult = c"cuMemcpy2D_v2_ptds";
    memcpy_2d_unaligned: unsafe extern "C" fn(*const c_void) -> CUresult =
        c"cuMemcpy2DUnaligned_v2";
    memcpy_2d_unaligned_ptds: unsafe extern "C" fn(*const c_void) -> CUresult =
        c"cuMemcpy2DUnaligned_v2_ptds";
    memcpy_3d: unsafe extern "C" fn(*const c_void) -> CUresult = c"cuMemcpy3D_v2";
    memcpy_3d_ptds: unsafe extern "C" fn(*const c_void) -> CUresult = c"cuMemcpy3D_v2_ptds";
    memcpy_3d_peer: unsafe extern "C" fn(*const c_void) -> CUresult = c"cuMemcpy3DPeer";
    memcpy_3d_peer_ptds: unsafe extern "C" fn(*const c_void) -> CUresult =
        c"cuMemcpy3DPeer_ptds";
    memcpy_peer_async: unsafe extern "C" fn(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, usize, CUstream) -> CUresult =
        c"cuMemcpyPeerAsync";
    memcpy_peer_async_ptsz: unsafe extern "C" fn(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, usize, CUstream) -> CUresult =
        c"cuMemcpyPeerAsync_ptsz";
    memcpy_2d_async: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy2DAsync_v2";
    memcpy_2d_async_ptsz: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy2DAsync_v2_ptsz";
    memcpy_3d_async: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy3DAsync_v2";
    memcpy_3d_async_ptsz: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy3DAsync_v2_ptsz";
    memcpy_3d_peer_async: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy3DPeerAsync";
    memcpy_3d_peer_async_ptsz: unsafe extern "C" fn(*const c_void, CUstream) -> CUresult =
        c"cuMemcpy3DPeerAsync_ptsz";
    memcpy_batch_async: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, usize, *mut c_void, *mut c_void, usize, *mut c_void, CUstream) -> CUresult =
        c"cuMemcpyBatchAsync";
    memcpy_batch_async_ptsz: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, usize, *mut c_void, *mut c_void, usize, *mut c_void, CUstream) -> CUresult =
        c"cuMemcpyBatchAsync_ptsz";
    memcpy_batch_async_v2: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, usize, *mut c_void, *mut c_void, usize, CUstream) -> CUresult =
        c"cuMemcpyBatchAsync_v2";
    memcpy_batch_async_v2_ptsz: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, usize, *mut c_void, *mut c_void, usize, CUstream) -> CUresult =
        c"cuMemcpyBatchAsync_v2_ptsz";
    memcpy_3d_batch_async: unsafe extern "C" fn(usize, *mut c_void, *mut c_void, u64, CUstream) -> CUresult =
        c"cuMemcpy3DBatchAsync";
    memcpy_3d_batch_async_ptsz: unsafe extern "C" fn(usize, *mut c_void, *mut c_void, u64, CUstream) -> CUresult =
        c"cuMemcpy3DBatchAsync_ptsz";
    memcpy_3d_batch_async_v2: unsafe extern "C" fn(usize, *mut c_void, u64, CUstream) -> CUresult =
        c"cuMemcpy3DBatchAsync_v2";
    memcpy_3d_batch_async_v2_ptsz: unsafe extern "C" fn(usize, *mut c_void, u64, CUstream) -> CUresult =
        c"cuMemcpy3DBatchAsync_v2_ptsz";
    memset_d8: unsafe extern "C" fn(CUdeviceptr, u8, usize) -> CUresult = c"cuMemsetD8_v2";
    memset_d8_ptds: unsafe extern "C" fn(CUdeviceptr, u8, usize) -> CUresult =
        c"cuMemsetD8_v2_ptds";
    memset_d2d8: unsafe extern "C" fn(CUdeviceptr, usize, u8, usize, usize) -> CUresult =
        c"cuMemsetD2D8_v2";
    memset_d2d8_ptds: unsafe extern "C" fn(CUdeviceptr, usize, u8, usize, usize) -> CUresult =
        c"cuMemsetD2D8_v2_ptds";
    memset_d8_async: unsafe extern "C" fn(CUdeviceptr, u8, usize, CUstream) -> CUresult =
        c"cuMemsetD8Async";
    memset_d8_async_ptsz: unsafe extern "C" fn(CUdeviceptr, u8, usize, CUstream) -> CUresult =
        c"cuMemsetD8Async_ptsz";
    memset_d2d8_async: unsafe extern "C" fn(CUdeviceptr, usize, u8, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D8Async";
    memset_d2d8_async_ptsz: unsafe extern "C" fn(CUdeviceptr, usize, u8, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D8Async_ptsz";
    memset_d16: unsafe extern "C" fn(CUdeviceptr, u16, usize) -> CUresult =
        c"cuMemsetD16_v2";
    memset_d16_ptds: unsafe extern "C" fn(CUdeviceptr, u16, usize) -> CUresult =
        c"cuMemsetD16_v2_ptds";
    memset_d2d16: unsafe extern "C" fn(CUdeviceptr, usize, u16, usize, usize) -> CUresult =
        c"cuMemsetD2D16_v2";
    memset_d2d16_ptds: unsafe extern "C" fn(CUdeviceptr, usize, u16, usize, usize) -> CUresult =
        c"cuMemsetD2D16_v2_ptds";
    memset_d16_async: unsafe extern "C" fn(CUdeviceptr, u16, usize, CUstream) -> CUresult =
        c"cuMemsetD16Async";
    memset_d16_async_ptsz: unsafe extern "C" fn(CUdeviceptr, u16, usize, CUstream) -> CUresult =
        c"cuMemsetD16Async_ptsz";
    memset_d2d16_async: unsafe extern "C" fn(CUdeviceptr, usize, u16, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D16Async";
    memset_d2d16_async_ptsz: unsafe extern "C" fn(CUdeviceptr, usize, u16, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D16Async_ptsz";
    memset_d32: unsafe extern "C" fn(CUdeviceptr, u32, usize) -> CUresult =
        c"cuMemsetD32_v2";
    memset_d32_ptds: unsafe extern "C" fn(CUdeviceptr, u32, usize) -> CUresult =
        c"cuMemsetD32_v2_ptds";
    memset_d2d32: unsafe extern "C" fn(CUdeviceptr, usize, u32, usize, usize) -> CUresult =
        c"cuMemsetD2D32_v2";
    memset_d2d32_ptds: unsafe extern "C" fn(CUdeviceptr, usize, u32, usize, usize) -> CUresult =
        c"cuMemsetD2D32_v2_ptds";
    memset_d32_async: unsafe extern "C" fn(CUdeviceptr, u32, usize, CUstream) -> CUresult =
        c"cuMemsetD32Async";
    memset_d32_async_ptsz: unsafe extern "C" fn(CUdeviceptr, u32, usize, CUstream) -> CUresult =
        c"cuMemsetD32Async_ptsz";
    memset_d2d32_async: unsafe extern "C" fn(CUdeviceptr, usize, u32, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D32Async";
    memset_d2d32_async_ptsz: unsafe extern "C" fn(CUdeviceptr, usize, u32, usize, usize, CUstream) -> CUresult =
        c"cuMemsetD2D32Async_ptsz";
    stream_write_value32: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWriteValue32";
    stream_write_value32_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWriteValue32_ptsz";
    stream_write_value32_v2: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWriteValue32_v2";
    stream_write_value32_v2_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWriteValue32_v2_ptsz";
    stream_write_value64: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWriteValue64";
    stream_write_value64_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWriteValue64_ptsz";
    stream_write_value64_v2: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWriteValue64_v2";
    stream_write_value64_v2_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWriteValue64_v2_ptsz";
    stream_wait_value32: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWaitValue32";
    stream_wait_value32_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWaitValue32_ptsz";
    stream_wait_value32_v2: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWaitValue32_v2";
    stream_wait_value32_v2_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult =
        c"cuStreamWaitValue32_v2_ptsz";
    stream_wait_value64: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWaitValue64";
    stream_wait_value64_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWaitValue64_ptsz";
    stream_wait_value64_v2: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWaitValue64_v2";
    stream_wait_value64_v2_ptsz: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult =
        c"cuStreamWaitValue64_v2_ptsz";
    stream_batch_mem_op: unsafe extern "C" fn(CUstream, c_uint, *mut c_void, c_uint) -> CUresult =
        c"cuStreamBatchMemOp";
    stream_batch_mem_op_ptsz: unsafe extern "C" fn(CUstream, c_uint, *mut c_void, c_uint) -> CUresult =
        c"cuStreamBatchMemOp_ptsz";
    stream_batch_mem_op_v2: unsafe extern "C" fn(CUstream, c_uint, *mut c_void, c_uint) -> CUresult =
        c"cuStreamBatchMemOp_v2";
    stream_batch_mem_op_v2_ptsz: unsafe extern "C" fn(CUstream, c_uint, *mut c_void, c_uint) -> CUresult =
        c"cuStreamBatchMemOp_v2_ptsz";
    launch_legacy: unsafe extern "C" fn(CUfunction) -> CUresult = c"cuLaunch";
    launch_grid: unsafe extern "C" fn(CUfunction, c_int, c_int) -> CUresult =
        c"cuLaunchGrid";
    launch_grid_async: unsafe extern "C" fn(CUfunction, c_int, c_int, CUstream) -> CUresult =
        c"cuLaunchGridAsync";
}

/// The loaded real driver.
pub struct Driver {
    pub fns: Fns,
    /// (real function address, our hook address), for every hook the driver exports.
    substitutes: Vec<(usize, usize)>,
}

impl Driver {
    /// Our hook for a real driver function, if we wrap it.
    pub fn substitute(&self, real: *mut c_void) -> Option<*mut c_void> {
        let real = real as usize;
        self.substitutes
            .iter()
            .find(|(r, _)| *r == real)
            .map(|&(_, hook)| hook as *mut c_void)
    }
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

/// The real driver if a hook has loaded it already; never loads it (the NVML hooks use this, so
/// that a process that only asks NVML does not get libcuda loaded into it).
pub fn driver_if_loaded() -> Option<&'static Driver> {
    DRIVER.get().and_then(Option::as_ref)
}

/// The real driver, loaded on first use; `None` if it cannot be loaded (logged once).
pub fn driver() -> Option<&'static Driver> {
    if let Some(loaded) = DRIVER.get() {
        return loaded.as_ref();
    }
    if in_resolution() {
        // Re-entered from inside our own initialisation (a constructor of the real driver):
        // answer "not loaded yet" rather than deadlock.
        return None;
    }
    DRIVER.get_or_init(|| with_guard(load)).as_ref()
}

/// Opens the real library that the variable `variable` names, else `default`: its handle and
/// path, or `None` (a path with a NUL byte is logged here; a library that does not load is left
/// to `missing`, which knows whether that is an error).
pub(crate) fn open_library(
    variable: &str,
    default: &str,
    missing: impl FnOnce(&str),
) -> Option<(*mut c_void, String)> {
    let path = std::env::var(variable)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| default.to_owned());
    let Ok(c_path) = CString::new(path.clone()) else {
        crate::log::error(format_args!("{variable} `{path}` contains a NUL byte"));
        return None;
    };
    // SAFETY: `c_path` is NUL-terminated; dlopen has no other preconditions.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        missing(&path);
        return None;
    }
    Some((handle, path))
}

fn load() -> Option<Driver> {
    let (handle, path) =
        open_library(tenant_abi::env::var::REAL_LIBCUDA, "libcuda.so.1", |path| {
            crate::log::error(format_args!(
                "cannot load the real CUDA driver `{path}` (set VGPU_REAL_LIBCUDA to its path)"
            ))
        })?;
    let fns = Fns::resolve(handle);
    let substitutes: Vec<(usize, usize)> = crate::exports::hooks()
        .iter()
        .filter_map(|&(name, hook)| {
            let real = lookup(handle, name);
            (!real.is_null()).then_some((real as usize, hook as usize))
        })
        .collect();
    if substitutes.iter().any(|&(real, hook)| real == hook) {
        crate::log::error(format_args!(
            "{} `{path}` is the interposer itself; point it at the real driver",
            tenant_abi::env::var::REAL_LIBCUDA
        ));
        return None;
    }
    crate::log::debug(format_args!(
        "loaded {path}: {} of {} hooked functions exported",
        substitutes.len(),
        crate::exports::hooks().len()
    ));
    let driver = Driver { fns, substitutes };
    check(&driver);
    check_copy_paths(handle);
    Some(driver)
}

/// Checks once, at load, which copy, memset and launch entry points this driver exports that the
/// interposer does not hold while borrowed memory is in host memory (`swap`): any keeps the swap
/// off in this process (said once if it was asked for).
fn check_copy_paths(handle: *mut c_void) {
    let exported: Vec<String> = crate::swap::UNHELD_COPY_ENTRY_POINTS
        .iter()
        .filter(|name| !lookup(handle, name).is_null())
        .map(|name| name.to_string_lossy().into_owned())
        .collect();
    crate::swap::copy_paths_checked(exported, crate::swap::Asked::from_env());
}

/// Checks once, at load, that this driver is one the hooks were written for (`crate::compat`):
/// its API version, and what its `cuGetProcAddress` answers for every entry point we wrap, for
/// the default and the per-thread default stream, at its own version and at the one we were
/// built for. Logs what does not match; never fails the load.
fn check(driver: &Driver) {
    let version = driver.fns.driver_get_version.and_then(|get| {
        let mut version: c_int = 0;
        // SAFETY: `cuDriverGetVersion` writes one int through a valid pointer.
        (unsafe { get(&mut version) } == CUDA_SUCCESS).then_some(version)
    });
    let mut unknown = Vec::new();
    let mut asks = 0usize;
    if let (Some(get_proc), Some(version)) = (driver.fns.get_proc_address_v2, version) {
        for base in crate::compat::base_names() {
            let Ok(c_base) = CString::new(base.clone()) else {
                continue;
            };
            for asked in crate::compat::versions_to_ask(version) {
                for flags in [0, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM] {
                    let mut found: *mut c_void = std::ptr::null_mut();
                    let mut status: c_int = 0;
                    // SAFETY: `c_base` is NUL-terminated, `found` and `status` are valid for
                    // writes; the real driver's contract for `cuGetProcAddress_v2`.
                    let rc = with_guard(|| unsafe {
                        get_proc(c_base.as_ptr(), &mut found, asked, flags, &mut status)
                    });
                    asks += 1;
                    if rc != CUDA_SUCCESS || found.is_null() || driver.substitute(found).is_some() {
                        continue;
                    }
                    if crate::exports::hook_by_base_name(&c_base, flags).is_some()
                        && !unknown.contains(&base)
                    {
                        unknown.push(base.clone());
                    }
                }
            }
        }
    }
    let level = crate::compat::level(version);
    if unknown.is_empty() && asks > 0 {
        crate::log::debug(format_args!(
            "driver check: CUDA driver API {:?}; {asks} cuGetProcAddress answers for {} wrapped entry points, every one a function the hooks know",
            version,
            crate::compat::base_names().len()
        ));
    }
    for line in crate::compat::findings(version, &unknown) {
        match level {
            crate::compat::Level::Warn => crate::log::error(format_args!("{line}")),
            crate::compat::Level::Debug => crate::log::debug(format_args!("{line}")),
        }
    }
}
