//! `vgpu-agent`: parses the command line, gathers the settings (flags, `VGPU_AGENT_*` variables,
//! the configuration file; see `vgpu_agent::config`), installs logging to stderr, and calls into
//! the library.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use vgpu_agent::config::Settings;
use vgpu_agent::tenant::{self, EnvConfig, ExecConfig};

#[derive(Parser)]
#[command(
    name = "vgpu-agent",
    version,
    about = "The vgpu node agent: joins a node's GPUs to the pool",
    after_help = "Every setting flag can also be set by a VGPU_AGENT_* variable or in the \
                  configuration file; flags win over variables, variables over the file. See \
                  docs/configuration.md."
)]
struct Cli {
    /// Configuration file (TOML) [default: $VGPU_AGENT_CONFIG, else /etc/vgpu/vgpu-agent.toml if
    /// it exists].
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Register this node with the control plane, heartbeat, and follow its assignments until
    /// SIGINT or SIGTERM.
    Join(JoinArgs),
    /// Print the GPU inventory that `join` would register.
    Inventory(InventoryArgs),
    /// Run a command inside a tenant's slice on this node (replaces this process).
    Exec(ExecArgs),
    /// Print the environment `exec` would give a tenant's processes, for container runtimes.
    Env(EnvArgs),
    /// Simulate many nodes in this one process (scale tests): each registers, heartbeats and
    /// watches its assignments as `join --simulate` does, until SIGINT, SIGTERM or --duration;
    /// then prints a summary.
    SimulateFleet(FleetArgs),
}

#[derive(Args)]
struct FleetArgs {
    /// Control-plane addresses, HOST:PORT (comma-separated or repeated); nodes spread over them
    /// [config: control_plane].
    #[arg(long, value_delimiter = ',')]
    control_plane: Vec<String>,
    /// How many nodes to simulate.
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// The simulated GPUs of every node: COUNTxMODEL-MEMORY or a .toml/.json topology file.
    #[arg(long, value_name = "SPEC", default_value = "8xH100-80GB")]
    spec: String,
    /// Node names are PREFIX-00000, PREFIX-00001, ...
    #[arg(long, value_name = "PREFIX", default_value = "sim")]
    name_prefix: String,
    /// Number of the first node (to run several fleets against one cluster).
    #[arg(long, default_value_t = 0)]
    first_index: usize,
    /// Labels of every node, KEY=VALUE (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', value_parser = label)]
    labels: Vec<(String, String)>,
    /// Heartbeat intervals vary by up to this many percent either way.
    #[arg(long, default_value_t = 10)]
    heartbeat_jitter_percent: u32,
    /// Registrations in flight at once while the fleet ramps up.
    #[arg(long, default_value_t = vgpu_agent::fleet::REGISTRATIONS_IN_FLIGHT_DEFAULT)]
    registrations_in_flight: usize,
    /// Nodes that share one HTTP/2 connection to each control-plane address.
    #[arg(long, default_value_t = vgpu_agent::fleet::NODES_PER_CONNECTION_DEFAULT)]
    nodes_per_connection: usize,
    /// Do not watch assignments (heartbeats only).
    #[arg(long)]
    no_watch: bool,
    /// Send heartbeats without a GPU health report.
    #[arg(long)]
    no_health: bool,
    /// Plain-text gRPC, for a control plane started with --insecure.
    #[arg(long)]
    insecure: bool,
    /// The cluster CA certificate (with --tls-cert and --tls-key: mutual TLS).
    #[arg(long, value_name = "FILE")]
    tls_ca_cert: Option<PathBuf>,
    /// A certificate with the admin role (`vgpu-cp cert issue --role admin`): one identity acts
    /// for every simulated node.
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key.
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Stop this many seconds after every node registered [default: run until SIGINT/SIGTERM].
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    /// Milliseconds between progress lines while nodes register.
    #[arg(long, default_value_t = 1000)]
    progress_ms: u64,
    /// Also write the summary as JSON to this file.
    #[arg(long, value_name = "FILE")]
    summary_json: Option<PathBuf>,
}

#[derive(Args)]
struct JoinArgs {
    /// Control-plane addresses, HOST:PORT (comma-separated or repeated); any member will do
    /// [config: control_plane].
    #[arg(long, value_delimiter = ',')]
    control_plane: Vec<String>,
    /// This node's name: lowercase letters, digits, `-` and `.` [default: the host name].
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    simulate: SimulateArg,
    /// Where assignments are kept [default: /var/lib/vgpu-agent/NAME if writable, else
    /// $HOME/.local/state/vgpu-agent/NAME].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Node labels, KEY=VALUE (comma-separated or repeated); tenants select nodes by them.
    #[arg(long, value_delimiter = ',', value_parser = label)]
    labels: Vec<(String, String)>,
    /// Address at which this agent can be reached, HOST:PORT (informational).
    #[arg(long)]
    address: Option<String>,
    /// Where the CDI spec of the placed tenants goes [default: /var/run/cdi if writable, else
    /// STATE_DIR/cdi; always STATE_DIR/cdi with --simulate].
    #[arg(long, value_name = "DIR", conflicts_with = "no_cdi")]
    cdi_dir: Option<PathBuf>,
    /// Write no CDI spec.
    #[arg(long)]
    no_cdi: bool,
    /// The NIC speed, in Gb/s, that tenants' NCCL traffic shares by bandwidth weight [default:
    /// 100].
    #[arg(long, value_name = "GBPS")]
    nic_gbps: Option<u32>,
    /// CPU that work outside vgpu keeps on this node (`4`, `0.5`, `500m`): the node registers
    /// its online CPUs less this, and tenants' `--cpu` is placed against the rest [default: 0]
    /// [config: reserved_cpu].
    #[arg(long, value_name = "CPUS", value_parser = vgpu_agent::config::parse_reserved_cpu)]
    reserved_cpu: Option<u64>,
    /// Host memory that work outside vgpu keeps on this node (`16GiB`): the node registers its
    /// MemTotal less this [default: 0] [config: reserved_host_memory].
    #[arg(long, value_name = "SIZE", value_parser = vgpu_agent::config::parse_reserved_host_memory)]
    reserved_host_memory: Option<u64>,
    /// Pinned host memory this node gives swapped-out borrowed GPU memory (elastic memory,
    /// `256GiB`; `0`: no swap), split evenly over its GPUs [default: a quarter of the host
    /// memory the node offers tenants] [config: swap_host_memory].
    #[arg(long, value_name = "SIZE", value_parser = vgpu_agent::config::parse_swap_host_memory)]
    swap_host_memory: Option<u64>,
    /// One swap staging file per GPU in the shared-memory directory, of the GPU's share of
    /// `swap_host_memory`, shared by its tenant processes (experimental; `/dev/shm` must hold
    /// it) [default: false] [config: shared_staging].
    #[arg(long)]
    shared_staging: bool,
    /// Concurrent sharing: run NVIDIA MPS for the node's GPUs and partition SMs for
    /// latency-sensitive tenants (docs: nodeagent/vgpu-agent/README.md) [config: mps].
    #[arg(long)]
    mps: bool,
    /// On an MPS node, which tenants are MPS clients: `non-latency` (every tenant but latency
    /// tenants, which keep a context of their own, fault-isolated) or `all` (latency tenants
    /// too: they give up fault isolation for running side by side) [default: non-latency]
    /// [config: mps_tenants].
    #[arg(long, value_name = "WHICH", value_parser = vgpu_agent::mps::MpsTenants::parse)]
    mps_tenants: Option<vgpu_agent::mps::MpsTenants>,
    /// On an MPS node, leave each GPU's SMs to the hardware's split instead of redistributing
    /// them among burst tenants by their measured progress [default: redistribute]
    /// [config: redistribute].
    #[arg(long)]
    no_redistribute: bool,
    /// The kube-scheduler allocates this node's GPUs through the DRA driver `vgpu.dev`: the
    /// control plane places no tenant here itself, only the claims' pinned tenants
    /// (docs/kubernetes.md) [config: kubernetes_managed].
    #[arg(long)]
    kubernetes_managed: bool,
    #[command(flatten)]
    security: SecurityArgs,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

/// How the agent reaches the control plane: certificates, a bootstrap token, or plain text.
#[derive(Args)]
struct SecurityArgs {
    /// Plain-text gRPC without certificates, for a control plane started with --insecure
    /// [config: insecure].
    #[arg(long)]
    insecure: bool,
    /// The cluster CA certificate [default: STATE_DIR/tls/ca.crt].
    #[arg(long, value_name = "FILE")]
    tls_ca_cert: Option<PathBuf>,
    /// This agent's certificate (role agent, common name = the node name) [default:
    /// STATE_DIR/tls/agent.crt].
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// Its key [default: STATE_DIR/tls/agent.key].
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// A bootstrap token from `vgpu-cp token create`: used once, while the certificate files do
    /// not exist, to get them [config: token].
    #[arg(long)]
    token: Option<String>,
    /// The pin of the cluster CA, `sha256:HEX` (printed by `vgpu-cp token create` and `vgpu-cp
    /// ca hash`); required with --token [config: ca_cert_hash].
    #[arg(long, value_name = "sha256:HEX")]
    ca_cert_hash: Option<String>,
}

impl JoinArgs {
    fn settings(self) -> Settings {
        Settings {
            control_plane: (!self.control_plane.is_empty()).then_some(self.control_plane),
            name: self.name,
            simulate: self.simulate.simulate,
            state_dir: self.state_dir,
            labels: (!self.labels.is_empty())
                .then(|| self.labels.into_iter().collect::<BTreeMap<_, _>>()),
            address: self.address,
            cdi: self.no_cdi.then_some(false),
            nic_gbps: self.nic_gbps,
            reserved_cpu: self.reserved_cpu,
            reserved_host_memory: self.reserved_host_memory,
            swap_host_memory: self.swap_host_memory,
            shared_staging: self.shared_staging.then_some(true),
            mps: self.mps.then_some(true),
            mps_tenants: self.mps_tenants,
            redistribute: self.no_redistribute.then_some(false),
            kubernetes_managed: self.kubernetes_managed.then_some(true),
            cdi_dir: self.cdi_dir,
            insecure: self.security.insecure.then_some(true),
            tls_ca_cert: self.security.tls_ca_cert,
            tls_cert: self.security.tls_cert,
            tls_key: self.security.tls_key,
            token: self.security.token,
            ca_cert_hash: self.security.ca_cert_hash,
            ..self.runtime.settings()
        }
    }
}

/// How tenant processes are run: shared by `join` (for CDI specs), `exec` and `env`.
#[derive(Args)]
struct RuntimeArgs {
    /// The interposer to preload [default: libvgpu_cuda.so beside vgpu-agent if present, else
    /// /usr/lib/vgpu/libvgpu_cuda.so].
    #[arg(long, value_name = "PATH")]
    interposer: Option<PathBuf>,
    /// The interposers' shared-memory directory [default: /dev/shm/vgpu].
    #[arg(long, value_name = "DIR")]
    shm_dir: Option<PathBuf>,
}

impl RuntimeArgs {
    fn settings(self) -> Settings {
        Settings {
            interposer: self.interposer,
            shm_dir: self.shm_dir,
            ..Settings::default()
        }
    }
}

#[derive(Args)]
struct TenantArgs {
    /// The tenant, as placed with `vgpuctl place`.
    #[arg(long)]
    tenant: String,
    /// The running agent's state directory [default: as `join` chooses it for --name].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// This node's name, as given to `join` [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// Run without the interposer: nothing is enforced (for debugging). Wins over --interposer.
    #[arg(long)]
    no_interposer: bool,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

impl TenantArgs {
    fn settings(self) -> (String, bool, Settings) {
        let settings = Settings {
            state_dir: self.state_dir,
            name: self.name,
            ..self.runtime.settings()
        };
        (self.tenant, self.no_interposer, settings)
    }
}

#[derive(Args)]
struct ExecArgs {
    #[command(flatten)]
    tenant: TenantArgs,
    /// The command and its arguments, after `--`.
    #[arg(required = true, num_args = 1.., last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct EnvArgs {
    #[command(flatten)]
    tenant: TenantArgs,
    /// Output format: `export K='V'` lines, or a JSON object.
    #[arg(short, long, value_enum, default_value_t = EnvOutput::Shell)]
    output: EnvOutput,
}

#[derive(Clone, Copy, ValueEnum)]
enum EnvOutput {
    Shell,
    Json,
}

#[derive(Args)]
struct SimulateArg {
    /// Simulated GPUs: COUNTxMODEL-MEMORY (e.g. 8xH100-80GB, 4xH200-141GB, 2xL40S-48GB) or the
    /// path of a .toml/.json topology file. Without it the GPUs are discovered through NVML.
    #[arg(long, value_name = "SPEC")]
    simulate: Option<String>,
}

#[derive(Args)]
struct InventoryArgs {
    #[command(flatten)]
    simulate: SimulateArg,
    /// Node name, which the simulated GPU uuids derive from [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn label(text: &str) -> Result<(String, String), String> {
    vgpu_agent::parse_label(text).map_err(|error| error.to_string())
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,h2=warn,tower=warn,hyper=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Err(error) = run(cli) {
        // The library's messages already include their causes; `{error}` avoids repeating them.
        eprintln!("vgpu-agent: {error}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let environment = api::config::ProcessEnvironment;
    let executable = std::env::current_exe().ok();
    let load = |flags| vgpu_agent::config::load(flags, cli.config.as_deref(), &environment);
    match cli.command {
        Command::Inventory(args) => {
            let flags = Settings {
                simulate: args.simulate.simulate,
                name: args.name,
                ..Settings::default()
            };
            let (settings, _) = load(flags)?;
            let inventory = settings.inventory_source()?.discover(&settings.node())?;
            match args.output {
                Output::Text => print!("{}", inventory.to_text()),
                Output::Json => println!("{}", serde_json::to_string_pretty(&inventory)?),
            }
            Ok(())
        }
        Command::Exec(args) => {
            let (tenant, no_interposer, flags) = args.tenant.settings();
            let (settings, _) = load(flags)?;
            let config = ExecConfig {
                state_dir: settings.tenant_state_dir(),
                node_hint: settings.node(),
                interposer: (!no_interposer).then(|| settings.interposer(executable.as_deref())),
                shm_dir: settings.tenant_shm_dir(),
                mps_pipe_dir: settings.mps_pipe_dir(&settings.tenant_shm_dir()),
                mps_tenants: settings.mps_tenants.unwrap_or_default(),
                tenant,
                command: args.command,
            };
            match tenant::exec(config)? {}
        }
        Command::Env(args) => {
            let (tenant, no_interposer, flags) = args.tenant.settings();
            let (settings, _) = load(flags)?;
            let state_dir = settings.tenant_state_dir();
            let placement = tenant::load_placement(&state_dir, &tenant, &settings.node())?;
            let interposer = (!no_interposer).then(|| settings.interposer(executable.as_deref()));
            if let Some(path) = interposer.as_deref().filter(|path| !path.is_file()) {
                eprintln!(
                    "vgpu-agent: warning: the interposer {} does not exist",
                    path.display()
                );
            }
            let config = EnvConfig {
                interposer,
                shm_dir: settings.tenant_shm_dir(),
                state_dir,
                mps_pipe_dir: settings.mps_pipe_dir(&settings.tenant_shm_dir()),
                mps_tenants: settings.mps_tenants.unwrap_or_default(),
            };
            let environment =
                tenant::tenant_environment(&placement.node, &placement.assignment, &config, None);
            match args.output {
                EnvOutput::Shell => print!("{}", tenant::render_shell(&environment)),
                EnvOutput::Json => println!("{}", tenant::render_json(&environment)),
            }
            Ok(())
        }
        Command::SimulateFleet(mut args) => {
            let flags = Settings {
                control_plane: Some(std::mem::take(&mut args.control_plane))
                    .filter(|addresses| !addresses.is_empty()),
                ..Settings::default()
            };
            let (settings, _) = load(flags)?;
            simulate_fleet(args, settings.control_plane.unwrap_or_default())
        }
        Command::Join(args) => {
            let (settings, file) = load(args.settings())?;
            let config = settings.join(file.as_deref(), executable.as_deref())?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|error| anyhow::anyhow!("cannot start the async runtime: {error}"))?;
            runtime.block_on(async {
                let shutdown = vgpu_agent::shutdown_signal()
                    .map_err(|error| anyhow::anyhow!("cannot install signal handlers: {error}"))?;
                vgpu_agent::join(config, shutdown).await?;
                anyhow::Ok(())
            })
        }
    }
}

fn simulate_fleet(args: FleetArgs, control_plane: Vec<String>) -> anyhow::Result<()> {
    use api::tls::{TlsFiles, Transport};
    use vgpu_agent::fleet::FleetConfig;
    let files = TlsFiles::from_parts(
        args.tls_ca_cert,
        args.tls_cert,
        args.tls_key,
        ["--tls-ca-cert", "--tls-cert", "--tls-key"],
    )?;
    let transport = Transport::choose(
        args.insecure,
        files.as_ref(),
        "pass --insecure for a control plane started with --insecure, or --tls-ca-cert, --tls-cert and --tls-key with an admin certificate",
    )?;
    let duration = args
        .duration
        .map(|seconds| {
            std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
                anyhow::anyhow!("--duration {seconds} is not a number of seconds >= 0")
            })
        })
        .transpose()?;
    let config = FleetConfig {
        name_prefix: args.name_prefix,
        first_index: args.first_index,
        labels: args.labels.into_iter().collect(),
        heartbeat_jitter_percent: args.heartbeat_jitter_percent,
        registrations_in_flight: args.registrations_in_flight,
        nodes_per_connection: args.nodes_per_connection,
        watch: !args.no_watch,
        report_health: !args.no_health,
        transport,
        duration,
        progress_interval: std::time::Duration::from_millis(args.progress_ms),
        ..FleetConfig::new(control_plane, args.count, &args.spec)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("cannot start the async runtime: {error}"))?;
    let summary = runtime.block_on(async {
        let shutdown = vgpu_agent::shutdown_signal()
            .map_err(|error| anyhow::anyhow!("cannot install signal handlers: {error}"))?;
        anyhow::Ok(vgpu_agent::fleet::simulate_fleet(config, shutdown).await?)
    })?;
    print!("{summary}");
    if let Some(path) = args.summary_json {
        let json = serde_json::to_string_pretty(&summary)?;
        std::fs::write(&path, json + "\n")
            .map_err(|error| anyhow::anyhow!("cannot write {}: {error}", path.display()))?;
    }
    Ok(())
}
