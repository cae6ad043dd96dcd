//! The fleet simulator behind `vgpu-agent simulate-fleet`: many simulated nodes in one process,
//! each driving the same node [`Session`] as `join` (register, heartbeat at the interval the
//! control plane hands out, register again when forgotten, watch its assignments), so that a
//! real control-plane cluster can be loaded with a thousand or more nodes from one machine, and
//! what it measures is the protocol real nodes speak. This file is the session's I/O shell for
//! a simulated node: it makes the calls (with the stream and timer pieces of [`crate::agent`])
//! and counts what happens.
//!
//! Each node is a tokio task. Nodes share gRPC channels: about `nodes_per_connection` nodes use
//! one HTTP/2 connection to each control-plane address, and node `i` starts at address
//! `i mod addresses`, so the load spreads over the members (followers forward heartbeats and
//! writes to the leader, as they do for real agents). What a simulated node leaves out on
//! purpose: the state directory, CDI specs and anything GPU-side; it only counts the assignment
//! messages and tenants it is sent. Its node key is derived from its name
//! ([`NodeKey::derived`]), so a second run with the same names registers the same nodes again; a
//! node whose name another registration holds stops the fleet, as a refused registration does.
//!
//! Each node has a health report of its GPUs (fixed made-up values, as `join --simulate`
//! sends), unless `report_health` is off, and the session sends it the way `join` does
//! ([`crate::report::ReportSender`]): in full on the first beat, when the leader asks for it, and
//! every 30 beats; the other beats name the report the leader holds. The transport is plain text
//! (`--insecure`) or mutual TLS with one certificate for the whole fleet, which must then have
//! the admin role (an agent certificate acts only for its own node); so unlike `join`, a node
//! also stops on a registration refused for its credentials
//! ([`Refusals::InvalidInventoryOrCredentials`]).
//!
//! Heartbeat intervals are jittered (± `heartbeat_jitter_percent`) and the first heartbeat of
//! each node falls at a random point of its first interval, so the fleet does not beat in
//! lockstep. The jitter is drawn from a per-node SplitMix64 sequence seeded by the node's index
//! ([`Jitter`]), so two runs with the same settings send the same schedule.

pub mod latency;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use api::tls::Transport;
use api::v1::{GpuHealth, HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse};
use serde::Serialize;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout};
use tracing::{info, warn};

use crate::agent::{
    AssignmentStream, Call, Io, Reply, StreamEnd, StreamItem, describe, keyed, maybe, next_item,
    now, registration_of,
};
use crate::endpoints::Endpoints;
use crate::error::{Error, Result};
use crate::inventory::InventorySource;
use crate::monitor::Report;
use crate::report::{ReportPolicy, ReportSender};
use crate::session::{
    Action, CallError, Event, Jitter, Lane, Refusals, Session, SessionConfig, Stop, WatchEnd,
    name_taken,
};
use crate::state::NodeKey;
use crate::{Timings, parse_label};

pub use crate::session::HEARTBEAT_JITTER_PERCENT_MAX;
pub use latency::{LatencyHistogram, LatencySummary};

/// Most nodes one fleet process simulates.
pub const FLEET_NODES_MAX: usize = 100_000;
/// Nodes that share one connection to each control-plane address, by default.
pub const NODES_PER_CONNECTION_DEFAULT: usize = 50;
/// Most nodes per connection: every node keeps one assignment stream open on its connection.
pub const NODES_PER_CONNECTION_MAX: usize = 1000;
/// Registrations in flight at once, by default (the ramp-up rate is what the cluster can take
/// at this concurrency).
pub const REGISTRATIONS_IN_FLIGHT_DEFAULT: usize = 32;
pub const REGISTRATIONS_IN_FLIGHT_MAX: usize = 1024;

/// What `vgpu-agent simulate-fleet` runs with.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Control-plane addresses, `HOST:PORT` or `http://HOST:PORT`.
    pub control_plane: Vec<String>,
    /// How many nodes to simulate.
    pub count: usize,
    /// The simulated GPUs of every node: `COUNTxMODEL-MEMORY` or a topology file.
    pub spec: String,
    /// Node names are `PREFIX-00000`, `PREFIX-00001`, ...
    pub name_prefix: String,
    /// Index of the first node (to run several fleet processes against one cluster).
    pub first_index: usize,
    pub labels: BTreeMap<String, String>,
    pub heartbeat_jitter_percent: u32,
    pub registrations_in_flight: usize,
    pub nodes_per_connection: usize,
    /// Whether each node watches its assignments (one stream per node).
    pub watch: bool,
    /// Whether heartbeats carry a (made-up) health report of every GPU.
    pub report_health: bool,
    /// Plain text, or mTLS with an admin certificate.
    pub transport: Transport,
    /// Stop this long after every node registered; `None` runs until shutdown.
    pub duration: Option<Duration>,
    /// How often progress is logged while nodes register (ten times as rarely afterwards).
    pub progress_interval: Duration,
    pub timings: Timings,
}

impl FleetConfig {
    /// A fleet of `count` nodes of `spec` with the default settings, over plain text.
    pub fn new(control_plane: Vec<String>, count: usize, spec: &str) -> FleetConfig {
        FleetConfig {
            control_plane,
            count,
            spec: spec.to_owned(),
            name_prefix: "sim".to_owned(),
            first_index: 0,
            labels: BTreeMap::new(),
            heartbeat_jitter_percent: 10,
            registrations_in_flight: REGISTRATIONS_IN_FLIGHT_DEFAULT,
            nodes_per_connection: NODES_PER_CONNECTION_DEFAULT,
            watch: true,
            report_health: true,
            transport: Transport::Insecure,
            duration: None,
            progress_interval: Duration::from_secs(1),
            timings: Timings::default(),
        }
    }

    /// The name of the node at `index` (counted from `first_index`), numbered with five digits
    /// (more past 99,999) so that names sort in node order.
    pub fn node_name(&self, index: usize) -> String {
        format!("{}-{:05}", self.name_prefix, self.first_index + index)
    }

    fn validate(&self) -> Result<()> {
        let bad = |problem: String| Err(Error::FleetSettings { problem });
        if self.count == 0 || self.count > FLEET_NODES_MAX {
            return bad(format!(
                "--count {} is out of range; simulate 1 to {FLEET_NODES_MAX} nodes per process",
                self.count
            ));
        }
        if self.heartbeat_jitter_percent > HEARTBEAT_JITTER_PERCENT_MAX {
            return bad(format!(
                "--heartbeat-jitter-percent {} is above {HEARTBEAT_JITTER_PERCENT_MAX}",
                self.heartbeat_jitter_percent
            ));
        }
        if !(1..=REGISTRATIONS_IN_FLIGHT_MAX).contains(&self.registrations_in_flight) {
            return bad(format!(
                "--registrations-in-flight {} is out of range; give 1 to {REGISTRATIONS_IN_FLIGHT_MAX}",
                self.registrations_in_flight
            ));
        }
        if !(1..=NODES_PER_CONNECTION_MAX).contains(&self.nodes_per_connection) {
            return bad(format!(
                "--nodes-per-connection {} is out of range; give 1 to {NODES_PER_CONNECTION_MAX}",
                self.nodes_per_connection
            ));
        }
        if self.progress_interval.is_zero() {
            return bad("the progress interval is 0; give at least 1 ms".to_owned());
        }
        api::names::validate("node", &self.node_name(self.count - 1))?;
        for (key, value) in &self.labels {
            parse_label(&format!("{key}={value}"))?;
        }
        Ok(())
    }
}

/// What a fleet run did, for people ([`std::fmt::Display`]) and for benchmarks (JSON).
#[derive(Debug, Clone, Serialize)]
pub struct FleetSummary {
    pub nodes: usize,
    pub gpus_per_node: usize,
    /// Nodes registered at least once.
    pub registered: usize,
    /// Seconds from the start until every node had registered, if they all did.
    pub ramp_up_seconds: Option<f64>,
    pub elapsed_seconds: f64,
    pub registrations: u64,
    pub registration_failures: u64,
    pub heartbeats_sent: u64,
    pub heartbeat_failures: u64,
    /// Heartbeats answered "unknown node", each followed by a registration.
    pub heartbeats_unknown: u64,
    /// Heartbeats that carried a full health report (the others named the one the leader
    /// holds).
    pub reports_sent: u64,
    /// Heartbeats answered `report_wanted` (the leader held no or another report).
    pub reports_wanted: u64,
    pub assignment_messages: u64,
    pub watch_reconnects: u64,
    /// Tenant assignments held by all nodes together at the end.
    pub tenants_assigned: i64,
    /// Every successful heartbeat call, as the simulated agents saw it.
    pub heartbeat_latency: LatencySummary,
    /// Successful heartbeat calls after every node had registered.
    pub heartbeat_latency_steady: LatencySummary,
    pub register_latency: LatencySummary,
    /// The last failure message seen, if any.
    pub last_failure: Option<String>,
}

impl std::fmt::Display for FleetSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "fleet: {} nodes x {} GPUs, {} registered, ran {:.1} s",
            self.nodes, self.gpus_per_node, self.registered, self.elapsed_seconds
        )?;
        match self.ramp_up_seconds {
            Some(seconds) => writeln!(
                f,
                "ramp-up: every node registered after {seconds:.1} s ({:.0} registrations/s)",
                self.nodes as f64 / seconds.max(1e-3)
            )?,
            None => writeln!(f, "ramp-up: not every node registered")?,
        }
        writeln!(
            f,
            "registrations: {} ({} failed attempts), {}",
            self.registrations, self.registration_failures, self.register_latency
        )?;
        writeln!(
            f,
            "heartbeats: {} sent, {} failed, {} answered `unknown node`; {} with a full report, {} answered `report wanted`",
            self.heartbeats_sent,
            self.heartbeat_failures,
            self.heartbeats_unknown,
            self.reports_sent,
            self.reports_wanted
        )?;
        writeln!(f, "heartbeat latency, all: {}", self.heartbeat_latency)?;
        writeln!(
            f,
            "heartbeat latency, after ramp-up: {}",
            self.heartbeat_latency_steady
        )?;
        writeln!(
            f,
            "assignments: {} messages, {} stream reconnects, {} tenant assignments held at the end",
            self.assignment_messages, self.watch_reconnects, self.tenants_assigned
        )?;
        if let Some(failure) = &self.last_failure {
            writeln!(f, "last failure: {failure}")?;
        }
        Ok(())
    }
}

/// Runs the fleet until `shutdown` completes, or until `duration` has passed after every node
/// registered. Returns the summary; fails only on what retrying cannot fix (bad settings, a
/// control plane that refuses the registration).
pub async fn simulate_fleet(
    config: FleetConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<FleetSummary> {
    config.validate()?;
    let source = InventorySource::from_simulate_arg(&config.spec)?;
    let mut nodes = Vec::with_capacity(config.count);
    for index in 0..config.count {
        let inventory = source.discover(&config.node_name(index))?;
        nodes.push(inventory.to_proto("", &config.labels));
    }
    let gpus_per_node = nodes[0].gpus.len();
    let open = || {
        Endpoints::with_transport(
            &config.control_plane,
            config.timings.connect_timeout,
            &config.transport,
        )
    };
    let addresses = open()?.len();
    let per_address = config.count.div_ceil(addresses);
    let connections = per_address.div_ceil(config.nodes_per_connection);
    let endpoints = (0..connections)
        .map(|_| open())
        .collect::<Result<Vec<_>>>()?;
    info!(
        "simulating {} nodes x {gpus_per_node} GPUs against {addresses} control-plane addresses over {} connections",
        config.count,
        connections * addresses
    );
    let fleet = Arc::new(Fleet {
        stats: Stats::default(),
        registrations: Semaphore::new(config.registrations_in_flight),
        started: Instant::now(),
        all_registered: Notify::new(),
        first_generation: ReportSender::first_generation_now(),
        endpoints,
        addresses,
        config,
    });
    let mut tasks = JoinSet::new();
    for (index, node) in nodes.into_iter().enumerate() {
        let fleet = fleet.clone();
        tasks.spawn(async move { fleet.run_node(index, node).await });
    }
    let outcome = tokio::select! {
        () = shutdown => {
            info!("shutting down the fleet");
            Ok(())
        }
        () = fleet.clone().until_done() => Ok(()),
        Some(joined) = tasks.join_next() => match joined {
            Ok(Err(error)) => Err(error),
            Ok(Ok(never)) => match never {},
            Err(join_error) => panic!("a simulated node panicked: {join_error}"),
        },
    };
    tasks.abort_all();
    outcome?;
    Ok(fleet.summary(gpus_per_node))
}

struct Fleet {
    config: FleetConfig,
    /// Channel sets; node `i` uses set `(i / addresses) % sets`.
    endpoints: Vec<Endpoints>,
    addresses: usize,
    stats: Stats,
    registrations: Semaphore,
    started: Instant,
    all_registered: Notify,
    /// The first report generation of every node (from the wall clock at start).
    first_generation: u64,
}

#[derive(Default)]
struct Stats {
    registered: AtomicUsize,
    ramp_up_micros: AtomicU64,
    steady: AtomicBool,
    registrations: AtomicU64,
    registration_failures: AtomicU64,
    heartbeats_sent: AtomicU64,
    heartbeat_failures: AtomicU64,
    heartbeats_unknown: AtomicU64,
    reports_sent: AtomicU64,
    reports_wanted: AtomicU64,
    assignment_messages: AtomicU64,
    watch_reconnects: AtomicU64,
    tenants_assigned: AtomicI64,
    heartbeat_latency: LatencyHistogram,
    heartbeat_latency_steady: LatencyHistogram,
    register_latency: LatencyHistogram,
    last_failure: Mutex<Option<String>>,
}

impl Stats {
    fn failure(&self, message: String) {
        *self.last_failure.lock().expect("failure lock") = Some(message);
    }
}

/// A simulated node's calls' answers, with how long they took.
enum Answer {
    Register(Reply<RegisterResponse>, Duration),
    /// With the wait the session gave it.
    Heartbeat(Reply<HeartbeatResponse>, Duration, Duration),
}

impl Fleet {
    /// Drives node `index`'s session and counts what happens; returns only on a registration
    /// refused for good.
    async fn run_node(&self, index: usize, node: api::v1::Node) -> Result<Infallible> {
        let endpoints = &self.endpoints[(index / self.addresses) % self.endpoints.len()];
        let timings = &self.config.timings;
        let report = Report {
            gpus: if self.config.report_health {
                simulated_health(&node)
            } else {
                Vec::new()
            },
            usage: Vec::new(),
        };
        let mut session = Session::new(SessionConfig {
            node: node.name.clone(),
            addresses: self.addresses,
            first_address: index % self.addresses,
            retry_initial: timings.retry_initial,
            retry_max: timings.retry_max,
            call_timeout: timings.call_timeout,
            watch: self.config.watch,
            refusals: Refusals::InvalidInventoryOrCredentials,
            jitter: Some(Jitter {
                percent: self.config.heartbeat_jitter_percent,
                seed: self.config.first_index as u64 + index as u64,
            }),
            report_policy: ReportPolicy::default(),
            first_generation: self.first_generation,
        });
        let node_key = NodeKey::derived(&node.name);
        let mut io = Io::<Answer>::default();
        // Whether the node registered once; until then registrations take a permit.
        let mut joined = false;
        // The node's tenant assignments, as its last message listed them.
        let mut tenants: i64 = 0;
        let mut actions = session.handle(now(), Event::Start);
        loop {
            for action in actions {
                let keyed_node = (&node, &node_key);
                if let Some(refused) = self.execute(endpoints, keyed_node, joined, action, &mut io)
                {
                    return Err(refused);
                }
            }
            let event = tokio::select! {
                lane = io.timers.next() => Some(match lane {
                    Lane::Heartbeat => Event::HeartbeatTimer { latest: &report },
                    Lane::Watch => Event::WatchTimer,
                }),
                answer = maybe(io.call.as_mut().map(|call| &mut call.answer)) => {
                    let address = io.call.take().expect("the call answered").address;
                    let at = endpoints.address(address);
                    Some(self.count_answer(&node.name, at, answer, &mut joined))
                }
                item = next_item(io.stream.as_mut()) => match item {
                    StreamItem::Message(message) => {
                        let stats = &self.stats;
                        stats.assignment_messages.fetch_add(1, Ordering::Relaxed);
                        let held = message.assignments.len() as i64;
                        stats.tenants_assigned.fetch_add(held - tenants, Ordering::Relaxed);
                        tenants = held;
                        None
                    }
                    StreamItem::Ended(end) => {
                        let address = io.stream.take().expect("the stream ended").address;
                        self.count_stream_end(&node.name, endpoints.address(address), &end);
                        match end {
                            StreamEnd::Status(status) if name_taken(&status) => {
                                Some(Event::NameTaken { message: status.message().to_owned() })
                            }
                            end => Some(Event::WatchEnded(end.watch_end())),
                        }
                    }
                },
            };
            actions = match event {
                Some(event) => session.handle(now(), event),
                None => Vec::new(),
            };
        }
    }

    /// Does what the session asked for; returns the error if it said to stop.
    fn execute<'a>(
        &'a self,
        endpoints: &Endpoints,
        (node, node_key): (&api::v1::Node, &NodeKey),
        joined: bool,
        action: Action,
        io: &mut Io<'a, Answer>,
    ) -> Option<Error> {
        match action {
            Action::Register { address, .. } => {
                io.call = Some(self.register(endpoints, address, node, node_key, !joined));
            }
            Action::Heartbeat {
                address,
                timeout,
                registration,
                request,
            } => {
                let request = keyed(request, node_key, Some(registration));
                io.call = Some(self.heartbeat(endpoints, address, timeout, request));
            }
            Action::Watch { address } => {
                io.stream = Some(AssignmentStream::open(
                    endpoints,
                    address,
                    &node.name,
                    node_key,
                    self.config.timings.call_timeout,
                ));
            }
            Action::WakeAt { lane, at } => io.timers.set(lane, at),
            Action::Stop(Stop::Refused { address, message }) => {
                return Some(Error::RegisterRefused {
                    address: endpoints.address(address).to_owned(),
                    message,
                });
            }
            Action::Stop(Stop::NameTaken { message }) => {
                return Some(Error::NodeNameTaken {
                    node: node.name.clone(),
                    message,
                });
            }
            Action::Stop(Stop::Shutdown) => {
                unreachable!("the fleet aborts its nodes instead of shutting them down")
            }
        }
        None
    }

    /// A registration of `node` at `address`; one that joins waits for a permit first, so that
    /// at most `registrations_in_flight` nodes join at once.
    fn register<'a>(
        &'a self,
        endpoints: &Endpoints,
        address: usize,
        node: &api::v1::Node,
        node_key: &NodeKey,
        joining: bool,
    ) -> Call<'a, Answer> {
        let request = keyed(
            RegisterRequest {
                node: Some(node.clone()),
            },
            node_key,
            None,
        );
        let mut client = endpoints.client(address);
        let call_timeout = self.config.timings.call_timeout;
        let answer = Box::pin(async move {
            let _permit = if joining {
                Some(self.registrations.acquire().await.expect("never closed"))
            } else {
                None
            };
            let started = Instant::now();
            let reply = timeout(call_timeout, client.register(request)).await;
            Answer::Register(reply, started.elapsed())
        });
        Call { address, answer }
    }

    fn heartbeat(
        &self,
        endpoints: &Endpoints,
        address: usize,
        limit: Duration,
        request: tonic::Request<HeartbeatRequest>,
    ) -> Call<'static, Answer> {
        let beat = request.get_ref();
        if !beat.gpus.is_empty() || !beat.usage.is_empty() {
            self.stats.reports_sent.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.heartbeats_sent.fetch_add(1, Ordering::Relaxed);
        let mut client = endpoints.client(address);
        let answer = Box::pin(async move {
            let started = Instant::now();
            let reply = timeout(limit, client.heartbeat(request)).await;
            Answer::Heartbeat(reply, limit, started.elapsed())
        });
        Call { address, answer }
    }

    /// Counts a call's answer and turns it into the session's event.
    fn count_answer(
        &self,
        node: &str,
        address: &str,
        answer: Answer,
        joined: &mut bool,
    ) -> Event<'static> {
        let stats = &self.stats;
        let relaxed = Ordering::Relaxed;
        match answer {
            Answer::Register(Ok(Ok(response)), elapsed) => {
                stats.register_latency.record(elapsed);
                stats.registrations.fetch_add(1, relaxed);
                if !*joined {
                    *joined = true;
                    self.joined();
                }
                Event::RegisterAnswered {
                    heartbeat_interval_ms: response.get_ref().heartbeat_interval_ms,
                    registration: registration_of(&response),
                }
            }
            Answer::Register(Ok(Err(status)), _) | Answer::Heartbeat(Ok(Err(status)), _, _)
                if name_taken(&status) =>
            {
                stats.failure(format!("{node} at {address}: {}", describe(&status)));
                Event::NameTaken {
                    message: status.message().to_owned(),
                }
            }
            Answer::Register(Ok(Err(status)), _) => {
                stats.registration_failures.fetch_add(1, relaxed);
                stats.failure(format!(
                    "registering {node} at {address}: {}",
                    describe(&status)
                ));
                Event::RegisterFailed(CallError::of(&status))
            }
            Answer::Register(Err(_), _) => {
                stats.registration_failures.fetch_add(1, relaxed);
                stats.failure(format!(
                    "registering {node} at {address}: timed out after {} ms",
                    self.config.timings.call_timeout.as_millis()
                ));
                Event::RegisterFailed(CallError::TimedOut)
            }
            Answer::Heartbeat(Ok(Ok(response)), _, elapsed) => {
                stats.heartbeat_latency.record(elapsed);
                if stats.steady.load(relaxed) {
                    stats.heartbeat_latency_steady.record(elapsed);
                }
                let answer = response.into_inner();
                if answer.report_wanted {
                    stats.reports_wanted.fetch_add(1, relaxed);
                }
                if !answer.known {
                    stats.heartbeats_unknown.fetch_add(1, relaxed);
                }
                Event::HeartbeatAnswered {
                    known: answer.known,
                    report_wanted: answer.report_wanted,
                }
            }
            Answer::Heartbeat(failed, limit, _) => {
                let problem = match failed {
                    Ok(Err(status)) => describe(&status),
                    _ => format!("timed out after {} ms", limit.as_millis()),
                };
                stats.heartbeat_failures.fetch_add(1, relaxed);
                stats.failure(format!("heartbeat of {node} via {address}: {problem}"));
                Event::HeartbeatFailed
            }
        }
    }

    /// A node registered for the first time; the last one ends the ramp-up.
    fn joined(&self) {
        let registered = self.stats.registered.fetch_add(1, Ordering::Relaxed) + 1;
        assert!(registered <= self.config.count);
        if registered == self.config.count {
            let micros = self.started.elapsed().as_micros() as u64;
            self.stats.ramp_up_micros.store(micros, Ordering::Relaxed);
            self.stats.steady.store(true, Ordering::Relaxed);
            self.all_registered.notify_waiters();
        }
    }

    fn count_stream_end(&self, node: &str, address: &str, end: &StreamEnd) {
        self.stats.watch_reconnects.fetch_add(1, Ordering::Relaxed);
        let problem = match end {
            StreamEnd::Closed => return,
            StreamEnd::OpenTimedOut => "opening timed out".to_owned(),
            StreamEnd::Status(_) if end.watch_end() == WatchEnd::NotRegistered => return,
            StreamEnd::Status(status) => describe(status),
        };
        self.stats.failure(format!(
            "assignment stream of {node} from {address}: {problem}"
        ));
    }

    /// Logs progress; completes `duration` after the last node registered (never without one).
    async fn until_done(self: Arc<Self>) {
        let count = self.config.count;
        let mut last_registered = 0;
        let mut last_at = Instant::now();
        let mut announced = false;
        loop {
            let steady = self.stats.steady.load(Ordering::Relaxed);
            let mut period = self.config.progress_interval;
            if steady {
                period *= 10;
                if let Some(duration) = self.config.duration {
                    let ramp = self.stats.ramp_up_micros.load(Ordering::Relaxed);
                    let end = self.started + Duration::from_micros(ramp) + duration;
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    period = period.min(left);
                }
            }
            tokio::select! {
                () = sleep(period) => {}
                () = self.all_registered.notified(), if !steady => {}
            }
            let stats = &self.stats;
            let registered = stats.registered.load(Ordering::Relaxed);
            let rate = (registered - last_registered) as f64 / last_at.elapsed().as_secs_f64();
            (last_registered, last_at) = (registered, Instant::now());
            let failures = stats.heartbeat_failures.load(Ordering::Relaxed)
                + stats.registration_failures.load(Ordering::Relaxed);
            let line = format!(
                "registered {registered}/{count} nodes ({rate:.0}/s); heartbeats {} sent, {} failed, latency p50 {:.2} ms p99 {:.2} ms; {} assignment messages",
                stats.heartbeats_sent.load(Ordering::Relaxed),
                stats.heartbeat_failures.load(Ordering::Relaxed),
                stats.heartbeat_latency.quantile(0.5).as_secs_f64() * 1e3,
                stats.heartbeat_latency.quantile(0.99).as_secs_f64() * 1e3,
                stats.assignment_messages.load(Ordering::Relaxed),
            );
            if failures > 0 {
                let last = stats.last_failure.lock().expect("failure lock").clone();
                warn!("{line}; last failure: {}", last.unwrap_or_default());
            } else {
                info!("{line}");
            }
            if registered == count && !announced {
                let ramp = Duration::from_micros(stats.ramp_up_micros.load(Ordering::Relaxed));
                info!(
                    "all {count} nodes registered after {:.1} s",
                    ramp.as_secs_f64()
                );
                announced = true;
            }
        }
    }

    fn summary(&self, gpus_per_node: usize) -> FleetSummary {
        let stats = &self.stats;
        let relaxed = Ordering::Relaxed;
        let ramp_micros = stats.ramp_up_micros.load(relaxed);
        FleetSummary {
            nodes: self.config.count,
            gpus_per_node,
            registered: stats.registered.load(relaxed),
            ramp_up_seconds: stats.steady.load(relaxed).then(|| ramp_micros as f64 / 1e6),
            elapsed_seconds: self.started.elapsed().as_secs_f64(),
            registrations: stats.registrations.load(relaxed),
            registration_failures: stats.registration_failures.load(relaxed),
            heartbeats_sent: stats.heartbeats_sent.load(relaxed),
            heartbeat_failures: stats.heartbeat_failures.load(relaxed),
            heartbeats_unknown: stats.heartbeats_unknown.load(relaxed),
            reports_sent: stats.reports_sent.load(relaxed),
            reports_wanted: stats.reports_wanted.load(relaxed),
            assignment_messages: stats.assignment_messages.load(relaxed),
            watch_reconnects: stats.watch_reconnects.load(relaxed),
            tenants_assigned: stats.tenants_assigned.load(relaxed),
            heartbeat_latency: stats.heartbeat_latency.summary(),
            heartbeat_latency_steady: stats.heartbeat_latency_steady.summary(),
            register_latency: stats.register_latency.summary(),
            last_failure: stats.last_failure.lock().expect("failure lock").clone(),
        }
    }
}

/// The health report of a simulated node's GPUs: what an idle, healthy GPU reports (40 °C plus
/// its index, nothing in use, no XID or ECC errors), the same on every beat.
fn simulated_health(node: &api::v1::Node) -> Vec<GpuHealth> {
    node.gpus
        .iter()
        .map(|gpu| GpuHealth {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            ecc_corrected: Some(0),
            ecc_uncorrected: Some(0),
            temperature_celsius: Some(40 + gpu.index),
            utilization_percent: Some(0),
            memory_used_bytes: Some(0),
            ..GpuHealth::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_out_of_range_are_refused_with_the_flag_to_change() {
        let good = FleetConfig::new(vec!["127.0.0.1:1".into()], 10, "8xH100-80GB");
        good.validate().unwrap();
        type Change = fn(&mut FleetConfig);
        let cases: [(Change, &str); 5] = [
            (|c| c.count = 0, "--count"),
            (|c| c.count = FLEET_NODES_MAX + 1, "--count"),
            (
                |c| c.heartbeat_jitter_percent = 51,
                "--heartbeat-jitter-percent",
            ),
            (
                |c| c.registrations_in_flight = 0,
                "--registrations-in-flight",
            ),
            (|c| c.nodes_per_connection = 0, "--nodes-per-connection"),
        ];
        for (change, flag) in cases {
            let mut config = good.clone();
            change(&mut config);
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(flag), "{error}");
        }
        let mut bad_prefix = good.clone();
        bad_prefix.name_prefix = "Not A Name".into();
        assert!(bad_prefix.validate().is_err());
    }

    #[test]
    fn node_names_are_numbered_from_the_first_index() {
        let mut config = FleetConfig::new(vec![], 3, "8xH100-80GB");
        assert_eq!(config.node_name(0), "sim-00000");
        config.first_index = 1000;
        config.name_prefix = "rack-a".into();
        assert_eq!(config.node_name(2), "rack-a-01002");
    }
}
