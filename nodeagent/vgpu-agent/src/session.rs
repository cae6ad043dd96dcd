//! The node session: what a node says to the control plane and when, as a pure state machine.
//! `join` ([`crate::agent`]) and every simulated node of `simulate-fleet` ([`crate::fleet`])
//! drive one [`Session`] each, so the scale benchmark measures the protocol real nodes speak.
//!
//! A session has two lanes, each with its own address cursor and [`Backoff`]:
//!
//! * The heartbeat lane registers, then beats. Registration moves across the addresses with
//!   backoff until one accepts; only a refusal named by [`Refusals`] stops the session. Beats
//!   come at the interval the control plane gave ([`heartbeat_interval`] bounds it), jittered if
//!   [`SessionConfig::jitter`] says so, and carry the report [`ReportSender`] picks. A failed
//!   beat moves to the next address and retries sooner, with backoff, never later than the
//!   interval. A beat answered `known = false` registers again at once (an identical inventory
//!   keeps the node's tenants).
//! * The watch lane holds one assignment stream, opened where registration got through. When the
//!   stream ends it moves to the next address and opens again after a backoff; a stream that
//!   lived [`SessionConfig::retry_max`] or longer was healthy and resets the backoff, unless the
//!   shell could not apply its messages. A stream that says the node is not registered makes the
//!   heartbeat lane register again as soon as it is free (at once when it is waiting for a
//!   beat).
//!
//! The node's name is bound to the node's identity (issue 22, point 5): the shell sends the
//! node key ([`NODE_KEY_METADATA`]) with every call, each accepted registration has a number
//! ([`REGISTRATION_METADATA`] on the answer), and every beat says which registration it is for
//! ([`Action::Heartbeat::registration`]). When the control plane says the name is held by
//! another registration ([`NODE_NAME_TAKEN`], [`name_taken`]: another key registered it, or
//! another agent with this key registered it after this one), the session stops
//! ([`Stop::NameTaken`]) rather than act for a node that is no longer its own: two agents
//! running one node's tenants is the accident this prevents, and a takeover must not go
//! unnoticed. A node the control plane forgot (`known = false`, removed by an admin) is
//! registered again as before, under a new number.
//!
//! The shell feeds [`Event`]s to [`Session::handle`] and does what the returned [`Action`]s say:
//! it makes the calls, keeps one timer per [`Lane`] and reports every call's outcome back. Timers
//! that are no longer wanted are not cancelled; the session ignores a timer event that is not
//! due.
//!
//! **Architecture Invariant:** the session does no I/O and reads no clock: time comes in with
//! every event, randomness as a seed in the configuration, and everything it wants done goes out
//! as an [`Action`]. Its tests compare the exact `Vec<Action>` of one event.

use std::time::{Duration, Instant};

use api::ErrorCode;
use api::v1::HeartbeatRequest;

use crate::backoff::Backoff;
use crate::monitor::Report;
use crate::report::{ReportPolicy, ReportSender};

/// Used when the control plane hands out no heartbeat interval.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);
/// Bounds on the interval the control plane may hand out.
pub const HEARTBEAT_INTERVAL_MIN: Duration = Duration::from_millis(50);
pub const HEARTBEAT_INTERVAL_MAX: Duration = Duration::from_secs(60);
/// Shortest wait for a heartbeat's answer: a short interval must not make beats time out on a
/// merely busy control plane.
pub const HEARTBEAT_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// Largest heartbeat jitter, in percent of the interval.
pub const HEARTBEAT_JITTER_PERCENT_MAX: u32 = 50;

/// Request metadata of `Register`, `Heartbeat` and `WatchAssignments`: the node key, 64 hex
/// digits the agent drew once and keeps in its state directory ([`crate::state::NodeKey`]).
/// The control plane binds the node's name to the first key that registered it.
pub use api::metadata::NODE_KEY as NODE_KEY_METADATA;
/// Response metadata of `Register` (the number of this registration, decimal) and request
/// metadata of `Heartbeat` (the registration the beat is for). Absent or 0: a control plane
/// that does not number registrations.
pub use api::metadata::REGISTRATION as REGISTRATION_METADATA;
/// The error code (`[VGPU-NODE-NAME-TAKEN] ...` at the start of a status message) of a call for
/// a node whose name another registration holds.
pub const NODE_NAME_TAKEN: &str = ErrorCode::NodeNameTaken.as_str();

/// Whether `status` says the node's name is held by another registration.
pub fn name_taken(status: &tonic::Status) -> bool {
    ErrorCode::of(status) == Some(ErrorCode::NodeNameTaken)
}

/// What a session runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// The node's name, as its heartbeats carry it.
    pub node: String,
    /// How many control-plane addresses there are; the actions name them by index.
    pub addresses: usize,
    /// The address the first registration goes to.
    pub first_address: usize,
    /// The first delay of every backoff.
    pub retry_initial: Duration,
    /// The longest delay of every backoff, and how long a healthy stream lives at least.
    pub retry_max: Duration,
    /// The longest wait for a unary call; heartbeats wait within [`HEARTBEAT_TIMEOUT_MIN`] and
    /// this, as long as the interval allows.
    pub call_timeout: Duration,
    /// Whether the node holds an assignment stream.
    pub watch: bool,
    /// Which registration refusals stop the session.
    pub refusals: Refusals,
    /// Spread of the heartbeats; `None` beats exactly at the interval.
    pub jitter: Option<Jitter>,
    pub report_policy: ReportPolicy,
    /// The first report generation ([`ReportSender::new`]).
    pub first_generation: u64,
}

/// Which refusals of a registration stop the session. Anything else is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusals {
    /// Only `INVALID_ARGUMENT`: retrying the same inventory cannot succeed. `join` stops on
    /// this alone.
    InvalidInventory,
    /// Also `PERMISSION_DENIED` and `UNAUTHENTICATED`: the fleet's one certificate may not act
    /// for its nodes, and a thousand nodes retrying would hide that.
    InvalidInventoryOrCredentials,
}

impl Refusals {
    fn stops(self, code: tonic::Code) -> bool {
        use tonic::Code::{InvalidArgument, PermissionDenied, Unauthenticated};
        match self {
            Refusals::InvalidInventory => code == InvalidArgument,
            Refusals::InvalidInventoryOrCredentials => {
                matches!(code, InvalidArgument | PermissionDenied | Unauthenticated)
            }
        }
    }
}

/// Heartbeats `interval` give or take up to `percent`%, drawn from a SplitMix64 sequence seeded
/// with `seed`; the first beat after joining falls anywhere in the first interval. Nodes that
/// registered together then do not beat together, and the same seed gives the same schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter {
    pub percent: u32,
    pub seed: u64,
}

/// The two timers of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    /// The next beat, or the next registration attempt.
    Heartbeat,
    /// The next opening of the assignment stream.
    Watch,
}

/// Why the session registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterReason {
    /// The node joins: the session's first registration.
    Join,
    /// A heartbeat was answered `known = false`.
    Unknown,
    /// The assignment stream said the node is not registered.
    NotRegistered,
}

/// How a unary call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// No answer within the call's timeout.
    TimedOut,
    /// An error status from the control plane or the transport.
    Status { code: tonic::Code, message: String },
}

impl CallError {
    pub fn of(status: &tonic::Status) -> CallError {
        CallError::Status {
            code: status.code(),
            message: status.message().to_owned(),
        }
    }
}

/// Why an assignment stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchEnd {
    /// The control plane closed it.
    Closed,
    /// It failed to open, timed out opening, or broke.
    Failed,
    /// The control plane does not know the node.
    NotRegistered,
    /// The shell could not apply a message and dropped the stream.
    Unapplied,
}

impl WatchEnd {
    /// How a stream that failed with `status` ended.
    pub fn of(status: &tonic::Status) -> WatchEnd {
        if ErrorCode::of(status) == Some(ErrorCode::NodeNotFound)
            || status.code() == tonic::Code::NotFound
        {
            WatchEnd::NotRegistered
        } else {
            WatchEnd::Failed
        }
    }
}

/// What happened, for [`Session::handle`].
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// The node starts; sent once, first.
    Start,
    /// The heartbeat lane's timer fired; `latest` is the newest health and usage sample, for a
    /// beat that is due.
    HeartbeatTimer {
        latest: &'a Report,
    },
    /// The watch lane's timer fired.
    WatchTimer,
    RegisterAnswered {
        heartbeat_interval_ms: u32,
        /// The registration's number ([`REGISTRATION_METADATA`]); 0 when the control plane
        /// gave none.
        registration: u64,
    },
    RegisterFailed(CallError),
    HeartbeatAnswered {
        known: bool,
        report_wanted: bool,
    },
    /// The heartbeat timed out or failed.
    HeartbeatFailed,
    /// The assignment stream ended; the shell has dropped it.
    WatchEnded(WatchEnd),
    /// A registration, beat or stream was refused because another registration holds the node's
    /// name ([`name_taken`]); the shell has dropped the call or stream.
    NameTaken {
        message: String,
    },
    /// The node stops (SIGINT, SIGTERM).
    Shutdown,
}

/// What the shell is to do. A call's outcome comes back as an [`Event`].
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Call `Register` at the address with this index, within the call timeout. `attempt`
    /// counts from 1 in each round of registration.
    Register {
        address: usize,
        attempt: u64,
        reason: RegisterReason,
    },
    /// Call `Heartbeat` at the address with this index, waiting at most `timeout`, for
    /// registration number `registration` ([`REGISTRATION_METADATA`]).
    Heartbeat {
        address: usize,
        timeout: Duration,
        registration: u64,
        request: HeartbeatRequest,
    },
    /// Open the assignment stream at the address with this index, waiting at most the call
    /// timeout for it to open, and report its end.
    Watch { address: usize },
    /// Send the lane's timer event at `at`; this replaces the lane's earlier timer.
    WakeAt { lane: Lane, at: Instant },
    /// Stop the node: drop the calls in flight and drive the session no further.
    Stop(Stop),
}

/// Why a session stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// It was told to ([`Event::Shutdown`]).
    Shutdown,
    /// The control plane at the address with this index refused the registration for good.
    Refused { address: usize, message: String },
    /// Another registration holds the node's name ([`Event::NameTaken`]).
    NameTaken { message: String },
}

/// One node's session with the control plane.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    heartbeats: Heartbeats,
    /// Where registrations and heartbeats go.
    heartbeat_address: usize,
    interval: Duration,
    heartbeat_backoff: Backoff,
    reports: ReportSender,
    random: Option<SplitMix64>,
    watch: Watching,
    watch_address: usize,
    watch_backoff: Backoff,
    /// The stream said the node is not registered while the heartbeat lane was busy: register
    /// as soon as it is free.
    register_pending: bool,
    /// The number of the last accepted registration; 0 before one, or from a control plane
    /// that does not number them.
    registration: u64,
    stopped: bool,
    /// The time of the last event.
    now: Option<Instant>,
}

#[derive(Debug)]
enum Heartbeats {
    NotStarted,
    /// A registration call is in flight.
    Registering(Round),
    /// The last registration attempt failed; the next one is at `at`.
    RegisterRetry {
        round: Round,
        at: Instant,
    },
    /// Registered; the next beat is at `at`.
    Waiting {
        at: Instant,
    },
    /// A heartbeat call is in flight.
    Beating,
}

/// One round of registration: attempts until one address accepts.
#[derive(Debug)]
struct Round {
    reason: RegisterReason,
    attempt: u64,
    backoff: Backoff,
}

#[derive(Debug)]
enum Watching {
    /// Not registered yet, or the session does not watch.
    Off,
    /// The stream was asked for at `since`.
    Open { since: Instant },
    /// The stream ended; it opens again at `at`.
    Waiting { at: Instant },
}

impl Session {
    pub fn new(config: SessionConfig) -> Session {
        assert!(config.addresses >= 1, "a control plane to talk to");
        assert!(!config.call_timeout.is_zero(), "a call timeout");
        let backoff = Backoff::new(config.retry_initial, config.retry_max);
        let random = config.jitter.map(|jitter| {
            assert!(jitter.percent <= HEARTBEAT_JITTER_PERCENT_MAX);
            SplitMix64::new(jitter.seed)
        });
        Session {
            heartbeats: Heartbeats::NotStarted,
            heartbeat_address: config.first_address % config.addresses,
            interval: HEARTBEAT_INTERVAL_DEFAULT,
            heartbeat_backoff: backoff.clone(),
            reports: ReportSender::new(config.report_policy, config.first_generation),
            random,
            watch: Watching::Off,
            watch_address: 0,
            watch_backoff: backoff,
            register_pending: false,
            registration: 0,
            stopped: false,
            now: None,
            config,
        }
    }

    /// Takes in one event that happened at `now` and returns what to do about it, in order.
    pub fn handle(&mut self, now: Instant, event: Event<'_>) -> Vec<Action> {
        assert!(!self.stopped, "a stopped session is driven no further");
        if let Some(before) = self.now {
            assert!(now >= before, "time runs forward");
        }
        self.now = Some(now);
        let mut actions = Vec::new();
        match event {
            Event::Start => {
                assert!(
                    matches!(self.heartbeats, Heartbeats::NotStarted),
                    "one start"
                );
                self.register(RegisterReason::Join, &mut actions);
            }
            Event::HeartbeatTimer { latest } => self.heartbeat_timer(now, latest, &mut actions),
            Event::WatchTimer => self.watch_timer(now, &mut actions),
            Event::RegisterAnswered {
                heartbeat_interval_ms,
                registration,
            } => self.registered(now, heartbeat_interval_ms, registration, &mut actions),
            Event::RegisterFailed(error) => self.register_failed(now, error, &mut actions),
            Event::HeartbeatAnswered {
                known,
                report_wanted,
            } => self.heartbeat_answered(now, known, report_wanted, &mut actions),
            Event::HeartbeatFailed => self.heartbeat_failed(now, &mut actions),
            Event::WatchEnded(end) => self.watch_ended(now, end, &mut actions),
            Event::NameTaken { message } => {
                self.stopped = true;
                actions.push(Action::Stop(Stop::NameTaken { message }));
            }
            Event::Shutdown => {
                self.stopped = true;
                actions.push(Action::Stop(Stop::Shutdown));
            }
        }
        self.assert_valid();
        actions
    }

    /// Where the heartbeat lane calls next (registrations and beats).
    pub fn heartbeat_address(&self) -> usize {
        self.heartbeat_address
    }

    /// Where the watch lane opens the stream next.
    pub fn watch_address(&self) -> usize {
        self.watch_address
    }

    /// The number of the last accepted registration (0 before one).
    pub fn registration(&self) -> u64 {
        self.registration
    }

    /// The interval of the last registration ([`HEARTBEAT_INTERVAL_DEFAULT`] before one).
    pub fn heartbeat_interval(&self) -> Duration {
        self.interval
    }

    fn register(&mut self, reason: RegisterReason, actions: &mut Vec<Action>) {
        let round = Round {
            reason,
            attempt: 1,
            backoff: Backoff::new(self.config.retry_initial, self.config.retry_max),
        };
        self.attempt(round, actions);
    }

    fn attempt(&mut self, round: Round, actions: &mut Vec<Action>) {
        assert!(round.attempt >= 1);
        actions.push(Action::Register {
            address: self.heartbeat_address,
            attempt: round.attempt,
            reason: round.reason,
        });
        self.heartbeats = Heartbeats::Registering(round);
    }

    fn registered(
        &mut self,
        now: Instant,
        interval_ms: u32,
        registration: u64,
        actions: &mut Vec<Action>,
    ) {
        let Heartbeats::Registering(round) = self.take_heartbeats() else {
            panic!("a registration answered that was not made");
        };
        self.registration = registration;
        self.interval = heartbeat_interval(interval_ms);
        self.heartbeat_backoff.reset();
        // The control plane may hold no report of the node now: start over with a full one.
        self.reports.answered(false, false);
        let joined = round.reason == RegisterReason::Join;
        let delay = if joined {
            self.first_delay()
        } else {
            self.beat_delay()
        };
        self.rest(now, delay, actions);
        if joined && self.config.watch {
            assert!(matches!(self.watch, Watching::Off));
            // Start watching where registration got through: that address answers.
            self.watch_address = self.heartbeat_address;
            self.open_watch(now, actions);
        }
    }

    fn register_failed(&mut self, now: Instant, error: CallError, actions: &mut Vec<Action>) {
        let Heartbeats::Registering(mut round) = self.take_heartbeats() else {
            panic!("a registration failed that was not made");
        };
        if let CallError::Status { code, message } = error
            && self.config.refusals.stops(code)
        {
            self.stopped = true;
            actions.push(Action::Stop(Stop::Refused {
                address: self.heartbeat_address,
                message,
            }));
            return;
        }
        self.heartbeat_address = self.next_address(self.heartbeat_address);
        let at = now + round.backoff.next_delay();
        self.heartbeats = Heartbeats::RegisterRetry { round, at };
        actions.push(Action::WakeAt {
            lane: Lane::Heartbeat,
            at,
        });
    }

    fn heartbeat_timer(&mut self, now: Instant, latest: &Report, actions: &mut Vec<Action>) {
        match self.heartbeats {
            Heartbeats::RegisterRetry { at, .. } if at <= now => {
                let Heartbeats::RegisterRetry { mut round, .. } = self.take_heartbeats() else {
                    unreachable!("matched above");
                };
                round.attempt += 1;
                self.attempt(round, actions);
            }
            Heartbeats::Waiting { at } if at <= now => {
                let request = self.reports.beat(&self.config.node, latest);
                self.heartbeats = Heartbeats::Beating;
                actions.push(Action::Heartbeat {
                    address: self.heartbeat_address,
                    timeout: self.heartbeat_timeout(),
                    registration: self.registration,
                    request,
                });
            }
            // A timer that is no longer wanted, or early.
            _ => {}
        }
    }

    fn heartbeat_answered(
        &mut self,
        now: Instant,
        known: bool,
        report_wanted: bool,
        actions: &mut Vec<Action>,
    ) {
        assert!(
            matches!(self.take_heartbeats(), Heartbeats::Beating),
            "a heartbeat answered that was not sent"
        );
        self.reports.answered(known, report_wanted);
        if known {
            self.heartbeat_backoff.reset();
            let delay = self.beat_delay();
            self.rest(now, delay, actions);
        } else {
            self.register(RegisterReason::Unknown, actions);
        }
    }

    fn heartbeat_failed(&mut self, now: Instant, actions: &mut Vec<Action>) {
        assert!(
            matches!(self.take_heartbeats(), Heartbeats::Beating),
            "a heartbeat failed that was not sent"
        );
        self.reports.failed();
        self.heartbeat_address = self.next_address(self.heartbeat_address);
        let delay = self.heartbeat_backoff.next_delay().min(self.interval);
        self.rest(now, delay, actions);
    }

    /// The heartbeat lane is free: beat after `delay`, or register now if the stream asked for
    /// it meanwhile.
    fn rest(&mut self, now: Instant, delay: Duration, actions: &mut Vec<Action>) {
        assert!(matches!(self.heartbeats, Heartbeats::NotStarted));
        if std::mem::take(&mut self.register_pending) {
            self.register(RegisterReason::NotRegistered, actions);
            return;
        }
        let at = now + delay;
        self.heartbeats = Heartbeats::Waiting { at };
        actions.push(Action::WakeAt {
            lane: Lane::Heartbeat,
            at,
        });
    }

    fn watch_timer(&mut self, now: Instant, actions: &mut Vec<Action>) {
        if let Watching::Waiting { at } = self.watch
            && at <= now
        {
            self.open_watch(now, actions);
        }
    }

    fn open_watch(&mut self, now: Instant, actions: &mut Vec<Action>) {
        assert!(self.config.watch);
        self.watch = Watching::Open { since: now };
        actions.push(Action::Watch {
            address: self.watch_address,
        });
    }

    fn watch_ended(&mut self, now: Instant, end: WatchEnd, actions: &mut Vec<Action>) {
        let Watching::Open { since } = self.watch else {
            panic!("a stream ended that was not open");
        };
        // A stream that lived a while was healthy: reconnect quickly. One that failed at once
        // keeps backing off, so a broken control-plane node is not hammered.
        if now.duration_since(since) >= self.config.retry_max && end != WatchEnd::Unapplied {
            self.watch_backoff.reset();
        }
        self.watch_address = self.next_address(self.watch_address);
        let at = now + self.watch_backoff.next_delay();
        self.watch = Watching::Waiting { at };
        actions.push(Action::WakeAt {
            lane: Lane::Watch,
            at,
        });
        if end == WatchEnd::NotRegistered {
            if matches!(self.heartbeats, Heartbeats::Waiting { .. }) {
                self.heartbeats = Heartbeats::NotStarted;
                self.register(RegisterReason::NotRegistered, actions);
            } else {
                self.register_pending = true;
            }
        }
    }

    fn take_heartbeats(&mut self) -> Heartbeats {
        std::mem::replace(&mut self.heartbeats, Heartbeats::NotStarted)
    }

    fn next_address(&self, address: usize) -> usize {
        (address + 1) % self.config.addresses
    }

    fn heartbeat_timeout(&self) -> Duration {
        let longest = self.config.call_timeout.max(HEARTBEAT_TIMEOUT_MIN);
        self.interval.clamp(HEARTBEAT_TIMEOUT_MIN, longest)
    }

    /// The wait before the first beat after joining.
    fn first_delay(&mut self) -> Duration {
        match &mut self.random {
            Some(random) => self.interval.mul_f64(random.unit()),
            None => self.interval,
        }
    }

    /// The wait between beats.
    fn beat_delay(&mut self) -> Duration {
        match (&mut self.random, self.config.jitter) {
            (Some(random), Some(jitter)) => jittered(self.interval, jitter.percent, random),
            _ => self.interval,
        }
    }

    fn assert_valid(&self) {
        assert!(self.heartbeat_address < self.config.addresses);
        assert!(self.watch_address < self.config.addresses);
        assert!(
            (HEARTBEAT_INTERVAL_MIN..=HEARTBEAT_INTERVAL_MAX).contains(&self.interval),
            "the interval is bounded"
        );
        if self.stopped {
            return;
        }
        if self.register_pending {
            assert!(
                matches!(
                    self.heartbeats,
                    Heartbeats::Registering(_)
                        | Heartbeats::RegisterRetry { .. }
                        | Heartbeats::Beating
                ),
                "a pending registration waits only for a busy heartbeat lane"
            );
        }
        if !matches!(self.watch, Watching::Off) {
            assert!(self.config.watch, "a stream only when watching");
            assert!(
                !matches!(self.heartbeats, Heartbeats::NotStarted),
                "a stream only after joining"
            );
        }
    }
}

/// The interval to heartbeat at, from the control plane's answer, within
/// [`HEARTBEAT_INTERVAL_MIN`] and [`HEARTBEAT_INTERVAL_MAX`].
pub fn heartbeat_interval(interval_ms: u32) -> Duration {
    if interval_ms == 0 {
        return HEARTBEAT_INTERVAL_DEFAULT;
    }
    Duration::from_millis(u64::from(interval_ms))
        .clamp(HEARTBEAT_INTERVAL_MIN, HEARTBEAT_INTERVAL_MAX)
}

/// `interval` give or take up to `percent`%, uniformly.
fn jittered(interval: Duration, percent: u32, random: &mut SplitMix64) -> Duration {
    assert!(percent <= HEARTBEAT_JITTER_PERCENT_MAX);
    let spread = f64::from(percent) / 100.0;
    let factor = 1.0 + spread * (2.0 * random.unit() - 1.0);
    assert!((0.5..=1.5).contains(&factor));
    interval.mul_f64(factor)
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a tiny, seedable generator, good enough for
/// spreading timers.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
#[path = "session_test.rs"]
mod tests;
