//! The allocator engine: [`Allocator::handle`] takes one [`Event`], validates it, updates links,
//! flows and demands, recomputes every rate with [`crate::fill::water_fill`], and returns the
//! [`Command`]s that bring the runtime's token buckets up to date.
//!
//! It keeps the last rate it emitted per flow and emits `SetRate` only on change, so a demand
//! report that changes nothing costs the runtime nothing. All maps are `BTreeMap`s and the filling
//! visits flows in id order, so the same events give the same commands everywhere.

use crate::fill::{FillFlow, water_fill};
use crate::types::{
    BYTES_PER_SECOND_MAX, Command, DemandReport, Event, FLOWS_MAX, FlowId, FlowSpec, LINKS_MAX,
    LINKS_PER_FLOW_MAX, LinkId, LinkSpec, Reject, TENANT_NAME_BYTES_MAX, WEIGHT_MAX,
};
use std::collections::{BTreeMap, BTreeSet};

/// The bandwidth allocator: links, flows, their demands and their current rates.
#[derive(Clone, Debug, Default)]
pub struct Allocator {
    links: BTreeMap<LinkId, LinkState>,
    flows: BTreeMap<FlowId, FlowState>,
    /// Links whose guarantees exceed their capacity, with the sum last reported.
    oversubscribed: BTreeMap<LinkId, u64>,
}

#[derive(Clone, Debug)]
struct LinkState {
    spec: LinkSpec,
    /// How many flows cross the link (a link in use cannot be removed).
    flow_count: usize,
    /// The sum of the effective guarantees on the link, as of the last recompute.
    guaranteed_bytes_per_second: u64,
}

#[derive(Clone, Debug)]
struct FlowState {
    spec: FlowSpec,
    demand_bytes_per_second: Option<u64>,
    /// The rate last emitted; `None` until the flow's first `SetRate`.
    rate_bytes_per_second: Option<u64>,
    floor_bytes_per_second: u64,
}

/// A read-only view of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowView<'a> {
    pub spec: &'a FlowSpec,
    /// The last demand reported; `None` = backlogged.
    pub demand_bytes_per_second: Option<u64>,
    /// The rate last emitted in a `SetRate`.
    pub rate_bytes_per_second: u64,
    /// The guarantee the flow actually gets: `min(min, cap, demand)`, scaled down where its links
    /// are oversubscribed.
    pub floor_bytes_per_second: u64,
}

/// A read-only view of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkView<'a> {
    pub spec: &'a LinkSpec,
    /// The sum of the rates of the flows that cross it.
    pub load_bytes_per_second: u64,
    /// The sum of those flows' effective guarantees (above capacity when oversubscribed).
    pub guaranteed_bytes_per_second: u64,
}

impl Allocator {
    pub fn new() -> Allocator {
        Allocator::default()
    }

    /// Applies one event and returns what the runtime must do (see [`Command`] for the order).
    pub fn handle(&mut self, event: Event) -> Vec<Command> {
        let mut commands = Vec::new();
        let applied = match event {
            Event::AddLink(spec) => self.add_link(spec),
            Event::RemoveLink { link } => self.remove_link(link),
            Event::SetLinkCapacity {
                link,
                capacity_bytes_per_second,
            } => self.set_link_capacity(link, capacity_bytes_per_second),
            Event::AddFlow(spec) => self.add_flow(spec),
            Event::RemoveFlow { flow } => self.remove_flow(flow, &mut commands),
            Event::Demand {
                flow,
                bytes_per_second,
            } => self.set_demands(&[DemandReport {
                flow,
                bytes_per_second,
            }]),
            Event::Demands(reports) => self.set_demands(&reports),
        };
        match applied {
            Ok(()) => self.recompute(&mut commands),
            Err(reason) => {
                assert!(commands.is_empty(), "a rejected event must change nothing");
                commands.push(Command::Rejected { reason });
            }
        }
        commands
    }

    pub fn flow(&self, flow: FlowId) -> Option<FlowView<'_>> {
        self.flows.get(&flow).map(Self::flow_view)
    }

    /// All flows, by id.
    pub fn flows(&self) -> impl Iterator<Item = FlowView<'_>> {
        self.flows.values().map(Self::flow_view)
    }

    pub fn link(&self, link: LinkId) -> Option<LinkView<'_>> {
        let state = self.links.get(&link)?;
        let load_bytes_per_second = self
            .flows
            .values()
            .filter(|flow| flow.spec.links.contains(&link))
            .map(|flow| flow.rate_bytes_per_second.unwrap_or(0))
            .sum();
        Some(LinkView {
            spec: &state.spec,
            load_bytes_per_second,
            guaranteed_bytes_per_second: state.guaranteed_bytes_per_second,
        })
    }

    /// All link ids, in order.
    pub fn link_ids(&self) -> impl Iterator<Item = LinkId> + '_ {
        self.links.keys().copied()
    }

    fn flow_view(state: &FlowState) -> FlowView<'_> {
        FlowView {
            spec: &state.spec,
            demand_bytes_per_second: state.demand_bytes_per_second,
            rate_bytes_per_second: state
                .rate_bytes_per_second
                .expect("every flow has a rate once an event is handled"),
            floor_bytes_per_second: state.floor_bytes_per_second,
        }
    }

    fn add_link(&mut self, spec: LinkSpec) -> Result<(), Reject> {
        if self.links.contains_key(&spec.link) {
            return Err(Reject::DuplicateLink(spec.link));
        }
        if self.links.len() >= LINKS_MAX {
            return Err(Reject::TooManyLinks);
        }
        check_capacity(spec.link, spec.capacity_bytes_per_second)?;
        let state = LinkState {
            spec,
            flow_count: 0,
            guaranteed_bytes_per_second: 0,
        };
        self.links.insert(state.spec.link, state);
        Ok(())
    }

    fn remove_link(&mut self, link: LinkId) -> Result<(), Reject> {
        let state = self.links.get(&link).ok_or(Reject::UnknownLink(link))?;
        if state.flow_count > 0 {
            return Err(Reject::LinkInUse {
                link,
                flows: state.flow_count,
            });
        }
        self.links.remove(&link);
        Ok(())
    }

    fn set_link_capacity(&mut self, link: LinkId, capacity: u64) -> Result<(), Reject> {
        check_capacity(link, capacity)?;
        let state = self.links.get_mut(&link).ok_or(Reject::UnknownLink(link))?;
        state.spec.capacity_bytes_per_second = capacity;
        Ok(())
    }

    fn add_flow(&mut self, spec: FlowSpec) -> Result<(), Reject> {
        let flow = spec.flow;
        if flow.0 == 0 {
            return Err(Reject::ReservedFlowId);
        }
        if self.flows.contains_key(&flow) {
            return Err(Reject::DuplicateFlow(flow));
        }
        if self.flows.len() >= FLOWS_MAX {
            return Err(Reject::TooManyFlows);
        }
        if spec.tenant.is_empty() || spec.tenant.len() > TENANT_NAME_BYTES_MAX {
            return Err(Reject::InvalidTenantName { flow });
        }
        let distinct: BTreeSet<LinkId> = spec.links.iter().copied().collect();
        if spec.links.is_empty()
            || spec.links.len() > LINKS_PER_FLOW_MAX
            || distinct.len() != spec.links.len()
        {
            return Err(Reject::InvalidPath { flow });
        }
        if let Some(&unknown) = spec.links.iter().find(|l| !self.links.contains_key(l)) {
            return Err(Reject::UnknownLink(unknown));
        }
        if spec.weight == 0 || spec.weight > WEIGHT_MAX {
            return Err(Reject::InvalidWeight {
                flow,
                weight: spec.weight,
            });
        }
        let min = spec.min_bytes_per_second.unwrap_or(0);
        let cap = spec.cap_bytes_per_second.unwrap_or(BYTES_PER_SECOND_MAX);
        if min > cap || cap > BYTES_PER_SECOND_MAX {
            return Err(Reject::InvalidLimits { flow });
        }

        for link in &spec.links {
            self.links
                .get_mut(link)
                .expect("links were checked above")
                .flow_count += 1;
        }
        let state = FlowState {
            spec,
            demand_bytes_per_second: None,
            rate_bytes_per_second: None,
            floor_bytes_per_second: 0,
        };
        self.flows.insert(flow, state);
        Ok(())
    }

    fn remove_flow(&mut self, flow: FlowId, commands: &mut Vec<Command>) -> Result<(), Reject> {
        let state = self.flows.remove(&flow).ok_or(Reject::UnknownFlow(flow))?;
        for link in &state.spec.links {
            let link = self.links.get_mut(link).expect("a flow's links exist");
            assert!(link.flow_count > 0);
            link.flow_count -= 1;
        }
        commands.push(Command::ClearRate { flow });
        Ok(())
    }

    /// Validates every report before applying any, so a bad batch changes nothing.
    fn set_demands(&mut self, reports: &[DemandReport]) -> Result<(), Reject> {
        if reports.len() > FLOWS_MAX {
            return Err(Reject::TooManyDemands);
        }
        for report in reports {
            if !self.flows.contains_key(&report.flow) {
                return Err(Reject::UnknownFlow(report.flow));
            }
            if let Some(demand) = report.bytes_per_second
                && demand > BYTES_PER_SECOND_MAX
            {
                return Err(Reject::InvalidDemand {
                    flow: report.flow,
                    bytes_per_second: demand,
                });
            }
        }
        for report in reports {
            let state = self.flows.get_mut(&report.flow).expect("checked above");
            state.demand_bytes_per_second = report.bytes_per_second;
        }
        Ok(())
    }

    /// Recomputes every rate and emits what changed.
    fn recompute(&mut self, commands: &mut Vec<Command>) {
        let link_index: BTreeMap<LinkId, usize> = self
            .links
            .keys()
            .enumerate()
            .map(|(index, &link)| (link, index))
            .collect();
        let capacities: Vec<u64> = self
            .links
            .values()
            .map(|link| link.spec.capacity_bytes_per_second)
            .collect();
        let fill_flows: Vec<FillFlow> = self
            .flows
            .values()
            .map(|flow| {
                let bound = match (flow.spec.cap_bytes_per_second, flow.demand_bytes_per_second) {
                    (Some(cap), Some(demand)) => Some(cap.min(demand)),
                    (cap, demand) => cap.or(demand),
                };
                let min = flow.spec.min_bytes_per_second.unwrap_or(0);
                FillFlow {
                    links: flow.spec.links.iter().map(|l| link_index[l]).collect(),
                    weight: flow.spec.weight,
                    guarantee: bound.map_or(min, |bound| min.min(bound)),
                    bound,
                }
            })
            .collect();
        let filled = water_fill(&capacities, &fill_flows);
        assert_eq!(filled.rates.len(), self.flows.len());
        assert_eq!(filled.guaranteed.len(), self.links.len());

        for (state, &guaranteed) in self.links.values_mut().zip(&filled.guaranteed) {
            state.guaranteed_bytes_per_second = guaranteed;
            let link = state.spec.link;
            let capacity = state.spec.capacity_bytes_per_second;
            let reported = self.oversubscribed.get(&link).copied();
            if guaranteed > capacity {
                if reported != Some(guaranteed) {
                    self.oversubscribed.insert(link, guaranteed);
                    commands.push(Command::Oversubscribed {
                        link,
                        guaranteed_bytes_per_second: guaranteed,
                        capacity_bytes_per_second: capacity,
                    });
                }
            } else if reported.is_some() {
                self.oversubscribed.remove(&link);
                commands.push(Command::OversubscriptionResolved { link });
            }
        }
        // A removed link cannot be oversubscribed: it had no flows.
        self.oversubscribed
            .retain(|link, _| self.links.contains_key(link));

        for ((&flow, state), (&rate, &floor)) in self
            .flows
            .iter_mut()
            .zip(filled.rates.iter().zip(&filled.floors))
        {
            state.floor_bytes_per_second = floor;
            if state.rate_bytes_per_second != Some(rate) {
                state.rate_bytes_per_second = Some(rate);
                commands.push(Command::SetRate {
                    flow,
                    bytes_per_second: rate,
                });
            }
        }
    }
}

fn check_capacity(link: LinkId, capacity: u64) -> Result<(), Reject> {
    if capacity == 0 || capacity > BYTES_PER_SECOND_MAX {
        return Err(Reject::InvalidCapacity {
            link,
            bytes_per_second: capacity,
        });
    }
    Ok(())
}
