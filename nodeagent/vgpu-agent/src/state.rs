//! The agent's state directory: the assignments it last received, persisted so that a restarted
//! agent knows what was running, and one file per tenant for the enforcement layer to read.
//!
//! ```text
//! STATE_DIR/
//!   assignments.json        {"format":1,"node":..,"revision":R,"node_state":"ready","assignments":[..]}
//!   inventory.json          the inventory last registered (for people and debugging)
//!   node-key                the node's identity: 64 hex digits, drawn once, mode 0600
//!   tenants/<tenant>.json   {"format":1,"node":..,"tenant":..,"revision":R,"priority":P,"slices":[..],
//!                            "latency":true,"latency_target_us":T}   (the last two for latency tenants)
//! ```
//!
//! Fields added later have a serde default, so files written before them still load (a tenant
//! without `latency_target_us` has none).
//!
//! A tenant file's `revision` is the assignment revision at which the tenant's share of this node
//! last changed. Every file is written atomically: to a temporary file in the same directory,
//! fsynced, renamed over the old one, then the directory is fsynced.
//! A damaged `assignments.json` (truncated by a full disk or a copy, or edited) is refused, never
//! half read: [`StateDir::quarantine_assignments`] moves it to `assignments.json.damaged` for
//! people to look at, and the follower waits for the control plane's set before it touches any
//! tenant's files ([`crate::follower`]). Tenant files are written
//! before `assignments.json`, so `assignments.json` is the commit point: after a crash in between,
//! the next reconcile (from the older `assignments.json`) rewrites the tenant files again, and any
//! tenant file that no current tenant owns is removed.
//!
//! The node key ([`NodeKey`], [`StateDir::node_key`]) is what the control plane binds the node's
//! name to when the node first registers: a second agent with the same `--name` but another
//! state directory (a cloned machine, or someone holding a bootstrap token) is refused. It is
//! drawn from the kernel's random source the first time and never changes; a damaged key file
//! stops the agent rather than make it a new identity silently ([`Error::NodeKeyDamaged`]).
//!
//! The default directory is `$VGPU_AGENT_STATE_DIR` (read by the command line), else
//! `/var/lib/vgpu-agent/NAME` when it can be created and written, else
//! `$HOME/.local/state/vgpu-agent/NAME` ([`default_state_dir`]).

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::assignments::{AssignmentSet, SliceAssignment, TenantAssignment};
use crate::error::{Error, Result};
use crate::inventory::Inventory;
use crate::reconcile::Change;

/// Version of the files' layout; bumped when a field changes meaning.
pub const STATE_FORMAT: u32 = 1;
/// Largest state file the agent reads back.
pub const STATE_FILE_BYTES_MAX: u64 = 64 << 20;

const ASSIGNMENTS_FILE: &str = "assignments.json";
const INVENTORY_FILE: &str = "inventory.json";
/// The shared-memory directory of the running agent (a path, for `exec` and `env`).
const SHM_DIR_FILE: &str = "shm-dir";
const NODE_KEY_FILE: &str = "node-key";
/// Random bytes in a node key; it is written as twice as many hex digits.
pub const NODE_KEY_BYTES: usize = 32;
const TENANTS_DIR: &str = "tenants";
const TEMPORARY_SUFFIX: &str = ".tmp";
/// Appended to the name of a damaged state file that was moved aside.
const DAMAGED_SUFFIX: &str = ".damaged";

/// `assignments.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignmentsFile {
    pub format: u32,
    pub node: String,
    pub revision: u64,
    pub node_state: String,
    pub assignments: Vec<TenantAssignment>,
}

/// `tenants/<tenant>.json`: one tenant's slices on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantFile {
    pub format: u32,
    pub node: String,
    pub tenant: String,
    /// The assignment revision at which this tenant's share of the node last changed.
    pub revision: u64,
    pub priority: i32,
    pub slices: Vec<SliceAssignment>,
    /// Latency-sensitive (`vgpuctl place --latency`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub latency: bool,
    /// The latency tenant's step-latency target in µs; absent: none given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_target_us: Option<u64>,
}

/// What [`StateDir::apply`] did besides applying the changes it was given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Tenants whose file was missing although their share did not change; rewritten.
    pub rewritten: Vec<String>,
    /// Files under `tenants/` that no current tenant owns; removed.
    pub removed_stale: Vec<String>,
}

/// The node's identity towards the control plane ([`crate::session::NODE_KEY_METADATA`]):
/// [`NODE_KEY_BYTES`] random bytes as lower-case hex. A secret: `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeKey(String);

impl NodeKey {
    /// The key written as `text`, if it is one.
    pub fn from_hex(text: &str) -> Option<NodeKey> {
        let well_formed = text.len() == 2 * NODE_KEY_BYTES
            && text
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte));
        well_formed.then(|| NodeKey(text.to_owned()))
    }

    /// A key that is a function of `seed`, for the simulated nodes of `simulate-fleet`: the same
    /// node gets the same key in every run, so a second run registers its nodes again. Not a
    /// secret; real agents use [`StateDir::node_key`].
    pub fn derived(seed: &str) -> NodeKey {
        // FNV-1a of the seed, then SplitMix64 for the digits.
        let hash = seed.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut random = crate::session::SplitMix64::new(hash);
        let text: String = (0..NODE_KEY_BYTES / 8)
            .map(|_| format!("{:016x}", random.next()))
            .collect();
        NodeKey::from_hex(&text).expect("hex digits")
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("NodeKey(..)")
    }
}

/// An opened state directory of one node.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
    node: String,
}

#[derive(Deserialize)]
struct FormatOnly {
    format: u32,
}

impl StateDir {
    /// Creates the directory (and `tenants/`) when missing and checks that it can be written.
    pub fn open(root: &Path, node: &str) -> Result<StateDir> {
        api::names::validate("node", node)?;
        let tenants = root.join(TENANTS_DIR);
        fs::create_dir_all(&tenants).map_err(|source| Error::StateDir {
            path: root.to_owned(),
            source,
        })?;
        probe_writable(root).map_err(|source| Error::StateDir {
            path: root.to_owned(),
            source,
        })?;
        Ok(StateDir {
            root: root.to_owned(),
            node: node.to_owned(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn assignments_path(&self) -> PathBuf {
        self.root.join(ASSIGNMENTS_FILE)
    }

    pub fn tenant_path(&self, tenant: &str) -> PathBuf {
        // Tenant names are DNS labels (checked when the set was built), so they are safe file names.
        assert!(
            api::names::validate("tenant", tenant).is_ok(),
            "tenant names are checked before use"
        );
        self.root.join(TENANTS_DIR).join(format!("{tenant}.json"))
    }

    /// The assignments last persisted; an empty set at revision 0 when there are none yet.
    pub fn load(&self) -> Result<AssignmentSet> {
        let path = self.assignments_path();
        let Some(text) = read_bounded(&path)? else {
            return Ok(AssignmentSet::default());
        };
        let corrupt = |error: serde_json::Error| Error::StateCorrupt {
            path: path.clone(),
            message: error.to_string(),
        };
        let format: FormatOnly = serde_json::from_str(&text).map_err(corrupt)?;
        if format.format != STATE_FORMAT {
            return Err(Error::StateFormat {
                path,
                found: format.format,
                expected: STATE_FORMAT,
            });
        }
        let file: AssignmentsFile = serde_json::from_str(&text).map_err(corrupt)?;
        if file.node != self.node {
            return Err(Error::StateOtherNode {
                path,
                found: file.node,
                expected: self.node.clone(),
            });
        }
        if file.assignments.len() > crate::assignments::TENANTS_PER_NODE_MAX {
            return Err(Error::StateCorrupt {
                path,
                message: format!("it lists {} tenants", file.assignments.len()),
            });
        }
        let mut set = AssignmentSet {
            revision: file.revision,
            node_state: file.node_state,
            ..Default::default()
        };
        for mut assignment in file.assignments {
            // What the control plane could not have sent is damage, not a reason to crash.
            let usable = api::names::validate("tenant", &assignment.tenant).is_ok()
                && !assignment.slices.is_empty()
                && (assignment.latency || assignment.latency_target_us.is_none())
                && !set.tenants.contains_key(&assignment.tenant);
            if !usable {
                return Err(Error::StateCorrupt {
                    path,
                    message: format!("the tenant entry `{}` is unusable", assignment.tenant),
                });
            }
            assignment.slices.sort();
            set.tenants.insert(assignment.tenant.clone(), assignment);
        }
        set.assert_consistent();
        Ok(set)
    }

    /// Moves a damaged `assignments.json` aside to `assignments.json.damaged` (replacing an
    /// older one there), so that nothing reads it again; returns where it went.
    pub fn quarantine_assignments(&self) -> Result<PathBuf> {
        let path = self.assignments_path();
        let aside = self
            .root
            .join(format!("{ASSIGNMENTS_FILE}{DAMAGED_SUFFIX}"));
        fs::rename(&path, &aside).map_err(|source| Error::StateIo {
            action: "move the damaged state file aside",
            path: path.clone(),
            source,
        })?;
        sync_directory(&self.root)?;
        assert!(!path.exists(), "the damaged file is gone from its place");
        Ok(aside)
    }

    /// Removes tenant files that do not read back as their tenant's, so that `exec` and `env`
    /// find none rather than a damaged one until the next applied set writes them again (a
    /// missing file is rewritten, [`ApplyReport::rewritten`]); returns the tenants.
    pub fn remove_damaged_tenant_files(&self) -> Result<Vec<String>> {
        let directory = self.root.join(TENANTS_DIR);
        let entries = fs::read_dir(&directory).map_err(|source| Error::StateIo {
            action: "list",
            path: directory.clone(),
            source,
        })?;
        let mut removed = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| Error::StateIo {
                action: "list",
                path: directory.clone(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(tenant) = name.strip_suffix(".json") else {
                continue;
            };
            if name.starts_with('.') || api::names::validate("tenant", tenant).is_err() {
                continue;
            }
            if matches!(
                read_tenant_file(&self.root, tenant),
                Err(Error::StateCorrupt { .. })
            ) {
                remove_if_present(&entry.path())?;
                removed.push(tenant.to_owned());
            }
        }
        Ok(removed)
    }

    /// One tenant's file, if there is one.
    pub fn load_tenant(&self, tenant: &str) -> Result<Option<TenantFile>> {
        let path = self.tenant_path(tenant);
        let Some(text) = read_bounded(&path)? else {
            return Ok(None);
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|error| Error::StateCorrupt {
                path,
                message: error.to_string(),
            })
    }

    /// Applies `changes` (computed from the persisted set to `new`) to the tenant files, makes
    /// sure every tenant of `new` has its file and no other tenant does, then persists `new`.
    pub fn apply(&self, new: &AssignmentSet, changes: &[Change]) -> Result<ApplyReport> {
        new.assert_consistent();
        let mut report = ApplyReport::default();
        for change in changes {
            match change {
                Change::Started(assignment)
                | Change::Changed {
                    after: assignment, ..
                } => {
                    assert!(
                        new.tenants.get(&assignment.tenant) == Some(assignment),
                        "changes lead to the new set"
                    );
                    self.write_tenant(new.revision, assignment)?;
                }
                Change::Stopped(assignment) => {
                    assert!(
                        !new.tenants.contains_key(&assignment.tenant),
                        "stopped tenants are gone"
                    );
                    remove_if_present(&self.tenant_path(&assignment.tenant))?;
                }
            }
        }
        for assignment in new.tenants.values() {
            if !self.tenant_path(&assignment.tenant).exists() {
                self.write_tenant(new.revision, assignment)?;
                report.rewritten.push(assignment.tenant.clone());
            }
        }
        report.removed_stale = self.remove_stale_tenant_files(new)?;
        let file = AssignmentsFile {
            format: STATE_FORMAT,
            node: self.node.clone(),
            revision: new.revision,
            node_state: new.node_state.clone(),
            assignments: new.tenants.values().cloned().collect(),
        };
        write_json(&self.assignments_path(), &file)?;
        Ok(report)
    }

    /// The node key: the one in `node-key`, or a new one drawn from the kernel's random source
    /// and written there (mode 0600) when there is none. A file that holds no key is an error:
    /// replacing it would make the node a new identity, which the control plane refuses.
    pub fn node_key(&self) -> Result<NodeKey> {
        let path = self.root.join(NODE_KEY_FILE);
        if let Some(text) = read_bounded(&path)? {
            return NodeKey::from_hex(text.trim_end()).ok_or(Error::NodeKeyDamaged { path });
        }
        let mut bytes = [0_u8; NODE_KEY_BYTES];
        fs::File::open("/dev/urandom")
            .and_then(|mut random| random.read_exact(&mut bytes))
            .map_err(|source| Error::StateIo {
                action: "read random bytes for the node key from",
                path: "/dev/urandom".into(),
                source,
            })?;
        assert!(bytes.iter().any(|byte| *byte != 0), "random bytes");
        let text: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
        let key = NodeKey::from_hex(&text).expect("hex digits");
        write_atomically_with_mode(&path, format!("{text}\n").as_bytes(), 0o600)?;
        Ok(key)
    }

    /// Records the shared-memory directory the agent uses, for `exec` and `env`.
    pub fn write_shm_dir(&self, shm_dir: &Path) -> Result<()> {
        write_atomically(
            &self.root.join(SHM_DIR_FILE),
            shm_dir.to_string_lossy().as_bytes(),
        )
    }

    /// Records the inventory that was registered.
    pub fn write_inventory(&self, inventory: &Inventory) -> Result<()> {
        assert_eq!(inventory.node, self.node);
        write_json(&self.root.join(INVENTORY_FILE), inventory)
    }

    fn write_tenant(&self, revision: u64, assignment: &TenantAssignment) -> Result<()> {
        let file = TenantFile {
            format: STATE_FORMAT,
            node: self.node.clone(),
            tenant: assignment.tenant.clone(),
            revision,
            priority: assignment.priority,
            slices: assignment.slices.clone(),
            latency: assignment.latency,
            latency_target_us: assignment.latency_target_us,
        };
        assert!(
            file.latency_target_us.is_none() || file.latency,
            "only a latency tenant has a latency target"
        );
        write_json(&self.tenant_path(&assignment.tenant), &file)
    }

    fn remove_stale_tenant_files(&self, new: &AssignmentSet) -> Result<Vec<String>> {
        let directory = self.root.join(TENANTS_DIR);
        let entries = fs::read_dir(&directory).map_err(|source| Error::StateIo {
            action: "list",
            path: directory.clone(),
            source,
        })?;
        let wanted: BTreeSet<String> = new
            .tenants
            .keys()
            .map(|tenant| format!("{tenant}.json"))
            .collect();
        let mut removed = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| Error::StateIo {
                action: "list",
                path: directory.clone(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let leftover_temporary = name.starts_with('.') && name.ends_with(TEMPORARY_SUFFIX);
            let stale_tenant = name.ends_with(".json") && !wanted.contains(&name);
            if leftover_temporary || stale_tenant {
                remove_if_present(&entry.path())?;
                if stale_tenant {
                    removed.push(name.trim_end_matches(".json").to_owned());
                }
            }
        }
        Ok(removed)
    }
}

/// The assignments file of the state directory at `root`, read without opening the directory for
/// writing (for `exec` and `env`, which may run as another user than the agent). `None` when
/// there is none.
pub fn read_assignments_file(root: &Path) -> Result<Option<AssignmentsFile>> {
    let path = root.join(ASSIGNMENTS_FILE);
    let Some(text) = read_bounded(&path)? else {
        return Ok(None);
    };
    let file: AssignmentsFile =
        serde_json::from_str(&text).map_err(|error| Error::StateCorrupt {
            path: path.clone(),
            message: error.to_string(),
        })?;
    if file.format != STATE_FORMAT {
        return Err(Error::StateFormat {
            path,
            found: file.format,
            expected: STATE_FORMAT,
        });
    }
    Ok(Some(file))
}

/// `tenants/<tenant>.json` of the state directory at `root`, read-only; `None` when there is none.
/// The shared-memory directory the agent of `root` recorded, if any.
pub fn read_shm_dir(root: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(root.join(SHM_DIR_FILE)).ok()?;
    let path = PathBuf::from(text.trim());
    path.is_absolute().then_some(path)
}

pub fn read_tenant_file(root: &Path, tenant: &str) -> Result<Option<TenantFile>> {
    api::names::validate("tenant", tenant)?;
    let path = root.join(TENANTS_DIR).join(format!("{tenant}.json"));
    let Some(text) = read_bounded(&path)? else {
        return Ok(None);
    };
    let file: TenantFile = serde_json::from_str(&text).map_err(|error| Error::StateCorrupt {
        path: path.clone(),
        message: error.to_string(),
    })?;
    if file.tenant != tenant || file.slices.is_empty() {
        return Err(Error::StateCorrupt {
            path,
            message: format!("it does not describe tenant {tenant} with slices"),
        });
    }
    Ok(Some(file))
}

/// Where `join` keeps node `node`'s state by default, found without creating anything: the
/// system directory when it exists, else the per-user one ([`default_state_dir`] creates).
pub fn find_state_dir(node: &str) -> PathBuf {
    let system = Path::new("/var/lib/vgpu-agent").join(node);
    if system.is_dir() {
        return system;
    }
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from);
    let base = home.map_or_else(std::env::temp_dir, |home| home.join(".local").join("state"));
    base.join("vgpu-agent").join(node)
}

/// `/var/lib/vgpu-agent/NODE` when it can be created and written (normally as root), else
/// `$HOME/.local/state/vgpu-agent/NODE` (or under the temporary directory without `$HOME`).
pub fn default_state_dir(node: &str) -> PathBuf {
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from);
    choose_state_dir(Path::new("/var/lib/vgpu-agent"), home.as_deref(), node)
}

fn choose_state_dir(system_base: &Path, home: Option<&Path>, node: &str) -> PathBuf {
    let system = system_base.join(node);
    if fs::create_dir_all(&system).is_ok() && probe_writable(&system).is_ok() {
        return system;
    }
    let base = home.map_or_else(std::env::temp_dir, |home| home.join(".local").join("state"));
    base.join("vgpu-agent").join(node)
}

pub(crate) fn probe_writable(directory: &Path) -> std::io::Result<()> {
    let probe = directory.join(format!(".probe-{}{TEMPORARY_SUFFIX}", std::process::id()));
    fs::write(&probe, b"")?;
    fs::remove_file(&probe)
}

fn read_bounded(path: &Path) -> Result<Option<String>> {
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::StateIo {
                action: "open",
                path: path.to_owned(),
                source,
            });
        }
    };
    let mut text = String::new();
    file.take(STATE_FILE_BYTES_MAX + 1)
        .read_to_string(&mut text)
        .map_err(|source| Error::StateIo {
            action: "read",
            path: path.to_owned(),
            source,
        })?;
    if text.len() as u64 > STATE_FILE_BYTES_MAX {
        return Err(Error::StateCorrupt {
            path: path.to_owned(),
            message: format!("larger than {STATE_FILE_BYTES_MAX} bytes"),
        });
    }
    Ok(Some(text))
}

/// Writes `value` as JSON to `path` atomically (see `write_atomically`), after checking that it
/// reads back as the same value.
pub fn write_json<T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
    path: &Path,
    value: &T,
) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("state types serialize");
    // What is written must read back as the same value.
    assert_eq!(
        &serde_json::from_slice::<T>(&bytes).expect("state files read back"),
        value
    );
    bytes.push(b'\n');
    write_atomically(path, &bytes)
}

/// Writes `bytes` to `path` so that a reader (or a crash) sees the old or the new content, never
/// a mix: a temporary file in the same directory, fsync, rename, fsync of the directory.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with_mode(path, bytes, 0o644)
}

/// [`write_atomically`], the file with permission bits `mode`.
fn write_atomically_with_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let directory = path.parent().expect("state files live in a directory");
    let name = path
        .file_name()
        .expect("state files have a name")
        .to_string_lossy();
    let temporary = directory.join(format!(".{name}{TEMPORARY_SUFFIX}"));
    let io_error = |action, path: &Path| {
        let path = path.to_owned();
        move |source| Error::StateIo {
            action,
            path,
            source,
        }
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temporary)
        .map_err(io_error("create", &temporary))?;
    // A temporary file left by a crash keeps its old mode on `open`.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_error("set the mode of", &temporary))?;
    file.write_all(bytes)
        .map_err(io_error("write", &temporary))?;
    file.sync_all().map_err(io_error("fsync", &temporary))?;
    drop(file);
    fs::rename(&temporary, path).map_err(io_error("rename into place", path))?;
    sync_directory(directory)
}

/// Makes a rename in `directory` durable.
fn sync_directory(directory: &Path) -> Result<()> {
    fs::File::open(directory)
        .and_then(|directory| directory.sync_all())
        .map_err(|source| Error::StateIo {
            action: "fsync",
            path: directory.to_owned(),
            source,
        })
}

/// Removes the file at `path`; a missing file is not an error.
pub fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(Error::StateIo {
            action: "remove",
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::reconcile;

    fn tenant(name: &str, gpu_index: u32) -> TenantAssignment {
        TenantAssignment {
            tenant: name.into(),
            priority: 3,
            bandwidth_weight: 0,
            latency: false,
            latency_target_us: None,
            slices: vec![SliceAssignment {
                gpu_index,
                gpu_uuid: format!("GPU-{gpu_index}"),
                compute_percent: 25,
                memory_bytes: 20 << 30,
                guaranteed: true,
                burst: true,
                memory_limit_bytes: 0,
            }],
        }
    }

    fn set(revision: u64, tenants: &[TenantAssignment]) -> AssignmentSet {
        AssignmentSet {
            revision,
            node_state: "ready".into(),
            tenants: tenants
                .iter()
                .map(|t| (t.tenant.clone(), t.clone()))
                .collect(),
        }
    }

    fn tenant_files(state: &StateDir) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(state.root().join(TENANTS_DIR))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_fresh_directory_loads_as_empty() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(&directory.path().join("deep/er"), "node-a").unwrap();
        assert_eq!(state.load().unwrap(), AssignmentSet::default());
        assert!(state.root().join(TENANTS_DIR).is_dir());
    }

    #[test]
    fn assignments_round_trip_through_the_disk() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let first = set(4, &[tenant("a", 0), tenant("b", 1)]);
        let report = state
            .apply(&first, &reconcile(&state.load().unwrap(), &first))
            .unwrap();
        assert_eq!(report, ApplyReport::default());
        assert_eq!(state.load().unwrap(), first);
        assert_eq!(tenant_files(&state), ["a.json", "b.json"]);
        let a = state.load_tenant("a").unwrap().unwrap();
        assert_eq!(
            (a.node.as_str(), a.revision, a.priority, a.slices.len()),
            ("node-a", 4, 3, 1)
        );

        // Reopening (a restart) sees the same set.
        let reopened = StateDir::open(directory.path(), "node-a").unwrap();
        assert_eq!(reopened.load().unwrap(), first);

        let second = set(9, &[tenant("b", 1), tenant("c", 2)]);
        let changes = reconcile(&reopened.load().unwrap(), &second);
        reopened.apply(&second, &changes).unwrap();
        assert_eq!(reopened.load().unwrap(), second);
        assert_eq!(tenant_files(&reopened), ["b.json", "c.json"]);
        // Unchanged tenants keep the revision at which they last changed.
        assert_eq!(reopened.load_tenant("b").unwrap().unwrap().revision, 4);
        assert_eq!(reopened.load_tenant("c").unwrap().unwrap().revision, 9);
        assert_eq!(reopened.load_tenant("a").unwrap(), None);
    }

    #[test]
    fn a_latency_target_is_persisted_changed_in_place_and_old_files_still_load() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let mut chat = tenant("chat", 0);
        chat.latency = true;
        chat.latency_target_us = Some(2_000);
        let first = set(5, &[chat.clone(), tenant("plain", 1)]);
        state
            .apply(&first, &reconcile(&AssignmentSet::default(), &first))
            .unwrap();
        assert_eq!(state.load().unwrap(), first);
        let file = state.load_tenant("chat").unwrap().unwrap();
        assert_eq!((file.latency, file.latency_target_us), (true, Some(2_000)));
        // A tenant without a target writes no such field: its file reads as before.
        let plain = fs::read_to_string(state.tenant_path("plain")).unwrap();
        assert!(!plain.contains("latency"), "{plain}");

        // A change of target and share (`vgpuctl set tenant`) rewrites the tenant's file.
        chat.latency_target_us = Some(1_500);
        chat.slices[0].compute_percent = 40;
        let second = set(8, &[chat.clone(), tenant("plain", 1)]);
        state
            .apply(&second, &reconcile(&state.load().unwrap(), &second))
            .unwrap();
        assert_eq!(state.load().unwrap(), second);
        let file = state.load_tenant("chat").unwrap().unwrap();
        assert_eq!(
            (
                file.revision,
                file.latency_target_us,
                file.slices[0].compute_percent
            ),
            (8, Some(1_500), 40)
        );
        assert_eq!(state.load_tenant("plain").unwrap().unwrap().revision, 5);

        // Files written before the fields existed.
        let old_assignments = r#"{"format": 1, "node": "node-a", "revision": 3,
            "node_state": "ready", "assignments": [{"tenant": "a", "priority": 0,
            "slices": [{"gpu_index": 0, "gpu_uuid": "GPU-0", "compute_percent": 25,
            "memory_bytes": 1, "guaranteed": true, "burst": false}]}]}"#;
        fs::write(state.assignments_path(), old_assignments).unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.tenants["a"].latency_target_us, None);
        assert!(!loaded.tenants["a"].latency);
        let old_tenant = r#"{"format": 1, "node": "node-a", "tenant": "a", "revision": 3,
            "priority": 0, "slices": [{"gpu_index": 0, "gpu_uuid": "GPU-0",
            "compute_percent": 25, "memory_bytes": 1, "guaranteed": true, "burst": false}]}"#;
        fs::write(state.tenant_path("a"), old_tenant).unwrap();
        let file = state.load_tenant("a").unwrap().unwrap();
        assert_eq!((file.latency, file.latency_target_us), (false, None));
    }

    #[test]
    fn apply_repairs_missing_and_stale_tenant_files() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let current = set(2, &[tenant("a", 0), tenant("b", 1)]);
        state
            .apply(&current, &reconcile(&AssignmentSet::default(), &current))
            .unwrap();
        fs::remove_file(state.tenant_path("a")).unwrap();
        fs::write(state.root().join(TENANTS_DIR).join("ghost.json"), "{}").unwrap();
        fs::write(state.root().join(TENANTS_DIR).join(".b.json.tmp"), "half").unwrap();
        let report = state.apply(&current, &[]).unwrap();
        assert_eq!(report.rewritten, ["a"]);
        assert_eq!(report.removed_stale, ["ghost"]);
        assert_eq!(tenant_files(&state), ["a.json", "b.json"]);
    }

    #[test]
    fn damaged_foreign_and_future_files_are_refused_with_a_reason() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        fs::write(state.assignments_path(), "{not json").unwrap();
        assert!(matches!(state.load(), Err(Error::StateCorrupt { .. })));

        let other = StateDir::open(directory.path(), "node-b").unwrap();
        let one = set(1, &[tenant("a", 0)]);
        other
            .apply(&one, &reconcile(&AssignmentSet::default(), &one))
            .unwrap();
        let error = state.load().unwrap_err();
        assert!(
            matches!(&error, Error::StateOtherNode { found, .. } if found == "node-b"),
            "{error}"
        );

        // Well-formed JSON that the control plane could not have sent is damage too, not a
        // reason to crash at every start.
        for impossible in [
            r#"{"tenant": "a", "priority": 0, "latency_target_us": 5, "slices": [{"gpu_index": 0,
                "gpu_uuid": "GPU-0", "compute_percent": 25, "memory_bytes": 1,
                "guaranteed": true, "burst": false}]}"#,
            r#"{"tenant": "a", "priority": 0, "slices": []}"#,
        ] {
            let text = format!(
                r#"{{"format": 1, "node": "node-a", "revision": 3, "node_state": "ready",
                "assignments": [{impossible}]}}"#
            );
            fs::write(state.assignments_path(), text).unwrap();
            let error = state.load().unwrap_err();
            assert!(matches!(error, Error::StateCorrupt { .. }), "{error}");
        }
        let twice = set(1, &[tenant("a", 0)]);
        let mut file = AssignmentsFile {
            format: STATE_FORMAT,
            node: "node-a".into(),
            revision: 1,
            node_state: "ready".into(),
            assignments: twice.tenants.values().cloned().collect(),
        };
        file.assignments.push(file.assignments[0].clone());
        fs::write(state.assignments_path(), serde_json::to_vec(&file).unwrap()).unwrap();
        assert!(matches!(state.load(), Err(Error::StateCorrupt { .. })));
        // Moved aside, it is no longer read.
        let aside = state.quarantine_assignments().unwrap();
        assert!(aside.ends_with("assignments.json.damaged"));
        assert_eq!(state.load().unwrap(), AssignmentSet::default());

        fs::write(
            state.assignments_path(),
            r#"{"format": 99, "anything": true}"#,
        )
        .unwrap();
        assert!(matches!(
            state.load(),
            Err(Error::StateFormat { found: 99, .. })
        ));
    }

    #[test]
    fn the_node_key_is_drawn_once_kept_private_and_never_replaced_silently() {
        use std::os::unix::fs::PermissionsExt;
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let key = state.node_key().unwrap();
        assert_eq!(key.as_str().len(), 2 * NODE_KEY_BYTES);
        assert_eq!(format!("{key:?}"), "NodeKey(..)", "not in logs");
        let path = directory.path().join(NODE_KEY_FILE);
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A restart reads the same key; another state directory draws another.
        let reopened = StateDir::open(directory.path(), "node-a").unwrap();
        assert_eq!(reopened.node_key().unwrap(), key);
        let other = tempfile::tempdir().unwrap();
        let elsewhere = StateDir::open(other.path(), "node-a").unwrap();
        assert_ne!(elsewhere.node_key().unwrap(), key);
        // A damaged key stops the agent instead of becoming a new identity.
        fs::write(&path, &key.as_str()[..20]).unwrap();
        let error = state.node_key().unwrap_err();
        assert!(matches!(error, Error::NodeKeyDamaged { .. }), "{error}");
        assert!(error.to_string().contains("vgpuctl node remove"), "{error}");
        // Simulated nodes derive theirs from the name, the same in every run.
        assert_eq!(NodeKey::derived("sim-1"), NodeKey::derived("sim-1"));
        assert_ne!(NodeKey::derived("sim-1"), NodeKey::derived("sim-2"));
        assert_eq!(NodeKey::from_hex("AB"), None);
    }

    #[test]
    fn the_inventory_is_recorded() {
        let directory = tempfile::tempdir().unwrap();
        let state = StateDir::open(directory.path(), "node-a").unwrap();
        let inventory = crate::inventory::InventorySource::from_simulate_arg("2xL4-24GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        state.write_inventory(&inventory).unwrap();
        let text = fs::read_to_string(directory.path().join(INVENTORY_FILE)).unwrap();
        assert_eq!(serde_json::from_str::<Inventory>(&text).unwrap(), inventory);
    }

    #[test]
    fn the_default_directory_falls_back_to_home() {
        let directory = tempfile::tempdir().unwrap();
        let writable = directory.path().join("system");
        assert_eq!(
            choose_state_dir(&writable, None, "node-a"),
            writable.join("node-a")
        );
        // A base below a plain file cannot be created.
        let blocked = directory.path().join("file");
        fs::write(&blocked, "").unwrap();
        let home = directory.path().join("home");
        assert_eq!(
            choose_state_dir(&blocked.join("system"), Some(&home), "node-a"),
            home.join(".local/state/vgpu-agent/node-a")
        );
    }
}
