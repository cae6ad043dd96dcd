//! Several connections of one process, as NCCL's channels are: one rank opens a connection per
//! channel to its peer, and every same-host sender of the process hands its GPU copies to the
//! same copy thread (`VGPU_NCCL_COPY_THREADS`, default 1). Through the real ABI and the fake
//! driver of `tests/fakecuda.c`, between two processes: `CONNS` connections from one listener,
//! messages spread over them with up to 32 in flight at once, every buffer in "device" memory
//! so every message is a GPU copy, data checked byte for byte on the receiving side. Run with
//! the GPU publishing completions (the default) and with the copy thread publishing them
//! after each copy's event (`VGPU_NCCL_GPU_FIN=0`).
//!
//! Three processes: the test re-executes this binary as the sending rank (the dynamic loader
//! must find the fake `libcuda.so.1` from the start), which re-executes it as the receiving
//! rank.

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_nccl::abi::*;

mod support;
use support::{
    Buf, Plugin, accept_polled, connect_polled, drain, fake_cuda_env, fake_driver, irecv_one,
    library, listen_announced, ok, read_handle,
};

/// Connections (NCCL's channels at its defaults on this path: 4).
const CONNS: usize = 4;
/// Messages per connection.
const PER_CONN: usize = 24;
/// Receives (and sends) in flight per connection: 8 x 4 = NCCL's 32 per process.
const DEPTH: usize = 8;
const CAP: usize = (1 << 20) + 8192;

/// The bytes of message `i` on connection `c`.
fn pattern(c: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((c * 53 + i * 131 + j * 7 + (j >> 9)) % 251) as u8)
        .collect()
}

fn size(c: usize, i: usize) -> usize {
    [1usize << 20, 4096, 0, 65_537, 300_000][(c + i) % 5] + (c * 131 + i * 977) % 2048
}

fn run_self(test: &str, env: &[(&str, String)]) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args([
            test,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("re-executing the test binary")
}

/// Runs the ignored test `test` of this binary in a process of its own with `env`: whether it
/// passed, and what it printed on stdout and stderr.
fn run_self_output(test: &str, env: &[(&str, String)]) -> (bool, String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args([
            test,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .output()
        .expect("re-executing the test binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn init(p: &Plugin) -> *mut c_void {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the plugin's init with valid arguments, as NCCL calls it.
    ok(
        unsafe { (p.net.init)(&mut ctx, 7, std::ptr::null_mut(), None, None) },
        "init",
    );
    ctx
}

#[test]
#[ignore = "the receiving rank of connections_of_one_process_share_its_copy_thread"]
fn channels_receiver() {
    let p = support::plugin();
    let ctx = init(&p);
    let lc = listen_announced(&p, ctx);
    // the connections arrive in any order; the sender says which is which in its first message
    let rcs: Vec<*mut c_void> = (0..CONNS).map(|_| accept_polled(&p, lc)).collect();
    let bufs: Vec<Vec<Buf>> = (0..CONNS)
        .map(|_| (0..DEPTH).map(|_| Buf::new(CAP, true)).collect())
        .collect();
    let mut mhs = vec![vec![std::ptr::null_mut(); DEPTH]; CONNS];
    for (c, rc) in rcs.iter().enumerate() {
        for (slot, b) in bufs[c].iter().enumerate() {
            // SAFETY: registering a live device buffer.
            ok(
                unsafe { (p.net.regMr)(*rc, b.ptr.cast(), CAP, NCCL_PTR_CUDA, &mut mhs[c][slot]) },
                "regMr",
            );
        }
    }
    // which connection is which: the first message on each names its sender-side index
    let mut order = [usize::MAX; CONNS];
    let mut bad = 0;
    for round in (0..PER_CONN).step_by(DEPTH) {
        let mut reqs = Vec::new();
        for i in round..(round + DEPTH).min(PER_CONN) {
            for (c, rc) in rcs.iter().enumerate() {
                let slot = i % DEPTH;
                let req = irecv_one(&p, *rc, bufs[c][slot].ptr, CAP, mhs[c][slot]);
                assert!(!req.is_null());
                reqs.push((c * PER_CONN + i, req));
            }
        }
        reqs.reverse(); // completions tested out of order
        let mut got = vec![-1i32; CONNS * PER_CONN];
        drain(&p, &mut reqs, &mut got);
        for (c, sender_index) in order.iter_mut().enumerate() {
            if *sender_index == usize::MAX {
                // message 0 of sender connection s is 1 MiB + ... with the first byte s-dependent
                let first = bufs[c][0].bytes(1)[0];
                *sender_index = (0..CONNS)
                    .find(|&s| pattern(s, 0, 1)[0] == first)
                    .unwrap_or(usize::MAX);
            }
            let s = *sender_index;
            for i in round..(round + DEPTH).min(PER_CONN) {
                let n = got[c * PER_CONN + i];
                if s == usize::MAX
                    || n as usize != size(s, i)
                    || bufs[c][i % DEPTH].bytes(n as usize) != pattern(s, i, n as usize)
                {
                    bad += 1;
                }
            }
        }
    }
    for (c, rc) in rcs.iter().enumerate() {
        for mh in &mhs[c] {
            // SAFETY: handles from regMr on this comm.
            ok(unsafe { (p.net.deregMr)(*rc, *mh) }, "deregMr");
        }
        // SAFETY: closing a comm made above.
        ok(unsafe { (p.net.closeRecv)(*rc) }, "closeRecv");
    }
    // SAFETY: closing the listener and the context made above.
    unsafe {
        ok((p.net.closeListen)(lc), "closeListen");
        ok((p.net.finalize)(ctx), "finalize");
    }
    println!("RESULT received={} bad={bad}", CONNS * PER_CONN);
}

#[test]
#[ignore = "the sending rank of connections_of_one_process_share_its_copy_thread"]
fn channels_sender() {
    // the receiving rank inherits this process's settings and the fake driver's path
    let mut child = run_self("channels_receiver", &[]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let handle = read_handle(lines.by_ref().map(|l| l.unwrap()));
    let p = support::plugin();
    let ctx = init(&p);
    let scs: Vec<*mut c_void> = (0..CONNS)
        .map(|_| connect_polled(&p, ctx, &handle))
        .collect();
    let payloads: Vec<Vec<Buf>> = (0..CONNS)
        .map(|c| {
            (0..PER_CONN)
                .map(|i| Buf::with(&pattern(c, i, size(c, i)), true))
                .collect()
        })
        .collect();
    let mut mhs = vec![vec![std::ptr::null_mut(); PER_CONN]; CONNS];
    for (c, sc) in scs.iter().enumerate() {
        for (i, b) in payloads[c].iter().enumerate() {
            // SAFETY: registering a live device buffer.
            ok(
                unsafe { (p.net.regMr)(*sc, b.ptr.cast(), b.len, NCCL_PTR_CUDA, &mut mhs[c][i]) },
                "regMr",
            );
        }
    }
    // every connection's sends posted before any is tested, interleaved across connections
    let mut sent = vec![-1i32; CONNS * PER_CONN];
    for round in (0..PER_CONN).step_by(DEPTH) {
        let mut reqs = Vec::new();
        for i in round..(round + DEPTH).min(PER_CONN) {
            for (c, sc) in scs.iter().enumerate() {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let mut req = std::ptr::null_mut();
                    // SAFETY: a registered live buffer of the given size.
                    ok(
                        unsafe {
                            (p.net.isend)(
                                *sc,
                                payloads[c][i].ptr.cast(),
                                payloads[c][i].len,
                                0,
                                mhs[c][i],
                                std::ptr::null_mut(),
                                &mut req,
                            )
                        },
                        "isend",
                    );
                    if !req.is_null() {
                        reqs.push((c * PER_CONN + i, req));
                        break;
                    }
                    assert!(Instant::now() < deadline, "isend never admitted");
                }
            }
        }
        reqs.sort_by_key(|&(k, _)| (k % 3, k));
        drain(&p, &mut reqs, &mut sent);
    }
    for c in 0..CONNS {
        for i in 0..PER_CONN {
            assert_eq!(sent[c * PER_CONN + i] as usize, size(c, i), "send {c}/{i}");
        }
    }
    // read to the end: the receiver prints more after its result
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let result = rest
        .iter()
        .find(|l| l.contains("RESULT"))
        .expect("the receiver printed a result");
    for (c, sc) in scs.iter().enumerate() {
        for mh in &mhs[c] {
            // SAFETY: handles from regMr on this comm.
            ok(unsafe { (p.net.deregMr)(*sc, *mh) }, "deregMr");
        }
        // SAFETY: closing a comm made above.
        ok(unsafe { (p.net.closeSend)(*sc) }, "closeSend");
    }
    // SAFETY: finalizing the context made above.
    ok(unsafe { (p.net.finalize)(ctx) }, "finalize");
    assert!(child.wait().unwrap().success());
    // SAFETY: the fake driver's `long fake_cuda_writes(void)`.
    let writes = unsafe {
        fake_driver()
            .get::<unsafe extern "C" fn() -> i64>(b"fake_cuda_writes\0")
            .expect("fake_cuda_writes")()
    };
    println!("{result} value_writes={writes}");
}

#[test]
fn connections_of_one_process_share_its_copy_thread() {
    library(); // built once, before the ranks load it
    for gpu_fin in ["1", "0"] {
        let mut env = fake_cuda_env();
        env.push(("VGPU_NCCL_LOCAL", "1".into()));
        env.push(("VGPU_NCCL_GPU_FIN", gpu_fin.into()));
        let (passed, text, stderr) = run_self_output("channels_sender", &env);
        assert!(passed, "VGPU_NCCL_GPU_FIN={gpu_fin}: {text}\n{stderr}");
        assert!(
            text.contains(&format!("RESULT received={} bad=0", CONNS * PER_CONN)),
            "VGPU_NCCL_GPU_FIN={gpu_fin}: {text}"
        );
        // every message is a device-to-device copy: all published by the GPU, or none
        let want = if gpu_fin == "1" { CONNS * PER_CONN } else { 0 };
        assert!(
            text.contains(&format!("value_writes={want}")),
            "VGPU_NCCL_GPU_FIN={gpu_fin}: expected {want} GPU-published completions: {text}"
        );
    }
}

/// A GPU-published completion that never reaches the ring (the driver's stream drained, the
/// head unchanged) must fail the connection, not leave NCCL's ranks waiting for ever: the copy
/// thread asks the driver about the stream once a millisecond while such copies are out.
#[test]
fn a_completion_that_never_lands_fails_the_send_instead_of_hanging() {
    library();
    let mut env = fake_cuda_env();
    env.push(("VGPU_NCCL_LOCAL", "1".into()));
    env.push(("FAKE_CUDA_DROP_VALUE_WRITES", "1".into()));
    let started = Instant::now();
    let (passed, stdout, stderr) = run_self_output("channels_sender", &env);
    assert!(!passed, "the sends completed: {stdout}");
    assert!(
        stderr.contains("completion never reached the ring"),
        "not failed for the lost completion: {stdout}\n{stderr}"
    );
    // well inside the harness's own 60 s deadline: the connection failed, nothing timed out
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

/// One process, both ends of a connection: a GPU buffer made as cudaMalloc makes it (no cuMem
/// handle, what `NCCL_CUMEM_ENABLE=0` gives NCCL) is refused at registration with what to do,
/// on the sending side of the same-host and TCP paths and the receiving side of TCP, while a
/// cuMem buffer is taken.
#[test]
#[ignore = "run by legacy_gpu_buffers_are_refused_at_registration"]
fn legacy_registration() {
    let p = support::plugin();
    let ctx = init(&p);
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut lc = std::ptr::null_mut();
    // SAFETY: plugin calls with valid arguments, as NCCL makes them.
    ok(
        unsafe { (p.net.listen)(ctx, 0, handle.as_mut_ptr().cast(), &mut lc) },
        "listen",
    );
    let (mut sc, mut rc): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    let deadline = Instant::now() + Duration::from_secs(30);
    while sc.is_null() || rc.is_null() {
        assert!(Instant::now() < deadline, "connect/accept never completed");
        // SAFETY: polling connect and accept, as NCCL's proxy does.
        unsafe {
            if sc.is_null() {
                ok(
                    (p.net.connect)(
                        ctx,
                        0,
                        handle.as_mut_ptr().cast(),
                        &mut sc,
                        std::ptr::null_mut(),
                    ),
                    "connect",
                );
            }
            if rc.is_null() {
                ok((p.net.accept)(lc, &mut rc, std::ptr::null_mut()), "accept");
            }
        }
    }
    // SAFETY: the fake driver's `void *fake_device_alloc_legacy(size_t)`.
    let legacy = unsafe {
        fake_driver()
            .get::<unsafe extern "C" fn(usize) -> *mut u8>(b"fake_device_alloc_legacy\0")
            .expect("fake_device_alloc_legacy")(1 << 20)
    };
    let vmm = Buf::new(1 << 20, true);
    for (name, comm) in [("send", sc), ("recv", rc)] {
        for (kind, ptr) in [("legacy", legacy), ("cumem", vmm.ptr)] {
            let mut mh = std::ptr::null_mut();
            // SAFETY: a live fake device buffer of 1 MiB.
            let r = unsafe { (p.net.regMr)(comm, ptr.cast(), 1 << 20, NCCL_PTR_CUDA, &mut mh) };
            println!("REG {name} {kind} {r}");
            if r == NCCL_SUCCESS {
                // SAFETY: the handle regMr just gave.
                ok(unsafe { (p.net.deregMr)(comm, mh) }, "deregMr");
            }
        }
    }
    // SAFETY: closing what was opened above.
    unsafe {
        ok((p.net.closeSend)(sc), "closeSend");
        ok((p.net.closeRecv)(rc), "closeRecv");
        ok((p.net.closeListen)(lc), "closeListen");
        ok((p.net.finalize)(ctx), "finalize");
    }
}

#[test]
fn legacy_gpu_buffers_are_refused_at_registration() {
    library();
    for local in ["1", "0"] {
        let mut env = fake_cuda_env();
        env.push(("VGPU_NCCL_LOCAL", local.into()));
        let (passed, stdout, stderr) = run_self_output("legacy_registration", &env);
        assert!(passed, "VGPU_NCCL_LOCAL={local}: {stdout}\n{stderr}");
        let code = |line: &str| {
            let at = stdout
                .find(line)
                .unwrap_or_else(|| panic!("no {line:?}: {stdout}"));
            stdout[at + line.len()..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<i32>()
                .unwrap()
        };
        assert_ne!(
            code("REG send legacy "),
            NCCL_SUCCESS,
            "VGPU_NCCL_LOCAL={local}"
        );
        assert_eq!(
            code("REG send cumem "),
            NCCL_SUCCESS,
            "VGPU_NCCL_LOCAL={local}"
        );
        assert_eq!(
            code("REG recv cumem "),
            NCCL_SUCCESS,
            "VGPU_NCCL_LOCAL={local}"
        );
        if local == "0" {
            // the TCP threads copy into GPU receive buffers from the plugin's context too
            assert_ne!(code("REG recv legacy "), NCCL_SUCCESS);
        }
        assert!(
            stderr.contains("legacy cudaMalloc allocation (NCCL_CUMEM_ENABLE=0?)"),
            "the refusal says what to do: {stderr}"
        );
    }
}
