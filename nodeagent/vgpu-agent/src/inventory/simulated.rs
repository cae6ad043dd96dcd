//! Simulated GPUs from a `COUNTxMODEL-MEMORY` spec such as `8xH100-80GB`.
//!
//! The spec gives COUNT GPUs of MODEL, all alike, laid out like the usual server of that part:
//!
//! * memory: the real size the driver reports for known products (H100 80GB = 81559 MiB, H200
//!   141GB = 143771 MiB, A100 80GB = 81920 MiB, A100 40GB = 40960 MiB, L40S 48GB = 46068 MiB,
//!   L4 24GB = 23034 MiB), otherwise the GB number read as GiB;
//! * SMs from [`MODELS`] (0 for unknown models);
//! * NVLink all-to-all for SXM parts (H100/H200 NV18, A100 NV12, as behind an NVSwitch), none for
//!   PCIe parts (L40S, L4, and any model with a `-PCIE-` part such as `H100-PCIE-80GB`);
//! * NUMA node 0 for the first half of the GPUs and 1 for the second when COUNT >= 4, else 0;
//! * PCI bus ids of a DGX H100 (`0000:18:00.0`, `0000:2a:00.0`, ...), eight per PCI domain;
//! * one NIC per pair of GPUs (`mlx5_0` for GPUs 0 and 1, `mlx5_1` for 2 and 3, ...);
//! * uuids derived from the node name and GPU index ([`simulated_uuid`]), so a restarted agent
//!   registers the same GPUs and keeps its tenants.

use crate::error::{Error, Result};
use crate::inventory::{GpuInfo, Inventory, MAX_GPUS_PER_NODE, NvlinkPeer};

/// What the simulator knows about a GPU product family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelProfile {
    /// The first `-`-separated part of the model name, upper case (`H100`).
    pub family: &'static str,
    pub sm_count: u32,
    /// SMs of the PCIe form factor when it differs.
    pub pcie_sm_count: Option<u32>,
    /// NVLink links between each pair of GPUs in an SXM server; 0 for PCIe-only parts.
    pub nvlink_links_per_pair: u32,
    /// (marketing GB, MiB the driver reports).
    pub known_memory: &'static [(u64, u64)],
}

/// The products the simulator knows. Unknown models get 0 SMs, no NVLink and GB read as GiB.
pub const MODELS: &[ModelProfile] = &[
    ModelProfile {
        family: "H100",
        sm_count: 132,
        pcie_sm_count: Some(114),
        nvlink_links_per_pair: 18,
        known_memory: &[(80, 81559)],
    },
    ModelProfile {
        family: "H200",
        sm_count: 132,
        pcie_sm_count: None,
        nvlink_links_per_pair: 18,
        known_memory: &[(141, 143771)],
    },
    ModelProfile {
        family: "A100",
        sm_count: 108,
        pcie_sm_count: None,
        nvlink_links_per_pair: 12,
        known_memory: &[(80, 81920), (40, 40960)],
    },
    ModelProfile {
        family: "L40S",
        sm_count: 142,
        pcie_sm_count: None,
        nvlink_links_per_pair: 0,
        known_memory: &[(48, 46068)],
    },
    ModelProfile {
        family: "L4",
        sm_count: 58,
        pcie_sm_count: None,
        nvlink_links_per_pair: 0,
        known_memory: &[(24, 23034)],
    },
];

/// The most memory a spec may give a GPU, in GB (read as GiB for unknown models): the control
/// plane's limit per GPU.
pub const SPEC_GIGABYTES_MAX: u64 = api::validate::GPU_MEMORY_BYTES_MAX >> 30;

/// PCI bus numbers of the eight GPUs of a DGX H100, reused in each PCI domain.
const BUS_NUMBERS: [u8; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

/// A parsed `COUNTxMODEL-MEMORY` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedSpec {
    pub count: u32,
    /// Upper case, as reported to the control plane (`H100-80GB`).
    pub model: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    /// 0 when the GPUs have no NVLink.
    pub nvlink_links_per_pair: u32,
}

impl SimulatedSpec {
    /// Parses `COUNTxMODEL-MEMORY`, e.g. `8xH100-80GB` or `2xL40S-48GB`.
    pub fn parse(spec: &str) -> Result<SimulatedSpec> {
        let spec = spec.trim();
        let (count_text, model_text) =
            spec.split_once(['x', 'X'])
                .ok_or_else(|| Error::SpecMalformed {
                    spec: spec.to_owned(),
                })?;
        // A model is a product name such as `H100-PCIE-80GB`: a space or a control character
        // (`8x H100-80GB`) is a typo, not an unknown product with no SMs.
        let model_character = |c: char| c.is_ascii_alphanumeric() || "-_.+".contains(c);
        if count_text.is_empty()
            || model_text.is_empty()
            || !model_text.chars().all(model_character)
        {
            return Err(Error::SpecMalformed {
                spec: spec.to_owned(),
            });
        }
        if !count_text.bytes().all(|byte| byte.is_ascii_digit()) {
            return Err(Error::SpecBadCount {
                spec: spec.to_owned(),
                count: count_text.to_owned(),
            });
        }
        // Saturate: a 30-digit count is "too many", not "not a number".
        let count = count_text.parse::<u64>().unwrap_or(u64::MAX);
        if count == 0 {
            return Err(Error::SpecZeroGpus {
                spec: spec.to_owned(),
            });
        }
        if count > MAX_GPUS_PER_NODE as u64 {
            return Err(Error::SpecTooManyGpus {
                spec: spec.to_owned(),
                count,
            });
        }
        let model = model_text.to_ascii_uppercase();
        let parts: Vec<&str> = model.split('-').collect();
        let family = parts[0];
        let memory_part = match parts.as_slice() {
            [_, .., last] if last.ends_with("GB") => *last,
            _ => {
                return Err(Error::SpecNoMemory {
                    spec: spec.to_owned(),
                    model,
                });
            }
        };
        let gigabytes = memory_part
            .strip_suffix("GB")
            .filter(|digits| !digits.is_empty() && digits.bytes().all(|byte| byte.is_ascii_digit()))
            .and_then(|digits| digits.parse::<u64>().ok())
            .filter(|&gigabytes| gigabytes > 0 && gigabytes <= SPEC_GIGABYTES_MAX)
            .ok_or_else(|| Error::SpecBadMemory {
                spec: spec.to_owned(),
                memory: memory_part.to_owned(),
            })?;
        if family.is_empty() {
            return Err(Error::SpecMalformed {
                spec: spec.to_owned(),
            });
        }
        let pcie = parts[1..parts.len() - 1].contains(&"PCIE");
        let profile = model_profile(family);
        let memory_mib = profile
            .and_then(|profile| profile.known_memory.iter().find(|(gb, _)| *gb == gigabytes))
            .map(|(_, mib)| *mib);
        let memory_bytes = match memory_mib {
            Some(mib) => mib << 20,
            None => gigabytes << 30,
        };
        let sm_count = profile.map_or(0, |profile| match (pcie, profile.pcie_sm_count) {
            (true, Some(pcie_sm_count)) => pcie_sm_count,
            _ => profile.sm_count,
        });
        let nvlink_links_per_pair = match profile {
            Some(profile) if !pcie => profile.nvlink_links_per_pair,
            _ => 0,
        };
        let parsed = SimulatedSpec {
            count: count as u32,
            model,
            memory_bytes,
            sm_count,
            nvlink_links_per_pair,
        };
        assert!(parsed.count >= 1 && parsed.memory_bytes > 0);
        Ok(parsed)
    }

    /// The GPUs of node `node` under this spec.
    pub fn inventory(&self, node: &str) -> Inventory {
        let count = self.count;
        let gpus = (0..count)
            .map(|index| {
                let nvlink_peers = if self.nvlink_links_per_pair == 0 {
                    Vec::new()
                } else {
                    (0..count)
                        .filter(|&peer| peer != index)
                        .map(|peer| NvlinkPeer {
                            gpu_index: peer,
                            link_count: self.nvlink_links_per_pair,
                        })
                        .collect()
                };
                let numa_node = if count >= 4 && index >= count.div_ceil(2) {
                    1
                } else {
                    0
                };
                GpuInfo {
                    uuid: simulated_uuid(node, index),
                    index,
                    model: self.model.clone(),
                    memory_bytes: self.memory_bytes,
                    sm_count: self.sm_count,
                    nvlink_peers,
                    numa_node,
                    pci_bus_id: simulated_pci_bus_id(index),
                    nearest_nics: vec![format!("mlx5_{}", index / 2)],
                    device_minor: None,
                }
            })
            .collect::<Vec<_>>();
        Inventory {
            node: node.to_owned(),
            host: super::host::simulated(&gpus),
            gpus,
            simulated: true,
            driver_version: None,
            skipped: Vec::new(),
        }
    }
}

/// The profile of a model family (`H100`), case-insensitive, or of a full model name
/// (`H100-80GB`, whose first part is the family).
pub fn model_profile(model: &str) -> Option<&'static ModelProfile> {
    let family = model.split('-').next().unwrap_or_default();
    MODELS
        .iter()
        .find(|profile| profile.family.eq_ignore_ascii_case(family))
}

/// The PCI bus id the simulator gives GPU `index`: DGX H100 bus numbers, eight per PCI domain.
pub fn simulated_pci_bus_id(index: u32) -> String {
    let domain = index / BUS_NUMBERS.len() as u32;
    let bus = BUS_NUMBERS[index as usize % BUS_NUMBERS.len()];
    format!("{domain:04x}:{bus:02x}:00.0")
}

/// A uuid shaped like NVML's (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`), derived only from the
/// node name and the GPU index. The hash is spelled out here (FNV-1a, then a SplitMix64 finish)
/// rather than taken from `std`, whose hasher may change between Rust releases: these uuids must
/// stay the same across agent upgrades.
pub fn simulated_uuid(node: &str, index: u32) -> String {
    let key = format!("vgpu-simulated-gpu/{node}/{index}");
    let high = stable_hash64(0x5eed_0001, key.as_bytes());
    let low = stable_hash64(0x5eed_0002, key.as_bytes());
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

fn stable_hash64(seed: u64, bytes: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = FNV_OFFSET ^ seed.wrapping_mul(FNV_PRIME);
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    // SplitMix64 finish, so that nearby keys spread over all bits.
    hash = hash.wrapping_add(0x9e37_79b9_7f4a_7c15);
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn parse_error(spec: &str) -> String {
        SimulatedSpec::parse(spec).unwrap_err().to_string()
    }

    #[test]
    fn parses_known_products() {
        let h100 = SimulatedSpec::parse("8xH100-80GB").unwrap();
        assert_eq!(
            h100,
            SimulatedSpec {
                count: 8,
                model: "H100-80GB".into(),
                memory_bytes: 81559 << 20,
                sm_count: 132,
                nvlink_links_per_pair: 18
            }
        );
        let h200 = SimulatedSpec::parse("4xH200-141GB").unwrap();
        assert_eq!(
            (
                h200.count,
                h200.memory_bytes,
                h200.sm_count,
                h200.nvlink_links_per_pair
            ),
            (4, 143771 << 20, 132, 18)
        );
        let a100 = SimulatedSpec::parse("8xA100-80GB").unwrap();
        assert_eq!(
            (a100.memory_bytes, a100.sm_count, a100.nvlink_links_per_pair),
            (81920 << 20, 108, 12)
        );
        let l40s = SimulatedSpec::parse("2xL40S-48GB").unwrap();
        assert_eq!((l40s.sm_count, l40s.nvlink_links_per_pair), (142, 0));
        let l4 = SimulatedSpec::parse("1xl4-24gb").unwrap();
        assert_eq!(
            (l4.model.as_str(), l4.sm_count, l4.memory_bytes),
            ("L4-24GB", 58, 23034 << 20)
        );
        let one = SimulatedSpec::parse(" 1xH100-80GB ").unwrap();
        assert_eq!(one.count, 1);
    }

    #[test]
    fn unknown_products_and_sizes_fall_back() {
        let unknown = SimulatedSpec::parse("2xB200-192GB").unwrap();
        assert_eq!(
            (
                unknown.memory_bytes,
                unknown.sm_count,
                unknown.nvlink_links_per_pair
            ),
            (192 << 30, 0, 0)
        );
        let odd_size = SimulatedSpec::parse("2xH100-94GB").unwrap();
        assert_eq!((odd_size.memory_bytes, odd_size.sm_count), (94 << 30, 132));
        let pcie = SimulatedSpec::parse("2xH100-PCIE-80GB").unwrap();
        assert_eq!(
            (pcie.sm_count, pcie.nvlink_links_per_pair, pcie.memory_bytes),
            (114, 0, 81559 << 20)
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert_eq!(
            parse_error("0xH100-80GB"),
            "the GPU spec `0xH100-80GB` asks for 0 GPUs; a node needs at least 1, e.g. `1xH100-80GB`"
        );
        assert_eq!(
            parse_error("8xH100"),
            "the model `H100` in `8xH100` has no memory size; end it with the memory in GB, e.g. `H100-80GB`"
        );
        assert_eq!(
            parse_error("axb"),
            "the GPU count `a` in `axb` is not a number; write COUNTxMODEL-MEMORY such as `8xH100-80GB`"
        );
        assert_eq!(
            parse_error("999xH100-80GB"),
            "the GPU spec `999xH100-80GB` asks for 999 GPUs; the limit is 64 per node"
        );
        assert!(parse_error("99999999999999999999999xH100-80GB").contains("the limit is 64"));
        assert!(parse_error("65xH100-80GB").contains("asks for 65 GPUs"));
        assert!(SimulatedSpec::parse("64xH100-80GB").is_ok());
        for malformed in ["", "8", "H100-80GB", "8x", "x8"] {
            assert!(
                parse_error(malformed).starts_with("cannot read the GPU spec"),
                "{malformed}"
            );
        }
        assert!(parse_error("8xH100-GB").starts_with("the memory `GB`"));
        assert!(parse_error("8xH100-0GB").starts_with("the memory `0GB`"));
        assert!(parse_error("8xH100-8.5GB").starts_with("the memory `8.5GB`"));
        assert!(parse_error("8xH100-80GiB").contains("has no memory size"));
        assert!(parse_error("-1xH100-80GB").contains("is not a number"));
    }

    #[test]
    fn lays_out_an_sxm_server() {
        let inventory = SimulatedSpec::parse("8xH100-80GB")
            .unwrap()
            .inventory("node-a");
        inventory.assert_consistent();
        assert_eq!(inventory.gpus.len(), 8);
        let numa: Vec<i32> = inventory.gpus.iter().map(|gpu| gpu.numa_node).collect();
        assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
        let buses: Vec<&str> = inventory
            .gpus
            .iter()
            .map(|gpu| gpu.pci_bus_id.as_str())
            .collect();
        assert_eq!(buses[0], "0000:18:00.0");
        assert_eq!(buses[7], "0000:db:00.0");
        assert_eq!(inventory.gpus[3].nearest_nics, ["mlx5_1"]);
        for gpu in &inventory.gpus {
            assert_eq!(gpu.nvlink_peers.len(), 7);
            assert!(
                gpu.nvlink_peers
                    .iter()
                    .all(|peer| peer.link_count == 18 && peer.gpu_index != gpu.index)
            );
        }
        let pcie = SimulatedSpec::parse("2xL40S-48GB")
            .unwrap()
            .inventory("node-a");
        assert!(
            pcie.gpus
                .iter()
                .all(|gpu| gpu.nvlink_peers.is_empty() && gpu.numa_node == 0)
        );
        let big = SimulatedSpec::parse("64xH100-80GB")
            .unwrap()
            .inventory("node-a");
        big.assert_consistent();
        assert_eq!(big.gpus[63].pci_bus_id, "0007:db:00.0");
        let ids: BTreeSet<&str> = big.gpus.iter().map(|gpu| gpu.pci_bus_id.as_str()).collect();
        assert_eq!(ids.len(), 64);
    }

    #[test]
    fn uuids_are_deterministic_unique_and_shaped_like_nvml() {
        let first = SimulatedSpec::parse("8xH100-80GB")
            .unwrap()
            .inventory("node-a");
        let again = SimulatedSpec::parse("8xH100-80GB")
            .unwrap()
            .inventory("node-a");
        assert_eq!(first, again);
        let other = SimulatedSpec::parse("8xH100-80GB")
            .unwrap()
            .inventory("node-b");
        let mut all = BTreeSet::new();
        for gpu in first.gpus.iter().chain(&other.gpus) {
            assert!(all.insert(gpu.uuid.clone()), "duplicate uuid {}", gpu.uuid);
            let groups: Vec<&str> = gpu.uuid.strip_prefix("GPU-").unwrap().split('-').collect();
            let lengths: Vec<usize> = groups.iter().map(|group| group.len()).collect();
            assert_eq!(lengths, [8, 4, 4, 4, 12], "{}", gpu.uuid);
            assert!(groups.iter().all(|group| {
                group
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            }));
        }
        // Pinned: a change here would make every simulated node lose its tenants on upgrade.
        assert_eq!(simulated_uuid("node-a", 0), PINNED_UUID_NODE_A_0);
    }

    const PINNED_UUID_NODE_A_0: &str = "GPU-806cf6df-f9ba-3d46-3981-687fed78de8d";
}
