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

use std::time::Duration;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, PostParams};

use crate::claim::{self, Allocation, ClaimRef};
use crate::error::{Error, Result};
use crate::kubelet::ClaimSource;
use crate::slices::{self, SliceAction};

/// The bound on one publication of the slice (read, then create or replace).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

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

/// A kube error with what to check next.
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) if status.code == 403 => format!(
            "{error}; the driver's service account lacks a permission: apply deploy/k8s/dra/rbac.yaml"
        ),
        kube::Error::Api(status) if status.code == 404 => format!(
            "{error}; either the object was deleted, or resource.k8s.io/v1 is not served (it needs Kubernetes 1.34 or newer)"
        ),
        _ => error.to_string(),
    }
}
