//! The few apiserver calls the driver makes, through kube-rs:
//!
//! * `GET /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}`: a claim's
//!   allocation ([`KubeClaims`], the [`ClaimSource`] of the running driver);
//! * `GET`, `POST` and `PUT` of `/apis/resource.k8s.io/v1/resourceslices[/{name}]`: the node's
//!   slice ([`publish`], which asks [`slices::plan`] what to send).
//!
//! Each call is bounded by the client's timeouts (kube-rs: 295 s read, which the caller bounds
//! further: [`crate::kubelet::PluginConfig::apiserver_timeout`] for claims, [`PUBLISH_TIMEOUT`]
//! for the slice).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, PostParams};

use crate::claim::{self, Allocation, ClaimRef};
use crate::error::{Error, Result};
use crate::kubelet::ClaimSource;
use crate::slices::{self, SliceAction};

/// The bound on one publication of the slice (read, then create or replace).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait between two attempts to publish the slice.
pub const PUBLISH_RETRY_MAX: Duration = Duration::from_secs(60);

/// Reads claims from the apiserver.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
    node: String,
}

impl KubeClaims {
    pub fn new(client: kube::Client, node: &str) -> KubeClaims {
        KubeClaims {
            client,
            node: node.to_owned(),
        }
    }
}

impl ClaimSource for KubeClaims {
    async fn allocation(&self, wanted: &ClaimRef) -> Result<Allocation> {
        let claims: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &wanted.namespace);
        let found = claims
            .get(&wanted.name)
            .await
            .map_err(|error| Error::Apiserver {
                claim: wanted.clone(),
                reason: describe(&error),
            })?;
        Ok(claim::allocation_from_claim(&found, wanted, &self.node)?)
    }
}

/// Makes the apiserver's slice of this node `wanted` (any generation; see [`slices::plan`]).
/// Returns what was done, with the slice as sent.
pub async fn publish(client: &kube::Client, wanted: ResourceSlice) -> Result<SliceAction> {
    let name = wanted
        .metadata
        .name
        .clone()
        .expect("a wanted slice has a name");
    let failed = |error: kube::Error| Error::Publish {
        name: name.clone(),
        reason: describe(&error),
    };
    let call = async {
        let api: Api<ResourceSlice> = Api::all(client.clone());
        let existing = api.get_opt(&name).await.map_err(failed)?;
        let action = slices::plan(existing.as_ref(), wanted);
        match &action {
            SliceAction::Create(slice) => {
                api.create(&PostParams::default(), slice)
                    .await
                    .map_err(failed)?;
            }
            SliceAction::Replace(slice) => {
                api.replace(&name, &PostParams::default(), slice)
                    .await
                    .map_err(failed)?;
            }
            SliceAction::Unchanged => {}
        }
        Ok(action)
    };
    tokio::time::timeout(PUBLISH_TIMEOUT, call)
        .await
        .map_err(|_| Error::Publish {
            name: name.clone(),
            reason: format!(
                "the apiserver did not answer within {} s",
                PUBLISH_TIMEOUT.as_secs()
            ),
        })?
}

/// Keeps the node's slice published: at once, then whenever the tainted GPUs (`unhealthy`, from
/// [`crate::health::spawn_sampler`]) change. A failed publication is retried after 1 s,
/// doubling up to [`PUBLISH_RETRY_MAX`], or at the next change. Returns when `unhealthy`'s
/// sender is gone and the last publication succeeded.
pub async fn keep_published(
    client: kube::Client,
    inventory: vgpu_agent::Inventory,
    pcie_roots: BTreeMap<u32, String>,
    mut unhealthy: tokio::sync::watch::Receiver<BTreeMap<u32, String>>,
) {
    let first_wait = Duration::from_secs(1);
    let mut wait = first_wait;
    loop {
        let facts = slices::NodeFacts {
            pcie_roots: pcie_roots.clone(),
            unhealthy: unhealthy.borrow_and_update().clone(),
        };
        let wanted = slices::resource_slice(&inventory, &facts, 0);
        match publish(&client, wanted).await {
            Ok(action) => {
                let done = match action {
                    SliceAction::Create(_) => "created",
                    SliceAction::Replace(_) => "replaced",
                    SliceAction::Unchanged => "kept",
                };
                tracing::info!(
                    "{done} ResourceSlice {} (tainted GPUs: {:?})",
                    slices::slice_name(&inventory.node),
                    facts.unhealthy
                );
                wait = first_wait;
                if unhealthy.changed().await.is_err() {
                    return;
                }
            }
            Err(error) => {
                tracing::warn!("{error}; retrying in {} s", wait.as_secs());
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = unhealthy.changed() => {}
                }
                wait = (wait * 2).min(PUBLISH_RETRY_MAX);
            }
        }
    }
}

/// A kube error with what to check next.
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) if status.code == 403 => format!(
            "{error}; the driver's service account lacks a permission: apply deploy/k8s/dra/rbac.yaml"
        ),
        kube::Error::Api(status) if status.code == 404 => format!(
            "{error}; either the object was deleted, or resource.k8s.io/v1 is not served (it needs Kubernetes 1.34 or newer)"
        ),
        kube::Error::Api(_) => error.to_string(),
        _ => format!(
            "{error}; check that the apiserver is reachable from the node and that the driver's pod mounts its service account token"
        ),
    }
}
