//! Byte layouts that cross process boundaries: the listen handle NCCL carries between ranks,
//! the hello a connector sends, the control messages of the same-host path, the part headers
//! of the TCP path, and the RDMA path's queue-pair info and slot messages. Pure encode/decode,
//! little-endian, versioned by `MAGIC`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const MAGIC: u32 = 0x5647_4e33; // "VGN3": the hello may offer RDMA (VGN2: the handle and hello carry the listener's secret)

/// What `listen` writes into NCCL's 128-byte handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenHandle {
    /// Identifies the host (boot id); equal ids mean the same-host path may be tried.
    pub host: [u8; 16],
    /// The listener's TCP address.
    pub tcp: SocketAddr,
    /// The listener's abstract Unix socket is `vgpu-nccl/<pid>/<nonce>`.
    pub pid: u32,
    pub nonce: u64,
    /// A random secret of the listener. It travels only inside the handle (which NCCL passes
    /// among the job's ranks), never in a socket's name, and every connector must present it in
    /// its hello: another tenant on the node can see the abstract socket's name and the TCP port
    /// but cannot connect without it.
    pub secret: [u8; 16],
}

/// Bytes of the handle we use; the rest of NCCL's 128 is ours to keep connect state in.
pub const HANDLE_LEN: usize = 80;
/// Offset of the in-progress connect pointer inside the handle (see `net::connect`).
pub const HANDLE_STATE_OFFSET: usize = 96;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("not a vgpu NCCL handle (magic {0:#x}); are all ranks using the same plugin?")]
    Magic(u32),
    #[error("malformed {0}")]
    Malformed(&'static str),
}

impl ListenHandle {
    pub fn encode(&self, out: &mut [u8]) {
        out[..HANDLE_LEN].fill(0);
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..20].copy_from_slice(&self.host);
        out[20..24].copy_from_slice(&self.pid.to_le_bytes());
        out[24..32].copy_from_slice(&self.nonce.to_le_bytes());
        out[64..80].copy_from_slice(&self.secret);
        out[32..34].copy_from_slice(&self.tcp.port().to_le_bytes());
        match self.tcp.ip() {
            IpAddr::V4(v4) => {
                out[34] = 4;
                out[35..39].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                out[34] = 6;
                out[35..51].copy_from_slice(&v6.octets());
            }
        }
    }

    /// Reads a handle from the front of `b` (NCCL's 128 bytes; a shorter slice is malformed).
    pub fn decode(b: &[u8]) -> Result<ListenHandle, WireError> {
        if b.len() < HANDLE_LEN {
            return Err(WireError::Malformed("handle length"));
        }
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        let port = u16::from_le_bytes([b[32], b[33]]);
        let ip = match b[34] {
            4 => IpAddr::V4(Ipv4Addr::from(
                <[u8; 4]>::try_from(&b[35..39]).expect("4 bytes"),
            )),
            6 => IpAddr::V6(Ipv6Addr::from(
                <[u8; 16]>::try_from(&b[35..51]).expect("16 bytes"),
            )),
            _ => return Err(WireError::Malformed("handle address family")),
        };
        Ok(ListenHandle {
            host: b[4..20].try_into().expect("16 bytes"),
            pid: u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")),
            nonce: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
            secret: b[64..80].try_into().expect("16 bytes"),
            tcp: SocketAddr::new(ip, port),
        })
    }

    pub fn unix_name(&self) -> String {
        format!("vgpu-nccl/{}/{}", self.pid, self.nonce)
    }
}

/// The first bytes on every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub local: bool,
    /// Groups the streams of one connection.
    pub conn: u64,
    pub index: u8,
    pub streams: u8,
    pub pid: u32,
    /// The listener's secret, from its handle.
    pub secret: [u8; 16],
    /// The connector asks for the RDMA path: its `RdmaInfo` follows the hello, and the
    /// listener answers with an `RdmaMsg::Info` (or `Refuse`, then TCP streams are dialled).
    pub rdma: bool,
}

pub const HELLO_LEN: usize = 40;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = u8::from(self.local);
        b[5] = self.index;
        b[6] = self.streams;
        b[7] = u8::from(self.rdma);
        b[8..16].copy_from_slice(&self.conn.to_le_bytes());
        b[16..20].copy_from_slice(&self.pid.to_le_bytes());
        b[24..40].copy_from_slice(&self.secret);
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, WireError> {
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        if b[6] == 0 || b[5] >= b[6] {
            return Err(WireError::Malformed("hello stream index"));
        }
        Ok(Hello {
            local: b[4] == 1,
            index: b[5],
            streams: b[6],
            conn: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            pid: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            secret: b[24..40].try_into().expect("16 bytes"),
            rdma: b[7] == 1,
        })
    }

    /// Whether a hello's first bytes (at least 8) ask for the RDMA path, so that the listener
    /// knows to read an `RdmaInfo` after it.
    pub fn asks_rdma(prefix: &[u8]) -> bool {
        prefix.get(7) == Some(&1)
    }
}

/// Whether two secrets are equal, comparing every byte (no early exit on the first difference).
pub fn same_secret(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Region id meaning "host memory: send the bytes through the socket".
pub const HOST_REGION: u32 = u32::MAX;

/// Control messages of the same-host path. Receiver to sender: `Ring`, `Reg`, `Dereg`, `Rtr`;
/// sender to receiver: `Fin`, `Data` (followed by `size` payload bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Msg {
    /// A GPU allocation of the receiver, exported. `legacy` carries a cudaIpc handle; otherwise
    /// the allocation's file descriptor travels with this message (SCM_RIGHTS).
    Reg {
        region: u32,
        alloc_size: u64,
        legacy: Option<[u8; 64]>,
    },
    Dereg {
        region: u32,
    },
    /// Ready to receive: receive number `seq` lands in `region` at `offset`, at most `cap` bytes.
    Rtr {
        seq: u32,
        region: u32,
        offset: u64,
        cap: u64,
    },
    /// The sender's copy into the receiver's GPU memory for `seq` is complete.
    Fin {
        seq: u32,
        size: u64,
    },
    /// `size` bytes for `seq` follow.
    Data {
        seq: u32,
        size: u64,
    },
    /// The connection's completion ring (`finring`): its memfd travels with this message, and
    /// GPU copies complete through it instead of `Fin`.
    Ring,
}

const T_REG: u8 = 1;
const T_REG_LEGACY: u8 = 2;
const T_DEREG: u8 = 3;
const T_RTR: u8 = 4;
const T_FIN: u8 = 5;
const T_DATA: u8 = 6;
const T_RING: u8 = 7;

impl Msg {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            Msg::Reg {
                region,
                alloc_size,
                legacy,
            } => {
                out.push(if legacy.is_some() {
                    T_REG_LEGACY
                } else {
                    T_REG
                });
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&alloc_size.to_le_bytes());
                if let Some(h) = legacy {
                    out.extend_from_slice(&h);
                }
            }
            Msg::Dereg { region } => {
                out.push(T_DEREG);
                out.extend_from_slice(&region.to_le_bytes());
            }
            Msg::Rtr {
                seq,
                region,
                offset,
                cap,
            } => {
                out.push(T_RTR);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&cap.to_le_bytes());
            }
            Msg::Fin { seq, size } | Msg::Data { seq, size } => {
                out.push(if matches!(self, Msg::Fin { .. }) {
                    T_FIN
                } else {
                    T_DATA
                });
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
            Msg::Ring => out.push(T_RING),
        }
    }

    /// Decode one message from the front of `b`: `Ok(None)` if more bytes are needed.
    pub fn decode(b: &[u8]) -> Result<Option<(Msg, usize)>, WireError> {
        let Some(&t) = b.first() else { return Ok(None) };
        let need = match t {
            T_REG => 13,
            T_REG_LEGACY => 77,
            T_DEREG => 5,
            T_RTR => 25,
            T_FIN | T_DATA => 13,
            T_RING => 1,
            _ => return Err(WireError::Malformed("control message type")),
        };
        if b.len() < need {
            return Ok(None);
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let msg = match t {
            T_REG => Msg::Reg {
                region: u32_at(1),
                alloc_size: u64_at(5),
                legacy: None,
            },
            T_REG_LEGACY => Msg::Reg {
                region: u32_at(1),
                alloc_size: u64_at(5),
                legacy: Some(b[13..77].try_into().expect("64 bytes")),
            },
            T_DEREG => Msg::Dereg { region: u32_at(1) },
            T_RTR => Msg::Rtr {
                seq: u32_at(1),
                region: u32_at(5),
                offset: u64_at(9),
                cap: u64_at(17),
            },
            T_FIN => Msg::Fin {
                seq: u32_at(1),
                size: u64_at(5),
            },
            T_RING => Msg::Ring,
            _ => Msg::Data {
                seq: u32_at(1),
                size: u64_at(5),
            },
        };
        Ok(Some((msg, need)))
    }
}

/// Header of one part of a request on one TCP stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartHeader {
    pub seq: u32,
    pub offset: u64,
    pub len: u64,
    pub total: u64,
}

pub const PART_LEN: usize = 32;

impl PartHeader {
    pub fn encode(&self) -> [u8; PART_LEN] {
        let mut b = [0u8; PART_LEN];
        b[0..4].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; PART_LEN]) -> PartHeader {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        PartHeader {
            seq: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            offset: u64_at(8),
            len: u64_at(16),
            total: u64_at(24),
        }
    }
}

/// How a request of `size` bytes is split over `streams` TCP streams: contiguous parts of at
/// least `min_part` bytes (so small requests use few streams), starting at stream
/// `seq % streams` so that small requests spread over the streams. Returns (stream, offset, len).
pub fn split(seq: u32, size: u64, streams: usize, min_part: u64) -> Vec<(usize, u64, u64)> {
    let streams = streams.max(1);
    let parts = (size / min_part.max(1)).clamp(1, streams as u64);
    let base = size / parts;
    let mut out = Vec::with_capacity(parts as usize);
    let mut offset = 0;
    for i in 0..parts {
        let len = if i + 1 == parts { size - offset } else { base };
        out.push((((seq as u64 + i) % streams as u64) as usize, offset, len));
        offset += len;
    }
    out
}

/// What one end of an RDMA connection tells the other to reach its queue pair: its number and
/// first packet sequence number (24 bits each), the port's LID (InfiniBand) and GID (RoCE, or
/// routed InfiniBand), and its active MTU (`enum ibv_mtu`, 1..=5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub mtu: u8,
    pub gid: [u8; 16],
    /// The largest single message its port takes (`max_msg_sz`).
    pub max_msg: u32,
}

pub const RDMA_INFO_LEN: usize = 32;

impl RdmaInfo {
    pub fn encode(&self) -> [u8; RDMA_INFO_LEN] {
        let mut b = [0u8; RDMA_INFO_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10] = self.mtu;
        b[12..16].copy_from_slice(&self.max_msg.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    pub fn decode(b: &[u8; RDMA_INFO_LEN]) -> Result<RdmaInfo, WireError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let info = RdmaInfo {
            qpn: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_le_bytes([b[8], b[9]]),
            mtu: b[10],
            max_msg: u32_at(12),
            gid: b[16..32].try_into().expect("16 bytes"),
        };
        if info.qpn >= 1 << 24 || info.psn >= 1 << 24 {
            return Err(WireError::Malformed("RDMA queue pair or sequence number"));
        }
        if !(1..=5).contains(&info.mtu) {
            return Err(WireError::Malformed("RDMA MTU"));
        }
        if b[11] != 0 {
            return Err(WireError::Malformed("RDMA info padding"));
        }
        Ok(info)
    }
}

/// Control messages of the RDMA path on the bootstrap TCP stream. Receiver to sender: first
/// `Info` (or `Refuse`), then one `Slot` per posted receive, in receive order; sender to
/// receiver: only `Truncated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaMsg {
    /// The listener's queue pair, already moved to RTS toward the connector's.
    Info(RdmaInfo),
    /// The listener cannot use RDMA (no device here): the connector dials TCP streams instead.
    Refuse,
    /// Receive `seq` may be written: `size` bytes at `addr` under `rkey`.
    Slot {
        seq: u32,
        addr: u64,
        rkey: u32,
        size: u64,
    },
    /// Send `seq` of `size` bytes did not fit its slot; the sender failed it and the
    /// connection is done for.
    Truncated { seq: u32, size: u64 },
}

const R_INFO: u8 = 1;
const R_REFUSE: u8 = 2;
const R_SLOT: u8 = 3;
const R_TRUNCATED: u8 = 4;
pub const RDMA_SLOT_LEN: usize = 25;

impl RdmaMsg {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            RdmaMsg::Info(info) => {
                out.push(R_INFO);
                out.extend_from_slice(&info.encode());
            }
            RdmaMsg::Refuse => out.push(R_REFUSE),
            RdmaMsg::Slot {
                seq,
                addr,
                rkey,
                size,
            } => {
                out.push(R_SLOT);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&rkey.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
            RdmaMsg::Truncated { seq, size } => {
                out.push(R_TRUNCATED);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
        }
    }

    /// Decode one message from the front of `b`: `Ok(None)` if more bytes are needed.
    pub fn decode(b: &[u8]) -> Result<Option<(RdmaMsg, usize)>, WireError> {
        let Some(&t) = b.first() else { return Ok(None) };
        let need = match t {
            R_INFO => 1 + RDMA_INFO_LEN,
            R_REFUSE => 1,
            R_SLOT => RDMA_SLOT_LEN,
            R_TRUNCATED => 13,
            _ => return Err(WireError::Malformed("RDMA control message type")),
        };
        if b.len() < need {
            return Ok(None);
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let msg = match t {
            R_INFO => RdmaMsg::Info(RdmaInfo::decode(
                b[1..1 + RDMA_INFO_LEN].try_into().expect("info bytes"),
            )?),
            R_REFUSE => RdmaMsg::Refuse,
            R_TRUNCATED => RdmaMsg::Truncated {
                seq: u32_at(1),
                size: u64_at(5),
            },
            _ => RdmaMsg::Slot {
                seq: u32_at(1),
                addr: u64_at(5),
                rkey: u32_at(13),
                size: u64_at(17),
            },
        };
        Ok(Some((msg, need)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn handle_round_trips_v4_and_v6() {
        for tcp in [
            "10.1.2.3:4567".parse().unwrap(),
            "[fe80::1]:80".parse().unwrap(),
        ] {
            let h = ListenHandle {
                host: [7; 16],
                tcp,
                pid: 42,
                nonce: 0xdead_beef,
                secret: [9; 16],
            };
            let mut buf = [0u8; 128];
            h.encode(&mut buf);
            assert_eq!(ListenHandle::decode(&buf).unwrap(), h);
        }
        assert_eq!(ListenHandle::decode(&[0u8; 128]), Err(WireError::Magic(0)));
    }

    #[test]
    fn hello_rejects_bad_index() {
        let h = Hello {
            local: false,
            conn: 9,
            index: 3,
            streams: 4,
            pid: 1,
            secret: [5; 16],
            rdma: true,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::asks_rdma(&h.encode()));
        assert!(!Hello::asks_rdma(&Hello { rdma: false, ..h }.encode()));
        assert!(same_secret(&h.secret, &[5; 16]));
        assert!(!same_secret(
            &h.secret,
            &[[5; 15].as_slice(), &[6]].concat().try_into().unwrap()
        ));
        let bad = Hello { index: 4, ..h }.encode();
        assert!(Hello::decode(&bad).is_err());
    }

    fn any_msg() -> impl Strategy<Value = Msg> {
        prop_oneof![
            (any::<u32>(), any::<u64>(), any::<bool>(), any::<u8>()).prop_map(|(r, s, l, b)| {
                Msg::Reg {
                    region: r,
                    alloc_size: s,
                    legacy: l.then_some([b; 64]),
                }
            }),
            any::<u32>().prop_map(|r| Msg::Dereg { region: r }),
            (any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
                |(seq, region, offset, cap)| Msg::Rtr {
                    seq,
                    region,
                    offset,
                    cap
                }
            ),
            (any::<u32>(), any::<u64>()).prop_map(|(seq, size)| Msg::Fin { seq, size }),
            (any::<u32>(), any::<u64>()).prop_map(|(seq, size)| Msg::Data { seq, size }),
            Just(Msg::Ring),
        ]
    }

    fn any_rdma_msg() -> impl Strategy<Value = RdmaMsg> {
        prop_oneof![
            (
                0u32..1 << 24,
                0u32..1 << 24,
                any::<u16>(),
                1u8..=5,
                any::<[u8; 16]>(),
                any::<u32>()
            )
                .prop_map(|(qpn, psn, lid, mtu, gid, max_msg)| RdmaMsg::Info(
                    RdmaInfo {
                        qpn,
                        psn,
                        lid,
                        mtu,
                        gid,
                        max_msg
                    }
                )),
            Just(RdmaMsg::Refuse),
            (any::<u32>(), any::<u64>()).prop_map(|(seq, size)| RdmaMsg::Truncated { seq, size }),
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
                |(seq, addr, rkey, size)| RdmaMsg::Slot {
                    seq,
                    addr,
                    rkey,
                    size
                }
            ),
        ]
    }

    #[test]
    fn rdma_info_refuses_out_of_range_fields() {
        let info = RdmaInfo {
            qpn: 0x12_3456,
            psn: 7,
            lid: 3,
            mtu: 5,
            gid: [1; 16],
            max_msg: 1 << 30,
        };
        assert_eq!(RdmaInfo::decode(&info.encode()), Ok(info));
        for bad in [
            RdmaInfo {
                qpn: 1 << 24,
                ..info
            },
            RdmaInfo {
                psn: 1 << 24,
                ..info
            },
            RdmaInfo { mtu: 0, ..info },
            RdmaInfo { mtu: 6, ..info },
        ] {
            assert!(RdmaInfo::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn rdma_messages_decode_from_any_chunking(msgs in proptest::collection::vec(any_rdma_msg(), 1..20), cut in 1usize..40) {
            let mut bytes = Vec::new();
            for m in &msgs { m.encode(&mut bytes); }
            let mut buf = Vec::new();
            let mut got = Vec::new();
            for chunk in bytes.chunks(cut) {
                buf.extend_from_slice(chunk);
                while let Some((m, n)) = RdmaMsg::decode(&buf).unwrap() {
                    got.push(m);
                    buf.drain(..n);
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, msgs);
        }

        #[test]
        fn messages_decode_from_any_chunking(msgs in proptest::collection::vec(any_msg(), 1..20), cut in 1usize..40) {
            let mut bytes = Vec::new();
            for m in &msgs { m.encode(&mut bytes); }
            // feed the stream in chunks of `cut` bytes, as a socket might deliver it
            let mut buf = Vec::new();
            let mut got = Vec::new();
            for chunk in bytes.chunks(cut) {
                buf.extend_from_slice(chunk);
                while let Some((m, n)) = Msg::decode(&buf).unwrap() {
                    got.push(m);
                    buf.drain(..n);
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, msgs);
        }

        #[test]
        fn split_covers_the_request_exactly(seq in any::<u32>(), size in 0u64..(1 << 26), streams in 1usize..16) {
            let parts = split(seq, size, streams, 65536);
            prop_assert!(!parts.is_empty() && parts.len() <= streams);
            let mut offset = 0;
            let mut used = std::collections::HashSet::new();
            for (s, o, l) in parts {
                prop_assert!(s < streams);
                prop_assert!(used.insert(s), "one part per stream");
                prop_assert_eq!(o, offset);
                offset += l;
            }
            prop_assert_eq!(offset, size);
        }
    }
}
