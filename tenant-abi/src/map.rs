//! Maps a shared file for the life of a value and unmaps it on drop. Read-only for the readers;
//! read-write for [`crate::create_schedule`] and [`crate::shm::write_board`] (the agent making a
//! GPU's schedule and memory board before handing them to tenants) and [`crate::writer`] (tests and tools that play a tenant process).
#![allow(unsafe_code)]

use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::ReadError;

/// A `#[repr(C)]` region made only of atomics, so any bytes are a valid value.
///
/// # Safety
/// Implement only for types whose every bit pattern is valid and whose fields are all atomics
/// (every access from any process is an atomic operation).
pub unsafe trait SharedRegion {}
// SAFETY: `ledger::Region` is `#[repr(C)]` and consists of `AtomicU32`/`AtomicU64` fields only.
unsafe impl SharedRegion for crate::ledger::Region {}
// SAFETY: `compute::Region` is `#[repr(C)]` and consists of `AtomicU32`/`AtomicU64` fields only.
unsafe impl SharedRegion for crate::compute::Region {}
// SAFETY: `board::Region` is `#[repr(C)]` and consists of `AtomicU32`/`AtomicI32`/`AtomicU64`
// fields only.
unsafe impl SharedRegion for crate::board::Region {}
// SAFETY: `slabs::SlabTable` is `#[repr(C)]` and consists of `AtomicU32`/`AtomicU64` fields
// (and one `u32` of padding, never read) only.
unsafe impl SharedRegion for crate::slabs::SlabTable {}

/// A mapping of a whole region file.
pub struct Mapping<T: SharedRegion> {
    address: *mut libc::c_void,
    bytes: usize,
    _region: PhantomData<T>,
}

// SAFETY: the mapping is owned by this value and only read through atomics (`SharedRegion`), so
// moving or sharing it between threads is as safe as sharing the atomics themselves.
unsafe impl<T: SharedRegion> Send for Mapping<T> {}
// SAFETY: as above: all access goes through atomic operations.
unsafe impl<T: SharedRegion> Sync for Mapping<T> {}

/// A read-only mapping.
pub type ReadOnly<T> = Mapping<T>;

impl<T: SharedRegion> Mapping<T> {
    /// Maps the existing file `path` read-only; it must be exactly `bytes` long (the layout's
    /// size). Never creates, sizes or writes the file.
    pub fn open(path: &Path, bytes: usize) -> Result<Mapping<T>, ReadError> {
        let file = File::open(path).map_err(|source| ReadError::Open {
            path: path.to_owned(),
            source,
        })?;
        Self::map(path, &file, bytes, libc::PROT_READ)
    }

    /// Maps `file` (already `bytes` long) read-write.
    pub fn writable(path: &Path, file: &File, bytes: usize) -> Result<Mapping<T>, ReadError> {
        Self::map(path, file, bytes, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Maps the header of `file` read-write: its first `size_of::<T>()` bytes, of a file at
    /// least `file_bytes` long (a swap staging file: `slabs::SlabTable` and the slabs after it).
    pub fn writable_header(
        path: &Path,
        file: &File,
        file_bytes: u64,
    ) -> Result<Mapping<T>, ReadError> {
        Self::map_checked(
            path,
            file,
            std::mem::size_of::<T>(),
            libc::PROT_READ | libc::PROT_WRITE,
            |found| found >= file_bytes,
            file_bytes,
        )
    }

    fn map(
        path: &Path,
        file: &File,
        bytes: usize,
        protection: libc::c_int,
    ) -> Result<Mapping<T>, ReadError> {
        Self::map_checked(
            path,
            file,
            bytes,
            protection,
            |found| found == bytes as u64,
            bytes as u64,
        )
    }

    fn map_checked(
        path: &Path,
        file: &File,
        bytes: usize,
        protection: libc::c_int,
        size_ok: impl Fn(u64) -> bool,
        expected: u64,
    ) -> Result<Mapping<T>, ReadError> {
        assert_eq!(std::mem::size_of::<T>(), bytes, "the layout's size");
        let found = file
            .metadata()
            .map_err(|source| ReadError::Open {
                path: path.to_owned(),
                source,
            })?
            .len();
        if !size_ok(found) {
            return Err(ReadError::Size {
                path: path.to_owned(),
                found,
                expected: expected as usize,
            });
        }
        // SAFETY: a fresh shared mapping of an open file that is `bytes` long; the kernel picks
        // the address. Failure is reported as MAP_FAILED and checked below.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                protection,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(ReadError::Map {
                path: path.to_owned(),
                source: std::io::Error::last_os_error(),
            });
        }
        assert_eq!(address as usize % std::mem::align_of::<T>(), 0);
        Ok(Mapping {
            address,
            bytes,
            _region: PhantomData,
        })
    }

    /// The mapped region. Loads from a read-only mapping are fine: atomics of at most 8 bytes
    /// load with plain moves; nothing here stores or compare-exchanges through it.
    pub fn region(&self) -> &T {
        // SAFETY: the mapping is page-aligned, `size_of::<T>()` bytes long and lives as long as
        // `self`. `T` consists only of atomics (`SharedRegion`), so every bit pattern is valid,
        // and all access (from here and from other processes) is atomic.
        unsafe { &*self.address.cast::<T>() }
    }
}

impl<T: SharedRegion> Drop for Mapping<T> {
    fn drop(&mut self) {
        // SAFETY: `address` and `bytes` are exactly what `mmap` returned and was asked for, and
        // no reference from `region` outlives `self`.
        let result = unsafe { libc::munmap(self.address, self.bytes) };
        debug_assert_eq!(result, 0, "munmap of our own mapping");
    }
}

/// Gives `file` its pages for its first `bytes` (`fallocate`): a shared-memory file's pages are
/// then resident for the file's life, so that processes registering it later fault nothing.
pub fn allocate(file: &File, bytes: u64) -> std::io::Result<()> {
    let len = libc::off_t::try_from(bytes)
        .map_err(|_| std::io::Error::other(format!("{bytes} bytes is too large a file")))?;
    // SAFETY: a plain system call on an open descriptor, with no pointer arguments.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
