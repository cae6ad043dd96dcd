//! Real GPU discovery, minus the driver: the [`GpuDiscovery`] trait that NVML implements
//! ([`super::nvml::NvmlDiscovery`]) and [`assemble`], the pure function that turns what the driver
//! says into an [`Inventory`].
//!
//! Everything that needs judgement lives here, so that it is unit-tested against a fake driver
//! and a fake `/sys` tree:
//!
//! * PCI bus ids are normalised to the sysfs form (`0000:18:00.0`, lower case, 4-digit domain)
//!   whatever form NVML or CUDA used (`00000000:18:00.0`).
//! * NVLink: each active link whose far end is a GPU of this node counts one link to that GPU.
//!   Links to an NVSwitch count towards the switch fabric: two GPUs that both reach the fabric
//!   are peers with the smaller of their switch link counts (an HGX H100 board gives `NV18`
//!   between every pair, as `nvidia-smi topo -m` shows). Both directions must agree; where they
//!   do not (a link down on one side), the smaller count wins and a warning says so. Links to a
//!   GPU that is not visible here (another container's) are ignored.
//! * MIG: a GPU with MIG enabled is skipped (logged, and listed under `skipped`): vgpu shares a
//!   whole GPU through its interposer and cannot enforce slices inside MIG instances. vgpu never
//!   changes the MIG mode itself.
//! * SM count: from the CUDA driver (`cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)`, matched by PCI
//!   bus id) when it answers, else from the model table of [`super::simulated::MODELS`], else 0
//!   with a warning. NVML has no SM count for a whole GPU.
//! * NUMA node: `/sys/bus/pci/devices/<bus id>/numa_node` when it names one, else NVML's answer,
//!   else 0 when the host has a single NUMA node (VMs often report -1 in sysfs), else -1.
//! * Device minor (`/dev/nvidia<minor>`): NVML, else `/proc/driver/nvidia/gpus/<bus id>/information`.
//! * Nearest NICs, best effort: the RDMA devices of `/sys/class/infiniband` (or, when there are
//!   none, the PCI network interfaces of `/sys/class/net`) that share the deepest part of the GPU's
//!   PCI path: the same PCIe switch or root port first, then the same host bridge, then the same
//!   NUMA node.
//!
//! **Architecture Invariant:** this module does not depend on NVML or CUDA; only the `nvml` and
//! `cuda` modules do.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::inventory::simulated::model_profile;
use crate::inventory::{GpuInfo, Inventory, MAX_GPUS_PER_NODE, NvlinkPeer, SkippedGpu};

/// Why the driver could not answer: a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryError(pub String);

impl std::fmt::Display for DiscoveryError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// What a GPU driver binding must answer. NVML implements it on real machines; tests use fakes.
pub trait GpuDiscovery {
    /// The driver version, for the record (`580.159.04`).
    fn driver_version(&self) -> Option<String>;
    /// How many GPUs the driver sees.
    fn device_count(&self) -> Result<u32, DiscoveryError>;
    /// Everything about GPU `index` (0 ≤ index < [`GpuDiscovery::device_count`]).
    fn gpu(&self, index: u32) -> Result<RawGpu, DiscoveryError>;
    /// SM counts by normalised PCI bus id; an error when no source could answer.
    fn sm_counts(&self) -> Result<BTreeMap<String, u32>, DiscoveryError>;
    /// Health of the GPUs for heartbeats.
    // TODO(issue 3, health): XID errors, ECC counters, throttle reasons and per-process usage.
    fn health(&self) -> HealthReport {
        HealthReport::default()
    }
}

/// GPU health as reported with heartbeats. Empty until health reporting is built.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReport {
    /// One line per problem, e.g. `GPU 3: XID 79 (fallen off the bus)`.
    pub problems: Vec<String>,
}

/// One GPU as the driver describes it, before any interpretation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawGpu {
    pub index: u32,
    pub uuid: String,
    /// The product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    pub memory_bytes: u64,
    /// As the driver spells it, e.g. `00000000:18:00.0`.
    pub pci_bus_id: String,
    pub device_minor: Option<u32>,
    pub mig: MigState,
    /// The NUMA node NVML reports, used when sysfs has none.
    pub numa_node: Option<u32>,
    /// Active NVLinks only.
    pub links: Vec<RawLink>,
}

/// A GPU's MIG mode: the current one and the one after the next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigState {
    /// The GPU cannot do MIG (or NVML could not say).
    Unsupported,
    Disabled {
        pending_enabled: bool,
    },
    Enabled {
        pending_enabled: bool,
    },
}

/// One active NVLink and what is at its far end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawLink {
    pub link: u32,
    pub remote: LinkRemote,
}

/// The far end of an NVLink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkRemote {
    /// A GPU, by PCI bus id.
    Gpu(String),
    /// An NVSwitch.
    Switch,
    /// NVML could not say what it is; the remote PCI bus id when it had one. Counted as a GPU
    /// link when the bus id is one of this node's GPUs.
    Unknown(Option<String>),
    /// Something else (an IBM NPU).
    Other,
}

/// Files of the host that discovery reads, under `root` (`/` in production, a temporary tree in
/// tests).
#[derive(Debug, Clone)]
pub struct HostFiles {
    root: PathBuf,
}

/// A network device that could serve a GPU's traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    /// Components of its PCI path under `/sys/devices` (`pci0000:15`, `0000:15:01.0`, ...).
    pub pci_path: Vec<String>,
    pub numa_node: Option<i32>,
}

impl HostFiles {
    /// The real host.
    pub fn system() -> HostFiles {
        HostFiles::at(Path::new("/"))
    }

    /// A host tree rooted elsewhere.
    pub fn at(root: &Path) -> HostFiles {
        HostFiles {
            root: root.to_owned(),
        }
    }

    fn pci_device(&self, bus_id: &str) -> PathBuf {
        self.root.join("sys/bus/pci/devices").join(bus_id)
    }

    /// `numa_node` of a PCI device; `None` when unreadable, `Some(-1)` when the kernel has none.
    pub fn numa_node(&self, bus_id: &str) -> Option<i32> {
        read_numa_node(&self.pci_device(bus_id).join("numa_node"))
    }

    /// How many NUMA nodes the host has (`/sys/devices/system/node/node*`); 0 when unknown.
    pub fn numa_node_count(&self) -> usize {
        let Ok(entries) = fs::read_dir(self.root.join("sys/devices/system/node")) else {
            return 0;
        };
        entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("node").is_some_and(|number| {
                    !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())
                })
            })
            .count()
    }

    /// The `Device Minor` the NVIDIA kernel module reports for the GPU at `bus_id`.
    pub fn device_minor(&self, bus_id: &str) -> Option<u32> {
        let path = self
            .root
            .join("proc/driver/nvidia/gpus")
            .join(bus_id)
            .join("information");
        parse_device_minor(&fs::read_to_string(path).ok()?)
    }

    /// The components of the PCI path of the device at `bus_id` under `/sys/devices`.
    pub fn pci_path(&self, bus_id: &str) -> Option<Vec<String>> {
        self.pci_path_of(&self.pci_device(bus_id))
    }

    fn pci_path_of(&self, link: &Path) -> Option<Vec<String>> {
        let devices = fs::canonicalize(self.root.join("sys/devices")).ok()?;
        let real = fs::canonicalize(link).ok()?;
        let relative = real.strip_prefix(&devices).ok()?;
        let components: Vec<String> = relative
            .components()
            .map(|component| component.as_os_str().to_string_lossy().into_owned())
            .collect();
        let on_pci = components
            .first()
            .is_some_and(|first| first.starts_with("pci"));
        on_pci.then_some(components)
    }

    /// RDMA devices (`/sys/class/infiniband`), or when there are none, network interfaces backed
    /// by a PCI device (`/sys/class/net`), sorted by name.
    pub fn nics(&self) -> Vec<Nic> {
        let rdma = self.nics_in("sys/class/infiniband");
        if rdma.is_empty() {
            self.nics_in("sys/class/net")
        } else {
            rdma
        }
    }

    fn nics_in(&self, class: &str) -> Vec<Nic> {
        let Ok(entries) = fs::read_dir(self.root.join(class)) else {
            return Vec::new();
        };
        let mut nics: Vec<Nic> = entries
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let device = entry.path().join("device");
                let pci_path = self.pci_path_of(&device)?;
                Some(Nic {
                    name: entry.file_name().to_string_lossy().into_owned(),
                    pci_path,
                    numa_node: read_numa_node(&device.join("numa_node")),
                })
            })
            .collect();
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        nics
    }
}

fn read_numa_node(path: &Path) -> Option<i32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reads `Device Minor: 3` out of `/proc/driver/nvidia/gpus/<bus id>/information`.
pub fn parse_device_minor(information: &str) -> Option<u32> {
    information.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "Device Minor")
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

/// A PCI bus id in sysfs form: `0000:18:00.0`. Accepts NVML's 8-digit domain, upper case, and a
/// missing domain (`18:00.0`). `None` when it is not a bus id.
pub fn normalize_bus_id(bus_id: &str) -> Option<String> {
    let text = bus_id.trim().to_ascii_lowercase();
    let parts: Vec<&str> = text.split(':').collect();
    let (domain, bus, slot) = match parts.as_slice() {
        [domain, bus, slot] => (u32::from_str_radix(domain, 16).ok()?, *bus, *slot),
        [bus, slot] => (0, *bus, *slot),
        _ => return None,
    };
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let (device, function) = slot.split_once('.')?;
    let device = u8::from_str_radix(device, 16).ok()?;
    let function = u8::from_str_radix(function, 16).ok()?;
    if device >= 32 || function >= 8 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// The model as the agent reports it: the product name without `NVIDIA`, words joined by `-`
/// (`NVIDIA H100 80GB HBM3` becomes `H100-80GB-HBM3`).
pub fn model_from_name(name: &str) -> String {
    let trimmed = name.trim();
    let without_vendor = match trimmed.get(..7) {
        Some(prefix) if prefix.eq_ignore_ascii_case("nvidia ") => &trimmed[7..],
        _ => trimmed,
    };
    let model = without_vendor
        .split_whitespace()
        .collect::<Vec<_>>()
        .join("-");
    if model.is_empty() {
        "unknown".to_owned()
    } else {
        model
    }
}

/// SMs of a model from the table, when it is known: PCIe parts of a family may have fewer.
pub fn sm_count_from_table(model: &str) -> Option<u32> {
    let profile = model_profile(model)?;
    let pcie = model.to_ascii_uppercase().contains("PCIE");
    Some(match (pcie, profile.pcie_sm_count) {
        (true, Some(sm_count)) => sm_count,
        _ => profile.sm_count,
    })
}

/// The NICs nearest to a GPU (see the module docs), sorted by name.
pub fn nearest_nics(gpu_path: Option<&[String]>, gpu_numa: i32, nics: &[Nic]) -> Vec<String> {
    let shared = |nic: &Nic| {
        gpu_path.map_or(0, |gpu_path| {
            gpu_path
                .iter()
                .zip(&nic.pci_path)
                .take_while(|(a, b)| a == b)
                .count()
        })
    };
    let best = nics.iter().map(shared).max().unwrap_or(0);
    // 1: the same host bridge; 2 or more: the same root port or PCIe switch.
    let mut names: Vec<String> = if best >= 1 {
        nics.iter()
            .filter(|nic| shared(nic) == best)
            .map(|nic| nic.name.clone())
            .collect()
    } else if gpu_numa >= 0 {
        nics.iter()
            .filter(|nic| nic.numa_node == Some(gpu_numa))
            .map(|nic| nic.name.clone())
            .collect()
    } else {
        Vec::new()
    };
    names.sort();
    names
}

/// What [`assemble`] found besides the inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    /// Things an operator should look at (skipped GPUs, asymmetric NVLinks, unknown SM counts).
    pub warnings: Vec<String>,
    /// Where facts came from (for the log at `info`).
    pub notes: Vec<String>,
}

/// Builds node `node`'s inventory from a driver and the host's files.
pub fn assemble(
    node: &str,
    discovery: &dyn GpuDiscovery,
    host: &HostFiles,
) -> Result<(Inventory, Findings)> {
    let mut findings = Findings::default();
    let count = discovery
        .device_count()
        .map_err(|error| Error::NoGpu { reason: error.0 })?;
    if count == 0 {
        return Err(Error::NoGpu {
            reason: "the driver reports 0 GPUs".to_owned(),
        });
    }
    if count as usize > MAX_GPUS_PER_NODE {
        findings.warnings.push(format!(
            "the driver reports {count} GPUs; registering the first {MAX_GPUS_PER_NODE}"
        ));
    }
    let count = count.min(MAX_GPUS_PER_NODE as u32);

    let mut usable: Vec<(RawGpu, String)> = Vec::new();
    let mut skipped: Vec<SkippedGpu> = Vec::new();
    for index in 0..count {
        let raw = match discovery.gpu(index) {
            Ok(raw) => raw,
            Err(error) => {
                skipped.push(SkippedGpu {
                    index,
                    uuid: String::new(),
                    pci_bus_id: String::new(),
                    reason: format!("cannot read it: {error}"),
                });
                continue;
            }
        };
        assert_eq!(raw.index, index, "the driver answers for the GPU asked");
        let Some(bus_id) = normalize_bus_id(&raw.pci_bus_id) else {
            skipped.push(SkippedGpu {
                index,
                uuid: raw.uuid.clone(),
                pci_bus_id: raw.pci_bus_id.clone(),
                reason: format!("unreadable PCI bus id `{}`", raw.pci_bus_id),
            });
            continue;
        };
        match raw.mig {
            MigState::Enabled { .. } => {
                skipped.push(SkippedGpu {
                    index,
                    uuid: raw.uuid.clone(),
                    pci_bus_id: bus_id,
                    reason: "MIG is enabled; vgpu shares whole GPUs and skips MIG-enabled ones \
                             (disable MIG to include it; vgpu never changes MIG mode)"
                        .to_owned(),
                });
                continue;
            }
            MigState::Disabled {
                pending_enabled: true,
            } => findings.warnings.push(format!(
                "GPU {index} ({}): MIG becomes enabled at the next GPU reset; it will then be skipped",
                raw.uuid
            )),
            MigState::Disabled { .. } | MigState::Unsupported => {}
        }
        if raw.memory_bytes == 0 || raw.uuid.is_empty() {
            skipped.push(SkippedGpu {
                index,
                uuid: raw.uuid.clone(),
                pci_bus_id: bus_id,
                reason: "the driver reports no uuid or no memory".to_owned(),
            });
            continue;
        }
        usable.push((raw, bus_id));
    }
    for skip in &skipped {
        findings
            .warnings
            .push(format!("GPU {} skipped: {}", skip.index, skip.reason));
    }
    if usable.is_empty() {
        let reasons: Vec<String> = skipped
            .iter()
            .map(|skip| format!("GPU {}: {}", skip.index, skip.reason))
            .collect();
        return Err(Error::NoUsableGpu {
            details: reasons.join("; "),
        });
    }

    let peers = count_nvlink_peers(&usable, &mut findings);
    let sm_counts = match discovery.sm_counts() {
        Ok(counts) => {
            findings
                .notes
                .push("SM counts from the CUDA driver (cuDeviceGetAttribute)".to_owned());
            counts
        }
        Err(error) => {
            findings.notes.push(format!(
                "SM counts from the model table (the CUDA driver did not answer: {error})"
            ));
            BTreeMap::new()
        }
    };
    let nics = host.nics();
    let mut gpus = Vec::with_capacity(usable.len());
    for (raw, bus_id) in &usable {
        let model = model_from_name(&raw.name);
        let sm_count = sm_counts
            .get(bus_id)
            .copied()
            .or_else(|| sm_count_from_table(&model))
            .unwrap_or_else(|| {
                findings.warnings.push(format!(
                    "GPU {}: unknown SM count for `{}`; reporting 0",
                    raw.index, raw.name
                ));
                0
            });
        let numa_node = host
            .numa_node(bus_id)
            .filter(|&node| node >= 0)
            .or_else(|| raw.numa_node.and_then(|node| i32::try_from(node).ok()))
            .or_else(|| (host.numa_node_count() == 1).then_some(0))
            .unwrap_or(-1);
        let device_minor = raw.device_minor.or_else(|| host.device_minor(bus_id));
        if device_minor.is_none() {
            findings.warnings.push(format!(
                "GPU {}: unknown device minor; CDI specs will use /dev/nvidia{}",
                raw.index, raw.index
            ));
        }
        let gpu_path = host.pci_path(bus_id);
        gpus.push(GpuInfo {
            uuid: raw.uuid.clone(),
            index: raw.index,
            model,
            memory_bytes: raw.memory_bytes,
            sm_count,
            nvlink_peers: peers.get(&raw.index).cloned().unwrap_or_default(),
            numa_node,
            pci_bus_id: bus_id.clone(),
            nearest_nics: nearest_nics(gpu_path.as_deref(), numa_node, &nics),
            device_minor,
        });
    }
    let inventory = Inventory {
        node: node.to_owned(),
        gpus,
        simulated: false,
        driver_version: discovery.driver_version(),
        skipped,
        // Read from the machine by the caller (`host::read_system`): not part of what NVML says.
        host: super::host::HostResources::default(),
    };
    inventory.assert_consistent();
    Ok((inventory, findings))
}

/// NVLink peers of each usable GPU (by index), symmetric, sorted by peer index.
fn count_nvlink_peers(
    usable: &[(RawGpu, String)],
    findings: &mut Findings,
) -> BTreeMap<u32, Vec<NvlinkPeer>> {
    let by_bus: BTreeMap<&str, u32> = usable
        .iter()
        .map(|(raw, bus_id)| (bus_id.as_str(), raw.index))
        .collect();
    // Directed counts: (from, to) -> links seen from `from`.
    let mut direct: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut switch_links: BTreeMap<u32, u32> = BTreeMap::new();
    for (raw, own_bus) in usable {
        for link in &raw.links {
            let remote_bus = match &link.remote {
                LinkRemote::Switch => {
                    *switch_links.entry(raw.index).or_default() += 1;
                    continue;
                }
                LinkRemote::Other | LinkRemote::Unknown(None) => continue,
                LinkRemote::Gpu(bus) | LinkRemote::Unknown(Some(bus)) => bus,
            };
            let Some(remote_bus) = normalize_bus_id(remote_bus) else {
                continue;
            };
            if &remote_bus == own_bus {
                continue;
            }
            // A GPU that is not one of ours (another container's, or skipped) is no peer.
            if let Some(&peer) = by_bus.get(remote_bus.as_str()) {
                *direct.entry((raw.index, peer)).or_default() += 1;
            }
        }
    }
    let mut links: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for (&(from, to), &forward) in &direct {
        let backward = direct.get(&(to, from)).copied().unwrap_or(0);
        if forward != backward && from < to {
            findings.warnings.push(format!(
                "GPUs {from} and {to} disagree on their NVLinks ({forward} against {backward}); \
                 using {}",
                forward.min(backward)
            ));
        }
        let count = forward.min(backward);
        if count > 0 {
            links.insert((from, to), count);
        }
    }
    for (&a, &links_a) in &switch_links {
        for (&b, &links_b) in &switch_links {
            if a != b {
                *links.entry((a, b)).or_default() += links_a.min(links_b);
            }
        }
    }
    if !switch_links.is_empty() {
        findings.notes.push(format!(
            "NVLink through NVSwitch: {} GPUs reach the switch fabric",
            switch_links.len()
        ));
    }
    let mut peers: BTreeMap<u32, Vec<NvlinkPeer>> = BTreeMap::new();
    for ((from, to), link_count) in links {
        assert!(from != to && link_count > 0);
        peers.entry(from).or_default().push(NvlinkPeer {
            gpu_index: to,
            link_count,
        });
    }
    peers
}

#[cfg(test)]
#[path = "discovery_test.rs"]
mod tests;
