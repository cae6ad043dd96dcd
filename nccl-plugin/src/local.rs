//! The same-host path: a Unix stream socket carries small control messages; data whose
//! destination is GPU memory is copied by the sender straight into the receiver's buffer
//! (CUDA IPC: cuMem file descriptors or legacy IPC handles; over NVLink between GPUs, or inside
//! one GPU between two slices), with no host bounce. Data whose destination is host memory (the
//! LL protocol's buffers, or hosts without GPUs) goes through the socket.
//!
//! Everything here runs on NCCL's proxy thread and never blocks: sockets are non-blocking, and
//! the sender's CUDA work runs on the process's copy threads (`copier`).
#![allow(unsafe_code)]

use crate::copier::{JOB_QUEUE, Job, Worker, now_ns};
use crate::cuda::{self, Export};
use crate::finring::FinRing;
use crate::log::trace;
use crate::sys;
use crate::wire::{HOST_REGION, Msg};
use crate::{Error, Mr};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// Bytes and payloads waiting to be written to the socket, in order.
#[derive(Default)]
struct Out {
    items: VecDeque<Item>,
}

enum Item {
    Bytes(Vec<u8>, usize),
    /// A message whose first byte carries a file descriptor.
    WithFd(Vec<u8>, OwnedFd),
    /// Payload straight from a registered host buffer; completes send `seq` when written.
    Payload {
        ptr: u64,
        len: usize,
        pos: usize,
        seq: u32,
    },
}

impl Out {
    fn msg(&mut self, m: Msg) {
        let mut b = Vec::with_capacity(80);
        m.encode(&mut b);
        self.items.push_back(Item::Bytes(b, 0));
    }

    /// Write what the socket takes; returns the sends whose payload is now fully written.
    fn flush(&mut self, sock: &UnixStream, completed: &mut Vec<u32>) -> Result<(), Error> {
        let fd = sock.as_raw_fd();
        while let Some(item) = self.items.front_mut() {
            match item {
                Item::Bytes(b, pos) => {
                    let n = sys::send(fd, &b[*pos..], None)?;
                    *pos += n;
                    if *pos < b.len() {
                        return Ok(());
                    }
                }
                Item::WithFd(b, owned) => {
                    let n = sys::send(fd, b, Some(owned.as_raw_fd()))?;
                    if n == 0 {
                        return Ok(());
                    }
                    // the descriptor went with the first byte; the rest is plain bytes
                    let rest = b[n..].to_vec();
                    *item = Item::Bytes(rest, 0);
                    continue;
                }
                Item::Payload { ptr, len, pos, seq } => {
                    if *pos < *len {
                        // SAFETY: NCCL keeps the registered send buffer valid until `test`
                        // reports this send done, which happens only after this write.
                        let n = unsafe {
                            sys::send_raw(fd, (*ptr as *const u8).add(*pos), *len - *pos)?
                        };
                        *pos += n;
                        if *pos < *len {
                            return Ok(());
                        }
                    }
                    completed.push(*seq);
                }
            }
            self.items.pop_front();
        }
        Ok(())
    }
}

/// A send's life. Its messages to the receiver (`Fin`, or `Data` + payload) must leave in send
/// order, because the receiver matches them to its receives in posting order: a later host
/// send may be ready before an earlier GPU copy has finished.
enum OpState {
    /// No ready-to-receive from the receiver yet.
    Waiting,
    /// The worker is copying into the receiver's GPU memory.
    Copying,
    /// The copy is on the GPU, which publishes its completion as ring entry `n`.
    OnGpu(u64),
    /// The worker is copying GPU data into staging, bound for the receiver's host memory.
    Staging,
    /// The copy (or staging, at the address given) is done; its messages may go out in order.
    Copied(Option<u64>),
    /// Host data bound for the receiver's host memory, ready to be written.
    HostReady,
    /// Its messages are queued; the payload (if any) is being written.
    Writing,
    /// Complete (its copy finished and `Fin` is queued); dropped at the end of the pass.
    Finished,
}

struct SendOp {
    seq: u32,
    src: u64,
    size: usize,
    cuda: bool,
    state: OpState,
    /// When NCCL posted it, and when its copy went to the worker (for `Timing`).
    posted_ns: u64,
    issued_ns: u64,
    /// Its copy's completion went to the receiver through the ring: no `Fin` is due.
    published: bool,
}

/// Where one connection's steps spent their time, logged when NCCL closes it (NCCL_DEBUG=INFO,
/// subsystem NET): the same-host GPU path is bound by per-step latency, and this says which
/// part of a step to shorten.
#[derive(Default)]
struct Timing {
    steps: u64,
    bytes: u64,
    /// Sender: isend until the receiver's ready-to-receive was there. Receiver: irecv until
    /// the sender's `Fin` (or data) arrived.
    wait_ns: u64,
    /// Sender: from handing a GPU copy to the worker until hearing that it finished.
    copy_ns: u64,
    max_copy_ns: u64,
    copies: u64,
    /// Sender: from the worker seeing a copy finish until the proxy thread heard of it (at
    /// NCCL's next `test` of that send).
    heard_ns: u64,
    /// The first step's start and the last step's end: steps / span is the connection's rate.
    first_ns: u64,
    last_ns: u64,
}

impl Timing {
    fn us(ns: u64, n: u64) -> f64 {
        ns as f64 / 1e3 / n.max(1) as f64
    }

    /// Count one step that started at `start_ns` and ended now.
    fn step(&mut self, start_ns: u64, bytes: usize) {
        let now = now_ns();
        if self.steps == 0 {
            self.first_ns = start_ns;
        }
        self.steps += 1;
        self.bytes += bytes as u64;
        self.wait_ns += now.saturating_sub(start_ns);
        self.last_ns = now;
    }

    /// Bytes moved, in MiB.
    fn mib(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64
    }

    /// Average time between step starts, in microseconds.
    fn interval_us(&self) -> f64 {
        Self::us(self.last_ns.saturating_sub(self.first_ns), self.steps)
    }
}

/// The oldest descriptor received with the socket's messages (they arrive in message order).
fn take_fd(fds: &mut Vec<OwnedFd>, missing: &'static str) -> Result<OwnedFd, Error> {
    if fds.is_empty() {
        return Err(Error::Protocol(missing));
    }
    Ok(fds.remove(0))
}

#[derive(Clone, Copy)]
struct Rtr {
    seq: u32,
    region: u32,
    offset: u64,
    cap: u64,
}

pub struct Sender {
    sock: UnixStream,
    out: Out,
    inbuf: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Registrations received before the worker exists (it starts at the first GPU send).
    early: Vec<Job>,
    rtrs: VecDeque<Rtr>,
    ops: VecDeque<SendOp>,
    done: HashMap<u32, usize>,
    next_seq: u32,
    worker: Option<Worker>,
    staging_busy: bool,
    timing: Timing,
    /// The receiver's completion ring (this side's mapping), once it arrived.
    ring: Option<Arc<FinRing>>,
    /// Copies whose completion the GPU published in the ring.
    gpu_completions: u64,
}

const READ_CHUNK: usize = 64 << 10;

impl Sender {
    pub fn new(sock: UnixStream) -> Result<Sender, Error> {
        sock.set_nonblocking(true)?;
        Ok(Sender {
            sock,
            out: Out::default(),
            inbuf: Vec::new(),
            fds: Vec::new(),
            early: Vec::new(),
            rtrs: VecDeque::new(),
            ops: VecDeque::new(),
            done: HashMap::new(),
            next_seq: 0,
            worker: None,
            staging_busy: false,
            timing: Timing::default(),
            ring: None,
            gpu_completions: 0,
        })
    }

    pub fn isend(&mut self, src: u64, size: usize, mr: &Mr) -> Result<u32, Error> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.ops.push_back(SendOp {
            seq,
            src,
            size,
            cuda: mr.cuda,
            state: OpState::Waiting,
            posted_ns: now_ns(),
            issued_ns: 0,
            published: false,
        });
        self.progress()?;
        Ok(seq)
    }

    /// `Some(size)` once send `seq` is complete (forgotten after this answer).
    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        if let Some(n) = self.done.remove(&seq) {
            return Ok(Some(n));
        }
        self.progress()?;
        Ok(self.done.remove(&seq))
    }

    fn worker(&mut self) -> Result<&mut Worker, Error> {
        if self.worker.is_none() {
            let mut w = Worker::start()?;
            for job in self.early.drain(..) {
                w.send(job)?;
            }
            self.worker = Some(w);
        }
        Ok(self.worker.as_mut().expect("set above"))
    }

    fn queue_job(&mut self, job: Job) -> Result<(), Error> {
        match &mut self.worker {
            Some(w) => w.send(job),
            None => {
                if self.early.len() >= JOB_QUEUE {
                    return Err(Error::Protocol(
                        "too many registrations before the first send",
                    ));
                }
                self.early.push(job);
                Ok(())
            }
        }
    }

    fn read(&mut self) -> Result<(), Error> {
        let mut buf = [0u8; READ_CHUNK];
        loop {
            match sys::recv_with_fds(&self.sock, &mut buf, &mut self.fds)? {
                None => break,
                Some(0) => return Err(Error::PeerClosed),
                Some(n) => self.inbuf.extend_from_slice(&buf[..n]),
            }
        }
        let mut used = 0;
        while let Some((msg, n)) = Msg::decode(&self.inbuf[used..])? {
            used += n;
            trace!(
                "same-host send: got {msg:?} (fds waiting {})",
                self.fds.len()
            );
            match msg {
                Msg::Reg {
                    region,
                    alloc_size,
                    legacy,
                } => {
                    let (export, fd) = match legacy {
                        Some(handle) => (
                            Export::Legacy {
                                handle: cuda::IpcHandle(handle),
                                alloc_size: alloc_size as usize,
                            },
                            None,
                        ),
                        None => {
                            let fd = take_fd(
                                &mut self.fds,
                                "a registration arrived without its descriptor",
                            )?;
                            (
                                Export::Fd {
                                    fd: fd.as_raw_fd(),
                                    alloc_size: alloc_size as usize,
                                },
                                Some(fd),
                            )
                        }
                    };
                    self.queue_job(Job::Region {
                        region,
                        export,
                        _fd: fd,
                    })?;
                }
                Msg::Dereg { region } => self.queue_job(Job::Forget { region })?,
                Msg::Ring => {
                    let fd = take_fd(
                        &mut self.fds,
                        "the completion ring arrived without its descriptor",
                    )?;
                    let ring = Arc::new(FinRing::open(&fd)?);
                    self.ring = Some(ring.clone());
                    self.queue_job(Job::Ring(ring))?;
                }
                Msg::Rtr {
                    seq,
                    region,
                    offset,
                    cap,
                } => self.rtrs.push_back(Rtr {
                    seq,
                    region,
                    offset,
                    cap,
                }),
                Msg::Fin { .. } | Msg::Data { .. } => {
                    return Err(Error::Protocol("receiver sent a sender message"));
                }
            }
        }
        self.inbuf.drain(..used);
        Ok(())
    }

    fn progress(&mut self) -> Result<(), Error> {
        // The receiver's messages (registrations, then ready-to-receive) matter only to a send
        // that waits for one; while every send is copying, NCCL's `test` calls skip the socket,
        // a system call each, which shortens NCCL's proxy loop for every connection. Messages
        // stay queued in order in the socket until then (a deregistration is applied at the
        // next send or at close).
        if self.ops.iter().any(|o| matches!(o.state, OpState::Waiting)) {
            self.read()?;
        }
        // start waiting sends in order, each with the next ready-to-receive
        for i in 0..self.ops.len() {
            if !matches!(self.ops[i].state, OpState::Waiting) {
                continue;
            }
            let Some(&rtr) = self.rtrs.front() else { break };
            let (seq, src, size, src_cuda) = {
                let op = &self.ops[i];
                (op.seq, op.src, op.size, op.cuda)
            };
            if rtr.seq != seq {
                return Err(Error::Protocol("sends and receives out of step"));
            }
            if size as u64 > rtr.cap {
                return Err(Error::Truncated {
                    sent: size,
                    posted: rtr.cap as usize,
                });
            }
            self.timing.step(self.ops[i].posted_ns, size);
            self.ops[i].issued_ns = now_ns();
            if rtr.region != HOST_REGION {
                self.worker()?.send(Job::Copy {
                    seq,
                    region: rtr.region,
                    offset: rtr.offset,
                    src,
                    size,
                    queued_ns: now_ns(),
                })?;
                self.ops[i].state = OpState::Copying;
            } else if src_cuda {
                if self.staging_busy {
                    break; // one staged send at a time; later sends keep their order
                }
                self.worker()?.send(Job::Stage { seq, src, size })?;
                self.staging_busy = true;
                self.ops[i].state = OpState::Staging;
            } else {
                self.ops[i].state = OpState::HostReady;
            }
            self.rtrs.pop_front();
        }
        // results from the worker
        if let Some(w) = self.worker.as_mut() {
            w.check_stall();
            while let Some(d) = w.try_done() {
                let staged = d.result.map_err(|e| {
                    crate::log::warn!(crate::abi::NCCL_NET, "same-host send {}: {e}", d.seq);
                    Error::Protocol("a GPU copy failed (see the log)")
                })?;
                if d.done_ns != 0 {
                    self.timing.heard_ns += now_ns().saturating_sub(d.done_ns);
                }
                if let Some(op) = self.ops.iter_mut().find(|o| o.seq == d.seq) {
                    op.published = d.published;
                    if let Some(slot) = d.ring_slot {
                        op.state = OpState::OnGpu(slot);
                        continue;
                    }
                    op.state = OpState::Copied(staged);
                    let took = now_ns().saturating_sub(op.issued_ns);
                    self.timing.copies += 1;
                    self.timing.copy_ns += took;
                    self.timing.max_copy_ns = self.timing.max_copy_ns.max(took);
                }
            }
        }
        // copies the GPU publishes: done once the ring's head has passed their entries (this
        // side reads the same page as the receiver)
        if let Some(ring) = &self.ring {
            let published = ring.published();
            for op in self.ops.iter_mut() {
                match op.state {
                    OpState::OnGpu(slot) if slot < published => {
                        op.state = OpState::Copied(None);
                        let took = now_ns().saturating_sub(op.issued_ns);
                        self.timing.copies += 1;
                        self.timing.copy_ns += took;
                        self.timing.max_copy_ns = self.timing.max_copy_ns.max(took);
                        self.gpu_completions += 1;
                    }
                    OpState::OnGpu(_) => break, // one stream: later copies finish later
                    _ => {}
                }
            }
        }
        // emit the receiver's messages in send order, stopping at the first send not ready
        for i in 0..self.ops.len() {
            let (seq, size, src) = (self.ops[i].seq, self.ops[i].size, self.ops[i].src);
            match self.ops[i].state {
                OpState::Waiting | OpState::Copying | OpState::OnGpu(_) | OpState::Staging => {
                    break;
                }
                OpState::Writing | OpState::Finished => {}
                OpState::HostReady => {
                    self.out.msg(Msg::Data {
                        seq,
                        size: size as u64,
                    });
                    self.out.items.push_back(Item::Payload {
                        ptr: src,
                        len: size,
                        pos: 0,
                        seq,
                    });
                    self.ops[i].state = OpState::Writing;
                }
                OpState::Copied(None) => {
                    if !self.ops[i].published {
                        self.out.msg(Msg::Fin {
                            seq,
                            size: size as u64,
                        });
                    }
                    self.done.insert(seq, size);
                    self.ops[i].state = OpState::Finished;
                }
                OpState::Copied(Some(staging)) => {
                    self.out.msg(Msg::Data {
                        seq,
                        size: size as u64,
                    });
                    self.out.items.push_back(Item::Payload {
                        ptr: staging,
                        len: size,
                        pos: 0,
                        seq,
                    });
                    self.ops[i].state = OpState::Writing;
                }
            }
        }
        let mut completed = Vec::new();
        self.out.flush(&self.sock, &mut completed)?;
        for seq in completed {
            if let Some(pos) = self.ops.iter().position(|o| o.seq == seq) {
                let op = self.ops.remove(pos).expect("position is valid");
                if op.cuda {
                    self.staging_busy = false;
                }
                self.done.insert(seq, op.size);
            }
        }
        self.ops.retain(|o| !matches!(o.state, OpState::Finished));
        Ok(())
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let t = &self.timing;
        if t.steps == 0 {
            return;
        }
        let (api, sleeps, worker_copies, pickup, gpu) =
            self.worker.as_ref().map_or((0, 0, 0, 0, 0), |w| {
                use std::sync::atomic::Ordering::Relaxed;
                let sh = &w.counters;
                (
                    sh.api_ns.load(Relaxed),
                    w.sleeps(),
                    sh.copies.load(Relaxed),
                    sh.pickup_ns.load(Relaxed),
                    sh.gpu_ns.load(Relaxed),
                )
            });
        crate::log::info!(
            crate::abi::NCCL_NET,
            "same-host send closed: {} steps, {:.1} MiB, one every {:.1} us; per step: waited {:.1} us for the receiver, GPU copy {:.1} us (max {:.1}) = until the copy thread took it {:.1} + cuMemcpyAsync {:.1} + until its event completed {:.1} + until the proxy heard {:.1}; {} completions published by the GPU (for those, the copy is the whole time from issue to the proxy seeing the ring); its copy thread slept {} times",
            t.steps,
            t.mib(),
            t.interval_us(),
            Timing::us(t.wait_ns, t.steps),
            Timing::us(t.copy_ns, t.copies),
            t.max_copy_ns as f64 / 1e3,
            Timing::us(pickup, worker_copies),
            Timing::us(api, worker_copies),
            Timing::us(gpu, worker_copies),
            Timing::us(t.heard_ns, t.copies),
            self.gpu_completions,
            sleeps
        );
    }
}

struct Posted {
    seq: u32,
    ptr: u64,
    cap: usize,
    posted_ns: u64,
    /// Into GPU memory: the sender copies, and completes it with `Fin` or through the ring.
    device: bool,
}

/// With the completion ring, how often a receiver whose oldest receive waits for a GPU copy
/// still reads the socket (only to notice a sender that went away): 1 ms.
const RING_READ_EVERY_NS: u64 = 1_000_000;

struct Incoming {
    seq: u32,
    ptr: u64,
    size: usize,
    got: usize,
}

pub struct Receiver {
    sock: UnixStream,
    out: Out,
    inbuf: Vec<u8>,
    next_region: u32,
    posted: VecDeque<Posted>,
    incoming: Option<Incoming>,
    done: HashMap<u32, usize>,
    next_seq: u32,
    timing: Timing,
    /// The completion ring (`VGPU_NCCL_FIN_RING`): GPU copies complete through it, never by a
    /// `Fin` message.
    ring: Option<FinRing>,
    /// Receives completed through the ring, for the close-time summary.
    ring_completions: u64,
    /// When the socket was last read.
    read_ns: u64,
    /// The sender closed its end (end of stream, or reset). What it wrote before still
    /// completes receives; a receive that nothing completes fails with `PeerClosed`.
    peer_closed: bool,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let t = &self.timing;
        if t.steps > 0 {
            crate::log::info!(
                crate::abi::NCCL_NET,
                "same-host recv closed: {} steps, {:.1} MiB, one every {:.1} us; per step: {:.1} us from posting to the sender's completion; {} completed through the ring",
                t.steps,
                t.mib(),
                t.interval_us(),
                Timing::us(t.wait_ns, t.steps),
                self.ring_completions
            );
        }
    }
}

impl Receiver {
    /// A receiver with the completion ring or not as configured (`VGPU_NCCL_FIN_RING`).
    pub fn new(sock: UnixStream) -> Result<Receiver, Error> {
        Receiver::with_ring(sock, crate::net::global().config.fin_ring)
    }

    /// A receiver whose GPU receives complete through the completion ring (`ring`), or
    /// through the sender's `Fin` messages.
    pub fn with_ring(sock: UnixStream, ring: bool) -> Result<Receiver, Error> {
        sock.set_nonblocking(true)?;
        let mut out = Out::default();
        // the ring goes first, before any ready-to-receive, so that the sender completes
        // every GPU copy of this connection through it
        let ring = if ring {
            let (ring, fd) = FinRing::create()?;
            let mut b = Vec::new();
            Msg::Ring.encode(&mut b);
            out.items.push_back(Item::WithFd(b, fd));
            Some(ring)
        } else {
            None
        };
        Ok(Receiver {
            sock,
            out,
            inbuf: Vec::new(),
            next_region: 0,
            posted: VecDeque::new(),
            incoming: None,
            done: HashMap::new(),
            next_seq: 0,
            timing: Timing::default(),
            ring,
            ring_completions: 0,
            read_ns: 0,
            peer_closed: false,
        })
    }

    /// Register a receive buffer: GPU memory is exported to the sender.
    pub fn register(&mut self, ptr: u64, size: usize, cuda: bool) -> Result<Mr, Error> {
        if !cuda {
            return Ok(Mr {
                ptr,
                size,
                cuda,
                region: HOST_REGION,
                base: ptr,
            });
        }
        let driver = cuda::driver()?;
        let (export, base) = driver.export(ptr)?;
        let region = self.next_region;
        self.next_region += 1;
        trace!(
            "same-host recv: region {region} = {ptr:#x}+{size} (allocation {base:#x}, {})",
            match export {
                Export::Fd { .. } => "cuMem fd",
                Export::Legacy { .. } => "legacy IPC",
            }
        );
        match export {
            Export::Fd { fd, alloc_size } => {
                let mut b = Vec::new();
                Msg::Reg {
                    region,
                    alloc_size: alloc_size as u64,
                    legacy: None,
                }
                .encode(&mut b);
                // SAFETY: `fd` was just returned by cuMemExportToShareableHandle and is ours.
                let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                self.out.items.push_back(Item::WithFd(b, owned));
            }
            Export::Legacy { handle, alloc_size } => {
                self.out.msg(Msg::Reg {
                    region,
                    alloc_size: alloc_size as u64,
                    legacy: Some(handle.0),
                });
            }
        }
        self.flush()?;
        Ok(Mr {
            ptr,
            size,
            cuda,
            region,
            base,
        })
    }

    /// Tells the sender to forget region `mr`. The ranks of a communicator tear down in any
    /// order, so the sender may have closed its end already: then nothing of ours is mapped
    /// there any more, and the deregistration succeeds.
    pub fn deregister(&mut self, mr: &Mr) -> Result<(), Error> {
        if mr.region != HOST_REGION {
            self.out.msg(Msg::Dereg { region: mr.region });
            self.flush()?;
        }
        Ok(())
    }

    pub fn irecv(&mut self, ptr: u64, cap: usize, mr: &Mr) -> Result<u32, Error> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let (region, offset) = if mr.region == HOST_REGION {
            (HOST_REGION, 0)
        } else {
            (mr.region, ptr - mr.base)
        };
        self.out.msg(Msg::Rtr {
            seq,
            region,
            offset,
            cap: cap as u64,
        });
        self.posted.push_back(Posted {
            seq,
            ptr,
            cap,
            posted_ns: now_ns(),
            device: region != HOST_REGION,
        });
        self.progress()?;
        Ok(seq)
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        if let Some(n) = self.done.remove(&seq) {
            return Ok(Some(n));
        }
        self.progress()?;
        match self.done.remove(&seq) {
            Some(n) => Ok(Some(n)),
            None if self.peer_closed => Err(Error::PeerClosed),
            None => Ok(None),
        }
    }

    fn flush(&mut self) -> Result<(), Error> {
        let mut none = Vec::new();
        let r = self.out.flush(&self.sock, &mut none);
        self.end_if_peer_gone(r)
    }

    /// Takes a socket error that says the sender has gone as the end of its stream: the
    /// ranks of a communicator close in any order, and a sender may close right after its
    /// last `Fin` (with our later messages unread, which Linux reports to us as a reset).
    fn end_if_peer_gone(&mut self, r: Result<(), Error>) -> Result<(), Error> {
        match r {
            Err(e) if e.peer_gone() => {
                trace!("same-host recv: the sender has gone ({e})");
                self.peer_closed = true;
                self.out = Out::default();
                Ok(())
            }
            other => other,
        }
    }

    /// The oldest posted receive, which the sender's completion of `seq` (`size` bytes) ends:
    /// checked and counted in the step timing.
    fn take_front(&mut self, seq: u32, size: u64) -> Result<Posted, Error> {
        let p = self
            .posted
            .pop_front()
            .ok_or(Error::Protocol("data for no posted receive"))?;
        if p.seq != seq {
            return Err(Error::Protocol("sends and receives out of step"));
        }
        if size as usize > p.cap {
            return Err(Error::Truncated {
                sent: size as usize,
                posted: p.cap,
            });
        }
        self.timing.step(p.posted_ns, size as usize);
        Ok(p)
    }

    fn progress(&mut self) -> Result<(), Error> {
        self.flush()?;
        let fd = self.sock.as_raw_fd();
        loop {
            // payload bytes go straight into the posted buffer
            if let Some(inc) = self.incoming.as_mut() {
                if !self.inbuf.is_empty() {
                    let take = self.inbuf.len().min(inc.size - inc.got);
                    // SAFETY: the posted receive buffer is valid for `size` <= cap bytes until
                    // this receive is reported done.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.inbuf.as_ptr(),
                            (inc.ptr as *mut u8).add(inc.got),
                            take,
                        );
                    }
                    inc.got += take;
                    self.inbuf.drain(..take);
                }
                if inc.got < inc.size {
                    if self.peer_closed {
                        return Ok(());
                    }
                    // SAFETY: as above; the range written is within the posted buffer.
                    let r = unsafe {
                        sys::recv_raw(fd, (inc.ptr as *mut u8).add(inc.got), inc.size - inc.got)
                    };
                    match r {
                        Ok(None) => return Ok(()),
                        Ok(Some(0)) => return self.end_if_peer_gone(Err(Error::PeerClosed)),
                        Ok(Some(n)) => inc.got += n,
                        Err(e) => return self.end_if_peer_gone(Err(e.into())),
                    }
                }
                if inc.got == inc.size {
                    self.done.insert(inc.seq, inc.size);
                    self.incoming = None;
                }
                continue;
            }
            // A GPU copy completed through the ring. Entries come in send order, but a host
            // receive posted earlier may still wait for its data on the socket: an entry is taken
            // only for the oldest posted receive. (The sender writes a later receive's socket
            // message only after an earlier copy's entry is published.)
            if let Some((ring, (seq, size))) = self.ring.as_ref().and_then(|r| Some((r, r.peek()?)))
                && self.posted.front().is_some_and(|p| p.seq == seq)
            {
                ring.pop();
                self.ring_completions += 1;
                self.take_front(seq, size)?;
                self.done.insert(seq, size as usize);
                continue;
            }
            if let Some((msg, n)) = Msg::decode(&self.inbuf)? {
                self.inbuf.drain(..n);
                trace!("same-host recv: got {msg:?}");
                match msg {
                    Msg::Fin { .. } if self.ring.is_some() => {
                        return Err(Error::Protocol(
                            "a Fin on the socket although the completion ring is in use",
                        ));
                    }
                    Msg::Fin { seq, size } | Msg::Data { seq, size } => {
                        let p = self.take_front(seq, size)?;
                        if matches!(msg, Msg::Fin { .. }) || size == 0 {
                            self.done.insert(seq, size as usize);
                        } else {
                            self.incoming = Some(Incoming {
                                seq,
                                ptr: p.ptr,
                                size: size as usize,
                                got: 0,
                            });
                        }
                    }
                    _ => return Err(Error::Protocol("sender sent a receiver message")),
                }
                continue;
            }
            // With the ring, the oldest receive into GPU memory can only complete through it;
            // the socket (data for later host receives, a closed peer) can wait a while, and
            // NCCL's `test` calls skip a system call each.
            if self.peer_closed {
                return Ok(());
            }
            let now = now_ns();
            if self.ring.is_some()
                && self.posted.front().is_some_and(|p| p.device)
                && now.saturating_sub(self.read_ns) < RING_READ_EVERY_NS
            {
                return Ok(());
            }
            self.read_ns = now;
            let mut buf = [0u8; 4096];
            // SAFETY: a local buffer of the given length.
            match unsafe { sys::recv_raw(fd, buf.as_mut_ptr(), buf.len()) } {
                Ok(None) => return Ok(()),
                Ok(Some(0)) => return self.end_if_peer_gone(Err(Error::PeerClosed)),
                Ok(Some(n)) => self.inbuf.extend_from_slice(&buf[..n]),
                Err(e) => return self.end_if_peer_gone(Err(e.into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HOST_REGION, Msg, Receiver};
    use crate::{Error, Mr};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn deregistering_after_the_sender_closed_succeeds() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut rx = Receiver::with_ring(ours, false).unwrap();
        let mr = |region| Mr {
            ptr: 0x1000,
            size: 4096,
            cuda: true,
            region,
            base: 0x1000,
        };
        // while the sender is there, it hears of the deregistration
        rx.deregister(&mr(3)).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let mut heard = [0u8; 256];
        assert!((&theirs).read(&mut heard).unwrap() > 0, "no message sent");
        // ranks tear down in any order: a sender that closed first forgets everything itself
        drop(theirs);
        rx.deregister(&mr(4)).unwrap();
        rx.deregister(&mr(HOST_REGION)).unwrap();
    }

    /// A sender may close right after its last `Fin`, with or without reading what we wrote
    /// (unread, Linux reports a reset): the receives its messages completed still complete,
    /// and only a receive that nothing completes fails.
    #[test]
    fn a_sender_that_closes_after_its_last_fin_completes_the_receive() {
        for sender_reads in [true, false] {
            let (ours, mut theirs) = UnixStream::pair().unwrap();
            let mut rx = Receiver::with_ring(ours, false).unwrap();
            let mr = Mr {
                ptr: 0x10000,
                size: 1 << 20,
                cuda: true,
                region: 2,
                base: 0x10000,
            };
            let seq = rx.irecv(0x10000, 4096, &mr).unwrap();
            if sender_reads {
                theirs.set_nonblocking(true).unwrap();
                let mut rtr = [0u8; 256];
                assert!(theirs.read(&mut rtr).unwrap() > 0, "no ready-to-receive");
            }
            let mut fin = Vec::new();
            Msg::Fin { seq, size: 4000 }.encode(&mut fin);
            theirs.write_all(&fin).unwrap();
            drop(theirs);
            // (another test of this process may fork in between: its child holds our peer's
            // descriptor until it execs, so the end of the stream can come a moment late)
            let deadline = Instant::now() + Duration::from_secs(5);
            let got = loop {
                match rx.poll(seq).unwrap() {
                    Some(n) => break n,
                    None if Instant::now() < deadline => std::thread::sleep(ms(1)),
                    None => panic!("the Fin never completed the receive"),
                }
            };
            assert_eq!(got, 4000, "sender read: {sender_reads}");
            let next = rx.irecv(0x10000, 4096, &mr).unwrap();
            let r = loop {
                match rx.poll(next) {
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(ms(1)),
                    other => break other,
                }
            };
            assert!(
                matches!(r, Err(Error::PeerClosed)),
                "a receive nothing completes fails (sender read: {sender_reads}): {r:?}"
            );
        }
    }
}
