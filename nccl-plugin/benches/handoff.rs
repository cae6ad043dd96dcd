//! What the same-host path's hand-offs cost, without a GPU: two processes drive the built
//! `libvgpu_nccl.so` through its real `ncclNet_v11` table the way NCCL's proxy threads do (the
//! receiver keeps `DEPTH` receives posted, the sender keeps `DEPTH` sends in flight, both test
//! in a loop), with every buffer in the fake driver's "device" memory, so each message takes
//! the GPU path: the copy thread, its event, and the completion (a socket `Fin`, or the
//! shared-memory ring). The fake driver's copy is a `memcpy` and its events are done at once,
//! so what is measured is the plugin's own path: thread hand-offs, system calls, wake-ups.
//!
//! Each case also runs with the sender's "proxy" testing only every `PASS_US` microseconds, as
//! NCCL's proxy thread does when it serves other connections between two visits to this one:
//! with socket `Fin`s the receiver hears of a finished copy only at the sender's next visit.
//!
//! `cargo bench -p nccl-plugin --bench handoff` prints a table (latency from `isend` to the
//! receiver's completed `test`, p50 and p99, messages per second, and the mean time one receive
//! `test` takes: NCCL's proxy thread pays it for every connection on every pass). `HANDOFF_MESSAGES`
//! (default 4000) and `HANDOFF_SIZES` (bytes, default `4096,262144`) change the run.
#![allow(unsafe_code)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::ffi::c_void;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{
    Buf, accept_polled, connect_polled, fake_cuda_env, handle_from_hex, irecv_one, library,
    listen_announced, ok, plugin,
};

/// Requests in flight per side: NCCL's ring all-reduce keeps 4 (8 steps of 2 slices).
const DEPTH: usize = 4;

fn now_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC is one clock for every process of the host.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn var(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn init(p: &support::Plugin) -> *mut c_void {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: init as NCCL calls it, with no logger.
    ok(
        unsafe { (p.net.init)(&mut ctx, 1, std::ptr::null_mut(), None, None) },
        "init",
    );
    ctx
}

/// Registers `bufs` on `comm` as device memory.
fn register(p: &support::Plugin, comm: *mut c_void, bufs: &[Buf]) -> Vec<*mut c_void> {
    bufs.iter()
        .map(|b| {
            let mut mh = std::ptr::null_mut();
            // SAFETY: a live fake-device buffer of `len` bytes.
            ok(
                unsafe { (p.net.regMr)(comm, b.ptr.cast(), b.len, b.kind(), &mut mh) },
                "regMr",
            );
            mh
        })
        .collect()
}

/// Tests `req` once; true when it is done (and checks the size it reports).
fn done(p: &support::Plugin, req: *mut c_void, size: usize) -> bool {
    let (mut d, mut got) = (0, -1);
    // SAFETY: a live request of isend/irecv.
    ok(unsafe { (p.net.test)(req, &mut d, &mut got) }, "test");
    if d == 1 {
        assert_eq!(got as usize, size, "a message arrived with the wrong size");
    }
    d == 1
}

/// The receiving rank: prints its handle, then one `DONE <i> <ns>` per message.
fn receiver(messages: usize, size: usize) {
    let p = plugin();
    let ctx = init(&p);
    let lc = listen_announced(&p, ctx);
    let rc = accept_polled(&p, lc);
    let bufs: Vec<Buf> = (0..DEPTH).map(|_| Buf::new(size, true)).collect();
    let mhs = register(&p, rc, &bufs);
    let mut posted = std::collections::VecDeque::new();
    let mut times = Vec::with_capacity(messages);
    let (mut next, mut received) = (0, 0);
    // what one `test` costs NCCL's receiving proxy thread (its loop visits every connection)
    let (mut tests, mut test_ns) = (0u64, 0u64);
    while received < messages {
        while next < messages && posted.len() < DEPTH {
            let slot = next % DEPTH;
            let req = irecv_one(&p, rc, bufs[slot].ptr, size, mhs[slot]);
            assert!(!req.is_null(), "irecv refused a receive");
            posted.push_back((next, req));
            next += 1;
        }
        let before = now_ns();
        let finished = posted.front().is_some_and(|&(_, req)| done(&p, req, size));
        test_ns += now_ns() - before;
        tests += 1;
        if let Some(&(i, _)) = posted.front()
            && finished
        {
            times.push(now_ns());
            let first = bufs[i % DEPTH].bytes(size)[0];
            assert_eq!(first, (i % 251) as u8, "message {i} holds the wrong data");
            posted.pop_front();
            received += 1;
        } else {
            // as NCCL's proxy thread does when a pass progressed nothing
            std::thread::yield_now();
        }
    }
    for (i, t) in times.iter().enumerate() {
        println!("DONE {i} {t}");
    }
    println!("TESTS {tests} {test_ns}");
    // SAFETY: closing what was opened above, after every request completed.
    unsafe {
        for mh in mhs {
            ok((p.net.deregMr)(rc, mh), "deregMr");
        }
        ok((p.net.closeRecv)(rc), "closeRecv");
        ok((p.net.closeListen)(lc), "closeListen");
        ok((p.net.finalize)(ctx), "finalize");
    }
}

/// The sending rank: connects to `handle`, sends `messages` messages with `DEPTH` in flight,
/// testing every `pass_us` (0: continuously); prints one `SENT <i> <ns>` per message.
fn sender(handle: &str, messages: usize, size: usize, pass_us: u64) {
    let p = plugin();
    let ctx = init(&p);
    let sc = connect_polled(&p, ctx, &handle_from_hex(handle));
    // one source buffer per message slot, refilled with the message's byte before its send
    let bufs: Vec<Buf> = (0..DEPTH).map(|_| Buf::new(size, true)).collect();
    let mhs = register(&p, sc, &bufs);
    let mut inflight = std::collections::VecDeque::new();
    let mut times = Vec::with_capacity(messages);
    let (mut next, mut sent) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(120);
    while sent < messages {
        assert!(Instant::now() < deadline, "the sends never completed");
        while next < messages && inflight.len() < DEPTH {
            let slot = next % DEPTH;
            // SAFETY: the slot's buffer is free (its last send completed) and `size` long.
            unsafe { std::ptr::write_bytes(bufs[slot].ptr, (next % 251) as u8, size) };
            let mut req = std::ptr::null_mut();
            let at = now_ns();
            // SAFETY: a registered buffer of `size` bytes, valid until the send completes.
            ok(
                unsafe {
                    (p.net.isend)(
                        sc,
                        bufs[slot].ptr.cast(),
                        size,
                        0,
                        mhs[slot],
                        std::ptr::null_mut(),
                        &mut req,
                    )
                },
                "isend",
            );
            if req.is_null() {
                break; // back-pressure: retried on the next pass
            }
            times.push(at);
            inflight.push_back(req);
            next += 1;
        }
        let before = sent;
        while let Some(&req) = inflight.front() {
            if !done(&p, req, size) {
                break;
            }
            inflight.pop_front();
            sent += 1;
        }
        if pass_us > 0 {
            // the proxy thread serves other connections until its next visit (yielding, so
            // that the run measures when it comes back, not how many cores the host has)
            let until = now_ns() + pass_us * 1000;
            while now_ns() < until {
                std::thread::yield_now();
            }
        } else if sent == before {
            std::thread::yield_now();
        }
    }
    for (i, t) in times.iter().enumerate() {
        println!("SENT {i} {t}");
    }
    // SAFETY: closing what was opened above, after every request completed.
    unsafe {
        for mh in mhs {
            ok((p.net.deregMr)(sc, mh), "deregMr");
        }
        ok((p.net.closeSend)(sc), "closeSend");
        ok((p.net.finalize)(ctx), "finalize");
    }
}

/// The numbers after `tag` in `lines`, in message order.
fn stamps(lines: &[String], tag: &str) -> Vec<u64> {
    let mut out: Vec<(usize, u64)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix(tag))
        .map(|rest| {
            let mut it = rest.split_whitespace().map(|w| w.parse::<u64>().unwrap());
            (it.next().unwrap() as usize, it.next().unwrap())
        })
        .collect();
    out.sort_unstable();
    out.into_iter().map(|(_, t)| t).collect()
}

struct Row {
    latency_p50_us: f64,
    latency_p99_us: f64,
    messages_per_s: f64,
    /// Mean time inside the receiver's `test` calls.
    test_ns: f64,
}

/// One case: a receiver and a sender process with `env`; returns what they measured.
fn case(env: &[(&str, String)], messages: usize, size: usize, pass_us: u64) -> Row {
    let exe = std::env::current_exe().expect("the bench executable");
    let spawn = |role: &str, extra: &[(&str, String)]| {
        Command::new(&exe)
            .env("VGPU_NCCL_NO_BUILD", "1")
            .env("HANDOFF_ROLE", role)
            .env("HANDOFF_MESSAGES", messages.to_string())
            .env("HANDOFF_SIZE", size.to_string())
            .env("HANDOFF_PASS_US", pass_us.to_string())
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning a rank")
    };
    let mut rx = spawn("receiver", &[]);
    let mut rx_lines = BufReader::new(rx.stdout.take().unwrap()).lines();
    let handle = rx_lines
        .by_ref()
        .map(|l| l.unwrap())
        .find_map(|l| l.strip_prefix("HANDLE ").map(str::to_owned))
        .expect("the receiver printed its handle");
    let tx = spawn("sender", &[("HANDOFF_HANDLE", handle)]);
    let tx_out = tx.wait_with_output().expect("the sender ran");
    assert!(tx_out.status.success(), "the sender failed");
    let rx_lines: Vec<String> = rx_lines.map(|l| l.unwrap()).collect();
    assert!(rx.wait().expect("the receiver ran").success());
    let tx_lines: Vec<String> = String::from_utf8_lossy(&tx_out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let (sent, done) = (stamps(&tx_lines, "SENT "), stamps(&rx_lines, "DONE "));
    assert_eq!((sent.len(), done.len()), (messages, messages));
    // the first messages include the connection's setup (regions, the ring): leave them out
    let skip = (messages / 10).min(100);
    let mut lat: Vec<u64> = sent[skip..]
        .iter()
        .zip(&done[skip..])
        .map(|(s, d)| d.saturating_sub(*s))
        .collect();
    lat.sort_unstable();
    let pct = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    let span = (done[messages - 1] - sent[skip]) as f64 / 1e9;
    Row {
        latency_p50_us: pct(0.5),
        latency_p99_us: pct(0.99),
        messages_per_s: (messages - skip) as f64 / span,
        test_ns: {
            let (calls, total) = rx_lines
                .iter()
                .find_map(|l| l.strip_prefix("TESTS "))
                .and_then(|rest| rest.split_once(' '))
                .map(|(c, t)| (c.parse::<f64>().unwrap(), t.trim().parse::<f64>().unwrap()))
                .expect("the receiver printed its test count");
            total / calls.max(1.0)
        },
    }
}

fn main() {
    let messages = var("HANDOFF_MESSAGES", 4000);
    match std::env::var("HANDOFF_ROLE").as_deref() {
        Ok("receiver") => return receiver(messages, var("HANDOFF_SIZE", 4096)),
        Ok("sender") => {
            let handle = std::env::var("HANDOFF_HANDLE").expect("HANDOFF_HANDLE");
            let pass = var("HANDOFF_PASS_US", 0) as u64;
            return sender(&handle, messages, var("HANDOFF_SIZE", 4096), pass);
        }
        _ => {}
    }
    library(); // built once, before the ranks load it
    let sizes: Vec<usize> = std::env::var("HANDOFF_SIZES")
        .unwrap_or_else(|_| "4096,262144".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("HANDOFF_SIZES: bytes, comma separated")
        })
        .collect();
    let modes: [(&str, &[(&str, &str)]); 4] = [
        ("socket Fin", &[("VGPU_NCCL_FIN_RING", "0")]),
        (
            "ring, published by the copy thread",
            &[("VGPU_NCCL_GPU_FIN", "0")],
        ),
        ("ring, published by the GPU (default)", &[]),
        (
            "ring by the GPU, copy thread sleeps after 100 us",
            &[("VGPU_NCCL_SPIN_US", "100")],
        ),
    ];
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "same-host GPU path through the fake driver: {messages} messages, {DEPTH} in flight, {cpus} CPUs"
    );
    println!(
        "| bytes | completion | sender visits | latency p50 (us) | latency p99 (us) | messages/s | receiver test (ns) |"
    );
    println!("| ---: | --- | --- | ---: | ---: | ---: | ---: |");
    for &size in &sizes {
        for pass_us in [0u64, 50] {
            for (name, vars) in &modes {
                let mut env = fake_cuda_env();
                env.push(("VGPU_NCCL_LOCAL", "1".into()));
                env.extend(vars.iter().map(|(k, v)| (*k, (*v).to_owned())));
                let row = case(&env, messages, size, pass_us);
                let visits = if pass_us == 0 {
                    "continuous".to_owned()
                } else {
                    format!("every {pass_us} us")
                };
                println!(
                    "| {size} | {name} | {visits} | {:.1} | {:.1} | {:.0} | {:.0} |",
                    row.latency_p50_us, row.latency_p99_us, row.messages_per_s, row.test_ns
                );
            }
        }
    }
}
