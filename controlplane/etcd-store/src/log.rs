//! `EtcdLog`: the command log as keys `<prefix>log/<seq>`, appended by transactions that cannot
//! fork, plus the cluster identity key and linearizable reads of the head.
//!
//! An append compares the `head` key's mod revision with the one it read (and that the next
//! key is absent), so of two writers that read the same head exactly one commits; the other
//! finds the new head in its transaction's else branch and tries again after it.

use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};

use tokio::time::Instant;

use crate::connection::{Connection, DECODE_BYTES_MAX, EtcdConfig, RETRY_PAUSE};
use crate::error::{Error, Result};
use crate::keys::{Keys, format_seq, parse_seq, prefix_end};
use crate::snapshot::SnapshotPointer;

/// Entries one append may carry: etcd refuses a transaction past `--max-txn-ops` (128 by
/// default), and each entry is one put besides the head's put and the comparisons.
pub const APPEND_ENTRIES_MAX: usize = 64;

/// Bytes one append may carry, all entries together: under etcd's default
/// `--max-request-bytes` (1.5 MiB) with room for keys and comparisons. vgpu-cp's largest entry
/// (`ENTRY_BYTES_MAX`, 1 MiB) fits.
pub const APPEND_BYTES_MAX: usize = 1_400_000;

/// Attempts of one append against other writers before `Error::Contended`. Each lost attempt
/// means another writer's append committed, so the log made progress meanwhile.
pub const APPEND_ATTEMPTS_MAX: u32 = 32;

/// The longest pause after a lost race. Pauses are random, growing with each loss up to this:
/// without them a writer whose round trip is longer (its etcd member forwards to etcd's leader)
/// loses every race to a faster one that appends back to back, and starves.
const CONTENDED_PAUSE_MAX: Duration = Duration::from_millis(64);

/// Entries one `read_from` returns at most.
pub const READ_ENTRIES_MAX: usize = 64;

/// One log entry: its sequence number (from 1, dense) and the bytes appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub bytes: Vec<u8>,
    /// The etcd revision of the transaction that appended it.
    pub revision: i64,
}

/// The head of the log: the last sequence number appended (0 for an empty log) and the etcd
/// revision of the `head` key's last change (0 before the first append).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub seq: u64,
    pub mod_revision: i64,
}

/// Entries read at one etcd revision.
#[derive(Debug, Clone)]
pub struct ReadBatch {
    /// Dense, ascending, starting at the requested sequence number; empty when the log ends
    /// before it.
    pub entries: Vec<Entry>,
    /// The etcd revision the read saw; a watch from `revision + 1` misses nothing after it.
    pub revision: i64,
    pub head: Head,
}

/// A leader-only write's condition: the create revision of the `leader` key when this member
/// created it. A deposed leader's key is gone or re-created, so the comparison fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    pub leader_revision: i64,
}

/// The log of one cluster under one prefix. Clones share the connection.
#[derive(Clone)]
pub struct EtcdLog {
    connection: Connection,
    cluster_id: Option<String>,
    /// The head as of this member's last append or read, shared by clones: an append starts
    /// from it instead of reading the head first (one round trip instead of two). When another
    /// writer moved the head since, the transaction fails and its else branch brings the new one.
    head_seen: Arc<Mutex<Option<Head>>>,
}

impl EtcdLog {
    /// Connects and checks a quorum answers; see `Connection::connect` for the bounds.
    pub async fn connect(config: &EtcdConfig) -> Result<EtcdLog> {
        Ok(EtcdLog::new(Connection::connect(config).await?))
    }

    pub fn new(connection: Connection) -> EtcdLog {
        EtcdLog {
            connection,
            cluster_id: None,
            head_seen: Arc::default(),
        }
    }

    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    pub fn keys(&self) -> &Keys {
        self.connection.keys()
    }

    /// Claims the prefix for `cluster_id`, or checks that it is already this cluster's.
    /// A prefix that holds another cluster is refused with `Error::OtherCluster`.
    pub async fn claim_cluster(&mut self, cluster_id: &str) -> Result<()> {
        assert!(!cluster_id.is_empty(), "a cluster id is never empty");
        let key = self.keys().cluster();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), cluster_id, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        // Safe to repeat: a retry of a claim that committed finds this cluster's own id.
        let response = self
            .connection
            .call_retrying("claim the cluster prefix", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?;
        if !response.succeeded() {
            let found = first_kv(&response.op_responses())
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                .unwrap_or_default();
            if found != cluster_id {
                return Err(Error::OtherCluster {
                    prefix: self.keys().prefix().to_string(),
                    found,
                    expected: cluster_id.to_string(),
                });
            }
        }
        tracing::info!(
            prefix = self.keys().prefix(),
            cluster_id,
            "claimed the etcd prefix"
        );
        self.cluster_id = Some(cluster_id.to_string());
        Ok(())
    }

    /// The head as of now: a linearizable read, so an entry acknowledged to anyone before this
    /// call is at or below it. A linearizable read of the pool is this, then waiting until the
    /// member has applied up to `seq`.
    pub async fn head(&self) -> Result<Head> {
        let key = self.keys().head();
        let response = self
            .connection
            .call_retrying("read the log head", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        let head = self.parse_head(response.kvs().first())?;
        self.see_head(head);
        Ok(head)
    }

    fn seen_head(&self) -> Option<Head> {
        *self
            .head_seen
            .lock()
            .expect("the head lock is never poisoned")
    }

    /// Remembers `head` unless a later one was seen already (answers can arrive out of order).
    fn see_head(&self, head: Head) {
        let mut seen = self
            .head_seen
            .lock()
            .expect("the head lock is never poisoned");
        if seen.is_none_or(|seen| seen.mod_revision < head.mod_revision) {
            *seen = Some(head);
        }
    }

    /// Appends `entries` after the current head and returns their sequence numbers. Never forks:
    /// each entry gets a number no other append got. When a transaction's answer is lost, the
    /// next attempt first looks whether it committed (its entries at its numbers, written by
    /// one transaction), so a retry does not append twice. Tries start only within the retry
    /// window (`Connection::retry_window`) of the append's start.
    /// On `Error::Unavailable` the outcome is unknown: the last transaction may still commit
    /// (etcd may hold it in its own log and commit it once its quorum returns).
    pub async fn append(&self, entries: &[Vec<u8>]) -> Result<RangeInclusive<u64>> {
        self.append_inner(entries, None).await
    }

    /// `append`, only while `fence`'s leadership lasts: etcd checks it in the same transaction,
    /// so a deposed leader's append fails with `Error::Deposed` and writes nothing.
    pub async fn append_fenced(
        &self,
        entries: &[Vec<u8>],
        fence: Fence,
    ) -> Result<RangeInclusive<u64>> {
        assert!(fence.leader_revision > 0, "a fence is a real revision");
        self.append_inner(entries, Some(fence)).await
    }

    async fn append_inner(
        &self,
        entries: &[Vec<u8>],
        fence: Option<Fence>,
    ) -> Result<RangeInclusive<u64>> {
        let cluster_id = self.claimed()?;
        check_append_size(entries)?;
        let started = Instant::now();
        let mut head = match self.seen_head() {
            Some(head) => head,
            None => self.head().await?,
        };
        // The first sequence numbers of attempts whose answer was lost: each may have committed.
        let mut unknown: Vec<u64> = Vec::new();
        for attempt in 1..=APPEND_ATTEMPTS_MAX {
            if let Some(seqs) = self.find_own_append(&unknown, head, entries).await? {
                return Ok(seqs);
            }
            let first = head.seq + 1;
            let last = head.seq + entries.len() as u64;
            let txn = self.append_txn(cluster_id, head, entries, fence);
            let answer = self
                .connection
                .call("append to the log", |mut client| async move {
                    client.txn(txn).await
                })
                .await;
            let response = match answer {
                Ok(response) => response,
                Err(error @ Error::Unavailable { .. }) => {
                    unknown.push(first);
                    // Another try only within the retry window (`Connection::retry_window`).
                    if Instant::now() + RETRY_PAUSE >= started + self.connection.retry_window() {
                        return Err(error);
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                    // The same head again: if the lost try committed, this one's comparison
                    // fails and its else branch shows it (no extra read that could hang too).
                    continue;
                }
                Err(error) => return Err(error),
            };
            if response.succeeded() {
                assert!(first <= last);
                // The transaction wrote the head at its own revision.
                if let Some(header) = response.header() {
                    self.see_head(Head {
                        seq: last,
                        mod_revision: header.revision(),
                    });
                }
                tracing::debug!(first, last, attempt, "appended");
                return Ok(first..=last);
            }
            // The else branch read the cluster key, the head and (fenced) the leader key.
            let reads = response.op_responses();
            let kvs: Vec<Option<&KeyValue>> = reads.iter().map(get_kv).collect();
            self.check_cluster(cluster_id, kvs.first().copied().flatten())?;
            let new_head = self.parse_head(kvs.get(1).copied().flatten())?;
            // An earlier attempt whose answer was lost may be what moved the head: then it is
            // written, whatever this attempt found (even a leadership that ended since).
            if let Some(seqs) = self.find_own_append(&unknown, new_head, entries).await? {
                return Ok(seqs);
            }
            if let Some(fence) = fence {
                let leader = kvs.get(2).copied().flatten();
                if leader.map(KeyValue::create_revision) != Some(fence.leader_revision) {
                    return Err(Error::Deposed {
                        revision: fence.leader_revision,
                    });
                }
            }
            if new_head == head && unknown.is_empty() {
                // Only the next key's absence failed: someone wrote a log key without the head.
                return Err(Error::Corrupt {
                    key: self.keys().log(head.seq + 1),
                    reason: format!("present although the head is {}", head.seq),
                });
            }
            tracing::debug!(attempt, seen = head.seq, now = new_head.seq, "append raced");
            self.see_head(new_head);
            head = new_head;
            tokio::time::sleep(contended_pause(attempt)).await;
        }
        if !unknown.is_empty() {
            // Out of attempts with answers lost on the way: `Contended` would claim that nothing
            // was written, which only holds if none of those attempts committed.
            let head = self.head().await?;
            if let Some(seqs) = self.find_own_append(&unknown, head, entries).await? {
                return Ok(seqs);
            }
            return Err(self.connection.unavailable(
                "append to the log",
                format!(
                    "{} of its attempts lost their answers; one may still commit",
                    unknown.len()
                ),
            ));
        }
        Err(Error::Contended {
            attempts: APPEND_ATTEMPTS_MAX,
        })
    }

    /// The numbers of an earlier attempt of this append that committed after all: starting at
    /// one of `firsts`, the entries equal ours byte for byte and were written at one etcd
    /// revision that neither neighbour shares (one transaction of exactly these entries).
    async fn find_own_append(
        &self,
        firsts: &[u64],
        head: Head,
        entries: &[Vec<u8>],
    ) -> Result<Option<RangeInclusive<u64>>> {
        let count = entries.len() as u64;
        for &first in firsts {
            let last = first + count - 1;
            if last > head.seq {
                continue;
            }
            let from = first.saturating_sub(1).max(1);
            let batch = match self.read_from(from, count as usize + 2).await {
                Ok(batch) => batch,
                // Already under a snapshot: too old to be the attempt still in question.
                Err(Error::Compacted { .. }) => continue,
                Err(error) => return Err(error),
            };
            let ours: Vec<&Entry> = batch
                .entries
                .iter()
                .filter(|entry| (first..=last).contains(&entry.seq))
                .collect();
            let Some(revision) = ours.first().map(|entry| entry.revision) else {
                continue;
            };
            let same = ours.len() == entries.len()
                && ours
                    .iter()
                    .zip(entries)
                    .all(|(entry, bytes)| entry.revision == revision && entry.bytes == *bytes);
            let neighbours_differ = batch
                .entries
                .iter()
                .filter(|entry| !(first..=last).contains(&entry.seq))
                .all(|entry| entry.revision != revision);
            if same && neighbours_differ {
                tracing::info!(first, last, "an append whose answer was lost had committed");
                return Ok(Some(first..=last));
            }
        }
        Ok(None)
    }

    fn append_txn(
        &self,
        cluster_id: &str,
        head: Head,
        entries: &[Vec<u8>],
        fence: Option<Fence>,
    ) -> Txn {
        let keys = self.keys();
        let last = head.seq + entries.len() as u64;
        let mut compares = vec![
            Compare::value(keys.cluster(), CompareOp::Equal, cluster_id),
            Compare::mod_revision(keys.head(), CompareOp::Equal, head.mod_revision),
            Compare::create_revision(keys.log(head.seq + 1), CompareOp::Equal, 0),
        ];
        let mut otherwise = vec![
            TxnOp::get(keys.cluster(), None),
            TxnOp::get(keys.head(), None),
        ];
        if let Some(fence) = fence {
            compares.push(Compare::create_revision(
                keys.leader(),
                CompareOp::Equal,
                fence.leader_revision,
            ));
            otherwise.push(TxnOp::get(keys.leader(), None));
        }
        let mut puts: Vec<TxnOp> = entries
            .iter()
            .zip(head.seq + 1..)
            .map(|(bytes, seq)| TxnOp::put(keys.log(seq), bytes.clone(), None))
            .collect();
        puts.push(TxnOp::put(keys.head(), format_seq(last), None));
        Txn::new().when(compares).and_then(puts).or_else(otherwise)
    }

    /// Up to `limit` (at most `READ_ENTRIES_MAX`) entries from `seq` on, with the head and the
    /// revision, all read at one revision. `Error::Compacted` when `seq` is under a snapshot.
    pub async fn read_from(&self, seq: u64, limit: usize) -> Result<ReadBatch> {
        assert!(seq >= 1, "sequence numbers start at 1");
        let limit = limit.clamp(1, READ_ENTRIES_MAX);
        let keys = self.keys();
        let range = GetOptions::new()
            .with_range(prefix_end(&keys.log_prefix()))
            .with_limit(limit as i64)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        // No comparison: the "then" branch always runs, and all three reads see one revision.
        let txn = Txn::new().and_then([
            TxnOp::get(keys.log(seq), Some(range)),
            TxnOp::get(keys.head(), None),
            TxnOp::get(keys.snapshot(), None),
        ]);
        let response = self
            .connection
            .call_retrying("read the log", |client| {
                let txn = txn.clone();
                async move {
                    client
                        .kv_client()
                        .max_decoding_message_size(DECODE_BYTES_MAX)
                        .txn(txn)
                        .await
                }
            })
            .await?;
        let revision = response
            .header()
            .map(|header| header.revision())
            .unwrap_or(0);
        let reads = response.op_responses();
        let head = self.parse_head(reads.get(1).and_then(get_kv))?;
        let snapshot = match reads.get(2).and_then(get_kv) {
            Some(kv) => Some(SnapshotPointer::parse(&keys.snapshot(), kv.value())?),
            None => None,
        };
        let mut entries = Vec::new();
        if let Some(TxnOpResponse::Get(range)) = reads.first() {
            for kv in range.kvs() {
                let key_seq = keys.log_seq(kv.key()).ok_or_else(|| Error::Corrupt {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    reason: "not a log key under the log prefix".into(),
                })?;
                let expected = seq + entries.len() as u64;
                if key_seq != expected {
                    break;
                }
                entries.push(Entry {
                    seq: key_seq,
                    bytes: kv.value().to_vec(),
                    revision: kv.create_revision(),
                });
            }
        }
        if entries.is_empty() && seq <= head.seq {
            // The entry exists in the numbering but not as a key: compacted under a snapshot.
            let snapshot_seq = snapshot.map(|pointer| pointer.seq).unwrap_or(0);
            if seq <= snapshot_seq {
                return Err(Error::Compacted { seq, snapshot_seq });
            }
            return Err(Error::Corrupt {
                key: keys.log(seq),
                reason: format!(
                    "missing although the head is {} and no snapshot covers it",
                    head.seq
                ),
            });
        }
        assert!(entries.iter().all(|entry| entry.seq <= head.seq));
        Ok(ReadBatch {
            entries,
            revision,
            head,
        })
    }

    pub(crate) fn claimed(&self) -> Result<&str> {
        self.cluster_id.as_deref().ok_or_else(|| Error::Unclaimed {
            prefix: self.keys().prefix().to_string(),
        })
    }

    pub(crate) fn check_cluster(&self, cluster_id: &str, kv: Option<&KeyValue>) -> Result<()> {
        let found = kv
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
            .unwrap_or_default();
        if found == cluster_id {
            return Ok(());
        }
        Err(Error::OtherCluster {
            prefix: self.keys().prefix().to_string(),
            found: if found.is_empty() {
                "(none: the prefix was wiped)".into()
            } else {
                found
            },
            expected: cluster_id.to_string(),
        })
    }

    fn parse_head(&self, kv: Option<&KeyValue>) -> Result<Head> {
        let Some(kv) = kv else {
            return Ok(Head {
                seq: 0,
                mod_revision: 0,
            });
        };
        let seq = parse_seq(kv.value()).ok_or_else(|| Error::Corrupt {
            key: self.keys().head(),
            reason: format!(
                "{:?} is not a sequence number",
                String::from_utf8_lossy(kv.value())
            ),
        })?;
        assert!(kv.mod_revision() > 0);
        Ok(Head {
            seq,
            mod_revision: kv.mod_revision(),
        })
    }
}

/// A random pause in `[0, min(2^attempt ms, CONTENDED_PAUSE_MAX))`.
fn contended_pause(attempt: u32) -> Duration {
    use rand::Rng as _;
    let ceiling = Duration::from_millis(1 << attempt.min(16)).min(CONTENDED_PAUSE_MAX);
    rand::thread_rng().gen_range(Duration::ZERO..ceiling)
}

fn check_append_size(entries: &[Vec<u8>]) -> Result<()> {
    assert!(!entries.is_empty(), "an append carries at least one entry");
    if entries.len() > APPEND_ENTRIES_MAX {
        return Err(Error::TooLarge {
            what: "an append's entry count",
            size: entries.len(),
            limit: APPEND_ENTRIES_MAX,
        });
    }
    let bytes: usize = entries.iter().map(Vec::len).sum();
    if bytes > APPEND_BYTES_MAX {
        return Err(Error::TooLarge {
            what: "an append's bytes",
            size: bytes,
            limit: APPEND_BYTES_MAX,
        });
    }
    Ok(())
}

/// The first key of a get, `None` when the key is absent or the op was not a get.
pub(crate) fn get_kv(response: &TxnOpResponse) -> Option<&KeyValue> {
    match response {
        TxnOpResponse::Get(get) => get.kvs().first(),
        _ => None,
    }
}

fn first_kv(responses: &[TxnOpResponse]) -> Option<&KeyValue> {
    responses.first().and_then(get_kv)
}
