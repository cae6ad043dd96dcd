//! mTLS to etcd: a member with a certificate from etcd's client CA works; one whose certificate
//! etcd does not trust is refused within its bound.

use std::path::Path;

use api::pki::{CertAndKey, Subject, issue, new_ca};
use api::tls::Role;
use etcd_store::{Error, EtcdLog, TlsPem};

use crate::etcd_cluster::{ClusterTls, EtcdCluster, required};

fn write(dir: &Path, name: &str, pem: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).expect("write a PEM file");
    path
}

fn leaf(ca: &CertAndKey, name: &str, hosts: &[&str]) -> CertAndKey {
    let subject = Subject {
        name: name.to_string(),
        role: Role::Member,
        hosts: hosts.iter().map(|host| host.to_string()).collect(),
    };
    issue(ca, &subject, 1).expect("issue a certificate")
}

fn client_pem(ca: &CertAndKey, client: &CertAndKey) -> TlsPem {
    TlsPem {
        ca: ca.cert_pem.clone().into_bytes(),
        client_cert: client.cert_pem.clone().into_bytes(),
        client_key: client.key_pem.clone().into_bytes(),
        server_name: None,
    }
}

#[tokio::test]
async fn mutual_tls_admits_a_trusted_client_and_refuses_another() {
    let certs = tempfile::tempdir().expect("a folder for certificates");
    let ca = new_ca("etcd test CA", 1).expect("a CA");
    let server = leaf(&ca, "etcd", &["127.0.0.1", "localhost"]);
    let client = leaf(&ca, "member-1", &[]);
    let tls = ClusterTls {
        server_cert: write(certs.path(), "server.pem", &server.cert_pem),
        server_key: write(certs.path(), "server-key.pem", &server.key_pem),
        ca: write(certs.path(), "ca.pem", &ca.cert_pem),
        client: client_pem(&ca, &client),
    };
    let Some(etcd) = EtcdCluster::start_with(
        "mutual_tls_admits_a_trusted_client",
        1,
        Some(tls),
        required(),
    )
    .await
    else {
        return;
    };
    let log = etcd.claimed_log("/tls/", "c").await;
    assert_eq!(
        log.append(&[b"over mTLS".to_vec()]).await.expect("append"),
        1..=1
    );

    // A certificate from another CA: etcd refuses the handshake.
    let other_ca = new_ca("another CA", 1).expect("a CA");
    let stranger = leaf(&other_ca, "stranger", &[]);
    let mut config = etcd.config("/tls/");
    config.tls = Some(TlsPem {
        ca: ca.cert_pem.clone().into_bytes(),
        ..client_pem(&other_ca, &stranger)
    });
    let Err(error) = EtcdLog::connect(&config).await else {
        panic!("etcd admitted a client certificate from a CA it does not trust");
    };
    assert!(matches!(error, Error::Tls { .. }), "{error}");
    assert!(error.to_string().contains("CA"), "{error}");

    // Plain HTTP to a TLS port fails too.
    let mut plain = etcd.config("/tls/");
    plain.tls = None;
    plain.endpoints = plain
        .endpoints
        .iter()
        .map(|url| url.replace("https", "http"))
        .collect();
    let Err(error) = EtcdLog::connect(&plain).await else {
        panic!("plain HTTP to etcd's TLS port connected");
    };
    // Nothing to tell apart from a wrong address: the error points at the endpoints.
    assert!(matches!(error, Error::Unavailable { .. }), "{error}");
    assert!(error.to_string().contains("--etcd-endpoints"), "{error}");
}
