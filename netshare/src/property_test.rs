//! Property tests of the allocator: capacity, guarantees, bounds, work conservation, weighted
//! max-min fairness, proportional weights, determinism, and commands that replay to the state.

use crate::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// One flow of a generated scenario.
#[derive(Clone, Debug)]
struct GeneratedFlow {
    path: Vec<u32>,
    weight: u32,
    min: Option<u64>,
    cap: Option<u64>,
    demand: Option<u64>,
}

#[derive(Clone, Debug)]
struct Scenario {
    capacities: Vec<u64>,
    flows: Vec<GeneratedFlow>,
}

fn rate_value() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..1_000, 1_000u64..2_000_000_000_000]
}

fn capacity() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..1_000, 1_000_000u64..1_000_000_000_000]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    proptest::collection::vec(capacity(), 1..6).prop_flat_map(|capacities| {
        let link_count = capacities.len() as u32;
        let flow = (
            proptest::sample::subsequence(
                (0..link_count).collect::<Vec<_>>(),
                1..=3.min(link_count as usize),
            ),
            prop_oneof![1u32..=100, Just(75), Just(25), 1u32..=WEIGHT_MAX],
            proptest::option::weighted(0.5, rate_value()),
            proptest::option::weighted(0.3, rate_value()),
            proptest::option::weighted(0.5, rate_value()),
        )
            .prop_map(|(path, weight, min, cap, demand)| {
                // A guarantee above the cap is refused; keep generated flows valid.
                let (min, cap) = match (min, cap) {
                    (Some(min), Some(cap)) if min > cap => (Some(cap), Some(min)),
                    other => other,
                };
                GeneratedFlow {
                    path,
                    weight,
                    min,
                    cap,
                    demand,
                }
            });
        (Just(capacities), proptest::collection::vec(flow, 1..12))
            .prop_map(|(capacities, flows)| Scenario { capacities, flows })
    })
}

fn events(scenario: &Scenario) -> Vec<Event> {
    let mut events: Vec<Event> = scenario
        .capacities
        .iter()
        .enumerate()
        .map(|(id, &capacity)| {
            Event::AddLink(LinkSpec {
                link: LinkId(id as u32),
                kind: LinkKind::Pcie { gpu: id as u32 },
                capacity_bytes_per_second: capacity,
            })
        })
        .collect();
    for (index, flow) in scenario.flows.iter().enumerate() {
        events.push(Event::AddFlow(FlowSpec {
            flow: FlowId(index as u64 + 1),
            tenant: format!("t{index}"),
            links: flow.path.iter().map(|&l| LinkId(l)).collect(),
            weight: flow.weight,
            min_bytes_per_second: flow.min,
            cap_bytes_per_second: flow.cap,
        }));
    }
    events.push(Event::Demands(
        scenario
            .flows
            .iter()
            .enumerate()
            .map(|(index, flow)| DemandReport {
                flow: FlowId(index as u64 + 1),
                bytes_per_second: flow.demand,
            })
            .collect(),
    ));
    events
}

/// Runs the events, checking that none is rejected and that the emitted `SetRate`s replay to the
/// allocator's rates after every event.
fn run(events: Vec<Event>) -> (Allocator, Vec<Vec<Command>>) {
    let mut allocator = Allocator::new();
    let mut emitted: BTreeMap<FlowId, u64> = BTreeMap::new();
    let mut all = Vec::new();
    for event in events {
        let commands = allocator.handle(event);
        for command in &commands {
            match command {
                Command::SetRate {
                    flow,
                    bytes_per_second,
                } => {
                    let previous = emitted.insert(*flow, *bytes_per_second);
                    assert_ne!(
                        previous,
                        Some(*bytes_per_second),
                        "SetRate without a change"
                    );
                }
                Command::ClearRate { flow } => {
                    emitted.remove(flow);
                }
                Command::Rejected { reason } => panic!("rejected: {reason}"),
                Command::Oversubscribed { .. } | Command::OversubscriptionResolved { .. } => {}
            }
        }
        let actual: BTreeMap<FlowId, u64> = allocator
            .flows()
            .map(|view| (view.spec.flow, view.rate_bytes_per_second))
            .collect();
        assert_eq!(emitted, actual);
        all.push(commands);
    }
    (allocator, all)
}

/// `min(cap, demand)`; `u64::MAX` for an unbounded flow.
fn bound(view: &FlowView<'_>) -> u64 {
    let cap = view.spec.cap_bytes_per_second.unwrap_or(u64::MAX);
    cap.min(view.demand_bytes_per_second.unwrap_or(u64::MAX))
}

/// Rounding slack on a link: a byte per flow.
fn slack(allocator: &Allocator, link: LinkId) -> u64 {
    allocator
        .flows()
        .filter(|view| view.spec.links.contains(&link))
        .count() as u64
}

fn saturated(allocator: &Allocator, link: LinkId) -> bool {
    let view = allocator.link(link).unwrap();
    view.load_bytes_per_second + slack(allocator, link) >= view.spec.capacity_bytes_per_second
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn no_link_is_over_capacity(scenario in scenario()) {
        let (allocator, _) = run(events(&scenario));
        for link in allocator.link_ids() {
            let view = allocator.link(link).unwrap();
            prop_assert!(view.load_bytes_per_second <= view.spec.capacity_bytes_per_second,
                "{link}: {} > {}", view.load_bytes_per_second, view.spec.capacity_bytes_per_second);
        }
    }

    #[test]
    fn guarantees_and_bounds_hold(scenario in scenario()) {
        let (allocator, _) = run(events(&scenario));
        let fits = allocator.link_ids().all(|link| {
            let view = allocator.link(link).unwrap();
            view.guaranteed_bytes_per_second <= view.spec.capacity_bytes_per_second
        });
        for view in allocator.flows() {
            let owed = view.spec.min_bytes_per_second.unwrap_or(0).min(bound(&view));
            prop_assert!(view.rate_bytes_per_second <= bound(&view));
            prop_assert!(view.floor_bytes_per_second <= owed);
            if fits {
                prop_assert_eq!(view.floor_bytes_per_second, owed);
                prop_assert!(view.rate_bytes_per_second >= owed,
                    "{}: {} < {owed}", view.spec.flow, view.rate_bytes_per_second);
            }
        }
    }

    #[test]
    fn work_conserving(scenario in scenario()) {
        // A flow below its bound (a backlogged one below its cap, or one below its demand) crosses
        // a full link: no capacity it could use is left idle.
        let (allocator, _) = run(events(&scenario));
        for view in allocator.flows() {
            if view.rate_bytes_per_second < bound(&view) {
                prop_assert!(
                    view.spec.links.iter().any(|&link| saturated(&allocator, link)),
                    "{} at {} below its bound {} with spare capacity on every link",
                    view.spec.flow, view.rate_bytes_per_second, bound(&view)
                );
            }
        }
    }

    #[test]
    fn weighted_max_min_fair(scenario in scenario()) {
        // Every flow below its bound has a bottleneck: a full link on which no flow above its
        // floor has a larger rate / weight. So its normalized rate cannot grow without taking
        // from a flow whose normalized rate is no larger.
        let (allocator, _) = run(events(&scenario));
        let views: Vec<FlowView<'_>> = allocator.flows().collect();
        for f in &views {
            if f.rate_bytes_per_second >= bound(f) {
                continue;
            }
            let has_bottleneck = f.spec.links.iter().any(|&link| {
                let tolerance = slack(&allocator, link) as f64 + 1.0;
                saturated(&allocator, link)
                    && views.iter().filter(|g| g.spec.links.contains(&link)).all(|g| {
                        let above_floor =
                            g.rate_bytes_per_second as f64 > g.floor_bytes_per_second as f64 + tolerance;
                        let (wf, wg) = (f64::from(f.spec.weight), f64::from(g.spec.weight));
                        !above_floor
                            || g.rate_bytes_per_second as f64 * wf
                                <= f.rate_bytes_per_second as f64 * wg + tolerance * (wf + wg)
                    })
            });
            prop_assert!(has_bottleneck, "{} has no bottleneck link", f.spec.flow);
        }
    }

    #[test]
    fn weights_split_a_shared_link_proportionally(
        capacity in 1_000u64..BYTES_PER_SECOND_MAX,
        first in 1u32..=1000,
        second in 1u32..=1000,
    ) {
        let mut allocator = Allocator::new();
        allocator.handle(Event::AddLink(LinkSpec {
            link: LinkId(1),
            kind: LinkKind::NvLink { from: 0, to: 1 },
            capacity_bytes_per_second: capacity,
        }));
        for (id, weight) in [(1, first), (2, second)] {
            allocator.handle(Event::AddFlow(FlowSpec {
                flow: FlowId(id),
                tenant: format!("t{id}"),
                links: vec![LinkId(1)],
                weight,
                min_bytes_per_second: None,
                cap_bytes_per_second: None,
            }));
        }
        let a = allocator.flow(FlowId(1)).unwrap().rate_bytes_per_second;
        let b = allocator.flow(FlowId(2)).unwrap().rate_bytes_per_second;
        prop_assert!(a + b <= capacity && a + b + 2 >= capacity);
        let (a, b, first, second) = (a as f64, b as f64, f64::from(first), f64::from(second));
        prop_assert!((a * second - b * first).abs() <= first + second, "{a}:{b} vs {first}:{second}");
        if first == 75.0 && second == 25.0 {
            prop_assert!((a - 3.0 * b).abs() <= 4.0);
        }
    }

    #[test]
    fn deterministic_and_independent_of_insertion_order(scenario in scenario()) {
        let (first, first_commands) = run(events(&scenario));
        let (_, second_commands) = run(events(&scenario));
        prop_assert_eq!(first_commands, second_commands);

        // Adding the flows in reverse order ends in the same rates.
        let mut reversed = events(&scenario);
        let links = scenario.capacities.len();
        let flow_count = scenario.flows.len();
        reversed[links..links + flow_count].reverse();
        let (second, _) = run(reversed);
        let rates = |allocator: &Allocator| -> Vec<(FlowId, u64)> {
            allocator.flows().map(|v| (v.spec.flow, v.rate_bytes_per_second)).collect()
        };
        prop_assert_eq!(rates(&first), rates(&second));
    }

    #[test]
    fn random_event_sequences_keep_the_invariants(
        scenario in scenario(),
        steps in proptest::collection::vec((0u8..4, 0usize..16, proptest::option::of(rate_value())), 0..40),
    ) {
        // Remove and re-add flows, change demands and capacities in any order; `run` checks that
        // nothing is rejected and that the commands replay to the state after every event.
        let mut events = events(&scenario);
        let mut present: Vec<bool> = vec![true; scenario.flows.len()];
        for (kind, which, value) in steps {
            let index = which % scenario.flows.len();
            let flow = FlowId(index as u64 + 1);
            let event = match (kind, present[index]) {
                (0, true) => {
                    present[index] = false;
                    Event::RemoveFlow { flow }
                }
                (0, false) => {
                    present[index] = true;
                    let spec = &scenario.flows[index];
                    Event::AddFlow(FlowSpec {
                        flow,
                        tenant: "again".to_string(),
                        links: spec.path.iter().map(|&l| LinkId(l)).collect(),
                        weight: spec.weight,
                        min_bytes_per_second: spec.min,
                        cap_bytes_per_second: spec.cap,
                    })
                }
                (1, true) => Event::Demand { flow, bytes_per_second: value },
                (2, _) => Event::SetLinkCapacity {
                    link: LinkId((which % scenario.capacities.len()) as u32),
                    capacity_bytes_per_second: value.unwrap_or(1).clamp(1, BYTES_PER_SECOND_MAX),
                },
                _ => continue,
            };
            events.push(event);
        }
        let (allocator, _) = run(events);
        for link in allocator.link_ids() {
            let view = allocator.link(link).unwrap();
            prop_assert!(view.load_bytes_per_second <= view.spec.capacity_bytes_per_second);
        }
    }
}
