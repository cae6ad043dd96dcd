//! What the interposer's hooks cost a launch on the CPU, per tenant configuration, against the
//! same fake driver without the interposer: a benchmark, not a test (ignored; it asserts
//! nothing about time). Issue 15's point 7 bounds vgpu's own cost at 2%; a launch-bound eager
//! PyTorch step launches about 300 kernels, so each microsecond a hook adds costs such a 3 ms
//! step 10%. Run it in release (the figures of a debug build mean nothing):
//!
//!   cargo test --release -p interposer --test abi -- --ignored launch_overhead --nocapture
//!
//! It prints a table: the median over 5 runs of the mean time of one `cuLaunchKernel` (a fake
//! kernel of 0 us) in each configuration, and its difference from the bare driver.

use super::{Probe, schedule, shm_dir};

const LAUNCHES: &str = "200000";
const RUNS: usize = 5;

type Configure = fn(Probe) -> Probe;

/// A best-effort tenant on a GPU with latency tenants (its launches may be squeezed), in both
/// benchmarks.
const SPATIAL_BURST: &str = "best effort beside latency tenants (spatial, burst)";

fn spatial_burst(probe: Probe) -> Probe {
    probe
        .env("VGPU_MEMORY_LIMITS", "0:8GiB")
        .env("VGPU_COMPUTE_SHARES", "0:75")
        .env("VGPU_BURST", "1")
        .env("VGPU_SPATIAL", "1")
}

/// `script` (one timed `launches` or `launches_of` command) run `RUNS` times in a probe of each
/// configuration: (name, median, min, max) of its ns per launch.
fn timed(
    shm: &std::path::Path,
    configurations: &[(&'static str, Option<&str>, Configure)],
    script: &str,
) -> Vec<(&'static str, u64, u64, u64)> {
    let command = script.split_whitespace().next().expect("a command");
    configurations
        .iter()
        .map(|&(name, tenant, configure)| {
            let mut runs: Vec<u64> = (0..RUNS)
                .map(|_| {
                    let out = configure(Probe::new(shm, tenant)).run(script);
                    out.lines()
                        .find_map(|line| line.strip_prefix(&format!("{command} 0 ns=")))
                        .and_then(|ns| ns.trim().parse().ok())
                        .unwrap_or_else(|| panic!("the probe printed no timing: {out}"))
                })
                .collect();
            runs.sort_unstable();
            (name, runs[RUNS / 2], runs[0], runs[RUNS - 1])
        })
        .collect()
}

#[test]
#[ignore = "a benchmark: run it in release with --ignored --nocapture"]
fn launch_overhead() {
    let shm = shm_dir();
    let _schedule = schedule(shm.path());
    let configurations: [(&str, Option<&str>, Configure); 6] = [
        ("bare driver (no interposer)", None, |p| {
            p.env_remove("LD_PRELOAD")
        }),
        ("interposer, no tenant", None, |p| p),
        ("tenant, memory quota only", Some("t"), |p| {
            p.env("VGPU_MEMORY_LIMITS", "0:8GiB")
        }),
        ("tenant, compute share 75% (turns)", Some("t"), |p| {
            p.env("VGPU_MEMORY_LIMITS", "0:8GiB")
                .env("VGPU_COMPUTE_SHARES", "0:75")
        }),
        (SPATIAL_BURST, Some("t"), spatial_burst),
        ("latency tenant (steps measured)", Some("t"), |p| {
            p.env("VGPU_MEMORY_LIMITS", "0:8GiB")
                .env("VGPU_COMPUTE_SHARES", "0:8")
                .env("VGPU_SPATIAL", "1")
                .env("VGPU_LATENCY", "1")
        }),
    ];
    let rows = timed(shm.path(), &configurations, &format!("launches {LAUNCHES}"));
    let bare = rows[0].1;
    println!("\n| configuration | ns per launch (median of {RUNS}) | min-max | added by vgpu |");
    println!("| --- | --: | --- | --: |");
    for (name, median, min, max) in rows {
        println!(
            "| {name} | {median} | {min}-{max} | {:+} |",
            median as i64 - bare as i64
        );
    }
}

/// Whether the gate leaves the GPU idle between small kernels: 20,000 kernels of `KERNEL_US` us
/// each (10, 3 and 1 us: a small model's elementwise and optimizer kernels run 2-5 us on an
/// H200; the fake runs them back to back on its clock) then a synchronisation, per
/// configuration; the time per kernel is the kernel's when the GPU never waits for the launches.
/// The compute gate bounds a tenant's queue (an event every `launch::SAMPLE_ALONE` launches, a
/// wait past `launch::EVENTS_PER_STREAM_MAX` unfinished) even while it is alone: a trainer of
/// many small kernels paid 7-13% through vgpu on an H200, which the launch path's CPU cost does
/// not explain. A bound short of the waiting thread's wake-up (a sleep of 20 us wakes after 50 us
/// or more) leaves the GPU idle.
#[test]
#[ignore = "a benchmark: run it in release with --ignored --nocapture"]
fn small_kernels_back_to_back() {
    let shm = shm_dir();
    let _schedule = schedule(shm.path());
    let configurations: [(&str, Option<&str>, Configure); 4] = [
        ("bare fake driver", None, |p| p.env_remove("LD_PRELOAD")),
        ("tenant, memory quota only", Some("t"), |p| {
            p.env("VGPU_MEMORY_LIMITS", "0:8GiB")
        }),
        ("tenant, compute share 75%, burst (alone)", Some("t"), |p| {
            p.env("VGPU_MEMORY_LIMITS", "0:8GiB")
                .env("VGPU_COMPUTE_SHARES", "0:75")
                .env("VGPU_BURST", "1")
        }),
        (SPATIAL_BURST, Some("t"), spatial_burst),
    ];
    println!(
        "\n| configuration | kernel us | ns per kernel (median of {RUNS}) | min-max | against bare |"
    );
    println!("| --- | --: | --: | --- | --: |");
    for kernel_us in [10, 3, 1] {
        let rows = timed(
            shm.path(),
            &configurations,
            &format!("launches_of 20000 {kernel_us}"),
        );
        let bare = rows[0].1.max(1) as f64;
        for (name, median, min, max) in rows {
            println!(
                "| {name} | {kernel_us} | {median} | {min}-{max} | {:.3} |",
                median as f64 / bare
            );
        }
    }
}
