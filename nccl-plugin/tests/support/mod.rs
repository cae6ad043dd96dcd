//! What the ABI tests and the same-host bench share: the built plugin `dlopen`ed through its
//! real tables, and the fake CUDA driver of `tests/fakecuda.c` with buffers in its "device"
//! memory. Included by `tests/abi.rs` and `benches/handoff.rs`; not every user needs every item.
#![allow(dead_code, unsafe_code)]

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use vgpu_nccl::abi::*;

/// The built `libvgpu_nccl.so` beside this executable's profile directory, built first unless
/// `VGPU_NCCL_NO_BUILD` is set (children of a run that built it already); `VGPU_NCCL_LIB`
/// names another (a bench carried to a machine without Rust).
pub fn library() -> &'static PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Some(so) = std::env::var_os("VGPU_NCCL_LIB") {
            return PathBuf::from(so);
        }
        let exe = std::env::current_exe().expect("test executable");
        let mut dir = exe.parent().expect("has a directory").to_owned();
        if dir.ends_with("deps") {
            dir.pop();
        }
        if std::env::var("VGPU_NCCL_NO_BUILD").is_err() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut b = Command::new(cargo);
            b.args(["build", "-p", "nccl-plugin", "--lib"]);
            if dir.ends_with("release") {
                b.arg("--release");
            }
            assert!(
                b.status().expect("cargo build").success(),
                "building libvgpu_nccl.so failed"
            );
        }
        let so = dir.join("libvgpu_nccl.so");
        assert!(so.exists(), "{} is missing", so.display());
        so
    })
}

pub struct Plugin {
    _lib: libloading::Library,
    pub net: &'static ncclNet_v11_t,
    pub v10: &'static ncclNet_v10_t,
    pub tuner: &'static ncclTuner_v5_t,
}

pub fn plugin() -> Plugin {
    // SAFETY: loading our own plugin library; the symbols are the static tables it exports,
    // with the layouts pinned by the abi module's tests.
    unsafe {
        let lib = libloading::Library::new(library()).expect("dlopen libvgpu_nccl.so");
        let net = &**lib
            .get::<*const ncclNet_v11_t>(b"ncclNetPlugin_v11\0")
            .expect("v11 symbol");
        let v10 = &**lib
            .get::<*const ncclNet_v10_t>(b"ncclNetPlugin_v10\0")
            .expect("v10 symbol");
        let tuner = &**lib
            .get::<*const ncclTuner_v5_t>(b"ncclTunerPlugin_v5\0")
            .expect("tuner symbol");
        Plugin {
            _lib: lib,
            net,
            v10,
            tuner,
        }
    }
}

/// The fake driver, loaded by path: the same object the plugin opens as `libcuda.so.1`.
pub fn fake_driver() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = std::env::var("VGPU_NCCL_FAKE_CUDA").expect("VGPU_NCCL_FAKE_CUDA");
        // SAFETY: our own fake driver; its initialisers do nothing.
        unsafe { libloading::Library::new(path) }.expect("dlopen the fake libcuda")
    })
}

/// A buffer NCCL would hand the plugin: host memory, or fake device memory.
pub struct Buf {
    pub ptr: *mut u8,
    pub len: usize,
    cuda: bool,
    _host: Vec<u8>,
}

impl Buf {
    pub fn new(len: usize, cuda: bool) -> Buf {
        if !cuda {
            let mut host = vec![0u8; len];
            return Buf {
                ptr: host.as_mut_ptr(),
                len,
                cuda,
                _host: host,
            };
        }
        // SAFETY: the fake's allocator, `void *fake_device_alloc(size_t)`; the memory is mapped
        // for the life of the process.
        let ptr = unsafe {
            let alloc = fake_driver()
                .get::<unsafe extern "C" fn(usize) -> *mut u8>(b"fake_device_alloc\0")
                .expect("fake_device_alloc");
            alloc(len.max(1))
        };
        assert!(!ptr.is_null(), "fake device allocation failed");
        Buf {
            ptr,
            len,
            cuda,
            _host: Vec::new(),
        }
    }

    pub fn with(bytes: &[u8], cuda: bool) -> Buf {
        let b = Buf::new(bytes.len(), cuda);
        // SAFETY: `b` holds at least `bytes.len()` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr, bytes.len()) };
        b
    }

    pub fn bytes(&self, n: usize) -> &[u8] {
        assert!(n <= self.len);
        // SAFETY: `n` bytes of a live buffer this value owns or maps.
        unsafe { std::slice::from_raw_parts(self.ptr, n) }
    }

    pub fn kind(&self) -> c_int {
        if self.cuda {
            NCCL_PTR_CUDA
        } else {
            NCCL_PTR_HOST
        }
    }
}

pub fn ok(r: ncclResult_t, what: &str) {
    assert_eq!(r, NCCL_SUCCESS, "{what} returned {r}");
}

/// Polls `accept` on listener `lc` until the connection arrives (30 s at most), as NCCL does.
pub fn accept_polled(p: &Plugin, lc: *mut c_void) -> *mut c_void {
    let mut rc: *mut c_void = std::ptr::null_mut();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while rc.is_null() {
        assert!(
            std::time::Instant::now() < deadline,
            "accept never completed"
        );
        // SAFETY: polling accept on a live listener, as NCCL does.
        ok(
            unsafe { (p.net.accept)(lc, &mut rc, std::ptr::null_mut()) },
            "accept",
        );
    }
    rc
}

/// Posts one receive of up to `size` bytes into `data` (registered as `mh`) on `rc`; returns
/// the request (NULL if the plugin refused it for now).
pub fn irecv_one(
    p: &Plugin,
    rc: *mut c_void,
    data: *mut u8,
    size: usize,
    mh: *mut c_void,
) -> *mut c_void {
    let (mut data, mut size, mut tag, mut mh) = (data.cast::<c_void>(), size, 0, mh);
    let mut req = std::ptr::null_mut();
    // SAFETY: one receive, its buffer live and registered on `rc` as the caller says.
    ok(
        unsafe {
            (p.net.irecv)(
                rc,
                1,
                &mut data,
                &mut size,
                &mut tag,
                &mut mh,
                std::ptr::null_mut(),
                &mut req,
            )
        },
        "irecv",
    );
    req
}

/// The fake driver of `tests/fakecuda.c`, built once as `libcuda.so.1` in a directory of its own
/// (`VGPU_NCCL_FAKE_CUDA_DIR`: a directory that already holds it).
pub fn fake_cuda() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("VGPU_NCCL_FAKE_CUDA_DIR") {
            return PathBuf::from(dir);
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nccl-fakecuda");
        std::fs::create_dir_all(&dir).expect("creating the fake driver's directory");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        // written under a temporary name and renamed: a concurrent run never loads half a file
        let partial = dir.join(format!("libcuda.so.1.{}.tmp", std::process::id()));
        let status = Command::new(cc)
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror"])
            .args(["-Wl,-soname,libcuda.so.1", "-o"])
            .arg(&partial)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fakecuda.c"))
            .status()
            .expect("running cc (install build-essential)");
        assert!(status.success(), "compiling tests/fakecuda.c failed");
        std::fs::rename(&partial, dir.join("libcuda.so.1")).expect("renaming the fake driver");
        dir
    })
}

/// The variables that make the plugin (in a child process) open the fake driver, and let the
/// child allocate its "device" buffers from it.
pub fn fake_cuda_env() -> Vec<(&'static str, String)> {
    let dir = fake_cuda();
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(rest) if !rest.is_empty() => format!("{}:{rest}", dir.display()),
        _ => dir.display().to_string(),
    };
    vec![
        ("LD_LIBRARY_PATH", path),
        (
            "VGPU_NCCL_FAKE_CUDA",
            dir.join("libcuda.so.1").display().to_string(),
        ),
    ]
}

/// The fake libibverbs of `tests/fakeibverbs.c`, built once as `libibverbs.so.1` in a directory
/// of its own against the installed `<infiniband/verbs.h>` (so its layouts are the real ones).
/// `None` when the header is missing (`apt-get install libibverbs-dev`; CI installs it).
pub fn fake_ibverbs() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        if !Path::new("/usr/include/infiniband/verbs.h").exists() {
            return None;
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nccl-fakeibverbs");
        std::fs::create_dir_all(&dir).expect("creating the fake libibverbs' directory");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let partial = dir.join(format!("libibverbs.so.1.{}.tmp", std::process::id()));
        let status = Command::new(cc)
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread"])
            .args(["-Wl,-soname,libibverbs.so.1", "-o"])
            .arg(&partial)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fakeibverbs.c"))
            .status()
            .expect("running cc (install build-essential)");
        assert!(status.success(), "compiling tests/fakeibverbs.c failed");
        std::fs::rename(&partial, dir.join("libibverbs.so.1")).expect("renaming the fake");
        Some(dir)
    })
    .as_ref()
}

/// The variables that make the plugin (in this process's children) open the fake libibverbs
/// first, with `devices` devices (0 or 1).
pub fn fake_ibverbs_env(dir: &Path, devices: u32) -> Vec<(&'static str, String)> {
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(rest) if !rest.is_empty() => format!("{}:{rest}", dir.display()),
        _ => dir.display().to_string(),
    };
    vec![
        ("LD_LIBRARY_PATH", path),
        ("VGPU_FAKE_IBV_DEVICES", devices.to_string()),
    ]
}

/// Test every request in `reqs` (in the order given) until all are done; returns sizes.
pub fn drain(p: &Plugin, reqs: &mut Vec<(usize, *mut c_void)>, sizes: &mut [i32]) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !reqs.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "requests never completed"
        );
        reqs.retain(|&(i, r)| {
            let (mut done, mut size) = (0, -1);
            // SAFETY: `r` is a live request from isend/irecv.
            ok(unsafe { (p.net.test)(r, &mut done, &mut size) }, "test");
            if done == 1 {
                sizes[i] = size;
            }
            done == 0
        });
    }
}

/// Listens on device 0 of the v11 table and prints the handle as a `HANDLE <hex>` line (its own
/// line, flushed) for the rank that will connect; returns the listen comm.
pub fn listen_announced(p: &Plugin, ctx: *mut c_void) -> *mut c_void {
    use std::io::Write;
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut lc = std::ptr::null_mut();
    // SAFETY: listen with a handle buffer of NCCL's size, as NCCL calls it.
    ok(
        unsafe { (p.net.listen)(ctx, 0, handle.as_mut_ptr().cast(), &mut lc) },
        "listen",
    );
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    println!("\nHANDLE {hex}");
    std::io::stdout().flush().expect("stdout");
    lc
}

/// The handle of the first `HANDLE <hex>` line among `lines` (the harness may print
/// `test name ... ` before it on the same line).
pub fn read_handle(lines: impl Iterator<Item = String>) -> [u8; NCCL_NET_HANDLE_MAXSIZE] {
    let mut lines = lines;
    let line = lines
        .find(|l| l.contains("HANDLE "))
        .expect("the listening rank printed its handle");
    handle_from_hex(&line[line.find("HANDLE ").unwrap() + "HANDLE ".len()..])
}

pub fn handle_from_hex(hex: &str) -> [u8; NCCL_NET_HANDLE_MAXSIZE] {
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("a hex handle");
    }
    handle
}

/// Polls the v11 `connect` to `handle` (a copy: connect keeps its state in the handle) until
/// the connection is made, 30 s at most, as NCCL does.
pub fn connect_polled(
    p: &Plugin,
    ctx: *mut c_void,
    handle: &[u8; NCCL_NET_HANDLE_MAXSIZE],
) -> *mut c_void {
    let mut h = *handle;
    let mut sc: *mut c_void = std::ptr::null_mut();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while sc.is_null() {
        assert!(
            std::time::Instant::now() < deadline,
            "connect never completed"
        );
        // SAFETY: polling connect with the same handle buffer, as NCCL does.
        ok(
            unsafe {
                (p.net.connect)(ctx, 0, h.as_mut_ptr().cast(), &mut sc, std::ptr::null_mut())
            },
            "connect",
        );
    }
    sc
}
