//! The vgpu control plane (`vgpu-cp`): a Raft-replicated (openraft) store of nodes, GPUs and
//! tenants that places tenants on GPU slices.
//!
//! [`run`] starts one member: it opens (or creates) its data directory, starts Raft and the gRPC
//! API, bootstraps a cluster or joins one, and runs until SIGINT/SIGTERM. [`config`] gathers its
//! [`Config`] from flags, `VGPU_CP_*` variables and the TOML configuration file.

pub mod beats;
pub mod certs;
pub mod config;
pub mod control_plane;
pub mod dashboard;
pub mod etcd_entry;
pub mod etcd_replication;
pub mod identity;
pub mod leader;
pub mod limits;
pub mod metrics;
pub mod network;
pub mod pool;
pub mod raft_types;
pub mod replication;
pub mod runtime;
pub mod security;
pub mod service;
pub mod store;
pub mod systemd;
pub mod transfer;
pub mod usage;
pub mod watchers;

#[cfg(test)]
mod connection_bounds_test;
#[cfg(test)]
mod etcd_replication_test;
#[cfg(test)]
mod etcd_store_test;
#[cfg(test)]
mod storage_failure_test;

use control_plane::{ControlPlane, Timings};
use raft_types::Raft;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot use the data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "another vgpu-cp is already running with the data directory {0}; stop it or choose another --data-dir"
    )]
    DataDirLocked(PathBuf),
    #[error(
        "the data directory {path} belongs to member {found} of cluster {cluster}; start it with --id {found}, or use an empty --data-dir for member {wanted}"
    )]
    WrongMember {
        path: PathBuf,
        found: u64,
        wanted: u64,
        cluster: String,
    },
    #[error(
        "the data directory {path} belongs to cluster {ours}, but the peer {peer} is in cluster {theirs}; use an empty --data-dir to join that cluster"
    )]
    OtherCluster {
        path: PathBuf,
        ours: String,
        theirs: String,
        peer: String,
    },
    #[error(
        "the data directory {path} holds member {id} of cluster {cluster}, which joined that cluster through its peers; `bootstrap` there would start it as that cluster's member, not a new cluster. To restart that member, start it in join mode (`vgpu-cp join --peer ...`, or mode = \"join\"); to create a new cluster, give `bootstrap` an empty --data-dir"
    )]
    JoinedMember {
        path: PathBuf,
        id: u64,
        cluster: String,
    },
    #[error(
        "cannot open the Raft log in {path}: {source}; check that its disk has space and is writable (a full disk stops a member; it resumes once started with space back)"
    )]
    Log { path: PathBuf, source: redb::Error },
    #[error(
        "cannot open the state machine: {0}; check that the data directory's disk has space and is writable"
    )]
    StateMachine(raft_types::StorageError),
    #[error("invalid Raft settings: {0}")]
    RaftConfig(#[from] openraft::ConfigError),
    #[error("Raft failed to start: {0}")]
    RaftStart(String),
    #[error("cannot listen on {address}: {source}; is another process using the port?")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "could not reach any peer of {peers:?} to join: {last}; check the addresses and that the cluster is up"
    )]
    NoPeer { peers: Vec<String>, last: String },
    #[error("joining the cluster failed: {0}")]
    Join(String),
    #[error("the gRPC server failed: {0}")]
    Serve(String),
    #[error(
        "{problem}; the data directory is {path}: check that its disk has space and is writable, then start vgpu-cp again (a supervisor such as systemd, Docker or Kubernetes does)"
    )]
    CoreStopped { path: PathBuf, problem: String },
    #[error(transparent)]
    Tls(#[from] api::tls::TlsError),
    /// etcd's own messages name the endpoints or prefix and say what to check.
    #[error(transparent)]
    Etcd(#[from] etcd_store::Error),
    #[error(
        "cannot read the etcd {what} {path}: {source}; check --etcd-ca, --etcd-cert and --etcd-key"
    )]
    EtcdTlsFile {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Clone, Debug)]
pub enum Mode {
    /// Initialise a new one-voter cluster (or restart from the data directory).
    Bootstrap,
    /// Join the cluster of these peers (or restart from the data directory).
    Join { peers: Vec<String> },
}

/// Raft timings; the defaults give a failover well under a second and a half.
#[derive(Clone, Debug)]
pub struct RaftTimings {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Entries between snapshots (snapshots bound the log).
    pub snapshot_logs_since_last: u64,
    /// Entries kept in the log behind a snapshot (for followers that lag a little).
    pub snapshot_keep_logs: u64,
}

impl Default for RaftTimings {
    fn default() -> Self {
        RaftTimings {
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 250,
            election_timeout_max_ms: 500,
            snapshot_logs_since_last: 20_000,
            snapshot_keep_logs: 1000,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub mode: Mode,
    pub id: u64,
    pub listen: SocketAddr,
    /// The address peers and clients use to reach this member (defaults to `listen`).
    pub advertise: String,
    pub data_dir: PathBuf,
    pub timings: Timings,
    pub raft: RaftTimings,
    pub security: Security,
    /// The pool's state in an existing etcd cluster instead of the built-in Raft store
    /// (issue 20); `None`: the Raft store.
    pub etcd: Option<EtcdStore>,
}

/// The etcd store's settings (`--etcd-endpoints`, `--etcd-prefix`, `--etcd-ca/cert/key`).
#[derive(Clone, Debug)]
pub struct EtcdStore {
    /// Client URLs of the etcd cluster, e.g. `https://10.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Every key of this pool lives under it; ends with `/`.
    pub prefix: String,
    /// mTLS to etcd; `None` for plain `http://` endpoints.
    pub tls: Option<EtcdTlsFiles>,
    /// The leader's etcd lease: a dead leader is replaced within about this long.
    pub lease_ttl: Duration,
}

/// The prefix when `--etcd-prefix` is not given.
pub const ETCD_PREFIX_DEFAULT: &str = "/vgpu/";
/// The leader's lease when none is given (the design's plan: `docs/design/etcd-store.md`).
pub const ETCD_LEASE_TTL_DEFAULT: Duration = Duration::from_secs(5);

/// The CA that signed etcd's server certificates, this member's client certificate and key.
#[derive(Clone, Debug)]
pub struct EtcdTlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl EtcdStore {
    /// The etcd client's settings: the files read, the default bounds.
    pub(crate) fn client_config(&self) -> Result<etcd_store::EtcdConfig, Error> {
        let mut config = etcd_store::EtcdConfig::new(self.endpoints.clone(), &self.prefix);
        if let Some(files) = &self.tls {
            let read = |what: &'static str, path: &PathBuf| {
                std::fs::read(path).map_err(|source| Error::EtcdTlsFile {
                    what,
                    path: path.clone(),
                    source,
                })
            };
            config.tls = Some(etcd_store::TlsPem {
                ca: read("CA certificate", &files.ca)?,
                client_cert: read("client certificate", &files.cert)?,
                client_key: read("client key", &files.key)?,
                server_name: None,
            });
        }
        Ok(config)
    }
}

/// Transport security of a member (`api::tls`).
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// Plain text, no authentication (`--insecure`).
    pub insecure: bool,
    /// The CA certificate, this member's certificate and key.
    pub tls: Option<api::tls::TlsFiles>,
    /// The CA's key: lets this member sign the certificates of agents joining with a token.
    pub ca_key: Option<PathBuf>,
    /// The highest priority a `tenant:OWNER` certificate may give its tenants (`None`:
    /// [`security::TENANT_PRIORITY_MAX_DEFAULT`]); admins may use the whole range.
    pub tenant_priority_max: Option<i32>,
}

/// What `vgpu-cp` says when it has neither certificates nor `--insecure`.
pub const CERTIFICATE_HINT: &str = "make a CA with `vgpu-cp ca init --dir DIR`, a member certificate with `vgpu-cp cert issue --role member ...`, and set tls_ca_cert, tls_cert and tls_key (--tls-ca-cert, --tls-cert, --tls-key); docs/security.md shows the steps";

impl Security {
    /// The transport and the API's guard these settings give (reads the files).
    pub fn load(&self) -> Result<(api::tls::Transport, security::Guard), Error> {
        let transport =
            api::tls::Transport::choose(self.insecure, self.tls.as_ref(), CERTIFICATE_HINT)?;
        let ca_cert_pem = match &transport {
            api::tls::Transport::Insecure => None,
            api::tls::Transport::Mtls(credentials) => Some(credentials.ca_pem.clone()),
        };
        let ca_signer = match (&ca_cert_pem, &self.ca_key) {
            (Some(cert_pem), Some(key)) => Some(api::pki::CertAndKey {
                cert_pem: cert_pem.clone(),
                key_pem: api::tls::read_pem(key, "CA private key")?,
            }),
            _ => None,
        };
        let guard = security::Guard {
            insecure: transport.is_insecure(),
            ca_cert_pem,
            ca_signer,
            revoked: security::Revocations::default(),
            tenant_priority_max: self
                .tenant_priority_max
                .unwrap_or(security::TENANT_PRIORITY_MAX_DEFAULT),
        };
        Ok((transport, guard))
    }
}

/// Runs one control-plane member until it is told to stop.
///
/// A member whose Raft core stops (a storage failure: a full disk, an I/O error) can serve
/// nothing, so it exits with [`Error::CoreStopped`] rather than answer `Status` and `/metrics`
/// as if healthy; restarted once space is back, it resumes from its log and snapshots.
pub async fn run(config: Config) -> Result<(), Error> {
    let started = start(config).await?;
    if let Err(error) = systemd::notify("READY=1") {
        tracing::warn!(%error, "could not tell systemd that the member is ready");
    }
    started.run_until(wait_for_signal()).await
}

/// A started member, for tests that run members in process.
pub struct Started {
    pub control_plane: Arc<ControlPlane>,
    /// The address the API listens on (the configured one, with its port once bound).
    pub local_address: SocketAddr,
    /// Makes the Raft log's writes fail as on a full disk (tests only).
    pub log_fault: store::WriteFault,
    data_dir: PathBuf,
    _lock: std::fs::File,
}

impl Started {
    /// Serves until `stop` completes (then shuts Raft down), or until the Raft core stops on its
    /// own: a storage failure such as a full disk, after which the member can serve nothing, so
    /// this returns [`Error::CoreStopped`] for `vgpu-cp` to exit with rather than go on
    /// answering `Status` and `/metrics` as if healthy.
    pub async fn run_until(self, stop: impl std::future::Future<Output = ()>) -> Result<(), Error> {
        tokio::select! {
            () = stop => {}
            problem = self.core_stopped() => {
                tracing::error!(%problem, "exiting: the Raft core stopped");
                systemd::notify("STOPPING=1").ok();
                return Err(Error::CoreStopped { path: self.data_dir.clone(), problem });
            }
        }
        tracing::info!("shutting down");
        systemd::notify("STOPPING=1").ok();
        self.control_plane.replication.shutdown().await;
        Ok(())
    }

    /// Waits until the member's Raft core stops for good, and says why
    /// ([`ControlPlane::health`]).
    pub async fn core_stopped(&self) -> String {
        self.control_plane
            .replication
            .stopped(self.control_plane.id)
            .await
    }
}

pub async fn start(config: Config) -> Result<Started, Error> {
    let (transport, guard) = config.security.load()?;
    if transport.is_insecure() {
        tracing::warn!(
            "running with --insecure: plain-text gRPC, no authentication; every caller is an admin"
        );
    }
    let data_dir = config.data_dir.clone();
    let io = |source| Error::DataDir {
        path: data_dir.clone(),
        source,
    };
    std::fs::create_dir_all(&data_dir).map_err(io)?;
    let lock = std::fs::File::create(data_dir.join("lock")).map_err(io)?;
    if lock.try_lock().is_err() {
        return Err(Error::DataDirLocked(data_dir));
    }
    let existing = identity::read(&data_dir).map_err(io)?;
    let cluster_id = match (&existing, &config.mode) {
        (Some(found), _) if found.node_id != config.id => {
            return Err(Error::WrongMember {
                path: data_dir,
                found: found.node_id,
                wanted: config.id,
                cluster: found.cluster_id.clone(),
            });
        }
        (Some(found), Mode::Join { peers }) => {
            let peer = peer_cluster_id(&transport, peers, Duration::from_secs(1))
                .await
                .ok()
                .flatten();
            if let Some((peer, theirs)) = peer
                && theirs != found.cluster_id
            {
                return Err(Error::OtherCluster {
                    path: data_dir,
                    ours: found.cluster_id.clone(),
                    theirs,
                    peer,
                });
            }
            found.cluster_id.clone()
        }
        (Some(found), Mode::Bootstrap) => {
            // A member that joined a cluster restarts only as what it is (issue 22: `bootstrap`
            // on another cluster's data directory started as that cluster's member).
            if found.origin == Some(identity::Origin::Join) {
                return Err(Error::JoinedMember {
                    path: data_dir,
                    id: found.node_id,
                    cluster: found.cluster_id.clone(),
                });
            }
            found.cluster_id.clone()
        }
        (None, Mode::Bootstrap) => identity::new_cluster_id(),
        (None, Mode::Join { peers }) => {
            match peer_cluster_id(&transport, peers, Duration::from_secs(30)).await? {
                Some((_, cluster_id)) => cluster_id,
                None => unreachable!("a successful lookup names a cluster"),
            }
        }
    };
    let fresh = existing.is_none();
    if fresh {
        identity::write(
            &data_dir,
            &identity::Identity {
                cluster_id: cluster_id.clone(),
                node_id: config.id,
                origin: Some(match config.mode {
                    Mode::Bootstrap => identity::Origin::Bootstrap,
                    Mode::Join { .. } => identity::Origin::Join,
                }),
            },
        )
        .map_err(io)?;
    }
    tracing::info!(id = config.id, %cluster_id, fresh, data_dir = %data_dir.display(), "starting control-plane member");

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Listen {
            address: config.listen,
            source,
        })?;
    let local_address = listener.local_addr().map_err(|source| Error::Listen {
        address: config.listen,
        source,
    })?;
    let (replication, shared, log_fault, raft) = match &config.etcd {
        None => {
            let log_path = data_dir.join("raft.redb");
            let log = store::LogStore::open(&log_path).map_err(|source| Error::Log {
                path: log_path,
                source,
            })?;
            let log_fault = log.write_fault();
            let (state_machine, shared) =
                store::StateMachineStore::open(&data_dir).map_err(Error::StateMachine)?;
            let raft_config = openraft::Config {
                cluster_name: format!("vgpu-{cluster_id}"),
                heartbeat_interval: config.raft.heartbeat_interval_ms,
                election_timeout_min: config.raft.election_timeout_min_ms,
                election_timeout_max: config.raft.election_timeout_max_ms,
                snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
                    config.raft.snapshot_logs_since_last,
                ),
                max_in_snapshot_log_to_keep: config.raft.snapshot_keep_logs,
                install_snapshot_timeout: 10_000,
                ..Default::default()
            }
            .validate()?;
            let network = network::NetworkFactory {
                cluster_id: cluster_id.clone(),
                transport: transport.clone(),
            };
            let raft = Raft::new(
                config.id,
                Arc::new(raft_config),
                network,
                log,
                state_machine,
            )
            .await
            .map_err(|e| Error::RaftStart(e.to_string()))?;
            let replication = replication::Replication::Raft(replication::RaftReplication::new(
                config.id,
                raft.clone(),
            ));
            (replication, shared, log_fault, Some(raft))
        }
        Some(etcd) => {
            // A port of 0 (tests) is the bound one: the leader key must say where to forward.
            let advertise = match config.advertise.rsplit_once(':') {
                Some((host, "0")) => format!("{host}:{}", local_address.port()),
                _ => config.advertise.clone(),
            };
            let (replication, shared) = start_etcd(etcd, &config, &cluster_id, &advertise).await?;
            (replication, shared, store::WriteFault::default(), None)
        }
    };
    let control_plane = Arc::new(ControlPlane::new(
        config.id,
        cluster_id,
        replication,
        shared,
        config.timings.clone(),
        transport.clone(),
    ));
    let server = serve(control_plane.clone(), listener, &transport, guard)?;
    tokio::spawn(async move {
        if let Err(error) = server.await {
            tracing::error!(%error, "the API server stopped");
        }
    });

    if let Some(raft) = &raft {
        match &config.mode {
            Mode::Bootstrap => {
                let initialized = raft
                    .is_initialized()
                    .await
                    .map_err(|e| Error::RaftStart(e.to_string()))?;
                if !initialized {
                    let members = std::collections::BTreeMap::from([(
                        config.id,
                        openraft::BasicNode::new(&config.advertise),
                    )]);
                    raft.initialize(members)
                        .await
                        .map_err(|e| Error::RaftStart(e.to_string()))?;
                    tracing::info!("initialised a new one-voter cluster");
                }
            }
            Mode::Join { peers } => {
                let initialized = raft
                    .is_initialized()
                    .await
                    .map_err(|e| Error::RaftStart(e.to_string()))?;
                if !initialized {
                    join(&transport, peers, config.id, &config.advertise).await?;
                }
            }
        }
    }
    tokio::spawn(control_plane.clone().leader_loop());
    Ok(Started {
        control_plane,
        local_address,
        log_fault,
        data_dir,
        _lock: lock,
    })
}

/// Connects to etcd, claims (`bootstrap`) or checks (`join`, a restart) the prefix for
/// `cluster_id`, and starts following the log from its newest snapshot: the member's state is
/// in etcd, its data directory keeps only its identity.
async fn start_etcd(
    etcd: &EtcdStore,
    config: &Config,
    cluster_id: &str,
    advertise: &str,
) -> Result<(replication::Replication, Arc<store::Shared>), Error> {
    let client_config = etcd.client_config()?;
    let mut log = etcd_store::EtcdLog::connect(&client_config).await?;
    log.claim_cluster(cluster_id).await?;
    tracing::info!(
        endpoints = %etcd.endpoints.join(","),
        prefix = %etcd.prefix,
        "the pool's state is in etcd"
    );
    let shared = Arc::new(store::Shared {
        applied: std::sync::RwLock::new(store::Applied::default()),
        applied_index: tokio::sync::watch::channel(0).0,
        watchers: watchers::NodeWatchers::default(),
    });
    let settings = etcd_replication::EtcdSettings {
        lease_ttl: etcd.lease_ttl,
        snapshot_every_entries: config.raft.snapshot_logs_since_last,
    };
    let replication = etcd_replication::EtcdReplication::start(
        config.id,
        advertise,
        log,
        shared.clone(),
        &settings,
        config.timings.request_deadline,
    );
    Ok((replication::Replication::Etcd(replication), shared))
}

/// Longest a call may take to answer (its response head; a watch stream then runs on), unless
/// `Timings::request_timeout` says otherwise. The slowest call, adding a member, waits up to
/// three request deadlines (30 s). A request whose body stops arriving (a half-open request)
/// is dropped at this bound, and what it buffered with it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Streams one connection may carry at once (a vgpuctl or agent uses a few; a member forwarding
/// many callers' writes, more).
pub const STREAMS_PER_CONNECTION_MAX: u32 = 1024;

/// Serves the gRPC API, `/metrics`, `/healthz` and the dashboard (`/ui/`) on one listener. Under
/// mTLS `/metrics` needs a client certificate of role `metrics`, `member` or `admin` (it names
/// every owner's tenants, nodes and usage); `/healthz` needs none and names nothing.
fn serve(
    control_plane: Arc<ControlPlane>,
    listener: tokio::net::TcpListener,
    transport: &api::tls::Transport,
    guard: security::Guard,
) -> Result<impl std::future::Future<Output = Result<(), Error>> + use<>, Error> {
    let guard = security::Guard {
        revoked: security::Revocations::of(control_plane.shared.clone()),
        ..guard
    };
    let guard = Arc::new(guard);
    let service = service::Service {
        control_plane: control_plane.clone(),
        guard: guard.clone(),
    };
    let size = network::MESSAGE_BYTES_MAX;
    let client_size = network::CLIENT_MESSAGE_BYTES_MAX;
    let routes = tonic::service::Routes::new(
        api::v1::pool_server::PoolServer::new(service.clone())
            .max_decoding_message_size(client_size),
    )
    .add_service(
        api::v1::agent_server::AgentServer::new(service.clone())
            .max_decoding_message_size(client_size),
    )
    .add_service(api::v1::cluster_server::ClusterServer::new(service.clone()))
    .add_service(
        api::v1::raft_server::RaftServer::new(service)
            .max_decoding_message_size(size)
            .max_encoding_message_size(size),
    );
    let metrics_plane = control_plane.clone();
    let metrics_guard = guard.clone();
    let health_plane = control_plane.clone();
    let router = routes
        .into_axum_router()
        .route(
            "/metrics",
            axum::routing::get(move |request: axum::extract::Request| {
                let control_plane = metrics_plane.clone();
                let guard = metrics_guard.clone();
                async move { metrics_answer(&control_plane, &guard, request) }
            }),
        )
        .route(
            "/healthz",
            axum::routing::get(move || {
                let control_plane = health_plane.clone();
                async move { health_answer(&control_plane) }
            }),
        );
    // The dashboard (`/ui/`), with the API's authentication (see `dashboard`).
    let router = router.merge(dashboard::router(control_plane.clone(), guard));
    // Under mTLS a connection that has not shown a client certificate is closed a minute after it
    // was accepted (`limits::Anonymous`); a request that carries one marks its connection, and
    // requests without one are bounded in number and size (`bound_anonymous`).
    let anonymous = transport
        .server_config()
        .is_some()
        .then(|| limits::Anonymous::new(control_plane.timings.anonymous_connection_max));
    let router = match anonymous.clone() {
        Some(anonymous) => router.layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let anonymous = anonymous.clone();
                async move { bound_anonymous(&anonymous, request, next).await }
            },
        )),
        None => router,
    };
    let request_timeout = control_plane.timings.request_timeout;
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)));
    // At most `CONNECTIONS_PER_PEER_MAX` connections of one address at once; one more is
    // closed as soon as it is accepted (issue 22).
    let connections = limits::PeerConnections::new(limits::CONNECTIONS_PER_PEER_MAX);
    let incoming = tokio_stream::StreamExt::filter_map(incoming, move |accepted| {
        let stream = match accepted {
            Ok(stream) => stream,
            Err(error) => return Some(Err(error)),
        };
        let peer = stream.peer_addr().ok()?.ip();
        match connections.admit(peer) {
            Some(permit) => Some(Ok(PeerStream {
                anonymous: anonymous.clone().zip(stream.peer_addr().ok()).map(
                    |(anonymous, remote)| AnonymousWatch {
                        anonymous,
                        remote,
                        accepted: std::time::Instant::now(),
                        authenticated: false,
                    },
                ),
                stream,
                _permit: permit,
            })),
            None => {
                let refused =
                    limits::CONNECTIONS_REFUSED.load(std::sync::atomic::Ordering::Relaxed);
                // Logged at the first refusal and then at powers of two, not per connection.
                if refused.is_power_of_two() {
                    tracing::warn!(%peer, refused, max = limits::CONNECTIONS_PER_PEER_MAX, "closed a connection: its address holds the most connections one peer may");
                }
                None
            }
        }
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = transport.server_config() {
        builder = builder
            .tls_config(tls)
            .map_err(|e| Error::Serve(format!("the TLS settings: {e}")))?;
    }
    // Every connection is bounded (issue 22: half-open requests and idle connections without a
    // certificate were never closed): a request is answered within REQUEST_TIMEOUT, a peer that
    // stops answering HTTP/2 pings is dropped, and a connection carries a bounded number of
    // streams.
    builder = builder
        .timeout(request_timeout)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .max_concurrent_streams(Some(STREAMS_PER_CONNECTION_MAX))
        .concurrency_limit_per_connection(STREAMS_PER_CONNECTION_MAX as usize);
    let server = builder
        .accept_http1(true)
        .add_routes(tonic::service::Routes::from(router));
    Ok(async move {
        server
            .serve_with_incoming(incoming)
            .await
            .map_err(|e| Error::Serve(e.to_string()))
    })
}

/// `GET /metrics`: the caller's certificate must allow it (`security::Guard::metrics`).
fn metrics_answer(
    control_plane: &ControlPlane,
    guard: &security::Guard,
    request: axum::extract::Request,
) -> axum::response::Response {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    // The guard reads the caller's certificate from the connection, as for a gRPC call.
    let (_, extensions, _) = tonic::Request::from_http(request).into_parts();
    let caller = tonic::Request::from_parts(tonic::metadata::MetadataMap::new(), extensions, ());
    if let Err(status) = guard.metrics(&caller, "reading /metrics") {
        let code = match status.code() {
            tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            _ => StatusCode::FORBIDDEN,
        };
        let text = format!(
            "{}\n/metrics needs a client certificate of role metrics, member or admin (`vgpu-cp cert issue --role metrics`); /healthz needs none\n",
            status.message()
        );
        return (
            code,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            text,
        )
            .into_response();
    }
    let replication = control_plane.replication.facts();
    let facts = metrics::RaftFacts {
        id: control_plane.id,
        term: replication.term,
        leader: (replication.leader != 0).then_some(replication.leader),
        last_log_index: replication.last_log_index,
        last_applied: replication.last_applied,
        storage_failure: control_plane.health().err(),
    };
    let mut text = control_plane.metrics.render(&facts, &control_plane.shared);
    // Usage and health: on the leader only (see `usage`).
    if control_plane.is_leader() {
        let reports = control_plane.reports.snapshot(&usage::Filter::All);
        let applied = control_plane.shared.read();
        usage::render(&mut text, &reports, |node| {
            applied.pool.nodes.contains_key(node)
        });
    }
    text.into_response()
}

/// `GET /healthz`, for liveness probes: `200 ok`, or `503` and why the member cannot serve
/// (its Raft core stopped, e.g. on a full disk). Needs no certificate and names nothing of the
/// pool.
fn health_answer(control_plane: &ControlPlane) -> axum::response::Response {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    let plain = [(header::CONTENT_TYPE, "text/plain; charset=utf-8")];
    match control_plane.health() {
        Ok(()) => (StatusCode::OK, plain, "ok\n".to_owned()).into_response(),
        Err(problem) => (
            StatusCode::SERVICE_UNAVAILABLE,
            plain,
            format!("{problem}\n"),
        )
            .into_response(),
    }
}

/// Under mTLS: marks the connection of `request` authenticated when the request carries a
/// client certificate (`limits::Anonymous`), and bounds a request without one (issue 22:
/// half-open requests without a certificate grew a member to 1.93 GB): its connection may have
/// at most `limits::ANONYMOUS_REQUESTS_PER_CONNECTION_MAX` such requests in flight (one more is
/// answered at once, its body never read) and its body is cut at
/// `limits::ANONYMOUS_REQUEST_BYTES_MAX`. With the request timeout and the anonymous
/// connection's lifetime, what one connection without a certificate can make a member hold is
/// a few hundred KiB for at most a minute.
async fn bound_anonymous(
    anonymous: &Arc<limits::Anonymous>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let Some(info) = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>() else {
        return next.run(request).await;
    };
    let Some(remote) = info.get_ref().remote_addr() else {
        return next.run(request).await;
    };
    if info.peer_certs().is_some_and(|certs| !certs.is_empty()) {
        anonymous.authenticated(remote);
        return next.run(request).await;
    }
    let Some(permit) = anonymous.admit_request(remote) else {
        return too_many_anonymous_requests(&request);
    };
    let request = request.map(|body| {
        axum::body::Body::new(http_body_util::Limited::new(
            body,
            limits::ANONYMOUS_REQUEST_BYTES_MAX,
        ))
    });
    let response = next.run(request).await;
    drop(permit);
    response
}

/// The answer to a request without a certificate on a connection that has the most such
/// requests in flight: a gRPC error for gRPC calls, `429` otherwise.
fn too_many_anonymous_requests(request: &axum::extract::Request) -> axum::response::Response {
    use axum::response::IntoResponse;
    let message = format!(
        "a connection without a client certificate may have at most {} requests in flight; what needs no certificate (`JoinNode` with a bootstrap token, `/healthz`) is one call at a time: wait for the answer, or connect with a client certificate",
        limits::ANONYMOUS_REQUESTS_PER_CONNECTION_MAX
    );
    let grpc = request
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/grpc"));
    if grpc {
        api::ErrorCode::Unavailable
            .status(message)
            .into_http::<axum::body::Body>()
    } else {
        (
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            format!("{message}\n"),
        )
            .into_response()
    }
}

/// An accepted connection that holds its peer's place among `limits::PeerConnections` until it
/// closes, and under mTLS is closed if no request on it showed a client certificate within
/// `limits::Anonymous::max` (checked when it reads: the server's HTTP/2 pings make an idle
/// client answer every 10 s, and one that does not answer is dropped for that).
struct PeerStream {
    stream: tokio::net::TcpStream,
    _permit: limits::ConnectionPermit,
    anonymous: Option<AnonymousWatch>,
}

struct AnonymousWatch {
    anonymous: Arc<limits::Anonymous>,
    remote: std::net::SocketAddr,
    accepted: std::time::Instant,
    /// Seen authenticated once: no more lookups.
    authenticated: bool,
}

impl AnonymousWatch {
    /// Whether the connection must close now.
    fn expired(&mut self) -> bool {
        if self.authenticated {
            return false;
        }
        if self.anonymous.is_authenticated(self.remote) {
            self.authenticated = true;
            return false;
        }
        self.anonymous
            .expired(self.remote, self.accepted, std::time::Instant::now())
    }
}

impl Drop for AnonymousWatch {
    fn drop(&mut self) {
        self.anonymous.forget(self.remote);
    }
}

impl tonic::transport::server::Connected for PeerStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl tokio::io::AsyncRead for PeerStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if let Some(watch) = self.anonymous.as_mut()
            && watch.expired()
        {
            let count = limits::ANONYMOUS_CONNECTIONS_CLOSED
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            if count.is_power_of_two() {
                tracing::info!(peer = %watch.remote, closed = count, "closed a connection that showed no client certificate within its time");
            }
            return std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no client certificate shown within the time a connection may stay anonymous",
            )));
        }
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for PeerStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Asks the peers, in turn, for their cluster id. Retries until `patience` runs out.
async fn peer_cluster_id(
    transport: &api::tls::Transport,
    peers: &[String],
    patience: Duration,
) -> Result<Option<(String, String)>, Error> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut last = String::from("no peer given");
    loop {
        for peer in peers {
            match cluster_client(transport, peer) {
                Ok(mut client) => match client.status(api::v1::ClusterStatusRequest {}).await {
                    Ok(status) => return Ok(Some((peer.clone(), status.into_inner().cluster_id))),
                    Err(status) => last = format!("{peer}: {}", status.message()),
                },
                Err(error) => last = format!("{peer}: {error}"),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::NoPeer {
                peers: peers.to_vec(),
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn cluster_client(
    transport: &api::tls::Transport,
    peer: &str,
) -> Result<api::v1::cluster_client::ClusterClient<tonic::transport::Channel>, api::tls::TlsError> {
    let channel = network::channel(transport, peer)?;
    Ok(api::v1::cluster_client::ClusterClient::new(channel))
}

/// Asks the cluster (through any peer; it forwards to the leader) to add this member.
async fn join(
    transport: &api::tls::Transport,
    peers: &[String],
    id: u64,
    advertise: &str,
) -> Result<(), Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    loop {
        for peer in peers {
            tracing::info!(%peer, id, "asking to join the cluster (learner first, voter once caught up)");
            let Ok(mut client) = cluster_client(transport, peer) else {
                continue;
            };
            let request = api::v1::AddMemberRequest {
                id,
                address: advertise.to_owned(),
            };
            match client.add_member(request).await {
                Ok(_) => {
                    tracing::info!(id, "joined the cluster as a voter");
                    return Ok(());
                }
                Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                    return Err(Error::Join(status.message().to_owned()));
                }
                Err(status) => last = format!("{peer}: {}", status.message()),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Join(last));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn wait_for_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
