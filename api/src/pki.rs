//! The cluster's public-key infrastructure: a cluster CA, certificates it issues (the role goes in
//! the subject's organisation, the name in its common name), certificate signing requests for
//! agents that join with a bootstrap token, the `sha256:` pin of a CA, and bootstrap tokens.
//!
//! Keys are ECDSA P-256 (rcgen with ring). Private keys are written with mode 0600.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

use crate::tls::{Role, TlsError};

/// Days a cluster CA is valid.
pub const CA_DAYS_DEFAULT: u32 = 3650;
/// Days a certificate issued by `vgpu-cp cert issue` or to a joining agent is valid.
pub const CERT_DAYS_DEFAULT: u32 = 365;
/// Longest validity accepted for any certificate.
pub const CERT_DAYS_MAX: u32 = 36500;
/// Largest certificate signing request accepted from a joining agent.
pub const CSR_BYTES_MAX: usize = 16 << 10;

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct CertAndKey {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CertAndKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertAndKey")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<private>")
            .finish()
    }
}

/// Who a certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    /// The common name: the agent's node name, the member's id, a person or service.
    pub name: String,
    pub role: Role,
    /// DNS names and IP addresses the holder serves on (members); empty for clients.
    pub hosts: Vec<String>,
}

fn generation(what: &str) -> impl Fn(rcgen::Error) -> TlsError + '_ {
    move |error| TlsError::Generate(format!("{what}: {error}"))
}

fn validity(params: &mut CertificateParams, days: u32) -> Result<(), TlsError> {
    if days == 0 || days > CERT_DAYS_MAX {
        return Err(TlsError::Generate(format!(
            "a validity of {days} days is out of range; give 1 to {CERT_DAYS_MAX}"
        )));
    }
    let now = time::OffsetDateTime::now_utc();
    // A little slack for clocks that run behind.
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::days(i64::from(days));
    Ok(())
}

/// A new self-signed cluster CA.
pub fn new_ca(common_name: &str, days: u32) -> Result<CertAndKey, TlsError> {
    let key = KeyPair::generate().map_err(generation("a CA key"))?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name.push(DnType::OrganizationName, "vgpu");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, days)?;
    let cert = params
        .self_signed(&key)
        .map_err(generation("the CA certificate"))?;
    Ok(CertAndKey {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// The parameters of a leaf certificate for `subject`: usable as client and as server.
fn leaf_params(subject: &Subject, days: u32) -> Result<CertificateParams, TlsError> {
    crate::names::validate("certificate name", &subject.name)
        .or_else(|_| {
            // Member ids are numbers, which are valid names too; anything else must be a name.
            subject
                .name
                .parse::<u64>()
                .map(|_| ())
                .map_err(|_| subject.name.clone())
        })
        .map_err(|_| {
            TlsError::Generate(format!(
                "`{}` is not a valid certificate name; use lowercase letters, digits, `-` and `.`",
                subject.name
            ))
        })?;
    let mut params = CertificateParams::new(subject.hosts.clone())
        .map_err(generation("the certificate's host names"))?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, subject.name.as_str());
    name.push(DnType::OrganizationName, subject.role.to_string());
    params.distinguished_name = name;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ClientAuth,
        ExtendedKeyUsagePurpose::ServerAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, days)?;
    Ok(params)
}

fn issuer(ca: &CertAndKey) -> Result<Issuer<'static, KeyPair>, TlsError> {
    let key = KeyPair::from_pem(&ca.key_pem).map_err(|error| TlsError::Invalid {
        what: "CA private key".into(),
        problem: error.to_string(),
    })?;
    Issuer::from_ca_cert_pem(&ca.cert_pem, key).map_err(|error| TlsError::Invalid {
        what: "CA certificate".into(),
        problem: error.to_string(),
    })
}

/// Issues a certificate (with a new key) for `subject`, signed by `ca`.
pub fn issue(ca: &CertAndKey, subject: &Subject, days: u32) -> Result<CertAndKey, TlsError> {
    let params = leaf_params(subject, days)?;
    let key = KeyPair::generate().map_err(generation("a key"))?;
    let cert = params
        .signed_by(&key, &issuer(ca)?)
        .map_err(generation("the certificate"))?;
    Ok(CertAndKey {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A new key and a certificate signing request for `name` (the CA decides the rest).
pub fn new_csr(name: &str) -> Result<(String, String), TlsError> {
    let key = KeyPair::generate().map_err(generation("a key"))?;
    let mut params = CertificateParams::default();
    let mut distinguished = DistinguishedName::new();
    distinguished.push(DnType::CommonName, name);
    params.distinguished_name = distinguished;
    let csr = params
        .serialize_request(&key)
        .map_err(generation("the signing request"))?;
    let pem = csr.pem().map_err(generation("the signing request"))?;
    Ok((pem, key.serialize_pem()))
}

/// Signs a certificate signing request for `subject`: only the public key (whose possession the
/// request's signature proves) is taken from the request; name, role and validity are the CA's.
pub fn sign_csr(
    ca: &CertAndKey,
    csr_pem: &str,
    subject: &Subject,
    days: u32,
) -> Result<String, TlsError> {
    if csr_pem.len() > CSR_BYTES_MAX {
        return Err(TlsError::Invalid {
            what: "certificate signing request".into(),
            problem: format!("larger than {CSR_BYTES_MAX} bytes"),
        });
    }
    let request =
        CertificateSigningRequestParams::from_pem(csr_pem).map_err(|error| TlsError::Invalid {
            what: "certificate signing request".into(),
            problem: error.to_string(),
        })?;
    let params = leaf_params(subject, days)?;
    let cert = params
        .signed_by(&request.public_key, &issuer(ca)?)
        .map_err(generation("the certificate"))?;
    Ok(cert.pem())
}

/// The pin of a CA certificate, as `vgpu-agent join --ca-cert-hash` takes it: `sha256:` and the
/// hex SHA-256 of the certificate's DER-encoded SubjectPublicKeyInfo (as kubeadm pins its CA).
pub fn ca_cert_hash(ca_pem: &str) -> Result<String, TlsError> {
    let der = first_certificate_der(ca_pem)?;
    spki_hash(&der)
}

/// The `sha256:` pin of one DER certificate's public key.
pub fn spki_hash(der: &[u8]) -> Result<String, TlsError> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|error| TlsError::Invalid {
            what: "certificate".into(),
            problem: error.to_string(),
        })?;
    Ok(format!("sha256:{}", sha256_hex(cert.public_key().raw)))
}

/// Whether the PEM private key `key_pem` is the key of the DER certificate `cert_der`.
pub fn key_matches_certificate(key_pem: &str, cert_der: &[u8]) -> Result<bool, TlsError> {
    use rcgen::PublicKeyData as _;
    let key = KeyPair::from_pem(key_pem).map_err(|error| TlsError::Invalid {
        what: "private key".into(),
        problem: error.to_string(),
    })?;
    let (_, cert) =
        x509_parser::parse_x509_certificate(cert_der).map_err(|error| TlsError::Invalid {
            what: "certificate".into(),
            problem: error.to_string(),
        })?;
    Ok(cert.public_key().raw == key.subject_public_key_info().as_slice())
}

/// The DER of the first certificate in `pem`.
pub fn first_certificate_der(pem: &str) -> Result<Vec<u8>, TlsError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .and_then(Result::ok)
        .map(|der| der.to_vec())
        .ok_or_else(|| TlsError::Invalid {
            what: "certificate".into(),
            problem: "no PEM certificate found".into(),
        })
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Characters of a bootstrap token's id and secret.
const TOKEN_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// A new bootstrap token, `ID.SECRET` (6 and 16 characters of `[a-z0-9]`, as kubeadm's).
pub fn new_token() -> String {
    use rand::Rng as _;
    let mut rng = rand::rngs::OsRng;
    let mut draw = |count: usize| -> String {
        (0..count)
            .map(|_| TOKEN_ALPHABET[rng.gen_range(0..TOKEN_ALPHABET.len())] as char)
            .collect()
    };
    let id = draw(6);
    let secret = draw(16);
    format!("{id}.{secret}")
}

/// Whether `token` has the shape [`new_token`] gives.
pub fn is_token_shaped(token: &str) -> bool {
    let Some((id, secret)) = token.split_once('.') else {
        return false;
    };
    let allowed = |part: &str| part.bytes().all(|b| TOKEN_ALPHABET.contains(&b));
    id.len() == 6 && secret.len() == 16 && allowed(id) && allowed(secret)
}

/// What the replicated state keeps of a token: its SHA-256, never the token itself.
pub fn token_hash(token: &str) -> String {
    sha256_hex(token.as_bytes())
}

/// Writes a private key (or anything secret): mode 0600, created or truncated.
pub fn write_private(path: &Path, text: &str) -> Result<(), TlsError> {
    write_with_mode(path, text, 0o600)
}

/// Writes a certificate: mode 0644.
pub fn write_public(path: &Path, text: &str) -> Result<(), TlsError> {
    write_with_mode(path, text, 0o644)
}

fn write_with_mode(path: &Path, text: &str, mode: u32) -> Result<(), TlsError> {
    use std::os::unix::fs::PermissionsExt as _;
    let io = |source| TlsError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    // The mode above applies only to a new file; an existing one is narrowed too.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io)?;
    file.write_all(text.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::Peer;

    #[test]
    fn issued_certificates_carry_name_and_role_and_chain_to_the_ca() {
        let ca = new_ca("vgpu test CA", 30).unwrap();
        let subject = Subject {
            name: "alice".into(),
            role: Role::Tenant("alice".into()),
            hosts: vec![],
        };
        let issued = issue(&ca, &subject, 1).unwrap();
        let der = first_certificate_der(&issued.cert_pem).unwrap();
        let peer = Peer::from_der(&der).unwrap();
        assert_eq!(peer.name, "alice");
        assert_eq!(peer.role, Role::Tenant("alice".into()));
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        let ca_der = first_certificate_der(&ca.cert_pem).unwrap();
        let (_, ca_parsed) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        assert_eq!(parsed.issuer(), ca_parsed.subject());
        assert!(
            parsed
                .verify_signature(Some(ca_parsed.public_key()))
                .is_ok()
        );
        assert!(issue(&ca, &subject, 0).is_err(), "zero days is refused");
    }

    #[test]
    fn a_signed_request_keeps_only_the_public_key() {
        let ca = new_ca("vgpu test CA", 30).unwrap();
        let (csr, key_pem) = new_csr("node-a").unwrap();
        let subject = Subject {
            name: "node-a".into(),
            role: Role::Agent,
            hosts: vec![],
        };
        let cert = sign_csr(&ca, &csr, &subject, 1).unwrap();
        let der = first_certificate_der(&cert).unwrap();
        let peer = Peer::from_der(&der).unwrap();
        assert_eq!(peer.role, Role::Agent);
        assert_eq!(peer.name, "node-a");
        let key = KeyPair::from_pem(&key_pem).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        use rcgen::PublicKeyData as _;
        assert_eq!(
            parsed.public_key().raw,
            key.subject_public_key_info().as_slice()
        );
        assert!(sign_csr(&ca, "not a csr", &subject, 1).is_err());
        assert!(key_matches_certificate(&key_pem, &der).unwrap());
        assert!(!key_matches_certificate(&ca.key_pem, &der).unwrap());
    }

    #[test]
    fn ca_hash_pins_the_public_key() {
        let ca = new_ca("one", 30).unwrap();
        let other = new_ca("two", 30).unwrap();
        let hash = ca_cert_hash(&ca.cert_pem).unwrap();
        assert!(
            hash.starts_with("sha256:") && hash.len() == 7 + 64,
            "{hash}"
        );
        assert_eq!(hash, ca_cert_hash(&ca.cert_pem).unwrap());
        assert_ne!(hash, ca_cert_hash(&other.cert_pem).unwrap());
    }

    #[test]
    fn tokens_have_their_shape_and_private_files_their_mode() {
        use std::os::unix::fs::PermissionsExt as _;
        let token = new_token();
        assert!(is_token_shaped(&token), "{token}");
        assert_ne!(token, new_token());
        assert!(!is_token_shaped("abcdef"));
        assert!(!is_token_shaped("ABCDEF.0123456789abcdef"));
        assert_eq!(token_hash(&token).len(), 64);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/key.pem");
        write_private(&path, "secret").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
