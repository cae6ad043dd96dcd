//! `Keys`: the layout of one cluster's keys under its prefix. Pure: no I/O.
//!
//! Sequence numbers are written as 20 decimal digits (`u64::MAX` has 20), so etcd's byte order of
//! keys and values is their numeric order: a range read returns the log in order, and a value
//! comparison orders snapshots.

/// Digits of a sequence number in a key or value.
pub const SEQ_DIGITS: usize = 20;

/// The keys of one cluster under `prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` must end with `/` so that `/vgpu/` and `/vgpu2/` never share keys.
    pub fn new(prefix: &str) -> Keys {
        assert!(
            prefix.ends_with('/') && prefix.len() > 1,
            "prefix {prefix:?} must end with '/'"
        );
        Keys {
            prefix: prefix.to_string(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Holds the cluster id: which cluster the prefix belongs to.
    pub fn cluster(&self) -> String {
        format!("{}cluster", self.prefix)
    }

    /// Holds the last appended sequence number; its mod revision orders appends.
    pub fn head(&self) -> String {
        format!("{}head", self.prefix)
    }

    /// Created by the leader with its lease; its create revision is the fencing token.
    pub fn leader(&self) -> String {
        format!("{}leader", self.prefix)
    }

    /// Points at the newest complete snapshot (`SnapshotPointer`).
    pub fn snapshot(&self) -> String {
        format!("{}snapshot", self.prefix)
    }

    /// All log entries: `log/<seq>`.
    pub fn log_prefix(&self) -> String {
        format!("{}log/", self.prefix)
    }

    pub fn log(&self, seq: u64) -> String {
        assert!(seq >= 1, "sequence numbers start at 1");
        format!("{}log/{seq:0SEQ_DIGITS$}", self.prefix)
    }

    /// The sequence number of a log key, `None` for any other key.
    pub fn log_seq(&self, key: &[u8]) -> Option<u64> {
        let rest = key.strip_prefix(self.log_prefix().as_bytes())?;
        parse_seq(rest)
    }

    /// The chunks of the snapshot covering `seq`: `snapshots/<seq>/<index>`.
    pub fn snapshot_chunks(&self, seq: u64) -> String {
        format!("{}snapshots/{seq:0SEQ_DIGITS$}/", self.prefix)
    }

    pub fn snapshot_chunk(&self, seq: u64, index: u32) -> String {
        format!("{}{index:010}", self.snapshot_chunks(seq))
    }

    /// Every member's registration: `members/<id>` (`Presence`).
    pub fn members_prefix(&self) -> String {
        format!("{}members/", self.prefix)
    }

    pub fn member(&self, id: u64) -> String {
        format!("{}{id:0SEQ_DIGITS$}", self.members_prefix())
    }

    /// The member id of a `members/` key, `None` for any other key.
    pub fn member_id(&self, key: &[u8]) -> Option<u64> {
        let rest = key.strip_prefix(self.members_prefix().as_bytes())?;
        parse_seq(rest)
    }
}

/// A sequence number as stored: exactly `SEQ_DIGITS` ASCII digits.
pub fn format_seq(seq: u64) -> String {
    format!("{seq:0SEQ_DIGITS$}")
}

/// The inverse of `format_seq`; `None` unless the bytes are exactly `SEQ_DIGITS` digits.
pub fn parse_seq(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != SEQ_DIGITS || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// The end of a prefix range: the prefix with its last byte incremented (etcd's `range_end`).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // Every prefix here ends with '/', so incrementing the last byte never carries.
    let last = end.last_mut().expect("a prefix is never empty");
    assert!(*last < 0xff, "prefix {prefix:?} ends with 0xff");
    *last += 1;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keys_sort_numerically_and_parse_back() {
        let keys = Keys::new("/vgpu/");
        assert_eq!(keys.log(7), "/vgpu/log/00000000000000000007");
        assert!(keys.log(9) < keys.log(10));
        assert!(keys.log(99_999) < keys.log(100_000));
        assert_eq!(keys.log_seq(keys.log(u64::MAX).as_bytes()), Some(u64::MAX));
        assert_eq!(keys.log_seq(keys.head().as_bytes()), None);
        assert_eq!(keys.log_seq(b"/vgpu/log/12"), None);
    }

    #[test]
    fn member_keys_parse_back() {
        let keys = Keys::new("/vgpu/");
        assert_eq!(keys.member(3), "/vgpu/members/00000000000000000003");
        assert_eq!(keys.member_id(keys.member(3).as_bytes()), Some(3));
        assert_eq!(keys.member_id(keys.log(3).as_bytes()), None);
    }

    #[test]
    fn prefixes_do_not_overlap() {
        let a = Keys::new("/vgpu/");
        let b = Keys::new("/vgpu2/");
        assert!(!b.log(1).starts_with(a.prefix()));
        assert_eq!(prefix_end("/vgpu/log/"), b"/vgpu/log0".to_vec());
        assert!(a.log(u64::MAX).as_bytes() < prefix_end(&a.log_prefix()).as_slice());
    }

    #[test]
    fn seq_values_round_trip_and_refuse_garbage() {
        assert_eq!(parse_seq(format_seq(42).as_bytes()), Some(42));
        assert_eq!(parse_seq(b"42"), None);
        assert_eq!(parse_seq(b"0000000000000000004x"), None);
        assert!(format_seq(9) < format_seq(10));
    }
}
