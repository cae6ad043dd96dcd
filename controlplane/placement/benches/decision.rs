//! Decision-time bench: how long one Submit takes on a large, busy pool.
//!
//! Pools of 1,000 and 10,000 nodes x 8 H100-80GB (all pairs NVLink-connected) are filled to 80%
//! of GPU compute with the mix of `common::draw_shape` (60% fractions of 0.1/0.25/0.5 GPU, 40%
//! whole 1/2/4/8 GPUs weighted 40/25/20/15); requests that do not fit while filling are
//! withdrawn. Then, for each scorer, `DECISIONS` Submits of the same mix are timed one by one
//! (after `WARMUP` untimed ones); each is released right after (untimed), so the load stays at
//! 80%. Prints p50/p99/max per decision and the share of decisions that were Pending.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-placement cargo bench -p placement --bench decision`
//! (add `-- --quick` for 1,000 nodes only, `-- --fill 0.95` for another fill share, `-- --by-shape`
//! for percentiles per request shape, `-- --constrained` for whole-node constraints: every node
//! reports 96 CPUs and 1 TiB, every fourth node has A100-80GB GPUs, and requests ask for CPU
//! and host memory, 10% CPU-heavy, 30% allowing only some models, drawn from a second PRNG so the
//! GPU shapes are the same as without).

mod common;

use common::{GIB, H100_MEMORY_BYTES, Rng, Shape, draw_shape, node_spec, request};
use placement::{Command, Constraints, Engine, EngineConfig, Event, HostCapacity, Request, Scorer};
use std::time::{Duration, Instant};

const WARMUP: usize = 500;
const DECISIONS: usize = 5_000;
const FILL_SHARE: f64 = 0.80;
const PENDING_DECISIONS: usize = 200;
/// Bounds the fill loop (a pool that cannot reach the target share stops here).
const FILL_ATTEMPTS_MAX: usize = 2_000_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|arg| arg == "--quick");
    let fill_share = args
        .iter()
        .position(|arg| arg == "--fill")
        .map_or(FILL_SHARE, |at| args[at + 1].parse().expect("--fill SHARE"));
    let sizes: &[usize] = if quick { &[1_000] } else { &[1_000, 10_000] };
    let constrained = args.iter().any(|arg| arg == "--constrained");
    println!("| nodes x GPUs | scorer | fill (s) | p50 (us) | p99 (us) | max (us) | pending |");
    println!("|---|---|---|---|---|---|---|");
    for &nodes in sizes {
        for scorer in [Scorer::Fragmentation, Scorer::BestFit] {
            run(nodes, scorer, fill_share, constrained);
        }
    }
}

/// CPU and host memory for `shape` (2..=8 CPUs per GPU, at least 1; 10% CPU-heavy, 8..=32 CPUs;
/// 4 GiB per CPU) and, for 30%, the allowed models.
fn draw_constraints(rng: &mut Rng, shape: Shape) -> Constraints {
    let gpus = f64::from(shape.0 * shape.1) / 1000.0;
    let cpus = if rng.weighted(&[90, 10]) == 0 {
        (gpus * (2 + rng.next_u64() % 7) as f64).max(1.0)
    } else {
        (8 + rng.next_u64() % 25) as f64
    };
    let cpu_milli = (cpus * 1000.0).round() as u64;
    let gpu_models = match rng.weighted(&[70, 10, 10, 10]) {
        0 => vec![],
        1 => vec!["H100-80GB"],
        2 => vec!["A100-80GB"],
        _ => vec!["A100-80GB", "H100-80GB"],
    };
    Constraints {
        cpu_milli,
        host_memory_bytes: cpu_milli * 4 * GIB / 1000,
        gpu_models: gpu_models.into_iter().map(str::to_string).collect(),
    }
}

fn run(node_count: usize, scorer: Scorer, fill_share: f64, constrained: bool) {
    let mut engine = Engine::new(EngineConfig {
        scorer,
        ..EngineConfig::default()
    });
    for index in 0..node_count {
        let model = if constrained && index % 4 == 3 {
            "A100-80GB"
        } else {
            "H100-80GB"
        };
        let spec = node_spec(
            &format!("node-{index:05}"),
            8,
            model,
            H100_MEMORY_BYTES,
            "all",
        );
        let host = if constrained {
            HostCapacity {
                cpu_milli: Some(96_000),
                memory_bytes: Some(1024 * GIB),
            }
        } else {
            HostCapacity::default()
        };
        assert!(engine.handle(Event::RegisterNode { spec, host }).is_empty());
    }
    let mut rng = Rng::new(42);
    let mut constraints_rng = Rng::new(43);
    let mut submit = |tenant: String, request: Request, shape: Shape, seq: u64| {
        let constraints = if constrained {
            draw_constraints(&mut constraints_rng, shape)
        } else {
            Constraints::default()
        };
        Event::SubmitConstrained {
            tenant,
            request,
            constraints,
            seq,
        }
    };
    let mut seq = 0u64;
    let fill_started = Instant::now();
    let gpus_total = engine.summary().gpus_total as f64;
    // Tracked from the Bind commands: `summary()` is O(pool), too slow to call per submit.
    let mut compute_allocated_percent = 0u64;
    for _ in 0..FILL_ATTEMPTS_MAX {
        if compute_allocated_percent as f64 / 100.0 >= fill_share * gpus_total {
            break;
        }
        seq += 1;
        let tenant = format!("fill-{seq}");
        let shape = draw_shape(&mut rng);
        let commands = engine.handle(submit(tenant.clone(), request(shape, 0), shape, seq));
        match commands.as_slice() {
            [Command::Bind { slices, .. }] => {
                compute_allocated_percent += slices
                    .iter()
                    .map(|slice| u64::from(slice.compute_percent))
                    .sum::<u64>();
            }
            _ => {
                engine.handle(Event::Release { tenant });
            }
        }
    }
    let fill_s = fill_started.elapsed().as_secs_f64();
    assert_eq!(
        engine.summary().compute_allocated_percent,
        compute_allocated_percent
    );
    let share = compute_allocated_percent as f64 / 100.0 / gpus_total;
    assert!(share >= fill_share - 0.01, "filled to {share}");
    engine.check_invariants();
    let empty_nodes = engine
        .nodes()
        .iter()
        .filter(|node| node.usage.iter().all(|usage| usage.tenants.is_empty()))
        .count();

    let mut times: Vec<Duration> = Vec::with_capacity(DECISIONS);
    let mut pending = 0usize;
    let mut by_shape: std::collections::BTreeMap<common::Shape, Vec<Duration>> = Default::default();
    for round in 0..WARMUP + DECISIONS {
        seq += 1;
        let tenant = format!("probe-{seq}");
        let shape = draw_shape(&mut rng);
        let event = submit(tenant.clone(), request(shape, 0), shape, seq);
        let started = Instant::now();
        let commands = engine.handle(event);
        let elapsed = started.elapsed();
        assert_eq!(commands.len(), 1);
        if round >= WARMUP {
            times.push(elapsed);
            by_shape.entry(shape).or_default().push(elapsed);
            pending += usize::from(matches!(commands[0], Command::Pending { .. }));
        }
        engine.handle(Event::Release { tenant });
    }
    engine.check_invariants();
    times.sort();
    let percentile =
        |p: f64| times[((times.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6;
    let what = if constrained { ", constrained" } else { "" };
    println!(
        "| {node_count} x 8{what} | {scorer:?} | {fill_s:.1} | {:.0} | {:.0} | {:.0} | {:.1}% |",
        percentile(0.50),
        percentile(0.99),
        percentile(1.0),
        100.0 * pending as f64 / DECISIONS as f64
    );
    // The slow path: a gang of 8-GPU nodes, one more than there are empty nodes, so every
    // decision is Pending after the search, the static check, the preemption search and the
    // reason (each a pass over the pool).
    let mut pending_times: Vec<Duration> = Vec::with_capacity(PENDING_DECISIONS);
    for _ in 0..PENDING_DECISIONS {
        seq += 1;
        let tenant = format!("gang-{seq}");
        let gang = Request {
            nodes: empty_nodes as u32 + 1,
            ..request((1000, 8), 0)
        };
        let started = Instant::now();
        let commands = engine.handle(Event::Submit {
            tenant: tenant.clone(),
            request: gang,
            seq,
        });
        pending_times.push(started.elapsed());
        assert!(
            matches!(commands.as_slice(), [Command::Pending { .. }]),
            "{commands:?}"
        );
        engine.handle(Event::Release { tenant });
    }
    pending_times.sort();
    let pending_percentile = |p: f64| {
        pending_times[((pending_times.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6
    };
    println!(
        "| {node_count} x 8, Pending {}x8 gang | {scorer:?} | | {:.0} | {:.0} | {:.0} | 100% |",
        empty_nodes + 1,
        pending_percentile(0.50),
        pending_percentile(0.99),
        pending_percentile(1.0)
    );
    if std::env::args().any(|arg| arg == "--by-shape") {
        for (shape, mut times) in by_shape {
            times.sort();
            let p99 = times[((times.len() - 1) as f64 * 0.99).round() as usize].as_secs_f64() * 1e6;
            let p50 = times[times.len() / 2].as_secs_f64() * 1e6;
            println!(
                "|   shape {shape:?} | n={} | | {p50:.0} | {p99:.0} | | |",
                times.len()
            );
        }
    }
}
