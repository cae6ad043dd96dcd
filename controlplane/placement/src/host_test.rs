//! Scenario tests of the whole-node constraints: CPU and host memory as hard constraints (search,
//! preemption, re-registration, reasons), GPU-model constraints, GPUs stranded behind exhausted
//! CPU in the fragmentation score, and the host state carried beside the engine's encoding.

use crate::testing::*;
use crate::*;
use std::collections::BTreeSet;

const CPU: u64 = 1000;

fn host(cpus: u64, memory_gib: u64) -> HostCapacity {
    HostCapacity {
        cpu_milli: Some(cpus * CPU),
        memory_bytes: Some(memory_gib * GIB),
    }
}

fn register(spec: NodeSpec, capacity: HostCapacity) -> Event {
    Event::RegisterNode {
        spec,
        host: capacity,
    }
}

fn asks(cpus: u64, memory_gib: u64, models: &[&str]) -> Constraints {
    Constraints {
        cpu_milli: cpus * CPU,
        host_memory_bytes: memory_gib * GIB,
        gpu_models: models.iter().map(|model| model.to_string()).collect(),
    }
}

fn submit_with(tenant: &str, request: Request, constraints: Constraints, seq: u64) -> Event {
    Event::SubmitConstrained {
        tenant: tenant.to_string(),
        request,
        constraints,
        seq,
    }
}

fn with_model(mut spec: NodeSpec, model: &str) -> NodeSpec {
    for gpu in &mut spec.gpus {
        gpu.model = model.to_string();
    }
    spec
}

fn engine_of(scorer: Scorer, nodes: Vec<(NodeSpec, HostCapacity)>) -> Engine {
    let mut engine = Engine::new(EngineConfig {
        scorer,
        ..EngineConfig::default()
    });
    for (spec, capacity) in nodes {
        assert_eq!(engine.handle(register(spec, capacity)), vec![]);
    }
    engine
}

fn one_node(cpus: u64, memory_gib: u64) -> Engine {
    engine_of(
        Scorer::Fragmentation,
        vec![(
            node_spec("a", 8, 80 * GIB, Interconnect::All),
            host(cpus, memory_gib),
        )],
    )
}

#[test]
fn cpu_beyond_what_is_free_waits_with_a_reason_naming_it() {
    let mut engine = one_node(16, 512);
    assert_eq!(
        handle(
            &mut engine,
            submit_with("t1", whole(1), asks(12, 0, &[]), 1)
        ),
        vec![bind("t1", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    // Seven GPUs are free, but only 4 CPUs.
    assert_eq!(
        handle(
            &mut engine,
            submit_with("t2", fraction(100), asks(8, 0, &[]), 2)
        ),
        vec![pending(
            "t2",
            "no Ready node has 8 CPUs free; the most free is a with 4 CPUs"
        )]
    );
    // A task that asks no CPU still fits.
    assert_eq!(handle(&mut engine, submit("t3", whole(1), 3)).len(), 1);
    // The release of t1 frees its CPUs: t2 is placed by the retry.
    let commands = handle(
        &mut engine,
        Event::Release {
            tenant: "t1".to_string(),
        },
    );
    assert!(
        matches!(commands.as_slice(), [Command::Released { .. }, Command::Bind { tenant, .. }] if tenant == "t2"),
        "{commands:?}"
    );
}

#[test]
fn cpu_or_host_memory_beyond_every_node_is_rejected_with_a_reason_naming_it() {
    let mut engine = one_node(16, 128);
    assert_eq!(
        handle(&mut engine, submit_with("c", whole(1), asks(32, 0, &[]), 1)),
        vec![reject(
            "c",
            "no node has 32 CPUs; the largest is a with 16 CPUs"
        )]
    );
    assert_eq!(
        handle(
            &mut engine,
            submit_with("m", fraction(500), asks(2, 256, &[]), 2)
        ),
        vec![reject(
            "m",
            "no node has 2 CPUs and 256GiB host memory; the largest is a with 16 CPUs and 128GiB host memory"
        )]
    );
    assert_eq!(
        handle(
            &mut engine,
            submit_with("g", gang(2, 1), asks(1, 0, &[]), 3)
        ),
        vec![reject("g", "2 nodes needed with 1 CPU, 1 node has it")]
    );
    // A node that reports nothing is unbounded.
    engine.handle(Event::AddNode(node_spec(
        "b",
        8,
        80 * GIB,
        Interconnect::All,
    )));
    let commands = handle(
        &mut engine,
        submit_with("c2", whole(1), asks(32, 0, &[]), 4),
    );
    assert!(
        matches!(commands.as_slice(), [Command::Bind { slices, .. }] if slices[0].node == "b"),
        "{commands:?}"
    );
}

#[test]
fn host_memory_beyond_what_is_free_waits_with_a_reason_naming_it() {
    let mut engine = one_node(64, 256);
    handle(
        &mut engine,
        submit_with("t1", whole(2), asks(0, 200, &[]), 1),
    );
    assert_eq!(
        handle(
            &mut engine,
            submit_with("t2", whole(1), asks(0, 100, &[]), 2)
        ),
        vec![pending(
            "t2",
            "no Ready node has 100GiB host memory free; the most free is a with 56GiB host memory"
        )]
    );
}

#[test]
fn model_constraints_pick_allowed_gpus_only() {
    let mixed = {
        let mut spec = node_spec("m", 4, 80 * GIB, Interconnect::All);
        for gpu in &mut spec.gpus {
            gpu.model = if gpu.index < 2 { "A100" } else { "H100" }.to_string();
        }
        spec
    };
    let mut engine = engine_of(
        Scorer::Fragmentation,
        vec![
            (
                with_model(node_spec("a", 2, 80 * GIB, Interconnect::All), "H100"),
                HostCapacity::default(),
            ),
            (mixed, HostCapacity::default()),
        ],
    );
    // Two A100s exist, both on m.
    assert_eq!(
        handle(
            &mut engine,
            submit_with("w", whole(2), asks(0, 0, &["A100"]), 1)
        ),
        vec![bind(
            "w",
            vec![slice("m", 0, 100, 80 * GIB), slice("m", 1, 100, 80 * GIB)]
        )]
    );
    assert_eq!(
        handle(
            &mut engine,
            submit_with("f", fraction(250), asks(0, 0, &["A100"]), 2)
        ),
        vec![pending(
            "f",
            "no GPU has 25% compute and 20GiB memory free; the most free is m GPU 0 with 0% compute and 0B"
        )]
    );
    // Several allowed models: either will do.
    let commands = handle(
        &mut engine,
        submit_with("g", fraction(250), asks(0, 0, &["A100", "H100"]), 3),
    );
    assert!(matches!(commands.as_slice(), [Command::Bind { .. }]));
    assert_eq!(
        handle(
            &mut engine,
            submit_with("b", whole(1), asks(0, 0, &["B200"]), 4)
        ),
        vec![reject("b", "no node has a GPU of model B200")]
    );
    assert_eq!(
        handle(
            &mut engine,
            submit_with("c", whole(3), asks(0, 0, &["A100"]), 5)
        ),
        vec![reject("c", "no node has 3 GPUs; the best is m with 2")]
    );
}

#[test]
fn preemption_frees_cpu_for_a_higher_priority_task() {
    let mut engine = one_node(16, 512);
    handle(
        &mut engine,
        submit_with("low", fraction(100), asks(12, 0, &[]), 1),
    );
    let mut high = whole(1);
    high.priority = 5;
    let commands = handle(&mut engine, submit_with("high", high, asks(8, 0, &[]), 2));
    assert_eq!(
        commands,
        vec![
            Command::Preempted {
                tenant: "low".to_string(),
                by: "high".to_string(),
                reason: "preempted by high (priority 5)".to_string(),
            },
            bind("high", vec![slice("a", 0, 100, 80 * GIB)]),
        ]
    );
    // A change of priority keeps the constraints: the victim still does not fit next to it.
    let commands = handle(
        &mut engine,
        Event::Update {
            tenant: "low".to_string(),
            compute_percent: None,
            priority: Some(1),
        },
    );
    assert_eq!(
        commands,
        vec![
            Command::Updated {
                tenant: "low".to_string(),
                slices: vec![]
            },
            pending(
                "low",
                "no Ready node has 12 CPUs free; the most free is a with 8 CPUs"
            ),
        ]
    );
    assert_eq!(engine.pending(), vec!["low".to_string()]);
}

#[test]
fn re_registration_with_less_cpu_than_used_replaces_the_tenants() {
    let mut engine = one_node(16, 512);
    handle(&mut engine, submit_with("t", whole(1), asks(12, 0, &[]), 1));
    // Same hardware, enough CPU: the tenant stays.
    assert_eq!(
        handle(
            &mut engine,
            register(
                node_spec("a", 8, 80 * GIB, Interconnect::All),
                host(12, 512)
            )
        ),
        vec![]
    );
    let commands = handle(
        &mut engine,
        register(node_spec("a", 8, 80 * GIB, Interconnect::All), host(8, 512)),
    );
    assert_eq!(
        commands,
        vec![
            Command::Unbound {
                tenant: "t".to_string(),
                reason: "node a re-registered with less CPU or host memory than its tenants use"
                    .to_string(),
            },
            pending("t", "no node is Ready"),
            pending(
                "t",
                "no Ready node has 12 CPUs free; the most free is a with 8 CPUs"
            ),
        ]
    );
}

/// Node a has 8 CPUs for 8 GPUs, node b 128: a CPU-heavy task strands a's GPUs, so the
/// Fragmentation scorer sends it to b and a GPU-only task to a; BestFit sees only GPUs and takes
/// the first node by name for both.
#[test]
fn gpus_stranded_behind_exhausted_cpu_count_in_the_fragmentation_score() {
    for scorer in [Scorer::Fragmentation, Scorer::BestFit] {
        let mut engine = engine_of(
            scorer,
            vec![
                (node_spec("a", 8, 80 * GIB, Interconnect::All), host(8, 512)),
                (
                    node_spec("b", 8, 80 * GIB, Interconnect::All),
                    host(128, 512),
                ),
                (
                    with_labels(
                        node_spec("c", 8, 80 * GIB, Interconnect::All),
                        &[("zone", "c")],
                    ),
                    host(128, 512),
                ),
            ],
        );
        // The mix: a GPU-heavy task (8 GPUs, 4 CPUs) fills c.
        let mut on_c = whole(8);
        on_c.node_selector = [("zone".to_string(), "c".to_string())].into();
        handle(
            &mut engine,
            submit_with("gpu-heavy", on_c, asks(4, 0, &[]), 1),
        );
        let node_of = |commands: &[Command]| match commands {
            [Command::Bind { slices, .. }] => slices[0].node.clone(),
            other => panic!("{other:?}"),
        };
        let cpu_heavy = handle(
            &mut engine,
            submit_with("cpu-heavy", whole(1), asks(8, 0, &[]), 2),
        );
        let gpu_only = handle(
            &mut engine,
            submit_with("gpu-only", whole(1), asks(0, 0, &[]), 3),
        );
        let expected = match scorer {
            Scorer::Fragmentation => ["b", "a"],
            Scorer::BestFit => ["a", "a"],
        };
        assert_eq!(
            [node_of(&cpu_heavy), node_of(&gpu_only)],
            expected,
            "{scorer:?}"
        );
    }
}

#[test]
fn the_host_state_travels_beside_the_encoding() {
    let mut engine = engine_of(
        Scorer::Fragmentation,
        vec![
            (
                node_spec("a", 8, 80 * GIB, Interconnect::All),
                host(16, 256),
            ),
            (
                node_spec("b", 8, 80 * GIB, Interconnect::All),
                HostCapacity::default(),
            ),
        ],
    );
    let plain = serde_json::to_string(&engine).unwrap();
    handle(
        &mut engine,
        submit_with("t1", whole(1), asks(12, 64, &["H100-80GB"]), 1),
    );
    handle(&mut engine, submit("t2", fraction(300), 2));
    // The encoding has no trace of host capacity or constraints: an engine without them encodes
    // as before, so the control plane's stored layouts decode unchanged.
    let json = serde_json::to_string(&engine).unwrap();
    assert!(
        !json.contains("cpu_milli") && !json.contains("gpu_models"),
        "{json}"
    );
    assert!(!plain.contains("host"));
    let state = engine.host_state();
    assert_eq!(state.nodes.keys().collect::<Vec<_>>(), vec!["a"]);
    assert_eq!(state.tenants.keys().collect::<Vec<_>>(), vec!["t1"]);
    let mut restored: Engine = serde_json::from_str(&json).unwrap();
    restored.restore_host_state(state);
    restored.check_invariants();
    assert_eq!(
        restored.node_host("a"),
        Some(NodeHost {
            capacity: host(16, 256),
            cpu_milli_used: 12 * CPU,
            memory_bytes_used: 64 * GIB,
        })
    );

    for seq in 3..6 {
        let event = submit_with(&format!("n{seq}"), fraction(500), asks(2, 32, &[]), seq);
        assert_eq!(
            handle(&mut engine, event.clone()),
            handle(&mut restored, event)
        );
    }
    assert_eq!(engine.host_state(), restored.host_state());
    assert_eq!(restored.constraints("t2"), Some(&Constraints::default()));
    let models: BTreeSet<String> = ["H100-80GB".to_string()].into();
    assert!(asks(0, 0, &["H100-80GB"]).gpu_models == models);
}

/// A100 node a and H100 node h; a tenant constrained to H100s holds two of h's GPUs. An
/// unconstrained whole GPU then goes to a under Fragmentation (it would take an H100 from the
/// tenants that need one, even though a is empty), to h under BestFit (fewest free GPUs left).
#[test]
fn unconstrained_tasks_leave_a_model_in_demand_to_those_that_need_it() {
    for scorer in [Scorer::Fragmentation, Scorer::BestFit] {
        let mut engine = engine_of(
            scorer,
            vec![
                (
                    with_model(node_spec("a", 8, 80 * GIB, Interconnect::All), "A100"),
                    HostCapacity::default(),
                ),
                (
                    with_model(node_spec("h", 8, 80 * GIB, Interconnect::All), "H100"),
                    HostCapacity::default(),
                ),
            ],
        );
        handle(
            &mut engine,
            submit_with("needs-h100", whole(2), asks(0, 0, &["H100"]), 1),
        );
        let commands = handle(&mut engine, submit("any", whole(1), 2));
        let [Command::Bind { slices, .. }] = commands.as_slice() else {
            panic!("{commands:?}")
        };
        let expected = match scorer {
            Scorer::Fragmentation => "a",
            Scorer::BestFit => "h",
        };
        assert_eq!(slices[0].node, expected, "{scorer:?}");
    }
}
