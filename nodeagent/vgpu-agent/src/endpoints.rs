//! The control-plane addresses the agent may call, with one lazily connected gRPC channel each.
//!
//! Any control-plane node accepts any call (followers forward to the leader), so the agent only
//! needs one that answers: each loop keeps its own cursor into the list and moves it to the next
//! address when a call fails.

use std::time::Duration;

use api::tls::Transport;
use api::v1::agent_client::AgentClient;
use tonic::transport::Channel;

use crate::error::{Error, Result};

/// Most control-plane addresses the agent takes.
pub const ENDPOINTS_MAX: usize = 64;
/// Largest message the agent accepts (a node's full assignment set).
pub const MESSAGE_BYTES_MAX: usize = 64 << 20;

/// The control plane's addresses and their channels.
#[derive(Debug, Clone)]
pub struct Endpoints {
    entries: Vec<(String, Channel)>,
}

impl Endpoints {
    /// Plain-text channels (a control plane started with `--insecure`); see [`Self::with_transport`].
    pub fn new(addresses: &[String], connect_timeout: Duration) -> Result<Endpoints> {
        Endpoints::with_transport(addresses, connect_timeout, &Transport::Insecure)
    }

    /// Takes addresses as `HOST:PORT` or `http://HOST:PORT`; blanks and repeats are dropped.
    /// Channels connect on first use, so a control plane that is down now is no error here.
    /// `transport` makes them plain text or mTLS.
    pub fn with_transport(
        addresses: &[String],
        connect_timeout: Duration,
        transport: &Transport,
    ) -> Result<Endpoints> {
        let mut entries: Vec<(String, Channel)> = Vec::new();
        for address in addresses
            .iter()
            .map(|address| address.trim())
            .filter(|address| !address.is_empty())
        {
            if entries.iter().any(|(known, _)| known == address) {
                continue;
            }
            if entries.len() == ENDPOINTS_MAX {
                return Err(Error::BadEndpoint {
                    address: address.to_owned(),
                    source_message: format!("more than {ENDPOINTS_MAX} control-plane addresses"),
                });
            }
            let endpoint = transport
                .endpoint(address)
                .map_err(|error| Error::BadEndpoint {
                    address: address.to_owned(),
                    source_message: error.to_string(),
                })?
                .connect_timeout(connect_timeout)
                .tcp_nodelay(true)
                // Keepalives notice a control-plane node that vanished without closing the
                // connection, which would otherwise leave the assignment stream hanging.
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true);
            entries.push((address.to_owned(), endpoint.connect_lazy()));
        }
        if entries.is_empty() {
            return Err(Error::NoControlPlane);
        }
        Ok(Endpoints { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The address at `cursor` (taken modulo the number of addresses).
    pub fn address(&self, cursor: usize) -> &str {
        &self.entries[cursor % self.entries.len()].0
    }

    /// A client for the address at `cursor` (taken modulo the number of addresses).
    pub fn client(&self, cursor: usize) -> AgentClient<Channel> {
        let channel = self.entries[cursor % self.entries.len()].1.clone();
        AgentClient::new(channel).max_decoding_message_size(MESSAGE_BYTES_MAX)
    }

    /// The cursor of the address after the one at `cursor`.
    pub fn next(&self, cursor: usize) -> usize {
        (cursor + 1) % self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn takes_plain_and_http_addresses_and_rotates() {
        let addresses = [
            "127.0.0.1:7401",
            " http://127.0.0.1:7402 ",
            "",
            "127.0.0.1:7401",
        ]
        .map(String::from);
        let endpoints = Endpoints::new(&addresses, Duration::from_secs(1)).unwrap();
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints.address(0), "127.0.0.1:7401");
        assert_eq!(endpoints.address(1), "http://127.0.0.1:7402");
        assert_eq!(endpoints.next(1), 0);
        assert_eq!(endpoints.address(5), "http://127.0.0.1:7402");
    }

    #[tokio::test]
    async fn refuses_no_addresses_and_bad_ones() {
        assert!(matches!(
            Endpoints::new(&[" ".into()], Duration::from_secs(1)),
            Err(Error::NoControlPlane)
        ));
        let error = Endpoints::new(&["bad host:1".into()], Duration::from_secs(1)).unwrap_err();
        assert!(matches!(error, Error::BadEndpoint { .. }), "{error}");
    }
}
