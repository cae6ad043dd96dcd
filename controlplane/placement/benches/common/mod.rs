//! Shared by the placement benches: a tiny deterministic PRNG (splitmix64), the workload mix,
//! node specs, and the trace CSV formats (read and written).
//!
//! Both CSVs have a header line that names the columns (in any order; `#` lines are comments).
//! Nodes CSV, one node per line:
//!   `name,gpu_count,gpu_model,gpu_memory_bytes[,nvlink][,cpu_milli][,memory_mib]`
//!   nvlink: `all` (every pair linked, NVSwitch; the default), `none` (PCIe only) or `islands4`
//!   (cliques {0..3}, {4..7}, ...). GPUs 0..n/2 are NUMA node 0, the rest NUMA node 1.
//!   cpu_milli, memory_mib: the node's CPU (millicores) and host memory (MiB); absent, empty or
//!   0: not reported (unbounded).
//! Requests CSV, one request per line, sorted by arrival:
//!   `name,arrival_s,departure_s,gpus_milli,gpu_count,memory_bytes[,cpu_milli][,memory_mib][,gpu_model]`
//!   gpus_milli: 1..=999 is a fraction of one GPU (gpu_count must be 1); 1000 means whole GPUs,
//!   gpu_count of them on one node (the Alibaba `openb` pod lists use the same pair of columns,
//!   `gpu_milli` and `num_gpu`). memory_bytes: per GPU; 0 means the default (the GPU's share for
//!   a fraction, the whole GPU for whole GPUs). Times are seconds (decimals allowed); an empty
//!   departure_s never departs. cpu_milli, memory_mib: CPU and host memory the task needs on its
//!   node (absent, empty or 0: none). gpu_model: the allowed GPU models, separated by `|`
//!   (absent or empty: any).

#![allow(dead_code)] // Each bench uses a different part.

use placement::{Constraints, GpuCount, GpuSpec, HostCapacity, NodeSpec, NvlinkPolicy, Request};
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub const GIB: u64 = 1 << 30;
pub const H100_MEMORY_BYTES: u64 = 80 * GIB;
pub const MIB: u64 = 1 << 20;

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
    /// 0: none.
    pub cpu_milli: u64,
    /// Host memory, MiB; 0: none.
    pub memory_mib: u64,
    /// Allowed GPU models; empty: any.
    pub gpu_models: Vec<String>,
}

impl TraceRequest {
    pub fn constraints(&self) -> Constraints {
        Constraints {
            cpu_milli: self.cpu_milli,
            host_memory_bytes: self.memory_mib * MIB,
            gpu_models: self.gpu_models.iter().cloned().collect(),
        }
    }

    /// GPUs asked, in thousandths.
    pub fn gpus_milli_total(&self) -> u64 {
        u64::from(self.gpus_milli) * u64::from(self.gpu_count)
    }
}

/// One node line of the nodes CSV.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceNode {
    pub spec: NodeSpec,
    pub host: HostCapacity,
}

/// One line of the nodes CSV, to write.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeLine {
    pub name: String,
    pub gpu_count: u32,
    pub model: String,
    pub memory_bytes: u64,
    pub nvlink: String,
    /// 0: not reported.
    pub cpu_milli: u64,
    /// 0: not reported.
    pub memory_mib: u64,
}

/// The header's column names, then the data lines (line number, fields).
fn table(text: &str) -> (Vec<String>, Vec<(usize, Vec<&str>)>) {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty() && !line.trim_start().starts_with('#'));
    let header: Vec<String> = lines
        .next()
        .map(|(_, line)| {
            line.split(',')
                .map(|name| name.trim().to_string())
                .collect()
        })
        .unwrap_or_default();
    let rows = lines
        .map(|(number, line)| (number + 1, line.split(',').map(str::trim).collect()))
        .collect();
    (header, rows)
}

/// Reads the fields of one table row by column name.
struct Row<'a> {
    what: &'static str,
    line: usize,
    header: &'a [String],
    fields: &'a [&'a str],
}

impl Row<'_> {
    fn optional(&self, column: &str) -> Option<&str> {
        let at = self.header.iter().position(|name| name == column)?;
        self.fields
            .get(at)
            .copied()
            .filter(|field| !field.is_empty())
    }

    fn text(&self, column: &str) -> &str {
        self.optional(column).unwrap_or_else(|| {
            panic!(
                "{} line {}: column {column} is missing or empty",
                self.what, self.line
            )
        })
    }

    fn integer(&self, column: &str) -> u64 {
        self.text(column).parse().unwrap_or_else(|_| {
            panic!(
                "{} line {}: column {column} is not an integer",
                self.what, self.line
            )
        })
    }

    fn integer_or_zero(&self, column: &str) -> u64 {
        self.optional(column).map_or(0, |_| self.integer(column))
    }

    fn float(&self, column: &str) -> f64 {
        self.text(column).parse().unwrap_or_else(|_| {
            panic!(
                "{} line {}: column {column} is not a number",
                self.what, self.line
            )
        })
    }
}

pub fn parse_nodes(text: &str) -> Vec<TraceNode> {
    let (header, rows) = table(text);
    rows.iter()
        .map(|(line, fields)| {
            let row = Row {
                what: "nodes",
                line: *line,
                header: &header,
                fields,
            };
            let reported = |value: u64| (value > 0).then_some(value);
            TraceNode {
                spec: node_spec(
                    row.text("name"),
                    row.integer("gpu_count") as u32,
                    row.text("gpu_model"),
                    row.integer("gpu_memory_bytes"),
                    row.optional("nvlink").unwrap_or("all"),
                ),
                host: HostCapacity {
                    cpu_milli: reported(row.integer_or_zero("cpu_milli")),
                    memory_bytes: reported(row.integer_or_zero("memory_mib") * MIB),
                },
            }
        })
        .collect()
}

pub fn parse_requests(text: &str) -> Vec<TraceRequest> {
    let (header, rows) = table(text);
    rows.iter()
        .map(|(line, fields)| {
            let row = Row {
                what: "requests",
                line: *line,
                header: &header,
                fields,
            };
            TraceRequest {
                name: row.text("name").to_string(),
                arrival_s: row.float("arrival_s"),
                departure_s: row
                    .optional("departure_s")
                    .map_or(f64::INFINITY, |_| row.float("departure_s")),
                gpus_milli: row.integer("gpus_milli") as u32,
                gpu_count: row.integer("gpu_count") as u32,
                memory_bytes: row.integer_or_zero("memory_bytes"),
                cpu_milli: row.integer_or_zero("cpu_milli"),
                memory_mib: row.integer_or_zero("memory_mib"),
                gpu_models: row
                    .optional("gpu_model")
                    .map(|models| {
                        models
                            .split('|')
                            .map(str::trim)
                            .filter(|model| !model.is_empty())
                            .map(str::to_string)
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        })
        .collect()
}

pub fn write_nodes(nodes: &[NodeLine]) -> String {
    let mut text =
        String::from("name,gpu_count,gpu_model,gpu_memory_bytes,nvlink,cpu_milli,memory_mib\n");
    for node in nodes {
        writeln!(
            text,
            "{},{},{},{},{},{},{}",
            node.name,
            node.gpu_count,
            node.model,
            node.memory_bytes,
            node.nvlink,
            node.cpu_milli,
            node.memory_mib
        )
        .unwrap();
    }
    text
}

pub fn write_requests(requests: &[TraceRequest]) -> String {
    let mut text = String::from(
        "name,arrival_s,departure_s,gpus_milli,gpu_count,memory_bytes,cpu_milli,memory_mib,gpu_model\n",
    );
    for request in requests {
        let departure = if request.departure_s.is_finite() {
            format!("{:.1}", request.departure_s)
        } else {
            String::new()
        };
        writeln!(
            text,
            "{},{:.1},{departure},{},{},{},{},{},{}",
            request.name,
            request.arrival_s,
            request.gpus_milli,
            request.gpu_count,
            request.memory_bytes,
            request.cpu_milli,
            request.memory_mib,
            request.gpu_models.join("|"),
        )
        .unwrap();
    }
    text
}
