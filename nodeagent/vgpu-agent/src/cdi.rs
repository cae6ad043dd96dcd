//! CDI (Container Device Interface) specs for the tenants placed on this node, so that
//! `docker run --device vgpu.dev/tenant=NAME` (Docker 25+ with CDI enabled) and
//! `podman run --device vgpu.dev/tenant=NAME` run a container inside the tenant's slice.
//!
//! One file, `<cdi dir>/vgpu.dev-tenant.json`, CDI version 0.6.0, kind `vgpu.dev/tenant`, one
//! device per tenant named after it. Each device's `containerEdits` carry:
//!
//! * `env`: the environment of [`crate::tenant::tenant_environment`], with `LD_PRELOAD` naming the
//!   interposer at [`CONTAINER_INTERPOSER_PATH`];
//! * `deviceNodes`: `/dev/nvidia<minor>` of each of the tenant's GPUs, then `/dev/nvidiactl`,
//!   `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools` (the runtime reads type and numbers from the
//!   host's nodes); simulated GPUs use their index as the minor and the device carries the
//!   annotation `vgpu.dev/simulated: "true"`;
//! * `mounts`: the interposer (read-only) at [`CONTAINER_INTERPOSER_PATH`], the NCCL plugin
//!   (read-only) at [`CONTAINER_NCCL_PLUGIN_PATH`] when it is installed beside the interposer on
//!   the host, and the tenant's own
//!   private directory ([`crate::private`]; read-write, at the same path as on the host, so that
//!   accounting spans containers and host processes). Nothing of the other tenants and nothing
//!   of the agent's state directory is mounted.
//!
//! The spec is rewritten atomically (temporary file, rename) whenever its content changes, and
//! removed when no tenant is placed here (a spec without devices is not useful to any runtime).
//! The driver's libraries are not part of this spec: they come from the NVIDIA Container Toolkit
//! (see the README).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::assignments::{AssignmentSet, TenantAssignment};
use crate::error::{Error, Result};
use crate::inventory::Inventory;
use crate::state::{probe_writable, remove_if_present, write_json};
use crate::tenant::{EnvConfig, nccl_plugin_beside, tenant_environment_with_plugin};

pub const CDI_VERSION: &str = "0.6.0";
/// The oldest CDI version that has everything vgpu writes except device annotations: what a spec
/// without annotations may declare, so that older container runtimes (containerd 1.7's first
/// releases read CDI 0.5.0 at most) accept it.
pub const CDI_VERSION_WITHOUT_ANNOTATIONS: &str = "0.5.0";
pub const CDI_KIND: &str = "vgpu.dev/tenant";
/// The spec's file name in the CDI directory.
pub const CDI_FILE: &str = "vgpu.dev-tenant.json";
/// Where the interposer appears inside containers.
pub const CONTAINER_INTERPOSER_PATH: &str = "/usr/lib/vgpu/libvgpu_cuda.so";
/// Where the NCCL plugin appears inside containers, when it is installed beside the interposer.
pub const CONTAINER_NCCL_PLUGIN_PATH: &str = "/usr/lib/vgpu/libvgpu_nccl.so";
/// The system CDI directory, used when it is writable.
pub const SYSTEM_CDI_DIR: &str = "/var/run/cdi";
/// Annotation on devices of simulated GPUs.
pub const SIMULATED_ANNOTATION: &str = "vgpu.dev/simulated";
/// Device nodes every CUDA process needs besides its GPUs.
pub const CONTROL_DEVICE_NODES: [&str; 3] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// A CDI spec (the subset vgpu writes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiSpec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<CdiDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=VALUE` strings.
    pub env: Vec<String>,
    pub device_nodes: Vec<DeviceNode>,
    pub mounts: Vec<Mount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub options: Vec<String>,
}

/// What the specs are built from besides the assignments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiConfig {
    /// Where the spec file goes.
    pub dir: PathBuf,
    /// The interposer on the host.
    pub interposer: PathBuf,
    pub shm_dir: PathBuf,
    pub state_dir: PathBuf,
    /// The node's MPS pipe directory when it runs MPS, mounted into every container.
    pub mps_pipe_dir: Option<PathBuf>,
    /// Which tenants join the node's MPS daemon.
    pub mps_tenants: crate::mps::MpsTenants,
}

/// `/var/run/cdi` when it can be created and written, else `<state dir>/cdi`. Simulated nodes
/// always use `<state dir>/cdi`: several of them may share one host (tests, local pools), and
/// the host's container runtime has no use for their specs.
pub fn default_cdi_dir(state_dir: &Path, simulated: bool) -> PathBuf {
    if simulated {
        return state_dir.join("cdi");
    }
    let system = Path::new(SYSTEM_CDI_DIR);
    if std::fs::create_dir_all(system).is_ok() && probe_writable(system).is_ok() {
        return system.to_owned();
    }
    state_dir.join("cdi")
}

/// The spec for `set` on node `node`; `None` when no tenant is placed here.
pub fn build_spec(
    node: &str,
    set: &AssignmentSet,
    inventory: &Inventory,
    config: &CdiConfig,
) -> Option<CdiSpec> {
    if set.tenants.is_empty() {
        return None;
    }
    let devices = set
        .tenants
        .values()
        .map(|assignment| tenant_device(node, assignment, inventory, config))
        .collect();
    let spec = CdiSpec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: CDI_KIND.to_owned(),
        devices,
    };
    spec.assert_valid();
    Some(spec)
}

/// The CDI device of one tenant, named after it: what `vgpu-agent exec` gives the tenant's
/// processes, for a container. The Kubernetes DRA driver (`vgpu-dra`) puts the same device in
/// a spec of its own kind, so a pod gets exactly what an `exec`ed process gets.
pub fn tenant_device(
    node: &str,
    assignment: &TenantAssignment,
    inventory: &Inventory,
    config: &CdiConfig,
) -> CdiDevice {
    let env_config = EnvConfig {
        interposer: Some(PathBuf::from(CONTAINER_INTERPOSER_PATH)),
        shm_dir: config.shm_dir.clone(),
        state_dir: config.state_dir.clone(),
        mps_pipe_dir: config.mps_pipe_dir.clone(),
        mps_tenants: config.mps_tenants,
    };
    let path = |path: &Path| path.to_string_lossy().into_owned();
    let layout = crate::private::Layout::new(&config.shm_dir);
    // A container sees the interposer, its own tenant's directory and the MPS pipes (on an MPS
    // node), nothing of the other tenants and nothing of the agent's state.
    let own = path(&layout.tenant_dir(&assignment.tenant));
    let pipes = config.mps_pipe_dir.iter().map(|pipes| Mount {
        host_path: path(pipes),
        container_path: path(pipes),
        options: bind_options("rw"),
    });
    let mut mounts = vec![
        Mount {
            host_path: path(&config.interposer),
            container_path: CONTAINER_INTERPOSER_PATH.to_owned(),
            options: bind_options("ro"),
        },
        Mount {
            host_path: own.clone(),
            container_path: own,
            options: bind_options("rw"),
        },
    ];
    mounts.extend(pipes);
    // The NCCL plugin is mounted (and named in the environment) when it is installed beside the
    // interposer on the host.
    let host_plugin = nccl_plugin_beside(Some(&config.interposer));
    if let Some(plugin) = &host_plugin {
        mounts.insert(
            1,
            Mount {
                host_path: path(plugin),
                container_path: CONTAINER_NCCL_PLUGIN_PATH.to_owned(),
                options: bind_options("ro"),
            },
        );
    }
    let container_plugin = host_plugin.map(|_| PathBuf::from(CONTAINER_NCCL_PLUGIN_PATH));
    let env = tenant_environment_with_plugin(
        node,
        assignment,
        &env_config,
        None,
        container_plugin.as_deref(),
    )
    .into_iter()
    .map(|(key, value)| format!("{key}={value}"))
    .collect();
    let gpu_nodes = assignment.slices.iter().map(|slice| {
        let minor = inventory
            .gpu_by_uuid(&slice.gpu_uuid)
            .and_then(|gpu| gpu.device_minor)
            .unwrap_or(slice.gpu_index);
        format!("/dev/nvidia{minor}")
    });
    let mut device_nodes: Vec<DeviceNode> = Vec::new();
    for node_path in gpu_nodes.chain(CONTROL_DEVICE_NODES.map(str::to_owned)) {
        if !device_nodes.iter().any(|known| known.path == node_path) {
            device_nodes.push(DeviceNode { path: node_path });
        }
    }
    let annotations = if inventory.simulated {
        BTreeMap::from([(SIMULATED_ANNOTATION.to_owned(), "true".to_owned())])
    } else {
        BTreeMap::new()
    };
    CdiDevice {
        name: assignment.tenant.clone(),
        annotations,
        container_edits: ContainerEdits {
            env,
            device_nodes,
            mounts,
        },
    }
}

fn bind_options(mode: &str) -> Vec<String> {
    [mode, "nosuid", "nodev", "bind"]
        .map(str::to_owned)
        .to_vec()
}

impl CdiSpec {
    /// What CDI requires of what vgpu writes: a version that has every field used, a
    /// `vendor/class` kind, unique device names of the allowed characters,
    /// absolute paths, `KEY=VALUE` environment entries.
    pub fn assert_valid(&self) {
        let annotated = self.devices.iter().any(|d| !d.annotations.is_empty());
        assert!(
            self.cdi_version == CDI_VERSION
                || (self.cdi_version == CDI_VERSION_WITHOUT_ANNOTATIONS && !annotated),
            "CDI {CDI_VERSION}, or {CDI_VERSION_WITHOUT_ANNOTATIONS} without device annotations"
        );
        let (vendor, class) = self
            .kind
            .split_once('/')
            .expect("a CDI kind is vendor/class");
        assert!(
            vendor.contains('.') && !class.is_empty() && !class.contains('/'),
            "a CDI kind is a domain name, `/`, then a class"
        );
        let mut names = std::collections::BTreeSet::new();
        for device in &self.devices {
            let alphanumeric = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
            assert!(
                alphanumeric(device.name.chars().next())
                    && alphanumeric(device.name.chars().last())
                    && device
                        .name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')),
                "CDI device names begin and end with a letter or digit (they are tenant names)"
            );
            assert!(names.insert(&device.name), "CDI device names are unique");
            let edits = &device.container_edits;
            assert!(edits.env.iter().all(|entry| entry.contains('=')));
            assert!(
                edits
                    .device_nodes
                    .iter()
                    .all(|node| node.path.starts_with('/'))
            );
            assert!(edits.mounts.iter().all(|mount| {
                Path::new(&mount.host_path).is_absolute()
                    && Path::new(&mount.container_path).is_absolute()
            }));
        }
    }
}

/// Keeps the CDI spec of a node in step with its assignments.
#[derive(Debug)]
pub struct CdiWriter {
    config: CdiConfig,
    node: String,
    inventory: Inventory,
    /// What was last written (`None`: the file was removed); unknown before the first write.
    last: Option<Option<CdiSpec>>,
}

impl CdiWriter {
    /// Creates the CDI directory when missing and checks that it can be written.
    pub fn new(config: CdiConfig, inventory: Inventory) -> Result<CdiWriter> {
        std::fs::create_dir_all(&config.dir)
            .and_then(|()| probe_writable(&config.dir))
            .map_err(|source| Error::CdiDir {
                path: config.dir.clone(),
                source,
            })?;
        Ok(CdiWriter {
            node: inventory.node.clone(),
            config,
            inventory,
            last: None,
        })
    }

    pub fn path(&self) -> PathBuf {
        self.config.dir.join(CDI_FILE)
    }

    /// Writes (or removes) the spec for `set` when it differs from what was last written.
    /// Returns whether the file changed.
    pub fn update(&mut self, set: &AssignmentSet) -> Result<bool> {
        let spec = build_spec(&self.node, set, &self.inventory, &self.config);
        if self.last.as_ref() == Some(&spec) {
            return Ok(false);
        }
        match &spec {
            Some(spec) => write_json(&self.path(), spec)?,
            None => remove_if_present(&self.path())?,
        }
        self.last = Some(spec);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignments::{SliceAssignment, TenantAssignment};
    use crate::inventory::InventorySource;

    fn set(tenants: &[(&str, &[u32])], inventory: &Inventory) -> AssignmentSet {
        AssignmentSet {
            revision: 4,
            node_state: "ready".into(),
            tenants: tenants
                .iter()
                .map(|(name, gpus)| {
                    let assignment = TenantAssignment {
                        tenant: (*name).to_owned(),
                        priority: 1,
                        bandwidth_weight: 0,
                        latency: false,
                        latency_target_us: None,
                        slices: gpus
                            .iter()
                            .map(|&index| SliceAssignment {
                                gpu_index: index,
                                gpu_uuid: inventory.gpus[index as usize].uuid.clone(),
                                compute_percent: 50,
                                memory_bytes: 10 << 30,
                                guaranteed: true,
                                burst: false,
                                memory_limit_bytes: 0,
                            })
                            .collect(),
                    };
                    ((*name).to_owned(), assignment)
                })
                .collect(),
        }
    }

    fn config(dir: &Path) -> CdiConfig {
        CdiConfig {
            dir: dir.to_owned(),
            interposer: PathBuf::from("/opt/vgpu/libvgpu_cuda.so"),
            shm_dir: PathBuf::from("/dev/shm/vgpu"),
            state_dir: PathBuf::from("/var/lib/vgpu-agent/node-a"),
            mps_pipe_dir: None,
            mps_tenants: crate::mps::MpsTenants::default(),
        }
    }

    fn simulated() -> Inventory {
        InventorySource::from_simulate_arg("4xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap()
    }

    #[test]
    fn the_spec_has_the_cdi_shape() {
        let inventory = simulated();
        let set = set(&[("infer", &[1]), ("train", &[2, 3])], &inventory);
        let spec = build_spec("node-a", &set, &inventory, &config(Path::new("/cdi"))).unwrap();
        let json: serde_json::Value = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["cdiVersion"], "0.6.0");
        assert_eq!(json["kind"], "vgpu.dev/tenant");
        let devices = json["devices"].as_array().unwrap();
        let names: Vec<&str> = devices
            .iter()
            .map(|device| device["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["infer", "train"]);
        let train = &devices[1];
        assert_eq!(train["annotations"]["vgpu.dev/simulated"], "true");
        let env: Vec<&str> = train["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry.as_str().unwrap())
            .collect();
        let visible = format!(
            "CUDA_VISIBLE_DEVICES={},{}",
            inventory.gpus[2].uuid, inventory.gpus[3].uuid
        );
        assert_eq!(env[0], visible);
        assert!(env.contains(&"LD_PRELOAD=/usr/lib/vgpu/libvgpu_cuda.so"));
        assert!(env.contains(&"VGPU_TENANT=train"));
        assert!(env.contains(&"VGPU_MEMORY_LIMITS=0:10737418240,1:10737418240"));
        let nodes: Vec<&str> = train["containerEdits"]["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|node| node["path"].as_str().unwrap())
            .collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidia2",
                "/dev/nvidia3",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
        let mounts = train["containerEdits"]["mounts"].as_array().unwrap();
        assert_eq!(mounts[0]["hostPath"], "/opt/vgpu/libvgpu_cuda.so");
        assert_eq!(mounts[0]["containerPath"], CONTAINER_INTERPOSER_PATH);
        assert_eq!(mounts[0]["options"][0], "ro");
        // Only the tenant's own directory, nothing of the other tenants or the agent's state.
        assert_eq!(mounts.len(), 2, "{mounts:?}");
        assert_eq!(mounts[1]["hostPath"], "/dev/shm/vgpu/tenants/train");
        assert_eq!(mounts[1]["containerPath"], "/dev/shm/vgpu/tenants/train");
        assert_eq!(mounts[1]["options"][0], "rw");
        assert!(env.contains(&"VGPU_SHM_DIR=/dev/shm/vgpu/tenants/train"));
        assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS")));
    }

    #[test]
    fn real_gpus_use_their_device_minor_and_carry_no_annotation() {
        let mut inventory = simulated();
        inventory.simulated = false;
        inventory.gpus[1].device_minor = Some(6);
        let set = set(&[("infer", &[1])], &inventory);
        let spec = build_spec("node-a", &set, &inventory, &config(Path::new("/cdi"))).unwrap();
        let device = &spec.devices[0];
        assert!(device.annotations.is_empty());
        assert_eq!(device.container_edits.device_nodes[0].path, "/dev/nvidia6");
        let json = serde_json::to_value(&spec).unwrap();
        assert!(json["devices"][0].get("annotations").is_none());
    }

    #[test]
    fn the_nccl_plugin_beside_the_hosts_interposer_is_mounted_and_named() {
        let directory = tempfile::tempdir().unwrap();
        let inventory = simulated();
        let mut config = config(Path::new("/cdi"));
        config.interposer = directory.path().join("libvgpu_cuda.so");
        std::fs::write(&config.interposer, b"").unwrap();
        let set = set(&[("infer", &[1])], &inventory);
        let without = build_spec("node-a", &set, &inventory, &config).unwrap();
        assert_eq!(without.devices[0].container_edits.mounts.len(), 2);
        assert!(
            !without.devices[0]
                .container_edits
                .env
                .iter()
                .any(|entry| entry.starts_with("NCCL_NET_PLUGIN="))
        );
        let plugin = directory.path().join("libvgpu_nccl.so");
        std::fs::write(&plugin, b"").unwrap();
        let with = build_spec("node-a", &set, &inventory, &config).unwrap();
        let edits = &with.devices[0].container_edits;
        assert_eq!(edits.mounts[1].host_path, plugin.to_str().unwrap());
        assert_eq!(edits.mounts[1].container_path, CONTAINER_NCCL_PLUGIN_PATH);
        assert_eq!(edits.mounts[1].options[0], "ro");
        let named = format!("NCCL_NET_PLUGIN={CONTAINER_NCCL_PLUGIN_PATH}");
        assert!(edits.env.contains(&named), "{:?}", edits.env);
    }

    #[test]
    fn the_file_follows_the_assignments_and_goes_away_when_empty() {
        let directory = tempfile::tempdir().unwrap();
        let inventory = simulated();
        let mut writer = CdiWriter::new(config(directory.path()), inventory.clone()).unwrap();
        let path = directory.path().join(CDI_FILE);
        assert!(writer.update(&set(&[("infer", &[0])], &inventory)).unwrap());
        let written: CdiSpec =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(written.devices.len(), 1);
        // The same set again writes nothing.
        assert!(!writer.update(&set(&[("infer", &[0])], &inventory)).unwrap());
        // A stopped tenant's device disappears; the last tenant gone removes the file.
        assert!(
            writer
                .update(&set(&[("infer", &[0]), ("train", &[1])], &inventory))
                .unwrap()
        );
        assert!(writer.update(&set(&[("train", &[1])], &inventory)).unwrap());
        let written: CdiSpec =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let names: Vec<&str> = written.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["train"]);
        assert!(writer.update(&set(&[], &inventory)).unwrap());
        assert!(!path.exists());
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(directory.path()).unwrap().count(), 0);
    }
}
