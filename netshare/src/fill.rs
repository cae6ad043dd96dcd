//! The allocation itself: guarantees first, then weighted progressive filling (water-filling)
//! over many links, as one pure function of capacities and flows.
//!
//! **Phase 1, guarantees.** A flow's effective guarantee is `min(min, cap, demand)`: a guarantee
//! is only owed to the extent the flow can use it. On a link whose effective guarantees add up to
//! more than its capacity, they are scaled by `capacity / sum` (and the link is reported); a flow
//! crossing several such links takes the smallest scale. The result is the flow's *floor*.
//!
//! **Phase 2, filling.** A water level `λ` rises from 0. An unfrozen flow's rate at level `λ` is
//! `clamp(weight × λ, floor, bound)` where `bound = min(cap, demand)`. A flow freezes when it
//! reaches its bound or when one of its links fills up; every unfrozen flow on a full link freezes
//! at its current rate. Between events each link's load is linear in `λ`, so the next event is
//! found exactly: a flow leaving its floor (`λ = floor / weight`), a flow reaching its bound
//! (`λ = bound / weight`), or a link filling (`λ = (capacity − fixed) / slope`). Each iteration
//! passes one floor or freezes at least one flow, so there are at most `2 × flows + 1`.
//!
//! The result is weighted max-min fair above the floors: every flow below its bound has a full
//! link on which no flow above its own floor has a larger `rate / weight`. It is work-conserving:
//! a flow below its bound always has a full link.
//!
//! Arithmetic is `f64`. Every input is an integer below 2^53 (so exact), and every result is within
//! a few ulps of the exact rational one. Results are rounded to the nearest whole byte per second
//! (so 2/3 of 90 GB/s is 60 GB/s, not 59,999,999,999 B/s); rounding is monotonic and bounds and
//! guarantees are integers, so each flow stays within its bound and at or above its guarantee. A
//! final integer pass takes the few bytes rounding may have put over a link's capacity back from
//! the flows on it with the most room above their floors, so no link is ever over capacity.

use crate::types::{FLOWS_MAX, LINKS_MAX, LINKS_PER_FLOW_MAX};

/// A flow as the filling sees it.
#[derive(Clone, Debug)]
pub(crate) struct FillFlow {
    /// Indices into the capacities slice; distinct.
    pub links: Vec<usize>,
    pub weight: u32,
    /// `min(min, cap, demand)`: what the flow is owed before any sharing.
    pub guarantee: u64,
    /// `min(cap, demand)`, or `None` for a backlogged flow without a cap.
    pub bound: Option<u64>,
}

/// The result, index for index with the inputs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Filled {
    pub rates: Vec<u64>,
    /// The guarantee after scaling on oversubscribed links.
    pub floors: Vec<u64>,
    /// The sum of effective guarantees on every link (oversubscribed where above capacity).
    pub guaranteed: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq)]
enum FlowState {
    Active,
    Frozen,
}

/// Allocates `capacities` (bytes/s per link) among `flows`.
pub(crate) fn water_fill(capacities: &[u64], flows: &[FillFlow]) -> Filled {
    assert!(capacities.len() <= LINKS_MAX);
    assert!(flows.len() <= FLOWS_MAX);

    let mut flows_on_link: Vec<Vec<usize>> = vec![Vec::new(); capacities.len()];
    for (index, flow) in flows.iter().enumerate() {
        assert!(!flow.links.is_empty() && flow.links.len() <= LINKS_PER_FLOW_MAX);
        assert!(flow.weight > 0);
        assert!(flow.bound.is_none_or(|bound| flow.guarantee <= bound));
        for &link in &flow.links {
            flows_on_link[link].push(index);
        }
    }

    // Phase 1: guarantees. Sums cannot overflow: FLOWS_MAX × 2^50 < 2^63.
    let mut guaranteed = vec![0u64; capacities.len()];
    for flow in flows {
        for &link in &flow.links {
            guaranteed[link] += flow.guarantee;
        }
    }
    let scale: Vec<f64> = capacities
        .iter()
        .zip(&guaranteed)
        .map(|(&capacity, &sum)| {
            if sum > capacity {
                capacity as f64 / sum as f64
            } else {
                1.0
            }
        })
        .collect();
    let floors: Vec<f64> = flows
        .iter()
        .map(|flow| {
            let smallest = flow
                .links
                .iter()
                .map(|&link| scale[link])
                .fold(1.0, f64::min);
            // Multiplying by exactly 1.0 keeps a guarantee that fits exact.
            flow.guarantee as f64 * smallest
        })
        .collect();

    // Phase 2: progressive filling.
    let bounds: Vec<f64> = flows
        .iter()
        .map(|flow| flow.bound.map_or(f64::INFINITY, |bound| bound as f64))
        .collect();
    let rate_at = |index: usize, level: f64| -> f64 {
        (f64::from(flows[index].weight) * level)
            .max(floors[index])
            .min(bounds[index])
    };
    let mut state = vec![FlowState::Active; flows.len()];
    let mut rates = vec![0.0f64; flows.len()];
    let mut level = 0.0f64;
    let iterations_max = 2 * flows.len() + 1;
    let mut iteration = 0;
    loop {
        assert!(
            iteration <= iterations_max,
            "water-filling did not converge"
        );
        iteration += 1;

        // Flows that reached their bound freeze there. The level at which that happens is computed
        // by the same expression as the event below, so the comparison is exact.
        for index in 0..flows.len() {
            if state[index] == FlowState::Active
                && level >= bounds[index] / f64::from(flows[index].weight)
            {
                state[index] = FlowState::Frozen;
                rates[index] = bounds[index];
            }
        }
        if state.iter().all(|&s| s == FlowState::Frozen) {
            break;
        }

        // Each link's load is `fixed + slope × λ` until the next event.
        let mut fixed = vec![0.0f64; capacities.len()];
        let mut slope = vec![0.0f64; capacities.len()];
        let mut next = f64::INFINITY;
        for (index, flow) in flows.iter().enumerate() {
            let weight = f64::from(flow.weight);
            let (contribution_fixed, contribution_slope) = match state[index] {
                FlowState::Frozen => (rates[index], 0.0),
                FlowState::Active => {
                    let floor_level = floors[index] / weight;
                    if level < floor_level {
                        next = next.min(floor_level);
                        (floors[index], 0.0)
                    } else {
                        next = next.min(bounds[index] / weight);
                        (0.0, weight)
                    }
                }
            };
            for &link in &flow.links {
                fixed[link] += contribution_fixed;
                slope[link] += contribution_slope;
            }
        }
        let full_at: Vec<f64> = (0..capacities.len())
            .map(|link| {
                if slope[link] > 0.0 {
                    ((capacities[link] as f64 - fixed[link]) / slope[link]).max(level)
                } else {
                    f64::INFINITY
                }
            })
            .collect();
        next = full_at.iter().copied().fold(next, f64::min);
        assert!(
            next.is_finite() && next >= level,
            "an active flow has no next event"
        );
        level = next;

        for (link, &at) in full_at.iter().enumerate() {
            if at <= level {
                for &index in &flows_on_link[link] {
                    if state[index] == FlowState::Active {
                        state[index] = FlowState::Frozen;
                        rates[index] = rate_at(index, level);
                    }
                }
            }
        }
    }

    let (rates, floors) = round_within_capacity(capacities, &flows_on_link, &rates, &floors);
    for (index, flow) in flows.iter().enumerate() {
        assert!(flow.bound.is_none_or(|bound| rates[index] <= bound));
        assert!(rates[index] >= floors[index]);
    }
    Filled {
        rates,
        floors,
        guaranteed,
    }
}

/// Rounds rates and floors to whole bytes per second, then lowers rates where rounding put a link
/// over capacity: first by rounding down instead of up the flows on it that were rounded up the
/// most (which keeps every rate within a byte of exact; a floor that fits is an integer, so it is
/// never rounded up, and only scaled floors on oversubscribed links can lose a byte), and only if
/// that is not enough (float error) from the flows with the most room above their floors, then
/// below floors.
fn round_within_capacity(
    capacities: &[u64],
    flows_on_link: &[Vec<usize>],
    exact_rates: &[f64],
    exact_floors: &[f64],
) -> (Vec<u64>, Vec<u64>) {
    let mut rates: Vec<u64> = exact_rates
        .iter()
        .map(|&rate| rate.round() as u64)
        .collect();
    let floors: Vec<u64> = exact_floors
        .iter()
        .map(|&floor| floor.round() as u64)
        .collect();
    for (link, on_link) in flows_on_link.iter().enumerate() {
        let capacity = capacities[link];
        let mut load: u64 = on_link.iter().map(|&index| rates[index]).sum();
        if load <= capacity {
            continue;
        }
        let mut rounded_up: Vec<(f64, usize)> = on_link
            .iter()
            .map(|&index| (rates[index] as f64 - exact_rates[index], index))
            .filter(|&(up, index)| up > 0.0 && rates[index] > 0)
            .collect();
        // Most rounded up first; ties by index, so the result is deterministic.
        rounded_up.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, index) in &rounded_up {
            if load <= capacity {
                break;
            }
            rates[index] -= 1;
            load -= 1;
        }
        // Each step clears the excess or takes a flow down to its floor (then to 0).
        for _ in 0..=2 * on_link.len() {
            if load <= capacity {
                break;
            }
            let room = |index: usize| rates[index] - floors[index].min(rates[index]);
            let largest = |key: &dyn Fn(usize) -> u64| -> usize {
                *on_link
                    .iter()
                    .max_by_key(|&&index| (key(index), std::cmp::Reverse(index)))
                    .expect("a link over capacity has flows")
            };
            let roomiest = largest(&room);
            let (victim, available) = if room(roomiest) > 0 {
                (roomiest, room(roomiest))
            } else {
                let fastest = largest(&|index| rates[index]);
                (fastest, rates[fastest])
            };
            let taken = available.min(load - capacity);
            rates[victim] -= taken;
            load -= taken;
        }
        assert!(load <= capacity, "rounding repair did not converge");
    }
    let floors = floors
        .iter()
        .zip(&rates)
        .map(|(&floor, &rate)| floor.min(rate))
        .collect();
    (rates, floors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(links: &[usize], weight: u32, guarantee: u64, bound: Option<u64>) -> FillFlow {
        FillFlow {
            links: links.to_vec(),
            weight,
            guarantee,
            bound,
        }
    }

    #[test]
    fn weights_split_one_link() {
        let filled = water_fill(&[100], &[flow(&[0], 75, 0, None), flow(&[0], 25, 0, None)]);
        assert_eq!(filled.rates, vec![75, 25]);
    }

    #[test]
    fn guarantee_is_a_floor_under_the_fair_share() {
        // Fair shares would be 50/50; the guarantee of 60 lifts the first flow, the second gets
        // the rest.
        let filled = water_fill(&[100], &[flow(&[0], 1, 60, None), flow(&[0], 1, 0, None)]);
        assert_eq!(filled.rates, vec![60, 40]);
        // A guarantee below the fair share changes nothing.
        let filled = water_fill(&[100], &[flow(&[0], 1, 30, None), flow(&[0], 1, 0, None)]);
        assert_eq!(filled.rates, vec![50, 50]);
    }

    #[test]
    fn oversubscribed_guarantees_scale() {
        let filled = water_fill(&[100], &[flow(&[0], 1, 150, None), flow(&[0], 1, 50, None)]);
        assert_eq!(filled.guaranteed, vec![200]);
        assert_eq!(filled.floors, vec![75, 25]);
        assert_eq!(filled.rates, vec![75, 25]);
    }

    #[test]
    fn classic_multi_link_max_min() {
        // Links 0 and 1 of capacity 10; flow 0 crosses both, flow 1 only link 0, flow 2 only
        // link 1, flow 3 only link 1. Link 1 fills first at λ = 10/3.
        let filled = water_fill(
            &[10, 10],
            &[
                flow(&[0, 1], 1, 0, None),
                flow(&[0], 1, 0, None),
                flow(&[1], 1, 0, None),
                flow(&[1], 1, 0, None),
            ],
        );
        assert_eq!(filled.rates, vec![3, 7, 3, 3]);
    }

    #[test]
    fn small_demand_is_redistributed() {
        let filled = water_fill(
            &[100],
            &[flow(&[0], 1, 0, Some(10)), flow(&[0], 1, 0, None)],
        );
        assert_eq!(filled.rates, vec![10, 90]);
    }

    #[test]
    fn zero_demand_gets_nothing() {
        let filled = water_fill(&[100], &[flow(&[0], 1, 0, Some(0)), flow(&[0], 3, 0, None)]);
        assert_eq!(filled.rates, vec![0, 100]);
    }

    #[test]
    fn rounding_never_puts_a_link_over_capacity() {
        // Three equal shares of 2 B/s are 0.67 each; rounded they would be 3 B/s in all.
        let filled = water_fill(
            &[2],
            &[
                flow(&[0], 1, 0, None),
                flow(&[0], 1, 0, None),
                flow(&[0], 1, 0, None),
            ],
        );
        assert_eq!(filled.rates.iter().sum::<u64>(), 2);
        // Scaled guarantees of 1.5 + 1.5 on 3 B/s round to 2 + 2: the repair takes a byte back,
        // even below a (rounded) floor, and the reported floor follows.
        let filled = water_fill(&[3], &[flow(&[0], 1, 3, None), flow(&[0], 1, 3, None)]);
        assert_eq!(filled.rates, vec![1, 2]);
        assert_eq!(filled.floors, vec![1, 2]);
    }

    #[test]
    fn no_flows() {
        let filled = water_fill(&[100, 5], &[]);
        assert_eq!(filled.rates, Vec::<u64>::new());
        assert_eq!(filled.guaranteed, vec![0, 0]);
    }
}
