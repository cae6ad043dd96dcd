//! The redistribution of one GPU's SMs among its burst tenants, as the closed-loop thread
//! runs it every period on an MPS node (`docs/design/utility-redistribution.md`): the members
//! are read from the GPU's schedule file (`ScheduleControl::activity`), fed to the GPU's
//! [`sharing::Redistributor`], and its caps and its way of sharing (turns, or side by side) are
//! published in the file for the members' interposers (`ScheduleControl::publish_caps`,
//! `ScheduleControl::publish_side_by_side`). Nothing is written while nobody is capped and
//! everyone takes turns. Side by side is published only while no other tenant that takes turns
//! (not a member, not a latency tenant) is active; while one is, the group is not judged.
//!
//! **Members**: live tenants that are not latency tenants, allowed to burst (they asked for
//! capacity beyond their share), of the highest priority among those, and active: one of their
//! processes launched (or waited to) within [`MEMBER_WINDOW_NS`] to join, within
//! [`MEMBER_LEAVE_NS`] to stay. A tenant pausing for its data loader or an evaluation for a few
//! seconds stays a member (its slower periods are noise the judgements' pairs absorb); one that
//! stopped leaves the group, and every cap comes off (a change of the group starts it again:
//! without the longer window to leave, a bursty tenant reset the group at every pause). A guaranteed tenant (not `--preemptible`) is never capped under its share of the GPU
//! (its [`Member::floor`]); a preemptible one has only the group's floor.

use std::collections::BTreeMap;

use sharing::{Member, RedistributeChange, RedistributeConfig, RedistributeOutput, Redistributor};
use tenant_abi::compute::{Activity, TENANTS};
use tenant_abi::shm::ScheduleControl;

/// How recently a tenant must have launched to join the group.
pub const MEMBER_WINDOW_NS: u64 = 1_000_000_000;
/// How recently a member must have launched to stay in it.
pub const MEMBER_LEAVE_NS: u64 = 5_000_000_000;

/// One GPU's redistribution: its core and where each member's slot is.
pub struct GpuRedistribution {
    redistributor: Redistributor,
    /// Whether the last period published any cap (the next clears them at once if none is
    /// left; otherwise nothing is written).
    capped: bool,
    /// Whether the last period published members side by side (likewise).
    sided: bool,
    /// The members of the last period (they stay while active within [`MEMBER_LEAVE_NS`]).
    members: std::collections::BTreeSet<String>,
}

impl GpuRedistribution {
    pub fn new(config: RedistributeConfig) -> GpuRedistribution {
        GpuRedistribution {
            redistributor: Redistributor::new(config),
            capped: false,
            sided: false,
            members: std::collections::BTreeSet::new(),
        }
    }

    /// One period at `now_ns`: `is_latency` names the latency tenants, `restricted` says
    /// whether the closed loop restricts the GPU's neighbours now.
    pub fn tick(
        &mut self,
        control: &ScheduleControl,
        uuid: &str,
        is_latency: impl Fn(&str) -> bool,
        restricted: bool,
        now_ns: u64,
    ) -> RedistributeOutput {
        let was = &self.members;
        let activity = control.activity();
        let (members, slots) = members(&activity, &is_latency, |name| was.contains(name), now_ns);
        self.members = members.iter().map(|member| member.name.clone()).collect();
        // Side by side, members never wait for turns: a tenant taking turns beside them (not a
        // member: a lower priority, or not allowed to burst) would wait through turns the
        // members no longer keep to. While one is active the group is not judged (as while
        // the closed loop restricts it) and nobody goes side by side.
        let others = others_taking_turns(&activity, &is_latency, &slots, now_ns);
        let output = self
            .redistributor
            .handle(now_ns, &members, restricted || others);
        let mut caps = [0u8; TENANTS];
        for (name, cap) in &output.caps {
            if let Some(&slot) = slots.get(name) {
                caps[slot] = *cap;
            }
        }
        let any = caps.iter().any(|&cap| cap != 0);
        if any || self.capped {
            control.publish_caps(&caps, now_ns);
        }
        self.capped = any;
        let sides = if output.side_by_side && !others {
            slots.values().fold(0u64, |mask, &slot| mask | 1 << slot)
        } else {
            0
        };
        if sides != 0 || self.sided {
            control.publish_side_by_side(sides, now_ns);
        }
        self.sided = sides != 0;
        if let Some(change) = &output.change {
            log_change(uuid, change);
        }
        output
    }

    /// The members' caps and rates, for the usage report and the trace.
    pub fn status(&self) -> Vec<sharing::MemberStatus> {
        self.redistributor.status()
    }
}

/// The members among a GPU's live tenants (see the module's docs), with their slots;
/// `was_member` names the last period's members.
pub fn members(
    activity: &[Activity],
    is_latency: impl Fn(&str) -> bool,
    was_member: impl Fn(&str) -> bool,
    now_ns: u64,
) -> (Vec<Member>, BTreeMap<String, usize>) {
    let candidates: Vec<&Activity> = activity
        .iter()
        .filter(|tenant| {
            let window = if was_member(&tenant.name) {
                MEMBER_LEAVE_NS
            } else {
                MEMBER_WINDOW_NS
            };
            !is_latency(&tenant.name)
                && tenant.config.burst
                && tenant_abi::compute::latency_fresh(tenant.demand_ns, now_ns, window)
        })
        .collect();
    let Some(top) = candidates.iter().map(|tenant| tenant.config.priority).max() else {
        return (Vec::new(), BTreeMap::new());
    };
    let chosen: Vec<&&Activity> = candidates
        .iter()
        .filter(|tenant| tenant.config.priority == top)
        .collect();
    let members = chosen
        .iter()
        .map(|tenant| Member {
            name: tenant.name.clone(),
            progress: tenant.progress,
            hinted: tenant.hinted,
            floor: floor(&tenant.config),
        })
        .collect();
    let slots = chosen
        .iter()
        .map(|tenant| (tenant.name.clone(), tenant.slot))
        .collect();
    (members, slots)
}

/// Whether a tenant that is neither a latency tenant nor a member (`slots`) launched on the GPU
/// within [`MEMBER_WINDOW_NS`]: one that takes turns beside the group.
fn others_taking_turns(
    activity: &[Activity],
    is_latency: impl Fn(&str) -> bool,
    slots: &BTreeMap<String, usize>,
    now_ns: u64,
) -> bool {
    activity.iter().any(|tenant| {
        !is_latency(&tenant.name)
            && !slots.contains_key(&tenant.name)
            && tenant_abi::compute::latency_fresh(tenant.demand_ns, now_ns, MEMBER_WINDOW_NS)
    })
}

/// The lowest cap of a member: its guaranteed share of the SMs (rounded up), else none.
pub fn floor(config: &tenant_abi::compute::TenantConfig) -> u8 {
    if !config.guaranteed {
        return 0;
    }
    let full = u32::from(sharing::redistribute::FULL);
    (config.share_pct.min(100) * full).div_ceil(100) as u8
}

fn log_change(uuid: &str, change: &RedistributeChange) {
    let share = |cap: u8| f64::from(cap) * 100.0 / f64::from(sharing::redistribute::FULL);
    match change {
        RedistributeChange::Judged {
            tenant,
            from,
            to,
            gain,
            stderr,
            kept,
        } => {
            let (gain, stderr) = (gain * 100.0, stderr * 100.0);
            if *kept {
                tracing::info!(
                    "redistribution on GPU {uuid}: {tenant} keeps {:.0}% of the SMs, was {:.0}% \
                     (the group's work {gain:+.1}% +- {stderr:.1}% of one tenant's work alone)",
                    share(*to),
                    share(*from)
                )
            } else {
                tracing::debug!(
                    "redistribution on GPU {uuid}: {tenant} stays at {:.0}% of the SMs ({:.0}% \
                     tried: {gain:+.1}% +- {stderr:.1}%)",
                    share(*from),
                    share(*to)
                )
            }
        }
        RedistributeChange::Reset { reason } => {
            tracing::info!("redistribution on GPU {uuid}: every SM cap off ({reason:?})")
        }
        RedistributeChange::SidesJudged {
            side_by_side,
            gain,
            stderr,
            kept,
        } => {
            let (gain, stderr) = (gain * 100.0, stderr * 100.0);
            let tried = if *side_by_side {
                "side by side (without turns)"
            } else {
                "back to turns"
            };
            if *kept {
                tracing::info!(
                    "redistribution on GPU {uuid}: the burst tenants go {tried} (the group's \
                     work {gain:+.1}% +- {stderr:.1}% of one tenant's work alone)"
                )
            } else {
                tracing::debug!(
                    "redistribution on GPU {uuid}: the burst tenants stay as they share \
                     ({tried} tried: {gain:+.1}% +- {stderr:.1}%)"
                )
            }
        }
        RedistributeChange::Probed { tenant, rate } => tracing::debug!(
            "redistribution on GPU {uuid}: {tenant} alone makes {rate:.1} units/s (a probe: \
             the others at their floors for one period)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenant_abi::compute::TenantConfig;

    const NOW: u64 = 10_000_000_000;

    fn tenant(slot: usize, name: &str, config: TenantConfig, demand_ns: u64) -> Activity {
        Activity {
            slot,
            name: name.to_owned(),
            config,
            demand_ns,
            progress: 7,
            hinted: false,
        }
    }

    const BEST_EFFORT: TenantConfig = TenantConfig {
        share_pct: 25,
        burst: true,
        guaranteed: false,
        priority: 0,
    };

    #[test]
    fn members_are_active_best_effort_burst_tenants_of_the_highest_priority() {
        let activity = [
            tenant(0, "a", BEST_EFFORT, NOW - 1),
            tenant(3, "b", BEST_EFFORT, NOW - 500_000_000),
            tenant(4, "stopped", BEST_EFFORT, NOW - 2_000_000_000),
            tenant(5, "infer", BEST_EFFORT, NOW),
            tenant(
                6,
                "guaranteed",
                TenantConfig {
                    guaranteed: true,
                    ..BEST_EFFORT
                },
                NOW - 2_000_000_000,
            ),
            tenant(
                7,
                "capped",
                TenantConfig {
                    burst: false,
                    ..BEST_EFFORT
                },
                NOW,
            ),
            tenant(
                8,
                "low",
                TenantConfig {
                    priority: -1,
                    ..BEST_EFFORT
                },
                NOW,
            ),
        ];
        let (group, slots) = members(&activity, |name| name == "infer", |_| false, NOW);
        let names: Vec<&str> = group.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(slots, BTreeMap::from([("a".into(), 0), ("b".into(), 3)]));
        assert_eq!(group[0].progress, 7);
        assert_eq!(group[0].floor, 0, "preemptible: the group's floor only");
        // A guaranteed tenant is a member with its share as its floor.
        let mut active = activity.to_vec();
        active[4].demand_ns = NOW;
        let (group, _) = members(&active, |name| name == "infer", |_| false, NOW);
        let guaranteed = group.iter().find(|m| m.name == "guaranteed").unwrap();
        assert_eq!(guaranteed.floor, 32, "25% of 128");
        // Only lower-priority tenants active: they are the group.
        let (group, _) = members(&activity[5..], |_| false, |_| false, NOW);
        assert_eq!(group.len(), 1);
        assert_eq!(group[0].name, "low");
        assert!(members(&[], |_| false, |_| false, NOW).0.is_empty());
        // A member that paused for 2 s stays one; a tenant silent that long does not join.
        let (group, _) = members(
            &activity,
            |name| name == "infer",
            |name| name == "stopped",
            NOW,
        );
        assert!(group.iter().any(|m| m.name == "stopped"));
        let paused = [tenant(4, "stopped", BEST_EFFORT, NOW - 6_000_000_000)];
        assert!(
            members(&paused, |_| false, |_| true, NOW).0.is_empty(),
            "gone after 5 s"
        );
    }

    #[test]
    fn a_tenant_taking_turns_beside_the_group_keeps_it_from_going_side_by_side() {
        let slots = BTreeMap::from([("a".to_owned(), 0), ("b".to_owned(), 3)]);
        let group = [
            tenant(0, "a", BEST_EFFORT, NOW),
            tenant(3, "b", BEST_EFFORT, NOW),
            tenant(5, "infer", BEST_EFFORT, NOW),
        ];
        // The members and a latency tenant: nobody else takes turns.
        assert!(!others_taking_turns(
            &group,
            |name| name == "infer",
            &slots,
            NOW
        ));
        // A capped tenant (no burst), or one of a lower priority, launching now: it does.
        let capped = TenantConfig {
            burst: false,
            ..BEST_EFFORT
        };
        let mut with = group.to_vec();
        with.push(tenant(7, "capped", capped, NOW));
        assert!(others_taking_turns(
            &with,
            |name| name == "infer",
            &slots,
            NOW
        ));
        // Silent for longer than a member's window to join: not beside the group.
        with[3].demand_ns = NOW - 2 * MEMBER_WINDOW_NS;
        assert!(!others_taking_turns(
            &with,
            |name| name == "infer",
            &slots,
            NOW
        ));
    }
}
