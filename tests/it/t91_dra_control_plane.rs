//! Issue 18, the second stage end to end: a control plane with mutual TLS, an agent joined with
//! `--kubernetes-managed`, and the DRA driver's plugin (in this process, with made-up claims)
//! driven over its unix socket as the kubelet drives it. The driver pins each claim in the
//! control plane with the node's agent certificate and node key; the agent makes it a tenant on
//! the node; the driver answers with the CDI device written from the agent's tenant file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use tests::{Cluster, json, wait_for};
use tonic::transport::{Channel, Endpoint};
use vgpu_dra::claim::{AllocatedDevice, Allocation, ClaimRef};
use vgpu_dra::driver::{Driver, DriverConfig, Stage};
use vgpu_dra::kubelet::pb::dra_v1::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
    dra_plugin_client::DraPluginClient,
};
use vgpu_dra::kubelet::{ClaimSource, Plugin, PluginConfig};
use vgpu_dra::pool::{ControlPlane, ControlPlaneConfig};

const NODE: &str = "k8s-node";
const UID_TRAIN: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const UID_GREEDY: &str = "bbbbbbbb-0000-4000-8000-000000000002";
const UID_LATE: &str = "cccccccc-0000-4000-8000-000000000003";
/// The bound on every wait here.
const WAIT: Duration = Duration::from_secs(30);

/// Made-up claims, counting how often the driver asked.
#[derive(Default)]
struct FakeClaims {
    allocations: Mutex<BTreeMap<String, Allocation>>,
    asked: AtomicUsize,
}

impl ClaimSource for FakeClaims {
    async fn allocation(&self, claim: &ClaimRef) -> vgpu_dra::Result<Allocation> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let allocations = self.allocations.lock().expect("no panic while held");
        allocations
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| vgpu_dra::Error::Apiserver {
                claim: claim.clone(),
                reason: "not found".into(),
            })
    }
}

fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ml".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

fn allocation(name: &str, uid: &str, memory: &str, compute: &str) -> Allocation {
    Allocation {
        claim: claim_ref(name, uid),
        devices: vec![AllocatedDevice {
            request: "gpu".into(),
            pool: NODE.into(),
            device: "gpu-0".into(),
            consumed: BTreeMap::from([
                ("memory".into(), memory.into()),
                ("compute".into(), compute.into()),
            ]),
        }],
    }
}

fn kubelet_claim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ml".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

async fn connect(path: &Path) -> Result<Channel> {
    let path = path.to_owned();
    let endpoint = Endpoint::from_static("http://localhost").connect_timeout(WAIT);
    let connect = endpoint.connect_with_connector(tower::service_fn(move |_| {
        let path = path.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(path).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    }));
    Ok(tokio::time::timeout(WAIT, connect).await??)
}

/// The tenants as `vgpuctl get tenants -o json` shows them.
fn tenants(cluster: &Cluster) -> Result<Vec<serde_json::Value>> {
    let tenants = json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    Ok(tenants.as_array().cloned().unwrap_or_default())
}

fn tenant(cluster: &Cluster, name: &str) -> Result<Option<serde_json::Value>> {
    Ok(tenants(cluster)?.into_iter().find(|t| t["name"] == name))
}

/// The driver of node [`NODE`] in its second stage, its files under `root`.
fn driver(root: &Path, agent_state_dir: &Path, shm_dir: &Path) -> Result<Driver> {
    let config = DriverConfig {
        node: NODE.into(),
        state_dir: root.join("dra-state"),
        cdi: vgpu_agent::cdi::CdiConfig {
            dir: root.join("cdi"),
            interposer: root.join("lib/libvgpu_cuda.so"),
            shm_dir: shm_dir.to_owned(),
            state_dir: agent_state_dir.to_owned(),
            mps_pipe_dir: None,
            mps_tenants: Default::default(),
        },
        quantum_ns: tenant_abi::compute::QUANTUM_NS_DEFAULT,
        stage: Stage::ControlPlane,
    };
    let inventory =
        vgpu_agent::InventorySource::from_simulate_arg("1xH100-80GB")?.discover(NODE)?;
    Ok(Driver::open(config, inventory)?)
}

async fn prepare(
    kubelet: &mut DraPluginClient<Channel>,
    name: &str,
    uid: &str,
) -> Result<NodePrepareResourceResponse> {
    let answer = kubelet
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![kubelet_claim(name, uid)],
        })
        .await?
        .into_inner();
    answer
        .claims
        .get(uid)
        .cloned()
        .context("the driver answers about the claim")
}

#[test]
fn a_prepared_claim_is_a_control_plane_tenant_owned_by_its_claim() -> Result<()> {
    let mut cluster = Cluster::start_secure(1, &[])?;
    let shm_dir = cluster.dir.path().join("shm");
    let shm = shm_dir.to_str().context("a UTF-8 path")?.to_owned();
    cluster.start_agent_with(
        NODE,
        "1xH100-80GB",
        &["--kubernetes-managed", "--shm-dir", &shm],
    )?;
    cluster.wait_nodes_ready(1)?;
    let agent_state_dir: PathBuf = cluster.agent(NODE).state_dir.clone();
    let root = cluster.dir.path().join("driver");
    let endpoints = cluster.endpoints();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let claims = std::sync::Arc::new(FakeClaims::default());
    claims.allocations.lock().expect("not poisoned").extend([
        (
            UID_TRAIN.to_owned(),
            allocation("train", UID_TRAIN, "20Gi", "25"),
        ),
        // More compute than is left on the GPU once `train` holds its 25%.
        (
            UID_GREEDY.to_owned(),
            allocation("greedy", UID_GREEDY, "20Gi", "100"),
        ),
    ]);
    let kubelet_root = root.join("kubelet");
    let socket = vgpu_dra::kubelet::dra_socket(&kubelet_root);
    let (plugin, mut kubelet) = runtime.block_on(async {
        let driver = driver(&root, &agent_state_dir, &shm_dir)?;
        // The agent's certificate and node key, as the DaemonSet mounts them.
        let settings = ControlPlaneConfig {
            endpoints: endpoints.split(',').map(str::to_owned).collect(),
            tls: Some(vgpu_agent::bootstrap::Security::default_files(
                &agent_state_dir,
            )),
            agent_state_dir: agent_state_dir.clone(),
            placement_timeout: WAIT,
        };
        let control_plane = ControlPlane::new(settings, NODE)?;
        let config = PluginConfig {
            kubelet_root: kubelet_root.clone(),
            apiserver_timeout: WAIT,
        };
        let plugin = Plugin::start_with(
            config,
            driver,
            std::sync::Arc::clone(&claims),
            Some(control_plane),
        )?;
        let kubelet = DraPluginClient::new(connect(&socket).await?);
        anyhow::Ok((plugin, kubelet))
    })?;

    // The kubelet prepares the claim: the control plane holds it as a tenant owned by the claim,
    // pinned to the node, and the CDI device is the tenant the agent wrote.
    let prepared = runtime.block_on(prepare(&mut kubelet, "train", UID_TRAIN))?;
    ensure!(prepared.error.is_empty(), "{prepared:?}");
    ensure!(
        prepared.devices.len() == 1
            && prepared.devices[0].cdi_device_ids == ["vgpu.dev/claim=train-aaaaaaaa"],
        "{prepared:?}"
    );
    let shown = tenant(&cluster, "train-aaaaaaaa")?.context("the claim's tenant is listed")?;
    ensure!(shown["owner"] == "k8s:ml/train", "{shown}");
    ensure!(shown["slices"][0]["node"] == NODE, "{shown}");
    ensure!(
        vgpu_agent::state::read_tenant_file(&agent_state_dir, "train-aaaaaaaa")?.is_some(),
        "the agent wrote the tenant's file"
    );
    let spec = vgpu_dra::driver::spec_path(&root.join("cdi"), UID_TRAIN);
    let text = std::fs::read_to_string(&spec)?;
    ensure!(text.contains("VGPU_TENANT=train-aaaaaaaa"), "{text}");
    ensure!(text.contains("VGPU_COMPUTE_SHARES=0:25"), "{text}");
    let private = vgpu_agent::private::Layout::new(&shm_dir).tenant_dir("train-aaaaaaaa");
    ensure!(
        private.is_dir(),
        "the agent made the tenant's private directory {}",
        private.display()
    );

    // The kubelet asks again (it does after a restart of either): the checkpoint answers, with
    // no second read of the claim and no second tenant.
    let asked = claims.asked.load(Ordering::SeqCst);
    let again = runtime.block_on(prepare(&mut kubelet, "train", UID_TRAIN))?;
    ensure!(again == prepared, "{again:?} != {prepared:?}");
    ensure!(claims.asked.load(Ordering::SeqCst) == asked);
    let owned = tenants(&cluster)?
        .into_iter()
        .filter(|t| t["owner"] == "k8s:ml/train")
        .count();
    ensure!(owned == 1, "one tenant for the claim, not {owned}");

    // A claim whose slice the GPU cannot give any more is refused at once, saying why.
    let greedy = runtime.block_on(prepare(&mut kubelet, "greedy", UID_GREEDY))?;
    ensure!(
        greedy.error.contains("refused") && greedy.devices.is_empty(),
        "{greedy:?}"
    );
    ensure!(tenant(&cluster, "greedy-bbbbbbbb")?.is_none());

    // vgpuctl cannot place on the Kubernetes-managed node, though its GPU has room: with no
    // other node, the placement is refused and says why.
    let refused = cluster.vgpuctl(&["place", "batch", "--gpus", "0.5", "--no-wait"])?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success() && stderr.contains("Kubernetes-managed"),
        "{refused:?}"
    );
    ensure!(tenant(&cluster, "batch")?.is_none());

    // Unprepare releases the tenant; the agent removes its file, the driver its CDI spec; a
    // second unprepare is done already.
    for _ in 0..2 {
        let answer = runtime.block_on(kubelet.node_unprepare_resources(
            NodeUnprepareResourcesRequest {
                claims: vec![
                    kubelet_claim("train", UID_TRAIN),
                    kubelet_claim("greedy", UID_GREEDY),
                ],
            },
        ))?;
        let answer = answer.into_inner();
        ensure!(
            answer.claims.values().all(|claim| claim.error.is_empty()),
            "{answer:?}"
        );
        ensure!(tenant(&cluster, "train-aaaaaaaa")?.is_none());
        ensure!(vgpu_agent::state::read_tenant_file(&agent_state_dir, "train-aaaaaaaa")?.is_none());
        ensure!(!spec.exists());
    }

    // Prepared again (a new pod of the same claim): the same tenant again.
    let back = runtime.block_on(prepare(&mut kubelet, "train", UID_TRAIN))?;
    ensure!(back == prepared, "{back:?} != {prepared:?}");
    wait_for("the tenant in the control plane", WAIT, || {
        tenant(&cluster, "train-aaaaaaaa").ok().flatten()
    })?;

    drop(kubelet);
    runtime.block_on(async { tokio::time::timeout(WAIT, plugin.stop()).await })??;

    // A driver that reads another directory than the agent's (here: one with only the node
    // key) gets its pin, waits for a tenant file that never comes, and tells the kubelet what
    // to check; its unprepare releases the pin.
    let elsewhere = root.join("not-the-agent");
    std::fs::create_dir_all(&elsewhere)?;
    std::fs::copy(agent_state_dir.join("node-key"), elsewhere.join("node-key"))?;
    claims.allocations.lock().expect("not poisoned").insert(
        UID_LATE.to_owned(),
        allocation("late", UID_LATE, "10Gi", "10"),
    );
    let other_root = root.join("other-driver");
    let other_kubelet_root = other_root.join("kubelet");
    let (plugin, mut kubelet) = runtime.block_on(async {
        let driver = driver(&other_root, &elsewhere, &shm_dir)?;
        let settings = ControlPlaneConfig {
            endpoints: endpoints.split(',').map(str::to_owned).collect(),
            tls: Some(vgpu_agent::bootstrap::Security::default_files(
                &agent_state_dir,
            )),
            agent_state_dir: elsewhere.clone(),
            placement_timeout: Duration::from_secs(1),
        };
        let plugin = Plugin::start_with(
            PluginConfig {
                kubelet_root: other_kubelet_root.clone(),
                apiserver_timeout: WAIT,
            },
            driver,
            std::sync::Arc::clone(&claims),
            Some(ControlPlane::new(settings, NODE)?),
        )?;
        let socket = vgpu_dra::kubelet::dra_socket(&other_kubelet_root);
        let kubelet = DraPluginClient::new(connect(&socket).await?);
        anyhow::Ok((plugin, kubelet))
    })?;
    let late = runtime.block_on(prepare(&mut kubelet, "late", UID_LATE))?;
    ensure!(
        late.error.contains("did not write") && late.error.contains("--agent-state-dir"),
        "{late:?}"
    );
    let held = tenant(&cluster, "late-cccccccc")?.context("the pin was taken")?;
    ensure!(held["owner"] == "k8s:ml/late", "{held}");
    let answer = runtime.block_on(kubelet.node_unprepare_resources(
        NodeUnprepareResourcesRequest {
            claims: vec![kubelet_claim("late", UID_LATE)],
        },
    ))?;
    let answer = answer.into_inner();
    ensure!(answer.claims[UID_LATE].error.is_empty(), "{answer:?}");
    ensure!(tenant(&cluster, "late-cccccccc")?.is_none());
    drop(kubelet);
    runtime.block_on(async { tokio::time::timeout(WAIT, plugin.stop()).await })??;
    Ok(())
}

#[test]
fn an_unreachable_control_plane_is_reported_to_the_kubelet() -> Result<()> {
    let root = tempfile::tempdir()?;
    let agent_state_dir = root.path().join("agent");
    std::fs::create_dir_all(&agent_state_dir)?;
    std::fs::write(
        agent_state_dir.join("node-key"),
        format!("{}\n", "ab".repeat(32)),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let claims = std::sync::Arc::new(FakeClaims::default());
    claims.allocations.lock().expect("not poisoned").insert(
        UID_TRAIN.to_owned(),
        allocation("train", UID_TRAIN, "20Gi", "25"),
    );
    let answer = runtime.block_on(async {
        let driver = driver(root.path(), &agent_state_dir, &root.path().join("shm"))?;
        let settings = ControlPlaneConfig {
            endpoints: vec![format!("127.0.0.1:{}", tests::free_port())],
            tls: None,
            agent_state_dir: agent_state_dir.clone(),
            placement_timeout: WAIT,
        };
        let kubelet_root = root.path().join("kubelet");
        let plugin = Plugin::start_with(
            PluginConfig {
                kubelet_root: kubelet_root.clone(),
                apiserver_timeout: WAIT,
            },
            driver,
            std::sync::Arc::clone(&claims),
            Some(ControlPlane::new(settings, NODE)?),
        )?;
        let mut kubelet =
            DraPluginClient::new(connect(&vgpu_dra::kubelet::dra_socket(&kubelet_root)).await?);
        let answer = prepare(&mut kubelet, "train", UID_TRAIN).await?;
        // Unpreparing a claim whose pin may have reached the control plane needs the control
        // plane too.
        let unprepared = kubelet
            .node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: vec![kubelet_claim("train", UID_TRAIN)],
            })
            .await?
            .into_inner();
        drop(kubelet);
        tokio::time::timeout(WAIT, plugin.stop()).await??;
        anyhow::Ok((answer, unprepared))
    })?;
    let (prepared, unprepared) = answer;
    ensure!(
        prepared.error.contains("no control-plane member")
            && prepared.error.contains("--control-plane"),
        "{prepared:?}"
    );
    ensure!(
        unprepared.claims[UID_TRAIN]
            .error
            .contains("no control-plane member"),
        "{unprepared:?}"
    );
    Ok(())
}
