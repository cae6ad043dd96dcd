//! The openraft type configuration of the control plane: what a log entry carries and what
//! applying it returns.

use crate::pool::{Command, CommandResult};
use std::io::Cursor;

openraft::declare_raft_types!(
    /// Raft types of the vgpu control plane.
    pub TypeConfig:
        D = Command,
        R = CommandResult,
        NodeId = u64,
        Node = openraft::BasicNode,
        AsyncRuntime = crate::runtime::VgpuRuntime,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;

/// bincode with the standard configuration: the one encoding for log entries, snapshots and peer
/// messages.
pub fn encode<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, bincode::error::EncodeError> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
}

/// How much more than its input a decode may claim: bincode claims the full width of every
/// integer (16 bytes for a `u128`) however few bytes its varint took.
const CLAIM_PER_INPUT_BYTE_MAX: usize = 16;
/// Inputs up to this size (votes, heartbeats, small writes) get a tight claim limit.
const DECODE_SMALL_BYTES_MAX: usize = 64 << 10;
/// Inputs up to this size get a middle one.
const DECODE_MEDIUM_BYTES_MAX: usize = 4 << 20;

/// Decodes a value that must fill `bytes` exactly.
///
/// bincode allocates a string or byte vector at the length its prefix claims before it reads
/// the bytes, and by default with no limit: a peer message claiming 2^62 bytes aborted the
/// member. So each decode gets a limit on what it claims in all, from the size of its input
/// (a claim can never rightly exceed [`CLAIM_PER_INPUT_BYTE_MAX`] times the input); peer
/// messages are at most [`crate::network::MESSAGE_BYTES_MAX`], and larger inputs are snapshot
/// files this member wrote and checksummed, which get no limit.
pub fn decode<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, bincode::error::DecodeError> {
    const SMALL: usize = DECODE_SMALL_BYTES_MAX * CLAIM_PER_INPUT_BYTE_MAX;
    const MEDIUM: usize = DECODE_MEDIUM_BYTES_MAX * CLAIM_PER_INPUT_BYTE_MAX;
    const MESSAGE: usize = crate::network::MESSAGE_BYTES_MAX * CLAIM_PER_INPUT_BYTE_MAX;
    let standard = bincode::config::standard();
    let (value, read) = match bytes.len() {
        length if length <= DECODE_SMALL_BYTES_MAX => {
            bincode::serde::decode_from_slice(bytes, standard.with_limit::<SMALL>())?
        }
        length if length <= DECODE_MEDIUM_BYTES_MAX => {
            bincode::serde::decode_from_slice(bytes, standard.with_limit::<MEDIUM>())?
        }
        length if length <= crate::network::MESSAGE_BYTES_MAX => {
            bincode::serde::decode_from_slice(bytes, standard.with_limit::<MESSAGE>())?
        }
        _ => bincode::serde::decode_from_slice(bytes, standard)?,
    };
    if read != bytes.len() {
        return Err(bincode::error::DecodeError::OtherString(format!(
            "{} trailing bytes after the value",
            bytes.len() - read
        )));
    }
    Ok(value)
}
