//! The node-local table through which the tuners of all tenants on a node see who is moving
//! data right now: one 32-byte slot per process (tenant key, weight and class, pid, last
//! activity), in a shared file. The second word holds the weight in its low 32 bits and bit 32
//! set for a best-effort tenant (clear: guaranteed). Each process writes only its own slot, one
//! atomic word at a time, so a process killed at any point leaves nothing locked; a dead
//! process's slot goes stale (its activity stamp stops advancing) and is reclaimed once its pid
//! is gone.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

pub const SLOTS: usize = 64;
/// Version 2 added the class bit; a table of version 1 is refused as foreign (its users would
/// read a best-effort tenant as a very heavy one).
const MAGIC: u64 = 0x5647_5055_4143_5432; // "VGPUACT2"
const BEST_EFFORT: u64 = 1 << 32;
const HEADER_WORDS: usize = 8;
const SLOT_WORDS: usize = 4;
pub const BYTES: usize = (HEADER_WORDS + SLOTS * SLOT_WORDS) * 8;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("activity table {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{0} is not a vgpu activity table (wrong magic or size); remove it or point VGPU_NCCL_SHARE_FILE elsewhere"
    )]
    Foreign(String),
    #[error("activity table {0} is full ({SLOTS} processes)")]
    Full(String),
}

pub struct Table {
    words: *const AtomicU64,
    slot: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics; it lives as long as the
// Table (unmapped in Drop).
unsafe impl Send for Table {}
// SAFETY: as above: all access is atomic.
unsafe impl Sync for Table {}

/// One other process's slot as seen now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub tenant: u64,
    pub weight: u64,
    /// A guaranteed tenant (its placement's share is reserved); otherwise best effort.
    pub guaranteed: bool,
    pub last_ns: u64,
}

fn pid_alive(pid: u64) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    pid != 0
        && (unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

impl Table {
    /// Open (creating if needed) and claim a slot for this process. `weight` must fit 32 bits.
    pub fn open(path: &Path, tenant: u64, weight: u64, guaranteed: bool) -> Result<Table, Error> {
        let name = path.display().to_string();
        let io = |source| Error::Io {
            path: name.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            file.set_len(BYTES as u64).map_err(io)?;
        } else if len != BYTES as u64 {
            return Err(Error::Foreign(name));
        }
        use std::os::fd::AsRawFd;
        // SAFETY: mapping BYTES bytes of a file of exactly that size, shared, read-write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io(std::io::Error::last_os_error()));
        }
        let words = p as *const AtomicU64;
        let mut t = Table {
            words,
            slot: usize::MAX,
        };
        // a fresh file is all zeros: stamp the magic once; anything else must carry it
        match t
            .word(0)
            .compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {}
            Err(m) if m == MAGIC => {}
            Err(_) => return Err(Error::Foreign(name)),
        }
        let me = std::process::id() as u64;
        for s in 0..SLOTS {
            let pid = t.slot_word(s, 2);
            let cur = pid.load(Ordering::Acquire);
            let free = cur == 0 || (cur != me && !pid_alive(cur));
            if free
                && pid
                    .compare_exchange(cur, me, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                t.slot_word(s, 3).store(0, Ordering::Release);
                t.slot_word(s, 0).store(tenant, Ordering::Release);
                let class = if guaranteed { 0 } else { BEST_EFFORT };
                t.slot_word(s, 1)
                    .store((weight & 0xffff_ffff) | class, Ordering::Release);
                t.slot = s;
                return Ok(t);
            }
        }
        Err(Error::Full(name))
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < BYTES / 8);
        // SAFETY: `i` is within the mapping, which is 8-byte aligned (page aligned).
        unsafe { &*self.words.add(i) }
    }

    fn slot_word(&self, slot: usize, i: usize) -> &AtomicU64 {
        self.word(HEADER_WORDS + slot * SLOT_WORDS + i)
    }

    /// Mark this process active now.
    pub fn touch(&self, now_ns: u64) {
        self.slot_word(self.slot, 3)
            .store(now_ns, Ordering::Release);
    }

    /// Every other slot with a live process.
    pub fn peers(&self) -> Vec<Peer> {
        (0..SLOTS)
            .filter(|&s| s != self.slot && self.slot_word(s, 2).load(Ordering::Acquire) != 0)
            .map(|s| {
                let word = self.slot_word(s, 1).load(Ordering::Acquire);
                Peer {
                    tenant: self.slot_word(s, 0).load(Ordering::Acquire),
                    weight: word & 0xffff_ffff,
                    guaranteed: word & BEST_EFFORT == 0,
                    last_ns: self.slot_word(s, 3).load(Ordering::Acquire),
                }
            })
            .collect()
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if self.slot != usize::MAX {
            self.slot_word(self.slot, 3).store(0, Ordering::Release);
            self.slot_word(self.slot, 2).store(0, Ordering::Release);
        }
        // SAFETY: unmapping the mapping made in `open`, once.
        unsafe { libc::munmap(self.words as *mut libc::c_void, BYTES) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_see_each_other_and_release_their_slot() {
        let dir = std::env::temp_dir().join(format!("vgpu-act-{}", std::process::id()));
        let path = dir.join("table");
        let a = Table::open(&path, 1, 75, true).unwrap();
        let b = Table::open(&path, 2, 25, false).unwrap();
        a.touch(100);
        b.touch(200);
        assert_eq!(
            a.peers(),
            vec![Peer {
                tenant: 2,
                weight: 25,
                guaranteed: false,
                last_ns: 200
            }]
        );
        assert_eq!(
            b.peers(),
            vec![Peer {
                tenant: 1,
                weight: 75,
                guaranteed: true,
                last_ns: 100
            }]
        );
        drop(b);
        assert!(a.peers().is_empty());
        // a table of the first version (no class bit) is refused, not misread
        let mut v1 = vec![0u8; BYTES];
        v1[..8].copy_from_slice(&0x5647_5055_4143_5431u64.to_ne_bytes());
        std::fs::write(dir.join("v1"), v1).unwrap();
        assert!(matches!(
            Table::open(&dir.join("v1"), 1, 1, true),
            Err(Error::Foreign(_))
        ));
        std::fs::write(dir.join("foreign"), b"x").unwrap();
        assert!(matches!(
            Table::open(&dir.join("foreign"), 1, 1, true),
            Err(Error::Foreign(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
