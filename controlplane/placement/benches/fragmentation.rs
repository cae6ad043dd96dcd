//! Fragmentation bench: how much of the pool is allocated when the first request fails to place,
//! and as the arrived load reaches 100/110/120/130% of the pool's GPUs, Fragmentation (FGD-style)
//! vs BestFit, on the same traces.
//!
//! Replay: events are taken in time order (a departure before an arrival at the same second);
//! an arrival is a Submit; one that does not place at once (Pending) counts as failed and is
//! withdrawn (Release), so both scorers see the same offered load; a departure releases the
//! tenant if it was placed. Reported per trace: the allocated share (sum of allocated compute /
//! total GPUs) at the first failure, the share of arrivals that failed, and the mean allocated
//! share at failures, and the allocated share right after the arrival that brings the arrived
//! load (GPUs asked by all arrivals so far, whether placed or not, over the pool's GPUs) to 100,
//! 110, 120 and 130% (`-` when the trace stops short): the field's usual measure (FGD, ATC'23),
//! which does not saturate when nothing departs. Then, per mix, the mean, min and max over seeds
//! and how many seeds each scorer is ahead on (a difference of at most `TIE_POINTS` is a tie).
//! Requests may ask for CPU, host memory and GPU models (`common/mod.rs`); they are hard
//! constraints for both scorers.
//!
//! The share at the first failure is a threshold measure: the first failure is nearly always a
//! whole-node (8-GPU) task arriving while no node is empty, so one empty node more or less at that
//! moment moves it by several points. Hence many seeds, and the two smoother columns.
//!
//! Traces (formats in `common/mod.rs` and docs/benchmarks.md): by default the bench generates
//! `SEEDS` synthetic traces per mix for a 64-node x 8 H100 pool and writes them as CSV under the
//! cargo target tmp dir, then reads them back (the same path a converted public trace takes), and
//! also replays the committed sample in `traces/` when present. Poisson arrivals whose rate rises
//! linearly so the offered load (rate x mean duration x mean GPUs) goes from 50% to 150% of the
//! pool over `RAMP_S`; exponential durations with mean `DURATION_MEAN_S`; memory proportional to
//! the fraction. Mixes: see `Profile`; `Constrained` is different: a mixed pool with CPU and host
//! memory, nothing departs, and arrivals stop past 135% of the pool.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-placement cargo bench -p placement --bench fragmentation`
//! Other seeds: `... -- --seeds 11..80` (inclusive).
//! The pool at the first failure, per scorer: `... -- --diagnose Awkward 4`.
//! Own CSVs: `... --bench fragmentation -- --nodes nodes.csv --requests requests.csv`
//! Regenerate the committed sample: `... --bench fragmentation -- --write-sample`

mod common;

use common::{
    GIB, H100_MEMORY_BYTES, NodeLine, Rng, TraceNode, TraceRequest, draw_shape, parse_nodes,
    parse_requests, request, write_nodes, write_requests,
};
use placement::{Command, Engine, EngineConfig, Event, Scorer};
use std::path::{Path, PathBuf};

const SEEDS: std::ops::RangeInclusive<u64> = 1..=10;
/// A difference of at most this many points of share counts as a tie.
const TIE_POINTS: f64 = 0.5;
const POOL_NODES: usize = 64;
const RAMP_S: f64 = 6.0 * 3600.0;
const DURATION_MEAN_S: f64 = 3600.0;
const LOAD_START: f64 = 0.5;
const LOAD_END: f64 = 1.5;
/// Arrived load (share of the pool's GPUs) at which the allocated share is reported.
const ARRIVED: [f64; 4] = [1.0, 1.1, 1.2, 1.3];
/// `Constrained` traces stop arriving past this arrived load.
const ARRIVED_END: f64 = 1.35;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value_of = |flag: &str, offset: usize| {
        args.iter()
            .position(|arg| arg == flag)
            .map(|at| args[at + offset].clone())
    };
    let sample_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    if args.iter().any(|arg| arg == "--write-sample") {
        write_trace(&sample_dir, "sample", 1, Profile::Typical);
        println!("wrote {}", sample_dir.display());
        return;
    }
    if let (Some(nodes), Some(requests)) = (value_of("--nodes", 1), value_of("--requests", 1)) {
        print_trace_header();
        let label = Path::new(&requests)
            .file_name()
            .map_or(requests.clone(), |name| name.to_string_lossy().into_owned());
        replay_both(&label, Path::new(&nodes), Path::new(&requests));
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("placement-traces");
    if let (Some(mix), Some(seed)) = (value_of("--diagnose", 1), value_of("--diagnose", 2)) {
        let profile = PROFILES
            .into_iter()
            .find(|profile| format!("{profile:?}") == mix)
            .expect("--diagnose Typical|Awkward|Sharing|Constrained SEED");
        let seed: u64 = seed.parse().expect("--diagnose MIX SEED");
        let (nodes, requests) = write_trace(&dir, &format!("{mix}-seed{seed}"), seed, profile);
        let nodes = parse_nodes(&std::fs::read_to_string(nodes).expect("read nodes CSV"));
        let requests =
            parse_requests(&std::fs::read_to_string(requests).expect("read requests CSV"));
        for scorer in [Scorer::Fragmentation, Scorer::BestFit] {
            println!("{scorer:?}:");
            replay(&nodes, &requests, scorer, true);
        }
        return;
    }
    let seeds = value_of("--seeds", 1).map_or(SEEDS, |range| {
        let (first, last) = range.split_once("..").expect("--seeds FIRST..LAST");
        first.parse().expect("--seeds FIRST")..=last.parse().expect("--seeds LAST")
    });
    print_trace_header();
    let mut by_profile: Vec<(Profile, Vec<(Replay, Replay)>)> = Vec::new();
    for profile in PROFILES {
        let mut results = Vec::new();
        for seed in seeds.clone() {
            let (nodes, requests) =
                write_trace(&dir, &format!("{profile:?}-seed{seed}"), seed, profile);
            results.push(replay_both(
                &format!("{profile:?} seed {seed}"),
                &nodes,
                &requests,
            ));
        }
        by_profile.push((profile, results));
    }
    let (nodes, requests) = (
        sample_dir.join("sample-nodes.csv"),
        sample_dir.join("sample-requests.csv"),
    );
    if nodes.exists() && requests.exists() {
        replay_both("traces/sample", &nodes, &requests);
    }
    println!();
    print_summary(&by_profile);
    println!();
    print_arrived_summary(&by_profile);
}

fn print_trace_header() {
    println!(
        "| trace | requests | Fragmentation: at first failure | BestFit: at first failure | arrivals failed (Frag / BestFit) | allocated at failures, mean (Frag / BestFit) | allocated at arrived 100/110/120/130%: Fragmentation | same: BestFit |"
    );
    println!("|---|---|---|---|---|---|---|---|");
}

/// `97.1 / 98.0 / - / -`.
fn arrived_text(result: &Replay) -> String {
    let values: Vec<String> = result
        .share_at_arrived
        .iter()
        .map(|share| {
            if share.is_nan() {
                "-".to_string()
            } else {
                format!("{:.1}", 100.0 * share)
            }
        })
        .collect();
    values.join(" / ")
}

/// One row per mix: the allocated share at each arrived load, mean over the seeds that reach it,
/// for each scorer; then the difference at 130% (mean [min, max]) and the seeds ahead / tied /
/// behind there.
fn print_arrived_summary(by_profile: &[(Profile, Vec<(Replay, Replay)>)]) {
    println!(
        "| mix | seeds reaching 130% | allocated at arrived 100/110/120/130%, mean: Fragmentation | same: BestFit | difference at 130%, points: mean [min, max] | Fragmentation ahead / tied / behind at 130% |"
    );
    println!("|---|---|---|---|---|---|");
    for (profile, results) in by_profile {
        let mean_at = |at: usize, pick: &dyn Fn(&(Replay, Replay)) -> &Replay| {
            let values: Vec<f64> = results
                .iter()
                .map(|pair| pick(pair).share_at_arrived[at])
                .filter(|share| !share.is_nan())
                .collect();
            if values.is_empty() {
                "-".to_string()
            } else {
                format!(
                    "{:.1}",
                    100.0 * values.iter().sum::<f64>() / values.len() as f64
                )
            }
        };
        let row = |pick: &dyn Fn(&(Replay, Replay)) -> &Replay| {
            (0..ARRIVED.len())
                .map(|at| mean_at(at, pick))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let last = ARRIVED.len() - 1;
        let differences: Vec<f64> = results
            .iter()
            .filter(|(frag, best)| {
                !frag.share_at_arrived[last].is_nan() && !best.share_at_arrived[last].is_nan()
            })
            .map(|(frag, best)| 100.0 * (frag.share_at_arrived[last] - best.share_at_arrived[last]))
            .collect();
        let (difference, tally) = if differences.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            let mean = differences.iter().sum::<f64>() / differences.len() as f64;
            let min = differences.iter().copied().fold(f64::INFINITY, f64::min);
            let max = differences
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            let ahead = differences.iter().filter(|&&d| d > TIE_POINTS).count();
            let behind = differences.iter().filter(|&&d| d < -TIE_POINTS).count();
            (
                format!("{mean:+.2} [{min:+.2}, {max:+.2}]"),
                format!(
                    "{ahead} / {} / {behind}",
                    differences.len() - ahead - behind
                ),
            )
        };
        println!(
            "| {profile:?} | {} | {} | {} | {difference} | {tally} |",
            differences.len(),
            row(&|(frag, _)| frag),
            row(&|(_, best)| best),
        );
    }
}

/// One row per mix: share at the first failure (mean [min, max]) for each scorer and for the
/// difference, seeds ahead / tied / behind, and the means of the two smoother measures.
fn print_summary(by_profile: &[(Profile, Vec<(Replay, Replay)>)]) {
    println!(
        "| mix | seeds | Fragmentation: at first failure, mean [min, max] | BestFit: same | difference, points: mean [min, max] | Fragmentation ahead / tied / behind | arrivals failed, mean (Frag / BestFit) | allocated at failures, mean (Frag / BestFit) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (profile, results) in by_profile {
        assert!(!results.is_empty());
        let stats = |pick: &dyn Fn(&(Replay, Replay)) -> f64| {
            let values: Vec<f64> = results.iter().map(pick).collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (mean, min, max)
        };
        let first = |result: &Replay| 100.0 * result.share_at_first_failure;
        let (frag_mean, frag_min, frag_max) = stats(&|(frag, _)| first(frag));
        let (best_mean, best_min, best_max) = stats(&|(_, best)| first(best));
        let (diff_mean, diff_min, diff_max) = stats(&|(frag, best)| first(frag) - first(best));
        let difference = |(frag, best): &(Replay, Replay)| first(frag) - first(best);
        let ahead = results
            .iter()
            .filter(|pair| difference(pair) > TIE_POINTS)
            .count();
        let behind = results
            .iter()
            .filter(|pair| difference(pair) < -TIE_POINTS)
            .count();
        let failed = |result: &Replay| 100.0 * result.failed as f64 / result.arrivals as f64;
        let at_failures =
            |result: &Replay| 100.0 * result.share_at_failures_sum / result.failed.max(1) as f64;
        println!(
            "| {profile:?} | {} | {frag_mean:.1}% [{frag_min:.1}, {frag_max:.1}] | {best_mean:.1}% [{best_min:.1}, {best_max:.1}] | {diff_mean:+.1} [{diff_min:+.1}, {diff_max:+.1}] | {ahead} / {} / {behind} | {:.2}% / {:.2}% | {:.1}% / {:.1}% |",
            results.len(),
            results.len() - ahead - behind,
            stats(&|(frag, _)| failed(frag)).0,
            stats(&|(_, best)| failed(best)).0,
            stats(&|(frag, _)| at_failures(frag)).0,
            stats(&|(_, best)| at_failures(best)).0,
        );
    }
}

/// Which task mix a synthetic trace draws from.
#[derive(Clone, Copy, Debug)]
enum Profile {
    /// `common::draw_shape`: 60% fractions of 0.1/0.25/0.5 GPU, 40% whole 1/2/4/8 GPUs weighted
    /// 40/25/20/15.
    Typical,
    /// Sizes that pack badly: 70% fractions of 0.3/0.6/0.7 GPU (equally likely), 30% whole
    /// 1/2/4/8 GPUs weighted 20/20/20/40 (many full-node jobs).
    Awkward,
    /// Shaped like a GPU-sharing cluster trace (many small fractional tasks, a long tail of
    /// whole-GPU tasks): 80% fractions of 0.05/0.1/0.2/0.25/0.3/0.5 GPU weighted 10/25/20/15/10/20,
    /// 20% whole 1/2/4/8 GPUs weighted 60/20/12/8.
    Sharing,
    /// Shaped like a public heterogeneous GPU-cluster trace: the `Sharing` shapes on a mixed
    /// pool (`constrained_pool`: H100 and A100 nodes of 8 GPUs, V100 nodes of 4, CPU-rich T4
    /// nodes of 2) whose CPU binds. Each task asks 2..=8 CPUs per GPU (at least 1 CPU) and 4 GiB
    /// of host memory per CPU; 10% are CPU-heavy (8..=32 CPUs, whatever their GPUs); 30% allow
    /// only some models (a third H100 only, a third A100 only, a third H100 or A100). Nothing
    /// departs; arrivals stop past `ARRIVED_END` of the pool's GPUs.
    Constrained,
}

const PROFILES: [Profile; 4] = [
    Profile::Typical,
    Profile::Awkward,
    Profile::Sharing,
    Profile::Constrained,
];

impl Profile {
    /// `((gpus_milli, gpu_count), weight)`: whole GPUs are `gpus_milli` 1000.
    fn shapes(self) -> &'static [((u32, u32), u32)] {
        match self {
            // The mix of `common::draw_shape`: 60% fractions (20% each), 40% whole GPUs split
            // 40/25/20/15 (16/10/8/6%), in units of 1/30,000.
            Profile::Typical => &[
                ((100, 1), 6_000),
                ((250, 1), 6_000),
                ((500, 1), 6_000),
                ((1000, 1), 4_800),
                ((1000, 2), 3_000),
                ((1000, 4), 2_400),
                ((1000, 8), 1_800),
            ],
            // 70% fractions (70 each of 210), 30% whole (90 split 20/20/20/40).
            Profile::Awkward => &[
                ((300, 1), 70),
                ((600, 1), 70),
                ((700, 1), 70),
                ((1000, 1), 18),
                ((1000, 2), 18),
                ((1000, 4), 18),
                ((1000, 8), 36),
            ],
            Profile::Sharing | Profile::Constrained => &[
                ((50, 1), 800),
                ((100, 1), 2_000),
                ((200, 1), 1_600),
                ((250, 1), 1_200),
                ((300, 1), 800),
                ((500, 1), 1_600),
                ((1000, 1), 1_200),
                ((1000, 2), 400),
                ((1000, 4), 240),
                ((1000, 8), 160),
            ],
        }
    }

    fn draw(self, rng: &mut Rng) -> (u32, u32) {
        match self {
            // Kept on the shared draw so the Typical traces match the decision bench's mix.
            Profile::Typical => draw_shape(rng),
            // Two draws (fraction or whole, then which), as the traces were first generated.
            Profile::Awkward => {
                if rng.weighted(&[70, 30]) == 0 {
                    ([300, 600, 700][rng.weighted(&[1, 1, 1])], 1)
                } else {
                    (1000, [1, 2, 4, 8][rng.weighted(&[20, 20, 20, 40])])
                }
            }
            Profile::Sharing | Profile::Constrained => {
                let weights: Vec<u32> = self.shapes().iter().map(|(_, weight)| *weight).collect();
                self.shapes()[rng.weighted(&weights)].0
            }
        }
    }

    fn mean_gpus_per_task(self) -> f64 {
        let total: u32 = self.shapes().iter().map(|(_, weight)| weight).sum();
        let gpus: f64 = self
            .shapes()
            .iter()
            .map(|&((milli, count), weight)| f64::from(milli * count) / 1000.0 * f64::from(weight))
            .sum();
        gpus / f64::from(total)
    }
}

/// Writes `{stem}-nodes.csv` and `{stem}-requests.csv`.
fn write_trace(dir: &Path, stem: &str, seed: u64, profile: Profile) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).expect("create trace dir");
    let (nodes, requests) = match profile {
        Profile::Constrained => constrained_trace(seed),
        _ => ramp_trace(seed, profile),
    };
    let nodes_path = dir.join(format!("{stem}-nodes.csv"));
    let requests_path = dir.join(format!("{stem}-requests.csv"));
    std::fs::write(&nodes_path, write_nodes(&nodes)).expect("write nodes");
    std::fs::write(&requests_path, write_requests(&requests)).expect("write requests");
    (nodes_path, requests_path)
}

/// `POOL_NODES` x 8 H100 without host capacity; Poisson arrivals on the load ramp, exponential
/// durations.
fn ramp_trace(seed: u64, profile: Profile) -> (Vec<NodeLine>, Vec<TraceRequest>) {
    let nodes: Vec<NodeLine> = (0..POOL_NODES)
        .map(|index| NodeLine {
            name: format!("node-{index:03}"),
            gpu_count: 8,
            model: "H100-80GB".to_string(),
            memory_bytes: H100_MEMORY_BYTES,
            nvlink: "all".to_string(),
            cpu_milli: 0,
            memory_mib: 0,
        })
        .collect();
    let gpus_total = (POOL_NODES * 8) as f64;
    let mut rng = Rng::new(seed);
    let mut requests: Vec<TraceRequest> = Vec::new();
    let ramp_s = RAMP_S;
    let mut now_s = 0.0;
    // Bounded by the ramp length: the rate is at least LOAD_START x pool / (duration x GPUs).
    while now_s < ramp_s {
        let load = LOAD_START + (LOAD_END - LOAD_START) * now_s / ramp_s;
        let rate_per_s = load * gpus_total / (DURATION_MEAN_S * profile.mean_gpus_per_task());
        now_s += rng.exponential(1.0 / rate_per_s);
        let (gpus_milli, gpu_count) = profile.draw(&mut rng);
        let duration_s = rng.exponential(DURATION_MEAN_S).max(1.0);
        requests.push(TraceRequest {
            name: format!("r{:05}", requests.len()),
            arrival_s: now_s,
            departure_s: now_s + duration_s,
            gpus_milli,
            gpu_count,
            memory_bytes: 0,
            cpu_milli: 0,
            memory_mib: 0,
            gpu_models: Vec::new(),
        });
    }
    (nodes, requests)
}

/// (count, GPUs per node, model, GPU memory GiB, nvlink, CPUs, host memory GiB) of the
/// `Constrained` pool: 400 GPUs on 64 nodes, 4, 8, 12 and 48 CPUs per GPU.
const CONSTRAINED_POOL: [(usize, u32, &str, u64, &str, u64, u64); 4] = [
    (24, 8, "H100-80GB", 80, "all", 96, 1024),
    (16, 8, "A100-40GB", 40, "all", 64, 512),
    (16, 4, "V100-32GB", 32, "none", 16, 128),
    (8, 2, "T4-16GB", 16, "none", 96, 384),
];

fn constrained_trace(seed: u64) -> (Vec<NodeLine>, Vec<TraceRequest>) {
    let mut nodes = Vec::new();
    for (count, gpu_count, model, memory_gib, nvlink, cpus, host_gib) in CONSTRAINED_POOL {
        for _ in 0..count {
            nodes.push(NodeLine {
                name: format!("node-{:03}", nodes.len()),
                gpu_count,
                model: model.to_string(),
                memory_bytes: memory_gib * GIB,
                nvlink: nvlink.to_string(),
                cpu_milli: cpus * 1000,
                memory_mib: host_gib * 1024,
            });
        }
    }
    let gpus_milli_total: u64 = nodes
        .iter()
        .map(|node| u64::from(node.gpu_count) * 1000)
        .sum();
    let mut rng = Rng::new(seed);
    let mut requests: Vec<TraceRequest> = Vec::new();
    let mut arrived_milli = 0u64;
    // Bounded: every task asks at least 50 milli-GPUs.
    while (arrived_milli as f64) < ARRIVED_END * gpus_milli_total as f64 {
        let (gpus_milli, gpu_count) = Profile::Constrained.draw(&mut rng);
        let gpus = f64::from(gpus_milli * gpu_count) / 1000.0;
        let cpus = if rng.weighted(&[90, 10]) == 0 {
            (gpus * (2 + rng.next_u64() % 7) as f64).max(1.0)
        } else {
            (8 + rng.next_u64() % 25) as f64
        };
        let cpu_milli = (cpus * 1000.0).round() as u64;
        let gpu_models: Vec<String> = match rng.weighted(&[70, 10, 10, 10]) {
            0 => Vec::new(),
            1 => vec!["H100-80GB".to_string()],
            2 => vec!["A100-40GB".to_string()],
            _ => vec!["A100-40GB".to_string(), "H100-80GB".to_string()],
        };
        arrived_milli += u64::from(gpus_milli * gpu_count);
        requests.push(TraceRequest {
            name: format!("r{:05}", requests.len()),
            arrival_s: requests.len() as f64,
            departure_s: f64::INFINITY,
            gpus_milli,
            gpu_count,
            memory_bytes: 0,
            cpu_milli,
            memory_mib: cpu_milli * 4096 / 1000,
            gpu_models,
        });
    }
    (nodes, requests)
}

/// Replays one trace with each scorer and prints one row; returns (Fragmentation, BestFit).
fn replay_both(label: &str, nodes_path: &Path, requests_path: &Path) -> (Replay, Replay) {
    let nodes = parse_nodes(&std::fs::read_to_string(nodes_path).expect("read nodes CSV"));
    let requests =
        parse_requests(&std::fs::read_to_string(requests_path).expect("read requests CSV"));
    let fragmentation = replay(&nodes, &requests, Scorer::Fragmentation, false);
    let best_fit = replay(&nodes, &requests, Scorer::BestFit, false);
    assert_eq!(fragmentation.arrivals, best_fit.arrivals);
    let failed = |result: &Replay| 100.0 * result.failed as f64 / requests.len() as f64;
    let at_failures =
        |result: &Replay| 100.0 * result.share_at_failures_sum / result.failed.max(1) as f64;
    println!(
        "| {label} | {} | {:.1}% | {:.1}% | {:.1}% / {:.1}% | {:.1}% / {:.1}% | {} | {} |",
        requests.len(),
        100.0 * fragmentation.share_at_first_failure,
        100.0 * best_fit.share_at_first_failure,
        failed(&fragmentation),
        failed(&best_fit),
        at_failures(&fragmentation),
        at_failures(&best_fit),
        arrived_text(&fragmentation),
        arrived_text(&best_fit),
    );
    (fragmentation, best_fit)
}

struct Replay {
    arrivals: usize,
    share_at_first_failure: f64,
    failed: usize,
    share_at_failures_sum: f64,
    /// Allocated share right after the arrival that brought the arrived load to each of
    /// `ARRIVED`; NaN when the trace stops short.
    share_at_arrived: [f64; 4],
}

/// `diagnose`: print the first failed request and the pool at that moment.
fn replay(
    nodes: &[TraceNode],
    requests: &[TraceRequest],
    scorer: Scorer,
    diagnose: bool,
) -> Replay {
    let mut engine = Engine::new(EngineConfig {
        scorer,
        ..EngineConfig::default()
    });
    for node in nodes {
        engine.handle(Event::RegisterNode {
            spec: node.spec.clone(),
            host: node.host,
        });
    }
    let gpus_total = engine.summary().gpus_total as f64;
    // (time, 0 = departure first, request index)
    let mut timeline: Vec<(f64, u8, usize)> = Vec::with_capacity(requests.len() * 2);
    for (index, trace_request) in requests.iter().enumerate() {
        timeline.push((trace_request.arrival_s, 1, index));
        timeline.push((trace_request.departure_s, 0, index));
    }
    timeline.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut placed = vec![false; requests.len()];
    let mut compute_allocated_percent = 0u64;
    let mut result = Replay {
        arrivals: requests.len(),
        share_at_first_failure: f64::NAN,
        failed: 0,
        share_at_failures_sum: 0.0,
        share_at_arrived: [f64::NAN; 4],
    };
    let mut arrived_milli = 0u64;
    let mut thresholds_passed = 0usize;
    for (_, kind, index) in timeline {
        let trace_request = &requests[index];
        let tenant = trace_request.name.clone();
        if kind == 0 {
            if placed[index] {
                placed[index] = false;
                let slices = engine.slices(&tenant).expect("placed").to_vec();
                compute_allocated_percent -= slices
                    .iter()
                    .map(|slice| u64::from(slice.compute_percent))
                    .sum::<u64>();
                engine.handle(Event::Release { tenant });
            }
            continue;
        }
        let shape = (trace_request.gpus_milli, trace_request.gpu_count);
        let event = Event::SubmitConstrained {
            tenant: tenant.clone(),
            request: request(shape, trace_request.memory_bytes),
            constraints: trace_request.constraints(),
            seq: index as u64,
        };
        arrived_milli += trace_request.gpus_milli_total();
        let commands = engine.handle(event);
        match commands.as_slice() {
            [Command::Bind { slices, .. }] => {
                placed[index] = true;
                compute_allocated_percent += slices
                    .iter()
                    .map(|slice| u64::from(slice.compute_percent))
                    .sum::<u64>();
            }
            _ => {
                let share = compute_allocated_percent as f64 / 100.0 / gpus_total;
                if result.failed == 0 {
                    result.share_at_first_failure = share;
                    if diagnose {
                        print_pool(&engine, trace_request, share);
                    }
                }
                result.failed += 1;
                result.share_at_failures_sum += share;
                engine.handle(Event::Release { tenant });
            }
        }
        let arrived = arrived_milli as f64 / 1000.0 / gpus_total;
        while thresholds_passed < ARRIVED.len() && arrived >= ARRIVED[thresholds_passed] {
            result.share_at_arrived[thresholds_passed] =
                compute_allocated_percent as f64 / 100.0 / gpus_total;
            thresholds_passed += 1;
        }
    }
    engine.check_invariants();
    result
}

/// The failed request, then each node's allocated compute per GPU, and how many nodes have
/// 0..=8 fully free GPUs.
fn print_pool(engine: &Engine, failed: &TraceRequest, share: f64) {
    println!(
        "  first failure: {} ({} milli x {}) at {:.0} s, allocated {:.1}%",
        failed.name,
        failed.gpus_milli,
        failed.gpu_count,
        failed.arrival_s,
        100.0 * share
    );
    let mut nodes_by_fully_free = [0usize; 9];
    for node in engine.nodes() {
        let fully_free = node
            .usage
            .iter()
            .filter(|usage| usage.tenants.is_empty())
            .count();
        nodes_by_fully_free[fully_free.min(8)] += 1;
        let allocated: Vec<u32> = node
            .usage
            .iter()
            .map(|usage| usage.compute_allocated_percent)
            .collect();
        println!(
            "  {} fully free {fully_free}, allocated % {allocated:?}",
            node.spec.name
        );
    }
    println!("  nodes with 0..=8 fully free GPUs: {nodes_by_fully_free:?}");
}
