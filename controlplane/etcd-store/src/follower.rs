//! `Follower`: every member's apply stream. It yields the log in order from a sequence number,
//! exactly once each, by range reads to catch up and a watch on the log prefix once caught up;
//! after a disconnect or a compacted watch it reads again from where it stopped, and when the
//! entries it needs were compacted it yields the snapshot instead.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions, WatchStream};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::keys::prefix_end;
use crate::log::{Entry, EtcdLog, READ_ENTRIES_MAX};
use crate::snapshot::Snapshot;

/// Pause after a failed watch before reading again, so a down etcd is not polled in a loop.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// What to apply next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Entries in order, the first one the one after the last yielded.
    Entries(Vec<Entry>),
    /// Replace the state with this snapshot; entries continue at `seq + 1`.
    Snapshot(Snapshot),
}

/// Yields the log from a sequence number on. Not `Clone`: one per applier.
pub struct Follower {
    log: EtcdLog,
    next_seq: u64,
    /// Open once caught up; `None` means "range-read first".
    watch: Option<WatchStream>,
}

impl Follower {
    /// Follows `log` from `next_seq` (1 for a member that applied nothing).
    pub fn new(log: EtcdLog, next_seq: u64) -> Follower {
        assert!(next_seq >= 1, "sequence numbers start at 1");
        Follower {
            log,
            next_seq,
            watch: None,
        }
    }

    /// The sequence number the next entry yielded will have.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The next entries (or snapshot) to apply, waiting at most `wait` for one to be appended:
    /// `Ok(None)` when none was. An `Err` (etcd unreachable) leaves the follower where it was;
    /// call again to resume.
    pub async fn next(&mut self, wait: Duration) -> Result<Option<Applied>> {
        let deadline = Instant::now() + wait;
        loop {
            if self.watch.is_none()
                && let Some(applied) = self.catch_up().await?
            {
                return Ok(Some(applied));
            }
            let Some(watch) = self.watch.as_mut() else {
                continue;
            };
            let message = match tokio::time::timeout_at(deadline, watch.message()).await {
                Err(_) => return Ok(None),
                Ok(message) => message,
            };
            match message {
                Ok(Some(response)) if response.canceled() || response.compact_revision() > 0 => {
                    // The revision we watched from was compacted (or etcd ended the watch):
                    // range reads find what we missed.
                    tracing::debug!(
                        compact_revision = response.compact_revision(),
                        reason = response.cancel_reason(),
                        "log watch ended; reading again"
                    );
                    self.watch = None;
                }
                Ok(Some(response)) => {
                    let (entries, gap) = self.take_events(response.events());
                    if gap {
                        self.watch = None;
                    }
                    if !entries.is_empty() {
                        return Ok(Some(Applied::Entries(entries)));
                    }
                }
                Ok(None) | Err(_) => {
                    tracing::debug!(next_seq = self.next_seq, "log watch broke; resuming");
                    self.watch = None;
                    if Instant::now() + RETRY_PAUSE >= deadline {
                        return Ok(None);
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Range-reads from `next_seq`. Yields what it found; with nothing new, opens the watch
    /// from just after the revision the read saw, so no append falls between the two.
    async fn catch_up(&mut self) -> Result<Option<Applied>> {
        match self.log.read_from(self.next_seq, READ_ENTRIES_MAX).await {
            Ok(batch) if !batch.entries.is_empty() => {
                let last = batch.entries.last().map(|entry| entry.seq).unwrap_or(0);
                assert_eq!(batch.entries[0].seq, self.next_seq);
                self.next_seq = last + 1;
                Ok(Some(Applied::Entries(batch.entries)))
            }
            Ok(batch) => {
                self.watch = Some(self.open_watch(batch.revision + 1).await?);
                Ok(None)
            }
            Err(Error::Compacted { .. }) => {
                let snapshot = self
                    .log
                    .read_snapshot()
                    .await?
                    .ok_or_else(|| Error::Corrupt {
                        key: self.log.keys().snapshot(),
                        reason: "the log was compacted but no snapshot is stored".into(),
                    })?;
                assert!(
                    snapshot.seq >= self.next_seq,
                    "a compaction below the snapshot"
                );
                self.next_seq = snapshot.seq + 1;
                Ok(Some(Applied::Snapshot(snapshot)))
            }
            Err(error) => Err(error),
        }
    }

    async fn open_watch(&self, start_revision: i64) -> Result<WatchStream> {
        let prefix = self.log.keys().log_prefix();
        let options = WatchOptions::new()
            .with_range(prefix_end(&prefix))
            .with_start_revision(start_revision);
        self.log
            .connection()
            .call_retrying("watch the log", |client| {
                let (prefix, options) = (prefix.clone(), options.clone());
                async move {
                    client
                        .watch_client()
                        .max_decoding_message_size(crate::connection::DECODE_BYTES_MAX)
                        .watch(prefix, Some(options))
                        .await
                }
            })
            .await
    }

    /// The watched puts that continue the log; `gap` when one skipped ahead (the watch is then
    /// dropped and a range read fills the gap). Deletes are compaction and are skipped.
    fn take_events(&mut self, events: &[etcd_client::Event]) -> (Vec<Entry>, bool) {
        let keys = self.log.keys();
        let mut entries = Vec::new();
        for event in events {
            if event.event_type() != EventType::Put {
                continue;
            }
            let Some(kv) = event.kv() else { continue };
            let Some(seq) = keys.log_seq(kv.key()) else {
                continue;
            };
            if seq < self.next_seq {
                continue;
            }
            if seq > self.next_seq {
                return (entries, true);
            }
            entries.push(Entry {
                seq,
                bytes: kv.value().to_vec(),
                revision: kv.create_revision(),
            });
            self.next_seq += 1;
        }
        (entries, false)
    }
}
