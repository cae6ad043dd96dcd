//! NVML memory queries through the real ABI: the probe reaches the fake `libnvidia-ml.so.1`
//! (`fakenvml.c`: 3 devices of 80 GiB with 3 GiB used, 512 MiB of it reserved in the v2 struct;
//! NVML device 2 is CUDA device 0, NVML device 1 is CUDA device 1, NVML device 0 is a GPU CUDA
//! does not show) both ways: linked directly (`nvml`, `nvml2`) and through
//! `dlsym(dlopen(...))` (`nvml_dl`, `nvml2_dl`), as pynvml does.
//!
//! Process lists: the fake lists the same processes on every device (`FAKE_NVML_PROCESSES`,
//! `FAKE_NVML_GRAPHICS_PROCESSES`, `FAKE_NVML_MPS_PROCESSES`, "pid:bytes,...", "self" for the
//! caller; entry i has instance ids i and 100 + i). The probe prints `procs <rc> <*infoCount>
//! <pid>:<bytes>[:<gi>:<ci>]...` (`procs_dl ... lib=` through `dlsym`).

use super::{GIB, Probe, shm_dir};

const MIB: u64 = 1 << 20;
/// The fake NVML's own figures for every device: total, free, used (v1); reserved, used (v2).
const REAL_V1: (u64, u64, u64) = (80 * GIB, 77 * GIB, 3 * GIB);
const REAL_V2_RESERVED: u64 = 512 * MIB;
const REAL_V2_USED: u64 = 3 * GIB - 512 * MIB;
/// CUDA device 0's uuid as NVML prints it (fakecuda.c's bytes a0..ae, then the ordinal).
const UUID_CUDA_0: &str = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae00";

fn tenant(shm: &std::path::Path) -> Probe {
    Probe::new(shm, Some("a"))
        .env("VGPU_MEMORY_LIMITS", "0:10GiB")
        .env("VGPU_CONTEXT_OVERHEAD", "512MiB")
}

#[test]
fn nvml_reports_the_slice_both_ways_in_and_agrees_with_cuda() {
    let shm = shm_dir();
    // Used on CUDA device 0: the context (512 MiB, charged when the probe retained it) + 3 GiB.
    let used = 3 * GIB + 512 * MIB;
    let free = 10 * GIB - used;
    let (real_total, real_free, real_used) = REAL_V1;
    let out = tenant(shm.path())
        .with_nvml()
        .run("alloc 3G nvml 2 nvml2 2 nvml_dl 2 nvml2_dl 2 nvml 1 nvml2_dl 1 nvml 0 info");
    let ten = 10 * GIB;
    let expected = [
        "alloc 0".to_owned(),
        format!("nvml 0 {ten} {free} {used}"),
        format!("nvml2 0 {ten} 0 {free} {used}"),
        format!("nvml_dl 0 {ten} {free} {used} lib=libvgpu_cuda.so"),
        format!("nvml2_dl 0 {ten} 0 {free} {used} lib=libvgpu_cuda.so"),
        // CUDA device 1 has no limit, and NVML device 0 is not a CUDA device of this process:
        // NVML's own figures.
        format!("nvml 0 {real_total} {real_free} {real_used}"),
        format!(
            "nvml2_dl 0 {real_total} {REAL_V2_RESERVED} {real_free} {REAL_V2_USED} lib=libvgpu_cuda.so"
        ),
        format!("nvml 0 {real_total} {real_free} {real_used}"),
        // cuMemGetInfo says the same as NVML.
        format!("info 0 {free} {ten}"),
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), expected);
}

#[test]
fn a_process_without_cuda_sees_the_tenants_usage_through_its_visible_uuids() {
    let shm = shm_dir();
    let _holder = tenant(shm.path()).hold("alloc 2G");
    let held = 2 * GIB + 512 * MIB;
    let (real_total, real_free, real_used) = REAL_V1;
    let ten = 10 * GIB;
    // As `vgpu-agent exec` starts it: CUDA_VISIBLE_DEVICES lists the slice's GPU uuids.
    let out = tenant(shm.path())
        .with_nvml()
        .env("PROBE_NO_CUDA", "1")
        .env("CUDA_VISIBLE_DEVICES", UUID_CUDA_0)
        .run("nvml 2 nvml_dl 2 nvml 1");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            format!("nvml 0 {ten} {} {held}", ten - held),
            format!("nvml_dl 0 {ten} {} {held} lib=libvgpu_cuda.so", ten - held),
            format!("nvml 0 {real_total} {real_free} {real_used}"),
        ]
    );
    // Without uuids in CUDA_VISIBLE_DEVICES and before CUDA is initialised, the device cannot be
    // mapped: NVML's figures. Once the process has a context, the driver maps it, and the new
    // context is charged.
    let out = tenant(shm.path())
        .with_nvml()
        .env("PROBE_NO_CUDA", "1")
        .env("CUDA_VISIBLE_DEVICES", "0")
        .run("nvml 2 retain 0 nvml 2");
    let both = held + 512 * MIB;
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            format!("nvml 0 {real_total} {real_free} {real_used}"),
            "retain 0".to_owned(),
            format!("nvml 0 {ten} {} {both}", ten - both),
        ]
    );
}

#[test]
fn nvml_errors_other_versions_and_pass_through_are_nvmls_own() {
    let shm = shm_dir();
    let (real_total, real_free, real_used) = REAL_V1;
    // A version this library does not know, and NVML's own errors, come back unchanged; a null
    // device reaches our export through dlsym(RTLD_DEFAULT) and NVML refuses it (2).
    let out = tenant(shm.path())
        .with_nvml()
        .run("nvml2_version 2 0x01000028 nvml_default");
    assert_eq!(
        out,
        "nvml2_version 25 0\nnvml_default 2 lib=libvgpu_cuda.so\n"
    );
    // No tenant: NVML answers, and dlsym hands out NVML's own functions.
    let out = Probe::new(shm.path(), None)
        .with_nvml()
        .env("VGPU_MEMORY_LIMITS", "0:10GiB")
        .run("nvml 2 nvml2_dl 2");
    assert_eq!(
        out,
        format!(
            "nvml 0 {real_total} {real_free} {real_used}\n\
             nvml2_dl 0 {real_total} {REAL_V2_RESERVED} {real_free} {REAL_V2_USED} lib=libnvidia-ml.so.1\n"
        )
    );
}

#[test]
fn without_libnvidia_ml_nothing_changes() {
    let shm = shm_dir();
    let empty = tempfile::tempdir().expect("a temporary directory");
    // Our export answers as NVML's loader stubs do when the library is missing (12), and CUDA
    // enforcement goes on as before.
    let out = tenant(shm.path())
        .env("VGPU_REAL_LIBNVML", empty.path().join("libnvidia-ml.so.1"))
        .run("nvml_default alloc 1G info alloc 9G");
    let free = 10 * GIB - GIB - 512 * MIB;
    assert_eq!(
        out,
        format!(
            "nvml_default 12 lib=libvgpu_cuda.so\nalloc 0\ninfo 0 {free} {}\nalloc 2\n",
            10 * GIB
        )
    );
}

/// The probe's pid (its first line, from `pid`) and the rest of its output.
fn split_pid(out: &str) -> (u32, Vec<String>) {
    let mut lines = out.lines();
    let pid = lines
        .next()
        .and_then(|line| line.strip_prefix("pid "))
        .and_then(|pid| pid.parse().ok())
        .expect("the probe prints its pid first");
    (pid, lines.map(str::to_owned).collect())
}

#[test]
fn process_lists_show_only_the_tenants_own_processes() {
    let shm = shm_dir();
    let mut mine = tenant(shm.path()).hold("alloc 1G");
    let theirs = Probe::new(shm.path(), Some("b"))
        .env("VGPU_MEMORY_LIMITS", "0:10GiB")
        .hold("alloc 1G");
    let (mine_pid, theirs_pid) = (mine.child.id(), theirs.child.id());
    let list = format!("1:4096,{mine_pid}:1000,{theirs_pid}:2000,self:3000");
    let script = "pid procs compute 2 8 procs compute_v2 2 8 procs compute_v3 2 8 \
                  procs_dl compute 2 8 procs_dl compute_v3 2 8 procs compute_v3 1 8 \
                  procs_dl compute 0 8";
    let out = tenant(shm.path())
        .with_nvml()
        .env("FAKE_NVML_PROCESSES", &list)
        .run(script);
    let (me, lines) = split_pid(&out);
    let hook = "lib=libvgpu_cuda.so";
    assert_eq!(
        lines,
        [
            // CUDA device 0, limited: the tenant's other process (from the ledger) and this one,
            // in NVML's order, with NVML's figures and instance ids.
            format!("procs 0 2 {mine_pid}:1000 {me}:3000"),
            format!("procs 0 2 {mine_pid}:1000:1:101 {me}:3000:3:103"),
            format!("procs 0 2 {mine_pid}:1000:1:101 {me}:3000:3:103"),
            format!("procs_dl 0 2 {mine_pid}:1000 {me}:3000 {hook}"),
            format!("procs_dl 0 2 {mine_pid}:1000:1:101 {me}:3000:3:103 {hook}"),
            // CUDA device 1 has no limit, NVML device 0 is not CUDA's: every process.
            format!(
                "procs 0 4 1:4096:0:100 {mine_pid}:1000:1:101 {theirs_pid}:2000:2:102 {me}:3000:3:103"
            ),
            format!("procs_dl 0 4 1:4096 {mine_pid}:1000 {theirs_pid}:2000 {me}:3000 {hook}"),
        ]
    );

    // A process without CUDA (a monitoring sidecar started with the slice's uuids) sees the
    // tenant's processes too; a dead one (killed, not yet reaped) is no longer the tenant's.
    let sidecar = || {
        tenant(shm.path())
            .with_nvml()
            .env("FAKE_NVML_PROCESSES", &list)
            .env("PROBE_NO_CUDA", "1")
            .env("CUDA_VISIBLE_DEVICES", UUID_CUDA_0)
    };
    let (me, lines) = split_pid(&sidecar().run("pid procs_dl compute 2 8"));
    assert_eq!(
        lines,
        [format!("procs_dl 0 2 {mine_pid}:1000 {me}:3000 {hook}")]
    );
    mine.kill_without_reaping();
    let (me, lines) = split_pid(&sidecar().run("pid procs compute_v3 2 8"));
    assert_eq!(lines, [format!("procs 0 1 {me}:3000:3:103")]);
}

#[test]
fn process_list_sizes_follow_nvmls_convention_with_the_filtered_count() {
    let shm = shm_dir();
    let mine = tenant(shm.path()).hold("alloc 1G");
    let mine_pid = mine.child.id();
    // 1500 entries, more than the first read takes (1024): the hook reads again.
    let many = std::iter::repeat_n("1:5", 1400)
        .chain([format!("{mine_pid}:10").as_str(), "self:20"])
        .chain(std::iter::repeat_n("2:5", 98))
        .collect::<Vec<_>>()
        .join(",");
    let script = "pid procs compute_v3 2 null procs compute_v3 2 0 procs compute_v3 2 1 \
                  procs compute_v3 2 2 procs_dl compute 2 null procs_dl compute 2 1 \
                  procs compute_v3 1 null procs compute_v3 1 1499 \
                  procs graphics_v3 2 null procs graphics 2 4 procs_dl graphics_v2 1 null \
                  procs mps 2 4 procs_dl mps_v2 2 null procs mps_v3 1 4";
    let out = tenant(shm.path())
        .with_nvml()
        .env("FAKE_NVML_PROCESSES", &many)
        .env("FAKE_NVML_GRAPHICS_PROCESSES", "1:5,2:6")
        .env("FAKE_NVML_MPS_PROCESSES", format!("self:7,{mine_pid}:8"))
        .run(script);
    let (me, lines) = split_pid(&out);
    let hook = "lib=libvgpu_cuda.so";
    assert_eq!(
        lines,
        [
            // A null buffer, no room, too little room: the tenant's count (2), nothing written.
            "procs 7 2".to_owned(),
            "procs 7 2".to_owned(),
            "procs 7 2".to_owned(),
            format!("procs 0 2 {mine_pid}:10:1400:1500 {me}:20:1401:1501"),
            format!("procs_dl 7 2 {hook}"),
            format!("procs_dl 7 2 {hook}"),
            // The unlimited device: NVML's own count.
            "procs 7 1500".to_owned(),
            "procs 7 1500".to_owned(),
            // No process of the tenant's in the graphics list: empty, whatever the room.
            "procs 0 0".to_owned(),
            "procs 0 0".to_owned(),
            format!("procs_dl 7 2 {hook}"),
            // MPS lists likewise.
            format!("procs 0 2 {me}:7 {mine_pid}:8"),
            format!("procs_dl 7 2 {hook}"),
            format!("procs 0 2 {me}:7:0:100 {mine_pid}:8:1:101"),
        ]
    );
}

#[test]
fn process_lists_of_unconfigured_processes_and_errors_are_nvmls_own() {
    let shm = shm_dir();
    let list = "1:4096,self:3000";
    // No tenant: every process, and dlsym hands out NVML's own function.
    let out = Probe::new(shm.path(), None)
        .with_nvml()
        .env("VGPU_MEMORY_LIMITS", "0:10GiB")
        .env("FAKE_NVML_PROCESSES", list)
        .run("pid procs compute_v3 2 8 procs_dl compute 2 null procs_dl compute 2 8");
    let (me, lines) = split_pid(&out);
    assert_eq!(
        lines,
        [
            format!("procs 0 2 1:4096:0:100 {me}:3000:1:101"),
            "procs_dl 7 2 lib=libnvidia-ml.so.1".to_owned(),
            format!("procs_dl 0 2 1:4096 {me}:3000 lib=libnvidia-ml.so.1"),
        ]
    );
    // A tenant's call on a null device: NVML's error (2), `*infoCount` untouched.
    let out = tenant(shm.path())
        .with_nvml()
        .env("FAKE_NVML_PROCESSES", list)
        .run("procs compute_v3 null 4 procs_dl compute null null");
    assert_eq!(out, "procs 2 4\nprocs_dl 2 0 lib=libvgpu_cuda.so\n");
}
