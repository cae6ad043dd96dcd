//! Tests of the tenant environment and of reading a placement from the state directory.

use super::*;
use crate::assignments::{AssignmentSet, SliceAssignment};
use crate::reconcile::reconcile;
use crate::state::StateDir;

fn slice(gpu_index: u32, compute_percent: u32, memory_gib: u64) -> SliceAssignment {
    SliceAssignment {
        gpu_index,
        gpu_uuid: format!("GPU-{gpu_index}"),
        compute_percent,
        memory_bytes: memory_gib << 30,
        guaranteed: true,
        burst: true,
        memory_limit_bytes: 0,
    }
}

fn trainer() -> TenantAssignment {
    TenantAssignment {
        tenant: "trainer".into(),
        priority: 5,
        slices: vec![slice(2, 50, 10), slice(5, 30, 20)],
        bandwidth_weight: 0,
        latency: false,
        latency_target_us: None,
    }
}

fn config() -> EnvConfig {
    EnvConfig {
        interposer: Some(PathBuf::from("/opt/vgpu/libvgpu_cuda.so")),
        shm_dir: PathBuf::from("/dev/shm/vgpu"),
        state_dir: PathBuf::from("/var/lib/vgpu-agent/node-a"),
        mps_pipe_dir: None,
        mps_tenants: crate::mps::MpsTenants::default(),
    }
}

#[test]
fn the_environment_describes_the_slices_by_process_ordinal() {
    let environment = tenant_environment("node-a", &trainer(), &config(), None);
    let flow = crate::bandwidth::flow_id("trainer").0.to_string();
    let expected = [
        ("CUDA_VISIBLE_DEVICES", "GPU-2,GPU-5"),
        ("LD_PRELOAD", "/opt/vgpu/libvgpu_cuda.so"),
        ("VGPU_TENANT", "trainer"),
        ("VGPU_NODE", "node-a"),
        ("VGPU_MEMORY_LIMITS", "0:10737418240,1:21474836480"),
        ("VGPU_COMPUTE_SHARES", "0:50,1:30"),
        ("VGPU_PRIORITY", "5"),
        ("VGPU_BURST", "1"),
        ("VGPU_GUARANTEED", "1"),
        ("VGPU_SHM_DIR", "/dev/shm/vgpu/tenants/trainer"),
        ("VGPU_AGENT_STATE_DIR", "/var/lib/vgpu-agent/node-a"),
        ("VGPU_NCCL_WEIGHT", "80"),
        (
            "VGPU_NCCL_ACTIVITY_FILE",
            "/dev/shm/vgpu/tenants/trainer/nccl-activity",
        ),
        (
            "VGPU_NETSHARE_TABLE",
            "/dev/shm/vgpu/tenants/trainer/netshare",
        ),
        ("VGPU_NETSHARE_FLOW", &flow),
        // a fraction of a GPU: squeezable by the closed loop, on every node
        ("VGPU_SPATIAL", "1"),
        ("NCCL_HOSTID", "vgpu-node-a-trainer"),
        ("NCCL_NET", "vgpu"),
    ];
    let pairs: Vec<(&str, &str)> = environment
        .iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect();
    assert_eq!(pairs, expected);
}

#[test]
fn flags_hold_only_when_every_slice_has_them() {
    let mut tenant = trainer();
    tenant.slices[1].burst = false;
    tenant.slices[0].guaranteed = false;
    tenant.priority = -1;
    let environment = tenant_environment("node-a", &tenant, &config(), None);
    let get = |key: &str| {
        environment
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value.clone())
    };
    assert_eq!(get("VGPU_BURST").as_deref(), Some("0"));
    assert_eq!(get("VGPU_GUARANTEED").as_deref(), Some("0"));
    assert_eq!(get("VGPU_PRIORITY").as_deref(), Some("-1"));
    // Without an interposer there is no LD_PRELOAD at all.
    let bare = EnvConfig {
        interposer: None,
        ..config()
    };
    let environment = tenant_environment("node-a", &tenant, &bare, Some("/x.so"));
    assert!(environment.iter().all(|(key, _)| key != "LD_PRELOAD"));
}

#[test]
fn the_interposer_goes_before_an_inherited_preload_once() {
    let interposer = "/opt/vgpu/libvgpu_cuda.so";
    assert_eq!(ld_preload(interposer, None), interposer);
    assert_eq!(ld_preload(interposer, Some("  ")), interposer);
    assert_eq!(
        ld_preload(interposer, Some("/usr/lib/libjemalloc.so")),
        "/opt/vgpu/libvgpu_cuda.so:/usr/lib/libjemalloc.so"
    );
    assert_eq!(
        ld_preload(interposer, Some("/a.so /opt/vgpu/libvgpu_cuda.so")),
        "/a.so /opt/vgpu/libvgpu_cuda.so"
    );
}

#[test]
fn the_interposer_is_found_beside_the_binary_else_in_the_system_path() {
    let directory = tempfile::tempdir().unwrap();
    let binary = directory.path().join("vgpu-agent");
    assert_eq!(
        resolve_interposer(None, Some(&binary)),
        PathBuf::from(INTERPOSER_SYSTEM_PATH)
    );
    std::fs::write(directory.path().join(INTERPOSER_FILE), b"").unwrap();
    assert_eq!(
        resolve_interposer(None, Some(&binary)),
        directory.path().join(INTERPOSER_FILE)
    );
    assert_eq!(
        resolve_interposer(Some(Path::new("/x/y.so")), Some(&binary)),
        PathBuf::from("/x/y.so")
    );
    assert_eq!(
        resolve_interposer(None, None),
        PathBuf::from(INTERPOSER_SYSTEM_PATH)
    );
}

#[test]
fn shell_and_json_renderings_quote_values() {
    let environment = vec![
        ("A".to_owned(), "plain".to_owned()),
        ("B".to_owned(), "it's $HOME".to_owned()),
    ];
    assert_eq!(
        render_shell(&environment),
        "export A='plain'\nexport B='it'\\''s $HOME'\n"
    );
    let json: serde_json::Value = serde_json::from_str(&render_json(&environment)).unwrap();
    assert_eq!(json["B"], "it's $HOME");
}

fn persist(state: &StateDir, tenants: &[TenantAssignment]) {
    let new = AssignmentSet {
        revision: 7,
        node_state: "ready".into(),
        tenants: tenants
            .iter()
            .map(|tenant| (tenant.tenant.clone(), tenant.clone()))
            .collect(),
    };
    let old = state.load().unwrap();
    state.apply(&new, &reconcile(&old, &new)).unwrap();
}

#[test]
fn placements_are_read_from_the_state_directory() {
    let directory = tempfile::tempdir().unwrap();
    let state = StateDir::open(directory.path(), "node-a").unwrap();
    // Before the agent has received anything, nobody is placed.
    let error = load_placement(directory.path(), "trainer", "node-a").unwrap_err();
    assert_eq!(
        error.to_string(),
        "tenant trainer is not placed on this node (node-a); `vgpuctl describe tenant trainer` shows where it runs"
    );
    persist(&state, &[trainer()]);
    let placement = load_placement(directory.path(), "trainer", "ignored").unwrap();
    assert_eq!(placement.node, "node-a");
    assert_eq!(placement.revision, 7);
    assert_eq!(placement.assignment, trainer());
    // Another tenant: not here, and the message names the node from the state.
    let error = load_placement(directory.path(), "other", "hint").unwrap_err();
    assert!(matches!(error, Error::TenantNotPlaced { ref node, .. } if node == "node-a"));
    // A tenant file without its commit (a crash in between) is not a placement.
    std::fs::copy(
        state.tenant_path("trainer"),
        directory.path().join("tenants/ghost.json"),
    )
    .unwrap();
    assert!(matches!(
        load_placement(directory.path(), "ghost", "node-a"),
        Err(Error::TenantNotPlaced { .. })
    ));
    // Bad names and missing directories say so.
    assert!(matches!(
        load_placement(directory.path(), "../x", "node-a"),
        Err(Error::Name(_))
    ));
    let missing = directory.path().join("missing");
    let error = load_placement(&missing, "trainer", "node-a").unwrap_err();
    assert!(
        error.to_string().starts_with("no agent state in"),
        "{error}"
    );
}

#[test]
fn exec_refuses_a_tenant_that_is_not_here_and_a_missing_interposer() {
    let directory = tempfile::tempdir().unwrap();
    let state = StateDir::open(directory.path(), "node-a").unwrap();
    persist(&state, &[trainer()]);
    let config = |tenant: &str, interposer: &str| ExecConfig {
        state_dir: directory.path().to_owned(),
        node_hint: "node-a".into(),
        tenant: tenant.into(),
        interposer: Some(directory.path().join(interposer)),
        shm_dir: directory.path().join("shm"),
        mps_pipe_dir: None,
        mps_tenants: crate::mps::MpsTenants::default(),
        command: vec!["true".into()],
    };
    assert!(matches!(
        exec(config("elsewhere", "libvgpu_cuda.so")),
        Err(Error::TenantNotPlaced { .. })
    ));
    assert!(matches!(
        exec(config("trainer", "libvgpu_cuda.so")),
        Err(Error::InterposerMissing { .. })
    ));
    // The agent has not made the tenant's private directory yet.
    std::fs::write(directory.path().join("libvgpu_cuda.so"), b"").unwrap();
    let error = exec(config("trainer", "libvgpu_cuda.so")).unwrap_err();
    assert!(matches!(error, Error::TenantDirMissing { .. }), "{error}");
    let layout = crate::private::Layout::new(&directory.path().join("shm"));
    let set = state.load().unwrap();
    let prepared = crate::private::prepare(
        &layout,
        &set,
        &crate::private::agent_owner,
        tenant_abi::compute::QUANTUM_NS_DEFAULT,
    )
    .unwrap();
    assert_eq!(prepared.created, ["trainer"]);
    // A command that cannot be run comes back as an error (a successful exec would not return).
    let mut missing_program = config("trainer", "libvgpu_cuda.so");
    missing_program.command = vec!["/nonexistent/program".into()];
    let error = exec(missing_program).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("cannot run `/nonexistent/program`"),
        "{error}"
    );
}

#[test]
fn nccl_settings_follow_the_slices_and_the_installed_plugin() {
    let get = |environment: &[(String, String)], key: &str| {
        environment
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value.clone())
    };
    // A tenant of whole GPUs keeps NCCL's own host identity and network choice.
    let whole = TenantAssignment {
        tenant: "big".into(),
        priority: 0,
        slices: vec![slice(0, 100, 80), slice(1, 100, 80)],
        bandwidth_weight: 0,
        latency: false,
        latency_target_us: None,
    };
    let environment = tenant_environment("node-a", &whole, &config(), None);
    assert_eq!(get(&environment, "NCCL_HOSTID"), None);
    assert_eq!(get(&environment, "NCCL_NET"), None);
    assert_eq!(
        get(&environment, "VGPU_NCCL_WEIGHT").as_deref(),
        Some("200")
    );
    // No plugin beside the interposer: no plugin variables.
    assert_eq!(get(&environment, "NCCL_NET_PLUGIN"), None);

    // With the plugin installed beside the interposer, both plugin variables name it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(INTERPOSER_FILE), b"").unwrap();
    std::fs::write(dir.path().join(NCCL_PLUGIN_FILE), b"").unwrap();
    let installed = EnvConfig {
        interposer: Some(dir.path().join(INTERPOSER_FILE)),
        ..config()
    };
    let environment = tenant_environment("node-a", &whole, &installed, None);
    let plugin = dir
        .path()
        .join(NCCL_PLUGIN_FILE)
        .to_string_lossy()
        .into_owned();
    assert_eq!(get(&environment, "NCCL_NET_PLUGIN"), Some(plugin.clone()));
    assert_eq!(get(&environment, "NCCL_TUNER_PLUGIN"), Some(plugin.clone()));
    // whole GPUs: NCCL's own identities, no env plugin
    assert_eq!(get(&environment, "NCCL_ENV_PLUGIN"), None);
    // Two tenants on one GPU get different host identities.
    let a = TenantAssignment {
        tenant: "a".into(),
        priority: 0,
        slices: vec![slice(3, 50, 10)],
        bandwidth_weight: 0,
        latency: false,
        latency_target_us: None,
    };
    let b = TenantAssignment {
        tenant: "b".into(),
        priority: 0,
        slices: vec![slice(3, 25, 10)],
        bandwidth_weight: 0,
        latency: false,
        latency_target_us: None,
    };
    let id = |t: &TenantAssignment| {
        get(
            &tenant_environment("node-a", t, &config(), None),
            "NCCL_HOSTID",
        )
    };
    assert_ne!(id(&a), id(&b));
    // a fractional tenant's ranks on one GPU get identities of their own from the env plugin
    let environment = tenant_environment("node-a", &a, &installed, None);
    assert_eq!(get(&environment, "NCCL_ENV_PLUGIN"), Some(plugin));
    assert_eq!(
        get(&environment, "NCCL_HOSTID").as_deref(),
        Some("vgpu-node-a-a")
    );
    assert_eq!(
        get(
            &tenant_environment("node-a", &b, &config(), None),
            "VGPU_NCCL_WEIGHT"
        )
        .as_deref(),
        Some("25")
    );
    // A weight given at placement wins over the derived one.
    let c = TenantAssignment {
        bandwidth_weight: 75,
        ..b
    };
    assert_eq!(
        get(
            &tenant_environment("node-a", &c, &config(), None),
            "VGPU_NCCL_WEIGHT"
        )
        .as_deref(),
        Some("75")
    );
}

#[test]
fn exec_runs_as_the_owner_of_the_tenants_directory() {
    use std::os::unix::fs::MetadataExt;
    let directory = tempfile::tempdir().unwrap();
    let layout = crate::private::Layout::new(directory.path());
    let dir = layout.tenant_dir("trainer");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(layout.nccl_activity("trainer"), b"").unwrap();
    // Owned by the caller: no switch.
    assert_eq!(tenant_user(directory.path(), "trainer").unwrap(), None);
    let me = crate::users::current();
    if me.uid != 0 {
        eprintln!("SKIPPED the switch to another user: not running as root");
        return;
    }
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 65534);
    assert_eq!(
        tenant_user(directory.path(), "trainer").unwrap(),
        Some(crate::users::Identity {
            uid: 65534,
            gid: 65534
        })
    );
    let error = tenant_user(directory.path(), "nobody-here").unwrap_err();
    assert!(matches!(error, Error::TenantDirMissing { .. }), "{error}");
}

#[test]
fn an_mps_node_gives_the_pipes_to_best_effort_tenants_and_spatial_roles_to_sharing_and_latency_tenants()
 {
    let mps = EnvConfig {
        mps_pipe_dir: Some(PathBuf::from("/dev/shm/vgpu/mps")),
        ..config()
    };
    let get = |assignment: &TenantAssignment, key: &str| {
        tenant_environment("node-a", assignment, &mps, None)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value)
    };
    // A trainer with fractions of two GPUs: squeezable, not a latency tenant.
    let trainer = trainer();
    assert_eq!(
        get(&trainer, "CUDA_MPS_PIPE_DIRECTORY").as_deref(),
        Some("/dev/shm/vgpu/mps")
    );
    assert_eq!(get(&trainer, "VGPU_SPATIAL").as_deref(), Some("1"));
    assert_eq!(get(&trainer, "VGPU_LATENCY"), None);
    // A latency tenant.
    let mut serving = trainer.clone();
    serving.latency = true;
    assert_eq!(get(&serving, "VGPU_SPATIAL").as_deref(), Some("1"));
    assert_eq!(get(&serving, "VGPU_LATENCY").as_deref(), Some("1"));
    // It keeps a context of its own (fault-isolated from the MPS clients), unless the node lets
    // every tenant join (`mps_tenants = "all"`).
    assert_eq!(get(&serving, "CUDA_MPS_PIPE_DIRECTORY"), None);
    let all = EnvConfig {
        mps_tenants: crate::mps::MpsTenants::All,
        ..mps.clone()
    };
    let pipes = |assignment: &TenantAssignment, config: &EnvConfig| {
        tenant_environment("node-a", assignment, config, None)
            .into_iter()
            .any(|(k, _)| k == "CUDA_MPS_PIPE_DIRECTORY")
    };
    assert!(pipes(&serving, &all));
    // A guaranteed tenant that does not burst is a client (its ranks on one GPU run at once).
    let mut steady = trainer.clone();
    for slice in &mut steady.slices {
        slice.burst = false;
    }
    assert!(pipes(&steady, &mps));
    assert!(pipes(&steady, &all));
    // A tenant with whole GPUs shares none: pipes only.
    let mut whole = trainer.clone();
    for slice in &mut whole.slices {
        slice.compute_percent = 100;
    }
    assert!(get(&whole, "CUDA_MPS_PIPE_DIRECTORY").is_some());
    assert_eq!(get(&whole, "VGPU_SPATIAL"), None);
    // Without MPS the roles are the same (the closed loop pauses and bounds queues there; only
    // the SM lever needs MPS), and there are no pipes.
    let plain = tenant_environment("node-a", &serving, &config(), None);
    let get_plain = |key: &str| {
        plain
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value.as_str())
    };
    assert_eq!(get_plain("VGPU_SPATIAL"), Some("1"));
    assert_eq!(get_plain("VGPU_LATENCY"), Some("1"));
    assert!(
        plain.iter().all(|(k, _)| !k.starts_with("CUDA_MPS")),
        "{plain:?}"
    );
}

#[test]
fn a_latency_tenant_on_an_mps_node_gets_its_latency_target() {
    let mps = EnvConfig {
        mps_pipe_dir: Some(PathBuf::from("/dev/shm/vgpu/mps")),
        ..config()
    };
    let get = |assignment: &TenantAssignment, config: &EnvConfig| {
        tenant_environment("node-a", assignment, config, None)
            .into_iter()
            .find(|(k, _)| k == "VGPU_LATENCY_TARGET_US")
            .map(|(_, value)| value)
    };
    let mut serving = trainer();
    serving.latency = true;
    serving.latency_target_us = Some(2_000);
    assert_eq!(get(&serving, &mps).as_deref(), Some("2000"));
    let environment = tenant_environment("node-a", &serving, &mps, None);
    let lookup = |name: &str| {
        environment
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let spatial = tenant_abi::SpatialEnv::from_lookup(lookup)
        .unwrap()
        .unwrap();
    assert_eq!(spatial.latency_target_us, Some(2_000));
    // No target given: none set (the controller derives one).
    serving.latency_target_us = None;
    assert_eq!(get(&serving, &mps), None);
}

/// What the agent writes is what the tenant side reads: the interposer's memory, compute and
/// spatial views and the NCCL plugin's tuner and token-bucket views, each through its own parser
/// in `tenant_abi`.
#[test]
fn the_tenant_side_reads_what_the_agent_writes() {
    let mut tenant = trainer();
    tenant.slices[0].guaranteed = false;
    tenant.latency = true;
    let mps = EnvConfig {
        mps_pipe_dir: Some(PathBuf::from("/dev/shm/vgpu/mps")),
        ..config()
    };
    let environment = tenant_environment("node-a", &tenant, &mps, None);
    let get = |name: &str| {
        environment
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let private = PathBuf::from("/dev/shm/vgpu/tenants/trainer");
    let memory = tenant_abi::MemoryEnv::from_lookup(get).unwrap().unwrap();
    assert_eq!(memory.tenant, "trainer");
    assert_eq!(
        memory.limits_bytes[..3],
        [Some(10 << 30), Some(20 << 30), None]
    );
    assert_eq!(memory.ledger_path(), private.join("trainer.mem"));
    let compute = tenant_abi::ComputeEnv::from_lookup(get).unwrap().unwrap();
    assert_eq!(compute.percent[..3], [Some(50), Some(30), None]);
    assert_eq!(
        (compute.burst, compute.guaranteed, compute.priority),
        (true, false, 5)
    );
    assert_eq!(compute.shm_dir, private);
    let spatial = tenant_abi::SpatialEnv::from_lookup(get).unwrap().unwrap();
    assert!(spatial.latency);
    let nccl = tenant_abi::NcclEnv::from_lookup(get).unwrap().unwrap();
    assert_eq!(
        (nccl.weight, nccl.guaranteed),
        (u64::from(crate::bandwidth::weight(&tenant)), false)
    );
    assert_eq!(nccl.activity_file, private.join("nccl-activity"));
    let netshare = tenant_abi::NetshareEnv::from_lookup(get).unwrap().unwrap();
    assert_eq!(netshare.table, private.join("netshare"));
    assert_eq!(netshare.flow, crate::bandwidth::flow_id("trainer").0);
    // And the whole contract reads back as one value.
    let whole = tenant_abi::TenantEnv::from_lookup(get).unwrap().unwrap();
    assert_eq!((whole.node.as_str(), whole.spatial), ("node-a", true));
}
