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
    /// The cluster CA: create one, or print the pin agents join with.
    #[command(subcommand)]
    Ca(CaCommand),
    /// Certificates signed by the cluster CA.
    #[command(subcommand)]
    Cert(CertCommand),
    /// Bootstrap tokens for `vgpu-agent join --token`.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Write a stopped pool's state to a file, to import it on the other store (docs/etcd.md).
    Export(ExportArgs),
    /// Make an exported pool's state the first snapshot of a new cluster on the store these
    /// settings name (an empty --data-dir, and an empty --etcd-prefix on etcd); then start the
    /// member with `vgpu-cp bootstrap` and the same settings.
    Import {
        /// The file `vgpu-cp export` wrote.
        #[arg(long = "in", value_name = "FILE")]
        input: PathBuf,
        #[command(flatten)]
        common: Common,
    },
}

/// Where `vgpu-cp export` reads the stopped pool, and where it writes.
#[derive(Args)]
struct ExportArgs {
    /// The data directory of one of the pool's members, on the Raft store (the one that led
    /// last has every committed entry).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "etcd_endpoints",
        conflicts_with = "etcd_endpoints"
    )]
    data_dir: Option<PathBuf>,
    /// The etcd cluster that holds the pool, on the etcd store: its client URLs.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    etcd_endpoints: Vec<String>,
    /// The pool's key prefix in etcd.
    #[arg(long, value_name = "PREFIX", default_value = vgpu_cp::ETCD_PREFIX_DEFAULT)]
    etcd_prefix: String,
    /// The CA certificate that signed etcd's server certificates (mTLS to etcd).
    #[arg(long, value_name = "FILE", requires_all = ["etcd_cert", "etcd_key"])]
    etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd.
    #[arg(long, value_name = "FILE")]
    etcd_cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, value_name = "FILE")]
    etcd_key: Option<PathBuf>,
    /// Where the export goes [default: standard output, when it is not a terminal].
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create a new cluster CA: DIR/ca.crt and DIR/ca.key (mode 0600).
    Init {
        /// Where the CA goes.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// The CA's common name.
        #[arg(long, default_value = "vgpu cluster CA")]
        common_name: String,
        /// Validity in days.
        #[arg(long, default_value_t = api::pki::CA_DAYS_DEFAULT)]
        days: u32,
        /// When DIR already holds ca.crt and ca.key, keep them and print the pin instead of
        /// failing: for init containers that run on every start (deploy/compose).
        #[arg(long)]
        keep_existing: bool,
    },
    /// Print the `sha256:` pin of a CA certificate, for `vgpu-agent join --ca-cert-hash`.
    Hash {
        /// The CA certificate.
        #[arg(long, value_name = "FILE")]
        ca_cert: PathBuf,
    },
}

#[derive(Subcommand)]
enum CertCommand {
    /// Issue a certificate and key (OUT_DIR/NAME.crt, OUT_DIR/NAME.key with mode 0600).
    Issue {
        /// The CA's directory, as `ca init` made it (ca.crt and ca.key).
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// admin, tenant:OWNER, agent (NAME = the node name), member (NAME = the member id) or
        /// metrics (a Prometheus scraper: `GET /metrics` only).
        #[arg(long, value_parser = role)]
        role: api::tls::Role,
        /// The certificate's common name (and file name).
        #[arg(long)]
        name: String,
        /// DNS names or IP addresses the holder serves on (members: every address peers,
        /// agents and vgpuctl use); comma-separated or repeated.
        #[arg(long, value_delimiter = ',')]
        host: Vec<String>,
        /// Validity in days.
        #[arg(long, default_value_t = api::pki::CERT_DAYS_DEFAULT)]
        days: u32,
        /// Where the files go.
        #[arg(long, value_name = "DIR")]
        out_dir: PathBuf,
    },
    /// Print a certificate's serial number (what `cert revoke --serial` takes).
    Serial {
        /// The certificate.
        #[arg(long, value_name = "FILE")]
        cert: PathBuf,
    },
    /// Revoke a certificate (needs an admin certificate): every member refuses it from then on.
    Revoke {
        /// The certificate to revoke.
        #[arg(
            long,
            value_name = "FILE",
            required_unless_present = "serial",
            conflicts_with = "serial"
        )]
        file: Option<PathBuf>,
        /// Or its serial number, hex.
        #[arg(long)]
        serial: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// How an admin command reaches the cluster: a member and an admin certificate.
#[derive(clap::Args)]
struct AdminArgs {
    /// A control-plane member, HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:7401")]
    endpoint: String,
    /// The cluster CA certificate.
    #[arg(long, value_name = "FILE")]
    ca_cert: PathBuf,
    /// An admin certificate.
    #[arg(long, value_name = "FILE")]
    cert: PathBuf,
    /// Its key.
    #[arg(long, value_name = "FILE")]
    key: PathBuf,
}

impl AdminArgs {
    /// The mutual-TLS transport these files make, and the endpoint.
    fn connect(self) -> anyhow::Result<(api::tls::Transport, String)> {
        let files = api::tls::TlsFiles {
            ca_cert: self.ca_cert,
            cert: self.cert,
            key: self.key,
        };
        Ok((
            api::tls::Transport::choose(false, Some(&files), "")?,
            self.endpoint,
        ))
    }
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create a short-lived bootstrap token (needs an admin certificate) and print it with the
    /// `vgpu-agent join` flags that use it.
    Create {
        /// How long the token is valid: `30m`, `1h`, `24h` (at most 7 days).
        #[arg(long, default_value = "1h", value_parser = ttl)]
        ttl: std::time::Duration,
        #[command(flatten)]
        admin: AdminArgs,
        /// Also write the token and the CA pin to FILE (mode 0600) as a vgpu-agent configuration
        /// file (keys `token` and `ca_cert_hash`), for agents in images without a shell: point
        /// `VGPU_AGENT_CONFIG` at it.
        #[arg(long, value_name = "FILE")]
        agent_config: Option<PathBuf>,
    },
}

fn role(text: &str) -> Result<api::tls::Role, String> {
    text.parse()
}

/// `90s`, `30m`, `1h`, `2d`, or plain seconds.
fn ttl(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, "s"), |at| text.split_at(at));
    let seconds_per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("`{text}` is not a duration; write 30m, 1h or 24h")),
    };
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration; write 30m, 1h or 24h"))?;
    Ok(std::time::Duration::from_secs(
        number.saturating_mul(seconds_per),
    ))
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
    /// Plain-text gRPC without authentication: for a trusted development network only [config:
    /// insecure].
    #[arg(long)]
    insecure: bool,
    /// The cluster CA certificate that peers' and clients' certificates must chain to [config:
    /// tls_ca_cert].
    #[arg(long, value_name = "FILE")]
    tls_ca_cert: Option<PathBuf>,
    /// This member's certificate (role member) [config: tls_cert].
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// Its private key [config: tls_key].
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// The CA's private key, to sign the certificates of agents that join with a token [config:
    /// tls_ca_key].
    #[arg(long, value_name = "FILE")]
    tls_ca_key: Option<PathBuf>,
    /// The highest priority a tenant certificate may give its tenants; admins use the whole
    /// range, -1000 to 1000 [default: 100] [config: tenant_priority_max].
    #[arg(long, allow_hyphen_values = true)]
    tenant_priority_max: Option<i32>,
    /// Keep the pool's state in this etcd cluster instead of the built-in Raft store: its client
    /// URLs (comma-separated or repeated) [config: etcd_endpoints].
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    etcd_endpoints: Vec<String>,
    /// The key prefix of this pool in etcd; one prefix per pool [default: /vgpu/] [config:
    /// etcd_prefix].
    #[arg(long, value_name = "PREFIX")]
    etcd_prefix: Option<String>,
    /// The CA certificate that signed etcd's server certificates (mTLS to etcd) [config:
    /// etcd_ca].
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// This member's client certificate for etcd [config: etcd_cert].
    #[arg(long, value_name = "FILE")]
    etcd_cert: Option<PathBuf>,
    /// Its private key [config: etcd_key].
    #[arg(long, value_name = "FILE")]
    etcd_key: Option<PathBuf>,
    /// The leader's etcd lease, whole seconds: a dead leader is replaced within about this long
    /// [default: 5] [config: etcd_lease_ttl_s].
    #[arg(long, value_name = "SECONDS")]
    etcd_lease_ttl_s: Option<u64>,
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
            insecure: self.insecure.then_some(true),
            tls_ca_cert: self.tls_ca_cert,
            tls_cert: self.tls_cert,
            tls_key: self.tls_key,
            tls_ca_key: self.tls_ca_key,
            tenant_priority_max: self.tenant_priority_max,
            etcd_endpoints: (!self.etcd_endpoints.is_empty()).then_some(self.etcd_endpoints),
            etcd_prefix: self.etcd_prefix,
            etcd_ca: self.etcd_ca,
            etcd_cert: self.etcd_cert,
            etcd_key: self.etcd_key,
            etcd_lease_ttl_s: self.etcd_lease_ttl_s,
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
        Mode::Ca(command) => return ca(command),
        Mode::Cert(command) => return cert(command),
        Mode::Token(command) => return token(command),
        Mode::Export(args) => {
            // Refused rather than ignored: a user who names the file expects it to be read.
            anyhow::ensure!(
                cli.config.is_none(),
                "vgpu-cp export does not read a configuration file: name the stopped pool with \
                 --data-dir (Raft store) or --etcd-endpoints and --etcd-prefix (etcd store, with \
                 --etcd-ca/--etcd-cert/--etcd-key for mTLS), as the file says"
            );
            return export(args);
        }
        Mode::Import { input, common } => {
            let flags = common.settings(Some(ModeName::Bootstrap), Vec::new());
            let config = vgpu_cp::config::load(
                flags,
                cli.config.as_deref(),
                &api::config::ProcessEnvironment,
            )?;
            return import(&config, &input);
        }
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

fn ca(command: CaCommand) -> anyhow::Result<()> {
    match command {
        CaCommand::Init {
            dir,
            common_name,
            days,
            keep_existing,
        } => {
            let cert = dir.join(vgpu_cp::certs::CA_CERT_FILE);
            let key = dir.join(vgpu_cp::certs::CA_KEY_FILE);
            if keep_existing && cert.exists() && key.exists() {
                // Kept only when the two belong together: a broken CA fails here, not later in
                // every member.
                let ca = vgpu_cp::certs::load_ca(&cert, &key)?;
                let cert_der = api::pki::first_certificate_der(&ca.cert_pem)?;
                anyhow::ensure!(
                    api::pki::key_matches_certificate(&ca.key_pem, &cert_der)?,
                    "{} does not belong to {}; remove both to make a new CA",
                    key.display(),
                    cert.display()
                );
                let hash = api::pki::ca_cert_hash(&ca.cert_pem)?;
                println!("CA certificate: {} (kept)", cert.display());
                println!("CA pin:         {hash}");
                return Ok(());
            }
            let (cert, key, hash) = vgpu_cp::certs::ca_init(&dir, &common_name, days)?;
            println!("CA certificate: {}", cert.display());
            println!(
                "CA key:         {} (mode 0600; keep it secret)",
                key.display()
            );
            println!("CA pin:         {hash}");
        }
        CaCommand::Hash { ca_cert } => {
            let pem = api::tls::read_pem(&ca_cert, "CA certificate")?;
            println!("{}", api::pki::ca_cert_hash(&pem)?);
        }
    }
    Ok(())
}

fn cert(command: CertCommand) -> anyhow::Result<()> {
    let (ca_dir, role, name, host, days, out_dir) = match command {
        CertCommand::Issue {
            ca_dir,
            role,
            name,
            host,
            days,
            out_dir,
        } => (ca_dir, role, name, host, days, out_dir),
        CertCommand::Serial { cert } => {
            println!("{}", serial_of_file(&cert)?);
            return Ok(());
        }
        CertCommand::Revoke {
            file,
            serial,
            admin,
        } => {
            let serial = match (file, serial) {
                (Some(file), _) => serial_of_file(&file)?,
                (None, Some(text)) => text,
                (None, None) => unreachable!("clap requires --revoke or --serial"),
            };
            let (transport, endpoint) = admin.connect()?;
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let answer =
                runtime.block_on(vgpu_cp::certs::revoke(&transport, &endpoint, &serial))?;
            let state = if answer.newly_revoked {
                "revoked"
            } else {
                "was already revoked"
            };
            println!(
                "certificate {serial} {state}; {} revoked in all",
                answer.revoked_total
            );
            return Ok(());
        }
    };
    let ca = vgpu_cp::certs::load_ca(
        &ca_dir.join(vgpu_cp::certs::CA_CERT_FILE),
        &ca_dir.join(vgpu_cp::certs::CA_KEY_FILE),
    )?;
    let (cert, key) = vgpu_cp::certs::cert_issue(&ca, role.clone(), &name, host, days, &out_dir)?;
    println!("certificate: {} (role {role}, name {name})", cert.display());
    println!("key:         {} (mode 0600)", key.display());
    Ok(())
}

fn serial_of_file(path: &std::path::Path) -> anyhow::Result<String> {
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("reading the certificate {}", path.display()))?;
    api::tls::serial_of_pem(&pem)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("reading the certificate {}", path.display()))
}

fn token(command: TokenCommand) -> anyhow::Result<()> {
    let TokenCommand::Create {
        ttl,
        admin,
        agent_config,
    } = command;
    let (transport, endpoint) = admin.connect()?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let created = runtime.block_on(vgpu_cp::certs::token_create(&transport, &endpoint, ttl))?;
    if let Some(path) = &agent_config {
        // The token is 0-9a-z and `.`, the pin `sha256:` and hex: no TOML escaping needed.
        let text = format!(
            "# A bootstrap token from `vgpu-cp token create`; it expires {} s after it was made.\n\
             token = \"{}\"\nca_cert_hash = \"{}\"\n",
            ttl.as_secs(),
            created.token,
            created.ca_cert_hash
        );
        api::pki::write_private(path, &text)
            .with_context(|| format!("writing the agent configuration {}", path.display()))?;
    }
    println!("{}", created.token);
    eprintln!(
        "expires in {} s; join a node with:\n  vgpu-agent join --control-plane {endpoint} --token {} --ca-cert-hash {}",
        ttl.as_secs(),
        created.token,
        created.ca_cert_hash
    );
    Ok(())
}

fn export(args: ExportArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let source = match args.data_dir {
        Some(data_dir) => vgpu_cp::transfer::Source::Raft { data_dir },
        None => vgpu_cp::transfer::Source::Etcd(vgpu_cp::EtcdStore {
            endpoints: args.etcd_endpoints,
            prefix: args.etcd_prefix,
            tls: args.etcd_ca.map(|ca| vgpu_cp::EtcdTlsFiles {
                ca,
                cert: args
                    .etcd_cert
                    .expect("clap requires --etcd-cert with --etcd-ca"),
                key: args
                    .etcd_key
                    .expect("clap requires --etcd-key with --etcd-ca"),
            }),
            lease_ttl: vgpu_cp::ETCD_LEASE_TTL_DEFAULT,
        }),
    };
    anyhow::ensure!(
        args.out.is_some() || !std::io::stdout().is_terminal(),
        "the export is binary: pass --out FILE, or redirect standard output to a file"
    );
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let (bytes, summary) = runtime.block_on(vgpu_cp::transfer::export(&source))?;
    match &args.out {
        Some(path) => {
            // Whole or not at all: a file cut short by a crash would be refused on import anyway.
            let temporary = path.with_extension("partial");
            std::fs::write(&temporary, &bytes)
                .with_context(|| format!("writing {}", temporary.display()))?;
            std::fs::rename(&temporary, path).with_context(|| {
                format!("renaming {} to {}", temporary.display(), path.display())
            })?;
        }
        None => std::io::Write::write_all(&mut std::io::stdout(), &bytes)
            .context("writing the export to standard output")?,
    }
    eprintln!(
        "exported cluster {} from the {} store at index {}: {} nodes, {} tenants, {} bytes",
        summary.header.cluster_id,
        summary.header.source_store,
        summary.header.last_applied_index,
        summary.nodes,
        summary.tenants,
        bytes.len()
    );
    if summary.entries_left_out > 0 {
        eprintln!(
            "warning: {} entries in this member's log come after the last commit it recorded and were left out (they may never have committed); export from the member that led last, or start the pool once more, stop it, and export again",
            summary.entries_left_out
        );
    }
    Ok(())
}

fn import(config: &vgpu_cp::Config, input: &std::path::Path) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let summary = runtime.block_on(vgpu_cp::transfer::import(config, input))?;
    let store = match &config.etcd {
        None => "the Raft store".to_owned(),
        Some(etcd) => format!("the etcd store (prefix {})", etcd.prefix),
    };
    println!(
        "imported cluster {} ({} nodes, {} tenants, at index {}, exported from the {} store) into {store}, member {} in {}",
        summary.header.cluster_id,
        summary.nodes,
        summary.tenants,
        summary.header.last_applied_index,
        summary.header.source_store,
        config.id,
        config.data_dir.display()
    );
    println!(
        "next: start this member with `vgpu-cp bootstrap` and the same settings, then the others with `vgpu-cp join`; do not start the old pool's members again"
    );
    Ok(())
}
