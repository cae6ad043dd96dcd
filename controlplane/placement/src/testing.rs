//! Builders for tests: node specs with common interconnects, and requests.

use crate::types::*;
use std::collections::BTreeMap;

pub(crate) const GIB: u64 = 1 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Interconnect {
    /// Every pair NVLink-connected (NVSwitch, like an H100 HGX board).
    All,
    /// No NVLink (PCIe only).
    None,
    /// Cliques of four: {0..3}, {4..7}, ...
    Islands4,
}

/// GPUs on two NUMA nodes (first half, second half); one NIC per pair of GPUs.
pub(crate) fn node_spec(
    name: &str,
    gpu_count: u32,
    memory_bytes: u64,
    interconnect: Interconnect,
) -> NodeSpec {
    let gpus = (0..gpu_count)
        .map(|index| {
            let nvlink_peers: BTreeMap<u32, u32> = (0..gpu_count)
                .filter(|&peer| {
                    peer != index
                        && match interconnect {
                            Interconnect::All => true,
                            Interconnect::None => false,
                            Interconnect::Islands4 => peer / 4 == index / 4,
                        }
                })
                .map(|peer| (peer, 18))
                .collect();
            GpuSpec {
                uuid: format!("GPU-{name}-{index}"),
                index,
                model: "H100-80GB".to_string(),
                memory_bytes,
                sm_count: 132,
                nvlink_peers,
                numa_node: if index * 2 < gpu_count { 0 } else { 1 },
                pci_bus_id: format!("0000:{:02x}:00.0", index + 1),
                nearest_nics: vec![format!("mlx5_{}", index / 2)],
            }
        })
        .collect();
    NodeSpec {
        name: name.to_string(),
        labels: BTreeMap::new(),
        gpus,
    }
}

pub(crate) fn with_labels(mut spec: NodeSpec, labels: &[(&str, &str)]) -> NodeSpec {
    spec.labels = labels
        .iter()
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect();
    spec
}

pub(crate) fn fraction(milli: u32) -> Request {
    Request {
        gpus: GpuCount::Milli(milli),
        nodes: 1,
        memory_bytes_per_gpu: None,
        compute_percent: None,
        burst: false,
        priority: 0,
        preemptible: false,
        nvlink: NvlinkPolicy::Prefer,
        node_selector: BTreeMap::new(),
    }
}

pub(crate) fn whole(gpus: u32) -> Request {
    Request {
        gpus: GpuCount::Whole(gpus),
        ..fraction(1)
    }
}

pub(crate) fn gang(nodes: u32, gpus: u32) -> Request {
    Request {
        nodes,
        ..whole(gpus)
    }
}

pub(crate) fn submit(tenant: &str, request: Request, seq: u64) -> Event {
    Event::Submit {
        tenant: tenant.to_string(),
        request,
        seq,
    }
}

pub(crate) fn slice(
    node: &str,
    gpu_index: u32,
    compute_percent: u32,
    memory_bytes: u64,
) -> SliceAssignment {
    SliceAssignment {
        node: node.to_string(),
        gpu_uuid: format!("GPU-{node}-{gpu_index}"),
        gpu_index,
        compute_percent,
        memory_bytes,
        guaranteed: true,
        burst: false,
    }
}

pub(crate) fn bind(tenant: &str, slices: Vec<SliceAssignment>) -> Command {
    Command::Bind {
        tenant: tenant.to_string(),
        slices,
    }
}

/// Hands `event` to `engine` and checks its invariants after it.
pub(crate) fn handle(engine: &mut crate::Engine, event: Event) -> Vec<Command> {
    let commands = engine.handle(event);
    engine.check_invariants();
    commands
}

pub(crate) fn pending(tenant: &str, reason: &str) -> Command {
    Command::Pending {
        tenant: tenant.to_string(),
        reason: reason.to_string(),
    }
}

pub(crate) fn reject(tenant: &str, reason: &str) -> Command {
    Command::Reject {
        tenant: tenant.to_string(),
        reason: reason.to_string(),
    }
}
