//! `vgpu-dra`: parses the command line, installs tracing, and runs the driver
//! ([`vgpu_dra::run`]) or prints the node's ResourceSlice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// Where the agent's state directories are on a node (`/var/lib/vgpu-agent/NODE`).
const AGENT_STATE_ROOT: &str = "/var/lib/vgpu-agent";

#[derive(Parser)]
#[command(
    name = "vgpu-dra",
    version,
    about = "The vgpu Kubernetes DRA driver (vgpu.dev)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serves the kubelet and publishes the node's ResourceSlice until SIGTERM.
    Run(Box<RunArgs>),
    /// Prints the ResourceSlice the driver would publish for this node (JSON, which YAML tools
    /// read too).
    PrintSlice(NodeArgs),
    /// Copies the interposer and the NCCL plugin from the image onto the host (the DaemonSet's
    /// init container), since the CDI specs mount them from the host.
    Install {
        /// Where the image has them.
        #[arg(long, default_value = "/usr/lib/vgpu")]
        from: PathBuf,
        /// The host directory (mounted into the init container).
        #[arg(long)]
        to: PathBuf,
    },
}

#[derive(clap::Args)]
struct NodeArgs {
    /// The Kubernetes node this runs on (the DaemonSet passes spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Simulated GPUs (`4xH100-80GB`) or a topology file instead of NVML discovery.
    #[arg(long)]
    simulate: Option<String>,
}

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// The kubelet's root directory (its sockets live under plugins_registry/ and plugins/).
    #[arg(long, default_value = vgpu_dra::kubelet::KUBELET_ROOT_DEFAULT)]
    kubelet_root: PathBuf,
    /// Where the checkpoint of prepared claims lives.
    #[arg(long, default_value = "/var/lib/vgpu-dra")]
    state_dir: PathBuf,
    /// Where the CDI specs go (containerd and CRI-O read /var/run/cdi).
    #[arg(long, default_value = vgpu_agent::cdi::SYSTEM_CDI_DIR)]
    cdi_dir: PathBuf,
    /// The shared-memory directory of the tenants' private directories.
    #[arg(long, default_value = vgpu_agent::tenant::SHM_DIR_DEFAULT)]
    shm_dir: PathBuf,
    /// The node's agent runs MPS (`vgpu-agent join --mps`): containers get its MPS pipes, as
    /// `vgpu-agent exec` gives tenants (latency tenants excepted, the agent's default).
    #[arg(long)]
    mps: bool,
    /// The interposer on the host, mounted into every container; the NCCL plugin is mounted too
    /// when it is beside it.
    #[arg(long, default_value = vgpu_agent::tenant::INTERPOSER_SYSTEM_PATH)]
    interposer: PathBuf,
    /// How long one claim's read from the apiserver may take, in seconds.
    #[arg(long, default_value_t = 10)]
    apiserver_timeout_s: u64,
    #[command(flatten)]
    control_plane: ControlPlaneArgs,
}

/// The second stage: with --control-plane, each claim is a pinned tenant of the control plane
/// and the node's agent (`vgpu-agent join --kubernetes-managed`) makes it a tenant on the node.
#[derive(clap::Args)]
struct ControlPlaneArgs {
    /// The control-plane members, HOST:PORT[,HOST:PORT...]. Without it the driver runs the first
    /// stage: claims become tenants on the node only, unknown to the control plane.
    #[arg(long, value_delimiter = ',')]
    control_plane: Vec<String>,
    /// The state directory of the node's agent: its node key, its certificate (tls/) and the
    /// tenant files the driver waits for [default: /var/lib/vgpu-agent/NODE_NAME, the agent's].
    #[arg(long)]
    agent_state_dir: Option<PathBuf>,
    /// The cluster CA certificate [default: AGENT_STATE_DIR/tls/ca.crt].
    #[arg(long)]
    tls_ca_cert: Option<PathBuf>,
    /// The node's agent certificate [default: AGENT_STATE_DIR/tls/agent.crt].
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// Its key [default: AGENT_STATE_DIR/tls/agent.key].
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Plain-text gRPC, for a control plane started with --insecure.
    #[arg(long)]
    insecure: bool,
    /// How long a prepare waits for the agent to write the claim's tenant (and an unprepare for
    /// it to go), in seconds; the kubelet retries after.
    #[arg(long, default_value_t = vgpu_dra::pool::PLACEMENT_TIMEOUT_DEFAULT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=600))]
    placement_timeout: u64,
}

impl ControlPlaneArgs {
    fn config(self, node: &str) -> Option<vgpu_dra::pool::ControlPlaneConfig> {
        if self.control_plane.is_empty() {
            return None;
        }
        let agent_state_dir = self
            .agent_state_dir
            .unwrap_or_else(|| Path::new(AGENT_STATE_ROOT).join(node));
        let defaults = vgpu_agent::bootstrap::Security::default_files(&agent_state_dir);
        let tls = (!self.insecure).then(|| api::tls::TlsFiles {
            ca_cert: self.tls_ca_cert.unwrap_or(defaults.ca_cert),
            cert: self.tls_cert.unwrap_or(defaults.cert),
            key: self.tls_key.unwrap_or(defaults.key),
        });
        Some(vgpu_dra::pool::ControlPlaneConfig {
            endpoints: self.control_plane,
            tls,
            agent_state_dir,
            placement_timeout: Duration::from_secs(self.placement_timeout),
        })
    }
}

fn inventory_source(args: &NodeArgs) -> anyhow::Result<vgpu_agent::InventorySource> {
    Ok(match &args.simulate {
        Some(spec) => vgpu_agent::InventorySource::from_simulate_arg(spec)?,
        None => vgpu_agent::InventorySource::Nvml,
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().command {
        Command::PrintSlice(args) => {
            let inventory = inventory_source(&args)?.discover(&args.node_name)?;
            let slice = vgpu_dra::slices::resource_slice(&inventory, &Default::default(), 0);
            let mut value = serde_json::to_value(&slice)?;
            value["apiVersion"] = "resource.k8s.io/v1".into();
            value["kind"] = "ResourceSlice".into();
            // JSON, which is YAML too: YAML 1.1 readers (kubectl's, PyYAML) take an unquoted
            // bus id such as 0000:18:00.0 for a number, and serde_yaml writes YAML 1.2.
            println!("{}", serde_json::to_string_pretty(&value)?);
            Ok(())
        }
        Command::Install { from, to } => {
            for installed in vgpu_dra::install_libraries(&from, &to)? {
                tracing::info!("installed {}", installed.display());
            }
            Ok(())
        }
        Command::Run(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(run(*args))
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let node = args.node.node_name.clone();
    api::names::validate("node", &node)?;
    anyhow::ensure!(
        args.kubelet_root.is_absolute(),
        "--kubelet-root {} is relative; the kubelet dials the socket path the driver reports, so give the absolute path (usually /var/lib/kubelet)",
        args.kubelet_root.display()
    );
    let control_plane = args.control_plane.config(&node);
    // The tenant's environment names the state directory of whoever keeps its tenant: the
    // agent's in the second stage.
    let tenant_state_dir = control_plane
        .as_ref()
        .map_or_else(|| args.state_dir.clone(), |cp| cp.agent_state_dir.clone());
    let stage = if control_plane.is_some() {
        vgpu_dra::driver::Stage::ControlPlane
    } else {
        vgpu_dra::driver::Stage::Node
    };
    let config = vgpu_dra::RunConfig {
        control_plane,
        inventory: inventory_source(&args.node)?,
        driver: vgpu_dra::driver::DriverConfig {
            node,
            state_dir: args.state_dir.clone(),
            cdi: vgpu_agent::cdi::CdiConfig {
                dir: args.cdi_dir,
                interposer: args.interposer,
                mps_pipe_dir: args.mps.then(|| vgpu_agent::mps::pipe_dir(&args.shm_dir)),
                shm_dir: args.shm_dir,
                state_dir: tenant_state_dir,
                mps_tenants: Default::default(),
            },
            quantum_ns: tenant_abi::compute::QUANTUM_NS_DEFAULT,
            stage,
        },
        plugin: vgpu_dra::kubelet::PluginConfig {
            kubelet_root: args.kubelet_root,
            apiserver_timeout: Duration::from_secs(args.apiserver_timeout_s),
        },
    };
    let client = kube::Client::try_default().await.context(
        "cannot reach the apiserver; inside a pod the service account is used, elsewhere set KUBECONFIG",
    )?;
    let shutdown = vgpu_agent::shutdown_signal()?;
    vgpu_dra::run(config, client, shutdown).await?;
    Ok(())
}
