//! The Raft log and vote, durable in a redb database (`DATA_DIR/raft.redb`).
//!
//! **Architecture Invariant:** a vote is on disk before `save_vote` returns, and appended entries
//! are on disk before the flush callback fires (redb commits with `Durability::Immediate`, which
//! fsyncs). That is what lets an acknowledged write survive `kill -9` of every node at once.

use crate::raft_types::{Entry, LogId, NodeId, StorageError, TypeConfig, decode, encode};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader, StorageIOError, Vote};
use redb::{Database, ReadableTable, TableDefinition};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("logs");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_LAST_PURGED: &str = "last_purged";

/// The log store; clones share one database.
#[derive(Clone)]
pub struct LogStore {
    database: Arc<Database>,
}

impl LogStore {
    /// Opens (or creates) the log database at `path`.
    pub fn open(path: &Path) -> Result<LogStore, redb::Error> {
        let database = Database::create(path)?;
        let transaction = database.begin_write()?;
        transaction.open_table(LOGS)?;
        transaction.open_table(META)?;
        transaction.commit()?;
        Ok(LogStore {
            database: Arc::new(database),
        })
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

    fn write_meta<T: serde::Serialize>(&self, key: &str, value: &T) -> Result<(), redb::Error> {
        let bytes = encode(value).expect("encoding plain data cannot fail");
        let transaction = self.database.begin_write()?;
        {
            let mut table = transaction.open_table(META)?;
            table.insert(key, bytes.as_slice())?;
        }
        transaction.commit()?;
        Ok(())
    }

    fn last_entry(&self) -> Result<Option<LogId>, StorageError> {
        let transaction = self
            .database
            .begin_read()
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let table = transaction
            .open_table(LOGS)
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let last = table.last().map_err(|e| StorageIOError::read_logs(&e))?;
        match last {
            None => Ok(None),
            Some((_, bytes)) => {
                let entry: Entry =
                    decode(bytes.value()).map_err(|e| StorageIOError::read_logs(&e))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let transaction = self
            .database
            .begin_read()
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let table = transaction
            .open_table(LOGS)
            .map_err(|e| StorageIOError::read_logs(&e))?;
        let start = match range.start_bound() {
            Bound::Included(&index) => index,
            Bound::Excluded(&index) => index + 1,
            Bound::Unbounded => 0,
        };
        let mut entries = Vec::new();
        for item in table
            .range(start..)
            .map_err(|e| StorageIOError::read_logs(&e))?
        {
            let (index, bytes) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            if !range.contains(&index.value()) {
                break;
            }
            let entry: Entry = decode(bytes.value()).map_err(|e| StorageIOError::read_logs(&e))?;
            assert_eq!(
                entry.log_id.index,
                index.value(),
                "log entry stored under the wrong key"
            );
            entries.push(entry);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.read_meta(KEY_LAST_PURGED)?;
        let last_log_id = self.last_entry()?.or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.write_meta(KEY_VOTE, vote)
            .map_err(|e| StorageIOError::write_vote(&e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not needed for safety (Raft re-derives it); it lets a restarted node re-apply what it
        // knows is committed before it hears from a leader.
        self.write_meta(KEY_COMMITTED, &committed)
            .map_err(|e| StorageIOError::write(&e))?;
        Ok(())
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
        let result = (|| -> Result<(), redb::Error> {
            let transaction = self.database.begin_write()?;
            {
                let mut table = transaction.open_table(LOGS)?;
                for entry in entries {
                    let bytes = encode(&entry).expect("encoding plain data cannot fail");
                    table.insert(entry.log_id.index, bytes.as_slice())?;
                }
            }
            // Durability::Immediate is redb's default: commit returns after fsync.
            transaction.commit()?;
            Ok(())
        })();
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(error) => {
                let io_error = std::io::Error::other(error.to_string());
                let storage_error: StorageError = StorageIOError::write_logs(&error).into();
                callback.log_io_completed(Err(io_error));
                Err(storage_error)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncating the log from this entry on");
        let result = (|| -> Result<(), redb::Error> {
            let transaction = self.database.begin_write()?;
            {
                let mut table = transaction.open_table(LOGS)?;
                table.retain_in(log_id.index.., |_, _| false)?;
            }
            transaction.commit()?;
            Ok(())
        })();
        result.map_err(|e| StorageIOError::write_logs(&e).into())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "purging the log up to this entry");
        let previous: Option<LogId> = self.read_meta(KEY_LAST_PURGED)?;
        assert!(
            previous.is_none_or(|p| p.index <= log_id.index),
            "purge must move forward"
        );
        let result = (|| -> Result<(), redb::Error> {
            let transaction = self.database.begin_write()?;
            {
                let mut meta = transaction.open_table(META)?;
                let bytes = encode(&log_id).expect("encoding plain data cannot fail");
                meta.insert(KEY_LAST_PURGED, bytes.as_slice())?;
                let mut table = transaction.open_table(LOGS)?;
                table.retain_in(..=log_id.index, |_, _| false)?;
            }
            transaction.commit()?;
            Ok(())
        })();
        result.map_err(|e| StorageIOError::write_logs(&e).into())
    }
}
