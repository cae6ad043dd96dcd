//! The tuner: caps the channels (CTAs) of a tenant's collectives by its bandwidth share, only
//! while another tenant on the node is moving data too (work-conserving: alone, a tenant keeps
//! NCCL's own choice).
//!
//! Why channels: on one NVLink pair, a collective's bandwidth grows with its channel count, and
//! when tenants' NCCL kernels run side by side (under MPS, which the agent runs per GPU) their
//! channels share the links. Measured on 2 x H200 (docs/benchmarks.md, probe_sharing.sh): two
//! jobs capped 18/6 under MPS reached 208 + 84 GB/s, together more than one job alone (256);
//! time-sliced without MPS the same caps gave 83 + 46. Fewer channels get more bandwidth each,
//! so channels are split by `weight^exponent` (exponent 1.2 by default, fitted to those runs)
//! rather than by weight.
//!
//! Every rank of a communicator must pick the same channel count for a collective (ranks on
//! different rings hang). Decisions therefore go through the communicator's log in the node's
//! activity table ([`activity::Table::agree`]): the first rank on the node to reach a collective
//! decides for all. A rank on another node cannot see that log, so caps apply only while every
//! rank of the communicator is attached on this node (slices of one node's GPUs count, whatever
//! NCCL's own node count says); otherwise all ranks keep NCCL's choice.

use tenant_abi::NcclEnv;
use tenant_abi::env::var;

use crate::activity;
use crate::log::{info, warn};
use std::path::PathBuf;

/// A tenant as the tuner weighs it: its bandwidth weight and whether its share is guaranteed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub weight: u64,
    pub guaranteed: bool,
}

/// Channels for tenant `mine` while the tenants of `others` are active, out of a `budget` of
/// channels one job would use alone; `None` = leave NCCL's choice.
///
/// Guaranteed tenants split the budget among themselves by `weight^exponent` and never yield to
/// best-effort ones (a guaranteed tenant next to best-effort tenants only keeps NCCL's choice).
/// A best-effort tenant gets `floor` channels while any guaranteed tenant is active, and splits
/// the budget with the other best-effort tenants by weight otherwise. Alone: NCCL's choice.
pub fn channels(
    mine: Share,
    others: &[Share],
    budget: u32,
    exponent: f64,
    floor: u32,
) -> Option<u32> {
    if mine.weight == 0 {
        return None;
    }
    let budget = budget.max(1);
    if !mine.guaranteed && others.iter().any(|o| o.guaranteed) {
        return Some(floor.clamp(1, budget));
    }
    let peers: Vec<u64> = others
        .iter()
        .filter(|o| o.guaranteed == mine.guaranteed)
        .map(|o| o.weight)
        .collect();
    if peers.is_empty() {
        return None;
    }
    let w = |x: u64| (x as f64).powf(exponent);
    let total: f64 = w(mine.weight) + peers.iter().map(|&o| w(o)).sum::<f64>();
    let share = w(mine.weight) / total;
    Some(((budget as f64 * share).round() as u32).clamp(1, budget))
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub tenant: String,
    pub weight: u64,
    /// `VGPU_GUARANTEED` (the agent sets it from the placement): `0` = best effort.
    pub guaranteed: bool,
    pub file: PathBuf,
    pub budget: u32,
    pub exponent: f64,
    /// Channels a best-effort tenant keeps while a guaranteed one is active.
    pub floor: u32,
    pub active_ns: u64,
}

impl Settings {
    /// The tenant's part of the environment ([`NcclEnv`]: `VGPU_TENANT`, `VGPU_NCCL_WEIGHT` and
    /// `VGPU_NCCL_ACTIVITY_FILE` all needed, `VGPU_GUARANTEED`), then the knobs
    /// `VGPU_NCCL_CHANNELS` (24), `VGPU_NCCL_SHARE_EXPONENT` (1.2),
    /// `VGPU_NCCL_BEST_EFFORT_CHANNELS` (1), `VGPU_NCCL_ACTIVE_MS` (200). A contract variable
    /// the tuner cannot read turns it off with a warning (NCCL's choices are kept).
    pub fn from_env() -> Option<Settings> {
        let nccl = match NcclEnv::from_lookup(|name| std::env::var(name).ok()) {
            Ok(nccl) => nccl?,
            Err(error) => {
                warn!(
                    crate::abi::NCCL_TUNING,
                    "tuner: {error}; NCCL's choices are kept"
                );
                return None;
            }
        };
        let num = |name: &str, default: f64, lo: f64, hi: f64| -> f64 {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|x| (lo..=hi).contains(x))
                .unwrap_or(default)
        };
        Some(Settings {
            tenant: nccl.tenant,
            weight: nccl.weight,
            guaranteed: nccl.guaranteed,
            file: nccl.activity_file,
            budget: num(var::NCCL_CHANNELS, 24.0, 1.0, 64.0) as u32,
            exponent: num(var::NCCL_SHARE_EXPONENT, 1.2, 0.5, 3.0),
            floor: num(var::NCCL_BEST_EFFORT_CHANNELS, 1.0, 1.0, 64.0) as u32,
            active_ns: (num(var::NCCL_ACTIVE_MS, 200.0, 1.0, 10_000.0) * 1e6) as u64,
        })
    }

    /// The tenant's class, as the log says it.
    fn class(&self) -> &'static str {
        if self.guaranteed {
            "guaranteed"
        } else {
            "best effort"
        }
    }
}

/// FNV-1a of the tenant name: the key under which a tenant's processes are grouped.
pub fn tenant_key(name: &str) -> u64 {
    netshare::FlowId::of_tenant(name).0
}

pub struct Tuner {
    settings: Option<Settings>,
    key: u64,
    table: Option<activity::Table>,
    /// The communicator's decision log; without one (no communicator id, or no free log) the
    /// tuner keeps NCCL's choices, as every rank then does.
    log: Option<activity::CommLog>,
    /// Collectives asked about so far (the next one's number in the log).
    seq: u64,
    n_ranks: usize,
    last: Option<u32>,
    comm: u64,
}

impl Drop for Tuner {
    fn drop(&mut self) {
        if let (Some(t), Some(l)) = (&self.table, &self.log) {
            t.leave_comm(l);
        }
    }
}

impl Tuner {
    pub fn new(comm: u64, n_ranks: usize, n_nodes: usize) -> Tuner {
        let settings = Settings::from_env();
        let (key, table) = match &settings {
            None => {
                info!(
                    crate::abi::NCCL_TUNING,
                    "tuner: no bandwidth weight configured (VGPU_NCCL_WEIGHT, VGPU_NCCL_ACTIVITY_FILE); NCCL's choices are kept"
                );
                (0, None)
            }
            Some(s) => {
                let key = tenant_key(&s.tenant);
                match activity::Table::open(&s.file, key, s.weight, s.guaranteed) {
                    Ok(t) => {
                        info!(
                            crate::abi::NCCL_TUNING,
                            "tuner: comm {comm:#x} ({n_ranks} ranks, {n_nodes} nodes): tenant {} weight {} ({}), {} channels shared by weight^{} while others are active, {} for best effort next to a guaranteed tenant",
                            s.tenant,
                            s.weight,
                            s.class(),
                            s.budget,
                            s.exponent,
                            s.floor
                        );
                        (key, Some(t))
                    }
                    Err(e) => {
                        warn!(
                            crate::abi::NCCL_TUNING,
                            "tuner: {e}; NCCL's choices are kept"
                        );
                        (key, None)
                    }
                }
            }
        };
        let log = match &table {
            Some(_) if comm == 0 => {
                info!(
                    crate::abi::NCCL_TUNING,
                    "tuner: this NCCL gives the tuner no communicator id (tuner API v4), so its ranks cannot agree on channel caps; NCCL's choices are kept"
                );
                None
            }
            Some(t) => match t.join_comm(comm, netshare::shm::monotonic_now_ns()) {
                Ok(l) => Some(l),
                Err(e) => {
                    warn!(crate::abi::NCCL_TUNING, "tuner: comm {comm:#x}: {e}");
                    None
                }
            },
            None => None,
        };
        Tuner {
            settings,
            key,
            table,
            log,
            seq: 0,
            n_ranks,
            last: None,
            comm,
        }
    }

    /// The channel cap for the next collective (0 = NCCL's own choice): the same on every rank
    /// of the communicator.
    pub fn decide(&mut self, now_ns: u64) -> Result<i32, activity::Error> {
        let (Some(t), Some(log)) = (&self.table, &self.log) else {
            return Ok(0);
        };
        t.touch(now_ns);
        let seq = self.seq;
        self.seq += 1;
        let all_here = t.comm_members(log) >= self.n_ranks as u64;
        let mut decided_here = false;
        let agreed = t.agree(log, seq, now_ns, || {
            decided_here = true;
            let c = if all_here { self.choose(now_ns) } else { None };
            c.map_or(0, |c| c.min(255) as u8)
        })?;
        let choice = (agreed > 0).then_some(agreed as u32);
        if choice != self.last {
            self.report(choice, !decided_here, all_here);
            self.last = choice;
        }
        Ok(choice.map_or(0, |c| c as i32))
    }

    /// This rank's own view: the channels for its tenant given who else is active now.
    fn choose(&self, now_ns: u64) -> Option<u32> {
        let (Some(s), Some(t)) = (&self.settings, &self.table) else {
            return None;
        };
        // one entry per other tenant: its largest weight, guaranteed if any process of it is
        let mut others: Vec<(u64, Share)> = Vec::new();
        for p in t.peers() {
            if p.tenant == self.key
                || p.last_ns == 0
                || now_ns.saturating_sub(p.last_ns) > s.active_ns
            {
                continue;
            }
            match others.iter_mut().find(|(k, _)| *k == p.tenant) {
                Some((_, o)) => {
                    o.weight = o.weight.max(p.weight);
                    o.guaranteed |= p.guaranteed;
                }
                None => others.push((
                    p.tenant,
                    Share {
                        weight: p.weight,
                        guaranteed: p.guaranteed,
                    },
                )),
            }
        }
        let shares: Vec<Share> = others.iter().map(|&(_, o)| o).collect();
        let mine = Share {
            weight: s.weight,
            guaranteed: s.guaranteed,
        };
        channels(mine, &shares, s.budget, s.exponent, s.floor)
    }

    /// Log a change of this communicator's channel count (once per change, per rank).
    fn report(&self, choice: Option<u32>, from_peer: bool, all_here: bool) {
        let Some(s) = &self.settings else { return };
        let by = if from_peer {
            "decided by another rank"
        } else {
            "decided here"
        };
        match choice {
            Some(c) => info!(
                crate::abi::NCCL_TUNING,
                "tuner: comm {:#x}: tenant {} (weight {}, {}) shares the links: {} of {} channels from collective {} ({by})",
                self.comm,
                s.tenant,
                s.weight,
                s.class(),
                c,
                s.budget,
                self.seq - 1
            ),
            None if !all_here => info!(
                crate::abi::NCCL_TUNING,
                "tuner: comm {:#x}: not all {} ranks are on this node (or attached yet): NCCL's channel count from collective {} ({by})",
                self.comm,
                self.n_ranks,
                self.seq - 1
            ),
            None => info!(
                crate::abi::NCCL_TUNING,
                "tuner: comm {:#x}: tenant {} alone (or guaranteed next to best effort only): NCCL's channel count from collective {} ({by})",
                self.comm,
                s.tenant,
                self.seq - 1
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn g(weight: u64) -> Share {
        Share {
            weight,
            guaranteed: true,
        }
    }

    const fn be(weight: u64) -> Share {
        Share {
            weight,
            guaranteed: false,
        }
    }

    #[test]
    fn alone_keeps_nccls_choice() {
        assert_eq!(channels(g(75), &[], 24, 1.2, 2), None);
        assert_eq!(channels(be(75), &[], 24, 1.2, 2), None);
    }

    #[test]
    fn seventy_five_twenty_five_with_the_fitted_exponent() {
        assert_eq!(channels(g(75), &[g(25)], 24, 1.2, 2), Some(19));
        assert_eq!(channels(g(25), &[g(75)], 24, 1.2, 2), Some(5));
        // exponent 1 is the plain proportional split
        assert_eq!(channels(g(75), &[g(25)], 24, 1.0, 2), Some(18));
        assert_eq!(channels(g(25), &[g(75)], 24, 1.0, 2), Some(6));
        // best-effort tenants among themselves split the same way
        assert_eq!(channels(be(75), &[be(25)], 24, 1.0, 2), Some(18));
    }

    #[test]
    fn a_guaranteed_tenant_never_yields_to_best_effort_ones() {
        assert_eq!(channels(g(25), &[be(75)], 24, 1.2, 2), None);
        assert_eq!(channels(be(75), &[g(25)], 24, 1.2, 2), Some(2));
        assert_eq!(channels(be(75), &[g(25)], 24, 1.2, 4), Some(4));
        // with guaranteed and best-effort neighbours, the guaranteed split ignores the latter
        assert_eq!(channels(g(75), &[g(25), be(50)], 24, 1.0, 2), Some(18));
        assert_eq!(channels(be(50), &[g(25), be(50)], 24, 1.0, 2), Some(2));
        // the floor never exceeds the budget nor drops below one channel
        assert_eq!(channels(be(1), &[g(1)], 3, 1.0, 8), Some(3));
        assert_eq!(channels(be(1), &[g(1)], 24, 1.0, 0), Some(1));
    }

    #[test]
    fn never_below_one_channel() {
        assert_eq!(channels(g(1), &[g(1_000_000)], 24, 1.2, 2), Some(1));
        assert_eq!(channels(g(50), &[g(50), g(50), g(50)], 2, 1.0, 2), Some(1));
    }

    #[test]
    fn tenant_keys_differ_and_are_never_zero() {
        assert_ne!(tenant_key("a"), tenant_key("b"));
        assert_ne!(tenant_key(""), 0);
    }
}
