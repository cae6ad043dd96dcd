//! The same-host path's completion ring (`VGPU_NCCL_FIN_RING=1`): one page of shared memory per
//! connection through which the sender's copy worker tells the receiver that a GPU copy is
//! complete, instead of a `Fin` message that NCCL's proxy thread on the sending side writes to
//! the socket at its next `test` call and the receiving side reads with a system call.
//!
//! The receiver creates the page (a memfd) and sends its descriptor to the sender with
//! `Msg::Ring` before any ready-to-receive, so every GPU copy of the connection completes through
//! the ring. One producer (the sender's copy worker), one consumer (the receiver's proxy
//! thread); entries are published in send order (one stream per connection completes in
//! order). The ring has more slots than NCCL keeps receives posted on a connection, and every
//! entry belongs to a posted receive, so it cannot fill up; if it ever did, the sender reports a
//! protocol error rather than wait.
//!
//! Two kinds of producer fill it. By default the GPU publishes (`VGPU_NCCL_GPU_FIN`): the copy
//! thread writes the entry when it issues the copy ([`FinRing::stage`]) and queues, right
//! behind the copy on its stream, a GPU write of the new head into this page (registered with
//! the driver by the sending process), so the receiver hears of the copy as soon as it is done,
//! without the copy thread polling an event. Otherwise the copy thread publishes
//! ([`FinRing::push`]) once it sees the copy's event complete.
//!
//! Everything here is atomics in a `MAP_SHARED` mapping; the only `unsafe` is the mapping.
#![allow(unsafe_code)]

use crate::Error;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Entries in the ring: twice NCCL's 32 requests in flight per connection.
pub const SLOTS: u64 = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"VGPUFIN1");

#[repr(C)]
struct Entry {
    seq: AtomicU64,
    size: AtomicU64,
}

/// The page's layout. `head` (entries published) and `tail` (entries consumed) sit on cache
/// lines of their own.
#[repr(C)]
struct Region {
    magic: AtomicU64,
    _pad0: [u64; 7],
    head: AtomicU64,
    _pad1: [u64; 7],
    tail: AtomicU64,
    _pad2: [u64; 7],
    entries: [Entry; SLOTS as usize],
}

const BYTES: usize = 4096;
const _: () = assert!(std::mem::size_of::<Region>() <= BYTES);

/// One side's mapping of a connection's ring.
pub struct FinRing {
    region: NonNull<Region>,
}

// SAFETY: the mapping is plain shared memory that lives until `drop`, and `Region` holds only
// atomics, so moving the handle to another thread (the copy worker) or sharing it is as safe as
// sharing a `&Region`.
unsafe impl Send for FinRing {}
// SAFETY: as above: every access goes through an atomic operation.
unsafe impl Sync for FinRing {}

impl FinRing {
    /// A new ring (receiver side) and the descriptor to send to the sender.
    pub fn create() -> Result<(FinRing, OwnedFd), Error> {
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"vgpu-nccl-fin".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), BYTES as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        let ring = FinRing::map_fd(&fd)?;
        ring.region().magic.store(MAGIC, Ordering::Release);
        Ok((ring, fd))
    }

    /// The sender's mapping of a ring the receiver created.
    pub fn open(fd: &OwnedFd) -> Result<FinRing, Error> {
        // SAFETY: fstat into a zeroed struct on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        if (st.st_size as usize) < BYTES {
            return Err(Error::Protocol("the completion ring is too small"));
        }
        let ring = FinRing::map_fd(fd)?;
        if ring.region().magic.load(Ordering::Acquire) != MAGIC {
            return Err(Error::Protocol(
                "the completion ring is not one (mismatched plugin versions?)",
            ));
        }
        Ok(ring)
    }

    fn map_fd(fd: &OwnedFd) -> Result<FinRing, Error> {
        // at least BYTES long: the creator truncated it to BYTES, `open` checked
        let region = crate::sys::map_shared(fd.as_raw_fd(), BYTES)?.cast::<Region>();
        Ok(FinRing { region })
    }

    fn region(&self) -> &Region {
        // SAFETY: the mapping is page-aligned, BYTES >= size_of::<Region>() long, readable and
        // writable, and lives until `drop` (which takes `&mut self`). `Region` is atomics only
        // (every bit pattern valid; a fresh memfd reads as zeros), and both processes access it
        // only through atomic operations.
        unsafe { self.region.as_ref() }
    }

    /// Producer: publish that the copy for `seq` (`size` bytes) is complete. `Err` if the ring
    /// is full (cannot happen while the receiver keeps at most `SLOTS` receives posted).
    pub fn push(&self, seq: u32, size: u64) -> Result<(), Error> {
        let head = self.region().head.load(Ordering::Relaxed);
        self.stage(head, seq, size)?;
        self.region()
            .head
            .store(head.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// Producer that lets the GPU publish: write entry `index` (the producer's count of
    /// entries so far) without publishing it. The copy's stream then writes `index + 1` to
    /// [`FinRing::HEAD_OFFSET`] once the copy is done ([`crate::cuda::Cuda::write_value`], whose
    /// fence orders it after this store and the copy). `Err` if the ring is full.
    pub fn stage(&self, index: u64, seq: u32, size: u64) -> Result<(), Error> {
        let r = self.region();
        if index.wrapping_sub(r.tail.load(Ordering::Acquire)) >= SLOTS {
            return Err(Error::Protocol("the completion ring is full"));
        }
        let e = &r.entries[(index % SLOTS) as usize];
        e.seq.store(u64::from(seq), Ordering::Relaxed);
        e.size.store(size, Ordering::Relaxed);
        // the entry is visible before anything this thread does next (the driver call that
        // queues the GPU's write of the head)
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(())
    }

    /// Entries published so far (by either kind of producer).
    pub fn published(&self) -> u64 {
        self.region().head.load(Ordering::Acquire)
    }

    /// Where the head counter sits in the page.
    pub const HEAD_OFFSET: usize = std::mem::offset_of!(Region, head);

    /// The page, for registering it with the driver (`BYTES` long, page-aligned).
    pub fn page(&self) -> (*mut u8, usize) {
        (self.region.as_ptr().cast(), BYTES)
    }

    /// Consumer: the oldest unconsumed completion, if any: `(seq, size)`.
    pub fn peek(&self) -> Option<(u32, u64)> {
        let r = self.region();
        let tail = r.tail.load(Ordering::Relaxed);
        if r.head.load(Ordering::Acquire) == tail {
            return None;
        }
        let e = &r.entries[(tail % SLOTS) as usize];
        Some((
            e.seq.load(Ordering::Relaxed) as u32,
            e.size.load(Ordering::Relaxed),
        ))
    }

    /// Consumer: drop the entry `peek` returned.
    pub fn pop(&self) {
        let r = self.region();
        let tail = r.tail.load(Ordering::Relaxed);
        debug_assert_ne!(r.head.load(Ordering::Acquire), tail, "pop of an empty ring");
        r.tail.store(tail.wrapping_add(1), Ordering::Release);
    }
}

impl Drop for FinRing {
    fn drop(&mut self) {
        // SAFETY: exactly the range `map_fd` mapped; no reference into it outlives self.
        unsafe { crate::sys::unmap(self.region.as_ptr().cast(), BYTES) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_cross_two_mappings_in_order_and_wrap_around() {
        let (receiver, fd) = FinRing::create().unwrap();
        let sender = FinRing::open(&fd).unwrap();
        assert_eq!(receiver.peek(), None);
        // several times around the ring, with a few entries outstanding at a time
        let mut next_consumed = 0u32;
        for seq in 0..(3 * SLOTS as u32) {
            sender.push(seq, u64::from(seq) * 4096 + 7).unwrap();
            if seq % 3 == 2 {
                while let Some((s, size)) = receiver.peek() {
                    assert_eq!((s, size), (next_consumed, u64::from(s) * 4096 + 7));
                    receiver.pop();
                    next_consumed += 1;
                }
            }
        }
        while receiver.peek().is_some() {
            receiver.pop();
            next_consumed += 1;
        }
        assert_eq!(next_consumed, 3 * SLOTS as u32);
    }

    #[test]
    fn staged_entries_appear_only_once_the_head_moves_past_them() {
        let (receiver, fd) = FinRing::create().unwrap();
        let sender = FinRing::open(&fd).unwrap();
        sender.stage(0, 7, 100).unwrap();
        sender.stage(1, 8, 200).unwrap();
        assert_eq!(receiver.peek(), None, "staged, not published");
        // what the GPU's write does: the head, as a plain 64-bit store at HEAD_OFFSET
        let head = |v: u64| {
            let (page, _) = sender.page();
            // SAFETY: HEAD_OFFSET is inside the mapped page and 8-byte aligned.
            let p = unsafe { page.add(FinRing::HEAD_OFFSET) }.cast::<AtomicU64>();
            // SAFETY: as above; the head is an AtomicU64.
            unsafe { &*p }.store(v, Ordering::Release);
        };
        head(1);
        assert_eq!(receiver.peek(), Some((7, 100)));
        receiver.pop();
        assert_eq!(receiver.peek(), None);
        head(2);
        assert_eq!(receiver.peek(), Some((8, 200)));
        assert_eq!(sender.published(), 2);
        // a full ring refuses to stage
        for i in 2..SLOTS + 1 {
            sender.stage(i, i as u32, 1).unwrap();
        }
        assert!(sender.stage(SLOTS + 1, 0, 1).is_err());
    }

    #[test]
    fn a_full_ring_is_an_error_not_a_wait() {
        let (receiver, fd) = FinRing::create().unwrap();
        let sender = FinRing::open(&fd).unwrap();
        for seq in 0..SLOTS as u32 {
            sender.push(seq, 1).unwrap();
        }
        assert!(matches!(sender.push(99, 1), Err(Error::Protocol(_))));
        receiver.pop();
        sender.push(99, 1).unwrap();
    }

    #[test]
    fn a_descriptor_that_is_not_a_ring_is_refused() {
        // SAFETY: memfd_create with a NUL-terminated name; checked.
        let fd = unsafe { libc::memfd_create(c"not-a-ring".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: just created, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        assert!(FinRing::open(&fd).is_err(), "empty file");
        // SAFETY: ftruncate on our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        assert!(FinRing::open(&fd).is_err(), "no magic");
    }
}
