//! Round trips through real files: the interposer's protocol writes (`writer`), the read-only
//! mapping reads.

use super::*;
use crate::layout::{ledger_path, schedule_path};
use crate::{DEVICES_MAX, writer};

/// A GPU of `capacity` whose share of the node's swap staging is half of it.
fn gpu(capacity: u64) -> crate::board::GpuSpec {
    crate::board::GpuSpec {
        capacity_bytes: capacity,
        staging_budget_bytes: capacity / 2,
    }
}

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn me() -> (u32, u64) {
    (std::process::id(), ledger::own_start_time())
}

#[test]
fn a_ledger_written_by_the_protocol_reads_back_per_device() {
    let directory = tempfile::tempdir().unwrap();
    let path = ledger_path(directory.path(), "train-a");
    assert_eq!(path, directory.path().join("train-a.mem"));
    let mut limits = [None; DEVICES_MAX];
    limits[0] = Some(10 * GIB);
    let mapping = writer::ledger(&path, &limits).unwrap();
    let (pid, start_time) = me();
    writer::charge_memory(&mapping, pid, start_time, 0, 3 * GIB).unwrap();
    // A process that no longer runs (pid 0x7fff_fff0 does not exist): not counted.
    writer::charge_memory(&mapping, 0x7fff_fff0, 1, 0, GIB).unwrap();
    let usage = read_ledger(&path).unwrap();
    assert_eq!(usage.limits_bytes[0], Some(10 * GIB));
    assert_eq!(usage.used_bytes(0), 3 * GIB);
    assert_eq!(usage.dead_slots, 1);
    assert_eq!(usage.processes.len(), 1);
    assert_eq!(usage.processes[0].pid, pid);
    // The reader wrote nothing: the dead slot is still there for the interposer to reclaim.
    assert_eq!(mapping.region().used_total(0), 4 * GIB);
}

#[test]
fn a_schedule_written_by_the_protocol_reads_back_per_tenant() {
    let directory = tempfile::tempdir().unwrap();
    let path = schedule_path(directory.path(), "GPU-1234");
    let mapping = writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let (pid, start_time) = me();
    writer::charge_time(
        &mapping,
        "train-a",
        pid,
        start_time,
        1_000_000,
        2_000_000_000,
    )
    .unwrap();
    let times = read_schedule(&path).unwrap();
    assert_eq!(
        times,
        [TenantTime {
            name: "train-a".into(),
            used_ns: 2_000_000_000,
            processes: 1,
        }]
    );
}

#[test]
fn missing_short_and_uninitialised_files_are_told_apart() {
    let directory = tempfile::tempdir().unwrap();
    let missing = read_ledger(&directory.path().join("nobody.mem")).unwrap_err();
    assert!(missing.is_not_found(), "{missing}");
    let short = directory.path().join("short.mem");
    std::fs::write(&short, [0u8; 100]).unwrap();
    let error = read_ledger(&short).unwrap_err();
    assert!(
        matches!(error, ReadError::Size { found: 100, .. }),
        "{error}"
    );
    assert!(!error.is_not_found());
    let zeroed = directory.path().join("zeroed.compute");
    std::fs::write(&zeroed, vec![0u8; compute::REGION_BYTES]).unwrap();
    let error = read_schedule(&zeroed).unwrap_err();
    assert!(matches!(error, ReadError::Uninitialised { .. }), "{error}");
}

#[test]
fn a_file_of_another_layout_version_is_refused() {
    let directory = tempfile::tempdir().unwrap();
    let path = ledger_path(directory.path(), "old");
    let mapping = writer::ledger(&path, &[None; DEVICES_MAX]).unwrap();
    mapping
        .region()
        .header
        .version
        .store(ledger::VERSION + 7, std::sync::atomic::Ordering::SeqCst);
    let error = read_ledger(&path).unwrap_err();
    assert!(matches!(error, ReadError::Layout { .. }), "{error}");
}

#[test]
fn a_created_schedule_is_initialised_and_an_existing_one_is_kept() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("GPU-1.compute");
    assert!(create_schedule(&path, 5_000_000).unwrap());
    assert!(read_schedule(&path).unwrap().is_empty());
    // A tenant's process uses it; creating again keeps the file (and its tenants).
    let mapping = writer::schedule(&path, compute::QUANTUM_NS_DEFAULT).unwrap();
    let (pid, start_time) = me();
    writer::charge_time(&mapping, "a", pid, start_time, 1_000, 7_000_000).unwrap();
    assert!(!create_schedule(&path, 5_000_000).unwrap());
    assert_eq!(read_schedule(&path).unwrap().len(), 1);
    let names: Vec<_> = std::fs::read_dir(directory.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["GPU-1.compute"], "no temporary file is left");
}

/// Issue 17: the agent creates a GPU's memory board once, fills it, and rewrites it as tenants
/// come and go; a reader sees the capacity and the tenants.
#[test]
fn a_board_is_created_once_and_rewritten_as_tenants_change() {
    use crate::board::TenantSpec;
    let directory = tempfile::tempdir().unwrap();
    let path = crate::layout::board_path(directory.path(), "GPU-1234");
    assert!(create_board(&path).unwrap());
    assert!(!create_board(&path).unwrap(), "an existing board is kept");
    let (capacity, holders) = read_board(&path).unwrap();
    assert_eq!(
        (capacity, holders.len()),
        (0, 0),
        "nothing lent before it is written"
    );
    let spec = |name: &str, request: u64, guaranteed: bool| TenantSpec {
        name: name.to_owned(),
        request_bytes: request,
        limit_bytes: request,
        priority: 0,
        guaranteed,
    };
    write_board(
        &path,
        gpu(78 * GIB),
        &[spec("a", 30 * GIB, true), spec("b", 20 * GIB, false)],
    )
    .unwrap();
    let (capacity, holders) = read_board(&path).unwrap();
    assert_eq!(capacity, 78 * GIB);
    {
        let mapping =
            open_writable::<crate::board::Region>(&path, crate::board::REGION_BYTES).unwrap();
        assert_eq!(mapping.region().staging_budget(), 39 * GIB);
    }
    let names: Vec<_> = holders
        .iter()
        .map(|h| (h.name.as_str(), h.request))
        .collect();
    assert_eq!(names, [("a", 30 * GIB), ("b", 20 * GIB)]);
    assert!(holders[0].guaranteed && !holders[1].guaranteed);
    // "a" left, "c" came, "b" grew.
    write_board(
        &path,
        gpu(78 * GIB),
        &[spec("b", 25 * GIB, false), spec("c", 10 * GIB, true)],
    )
    .unwrap();
    let (_, holders) = read_board(&path).unwrap();
    let mut names: Vec<_> = holders
        .iter()
        .map(|h| (h.name.clone(), h.request))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [("b".to_owned(), 25 * GIB), ("c".to_owned(), 10 * GIB)]
    );
    // A bad entry is refused with the file named; a file of another size is not a board.
    let bad = write_board(&path, gpu(GIB), &[spec(&"x".repeat(80), 1, true)]).unwrap_err();
    assert!(bad.to_string().contains("GPU-1234.memory"), "{bad}");
    let other = directory.path().join("other.memory");
    std::fs::write(&other, b"not a board").unwrap();
    assert!(matches!(
        write_board(&other, gpu(GIB), &[]),
        Err(BoardWriteError::Read(ReadError::Size { .. }))
    ));
}

/// Issue 17: the agent's sample of a board reclaims a dead process's slot before it reports, so a
/// process killed without freeing no longer holds memory on the board.
#[test]
fn sampling_a_board_reclaims_dead_processes_and_reports_each_tenant() {
    use crate::board::{Board, TenantSpec};
    let directory = tempfile::tempdir().unwrap();
    let path = crate::layout::board_path(directory.path(), "GPU-1234");
    create_board(&path).unwrap();
    let spec = TenantSpec {
        name: "a".to_owned(),
        request_bytes: 20 * GIB,
        limit_bytes: 60 * GIB,
        priority: 0,
        guaranteed: true,
    };
    write_board(&path, gpu(78 * GIB), &[spec]).unwrap();
    // A process that has exited: its pid no longer runs.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    {
        let mapping =
            open_writable::<crate::board::Region>(&path, crate::board::REGION_BYTES).unwrap();
        let region = mapping.region();
        let live = crate::ledger::test_liveness::Fake::with(&[dead_pid]);
        let board = Board::new(region, &live);
        let tenant = region.find("a").unwrap();
        let slot = board.claim_slot(dead_pid, 1, tenant).unwrap();
        board.reserve(slot, 25 * GIB).unwrap();
    }
    let (usage, reclaimed) = sample_board(&path).unwrap();
    assert_eq!(reclaimed, 1);
    assert_eq!(usage.len(), 1);
    assert_eq!(
        (
            usage[0].request_bytes,
            usage[0].limit_bytes,
            usage[0].resident_bytes
        ),
        (20 * GIB, 60 * GIB, 0)
    );
    let (_, again) = sample_board(&path).unwrap();
    assert_eq!(again, 0, "nothing left to reclaim");
}

#[test]
fn a_staging_file_of_another_layout_version_is_replaced() {
    let directory = tempfile::tempdir().unwrap();
    let path = crate::layout::staging_path(directory.path(), "GPU-1");
    assert!(create_staging(&path, 256 * MIB).unwrap());
    staging_table(&path).unwrap().region().version.store(
        crate::slabs::VERSION - 1,
        std::sync::atomic::Ordering::Release,
    );
    let error = create_staging(&path, 256 * MIB).unwrap_err();
    assert!(error.is_other_version(), "{error}");
    assert!(error.to_string().contains("upgrade"), "{error}");
}

#[test]
fn a_staging_file_is_made_once_per_budget_and_a_dead_owners_slabs_come_back() {
    let directory = tempfile::tempdir().unwrap();
    let path = crate::layout::staging_path(directory.path(), "GPU-1");
    let budget = 256 * MIB + 10 * MIB;
    assert!(create_staging(&path, budget).unwrap());
    let bytes = std::fs::metadata(&path).unwrap().len();
    assert_eq!(bytes, crate::slabs::SlabTable::data_offset() + 4 * 64 * MIB);
    assert_eq!(bytes, staging_file_bytes(budget));
    assert!(!create_staging(&path, budget).unwrap(), "there already");
    let other = create_staging(&path, 2 * budget).unwrap_err();
    assert!(other.is_other_version(), "{other}");
    let table = |path: &Path| staging_table(path).unwrap();
    assert!(
        !table(&path).region().is_allocated(),
        "not registered until allocated"
    );
    assert!(!staging_allocated(&path).unwrap());
    allocate_staging(&path).unwrap();
    assert!(table(&path).region().is_allocated());
    assert!(staging_allocated(&path).unwrap());

    // A slot of this process on the board, and slabs claimed by it and by a process that
    // never owned a slot.
    let board_path = crate::layout::board_path(directory.path(), "GPU-1");
    create_board(&board_path).unwrap();
    let gpu = board::GpuSpec {
        capacity_bytes: 10 * GIB,
        staging_budget_bytes: budget,
    };
    let spec = board::TenantSpec {
        name: "a".into(),
        request_bytes: GIB,
        limit_bytes: 2 * GIB,
        priority: 0,
        guaranteed: true,
    };
    write_board(&board_path, gpu, &[spec]).unwrap();
    let mapping = map::Mapping::<board::Region>::writable(
        &board_path,
        &std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&board_path)
            .unwrap(),
        board::REGION_BYTES,
    )
    .unwrap();
    let (pid, start_time) = me();
    let slot = board::Board::new(mapping.region(), crate::ProcLiveness)
        .claim_slot(pid, start_time, 0)
        .unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let table =
        map::Mapping::<crate::slabs::SlabTable>::writable_header(&path, &file, bytes).unwrap();
    let mine = crate::slabs::owner_token(slot, pid);
    let gone = crate::slabs::owner_token(slot + 1, pid);
    assert!(table.region().claim_run(mine, 2, usize::MAX).is_some());
    assert!(table.region().claim_run(gone, 1, usize::MAX).is_some());
    assert_eq!(reclaim_staging(&path, &board_path).unwrap(), 1);
    assert_eq!(table.region().owned_by(mine), 2);
    assert_eq!(table.region().free(), 2);
}
