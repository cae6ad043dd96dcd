//! The few CUDA driver entry points the plugin needs, opened from `libcuda.so.1` at run time so
//! the plugin loads (and its host-memory transport works) on machines without a GPU.
//!
//! Every function here is a thin safe wrapper: it checks the result code and turns it into
//! [`CudaError`]; callers own the meaning of the pointers they pass.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

pub type CUresult = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmemHandle = u64;

const CUDA_SUCCESS: CUresult = 0;
const CUDA_ERROR_NOT_READY: CUresult = 600;
/// What a missing optional entry point reports.
const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("libcuda.so.1 could not be opened ({0}); GPU buffers need the NVIDIA driver")]
    NoDriver(String),
    #[error("{call} failed with CUDA error {code}")]
    Call { call: &'static str, code: CUresult },
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle(pub [u8; 64]);

#[repr(C)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

#[repr(C)]
struct MemAccessDesc {
    location: MemLocation,
    flags: c_int,
}

macro_rules! driver {
    ($($field:ident : $sym:literal => fn($($arg:ty),*);)*) => {
        struct Fns { $($field: unsafe extern "C" fn($($arg),*) -> CUresult,)* }
        fn load(lib: &libloading::Library) -> Result<Fns, String> {
            // SAFETY: each symbol is declared with the prototype of the CUDA driver API
            // (cuda.h, CUDA 12/13) under its versioned name.
            unsafe {
                Ok(Fns {$(
                    $field: *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> CUresult>($sym)
                        .map_err(|e| e.to_string())?,
                )*})
            }
        }
    };
}

driver! {
    ctx_get_current: b"cuCtxGetCurrent\0" => fn(*mut CUcontext);
    ctx_set_current: b"cuCtxSetCurrent\0" => fn(CUcontext);
    ctx_get_device: b"cuCtxGetDevice\0" => fn(*mut c_int);
    ctx_create: b"cuCtxCreate_v2\0" => fn(*mut CUcontext, c_uint, c_int);
    get_address_range: b"cuMemGetAddressRange_v2\0" => fn(*mut CUdeviceptr, *mut usize, CUdeviceptr);
    retain_allocation_handle: b"cuMemRetainAllocationHandle\0" => fn(*mut CUmemHandle, *mut c_void);
    release: b"cuMemRelease\0" => fn(CUmemHandle);
    export_shareable: b"cuMemExportToShareableHandle\0" => fn(*mut c_void, CUmemHandle, c_int, u64);
    import_shareable: b"cuMemImportFromShareableHandle\0" => fn(*mut CUmemHandle, *mut c_void, c_int);
    address_reserve: b"cuMemAddressReserve\0" => fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    address_free: b"cuMemAddressFree\0" => fn(CUdeviceptr, usize);
    map: b"cuMemMap\0" => fn(CUdeviceptr, usize, usize, CUmemHandle, u64);
    unmap: b"cuMemUnmap\0" => fn(CUdeviceptr, usize);
    set_access: b"cuMemSetAccess\0" => fn(CUdeviceptr, usize, *const MemAccessDesc, usize);
    ipc_get: b"cuIpcGetMemHandle\0" => fn(*mut IpcHandle, CUdeviceptr);
    ipc_open: b"cuIpcOpenMemHandle_v2\0" => fn(*mut CUdeviceptr, IpcHandle, c_uint);
    ipc_close: b"cuIpcCloseMemHandle\0" => fn(CUdeviceptr);
    stream_create: b"cuStreamCreate\0" => fn(*mut CUstream, c_uint);
    stream_destroy: b"cuStreamDestroy_v2\0" => fn(CUstream);
    stream_synchronize: b"cuStreamSynchronize\0" => fn(CUstream);
    event_create: b"cuEventCreate\0" => fn(*mut CUevent, c_uint);
    event_record: b"cuEventRecord\0" => fn(CUevent, CUstream);
    event_query: b"cuEventQuery\0" => fn(CUevent);
    event_destroy: b"cuEventDestroy_v2\0" => fn(CUevent);
    memcpy_async: b"cuMemcpyAsync\0" => fn(CUdeviceptr, CUdeviceptr, usize, CUstream);
    host_alloc: b"cuMemHostAlloc\0" => fn(*mut *mut c_void, usize, c_uint);
    free_host: b"cuMemFreeHost\0" => fn(*mut c_void);
    pointer_attribute: b"cuPointerGetAttribute\0" => fn(*mut c_void, c_int, CUdeviceptr);
    device_count: b"cuDeviceGetCount\0" => fn(*mut c_int);
    primary_state: b"cuDevicePrimaryCtxGetState\0" => fn(c_int, *mut c_uint, *mut c_int);
}

/// Entry points the plugin can do without: stream memory operations and host registration,
/// through which the GPU itself publishes a finished copy into the completion ring
/// (`VGPU_NCCL_GPU_FIN`). A driver without them keeps the copy thread's event polling.
struct MemOps {
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    host_device_pointer: unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult,
    write_value64: unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult,
    stream_query: unsafe extern "C" fn(CUstream) -> CUresult,
}

/// The first of `names` the library exports, as a function of type `T`.
///
/// # Safety
/// `T` must be the prototype of every symbol in `names`.
unsafe fn first<T: Copy>(lib: &libloading::Library, names: &[&[u8]]) -> Option<T> {
    names
        .iter()
        // SAFETY: the caller names symbols whose prototype is `T`.
        .find_map(|n| unsafe { lib.get::<T>(n) }.ok().map(|f| *f))
}

/// `cuDeviceGetUuid`: which physical GPU a device is (for the per-GPU rank slots of
/// `identity`); optional like the memory operations.
type DeviceUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult;

impl MemOps {
    fn load(lib: &libloading::Library) -> Option<MemOps> {
        // SAFETY: prototypes of cuda.h (CUDA 12/13); the `_v2` names are what cuda.h's macros
        // resolve to (cuStreamWriteValue64_v2 needs no driver option, unlike the first
        // version of the stream memory operations).
        unsafe {
            Some(MemOps {
                host_register: first(lib, &[b"cuMemHostRegister_v2\0", b"cuMemHostRegister\0"])?,
                host_unregister: first(lib, &[b"cuMemHostUnregister\0"])?,
                host_device_pointer: first(
                    lib,
                    &[
                        b"cuMemHostGetDevicePointer_v2\0",
                        b"cuMemHostGetDevicePointer\0",
                    ],
                )?,
                write_value64: first(lib, &[b"cuStreamWriteValue64_v2\0"])?,
                stream_query: first(lib, &[b"cuStreamQuery\0"])?,
            })
        }
    }
}

pub struct Cuda {
    fns: Fns,
    memops: Option<MemOps>,
    device_uuid: Option<DeviceUuid>,
    _lib: libloading::Library,
}

fn check(call: &'static str, code: CUresult) -> Result<(), CudaError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Call { call, code })
    }
}

/// The driver, opened once per process.
pub fn driver() -> Result<&'static Cuda, CudaError> {
    static DRIVER: OnceLock<Result<Cuda, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: opening the NVIDIA driver library runs its initialisers, which is what
            // every CUDA program does; the handle lives for the rest of the process.
            let lib =
                unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
            let fns = load(&lib)?;
            let memops = MemOps::load(&lib);
            // SAFETY: the prototype of cuda.h (the `_v2` name is what its macro resolves to).
            let device_uuid =
                unsafe { first(&lib, &[b"cuDeviceGetUuid_v2\0", b"cuDeviceGetUuid\0"]) };
            Ok(Cuda {
                fns,
                memops,
                device_uuid,
                _lib: lib,
            })
        })
        .as_ref()
        .map_err(|e| CudaError::NoDriver(e.clone()))
}

/// What a receiver hands its sender so the sender can write into the receiver's GPU buffer.
pub enum Export {
    /// A cuMem (VMM) allocation exported as a file descriptor, travelling by SCM_RIGHTS.
    Fd { fd: c_int, alloc_size: usize },
    /// A legacy cudaMalloc allocation.
    Legacy {
        handle: IpcHandle,
        alloc_size: usize,
    },
}

/// A peer allocation mapped into this process.
pub enum Mapping {
    Vmm { va: CUdeviceptr, size: usize },
    Legacy { va: CUdeviceptr },
}

impl Mapping {
    pub fn base(&self) -> CUdeviceptr {
        match self {
            Mapping::Vmm { va, .. } | Mapping::Legacy { va } => *va,
        }
    }
}

impl Cuda {
    /// What the driver knows of `ptr` (memory type, device, context), for debugging traces.
    pub fn describe(&self, ptr: CUdeviceptr) -> String {
        const CONTEXT: c_int = 1;
        const MEMORY_TYPE: c_int = 2;
        const DEVICE_ORDINAL: c_int = 9;
        let (mut kind, mut ordinal): (c_uint, c_int) = (0, -1);
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: each out-pointer points to a local of the type the attribute writes.
        let codes = unsafe {
            [
                (self.fns.pointer_attribute)((&mut kind as *mut c_uint).cast(), MEMORY_TYPE, ptr),
                (self.fns.pointer_attribute)(
                    (&mut ordinal as *mut c_int).cast(),
                    DEVICE_ORDINAL,
                    ptr,
                ),
                (self.fns.pointer_attribute)((&mut ctx as *mut CUcontext).cast(), CONTEXT, ptr),
            ]
        };
        let kind = match kind {
            1 => "host",
            2 => "device",
            3 => "array",
            4 => "unified",
            _ => "unknown",
        };
        format!("{ptr:#x}: {kind} memory of device {ordinal}, context {ctx:?} (codes {codes:?})")
    }

    /// The devices on which this process has an active primary context, for debugging traces.
    pub fn active_devices(&self) -> Vec<c_int> {
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        if unsafe { (self.fns.device_count)(&mut n) } != CUDA_SUCCESS {
            return Vec::new();
        }
        (0..n)
            .filter(|&d| {
                let (mut flags, mut active) = (0, 0);
                // SAFETY: out-pointers to locals; `d` is a device ordinal below the count.
                let r = unsafe { (self.fns.primary_state)(d, &mut flags, &mut active) };
                r == CUDA_SUCCESS && active != 0
            })
            .collect()
    }

    pub fn current_context(&self) -> Result<CUcontext, CudaError> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuCtxGetCurrent", unsafe {
            (self.fns.ctx_get_current)(&mut ctx)
        })?;
        Ok(ctx)
    }

    /// A new context on `device` (current on the calling thread until it sets another). It is
    /// never destroyed: callers keep it for the life of the process.
    pub fn create_context(&self, device: c_int) -> Result<CUcontext, CudaError> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; flags 0 (automatic scheduling); `device` is the
        // ordinal of the caller's current device.
        check("cuCtxCreate", unsafe {
            (self.fns.ctx_create)(&mut ctx, 0, device)
        })?;
        Ok(ctx)
    }

    pub fn set_context(&self, ctx: CUcontext) -> Result<(), CudaError> {
        // SAFETY: `ctx` came from cuCtxGetCurrent in this process (or is null, which unbinds).
        check("cuCtxSetCurrent", unsafe {
            (self.fns.ctx_set_current)(ctx)
        })
    }

    pub fn current_device(&self) -> Result<c_int, CudaError> {
        let mut dev = 0;
        // SAFETY: out-pointer to a local.
        check("cuCtxGetDevice", unsafe {
            (self.fns.ctx_get_device)(&mut dev)
        })?;
        Ok(dev)
    }

    /// The physical GPU of the calling thread's current context (its UUID).
    pub fn current_gpu_uuid(&self) -> Result<[u8; 16], CudaError> {
        let get = self.device_uuid.ok_or(CudaError::Call {
            call: "cuDeviceGetUuid",
            code: CUDA_ERROR_NOT_SUPPORTED,
        })?;
        let device = self.current_device()?;
        let mut uuid = [0u8; 16];
        // SAFETY: out-pointer to a local of the 16 bytes CUuuid holds; a valid ordinal.
        check("cuDeviceGetUuid", unsafe { get(&mut uuid, device) })?;
        Ok(uuid)
    }

    /// The allocation that holds `ptr`: its base and size.
    pub fn address_range(&self, ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize), CudaError> {
        let (mut base, mut size) = (0, 0);
        // SAFETY: out-pointers to locals; the driver validates `ptr`.
        check("cuMemGetAddressRange", unsafe {
            (self.fns.get_address_range)(&mut base, &mut size, ptr)
        })?;
        Ok((base, size))
    }

    /// Export the allocation holding `ptr` for another process: as a file descriptor when it is
    /// a cuMem allocation made shareable, as a legacy IPC handle otherwise.
    pub fn export(&self, ptr: CUdeviceptr) -> Result<(Export, CUdeviceptr), CudaError> {
        let (base, alloc_size) = self.address_range(ptr)?;
        let mut handle: CUmemHandle = 0;
        // SAFETY: out-pointer to a local; `base` is a device address the driver knows.
        let retained =
            unsafe { (self.fns.retain_allocation_handle)(&mut handle, base as *mut c_void) };
        if retained == CUDA_SUCCESS {
            let mut fd: c_int = -1;
            // SAFETY: `handle` was just retained; `fd` is an out-pointer to a local int, which is
            // what the POSIX fd handle type writes.
            let exported = unsafe {
                (self.fns.export_shareable)(
                    (&mut fd as *mut c_int).cast(),
                    handle,
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            };
            // SAFETY: balances the retain above; the allocation stays owned by its creator.
            unsafe { (self.fns.release)(handle) };
            check("cuMemExportToShareableHandle", exported)?;
            return Ok((Export::Fd { fd, alloc_size }, base));
        }
        let mut ipc = IpcHandle([0; 64]);
        // SAFETY: out-pointer to a local 64-byte handle.
        check("cuIpcGetMemHandle", unsafe {
            (self.fns.ipc_get)(&mut ipc, base)
        })?;
        Ok((
            Export::Legacy {
                handle: ipc,
                alloc_size,
            },
            base,
        ))
    }

    /// Whether `ptr` lies in a cuMem (VMM) allocation, which every context on its device can
    /// reach; a legacy cudaMalloc allocation belongs to the context that made it.
    pub fn is_vmm(&self, ptr: CUdeviceptr) -> Result<bool, CudaError> {
        let (base, _) = self.address_range(ptr)?;
        let mut handle: CUmemHandle = 0;
        // SAFETY: out-pointer to a local; `base` is a device address the driver knows.
        let retained =
            unsafe { (self.fns.retain_allocation_handle)(&mut handle, base as *mut c_void) };
        if retained != CUDA_SUCCESS {
            return Ok(false);
        }
        // SAFETY: balances the retain above.
        unsafe { (self.fns.release)(handle) };
        Ok(true)
    }

    /// Map a peer's exported allocation into this process, accessible from `device`.
    pub fn import(&self, export: &Export, device: c_int) -> Result<Mapping, CudaError> {
        match export {
            Export::Legacy { handle, .. } => {
                let mut va = 0;
                // SAFETY: out-pointer to a local; the handle bytes came from cuIpcGetMemHandle in
                // the peer process.
                check("cuIpcOpenMemHandle", unsafe {
                    (self.fns.ipc_open)(&mut va, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                })?;
                Ok(Mapping::Legacy { va })
            }
            Export::Fd { fd, alloc_size } => {
                let size = *alloc_size;
                let mut handle: CUmemHandle = 0;
                // SAFETY: the POSIX fd handle type takes the descriptor itself as the pointer
                // value; `fd` is open in this process (received by SCM_RIGHTS).
                check("cuMemImportFromShareableHandle", unsafe {
                    (self.fns.import_shareable)(
                        &mut handle,
                        *fd as isize as *mut c_void,
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                let mut va = 0;
                // SAFETY: reserve a fresh range of the allocation's size (out-pointer to a local).
                let reserved = unsafe { (self.fns.address_reserve)(&mut va, size, 0, 0, 0) };
                if let Err(e) = check("cuMemAddressReserve", reserved) {
                    // SAFETY: drop the imported handle we own.
                    unsafe { (self.fns.release)(handle) };
                    return Err(e);
                }
                // SAFETY: `va..va+size` was reserved above and `handle` covers `size` bytes.
                let mapped = unsafe { (self.fns.map)(va, size, 0, handle, 0) };
                // SAFETY: the mapping keeps its own reference to the allocation.
                unsafe { (self.fns.release)(handle) };
                if let Err(e) = check("cuMemMap", mapped) {
                    // SAFETY: frees the range reserved above.
                    unsafe { (self.fns.address_free)(va, size) };
                    return Err(e);
                }
                let desc = MemAccessDesc {
                    location: MemLocation {
                        kind: CU_MEM_LOCATION_TYPE_DEVICE,
                        id: device,
                    },
                    flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                // SAFETY: `va..va+size` is mapped; one access descriptor.
                let access = unsafe { (self.fns.set_access)(va, size, &desc, 1) };
                if let Err(e) = check("cuMemSetAccess", access) {
                    // SAFETY: undo the map and reservation made above.
                    unsafe {
                        (self.fns.unmap)(va, size);
                        (self.fns.address_free)(va, size);
                    }
                    return Err(e);
                }
                Ok(Mapping::Vmm { va, size })
            }
        }
    }

    pub fn unmap(&self, mapping: &Mapping) {
        // SAFETY: the mapping was made by `import` and is unmapped once (callers drop it after).
        unsafe {
            match *mapping {
                Mapping::Vmm { va, size } => {
                    (self.fns.unmap)(va, size);
                    (self.fns.address_free)(va, size);
                }
                Mapping::Legacy { va } => {
                    (self.fns.ipc_close)(va);
                }
            }
        }
    }

    pub fn stream(&self) -> Result<CUstream, CudaError> {
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuStreamCreate", unsafe {
            (self.fns.stream_create)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(s)
    }

    pub fn destroy_stream(&self, s: CUstream) {
        // SAFETY: `s` was created by `stream` and is destroyed once.
        unsafe { (self.fns.stream_destroy)(s) };
    }

    pub fn synchronize(&self, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: `s` is a live stream of this process.
        check("cuStreamSynchronize", unsafe {
            (self.fns.stream_synchronize)(s)
        })
    }

    pub fn event(&self) -> Result<CUevent, CudaError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check("cuEventCreate", unsafe {
            (self.fns.event_create)(&mut e, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(e)
    }

    pub fn destroy_event(&self, e: CUevent) {
        // SAFETY: `e` was created by `event` and is destroyed once.
        unsafe { (self.fns.event_destroy)(e) };
    }

    pub fn record(&self, e: CUevent, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: live event and stream of this process.
        check("cuEventRecord", unsafe { (self.fns.event_record)(e, s) })
    }

    /// Whether the work before the event's last record has finished.
    pub fn done(&self, e: CUevent) -> Result<bool, CudaError> {
        // SAFETY: live event of this process.
        match unsafe { (self.fns.event_query)(e) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(CudaError::Call {
                call: "cuEventQuery",
                code,
            }),
        }
    }

    /// Queue a copy of `n` bytes; either side may be device or pinned host memory (UVA).
    pub fn copy_async(&self, dst: u64, src: u64, n: usize, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges are valid for `n` bytes until the copy's
        // completion is observed.
        check("cuMemcpyAsync", unsafe {
            (self.fns.memcpy_async)(dst, src, n, s)
        })
    }

    pub fn host_alloc(&self, n: usize) -> Result<*mut u8, CudaError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; flags 0 = pinned, portable within this context.
        check("cuMemHostAlloc", unsafe {
            (self.fns.host_alloc)(&mut p, n, 0)
        })?;
        Ok(p.cast())
    }

    pub fn free_host(&self, p: *mut u8) {
        // SAFETY: `p` came from `host_alloc` and is freed once.
        unsafe { (self.fns.free_host)(p.cast()) };
    }

    /// Whether the driver has what [`Cuda::register_host`] and [`Cuda::write_value`] need.
    pub fn has_memops(&self) -> bool {
        self.memops.is_some()
    }

    fn memops(&self, call: &'static str) -> Result<&MemOps, CudaError> {
        self.memops.as_ref().ok_or(CudaError::Call {
            call,
            code: CUDA_ERROR_NOT_SUPPORTED,
        })
    }

    /// Pins `len` bytes of host memory at `p` (page-aligned, mapped by this process) for the
    /// current context's device and returns the address the device writes them at.
    ///
    /// The caller keeps the mapping alive until [`Cuda::unregister_host`].
    pub fn register_host(&self, p: *mut u8, len: usize) -> Result<CUdeviceptr, CudaError> {
        const PORTABLE: c_uint = 1;
        const DEVICEMAP: c_uint = 2;
        let m = self.memops("cuMemHostRegister")?;
        // SAFETY: `p..p+len` is a live mapping of this process (the caller's contract).
        check("cuMemHostRegister", unsafe {
            (m.host_register)(p.cast(), len, PORTABLE | DEVICEMAP)
        })?;
        let mut dev = 0;
        // SAFETY: out-pointer to a local; `p` was just registered; flags must be 0.
        let r = check("cuMemHostGetDevicePointer", unsafe {
            (m.host_device_pointer)(&mut dev, p.cast(), 0)
        });
        if let Err(e) = r {
            // SAFETY: registered above, unregistered once.
            unsafe { (m.host_unregister)(p.cast()) };
            return Err(e);
        }
        Ok(dev)
    }

    pub fn unregister_host(&self, p: *mut u8) {
        if let Some(m) = &self.memops {
            // SAFETY: `p` was registered by `register_host` and is unregistered once.
            unsafe { (m.host_unregister)(p.cast()) };
        }
    }

    /// Queue a write of `value` to `addr` (device-visible memory) on `s`, after everything
    /// queued on `s` before it, with a system-wide memory fence first (the default flags):
    /// whoever sees the value also sees what the stream's earlier copies wrote.
    pub fn write_value(&self, s: CUstream, addr: CUdeviceptr, value: u64) -> Result<(), CudaError> {
        let m = self.memops("cuStreamWriteValue64")?;
        // SAFETY: `s` is a live stream; `addr` is device-visible memory the caller keeps
        // registered until the stream has drained.
        check("cuStreamWriteValue64", unsafe {
            (m.write_value64)(s, addr, value, 0)
        })
    }

    /// Whether everything queued on `s` has finished (`Err`: it failed).
    pub fn stream_done(&self, s: CUstream) -> Result<bool, CudaError> {
        let m = self.memops("cuStreamQuery")?;
        // SAFETY: live stream of this process.
        match unsafe { (m.stream_query)(s) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(CudaError::Call {
                call: "cuStreamQuery",
                code,
            }),
        }
    }
}
