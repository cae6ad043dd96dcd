//! gRPC metadata that vgpu-agent and vgpu-cp exchange besides the messages: the node key and the
//! registration number (issue 22, point 5: a node's name is bound to the identity that first
//! registered it).
//!
//! The agent draws a node key once and keeps it in its state directory; it sends it as
//! [`NODE_KEY`] with `Register`, `Heartbeat` and `WatchAssignments`. The control plane keeps
//! only its SHA-256 ([`node_key_sha256`]) and binds the node's name to it at the first keyed
//! registration. Each accepted keyed registration has a number, sent back as [`REGISTRATION`] on
//! the `Register` answer; every beat names the registration it is for with the same metadata.
//! A call for a name bound to another key, or a beat of an older registration, is refused with
//! `[VGPU-NODE-NAME-TAKEN]` (`crate::ErrorCode::NodeNameTaken`).
//!
//! Metadata travel outside the messages, so agents and control planes of versions before these
//! names simply do not send or read them.

use tonic::metadata::MetadataMap;

/// Request metadata of `Register`, `Heartbeat` and `WatchAssignments`: the node key,
/// [`NODE_KEY_TEXT_LEN`] lowercase hex digits.
pub const NODE_KEY: &str = "vgpu-node-key";
/// Response metadata of `Register` (the number of the registration it accepted, decimal) and
/// request metadata of `Heartbeat` (the registration the beat is for). Absent or 0: no number
/// (a control plane before numbered registrations, or a registration without a key).
pub const REGISTRATION: &str = "vgpu-registration";
/// Length of a node key: 32 random bytes as lowercase hex.
pub const NODE_KEY_TEXT_LEN: usize = 64;

/// Why a call's node-key or registration metadata was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetadataError {
    #[error(
        "the `{NODE_KEY}` metadata is not a node key ({NODE_KEY_TEXT_LEN} lowercase hex digits); the agent draws it into STATE_DIR/node-key: remove a damaged file there only if this machine should become a new node identity"
    )]
    MalformedNodeKey,
    #[error(
        "the `{REGISTRATION}` metadata is not a registration number (decimal digits); send the number the Register answer carried"
    )]
    MalformedRegistration,
}

/// Whether `text` is a node key: exactly [`NODE_KEY_TEXT_LEN`] lowercase hex digits.
pub fn is_node_key(text: &str) -> bool {
    text.len() == NODE_KEY_TEXT_LEN
        && text
            .bytes()
            .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
}

/// The node key a call carries: `None` when it carries none (an agent of an earlier version),
/// an error when it carries a malformed one (or several).
pub fn node_key(metadata: &MetadataMap) -> Result<Option<&str>, MetadataError> {
    let mut values = metadata.get_all(NODE_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(MetadataError::MalformedNodeKey);
    }
    match value.to_str() {
        Ok(text) if is_node_key(text) => Ok(Some(text)),
        _ => Err(MetadataError::MalformedNodeKey),
    }
}

/// The registration number a call carries (`None`: none; 0 is a number, "no registration").
pub fn registration(metadata: &MetadataMap) -> Result<Option<u64>, MetadataError> {
    let mut values = metadata.get_all(REGISTRATION).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(MetadataError::MalformedRegistration);
    }
    let text = value
        .to_str()
        .map_err(|_| MetadataError::MalformedRegistration)?;
    // Digits only: no sign, no spaces (which `parse` would take or refuse less plainly).
    if text.is_empty() || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(MetadataError::MalformedRegistration);
    }
    text.parse()
        .map(Some)
        .map_err(|_| MetadataError::MalformedRegistration)
}

/// What the control plane keeps of a node key: its SHA-256, as lowercase hex. The key itself is
/// a secret of the agent and never enters the log.
pub fn node_key_sha256(key: &str) -> String {
    assert!(is_node_key(key), "only admitted node keys are hashed");
    let digest = crate::pki::sha256_hex(key.as_bytes());
    assert!(
        is_node_key(&digest),
        "a SHA-256 in hex looks like a node key"
    );
    digest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&'static str, &str)]) -> MetadataMap {
        let mut map = MetadataMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn node_keys_are_64_lowercase_hex_digits_and_only_their_digest_is_kept() {
        let key = "0123456789abcdef".repeat(4);
        assert_eq!(
            node_key(&metadata(&[(NODE_KEY, &key)])),
            Ok(Some(key.as_str()))
        );
        assert_eq!(node_key(&MetadataMap::new()), Ok(None));
        for bad in [
            "",
            &key[1..],
            &format!("{key}0"),
            &key.to_uppercase(),
            &format!("{}g", &key[1..]),
            &format!(" {}", &key[1..]),
        ] {
            assert_eq!(
                node_key(&metadata(&[(NODE_KEY, bad)])),
                Err(MetadataError::MalformedNodeKey),
                "{bad:?}"
            );
        }
        let twice = metadata(&[(NODE_KEY, &key), (NODE_KEY, &key)]);
        assert_eq!(node_key(&twice), Err(MetadataError::MalformedNodeKey));
        let digest = node_key_sha256(&key);
        assert_ne!(digest, key);
        assert_eq!(digest, node_key_sha256(&key), "the digest is stable");
        assert_ne!(digest, node_key_sha256(&"f".repeat(64)));
    }

    #[test]
    fn registration_numbers_are_decimal_digits() {
        assert_eq!(registration(&MetadataMap::new()), Ok(None));
        assert_eq!(registration(&metadata(&[(REGISTRATION, "0")])), Ok(Some(0)));
        assert_eq!(
            registration(&metadata(&[(REGISTRATION, "18446744073709551615")])),
            Ok(Some(u64::MAX))
        );
        for bad in ["", "-1", "+1", "1 ", "0x10", "18446744073709551616", "12a"] {
            assert_eq!(
                registration(&metadata(&[(REGISTRATION, bad)])),
                Err(MetadataError::MalformedRegistration),
                "{bad:?}"
            );
        }
    }
}
