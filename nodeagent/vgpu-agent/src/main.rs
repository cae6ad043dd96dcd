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
    #[command(flatten)]
    runtime: RuntimeArgs,
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
            cdi_dir: self.cdi_dir,
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
                shm_dir: settings.shm_dir(),
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
                shm_dir: settings.shm_dir(),
                state_dir,
            };
            let environment =
                tenant::tenant_environment(&placement.node, &placement.assignment, &config, None);
            match args.output {
                EnvOutput::Shell => print!("{}", tenant::render_shell(&environment)),
                EnvOutput::Json => println!("{}", tenant::render_json(&environment)),
            }
            Ok(())
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
