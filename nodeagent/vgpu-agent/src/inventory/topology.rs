//! Simulated GPUs from a topology file (`.toml` or `.json`), for layouts a `COUNTxMODEL` spec
//! cannot say: mixed models, NVLink islands, PCIe parts with NVLink bridges.
//!
//! ```toml
//! [nvlink]                       # optional: all-to-all NVLink inside each island
//! islands = [[0, 1, 2, 3], [4, 5, 6, 7]]
//! links_per_pair = 18
//!
//! [[gpus]]
//! index = 0                      # required, unique
//! model = "H100-80GB"            # required
//! memory = "81559MiB"            # required: a size string (api::size) or a number of bytes
//! sm_count = 132                 # default: from the simulator's model table, else 0
//! numa_node = 0                  # default: -1 (unknown)
//! pci_bus_id = "0000:18:00.0"    # default: as the simulator derives it from the index
//! nics = ["mlx5_0"]              # default: none
//! nvlink_peers = [{ gpu = 1, links = 18 }]   # default: none; adds to the islands
//! uuid = "GPU-..."               # default: derived from the node name and index
//! device_minor = 0               # default: none (CDI specs use the index)
//!
//! [host]                         # optional: what the node offers tenants besides GPUs
//! cpu_milli = 64000              # default: 16 CPUs a GPU (`host::simulated`); 0: not reported
//! memory_bytes = 549755813888    # default: 128 GiB a GPU; 0: not reported
//! ```
//!
//! The JSON form has the same fields. The output of `vgpu-agent inventory -o json` is itself a
//! valid topology file (`memory_bytes`, `nearest_nics` and `{gpu_index, link_count}` are accepted
//! as other spellings, and the top-level `node`, `simulated`, `driver_version` and `skipped` are
//! ignored), also when it came from a real node.
//!
//! NVLink is symmetric: a peer listed on one side only is added to the other side with a warning;
//! two sides that disagree on the link count are an error.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result, TopologyProblem};
use crate::inventory::simulated::{model_profile, simulated_pci_bus_id, simulated_uuid};
use crate::inventory::{GpuInfo, Inventory, MAX_GPUS_PER_NODE, NvlinkPeer};

/// Largest topology file the agent reads.
pub const TOPOLOGY_FILE_BYTES_MAX: u64 = 1 << 20;

/// The file as written, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyFile {
    /// Ignored: the node name comes from `--name`. Accepted so that `inventory -o json` output
    /// reads back.
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub nvlink: Option<NvlinkIslands>,
    #[serde(default)]
    pub gpus: Vec<GpuEntry>,
    /// Ignored, like `node`: accepted so that the inventory of a real node reads back.
    #[serde(default)]
    pub simulated: Option<bool>,
    #[serde(default)]
    pub driver_version: Option<String>,
    #[serde(default)]
    pub skipped: Option<serde::de::IgnoredAny>,
    /// The node's CPU and host memory; absent: the simulated default for its GPUs.
    #[serde(default)]
    pub host: Option<super::host::HostResources>,
}

/// All-to-all NVLink inside each island.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvlinkIslands {
    pub islands: Vec<Vec<u32>>,
    pub links_per_pair: u32,
}

/// One `[[gpus]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuEntry {
    pub index: u32,
    pub model: String,
    #[serde(alias = "memory_bytes")]
    pub memory: MemoryValue,
    #[serde(default)]
    pub sm_count: Option<u32>,
    #[serde(default)]
    pub numa_node: Option<i32>,
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    #[serde(default, alias = "nearest_nics")]
    pub nics: Vec<String>,
    #[serde(default)]
    pub nvlink_peers: Vec<PeerEntry>,
    #[serde(default)]
    pub uuid: Option<String>,
    /// `N` of `/dev/nvidiaN` for CDI specs; default: none (the index is used).
    #[serde(default)]
    pub device_minor: Option<u32>,
}

/// One entry of a GPU's `nvlink_peers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerEntry {
    #[serde(alias = "gpu")]
    pub gpu_index: u32,
    #[serde(alias = "links")]
    pub link_count: u32,
}

/// A memory size: a size string such as `"80GiB"`, or a number of bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryValue {
    Bytes(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for MemoryValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = MemoryValue;
            fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
                formatter.write_str("a size such as \"80GiB\" or a whole number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<MemoryValue, E> {
                Ok(MemoryValue::Bytes(value))
            }
            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<MemoryValue, E> {
                u64::try_from(value)
                    .map(MemoryValue::Bytes)
                    .map_err(|_| E::custom(format!("the memory size {value} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<MemoryValue, E> {
                Ok(MemoryValue::Text(value.to_owned()))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Reads and validates the topology file at `path` for node `node`. Returns the inventory and
/// warnings about what was repaired.
pub fn load(path: &Path, node: &str) -> Result<(Inventory, Vec<String>)> {
    let text = read_bounded(path)?;
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let file: TopologyFile = match extension.as_deref() {
        Some("toml") => toml::from_str(&text).map_err(|error| Error::TopologyParse {
            path: path.to_owned(),
            message: error.to_string(),
        })?,
        Some("json") => serde_json::from_str(&text).map_err(|error| Error::TopologyParse {
            path: path.to_owned(),
            message: error.to_string(),
        })?,
        _ => {
            return Err(Error::TopologyExtension {
                path: path.to_owned(),
            });
        }
    };
    build(file, node).map_err(|problem| Error::TopologyInvalid {
        path: path.to_owned(),
        problem,
    })
}

fn read_bounded(path: &Path) -> Result<String> {
    let read_error = |source| Error::TopologyRead {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut text = String::new();
    file.take(TOPOLOGY_FILE_BYTES_MAX + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > TOPOLOGY_FILE_BYTES_MAX {
        return Err(Error::TopologyParse {
            path: path.to_owned(),
            message: format!("the file is larger than {TOPOLOGY_FILE_BYTES_MAX} bytes"),
        });
    }
    Ok(text)
}

/// Validates a parsed file and fills in defaults. Pure: no I/O, no logging.
pub fn build(file: TopologyFile, node: &str) -> Result<(Inventory, Vec<String>), TopologyProblem> {
    let mut warnings = Vec::new();
    if let Some(named) = file.node.as_deref().filter(|named| *named != node) {
        warnings.push(format!(
            "the file describes node `{named}`; registering it as `{node}` (GPUs without a uuid get uuids of `{node}`)"
        ));
    }
    if file.gpus.is_empty() {
        return Err(TopologyProblem::NoGpus);
    }
    if file.gpus.len() > MAX_GPUS_PER_NODE {
        return Err(TopologyProblem::TooManyGpus(file.gpus.len()));
    }
    let mut entries: BTreeMap<u32, GpuEntry> = BTreeMap::new();
    for entry in file.gpus {
        let index = entry.index;
        if entries.insert(index, entry).is_some() {
            return Err(TopologyProblem::DuplicateIndex(index));
        }
    }

    // Directed links (from, to) -> link count, from both the peer lists and the islands.
    let mut links: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for (&index, entry) in &entries {
        for peer in &entry.nvlink_peers {
            let to = peer.gpu_index;
            if to == index {
                return Err(TopologyProblem::SelfPeer { index });
            }
            if !entries.contains_key(&to) {
                return Err(TopologyProblem::UnknownPeer { index, peer: to });
            }
            if peer.link_count == 0 {
                return Err(TopologyProblem::ZeroLinks { index, peer: to });
            }
            add_link(&mut links, index, to, peer.link_count)?;
        }
    }
    if let Some(nvlink) = &file.nvlink {
        if nvlink.links_per_pair == 0 && !nvlink.islands.is_empty() {
            return Err(TopologyProblem::ZeroLinksPerPair);
        }
        let mut seen = BTreeSet::new();
        for (island_number, island) in nvlink.islands.iter().enumerate() {
            for &member in island {
                if !entries.contains_key(&member) {
                    return Err(TopologyProblem::UnknownIslandMember {
                        island: island_number,
                        index: member,
                    });
                }
                if !seen.insert(member) {
                    return Err(TopologyProblem::OverlappingIslands { index: member });
                }
            }
            for &from in island {
                for &to in island.iter().filter(|&&to| to != from) {
                    add_link(&mut links, from, to, nvlink.links_per_pair)?;
                }
            }
        }
    }
    let one_sided: Vec<(u32, u32, u32)> = links
        .iter()
        .filter(|((from, to), _)| !links.contains_key(&(*to, *from)))
        .map(|(&(from, to), &count)| (from, to, count))
        .collect();
    for (from, to, count) in one_sided {
        warnings.push(format!(
            "GPU {from} lists NVLink peer {to} (NV{count}) but GPU {to} does not list {from}; assuming the link goes both ways"
        ));
        links.insert((to, from), count);
    }
    for (&(from, to), &forward) in &links {
        let backward = links[&(to, from)];
        if forward != backward {
            return Err(TopologyProblem::LinkCountMismatch {
                index: from.min(to),
                peer: from.max(to),
                forward,
                backward,
            });
        }
    }

    let mut uuids = BTreeSet::new();
    let mut pci_bus_ids = BTreeSet::new();
    let mut gpus = Vec::with_capacity(entries.len());
    for (index, entry) in entries {
        let model = entry.model.trim().to_owned();
        if model.is_empty() {
            return Err(TopologyProblem::EmptyModel { index });
        }
        let memory_bytes = match &entry.memory {
            MemoryValue::Bytes(bytes) => *bytes,
            MemoryValue::Text(text) => api::size::parse_bytes(text)
                .map_err(|source| TopologyProblem::BadMemory { index, source })?,
        };
        if memory_bytes == 0 {
            return Err(TopologyProblem::ZeroMemory { index });
        }
        if memory_bytes > api::validate::GPU_MEMORY_BYTES_MAX {
            return Err(TopologyProblem::TooMuchMemory {
                index,
                bytes: memory_bytes,
            });
        }
        let uuid = entry
            .uuid
            .filter(|uuid| !uuid.trim().is_empty())
            .unwrap_or_else(|| simulated_uuid(node, index));
        if !uuids.insert(uuid.clone()) {
            return Err(TopologyProblem::Duplicate {
                index,
                what: "uuid",
                value: uuid,
            });
        }
        let pci_bus_id = entry
            .pci_bus_id
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| simulated_pci_bus_id(index));
        if !pci_bus_ids.insert(pci_bus_id.clone()) {
            return Err(TopologyProblem::Duplicate {
                index,
                what: "PCI bus id",
                value: pci_bus_id,
            });
        }
        let nvlink_peers = links
            .range((index, 0)..=(index, u32::MAX))
            .map(|(&(_, to), &link_count)| NvlinkPeer {
                gpu_index: to,
                link_count,
            })
            .collect();
        gpus.push(GpuInfo {
            uuid,
            index,
            sm_count: entry
                .sm_count
                .unwrap_or_else(|| model_profile(&model).map_or(0, |profile| profile.sm_count)),
            model,
            memory_bytes,
            nvlink_peers,
            numa_node: entry.numa_node.unwrap_or(-1),
            pci_bus_id,
            nearest_nics: entry.nics,
            device_minor: entry.device_minor,
        });
    }
    let inventory = Inventory {
        node: node.to_owned(),
        host: file.host.unwrap_or_else(|| super::host::simulated(&gpus)),
        gpus,
        simulated: true,
        driver_version: None,
        skipped: Vec::new(),
    };
    inventory.assert_consistent();
    Ok((inventory, warnings))
}

fn add_link(
    links: &mut BTreeMap<(u32, u32), u32>,
    from: u32,
    to: u32,
    count: u32,
) -> Result<(), TopologyProblem> {
    assert!(from != to && count > 0);
    match links.insert((from, to), count) {
        Some(previous) if previous != count => Err(TopologyProblem::LinkCountMismatch {
            index: from.min(to),
            peer: from.max(to),
            forward: previous,
            backward: count,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn examples() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
    }

    fn from_toml(text: &str) -> Result<(Inventory, Vec<String>), TopologyProblem> {
        build(
            toml::from_str(text).expect("the test TOML parses"),
            "node-a",
        )
    }

    fn gpu_toml(index: u32, extra: &str) -> String {
        format!("[[gpus]]\nindex = {index}\nmodel = \"H100-80GB\"\nmemory = \"80GiB\"\n{extra}\n")
    }

    #[test]
    fn the_two_island_example_parses() {
        let (inventory, warnings) =
            load(&examples().join("two-islands-8xH100.toml"), "node-a").unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(inventory.gpus.len(), 8);
        let peers = |index: usize| -> Vec<u32> {
            inventory.gpus[index]
                .nvlink_peers
                .iter()
                .map(|peer| peer.gpu_index)
                .collect()
        };
        assert_eq!(peers(0), [1, 2, 3]);
        assert_eq!(peers(5), [4, 6, 7]);
        assert!(
            inventory
                .gpus
                .iter()
                .all(|gpu| gpu.nvlink_peers.iter().all(|peer| peer.link_count == 18))
        );
        assert_eq!(inventory.gpus[0].memory_bytes, 81559 << 20);
        assert_eq!(inventory.gpus[4].numa_node, 1);
        assert_eq!(inventory.gpus[0].sm_count, 132);
        assert_eq!(inventory.gpus[0].uuid, simulated_uuid("node-a", 0));
    }

    #[test]
    fn the_json_example_parses() {
        let (inventory, warnings) =
            load(&examples().join("mixed-a100-pairs-and-l4.json"), "node-b").unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let models: Vec<&str> = inventory
            .gpus
            .iter()
            .map(|gpu| gpu.model.as_str())
            .collect();
        assert_eq!(
            models,
            [
                "A100-80GB",
                "A100-80GB",
                "A100-80GB",
                "A100-80GB",
                "L4-24GB",
                "L4-24GB"
            ]
        );
        assert_eq!(
            inventory.gpus[0].nvlink_peers,
            [NvlinkPeer {
                gpu_index: 1,
                link_count: 12
            }]
        );
        assert_eq!(
            inventory.gpus[3].nvlink_peers,
            [NvlinkPeer {
                gpu_index: 2,
                link_count: 12
            }]
        );
        assert!(inventory.gpus[4].nvlink_peers.is_empty());
        assert_eq!(inventory.gpus[4].memory_bytes, 24_000_000_000);
        assert_eq!(inventory.gpus[0].memory_bytes, 85_899_345_920);
        assert_eq!(inventory.gpus[5].sm_count, 58);
    }

    #[test]
    fn a_file_may_give_the_host_capacity_else_gpus_give_the_default() {
        let (plain, _) = from_toml(&(gpu_toml(0, "") + &gpu_toml(1, ""))).unwrap();
        assert_eq!(plain.host, crate::inventory::host::simulated(&plain.gpus));
        assert_eq!(plain.host.cpu_milli, 32_000);
        let text = gpu_toml(0, "") + "[host]\ncpu_milli = 96000\nmemory_bytes = 1099511627776\n";
        let (given, _) = from_toml(&text).unwrap();
        assert_eq!(given.host.cpu_milli, 96_000);
        assert_eq!(given.host.memory_bytes, 1 << 40);
    }

    #[test]
    fn inventory_json_reads_back_as_a_topology_file() {
        let original = crate::inventory::InventorySource::from_simulate_arg("8xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        let json = serde_json::to_string_pretty(&original).unwrap();
        let (read_back, warnings) = build(serde_json::from_str(&json).unwrap(), "node-a").unwrap();
        assert!(warnings.is_empty());
        assert_eq!(read_back, original);
        // Under another name the GPUs keep the file's uuids, with a warning.
        let (renamed, warnings) = build(serde_json::from_str(&json).unwrap(), "node-b").unwrap();
        assert_eq!(renamed.gpus, original.gpus);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
    }

    #[test]
    fn one_sided_links_are_mirrored_with_a_warning() {
        let text = gpu_toml(0, "nvlink_peers = [{ gpu = 1, links = 4 }]") + &gpu_toml(1, "");
        let (inventory, warnings) = from_toml(&text).unwrap();
        assert_eq!(
            inventory.gpus[1].nvlink_peers,
            [NvlinkPeer {
                gpu_index: 0,
                link_count: 4
            }]
        );
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].contains("GPU 0 lists NVLink peer 1"),
            "{}",
            warnings[0]
        );
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let cases: Vec<(String, TopologyProblem)> = vec![
            (String::new(), TopologyProblem::NoGpus),
            (
                gpu_toml(0, "") + &gpu_toml(0, ""),
                TopologyProblem::DuplicateIndex(0),
            ),
            (
                gpu_toml(0, "nvlink_peers = [{ gpu = 7, links = 4 }]"),
                TopologyProblem::UnknownPeer { index: 0, peer: 7 },
            ),
            (
                gpu_toml(0, "nvlink_peers = [{ gpu = 0, links = 4 }]"),
                TopologyProblem::SelfPeer { index: 0 },
            ),
            (
                gpu_toml(0, "nvlink_peers = [{ gpu = 1, links = 0 }]") + &gpu_toml(1, ""),
                TopologyProblem::ZeroLinks { index: 0, peer: 1 },
            ),
            (
                gpu_toml(0, "nvlink_peers = [{ gpu = 1, links = 4 }]")
                    + &gpu_toml(1, "nvlink_peers = [{ gpu = 0, links = 6 }]"),
                TopologyProblem::LinkCountMismatch {
                    index: 0,
                    peer: 1,
                    forward: 4,
                    backward: 6,
                },
            ),
            (
                "[nvlink]\nislands = [[0, 5]]\nlinks_per_pair = 18\n".to_owned() + &gpu_toml(0, ""),
                TopologyProblem::UnknownIslandMember {
                    island: 0,
                    index: 5,
                },
            ),
            (
                "[nvlink]\nislands = [[0, 1], [1]]\nlinks_per_pair = 18\n".to_owned()
                    + &gpu_toml(0, "")
                    + &gpu_toml(1, ""),
                TopologyProblem::OverlappingIslands { index: 1 },
            ),
            (
                "[nvlink]\nislands = [[0, 1]]\nlinks_per_pair = 0\n".to_owned()
                    + &gpu_toml(0, "")
                    + &gpu_toml(1, ""),
                TopologyProblem::ZeroLinksPerPair,
            ),
            (
                "[nvlink]\nislands = [[0, 1]]\nlinks_per_pair = 18\n".to_owned()
                    + &gpu_toml(0, "nvlink_peers = [{ gpu = 1, links = 4 }]")
                    + &gpu_toml(1, ""),
                TopologyProblem::LinkCountMismatch {
                    index: 0,
                    peer: 1,
                    forward: 4,
                    backward: 18,
                },
            ),
            (
                gpu_toml(0, "uuid = \"GPU-1\"") + &gpu_toml(1, "uuid = \"GPU-1\""),
                TopologyProblem::Duplicate {
                    index: 1,
                    what: "uuid",
                    value: "GPU-1".into(),
                },
            ),
            (
                // GPU 1 gets the derived id 0000:2a:00.0, which GPU 0 already has.
                gpu_toml(0, "pci_bus_id = \"0000:2a:00.0\"") + &gpu_toml(1, ""),
                TopologyProblem::Duplicate {
                    index: 1,
                    what: "PCI bus id",
                    value: "0000:2a:00.0".into(),
                },
            ),
            (
                "[[gpus]]\nindex = 0\nmodel = \" \"\nmemory = 1\n".to_owned(),
                TopologyProblem::EmptyModel { index: 0 },
            ),
            (
                "[[gpus]]\nindex = 0\nmodel = \"X\"\nmemory = 0\n".to_owned(),
                TopologyProblem::ZeroMemory { index: 0 },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(from_toml(&text).unwrap_err(), expected, "{text}");
        }
        let bad_size =
            from_toml("[[gpus]]\nindex = 0\nmodel = \"X\"\nmemory = \"80 parsecs\"\n").unwrap_err();
        assert!(matches!(
            bad_size,
            TopologyProblem::BadMemory { index: 0, .. }
        ));
        assert!(bad_size.to_string().contains("unknown unit"), "{bad_size}");
        let too_many: String = (0..65).map(|index| gpu_toml(index, "")).collect();
        assert_eq!(
            from_toml(&too_many).unwrap_err(),
            TopologyProblem::TooManyGpus(65)
        );
    }

    #[test]
    fn files_that_do_not_parse_name_the_file_and_the_place() {
        let directory = tempfile::tempdir().unwrap();
        let typo = directory.path().join("typo.toml");
        std::fs::write(
            &typo,
            "[[gpus]]\nindex = 0\nmodel = \"X\"\nmemroy = \"1GiB\"\n",
        )
        .unwrap();
        let error = load(&typo, "node-a").unwrap_err().to_string();
        assert!(
            error.contains("typo.toml") && error.contains("memroy"),
            "{error}"
        );
        let negative = directory.path().join("negative.json");
        std::fs::write(
            &negative,
            r#"{"gpus": [{"index": 0, "model": "X", "memory": -5}]}"#,
        )
        .unwrap();
        let error = load(&negative, "node-a").unwrap_err().to_string();
        assert!(error.contains("negative"), "{error}");
        let missing = load(&directory.path().join("missing.toml"), "node-a").unwrap_err();
        assert!(matches!(missing, Error::TopologyRead { .. }), "{missing}");
        let invalid = directory.path().join("invalid.json");
        std::fs::write(&invalid, r#"{"gpus": []}"#).unwrap();
        let error = load(&invalid, "node-a").unwrap_err().to_string();
        assert!(
            error.contains("invalid.json") && error.contains("lists no GPUs"),
            "{error}"
        );
    }
}
