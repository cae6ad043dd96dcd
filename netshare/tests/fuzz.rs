//! Fuzz target for opening a bucket table file (`Table::open`, what every NCCL plugin instance
//! does, and `TableOwner::open_or_create`, what the agent does): the file is writable by every
//! tenant, so any content must be refused with a reason or, when the header is valid, served
//! without a panic whatever the slots hold. `VGPU_FUZZ_CASES` sets the cases;
//! `docs/fuzzing.md` says more.

use fuzzkit as fuzz;

use netshare::{
    Admission, BucketConfig, FlowId, MAGIC, REGION_BYTES, SLOTS, Table, TableOwner, VERSION,
};
use proptest::prelude::*;

/// A table file: a header (valid or with one field off), slot words set to anything, a few
/// stray bytes anywhere, and a length around the real one.
#[derive(Debug, Clone)]
struct Contents {
    magic: u64,
    version: u32,
    slot_count: u32,
    words: Vec<(usize, usize, u64)>,
    length: usize,
    noise: Vec<(usize, u8)>,
}

impl Contents {
    fn bytes(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.length];
        let mut put = |at: usize, value: &[u8]| {
            if at + value.len() <= bytes.len() {
                bytes[at..at + value.len()].copy_from_slice(value);
            }
        };
        put(0, &self.magic.to_le_bytes());
        put(8, &self.version.to_le_bytes());
        put(12, &self.slot_count.to_le_bytes());
        for &(slot, word, value) in &self.words {
            put(
                64 + (slot % SLOTS) * 64 + (word % 8) * 8,
                &value.to_le_bytes(),
            );
        }
        for &(at, byte) in &self.noise {
            put(at, &[byte]);
        }
        bytes
    }

    fn valid_header(&self) -> bool {
        let bytes = self.bytes();
        bytes.len() >= REGION_BYTES
            && bytes[0..8] == MAGIC.to_le_bytes()
            && bytes[8..12] == VERSION.to_le_bytes()
            && bytes[12..16] == (SLOTS as u32).to_le_bytes()
    }
}

fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(1 << 30),
        Just((1 << 30) + 1),
        any::<u64>(),
    ]
}

fn contents() -> impl Strategy<Value = Contents> {
    (
        prop_oneof![4 => Just(MAGIC), 1 => any::<u64>()],
        prop_oneof![4 => Just(VERSION), 1 => any::<u32>()],
        prop_oneof![4 => Just(SLOTS as u32), 1 => any::<u32>()],
        proptest::collection::vec((0..SLOTS, 0usize..8, word()), 0..40),
        prop_oneof![
            4 => Just(REGION_BYTES),
            1 => 0..REGION_BYTES,
            1 => REGION_BYTES..REGION_BYTES + 4096,
        ],
        proptest::collection::vec((0..REGION_BYTES, any::<u8>()), 0..8),
    )
        .prop_map(
            |(magic, version, slot_count, words, length, noise)| Contents {
                magic,
                version,
                slot_count,
                words,
                length,
                noise,
            },
        )
}

fn check_table(contents: Contents) {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("netshare.node-a");
    std::fs::write(&path, contents.bytes()).unwrap();
    let valid_header = contents.valid_header();
    match Table::open(&path) {
        Ok(table) => {
            assert!(valid_header, "{contents:?}");
            // Whatever the slots hold, a plugin's calls answer.
            for flow in table.flows() {
                let bucket = table.bucket(flow).expect("a listed flow has a bucket");
                let stats = table.stats(flow).expect("a listed flow has stats");
                assert!(
                    stats.config.is_valid(),
                    "a stored burst is clamped: {stats:?}"
                );
                for (bytes, now_ns) in [(0, 0), (1, 1), (u64::MAX, u64::MAX), (1 << 20, 1 << 40)] {
                    match bucket.try_consume(bytes, now_ns) {
                        Admission::Admitted | Admission::Gone => {}
                        Admission::WaitFor(wait) => assert!(wait.as_nanos() > 0),
                    }
                }
            }
            assert!(table.bucket(FlowId(0)).is_none());
        }
        Err(error) => {
            assert!(!valid_header, "{error}");
            let message = error.to_string();
            assert!(message.contains("netshare.node-a"), "{message}");
        }
    }
    // The agent replaces anything that is not a valid table, and keeps a valid one.
    let owner = TableOwner::open_or_create(&path).unwrap();
    let flow = FlowId(u64::MAX);
    match owner.set_rate(flow, BucketConfig::for_rate(1 << 30)) {
        Ok(()) => assert!(owner.table().bucket(flow).is_some()),
        Err(error) => assert_eq!(owner.table().flows().len(), SLOTS, "{error}"),
    }
    drop(owner);
    Table::open(&path).unwrap();
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn table_files(contents in contents()) {
        fuzz::bounded(contents, check_table);
    }
}
