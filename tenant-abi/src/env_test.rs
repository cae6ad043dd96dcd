//! The environment's parsers: each view alone, bad input, and the round trip of what the agent
//! writes through what the tenant side reads.

use super::*;
use std::collections::HashMap;

fn config(vars: &[(&str, &str)]) -> Result<Option<MemoryEnv>, EnvError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    MemoryEnv::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn no_tenant_means_pass_through() {
    assert_eq!(config(&[("VGPU_MEMORY_LIMIT", "1GiB")]), Ok(None));
    assert_eq!(config(&[("VGPU_TENANT", " ")]), Ok(None));
}

#[test]
fn per_device_limits_override_the_global_one() {
    let c = config(&[
        ("VGPU_TENANT", "a"),
        ("VGPU_MEMORY_LIMIT", "10GiB"),
        ("VGPU_MEMORY_LIMITS", "1:2GiB, 3:512MiB"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(c.limits_bytes[0], Some(10 << 30));
    assert_eq!(c.limits_bytes[1], Some(2 << 30));
    assert_eq!(c.limits_bytes[3], Some(512 << 20));
    assert_eq!(c.shm_dir, PathBuf::from(SHM_DIR_DEFAULT));
    assert_eq!(c.ledger_path(), PathBuf::from("/dev/shm/vgpu/a.mem"));
    assert_eq!(
        c.context_overhead_bytes,
        [CONTEXT_OVERHEAD_DEFAULT_BYTES; DEVICES_MAX]
    );
}

#[test]
fn context_overhead_is_one_size_or_per_device() {
    let overheads = |value: &str| {
        config(&[("VGPU_TENANT", "a"), ("VGPU_CONTEXT_OVERHEAD", value)])
            .map(|c| c.expect("a tenant").context_overhead_bytes)
    };
    assert_eq!(overheads("0"), Ok([0; DEVICES_MAX]));
    assert_eq!(overheads("512MiB"), Ok([512 << 20; DEVICES_MAX]));
    let listed = overheads("1:0, 3:1GiB").unwrap();
    assert_eq!(listed[0], CONTEXT_OVERHEAD_DEFAULT_BYTES);
    assert_eq!((listed[1], listed[3]), (0, 1 << 30));
    for bad in ["16:1GiB", "x:1GiB", "0:lots", "1GiB,2"] {
        let err = overheads(bad).unwrap_err();
        assert!(err.0.starts_with("VGPU_CONTEXT_OVERHEAD: "), "{err}");
    }
}

#[test]
fn only_listed_devices_are_limited() {
    let c = config(&[("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "1:1GiB")])
        .unwrap()
        .unwrap();
    assert_eq!(c.limits_bytes[0], None);
    assert_eq!(c.limits_bytes[1], Some(1 << 30));
}

fn compute(vars: &[(&str, &str)]) -> Result<Option<ComputeEnv>, EnvError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    ComputeEnv::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn compute_shares_and_flags_are_read() {
    assert_eq!(compute(&[("VGPU_COMPUTE_SHARES", "0:50")]), Ok(None));
    assert_eq!(compute(&[("VGPU_TENANT", "a")]), Ok(None));
    assert_eq!(
        compute(&[("VGPU_TENANT", "a"), ("VGPU_COMPUTE_SHARES", "0:0")]),
        Ok(None)
    );
    let c = compute(&[
        ("VGPU_TENANT", "a"),
        ("VGPU_COMPUTE_SHARES", "0:70, 2:30%"),
        ("VGPU_BURST", "1"),
        ("VGPU_PRIORITY", "-5"),
        ("VGPU_SHM_DIR", "/tmp/x"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(c.percent[0], Some(70));
    assert_eq!(c.percent[1], None);
    assert_eq!(c.percent[2], Some(30));
    assert!(c.burst && c.guaranteed);
    assert_eq!((c.priority, c.quantum_ms), (-5, 20));
    assert_eq!(c.shm_dir, PathBuf::from("/tmp/x"));
    for vars in [
        vec![("VGPU_COMPUTE_SHARES", "0:101")],
        vec![("VGPU_COMPUTE_SHARES", "16:10")],
        vec![("VGPU_COMPUTE_SHARES", "0=10")],
        vec![("VGPU_COMPUTE_SHARES", "0:10"), ("VGPU_BURST", "yes")],
        vec![("VGPU_COMPUTE_SHARES", "0:10"), ("VGPU_PRIORITY", "5000")],
        vec![
            ("VGPU_COMPUTE_SHARES", "0:10"),
            ("VGPU_COMPUTE_QUANTUM_MS", "0"),
        ],
    ] {
        let mut vars = vars;
        vars.push(("VGPU_TENANT", "a"));
        let err = compute(&vars).unwrap_err();
        assert!(err.0.starts_with("VGPU_"), "{err}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    for vars in [
        vec![("VGPU_TENANT", "../etc")],
        vec![("VGPU_TENANT", "A")],
        vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "0=1GiB")],
        vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "16:1GiB")],
        vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "x:1GiB")],
        vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMIT", "lots")],
        vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "0:0")],
        vec![("VGPU_TENANT", "a"), ("VGPU_CONTEXT_OVERHEAD", "1QB")],
    ] {
        let err = config(&vars).unwrap_err();
        assert!(err.0.starts_with("VGPU_"), "{err}");
    }
}

fn spatial(vars: &[(&str, &str)]) -> Result<Option<SpatialEnv>, EnvError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    SpatialEnv::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn spatial_mode_is_opt_in_and_validated() {
    assert_eq!(spatial(&[("VGPU_SPATIAL", "1")]), Ok(None));
    assert_eq!(spatial(&[("VGPU_TENANT", "a")]), Ok(None));
    assert_eq!(
        spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "0")]),
        Ok(None)
    );
    let c = spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "1")])
        .unwrap()
        .unwrap();
    assert!(!c.latency);
    assert_eq!((c.hold_ms, c.sms), (50, None));
    let c = spatial(&[
        ("VGPU_TENANT", "a"),
        ("VGPU_SPATIAL", "1"),
        ("VGPU_LATENCY", "1"),
        ("VGPU_SPATIAL_HOLD_MS", "20"),
        ("VGPU_SPATIAL_SMS", "96"),
    ])
    .unwrap()
    .unwrap();
    assert!(c.latency);
    assert_eq!((c.hold_ms, c.sms), (20, Some(96)));
    for bad in [
        ("VGPU_SPATIAL_HOLD_MS", "0"),
        ("VGPU_SPATIAL_HOLD_MS", "x"),
        ("VGPU_SPATIAL_SMS", "0"),
        ("VGPU_LATENCY", "yes"),
    ] {
        let err = spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "1"), bad]).unwrap_err();
        assert!(err.0.starts_with(bad.0), "{err}");
    }
}

fn lookup(environment: &[(String, String)]) -> impl Fn(&str) -> Option<String> + '_ {
    |name| {
        environment
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    }
}

fn example() -> TenantEnv {
    let mut memory_limits_bytes = [None; DEVICES_MAX];
    memory_limits_bytes[0] = Some(10 << 30);
    memory_limits_bytes[1] = Some(20 << 30);
    let mut compute_pct = [None; DEVICES_MAX];
    compute_pct[0] = Some(50);
    compute_pct[1] = Some(30);
    TenantEnv {
        tenant: "trainer".to_owned(),
        node: "node-a".to_owned(),
        shm_dir: PathBuf::from("/dev/shm/vgpu/tenants/trainer"),
        agent_state_dir: PathBuf::from("/var/lib/vgpu-agent/node-a"),
        memory_limits_bytes,
        compute_pct,
        priority: -5,
        burst: true,
        guaranteed: false,
        nccl_weight: 80,
        nccl_activity_file: PathBuf::from("/dev/shm/vgpu/tenants/trainer/nccl-activity"),
        netshare: NetshareEnv {
            table: PathBuf::from("/dev/shm/vgpu/tenants/trainer/netshare"),
            flow: 42,
        },
        spatial: true,
        latency: true,
        latency_target_us: Some(2_000),
    }
}

#[test]
fn what_the_agent_writes_reads_back_whole() {
    let written = example();
    let environment = written.to_env();
    assert_eq!(
        TenantEnv::from_lookup(lookup(&environment)),
        Ok(Some(written.clone()))
    );
    let plain = TenantEnv {
        spatial: false,
        latency: false,
        latency_target_us: None,
        guaranteed: true,
        burst: false,
        ..written
    };
    let environment = plain.to_env();
    assert!(
        environment
            .iter()
            .all(|(key, _)| key != var::SPATIAL && key != var::LATENCY)
    );
    assert_eq!(
        TenantEnv::from_lookup(lookup(&environment)),
        Ok(Some(plain))
    );
}

#[test]
fn every_view_reads_what_the_agent_wrote() {
    let written = example();
    let environment = written.to_env();
    let get = lookup(&environment);
    let memory = MemoryEnv::from_lookup(&get).unwrap().unwrap();
    assert_eq!(memory.tenant, written.tenant);
    assert_eq!(memory.limits_bytes, written.memory_limits_bytes);
    assert_eq!(memory.shm_dir, written.shm_dir);
    assert_eq!(memory.ledger_path(), written.shm_dir.join("trainer.mem"));
    let compute = ComputeEnv::from_lookup(&get).unwrap().unwrap();
    assert_eq!(compute.percent, written.compute_pct);
    assert_eq!(
        (compute.burst, compute.guaranteed, compute.priority),
        (written.burst, written.guaranteed, written.priority)
    );
    let spatial = SpatialEnv::from_lookup(&get).unwrap().unwrap();
    assert!(spatial.latency);
    assert_eq!(spatial.latency_target_us, Some(2_000));
    let nccl = NcclEnv::from_lookup(&get).unwrap().unwrap();
    assert_eq!(
        (nccl.weight, nccl.guaranteed, &nccl.activity_file),
        (
            written.nccl_weight,
            written.guaranteed,
            &written.nccl_activity_file
        )
    );
    assert_eq!(
        NetshareEnv::from_lookup(&get),
        Ok(Some(written.netshare.clone()))
    );
}

#[test]
fn readers_agree_on_flags_and_on_pass_through() {
    // `false` was false to the interposer and true to the NCCL tuner before they shared a parser.
    let environment = [
        ("VGPU_TENANT", "a"),
        ("VGPU_COMPUTE_SHARES", "0:50"),
        ("VGPU_GUARANTEED", "false"),
        ("VGPU_NCCL_WEIGHT", "10"),
        ("VGPU_NCCL_ACTIVITY_FILE", "/tmp/activity"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let get = lookup(&environment);
    assert!(!ComputeEnv::from_lookup(&get).unwrap().unwrap().guaranteed);
    assert!(!NcclEnv::from_lookup(&get).unwrap().unwrap().guaranteed);
    // An empty tenant is pass-through to every reader.
    let environment = [
        ("VGPU_TENANT", " "),
        ("VGPU_COMPUTE_SHARES", "0:50"),
        ("VGPU_SPATIAL", "1"),
        ("VGPU_NCCL_WEIGHT", "10"),
        ("VGPU_NCCL_ACTIVITY_FILE", "/tmp/activity"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let get = lookup(&environment);
    assert_eq!(MemoryEnv::from_lookup(&get), Ok(None));
    assert_eq!(ComputeEnv::from_lookup(&get), Ok(None));
    assert_eq!(SpatialEnv::from_lookup(&get), Ok(None));
    assert_eq!(NcclEnv::from_lookup(&get), Ok(None));
    assert_eq!(TenantEnv::from_lookup(&get), Ok(None));
    // A bad flag is an error to every reader, never a silent default.
    let environment = [
        ("VGPU_TENANT", "a"),
        ("VGPU_COMPUTE_SHARES", "0:50"),
        ("VGPU_GUARANTEED", "maybe"),
        ("VGPU_NCCL_WEIGHT", "10"),
        ("VGPU_NCCL_ACTIVITY_FILE", "/tmp/activity"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let get = lookup(&environment);
    assert!(
        ComputeEnv::from_lookup(&get)
            .unwrap_err()
            .0
            .starts_with("VGPU_GUARANTEED")
    );
    assert!(
        NcclEnv::from_lookup(&get)
            .unwrap_err()
            .0
            .starts_with("VGPU_GUARANTEED")
    );
}

#[test]
fn the_activity_file_keeps_its_old_name_for_a_release() {
    let old = [
        ("VGPU_TENANT", "a"),
        ("VGPU_NCCL_WEIGHT", "10"),
        ("VGPU_NCCL_SHARE_FILE", "/tmp/old"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let nccl = NcclEnv::from_lookup(lookup(&old)).unwrap().unwrap();
    assert_eq!(nccl.activity_file, PathBuf::from("/tmp/old"));
    let both = [
        ("VGPU_TENANT", "a"),
        ("VGPU_NCCL_WEIGHT", "10"),
        ("VGPU_NCCL_SHARE_FILE", "/tmp/old"),
        ("VGPU_NCCL_ACTIVITY_FILE", "/tmp/new"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let nccl = NcclEnv::from_lookup(lookup(&both)).unwrap().unwrap();
    assert_eq!(nccl.activity_file, PathBuf::from("/tmp/new"));
}

#[test]
fn the_strict_reader_names_what_is_missing_or_bad() {
    let mut environment = example().to_env();
    environment.retain(|(key, _)| key != var::NODE);
    let error = TenantEnv::from_lookup(lookup(&environment)).unwrap_err();
    assert!(error.0.starts_with("VGPU_NODE"), "{error}");
    for (key, bad) in [
        (var::NCCL_WEIGHT, "0"),
        (var::NETSHARE_FLOW, "0"),
        (var::PRIORITY, "5000"),
        (var::MEMORY_LIMITS, "0:lots"),
    ] {
        let mut environment = example().to_env();
        for (k, v) in environment.iter_mut() {
            if k == key {
                *v = bad.to_owned();
            }
        }
        let error = TenantEnv::from_lookup(lookup(&environment)).unwrap_err();
        assert!(error.0.starts_with(key), "{key}={bad}: {error}");
    }
}

proptest::proptest! {
    #[test]
    fn any_agent_decision_round_trips(
        limits in proptest::collection::vec(proptest::option::of(1u64..(1 << 50)), 1..=DEVICES_MAX),
        percents in proptest::collection::vec(proptest::option::of(1u32..=100), 1..=DEVICES_MAX),
        priority in PRIORITY_MIN..=PRIORITY_MAX,
        weight in 1..=NCCL_WEIGHT_MAX,
        flow in 1u64..,
        flags in 0u8..16,
    ) {
        let mut written = example();
        written.memory_limits_bytes = [None; DEVICES_MAX];
        written.memory_limits_bytes[..limits.len()].copy_from_slice(&limits);
        written.compute_pct = [None; DEVICES_MAX];
        written.compute_pct[..percents.len()].copy_from_slice(&percents);
        written.priority = priority;
        written.nccl_weight = weight;
        written.netshare.flow = flow;
        written.burst = flags & 1 != 0;
        written.guaranteed = flags & 2 != 0;
        written.spatial = flags & 4 != 0;
        written.latency = written.spatial && flags & 8 != 0;
        written.latency_target_us = if written.latency { Some(2_000) } else { None };
        let environment = written.to_env();
        proptest::prop_assert_eq!(TenantEnv::from_lookup(lookup(&environment)), Ok(Some(written)));
    }
}
