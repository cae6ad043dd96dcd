//! The same-host path's copy threads: the CUDA work of every same-host sender of a process
//! (imports of the receivers' buffers, `cuMemcpyAsync` into them, event polling) runs on a few
//! threads per device (`VGPU_NCCL_COPY_THREADS`, default 1), never on NCCL's proxy thread: a
//! driver call that waits for the GPU (whose NCCL kernel may itself wait for the proxy) must not
//! stop the proxy from serving its other connections.
//!
//! One thread serves many connections (each its own stream, so one connection's copies finish
//! in order and different connections' copies overlap). A thread per connection, as before, put
//! 16 to 32 threads per rank on the driver's context lock and the CPUs at 16 channels, and the
//! time each copy waited for its thread grew with the channel count.
//!
//! Bounds: a connection has at most [`JOB_QUEUE`] copies outstanding (more is a protocol
//! error), so its completion channel never holds more than that.
#![allow(unsafe_code)]

use crate::cuda::{self, CUdeviceptr, CUevent, CUstream, Export, Mapping};
use crate::finring::FinRing;
use crate::log::trace;
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// Copies one connection may have outstanding: twice NCCL's 32 requests in flight.
pub(crate) const JOB_QUEUE: usize = 64;

/// What the proxy thread asks of its connection's copy thread, in send order.
pub(crate) enum Job {
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
    /// The receiver's completion ring: finished copies are published there from now on (by
    /// the GPU where the driver allows, `VGPU_NCCL_GPU_FIN`).
    Ring(Arc<FinRing>),
    /// Copy GPU data into the staging buffer (bound for the receiver's host memory).
    Stage {
        seq: u32,
        src: u64,
        size: usize,
    },
}

impl Job {
    /// Whether the job answers with a [`JobDone`] (copies do; registrations do not).
    fn answers(&self) -> bool {
        matches!(self, Job::Copy { .. } | Job::Stage { .. })
    }
}

/// What the copy thread reports back: send `seq` finished its copy (`staged` holds the
/// staging buffer for `Stage` jobs), or failed.
pub(crate) struct JobDone {
    pub seq: u32,
    pub result: Result<Option<u64>, String>,
    /// When the thread saw the copy finish (0 for failures), for the step timing.
    pub done_ns: u64,
    /// The completion went to the receiver through the ring (no `Fin` message is due).
    pub published: bool,
    /// Issued, not done: the GPU publishes this copy as ring entry `n` (the copy is done once
    /// the ring's published count exceeds `n`). The sender's proxy reads the ring itself.
    pub ring_slot: Option<u64>,
}

impl JobDone {
    /// Send `seq` failed (`u32::MAX`: a job without a send, which poisons the connection).
    fn failed(seq: u32, error: String) -> JobDone {
        JobDone {
            seq,
            result: Err(error),
            done_ns: 0,
            published: false,
            ring_slot: None,
        }
    }
}

/// A copy the thread has issued: its send, the event on the main stream, the staging buffer
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

/// What issuing a job put on the GPU.
enum Issued {
    /// Nothing (registrations, the ring).
    Nothing,
    /// A copy the thread completes when its event has.
    Event(InFlight),
    /// A copy the GPU publishes in the ring as entry `slot`.
    OnGpu { seq: u32, slot: u64 },
}

/// Which CUDA call a copy thread is in, for the stall report.
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

/// One connection's timing counters, which its close-time step log reports.
#[derive(Default)]
pub(crate) struct Counters {
    /// Time spent inside cuMemcpyAsync calls (the API cost, not the copy).
    pub api_ns: AtomicU64,
    /// GPU copies issued, the time their jobs waited before the thread took them, and the time
    /// from the issue call's return until the thread saw their event complete.
    pub copies: AtomicU64,
    pub pickup_ns: AtomicU64,
    pub gpu_ns: AtomicU64,
}

/// What a copy thread publishes to every connection it serves.
#[derive(Default)]
struct ThreadState {
    /// The CUDA call it is in and since when (for the stall report).
    in_call: AtomicU8,
    since_ns: AtomicU64,
    /// How often it went to sleep waiting for a job (each costs a wake-up).
    sleeps: AtomicU64,
}

/// A message to a copy thread.
enum ToThread {
    Open {
        conn: u64,
        done: mpsc::Sender<JobDone>,
        counters: Arc<Counters>,
    },
    Job {
        conn: u64,
        job: Job,
    },
    /// Finish the connection's copies, release what it imported and answer on `ack`.
    Close {
        conn: u64,
        ack: mpsc::SyncSender<()>,
    },
}

/// A running copy thread.
struct CopyThread {
    to: mpsc::Sender<ToThread>,
    state: Arc<ThreadState>,
}

/// The copy threads of one device (and application context), given to connections in turn.
struct Pool {
    device: i32,
    app: usize,
    threads: Vec<Arc<CopyThread>>,
    next: usize,
}

static POOLS: Mutex<Vec<Pool>> = Mutex::new(Vec::new());
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// How long an idle copy thread keeps polling for the next job before it sleeps
/// (`VGPU_NCCL_SPIN_US`): the next step's copy usually follows within microseconds, and a
/// futex wake-up would add its latency to that step.
fn spin_ns() -> u64 {
    crate::net::global().config.spin_ns
}

pub(crate) fn now_ns() -> u64 {
    netshare::shm::monotonic_now_ns()
}

/// A connection's handle on its copy thread.
pub(crate) struct Worker {
    conn: u64,
    thread: Arc<CopyThread>,
    done: mpsc::Receiver<JobDone>,
    pub counters: Arc<Counters>,
    /// Copies sent whose answer has not been taken yet.
    outstanding: usize,
    reported: bool,
}

impl Worker {
    /// A handle on a copy thread of the calling thread's current device and context (started
    /// with the first connection there).
    pub fn start() -> Result<Worker, crate::Error> {
        let driver = cuda::driver()?;
        let app = driver.current_context()? as usize;
        let device = driver.current_device()?;
        let thread = {
            let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
            let at = match pools
                .iter()
                .position(|p| p.device == device && p.app == app)
            {
                Some(at) => at,
                None => {
                    pools.push(Pool {
                        device,
                        app,
                        threads: Vec::new(),
                        next: 0,
                    });
                    pools.len() - 1
                }
            };
            let pool = &mut pools[at];
            let want = crate::net::global().config.copy_threads;
            if pool.threads.len() < want {
                let (to, from) = mpsc::channel();
                let state = Arc::new(ThreadState::default());
                let theirs = state.clone();
                std::thread::Builder::new()
                    .name("vgpu-nccl-copy".into())
                    .spawn(move || copy_thread(driver, app, device, from, theirs))?;
                pool.threads.push(Arc::new(CopyThread { to, state }));
            }
            let thread = pool.threads[pool.next % pool.threads.len()].clone();
            pool.next = pool.next.wrapping_add(1);
            thread
        };
        let conn = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let (done_tx, done) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        thread
            .to
            .send(ToThread::Open {
                conn,
                done: done_tx,
                counters: counters.clone(),
            })
            .map_err(|_| crate::Error::Protocol("the copy thread stopped"))?;
        Ok(Worker {
            conn,
            thread,
            done,
            counters,
            outstanding: 0,
            reported: false,
        })
    }

    pub fn send(&mut self, job: Job) -> Result<(), crate::Error> {
        if job.answers() {
            if self.outstanding >= JOB_QUEUE {
                return Err(crate::Error::Protocol(
                    "too many GPU copies outstanding on one connection",
                ));
            }
            self.outstanding += 1;
        }
        self.thread
            .to
            .send(ToThread::Job {
                conn: self.conn,
                job,
            })
            .map_err(|_| crate::Error::Protocol("the copy thread stopped"))
    }

    /// The next finished (or failed) copy, if any.
    pub fn try_done(&mut self) -> Option<JobDone> {
        let d = self.done.try_recv().ok()?;
        self.outstanding = self.outstanding.saturating_sub(1);
        Some(d)
    }

    /// How often this connection's copy thread went to sleep (shared by its connections).
    pub fn sleeps(&self) -> u64 {
        self.thread.state.sleeps.load(Ordering::Relaxed)
    }

    /// Log once if the copy thread has been inside one CUDA call for more than 2 s.
    pub fn check_stall(&mut self) {
        let state = &self.thread.state;
        let (what, since) = (
            state.in_call.load(Ordering::Acquire),
            state.since_ns.load(Ordering::Acquire),
        );
        if what != IN_NOTHING && !self.reported && now_ns().saturating_sub(since) > 2_000_000_000 {
            self.reported = true;
            crate::log::warn!(
                crate::abi::NCCL_NET,
                "same-host copy thread stuck in {} for more than 2 s",
                call_name(what)
            );
        }
    }
}

impl Drop for Worker {
    /// Waits until the connection's copies are done and its imports released: NCCL frees the
    /// buffers once the connection is closed.
    fn drop(&mut self) {
        let (ack, acked) = mpsc::sync_channel(1);
        if self
            .thread
            .to
            .send(ToThread::Close {
                conn: self.conn,
                ack,
            })
            .is_ok()
        {
            let _ = acked.recv();
        }
    }
}

/// The next message for an idle thread: polled for `spin_ns()`, then waited for. `None` once
/// every sender is gone.
fn next_message(from: &mpsc::Receiver<ToThread>, state: &ThreadState) -> Option<ToThread> {
    let start = now_ns();
    let spin = spin_ns();
    loop {
        match from.try_recv() {
            Ok(m) => return Some(m),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if now_ns().saturating_sub(start) > spin {
            state.sleeps.fetch_add(1, Ordering::Relaxed);
            return from.recv().ok();
        }
        std::thread::yield_now();
    }
}

/// Messages a copy thread takes before it polls its copies again.
const MESSAGES_PER_PASS: usize = 16;

/// One connection as its copy thread sees it.
struct Conn {
    done: mpsc::Sender<JobDone>,
    counters: Arc<Counters>,
    /// Its stream(s), or why it has none (every copy then fails with that).
    stream: Result<CUstream, String>,
    extra: Vec<CUstream>,
    exports: HashMap<u32, (Export, Option<OwnedFd>)>,
    maps: HashMap<u32, Mapping>,
    inflight: VecDeque<InFlight>,
    staging: Option<(*mut u8, usize)>,
    ring: Option<Arc<FinRing>>,
    /// The ring's page as the GPU writes it (registered with the driver): its copies are
    /// published by the GPU. `None`: the thread publishes them after their events.
    gpu_page: Option<CUdeviceptr>,
    /// Ring entries this connection's copies were given (GPU-published ones).
    ring_issued: u64,
    /// When the thread last asked the driver about the stream of GPU-published copies that
    /// have not appeared in the ring yet (a failed copy would otherwise never appear).
    queried_ns: u64,
    /// Closing: answered once its copies are done.
    closing: Option<mpsc::SyncSender<()>>,
}

/// The driver state a copy thread works in.
struct Gpu<'a> {
    driver: &'static cuda::Cuda,
    device: i32,
    state: &'a ThreadState,
    events: Vec<CUevent>,
}

impl Gpu<'_> {
    fn enter(&self, what: u8) {
        self.state.since_ns.store(now_ns(), Ordering::Release);
        self.state.in_call.store(what, Ordering::Release);
    }

    /// Leaves the call entered last; returns how long it took.
    fn leave(&self) -> u64 {
        self.state.in_call.store(IN_NOTHING, Ordering::Release);
        now_ns().saturating_sub(self.state.since_ns.load(Ordering::Acquire))
    }

    fn open(&self, ready: &Result<(), String>) -> (Result<CUstream, String>, Vec<CUstream>) {
        if let Err(e) = ready {
            return (Err(e.clone()), Vec::new());
        }
        let stream = self.driver.stream().map_err(|e| e.to_string());
        // VGPU_NCCL_COPY_PIECES > 1: a step's copy is cut into pieces issued on as many
        // streams, which the driver may spread over several copy engines
        let extra = match stream {
            Ok(_) => (1..crate::net::global().config.copy_pieces)
                .map_while(|_| self.driver.stream().ok())
                .collect(),
            Err(_) => Vec::new(),
        };
        (stream, extra)
    }

    /// Puts a job's copy on the GPU.
    fn issue(&mut self, c: &mut Conn, job: Job) -> Result<Issued, String> {
        let (seq, staged, pieces, copied, stream) = match job {
            Job::Region {
                region,
                export,
                _fd,
            } => {
                c.exports.insert(region, (export, _fd));
                return Ok(Issued::Nothing);
            }
            Job::Ring(r) => {
                c.gpu_page = self.gpu_publisher(c, &r);
                c.ring = Some(r);
                return Ok(Issued::Nothing);
            }
            Job::Forget { region } => {
                c.exports.remove(&region);
                if let Some(m) = c.maps.remove(&region) {
                    c.sync(self.driver);
                    self.driver.unmap(&m);
                }
                return Ok(Issued::Nothing);
            }
            Job::Copy {
                seq,
                region,
                offset,
                src,
                size,
                queued_ns,
            } => {
                let stream = c.stream.clone()?;
                c.counters
                    .pickup_ns
                    .fetch_add(now_ns().saturating_sub(queued_ns), Ordering::Relaxed);
                c.counters.copies.fetch_add(1, Ordering::Relaxed);
                let base = match c.maps.entry(region) {
                    std::collections::hash_map::Entry::Occupied(m) => m.get().base(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        let (export, fd) = c
                            .exports
                            .get_mut(&region)
                            .ok_or("a receive into an unknown region")?;
                        self.enter(IN_IMPORT);
                        let m = self.driver.import(export, self.device);
                        self.leave();
                        fd.take(); // the mapping holds the allocation now
                        let base = slot.insert(m.map_err(|e| e.to_string())?).base();
                        trace!(
                            "same-host copy thread (device {}, primary contexts on {:?}): region {region} mapped; destination {}; source {}",
                            self.device,
                            self.driver.active_devices(),
                            self.driver.describe(base),
                            self.driver.describe(src)
                        );
                        base
                    }
                };
                let dst = base + offset;
                if let (Some(page), Some(ring)) = (c.gpu_page, &c.ring) {
                    // the entry first, then the copy, then the GPU's write of the head
                    let slot = c.ring_issued;
                    ring.stage(slot, seq, size as u64)
                        .map_err(|e| e.to_string())?;
                    self.enter(IN_COPY);
                    let r = self
                        .driver
                        .copy_async(dst, src, size, stream)
                        .and_then(|()| {
                            self.driver.write_value(
                                stream,
                                page + FinRing::HEAD_OFFSET as u64,
                                slot + 1,
                            )
                        });
                    c.counters.api_ns.fetch_add(self.leave(), Ordering::Relaxed);
                    r.map_err(|e| e.to_string())?;
                    c.ring_issued += 1;
                    trace!(
                        "same-host send {seq}: copy {size} bytes {src:#x} -> {dst:#x}, published by the GPU as ring entry {slot}"
                    );
                    return Ok(Issued::OnGpu { seq, slot });
                }
                let pieces = pieces_of(size, c.extra.len() + 1);
                for (i, (at, len)) in pieces.iter().enumerate() {
                    let on = if i == 0 { stream } else { c.extra[i - 1] };
                    self.enter(IN_COPY);
                    let r = self.driver.copy_async(dst + at, src + at, *len, on);
                    c.counters.api_ns.fetch_add(self.leave(), Ordering::Relaxed);
                    r.map_err(|e| e.to_string())?;
                }
                trace!(
                    "same-host send {seq}: copy {size} bytes {src:#x} -> {dst:#x} in {} piece(s)",
                    pieces.len()
                );
                (seq, None, pieces.len(), Some(size as u64), stream)
            }
            Job::Stage { seq, src, size } => {
                let stream = c.stream.clone()?;
                if c.staging.is_none_or(|(_, cap)| cap < size) {
                    if let Some((p, _)) = c.staging.take() {
                        self.driver.free_host(p);
                    }
                    let cap = size.next_power_of_two().max(1 << 20);
                    c.staging =
                        Some((self.driver.host_alloc(cap).map_err(|e| e.to_string())?, cap));
                }
                let (p, _) = c.staging.expect("allocated above");
                self.enter(IN_COPY);
                let r = self.driver.copy_async(p as u64, src, size, stream);
                self.leave();
                r.map_err(|e| e.to_string())?;
                (seq, Some(p as u64), 1, None, stream)
            }
        };
        let mut record = |on: CUstream| {
            let ev = match self.events.pop() {
                Some(e) => Ok(e),
                None => self.driver.event(),
            };
            ev.and_then(|ev| self.driver.record(ev, on).map(|()| ev))
        };
        let ev = record(stream).map_err(|e| e.to_string())?;
        let others = c.extra[..pieces.saturating_sub(1)]
            .iter()
            .map(|&on| record(on))
            .collect::<Result<Vec<CUevent>, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Issued::Event(InFlight {
            seq,
            ev,
            staged,
            others,
            issued_ns: now_ns(),
            copied,
        }))
    }

    /// The device address of the ring's page if this connection's copies can be published by
    /// the GPU (`VGPU_NCCL_GPU_FIN`, one stream per copy, a driver with stream memory
    /// operations); `None` leaves it to the thread.
    fn gpu_publisher(&self, c: &Conn, ring: &FinRing) -> Option<CUdeviceptr> {
        if !crate::net::global().config.gpu_fin || !c.extra.is_empty() || c.stream.is_err() {
            return None;
        }
        let (page, len) = ring.page();
        let r = if self.driver.has_memops() {
            self.driver
                .register_host(page, len)
                .map_err(|e| e.to_string())
        } else {
            Err("the driver has no stream memory operations".to_string())
        };
        match r {
            Ok(dev) => Some(dev),
            Err(e) => {
                static WARNED: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    crate::log::warn!(
                        crate::abi::NCCL_NET,
                        "same-host path: the GPU cannot publish copy completions ({e}); the copy thread does"
                    );
                }
                None
            }
        }
    }

    /// Watches a connection's GPU-published copies: every millisecond while some have not
    /// appeared in the ring, asks whether its stream failed (or drained without publishing,
    /// which would leave the receiver waiting for ever). Returns how many appeared.
    fn watch(&mut self, c: &mut Conn) -> usize {
        let Some(ring) = &c.ring else { return 0 };
        let published = ring.published();
        if c.gpu_page.is_none() || published >= c.ring_issued {
            return 0;
        }
        let now = now_ns();
        if now.saturating_sub(c.queried_ns) < 1_000_000 {
            return 0;
        }
        c.queried_ns = now;
        let Ok(stream) = &c.stream else { return 0 };
        let stream = *stream;
        self.enter(IN_QUERY);
        let r = self.driver.stream_done(stream);
        self.leave();
        let failure = match r {
            Ok(false) => return 0,
            Ok(true) if ring.published() >= c.ring_issued => return 1,
            Ok(true) => "the GPU finished a copy but its completion never reached the ring".into(),
            Err(e) => e.to_string(),
        };
        // stop watching: the connection is poisoned
        c.ring_issued = published;
        let _ = c.done.send(JobDone::failed(u32::MAX, failure));
        1
    }

    /// Completes the connection's finished copies, oldest first (copies on one stream finish
    /// in order; a copy in pieces is done when every piece is). Returns how many it completed.
    fn reap(&mut self, c: &mut Conn) -> usize {
        let mut n = 0;
        while let Some(front) = c.inflight.front() {
            let seq = front.seq;
            self.enter(IN_QUERY);
            let r: Result<bool, cuda::CudaError> = std::iter::once(&front.ev)
                .chain(&front.others)
                .try_fold(true, |all, &e| Ok(all && self.driver.done(e)?));
            self.leave();
            match r {
                Ok(true) => {
                    let f = c.inflight.pop_front().expect("front exists");
                    let now = now_ns();
                    if f.staged.is_none() {
                        c.counters
                            .gpu_ns
                            .fetch_add(now.saturating_sub(f.issued_ns), Ordering::Relaxed);
                    }
                    self.events.push(f.ev);
                    self.events.extend(f.others);
                    trace!("same-host send {seq}: copy done");
                    // the receiver hears of a GPU copy through the ring at once, without
                    // waiting for the proxy thread's next `test` and a socket message
                    let (result, published) = match (&c.ring, f.copied) {
                        (Some(r), Some(size)) => match r.push(seq, size) {
                            Ok(()) => (Ok(f.staged), true),
                            Err(e) => (Err(e.to_string()), false),
                        },
                        _ => (Ok(f.staged), false),
                    };
                    let _ = c.done.send(JobDone {
                        seq,
                        result,
                        done_ns: now,
                        published,
                        ring_slot: None,
                    });
                    n += 1;
                }
                Ok(false) => break,
                Err(e) => {
                    c.inflight.pop_front();
                    let _ = c.done.send(JobDone::failed(seq, e.to_string()));
                    n += 1;
                }
            }
        }
        n
    }

    /// Takes the messages waiting, at most [`MESSAGES_PER_PASS`].
    fn take_waiting(
        &mut self,
        from: &mpsc::Receiver<ToThread>,
        conns: &mut HashMap<u64, Conn>,
        ready: &Result<(), String>,
    ) {
        for _ in 0..MESSAGES_PER_PASS {
            match from.try_recv() {
                Ok(m) => self.handle(conns, ready, m),
                Err(_) => return,
            }
        }
    }

    fn handle(
        &mut self,
        conns: &mut HashMap<u64, Conn>,
        ready: &Result<(), String>,
        message: ToThread,
    ) {
        match message {
            ToThread::Open {
                conn,
                done,
                counters,
            } => {
                let (stream, extra) = self.open(ready);
                conns.insert(
                    conn,
                    Conn {
                        done,
                        counters,
                        stream,
                        extra,
                        exports: HashMap::new(),
                        maps: HashMap::new(),
                        inflight: VecDeque::new(),
                        staging: None,
                        ring: None,
                        gpu_page: None,
                        ring_issued: 0,
                        queried_ns: 0,
                        closing: None,
                    },
                );
            }
            ToThread::Job { conn, job } => {
                let Some(c) = conns.get_mut(&conn) else {
                    return;
                };
                match self.issue(c, job) {
                    Ok(Issued::Event(f)) => c.inflight.push_back(f),
                    Ok(Issued::OnGpu { seq, slot }) => {
                        let _ = c.done.send(JobDone {
                            seq,
                            result: Ok(None),
                            done_ns: 0,
                            published: true,
                            ring_slot: Some(slot),
                        });
                    }
                    Ok(Issued::Nothing) => {}
                    // a failed job poisons the connection: report it on its next send
                    Err(e) => {
                        let _ = c.done.send(JobDone::failed(u32::MAX, e));
                    }
                }
            }
            ToThread::Close { conn, ack } => match conns.get_mut(&conn) {
                Some(c) => c.closing = Some(ack),
                None => {
                    let _ = ack.send(());
                }
            },
        }
    }

    /// Releases what a connection holds once its copies are done.
    fn release(&mut self, c: Conn) {
        c.sync(self.driver);
        for m in c.maps.values() {
            self.driver.unmap(m);
        }
        if let Some((p, _)) = c.staging {
            self.driver.free_host(p);
        }
        if let (Some(_), Some(ring)) = (c.gpu_page, &c.ring) {
            self.driver.unregister_host(ring.page().0);
        }
        if let Ok(s) = c.stream {
            self.driver.destroy_stream(s);
        }
        for s in c.extra {
            self.driver.destroy_stream(s);
        }
        if let Some(ack) = c.closing {
            let _ = ack.send(());
        }
    }
}

impl Conn {
    /// Whether it has copies the thread still watches: issued with an event, or published
    /// by the GPU and not yet in the ring.
    fn busy(&self) -> bool {
        !self.inflight.is_empty()
            || (self.gpu_page.is_some()
                && self
                    .ring
                    .as_ref()
                    .is_some_and(|r| r.published() < self.ring_issued))
    }

    /// Waits for everything on the connection's streams.
    fn sync(&self, driver: &cuda::Cuda) {
        if let Ok(s) = &self.stream {
            let _ = driver.synchronize(*s);
            for &s in &self.extra {
                let _ = driver.synchronize(s);
            }
        }
    }
}

fn copy_thread(
    driver: &'static cuda::Cuda,
    app: usize,
    device: i32,
    from: mpsc::Receiver<ToThread>,
    state: Arc<ThreadState>,
) {
    // a thread that cannot enter a context still answers: every copy fails with the reason
    let ready = crate::context::enter_copy_context(driver, app, device).map_err(|e| {
        crate::log::warn!(crate::abi::NCCL_NET, "same-host copy thread: {e}");
        format!("the copy thread has no CUDA context: {e}")
    });
    let mut gpu = Gpu {
        driver,
        device,
        state: &state,
        events: Vec::new(),
    };
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut ids: Vec<u64> = Vec::new();
    'serve: loop {
        // take the messages waiting (a bounded batch, so polling is never starved); when no
        // copy is in flight, wait for one: polled for spin_ns(), then asleep
        let busy = conns.values().any(Conn::busy);
        if !busy {
            match next_message(&from, &state) {
                Some(m) => gpu.handle(&mut conns, &ready, m),
                None => break 'serve,
            }
        }
        gpu.take_waiting(&from, &mut conns, &ready);
        // poll each connection's copies, and between two connections take what came: a copy
        // handed over while the thread polls waits only for the connection being polled
        let mut reaped = 0;
        ids.clear();
        ids.extend(conns.iter().filter(|(_, c)| c.busy()).map(|(&id, _)| id));
        for id in &ids {
            if let Some(c) = conns.get_mut(id) {
                reaped += gpu.reap(c) + gpu.watch(c);
            }
            gpu.take_waiting(&from, &mut conns, &ready);
        }
        let finished: Vec<u64> = conns
            .iter()
            .filter(|(_, c)| c.closing.is_some() && c.inflight.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in finished {
            let c = conns.remove(&id).expect("listed above");
            gpu.release(c);
        }
        if reaped == 0 {
            std::thread::yield_now();
        }
    }
    for (_, c) in conns.drain() {
        gpu.release(c);
    }
    for e in gpu.events.drain(..) {
        driver.destroy_event(e);
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

#[cfg(test)]
mod tests {
    use super::pieces_of;

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
