//! `vgpu-cp`: parses the command line, gathers the settings (flags, `VGPU_CP_*` variables, the
//! configuration file; see `vgpu_cp::config`), installs logging, and runs one control-plane member.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use vgpu_cp::config::{ModeName, Settings};

#[derive(Parser)]
#[command(
    name = "vgpu-cp",
    version,
    about = "The vgpu control plane: a Raft-replicated GPU pool",
    after_help = "Every flag can also be set by a VGPU_CP_* variable or in the configuration file; \
                  flags win over variables, variables over the file. See docs/configuration.md."
)]
struct Cli {
    /// Configuration file (TOML) [default: $VGPU_CP_CONFIG, else /etc/vgpu/vgpu-cp.toml if it
    /// exists].
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Initialise a new one-voter cluster, or restart this member from its data directory.
    Bootstrap(Common),
    /// Join an existing cluster through a peer, or restart this member from its data directory.
    Join {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        peers: Peers,
    },
    /// Bootstrap or join as the configuration's `mode` says (one systemd unit for every member).
    Run {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        peers: Peers,
    },
}

#[derive(Args)]
struct Peers {
    /// Address of one or more members of the cluster (comma-separated or repeated) [config:
    /// peers].
    #[arg(long, value_delimiter = ',')]
    peer: Vec<String>,
}

#[derive(Args)]
struct Common {
    /// This member's Raft id (1 or more, unique in the cluster) [config: id].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    id: Option<u64>,
    /// Address for the gRPC API, Raft traffic and /metrics [default: 127.0.0.1:7401].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Address peers and clients use to reach this member [default: the listen address].
    #[arg(long)]
    advertise: Option<String>,
    /// Where the Raft log, snapshots and identity live [config: data_dir].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// A node agent silent for this long is marked lost and its tenants are re-placed [default:
    /// 5000].
    #[arg(long)]
    node_lost_timeout_ms: Option<u64>,
    /// Heartbeat interval handed to agents [default: 1000].
    #[arg(long)]
    agent_heartbeat_ms: Option<u64>,
    /// Raft heartbeat interval [default: 50].
    #[arg(long)]
    raft_heartbeat_ms: Option<u64>,
    /// Lower bound of the Raft election timeout (the upper bound is twice this). openraft's
    /// leader lease equals the upper bound, so failover takes one to two upper bounds [default:
    /// 250].
    #[arg(long)]
    election_timeout_ms: Option<u64>,
    /// Log entries between snapshots [default: 20000].
    #[arg(long)]
    snapshot_every: Option<u64>,
    /// Log entries kept behind the last snapshot [default: 1000].
    #[arg(long)]
    snapshot_keep_logs: Option<u64>,
}

impl Common {
    /// The settings these flags give (the highest layer).
    fn settings(self, mode: Option<ModeName>, peers: Vec<String>) -> Settings {
        Settings {
            mode,
            id: self.id,
            id_from_hostname: None,
            listen: self.listen,
            advertise: self.advertise,
            data_dir: self.data_dir,
            peers: (!peers.is_empty()).then_some(peers),
            node_lost_timeout_ms: self.node_lost_timeout_ms,
            agent_heartbeat_ms: self.agent_heartbeat_ms,
            raft_heartbeat_ms: self.raft_heartbeat_ms,
            election_timeout_ms: self.election_timeout_ms,
            snapshot_every: self.snapshot_every,
            snapshot_keep_logs: self.snapshot_keep_logs,
        }
    }
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn,h2=warn,tower=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(error) = run(cli) {
        // `{:#}` prints the causes on one line, without the backtrace `Debug` would add.
        eprintln!("vgpu-cp: {error:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let flags = match cli.command {
        Mode::Bootstrap(common) => common.settings(Some(ModeName::Bootstrap), Vec::new()),
        Mode::Join { common, peers } => common.settings(Some(ModeName::Join), peers.peer),
        Mode::Run { common, peers } => common.settings(None, peers.peer),
    };
    let config = vgpu_cp::config::load(
        flags,
        cli.config.as_deref(),
        &api::config::ProcessEnvironment,
    )?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(vgpu_cp::run(config))
        .context("vgpu-cp failed")?;
    Ok(())
}
