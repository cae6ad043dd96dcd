//! The log entry of the etcd store (issue 20, `controlplane/etcd-store`): what vgpu-cp will write
//! as the bytes of one `<prefix>log/<seq>` key, and how a member applies it to `PoolState`.
//!
//! Not used yet: vgpu-cp runs on the Raft store only until the etcd path works end to end
//! (`docs/design/etcd-store.md`, "The plan for vgpu-cp"). It lives here, not in `etcd-store`,
//! because it knows `Command` and `PoolState`, which that crate must not.
//!
//! On the Raft store an entry's leadership (`EntryLeader`) comes from openraft's log id. etcd has
//! no terms, so the entry says itself which leadership appended it (`fence`: the create revision
//! of the `leader` key), and the appending member guarantees it by appending such an entry only
//! with `EtcdLog::append_fenced` on that same fence: etcd then committed it only while that
//! leadership lasted. `apply_etcd_entry` checks what it can check deterministically (a fence is
//! older than the entry's own revision) and otherwise applies exactly as the Raft store does.

use serde::{Deserialize, Serialize};

use crate::pool::{Command, CommandResult, EntryLeader, PoolState};
use crate::raft_types::{NodeId, decode, encode};

/// The entry encoding's version, first in every entry so a later format can be told apart.
pub const ETCD_ENTRY_FORMAT: u32 = 1;

/// One entry of the etcd log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EtcdEntry {
    pub format_version: u32,
    /// The member that appended it: with `batch`, how that member finds the results of its own
    /// writes among the applied entries without racing its apply task.
    pub origin: NodeId,
    /// The appending member's batch number, increasing per member.
    pub batch: u64,
    /// The leadership (the `leader` key's create revision) whose fenced append carried this
    /// entry; `None` for an unfenced append, in which leader decisions are refused.
    pub fence: Option<i64>,
    /// A `Command::Batch`, as the Raft store's entries carry.
    pub command: Command,
}

/// Why an entry's bytes cannot be applied. The apply task stops at such an entry: applying
/// around it would make this member's state differ from the others'.
#[derive(Debug, thiserror::Error)]
pub enum EtcdEntryError {
    #[error(
        "etcd log entry {seq} does not decode ({reason}): it was not written by this vgpu-cp \
         version or the key was changed outside vgpu-cp; restore the prefix from a backup or \
         upgrade this member"
    )]
    Undecodable { seq: u64, reason: String },
    #[error(
        "etcd log entry {seq} has format {found}, newer than this member's {ETCD_ENTRY_FORMAT}: \
         upgrade this member"
    )]
    NewerFormat { seq: u64, found: u32 },
}

impl EtcdEntry {
    pub fn new(origin: NodeId, batch: u64, fence: Option<i64>, command: Command) -> EtcdEntry {
        assert!(
            matches!(command, Command::Batch(_)),
            "etcd entries carry batches, as Raft entries do"
        );
        assert!(
            fence.is_none_or(|fence| fence > 0),
            "a fence is a real revision"
        );
        EtcdEntry {
            format_version: ETCD_ENTRY_FORMAT,
            origin,
            batch,
            fence,
            command,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        assert_eq!(self.format_version, ETCD_ENTRY_FORMAT);
        encode(self).expect("encoding plain data cannot fail")
    }

    /// Decodes entry `seq`; the version is checked first, so a newer format is named as such.
    pub fn decode(seq: u64, bytes: &[u8]) -> Result<EtcdEntry, EtcdEntryError> {
        let undecodable = |error: bincode::error::DecodeError| EtcdEntryError::Undecodable {
            seq,
            reason: error.to_string(),
        };
        let (format_version, _): (u32, usize) =
            bincode::serde::decode_from_slice(bytes, bincode::config::standard())
                .map_err(undecodable)?;
        if format_version > ETCD_ENTRY_FORMAT {
            return Err(EtcdEntryError::NewerFormat {
                seq,
                found: format_version,
            });
        }
        let entry: EtcdEntry = decode(bytes).map_err(undecodable)?;
        if !matches!(entry.command, Command::Batch(_)) {
            return Err(EtcdEntryError::Undecodable {
                seq,
                reason: "its command is not a batch".into(),
            });
        }
        Ok(entry)
    }

    /// The leadership that appended this entry, as `PoolState::apply_entry` takes it. `revision`
    /// is the etcd revision the entry was written at (the same on every member): a fence can
    /// only be older than the write it fenced, so a fence that is not counts as none.
    pub fn appended_by(&self, revision: i64) -> EntryLeader {
        match self.fence {
            Some(fence) if fence > 0 && fence < revision => EntryLeader {
                term: fence as u64,
                leader: self.origin,
            },
            _ => EntryLeader::default(),
        }
    }
}

/// Applies entry `seq` (written at etcd `revision`) to `pool`, as the Raft store's state machine
/// applies log entry `seq`.
pub fn apply_etcd_entry(
    pool: &mut PoolState,
    seq: u64,
    revision: i64,
    bytes: &[u8],
) -> Result<(EtcdEntry, CommandResult), EtcdEntryError> {
    assert!(seq >= 1 && revision > 0);
    let entry = EtcdEntry::decode(seq, bytes)?;
    let appended_by = entry.appended_by(revision);
    let result = pool.apply_entry(seq, appended_by, entry.command.clone());
    Ok((entry, result))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(term: u64, leader: NodeId) -> Command {
        Command::Batch(vec![Command::LeaderDecision {
            term,
            leader,
            command: Box::new(Command::Retry { unix_ms: 1 }),
        }])
    }

    fn first_result(result: CommandResult) -> CommandResult {
        match result {
            CommandResult::Batch(mut results) => results.remove(0),
            other => panic!("a batch answers a batch, got {other:?}"),
        }
    }

    #[test]
    fn entries_round_trip() {
        let entry = EtcdEntry::new(3, 17, Some(42), decision(42, 3));
        let decoded = EtcdEntry::decode(5, &entry.encode()).expect("decode");
        assert_eq!(decoded, entry);
        assert!(matches!(
            EtcdEntry::decode(5, b"\x01garbage"),
            Err(EtcdEntryError::Undecodable { seq: 5, .. })
        ));
    }

    #[test]
    fn a_newer_format_is_named_as_such() {
        let mut entry = EtcdEntry::new(3, 17, None, Command::Batch(Vec::new()));
        entry.format_version = ETCD_ENTRY_FORMAT + 1;
        let bytes = encode(&entry).expect("encode");
        let error = EtcdEntry::decode(9, &bytes).expect_err("newer");
        assert!(
            matches!(error, EtcdEntryError::NewerFormat { seq: 9, found: 2 }),
            "{error}"
        );
        assert!(error.to_string().contains("upgrade"));
    }

    #[test]
    fn a_decision_applies_only_under_the_leadership_that_fenced_it() {
        let mut pool = PoolState::default();
        // Decided by member 3 under leadership 42, appended fenced on 42: applied.
        let fenced = EtcdEntry::new(3, 1, Some(42), decision(42, 3)).encode();
        let (_, result) = apply_etcd_entry(&mut pool, 1, 50, &fenced).expect("apply");
        assert_eq!(first_result(result), CommandResult::Done);

        // The same decision in an entry of another leadership, or unfenced: refused.
        for (fence, origin) in [(Some(43), 3), (Some(42), 4), (None, 3)] {
            let entry = EtcdEntry::new(origin, 2, fence, decision(42, 3)).encode();
            let (_, result) = apply_etcd_entry(&mut pool, 2, 60, &entry).expect("apply");
            assert!(
                matches!(first_result(result), CommandResult::Failed { .. }),
                "fence {fence:?} from member {origin}"
            );
        }

        // A fence not older than the entry's own revision cannot be real: treated as none.
        let future = EtcdEntry::new(3, 3, Some(70), decision(70, 3)).encode();
        let (_, result) = apply_etcd_entry(&mut pool, 3, 70, &future).expect("apply");
        assert!(matches!(first_result(result), CommandResult::Failed { .. }));
    }

    #[test]
    fn members_applying_the_same_entries_reach_the_same_state() {
        let entries: Vec<(i64, Vec<u8>)> = (1..=5)
            .map(|seq| {
                let command = Command::Batch(vec![Command::Retry { unix_ms: seq }]);
                (
                    seq * 10,
                    EtcdEntry::new(1, seq as u64, None, command).encode(),
                )
            })
            .collect();
        let mut one = PoolState::default();
        let mut other = PoolState::default();
        for (seq, (revision, bytes)) in (1u64..).zip(&entries) {
            let (_, first) = apply_etcd_entry(&mut one, seq, *revision, bytes).expect("apply");
            let (_, second) = apply_etcd_entry(&mut other, seq, *revision, bytes).expect("apply");
            assert_eq!(first, second);
        }
        assert_eq!(
            encode(&one).expect("encode"),
            encode(&other).expect("encode")
        );
    }
}
