//! Service-level tests of node identity (issue 22, point 5): a one-member control plane in this
//! process, its `Agent` handlers called with the metadata agents send (`api::metadata`).

use super::*;
use api::metadata::{NODE_KEY, REGISTRATION};
use api::v1::agent_server::Agent;
use api::v1::pool_server::Pool;
use std::time::Duration;

/// Longest the member may take to elect itself.
const ELECTION_TIME_MAX: Duration = Duration::from_secs(30);

struct Member {
    service: Service,
    _data: tempfile::TempDir,
    _started: crate::Started,
}

async fn member() -> Member {
    let data = tempfile::tempdir().unwrap();
    let listen: std::net::SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .unwrap();
    let config = crate::Config {
        mode: crate::Mode::Bootstrap,
        id: 1,
        listen,
        advertise: listen.to_string(),
        data_dir: data.path().to_owned(),
        timings: Default::default(),
        raft: Default::default(),
        etcd: None,
        security: crate::Security {
            insecure: true,
            ..Default::default()
        },
    };
    let started = crate::start(config).await.unwrap();
    started
        .control_plane
        .raft()
        .expect("the Raft store")
        .wait(Some(ELECTION_TIME_MAX))
        .current_leader(1, "the member elects itself")
        .await
        .unwrap();
    let (_, guard) = crate::Security {
        insecure: true,
        ..Default::default()
    }
    .load()
    .unwrap();
    Member {
        service: Service {
            control_plane: started.control_plane.clone(),
            guard: Arc::new(guard),
        },
        _data: data,
        _started: started,
    }
}

fn inventory(name: &str) -> v1::Node {
    v1::Node {
        name: name.to_owned(),
        address: "10.0.0.1".to_owned(),
        gpus: vec![v1::Gpu {
            uuid: format!("GPU-{name}-0"),
            index: 0,
            model: "H100-80GB".to_owned(),
            memory_bytes: 80 << 30,
            sm_count: 132,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// `message` with the node key `key` and the registration `registration`, as an agent sends it.
fn with_claim<T>(message: T, key: Option<&str>, registration: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert(NODE_KEY, key.parse().unwrap());
    }
    if let Some(registration) = registration {
        request
            .metadata_mut()
            .insert(REGISTRATION, registration.parse().unwrap());
    }
    request
}

async fn register(member: &Member, name: &str, key: Option<&str>) -> Result<Option<u64>, Status> {
    let request = v1::RegisterRequest {
        node: Some(inventory(name)),
    };
    let response = member
        .service
        .register(with_claim(request, key, None))
        .await?;
    Ok(response
        .metadata()
        .get(REGISTRATION)
        .map(|value| value.to_str().unwrap().parse().unwrap()))
}

async fn beat(
    member: &Member,
    name: &str,
    key: Option<&str>,
    registration: Option<u64>,
) -> Result<bool, Status> {
    let request = v1::HeartbeatRequest {
        node: name.to_owned(),
        ..Default::default()
    };
    let number = registration.map(|number| number.to_string());
    let response = member
        .service
        .heartbeat(with_claim(request, key, number.as_deref()))
        .await?;
    Ok(response.into_inner().known)
}

async fn watch(member: &Member, name: &str, key: Option<&str>) -> Result<(), Status> {
    let request = v1::WatchAssignmentsRequest {
        node: name.to_owned(),
    };
    member
        .service
        .watch_assignments(with_claim(request, key, None))
        .await
        .map(drop)
}

fn assert_taken<T: std::fmt::Debug>(what: &str, result: Result<T, Status>) -> String {
    let status = result.expect_err(what);
    assert_eq!(
        ErrorCode::of(&status),
        Some(ErrorCode::NodeNameTaken),
        "{what}: {status:?}"
    );
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{what}");
    status.message().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_key_and_registration_that_hold_a_name_may_beat_and_watch_for_it() {
    let member = member().await;
    let (key_a, key_b) = ("a".repeat(64), "b".repeat(64));
    let first = register(&member, "node-a", Some(&key_a))
        .await
        .unwrap()
        .expect("a keyed registration is numbered");
    assert!(
        beat(&member, "node-a", Some(&key_a), Some(first))
            .await
            .unwrap()
    );
    watch(&member, "node-a", Some(&key_a)).await.unwrap();

    // Another key: its registration, beats and stream are refused, with the remedy.
    let message = assert_taken(
        "another key registers",
        register(&member, "node-a", Some(&key_b)).await,
    );
    assert!(
        message
            .starts_with("[VGPU-NODE-NAME-TAKEN] node `node-a` is registered by another node key")
            && message.contains("vgpuctl node remove node-a"),
        "{message}"
    );
    assert_taken(
        "another key beats",
        beat(&member, "node-a", Some(&key_b), Some(first)).await,
    );
    assert_taken("a keyless beat", beat(&member, "node-a", None, None).await);
    assert_taken(
        "another key watches",
        watch(&member, "node-a", Some(&key_b)).await,
    );
    assert_taken(
        "a keyless registration",
        register(&member, "node-a", None).await,
    );

    // Malformed metadata is refused at admission.
    for (key, number) in [
        ("A".repeat(64), "1"),
        ("a".repeat(63), "1"),
        (key_a.clone(), "x"),
    ] {
        let status = beat_raw(&member, &key, number).await.unwrap_err();
        assert_eq!(
            ErrorCode::of(&status),
            Some(ErrorCode::InvalidArgument),
            "{status:?}"
        );
    }
    let status = register(&member, "node-a", Some("short"))
        .await
        .unwrap_err();
    assert_eq!(ErrorCode::of(&status), Some(ErrorCode::InvalidArgument));

    // The same key registers again (a restart, or a second agent with a copy of the state
    // directory): a new number, and beats of the older registration are refused.
    let second = register(&member, "node-a", Some(&key_a))
        .await
        .unwrap()
        .unwrap();
    assert!(second > first);
    let message = assert_taken(
        "a beat of the older registration",
        beat(&member, "node-a", Some(&key_a), Some(first)).await,
    );
    assert!(message.contains("registered again"), "{message}");
    assert_taken(
        "a beat without a number",
        beat(&member, "node-a", Some(&key_a), None).await,
    );
    assert!(
        beat(&member, "node-a", Some(&key_a), Some(second))
            .await
            .unwrap()
    );

    // An admin removes the node: its name is free, the old agent's beat says "unknown".
    member
        .service
        .remove_node(Request::new(v1::RemoveNodeRequest {
            node: "node-a".to_owned(),
        }))
        .await
        .unwrap();
    assert!(
        !beat(&member, "node-a", Some(&key_a), Some(second))
            .await
            .unwrap()
    );
    let taken_over = register(&member, "node-a", Some(&key_b))
        .await
        .unwrap()
        .unwrap();
    assert!(
        beat(&member, "node-a", Some(&key_b), Some(taken_over))
            .await
            .unwrap()
    );
    assert_taken(
        "the old key after the takeover",
        watch(&member, "node-a", Some(&key_a)).await,
    );

    // An agent without a key (an earlier version) registers a name nobody bound, unnumbered.
    assert_eq!(register(&member, "node-old", None).await.unwrap(), None);
    assert!(beat(&member, "node-old", None, None).await.unwrap());
    watch(&member, "node-old", None).await.unwrap();
}

async fn beat_raw(member: &Member, key: &str, registration: &str) -> Result<bool, Status> {
    let request = v1::HeartbeatRequest {
        node: "node-a".to_owned(),
        ..Default::default()
    };
    let response = member
        .service
        .heartbeat(with_claim(request, Some(key), Some(registration)))
        .await?;
    Ok(response.into_inner().known)
}

/// A pinned request for the claim `train` of namespace `ml` on GPU 0 of `node` (issue 18).
fn pinned(node: &str) -> v1::PlacementRequest {
    v1::PlacementRequest {
        milli_gpus: 250,
        owner: api::names::claim_owner("ml", "train"),
        pin: Some(v1::Pin {
            node: node.to_owned(),
            gpus: vec![v1::PinnedGpu {
                uuid: format!("GPU-{node}-0"),
                compute_percent: 25,
                memory_bytes: 20 << 30,
            }],
        }),
        ..Default::default()
    }
}

async fn place(
    member: &Member,
    name: &str,
    request: v1::PlacementRequest,
) -> Result<v1::Tenant, Status> {
    let request = v1::PlaceRequest {
        name: name.to_owned(),
        request: Some(request),
    };
    let response = member.service.place(Request::new(request)).await?;
    Ok(response.into_inner().tenant.expect("a placed tenant"))
}

/// Issue 18: a Kubernetes-managed node registers as one, takes the pin of a claim's tenant
/// (again and again: the driver retries), refuses a pin for a tenant not named after its claim,
/// and never takes a tenant of vgpuctl. (Which certificates may pin is `security`'s test; this
/// member runs `--insecure`, where every caller may.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubernetes_managed_node_takes_pins_and_no_other_tenant() {
    let member = member().await;
    let mut node = inventory("gpu-k");
    node.kubernetes_managed = true;
    let request = v1::RegisterRequest { node: Some(node) };
    member
        .service
        .register(with_claim(request, None, None))
        .await
        .unwrap();
    let shown = member
        .service
        .get_node(Request::new(v1::GetNodeRequest {
            name: "gpu-k".to_owned(),
            stale: false,
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(shown.kubernetes_managed, "{shown:?}");

    let tenant = place(&member, "train-3f2a9c1e", pinned("gpu-k"))
        .await
        .unwrap();
    assert_eq!(tenant.state, v1::TenantState::Placed as i32);
    assert_eq!(tenant.owner, "k8s:ml/train");
    assert_eq!(tenant.slices.len(), 1);
    assert_eq!(tenant.slices[0].compute_percent, 25);
    let again = place(&member, "train-3f2a9c1e", pinned("gpu-k"))
        .await
        .unwrap();
    assert_eq!(
        again.slices, tenant.slices,
        "the same pin again is answered with the tenant"
    );

    let status = place(&member, "infer-3f2a9c1e", pinned("gpu-k"))
        .await
        .unwrap_err();
    assert_eq!(
        ErrorCode::of(&status),
        Some(ErrorCode::InvalidArgument),
        "{status:?}"
    );
    assert!(
        status.message().contains("not named after claim `train`"),
        "{status:?}"
    );

    let plain = v1::PlacementRequest {
        milli_gpus: 100,
        ..Default::default()
    };
    let status = place(&member, "vgpuctl-a", plain).await.unwrap_err();
    assert_eq!(
        ErrorCode::of(&status),
        Some(ErrorCode::Unplaceable),
        "{status:?}"
    );
    assert!(
        status.message().contains("Kubernetes-managed"),
        "{status:?}"
    );
}

/// Issue 18 with issue 22's node identity: the name of a Kubernetes-managed node registered with
/// a node key takes pins only with that key (a clone with the same name and its own certificate
/// cannot place on its GPUs); with the key, the pin binds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_needs_the_key_that_holds_the_node_name() {
    let member = member().await;
    let (key, other) = ("ab".repeat(32), "cd".repeat(32));
    let mut node = inventory("gpu-k");
    node.kubernetes_managed = true;
    let request = v1::RegisterRequest { node: Some(node) };
    member
        .service
        .register(with_claim(request, Some(&key), None))
        .await
        .unwrap();
    let pin = |key: Option<&str>| {
        let request = v1::PlaceRequest {
            name: "train-3f2a9c1e".to_owned(),
            request: Some(pinned("gpu-k")),
        };
        with_claim(request, key, None)
    };
    for wrong in [None, Some(other.as_str())] {
        let status = member.service.place(pin(wrong)).await.unwrap_err();
        assert_eq!(
            ErrorCode::of(&status),
            Some(ErrorCode::NodeNameTaken),
            "{wrong:?}: {status:?}"
        );
    }
    let placed = member.service.place(pin(Some(&key))).await.unwrap();
    let tenant = placed.into_inner().tenant.unwrap();
    assert_eq!(tenant.state, v1::TenantState::Placed as i32);
}

/// Issue 17: admission refuses a memory limit past every GPU of the pool, and a limit within it
/// is placed, booked at its request, with the limit on its slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_limit_past_every_gpu_is_refused_at_admission() {
    let member = member().await;
    let request = v1::RegisterRequest {
        node: Some(inventory("gpu-a")),
    };
    member
        .service
        .register(with_claim(request, None, None))
        .await
        .unwrap();
    let elastic = |limit_gib: u64| v1::PlacementRequest {
        milli_gpus: 250,
        memory_bytes_per_gpu: 20 << 30,
        memory_limit_bytes_per_gpu: limit_gib << 30,
        ..Default::default()
    };
    let status = place(&member, "greedy", elastic(100)).await.unwrap_err();
    assert_eq!(
        ErrorCode::of(&status),
        Some(ErrorCode::InvalidArgument),
        "{status:?}"
    );
    assert!(
        status
            .message()
            .contains("more than any GPU of the pool has (the largest has 80GiB)"),
        "{status:?}"
    );
    let tenant = place(&member, "elastic", elastic(60)).await.unwrap();
    assert_eq!(tenant.state, v1::TenantState::Placed as i32);
    assert_eq!(tenant.slices[0].memory_bytes, 20 << 30);
    assert_eq!(tenant.slices[0].memory_limit_bytes, 60 << 30);
}
