//! `vgpu-dra`, the Kubernetes DRA driver of vgpu (driver name `vgpu.dev`): pods ask for a slice
//! of a GPU (`memory`, `compute`) or whole GPUs through ResourceClaims, and each prepared claim
//! is a vgpu tenant on its node, with exactly the environment `vgpu-agent exec` gives a tenant.
//!
//! Map of the crate:
//!
//! * [`claim`]: a claim's allocation and the tenant it becomes (pure).
//! * [`slices`]: the node's GPUs as a ResourceSlice, and what to send to the apiserver (pure).
//! * [`driver`]: preparing and unpreparing claims on the node's files, checkpointed.
//! * [`kubelet`]: the plugin-registration and DRA gRPC services on the kubelet's unix sockets.
//! * [`pool`]: the second stage's control-plane calls (the claim's pin, its release) and the
//!   bounded waits for the agent's tenant files.
//! * [`apiserver`]: the apiserver calls (claims, the slice) through kube-rs.
//! * [`health`]: which GPUs the slice taints, from the agent's health samples.
//! * [`error`]: the typed errors.
//!
//! **Architecture Invariant:** the tenant's environment, CDI device and private directory come
//! from `vgpu-agent`'s library (`tenant`, `cdi`, `private`); this crate never builds them itself.
//! **Architecture Invariant:** `claim`, `slices` and `driver` do not depend on kube-rs's client or
//! on tonic, so they are tested without sockets.

pub mod apiserver;
pub mod claim;
pub mod driver;
pub mod error;
pub mod health;
pub mod kubelet;
pub mod pool;
pub mod slices;

use std::path::{Path, PathBuf};

pub use error::{Error, Result};

/// Everything `vgpu-dra run` needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub driver: driver::DriverConfig,
    pub plugin: kubelet::PluginConfig,
    pub inventory: vgpu_agent::InventorySource,
    /// The second stage's control plane (with `driver.stage` = [`driver::Stage::ControlPlane`]).
    pub control_plane: Option<pool::ControlPlaneConfig>,
}

/// Runs the driver until `shutdown` completes: keeps the node's slice published (with the GPUs
/// that fail health checks tainted), serves the kubelet, and stops serving on shutdown.
pub async fn run(
    config: RunConfig,
    client: kube::Client,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let node = config.driver.node.clone();
    let inventory = config.inventory.discover(&node)?;
    // The node's files first: a driver that cannot keep its tenants (the agent keeps them, the
    // checkpoint is damaged) must not offer the node's GPUs to the scheduler.
    let driver = driver::Driver::open(config.driver.clone(), inventory.clone())?;
    let pcie_roots = if inventory.simulated {
        Default::default()
    } else {
        pcie_roots(&inventory, Path::new("/sys/bus/pci/devices"))
    };
    let unhealthy = {
        let inventory = inventory.clone();
        let state_dir = config.driver.state_dir.clone();
        health::spawn_sampler(
            move || -> Option<Box<dyn vgpu_agent::health::HealthSource>> {
                if inventory.simulated {
                    return Some(Box::new(vgpu_agent::health::SimulatedHealth::new(
                        &inventory, &state_dir,
                    )));
                }
                match vgpu_agent::health::nvml::NvmlHealth::open(&inventory) {
                    Ok(source) => Some(Box::new(source)),
                    Err(error) => {
                        tracing::warn!("cannot sample GPU health through NVML: {error}");
                        None
                    }
                }
            },
            health::SAMPLE_PERIOD_DEFAULT,
        )
    };
    let publisher = tokio::spawn(apiserver::keep_published(
        client.clone(),
        inventory,
        pcie_roots,
        unhealthy,
    ));
    let claims = apiserver::KubeClaims::new(client, &node);
    let control_plane = config
        .control_plane
        .map(|settings| pool::ControlPlane::new(settings, &node))
        .transpose()?;
    let plugin = kubelet::Plugin::start_with(config.plugin, driver, claims, control_plane)?;
    shutdown.await;
    publisher.abort();
    // The kubelet keeps its connections open; they get a GOAWAY, and calls in flight this long
    // to finish.
    match tokio::time::timeout(STOP_TIMEOUT, plugin.stop()).await {
        Ok(stopped) => stopped,
        Err(_) => {
            tracing::warn!(
                "calls still in flight after {} s; stopping anyway (the kubelet retries them)",
                STOP_TIMEOUT.as_secs()
            );
            Ok(())
        }
    }
}

/// How long calls in flight may take to finish at shutdown (the DaemonSet gives 15 s).
pub const STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The PCIe root complex of each real GPU, from sysfs (`<devices>/<bus id>` links to
/// `.../pci<domain>:<bus>/...`); GPUs whose link cannot be read are left out.
pub fn pcie_roots(
    inventory: &vgpu_agent::Inventory,
    devices: &Path,
) -> std::collections::BTreeMap<u32, String> {
    inventory
        .gpus
        .iter()
        .filter_map(|gpu| {
            let link: PathBuf = devices.join(sysfs_bus_id(&gpu.pci_bus_id));
            let target = std::fs::read_link(link).ok()?;
            let root = slices::pcie_root_from_sysfs(&target.to_string_lossy())?;
            Some((gpu.index, root))
        })
        .collect()
}

/// NVML writes bus ids with an 8-digit domain (`00000000:17:00.0`), sysfs with 4 (`0000:17:00.0`).
fn sysfs_bus_id(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// Copies the interposer (required) and the NCCL plugin (when present) from `from` (the image)
/// into `to` (a host directory), each through a temporary file and a rename, so a process that
/// has the old file mapped keeps it. Returns the files installed.
pub fn install_libraries(from: &Path, to: &Path) -> Result<Vec<PathBuf>> {
    use vgpu_agent::tenant::{INTERPOSER_FILE, NCCL_PLUGIN_FILE};
    let io = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    };
    let interposer = from.join(INTERPOSER_FILE);
    if !interposer.is_file() {
        return Err(Error::Io {
            action: "find the interposer at",
            path: interposer,
            source: std::io::Error::other(
                "the image has no interposer: build it (`cargo build --release -p interposer`) before deploy/docker/build.sh",
            ),
        });
    }
    std::fs::create_dir_all(to).map_err(io("create", to))?;
    let mut installed = Vec::new();
    for name in [INTERPOSER_FILE, NCCL_PLUGIN_FILE] {
        let source = from.join(name);
        if !source.is_file() {
            continue;
        }
        let target = to.join(name);
        let temporary = to.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::copy(&source, &temporary).map_err(io("copy to", &temporary))?;
        std::fs::rename(&temporary, &target).map_err(io("rename into", &target))?;
        installed.push(target);
    }
    assert!(!installed.is_empty(), "the interposer was found");
    Ok(installed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_are_installed_and_a_missing_interposer_says_how_to_build_it() {
        let root = tempfile::tempdir().unwrap();
        let (image, host) = (root.path().join("image"), root.path().join("host"));
        std::fs::create_dir_all(&image).unwrap();
        let error = install_libraries(&image, &host).unwrap_err();
        assert!(error.to_string().contains("-p interposer"), "{error}");
        std::fs::write(image.join("libvgpu_cuda.so"), b"elf").unwrap();
        let installed = install_libraries(&image, &host).unwrap();
        assert_eq!(installed, [host.join("libvgpu_cuda.so")]);
        std::fs::write(image.join("libvgpu_nccl.so"), b"elf2").unwrap();
        assert_eq!(install_libraries(&image, &host).unwrap().len(), 2);
        assert_eq!(
            std::fs::read(host.join("libvgpu_nccl.so")).unwrap(),
            b"elf2"
        );
        assert_eq!(
            std::fs::read_dir(&host).unwrap().count(),
            2,
            "no temporary left"
        );
    }

    #[test]
    fn nvml_bus_ids_become_sysfs_names() {
        assert_eq!(sysfs_bus_id("00000000:17:00.0"), "0000:17:00.0");
        assert_eq!(sysfs_bus_id("0000:AB:00.0"), "0000:ab:00.0");
    }
}
