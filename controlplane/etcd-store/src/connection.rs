//! `Connection`: an etcd client with the settings every call is bounded by, and the one place
//! that turns `etcd_client::Error` into this crate's `Error`.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::keys::Keys;

/// The longest answer a read may decode: `READ_ENTRIES_MAX` entries of `ENTRY_BYTES_MAX` plus
/// headers. tonic's default (4 MiB) would refuse a page of large entries.
pub const DECODE_BYTES_MAX: usize = 96 << 20;

/// Pause between tries of a request etcd could not serve (a member gone, a leader changing).
pub const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// How to reach the etcd cluster, and which prefix in it holds this pool.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `https://10.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Every key of the pool lives under it; it ends with `/` (`/vgpu/`).
    pub prefix: String,
    /// mTLS to etcd; `None` for plain `http://` endpoints.
    pub tls: Option<TlsPem>,
    /// Bound on opening the connection and proving a quorum answers.
    pub connect_timeout: Duration,
    /// Bound on every single request (a read, a transaction, a lease grant).
    pub request_timeout: Duration,
}

impl EtcdConfig {
    /// Plain-text endpoints with the default bounds (5 s each).
    pub fn new(endpoints: Vec<String>, prefix: &str) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            prefix: prefix.to_string(),
            tls: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::Config(
                "no etcd endpoint: set --etcd-endpoints".into(),
            ));
        }
        if !self.prefix.ends_with('/') || self.prefix.len() < 2 {
            return Err(Error::Config(format!(
                "the etcd prefix {:?} must be a path ending with '/', such as /vgpu/",
                self.prefix
            )));
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(Error::Config("etcd timeouts must be positive".into()));
        }
        Ok(())
    }
}

/// PEM material for mTLS to etcd: the CA that signed etcd's server certificates, and this
/// member's client certificate and key.
#[derive(Clone)]
pub struct TlsPem {
    pub ca: Vec<u8>,
    pub client_cert: Vec<u8>,
    pub client_key: Vec<u8>,
    /// The name to check etcd's certificate against when it is not the endpoint's host.
    pub server_name: Option<String>,
}

impl std::fmt::Debug for TlsPem {
    // The key never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPem")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// A client plus its bounds. Cheap to clone: clones share the underlying channels.
#[derive(Clone)]
pub struct Connection {
    client: Client,
    keys: Keys,
    endpoints: String,
    request_timeout: Duration,
}

impl Connection {
    /// Connects and proves that a quorum answers (a linearizable read of the cluster key), all
    /// within `connect_timeout + request_timeout`.
    pub async fn connect(config: &EtcdConfig) -> Result<Connection> {
        config.validate()?;
        let endpoints = config.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            // HTTP/2 pings find a dead member quickly, so the balancer moves to another.
            .with_keep_alive(Duration::from_secs(2), config.request_timeout)
            .with_keep_alive_while_idle(true)
            // Without a leader etcd would hold a request until its own timeout; fail fast.
            .with_require_leader(true);
        if let Some(tls) = &config.tls {
            let mut tls_options = TlsOptions::new()
                .ca_certificate(Certificate::from_pem(&tls.ca))
                .identity(Identity::from_pem(&tls.client_cert, &tls.client_key));
            if let Some(name) = &tls.server_name {
                tls_options = tls_options.domain_name(name.clone());
            }
            options = options.with_tls(tls_options);
        }
        let connecting = Client::connect(config.endpoints.clone(), Some(options));
        let client = match tokio::time::timeout(config.connect_timeout, connecting).await {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => {
                return Err(classify(
                    &endpoints,
                    "connect",
                    config.connect_timeout,
                    error,
                ));
            }
            Err(_) => {
                return Err(Error::Unavailable {
                    endpoints,
                    operation: "connect",
                    timeout: config.connect_timeout,
                    reason: "no connection".into(),
                });
            }
        };
        let connection = Connection {
            client,
            keys: Keys::new(&config.prefix),
            endpoints,
            request_timeout: config.request_timeout,
        };
        let probe = connection.keys.cluster();
        connection
            .call_retrying("connect", |mut client| {
                let probe = probe.clone();
                async move { client.get(probe, None).await }
            })
            .await?;
        Ok(connection)
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// A clone of the client for calls `call` cannot wrap (streams).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Runs one request against a clone of the client, bounded by `request_timeout`.
    pub async fn call<T, F, Fut>(&self, operation: &'static str, request: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let timeout = self.request_timeout;
        match tokio::time::timeout(timeout, request(self.client.clone())).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(classify(&self.endpoints, operation, timeout, error)),
            Err(_) => Err(Error::Unavailable {
                endpoints: self.endpoints.clone(),
                operation,
                timeout,
                reason: "no answer".into(),
            }),
        }
    }

    /// `call` for a request that is safe to repeat (a read, a put of the same value, a delete):
    /// tries again while etcd answers `Unavailable` (the balancer still on a dead member, an
    /// etcd leader election), starting tries only within `retry_window` of the first one, so it
    /// ends within `retry_window + request_timeout`.
    pub async fn call_retrying<T, F, Fut>(
        &self,
        operation: &'static str,
        mut request: F,
    ) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.retry_window();
        loop {
            match self.call(operation, &mut request).await {
                Err(Error::Unavailable { reason, .. })
                    if Instant::now() + RETRY_PAUSE < deadline =>
                {
                    tracing::debug!(operation, reason, "etcd unavailable; trying again");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                other => return other,
            }
        }
    }

    /// How long after a request's first try another may start: one and a half request
    /// timeouts, so that a try that hung until its timeout on a member that just died (the
    /// client's balancer still routes to it for a moment) leaves room for one through a live
    /// member.
    pub fn retry_window(&self) -> Duration {
        self.request_timeout * 3 / 2
    }

    /// `Error::Unavailable` for `operation`, for bounds this module does not apply itself.
    pub fn unavailable(&self, operation: &'static str, reason: String) -> Error {
        Error::Unavailable {
            endpoints: self.endpoints.clone(),
            operation,
            timeout: self.request_timeout,
            reason,
        }
    }
}

/// Transport failures, timeouts and "no leader" mean the quorum is out of reach: the caller may
/// retry. Anything else is etcd refusing this request, which a retry would not change.
fn classify(
    endpoints: &str,
    operation: &'static str,
    timeout: Duration,
    error: etcd_client::Error,
) -> Error {
    if let etcd_client::Error::InvalidUri(problem) = &error {
        return Error::Config(format!(
            "an etcd endpoint in {endpoints} is not a URL ({problem}): give URLs such as \
             https://10.0.0.1:2379 in --etcd-endpoints"
        ));
    }
    if is_tls_failure(&error) {
        return Error::Tls {
            endpoints: endpoints.to_string(),
            operation,
            reason: error.to_string(),
        };
    }
    let unavailable = match &error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            use tonic::Code;
            matches!(
                status.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
            ) || status.message().contains("leader")
                || status.message().contains("timed out")
        }
        etcd_client::Error::WatchError(_) | etcd_client::Error::LeaseKeepAliveError(_) => true,
        _ => false,
    };
    if unavailable {
        Error::Unavailable {
            endpoints: endpoints.to_string(),
            operation,
            timeout,
            reason: error.to_string(),
        }
    } else {
        Error::Rejected {
            endpoints: endpoints.to_string(),
            operation,
            source: error,
        }
    }
}

/// Whether the error (or a cause of it) is a failed TLS handshake. rustls and hyper report these
/// only as text inside an I/O error, so the chain's messages are searched.
fn is_tls_failure(error: &etcd_client::Error) -> bool {
    const MARKS: [&str; 5] = [
        "certificate",
        "Certificate",
        "HandshakeFailure",
        "InvalidContentType",
        "CorruptMessage",
    ];
    let mut cause: Option<&dyn std::error::Error> = Some(error);
    let mut depth = 0;
    // Bounded: error chains are short, but a cyclic `source` must not hang us.
    while let Some(current) = cause
        && depth < 16
    {
        let text = format!("{current:?}");
        if MARKS.iter().any(|mark| text.contains(mark)) {
            return true;
        }
        cause = current.source();
        depth += 1;
    }
    false
}
