//! Plays the kubelet over the real unix sockets: registration handshake, `GetInfo`,
//! `NodePrepareResources` and `NodeUnprepareResources` with made-up claims, a restart in the
//! middle.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use vgpu_dra::claim::{AllocatedDevice, Allocation, ClaimRef};
use vgpu_dra::driver::{Driver, DriverConfig, spec_path};
use vgpu_dra::kubelet::pb::dra_v1::{
    Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
    dra_plugin_client::DraPluginClient,
};
use vgpu_dra::kubelet::pb::registration::{
    InfoRequest, RegistrationStatus, registration_client::RegistrationClient,
};
use vgpu_dra::kubelet::{ClaimSource, Plugin, PluginConfig, RegistrationState};

/// Longest wait for anything in these tests.
const WAIT: Duration = Duration::from_secs(10);

/// Made-up claims, counting how often the driver asked.
#[derive(Default)]
struct FakeClaims {
    allocations: Mutex<BTreeMap<String, Allocation>>,
    asked: AtomicUsize,
}

impl ClaimSource for FakeClaims {
    async fn allocation(&self, claim: &ClaimRef) -> vgpu_dra::Result<Allocation> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let allocations = self.allocations.lock().unwrap();
        allocations
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| vgpu_dra::Error::Apiserver {
                claim: claim.clone(),
                reason: "not found".into(),
            })
    }
}

struct Node {
    root: tempfile::TempDir,
}

impl Node {
    fn new() -> Node {
        Node {
            root: tempfile::tempdir().unwrap(),
        }
    }

    fn kubelet_root(&self) -> PathBuf {
        self.root.path().join("kubelet")
    }

    fn driver_config(&self) -> DriverConfig {
        let root = self.root.path();
        DriverConfig {
            node: "node-a".into(),
            state_dir: root.join("state"),
            cdi: vgpu_agent::cdi::CdiConfig {
                dir: root.join("cdi"),
                interposer: root.join("lib/libvgpu_cuda.so"),
                shm_dir: root.join("shm"),
                state_dir: root.join("state"),
                mps_pipe_dir: None,
                mps_tenants: Default::default(),
            },
            quantum_ns: tenant_abi::compute::QUANTUM_NS_DEFAULT,
            stage: vgpu_dra::driver::Stage::Node,
        }
    }

    fn start(&self, claims: Arc<FakeClaims>) -> Plugin {
        let inventory = vgpu_agent::InventorySource::from_simulate_arg("2xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        let driver = Driver::open(self.driver_config(), inventory).unwrap();
        let config = PluginConfig {
            kubelet_root: self.kubelet_root(),
            apiserver_timeout: WAIT,
        };
        Plugin::start(config, driver, claims).unwrap()
    }
}

async fn connect(path: &Path) -> Channel {
    let path = path.to_owned();
    let endpoint = Endpoint::from_static("http://localhost").connect_timeout(WAIT);
    let connect = endpoint.connect_with_connector(tower::service_fn(move |_| {
        let path = path.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(path).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    }));
    tokio::time::timeout(WAIT, connect).await.unwrap().unwrap()
}

/// Finds CDI device `id` (`vendor/class=name`) among the specs in `cdi_dir` as a runtime does, and
/// returns its environment. Panics unless exactly one spec of that kind defines the device.
fn resolve_cdi(cdi_dir: &Path, id: &str) -> Vec<String> {
    let (kind, name) = id.split_once('=').unwrap();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(cdi_dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        if spec["kind"] != kind {
            continue;
        }
        for device in spec["devices"].as_array().unwrap() {
            if device["name"] == name {
                found.push(device["containerEdits"]["env"].clone());
            }
        }
    }
    assert_eq!(found.len(), 1, "CDI device {id} is defined once");
    serde_json::from_value(found.remove(0)).unwrap()
}

fn claim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ml".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

fn allocation(name: &str, uid: &str) -> Allocation {
    Allocation {
        claim: ClaimRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: uid.into(),
        },
        devices: vec![AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: "gpu-0".into(),
            consumed: BTreeMap::from([
                ("memory".into(), "20Gi".into()),
                ("compute".into(), "25".into()),
            ]),
        }],
    }
}

const UID_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const UID_MISSING: &str = "dddddddd-0000-4000-8000-000000000004";

#[tokio::test]
async fn the_kubelet_registers_the_driver_and_finds_its_dra_socket() {
    let node = Node::new();
    let plugin = node.start(Arc::new(FakeClaims::default()));
    let mut state = plugin.registration();
    assert_eq!(*state.borrow(), RegistrationState::Waiting);

    let registration = node
        .kubelet_root()
        .join("plugins_registry/vgpu.dev-reg.sock");
    let mut kubelet = RegistrationClient::new(connect(&registration).await);
    let info = kubelet.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "vgpu.dev");
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);
    let endpoint = node.kubelet_root().join("plugins/vgpu.dev/dra.sock");
    assert_eq!(Path::new(&info.endpoint), endpoint);

    kubelet
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    tokio::time::timeout(
        WAIT,
        state.wait_for(|s| *s == RegistrationState::Registered),
    )
    .await
    .unwrap()
    .unwrap();

    // The endpoint answers the DRA service; an empty call is an empty answer.
    let mut dra = DraPluginClient::new(connect(&endpoint).await);
    let answer = dra
        .node_prepare_resources(NodePrepareResourcesRequest { claims: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims.is_empty());

    // A refusal is shown too; stopping removes the registration socket (the kubelet then
    // deregisters the driver).
    kubelet
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "version not supported".into(),
        })
        .await
        .unwrap();
    tokio::time::timeout(
        WAIT,
        state.wait_for(|s| matches!(s, RegistrationState::Refused(_))),
    )
    .await
    .unwrap()
    .unwrap();
    drop((kubelet, dra));
    tokio::time::timeout(WAIT, plugin.stop())
        .await
        .unwrap()
        .unwrap();
    assert!(!registration.exists());
}

#[tokio::test]
async fn claims_are_prepared_once_and_survive_a_restart() {
    let node = Node::new();
    let claims = Arc::new(FakeClaims::default());
    claims
        .allocations
        .lock()
        .unwrap()
        .insert(UID_A.into(), allocation("train", UID_A));
    let plugin = node.start(Arc::clone(&claims));
    let endpoint = node.kubelet_root().join("plugins/vgpu.dev/dra.sock");
    let mut kubelet = DraPluginClient::new(connect(&endpoint).await);

    // One good claim, one the apiserver does not know, one with a uid that is no uid.
    let answer = kubelet
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![
                claim("train", UID_A),
                claim("ghost", UID_MISSING),
                claim("evil", "../../etc"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims.len(), 3);
    let prepared = &answer.claims[UID_A];
    assert_eq!(prepared.error, "");
    assert_eq!(prepared.devices.len(), 1);
    let device = &prepared.devices[0];
    assert_eq!(device.pool_name, "node-a");
    assert_eq!(device.device_name, "gpu-0");
    assert_eq!(device.request_names, ["gpu"]);
    assert_eq!(device.cdi_device_ids, ["vgpu.dev/claim=train-aaaaaaaa"]);
    assert!(answer.claims[UID_MISSING].error.contains("not found"));
    assert!(answer.claims[UID_MISSING].devices.is_empty());
    assert!(
        answer.claims["../../etc"]
            .error
            .contains("not a Kubernetes uid")
    );
    let spec = spec_path(&node.driver_config().cdi.dir, UID_A);
    assert!(spec.exists());
    // As the container runtime does: every CDI id the kubelet got names a device of a spec in
    // the CDI directory, whose environment is the tenant's.
    for id in &device.cdi_device_ids {
        let env = resolve_cdi(&node.driver_config().cdi.dir, id);
        assert!(
            env.contains(&"VGPU_TENANT=train-aaaaaaaa".to_owned()),
            "{env:?}"
        );
        assert!(
            env.contains(&"VGPU_COMPUTE_SHARES=0:25".to_owned()),
            "{env:?}"
        );
    }
    assert_eq!(claims.asked.load(Ordering::SeqCst), 2);

    // The driver restarts; the apiserver now knows nothing. The kubelet asks again (it does after
    // a restart of either): the checkpoint answers, without the apiserver.
    drop(kubelet);
    tokio::time::timeout(WAIT, plugin.stop())
        .await
        .unwrap()
        .unwrap();
    let forgetful = Arc::new(FakeClaims::default());
    let plugin = node.start(Arc::clone(&forgetful));
    let mut kubelet = DraPluginClient::new(connect(&endpoint).await);
    let again = kubelet
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim("train", UID_A)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&again.claims[UID_A], prepared);
    assert_eq!(forgetful.asked.load(Ordering::SeqCst), 0);

    // Unprepare undoes it, twice is fine, and so is a claim never prepared.
    for _ in 0..2 {
        let answer = kubelet
            .node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: vec![claim("train", UID_A), claim("ghost", UID_MISSING)],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.claims.len(), 2);
        assert!(answer.claims.values().all(|claim| claim.error.is_empty()));
        assert!(!spec.exists());
    }
    drop(kubelet);
    tokio::time::timeout(WAIT, plugin.stop())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_of_one_claim_preparing_at_once_get_one_tenant() {
    let node = Node::new();
    let claims = Arc::new(FakeClaims::default());
    claims
        .allocations
        .lock()
        .unwrap()
        .insert(UID_A.into(), allocation("shared", UID_A));
    let plugin = node.start(Arc::clone(&claims));
    let endpoint = node.kubelet_root().join("plugins/vgpu.dev/dra.sock");
    let mut first = DraPluginClient::new(connect(&endpoint).await);
    let mut second = DraPluginClient::new(connect(&endpoint).await);
    let request = || NodePrepareResourcesRequest {
        claims: vec![claim("shared", UID_A)],
    };
    let (a, b) = tokio::join!(
        first.node_prepare_resources(request()),
        second.node_prepare_resources(request())
    );
    let (a, b) = (a.unwrap().into_inner(), b.unwrap().into_inner());
    assert_eq!(a.claims[UID_A], b.claims[UID_A]);
    assert_eq!(
        a.claims[UID_A].devices[0].cdi_device_ids,
        ["vgpu.dev/claim=shared-aaaaaaaa"]
    );
    let checkpoint: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(node.root.path().join("state/dra-checkpoint.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(checkpoint["claims"].as_object().unwrap().len(), 1);
    drop((first, second));
    tokio::time::timeout(WAIT, plugin.stop())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn too_many_claims_in_one_call_are_refused() {
    let node = Node::new();
    let plugin = node.start(Arc::new(FakeClaims::default()));
    let endpoint = node.kubelet_root().join("plugins/vgpu.dev/dra.sock");
    let mut kubelet = DraPluginClient::new(connect(&endpoint).await);
    let many = (0..=vgpu_dra::kubelet::CLAIMS_PER_CALL_MAX)
        .map(|i| claim("c", &format!("{i:08x}")))
        .collect();
    let error = kubelet
        .node_prepare_resources(NodePrepareResourcesRequest { claims: many })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    drop(kubelet);
    tokio::time::timeout(WAIT, plugin.stop())
        .await
        .unwrap()
        .unwrap();
}
