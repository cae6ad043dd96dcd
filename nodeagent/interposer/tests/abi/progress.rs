//! What a tenant achieves, and the agent's per-tenant SM caps, through the real ABI
//! (`docs/design/utility-redistribution.md`): a gated tenant's synchronisations that waited for
//! work it launched count as steps in its slot of the GPU's schedule; `vgpu_progress` (and
//! `vgpu.torch.progress` over it) counts the application's own units instead; and a cap the
//! agent publishes for a squeezable tenant moves its launches to a green context of that share
//! of the SMs, with or without a latency tenant on the GPU.

use super::{Probe, kit, latency_tenant, now_ns, schedule, shm_dir, trace};
use std::path::Path;
use std::process::Command;
use tenant_abi::compute::{Region, TENANTS};
use tenant_abi::control::{DECISION_TTL_NS, Decision};

/// The slot of tenant `name` in the schedule (it joined earlier; a slot outlives its processes).
fn slot_of(region: &Region, name: &str) -> usize {
    region
        .live_slots()
        .into_iter()
        .find(|(_, slot_name)| slot_name == name)
        .map(|(slot, _)| slot)
        .unwrap_or_else(|| panic!("{name} has no slot"))
}

/// A best-effort trainer with a compute share: a member of the GPU's schedule (gated).
fn trainer(shm: &Path) -> Probe {
    Probe::new(shm, Some("trainer"))
        .env("VGPU_COMPUTE_SHARES", "0:100")
        .env("VGPU_GUARANTEED", "0")
}

/// The trainer in spatial mode (what the agent gives a tenant with a fraction of a GPU), with a
/// latency stamp that stays fresh for a minute once a latency tenant launched.
fn squeezable(shm: &Path) -> Probe {
    trainer(shm)
        .env("VGPU_SPATIAL", "1")
        .env("VGPU_SPATIAL_HOLD_MS", "60000")
}

/// One launch moved to green stream 0x9000 of a green context of `sms` SMs (the fake's trace:
/// the context, then the event pair around the kernel; `spatial.rs` explains the tokens).
fn moved_to(sms: u32) -> String {
    format!("C:{sms} R:1:5000 W:9000:1 K:9000 R:2:9000 W:5000:2")
}

/// Caps published with `caps` for the named slots, stamped `at`.
fn publish_caps(region: &Region, caps: &[(usize, u8)], at: u64) {
    let mut all = [0u8; TENANTS];
    for &(slot, cap) in caps {
        all[slot] = cap;
    }
    region.control.publish_caps(&all, at);
}

/// A stamp that keeps what is published in force however slowly the next probe starts (a
/// loaded CI machine): `Control::cap` and `Control::decision` treat a stamp ahead of their clock
/// as fresh, so a stamp 5 s ahead holds for 5.5 s.
fn ahead(shm: &Path) -> u64 {
    now_ns(shm) + 5_000_000_000
}

#[test]
fn a_gated_tenants_syncs_that_waited_for_its_work_are_steps() {
    let shm = shm_dir();
    // 3 launch-and-sync steps; a stream sync and a device sync with nothing launched since (no
    // step); a kernel polled to completion, a graph ended by a device sync, a copy ended by a
    // stream sync (3 steps); a second sync of nothing.
    let out = trainer(shm.path()).run(
        "step kernel 100 3 stream_sync sync launch kernel 100 stream_poll launch graph 100 sync \
         copy 100 stream_sync stream_sync",
    );
    assert!(out.contains("step 0 ") && out.contains("copy 0"), "{out}");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let slot = slot_of(region, "trainer");
    assert_eq!(region.progress(slot), (6, false), "{out}");
    // Another process of the tenant adds to the same slot.
    trainer(shm.path()).run("step kernel 100 2 sync");
    assert_eq!(region.progress(slot), (8, false));
    // A latency tenant's steps count in its own slot too (besides its histogram).
    latency_tenant(shm.path()).run("step kernel 100 2 stream_sync");
    assert_eq!(region.progress(slot_of(region, "inference")), (2, false));
    assert_eq!(region.progress(slot), (8, false), "not the trainer's");
}

#[test]
fn vgpu_progress_counts_the_applications_units_and_steps_stop_counting() {
    let shm = shm_dir();
    let out = trainer(shm.path())
        .run("step kernel 100 2 progress 5 step kernel 100 2 progress 3 progress 0");
    assert_eq!(out.matches("progress 0\n").count(), 3, "{out}");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let slot = slot_of(region, "trainer");
    // The 2 steps before the first call stay in the count; none after it.
    assert_eq!(region.progress(slot), (10, true), "{out}");
    // The tenant's other processes count no steps either once it counts its own units.
    trainer(shm.path()).run("step kernel 100 2");
    assert_eq!(region.progress(slot), (10, true));
    // A count that would reach the flag's bit is refused, and nothing is counted.
    let out = trainer(shm.path()).run("launch kernel 10 progress 9223372036854775808");
    assert!(out.contains("progress -1\n"), "{out}");
    assert_eq!(region.progress(slot), (10, true));
    // A latency tenant counts into its slot.
    let out = latency_tenant(shm.path()).run("step kernel 100 1 progress 4");
    assert!(out.contains("progress 0\n"), "{out}");
    assert_eq!(region.progress(slot_of(region, "inference")), (5, true));
}

#[test]
fn vgpu_progress_without_a_schedule_slot_says_so() {
    let shm = shm_dir();
    // No tenant at all.
    let out = Probe::new(shm.path(), None).run("launch kernel 10 progress 1");
    assert!(out.contains("progress 1\n"), "{out}");
    // A tenant without a compute share (never a member of the schedule).
    let out = Probe::new(shm.path(), Some("trainer")).run("launch kernel 10 progress 1");
    assert!(out.contains("progress 1\n"), "{out}");
    // A gated tenant before its first launch (it joins the schedule there), then after it.
    let out = trainer(shm.path()).run("progress 7 sync launch kernel 10 progress 2");
    assert!(out.starts_with("progress 1\n"), "{out}");
    assert!(out.ends_with("progress 0\n"), "{out}");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    assert_eq!(region.progress(slot_of(region, "trainer")), (2, true));
}

#[test]
fn a_fresh_cap_moves_a_launch_to_its_share_of_the_sms_without_a_latency_tenant() {
    let shm = shm_dir();
    // The first run makes the schedule file and the trainer's slot; nothing is capped.
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let slot = slot_of(region, "trainer");
    // Half of the fake's 132 SMs: 66, rounded down to the granularity of 8.
    publish_caps(region, &[(slot, 64)], ahead(shm.path()));
    let out = squeezable(shm.path()).run("launch kernel 10 launch kernel 10 trace");
    let twice = format!(
        "{} R:1:5000 W:9000:1 K:9000 R:2:9000 W:5000:2",
        moved_to(64)
    );
    assert_eq!(trace(&out), twice, "{out}");
    // A copy within the GPU's memory runs on its SMs: it moves with the cap too.
    let out = squeezable(shm.path()).run("copy 10 trace");
    assert!(out.contains("copy 0"), "{out}");
    assert_eq!(trace(&out), moved_to(64), "{out}");
    // The share is of the device's SMs: half of 64 is 32.
    let out = squeezable(shm.path())
        .env("FAKE_CUDA_SMS", "64")
        .run("launch kernel 10 trace");
    assert_eq!(trace(&out), moved_to(32), "{out}");
    // The smallest cap still leaves one granule.
    publish_caps(region, &[(slot, 1)], ahead(shm.path()));
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), moved_to(8), "{out}");
    // Another tenant's cap is not this one's.
    publish_caps(region, &[((slot + 1) % TENANTS, 32)], ahead(shm.path()));
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
    // Without spatial mode a cap moves nothing (the agent must give the tenant VGPU_SPATIAL=1).
    publish_caps(region, &[(slot, 64)], ahead(shm.path()));
    let out = trainer(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
}

#[test]
fn an_expired_or_zero_cap_and_a_driver_without_green_contexts_leave_launches_in_place() {
    let shm = shm_dir();
    squeezable(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let slot = slot_of(region, "trainer");
    // Older than a decision lives (the agent stopped): uncapped.
    publish_caps(
        region,
        &[(slot, 64)],
        now_ns(shm.path()) - DECISION_TTL_NS - 1_000_000,
    );
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
    // Published and fresh, but 0 for this tenant: uncapped.
    publish_caps(region, &[(slot, 0)], ahead(shm.path()));
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), "K:5000", "{out}");
    // A cap in force on a driver without green contexts: the launch goes as it came.
    publish_caps(region, &[(slot, 64)], ahead(shm.path()));
    let nogreen = kit().dir.join("nogreen");
    let out = squeezable(shm.path())
        .env("LD_LIBRARY_PATH", &nogreen)
        .env("VGPU_REAL_LIBCUDA", nogreen.join("libcuda.so.1"))
        .run("launch kernel 10 launch kernel 10 trace");
    assert_eq!(out.matches("launch 0 ").count(), 2, "{out}");
    assert_eq!(trace(&out), "K:5000 K:5000", "{out}");
}

#[test]
fn beside_a_latency_tenant_a_launch_keeps_the_smaller_of_the_decision_and_the_cap() {
    let shm = shm_dir();
    latency_tenant(shm.path()).run("launch kernel 10");
    squeezable(shm.path()).run("launch kernel 10");
    let mapping = schedule(shm.path());
    let region = mapping.region();
    let slot = slot_of(region, "trainer");
    let decide = |sms: u16| {
        region.control.publish(
            Decision {
                sms,
                level: 2,
                ..Decision::default()
            },
            ahead(shm.path()),
        );
    };
    publish_caps(region, &[(slot, 64)], ahead(shm.path()));
    // The decision leaves fewer SMs than the cap.
    decide(40);
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), moved_to(40), "{out}");
    // The cap leaves fewer than the decision.
    decide(104);
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), moved_to(64), "{out}");
    // A decision that keeps every SM (only a queue bound, which records an event after the
    // launch): the cap alone.
    region.control.publish(
        Decision {
            inflight: 4,
            level: 1,
            ..Decision::default()
        },
        ahead(shm.path()),
    );
    let out = squeezable(shm.path()).run("launch kernel 10 trace");
    assert_eq!(trace(&out), format!("{} R:3:5000", moved_to(64)), "{out}");
}

/// `vgpu.torch.progress` in a Python process with the interposer preloaded, launching through
/// the fake driver with ctypes: False before the process joined a GPU's schedule, True after its
/// first launch, with the count in the tenant's slot; False, warned once, without the
/// interposer. Skipped, with a line, where `python3` is missing.
#[test]
fn vgpu_torch_progress_counts_through_the_interposer() {
    // The interpreter itself, not a wrapper script (pyenv's shims are shell scripts, which
    // would run with the interposer preloaded too).
    let executable = match Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
    {
        Ok(output) if output.status.success() => {
            String::from_utf8_lossy(&output.stdout).trim().to_owned()
        }
        Ok(output) => panic!("python3 failed: {output:?}"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("SKIPPED: python3 is not installed (.ci/run installs it)");
            return;
        }
        Err(e) => panic!("running python3: {e}"),
    };
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/python");
    let script = r#"
import ctypes, warnings
import vgpu.torch as helper
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("before", helper.progress(2))
    cuda = ctypes.CDLL("libcuda.so.1")
    context = ctypes.c_void_p()
    assert cuda.cuInit(0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0
    assert cuda.cuCtxSetCurrent(context) == 0
    print("launch", cuda.cuLaunchKernel(None, 10, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(0x5000),
                                        None, None))
    print("after", helper.progress(3), helper.progress())
print("warnings", len(caught))
"#;
    let shm = shm_dir();
    let kit = kit();
    let run = |preload: bool| {
        let mut command = Command::new(&executable);
        for (name, _) in std::env::vars() {
            if name.starts_with("VGPU_") || name.starts_with("FAKE_CUDA_") {
                command.env_remove(name);
            }
        }
        command
            .args(["-c", script])
            .env("PYTHONPATH", &python)
            .env("LD_LIBRARY_PATH", &kit.dir)
            .env("VGPU_REAL_LIBCUDA", kit.dir.join("libcuda.so.1"))
            .env("VGPU_SHM_DIR", shm.path())
            .env("VGPU_TENANT", "trainer")
            .env("VGPU_COMPUTE_SHARES", "0:100");
        if preload {
            command.env("LD_PRELOAD", &kit.interposer);
        } else {
            command.env_remove("LD_PRELOAD");
        }
        let output = command.output().expect("running python");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let out = run(true);
    assert_eq!(
        out, "before False\nlaunch 0\nafter True True\nwarnings 0\n",
        "{out}"
    );
    let mapping = schedule(shm.path());
    let region = mapping.region();
    assert_eq!(region.progress(slot_of(region, "trainer")), (4, true));
    let out = run(false);
    assert_eq!(
        out, "before False\nlaunch 0\nafter False False\nwarnings 1\n",
        "{out}"
    );
}
