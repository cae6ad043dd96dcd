//! The CUDA driver-API types, constants and function signatures the interposer touches, declared
//! by hand from the driver API's public ABI (64-bit Linux). Style item 11 asks for bindgen
//! output here; the machines that build this crate have no `cuda.h`, and the surface is small, so
//! it is written out and exercised through the fake driver in the tests instead.
//!
//! Nothing here is unsafe code by itself: function-pointer types are only called in `exports`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = c_ulonglong;
pub type CUmemGenericAllocationHandle = c_ulonglong;
pub type CUstream = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUarray = *mut c_void;
pub type cuuint64_t = u64;
pub type CUcontext = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUgraph = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// The driver is shutting down (the process is exiting).
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND: CUresult = 302;
pub const CUDA_ERROR_SHARED_OBJECT_INIT_FAILED: CUresult = 303;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CU_MEM_LOCATION_TYPE_DEVICE`: `CUmemLocation::id` is a device ordinal.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`: ask for the `_ptsz`/`_ptds` variants.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: cuuint64_t = 1 << 1;

/// `CU_EVENT_DISABLE_TIMING`: the cheapest event kind (no timestamp).
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`, and the memory type of device memory it answers.
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;

/// `CUlaunchConfig` (`cuLaunchKernelEx`); only `h_stream` is read.
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

#[repr(C)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp`; only the leading fields are read.
#[repr(C)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`: who may access a mapping, and how.
#[repr(C)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;

#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub num_channels: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

pub type FnMemAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
pub type FnMemAllocPitch =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
pub type FnMemAllocManaged = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
pub type FnMemFree = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type FnMemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    c_ulonglong,
) -> CUresult;
pub type FnMemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
pub type FnMemAddressReserve =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong) -> CUresult;
pub type FnMemAddressFree = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type FnMemMap = unsafe extern "C" fn(
    CUdeviceptr,
    usize,
    usize,
    CUmemGenericAllocationHandle,
    c_ulonglong,
) -> CUresult;
pub type FnMemUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type FnMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
pub type FnMemFreeHost = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub type FnMemHostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
pub type FnMemHostUnregister = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub type FnMemcpyDtoH = unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult;
pub type FnMemcpyHtoD = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult;
/// `CU_MEMHOSTALLOC_PORTABLE`: the pinned memory counts as pinned in every context, so that the
/// swap's staging can serve a chunk of any context of the process.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: the same for memory pinned by `cuMemHostRegister`.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x1;
pub type FnStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
pub type FnStreamDestroy = unsafe extern "C" fn(CUstream) -> CUresult;
pub type FnMemSetAccess =
    unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult;
pub type FnMemGetAllocationGranularity =
    unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult;
pub type FnMemAllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
pub type FnMemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
pub type FnMemFreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
pub type FnArrayCreate =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
pub type FnArray3DCreate =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
pub type FnArrayDestroy = unsafe extern "C" fn(CUarray) -> CUresult;
/// `CUipcMemHandle`: 64 opaque bytes.
#[repr(C)]
pub struct CUipcMemHandle {
    pub reserved: [c_char; 64],
}
pub type FnIpcGetMemHandle = unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult;
pub type FnMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
pub type FnDeviceTotalMem = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;
pub type FnCtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
/// `cuDriverGetVersion`: the driver API version, 1000 * major + 10 * minor.
pub type FnDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type FnDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
/// `cuGetProcAddress` (CUDA 11.3+): symbol, pfn, cudaVersion, flags.
pub type FnGetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, cuuint64_t) -> CUresult;
/// `cuGetProcAddress_v2` (CUDA 12.0+): adds `CUdriverProcAddressQueryResult *symbolStatus`.
pub type FnGetProcAddressV2 = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    cuuint64_t,
    *mut c_int,
) -> CUresult;
pub type FnLaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
pub type FnLaunchKernelEx = unsafe extern "C" fn(
    *const CUlaunchConfig,
    CUfunction,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
pub type FnLaunchCooperativeKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
) -> CUresult;
/// `cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, numDevices, flags)`; the
/// parameter list is passed through unread.
pub type FnLaunchCooperativeKernelMultiDevice =
    unsafe extern "C" fn(*mut c_void, c_uint, c_uint) -> CUresult;
pub type FnGraphLaunch = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;
/// `cuStreamBeginCapture` and `_ptsz` as first exported (CUDA 10.0): the stream only.
pub type FnStreamBeginCapture = unsafe extern "C" fn(CUstream) -> CUresult;
/// `cuStreamBeginCapture_v2` and `_v2_ptsz` (CUDA 10.1+): adds `CUstreamCaptureMode mode`.
pub type FnStreamBeginCaptureV2 = unsafe extern "C" fn(CUstream, c_int) -> CUresult;
pub type FnStreamEndCapture = unsafe extern "C" fn(CUstream, *mut CUgraph) -> CUresult;
/// `cuStreamIsCapturing(stream, CUstreamCaptureStatus *)`.
pub type FnStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
/// `CU_STREAM_CAPTURE_STATUS_NONE`: the stream is not capturing.
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub type FnEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
pub type FnEventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub type FnEventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
pub type FnEventDestroy = unsafe extern "C" fn(CUevent) -> CUresult;
/// `cuStreamSynchronize`, `cuStreamQuery` and their `_ptsz` variants.
pub type FnStreamSync = unsafe extern "C" fn(CUstream) -> CUresult;
/// `cuEventSynchronize`.
pub type FnEventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
/// `cuMemcpyAsync`, `cuMemcpyDtoDAsync_v2`, `cuMemcpyHtoDAsync_v2`, `cuMemcpyDtoHAsync_v2` and
/// their `_ptsz` variants: destination, source (a device pointer or a host pointer, the same
/// width), bytes, stream.
pub type FnMemcpyAsync = unsafe extern "C" fn(u64, u64, usize, CUstream) -> CUresult;
/// `cuCtxSynchronize`.
pub type FnCtxSynchronize = unsafe extern "C" fn() -> CUresult;
/// `cuPointerGetAttribute(data, attribute, pointer)`.
pub type FnPointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> CUresult;
/// `cuCtxSynchronize_v2(CUcontext)` (CUDA 13).
pub type FnCtxSynchronizeV2 = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type FnCtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub type FnCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type FnDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `cuDeviceGetUuid[_v2](CUuuid *, CUdevice)`; `CUuuid` is 16 bytes.
pub type FnDeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], CUdevice) -> CUresult;
/// glibc's `dlsym`.
pub type FnDlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

// ---- green contexts (CUDA 12.4+), for spatial partitioning ----

pub type CUgreenCtx = *mut c_void;
pub type CUdevResourceDesc = *mut c_void;

/// `CU_DEV_RESOURCE_TYPE_SM`.
pub const CU_DEV_RESOURCE_TYPE_SM: c_int = 1;
/// `CU_GREEN_CTX_DEFAULT_STREAM`: required by `cuGreenCtxCreate`.
pub const CU_GREEN_CTX_DEFAULT_STREAM: c_uint = 0x1;
/// `CU_STREAM_NON_BLOCKING`: required by `cuGreenCtxStreamCreate`.
pub const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE` (`CUlaunchAttribute::id`).
pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: c_uint = 2;

/// `CUdevResource`, kept opaque: `type` at offset 0, a 92-byte pad, then the `CUdevSmResource`
/// union member at offset 96 (`smCount`, and from CUDA 13 `minSmPartitionSize`,
/// `smCoscheduledAlignment`, `flags`). The driver's struct is 144 bytes (CUDA 12.4) and grew in
/// CUDA 13, so this buffer is oversized and zeroed: fields an older driver does not write read 0.
#[repr(C, align(8))]
pub struct CUdevResource {
    pub bytes: [u8; DEV_RESOURCE_BYTES],
}

/// Our size of `CUdevResource` (larger than any driver's so far).
pub const DEV_RESOURCE_BYTES: usize = 512;
/// Offsets into `CUdevResource`.
pub const DEV_RESOURCE_SM_COUNT: usize = 96;
pub const DEV_RESOURCE_SM_MIN_PARTITION: usize = 100;
pub const DEV_RESOURCE_SM_ALIGNMENT: usize = 104;

impl CUdevResource {
    pub fn zeroed() -> CUdevResource {
        CUdevResource {
            bytes: [0; DEV_RESOURCE_BYTES],
        }
    }

    pub fn word(&self, offset: usize) -> u32 {
        let mut word = [0u8; 4];
        word.copy_from_slice(&self.bytes[offset..offset + 4]);
        u32::from_ne_bytes(word)
    }
}

/// `CUlaunchAttribute`: an id, padding to 8 bytes, a 64-byte value union.
#[repr(C)]
pub struct CUlaunchAttribute {
    pub id: c_uint,
    pub pad: [u8; 4],
    pub value: [u8; 64],
}

pub type FnDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
pub type FnDeviceGetDevResource =
    unsafe extern "C" fn(CUdevice, *mut CUdevResource, c_int) -> CUresult;
/// `cuDevSmResourceSplitByCount(result, nbGroups, input, remaining, useFlags, minCount)`.
pub type FnDevSmResourceSplitByCount = unsafe extern "C" fn(
    *mut CUdevResource,
    *mut c_uint,
    *const CUdevResource,
    *mut CUdevResource,
    c_uint,
    c_uint,
) -> CUresult;
pub type FnDevResourceGenerateDesc =
    unsafe extern "C" fn(*mut CUdevResourceDesc, *mut CUdevResource, c_uint) -> CUresult;
pub type FnGreenCtxCreate =
    unsafe extern "C" fn(*mut CUgreenCtx, CUdevResourceDesc, CUdevice, c_uint) -> CUresult;
pub type FnGreenCtxStreamCreate =
    unsafe extern "C" fn(*mut CUstream, CUgreenCtx, c_uint, c_int) -> CUresult;
pub type FnStreamWaitEvent = unsafe extern "C" fn(CUstream, CUevent, c_uint) -> CUresult;
