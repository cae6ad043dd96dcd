//! The node's GPU inventory: what the agent registers with the control plane.
//!
//! An [`InventorySource`] produces an [`Inventory`]: two simulated sources, a
//! `COUNTxMODEL-MEMORY` spec ([`simulated`]) and a topology file ([`topology`]), and real
//! discovery through NVML ([`nvml`] behind the [`discovery::GpuDiscovery`] trait, with the
//! interpretation in [`discovery::assemble`]).
//!
//! **Architecture Invariant:** an inventory is deterministic. The same source and node name give
//! the same GPUs, uuids included, on every start, because the control plane keeps a node's
//! tenants only when it re-registers with an identical inventory.

pub mod cuda;
pub mod discovery;
pub mod host;
pub mod nvml;
pub mod simulated;
pub mod topology;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Most GPUs one node may report (the control plane refuses more).
pub const MAX_GPUS_PER_NODE: usize = 64;

/// One GPU as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub uuid: String,
    pub index: u32,
    pub model: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    /// Sorted by peer index, at most one entry per peer.
    pub nvlink_peers: Vec<NvlinkPeer>,
    /// -1 when unknown.
    pub numa_node: i32,
    pub pci_bus_id: String,
    pub nearest_nics: Vec<String>,
    /// `N` of `/dev/nvidiaN`: from the driver for real GPUs, absent for simulated ones (which then
    /// use their index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_minor: Option<u32>,
}

/// A GPU the driver reported that the agent does not register, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedGpu {
    pub index: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    pub reason: String,
}

/// An NVLink connection from one GPU to another GPU of the same node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NvlinkPeer {
    pub gpu_index: u32,
    pub link_count: u32,
}

/// A node's GPUs, sorted by index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub node: String,
    pub gpus: Vec<GpuInfo>,
    /// Whether the GPUs are simulated (a spec or a topology file) rather than discovered.
    #[serde(default)]
    pub simulated: bool,
    /// The NVIDIA driver version, for real GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// GPUs the driver reported that are not registered (MIG enabled, unreadable).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedGpu>,
    /// CPU and host memory for tenants (`host`): the machine's for discovered GPUs, defaults for
    /// simulated ones; `join` subtracts the reserve before registering.
    #[serde(default)]
    pub host: host::HostResources,
}

/// Where the inventory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InventorySource {
    /// `COUNTxMODEL-MEMORY`, e.g. `8xH100-80GB`.
    Simulated(simulated::SimulatedSpec),
    /// A `.toml` or `.json` file that describes each GPU (mixed layouts, NVLink islands).
    TopologyFile(PathBuf),
    /// Real discovery through NVML.
    Nvml,
}

impl InventorySource {
    /// Reads a `--simulate` argument: a topology file path when it ends in `.toml`/`.json` or
    /// names a path (contains `/`), a `COUNTxMODEL-MEMORY` spec otherwise.
    pub fn from_simulate_arg(spec: &str) -> Result<InventorySource> {
        let trimmed = spec.trim();
        if is_topology_path(Path::new(trimmed)) {
            return Ok(InventorySource::TopologyFile(PathBuf::from(trimmed)));
        }
        if trimmed.contains('/') {
            return Err(Error::TopologyExtension {
                path: PathBuf::from(trimmed),
            });
        }
        Ok(InventorySource::Simulated(simulated::SimulatedSpec::parse(
            trimmed,
        )?))
    }

    /// Produces the inventory of node `node`. Problems that were repaired (such as one-sided
    /// NVLink peer lists) are logged as warnings.
    pub fn discover(&self, node: &str) -> Result<Inventory> {
        api::names::validate("node", node)?;
        let inventory = match self {
            InventorySource::Simulated(spec) => spec.inventory(node),
            InventorySource::TopologyFile(path) => {
                let (inventory, warnings) = topology::load(path, node)?;
                for warning in warnings {
                    tracing::warn!("{}: {warning}", path.display());
                }
                inventory
            }
            InventorySource::Nvml => discover_with_nvml(node)?,
        };
        inventory.assert_consistent();
        Ok(inventory)
    }
}

/// Discovers the node's GPUs through NVML and logs what was skipped and where facts came from.
fn discover_with_nvml(node: &str) -> Result<Inventory> {
    let nvml = nvml::NvmlDiscovery::open().map_err(|error| Error::NoGpu { reason: error.0 })?;
    tracing::info!("NVML loaded from {}", nvml.library());
    let (mut inventory, findings) =
        discovery::assemble(node, &nvml, &discovery::HostFiles::system())?;
    inventory.host = host::read_system();
    for note in &findings.notes {
        tracing::info!("{note}");
    }
    for warning in &findings.warnings {
        tracing::warn!("{warning}");
    }
    Ok(inventory)
}

impl Inventory {
    /// Checks what every source guarantees; a failure is a bug in the source.
    pub fn assert_consistent(&self) {
        assert!(!self.gpus.is_empty(), "an inventory has at least one GPU");
        assert!(
            self.gpus.len() <= MAX_GPUS_PER_NODE,
            "an inventory has at most {MAX_GPUS_PER_NODE} GPUs"
        );
        assert!(
            self.gpus
                .windows(2)
                .all(|pair| pair[0].index < pair[1].index),
            "GPUs are sorted by index without duplicates"
        );
        let indexes: BTreeMap<u32, &GpuInfo> =
            self.gpus.iter().map(|gpu| (gpu.index, gpu)).collect();
        for gpu in &self.gpus {
            assert!(gpu.memory_bytes > 0, "GPU {} has memory", gpu.index);
            for peer in &gpu.nvlink_peers {
                let other = indexes
                    .get(&peer.gpu_index)
                    .expect("NVLink peers are GPUs of the node");
                let back = other
                    .nvlink_peers
                    .iter()
                    .find(|back| back.gpu_index == gpu.index);
                assert_eq!(
                    back.map(|back| back.link_count),
                    Some(peer.link_count),
                    "NVLink is symmetric"
                );
            }
        }
    }

    /// The protobuf node sent with `Register`.
    pub fn to_proto(&self, address: &str, labels: &BTreeMap<String, String>) -> api::v1::Node {
        api::v1::Node {
            name: self.node.clone(),
            address: address.to_owned(),
            labels: labels
                .iter()
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect(),
            gpus: self
                .gpus
                .iter()
                .map(|gpu| api::v1::Gpu {
                    uuid: gpu.uuid.clone(),
                    index: gpu.index,
                    model: gpu.model.clone(),
                    memory_bytes: gpu.memory_bytes,
                    sm_count: gpu.sm_count,
                    nvlink_peers: gpu
                        .nvlink_peers
                        .iter()
                        .map(|peer| api::v1::NvlinkPeer {
                            gpu_index: peer.gpu_index,
                            link_count: peer.link_count,
                        })
                        .collect(),
                    numa_node: gpu.numa_node,
                    pci_bus_id: gpu.pci_bus_id.clone(),
                    nearest_nics: gpu.nearest_nics.clone(),
                    ..Default::default()
                })
                .collect(),
            cpu_milli: self.host.cpu_milli,
            host_memory_bytes: self.host.memory_bytes,
            ..Default::default()
        }
    }

    /// A table for people, one GPU a line, in the style of `nvidia-smi topo -m`.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let total: u64 = self.gpus.iter().map(|gpu| gpu.memory_bytes).sum();
        let origin = match (&self.driver_version, self.simulated) {
            (_, true) => " (simulated)".to_owned(),
            (Some(version), false) => format!(" (NVIDIA driver {version})"),
            (None, false) => String::new(),
        };
        let _ = writeln!(
            out,
            "node {}: {} GPUs, {} in all{origin}",
            self.node,
            self.gpus.len(),
            api::size::format_bytes(total)
        );
        let cpu = match self.host.cpu_milli {
            0 => "not reported".to_owned(),
            milli => format!("{} CPUs", api::cpu::format_cpu_milli(milli)),
        };
        let memory = match self.host.memory_bytes {
            0 => "not reported".to_owned(),
            bytes => api::size::format_bytes(bytes),
        };
        let _ = writeln!(out, "host: {cpu}, {memory} memory");
        let _ = writeln!(
            out,
            "{:<5} {:<42} {:<12} {:>10} {:>4} {:>4} {:<13} {:<10} NVLINK",
            "INDEX", "UUID", "MODEL", "MEMORY", "SMS", "NUMA", "PCI", "NICS"
        );
        for gpu in &self.gpus {
            let nvlink = if gpu.nvlink_peers.is_empty() {
                "-".to_owned()
            } else {
                gpu.nvlink_peers
                    .iter()
                    .map(|peer| format!("{}:NV{}", peer.gpu_index, peer.link_count))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let nics = if gpu.nearest_nics.is_empty() {
                "-".to_owned()
            } else {
                gpu.nearest_nics.join(",")
            };
            let _ = writeln!(
                out,
                "{:<5} {:<42} {:<12} {:>10} {:>4} {:>4} {:<13} {:<10} {}",
                gpu.index,
                gpu.uuid,
                gpu.model,
                api::size::format_bytes(gpu.memory_bytes),
                gpu.sm_count,
                gpu.numa_node,
                gpu.pci_bus_id,
                nics,
                nvlink
            );
        }
        for skipped in &self.skipped {
            let _ = writeln!(
                out,
                "skipped GPU {} {} {}: {}",
                skipped.index, skipped.uuid, skipped.pci_bus_id, skipped.reason
            );
        }
        out
    }

    /// The GPU with uuid `uuid`.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<&GpuInfo> {
        self.gpus.iter().find(|gpu| gpu.uuid == uuid)
    }
}

/// Returns whether `path` names a topology file by its extension.
pub fn is_topology_path(path: &Path) -> bool {
    matches!(
        path.extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("toml" | "json")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simulate_argument_is_a_spec_or_a_file() {
        assert!(matches!(
            InventorySource::from_simulate_arg("8xH100-80GB"),
            Ok(InventorySource::Simulated(_))
        ));
        assert_eq!(
            InventorySource::from_simulate_arg("layouts/two.TOML").unwrap(),
            InventorySource::TopologyFile(PathBuf::from("layouts/two.TOML"))
        );
        assert_eq!(
            InventorySource::from_simulate_arg("x.json").unwrap(),
            InventorySource::TopologyFile(PathBuf::from("x.json"))
        );
        let error = InventorySource::from_simulate_arg("layouts/two.yaml").unwrap_err();
        assert!(
            error.to_string().contains("`*.toml` or `*.json`"),
            "{error}"
        );
        assert!(is_topology_path(Path::new("a/b.Json")));
        assert!(!is_topology_path(Path::new("a/b.yaml")));
    }

    #[test]
    fn without_nvml_discovery_says_what_to_do() {
        // This machine has no NVIDIA driver; on a GPU machine discovery succeeds instead.
        if let Err(error) = InventorySource::Nvml.discover("node-a") {
            let message = error.to_string();
            assert!(
                message.starts_with("no NVIDIA GPU found (NVML: ")
                    || message.starts_with("no usable NVIDIA GPU"),
                "{message}"
            );
            assert!(
                message.ends_with("pass --simulate SPEC to run with simulated GPUs"),
                "{message}"
            );
        }
    }

    #[test]
    fn the_node_name_is_checked() {
        let source = InventorySource::from_simulate_arg("1xH100-80GB").unwrap();
        assert!(matches!(source.discover("Bad_Name"), Err(Error::Name(_))));
    }

    #[test]
    fn the_proto_node_carries_every_field() {
        let inventory = InventorySource::from_simulate_arg("2xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        let labels = BTreeMap::from([("zone".to_owned(), "a".to_owned())]);
        let node = inventory.to_proto("10.0.0.1:7500", &labels);
        assert_eq!(node.name, "node-a");
        assert_eq!(node.address, "10.0.0.1:7500");
        assert_eq!(node.labels.get("zone").map(String::as_str), Some("a"));
        assert_eq!(node.gpus.len(), 2);
        assert_eq!(node.gpus[0].uuid, inventory.gpus[0].uuid);
        assert_eq!(
            node.gpus[0].nvlink_peers,
            vec![api::v1::NvlinkPeer {
                gpu_index: 1,
                link_count: 18
            }]
        );
        assert_eq!(node.gpus[1].memory_bytes, 81559 << 20);
        assert_eq!(node.cpu_milli, 32_000, "simulated: 16 CPUs a GPU");
        assert_eq!(node.host_memory_bytes, 256 << 30);
        let text = inventory.to_text();
        assert!(text.starts_with("node node-a: 2 GPUs"), "{text}");
        assert!(text.contains("host: 32 CPUs, 256GiB memory\n"), "{text}");
        assert!(text.contains("0:NV18"), "{text}");
    }
}
