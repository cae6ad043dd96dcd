//! Fragmentation bench: how much of the pool is allocated when the first request fails to place,
//! Fragmentation (FGD-style) vs BestFit, on the same traces.
//!
//! Replay: events are taken in time order (a departure before an arrival at the same second);
//! an arrival is a Submit; one that does not place at once (Pending) counts as failed and is
//! withdrawn (Release), so both scorers see the same offered load; a departure releases the
//! tenant if it was placed. Reported per trace: the allocated share (sum of allocated compute /
//! total GPUs) at the first failure, the share of arrivals that failed, and the mean allocated
//! share at failures.
//!
//! Traces (formats in `common/mod.rs` and docs/benchmarks.md): by default the bench generates
//! `SEEDS` synthetic traces for a 64-node x 8 H100 pool and writes them as CSV under the cargo
//! target tmp dir, then reads them back (the same path a converted public trace takes), and also
//! replays the committed sample in `traces/` when present. Generator: the `common::draw_shape`
//! mix (60% fractions of 0.1/0.25/0.5 GPU, 40% whole 1/2/4/8 GPUs weighted 40/25/20/15, memory
//! proportional); Poisson arrivals whose rate rises linearly so the offered load (rate x mean
//! duration x mean GPUs) goes from 50% to 150% of the pool over `RAMP_S`; exponential durations
//! with mean `DURATION_MEAN_S`. A second profile, `Awkward`, draws sizes that pack badly (see
//! `Profile`).
//!
//! Run: `CARGO_TARGET_DIR=/work/target-placement cargo bench -p placement --bench fragmentation`
//! Own CSVs: `... --bench fragmentation -- --nodes nodes.csv --requests requests.csv`
//! Regenerate the committed sample: `... --bench fragmentation -- --write-sample`

mod common;

use common::{
    H100_MEMORY_BYTES, Rng, TraceRequest, draw_shape, parse_nodes, parse_requests, request,
    write_nodes, write_requests,
};
use placement::{Command, Engine, EngineConfig, Event, NodeSpec, Scorer};
use std::path::{Path, PathBuf};

const SEEDS: [u64; 5] = [1, 2, 3, 4, 5];
const POOL_NODES: usize = 64;
const RAMP_S: f64 = 6.0 * 3600.0;
const DURATION_MEAN_S: f64 = 3600.0;
const LOAD_START: f64 = 0.5;
const LOAD_END: f64 = 1.5;
/// Mean GPUs per task of the mix: 0.6 x (0.1+0.25+0.5)/3 + 0.4 x (0.4x1 + 0.25x2 + 0.2x4 + 0.15x8).
const MEAN_GPUS_PER_TASK: f64 = 0.6 * (0.85 / 3.0) + 0.4 * 2.9;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value_of = |flag: &str| {
        args.iter()
            .position(|arg| arg == flag)
            .map(|at| args[at + 1].clone())
    };
    let sample_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    if args.iter().any(|arg| arg == "--write-sample") {
        write_trace(&sample_dir, "sample", 1, Profile::Typical);
        println!("wrote {}", sample_dir.display());
        return;
    }
    println!(
        "| trace | scorer | allocated at first failure | arrivals failed | allocated at failures (mean) |"
    );
    println!("|---|---|---|---|---|");
    if let (Some(nodes), Some(requests)) = (value_of("--nodes"), value_of("--requests")) {
        replay_both(&nodes, Path::new(&nodes), Path::new(&requests));
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("placement-traces");
    for profile in [Profile::Typical, Profile::Awkward] {
        for seed in SEEDS {
            let (nodes, requests) =
                write_trace(&dir, &format!("{profile:?}-seed{seed}"), seed, profile);
            replay_both(&format!("{profile:?} seed {seed}"), &nodes, &requests);
        }
    }
    let (nodes, requests) = (
        sample_dir.join("sample-nodes.csv"),
        sample_dir.join("sample-requests.csv"),
    );
    if nodes.exists() && requests.exists() {
        replay_both("traces/sample", &nodes, &requests);
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
}

impl Profile {
    fn draw(self, rng: &mut Rng) -> (u32, u32) {
        match self {
            Profile::Typical => draw_shape(rng),
            Profile::Awkward => {
                if rng.weighted(&[70, 30]) == 0 {
                    ([300, 600, 700][rng.weighted(&[1, 1, 1])], 1)
                } else {
                    (1000, [1, 2, 4, 8][rng.weighted(&[20, 20, 20, 40])])
                }
            }
        }
    }

    fn mean_gpus_per_task(self) -> f64 {
        match self {
            Profile::Typical => MEAN_GPUS_PER_TASK,
            Profile::Awkward => 0.7 * (1.6 / 3.0) + 0.3 * (0.2 + 0.4 + 0.8 + 3.2),
        }
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

fn replay_both(label: &str, nodes_path: &Path, requests_path: &Path) {
    let nodes = parse_nodes(&std::fs::read_to_string(nodes_path).expect("read nodes CSV"));
    let requests =
        parse_requests(&std::fs::read_to_string(requests_path).expect("read requests CSV"));
    for scorer in [Scorer::Fragmentation, Scorer::BestFit] {
        let result = replay(&nodes, &requests, scorer);
        println!(
            "| {label} ({} requests) | {scorer:?} | {:.1}% | {:.1}% | {:.1}% |",
            requests.len(),
            100.0 * result.share_at_first_failure,
            100.0 * result.failed as f64 / requests.len() as f64,
            100.0 * result.share_at_failures_sum / result.failed.max(1) as f64,
        );
    }
}

struct Replay {
    share_at_first_failure: f64,
    failed: usize,
    share_at_failures_sum: f64,
}

fn replay(nodes: &[NodeSpec], requests: &[TraceRequest], scorer: Scorer) -> Replay {
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
