//! Connections to the control plane and failover between its members.
//!
//! Every control-plane member answers every call (writes are forwarded to the leader server-side),
//! so the client only needs one live member. [`Endpoints::call`] starts at the member that answered
//! last, moves on to the next one when a member cannot be reached or says it cannot serve now, and
//! keeps going round, with a growing pause, until the call's time limit. A call whose outcome is
//! unknown (sent, then no answer) is retried only when it is idempotent: Place with the same
//! request returns the same tenant, reads change nothing, but Release must not be repeated blindly.
//! `[VGPU-NO-LEADER]` means the member wrote nothing, so every call may move on after it; a
//! `[VGPU-STORAGE]` failure is the member's own, so idempotent calls move on after it too.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use api::ErrorCode;
use api::v1::ClusterStatusRequest;
use api::v1::cluster_client::ClusterClient;
use tonic::transport::Channel;

/// How long to wait for a TCP/HTTP2 connection to one member.
pub const CONNECT_TIMEOUT_MS: u64 = 1000;
/// Upper bound on passes over all endpoints, whatever the time limit.
const ROUNDS_MAX: u32 = 64;
const RETRY_PAUSE_MIN_MS: u64 = 100;
const RETRY_PAUSE_MAX_MS: u64 = 1000;

/// Whether a call may be sent again after its outcome became unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Sending it twice has the same effect as once (reads, Place, Drain).
    Idempotent,
    /// Retried only when it certainly did not reach a member (Release, membership changes).
    AtMostOnce,
}

/// Why a call failed for good.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// A member answered with an error: the request was wrong or cannot be done now.
    #[error("{}", refusal_text(*.code, *.grpc, .message))]
    Refused {
        code: Option<ErrorCode>,
        grpc: tonic::Code,
        message: String,
    },
    /// No member answered in time.
    #[error(
        "none of the endpoints {endpoints} answered ({what}): {last}; is vgpu-cp running? Check the addresses given with --endpoints or VGPU_ENDPOINTS"
    )]
    Unreachable {
        endpoints: String,
        what: String,
        last: String,
    },
    /// The call was sent but no answer came back; it may or may not have taken effect.
    #[error(
        "{what} was sent to {endpoint} but no answer came back ({detail}); it may or may not have taken effect: {advice}"
    )]
    Ambiguous {
        endpoint: String,
        what: String,
        detail: String,
        advice: String,
    },
}

impl CallError {
    /// The stable code of a refusal, if the server gave one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            CallError::Refused { code, .. } => *code,
            _ => None,
        }
    }

    fn refused(status: &tonic::Status) -> CallError {
        let code = ErrorCode::of(status);
        let message = human_message(status.message()).to_owned();
        CallError::Refused {
            code,
            grpc: status.code(),
            message,
        }
    }
}

fn refusal_text(code: Option<ErrorCode>, grpc: tonic::Code, message: &str) -> String {
    match code {
        Some(code) => format!("{message} ({})", code.as_str()),
        None if grpc == tonic::Code::Unimplemented => format!(
            "the endpoint does not serve this call (`{grpc}`: {message}); check that --endpoints points at vgpu-cp and that it runs the same vgpu version"
        ),
        None if message.is_empty() => format!("the control plane answered `{grpc}`"),
        None => format!("the control plane answered `{grpc}`: {message}"),
    }
}

/// The part of a status message after its `[VGPU-CODE]` prefix.
pub fn human_message(message: &str) -> &str {
    match message
        .strip_prefix('[')
        .and_then(|rest| rest.split_once(']'))
    {
        Some((code, rest)) if code.starts_with("VGPU-") => rest.trim_start(),
        _ => message,
    }
}

/// What a failed attempt means for the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// A real answer: stop and report it.
    Final,
    /// The member did not take the call: try another one.
    NotDelivered,
    /// The call may have been carried out: only idempotent calls try another member.
    Unknown,
    /// The member's own storage or Raft core failed; other members may be fine. Idempotent calls
    /// try another member, others report the error as it is.
    MemberBroken,
}

fn classify(status: &tonic::Status) -> Failure {
    match ErrorCode::of(status) {
        // The server retried internally until it gave up finding a leader; nothing was written.
        Some(ErrorCode::NoLeader | ErrorCode::NotLeader) => Failure::NotDelivered,
        // The server says the outcome is unknown (e.g. the leader failed mid-request).
        Some(ErrorCode::Unavailable) => Failure::Unknown,
        Some(ErrorCode::Storage) => Failure::MemberBroken,
        Some(_) => Failure::Final,
        None => match status.code() {
            tonic::Code::Unavailable if is_connect_failure(status) => Failure::NotDelivered,
            tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Aborted => Failure::Unknown,
            _ => Failure::Final,
        },
    }
}

/// Whether a status without a vgpu code comes from failing to open the connection, which means
/// the request never left this process.
fn is_connect_failure(status: &tonic::Status) -> bool {
    let text = format!("{status:?}").to_ascii_lowercase();
    [
        "connecterror",
        "connect error",
        "connection refused",
        "connectionrefused",
        "dns error",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// Settings of [`Endpoints`].
#[derive(Debug, Clone)]
pub struct EndpointsConfig {
    /// Normalised `host:port` addresses, at least one.
    pub addresses: Vec<String>,
    /// Time limit of one call, retries included (each pass tries every endpoint at least once).
    pub call_timeout: Duration,
    pub connect_timeout: Duration,
    /// Plain text (`--insecure`) or mTLS.
    pub transport: api::tls::Transport,
}

/// The control-plane members this invocation may talk to, with one cached channel per member.
pub struct Endpoints {
    config: EndpointsConfig,
    channels: Mutex<Vec<Option<Channel>>>,
    /// Index of the member that answered last; calls start there.
    preferred: AtomicUsize,
    /// Whether any member answered a call yet (then `preferred` is known to be alive).
    answered: AtomicBool,
}

impl Endpoints {
    pub fn new(config: EndpointsConfig) -> Endpoints {
        assert!(!config.addresses.is_empty(), "at least one endpoint");
        assert!(
            config.call_timeout > Duration::ZERO,
            "a positive call timeout"
        );
        let channels = Mutex::new(vec![None; config.addresses.len()]);
        Endpoints {
            config,
            channels,
            preferred: AtomicUsize::new(0),
            answered: AtomicBool::new(false),
        }
    }

    /// The address that answered last (or the first one).
    pub fn preferred_address(&self) -> &str {
        &self.config.addresses[self.preferred.load(Ordering::Relaxed)]
    }

    /// Runs `attempt` against one member after another until one answers, as described in the
    /// module doc. `what` names the call in messages ("release of tenant infer-a"); `advice` says
    /// what to do when the outcome of an at-most-once call is unknown.
    ///
    /// Before an at-most-once call, when no member has answered yet, a cheap Cluster.Status
    /// finds a live member first: a stopped member still accepts TCP connections, and sending
    /// the call there would leave its outcome unknown.
    pub async fn call<T, F, Fut>(
        &self,
        what: &str,
        delivery: Delivery,
        advice: &str,
        attempt: F,
    ) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        if delivery == Delivery::AtMostOnce && !self.answered.load(Ordering::Relaxed) {
            self.find_live_member().await;
        }
        let budget = self.config.call_timeout;
        self.call_with_failover(what, delivery, advice, budget, attempt)
            .await
    }

    /// Points `preferred` at a member that answers, if one does within half the call timeout.
    async fn find_live_member(&self) {
        let budget = self.config.call_timeout / 2;
        let probe = self.call_with_failover(
            "a liveness check",
            Delivery::Idempotent,
            "",
            budget,
            |channel| async move {
                ClusterClient::new(channel)
                    .status(ClusterStatusRequest {})
                    .await
            },
        );
        if let Err(error) = probe.await {
            tracing::debug!(%error, "no member answered the liveness check; trying the call anyway");
        }
    }

    async fn call_with_failover<T, F, Fut>(
        &self,
        what: &str,
        delivery: Delivery,
        advice: &str,
        budget: Duration,
        mut attempt: F,
    ) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let started = Instant::now();
        let count = self.config.addresses.len();
        let mut pause = Duration::from_millis(RETRY_PAUSE_MIN_MS);
        let mut last_error = String::from("no attempt was made");
        // Each endpoint of the first pass gets at least this long, even when time ran out.
        let floor = self
            .config
            .connect_timeout
            .min(budget / u32::try_from(count).unwrap_or(u32::MAX));
        for round in 0..ROUNDS_MAX {
            let first = self.preferred.load(Ordering::Relaxed);
            for offset in 0..count {
                let index = (first + offset) % count;
                let address = &self.config.addresses[index];
                let channel = match self.channel(index).await {
                    Ok(channel) => channel,
                    Err(detail) => {
                        tracing::debug!(%address, %detail, "could not connect");
                        last_error = format!("{address}: {detail}");
                        continue;
                    }
                };
                let remaining = budget.saturating_sub(started.elapsed());
                let limit = attempt_limit(remaining, round, count - offset, delivery, floor);
                let (failure, detail) = match tokio::time::timeout(limit, attempt(channel)).await {
                    Ok(Ok(response)) => {
                        self.preferred.store(index, Ordering::Relaxed);
                        self.answered.store(true, Ordering::Relaxed);
                        return Ok(response.into_inner());
                    }
                    Ok(Err(status)) => match classify(&status) {
                        Failure::Final => return Err(CallError::refused(&status)),
                        Failure::MemberBroken if delivery == Delivery::AtMostOnce => {
                            return Err(CallError::refused(&status));
                        }
                        failure => (failure, status_text(&status)),
                    },
                    Err(_) => (Failure::Unknown, format!("no answer within {limit:?}")),
                };
                tracing::debug!(%address, ?failure, %detail, "attempt failed");
                match failure {
                    Failure::Final | Failure::NotDelivered => {}
                    Failure::MemberBroken => self.forget(index),
                    Failure::Unknown => {
                        self.forget(index);
                        if delivery == Delivery::AtMostOnce {
                            return Err(CallError::Ambiguous {
                                endpoint: address.clone(),
                                what: what.to_owned(),
                                detail,
                                advice: advice.to_owned(),
                            });
                        }
                    }
                }
                last_error = format!("{address}: {detail}");
            }
            if started.elapsed() + pause >= budget {
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(RETRY_PAUSE_MAX_MS));
        }
        Err(CallError::Unreachable {
            endpoints: self.config.addresses.join(","),
            what: what.to_owned(),
            last: last_error,
        })
    }

    /// The cached channel to member `index`, connecting first when there is none.
    async fn channel(&self, index: usize) -> Result<Channel, String> {
        if let Some(channel) = self
            .channels
            .lock()
            .expect("channels lock")
            .get(index)
            .cloned()
            .flatten()
        {
            return Ok(channel);
        }
        let address = &self.config.addresses[index];
        let endpoint = self
            .config
            .transport
            .endpoint(address)
            .map_err(|error| format!("bad address: {}", error_chain(&error)))?
            .connect_timeout(self.config.connect_timeout)
            .tcp_nodelay(true);
        let channel =
            match tokio::time::timeout(self.config.connect_timeout, endpoint.connect()).await {
                Ok(Ok(channel)) => channel,
                Ok(Err(error)) => return Err(format!("cannot connect: {}", error_chain(&error))),
                Err(_) => {
                    return Err(format!(
                        "cannot connect within {:?}",
                        self.config.connect_timeout
                    ));
                }
            };
        self.channels.lock().expect("channels lock")[index] = Some(channel.clone());
        Ok(channel)
    }

    fn forget(&self, index: usize) {
        self.channels.lock().expect("channels lock")[index] = None;
    }
}

/// How long one attempt may take. In the first pass every endpoint gets a try even when an
/// earlier one hung (a stopped or partitioned member), so an idempotent call gives each endpoint
/// not yet tried an equal share of the time left. An at-most-once call cannot move on after
/// sending, so it gets all the time left. `floor` is the least any first-pass attempt gets.
fn attempt_limit(
    remaining: Duration,
    round: u32,
    untried: usize,
    delivery: Delivery,
    floor: Duration,
) -> Duration {
    debug_assert!(untried >= 1);
    match (round, delivery) {
        (0, Delivery::Idempotent) => {
            (remaining / u32::try_from(untried).unwrap_or(u32::MAX).max(1)).max(floor)
        }
        (0, Delivery::AtMostOnce) => remaining.max(floor),
        _ => remaining,
    }
}

/// A status as one line: the message without its code prefix, or the gRPC code when empty.
fn status_text(status: &tonic::Status) -> String {
    let message = status.message();
    match ErrorCode::of(status) {
        Some(code) => format!("{} ({})", human_message(message), code.as_str()),
        None if message.is_empty() => format!("`{}`", status.code()),
        None => format!("`{}`: {message}", status.code()),
    }
}

/// An error with its sources, e.g. "transport error: tcp connect error: Connection refused".
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_decide_whether_to_try_another_member() {
        assert_eq!(
            classify(&ErrorCode::NoLeader.status("none")),
            Failure::NotDelivered
        );
        assert_eq!(
            classify(&ErrorCode::Unavailable.status("lost")),
            Failure::Unknown
        );
        assert_eq!(
            classify(&ErrorCode::TenantNotFound.status("gone")),
            Failure::Final
        );
        assert_eq!(
            classify(&ErrorCode::Storage.status("broken")),
            Failure::MemberBroken
        );
        assert_eq!(
            classify(&ErrorCode::TenantExists.status("taken")),
            Failure::Final
        );
        assert_eq!(
            classify(&tonic::Status::unavailable("tcp connect error: refused")),
            Failure::NotDelivered
        );
        assert_eq!(
            classify(&tonic::Status::unavailable("h2 protocol error")),
            Failure::Unknown
        );
        assert_eq!(
            classify(&tonic::Status::cancelled("timeout")),
            Failure::Unknown
        );
        assert_eq!(classify(&tonic::Status::unimplemented("")), Failure::Final);
    }

    #[test]
    fn human_messages_lose_only_the_code_prefix() {
        assert_eq!(
            human_message("[VGPU-TENANT-NOT-FOUND] no tenant x"),
            "no tenant x"
        );
        assert_eq!(human_message("[other] text"), "[other] text");
        assert_eq!(human_message("plain"), "plain");
        let refused = CallError::refused(&ErrorCode::Unplaceable.status("the pool has no nodes"));
        assert_eq!(
            refused.to_string(),
            "the pool has no nodes (VGPU-UNPLACEABLE)"
        );
        assert_eq!(refused.code(), Some(ErrorCode::Unplaceable));
    }

    #[test]
    fn the_first_pass_shares_time_between_endpoints() {
        let second = Duration::from_secs(1);
        let limit = |remaining, round, untried, delivery| {
            attempt_limit(remaining, round, untried, delivery, second)
        };
        assert_eq!(
            limit(Duration::from_secs(9), 0, 3, Delivery::Idempotent),
            Duration::from_secs(3)
        );
        assert_eq!(
            limit(Duration::from_secs(9), 0, 1, Delivery::Idempotent),
            Duration::from_secs(9)
        );
        assert_eq!(limit(Duration::ZERO, 0, 2, Delivery::Idempotent), second);
        assert_eq!(
            limit(Duration::from_secs(9), 0, 3, Delivery::AtMostOnce),
            Duration::from_secs(9)
        );
        assert_eq!(
            limit(Duration::from_secs(4), 1, 3, Delivery::Idempotent),
            Duration::from_secs(4)
        );
    }
}
