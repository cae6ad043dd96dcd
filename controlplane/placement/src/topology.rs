//! A node's GPU interconnect, derived once from its [`NodeSpec`]: NVLink adjacency, NUMA nodes and
//! shared NICs as bitmasks over GPU positions (the position in `NodeSpec::gpus`), and the search
//! for the best-connected set of free GPUs for a multi-GPU request.
//!
//! Sets are scored by NVLink pairs, then NVLink link count, then pairs on the same NUMA node, then
//! pairs sharing a nearest NIC. The search enumerates every candidate set while there are at most
//! [`SUBSETS_SCORED_MAX`] of them (8 GPUs: at most C(8,4) = 70) and otherwise grows a set greedily
//! from every seed GPU, so a 16- or 64-GPU node stays bounded.

use crate::types::{NodeSpec, NvlinkPolicy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// GPUs per node we can represent (bitmasks are u64).
pub(crate) const GPUS_PER_NODE_MAX: usize = 64;
/// Most candidate sets scored exhaustively before falling back to greedy growth.
pub(crate) const SUBSETS_SCORED_MAX: u64 = 256;
/// Most branch steps of one max-clique search; past it the best clique found so far is used.
const CLIQUE_STEPS_MAX: u32 = 100_000;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Topology {
    /// Bit j of `nvlink_mask[i]`: GPU positions i and j share at least one NVLink (either
    /// direction listed; never the GPU itself).
    pub nvlink_mask: Vec<u64>,
    /// `links[i * gpu_count + j]`: NVLinks between positions i and j (max of both directions).
    pub links: Vec<u32>,
    /// Bit j of `numa_mask[i]`: positions i and j are on the same known NUMA node.
    pub numa_mask: Vec<u64>,
    /// Bit j of `nic_mask[i]`: positions i and j share a nearest NIC.
    pub nic_mask: Vec<u64>,
    /// A hash of the fields above (FNV-1a), so searches can reuse one node's set choice for
    /// another node with the same topology (most of a pool is identical machines).
    pub fingerprint: u64,
}

/// How well a GPU set is connected; larger is better, compared field by field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct SetScore {
    pub pairs_nvlink: u32,
    pub links_total: u32,
    pub pairs_same_numa: u32,
    pub pairs_shared_nic: u32,
}

pub(crate) fn bit(position: usize) -> u64 {
    assert!(position < GPUS_PER_NODE_MAX);
    1u64 << position
}

/// Positions set in `mask`, ascending.
pub(crate) fn positions(mask: u64) -> impl Iterator<Item = usize> {
    // Walks set bits only (lowest first): this runs inside the per-set scoring loops.
    let mut rest = mask;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let position = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        Some(position)
    })
}

impl Topology {
    pub(crate) fn new(spec: &NodeSpec) -> Topology {
        let gpu_count = spec.gpus.len();
        assert!(
            gpu_count <= GPUS_PER_NODE_MAX,
            "node {} has {gpu_count} GPUs",
            spec.name
        );
        let position_of: BTreeMap<u32, usize> = spec
            .gpus
            .iter()
            .enumerate()
            .map(|(position, gpu)| (gpu.index, position))
            .collect();
        assert_eq!(
            position_of.len(),
            gpu_count,
            "node {}: GPU indexes must be unique",
            spec.name
        );

        let mut topology = Topology {
            nvlink_mask: vec![0; gpu_count],
            links: vec![0; gpu_count * gpu_count],
            numa_mask: vec![0; gpu_count],
            nic_mask: vec![0; gpu_count],
            fingerprint: 0,
        };
        for (position, gpu) in spec.gpus.iter().enumerate() {
            for (peer_index, &link_count) in &gpu.nvlink_peers {
                // Unknown peers and self-links are ignored: malformed agent input must not crash
                // every replica.
                let Some(&peer) = position_of.get(peer_index) else {
                    continue;
                };
                if peer == position || link_count == 0 {
                    continue;
                }
                for (a, b) in [(position, peer), (peer, position)] {
                    topology.nvlink_mask[a] |= bit(b);
                    let slot = &mut topology.links[a * gpu_count + b];
                    *slot = (*slot).max(link_count);
                }
            }
        }
        for (a, gpu_a) in spec.gpus.iter().enumerate() {
            for (b, gpu_b) in spec.gpus.iter().enumerate() {
                if a == b {
                    continue;
                }
                if gpu_a.numa_node >= 0 && gpu_a.numa_node == gpu_b.numa_node {
                    topology.numa_mask[a] |= bit(b);
                }
                if gpu_a
                    .nearest_nics
                    .iter()
                    .any(|nic| gpu_b.nearest_nics.contains(nic))
                {
                    topology.nic_mask[a] |= bit(b);
                }
            }
        }
        topology.fingerprint = topology.compute_fingerprint();
        assert_ne!(topology.fingerprint, 0);
        topology
    }

    fn compute_fingerprint(&self) -> u64 {
        let words = self
            .nvlink_mask
            .iter()
            .chain(&self.numa_mask)
            .chain(&self.nic_mask)
            .copied();
        let words = words.chain(self.links.iter().map(|&links| u64::from(links)));
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for word in words.chain(std::iter::once(self.gpu_count() as u64)) {
            for byte in word.to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        hash.max(1)
    }

    pub(crate) fn gpu_count(&self) -> usize {
        self.nvlink_mask.len()
    }

    /// True when every pair in `set` shares an NVLink.
    pub(crate) fn is_nvlink_clique(&self, set: u64) -> bool {
        positions(set).all(|position| (self.nvlink_mask[position] | bit(position)) & set == set)
    }

    pub(crate) fn score(&self, set: u64) -> SetScore {
        let gpu_count = self.gpu_count();
        let mut score = SetScore::default();
        for a in positions(set) {
            // Count each unordered pair once: only peers above `a`.
            let above = set & !((bit(a) << 1) - 1);
            score.pairs_nvlink += (self.nvlink_mask[a] & above).count_ones();
            score.pairs_same_numa += (self.numa_mask[a] & above).count_ones();
            score.pairs_shared_nic += (self.nic_mask[a] & above).count_ones();
            for b in positions(self.nvlink_mask[a] & above) {
                score.links_total += self.links[a * gpu_count + b];
            }
        }
        assert!(score.pairs_nvlink <= set.count_ones() * set.count_ones());
        score
    }

    /// The size of the largest NVLink clique within `candidates` (bounded search; see
    /// `CLIQUE_STEPS_MAX`).
    pub(crate) fn max_clique(&self, candidates: u64) -> u32 {
        let mut best = candidates.count_ones().min(1);
        let mut steps_left = CLIQUE_STEPS_MAX;
        self.expand_clique(0, candidates, &mut best, &mut steps_left);
        assert!(best <= candidates.count_ones());
        best
    }

    fn expand_clique(&self, size: u32, mut candidates: u64, best: &mut u32, steps_left: &mut u32) {
        if candidates == 0 {
            *best = (*best).max(size);
            return;
        }
        while candidates != 0 {
            if size + candidates.count_ones() <= *best || *steps_left == 0 {
                return;
            }
            *steps_left -= 1;
            let position = candidates.trailing_zeros() as usize;
            candidates &= !bit(position);
            self.expand_clique(
                size + 1,
                candidates & self.nvlink_mask[position],
                best,
                steps_left,
            );
        }
        *best = (*best).max(size);
    }

    /// The best set of `gpu_count` GPUs among `eligible` under `policy`, with its score; `None`
    /// when there are too few eligible GPUs or (Require) no NVLink clique of that size.
    pub(crate) fn choose(
        &self,
        eligible: u64,
        gpu_count: u32,
        policy: NvlinkPolicy,
    ) -> Option<(u64, SetScore)> {
        assert!(gpu_count >= 1);
        assert_eq!(
            eligible >> self.gpu_count().min(63) >> 1,
            0,
            "eligible GPUs outside the node"
        );
        let eligible_count = eligible.count_ones();
        if eligible_count < gpu_count {
            return None;
        }
        if policy == NvlinkPolicy::Ignore || gpu_count == 1 {
            // Lowest positions first: no topology preference (one GPU has no pairs to score).
            let set = positions(eligible)
                .take(gpu_count as usize)
                .fold(0, |set, position| set | bit(position));
            return Some((set, SetScore::default()));
        }
        let require = policy == NvlinkPolicy::Require;
        if eligible_count < 64
            && binomial(u64::from(eligible_count), u64::from(gpu_count)) <= SUBSETS_SCORED_MAX
        {
            self.choose_exhaustive(eligible, gpu_count, require)
        } else {
            self.choose_greedy(eligible, gpu_count, require)
        }
    }

    fn choose_exhaustive(
        &self,
        eligible: u64,
        gpu_count: u32,
        require: bool,
    ) -> Option<(u64, SetScore)> {
        let eligible_positions: Vec<usize> = positions(eligible).collect();
        let n = eligible_positions.len() as u32;
        assert!(n >= gpu_count && n <= 63);
        let mut best: Option<(u64, SetScore)> = None;
        // Gosper's hack: every n-bit combination with `gpu_count` bits set, ascending.
        let mut combination: u64 = (1u64 << gpu_count) - 1;
        let mut combinations_left = SUBSETS_SCORED_MAX;
        while combination < (1u64 << n) && combinations_left > 0 {
            combinations_left -= 1;
            let set = positions(combination).fold(0, |set, i| set | bit(eligible_positions[i]));
            if !require || self.is_nvlink_clique(set) {
                let score = self.score(set);
                if best.is_none_or(|(_, best_score)| score > best_score) {
                    best = Some((set, score));
                }
            }
            let lowest = combination & combination.wrapping_neg();
            let ripple = combination + lowest;
            combination = (((ripple ^ combination) >> 2) / lowest) | ripple;
        }
        best
    }

    fn choose_greedy(
        &self,
        eligible: u64,
        gpu_count: u32,
        require: bool,
    ) -> Option<(u64, SetScore)> {
        let mut best: Option<(u64, SetScore)> = None;
        for seed in positions(eligible) {
            let mut set = bit(seed);
            for _ in 1..gpu_count {
                let mut best_next: Option<(usize, (bool, u32, u32, u32))> = None;
                for candidate in positions(eligible & !set) {
                    let connected_all = self.nvlink_mask[candidate] & set == set;
                    if require && !connected_all {
                        continue;
                    }
                    let links: u32 = positions(set)
                        .map(|member| self.links[candidate * self.gpu_count() + member])
                        .sum();
                    let key = (
                        connected_all,
                        links,
                        (self.numa_mask[candidate] & set).count_ones(),
                        (self.nic_mask[candidate] & set).count_ones(),
                    );
                    if best_next.is_none_or(|(_, best_key)| key > best_key) {
                        best_next = Some((candidate, key));
                    }
                }
                let Some((next, _)) = best_next else { break };
                set |= bit(next);
            }
            if set.count_ones() != gpu_count || (require && !self.is_nvlink_clique(set)) {
                continue;
            }
            let score = self.score(set);
            if best.is_none_or(|(_, best_score)| score > best_score) {
                best = Some((set, score));
            }
        }
        best
    }
}

/// C(n, k), saturating (only compared against small limits).
fn binomial(n: u64, k: u64) -> u64 {
    assert!(k <= n);
    let k = k.min(n - k);
    let mut result: u64 = 1;
    for i in 0..k {
        result = result.saturating_mul(n - i) / (i + 1);
        if result > SUBSETS_SCORED_MAX * 1024 {
            return u64::MAX;
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Interconnect, node_spec};

    #[test]
    fn binomials() {
        assert_eq!(binomial(8, 4), 70);
        assert_eq!(binomial(8, 8), 1);
        assert_eq!(binomial(16, 8), 12_870);
        assert_eq!(binomial(64, 32), u64::MAX);
    }

    #[test]
    fn islands_of_four() {
        let topology = Topology::new(&node_spec("n", 8, 80 << 30, Interconnect::Islands4));
        assert_eq!(topology.max_clique(0xff), 4);
        assert_eq!(topology.max_clique(0b1110_0111), 3);
        let (set, score) = topology.choose(0xff, 4, NvlinkPolicy::Require).unwrap();
        assert!(set == 0x0f || set == 0xf0);
        assert_eq!(score.pairs_nvlink, 6);
        assert_eq!(topology.choose(0xff, 5, NvlinkPolicy::Require), None);
        let (set, _) = topology.choose(0xff, 5, NvlinkPolicy::Prefer).unwrap();
        assert_eq!(set.count_ones(), 5);
    }

    #[test]
    fn greedy_on_a_large_node() {
        let topology = Topology::new(&node_spec("n", 32, 80 << 30, Interconnect::Islands4));
        assert_eq!(topology.max_clique(u64::from(u32::MAX)), 4);
        let (set, score) = topology
            .choose(u64::from(u32::MAX) & !1, 4, NvlinkPolicy::Require)
            .unwrap();
        assert_eq!(set, 0xf0);
        assert_eq!(score.pairs_nvlink, 6);
        let full = Topology::new(&node_spec("n", 16, 80 << 30, Interconnect::All));
        assert_eq!(full.max_clique(0xffff), 16);
        assert_eq!(
            full.choose(0xffff, 8, NvlinkPolicy::Require)
                .unwrap()
                .0
                .count_ones(),
            8
        );
    }
}
