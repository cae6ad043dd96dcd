//! The Raft log and vote, durable in a redb database (`DATA_DIR/raft.redb`), with group commit.
//!
//! Every mutation (append, truncate, purge, vote, committed index) goes, in order, through one
//! writer thread. The writer takes everything queued, applies it in one redb transaction and
//! commits it with one fsync, then acknowledges: it calls the append callbacks and wakes the
//! callers that wait (vote, truncate, purge). Under load, many appends share one fsync; alone,
//! an append costs one. Appended entries are readable at once from an in-memory overlay
//! (`pending`) until the writer has made them durable, as openraft's `append` contract asks.
//!
//! **Architecture Invariant:** a vote is on disk before `save_vote` returns, and appended entries
//! are on disk before their flush callback fires. That is what lets an acknowledged write survive
//! `kill -9` of every node at once.

use crate::raft_types::{Entry, LogId, NodeId, StorageError, TypeConfig, decode, encode};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader, StorageIOError, Vote};
use redb::{Database, ReadableTable, TableDefinition};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("logs");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_LAST_PURGED: &str = "last_purged";

/// Mutations queued for the writer before `append` waits for room.
const WRITE_QUEUE_MAX: usize = 4096;
/// Most mutations the writer puts into one transaction.
const WRITE_BATCH_MAX: usize = 1024;

/// One mutation, applied by the writer in queue order.
enum Write {
    Append {
        entries: Vec<(u64, Vec<u8>, LogId)>,
        callback: LogFlushed<TypeConfig>,
    },
    Truncate {
        from_index: u64,
        done: tokio::sync::oneshot::Sender<Result<(), String>>,
    },
    Purge {
        upto: LogId,
        done: tokio::sync::oneshot::Sender<Result<(), String>>,
    },
    Meta {
        key: &'static str,
        value: Vec<u8>,
        done: Option<tokio::sync::oneshot::Sender<Result<(), String>>>,
    },
}

/// What readers need besides the database: entries not yet durable, and the log's bounds.
#[derive(Default)]
struct Overlay {
    /// Appended entries the writer has not made durable yet, by index.
    pending: BTreeMap<u64, Entry>,
    last_log_id: Option<LogId>,
    last_purged: Option<LogId>,
}

/// Counters of the log writer, for `/metrics`: transactions committed, and entries appended.
pub static LOG_TRANSACTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
pub static LOG_ENTRIES_APPENDED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);
pub static LOG_APPEND_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How mutations reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// A writer thread batches everything queued into one transaction (production).
    GroupCommit,
    /// Each mutation is written before the call returns, on the caller's thread. The
    /// deterministic simulation uses this: a real thread would complete I/O outside its
    /// virtual clock.
    Inline,
}

#[derive(Clone)]
enum Writer {
    Thread(SyncSender<Write>),
    Inline,
}

/// The log store; clones share one database, one writer and one overlay.
#[derive(Clone)]
pub struct LogStore {
    database: Arc<Database>,
    overlay: Arc<Mutex<Overlay>>,
    writer: Writer,
    fault: WriteFault,
}

/// An injectable storage fault, for tests of what a member does when its disk fills: while set,
/// every write of the log fails as a full disk would (`ErrorKind::StorageFull`), before redb is
/// touched. Clones share one switch. Nothing sets it outside tests.
#[derive(Clone, Default)]
pub struct WriteFault(Arc<std::sync::atomic::AtomicBool>);

impl WriteFault {
    /// Makes every later write fail (`true`) or succeed again (`false`).
    pub fn set(&self, failing: bool) {
        self.0.store(failing, std::sync::atomic::Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), redb::Error> {
        if self.0.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(redb::Error::Io(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "no space left on device (a fault injected by a test)",
            )));
        }
        Ok(())
    }
}

impl LogStore {
    /// Opens (or creates) the log database at `path` with group commit.
    pub fn open(path: &Path) -> Result<LogStore, redb::Error> {
        LogStore::open_with(path, WriteMode::GroupCommit)
    }

    /// Opens (or creates) the log database at `path`; starts the writer thread for group commit.
    pub fn open_with(path: &Path, mode: WriteMode) -> Result<LogStore, redb::Error> {
        let database = Arc::new(Database::create(path)?);
        let transaction = database.begin_write()?;
        transaction.open_table(LOGS)?;
        transaction.open_table(META)?;
        transaction.commit()?;
        let mut overlay = Overlay::default();
        {
            let transaction = database.begin_read()?;
            let meta = transaction.open_table(META)?;
            if let Some(bytes) = meta.get(KEY_LAST_PURGED)? {
                overlay.last_purged =
                    Some(decode(bytes.value()).map_err(|e| redb::Error::Corrupted(e.to_string()))?);
            }
            let logs = transaction.open_table(LOGS)?;
            if let Some((_, bytes)) = logs.last()? {
                let entry: Entry =
                    decode(bytes.value()).map_err(|e| redb::Error::Corrupted(e.to_string()))?;
                overlay.last_log_id = Some(entry.log_id);
            }
            overlay.last_log_id = overlay.last_log_id.or(overlay.last_purged);
        }
        let overlay = Arc::new(Mutex::new(overlay));
        let fault = WriteFault::default();
        let writer = match mode {
            WriteMode::Inline => Writer::Inline,
            WriteMode::GroupCommit => {
                let (sender, queue) = sync_channel(WRITE_QUEUE_MAX);
                let thread_database = database.clone();
                let thread_overlay = overlay.clone();
                let thread_fault = fault.clone();
                std::thread::Builder::new()
                    .name("raft-log-writer".to_owned())
                    .spawn(move || {
                        run_writer(&thread_database, &thread_overlay, &thread_fault, &queue)
                    })
                    .expect("spawning the log writer thread");
                Writer::Thread(sender)
            }
        };
        Ok(LogStore {
            database,
            overlay,
            writer,
            fault,
        })
    }

    /// The switch that makes this store's writes fail (tests of a full disk).
    pub fn write_fault(&self) -> WriteFault {
        self.fault.clone()
    }

    fn overlay(&self) -> std::sync::MutexGuard<'_, Overlay> {
        self.overlay
            .lock()
            .expect("a panic while holding the log overlay is a bug")
    }

    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, StorageError> {
        let transaction = self
            .database
            .begin_read()
            .map_err(|e| StorageIOError::read(&e))?;
        let table = transaction
            .open_table(META)
            .map_err(|e| StorageIOError::read(&e))?;
        let Some(bytes) = table.get(key).map_err(|e| StorageIOError::read(&e))? else {
            return Ok(None);
        };
        let value = decode(bytes.value()).map_err(|e| StorageIOError::read(&e))?;
        Ok(Some(value))
    }

    fn send(&self, write: Write) -> Result<(), StorageError> {
        match &self.writer {
            Writer::Thread(sender) => sender.send(write).map_err(|_| {
                let error = std::io::Error::other("the log writer thread stopped");
                StorageIOError::write_logs(&error).into()
            }),
            Writer::Inline => {
                complete_batch(&self.database, &self.overlay, &self.fault, vec![write]);
                Ok(())
            }
        }
    }

    /// Queues a mutation and waits until the writer has made it durable.
    async fn write_and_wait(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<(), String>>) -> Write,
    ) -> Result<(), String> {
        let (done, wait) = tokio::sync::oneshot::channel();
        self.send(make(done)).map_err(|e| e.to_string())?;
        wait.await
            .map_err(|_| "the log writer thread stopped".to_owned())?
    }
}

/// The writer thread: drains the queue in order, one transaction and one fsync per batch.
fn run_writer(
    database: &Database,
    overlay: &Mutex<Overlay>,
    fault: &WriteFault,
    queue: &Receiver<Write>,
) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        while batch.len() < WRITE_BATCH_MAX {
            match queue.try_recv() {
                Ok(write) => batch.push(write),
                Err(_) => break,
            }
        }
        complete_batch(database, overlay, fault, batch);
    }
}

/// Writes a batch in one transaction, then acknowledges each mutation in order.
fn complete_batch(
    database: &Database,
    overlay: &Mutex<Overlay>,
    fault: &WriteFault,
    batch: Vec<Write>,
) {
    let result = fault
        .check()
        .and_then(|()| write_batch(database, &batch))
        .map_err(|e| e.to_string());
    LOG_TRANSACTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if result.is_ok() {
        // Durable now: drop them from the overlay, unless a truncate replaced them since.
        let mut overlay = overlay.lock().expect("log overlay lock");
        for write in &batch {
            if let Write::Append { entries, .. } = write {
                for (index, _, log_id) in entries {
                    if overlay
                        .pending
                        .get(index)
                        .is_some_and(|entry| entry.log_id == *log_id)
                    {
                        overlay.pending.remove(index);
                    }
                }
            }
        }
    } else {
        tracing::error!(error = ?result, "writing the Raft log failed");
    }
    for write in batch {
        match write {
            Write::Append { callback, .. } => {
                callback.log_io_completed(result.clone().map_err(std::io::Error::other));
            }
            Write::Truncate { done, .. } | Write::Purge { done, .. } => {
                let _ = done.send(result.clone());
            }
            Write::Meta { done, .. } => {
                if let Some(done) = done {
                    let _ = done.send(result.clone());
                }
            }
        }
    }
}

fn write_batch(database: &Database, batch: &[Write]) -> Result<(), redb::Error> {
    let transaction = database.begin_write()?;
    {
        let mut logs = transaction.open_table(LOGS)?;
        let mut meta = transaction.open_table(META)?;
        for write in batch {
            match write {
                Write::Append { entries, .. } => {
                    for (index, bytes, _) in entries {
                        logs.insert(*index, bytes.as_slice())?;
                    }
                }
                Write::Truncate { from_index, .. } => {
                    logs.retain_in(*from_index.., |_, _| false)?;
                }
                Write::Purge { upto, .. } => {
                    let bytes = encode(upto).expect("encoding plain data cannot fail");
                    meta.insert(KEY_LAST_PURGED, bytes.as_slice())?;
                    logs.retain_in(..=upto.index, |_, _| false)?;
                }
                Write::Meta { key, value, .. } => {
                    meta.insert(*key, value.as_slice())?;
                }
            }
        }
    }
    // Durability::Immediate is redb's default: commit returns after fsync.
    transaction.commit()?;
    Ok(())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        // Snapshot the overlay first: anything the writer removes from it afterwards is already
        // committed, so the read transaction below (begun later) sees it.
        let (pending, end) = {
            let overlay = self.overlay();
            let pending: BTreeMap<u64, Entry> = overlay
                .pending
                .range(range.clone())
                .map(|(index, entry)| (*index, entry.clone()))
                .collect();
            (pending, overlay.last_log_id.map_or(0, |id| id.index + 1))
        };
        let start = match range.start_bound() {
            Bound::Included(&index) => index,
            Bound::Excluded(&index) => index + 1,
            Bound::Unbounded => 0,
        };
        let mut entries = Vec::new();
        let transaction = self
            .database
            .begin_read()
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let table = transaction
            .open_table(LOGS)
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let mut pending = pending.into_iter().peekable();
        for item in table
            .range(start..end.max(start))
            .map_err(|e| StorageIOError::read_logs(&e))?
        {
            let (index, bytes) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            let index = index.value();
            if !range.contains(&index) {
                break;
            }
            while let Some((pending_index, _)) = pending.peek() {
                if *pending_index >= index {
                    break;
                }
                entries.push(pending.next().expect("peeked").1);
            }
            if pending
                .peek()
                .is_some_and(|(pending_index, _)| *pending_index == index)
            {
                entries.push(pending.next().expect("peeked").1);
                continue;
            }
            let entry: Entry = decode(bytes.value()).map_err(|e| StorageIOError::read_logs(&e))?;
            assert_eq!(
                entry.log_id.index, index,
                "log entry stored under the wrong key"
            );
            entries.push(entry);
        }
        entries.extend(
            pending
                .map(|(_, entry)| entry)
                .filter(|entry| entry.log_id.index < end),
        );
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let overlay = self.overlay();
        Ok(LogState {
            last_purged_log_id: overlay.last_purged,
            last_log_id: overlay.last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let value = encode(vote).expect("encoding plain data cannot fail");
        self.write_and_wait(|done| Write::Meta {
            key: KEY_VOTE,
            value,
            done: Some(done),
        })
        .await
        .map_err(|e| StorageIOError::write_vote(&std::io::Error::other(e)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not needed for safety (Raft re-derives it); it lets a restarted node re-apply what it
        // knows is committed before it hears from a leader. So nobody waits for it.
        let value = encode(&committed).expect("encoding plain data cannot fail");
        self.send(Write::Meta {
            key: KEY_COMMITTED,
            value,
            done: None,
        })
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut encoded = Vec::new();
        LOG_APPEND_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut overlay = self.overlay();
            for entry in entries {
                let bytes = encode(&entry).expect("encoding plain data cannot fail");
                encoded.push((entry.log_id.index, bytes, entry.log_id));
                LOG_ENTRIES_APPENDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Appending at or below the last index overwrites (as a plain insert would); the
                // last log id is that of the highest index present.
                if overlay
                    .last_log_id
                    .is_none_or(|last| last.index <= entry.log_id.index)
                {
                    overlay.last_log_id = Some(entry.log_id);
                }
                overlay.pending.insert(entry.log_id.index, entry);
            }
        }
        self.send(Write::Append {
            entries: encoded,
            callback,
        })
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncating the log from this entry on");
        {
            let mut overlay = self.overlay();
            overlay.pending.retain(|index, _| *index < log_id.index);
            let previous = overlay.pending.keys().next_back().copied();
            overlay.last_log_id = previous.map(|index| overlay.pending[&index].log_id);
        }
        if self.overlay().last_log_id.is_none() {
            // The last surviving entry is in the database (or the log is empty after a purge).
            let last = self.last_durable_before(log_id.index)?;
            let mut overlay = self.overlay();
            overlay.last_log_id = last.or(overlay.last_purged);
        }
        let from_index = log_id.index;
        self.write_and_wait(|done| Write::Truncate { from_index, done })
            .await
            .map_err(|e| StorageIOError::write_logs(&std::io::Error::other(e)).into())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "purging the log up to this entry");
        {
            let mut overlay = self.overlay();
            assert!(
                overlay.last_purged.is_none_or(|p| p.index <= log_id.index),
                "purge must move forward"
            );
            overlay.last_purged = Some(log_id);
            overlay.pending.retain(|index, _| *index > log_id.index);
            if overlay
                .last_log_id
                .is_none_or(|last| last.index < log_id.index)
            {
                overlay.last_log_id = Some(log_id);
            }
        }
        self.write_and_wait(|done| Write::Purge { upto: log_id, done })
            .await
            .map_err(|e| StorageIOError::write_logs(&std::io::Error::other(e)).into())
    }
}

impl LogStore {
    /// The id of the last entry in the database with an index below `below`.
    fn last_durable_before(&self, below: u64) -> Result<Option<LogId>, StorageError> {
        let transaction = self
            .database
            .begin_read()
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let table = transaction
            .open_table(LOGS)
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let last = table
            .range(..below)
            .map_err(|e| StorageIOError::read_logs(&e))?
            .next_back();
        match last {
            None => Ok(None),
            Some(item) => {
                let (_, bytes) = item.map_err(|e| StorageIOError::read_logs(&e))?;
                let entry: Entry =
                    decode(bytes.value()).map_err(|e| StorageIOError::read_logs(&e))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}
