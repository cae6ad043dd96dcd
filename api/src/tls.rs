//! Transport security, the same in every binary: mutual TLS (rustls) with certificates signed by
//! the cluster CA, the role a certificate carries, and the explicit plain-text mode.
//!
//! A [`Transport`] is chosen once at start from the binary's settings ([`Transport::choose`]):
//! `Mtls` when certificate files are configured, `Insecure` only when `--insecure` (or
//! `insecure = true`) says so; neither is an error that says how to get certificates. Servers
//! ask for a client certificate but do not require one at the TLS layer, so that an agent that
//! has only a bootstrap token can reach `Agent.JoinNode`; every other call is refused without a
//! certificate by the service ([`Peer::of`] gives the caller).
//!
//! **Roles** live in the certificate subject: the organisation is the role (`admin`,
//! `tenant:OWNER`, `agent`, `member`, `metrics`), the common name the holder (node name, member id).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Time a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest certificate or key file read.
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;

/// What went wrong with certificates, keys or the transport settings.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        what: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {what} is invalid: {problem}")]
    Invalid { what: String, problem: String },
    #[error("cannot create {0}")]
    Generate(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no TLS certificates are configured, and plain text needs an explicit --insecure; {hint}, or pass --insecure (insecure = true) for a trusted development network only"
    )]
    NoCredentials { hint: String },
    #[error("only some of the TLS files are configured: {0}")]
    Partial(String),
    #[error("`{address}` cannot be used as an address: {problem}")]
    Address { address: String, problem: String },
}

/// What a client certificate allows.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Everything.
    Admin,
    /// Place, release, list and describe the tenants of this owner.
    Tenant(String),
    /// The agent RPCs of its own node (the certificate's common name).
    Agent,
    /// A control-plane member: Raft traffic, forwarding, joining.
    Member,
    /// A metrics scraper (Prometheus): `GET /metrics` of every member, nothing else.
    Metrics,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Admin => f.write_str("admin"),
            Role::Tenant(owner) => write!(f, "tenant:{owner}"),
            Role::Agent => f.write_str("agent"),
            Role::Member => f.write_str("member"),
            Role::Metrics => f.write_str("metrics"),
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(text: &str) -> Result<Role, String> {
        match text.trim() {
            "admin" => Ok(Role::Admin),
            "agent" => Ok(Role::Agent),
            "member" => Ok(Role::Member),
            "metrics" => Ok(Role::Metrics),
            other => match other.strip_prefix("tenant:") {
                Some(owner) => {
                    crate::names::validate("tenant owner", owner)
                        .map_err(|error| error.to_string())?;
                    Ok(Role::Tenant(owner.to_owned()))
                }
                None => Err(format!(
                    "the role `{other}` is unknown; write `admin`, `tenant:OWNER`, `agent`, `member` or `metrics`"
                )),
            },
        }
    }
}

/// The authenticated caller of a request: from its verified client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub role: Role,
    /// The certificate's common name.
    pub name: String,
    /// The certificate's serial number ([`normalize_serial`] form); empty without a certificate
    /// (`--insecure`).
    pub serial: String,
}

/// A certificate serial as vgpu keeps it: lowercase hex, no colons, no leading zeros (`0` for
/// zero). `None` for anything else than hex digits and colons, or more than 40 digits (RFC 5280
/// serials are at most 20 bytes).
pub fn normalize_serial(text: &str) -> Option<String> {
    let digits: String = text
        .trim()
        .chars()
        .filter(|c| *c != ':')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    if digits.is_empty() || digits.len() > 40 || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let trimmed = digits.trim_start_matches('0');
    Some(if trimmed.is_empty() { "0" } else { trimmed }.to_owned())
}

/// The serial of the first certificate in `pem`, normalized.
pub fn serial_of_pem(pem: &str) -> Result<String, String> {
    let der = crate::pki::first_certificate_der(pem).map_err(|error| error.to_string())?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|error| format!("unreadable certificate: {error}"))?;
    Ok(serial_of(&cert))
}

fn serial_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> String {
    let hex: String = cert
        .raw_serial()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    normalize_serial(&hex).unwrap_or_else(|| "0".to_owned())
}

impl Peer {
    /// The caller of `request`: `None` without a client certificate (plain text, or TLS without
    /// one); an error for a certificate that names no valid role. The TLS layer has already
    /// verified the certificate against the cluster CA.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<Result<Peer, String>> {
        let certificates = request.peer_certs()?;
        let leaf = certificates.first()?;
        Some(Peer::from_der(leaf))
    }

    /// Reads name and role from a DER certificate.
    pub fn from_der(der: &[u8]) -> Result<Peer, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|error| format!("unreadable client certificate: {error}"))?;
        let subject = cert.subject();
        let name = subject
            .iter_common_name()
            .next()
            .and_then(|attribute| attribute.as_str().ok())
            .unwrap_or_default()
            .to_owned();
        let role = subject
            .iter_organization()
            .next()
            .and_then(|attribute| attribute.as_str().ok())
            .ok_or_else(|| "the client certificate names no role (subject O)".to_owned())?
            .parse::<Role>()?;
        Ok(Peer {
            role,
            name,
            serial: serial_of(&cert),
        })
    }
}

/// The three files of an mTLS identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The cluster CA's certificate: what peers' certificates must chain to.
    pub ca_cert: PathBuf,
    /// This binary's certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files from three optional settings: all three, or none (`Ok(None)`); some of them is
    /// an error naming the missing ones (`names` are the keys as documented, in the same order).
    pub fn from_parts(
        ca_cert: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        names: [&str; 3],
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (ca_cert, cert, key) {
            (None, None, None) => Ok(None),
            (Some(ca_cert), Some(cert), Some(key)) => Ok(Some(TlsFiles { ca_cert, cert, key })),
            (ca_cert, cert, key) => {
                let missing: Vec<&str> = [ca_cert.is_none(), cert.is_none(), key.is_none()]
                    .iter()
                    .zip(names)
                    .filter(|(missing, _)| **missing)
                    .map(|(_, name)| name)
                    .collect();
                Err(TlsError::Partial(format!(
                    "set {} as well (mutual TLS needs the CA certificate, a certificate and its key)",
                    missing.join(" and ")
                )))
            }
        }
    }
}

/// A loaded mTLS identity.
#[derive(Clone)]
pub struct Credentials {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").finish_non_exhaustive()
    }
}

/// Reads a PEM file, bounded.
pub fn read_pem(path: &Path, what: &str) -> Result<String, TlsError> {
    use std::io::Read as _;
    let read = |source| TlsError::Read {
        what: what.to_owned(),
        path: path.to_owned(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(read)?
        .take(PEM_FILE_BYTES_MAX)
        .read_to_string(&mut text)
        .map_err(read)?;
    if !text.contains("-----BEGIN") {
        return Err(TlsError::Invalid {
            what: format!("{what} {}", path.display()),
            problem: "it holds no PEM block".into(),
        });
    }
    Ok(text)
}

impl Credentials {
    pub fn load(files: &TlsFiles) -> Result<Credentials, TlsError> {
        let credentials = Credentials {
            ca_pem: read_pem(&files.ca_cert, "CA certificate")?,
            cert_pem: read_pem(&files.cert, "certificate")?,
            key_pem: read_pem(&files.key, "private key")?,
        };
        // Fail at start, not at the first connection.
        crate::pki::first_certificate_der(&credentials.ca_pem)?;
        let cert_der = crate::pki::first_certificate_der(&credentials.cert_pem)?;
        if !crate::pki::key_matches_certificate(&credentials.key_pem, &cert_der)? {
            return Err(TlsError::Invalid {
                what: format!("private key {}", files.key.display()),
                problem: format!(
                    "it does not belong to the certificate {}; give the key issued with it",
                    files.cert.display()
                ),
            });
        }
        Ok(credentials)
    }

    /// The certificate chain a server presents: its certificate, then the CA's (so that an agent
    /// joining with `--ca-cert-hash` finds the CA to pin).
    fn chain_pem(&self) -> String {
        let mut chain = self.cert_pem.trim_end().to_owned();
        chain.push('\n');
        chain.push_str(self.ca_pem.trim_end());
        chain.push('\n');
        chain
    }
}

/// How a binary talks to the others.
#[derive(Clone, Debug)]
pub enum Transport {
    /// Plain text, no authentication: everyone is an admin. Only with `--insecure`.
    Insecure,
    /// Mutual TLS with the cluster CA.
    Mtls(Arc<Credentials>),
}

impl Transport {
    /// The transport the settings ask for. `hint` says how this binary gets certificates.
    pub fn choose(
        insecure: bool,
        files: Option<&TlsFiles>,
        hint: &str,
    ) -> Result<Transport, TlsError> {
        match (insecure, files) {
            (true, _) => Ok(Transport::Insecure),
            (false, Some(files)) => Ok(Transport::Mtls(Arc::new(Credentials::load(files)?))),
            (false, None) => Err(TlsError::NoCredentials {
                hint: hint.to_owned(),
            }),
        }
    }

    pub fn is_insecure(&self) -> bool {
        matches!(self, Transport::Insecure)
    }

    /// An endpoint for `address` (`HOST:PORT`, or with an `http://`/`https://` scheme, which
    /// the transport overrides): `https` with this identity under mTLS, `http` otherwise.
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, TlsError> {
        let host_port = strip_scheme(address);
        let bad = |problem: String| TlsError::Address {
            address: address.to_owned(),
            problem,
        };
        match self {
            Transport::Insecure => Endpoint::from_shared(format!("http://{host_port}"))
                .map_err(|error| bad(error.to_string())),
            Transport::Mtls(credentials) => {
                let tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&credentials.ca_pem))
                    .identity(Identity::from_pem(
                        &credentials.cert_pem,
                        &credentials.key_pem,
                    ))
                    .timeout(HANDSHAKE_TIMEOUT);
                Endpoint::from_shared(format!("https://{host_port}"))
                    .map_err(|error| bad(error.to_string()))?
                    .tls_config(tls)
                    .map_err(|error| bad(error.to_string()))
            }
        }
    }

    /// The server side: `None` for plain text.
    pub fn server_config(&self) -> Option<ServerTlsConfig> {
        match self {
            Transport::Insecure => None,
            Transport::Mtls(credentials) => Some(
                ServerTlsConfig::new()
                    .identity(Identity::from_pem(
                        credentials.chain_pem(),
                        &credentials.key_pem,
                    ))
                    .client_ca_root(Certificate::from_pem(&credentials.ca_pem))
                    // Checked per call instead: only `Agent.JoinNode` goes without one.
                    .client_auth_optional(true)
                    .timeout(HANDSHAKE_TIMEOUT),
            ),
        }
    }
}

fn strip_scheme(address: &str) -> &str {
    let address = address.trim();
    address
        .strip_prefix("https://")
        .or_else(|| address.strip_prefix("http://"))
        .unwrap_or(address)
        .trim_end_matches('/')
}

/// An endpoint that authenticates the server only, by the pinned CA: the server's chain must
/// contain a CA whose public key hashes to `ca_cert_hash` (`sha256:HEX`), and the server's
/// certificate must be valid under that CA. For `vgpu-agent join --token`, before it has a
/// certificate of its own.
pub fn pinned_endpoint(address: &str, ca_cert_hash: &str) -> Result<Endpoint, TlsError> {
    let pin = parse_pin(ca_cert_hash)?;
    let bad = |problem: String| TlsError::Address {
        address: address.to_owned(),
        problem,
    };
    let verifier = Arc::new(PinnedCaVerifier {
        pin,
        provider: Arc::new(rustls::crypto::ring::default_provider()),
    });
    Endpoint::from_shared(format!("https://{}", strip_scheme(address)))
        .map_err(|error| bad(error.to_string()))?
        .tls_config_with_verifier(ClientTlsConfig::new().timeout(HANDSHAKE_TIMEOUT), verifier)
        .map_err(|error| bad(error.to_string()))
}

/// Checks the shape of a `--ca-cert-hash` value and returns it normalised.
pub fn parse_pin(text: &str) -> Result<String, TlsError> {
    let text = text.trim().to_ascii_lowercase();
    let valid = text
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if !valid {
        return Err(TlsError::Invalid {
            what: "CA certificate hash".into(),
            problem: format!(
                "`{text}` is not `sha256:` and 64 hex digits; `vgpu-cp ca hash` prints it"
            ),
        });
    }
    Ok(text)
}

/// Verifies a server by a CA found in its own chain and pinned by hash.
#[derive(Debug)]
struct PinnedCaVerifier {
    pin: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let pinned = intermediates
            .iter()
            .find(|candidate| {
                crate::pki::spki_hash(candidate).is_ok_and(|hash| hash == self.pin)
            })
            .ok_or_else(|| {
                rustls::Error::General(format!(
                    "the server's certificate chain holds no CA with the pinned hash {}; check --ca-cert-hash against `vgpu-cp ca hash` on a control-plane member",
                    self.pin
                ))
            })?;
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(pinned.clone().into_owned())
            .map_err(|error| rustls::Error::General(format!("the pinned CA: {error}")))?;
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|error| rustls::Error::General(error.to_string()))?;
        verifier.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_are_normalized_or_refused() {
        assert_eq!(normalize_serial("0A:1b").as_deref(), Some("a1b"));
        assert_eq!(normalize_serial(" 00 ").as_deref(), Some("0"));
        assert_eq!(normalize_serial(&"f".repeat(40)), Some("f".repeat(40)));
        for bad in ["", ":", "xyz", "0x1f", &"f".repeat(41)] {
            assert_eq!(normalize_serial(bad), None, "{bad}");
        }
    }

    #[test]
    fn roles_round_trip_and_unknown_ones_say_what_to_write() {
        for role in [
            Role::Admin,
            Role::Agent,
            Role::Member,
            Role::Metrics,
            Role::Tenant("team-a".into()),
        ] {
            assert_eq!(role.to_string().parse::<Role>().unwrap(), role);
        }
        let error = "root".parse::<Role>().unwrap_err();
        assert!(error.contains("tenant:OWNER"), "{error}");
        assert!("tenant:Bad Name".parse::<Role>().is_err());
    }

    #[test]
    fn no_certificates_without_insecure_is_refused_with_a_hint() {
        let error = Transport::choose(false, None, "run `vgpu-cp cert issue`").unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("--insecure") && text.contains("vgpu-cp cert issue"),
            "{text}"
        );
        assert!(Transport::choose(true, None, "").unwrap().is_insecure());
        let partial = TlsFiles::from_parts(
            Some("ca.pem".into()),
            None,
            Some("key.pem".into()),
            ["tls_ca_cert", "tls_cert", "tls_key"],
        )
        .unwrap_err()
        .to_string();
        assert!(
            partial.contains("tls_cert") && !partial.contains("tls_key"),
            "{partial}"
        );
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let ca = crate::pki::new_ca("test", 1).unwrap();
        let subject = crate::pki::Subject {
            name: "ops".into(),
            role: Role::Admin,
            hosts: vec![],
        };
        let issued = crate::pki::issue(&ca, &subject, 1).unwrap();
        let path = |name: &str| dir.path().join(name);
        std::fs::write(path("ca.crt"), &ca.cert_pem).unwrap();
        std::fs::write(path("ops.crt"), &issued.cert_pem).unwrap();
        std::fs::write(path("ops.key"), &issued.key_pem).unwrap();
        std::fs::write(path("other.key"), &ca.key_pem).unwrap();
        let files = |key: &str| TlsFiles {
            ca_cert: path("ca.crt"),
            cert: path("ops.crt"),
            key: path(key),
        };
        assert!(Credentials::load(&files("ops.key")).is_ok());
        let error = Credentials::load(&files("other.key"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("does not belong"), "{error}");
    }

    #[test]
    fn pins_must_be_sha256_hex() {
        let good = format!("sha256:{}", "AB".repeat(32));
        assert_eq!(parse_pin(&good).unwrap(), good.to_ascii_lowercase());
        assert!(parse_pin("sha1:abcd").is_err());
        assert!(parse_pin("sha256:xyz").is_err());
    }
}
