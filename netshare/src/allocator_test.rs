//! Scenario tests of the allocator engine: exact `Vec<Command>` comparisons.

use crate::*;

const GB: u64 = 1_000_000_000;

pub(crate) fn link(id: u32, capacity: u64) -> Event {
    Event::AddLink(LinkSpec {
        link: LinkId(id),
        kind: LinkKind::NvLink { from: 0, to: 1 },
        capacity_bytes_per_second: capacity,
    })
}

pub(crate) fn flow(id: u64, links: &[u32], weight: u32) -> FlowSpec {
    FlowSpec {
        flow: FlowId(id),
        tenant: format!("tenant-{id}"),
        links: links.iter().map(|&l| LinkId(l)).collect(),
        weight,
        min_bytes_per_second: None,
        cap_bytes_per_second: None,
    }
}

fn set(flow: u64, rate: u64) -> Command {
    Command::SetRate {
        flow: FlowId(flow),
        bytes_per_second: rate,
    }
}

fn demand(flow: u64, rate: Option<u64>) -> Event {
    Event::Demand {
        flow: FlowId(flow),
        bytes_per_second: rate,
    }
}

#[test]
fn shares_75_25_split_three_to_one() {
    let mut allocator = Allocator::new();
    assert_eq!(allocator.handle(link(1, 400 * GB)), vec![]);
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(1, &[1], 75))),
        vec![set(1, 400 * GB)]
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(2, &[1], 25))),
        vec![set(1, 300 * GB), set(2, 100 * GB)]
    );
    // The second tenant goes quiet: the first gets everything it does not use.
    assert_eq!(
        allocator.handle(demand(2, Some(10 * GB))),
        vec![set(1, 390 * GB), set(2, 10 * GB)]
    );
    // The same report again changes nothing and emits nothing.
    assert_eq!(allocator.handle(demand(2, Some(10 * GB))), vec![]);
    // Backlogged again: back to 3:1.
    assert_eq!(
        allocator.handle(demand(2, None)),
        vec![set(1, 300 * GB), set(2, 100 * GB)]
    );
    assert_eq!(
        allocator.handle(Event::RemoveFlow { flow: FlowId(1) }),
        vec![Command::ClearRate { flow: FlowId(1) }, set(2, 400 * GB)]
    );
}

#[test]
fn guarantee_lifts_a_small_share_and_caps_bound_a_large_one() {
    let mut allocator = Allocator::new();
    allocator.handle(link(1, 100 * GB));
    let guaranteed = FlowSpec {
        min_bytes_per_second: Some(40 * GB),
        ..flow(1, &[1], 1)
    };
    let capped = FlowSpec {
        cap_bytes_per_second: Some(30 * GB),
        ..flow(2, &[1], 9)
    };
    assert_eq!(
        allocator.handle(Event::AddFlow(guaranteed)),
        vec![set(1, 100 * GB)]
    );
    // Weight 9 would give flow 2 90 GB/s; the guarantee keeps flow 1 at 40, and flow 2 gets 60.
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(3, &[1], 9))),
        vec![set(1, 40 * GB), set(3, 60 * GB)]
    );
    // A capped flow takes at most its cap; the guarantee still holds for flow 1 and the rest is
    // split by weight between the others above their floors.
    assert_eq!(
        allocator.handle(Event::AddFlow(capped)),
        vec![set(2, 30 * GB), set(3, 30 * GB)]
    );
    assert_eq!(
        allocator.flow(FlowId(1)).unwrap().rate_bytes_per_second,
        40 * GB
    );
    assert_eq!(
        allocator.link(LinkId(1)).unwrap().load_bytes_per_second,
        100 * GB
    );
}

#[test]
fn oversubscribed_guarantees_scale_and_are_reported() {
    let mut allocator = Allocator::new();
    allocator.handle(link(1, 100 * GB));
    let a = FlowSpec {
        min_bytes_per_second: Some(90 * GB),
        ..flow(1, &[1], 1)
    };
    let b = FlowSpec {
        min_bytes_per_second: Some(60 * GB),
        ..flow(2, &[1], 1)
    };
    allocator.handle(Event::AddFlow(a));
    assert_eq!(
        allocator.handle(Event::AddFlow(b)),
        vec![
            Command::Oversubscribed {
                link: LinkId(1),
                guaranteed_bytes_per_second: 150 * GB,
                capacity_bytes_per_second: 100 * GB,
            },
            set(1, 60 * GB),
            set(2, 40 * GB),
        ]
    );
    assert_eq!(
        allocator.flow(FlowId(2)).unwrap().floor_bytes_per_second,
        40 * GB
    );
    // Flow 1 now only wants 30: the guarantees fit again, flow 2 gets the rest.
    assert_eq!(
        allocator.handle(demand(1, Some(30 * GB))),
        vec![
            Command::OversubscriptionResolved { link: LinkId(1) },
            set(1, 30 * GB),
            set(2, 70 * GB),
        ]
    );
    // The link shrinks below the guarantees again.
    assert_eq!(
        allocator.handle(Event::SetLinkCapacity {
            link: LinkId(1),
            capacity_bytes_per_second: 45 * GB,
        }),
        vec![
            Command::Oversubscribed {
                link: LinkId(1),
                guaranteed_bytes_per_second: 90 * GB,
                capacity_bytes_per_second: 45 * GB,
            },
            set(1, 15 * GB),
            set(2, 30 * GB),
        ]
    );
}

#[test]
fn multi_link_paths_fill_progressively() {
    // Flow 1 sends GPU0 → GPU1 over NVLink 1; flow 2 sends GPU0 → NIC over PCIe 2 and NIC port
    // 3; flow 3 (weight 4) sends over the NIC port only. The NIC port (25 GB/s) is flow 2's
    // bottleneck: it gets 1/5 of it, and NVLink is not touched.
    let mut allocator = Allocator::new();
    allocator.handle(link(1, 400 * GB));
    allocator.handle(link(2, 64 * GB));
    allocator.handle(link(3, 25 * GB));
    allocator.handle(Event::AddFlow(flow(1, &[1], 1)));
    allocator.handle(Event::AddFlow(flow(2, &[2, 3], 1)));
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(3, &[3], 4))),
        vec![set(2, 5 * GB), set(3, 20 * GB)]
    );
    assert_eq!(
        allocator.flow(FlowId(1)).unwrap().rate_bytes_per_second,
        400 * GB
    );
    // A fourth flow shares PCIe with flow 2. PCIe is not flow 2's bottleneck, so the newcomer
    // gets everything flow 2 cannot use (work conservation), not half.
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(4, &[2], 1))),
        vec![set(4, 59 * GB)]
    );
}

#[test]
fn invalid_events_are_rejected_and_change_nothing() {
    let mut allocator = Allocator::new();
    allocator.handle(link(1, 100));
    allocator.handle(Event::AddFlow(flow(1, &[1], 1)));
    let rejected = |reason| vec![Command::Rejected { reason }];
    assert_eq!(
        allocator.handle(link(1, 5)),
        rejected(Reject::DuplicateLink(LinkId(1)))
    );
    assert_eq!(
        allocator.handle(link(2, 0)),
        rejected(Reject::InvalidCapacity {
            link: LinkId(2),
            bytes_per_second: 0
        })
    );
    assert_eq!(
        allocator.handle(link(2, BYTES_PER_SECOND_MAX + 1)),
        rejected(Reject::InvalidCapacity {
            link: LinkId(2),
            bytes_per_second: BYTES_PER_SECOND_MAX + 1
        })
    );
    assert_eq!(
        allocator.handle(Event::RemoveLink { link: LinkId(1) }),
        rejected(Reject::LinkInUse {
            link: LinkId(1),
            flows: 1
        })
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(1, &[1], 1))),
        rejected(Reject::DuplicateFlow(FlowId(1)))
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(0, &[1], 1))),
        rejected(Reject::ReservedFlowId)
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(2, &[9], 1))),
        rejected(Reject::UnknownLink(LinkId(9)))
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(2, &[1, 1], 1))),
        rejected(Reject::InvalidPath { flow: FlowId(2) })
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(2, &[], 1))),
        rejected(Reject::InvalidPath { flow: FlowId(2) })
    );
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(2, &[1], 0))),
        rejected(Reject::InvalidWeight {
            flow: FlowId(2),
            weight: 0
        })
    );
    let inverted = FlowSpec {
        min_bytes_per_second: Some(10),
        cap_bytes_per_second: Some(5),
        ..flow(2, &[1], 1)
    };
    assert_eq!(
        allocator.handle(Event::AddFlow(inverted)),
        rejected(Reject::InvalidLimits { flow: FlowId(2) })
    );
    let nameless = FlowSpec {
        tenant: String::new(),
        ..flow(2, &[1], 1)
    };
    assert_eq!(
        allocator.handle(Event::AddFlow(nameless)),
        rejected(Reject::InvalidTenantName { flow: FlowId(2) })
    );
    // A batch with one unknown flow applies none of its reports.
    assert_eq!(
        allocator.handle(Event::Demands(vec![
            DemandReport {
                flow: FlowId(1),
                bytes_per_second: Some(1),
            },
            DemandReport {
                flow: FlowId(7),
                bytes_per_second: Some(1),
            },
        ])),
        rejected(Reject::UnknownFlow(FlowId(7)))
    );
    assert_eq!(
        allocator.flow(FlowId(1)).unwrap().demand_bytes_per_second,
        None
    );
    assert_eq!(
        allocator.handle(Event::RemoveFlow { flow: FlowId(7) }),
        rejected(Reject::UnknownFlow(FlowId(7)))
    );
    assert_eq!(allocator.flows().count(), 1);
    assert_eq!(
        allocator.flow(FlowId(1)).unwrap().rate_bytes_per_second,
        100
    );
    // Removing the flow frees the link.
    allocator.handle(Event::RemoveFlow { flow: FlowId(1) });
    assert_eq!(
        allocator.handle(Event::RemoveLink { link: LinkId(1) }),
        vec![]
    );
    assert_eq!(allocator.link_ids().count(), 0);
}

#[test]
fn bounds_are_enforced() {
    let mut allocator = Allocator::new();
    for id in 0..LINKS_MAX as u32 {
        assert_eq!(allocator.handle(link(id, 1_000_000)), vec![]);
    }
    assert_eq!(
        allocator.handle(link(LINKS_MAX as u32, 1)),
        vec![Command::Rejected {
            reason: Reject::TooManyLinks
        }]
    );
    let long_path: Vec<u32> = (0..=LINKS_PER_FLOW_MAX as u32).collect();
    assert_eq!(
        allocator.handle(Event::AddFlow(flow(1, &long_path, 1))),
        vec![Command::Rejected {
            reason: Reject::InvalidPath { flow: FlowId(1) }
        }]
    );
    let batch = Event::Demands(vec![
        DemandReport {
            flow: FlowId(1),
            bytes_per_second: None
        };
        FLOWS_MAX + 1
    ]);
    assert_eq!(
        allocator.handle(batch),
        vec![Command::Rejected {
            reason: Reject::TooManyDemands
        }]
    );
}

#[test]
fn many_flows_stay_fast() {
    // FLOWS_MAX flows over 64 links, a third of them with small demands: the bounds hold and the
    // filling converges (its iteration count is asserted inside).
    let mut allocator = Allocator::new();
    for id in 0..64 {
        allocator.handle(link(id, 100 * GB));
    }
    let mut reports = Vec::new();
    for id in 1..=FLOWS_MAX as u64 {
        let path = [(id % 64) as u32, ((id / 64 + id) % 64) as u32];
        let path: &[u32] = if path[0] == path[1] {
            &path[..1]
        } else {
            &path
        };
        let commands = allocator.handle(Event::AddFlow(flow(id, path, (id % 7 + 1) as u32)));
        assert!(!commands.is_empty());
        reports.push(DemandReport {
            flow: FlowId(id),
            bytes_per_second: (id % 3 == 0).then_some(id * 1_000_000),
        });
    }
    let commands = allocator.handle(Event::Demands(reports));
    assert!(commands.len() <= FLOWS_MAX);
    for id in allocator.link_ids().collect::<Vec<_>>() {
        let view = allocator.link(id).unwrap();
        assert!(view.load_bytes_per_second <= view.spec.capacity_bytes_per_second);
    }
}

#[test]
fn readme_worked_example() {
    let mut allocator = Allocator::new();
    allocator.handle(link(1, 400 * GB));
    let a = flow(1, &[1], 50);
    let b = FlowSpec {
        min_bytes_per_second: Some(150 * GB),
        ..flow(2, &[1], 25)
    };
    let c = flow(3, &[1], 25);
    allocator.handle(Event::AddFlow(a));
    allocator.handle(Event::AddFlow(b));
    allocator.handle(Event::AddFlow(c));
    assert_eq!(
        allocator.handle(demand(3, Some(30 * GB))),
        vec![set(1, 220 * GB), set(3, 30 * GB)]
    );
    assert_eq!(
        allocator.flow(FlowId(2)).unwrap().rate_bytes_per_second,
        150 * GB
    );
    assert_eq!(
        allocator.handle(demand(3, None)),
        vec![set(1, 166_666_666_667), set(3, 83_333_333_333)]
    );
    assert_eq!(
        allocator.link(LinkId(1)).unwrap().load_bytes_per_second,
        400 * GB
    );
}
