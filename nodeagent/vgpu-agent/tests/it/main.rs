//! The `join` runtime against a fake control plane served over real gRPC on localhost: it
//! registers, follows the assignment stream into the state directory, registers again when the
//! control plane forgets it, reconnects when the stream ends, moves past a dead address, and
//! reconciles after a restart. Progress is asserted by waiting for it, with a finite deadline.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::v1::agent_server::{Agent, AgentServer};
use api::v1::{
    Assignment, Assignments, HeartbeatRequest, HeartbeatResponse, Node, NodeState, RegisterRequest,
    RegisterResponse, ReportKind, Slice, WatchAssignmentsRequest,
};
use futures::Stream;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};
use vgpu_agent::cdi::{CDI_FILE, CdiConfig};
use vgpu_agent::{InventorySource, JoinConfig, Timings};

const DEADLINE: Duration = Duration::from_secs(20);

#[derive(Default)]
struct FakeState {
    registrations: Vec<Node>,
    heartbeats: u64,
    /// Answer the next heartbeat with `known = false`.
    forget_once: bool,
    /// Answer the next heartbeat with `report_wanted = true`, as a new leader would.
    want_report_once: bool,
    /// Every heartbeat's report: its kind, generation and number of GPU entries.
    reports: Vec<(ReportKind, u64, usize)>,
    /// Which of `reports` was answered `report_wanted`.
    wanted_at: Option<usize>,
    watches: u64,
    current: Assignments,
    watchers: Vec<mpsc::UnboundedSender<Result<Assignments, Status>>>,
}

#[derive(Clone, Default)]
struct FakeControlPlane {
    state: Arc<Mutex<FakeState>>,
}

impl FakeControlPlane {
    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }

    fn publish(&self, assignments: Assignments) {
        self.with(|state| {
            state.current = assignments.clone();
            state
                .watchers
                .retain(|watcher| watcher.send(Ok(assignments.clone())).is_ok());
        });
    }

    /// Ends every open stream, as a control-plane node that goes away would.
    fn end_streams(&self) {
        self.with(|state| state.watchers.clear());
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<Assignments, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for FakeControlPlane {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let node = request
            .into_inner()
            .node
            .ok_or_else(|| Status::invalid_argument("no node"))?;
        self.with(|state| state.registrations.push(node));
        Ok(Response::new(RegisterResponse {
            heartbeat_interval_ms: 100,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let request = request.into_inner();
        let kind = ReportKind::try_from(request.report).expect("a known kind");
        let (known, report_wanted) = self.with(|state| {
            state.heartbeats += 1;
            state
                .reports
                .push((kind, request.report_generation, request.gpus.len()));
            let wanted = std::mem::take(&mut state.want_report_once);
            if wanted {
                state.wanted_at = Some(state.reports.len() - 1);
            }
            (!std::mem::take(&mut state.forget_once), wanted)
        });
        Ok(Response::new(HeartbeatResponse {
            known,
            report_wanted,
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
        _: Request<WatchAssignmentsRequest>,
    ) -> Result<Response<AssignmentStream>, Status> {
        let (sender, receiver) = mpsc::unbounded_channel();
        self.with(|state| {
            state.watches += 1;
            sender.send(Ok(state.current.clone())).unwrap();
            state.watchers.push(sender);
        });
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Serves the fake on a free localhost port; returns its address.
async fn serve(fake: FakeControlPlane) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let incoming = futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(fake))
            .serve_with_incoming(incoming),
    );
    address
}

/// An address nothing listens on.
async fn dead_address() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().to_string()
}

struct RunningAgent {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<vgpu_agent::Result<()>>,
}

impl RunningAgent {
    async fn stop(self) {
        self.stop.send(()).unwrap();
        let result = tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the agent stops")
            .unwrap();
        result.expect("a stopped agent returns Ok");
    }
}

fn fake_mps_control(state_dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = state_dir.join("fake-mps-control");
    std::fs::create_dir_all(state_dir).unwrap();
    std::fs::write(
        &path,
        "#!/bin/sh\n[ \"$1\" = -d ] || exit 1\n: > \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn start(control_plane: Vec<String>, state_dir: &Path) -> RunningAgent {
    let config = JoinConfig {
        control_plane,
        name: "node-a".into(),
        source: InventorySource::from_simulate_arg("4xH100-80GB").unwrap(),
        state_dir: state_dir.to_owned(),
        labels: [("zone".to_owned(), "a".to_owned())].into(),
        address: "127.0.0.1:7500".into(),
        timings: Timings {
            retry_initial: Duration::from_millis(20),
            retry_max: Duration::from_millis(200),
            call_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_millis(500),
        },
        shm_dir: state_dir.join("shm"),
        nic_bytes_per_second: 12_500_000_000,
        host_reserve: Default::default(),
        swap_host_memory: None,
        shared_staging: false,
        kubernetes_managed: false,
        cdi: Some(CdiConfig {
            dir: state_dir.join("cdi"),
            interposer: state_dir.join("libvgpu_cuda.so"),
            shm_dir: state_dir.join("shm"),
            state_dir: state_dir.to_owned(),
            mps_pipe_dir: Some(vgpu_agent::mps::pipe_dir(&state_dir.join("shm"))),
            // Every tenant an MPS client, so that the spec shows the pipes whatever the flags.
            mps_tenants: vgpu_agent::mps::MpsTenants::All,
        }),
        // Concurrent sharing, with a stand-in for nvidia-cuda-mps-control that records its
        // start (the real one needs a GPU; tests/gpu runs it).
        mps: Some(vgpu_agent::mps::MpsConfig::new(
            Some(fake_mps_control(state_dir)),
            &state_dir.join("shm"),
            state_dir,
            vgpu_agent::mps::MpsTenants::All,
        )),
        security: vgpu_agent::bootstrap::Security {
            insecure: true,
            files: vgpu_agent::bootstrap::Security::default_files(state_dir),
            token: None,
            ca_cert_hash: None,
        },
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(vgpu_agent::join(config, async move {
        let _ = stopped.await;
    }));
    RunningAgent { stop, task }
}

async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn assignments(revision: u64, tenants: &[(&str, u32, u32)]) -> Assignments {
    Assignments {
        revision,
        node_state: NodeState::Ready as i32,
        assignments: tenants
            .iter()
            .map(|&(tenant, gpu_index, compute_percent)| Assignment {
                tenant: tenant.into(),
                priority: 0,
                bandwidth_weight: 0,
                latency: false,
                latency_target_us: 0,
                slices: vec![Slice {
                    node: "node-a".into(),
                    gpu: format!("GPU-{gpu_index}"),
                    gpu_index,
                    compute_percent,
                    memory_bytes: 20 << 30,
                    guaranteed: true,
                    burst: false,
                    memory_limit_bytes: 0,
                }],
            })
            .collect(),
    }
}

fn tenant_files(state_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(state_dir.join("tenants"))
        .map(|entries| {
            entries
                .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The tenants of the CDI spec, in order; empty when there is no spec.
fn cdi_devices(state_dir: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(state_dir.join("cdi").join(CDI_FILE)) else {
        return Vec::new();
    };
    let Ok(spec) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Vec::new();
    };
    spec["devices"]
        .as_array()
        .map(|devices| {
            devices
                .iter()
                .filter_map(|device| device["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn persisted_revision(state_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(state_dir.join("assignments.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["revision"].as_u64()
}

#[tokio::test]
async fn joins_follows_assignments_and_recovers() {
    let fake = FakeControlPlane::default();
    fake.publish(assignments(1, &[("infer-a", 0, 25)]));
    let live = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let state_dir = directory.path().join("state");
    // The first address is dead: the agent must move on to the live one.
    let agent = start(vec![dead_address().await, live], &state_dir);

    wait_for("registration", || {
        fake.with(|state| !state.registrations.is_empty())
    })
    .await;
    let registered = fake.with(|state| state.registrations[0].clone());
    assert_eq!(registered.name, "node-a");
    assert_eq!(registered.gpus.len(), 4);
    assert_eq!(registered.labels.get("zone").map(String::as_str), Some("a"));
    assert_eq!(registered.address, "127.0.0.1:7500");

    wait_for("the first set on disk", || {
        tenant_files(&state_dir) == ["infer-a.json"]
    })
    .await;
    wait_for("heartbeats", || fake.with(|state| state.heartbeats >= 2)).await;

    fake.publish(assignments(2, &[("infer-b", 1, 50)]));
    wait_for("the second set on disk", || {
        tenant_files(&state_dir) == ["infer-b.json"]
    })
    .await;
    wait_for("revision 2", || persisted_revision(&state_dir) == Some(2)).await;
    wait_for("the CDI spec of the second set", || {
        cdi_devices(&state_dir) == ["infer-b"]
    })
    .await;
    // The MPS daemon runs, and containers get its pipes.
    assert!(state_dir.join("shm/mps/control").exists());
    let spec = std::fs::read_to_string(state_dir.join("cdi").join(CDI_FILE)).unwrap();
    assert!(spec.contains("CUDA_MPS_PIPE_DIRECTORY="), "{spec}");
    // The placed tenant has its private directory; the one that left has none.
    let tenants = state_dir.join("shm/tenants");
    assert!(tenants.join("infer-b/nccl-activity").exists());
    assert!(!tenants.join("infer-a").exists());
    // `exec` and `env` find the placed tenant, and refuse the one that left.
    let placement = vgpu_agent::tenant::load_placement(&state_dir, "infer-b", "x").unwrap();
    assert_eq!(placement.node, "node-a");
    assert_eq!(placement.assignment.slices[0].compute_percent, 50);
    let gone = vgpu_agent::tenant::load_placement(&state_dir, "infer-a", "x").unwrap_err();
    assert!(
        gone.to_string()
            .starts_with("tenant infer-a is not placed on this node (node-a)")
    );

    // The control plane forgets the node: the agent registers again, with the same inventory.
    fake.with(|state| state.forget_once = true);
    wait_for("a second registration", || {
        fake.with(|state| state.registrations.len() >= 2)
    })
    .await;
    let again = fake.with(|state| state.registrations[1].clone());
    assert_eq!(again, registered);

    // The stream ends: the agent watches again and picks up what changed meanwhile.
    let watches = fake.with(|state| state.watches);
    fake.end_streams();
    fake.with(|state| state.current = assignments(3, &[("infer-b", 1, 50), ("infer-c", 2, 100)]));
    wait_for("a new stream", || {
        fake.with(|state| state.watches > watches)
    })
    .await;
    wait_for("the third set on disk", || {
        tenant_files(&state_dir) == ["infer-b.json", "infer-c.json"]
    })
    .await;
    wait_for("the CDI spec of the third set", || {
        cdi_devices(&state_dir) == ["infer-b", "infer-c"]
    })
    .await;

    agent.stop().await;
}

/// The health report goes out in full on the first beat only; the next beats name it without
/// repeating it, until the control plane (a new leader) says it has none.
#[tokio::test]
async fn an_unchanged_report_is_not_sent_again_and_a_leader_without_it_gets_it() {
    let fake = FakeControlPlane::default();
    fake.publish(assignments(1, &[]));
    let live = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let agent = start(vec![live], &directory.path().join("state"));
    wait_for("four heartbeats", || {
        fake.with(|state| state.heartbeats >= 4)
    })
    .await;
    let reports = fake.with(|state| state.reports.clone());
    let (first_kind, generation, gpus) = reports[0];
    assert_eq!((first_kind, gpus), (ReportKind::Full, 4), "{reports:?}");
    // A full refresh comes only after 30 beats (3 s at the fake's 100 ms).
    for &later in &reports[1..4] {
        assert_eq!(
            later,
            (ReportKind::Unchanged, generation, 0),
            "the same report is not sent twice: {reports:?}"
        );
    }

    fake.with(|state| state.want_report_once = true);
    wait_for(
        "two heartbeats after the one answered `report_wanted`",
        || {
            fake.with(|state| {
                state
                    .wanted_at
                    .is_some_and(|at| state.reports.len() >= at + 3)
            })
        },
    )
    .await;
    let (reports, wanted_at) = fake.with(|state| (state.reports.clone(), state.wanted_at.unwrap()));
    let (kind, new_generation, gpus) = reports[wanted_at + 1];
    assert_eq!((kind, gpus), (ReportKind::Full, 4), "{reports:?}");
    assert!(new_generation > generation, "{reports:?}");
    assert_eq!(
        reports[wanted_at + 2],
        (ReportKind::Unchanged, new_generation, 0),
        "{reports:?}"
    );
    agent.stop().await;
}

#[tokio::test]
async fn a_restart_restores_and_reconciles() {
    let fake = FakeControlPlane::default();
    fake.publish(assignments(5, &[("keep", 0, 25), ("leave", 1, 25)]));
    let live = serve(fake.clone()).await;
    let directory = tempfile::tempdir().unwrap();
    let state_dir = directory.path().to_owned();

    let agent = start(vec![live.clone()], &state_dir);
    wait_for("the first set on disk", || {
        tenant_files(&state_dir) == ["keep.json", "leave.json"]
    })
    .await;
    agent.stop().await;
    let first_inventory = fake.with(|state| state.registrations[0].clone());

    // While the agent is down, `leave` goes and `arrive` comes.
    fake.with(|state| state.current = assignments(7, &[("keep", 0, 25), ("arrive", 2, 50)]));
    let agent = start(vec![live], &state_dir);
    wait_for("the reconciled set on disk", || {
        tenant_files(&state_dir) == ["arrive.json", "keep.json"]
    })
    .await;
    wait_for("revision 7", || persisted_revision(&state_dir) == Some(7)).await;
    // Same uuids after the restart, so the control plane keeps the node's tenants.
    assert_eq!(
        fake.with(|state| state.registrations.last().unwrap().clone()),
        first_inventory
    );
    let keep: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(state_dir.join("tenants/keep.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        keep["revision"], 5,
        "an unchanged tenant keeps the revision it last changed at"
    );
    agent.stop().await;
}

#[tokio::test]
async fn an_agent_without_a_control_plane_still_stops_cleanly() {
    let directory = tempfile::tempdir().unwrap();
    let agent = start(vec![dead_address().await], directory.path());
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.stop().await;
}

#[tokio::test]
async fn a_refused_inventory_stops_the_agent_with_the_reason() {
    #[derive(Clone)]
    struct Refusing;
    #[tonic::async_trait]
    impl Agent for Refusing {
        async fn register(
            &self,
            _: Request<RegisterRequest>,
        ) -> Result<Response<RegisterResponse>, Status> {
            Err(api::ErrorCode::InvalidArgument.status("node `node-a` reports GPU index 0 twice"))
        }
        async fn heartbeat(
            &self,
            _: Request<HeartbeatRequest>,
        ) -> Result<Response<HeartbeatResponse>, Status> {
            Err(Status::unimplemented("no"))
        }
        async fn join_node(
            &self,
            _: Request<api::v1::JoinNodeRequest>,
        ) -> Result<Response<api::v1::JoinNodeResponse>, Status> {
            Err(Status::unimplemented("no"))
        }
        type WatchAssignmentsStream = AssignmentStream;
        async fn watch_assignments(
            &self,
            _: Request<WatchAssignmentsRequest>,
        ) -> Result<Response<AssignmentStream>, Status> {
            Err(Status::unimplemented("no"))
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let incoming = futures::stream::unfold(listener, |listener| async move {
        Some((listener.accept().await.map(|(stream, _)| stream), listener))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(Refusing))
            .serve_with_incoming(incoming),
    );
    let directory = tempfile::tempdir().unwrap();
    let agent = start(vec![address], directory.path());
    let result = tokio::time::timeout(DEADLINE, agent.task)
        .await
        .expect("the agent gives up")
        .unwrap();
    let error = result.unwrap_err().to_string();
    assert!(
        error.contains("refused to register") && error.contains("GPU index 0 twice"),
        "{error}"
    );
}
