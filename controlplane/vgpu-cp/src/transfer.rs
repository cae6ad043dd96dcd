//! Moving a pool from one store to the other (issue 20): `vgpu-cp export` writes a stopped
//! pool's state to a file, `vgpu-cp import` makes that state the first snapshot of a new
//! cluster on either store.
//!
//! The file is a short text header, a blank line, then the body: the pool as the etcd store
//! snapshots it (`store::encode_pool_snapshot`, the Raft store's checksummed snapshot encoding,
//! formats 1 to 5). The header says which file format it is, which store and cluster it came
//! from, the log index the state is at and the body's size; its last line is the SHA-256 of the
//! header lines above it and the body, so a changed header is refused like a changed body:
//!
//! ```text
//! vgpu-pool-export
//! format_version=1
//! source_store=raft
//! cluster_id=5f0c8e4d2a91b7c3
//! last_applied_index=1234
//! body_bytes=5678
//! sha256=<64 hex digits>
//!
//! <body>
//! ```
//!
//! Export reads what a restarting member would: on the Raft store the data directory's snapshot
//! and the committed log entries after it (`StateMachineStore::open`, then its `apply`, as
//! openraft re-applies on start), on the etcd store the snapshot and log keys under the prefix
//! (as a new member's `Follower` would, through `apply_etcd_entry`). It refuses a running pool:
//! a locked data directory, or members still registered under the prefix.
//!
//! Import refuses a data directory or prefix that holds anything, writes the state as the first
//! snapshot (Raft: `store::write_first_snapshot`, a one-voter membership of this member; etcd:
//! `EtcdLog::install_first_snapshot`, the head at the same index) and the member's identity with
//! the exported cluster id, so `vgpu-cp bootstrap` with the same settings starts the imported pool
//! and others join it as usual.
//!
//! **The cluster id is kept.** Node agents do not check it (they trust the cluster CA), and the
//! state keeps every node's name, key binding and registration, every token and revocation: an
//! agent registered with the old pool goes on once it reaches the new members (same addresses,
//! or `--control-plane` changed), with certificates of the same CA. What the id guards is that a
//! data directory or prefix is never mixed with another cluster's; the old pool's members must
//! therefore not be started again after the move (their data is the old copy of the same
//! cluster).

use crate::identity;
use crate::pool::PoolState;
use crate::store;
use std::fmt;
use std::path::{Path, PathBuf};

/// The layout of the export file this version writes and reads.
pub const EXPORT_FORMAT_VERSION: u32 = 1;
/// The first line of every export file.
const MAGIC: &str = "vgpu-pool-export";
/// The header is short; a file whose first this many bytes hold no blank line is not an export.
const HEADER_BYTES_MAX: usize = 4096;
/// The data directory's Raft log (as `start` names it).
const RAFT_LOG_FILE: &str = "raft.redb";
/// The data directory's lock (as `start` takes it).
const LOCK_FILE: &str = "lock";

/// Which store a pool keeps its state in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Raft,
    Etcd,
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreKind::Raft => "raft",
            StoreKind::Etcd => "etcd",
        })
    }
}

impl StoreKind {
    fn parse(text: &str) -> Option<StoreKind> {
        match text {
            "raft" => Some(StoreKind::Raft),
            "etcd" => Some(StoreKind::Etcd),
            _ => None,
        }
    }
}

/// The header of an export file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportHeader {
    pub format_version: u32,
    pub source_store: StoreKind,
    pub cluster_id: String,
    /// The log index (Raft) or sequence number (etcd) of the last entry in the state.
    pub last_applied_index: u64,
    pub body_bytes: u64,
    /// SHA-256 (hex) of the header's lines before it and the body.
    pub sha256: String,
}

/// An export read back: its header and the pool.
pub struct Export {
    pub header: ExportHeader,
    pub pool: PoolState,
}

/// What an export or an import moved, for the command to print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub header: ExportHeader,
    pub nodes: usize,
    pub tenants: usize,
    /// Raft export only: entries in the member's log after the last commit it recorded, which
    /// were left out (they may never have committed).
    pub entries_left_out: u64,
}

/// Where `export` reads a stopped pool.
#[derive(Clone, Debug)]
pub enum Source {
    /// A Raft member's data directory.
    Raft { data_dir: PathBuf },
    /// The pool's prefix in etcd.
    Etcd(crate::EtcdStore),
}

/// What moving a pool can fail with; each message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(
        "{path} is not a pool export of vgpu-cp (it does not start with `{MAGIC}`): pass the file \
         that `vgpu-cp export --out` wrote"
    )]
    NotAnExport { path: PathBuf },
    #[error(
        "{path} is a pool export of format {found}, which this vgpu-cp does not read (it reads \
         format {EXPORT_FORMAT_VERSION}): import it with the vgpu-cp version that exported it, or \
         a newer one"
    )]
    UnknownFormat { path: PathBuf, found: String },
    #[error(
        "{path} fails its checksum (sha256 {found}, its header says {expected}): the file \
         changed or was cut short after the export; copy it again, or export the pool again"
    )]
    Checksum {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("{path} is damaged ({reason}): export the pool again (`vgpu-cp export`)")]
    Damaged { path: PathBuf, reason: String },
    #[error(
        "the data directory {path} is not empty: import creates a new cluster, only in an empty \
         --data-dir; choose another one, or move this one away"
    )]
    DataDirNotEmpty { path: PathBuf },
    #[error(
        "the data directory {path} is in use by a running vgpu-cp: stop every member of the pool \
         before exporting it, so that no acknowledged write is left out"
    )]
    PoolRunning { path: PathBuf },
    #[error(
        "{path} holds no vgpu-cp member (no identity.json): pass the data directory of one of \
         the pool's members with --data-dir"
    )]
    NoMember { path: PathBuf },
    #[error(
        "the member in {path} keeps the pool's state in etcd, not in its data directory (there \
         is no {RAFT_LOG_FILE}): export with --etcd-endpoints and --etcd-prefix instead"
    )]
    NotRaft { path: PathBuf },
    #[error("cannot read the Raft store in {path}: {reason}; is it a vgpu-cp data directory?")]
    RaftStore { path: PathBuf, reason: String },
    #[error(
        "the pool under etcd prefix {prefix} is running: members {members} are registered there; \
         stop every vgpu-cp member of the pool first (a stopped member's registration goes when \
         its lease expires, within etcd_lease_ttl_s)"
    )]
    EtcdPoolRunning { prefix: String, members: String },
    #[error(
        "etcd prefix {prefix} holds no pool (it has no cluster key): check --etcd-prefix and \
         --etcd-endpoints"
    )]
    NoEtcdPool { prefix: String },
    #[error(
        "the pool under etcd prefix {prefix} changed while it was exported (a snapshot moved): \
         stop every vgpu-cp member of the pool, then export again"
    )]
    EtcdPoolChanged { prefix: String },
    #[error(
        "the pool holds no state yet (nothing was ever written to it): there is nothing to \
         export; bootstrap a new pool on the other store instead"
    )]
    EmptyPool,
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// etcd's own messages name the endpoints or prefix and say what to check.
    #[error(transparent)]
    Etcd(#[from] etcd_store::Error),
    #[error(transparent)]
    Entry(#[from] crate::etcd_entry::EtcdEntryError),
    /// The member's settings (the etcd TLS files).
    #[error(transparent)]
    Settings(Box<crate::Error>),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TransferError {
    let path = path.to_owned();
    move |source| TransferError::Io { what, path, source }
}

/// The export file of `pool` at `last_applied_index`, from `source_store`'s cluster `cluster_id`.
pub fn encode_export(
    source_store: StoreKind,
    cluster_id: &str,
    last_applied_index: u64,
    pool: &PoolState,
) -> Vec<u8> {
    assert!(!cluster_id.is_empty() && !cluster_id.contains(char::is_whitespace));
    let body = store::encode_pool_snapshot(last_applied_index, pool);
    let covered = format!(
        "{MAGIC}\nformat_version={EXPORT_FORMAT_VERSION}\nsource_store={source_store}\ncluster_id={cluster_id}\nlast_applied_index={last_applied_index}\nbody_bytes={}\n",
        body.len()
    );
    let sha256 = sha256_hex(covered.as_bytes(), &body);
    let mut bytes = format!("{covered}sha256={sha256}\n\n").into_bytes();
    assert!(bytes.len() < HEADER_BYTES_MAX, "the header stays short");
    bytes.extend_from_slice(&body);
    bytes
}

/// Reads an export file's `bytes` (`path` is for the messages): the header is checked, then the
/// body's size and checksum, then the body decodes (with the snapshot encoding's own checks) to
/// the state at the header's index.
pub fn decode_export(path: &Path, bytes: &[u8]) -> Result<Export, TransferError> {
    let damaged = |reason: String| TransferError::Damaged {
        path: path.to_owned(),
        reason,
    };
    if !bytes.starts_with(format!("{MAGIC}\n").as_bytes()) {
        return Err(TransferError::NotAnExport {
            path: path.to_owned(),
        });
    }
    let window = &bytes[..bytes.len().min(HEADER_BYTES_MAX)];
    let Some(end) = window.windows(2).position(|pair| pair == b"\n\n") else {
        return Err(damaged("its header has no end".to_owned()));
    };
    let text = std::str::from_utf8(&bytes[..end])
        .map_err(|_| damaged("its header is not text".to_owned()))?;
    let body = &bytes[end + 2..];
    // The checksum is the header's last line and covers the lines before it and the body.
    let covered = text.rfind("\nsha256=").map_or(text, |at| &text[..at + 1]);
    let fields: std::collections::BTreeMap<&str, &str> = text
        .lines()
        .skip(1)
        .filter_map(|line| line.split_once('='))
        .collect();
    // The version first: a newer layout is named as such, not as damage.
    let version = fields.get("format_version").copied().unwrap_or("(none)");
    if version.parse::<u32>() != Ok(EXPORT_FORMAT_VERSION) {
        return Err(TransferError::UnknownFormat {
            path: path.to_owned(),
            found: version.to_owned(),
        });
    }
    let field = |name: &str| {
        fields
            .get(name)
            .copied()
            .ok_or_else(|| damaged(format!("its header has no {name}")))
    };
    let number = |name: &str| -> Result<u64, TransferError> {
        field(name)?
            .parse()
            .map_err(|_| damaged(format!("its header's {name} is not a number")))
    };
    let header = ExportHeader {
        format_version: EXPORT_FORMAT_VERSION,
        source_store: StoreKind::parse(field("source_store")?)
            .ok_or_else(|| damaged("its header names an unknown source_store".to_owned()))?,
        cluster_id: field("cluster_id")?.to_owned(),
        last_applied_index: number("last_applied_index")?,
        body_bytes: number("body_bytes")?,
        sha256: field("sha256")?.to_owned(),
    };
    if header.cluster_id.is_empty() {
        return Err(damaged("its header's cluster_id is empty".to_owned()));
    }
    if body.len() as u64 != header.body_bytes {
        return Err(damaged(format!(
            "its body has {} bytes, its header says {}",
            body.len(),
            header.body_bytes
        )));
    }
    let found = sha256_hex(covered.as_bytes(), body);
    if found != header.sha256 {
        return Err(TransferError::Checksum {
            path: path.to_owned(),
            expected: header.sha256,
            found,
        });
    }
    let (index, pool) =
        store::decode_pool_snapshot(body).map_err(|error| damaged(error.to_string()))?;
    if index != header.last_applied_index {
        return Err(damaged(format!(
            "its body holds the state at index {index}, its header says {}",
            header.last_applied_index
        )));
    }
    Ok(Export { header, pool })
}

/// SHA-256 (hex) of `header` then `body`.
fn sha256_hex(header: &[u8], body: &[u8]) -> String {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(header);
    context.update(body);
    context
        .finish()
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Reads a stopped pool's state from `source`: the export file's bytes and what it holds.
pub async fn export(source: &Source) -> Result<(Vec<u8>, Summary), TransferError> {
    let (kind, cluster_id, index, pool, entries_left_out) = match source {
        Source::Raft { data_dir } => {
            let read = read_raft_store(data_dir).await?;
            (StoreKind::Raft, read.0, read.1, read.2, read.3)
        }
        Source::Etcd(etcd) => {
            let read = read_etcd_store(etcd).await?;
            (StoreKind::Etcd, read.0, read.1, read.2, 0)
        }
    };
    if index == 0 {
        return Err(TransferError::EmptyPool);
    }
    let bytes = encode_export(kind, &cluster_id, index, &pool);
    // Pair check: the file reads back as the state it was made of.
    let export = decode_export(Path::new("(the export)"), &bytes)?;
    assert_eq!(export.header.last_applied_index, index);
    let summary = Summary {
        nodes: export.pool.nodes.len(),
        tenants: export.pool.tenants.len(),
        header: export.header,
        entries_left_out,
    };
    Ok((bytes, summary))
}

/// The Raft member in `data_dir`, offline: its cluster id, and the state at its last committed
/// entry (the snapshot, then the committed entries after it, applied as on a restart), and how
/// many entries after that were left out.
async fn read_raft_store(data_dir: &Path) -> Result<(String, u64, PoolState, u64), TransferError> {
    use openraft::RaftLogReader;
    use openraft::storage::{RaftLogStorage, RaftStateMachine};
    let identity = identity::read(data_dir)
        .map_err(io("read the identity in", data_dir))?
        .ok_or_else(|| TransferError::NoMember {
            path: data_dir.to_owned(),
        })?;
    let log_path = data_dir.join(RAFT_LOG_FILE);
    if !log_path.exists() {
        return Err(TransferError::NotRaft {
            path: data_dir.to_owned(),
        });
    }
    let lock = std::fs::File::create(data_dir.join(LOCK_FILE))
        .map_err(io("open the lock of", data_dir))?;
    if lock.try_lock().is_err() {
        return Err(TransferError::PoolRunning {
            path: data_dir.to_owned(),
        });
    }
    let store_error = |reason: String| TransferError::RaftStore {
        path: data_dir.to_owned(),
        reason,
    };
    let mut log = store::LogStore::open_with(&log_path, store::WriteMode::Inline)
        .map_err(|error| store_error(error.to_string()))?;
    let (mut state_machine, shared) =
        store::StateMachineStore::open(data_dir).map_err(|error| store_error(error.to_string()))?;
    let committed = log
        .read_committed()
        .await
        .map_err(|error| store_error(error.to_string()))?;
    let last_log = log
        .get_log_state()
        .await
        .map_err(|error| store_error(error.to_string()))?
        .last_log_id;
    let applied = shared.read().last_applied;
    let next_index = |id: Option<crate::raft_types::LogId>| id.map_or(0, |id| id.index + 1);
    let start = next_index(applied);
    let end = next_index(committed).max(start);
    if start < end {
        let entries = log
            .try_get_log_entries(start..end)
            .await
            .map_err(|error| store_error(error.to_string()))?;
        if entries.len() as u64 != end - start {
            return Err(store_error(format!(
                "the log lacks committed entries between {start} and {end}"
            )));
        }
        state_machine
            .apply(entries)
            .await
            .map_err(|error| store_error(error.to_string()))?;
    }
    let entries_left_out = next_index(last_log).saturating_sub(end);
    let applied = shared.read();
    let index = applied.last_applied.map_or(0, |id| id.index);
    assert!(index + 1 >= end, "every committed entry was applied");
    drop(lock);
    Ok((
        identity.cluster_id,
        index,
        applied.pool.clone(),
        entries_left_out,
    ))
}

/// The pool under the etcd prefix, offline: its cluster id, and the state at the log's head
/// (the snapshot, then every entry after it, applied as a new member would).
async fn read_etcd_store(
    etcd: &crate::EtcdStore,
) -> Result<(String, u64, PoolState), TransferError> {
    let config = etcd
        .client_config()
        .map_err(|error| TransferError::Settings(Box::new(error)))?;
    let log = etcd_store::EtcdLog::connect(&config).await?;
    let prefix = log.keys().prefix().to_owned();
    let cluster_id = log
        .stored_cluster_id()
        .await?
        .ok_or_else(|| TransferError::NoEtcdPool {
            prefix: prefix.clone(),
        })?;
    let members = etcd_store::Presence::members(log.connection()).await?;
    if !members.is_empty() {
        let members: Vec<String> = members
            .iter()
            .map(|(id, address)| format!("{id} ({address})"))
            .collect();
        return Err(TransferError::EtcdPoolRunning {
            prefix,
            members: members.join(", "),
        });
    }
    let (mut index, mut pool) = match log.read_snapshot().await? {
        Some(snapshot) => {
            let (index, pool) = store::decode_pool_snapshot(&snapshot.bytes).map_err(|error| {
                etcd_store::Error::Corrupt {
                    key: log.keys().snapshot(),
                    reason: error.to_string(),
                }
            })?;
            assert_eq!(index, snapshot.seq, "a snapshot holds the state at its seq");
            (index, pool)
        }
        None => (0, PoolState::default()),
    };
    loop {
        let batch = match log.read_from(index + 1, etcd_store::READ_ENTRIES_MAX).await {
            Ok(batch) => batch,
            Err(etcd_store::Error::Compacted { .. }) => {
                return Err(TransferError::EtcdPoolChanged { prefix });
            }
            Err(error) => return Err(error.into()),
        };
        for entry in &batch.entries {
            assert_eq!(entry.seq, index + 1, "entries come in order, without gaps");
            crate::etcd_entry::apply_etcd_entry(
                &mut pool,
                entry.seq,
                entry.revision,
                &entry.bytes,
            )?;
            index = entry.seq;
        }
        if batch.entries.is_empty() || index >= batch.head.seq {
            break;
        }
    }
    Ok((cluster_id, index, pool))
}

/// Reads the export file at `path` and makes its state the first snapshot of a new cluster on
/// the store `config` names (its data directory, and etcd's prefix, must be empty), with the
/// member `config.id` and the exported cluster id. Start the member with `vgpu-cp bootstrap`
/// and the same settings afterwards.
pub async fn import(config: &crate::Config, path: &Path) -> Result<Summary, TransferError> {
    let bytes = std::fs::read(path).map_err(io("read the export", path))?;
    let export = decode_export(path, &bytes)?;
    let data_dir = &config.data_dir;
    if let Some(existing) = std::fs::read_dir(data_dir)
        .ok()
        .and_then(|mut entries| entries.next())
    {
        existing.map_err(io("read the data directory", data_dir))?;
        return Err(TransferError::DataDirNotEmpty {
            path: data_dir.clone(),
        });
    }
    std::fs::create_dir_all(data_dir).map_err(io("create the data directory", data_dir))?;
    let lock = std::fs::File::create(data_dir.join(LOCK_FILE))
        .map_err(io("create the lock in", data_dir))?;
    if lock.try_lock().is_err() {
        return Err(TransferError::PoolRunning {
            path: data_dir.clone(),
        });
    }
    let index = export.header.last_applied_index;
    match &config.etcd {
        None => {
            store::write_first_snapshot(data_dir, config.id, &config.advertise, index, &export.pool)
                .map_err(io("write the first snapshot in", data_dir))?
        }
        Some(etcd) => {
            let client_config = etcd
                .client_config()
                .map_err(|error| TransferError::Settings(Box::new(error)))?;
            let mut log = etcd_store::EtcdLog::connect(&client_config).await?;
            let keys = log.count_keys().await?;
            if keys > 0 {
                return Err(etcd_store::Error::NotEmpty {
                    prefix: log.keys().prefix().to_owned(),
                    what: format!("{keys} keys"),
                }
                .into());
            }
            log.claim_cluster(&export.header.cluster_id).await?;
            let body = store::encode_pool_snapshot(index, &export.pool);
            log.install_first_snapshot(index, &body).await?;
        }
    }
    // Last: a member starts from this directory only once its state is in place.
    identity::write(
        data_dir,
        &identity::Identity {
            cluster_id: export.header.cluster_id.clone(),
            node_id: config.id,
            origin: Some(identity::Origin::Bootstrap),
        },
    )
    .map_err(io("write the identity in", data_dir))?;
    drop(lock);
    Ok(Summary {
        nodes: export.pool.nodes.len(),
        tenants: export.pool.tenants.len(),
        header: export.header,
        entries_left_out: 0,
    })
}

#[cfg(test)]
#[path = "transfer_test.rs"]
mod tests;
