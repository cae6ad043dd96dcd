//! `vgpu-agent`: parses the command line, installs logging to stderr, and calls into the library.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
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
}

#[derive(Args)]
struct SimulateArg {
    /// Simulated GPUs: COUNTxMODEL-MEMORY (e.g. 8xH100-80GB, 4xH200-141GB, 2xL40S-48GB) or the
    /// path of a .toml/.json topology file. Required until NVML discovery is built.
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
        Command::Join(args) => {
            let state_dir = args
                .state_dir
                .unwrap_or_else(|| vgpu_agent::default_state_dir(&args.name));
            let config = JoinConfig {
                control_plane: args.control_plane,
                source: args.simulate.source()?,
                state_dir,
                labels: args.labels.into_iter().collect::<BTreeMap<_, _>>(),
                address: args.address,
                name: args.name,
                timings: Timings::default(),
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
