//! Simulated clients: each keeps issuing Place / Release / Read of a few tenant names against
//! random members, and records every operation in the [`History`].
//!
//! A write goes through `client_write` on the member asked; a non-leader answers
//! `ForwardToLeader` (the entry was never appended there, or was truncated, so it cannot commit)
//! and the client retries at the leader, a bounded number of times. A timeout or a member that
//! stops while the request is in flight leaves the outcome unknown, and the client does not retry
//! (a retried release would answer `NotFound` for its own earlier success). A read asks the
//! member to `ensure_linearizable` (only a leader can) and then reads that member's state machine.

use crate::history::{Call, History, Operation, Outcome};
use crate::network::Router;
use api::ErrorCode;
use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use prost::Message;
use rand::Rng;
use rand::rngs::StdRng;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use vgpu_cp::pool::{Command, CommandResult};
use vgpu_cp::raft_types::NodeId;

/// Attempts per operation (the first plus retries at the leader named by a `ForwardToLeader`).
const ATTEMPTS_MAX: u32 = 4;
/// How long a client waits for one answer before the outcome counts as unknown. Short, so that
/// clients stuck on an isolated leader give up and find the new one, as real clients would (and
/// so a deposed leader's stale answers get compared with the new leader's).
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(400);
const RETRY_PAUSE_MS_MAX: u64 = 40;
const THINK_MS_MAX: u64 = 40;

/// A virtual clock for the whole run, in microseconds since it started.
#[derive(Clone, Copy)]
pub struct Clock {
    pub start: Instant,
}

impl Clock {
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).expect("a run lasts less than 500000 years")
    }

    /// What clients stamp on commands (placement reads no clock; this goes into tenant history).
    pub fn unix_ms(&self) -> i64 {
        1_800_000_000_000 + i64::try_from(self.start.elapsed().as_millis()).expect("short run")
    }
}

/// The request the simulation places: a fraction of one GPU, so placements are cheap and (with
/// at most a few tenants on eight GPUs) always fit.
pub fn placement_request(milli_gpus: u32) -> Vec<u8> {
    api::v1::PlacementRequest {
        milli_gpus,
        ..Default::default()
    }
    .encode_to_vec()
}

fn milli_of(request: &[u8]) -> Option<u32> {
    api::v1::PlacementRequest::decode(request)
        .ok()
        .map(|request| request.milli_gpus)
}

pub struct Client {
    pub id: u32,
    pub router: Arc<Router>,
    pub history: Arc<History>,
    pub rng: StdRng,
    pub clock: Clock,
    pub names: Vec<String>,
    pub members: Vec<NodeId>,
}

impl Client {
    /// Issues operations until `deadline` (virtual time).
    pub async fn run(mut self, deadline: Instant) {
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(self.rng.gen_range(0..=THINK_MS_MAX))).await;
            let name = self.names[self.rng.gen_range(0..self.names.len())].clone();
            let call = match self.rng.gen_range(0..100) {
                0..45 => Call::Place(100 * self.rng.gen_range(1..=5)),
                45..70 => Call::Release,
                _ => Call::Read,
            };
            let member = self.random_member();
            let invoked = self.history.event();
            let invoked_us = self.clock.now_us();
            let answer = match call {
                Call::Place(milli) => {
                    let command = Command::Place {
                        name: name.clone(),
                        request: placement_request(milli),
                        unix_ms: self.clock.unix_ms(),
                    };
                    self.write(member, command, call).await
                }
                Call::Release => {
                    let command = Command::Release {
                        name: name.clone(),
                        unix_ms: self.clock.unix_ms(),
                    };
                    self.write(member, command, call).await
                }
                Call::Read => self.read(member, &name).await,
            };
            // No answer at all means the operation certainly had no effect: leave it out.
            let Some((outcome, note)) = answer else {
                continue;
            };
            let (returned, returned_us) = if outcome == Outcome::Unknown {
                (u64::MAX, u64::MAX)
            } else {
                (self.history.event(), self.clock.now_us())
            };
            let operation = Operation {
                client: self.id,
                name,
                call,
                invoked,
                returned,
                invoked_us,
                returned_us,
                outcome,
                note,
            };
            self.history.record(operation);
        }
    }

    fn random_member(&mut self) -> NodeId {
        self.members[self.rng.gen_range(0..self.members.len())]
    }

    async fn pause(&mut self) {
        tokio::time::sleep(Duration::from_millis(
            self.rng.gen_range(1..=RETRY_PAUSE_MS_MAX),
        ))
        .await;
    }

    /// Commits `command`; `None` when it certainly never took effect.
    async fn write(
        &mut self,
        first: NodeId,
        command: Command,
        call: Call,
    ) -> Option<(Outcome, String)> {
        let mut target = first;
        for _ in 0..ATTEMPTS_MAX {
            let Some(member) = self.router.member(target) else {
                // The member is down: the request was never delivered.
                self.pause().await;
                target = self.random_member();
                continue;
            };
            match tokio::time::timeout(REQUEST_TIMEOUT, member.raft.client_write(command.clone()))
                .await
            {
                Err(_elapsed) => {
                    return Some((Outcome::Unknown, format!("member {target} timed out")));
                }
                Ok(Ok(response)) => {
                    let note = format!("member {target}, log {}", response.log_id);
                    return Some((classify(call, &response.data), note));
                }
                Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward)))) => {
                    self.pause().await;
                    target = match forward.leader_id {
                        Some(leader) => leader,
                        None => self.random_member(),
                    };
                }
                Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(error)))) => {
                    return Some((Outcome::Unexpected, format!("member {target}: {error}")));
                }
                Ok(Err(RaftError::Fatal(fatal))) => {
                    return Some((
                        Outcome::Unknown,
                        format!("member {target} stopped: {fatal}"),
                    ));
                }
            }
        }
        None
    }

    /// A linearizable read of `name`; `None` when no member could serve it.
    async fn read(&mut self, first: NodeId, name: &str) -> Option<(Outcome, String)> {
        let mut target = first;
        for _ in 0..ATTEMPTS_MAX {
            let Some(member) = self.router.member(target) else {
                self.pause().await;
                target = self.random_member();
                continue;
            };
            match tokio::time::timeout(REQUEST_TIMEOUT, member.raft.ensure_linearizable()).await {
                Ok(Ok(read_log_id)) => {
                    // No await between the check and the read: the member cannot change under us.
                    let applied = member.shared.read();
                    let outcome = match applied.pool.tenants.get(name) {
                        None => Outcome::Absent,
                        Some(record) => match milli_of(&record.request) {
                            Some(milli) => Outcome::Present(milli),
                            None => Outcome::Unexpected,
                        },
                    };
                    let last_applied = applied.last_applied.map_or(0, |id| id.index);
                    let read_index = read_log_id.map_or(0, |id| id.index);
                    assert!(
                        last_applied >= read_index,
                        "ensure_linearizable returns once the read index is applied"
                    );
                    return Some((
                        outcome,
                        format!("member {target}, read index {read_index}, applied {last_applied}"),
                    ));
                }
                Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(forward)))) => {
                    self.pause().await;
                    target = match forward.leader_id {
                        Some(leader) => leader,
                        None => self.random_member(),
                    };
                }
                // A read that gets no answer changes nothing.
                Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_))))
                | Ok(Err(RaftError::Fatal(_)))
                | Err(_) => return None,
            }
        }
        None
    }
}

/// Maps what applying a command returned onto the register model.
fn classify(call: Call, result: &CommandResult) -> Outcome {
    match (call, result) {
        (Call::Place(milli), CommandResult::Tenant(record))
            if milli_of(&record.request) == Some(milli) =>
        {
            Outcome::Placed
        }
        (
            Call::Place(_),
            CommandResult::Failed {
                code: ErrorCode::TenantExists,
                ..
            },
        ) => Outcome::Exists,
        (
            Call::Place(_),
            CommandResult::Failed {
                code: ErrorCode::Unplaceable,
                ..
            },
        ) => Outcome::Unplaceable,
        (Call::Release, CommandResult::Done) => Outcome::Released,
        (
            Call::Release,
            CommandResult::Failed {
                code: ErrorCode::TenantNotFound,
                ..
            },
        ) => Outcome::NotFound,
        _ => Outcome::Unexpected,
    }
}
