//! The kubelet's side of the driver, over tonic on two unix sockets:
//!
//! * `<kubelet root>/plugins_registry/vgpu.dev-reg.sock`: the plugin-registration service
//!   (`pluginregistration.Registration`). The kubelet finds the socket, asks `GetInfo` (type
//!   `DRAPlugin`, name `vgpu.dev`, the DRA socket, `v1.DRAPlugin`) and reports the outcome with
//!   `NotifyRegistrationStatus`, which [`Plugin::registration`] shows.
//! * `<kubelet root>/plugins/vgpu.dev/dra.sock`: the DRA service
//!   (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`). `NodePrepareResources` answers a claim that
//!   is prepared from the checkpoint, without asking the apiserver; otherwise it reads the
//!   claim's allocation from a [`ClaimSource`] (bounded by a timeout) and hands it to the
//!   [`Driver`]. Each claim's failure is reported in its own entry, so one bad claim does not
//!   hold up the others.
//!
//! In the second stage ([`Plugin::start_with`] with a [`ControlPlane`]) a claim not in the
//! checkpoint is pinned in the control plane and waited for (see `crate::pool`), and unprepare
//! releases it there first.
//!
//! The v1beta1 service (kubelets before 1.34) is not served: `resource.k8s.io/v1` with
//! consumable capacity needs 1.34 or newer anyway.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::claim::{Allocation, ClaimRef, DRIVER_NAME};
use crate::driver::{Driver, PreparedClaim, Stage, valid_uid};
use crate::error::{Error, Result};
use crate::pool::ControlPlane;

/// The generated messages and services.
pub mod pb {
    /// `pluginregistration` (the kubelet's plugin-registration API, v1).
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1`.
    pub mod dra_v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
}

use pb::dra_v1::dra_plugin_server::{DraPlugin, DraPluginServer};
use pb::registration::registration_server::{Registration, RegistrationServer};

/// The plugin type the kubelet expects of a DRA driver.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA services served, as the kubelet names them in `supported_versions`.
pub const SUPPORTED_VERSIONS: [&str; 1] = ["v1.DRAPlugin"];
/// The kubelet's root directory by default.
pub const KUBELET_ROOT_DEFAULT: &str = "/var/lib/kubelet";
/// Most claims in one call; the kubelet sends the claims of one pod.
pub const CLAIMS_PER_CALL_MAX: usize = 1024;
/// How long one claim's read from the apiserver may take by default.
pub const APISERVER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// The registration socket under the kubelet's root.
pub fn registration_socket(kubelet_root: &Path) -> PathBuf {
    kubelet_root
        .join("plugins_registry")
        .join(format!("{DRIVER_NAME}-reg.sock"))
}

/// The DRA service's socket under the kubelet's root.
pub fn dra_socket(kubelet_root: &Path) -> PathBuf {
    kubelet_root
        .join("plugins")
        .join(DRIVER_NAME)
        .join("dra.sock")
}

/// Where a claim's allocation comes from: the apiserver in the driver
/// ([`crate::apiserver::KubeClaims`]), made-up claims in tests.
pub trait ClaimSource: Send + Sync + 'static {
    fn allocation(&self, claim: &ClaimRef) -> impl Future<Output = Result<Allocation>> + Send;
}

impl<S: ClaimSource> ClaimSource for Arc<S> {
    fn allocation(&self, claim: &ClaimRef) -> impl Future<Output = Result<Allocation>> + Send {
        S::allocation(self, claim)
    }
}

/// How the plugin is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    pub kubelet_root: PathBuf,
    /// The bound on one claim's read from the [`ClaimSource`].
    pub apiserver_timeout: Duration,
}

/// What the kubelet last said about the registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationState {
    /// The kubelet has not said anything yet.
    Waiting,
    Registered,
    Refused(String),
}

/// The running plugin: both sockets are bound and served until [`Plugin::stop`].
#[derive(Debug)]
pub struct Plugin {
    stop: oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>>,
    registration: watch::Receiver<RegistrationState>,
    registration_socket: PathBuf,
}

impl Plugin {
    /// Binds both sockets (replacing stale ones), then serves them on the current runtime. The
    /// sockets accept connections when this returns.
    pub fn start<S: ClaimSource>(
        config: PluginConfig,
        driver: Driver,
        source: S,
    ) -> Result<Plugin> {
        Plugin::start_with(config, driver, source, None)
    }

    /// [`Plugin::start`] for the second stage when `control_plane` is given: each claim is
    /// pinned in the control plane and made a tenant by the node's agent (`crate::pool`).
    pub fn start_with<S: ClaimSource>(
        config: PluginConfig,
        driver: Driver,
        source: S,
        control_plane: Option<ControlPlane>,
    ) -> Result<Plugin> {
        assert_eq!(
            control_plane.is_some(),
            driver.stage() == Stage::ControlPlane,
            "the second stage has a control plane, the first none"
        );
        let registration_socket = registration_socket(&config.kubelet_root);
        let dra_socket = dra_socket(&config.kubelet_root);
        let dra_listener = bind(&dra_socket)?;
        let registration_listener = bind(&registration_socket)?;
        let (state_sender, registration) = watch::channel(RegistrationState::Waiting);
        let registrar = Registrar {
            endpoint: dra_socket.to_string_lossy().into_owned(),
            state: state_sender,
        };
        let service = DraService {
            driver: Arc::new(Mutex::new(driver)),
            source: Arc::new(source),
            timeout: config.apiserver_timeout,
            control_plane: control_plane.map(Arc::new),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let (stop_dra, stopped_dra) = oneshot::channel::<()>();
        let served = tokio::spawn(async move {
            let dra = tonic::transport::Server::builder()
                .add_service(DraPluginServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(dra_listener), async {
                    let _ = stopped_dra.await;
                });
            let registration = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(registrar))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(registration_listener),
                    async {
                        let _ = stopped.await;
                        let _ = stop_dra.send(());
                    },
                );
            let (dra, registration) = tokio::join!(dra, registration);
            dra.and(registration)
        });
        tracing::info!(
            "serving the kubelet: registration on {}, DRA on {}",
            registration_socket.display(),
            dra_socket.display()
        );
        Ok(Plugin {
            stop,
            served,
            registration,
            registration_socket,
        })
    }

    /// What the kubelet said about the registration, as it changes.
    pub fn registration(&self) -> watch::Receiver<RegistrationState> {
        self.registration.clone()
    }

    /// Removes the registration socket (the kubelet then deregisters the plugin), lets the calls
    /// in flight finish and stops serving.
    pub async fn stop(self) -> Result<()> {
        let _ = std::fs::remove_file(&self.registration_socket);
        let _ = self.stop.send(());
        match self.served.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(Error::Io {
                action: "serve",
                path: self.registration_socket,
                source: std::io::Error::other(error.to_string()),
            }),
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }
}

/// Binds a unix socket at `path`, creating its directory and replacing a stale socket.
fn bind(path: &Path) -> Result<UnixListener> {
    let io = |action: &'static str| {
        let path = path.to_owned();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    };
    if let Some(directory) = path.parent() {
        std::fs::create_dir_all(directory).map_err(io("create the directory of"))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!("replaced the stale socket {}", path.display()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(io("remove the stale socket")(error)),
    }
    UnixListener::bind(path).map_err(io("listen on"))
}

struct Registrar {
    endpoint: String,
    state: watch::Sender<RegistrationState>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(
        &self,
        _request: Request<pb::registration::InfoRequest>,
    ) -> std::result::Result<Response<pb::registration::PluginInfo>, Status> {
        Ok(Response::new(pb::registration::PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: DRIVER_NAME.to_owned(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.map(str::to_owned).to_vec(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pb::registration::RegistrationStatus>,
    ) -> std::result::Result<Response<pb::registration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let state = if status.plugin_registered {
            tracing::info!("the kubelet registered driver {DRIVER_NAME}");
            RegistrationState::Registered
        } else {
            tracing::error!(
                "the kubelet refused driver {DRIVER_NAME}: {}; pods asking for vgpu.dev devices will not start on this node until the kubelet accepts it (is the kubelet 1.34 or newer?)",
                status.error
            );
            RegistrationState::Refused(status.error)
        };
        self.state.send_replace(state);
        Ok(Response::new(
            pb::registration::RegistrationStatusResponse {},
        ))
    }
}

struct DraService<S> {
    driver: Arc<Mutex<Driver>>,
    source: Arc<S>,
    timeout: Duration,
    /// The second stage's control plane.
    control_plane: Option<Arc<ControlPlane>>,
}

impl<S: ClaimSource> DraService<S> {
    async fn prepare(&self, claim: ClaimRef) -> Result<Vec<pb::dra_v1::Device>> {
        if let Some(prepared) = lock(&self.driver).prepared(&claim.uid) {
            return Ok(devices(prepared));
        }
        let allocation = tokio::time::timeout(self.timeout, self.source.allocation(&claim))
            .await
            .map_err(|_| Error::ApiserverTimeout {
                claim: claim.clone(),
                seconds: self.timeout.as_secs(),
            })??;
        assert_eq!(
            allocation.claim, claim,
            "the source answers about the claim"
        );
        let driver = Arc::clone(&self.driver);
        let prepared = match &self.control_plane {
            None => blocking(move || lock(&driver).prepare(&allocation)).await?,
            Some(control_plane) => {
                // The control plane is called without the driver's lock, so one slow claim does
                // not hold up the others; `record` answers a claim recorded meanwhile as it was.
                let planned = lock(&self.driver).plan(&allocation)?;
                let noted = Arc::clone(&self.driver);
                let placing = claim.clone();
                blocking(move || lock(&noted).begin_placing(&placing)).await?;
                let written = control_plane.place(&claim, &planned).await?;
                if written.slices != planned.slices {
                    tracing::warn!(
                        "the agent wrote tenant {} with slices {:?}, where claim {claim} was allocated {:?}; the CDI spec follows the agent",
                        written.tenant,
                        written.slices,
                        planned.slices
                    );
                }
                blocking(move || lock(&driver).record(&allocation, written)).await?
            }
        };
        tracing::info!(
            "prepared claim {claim} as tenant {}",
            prepared.assignment.tenant
        );
        Ok(devices(&prepared))
    }

    async fn unprepare(&self, claim: ClaimRef) -> Result<()> {
        if let Some(control_plane) = &self.control_plane {
            // A claim neither prepared nor being placed holds no tenant: done, without the
            // control plane.
            let tenant = lock(&self.driver).tenant_of(&claim.uid);
            if let Some(tenant) = tenant {
                control_plane.release(&claim, &tenant).await?;
            }
        }
        let driver = Arc::clone(&self.driver);
        let uid = claim.uid.clone();
        blocking(move || lock(&driver).unprepare(&uid)).await?;
        tracing::info!("unprepared claim {claim}");
        Ok(())
    }
}

/// Runs `work` (file writes) off the runtime's threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|join| std::panic::resume_unwind(join.into_panic()))
}

fn lock(driver: &Mutex<Driver>) -> std::sync::MutexGuard<'_, Driver> {
    // A panic while holding the lock is a bug that the process does not survive.
    driver.lock().expect("no panic while preparing")
}

fn devices(prepared: &PreparedClaim) -> Vec<pb::dra_v1::Device> {
    prepared
        .devices
        .iter()
        .map(|device| pb::dra_v1::Device {
            request_names: vec![device.request.clone()],
            pool_name: device.pool.clone(),
            device_name: device.device.clone(),
            cdi_device_ids: device.cdi_device_ids.clone(),
        })
        .collect()
}

/// The claims of a call, checked: bounded in number, each with a uid that may name a file.
fn claims(claims: Vec<pb::dra_v1::Claim>) -> std::result::Result<Vec<ClaimRef>, Status> {
    if claims.len() > CLAIMS_PER_CALL_MAX {
        return Err(Status::invalid_argument(format!(
            "{} claims in one call; the driver takes at most {CLAIMS_PER_CALL_MAX}",
            claims.len()
        )));
    }
    Ok(claims
        .into_iter()
        .map(|claim| ClaimRef {
            namespace: claim.namespace,
            name: claim.name,
            uid: claim.uid,
        })
        .collect())
}

fn check_uid(claim: &ClaimRef) -> std::result::Result<(), String> {
    if valid_uid(&claim.uid) {
        Ok(())
    } else {
        Err(format!(
            "claim {claim} has a uid that is not a Kubernetes uid; this is a kubelet bug"
        ))
    }
}

#[tonic::async_trait]
impl<S: ClaimSource> DraPlugin for DraService<S> {
    async fn node_prepare_resources(
        &self,
        request: Request<pb::dra_v1::NodePrepareResourcesRequest>,
    ) -> std::result::Result<Response<pb::dra_v1::NodePrepareResourcesResponse>, Status> {
        let mut answers = HashMap::new();
        for claim in claims(request.into_inner().claims)? {
            let uid = claim.uid.clone();
            let result = match check_uid(&claim) {
                Ok(()) => self.prepare(claim).await.map_err(|error| error.to_string()),
                Err(error) => Err(error),
            };
            let answer = match result {
                Ok(devices) => pb::dra_v1::NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!("cannot prepare claim uid {uid}: {error}");
                    pb::dra_v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            answers.insert(uid, answer);
        }
        Ok(Response::new(pb::dra_v1::NodePrepareResourcesResponse {
            claims: answers,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<pb::dra_v1::NodeUnprepareResourcesRequest>,
    ) -> std::result::Result<Response<pb::dra_v1::NodeUnprepareResourcesResponse>, Status> {
        let mut answers = HashMap::new();
        for claim in claims(request.into_inner().claims)? {
            let uid = claim.uid.clone();
            let result = match check_uid(&claim) {
                Ok(()) => self
                    .unprepare(claim)
                    .await
                    .map_err(|error| error.to_string()),
                Err(error) => Err(error),
            };
            let error = result.err().unwrap_or_default();
            if !error.is_empty() {
                tracing::warn!("cannot unprepare claim uid {uid}: {error}");
            }
            answers.insert(uid, pb::dra_v1::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(pb::dra_v1::NodeUnprepareResourcesResponse {
            claims: answers,
        }))
    }
}
