//! Issue 22, the agent's side: `join` against a fake control plane over real gRPC on localhost,
//! broken the ways a busy node, an unlucky operator and a second agent with the same name break
//! it. Progress is asserted by waiting for it (a watch channel, or the files), with a finite
//! deadline; nothing waits a fixed time to let something happen.
//!
//! * Heartbeats go on while the application of an assignment set is blocked in a file write.
//! * A restart with a damaged `assignments.json` keeps the tenants' private directories until the
//!   control plane's set arrives.
//! * A second agent with the node's name but another node key is refused and stops; an agent
//!   whose name another registration took stops too, and says why.
//!
//! The fake binds the node's name to the first node key that registers it, as the control plane
//! is to (issue 22, point 5): a registration with another key is refused, every accepted one gets
//! a new number, and a beat or stream with another key or an older number is refused.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::v1::agent_server::{Agent, AgentServer};
use api::v1::{
    Assignment, Assignments, HeartbeatRequest, HeartbeatResponse, NodeState, RegisterRequest,
    RegisterResponse, Slice, WatchAssignmentsRequest,
};
use futures::Stream;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Request, Response, Status};
use vgpu_agent::{InventorySource, JoinConfig, Timings};

const DEADLINE: Duration = Duration::from_secs(20);
const NODE: &str = "node-a";

/// The error code of a call for a node whose name another registration holds.
const NAME_TAKEN: &str = "[VGPU-NODE-NAME-TAKEN]";

#[derive(Default)]
struct FakeState {
    registrations: Vec<RegisterRequest>,
    /// The node key the name is bound to, and the number of the newest registration.
    binding: Option<(String, u64)>,
    /// Registrations accepted so far; the next one gets this plus one.
    registered: u64,
    /// The node key and registration of every beat.
    beats: Vec<(String, u64)>,
    /// Answer the next beat `known = false` and forget the binding (an admin removed the node).
    forget_once: bool,
    current: Assignments,
    /// Open streams get nothing until [`FakeControlPlane::publish`] (a slow control plane).
    silent: bool,
    watchers: Vec<mpsc::UnboundedSender<Result<Assignments, Status>>>,
}

/// A control plane that accepts every registration, answers every beat and streams
/// [`FakeState::current`].
#[derive(Clone)]
struct FakeControlPlane {
    state: Arc<Mutex<FakeState>>,
    /// How many heartbeats arrived.
    heartbeats: Arc<watch::Sender<u64>>,
}

impl FakeControlPlane {
    fn new() -> FakeControlPlane {
        FakeControlPlane {
            state: Arc::default(),
            heartbeats: Arc::new(watch::Sender::new(0)),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }

    fn publish(&self, assignments: Assignments) {
        self.with(|state| {
            state.current = assignments.clone();
            state.silent = false;
            state
                .watchers
                .retain(|watcher| watcher.send(Ok(assignments.clone())).is_ok());
        });
    }

    /// What an admin's removal followed by another agent's registration leaves: the name bound
    /// to `key` under a new registration.
    fn take_over(&self, key: &str) {
        self.with(|state| {
            state.registered += 1;
            state.binding = Some((key.to_owned(), state.registered));
        });
    }

    fn heartbeats(&self) -> u64 {
        *self.heartbeats.borrow()
    }

    /// Waits until `count` heartbeats arrived in all.
    async fn wait_for_heartbeats(&self, count: u64, what: &str) {
        let mut receiver = self.heartbeats.subscribe();
        tokio::time::timeout(DEADLINE, receiver.wait_for(|seen| *seen >= count))
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .expect("the fake lives");
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<Assignments, Status>> + Send>>;

/// A request's metadata entry `name`, or "" without one.
fn metadata<T>(request: &Request<T>, name: &str) -> String {
    request
        .metadata()
        .get(name)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn taken(held_by: u64) -> Status {
    Status::failed_precondition(format!(
        "{NAME_TAKEN} node `{NODE}` is registered by another node key (registration {held_by})"
    ))
}

#[tonic::async_trait]
impl Agent for FakeControlPlane {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let key = metadata(&request, "vgpu-node-key");
        assert_eq!(key.len(), 64, "every registration carries the node key");
        let registration = self.with(|state| {
            if let Some((bound, held_by)) = &state.binding
                && *bound != key
            {
                return Err(taken(*held_by));
            }
            state.registered += 1;
            state.binding = Some((key, state.registered));
            state.registrations.push(request.into_inner());
            Ok(state.registered)
        })?;
        let mut response = Response::new(RegisterResponse {
            heartbeat_interval_ms: 50,
        });
        response
            .metadata_mut()
            .insert("vgpu-registration", registration.into());
        Ok(response)
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let key = metadata(&request, "vgpu-node-key");
        let registration: u64 = metadata(&request, "vgpu-registration").parse().unwrap();
        let known = self.with(|state| {
            state.beats.push((key.clone(), registration));
            if std::mem::take(&mut state.forget_once) {
                state.binding = None;
                return Ok(false);
            }
            match &state.binding {
                Some((bound, held_by)) if *bound != key || *held_by != registration => {
                    Err(taken(*held_by))
                }
                Some(_) => Ok(true),
                None => Ok(false),
            }
        })?;
        self.heartbeats.send_modify(|count| *count += 1);
        Ok(Response::new(HeartbeatResponse {
            known,
            report_wanted: false,
        }))
    }

    async fn join_node(
        &self,
        _: Request<api::v1::JoinNodeRequest>,
    ) -> Result<Response<api::v1::JoinNodeResponse>, Status> {
        Err(Status::unimplemented(
            "the fake serves --insecure agents only",
        ))
    }

    type WatchAssignmentsStream = AssignmentStream;

    async fn watch_assignments(
        &self,
        request: Request<WatchAssignmentsRequest>,
    ) -> Result<Response<AssignmentStream>, Status> {
        let key = metadata(&request, "vgpu-node-key");
        let (sender, receiver) = mpsc::unbounded_channel();
        self.with(|state| {
            if let Some((bound, held_by)) = &state.binding
                && *bound != key
            {
                return Err(taken(*held_by));
            }
            if !state.silent {
                sender.send(Ok(state.current.clone())).unwrap();
            }
            state.watchers.push(sender);
            Ok(())
        })?;
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Serves `service` on a free localhost port; returns its address.
async fn serve<S: Agent>(service: S) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let incoming = futures::stream::unfold(listener, |listener| async move {
        Some((listener.accept().await.map(|(stream, _)| stream), listener))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(service))
            .serve_with_incoming(incoming),
    );
    address
}

/// An agent running `join` on a runtime and thread of its own, so that an agent that blocks its
/// thread shows as missing heartbeats at the fake, which runs on the test's runtime.
struct RunningAgent {
    stop: oneshot::Sender<()>,
    result: oneshot::Receiver<vgpu_agent::Result<()>>,
}

impl RunningAgent {
    /// How the agent ended by itself.
    async fn ended(self) -> vgpu_agent::Result<()> {
        ended(self.result).await
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        ended(self.result)
            .await
            .expect("a stopped agent returns Ok");
    }
}

async fn ended(result: oneshot::Receiver<vgpu_agent::Result<()>>) -> vgpu_agent::Result<()> {
    tokio::time::timeout(DEADLINE, result)
        .await
        .expect("the agent ends")
        .expect("the agent's thread reports")
}

fn config(control_plane: String, state_dir: &Path) -> JoinConfig {
    JoinConfig {
        control_plane: vec![control_plane],
        name: NODE.into(),
        source: InventorySource::from_simulate_arg("4xH100-80GB").unwrap(),
        state_dir: state_dir.to_owned(),
        labels: Default::default(),
        address: "127.0.0.1:7500".into(),
        timings: Timings {
            retry_initial: Duration::from_millis(20),
            retry_max: Duration::from_millis(200),
            call_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_millis(500),
        },
        shm_dir: shm_dir(state_dir),
        nic_bytes_per_second: 12_500_000_000,
        host_reserve: Default::default(),
        swap_host_memory: None,
        shared_staging: false,
        cdi: None,
        kubernetes_managed: false,
        mps: None,
        security: vgpu_agent::bootstrap::Security {
            insecure: true,
            files: vgpu_agent::bootstrap::Security::default_files(state_dir),
            token: None,
            ca_cert_hash: None,
        },
    }
}

fn start(control_plane: String, state_dir: &Path) -> RunningAgent {
    start_with(config(control_plane, state_dir))
}

fn start_with(config: JoinConfig) -> RunningAgent {
    let (stop, stopped) = oneshot::channel::<()>();
    let (report, result) = oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ended = runtime.block_on(vgpu_agent::join(config, async move {
            let _ = stopped.await;
        }));
        let _ = report.send(ended);
    });
    RunningAgent { stop, result }
}

fn shm_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("shm")
}

/// Waits for a condition on files, checking it every few milliseconds until the deadline.
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn assignments(revision: u64, tenants: &[(&str, u32)]) -> Assignments {
    Assignments {
        revision,
        node_state: NodeState::Ready as i32,
        assignments: tenants
            .iter()
            .map(|&(tenant, gpu_index)| Assignment {
                tenant: tenant.into(),
                priority: 0,
                bandwidth_weight: 0,
                latency: false,
                latency_target_us: 0,
                slices: vec![Slice {
                    node: NODE.into(),
                    gpu: format!("GPU-{gpu_index}"),
                    gpu_index,
                    compute_percent: 25,
                    memory_bytes: 20 << 30,
                    guaranteed: true,
                    burst: false,
                    memory_limit_bytes: 0,
                }],
            })
            .collect(),
    }
}

fn persisted_revision(state_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(state_dir.join("assignments.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["revision"].as_u64()
}

fn private_dir(state_dir: &Path, tenant: &str) -> PathBuf {
    shm_dir(state_dir).join("tenants").join(tenant)
}

/// Point 3 of issue 22: the agent's heartbeats and its assignment handling shared one task, and
/// each update wrote files synchronously, so a node under churn went silent and was declared
/// lost. Here one tenant file's write blocks for good (its temporary path is a FIFO nobody
/// reads, so opening it for writing does not return), and heartbeats must go on meanwhile.
#[tokio::test]
async fn heartbeats_go_on_while_a_state_write_is_blocked() {
    let fake = FakeControlPlane::new();
    fake.publish(assignments(1, &[("infer-a", 0)]));
    let address = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let state_dir = directory.path().join("state");
    let agent = start(address, &state_dir);
    wait_until("revision 1 on disk", || {
        persisted_revision(&state_dir) == Some(1)
    })
    .await;

    // The next write of `infer-b`'s tenant file blocks in `open` until the FIFO has a reader.
    let fifo = state_dir.join("tenants/.infer-b.json.tmp");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    fake.publish(assignments(2, &[("infer-a", 0), ("infer-b", 1)]));
    // The private directory comes first, the tenant file next: once the directory is there,
    // the write is blocked (or about to be).
    wait_until("infer-b's private directory", || {
        private_dir(&state_dir, "infer-b")
            .join("nccl-activity")
            .exists()
    })
    .await;
    let before = fake.heartbeats();
    fake.wait_for_heartbeats(before + 5, "five heartbeats while the write is blocked")
        .await;
    assert_eq!(
        persisted_revision(&state_dir),
        Some(1),
        "the write was blocked all along"
    );

    // Unblock it: the reader lets `open` return; the name goes so the retry writes a real file.
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    std::fs::remove_file(&fifo).unwrap();
    wait_until("revision 2 on disk", || {
        persisted_revision(&state_dir) == Some(2)
    })
    .await;
    assert!(state_dir.join("tenants/infer-b.json").is_file());
    drop(reader);
    agent.stop().await;
}

/// Issue 22: an agent restarted with a truncated `assignments.json` deleted its tenants' private
/// directories (their ledgers and schedule links) before the control plane's set recreated them
/// empty. Now the file is moved aside and every directory stays until that set arrives; then only
/// the directories of tenants no longer placed here go.
#[tokio::test]
async fn a_truncated_assignments_file_keeps_the_tenants_directories() {
    let fake = FakeControlPlane::new();
    fake.publish(assignments(4, &[("stays", 0), ("leaves", 1)]));
    let address = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let state_dir = directory.path().join("state");
    let agent = start(address.clone(), &state_dir);
    wait_until("revision 4 on disk", || {
        persisted_revision(&state_dir) == Some(4)
    })
    .await;
    wait_until("both private directories", || {
        ["stays", "leaves"].iter().all(|tenant| {
            private_dir(&state_dir, tenant)
                .join("nccl-activity")
                .exists()
        })
    })
    .await;
    agent.stop().await;
    // What the tenants' processes keep there (the memory ledger's place, here a marker).
    for tenant in ["stays", "leaves"] {
        std::fs::write(
            private_dir(&state_dir, tenant).join(format!("{tenant}.mem")),
            tenant,
        )
        .unwrap();
    }
    let file = state_dir.join("assignments.json");
    let text = std::fs::read(&file).unwrap();
    std::fs::write(&file, &text[..text.len() / 3]).unwrap();

    // The control plane is slow to send its set; the agent registers and waits for it.
    fake.with(|state| state.silent = true);
    let registrations = fake.with(|state| state.registrations.len());
    let agent = start(address, &state_dir);
    wait_until("the registration after the restart", || {
        fake.with(|state| state.registrations.len() > registrations)
    })
    .await;
    // The registration comes after the private directories were dealt with at start.
    for tenant in ["stays", "leaves"] {
        let ledger = private_dir(&state_dir, tenant).join(format!("{tenant}.mem"));
        assert_eq!(
            std::fs::read_to_string(&ledger).ok().as_deref(),
            Some(tenant),
            "{tenant}'s private directory is kept while the set is unknown"
        );
    }
    assert_eq!(
        std::fs::read(state_dir.join("assignments.json.damaged")).unwrap(),
        &text[..text.len() / 3],
        "the damaged file is kept aside as it was"
    );

    fake.publish(assignments(5, &[("stays", 0)]));
    wait_until("revision 5 on disk", || {
        persisted_revision(&state_dir) == Some(5)
    })
    .await;
    wait_until("the directory of the tenant that left to go", || {
        !private_dir(&state_dir, "leaves").exists()
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(private_dir(&state_dir, "stays").join("stays.mem")).unwrap(),
        "stays",
        "the placed tenant's ledger survived the restart"
    );
    assert!(state_dir.join("tenants/stays.json").is_file());
    assert!(!state_dir.join("tenants/leaves.json").exists());
    agent.stop().await;
}

fn node_key(state_dir: &Path) -> String {
    std::fs::read_to_string(state_dir.join("node-key"))
        .unwrap()
        .trim()
        .to_owned()
}

/// Issue 22, point 5: a bootstrap token, or a cloned machine with the same host name, took over a
/// live node's name, and the real agent kept heartbeating without noticing. Now the name is
/// bound to the node key of the agent that registered it first: another key is refused and that
/// agent stops with the reason; a restart of the real agent keeps its key and its name; an admin's
/// removal makes the agent register again under a new number; and when another agent holds the
/// name after all, the real one stops and says so.
#[tokio::test]
async fn a_node_name_belongs_to_the_agent_that_registered_it_first() {
    let fake = FakeControlPlane::new();
    fake.publish(assignments(1, &[("infer-a", 0)]));
    let address = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let real_dir = directory.path().join("real");
    let real = start(address.clone(), &real_dir);
    fake.wait_for_heartbeats(2, "the real agent's first beats")
        .await;
    let real_key = node_key(&real_dir);
    assert_eq!(
        fake.with(|state| state.beats.last().cloned()),
        Some((real_key.clone(), 1)),
        "beats carry the node key and the registration's number"
    );

    // A second agent with the same name and its own state directory: refused, and it stops.
    let intruder_dir = directory.path().join("intruder");
    let error = start(address.clone(), &intruder_dir)
        .ended()
        .await
        .unwrap_err()
        .to_string();
    assert_ne!(node_key(&intruder_dir), real_key);
    assert!(
        error.contains("node `node-a` is no longer this agent's")
            && error.contains(NAME_TAKEN)
            && error.contains("vgpuctl node remove node-a"),
        "{error}"
    );
    let beats = fake.heartbeats();
    fake.wait_for_heartbeats(beats + 2, "the real agent beating on")
        .await;
    assert_eq!(
        fake.with(|state| state.registrations.len()),
        1,
        "the intruder's inventory never replaced the node's"
    );

    // The real agent restarts: the same key, so the same node, under a new number.
    real.stop().await;
    let real = start(address.clone(), &real_dir);
    let beats = fake.heartbeats();
    fake.wait_for_heartbeats(beats + 2, "beats after the restart")
        .await;
    assert_eq!(node_key(&real_dir), real_key);
    assert_eq!(
        fake.with(|state| state.beats.last().cloned()),
        Some((real_key.clone(), 2))
    );

    // An admin removes the node: the agent registers it again, under a new number.
    fake.with(|state| state.forget_once = true);
    let beats = fake.heartbeats();
    fake.wait_for_heartbeats(beats + 3, "beats after the removal")
        .await;
    assert_eq!(
        fake.with(|state| state.beats.last().cloned()),
        Some((real_key.clone(), 3))
    );

    // Another key holds the name now (removed, then registered by someone else): the real
    // agent's next beat is refused, and it stops with the reason instead of beating on.
    fake.take_over(&"0".repeat(64));
    let error = real.ended().await.unwrap_err().to_string();
    assert!(
        error.contains("node `node-a` is no longer this agent's") && error.contains(NAME_TAKEN),
        "{error}"
    );
}
