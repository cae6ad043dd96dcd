//! ibverbs, opened at run time: `libibverbs.so.1` is `dlopen`ed (never linked), so the plugin
//! loads on hosts without it. The few structs the RDMA path touches are declared here with the
//! layouts of rdma-core's `<infiniband/verbs.h>` (x86-64; a test compiles a C program against
//! the real header and compares every size and offset). `ibv_post_send`, `ibv_post_recv` and
//! `ibv_poll_cq` are static inline in that header and call through `context->ops`, so
//! `ibv_context_ops` must match exactly; the other calls are exported functions found with
//! `dlsym`. Above the declarations sit small owning wrappers (`Device`, `Cq`, `Qp`,
//! `MemoryRegion`): the `rdma` transport uses only those and holds no `unsafe`.
#![allow(unsafe_code, non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

// ---- declarations (verbs.h, rdma-core 44) ----

#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}

/// `union ibv_gid`: 16 bytes, aligned as its `__be64` view.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

type Fp = *mut c_void;
pub type PollCq = unsafe extern "C" fn(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int;
pub type PostSend = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int;
pub type PostRecv = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers, of which the inline data-path wrappers use
/// `poll_cq` (the 12th), `post_send` and `post_recv` (the 27th and 28th).
#[repr(C)]
pub struct ibv_context_ops {
    /// `_compat_query_device` .. `_compat_create_cq`.
    pub _before_poll_cq: [Fp; 11],
    pub poll_cq: Option<PollCq>,
    /// `req_notify_cq` .. `_compat_destroy_qp`.
    pub _between: [Fp; 13],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    /// `_compat_create_ah` .. `_compat_async_event`.
    pub _after: [Fp; 5],
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut c_void,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr` with its `wr` union seen as `rdma` (remote address, rkey) and the
/// unions this path never sets kept as padding.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// Network byte order.
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// The rest of the `wr` union (its `atomic` view is 32 bytes).
    pub _wr_rest: [u32; 5],
    pub qp_type_xrc_remote_srqn: u32,
    /// The `bind_mw` / `tso` union.
    pub _tail: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
pub const IBV_QPT_RC: c_uint = 2;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 1 << 7 | 1;

// ---- the library ----

macro_rules! verbs_fns {
    ($($name:ident: $ty:ty;)*) => {
        /// The exported functions of libibverbs this path calls.
        pub struct Verbs {
            _lib: libloading::Library,
            $(pub $name: $ty,)*
            /// `ibv_reg_dmabuf_mr` (rdma-core 34+): absent in older libraries.
            pub ibv_reg_dmabuf_mr: Option<
                unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr,
            >,
        }

        impl Verbs {
            /// # Safety
            /// `lib` must be a libibverbs whose symbols have the signatures of verbs.h.
            unsafe fn resolve(lib: libloading::Library) -> Result<Verbs, String> {
                // SAFETY: the caller's contract; each symbol is looked up by its C name and
                // given the type verbs.h declares for it.
                unsafe {
                    $(let $name = *lib
                        .get::<$ty>(concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|e| format!("{}: {e}", stringify!($name)))?;)*
                    let ibv_reg_dmabuf_mr = lib.get(b"ibv_reg_dmabuf_mr\0").ok().map(|s| *s);
                    Ok(Verbs { _lib: lib, $($name,)* ibv_reg_dmabuf_mr })
                }
            }
        }
    };
}

verbs_fns! {
    ibv_get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_free_device_list: unsafe extern "C" fn(*mut *mut ibv_device);
    ibv_get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
    ibv_open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int;
    ibv_query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    ibv_alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int;
    ibv_create_cq: unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq;
    ibv_destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int;
    ibv_create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int;
}

/// A verbs call that failed: which, and the errno it left (or returned).
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {}", std::io::Error::from_raw_os_error(*.errno))]
pub struct VerbsError {
    pub what: &'static str,
    pub errno: i32,
}

fn errno_of(what: &'static str, rc: c_int) -> VerbsError {
    // verbs calls return -1 with errno, or the errno itself (ibv_modify_qp, the post calls)
    let errno = if rc > 0 {
        rc
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    };
    VerbsError { what, errno }
}

/// Opens `name` (normally `libibverbs.so.1`) once per process; the same answer afterwards.
pub fn load(name: &str) -> Result<&'static Verbs, String> {
    static VERBS: OnceLock<Result<Verbs, String>> = OnceLock::new();
    VERBS
        .get_or_init(|| {
            // SAFETY: loading a C library by name; libibverbs' initialisers only read its
            // configuration and sysfs.
            let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
            // SAFETY: a library with this soname is libibverbs (or a fake with its ABI).
            unsafe { Verbs::resolve(lib) }
        })
        .as_ref()
        .map_err(Clone::clone)
}

// ---- owning wrappers ----

/// Why no RDMA device can be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoDevice {
    /// `ibv_get_device_list` found none (or the kernel has no RDMA support).
    None,
    /// `VGPU_NCCL_IB_DEV` names a device that does not exist.
    NotFound(String),
    /// Devices exist, but no port is ACTIVE.
    NoActivePort,
    /// A call failed while opening one.
    Failed(String),
}

/// What the RDMA path knows of the port it uses.
#[derive(Clone, Copy, Debug)]
pub struct PortInfo {
    pub port: u8,
    pub lid: u16,
    pub gid: ibv_gid,
    pub gid_index: u8,
    /// `enum ibv_mtu` (1 = 256 .. 5 = 4096).
    pub mtu: u8,
    pub link_layer: u8,
    pub max_msg: u32,
}

/// One opened device with a protection domain, for the life of the process.
pub struct Device {
    pub verbs: &'static Verbs,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    pub name: String,
    pub port: PortInfo,
}

// SAFETY: verbs objects may be used from any thread (libibverbs and its providers lock what
// they share); the pointers are only freed by Drop, which needs the sole owner.
unsafe impl Send for Device {}
// SAFETY: as above; every use through `&Device` is a thread-safe verbs call.
unsafe impl Sync for Device {}

impl Device {
    /// The first device with an ACTIVE port (or the one named `wanted`), opened, with a PD.
    pub fn open(
        verbs: &'static Verbs,
        wanted: Option<&str>,
        gid_index: u8,
    ) -> Result<Device, NoDevice> {
        let mut n: c_int = 0;
        // SAFETY: an out-pointer to an int; the list is freed below.
        let list = unsafe { (verbs.ibv_get_device_list)(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: the list returned above, freed once.
                unsafe { (verbs.ibv_free_device_list)(list) };
            }
            return Err(NoDevice::None);
        }
        let mut found = Err(match wanted {
            Some(w) => NoDevice::NotFound(w.to_owned()),
            None => NoDevice::NoActivePort,
        });
        for i in 0..n as usize {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; the name is a C string it owns.
            let name = unsafe { CStr::from_ptr((verbs.ibv_get_device_name)(dev)) }
                .to_string_lossy()
                .into_owned();
            if wanted.is_some_and(|w| w != name) {
                continue;
            }
            match Device::open_one(verbs, dev, name, gid_index) {
                Ok(d) => {
                    found = Ok(d);
                    break;
                }
                Err(e) if wanted.is_some() => {
                    found = Err(e);
                    break;
                }
                Err(NoDevice::Failed(e)) => found = Err(NoDevice::Failed(e)),
                Err(_) => {}
            }
        }
        // SAFETY: opened contexts stay valid after the list is freed (verbs.h says so).
        unsafe { (verbs.ibv_free_device_list)(list) };
        found
    }

    fn open_one(
        verbs: &'static Verbs,
        dev: *mut ibv_device,
        name: String,
        gid_index: u8,
    ) -> Result<Device, NoDevice> {
        let failed = |what: &'static str, rc: c_int| {
            NoDevice::Failed(format!("{name}: {}", errno_of(what, rc)))
        };
        // SAFETY: a device of a live list.
        let ctx = unsafe { (verbs.ibv_open_device)(dev) };
        if ctx.is_null() {
            return Err(failed("ibv_open_device", -1));
        }
        let close = |e| {
            // SAFETY: the context opened above, closed once on this error path.
            unsafe { (verbs.ibv_close_device)(ctx) };
            Err(e)
        };
        let mut active = None;
        for port in 1..=2u8 {
            let mut attr = ibv_port_attr::default();
            // SAFETY: an open context and a zeroed out-struct of the full size (the exported
            // function fills the compatible prefix, which holds every field read here).
            if unsafe { (verbs.ibv_query_port)(ctx, port, &mut attr) } != 0 {
                break;
            }
            if attr.state == IBV_PORT_ACTIVE {
                active = Some((port, attr));
                break;
            }
        }
        let Some((port, attr)) = active else {
            return close(NoDevice::NoActivePort);
        };
        let mut gid = ibv_gid::default();
        // SAFETY: an open context, an out-pointer to a 16-byte gid.
        let rc = unsafe { (verbs.ibv_query_gid)(ctx, port, c_int::from(gid_index), &mut gid) };
        if rc != 0 {
            return close(failed("ibv_query_gid", rc));
        }
        // SAFETY: an open context.
        let pd = unsafe { (verbs.ibv_alloc_pd)(ctx) };
        if pd.is_null() {
            return close(failed("ibv_alloc_pd", -1));
        }
        Ok(Device {
            verbs,
            ctx,
            pd,
            name,
            port: PortInfo {
                port,
                lid: attr.lid,
                gid,
                gid_index,
                mtu: attr.active_mtu.clamp(1, 5) as u8,
                link_layer: attr.link_layer,
                max_msg: attr.max_msg_sz,
            },
        })
    }

    pub fn has_dmabuf(&self) -> bool {
        self.verbs.ibv_reg_dmabuf_mr.is_some()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: made by open_one; every object of the PD is gone (they borrow the Device).
        unsafe {
            (self.verbs.ibv_dealloc_pd)(self.pd);
            (self.verbs.ibv_close_device)(self.ctx);
        }
    }
}

/// A registered memory region; deregistered on drop.
pub struct MemoryRegion {
    verbs: &'static Verbs,
    mr: *mut ibv_mr,
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

// SAFETY: an ibv_mr is a handle the NIC uses; its fields are read-only after registration.
unsafe impl Send for MemoryRegion {}

pub const ACCESS_RECV: c_int = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
pub const ACCESS_SEND: c_int = IBV_ACCESS_LOCAL_WRITE;

impl MemoryRegion {
    /// Registers `len` bytes at `addr` (host memory, or GPU memory where a peer-memory driver
    /// lets the NIC reach it).
    pub fn register(
        dev: &Device,
        addr: u64,
        len: usize,
        access: c_int,
    ) -> Result<MemoryRegion, VerbsError> {
        // SAFETY: a live PD; the caller (NCCL, through regMr) keeps the range valid until the
        // region is deregistered, which happens before the Device is dropped.
        let mr = unsafe { (dev.verbs.ibv_reg_mr)(dev.pd, addr as *mut c_void, len.max(1), access) };
        MemoryRegion::wrap(dev, mr, "ibv_reg_mr")
    }

    /// Registers a dma-buf (`fd` at `offset`) that the application sees at `addr`.
    pub fn register_dmabuf(
        dev: &Device,
        addr: u64,
        len: usize,
        offset: u64,
        fd: c_int,
        access: c_int,
    ) -> Result<MemoryRegion, VerbsError> {
        let Some(reg) = dev.verbs.ibv_reg_dmabuf_mr else {
            return Err(VerbsError {
                what: "ibv_reg_dmabuf_mr (absent from this libibverbs)",
                errno: libc::ENOSYS,
            });
        };
        // SAFETY: a live PD and the descriptor NCCL passes for this range, as above.
        let mr = unsafe { reg(dev.pd, offset, len.max(1), addr, fd, access) };
        MemoryRegion::wrap(dev, mr, "ibv_reg_dmabuf_mr")
    }

    fn wrap(dev: &Device, mr: *mut ibv_mr, what: &'static str) -> Result<MemoryRegion, VerbsError> {
        if mr.is_null() {
            return Err(errno_of(what, -1));
        }
        // SAFETY: a region just registered; its fields are set by the library.
        let (addr, len, lkey, rkey) =
            unsafe { ((*mr).addr as u64, (*mr).length, (*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            verbs: dev.verbs,
            mr,
            addr,
            len,
            lkey,
            rkey,
        })
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by `wrap`'s caller, deregistered once.
        unsafe { (self.verbs.ibv_dereg_mr)(self.mr) };
    }
}

/// A completion queue, polled (no completion channel).
pub struct Cq {
    verbs: &'static Verbs,
    cq: *mut ibv_cq,
}

// SAFETY: see Device.
unsafe impl Send for Cq {}

impl Cq {
    pub fn new(dev: &Device, entries: usize) -> Result<Cq, VerbsError> {
        // SAFETY: an open context; no channel, vector 0.
        let cq = unsafe {
            (dev.verbs.ibv_create_cq)(
                dev.ctx,
                entries as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(errno_of("ibv_create_cq", -1));
        }
        Ok(Cq {
            verbs: dev.verbs,
            cq,
        })
    }

    /// Takes up to `out.len()` completions without waiting; returns how many.
    pub fn poll(&self, out: &mut [ibv_wc]) -> Result<usize, VerbsError> {
        // SAFETY: a live CQ whose context's ops table the provider filled (ibv_poll_cq in
        // verbs.h does exactly this call); `out` has room for the count given.
        let n = unsafe {
            let poll = (*(*self.cq).context).ops.poll_cq.ok_or(VerbsError {
                what: "ibv_poll_cq (no provider op)",
                errno: libc::ENOSYS,
            })?;
            poll(
                self.cq,
                out.len().min(c_int::MAX as usize) as c_int,
                out.as_mut_ptr(),
            )
        };
        if n < 0 {
            return Err(VerbsError {
                what: "ibv_poll_cq",
                errno: libc::EIO,
            });
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: made by `new`; the QPs using it are dropped first (they hold a borrow).
        unsafe { (self.verbs.ibv_destroy_cq)(self.cq) };
    }
}

/// What a peer needs to reach a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mtu: u8,
}

/// One RDMA write with immediate: `len` bytes from `src` (covered by the local key `lkey`) to
/// `remote_addr` under `rkey`, completing as `wr_id`, carrying `imm` (host order here).
pub struct WriteImm {
    pub wr_id: u64,
    pub src: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
}

/// A reliable-connected queue pair.
pub struct Qp {
    verbs: &'static Verbs,
    qp: *mut ibv_qp,
    port: PortInfo,
}

// SAFETY: see Device.
unsafe impl Send for Qp {}

impl Qp {
    /// An RC queue pair on `send`/`recv`, moved to INIT.
    pub fn new(dev: &Device, send: &Cq, recv: &Cq, depth: u32) -> Result<Qp, VerbsError> {
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send.cq,
            recv_cq: recv.cq,
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live PD and CQs; the attribute struct outlives the call.
        let qp = unsafe { (dev.verbs.ibv_create_qp)(dev.pd, &mut init) };
        if qp.is_null() {
            return Err(errno_of("ibv_create_qp", -1));
        }
        let q = Qp {
            verbs: dev.verbs,
            qp,
            port: dev.port,
        };
        let attr = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: dev.port.port,
            qp_access_flags: (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE) as c_uint,
            ..Default::default()
        };
        q.modify(
            attr,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(q)
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP; qp_num is set at creation and never changes.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(
        &self,
        mut attr: ibv_qp_attr,
        mask: c_int,
        what: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: a live QP; the attribute struct outlives the call.
        let rc = unsafe { (self.verbs.ibv_modify_qp)(self.qp, &mut attr, mask) };
        if rc != 0 {
            return Err(errno_of(what, rc));
        }
        Ok(())
    }

    /// INIT -> RTR (toward `remote`) -> RTS (sending from `psn`).
    pub fn connect(&self, remote: &Remote, psn: u32) -> Result<(), VerbsError> {
        let global = self.port.link_layer == IBV_LINK_LAYER_ETHERNET || remote.lid == 0;
        let ah = ibv_ah_attr {
            grh: ibv_global_route {
                dgid: ibv_gid { raw: remote.gid },
                flow_label: 0,
                sgid_index: self.port.gid_index,
                hop_limit: 255,
                traffic_class: 0,
            },
            dlid: remote.lid,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: u8::from(global),
            port_num: self.port.port,
        };
        let rtr = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: c_uint::from(remote.mtu.min(self.port.mtu)),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ah,
            ..Default::default()
        };
        self.modify(
            rtr,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let rts = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            rts,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Posts a signaled RDMA write with immediate (`w`); zero bytes post no scatter entry.
    pub fn post_write_imm(&self, w: &WriteImm) -> Result<(), VerbsError> {
        let mut sge = ibv_sge {
            addr: w.src,
            length: w.len,
            lkey: w.lkey,
        };
        let mut wr = ibv_send_wr {
            wr_id: w.wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: c_int::from(w.len > 0),
            opcode: IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: IBV_SEND_SIGNALED,
            imm_data: w.imm.to_be(),
            remote_addr: w.remote_addr,
            rkey: w.rkey,
            _wr_rest: [0; 5],
            qp_type_xrc_remote_srqn: 0,
            _tail: [0; 6],
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the work request and its scatter entry outlive the call (the
        // provider copies them into the send queue); ibv_post_send in verbs.h is this call.
        let rc = unsafe {
            match (*(*self.qp).context).ops.post_send {
                Some(post) => post(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(errno_of("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Posts a receive without a scatter list: it is consumed by an RDMA write with immediate,
    /// whose data lands where the write says.
    pub fn post_recv(&self, wr_id: u64) -> Result<(), VerbsError> {
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the work request outlives the call; ibv_post_recv in verbs.h is
        // this call.
        let rc = unsafe {
            match (*(*self.qp).context).ops.post_recv {
                Some(post) => post(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(errno_of("ibv_post_recv", rc));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: made by `new`, destroyed once, before its CQs (field order of its owner).
        unsafe { (self.verbs.ibv_destroy_qp)(self.qp) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use std::path::Path;
    use std::process::Command;

    /// Every size, offset and constant this module declares, as `name value` lines, computed by
    /// Rust; the C program below prints the same names from the real header.
    fn rust_layout() -> Vec<String> {
        let mut v = Vec::new();
        macro_rules! size {
            ($t:ident) => {
                v.push(format!("sizeof.{} {}", stringify!($t), size_of::<$t>()));
            };
        }
        macro_rules! off {
            ($t:ident, $($f:tt)+) => {
                v.push(format!("{}.{} {}", stringify!($t), stringify!($($f)+).replace(' ', ""), offset_of!($t, $($f)+)));
            };
        }
        size!(ibv_gid);
        size!(ibv_context_ops);
        size!(ibv_context);
        off!(ibv_context, ops);
        off!(ibv_context, cmd_fd);
        off!(ibv_context, mutex);
        off!(ibv_context, abi_compat);
        off!(ibv_context_ops, poll_cq);
        off!(ibv_context_ops, post_send);
        off!(ibv_context_ops, post_recv);
        size!(ibv_port_attr);
        off!(ibv_port_attr, active_mtu);
        off!(ibv_port_attr, max_msg_sz);
        off!(ibv_port_attr, lid);
        off!(ibv_port_attr, link_layer);
        off!(ibv_port_attr, port_cap_flags2);
        size!(ibv_pd);
        size!(ibv_mr);
        off!(ibv_mr, addr);
        off!(ibv_mr, length);
        off!(ibv_mr, lkey);
        off!(ibv_mr, rkey);
        size!(ibv_cq);
        off!(ibv_cq, cqe);
        size!(ibv_qp);
        off!(ibv_qp, qp_num);
        off!(ibv_qp, events_completed);
        size!(ibv_qp_cap);
        size!(ibv_qp_init_attr);
        off!(ibv_qp_init_attr, cap);
        off!(ibv_qp_init_attr, qp_type);
        off!(ibv_qp_init_attr, sq_sig_all);
        size!(ibv_global_route);
        off!(ibv_global_route, sgid_index);
        size!(ibv_ah_attr);
        off!(ibv_ah_attr, dlid);
        off!(ibv_ah_attr, is_global);
        off!(ibv_ah_attr, port_num);
        size!(ibv_qp_attr);
        off!(ibv_qp_attr, rq_psn);
        off!(ibv_qp_attr, dest_qp_num);
        off!(ibv_qp_attr, qp_access_flags);
        off!(ibv_qp_attr, ah_attr);
        off!(ibv_qp_attr, pkey_index);
        off!(ibv_qp_attr, max_dest_rd_atomic);
        off!(ibv_qp_attr, min_rnr_timer);
        off!(ibv_qp_attr, port_num);
        off!(ibv_qp_attr, timeout);
        off!(ibv_qp_attr, rnr_retry);
        off!(ibv_qp_attr, rate_limit);
        size!(ibv_sge);
        size!(ibv_send_wr);
        off!(ibv_send_wr, num_sge);
        off!(ibv_send_wr, opcode);
        off!(ibv_send_wr, send_flags);
        off!(ibv_send_wr, imm_data);
        off!(ibv_send_wr, remote_addr);
        off!(ibv_send_wr, rkey);
        size!(ibv_recv_wr);
        off!(ibv_recv_wr, num_sge);
        size!(ibv_wc);
        off!(ibv_wc, status);
        off!(ibv_wc, opcode);
        off!(ibv_wc, byte_len);
        off!(ibv_wc, imm_data);
        off!(ibv_wc, wc_flags);
        for (name, value) in [
            ("IBV_PORT_ACTIVE", IBV_PORT_ACTIVE as i64),
            (
                "IBV_LINK_LAYER_INFINIBAND",
                IBV_LINK_LAYER_INFINIBAND as i64,
            ),
            ("IBV_LINK_LAYER_ETHERNET", IBV_LINK_LAYER_ETHERNET as i64),
            ("IBV_QPT_RC", IBV_QPT_RC as i64),
            ("IBV_QPS_INIT", IBV_QPS_INIT as i64),
            ("IBV_QPS_RTR", IBV_QPS_RTR as i64),
            ("IBV_QPS_RTS", IBV_QPS_RTS as i64),
            ("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE as i64),
            ("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE as i64),
            ("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ as i64),
            ("IBV_QP_STATE", IBV_QP_STATE as i64),
            ("IBV_QP_ACCESS_FLAGS", IBV_QP_ACCESS_FLAGS as i64),
            ("IBV_QP_PKEY_INDEX", IBV_QP_PKEY_INDEX as i64),
            ("IBV_QP_PORT", IBV_QP_PORT as i64),
            ("IBV_QP_AV", IBV_QP_AV as i64),
            ("IBV_QP_PATH_MTU", IBV_QP_PATH_MTU as i64),
            ("IBV_QP_TIMEOUT", IBV_QP_TIMEOUT as i64),
            ("IBV_QP_RETRY_CNT", IBV_QP_RETRY_CNT as i64),
            ("IBV_QP_RNR_RETRY", IBV_QP_RNR_RETRY as i64),
            ("IBV_QP_RQ_PSN", IBV_QP_RQ_PSN as i64),
            ("IBV_QP_MAX_QP_RD_ATOMIC", IBV_QP_MAX_QP_RD_ATOMIC as i64),
            ("IBV_QP_MIN_RNR_TIMER", IBV_QP_MIN_RNR_TIMER as i64),
            ("IBV_QP_SQ_PSN", IBV_QP_SQ_PSN as i64),
            (
                "IBV_QP_MAX_DEST_RD_ATOMIC",
                IBV_QP_MAX_DEST_RD_ATOMIC as i64,
            ),
            ("IBV_QP_DEST_QPN", IBV_QP_DEST_QPN as i64),
            (
                "IBV_WR_RDMA_WRITE_WITH_IMM",
                IBV_WR_RDMA_WRITE_WITH_IMM as i64,
            ),
            ("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED as i64),
            ("IBV_WC_SUCCESS", IBV_WC_SUCCESS as i64),
            ("IBV_WC_WITH_IMM", IBV_WC_WITH_IMM as i64),
            (
                "IBV_WC_RECV_RDMA_WITH_IMM",
                IBV_WC_RECV_RDMA_WITH_IMM as i64,
            ),
        ] {
            v.push(format!("{name} {value}"));
        }
        v
    }

    /// The C program printing the same lines from `<infiniband/verbs.h>`.
    fn c_program(names: &[String]) -> String {
        let mut c = String::from(
            "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
        );
        for line in names {
            let name = line.split(' ').next().unwrap();
            let expr = if let Some(t) = name.strip_prefix("sizeof.") {
                // union ibv_gid is the one union
                let kind = if t == "ibv_gid" { "union" } else { "struct" };
                format!("sizeof({kind} {t})")
            } else if let Some((t, f)) = name.split_once('.') {
                // fields this module names differently from the header
                let f = match (t, f) {
                    ("ibv_context_ops", f) => f.to_owned(),
                    ("ibv_send_wr", "remote_addr") => "wr.rdma.remote_addr".to_owned(),
                    ("ibv_send_wr", "rkey") => "wr.rdma.rkey".to_owned(),
                    (_, f) => f.to_owned(),
                };
                format!("offsetof(struct {t}, {f})")
            } else {
                name.to_owned()
            };
            c.push_str(&format!("  printf(\"{name} %ld\\n\", (long)({expr}));\n"));
        }
        c.push_str("  return 0;\n}\n");
        c
    }

    #[test]
    fn layouts_match_the_installed_verbs_header() {
        let header = Path::new("/usr/include/infiniband/verbs.h");
        if !header.exists() {
            eprintln!(
                "SKIPPED layouts_match_the_installed_verbs_header: {} is missing (apt-get install libibverbs-dev)",
                header.display()
            );
            return;
        }
        let rust = rust_layout();
        let dir = std::env::temp_dir().join(format!("vgpu-ibv-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("layout.c");
        let exe = dir.join("layout");
        std::fs::write(&src, c_program(&rust)).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let status = Command::new(cc)
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .status()
            .expect("running cc");
        assert!(status.success(), "compiling the layout program failed");
        let out = Command::new(&exe).output().unwrap();
        let c: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(c.len(), rust.len());
        for (r, c) in rust.iter().zip(&c) {
            assert_eq!(r, c, "Rust against verbs.h");
        }
    }
}
