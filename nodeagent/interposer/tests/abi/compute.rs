//! Compute sharing through the real ABI: several tenant processes launch simulated kernels on
//! one simulated GPU (the fake driver's shared timeline, `FAKE_CUDA_GPU`), and each reports the
//! GPU time its kernels got inside a common window. Shares are checked to within a few points
//! (the machine running the tests is shared, so the bounds leave room for scheduling noise).

use super::{Probe, now_ns_fast, schedule, shm_dir};
use std::path::Path;
use std::time::{Duration, Instant};

/// One tenant process of a run.
struct Spinner {
    tenant: &'static str,
    env: Vec<(&'static str, String)>,
    api: &'static str,
    kernel_us: u32,
    /// Probe commands run before the spin (e.g. a graph capture).
    script: &'static str,
    /// Started this long after the others.
    delay: Duration,
}

fn spinner(tenant: &'static str, shares: &str, api: &'static str) -> Spinner {
    Spinner {
        tenant,
        env: vec![("VGPU_COMPUTE_SHARES", shares.to_owned())],
        api,
        kernel_us: 1000,
        script: "",
        delay: Duration::ZERO,
    }
}

impl Spinner {
    fn env(mut self, name: &'static str, value: &str) -> Spinner {
        self.env.push((name, value.to_owned()));
        self
    }
}

/// What a spinning probe reported.
#[derive(Debug)]
struct Spun {
    used_ns: u64,
    max_wait_us: u64,
}

fn clock_ns(shm: &Path) -> u64 {
    let out = Probe::new(shm, None).run("clock");
    out.trim()
        .strip_prefix("clock ")
        .and_then(|v| v.parse().ok())
        .expect("clock <ns>")
}

/// Runs `spinners` together on one simulated GPU; the window starts `window_ms.0` after now
/// and ends at `window_ms.1`; every probe spins until `until_ms`.
fn spin_together(
    shm: &Path,
    spinners: Vec<Spinner>,
    window_ms: (u64, u64),
    until_ms: u64,
) -> Vec<Spun> {
    let t0 = clock_ns(shm);
    let ms = 1_000_000;
    let window = format!("{},{}", t0 + window_ms.0 * ms, t0 + window_ms.1 * ms);
    let until = (t0 + until_ms * ms).to_string();
    let gpu = shm.join("gpu.sim");
    std::thread::scope(|scope| {
        let handles: Vec<_> = spinners
            .into_iter()
            .map(|s| {
                let (window, until, gpu) = (&window, &until, &gpu);
                scope.spawn(move || {
                    std::thread::sleep(s.delay);
                    let mut probe = Probe::new(shm, Some(s.tenant))
                        .env("FAKE_CUDA_DEVICES", "1")
                        .env("FAKE_CUDA_GPU", gpu)
                        .env("FAKE_CUDA_WINDOW", window)
                        .env("PROBE_UNTIL_NS", until);
                    for (name, value) in &s.env {
                        probe = probe.env(name, value);
                    }
                    let out = probe.run(&format!("{} spin {} {}", s.script, s.api, s.kernel_us));
                    parse_spin(&out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a spinner"))
            .collect()
    })
}

fn parse_spin(out: &str) -> Spun {
    for line in out.lines().filter(|l| l.starts_with("capture ")) {
        assert!(line.starts_with("capture 0 "), "a capture failed: {line}");
    }
    let line = out
        .lines()
        .find(|l| l.starts_with("spin "))
        .unwrap_or_else(|| panic!("no spin line in {out:?}"));
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    assert!(line.starts_with("spin 0 "), "a launch failed: {line}");
    Spun {
        used_ns: field("used="),
        max_wait_us: field("max_wait_us="),
    }
}

/// The GPU schedule files in `shm` (a gated process that joined made one).
fn schedule_files(shm: &Path) -> Vec<String> {
    std::fs::read_dir(shm)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".compute"))
        .collect()
}

/// Percent of a `window_ms`-long window.
fn shares(spun: &[Spun], window_ms: u64) -> Vec<f64> {
    spun.iter()
        .map(|s| s.used_ns as f64 / (window_ms as f64 * 1e4))
        .collect()
}

/// The split of the GPU among several tenants: each one's part of the time the GPU was busy
/// must be within `points` of `want`, and together they must have kept the GPU at least 75%
/// busy (work conservation). The split is what the schedule decides; the total also loses
/// whatever time the test machine's CPUs did not give the probes (CI runs on two cores),
/// which is why the split is compared normalised and the total only has a floor.
fn assert_split(got: &[f64], want: &[f64], points: f64) {
    let total: f64 = got.iter().sum();
    assert!(
        total >= 75.0,
        "the GPU was busy only {total:.1} % of the window ({got:.1?} %)"
    );
    let split: Vec<f64> = got.iter().map(|g| g * 100.0 / total).collect();
    assert!(
        split.iter().zip(want).all(|(g, w)| (g - w).abs() <= points),
        "split {split:.1?} % (raw {got:.1?} %), want {want:?} % ± {points}"
    );
}

/// A lone tenant's share of the window: at most `most` percent (what the schedule decides) and
/// at least `least` (it ran; CPU starvation on a loaded test machine only ever lowers it).
fn assert_alone(got: f64, least: f64, most: f64) {
    assert!(
        (least..=most).contains(&got),
        "got {got:.1} %, want between {least} and {most} %"
    );
}

#[test]
fn two_tenants_get_70_30_of_the_gpu() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:70", "kernel"),
            spinner("b", "0:30", "kernel"),
        ],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
    let schedules = schedule_files(shm.path());
    assert_eq!(
        schedules,
        ["GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae00.compute"]
    );
}

#[test]
fn graph_extended_and_per_thread_launches_are_gated() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:75", "graph"),
            spinner("b", "0:25", "ex_ptsz"),
        ],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[75.0, 25.0], 6.0);
}

/// A copy within the GPU's memory runs on its SMs like a kernel (an H200 copied 4.2 TB/s with
/// `y.copy_(x)`), so it takes its tenant's turns: a tenant made of device-to-device copies gets
/// its share, not the time of the tenant beside it (before, copies passed no turn, and such a
/// tenant ran through the other's turns).
#[test]
fn device_to_device_copies_take_turns_like_kernels() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![spinner("a", "0:70", "kernel"), spinner("b", "0:30", "dtod")],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
}

/// A memset is a kernel to the GPU (it writes at HBM speed on the SMs): before the fix memsets
/// passed no turn, as device-to-device copies did.
#[test]
fn memsets_take_turns_like_kernels() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:70", "kernel"),
            spinner("b", "0:30", "memset"),
        ],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
}

/// `cuMemcpyAsync` reads its direction from its pointers: between two device addresses it takes
/// turns like a kernel; from host memory it runs on the copy engines and waits for no turn (a
/// turn is 20 ms; NCCL's and frameworks' small host copies would each wait for one).
#[test]
fn a_unified_copy_takes_turns_between_device_addresses_only() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:70", "kernel"),
            spinner("b", "0:30", "unified_dtod"),
        ],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:70", "kernel"),
            spinner("b", "0:30", "unified_htod"),
        ],
        (400, 2400),
        2500,
    );
    assert!(
        spun[1].max_wait_us < 15_000,
        "a copy from host memory waited {} us in one call",
        spun[1].max_wait_us
    );
}

#[test]
fn cooperative_and_get_proc_address_launches_are_gated() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![
            spinner("a", "0:25", "coop_ptsz"),
            spinner("b", "0:75", "gpa"),
        ],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[25.0, 75.0], 6.0);
}

#[test]
fn launch_functions_resolve_to_the_hooks() {
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_COMPUTE_SHARES", "0:50")
        .env("FAKE_CUDA_DEVICES", "1")
        .run(
            "launch gpa 10 launch gpa_ptsz 10 launch dl 10 launch kernel 10 launch kernel_ptsz 10 \
             launch ex 10 launch coop 10 launch multi 10 launch graph_ptsz 10 sync",
        );
    assert_eq!(
        out,
        "launch 0 lib=libvgpu_cuda.so\nlaunch 0 lib=libvgpu_cuda.so\nlaunch 0 lib=libvgpu_cuda.so\n\
         launch 0 lib=libcuda.so.1\nlaunch 0 lib=libcuda.so.1\nlaunch 0 lib=libcuda.so.1\n\
         launch 0 lib=libcuda.so.1\nlaunch 0 lib=libcuda.so.1\nlaunch 0 lib=libcuda.so.1\nsync 0\n"
    );
}

#[test]
fn a_bursting_tenant_gives_idle_time_back_and_a_capped_one_stays_capped() {
    let shm = shm_dir();
    // "b" may burst and runs alone for a second, then "a" arrives with a guaranteed 70%.
    let mut late = spinner("a", "0:70", "kernel");
    late.delay = Duration::from_millis(1000);
    let spun = spin_together(
        shm.path(),
        vec![late, spinner("b", "0:30", "kernel").env("VGPU_BURST", "1")],
        (1400, 3400),
        3500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);

    // Without burst, a tenant alone keeps to its share.
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![spinner("c", "0:40", "kernel")],
        (400, 2400),
        2500,
    );
    assert_alone(shares(&spun, 2000)[0], 25.0, 46.0);
}

#[test]
fn idle_time_goes_to_the_higher_priority() {
    let shm = shm_dir();
    let best_effort = |name, priority| {
        spinner(name, "0:30", "kernel")
            .env("VGPU_BURST", "1")
            .env("VGPU_GUARANTEED", "0")
            .env("VGPU_PRIORITY", priority)
    };
    let spun = spin_together(
        shm.path(),
        vec![best_effort("high", "10"), best_effort("low", "0")],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
}

#[test]
fn a_killed_process_mid_turn_stalls_the_others_only_briefly() {
    let shm = shm_dir();
    let t0 = clock_ns(shm.path());
    let gpu = shm.path().join("gpu.sim");
    let mut victim = Probe::new(shm.path(), Some("a"))
        .env("VGPU_COMPUTE_SHARES", "0:50")
        .env("FAKE_CUDA_DEVICES", "1")
        .env("FAKE_CUDA_GPU", &gpu)
        .env("PROBE_UNTIL_NS", (t0 + 60_000_000_000).to_string())
        .start_holding("spin kernel 1000");
    let survivor = std::thread::spawn({
        let shm = shm.path().to_owned();
        move || {
            Probe::new(&shm, Some("b"))
                .env("VGPU_COMPUTE_SHARES", "0:50")
                .env("VGPU_BURST", "1")
                .env("FAKE_CUDA_DEVICES", "1")
                .env("FAKE_CUDA_GPU", &gpu)
                .env("PROBE_UNTIL_NS", (t0 + 2_500_000_000).to_string())
                .run("spin kernel 1000")
        }
    });
    // The victim holds the GPU half of the time; kill it at some point of its turn.
    victim.wait_for_line("spinning");
    std::thread::sleep(Duration::from_millis(700));
    let killed = Instant::now();
    victim.kill_without_reaping();
    let out = survivor.join().expect("the survivor");
    let spun = parse_spin(&out);
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "the survivor finished late"
    );
    // Normal waits are a turn of the other tenant (20 ms) plus a drain; after the kill, the
    // survivor waits at most a grace period (10 ms) more. Generous for a loaded machine.
    assert!(
        spun.max_wait_us < 250_000,
        "a launch of the survivor waited {} ms",
        spun.max_wait_us / 1000
    );
}

#[test]
fn a_process_without_turns_joins_the_schedule_but_is_never_held() {
    // `VGPU_COMPUTE_TURNS=0`: a capped 30% tenant alone would get at most 30% of the GPU
    // (`a_bursting_tenant_gives_idle_time_back_and_a_capped_one_stays_capped`); without turns
    // it is not held, yet it is a member of the GPU's schedule (its demand and steps count).
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![spinner("free", "0:30", "kernel").env("VGPU_COMPUTE_TURNS", "0")],
        (200, 1200),
        1300,
    );
    assert_alone(shares(&spun, 1000)[0], 85.0, 100.5);
    let files = schedule_files(shm.path());
    assert_eq!(files.len(), 1, "{files:?}");
}

#[test]
fn a_tenant_the_agent_has_side_by_side_is_never_held_by_turns() {
    // The redistribution's "side by side" (`Control::side_by_side`, published again every 20 ms
    // as the agent does every period): a capped 30% tenant alone would get at most 30% of the
    // GPU; side by side it waits for no turn.
    let shm = shm_dir();
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let spun = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                control.publish_side_by_side(u64::MAX, now_ns_fast());
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let spun = spin_together(
            shm.path(),
            vec![spinner("sided", "0:30", "kernel")],
            (200, 1200),
            1300,
        );
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        spun
    });
    assert_alone(shares(&spun, 1000)[0], 85.0, 100.5);
    // Once the agent stops publishing (it died), the word lapses and the turns hold again.
    let spun = spin_together(
        shm.path(),
        vec![spinner("sided", "0:30", "kernel")],
        (600, 1600),
        1700,
    );
    assert_alone(shares(&spun, 1000)[0], 15.0, 36.0);
}

#[test]
fn tenants_without_a_share_are_not_gated() {
    let shm = shm_dir();
    let spun = spin_together(
        shm.path(),
        vec![Spinner {
            tenant: "free",
            env: vec![],
            api: "kernel",
            kernel_us: 1000,
            script: "",
            delay: Duration::ZERO,
        }],
        (200, 1200),
        1300,
    );
    // Not held by any turn: far above what a share would allow.
    assert_alone(shares(&spun, 1000)[0], 85.0, 100.5);
    let files = schedule_files(shm.path());
    assert!(files.is_empty(), "{files:?}");
}

#[test]
fn graph_capture_under_gating_records_nothing_on_the_capturing_stream() {
    for mode in ["global", "relaxed"] {
        let shm = shm_dir();
        let out = Probe::new(shm.path(), Some("a"))
            .env("VGPU_COMPUTE_SHARES", "0:50")
            .env("FAKE_CUDA_DEVICES", "1")
            .run(&format!(
                "launch kernel 10 capture {mode} kernel 40 capture {mode} ex 40 \
                 capture {mode} graph 40 trace"
            ));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            &lines[..4],
            [
                "launch 0 lib=libcuda.so.1",
                "capture 0 graph=400",
                "capture 0 graph=400",
                "capture 0 graph=400",
            ],
            "{mode}: {out}"
        );
        let trace = lines[4].strip_prefix("trace ").expect("a trace line");
        let captured = trace.split(' ').filter(|t| *t == "G:5000").count();
        assert_eq!(captured, 120, "{mode}: {trace}");
        assert!(!trace.contains("R:"), "{mode}: events recorded: {trace}");
    }
}

#[test]
fn graphs_captured_under_gating_are_gated_at_launch() {
    let shm = shm_dir();
    let mut captured = spinner("a", "0:70", "graph");
    captured.script = "capture global kernel 40";
    let spun = spin_together(
        shm.path(),
        vec![captured, spinner("b", "0:30", "kernel")],
        (400, 2400),
        2500,
    );
    assert_split(&shares(&spun, 2000), &[70.0, 30.0], 6.0);
}

#[test]
fn the_queue_bound_waits_at_most_one_turn_for_a_kernel_that_does_not_finish() {
    // Kernels whose events never say done (in real life a collective waiting for a peer that
    // waits for us, issue 16: 1 s stalls) must not hold a capped tenant's launches for long: the
    // queue bound gives up after one turn, so no launch call takes much more than a turn, an
    // idle turn and a drain.
    let shm = shm_dir();
    let stuck = spinner("ranks", "0:50", "kernel").env("FAKE_CUDA_EVENTS_NEVER", "1");
    let spun = spin_together(shm.path(), vec![stuck], (100, 1300), 1500);
    assert!(
        spun[0].max_wait_us < 300_000,
        "a launch call took {} ms",
        spun[0].max_wait_us / 1000
    );
}
