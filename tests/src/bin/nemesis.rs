//! `nemesis`: breaks a running compose cluster on purpose while clients place, release and read
//! tenants, then checks the history for linearizability, lost acknowledged writes and requests
//! that failed for good during the rolling restart (see `tests::nemesis`). Exit status 0: no
//! violation; 1: a violation (the history is in `--out`); 2: the run itself failed.
//!
//! `deploy/compose/nemesis.sh` starts the cluster, runs this and tears the cluster down:
//!
//!   deploy/compose/nemesis.sh
//!   cargo run -p tests --bin nemesis -- --project P --members cp1=127.0.0.1:17401,... --out DIR \
//!       --tls-ca-cert ca.crt --tls-cert admin.crt --tls-key admin.key     # or --insecure
//!   cargo run -p tests --bin nemesis -- --check DIR/history.jsonl      # check a kept history

use anyhow::{Context, Result, bail};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use tests::nemesis::client::Endpoint;
use tests::nemesis::docker::Project;
use tests::nemesis::{self, Config};

#[derive(Parser)]
struct Args {
    /// The compose project the cluster runs under (`docker-compose -p`).
    #[arg(long, required_unless_present = "check")]
    project: Option<String>,
    /// The members: `SERVICE=HOST:PORT` of each control-plane member's published port.
    #[arg(long, value_delimiter = ',', required_unless_present = "check")]
    members: Vec<String>,
    /// The cluster CA certificate (with --tls-cert and --tls-key: talk to the members over
    /// mutual TLS, as the compose cluster runs).
    #[arg(long, value_name = "FILE")]
    tls_ca_cert: Option<PathBuf>,
    /// An admin certificate.
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Plain text, for a cluster started with --insecure (deploy/compose/insecure.yml).
    #[arg(long, conflicts_with_all = ["tls_ca_cert", "tls_cert", "tls_key"])]
    insecure: bool,
    /// The compose network the nemesis cuts members off.
    #[arg(long, default_value = "vgpu")]
    network: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 6)]
    clients: u32,
    /// Tenant names the clients share.
    #[arg(long, default_value_t = 16)]
    names: usize,
    /// Seconds each fault lasts.
    #[arg(long, default_value_t = 8)]
    fault_seconds: u64,
    /// Seconds without faults between two faults.
    #[arg(long, default_value_t = 4)]
    quiet_seconds: u64,
    /// Seed of the clients' choices (printed; random when not given).
    #[arg(long)]
    seed: Option<u64>,
    /// Where the history and the summary go.
    #[arg(long, required_unless_present = "check")]
    out: Option<PathBuf>,
    /// Self-test: add a made-up stale read to the history; the run must fail.
    #[arg(long)]
    doctor_stale_read: bool,
    /// Only check a history written by an earlier run (`history.jsonl`).
    #[arg(long)]
    check: Option<PathBuf>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("nemesis: {error:#}");
            std::process::exit(2);
        }
    }
}

/// `Ok(false)` when the history has a violation.
fn run(args: Args) -> Result<bool> {
    if let Some(path) = &args.check {
        let operations = nemesis::read_history(path)?;
        let finals = nemesis::finals_of(&operations);
        let violations = nemesis::check(&operations, &finals);
        for violation in &violations {
            println!("VIOLATION: {violation}");
        }
        println!(
            "{} operations, {} members' final states, {} violations",
            operations.len(),
            finals.len(),
            violations.len()
        );
        return Ok(violations.is_empty());
    }
    let files = api::tls::TlsFiles::from_parts(
        args.tls_ca_cert.clone(),
        args.tls_cert.clone(),
        args.tls_key.clone(),
        ["--tls-ca-cert", "--tls-cert", "--tls-key"],
    )?;
    let transport = api::tls::Transport::choose(
        args.insecure,
        files.as_ref(),
        "pass --tls-ca-cert, --tls-cert and --tls-key with an admin certificate, or --insecure for a cluster started with --insecure",
    )?;
    let endpoints = args
        .members
        .iter()
        .map(|member| match member.split_once('=') {
            Some((service, address)) => Ok(Endpoint {
                service: service.to_owned(),
                address: address.to_owned(),
                transport: transport.clone(),
            }),
            None => bail!("--members takes SERVICE=HOST:PORT, not `{member}`"),
        })
        .collect::<Result<Vec<_>>>()?;
    if endpoints.len() != 3 {
        bail!(
            "--members names {} members; the compose cluster has three",
            endpoints.len()
        );
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let config = Config {
        project: Project {
            name: args.project.context("--project")?,
            network: args.network,
        },
        endpoints,
        clients: args.clients,
        names: args.names,
        fault_duration: Duration::from_secs(args.fault_seconds),
        quiet_duration: Duration::from_secs(args.quiet_seconds),
        seed,
        out_dir: args.out.context("--out")?,
        doctor_stale_read: args.doctor_stale_read,
    };
    let out_dir = config.out_dir.clone();
    tracing::info!(seed, out = %out_dir.display(), "nemesis run starts");
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(nemesis::run(config))?;
    for violation in &report.violations {
        println!("VIOLATION: {violation}");
    }
    print!("{}", report.summary);
    println!("history: {}", out_dir.join("history.jsonl").display());
    Ok(report.violations.is_empty())
}
