//! The driver's apiserver calls against an HTTP fake of exactly the endpoints it uses: reading
//! a ResourceClaim, and reading, creating and replacing the node's ResourceSlice.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::IntoResponse;
use axum::routing::get;
use vgpu_dra::claim::ClaimRef;
use vgpu_dra::kubelet::ClaimSource;
use vgpu_dra::slices::{self, NodeFacts, SliceAction};

const WAIT: Duration = Duration::from_secs(10);
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

#[derive(Default)]
struct Apiserver {
    claims: BTreeMap<(String, String), serde_json::Value>,
    slices: BTreeMap<String, serde_json::Value>,
    /// Every request, as `METHOD path`.
    log: Vec<String>,
    next_version: u64,
    /// Told the number of slice writes so far, when set.
    writes: Option<tokio::sync::watch::Sender<u64>>,
}

impl Apiserver {
    fn wrote(&mut self) {
        self.next_version += 1;
        if let Some(writes) = &self.writes {
            writes.send_modify(|count| *count += 1);
        }
    }
}

type Shared = Arc<Mutex<Apiserver>>;

fn json(status: StatusCode, body: &serde_json::Value) -> axum::response::Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn not_found(what: &str) -> axum::response::Response {
    json(
        StatusCode::NOT_FOUND,
        &serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": format!("{what} not found"), "reason": "NotFound", "code": 404
        }),
    )
}

async fn claim(
    State(server): State<Shared>,
    Path((namespace, name)): Path<(String, String)>,
    method: Method,
    uri: Uri,
) -> axum::response::Response {
    let mut server = server.lock().unwrap();
    server.log.push(format!("{method} {}", uri.path()));
    match server.claims.get(&(namespace, name)) {
        Some(claim) => json(StatusCode::OK, claim),
        None => not_found("resourceclaim"),
    }
}

async fn slice(
    State(server): State<Shared>,
    Path(name): Path<String>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> axum::response::Response {
    let mut server = server.lock().unwrap();
    server.log.push(format!("{method} {}", uri.path()));
    if method == Method::PUT {
        let mut sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let Some(stored) = server.slices.get(&name) else {
            return not_found("resourceslice");
        };
        // Optimistic concurrency, as the apiserver does it.
        if sent["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"] {
            return json(
                StatusCode::CONFLICT,
                &serde_json::json!({"kind": "Status", "code": 409}),
            );
        }
        server.wrote();
        sent["metadata"]["resourceVersion"] = server.next_version.to_string().into();
        server.slices.insert(name, sent.clone());
        return json(StatusCode::OK, &sent);
    }
    match server.slices.get(&name) {
        Some(slice) => json(StatusCode::OK, slice),
        None => not_found("resourceslice"),
    }
}

async fn create_slice(
    State(server): State<Shared>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> axum::response::Response {
    let mut server = server.lock().unwrap();
    server.log.push(format!("{method} {}", uri.path()));
    let mut sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(sent["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(sent["kind"], "ResourceSlice");
    let name = sent["metadata"]["name"].as_str().unwrap().to_owned();
    server.wrote();
    sent["metadata"]["resourceVersion"] = server.next_version.to_string().into();
    server.slices.insert(name, sent.clone());
    json(StatusCode::CREATED, &sent)
}

/// Serves the fake on a free port; returns a client of it.
async fn start(server: Shared) -> kube::Client {
    let app = axum::Router::new()
        .route(
            "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
            get(claim),
        )
        .route(SLICES, axum::routing::post(create_slice))
        .route(&format!("{SLICES}/{{name}}"), get(slice).put(slice))
        .with_state(server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = kube::Config::new(format!("http://{address}").parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

fn inventory() -> vgpu_agent::Inventory {
    vgpu_agent::InventorySource::from_simulate_arg("2xH100-80GB")
        .unwrap()
        .discover("node-a")
        .unwrap()
}

#[tokio::test]
async fn the_slice_is_created_then_replaced_with_the_next_generation_then_kept() {
    let server = Shared::default();
    let client = start(Arc::clone(&server)).await;
    let publish = |facts: NodeFacts| {
        let client = client.clone();
        async move {
            let wanted = slices::resource_slice(&inventory(), &facts, 0);
            tokio::time::timeout(WAIT, vgpu_dra::apiserver::publish(&client, wanted))
                .await
                .unwrap()
                .unwrap()
        }
    };
    assert!(matches!(
        publish(NodeFacts::default()).await,
        SliceAction::Create(_)
    ));
    assert!(matches!(
        publish(NodeFacts::default()).await,
        SliceAction::Unchanged
    ));
    let failing = NodeFacts {
        unhealthy: BTreeMap::from([(1, "ECC".to_owned())]),
        ..NodeFacts::default()
    };
    assert!(matches!(publish(failing).await, SliceAction::Replace(_)));

    let server = server.lock().unwrap();
    let stored = &server.slices["node-a-vgpu.dev"];
    assert_eq!(stored["spec"]["pool"]["generation"], 1);
    assert_eq!(
        stored["spec"]["devices"][1]["taints"][0]["key"],
        "vgpu.dev/unhealthy"
    );
    assert_eq!(
        stored["spec"]["devices"][0]["allowMultipleAllocations"],
        true
    );
    let path = format!("{SLICES}/node-a-vgpu.dev");
    assert_eq!(
        server.log,
        [
            format!("GET {path}"),
            format!("POST {SLICES}"),
            format!("GET {path}"),
            format!("GET {path}"),
            format!("PUT {path}"),
        ]
    );
}

#[tokio::test]
async fn a_claim_is_read_and_its_allocation_on_this_node_taken() {
    let server = Shared::default();
    let uid = "aaaaaaaa-0000-4000-8000-000000000001";
    let claim = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "vgpu.dev",
            "capacity": {"requests": {"memory": "20Gi", "compute": "25"}}
        }}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": "vgpu.dev", "pool": "node-a", "device": "gpu-1",
            "shareID": "6f1c1d1e-0000-4000-8000-00000000000a",
            "consumedCapacity": {"memory": "20Gi", "compute": "25"}
        }]}}}
    });
    server
        .lock()
        .unwrap()
        .claims
        .insert(("ml".into(), "train".into()), claim);
    let client = start(Arc::clone(&server)).await;
    let claims = vgpu_dra::apiserver::KubeClaims::new(client, "node-a");
    let wanted = ClaimRef {
        namespace: "ml".into(),
        name: "train".into(),
        uid: uid.into(),
    };
    let allocation = tokio::time::timeout(WAIT, claims.allocation(&wanted))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(allocation.devices.len(), 1);
    assert_eq!(allocation.devices[0].device, "gpu-1");
    assert_eq!(allocation.devices[0].consumed["compute"], "25");

    let missing = ClaimRef {
        name: "gone".into(),
        ..wanted
    };
    let error = tokio::time::timeout(WAIT, claims.allocation(&missing))
        .await
        .unwrap()
        .unwrap_err();
    assert!(error.to_string().contains("not found"), "{error}");
    assert!(error.to_string().contains("object was deleted"), "{error}");
}

#[tokio::test]
async fn the_slice_follows_the_health_of_the_gpus() {
    let server = Shared::default();
    let (writes, mut written) = tokio::sync::watch::channel(0u64);
    server.lock().unwrap().writes = Some(writes);
    let client = start(Arc::clone(&server)).await;
    let (health, unhealthy) = tokio::sync::watch::channel(BTreeMap::new());
    let publisher = tokio::spawn(vgpu_dra::apiserver::keep_published(
        client,
        inventory(),
        BTreeMap::new(),
        unhealthy,
    ));
    tokio::time::timeout(WAIT, written.wait_for(|count| *count == 1))
        .await
        .unwrap()
        .unwrap();
    health.send_replace(BTreeMap::from([(0, "xid-79".to_owned())]));
    tokio::time::timeout(WAIT, written.wait_for(|count| *count == 2))
        .await
        .unwrap()
        .unwrap();
    {
        let server = server.lock().unwrap();
        let stored = &server.slices["node-a-vgpu.dev"];
        assert_eq!(stored["spec"]["devices"][0]["taints"][0]["value"], "xid-79");
        assert_eq!(stored["spec"]["pool"]["generation"], 1);
    }
    // The health thread gone, the publisher ends after its last publication.
    drop(health);
    tokio::time::timeout(WAIT, publisher)
        .await
        .unwrap()
        .unwrap();
}
