//! Registrations as large as admission allows (issue 22, point 1): a few MB of registrations in
//! the log, then a member paused, wedged the cluster for minutes (a follower behind such a batch
//! never caught up). The nemesis registers [`BULK_NODES`] nodes of about 100 KiB each (labels,
//! GPU texts and NIC lists near their bounds, no heartbeats), pauses a follower, and requires it
//! to serve a linearizable read again; then removes the nodes (`Pool.RemoveNode`).

use crate::nemesis::client::Endpoint;
use anyhow::{Result, bail};
use api::v1::agent_client::AgentClient;
use api::v1::pool_client::PoolClient;
use api::v1::{Gpu, Node, RegisterRequest, RemoveNodeRequest};
use std::time::{Duration, Instant};

/// Nodes registered: about 1.9 MiB of registrations in all.
pub const BULK_NODES: usize = 16;
/// How long registering or removing one node may take (it retries across members).
const DEADLINE: Duration = Duration::from_secs(60);
/// How long one attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The names of the bulk nodes.
pub fn names() -> Vec<String> {
    (0..BULK_NODES)
        .map(|index| format!("bulk-{index:02}"))
        .collect()
}

/// `text` padded with `fill` to `length` characters.
fn padded(text: &str, fill: char, length: usize) -> String {
    assert!(text.len() <= length);
    let mut padded = text.to_owned();
    padded.extend(std::iter::repeat_n(fill, length - text.len()));
    padded
}

/// A registration near every bound of `api::validate::admit_node` (64 labels of 240 + 250
/// characters, 64 GPUs with 120-character uuids and models and 16 NICs of 60 characters each).
pub fn node(name: &str) -> Node {
    let labels = (0..64)
        .map(|index| {
            (
                padded(&format!("k{index:02}-"), 'a', 240),
                padded("v", 'v', 250),
            )
        })
        .collect();
    let gpus = (0..64u32)
        .map(|index| Gpu {
            uuid: padded(&format!("GPU-{name}-{index:02}-"), '0', 120),
            index,
            model: padded("NVIDIA H100 80GB HBM3 ", 'x', 120),
            memory_bytes: 80 << 30,
            sm_count: 132,
            numa_node: 0,
            pci_bus_id: format!("00000000:{index:02x}:00.0"),
            nearest_nics: (0..16)
                .map(|nic| padded(&format!("mlx5_{nic}-"), 'n', 60))
                .collect(),
            ..Default::default()
        })
        .collect();
    Node {
        name: name.to_owned(),
        address: padded("bulk.example.net", 'b', 250),
        labels,
        gpus,
        ..Default::default()
    }
}

fn channel(endpoint: &Endpoint) -> Result<tonic::transport::Channel> {
    Ok(endpoint
        .transport
        .endpoint(&endpoint.address)?
        .connect_timeout(Duration::from_secs(1))
        .timeout(ATTEMPT_TIMEOUT)
        .connect_lazy())
}

/// Registers the bulk nodes (as an admin, through the members in turn); returns the bytes
/// registered.
pub async fn register(endpoints: &[Endpoint]) -> Result<usize> {
    use prost::Message as _;
    let mut bytes = 0;
    for (number, name) in names().into_iter().enumerate() {
        let node = node(&name);
        bytes += node.encoded_len();
        let deadline = Instant::now() + DEADLINE;
        let mut turn = number;
        loop {
            let endpoint = &endpoints[turn % endpoints.len()];
            let request = RegisterRequest {
                node: Some(node.clone()),
            };
            match AgentClient::new(channel(endpoint)?).register(request).await {
                Ok(_) => break,
                Err(status) if Instant::now() >= deadline => bail!(
                    "registering {name} failed for {DEADLINE:?}; last, at {}: {}",
                    endpoint.service,
                    status.message()
                ),
                Err(status) => {
                    tracing::debug!(service = %endpoint.service, %status, "registering a bulk node; again");
                    turn += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }
    Ok(bytes)
}

/// Removes the bulk nodes (their tenants, if any, are placed elsewhere).
pub async fn remove(endpoints: &[Endpoint]) -> Result<()> {
    for (number, name) in names().into_iter().enumerate() {
        let deadline = Instant::now() + DEADLINE;
        let mut turn = number;
        loop {
            let endpoint = &endpoints[turn % endpoints.len()];
            let request = RemoveNodeRequest { node: name.clone() };
            match PoolClient::new(channel(endpoint)?)
                .remove_node(request)
                .await
            {
                Ok(_) => break,
                Err(status) if status.code() == tonic::Code::NotFound => break,
                Err(status) if Instant::now() >= deadline => bail!(
                    "removing {name} failed for {DEADLINE:?}; last, at {}: {}",
                    endpoint.service,
                    status.message()
                ),
                Err(_) => {
                    turn += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bulk_node_is_admitted_and_large() {
        use prost::Message as _;
        let node = node("bulk-00");
        api::validate::admit_node(Some(&node)).expect("within every bound");
        let size = node.encoded_len();
        assert!(
            (100 << 10..=api::validate::REGISTER_BYTES_MAX).contains(&size),
            "{size} bytes"
        );
    }
}
