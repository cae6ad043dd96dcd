//! `vgpu-cp`: parses the command line, installs logging, and runs one control-plane member.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "vgpu-cp",
    version,
    about = "The vgpu control plane: a Raft-replicated GPU pool"
)]
struct Cli {
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
        /// Address of one or more members of the cluster (comma-separated or repeated).
        #[arg(long, required = true, value_delimiter = ',')]
        peer: Vec<String>,
    },
}

#[derive(Args)]
struct Common {
    /// This member's Raft id (1 or more, unique in the cluster).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    id: u64,
    /// Address for the gRPC API, Raft traffic and /metrics.
    #[arg(long, default_value = "127.0.0.1:7401")]
    listen: SocketAddr,
    /// Address peers and clients use to reach this member (default: --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// Where the Raft log, snapshots and identity live.
    #[arg(long)]
    data_dir: PathBuf,
    /// A node agent silent for this long is marked lost and its tenants are re-placed.
    #[arg(long, default_value = "5000", env = "VGPU_NODE_LOST_TIMEOUT_MS")]
    node_lost_timeout_ms: u64,
    /// Heartbeat interval handed to agents.
    #[arg(long, default_value = "1000")]
    agent_heartbeat_ms: u64,
    /// Raft heartbeat interval.
    #[arg(long, default_value = "50")]
    raft_heartbeat_ms: u64,
    /// Lower bound of the Raft election timeout (the upper bound is twice this). openraft's
    /// leader lease equals the upper bound, so failover takes one to two upper bounds.
    #[arg(long, default_value = "250")]
    election_timeout_ms: u64,
    /// Log entries between snapshots.
    #[arg(long, default_value = "20000")]
    snapshot_every: u64,
    /// Log entries kept behind the last snapshot.
    #[arg(long, default_value = "1000")]
    snapshot_keep_logs: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn,h2=warn,tower=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let (common, mode) = match cli.command {
        Mode::Bootstrap(common) => (common, vgpu_cp::Mode::Bootstrap),
        Mode::Join { common, peer } => (common, vgpu_cp::Mode::Join { peers: peer }),
    };
    anyhow::ensure!(
        common.election_timeout_ms > common.raft_heartbeat_ms,
        "--election-timeout-ms must exceed --raft-heartbeat-ms"
    );
    let config = vgpu_cp::Config {
        mode,
        id: common.id,
        listen: common.listen,
        advertise: common
            .advertise
            .unwrap_or_else(|| common.listen.to_string()),
        data_dir: common.data_dir,
        timings: vgpu_cp::control_plane::Timings {
            node_lost_timeout: Duration::from_millis(common.node_lost_timeout_ms),
            heartbeat_interval: Duration::from_millis(common.agent_heartbeat_ms),
            ..Default::default()
        },
        raft: vgpu_cp::RaftTimings {
            heartbeat_interval_ms: common.raft_heartbeat_ms,
            election_timeout_min_ms: common.election_timeout_ms,
            election_timeout_max_ms: common.election_timeout_ms * 2,
            snapshot_logs_since_last: common.snapshot_every,
            snapshot_keep_logs: common.snapshot_keep_logs,
        },
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(vgpu_cp::run(config))
        .context("vgpu-cp failed")?;
    Ok(())
}
