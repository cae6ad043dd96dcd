//! The replicated pool state: nodes, tenants and the placement engine, changed only by applying
//! [`Command`]s from the Raft log.
//!
//! **Architecture Invariant:** `PoolState::apply` is a pure function of the state and the entry
//! (log index, command). It reads no clock (time travels inside the command, stamped by the node
//! that proposed it) and iterates only ordered maps, so every replica computes the same placements.
//! Placement therefore runs inside `apply` on every replica, and the leader decides *when* things
//! happen (node loss, retries) by proposing commands.

use api::ErrorCode;
use api::v1;
use placement::{
    Constraints, Engine, EngineConfig, Event, HostCapacity, NodeSpec, SliceAssignment,
};
use prost::Message;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Most history events kept per tenant (older ones are dropped).
pub const TENANT_HISTORY_MAX: usize = 32;
/// Most GPUs a node may register.
pub const NODE_GPUS_MAX: usize = 64;

/// A change to the pool; one per Raft log entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    RegisterNode {
        spec: NodeSpec,
        address: String,
        unix_ms: i64,
    },
    SetNodeState {
        node: String,
        state: placement::NodeState,
        reason: String,
        unix_ms: i64,
    },
    /// `request` is a prost-encoded `vgpu.v1.PlacementRequest`.
    Place {
        name: String,
        request: Vec<u8>,
        unix_ms: i64,
    },
    Release {
        name: String,
        unix_ms: i64,
    },
    /// Try the pending queue again.
    Retry {
        unix_ms: i64,
    },
    /// Several commands proposed together by the leader (see `control_plane`'s batcher): one
    /// log entry, so one fsync, for many client writes. Applied in order; never nested.
    Batch(Vec<Command>),
    /// Records a bootstrap token for `vgpu-agent join --token`: only its SHA-256 (hex) and
    /// expiry, never the token. Drops expired tokens. (Appended last: variants are numbered by
    /// position in the log encoding.)
    CreateToken {
        hash: String,
        expires_unix_ms: i64,
        unix_ms: i64,
    },
    /// Revokes the certificate with this serial (normalized hex, `api::tls::normalize_serial`).
    /// (Appended last, like `CreateToken`. A member of an older version cannot read it: revoke
    /// only once every member runs a version that knows it.)
    RevokeCertificate {
        serial: String,
        unix_ms: i64,
    },
    /// Changes a tenant in place (`Pool.SetTenant`): each `Some` field is set. `owner` is the
    /// caller's owner when a tenant certificate asked (it may change only its owner's tenants);
    /// `None` for admins. (Appended last, like `RevokeCertificate`: a member of an older version
    /// cannot read it; change tenants only once every member runs a version that knows it.)
    SetTenant {
        name: String,
        compute_percent: Option<u32>,
        priority: Option<i32>,
        latency_target_us: Option<u64>,
        owner: Option<String>,
        unix_ms: i64,
    },
    /// A command the leader decided by time (`SetNodeState` for a silent or resumed node,
    /// `Retry`), fenced by the leadership it was decided under: applied only when the entry
    /// carrying it was appended by that same leader (`term`, `leader`), else refused with
    /// `[VGPU-NOT-LEADER]` and nothing changes. A leader paused past an election, or deposed
    /// between deciding and proposing, cannot unbind tenants on a stale view (issue 22).
    /// (Appended last, like `SetTenant`.)
    LeaderDecision {
        term: u64,
        leader: u64,
        command: Box<Command>,
    },
    /// A write a `tenant:OWNER` certificate asked for (`Place`, `Release`, `SetTenant`), with
    /// the owner it may act for: applied only when the tenant does not exist yet or is stored
    /// with that owner (and a `Place` asks for that owner), else refused with
    /// `[VGPU-PERMISSION-DENIED]` and nothing changes. The entry member checks the owner before
    /// proposing too, but only apply sees the state the write meets: a release racing another
    /// owner's place of the same name cannot remove that owner's tenant (issue 22).
    /// (Appended last, like `LeaderDecision`.)
    AsOwner {
        owner: String,
        command: Box<Command>,
    },
    /// Forgets a node (`Pool.RemoveNode`, admins): its tenants are re-placed, and it leaves the
    /// pool until its agent registers it again. (Appended last, like `AsOwner`.)
    RemoveNode {
        node: String,
        unix_ms: i64,
    },
    /// A registration that carries the agent's node key (`api::metadata::NODE_KEY`), as its
    /// SHA-256 (`api::metadata::node_key_sha256`; the key itself never enters the log). The
    /// first keyed registration binds the node's name to the key; another key's is refused with
    /// `[VGPU-NODE-NAME-TAKEN]` until an admin removes the node (issue 22, point 5). Checked
    /// here, in apply, so that of two racing registrations only the first can bind. A plain
    /// `RegisterNode` (an agent without a key) is accepted only for a name that is not bound.
    /// (Appended last, like `RemoveNode`.)
    RegisterKeyedNode {
        spec: NodeSpec,
        address: String,
        key_sha256: String,
        unix_ms: i64,
    },
    /// A registration that reports the node's host capacity (CPU, host memory: issue 19), keyed
    /// (`RegisterKeyedNode`) or not (`RegisterNode`). Proposed only when the agent reported some
    /// host capacity, so that agents of earlier versions keep producing the entries older
    /// members read. (Appended last, like `RegisterKeyedNode`: a member of an older version
    /// cannot read it; run agents that report host capacity only once every member knows it.)
    RegisterHostNode {
        spec: NodeSpec,
        host: HostCapacity,
        address: String,
        key_sha256: Option<String>,
        unix_ms: i64,
    },
    /// `Place` of a request with whole-node constraints (`cpu_milli`, `host_memory_bytes`,
    /// `gpu_models`: issue 19). Applied exactly as `Place`, which reads the constraints from the
    /// request; its own variant only so that a member of an older version, which would ignore
    /// the request's new fields and place differently, stops at the entry instead of diverging.
    /// (Appended last, like `RegisterHostNode`.)
    PlaceConstrained {
        name: String,
        request: Vec<u8>,
        unix_ms: i64,
    },
    /// A registration of a Kubernetes-managed node (`Node.kubernetes_managed`, issue 18),
    /// keyed or not, with its host capacity (none reported: the default). The placement engine
    /// never places there itself; only pins do. (Appended last, like `PlaceConstrained`: a
    /// member of an older version cannot read it; run agents with `--kubernetes-managed` only
    /// once every member knows it.)
    RegisterKubernetesNode {
        spec: NodeSpec,
        host: HostCapacity,
        address: String,
        key_sha256: Option<String>,
        unix_ms: i64,
    },
    /// `Place` of a request with a pin (`PlacementRequest.pin`, issue 18): bound exactly to the
    /// pin or refused. Applied exactly as `Place`, which reads the pin from the request; its own
    /// variant for the reason `PlaceConstrained` has one: a member of an older version would
    /// place the request by search. (Appended last, like `RegisterKubernetesNode`.)
    PlacePinned {
        name: String,
        request: Vec<u8>,
        unix_ms: i64,
    },
}

/// Most unexpired bootstrap tokens the pool keeps.
pub const TOKENS_MAX: usize = 1024;

/// Most revoked certificates the pool keeps (they are kept for good: a certificate lives up to
/// years; replace the CA long before this fills).
pub const REVOKED_MAX: usize = 65_536;

/// Most commands in one `Command::Batch` (their sequence numbers are `index << 16 | position`).
pub const BATCH_COMMANDS_MAX: usize = 1024;

/// What applying a command returned, sent back to the client that proposed it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CommandResult {
    Done,
    /// The results of a `Command::Batch`, in order.
    Batch(Vec<CommandResult>),
    Tenant(Box<TenantRecord>),
    Failed {
        code: ErrorCode,
        message: String,
    },
    /// A certificate revocation: whether it was new, and how many are revoked now.
    Revoked {
        newly: bool,
        total: u32,
    },
    /// A keyed registration was accepted as registration number `registration`
    /// (`api::metadata::REGISTRATION`); a plain one answers `Done`. (Appended last: only members
    /// that propose `RegisterKeyedNode` get it back.)
    Registered {
        registration: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TenantState {
    Pending,
    Placed,
    Preempted,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEvent {
    pub unix_ms: i64,
    pub state: TenantState,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    /// prost-encoded `vgpu.v1.PlacementRequest`, exactly as submitted, then rewritten by each
    /// `SetTenant` that changed it (so `Place` again with the first request is a conflict).
    pub request: Vec<u8>,
    pub state: TenantState,
    pub reason: String,
    pub slices: Vec<SliceAssignment>,
    pub history: VecDeque<HistoryEvent>,
    pub created_unix_ms: i64,
    /// Log index of the last change.
    pub revision: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub address: String,
    pub registered_unix_ms: i64,
    /// Why the node is in its current state, for `describe node`.
    pub state_reason: String,
}

/// Counters kept in the replicated state, so they survive restarts and leader changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub placements: u64,
    pub preemptions: u64,
    pub rejections: u64,
    pub releases: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PoolState {
    pub engine: Engine,
    pub nodes: BTreeMap<String, NodeRecord>,
    pub tenants: BTreeMap<String, TenantRecord>,
    /// Log index of the last change to each node's assignments or state.
    pub node_revisions: BTreeMap<String, u64>,
    pub counters: Counters,
    /// Bootstrap tokens: SHA-256 (hex) -> expiry, unix ms.
    pub tokens: BTreeMap<String, i64>,
    /// Revoked certificates: serial (normalized hex) -> when, unix ms. Not part of this
    /// struct's encoding: the snapshot carries it next to the pool (format 2), so that a pool
    /// without revocations encodes exactly as before (format 1) and older members can still
    /// read its snapshots during a rolling upgrade (`store::state_machine`).
    #[serde(skip)]
    pub revoked: BTreeMap<String, i64>,
    /// The nodes whose names are bound to a node key (`Command::RegisterKeyedNode`), by name.
    /// Never shown by any read. Not part of this struct's encoding, like `revoked`: the
    /// snapshot carries it (format 3) only when some name is bound.
    #[serde(skip)]
    pub node_keys: BTreeMap<String, NodeKeyBinding>,
}

/// What binds a node's name: the SHA-256 of the node key that registered it first, and the
/// number of its latest registration (the sequence number of the entry that applied it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeKeyBinding {
    pub key_sha256: String,
    pub registration: u64,
}

/// Why a call for a node is refused: its name is held by another key or registration. The
/// message goes out coded `[VGPU-NODE-NAME-TAKEN]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameTaken(pub String);

/// The message of a call whose key is not the one `node` is bound to (or that has no key).
fn name_taken_message(node: &str) -> String {
    format!(
        "node `{node}` is registered by another node key; if this machine is meant to replace it, an admin removes the node first (`vgpuctl node remove {node}`), otherwise give this machine its own name (`vgpu-agent join --name ...`)"
    )
}

impl Default for PoolState {
    fn default() -> Self {
        PoolState {
            engine: Engine::new(EngineConfig::default()),
            nodes: BTreeMap::new(),
            tenants: BTreeMap::new(),
            node_revisions: BTreeMap::new(),
            counters: Counters::default(),
            tokens: BTreeMap::new(),
            revoked: BTreeMap::new(),
            node_keys: BTreeMap::new(),
        }
    }
}

fn engine_failure() -> CommandResult {
    failed(
        ErrorCode::Internal,
        "the placement engine failed on this request (a bug in vgpu); it was not applied; please report it with the control-plane logs",
    )
}

fn failed(code: ErrorCode, message: impl Into<String>) -> CommandResult {
    CommandResult::Failed {
        code,
        message: message.into(),
    }
}

/// Which leader appended a log entry: its term and its member id (openraft's `LeaderId`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryLeader {
    pub term: u64,
    pub leader: u64,
}

impl PoolState {
    /// Applies the command of log entry `index`, appended by an unknown leader: a
    /// `Command::LeaderDecision` in it is refused. The state machine calls [`Self::apply_entry`].
    pub fn apply(&mut self, index: u64, command: Command) -> CommandResult {
        self.apply_entry(index, EntryLeader::default(), command)
    }

    /// Applies the command of log entry `index`, which `appended_by` appended.
    pub fn apply_entry(
        &mut self,
        index: u64,
        appended_by: EntryLeader,
        command: Command,
    ) -> CommandResult {
        match command {
            Command::Batch(commands) => {
                assert!(commands.len() <= BATCH_COMMANDS_MAX, "batches are bounded");
                let results = commands
                    .into_iter()
                    .enumerate()
                    .map(|(position, command)| {
                        assert!(!matches!(command, Command::Batch(_)), "batches do not nest");
                        self.apply_fenced(
                            index,
                            index << 16 | position as u64,
                            appended_by,
                            command,
                        )
                    })
                    .collect();
                CommandResult::Batch(results)
            }
            command => self.apply_fenced(index, index << 16, appended_by, command),
        }
    }

    /// Unwraps a `Command::LeaderDecision` whose leadership appended the entry, and a
    /// `Command::AsOwner` whose owner holds the tenant; refuses the others (see the variants).
    fn apply_fenced(
        &mut self,
        index: u64,
        seq: u64,
        appended_by: EntryLeader,
        command: Command,
    ) -> CommandResult {
        let (term, leader, command) = match command {
            Command::LeaderDecision {
                term,
                leader,
                command,
            } => (term, leader, command),
            Command::AsOwner { owner, command } => {
                if let Err(refusal) = self.check_owner(&owner, &command) {
                    return refusal;
                }
                return self.apply_at(index, seq, *command);
            }
            command => return self.apply_at(index, seq, command),
        };
        if !matches!(
            *command,
            Command::SetNodeState { .. } | Command::Retry { .. }
        ) {
            return failed(
                ErrorCode::InvalidArgument,
                "only node state changes and retries are leader decisions (a bug in the proposer)",
            );
        }
        let decided = EntryLeader { term, leader };
        if decided != appended_by {
            return failed(
                ErrorCode::NotLeader,
                format!(
                    "a decision of leader {leader} in term {term} reached the log under leader {} in term {}; it was made on a stale view and is dropped (the current leader decides again)",
                    appended_by.leader, appended_by.term
                ),
            );
        }
        self.apply_at(index, seq, *command)
    }

    /// Applies one (non-batch) command of log entry `index`; `seq` orders tenants submitted in
    /// the same entry.
    fn apply_at(&mut self, index: u64, seq: u64, command: Command) -> CommandResult {
        match command {
            Command::Batch(_) => unreachable!("batches are unpacked by apply"),
            Command::LeaderDecision { .. } | Command::AsOwner { .. } => {
                unreachable!("decisions and owned writes are unwrapped by apply")
            }
            Command::RegisterNode {
                spec,
                address,
                unix_ms,
            } => {
                let registration = Registration {
                    spec,
                    host: HostCapacity::default(),
                    address,
                    key_sha256: None,
                    kubernetes_managed: false,
                };
                self.register_node(index, seq, registration, unix_ms)
            }
            Command::RegisterKeyedNode {
                spec,
                address,
                key_sha256,
                unix_ms,
            } => {
                let registration = Registration {
                    spec,
                    host: HostCapacity::default(),
                    address,
                    key_sha256: Some(key_sha256),
                    kubernetes_managed: false,
                };
                self.register_node(index, seq, registration, unix_ms)
            }
            Command::RegisterHostNode {
                spec,
                host,
                address,
                key_sha256,
                unix_ms,
            } => {
                let registration = Registration {
                    spec,
                    host,
                    address,
                    key_sha256,
                    kubernetes_managed: false,
                };
                self.register_node(index, seq, registration, unix_ms)
            }
            Command::RegisterKubernetesNode {
                spec,
                host,
                address,
                key_sha256,
                unix_ms,
            } => {
                let registration = Registration {
                    spec,
                    host,
                    address,
                    key_sha256,
                    kubernetes_managed: true,
                };
                self.register_node(index, seq, registration, unix_ms)
            }
            Command::SetNodeState {
                node,
                state,
                reason,
                unix_ms,
            } => self.set_node_state(index, node, state, reason, unix_ms),
            Command::Place {
                name,
                request,
                unix_ms,
            }
            | Command::PlaceConstrained {
                name,
                request,
                unix_ms,
            }
            | Command::PlacePinned {
                name,
                request,
                unix_ms,
            } => self.place(index, seq, name, request, unix_ms),
            Command::Release { name, unix_ms } => self.release(index, name, unix_ms),
            Command::RemoveNode { node, unix_ms } => self.remove_node(index, node, unix_ms),
            Command::CreateToken {
                hash,
                expires_unix_ms,
                unix_ms,
            } => self.create_token(hash, expires_unix_ms, unix_ms),
            Command::RevokeCertificate { serial, unix_ms } => {
                self.revoke_certificate(serial, unix_ms)
            }
            Command::SetTenant {
                name,
                compute_percent,
                priority,
                latency_target_us,
                owner,
                unix_ms,
            } => {
                let change = v1::SetTenantRequest {
                    name,
                    compute_percent,
                    priority,
                    latency_target_us,
                };
                self.set_tenant(index, change, owner.as_deref(), unix_ms)
            }
            Command::Retry { unix_ms } => {
                let Some(commands) = self.handle_guarded(Event::Retry) else {
                    return engine_failure();
                };
                self.record(index, unix_ms, commands, None);
                CommandResult::Done
            }
        }
    }

    /// Whether `owner` may apply `command` (see `Command::AsOwner`).
    fn check_owner(&self, owner: &str, command: &Command) -> Result<(), CommandResult> {
        let name = match command {
            Command::Place { name, request, .. }
            | Command::PlaceConstrained { name, request, .. } => {
                let asked = v1::PlacementRequest::decode(request.as_slice())
                    .map(|request| request.owner)
                    .unwrap_or_default();
                if asked != owner {
                    return Err(failed(
                        ErrorCode::PermissionDenied,
                        format!(
                            "a tenant certificate of owner `{owner}` placed tenant `{name}` for another owner; it places only for its own"
                        ),
                    ));
                }
                name
            }
            Command::Release { name, .. } | Command::SetTenant { name, .. } => name,
            _ => {
                return Err(failed(
                    ErrorCode::InvalidArgument,
                    "only placing, changing and releasing tenants act for an owner (a bug in the proposer)",
                ));
            }
        };
        let Some(record) = self.tenants.get(name) else {
            return Ok(());
        };
        if decode_request(&record.request).owner == owner {
            return Ok(());
        }
        Err(failed(
            ErrorCode::PermissionDenied,
            format!(
                "tenant `{name}` belongs to another owner than `{owner}`; a tenant certificate acts only on its own owner's tenants, and nothing was changed"
            ),
        ))
    }

    fn create_token(&mut self, hash: String, expires_unix_ms: i64, unix_ms: i64) -> CommandResult {
        self.tokens.retain(|_, expires| *expires > unix_ms);
        if expires_unix_ms <= unix_ms || hash.len() != 64 {
            return failed(
                ErrorCode::InvalidArgument,
                "a bootstrap token needs a SHA-256 and an expiry in the future",
            );
        }
        if self.tokens.len() >= TOKENS_MAX && !self.tokens.contains_key(&hash) {
            return failed(
                ErrorCode::InvalidArgument,
                format!(
                    "{TOKENS_MAX} bootstrap tokens are unexpired; wait for some to expire, or create them with a shorter --ttl"
                ),
            );
        }
        self.tokens.insert(hash, expires_unix_ms);
        assert!(self.tokens.len() <= TOKENS_MAX, "tokens are bounded");
        CommandResult::Done
    }

    fn revoke_certificate(&mut self, serial: String, unix_ms: i64) -> CommandResult {
        if api::tls::normalize_serial(&serial).as_deref() != Some(serial.as_str()) {
            return failed(
                ErrorCode::InvalidArgument,
                format!("`{serial}` is not a certificate serial (hex digits)"),
            );
        }
        if self.revoked.contains_key(&serial) {
            return CommandResult::Revoked {
                newly: false,
                total: self.revoked.len() as u32,
            };
        }
        if self.revoked.len() >= REVOKED_MAX {
            return failed(
                ErrorCode::InvalidArgument,
                format!(
                    "{REVOKED_MAX} certificates are revoked already; replace the cluster CA (docs/security.md)"
                ),
            );
        }
        self.revoked.insert(serial, unix_ms);
        CommandResult::Revoked {
            newly: true,
            total: self.revoked.len() as u32,
        }
    }

    /// The expiry (unix ms) of the token with this SHA-256 (hex), if the pool knows it (an
    /// expired one stays until the next token is created).
    pub fn token_expiry(&self, hash: &str) -> Option<i64> {
        self.tokens.get(hash).copied()
    }

    /// Registers (or re-registers) a node; `key_sha256` is its node key's digest, `None` for an
    /// agent without a key. A name bound to another key, or bound at all for a keyless call,
    /// is refused and nothing changes. A keyed registration binds the name and gets the number
    /// `seq` (unique and growing across entries and within a batch).
    fn register_node(
        &mut self,
        index: u64,
        seq: u64,
        registration: Registration,
        unix_ms: i64,
    ) -> CommandResult {
        let Registration {
            spec,
            host,
            address,
            key_sha256,
            kubernetes_managed,
        } = registration;
        if let Err(message) = validate_node_spec(&spec) {
            return failed(ErrorCode::InvalidArgument, message);
        }
        if let Err(message) = validate_host_capacity(&spec.name, &host) {
            return failed(ErrorCode::InvalidArgument, message);
        }
        if let Some(key) = &key_sha256
            && !api::metadata::is_node_key(key)
        {
            return failed(
                ErrorCode::InvalidArgument,
                "a keyed registration carries the SHA-256 of its node key as 64 lowercase hex digits (a bug in the proposer)",
            );
        }
        let name = spec.name.clone();
        if let Some(bound) = self.node_keys.get(&name)
            && key_sha256.as_deref() != Some(bound.key_sha256.as_str())
        {
            return failed(ErrorCode::NodeNameTaken, name_taken_message(&name));
        }
        let event = if kubernetes_managed {
            Event::RegisterKubernetesNode { spec, host }
        } else {
            Event::RegisterNode { spec, host }
        };
        let Some(commands) = self.handle_guarded(event) else {
            return engine_failure();
        };
        debug_assert_eq!(
            self.engine.node(&name).map(|node| node.kubernetes_managed),
            Some(kubernetes_managed),
            "the engine keeps the kind registered"
        );
        debug_assert_eq!(
            self.engine.node_host(&name).map(|node| node.capacity),
            Some(host),
            "the engine keeps the host capacity registered"
        );
        let record = NodeRecord {
            address,
            registered_unix_ms: unix_ms,
            state_reason: "registered".to_owned(),
        };
        self.nodes.insert(name.clone(), record);
        self.node_revisions.insert(name.clone(), index);
        self.record(index, unix_ms, commands, None);
        let Some(key_sha256) = key_sha256 else {
            assert!(
                !self.node_keys.contains_key(&name),
                "a keyless name stays unbound"
            );
            return CommandResult::Done;
        };
        let previous = self.node_keys.insert(
            name,
            NodeKeyBinding {
                key_sha256,
                registration: seq,
            },
        );
        assert!(
            previous.is_none_or(|previous| previous.registration < seq),
            "registration numbers grow"
        );
        CommandResult::Registered { registration: seq }
    }

    /// The owner (its claim, `k8s:<namespace>/<claim>`) of tenant `tenant` when the agent of
    /// `node` may release it: the tenant is pinned to `node` (issue 18: the node's DRA driver
    /// releases its claims' tenants with the node's agent certificate). `Err` with the code and
    /// message of the refusal otherwise: an unknown tenant is `TenantNotFound` (a repeated
    /// release), any other tenant `PermissionDenied`.
    pub fn pinned_release_owner(
        &self,
        node: &str,
        tenant: &str,
    ) -> Result<String, (ErrorCode, String)> {
        let Some(record) = self.tenants.get(tenant) else {
            return Err((
                ErrorCode::TenantNotFound,
                format!("no tenant is named `{tenant}`; it may be released already"),
            ));
        };
        match self.engine.pin(tenant) {
            Some(pin) if pin.node == node => Ok(decode_request(&record.request).owner),
            _ => Err((
                ErrorCode::PermissionDenied,
                format!(
                    "tenant `{tenant}` is not pinned to node `{node}`; the agent certificate of a node releases only the tenants pinned there (its DRA driver's claims)"
                ),
            )),
        }
    }

    /// Whether a call for `node` that carries the node key digest `key_sha256` (and, for a
    /// heartbeat, names `registration`) may act for it: `Err` when the name is bound to another
    /// key (or the call has none), or to a later registration. A node that is not registered,
    /// or whose name is not bound (registered by an agent without a key), passes: the call's
    /// own answer says what to do then.
    pub fn check_node_claim(
        &self,
        node: &str,
        key_sha256: Option<&str>,
        registration: Option<u64>,
    ) -> Result<(), NameTaken> {
        let Some(bound) = self.node_keys.get(node) else {
            return Ok(());
        };
        debug_assert!(
            self.nodes.contains_key(node),
            "only registered names are bound"
        );
        if key_sha256 != Some(bound.key_sha256.as_str()) {
            return Err(NameTaken(name_taken_message(node)));
        }
        match registration {
            Some(registration) if registration != bound.registration => Err(NameTaken(format!(
                "node `{node}` was registered again (registration {}) after this agent's registration {registration}, with the same node key: another agent runs with this node's state directory or a copy of it; stop one of them, or give it its own state directory and name (`vgpu-agent join --state-dir ... --name ...`)",
                bound.registration
            ))),
            _ => Ok(()),
        }
    }

    fn remove_node(&mut self, index: u64, node: String, unix_ms: i64) -> CommandResult {
        if !self.nodes.contains_key(&node) {
            return failed(
                ErrorCode::NodeNotFound,
                format!("no node is named `{node}`; `vgpuctl get nodes` lists them"),
            );
        }
        let Some(commands) = self.handle_guarded(Event::RemoveNode(node.clone())) else {
            return engine_failure();
        };
        self.record(index, unix_ms, commands, None);
        self.nodes.remove(&node);
        // The name is free again: the next agent to register it binds it.
        self.node_keys.remove(&node);
        // A watch of the node sees its revision go to 0, then an empty set.
        self.node_revisions.remove(&node);
        assert!(self.engine.node(&node).is_none(), "a removed node is gone");
        assert!(
            self.tenants
                .values()
                .all(|tenant| tenant.slices.iter().all(|slice| slice.node != node)),
            "no tenant keeps a slice on a removed node"
        );
        CommandResult::Done
    }

    fn set_node_state(
        &mut self,
        index: u64,
        node: String,
        state: placement::NodeState,
        reason: String,
        unix_ms: i64,
    ) -> CommandResult {
        let Some(record) = self.nodes.get_mut(&node) else {
            return failed(
                ErrorCode::NodeNotFound,
                format!("no node is named `{node}`; `vgpuctl get nodes` lists them"),
            );
        };
        record.state_reason = reason;
        let commands = self.engine.handle(Event::SetNodeState {
            node: node.clone(),
            state,
        });
        self.node_revisions.insert(node, index);
        self.record(index, unix_ms, commands, None);
        CommandResult::Done
    }

    fn place(
        &mut self,
        index: u64,
        seq: u64,
        name: String,
        request_bytes: Vec<u8>,
        unix_ms: i64,
    ) -> CommandResult {
        if let Err(error) = api::names::validate("tenant", &name) {
            return failed(ErrorCode::InvalidArgument, error.to_string());
        }
        let request = match v1::PlacementRequest::decode(request_bytes.as_slice()) {
            Ok(request) => request,
            Err(error) => {
                return failed(
                    ErrorCode::InvalidArgument,
                    format!("unreadable request: {error}"),
                );
            }
        };
        if let Err(error) = api::validate::validate_request(&request) {
            return failed(ErrorCode::InvalidArgument, error.to_string());
        }
        if let Some(existing) = self.tenants.get(&name) {
            if existing.request == request_bytes {
                return CommandResult::Tenant(Box::new(existing.clone()));
            }
            return failed(
                ErrorCode::TenantExists,
                format!(
                    "tenant `{name}` exists with a different request; release it first (`vgpuctl release {name}`) or choose another name"
                ),
            );
        }
        let record = TenantRecord {
            name: name.clone(),
            request: request_bytes,
            state: TenantState::Pending,
            reason: String::new(),
            slices: Vec::new(),
            history: VecDeque::new(),
            created_unix_ms: unix_ms,
            revision: index,
        };
        self.tenants.insert(name.clone(), record);
        let engine_request = to_engine_request(&request);
        let constraints = constraints_of(&request);
        // A pin was admitted only with its bounds (`api::validate::admit_request`) and from the
        // node's agent; the engine decides whether the pool holds it.
        let event = if let Some(pin) = &request.pin {
            Event::SubmitPinned {
                tenant: name.clone(),
                request: engine_request,
                pin: pin_of(pin),
                seq,
            }
        } else if constraints == Constraints::default() {
            Event::Submit {
                tenant: name.clone(),
                request: engine_request,
                seq,
            }
        } else {
            Event::SubmitConstrained {
                tenant: name.clone(),
                request: engine_request,
                constraints,
                seq,
            }
        };
        let Some(commands) = self.handle_guarded(event) else {
            self.tenants.remove(&name);
            return engine_failure();
        };
        let rejection = self.record(index, unix_ms, commands, Some(&name));
        if let Some(reason) = rejection {
            return failed(ErrorCode::Unplaceable, reason);
        }
        let record = self
            .tenants
            .get(&name)
            .expect("a submitted tenant is either rejected or kept");
        CommandResult::Tenant(Box::new(record.clone()))
    }

    fn release(&mut self, index: u64, name: String, unix_ms: i64) -> CommandResult {
        if !self.tenants.contains_key(&name) {
            return failed(
                ErrorCode::TenantNotFound,
                format!("no tenant is named `{name}`; `vgpuctl get tenants` lists them"),
            );
        }
        let commands = self.engine.handle(Event::Release {
            tenant: name.clone(),
        });
        self.record(index, unix_ms, commands, None);
        assert!(
            !self.tenants.contains_key(&name),
            "a released tenant is removed"
        );
        CommandResult::Done
    }

    /// Changes tenant `change.name` in place; see `Command::SetTenant`. The engine decides
    /// whether a new share fits the GPUs the tenant holds (it is never moved); the request is
    /// rewritten with the new values, the change goes into the tenant's history, and the nodes
    /// it is on get a new revision, so their agents receive it. A change to the values the
    /// tenant has already is answered with the tenant and changes nothing.
    fn set_tenant(
        &mut self,
        index: u64,
        change: v1::SetTenantRequest,
        owner: Option<&str>,
        unix_ms: i64,
    ) -> CommandResult {
        let name = change.name.clone();
        let Some(record) = self.tenants.get(&name) else {
            return failed(
                ErrorCode::TenantNotFound,
                format!("no tenant is named `{name}`; `vgpuctl get tenants` lists them"),
            );
        };
        let mut request = decode_request(&record.request);
        if let Some(owner) = owner
            && request.owner != owner
        {
            return failed(
                ErrorCode::PermissionDenied,
                format!(
                    "tenant `{name}` belongs to another owner; a tenant certificate changes only its own owner's tenants"
                ),
            );
        }
        if let Err(error) = api::validate::validate_change(&change) {
            return failed(ErrorCode::InvalidArgument, error.to_string());
        }
        if change.latency_target_us.is_some_and(|target| target > 0) && !request.latency {
            return failed(
                ErrorCode::InvalidArgument,
                format!(
                    "tenant `{name}` is not a latency tenant, and a latency target applies only to one; place a tenant with `--latency` to give it a target"
                ),
            );
        }
        // Only what differs from what the tenant has is changed (and recorded).
        let compute_percent = change
            .compute_percent
            .filter(|&percent| percent != current_compute_percent(record, &request));
        let priority = change.priority.filter(|&p| p != request.priority);
        let latency_target_us = change
            .latency_target_us
            .filter(|&target| target != request.latency_target_us);
        let mut changes = Vec::new();
        if let Some(percent) = compute_percent {
            let now = current_compute_percent(record, &request);
            changes.push(format!("compute {now}% -> {percent}%"));
        }
        if let Some(priority) = priority {
            changes.push(format!("priority {} -> {priority}", request.priority));
        }
        if let Some(target) = latency_target_us {
            let text = |us: u64| match us {
                0 => "none".to_owned(),
                us => format!("{us}us"),
            };
            changes.push(format!(
                "latency target {} -> {}",
                text(request.latency_target_us),
                text(target)
            ));
        }
        if changes.is_empty() {
            return CommandResult::Tenant(Box::new(record.clone()));
        }
        if compute_percent.is_some() || priority.is_some() {
            let Some(commands) = self.handle_guarded(Event::Update {
                tenant: name.clone(),
                compute_percent,
                priority,
            }) else {
                return engine_failure();
            };
            if let Some(reason) = commands.iter().find_map(|command| match command {
                placement::Command::Refused { reason, .. } => Some(reason.clone()),
                _ => None,
            }) {
                assert_eq!(commands.len(), 1, "a refusal changes nothing");
                return failed(ErrorCode::Unplaceable, reason);
            }
            self.record(index, unix_ms, commands, None);
        }
        if let Some(percent) = compute_percent {
            request.compute_percent = percent;
        }
        if let Some(priority) = priority {
            request.priority = priority;
        }
        if let Some(target) = latency_target_us {
            request.latency_target_us = target;
        }
        assert!(
            api::validate::validate_request(&request).is_ok(),
            "a changed request stays valid"
        );
        let record = self
            .tenants
            .get_mut(&name)
            .expect("a changed tenant is kept");
        record.request = request.encode_to_vec();
        record.revision = index;
        let state = record.state;
        record.history.push_back(HistoryEvent {
            unix_ms,
            state,
            message: format!("changed: {}", changes.join(", ")),
        });
        while record.history.len() > TENANT_HISTORY_MAX {
            record.history.pop_front();
        }
        let nodes: BTreeSet<String> = record.slices.iter().map(|s| s.node.clone()).collect();
        for node in nodes {
            self.node_revisions.insert(node, index);
        }
        let record = self.tenants.get(&name).expect("a changed tenant is kept");
        assert_eq!(
            self.engine.slices(&name).unwrap_or_default(),
            record.slices.as_slice(),
            "the engine and the record agree on the tenant's slices"
        );
        CommandResult::Tenant(Box::new(record.clone()))
    }

    /// Runs the engine on one event. A panic inside the engine is a bug, but letting it unwind
    /// would stop every replica at the same log entry, and again at every restart (a poison
    /// entry). So it is caught and the command fails; every replica catches it at the same point
    /// and stays identical.
    fn handle_guarded(&mut self, event: Event) -> Option<Vec<placement::Command>> {
        let engine = &mut self.engine;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.handle(event))) {
            Ok(commands) => Some(commands),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(%message, "the placement engine panicked; the command was refused (this is a bug)");
                None
            }
        }
    }

    /// Applies the engine's decisions to the tenant records. Returns the rejection reason of
    /// `submitted`, if the engine rejected it.
    fn record(
        &mut self,
        index: u64,
        unix_ms: i64,
        commands: Vec<placement::Command>,
        submitted: Option<&str>,
    ) -> Option<String> {
        let mut rejection = None;
        let mut touched: BTreeSet<String> = BTreeSet::new();
        for command in commands {
            match command {
                placement::Command::Bind { tenant, slices } => {
                    self.counters.placements += 1;
                    let record = self
                        .tenants
                        .get_mut(&tenant)
                        .expect("engine binds known tenants");
                    touched.extend(record.slices.iter().map(|s| s.node.clone()));
                    touched.extend(slices.iter().map(|s| s.node.clone()));
                    let mut message = format!("placed on {}", describe_slices(&slices));
                    if let Some(note) = borrow_note_of(&record.request) {
                        message = format!("{message}; {note}");
                    }
                    record.slices = slices;
                    transition(
                        record,
                        index,
                        unix_ms,
                        TenantState::Placed,
                        String::new(),
                        message,
                    );
                }
                placement::Command::Pending { tenant, reason } => {
                    let record = self
                        .tenants
                        .get_mut(&tenant)
                        .expect("engine queues known tenants");
                    let state = if record.state == TenantState::Preempted {
                        TenantState::Preempted
                    } else {
                        TenantState::Pending
                    };
                    let reason = match borrow_note_of(&record.request) {
                        Some(note) => format!("{reason} ({note})"),
                        None => reason,
                    };
                    let message = format!("pending: {reason}");
                    transition(record, index, unix_ms, state, reason, message);
                }
                placement::Command::Preempted { tenant, by, reason } => {
                    self.counters.preemptions += 1;
                    let record = self
                        .tenants
                        .get_mut(&tenant)
                        .expect("engine preempts known tenants");
                    touched.extend(record.slices.drain(..).map(|s| s.node));
                    let message = format!("preempted by {by}: {reason}");
                    transition(
                        record,
                        index,
                        unix_ms,
                        TenantState::Preempted,
                        reason,
                        message,
                    );
                }
                placement::Command::Unbound { tenant, reason } => {
                    let record = self
                        .tenants
                        .get_mut(&tenant)
                        .expect("engine unbinds known tenants");
                    touched.extend(record.slices.drain(..).map(|s| s.node));
                    let message = format!("unbound: {reason}");
                    transition(
                        record,
                        index,
                        unix_ms,
                        TenantState::Pending,
                        reason,
                        message,
                    );
                }
                placement::Command::Reject { tenant, reason } => {
                    self.counters.rejections += 1;
                    let record = self
                        .tenants
                        .remove(&tenant)
                        .expect("engine rejects known tenants");
                    assert!(record.slices.is_empty(), "a rejected tenant holds nothing");
                    if submitted == Some(tenant.as_str()) {
                        rejection = Some(reason);
                    }
                }
                placement::Command::Released { tenant } => {
                    self.counters.releases += 1;
                    if let Some(record) = self.tenants.remove(&tenant) {
                        touched.extend(record.slices.into_iter().map(|s| s.node));
                    }
                }
                placement::Command::Updated { tenant, slices } => {
                    let record = self
                        .tenants
                        .get_mut(&tenant)
                        .expect("engine changes known tenants");
                    assert_eq!(
                        record.slices.len(),
                        slices.len(),
                        "a changed tenant keeps its GPUs"
                    );
                    touched.extend(slices.iter().map(|s| s.node.clone()));
                    record.slices = slices;
                    record.revision = index;
                }
                placement::Command::Refused { tenant, reason } => {
                    unreachable!("the caller handles a refused change of {tenant}: {reason}")
                }
            }
        }
        for node in touched {
            self.node_revisions.insert(node, index);
        }
        rejection
    }

    /// The slices of every tenant placed on `node`, with the node's revision.
    pub fn assignments(&self, node: &str) -> (u64, Vec<v1::Assignment>) {
        let revision = self.node_revisions.get(node).copied().unwrap_or(0);
        let mut assignments = Vec::new();
        for record in self.tenants.values() {
            if !record.slices.iter().any(|s| s.node == node) {
                continue;
            }
            let request = decode_request(&record.request);
            let slices: Vec<v1::Slice> = record
                .slices
                .iter()
                .filter(|s| s.node == node)
                .map(|slice| self.slice_of(slice, &request))
                .collect();
            assignments.push(v1::Assignment {
                tenant: record.name.clone(),
                slices,
                priority: request.priority,
                bandwidth_weight: request.bandwidth_weight,
                latency: request.latency,
                latency_target_us: request.latency_target_us,
            });
        }
        (revision, assignments)
    }

    /// A slice as the API shows it, with the tenant's memory limit on its GPU
    /// (`placement::memory::slice_limit`: capped at the GPU's memory, never below the request).
    fn slice_of(&self, slice: &SliceAssignment, request: &v1::PlacementRequest) -> v1::Slice {
        let gpu_memory_bytes = self
            .engine
            .node(&slice.node)
            .and_then(|view| {
                view.spec
                    .gpus
                    .iter()
                    .find(|gpu| gpu.uuid == slice.gpu_uuid)
                    .map(|gpu| gpu.memory_bytes)
            })
            .unwrap_or(u64::MAX);
        v1::Slice {
            memory_limit_bytes: placement::memory::slice_limit(
                slice.memory_bytes,
                request.memory_limit_bytes_per_gpu,
                gpu_memory_bytes,
            ),
            ..slice_to_proto(slice)
        }
    }

    /// The largest GPU memory of the registered nodes; 0 when none has a GPU. Admission
    /// (`Service::place`) refuses a memory limit past it; `apply` does not, so that members of
    /// versions that do not know limits apply the same entries the same way.
    pub fn largest_gpu_memory_bytes(&self) -> u64 {
        self.engine
            .nodes()
            .iter()
            .flat_map(|view| view.spec.gpus.iter().map(|gpu| gpu.memory_bytes))
            .max()
            .unwrap_or(0)
    }

    pub fn tenant_to_proto(&self, record: &TenantRecord) -> v1::Tenant {
        let request = decode_request(&record.request);
        let slices = record
            .slices
            .iter()
            .map(|slice| self.slice_of(slice, &request))
            .collect();
        v1::Tenant {
            name: record.name.clone(),
            owner: request.owner.clone(),
            request: Some(request),
            state: tenant_state_to_proto(record.state) as i32,
            reason: record.reason.clone(),
            slices,
            history: record
                .history
                .iter()
                .map(|event| v1::TenantEvent {
                    unix_ms: event.unix_ms,
                    state: tenant_state_to_proto(event.state) as i32,
                    message: event.message.clone(),
                })
                .collect(),
            created_unix_ms: record.created_unix_ms,
            revision: record.revision,
            // Filled in by `GetTenant` from the leader's reports (`usage`).
            usage: Vec::new(),
        }
    }

    /// The node as the API shows it; `last_heartbeat_unix_ms` is filled in by the caller.
    pub fn node_to_proto(&self, name: &str) -> Option<v1::Node> {
        let view = self.engine.node(name)?;
        let record = self.nodes.get(name)?;
        let gpus = view
            .spec
            .gpus
            .iter()
            .zip(view.usage.iter())
            .map(|(gpu, usage)| v1::Gpu {
                uuid: gpu.uuid.clone(),
                index: gpu.index,
                model: gpu.model.clone(),
                memory_bytes: gpu.memory_bytes,
                sm_count: gpu.sm_count,
                nvlink_peers: gpu
                    .nvlink_peers
                    .iter()
                    .map(|(&gpu_index, &link_count)| v1::NvlinkPeer {
                        gpu_index,
                        link_count,
                    })
                    .collect(),
                numa_node: gpu.numa_node,
                pci_bus_id: gpu.pci_bus_id.clone(),
                nearest_nics: gpu.nearest_nics.clone(),
                compute_allocated_percent: usage.compute_allocated_percent,
                memory_allocated_bytes: usage.memory_allocated_bytes,
                tenants: usage.tenants.clone(),
                node: name.to_owned(),
                // Filled in by the reads from the leader's reports (`usage`).
                health: None,
            })
            .collect();
        let host = self.engine.node_host(name).unwrap_or_default();
        Some(v1::Node {
            name: name.to_owned(),
            address: record.address.clone(),
            labels: view.spec.labels.clone().into_iter().collect(),
            state: node_state_to_proto(view.state) as i32,
            last_heartbeat_unix_ms: 0,
            gpus,
            cpu_milli: host.capacity.cpu_milli.unwrap_or(0),
            host_memory_bytes: host.capacity.memory_bytes.unwrap_or(0),
            cpu_milli_allocated: host.cpu_milli_used,
            host_memory_allocated_bytes: host.memory_bytes_used,
            kubernetes_managed: view.kubernetes_managed,
        })
    }
}

fn transition(
    record: &mut TenantRecord,
    index: u64,
    unix_ms: i64,
    state: TenantState,
    reason: String,
    message: String,
) {
    let unchanged = record.state == state && record.reason == reason && !record.history.is_empty();
    record.state = state;
    record.reason = reason;
    record.revision = index;
    if unchanged && state != TenantState::Placed {
        return;
    }
    record.history.push_back(HistoryEvent {
        unix_ms,
        state,
        message,
    });
    while record.history.len() > TENANT_HISTORY_MAX {
        record.history.pop_front();
    }
}

/// The compute share `record` holds per GPU now: its slices' when placed, else what its request
/// asks for (0 there: the fraction's share, or 100 for whole GPUs).
fn current_compute_percent(record: &TenantRecord, request: &v1::PlacementRequest) -> u32 {
    if let Some(slice) = record.slices.first() {
        return slice.compute_percent;
    }
    match request.compute_percent {
        0 if request.milli_gpus > 0 => request.milli_gpus.div_ceil(10),
        0 => 100,
        percent => percent,
    }
}

/// The sentence about borrowed memory for a stored request whose limit passes its request.
fn borrow_note_of(request_bytes: &[u8]) -> Option<String> {
    let request = decode_request(request_bytes);
    placement::memory::borrow_note(
        request.memory_bytes_per_gpu,
        request.memory_limit_bytes_per_gpu,
    )
}

fn describe_slices(slices: &[SliceAssignment]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for slice in slices.iter().take(8) {
        parts.push(format!(
            "{} GPU {} ({}%, {})",
            slice.node,
            slice.gpu_index,
            slice.compute_percent,
            api::size::format_bytes(slice.memory_bytes)
        ));
    }
    if slices.len() > 8 {
        parts.push(format!("and {} more", slices.len() - 8));
    }
    parts.join(", ")
}

pub fn decode_request(bytes: &[u8]) -> v1::PlacementRequest {
    v1::PlacementRequest::decode(bytes)
        .expect("stored requests were validated before they were stored")
}

/// Maps a validated API request onto the engine's request.
pub fn to_engine_request(request: &v1::PlacementRequest) -> placement::Request {
    let gpus = if request.whole_gpus > 0 {
        placement::GpuCount::Whole(request.whole_gpus)
    } else {
        placement::GpuCount::Milli(request.milli_gpus)
    };
    let nvlink = match v1::NvlinkPolicy::try_from(request.nvlink).unwrap_or_default() {
        v1::NvlinkPolicy::Unspecified | v1::NvlinkPolicy::Prefer => placement::NvlinkPolicy::Prefer,
        v1::NvlinkPolicy::Require => placement::NvlinkPolicy::Require,
        v1::NvlinkPolicy::Ignore => placement::NvlinkPolicy::Ignore,
    };
    placement::Request {
        gpus,
        nodes: request.nodes.max(1),
        memory_bytes_per_gpu: (request.memory_bytes_per_gpu > 0)
            .then_some(request.memory_bytes_per_gpu),
        compute_percent: (request.compute_percent > 0).then_some(request.compute_percent),
        burst: request.burst,
        priority: request.priority,
        preemptible: request.preemptible,
        nvlink,
        node_selector: request.node_selector.clone().into_iter().collect(),
    }
}

/// The whole-node constraints of a validated API request (issue 19): 0 and an empty list ask
/// nothing.
pub fn constraints_of(request: &v1::PlacementRequest) -> Constraints {
    Constraints {
        cpu_milli: request.cpu_milli,
        host_memory_bytes: request.host_memory_bytes,
        gpu_models: request.gpu_models.iter().cloned().collect(),
    }
}

/// The engine's pin of an API pin.
pub fn pin_of(pin: &v1::Pin) -> placement::Pin {
    placement::Pin {
        node: pin.node.clone(),
        gpus: pin
            .gpus
            .iter()
            .map(|gpu| placement::PinnedGpu {
                uuid: gpu.uuid.clone(),
                compute_percent: gpu.compute_percent,
                memory_bytes: gpu.memory_bytes,
            })
            .collect(),
    }
}

/// A node's host capacity as its agent registers it: 0 is not reported (unbounded).
pub fn host_capacity_from_proto(node: &v1::Node) -> HostCapacity {
    HostCapacity {
        cpu_milli: (node.cpu_milli > 0).then_some(node.cpu_milli),
        memory_bytes: (node.host_memory_bytes > 0).then_some(node.host_memory_bytes),
    }
}

/// Checks a registering node's host capacity: a reported amount is within the admission bounds
/// (`api::validate::CPU_MILLI_MAX`, `HOST_MEMORY_BYTES_MAX`) and not zero. Checked in apply too
/// (like [`validate_node_spec`]), since `RegisterHostNode` exists only in this version: its rule
/// is this one from the start.
pub fn validate_host_capacity(node: &str, host: &HostCapacity) -> Result<(), String> {
    if let Some(cpu_milli) = host.cpu_milli
        && !(1..=api::validate::CPU_MILLI_MAX).contains(&cpu_milli)
    {
        return Err(format!(
            "node `{node}` reports {cpu_milli} millicores of CPU; give between 1 and {}",
            api::validate::CPU_MILLI_MAX
        ));
    }
    if let Some(memory_bytes) = host.memory_bytes
        && !(1..=api::validate::HOST_MEMORY_BYTES_MAX).contains(&memory_bytes)
    {
        return Err(format!(
            "node `{node}` reports {memory_bytes} bytes of host memory; give between 1 and {}",
            api::validate::HOST_MEMORY_BYTES_MAX
        ));
    }
    Ok(())
}

/// What a registration entry carries, whichever of its variants.
struct Registration {
    spec: NodeSpec,
    host: HostCapacity,
    address: String,
    key_sha256: Option<String>,
    kubernetes_managed: bool,
}

/// Checks a registering node's inventory; the message says what is wrong.
pub fn validate_node_spec(spec: &NodeSpec) -> Result<(), String> {
    api::names::validate("node", &spec.name).map_err(|e| e.to_string())?;
    if spec.gpus.is_empty() {
        return Err(format!(
            "node `{}` reports no GPUs; a node needs at least one",
            spec.name
        ));
    }
    if spec.gpus.len() > NODE_GPUS_MAX {
        return Err(format!(
            "node `{}` reports {} GPUs; the limit is {NODE_GPUS_MAX}",
            spec.name,
            spec.gpus.len()
        ));
    }
    let mut indexes = BTreeSet::new();
    let mut uuids = BTreeSet::new();
    for gpu in &spec.gpus {
        if !indexes.insert(gpu.index) {
            return Err(format!(
                "node `{}` reports GPU index {} twice",
                spec.name, gpu.index
            ));
        }
        if gpu.uuid.is_empty() || !uuids.insert(gpu.uuid.clone()) {
            return Err(format!(
                "node `{}` reports an empty or repeated GPU uuid `{}`",
                spec.name, gpu.uuid
            ));
        }
        if gpu.memory_bytes == 0 {
            return Err(format!(
                "node `{}` reports GPU {} with no memory",
                spec.name, gpu.index
            ));
        }
        if gpu.memory_bytes > api::validate::GPU_MEMORY_BYTES_MAX {
            return Err(format!(
                "node `{}` reports GPU {} with {} bytes of memory; the limit is {} ({})",
                spec.name,
                gpu.index,
                gpu.memory_bytes,
                api::validate::GPU_MEMORY_BYTES_MAX,
                api::size::format_bytes(api::validate::GPU_MEMORY_BYTES_MAX)
            ));
        }
    }
    for gpu in &spec.gpus {
        if let Some(peer) = gpu
            .nvlink_peers
            .keys()
            .find(|peer| !indexes.contains(peer) || **peer == gpu.index)
        {
            return Err(format!(
                "node `{}`: GPU {} lists NVLink peer {peer}, which is not another GPU of the node",
                spec.name, gpu.index
            ));
        }
    }
    Ok(())
}

pub fn slice_to_proto(slice: &SliceAssignment) -> v1::Slice {
    v1::Slice {
        node: slice.node.clone(),
        gpu: slice.gpu_uuid.clone(),
        gpu_index: slice.gpu_index,
        compute_percent: slice.compute_percent,
        memory_bytes: slice.memory_bytes,
        guaranteed: slice.guaranteed,
        burst: slice.burst,
        memory_limit_bytes: slice.memory_bytes,
    }
}

pub fn tenant_state_to_proto(state: TenantState) -> v1::TenantState {
    match state {
        TenantState::Pending => v1::TenantState::Pending,
        TenantState::Placed => v1::TenantState::Placed,
        TenantState::Preempted => v1::TenantState::Preempted,
    }
}

pub fn node_state_to_proto(state: placement::NodeState) -> v1::NodeState {
    match state {
        placement::NodeState::Ready => v1::NodeState::Ready,
        placement::NodeState::Lost => v1::NodeState::Lost,
        placement::NodeState::Draining => v1::NodeState::Draining,
    }
}

/// Converts a node as an agent registers it into the engine's inventory.
pub fn node_spec_from_proto(node: &v1::Node) -> NodeSpec {
    NodeSpec {
        name: node.name.clone(),
        labels: node.labels.clone().into_iter().collect(),
        gpus: node
            .gpus
            .iter()
            .map(|gpu| placement::GpuSpec {
                uuid: gpu.uuid.clone(),
                index: gpu.index,
                model: gpu.model.clone(),
                memory_bytes: gpu.memory_bytes,
                sm_count: gpu.sm_count,
                nvlink_peers: gpu
                    .nvlink_peers
                    .iter()
                    .map(|p| (p.gpu_index, p.link_count))
                    .collect(),
                numa_node: gpu.numa_node,
                pci_bus_id: gpu.pci_bus_id.clone(),
                nearest_nics: gpu.nearest_nics.clone(),
            })
            .collect(),
    }
}

#[cfg(test)]
#[path = "pool_test.rs"]
mod tests;

#[cfg(test)]
#[path = "pool_host_test.rs"]
mod host_tests;
