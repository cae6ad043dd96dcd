//! The node side of a claim, without sockets: [`Driver::prepare`] turns an allocation into a
//! vgpu tenant (its private directory, a CDI spec with its one device) and records it in the
//! checkpoint; [`Driver::unprepare`] undoes it. Both are idempotent, and the checkpoint makes
//! them so across restarts.
//!
//! Files, in the order they are written, so that a crash at any point leaves a state that the
//! next call (the kubelet retries every call that got no answer) or [`Driver::open`] repairs:
//!
//! The claim's CDI device is the tenant's (`vgpu_agent::cdi::tenant_device`) plus
//! [`toolkit_environment`].
//!
//! * prepare: the claim's CDI spec `<cdi dir>/vgpu.dev-claim_<uid>.json` (atomic), then the
//!   private directories of every prepared claim ([`vgpu_agent::private::prepare`]), then the
//!   checkpoint `<state dir>/dra-checkpoint.json` (atomic). Only then is the answer sent.
//! * unprepare: the private directories without the claim, then its CDI spec goes, then the
//!   checkpoint without it.
//! * open: the checkpoint is the truth. Every claim in it gets its directory and spec again, and
//!   specs and directories of claims not in it are removed.
//!
//! **Architecture Invariant:** the driver is the only writer of `vgpu.dev/claim` CDI specs. In
//! the first stage ([`Stage::Node`]) it is also the only writer of tenants' private directories
//! (see ARCHITECTURE.md, "Pods get slices through DRA"): [`Driver::open`] records it as the
//! shared-memory directory's keeper (`vgpu_agent::private::claim_keeper`) and refuses to start
//! where the agent keeps it. In the second stage ([`Stage::ControlPlane`]) the agent keeps them
//! (its tenants include the claims the driver pins, `crate::pool`), and the driver writes no
//! directory: it records a claim ([`Driver::record`]) with the tenant the agent wrote, after
//! noting it as being placed ([`Driver::begin_placing`]), so an unprepare after a crash in between
//! still releases it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vgpu_agent::assignments::{AssignmentSet, TenantAssignment};
use vgpu_agent::cdi::{
    CDI_VERSION, CDI_VERSION_WITHOUT_ANNOTATIONS, CdiConfig, CdiSpec, tenant_device,
};
use vgpu_agent::inventory::Inventory;
use vgpu_agent::private::{self, Layout};
use vgpu_agent::state::{remove_if_present, write_json};

use crate::claim::{self, Allocation, ClaimRef};
use crate::error::{Error, Result};

/// The CDI kind of the claims' devices; the agent's own spec uses `vgpu.dev/tenant`, so the two
/// never name the same device.
pub const CDI_KIND: &str = "vgpu.dev/claim";
/// The checkpoint's file name in the state directory.
pub const CHECKPOINT_FILE: &str = "dra-checkpoint.json";
/// The checkpoint's layout version.
pub const CHECKPOINT_VERSION: u32 = 1;
/// Largest checkpoint read back (65,536 claims of about 1 KiB).
pub const CHECKPOINT_BYTES_MAX: u64 = 64 << 20;
/// Most claims prepared on one node at once.
pub const CLAIMS_MAX: usize = vgpu_agent::assignments::TENANTS_PER_NODE_MAX;
const CDI_FILE_PREFIX: &str = "vgpu.dev-claim_";

/// What the driver needs besides the node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverConfig {
    pub node: String,
    /// Where the checkpoint lives.
    pub state_dir: PathBuf,
    /// Where the CDI specs go and what they mount (the shared-memory directory, the interposer).
    pub cdi: CdiConfig,
    /// The time slice of each GPU's compute schedule.
    pub quantum_ns: u64,
    /// Who makes a claim a tenant on the node.
    pub stage: Stage,
}

/// Who makes a prepared claim a tenant on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The first stage: the driver alone, without the control plane; it keeps the tenants'
    /// private directories.
    Node,
    /// The second stage: the control plane holds each claim as a pinned tenant and the node's
    /// agent (`vgpu-agent join --kubernetes-managed`) keeps its private directory.
    ControlPlane,
}

/// A device of a prepared claim, as the kubelet is told about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub cdi_device_ids: Vec<String>,
}

/// A claim that is a tenant on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub claim: ClaimRef,
    pub assignment: TenantAssignment,
    pub devices: Vec<PreparedDevice>,
}

/// The checkpoint file: every prepared claim by uid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    pub claims: BTreeMap<String, PreparedClaim>,
    /// In the second stage, claims whose pin was asked of the control plane and not yet
    /// recorded as prepared, by uid: an unprepare releases them too.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub placing: BTreeMap<String, ClaimRef>,
}

/// The prepared claims of one node and the files that make them tenants.
#[derive(Debug)]
pub struct Driver {
    config: DriverConfig,
    inventory: Inventory,
    checkpoint: Checkpoint,
}

impl Driver {
    /// Reads the checkpoint (none: nothing prepared) and brings the files in line with it.
    pub fn open(config: DriverConfig, inventory: Inventory) -> Result<Driver> {
        assert_eq!(config.node, inventory.node, "the inventory is this node's");
        for directory in [&config.state_dir, &config.cdi.dir] {
            std::fs::create_dir_all(directory).map_err(|source| Error::Io {
                action: "create",
                path: directory.clone(),
                source,
            })?;
        }
        // Before anything under the shared-memory directory is touched: where the agent keeps
        // the tenants, the driver would remove them (and the agent the pods').
        if config.stage == Stage::Node {
            private::claim_keeper(
                &Layout::new(&config.cdi.shm_dir),
                private::Keeper::KubernetesDriver,
            )?;
        }
        let checkpoint = read_checkpoint(&config.state_dir.join(CHECKPOINT_FILE))?;
        let driver = Driver {
            config,
            inventory,
            checkpoint,
        };
        for prepared in driver.checkpoint.claims.values() {
            driver.write_spec(prepared)?;
        }
        driver.remove_stray_specs()?;
        driver.prepare_directories(&driver.checkpoint)?;
        Ok(driver)
    }

    /// The claim with uid `uid` when it is prepared.
    pub fn prepared(&self, uid: &str) -> Option<&PreparedClaim> {
        self.checkpoint.claims.get(uid)
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn stage(&self) -> Stage {
        self.config.stage
    }

    /// Makes `allocation`'s claim a tenant (the first stage); a claim already prepared is
    /// returned as it was.
    pub fn prepare(&mut self, allocation: &Allocation) -> Result<PreparedClaim> {
        assert_eq!(self.config.stage, Stage::Node, "the second stage records");
        if let Some(prepared) = self.checkpoint.claims.get(&allocation.claim.uid) {
            return Ok(prepared.clone());
        }
        let assignment = self.plan(allocation)?;
        self.record(allocation, assignment)
    }

    /// The tenant `allocation`'s claim becomes on this node, if one more claim fits.
    pub fn plan(&self, allocation: &Allocation) -> Result<TenantAssignment> {
        if self.checkpoint.claims.len() >= CLAIMS_MAX {
            return Err(Error::Io {
                action: "prepare a claim on",
                path: self.config.state_dir.clone(),
                source: std::io::Error::other(format!(
                    "{CLAIMS_MAX} claims are prepared on this node already"
                )),
            });
        }
        Ok(claim::assignment(allocation, &self.inventory)?)
    }

    /// The second stage: notes that `claim`'s pin is being asked of the control plane, so that
    /// an unprepare releases it even when the driver stops before [`Driver::record`].
    pub fn begin_placing(&mut self, claim: &ClaimRef) -> Result<()> {
        assert_eq!(self.config.stage, Stage::ControlPlane);
        if self.checkpoint.claims.contains_key(&claim.uid)
            || self.checkpoint.placing.get(&claim.uid) == Some(claim)
        {
            return Ok(());
        }
        let mut next = self.checkpoint.clone();
        next.placing.insert(claim.uid.clone(), claim.clone());
        self.commit(next)
    }

    /// The tenant of claim `uid` that the control plane may hold (prepared, or being placed).
    pub fn tenant_of(&self, uid: &str) -> Option<String> {
        if let Some(prepared) = self.checkpoint.claims.get(uid) {
            return Some(prepared.assignment.tenant.clone());
        }
        self.checkpoint.placing.get(uid).map(claim::tenant_name)
    }

    /// Records `allocation`'s claim as the tenant `assignment` (its CDI spec, in the first stage
    /// its private directory, then the checkpoint); a claim already prepared is returned as it
    /// was.
    pub fn record(
        &mut self,
        allocation: &Allocation,
        assignment: TenantAssignment,
    ) -> Result<PreparedClaim> {
        let uid = &allocation.claim.uid;
        if let Some(prepared) = self.checkpoint.claims.get(uid) {
            return Ok(prepared.clone());
        }
        let cdi_id = format!("{CDI_KIND}={}", assignment.tenant);
        let prepared = PreparedClaim {
            claim: allocation.claim.clone(),
            devices: allocation
                .devices
                .iter()
                .map(|device| PreparedDevice {
                    request: device.request.clone(),
                    pool: device.pool.clone(),
                    device: device.device.clone(),
                    cdi_device_ids: vec![cdi_id.clone()],
                })
                .collect(),
            assignment,
        };
        let mut next = self.checkpoint.clone();
        next.claims.insert(uid.clone(), prepared.clone());
        next.placing.remove(uid);
        self.write_spec(&prepared)?;
        self.prepare_directories(&next)?;
        self.commit(next)?;
        Ok(prepared)
    }

    /// Undoes [`Driver::prepare`] (or [`Driver::record`]); a claim that is not prepared is done
    /// already. In the second stage the caller releases the tenant first.
    pub fn unprepare(&mut self, uid: &str) -> Result<()> {
        if !self.checkpoint.claims.contains_key(uid) && !self.checkpoint.placing.contains_key(uid) {
            return Ok(());
        }
        let mut next = self.checkpoint.clone();
        next.claims.remove(uid);
        next.placing.remove(uid);
        self.prepare_directories(&next)?;
        remove_if_present(&self.spec_path(uid))?;
        self.commit(next)
    }

    fn commit(&mut self, next: Checkpoint) -> Result<()> {
        assert_eq!(next.version, CHECKPOINT_VERSION);
        write_json(&self.config.state_dir.join(CHECKPOINT_FILE), &next)?;
        self.checkpoint = next;
        Ok(())
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        spec_path(&self.config.cdi.dir, uid)
    }

    fn write_spec(&self, prepared: &PreparedClaim) -> Result<()> {
        let mut device = tenant_device(
            &self.config.node,
            &prepared.assignment,
            &self.inventory,
            &self.config.cdi,
        );
        device
            .container_edits
            .env
            .extend(toolkit_environment(&prepared.assignment));
        // The oldest version that has what the device uses: containerd 1.7's first releases read
        // CDI 0.5.0 at most, and only simulated GPUs' devices carry annotations (0.6.0).
        let version = if device.annotations.is_empty() {
            CDI_VERSION_WITHOUT_ANNOTATIONS
        } else {
            CDI_VERSION
        };
        let spec = CdiSpec {
            cdi_version: version.to_owned(),
            kind: CDI_KIND.to_owned(),
            devices: vec![device],
        };
        spec.assert_valid();
        Ok(write_json(&self.spec_path(&prepared.claim.uid), &spec)?)
    }

    /// Removes the specs of claims that are not in the checkpoint (a crash between the spec and
    /// the checkpoint, or an unprepare that did not finish).
    fn remove_stray_specs(&self) -> Result<()> {
        let directory = &self.config.cdi.dir;
        let entries = std::fs::read_dir(directory).map_err(|source| Error::Io {
            action: "list",
            path: directory.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(uid) = name
                .strip_prefix(CDI_FILE_PREFIX)
                .and_then(|rest| rest.strip_suffix(".json"))
            else {
                continue;
            };
            if !self.checkpoint.claims.contains_key(uid) {
                tracing::info!("removing the CDI spec of claim uid {uid}, which is not prepared");
                remove_if_present(&entry.path())?;
            }
        }
        Ok(())
    }

    fn prepare_directories(&self, checkpoint: &Checkpoint) -> Result<()> {
        if self.config.stage == Stage::ControlPlane {
            // The agent keeps them.
            return Ok(());
        }
        let set = AssignmentSet {
            revision: 0,
            node_state: "ready".to_owned(),
            tenants: checkpoint
                .claims
                .values()
                .map(|prepared| {
                    (
                        prepared.assignment.tenant.clone(),
                        prepared.assignment.clone(),
                    )
                })
                .collect(),
        };
        let layout = Layout::new(&self.config.cdi.shm_dir);
        let done = private::prepare(&layout, &set, &private::agent_owner, self.config.quantum_ns)?;
        if let Some(problem) = done.problems.into_iter().next() {
            return Err(problem.into());
        }
        Ok(())
    }
}

/// What a pod's container gets besides the tenant's environment: the NVIDIA Container Toolkit's
/// variables (read by it under `runtimeClassName: nvidia`), so that it injects the driver's
/// libraries for exactly the tenant's GPUs. vgpu's spec carries no driver library (see
/// `vgpu_agent::cdi`).
pub fn toolkit_environment(assignment: &TenantAssignment) -> Vec<String> {
    let uuids: Vec<&str> = assignment
        .slices
        .iter()
        .map(|slice| slice.gpu_uuid.as_str())
        .collect();
    vec![
        format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(",")),
        "NVIDIA_DRIVER_CAPABILITIES=compute,utility".to_owned(),
    ]
}

/// The CDI spec file of claim `uid` in `cdi_dir`.
pub fn spec_path(cdi_dir: &Path, uid: &str) -> PathBuf {
    assert!(
        !uid.is_empty() && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
        "claim uids are checked before they name files"
    );
    cdi_dir.join(format!("{CDI_FILE_PREFIX}{uid}.json"))
}

fn read_checkpoint(path: &Path) -> Result<Checkpoint> {
    let bad = |reason: String| Error::Checkpoint {
        path: path.to_owned(),
        reason,
    };
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Checkpoint {
                version: CHECKPOINT_VERSION,
                ..Checkpoint::default()
            });
        }
        Err(error) => return Err(bad(error.to_string())),
    };
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(file, CHECKPOINT_BYTES_MAX + 1),
        &mut bytes,
    )
    .map_err(|error| bad(error.to_string()))?;
    if bytes.len() as u64 > CHECKPOINT_BYTES_MAX {
        return Err(bad(format!("larger than {CHECKPOINT_BYTES_MAX} bytes")));
    }
    let checkpoint: Checkpoint =
        serde_json::from_slice(&bytes).map_err(|error| bad(error.to_string()))?;
    if checkpoint.version != CHECKPOINT_VERSION {
        return Err(bad(format!(
            "version {} where this driver writes {CHECKPOINT_VERSION}",
            checkpoint.version
        )));
    }
    for (uid, prepared) in &checkpoint.claims {
        if *uid != prepared.claim.uid || !valid_uid(uid) {
            return Err(bad(format!("claim uid `{uid}` does not match its entry")));
        }
    }
    for (uid, claim) in &checkpoint.placing {
        if *uid != claim.uid || !valid_uid(uid) {
            return Err(bad(format!("claim uid `{uid}` does not match its entry")));
        }
    }
    Ok(checkpoint)
}

/// Whether `uid` may name a file: what Kubernetes writes (a UUID) and nothing else.
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 64 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

#[cfg(test)]
#[path = "driver_test.rs"]
mod tests;
