//! The workload model behind [`Scorer::Fragmentation`](crate::Scorer): a deterministic
//! distribution of request shapes and the FGD fragmentation measure (Weng et al., USENIX ATC'23).
//!
//! The distribution is a fixed prior over typical shapes (0.1, 0.25 and 0.5 GPU with proportional
//! memory; 1, 2, 4 and 8 GPUs) blended with integer counts of the shapes submitted so far. Counts
//! are halved whenever their total passes [`OBSERVED_TOTAL_MAX`], so old submissions fade and the
//! state stays bounded. Everything is integer arithmetic: weights are counts, fragments are
//! compute percent, so every replica computes the same scores bit for bit.
//!
//! The fragment of a node for a shape is the free GPU compute that shape cannot use: for a
//! fraction, the free compute of each GPU the fraction does not fit on; for k whole GPUs, all free
//! compute when fewer than k GPUs are fully free, else the free compute of partly used GPUs.
//!
//! The search scores fractions by this model's delta. Whole-GPU sets are not scored by it: their
//! delta depends only on the node's count of fully free GPUs, and ordering those counts by it did
//! no better than best fit on the fragmentation bench, so whole-GPU requests use best fit plus
//! the one rule the model implies most strongly: do not open an empty node while a used node fits
//! (`search.rs`).

use serde::{Deserialize, Serialize};

/// Past this many observations all counts are halved (a cheap, deterministic decay).
pub(crate) const OBSERVED_TOTAL_MAX: u64 = 448;
/// Most distinct observed shapes kept; the rarest is dropped to admit a new one.
pub(crate) const SHAPES_OBSERVED_MAX: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum ShapeMemory {
    /// Thousandths of the chosen GPU's memory.
    Permille(u32),
    Bytes(u64),
}

impl ShapeMemory {
    pub(crate) fn bytes_on(self, gpu_memory_bytes: u64) -> u64 {
        match self {
            ShapeMemory::Permille(permille) => {
                assert!(permille <= 1000);
                // (a * p) / 1000 without 128-bit division (this runs for every GPU scored):
                // with a = 1000 q + r, it is exactly q p + (r p) / 1000.
                let (quotient, remainder) = (gpu_memory_bytes / 1000, gpu_memory_bytes % 1000);
                quotient * u64::from(permille) + remainder * u64::from(permille) / 1000
            }
            ShapeMemory::Bytes(bytes) => bytes,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum Shape {
    Fraction {
        compute_percent: u32,
        memory: ShapeMemory,
    },
    Whole {
        gpus: u32,
    },
}

/// The prior, as virtual observations (64 in all, so real submissions soon dominate).
const PRIOR: [(Shape, u64); 7] = [
    (
        Shape::Fraction {
            compute_percent: 10,
            memory: ShapeMemory::Permille(100),
        },
        8,
    ),
    (
        Shape::Fraction {
            compute_percent: 25,
            memory: ShapeMemory::Permille(250),
        },
        8,
    ),
    (
        Shape::Fraction {
            compute_percent: 50,
            memory: ShapeMemory::Permille(500),
        },
        8,
    ),
    (Shape::Whole { gpus: 1 }, 16),
    (Shape::Whole { gpus: 2 }, 8),
    (Shape::Whole { gpus: 4 }, 8),
    (Shape::Whole { gpus: 8 }, 8),
];

/// One GPU as the fragmentation measure sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GpuFree {
    pub compute_free_percent: u32,
    pub memory_free_bytes: u64,
    pub memory_total_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkloadModel {
    /// Observed counts, sorted by shape.
    observed: Vec<(Shape, u64)>,
    observed_total: u64,
    /// Prior plus observed, sorted by shape: what scoring reads (kept, not recomputed per use).
    weights: Vec<(Shape, u64)>,
}

impl Default for WorkloadModel {
    fn default() -> Self {
        let mut model = WorkloadModel {
            observed: Vec::new(),
            observed_total: 0,
            weights: Vec::new(),
        };
        model.rebuild_weights();
        model
    }
}

impl WorkloadModel {
    #[cfg(test)]
    pub(crate) fn weights(&self) -> &[(Shape, u64)] {
        &self.weights
    }

    /// Sum of all weights: the scale of a fragment that counts for every shape (stranded GPUs).
    pub(crate) fn weight_total(&self) -> u64 {
        self.weights.iter().map(|(_, weight)| weight).sum()
    }

    pub(crate) fn observe(&mut self, shape: Shape) {
        match self
            .observed
            .binary_search_by(|(known, _)| known.cmp(&shape))
        {
            Ok(at) => self.observed[at].1 += 1,
            Err(_) => {
                if self.observed.len() >= SHAPES_OBSERVED_MAX {
                    // Drop the rarest shape (the last such in shape order): bounded state.
                    let (rarest, _) = self
                        .observed
                        .iter()
                        .enumerate()
                        .min_by_key(|(at, (_, count))| (*count, std::cmp::Reverse(*at)))
                        .expect("observed is full, so not empty");
                    self.observed_total -= self.observed[rarest].1;
                    self.observed.remove(rarest);
                }
                let at = self
                    .observed
                    .binary_search_by(|(known, _)| known.cmp(&shape))
                    .unwrap_err();
                self.observed.insert(at, (shape, 1));
            }
        }
        self.observed_total += 1;
        if self.observed_total > OBSERVED_TOTAL_MAX {
            for (_, count) in &mut self.observed {
                *count /= 2;
            }
            self.observed.retain(|(_, count)| *count > 0);
            self.observed_total = self.observed.iter().map(|(_, count)| count).sum();
        }
        assert!(self.observed.len() <= SHAPES_OBSERVED_MAX);
        assert!(self.observed_total <= OBSERVED_TOTAL_MAX);
        self.rebuild_weights();
    }

    fn rebuild_weights(&mut self) {
        let mut weights: Vec<(Shape, u64)> = PRIOR.to_vec();
        weights.extend(self.observed.iter().copied());
        weights.sort();
        // Merge equal shapes (prior and observed).
        let mut merged: Vec<(Shape, u64)> = Vec::with_capacity(weights.len());
        for (shape, weight) in weights {
            match merged.last_mut() {
                Some((last, last_weight)) if *last == shape => *last_weight += weight,
                _ => merged.push((shape, weight)),
            }
        }
        assert!(merged.windows(2).all(|pair| pair[0].0 < pair[1].0));
        self.weights = merged;
    }

    #[cfg(test)]
    /// Change of expected fragmentation on a node when a fraction (`compute_percent`,
    /// `memory_bytes`) is taken from `gpu`. The node has `fully_free` untouched GPUs and
    /// `compute_free_sum` percent free in all; `gpu_fully_free` says whether `gpu` is one of them.
    pub(crate) fn fraction_delta(
        &self,
        node: (u32, u64),
        gpu: GpuFree,
        gpu_fully_free: bool,
        compute_percent: u32,
        memory_bytes: u64,
    ) -> i64 {
        assert!(!gpu_fully_free || node.0 >= 1);
        self.whole_part(node, gpu_fully_free, compute_percent)
            + self.fraction_part(gpu, compute_percent, memory_bytes)
    }

    /// The part of [`WorkloadModel::fraction_delta`] that comes from whole-GPU shapes. It depends
    /// only on the node and on whether the chosen GPU is fully free, so the search computes it
    /// once per node rather than once per GPU.
    pub(crate) fn whole_part(
        &self,
        node: (u32, u64),
        gpu_fully_free: bool,
        compute_percent: u32,
    ) -> i64 {
        let (fully_free, compute_free_sum) = node;
        assert!(!gpu_fully_free || fully_free >= 1);
        assert!(compute_free_sum >= u64::from(compute_percent));
        let fully_free_after = fully_free - u32::from(gpu_fully_free);
        let sum_after = compute_free_sum - u64::from(compute_percent);
        let mut delta: i64 = 0;
        for &(shape, weight) in &self.weights {
            if let Shape::Whole { gpus } = shape {
                let change = whole_fragment(gpus, fully_free_after, sum_after) as i64
                    - whole_fragment(gpus, fully_free, compute_free_sum) as i64;
                delta += weight as i64 * change;
            }
        }
        delta
    }

    /// The part of [`WorkloadModel::fraction_delta`] that comes from fractional shapes on `gpu`.
    pub(crate) fn fraction_part(
        &self,
        gpu: GpuFree,
        compute_percent: u32,
        memory_bytes: u64,
    ) -> i64 {
        assert!(
            gpu.compute_free_percent >= compute_percent && gpu.memory_free_bytes >= memory_bytes
        );
        let after = GpuFree {
            compute_free_percent: gpu.compute_free_percent - compute_percent,
            memory_free_bytes: gpu.memory_free_bytes - memory_bytes,
            memory_total_bytes: gpu.memory_total_bytes,
        };
        let mut delta: i64 = 0;
        for &(shape, weight) in &self.weights {
            if let Shape::Fraction { .. } = shape {
                let change =
                    fraction_fragment(shape, after) as i64 - fraction_fragment(shape, gpu) as i64;
                delta += weight as i64 * change;
            }
        }
        delta
    }
}

/// Free compute of `gpu` that the fractional `shape` cannot use.
fn fraction_fragment(shape: Shape, gpu: GpuFree) -> u64 {
    let Shape::Fraction {
        compute_percent,
        memory,
    } = shape
    else {
        unreachable!("fractions only")
    };
    let fits = gpu.compute_free_percent >= compute_percent
        && gpu.memory_free_bytes >= memory.bytes_on(gpu.memory_total_bytes);
    if fits {
        0
    } else {
        u64::from(gpu.compute_free_percent)
    }
}

/// Free compute of a node that a `gpus`-whole-GPU task cannot use.
fn whole_fragment(gpus: u32, fully_free: u32, compute_free_sum: u64) -> u64 {
    assert!(compute_free_sum >= 100 * u64::from(fully_free));
    if fully_free < gpus {
        compute_free_sum
    } else {
        compute_free_sum - 100 * u64::from(fully_free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(compute_free_percent: u32, memory_free_bytes: u64) -> GpuFree {
        GpuFree {
            compute_free_percent,
            memory_free_bytes,
            memory_total_bytes: 80 * GIB,
        }
    }

    #[test]
    fn fractions_prefer_partly_used_gpus() {
        let model = WorkloadModel::default();
        // Node: 8 GPUs, one of them half used.
        let node = (7, 750);
        let on_free = model.fraction_delta(node, gpu(100, 80 * GIB), true, 50, 40 * GIB);
        let on_used = model.fraction_delta(node, gpu(50, 40 * GIB), false, 50, 40 * GIB);
        assert!(on_used < on_free, "{on_used} vs {on_free}");
    }

    #[test]
    fn observation_is_bounded_and_decays() {
        let mut model = WorkloadModel::default();
        for i in 0..2_000u32 {
            model.observe(Shape::Fraction {
                compute_percent: 1 + i % 40,
                memory: ShapeMemory::Permille(i % 40),
            });
        }
        assert!(model.observed.len() <= SHAPES_OBSERVED_MAX);
        assert!(model.observed_total <= OBSERVED_TOTAL_MAX);
        let prior_total: u64 = PRIOR.iter().map(|(_, weight)| weight).sum();
        let weights_total: u64 = model.weights().iter().map(|(_, weight)| weight).sum();
        assert_eq!(weights_total, prior_total + model.observed_total);
    }
}
