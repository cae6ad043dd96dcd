//! The Raft state machine: the [`PoolState`] in memory, persisted through snapshots
//! (`DATA_DIR/snapshot.bin`).
//!
//! On start the state is restored from the last snapshot, and openraft re-applies the committed
//! log entries after it (the log store keeps the committed index), so nothing acknowledged is
//! lost. Snapshots are written to a temporary file, fsynced, renamed over the old one, and the
//! directory fsynced; each carries a checksum that is verified when it is read back.

use crate::pool::{CommandResult, PoolState};
use crate::raft_types::{
    Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig, decode, encode,
};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder, StorageIOError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::watch;

/// Format 1: the applied state. Format 2: the same, then the revoked certificates. Format 3:
/// format 2, then the node names bound to node keys. Format 4: format 3, then the placement
/// engine's host state (nodes' CPU and host memory, tenants' constraints: issue 19). Format 5:
/// format 4 with the host state's later fields (Kubernetes-managed nodes and pins: issue 18). A
/// snapshot is written in the lowest format that holds it (without revocations, bound names or
/// host state: format 1), which members of earlier versions read too.
const SNAPSHOT_FORMAT_VERSION: u32 = 5;
const SNAPSHOT_FORMAT_WITH_HOST_STATE: u32 = 4;
const SNAPSHOT_FORMAT_WITH_NODE_KEYS: u32 = 3;
const SNAPSHOT_FORMAT_WITH_REVOCATIONS: u32 = 2;
const SNAPSHOT_FORMAT_WITHOUT_REVOCATIONS: u32 = 1;
const SNAPSHOT_FILE: &str = "snapshot.bin";

/// What has been applied: the pool plus Raft's own bookkeeping.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Applied {
    pub pool: PoolState,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
}

/// State shared between the state machine (which openraft owns) and the API handlers.
pub struct Shared {
    pub applied: RwLock<Applied>,
    /// The index of the last applied entry; API handlers and watches wait on it.
    pub applied_index: watch::Sender<u64>,
    /// Wake-ups of assignment streams, per node (`crate::watchers`).
    pub watchers: crate::watchers::NodeWatchers,
}

impl Shared {
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Applied> {
        self.applied
            .read()
            .expect("a panic while holding the state lock is a bug")
    }
}

/// A snapshot as the rest of the store uses it: `applied.pool.revoked` and `node_keys` filled,
/// and the engine's host state restored.
struct SnapshotFile {
    meta: SnapshotMeta,
    applied: Applied,
}

/// Format 1 on disk and on the wire.
#[derive(Serialize, Deserialize)]
struct SnapshotV1 {
    format_version: u32,
    meta: SnapshotMeta,
    applied: Applied,
}

/// Format 2: format 1's fields, then the revoked certificates (`PoolState::revoked` is not part
/// of `PoolState`'s encoding).
#[derive(Serialize, Deserialize)]
struct SnapshotV2 {
    format_version: u32,
    meta: SnapshotMeta,
    applied: Applied,
    revoked: BTreeMap<String, i64>,
}

/// Format 3: format 2's fields, then the bound node names (`PoolState::node_keys` is not part
/// of `PoolState`'s encoding either).
#[derive(Serialize, Deserialize)]
struct SnapshotV3 {
    format_version: u32,
    meta: SnapshotMeta,
    applied: Applied,
    revoked: BTreeMap<String, i64>,
    node_keys: BTreeMap<String, crate::pool::NodeKeyBinding>,
}

/// Format 4: format 3's fields, then the placement engine's host state (`Engine::host_state`, not
/// part of the engine's encoding) as it was first laid out.
#[derive(Serialize, Deserialize)]
struct SnapshotV4 {
    format_version: u32,
    meta: SnapshotMeta,
    applied: Applied,
    revoked: BTreeMap<String, i64>,
    node_keys: BTreeMap<String, crate::pool::NodeKeyBinding>,
    host_state: HostStateV4,
}

/// `placement::HostState` as format 4 lays it out: its first two fields.
#[derive(Serialize, Deserialize)]
struct HostStateV4 {
    nodes: BTreeMap<String, placement::HostCapacity>,
    tenants: BTreeMap<String, placement::Constraints>,
}

/// Format 5: format 4 with the whole host state (`placement::HostState`, with the
/// Kubernetes-managed nodes and the pins).
#[derive(Serialize, Deserialize)]
struct SnapshotV5 {
    format_version: u32,
    meta: SnapshotMeta,
    applied: Applied,
    revoked: BTreeMap<String, i64>,
    node_keys: BTreeMap<String, crate::pool::NodeKeyBinding>,
    host_state: placement::HostState,
}

struct StoredSnapshot {
    meta: SnapshotMeta,
    bytes: Vec<u8>,
}

pub struct StateMachineStore {
    shared: Arc<Shared>,
    directory: PathBuf,
    current: Arc<Mutex<Option<StoredSnapshot>>>,
}

impl StateMachineStore {
    /// Opens the state machine in `directory`, restoring the last snapshot if there is one.
    pub fn open(directory: &Path) -> Result<(StateMachineStore, Arc<Shared>), StorageError> {
        let path = directory.join(SNAPSHOT_FILE);
        let (applied, current) = match std::fs::read(&path) {
            Ok(bytes) => {
                let file = decode_snapshot(&bytes)?;
                tracing::info!(last_log_id = ?file.meta.last_log_id, "restored the state machine from its snapshot");
                (
                    file.applied,
                    Some(StoredSnapshot {
                        meta: file.meta,
                        bytes,
                    }),
                )
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                (Applied::default(), None)
            }
            Err(error) => return Err(StorageIOError::read_snapshot(None, &error).into()),
        };
        let index = applied.last_applied.map_or(0, |id| id.index);
        let shared = Arc::new(Shared {
            applied: RwLock::new(applied),
            applied_index: watch::channel(index).0,
            watchers: crate::watchers::NodeWatchers::default(),
        });
        let store = StateMachineStore {
            shared: shared.clone(),
            directory: directory.to_owned(),
            current: Arc::new(Mutex::new(current)),
        };
        Ok((store, shared))
    }
}

/// Encodes a snapshot file: 8 bytes of checksum, then the bincode body (format 1 when nothing is
/// revoked, no name is bound and no host state is kept, format 2 when only certificates are
/// revoked, format 3 when names are bound too, format 4 with host capacities or constraints,
/// format 5 with Kubernetes-managed nodes or pins).
fn encode_snapshot(file: &SnapshotFile) -> Vec<u8> {
    let revoked = &file.applied.pool.revoked;
    let node_keys = &file.applied.pool.node_keys;
    let host_state = file.applied.pool.engine.host_state();
    let kubernetes = !host_state.kubernetes_nodes.is_empty() || !host_state.pins.is_empty();
    let body = if kubernetes {
        encode(&SnapshotV5 {
            format_version: SNAPSHOT_FORMAT_VERSION,
            meta: file.meta.clone(),
            applied: file.applied.clone(),
            revoked: revoked.clone(),
            node_keys: node_keys.clone(),
            host_state,
        })
    } else if host_state != placement::HostState::default() {
        encode(&SnapshotV4 {
            format_version: SNAPSHOT_FORMAT_WITH_HOST_STATE,
            meta: file.meta.clone(),
            applied: file.applied.clone(),
            revoked: revoked.clone(),
            node_keys: node_keys.clone(),
            host_state: HostStateV4 {
                nodes: host_state.nodes,
                tenants: host_state.tenants,
            },
        })
    } else if !node_keys.is_empty() {
        encode(&SnapshotV3 {
            format_version: SNAPSHOT_FORMAT_WITH_NODE_KEYS,
            meta: file.meta.clone(),
            applied: file.applied.clone(),
            revoked: revoked.clone(),
            node_keys: node_keys.clone(),
        })
    } else if revoked.is_empty() {
        encode(&SnapshotV1 {
            format_version: SNAPSHOT_FORMAT_WITHOUT_REVOCATIONS,
            meta: file.meta.clone(),
            applied: file.applied.clone(),
        })
    } else {
        encode(&SnapshotV2 {
            format_version: SNAPSHOT_FORMAT_WITH_REVOCATIONS,
            meta: file.meta.clone(),
            applied: file.applied.clone(),
            revoked: revoked.clone(),
        })
    }
    .expect("encoding plain data cannot fail");
    let mut bytes = Vec::with_capacity(body.len() + 8);
    bytes.extend_from_slice(&checksum(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    bytes
}

fn decode_snapshot(bytes: &[u8]) -> Result<SnapshotFile, StorageError> {
    let corrupt = |message: String| -> StorageError {
        StorageIOError::read_snapshot(None, &std::io::Error::other(message)).into()
    };
    if bytes.len() < 8 {
        return Err(corrupt(format!(
            "snapshot of {} bytes is truncated",
            bytes.len()
        )));
    }
    let (head, body) = bytes.split_at(8);
    let expected = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    if checksum(body) != expected {
        return Err(corrupt(
            "snapshot checksum mismatch: the file is corrupt".to_owned(),
        ));
    }
    let undecodable =
        |e: bincode::error::DecodeError| corrupt(format!("undecodable snapshot: {e}"));
    // Every format starts with its version.
    let (format_version, _): (u32, usize) =
        bincode::serde::decode_from_slice(body, bincode::config::standard())
            .map_err(undecodable)?;
    let file = match format_version {
        SNAPSHOT_FORMAT_WITHOUT_REVOCATIONS => {
            let v1: SnapshotV1 = decode(body).map_err(undecodable)?;
            SnapshotFile {
                meta: v1.meta,
                applied: v1.applied,
            }
        }
        SNAPSHOT_FORMAT_WITH_REVOCATIONS => {
            let v2: SnapshotV2 = decode(body).map_err(undecodable)?;
            let mut applied = v2.applied;
            applied.pool.revoked = v2.revoked;
            SnapshotFile {
                meta: v2.meta,
                applied,
            }
        }
        SNAPSHOT_FORMAT_WITH_NODE_KEYS => {
            let v3: SnapshotV3 = decode(body).map_err(undecodable)?;
            let mut applied = v3.applied;
            applied.pool.revoked = v3.revoked;
            applied.pool.node_keys = v3.node_keys;
            SnapshotFile {
                meta: v3.meta,
                applied,
            }
        }
        SNAPSHOT_FORMAT_WITH_HOST_STATE => {
            let v4: SnapshotV4 = decode(body).map_err(undecodable)?;
            let host_state = placement::HostState {
                nodes: v4.host_state.nodes,
                tenants: v4.host_state.tenants,
                ..placement::HostState::default()
            };
            restored(v4.meta, v4.applied, v4.revoked, v4.node_keys, host_state).map_err(corrupt)?
        }
        SNAPSHOT_FORMAT_VERSION => {
            let v5: SnapshotV5 = decode(body).map_err(undecodable)?;
            restored(v5.meta, v5.applied, v5.revoked, v5.node_keys, v5.host_state)
                .map_err(corrupt)?
        }
        other => {
            return Err(corrupt(format!(
                "snapshot format {other} is not one this version reads (1 to {SNAPSHOT_FORMAT_VERSION}); was it written by a newer vgpu-cp?"
            )));
        }
    };
    assert_eq!(
        file.meta.last_log_id, file.applied.last_applied,
        "snapshot meta and content disagree"
    );
    Ok(file)
}

/// A snapshot of format 4 or 5 with what the pool's encoding leaves out put back; `Err` when the
/// host state does not fit the pool (a damaged file), so it is refused rather than panicking.
fn restored(
    meta: SnapshotMeta,
    mut applied: Applied,
    revoked: BTreeMap<String, i64>,
    node_keys: BTreeMap<String, crate::pool::NodeKeyBinding>,
    host_state: placement::HostState,
) -> Result<SnapshotFile, String> {
    if !host_state_fits(&applied.pool.engine, &host_state) {
        return Err("the snapshot's host state names nodes or tenants its pool does not have: the file is corrupt".to_owned());
    }
    applied.pool.revoked = revoked;
    applied.pool.node_keys = node_keys;
    applied.pool.engine.restore_host_state(host_state);
    Ok(SnapshotFile { meta, applied })
}

/// The pool as the etcd store (issue 20; not used yet) will snapshot it: this store's encoding
/// (checksum, formats 1 to 5, the checks on decoding) with `last_applied` at the etcd log's
/// sequence number `seq` and no Raft membership, so one encoding and its checks serve both.
pub fn encode_pool_snapshot(seq: u64, pool: &PoolState) -> Vec<u8> {
    assert!(seq >= 1, "a snapshot covers at least entry 1");
    // etcd has no terms or Raft leaders: the log id carries only the sequence number.
    let last = Some(LogId::new(openraft::CommittedLeaderId::new(0, 0), seq));
    let file = SnapshotFile {
        meta: SnapshotMeta {
            last_log_id: last,
            last_membership: StoredMembership::default(),
            snapshot_id: format!("etcd-{seq}"),
        },
        applied: Applied {
            pool: pool.clone(),
            last_applied: last,
            membership: StoredMembership::default(),
        },
    };
    let bytes = encode_snapshot(&file);
    assert!(bytes.len() > 8, "a checksum and a body");
    bytes
}

/// The inverse of `encode_pool_snapshot`: the sequence number it covers and the pool.
pub fn decode_pool_snapshot(bytes: &[u8]) -> Result<(u64, PoolState), StorageError> {
    let file = decode_snapshot(bytes)?;
    let seq = file.applied.last_applied.map_or(0, |id| id.index);
    assert!(
        file.applied.membership == StoredMembership::default(),
        "an etcd snapshot carries no Raft membership"
    );
    Ok((seq, file.applied.pool))
}

/// Writes `pool` into the empty data directory `directory` as the first snapshot of a new
/// one-voter Raft cluster whose only member is `id`, reachable at `address`: the snapshot covers
/// log index `index`, and its membership is that one voter (at the same log id, as if the
/// membership entry had been compacted into it). On start, openraft finds the log empty and the
/// state at `index`, purges the log up to it and elects the member: the cluster counts as
/// initialised, and more members join as usual. This is how `transfer::import` moves a pool
/// onto the Raft store; the snapshot file is written as `build_snapshot` writes one.
pub fn write_first_snapshot(
    directory: &Path,
    id: crate::raft_types::NodeId,
    address: &str,
    index: u64,
    pool: &PoolState,
) -> std::io::Result<()> {
    assert!(index >= 1, "a snapshot covers at least entry 1");
    assert!(
        !directory.join(SNAPSHOT_FILE).exists(),
        "a first snapshot goes into a directory without one"
    );
    // No Raft leader appended these entries: term 0, as the etcd store's snapshots say.
    let last = Some(LogId::new(openraft::CommittedLeaderId::new(0, 0), index));
    let voters = std::collections::BTreeSet::from([id]);
    let nodes = BTreeMap::from([(id, openraft::BasicNode::new(address))]);
    let membership = StoredMembership::new(last, openraft::Membership::new(vec![voters], nodes));
    let file = SnapshotFile {
        meta: SnapshotMeta {
            last_log_id: last,
            last_membership: membership.clone(),
            snapshot_id: format!("import-{index}"),
        },
        applied: Applied {
            pool: pool.clone(),
            last_applied: last,
            membership,
        },
    };
    let bytes = encode_snapshot(&file);
    // Pair assertion: what we are about to persist reads back as the same state.
    let read = decode_snapshot(&bytes).map_err(std::io::Error::other)?;
    assert_eq!(read.applied.last_applied, last);
    write_durably(directory, &bytes)
}

/// Whether every node and tenant of `host_state` is in `engine` (what `restore_host_state`
/// asserts), so that a damaged snapshot is refused with a reason rather than a panic.
fn host_state_fits(engine: &placement::Engine, host_state: &placement::HostState) -> bool {
    host_state
        .nodes
        .keys()
        .chain(&host_state.kubernetes_nodes)
        .all(|node| engine.node(node).is_some())
        && host_state
            .tenants
            .keys()
            .chain(host_state.pins.keys())
            .all(|tenant| engine.constraints(tenant).is_some())
}

/// FNV-1a, 64 bit: enough to detect torn or corrupted snapshot files.
fn checksum(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

fn write_durably(directory: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = directory.join(format!("{SNAPSHOT_FILE}.tmp"));
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&temporary, directory.join(SNAPSHOT_FILE))?;
    std::fs::File::open(directory)?.sync_all()?;
    Ok(())
}

pub struct SnapshotBuilder {
    shared: Arc<Shared>,
    directory: PathBuf,
    current: Arc<Mutex<Option<StoredSnapshot>>>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let applied = self.shared.read().clone();
        let meta = SnapshotMeta {
            last_log_id: applied.last_applied,
            last_membership: applied.membership.clone(),
            snapshot_id: format!(
                "{}-{}",
                applied.last_applied.map_or(0, |id| id.leader_id.term),
                applied.last_applied.map_or(0, |id| id.index)
            ),
        };
        let file = SnapshotFile {
            meta: meta.clone(),
            applied,
        };
        let directory = self.directory.clone();
        let bytes = tokio::task::spawn_blocking(move || {
            let bytes = encode_snapshot(&file);
            // Pair assertion: what we are about to persist reads back.
            debug_assert!(decode_snapshot(&bytes).is_ok());
            write_durably(&directory, &bytes).map(|()| bytes)
        })
        .await
        .expect("the snapshot writer does not panic")
        .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        tracing::info!(snapshot = %meta.snapshot_id, size_bytes = bytes.len(), "wrote a snapshot");
        let data = Box::new(Cursor::new(bytes.clone()));
        *self.current.lock().expect("snapshot lock") = Some(StoredSnapshot {
            meta: meta.clone(),
            bytes,
        });
        Ok(Snapshot {
            meta,
            snapshot: data,
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.shared.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CommandResult>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut results = Vec::new();
        let last_index = {
            let mut applied = self.shared.applied.write().expect("state lock");
            for entry in entries {
                assert!(
                    applied
                        .last_applied
                        .is_none_or(|last| last.index < entry.log_id.index),
                    "entries are applied once, in order"
                );
                applied.last_applied = Some(entry.log_id);
                let result = match entry.payload {
                    EntryPayload::Blank => CommandResult::Done,
                    EntryPayload::Normal(command) => {
                        let appended_by = crate::pool::EntryLeader {
                            term: entry.log_id.leader_id.term,
                            leader: entry.log_id.leader_id.node_id,
                        };
                        applied
                            .pool
                            .apply_entry(entry.log_id.index, appended_by, command)
                    }
                    EntryPayload::Membership(membership) => {
                        applied.membership = StoredMembership::new(Some(entry.log_id), membership);
                        CommandResult::Done
                    }
                };
                results.push(result);
            }
            applied.last_applied.map_or(0, |id| id.index)
        };
        self.shared.applied_index.send_replace(last_index);
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            shared: self.shared.clone(),
            directory: self.directory.clone(),
            current: self.current.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let bytes = snapshot.into_inner();
        let file = decode_snapshot(&bytes)?;
        assert_eq!(
            &file.meta.last_log_id, &meta.last_log_id,
            "installed snapshot is the one announced"
        );
        let directory = self.directory.clone();
        let to_write = bytes.clone();
        tokio::task::spawn_blocking(move || write_durably(&directory, &to_write))
            .await
            .expect("the snapshot writer does not panic")
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let index = file.applied.last_applied.map_or(0, |id| id.index);
        *self.shared.applied.write().expect("state lock") = file.applied;
        *self.current.lock().expect("snapshot lock") = Some(StoredSnapshot {
            meta: meta.clone(),
            bytes,
        });
        self.shared.applied_index.send_replace(index);
        tracing::info!(snapshot = %meta.snapshot_id, "installed a snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let current = self.current.lock().expect("snapshot lock");
        Ok(current.as_ref().map(|stored| Snapshot {
            meta: stored.meta.clone(),
            snapshot: Box::new(Cursor::new(stored.bytes.clone())),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(revoked: &[(&str, i64)]) -> SnapshotFile {
        let mut applied = Applied::default();
        applied.pool.tokens.insert("ab".repeat(32), 99);
        applied.pool.revoked = revoked.iter().map(|(s, t)| (s.to_string(), *t)).collect();
        SnapshotFile {
            meta: SnapshotMeta::default(),
            applied,
        }
    }

    fn version(bytes: &[u8]) -> u32 {
        bincode::serde::decode_from_slice::<u32, _>(&bytes[8..], bincode::config::standard())
            .unwrap()
            .0
    }

    #[test]
    fn revocations_travel_in_format_2_and_a_snapshot_without_them_stays_format_1() {
        let plain = encode_snapshot(&file(&[]));
        assert_eq!(
            version(&plain),
            1,
            "readable by members of earlier versions"
        );
        // Exactly what an earlier version wrote: the format-1 struct on its own.
        let earlier = file(&[]);
        let body = encode(&SnapshotV1 {
            format_version: 1,
            meta: earlier.meta,
            applied: earlier.applied,
        })
        .unwrap();
        assert_eq!(&plain[8..], body.as_slice());
        let read = decode_snapshot(&plain).unwrap();
        assert!(read.applied.pool.revoked.is_empty());
        assert_eq!(read.applied.pool.tokens.len(), 1);

        let revoked = encode_snapshot(&file(&[("1f", 5), ("a0", 7)]));
        assert_eq!(version(&revoked), 2);
        let read = decode_snapshot(&revoked).unwrap();
        assert_eq!(
            read.applied.pool.revoked,
            BTreeMap::from([("1f".to_owned(), 5), ("a0".to_owned(), 7)])
        );
        assert_eq!(read.applied.pool.tokens.len(), 1);
    }

    /// Issue 22, point 5: bound node names survive a snapshot (format 3), with the revocations;
    /// a pool without them keeps the formats earlier members read.
    #[test]
    fn bound_node_names_travel_in_format_3() {
        let binding = crate::pool::NodeKeyBinding {
            key_sha256: "c".repeat(64),
            registration: 7 << 16,
        };
        let mut bound = file(&[("1f", 5)]);
        bound
            .applied
            .pool
            .node_keys
            .insert("node-a".to_owned(), binding.clone());
        let bytes = encode_snapshot(&bound);
        assert_eq!(version(&bytes), 3);
        let read = decode_snapshot(&bytes).unwrap();
        assert_eq!(
            read.applied.pool.node_keys,
            BTreeMap::from([("node-a".to_owned(), binding)])
        );
        assert_eq!(read.applied.pool.revoked.len(), 1);
        assert_eq!(read.applied.pool.tokens.len(), 1);
        assert_eq!(version(&encode_snapshot(&file(&[("1f", 5)]))), 2);
    }

    /// Issue 19: nodes' host capacity and tenants' constraints survive a snapshot (format 4),
    /// and the restored engine decides like the one that wrote it.
    /// A node `name` with `gpus` H100s, `GPU-0`, `GPU-1`, ...
    fn h100_node(name: &str, gpus: u32) -> placement::NodeSpec {
        placement::NodeSpec {
            name: name.into(),
            labels: BTreeMap::new(),
            gpus: (0..gpus)
                .map(|index| placement::GpuSpec {
                    uuid: format!("GPU-{index}"),
                    index,
                    model: "H100-80GB".into(),
                    memory_bytes: 80 << 30,
                    sm_count: 132,
                    nvlink_peers: BTreeMap::new(),
                    numa_node: 0,
                    pci_bus_id: String::new(),
                    nearest_nics: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn host_state_travels_in_format_4() {
        use crate::pool::{Command, CommandResult};
        use api::v1;
        use prost::Message;
        let spec = h100_node("node-a", 2);
        let mut written = file(&[]);
        let registered = written.applied.pool.apply(
            1,
            Command::RegisterHostNode {
                spec,
                host: placement::HostCapacity {
                    cpu_milli: Some(16_000),
                    memory_bytes: None,
                },
                address: String::new(),
                key_sha256: None,
                unix_ms: 0,
            },
        );
        assert_eq!(registered, CommandResult::Done);
        let place = |name: &str| Command::PlaceConstrained {
            name: name.into(),
            request: v1::PlacementRequest {
                whole_gpus: 1,
                cpu_milli: 10_000,
                ..Default::default()
            }
            .encode_to_vec(),
            unix_ms: 0,
        };
        let placed = written.applied.pool.apply(2, place("t1"));
        assert!(matches!(placed, CommandResult::Tenant(_)), "{placed:?}");
        let bytes = encode_snapshot(&written);
        assert_eq!(version(&bytes), 4);
        let mut read = decode_snapshot(&bytes).unwrap();
        assert_eq!(
            read.applied.pool.engine.host_state(),
            written.applied.pool.engine.host_state()
        );
        assert_eq!(read.applied.pool.tokens.len(), 1);
        // A second tenant asking 10 CPUs does not fit the 6 left, on both.
        let left = written.applied.pool.apply(3, place("t2"));
        let right = read.applied.pool.apply(3, place("t2"));
        assert_eq!(left, right);
        let CommandResult::Tenant(pending) = right else {
            panic!("expected a pending tenant, got {right:?}");
        };
        assert!(pending.reason.contains("CPU"), "{}", pending.reason);
        // Without host state the formats earlier members read are kept.
        assert_eq!(version(&encode_snapshot(&file(&[]))), 1);
    }

    /// Issue 18: Kubernetes-managed nodes and pins survive a snapshot (format 5), the restored
    /// pool keeps the pinned tenant bound, and a pool without them keeps format 4 and below.
    #[test]
    fn kubernetes_nodes_and_pins_travel_in_format_5() {
        use crate::pool::{Command, CommandResult};
        use api::v1;
        use prost::Message;
        let spec = h100_node("node-k", 1);
        let mut written = file(&[]);
        let registered = written.applied.pool.apply(
            1,
            Command::RegisterKubernetesNode {
                spec,
                host: placement::HostCapacity::default(),
                address: String::new(),
                key_sha256: None,
                unix_ms: 0,
            },
        );
        assert_eq!(registered, CommandResult::Done);
        let request = v1::PlacementRequest {
            milli_gpus: 250,
            owner: "k8s:ml/train".into(),
            pin: Some(v1::Pin {
                node: "node-k".into(),
                gpus: vec![v1::PinnedGpu {
                    uuid: "GPU-0".into(),
                    compute_percent: 25,
                    memory_bytes: 20 << 30,
                }],
            }),
            ..Default::default()
        };
        let placed = written.applied.pool.apply(
            2,
            Command::PlacePinned {
                name: "train-3f2a9c1e".into(),
                request: request.encode_to_vec(),
                unix_ms: 0,
            },
        );
        assert!(matches!(placed, CommandResult::Tenant(_)), "{placed:?}");
        let bytes = encode_snapshot(&written);
        assert_eq!(version(&bytes), SNAPSHOT_FORMAT_VERSION);
        let read = decode_snapshot(&bytes).unwrap();
        let engine = &read.applied.pool.engine;
        assert_eq!(
            engine.host_state(),
            written.applied.pool.engine.host_state()
        );
        assert!(engine.node("node-k").unwrap().kubernetes_managed);
        assert_eq!(
            engine.pin("train-3f2a9c1e"),
            Some(&crate::pool::pin_of(request.pin.as_ref().unwrap()))
        );
        engine.check_invariants();
        // Pair check: what decodes encodes to the same bytes.
        assert_eq!(encode_snapshot(&read), bytes);
    }

    #[test]
    fn the_etcd_store_snapshots_the_pool_in_this_encoding() {
        let pool = file(&[("cafe", 7)]).applied.pool;
        let bytes = encode_pool_snapshot(12, &pool);
        assert_eq!(version(&bytes), SNAPSHOT_FORMAT_WITH_REVOCATIONS);
        let (seq, decoded) = decode_pool_snapshot(&bytes).expect("decode");
        assert_eq!(seq, 12);
        assert_eq!(decoded.revoked, pool.revoked);
        // Pair check: what decodes encodes to the same bytes.
        assert_eq!(encode_pool_snapshot(12, &decoded), bytes);
        let mut damaged = bytes.clone();
        *damaged.last_mut().expect("bytes") ^= 1;
        assert!(decode_pool_snapshot(&damaged).is_err());
    }

    #[test]
    fn a_snapshot_of_an_unknown_format_is_refused_with_a_reason() {
        let mut bytes = encode_snapshot(&file(&[]));
        // Rewrite the version (a one-byte varint) and the checksum.
        bytes[8] = 9;
        let sum = checksum(&bytes[8..]).to_le_bytes();
        bytes[..8].copy_from_slice(&sum);
        let error = decode_snapshot(&bytes).err().unwrap().to_string();
        assert!(error.contains("snapshot format 9"), "{error}");
    }
}
