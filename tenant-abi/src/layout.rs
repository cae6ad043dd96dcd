//! The file names of a tenant's private directory (its `VGPU_SHM_DIR`), where its processes and
//! the agent meet. The agent makes the directory and the links in it (`vgpu_agent::private`);
//! these names are what both sides agree on.
//!
//! | name | what |
//! | --- | --- |
//! | `<tenant>.mem` | the tenant's memory ledger ([`crate::ledger`]), created by its first process |
//! | `<gpu uuid>.compute` | the compute schedule of a GPU the tenant is on ([`crate::compute`]) |
//! | `<gpu uuid>.memory` | the memory board of a GPU the tenant is on ([`crate::board`]), the agent's |
//! | `nccl-activity` | the NCCL tuners' activity table (who runs collectives on the node, with what weight) |
//! | `netshare` | the tenant's token-bucket table (`netshare::table`) |

use std::path::{Path, PathBuf};

/// The NCCL tuners' activity table, in a tenant's directory (`VGPU_NCCL_ACTIVITY_FILE`).
pub const NCCL_ACTIVITY_FILE: &str = "nccl-activity";
/// The activity table's name before it was renamed; an agent still removes it.
pub const NCCL_ACTIVITY_FILE_OLD: &str = "nccl-share";
/// A tenant's token-bucket table, in its directory (`VGPU_NETSHARE_TABLE`).
pub const NETSHARE_FILE: &str = "netshare";
/// The lock file beside the token-bucket table.
pub const NETSHARE_LOCK_FILE: &str = "netshare.lock";

/// The memory ledger of `tenant` in `dir` (`<dir>/<tenant>.mem`).
pub fn ledger_path(dir: &Path, tenant: &str) -> PathBuf {
    assert!(
        !tenant.is_empty() && !tenant.contains('/'),
        "tenant names are checked before they become file names"
    );
    dir.join(format!("{tenant}.mem"))
}

/// The compute schedule of the GPU `uuid` in `dir` (`<dir>/<uuid>.compute`).
pub fn schedule_path(dir: &Path, uuid: &str) -> PathBuf {
    assert!(
        !uuid.is_empty() && !uuid.contains('/'),
        "GPU uuids never contain a path separator"
    );
    dir.join(format!("{uuid}.compute"))
}

/// The memory board of the GPU `uuid` in `dir` (`<dir>/<uuid>.memory`).
pub fn board_path(dir: &Path, uuid: &str) -> PathBuf {
    assert!(
        !uuid.is_empty() && !uuid.contains('/'),
        "GPU uuids never contain a path separator"
    );
    dir.join(format!("{uuid}.memory"))
}

/// The swap staging file of the GPU `uuid` in `dir` (`<dir>/<uuid>.staging`, `crate::slabs`).
pub fn staging_path(dir: &Path, uuid: &str) -> PathBuf {
    assert!(
        !uuid.is_empty() && !uuid.contains('/'),
        "GPU uuids never contain a path separator"
    );
    dir.join(format!("{uuid}.staging"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_inside_the_directory() {
        let dir = Path::new("/dev/shm/vgpu/tenants/a");
        assert_eq!(ledger_path(dir, "a"), dir.join("a.mem"));
        assert_eq!(schedule_path(dir, "GPU-1"), dir.join("GPU-1.compute"));
        assert_eq!(board_path(dir, "GPU-1"), dir.join("GPU-1.memory"));
        assert_ne!(NCCL_ACTIVITY_FILE, NCCL_ACTIVITY_FILE_OLD);
    }
}
