//! Snapshots of the applied state in etcd, and compaction of the log under them.
//!
//! A snapshot may be larger than one etcd request (1.5 MiB by default), so its bytes go in
//! chunks `snapshots/<seq>/<index>` first, and only then does one transaction move the
//! `snapshot` pointer to them: a reader sees a complete snapshot or the previous one. The log
//! keys at or below the snapshot's sequence number, and the previous snapshot's chunks, are
//! deleted after the pointer moved.

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use ring::digest::{SHA256, digest};

use crate::connection::DECODE_BYTES_MAX;
use crate::error::{Error, Result};
use crate::keys::{format_seq, parse_seq, prefix_end};
use crate::log::EtcdLog;

/// Bytes of one chunk: a put well under etcd's default `--max-request-bytes` (1.5 MiB).
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// Chunks one snapshot may have: 4 GiB, far past any pool, but a bound a corrupt pointer
/// cannot exceed.
pub const SNAPSHOT_CHUNKS_MAX: u32 = 4096;

/// Chunks one read of a snapshot returns (the answer stays under `DECODE_BYTES_MAX`).
const SNAPSHOT_CHUNKS_PER_READ: i64 = 16;

/// Attempts to read a snapshot whose chunks vanished under the read (etcd compacted the
/// revision it was read at).
const SNAPSHOT_READ_ATTEMPTS_MAX: u32 = 3;

/// A snapshot: the state after applying entries `1..=seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub seq: u64,
    pub bytes: Vec<u8>,
}

/// The value of the `snapshot` key, readable with etcdctl:
/// `seq=<20 digits> chunks=<n> bytes=<n> sha256=<hex>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPointer {
    pub seq: u64,
    pub chunks: u32,
    pub bytes: u64,
    pub sha256: String,
}

impl SnapshotPointer {
    fn of(seq: u64, bytes: &[u8]) -> SnapshotPointer {
        SnapshotPointer {
            seq,
            chunks: bytes.len().div_ceil(SNAPSHOT_CHUNK_BYTES).max(1) as u32,
            bytes: bytes.len() as u64,
            sha256: hex(digest(&SHA256, bytes).as_ref()),
        }
    }

    pub fn encode(&self) -> String {
        format!(
            "seq={} chunks={} bytes={} sha256={}",
            format_seq(self.seq),
            self.chunks,
            self.bytes,
            self.sha256
        )
    }

    pub fn parse(key: &str, value: &[u8]) -> Result<SnapshotPointer> {
        let corrupt = |reason: &str| Error::Corrupt {
            key: key.to_string(),
            reason: format!("{reason} in {:?}", String::from_utf8_lossy(value)),
        };
        let text = std::str::from_utf8(value).map_err(|_| corrupt("not UTF-8"))?;
        let mut fields = text.split(' ').map(|field| field.split_once('='));
        let mut next = |name: &str| match fields.next() {
            Some(Some((found, value))) if found == name => Ok(value),
            _ => Err(corrupt(&format!("no {name}="))),
        };
        let seq = parse_seq(next("seq")?.as_bytes()).ok_or_else(|| corrupt("bad seq"))?;
        let chunks: u32 = next("chunks")?.parse().map_err(|_| corrupt("bad chunks"))?;
        let bytes: u64 = next("bytes")?.parse().map_err(|_| corrupt("bad bytes"))?;
        let sha256 = next("sha256")?.to_string();
        if chunks == 0 || chunks > SNAPSHOT_CHUNKS_MAX || sha256.len() != 64 {
            return Err(corrupt("chunk count or digest out of range"));
        }
        Ok(SnapshotPointer {
            seq,
            chunks,
            bytes,
            sha256,
        })
    }
}

/// The pointer to a snapshot of `bytes` covering entries `1..=seq`, if it fits the chunk limit.
fn snapshot_pointer_of(seq: u64, bytes: &[u8]) -> Result<SnapshotPointer> {
    let pointer = SnapshotPointer::of(seq, bytes);
    if pointer.chunks > SNAPSHOT_CHUNKS_MAX {
        return Err(Error::TooLarge {
            what: "a snapshot's bytes",
            size: bytes.len(),
            limit: SNAPSHOT_CHUNKS_MAX as usize * SNAPSHOT_CHUNK_BYTES,
        });
    }
    Ok(pointer)
}

impl EtcdLog {
    /// Writes the chunks of the snapshot at `seq` (invisible until its pointer names them). An
    /// empty snapshot still has its one (empty) chunk.
    async fn write_snapshot_chunks(&self, seq: u64, bytes: &[u8]) -> Result<()> {
        let chunks: Vec<&[u8]> = if bytes.is_empty() {
            vec![&[]]
        } else {
            bytes.chunks(SNAPSHOT_CHUNK_BYTES).collect()
        };
        for (index, chunk) in chunks.into_iter().enumerate() {
            let key = self.keys().snapshot_chunk(seq, index as u32);
            self.connection()
                .call_retrying("write a snapshot chunk", |mut client| {
                    let (key, chunk) = (key.clone(), chunk.to_vec());
                    async move { client.put(key, chunk, None).await }
                })
                .await?;
        }
        Ok(())
    }

    /// Stores `bytes` as the snapshot covering entries `1..=seq`, then deletes those log keys
    /// and the previous snapshot. Returns `false` (and stores nothing) when a snapshot at `seq`
    /// or later is already there. `seq` must be appended already.
    pub async fn put_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<bool> {
        let cluster_id = self.claimed()?.to_string();
        assert!(seq >= 1, "a snapshot covers at least entry 1");
        let pointer = snapshot_pointer_of(seq, bytes)?;
        let head = self.head().await?;
        assert!(
            seq <= head.seq,
            "a snapshot at {seq} past the log's head {}",
            head.seq
        );
        let (current, current_revision, _) = self.snapshot_pointer().await?;
        if current.as_ref().is_some_and(|current| current.seq >= seq) {
            return Ok(false);
        }
        let keys = self.keys().clone();
        // Chunks first: the pointer below makes them visible only once all are written.
        self.write_snapshot_chunks(seq, bytes).await?;
        let txn = Txn::new()
            .when([
                Compare::value(keys.cluster(), CompareOp::Equal, cluster_id),
                Compare::mod_revision(keys.snapshot(), CompareOp::Equal, current_revision),
            ])
            .and_then([TxnOp::put(keys.snapshot(), pointer.encode(), None)]);
        let mut moved = self
            .connection()
            .call_retrying("move the snapshot pointer", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?
            .succeeded();
        if !moved {
            // A retried transaction whose first try committed fails its comparison: look.
            moved = self.snapshot_pointer().await?.0.as_ref() == Some(&pointer);
        }
        if !moved {
            // Another member stored a snapshot meanwhile: drop our chunks, keep theirs.
            self.delete_prefix("delete unused snapshot chunks", keys.snapshot_chunks(seq))
                .await?;
            return Ok(false);
        }
        tracing::info!(
            seq,
            bytes = bytes.len(),
            chunks = pointer.chunks,
            "stored a snapshot in etcd"
        );
        if let Some(previous) = current {
            self.delete_prefix(
                "delete the previous snapshot",
                keys.snapshot_chunks(previous.seq),
            )
            .await?;
        }
        self.compact_log(seq).await?;
        Ok(true)
    }

    /// Starts the log of a new pool at a snapshot: stores `bytes` as the snapshot covering
    /// entries `1..=seq` and moves the head to `seq`, so the first append is `seq + 1` and every
    /// member loads this snapshot before anything else (`read_from` says `Error::Compacted` for
    /// the numbers under it). Only into a claimed prefix with no head and no snapshot yet
    /// (`Error::NotEmpty` otherwise, with nothing visible written): this is how an exported pool
    /// is imported (vgpu-cp's `transfer`).
    pub async fn install_first_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<()> {
        let cluster_id = self.claimed()?.to_string();
        assert!(seq >= 1, "a snapshot covers at least entry 1");
        let pointer = snapshot_pointer_of(seq, bytes)?;
        let keys = self.keys().clone();
        let not_empty = |what: &str| Error::NotEmpty {
            prefix: keys.prefix().to_string(),
            what: what.to_string(),
        };
        let (current, _, _) = self.snapshot_pointer().await?;
        if current.is_some() {
            return Err(not_empty("a snapshot"));
        }
        let head = self.head().await?.seq;
        if head > 0 {
            return Err(not_empty(&format!("a log of {head} entries")));
        }
        self.write_snapshot_chunks(seq, bytes).await?;
        // The pointer and the head together, only where neither exists: a reader sees no pool
        // or the whole imported one, and a log started meanwhile is never overwritten.
        let txn = Txn::new()
            .when([
                Compare::value(keys.cluster(), CompareOp::Equal, cluster_id),
                Compare::create_revision(keys.snapshot(), CompareOp::Equal, 0),
                Compare::create_revision(keys.head(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(keys.snapshot(), pointer.encode(), None),
                TxnOp::put(keys.head(), format_seq(seq), None),
            ]);
        let installed = self
            .connection()
            .call_retrying("install the first snapshot", |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await?
            .succeeded();
        // A retried transaction whose first try committed fails its comparison: look.
        let (found, _, _) = self.snapshot_pointer().await?;
        if !installed && found.as_ref() != Some(&pointer) {
            // Another writer started a log or stored a snapshot meanwhile: keep theirs.
            self.delete_prefix("delete unused snapshot chunks", keys.snapshot_chunks(seq))
                .await?;
            return Err(not_empty("a log or a snapshot written meanwhile"));
        }
        let head = self.head().await?;
        assert_eq!(head.seq, seq, "the head starts at the first snapshot");
        tracing::info!(
            seq,
            bytes = bytes.len(),
            "installed the first snapshot in etcd"
        );
        Ok(())
    }

    /// How many keys the prefix holds (every key this crate writes is under it): 0 for a prefix
    /// no pool ever used.
    pub async fn count_keys(&self) -> Result<i64> {
        let prefix = self.keys().prefix().to_string();
        let response = self
            .connection()
            .call_retrying("count the keys under the prefix", |mut client| {
                let options = GetOptions::new()
                    .with_range(prefix_end(&prefix))
                    .with_count_only();
                let prefix = prefix.clone();
                async move { client.get(prefix, Some(options)).await }
            })
            .await?;
        let count = response.count();
        assert!(count >= 0, "etcd counts keys from zero");
        Ok(count)
    }

    /// The cluster id the prefix was claimed for, without claiming it (`None`: never claimed).
    pub async fn stored_cluster_id(&self) -> Result<Option<String>> {
        let key = self.keys().cluster();
        let response = self
            .connection()
            .call_retrying("read the cluster key", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        Ok(response
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    /// Deletes log keys `1..=seq`. Only below a stored snapshot: readers behind it load that.
    async fn compact_log(&self, seq: u64) -> Result<()> {
        let keys = self.keys().clone();
        let from = keys.log(1);
        let to = keys.log(seq + 1);
        self.connection()
            .call_retrying("compact the log", |mut client| {
                let (from, to) = (from.clone(), to.clone());
                async move {
                    client
                        .delete(from, Some(DeleteOptions::new().with_range(to)))
                        .await
                }
            })
            .await?;
        Ok(())
    }

    async fn delete_prefix(&self, operation: &'static str, prefix: String) -> Result<()> {
        let end = prefix_end(&prefix);
        self.connection()
            .call_retrying(operation, |mut client| {
                let (prefix, end) = (prefix.clone(), end.clone());
                async move {
                    client
                        .delete(prefix, Some(DeleteOptions::new().with_range(end)))
                        .await
                }
            })
            .await?;
        Ok(())
    }

    /// The current pointer (if any), the `snapshot` key's mod revision (0 if absent), and the
    /// revision the read saw.
    async fn snapshot_pointer(&self) -> Result<(Option<SnapshotPointer>, i64, i64)> {
        let key = self.keys().snapshot();
        let response = self
            .connection()
            .call_retrying("read the snapshot pointer", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        let read_at = response
            .header()
            .map(|header| header.revision())
            .unwrap_or(0);
        match response.kvs().first() {
            None => Ok((None, 0, read_at)),
            Some(kv) => Ok((
                Some(SnapshotPointer::parse(&key, kv.value())?),
                kv.mod_revision(),
                read_at,
            )),
        }
    }

    /// The newest snapshot, checked against its pointer's size and digest; `None` if none was
    /// stored.
    pub async fn read_snapshot(&self) -> Result<Option<Snapshot>> {
        let mut last_error = None;
        for _ in 0..SNAPSHOT_READ_ATTEMPTS_MAX {
            // The chunks are read at the revision the pointer was read at, not at the pointer's
            // own (older) mod revision: etcd may have compacted that one long ago, and at the
            // read's revision the pointer's chunks still exist (they go only after it moves).
            let (pointer, _, revision) = self.snapshot_pointer().await?;
            let Some(pointer) = pointer else {
                return Ok(None);
            };
            match self.read_chunks(&pointer, revision).await {
                Ok(snapshot) => return Ok(Some(snapshot)),
                // Read at an old revision that etcd compacted: read the pointer again.
                Err(error @ Error::Rejected { .. }) => last_error = Some(error),
                Err(error) => return Err(error),
            }
        }
        Err(last_error.expect("the loop ran at least once"))
    }

    async fn read_chunks(&self, pointer: &SnapshotPointer, revision: i64) -> Result<Snapshot> {
        let keys = self.keys().clone();
        let end = prefix_end(&keys.snapshot_chunks(pointer.seq));
        let mut bytes = Vec::with_capacity(pointer.bytes.min(1 << 30) as usize);
        let mut from = keys.snapshot_chunk(pointer.seq, 0);
        let mut chunks = 0u32;
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_revision(revision)
                .with_limit(SNAPSHOT_CHUNKS_PER_READ)
                .with_sort(SortTarget::Key, SortOrder::Ascend);
            let response = self
                .connection()
                .call_retrying("read a snapshot", |client| {
                    let (start, options) = (from.clone(), options.clone());
                    async move {
                        client
                            .kv_client()
                            .max_decoding_message_size(DECODE_BYTES_MAX)
                            .get(start, Some(options))
                            .await
                    }
                })
                .await?;
            for kv in response.kvs() {
                let expected = keys.snapshot_chunk(pointer.seq, chunks);
                if kv.key() != expected.as_bytes() {
                    return Err(Error::Corrupt {
                        key: expected,
                        reason: "chunk missing".into(),
                    });
                }
                bytes.extend_from_slice(kv.value());
                chunks += 1;
                if chunks > pointer.chunks {
                    break;
                }
            }
            if !response.more() || chunks >= pointer.chunks {
                break;
            }
            from = keys.snapshot_chunk(pointer.seq, chunks);
        }
        let found = SnapshotPointer::of(pointer.seq, &bytes);
        if chunks != pointer.chunks || found != *pointer {
            return Err(Error::Corrupt {
                key: keys.snapshot(),
                reason: format!(
                    "the chunks give {chunks} chunks, {} bytes, sha256 {}; the pointer says {}",
                    found.bytes,
                    found.sha256,
                    pointer.encode()
                ),
            });
        }
        Ok(Snapshot {
            seq: pointer.seq,
            bytes,
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_round_trip_and_refuse_garbage() {
        let pointer = SnapshotPointer::of(12, &vec![7u8; SNAPSHOT_CHUNK_BYTES + 1]);
        assert_eq!(pointer.chunks, 2);
        let encoded = pointer.encode();
        assert_eq!(
            SnapshotPointer::parse("k", encoded.as_bytes()).ok(),
            Some(pointer)
        );
        assert!(SnapshotPointer::parse("k", b"seq=12 chunks=1").is_err());
        assert!(SnapshotPointer::parse("k", b"").is_err());
        assert_eq!(SnapshotPointer::of(1, &[]).chunks, 1);
    }
}
