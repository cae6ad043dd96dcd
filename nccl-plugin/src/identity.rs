//! Per-rank host identity for NCCL, through NCCL's env plugin (`ncclEnvPlugin_v1`, which NCCL
//! 2.28+ loads from `NCCL_ENV_PLUGIN` and asks for every variable it reads).
//!
//! NCCL refuses a communicator in which two ranks share a host identity and a GPU ("Duplicate
//! GPU detected"). Ranks on different slices of one GPU are exactly that, and every rank
//! started by one launcher inherits the same environment, so `NCCL_HOSTID` alone cannot tell
//! them apart. Here each process claims a *slot* on its physical GPU when NCCL first asks for
//! `NCCL_HOSTID`: the lowest `k` whose lock file it can `flock`. Slot 0 keeps the identity the
//! environment gives (so a job with one rank per GPU is unchanged: its ranks share a host and
//! reach each other over NVLink); slot `k > 0` gets `<identity>-slot<k>`, shared by the `k`-th
//! rank of every GPU on the host, so no two ranks of one identity share a GPU. The lock is held
//! until the process ends (a crash included: the kernel drops it), so the next job reuses the
//! slot.
//!
//! The lock files live in the tenant's private directory (`VGPU_SHM_DIR`, set by the agent),
//! else in `/dev/shm` under the user's id.

use std::ffi::{CStr, CString};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Ranks of one host identity on one GPU (more fail to claim a slot and keep the identity the
/// environment gives, which NCCL then refuses as a duplicate).
pub const SLOTS_MAX: usize = 64;

/// The `NCCL_HOSTID` this process gives NCCL, computed once: `None` when it keeps the
/// environment's (slot 0, or no GPU to claim a slot on).
pub fn host_id() -> Option<&'static CStr> {
    static ID: OnceLock<Option<CString>> = OnceLock::new();
    ID.get_or_init(|| {
        let uuid = match crate::cuda::driver().and_then(|d| d.current_gpu_uuid()) {
            Ok(u) => u,
            Err(e) => {
                note(&format!(
                    "no current GPU ({e}); NCCL_HOSTID stays as the environment sets it"
                ));
                return None;
            }
        };
        let base = std::env::var("NCCL_HOSTID").unwrap_or_else(|_| default_base());
        match claim(&slot_dir(), &uuid) {
            Ok(slot) => {
                let id = identity(&base, slot);
                if let Some(id) = &id {
                    note(&format!("rank slot {slot} on its GPU: NCCL_HOSTID={id}"));
                }
                id.and_then(|s| CString::new(s).ok())
            }
            Err(e) => {
                note(&format!(
                    "no rank slot on this GPU ({e}); NCCL_HOSTID stays as the environment sets it"
                ));
                None
            }
        }
    })
    .as_deref()
}

/// The identity of slot `slot` given the environment's `base`: `None` for slot 0 (unchanged).
pub fn identity(base: &str, slot: usize) -> Option<String> {
    (slot > 0).then(|| format!("{base}-slot{slot}"))
}

/// NCCL's own default when `NCCL_HOSTID` is unset is the host name and the boot id; any string
/// that every process of the host computes alike serves for the slots above 0.
fn default_base() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}{}", name.trim(), boot.trim())
}

fn slot_dir() -> PathBuf {
    tenant_abi::env::private_dir(|name| std::env::var(name).ok())
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// Claims the lowest free slot of GPU `uuid` under `dir`; the lock is held for the rest of the
/// process (its descriptor is never closed, and does not survive an `exec`).
pub fn claim(dir: &Path, uuid: &[u8; 16]) -> std::io::Result<usize> {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    let uid = crate::sys::uid();
    for slot in 0..SLOTS_MAX {
        let path = dir.join(format!("vgpu-nccl-slot-{uid}-{hex}-{slot}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)?;
        if crate::sys::try_lock(&file)? {
            hold(file);
            return Ok(slot);
        }
    }
    Err(std::io::Error::other(format!(
        "all {SLOTS_MAX} slots of this GPU are taken"
    )))
}

/// Keeps a slot's lock for the life of the process.
fn hold(file: File) {
    static HELD: std::sync::Mutex<Vec<File>> = std::sync::Mutex::new(Vec::new());
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(file);
}

/// NCCL hands its logger only to the net and tuner plugins, which load after the host identity
/// is fixed: say it on stderr when `NCCL_DEBUG` asks for INFO (NCCL itself logs the identity
/// it was given as `NCCL_HOSTID set by environment to ...`).
fn note(what: &str) {
    if std::env::var("NCCL_DEBUG").is_ok_and(|v| v.eq_ignore_ascii_case("INFO")) {
        eprintln!("[vgpu env plugin] {what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_zero_keeps_the_identity_and_others_extend_it() {
        assert_eq!(identity("vgpu-node-a-t", 0), None);
        assert_eq!(
            identity("vgpu-node-a-t", 2).as_deref(),
            Some("vgpu-node-a-t-slot2")
        );
    }

    #[test]
    fn slots_are_claimed_lowest_first_and_released_by_the_holder() {
        let dir = std::env::temp_dir().join(format!("vgpu-slots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gpu = [7u8; 16];
        // another process holding slot 0 (a child: flock is per open file description)
        let path = |slot: usize| {
            let uid = crate::sys::uid();
            dir.join(format!("vgpu-nccl-slot-{uid}-{}-{slot}", "07".repeat(16)))
        };
        std::fs::write(path(0), b"").unwrap();
        // -o: the lock stays with flock(1) itself, not with the command it runs
        let mut holder = std::process::Command::new("flock")
            .arg("-o")
            .arg(path(0))
            .args(["sleep", "30"])
            .spawn()
            .expect("flock(1) from util-linux");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let f = File::open(path(0)).unwrap();
            if !crate::sys::try_lock(&f).unwrap() {
                break; // the child holds it
            }
            drop(f);
            assert!(std::time::Instant::now() < deadline, "flock never took it");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(claim(&dir, &gpu).unwrap(), 1, "slot 0 is held");
        assert_eq!(claim(&dir, &[8u8; 16]).unwrap(), 0, "another GPU's slots");
        holder.kill().unwrap();
        holder.wait().unwrap();
        // the holder is gone: its slot is free again (our own slot 1 stays held)
        assert_eq!(claim(&dir, &gpu).unwrap(), 0);
        assert_eq!(claim(&dir, &gpu).unwrap(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
