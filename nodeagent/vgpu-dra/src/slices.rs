//! The node's GPUs as one ResourceSlice (`resource.k8s.io/v1`), pure: [`resource_slice`] from
//! the inventory, [`plan`] decides what to send given what the apiserver has.
//!
//! One slice per node, named `<node>-vgpu.dev`, pool = the node's name, one device `gpu-<index>`
//! per GPU with
//!
//! * attributes `uuid`, `model`, `index`, `memoryBytes`, `smCount`, `numaNode` (when known),
//!   `pciBusID`, `nvlinkIsland` (the lowest index of the GPUs it reaches over NVLink, its own
//!   when none) and the standard `resource.kubernetes.io/pcieRoot` (when known), for CEL
//!   selectors and `matchAttribute` constraints (`nvlinkIsland` keeps a gang on one island);
//! * capacities `memory` (bytes) and `compute` (percent, 100) without a request policy: a
//!   request names how much it takes, and one that names neither takes the whole GPU;
//! * `allowMultipleAllocations: true`, so several claims share a GPU up to its capacity;
//! * a `NoSchedule` taint `vgpu.dev/unhealthy` on a GPU the agent's health check found failing,
//!   so no new claim lands on it (claims already there keep running).
//!
//! The pool's generation goes up by one whenever the devices change ([`plan`]), as the scheduler
//! requires to tell a newer slice from an older one.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use vgpu_agent::inventory::{GpuInfo, Inventory};

use crate::claim::{CAPACITY_COMPUTE, CAPACITY_MEMORY, DRIVER_NAME, device_name};

/// The standard attribute of the PCIe root complex a device hangs off.
pub const PCIE_ROOT_ATTRIBUTE: &str = "resource.kubernetes.io/pcieRoot";
/// The taint key of a GPU that failed the agent's health checks.
pub const UNHEALTHY_TAINT: &str = "vgpu.dev/unhealthy";
/// Most devices the API allows in one slice.
pub const SLICE_DEVICES_MAX: usize = 128;

/// Facts about the node's GPUs that the inventory does not carry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// `pci<domain>:<bus>` of each GPU's root complex, by GPU index (from sysfs).
    pub pcie_roots: BTreeMap<u32, String>,
    /// GPUs that failed the health checks, by index, with the reason (the taint's value).
    pub unhealthy: BTreeMap<u32, String>,
}

/// The slice's name for node `node`.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER_NAME}")
}

/// The ResourceSlice of the node of `inventory`, at pool generation `generation`.
pub fn resource_slice(inventory: &Inventory, facts: &NodeFacts, generation: i64) -> ResourceSlice {
    assert!(inventory.gpus.len() <= SLICE_DEVICES_MAX);
    assert!(generation >= 0);
    let islands = nvlink_islands(inventory);
    let devices = inventory
        .gpus
        .iter()
        .map(|gpu| device(gpu, islands[&gpu.index], facts))
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(&inventory.node)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.to_owned(),
            node_name: Some(inventory.node.clone()),
            pool: ResourcePool {
                name: inventory.node.clone(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    }
}

fn device(gpu: &GpuInfo, island: u32, facts: &NodeFacts) -> Device {
    let string = |value: &str| DeviceAttribute {
        string: Some(value.to_owned()),
        ..DeviceAttribute::default()
    };
    let int = |value: i64| DeviceAttribute {
        int: Some(value),
        ..DeviceAttribute::default()
    };
    let memory = i64::try_from(gpu.memory_bytes).expect("GPU memory fits i64");
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("model".to_owned(), string(&gpu.model)),
        ("index".to_owned(), int(i64::from(gpu.index))),
        ("memoryBytes".to_owned(), int(memory)),
        ("smCount".to_owned(), int(i64::from(gpu.sm_count))),
        ("pciBusID".to_owned(), string(&gpu.pci_bus_id)),
        ("nvlinkIsland".to_owned(), int(i64::from(island))),
    ]);
    if gpu.numa_node >= 0 {
        attributes.insert("numaNode".to_owned(), int(i64::from(gpu.numa_node)));
    }
    if let Some(root) = facts.pcie_roots.get(&gpu.index) {
        attributes.insert(PCIE_ROOT_ATTRIBUTE.to_owned(), string(root));
    }
    let capacity = |value: String| DeviceCapacity {
        value: Quantity(value),
        request_policy: None,
    };
    let taints = facts.unhealthy.get(&gpu.index).map(|reason| {
        vec![DeviceTaint {
            key: UNHEALTHY_TAINT.to_owned(),
            value: Some(taint_value(reason)),
            effect: "NoSchedule".to_owned(),
            time_added: None,
        }]
    });
    Device {
        name: device_name(gpu.index),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([
            (
                CAPACITY_MEMORY.to_owned(),
                capacity(gpu.memory_bytes.to_string()),
            ),
            (CAPACITY_COMPUTE.to_owned(), capacity("100".to_owned())),
        ])),
        allow_multiple_allocations: Some(true),
        taints,
        ..Device::default()
    }
}

/// A taint value: a label value (63 characters of letters, digits, `-`, `_`, `.`, starting and
/// ending with a letter or digit).
fn taint_value(reason: &str) -> String {
    let cleaned: String = reason
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let trimmed = cleaned.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.is_empty() {
        "failing".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// Each GPU's NVLink island: the lowest index among the GPUs it reaches over NVLink (itself
/// included).
pub fn nvlink_islands(inventory: &Inventory) -> BTreeMap<u32, u32> {
    let mut islands = BTreeMap::new();
    for gpu in &inventory.gpus {
        if islands.contains_key(&gpu.index) {
            continue;
        }
        // Every GPU reached from this one, the lowest unvisited index, gets this index.
        let mut island = BTreeSet::from([gpu.index]);
        let mut frontier = vec![gpu.index];
        while let Some(index) = frontier.pop() {
            let Some(member) = inventory.gpus.iter().find(|g| g.index == index) else {
                continue;
            };
            for peer in &member.nvlink_peers {
                if island.insert(peer.gpu_index) {
                    frontier.push(peer.gpu_index);
                }
            }
        }
        let lowest = *island.first().expect("the GPU itself");
        for member in island {
            islands.insert(member, lowest);
        }
    }
    assert!(
        inventory
            .gpus
            .iter()
            .all(|gpu| islands.contains_key(&gpu.index))
    );
    islands
}

/// The root complex of a PCI device from its sysfs path (the target of
/// `/sys/bus/pci/devices/<bus id>`), e.g. `../../../devices/pci0000:16/0000:16:02.0/0000:17:00.0`
/// gives `pci0000:16`.
pub fn pcie_root_from_sysfs(path: &str) -> Option<String> {
    path.split('/')
        .find(|part| {
            part.strip_prefix("pci").is_some_and(|rest| {
                let (domain, bus) = rest.split_once(':').unwrap_or(("", ""));
                domain.len() == 4
                    && bus.len() == 2
                    && domain
                        .chars()
                        .chain(bus.chars())
                        .all(|c| c.is_ascii_hexdigit())
            })
        })
        .map(str::to_owned)
}

/// What to send to the apiserver.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceAction {
    /// There is no slice: create this one.
    Create(ResourceSlice),
    /// The slice differs: replace it with this one (the existing resource version, the next
    /// generation).
    Replace(ResourceSlice),
    Unchanged,
}

/// Compares the wanted slice (any generation) with what the apiserver has.
pub fn plan(existing: Option<&ResourceSlice>, wanted: ResourceSlice) -> SliceAction {
    let Some(existing) = existing else {
        let mut wanted = wanted;
        wanted.spec.pool.generation = 0;
        return SliceAction::Create(wanted);
    };
    let mut comparable = wanted.spec.clone();
    comparable.pool.generation = existing.spec.pool.generation;
    if comparable == existing.spec {
        return SliceAction::Unchanged;
    }
    let mut replacement = wanted;
    replacement.spec.pool.generation = existing.spec.pool.generation + 1;
    replacement.metadata.resource_version = existing.metadata.resource_version.clone();
    replacement.metadata.uid = existing.metadata.uid.clone();
    assert!(replacement.spec.pool.generation > existing.spec.pool.generation);
    SliceAction::Replace(replacement)
}

#[cfg(test)]
#[path = "slices_test.rs"]
mod tests;
