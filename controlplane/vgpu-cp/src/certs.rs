//! The operator's certificate commands: `vgpu-cp ca init`, `ca hash`, `cert issue` and
//! `token create`. Files are written as `NAME.crt` (0644) and `NAME.key` (0600).

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::pki::{self, CertAndKey, Subject};
use api::tls::{Role, TlsError, Transport};

/// The CA's file names inside its directory.
pub const CA_CERT_FILE: &str = "ca.crt";
pub const CA_KEY_FILE: &str = "ca.key";

/// What went wrong in a certificate command.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(
        "{path} already exists; remove it first, or choose another directory (a new CA invalidates every certificate of the old one)"
    )]
    Exists { path: PathBuf },
    #[error("the control plane refused: {0}")]
    Refused(String),
    #[error("could not reach {endpoint}: {detail}")]
    Unreachable { endpoint: String, detail: String },
}

/// Writes a new cluster CA into `dir` and returns the paths and the `--ca-cert-hash` pin.
pub fn ca_init(
    dir: &Path,
    common_name: &str,
    days: u32,
) -> Result<(PathBuf, PathBuf, String), CertError> {
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    for path in [&cert_path, &key_path] {
        if path.exists() {
            return Err(CertError::Exists { path: path.clone() });
        }
    }
    let ca = pki::new_ca(common_name, days)?;
    pki::write_private(&key_path, &ca.key_pem)?;
    pki::write_public(&cert_path, &ca.cert_pem)?;
    let hash = pki::ca_cert_hash(&ca.cert_pem)?;
    Ok((cert_path, key_path, hash))
}

/// Reads a CA's certificate and key.
pub fn load_ca(ca_cert: &Path, ca_key: &Path) -> Result<CertAndKey, CertError> {
    Ok(CertAndKey {
        cert_pem: api::tls::read_pem(ca_cert, "CA certificate")?,
        key_pem: api::tls::read_pem(ca_key, "CA private key")?,
    })
}

/// Issues a certificate for `name` with `role` (and `hosts` as subject alternative names, for
/// members) into `out_dir/FILE.crt` and `.key`, where FILE is `name`; returns both paths.
pub fn cert_issue(
    ca: &CertAndKey,
    role: Role,
    name: &str,
    hosts: Vec<String>,
    days: u32,
    out_dir: &Path,
) -> Result<(PathBuf, PathBuf), CertError> {
    let subject = Subject {
        name: name.to_owned(),
        role,
        hosts,
    };
    let issued = pki::issue(ca, &subject, days)?;
    let cert_path = out_dir.join(format!("{name}.crt"));
    let key_path = out_dir.join(format!("{name}.key"));
    pki::write_private(&key_path, &issued.key_pem)?;
    pki::write_public(&cert_path, &issued.cert_pem)?;
    Ok((cert_path, key_path))
}

/// A Cluster API client for `endpoint`, authenticated by `transport` (an admin certificate).
async fn cluster_client(
    transport: &Transport,
    endpoint: &str,
) -> Result<api::v1::cluster_client::ClusterClient<tonic::transport::Channel>, CertError> {
    let channel = transport
        .endpoint(endpoint)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(15))
        .connect()
        .await
        .map_err(|error| CertError::Unreachable {
            endpoint: endpoint.to_owned(),
            detail: format!("{error:?}"),
        })?;
    Ok(api::v1::cluster_client::ClusterClient::new(channel))
}

/// A new bootstrap token, created through `endpoint` with an admin certificate (`transport`).
pub async fn token_create(
    transport: &Transport,
    endpoint: &str,
    ttl: Duration,
) -> Result<api::v1::CreateJoinTokenResponse, CertError> {
    cluster_client(transport, endpoint)
        .await?
        .create_join_token(api::v1::CreateJoinTokenRequest {
            ttl_seconds: ttl.as_secs().max(1),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| CertError::Refused(status.message().to_owned()))
}

/// Revokes the certificate with `serial` through `endpoint` with an admin certificate.
pub async fn revoke(
    transport: &Transport,
    endpoint: &str,
    serial: &str,
) -> Result<api::v1::RevokeCertificateResponse, CertError> {
    cluster_client(transport, endpoint)
        .await?
        .revoke_certificate(api::v1::RevokeCertificateRequest {
            serial: serial.to_owned(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| CertError::Refused(status.message().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_init_refuses_to_overwrite_and_issue_writes_private_keys() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, hash) = ca_init(dir.path(), "test", 30).unwrap();
        assert!(hash.starts_with("sha256:"));
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&key), 0o600);
        assert_eq!(mode(&cert), 0o644);
        let error = ca_init(dir.path(), "test", 30).unwrap_err().to_string();
        assert!(error.contains("already exists"), "{error}");
        let ca = load_ca(&cert, &key).unwrap();
        let out = dir.path().join("issued");
        let (cert, key) = cert_issue(
            &ca,
            Role::Member,
            "1",
            vec!["127.0.0.1".into(), "localhost".into()],
            10,
            &out,
        )
        .unwrap();
        assert_eq!(mode(&key), 0o600);
        let der = pki::first_certificate_der(&std::fs::read_to_string(cert).unwrap()).unwrap();
        let peer = api::tls::Peer::from_der(&der).unwrap();
        assert_eq!((peer.role, peer.name.as_str()), (Role::Member, "1"));
    }
}
