//! Shared by the placement benches: a tiny deterministic PRNG (splitmix64), the workload mix,
//! node specs, and the trace CSV formats (read and written).
//!
//! Nodes CSV, one node per line after a header line (`#` lines are comments):
//!   `name,gpu_count,gpu_model,gpu_memory_bytes[,nvlink]`
//!   nvlink: `all` (every pair linked, NVSwitch; the default), `none` (PCIe only) or `islands4`
//!   (cliques {0..3}, {4..7}, ...). GPUs 0..n/2 are NUMA node 0, the rest NUMA node 1.
//! Requests CSV, one request per line after a header line, sorted by arrival:
//!   `name,arrival_s,departure_s,gpus_milli,gpu_count,memory_bytes`
//!   gpus_milli: 1..=999 is a fraction of one GPU (gpu_count must be 1); 1000 means whole GPUs,
//!   gpu_count of them on one node (the Alibaba `openb` pod lists use the same pair of columns,
//!   `gpu_milli` and `num_gpu`). memory_bytes: per GPU; 0 means the default (the GPU's share for
//!   a fraction, the whole GPU for whole GPUs). Times are seconds (decimals allowed).

#![allow(dead_code)] // Each bench uses a different part.

use placement::{GpuCount, GpuSpec, NodeSpec, NvlinkPolicy, Request};
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub const GIB: u64 = 1 << 30;
pub const H100_MEMORY_BYTES: u64 = 80 * GIB;

/// splitmix64: deterministic, seedable, good enough for workload generation.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with the given mean.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Index drawn with the given weights.
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u32 = weights.iter().sum();
        let mut pick = (self.next_u64() % u64::from(total)) as u32;
        for (index, &weight) in weights.iter().enumerate() {
            if pick < weight {
                return index;
            }
            pick -= weight;
        }
        unreachable!("pick < total")
    }
}

/// One task shape of the mix: `(gpus_milli, gpu_count)` as in the requests CSV.
pub type Shape = (u32, u32);

/// The documented mix: 60% fractions (0.1, 0.25, 0.5 GPU, equally likely, memory proportional),
/// 40% whole GPUs (1, 2, 4, 8 with weights 40, 25, 20, 15).
pub fn draw_shape(rng: &mut Rng) -> Shape {
    if rng.weighted(&[60, 40]) == 0 {
        ([100, 250, 500][rng.weighted(&[1, 1, 1])], 1)
    } else {
        (1000, [1, 2, 4, 8][rng.weighted(&[40, 25, 20, 15])])
    }
}

pub fn request(shape: Shape, memory_bytes: u64) -> Request {
    let (gpus_milli, gpu_count) = shape;
    assert!((1..=1000).contains(&gpus_milli) && gpu_count >= 1);
    assert!(
        gpus_milli == 1000 || gpu_count == 1,
        "a fraction is of one GPU"
    );
    Request {
        gpus: if gpus_milli == 1000 {
            GpuCount::Whole(gpu_count)
        } else {
            GpuCount::Milli(gpus_milli)
        },
        nodes: 1,
        memory_bytes_per_gpu: if memory_bytes == 0 {
            None
        } else {
            Some(memory_bytes)
        },
        compute_percent: None,
        burst: false,
        priority: 0,
        preemptible: false,
        nvlink: NvlinkPolicy::Prefer,
        node_selector: BTreeMap::new(),
    }
}

pub fn node_spec(
    name: &str,
    gpu_count: u32,
    model: &str,
    memory_bytes: u64,
    nvlink: &str,
) -> NodeSpec {
    let linked = |a: u32, b: u32| match nvlink {
        "all" => true,
        "none" => false,
        "islands4" => a / 4 == b / 4,
        other => panic!("unknown nvlink value {other:?} (all, none, islands4)"),
    };
    let gpus = (0..gpu_count)
        .map(|index| GpuSpec {
            uuid: format!("GPU-{name}-{index}"),
            index,
            model: model.to_string(),
            memory_bytes,
            sm_count: 132,
            nvlink_peers: (0..gpu_count)
                .filter(|&peer| peer != index && linked(index, peer))
                .map(|peer| (peer, 18))
                .collect(),
            numa_node: if index * 2 < gpu_count { 0 } else { 1 },
            pci_bus_id: format!("0000:{:02x}:00.0", index + 1),
            nearest_nics: vec![format!("mlx5_{}", index / 2)],
        })
        .collect();
    NodeSpec {
        name: name.to_string(),
        labels: BTreeMap::new(),
        gpus,
    }
}

/// One request line of the requests CSV.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    pub name: String,
    pub arrival_s: f64,
    pub departure_s: f64,
    pub gpus_milli: u32,
    pub gpu_count: u32,
    pub memory_bytes: u64,
}

fn data_lines(text: &str) -> impl Iterator<Item = (usize, Vec<&str>)> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .skip(1) // The header.
        .map(|(number, line)| (number + 1, line.split(',').map(str::trim).collect()))
}

pub fn parse_nodes(text: &str) -> Vec<NodeSpec> {
    data_lines(text)
        .map(|(line, fields)| {
            assert!(
                fields.len() == 4 || fields.len() == 5,
                "nodes line {line}: 4 or 5 fields"
            );
            let number = |at: usize| {
                fields[at]
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("nodes line {line}: field {at}"))
            };
            node_spec(
                fields[0],
                number(1) as u32,
                fields[2],
                number(3),
                fields.get(4).copied().unwrap_or("all"),
            )
        })
        .collect()
}

pub fn parse_requests(text: &str) -> Vec<TraceRequest> {
    data_lines(text)
        .map(|(line, fields)| {
            assert_eq!(fields.len(), 6, "requests line {line}: 6 fields");
            let float = |at: usize| {
                fields[at]
                    .parse::<f64>()
                    .unwrap_or_else(|_| panic!("requests line {line}: field {at}"))
            };
            let integer = |at: usize| {
                fields[at]
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("requests line {line}: field {at}"))
            };
            TraceRequest {
                name: fields[0].to_string(),
                arrival_s: float(1),
                departure_s: float(2),
                gpus_milli: integer(3) as u32,
                gpu_count: integer(4) as u32,
                memory_bytes: integer(5),
            }
        })
        .collect()
}

pub fn write_nodes(nodes: &[(String, u32, String, u64, String)]) -> String {
    let mut text = String::from("name,gpu_count,gpu_model,gpu_memory_bytes,nvlink\n");
    for (name, gpu_count, model, memory_bytes, nvlink) in nodes {
        writeln!(text, "{name},{gpu_count},{model},{memory_bytes},{nvlink}").unwrap();
    }
    text
}

pub fn write_requests(requests: &[TraceRequest]) -> String {
    let mut text = String::from("name,arrival_s,departure_s,gpus_milli,gpu_count,memory_bytes\n");
    for request in requests {
        writeln!(
            text,
            "{},{:.1},{:.1},{},{},{}",
            request.name,
            request.arrival_s,
            request.departure_s,
            request.gpus_milli,
            request.gpu_count,
            request.memory_bytes
        )
        .unwrap();
    }
    text
}
