//! The same-host path: a Unix stream socket carries small control messages; data whose
//! destination is GPU memory is copied by the sender straight into the receiver's buffer
//! (CUDA IPC: cuMem file descriptors or legacy IPC handles; over NVLink between GPUs, or inside
//! one GPU between two slices), with no host bounce. Data whose destination is host memory (the
//! LL protocol's buffers, or hosts without GPUs) goes through the socket.
//!
//! Everything here runs on NCCL's proxy thread and never blocks: sockets are non-blocking and
//! copies are polled through CUDA events.
#![allow(unsafe_code)]

use crate::cuda::{self, CUevent, CUstream, Export, Mapping};
use crate::finring::FinRing;
use crate::log::trace;
use crate::sys;
use crate::wire::{HOST_REGION, Msg};
use crate::{Error, Mr};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

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

/// What the proxy thread asks of the sender's copy worker, in send order.
enum Job {
    /// A registration of the receiver: keep it until a send needs it (owns the descriptor).
    Region {
        region: u32,
        export: Export,
        _fd: Option<OwnedFd>,
    },
    Forget {
        region: u32,
    },
    /// Copy `size` bytes from `src` into the receiver's region at `offset` (`queued_ns`: when
    /// the proxy handed it over, for the step timing).
    Copy {
        seq: u32,
        region: u32,
        offset: u64,
        src: u64,
        size: usize,
        queued_ns: u64,
    },
    /// The receiver's completion ring: finished copies are published there from now on.
    Ring(FinRing),
    /// Copy GPU data into the staging buffer (bound for the receiver's host memory).
    Stage {
        seq: u32,
        src: u64,
        size: usize,
    },
}

/// What the worker reports back: send `seq` finished its copy (`staged` holds the staging
/// buffer for `Stage` jobs), or failed.
struct JobDone {
    seq: u32,
    result: Result<Option<u64>, String>,
    /// When the worker saw the copy finish (0 for failures), for the step timing.
    done_ns: u64,
    /// The completion went to the receiver through the ring (no `Fin` message is due).
    published: bool,
}

impl JobDone {
    /// Send `seq` failed (`u32::MAX`: a job without a send, which poisons the connection).
    fn failed(seq: u32, error: String) -> JobDone {
        JobDone {
            seq,
            result: Err(error),
            done_ns: 0,
            published: false,
        }
    }
}

/// What a job put on the GPU: its send, the staging buffer (`Stage`), the number of pieces,
/// and the bytes of a `Copy` (for the completion ring).
type Issued = (u32, Option<u64>, usize, Option<u64>);

/// A copy the worker has issued: its send, the event on the main stream, the staging buffer
/// (`Stage` jobs), the events on the extra streams, and when its issue call returned.
struct InFlight {
    seq: u32,
    ev: CUevent,
    staged: Option<u64>,
    others: Vec<CUevent>,
    issued_ns: u64,
    /// Bytes of a `Copy` job (`None` for staging), for the completion ring.
    copied: Option<u64>,
}

/// Which CUDA call the worker is in, for the stall report.
const IN_NOTHING: u8 = 0;
const IN_IMPORT: u8 = 1;
const IN_COPY: u8 = 2;
const IN_QUERY: u8 = 3;

fn call_name(c: u8) -> &'static str {
    match c {
        IN_IMPORT => "importing the receiver's buffer",
        IN_COPY => "cuMemcpyAsync",
        IN_QUERY => "cuEventQuery",
        _ => "nothing",
    }
}

/// The sender's CUDA work runs on its own thread, never on NCCL's proxy thread: a driver call
/// that waits for the GPU (whose NCCL kernel may itself wait for this proxy) must not stop the
/// proxy from serving the other connections. Jobs and results go through bounded channels (64:
/// twice NCCL's 32 requests in flight per connection).
struct Worker {
    jobs: std::sync::mpsc::SyncSender<Job>,
    done: std::sync::mpsc::Receiver<JobDone>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: std::sync::Arc<WorkerShared>,
    reported: bool,
}

/// What the worker publishes to the proxy thread: the CUDA call it is in (for the stall
/// report) and its timing counters (for the close-time summary).
#[derive(Default)]
struct WorkerShared {
    in_call: std::sync::atomic::AtomicU8,
    since_ns: std::sync::atomic::AtomicU64,
    /// Time spent inside cuMemcpyAsync calls (the API cost, not the copy).
    api_ns: std::sync::atomic::AtomicU64,
    /// How often the worker went to sleep waiting for a job (each costs a wake-up).
    sleeps: std::sync::atomic::AtomicU64,
    /// GPU copies issued, the time their jobs waited before the worker took them, and the time
    /// from the issue call's return until the worker saw their event complete.
    copies: std::sync::atomic::AtomicU64,
    pickup_ns: std::sync::atomic::AtomicU64,
    gpu_ns: std::sync::atomic::AtomicU64,
}

const JOB_QUEUE: usize = 64;

/// How long an idle worker keeps polling for the next job before it sleeps
/// (`VGPU_NCCL_SPIN_US`, default 100 us): the next step's copy usually follows within
/// microseconds, and a futex wake-up would add its latency to that step.
fn spin_ns() -> u64 {
    crate::net::global().config.spin_ns
}

fn now_ns() -> u64 {
    netshare::shm::monotonic_now_ns()
}

impl Worker {
    fn start() -> Result<Worker, Error> {
        let driver = cuda::driver()?;
        let ctx = driver.current_context()? as usize;
        let device = driver.current_device()?;
        let (jobs, job_rx) = std::sync::mpsc::sync_channel::<Job>(JOB_QUEUE);
        let (done_tx, done) = std::sync::mpsc::sync_channel::<JobDone>(JOB_QUEUE);
        let shared = std::sync::Arc::new(WorkerShared::default());
        let theirs = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vgpu-nccl-copy".into())
            .spawn(move || copy_worker(driver, ctx, device, job_rx, done_tx, theirs))?;
        Ok(Worker {
            jobs,
            done,
            thread: Some(thread),
            shared,
            reported: false,
        })
    }

    fn send(&self, job: Job) -> Result<(), Error> {
        self.jobs
            .try_send(job)
            .map_err(|_| Error::Protocol("the copy worker's queue is full or it stopped"))
    }

    /// Log once if the worker has been inside one CUDA call for more than 2 s.
    fn check_stall(&mut self) {
        use std::sync::atomic::Ordering;
        let (what, since) = (
            self.shared.in_call.load(Ordering::Acquire),
            self.shared.since_ns.load(Ordering::Acquire),
        );
        if what != IN_NOTHING && !self.reported && now_ns().saturating_sub(since) > 2_000_000_000 {
            self.reported = true;
            crate::log::warn!(
                crate::abi::NCCL_NET,
                "same-host copy worker stuck in {} for more than 2 s",
                call_name(what)
            );
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // closing the job channel ends the worker once its copies are done
        let (tx, _) = std::sync::mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.jobs, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The next job for an idle worker: polled for `spin_ns()`, then waited for. `None` once the
/// proxy side has closed the channel.
fn next_job(jobs: &std::sync::mpsc::Receiver<Job>, shared: &WorkerShared) -> Option<Job> {
    let start = now_ns();
    let spin = spin_ns();
    loop {
        match jobs.try_recv() {
            Ok(j) => return Some(j),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if now_ns().saturating_sub(start) > spin {
            shared
                .sleeps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return jobs.recv().ok();
        }
        std::thread::yield_now();
    }
}

fn copy_worker(
    driver: &'static cuda::Cuda,
    ctx: usize,
    device: i32,
    jobs: std::sync::mpsc::Receiver<Job>,
    done: std::sync::mpsc::SyncSender<JobDone>,
    shared: std::sync::Arc<WorkerShared>,
) {
    use std::sync::atomic::Ordering;
    let enter = |what: u8| {
        shared.since_ns.store(now_ns(), Ordering::Release);
        shared.in_call.store(what, Ordering::Release);
    };
    let leave = || {
        if shared.in_call.swap(IN_NOTHING, Ordering::AcqRel) == IN_COPY {
            let spent = now_ns().saturating_sub(shared.since_ns.load(Ordering::Acquire));
            shared.api_ns.fetch_add(spent, Ordering::Relaxed);
        }
    };
    if let Err(e) = crate::context::enter_copy_context(driver, ctx, device) {
        // every job then fails: the channel closes and the proxy reports it
        crate::log::warn!(crate::abi::NCCL_NET, "same-host copy worker: {e}");
        return;
    }
    let Ok(stream) = driver.stream() else { return };
    // VGPU_NCCL_COPY_PIECES > 1: a step's copy is cut into pieces issued on as many streams,
    // which the driver may spread over several copy engines
    let extra: Vec<CUstream> = (1..crate::net::global().config.copy_pieces)
        .map_while(|_| driver.stream().ok())
        .collect();
    let mut exports: HashMap<u32, (Export, Option<OwnedFd>)> = HashMap::new();
    let mut maps: HashMap<u32, Mapping> = HashMap::new();
    let mut events: Vec<CUevent> = Vec::new();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    let mut staging: Option<(*mut u8, usize)> = None;
    let mut ring: Option<FinRing> = None;
    let mut open = true;
    while open || !inflight.is_empty() {
        // take jobs: sleep only when no copy is in flight and none came for spin_ns()
        let job = if inflight.is_empty() {
            match next_job(&jobs, &shared) {
                Some(j) => Some(j),
                None => {
                    open = false;
                    None
                }
            }
        } else {
            match jobs.try_recv() {
                Ok(j) => Some(j),
                Err(std::sync::mpsc::TryRecvError::Empty) => None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    None
                }
            }
        };
        if let Some(job) = job {
            let issued: Result<Option<Issued>, String> = (|| {
                match job {
                    Job::Region {
                        region,
                        export,
                        _fd,
                    } => {
                        exports.insert(region, (export, _fd));
                        Ok(None)
                    }
                    Job::Ring(r) => {
                        ring = Some(r);
                        Ok(None)
                    }
                    Job::Forget { region } => {
                        exports.remove(&region);
                        if let Some(m) = maps.remove(&region) {
                            let _ = driver.synchronize(stream);
                            for &s in &extra {
                                let _ = driver.synchronize(s);
                            }
                            driver.unmap(&m);
                        }
                        Ok(None)
                    }
                    Job::Copy {
                        seq,
                        region,
                        offset,
                        src,
                        size,
                        queued_ns,
                    } => {
                        shared
                            .pickup_ns
                            .fetch_add(now_ns().saturating_sub(queued_ns), Ordering::Relaxed);
                        shared.copies.fetch_add(1, Ordering::Relaxed);
                        let base = match maps.entry(region) {
                            std::collections::hash_map::Entry::Occupied(m) => m.get().base(),
                            std::collections::hash_map::Entry::Vacant(slot) => {
                                let (export, fd) = exports
                                    .get_mut(&region)
                                    .ok_or("a receive into an unknown region")?;
                                enter(IN_IMPORT);
                                let m = driver.import(export, device);
                                leave();
                                fd.take(); // the mapping holds the allocation now
                                let base = slot.insert(m.map_err(|e| e.to_string())?).base();
                                trace!(
                                    "same-host copy worker (device {device}, primary contexts on {:?}): region {region} mapped; destination {}; source {}",
                                    driver.active_devices(),
                                    driver.describe(base),
                                    driver.describe(src)
                                );
                                base
                            }
                        };
                        let dst = base + offset;
                        let pieces = pieces_of(size, extra.len() + 1);
                        for (i, (at, len)) in pieces.iter().enumerate() {
                            let on = if i == 0 { stream } else { extra[i - 1] };
                            enter(IN_COPY);
                            let r = driver.copy_async(dst + at, src + at, *len, on);
                            leave();
                            r.map_err(|e| e.to_string())?;
                        }
                        trace!(
                            "same-host send {seq}: copy {size} bytes {src:#x} -> {dst:#x} in {} piece(s)",
                            pieces.len()
                        );
                        Ok(Some((seq, None, pieces.len(), Some(size as u64))))
                    }
                    Job::Stage { seq, src, size } => {
                        if staging.is_none_or(|(_, cap)| cap < size) {
                            if let Some((p, _)) = staging.take() {
                                driver.free_host(p);
                            }
                            let cap = size.next_power_of_two().max(1 << 20);
                            staging =
                                Some((driver.host_alloc(cap).map_err(|e| e.to_string())?, cap));
                        }
                        let (p, _) = staging.expect("allocated above");
                        enter(IN_COPY);
                        let r = driver.copy_async(p as u64, src, size, stream);
                        leave();
                        r.map_err(|e| e.to_string())?;
                        Ok(Some((seq, Some(p as u64), 1, None)))
                    }
                }
            })();
            match issued {
                Ok(None) => {}
                Ok(Some((seq, staged, pieces, copied))) => {
                    let mut record = |on: CUstream| {
                        let ev = match events.pop() {
                            Some(e) => Ok(e),
                            None => driver.event(),
                        };
                        ev.and_then(|ev| driver.record(ev, on).map(|()| ev))
                    };
                    let main = record(stream);
                    let others: Result<Vec<CUevent>, _> = extra[..pieces.saturating_sub(1)]
                        .iter()
                        .map(|&on| record(on))
                        .collect();
                    match (main, others) {
                        (Ok(ev), Ok(others)) => inflight.push_back(InFlight {
                            seq,
                            ev,
                            staged,
                            others,
                            issued_ns: now_ns(),
                            copied,
                        }),
                        (Err(e), _) | (_, Err(e)) => {
                            let _ = done.send(JobDone::failed(seq, e.to_string()));
                        }
                    }
                }
                Err(e) => {
                    // a failed job poisons the connection: report it on the next send
                    let _ = done.send(JobDone::failed(u32::MAX, e));
                }
            }
            continue;
        }
        // poll the oldest copy (copies on one stream finish in order; a copy in pieces is
        // done when every piece is)
        if let Some(front) = inflight.front() {
            let seq = front.seq;
            enter(IN_QUERY);
            let r: Result<bool, cuda::CudaError> = std::iter::once(&front.ev)
                .chain(&front.others)
                .try_fold(true, |all, &e| Ok(all && driver.done(e)?));
            leave();
            match r {
                Ok(true) => {
                    let f = inflight.pop_front().expect("front exists");
                    let now = now_ns();
                    if f.staged.is_none() {
                        shared
                            .gpu_ns
                            .fetch_add(now.saturating_sub(f.issued_ns), Ordering::Relaxed);
                    }
                    events.push(f.ev);
                    events.extend(f.others);
                    trace!("same-host send {seq}: copy done");
                    // the receiver hears of a GPU copy through the ring at once, without
                    // waiting for the proxy thread's next `test` and a socket message
                    let (result, published) = match (&ring, f.copied) {
                        (Some(r), Some(size)) => match r.push(seq, size) {
                            Ok(()) => (Ok(f.staged), true),
                            Err(e) => (Err(e.to_string()), false),
                        },
                        _ => (Ok(f.staged), false),
                    };
                    if done
                        .send(JobDone {
                            seq,
                            result,
                            done_ns: now,
                            published,
                        })
                        .is_err()
                    {
                        break;
                    }
                }
                Ok(false) => std::thread::yield_now(),
                Err(e) => {
                    inflight.pop_front();
                    let _ = done.send(JobDone::failed(seq, e.to_string()));
                }
            }
        }
    }
    let _ = driver.synchronize(stream);
    for &s in &extra {
        let _ = driver.synchronize(s);
    }
    for m in maps.values() {
        driver.unmap(m);
    }
    for e in events {
        driver.destroy_event(e);
    }
    if let Some((p, _)) = staging {
        driver.free_host(p);
    }
    driver.destroy_stream(stream);
    for s in extra {
        driver.destroy_stream(s);
    }
}

/// A copy of `size` bytes cut into at most `streams` pieces of at least `MIN_PIECE` bytes
/// (whole 4 KiB pages but the last): `(offset, length)` of each.
fn pieces_of(size: usize, streams: usize) -> Vec<(u64, usize)> {
    const MIN_PIECE: usize = 128 << 10;
    if size == 0 {
        return Vec::new();
    }
    let k = streams.min(size / MIN_PIECE).max(1);
    let piece = size.div_ceil(k).next_multiple_of(4096);
    (0..size)
        .step_by(piece)
        .map(|at| (at as u64, piece.min(size - at)))
        .collect()
}

/// A send's life. Its messages to the receiver (`Fin`, or `Data` + payload) must leave in send
/// order, because the receiver matches them to its receives in posting order: a later host
/// send may be ready before an earlier GPU copy has finished.
enum OpState {
    /// No ready-to-receive from the receiver yet.
    Waiting,
    /// The worker is copying into the receiver's GPU memory.
    Copying,
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
            let w = Worker::start()?;
            for job in self.early.drain(..) {
                w.send(job)?;
            }
            self.worker = Some(w);
        }
        Ok(self.worker.as_mut().expect("set above"))
    }

    fn queue_job(&mut self, job: Job) -> Result<(), Error> {
        match &self.worker {
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
                    self.queue_job(Job::Ring(FinRing::open(&fd)?))?;
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
            while let Ok(d) = w.done.try_recv() {
                let staged = d.result.map_err(|e| {
                    crate::log::warn!(crate::abi::NCCL_NET, "same-host send {}: {e}", d.seq);
                    Error::Protocol("a GPU copy failed (see the log)")
                })?;
                if d.done_ns != 0 {
                    self.timing.heard_ns += now_ns().saturating_sub(d.done_ns);
                }
                if let Some(op) = self.ops.iter_mut().find(|o| o.seq == d.seq) {
                    op.state = OpState::Copied(staged);
                    op.published = d.published;
                    let took = now_ns().saturating_sub(op.issued_ns);
                    self.timing.copies += 1;
                    self.timing.copy_ns += took;
                    self.timing.max_copy_ns = self.timing.max_copy_ns.max(took);
                }
            }
        }
        // emit the receiver's messages in send order, stopping at the first send not ready
        for i in 0..self.ops.len() {
            let (seq, size, src) = (self.ops[i].seq, self.ops[i].size, self.ops[i].src);
            match self.ops[i].state {
                OpState::Waiting | OpState::Copying | OpState::Staging => break,
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
                let sh = &w.shared;
                (
                    sh.api_ns.load(Relaxed),
                    sh.sleeps.load(Relaxed),
                    sh.copies.load(Relaxed),
                    sh.pickup_ns.load(Relaxed),
                    sh.gpu_ns.load(Relaxed),
                )
            });
        crate::log::info!(
            crate::abi::NCCL_NET,
            "same-host send closed: {} steps, {:.1} MiB, one every {:.1} us; per step: waited {:.1} us for the receiver, GPU copy {:.1} us (max {:.1}) = until the worker took it {:.1} + cuMemcpyAsync {:.1} + until its event completed {:.1} + until the proxy heard {:.1}; copy worker slept {} times",
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
    pub fn new(sock: UnixStream) -> Result<Receiver, Error> {
        sock.set_nonblocking(true)?;
        let mut out = Out::default();
        // the ring goes first, before any ready-to-receive, so that the sender completes
        // every GPU copy of this connection through it
        let ring = if crate::net::global().config.fin_ring {
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
    use super::{HOST_REGION, Msg, Receiver, pieces_of};
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
        let mut rx = Receiver::new(ours).unwrap();
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
            let mut rx = Receiver::new(ours).unwrap();
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

    #[test]
    fn a_copy_is_cut_into_page_aligned_pieces_that_cover_it_once() {
        assert!(pieces_of(0, 4).is_empty());
        assert_eq!(
            pieces_of(1000, 4),
            vec![(0, 1000)],
            "small copies stay whole"
        );
        assert_eq!(pieces_of(1 << 20, 1), vec![(0, 1 << 20)]);
        assert_eq!(
            pieces_of(1 << 20, 4),
            vec![
                (0, 256 << 10),
                (256 << 10, 256 << 10),
                (512 << 10, 256 << 10),
                (768 << 10, 256 << 10)
            ]
        );
        // no piece under 128 KiB: 300 KiB in at most 2
        assert_eq!(pieces_of(300 << 10, 8).len(), 2);
        for (size, streams) in [
            ((3 << 20) + 17, 4),
            (999_999, 3),
            (128 << 10, 8),
            (5 << 20, 7),
        ] {
            let p = pieces_of(size, streams);
            assert!(p.len() <= streams);
            let mut next = 0u64;
            for &(at, len) in &p {
                assert_eq!(at, next, "pieces are contiguous");
                assert!(len > 0);
                assert_eq!(at % 4096, 0);
                next = at + len as u64;
            }
            assert_eq!(next, size as u64, "{size} in {streams}");
        }
    }
}
