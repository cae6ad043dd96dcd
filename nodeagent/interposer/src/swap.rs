//! The swap of elastic memory (issue 17, `docs/design/elastic-memory.md`, "Reclaim"), the pure
//! part: which of this process's borrowed chunks go to host memory when other tenants want memory
//! back, and bringing them all back, at the same addresses, when the GPU has room again. The
//! driver work (copy to pinned staging, unmap and release; create, map and copy back) is behind
//! [`Backing`] (`vmm::SwapBacking` for the real driver, a byte-vector model in the tests), and
//! the board's counters behind [`Counters`].
//!
//! **The hold rule**: a process with any chunk out must launch nothing and copy nothing until
//! every chunk is back ([`Chunks::held`]), since a kernel may touch any allocation of its
//! process. [`hold`] holds a borrowing allocation (`hooks`) and is the hook that the launch and
//! copy paths are to call; it is not wired into them yet (the launch gate is another module's),
//! so the swap is off unless a test asks for it (`VGPU_MEMORY_SWAP=1`) and must stay off on a GPU
//! until it is.
//!
//! Only borrowed chunks that the interposer backs itself are here (`vmm::Purpose::Borrowed`):
//! the application's own `cuMemCreate` memory and memory within the request are never swapped.

use std::collections::BTreeMap;

/// How long [`hold`] waits for chunks to come back before it gives up and says so (a launch let
/// through then would touch an unmapped chunk and fault, so the wait is long).
pub const HOLD_WAIT_MAX_MS: u64 = 10_000;

/// A driver step of a swap failed: the chunk is left as it was (resident, or out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapError {
    pub address: u64,
    /// The driver's `CUresult`.
    pub result: i32,
}

impl std::fmt::Display for SwapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "swapping the chunk at {:#x} failed with CUresult {}",
            self.address, self.result
        )
    }
}

impl std::error::Error for SwapError {}

/// The driver side of moving one chunk out and back in.
pub trait Backing {
    /// Copies the chunk's `size` bytes at `address` to host staging, then unmaps and releases
    /// its physical memory; the address range stays reserved. On an error nothing changed.
    fn swap_out(&mut self, address: u64, size: u64) -> Result<(), SwapError>;
    /// Creates physical memory for the chunk, maps it at `address` again and copies the staging
    /// back (then frees the staging). On an error the chunk is still out.
    fn swap_in(&mut self, address: u64, size: u64) -> Result<(), SwapError>;
}

/// No driver (a call that may not swap): every step fails.
pub struct NoBacking;

impl Backing for NoBacking {
    fn swap_out(&mut self, address: u64, _: u64) -> Result<(), SwapError> {
        Err(SwapError {
            address,
            result: 801,
        })
    }

    fn swap_in(&mut self, address: u64, _: u64) -> Result<(), SwapError> {
        Err(SwapError {
            address,
            result: 801,
        })
    }
}

/// The board's counters of this process's slot.
pub trait Counters {
    /// `bytes` went to host memory: no longer resident, still held.
    fn swapped_out(&mut self, bytes: u64);
    /// Makes `bytes` resident again if the GPU has room (`Board::swap_in`); `false` if not.
    fn swap_in(&mut self, bytes: u64) -> bool;
    /// Undoes a `swap_in` whose driver work failed: the bytes are out again.
    fn swap_in_failed(&mut self, bytes: u64);
}

/// One borrowed chunk of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub size: u64,
    /// In host staging, unmapped.
    pub out: bool,
}

/// This process's swappable chunks, by address.
#[derive(Debug, Default)]
pub struct Chunks {
    chunks: BTreeMap<u64, Chunk>,
}

impl Chunks {
    /// A new borrowed chunk, resident.
    pub fn add(&mut self, address: u64, size: u64) {
        assert!(size > 0, "a chunk has bytes");
        let replaced = self.chunks.insert(address, Chunk { size, out: false });
        assert!(replaced.is_none(), "chunk {address:#x} added twice");
    }

    /// The chunk at `address` was freed; what it was (the caller credits it resident or out).
    pub fn remove(&mut self, address: u64) -> Option<Chunk> {
        self.chunks.remove(&address)
    }

    /// Whether a chunk is out: launches and copies must wait.
    pub fn held(&self) -> bool {
        self.chunks.values().any(|c| c.out)
    }

    /// Bytes out now.
    pub fn out_bytes(&self) -> u64 {
        self.chunks.values().filter(|c| c.out).map(|c| c.size).sum()
    }

    /// Whether a chunk is resident: something a want could be met with.
    pub fn any_resident(&self) -> bool {
        self.chunks.values().any(|c| !c.out)
    }

    /// Bytes resident now.
    #[cfg(test)]
    pub fn resident_bytes(&self) -> u64 {
        self.chunks
            .values()
            .filter(|c| !c.out)
            .map(|c| c.size)
            .sum()
    }

    /// Gives back at least `want` bytes if it has them: resident chunks go out largest first
    /// (fewest copies), until `want` is met. Returns the bytes that went out. A chunk the driver
    /// could not move stays and the next is tried.
    pub fn give_back(
        &mut self,
        want: u64,
        backing: &mut impl Backing,
        counters: &mut impl Counters,
    ) -> u64 {
        let mut order: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|(_, c)| !c.out)
            .map(|(&address, c)| (address, c.size))
            .collect();
        order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut given = 0u64;
        for (address, size) in order {
            if given >= want {
                break;
            }
            match backing.swap_out(address, size) {
                Ok(()) => {
                    self.chunks.get_mut(&address).expect("listed above").out = true;
                    counters.swapped_out(size);
                    given += size;
                }
                Err(e) => crate::log::error(format_args!("{e}; it stays resident")),
            }
        }
        assert!(given <= self.out_bytes());
        given
    }

    /// Brings every chunk back if the GPU has room for each (all or as many as fit, in address
    /// order); returns whether none is out any more.
    pub fn take_back(&mut self, backing: &mut impl Backing, counters: &mut impl Counters) -> bool {
        let out: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|(_, c)| c.out)
            .map(|(&address, c)| (address, c.size))
            .collect();
        for (address, size) in out {
            if !counters.swap_in(size) {
                break;
            }
            match backing.swap_in(address, size) {
                Ok(()) => self.chunks.get_mut(&address).expect("listed above").out = false,
                Err(e) => {
                    counters.swap_in_failed(size);
                    crate::log::error(format_args!("{e}; it stays in host memory"));
                    break;
                }
            }
        }
        !self.held()
    }
}

/// The hold: while this process has a chunk out, waits (bounded by [`HOLD_WAIT_MAX_MS`], in
/// steps of 1 ms) for `take_back` to bring everything back; `take_back` is tried at each step.
/// Returns whether nothing is out any more; after the bound it logs and says so. `hooks` holds a
/// borrowing allocation with it; the launch gate and the copy hooks are to call it before they
/// reach the driver (not wired yet: `launch` and `closed_loop` are another module's), and until
/// they do the swap is off outside tests.
pub fn hold(mut take_back: impl FnMut() -> bool) -> bool {
    for _ in 0..HOLD_WAIT_MAX_MS {
        if take_back() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let back = take_back();
    if !back {
        crate::log::error(format_args!(
            "borrowed memory of this process is still in host memory after {HOLD_WAIT_MAX_MS} \
             ms (the GPU has no room for it)"
        ));
    }
    back
}

#[cfg(test)]
#[path = "swap_test.rs"]
mod tests;
