//! Closed-loop sharing through the real ABI: a latency tenant's steps (a launch, then the
//! synchronisation or query that sees it done) land in its histogram in the GPU's schedule file,
//! and a squeezable tenant obeys a decision written there as the agent would (pause while a
//! latency step is in flight, a bound on queued launches, fewer SMs), and ignores one that is
//! too old.

use super::{Probe, clocks, latency_tenant, now_ns, now_ns_fast, schedule, shm_dir, trace};
use std::path::Path;

use tenant_abi::control::{DECISION_TTL_NS, Decision};

/// The interposer's bound on a launch held by a step in flight (`closed_loop::PAUSE_WAIT_MAX_NS`,
/// private to the cdylib: restated).
const PAUSE_WAIT_MAX_NS: u64 = 50_000_000;

fn squeezable(shm: &Path) -> Probe {
    Probe::new(shm, Some("trainer"))
        .env("VGPU_SPATIAL", "1")
        .env("VGPU_SPATIAL_HOLD_MS", "60000")
}

#[test]
fn a_latency_tenants_steps_land_in_its_histogram() {
    let shm = shm_dir();
    // 3 synchronised steps of 2 ms, one polled to completion, one ended by a device sync, and a
    // synchronisation with nothing open (no step).
    let out = latency_tenant(shm.path())
        .run("step kernel 2000 3 launch graph 1000 stream_poll launch kernel 500 sync stream_sync");
    assert!(out.contains("step 0 "), "{out}");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let (steps, total_ns): (u64, u64) = (0..tenant_abi::compute::TENANTS)
        .map(|slot| region.control.latency(slot))
        .fold((0, 0), |(s, t), w| (s + w.steps, t + w.total_ns));
    assert_eq!(steps, 5, "{out}");
    assert!(
        (7_500_000..=200_000_000).contains(&total_ns),
        "5 steps of 2+2+2+1+0.5 ms took {total_ns} ns"
    );
    let control = &region.control;
    assert!(
        !control.step_in_flight(now_ns(shm.path())),
        "the last step closed"
    );
}

#[test]
fn a_squeezed_launch_waits_while_a_latency_step_is_in_flight_and_only_under_a_fresh_decision() {
    let shm = shm_dir();
    // The squeezable tenant's first run makes the schedule file.
    squeezable(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let pause = Decision {
        pause: true,
        level: 9,
        ..Decision::default()
    };
    let now = now_ns(shm.path());
    control.publish(pause, now);
    control.open_step(now);
    let out = squeezable(shm.path()).run("clock launch kernel 10 clock");
    let t = clocks(&out);
    let waited = t[1] - t[0];
    assert!(
        (40_000_000..2_000_000_000).contains(&waited),
        "paused {waited} ns: the step never closes, so the launch waits its bound (50 ms)"
    );
    assert!(control.paused_ns.load(std::sync::atomic::Ordering::Relaxed) >= 40_000_000);
    // The step closed: no wait (the best of three launches: a loaded machine may deschedule
    // one probe for longer than the bound, not three).
    control.close_step(now_ns(shm.path()));
    let quickest = || {
        (0..3)
            .map(|_| {
                let t = clocks(&squeezable(shm.path()).run("clock launch kernel 10 clock"));
                t[1] - t[0]
            })
            .min()
            .expect("three runs")
    };
    let took = quickest();
    assert!(took < 30_000_000, "{took} ns with no step open");
    // A step in flight but a decision too old to hold (its agent stopped): no wait.
    let now = now_ns(shm.path());
    control.publish(pause, now - DECISION_TTL_NS - 1_000_000);
    control.open_step(now);
    let took = quickest();
    assert!(took < 30_000_000, "{took} ns under a stale decision");
}

#[test]
fn a_bound_on_queued_launches_holds_while_a_latency_tenant_is_active() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    // Eight kernels of 5 ms launched back to back: how long the launch calls took.
    let launches = |decision: Decision| {
        control.publish(decision, now_ns(shm.path()));
        let script = format!("clock {} clock", ["launch kernel 5000"; 8].join(" "));
        let t = clocks(&squeezable(shm.path()).run(&script));
        t[1] - t[0]
    };
    // Unbounded: the kernels queue up without the launch calls waiting (the best of three: a
    // loaded machine may deschedule one probe for longer than the bound, not three).
    let free = (0..3)
        .map(|_| launches(Decision::default()))
        .min()
        .expect("three runs");
    assert!(free < 20_000_000, "unbounded launches took {free} ns");
    // One launch queued at most: each launch waits for the previous kernel.
    let bounded = launches(Decision {
        inflight: 1,
        level: 3,
        ..Decision::default()
    });
    assert!(
        bounded >= 30_000_000,
        "bounded launches took only {bounded} ns"
    );
    assert!(
        control
            .bounded_launches
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[test]
fn a_bound_on_queued_launches_gives_up_on_kernels_that_do_not_finish() {
    // A neighbour's kernels that wait for another process (a collective's peer) do not finish
    // while it waits: each bounded launch gives up after the pause bound, not after a second.
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    mapping.region().control.publish(
        Decision {
            inflight: 1,
            level: 3,
            ..Decision::default()
        },
        now_ns(shm.path()),
    );
    let script = format!("clock {} clock", ["launch kernel 10"; 8].join(" "));
    let t = clocks(
        &squeezable(shm.path())
            .env("FAKE_CUDA_EVENTS_NEVER", "1")
            .run(&script),
    );
    // Each gives up after the pause bound (8 x 50 ms), not after a second (8 s); the slack is
    // for a loaded machine.
    assert!(
        t[1] - t[0] < 2_000_000_000,
        "8 bounded launches took {} ms",
        (t[1] - t[0]) / 1_000_000
    );
}

#[test]
fn the_decision_sets_how_many_sms_a_squeezed_launch_keeps() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    control.publish(
        Decision {
            sms: 64,
            level: 2,
            ..Decision::default()
        },
        now_ns(shm.path()),
    );
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert!(trace(&out).starts_with("C:64 "), "{out}");
    // A decision that keeps every SM (here: only a queue bound) moves nothing.
    control.publish(
        Decision {
            inflight: 4,
            level: 1,
            ..Decision::default()
        },
        now_ns(shm.path()),
    );
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert!(trace(&out).starts_with("K:5000"), "{out}");
    // No decision in force and no VGPU_SPATIAL_SMS: nothing moves (fail open).
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
}

#[test]
fn a_guard_holds_launches_before_a_predicted_step_and_exclusive_while_a_latency_tenant_runs() {
    let shm = shm_dir();
    squeezable(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    // The decision is published again every 20 ms while a probe runs, as the agent does, so
    // that only the guard (or the latency tenant's activity) can end a hold, not the decision's
    // expiry: the bounds below then leave seconds for a loaded machine's scheduling.
    let keep_publishing = |decision: Decision, probe: &dyn Fn() -> Vec<u64>| -> Vec<u64> {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    control.publish(decision, now_ns_fast());
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            });
            let t = probe();
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            t
        })
    };
    // A step predicted 150 ms from now and a guard of 150 ms: a launch inside [now, now + 300
    // ms] is held until the prediction is 150 ms past (no step came). Checked on the shared
    // clock, not on the probe's own duration: the probe's start-up (tens of ms on a loaded
    // 2-core CI machine) comes out of the hold, not on top of it. A probe that started after
    // the window tests nothing and is tried again.
    let guard = Decision {
        pause: true,
        guard_us: 150_000,
        level: 10,
        ..Decision::default()
    };
    let mut tested = false;
    for _ in 0..5 {
        let now = now_ns(shm.path());
        control.predict_step(now + 150_000_000);
        let guard_end = now + 300_000_000;
        let t = keep_publishing(guard, &|| {
            clocks(&squeezable(shm.path()).run("clock launch kernel 10 clock"))
        });
        if t[0] >= guard_end {
            continue;
        }
        assert!(
            (guard_end..guard_end + 3_000_000_000).contains(&t[1]),
            "held until {} ms after the guard ended",
            (t[1] as i64 - guard_end as i64) / 1_000_000
        );
        tested = true;
        break;
    }
    assert!(
        tested,
        "five probes started after the guard's window: too loaded to test"
    );
    // A predicted step far away: no wait.
    control.predict_step(now_ns(shm.path()) + 5_000_000_000);
    let t = keep_publishing(guard, &|| {
        clocks(&squeezable(shm.path()).run("clock launch kernel 10 clock"))
    });
    assert!(t[1] - t[0] < 1_000_000_000, "held {} ns", t[1] - t[0]);
    // Exclusive: held while the latency tenant launched within the hold time (300 ms here).
    let exclusive = Decision {
        exclusive: true,
        level: 14,
        ..Decision::default()
    };
    let mut tested = false;
    for _ in 0..5 {
        let launched = clocks(&latency_tenant(shm.path()).run("clock launch kernel 10"))[0];
        let hold_end = launched + 300_000_000;
        let t = keep_publishing(exclusive, &|| {
            clocks(
                &squeezable(shm.path())
                    .env("VGPU_SPATIAL_HOLD_MS", "300")
                    .run("clock launch kernel 10 clock"),
            )
        });
        if t[0] >= hold_end {
            continue;
        }
        assert!(
            (hold_end..hold_end + 3_000_000_000).contains(&t[1]),
            "held until {} ms after the latency tenant's launch under exclusive",
            (t[1] - launched) / 1_000_000
        );
        tested = true;
        break;
    }
    assert!(
        tested,
        "five probes started after the hold: too loaded to test"
    );
}

/// Fit: at a guard, a launch also waits while the latency tenant's next step is due within the
/// launch's own measured duration. Kernels of 60 ms, a guard of 1 ms and a step always predicted
/// 30 ms ahead: the second kernel's launch waits for the first (the bound of one in flight),
/// which measures 60 ms, and is then held until the predictions stop; kernels of 1 ms fit in the
/// 30 ms and go at once.
#[test]
fn a_guard_holds_a_launch_that_would_not_end_before_the_next_step() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let guard = Decision {
        pause: true,
        guard_us: 1_000,
        inflight: 1,
        level: 10,
        ..Decision::default()
    };
    const PREDICTING_NS: u64 = 1_500_000_000;
    // Steps predicted 30 ms ahead, again and again, for `PREDICTING_NS`; then the last
    // prediction goes stale. Returns the probe's clocks and when the predictions stopped.
    let run = |kernel_us: u32| -> (Vec<u64>, u64) {
        let stop_at = now_ns_fast() + PREDICTING_NS;
        std::thread::scope(|scope| {
            scope.spawn(|| {
                loop {
                    let now = now_ns_fast();
                    if now >= stop_at {
                        break;
                    }
                    control.publish(guard, now);
                    control.predict_step(now + 30_000_000);
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                // The decision stays in force (the agent keeps publishing it).
                for _ in 0..100 {
                    control.publish(guard, now_ns_fast());
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            });
            let script = format!("clock launch kernel {kernel_us} launch kernel {kernel_us} clock");
            (
                clocks(
                    &squeezable(shm.path())
                        .env("VGPU_SPATIAL_HOLD_MS", "60000")
                        .run(&script),
                ),
                stop_at,
            )
        })
    };
    // Only a probe that started well inside the predictions tests anything.
    const STARTED_WITHIN_NS: u64 = 200_000_000;
    let mut tested = [false, false];
    for _ in 0..5 {
        if !tested[0] {
            let (t, stop_at) = run(60_000);
            if t[0] + STARTED_WITHIN_NS < stop_at {
                assert!(
                    (stop_at..stop_at + 3_000_000_000).contains(&t[1]),
                    "the second 60 ms kernel went {} ms after the predictions stopped",
                    (t[1] as i64 - stop_at as i64) / 1_000_000
                );
                tested[0] = true;
            }
        }
        if !tested[1] {
            let (t, stop_at) = run(1_000);
            if t[0] + STARTED_WITHIN_NS < stop_at && t[1] < stop_at {
                tested[1] = true;
            }
        }
        if tested == [true, true] {
            break;
        }
    }
    assert_eq!(
        tested,
        [true, true],
        "[60 ms kernels held, 1 ms kernels went] in five tries (a probe that started after the \
         predictions tests nothing)"
    );
}

#[test]
fn a_launch_held_at_exclusive_keeps_its_tenants_demand_fresh() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    region.control.publish(
        Decision {
            exclusive: true,
            level: 14,
            ..Decision::default()
        },
        now_ns(shm.path()),
    );
    // Held (the latency tenant launched within the hold time, 60 s here) while the agent keeps
    // publishing Exclusive: meanwhile its demand stamp keeps moving, so the agent sees a
    // neighbour that wants the GPU.
    let start = now_ns(shm.path());
    let exclusive = Decision {
        exclusive: true,
        level: 14,
        ..Decision::default()
    };
    // A compute share, as the agent gives every tenant: the tenant is a member of the
    // schedule, with a demand stamp.
    let mut held = squeezable(shm.path())
        .env("VGPU_COMPUTE_SHARES", "0:75")
        .start_holding("launch kernel 10");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(8);
    let stamp = || {
        let slot = region
            .live_slots()
            .into_iter()
            .find(|(_, name)| name == "trainer")
            .map(|(slot, _)| slot)?;
        Some(
            region.tenants[slot]
                .demand_ns
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    // A stamp 1.2 s or more into the hold (past the old 1 s bound, and past the decision's
    // lifetime: the hold follows the agent's republished decision), seen while it is still
    // held: stamped while held, not only by the launch that went afterwards.
    let hold_ns = tenant_abi::control::HOLD_WAIT_MAX_NS;
    loop {
        region.control.publish(exclusive, now_ns(shm.path()));
        let stamp = stamp();
        let since = stamp.map(|stamp| stamp.saturating_sub(start));
        if since.is_some_and(|since| (1_200_000_000..hold_ns).contains(&since)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline && since.is_none_or(|since| since < hold_ns),
            "the held tenant's demand was last stamped {:?} ms after the launch began",
            since.map(|since| since / 1_000_000)
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The agent stops saying Exclusive (here: stops publishing; the decision lapses): the launch
    // goes, long before HOLD_WAIT_MAX_NS.
    held.wait_held();
    let end = now_ns(shm.path());
    assert!(
        end.saturating_sub(start) < hold_ns,
        "held {} ms after the decision was last published",
        end.saturating_sub(start) / 1_000_000
    );
}

#[test]
fn a_guard_holds_a_launch_for_as_long_as_the_agent_keeps_it_and_steps_keep_coming() {
    let shm = shm_dir();
    squeezable(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let guard = Decision {
        pause: true,
        guard_us: 20_000,
        level: 9,
        ..Decision::default()
    };
    // A latency tenant whose next step is always due within the guard (steps closer together
    // than the guard leave no gap), and an agent that keeps the guard in force: the launch
    // waits past PAUSE_WAIT_MAX_NS (the old bound, which let a kernel into every 16th step).
    let keep = |until: std::time::Instant| {
        while std::time::Instant::now() < until {
            let now = now_ns(shm.path());
            control.publish(guard, now);
            control.predict_step(now + 5_000_000);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    };
    let now = now_ns(shm.path());
    control.publish(guard, now);
    control.predict_step(now + 5_000_000);
    let mut held = squeezable(shm.path()).start_holding("clock launch kernel 10 clock");
    keep(std::time::Instant::now() + std::time::Duration::from_millis(400));
    // The steps stop coming (no new prediction): the launch goes once the last one is a guard
    // past.
    held.wait_held();
    let t = clocks(&held.output);
    let waited = t[1] - t[0];
    assert!(
        waited >= 2 * PAUSE_WAIT_MAX_NS,
        "held {} ms by a guard kept in force for 400 ms",
        waited / 1_000_000
    );
    assert!(
        waited < tenant_abi::control::HOLD_WAIT_MAX_NS,
        "held {} ms",
        waited / 1_000_000
    );
}

#[test]
fn a_launch_held_at_exclusive_stays_held_when_the_agent_relaxes_to_a_guard() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let exclusive = Decision {
        exclusive: true,
        level: 10,
        ..Decision::default()
    };
    let guard = Decision {
        pause: true,
        guard_us: 20_000,
        level: 9,
        ..Decision::default()
    };
    let keep = |decision: Decision, for_ms: u64| {
        let until = std::time::Instant::now() + std::time::Duration::from_millis(for_ms);
        while std::time::Instant::now() < until {
            let now = now_ns(shm.path());
            control.publish(decision, now);
            control.predict_step(now + 5_000_000);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    };
    let region = mapping.region();
    let start = now_ns(shm.path());
    control.publish(exclusive, start);
    // A compute share makes it a member of the schedule: its demand stamp shows it waiting.
    let mut held = squeezable(shm.path())
        .env("VGPU_COMPUTE_SHARES", "0:75")
        .start_holding("clock launch kernel 10 clock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(8);
    loop {
        let waiting = region
            .live_slots()
            .into_iter()
            .find(|(_, name)| name == "trainer")
            .is_some_and(|(slot, _)| {
                region.tenants[slot]
                    .demand_ns
                    .load(std::sync::atomic::Ordering::Relaxed)
                    > start
            });
        if waiting {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the neighbour never waited"
        );
        keep(exclusive, 5);
    }
    keep(exclusive, 50);
    let relaxed = now_ns(shm.path());
    // Relaxed to a guard with steps still due within it: still held (it went here, before).
    keep(guard, 300);
    let guard_end = now_ns(shm.path());
    held.wait_held();
    let t = clocks(&held.output);
    assert!(t[0] < relaxed, "the launch began after Exclusive ended");
    assert!(
        t[1] >= guard_end,
        "the launch went {} ms after Exclusive was relaxed to a guard kept for 300 ms",
        t[1].saturating_sub(relaxed) / 1_000_000
    );
}

#[test]
fn a_latency_tenant_predicts_its_next_step_from_its_rhythm() {
    let shm = shm_dir();
    let out = latency_tenant(shm.path())
        .run("step kernel 1000 1 sleep_ms 4 step kernel 1000 1 sleep_ms 4 step kernel 1000 1");
    assert!(out.contains("step 0 "), "{out}");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let due = control
        .next_step_ns
        .load(std::sync::atomic::Ordering::Relaxed);
    let opened = control
        .step_open_ns
        .load(std::sync::atomic::Ordering::Relaxed);
    // Steps start about 5 ms apart (1 ms step, 4 ms sleep): the next one is due about then.
    assert!(
        (3_000_000..30_000_000).contains(&due.saturating_sub(opened)),
        "due {} ns after the last start",
        due.saturating_sub(opened)
    );
}

#[test]
fn copies_are_steps_of_a_latency_tenant_and_held_back_in_a_neighbour() {
    let shm = shm_dir();
    let out = latency_tenant(shm.path()).run("copy 2000 stream_sync copy 1000 stream_sync");
    assert!(out.contains("copy 0"), "{out}");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let steps: u64 = (0..tenant_abi::compute::TENANTS)
        .map(|slot| control.latency(slot).steps)
        .sum();
    assert_eq!(steps, 2, "{out}");
    // A neighbour's copy waits while a latency step is in flight under pause.
    let now = now_ns(shm.path());
    control.publish(
        Decision {
            pause: true,
            level: 9,
            ..Decision::default()
        },
        now,
    );
    control.open_step(now);
    let t = clocks(&squeezable(shm.path()).run("clock copy 10 clock"));
    assert!(
        (40_000_000..2_000_000_000).contains(&(t[1] - t[0])),
        "a neighbour's copy waited {} ns",
        t[1] - t[0]
    );
}

/// What a cap on a neighbour's launches in flight costs it with small kernels: 4,000 kernels of
/// 50, 10 and 2 us (the fake runs them back to back on its clock) beside an active latency
/// tenant, under a decision capping 4 in flight, against no decision. A cap of N leaves N - 1
/// launches queued behind the one awaited; a wait that wakes late lets them run dry, and the
/// neighbour loses more than the level means. A benchmark, not a test (it asserts nothing about
/// time): `cargo test --release -p interposer --test abi -- --ignored cap_on_launches --nocapture`.
#[test]
#[ignore = "a benchmark: run it in release with --ignored --nocapture"]
fn a_cap_on_launches_in_flight_with_small_kernels() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let control = &mapping.region().control;
    let per_kernel = |decision: Decision, us: u32| {
        let mut runs: Vec<u64> = (0..5)
            .map(|_| {
                control.publish(decision, now_ns(shm.path()));
                let out = squeezable(shm.path()).run(&format!("launches_of 4000 {us}"));
                out.lines()
                    .find_map(|line| line.strip_prefix("launches_of 0 ns="))
                    .and_then(|ns| ns.trim().parse().ok())
                    .unwrap_or_else(|| panic!("no timing: {out}"))
            })
            .collect();
        runs.sort_unstable();
        runs[2]
    };
    println!("\n| kernel us | no decision: ns per kernel | cap of 4 in flight | ratio |");
    println!("| --: | --: | --: | --: |");
    for us in [50, 10, 2] {
        let free = per_kernel(Decision::default(), us);
        let capped = per_kernel(
            Decision {
                inflight: 4,
                level: 2,
                ..Decision::default()
            },
            us,
        );
        println!(
            "| {us} | {free} | {capped} | {:.3} |",
            capped as f64 / free.max(1) as f64
        );
    }
}
