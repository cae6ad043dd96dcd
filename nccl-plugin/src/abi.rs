//! The C types of NCCL's plugin ABI (net v10/v11, tuner v4/v5), laid out as in NCCL 2.28's
//! `src/include/plugin/net/net_v1{0,1}.h` and `tuner/tuner_v{4,5}.h`. Field order is the ABI;
//! the tests at the bottom pin sizes and offsets to the values the C headers give on x86-64.
#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_char, c_float, c_int, c_ulong, c_void};

/// `ncclResult_t`: a 4-byte C enum.
pub type ncclResult_t = c_int;
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;

pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;
pub const NCCL_PTR_HOST: c_int = 0x1;
pub const NCCL_PTR_CUDA: c_int = 0x2;
pub const NCCL_PTR_DMABUF: c_int = 0x4;
pub const NCCL_NET_MAX_REQUESTS: usize = 32;
pub const NCCL_NET_MAX_DEVS_PER_NIC: usize = 4;
/// `NCCL_MAX_NET_SIZE_BYTES`: 1 TiB.
pub const NCCL_MAX_NET_SIZE_BYTES: usize = 1 << 40;

/// `ncclDebugLogLevel`.
pub const NCCL_LOG_WARN: c_int = 2;
pub const NCCL_LOG_INFO: c_int = 3;
/// `ncclDebugLogSubSys` bits.
pub const NCCL_INIT: c_ulong = 0x1;
pub const NCCL_NET: c_ulong = 0x10;
pub const NCCL_TUNING: c_ulong = 0x40;

/// `ncclDebugLogger_t` (C-variadic: stable Rust may call it, not define one).
pub type ncclDebugLogger_t = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;
/// `ncclProfilerCallback_t`; kept, never called.
pub type ncclProfilerCallback_t = Option<
    unsafe extern "C" fn(
        e_handle: *mut *mut c_void,
        kind: c_int,
        p_handle: *mut c_void,
        plugin_id: i64,
        ext_data: *mut c_void,
    ) -> ncclResult_t,
>;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclNetVDeviceProps_t {
    pub ndevs: c_int,
    pub devs: [c_int; NCCL_NET_MAX_DEVS_PER_NIC],
}

#[repr(C)]
pub struct ncclNetCommConfig_t {
    pub trafficClass: c_int,
}

/// `ncclNetProperties_v10_t` (104 bytes) is this without `maxMultiRequestSize`.
#[repr(C)]
pub struct ncclNetProperties_v10_t {
    pub name: *mut c_char,
    pub pciPath: *mut c_char,
    pub guid: u64,
    pub ptrSupport: c_int,
    pub regIsGlobal: c_int,
    pub forceFlush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: c_float,
    pub maxComms: c_int,
    pub maxRecvs: c_int,
    pub netDeviceType: c_int,
    pub netDeviceVersion: c_int,
    pub vProps: ncclNetVDeviceProps_t,
    pub maxP2pBytes: usize,
    pub maxCollBytes: usize,
}

/// `ncclNetProperties_v11_t` (112 bytes).
#[repr(C)]
pub struct ncclNetProperties_v11_t {
    pub v10: ncclNetProperties_v10_t,
    pub maxMultiRequestSize: c_int,
}

#[repr(C)]
pub struct ncclNetDeviceHandle_t {
    pub netDeviceType: c_int,
    pub netDeviceVersion: c_int,
    pub handle: *mut c_void,
    pub size: usize,
    pub needsProxyProgress: c_int,
}

#[repr(C)]
pub struct ncclNetCommAttr_t {
    pub maxConcurrentPeers: i32,
    pub minConcurrentPeers: i32,
    pub maxFlowsPerPeer: i32,
    pub minFlowsPerPeer: i32,
}

#[repr(C)]
pub struct ncclNetAttr_t {
    pub sendCommAttr: ncclNetCommAttr_t,
    pub recvCommAttr: ncclNetCommAttr_t,
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

type Comm = *mut c_void;

/// `ncclNet_v11_t`: 22 members.
#[repr(C)]
pub struct ncclNet_v11_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        ctx: *mut *mut c_void,
        comm_id: u64,
        config: *mut ncclNetCommConfig_t,
        log: ncclDebugLogger_t,
        prof: ncclProfilerCallback_t,
    ) -> ncclResult_t,
    pub devices: unsafe extern "C" fn(ndev: *mut c_int) -> ncclResult_t,
    pub getProperties:
        unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t,
    pub listen: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        listen_comm: *mut Comm,
    ) -> ncclResult_t,
    pub connect: unsafe extern "C" fn(
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        send_comm: *mut Comm,
        dev_comm: *mut *mut ncclNetDeviceHandle_t,
    ) -> ncclResult_t,
    pub accept: unsafe extern "C" fn(
        listen_comm: Comm,
        recv_comm: *mut Comm,
        dev_comm: *mut *mut ncclNetDeviceHandle_t,
    ) -> ncclResult_t,
    pub regMr: RegMr,
    pub regMrDmaBuf: RegMrDmaBuf,
    pub deregMr: DeregMr,
    pub isend: Isend,
    pub irecv: Irecv,
    pub iflush: Iflush,
    pub test: Test,
    pub closeSend: Close,
    pub closeRecv: Close,
    pub closeListen: Close,
    pub getDeviceMr:
        Option<unsafe extern "C" fn(Comm, *mut c_void, *mut *mut c_void) -> ncclResult_t>,
    pub irecvConsumed: Option<unsafe extern "C" fn(Comm, c_int, *mut c_void) -> ncclResult_t>,
    pub makeVDevice:
        Option<unsafe extern "C" fn(*mut c_int, *mut ncclNetVDeviceProps_t) -> ncclResult_t>,
    pub finalize: unsafe extern "C" fn(ctx: *mut c_void) -> ncclResult_t,
    pub setNetAttr: Option<unsafe extern "C" fn(*mut c_void, *mut ncclNetAttr_t) -> ncclResult_t>,
}

/// `ncclNet_v10_t`: 20 members, no per-communicator context.
#[repr(C)]
pub struct ncclNet_v10_t {
    pub name: *const c_char,
    pub init:
        unsafe extern "C" fn(log: ncclDebugLogger_t, prof: ncclProfilerCallback_t) -> ncclResult_t,
    pub devices: unsafe extern "C" fn(ndev: *mut c_int) -> ncclResult_t,
    pub getProperties:
        unsafe extern "C" fn(dev: c_int, props: *mut ncclNetProperties_v10_t) -> ncclResult_t,
    pub listen: unsafe extern "C" fn(
        dev: c_int,
        handle: *mut c_void,
        listen_comm: *mut Comm,
    ) -> ncclResult_t,
    pub connect: unsafe extern "C" fn(
        dev: c_int,
        config: *mut ncclNetCommConfig_t,
        handle: *mut c_void,
        send_comm: *mut Comm,
        dev_comm: *mut *mut ncclNetDeviceHandle_t,
    ) -> ncclResult_t,
    pub accept: unsafe extern "C" fn(
        listen_comm: Comm,
        recv_comm: *mut Comm,
        dev_comm: *mut *mut ncclNetDeviceHandle_t,
    ) -> ncclResult_t,
    pub regMr: RegMr,
    pub regMrDmaBuf: RegMrDmaBuf,
    pub deregMr: DeregMr,
    pub isend: Isend,
    pub irecv: Irecv,
    pub iflush: Iflush,
    pub test: Test,
    pub closeSend: Close,
    pub closeRecv: Close,
    pub closeListen: Close,
    pub getDeviceMr:
        Option<unsafe extern "C" fn(Comm, *mut c_void, *mut *mut c_void) -> ncclResult_t>,
    pub irecvConsumed: Option<unsafe extern "C" fn(Comm, c_int, *mut c_void) -> ncclResult_t>,
    pub makeVDevice:
        Option<unsafe extern "C" fn(*mut c_int, *mut ncclNetVDeviceProps_t) -> ncclResult_t>,
}

pub type RegMr = unsafe extern "C" fn(
    comm: Comm,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t;
pub type RegMrDmaBuf = unsafe extern "C" fn(
    comm: Comm,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t;
pub type DeregMr = unsafe extern "C" fn(comm: Comm, mhandle: *mut c_void) -> ncclResult_t;
pub type Isend = unsafe extern "C" fn(
    send_comm: Comm,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type Irecv = unsafe extern "C" fn(
    recv_comm: Comm,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type Iflush = unsafe extern "C" fn(
    recv_comm: Comm,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t;
pub type Test =
    unsafe extern "C" fn(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t;
pub type Close = unsafe extern "C" fn(comm: Comm) -> ncclResult_t;

/// `ncclNvlDomainInfo_v5_t`.
#[repr(C)]
pub struct ncclNvlDomainInfo_v5_t {
    pub nNvlDomains: c_int,
    pub minRanksPerNvlDomain: c_int,
    pub maxRanksPerNvlDomain: c_int,
}

/// `ncclFunc_t` values.
pub const NCCL_FUNC_BROADCAST: c_int = 0;
pub const NCCL_FUNC_REDUCE: c_int = 1;
pub const NCCL_FUNC_ALLGATHER: c_int = 2;
pub const NCCL_FUNC_REDUCESCATTER: c_int = 3;
pub const NCCL_FUNC_ALLREDUCE: c_int = 4;

pub type GetCollInfo = unsafe extern "C" fn(
    ctx: *mut c_void,
    coll: c_int,
    n_bytes: usize,
    num_pipe_ops: c_int,
    cost_table: *mut *mut c_float,
    num_algo: c_int,
    num_proto: c_int,
    reg_buff: c_int,
    n_channels: *mut c_int,
) -> ncclResult_t;

/// `ncclTuner_v5_t`. The constants pointer is opaque to us: we never rewrite NCCL's model.
#[repr(C)]
pub struct ncclTuner_v5_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        ctx: *mut *mut c_void,
        comm_id: u64,
        n_ranks: usize,
        n_nodes: usize,
        log: ncclDebugLogger_t,
        nvl: *mut ncclNvlDomainInfo_v5_t,
        constants: *mut c_void,
    ) -> ncclResult_t,
    pub getCollInfo: GetCollInfo,
    pub finalize: unsafe extern "C" fn(ctx: *mut c_void) -> ncclResult_t,
}

/// `ncclTuner_v4_t` (NCCL 2.24 to 2.27).
#[repr(C)]
pub struct ncclTuner_v4_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        n_ranks: usize,
        n_nodes: usize,
        log: ncclDebugLogger_t,
        ctx: *mut *mut c_void,
    ) -> ncclResult_t,
    pub getCollInfo: GetCollInfo,
    pub destroy: unsafe extern "C" fn(ctx: *mut c_void) -> ncclResult_t,
}

/// `ncclEnv_v1_t` (NCCL 2.28+, `NCCL_ENV_PLUGIN`): NCCL asks it for every variable it reads.
/// The string returned must stay valid until `finalize` or the next `getEnv` of that name.
#[repr(C)]
pub struct ncclEnv_v1_t {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(
        major: u8,
        minor: u8,
        patch: u8,
        suffix: *const c_char,
    ) -> ncclResult_t,
    pub finalize: unsafe extern "C" fn() -> ncclResult_t,
    pub getEnv: unsafe extern "C" fn(name: *const c_char) -> *const c_char,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_c_headers() {
        assert_eq!(size_of::<ncclNetProperties_v10_t>(), 104);
        assert_eq!(size_of::<ncclNetProperties_v11_t>(), 112);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, ptrSupport), 24);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, speed), 36);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, latency), 44);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, maxRecvs), 52);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, netDeviceType), 56);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, vProps), 64);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, maxP2pBytes), 88);
        assert_eq!(offset_of!(ncclNetProperties_v10_t, maxCollBytes), 96);
        assert_eq!(
            offset_of!(ncclNetProperties_v11_t, maxMultiRequestSize),
            104
        );
        assert_eq!(size_of::<ncclNetDeviceHandle_t>(), 32);
        assert_eq!(size_of::<ncclNetAttr_t>(), 44);
        assert_eq!(size_of::<ncclNet_v11_t>(), 22 * 8);
        assert_eq!(size_of::<ncclNet_v10_t>(), 20 * 8);
        assert_eq!(size_of::<ncclTuner_v5_t>(), 4 * 8);
        assert_eq!(size_of::<ncclTuner_v4_t>(), 4 * 8);
        assert_eq!(size_of::<ncclEnv_v1_t>(), 4 * 8);
        assert_eq!(offset_of!(ncclEnv_v1_t, getEnv), 24);
    }
}
