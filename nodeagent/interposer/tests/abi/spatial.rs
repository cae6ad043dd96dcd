//! Spatial partitioning through the real ABI: a latency tenant's probe stamps the GPU's schedule
//! file, and a squeezable tenant's probe launches; the fake driver's trace says which stream
//! each kernel ran on and in what order the events were recorded and waited for.
//!
//! Trace tokens (see `fakecuda.c`): `K:<stream>` a kernel or graph, `R:<event>:<stream>` a
//! record, `W:<stream>:<event>` a wait, `C:<sms>` a green context. The application's stream is
//! 0x5000; green streams are 0x9000, 0x9001, ...; `2` is the per-thread default stream.

use super::{Probe, kit, latency_tenant, shm_dir, trace};
use std::path::Path;

/// One redirected launch on application stream `app`, green stream `green`, events `a` and `b`:
/// record a on the application's stream, the green stream waits for it, the kernel on the green
/// stream, record b there, the application's stream waits for b.
fn redirected(app: &str, green: &str, a: u32, b: u32) -> String {
    format!("R:{a}:{app} W:{green}:{a} K:{green} R:{b}:{green} W:{app}:{b}")
}

/// Squeezed to an explicit SM count (`VGPU_SPATIAL_SMS`, what applies while the agent publishes
/// no decision; `closed_loop.rs` tests the decisions).
fn squeezable(shm: &Path) -> Probe {
    Probe::new(shm, Some("trainer"))
        .env("VGPU_SPATIAL", "1")
        .env("VGPU_SPATIAL_HOLD_MS", "60000")
        .env("VGPU_SPATIAL_SMS", "104")
}

/// A latency tenant launches once: its stamp is fresh for the squeezable probes that follow.
fn stamp(shm: &Path) {
    let out = latency_tenant(shm).run("launch kernel 10 trace");
    assert!(out.contains("launch 0 "), "{out}");
    assert_eq!(
        trace(&out),
        "K:5000",
        "a latency tenant is never redirected"
    );
}

#[test]
fn without_spatial_mode_launches_stay_where_they_were() {
    let shm = shm_dir();
    stamp(shm.path());
    let out = Probe::new(shm.path(), Some("trainer"))
        .env("VGPU_SPATIAL_HOLD_MS", "60000")
        .run("launch kernel 10 launch graph 10 trace");
    assert_eq!(trace(&out), "K:5000 K:5000");
    let out = Probe::new(shm.path(), Some("trainer"))
        .env("VGPU_SPATIAL", "0")
        .run("launch ex 10 trace");
    assert_eq!(trace(&out), "K:5000");
}

#[test]
fn a_fresh_latency_stamp_moves_launches_to_a_green_stream_in_order() {
    let shm = shm_dir();
    stamp(shm.path());
    let out = squeezable(shm.path())
        .run("launch kernel 10 launch ex 10 launch graph 10 launch kernel_ptsz 10 trace");
    assert_eq!(out.matches("launch 0 ").count(), 4, "{out}");
    let want = [
        "C:104".to_owned(),
        redirected("5000", "9000", 1, 2),
        redirected("5000", "9000", 1, 2),
        redirected("5000", "9000", 1, 2),
        // The per-thread default stream gets its own green stream and events.
        redirected("2", "9001", 3, 4),
    ]
    .join(" ");
    assert_eq!(trace(&out), want);
}

#[test]
fn the_partition_size_is_configurable_and_rounded_to_the_granularity() {
    let shm = shm_dir();
    stamp(shm.path());
    let out = squeezable(shm.path())
        .env("VGPU_SPATIAL_SMS", "110")
        .run("launch kernel 10 trace");
    assert!(trace(&out).starts_with("C:104 "), "{out}");
}

#[test]
fn a_copy_within_the_gpus_memory_is_squeezed_like_a_kernel() {
    let shm = shm_dir();
    stamp(shm.path());
    let out = squeezable(shm.path()).run("copy 10 launch kernel 10 trace");
    assert!(out.contains("copy 0"), "{out}");
    let want = [
        "C:104".to_owned(),
        redirected("5000", "9000", 1, 2),
        redirected("5000", "9000", 1, 2),
    ]
    .join(" ");
    assert_eq!(trace(&out), want);
}

#[test]
fn cooperative_launches_stay_on_the_application_stream() {
    let shm = shm_dir();
    stamp(shm.path());
    let out = squeezable(shm.path())
        .run("launch coop 10 launch coop_ptsz 10 launch ex_coop 10 launch multi 10 trace");
    assert_eq!(trace(&out), "K:5000 K:2 K:5000 K:0");
}

#[test]
fn a_stale_or_missing_stamp_leaves_launches_on_the_application_stream() {
    let shm = shm_dir();
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "no latency tenant ever launched");
    stamp(shm.path());
    let out = squeezable(shm.path())
        .env("VGPU_SPATIAL_HOLD_MS", "5")
        .run("sleep_ms 30 launch kernel 10 launch graph 10 trace");
    assert_eq!(
        trace(&out),
        "K:5000 K:5000",
        "the stamp is older than the hold"
    );
}

#[test]
fn missing_or_failing_green_contexts_fail_open() {
    let shm = shm_dir();
    stamp(shm.path());
    let nogreen = kit().dir.join("nogreen");
    let out = squeezable(shm.path())
        .env("LD_LIBRARY_PATH", &nogreen)
        .env("VGPU_REAL_LIBCUDA", nogreen.join("libcuda.so.1"))
        .run("launch kernel 10 launch ex 10 trace");
    assert_eq!(out.matches("launch 0 ").count(), 2, "{out}");
    assert_eq!(
        trace(&out),
        "K:5000 K:5000",
        "a driver without green contexts"
    );
    let out = squeezable(shm.path())
        .env("FAKE_CUDA_GREEN_FAIL", "1")
        .run("launch kernel 10 launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000 K:5000", "green context creation fails");
    // The driver refuses the launch on the green stream: it runs on the application's stream,
    // and that context is not redirected again.
    let out = squeezable(shm.path())
        .env("FAKE_CUDA_GREEN_LAUNCH_FAIL", "1")
        .run("launch kernel 10 launch kernel 10 trace");
    assert_eq!(out.matches("launch 0 ").count(), 2, "{out}");
    assert_eq!(trace(&out), "C:104 R:1:5000 W:9000:1 K:5000 K:5000");
}

#[test]
fn a_latency_tenant_is_never_held_by_turns() {
    let shm = shm_dir();
    // A capped 10% share alone on the GPU gets about 10% of it (idle turns) when gated.
    let spin = |latency: bool| {
        let clock = Probe::new(shm.path(), None).run("clock");
        let t0: u64 = clock
            .trim()
            .strip_prefix("clock ")
            .and_then(|v| v.parse().ok())
            .expect("clock <ns>");
        let (start, end) = (t0 + 200_000_000, t0 + 600_000_000);
        let gpu = shm.path().join(format!("gpu-{latency}"));
        let mut probe = Probe::new(shm.path(), Some("inference"))
            .env("VGPU_SPATIAL", "1")
            .env("VGPU_COMPUTE_SHARES", "0:10")
            .env("FAKE_CUDA_GPU", &gpu)
            .env("FAKE_CUDA_WINDOW", format!("{start},{end}"))
            .env("PROBE_UNTIL_NS", (end + 50_000_000).to_string());
        if latency {
            probe = probe.env("VGPU_LATENCY", "1");
        }
        let out = probe.run("spin kernel 1000");
        let used: u64 = out
            .split_whitespace()
            .find_map(|w| w.strip_prefix("used="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no used= in {out}"));
        used as f64 / (end - start) as f64
    };
    let latency = spin(true);
    assert!(
        latency > 0.9,
        "the latency tenant got {latency:.2} of the GPU"
    );
    let gated = spin(false);
    assert!(gated < 0.5, "the same tenant, gated, got {gated:.2}");
}
