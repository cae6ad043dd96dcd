//! Placement stability (issue 22): tenants that nobody releases must keep their placement, the
//! same node, GPUs and shares, through every fault the nemesis injects. A paused leader that
//! woke and marked every node lost, or a node whose heartbeats went stale under churn, re-placed
//! such tenants; linearizability alone does not see that (a re-placed tenant is still present).
//!
//! Before the faults, [`place`] places [`STABLE_TENANTS`] tenants (`stable-00`, ...) that the
//! clients never touch and records where each landed; after each fault has healed, and at the
//! end, [`check`] reads them again (linearizable `GetTenant`) and [`compare`] names every tenant
//! whose placement changed. Also here: [`churn`], the load of the churn-while-paused scenario.

use crate::nemesis::client::Endpoint;
use anyhow::{Context, Result, bail};
use api::ErrorCode;
use api::v1::pool_client::PoolClient;
use api::v1::{
    GetTenantRequest, PlaceRequest, PlacementRequest, ReleaseRequest, Tenant, TenantState,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Tenants that must not move.
pub const STABLE_TENANTS: usize = 8;
/// Each one's share: 8 x 0.25 GPU beside the clients' names (at most 16 x 0.5 GPU) fit the two
/// simulated 8-GPU nodes at once, so nothing needs to preempt or wait.
const STABLE_MILLI_GPUS: u32 = 250;
/// How long placing and reading the stable tenants may take (they retry across members).
const DEADLINE: Duration = Duration::from_secs(60);
/// How long one attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(4);
/// Tenant names the churn load cycles through.
const CHURN_NAMES: usize = 32;

/// Where a tenant is: its state and its slices (node, GPU uuid, compute share, memory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub state: i32,
    pub slices: Vec<(String, String, u32, u64)>,
}

impl Placement {
    pub fn of(tenant: &Tenant) -> Placement {
        let mut slices: Vec<(String, String, u32, u64)> = tenant
            .slices
            .iter()
            .map(|slice| {
                (
                    slice.node.clone(),
                    slice.gpu.clone(),
                    slice.compute_percent,
                    slice.memory_bytes,
                )
            })
            .collect();
        slices.sort();
        Placement {
            state: tenant.state,
            slices,
        }
    }

    fn describe(&self) -> String {
        let state = TenantState::try_from(self.state).map_or_else(
            |_| format!("state {}", self.state),
            |s| s.as_str_name().to_owned(),
        );
        let slices: Vec<String> = self
            .slices
            .iter()
            .map(|(node, gpu, compute, _)| format!("{node}/{gpu} {compute}%"))
            .collect();
        format!("{state} on [{}]", slices.join(", "))
    }
}

/// The names of the stable tenants.
pub fn names() -> Vec<String> {
    (0..STABLE_TENANTS)
        .map(|index| format!("stable-{index:02}"))
        .collect()
}

/// Every tenant whose placement differs from what `expected` recorded (moved, pending, gone),
/// one message each, saying `when` it was seen.
pub fn compare(
    expected: &BTreeMap<String, Placement>,
    observed: &BTreeMap<String, Option<Placement>>,
    when: &str,
) -> Vec<String> {
    let mut violations = Vec::new();
    for (name, before) in expected {
        match observed.get(name) {
            Some(Some(now)) if now == before => {}
            Some(Some(now)) => violations.push(format!(
                "tenant `{name}` lost its placement {when}: it was {}, now {}",
                before.describe(),
                now.describe()
            )),
            Some(None) => violations.push(format!(
                "tenant `{name}` is gone {when}: it was {}",
                before.describe()
            )),
            None => violations.push(format!("tenant `{name}` was not read {when}")),
        }
    }
    violations
}

/// A pool client of one member.
fn client(endpoint: &Endpoint) -> Result<PoolClient<tonic::transport::Channel>> {
    let channel = endpoint
        .transport
        .endpoint(&endpoint.address)?
        .connect_timeout(Duration::from_secs(1))
        .timeout(ATTEMPT_TIMEOUT)
        .connect_lazy();
    Ok(PoolClient::new(channel))
}

/// Reads `name` (linearizable) at any member: `None` when it does not exist.
async fn read(endpoints: &[Endpoint], name: &str) -> Result<Option<Tenant>> {
    let deadline = Instant::now() + DEADLINE;
    let mut last = String::new();
    while Instant::now() < deadline {
        for endpoint in endpoints {
            let request = GetTenantRequest {
                name: name.to_owned(),
                stale: false,
            };
            match client(endpoint)?.get_tenant(request).await {
                Ok(answer) => return Ok(Some(answer.into_inner())),
                Err(status) if ErrorCode::of(&status) == Some(ErrorCode::TenantNotFound) => {
                    return Ok(None);
                }
                Err(status) => last = format!("{}: {}", endpoint.service, status.message()),
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("no member answered a read of `{name}` within {DEADLINE:?}; last: {last}")
}

/// Places the stable tenants and waits until each is placed; returns where they are.
pub async fn place(endpoints: &[Endpoint]) -> Result<BTreeMap<String, Placement>> {
    let mut placed = BTreeMap::new();
    for name in names() {
        let deadline = Instant::now() + DEADLINE;
        let tenant = loop {
            let request = PlaceRequest {
                name: name.clone(),
                request: Some(PlacementRequest {
                    milli_gpus: STABLE_MILLI_GPUS,
                    ..Default::default()
                }),
            };
            // Placing an existing name with the same request answers the tenant, so a retry
            // after an unknown outcome is safe.
            let endpoint = &endpoints[placed.len() % endpoints.len()];
            let _ = client(endpoint)?.place(request).await;
            if let Some(tenant) = read(endpoints, &name).await?
                && tenant.state == TenantState::Placed as i32
            {
                break tenant;
            }
            if Instant::now() >= deadline {
                bail!("`{name}` was not placed within {DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        placed.insert(name, Placement::of(&tenant));
    }
    Ok(placed)
}

/// Reads the stable tenants again and compares them with `expected`.
pub async fn check(
    endpoints: &[Endpoint],
    expected: &BTreeMap<String, Placement>,
    when: &str,
) -> Result<Vec<String>> {
    let mut observed = BTreeMap::new();
    for name in expected.keys() {
        let tenant = read(endpoints, name)
            .await
            .with_context(|| format!("reading the stable tenants {when}"))?;
        observed.insert(name.clone(), tenant.as_ref().map(Placement::of));
    }
    Ok(compare(expected, &observed, when))
}

/// The churn load: places and releases `churn-NN` tenants (0.1 GPU each) as fast as the members
/// answer, round robin over them, until `stop`; returns how many calls were answered. Outside
/// the checked history (its names are its own); what it may break is the stable tenants'
/// placement and the nodes' heartbeats.
pub async fn churn(endpoints: Vec<Endpoint>, stop: Arc<AtomicBool>, answered: Arc<AtomicU64>) {
    let mut turn = 0usize;
    let clients: Vec<_> = endpoints.iter().filter_map(|e| client(e).ok()).collect();
    if clients.is_empty() {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        let name = format!("churn-{:02}", (turn / 2) % CHURN_NAMES);
        let mut pool = clients[turn % clients.len()].clone();
        let result = if turn.is_multiple_of(2) {
            let request = PlaceRequest {
                name,
                request: Some(PlacementRequest {
                    milli_gpus: 100,
                    ..Default::default()
                }),
            };
            pool.place(request).await.map(|_| ())
        } else {
            pool.release(ReleaseRequest { name }).await.map(|_| ())
        };
        if result.is_ok() {
            answered.fetch_add(1, Ordering::Relaxed);
        }
        turn += 1;
    }
    // Leave nothing of the load behind (best effort; a later run starts a new project anyway).
    for index in 0..CHURN_NAMES {
        let name = format!("churn-{index:02}");
        for pool in &clients {
            let mut pool = pool.clone();
            if pool
                .release(ReleaseRequest { name: name.clone() })
                .await
                .is_ok()
            {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(node: &str, gpu: &str) -> Placement {
        Placement {
            state: TenantState::Placed as i32,
            slices: vec![(node.to_owned(), gpu.to_owned(), 25, 1 << 30)],
        }
    }

    #[test]
    fn a_moved_pending_or_missing_tenant_is_a_violation() {
        let expected: BTreeMap<String, Placement> = [
            ("a".to_owned(), placement("node-a", "GPU-1")),
            ("b".to_owned(), placement("node-a", "GPU-2")),
            ("c".to_owned(), placement("node-b", "GPU-3")),
            ("d".to_owned(), placement("node-b", "GPU-4")),
        ]
        .into();
        let mut observed: BTreeMap<String, Option<Placement>> = expected
            .iter()
            .map(|(name, placement)| (name.clone(), Some(placement.clone())))
            .collect();
        assert!(compare(&expected, &observed, "after the pause").is_empty());

        observed.insert("a".to_owned(), Some(placement("node-b", "GPU-9")));
        observed.insert(
            "b".to_owned(),
            Some(Placement {
                state: TenantState::Pending as i32,
                slices: Vec::new(),
            }),
        );
        observed.insert("c".to_owned(), None);
        observed.remove("d");
        let violations = compare(&expected, &observed, "after the pause");
        assert_eq!(violations.len(), 4, "{violations:#?}");
        assert!(
            violations[0].contains("`a` lost its placement after the pause")
                && violations[0].contains("node-a/GPU-1 25%")
                && violations[0].contains("node-b/GPU-9"),
            "{}",
            violations[0]
        );
        assert!(
            violations[1].contains("TENANT_STATE_PENDING"),
            "{}",
            violations[1]
        );
        assert!(violations[2].contains("`c` is gone"), "{}", violations[2]);
        assert!(
            violations[3].contains("`d` was not read"),
            "{}",
            violations[3]
        );
    }
}
