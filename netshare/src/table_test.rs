//! The bucket table on real mapped files: slot life, ownership, reopening, and concurrent use by
//! threads and by processes (one of them killed with SIGKILL mid-consume).

use super::*;
use crate::bucket::BucketConfig;
use crate::shm::monotonic_now_ns;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SECOND_NS: u64 = 1_000_000_000;

fn table_path(directory: &tempfile::TempDir) -> PathBuf {
    directory.path().join("vgpu").join("netshare.test-node")
}

/// Waits (bounded) until `condition` holds; progress is asserted by waiting, never by sleeping.
fn wait_until(what: &str, timeout_ns: u64, mut condition: impl FnMut() -> bool) {
    let deadline = monotonic_now_ns() + timeout_ns;
    while !condition() {
        assert!(
            monotonic_now_ns() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn slots_are_assigned_reconfigured_and_freed() {
    let directory = tempfile::tempdir().unwrap();
    let path = table_path(&directory);
    let owner = TableOwner::open_or_create(&path).unwrap();
    let plugin = Table::open(&path).unwrap();
    assert!(plugin.bucket(FlowId(7)).is_none());

    let config = BucketConfig {
        rate_bytes_per_second: 1_000_000,
        burst_bytes: 1_000,
    };
    owner.set_rate(FlowId(7), config).unwrap();
    let bucket = plugin.bucket(FlowId(7)).unwrap();
    let now = 10 * SECOND_NS;
    assert_eq!(bucket.try_consume(1_000, now), Admission::Admitted);
    assert_eq!(
        bucket.try_consume(1_000, now),
        Admission::WaitFor(Duration::from_millis(1))
    );
    assert_eq!(
        plugin.stats(FlowId(7)).unwrap(),
        BucketStats {
            config,
            admitted_bytes: 1_000,
            throttled_count: 1,
        }
    );

    // A rate change keeps the debt (1 ms) and applies to the next request: at 10 MB/s, 1 kB
    // costs 100 µs, and the burst is 100 µs, so the wait is 1 ms.
    let faster = BucketConfig {
        rate_bytes_per_second: 10_000_000,
        burst_bytes: 1_000,
    };
    owner.set_rate(FlowId(7), faster).unwrap();
    assert_eq!(plugin.flows(), vec![FlowId(7)]);
    assert_eq!(
        bucket.try_consume(1_000, now),
        Admission::WaitFor(Duration::from_millis(1))
    );
    assert_eq!(
        bucket.try_consume(1_000, now + 1_000_000),
        Admission::Admitted
    );

    assert!(owner.clear(FlowId(7)));
    assert!(!owner.clear(FlowId(7)));
    assert_eq!(bucket.try_consume(1, now), Admission::Gone);
    assert!(plugin.bucket(FlowId(7)).is_none());
    // The freed slot is reused with a fresh bucket and fresh counters; the old handle stays gone.
    owner.set_rate(FlowId(8), config).unwrap();
    assert_eq!(bucket.try_consume(1, now), Admission::Gone);
    let reused = plugin.bucket(FlowId(8)).unwrap();
    assert_eq!(reused.stats().admitted_bytes, 0);
    assert_eq!(reused.try_consume(1_000, now), Admission::Admitted);

    assert!(matches!(
        owner.set_rate(FlowId(0), config),
        Err(Error::ReservedFlowId)
    ));
    let bad = BucketConfig {
        rate_bytes_per_second: 1,
        burst_bytes: 0,
    };
    assert!(matches!(
        owner.set_rate(FlowId(9), bad),
        Err(Error::InvalidBurst(0))
    ));
}

#[test]
fn the_table_holds_slots_flows_and_no_more() {
    let directory = tempfile::tempdir().unwrap();
    let owner = TableOwner::open_or_create(&table_path(&directory)).unwrap();
    let config = BucketConfig::for_rate(1_000);
    for flow in 1..=SLOTS as u64 {
        owner.set_rate(FlowId(flow), config).unwrap();
    }
    assert!(matches!(
        owner.set_rate(FlowId(SLOTS as u64 + 1), config),
        Err(Error::Full(_))
    ));
    assert!(owner.clear(FlowId(3)));
    owner.set_rate(FlowId(SLOTS as u64 + 1), config).unwrap();
    assert_eq!(owner.table().flows().len(), SLOTS);
}

#[test]
fn one_agent_owns_a_table_and_a_restarted_one_keeps_its_buckets() {
    let directory = tempfile::tempdir().unwrap();
    let path = table_path(&directory);
    let owner = TableOwner::open_or_create(&path).unwrap();
    owner
        .set_rate(FlowId(5), BucketConfig::for_rate(123))
        .unwrap();
    assert!(matches!(
        TableOwner::open_or_create(&path),
        Err(Error::Busy { .. })
    ));
    let plugin = Table::open(&path).unwrap();
    drop(owner);

    let restarted = TableOwner::open_or_create(&path).unwrap();
    assert_eq!(restarted.table().flows(), vec![FlowId(5)]);
    // The plugin's mapping is the same file, so it sees the restarted agent's changes.
    restarted
        .set_rate(FlowId(5), BucketConfig::for_rate(456))
        .unwrap();
    assert_eq!(
        plugin
            .stats(FlowId(5))
            .unwrap()
            .config
            .rate_bytes_per_second,
        456
    );
}

#[test]
fn plugins_refuse_a_missing_or_foreign_file_and_the_agent_replaces_it() {
    let directory = tempfile::tempdir().unwrap();
    let path = table_path(&directory);
    assert!(matches!(Table::open(&path), Err(Error::Io { .. })));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, vec![0xAB; REGION_BYTES]).unwrap();
    assert!(matches!(Table::open(&path), Err(Error::BadLayout { .. })));
    std::fs::write(&path, b"short").unwrap();
    assert!(matches!(Table::open(&path), Err(Error::Io { .. })));

    let owner = TableOwner::open_or_create(&path).unwrap();
    assert!(owner.table().flows().is_empty());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, FILE_MODE);
    Table::open(&path).unwrap();
}

#[test]
fn threads_sharing_a_mapped_bucket_never_exceed_rate_times_time_plus_burst() {
    let directory = tempfile::tempdir().unwrap();
    let path = table_path(&directory);
    let owner = TableOwner::open_or_create(&path).unwrap();
    let config = BucketConfig {
        rate_bytes_per_second: 200_000_000,
        burst_bytes: 1 << 20,
    };
    owner.set_rate(FlowId(1), config).unwrap();
    let threads = 4;
    let duration_ns = 400_000_000;

    let start = monotonic_now_ns();
    let results: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let path = &path;
                scope.spawn(move || {
                    // Each thread maps the file itself, as separate plugin instances would.
                    let table = Table::open(path).unwrap();
                    let bucket = table.bucket(FlowId(1)).unwrap();
                    let mut size = 4096 + thread * 7919;
                    let (mut admitted, mut last_ns) = (0u64, 0u64);
                    loop {
                        let now = monotonic_now_ns();
                        if now >= start + duration_ns {
                            return (admitted, last_ns);
                        }
                        match bucket.try_consume(size, now) {
                            Admission::Admitted => {
                                admitted += size;
                                last_ns = now;
                                size = 4096 + (size * 31 + 17) % (256 << 10);
                            }
                            Admission::WaitFor(wait) => {
                                std::thread::sleep(wait.min(Duration::from_micros(500)))
                            }
                            Admission::Gone => panic!("the bucket vanished"),
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted: u64 = results.iter().map(|r| r.0).sum();
    let last_ns = results.iter().map(|r| r.1).max().unwrap();
    let allowed = u128::from(last_ns - start) * u128::from(config.rate_bytes_per_second)
        / u128::from(SECOND_NS)
        + u128::from(config.burst_bytes);
    eprintln!("{threads} threads: {admitted} bytes admitted, {allowed} allowed");
    assert!(u128::from(admitted) <= allowed, "{admitted} > {allowed}");
    assert_eq!(
        owner.table().stats(FlowId(1)).unwrap().admitted_bytes,
        admitted
    );
    // Lenient lower bound (the machine is shared): four polling threads get a good part of the rate.
    let expected = duration_ns * config.rate_bytes_per_second / SECOND_NS;
    assert!(
        admitted >= expected / 4,
        "{admitted} < a quarter of {expected}"
    );
}

/// The environment variable that turns `child_consumer` into a real consumer.
const CHILD_TABLE: &str = "NETSHARE_TEST_CHILD_TABLE";
const CHILD_DURATION_NS: &str = "NETSHARE_TEST_CHILD_DURATION_NS";
const CHILD_FLOW: u64 = 42;
const CHILD_READY: &str = "netshare-child-ready";

/// Not a test on its own: when `multi_process_*` spawns this test binary with `CHILD_TABLE` set,
/// this consumes from the shared bucket for a while and prints what it got. Without it, it
/// returns at once.
#[test]
fn child_consumer() {
    let Ok(path) = std::env::var(CHILD_TABLE) else {
        return;
    };
    let duration_ns: u64 = std::env::var(CHILD_DURATION_NS).unwrap().parse().unwrap();
    let table = Table::open(Path::new(&path)).unwrap();
    let bucket = table.bucket(FlowId(CHILD_FLOW)).unwrap();
    // The harness has printed "test ... " without a newline, so the marker ends a line.
    println!("{CHILD_READY}");
    let start = monotonic_now_ns();
    let mut admitted = 0u64;
    let mut size = 65_536u64;
    while monotonic_now_ns() < start + duration_ns {
        match bucket.try_consume(size, monotonic_now_ns()) {
            Admission::Admitted => {
                admitted += size;
                size = 4096 + (size * 31 + 17) % (256 << 10);
            }
            Admission::WaitFor(wait) => std::thread::sleep(wait.min(Duration::from_micros(500))),
            Admission::Gone => panic!("the bucket vanished"),
        }
    }
    println!("admitted {admitted}");
}

fn spawn_child(path: &Path, duration_ns: u64) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "table::table_test::child_consumer",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_TABLE, path)
        .env(CHILD_DURATION_NS, duration_ns.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // Skip the harness's output up to our marker.
    let mut ready = false;
    while !ready {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            break;
        }
        ready = line.trim_end().ends_with(CHILD_READY);
    }
    if !ready {
        let status = child.wait().unwrap();
        panic!("the child exited before it was ready: {status}");
    }
    (child, stdout)
}

#[test]
fn multi_process_consumers_survive_a_sigkilled_peer() {
    let directory = tempfile::tempdir().unwrap();
    let path = table_path(&directory);
    let owner = TableOwner::open_or_create(&path).unwrap();
    let config = BucketConfig {
        rate_bytes_per_second: 100_000_000,
        burst_bytes: 1 << 20,
    };
    owner.set_rate(FlowId(CHILD_FLOW), config).unwrap();
    let stats = || owner.table().stats(FlowId(CHILD_FLOW)).unwrap();

    let start = monotonic_now_ns();
    let duration_ns = 1_500_000_000;
    let mut children: Vec<_> = (0..3).map(|_| spawn_child(&path, duration_ns)).collect();

    // Kill one child while all of them are hammering the bucket.
    wait_until("consumption to start", 10 * SECOND_NS, || {
        stats().admitted_bytes > 10 << 20
    });
    let (mut victim, _) = children.remove(0);
    victim.kill().unwrap(); // SIGKILL on Unix.
    let status = victim.wait().unwrap();
    assert!(!status.success());
    let killed_at = monotonic_now_ns();
    let admitted_at_kill = stats().admitted_bytes;

    // The survivors keep going and finish normally.
    let mut survivors_admitted = 0u64;
    for (mut child, stdout) in children {
        let mut report = None;
        for line in stdout.lines() {
            if let Some(bytes) = line.unwrap().strip_prefix("admitted ") {
                report = Some(bytes.trim().parse::<u64>().unwrap());
            }
        }
        assert!(child.wait().unwrap().success());
        survivors_admitted += report.expect("a survivor reports what it got");
    }
    let end = monotonic_now_ns();
    let total = stats().admitted_bytes;
    assert!(survivors_admitted <= total);

    let allowed = u128::from(end - start) * u128::from(config.rate_bytes_per_second)
        / u128::from(SECOND_NS)
        + u128::from(config.burst_bytes);
    eprintln!(
        "3 processes, one killed: {total} bytes admitted ({after_kill} after the kill), {allowed} allowed",
        after_kill = total - admitted_at_kill
    );
    assert!(u128::from(total) <= allowed, "{total} > {allowed}");
    // After the kill the bucket was neither locked nor corrupted: the survivors got a good part
    // of the rate (leniently, on a shared machine).
    let after_kill = total - admitted_at_kill;
    let possible = (end - killed_at) * config.rate_bytes_per_second / SECOND_NS;
    assert!(
        after_kill >= possible / 4,
        "{after_kill} bytes after the kill, {possible} possible"
    );
    // And the parent can still use the bucket.
    let bucket = owner.table().bucket(FlowId(CHILD_FLOW)).unwrap();
    wait_until("the parent to be admitted", 10 * SECOND_NS, || {
        bucket.try_consume(4096, monotonic_now_ns()) == Admission::Admitted
    });
}
