//! The C boundary. NCCL `dlsym`s `ncclNetPlugin_v11`/`_v10` and `ncclTunerPlugin_v5`/`_v4`:
//! const tables of function pointers. Every entry point runs its body under `catch_unwind`, so a
//! panic becomes `ncclInternalError` in NCCL's log instead of killing the training process, and
//! every error is logged through NCCL's logger before its code is returned.
#![allow(unsafe_code, non_upper_case_globals)]

use crate::abi::*;
use crate::log::{info, warn};
use crate::net::{self, Connecting, Listener, RecvComm, SendComm};
use crate::wire::{HANDLE_STATE_OFFSET, ListenHandle};
use crate::{Error, Mr, tuner};
use std::ffi::{c_char, c_float, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

fn guard(what: &str, f: impl FnOnce() -> Result<(), Error>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            warn!(NCCL_NET, "{what}: {e}");
            match e {
                Error::Invalid(_) => NCCL_INVALID_ARGUMENT,
                Error::Cuda(_) => NCCL_UNHANDLED_CUDA_ERROR,
                Error::PeerClosed | Error::Truncated { .. } | Error::WorkRequest(_) => {
                    NCCL_REMOTE_ERROR
                }
                Error::Io(_) | Error::Verbs(_) => NCCL_SYSTEM_ERROR,
                _ => NCCL_INTERNAL_ERROR,
            }
        }
        Err(_) => {
            warn!(
                NCCL_NET,
                "{what}: internal panic (a bug in libvgpu_nccl.so); returning an error to NCCL"
            );
            NCCL_INTERNAL_ERROR
        }
    }
}

const NAME: &std::ffi::CStr = c"vgpu";

/// One comm pointer handed to NCCL: regMr/deregMr take either kind.
enum AnyComm {
    Send(Box<SendComm>),
    Recv(Box<RecvComm>),
}

enum Req {
    Send(*mut AnyComm, u32),
    Recv(*mut AnyComm, u32),
    Done(usize),
}

/// Frees a `Box<T>` that was handed to NCCL as `p` (ignores NULL).
///
/// # Safety
/// `p` is NULL or came from `Box::into_raw(Box<T>)` in this library, and NCCL hands it back
/// for freeing exactly once.
unsafe fn free<T>(p: *mut c_void) {
    if !p.is_null() {
        // SAFETY: the caller's contract above.
        drop(unsafe { Box::from_raw(p.cast::<T>()) });
    }
}

fn out<T>(p: *mut T, v: T) -> Result<(), Error> {
    if p.is_null() {
        return Err(Error::Invalid("NULL output pointer"));
    }
    // SAFETY: NCCL passes valid, aligned output pointers; checked non-null above.
    unsafe { p.write(v) };
    Ok(())
}

fn comm<'a>(p: *mut c_void) -> Result<&'a mut AnyComm, Error> {
    if p.is_null() {
        return Err(Error::Invalid("NULL comm"));
    }
    // SAFETY: every comm pointer NCCL passes back was made by Box::into_raw(AnyComm) below and
    // is used by one thread (NCCL's proxy thread) at a time until its close call.
    Ok(unsafe { &mut *p.cast::<AnyComm>() })
}

fn fill_props(dev: c_int, p: &mut ncclNetProperties_v10_t) -> Result<(), Error> {
    if dev != 0 {
        return Err(Error::Invalid("no such device (the plugin has one)"));
    }
    let g = net::global();
    let gpu = g.config.gdr && crate::cuda::driver().is_ok();
    p.name = NAME.as_ptr() as *mut c_char;
    p.pciPath = std::ptr::null_mut();
    p.guid = 0x7667_7075_0000_0000;
    let rdma = crate::rdma::device();
    p.ptrSupport = NCCL_PTR_HOST
        | if gpu { NCCL_PTR_CUDA } else { 0 }
        | if rdma.is_some_and(|d| d.has_dmabuf()) {
            NCCL_PTR_DMABUF
        } else {
            0
        };
    p.regIsGlobal = 0;
    p.forceFlush = 0;
    p.speed = g.config.speed_mbps;
    p.port = 0;
    p.latency = 0.0;
    p.maxComms = 65536;
    p.maxRecvs = 1;
    p.netDeviceType = 0;
    p.netDeviceVersion = 0;
    p.vProps = ncclNetVDeviceProps_t {
        ndevs: 1,
        devs: [0; NCCL_NET_MAX_DEVS_PER_NIC],
    };
    // one RDMA write carries a whole request: no request may exceed the port's largest message
    let largest = rdma.map_or(NCCL_MAX_NET_SIZE_BYTES, |d| {
        NCCL_MAX_NET_SIZE_BYTES.min(match d.port.max_msg {
            0 => 1 << 30,
            m => m as usize,
        })
    });
    p.maxP2pBytes = largest;
    p.maxCollBytes = largest;
    Ok(())
}

fn init_common(log: ncclDebugLogger_t) {
    crate::log::set(log);
    let g = net::global();
    // decided (and logged) once per process: RDMA or TCP for connections to other hosts
    let _ = crate::rdma::probe();
    info!(
        NCCL_INIT | NCCL_NET,
        "net plugin ready: {} TCP streams per connection, same-host GPU path {}, GPU buffers {}, advertising {}",
        g.config.sockets,
        if g.config.local { "on" } else { "off" },
        if g.config.gdr && crate::cuda::driver().is_ok() {
            "accepted"
        } else {
            "not accepted (host staging by NCCL)"
        },
        g.addr
    );
}

unsafe extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    comm_id: u64,
    _config: *mut ncclNetCommConfig_t,
    log: ncclDebugLogger_t,
    _prof: ncclProfilerCallback_t,
) -> ncclResult_t {
    guard("init", || {
        init_common(log);
        out(ctx, Box::into_raw(Box::new(comm_id)).cast())
    })
}

unsafe extern "C" fn init_v10(
    log: ncclDebugLogger_t,
    _prof: ncclProfilerCallback_t,
) -> ncclResult_t {
    guard("init", || {
        init_common(log);
        Ok(())
    })
}

unsafe extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    guard("finalize", || {
        // SAFETY: made by init_v11's Box::into_raw and finalized once.
        unsafe { free::<u64>(ctx) };
        Ok(())
    })
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || out(ndev, 1))
}

unsafe extern "C" fn get_properties_v11(
    dev: c_int,
    props: *mut ncclNetProperties_v11_t,
) -> ncclResult_t {
    guard("getProperties", || {
        if props.is_null() {
            return Err(Error::Invalid("NULL properties"));
        }
        // SAFETY: NCCL passes a valid v11 properties struct.
        let p = unsafe { &mut *props };
        fill_props(dev, &mut p.v10)?;
        p.maxMultiRequestSize = 1;
        Ok(())
    })
}

unsafe extern "C" fn get_properties_v10(
    dev: c_int,
    props: *mut ncclNetProperties_v10_t,
) -> ncclResult_t {
    guard("getProperties", || {
        if props.is_null() {
            return Err(Error::Invalid("NULL properties"));
        }
        // SAFETY: NCCL passes a valid v10 properties struct.
        fill_props(dev, unsafe { &mut *props })
    })
}

fn handle_bytes<'a>(handle: *mut c_void) -> Result<&'a mut [u8; NCCL_NET_HANDLE_MAXSIZE], Error> {
    if handle.is_null() {
        return Err(Error::Invalid("NULL handle"));
    }
    // SAFETY: NCCL's handles are NCCL_NET_HANDLE_MAXSIZE bytes, owned by NCCL for the call.
    Ok(unsafe { &mut *handle.cast::<[u8; NCCL_NET_HANDLE_MAXSIZE]>() })
}

fn listen_impl(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> Result<(), Error> {
    if dev != 0 {
        return Err(Error::Invalid("no such device"));
    }
    let h = handle_bytes(handle)?;
    h.fill(0);
    let l = Listener::new(h)?;
    out(listen_comm, Box::into_raw(Box::new(l)).cast())
}

unsafe extern "C" fn listen_v11(
    _ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    lc: *mut *mut c_void,
) -> ncclResult_t {
    guard("listen", || listen_impl(dev, handle, lc))
}

unsafe extern "C" fn listen_v10(
    dev: c_int,
    handle: *mut c_void,
    lc: *mut *mut c_void,
) -> ncclResult_t {
    guard("listen", || listen_impl(dev, handle, lc))
}

fn connect_impl(dev: c_int, handle: *mut c_void, send_comm: *mut *mut c_void) -> Result<(), Error> {
    if dev != 0 {
        return Err(Error::Invalid("no such device"));
    }
    out(send_comm, std::ptr::null_mut())?;
    let h = handle_bytes(handle)?;
    let slot = &mut h[HANDLE_STATE_OFFSET..HANDLE_STATE_OFFSET + 8];
    let mut state = u64::from_le_bytes(slot.try_into().expect("8 bytes")) as *mut Connecting;
    if state.is_null() {
        let target = ListenHandle::decode(&h[..])?;
        state = Box::into_raw(Box::new(Connecting::start(target)?));
        h[HANDLE_STATE_OFFSET..HANDLE_STATE_OFFSET + 8]
            .copy_from_slice(&(state as u64).to_le_bytes());
    }
    // SAFETY: `state` was made by Box::into_raw above (now or in an earlier call with this
    // handle) and is freed only below, after which the slot is zeroed.
    let result = unsafe { &mut *state }.poll();
    let done = !matches!(result, Ok(None));
    if done {
        // SAFETY: see above; freed once.
        drop(unsafe { Box::from_raw(state) });
        h[HANDLE_STATE_OFFSET..HANDLE_STATE_OFFSET + 8].fill(0);
    }
    if let Some(s) = result? {
        info!(NCCL_NET, "connected ({})", s.kind());
        out(
            send_comm,
            Box::into_raw(Box::new(AnyComm::Send(Box::new(s)))).cast(),
        )?;
    }
    Ok(())
}

unsafe extern "C" fn connect_v11(
    _ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_t,
) -> ncclResult_t {
    guard("connect", || connect_impl(dev, handle, send_comm))
}

unsafe extern "C" fn connect_v10(
    dev: c_int,
    _config: *mut ncclNetCommConfig_t,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_t,
) -> ncclResult_t {
    guard("connect", || connect_impl(dev, handle, send_comm))
}

unsafe extern "C" fn accept(
    lc: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev: *mut *mut ncclNetDeviceHandle_t,
) -> ncclResult_t {
    guard("accept", || {
        out(recv_comm, std::ptr::null_mut())?;
        if lc.is_null() {
            return Err(Error::Invalid("NULL listen comm"));
        }
        // SAFETY: made by listen_impl's Box::into_raw; used by one thread at a time.
        let l = unsafe { &mut *lc.cast::<Listener>() };
        if let Some(r) = l.accept()? {
            out(
                recv_comm,
                Box::into_raw(Box::new(AnyComm::Recv(Box::new(r)))).cast(),
            )?;
        }
        Ok(())
    })
}

fn reg(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    dmabuf: Option<(u64, c_int)>,
    mh: *mut *mut c_void,
) -> Result<(), Error> {
    let cuda = match kind {
        NCCL_PTR_HOST => false,
        NCCL_PTR_CUDA => true,
        _ => return Err(Error::Invalid("memory type (only host and CUDA pointers)")),
    };
    let mr = match comm(c)? {
        AnyComm::Send(s) => s.register(data as u64, size, cuda, dmabuf)?,
        AnyComm::Recv(r) => r.register(data as u64, size, cuda, dmabuf)?,
    };
    out(mh, Box::into_raw(Box::new(mr)).cast())
}

unsafe extern "C" fn reg_mr(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mh: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMr", || reg(c, data, size, kind, None, mh))
}

unsafe extern "C" fn reg_mr_dmabuf(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    offset: u64,
    fd: c_int,
    mh: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMrDmaBuf", || {
        reg(c, data, size, kind, Some((offset, fd)), mh)
    })
}

unsafe extern "C" fn dereg_mr(c: *mut c_void, mh: *mut c_void) -> ncclResult_t {
    guard("deregMr", || {
        if mh.is_null() {
            return Ok(());
        }
        // SAFETY: made by reg's Box::into_raw; NCCL deregisters once.
        let mr = unsafe { Box::from_raw(mh.cast::<Mr>()) };
        match comm(c)? {
            AnyComm::Recv(r) => r.deregister(&mr)?,
            AnyComm::Send(s) => s.deregister(&mr),
        }
        Ok(())
    })
}

fn mr<'a>(mh: *mut c_void) -> Result<&'a Mr, Error> {
    if mh.is_null() {
        return Err(Error::Invalid("NULL memory handle (unregistered buffer)"));
    }
    // SAFETY: made by reg's Box::into_raw and alive until deregMr.
    Ok(unsafe { &*mh.cast::<Mr>() })
}

unsafe extern "C" fn isend(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    _tag: c_int,
    mh: *mut c_void,
    _ph: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("isend", || {
        out(request, std::ptr::null_mut())?;
        let AnyComm::Send(s) = comm(c)? else {
            return Err(Error::Invalid("isend on a receive comm"));
        };
        if let Some(seq) = s.isend(data as u64, size, mr(mh)?)? {
            out(
                request,
                Box::into_raw(Box::new(Req::Send(c.cast(), seq))).cast(),
            )?;
        }
        Ok(())
    })
}

unsafe extern "C" fn irecv(
    c: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    _ph: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("irecv", || {
        out(request, std::ptr::null_mut())?;
        if n != 1 || data.is_null() || sizes.is_null() || mhandles.is_null() {
            return Err(Error::Invalid(
                "irecv takes exactly one buffer (maxRecvs is 1)",
            ));
        }
        let AnyComm::Recv(r) = comm(c)? else {
            return Err(Error::Invalid("irecv on a send comm"));
        };
        // SAFETY: n == 1, so each array has one valid element.
        let (ptr, cap, mh) = unsafe { (*data as u64, *sizes, *mhandles) };
        let seq = r.irecv(ptr, cap, mr(mh)?)?;
        out(
            request,
            Box::into_raw(Box::new(Req::Recv(c.cast(), seq))).cast(),
        )
    })
}

unsafe extern "C" fn iflush(
    _c: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mh: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // Data written into GPU memory is complete when its receive completes (the sender's copy has
    // finished); there is nothing to flush.
    guard("iflush", || {
        out(request, Box::into_raw(Box::new(Req::Done(0))).cast())
    })
}

unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    guard("test", || {
        out(done, 0)?;
        if request.is_null() {
            return Err(Error::Invalid("NULL request"));
        }
        // SAFETY: made by isend/irecv/iflush's Box::into_raw; freed below once done.
        let req = unsafe { &*request.cast::<Req>() };
        let finished = match *req {
            Req::Done(n) => Some(n),
            Req::Send(c, seq) => match comm(c.cast())? {
                AnyComm::Send(s) => s.poll(seq)?,
                AnyComm::Recv(_) => return Err(Error::Invalid("request of the wrong comm")),
            },
            Req::Recv(c, seq) => match comm(c.cast())? {
                AnyComm::Recv(r) => r.poll(seq)?,
                AnyComm::Send(_) => return Err(Error::Invalid("request of the wrong comm")),
            },
        };
        if let Some(n) = finished {
            // SAFETY: the request is complete; NCCL does not use it again.
            drop(unsafe { Box::from_raw(request.cast::<Req>()) });
            out(done, 1)?;
            if !sizes.is_null() {
                out(sizes, c_int::try_from(n).unwrap_or(c_int::MAX))?;
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn close_comm(c: *mut c_void) -> ncclResult_t {
    guard("close", || {
        // SAFETY: made by connect/accept's Box::into_raw; closed once.
        unsafe { free::<AnyComm>(c) };
        Ok(())
    })
}

unsafe extern "C" fn close_listen(c: *mut c_void) -> ncclResult_t {
    guard("closeListen", || {
        // SAFETY: made by listen_impl's Box::into_raw; closed once.
        unsafe { free::<Listener>(c) };
        Ok(())
    })
}

/// A table of function pointers NCCL reads; the name points at a static C string.
#[repr(transparent)]
pub struct Table<T>(T);
// SAFETY: the tables are immutable and hold only function pointers and a 'static C string.
unsafe impl<T> Sync for Table<T> {}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: Table<ncclNet_v11_t> = Table(ncclNet_v11_t {
    name: NAME.as_ptr(),
    init: init_v11,
    devices,
    getProperties: get_properties_v11,
    listen: listen_v11,
    connect: connect_v11,
    accept,
    regMr: reg_mr,
    regMrDmaBuf: reg_mr_dmabuf,
    deregMr: dereg_mr,
    isend,
    irecv,
    iflush,
    test,
    closeSend: close_comm,
    closeRecv: close_comm,
    closeListen: close_listen,
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
    finalize,
    setNetAttr: None,
});

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: Table<ncclNet_v10_t> = Table(ncclNet_v10_t {
    name: NAME.as_ptr(),
    init: init_v10,
    devices,
    getProperties: get_properties_v10,
    listen: listen_v10,
    connect: connect_v10,
    accept,
    regMr: reg_mr,
    regMrDmaBuf: reg_mr_dmabuf,
    deregMr: dereg_mr,
    isend,
    irecv,
    iflush,
    test,
    closeSend: close_comm,
    closeRecv: close_comm,
    closeListen: close_listen,
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
});

// ---- tuner ----

fn tuner_guard(what: &str, f: impl FnOnce() -> Result<(), Error>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            warn!(NCCL_TUNING, "tuner {what}: {e}");
            NCCL_INTERNAL_ERROR
        }
        Err(_) => {
            warn!(
                NCCL_TUNING,
                "tuner {what}: internal panic (a bug in libvgpu_nccl.so)"
            );
            NCCL_INTERNAL_ERROR
        }
    }
}

fn tuner_new(
    ctx: *mut *mut c_void,
    comm_id: u64,
    n_ranks: usize,
    n_nodes: usize,
    log: ncclDebugLogger_t,
) -> Result<(), Error> {
    crate::log::set(log);
    let t = tuner::Tuner::new(comm_id, n_ranks, n_nodes);
    out(ctx, Box::into_raw(Box::new(t)).cast())
}

unsafe extern "C" fn tuner_init_v5(
    ctx: *mut *mut c_void,
    comm_id: u64,
    n_ranks: usize,
    n_nodes: usize,
    log: ncclDebugLogger_t,
    _nvl: *mut ncclNvlDomainInfo_v5_t,
    _constants: *mut c_void,
) -> ncclResult_t {
    tuner_guard("init", || tuner_new(ctx, comm_id, n_ranks, n_nodes, log))
}

unsafe extern "C" fn tuner_init_v4(
    n_ranks: usize,
    n_nodes: usize,
    log: ncclDebugLogger_t,
    ctx: *mut *mut c_void,
) -> ncclResult_t {
    tuner_guard("init", || tuner_new(ctx, 0, n_ranks, n_nodes, log))
}

unsafe extern "C" fn get_coll_info(
    ctx: *mut c_void,
    _coll: c_int,
    _n_bytes: usize,
    _num_pipe_ops: c_int,
    _cost_table: *mut *mut c_float,
    _num_algo: c_int,
    _num_proto: c_int,
    _reg_buff: c_int,
    n_channels: *mut c_int,
) -> ncclResult_t {
    tuner_guard("getCollInfo", || {
        if ctx.is_null() {
            return Err(Error::Invalid("NULL tuner context"));
        }
        // SAFETY: made by tuner_new's Box::into_raw; NCCL calls one communicator's tuner from
        // one thread at a time.
        let t = unsafe { &mut *ctx.cast::<tuner::Tuner>() };
        let c = t.decide(netshare::shm::monotonic_now_ns())?;
        if c > 0 {
            out(n_channels, c)?;
        }
        Ok(())
    })
}

unsafe extern "C" fn tuner_finalize(ctx: *mut c_void) -> ncclResult_t {
    tuner_guard("finalize", || {
        // SAFETY: made by tuner_new's Box::into_raw; finalized once.
        unsafe { free::<tuner::Tuner>(ctx) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub static ncclTunerPlugin_v5: Table<ncclTuner_v5_t> = Table(ncclTuner_v5_t {
    name: NAME.as_ptr(),
    init: tuner_init_v5,
    getCollInfo: get_coll_info,
    finalize: tuner_finalize,
});

#[unsafe(no_mangle)]
pub static ncclTunerPlugin_v4: Table<ncclTuner_v4_t> = Table(ncclTuner_v4_t {
    name: NAME.as_ptr(),
    init: tuner_init_v4,
    getCollInfo: get_coll_info,
    destroy: tuner_finalize,
});

// ---- env (NCCL 2.28+, loaded only when NCCL_ENV_PLUGIN names this library) ----

unsafe extern "C" fn env_init(
    _major: u8,
    _minor: u8,
    _patch: u8,
    _suffix: *const c_char,
) -> ncclResult_t {
    NCCL_SUCCESS
}

unsafe extern "C" fn env_finalize() -> ncclResult_t {
    NCCL_SUCCESS
}

/// What NCCL reads: the process environment, except `NCCL_HOSTID` for a rank that shares its
/// GPU with another rank of the same identity (`identity`).
unsafe extern "C" fn env_get(name: *const c_char) -> *const c_char {
    if name.is_null() {
        return std::ptr::null();
    }
    // SAFETY: NCCL passes a NUL-terminated variable name.
    let wanted = unsafe { std::ffi::CStr::from_ptr(name) };
    if wanted.to_bytes() == b"NCCL_HOSTID" {
        // a panic keeps the environment's value rather than unwinding into NCCL
        if let Ok(Some(id)) = catch_unwind(crate::identity::host_id) {
            return id.as_ptr();
        }
    }
    // SAFETY: as NCCL's own env plugin does; the pointer stays valid while nobody changes the
    // variable, which NCCL's contract already asks of the application.
    unsafe { libc::getenv(name) }
}

#[unsafe(no_mangle)]
pub static ncclEnvPlugin_v1: Table<ncclEnv_v1_t> = Table(ncclEnv_v1_t {
    name: NAME.as_ptr(),
    init: env_init,
    finalize: env_finalize,
    getEnv: env_get,
});
