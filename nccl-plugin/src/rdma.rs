//! The RDMA path (ibverbs) for connections that do not take the same-host path: one reliable
//! connected queue pair per connection, set up over the TCP stream the connection machinery
//! already makes (hello and secret checked as for TCP; then each end's `RdmaInfo`).
//!
//! Data moves by RDMA write with immediate from sender to receiver: for every `irecv` the
//! receiver posts a receive work request and sends the sender a `Slot` (address, rkey, size,
//! sequence number) over that TCP stream; the sender, once it holds the slot of its next
//! sequence number, writes its bytes straight into the receiver's buffer with `imm = seq`. The
//! send completes on its send-queue completion (the peer acknowledged the data), the receive on
//! the completion of its receive request, whose `byte_len` is the size sent. Without a slot,
//! `isend` returns a NULL request: NCCL's back-pressure. Nothing here waits: the control stream
//! is non-blocking, completion queues are polled.
//!
//! Whether the path is used is decided once per process (`device`): libibverbs loads, a device
//! has an ACTIVE port, and `VGPU_NCCL_IB` allows it; NCCL's log says which, and why not.

use crate::ibv::{self, Cq, Device, MemoryRegion, NoDevice, Qp, Remote};
use crate::log::info;
use crate::wire::{RDMA_INFO_LEN, RdmaInfo, RdmaMsg};
use crate::{Error, Mr};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// NCCL keeps at most this many requests in flight per comm (`NCCL_NET_MAX_REQUESTS`).
const MAX_REQUESTS: usize = crate::abi::NCCL_NET_MAX_REQUESTS;
/// Work requests per queue and entries per completion queue: twice NCCL's bound.
const DEPTH: u32 = 2 * MAX_REQUESTS as u32;
/// Control bytes a receiver may have queued unsent (slots of 25 bytes, at most 32 posted).
const OUT_MAX: usize = 4096;
/// How long a receive may stay pending after the sender closed the control stream (its last
/// completions may still be on their way) before it fails.
const GONE_GRACE: Duration = Duration::from_secs(2);
/// How long the connector waits for the listener's answer (its proxy thread polls accept).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The immediate's top bit is unused (sequence numbers travel modulo 2^31).
const SEQ_MASK: u32 = 0x7fff_ffff;

/// The process's RDMA device, or why there is none (opened once; the choice is logged once).
pub fn probe() -> &'static Result<Device, String> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let config = &crate::net::global().config;
        let result = open(config);
        match &result {
            Ok(d) => info!(
                crate::abi::NCCL_INIT | crate::abi::NCCL_NET,
                "other hosts: rdma over {} port {} ({}, MTU {}, GID index {}, largest message {} bytes, dma-buf {})",
                d.name,
                d.port.port,
                if d.port.link_layer == ibv::IBV_LINK_LAYER_ETHERNET {
                    "RoCE"
                } else {
                    "InfiniBand"
                },
                128u32 << d.port.mtu,
                d.port.gid_index,
                d.port.max_msg,
                if d.has_dmabuf() { "yes" } else { "no" }
            ),
            Err(why) => info!(
                crate::abi::NCCL_INIT | crate::abi::NCCL_NET,
                "other hosts: tcp ({why})"
            ),
        }
        result
    })
}

/// The RDMA device when the path is on.
pub fn device() -> Option<&'static Device> {
    probe().as_ref().ok()
}

fn open(config: &crate::config::Config) -> Result<Device, String> {
    if !config.ib {
        return Err("rdma disabled by VGPU_NCCL_IB=0".into());
    }
    let verbs = ibv::load(&config.ibverbs_lib)
        .map_err(|e| format!("no libibverbs ({}: {e})", config.ibverbs_lib))?;
    Device::open(verbs, config.ib_dev.as_deref(), config.ib_gid_index).map_err(|e| match e {
        NoDevice::None => "no RDMA device".to_owned(),
        NoDevice::NotFound(name) => format!("no RDMA device named {name} (VGPU_NCCL_IB_DEV)"),
        NoDevice::NoActivePort => "no active port on any RDMA device".to_owned(),
        NoDevice::Failed(e) => format!("RDMA device unusable: {e}"),
    })
}

/// The largest message both ends take (0 from a peer means "not said": 1 GiB).
fn max_message(local: u32, remote: u32) -> u64 {
    let known = |m: u32| if m == 0 { 1 << 30 } else { u64::from(m) };
    known(local).min(known(remote))
}

/// A queue pair with its completion queues, in INIT until `connect`. Field order is drop order:
/// the QP goes before its CQs.
struct Endpoint {
    qp: Qp,
    send_cq: Cq,
    recv_cq: Cq,
    psn: u32,
}

impl Endpoint {
    fn new(dev: &'static Device) -> Result<Endpoint, Error> {
        let send_cq = Cq::new(dev, DEPTH as usize)?;
        let recv_cq = Cq::new(dev, DEPTH as usize)?;
        let qp = Qp::new(dev, &send_cq, &recv_cq, DEPTH)?;
        // any 24-bit start works; a random one keeps a stale packet of an earlier QP with the
        // same number from matching
        let psn = (crate::net::random_u64() as u32) & 0xff_ffff;
        Ok(Endpoint {
            qp,
            send_cq,
            recv_cq,
            psn,
        })
    }

    fn info(&self, dev: &Device) -> RdmaInfo {
        RdmaInfo {
            qpn: self.qp.qpn(),
            psn: self.psn,
            lid: dev.port.lid,
            mtu: dev.port.mtu,
            gid: dev.port.gid.raw,
            max_msg: dev.port.max_msg,
        }
    }

    fn connect(&self, remote: &RdmaInfo) -> Result<(), Error> {
        let r = Remote {
            qpn: remote.qpn,
            psn: remote.psn,
            lid: remote.lid,
            gid: remote.gid,
            mtu: remote.mtu,
        };
        Ok(self.qp.connect(&r, self.psn)?)
    }
}

/// The memory regions one comm registered, by the id NCCL's `mhandle` carries.
#[derive(Default)]
struct Regions {
    map: HashMap<u32, MemoryRegion>,
    next: u32,
}

impl Regions {
    fn register(
        &mut self,
        dev: &'static Device,
        ptr: u64,
        size: usize,
        cuda: bool,
        dmabuf: Option<(u64, i32)>,
        access: i32,
    ) -> Result<Mr, Error> {
        let region = match dmabuf {
            Some((offset, fd)) if fd >= 0 && dev.has_dmabuf() => {
                MemoryRegion::register_dmabuf(dev, ptr, size, offset, fd, access)?
            }
            _ => MemoryRegion::register(dev, ptr, size, access)?,
        };
        let id = self.next;
        self.next = self.next.wrapping_add(1) % crate::wire::HOST_REGION;
        self.map.insert(id, region);
        Ok(Mr {
            ptr,
            size,
            cuda,
            region: id,
            base: ptr,
        })
    }

    fn deregister(&mut self, mr: &Mr) {
        self.map.remove(&mr.region);
    }

    /// The region of `mr`, if it covers `len` bytes at `ptr`.
    fn covering(&self, mr: &Mr, ptr: u64, len: u64) -> Result<&MemoryRegion, Error> {
        let r = self.map.get(&mr.region).ok_or(Error::Invalid(
            "buffer not registered on this RDMA connection",
        ))?;
        let inside = ptr >= r.addr
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= r.addr + r.len as u64);
        if !inside {
            return Err(Error::Invalid("buffer outside its registered region"));
        }
        Ok(r)
    }
}

/// Reads what the control stream has without waiting. `Ok(false)` at end of stream.
fn read_available(s: &mut TcpStream, into: &mut Vec<u8>) -> Result<bool, Error> {
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                into.extend_from_slice(&chunk[..n]);
                if into.len() > OUT_MAX {
                    return Err(Error::Protocol("RDMA control stream overflow"));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes what it can of `out` without waiting.
fn flush(s: &mut TcpStream, out: &mut Vec<u8>) -> Result<(), Error> {
    while !out.is_empty() {
        match s.write(out) {
            Ok(0) => return Err(Error::PeerClosed),
            Ok(n) => {
                out.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn status_error(wc: &ibv::ibv_wc) -> Error {
    Error::WorkRequest(wc.status)
}

// ---- sender ----

/// The connector's half of a bootstrap: sends its queue pair after the hello on `stream`
/// (already written by the caller) and waits, on the dialling thread, for the listener's.
/// `Ok(None)`: the listener has no RDMA (it refused or closed), so the caller dials TCP.
pub fn offer(mut stream: TcpStream) -> Result<Option<Sender>, Error> {
    let dev = device().ok_or(Error::Protocol("offer without an RDMA device"))?;
    let ep = Endpoint::new(dev)?;
    stream.write_all(&ep.info(dev).encode())?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    let (answer, used) = loop {
        if let Some(decoded) = RdmaMsg::decode(&buf)? {
            break decoded;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
        if buf.len() > 1 + RDMA_INFO_LEN + OUT_MAX {
            return Err(Error::Protocol("RDMA bootstrap overflow"));
        }
    };
    let remote = match answer {
        RdmaMsg::Info(remote) => remote,
        RdmaMsg::Refuse => return Ok(None),
        RdmaMsg::Slot { .. } | RdmaMsg::Truncated { .. } => {
            return Err(Error::Protocol(
                "RDMA bootstrap: a slot before the queue pair",
            ));
        }
    };
    ep.connect(&remote)?;
    buf.drain(..used);
    stream.set_read_timeout(None)?;
    stream.set_nonblocking(true)?;
    let mut sender = Sender {
        ep,
        control: stream,
        inbuf: buf,
        slots: VecDeque::new(),
        regions: Regions::default(),
        next_seq: 0,
        inflight: HashMap::new(),
        max_msg: max_message(dev.port.max_msg, remote.max_msg),
        closed: false,
        broken: false,
        dev,
    };
    sender.take_messages()?;
    Ok(Some(sender))
}

struct Slot {
    seq: u32,
    addr: u64,
    rkey: u32,
    size: u64,
}

struct SendState {
    size: usize,
    result: Option<Result<usize, Error>>,
}

pub struct Sender {
    ep: Endpoint,
    control: TcpStream,
    inbuf: Vec<u8>,
    /// Receives the peer posted that no send has taken yet, in sequence order.
    slots: VecDeque<Slot>,
    regions: Regions,
    next_seq: u32,
    inflight: HashMap<u32, SendState>,
    max_msg: u64,
    /// The receiver closed the control stream.
    closed: bool,
    /// A send was refused (truncation): the two ends no longer agree on sequence numbers.
    broken: bool,
    dev: &'static Device,
}

impl Sender {
    pub fn register(
        &mut self,
        ptr: u64,
        size: usize,
        cuda: bool,
        dmabuf: Option<(u64, i32)>,
    ) -> Result<Mr, Error> {
        self.regions
            .register(self.dev, ptr, size, cuda, dmabuf, ibv::ACCESS_SEND)
    }

    pub fn deregister(&mut self, mr: &Mr) {
        self.regions.deregister(mr);
    }

    /// Slots (and nothing else) arrive from the receiver.
    fn take_messages(&mut self) -> Result<(), Error> {
        if !self.closed && !read_available(&mut self.control, &mut self.inbuf)? {
            self.closed = true;
        }
        while let Some((msg, used)) = RdmaMsg::decode(&self.inbuf)? {
            self.inbuf.drain(..used);
            let RdmaMsg::Slot {
                seq,
                addr,
                rkey,
                size,
            } = msg
            else {
                return Err(Error::Protocol(
                    "RDMA: unexpected message from the receiver",
                ));
            };
            if self.slots.len() >= MAX_REQUESTS {
                return Err(Error::Protocol("RDMA: more receive slots than requests"));
            }
            self.slots.push_back(Slot {
                seq,
                addr,
                rkey,
                size,
            });
        }
        Ok(())
    }

    /// `Ok(None)` while the receiver has posted no receive for the next send (or 32 sends are
    /// in flight): NCCL retries.
    pub fn isend(&mut self, src: u64, size: usize, mr: &Mr) -> Result<Option<u32>, Error> {
        if self.broken {
            return Err(Error::Protocol(
                "RDMA connection unusable after a truncated send",
            ));
        }
        self.take_messages()?;
        if self.inflight.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let Some(slot) = self.slots.front() else {
            return if self.closed {
                Err(Error::PeerClosed)
            } else {
                Ok(None)
            };
        };
        let seq = self.next_seq;
        if slot.seq != seq {
            return Err(Error::Protocol("RDMA: receive slots out of sequence"));
        }
        if size as u64 > self.max_msg {
            return Err(Error::Invalid(
                "send larger than the RDMA port's largest message",
            ));
        }
        let slot = self.slots.pop_front().expect("checked above");
        self.next_seq = seq.wrapping_add(1);
        if size as u64 > slot.size {
            // the receiver learns it from the control stream (its posted request is left
            // unconsumed, so the connection is done for: NCCL aborts on the error anyway)
            self.broken = true;
            let mut note = Vec::new();
            RdmaMsg::Truncated {
                seq,
                size: size as u64,
            }
            .encode(&mut note);
            let _ = flush(&mut self.control, &mut note);
            return Err(Error::Truncated {
                sent: size,
                posted: slot.size as usize,
            });
        }
        let lkey = if size == 0 {
            0
        } else {
            self.regions.covering(mr, src, size as u64)?.lkey
        };
        self.ep.qp.post_write_imm(&ibv::WriteImm {
            wr_id: u64::from(seq),
            src,
            len: size as u32,
            lkey,
            remote_addr: slot.addr,
            rkey: slot.rkey,
            imm: seq & SEQ_MASK,
        })?;
        self.inflight.insert(seq, SendState { size, result: None });
        Ok(Some(seq))
    }

    fn reap(&mut self) -> Result<(), Error> {
        let mut wcs = [ibv::ibv_wc::default(); 16];
        loop {
            let n = self.ep.send_cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                let seq = wc.wr_id as u32;
                let Some(state) = self.inflight.get_mut(&seq) else {
                    return Err(Error::Protocol("RDMA: completion of an unknown send"));
                };
                state.result = Some(if wc.status == ibv::IBV_WC_SUCCESS {
                    Ok(state.size)
                } else {
                    Err(status_error(wc))
                });
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        self.reap()?;
        let Some(state) = self.inflight.get(&seq) else {
            return Err(Error::Protocol("unknown send"));
        };
        if state.result.is_none() {
            return Ok(None);
        }
        let state = self.inflight.remove(&seq).expect("present");
        state.result.expect("checked above").map(Some)
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }
}

// ---- receiver ----

/// The listener's half: `remote` is the connector's queue pair (read after its hello).
/// `Ok(None)` when this process has no RDMA device: the caller refuses the offer.
pub fn accept(mut stream: TcpStream, remote: &RdmaInfo) -> Result<Option<Receiver>, Error> {
    let Some(dev) = device() else {
        let mut refuse = Vec::new();
        RdmaMsg::Refuse.encode(&mut refuse);
        // best effort: the connector takes a closed stream as a refusal too
        let _ = stream.set_nonblocking(true);
        let _ = flush(&mut stream, &mut refuse);
        return Ok(None);
    };
    let ep = Endpoint::new(dev)?;
    ep.connect(remote)?;
    stream.set_nonblocking(true)?;
    stream.set_nodelay(true)?;
    let mut out = Vec::new();
    RdmaMsg::Info(ep.info(dev)).encode(&mut out);
    let mut r = Receiver {
        ep,
        control: stream,
        out,
        inbuf: Vec::new(),
        regions: Regions::default(),
        next_seq: 0,
        posted: HashMap::new(),
        done: HashMap::new(),
        gone_since: None,
        last_look: None,
        broken: None,
        max_msg: max_message(dev.port.max_msg, remote.max_msg),
        dev,
    };
    flush(&mut r.control, &mut r.out)?;
    Ok(Some(r))
}

pub struct Receiver {
    ep: Endpoint,
    control: TcpStream,
    /// Slots not yet written to the control stream.
    out: Vec<u8>,
    inbuf: Vec<u8>,
    regions: Regions,
    next_seq: u32,
    /// Posted receives not yet completed: their capacity.
    posted: HashMap<u32, u64>,
    done: HashMap<u32, Result<usize, Error>>,
    /// When the sender closed the control stream.
    gone_since: Option<Instant>,
    last_look: Option<Instant>,
    /// The sender refused a send as too large for receive `seq` (the size it had).
    broken: Option<(u32, u64)>,
    max_msg: u64,
    dev: &'static Device,
}

impl Receiver {
    pub fn register(
        &mut self,
        ptr: u64,
        size: usize,
        cuda: bool,
        dmabuf: Option<(u64, i32)>,
    ) -> Result<Mr, Error> {
        self.regions
            .register(self.dev, ptr, size, cuda, dmabuf, ibv::ACCESS_RECV)
    }

    pub fn deregister(&mut self, mr: &Mr) {
        self.regions.deregister(mr);
    }

    pub fn irecv(&mut self, ptr: u64, cap: usize, mr: &Mr) -> Result<u32, Error> {
        if self.posted.len() + self.done.len() >= MAX_REQUESTS {
            return Err(Error::Invalid("more than 32 receives in flight"));
        }
        // a slot larger than a single message cannot be filled by one write anyway
        let cap = (cap as u64).min(self.max_msg);
        let rkey = if cap == 0 {
            self.regions.map.get(&mr.region).map_or(0, |r| r.rkey)
        } else {
            self.regions.covering(mr, ptr, cap)?.rkey
        };
        let seq = self.next_seq;
        self.ep.qp.post_recv(u64::from(seq))?;
        self.next_seq = seq.wrapping_add(1);
        self.posted.insert(seq, cap);
        RdmaMsg::Slot {
            seq,
            addr: ptr,
            rkey,
            size: cap,
        }
        .encode(&mut self.out);
        assert!(
            self.out.len() <= OUT_MAX,
            "at most 32 slots are ever queued"
        );
        flush(&mut self.control, &mut self.out)?;
        Ok(seq)
    }

    fn reap(&mut self) -> Result<(), Error> {
        let mut wcs = [ibv::ibv_wc::default(); 16];
        loop {
            let n = self.ep.recv_cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                let seq = wc.wr_id as u32;
                let Some(cap) = self.posted.remove(&seq) else {
                    return Err(Error::Protocol("RDMA: completion of an unknown receive"));
                };
                let result = if wc.status != ibv::IBV_WC_SUCCESS {
                    Err(status_error(wc))
                } else if wc.wc_flags & ibv::IBV_WC_WITH_IMM == 0
                    || u32::from_be(wc.imm_data) & SEQ_MASK != seq & SEQ_MASK
                {
                    Err(Error::Protocol("RDMA: a write landed in the wrong receive"))
                } else if u64::from(wc.byte_len) > cap {
                    Err(Error::Truncated {
                        sent: wc.byte_len as usize,
                        posted: cap as usize,
                    })
                } else {
                    Ok(wc.byte_len as usize)
                };
                self.done.insert(seq, result);
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Reads the control stream at most once a millisecond: the sender's truncation notes, and
    /// whether it went away.
    fn look_at_sender(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        if self
            .last_look
            .is_some_and(|t| now.duration_since(t) < Duration::from_millis(1))
        {
            return Ok(());
        }
        self.last_look = Some(now);
        if self.gone_since.is_none() && !read_available(&mut self.control, &mut self.inbuf)? {
            self.gone_since = Some(now);
        }
        while let Some((msg, used)) = RdmaMsg::decode(&self.inbuf)? {
            self.inbuf.drain(..used);
            match msg {
                RdmaMsg::Truncated { seq, size } => self.broken = Some((seq, size)),
                _ => return Err(Error::Protocol("RDMA: unexpected message from the sender")),
            }
        }
        Ok(())
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        flush(&mut self.control, &mut self.out)?;
        self.reap()?;
        if let Some(result) = self.done.remove(&seq) {
            return result.map(Some);
        }
        let Some(&cap) = self.posted.get(&seq) else {
            return Err(Error::Protocol("unknown receive"));
        };
        self.look_at_sender()?;
        if let Some((bad, size)) = self.broken {
            // this receive and every later one will never be written
            if seq.wrapping_sub(bad) < 1 << 31 {
                self.posted.remove(&seq);
                return Err(Error::Truncated {
                    sent: size as usize,
                    posted: cap as usize,
                });
            }
        }
        if self.gone_since.is_some_and(|t| t.elapsed() > GONE_GRACE) {
            self.posted.remove(&seq);
            return Err(Error::PeerClosed);
        }
        Ok(None)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smaller_port_limit_wins_and_zero_means_one_gib() {
        assert_eq!(max_message(1 << 20, 1 << 30), 1 << 20);
        assert_eq!(max_message(0, 0), 1 << 30);
        assert_eq!(max_message(0, 4096), 4096);
    }
}
