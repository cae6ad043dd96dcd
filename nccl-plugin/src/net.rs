//! The connection layer: listen, connect and accept without blocking NCCL, then one of three
//! transports per connection: `local` (same host: Unix socket + GPU-to-GPU copies), `rdma`
//! (any connection that does not take the same-host path, when this process and the
//! listener's both have a usable RDMA device) or `tcp` (several streams with their own
//! threads).

use crate::config::{Config, host_id};
use crate::log::{info, warn};
use crate::wire::{HELLO_LEN, Hello, ListenHandle, RDMA_INFO_LEN, RdmaInfo, same_secret};
use crate::{Error, Mr, local, rdma, tcp};
use netshare::{Bucket, FlowId, Table};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Process-wide state: settings, host identity, the bandwidth table.
pub struct Global {
    pub config: Config,
    pub host: [u8; 16],
    pub addr: IpAddr,
    table: Option<Table>,
}

pub fn global() -> &'static Global {
    static G: OnceLock<Global> = OnceLock::new();
    G.get_or_init(|| {
        let config = Config::from_env();
        let addr = config.addr.unwrap_or_else(|| {
            crate::sys::first_ipv4()
                .map(IpAddr::V4)
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
        });
        let table = config
            .netshare
            .as_ref()
            .and_then(|(path, flow)| match Table::open(path) {
                Ok(t) => {
                    info!(
                        crate::abi::NCCL_NET,
                        "sends obey flow {flow} of bandwidth table {}",
                        path.display()
                    );
                    Some(t)
                }
                Err(e) => {
                    warn!(
                        crate::abi::NCCL_NET,
                        "bandwidth table {} unusable ({e}); sending unthrottled",
                        path.display()
                    );
                    None
                }
            });
        Global {
            config,
            host: host_id(),
            addr,
            table,
        }
    })
}

/// A 64-bit value unlikely to repeat (time, pid and a counter, mixed).
pub(crate) fn random_u64() -> u64 {
    nonce()
}

fn nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    // splitmix64 of time, pid and a counter: unique per listener and connection in practice
    let mut z = t ^ ((std::process::id() as u64) << 32) ^ c.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 16 bytes from the kernel's random source.
fn secret() -> Result<[u8; 16], Error> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

enum Incoming {
    Unix(UnixStream),
    Tcp(TcpStream),
}

struct Pending {
    stream: Incoming,
    buf: Vec<u8>,
    /// Bytes to read before the connection is complete: the hello, and after a TCP hello
    /// that asks for RDMA, the connector's queue pair.
    want: usize,
}

pub struct Listener {
    unix: Option<UnixListener>,
    tcp: TcpListener,
    pending: Vec<Pending>,
    groups: HashMap<u64, Vec<Option<TcpStream>>>,
    secret: [u8; 16],
}

impl Listener {
    /// Listen on a TCP port and an abstract Unix socket; write the handle.
    pub fn new(handle_out: &mut [u8]) -> Result<Listener, Error> {
        let g = global();
        let tcp = TcpListener::bind(SocketAddr::new(g.addr, 0))?;
        tcp.set_nonblocking(true)?;
        let pid = std::process::id();
        let nonce = nonce();
        let handle = ListenHandle {
            host: g.host,
            tcp: tcp.local_addr()?,
            pid,
            nonce,
            secret: secret()?,
        };
        let unix = if g.config.local {
            let addr = UnixAddr::from_abstract_name(handle.unix_name().as_bytes())?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => {
                    l.set_nonblocking(true)?;
                    Some(l)
                }
                Err(e) => {
                    warn!(
                        crate::abi::NCCL_NET,
                        "no same-host socket ({e}); peers on this host will use TCP"
                    );
                    None
                }
            }
        } else {
            None
        };
        handle.encode(handle_out);
        Ok(Listener {
            unix,
            tcp,
            pending: Vec::new(),
            groups: HashMap::new(),
            secret: handle.secret,
        })
    }

    /// Poll for a complete connection; `None` until one has arrived.
    pub fn accept(&mut self) -> Result<Option<RecvComm>, Error> {
        if let Some(u) = &self.unix {
            loop {
                match u.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(true)?;
                        self.pending.push(Pending {
                            stream: Incoming::Unix(s),
                            buf: Vec::new(),
                            want: HELLO_LEN,
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        loop {
            match self.tcp.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(true)?;
                    self.pending.push(Pending {
                        stream: Incoming::Tcp(s),
                        buf: Vec::new(),
                        want: HELLO_LEN,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let mut chunk = [0u8; HELLO_LEN + RDMA_INFO_LEN];
            let want = p.want - p.buf.len();
            let r = match &mut p.stream {
                Incoming::Unix(s) => s.read(&mut chunk[..want]),
                Incoming::Tcp(s) => s.read(&mut chunk[..want]),
            };
            match r {
                Ok(0) => {
                    self.pending.swap_remove(i);
                    continue;
                }
                Ok(n) => p.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => {
                    self.pending.swap_remove(i);
                    continue;
                }
            }
            if p.buf.len() == HELLO_LEN
                && p.want == HELLO_LEN
                && matches!(p.stream, Incoming::Tcp(_))
                && Hello::asks_rdma(&p.buf)
            {
                p.want = HELLO_LEN + RDMA_INFO_LEN;
            }
            if p.buf.len() < p.want {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            // A connection that does not present this listener's secret is not one of the
            // job's ranks (another process on the node found the socket): drop it and go on.
            let hello = match Hello::decode(p.buf[..HELLO_LEN].try_into().expect("HELLO_LEN bytes"))
            {
                Ok(hello) if same_secret(&hello.secret, &self.secret) => hello,
                Ok(hello) => {
                    warn!(
                        crate::abi::NCCL_NET,
                        "refused a connection from pid {} without this listener's secret",
                        hello.pid
                    );
                    continue;
                }
                Err(e) => {
                    warn!(crate::abi::NCCL_NET, "refused a connection: {e}");
                    continue;
                }
            };
            match p.stream {
                Incoming::Unix(s) => {
                    return Ok(Some(RecvComm {
                        t: RecvT::Local(local::Receiver::new(s)?),
                    }));
                }
                Incoming::Tcp(s) if hello.rdma => {
                    let info = match RdmaInfo::decode(
                        p.buf[HELLO_LEN..].try_into().expect("RDMA_INFO_LEN bytes"),
                    ) {
                        Ok(info) => info,
                        Err(e) => {
                            warn!(crate::abi::NCCL_NET, "refused an RDMA connection: {e}");
                            continue;
                        }
                    };
                    // no device here: the refusal sends the connector to TCP, which arrives
                    // as new streams
                    match rdma::accept(s, &info) {
                        Ok(Some(r)) => {
                            info!(crate::abi::NCCL_NET, "accepted (rdma)");
                            return Ok(Some(RecvComm {
                                t: RecvT::Rdma(Box::new(r)),
                            }));
                        }
                        Ok(None) => {}
                        // the stream is closed: the connector takes that as a refusal
                        Err(e) => warn!(
                            crate::abi::NCCL_NET,
                            "RDMA setup for pid {} failed ({e}); it will connect over TCP",
                            hello.pid
                        ),
                    }
                }
                Incoming::Tcp(s) => {
                    let group = self.groups.entry(hello.conn).or_default();
                    if group.is_empty() {
                        group.resize_with(hello.streams as usize, || None);
                    }
                    if hello.index as usize >= group.len() {
                        return Err(Error::Protocol(
                            "streams of one connection disagree on their count",
                        ));
                    }
                    group[hello.index as usize] = Some(s);
                    if group.iter().all(Option::is_some) {
                        let streams: Vec<TcpStream> = self
                            .groups
                            .remove(&hello.conn)
                            .expect("present")
                            .into_iter()
                            .flatten()
                            .collect();
                        return Ok(Some(RecvComm {
                            t: RecvT::Tcp(tcp::Receiver::new(streams)?),
                        }));
                    }
                }
            }
        }
        Ok(None)
    }
}

enum Connected {
    Local(UnixStream),
    Rdma(Box<rdma::Sender>),
    Tcp(Vec<TcpStream>),
}

/// A connect in progress; its pointer lives in NCCL's handle between calls.
pub struct Connecting {
    thread: Option<JoinHandle<Result<Connected, Error>>>,
}

fn dial(handle: ListenHandle) -> Result<Connected, Error> {
    let g = global();
    let conn = nonce();
    let pid = std::process::id();
    if g.config.local && handle.host == g.host {
        let addr = UnixAddr::from_abstract_name(handle.unix_name().as_bytes())?;
        match UnixStream::connect_addr(&addr) {
            Ok(mut s) => {
                s.write_all(
                    &Hello {
                        local: true,
                        conn,
                        index: 0,
                        streams: 1,
                        pid,
                        secret: handle.secret,
                        rdma: false,
                    }
                    .encode(),
                )?;
                return Ok(Connected::Local(s));
            }
            Err(e) => info!(
                crate::abi::NCCL_NET,
                "same-host socket of {} unreachable ({e}); using TCP", handle.pid
            ),
        }
    }
    if rdma::device().is_some() {
        let mut s = TcpStream::connect_timeout(&handle.tcp, Duration::from_secs(30))?;
        s.set_nodelay(true)?;
        s.write_all(
            &Hello {
                local: false,
                conn,
                index: 0,
                streams: 1,
                pid,
                secret: handle.secret,
                rdma: true,
            }
            .encode(),
        )?;
        // Only a refusal (or a stream closed before any answer) falls back to TCP: once the
        // listener answered, it has handed NCCL a receive comm for this connection, and a
        // second connection would be paired with the wrong connect.
        match rdma::offer(s)? {
            Some(sender) => return Ok(Connected::Rdma(Box::new(sender))),
            None => info!(
                crate::abi::NCCL_NET,
                "the listener of pid {} has no RDMA device; using TCP", handle.pid
            ),
        }
    }
    let n = g.config.sockets;
    let mut streams = Vec::with_capacity(n);
    for index in 0..n {
        let mut s = TcpStream::connect_timeout(&handle.tcp, Duration::from_secs(30))?;
        s.set_nodelay(true)?;
        s.write_all(
            &Hello {
                local: false,
                conn,
                index: index as u8,
                streams: n as u8,
                pid,
                secret: handle.secret,
                rdma: false,
            }
            .encode(),
        )?;
        streams.push(s);
    }
    Ok(Connected::Tcp(streams))
}

impl Connecting {
    pub fn start(handle: ListenHandle) -> Result<Connecting, Error> {
        let t = std::thread::Builder::new()
            .name("vgpu-nccl-dial".into())
            .spawn(move || dial(handle))?;
        Ok(Connecting { thread: Some(t) })
    }

    /// `None` while the connection is still being made.
    pub fn poll(&mut self) -> Result<Option<SendComm>, Error> {
        if !self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            return Ok(None);
        }
        let t = self.thread.take().expect("checked above");
        let connected = t
            .join()
            .map_err(|_| Error::Protocol("the connecting thread panicked"))??;
        let g = global();
        let t = match connected {
            Connected::Local(s) => SendT::Local(Box::new(local::Sender::new(s)?)),
            Connected::Rdma(s) => SendT::Rdma(s),
            Connected::Tcp(streams) => SendT::Tcp(tcp::Sender::new(streams, g.config.min_part)?),
        };
        let bucket = g
            .config
            .netshare
            .as_ref()
            .and_then(|(_, flow)| g.table.as_ref().map(|_| FlowId(*flow)));
        Ok(Some(SendComm { t, flow: bucket }))
    }
}

enum SendT {
    Local(Box<local::Sender>),
    Rdma(Box<rdma::Sender>),
    Tcp(tcp::Sender),
}

pub struct SendComm {
    t: SendT,
    flow: Option<FlowId>,
}

impl SendComm {
    pub fn kind(&self) -> &'static str {
        match self.t {
            SendT::Local(_) => "same-host",
            SendT::Rdma(_) => "rdma",
            SendT::Tcp(_) => "tcp",
        }
    }

    /// `dmabuf`: the (offset, fd) of `regMrDmaBuf`; only the RDMA path uses it.
    pub fn register(
        &mut self,
        ptr: u64,
        size: usize,
        cuda: bool,
        dmabuf: Option<(u64, i32)>,
    ) -> Result<Mr, Error> {
        match &mut self.t {
            SendT::Rdma(s) => s.register(ptr, size, cuda, dmabuf),
            SendT::Local(_) | SendT::Tcp(_) => {
                // the copy threads read GPU send buffers from the plugin's own context
                refuse_legacy(ptr, cuda)?;
                Ok(Mr {
                    ptr,
                    size,
                    cuda,
                    region: crate::wire::HOST_REGION,
                    base: ptr,
                })
            }
        }
    }

    pub fn deregister(&mut self, mr: &Mr) {
        if let SendT::Rdma(s) = &mut self.t {
            s.deregister(mr);
        }
    }

    /// `Ok(None)`: the tenant's bandwidth share has no tokens now; NCCL will retry.
    pub fn isend(&mut self, src: u64, size: usize, mr: &Mr) -> Result<Option<u32>, Error> {
        let bucket = self
            .flow
            .zip(global().table.as_ref())
            .and_then(|(flow, table)| table.bucket(flow));
        if bucket.is_some_and(|b| !admitted(&b, size)) {
            return Ok(None);
        }
        match &mut self.t {
            SendT::Local(s) => s.isend(src, size, mr).map(Some),
            SendT::Rdma(s) => s.isend(src, size, mr),
            SendT::Tcp(s) => s.isend(src, size, mr).map(Some),
        }
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        match &mut self.t {
            SendT::Local(s) => s.poll(seq),
            SendT::Rdma(s) => s.poll(seq),
            SendT::Tcp(s) => s.poll(seq),
        }
    }
}

/// The plugin's own CUDA context reaches cuMem allocations but stalls on legacy cudaMalloc
/// ones (a copy from one waited behind NCCL's kernel in the application's context: measured on
/// an H100 with `NCCL_CUMEM_ENABLE=0`): such GPU buffers are refused at registration, with
/// what to do, rather than hang the job.
fn refuse_legacy(ptr: u64, cuda: bool) -> Result<(), Error> {
    if cuda && global().config.own_context && !crate::cuda::driver()?.is_vmm(ptr)? {
        return Err(Error::LegacyGpuBuffer(ptr));
    }
    Ok(())
}

fn admitted(b: &Bucket<'_>, size: usize) -> bool {
    use netshare::Admission;
    matches!(
        b.try_consume(size as u64, netshare::shm::monotonic_now_ns()),
        Admission::Admitted | Admission::Gone
    )
}

enum RecvT {
    Local(local::Receiver),
    Rdma(Box<rdma::Receiver>),
    Tcp(tcp::Receiver),
}

pub struct RecvComm {
    t: RecvT,
}

impl RecvComm {
    /// `dmabuf`: the (offset, fd) of `regMrDmaBuf`; only the RDMA path uses it.
    pub fn register(
        &mut self,
        ptr: u64,
        size: usize,
        cuda: bool,
        dmabuf: Option<(u64, i32)>,
    ) -> Result<Mr, Error> {
        match &mut self.t {
            RecvT::Local(r) => r.register(ptr, size, cuda),
            RecvT::Rdma(r) => r.register(ptr, size, cuda, dmabuf),
            RecvT::Tcp(_) => {
                // the TCP threads copy into GPU receive buffers from the plugin's own context
                refuse_legacy(ptr, cuda)?;
                Ok(Mr {
                    ptr,
                    size,
                    cuda,
                    region: crate::wire::HOST_REGION,
                    base: ptr,
                })
            }
        }
    }

    pub fn deregister(&mut self, mr: &Mr) -> Result<(), Error> {
        match &mut self.t {
            RecvT::Local(r) => r.deregister(mr),
            RecvT::Rdma(r) => {
                r.deregister(mr);
                Ok(())
            }
            RecvT::Tcp(_) => Ok(()),
        }
    }

    pub fn irecv(&mut self, ptr: u64, cap: usize, mr: &Mr) -> Result<u32, Error> {
        match &mut self.t {
            RecvT::Local(r) => r.irecv(ptr, cap, mr),
            RecvT::Rdma(r) => r.irecv(ptr, cap, mr),
            RecvT::Tcp(r) => r.irecv(ptr, cap, mr),
        }
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        match &mut self.t {
            RecvT::Local(r) => r.poll(seq),
            RecvT::Rdma(r) => r.poll(seq),
            RecvT::Tcp(r) => r.poll(seq),
        }
    }
}
