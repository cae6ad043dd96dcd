//! Fragmentation bench: how much of the pool is allocated when the first request fails to place,
//! Fragmentation (FGD-style) vs BestFit, on the same traces.
//!
//! Replay: events are taken in time order (a departure before an arrival at the same second);
//! an arrival is a Submit; one that does not place at once (Pending) counts as failed and is
//! withdrawn (Release), so both scorers see the same offered load; a departure releases the
//! tenant if it was placed. Reported per trace: the allocated share (sum of allocated compute /
//! total GPUs) at the first failure, the share of arrivals that failed, and the mean allocated
//! share at failures; then, per mix, the mean, min and max over seeds and how many seeds each
//! scorer is ahead on (a difference of at most `TIE_POINTS` is a tie).
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
//! the fraction. Mixes: see `Profile`.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-placement cargo bench -p placement --bench fragmentation`
//! Other seeds: `... -- --seeds 11..80` (inclusive).
//! The pool at the first failure, per scorer: `... -- --diagnose Awkward 4`.
//! Own CSVs: `... --bench fragmentation -- --nodes nodes.csv --requests requests.csv`
//! Regenerate the committed sample: `... --bench fragmentation -- --write-sample`

mod common;

use common::{
    H100_MEMORY_BYTES, Rng, TraceRequest, draw_shape, parse_nodes, parse_requests, request,
    write_nodes, write_requests,
};
use placement::{Command, Engine, EngineConfig, Event, NodeSpec, Scorer};
use std::path::{Path, PathBuf};

const SEEDS: std::ops::RangeInclusive<u64> = 1..=10;
/// A difference of at most this many points of share counts as a tie.
const TIE_POINTS: f64 = 0.5;
const POOL_NODES: usize = 64;
const RAMP_S: f64 = 6.0 * 3600.0;
const DURATION_MEAN_S: f64 = 3600.0;
const LOAD_START: f64 = 0.5;
const LOAD_END: f64 = 1.5;

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
        replay_both(&nodes, Path::new(&nodes), Path::new(&requests));
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("placement-traces");
    if let (Some(mix), Some(seed)) = (value_of("--diagnose", 1), value_of("--diagnose", 2)) {
        let profile = PROFILES
            .into_iter()
            .find(|profile| format!("{profile:?}") == mix)
            .expect("--diagnose Typical|Awkward|Sharing SEED");
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
}

fn print_trace_header() {
    println!(
        "| trace | requests | Fragmentation: at first failure | BestFit: at first failure | arrivals failed (Frag / BestFit) | allocated at failures, mean (Frag / BestFit) |"
    );
    println!("|---|---|---|---|---|---|");
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
}

const PROFILES: [Profile; 3] = [Profile::Typical, Profile::Awkward, Profile::Sharing];

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
            Profile::Sharing => &[
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
            Profile::Sharing => {
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
    let nodes: Vec<_> = (0..POOL_NODES)
        .map(|index| {
            (
                format!("node-{index:03}"),
                8,
                "H100-80GB".to_string(),
                H100_MEMORY_BYTES,
                "all".to_string(),
            )
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
        });
    }
    let nodes_path = dir.join(format!("{stem}-nodes.csv"));
    let requests_path = dir.join(format!("{stem}-requests.csv"));
    std::fs::write(&nodes_path, write_nodes(&nodes)).expect("write nodes");
    std::fs::write(&requests_path, write_requests(&requests)).expect("write requests");
    (nodes_path, requests_path)
}

/// Replays one trace with each scorer and prints one row; returns (Fragmentation, BestFit).
fn replay_both(label: &str, nodes_path: &Path, requests_path: &Path) -> (Replay, Replay) {
    let nodes = parse_nodes(&std::fs::read_to_string(nodes_path).expect("read nodes CSV"));
    let requests =
        parse_requests(&std::fs::read_to_string(requests_path).expect("read requests CSV"));
    let fragmentation = replay(&nodes, &requests, Scorer::Fragmentation, false);
    let best_fit = replay(&nodes, &requests, Scorer::BestFit, false);
    let failed = |result: &Replay| 100.0 * result.failed as f64 / requests.len() as f64;
    let at_failures =
        |result: &Replay| 100.0 * result.share_at_failures_sum / result.failed.max(1) as f64;
    println!(
        "| {label} | {} | {:.1}% | {:.1}% | {:.1}% / {:.1}% | {:.1}% / {:.1}% |",
        requests.len(),
        100.0 * fragmentation.share_at_first_failure,
        100.0 * best_fit.share_at_first_failure,
        failed(&fragmentation),
        failed(&best_fit),
        at_failures(&fragmentation),
        at_failures(&best_fit),
    );
    (fragmentation, best_fit)
}

struct Replay {
    arrivals: usize,
    share_at_first_failure: f64,
    failed: usize,
    share_at_failures_sum: f64,
}

/// `diagnose`: print the first failed request and the pool at that moment.
fn replay(nodes: &[NodeSpec], requests: &[TraceRequest], scorer: Scorer, diagnose: bool) -> Replay {
    let mut engine = Engine::new(EngineConfig {
        scorer,
        ..EngineConfig::default()
    });
    for spec in nodes {
        engine.handle(Event::AddNode(spec.clone()));
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
    };
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
        let event = Event::Submit {
            tenant: tenant.clone(),
            request: request(shape, trace_request.memory_bytes),
            seq: index as u64,
        };
        match engine.handle(event).as_slice() {
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
