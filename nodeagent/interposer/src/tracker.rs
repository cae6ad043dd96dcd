//! What this process has allocated through the hooks, so that a free credits back exactly what
//! the allocation charged. Process-local (the shared ledger holds only per-device sums).

use std::collections::HashMap;

/// An allocation, as the driver names it. Pointers, VMM handles and arrays are separate name
/// spaces, so they are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Key {
    /// A `CUdeviceptr` from `cuMemAlloc*` (also pitch, managed and stream-ordered allocations).
    Pointer(u64),
    /// A `CUmemGenericAllocationHandle` from `cuMemCreate`.
    Handle(u64),
    /// A `CUarray` from `cuArrayCreate` / `cuArray3DCreate`.
    Array(usize),
}

/// What one allocation charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub device: usize,
    /// Charged to the tenant's ledger, and to the GPU's memory board when `on_board`.
    pub bytes: u64,
    pub on_board: bool,
    /// Past the tenant's request (elastic memory).
    pub borrowed: bool,
}

/// The live allocations of this process.
#[derive(Debug, Default)]
pub struct Tracker {
    live: HashMap<Key, Charge>,
}

impl Tracker {
    /// Records an allocation; returns a stale entry under the same key, if any (an allocation we
    /// never saw freed, e.g. freed through an API we do not hook), which the caller credits.
    pub fn insert(&mut self, key: Key, charge: Charge) -> Option<Charge> {
        self.live.insert(key, charge)
    }

    /// Forgets an allocation that is being freed.
    pub fn remove(&mut self, key: Key) -> Option<Charge> {
        self.live.remove(&key)
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Drops everything (after `fork`: the child owns none of the parent's allocations).
    pub fn clear(&mut self) {
        self.live.clear();
    }
}

/// Element size in bytes of a `CUarray_format`; unknown (newer) formats count as 4 bytes, so
/// the estimate errs on the side of charging.
pub fn array_format_bytes(format: i32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => 4,
    }
}

/// Estimated bytes of a CUDA array: width × max(height,1) × max(depth,1) × element × channels.
/// The driver adds alignment and tiling that the API does not expose, so this is a lower-bound
/// estimate, documented as such.
pub fn array_bytes(width: usize, height: usize, depth: usize, format: i32, channels: u32) -> u64 {
    let dims = [width, height.max(1), depth.max(1)];
    dims.iter()
        .map(|&d| d as u64)
        .chain([array_format_bytes(format), u64::from(channels.max(1))])
        .try_fold(1u64, u64::checked_mul)
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_different_kinds_do_not_collide() {
        let mut tracker = Tracker::default();
        let charge = Charge {
            device: 0,
            bytes: 1,
            on_board: false,
            borrowed: false,
        };
        assert_eq!(tracker.insert(Key::Pointer(7), charge), None);
        assert_eq!(tracker.insert(Key::Handle(7), charge), None);
        assert_eq!(tracker.insert(Key::Array(7), charge), None);
        assert_eq!(tracker.len(), 3);
        assert_eq!(tracker.remove(Key::Pointer(7)), Some(charge));
        assert_eq!(tracker.remove(Key::Pointer(7)), None);
        tracker.clear();
        assert!(tracker.is_empty());
    }

    #[test]
    fn array_sizes_are_estimated() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4), 1024 * 16);
        assert_eq!(array_bytes(1024, 512, 2, 0x01, 1), 1024 * 512 * 2);
        assert_eq!(array_bytes(10, 10, 10, 0x10, 2), 1000 * 4);
        assert_eq!(array_bytes(usize::MAX, 2, 2, 0x20, 4), u64::MAX);
    }
}
