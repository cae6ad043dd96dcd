//! Tests of `driver`: prepare and unprepare on real files, the checkpoint across reopening.

use super::*;
use crate::claim::AllocatedDevice;
use vgpu_agent::InventorySource;

struct Node {
    _root: tempfile::TempDir,
    config: DriverConfig,
    inventory: Inventory,
}

fn node() -> Node {
    let root = tempfile::tempdir().unwrap();
    let config = DriverConfig {
        node: "node-a".into(),
        state_dir: root.path().join("state"),
        cdi: CdiConfig {
            dir: root.path().join("cdi"),
            interposer: root.path().join("lib/libvgpu_cuda.so"),
            shm_dir: root.path().join("shm"),
            state_dir: root.path().join("state"),
            mps_pipe_dir: None,
            mps_tenants: Default::default(),
        },
        quantum_ns: tenant_abi::compute::QUANTUM_NS_DEFAULT,
        stage: crate::driver::Stage::Node,
    };
    let inventory = InventorySource::from_simulate_arg("2xH100-80GB")
        .unwrap()
        .discover("node-a")
        .unwrap();
    Node {
        _root: root,
        config,
        inventory,
    }
}

fn allocation(name: &str, uid: &str, compute: &str) -> Allocation {
    Allocation {
        claim: ClaimRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: uid.into(),
        },
        devices: vec![AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: "gpu-1".into(),
            consumed: BTreeMap::from([
                ("memory".into(), "20Gi".into()),
                ("compute".into(), compute.into()),
            ]),
        }],
    }
}

const UID_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const UID_B: &str = "bbbbbbbb-0000-4000-8000-000000000002";

fn read_spec(node: &Node, uid: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(spec_path(&node.config.cdi.dir, uid)).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_prepared_claim_is_a_tenant_with_a_cdi_device() {
    let node = node();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    let prepared = driver.prepare(&allocation("train", UID_A, "25")).unwrap();
    assert_eq!(prepared.assignment.tenant, "train-aaaaaaaa");
    assert_eq!(
        prepared.devices[0].cdi_device_ids,
        ["vgpu.dev/claim=train-aaaaaaaa"]
    );
    let spec = read_spec(&node, UID_A);
    // Simulated GPUs' devices carry an annotation, which needs CDI 0.6.0.
    assert_eq!(spec["cdiVersion"], "0.6.0");
    assert_eq!(spec["kind"], "vgpu.dev/claim");
    let device = &spec["devices"][0];
    assert_eq!(device["name"], "train-aaaaaaaa");
    // The environment is the one `vgpu-agent exec` builds for the same tenant.
    let exec_env: Vec<String> = vgpu_agent::tenant::tenant_environment(
        "node-a",
        &prepared.assignment,
        &vgpu_agent::tenant::EnvConfig {
            interposer: Some(vgpu_agent::cdi::CONTAINER_INTERPOSER_PATH.into()),
            shm_dir: node.config.cdi.shm_dir.clone(),
            state_dir: node.config.state_dir.clone(),
            mps_pipe_dir: None,
            mps_tenants: Default::default(),
        },
        None,
    )
    .into_iter()
    .map(|(key, value)| format!("{key}={value}"))
    .collect();
    let spec_env: Vec<String> =
        serde_json::from_value(device["containerEdits"]["env"].clone()).unwrap();
    let mut expected = exec_env;
    expected.extend(toolkit_environment(&prepared.assignment));
    assert_eq!(spec_env, expected);
    assert!(spec_env.contains(&format!(
        "NVIDIA_VISIBLE_DEVICES={}",
        node.inventory.gpus[1].uuid
    )));
    assert!(spec_env.contains(&"VGPU_COMPUTE_SHARES=0:25".to_owned()));
    assert!(spec_env.contains(&format!("VGPU_MEMORY_LIMITS=0:{}", 20u64 << 30)));
    // The tenant's private directory exists, with its GPU's schedule linked in.
    let layout = Layout::new(&node.config.cdi.shm_dir);
    assert!(private::is_prepared(&layout, "train-aaaaaaaa"));
    let schedule = layout
        .tenant_dir("train-aaaaaaaa")
        .join(format!("{}.compute", node.inventory.gpus[1].uuid));
    assert!(schedule.exists(), "{}", schedule.display());
}

#[test]
fn real_gpus_get_the_oldest_cdi_version_and_the_nccl_plugin_when_installed() {
    let mut node = node();
    node.inventory.simulated = false;
    let libraries = node.config.cdi.interposer.parent().unwrap().to_owned();
    std::fs::create_dir_all(&libraries).unwrap();
    std::fs::write(&node.config.cdi.interposer, b"").unwrap();
    std::fs::write(libraries.join("libvgpu_nccl.so"), b"").unwrap();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    driver.prepare(&allocation("train", UID_A, "25")).unwrap();
    let spec = read_spec(&node, UID_A);
    assert_eq!(spec["cdiVersion"], "0.5.0");
    let device = &spec["devices"][0];
    assert!(device.get("annotations").is_none());
    let mounts = device["containerEdits"]["mounts"].as_array().unwrap();
    assert_eq!(mounts[1]["containerPath"], "/usr/lib/vgpu/libvgpu_nccl.so");
    assert_eq!(
        mounts[1]["hostPath"],
        libraries.join("libvgpu_nccl.so").to_str().unwrap()
    );
    let env: Vec<String> = serde_json::from_value(device["containerEdits"]["env"].clone()).unwrap();
    assert!(env.contains(&"NCCL_NET_PLUGIN=/usr/lib/vgpu/libvgpu_nccl.so".to_owned()));
    // A fraction of a GPU: the plugin's env part too, and the slice's own NCCL host identity.
    assert!(env.contains(&"NCCL_ENV_PLUGIN=/usr/lib/vgpu/libvgpu_nccl.so".to_owned()));
    assert!(env.contains(&"NCCL_HOSTID=vgpu-node-a-train-aaaaaaaa".to_owned()));
}

/// The CDI format's rules (CDI's SPEC.md) that a runtime checks when it loads the spec: only
/// known fields, a `vendor/class` kind of DNS and label characters, device names that begin and
/// end with a letter or digit, absolute paths, `KEY=VALUE` environment entries.
fn assert_cdi_format(spec: &serde_json::Value) {
    let keys = |value: &serde_json::Value, allowed: &[&str]| {
        for key in value.as_object().unwrap().keys() {
            assert!(allowed.contains(&key.as_str()), "unknown CDI field {key}");
        }
    };
    keys(spec, &["cdiVersion", "kind", "devices", "containerEdits"]);
    let (vendor, class) = spec["kind"].as_str().unwrap().split_once('/').unwrap();
    assert!(vendor.split('.').all(|label| {
        !label.is_empty() && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    }));
    assert!(class.len() <= 63 && class.chars().all(|c| c.is_ascii_alphanumeric()));
    let devices = spec["devices"].as_array().unwrap();
    assert!(!devices.is_empty());
    for device in devices {
        keys(device, &["name", "annotations", "containerEdits"]);
        let name = device["name"].as_str().unwrap();
        assert!(name.starts_with(|c: char| c.is_ascii_alphanumeric()));
        assert!(name.ends_with(|c: char| c.is_ascii_alphanumeric()));
        let edits = &device["containerEdits"];
        keys(edits, &["env", "deviceNodes", "mounts", "hooks"]);
        for entry in edits["env"].as_array().unwrap() {
            let (key, _) = entry.as_str().unwrap().split_once('=').unwrap();
            assert!(!key.is_empty());
        }
        for node in edits["deviceNodes"].as_array().unwrap() {
            keys(
                node,
                &["path", "hostPath", "type", "major", "minor", "permissions"],
            );
            assert!(node["path"].as_str().unwrap().starts_with("/dev/"));
        }
        for mount in edits["mounts"].as_array().unwrap() {
            keys(mount, &["hostPath", "containerPath", "options", "type"]);
            assert!(mount["hostPath"].as_str().unwrap().starts_with('/'));
            assert!(mount["containerPath"].as_str().unwrap().starts_with('/'));
        }
    }
}

#[test]
fn the_claims_cdi_spec_keeps_the_cdi_format() {
    let node = node();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    driver
        .prepare(&allocation("Train_Job.1", UID_A, "25"))
        .unwrap();
    assert_cdi_format(&read_spec(&node, UID_A));
}

#[test]
fn prepare_and_unprepare_are_idempotent() {
    let node = node();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    let first = driver.prepare(&allocation("train", UID_A, "25")).unwrap();
    // The same claim again (even if the apiserver now said otherwise) is what was prepared.
    let again = driver.prepare(&allocation("train", UID_A, "50")).unwrap();
    assert_eq!(first, again);
    driver.prepare(&allocation("infer", UID_B, "50")).unwrap();
    assert_eq!(driver.checkpoint().claims.len(), 2);

    driver.unprepare(UID_A).unwrap();
    driver.unprepare(UID_A).unwrap();
    assert!(!spec_path(&node.config.cdi.dir, UID_A).exists());
    let layout = Layout::new(&node.config.cdi.shm_dir);
    assert!(!layout.tenant_dir("train-aaaaaaaa").exists());
    assert!(private::is_prepared(&layout, "infer-bbbbbbbb"));
    assert!(spec_path(&node.config.cdi.dir, UID_B).exists());
    driver
        .unprepare("cccccccc-0000-4000-8000-000000000003")
        .unwrap();
}

#[test]
fn the_checkpoint_is_the_truth_after_a_restart() {
    let node = node();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    let prepared = driver.prepare(&allocation("train", UID_A, "25")).unwrap();
    drop(driver);
    // A crash left a spec and a directory of a claim that never reached the checkpoint, and the
    // prepared claim's spec was lost.
    let stray = spec_path(&node.config.cdi.dir, UID_B);
    std::fs::copy(spec_path(&node.config.cdi.dir, UID_A), &stray).unwrap();
    std::fs::remove_file(spec_path(&node.config.cdi.dir, UID_A)).unwrap();
    let layout = Layout::new(&node.config.cdi.shm_dir);
    std::fs::create_dir_all(layout.tenant_dir("infer-bbbbbbbb")).unwrap();

    let driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    assert_eq!(driver.prepared(UID_A), Some(&prepared));
    assert!(spec_path(&node.config.cdi.dir, UID_A).exists());
    assert!(!stray.exists());
    assert!(!layout.tenant_dir("infer-bbbbbbbb").exists());
    assert!(private::is_prepared(&layout, "train-aaaaaaaa"));
}

#[test]
fn the_driver_does_not_start_where_the_agent_keeps_the_tenants() {
    let node = node();
    let layout = Layout::new(&node.config.cdi.shm_dir);
    private::claim_keeper(&layout, private::Keeper::Agent).unwrap();
    std::fs::create_dir_all(layout.tenant_dir("placed-by-vgpuctl")).unwrap();
    let error = Driver::open(node.config.clone(), node.inventory.clone()).unwrap_err();
    assert!(error.to_string().contains("never both"), "{error}");
    assert!(layout.tenant_dir("placed-by-vgpuctl").exists());
}

#[test]
fn a_damaged_checkpoint_says_what_to_do() {
    let node = node();
    std::fs::create_dir_all(&node.config.state_dir).unwrap();
    std::fs::write(node.config.state_dir.join(CHECKPOINT_FILE), b"{not json").unwrap();
    let error = Driver::open(node.config.clone(), node.inventory.clone()).unwrap_err();
    assert!(error.to_string().contains("move it away"), "{error}");
}

/// The second stage: the driver keeps no private directory and records no keeper (the agent
/// keeps them); a claim noted as being placed is the tenant an unprepare releases, and after a
/// reopen too; recording it writes the CDI spec from the tenant the agent wrote.
#[test]
fn in_the_second_stage_the_agent_keeps_the_directories() {
    let mut node = node();
    node.config.stage = Stage::ControlPlane;
    let layout = Layout::new(&node.config.cdi.shm_dir);
    // The agent keeps the node's tenants: the second stage's driver starts beside it.
    private::claim_keeper(&layout, private::Keeper::Agent).unwrap();
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    let train = allocation("train", UID_A, "25");
    let planned = driver.plan(&train).unwrap();
    assert_eq!(driver.tenant_of(UID_A), None);
    driver.begin_placing(&train.claim).unwrap();
    assert_eq!(driver.tenant_of(UID_A).as_deref(), Some("train-aaaaaaaa"));
    assert!(driver.prepared(UID_A).is_none());
    let mut driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    assert_eq!(driver.tenant_of(UID_A).as_deref(), Some("train-aaaaaaaa"));

    let prepared = driver.record(&train, planned.clone()).unwrap();
    assert_eq!(prepared.assignment, planned);
    assert!(driver.checkpoint().placing.is_empty());
    assert_eq!(
        read_spec(&node, UID_A)["devices"][0]["name"],
        "train-aaaaaaaa"
    );
    assert!(
        !private::is_prepared(&layout, "train-aaaaaaaa"),
        "the agent makes the directory, not the driver"
    );
    // Recorded again (two pods of the claim): as it was.
    assert_eq!(driver.record(&train, planned).unwrap(), prepared);

    driver.unprepare(UID_A).unwrap();
    assert_eq!(driver.tenant_of(UID_A), None);
    assert!(!spec_path(&node.config.cdi.dir, UID_A).exists());
    // A claim only noted is forgotten by unprepare too.
    driver
        .begin_placing(&allocation("eval", UID_B, "10").claim)
        .unwrap();
    driver.unprepare(UID_B).unwrap();
    assert_eq!(driver.checkpoint().placing.len(), 0);
}

#[test]
fn a_pin_request_is_the_claims_slices_owned_by_the_claim() {
    let node = node();
    let driver = Driver::open(node.config.clone(), node.inventory.clone()).unwrap();
    let train = allocation("train", UID_A, "25");
    let planned = driver.plan(&train).unwrap();
    let request = crate::pool::pin_request("node-a", &train.claim, &planned);
    assert_eq!(request.name, "train-aaaaaaaa");
    let placement = request.request.unwrap();
    assert_eq!(placement.owner, "k8s:ml/train");
    let pin = placement.pin.clone().unwrap();
    assert_eq!(pin.node, "node-a");
    assert_eq!(pin.gpus.len(), 1);
    assert_eq!(pin.gpus[0].uuid, node.inventory.gpus[1].uuid);
    assert_eq!(pin.gpus[0].compute_percent, 25);
    assert_eq!(pin.gpus[0].memory_bytes, 20 << 30);
    // What the control plane admits.
    api::validate::admit_request(&placement).unwrap();
    api::validate::admit_claim_tenant(&request.name, &placement).unwrap();
}
