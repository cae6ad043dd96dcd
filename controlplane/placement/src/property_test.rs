//! Property tests: random pools and random event sequences, checked after every event against
//! the engine's own invariants and against a model rebuilt from the command stream alone.

use crate::testing::*;
use crate::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const NODE_NAMES: [&str; 5] = ["n0", "n1", "n2", "n3", "n4"];
const TENANTS_MAX: usize = 40;

const MODELS: [&str; 2] = ["H100-80GB", "A100-40GB"];

/// A node and its host capacity: a third of nodes report none (unbounded), the others 4..=64
/// CPUs and 64..=512 GiB; GPUs of one model each, or (a quarter of nodes) of both models.
fn node_strategy(name: &'static str) -> impl Strategy<Value = (NodeSpec, HostCapacity)> {
    (
        1u32..=8,
        prop::sample::select(vec![16u64, 40, 80]),
        0u8..3,
        prop::bool::ANY,
        0u8..4,
        prop::option::weighted(0.67, (4u64..=64, 64u64..=512)),
    )
        .prop_map(
            move |(gpus, memory_gib, interconnect, zone_a, models, host)| {
                let interconnect = [
                    Interconnect::All,
                    Interconnect::None,
                    Interconnect::Islands4,
                ][interconnect as usize];
                let mut spec = with_labels(
                    node_spec(name, gpus, memory_gib * GIB, interconnect),
                    &[("zone", if zone_a { "a" } else { "b" })],
                );
                for gpu in &mut spec.gpus {
                    gpu.model = match models {
                        0 | 1 => MODELS[0],
                        2 => MODELS[1],
                        _ => MODELS[(gpu.index % 2) as usize],
                    }
                    .to_string();
                }
                let host =
                    host.map_or(HostCapacity::default(), |(cpus, memory_gib)| HostCapacity {
                        cpu_milli: Some(cpus * 1000),
                        memory_bytes: Some(memory_gib * GIB),
                    });
                (spec, host)
            },
        )
}

/// Half of requests ask nothing more; the others some CPU (up to 48 CPUs), host memory (up to
/// 384 GiB) and/or one or two allowed models.
fn constraints_strategy() -> impl Strategy<Value = Constraints> {
    prop_oneof![
        1 => Just(Constraints::default()),
        1 => (
            prop::option::weighted(0.6, 1u64..=48),
            prop::option::weighted(0.5, 1u64..=384),
            prop::sample::select(vec![0u8, 0, 1, 2, 3]),
        )
            .prop_map(|(cpus, memory_gib, models)| Constraints {
                cpu_milli: cpus.map_or(0, |cpus| cpus * 1000),
                host_memory_bytes: memory_gib.map_or(0, |gib| gib * GIB),
                gpu_models: match models {
                    1 => [MODELS[0].to_string()].into(),
                    2 => [MODELS[1].to_string()].into(),
                    3 => MODELS.iter().map(|model| model.to_string()).collect(),
                    _ => BTreeSet::new(),
                },
            }),
    ]
}

fn request_strategy() -> impl Strategy<Value = Request> {
    let gpus = prop_oneof![
        prop::sample::select(vec![100u32, 250, 300, 500, 750, 999]).prop_map(GpuCount::Milli),
        (1u32..=4).prop_map(GpuCount::Whole),
    ];
    (
        gpus,
        1u32..=3,
        prop::option::weighted(0.2, prop::sample::select(vec![8u64, 20, 60])),
        prop::option::weighted(0.2, 1u32..=100),
        0i32..4,
        prop::bool::weighted(0.3),
        prop::sample::select(vec![
            NvlinkPolicy::Prefer,
            NvlinkPolicy::Require,
            NvlinkPolicy::Ignore,
        ]),
        prop::bool::weighted(0.2),
    )
        .prop_map(
            |(gpus, nodes, memory_gib, compute_percent, priority, preemptible, nvlink, zone)| {
                Request {
                    gpus,
                    nodes: if matches!(gpus, GpuCount::Whole(_)) {
                        nodes
                    } else {
                        1
                    },
                    memory_bytes_per_gpu: memory_gib.map(|gib| gib * GIB),
                    compute_percent,
                    burst: false,
                    priority,
                    preemptible,
                    nvlink,
                    node_selector: if zone {
                        [("zone".to_string(), "a".to_string())].into()
                    } else {
                        BTreeMap::new()
                    },
                }
            },
        )
}

/// Events without tenant names; names are assigned in order so Submits never repeat one.
#[derive(Clone, Debug)]
enum Step {
    Submit(Request, Constraints),
    Release(usize),
    Retry,
    State(usize, NodeState),
    Readd(NodeSpec, HostCapacity),
    Remove(usize),
    Update(usize, Option<u32>, Option<i32>),
    /// A node registered again as Kubernetes-managed.
    ReaddKubernetes(NodeSpec, HostCapacity),
    /// A pin on node `.0`: (GPU index, compute percent, memory GiB) per GPU, some of them not
    /// on the node or not fitting it.
    SubmitPinned(usize, Vec<(u32, u32, u64)>),
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (request_strategy(), constraints_strategy())
            .prop_map(|(request, constraints)| Step::Submit(request, constraints)),
        3 => (0..TENANTS_MAX).prop_map(Step::Release),
        1 => Just(Step::Retry),
        1 => (0..NODE_NAMES.len(), prop::sample::select(vec![NodeState::Ready, NodeState::Lost, NodeState::Draining]))
            .prop_map(|(node, state)| Step::State(node, state)),
        1 => (0..NODE_NAMES.len()).prop_flat_map(|node| {
            node_strategy(NODE_NAMES[node]).prop_map(|(spec, host)| Step::Readd(spec, host))
        }),
        1 => (0..NODE_NAMES.len()).prop_map(Step::Remove),
        2 => (
            0..TENANTS_MAX,
            prop::option::weighted(0.7, prop_oneof![1u32..=100, Just(0u32), Just(101u32)]),
            prop::option::weighted(0.4, -1i32..5),
        )
            .prop_map(|(tenant, compute, priority)| Step::Update(tenant, compute, priority)),
        1 => (0..NODE_NAMES.len()).prop_flat_map(|node| {
            node_strategy(NODE_NAMES[node])
                .prop_map(|(spec, host)| Step::ReaddKubernetes(spec, host))
        }),
        3 => (
            0..NODE_NAMES.len(),
            prop::collection::vec((0u32..9, prop_oneof![1u32..=100, Just(100u32)], 0u64..=48), 1..=2),
        )
            .prop_map(|(node, gpus)| Step::SubmitPinned(node, gpus)),
    ]
}

fn events(pool: Vec<(NodeSpec, HostCapacity)>, steps: Vec<Step>) -> Vec<Event> {
    // In a pool of two or more nodes the last is Kubernetes-managed, so that pins bind.
    let managed_at = (pool.len() >= 2).then(|| pool.len() - 1);
    let mut events: Vec<Event> = pool
        .into_iter()
        .enumerate()
        .map(|(position, (spec, host))| {
            if Some(position) == managed_at {
                Event::RegisterKubernetesNode { spec, host }
            } else {
                Event::RegisterNode { spec, host }
            }
        })
        .collect();
    let mut submitted = 0usize;
    for step in steps {
        events.push(match step {
            Step::Submit(request, constraints) => {
                submitted += 1;
                if constraints == Constraints::default() {
                    submit(&format!("t{submitted}"), request, submitted as u64)
                } else {
                    Event::SubmitConstrained {
                        tenant: format!("t{submitted}"),
                        request,
                        constraints,
                        seq: submitted as u64,
                    }
                }
            }
            Step::Release(tenant) => Event::Release {
                tenant: format!("t{tenant}"),
            },
            Step::Retry => Event::Retry,
            Step::State(node, state) => Event::SetNodeState {
                node: NODE_NAMES[node].to_string(),
                state,
            },
            Step::Readd(spec, host) => Event::RegisterNode { spec, host },
            Step::ReaddKubernetes(spec, host) => Event::RegisterKubernetesNode { spec, host },
            Step::SubmitPinned(node, gpus) => {
                submitted += 1;
                let node = NODE_NAMES[node];
                let request = if gpus.len() == 1 {
                    fraction(500)
                } else {
                    whole(gpus.len() as u32)
                };
                let pin = Pin {
                    node: node.to_string(),
                    gpus: gpus
                        .into_iter()
                        .map(|(index, compute_percent, memory_gib)| PinnedGpu {
                            uuid: format!("GPU-{node}-{index}"),
                            compute_percent,
                            memory_bytes: memory_gib * GIB,
                        })
                        .collect(),
                };
                Event::SubmitPinned {
                    tenant: format!("t{submitted}"),
                    request,
                    pin,
                    seq: submitted as u64,
                }
            }
            Step::Remove(node) => Event::RemoveNode(NODE_NAMES[node].to_string()),
            Step::Update(tenant, compute_percent, priority) => Event::Update {
                tenant: format!("t{tenant}"),
                compute_percent,
                priority,
            },
        });
    }
    events
}

fn pool_strategy() -> impl Strategy<Value = Vec<(NodeSpec, HostCapacity)>> {
    (1usize..=NODE_NAMES.len()).prop_flat_map(|count| {
        NODE_NAMES[..count]
            .iter()
            .map(|&name| node_strategy(name))
            .collect::<Vec<_>>()
    })
}

/// What the command stream alone says: tenants' requests and current slices.
#[derive(Default)]
struct Model {
    requests: BTreeMap<TenantName, Request>,
    placed: BTreeMap<TenantName, Vec<SliceAssignment>>,
    pins: BTreeMap<TenantName, Pin>,
}

impl Model {
    fn apply(&mut self, event: &Event, commands: &[Command]) {
        let submitted = match event {
            Event::Submit {
                tenant, request, ..
            }
            | Event::SubmitConstrained {
                tenant, request, ..
            }
            | Event::SubmitPinned {
                tenant, request, ..
            } => Some((tenant, request)),
            _ => None,
        };
        if let Event::SubmitPinned { tenant, pin, .. } = event {
            // Bound to exactly the pin, or rejected: never pending, never preempting.
            assert_eq!(commands.len(), 1, "{tenant}: {commands:?}");
            match &commands[0] {
                Command::Bind { slices, .. } => {
                    let pinned: Vec<(&str, &str, u32, u64)> = pin
                        .gpus
                        .iter()
                        .map(|g| {
                            (
                                pin.node.as_str(),
                                g.uuid.as_str(),
                                g.compute_percent,
                                g.memory_bytes,
                            )
                        })
                        .collect();
                    let bound: Vec<(&str, &str, u32, u64)> = slices
                        .iter()
                        .map(|s| {
                            (
                                s.node.as_str(),
                                s.gpu_uuid.as_str(),
                                s.compute_percent,
                                s.memory_bytes,
                            )
                        })
                        .collect();
                    assert_eq!(pinned, bound);
                    self.pins.insert(tenant.clone(), pin.clone());
                }
                Command::Reject { .. } => {}
                other => panic!("{tenant}: a pin answered {other:?}"),
            }
        }
        if let Some((tenant, request)) = submitted {
            let own: Vec<&Command> = commands
                .iter()
                .filter(|command| command_tenant(command) == tenant)
                .collect();
            assert_eq!(own.len(), 1, "{tenant}: {commands:?}");
            assert!(matches!(
                own[0],
                Command::Bind { .. } | Command::Pending { .. } | Command::Reject { .. }
            ));
            assert!(
                commands
                    .iter()
                    .all(|command| command_tenant(command) == tenant
                        || matches!(command, Command::Preempted { .. }))
            );
            if !matches!(own[0], Command::Reject { .. }) {
                self.requests.insert(tenant.clone(), request.clone());
            }
        }
        if let Event::Update {
            tenant,
            compute_percent,
            priority,
        } = event
        {
            let known = self.requests.get_mut(tenant);
            match commands.first() {
                Some(Command::Refused {
                    tenant: refused, ..
                }) => {
                    assert_eq!(refused, tenant);
                    assert_eq!(commands.len(), 1, "a refusal changes nothing");
                    if let (Some(request), Some(percent)) = (&known, compute_percent) {
                        let whole = matches!(request.gpus, GpuCount::Whole(_));
                        let out_of_range = !(1..=100).contains(percent);
                        let grows = self.placed.get(tenant).is_some_and(|slices| {
                            slices.iter().any(|s| s.compute_percent < *percent)
                        });
                        let pinned = self.pins.contains_key(tenant);
                        assert!(
                            whole || out_of_range || grows || pinned,
                            "{tenant}: {commands:?}"
                        );
                    }
                }
                Some(Command::Updated {
                    tenant: changed,
                    slices,
                }) => {
                    assert_eq!(changed, tenant);
                    assert!(
                        !self.pins.contains_key(tenant),
                        "a pinned tenant is never changed"
                    );
                    let request = known.expect("only known tenants are changed");
                    if let Some(percent) = compute_percent {
                        assert!(matches!(request.gpus, GpuCount::Milli(_)));
                        request.compute_percent = Some(*percent);
                        assert!(slices.iter().all(|s| s.compute_percent == *percent));
                    }
                    if let Some(priority) = priority {
                        request.priority = *priority;
                    }
                    match self.placed.get_mut(tenant) {
                        Some(placed) => {
                            let gpus = |slices: &[SliceAssignment]| -> Vec<(String, u32, u64)> {
                                slices
                                    .iter()
                                    .map(|s| (s.node.clone(), s.gpu_index, s.memory_bytes))
                                    .collect()
                            };
                            assert_eq!(gpus(placed), gpus(slices), "{tenant} moved");
                            *placed = slices.clone();
                        }
                        None => assert!(slices.is_empty()),
                    }
                }
                other => panic!("{tenant}: an update answered {other:?}"),
            }
            assert!(
                commands[1..]
                    .iter()
                    .all(|c| !matches!(c, Command::Updated { .. } | Command::Refused { .. }))
            );
        }
        for command in commands {
            match command {
                Command::Updated { .. } | Command::Refused { .. } => {}
                Command::Bind { tenant, slices } => {
                    if let Some(pin) = self.pins.get(tenant) {
                        let uuids: Vec<&str> = pin.gpus.iter().map(|g| g.uuid.as_str()).collect();
                        let bound: Vec<&str> = slices.iter().map(|s| s.gpu_uuid.as_str()).collect();
                        assert_eq!(uuids, bound, "{tenant} bound off its pin");
                    }
                    let request = &self.requests[tenant];
                    let (gpus, nodes) = match request.gpus {
                        GpuCount::Whole(gpus) => (gpus, request.nodes),
                        GpuCount::Milli(_) => (1, 1),
                    };
                    assert_eq!(slices.len(), (gpus * nodes) as usize);
                    let distinct: BTreeSet<(&str, u32)> = slices
                        .iter()
                        .map(|s| (s.node.as_str(), s.gpu_index))
                        .collect();
                    assert_eq!(distinct.len(), slices.len());
                    let nodes_used: BTreeSet<&str> =
                        slices.iter().map(|s| s.node.as_str()).collect();
                    assert_eq!(nodes_used.len(), nodes as usize);
                    assert!(slices.iter().all(|s| s.guaranteed != request.preemptible));
                    assert!(
                        self.placed.insert(tenant.clone(), slices.clone()).is_none(),
                        "{tenant} bound twice"
                    );
                }
                Command::Preempted { tenant, by, .. } => {
                    assert!(
                        !self.pins.contains_key(tenant),
                        "a pinned tenant is never a victim"
                    );
                    assert!(
                        !self.pins.contains_key(by),
                        "a pinned tenant never preempts"
                    );
                    let victim = &self.requests[tenant];
                    let preemptor = &self.requests[by];
                    assert!(!preemptor.preemptible);
                    assert!(
                        victim.priority < preemptor.priority
                            || (victim.preemptible && victim.priority <= preemptor.priority),
                        "{by} {preemptor:?} preempted {tenant} {victim:?}"
                    );
                    assert!(self.placed.remove(tenant).is_some());
                }
                Command::Unbound { tenant, .. } => assert!(self.placed.remove(tenant).is_some()),
                Command::Released { tenant } => {
                    self.placed.remove(tenant);
                    self.requests.remove(tenant);
                    self.pins.remove(tenant);
                }
                Command::Pending { tenant, .. } => assert!(!self.placed.contains_key(tenant)),
                Command::Reject { .. } => {}
            }
        }
    }
}

fn command_tenant(command: &Command) -> &str {
    match command {
        Command::Bind { tenant, .. }
        | Command::Pending { tenant, .. }
        | Command::Preempted { tenant, .. }
        | Command::Unbound { tenant, .. }
        | Command::Reject { tenant, .. }
        | Command::Updated { tenant, .. }
        | Command::Refused { tenant, .. }
        | Command::Released { tenant } => tenant,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_event_sequences_keep_every_invariant(
        pool in pool_strategy(),
        steps in prop::collection::vec(step_strategy(), 1..60),
        snapshot_at in 0usize..70,
        best_fit in prop::bool::ANY,
        nodes_scored_max in 1usize..4,
    ) {
        let scorer = if best_fit { Scorer::BestFit } else { Scorer::Fragmentation };
        let config = EngineConfig { scorer, retry_per_event_max: 8, nodes_scored_max };
        let mut engine = Engine::new(config.clone());
        let mut twin = Engine::new(config);
        let mut restored: Option<Engine> = None;
        let mut model = Model::default();
        for (at, event) in events(pool, steps).into_iter().enumerate() {
            if at == snapshot_at {
                // As the control plane does: the engine's encoding, then its host state beside it.
                let mut decoded: Engine =
                    serde_json::from_str(&serde_json::to_string(&engine).unwrap()).unwrap();
                decoded.restore_host_state(engine.host_state());
                decoded.check_invariants();
                restored = Some(decoded);
            }
            let commands = engine.handle(event.clone());
            engine.check_invariants();
            prop_assert_eq!(&twin.handle(event.clone()), &commands);
            if let Some(restored) = restored.as_mut() {
                prop_assert_eq!(&restored.handle(event.clone()), &commands);
            }
            model.apply(&event, &commands);
            for (tenant, slices) in &model.placed {
                prop_assert_eq!(engine.slices(tenant), Some(slices.as_slice()));
            }
            let summary = engine.summary();
            prop_assert_eq!(summary.tenants_placed, model.placed.len() as u64);
            prop_assert_eq!(summary.tenants_placed + summary.tenants_pending, model.requests.len() as u64);
        }
    }
}
