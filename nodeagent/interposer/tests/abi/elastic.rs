//! Elastic memory through the real ABI (issue 17, `docs/design/elastic-memory.md`): the test
//! plays the agent and writes CUDA device 0's memory board (`<uuid>.memory` beside the ledgers,
//! with each tenant's request and limit and the GPU's capacity), and tenant processes allocate
//! past their request (`VGPU_MEMORY_LIMITS`, what the agent sets to the request) against it. The
//! board is read back as the agent reads it for its reports (`tenant_abi::shm::sample_board`).

use super::{GIB, Holder, Probe, shm_dir};
use std::io::Read;
use std::path::{Path, PathBuf};
use tenant_abi::board::{TenantSpec, TenantUsage};

const MIB: u64 = 1 << 20;
/// CUDA device 0's uuid (fakecuda.c's bytes a0..ae, then the ordinal): names its board.
const GPU_0: &str = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae00";

/// Writes device 0's board: `capacity` and `(tenant, request, limit)` entries, with a swap
/// staging budget as large as the capacity (every chunk may go out).
fn board(shm: &Path, capacity: u64, tenants: &[(&str, u64, u64)]) -> PathBuf {
    board_with_staging(shm, capacity, capacity, tenants)
}

/// [`board`] with a staging budget of `staging` bytes.
fn board_with_staging(
    shm: &Path,
    capacity: u64,
    staging: u64,
    tenants: &[(&str, u64, u64)],
) -> PathBuf {
    let path = tenant_abi::layout::board_path(shm, GPU_0);
    tenant_abi::shm::create_board(&path).expect("creating the board");
    let specs: Vec<TenantSpec> = tenants
        .iter()
        .map(|&(name, request, limit)| TenantSpec {
            name: name.to_owned(),
            request_bytes: request,
            limit_bytes: limit,
            priority: 0,
            guaranteed: true,
        })
        .collect();
    let gpu = tenant_abi::board::GpuSpec {
        capacity_bytes: capacity,
        staging_budget_bytes: staging,
    };
    tenant_abi::shm::write_board(&path, gpu, &specs).expect("writing the board");
    path
}

/// What the agent would report for `tenant` from the board now (dead processes reclaimed).
/// A tenant's (resident, swapped, staging) bytes on the board.
fn memory_of(board: &Path, tenant: &str) -> (u64, u64, u64) {
    let usage = usage(board, tenant);
    (
        usage.resident_bytes,
        usage.swapped_bytes,
        usage.staging_bytes,
    )
}

fn usage(board: &Path, tenant: &str) -> TenantUsage {
    let (tenants, _) = tenant_abi::shm::sample_board(board).expect("sampling the board");
    tenants
        .into_iter()
        .find(|t| t.name == tenant)
        .expect("the tenant is on the board")
}

/// A process of `tenant` whose request on device 0 is `request` (as the agent sets it), with the
/// swap off (`VGPU_MEMORY_SWAP=0`; [`swapping`] turns it on, as it is by default).
fn tenant(shm: &Path, name: &str, request: &str) -> Probe {
    Probe::new(shm, Some(name))
        .env("VGPU_MEMORY_LIMITS", format!("0:{request}"))
        .env("VGPU_MEMORY_SWAP", "0")
}

/// A probe with the swap on and a fake driver that moves real bytes (so contents can be checked
/// through a swap).
/// Staging is not pinned ahead (`VGPU_MEMORY_STAGING_WARM=0`), so that what a round pins does
/// not depend on the watcher's timing; `a_borrowers_staging_is_pinned_ahead_...` turns it on.
fn swapping(probe: Probe) -> Probe {
    probe
        .env("VGPU_MEMORY_SWAP", "1")
        .env("FAKE_CUDA_REAL_BYTES", "1")
        .env("VGPU_MEMORY_STAGING_WARM", "0")
}

/// A file in the test's shm directory, as a probe script names it (`touch`, `until_file`).
fn file_in(shm: &Path, name: &str) -> String {
    shm.join(name).display().to_string()
}

/// Runs `script`; its stdout and stderr (the probe may refuse; it must not fail).
fn run(probe: Probe, script: &str) -> (String, String) {
    let mut probe = probe;
    probe.command.args(script.split_whitespace());
    let output = probe.command.output().expect("running the probe");
    assert!(output.status.success(), "the probe `{script}` failed");
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Kills a holding probe and returns what it wrote to stderr.
fn stderr_of(mut holder: Holder) -> String {
    holder.child.kill().expect("kill");
    holder.child.wait().expect("wait");
    let mut text = String::new();
    if let Some(mut stderr) = holder.child.stderr.take() {
        stderr.read_to_string(&mut text).expect("reading stderr");
    }
    text
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn past_the_request_a_tenant_borrows_vmm_backed_memory_up_to_its_limit() {
    let shm = shm_dir();
    let board = board(shm.path(), 40 * GIB, &[("a", 10 * GIB, 30 * GIB)]);
    // 8 GiB within the request, then 4 GiB past it: borrowed, so VMM-backed (the fake's ranges).
    let holder = tenant(shm.path(), "a", "10GiB").hold("info alloc 8G alloc 4G vmm info");
    assert_eq!(
        lines(&holder.output),
        [
            // The limit is the total; free: the GPU's 40 GiB free, within the limit.
            format!("info 0 {} {}", 30 * GIB, 30 * GIB).as_str(),
            "alloc 0",
            "alloc 0",
            format!("vmm 0 reserved={} mapped={}", 4 * GIB, 4 * GIB).as_str(),
            // 12 held: 18 more up to the limit, and the GPU has 28 free.
            format!("info 0 {} {}", 18 * GIB, 30 * GIB).as_str(),
        ]
    );
    let held = usage(&board, "a");
    assert_eq!((held.resident_bytes, held.swapped_bytes), (12 * GIB, 0));
    assert_eq!(held.borrowed_bytes(), 2 * GIB);
    // A second process of the tenant: past the limit it is refused and told what to do; up to
    // the limit it borrows; its free gives the bytes back to the board.
    let (out, err) = run(
        tenant(shm.path(), "a", "10GiB"),
        "alloc 20G alloc 18G vmm info free vmm info",
    );
    assert_eq!(
        lines(&out),
        [
            "alloc 2",
            "alloc 0",
            format!("vmm 0 reserved={} mapped={}", 18 * GIB, 18 * GIB).as_str(),
            format!("info 0 0 {}", 30 * GIB).as_str(),
            "free 0",
            "vmm 0 reserved=0 mapped=0",
            format!("info 0 {} {}", 18 * GIB, 30 * GIB).as_str(),
        ]
    );
    assert_eq!(
        err.matches("raise the limit (--memory-limit)").count(),
        1,
        "{err}"
    );
    assert_eq!(usage(&board, "a").resident_bytes, 12 * GIB);
    drop(holder);
    assert_eq!(usage(&board, "a").resident_bytes, 0);
}

#[test]
fn a_borrow_is_refused_when_the_gpu_is_full_and_a_request_waits_for_borrowers() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        40 * GIB,
        &[("a", 10 * GIB, 35 * GIB), ("b", 20 * GIB, 20 * GIB)],
    );
    // "a" grows to 30 GiB (20 borrowed) while "b" idles: 10 of the GPU's 40 GiB stay free.
    let _a = tenant(shm.path(), "a", "10GiB").hold("alloc 10G alloc 20G");
    assert_eq!(usage(&board, "a").borrowed_bytes(), 20 * GIB);
    // "b" takes its request: its free says the request is its own (guaranteed), but until the
    // swap gives borrowed memory back only what is free is granted, with a line saying so.
    let (out, err) = run(
        tenant(shm.path(), "b", "20GiB"),
        "info alloc 20G alloc 10G info",
    );
    assert_eq!(
        lines(&out),
        [
            format!("info 0 {} {}", 20 * GIB, 20 * GIB).as_str(),
            "alloc 2",
            "alloc 0",
            format!("info 0 {} {}", 10 * GIB, 20 * GIB).as_str(),
        ]
    );
    assert!(err.contains("(the swap) is off"), "{err}");
    // With "b" holding 10 the GPU is full: "a" may not borrow more, though within its limit.
    let _b = tenant(shm.path(), "b", "20GiB").hold("alloc 10G");
    let (out, err) = run(tenant(shm.path(), "a", "10GiB"), "alloc 2M info");
    assert_eq!(
        lines(&out),
        ["alloc 2", format!("info 0 0 {}", 35 * GIB).as_str()]
    );
    assert!(
        err.contains("wait for other tenants to free memory"),
        "{err}"
    );
    assert_eq!(usage(&board, "b").resident_bytes, 10 * GIB);
    assert_eq!(usage(&board, "a").resident_bytes, 30 * GIB);
}

#[test]
fn only_the_paths_that_can_be_swapped_or_are_the_applications_own_borrow() {
    let shm = shm_dir();
    let board = board(shm.path(), 40 * GIB, &[("a", 2 * GIB, 20 * GIB)]);
    // At its request: the stream-ordered allocator, managed memory, pools and arrays are refused
    // past it; cuMemCreate is counted as borrowed; a pitched allocation borrows VMM-backed (1024
    // x 1M rows = 1 GiB), and legacy IPC refuses it while it serves memory within the request.
    let holder = tenant(shm.path(), "a", "2GiB").hold(
        "alloc 2G ipc async 1G managed 1G pool 1G array 16384 16384 create 1G pitch 1000 1M \
         ipc vmm",
    );
    assert_eq!(
        lines(&holder.output),
        [
            "alloc 0",
            "ipc 0",
            "async 2",
            "managed 2",
            "pool 2",
            "array 2",
            "create 0",
            "pitch 0 1024",
            "ipc 801",
            format!("vmm 0 reserved={GIB} mapped={GIB}").as_str(),
        ]
    );
    let held = usage(&board, "a");
    assert_eq!(held.resident_bytes, 4 * GIB);
    assert_eq!(held.borrowed_bytes(), 2 * GIB);
    let err = stderr_of(holder);
    assert_eq!(err.matches("cannot borrow").count(), 4, "{err}");
    assert!(err.contains("the stream-ordered allocator"), "{err}");
    assert!(err.contains("cuMemAllocManaged"), "{err}");
    assert!(err.contains("a CUDA array"), "{err}");
    assert_eq!(err.matches("cuIpcGetMemHandle").count(), 1, "{err}");
    assert!(err.contains("raise the request (--memory)"), "{err}");
}

/// Memory the application maps itself (`cuMemCreate`, PyTorch's `expandable_segments`) cannot
/// be swapped out, so it must not overbook the GPU's requests: past its request a tenant creates
/// only from what no tenant's request books and no one borrowed, with a line saying so, while
/// `cuMemAlloc` (swappable) still borrows what is free. Before, it borrowed any free memory and
/// another tenant's request could then never be met.
#[test]
fn memory_the_application_creates_past_its_request_never_overbooks_the_requests() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        40 * GIB,
        &[("a", 2 * GIB, 20 * GIB), ("b", 30 * GIB, 30 * GIB)],
    );
    // Requests book 32 of 40: "a" may create 6 past its 2, not 4 more; cuMemAlloc borrows on.
    let holder = tenant(shm.path(), "a", "2GiB").hold("alloc 2G create 6G create 4G alloc 4G");
    assert_eq!(
        lines(&holder.output),
        ["alloc 0", "create 0", "create 2", "alloc 0"]
    );
    assert_eq!(usage(&board, "a").resident_bytes, 12 * GIB);
    let err = stderr_of(holder);
    assert!(
        err.contains("cannot be swapped out") && err.contains("2.00 GiB is left"),
        "{err}"
    );
    assert!(err.contains("expandable_segments:False"), "{err}");
}

#[test]
fn a_borrowed_allocation_is_rounded_to_the_granularity_and_credited_at_free() {
    let shm = shm_dir();
    let board = board(shm.path(), 40 * GIB, &[("a", GIB, 4 * GIB)]);
    // 1 byte past the request takes 2 MiB (the fake driver's granularity).
    let holder = tenant(shm.path(), "a", "1GiB").hold("alloc 1G alloc 1 vmm");
    assert_eq!(
        lines(&holder.output),
        [
            "alloc 0",
            "alloc 0",
            format!("vmm 0 reserved={} mapped={}", 2 * MIB, 2 * MIB).as_str()
        ]
    );
    assert_eq!(usage(&board, "a").resident_bytes, GIB + 2 * MIB);
    drop(holder);
    let (out, _) = run(
        tenant(shm.path(), "a", "1GiB"),
        "alloc 1G alloc 3G free free info",
    );
    assert_eq!(
        lines(&out),
        [
            "alloc 0",
            "alloc 0",
            "free 0",
            "free 0",
            format!("info 0 {} {}", 4 * GIB, 4 * GIB).as_str()
        ]
    );
    assert_eq!(usage(&board, "a").resident_bytes, 0);
}

#[test]
fn without_a_board_for_the_tenant_the_request_is_a_hard_quota_as_before() {
    let shm = shm_dir();
    let script = "alloc 2G alloc 1 info vmm";
    let expected = [
        "alloc 0".to_owned(),
        "alloc 2".to_owned(),
        format!("info 0 0 {}", 2 * GIB),
        "vmm 0 reserved=0 mapped=0".to_owned(),
    ];
    // No board file: nothing changed (the refusal's line is today's).
    let (out, err) = run(tenant(shm.path(), "a", "2GiB"), script);
    assert_eq!(lines(&out), expected);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("tenant a holds 2.00 GiB of its 2.00 GiB"),
        "{err}"
    );
    // A board that does not describe the tenant: the same, and one line says why.
    board(shm.path(), 40 * GIB, &[("b", 2 * GIB, 20 * GIB)]);
    let (out, err) = run(tenant(shm.path(), "a", "2GiB"), script);
    assert_eq!(lines(&out), expected);
    assert_eq!(
        err.matches("does not describe tenant a").count(),
        1,
        "{err}"
    );
}

#[test]
fn nvml_reports_the_limit_and_what_may_be_borrowed_as_cuda_does() {
    let shm = shm_dir();
    board(shm.path(), 40 * GIB, &[("a", 10 * GIB, 30 * GIB)]);
    // NVML device 2 is CUDA device 0 (fakenvml.c).
    let out = tenant(shm.path(), "a", "10GiB")
        .with_nvml()
        .run("alloc 12G nvml 2 info");
    let (total, free, used) = (30 * GIB, 18 * GIB, 12 * GIB);
    assert_eq!(
        lines(&out),
        [
            "alloc 0",
            format!("nvml 0 {total} {free} {used}").as_str(),
            format!("info 0 {free} {total}").as_str(),
        ]
    );
}

/// The swap (on by default; these tests' `tenant` turns it off and `swapping` on again),
/// on the fake driver with real bytes: "b" needs its request, which "a" borrowed; "b" asks "a"
/// for it on the board and waits; "a" sees the want at its next call into the driver, moves its
/// borrowed chunk to host memory; "b" gets its memory; when "b" frees it, "a" brings the chunk
/// back at the same address with its contents.
/// The address a borrower's probe printed (`addr`, after its last allocation).
fn printed_address(probe: &Holder) -> String {
    probe
        .output
        .lines()
        .find_map(|line| line.strip_prefix("addr "))
        .expect("the probe printed its chunk's address")
        .to_owned()
}

/// A borrower's probe ended `spin_info FILE info check SEED addr vmm` with its memory back: its
/// `cuMemGetInfo` shows its whole `limit` held, its pattern checked out, its last chunk at
/// `address` again, and `borrowed` bytes reserved and mapped.
fn assert_came_back(probe: &Holder, limit: u64, address: &str, borrowed: u64) {
    let after: Vec<&str> = probe.output.lines().collect();
    assert_eq!(
        after[after.len() - 5..],
        [
            "spin_info 0",
            format!("info 0 0 {limit}").as_str(),
            "check 0 ok",
            format!("addr {address}").as_str(),
            format!("vmm 0 reserved={borrowed} mapped={borrowed}").as_str(),
        ]
    );
}

#[test]
fn a_borrowed_chunk_goes_to_host_memory_for_a_request_and_comes_back_intact() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a": 4 MiB within its request, 8 MiB borrowed with a pattern; then it keeps calling
    // cuMemGetInfo until "b" is done, queries once more and reads its pattern back.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 addr touch {} spin_info {} info check 7 addr vmm",
        file("a-ready"),
        file("b-done")
    ));
    a.wait_for_line("touch 0");
    let address = printed_address(&a);
    assert_eq!(usage(&board, "a").borrowed_bytes(), 8 * MIB);
    // "b": its request, which only fits once "a" gave its borrowed chunk back.
    let mut b = swapping(tenant(shm.path(), "b", "8MiB")).start_holding(&format!(
        "until_file {} alloc 8M info until_file {} free touch {}",
        file("a-ready"),
        file("test-go"),
        file("b-done")
    ));
    b.wait_for_line(&format!("info 0 0 {}", 8 * MIB));
    assert_eq!(b.output, "until_file 0\nalloc 0\n");
    // Swapped bytes only: "a" keeps trying to swap back in, and a try counts the bytes resident
    // for an instant before it sees the GPU full.
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    assert_eq!(usage(&board, "b").resident_bytes, 8 * MIB);
    // "b" frees its memory: "a" brings its chunk back, at the same address, with its bytes.
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    a.wait_held();
    assert_came_back(&a, 12 * MIB, &address, 8 * MIB);
    let back = usage(&board, "a");
    assert_eq!((back.resident_bytes, back.swapped_bytes), (12 * MIB, 0));
    let err = stderr_of(a);
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
}

/// Two tenants that need their requests back at the same moment from one borrower: both get
/// them (the borrower gives back for both, in whatever order their wants land), neither is
/// refused nor waits out its bound, and once both have freed, the borrower's chunks come back
/// at their addresses with their bytes. Before the plan counted only the room other claims
/// leave, both asked for their need less the same free room, the borrower gave the sum, each
/// found the rest held by the other's claim and waited 2.5 s; and their claims outlived their
/// frees, so the borrower's memory stayed out 5 s more, or went out again.
#[test]
fn two_tenants_reclaiming_from_one_borrower_at_once_both_get_their_requests() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        24 * MIB,
        &[
            ("a", 4 * MIB, 20 * MIB),
            ("b", 8 * MIB, 8 * MIB),
            ("c", 8 * MIB, 8 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a": its 4 MiB request, then two borrowed chunks of 8 MiB with patterns (the board full);
    // it keeps calling cuMemGetInfo until both others are done, then reads the second chunk's
    // pattern back.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 alloc 8M fill 9 addr touch {} spin_info {} info check 9 addr vmm",
        file("a-ready"),
        file("both-done")
    ));
    a.wait_for_line("touch 0");
    let address = printed_address(&a);
    assert_eq!(usage(&board, "a").borrowed_bytes(), 16 * MIB);
    // "b" and "c" start together; each asks for its whole request.
    let needy = |name: &str| {
        swapping(tenant(shm.path(), name, "8MiB")).start_holding(&format!(
            "until_file {} alloc 8M info until_file {} free touch {}",
            file("a-ready"),
            file("test-go"),
            file(&format!("{name}-done"))
        ))
    };
    let (mut b, mut c) = (needy("b"), needy("c"));
    for (name, probe) in [("b", &mut b), ("c", &mut c)] {
        probe.wait_for_line(&format!("info 0 0 {}", 8 * MIB));
        assert_eq!(probe.output, "until_file 0\nalloc 0\n", "{name}");
    }
    assert_eq!(usage(&board, "a").swapped_bytes, 16 * MIB);
    assert_eq!(usage(&board, "b").resident_bytes, 8 * MIB);
    assert_eq!(usage(&board, "c").resident_bytes, 8 * MIB);
    // Both free: "a" brings both chunks back, the checked one at its address with its bytes.
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    c.wait_held();
    std::fs::write(shm.path().join("both-done"), "").expect("touching both-done");
    a.wait_held();
    assert_came_back(&a, 20 * MIB, &address, 16 * MIB);
    let back = usage(&board, "a");
    let wants: Vec<u64> = (0..3).map(|i| want_on(&board, i)).collect();
    let err = stderr_of(a);
    assert_eq!(
        (back.resident_bytes, back.swapped_bytes),
        (20 * MIB, 0),
        "wants {wants:?}; a: {err}"
    );
    let rounds = err.matches("went to host memory").count();
    assert!((1..=2).contains(&rounds), "{rounds} rounds out: {err}");
    for (name, probe) in [("b", b), ("c", c)] {
        let err = stderr_of(probe);
        // Neither waited out its bound because the other's claim held the room it counted on.
        assert!(
            !err.contains("refus") && !err.contains("short after"),
            "{name}: {err}"
        );
    }
}

/// A request taken back piece by piece costs the borrower one round, not one per piece: the
/// first piece that does not fit asks for the rest of the request and holds that room for it
/// (`Board::claim`), so the borrower neither gives back in two rounds nor swaps the second
/// chunk straight back in.
#[test]
fn a_request_taken_back_in_pieces_costs_the_borrower_one_round() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" fills the GPU: 4 MiB within its request, two borrowed chunks of 4 MiB.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 4M alloc 4M touch {} spin_info {}",
        file("a-ready"),
        file("b-done")
    ));
    a.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").borrowed_bytes(), 8 * MIB);
    // "b" takes its 8 MiB in two pieces.
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 4M alloc 4M touch {}",
        file("a-ready"),
        file("b-done")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\nalloc 0\ntouch 0\n");
    a.wait_held();
    let a_now = usage(&board, "a");
    assert_eq!(
        (a_now.resident_bytes, a_now.swapped_bytes),
        (4 * MIB, 8 * MIB)
    );
    // Its reclaim history: one round, 8 MiB, stamped.
    assert_eq!((a_now.reclaims, a_now.reclaimed_bytes), (1, 8 * MIB));
    assert!(a_now.last_reclaim_unix_ms > 0);
    let err = stderr_of(a);
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
}

/// A chunk freed while it is in host memory: its staging and range go, and the board credits
/// the tenant's swapped bytes.
#[test]
fn a_chunk_freed_while_in_host_memory_is_credited_as_swapped() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M touch {} spin_info {} free vmm",
        file("a-ready"),
        file("b-has")
    ));
    let _b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M touch {}",
        file("a-ready"),
        file("b-has")
    ));
    a.wait_held();
    assert!(
        a.output
            .ends_with("spin_info 0\nfree 0\nvmm 0 reserved=0 mapped=0\n"),
        "{}",
        a.output
    );
    let freed = usage(&board, "a");
    assert_eq!((freed.resident_bytes, freed.swapped_bytes), (4 * MIB, 0));
}

/// A want is met by the tenant's process that holds borrowed chunks, whichever of its processes
/// calls into the driver first: one with nothing to give leaves the want on the board.
#[test]
fn a_want_waits_for_the_process_that_has_borrowed_chunks() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // The first process of "a" holds its request and keeps calling; the second borrows.
    let mut within = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M touch {} spin_info {}",
        file("within"),
        file("b-has")
    ));
    let mut borrower = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "until_file {} alloc 8M touch {} spin_info {}",
        file("within"),
        file("borrowed"),
        file("b-has")
    ));
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M touch {}",
        file("borrowed"),
        file("b-has")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\ntouch 0\n");
    within.wait_held();
    borrower.wait_held();
    let a = usage(&board, "a");
    assert_eq!((a.resident_bytes, a.swapped_bytes), (4 * MIB, 8 * MIB));
    assert!(stderr_of(within).is_empty());
    assert_eq!(
        stderr_of(borrower).matches("went to host memory").count(),
        1
    );
}

/// The hold rule on a borrowing allocation: a process with a chunk in host memory borrows more
/// only once the chunk is back (it waits, bounded, for the GPU to have room for it).
#[test]
fn a_process_with_a_chunk_out_borrows_more_only_once_it_is_back() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 16 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" borrows 8 MiB (a pattern in it) and gives it back to "b"; then it borrows 2 MiB more,
    // which waits until "b" freed its memory and the 8 MiB are back.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 5 touch {} spin_info {} touch {} alloc 2M free check 5",
        file("a-ready"),
        file("b-has"),
        file("a-borrowing")
    ));
    let mut b = swapping(tenant(shm.path(), "b", "8MiB")).start_holding(&format!(
        "until_file {} alloc 8M touch {} until_file {} free",
        file("a-ready"),
        file("b-has"),
        file("test-go")
    ));
    a.wait_for_line("touch 0");
    a.wait_for_line("touch 0");
    // "a" is about to borrow (or waiting): its chunk is out while "b" holds the memory (swapped
    // bytes only: a try to swap back in counts them resident for an instant).
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    a.wait_held();
    assert!(
        a.output
            .ends_with("spin_info 0\nalloc 0\nfree 0\ncheck 0 ok\n"),
        "{}",
        a.output
    );
    let back = usage(&board, "a");
    assert_eq!((back.resident_bytes, back.swapped_bytes), (12 * MIB, 0));
}

/// The bytes of the want posted on the `index`-th tenant of `board` (the word a borrower reads;
/// the agent's reports do not show it).
fn want_on(board: &Path, index: usize) -> u64 {
    use tenant_abi::board::{Region, Tenant};
    let at = std::mem::offset_of!(Region, tenants)
        + index * std::mem::size_of::<Tenant>()
        + std::mem::offset_of!(Tenant, want_bytes);
    let bytes = std::fs::read(board).expect("reading the board");
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"))
}

/// Polls (every millisecond, at most 20 s) until `done` says yes.
fn until(mut done: impl FnMut() -> bool, what: &str) {
    let began = std::time::Instant::now();
    while !done() {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(20),
            "waited 20 s for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// The hold rule on launches and copies: a process whose borrowed chunk went to host memory (at
/// its `cuMemGetInfo`) is held at its next kernel launch and at its next asynchronous copy until
/// the chunk is back, and then both see the chunk's original bytes. Without the hold the fake
/// answers 700 (an illegal address: the chunk is unmapped) and the bytes would not match.
#[test]
fn a_launch_and_a_copy_wait_while_a_chunk_is_out_and_see_its_contents() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 kcheck 7 touch {} spin_info {} kcheck 7 acheck 7 check 7",
        file("a-ready"),
        file("b-has")
    ));
    let mut b = swapping(tenant(shm.path(), "b", "8MiB")).start_holding(&format!(
        "until_file {} alloc 8M touch {} until_file {} free",
        file("a-ready"),
        file("b-has"),
        file("test-go")
    ));
    b.wait_for_line("touch 0");
    a.wait_for_line("spin_info 0");
    // "a" is at its launch now, held: its chunk is out while "b" holds the memory.
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    assert_eq!(usage(&board, "b").resident_bytes, 8 * MIB);
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    a.wait_held();
    // (`wait_for_line` took "spin_info 0" out of the output.)
    assert_eq!(
        a.output,
        "alloc 0\nalloc 0\nfill 0\nkcheck 0 ok\ntouch 0\nkcheck 0 ok\nacheck 0 ok\ncheck 0 ok\n"
    );
    let back = usage(&board, "a");
    assert_eq!((back.resident_bytes, back.swapped_bytes), (12 * MIB, 0));
    let err = stderr_of(a);
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
    assert!(!err.contains("refused"), "{err}");
}

/// A want is acted on (at a kernel launch, or by the swap's watcher while the borrower calls
/// nothing) only after the borrower's queued work finished: "a" queued a 1.5 s kernel before the
/// want came, and the fake counts an unmap while a kernel of the process runs (`busy_unmaps`).
#[test]
fn a_want_is_met_at_a_launch_after_the_queued_work_drained() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let swapping = |probe: Probe| swapping(probe).env("FAKE_CUDA_QUEUE_MS", "10000");
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 3 launch kernel 1500000 touch {} until_file {} kcheck 3 \
         busy_unmaps",
        file("a-ready"),
        file("b-asked")
    ));
    let mut b = swapping(tenant(shm.path(), "b", "8MiB")).start_holding(&format!(
        "until_file {} alloc 8M touch {} until_file {} free",
        file("a-ready"),
        file("b-has"),
        file("test-go")
    ));
    // "b" asks "a" (tenant 0) for its memory. "a" may be calling nothing (until_file): its
    // swap watcher takes the want within milliseconds (so the want is not waited for here: a
    // poll missed it under load), and either way the move waits for the 1.5 s kernel.
    std::fs::write(shm.path().join("b-asked"), "").expect("touching b-asked");
    b.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    assert_eq!(want_on(&board, 0), 0);
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    a.wait_held();
    assert!(
        a.output
            .ends_with("until_file 0\nkcheck 0 ok\nbusy_unmaps 0\n"),
        "{}",
        a.output
    );
    let err = stderr_of(a);
    assert_eq!(
        err.matches("went to host memory after its queued work finished")
            .count(),
        1,
        "{err}"
    );
}

/// A process with no borrowed chunk is never held, whatever is posted on the board: the hold
/// costs it one relaxed load (its launches and copies go straight on).
#[test]
fn a_process_without_borrowed_chunks_launches_and_copies_unheld() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let probe = tenant(shm.path(), "a", "4MiB")
        .env("VGPU_MEMORY_SWAP", "1")
        .env("FAKE_CUDA_REAL_BYTES", "1");
    let out = probe.run("alloc 4M launch kernel 10 copy 1 fill 1 check 1 acheck 1");
    assert_eq!(
        lines(&out),
        [
            "alloc 0",
            "launch 0 lib=libcuda.so.1",
            "copy 0",
            "fill 700",
            "check 700 bad",
            "acheck 700 bad",
        ]
    );
    assert_eq!(usage(&board, "a").swapped_bytes, 0);
}

/// A driver that exports a copy entry point the interposer does not hold: the swap stays off
/// in the process (one line at load says so), so a borrowed chunk stays resident whatever is
/// asked, and a tenant short of its request is refused as without the swap.
#[test]
fn a_driver_with_a_copy_path_we_do_not_hold_keeps_the_swap_off() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let unheld = super::kit().dir.join("unheld");
    let swapping = |probe: Probe| {
        swapping(probe)
            .env("LD_LIBRARY_PATH", &unheld)
            .env("VGPU_REAL_LIBCUDA", unheld.join("libcuda.so.1"))
    };
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 2 touch {} spin_info {} kcheck 2",
        file("a-ready"),
        file("b-done")
    ));
    let (out, err) = run(
        swapping(tenant(shm.path(), "b", "8MiB")),
        &format!("until_file {} alloc 8M", file("a-ready")),
    );
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
    assert_eq!(lines(&out), ["until_file 0", "alloc 2"]);
    assert!(err.contains("(the swap) is off"), "{err}");
    assert!(
        a.output.ends_with("spin_info 0\nkcheck 0 ok\n"),
        "{}",
        a.output
    );
    let a_usage = usage(&board, "a");
    assert_eq!(
        (a_usage.resident_bytes, a_usage.swapped_bytes),
        (12 * MIB, 0)
    );
    let a_err = stderr_of(a);
    assert_eq!(
        a_err
            .matches("the swap (VGPU_MEMORY_SWAP) is off in this process")
            .count(),
        1,
        "{a_err}"
    );
    assert!(a_err.contains("cuMemcpyWithAttributesAsync"), "{a_err}");
    assert!(!a_err.contains("went to host memory"), "{a_err}");
}

/// The node's swap staging budget (`swap_host_memory`, this GPU's share on the board) has room
/// for 4 MiB, and the borrower's chunk is 8 MiB: the swap-out is refused, the borrower keeps its
/// memory and its bytes and says the node's swap space is full; the tenant that needed the
/// memory is refused with `CUDA_ERROR_OUT_OF_MEMORY` and the same words, without waiting out the
/// reclaim's 5 s. Nobody is killed, nothing hangs.
#[test]
fn a_reclaim_the_swap_space_cannot_hold_is_refused_and_the_borrower_keeps_its_bytes() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        16 * MIB,
        4 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7 kcheck 7 vmm",
        file("a-ready"),
        file("b-done")
    ));
    let began = std::time::Instant::now();
    let (out, err) = run(
        swapping(tenant(shm.path(), "b", "8MiB")),
        &format!("until_file {} alloc 8M", file("a-ready")),
    );
    let waited = began.elapsed();
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
    assert_eq!(lines(&out), ["until_file 0", "alloc 2"]);
    assert_eq!(
        err.matches("the node's swap space is full").count(),
        1,
        "{err}"
    );
    assert!(err.contains("raise the agent's swap_host_memory"), "{err}");
    assert!(
        waited < std::time::Duration::from_secs(4),
        "the refusal waited {waited:?}: it should not wait out the reclaim"
    );
    assert!(
        a.output.ends_with(&format!(
            "spin_info 0\ncheck 0 ok\nkcheck 0 ok\nvmm 0 reserved={} mapped={}\n",
            8 * MIB,
            8 * MIB
        )),
        "{}",
        a.output
    );
    assert_eq!(memory_of(&board, "a"), (12 * MIB, 0, 0));
    let a_err = stderr_of(a);
    assert!(a_err.contains("the node's swap space is full"), "{a_err}");
    assert!(a_err.contains("swap_host_memory"), "{a_err}");
    assert!(!a_err.contains("went to host memory"), "{a_err}");
}

/// A borrower that cannot give back in time (its 6 s kernel runs past the needy tenant's 5 s
/// wait) is passed over after `RECLAIM_ESCALATE_MS` (2.5 s), and another borrower is asked for
/// the rest: the request is granted, where before it was refused when the wait ran out.
#[test]
fn a_borrower_stuck_in_a_long_kernel_is_passed_over_for_another() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        24 * MIB,
        &[
            ("a", 4 * MIB, 12 * MIB),
            ("c", 2 * MIB, 10 * MIB),
            ("b", 8 * MIB, 8 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let swapping = |probe: Probe| swapping(probe).env("FAKE_CUDA_QUEUE_MS", "20000");
    // "a" borrowed 8 (the most: asked first) and queues a 6 s kernel; "c" borrowed 6 and idles.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M launch kernel 6000000 touch {} until_file {}",
        file("a-ready"),
        file("b-done")
    ));
    let mut c = swapping(tenant(shm.path(), "c", "2MiB")).start_holding(&format!(
        "alloc 2M alloc 6M fill 5 touch {} until_file {} check 5",
        file("c-ready"),
        file("b-done")
    ));
    // 20 of 24 held: "b" needs 8 within its request, 4 of it from the borrowers.
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} until_file {} clock alloc 8M clock",
        file("a-ready"),
        file("c-ready")
    ));
    let b_lines = lines(&b.output);
    assert_eq!(b_lines[3], "alloc 0", "{}", b.output);
    let clock = |line: &str| -> u64 {
        line.strip_prefix("clock ")
            .and_then(|ns| ns.parse().ok())
            .expect("a clock line")
    };
    let ms = (clock(b_lines[4]) - clock(b_lines[2])) / 1_000_000;
    assert!(
        (2_500..5_000).contains(&ms),
        "granted after {ms} ms: after the patience, before the wait ran out"
    );
    assert_eq!(
        usage(&board, "c").swapped_bytes,
        6 * MIB,
        "c gave its chunk"
    );
    let err = stderr_of(b);
    assert!(
        err.contains("tenant(s) a gave nothing back") && err.contains("asking c"),
        "{err}"
    );
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
    c.wait_held();
    assert!(c.output.ends_with("check 0 ok\n"), "{}", c.output);
}

/// A swap-out short of staging asks the GPU's other processes for the staging they keep idle
/// (here pinned ahead by "a"'s watcher) before it is refused: "a" frees it, "b" moves its chunk
/// out, and "c" gets its request. Before, "b" was refused and "c" got an out-of-memory error
/// while 8 MiB of staging sat idle.
#[test]
fn a_swap_out_short_of_staging_gets_the_staging_another_process_keeps_idle() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        32 * MIB,
        16 * MIB,
        &[
            ("a", 4 * MIB, 16 * MIB),
            ("b", 4 * MIB, 20 * MIB),
            ("c", 12 * MIB, 12 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("VGPU_MEMORY_STAGING_WARM", "1")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} until_file {} check 7",
            file("a-ready"),
            file("c-done")
        ));
    // Half the budget: 8 MiB pinned ahead for its 8 MiB chunk.
    until(
        || usage(&board, "a").staging_bytes == 8 * MIB,
        "8 MiB of staging pinned ahead by a",
    );
    let mut b = swapping(tenant(shm.path(), "b", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 12M fill 5 touch {} until_file {} check 5",
        file("b-ready"),
        file("c-done")
    ));
    // 28 of 32 held: "c" needs 12 within its request, 8 of it from "b" (which borrowed the
    // most), whose 12 MiB chunk needs 12 MiB of staging: 8 are left beside a's idle 8.
    let c = swapping(tenant(shm.path(), "c", "12MiB"))
        .hold(&format!("until_file {} alloc 12M free", file("b-ready")));
    assert_eq!(c.output, "until_file 0\nalloc 0\nfree 0\n", "granted");
    std::fs::write(shm.path().join("c-done"), "").expect("touching c-done");
    a.wait_held();
    b.wait_held();
    assert!(a.output.ends_with("check 0 ok\n"), "{}", a.output);
    assert!(b.output.ends_with("check 0 ok\n"), "{}", b.output);
    let err = stderr_of(b);
    assert!(err.contains("went to host memory"), "{err}");
    assert!(!err.contains("swap space is full"), "{err}");
}

/// The tenant that took a borrower's memory is killed holding it: its slot counts until it is
/// reclaimed. The borrower, idle with its chunk out (its watcher stands in the GPU's line), gets
/// its chunk back without an agent to reclaim the dead slot.
#[test]
fn a_borrower_takes_its_memory_back_from_a_needy_process_that_died_holding_it() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("c", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 touch {} until_file {} check 7",
        file("a-ready"),
        file("c-done")
    ));
    // 12 of 16 held: "c" needs 8 within its request, 4 of it from "a"; it dies holding them.
    let mut c = swapping(tenant(shm.path(), "c", "8MiB"))
        .start_holding(&format!("until_file {} alloc 8M", file("a-ready")));
    c.wait_held();
    assert_eq!(c.output, "until_file 0\nalloc 0\n", "granted");
    // Killed holding them (SIGKILL: no exit handler runs).
    c.child.kill().expect("kill");
    c.child.wait().expect("wait");
    // Back while "a" is still idle (its watcher, not a call of its own, brought it).
    until(
        || usage(&board, "a").swapped_bytes == 0,
        "a's chunk back on the GPU while a idles",
    );
    std::fs::write(shm.path().join("c-done"), "").expect("touching c-done");
    a.wait_held();
    assert!(
        a.output.ends_with("check 0 ok\n"),
        "back and intact:\n{}",
        a.output
    );
}

/// Both directions at once on a staging budget that holds one chunk beside the taker's: "a" has
/// three 2 MiB chunks out for "n"'s request and launches; the line serves it and asks "b" (in
/// line for a borrow) for its memory. "b" can stage one chunk at a time, so it lands and counts
/// each, and waits while "a" brings that one in and frees its staging (a short budget), three
/// times. Before, "b" gave up after its second wait and "a" waited 10 s for the rest.
#[test]
fn an_exchange_on_a_short_staging_budget_moves_everything_in_one_round() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        38 * MIB,
        8 * MIB,
        &[
            ("a", 4 * MIB, 40 * MIB),
            ("b", 4 * MIB, 40 * MIB),
            ("n", 12 * MIB, 12 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 2M alloc 2M alloc 2M alloc 2M alloc 2M alloc 2M alloc 2M alloc 2M \
         fill 3 touch {} until_file {} check 3",
        file("a-ready"),
        file("a-go")
    ));
    until(|| Path::new(&file("a-ready")).exists(), "a holding 20 MiB");
    let mut b = swapping(tenant(shm.path(), "b", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 2M alloc 2M alloc 2M alloc 2M fill 5 touch {} until_file {} \
         alloc_retry 4M free touch {} until_file {} check 5",
        file("b-ready"),
        file("n-has"),
        file("b-more"),
        file("done")
    ));
    until(|| Path::new(&file("b-ready")).exists(), "b holding 12 MiB");
    // 32 of 38 held: n's 12 within its request take 6 MiB of a's borrowed memory.
    let mut n = swapping(tenant(shm.path(), "n", "12MiB"))
        .start_holding(&format!("alloc 12M touch {}", file("n-has")));
    n.wait_held();
    assert_eq!(usage(&board, "a").swapped_bytes, 6 * MIB);
    // "b" asks for 4 MiB more and waits in line; "a" stands in it already, and now launches.
    until(|| waiting(&board) == 2, "a and b in the GPU's line");
    std::fs::write(shm.path().join("a-go"), "").expect("touching a-go");
    a.wait_held();
    assert!(a.output.ends_with("check 0 ok\n"), "{}", a.output);
    assert_eq!(usage(&board, "b").swapped_bytes, 6 * MIB, "b gave 6 MiB");
    std::fs::write(shm.path().join("done"), "").expect("touching done");
    drop(n);
    drop(a);
    b.wait_held();
    assert!(b.output.ends_with("check 0 ok\n"), "{}", b.output);
    let err = stderr_of(b);
    let rounds: Vec<&str> = err
        .lines()
        .filter(|line| line.contains("went to host memory"))
        .collect();
    assert_eq!(rounds.len(), 1, "one round: {err}");
    assert!(rounds[0].contains("6.0 MiB of this process"), "{err}");
}

/// A later chunk's fresh pin does not hold back the counting of the chunks landed before it: on
/// an H200 a 1 GiB pin kept six landed chunks uncounted for 132 ms, and the swap-in waiting for
/// their room started that much later. "b" borrows in line and "a", waiting behind it, gives it
/// two borrowed 1 GiB chunks (dry: sizes only), their room counted free a piece (1 GiB) at a
/// time. The second chunk's staging is a pin that lasts until the test ends it
/// (`FAKE_CUDA_SLOW_PIN`), and the first chunk's copy completes only once that pin began. The
/// board shows the first chunk out while the pin still waits for the test: the order, with no
/// time measured.
#[test]
fn a_chunk_landed_while_the_next_ones_staging_is_pinned_is_counted_free_meanwhile() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        5 * GIB,
        &[("a", GIB, 5 * GIB), ("b", GIB, 4 * GIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let dry_swapping = |probe: Probe| {
        probe
            .env("VGPU_MEMORY_SWAP", "1")
            .env("VGPU_MEMORY_STAGING_WARM", "0")
            .env("VGPU_MEMORY_STAGING_TOUCH", "0")
    };
    let mut a = dry_swapping(tenant(shm.path(), "a", "1GiB"))
        .env("FAKE_CUDA_SLOW_PIN", format!("2:{}", file("pin-go")))
        .start_holding(&format!(
            "alloc 1G alloc 1G alloc 1G touch {} until_file {} alloc_retry 2G",
            file("a-ready"),
            file("a-go")
        ));
    a.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").borrowed_bytes(), 2 * GIB);
    // "b" waits first (1 GiB free, it asks for 3 more), then "a" behind it.
    let mut b =
        dry_swapping(tenant(shm.path(), "b", "1GiB")).start_holding("alloc 1G alloc_retry 3G");
    until(|| waiting(&board) == 1, "b in line");
    std::fs::write(shm.path().join("a-go"), "").expect("touching a-go");
    until(
        || usage(&board, "a").swapped_bytes == GIB,
        "a's first chunk counted free while the second's staging is being pinned",
    );
    // Both chunks' staging reserved: the second one's pin has begun, and cannot have ended.
    assert_eq!(memory_of(&board, "a"), (2 * GIB, GIB, 2 * GIB));
    std::fs::write(shm.path().join("pin-go"), "").expect("touching pin-go");
    b.wait_held();
    assert!(
        b.output.ends_with("alloc_retry 0 tries=2\n"),
        "{}",
        b.output
    );
    drop(b);
    a.wait_held();
    assert!(a.output.contains("alloc_retry 0"), "{}", a.output);
    let a_now = usage(&board, "a");
    assert_eq!((a_now.resident_bytes, a_now.swapped_bytes), (5 * GIB, 0));
    let err = stderr_of(a);
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
}

/// A swap-out whose copies never complete (a hung copy engine: `FAKE_CUDA_SWAP_HANG`) gives up
/// after its bound (`vmm::copy_wait_max`) and leaves the chunk where it was, mapped with its
/// contents: the borrower runs on and says so, and the tenant that asked is refused when its own
/// wait runs out, with nothing hung.
#[test]
fn a_swap_out_whose_copies_never_complete_leaves_the_chunk_in_place() {
    let shm = shm_dir();
    board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("FAKE_CUDA_SWAP_HANG", "1")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} until_file {} check 7",
            file("a-ready"),
            file("b-done")
        ));
    let b = swapping(tenant(shm.path(), "b", "8MiB"))
        .hold(&format!("until_file {} alloc 8M", file("a-ready")));
    assert_eq!(
        b.output, "until_file 0\nalloc 2\n",
        "refused when the wait ran out"
    );
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
    assert!(
        a.output.ends_with("check 0 ok\n"),
        "the chunk stayed mapped with its contents:\n{}",
        a.output
    );
    let err = stderr_of(a);
    assert!(err.contains("did not complete within"), "{err}");
    assert!(!err.contains("went to host memory"), "{err}");
}

/// A stopped borrower (a stop signal, or a debugger) gives nothing back until it continues: the
/// tenant waiting within its request says which process is stopped and how to let it go on,
/// instead of only that it waited.
#[test]
fn a_stopped_borrower_is_named_to_the_tenant_waiting_for_its_memory() {
    let shm = shm_dir();
    board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M touch {} until_file {}",
        file("a-ready"),
        file("b-done")
    ));
    let pid = a.child.id();
    until(
        || Path::new(&file("a-ready")).exists(),
        "a holding its borrowed memory",
    );
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &pid.to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill {name} {pid}");
    };
    // Continued below.
    signal("-STOP");
    // 12 of 16 held: "b" needs 8 within its request, 4 of it from "a", which cannot give.
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold("alloc 8M");
    signal("-CONT");
    assert_eq!(b.output, "alloc 2\n", "refused when the wait ran out");
    let err = stderr_of(b);
    assert!(
        err.contains(&format!("process(es) {pid} (tenant a) are stopped"))
            && err.contains("kill -CONT"),
        "{err}"
    );
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
}

/// An idle process with a chunk out (it makes no hook call) waits all the same: its watcher stands
/// it in the GPU's line, so the line may ask it for its resident borrowed memory. Here "a" gave
/// 8 MiB for "b"'s request and idles; "c" waits to borrow 10 MiB, which only "a"'s other 4 MiB
/// can complete. Before, an idle process was a runner, never asked, and "c" waited for ever.
#[test]
fn an_idle_process_with_a_chunk_out_stands_in_line_and_lends_its_idle_memory() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        24 * MIB,
        &[
            ("a", 4 * MIB, 20 * MIB),
            ("b", 8 * MIB, 8 * MIB),
            ("c", 2 * MIB, 12 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M alloc 4M fill 3 touch {} until_file {} check 3",
        file("a-ready"),
        file("a-go")
    ));
    let mut c = swapping(tenant(shm.path(), "c", "2MiB")).start_holding(&format!(
        "alloc 2M touch {} until_file {} alloc_retry 10M",
        file("c-ready"),
        file("b-has")
    ));
    // 18 of 24 held: b's 8 within its request take 8 MiB of a's borrowed memory (its largest).
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} until_file {} alloc 8M touch {}",
        file("a-ready"),
        file("c-ready"),
        file("b-has")
    ));
    assert_eq!(b.output, "until_file 0\nuntil_file 0\nalloc 0\ntouch 0\n");
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    c.wait_held();
    assert_eq!(
        lines(&c.output),
        [
            "alloc 0",
            "touch 0",
            "until_file 0",
            "alloc_retry 0 tries=2"
        ],
        "c borrowed a's idle 4 MiB"
    );
    assert_eq!(usage(&board, "a").swapped_bytes, 12 * MIB);
    drop(c);
    drop(b);
    std::fs::write(shm.path().join("a-go"), "").expect("touching a-go");
    a.wait_held();
    assert!(a.output.ends_with("check 0 ok\n"), "{}", a.output);
    assert_eq!(usage(&board, "a").swapped_bytes, 0, "a's chunks came back");
}

/// An application marks a borrowed allocation cold (`vgpu_memory_cold`, found by `dlsym` as
/// `vgpu.torch.mark_cold` finds it): when another tenant needs its request, that allocation goes
/// to host memory first, though a larger one would go first by default (fewest copies; with
/// `cold 0` in the script the 4 MiB chunk goes).
#[test]
fn a_borrowed_allocation_marked_cold_is_given_back_first() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        10 * MIB,
        &[("a", 4 * MIB, 10 * MIB), ("b", 2 * MIB, 2 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 4M alloc 2M fill 3 cold 1 touch {} spin_info {} check 3",
        file("a-ready"),
        file("b-has")
    ));
    // b frees its memory once it had it, so that a's chunk comes back for its check.
    let b = swapping(tenant(shm.path(), "b", "2MiB")).hold(&format!(
        "until_file {} alloc 2M touch {} free",
        file("a-ready"),
        file("b-has")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\ntouch 0\nfree 0\n");
    a.wait_held();
    let after = lines(&a.output);
    assert_eq!(
        after[..5],
        [
            "alloc 0",
            "alloc 0",
            "alloc 0",
            "fill 0",
            &format!("cold 0 {}", 2 * MIB)
        ]
    );
    assert_eq!(after.last(), Some(&"check 0 ok"), "{}", a.output);
    let err = stderr_of(a);
    assert!(
        err.contains("2.0 MiB of this process's borrowed memory went to host memory"),
        "the cold 2 MiB went, not the 4 MiB chunk: {err}"
    );
    assert!(
        !err.contains("4.0 MiB of this process's borrowed memory went"),
        "{err}"
    );
    assert_eq!(
        usage(&board, "a").swapped_bytes,
        0,
        "the cold chunk came back"
    );
}

/// Marking memory cold in a process whose memory is never asked back says so (1), and a `cold`
/// that is neither 0 nor 1 is refused (-1).
#[test]
fn marking_cold_without_the_swap_says_it_is_inactive() {
    let shm = shm_dir();
    board(shm.path(), 10 * MIB, &[("a", 4 * MIB, 10 * MIB)]);
    let (out, _) = run(tenant(shm.path(), "a", "4MiB"), "alloc 4M alloc 2M cold 1");
    assert_eq!(lines(&out), ["alloc 0", "alloc 0", "cold 1 0"]);
    // A fresh board: the first probe's slot is dead, its bytes still on this one.
    let shm = shm_dir();
    board(shm.path(), 10 * MIB, &[("a", 4 * MIB, 10 * MIB)]);
    let (out, _) = run(
        swapping(tenant(shm.path(), "a", "4MiB")),
        "alloc 4M alloc 2M cold 2 cold 0",
    );
    assert_eq!(
        lines(&out),
        ["alloc 0", "alloc 0", "cold -1 0", "cold 0 2097152"]
    );
}

/// Hints first: the borrower's process registered a hint helper (a thread of the probe, through
/// the exported `vgpu_memory_hint_register`, `vgpu_memory_want` and `vgpu_memory_hint_done`
/// found by `dlsym`), which frees its borrowed allocation when asked. The want is met by the
/// free: nothing is swapped, and the tenant that needed the memory gets it.
#[test]
fn a_hint_helper_that_frees_on_a_want_spares_the_swap() {
    let shm = shm_dir();
    let (board, a, _b) = hinted_beside_b(shm.path(), "alloc 4M alloc 8M hinter free", "info vmm");
    let after = lines(&a.output);
    assert_eq!(
        after[..5],
        ["alloc 0", "alloc 0", "hinter 0", "touch 0", "spin_info 0"]
    );
    assert_eq!(
        after[5],
        format!("hint_join {} 0", 4 * MIB),
        "the shortfall is asked"
    );
    assert_eq!(after[7], "vmm 0 reserved=0 mapped=0");
    assert_eq!(memory_of(&board, "a"), (4 * MIB, 0, 0));
    assert_eq!(usage(&board, "b").resident_bytes, 8 * MIB);
    let err = stderr_of(a);
    assert!(err.contains("nothing was swapped"), "{err}");
    assert!(!err.contains("went to host memory"), "{err}");
}

/// On a 16 MiB GPU, "a" (request 4 MiB, limit 12) runs `setup` (its allocations and a `hinter`),
/// then spins in the driver until "b" (request 8 MiB) has allocated its 8 MiB, then joins its
/// helper and runs `then`. Returns the board, "a", held to its end, and "b", holding its 8 MiB.
fn hinted_beside_b(shm: &Path, setup: &str, then: &str) -> (PathBuf, Holder, Holder) {
    let board = board(
        shm,
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm, name);
    let mut a = swapping(tenant(shm, "a", "4MiB")).start_holding(&format!(
        "{setup} touch {} spin_info {} hint_join {then}",
        file("a-ready"),
        file("b-has")
    ));
    let b = swapping(tenant(shm, "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M touch {}",
        file("a-ready"),
        file("b-has")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\ntouch 0\n");
    a.wait_held();
    (board, a, b)
}

/// An engine that sleeps when asked (vLLM's sleep mode releases the physical memory of its own
/// VMM allocations, `cuMemRelease`, keeping their address ranges): "a" holds 4 MiB it created
/// past its request (from what no request books) and 4 MiB borrowed with `cuMemAlloc`; b's
/// request finds the GPU 4 MiB short, a's helper releases the created memory at the want, and
/// b's request is met with nothing swapped, a's borrowed `cuMemAlloc` memory left resident.
#[test]
fn an_engine_that_releases_its_own_vmm_memory_on_a_want_spares_the_swap() {
    let shm = shm_dir();
    let (board, a, _b) = hinted_beside_b(
        shm.path(),
        "alloc 4M create 4M alloc 4M hinter release",
        "info",
    );
    let after = lines(&a.output);
    assert_eq!(
        after[..6],
        [
            "alloc 0",
            "create 0",
            "alloc 0",
            "hinter 0",
            "touch 0",
            "spin_info 0"
        ]
    );
    assert_eq!(
        after[6],
        format!("hint_join {} 0", 4 * MIB),
        "the shortfall is asked, and the release succeeded"
    );
    assert_eq!(
        memory_of(&board, "a"),
        (8 * MIB, 0, 0),
        "the request and the borrowed cuMemAlloc memory stay, nothing swapped"
    );
    assert_eq!(usage(&board, "b").resident_bytes, 8 * MIB);
    let err = stderr_of(a);
    assert!(err.contains("nothing was swapped"), "{err}");
    assert!(!err.contains("went to host memory"), "{err}");
}

/// A hint helper that does nothing: the swap waits out its budget (`VGPU_MEMORY_HINT_MS`, 300 ms
/// here), then moves the borrowed chunk as without a helper; the chunk comes back intact.
#[test]
fn a_hint_helper_that_frees_nothing_delays_the_swap_by_its_budget_only() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("VGPU_MEMORY_HINT_MS", "300")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 hinter idle touch {} spin_info {} hint_join check 7",
            file("a-ready"),
            file("b-has")
        ));
    let mut b = swapping(tenant(shm.path(), "b", "8MiB")).start_holding(&format!(
        "until_file {} clock alloc 8M clock touch {} until_file {} free",
        file("a-ready"),
        file("b-has"),
        file("test-go")
    ));
    b.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    a.wait_held();
    let b_lines = lines(&b.output);
    assert_eq!(b_lines[0], "until_file 0");
    assert_eq!(b_lines[2], "alloc 0");
    let clock = |line: &str| -> u64 {
        line.strip_prefix("clock ")
            .and_then(|ns| ns.parse().ok())
            .expect("a clock line")
    };
    let alloc_ms = (clock(b_lines[3]) - clock(b_lines[1])) / 1_000_000;
    assert!(
        alloc_ms >= 300,
        "b got its memory after {alloc_ms} ms, within the helper's budget"
    );
    assert!(
        a.output
            .ends_with(&format!("hint_join {} -1\ncheck 0 ok\n", 4 * MIB)),
        "{}",
        a.output
    );
    // The chunk's staging is kept for the next swap-out, still reserved on the board.
    assert_eq!(memory_of(&board, "a"), (12 * MIB, 0, 8 * MIB));
    let err = stderr_of(a);
    assert!(err.contains("the swap moves the rest"), "{err}");
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
}

/// The swap's pinned staging is kept and reused (`staging`): a second reclaim round pins nothing
/// new (one `cuMemHostAlloc` in all), a smaller chunk goes out in the larger pooled buffer and
/// comes back with its bytes, the pooled buffer stays reserved on the board while the process
/// lives, and nothing is staged once it exited.
#[test]
fn a_second_reclaim_reuses_the_pinned_staging_of_the_first() {
    second_reclaim_reuses_staging(false);
}

/// The same on a driver that refuses `cuMemHostRegister`: the staging is pinned by
/// `cuMemHostAlloc` instead, pooled and freed the same way.
#[test]
fn without_host_registration_the_staging_is_pinned_by_host_alloc() {
    second_reclaim_reuses_staging(true);
}

fn second_reclaim_reuses_staging(no_register: bool) {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" fills the GPU (4 MiB within its request, 8 MiB borrowed) and gives the 8 MiB chunk
    // back for "b"; once it is back, "a" frees it, borrows 4 MiB with another pattern, and gives
    // that back for "b"'s second round.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("FAKE_CUDA_NO_REGISTER", if no_register { "1" } else { "0" })
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7 free alloc 4M fill 5 touch {} \
         spin_info {} check 5 host_allocs",
            file("a-ready"),
            file("b-done"),
            file("a-ready-2"),
            file("b-done-2")
        ));
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M free touch {} until_file {} alloc 8M free touch {}",
        file("a-ready"),
        file("b-done"),
        file("a-ready-2"),
        file("b-done-2")
    ));
    assert_eq!(
        b.output,
        "until_file 0\nalloc 0\nfree 0\ntouch 0\nuntil_file 0\nalloc 0\nfree 0\ntouch 0\n"
    );
    a.wait_held();
    assert!(
        a.output.ends_with("check 0 ok\nhost_allocs 0 1 0\n"),
        "both chunks came back intact, and one buffer was pinned for both rounds:\n{}",
        a.output
    );
    assert!(a.output.contains("check 0 ok\nfree 0\n"), "{}", a.output);
    // The 8 MiB buffer is pooled: still reserved on the board as a's staging.
    assert_eq!(memory_of(&board, "a"), (8 * MIB, 0, 8 * MIB));
    let pooled = usage(&board, "a");
    assert_eq!((pooled.reclaims, pooled.reclaimed_bytes), (2, 12 * MIB));
    let err = stderr_of(a);
    assert_eq!(
        err.contains("cuMemHostRegister refused swap staging"),
        no_register,
        "{err}"
    );
    let rounds: Vec<&str> = err
        .lines()
        .filter(|line| line.contains("went to host memory"))
        .collect();
    assert_eq!(rounds.len(), 2, "{err}");
    assert!(rounds[0].contains("for 8.0 MiB of new staging"), "{err}");
    assert!(
        rounds[1].contains("pinning 0.0 ms for 0.0 MiB of new staging"),
        "the second round pinned nothing: {err}"
    );
    // Exited: the board's dead-slot reclaim returns its staging (the OS freed the memory).
    assert_eq!(usage(&board, "a").staging_bytes, 0);
    drop(b);
}

/// A new process of a tenant on a GPU full of borrowed memory: its context's overhead goes on the
/// board within its request, so the borrower gives memory back before the driver creates the
/// context (before, the board did not see contexts: the context's creation found the GPU full
/// and failed, the third of three jobs on an H200 with it).
#[test]
fn a_context_on_a_gpu_full_of_borrowed_memory_gets_its_room_by_a_reclaim() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7",
        file("a-ready"),
        file("b-done")
    ));
    // "b" creates its context only once "a" holds the whole GPU; its context costs 2 MiB.
    let mut b = swapping(tenant(shm.path(), "b", "8MiB"))
        .env("PROBE_NO_CUDA", "1")
        .env("VGPU_CONTEXT_OVERHEAD", "2MiB")
        .start_holding(&format!(
            "until_file {} retain 0 touch {} until_file {} alloc 6M info free touch {}",
            file("a-ready"),
            file("b-context"),
            file("test-go"),
            file("b-done")
        ));
    b.wait_for_line("touch 0");
    // The context alone took its room back: on the board before any allocation of "b".
    assert_eq!(usage(&board, "b").resident_bytes, 2 * MIB);
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    std::fs::write(shm.path().join("test-go"), "").expect("touching test-go");
    b.wait_held();
    assert_eq!(
        b.output,
        format!(
            "until_file 0\nretain 0\nuntil_file 0\nalloc 0\ninfo 0 0 {}\nfree 0\ntouch 0\n",
            8 * MIB
        ),
        "the context and the rest of the request were granted"
    );
    // Its context holds 2 MiB of the board while it lives: "a" takes its chunk back once it
    // exited (its dead slot reclaimed by "a"'s wait in line).
    drop(b);
    a.wait_held();
    assert!(a.output.ends_with("check 0 ok\n"), "{}", a.output);
    let err = stderr_of(a);
    assert!(
        err.contains("went to host memory"),
        "a gave its chunk back: {err}"
    );
    // The board's dead-slot reclaim returned b's context's charge.
    assert_eq!(usage(&board, "b").resident_bytes, 0);
}

/// A borrow while the GPU's free memory is held for another tenant's request (its claim after a
/// reclaim) waits in the GPU's line with the swap on: the caching allocator's retry is granted
/// once the claim is gone. Refused at once before, the retry failed too, and a training job of
/// three on an H200 died with out of memory.
#[test]
fn a_borrow_beside_another_tenants_claim_waits_in_line_for_it() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        14 * MIB,
        &[
            ("a", 2 * MIB, 14 * MIB),
            ("b", 8 * MIB, 8 * MIB),
            ("c", 2 * MIB, 14 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" borrows 6 MiB, "c" takes its request: 10 of 14 held.
    let mut a = swapping(tenant(shm.path(), "a", "2MiB")).start_holding(&format!(
        "alloc 2M alloc 6M fill 7 touch {} spin_info {} check 7",
        file("a-ready"),
        file("test-done")
    ));
    // "b" takes 6 MiB of its request: 4 are free, "a" gives its 6 back, and the 2 left of "b"'s
    // request stay claimed for it. Once "b" has left, "a"'s 6 and "c"'s 4 fit beside each other
    // in either order (with 12 MiB, "a", first in line, could take its chunk back first and
    // leave "c" waiting behind a tenant that runs: the test raced on it).
    let mut c = swapping(tenant(shm.path(), "c", "2MiB")).start_holding(&format!(
        "until_file {} alloc 2M touch {} until_file {} alloc_retry 4M",
        file("a-ready"),
        file("c-ready"),
        file("b-got")
    ));
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 6M touch {}",
        file("c-ready"),
        file("b-got")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\ntouch 0\n");
    assert_eq!(usage(&board, "a").swapped_bytes, 6 * MIB);
    // "c"'s borrow of 4 MiB finds the 4 free, 2 of them held for "b": refused once, its retry
    // waits.
    until(
        || usage(&board, "c").waiting_processes != 0,
        "c to wait in line",
    );
    // "b" exits: its claim holds nothing any more, and "c" gets its 4 MiB.
    drop(b);
    c.wait_held();
    assert_eq!(
        c.output,
        "until_file 0\nalloc 0\ntouch 0\nuntil_file 0\nalloc_retry 0 tries=2\n"
    );
    // "c" exits too: "a" takes its chunk back, intact.
    drop(c);
    std::fs::write(shm.path().join("test-done"), "").expect("touching test-done");
    a.wait_held();
    assert!(a.output.ends_with("check 0 ok\n"), "{}", a.output);
}

/// With `VGPU_MEMORY_STAGING_WARM` on (the default), a borrower's watcher pins staging for its
/// resident borrowed chunk ahead, within half the GPU's swap budget: the reclaim then pins
/// nothing, and the buffer is pinned once for the process's life.
#[test]
fn a_borrowers_staging_is_pinned_ahead_and_the_reclaim_pins_nothing() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        12 * MIB,
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("VGPU_MEMORY_STAGING_WARM", "1")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7 host_allocs",
            file("a-ready"),
            file("b-done")
        ));
    // The watcher pins 8 MiB (its chunk; half the budget is 8 MiB) within its first looks.
    until(
        || usage(&board, "a").staging_bytes == 8 * MIB,
        "8 MiB of staging pinned ahead",
    );
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M free touch {}",
        file("a-ready"),
        file("b-done")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\nfree 0\ntouch 0\n");
    a.wait_held();
    assert!(
        a.output.ends_with("check 0 ok\nhost_allocs 0 1 0\n"),
        "the chunk came back intact, and its one buffer was pinned ahead:\n{}",
        a.output
    );
    let err = stderr_of(a);
    let rounds: Vec<&str> = err
        .lines()
        .filter(|line| line.contains("went to host memory"))
        .collect();
    assert_eq!(rounds.len(), 1, "{err}");
    assert!(
        rounds[0].contains("pinning 0.0 ms for 0.0 MiB of new staging"),
        "the round pinned nothing: {err}"
    );
}

/// Pooled staging that no swap-out reuses within the idle bound (`VGPU_MEMORY_STAGING_IDLE_MS`,
/// 0 here) is freed at the process's next call, and released on the board while it lives.
#[test]
fn pooled_staging_that_idles_past_the_bound_is_freed_and_released() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("VGPU_MEMORY_STAGING_IDLE_MS", "0")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7 info host_allocs",
            file("a-ready"),
            file("b-done")
        ));
    let _b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M free touch {}",
        file("a-ready"),
        file("b-done")
    ));
    a.wait_held();
    assert!(
        a.output.ends_with(&format!(
            "check 0 ok\ninfo 0 0 {}\nhost_allocs 0 1 1\n",
            12 * MIB
        )),
        "pinned once, freed at the call after the chunk came back:\n{}",
        a.output
    );
    assert_eq!(memory_of(&board, "a"), (12 * MIB, 0, 0));
}

/// A copy out that fails on the copy engine (the fake's first queued copy, reported when the
/// stream is queried, as a fault would be) leaves the chunk mapped with its bytes: nothing is
/// unmapped, the want stays posted, and the next try moves it (in the same pinned buffer).
#[test]
fn a_failed_copy_out_leaves_the_chunk_resident_and_intact() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let mut a = swapping(tenant(shm.path(), "a", "4MiB"))
        .env("FAKE_CUDA_ASYNC_FAIL", "1")
        .start_holding(&format!(
            "alloc 4M alloc 8M fill 7 touch {} spin_info {} check 7 host_allocs vmm",
            file("a-ready"),
            file("b-done")
        ));
    let b = swapping(tenant(shm.path(), "b", "8MiB")).hold(&format!(
        "until_file {} alloc 8M free touch {}",
        file("a-ready"),
        file("b-done")
    ));
    assert_eq!(b.output, "until_file 0\nalloc 0\nfree 0\ntouch 0\n");
    a.wait_held();
    assert!(
        a.output.ends_with(&format!(
            "check 0 ok\nhost_allocs 0 1 0\nvmm 0 reserved={} mapped={}\n",
            8 * MIB,
            8 * MIB
        )),
        "{}",
        a.output
    );
    assert_eq!(usage(&board, "a").swapped_bytes, 0);
    let err = stderr_of(a);
    assert!(
        err.contains("failed with CUresult 700; it stays resident"),
        "{err}"
    );
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
    drop(b);
}

/// Issue 17's three jobs whose footprints add up to 1.5x the GPU's memory (16 MiB; requests of
/// 2 MiB, limits and footprints of 8 MiB): all three finish, each sees its own bytes, nobody is
/// refused past one retry. "a" and "b" fill the GPU; "c" takes its request back from them (one
/// of them goes to host memory), and its borrow, retried as a caching allocator retries, waits
/// in the GPU's line. When "a" and "b" may go on, the one whose chunk is out waits in line
/// behind "c" at its kernel; the other runs, ends and frees: "c" gets its room first, then the
/// held one gets its chunk back, intact.
#[test]
fn three_jobs_at_one_and_a_half_times_the_memory_all_finish_in_line() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[
            ("a", 2 * MIB, 8 * MIB),
            ("b", 2 * MIB, 8 * MIB),
            ("c", 2 * MIB, 8 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let job = |name: &str, seed: u32, before: &str| {
        swapping(tenant(shm.path(), name, "2MiB")).start_holding(&format!(
            "{before} alloc 2M alloc_retry 6M fill {seed} touch {} spin_info {} kcheck {seed} \
             check {seed} free free",
            file(&format!("{name}-ready")),
            file("go"),
        ))
    };
    let mut a = job("a", 1, "");
    a.wait_for_line("touch 0");
    let mut b = job("b", 2, "");
    b.wait_for_line("touch 0");
    assert_eq!(
        usage(&board, "a").resident_bytes + usage(&board, "b").resident_bytes,
        16 * MIB
    );
    let mut c = job("c", 3, "");
    // "c" has its request back (one borrower's chunk went out) and waits in line for 6 MiB.
    until(
        || {
            let (tenants, _) = tenant_abi::shm::sample_board(&board).expect("sampling");
            let swapped: u64 = tenants.iter().map(|t| t.swapped_bytes).sum();
            swapped == 6 * MIB && usage(&board, "c").resident_bytes == 2 * MIB
        },
        "c's request, taken back from a borrower",
    );
    std::fs::write(shm.path().join("go"), "").expect("touching go");
    for job in [&mut a, &mut b, &mut c] {
        job.wait_held();
        assert!(
            job.output.contains("alloc_retry 0")
                && job
                    .output
                    .ends_with("kcheck 0 ok\ncheck 0 ok\nfree 0\nfree 0\n"),
            "{}",
            job.output
        );
    }
    assert!(c.output.contains("alloc_retry 0 tries=2"), "{}", c.output);
    // Nothing resident or out; staging may stay pooled for reuse (`staging`), never more than
    // what went out.
    let (tenants, _) = tenant_abi::shm::sample_board(&board).expect("sampling");
    for t in tenants {
        assert_eq!((t.resident_bytes, t.swapped_bytes), (0, 0), "{t:?}");
        assert!(t.staging_bytes <= t.reclaimed_bytes, "{t:?}");
    }
}

/// Two borrowers that each wait for memory the other holds do not wait for ever: the first in
/// line asks the other waiter for what it borrowed (`reclaim::unstall`), which goes to host
/// memory; the first gets its room, runs and ends; then the other gets its chunk back and its
/// own borrow, with its bytes intact.
#[test]
fn two_borrowers_waiting_for_each_other_are_served_in_turn() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 2 * MIB, 12 * MIB), ("b", 2 * MIB, 12 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" holds 8, "b" 6: 2 free. Each then asks for 4 more, "a" first.
    let mut a = swapping(tenant(shm.path(), "a", "2MiB")).start_holding(&format!(
        "alloc 2M alloc 6M fill 1 touch {} until_file {} alloc_retry 4M fill 4 kcheck 4 free \
         check 1 free free",
        file("a-ready"),
        file("a-go"),
    ));
    a.wait_for_line("touch 0");
    let mut b = swapping(tenant(shm.path(), "b", "2MiB")).start_holding(&format!(
        "alloc 2M alloc 4M fill 2 touch {} until_file {} alloc_retry 4M fill 5 kcheck 5 free \
         check 2",
        file("b-ready"),
        file("b-go"),
    ));
    b.wait_for_line("touch 0");
    std::fs::write(shm.path().join("a-go"), "").expect("touching a-go");
    until(|| waiting(&board) == 1, "a in line");
    std::fs::write(shm.path().join("b-go"), "").expect("touching b-go");
    a.wait_held();
    assert!(
        a.output.ends_with(
            "alloc_retry 0 tries=2\nfill 0\nkcheck 0 ok\nfree 0\ncheck 0 ok\nfree 0\nfree 0\n"
        ),
        "{}",
        a.output
    );
    drop(a);
    b.wait_held();
    assert!(
        b.output
            .ends_with("alloc_retry 0 tries=2\nfill 0\nkcheck 0 ok\nfree 0\ncheck 0 ok\n"),
        "{}",
        b.output
    );
    let b_now = usage(&board, "b");
    assert_eq!((b_now.resident_bytes, b_now.swapped_bytes), (6 * MIB, 0));
    assert_eq!(b_now.reclaims, 1, "b gave its chunk back once, for a");
}

/// Processes in the line of `board` now (the slots' wait stamps; the agent's reports do not show
/// them).
fn waiting(board: &Path) -> usize {
    use tenant_abi::board::{Region, Slot};
    let bytes = std::fs::read(board).expect("reading the board");
    (0..tenant_abi::board::SLOTS)
        .filter(|&i| {
            let at = std::mem::offset_of!(Region, slots)
                + i * std::mem::size_of::<Slot>()
                + std::mem::offset_of!(Slot, wait_since_ns);
            u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes")) != 0
        })
        .count()
}

/// A line that cannot move (requests fill the GPU; every process holding memory waits) refuses
/// its last borrow, never a process waiting for its own swapped-out memory: "c" took its request
/// back from "a" and "b" (both held at their kernels, waiting for their chunks) and waits to
/// borrow more, which nobody could ever free. Its retry is refused with the line that says so;
/// it frees its request, and "a" and "b" get their chunks back, intact.
#[test]
fn a_stuck_line_refuses_its_last_borrow_and_the_held_go_on() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        12 * MIB,
        &[
            ("a", 4 * MIB, 8 * MIB),
            ("b", 4 * MIB, 8 * MIB),
            ("c", 4 * MIB, 8 * MIB),
        ],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let job = |name: &str, seed: u32| {
        let mut job = swapping(tenant(shm.path(), name, "4MiB")).start_holding(&format!(
            "alloc 4M alloc 2M fill {seed} touch {} spin_info {} kcheck {seed} free free",
            file(&format!("{name}-ready")),
            file("go"),
        ));
        job.wait_for_line("touch 0");
        job
    };
    let mut a = job("a", 1);
    let mut b = job("b", 2);
    let c = swapping(tenant(shm.path(), "c", "4MiB")).start_holding("alloc 4M alloc_retry 2M free");
    until(|| waiting(&board) == 1, "c in line");
    std::fs::write(shm.path().join("go"), "").expect("touching go");
    let mut c = c;
    c.wait_held();
    assert_eq!(c.output, "alloc 0\nalloc_retry 2 tries=2\nfree 0\n");
    for job in [&mut a, &mut b] {
        job.wait_held();
        assert!(
            job.output.ends_with("kcheck 0 ok\nfree 0\nfree 0\n"),
            "{}",
            job.output
        );
    }
    let err = stderr_of(c);
    assert!(err.contains("the last in line, is refused"), "{err}");
}

/// A borrower that grows piece by piece in line asks the other waiter in a few rounds, not one a
/// piece (each wait stands for twice the last one), and keeps its place between pieces: "b"
/// takes six 2 MiB pieces (the fake's granularity) from "a"'s borrowed memory in at most three
/// rounds of "a"'s swap, while "a" waits behind it for more than the GPU could give; "a" goes on
/// once "b" is gone, with its chunks back.
#[test]
fn a_borrower_growing_piece_by_piece_in_line_asks_in_few_rounds() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        32 * MIB,
        &[("a", 4 * MIB, 32 * MIB), ("b", 4 * MIB, 24 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let pieces = ["alloc 2M"; 8].join(" ");
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M {pieces} touch {} until_file {} alloc_retry 12M",
        file("a-ready"),
        file("a-go"),
    ));
    a.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").resident_bytes, 20 * MIB);
    let grow = ["alloc_retry 2M"; 6].join(" ");
    let mut b = swapping(tenant(shm.path(), "b", "4MiB"))
        .start_holding(&format!("alloc 4M alloc 8M {grow}"));
    // "b" waits first (the GPU is full), then "a" behind it.
    until(|| waiting(&board) == 1, "b in line");
    std::fs::write(shm.path().join("a-go"), "").expect("touching a-go");
    b.wait_held();
    assert_eq!(
        b.output.matches("alloc_retry 0").count(),
        6,
        "every piece granted:\n{}",
        b.output
    );
    assert_eq!(usage(&board, "b").resident_bytes, 24 * MIB);
    drop(b);
    a.wait_held();
    assert!(
        a.output.ends_with("alloc_retry 0 tries=2\n"),
        "{}",
        a.output
    );
    let rounds = stderr_of(a).matches("went to host memory").count();
    assert!(
        (1..=3).contains(&rounds),
        "{rounds} rounds of a's swap for six pieces"
    );
}

/// An idle borrower (no hook call: it sleeps, as a notebook holding tensors does) gives its
/// borrowed memory back all the same: its watcher thread acts on the want. The needy tenant's
/// request is granted, and when it is gone the idle one's chunk comes back, bytes intact, before
/// or at its next copy.
#[test]
fn an_idle_borrower_gives_back_through_its_watcher() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    // "a" borrows 8 MiB with a pattern, then sleeps (no hook call) until "b" is done.
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 8M fill 7 touch {} until_file {} check 7",
        file("a-ready"),
        file("b-done")
    ));
    a.wait_for_line("touch 0");
    assert_eq!(usage(&board, "a").borrowed_bytes(), 8 * MIB);
    let b = swapping(tenant(shm.path(), "b", "8MiB"))
        .hold(&format!("until_file {} alloc 8M", file("a-ready")));
    assert_eq!(b.output, "until_file 0\nalloc 0\n");
    assert_eq!(usage(&board, "a").swapped_bytes, 8 * MIB);
    drop(b);
    // "b" is gone: the watcher brings the chunk back while "a" still sleeps.
    until(
        || usage(&board, "a").swapped_bytes == 0,
        "a's chunk back while it sleeps",
    );
    std::fs::write(shm.path().join("b-done"), "").expect("touching b-done");
    a.wait_held();
    assert!(
        a.output.ends_with("until_file 0\ncheck 0 ok\n"),
        "{}",
        a.output
    );
}

/// A thread waiting in the GPU's line lets go of its process's state between looks: another
/// thread of the same process frees the memory it waits for (its `cuMemFree` needs that state),
/// and the wait ends with it. Holding it across the wait, the free would wait for the waiter, and
/// the waiter for the free, for ever.
#[test]
fn a_waiting_thread_lets_another_thread_of_its_process_free() {
    let shm = shm_dir();
    let board = board(shm.path(), 8 * MIB, &[("a", 2 * MIB, 12 * MIB)]);
    // 2 MiB within the request, 6 MiB borrowed: the GPU is full. Another thread frees the 6 MiB
    // 300 ms later; meanwhile this one asks for 4 MiB more (refused once, then in line; within
    // the limit: past it, it would be refused at once).
    let a = swapping(tenant(shm.path(), "a", "2MiB"))
        .hold("alloc 2M alloc 6M free_later 300 alloc_retry 4M");
    assert!(
        a.output.ends_with("free_later 0\nalloc_retry 0 tries=2\n"),
        "{}",
        a.output
    );
    assert_eq!(usage(&board, "a").resident_bytes, 6 * MIB);
}

/// A borrow past the tenant's limit on a GPU without room is refused by the limit at once, at the
/// first try and at the caching allocator's retry: it never stands in line for room that could
/// not serve it (the retry waited for ever before; here `VGPU_MEMORY_WAIT_S` bounds it).
#[test]
fn a_borrow_past_the_limit_on_a_full_gpu_is_refused_at_once_not_queued() {
    let shm = shm_dir();
    let _board = board(
        shm.path(),
        24 * MIB,
        &[("a", 4 * MIB, 16 * MIB), ("b", 4 * MIB, 20 * MIB)],
    );
    let file = |name: &str| file_in(shm.path(), name);
    let b = swapping(tenant(shm.path(), "b", "4MiB")).start_holding(&format!(
        "alloc 4M alloc 12M touch {} until_file {}",
        file("b-ready"),
        file("b-go")
    ));
    let began = std::time::Instant::now();
    let (out, err) = run(
        swapping(tenant(shm.path(), "a", "4MiB")).env("VGPU_MEMORY_WAIT_S", "5"),
        &format!(
            "until_file {} alloc 4M alloc 4M alloc_retry 10M",
            file("b-ready")
        ),
    );
    let took = began.elapsed();
    std::fs::write(shm.path().join("b-go"), "").expect("touching b-go");
    drop(b);
    assert_eq!(
        lines(&out),
        [
            "until_file 0",
            "alloc 0",
            "alloc 0",
            "alloc_retry 2 tries=2"
        ]
    );
    assert_eq!(
        err.matches("raise the limit (--memory-limit)").count(),
        2,
        "{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(4),
        "refused at once, not after the wait's bound: {took:?}"
    );
}

/// The GPU's shared staging file for `budget`, made and allocated beside the board as the
/// agent would (`VGPU_AGENT_SHARED_STAGING=1`).
fn shared_staging_file(shm: &Path, budget: u64) -> std::path::PathBuf {
    let staging = tenant_abi::layout::staging_path(shm, GPU_0);
    assert!(tenant_abi::shm::create_staging(&staging, budget).expect("the staging file"));
    tenant_abi::shm::allocate_staging(&staging).expect("the staging file's pages");
    staging
}

/// `a` borrows `borrow.0` past its 4 MiB request, fills it and waits for `borrow.1`
/// registrations (the file's slabs); then "b" (request `b_bytes`) allocates `b_bytes`, which
/// swaps a's chunk out through the file, and frees it, and `a` checks its contents and says
/// how much it registered. Returns `a`, held to its end, and b's output.
fn out_and_back_through_the_file(
    shm: &Path,
    a: Probe,
    borrow: (&str, u32),
    b_bytes: &str,
) -> (Holder, String) {
    let file = |name: &str| file_in(shm, name);
    let (bytes, registrations) = borrow;
    let mut a = a.start_holding(&format!(
        "alloc 4M alloc {bytes} fill 7 until_host_allocs {registrations} touch {} spin_info {} \
         check 7 host_allocs",
        file("a-ready"),
        file("b-done")
    ));
    let b = swapping(tenant(shm, "b", &format!("{b_bytes}iB"))).hold(&format!(
        "until_file {} alloc {b_bytes} free touch {}",
        file("a-ready"),
        file("b-done")
    ));
    a.wait_held();
    (a, b.output.clone())
}

/// The GPU's shared staging file (`VGPU_AGENT_SHARED_STAGING=1`; the test plays the agent and
/// makes it beside the board): a borrower registers it once, off the swap's path, from its first
/// borrow; its swap-out then stages in a run of the file's slabs, pinning nothing, and the chunk
/// comes back intact. The slabs stay its own (pooled) while it lives, and the agent's sampling
/// gives them back once it is gone.
#[test]
fn a_swap_out_stages_in_the_gpus_shared_file_and_pins_nothing() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        12 * MIB,
        128 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 8 * MIB, 8 * MIB)],
    );
    let staging = shared_staging_file(shm.path(), 128 * MIB);
    // Staging is not pinned ahead (`swapping`): the only pin is the file's registration, as
    // far as a's borrowed 8 MiB needs (one slab of the two).
    let (a, b) = out_and_back_through_the_file(
        shm.path(),
        swapping(tenant(shm.path(), "a", "4MiB")).env("VGPU_LOG", "2"),
        ("8M", 1),
        "8M",
    );
    assert_eq!(b, "until_file 0\nalloc 0\nfree 0\ntouch 0\n");
    assert!(
        a.output.ends_with(
            "until_host_allocs 0\ntouch 0\nspin_info 0\ncheck 0 ok\nhost_allocs 0 1 0\n"
        ),
        "registered as far as needed, the chunk out and back through the file, nothing else pinned:\n{}",
        a.output
    );
    // The run of one 64 MiB slab that held the chunk is a's, pooled, reserved on the board.
    assert_eq!(usage(&board, "a").staging_bytes, 64 * MIB);
    let err = stderr_of(a);
    assert!(err.contains("shared swap staging"), "{err}");
    let rounds: Vec<&str> = err
        .lines()
        .filter(|line| line.contains("went to host memory"))
        .collect();
    assert_eq!(rounds.len(), 1, "{err}");
    assert!(
        rounds[0].contains("pinning 0.0 ms for 0.0 MiB of new staging"),
        "the round pinned nothing: {err}"
    );
    // a is gone: the agent's sampling reclaims its slot, then its slabs.
    until(
        || {
            let _ = usage(&board, "a");
            tenant_abi::shm::reclaim_staging(&staging, &board).expect("reclaiming") > 0
        },
        "a's slab given back",
    );
}

/// A chunk larger than a slab stages in a run of slabs and is copied a slab at a time: each slab
/// is a registration of its own, and the driver (and the fake) refuses a copy across two.
#[test]
fn a_chunk_larger_than_a_slab_is_copied_a_slab_at_a_time_and_comes_back_intact() {
    let shm = shm_dir();
    let board = board_with_staging(
        shm.path(),
        200 * MIB,
        512 * MIB,
        &[("a", 4 * MIB, 200 * MIB), ("b", 140 * MIB, 140 * MIB)],
    );
    shared_staging_file(shm.path(), 512 * MIB);
    // Eight slabs of 64 MiB; a's chunk of 130 MiB needs three (within half the budget), so
    // three registrations, and it takes a run of three.
    let (a, b) = out_and_back_through_the_file(
        shm.path(),
        swapping(tenant(shm.path(), "a", "4MiB")),
        ("130M", 3),
        "140M",
    );
    assert_eq!(b, "until_file 0\nalloc 0\nfree 0\ntouch 0\n");
    assert!(
        a.output.ends_with(
            "until_host_allocs 0\ntouch 0\nspin_info 0\ncheck 0 ok\nhost_allocs 0 3 0\n"
        ),
        "out and back through three slabs, nothing else pinned:\n{}",
        a.output
    );
    assert_eq!(usage(&board, "a").staging_bytes, 192 * MIB);
    let err = stderr_of(a);
    assert_eq!(err.matches("went to host memory").count(), 1, "{err}");
}

/// The shared file is registered as far as the process's borrowed chunks need, and further as
/// it borrows more: a process that borrows little registers little.
#[test]
fn the_shared_file_is_registered_as_far_as_the_borrowed_chunks_need() {
    let shm = shm_dir();
    let _board = board_with_staging(
        shm.path(),
        200 * MIB,
        512 * MIB,
        &[("a", 4 * MIB, 200 * MIB)],
    );
    shared_staging_file(shm.path(), 512 * MIB);
    // Exactly as far as wanted: a correct want never registers a third slab, so the count
    // read right after the second is 2 (a want of the whole file would show more by then).
    let out = swapping(tenant(shm.path(), "a", "4MiB"))
        .run("alloc 4M alloc 8M until_host_allocs 1 alloc 64M until_host_allocs 2 host_allocs");
    assert!(
        out.ends_with("until_host_allocs 0\nalloc 0\nuntil_host_allocs 0\nhost_allocs 0 2 0\n"),
        "one slab for 8 MiB, a second for 64 MiB more, no more (of eight):\n{out}"
    );
}

/// A borrow that finds the room held by a process that died (SIGKILL, nothing reclaimed it yet:
/// no agent runs here) is granted at once: the borrower reclaims the dead slot before it refuses.
/// Before, its first attempt was refused (the error returned to the application, for a caching
/// allocator to retry), though the memory was free (found by the line simulation's kills).
#[test]
fn a_borrow_beside_a_dead_processs_memory_reclaims_it_instead_of_refusing() {
    let shm = shm_dir();
    let board = board(
        shm.path(),
        16 * MIB,
        &[("a", 4 * MIB, 12 * MIB), ("b", 4 * MIB, 12 * MIB)],
    );
    let mut a = swapping(tenant(shm.path(), "a", "4MiB")).hold("alloc 4M alloc 8M");
    assert_eq!(a.output, "alloc 0\nalloc 0\n", "a holds 12 of 16");
    a.child.kill().expect("kill");
    a.child.wait().expect("wait");
    // (Not sampled here: sampling the board, as the agent does, reclaims dead slots.)
    let (out, _) = run(
        swapping(tenant(shm.path(), "b", "4MiB")),
        "alloc 4M alloc 8M",
    );
    assert_eq!(
        out, "alloc 0\nalloc 0\n",
        "b's borrow granted at the first attempt"
    );
    assert_eq!(usage(&board, "a").resident_bytes, 0);
}
