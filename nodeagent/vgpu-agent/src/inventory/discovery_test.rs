//! Tests of [`super::assemble`] against a fake driver and a fake `/sys` tree.

use std::os::unix::fs::symlink;

use super::*;

/// A driver that answers from a list.
#[derive(Default)]
struct FakeDriver {
    gpus: Vec<Result<RawGpu, DiscoveryError>>,
    sm_counts: Option<BTreeMap<String, u32>>,
    count_error: Option<String>,
}

impl GpuDiscovery for FakeDriver {
    fn driver_version(&self) -> Option<String> {
        Some("580.159.04".to_owned())
    }

    fn device_count(&self) -> Result<u32, DiscoveryError> {
        match &self.count_error {
            Some(error) => Err(DiscoveryError(error.clone())),
            None => Ok(self.gpus.len() as u32),
        }
    }

    fn gpu(&self, index: u32) -> Result<RawGpu, DiscoveryError> {
        self.gpus[index as usize].clone()
    }

    fn sm_counts(&self) -> Result<BTreeMap<String, u32>, DiscoveryError> {
        self.sm_counts
            .clone()
            .ok_or_else(|| DiscoveryError("libcuda.so.1: cannot open shared object file".into()))
    }
}

const BUSES: [&str; 4] = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
];

fn gpu(index: u32) -> RawGpu {
    RawGpu {
        index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        name: "NVIDIA H100 80GB HBM3".to_owned(),
        memory_bytes: 81559 << 20,
        pci_bus_id: BUSES[index as usize].to_owned(),
        device_minor: Some(index),
        mig: MigState::Disabled {
            pending_enabled: false,
        },
        numa_node: None,
        links: Vec::new(),
    }
}

fn links_to(remote: LinkRemote, count: u32) -> Vec<RawLink> {
    (0..count)
        .map(|link| RawLink {
            link,
            remote: remote.clone(),
        })
        .collect()
}

fn empty_host() -> (tempfile::TempDir, HostFiles) {
    let directory = tempfile::tempdir().unwrap();
    let host = HostFiles::at(directory.path());
    (directory, host)
}

fn peers(inventory: &Inventory, index: usize) -> Vec<(u32, u32)> {
    inventory.gpus[index]
        .nvlink_peers
        .iter()
        .map(|peer| (peer.gpu_index, peer.link_count))
        .collect()
}

#[test]
fn bus_ids_take_the_sysfs_form() {
    assert_eq!(
        normalize_bus_id("00000000:2A:00.0").as_deref(),
        Some("0000:2a:00.0")
    );
    assert_eq!(
        normalize_bus_id(" 0001:18:1f.7 ").as_deref(),
        Some("0001:18:1f.7")
    );
    assert_eq!(normalize_bus_id("18:00.0").as_deref(), Some("0000:18:00.0"));
    for bad in [
        "",
        "garbage",
        "0000:18:00",
        "0000:18:20.0",
        "0000:18:00.8",
        "x:18:00.0",
    ] {
        assert_eq!(normalize_bus_id(bad), None, "{bad}");
    }
}

#[test]
fn models_and_sm_counts_come_from_product_names() {
    assert_eq!(model_from_name("NVIDIA H100 80GB HBM3"), "H100-80GB-HBM3");
    assert_eq!(model_from_name("NVIDIA H200"), "H200");
    assert_eq!(model_from_name("NVIDIA A100-SXM4-80GB"), "A100-SXM4-80GB");
    assert_eq!(model_from_name("  "), "unknown");
    assert_eq!(sm_count_from_table("H100-80GB-HBM3"), Some(132));
    assert_eq!(sm_count_from_table("H100-PCIe"), Some(114));
    assert_eq!(sm_count_from_table("A100-SXM4-80GB"), Some(108));
    assert_eq!(sm_count_from_table("GB300"), None);
}

#[test]
fn device_minors_are_read_from_the_driver_information() {
    let information = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t GPU-1\n\
                       Device Minor: \t 3\nBus Type: \t PCIe\n";
    assert_eq!(parse_device_minor(information), Some(3));
    assert_eq!(parse_device_minor("Model: x\n"), None);
}

#[test]
fn direct_nvlinks_are_counted_per_peer() {
    // GPUs 0 and 1: 12 links; GPUs 1 and 2: 6 links; GPU 3 has no NVLink.
    let mut gpus: Vec<RawGpu> = (0..4).map(gpu).collect();
    gpus[0].links = links_to(LinkRemote::Gpu(BUSES[1].into()), 12);
    gpus[1].links = links_to(LinkRemote::Gpu(BUSES[0].into()), 12);
    gpus[1].links.extend(links_to(
        LinkRemote::Unknown(Some("0000:3a:00.0".into())),
        6,
    ));
    gpus[2].links = links_to(LinkRemote::Gpu(BUSES[1].to_lowercase()), 6);
    // A link to a GPU that is not visible here is ignored.
    gpus[3].links = links_to(LinkRemote::Gpu("0000:db:00.0".into()), 4);
    let driver = FakeDriver {
        gpus: gpus.into_iter().map(Ok).collect(),
        ..Default::default()
    };
    let (_directory, host) = empty_host();
    let (inventory, findings) = assemble("node-a", &driver, &host).unwrap();
    assert_eq!(peers(&inventory, 0), [(1, 12)]);
    assert_eq!(peers(&inventory, 1), [(0, 12), (2, 6)]);
    assert_eq!(peers(&inventory, 2), [(1, 6)]);
    assert_eq!(peers(&inventory, 3), []);
    assert!(findings.warnings.is_empty(), "{findings:?}");
    // Without CUDA the table gives the SMs; the rest comes through as the driver said.
    let first = &inventory.gpus[0];
    assert_eq!(first.sm_count, 132);
    assert_eq!(first.model, "H100-80GB-HBM3");
    assert_eq!(first.pci_bus_id, "0000:18:00.0");
    assert_eq!(first.numa_node, -1);
    assert_eq!(first.device_minor, Some(0));
    assert_eq!(inventory.driver_version.as_deref(), Some("580.159.04"));
    assert!(!inventory.simulated);
    assert!(
        findings
            .notes
            .iter()
            .any(|note| note.contains("model table"))
    );
}

#[test]
fn nvswitch_links_make_every_pair_peers() {
    let mut gpus: Vec<RawGpu> = (0..3).map(gpu).collect();
    gpus[0].links = links_to(LinkRemote::Switch, 18);
    gpus[1].links = links_to(LinkRemote::Switch, 18);
    // One of GPU 2's links is down: the pairs with GPU 2 get 17.
    gpus[2].links = links_to(LinkRemote::Switch, 17);
    let driver = FakeDriver {
        gpus: gpus.into_iter().map(Ok).collect(),
        sm_counts: Some(BTreeMap::from([("0000:18:00.0".to_owned(), 130)])),
        ..Default::default()
    };
    let (_directory, host) = empty_host();
    let (inventory, findings) = assemble("node-a", &driver, &host).unwrap();
    assert_eq!(peers(&inventory, 0), [(1, 18), (2, 17)]);
    assert_eq!(peers(&inventory, 2), [(0, 17), (1, 17)]);
    // CUDA's count wins over the table where it answered.
    assert_eq!(inventory.gpus[0].sm_count, 130);
    assert_eq!(inventory.gpus[1].sm_count, 132);
    assert!(
        findings
            .notes
            .iter()
            .any(|note| note.contains("CUDA driver"))
    );
}

#[test]
fn one_sided_links_become_symmetric_with_a_warning() {
    let mut gpus: Vec<RawGpu> = (0..2).map(gpu).collect();
    gpus[0].links = links_to(LinkRemote::Gpu(BUSES[1].into()), 4);
    gpus[1].links = links_to(LinkRemote::Gpu(BUSES[0].into()), 3);
    let driver = FakeDriver {
        gpus: gpus.into_iter().map(Ok).collect(),
        ..Default::default()
    };
    let (_directory, host) = empty_host();
    let (inventory, findings) = assemble("node-a", &driver, &host).unwrap();
    assert_eq!(peers(&inventory, 0), [(1, 3)]);
    assert_eq!(peers(&inventory, 1), [(0, 3)]);
    assert_eq!(findings.warnings.len(), 1, "{findings:?}");
    assert!(findings.warnings[0].contains("4 against 3"));
}

#[test]
fn mig_enabled_and_unreadable_gpus_are_skipped() {
    let mut gpus: Vec<Result<RawGpu, DiscoveryError>> = (0..4).map(|i| Ok(gpu(i))).collect();
    let mut mig = gpu(1);
    mig.mig = MigState::Enabled {
        pending_enabled: true,
    };
    // GPU 0 has links to the MIG GPU; they are dropped with it.
    gpus[0].as_mut().unwrap().links = links_to(LinkRemote::Gpu(BUSES[1].into()), 2);
    mig.links = links_to(LinkRemote::Gpu(BUSES[0].into()), 2);
    gpus[1] = Ok(mig);
    gpus[2] = Err(DiscoveryError("GPU is lost".into()));
    let mut pending = gpu(3);
    pending.mig = MigState::Disabled {
        pending_enabled: true,
    };
    gpus[3] = Ok(pending);
    let driver = FakeDriver {
        gpus,
        ..Default::default()
    };
    let (_directory, host) = empty_host();
    let (inventory, findings) = assemble("node-a", &driver, &host).unwrap();
    let indexes: Vec<u32> = inventory.gpus.iter().map(|gpu| gpu.index).collect();
    assert_eq!(indexes, [0, 3]);
    assert_eq!(peers(&inventory, 0), []);
    let skipped: Vec<u32> = inventory.skipped.iter().map(|skip| skip.index).collect();
    assert_eq!(skipped, [1, 2]);
    assert!(inventory.skipped[0].reason.contains("MIG is enabled"));
    assert_eq!(inventory.skipped[0].pci_bus_id, "0000:2a:00.0");
    assert!(inventory.skipped[1].reason.contains("GPU is lost"));
    assert!(
        findings
            .warnings
            .iter()
            .any(|warning| warning.contains("next GPU reset")),
        "{findings:?}"
    );
}

#[test]
fn no_gpu_is_a_clear_error() {
    let (_directory, host) = empty_host();
    let none = FakeDriver::default();
    let error = assemble("node-a", &none, &host).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no NVIDIA GPU found (NVML: the driver reports 0 GPUs); pass --simulate SPEC to run with simulated GPUs"
    );
    let broken = FakeDriver {
        count_error: Some("Driver Not Loaded".into()),
        ..Default::default()
    };
    let error = assemble("node-a", &broken, &host).unwrap_err();
    assert!(
        error.to_string().contains("(NVML: Driver Not Loaded)"),
        "{error}"
    );
    let mut only_mig = gpu(0);
    only_mig.mig = MigState::Enabled {
        pending_enabled: true,
    };
    let all_mig = FakeDriver {
        gpus: vec![Ok(only_mig)],
        ..Default::default()
    };
    let error = assemble("node-a", &all_mig, &host).unwrap_err();
    assert!(
        error.to_string().contains("GPU 0: MIG is enabled"),
        "{error}"
    );
    assert!(error.to_string().contains("--simulate SPEC"), "{error}");
}

/// Builds `/sys/devices/<path>` with a `numa_node` file and returns its directory.
fn pci_device(root: &Path, path: &str, numa: &str) -> PathBuf {
    let directory = root.join("sys/devices").join(path);
    fs::create_dir_all(&directory).unwrap();
    fs::write(directory.join("numa_node"), numa).unwrap();
    directory
}

#[test]
fn numa_nodes_minors_and_nearest_nics_come_from_the_host_files() {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path();
    // GPU 0 and mlx5_0 share a PCIe switch under root port 0000:15:01.0; GPU 1 and mlx5_1 sit
    // under the same host bridge pci0000:9a on NUMA node 1; GPU 2 has no NIC on its bridge but
    // mlx5_1 on its NUMA node; GPU 3 likewise gets mlx5_0 through NUMA node 0.
    let devices = [
        (
            "0000:18:00.0",
            "pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0",
            "0\n",
        ),
        (
            "0000:2a:00.0",
            "pci0000:9a/0000:9a:01.0/0000:2a:00.0",
            "1\n",
        ),
        (
            "0000:3a:00.0",
            "pci0000:b0/0000:b0:01.0/0000:3a:00.0",
            "1\n",
        ),
        (
            "0000:5d:00.0",
            "pci0000:c0/0000:c0:01.0/0000:5d:00.0",
            "0\n",
        ),
    ];
    fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    for (bus, path, numa) in devices {
        let device = pci_device(root, path, numa);
        symlink(&device, root.join("sys/bus/pci/devices").join(bus)).unwrap();
    }
    let nic0 = pci_device(
        root,
        "pci0000:15/0000:15:01.0/0000:16:01.0/0000:19:00.0",
        "0\n",
    );
    let nic1 = pci_device(root, "pci0000:9a/0000:9a:02.0/0000:9b:00.0", "1\n");
    for (name, device) in [("mlx5_0", &nic0), ("mlx5_1", &nic1)] {
        let class = root.join("sys/class/infiniband").join(name);
        fs::create_dir_all(&class).unwrap();
        symlink(device, class.join("device")).unwrap();
    }
    // A net interface is ignored while RDMA devices exist.
    fs::create_dir_all(root.join("sys/class/net/eth0")).unwrap();
    symlink(&nic0, root.join("sys/class/net/eth0/device")).unwrap();
    // GPU 3's minor is not known to NVML; the driver's proc file has it.
    let information = root.join("proc/driver/nvidia/gpus/0000:5d:00.0");
    fs::create_dir_all(&information).unwrap();
    fs::write(information.join("information"), "Device Minor: \t 7\n").unwrap();

    let mut gpus: Vec<RawGpu> = (0..4).map(gpu).collect();
    gpus[3].device_minor = None;
    gpus[3].numa_node = Some(5);
    let driver = FakeDriver {
        gpus: gpus.into_iter().map(Ok).collect(),
        ..Default::default()
    };
    let (inventory, _) = assemble("node-a", &driver, &HostFiles::at(root)).unwrap();
    let numa: Vec<i32> = inventory.gpus.iter().map(|gpu| gpu.numa_node).collect();
    assert_eq!(numa, [0, 1, 1, 0], "sysfs wins over NVML");
    let nics: Vec<Vec<String>> = inventory
        .gpus
        .iter()
        .map(|gpu| gpu.nearest_nics.clone())
        .collect();
    assert_eq!(
        nics,
        [
            vec!["mlx5_0"],
            vec!["mlx5_1"],
            vec!["mlx5_1"],
            vec!["mlx5_0"]
        ]
    );
    assert_eq!(inventory.gpus[3].device_minor, Some(7));
}

#[test]
fn network_interfaces_serve_when_there_is_no_rdma_device() {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path();
    let gpu_device = pci_device(root, "pci0000:00/0000:00:05.0", "-1\n");
    fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    symlink(&gpu_device, root.join("sys/bus/pci/devices/0000:18:00.0")).unwrap();
    let nic = pci_device(root, "pci0000:00/0000:00:03.0/virtio0", "-1\n");
    fs::create_dir_all(root.join("sys/class/net/eth0")).unwrap();
    symlink(&nic, root.join("sys/class/net/eth0/device")).unwrap();
    // `lo` has no device and is not a NIC.
    fs::create_dir_all(root.join("sys/class/net/lo")).unwrap();
    let host = HostFiles::at(root);
    assert_eq!(host.numa_node("0000:18:00.0"), Some(-1));
    assert_eq!(host.numa_node_count(), 0);
    let nics = host.nics();
    assert_eq!(nics.len(), 1);
    assert_eq!(nics[0].name, "eth0");
    let gpu_path = host.pci_path("0000:18:00.0").unwrap();
    assert_eq!(gpu_path, ["pci0000:00", "0000:00:05.0"]);
    assert_eq!(nearest_nics(Some(&gpu_path), -1, &nics), ["eth0"]);
    // Unknown PCI path and NUMA node: nothing is near.
    assert!(nearest_nics(None, -1, &nics).is_empty());
}

#[test]
fn a_single_numa_host_puts_unplaced_gpus_on_node_0() {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path();
    let gpu_device = pci_device(root, "pci0000:00/0000:00:06.0", "-1\n");
    fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    symlink(&gpu_device, root.join("sys/bus/pci/devices/0000:18:00.0")).unwrap();
    let driver = FakeDriver {
        gpus: vec![Ok(gpu(0))],
        ..Default::default()
    };
    let (inventory, _) = assemble("node-a", &driver, &HostFiles::at(root)).unwrap();
    assert_eq!(inventory.gpus[0].numa_node, -1, "unknown node count");
    for name in ["node0", "possible", "online"] {
        fs::create_dir_all(root.join("sys/devices/system/node").join(name)).unwrap();
    }
    let (inventory, _) = assemble("node-a", &driver, &HostFiles::at(root)).unwrap();
    assert_eq!(inventory.gpus[0].numa_node, 0);
    fs::create_dir_all(root.join("sys/devices/system/node/node1")).unwrap();
    let (inventory, _) = assemble("node-a", &driver, &HostFiles::at(root)).unwrap();
    assert_eq!(inventory.gpus[0].numa_node, -1, "two nodes: unknown");
}
