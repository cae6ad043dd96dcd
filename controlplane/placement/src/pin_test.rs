//! Kubernetes-managed nodes and pinned tenants (issue 18): exact commands for a pin that fits,
//! one that does not, a request of the engine's own that must not land on a managed node, node
//! loss and removal, and the pins across an encode/decode round trip.

use crate::testing::*;
use crate::*;

fn register_kubernetes(engine: &mut Engine, spec: NodeSpec) -> Vec<Command> {
    let host = HostCapacity::default();
    handle(engine, Event::RegisterKubernetesNode { spec, host })
}

fn pin(node: &str, gpus: &[(u32, u32, u64)]) -> Pin {
    Pin {
        node: node.to_string(),
        gpus: gpus
            .iter()
            .map(|&(index, compute_percent, memory_bytes)| PinnedGpu {
                uuid: format!("GPU-{node}-{index}"),
                compute_percent,
                memory_bytes,
            })
            .collect(),
    }
}

fn submit_pinned(tenant: &str, request: Request, pin: Pin, seq: u64) -> Event {
    Event::SubmitPinned {
        tenant: tenant.to_string(),
        request,
        pin,
        seq,
    }
}

fn set_state(node: &str, state: NodeState) -> Event {
    Event::SetNodeState {
        node: node.to_string(),
        state,
    }
}

/// A managed node `k` (2 GPUs) and a plain node `v` (1 GPU).
fn mixed_pool() -> Engine {
    let mut engine = Engine::new(EngineConfig::default());
    assert_eq!(
        register_kubernetes(&mut engine, node_spec("k", 2, 80 * GIB, Interconnect::All)),
        vec![]
    );
    assert_eq!(
        handle(
            &mut engine,
            Event::AddNode(node_spec("v", 1, 80 * GIB, Interconnect::All))
        ),
        vec![]
    );
    engine
}

#[test]
fn a_pin_that_fits_binds_exactly_its_slices() {
    let mut engine = mixed_pool();
    // The search would put a quarter on GPU 0; the pin says GPU 1, 30% and 20 GiB.
    assert_eq!(
        handle(
            &mut engine,
            submit_pinned("c1", fraction(250), pin("k", &[(1, 30, 20 * GIB)]), 1)
        ),
        vec![bind("c1", vec![slice("k", 1, 30, 20 * GIB)])]
    );
    // Two GPUs, whole: both pinned slices, in the pin's order.
    assert_eq!(
        handle(
            &mut engine,
            submit_pinned(
                "c2",
                whole(2),
                pin("k", &[(0, 100, 80 * GIB), (1, 70, 60 * GIB)]),
                2
            )
        ),
        vec![bind(
            "c2",
            vec![slice("k", 0, 100, 80 * GIB), slice("k", 1, 70, 60 * GIB)]
        )]
    );
    assert_eq!(engine.pin("c1"), Some(&pin("k", &[(1, 30, 20 * GIB)])));
    assert_eq!(engine.pin("nobody"), None);
    assert!(engine.node("k").unwrap().kubernetes_managed);
    assert!(!engine.node("v").unwrap().kubernetes_managed);
}

#[test]
fn a_pin_that_does_not_fit_is_rejected_at_once() {
    let mut engine = mixed_pool();
    handle(
        &mut engine,
        submit_pinned("c1", fraction(500), pin("k", &[(0, 60, 40 * GIB)]), 1),
    );
    // Over the GPU's free compute: rejected, never pending, and c1 is not preempted.
    assert_eq!(
        handle(
            &mut engine,
            submit_pinned(
                "c2",
                with_priority(fraction(500), 1000),
                pin("k", &[(0, 50, 10 * GIB)]),
                2
            )
        ),
        vec![reject(
            "c2",
            "GPU GPU-k-0 of node k has 40% and 42949672960 bytes free, and the pin asks 50% and 10737418240 bytes (its tenants: c1)"
        )]
    );
    let refusals = [
        (
            pin("v", &[(0, 10, GIB)]),
            "node v is not Kubernetes-managed: vgpu places its tenants there; pin only to nodes whose agent runs with --kubernetes-managed",
        ),
        (pin("x", &[(0, 10, GIB)]), "the pool has no node x"),
        (pin("k", &[(7, 10, GIB)]), "node k has no GPU GPU-k-7"),
        (
            pin("k", &[(1, 10, GIB), (1, 10, GIB)]),
            "the pin has 2 GPUs and the request asks for 1",
        ),
    ];
    for (seq, (refused, reason)) in refusals.into_iter().enumerate() {
        assert_eq!(
            handle(
                &mut engine,
                submit_pinned("c3", fraction(100), refused, 3 + seq as u64)
            ),
            vec![reject("c3", reason)]
        );
    }
    assert_eq!(
        handle(
            &mut engine,
            submit_pinned("c3", whole(2), pin("k", &[(1, 10, GIB), (1, 10, GIB)]), 9)
        ),
        vec![reject("c3", "the pin names GPU GPU-k-1 twice")]
    );
    assert_eq!(engine.pending_count(), 0);
    assert_eq!(engine.slices("c1").unwrap().len(), 1);
}

#[test]
fn requests_of_the_engine_never_land_on_a_managed_node() {
    let mut engine = mixed_pool();
    assert_eq!(
        handle(&mut engine, submit("t1", whole(1), 1)),
        vec![bind("t1", vec![slice("v", 0, 100, 80 * GIB)])]
    );
    // The managed node has two free GPUs; the request waits for the plain node instead.
    assert_eq!(
        handle(&mut engine, submit("t2", fraction(500), 2)),
        vec![pending(
            "t2",
            "no GPU has 50% compute and 40GiB memory free; the most free is v GPU 0 with 0% compute and 0B"
        )]
    );
    // Nor by preemption: a higher priority evicts t1 on the plain node, never a pinned tenant.
    handle(
        &mut engine,
        submit_pinned("c1", fraction(500), pin("k", &[(0, 50, 40 * GIB)]), 3),
    );
    let commands = handle(&mut engine, submit("t3", with_priority(whole(1), 10), 4));
    assert_eq!(
        commands.last(),
        Some(&bind("t3", vec![slice("v", 0, 100, 80 * GIB)]))
    );
    assert!(
        commands
            .iter()
            .all(|command| !matches!(command, Command::Preempted { tenant, .. } if tenant == "c1"))
    );
    assert_eq!(
        engine.slices("c1"),
        Some(&[slice("k", 0, 50, 40 * GIB)][..])
    );
    // A pool of managed nodes only: the engine's requests can never fit, and say why.
    let mut managed_only = Engine::new(EngineConfig::default());
    register_kubernetes(
        &mut managed_only,
        node_spec("k", 2, 80 * GIB, Interconnect::All),
    );
    assert_eq!(
        handle(&mut managed_only, submit("t", fraction(250), 1)),
        vec![reject(
            "t",
            "every node of the pool (1) is Kubernetes-managed: pods get their GPUs through DRA (docs/kubernetes.md), and vgpuctl places only on nodes whose agent runs without --kubernetes-managed"
        )]
    );
    // A pinned tenant's share is its claim's.
    assert_eq!(
        handle(
            &mut engine,
            Event::Update {
                tenant: "c1".to_string(),
                compute_percent: Some(20),
                priority: None,
            }
        ),
        vec![Command::Refused {
            tenant: "c1".to_string(),
            reason: "tenant c1 holds a Kubernetes claim's slices; change the claim (its ResourceClaim), not the tenant".to_string(),
        }]
    );
}

#[test]
fn a_pinned_tenant_stays_bound_when_its_node_is_lost() {
    let mut engine = mixed_pool();
    handle(
        &mut engine,
        submit_pinned("c1", fraction(500), pin("k", &[(1, 50, 40 * GIB)]), 1),
    );
    for state in [NodeState::Lost, NodeState::Draining, NodeState::Ready] {
        assert_eq!(handle(&mut engine, set_state("k", state)), vec![]);
        assert_eq!(
            engine.slices("c1"),
            Some(&[slice("k", 1, 50, 40 * GIB)][..])
        );
    }
    handle(&mut engine, set_state("k", NodeState::Lost));
    // Released while its node is lost: its slices are freed.
    assert_eq!(
        handle(
            &mut engine,
            Event::Release {
                tenant: "c1".to_string()
            }
        ),
        vec![Command::Released {
            tenant: "c1".to_string()
        }]
    );
    assert_eq!(engine.node("k").unwrap().usage[1], GpuUsage::default());
}

#[test]
fn a_removed_node_takes_its_pins_until_it_comes_back() {
    let mut engine = mixed_pool();
    handle(
        &mut engine,
        submit_pinned("c1", fraction(500), pin("k", &[(1, 50, 40 * GIB)]), 1),
    );
    assert_eq!(
        handle(&mut engine, Event::RemoveNode("k".to_string())),
        vec![
            Command::Unbound {
                tenant: "c1".to_string(),
                reason: "node k was removed".to_string(),
            },
            pending("c1", "node k is Draining"),
            pending("c1", "the pool has no node k"),
        ]
    );
    // Back as a plain node: the pin does not bind there.
    assert_eq!(
        handle(
            &mut engine,
            Event::AddNode(node_spec("k", 2, 80 * GIB, Interconnect::All))
        ),
        vec![pending(
            "c1",
            "node k is not Kubernetes-managed: vgpu places its tenants there; pin only to nodes whose agent runs with --kubernetes-managed"
        )]
    );
    // Managed again with the same GPUs: the pin binds again.
    assert_eq!(
        register_kubernetes(&mut engine, node_spec("k", 2, 80 * GIB, Interconnect::All)),
        vec![bind("c1", vec![slice("k", 1, 50, 40 * GIB)])]
    );
}

#[test]
fn a_node_that_becomes_managed_sheds_the_engines_tenants() {
    let mut engine = Engine::new(EngineConfig::default());
    handle(
        &mut engine,
        Event::AddNode(node_spec("a", 1, 80 * GIB, Interconnect::All)),
    );
    handle(&mut engine, submit("t1", fraction(500), 1));
    assert_eq!(
        register_kubernetes(&mut engine, node_spec("a", 1, 80 * GIB, Interconnect::All)),
        vec![
            Command::Unbound {
                tenant: "t1".to_string(),
                reason: "node a re-registered as Kubernetes-managed".to_string(),
            },
            pending("t1", "no node is Ready"),
        ]
    );
    assert!(engine.node("a").unwrap().kubernetes_managed);
}

#[test]
fn pins_and_managed_nodes_survive_an_encode_decode_round_trip() {
    let mut engine = mixed_pool();
    handle(
        &mut engine,
        submit_pinned("c1", fraction(500), pin("k", &[(0, 50, 40 * GIB)]), 1),
    );
    handle(&mut engine, submit("t1", fraction(250), 2));
    handle(&mut engine, set_state("k", NodeState::Lost));
    let json = serde_json::to_string(&engine).unwrap();
    assert!(
        !json.contains("kubernetes") && !json.contains("\"pin\""),
        "{json}"
    );
    let state = engine.host_state();
    assert_eq!(state.kubernetes_nodes.iter().collect::<Vec<_>>(), vec!["k"]);
    assert_eq!(state.pins.keys().collect::<Vec<_>>(), vec!["c1"]);
    let mut restored: Engine = serde_json::from_str(&json).unwrap();
    restored.restore_host_state(state);
    restored.check_invariants();
    assert_eq!(restored.pin("c1"), engine.pin("c1"));
    assert_eq!(engine.host_state(), restored.host_state());
    // The restored engine decides as the original: the managed node stays out of the search,
    // the pinned tenant stays through the node's return.
    for event in [
        set_state("k", NodeState::Ready),
        submit("t2", whole(1), 3),
        submit("t3", fraction(900), 4),
    ] {
        assert_eq!(
            handle(&mut engine, event.clone()),
            handle(&mut restored, event)
        );
    }
    assert_eq!(engine.slices("c1"), restored.slices("c1"));
}

fn with_priority(mut request: Request, priority: i32) -> Request {
    request.priority = priority;
    request
}
