//! The `join` runtime: register the node, then heartbeat and follow assignments at the same time
//! until shutdown. What is said to the control plane and when is the node [`Session`]'s
//! business ([`crate::session`], the same one every node of `simulate-fleet` drives); this file
//! is its I/O shell: it makes the calls the session asks for, with timeouts, keeps its timers,
//! hands each stream message to the [`Follower`] and logs.
//!
//! * Registration retries across the control-plane addresses with backoff until one accepts the
//!   node. Only a refusal of the inventory itself (`INVALID_ARGUMENT`) stops the agent: retrying
//!   the same inventory cannot succeed ([`Refusals::InvalidInventory`]).
//! * Heartbeats come at the interval the control plane gave; a beat carries the health and usage
//!   report ([`Monitor::latest`]) only when it changed, as a refresh, or when the leader asks for
//!   it ([`crate::report::ReportSender`], inside the session). When the control plane answers
//!   `known = false`, or the assignment stream says the node is not registered, the agent
//!   registers again (an identical inventory keeps the node's tenants). Failed beats move to the
//!   next address and retry sooner, with backoff, never later than the interval.
//! * Every call carries the node key from the state directory
//!   ([`crate::state::NodeKey`]), and every beat the number of the registration it is for. When
//!   the control plane says another registration holds the node's name, the agent stops with
//!   [`Error::NodeNameTaken`]: acting for a node that another agent now runs would run its
//!   tenants twice, and a takeover must be seen (issue 22, point 5). When the node was
//!   forgotten and registered again, the log says its registration changed.
//! * One `WatchAssignments` stream is held; when it ends or fails the agent moves to the next
//!   address and calls again after a backoff. Each message goes to the [`Follower`] on a thread
//!   of its own ([`follower::Worker`](crate::follower::Worker)); a message it cannot apply drops
//!   the stream it came on.
//!
//! **Architecture Invariant:** the loop here does no file I/O and never waits for the
//! assignments to be applied: handing a message over is a swap in a one-message slot. So a
//! beat is never late because a state write is slow or blocked, or because the stream brings
//! hundreds of updates a second (issue 22, point 3: a node under churn went silent and was
//! declared lost). Updates are coalesced: only the newest set waits while one is applied.
//!
//! Bounds: every wait is a backoff (100 ms doubling to 2 s by default) or the heartbeat
//! interval, every call has a timeout, and nothing else is queued: at most one unary call and
//! one stream are in flight, and one assignment message waits. There is no attempt limit on
//! purpose: an agent's job is to stay joined through control-plane outages, and shutdown
//! (SIGINT, SIGTERM) ends the loop at any point. State files are written atomically, and
//! shutdown waits up to [`WORKER_STOP_LIMIT`] for the application in progress.
//!
//! The pieces of I/O that `simulate-fleet` shares (`Timers`, `AssignmentStream`) are here
//! too, so both shells open streams and keep time the same way.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use api::v1::{
    Assignments, HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse,
    WatchAssignmentsRequest,
};
use tokio::time::error::Elapsed;
use tokio::time::timeout;
use tonic::Streaming;
use tracing::{debug, error, info, warn};

use crate::cdi::{CdiConfig, CdiWriter};
use crate::endpoints::Endpoints;
use crate::error::{Error, Result};
use crate::follower::{Follower, Worker};
use crate::inventory::InventorySource;
use crate::monitor::{Monitor, MonitorConfig, Report};
use crate::report::{ReportPolicy, ReportSender};
use crate::session::{
    Action, CallError, Event, Lane, NODE_KEY_METADATA, REGISTRATION_METADATA, Refusals,
    RegisterReason, Session, SessionConfig, Stop, WatchEnd, name_taken,
};
use crate::state::{NodeKey, StateDir};

pub use crate::session::{
    HEARTBEAT_INTERVAL_DEFAULT, HEARTBEAT_INTERVAL_MAX, HEARTBEAT_INTERVAL_MIN,
};

/// How often GPU health and tenant usage are sampled for the heartbeats ([`crate::monitor`]).
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait at shutdown for the assignment set being applied.
pub const WORKER_STOP_LIMIT: Duration = Duration::from_secs(10);

/// What `vgpu-agent join` runs with.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// Control-plane addresses, `HOST:PORT` or `http://HOST:PORT`.
    pub control_plane: Vec<String>,
    pub name: String,
    pub source: InventorySource,
    pub state_dir: PathBuf,
    pub labels: BTreeMap<String, String>,
    /// Where the agent can be reached; informational.
    pub address: String,
    pub timings: Timings,
    /// CDI specs for the placed tenants; `None` writes none.
    pub cdi: Option<CdiConfig>,
    /// The interposers' shared-memory directory, where tenants' usage is read
    /// ([`crate::usage`]).
    pub shm_dir: PathBuf,
    /// The NIC bandwidth the tenants' NCCL traffic shares by weight ([`crate::bandwidth`]).
    pub nic_bytes_per_second: u64,
    /// CPU and host memory kept for work outside vgpu, subtracted from what the node registers
    /// (`inventory::host`).
    pub host_reserve: crate::inventory::host::HostReserve,
    /// Pinned host memory for swapped-out borrowed GPU memory on this node, split evenly over
    /// its GPUs' memory boards (`swap_host_memory`); `None`: [`swap_host_memory_default`].
    pub swap_host_memory: Option<u64>,
    /// One swap staging file per GPU shared by its processes (`shared_staging`).
    pub shared_staging: bool,
    /// Plain text, certificates, or a bootstrap token.
    pub security: crate::bootstrap::Security,
    /// Concurrent sharing: the node's MPS daemon ([`crate::mps`]); `None`: time slicing only.
    pub mps: Option<crate::mps::MpsConfig>,
    /// Registers the node as Kubernetes-managed (issue 18): the control plane then places no
    /// tenant here itself; only tenants pinned by the DRA driver hold its slices.
    pub kubernetes_managed: bool,
}

/// Retry and timeout settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Longest wait for a unary call or for a stream to open.
    pub call_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Default for Timings {
    fn default() -> Timings {
        Timings {
            retry_initial: Duration::from_millis(100),
            retry_max: Duration::from_secs(2),
            call_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
        }
    }
}

/// The node's swap staging budget when `swap_host_memory` is not set: a quarter of the host
/// memory it offers tenants (`MemTotal` less `reserved_host_memory`). Pinned memory cannot be
/// paged out, so the default keeps three quarters for the kernel and the tenants' own host
/// memory; 0 when the host memory is not known (then nothing is swapped, and that is said).
pub fn swap_host_memory_default(host_memory_bytes: u64) -> u64 {
    host_memory_bytes / 4
}

/// Joins the pool and follows assignments until `shutdown` completes (then returns `Ok`), or
/// until something that retrying cannot fix happens.
pub async fn join(config: JoinConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    // First, so that an agent without credentials stops before it touches anything.
    let transport =
        crate::bootstrap::transport(&config.security, &config.name, &config.control_plane).await?;
    let mut inventory = config.source.discover(&config.name)?;
    inventory.host = inventory.host.less(config.host_reserve)?;
    info!(
        cpu_milli = inventory.host.cpu_milli,
        host_memory_bytes = inventory.host.memory_bytes,
        "host capacity for tenants (0: not reported)"
    );
    let state = StateDir::open(&config.state_dir, &config.name)?;
    let node_key = state.node_key()?;
    let mut follower = Follower::restore(state.clone(), &config.name)?;
    state.write_inventory(&inventory)?;
    state.write_shm_dir(&config.shm_dir)?;
    let layout = crate::private::Layout::new(&config.shm_dir);
    // Before any tenant directory is touched: on a Kubernetes-managed node the DRA driver keeps
    // them, and the agent would remove its pods' tenants.
    crate::private::claim_keeper(&layout, crate::private::Keeper::Agent)?;
    let gpu_memory = inventory
        .gpus
        .iter()
        .map(|gpu| (gpu.uuid.clone(), gpu.memory_bytes))
        .collect();
    let swap_host_memory = config
        .swap_host_memory
        .unwrap_or_else(|| swap_host_memory_default(inventory.host.memory_bytes));
    if swap_host_memory == 0 {
        warn!(
            "swap_host_memory is 0: borrowed GPU memory is never swapped out on this node, so a tenant whose request others borrowed is refused with \"the node's swap space is full\""
        );
    } else {
        info!(
            swap_host_memory_bytes = swap_host_memory,
            "pinned host memory for swapped-out borrowed GPU memory, split evenly over the GPUs"
        );
    }
    if config.shared_staging {
        warn!(
            "shared_staging is on (experimental): each GPU's tenants share one swap staging file, \
             and every tenant process on a GPU can read what the others swapped out into it; use \
             it only where a GPU's tenants trust one another (docs/security.md)"
        );
    }
    follower = follower
        .with_gpu_memory(gpu_memory)
        .with_swap_host_memory(swap_host_memory)
        .with_shared_staging(config.shared_staging)
        .with_private(layout);
    if let Some(mps) = &config.mps {
        // Before any tenant can be started here: their environment names the daemon's pipes.
        crate::mps::ensure_running(mps)?;
        // Faults of its clients: reported, and clients that keep a lost context terminated so
        // that new ones are accepted again.
        let _mps_watch = crate::mps_watch::spawn(mps.clone(), crate::mps_watch::GRACE_DEFAULT);
    }
    if let Some(cdi) = config.cdi {
        if !cdi.interposer.is_file() {
            warn!(
                "the interposer {} does not exist; containers started from the CDI spec will fail until it does",
                cdi.interposer.display()
            );
        }
        follower = follower.with_cdi(CdiWriter::new(cdi, inventory.clone())?);
    }
    let endpoints = Endpoints::with_transport(
        &config.control_plane,
        config.timings.connect_timeout,
        &transport,
    )?;
    let monitor_config = MonitorConfig {
        node: config.name.clone(),
        shm_dir: config.shm_dir.clone(),
        state_dir: config.state_dir.clone(),
        interval: MONITOR_INTERVAL,
    };
    let (monitor_inventory, source) = (inventory.clone(), config.source.clone());
    let monitor = tokio::task::spawn_blocking(move || {
        Monitor::start(monitor_config, &monitor_inventory, &source)
    })
    .await
    .map_err(|error| Error::Monitor(error.to_string()))?
    .map_err(|error| Error::Monitor(error.to_string()))?;
    // The closed loop of each GPU with a latency tenant (`closed_loop`): its statuses go into the
    // usage report, its tenants follow the assignments.
    let closed_loop = crate::closed_loop::ClosedLoopShared::new();
    closed_loop.set_tenants(latency_tenants(follower.current()));
    let statuses = closed_loop.clone();
    monitor.set_latency_source(crate::usage::LatencySource::new(move |tenant| {
        let status = statuses.statuses().remove(tenant)?;
        Some(crate::usage::LatencyReport::from_ns(
            status.target_ns,
            status.baseline_p99_ns,
            status.p50_ns,
            status.p99_ns,
            status.steps,
            status.violations,
        ))
    }));
    // On an MPS node, the SM redistribution's members go into the usage report too.
    let members = closed_loop.clone();
    monitor.set_redistribution_source(crate::usage::RedistributionSource::new(move |tenant| {
        let member = members.members().remove(tenant)?;
        Some(crate::usage::RedistributionReport::from_member(&member))
    }));
    let _closed_loop_thread = crate::closed_loop::spawn(
        crate::closed_loop::ClosedLoopConfig::new(
            config.shm_dir.clone(),
            config
                .mps
                .as_ref()
                .is_some_and(|mps| mps.tenants.latency_tenants_join()),
            config.mps.as_ref().is_some_and(|mps| mps.redistribute),
            &inventory,
        ),
        closed_loop.clone(),
    );
    let mut worker = Worker::spawn(move |message, source| {
        follower.on_message(message, source)?;
        closed_loop.set_tenants(latency_tenants(follower.current()));
        Ok(())
    })?;
    let agent = Agent {
        node: api::v1::Node {
            kubernetes_managed: config.kubernetes_managed,
            ..inventory.to_proto(&config.address, &config.labels)
        },
        node_key,
        endpoints,
        timings: config.timings,
        monitor,
    };
    let shaper = tokio::spawn(crate::bandwidth::run(
        config.state_dir.clone(),
        config.shm_dir.clone(),
        config.nic_bytes_per_second,
    ));
    let result = agent.run(&mut worker, shutdown).await;
    shaper.abort();
    let counts = worker.counts();
    if !worker.stop(WORKER_STOP_LIMIT).await {
        warn!(
            "the assignment set being applied was not done within {} s (is the state directory's disk stuck?); exiting anyway, state files are replaced atomically",
            WORKER_STOP_LIMIT.as_secs()
        );
    }
    info!(
        "assignment messages: {} received, {} applied, {} replaced by a newer one first",
        counts.offered, counts.applied, counts.coalesced
    );
    result
}

struct Agent {
    node: api::v1::Node,
    /// Sent with every call.
    node_key: NodeKey,
    endpoints: Endpoints,
    timings: Timings,
    /// GPU health and tenant usage for the heartbeats.
    monitor: Monitor,
}

/// The latency tenants of an assignment set, with their explicit targets.
fn latency_tenants(
    set: &crate::assignments::AssignmentSet,
) -> BTreeMap<String, crate::closed_loop::LatencySpec> {
    set.tenants
        .iter()
        .filter(|(_, tenant)| tenant.latency)
        .map(|(name, tenant)| {
            let target_ns = tenant.latency_target_us.map(|us| us.saturating_mul(1_000));
            (name.clone(), crate::closed_loop::LatencySpec { target_ns })
        })
        .collect()
}

enum Answer {
    Register(Reply<RegisterResponse>),
    /// With the wait the session gave it.
    Heartbeat(Reply<HeartbeatResponse>, Duration),
}

/// What to log once the session has said what comes next.
enum Note {
    RegisterFailed { address: usize, problem: String },
    HeartbeatFailed { address: usize, problem: String },
    StreamEnded { address: usize, end: StreamEnd },
    Unapplied(Error),
}

impl Agent {
    /// Drives the node's session until it stops: `Ok` after `shutdown`, an error after a refusal
    /// that retrying cannot fix.
    async fn run(&self, worker: &mut Worker, shutdown: impl Future<Output = ()>) -> Result<()> {
        let mut session = Session::new(SessionConfig {
            node: self.name().to_owned(),
            addresses: self.endpoints.len(),
            first_address: 0,
            retry_initial: self.timings.retry_initial,
            retry_max: self.timings.retry_max,
            call_timeout: self.timings.call_timeout,
            watch: true,
            refusals: Refusals::InvalidInventory,
            jitter: None,
            report_policy: ReportPolicy::default(),
            first_generation: ReportSender::first_generation_now(),
        });
        let mut shutdown = std::pin::pin!(shutdown);
        let mut io = Io::<Answer>::default();
        // Heartbeat failures in a row, for the log.
        let mut failures: u64 = 0;
        // The number of the stream last opened, so that a failure of a message from an earlier
        // one does not drop the current one.
        let mut streams: u64 = 0;
        let mut actions = session.handle(now(), Event::Start);
        loop {
            for action in actions {
                if let Some(stopped) = self.execute(action, &mut io, &mut streams) {
                    return stopped;
                }
            }
            let latest: Report;
            let mut note = None;
            let event = tokio::select! {
                () = &mut shutdown => {
                    info!("shutting down");
                    Some(Event::Shutdown)
                }
                lane = io.timers.next() => Some(match lane {
                    Lane::Heartbeat => {
                        latest = self.monitor.latest();
                        Event::HeartbeatTimer { latest: &latest }
                    }
                    Lane::Watch => Event::WatchTimer,
                }),
                answer = maybe(io.call.as_mut().map(|call| &mut call.answer)) => {
                    let address = io.call.take().expect("the call answered").address;
                    let registration = session.registration();
                    Some(self.answered(address, answer, registration, &mut failures, &mut note))
                }
                item = next_item(io.stream.as_mut()) => {
                    let address = io.stream.as_ref().expect("the stream yielded").address;
                    match item {
                        StreamItem::Message(message) => {
                            let revision = message.revision;
                            if worker.offer(message, self.endpoints.address(address), streams) {
                                debug!("assignments revision {revision} replaced an unapplied set");
                            }
                            None
                        }
                        StreamItem::Ended(StreamEnd::Status(status)) if name_taken(&status) => {
                            io.stream = None;
                            Some(Event::NameTaken { message: status.message().to_owned() })
                        }
                        StreamItem::Ended(end) => {
                            io.stream = None;
                            let event = Event::WatchEnded(end.watch_end());
                            note = Some(Note::StreamEnded { address, end });
                            Some(event)
                        }
                    }
                }
                failure = worker.failure() => {
                    let Some(failure) = failure else {
                        return Err(Error::WorkerGone);
                    };
                    if io.stream.is_some() && failure.stream == streams {
                        io.stream = None;
                        note = Some(Note::Unapplied(failure.error));
                        Some(Event::WatchEnded(WatchEnd::Unapplied))
                    } else {
                        warn!(
                            "cannot apply the assignments of revision {} from an earlier stream: {}; the current stream's set is applied next",
                            failure.revision, failure.error
                        );
                        None
                    }
                }
            };
            let at = now();
            actions = match event {
                Some(event) => session.handle(at, event),
                None => Vec::new(),
            };
            if let Some(note) = note {
                self.log_note(note, &actions, &session, at, failures);
            }
        }
    }

    fn name(&self) -> &str {
        &self.node.name
    }

    /// Does what the session asked for; returns how the agent ends if it said to stop.
    fn execute(
        &self,
        action: Action,
        io: &mut Io<'static, Answer>,
        streams: &mut u64,
    ) -> Option<Result<()>> {
        match action {
            Action::Register {
                address,
                attempt,
                reason,
            } => {
                self.log_register(address, attempt, reason);
                io.call = Some(self.register(address));
            }
            Action::Heartbeat {
                address,
                timeout,
                registration,
                request,
            } => io.call = Some(self.heartbeat(address, timeout, registration, request)),
            Action::Watch { address } => {
                *streams += 1;
                io.stream = Some(AssignmentStream::open(
                    &self.endpoints,
                    address,
                    self.name(),
                    &self.node_key,
                    self.timings.call_timeout,
                ));
            }
            Action::WakeAt { lane, at } => io.timers.set(lane, at),
            Action::Stop(Stop::Shutdown) => return Some(Ok(())),
            Action::Stop(Stop::Refused { address, message }) => {
                return Some(Err(Error::RegisterRefused {
                    address: self.endpoints.address(address).to_owned(),
                    message,
                }));
            }
            Action::Stop(Stop::NameTaken { message }) => {
                return Some(Err(Error::NodeNameTaken {
                    node: self.name().to_owned(),
                    message,
                }));
            }
        }
        None
    }

    fn register(&self, address: usize) -> Call<'static, Answer> {
        let request = keyed(
            RegisterRequest {
                node: Some(self.node.clone()),
            },
            &self.node_key,
            None,
        );
        let mut client = self.endpoints.client(address);
        let call_timeout = self.timings.call_timeout;
        let answer = Box::pin(async move {
            Answer::Register(timeout(call_timeout, client.register(request)).await)
        });
        Call { address, answer }
    }

    fn heartbeat(
        &self,
        address: usize,
        limit: Duration,
        registration: u64,
        request: HeartbeatRequest,
    ) -> Call<'static, Answer> {
        let request = keyed(request, &self.node_key, Some(registration));
        let mut client = self.endpoints.client(address);
        let answer = Box::pin(async move {
            Answer::Heartbeat(timeout(limit, client.heartbeat(request)).await, limit)
        });
        Call { address, answer }
    }

    /// The event of a call's answer; logs what needs no word from the session.
    fn answered(
        &self,
        address: usize,
        answer: Answer,
        registration_before: u64,
        failures: &mut u64,
        note: &mut Option<Note>,
    ) -> Event<'static> {
        let at = self.endpoints.address(address);
        let timed_out = |limit: Duration| format!("timed out after {} ms", limit.as_millis());
        match answer {
            Answer::Register(Ok(Ok(response))) => {
                let interval_ms = response.get_ref().heartbeat_interval_ms;
                let registration = registration_of(&response);
                info!(
                    "registered node {} with {} GPUs via {at} (registration {registration}); heartbeat every {} ms",
                    self.name(),
                    self.node.gpus.len(),
                    crate::session::heartbeat_interval(interval_ms).as_millis()
                );
                if registration_before != 0 && registration != registration_before {
                    warn!(
                        "node {} was registered anew: its registration changed from {registration_before} to {registration}, because the control plane had forgotten the node (an admin removed it, or its state was lost); the assignment stream says which tenants it runs now",
                        self.name()
                    );
                }
                *failures = 0;
                Event::RegisterAnswered {
                    heartbeat_interval_ms: interval_ms,
                    registration,
                }
            }
            Answer::Register(Ok(Err(status))) | Answer::Heartbeat(Ok(Err(status)), _)
                if name_taken(&status) =>
            {
                Event::NameTaken {
                    message: status.message().to_owned(),
                }
            }
            Answer::Register(Ok(Err(status))) => {
                let problem = format!("failed: {}", describe(&status));
                *note = Some(Note::RegisterFailed { address, problem });
                Event::RegisterFailed(CallError::of(&status))
            }
            Answer::Register(Err(_)) => {
                let problem = timed_out(self.timings.call_timeout);
                *note = Some(Note::RegisterFailed { address, problem });
                Event::RegisterFailed(CallError::TimedOut)
            }
            Answer::Heartbeat(Ok(Ok(response)), _) => {
                let response = response.into_inner();
                if response.known {
                    if *failures > 0 {
                        info!(
                            "heartbeats reach the control plane again via {at} after {failures} failures"
                        );
                    }
                    debug!("heartbeat via {at}");
                    *failures = 0;
                }
                Event::HeartbeatAnswered {
                    known: response.known,
                    report_wanted: response.report_wanted,
                }
            }
            Answer::Heartbeat(Ok(Err(status)), _) => {
                *failures += 1;
                let problem = describe(&status);
                *note = Some(Note::HeartbeatFailed { address, problem });
                Event::HeartbeatFailed
            }
            Answer::Heartbeat(Err(_), limit) => {
                *failures += 1;
                let problem = timed_out(limit);
                *note = Some(Note::HeartbeatFailed { address, problem });
                Event::HeartbeatFailed
            }
        }
    }

    fn log_register(&self, address: usize, attempt: u64, reason: RegisterReason) {
        let at = self.endpoints.address(address);
        if attempt == 1 {
            match reason {
                RegisterReason::Join => {}
                RegisterReason::Unknown => warn!(
                    "the control plane at {at} does not know node {}; registering again",
                    self.name()
                ),
                RegisterReason::NotRegistered => info!(
                    "the control plane does not know node {}; registering again",
                    self.name()
                ),
            }
        }
        info!(
            "registering node {} with {} GPUs at {at} (attempt {attempt})",
            self.name(),
            self.node.gpus.len()
        );
    }

    /// Logs a failure with what the session does next: where it calls, and after how long.
    fn log_note(
        &self,
        note: Note,
        actions: &[Action],
        session: &Session,
        at: std::time::Instant,
        failures: u64,
    ) {
        let delay_ms = |lane: Lane| {
            let wake = actions.iter().find_map(|action| match action {
                Action::WakeAt { lane: woken, at } if *woken == lane => Some(*at),
                _ => None,
            });
            wake.map_or(0, |wake| wake.saturating_duration_since(at).as_millis())
        };
        let address = |index: usize| self.endpoints.address(index);
        let watch_again = || {
            format!(
                "watching again via {} in {} ms",
                address(session.watch_address()),
                delay_ms(Lane::Watch)
            )
        };
        match note {
            Note::RegisterFailed {
                address: to,
                problem,
            } => {
                // A refusal that stops the agent is told by the error it returns.
                let stops = actions.iter().any(|a| matches!(a, Action::Stop(_)));
                if !stops {
                    warn!("registering at {} {problem}", address(to));
                }
            }
            Note::HeartbeatFailed {
                address: to,
                problem,
            } => {
                // The first failure and then ever more rarely, so an outage does not flood the log.
                if failures.is_power_of_two() || failures.is_multiple_of(64) {
                    warn!(
                        "heartbeat via {} failed ({failures} in a row): {problem}; next via {} in {} ms",
                        address(to),
                        address(session.heartbeat_address()),
                        delay_ms(Lane::Heartbeat)
                    );
                }
            }
            Note::StreamEnded { address: from, end } => {
                let from = address(from);
                match end {
                    StreamEnd::Closed => {
                        info!("the assignment stream from {from} ended; {}", watch_again())
                    }
                    StreamEnd::OpenTimedOut => warn!(
                        "opening the assignment stream at {from} timed out after {} ms; {}",
                        self.timings.call_timeout.as_millis(),
                        watch_again()
                    ),
                    StreamEnd::Status(status) if end_is_not_registered(&status) => warn!(
                        "the assignment stream from {from} says: {}; {}",
                        describe(&status),
                        watch_again()
                    ),
                    StreamEnd::Status(status) => warn!(
                        "the assignment stream from {from} failed: {}; {}",
                        describe(&status),
                        watch_again()
                    ),
                }
            }
            Note::Unapplied(problem) => {
                error!("cannot apply the assignments: {problem}; {}", watch_again())
            }
        }
    }
}

fn end_is_not_registered(status: &tonic::Status) -> bool {
    WatchEnd::of(status) == WatchEnd::NotRegistered
}

/// A call's outcome: its answer, an error status, or no answer within its timeout.
pub(crate) type Reply<T> =
    std::result::Result<std::result::Result<tonic::Response<T>, tonic::Status>, Elapsed>;
/// A call in flight, owned, so that it survives the `select!` rounds it does not win.
pub(crate) type Pending<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The unary call in flight: the index of the address it went to, and its answer to come.
pub(crate) struct Call<'a, A> {
    pub(crate) address: usize,
    pub(crate) answer: Pending<'a, A>,
}

/// What a session's shell has in flight: at most one unary call (a registration or a
/// heartbeat), one assignment stream and one timer per lane.
pub(crate) struct Io<'a, A> {
    pub(crate) call: Option<Call<'a, A>>,
    pub(crate) stream: Option<AssignmentStream>,
    pub(crate) timers: Timers,
}

impl<A> Default for Io<'_, A> {
    fn default() -> Self {
        Io {
            call: None,
            stream: None,
            timers: Timers::default(),
        }
    }
}

/// The time now, on tokio's clock, for a [`Session`] event.
pub(crate) fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Completes with `future`'s output, or never when there is none: a `select!` branch for a call
/// that may not be in flight.
pub(crate) async fn maybe<F: Future + Unpin>(future: Option<F>) -> F::Output {
    match future {
        Some(future) => future.await,
        None => std::future::pending().await,
    }
}

/// The two timers a [`Session`] asks for, one per [`Lane`]; setting one replaces it.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    heartbeat: Option<std::time::Instant>,
    watch: Option<std::time::Instant>,
}

impl Timers {
    pub(crate) fn set(&mut self, lane: Lane, at: std::time::Instant) {
        *self.slot(lane) = Some(at);
    }

    /// Waits for the earlier timer, clears it and returns its lane; never completes while none
    /// is set. Cancel-safe: a timer is cleared only once it fired.
    pub(crate) async fn next(&mut self) -> Lane {
        let due = [(self.heartbeat, Lane::Heartbeat), (self.watch, Lane::Watch)]
            .into_iter()
            .filter_map(|(at, lane)| Some((at?, lane)))
            .min();
        let Some((at, lane)) = due else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        *self.slot(lane) = None;
        lane
    }

    fn slot(&mut self, lane: Lane) -> &mut Option<std::time::Instant> {
        match lane {
            Lane::Heartbeat => &mut self.heartbeat,
            Lane::Watch => &mut self.watch,
        }
    }
}

/// One `WatchAssignments` stream, from its opening on.
pub(crate) struct AssignmentStream {
    /// The index of the address it was opened at.
    pub(crate) address: usize,
    /// That address, for the log.
    name: String,
    state: StreamState,
}

enum StreamState {
    Opening(Pending<'static, Reply<Streaming<Assignments>>>),
    /// Boxed: a stream is large, and every simulated node of a fleet holds one.
    Open(Box<Streaming<Assignments>>),
}

/// What an assignment stream yielded.
pub(crate) enum StreamItem {
    Message(Assignments),
    /// The stream is over; drop it.
    Ended(StreamEnd),
}

/// How an assignment stream ended.
pub(crate) enum StreamEnd {
    Closed,
    OpenTimedOut,
    Status(tonic::Status),
}

impl StreamEnd {
    /// What the session is told.
    pub(crate) fn watch_end(&self) -> WatchEnd {
        match self {
            StreamEnd::Closed => WatchEnd::Closed,
            StreamEnd::OpenTimedOut => WatchEnd::Failed,
            StreamEnd::Status(status) => WatchEnd::of(status),
        }
    }
}

impl AssignmentStream {
    /// Starts opening `node`'s stream at the address with index `address`, waiting at most
    /// `call_timeout` for it to open.
    pub(crate) fn open(
        endpoints: &Endpoints,
        address: usize,
        node: &str,
        node_key: &NodeKey,
        call_timeout: Duration,
    ) -> AssignmentStream {
        let request = keyed(
            WatchAssignmentsRequest {
                node: node.to_owned(),
            },
            node_key,
            None,
        );
        let mut client = endpoints.client(address);
        let opening =
            Box::pin(async move { timeout(call_timeout, client.watch_assignments(request)).await });
        AssignmentStream {
            address,
            name: endpoints.address(address).to_owned(),
            state: StreamState::Opening(opening),
        }
    }

    /// The next message, or the end. Cancel-safe: the opening call and the stream live in
    /// `self`.
    pub(crate) async fn next(&mut self) -> StreamItem {
        loop {
            match &mut self.state {
                StreamState::Opening(opening) => match opening.await {
                    Err(_) => return StreamItem::Ended(StreamEnd::OpenTimedOut),
                    Ok(Err(status)) => return StreamItem::Ended(StreamEnd::Status(status)),
                    Ok(Ok(response)) => {
                        debug!("watching assignments via {}", self.name);
                        self.state = StreamState::Open(Box::new(response.into_inner()));
                    }
                },
                StreamState::Open(stream) => {
                    return match stream.message().await {
                        Ok(Some(message)) => StreamItem::Message(message),
                        Ok(None) => StreamItem::Ended(StreamEnd::Closed),
                        Err(status) => StreamItem::Ended(StreamEnd::Status(status)),
                    };
                }
            }
        }
    }
}

/// The next item of `stream`, or never when there is none: a `select!` branch.
pub(crate) async fn next_item(stream: Option<&mut AssignmentStream>) -> StreamItem {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// `message` as a request that carries the node key and, for a beat, the registration it is for.
pub(crate) fn keyed<T>(
    message: T,
    node_key: &NodeKey,
    registration: Option<u64>,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    let key = node_key.as_str().parse().expect("hex digits are ASCII");
    metadata.insert(NODE_KEY_METADATA, key);
    if let Some(registration) = registration {
        metadata.insert(REGISTRATION_METADATA, registration.into());
    }
    request
}

/// The number of the registration a `Register` answer accepted; 0 when there is none (a
/// control plane that does not number registrations).
pub(crate) fn registration_of<T>(response: &tonic::Response<T>) -> u64 {
    response
        .metadata()
        .get(REGISTRATION_METADATA)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

/// A status for a log line: its message, or its code when the message is empty.
pub(crate) fn describe(status: &tonic::Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {}", status.code(), status.message())
    }
}
