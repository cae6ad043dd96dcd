//! The node-local table through which the tuners of all tenants on a node see who is moving
//! data right now: one 32-byte slot per process (tenant key, weight and class, pid, last
//! activity), in a shared file. The second word holds the weight in its low 32 bits and bit 32
//! set for a best-effort tenant (clear: guaranteed). Each process writes only its own slot, one
//! atomic word at a time, so a process killed at any point leaves nothing locked; a dead
//! process's slot goes stale (its activity stamp stops advancing) and is reclaimed once its pid
//! is gone.
//!
//! After the process slots come the communicators' decision logs ([`COMMS`] of them): every
//! rank of a communicator must give NCCL the same channel count for the same collective, or the
//! ranks run different rings and the collective hangs. Ranks reach a collective at different
//! times and could read the activity slots differently, so the first rank to reach collective
//! `n` decides and publishes the decision in slot `n % RING` of the communicator's log, and the
//! others take it from there (one compare-and-swap per collective, no lock).
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

pub const SLOTS: usize = 64;
/// Version 2 added the class bit, version 3 the communicators' decision logs. An older table is
/// never read as this one: it is replaced once no live process is listed in it, and refused as
/// foreign while one is (a version-1 reader would take a best-effort tenant for a very heavy
/// one).
const MAGIC: u64 = 0x5647_5055_4143_5433; // "VGPUACT3"
const BEST_EFFORT: u64 = 1 << 32;
const HEADER_WORDS: usize = 8;
const SLOT_WORDS: usize = 4;
/// Communicators whose ranks on this node can agree on decisions at once.
pub const COMMS: usize = 32;
/// Decisions a communicator's log remembers: how far its slowest rank on this node may trail
/// the fastest one, in collectives. A rank runs ahead only as far as its GPU's launch queue
/// lets it (about a thousand kernels), since the GPUs of a communicator move in step.
pub const RING: usize = 4096;
/// A log: communicator id, processes attached, last decision time, then the decisions.
const COMM_HEAD: usize = 3;
const COMM_WORDS: usize = COMM_HEAD + RING;
const COMMS_START: usize = HEADER_WORDS + SLOTS * SLOT_WORDS;
pub const BYTES: usize = (COMMS_START + COMMS * COMM_WORDS) * 8;
/// A log nobody has decided in for this long is taken over when the logs are all in use (its
/// processes were killed before they could detach).
const COMM_STALE_NS: u64 = 600 * 1_000_000_000;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("activity table {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{0} is not a vgpu activity table of this version (wrong magic or size), or processes of an earlier vgpu version still use it; stop them, or remove the file, or point VGPU_NCCL_ACTIVITY_FILE elsewhere"
    )]
    Foreign(String),
    #[error("activity table {0} is full ({SLOTS} processes)")]
    Full(String),
    #[error(
        "activity table {0} has no free communicator log ({COMMS} in use); channel caps are off for this communicator"
    )]
    CommsFull(String),
    #[error(
        "this rank reached collective {seq} after the communicator's log had moved on to collective {newer} (more than {RING} collectives behind another rank on this node); its channel decision is lost"
    )]
    Behind { seq: u64, newer: u64 },
}

pub struct Table {
    words: *const AtomicU64,
    slot: usize,
    path: String,
}

// SAFETY: the mapping is shared memory accessed only through atomics; it lives as long as the
// Table (unmapped in Drop).
unsafe impl Send for Table {}
// SAFETY: as above: all access is atomic.
unsafe impl Sync for Table {}

/// The advisory lock that serialises [`Table::open`]s of one file. Released explicitly on
/// drop: the mapping keeps the open file description (and with it a `flock`) alive after the
/// descriptor closes.
struct OpenLock<'f>(&'f std::fs::File);

impl<'f> OpenLock<'f> {
    fn take(file: &'f std::fs::File) -> std::io::Result<OpenLock<'f>> {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor that `file` owns for the guard's lifetime.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OpenLock(file))
    }
}

impl Drop for OpenLock<'_> {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as in `take`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Whether the file at `path` is an activity table of an earlier version (its magic is
/// "VGPUACT" and an older digit) none of whose process slots holds a live process: the agent
/// keeps the node's table across restarts, so an upgrade finds the old one there.
fn unused_older_table(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    let word = |i: usize| -> Option<u64> {
        let b = bytes.get(i * 8..i * 8 + 8)?;
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    };
    let Some(magic) = word(0) else { return false };
    let older = magic >> 8 == MAGIC >> 8 && (magic & 0xff) < (MAGIC & 0xff);
    older
        && (0..SLOTS)
            .all(|s| word(HEADER_WORDS + s * SLOT_WORDS + 2).is_none_or(|pid| !pid_alive(pid)))
}

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
        use std::os::fd::AsRawFd;
        // Opening (sizing, upgrading, claiming a slot) is serialised by an advisory lock, taken
        // here and dropped when this function returns; using the table takes no lock.
        let _opening = OpenLock::take(&file).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len != 0 && len != BYTES as u64 && unused_older_table(path) {
            // a table of an earlier plugin version that no live process uses: start afresh
            file.set_len(0).map_err(io)?;
        }
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            file.set_len(BYTES as u64).map_err(io)?;
        } else if len != BYTES as u64 {
            return Err(Error::Foreign(name));
        }
        // a file of exactly BYTES bytes (checked above)
        let p = crate::sys::map_shared(file.as_raw_fd(), BYTES).map_err(io)?;
        let words = p.as_ptr() as *const AtomicU64;
        let mut t = Table {
            words,
            slot: usize::MAX,
            path: name.clone(),
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

    fn comm_word(&self, log: usize, i: usize) -> &AtomicU64 {
        assert!(log < COMMS && i < COMM_WORDS);
        self.word(COMMS_START + log * COMM_WORDS + i)
    }

    /// Attach this process to communicator `comm`'s decision log (its ranks on this node all
    /// find the same one), claiming a free log, or a stale one, if none has it yet.
    pub fn join_comm(&self, comm: u64, now_ns: u64) -> Result<CommLog, Error> {
        let id = comm.max(1); // 0 marks a free log
        let start = (id % COMMS as u64) as usize;
        let order = (0..COMMS).map(|i| (start + i) % COMMS);
        for log in order.clone() {
            let w = self.comm_word(log, 0);
            let mut cur = w.load(Ordering::Acquire);
            if cur == 0 {
                cur = match w.compare_exchange(0, id, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        self.comm_word(log, 2).store(now_ns, Ordering::Release);
                        id
                    }
                    Err(other) => other,
                };
            }
            if cur == id {
                self.comm_word(log, 1).fetch_add(1, Ordering::AcqRel);
                return Ok(CommLog { log, id });
            }
        }
        // all in use: take over one whose processes died without detaching
        for log in order {
            let last = self.comm_word(log, 2).load(Ordering::Acquire);
            let old = self.comm_word(log, 0).load(Ordering::Acquire);
            if now_ns.saturating_sub(last) > COMM_STALE_NS
                && self
                    .comm_word(log, 0)
                    .compare_exchange(old, id, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                for i in COMM_HEAD..COMM_WORDS {
                    self.comm_word(log, i).store(0, Ordering::Release);
                }
                self.comm_word(log, 2).store(now_ns, Ordering::Release);
                self.comm_word(log, 1).store(1, Ordering::Release);
                return Ok(CommLog { log, id });
            }
        }
        Err(Error::CommsFull(self.path.clone()))
    }

    /// Detach from a communicator's log; the last process to leave frees it.
    pub fn leave_comm(&self, c: &CommLog) {
        if self.comm_word(c.log, 0).load(Ordering::Acquire) != c.id {
            return; // taken over meanwhile
        }
        if self.comm_word(c.log, 1).fetch_sub(1, Ordering::AcqRel) == 1 {
            for i in COMM_HEAD..COMM_WORDS {
                self.comm_word(c.log, i).store(0, Ordering::Release);
            }
            let _ = self.comm_word(c.log, 0).compare_exchange(
                c.id,
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// Processes of this node attached to the communicator's log.
    pub fn comm_members(&self, c: &CommLog) -> u64 {
        self.comm_word(c.log, 1).load(Ordering::Acquire)
    }

    /// The decision (0..=255) for the communicator's collective `seq` (0, 1, 2, ... in the
    /// order NCCL asks): the one another rank on this node published, or `decide()`'s, published
    /// now for the others.
    pub fn agree(
        &self,
        c: &CommLog,
        seq: u64,
        now_ns: u64,
        decide: impl FnOnce() -> u8,
    ) -> Result<u8, Error> {
        let cell = self.comm_word(c.log, COMM_HEAD + (seq % RING as u64) as usize);
        // a cell holds (collective + 1) << 8 | decision; 0 = never written
        let tag = seq + 1;
        let mut cur = cell.load(Ordering::Acquire);
        let mut decide = Some(decide);
        let mut mine = 0u8;
        loop {
            let have = cur >> 8;
            if have == tag {
                return Ok((cur & 0xff) as u8);
            }
            if have > tag {
                return Err(Error::Behind {
                    seq,
                    newer: have - 1,
                });
            }
            if let Some(f) = decide.take() {
                mine = f();
            }
            let d = mine;
            match cell.compare_exchange(
                cur,
                (tag << 8) | d as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.comm_word(c.log, 2).store(now_ns, Ordering::Release);
                    return Ok(d);
                }
                Err(other) => cur = other,
            }
        }
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

/// A process's attachment to one communicator's decision log ([`Table::join_comm`]).
#[derive(Debug)]
pub struct CommLog {
    log: usize,
    id: u64,
}

impl Drop for Table {
    fn drop(&mut self) {
        if self.slot != usize::MAX {
            self.slot_word(self.slot, 3).store(0, Ordering::Release);
            self.slot_word(self.slot, 2).store(0, Ordering::Release);
        }
        // SAFETY: the mapping made in `open`, unmapped once; no reference into it outlives self.
        unsafe { crate::sys::unmap(self.words as *mut libc::c_void, BYTES) };
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
        // a table of an earlier version (version 2: 2112 bytes, no decision logs) is refused,
        // not misread, while a live process uses it, and replaced once none does
        let older = |pid: u64| {
            let mut v2 = vec![0u8; (HEADER_WORDS + SLOTS * SLOT_WORDS) * 8];
            v2[..8].copy_from_slice(&0x5647_5055_4143_5432u64.to_ne_bytes());
            let at = (HEADER_WORDS + 5 * SLOT_WORDS + 2) * 8;
            v2[at..at + 8].copy_from_slice(&pid.to_ne_bytes());
            std::fs::write(dir.join("v2"), v2).unwrap();
        };
        older(std::process::id() as u64);
        assert!(matches!(
            Table::open(&dir.join("v2"), 1, 1, true),
            Err(Error::Foreign(_))
        ));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as u64;
        child.wait().unwrap();
        older(dead);
        let upgraded = Table::open(&dir.join("v2"), 1, 1, true).unwrap();
        assert!(upgraded.peers().is_empty());
        assert_eq!(
            std::fs::metadata(dir.join("v2")).unwrap().len(),
            BYTES as u64
        );
        std::fs::write(dir.join("foreign"), b"x").unwrap();
        assert!(matches!(
            Table::open(&dir.join("foreign"), 1, 1, true),
            Err(Error::Foreign(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_communicators_ranks_share_one_decision_per_collective() {
        let dir = std::env::temp_dir().join(format!("vgpu-act-comm-{}", std::process::id()));
        let path = dir.join("table");
        let a = Table::open(&path, 1, 75, true).unwrap();
        let b = Table::open(&path, 1, 75, true).unwrap();
        let la = a.join_comm(42, 10).unwrap();
        let lb = b.join_comm(42, 10).unwrap();
        assert_eq!(a.comm_members(&la), 2);
        // the first to reach a collective decides; the other never runs its own decision
        assert_eq!(a.agree(&la, 0, 20, || 0).unwrap(), 0);
        assert_eq!(b.agree(&lb, 0, 21, || panic!("decided twice")).unwrap(), 0);
        assert_eq!(b.agree(&lb, 1, 22, || 19).unwrap(), 19);
        assert_eq!(a.agree(&la, 1, 23, || 24).unwrap(), 19);
        // a rank that trails by more than the log holds gets an error, not a guess
        assert_eq!(a.agree(&la, RING as u64 + 5, 24, || 7).unwrap(), 7);
        assert!(matches!(
            b.agree(&lb, 5, 25, || 7),
            Err(Error::Behind { seq: 5, .. })
        ));
        // another communicator gets another log; the last rank to leave frees it
        let other = a.join_comm(43, 30).unwrap();
        assert_eq!(a.agree(&other, 1, 31, || 3).unwrap(), 3);
        a.leave_comm(&la);
        assert_eq!(b.comm_members(&lb), 1);
        b.leave_comm(&lb);
        let again = b.join_comm(42, 40).unwrap();
        assert_eq!(b.comm_members(&again), 1);
        assert_eq!(b.agree(&again, 1, 41, || 4).unwrap(), 4, "a fresh log");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn logs_of_dead_communicators_are_taken_over_once_stale() {
        let dir = std::env::temp_dir().join(format!("vgpu-act-stale-{}", std::process::id()));
        let t = Table::open(&dir.join("table"), 1, 1, true).unwrap();
        let logs: Vec<CommLog> = (0..COMMS as u64)
            .map(|c| t.join_comm(100 + c, 1).unwrap())
            .collect();
        assert!(matches!(t.join_comm(999, 2), Err(Error::CommsFull(_))));
        // none of them decided for COMM_STALE_NS: one is reused, with an empty log
        let taken = t.join_comm(999, 2 + COMM_STALE_NS).unwrap();
        assert_eq!(t.comm_members(&taken), 1);
        assert_eq!(t.agree(&taken, 0, 3 + COMM_STALE_NS, || 6).unwrap(), 6);
        drop(logs);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
