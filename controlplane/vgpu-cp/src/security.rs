//! Who may call what: the role of the caller's client certificate (see `api::tls`) against the
//! call, checked by every handler before it reads or proposes anything, so a refused request
//! leaves no trace in the replicated state.
//!
//! - `admin`: everything.
//! - `tenant:OWNER`: place, change (`SetTenant`), release, get and list the tenants whose owner
//!   is OWNER, at a priority of at most the member's ceiling (`Guard::tenant_priority_max`), so
//!   a tenant cannot preempt what an admin placed above it. Writes carry the owner into the log
//!   (`pool::Command::AsOwner`), and applying them checks it again.
//! - `agent`: `Register`, `Heartbeat` and `WatchAssignments` for the node named by its
//!   certificate's common name, and `Place` of a pinned request (`PlacementRequest.pin`, a
//!   Kubernetes claim's slices: issue 18) on that node, which only that agent may place: the
//!   node's DRA driver holds its certificate. Not admins either: a pin is what the kube-scheduler
//!   allocated, which no person decides. `Release` of a tenant pinned to that node too
//!   (`PoolState::pinned_release_owner`); admins may release any tenant, pinned or not.
//! - `member`: the Raft transport (`Raft.*`), `Cluster.Status` and `Cluster.AddMember` (joining).
//! - `metrics`: `GET /metrics` (which names every owner's tenants and nodes), and
//!   `Cluster.Status`; admins and members may read `/metrics` too.
//! - no certificate: only `Agent.JoinNode`, which proves a bootstrap token instead.
//!
//! A certificate whose serial the replicated state lists as revoked (`Cluster.RevokeCertificate`)
//! is refused whatever its role.
//!
//! Under `--insecure` there are no certificates and every caller is an admin; a pin is then
//! accepted from anyone, like every other call (a cluster without certificates trusts its
//! network, and the DRA driver of such a cluster has no certificate to show).

use api::ErrorCode;
use api::pki::CertAndKey;
use api::tls::{Peer, Role};
use std::sync::Arc;
use tonic::{Request, Status};

/// The common name given to callers under `--insecure`.
pub const INSECURE_CALLER: &str = "insecure";
/// The highest priority tenant certificates may use unless the member is configured otherwise:
/// the upper tenth of the range (`api::validate::PRIORITY_MAX`) is left to admins.
pub const TENANT_PRIORITY_MAX_DEFAULT: i32 = 100;
/// Longest bootstrap token lifetime (`vgpu-cp token create --ttl`).
pub const TOKEN_TTL_MAX_SECONDS: u64 = 7 * 24 * 3600;

/// The security settings of a running member's API.
#[derive(Clone, Debug)]
pub struct Guard {
    /// `--insecure`: no certificates; everyone is an admin.
    pub insecure: bool,
    /// The cluster CA's certificate (PEM); `None` under `--insecure`.
    pub ca_cert_pem: Option<String>,
    /// The cluster CA with its key, when this member signs joining agents' certificates.
    pub ca_signer: Option<CertAndKey>,
    /// Where the revoked serials are read (the replicated state).
    pub revoked: Revocations,
    /// The highest priority a `tenant:OWNER` caller may place or set; admins are not bound.
    pub tenant_priority_max: i32,
}

/// The revoked certificates, read from the member's replicated state at each call. Empty
/// until [`Revocations::of`] connects it (tests, and the moment before the store is open).
#[derive(Clone, Default)]
pub struct Revocations(Option<Arc<crate::store::Shared>>);

impl Revocations {
    pub fn of(shared: Arc<crate::store::Shared>) -> Revocations {
        Revocations(Some(shared))
    }

    /// When (unix ms) the certificate with this serial was revoked, if it was.
    pub fn revoked_at(&self, serial: &str) -> Option<i64> {
        self.0.as_ref()?.read().pool.revoked.get(serial).copied()
    }
}

impl std::fmt::Debug for Revocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Revocations(replicated state)"
        } else {
            "Revocations(none)"
        })
    }
}

/// Which tenants a caller may see and change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantScope {
    All,
    Owner(String),
}

impl TenantScope {
    /// Whether a tenant recorded with `owner` is in scope.
    pub fn covers(&self, owner: &str) -> bool {
        match self {
            TenantScope::All => true,
            TenantScope::Owner(mine) => mine == owner,
        }
    }
}

/// A refusal: `[VGPU-PERMISSION-DENIED]`, who asked, and what to do.
pub fn denied(peer: &Peer, what: &str) -> Status {
    ErrorCode::PermissionDenied.status(format!(
        "the certificate of `{}` (role {}) does not allow {what}; use a certificate whose role allows it (docs/security.md lists what each role may do)",
        peer.name, peer.role
    ))
}

impl Guard {
    /// The caller of `request`: its certificate's name and role, or an admin under
    /// `--insecure`. No certificate is `UNAUTHENTICATED`.
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Peer, Status> {
        if self.insecure {
            return Ok(Peer {
                role: Role::Admin,
                name: INSECURE_CALLER.to_owned(),
                serial: String::new(),
            });
        }
        match Peer::of(request) {
            Some(Ok(peer)) => match self.revoked.revoked_at(&peer.serial) {
                None => Ok(peer),
                Some(at) => Err(ErrorCode::PermissionDenied.status(format!(
                    "the certificate of `{}` (role {}, serial {}) was revoked at unix ms {at}; ask an admin for a new one (`vgpu-cp cert issue`)",
                    peer.name, peer.role, peer.serial
                ))),
            },
            Some(Err(problem)) => Err(ErrorCode::PermissionDenied.status(format!(
                "{problem}; issue a new certificate with `vgpu-cp cert issue --role ...`"
            ))),
            None => Err(ErrorCode::Unauthenticated.status(
                "this call needs a client certificate signed by the cluster CA; configure tls_cert and tls_key (`vgpu-cp cert issue` makes them), or join an agent with `vgpu-agent join --token`",
            )),
        }
    }

    /// Admins only.
    pub fn admin<T>(&self, request: &Request<T>, what: &str) -> Result<Peer, Status> {
        let peer = self.caller(request)?;
        match peer.role {
            Role::Admin => Ok(peer),
            _ => Err(denied(&peer, what)),
        }
    }

    /// Admins and control-plane members.
    pub fn member<T>(&self, request: &Request<T>, what: &str) -> Result<Peer, Status> {
        let peer = self.caller(request)?;
        match peer.role {
            Role::Admin | Role::Member => Ok(peer),
            _ => Err(denied(&peer, what)),
        }
    }

    /// Admins, members and metrics scrapers: `GET /metrics`, which names every owner's tenants,
    /// nodes and usage.
    pub fn metrics<T>(&self, request: &Request<T>, what: &str) -> Result<Peer, Status> {
        let peer = self.caller(request)?;
        match peer.role {
            Role::Admin | Role::Member | Role::Metrics => Ok(peer),
            _ => Err(denied(&peer, what)),
        }
    }

    /// Admins, and the agent of `node`.
    pub fn agent<T>(&self, request: &Request<T>, node: &str, what: &str) -> Result<Peer, Status> {
        let peer = self.caller(request)?;
        match &peer.role {
            Role::Admin => Ok(peer),
            Role::Agent if peer.name == node => Ok(peer),
            Role::Agent => Err(denied(
                &peer,
                &format!("{what} for node `{node}` (an agent acts only for its own node)"),
            )),
            _ => Err(denied(&peer, what)),
        }
    }

    /// The agent of `node` only, for placing a pin there (see the module docs); any caller
    /// under `--insecure`.
    pub fn pin<T>(&self, request: &Request<T>, node: &str) -> Result<Peer, Status> {
        let peer = self.caller(request)?;
        self.check_pin(peer, node)
    }

    /// [`Guard::pin`] for a caller already known.
    pub fn check_pin(&self, peer: Peer, node: &str) -> Result<Peer, Status> {
        if self.insecure {
            return Ok(peer);
        }
        match &peer.role {
            Role::Agent if peer.name == node => Ok(peer),
            _ => Err(denied(
                &peer,
                &format!(
                    "placing a pinned tenant on node `{node}`: only that node's agent certificate may (its DRA driver places the slices Kubernetes allocated)"
                ),
            )),
        }
    }

    /// Refuses a priority above [`Guard::tenant_priority_max`] asked by a tenant certificate,
    /// with a message that says the ceiling.
    pub fn check_priority(
        &self,
        peer: &Peer,
        scope: &TenantScope,
        priority: i32,
    ) -> Result<(), Status> {
        if *scope == TenantScope::All || priority <= self.tenant_priority_max {
            return Ok(());
        }
        Err(ErrorCode::PermissionDenied.status(format!(
            "the certificate of `{}` (role {}) may use priorities up to {} (the ceiling for tenant certificates), not {priority}; ask an admin to place or change it above that",
            peer.name, peer.role, self.tenant_priority_max
        )))
    }

    /// Admins (all tenants) and tenants (their own).
    pub fn tenants<T>(
        &self,
        request: &Request<T>,
        what: &str,
    ) -> Result<(Peer, TenantScope), Status> {
        let peer = self.caller(request)?;
        let scope = match &peer.role {
            Role::Admin => TenantScope::All,
            Role::Tenant(owner) => TenantScope::Owner(owner.clone()),
            _ => return Err(denied(&peer, what)),
        };
        Ok((peer, scope))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(role: Role, name: &str) -> Peer {
        Peer {
            role,
            name: name.to_owned(),
            serial: "1".to_owned(),
        }
    }

    #[test]
    fn insecure_callers_are_admins_and_no_certificate_is_unauthenticated() {
        let insecure = Guard {
            insecure: true,
            ca_cert_pem: None,
            ca_signer: None,
            revoked: Revocations::default(),
            tenant_priority_max: TENANT_PRIORITY_MAX_DEFAULT,
        };
        let caller = insecure.admin(&Request::new(()), "anything").unwrap();
        assert_eq!(caller.role, Role::Admin);
        let secure = Guard {
            insecure: false,
            ca_cert_pem: None,
            ca_signer: None,
            revoked: Revocations::default(),
            tenant_priority_max: TENANT_PRIORITY_MAX_DEFAULT,
        };
        let status = secure.caller(&Request::new(())).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(
            status.message().starts_with("[VGPU-UNAUTHENTICATED]"),
            "{status:?}"
        );
    }

    #[test]
    fn refusals_name_the_caller_and_role() {
        let status = denied(&peer(Role::Tenant("a".into()), "alice"), "draining nodes");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        let message = status.message();
        assert!(
            message.starts_with("[VGPU-PERMISSION-DENIED]")
                && message.contains("`alice`")
                && message.contains("tenant:a")
                && message.contains("draining nodes"),
            "{message}"
        );
        assert!(TenantScope::Owner("a".into()).covers("a"));
        assert!(!TenantScope::Owner("a".into()).covers("b"));
        assert!(!TenantScope::Owner("a".into()).covers(""));
        assert!(TenantScope::All.covers("anyone"));
    }

    #[test]
    fn tenant_certificates_are_held_below_the_priority_ceiling_and_admins_are_not() {
        let guard = Guard {
            insecure: false,
            ca_cert_pem: None,
            ca_signer: None,
            revoked: Revocations::default(),
            tenant_priority_max: 100,
        };
        let alice = peer(Role::Tenant("alice".into()), "alice");
        let owner = TenantScope::Owner("alice".into());
        assert!(guard.check_priority(&alice, &owner, 100).is_ok());
        assert!(guard.check_priority(&alice, &owner, -1000).is_ok());
        let status = guard.check_priority(&alice, &owner, 1000).unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        let message = status.message();
        assert!(
            message.starts_with("[VGPU-PERMISSION-DENIED]")
                && message.contains("up to 100")
                && message.contains("not 1000"),
            "{message}"
        );
        let admin = peer(Role::Admin, "ops");
        assert!(
            guard
                .check_priority(&admin, &TenantScope::All, 1000)
                .is_ok()
        );
    }

    #[test]
    fn only_the_nodes_own_agent_places_a_pin_there() {
        let guard = Guard {
            insecure: false,
            ca_cert_pem: None,
            ca_signer: None,
            revoked: Revocations::default(),
            tenant_priority_max: TENANT_PRIORITY_MAX_DEFAULT,
        };
        let own = guard.check_pin(peer(Role::Agent, "gpu-1"), "gpu-1");
        assert_eq!(own.unwrap().name, "gpu-1");
        for caller in [
            peer(Role::Agent, "gpu-2"),
            peer(Role::Admin, "ops"),
            peer(Role::Tenant("ml".into()), "ml"),
            peer(Role::Member, "cp-1"),
        ] {
            let status = guard.check_pin(caller, "gpu-1").unwrap_err();
            assert_eq!(status.code(), tonic::Code::PermissionDenied);
            assert!(
                status
                    .message()
                    .contains("only that node's agent certificate"),
                "{status:?}"
            );
        }
        let insecure = Guard {
            insecure: true,
            ..guard
        };
        assert!(insecure.pin(&Request::new(()), "gpu-1").is_ok());
    }
}
