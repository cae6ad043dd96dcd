//! Maps the tenant's ledger file (`$VGPU_SHM_DIR/<tenant>.mem`, mode 0600) `MAP_SHARED`.
//!
//! Creation race: the creator opens with `O_EXCL`, sizes the file, initialises the header and
//! publishes the magic last. Everyone else waits (bounded) for the magic. Because every header
//! field is a constant and the slots start zeroed, initialisation is idempotent: if the creator
//! died before publishing, a waiter initialises the file itself after the wait instead of
//! failing forever.
#![allow(unsafe_code)]

use crate::config::Config;
use crate::ledger::{REGION_BYTES, Region};
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::time::{Duration, Instant};

/// How long a process waits for another to publish a new ledger file.
pub const INIT_WAIT: Duration = Duration::from_secs(1);

/// Opens (creating if needed) and maps the ledger of `config`'s tenant, then stores the limits.
pub fn open(config: &Config) -> Result<&'static Region, String> {
    let path = config.ledger_path();
    let shown = path.display();
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&config.shm_dir)
        .map_err(|e| format!("cannot create {}: {e}", config.shm_dir.display()))?;
    let (file, created) = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(file) => (file, true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| format!("cannot open the ledger {shown}: {e}"))?;
            (file, false)
        }
        Err(e) => return Err(format!("cannot create the ledger {shown}: {e}")),
    };
    ensure_size(&file, created).map_err(|e| format!("cannot size the ledger {shown}: {e}"))?;
    let region = map(&file).map_err(|e| format!("cannot map the ledger {shown}: {e}"))?;
    if created {
        region.initialise();
    } else {
        let deadline = Instant::now() + INIT_WAIT;
        while !region.is_initialised() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !region.is_initialised() {
            crate::log::error(format_args!(
                "the ledger {shown} was never initialised (its creator died?); initialising it"
            ));
            region.initialise();
        }
    }
    region.check_layout().map_err(|e| format!("{shown}: {e}"))?;
    region.set_limits(&config.limits_bytes);
    Ok(region)
}

/// Grows the file to the region size. The creator always sizes it; others size it too if the
/// creator has not yet (same size, so racing `ftruncate`s agree); a file larger than ours belongs
/// to another layout and is caught by the version check.
fn ensure_size(file: &File, created: bool) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if created || len < REGION_BYTES as u64 {
        file.set_len(REGION_BYTES as u64)?;
    }
    Ok(())
}

/// Maps the file for the life of the process (never unmapped: hooks may run until exit).
fn map(file: &File) -> std::io::Result<&'static Region> {
    // SAFETY: a fresh shared mapping of an open file of at least REGION_BYTES bytes; the kernel
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
    // SAFETY: the mapping is page-aligned, REGION_BYTES long, readable and writable, and lives
    // until exit. `Region` consists only of atomics, for which every bit pattern is valid, and
    // all access (from this and other processes) goes through atomic operations.
    Ok(unsafe { &*address.cast::<Region>() })
}
