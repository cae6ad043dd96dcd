//! The crate's only `unsafe` code: mapping the bucket table file `MAP_SHARED`, the advisory lock
//! that keeps a second agent out, and the CLOCK_MONOTONIC read that runtimes pass in as `now_ns`.
//! Everything here is a thin wrapper over one system call; the protocol lives in
//! `table` and [`crate::bucket`].
#![allow(unsafe_code)]

use crate::table::{REGION_BYTES, Region};
use std::fs::File;
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// A `MAP_SHARED` mapping of a whole bucket table file, unmapped on drop.
pub(crate) struct Mapping {
    region: NonNull<Region>,
}

// SAFETY: the mapping is plain memory that lives until `drop`, and `Region` is made of atomics
// only, so handing it to or sharing it with other threads is as safe as sharing a `&Region`.
unsafe impl Send for Mapping {}
// SAFETY: as above: every access through `&Region` is an atomic operation.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `file`, which must be at least [`REGION_BYTES`] long (checked).
    pub(crate) fn map(file: &File) -> std::io::Result<Mapping> {
        let length = file.metadata()?.len();
        if length < REGION_BYTES as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the file has {length} bytes, a table needs {REGION_BYTES}"),
            ));
        }
        // SAFETY: a fresh shared mapping of an open file at least REGION_BYTES long; the kernel
        // picks the address. Failure is reported as MAP_FAILED and checked below.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        assert_eq!(address as usize % std::mem::align_of::<Region>(), 0);
        let region = NonNull::new(address.cast::<Region>()).expect("mmap never returns NULL here");
        Ok(Mapping { region })
    }
}

impl Deref for Mapping {
    type Target = Region;

    fn deref(&self) -> &Region {
        // SAFETY: the mapping is page-aligned (so aligned for `Region`), REGION_BYTES long,
        // readable and writable, and lives until `drop`, which needs `&mut self`, so no borrow
        // outlives it. `Region` consists only of atomics, for which every bit pattern is valid,
        // and all access, from this and other processes, goes through atomic operations.
        unsafe { self.region.as_ref() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range `map` mapped; no reference into it outlives `self`.
        let result = unsafe { libc::munmap(self.region.as_ptr().cast(), REGION_BYTES) };
        assert_eq!(result, 0, "munmap of our own mapping failed");
    }
}

/// Takes an exclusive advisory lock on `file` without waiting; `false` when someone else holds
/// it. The kernel drops the lock when the holder's file is closed, including by `kill -9`.
pub(crate) fn try_lock_exclusive(file: &File) -> std::io::Result<bool> {
    // SAFETY: flock on a file descriptor we own; it touches no memory.
    let result = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if result == 0 {
        return Ok(true);
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(error)
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process of a node, which is what the
/// buckets' `now_ns` must be. Runtimes read it and pass it in; the cores never call it.
pub fn monotonic_now_ns() -> u64 {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer to a local.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut time) };
    assert_eq!(result, 0, "CLOCK_MONOTONIC is always available on Linux");
    let seconds = u64::try_from(time.tv_sec).expect("CLOCK_MONOTONIC is never negative");
    let nanos = u64::try_from(time.tv_nsec).expect("tv_nsec is in 0..1e9");
    seconds * 1_000_000_000 + nanos
}
