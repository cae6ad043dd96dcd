//! `libvgpu_nccl.so` through its real ABI, without a GPU: the built library is `dlopen`ed and
//! its `ncclNetPlugin_v11`/`_v10` and `ncclTunerPlugin_v5` tables are driven the way NCCL's
//! proxy thread drives them (connect/accept polled until done, 32 requests in flight, NULL
//! requests on back-pressure retried, completions tested out of order), with host buffers,
//! between two processes: this test binary re-executes itself as the receiving rank.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_nccl::abi::*;

mod support;
use support::{
    Buf, Plugin, accept_polled, connect_polled, drain, fake_cuda_env, fake_driver, fake_ibverbs,
    fake_ibverbs_env, irecv_one, library, listen_announced, ok, plugin, read_handle,
};

/// The bytes of message `i` of a run: every byte depends on the message and its position.
fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((i * 131 + j * 7 + (j >> 11)) % 251) as u8)
        .collect()
}

fn sizes(n: usize) -> Vec<usize> {
    let fixed = [0usize, 1, 4096, 65_535, 1 << 20, (3 << 20) + 17, 512 << 10];
    (0..n)
        .map(|i| fixed[i % fixed.len()] + (i * 977) % 3000)
        .collect()
}

/// With `VGPU_NCCL_TEST_GPU=1` (and the fake driver of `tests/fakecuda.c` first on the library
/// path, named by `VGPU_NCCL_FAKE_CUDA`), some buffers on each side are "device memory" of the
/// fake driver, so the same-host path exports, imports and copies them as it does on a GPU.
fn gpu_mode() -> bool {
    std::env::var("VGPU_NCCL_TEST_GPU").is_ok_and(|v| v == "1")
}

/// The fake driver's counters: copies issued in the application's (primary) context, copies in
/// any other context, contexts created.
fn fake_stats() -> (i64, i64, i64) {
    let (mut primary, mut other, mut created) = (0i64, 0i64, 0i64);
    // SAFETY: `void fake_cuda_stats(long *, long *, long *)` with three out-pointers.
    unsafe {
        let stats = fake_driver()
            .get::<unsafe extern "C" fn(*mut i64, *mut i64, *mut i64)>(b"fake_cuda_stats\0")
            .expect("fake_cuda_stats");
        stats(&mut primary, &mut other, &mut created);
    }
    (primary, other, created)
}

const MESSAGES: usize = 96;
const CAP: usize = (4 << 20) + 4096;

/// The fake driver's count of stream value writes (the GPU publishing completions).
fn fake_writes() -> i64 {
    // SAFETY: `long fake_cuda_writes(void)`.
    unsafe {
        fake_driver()
            .get::<unsafe extern "C" fn() -> i64>(b"fake_cuda_writes\0")
            .expect("fake_cuda_writes")()
    }
}

fn init(p: &Plugin, v10: bool) -> *mut c_void {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: calling the plugin's entry points with valid arguments, as NCCL does.
    unsafe {
        if v10 {
            ok((p.v10.init)(None, None), "init_v10");
        } else {
            ok(
                (p.net.init)(&mut ctx, 7, std::ptr::null_mut(), None, None),
                "init",
            );
        }
        let mut n = 0;
        ok((p.net.devices)(&mut n), "devices");
        assert_eq!(n, 1);
        let mut props: ncclNetProperties_v11_t = std::mem::zeroed();
        ok((p.net.getProperties)(0, &mut props), "getProperties");
        assert_eq!(
            std::ffi::CStr::from_ptr(props.v10.name).to_str().unwrap(),
            "vgpu"
        );
        assert!(props.v10.ptrSupport & NCCL_PTR_HOST != 0);
        assert_eq!(props.v10.maxRecvs, 1);
        assert_eq!(props.maxMultiRequestSize, 1);
        assert_ne!(
            (p.net.getProperties)(1, &mut props),
            NCCL_SUCCESS,
            "device 1 must not exist"
        );
    }
    ctx
}

fn receiver() {
    let p = plugin();
    let v10 = std::env::var("VGPU_NCCL_V10").is_ok();
    let ctx = init(&p, v10);
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut lc = std::ptr::null_mut();
    // SAFETY: plugin calls with valid arguments.
    unsafe {
        if v10 {
            ok(
                (p.v10.listen)(0, handle.as_mut_ptr().cast(), &mut lc),
                "listen",
            );
        } else {
            ok(
                (p.net.listen)(ctx, 0, handle.as_mut_ptr().cast(), &mut lc),
                "listen",
            );
        }
    }
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    println!("\nHANDLE {hex}");
    std::io::stdout().flush().unwrap();
    let rc = accept_polled(&p, lc);
    // in GPU mode three of every four receive buffers are device memory
    let bufs: Vec<Buf> = (0..32)
        .map(|slot| Buf::new(CAP, gpu_mode() && slot % 4 != 3))
        .collect();
    let mut mhs = Vec::new();
    for b in &bufs {
        let mut mh = std::ptr::null_mut();
        // SAFETY: registering a live buffer of the kind it is.
        ok(
            unsafe { (p.net.regMr)(rc, b.ptr.cast(), CAP, b.kind(), &mut mh) },
            "regMr",
        );
        mhs.push(mh);
    }
    // a multi-receive is refused: maxRecvs is 1
    {
        let mut data = [bufs[0].ptr.cast::<c_void>(), bufs[1].ptr.cast()];
        let mut sz = [CAP, CAP];
        let mut tags = [0, 0];
        let mut mh2 = [mhs[0], mhs[1]];
        let mut req = std::ptr::null_mut();
        // SAFETY: arrays of two valid entries.
        let r = unsafe {
            (p.net.irecv)(
                rc,
                2,
                data.as_mut_ptr(),
                sz.as_mut_ptr(),
                tags.as_mut_ptr(),
                mh2.as_mut_ptr(),
                std::ptr::null_mut(),
                &mut req,
            )
        };
        assert_eq!(r, NCCL_INVALID_ARGUMENT);
    }
    let want = sizes(MESSAGES);
    let mut got = vec![-1i32; MESSAGES];
    let mut bad = 0;
    // rounds of 32 receives in flight, tested newest first (out of order)
    for round in (0..MESSAGES).step_by(32) {
        let mut reqs = Vec::new();
        for i in round..(round + 32).min(MESSAGES) {
            let slot = i % 32;
            let req = irecv_one(&p, rc, bufs[slot].ptr, CAP, mhs[slot]);
            assert!(!req.is_null());
            reqs.push((i, req));
        }
        reqs.reverse();
        drain(&p, &mut reqs, &mut got);
        for i in round..(round + 32).min(MESSAGES) {
            if got[i] as usize != want[i] || bufs[i % 32].bytes(want[i]) != pattern(i, want[i]) {
                bad += 1;
            }
        }
    }
    for mh in mhs {
        // SAFETY: deregistering handles from regMr.
        ok(unsafe { (p.net.deregMr)(rc, mh) }, "deregMr");
    }
    // SAFETY: closing comms made above.
    unsafe {
        ok((p.net.closeRecv)(rc), "closeRecv");
        ok((p.net.closeListen)(lc), "closeListen");
        if !v10 {
            ok((p.net.finalize)(ctx), "finalize");
        }
    }
    println!("RESULT received={MESSAGES} bad={bad}");
}

#[test]
fn child_receiver() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        receiver();
    }
}

/// Run a receiving child with `env`, send MESSAGES messages to it, return its result line.
/// Connections to the listener of `handle` that present a wrong secret, over TCP and over the
/// same-host socket (when it exists); kept open by the caller.
fn intrude(handle: &[u8]) -> Vec<Box<dyn std::any::Any>> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    use vgpu_nccl::wire::{Hello, ListenHandle};
    let listen = ListenHandle::decode(handle).expect("a vgpu handle");
    let hello = |local: bool| {
        Hello {
            local,
            conn: 77,
            index: 0,
            streams: 1,
            pid: 1,
            secret: [0x42; 16],
            rdma: false,
        }
        .encode()
    };
    let mut kept: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut tcp = std::net::TcpStream::connect(listen.tcp).expect("the listener's TCP port");
    tcp.write_all(&hello(false)).unwrap();
    kept.push(Box::new(tcp));
    if let Ok(mut unix) = SocketAddr::from_abstract_name(listen.unix_name().as_bytes())
        .and_then(|address| UnixStream::connect_addr(&address))
    {
        unix.write_all(&hello(true)).unwrap();
        kept.push(Box::new(unix));
    }
    kept
}

fn exchange(env: &[(&str, &str)], throttle: Option<(&Path, u64)>) -> (String, usize) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env("VGPU_NCCL_NO_BUILD", "1")
        .args([
            "child_receiver",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("VGPU_NCCL_CHILD", "1")
        .envs(env.iter().copied())
        // `CHILD:NAME=value`: a setting of the receiving rank only
        .envs(
            env.iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("CHILD:")?, *v))),
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the receiving rank");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let handle_line = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.contains("HANDLE "))
        .expect("child printed its handle");
    let hex = &handle_line[handle_line.find("HANDLE ").unwrap() + "HANDLE ".len()..];
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    // Another process on the node finds the listener (its TCP port, its abstract socket's name
    // in /proc/net/unix) and connects first, with a well-formed hello but not the secret of the
    // handle. The receiver must not take it for the rank: the exchange below only completes if
    // it keeps waiting for the real connection.
    let _intruders = intrude(&handle);
    for (k, v) in env.iter().filter(|(k, _)| !k.starts_with("CHILD:")) {
        // the sender's settings must match the receiver's (same process env in NCCL)
        // SAFETY: single-threaded at this point of the test, before the plugin reads them.
        unsafe { std::env::set_var(k, v) };
    }
    if let Some((table, flow)) = throttle {
        // SAFETY: as above.
        unsafe {
            std::env::set_var("VGPU_NETSHARE_TABLE", table);
            std::env::set_var("VGPU_NETSHARE_FLOW", flow.to_string());
        }
    }
    let p = plugin();
    let v10 = env.iter().any(|(k, _)| *k == "VGPU_NCCL_V10");
    let ctx = init(&p, v10);
    let mut sc: *mut c_void = std::ptr::null_mut();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sc.is_null() {
        assert!(Instant::now() < deadline, "connect never completed");
        // SAFETY: polling connect with the same handle buffer, as NCCL does.
        unsafe {
            if v10 {
                ok(
                    (p.v10.connect)(
                        0,
                        std::ptr::null_mut(),
                        handle.as_mut_ptr().cast(),
                        &mut sc,
                        std::ptr::null_mut(),
                    ),
                    "connect",
                );
            } else {
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
        }
    }
    let want = sizes(MESSAGES);
    // in GPU mode every third message leaves from device memory: with the receiver's buffers
    // that makes device-to-device, host-to-device, device-to-host (staged) and host-to-host
    let payloads: Vec<Buf> = (0..MESSAGES)
        .map(|i| Buf::with(&pattern(i, want[i]), gpu_mode() && i % 3 == 0))
        .collect();
    let mut mhs = Vec::new();
    for b in &payloads {
        let mut mh = std::ptr::null_mut();
        // SAFETY: registering a live buffer of the kind it is.
        ok(
            unsafe { (p.net.regMr)(sc, b.ptr.cast(), b.len, b.kind(), &mut mh) },
            "regMr",
        );
        mhs.push(mh);
    }
    let mut null_requests = 0;
    let mut sent = vec![-1i32; MESSAGES];
    for round in (0..MESSAGES).step_by(32) {
        let mut reqs = Vec::new();
        for i in round..(round + 32).min(MESSAGES) {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let mut req = std::ptr::null_mut();
                // SAFETY: a registered live buffer.
                ok(
                    unsafe {
                        (p.net.isend)(
                            sc,
                            payloads[i].ptr.cast(),
                            want[i],
                            0,
                            mhs[i],
                            std::ptr::null_mut(),
                            &mut req,
                        )
                    },
                    "isend",
                );
                if !req.is_null() {
                    reqs.push((i, req));
                    break;
                }
                null_requests += 1; // back-pressure: NCCL retries on its next pass
                assert!(Instant::now() < deadline, "isend never admitted");
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // test in an interleaved order
        reqs.sort_by_key(|&(i, _)| (i % 3, i));
        drain(&p, &mut reqs, &mut sent);
    }
    for i in 0..MESSAGES {
        assert_eq!(
            sent[i] as usize, want[i],
            "send {i} reported the wrong size"
        );
    }
    for mh in mhs {
        // SAFETY: handles from regMr.
        ok(unsafe { (p.net.deregMr)(sc, mh) }, "deregMr");
    }
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let result = rest
        .iter()
        .find(|l| l.contains("RESULT"))
        .cloned()
        .expect("child printed a result");
    // SAFETY: closing the comm made above.
    unsafe {
        ok((p.net.closeSend)(sc), "closeSend");
        if !v10 {
            ok((p.net.finalize)(ctx), "finalize");
        }
    }
    assert!(child.wait().unwrap().success());
    let result = if gpu_mode() {
        let (primary, other, created) = fake_stats();
        let writes = fake_writes();
        format!(
            "{result} copies_primary={primary} copies_other={other} contexts_created={created} value_writes={writes}"
        )
    } else {
        result
    };
    (result, null_requests)
}

/// Runs the ignored test `name` of this binary alone in a new process (the plugin reads its
/// settings once per process), with `env`; asserts it passed and returns what it printed.
fn run_alone(name: &str, env: &[(&str, String)]) -> String {
    run_alone_with_stderr(name, env).0
}

/// `run_alone`, returning what the test printed to stdout and to stderr (where the plugin's
/// INFO lines go with `VGPU_NCCL_LOG_STDERR=1`, the receiving child's included).
fn run_alone_with_stderr(name: &str, env: &[(&str, String)]) -> (String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args([
            name,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let errors = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{name}: {text}\n{errors}");
    (text, errors)
}

/// The number after `key` (such as `nulls=`) in a child's output.
fn number(text: &str, key: &str) -> f64 {
    let word = text
        .split_whitespace()
        .find(|w| w.starts_with(key))
        .unwrap_or_else(|| panic!("{key} in {text}"));
    word[key.len()..].parse().unwrap()
}

// Each scenario runs in its own test process run (env is per process): cargo runs the tests of
// this file in threads of one process, so the scenarios that set variables are serialised here.
#[test]
fn host_buffers_between_processes() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    library(); // build the .so once, before the children that use it
    let scenarios: [(&str, Vec<(&str, &str)>); 4] = [
        (
            "tcp, 4 streams, v11",
            vec![
                ("VGPU_NCCL_LOCAL", "0"),
                ("VGPU_NCCL_SOCKETS", "4"),
                ("VGPU_NCCL_MIN_PART", "65536"),
            ],
        ),
        (
            "same-host socket without the completion ring, v11",
            vec![("VGPU_NCCL_LOCAL", "1"), ("VGPU_NCCL_FIN_RING", "0")],
        ),
        // the completion ring (the default) set up but idle: host receives keep the socket
        (
            "same-host socket with the completion ring, v11",
            vec![("VGPU_NCCL_LOCAL", "1")],
        ),
        (
            "tcp, 3 streams, v10",
            vec![
                ("VGPU_NCCL_LOCAL", "0"),
                ("VGPU_NCCL_SOCKETS", "3"),
                ("VGPU_NCCL_V10", "1"),
            ],
        ),
    ];
    for (name, env) in scenarios {
        let scenario = env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";");
        let text = run_alone("one_scenario", &[("VGPU_NCCL_SCENARIO", scenario)]);
        assert!(
            text.contains(&format!("RESULT received={MESSAGES} bad=0")),
            "{name}: {text}"
        );
    }
}

// The same-host GPU path (export, import, copies into the receiver's device buffers, staging for
// its host buffers, messages in send order) between two processes, with the fake driver: once
// with the copies in the plugin's own context (the default), once in the application's.
#[test]
fn gpu_buffers_between_processes_through_a_fake_driver() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    library(); // build the .so once, before the children that use it
    let fake = fake_cuda_env();
    // the same-host path with copies completing through socket `Fin`s (the ring turned off),
    // with the application's context asked for, on a driver that refuses a context of our own
    // (the application's is used), with each step's copy cut into pieces on several streams,
    // and with the default: copies completing through the shared-memory ring (the receiver
    // refuses a socket Fin then, so passing proves that the ring carried every GPU copy's
    // completion, host receives still in the mix); then the TCP path, whose stream threads
    // stage GPU buffers through pinned memory. With the ring, the GPU publishes each copy's
    // completion (a stream value write into the ring's page) unless turned off
    // (`VGPU_NCCL_GPU_FIN=0`), the driver refuses to register the page, or copies are cut in
    // pieces: then the copy thread does, after the copy's event
    let mut one_piece_copies = None;
    for (local, own, refuse, pieces, ring, gpu_fin) in [
        ("1", None, false, None, false, None),
        ("1", Some("0"), false, None, false, None),
        ("1", None, true, None, false, None),
        ("1", None, false, Some("4"), false, None),
        ("1", None, false, None, true, None),
        ("1", None, false, None, true, Some("0")),
        ("1", None, false, None, true, Some("refused")),
        ("1", None, false, Some("4"), true, None),
        ("0", None, false, None, false, None),
    ] {
        let mut scenario = format!("VGPU_NCCL_LOCAL={local};VGPU_NCCL_TEST_GPU=1");
        if !ring {
            scenario.push_str(";VGPU_NCCL_FIN_RING=0");
        }
        if let Some(n) = pieces {
            scenario.push_str(&format!(";VGPU_NCCL_COPY_PIECES={n}"));
        }
        if let Some(v) = own {
            scenario.push_str(&format!(";VGPU_NCCL_OWN_CONTEXT={v}"));
        }
        if refuse {
            scenario.push_str(";FAKE_CUDA_CTX_CREATE_FAIL=1");
        }
        match gpu_fin {
            Some("refused") => scenario.push_str(";FAKE_CUDA_HOST_REGISTER_FAIL=1"),
            Some(v) => scenario.push_str(&format!(";VGPU_NCCL_GPU_FIN={v}")),
            None => {}
        }
        let mut env = fake.clone();
        env.push(("VGPU_NCCL_SCENARIO", scenario));
        let text = run_alone("one_scenario", &env);
        assert!(
            text.contains(&format!("RESULT received={MESSAGES} bad=0")),
            "VGPU_NCCL_LOCAL {local}, VGPU_NCCL_OWN_CONTEXT {own:?}, context refused {refuse}, pieces {pieces:?}, ring {ring}, GPU completions {gpu_fin:?}: {text}"
        );
        let field = |k: &str| number(&text, k) as i64;
        let (primary, other, created) = (
            field("copies_primary="),
            field("copies_other="),
            field("contexts_created="),
        );
        // same host: 72 of the 96 receives are into device memory, and 8 device sends go to
        // host memory; TCP: the sender stages its 32 device sends (the receiver's copies are
        // counted in its own process)
        let least = if local == "1" { 72 } else { 31 };
        assert!(primary + other >= least, "too few copies: {text}");
        // every device-to-device copy (72 of them) published by the GPU, or none
        let writes = field("value_writes=");
        if local == "1" && ring && gpu_fin.is_none() && pieces.is_none() {
            assert_eq!(writes, 72, "the GPU did not publish every copy: {text}");
        } else {
            assert_eq!(writes, 0, "the GPU published where it should not: {text}");
        }
        if local == "1" && own.is_none() && !refuse && !ring {
            match pieces {
                // a third of the messages are 512 KiB or more: each of those is 4 copies now
                Some(_) => assert!(
                    primary + other >= one_piece_copies.expect("the default ran first") + 40,
                    "the copies were not cut into pieces: {text}"
                ),
                None => one_piece_copies = Some(primary + other),
            }
        }
        if own.is_none() && !refuse {
            assert_eq!(
                (primary, created),
                (0, 1),
                "copies left our context: {text}"
            );
        } else {
            assert_eq!((other, created), (0, 0), "{text}");
        }
    }
}

fn scenario_env() -> Vec<(String, String)> {
    std::env::var("VGPU_NCCL_SCENARIO")
        .unwrap_or_default()
        .split(';')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

#[test]
#[ignore = "run by host_buffers_between_processes in its own process"]
fn one_scenario() {
    let env = scenario_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (result, _) = exchange(&env, None);
    println!("{result}");
}

#[test]
#[ignore = "run by throttled_sends_return_null_requests in its own process"]
fn one_throttled() {
    let dir = std::env::temp_dir().join(format!("vgpu-nccl-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("netshare");
    let owner = netshare::TableOwner::open_or_create(&path).unwrap();
    // 200 MB/s with the minimum burst: ~100 MB of traffic must wait for tokens
    owner
        .set_rate(
            netshare::FlowId(5),
            netshare::BucketConfig::for_rate(200_000_000),
        )
        .unwrap();
    let started = Instant::now();
    let (result, nulls) = exchange(&[("VGPU_NCCL_LOCAL", "0")], Some((&path, 5)));
    let secs = started.elapsed().as_secs_f64();
    let bytes: usize = sizes(MESSAGES).iter().sum();
    println!("{result} nulls={nulls} secs={secs:.2} bytes={bytes}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn throttled_sends_return_null_requests() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    library(); // build the .so once, before the children that use it
    let text = run_alone("one_throttled", &[]);
    assert!(
        text.contains(&format!("RESULT received={MESSAGES} bad=0")),
        "{text}"
    );
    let field = |k: &str| number(&text, k);
    assert!(
        field("nulls=") > 0.0,
        "the bucket never pushed back: {text}"
    );
    // at 200 MB/s plus one burst, the bytes cannot have gone faster than the rate allows
    let min_secs = (field("bytes=") - 8e6) / 200e6;
    assert!(
        field("secs=") >= min_secs * 0.9,
        "sent faster than the share: {text}"
    );
}

/// A tuner context for communicator `comm` of `ranks` ranks, as NCCL's init makes one.
fn tuner_init(p: &Plugin, comm: u64, ranks: usize, nodes: usize) -> *mut c_void {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: tuner init with valid pointers (the constants are not touched).
    ok(
        unsafe {
            (p.tuner.init)(
                &mut ctx,
                comm,
                ranks,
                nodes,
                None,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
        "tuner init",
    );
    ctx
}

/// The channels the tuner picks for the context's next collective (0 = NCCL's choice).
fn tuner_call(p: &Plugin, ctx: *mut c_void) -> c_int {
    let mut ch: c_int = 0;
    // SAFETY: a live tuner context; NCCL's cost table is not read by our tuner.
    ok(
        unsafe {
            (p.tuner.getCollInfo)(
                ctx,
                NCCL_FUNC_ALLREDUCE,
                1 << 28,
                1,
                std::ptr::null_mut(),
                7,
                3,
                0,
                &mut ch,
            )
        },
        "getCollInfo",
    );
    ch
}

#[test]
fn tuner_caps_channels_only_while_another_tenant_is_active() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    library(); // build the .so once, before the children that use it
    let text = run_alone("one_tuner", &[]);
    assert!(
        text.contains("TUNER alone=0 shared=19 other=5 later=0"),
        "{text}"
    );
    // the second tenant best effort: the guaranteed one keeps NCCL's choice, the other gets the
    // best-effort floor (1 channel) while the guaranteed one is active
    let text = run_alone(
        "one_tuner",
        &[("VGPU_NCCL_TEST_OTHER_GUARANTEED", "0".into())],
    );
    assert!(
        text.contains("TUNER alone=0 shared=0 other=1 later=0"),
        "{text}"
    );
}

#[test]
#[ignore = "run by tuner_caps_channels_only_while_another_tenant_is_active in its own process"]
fn one_tuner() {
    let dir = std::env::temp_dir().join(format!("vgpu-nccl-tuner-{}", std::process::id()));
    let file = dir.join("share");
    // SAFETY: set before the plugin reads them, with one test thread.
    unsafe {
        std::env::set_var("VGPU_TENANT", "train");
        std::env::set_var("VGPU_NCCL_WEIGHT", "75");
        std::env::set_var("VGPU_NCCL_ACTIVITY_FILE", &file);
        std::env::set_var("VGPU_NCCL_ACTIVE_MS", "3000");
    }
    let p = plugin();
    let call = |ctx: *mut c_void| tuner_call(&p, ctx);
    // a communicator of one rank: caps apply only once all of a communicator's ranks are on
    // this node, and this one's are
    let ctx = tuner_init(&p, 1, 1, 1);
    let alone = call(ctx);
    // another tenant, in another process, becomes active
    let mut other = Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .args([
            "tuner_other",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .env("VGPU_TENANT", "serve")
        .env("VGPU_NCCL_WEIGHT", "25")
        .env(
            "VGPU_GUARANTEED",
            std::env::var("VGPU_NCCL_TEST_OTHER_GUARANTEED").unwrap_or_else(|_| "1".into()),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(other.stdout.take().unwrap()).lines();
    let other_line = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.contains("OTHER "))
        .expect("other tenant ran");
    let shared = call(ctx);
    // let the other tenant finish
    other.stdin.take().unwrap().write_all(b"done\n").unwrap();
    let _rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    assert!(other.wait().unwrap().success());
    std::thread::sleep(Duration::from_millis(3200));
    let later = call(ctx);
    // SAFETY: finalize the context made above.
    ok(unsafe { (p.tuner.finalize)(ctx) }, "tuner finalize");
    println!(
        "TUNER alone={alone} shared={shared} other={} later={later}",
        &other_line[other_line.find("OTHER ").unwrap() + "OTHER ".len()..]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "the second tenant of one_tuner"]
fn tuner_other() {
    let p = plugin();
    let ctx = tuner_init(&p, 2, 1, 1);
    // the trainer was active a moment ago, so this tenant shares
    let ch = tuner_call(&p, ctx);
    println!("OTHER {ch}");
    std::io::stdout().flush().unwrap();
    // stay registered (and active) until the trainer has asked again
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();

    // SAFETY: finalize the context made above.
    ok(unsafe { (p.tuner.finalize)(ctx) }, "tuner finalize");
}

#[test]
fn ranks_of_one_communicator_agree_on_every_collective() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    library();
    let text = run_alone("two_ranks_one_comm", &[]);
    // collective 0: rank 0 decided before the noisy tenant showed up (NCCL's choice), and rank
    // 1, asking after it did, takes that decision instead of capping (which hung NCCL on the
    // 2 x H200); collective 1 is capped on both; a communicator with a rank elsewhere is not
    assert!(
        text.contains("AGREE c0=0/0 c1=19/19 noisy=5 partial=0"),
        "{text}"
    );
}

#[test]
#[ignore = "run by ranks_of_one_communicator_agree_on_every_collective in its own process"]
fn two_ranks_one_comm() {
    let dir = std::env::temp_dir().join(format!("vgpu-nccl-agree-{}", std::process::id()));
    // SAFETY: set before the plugin reads them (each tuner init reads them), one test thread.
    let tenant = |name: &str, weight: &str| unsafe {
        std::env::set_var("VGPU_TENANT", name);
        std::env::set_var("VGPU_NCCL_WEIGHT", weight);
        std::env::set_var("VGPU_NCCL_ACTIVITY_FILE", dir.join("share"));
        std::env::set_var("VGPU_NCCL_ACTIVE_MS", "3000");
    };
    let p = plugin();
    tenant("train", "75");
    // two ranks of one communicator (as two processes would: each its own slot in the table)
    let r0 = tuner_init(&p, 7, 2, 2);
    let r1 = tuner_init(&p, 7, 2, 2);
    // a communicator of 3 ranks, of which only this one is on this node
    let partial = tuner_init(&p, 11, 3, 1);
    let c0_r0 = tuner_call(&p, r0);
    tenant("noisy", "25");
    let noisy = tuner_init(&p, 9, 1, 1);
    let noisy_ch = tuner_call(&p, noisy);
    let c0_r1 = tuner_call(&p, r1);
    let c1_r1 = tuner_call(&p, r1);
    let c1_r0 = tuner_call(&p, r0);
    let partial_ch = tuner_call(&p, partial);
    println!("AGREE c0={c0_r0}/{c0_r1} c1={c1_r0}/{c1_r1} noisy={noisy_ch} partial={partial_ch}");
    for ctx in [r0, r1, partial, noisy] {
        // SAFETY: finalize each context made above, once.
        ok(unsafe { (p.tuner.finalize)(ctx) }, "tuner finalize");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The RDMA path between two processes through the fake libibverbs of `tests/fakeibverbs.c`
/// (no machine we have has an RDMA device): the same exchange as the TCP scenarios (32 requests
/// in flight, completions tested out of order, sizes from 0 to over 3 MiB, every byte checked),
/// with the same-host path off so that the connection is one the RDMA path serves. The
/// transport each end took is read from the plugin's log; the fake's counters show that every
/// message went through its RDMA writes. Then the fallbacks to TCP: no libibverbs, no device,
/// no active port, turned off, and a listener without a device (the connector is refused).
#[test]
fn rdma_between_processes_through_a_fake_libibverbs() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    let Some(dir) = fake_ibverbs() else {
        eprintln!(
            "SKIPPED rdma_between_processes_through_a_fake_libibverbs: \
             /usr/include/infiniband/verbs.h is missing (apt-get install libibverbs-dev)"
        );
        return;
    };
    library(); // build the .so once, before the children that use it
    let run = |devices: u32, settings: &str| {
        let mut env = fake_ibverbs_env(dir, devices);
        env.push((
            "VGPU_NCCL_SCENARIO",
            format!(
                "VGPU_NCCL_LOCAL=0;VGPU_NCCL_LOG_STDERR=1;VGPU_FAKE_IBV_VERBOSE=1;VGPU_NCCL_MIN_PART=65536{settings}"
            ),
        ));
        let (text, log) = run_alone_with_stderr("one_scenario", &env);
        assert!(
            text.contains(&format!("RESULT received={MESSAGES} bad=0")),
            "{settings}: {text}\n{log}"
        );
        log
    };
    let count = |log: &str, needle: &str| log.matches(needle).count();
    for (settings, fabric) in [
        ("", "InfiniBand"),
        (
            ";VGPU_FAKE_IBV_LINK=eth;VGPU_NCCL_IB_GID_INDEX=1;VGPU_NCCL_V10=1",
            "RoCE",
        ),
    ] {
        let log = run(1, settings);
        // both processes chose RDMA once, and the connection took it on both ends
        assert_eq!(
            count(
                &log,
                &format!("other hosts: rdma over fake_ib0 port 1 ({fabric}")
            ),
            2,
            "{settings}: {log}"
        );
        assert_eq!(count(&log, "connected (rdma)"), 1, "{settings}: {log}");
        assert_eq!(count(&log, "accepted (rdma)"), 1, "{settings}: {log}");
        // the sender's QP wrote every message and the receiver's consumed a receive for each
        assert_eq!(
            count(&log, &format!("writes={MESSAGES} receives=0")),
            1,
            "{settings}: {log}"
        );
        assert_eq!(
            count(&log, &format!("writes=0 receives={MESSAGES}")),
            1,
            "{settings}: {log}"
        );
    }
    for (devices, settings, why) in [
        (
            1,
            ";VGPU_NCCL_IBVERBS_LIB=/nonexistent/libibverbs.so.1",
            "tcp (no libibverbs (/nonexistent/libibverbs.so.1",
        ),
        (0, "", "tcp (no RDMA device)"),
        (
            1,
            ";VGPU_FAKE_IBV_PORT_DOWN=1",
            "tcp (no active port on any RDMA device)",
        ),
        (
            1,
            ";VGPU_NCCL_IB=0",
            "tcp (rdma disabled by VGPU_NCCL_IB=0)",
        ),
        (
            1,
            ";VGPU_NCCL_IB_DEV=mlx5_7",
            "tcp (no RDMA device named mlx5_7",
        ),
    ] {
        let log = run(devices, settings);
        assert_eq!(
            count(&log, &format!("other hosts: {why}")),
            2,
            "{settings}: {log}"
        );
        assert_eq!(count(&log, "connected (tcp)"), 1, "{settings}: {log}");
        assert_eq!(count(&log, "(rdma)"), 0, "{settings}: {log}");
    }
    // the listener has no device, the connector has one: refused, it connects over TCP
    let log = run(1, ";CHILD:VGPU_FAKE_IBV_DEVICES=0");
    assert_eq!(count(&log, "other hosts: rdma over fake_ib0"), 1, "{log}");
    assert_eq!(count(&log, "other hosts: tcp (no RDMA device)"), 1, "{log}");
    assert_eq!(count(&log, "has no RDMA device; using TCP"), 1, "{log}");
    assert_eq!(count(&log, "connected (tcp)"), 1, "{log}");
}

/// A send larger than the receive it meets, on the RDMA path: the sender's `isend` and the
/// receiver's `test` both fail with NCCL's remote error (the TCP path's rule too).
#[test]
fn rdma_truncation_fails_both_ends() {
    if std::env::var("VGPU_NCCL_CHILD").is_ok() {
        return;
    }
    let Some(dir) = fake_ibverbs() else {
        eprintln!("SKIPPED rdma_truncation_fails_both_ends: verbs.h is missing");
        return;
    };
    library();
    let mut env = fake_ibverbs_env(dir, 1);
    env.push(("VGPU_NCCL_LOCAL", "0".into()));
    env.push(("VGPU_NCCL_LOG_STDERR", "1".into()));
    let (text, log) = run_alone_with_stderr("one_truncated", &env);
    assert!(text.contains("SENDER rc=6"), "{text}\n{log}");
    assert!(text.contains("RECEIVER rc=6"), "{text}\n{log}");
    assert!(log.contains("connected (rdma)"), "{log}");
    assert!(
        log.contains("a send of 8192 bytes does not fit the 4096-byte receive"),
        "{log}"
    );
}

#[test]
#[ignore = "run by rdma_truncation_fails_both_ends in its own process"]
fn one_truncated() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .env("VGPU_NCCL_CHILD", "1")
        .args([
            "truncated_receiver",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let handle = read_handle(lines.by_ref().map(|l| l.unwrap()));
    let p = plugin();
    let ctx = init(&p, false);
    let sc = connect_polled(&p, ctx, &handle);
    let payload = Buf::with(&pattern(1, 8192), false);
    let mut mh = std::ptr::null_mut();
    // SAFETY: registering a live host buffer.
    ok(
        unsafe { (p.net.regMr)(sc, payload.ptr.cast(), 8192, NCCL_PTR_HOST, &mut mh) },
        "regMr",
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let rc = loop {
        let mut req = std::ptr::null_mut();
        // SAFETY: a registered live buffer.
        let rc = unsafe {
            (p.net.isend)(
                sc,
                payload.ptr.cast(),
                8192,
                0,
                mh,
                std::ptr::null_mut(),
                &mut req,
            )
        };
        if rc != NCCL_SUCCESS || !req.is_null() {
            break rc;
        }
        assert!(Instant::now() < deadline, "no slot ever came");
        std::thread::sleep(Duration::from_millis(1));
    };
    println!("SENDER rc={rc}");
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    println!("{}", rest.join("\n"));
    assert!(child.wait().unwrap().success());
    // SAFETY: the handle and comm made above.
    unsafe {
        ok((p.net.deregMr)(sc, mh), "deregMr");
        ok((p.net.closeSend)(sc), "closeSend");
    }
}

#[test]
#[ignore = "the receiving rank of one_truncated"]
fn truncated_receiver() {
    let p = plugin();
    let ctx = init(&p, false);
    let lc = listen_announced(&p, ctx);
    let rc = accept_polled(&p, lc);
    let buf = Buf::new(4096, false);
    let mut mh = std::ptr::null_mut();
    // SAFETY: registering a live host buffer.
    ok(
        unsafe { (p.net.regMr)(rc, buf.ptr.cast(), 4096, NCCL_PTR_HOST, &mut mh) },
        "regMr",
    );
    let req = irecv_one(&p, rc, buf.ptr, 4096, mh);
    let deadline = Instant::now() + Duration::from_secs(30);
    let result = loop {
        let (mut done, mut size) = (0, -1);
        // SAFETY: a live request from irecv.
        let r = unsafe { (p.net.test)(req, &mut done, &mut size) };
        if r != NCCL_SUCCESS || done == 1 {
            break r;
        }
        assert!(Instant::now() < deadline, "the receive never failed");
        std::thread::sleep(Duration::from_millis(1));
    };
    println!("RECEIVER rc={result}");
    // SAFETY: the handle and comms made above.
    unsafe {
        ok((p.net.deregMr)(rc, mh), "deregMr");
        ok((p.net.closeRecv)(rc), "closeRecv");
        ok((p.net.closeListen)(lc), "closeListen");
    }
}
