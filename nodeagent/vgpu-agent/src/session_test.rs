//! Scenario tests of the node session: one event in, the exact actions out.

use api::v1::ReportKind;
use tonic::Code;

use super::*;

const INTERVAL_MS: u32 = 1000;
/// The number the control plane gives every registration in these tests.
const REGISTRATION: u64 = 41;

/// A session of `node-a` against three addresses, as `join` configures it (100 ms doubling to
/// 2 s, 5 s calls, watching, no jitter).
fn config() -> SessionConfig {
    SessionConfig {
        node: "node-a".to_owned(),
        addresses: 3,
        first_address: 0,
        retry_initial: Duration::from_millis(100),
        retry_max: Duration::from_secs(2),
        call_timeout: Duration::from_secs(5),
        watch: true,
        refusals: Refusals::InvalidInventory,
        jitter: None,
        report_policy: ReportPolicy::default(),
        first_generation: 100,
    }
}

/// Times as milliseconds after a fixed start.
struct Clock(Instant);

impl Clock {
    fn new() -> Clock {
        Clock(Instant::now())
    }

    fn at(&self, ms: u64) -> Instant {
        self.0 + Duration::from_millis(ms)
    }
}

fn report() -> Report {
    Report {
        gpus: vec![api::usage::empty_health("GPU-0", 0)],
        usage: Vec::new(),
    }
}

fn register(address: usize, attempt: u64, reason: RegisterReason) -> Action {
    Action::Register {
        address,
        attempt,
        reason,
    }
}

fn wake(lane: Lane, at: Instant) -> Action {
    Action::WakeAt { lane, at }
}

/// A heartbeat to `address` with the full report as generation `generation`.
fn full_beat(address: usize, generation: u64) -> Action {
    let report = report();
    Action::Heartbeat {
        address,
        timeout: Duration::from_secs(1),
        registration: REGISTRATION,
        request: HeartbeatRequest {
            node: "node-a".to_owned(),
            report: ReportKind::Full as i32,
            gpus: report.gpus,
            usage: report.usage,
            report_generation: generation,
        },
    }
}

/// A heartbeat to `address` that names the acknowledged report `generation`.
fn unchanged_beat(address: usize, generation: u64) -> Action {
    Action::Heartbeat {
        address,
        timeout: Duration::from_secs(1),
        registration: REGISTRATION,
        request: HeartbeatRequest {
            node: "node-a".to_owned(),
            report: ReportKind::Unchanged as i32,
            report_generation: generation,
            ..HeartbeatRequest::default()
        },
    }
}

fn unavailable() -> Event<'static> {
    Event::RegisterFailed(CallError::Status {
        code: Code::Unavailable,
        message: "connection refused".to_owned(),
    })
}

fn answered(ms: u32) -> Event<'static> {
    Event::RegisterAnswered {
        heartbeat_interval_ms: ms,
        registration: REGISTRATION,
    }
}

fn known() -> Event<'static> {
    Event::HeartbeatAnswered {
        known: true,
        report_wanted: false,
    }
}

/// A session that registered at address 0 at 0 ms (next beat at 1000 ms, stream open at 0).
fn joined(clock: &Clock) -> Session {
    let mut session = Session::new(config());
    assert_eq!(
        session.handle(clock.at(0), Event::Start),
        vec![register(0, 1, RegisterReason::Join)]
    );
    assert_eq!(
        session.handle(clock.at(0), answered(INTERVAL_MS)),
        vec![
            wake(Lane::Heartbeat, clock.at(1000)),
            Action::Watch { address: 0 }
        ]
    );
    session
}

#[test]
fn the_first_registration_goes_to_the_first_address() {
    let clock = Clock::new();
    let mut session = Session::new(SessionConfig {
        first_address: 2,
        ..config()
    });
    assert_eq!(
        session.handle(clock.at(0), Event::Start),
        vec![register(2, 1, RegisterReason::Join)]
    );
    // Registered: beat after one interval, and watch where registration got through.
    assert_eq!(
        session.handle(clock.at(30), answered(INTERVAL_MS)),
        vec![
            wake(Lane::Heartbeat, clock.at(1030)),
            Action::Watch { address: 2 }
        ]
    );
    assert_eq!(session.heartbeat_interval(), Duration::from_secs(1));
    let latest = report();
    assert_eq!(
        session.handle(clock.at(1030), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(2, 100)]
    );
    assert_eq!(
        session.handle(clock.at(1040), known()),
        vec![wake(Lane::Heartbeat, clock.at(2040))]
    );
    // The report is acknowledged: the next beat names it.
    assert_eq!(
        session.handle(clock.at(2040), Event::HeartbeatTimer { latest: &latest }),
        vec![unchanged_beat(2, 100)]
    );
}

#[test]
fn a_failed_registration_moves_to_the_next_address_and_backs_off() {
    let clock = Clock::new();
    let mut session = Session::new(config());
    let latest = report();
    session.handle(clock.at(0), Event::Start);
    assert_eq!(
        session.handle(clock.at(10), unavailable()),
        vec![wake(Lane::Heartbeat, clock.at(110))]
    );
    // Early: nothing yet.
    assert_eq!(
        session.handle(clock.at(50), Event::HeartbeatTimer { latest: &latest }),
        vec![]
    );
    assert_eq!(
        session.handle(clock.at(110), Event::HeartbeatTimer { latest: &latest }),
        vec![register(1, 2, RegisterReason::Join)]
    );
    assert_eq!(
        session.handle(clock.at(5110), Event::RegisterFailed(CallError::TimedOut)),
        vec![wake(Lane::Heartbeat, clock.at(5310))],
        "twice as long"
    );
    assert_eq!(
        session.handle(clock.at(5310), Event::HeartbeatTimer { latest: &latest }),
        vec![register(2, 3, RegisterReason::Join)]
    );
    // A refusal that is not about the inventory is retried too, round the addresses.
    let denied = Event::RegisterFailed(CallError::Status {
        code: Code::PermissionDenied,
        message: "not yet".to_owned(),
    });
    assert_eq!(
        session.handle(clock.at(5320), denied),
        vec![wake(Lane::Heartbeat, clock.at(5720))]
    );
    assert_eq!(
        session.handle(clock.at(5720), Event::HeartbeatTimer { latest: &latest }),
        vec![register(0, 4, RegisterReason::Join)]
    );
    assert_eq!(
        session.handle(clock.at(5730), answered(INTERVAL_MS)),
        vec![
            wake(Lane::Heartbeat, clock.at(6730)),
            Action::Watch { address: 0 }
        ]
    );
}

#[test]
fn a_refused_inventory_stops_the_session() {
    let clock = Clock::new();
    let mut session = Session::new(config());
    session.handle(clock.at(0), Event::Start);
    session.handle(clock.at(10), unavailable());
    let latest = report();
    session.handle(clock.at(110), Event::HeartbeatTimer { latest: &latest });
    let invalid = Event::RegisterFailed(CallError::Status {
        code: Code::InvalidArgument,
        message: "node `node-a` reports GPU index 0 twice".to_owned(),
    });
    assert_eq!(
        session.handle(clock.at(120), invalid),
        vec![Action::Stop(Stop::Refused {
            address: 1,
            message: "node `node-a` reports GPU index 0 twice".to_owned(),
        })]
    );
}

#[test]
fn the_fleet_also_stops_on_refused_credentials() {
    let clock = Clock::new();
    let mut session = Session::new(SessionConfig {
        refusals: Refusals::InvalidInventoryOrCredentials,
        ..config()
    });
    session.handle(clock.at(0), Event::Start);
    let unauthenticated = Event::RegisterFailed(CallError::Status {
        code: Code::Unauthenticated,
        message: "no certificate".to_owned(),
    });
    assert_eq!(
        session.handle(clock.at(10), unauthenticated),
        vec![Action::Stop(Stop::Refused {
            address: 0,
            message: "no certificate".to_owned(),
        })]
    );
}

#[test]
fn the_heartbeat_interval_is_bounded() {
    assert_eq!(heartbeat_interval(0), HEARTBEAT_INTERVAL_DEFAULT);
    assert_eq!(heartbeat_interval(1), HEARTBEAT_INTERVAL_MIN);
    assert_eq!(heartbeat_interval(250), Duration::from_millis(250));
    assert_eq!(heartbeat_interval(u32::MAX), HEARTBEAT_INTERVAL_MAX);
}

#[test]
fn the_interval_handed_out_is_clamped_and_bounds_the_call_timeout() {
    let clock = Clock::new();
    let latest = report();
    let cases = [
        // (handed out, first beat after, heartbeat timeout)
        (0, 1000, 1000),
        (1, 50, 1000),
        (250, 250, 1000),
        (3000, 3000, 3000),
        (u32::MAX, 60_000, 5000),
    ];
    for (handed_out, beat_ms, timeout_ms) in cases {
        let mut session = Session::new(SessionConfig {
            watch: false,
            ..config()
        });
        session.handle(clock.at(0), Event::Start);
        assert_eq!(
            session.handle(clock.at(0), answered(handed_out)),
            vec![wake(Lane::Heartbeat, clock.at(beat_ms))],
            "{handed_out} ms handed out"
        );
        let actions = session.handle(clock.at(beat_ms), Event::HeartbeatTimer { latest: &latest });
        let [Action::Heartbeat { timeout, .. }] = actions.as_slice() else {
            panic!("one beat, not {actions:?}");
        };
        assert_eq!(
            *timeout,
            Duration::from_millis(timeout_ms),
            "{handed_out} ms"
        );
    }
}

#[test]
fn an_unknown_node_registers_again_and_sends_its_report_in_full() {
    let clock = Clock::new();
    let mut session = joined(&clock);
    let latest = report();
    session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest });
    session.handle(clock.at(1010), known());
    assert_eq!(
        session.handle(clock.at(2010), Event::HeartbeatTimer { latest: &latest }),
        vec![unchanged_beat(0, 100)]
    );
    let unknown = Event::HeartbeatAnswered {
        known: false,
        report_wanted: false,
    };
    assert_eq!(
        session.handle(clock.at(2020), unknown),
        vec![register(0, 1, RegisterReason::Unknown)],
        "at once, at the address that answered"
    );
    // Registered again: no second stream, and the next beat carries the report in full.
    assert_eq!(
        session.handle(clock.at(2030), answered(INTERVAL_MS)),
        vec![wake(Lane::Heartbeat, clock.at(3030))]
    );
    assert_eq!(
        session.handle(clock.at(3030), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(0, 101)]
    );
}

#[test]
fn a_failed_heartbeat_moves_on_and_retries_sooner_never_later_than_the_interval() {
    let clock = Clock::new();
    let mut session = Session::new(SessionConfig {
        watch: false,
        ..config()
    });
    let latest = report();
    session.handle(clock.at(0), Event::Start);
    session.handle(clock.at(0), answered(300));
    assert_eq!(
        session.handle(clock.at(300), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(0, 100)]
    );
    assert_eq!(
        session.handle(clock.at(1300), Event::HeartbeatFailed),
        vec![wake(Lane::Heartbeat, clock.at(1400))]
    );
    // Whether the report arrived is unknown: full again, as a new generation.
    assert_eq!(
        session.handle(clock.at(1400), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(1, 101)]
    );
    assert_eq!(
        session.handle(clock.at(2400), Event::HeartbeatFailed),
        vec![wake(Lane::Heartbeat, clock.at(2600))]
    );
    session.handle(clock.at(2600), Event::HeartbeatTimer { latest: &latest });
    assert_eq!(
        session.handle(clock.at(3600), Event::HeartbeatFailed),
        vec![wake(Lane::Heartbeat, clock.at(3900))],
        "400 ms of backoff capped at the 300 ms interval"
    );
    session.handle(clock.at(3900), Event::HeartbeatTimer { latest: &latest });
    assert_eq!(
        session.handle(clock.at(3910), known()),
        vec![wake(Lane::Heartbeat, clock.at(4210))]
    );
    session.handle(clock.at(4210), Event::HeartbeatTimer { latest: &latest });
    assert_eq!(
        session.handle(clock.at(5210), Event::HeartbeatFailed),
        vec![wake(Lane::Heartbeat, clock.at(5310))],
        "the backoff starts over after a success"
    );
    assert_eq!(session.heartbeat_address(), 1, "0, 1, 2, 0, then 1 again");
}

#[test]
fn an_ended_stream_reconnects_at_the_next_address_after_a_backoff() {
    let clock = Clock::new();
    let mut session = joined(&clock);
    assert_eq!(
        session.handle(clock.at(50), Event::WatchEnded(WatchEnd::Failed)),
        vec![wake(Lane::Watch, clock.at(150))]
    );
    assert_eq!(session.handle(clock.at(100), Event::WatchTimer), vec![]);
    assert_eq!(
        session.handle(clock.at(150), Event::WatchTimer),
        vec![Action::Watch { address: 1 }]
    );
    assert_eq!(
        session.handle(clock.at(160), Event::WatchEnded(WatchEnd::Closed)),
        vec![wake(Lane::Watch, clock.at(360))],
        "a stream that failed at once keeps backing off"
    );
    assert_eq!(
        session.handle(clock.at(360), Event::WatchTimer),
        vec![Action::Watch { address: 2 }]
    );
    // A stream that lived `retry_max` was healthy: reconnect quickly.
    assert_eq!(
        session.handle(clock.at(2360), Event::WatchEnded(WatchEnd::Closed)),
        vec![wake(Lane::Watch, clock.at(2460))]
    );
    session.handle(clock.at(2460), Event::WatchTimer);
    session.handle(clock.at(2470), Event::WatchEnded(WatchEnd::Closed));
    session.handle(clock.at(2670), Event::WatchTimer);
    // Unless its messages could not be applied.
    assert_eq!(
        session.handle(clock.at(9000), Event::WatchEnded(WatchEnd::Unapplied)),
        vec![wake(Lane::Watch, clock.at(9400))]
    );
}

#[test]
fn a_stream_that_does_not_know_the_node_registers_it_again() {
    let clock = Clock::new();
    let mut session = joined(&clock);
    // The heartbeat lane waits for its beat: register at once.
    assert_eq!(
        session.handle(clock.at(50), Event::WatchEnded(WatchEnd::NotRegistered)),
        vec![
            wake(Lane::Watch, clock.at(150)),
            register(0, 1, RegisterReason::NotRegistered),
        ]
    );
    // The beat's old timer is ignored while registering.
    let latest = report();
    assert_eq!(
        session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest }),
        vec![]
    );
    assert_eq!(
        session.handle(clock.at(1000), answered(INTERVAL_MS)),
        vec![wake(Lane::Heartbeat, clock.at(2000))]
    );
    assert_eq!(
        session.handle(clock.at(1000), Event::WatchTimer),
        vec![Action::Watch { address: 1 }]
    );
    // A beat is in flight: register once it is answered.
    assert_eq!(
        session.handle(clock.at(2000), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(0, 100)]
    );
    assert_eq!(
        session.handle(clock.at(2001), Event::WatchEnded(WatchEnd::NotRegistered)),
        vec![wake(Lane::Watch, clock.at(2201))]
    );
    assert_eq!(
        session.handle(clock.at(2010), known()),
        vec![register(0, 1, RegisterReason::NotRegistered)]
    );
}

#[test]
fn a_stream_refusal_during_registration_registers_once_more_afterwards() {
    let clock = Clock::new();
    let mut session = joined(&clock);
    let latest = report();
    session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest });
    let unknown = Event::HeartbeatAnswered {
        known: false,
        report_wanted: false,
    };
    session.handle(clock.at(1010), unknown);
    assert_eq!(
        session.handle(clock.at(1020), Event::WatchEnded(WatchEnd::NotRegistered)),
        vec![wake(Lane::Watch, clock.at(1120))]
    );
    // Which registration the stream's refusal came after is unknown: register again.
    assert_eq!(
        session.handle(clock.at(1030), answered(INTERVAL_MS)),
        vec![register(0, 1, RegisterReason::NotRegistered)]
    );
    assert_eq!(
        session.handle(clock.at(1040), answered(INTERVAL_MS)),
        vec![wake(Lane::Heartbeat, clock.at(2040))]
    );
}

#[test]
fn shutdown_stops_the_session_at_any_point() {
    let clock = Clock::new();
    let mut session = Session::new(config());
    session.handle(clock.at(0), Event::Start);
    assert_eq!(
        session.handle(clock.at(1), Event::Shutdown),
        vec![Action::Stop(Stop::Shutdown)]
    );
    let mut session = joined(&clock);
    assert_eq!(
        session.handle(clock.at(1), Event::Shutdown),
        vec![Action::Stop(Stop::Shutdown)]
    );
}

#[test]
fn a_session_that_does_not_watch_opens_no_stream() {
    let clock = Clock::new();
    let mut session = Session::new(SessionConfig {
        watch: false,
        ..config()
    });
    session.handle(clock.at(0), Event::Start);
    assert_eq!(
        session.handle(clock.at(0), answered(INTERVAL_MS)),
        vec![wake(Lane::Heartbeat, clock.at(1000))]
    );
}

#[test]
fn jittered_beats_spread_over_the_first_interval_and_repeat_with_the_seed() {
    let clock = Clock::new();
    let jittered_session = |seed| {
        Session::new(SessionConfig {
            watch: false,
            jitter: Some(Jitter { percent: 10, seed }),
            ..config()
        })
    };
    let first_beats = |seed| {
        let mut session = jittered_session(seed);
        session.handle(clock.at(0), Event::Start);
        session.handle(clock.at(0), answered(INTERVAL_MS))
    };
    let mut firsts = Vec::new();
    for seed in 0..100 {
        let actions = first_beats(seed);
        assert_eq!(
            actions,
            first_beats(seed),
            "the same seed, the same schedule"
        );
        let [Action::WakeAt { at, .. }] = actions.as_slice() else {
            panic!("one timer, not {actions:?}");
        };
        assert!(*at <= clock.at(1000));
        firsts.push(*at);
    }
    let early = firsts.iter().filter(|at| **at < clock.at(500)).count();
    assert!(
        (30..70).contains(&early),
        "{early} of 100 in the first half"
    );
    // Later beats: the interval, give or take 10%.
    let mut session = jittered_session(7);
    let latest = report();
    session.handle(clock.at(0), Event::Start);
    session.handle(clock.at(0), answered(INTERVAL_MS));
    session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest });
    let actions = session.handle(clock.at(1000), known());
    let [Action::WakeAt { at, .. }] = actions.as_slice() else {
        panic!("one timer, not {actions:?}");
    };
    assert!(
        (clock.at(1900)..=clock.at(2100)).contains(at),
        "{actions:?}"
    );
}

#[test]
fn jitter_stays_within_its_bounds_and_spreads() {
    let fleet_jitter = |random: &mut SplitMix64| jittered(Duration::from_secs(1), 10, random);
    let mut random = SplitMix64::new(7);
    let delays: Vec<Duration> = (0..1000).map(|_| fleet_jitter(&mut random)).collect();
    let (low, high) = (Duration::from_millis(900), Duration::from_millis(1100));
    assert!(delays.iter().all(|d| (low..=high).contains(d)));
    let below = delays
        .iter()
        .filter(|d| **d < Duration::from_secs(1))
        .count();
    assert!(
        (400..600).contains(&below),
        "{below} of 1000 below the mean"
    );
    // Same seed, same schedule.
    let mut again = SplitMix64::new(7);
    assert_eq!(fleet_jitter(&mut again), delays[0]);
}

#[test]
fn a_stream_that_does_not_know_the_node_asks_for_registration() {
    let not_found = ErrorCode::NodeNotFound.status("node `a` is not registered");
    assert_eq!(WatchEnd::of(&not_found), WatchEnd::NotRegistered);
    assert_eq!(
        WatchEnd::of(&tonic::Status::unavailable("down")),
        WatchEnd::Failed
    );
}

#[test]
fn beats_name_the_registration_they_are_for_and_a_new_one_replaces_it() {
    let clock = Clock::new();
    let mut session = joined(&clock);
    assert_eq!(session.registration(), REGISTRATION);
    let latest = report();
    assert_eq!(
        session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest }),
        vec![full_beat(0, 100)]
    );
    // Forgotten (an admin removed the node): registered again, under a new number.
    assert_eq!(
        session.handle(
            clock.at(1010),
            Event::HeartbeatAnswered {
                known: false,
                report_wanted: false
            }
        ),
        vec![register(0, 1, RegisterReason::Unknown)]
    );
    assert_eq!(
        session.handle(
            clock.at(1020),
            Event::RegisterAnswered {
                heartbeat_interval_ms: INTERVAL_MS,
                registration: 97,
            }
        ),
        vec![wake(Lane::Heartbeat, clock.at(2020))]
    );
    assert_eq!(session.registration(), 97);
    let actions = session.handle(clock.at(2020), Event::HeartbeatTimer { latest: &latest });
    let [Action::Heartbeat { registration, .. }] = actions.as_slice() else {
        panic!("one beat, not {actions:?}");
    };
    assert_eq!(*registration, 97);
}

#[test]
fn a_name_held_by_another_registration_stops_the_session_whatever_it_was_doing() {
    let clock = Clock::new();
    let taken = |message: &str| Event::NameTaken {
        message: message.to_owned(),
    };
    let stop = |message: &str| {
        vec![Action::Stop(Stop::NameTaken {
            message: message.to_owned(),
        })]
    };
    // The registration is refused.
    let mut session = Session::new(config());
    session.handle(clock.at(0), Event::Start);
    assert_eq!(session.handle(clock.at(5), taken("first")), stop("first"));
    // A beat in flight is refused.
    let mut session = joined(&clock);
    let latest = report();
    session.handle(clock.at(1000), Event::HeartbeatTimer { latest: &latest });
    assert_eq!(session.handle(clock.at(1005), taken("beat")), stop("beat"));
    // The stream is refused while the lane waits for the next beat.
    let mut session = joined(&clock);
    assert_eq!(
        session.handle(clock.at(10), taken("stream")),
        stop("stream")
    );
}

#[test]
fn a_name_taken_refusal_is_told_by_its_code() {
    let taken = tonic::Status::failed_precondition(format!(
        "[{NODE_NAME_TAKEN}] node `node-a` is registered with another node key"
    ));
    assert!(name_taken(&taken));
    for other in [
        tonic::Status::failed_precondition("node `node-a` is registered with another node key"),
        tonic::Status::failed_precondition(format!("[{NODE_NAME_TAKEN}-OTHER] x")),
        ErrorCode::NodeNotFound.status("node `a` is not registered"),
    ] {
        assert!(!name_taken(&other), "{other:?}");
    }
}
