//! Scenario tests of the engine: small pools, exact command vectors.

use crate::testing::*;
use crate::*;

fn engine_with(nodes: &[NodeSpec]) -> Engine {
    let mut engine = Engine::new(EngineConfig::default());
    for spec in nodes {
        assert_eq!(engine.handle(Event::AddNode(spec.clone())), vec![]);
    }
    engine
}

fn released(tenant: &str) -> Command {
    Command::Released {
        tenant: tenant.to_string(),
    }
}

fn with_priority(mut request: Request, priority: i32) -> Request {
    request.priority = priority;
    request
}

#[test]
fn two_halves_share_one_gpu() {
    let mut engine = engine_with(&[node_spec("a", 2, 80 * GIB, Interconnect::All)]);
    assert_eq!(
        handle(&mut engine, submit("t1", fraction(500), 1)),
        vec![bind("t1", vec![slice("a", 0, 50, 40 * GIB)])]
    );
    assert_eq!(
        handle(&mut engine, submit("t2", fraction(500), 2)),
        vec![bind("t2", vec![slice("a", 0, 50, 40 * GIB)])]
    );
    let usage = &engine.node("a").unwrap().usage;
    assert_eq!(usage[0].compute_allocated_percent, 100);
    assert_eq!(usage[0].tenants, vec!["t1".to_string(), "t2".to_string()]);
    assert_eq!(usage[1], GpuUsage::default());
}

#[test]
fn fractions_keep_whole_gpus_free() {
    let mut engine = engine_with(&[node_spec("a", 2, 80 * GIB, Interconnect::All)]);
    assert_eq!(
        handle(&mut engine, submit("w", whole(1), 1)),
        vec![bind("w", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    assert_eq!(
        handle(&mut engine, submit("f1", fraction(500), 2)),
        vec![bind("f1", vec![slice("a", 1, 50, 40 * GIB)])]
    );
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "w".to_string()
            }
        ),
        vec![released("w")]
    );
    // GPU 0 is fully free and first by index; the fraction still goes next to f1 on GPU 1.
    assert_eq!(
        handle(&mut engine, submit("f2", fraction(250), 3)),
        vec![bind("f2", vec![slice("a", 1, 25, 20 * GIB)])]
    );
    assert_eq!(
        handle(&mut engine, submit("w2", whole(1), 4)),
        vec![bind("w2", vec![slice("a", 0, 100, 80 * GIB)])]
    );
}

#[test]
fn fractions_leave_a_node_free_for_an_eight_gpu_job() {
    let mut engine = engine_with(&[
        node_spec("a", 8, 80 * GIB, Interconnect::All),
        node_spec("b", 8, 80 * GIB, Interconnect::All),
    ]);
    for (seq, tenant) in ["f1", "f2", "f3", "f4", "f5"].iter().enumerate() {
        let commands = handle(&mut engine, submit(tenant, fraction(250), seq as u64));
        // Four quarters fill a GPU of node a; the fifth opens a second GPU, still on node a.
        let gpu = if seq < 4 { 0 } else { 1 };
        assert_eq!(
            commands,
            vec![bind(tenant, vec![slice("a", gpu, 25, 20 * GIB)])],
            "{tenant}"
        );
    }
    let commands = handle(&mut engine, submit("big", whole(8), 10));
    assert_eq!(
        commands,
        vec![bind(
            "big",
            (0..8).map(|gpu| slice("b", gpu, 100, 80 * GIB)).collect()
        )]
    );
}

#[test]
fn whole_gpus_do_not_open_an_empty_node_for_a_better_topology() {
    // Node a keeps GPUs 1, 3, 5 and 7 free (two per NUMA node, no shared NIC); node b is empty,
    // so its GPUs 0..3 (one NUMA node, two NIC pairs) score better for a Prefer request.
    let setup = |scorer: Scorer| {
        let mut engine = Engine::new(EngineConfig {
            scorer,
            ..EngineConfig::default()
        });
        for name in ["a", "b"] {
            engine.handle(Event::AddNode(node_spec(
                name,
                8,
                80 * GIB,
                Interconnect::All,
            )));
        }
        for gpu in 0..8u64 {
            let tenant = format!("w{gpu}");
            let commands = handle(&mut engine, submit(&tenant, whole(1), gpu));
            assert_eq!(
                commands,
                vec![bind(&tenant, vec![slice("a", gpu as u32, 100, 80 * GIB)])]
            );
        }
        for gpu in [1, 3, 5, 7] {
            let tenant = format!("w{gpu}");
            assert_eq!(
                handle(
                    &mut engine,
                    Event::Release {
                        tenant: tenant.clone()
                    }
                ),
                vec![released(&tenant)]
            );
        }
        engine
    };
    // Fragmentation keeps node b whole for a node-sized task.
    let mut engine = setup(Scorer::Fragmentation);
    assert_eq!(
        handle(&mut engine, submit("four", whole(4), 10)),
        vec![bind(
            "four",
            [1, 3, 5, 7]
                .into_iter()
                .map(|gpu| slice("a", gpu, 100, 80 * GIB))
                .collect()
        )]
    );
    // BestFit (the baseline) follows the topology preference and opens node b.
    let mut engine = setup(Scorer::BestFit);
    assert_eq!(
        handle(&mut engine, submit("four", whole(4), 10)),
        vec![bind(
            "four",
            (0..4).map(|gpu| slice("b", gpu, 100, 80 * GIB)).collect()
        )]
    );
}

#[test]
fn nvlink_require_stays_inside_an_island() {
    let mut engine = engine_with(&[node_spec("a", 8, 80 * GIB, Interconnect::Islands4)]);
    let require = |gpus| Request {
        nvlink: NvlinkPolicy::Require,
        ..whole(gpus)
    };
    assert_eq!(
        handle(&mut engine, submit("one", whole(1), 1)),
        vec![bind("one", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    let commands = handle(&mut engine, submit("four", require(4), 2));
    assert_eq!(
        commands,
        vec![bind(
            "four",
            (4..8).map(|gpu| slice("a", gpu, 100, 80 * GIB)).collect()
        )]
    );
    let commands = handle(&mut engine, submit("five", require(5), 3));
    assert_eq!(
        commands,
        vec![reject(
            "five",
            "no node has 5 NVLink-connected GPUs; the best is a with 4"
        )]
    );
    let commands = handle(&mut engine, submit("four-more", require(4), 4));
    assert_eq!(
        commands,
        vec![pending(
            "four-more",
            "no node has 4 NVLink-connected GPUs free; the best is a with 3"
        )]
    );
    // Prefer takes what is there: three linked GPUs of island 0.
    let commands = handle(&mut engine, submit("three", whole(3), 5));
    assert_eq!(
        commands,
        vec![bind(
            "three",
            (1..4).map(|gpu| slice("a", gpu, 100, 80 * GIB)).collect()
        )]
    );
}

#[test]
fn two_gpus_prefer_one_numa_node() {
    // PCIe only: GPUs 0,1 on NUMA 0 and GPUs 2,3 on NUMA 1.
    let mut engine = engine_with(&[node_spec("a", 4, 80 * GIB, Interconnect::None)]);
    assert_eq!(
        handle(&mut engine, submit("one", whole(1), 1)),
        vec![bind("one", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    let commands = handle(&mut engine, submit("two", whole(2), 2));
    assert_eq!(
        commands,
        vec![bind(
            "two",
            vec![slice("a", 2, 100, 80 * GIB), slice("a", 3, 100, 80 * GIB)]
        )]
    );
    // Ignore takes the lowest free GPUs.
    let mut engine = engine_with(&[node_spec("a", 4, 80 * GIB, Interconnect::None)]);
    handle(&mut engine, submit("one", whole(1), 1));
    let commands = handle(
        &mut engine,
        submit(
            "two",
            Request {
                nvlink: NvlinkPolicy::Ignore,
                ..whole(2)
            },
            2,
        ),
    );
    assert_eq!(
        commands,
        vec![bind(
            "two",
            vec![slice("a", 1, 100, 80 * GIB), slice("a", 2, 100, 80 * GIB)]
        )]
    );
}

#[test]
fn multi_node_gang_is_all_or_nothing() {
    let spec = |name| node_spec(name, 8, 80 * GIB, Interconnect::All);
    let mut engine = engine_with(&[spec("a"), spec("b"), spec("c")]);
    assert_eq!(
        handle(&mut engine, submit("f", fraction(100), 1)),
        vec![bind("f", vec![slice("a", 0, 10, 8 * GIB)])]
    );
    let all_of = |node: &str| {
        (0..8)
            .map(|gpu| slice(node, gpu, 100, 80 * GIB))
            .collect::<Vec<_>>()
    };
    let commands = handle(&mut engine, submit("g1", gang(2, 8), 2));
    assert_eq!(
        commands,
        vec![bind("g1", [all_of("b"), all_of("c")].concat())]
    );
    let commands = handle(&mut engine, submit("g2", gang(2, 8), 3));
    assert_eq!(
        commands,
        vec![pending(
            "g2",
            "2 nodes x 8 GPUs needed, 0 nodes have 8 GPUs free"
        )]
    );
    // Nothing of g2 is held while it waits.
    assert_eq!(engine.summary().compute_allocated_percent, 10 + 1600);
    let commands = handle(
        &mut engine,
        Event::Release {
            tenant: "g1".to_string(),
        },
    );
    assert_eq!(
        commands,
        vec![
            released("g1"),
            bind("g2", [all_of("b"), all_of("c")].concat())
        ]
    );
    let commands = handle(&mut engine, submit("g4", gang(4, 8), 4));
    assert_eq!(
        commands,
        vec![reject("g4", "4 nodes x 8 GPUs needed, 3 nodes have 8 GPUs")]
    );
}

#[test]
fn selectors_filter_and_reasons_name_them() {
    let mut engine = engine_with(&[
        with_labels(
            node_spec("a", 8, 80 * GIB, Interconnect::All),
            &[("gpu", "h100")],
        ),
        with_labels(
            node_spec("b", 8, 80 * GIB, Interconnect::All),
            &[("gpu", "a100")],
        ),
    ]);
    let on_h100 = |request: Request| Request {
        node_selector: [("gpu".to_string(), "h100".to_string())].into(),
        ..request
    };
    let commands = handle(&mut engine, submit("g", on_h100(gang(2, 8)), 1));
    assert_eq!(
        commands,
        vec![reject(
            "g",
            "2 nodes x 8 GPUs needed, 1 node matches selector gpu=h100"
        )]
    );
    let none = Request {
        node_selector: [("gpu".to_string(), "b200".to_string())].into(),
        ..fraction(100)
    };
    assert_eq!(
        handle(&mut engine, submit("n", none, 2)),
        vec![reject("n", "no node matches selector gpu=b200")]
    );
    let commands = handle(&mut engine, submit("w", on_h100(whole(8)), 3));
    assert_eq!(
        commands,
        vec![bind(
            "w",
            (0..8).map(|gpu| slice("a", gpu, 100, 80 * GIB)).collect()
        )]
    );
    let commands = handle(&mut engine, submit("f", on_h100(fraction(100)), 4));
    assert_eq!(
        commands,
        vec![pending(
            "f",
            "no GPU has 10% compute and 8GiB memory free; the most free is a GPU 0 with 0% compute and 0B"
        )]
    );
}

#[test]
fn reasons_carry_the_numbers() {
    let mut engine = engine_with(&[node_spec("a", 8, 80 * GIB, Interconnect::All)]);
    let too_big = Request {
        memory_bytes_per_gpu: Some(100 * GIB),
        ..fraction(100)
    };
    assert_eq!(
        handle(&mut engine, submit("m", too_big, 1)),
        vec![reject(
            "m",
            "no GPU has 100GiB memory; the largest is 80GiB (a GPU 0)"
        )]
    );
    assert_eq!(
        handle(&mut engine, submit("w", whole(16), 2)),
        vec![reject("w", "no node has 16 GPUs; the best is a with 8")]
    );
    assert_eq!(
        handle(&mut engine, submit("z", fraction(0), 3)),
        vec![reject("z", "invalid request: Milli(0) must be 1..=999")]
    );
    for gpu in 0..8u32 {
        let commands = handle(
            &mut engine,
            submit(&format!("h{gpu}"), fraction(500), 10 + u64::from(gpu)),
        );
        assert_eq!(commands.len(), 1);
    }
    // Eight halves: one per GPU? No: two per GPU, four GPUs used, four fully free.
    assert_eq!(
        engine
            .node("a")
            .unwrap()
            .usage
            .iter()
            .filter(|usage| usage.tenants.is_empty())
            .count(),
        4
    );
    let memory_hungry = Request {
        memory_bytes_per_gpu: Some(60 * GIB),
        compute_percent: Some(25),
        ..fraction(250)
    };
    assert_eq!(
        handle(&mut engine, submit("x", whole(5), 20)),
        vec![pending(
            "x",
            "no node has 5 GPUs free; the best is a with 4"
        )]
    );
    let commands = handle(&mut engine, submit("y", memory_hungry.clone(), 21));
    assert_eq!(commands, vec![bind("y", vec![slice("a", 4, 25, 60 * GIB)])]);
    for (seq, tenant) in ["y2", "y3", "y4"].iter().enumerate() {
        handle(
            &mut engine,
            submit(tenant, memory_hungry.clone(), 22 + seq as u64),
        );
    }
    let commands = handle(&mut engine, submit("y5", memory_hungry, 30));
    assert_eq!(
        commands,
        vec![pending(
            "y5",
            "no GPU has 25% compute and 60GiB memory free; the most free is a GPU 4 with 75% compute and 20GiB"
        )]
    );
}

#[test]
fn preemption_takes_the_fewest_then_the_cheapest() {
    let mut engine = engine_with(&[node_spec("a", 1, 80 * GIB, Interconnect::All)]);
    handle(
        &mut engine,
        submit("low1", with_priority(fraction(250), 1), 1),
    );
    handle(
        &mut engine,
        submit("low2", with_priority(fraction(250), 1), 2),
    );
    handle(
        &mut engine,
        submit("mid", with_priority(fraction(500), 2), 3),
    );
    // One victim (mid) beats two of lower priority (low1 + low2).
    let commands = handle(
        &mut engine,
        submit("high", with_priority(fraction(500), 5), 4),
    );
    let reason = "preempted by high (priority 5)".to_string();
    assert_eq!(
        commands,
        vec![
            Command::Preempted {
                tenant: "mid".to_string(),
                by: "high".to_string(),
                reason
            },
            bind("high", vec![slice("a", 0, 50, 40 * GIB)]),
        ]
    );
    assert_eq!(engine.pending(), vec!["mid".to_string()]);
    // Of three single victims (low1, low2, high) the lowest priority, then the first name, goes.
    let commands = handle(
        &mut engine,
        submit("top", with_priority(fraction(250), 9), 6),
    );
    let reason = "preempted by top (priority 9)".to_string();
    assert_eq!(
        commands,
        vec![
            Command::Preempted {
                tenant: "low1".to_string(),
                by: "top".to_string(),
                reason
            },
            bind("top", vec![slice("a", 0, 25, 20 * GIB)]),
        ]
    );
    // The victims come back when capacity frees, in queue order (mid 2, then low1 1).
    let commands = handle(
        &mut engine,
        Event::Release {
            tenant: "high".to_string(),
        },
    );
    assert_eq!(
        commands,
        vec![
            released("high"),
            bind("mid", vec![slice("a", 0, 50, 40 * GIB)]),
            pending(
                "low1",
                "no GPU has 25% compute and 20GiB memory free; the most free is a GPU 0 with 0% compute and 0B"
            ),
        ]
    );
}

#[test]
fn preemptible_tenants_never_preempt_and_victims_do_not_ping_pong() {
    let mut engine = engine_with(&[node_spec("a", 1, 80 * GIB, Interconnect::All)]);
    handle(&mut engine, submit("victim", with_priority(whole(1), 1), 1));
    let spot = Request {
        preemptible: true,
        ..with_priority(whole(1), 10)
    };
    assert_eq!(
        handle(&mut engine, submit("spot", spot, 2)),
        vec![pending(
            "spot",
            "no node has 1 GPU free; the best is a with 0"
        )]
    );
    // Equal priority and guaranteed: not a victim.
    assert_eq!(
        handle(&mut engine, submit("peer", with_priority(whole(1), 1), 3)),
        vec![pending(
            "peer",
            "no node has 1 GPU free; the best is a with 0"
        )]
    );
    let commands = handle(&mut engine, submit("boss", with_priority(whole(1), 5), 4));
    assert_eq!(commands.len(), 2);
    assert_eq!(engine.slices("boss").map(<[_]>::len), Some(1));
    // The victim cannot evict boss (higher priority); the reason changes once, then stays quiet.
    let commands = handle(&mut engine, Event::Retry);
    assert_eq!(
        commands,
        vec![pending(
            "victim",
            "no node has 1 GPU free; the best is a with 0"
        )]
    );
    assert_eq!(handle(&mut engine, Event::Retry), vec![]);
    assert_eq!(
        engine.pending(),
        vec!["spot".to_string(), "victim".to_string(), "peer".to_string()]
    );
}

#[test]
fn preemptible_victims_of_equal_priority_can_go() {
    let mut engine = engine_with(&[node_spec("a", 1, 80 * GIB, Interconnect::All)]);
    let spot = Request {
        preemptible: true,
        ..with_priority(fraction(500), 3)
    };
    let commands = handle(&mut engine, submit("spot", spot.clone(), 1));
    assert_eq!(
        commands,
        vec![bind(
            "spot",
            vec![SliceAssignment {
                guaranteed: false,
                ..slice("a", 0, 50, 40 * GIB)
            }]
        )]
    );
    handle(&mut engine, submit("spot2", spot, 2));
    let commands = handle(&mut engine, submit("steady", with_priority(whole(1), 3), 3));
    let preempted: Vec<&Command> = commands
        .iter()
        .filter(|command| matches!(command, Command::Preempted { .. }))
        .collect();
    assert_eq!(preempted.len(), 2);
    assert_eq!(
        commands.last(),
        Some(&bind("steady", vec![slice("a", 0, 100, 80 * GIB)]))
    );
}

#[test]
fn lost_nodes_give_their_tenants_to_others() {
    let spec = |name| node_spec(name, 1, 80 * GIB, Interconnect::All);
    let mut engine = engine_with(&[spec("a"), spec("b")]);
    assert_eq!(
        handle(&mut engine, submit("t", whole(1), 1)),
        vec![bind("t", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    let lost = |node: &str| Event::SetNodeState {
        node: node.to_string(),
        state: NodeState::Lost,
    };
    let unbound = |reason: &str| Command::Unbound {
        tenant: "t".to_string(),
        reason: reason.to_string(),
    };
    assert_eq!(
        handle(&mut engine, lost("a")),
        vec![
            unbound("node a is Lost"),
            bind("t", vec![slice("b", 0, 100, 80 * GIB)])
        ]
    );
    assert_eq!(
        handle(&mut engine, lost("b")),
        vec![unbound("node b is Lost"), pending("t", "no node is Ready")]
    );
    assert_eq!(handle(&mut engine, Event::Retry), vec![]);
    let draining = Event::SetNodeState {
        node: "a".to_string(),
        state: NodeState::Draining,
    };
    assert_eq!(handle(&mut engine, draining), vec![]);
    // Re-registering with the same GPUs makes it Ready again.
    assert_eq!(
        handle(&mut engine, Event::AddNode(spec("a"))),
        vec![bind("t", vec![slice("a", 0, 100, 80 * GIB)])]
    );
    assert_eq!(handle(&mut engine, Event::AddNode(spec("a"))), vec![]);
    assert_eq!(engine.slices("t").map(<[_]>::len), Some(1));
    // A changed inventory re-places the tenant: b is Lost, so it waits, then takes the new a.
    let commands = handle(
        &mut engine,
        Event::AddNode(node_spec("a", 2, 40 * GIB, Interconnect::All)),
    );
    let reason = "node a re-registered with a different GPU inventory";
    assert_eq!(
        commands,
        vec![
            unbound(reason),
            pending("t", "no node is Ready"),
            bind("t", vec![slice("a", 0, 100, 40 * GIB)])
        ]
    );
    let commands = handle(&mut engine, Event::RemoveNode("a".to_string()));
    assert_eq!(
        commands,
        vec![
            unbound("node a was removed"),
            pending("t", "no node is Ready")
        ]
    );
    assert_eq!(
        handle(&mut engine, Event::RemoveNode("a".to_string())),
        vec![]
    );
}

#[test]
fn releases_are_idempotent_and_backfill_skips_what_does_not_fit() {
    let mut engine = engine_with(&[node_spec("a", 2, 80 * GIB, Interconnect::All)]);
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "ghost".to_string()
            }
        ),
        vec![released("ghost")]
    );
    let urgent = |request| with_priority(request, 10);
    handle(&mut engine, submit("w1", urgent(whole(1)), 1));
    handle(&mut engine, submit("w2", urgent(whole(1)), 2));
    handle(&mut engine, submit("big", with_priority(whole(2), 9), 3));
    handle(&mut engine, submit("small", fraction(500), 4));
    assert_eq!(
        engine.pending(),
        vec!["big".to_string(), "small".to_string()]
    );
    // One GPU frees: big still does not fit (its reason changes), small behind it does.
    let commands = handle(
        &mut engine,
        Event::Release {
            tenant: "w1".to_string(),
        },
    );
    assert_eq!(
        commands,
        vec![
            released("w1"),
            pending("big", "no node has 2 GPUs free; the best is a with 1"),
            bind("small", vec![slice("a", 0, 50, 40 * GIB)]),
        ]
    );
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "small".to_string()
            }
        ),
        vec![released("small")]
    );
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "big".to_string()
            }
        ),
        vec![released("big")]
    );
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "big".to_string()
            }
        ),
        vec![released("big")]
    );
    assert_eq!(engine.summary().tenants_pending, 0);
}

#[test]
fn a_restored_engine_continues_identically() {
    let mut engine = engine_with(&[
        node_spec("a", 8, 80 * GIB, Interconnect::Islands4),
        node_spec("b", 4, 40 * GIB, Interconnect::None),
    ]);
    handle(&mut engine, submit("t1", fraction(300), 1));
    handle(&mut engine, submit("t2", whole(3), 2));
    let json = serde_json::to_string(&engine).unwrap();
    let mut restored: Engine = serde_json::from_str(&json).unwrap();
    restored.check_invariants();
    for (seq, request) in [fraction(700), whole(4), gang(2, 1), fraction(10)]
        .into_iter()
        .enumerate()
    {
        let event = submit(&format!("n{seq}"), request, 10 + seq as u64);
        assert_eq!(
            handle(&mut engine, event.clone()),
            handle(&mut restored, event)
        );
    }
    assert_eq!(
        serde_json::to_string(&engine).unwrap(),
        serde_json::to_string(&restored).unwrap()
    );
}

fn update(tenant: &str, compute_percent: Option<u32>, priority: Option<i32>) -> Event {
    Event::Update {
        tenant: tenant.to_string(),
        compute_percent,
        priority,
    }
}

fn updated(tenant: &str, slices: Vec<SliceAssignment>) -> Command {
    Command::Updated {
        tenant: tenant.to_string(),
        slices,
    }
}

#[test]
fn a_share_that_fits_its_gpu_is_changed_in_place() {
    let mut engine = engine_with(&[node_spec("a", 2, 80 * GIB, Interconnect::All)]);
    handle(&mut engine, submit("chat", fraction(250), 1));
    handle(&mut engine, submit("batch", fraction(500), 2));
    // 25 + 50 on GPU 0: chat may grow to 50%, on the same GPU, with the same memory.
    assert_eq!(
        handle(&mut engine, update("chat", Some(50), None)),
        vec![updated("chat", vec![slice("a", 0, 50, 20 * GIB)])]
    );
    let usage = &engine.node("a").unwrap().usage[0];
    assert_eq!(usage.compute_allocated_percent, 100);
    assert_eq!(engine.slices("chat").unwrap()[0].compute_percent, 50);
    // The same share again changes nothing but says so.
    assert_eq!(
        handle(&mut engine, update("chat", Some(50), None)),
        vec![updated("chat", vec![slice("a", 0, 50, 20 * GIB)])]
    );
}

#[test]
fn a_share_that_does_not_fit_is_refused_and_the_tenant_is_not_moved() {
    let mut engine = engine_with(&[node_spec("a", 2, 80 * GIB, Interconnect::All)]);
    handle(&mut engine, submit("chat", fraction(250), 1));
    handle(&mut engine, submit("batch", fraction(500), 2));
    let before = engine.clone();
    // GPU 1 is empty, but a placed tenant stays where it is.
    assert_eq!(
        handle(&mut engine, update("chat", Some(60), Some(7))),
        vec![Command::Refused {
            tenant: "chat".to_string(),
            reason: "GPU 0 of node a has room for 50% for tenant chat (25% now, 25% unallocated); a placed tenant is not moved: ask for at most 50%, or release it and place it again".to_string()
        }]
    );
    assert_eq!(
        format!("{engine:?}"),
        format!("{before:?}"),
        "nothing changed"
    );
    // Whole GPUs are exclusive; unknown tenants are refused too.
    handle(&mut engine, submit("train", whole(1), 3));
    let refused = |commands: Vec<Command>| match commands.as_slice() {
        [Command::Refused { reason, .. }] => reason.clone(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(refused(handle(&mut engine, update("train", Some(50), None))).contains("whole GPUs"),);
    assert_eq!(
        refused(handle(&mut engine, update("ghost", None, Some(1)))),
        "no tenant is named ghost"
    );
    assert_eq!(
        refused(handle(&mut engine, update("ghost", Some(10), None))),
        "no tenant is named ghost"
    );
}

#[test]
fn a_smaller_share_lets_a_pending_tenant_in_and_a_new_priority_counts_at_once() {
    let mut engine = engine_with(&[node_spec("a", 1, 80 * GIB, Interconnect::All)]);
    handle(
        &mut engine,
        submit("big", with_compute(fraction(250), 80), 1),
    );
    let commands = handle(&mut engine, submit("small", fraction(250), 2));
    assert!(
        matches!(commands.as_slice(), [Command::Pending { tenant, .. }] if tenant == "small"),
        "{commands:?}"
    );
    // A pending tenant's share is its request's; it waits with it, for the new reason.
    assert_eq!(
        handle(&mut engine, update("small", Some(30), None)),
        vec![
            updated("small", vec![]),
            pending(
                "small",
                "no GPU has 30% compute and 20GiB memory free; the most free is a GPU 0 with 20% compute and 60GiB"
            )
        ]
    );
    assert_eq!(engine.pending(), vec!["small".to_string()]);
    // The placed tenant gives up compute: the pending one fits now and is placed at once.
    assert_eq!(
        handle(&mut engine, update("big", Some(70), None)),
        vec![
            updated("big", vec![slice("a", 0, 70, 20 * GIB)]),
            bind("small", vec![slice("a", 0, 30, 20 * GIB)]),
        ]
    );
    assert!(engine.pending().is_empty());
    // A waiting tenant raised above a placed one preempts it on the spot.
    handle(
        &mut engine,
        submit("urgent", with_compute(fraction(250), 60), 3),
    );
    assert_eq!(engine.pending(), vec!["urgent".to_string()]);
    let commands = handle(&mut engine, update("urgent", None, Some(5)));
    assert_eq!(commands[0], updated("urgent", vec![]));
    assert!(
        commands
            .iter()
            .any(|c| matches!(c, Command::Preempted { tenant, by, .. } if tenant == "big" && by == "urgent")),
        "{commands:?}"
    );
    assert!(
        commands.contains(&bind("urgent", vec![slice("a", 0, 60, 20 * GIB)])),
        "{commands:?}"
    );
}

fn with_compute(mut request: Request, compute_percent: u32) -> Request {
    request.compute_percent = Some(compute_percent);
    request
}
