//! A nemesis client: keeps placing, releasing and reading tenants through the members' published
//! ports, failing over between members the way vgpuctl does, and records every attempt that may
//! have reached the cluster.
//!
//! One logical request (say "release nemesis-03") may take several attempts. Each attempt is
//! recorded on its own, because each is a separate request to the cluster:
//! - an attempt that certainly did not reach a member (connection refused, `[VGPU-NO-LEADER]`,
//!   `[VGPU-NOT-LEADER]`) is left out: it had no effect;
//! - an attempt whose answer never came (timeout, reset, `[VGPU-UNAVAILABLE]`) is recorded with
//!   an unknown outcome (it may take effect at any later time, or never), and the client moves on
//!   to another member, for releases too: the unknown attempt stays in the history, so a retried
//!   release that answers `NotFound` is still checked correctly;
//! - the attempt that gets an answer ends the request.
//!
//! A request *fails for good* when no attempt got an answer before its deadline. During a rolling
//! restart that must never happen.

use crate::nemesis::phase::{Phase, PhaseClock};
use api::ErrorCode;
use api::v1::pool_client::PoolClient;
use api::v1::{GetTenantRequest, PlaceRequest, PlacementRequest, ReleaseRequest};
use linearizability::{Call, History, Operation, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// How long one attempt may wait for its answer before its outcome counts as unknown. A member
/// retries internally for up to its request deadline (10 s) while it has no leader; this is
/// shorter so that a client stuck on a paused or cut-off member moves on, as vgpuctl does when it
/// splits its time limit across endpoints.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(4);
/// How long one logical request may take, all attempts included, before it fails for good.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// How long to wait for a TCP connection to a published port.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The pause after a pass over every member without an answer; doubles up to the maximum.
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(100);
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(1);
/// Attempts per logical request, whatever the deadline says.
const ATTEMPTS_MAX: u32 = 64;
/// Pause between two requests of one client.
const THINK_MS_MAX: u64 = 60;
/// The requests clients place: 0.1 to 0.5 GPU, so that every name fits at once on the two
/// simulated 8-GPU nodes and placements never wait for capacity.
const MILLI_GPUS: [u32; 5] = [100, 200, 300, 400, 500];

/// A member as clients see it: its compose service, its published address and how to talk to
/// it.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub service: String,
    pub address: String,
    /// mTLS with an admin certificate, or plain text for a cluster started with `--insecure`.
    pub transport: api::tls::Transport,
}

/// The end of one logical request.
#[derive(Clone, Debug)]
pub struct Request {
    pub client: u32,
    pub phase: Phase,
    pub description: String,
    /// `None` when it failed for good (no answer before the deadline).
    pub answered: Option<Outcome>,
    pub attempts: u32,
    pub elapsed: Duration,
}

/// What an attempt's failure means for the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The member did not take the request: it had no effect. Try another member.
    NotDelivered,
    /// It may have taken effect: record an unknown outcome, then try another member.
    Unknown,
}

/// Classifies a failed call the way vgpuctl's endpoint failover does (`vgpuctl::endpoints`):
/// `Err(outcome)` for an answer of the register model (`TENANT_EXISTS`, `UNPLACEABLE`,
/// `TENANT_NOT_FOUND`, or `Unexpected` for anything the model does not allow).
pub fn classify_status(call: Call, status: &tonic::Status) -> Result<Failure, Outcome> {
    match (call, ErrorCode::of(status)) {
        // The member gave up finding a leader: nothing was written.
        (_, Some(ErrorCode::NoLeader | ErrorCode::NotLeader)) => Ok(Failure::NotDelivered),
        // The member says the outcome is unknown (its leader failed mid-request), or its own
        // storage failed.
        (_, Some(ErrorCode::Unavailable | ErrorCode::Storage)) => Ok(Failure::Unknown),
        (Call::Place(_), Some(ErrorCode::TenantExists)) => Err(Outcome::Exists),
        (Call::Place(_), Some(ErrorCode::Unplaceable)) => Err(Outcome::Unplaceable),
        (Call::Release, Some(ErrorCode::TenantNotFound)) => Err(Outcome::NotFound),
        (Call::Read, Some(ErrorCode::TenantNotFound)) => Err(Outcome::Absent),
        (_, Some(_)) => Err(Outcome::Unexpected),
        (_, None) => match status.code() {
            tonic::Code::Unavailable if is_connect_failure(status) => Ok(Failure::NotDelivered),
            tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Aborted
            | tonic::Code::Internal => Ok(Failure::Unknown),
            _ => Err(Outcome::Unexpected),
        },
    }
}

/// Whether a status without a vgpu code comes from failing to open the connection (the request
/// never left this process).
fn is_connect_failure(status: &tonic::Status) -> bool {
    let text = format!("{status:?}").to_ascii_lowercase();
    [
        "connecterror",
        "connect error",
        "connection refused",
        "dns error",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// One client task.
pub struct Client {
    pub id: u32,
    pub endpoints: Vec<Endpoint>,
    pub names: Vec<String>,
    pub history: Arc<History>,
    pub clock: PhaseClock,
    pub rng: StdRng,
    /// Cached channels, one per endpoint; dropped after an attempt whose answer never came.
    channels: Vec<Option<Channel>>,
    /// The endpoint that answered last; requests start there.
    preferred: usize,
}

impl Client {
    pub fn new(
        id: u32,
        seed: u64,
        endpoints: Vec<Endpoint>,
        names: Vec<String>,
        history: Arc<History>,
        clock: PhaseClock,
    ) -> Client {
        assert!(!endpoints.is_empty(), "a client needs a member to talk to");
        assert!(!names.is_empty(), "a client needs tenant names");
        let channels = vec![None; endpoints.len()];
        let preferred = id as usize % endpoints.len();
        Client {
            id,
            endpoints,
            names,
            history,
            clock,
            rng: StdRng::seed_from_u64(seed ^ (u64::from(id) << 32)),
            channels,
            preferred,
        }
    }

    /// Issues requests until `stop` is set; returns how each logical request ended.
    pub async fn run(mut self, stop: Arc<AtomicBool>) -> Vec<Request> {
        let mut requests = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let think = self.rng.gen_range(0..=THINK_MS_MAX);
            tokio::time::sleep(Duration::from_millis(think)).await;
            let name = self.names[self.rng.gen_range(0..self.names.len())].clone();
            let call = match self.rng.gen_range(0..100) {
                0..40 => Call::Place(MILLI_GPUS[self.rng.gen_range(0..MILLI_GPUS.len())]),
                40..65 => Call::Release,
                _ => Call::Read,
            };
            requests.push(self.request(&name, call).await);
        }
        requests
    }

    /// Runs one logical request to its answer or its deadline.
    pub async fn request(&mut self, name: &str, call: Call) -> Request {
        let phase = self.clock.phase();
        let started = Instant::now();
        let description = format!("{call:?} {name}");
        let mut pause = RETRY_PAUSE_MIN;
        let mut attempts = 0;
        let count = self.endpoints.len();
        while attempts < ATTEMPTS_MAX && started.elapsed() < REQUEST_DEADLINE {
            let first = self.preferred;
            for offset in 0..count {
                if started.elapsed() >= REQUEST_DEADLINE {
                    break;
                }
                let index = (first + offset) % count;
                attempts += 1;
                if let Some(outcome) = self.attempt(index, name, call).await {
                    self.preferred = index;
                    return Request {
                        client: self.id,
                        phase,
                        description,
                        answered: Some(outcome),
                        attempts,
                        elapsed: started.elapsed(),
                    };
                }
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_PAUSE_MAX);
        }
        tracing::warn!(client = self.id, %description, attempts, ?phase, "request failed for good");
        Request {
            client: self.id,
            phase,
            description,
            answered: None,
            attempts,
            elapsed: started.elapsed(),
        }
    }

    /// One attempt at member `index`: `Some(outcome)` when it answered (the operation is
    /// recorded), `None` when the request goes on (an unknown outcome is recorded first).
    async fn attempt(&mut self, index: usize, name: &str, call: Call) -> Option<Outcome> {
        let channel = self.channel(index)?;
        let service = self.endpoints[index].service.clone();
        let invoked = self.history.event();
        let invoked_us = self.clock.now_us();
        let answer = tokio::time::timeout(ATTEMPT_TIMEOUT, send(channel, name, call)).await;
        let (outcome, note) = match answer {
            Ok(Ok(outcome)) => (outcome, format!("{service} answered")),
            Ok(Err(status)) => match classify_status(call, &status) {
                Err(outcome) => (outcome, format!("{service}: {}", status.message())),
                Ok(Failure::NotDelivered) => {
                    tracing::debug!(client = self.id, %service, %status, "not delivered");
                    return None;
                }
                Ok(Failure::Unknown) => {
                    self.channels[index] = None;
                    (Outcome::Unknown, format!("{service}: {status}"))
                }
            },
            Err(_) => {
                self.channels[index] = None;
                let note = format!("{service}: no answer within {ATTEMPT_TIMEOUT:?}");
                (Outcome::Unknown, note)
            }
        };
        // A read whose answer never came changed nothing: leave it out.
        if outcome == Outcome::Unknown && call == Call::Read {
            return None;
        }
        let (returned, returned_us) = if outcome == Outcome::Unknown {
            (u64::MAX, u64::MAX)
        } else {
            (self.history.event(), self.clock.now_us())
        };
        self.history.record(Operation {
            client: self.id,
            name: name.to_owned(),
            call,
            invoked,
            returned,
            invoked_us,
            returned_us,
            outcome,
            note,
        });
        (outcome != Outcome::Unknown).then_some(outcome)
    }

    /// The cached channel to member `index`, created lazily (it connects on first use, so a
    /// refused connection shows up as the call's `Unavailable` connect error).
    fn channel(&mut self, index: usize) -> Option<Channel> {
        if let Some(channel) = &self.channels[index] {
            return Some(channel.clone());
        }
        let Endpoint {
            address, transport, ..
        } = &self.endpoints[index];
        let endpoint = transport
            .endpoint(address)
            .map_err(|error| tracing::error!(%address, %error, "bad endpoint"))
            .ok()?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = endpoint.connect_lazy();
        self.channels[index] = Some(channel.clone());
        Some(channel)
    }
}

/// Sends one call; maps a successful answer onto the register model.
async fn send(channel: Channel, name: &str, call: Call) -> Result<Outcome, tonic::Status> {
    let mut pool = PoolClient::new(channel);
    match call {
        Call::Place(milli_gpus) => {
            let request = PlaceRequest {
                name: name.to_owned(),
                request: Some(PlacementRequest {
                    milli_gpus,
                    ..Default::default()
                }),
            };
            let tenant = pool.place(request).await?.into_inner().tenant;
            Ok(match tenant.and_then(|tenant| tenant.request) {
                Some(request) if request.milli_gpus == milli_gpus => Outcome::Placed,
                _ => Outcome::Unexpected,
            })
        }
        Call::Release => {
            pool.release(ReleaseRequest {
                name: name.to_owned(),
            })
            .await?;
            Ok(Outcome::Released)
        }
        Call::Read => {
            let request = GetTenantRequest {
                name: name.to_owned(),
                stale: false,
            };
            let tenant = pool.get_tenant(request).await?.into_inner();
            Ok(match tenant.request {
                Some(request) => Outcome::Present(request.milli_gpus),
                None => Outcome::Unexpected,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_of_the_model_end_the_request() {
        let exists = ErrorCode::TenantExists.status("exists with another request");
        assert_eq!(
            classify_status(Call::Place(100), &exists),
            Err(Outcome::Exists)
        );
        let missing = ErrorCode::TenantNotFound.status("no tenant");
        assert_eq!(
            classify_status(Call::Release, &missing),
            Err(Outcome::NotFound)
        );
        assert_eq!(classify_status(Call::Read, &missing), Err(Outcome::Absent));
        // A code the model has no place for is a wrong answer, not a retry.
        let invalid = ErrorCode::InvalidArgument.status("bad");
        assert_eq!(
            classify_status(Call::Release, &invalid),
            Err(Outcome::Unexpected)
        );
    }

    #[test]
    fn only_failures_that_wrote_nothing_are_left_out() {
        let no_leader = ErrorCode::NoLeader.status("no leader within 10s");
        assert_eq!(
            classify_status(Call::Release, &no_leader),
            Ok(Failure::NotDelivered)
        );
        let unknown = ErrorCode::Unavailable.status("the leader failed mid-request");
        assert_eq!(
            classify_status(Call::Place(100), &unknown),
            Ok(Failure::Unknown)
        );
        let reset = tonic::Status::unavailable("connection reset by peer");
        assert_eq!(classify_status(Call::Release, &reset), Ok(Failure::Unknown));
        let refused = tonic::Status::unavailable("tcp connect error: Connection refused");
        assert_eq!(
            classify_status(Call::Release, &refused),
            Ok(Failure::NotDelivered)
        );
    }
}
