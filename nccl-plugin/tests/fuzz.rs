//! Fuzz targets for the plugin's wire decoders (`wire`): the listen handle NCCL carries between
//! ranks, the hello, the control messages of the same-host path, the TCP part headers and the
//! RDMA path's queue-pair info and control messages, all
//! fed arbitrary bytes (and mutated valid encodings). A decoder must never panic or loop, and
//! what it accepts must encode back to the bytes it read. The module's own property tests
//! check that valid messages round-trip; these check what a hostile or broken peer could send.
//! `VGPU_FUZZ_CASES` sets the cases per target; `docs/fuzzing.md` says more.

use fuzzkit as fuzz;

use proptest::prelude::*;
use vgpu_nccl::wire::{
    HANDLE_LEN, HELLO_LEN, Hello, ListenHandle, MAGIC, Msg, PART_LEN, PartHeader, RDMA_INFO_LEN,
    RdmaInfo, RdmaMsg, WireError,
};

/// Arbitrary bytes, and bytes that start like ours (the magic, then anything).
fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..max),
        proptest::collection::vec(any::<u8>(), 0..max).prop_map(|mut bytes| {
            for (slot, byte) in bytes.iter_mut().zip(MAGIC.to_le_bytes()) {
                *slot = byte;
            }
            bytes
        }),
    ]
}

fn check_handle(bytes: Vec<u8>) {
    match ListenHandle::decode(&bytes) {
        Ok(handle) => {
            let mut again = vec![0u8; HANDLE_LEN];
            handle.encode(&mut again);
            assert_eq!(ListenHandle::decode(&again), Ok(handle.clone()));
            assert!(handle.unix_name().starts_with("vgpu-nccl/"));
        }
        Err(WireError::Magic(magic)) => assert_ne!(magic, MAGIC),
        Err(WireError::Malformed(what)) => assert!(!what.is_empty()),
    }
}

fn check_hello(bytes: [u8; HELLO_LEN]) {
    if let Ok(hello) = Hello::decode(&bytes) {
        assert!(hello.streams >= 1 && hello.index < hello.streams);
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
    }
}

/// Decodes a stream of control messages the way the receiver does: one after another until
/// more bytes are needed or the stream is refused. Each message re-encodes to what it read.
fn check_messages(bytes: Vec<u8>) {
    let mut rest = bytes.as_slice();
    let mut messages = 0;
    loop {
        match Msg::decode(rest) {
            Ok(Some((message, used))) => {
                assert!(used > 0 && used <= rest.len());
                let mut encoded = Vec::new();
                message.encode(&mut encoded);
                assert_eq!(encoded.as_slice(), &rest[..used], "{message:?}");
                rest = &rest[used..];
                messages += 1;
                assert!(messages <= bytes.len(), "no progress");
            }
            Ok(None) => return,
            Err(WireError::Malformed(what)) => {
                assert!(!what.is_empty());
                return;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
}

fn check_part(bytes: [u8; PART_LEN]) {
    let header = PartHeader::decode(&bytes);
    let encoded = header.encode();
    assert_eq!(PartHeader::decode(&encoded), header);
    let mut expected = bytes;
    expected[4..8].fill(0);
    assert_eq!(encoded, expected);
}

/// The RDMA control stream as both ends decode it: messages one after another until more bytes
/// are needed or the stream is refused; each re-encodes to what it read, and an accepted queue
/// pair keeps its 24-bit numbers and a real MTU.
fn check_rdma_messages(bytes: Vec<u8>) {
    let mut rest = bytes.as_slice();
    loop {
        match RdmaMsg::decode(rest) {
            Ok(Some((message, used))) => {
                assert!(used > 0 && used <= rest.len());
                if let RdmaMsg::Info(info) = message {
                    assert!(info.qpn < 1 << 24 && info.psn < 1 << 24);
                    assert!((1..=5).contains(&info.mtu));
                }
                let mut encoded = Vec::new();
                message.encode(&mut encoded);
                assert_eq!(encoded.as_slice(), &rest[..used], "{message:?}");
                rest = &rest[used..];
            }
            Ok(None) => return,
            Err(WireError::Malformed(what)) => {
                assert!(!what.is_empty());
                return;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
}

fn check_rdma_info(bytes: [u8; RDMA_INFO_LEN]) {
    if let Ok(info) = RdmaInfo::decode(&bytes) {
        assert_eq!(info.encode(), bytes);
    }
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn rdma_control_messages(bytes in prop_oneof![
        bytes(200),
        // Valid type bytes followed by anything, several in a row.
        proptest::collection::vec(
            (1u8..=4, proptest::collection::vec(any::<u8>(), 0..40)),
            1..6,
        )
        .prop_map(|parts| parts.into_iter().flat_map(|(t, body)| std::iter::once(t).chain(body)).collect()),
    ]) {
        fuzz::bounded(bytes, check_rdma_messages);
    }

    #[test]
    fn rdma_queue_pair_info(bytes in proptest::array::uniform32(any::<u8>())) {
        fuzz::bounded(bytes, check_rdma_info);
    }

    #[test]
    fn listen_handles(bytes in bytes(160)) {
        fuzz::bounded(bytes, check_handle);
    }

    #[test]
    fn hellos(bytes in bytes(HELLO_LEN + 1).prop_map(|bytes| {
        let mut fixed = [0u8; HELLO_LEN];
        for (slot, byte) in fixed.iter_mut().zip(bytes) {
            *slot = byte;
        }
        fixed
    })) {
        fuzz::bounded(bytes, check_hello);
    }

    #[test]
    fn control_messages(bytes in prop_oneof![
        bytes(200),
        // Valid type bytes followed by anything, several in a row.
        proptest::collection::vec(
            (1u8..=6, proptest::collection::vec(any::<u8>(), 0..80)),
            1..6,
        )
        .prop_map(|parts| parts.into_iter().flat_map(|(t, body)| std::iter::once(t).chain(body)).collect()),
    ]) {
        fuzz::bounded(bytes, check_messages);
    }

    #[test]
    fn part_headers(bytes in proptest::array::uniform32(any::<u8>())) {
        fuzz::bounded(bytes, check_part);
    }
}

/// Found by `listen_handles`: a slice shorter than the 51 bytes the address reaches panicked
/// (index out of range) instead of being refused. NCCL always passes 128 bytes, so only a
/// caller of the public decoder could hit it; it is refused as malformed now.
#[test]
fn regression_a_short_handle_is_malformed() {
    for length in [0, 4, 34, 50, HANDLE_LEN - 1] {
        let mut bytes = vec![0u8; length];
        for (slot, byte) in bytes.iter_mut().zip(MAGIC.to_le_bytes()) {
            *slot = byte;
        }
        if length > 34 {
            bytes[34] = 6;
        }
        assert_eq!(
            ListenHandle::decode(&bytes),
            Err(WireError::Malformed("handle length"))
        );
    }
}
