//! The cross-host path: each connection has several TCP streams, each served by its own thread
//! on both ends. A request is cut into contiguous parts, one per stream, so one large request
//! uses every stream at once. NCCL's proxy thread only hands parts to the threads (bounded
//! queues that cannot fill: NCCL keeps at most 32 requests in flight per connection and each
//! request puts at most one part on a stream) and polls atomic counters.
//!
//! GPU buffers are staged through pinned host memory by the stream threads.
#![allow(unsafe_code)]

use crate::cuda;
use crate::sys::SendPtr;
use crate::wire::{PART_LEN, PartHeader, split};
use crate::{Error, Mr};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Parts queued per stream thread: twice NCCL's in-flight bound.
const QUEUE: usize = 64;
/// Pinned staging per stream thread for GPU buffers.
const STAGING: usize = 4 << 20;

/// Completion state of one request, shared with the stream threads.
#[derive(Default)]
pub struct ReqState {
    parts: AtomicUsize,
    parts_done: AtomicUsize,
    bytes: AtomicU64,
    total: AtomicU64,
    failed: AtomicBool,
    seen: AtomicBool,
}

struct Part {
    req: Arc<ReqState>,
    header: PartHeader,
    src: SendPtr,
    cuda: bool,
}

/// The application's context and device when the connection was made (NCCL's proxy thread has
/// them current); stream threads copy GPU memory in the plugin's own context on that device
/// (`context::enter_copy_context`).
#[derive(Clone, Copy)]
struct Ctx(usize, i32);

fn current_ctx() -> Option<Ctx> {
    let driver = cuda::driver().ok()?;
    let ctx = driver.current_context().ok().filter(|c| !c.is_null())?;
    let device = driver.current_device().ok()?;
    Some(Ctx(ctx as usize, device))
}

/// Pinned staging and a stream, made lazily by a thread that meets GPU memory.
struct Staging {
    driver: &'static cuda::Cuda,
    buf: *mut u8,
    stream: cuda::CUstream,
}

impl Staging {
    fn new(ctx: Option<Ctx>) -> Result<Staging, Error> {
        let driver = cuda::driver()?;
        let ctx = ctx.ok_or(Error::Protocol(
            "a GPU buffer on a connection made without a CUDA context",
        ))?;
        crate::context::enter_copy_context(driver, ctx.0, ctx.1)?;
        let buf = driver.host_alloc(STAGING)?;
        let stream = driver.stream()?;
        Ok(Staging {
            driver,
            buf,
            stream,
        })
    }

    fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), Error> {
        self.driver.copy_async(dst, src, n, self.stream)?;
        Ok(self.driver.synchronize(self.stream)?)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.driver.free_host(self.buf);
        self.driver.destroy_stream(self.stream);
    }
}

fn send_part(
    stream: &mut TcpStream,
    part: &Part,
    staging: &mut Option<Staging>,
    ctx: Option<Ctx>,
) -> Result<(), Error> {
    stream.write_all(&part.header.encode())?;
    let len = part.header.len as usize;
    let src = part.src.0 + part.header.offset;
    if !part.cuda {
        // SAFETY: NCCL keeps the send buffer valid until the request is reported done, which
        // needs this part's completion; this thread alone reads this range.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
        stream.write_all(bytes)?;
        return Ok(());
    }
    if staging.is_none() {
        *staging = Some(Staging::new(ctx)?);
    }
    let s = staging.as_ref().expect("set above");
    let mut done = 0;
    while done < len {
        let n = (len - done).min(STAGING);
        s.copy(s.buf as u64, src + done as u64, n)?;
        // SAFETY: the staging buffer holds `n` bytes just copied.
        stream.write_all(unsafe { std::slice::from_raw_parts(s.buf, n) })?;
        done += n;
    }
    Ok(())
}

pub struct Sender {
    queues: Vec<SyncSender<Part>>,
    threads: Vec<JoinHandle<()>>,
    streams: Vec<TcpStream>,
    inflight: HashMap<u32, Arc<ReqState>>,
    next_seq: u32,
    min_part: u64,
}

impl Sender {
    pub fn new(streams: Vec<TcpStream>, min_part: u64) -> Result<Sender, Error> {
        let ctx = current_ctx();
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        let mut keep = Vec::new();
        for (i, s) in streams.into_iter().enumerate() {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            keep.push(s.try_clone()?);
            let (tx, rx) = sync_channel::<Part>(QUEUE);
            let mut stream = s;
            let t = std::thread::Builder::new()
                .name(format!("vgpu-nccl-tx{i}"))
                .spawn(move || {
                    let mut staging = None;
                    while let Ok(part) = rx.recv() {
                        if send_part(&mut stream, &part, &mut staging, ctx).is_err() {
                            part.req.failed.store(true, Ordering::Release);
                        }
                        part.req.parts_done.fetch_add(1, Ordering::AcqRel);
                    }
                })?;
            queues.push(tx);
            threads.push(t);
        }
        Ok(Sender {
            queues,
            threads,
            streams: keep,
            inflight: HashMap::new(),
            next_seq: 0,
            min_part,
        })
    }

    pub fn isend(&mut self, src: u64, size: usize, mr: &Mr) -> Result<u32, Error> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let parts = split(seq, size as u64, self.queues.len(), self.min_part);
        let req = Arc::new(ReqState::default());
        req.parts.store(parts.len(), Ordering::Release);
        req.total.store(size as u64, Ordering::Release);
        for (stream, offset, len) in parts {
            let header = PartHeader {
                seq,
                offset,
                len,
                total: size as u64,
            };
            let part = Part {
                req: req.clone(),
                header,
                src: SendPtr(src),
                cuda: mr.cuda,
            };
            self.queues[stream]
                .try_send(part)
                .map_err(|_| Error::Protocol("stream queue full or closed"))?;
        }
        self.inflight.insert(seq, req);
        Ok(seq)
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        let Some(req) = self.inflight.get(&seq) else {
            return Err(Error::Protocol("unknown send"));
        };
        if req.parts_done.load(Ordering::Acquire) < req.parts.load(Ordering::Acquire) {
            return Ok(None);
        }
        let req = self.inflight.remove(&seq).expect("present");
        if req.failed.load(Ordering::Acquire) {
            return Err(Error::PeerClosed);
        }
        Ok(Some(req.total.load(Ordering::Acquire) as usize))
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

struct Posted {
    req: Arc<ReqState>,
    ptr: SendPtr,
    cap: u64,
    cuda: bool,
}

/// Receives posted but not yet complete, by sequence number; the stream threads wait here for
/// the receive their next part belongs to.
#[derive(Default)]
struct Board {
    posted: Mutex<HashMap<u32, Posted>>,
    changed: Condvar,
    closing: AtomicBool,
}

fn recv_part(
    stream: &mut TcpStream,
    board: &Board,
    staging: &mut Option<Staging>,
    ctx: Option<Ctx>,
) -> Result<bool, Error> {
    let mut hb = [0u8; PART_LEN];
    if let Err(e) = stream.read_exact(&mut hb) {
        return if board.closing.load(Ordering::Acquire) {
            Ok(false)
        } else {
            Err(e.into())
        };
    }
    let h = PartHeader::decode(&hb);
    // wait for the matching irecv
    let (req, ptr, cap, cuda) = {
        let mut posted = board.posted.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(p) = posted.get(&h.seq) {
                break (p.req.clone(), p.ptr, p.cap, p.cuda);
            }
            if board.closing.load(Ordering::Acquire) {
                return Ok(false);
            }
            posted = board
                .changed
                .wait_timeout(posted, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    };
    req.total.store(h.total, Ordering::Release);
    let fits = h.offset.checked_add(h.len).is_some_and(|end| end <= cap) && h.total <= cap;
    let len = h.len as usize;
    if !fits {
        req.failed.store(true, Ordering::Release);
        let mut sink = vec![0u8; 64 << 10];
        let mut left = len;
        while left > 0 {
            let n = left.min(sink.len());
            stream.read_exact(&mut sink[..n])?;
            left -= n;
        }
    } else if !cuda {
        // SAFETY: the posted buffer is valid for `cap` bytes until the receive is reported done;
        // parts of one request cover disjoint ranges and this thread alone writes this one.
        let dst = unsafe { std::slice::from_raw_parts_mut((ptr.0 + h.offset) as *mut u8, len) };
        stream.read_exact(dst)?;
    } else {
        if staging.is_none() {
            *staging = Some(Staging::new(ctx)?);
        }
        let s = staging.as_ref().expect("set above");
        let mut done = 0;
        while done < len {
            let n = (len - done).min(STAGING);
            // SAFETY: the staging buffer has STAGING bytes.
            stream.read_exact(unsafe { std::slice::from_raw_parts_mut(s.buf, n) })?;
            s.copy(ptr.0 + h.offset + done as u64, s.buf as u64, n)?;
            done += n;
        }
    }
    req.bytes.fetch_add(h.len, Ordering::AcqRel);
    req.seen.store(true, Ordering::Release);
    Ok(true)
}

pub struct Receiver {
    board: Arc<Board>,
    threads: Vec<JoinHandle<()>>,
    streams: Vec<TcpStream>,
    inflight: HashMap<u32, Arc<ReqState>>,
    next_seq: u32,
}

impl Receiver {
    pub fn new(streams: Vec<TcpStream>) -> Result<Receiver, Error> {
        let ctx = current_ctx();
        let board = Arc::new(Board::default());
        let mut threads = Vec::new();
        let mut keep = Vec::new();
        for (i, s) in streams.into_iter().enumerate() {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            keep.push(s.try_clone()?);
            let board = board.clone();
            let mut stream = s;
            let t = std::thread::Builder::new()
                .name(format!("vgpu-nccl-rx{i}"))
                .spawn(move || {
                    let mut staging = None;
                    loop {
                        match recv_part(&mut stream, &board, &mut staging, ctx) {
                            Ok(true) => {}
                            Ok(false) => break,
                            Err(_) => {
                                // mark every posted receive failed: the connection is gone
                                let posted = board.posted.lock().unwrap_or_else(|e| e.into_inner());
                                for p in posted.values() {
                                    p.req.failed.store(true, Ordering::Release);
                                    p.req.seen.store(true, Ordering::Release);
                                }
                                break;
                            }
                        }
                    }
                })?;
            threads.push(t);
        }
        Ok(Receiver {
            board,
            threads,
            streams: keep,
            inflight: HashMap::new(),
            next_seq: 0,
        })
    }

    pub fn irecv(&mut self, ptr: u64, cap: usize, mr: &Mr) -> Result<u32, Error> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let req = Arc::new(ReqState::default());
        req.total.store(u64::MAX, Ordering::Release);
        let mut posted = self.board.posted.lock().unwrap_or_else(|e| e.into_inner());
        posted.insert(
            seq,
            Posted {
                req: req.clone(),
                ptr: SendPtr(ptr),
                cap: cap as u64,
                cuda: mr.cuda,
            },
        );
        drop(posted);
        self.board.changed.notify_all();
        self.inflight.insert(seq, req);
        Ok(seq)
    }

    pub fn poll(&mut self, seq: u32) -> Result<Option<usize>, Error> {
        let Some(req) = self.inflight.get(&seq) else {
            return Err(Error::Protocol("unknown receive"));
        };
        if !req.seen.load(Ordering::Acquire) {
            return Ok(None);
        }
        let total = req.total.load(Ordering::Acquire);
        if req.failed.load(Ordering::Acquire) {
            self.forget(seq);
            return Err(Error::Truncated {
                sent: total as usize,
                posted: 0,
            });
        }
        if req.bytes.load(Ordering::Acquire) < total {
            return Ok(None);
        }
        self.forget(seq);
        Ok(Some(total as usize))
    }

    fn forget(&mut self, seq: u32) {
        self.inflight.remove(&seq);
        self.board
            .posted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&seq);
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.board.closing.store(true, Ordering::Release);
        self.board.changed.notify_all();
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
