//! The `join` runtime: register the node, then heartbeat and follow assignments at the same time
//! until shutdown.
//!
//! * Registration retries across the control-plane addresses with backoff until one accepts the
//!   node. Only a refusal of the inventory itself (`INVALID_ARGUMENT`) stops the agent: retrying
//!   the same inventory cannot succeed.
//! * The heartbeat loop beats at the interval the control plane gave; a beat carries the health
//!   and usage report only when it changed, as a refresh, or when the leader asks for it
//!   ([`ReportSender`]). When the control plane answers `known = false`, or the assignment
//!   stream says the node is not registered, it registers again (an identical inventory keeps
//!   the node's tenants). Failed beats move to the next address and retry sooner, with backoff,
//!   never later than the interval.
//! * The watch loop holds one `WatchAssignments` stream; when it ends or fails it moves to the
//!   next address and calls again after a backoff. Each message goes to the [`Follower`].
//!
//! Bounds: every wait is a [`Backoff`] (100 ms doubling to 2 s by default) or the heartbeat
//! interval, every call has a timeout, and nothing is queued. The loops have no attempt limit on
//! purpose: an agent's job is to stay joined through control-plane outages, and shutdown (SIGINT,
//! SIGTERM) ends them at any point. State writes are synchronous, so cancelling a loop never
//! leaves a half-written file.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use api::ErrorCode;
use api::v1::{RegisterRequest, WatchAssignmentsRequest};
use tokio::sync::Notify;
use tokio::time::{Instant, sleep, timeout};
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::cdi::{CdiConfig, CdiWriter};
use crate::endpoints::Endpoints;
use crate::error::{Error, Result};
use crate::follower::Follower;
use crate::inventory::InventorySource;
use crate::monitor::{Monitor, MonitorConfig};
use crate::report::{ReportPolicy, ReportSender};
use crate::state::StateDir;

/// Used when the control plane hands out no heartbeat interval.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// Bounds on the interval the control plane may hand out.
pub const HEARTBEAT_INTERVAL_MIN: Duration = Duration::from_millis(50);
pub const HEARTBEAT_INTERVAL_MAX: Duration = Duration::from_secs(60);
/// How often GPU health and tenant usage are sampled for the heartbeats ([`crate::monitor`]).
pub const MONITOR_INTERVAL: Duration = Duration::from_secs(1);

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
    /// Plain text, certificates, or a bootstrap token.
    pub security: crate::bootstrap::Security,
    /// Concurrent sharing: the node's MPS daemon ([`crate::mps`]); `None`: time slicing only.
    pub mps: Option<crate::mps::MpsConfig>,
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

/// Joins the pool and follows assignments until `shutdown` completes (then returns `Ok`), or
/// until something that retrying cannot fix happens.
pub async fn join(config: JoinConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    // First, so that an agent without credentials stops before it touches anything.
    let transport =
        crate::bootstrap::transport(&config.security, &config.name, &config.control_plane).await?;
    let inventory = config.source.discover(&config.name)?;
    let state = StateDir::open(&config.state_dir, &config.name)?;
    let mut follower = Follower::restore(state.clone(), &config.name)?;
    state.write_inventory(&inventory)?;
    state.write_shm_dir(&config.shm_dir)?;
    follower = follower.with_private(crate::private::Layout::new(&config.shm_dir));
    if let Some(mps) = &config.mps {
        // Before any tenant can be started here: their environment names the daemon's pipes.
        crate::mps::ensure_running(mps)?;
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
    let agent = Agent {
        node: inventory.to_proto(&config.address, &config.labels),
        endpoints,
        timings: config.timings,
        reregister: Notify::new(),
        monitor,
    };
    let shaper = tokio::spawn(crate::bandwidth::run(
        config.state_dir.clone(),
        config.shm_dir.clone(),
        config.nic_bytes_per_second,
    ));
    let result = tokio::select! {
        result = agent.run(follower) => result,
        () = shutdown => {
            info!("shutting down");
            Ok(())
        }
    };
    shaper.abort();
    result
}

struct Agent {
    node: api::v1::Node,
    endpoints: Endpoints,
    timings: Timings,
    /// Raised by the watch loop when the control plane does not know the node.
    reregister: Notify,
    /// GPU health and tenant usage for the heartbeats.
    monitor: Monitor,
}

/// Why an assignment stream ended.
enum StreamEnd {
    Closed,
    OpenTimedOut,
    NotRegistered(tonic::Status),
    Failed(tonic::Status),
    Persist(Error),
}

impl Agent {
    async fn run(&self, follower: Follower) -> Result<()> {
        let mut cursor = 0;
        let interval = self.register(&mut cursor).await?;
        let outcome = tokio::select! {
            outcome = self.heartbeat_loop(cursor, interval) => outcome,
            // Start watching where registration got through: that address answers.
            outcome = self.watch_loop(cursor, follower) => outcome,
        };
        match outcome {
            Ok(never) => match never {},
            Err(error) => Err(error),
        }
    }

    fn name(&self) -> &str {
        &self.node.name
    }

    /// Registers, moving across addresses with backoff until one accepts. Returns the heartbeat
    /// interval.
    async fn register(&self, cursor: &mut usize) -> Result<Duration> {
        let gpus = self.node.gpus.len();
        let mut backoff = Backoff::new(self.timings.retry_initial, self.timings.retry_max);
        let mut attempt: u64 = 0;
        loop {
            attempt += 1;
            let address = self.endpoints.address(*cursor).to_owned();
            info!(
                "registering node {} with {gpus} GPUs at {address} (attempt {attempt})",
                self.name()
            );
            let request = RegisterRequest {
                node: Some(self.node.clone()),
            };
            let mut client = self.endpoints.client(*cursor);
            match timeout(self.timings.call_timeout, client.register(request)).await {
                Ok(Ok(response)) => {
                    let interval = heartbeat_interval(response.get_ref().heartbeat_interval_ms);
                    info!(
                        "registered node {} with {gpus} GPUs via {address}; heartbeat every {} ms",
                        self.name(),
                        interval.as_millis()
                    );
                    return Ok(interval);
                }
                Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    return Err(Error::RegisterRefused {
                        address,
                        message: status.message().to_owned(),
                    });
                }
                Ok(Err(status)) => warn!("registering at {address} failed: {}", describe(&status)),
                Err(_) => warn!(
                    "registering at {address} timed out after {} ms",
                    self.timings.call_timeout.as_millis()
                ),
            }
            *cursor = self.endpoints.next(*cursor);
            sleep(backoff.next_delay()).await;
        }
    }

    async fn heartbeat_loop(
        &self,
        mut cursor: usize,
        mut interval: Duration,
    ) -> Result<Infallible> {
        let mut backoff = Backoff::new(self.timings.retry_initial, self.timings.retry_max);
        let mut failures: u64 = 0;
        let mut delay = interval;
        let mut reports = ReportSender::new(
            ReportPolicy::default(),
            ReportSender::first_generation_now(),
        );
        loop {
            let reregister = tokio::select! {
                () = sleep(delay) => false,
                () = self.reregister.notified() => true,
            };
            if reregister {
                info!(
                    "the control plane does not know node {}; registering again",
                    self.name()
                );
                interval = self.register(&mut cursor).await?;
                (delay, failures) = (interval, 0);
                backoff.reset();
                reports.answered(false, false);
                continue;
            }
            let address = self.endpoints.address(cursor).to_owned();
            let request = reports.beat(self.name(), &self.monitor.latest());
            let mut client = self.endpoints.client(cursor);
            let call_timeout = interval.clamp(
                Duration::from_secs(1),
                self.timings.call_timeout.max(Duration::from_secs(1)),
            );
            let problem = match timeout(call_timeout, client.heartbeat(request)).await {
                Ok(Ok(response)) if response.get_ref().known => {
                    reports.answered(true, response.get_ref().report_wanted);
                    if failures > 0 {
                        info!(
                            "heartbeats reach the control plane again via {address} after {failures} failures"
                        );
                    }
                    debug!("heartbeat via {address}");
                    (delay, failures) = (interval, 0);
                    backoff.reset();
                    continue;
                }
                Ok(Ok(_)) => {
                    reports.answered(false, false);
                    warn!(
                        "the control plane at {address} does not know node {}; registering again",
                        self.name()
                    );
                    interval = self.register(&mut cursor).await?;
                    (delay, failures) = (interval, 0);
                    backoff.reset();
                    continue;
                }
                Ok(Err(status)) => describe(&status),
                Err(_) => format!("timed out after {} ms", call_timeout.as_millis()),
            };
            reports.failed();
            failures += 1;
            cursor = self.endpoints.next(cursor);
            delay = backoff.next_delay().min(interval);
            // The first failure and then ever more rarely, so an outage does not flood the log.
            if failures.is_power_of_two() || failures.is_multiple_of(64) {
                warn!(
                    "heartbeat via {address} failed ({failures} in a row): {problem}; next via {} in {} ms",
                    self.endpoints.address(cursor),
                    delay.as_millis()
                );
            }
        }
    }

    async fn watch_loop(&self, mut cursor: usize, mut follower: Follower) -> Result<Infallible> {
        let mut backoff = Backoff::new(self.timings.retry_initial, self.timings.retry_max);
        loop {
            let address = self.endpoints.address(cursor).to_owned();
            let opened = Instant::now();
            let end = self.watch_once(cursor, &mut follower).await;
            // A stream that lived a while was healthy: reconnect quickly. One that failed at
            // once keeps backing off, so a broken control-plane node is not hammered.
            if opened.elapsed() >= self.timings.retry_max && !matches!(end, StreamEnd::Persist(_)) {
                backoff.reset();
            }
            cursor = self.endpoints.next(cursor);
            let delay = backoff.next_delay();
            let next = self.endpoints.address(cursor);
            let retry = format!("watching again via {next} in {} ms", delay.as_millis());
            match end {
                StreamEnd::Closed => info!("the assignment stream from {address} ended; {retry}"),
                StreamEnd::OpenTimedOut => warn!(
                    "opening the assignment stream at {address} timed out after {} ms; {retry}",
                    self.timings.call_timeout.as_millis()
                ),
                StreamEnd::NotRegistered(status) => {
                    warn!(
                        "the assignment stream from {address} says: {}; {retry}",
                        describe(&status)
                    );
                    self.reregister.notify_one();
                }
                StreamEnd::Failed(status) => {
                    warn!(
                        "the assignment stream from {address} failed: {}; {retry}",
                        describe(&status)
                    )
                }
                StreamEnd::Persist(problem) => {
                    error!("cannot apply the assignments: {problem}; {retry}")
                }
            }
            sleep(delay).await;
        }
    }

    async fn watch_once(&self, cursor: usize, follower: &mut Follower) -> StreamEnd {
        let address = self.endpoints.address(cursor);
        let request = WatchAssignmentsRequest {
            node: self.name().to_owned(),
        };
        let mut client = self.endpoints.client(cursor);
        let mut stream =
            match timeout(self.timings.call_timeout, client.watch_assignments(request)).await {
                Err(_) => return StreamEnd::OpenTimedOut,
                Ok(Err(status)) => return classify(status),
                Ok(Ok(response)) => response.into_inner(),
            };
        debug!("watching assignments via {address}");
        loop {
            match stream.message().await {
                Ok(Some(message)) => {
                    if let Err(problem) = follower.on_message(&message, address) {
                        return StreamEnd::Persist(problem);
                    }
                }
                Ok(None) => return StreamEnd::Closed,
                Err(status) => return classify(status),
            }
        }
    }
}

fn classify(status: tonic::Status) -> StreamEnd {
    if ErrorCode::of(&status) == Some(ErrorCode::NodeNotFound)
        || status.code() == tonic::Code::NotFound
    {
        StreamEnd::NotRegistered(status)
    } else {
        StreamEnd::Failed(status)
    }
}

/// The interval to heartbeat at, from the control plane's answer, within sane bounds.
fn heartbeat_interval(interval_ms: u32) -> Duration {
    if interval_ms == 0 {
        return HEARTBEAT_INTERVAL_DEFAULT;
    }
    Duration::from_millis(u64::from(interval_ms))
        .clamp(HEARTBEAT_INTERVAL_MIN, HEARTBEAT_INTERVAL_MAX)
}

/// A status for a log line: its message, or its code when the message is empty.
fn describe(status: &tonic::Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {}", status.code(), status.message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heartbeat_interval_is_bounded() {
        assert_eq!(heartbeat_interval(0), HEARTBEAT_INTERVAL_DEFAULT);
        assert_eq!(heartbeat_interval(1), HEARTBEAT_INTERVAL_MIN);
        assert_eq!(heartbeat_interval(250), Duration::from_millis(250));
        assert_eq!(heartbeat_interval(u32::MAX), HEARTBEAT_INTERVAL_MAX);
    }

    #[test]
    fn a_stream_that_does_not_know_the_node_asks_for_registration() {
        let not_found = ErrorCode::NodeNotFound.status("node `a` is not registered");
        assert!(matches!(classify(not_found), StreamEnd::NotRegistered(_)));
        assert!(matches!(
            classify(tonic::Status::unavailable("down")),
            StreamEnd::Failed(_)
        ));
    }
}
