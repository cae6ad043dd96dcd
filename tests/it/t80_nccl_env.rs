//! A tenant's bandwidth share reaches its processes: `vgpuctl place --bandwidth` (or the compute
//! share by default) becomes the NCCL tuner's weight in `vgpu-agent env`, and tenants holding
//! fractions of a GPU get their own NCCL host identity.

use anyhow::{Result, bail};
use std::process::Command;
use std::time::{Duration, Instant};
use tests::{Cluster, binary};

/// `vgpu-agent env` for `tenant` once the agent has the placement.
fn tenant_env(cluster: &Cluster, tenant: &str, shm_dir: &str) -> Result<String> {
    tenant_env_with(cluster, tenant, shm_dir, &[])
}

fn tenant_env_with(
    cluster: &Cluster,
    tenant: &str,
    shm_dir: &str,
    vars: &[(&str, &str)],
) -> Result<String> {
    let state_dir = &cluster.agents[0].state_dir;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new(binary("vgpu-agent"))
            .args([
                "env",
                "--tenant",
                tenant,
                "--name",
                "node-a",
                "--shm-dir",
                shm_dir,
            ])
            .arg("--state-dir")
            .arg(state_dir)
            .envs(vars.iter().copied())
            .output()?;
        if out.status.success() {
            return Ok(String::from_utf8(out.stdout)?);
        }
        if Instant::now() > deadline {
            bail!(
                "vgpu-agent env --tenant {tenant}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn bandwidth_weights_and_slice_identities_reach_the_tenant_environment() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    let shm = tempfile::tempdir()?;
    let shm_dir = shm.path().to_string_lossy().into_owned();
    cluster.start_agent_with(
        "node-a",
        "1xH100-80GB",
        &["--shm-dir", &shm_dir, "--nic-gbps", "100"],
    )?;
    cluster.wait_nodes_ready(1)?;

    let placed = cluster.vgpuctl(&["place", "train", "--gpus", "0.5", "--bandwidth", "75"])?;
    assert!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );
    let placed = cluster.vgpuctl(&["place", "serve", "--gpus", "0.25", "--latency"])?;
    assert!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );

    let train = tenant_env(&cluster, "train", &shm_dir)?;
    let serve = tenant_env(&cluster, "serve", &shm_dir)?;
    assert!(train.contains("VGPU_NCCL_WEIGHT='75'"), "{train}");
    // no weight given: the compute share (25 percent of one GPU)
    assert!(serve.contains("VGPU_NCCL_WEIGHT='25'"), "{serve}");
    assert!(train.contains("NCCL_HOSTID='vgpu-node-a-train'"), "{train}");
    assert!(serve.contains("NCCL_HOSTID='vgpu-node-a-serve'"), "{serve}");
    assert!(train.contains("NCCL_NET='vgpu'"), "{train}");
    assert!(train.contains("VGPU_NCCL_ACTIVITY_FILE="), "{train}");
    // The latency role holds on every node (the closed loop pauses and bounds queues without
    // MPS too); only the MPS pipes depend on the node.
    assert!(serve.contains("VGPU_LATENCY='1'"), "{serve}");
    assert!(!serve.contains("CUDA_MPS_PIPE_DIRECTORY"), "{serve}");
    let mps = [("VGPU_AGENT_MPS", "true")];
    let serve_mps = tenant_env_with(&cluster, "serve", &shm_dir, &mps)?;
    let train_mps = tenant_env_with(&cluster, "train", &shm_dir, &mps)?;
    // On an MPS node the latency tenant keeps a context of its own by default (MPS shares one
    // fault domain); `mps_tenants = all` makes it a client too.
    assert!(
        !serve_mps.contains("CUDA_MPS_PIPE_DIRECTORY"),
        "{serve_mps}"
    );
    let all = [
        ("VGPU_AGENT_MPS", "true"),
        ("VGPU_AGENT_MPS_TENANTS", "all"),
    ];
    let serve_all = tenant_env_with(&cluster, "serve", &shm_dir, &all)?;
    assert!(
        serve_all.contains(&format!("CUDA_MPS_PIPE_DIRECTORY='{shm_dir}/mps'")),
        "{serve_all}"
    );
    assert!(serve_mps.contains("VGPU_LATENCY='1'"), "{serve_mps}");
    assert!(train_mps.contains("VGPU_SPATIAL='1'"), "{train_mps}");
    assert!(!train_mps.contains("VGPU_LATENCY"), "{train_mps}");

    // The agent shares the NIC 75:25 through the token buckets the tenants' plugins obey.
    let flow = |env: &str| -> Result<u64> {
        let line = env
            .lines()
            .find(|l| l.contains("VGPU_NETSHARE_FLOW="))
            .unwrap_or_default();
        Ok(line
            .rsplit('=')
            .next()
            .unwrap_or_default()
            .trim_matches('\'')
            .parse()?)
    };
    assert!(
        train.contains(&format!(
            "VGPU_NETSHARE_TABLE='{shm_dir}/tenants/train/netshare'"
        )),
        "{train}"
    );
    let (train_flow, serve_flow) = (
        netshare::FlowId(flow(&train)?),
        netshare::FlowId(flow(&serve)?),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let rates = loop {
        // Each tenant's bucket is in its own table, in its private directory.
        let rate = |tenant: &str, flow| {
            let table =
                netshare::Table::open(&shm.path().join(format!("tenants/{tenant}/netshare")))
                    .ok()?;
            (table.flows() == [flow]).then_some(())?;
            Some(table.stats(flow)?.config.rate_bytes_per_second)
        };
        let rates = rate("train", train_flow).zip(rate("serve", serve_flow));
        match rates {
            Some(r) => break r,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            None => {
                bail!("the agent never wrote both tenants' rates into {shm_dir}/tenants/*/netshare")
            }
        }
    };
    assert_eq!(
        rates,
        (9_375_000_000, 3_125_000_000),
        "100 Gb/s split 75:25"
    );

    // A weight out of range is refused before anything is placed.
    let bad = cluster.vgpuctl(&["place", "bad", "--gpus", "1", "--bandwidth", "0"])?;
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("bandwidth weight"),
        "{bad:?}"
    );
    let tenants = tests::json(&cluster.vgpuctl(&["get", "tenants", "-o", "json"])?)?;
    assert_eq!(tenants.as_array().map(Vec::len), Some(2), "{tenants}");
    Ok(())
}

/// Two simulated agents on one host (as in the README's three-member example) each keep their
/// tenants' private directories under their own state directory, and `vgpu-agent env` finds
/// the right one without being told.
#[test]
fn simulated_agents_on_one_host_keep_their_tenants_directories_apart() -> Result<()> {
    let mut cluster = Cluster::start(1, &[])?;
    cluster.start_agent_with("node-a", "1xH100-80GB", &["--labels", "host=a"])?;
    cluster.start_agent_with("node-b", "1xH100-80GB", &["--labels", "host=b"])?;
    cluster.wait_nodes_ready(2)?;
    for (tenant, host) in [("on-a", "a"), ("on-b", "b")] {
        let placed = cluster.vgpuctl(&[
            "place",
            tenant,
            "--gpus",
            "0.5",
            "--selector",
            &format!("host={host}"),
        ])?;
        assert!(
            placed.status.success(),
            "{}",
            String::from_utf8_lossy(&placed.stderr)
        );
    }
    for (tenant, node) in [("on-a", 0), ("on-b", 1)] {
        let state_dir = cluster.agents[node].state_dir.clone();
        let own = state_dir.join("shm/tenants").join(tenant);
        // The private directory is made before the assignment is committed (the commit point
        // is `assignments.json`), so `env` may still say "not placed" for a moment: wait for
        // both.
        let deadline = Instant::now() + Duration::from_secs(20);
        let out = loop {
            let out = Command::new(binary("vgpu-agent"))
                .args(["env", "--tenant", tenant, "--name"])
                .arg(if node == 0 { "node-a" } else { "node-b" })
                .arg("--state-dir")
                .arg(&state_dir)
                .output()?;
            if out.status.success() && own.join("nccl-activity").exists() {
                break out;
            }
            if Instant::now() > deadline {
                bail!(
                    "{} never appeared or `vgpu-agent env` kept failing: {}",
                    own.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = String::from_utf8(out.stdout)?;
        assert!(
            text.contains(&format!("VGPU_SHM_DIR='{}'", own.display())),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Each agent's prepare left the other's tenant alone (and its own directory holds only its
    // own tenant).
    let listing = |node: usize| -> Result<Vec<String>> {
        let dir = cluster.agents[node].state_dir.join("shm/tenants");
        let mut names: Vec<String> = std::fs::read_dir(dir)?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        names.sort();
        Ok(names)
    };
    assert_eq!(listing(0)?, ["on-a"]);
    assert_eq!(listing(1)?, ["on-b"]);
    Ok(())
}
