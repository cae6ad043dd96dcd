//! Half-open requests (issue 22): a client that sends a call's headers and the length prefix of
//! its message, then nothing, held the request (and what it had buffered) for good. Now the
//! server answers every call within `Timings::request_timeout` and drops the request with it.
//! The client here speaks HTTP/2 by hand over plain TCP (the member runs `--insecure`; the
//! bound is the same behind TLS, which only wraps the connection), and sends no certificate.

use crate::control_plane::Timings;
use crate::{Config, Mode, RaftTimings, Security, start};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One HTTP/2 frame: length (24 bits), type, flags, stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 1 << 24);
    let length = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut bytes = vec![length[1], length[2], length[3], kind, flags];
    bytes.extend_from_slice(&stream.to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// An HPACK header block of literal fields without indexing (no Huffman coding).
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        assert!(name.len() < 127 && value.len() < 127, "one-byte lengths");
        block.push(0x00);
        block.push(u8::try_from(name.len()).unwrap());
        block.extend_from_slice(name.as_bytes());
        block.push(u8::try_from(value.len()).unwrap());
        block.extend_from_slice(value.as_bytes());
    }
    block
}

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_request_is_answered_within_the_request_timeout() {
    let directory = tempfile::tempdir().unwrap();
    let request_timeout = Duration::from_secs(1);
    let started = start(Config {
        mode: Mode::Bootstrap,
        id: 1,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: "127.0.0.1:1".to_owned(),
        data_dir: directory.path().to_owned(),
        timings: Timings {
            request_timeout,
            ..Timings::default()
        },
        raft: RaftTimings::default(),
        security: Security {
            insecure: true,
            ..Security::default()
        },
    })
    .await
    .unwrap();

    let mut connection = tokio::net::TcpStream::connect(started.local_address)
        .await
        .unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    let fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/vgpu.v1.Pool/Place"),
        (":authority", "member"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    out.extend(frame(HEADERS, END_HEADERS, 1, &header_block(&fields)));
    // A message of 1 MiB announced (uncompressed), 100 bytes of it sent, then silence.
    let mut data = vec![0, 0x00, 0x10, 0x00, 0x00];
    data.extend_from_slice(&[0x0a; 100]);
    out.extend(frame(DATA, 0, 1, &data));
    // Taken before the write: the server's clock for the call starts after it.
    let sent = Instant::now();
    connection.write_all(&out).await.unwrap();

    // Read frames until the server ends stream 1: its answer (HEADERS) or a reset.
    let bound = request_timeout + Duration::from_secs(10);
    let ended = tokio::time::timeout(bound, async {
        loop {
            let mut head = [0u8; 9];
            connection.read_exact(&mut head).await.unwrap();
            let length =
                usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; length];
            connection.read_exact(&mut payload).await.unwrap();
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    connection
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .unwrap();
                }
                PING if flags & ACK == 0 => {
                    connection
                        .write_all(&frame(PING, ACK, 0, &payload))
                        .await
                        .unwrap();
                }
                HEADERS | RST_STREAM if stream == 1 => return kind,
                GOAWAY => return kind,
                _ => {}
            }
        }
    })
    .await
    .expect("the server ends a half-open request within its request timeout");
    let waited = sent.elapsed();
    assert!(
        ended == HEADERS || ended == RST_STREAM,
        "the request was answered or reset, not the connection closed (frame type {ended})"
    );
    assert!(
        waited >= request_timeout,
        "nothing but the timeout ends it: {waited:?}"
    );
    started.control_plane.raft.shutdown().await.ok();
}
