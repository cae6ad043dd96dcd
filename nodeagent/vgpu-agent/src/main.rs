//! `vgpu-agent`: parses the command line, installs logging to stderr, and calls into the library.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};
use vgpu_agent::cdi::CdiConfig;
use vgpu_agent::tenant::{self, EnvConfig, ExecConfig};
use vgpu_agent::{InventorySource, JoinConfig, Timings};

#[derive(Parser)]
#[command(
    name = "vgpu-agent",
    version,
    about = "The vgpu node agent: joins a node's GPUs to the pool"
)]
struct Cli {
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
    /// Control-plane addresses, HOST:PORT (comma-separated or repeated); any member will do.
    #[arg(long, required = true, value_delimiter = ',')]
    control_plane: Vec<String>,
    /// This node's name: lowercase letters, digits, `-` and `.`.
    #[arg(long)]
    name: String,
    #[command(flatten)]
    simulate: SimulateArg,
    /// Where assignments are kept [default: /var/lib/vgpu-agent/NAME if writable, else
    /// $HOME/.local/state/vgpu-agent/NAME].
    #[arg(long, env = "VGPU_AGENT_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Node labels, KEY=VALUE (comma-separated or repeated); tenants select nodes by them.
    #[arg(long, value_delimiter = ',', value_parser = label)]
    labels: Vec<(String, String)>,
    /// Address at which this agent can be reached, HOST:PORT (informational).
    #[arg(long, default_value = "")]
    address: String,
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

/// How tenant processes are run: shared by `join` (for CDI specs), `exec` and `env`.
#[derive(Args)]
struct RuntimeArgs {
    /// The interposer to preload [default: libvgpu_cuda.so beside vgpu-agent if present, else
    /// /usr/lib/vgpu/libvgpu_cuda.so].
    #[arg(long, value_name = "PATH", env = "VGPU_INTERPOSER")]
    interposer: Option<PathBuf>,
    /// The interposers' shared-memory directory.
    #[arg(long, value_name = "DIR", env = "VGPU_SHM_DIR", default_value = tenant::SHM_DIR_DEFAULT)]
    shm_dir: PathBuf,
}

impl RuntimeArgs {
    fn interposer(&self) -> PathBuf {
        let executable = std::env::current_exe().ok();
        tenant::resolve_interposer(self.interposer.as_deref(), executable.as_deref())
    }
}

#[derive(Args)]
struct TenantArgs {
    /// The tenant, as placed with `vgpuctl place`.
    #[arg(long)]
    tenant: String,
    /// The running agent's state directory [default: as `join` chooses it for --name].
    #[arg(long, env = "VGPU_AGENT_STATE_DIR")]
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
    fn node(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(vgpu_agent::default_node_name)
    }

    fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| vgpu_agent::state::find_state_dir(&self.node()))
    }

    fn interposer(&self) -> Option<PathBuf> {
        (!self.no_interposer).then(|| self.runtime.interposer())
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

impl SimulateArg {
    fn source(&self) -> anyhow::Result<InventorySource> {
        Ok(match &self.simulate {
            Some(spec) => InventorySource::from_simulate_arg(spec)?,
            None => InventorySource::Nvml,
        })
    }
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

/// `path` made absolute against the working directory (CDI mounts need absolute paths).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
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
    match cli.command {
        Command::Inventory(args) => {
            let name = args.name.unwrap_or_else(vgpu_agent::default_node_name);
            let inventory = args.simulate.source()?.discover(&name)?;
            match args.output {
                Output::Text => print!("{}", inventory.to_text()),
                Output::Json => println!("{}", serde_json::to_string_pretty(&inventory)?),
            }
            Ok(())
        }
        Command::Exec(args) => {
            let config = ExecConfig {
                state_dir: args.tenant.state_dir(),
                node_hint: args.tenant.node(),
                interposer: args.tenant.interposer(),
                shm_dir: args.tenant.runtime.shm_dir.clone(),
                tenant: args.tenant.tenant,
                command: args.command,
            };
            match tenant::exec(config)? {}
        }
        Command::Env(args) => {
            let state_dir = args.tenant.state_dir();
            let placement =
                tenant::load_placement(&state_dir, &args.tenant.tenant, &args.tenant.node())?;
            let interposer = args.tenant.interposer();
            if let Some(path) = interposer.as_deref().filter(|path| !path.is_file()) {
                eprintln!(
                    "vgpu-agent: warning: the interposer {} does not exist",
                    path.display()
                );
            }
            let config = EnvConfig {
                interposer,
                shm_dir: args.tenant.runtime.shm_dir.clone(),
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
            let state_dir = args
                .state_dir
                .unwrap_or_else(|| vgpu_agent::default_state_dir(&args.name));
            let cdi = (!args.no_cdi).then(|| CdiConfig {
                dir: args.cdi_dir.clone().unwrap_or_else(|| {
                    vgpu_agent::cdi::default_cdi_dir(&state_dir, args.simulate.simulate.is_some())
                }),
                interposer: args.runtime.interposer(),
                shm_dir: absolute(&args.runtime.shm_dir),
                state_dir: absolute(&state_dir),
            });
            let config = JoinConfig {
                control_plane: args.control_plane,
                source: args.simulate.source()?,
                state_dir,
                labels: args.labels.into_iter().collect::<BTreeMap<_, _>>(),
                address: args.address,
                name: args.name,
                timings: Timings::default(),
                cdi,
            };
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
