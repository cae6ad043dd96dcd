use super::*;
use crate::assignments::{SliceAssignment, TenantAssignment};
use std::os::unix::process::CommandExt;
use std::process::Command;

const QUANTUM: u64 = tenant_abi::compute::QUANTUM_NS_DEFAULT;
/// Two unprivileged identities for the tenants (the usual `nobody`, and one below it).
const A: Identity = Identity {
    uid: 65534,
    gid: 65534,
};
const B: Identity = Identity {
    uid: 65533,
    gid: 65533,
};

fn set(tenants: &[(&str, &[&str])]) -> AssignmentSet {
    AssignmentSet {
        revision: 1,
        node_state: "ready".into(),
        tenants: tenants
            .iter()
            .map(|(name, gpus)| {
                let slices = gpus
                    .iter()
                    .enumerate()
                    .map(|(index, uuid)| SliceAssignment {
                        gpu_index: index as u32,
                        gpu_uuid: (*uuid).into(),
                        compute_percent: 50,
                        memory_bytes: 1 << 30,
                        guaranteed: true,
                        burst: false,
                        memory_limit_bytes: 0,
                    })
                    .collect();
                let assignment = TenantAssignment {
                    tenant: (*name).into(),
                    priority: 0,
                    slices,
                    bandwidth_weight: 0,
                    latency: false,
                    latency_target_us: None,
                };
                ((*name).to_owned(), assignment)
            })
            .collect(),
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

fn inode(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

fn is_root() -> bool {
    users::current().uid == 0
}

/// As root the tenants get their own users; otherwise everything stays the test's.
fn owners(tenant: &str) -> Identity {
    match (is_root(), tenant) {
        (false, _) => users::current(),
        (true, "a") => A,
        (true, _) => B,
    }
}

#[test]
fn each_tenant_gets_a_private_directory_with_links_to_exactly_its_shared_tables() {
    let shm = tempfile::tempdir().unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    // What an agent before private directories left behind.
    std::fs::create_dir_all(layout.root()).unwrap();
    std::fs::write(layout.root().join("a.mem"), b"old").unwrap();
    std::fs::write(layout.root().join("netshare"), b"old").unwrap();
    std::fs::write(layout.root().join("unrelated"), b"kept").unwrap();

    let first = set(&[("a", &["GPU-0", "GPU-1"]), ("b", &["GPU-1"])]);
    let prepared = prepare(&layout, &first, &owners, QUANTUM).unwrap();
    assert!(prepared.problems.is_empty(), "{:?}", prepared.problems);
    assert_eq!(prepared.created, ["a", "b"]);
    assert_eq!(prepared.old_files.len(), 2, "{:?}", prepared.old_files);
    assert!(layout.root().join("unrelated").exists());
    assert_eq!(mode(layout.root()), 0o711);
    assert_eq!(mode(&layout.root().join("tenants")), 0o711);
    assert_eq!(mode(&layout.root().join("gpus")), 0o700);
    assert_eq!(mode(&layout.root().join("node")), 0o700);
    for tenant in ["a", "b"] {
        let dir = layout.tenant_dir(tenant);
        assert_eq!(mode(&dir), 0o700);
        let metadata = std::fs::metadata(&dir).unwrap();
        let owner = owners(tenant);
        assert_eq!((metadata.uid(), metadata.gid()), (owner.uid, owner.gid));
        assert_eq!(
            inode(&layout.nccl_activity(tenant)),
            inode(&layout.root().join("node/nccl-activity"))
        );
    }
    let gpu1 = inode(&layout.schedule("GPU-1"));
    assert_eq!(
        inode(&tenant_abi::layout::schedule_path(
            &layout.tenant_dir("a"),
            "GPU-1"
        )),
        gpu1
    );
    assert_eq!(
        inode(&tenant_abi::layout::schedule_path(
            &layout.tenant_dir("b"),
            "GPU-1"
        )),
        gpu1
    );
    assert!(!tenant_abi::layout::schedule_path(&layout.tenant_dir("b"), "GPU-0").exists());
    // The schedules are ready for the interposer: initialised, nobody in them yet.
    assert!(
        tenant_abi::read_schedule(&layout.schedule("GPU-0"))
            .unwrap()
            .is_empty()
    );

    // Idempotent.
    let again = prepare(&layout, &first, &owners, QUANTUM).unwrap();
    assert!(
        again.created.is_empty()
            && again.removed.is_empty()
            && again.old_files.is_empty()
            && again.problems.is_empty(),
        "{again:?}"
    );

    // a leaves GPU-0, b is released.
    let second = set(&[("a", &["GPU-1"])]);
    let prepared = prepare(&layout, &second, &owners, QUANTUM).unwrap();
    assert_eq!(prepared.removed, ["b"]);
    assert!(!layout.tenant_dir("b").exists());
    assert!(!tenant_abi::layout::schedule_path(&layout.tenant_dir("a"), "GPU-0").exists());
    assert_eq!(
        inode(&tenant_abi::layout::schedule_path(
            &layout.tenant_dir("a"),
            "GPU-1"
        )),
        gpu1
    );
}

/// Tries to open `path` for reading and writing as `who`; the error kind when refused.
fn open_as(who: Identity, path: &Path) -> Result<(), String> {
    let output = Command::new("sh")
        .arg("-c")
        .arg("exec 3<>\"$1\"")
        .arg("sh")
        .arg(path)
        .uid(who.uid)
        .gid(who.gid)
        .output()
        .unwrap();
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

#[test]
fn another_tenant_or_user_cannot_reach_a_tenants_files() {
    if !is_root() {
        // Only root can run processes as other users; the modes are checked by the test above.
        eprintln!("SKIPPED the cross-user part: not running as root");
        return;
    }
    let shm = tempfile::tempdir().unwrap();
    // The temporary directory's parent must be searchable by the tenants' users.
    std::fs::set_permissions(shm.path(), Permissions::from_mode(0o755)).unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    let placed = set(&[("a", &["GPU-0"]), ("b", &["GPU-0", "GPU-1"])]);
    prepare(&layout, &placed, &owners, QUANTUM).unwrap();
    // The files a tenant's processes create and the agent writes.
    let ledger = layout.ledger("a");
    std::fs::write(&ledger, b"").unwrap();
    std::fs::set_permissions(&ledger, Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&ledger, Some(A.uid), Some(A.gid)).unwrap();
    std::fs::write(layout.netshare("a"), b"").unwrap();
    std::fs::set_permissions(layout.netshare("a"), Permissions::from_mode(0o666)).unwrap();

    // a reaches its own files and the schedule of its GPU.
    let own_schedule = tenant_abi::layout::schedule_path(&layout.tenant_dir("a"), "GPU-0");
    for path in [&ledger, &layout.netshare("a"), &own_schedule] {
        open_as(A, path).unwrap_or_else(|e| panic!("a cannot open {}: {e}", path.display()));
    }
    // b, and a user that is no tenant, reach none of a's files ...
    let stranger = Identity {
        uid: 65532,
        gid: 65532,
    };
    for who in [B, stranger] {
        for path in [&ledger, &layout.netshare("a"), &own_schedule] {
            let refused = open_as(who, path).expect_err("opened another tenant's file");
            assert!(refused.contains("Permission denied"), "{refused}");
        }
    }
    // ... nor the originals of the shared tables, nor a GPU schedule they are not placed on.
    for path in [
        layout.schedule("GPU-0"),
        layout.root().join("node/nccl-activity"),
    ] {
        assert!(open_as(stranger, &path).is_err());
    }
    assert!(open_as(A, &layout.schedule("GPU-1")).is_err());
    // Nobody but the agent can list who is placed here.
    let listing = Command::new("ls")
        .arg(layout.root().join("tenants"))
        .uid(A.uid)
        .gid(A.gid)
        .output()
        .unwrap();
    assert!(!listing.status.success());
}

#[test]
fn one_keeper_per_shared_memory_directory() {
    let directory = tempfile::tempdir().unwrap();
    let layout = Layout::new(&directory.path().join("shm"));
    claim_keeper(&layout, Keeper::Agent).unwrap();
    // The same keeper again (a restart) is fine; the other one is refused, and told what to do.
    claim_keeper(&layout, Keeper::Agent).unwrap();
    let error = claim_keeper(&layout, Keeper::KubernetesDriver).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("kept by vgpu-agent"), "{message}");
    assert!(message.contains("remove"), "{message}");
    // Handed over: the record removed, the driver keeps the directory from now on.
    std::fs::remove_file(layout.root().join(KEEPER_FILE)).unwrap();
    claim_keeper(&layout, Keeper::KubernetesDriver).unwrap();
    assert!(claim_keeper(&layout, Keeper::Agent).is_err());
    let names: Vec<String> = std::fs::read_dir(layout.root())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, [KEEPER_FILE], "no temporary file is left");
}

/// The staging budget in a board file's header (the word the interposers read).
fn staging_budget(board: &std::path::Path) -> u64 {
    use tenant_abi::board::{Header, Region};
    let at =
        std::mem::offset_of!(Region, header) + std::mem::offset_of!(Header, staging_budget_bytes);
    let bytes = std::fs::read(board).unwrap();
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Issue 17: every GPU of the node gets a memory board with its capacity and the tenants placed
/// on it, rewritten as they come and go.
#[test]
fn each_gpu_gets_a_memory_board_of_its_tenants() {
    let shm = tempfile::tempdir().unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    let gpus: std::collections::BTreeMap<String, u64> = [
        ("GPU-1".to_owned(), 80 << 30),
        ("GPU-2".to_owned(), 80 << 30),
    ]
    .into();
    let gpus = BoardGpus {
        memory_bytes: &gpus,
        swap_host_memory_bytes: 65 << 30,
        shared_staging: false,
    };
    let first = set(&[("a", &["GPU-1"]), ("b", &["GPU-1", "GPU-2"])]);
    prepare(&layout, &first, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &first, &gpus).is_empty());
    // The node's swap staging, split evenly: each board holds its GPU's share.
    for uuid in ["GPU-1", "GPU-2"] {
        assert_eq!(staging_budget(&layout.board(uuid)), (65 << 30) / 2);
    }
    let (capacity, holders) = tenant_abi::shm::read_board(&layout.board("GPU-1")).unwrap();
    assert_eq!(capacity, (80 << 30) - BOARD_RESERVE_BYTES);
    let names: Vec<_> = holders
        .iter()
        .map(|h| (h.name.as_str(), h.request))
        .collect();
    assert_eq!(names, [("a", 1 << 30), ("b", 1 << 30)]);
    let (_, holders) = tenant_abi::shm::read_board(&layout.board("GPU-2")).unwrap();
    assert_eq!(holders.len(), 1);
    // Each tenant reaches the boards of its GPUs, and only those, from its own directory.
    let inode = |path: &std::path::Path| std::fs::metadata(path).map(|m| m.ino()).ok();
    let board_link =
        |tenant: &str, uuid: &str| tenant_abi::layout::board_path(&layout.tenant_dir(tenant), uuid);
    assert_eq!(
        inode(&board_link("a", "GPU-1")),
        inode(&layout.board("GPU-1"))
    );
    assert_eq!(
        inode(&board_link("b", "GPU-2")),
        inode(&layout.board("GPU-2"))
    );
    assert_eq!(inode(&board_link("a", "GPU-2")), None);
    let second = set(&[("b", &["GPU-1"])]);
    prepare(&layout, &second, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &second, &gpus).is_empty());
    assert_eq!(
        inode(&board_link("b", "GPU-2")),
        None,
        "the board of a GPU the tenant left is unlinked"
    );
    assert_eq!(
        inode(&board_link("b", "GPU-1")),
        inode(&layout.board("GPU-1"))
    );
    let (_, holders) = tenant_abi::shm::read_board(&layout.board("GPU-1")).unwrap();
    assert_eq!(
        holders.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
    let (_, holders) = tenant_abi::shm::read_board(&layout.board("GPU-2")).unwrap();
    assert!(
        holders.is_empty(),
        "a GPU without tenants keeps an empty board"
    );
}

/// Issue 17: a slice's memory limit is the board entry's limit; a slice without one (0) has its
/// request as limit.
#[test]
fn a_board_entry_carries_the_slices_limit() {
    let shm = tempfile::tempdir().unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    let gpus: std::collections::BTreeMap<String, u64> = [("GPU-1".to_owned(), 80 << 30)].into();
    let gpus = BoardGpus {
        memory_bytes: &gpus,
        swap_host_memory_bytes: 0,
        shared_staging: false,
    };
    let mut placed = set(&[("a", &["GPU-1"]), ("b", &["GPU-1"])]);
    placed.tenants.get_mut("a").unwrap().slices[0].memory_limit_bytes = 60 << 30;
    prepare(&layout, &placed, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &placed, &gpus).is_empty());
    let (usage, _) = tenant_abi::shm::sample_board(&layout.board("GPU-1")).unwrap();
    let limits: Vec<_> = usage
        .iter()
        .map(|t| (t.name.as_str(), t.request_bytes, t.limit_bytes))
        .collect();
    assert_eq!(limits, [("a", 1 << 30, 60 << 30), ("b", 1 << 30, 1 << 30)]);
}

/// Issue 17: memory the GPU uses outside the board's accounting for longer than the settle time
/// lowers the board's capacity to the GPU's memory less that use and a margin (the monitor's
/// `BoardReserves`); a republish keeps the measured capacity; when the use goes, the capacity
/// comes back.
#[test]
fn a_boards_capacity_follows_the_memory_used_outside_it() {
    use crate::monitor::BoardReserves;
    use crate::reserve::{MARGIN_BYTES, SETTLE_NS};
    const GIB: u64 = 1 << 30;
    let shm = tempfile::tempdir().unwrap();
    let root = shm.path().join("vgpu");
    let layout = Layout::new(&root);
    let memory: std::collections::BTreeMap<String, u64> = [("GPU-1".to_owned(), 80 * GIB)].into();
    let gpus = BoardGpus {
        memory_bytes: &memory,
        swap_host_memory_bytes: 0,
        shared_staging: false,
    };
    let placed = set(&[("a", &["GPU-1"])]);
    prepare(&layout, &placed, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &placed, &gpus).is_empty());
    let capacity = || {
        tenant_abi::shm::board_counts(&layout.board("GPU-1"))
            .unwrap()
            .0
    };
    assert_eq!(capacity(), 80 * GIB - BOARD_RESERVE_BYTES);

    let mut reserves = BoardReserves::new(&root, memory.clone());
    let health = |used: u64| {
        let mut gpu = api::usage::empty_health("GPU-1", 0);
        gpu.memory_used_bytes = Some(used);
        vec![gpu]
    };
    // 5 GiB used outside the board (nothing is resident on it), sampled every second.
    for second in 0..=SETTLE_NS / 1_000_000_000 {
        let before = reserves.resident();
        assert_eq!(before.get("GPU-1"), Some(&0));
        reserves.apply(&health(5 * GIB), &before, second * 1_000_000_000);
    }
    assert_eq!(capacity(), 80 * GIB - 5 * GIB - MARGIN_BYTES);
    // The follower rewrites the board (a tenant came): the measured capacity stays.
    let more = set(&[("a", &["GPU-1"]), ("b", &["GPU-1"])]);
    prepare(&layout, &more, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &more, &gpus).is_empty());
    assert_eq!(capacity(), 80 * GIB - 5 * GIB - MARGIN_BYTES);
    // The outside use ends: the capacity comes back at the next sample.
    let before = reserves.resident();
    reserves.apply(&health(GIB), &before, 10 * 1_000_000_000);
    assert_eq!(capacity(), 80 * GIB - BOARD_RESERVE_BYTES);
}

/// A board file left by another vgpu version (another size) is replaced, not left to fail every
/// write until someone removes it.
#[test]
fn a_board_of_another_version_is_replaced() {
    let shm = tempfile::tempdir().unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    let memory: std::collections::BTreeMap<String, u64> = [("GPU-1".to_owned(), 80 << 30)].into();
    let gpus = BoardGpus {
        memory_bytes: &memory,
        swap_host_memory_bytes: 0,
        shared_staging: false,
    };
    let placed = set(&[("a", &["GPU-1"])]);
    prepare(&layout, &placed, &owners, QUANTUM).unwrap();
    std::fs::write(layout.board("GPU-1"), vec![0u8; 4096]).unwrap();
    assert!(publish_boards(&layout, &placed, &gpus).is_empty());
    let (capacity, holders) = tenant_abi::shm::read_board(&layout.board("GPU-1")).unwrap();
    assert_eq!(capacity, (80 << 30) - BOARD_RESERVE_BYTES);
    assert_eq!(holders.len(), 1);
}

/// Issue 17: with the shared staging on, each GPU gets one staging file for its share of the
/// node's budget, linked beside its board into the directories of the tenants on it, and
/// unlinked from a tenant that left the GPU.
#[test]
fn each_gpu_gets_a_shared_staging_file_linked_like_its_board() {
    let shm = tempfile::tempdir().unwrap();
    let layout = Layout::new(&shm.path().join("vgpu"));
    let memory: std::collections::BTreeMap<String, u64> = [
        ("GPU-1".to_owned(), 80 << 30),
        ("GPU-2".to_owned(), 80 << 30),
    ]
    .into();
    let gpus = BoardGpus {
        memory_bytes: &memory,
        swap_host_memory_bytes: 256 << 20,
        shared_staging: true,
    };
    let first = set(&[("a", &["GPU-1"]), ("b", &["GPU-1", "GPU-2"])]);
    prepare(&layout, &first, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &first, &gpus).is_empty());
    let inode = |path: &std::path::Path| std::fs::metadata(path).map(|m| m.ino()).ok();
    let staging_link = |tenant: &str, uuid: &str| {
        tenant_abi::layout::staging_path(&layout.tenant_dir(tenant), uuid)
    };
    for uuid in ["GPU-1", "GPU-2"] {
        // 128 MiB each: two slabs of 64 MiB after the table.
        assert_eq!(
            std::fs::metadata(layout.staging(uuid)).unwrap().len(),
            tenant_abi::shm::staging_file_bytes(128 << 20)
        );
    }
    assert_eq!(
        inode(&staging_link("a", "GPU-1")),
        inode(&layout.staging("GPU-1"))
    );
    assert_eq!(
        inode(&staging_link("b", "GPU-2")),
        inode(&layout.staging("GPU-2"))
    );
    assert_eq!(inode(&staging_link("a", "GPU-2")), None);
    let second = set(&[("b", &["GPU-1"])]);
    prepare(&layout, &second, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout, &second, &gpus).is_empty());
    assert_eq!(
        inode(&staging_link("b", "GPU-2")),
        None,
        "unlinked with the board"
    );
    // Turned off: the file and its links go (processes that mapped it keep it until they exit).
    let off = BoardGpus {
        shared_staging: false,
        ..gpus
    };
    assert!(publish_boards(&layout, &second, &off).is_empty());
    assert!(!layout.staging("GPU-1").exists());
    assert_eq!(inode(&staging_link("b", "GPU-1")), None);
    // A file an earlier agent left half allocated (it stopped during the allocation) is
    // allocated again: processes register only an allocated file.
    let shm3 = tempfile::tempdir().unwrap();
    let layout3 = Layout::new(&shm3.path().join("vgpu"));
    prepare(&layout3, &first, &owners, QUANTUM).unwrap();
    std::fs::create_dir_all(layout3.staging("GPU-1").parent().unwrap()).unwrap();
    assert!(tenant_abi::shm::create_staging(&layout3.staging("GPU-1"), 128 << 20).unwrap());
    assert!(!tenant_abi::shm::staging_allocated(&layout3.staging("GPU-1")).unwrap());
    assert!(publish_boards(&layout3, &first, &gpus).is_empty());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !tenant_abi::shm::staging_allocated(&layout3.staging("GPU-1")).unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the half-allocated staging file was not allocated again within 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Too small a budget for one slab: no file.
    let tiny = BoardGpus {
        swap_host_memory_bytes: 64 << 20,
        ..gpus
    };
    let shm2 = tempfile::tempdir().unwrap();
    let layout2 = Layout::new(&shm2.path().join("vgpu"));
    prepare(&layout2, &first, &owners, QUANTUM).unwrap();
    assert!(publish_boards(&layout2, &first, &tiny).is_empty());
    assert!(!layout2.staging("GPU-1").exists());
}
