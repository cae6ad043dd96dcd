//! How the agent gets its transport: `--insecure` (plain text), its certificate files, or, the
//! first time, a bootstrap token (as `kubeadm join` does).
//!
//! With `--token T --ca-cert-hash sha256:...` and no certificate yet, the agent connects with
//! server-authenticated TLS only (the server's chain must hold a CA whose public key matches the
//! pin), calls `Agent.JoinNode` with the token and a signing request for a new key, checks that
//! the CA it gets back is the pinned one, and writes the CA certificate, its certificate (role
//! agent, common name = the node name) and key (mode 0600). Then it reconnects with mTLS. A
//! restarted agent finds the files and needs no token.

use std::path::PathBuf;
use std::time::Duration;

use api::tls::{TlsFiles, Transport};
use tracing::{info, warn};

use crate::error::{Error, Result};

/// The files under the state directory when none are configured.
pub const TLS_DIR: &str = "tls";
/// Longest the bootstrap keeps trying the control-plane members.
pub const JOIN_DEADLINE: Duration = Duration::from_secs(60);
/// Pause between rounds over the members.
const JOIN_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// What the agent's transport is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Security {
    /// Plain text, no certificates (`--insecure`).
    pub insecure: bool,
    /// Where the CA certificate, the agent's certificate and key are (or will be written).
    pub files: TlsFiles,
    /// A bootstrap token, used only while the certificate files do not exist.
    pub token: Option<String>,
    /// The pin of the cluster CA, required with `token`.
    pub ca_cert_hash: Option<String>,
}

impl Security {
    /// The default files: `STATE_DIR/tls/ca.crt`, `agent.crt`, `agent.key`.
    pub fn default_files(state_dir: &std::path::Path) -> TlsFiles {
        let dir = state_dir.join(TLS_DIR);
        TlsFiles {
            ca_cert: dir.join("ca.crt"),
            cert: dir.join("agent.crt"),
            key: dir.join("agent.key"),
        }
    }

    fn files_exist(&self) -> bool {
        [&self.files.ca_cert, &self.files.cert, &self.files.key]
            .iter()
            .all(|path| path.exists())
    }
}

fn tls_error(error: api::tls::TlsError) -> Error {
    Error::Tls(error.to_string())
}

/// The transport for `node`: plain text, the existing certificate, or one obtained with the
/// bootstrap token through one of `control_plane`.
pub async fn transport(
    security: &Security,
    node: &str,
    control_plane: &[String],
) -> Result<Transport> {
    if security.insecure {
        warn!("running with --insecure: plain-text gRPC, no authentication");
        return Ok(Transport::Insecure);
    }
    if !security.files_exist() {
        let (Some(token), Some(pin)) = (&security.token, &security.ca_cert_hash) else {
            let missing: Vec<String> = [
                &security.files.ca_cert,
                &security.files.cert,
                &security.files.key,
            ]
            .iter()
            .filter(|path| !path.exists())
            .map(|path| path.display().to_string())
            .collect();
            return Err(Error::Tls(format!(
                "no certificate ({} missing); join with a bootstrap token: `vgpu-agent join --token TOKEN --ca-cert-hash sha256:...` (an admin runs `vgpu-cp token create`), or pass --insecure for a control plane started with --insecure",
                missing.join(", ")
            )));
        };
        obtain_certificate(&security.files, token, pin, node, control_plane).await?;
    } else if security.token.is_some() {
        info!("the certificate exists already; the bootstrap token is not needed");
    }
    Transport::choose(false, Some(&security.files), "").map_err(tls_error)
}

/// Proves `token` to a member (trying each in turn) and writes the certificate it signs.
async fn obtain_certificate(
    files: &TlsFiles,
    token: &str,
    pin: &str,
    node: &str,
    control_plane: &[String],
) -> Result<()> {
    let pin = api::tls::parse_pin(pin).map_err(tls_error)?;
    let (csr_pem, key_pem) = api::pki::new_csr(node).map_err(tls_error)?;
    let deadline = tokio::time::Instant::now() + JOIN_DEADLINE;
    let mut last = String::from("no control-plane address");
    loop {
        for address in control_plane {
            match join_once(address, &pin, token, node, &csr_pem).await {
                Ok(response) => {
                    let returned =
                        api::pki::ca_cert_hash(&response.ca_certificate_pem).map_err(tls_error)?;
                    if returned != pin {
                        return Err(Error::Tls(format!(
                            "{address} returned a CA ({returned}) other than the pinned one ({pin}); check --ca-cert-hash"
                        )));
                    }
                    write_files(files, &response, &key_pem)?;
                    info!(cert = %files.cert.display(), "joined with the bootstrap token; certificate written");
                    return Ok(());
                }
                // The token itself is refused: no other member will think otherwise.
                Err(status) if status.code() == tonic::Code::Unauthenticated => {
                    return Err(Error::Tls(format!(
                        "{address} refused the bootstrap token: {}",
                        status.message()
                    )));
                }
                Err(status) => {
                    last = format!("{address}: {}", status.message());
                    warn!(%address, message = status.message(), "bootstrap join failed; trying the next member");
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Tls(format!(
                "could not join with the bootstrap token within {JOIN_DEADLINE:?}: {last}"
            )));
        }
        tokio::time::sleep(JOIN_RETRY_PAUSE).await;
    }
}

async fn join_once(
    address: &str,
    pin: &str,
    token: &str,
    node: &str,
    csr_pem: &str,
) -> std::result::Result<api::v1::JoinNodeResponse, tonic::Status> {
    let endpoint = api::tls::pinned_endpoint(address, pin)
        .map_err(|error| tonic::Status::invalid_argument(error.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(15));
    let channel = endpoint
        .connect()
        .await
        .map_err(|error| tonic::Status::unavailable(format!("cannot connect: {error:?}")))?;
    let mut client = api::v1::agent_client::AgentClient::new(channel);
    let request = api::v1::JoinNodeRequest {
        token: token.to_owned(),
        node: node.to_owned(),
        csr_pem: csr_pem.to_owned(),
    };
    client
        .join_node(request)
        .await
        .map(tonic::Response::into_inner)
}

fn write_files(
    files: &TlsFiles,
    response: &api::v1::JoinNodeResponse,
    key_pem: &str,
) -> Result<()> {
    // The key first and the CA last: a crash in between leaves the files incomplete, and the
    // next start joins again (the token permitting) rather than using a half-written set.
    let written = api::pki::write_private(&files.key, key_pem)
        .and_then(|()| api::pki::write_public(&files.cert, &response.certificate_pem))
        .and_then(|()| api::pki::write_public(&files.ca_cert, &response.ca_certificate_pem));
    written.map_err(tls_error)
}

/// The configured paths or the defaults under `state_dir`.
pub fn files(
    state_dir: &std::path::Path,
    ca_cert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> TlsFiles {
    let defaults = Security::default_files(state_dir);
    TlsFiles {
        ca_cert: ca_cert.unwrap_or(defaults.ca_cert),
        cert: cert.unwrap_or(defaults.cert),
        key: key.unwrap_or(defaults.key),
    }
}
