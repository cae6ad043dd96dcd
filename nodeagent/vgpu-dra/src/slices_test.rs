//! Tests of `slices`: the slice of an inventory, NVLink islands, PCIe roots, and the plan.

use super::*;
use vgpu_agent::InventorySource;

fn two_islands() -> Inventory {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../vgpu-agent/examples/two-islands-8xH100.toml"
    );
    InventorySource::from_simulate_arg(path)
        .unwrap()
        .discover("node-a")
        .unwrap()
}

#[test]
fn every_gpu_is_a_shareable_device_with_its_facts() {
    let inventory = two_islands();
    let facts = NodeFacts {
        pcie_roots: BTreeMap::from([(0, "pci0000:16".to_owned())]),
        unhealthy: BTreeMap::from([(3, "XID 79: fell off the bus".to_owned())]),
    };
    let slice = resource_slice(&inventory, &facts, 4);
    assert_eq!(slice.metadata.name.as_deref(), Some("node-a-vgpu.dev"));
    assert_eq!(slice.spec.driver, "vgpu.dev");
    assert_eq!(slice.spec.node_name.as_deref(), Some("node-a"));
    assert_eq!(slice.spec.pool.name, "node-a");
    assert_eq!(slice.spec.pool.generation, 4);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    let devices = slice.spec.devices.as_ref().unwrap();
    assert_eq!(devices.len(), inventory.gpus.len());
    let first = &devices[0];
    let gpu = &inventory.gpus[0];
    assert_eq!(first.name, "gpu-0");
    assert_eq!(first.allow_multiple_allocations, Some(true));
    let attributes = first.attributes.as_ref().unwrap();
    assert_eq!(
        attributes["uuid"].string.as_deref(),
        Some(gpu.uuid.as_str())
    );
    assert_eq!(
        attributes["model"].string.as_deref(),
        Some(gpu.model.as_str())
    );
    assert_eq!(attributes["smCount"].int, Some(i64::from(gpu.sm_count)));
    assert_eq!(attributes["memoryBytes"].int, Some(gpu.memory_bytes as i64));
    assert_eq!(
        attributes[PCIE_ROOT_ATTRIBUTE].string.as_deref(),
        Some("pci0000:16")
    );
    assert!(
        devices[1]
            .attributes
            .as_ref()
            .unwrap()
            .get(PCIE_ROOT_ATTRIBUTE)
            .is_none()
    );
    let capacity = first.capacity.as_ref().unwrap();
    assert_eq!(capacity["memory"].value.0, gpu.memory_bytes.to_string());
    assert_eq!(capacity["compute"].value.0, "100");
    assert!(capacity.values().all(|c| c.request_policy.is_none()));
    // Only the failing GPU is tainted, with a label-safe reason.
    let tainted: Vec<&str> = devices
        .iter()
        .filter(|device| device.taints.is_some())
        .map(|device| device.name.as_str())
        .collect();
    assert_eq!(tainted, ["gpu-3"]);
    let taint = &devices[3].taints.as_ref().unwrap()[0];
    assert_eq!(taint.key, UNHEALTHY_TAINT);
    assert_eq!(taint.effect, "NoSchedule");
    assert_eq!(taint.value.as_deref(), Some("XID-79--fell-off-the-bus"));
}

#[test]
fn nvlink_islands_are_named_by_their_lowest_gpu() {
    let inventory = two_islands();
    let islands = nvlink_islands(&inventory);
    let values: Vec<u32> = islands.values().copied().collect();
    assert_eq!(values, [0, 0, 0, 0, 4, 4, 4, 4]);
    let mut alone = inventory.clone();
    for gpu in &mut alone.gpus {
        gpu.nvlink_peers.clear();
    }
    let values: Vec<u32> = nvlink_islands(&alone).values().copied().collect();
    assert_eq!(values, [0, 1, 2, 3, 4, 5, 6, 7]);
}

#[test]
fn pcie_roots_come_from_the_sysfs_path() {
    assert_eq!(
        pcie_root_from_sysfs("../../../devices/pci0000:16/0000:16:02.0/0000:17:00.0").as_deref(),
        Some("pci0000:16")
    );
    assert_eq!(pcie_root_from_sysfs("../../../devices/platform/x"), None);
    assert_eq!(pcie_root_from_sysfs("pcie/pci0000:zz"), None);
}

#[test]
fn the_plan_creates_replaces_with_the_next_generation_or_keeps() {
    let inventory = two_islands();
    let wanted = resource_slice(&inventory, &NodeFacts::default(), 0);
    let SliceAction::Create(created) = plan(None, wanted.clone()) else {
        panic!("no slice yet: create");
    };
    assert_eq!(created.spec.pool.generation, 0);

    let mut existing = created.clone();
    existing.metadata.resource_version = Some("41".into());
    existing.spec.pool.generation = 7;
    assert_eq!(
        plan(Some(&existing), wanted.clone()),
        SliceAction::Unchanged
    );

    let tainted = resource_slice(
        &inventory,
        &NodeFacts {
            unhealthy: BTreeMap::from([(0, "ECC".to_owned())]),
            ..NodeFacts::default()
        },
        0,
    );
    let SliceAction::Replace(replacement) = plan(Some(&existing), tainted) else {
        panic!("the devices changed: replace");
    };
    assert_eq!(replacement.spec.pool.generation, 8);
    assert_eq!(replacement.metadata.resource_version.as_deref(), Some("41"));
}

/// `deploy/k8s/dra/resourceslice-example.yaml` is what `vgpu-dra print-slice` writes for the
/// two-island example node; validate.sh checks it against the official schema. Regenerate with
/// `vgpu-dra print-slice --node-name node-a --simulate nodeagent/vgpu-agent/examples/two-islands-8xH100.toml`.
#[test]
fn the_committed_example_slice_is_what_the_driver_publishes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/k8s/dra/resourceslice-example.yaml"
    );
    let committed = std::fs::read_to_string(path).unwrap();
    let committed: serde_json::Value = serde_yaml::from_str(
        &committed
            .lines()
            .filter(|line| !line.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let mut wanted =
        serde_json::to_value(resource_slice(&two_islands(), &NodeFacts::default(), 0)).unwrap();
    wanted["apiVersion"] = "resource.k8s.io/v1".into();
    wanted["kind"] = "ResourceSlice".into();
    assert_eq!(committed, wanted, "regenerate {path} (see this test's doc)");
}
