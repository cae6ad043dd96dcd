//! Running a tenant's processes inside its slice: the environment that `vgpu-agent exec` gives a
//! process, that `vgpu-agent env` prints and that the CDI spec ([`crate::cdi`]) puts into
//! containers. [`tenant_environment`] is pure; [`load_placement`] and [`exec`] do the reading and
//! the `exec(2)`.
//!
//! The environment, in this order:
//!
//! | variable | value |
//! | --- | --- |
//! | `CUDA_VISIBLE_DEVICES` | the tenant's GPU uuids on this node, in slice order (by GPU index) |
//! | `LD_PRELOAD` | the interposer, before any inherited `LD_PRELOAD` |
//! | `VGPU_TENANT`, `VGPU_NODE` | who and where |
//! | `VGPU_MEMORY_LIMITS` | `0:<bytes>,1:<bytes>`: per device ordinal *as the process sees it* |
//! | `VGPU_COMPUTE_SHARES` | `0:<percent>,1:<percent>` |
//! | `VGPU_PRIORITY` | the tenant's priority |
//! | `VGPU_BURST` | `1` when every slice may burst past its share, else `0` |
//! | `VGPU_GUARANTEED` | `1` when every slice's share is guaranteed, else `0` |
//! | `VGPU_SHM_DIR` | the shared-memory directory of the interposers (`/dev/shm/vgpu`) |
//! | `VGPU_AGENT_STATE_DIR` | the agent's state directory (the tenant files) |
//! | `VGPU_NCCL_WEIGHT` | the tenant's bandwidth weight: as placed (`vgpuctl place --bandwidth`), else its compute percents summed (at least 1) |
//! | `VGPU_NCCL_SHARE_FILE` | `<shm dir>/nccl-share`: where the tenants' NCCL tuners see each other |
//! | `VGPU_NETSHARE_TABLE`, `VGPU_NETSHARE_FLOW` | `<shm dir>/netshare` and the tenant's flow in it: the token bucket its NCCL network sends wait on ([`crate::bandwidth`]) |
//! | `NCCL_NET_PLUGIN`, `NCCL_TUNER_PLUGIN` | `libvgpu_nccl.so` beside the interposer, when it is there |
//! | `NCCL_HOSTID`, `NCCL_NET` | for a tenant with a fraction of a GPU: `vgpu-<node>-<tenant>` and `vgpu`, so NCCL treats the slice as its own device (no "Duplicate GPU detected" when two tenants' ranks share a GPU) and connects it through the plugin |
//!
//! Ordinals follow `CUDA_VISIBLE_DEVICES`: the process's device 0 is the tenant's first slice.

use std::convert::Infallible;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::assignments::TenantAssignment;
use crate::error::{Error, Result};
use crate::state::{read_assignments_file, read_tenant_file};

/// The interposer's file name, looked for next to the `vgpu-agent` binary.
pub const INTERPOSER_FILE: &str = "libvgpu_cuda.so";
/// Where the interposer is installed when it is not next to the binary.
pub const INTERPOSER_SYSTEM_PATH: &str = "/usr/lib/vgpu/libvgpu_cuda.so";
/// The NCCL plugin's file name, looked for beside the interposer.
pub const NCCL_PLUGIN_FILE: &str = "libvgpu_nccl.so";
/// The NCCL tuners' activity table, in the shared-memory directory.
pub const NCCL_SHARE_FILE: &str = "nccl-share";
/// The interposers' shared-memory directory by default.
pub const SHM_DIR_DEFAULT: &str = "/dev/shm/vgpu";

/// What the environment is built from besides the tenant's assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    /// The interposer to preload; `None` runs without it (nothing enforced).
    pub interposer: Option<PathBuf>,
    pub shm_dir: PathBuf,
    pub state_dir: PathBuf,
}

/// A tenant's placement on this node, as the agent last persisted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    /// Assignment revision of the agent's state.
    pub revision: u64,
    pub assignment: TenantAssignment,
}

/// The environment of tenant `assignment`'s processes on node `node` (see the module docs).
/// `inherited_ld_preload` is the `LD_PRELOAD` the process would otherwise have.
pub fn tenant_environment(
    node: &str,
    assignment: &TenantAssignment,
    config: &EnvConfig,
    inherited_ld_preload: Option<&str>,
) -> Vec<(String, String)> {
    assert!(
        !assignment.slices.is_empty(),
        "a placed tenant has slices on this node"
    );
    assert!(assignment.slices.is_sorted(), "slices are in GPU order");
    let slices = &assignment.slices;
    let per_ordinal = |value: &dyn Fn(usize) -> String| {
        (0..slices.len())
            .map(|ordinal| format!("{ordinal}:{}", value(ordinal)))
            .collect::<Vec<_>>()
            .join(",")
    };
    let flag = |all: bool| if all { "1" } else { "0" }.to_owned();
    let mut environment = vec![(
        "CUDA_VISIBLE_DEVICES".to_owned(),
        slices
            .iter()
            .map(|slice| slice.gpu_uuid.as_str())
            .collect::<Vec<_>>()
            .join(","),
    )];
    if let Some(interposer) = &config.interposer {
        environment.push((
            "LD_PRELOAD".to_owned(),
            ld_preload(&interposer.to_string_lossy(), inherited_ld_preload),
        ));
    }
    environment.extend([
        ("VGPU_TENANT".to_owned(), assignment.tenant.clone()),
        ("VGPU_NODE".to_owned(), node.to_owned()),
        (
            "VGPU_MEMORY_LIMITS".to_owned(),
            per_ordinal(&|ordinal| slices[ordinal].memory_bytes.to_string()),
        ),
        (
            "VGPU_COMPUTE_SHARES".to_owned(),
            per_ordinal(&|ordinal| slices[ordinal].compute_percent.to_string()),
        ),
        ("VGPU_PRIORITY".to_owned(), assignment.priority.to_string()),
        (
            "VGPU_BURST".to_owned(),
            flag(slices.iter().all(|slice| slice.burst)),
        ),
        (
            "VGPU_GUARANTEED".to_owned(),
            flag(slices.iter().all(|slice| slice.guaranteed)),
        ),
        (
            "VGPU_SHM_DIR".to_owned(),
            config.shm_dir.to_string_lossy().into_owned(),
        ),
        (
            "VGPU_AGENT_STATE_DIR".to_owned(),
            config.state_dir.to_string_lossy().into_owned(),
        ),
    ]);
    environment.extend([
        (
            "VGPU_NCCL_WEIGHT".to_owned(),
            crate::bandwidth::weight(assignment).to_string(),
        ),
        (
            "VGPU_NCCL_SHARE_FILE".to_owned(),
            config
                .shm_dir
                .join(NCCL_SHARE_FILE)
                .to_string_lossy()
                .into_owned(),
        ),
        (
            "VGPU_NETSHARE_TABLE".to_owned(),
            crate::bandwidth::table_path(&config.shm_dir)
                .to_string_lossy()
                .into_owned(),
        ),
        (
            "VGPU_NETSHARE_FLOW".to_owned(),
            crate::bandwidth::flow_id(&assignment.tenant).0.to_string(),
        ),
    ]);
    if let Some(plugin) = nccl_plugin_beside(config.interposer.as_deref()) {
        let plugin = plugin.to_string_lossy().into_owned();
        environment.push(("NCCL_NET_PLUGIN".to_owned(), plugin.clone()));
        environment.push(("NCCL_TUNER_PLUGIN".to_owned(), plugin));
    }
    environment.extend(slice_identity_environment(node, assignment));
    assert!(
        environment
            .iter()
            .all(|(key, value)| !key.is_empty() && !key.contains('=') && !value.contains('\0')),
        "environment entries are well formed"
    );
    environment
}

/// Per-slice identity for NCCL. NCCL refuses two ranks on one GPU that share a host identity
/// ("Duplicate GPU detected"), which is what two tenants' ranks on one GPU look like. A tenant
/// holding a fraction of a GPU therefore gets its own host identity (`NCCL_HOSTID`), so NCCL
/// treats its slice as a device of its own, and `NCCL_NET=vgpu` so that the traffic between such
/// "hosts" goes through libvgpu_nccl.so. Its processes on this node share the identity, so they
/// still reach each other over NVLink. Whole-GPU tenants keep NCCL's defaults.
pub fn slice_identity_environment(
    node: &str,
    assignment: &TenantAssignment,
) -> Vec<(String, String)> {
    if assignment
        .slices
        .iter()
        .all(|slice| slice.compute_percent >= 100)
    {
        return Vec::new();
    }
    vec![
        (
            "NCCL_HOSTID".to_owned(),
            format!("vgpu-{node}-{}", assignment.tenant),
        ),
        ("NCCL_NET".to_owned(), "vgpu".to_owned()),
    ]
}

/// `libvgpu_nccl.so` beside the interposer, when it is installed there.
pub fn nccl_plugin_beside(interposer: Option<&Path>) -> Option<PathBuf> {
    interposer?
        .parent()
        .map(|directory| directory.join(NCCL_PLUGIN_FILE))
        .filter(|path| path.is_file())
}

/// `interposer` first, then whatever was preloaded before (once).
fn ld_preload(interposer: &str, inherited: Option<&str>) -> String {
    let inherited = inherited.map(str::trim).unwrap_or_default();
    let already = inherited.split([':', ' ']).any(|entry| entry == interposer);
    match (inherited.is_empty(), already) {
        (true, _) => interposer.to_owned(),
        (false, true) => inherited.to_owned(),
        (false, false) => format!("{interposer}:{inherited}"),
    }
}

/// The interposer to preload: `explicit` when given, else `libvgpu_cuda.so` next to
/// `executable` when it exists there, else [`INTERPOSER_SYSTEM_PATH`].
pub fn resolve_interposer(explicit: Option<&Path>, executable: Option<&Path>) -> PathBuf {
    if let Some(explicit) = explicit {
        return explicit.to_owned();
    }
    if let Some(beside) = executable
        .and_then(Path::parent)
        .map(|directory| directory.join(INTERPOSER_FILE))
        .filter(|path| path.is_file())
    {
        return beside;
    }
    PathBuf::from(INTERPOSER_SYSTEM_PATH)
}

/// Tenant `tenant`'s placement from the state directory at `state_dir`, without writing to it.
/// The tenant must be in `assignments.json` (the commit point) and have its `tenants/` file;
/// `node_hint` names the node in messages when the directory does not.
pub fn load_placement(state_dir: &Path, tenant: &str, node_hint: &str) -> Result<Placement> {
    api::names::validate("tenant", tenant)?;
    if !state_dir.is_dir() {
        return Err(Error::NoAgentState {
            path: state_dir.to_owned(),
        });
    }
    let committed = read_assignments_file(state_dir)?;
    let node = committed
        .as_ref()
        .map_or_else(|| node_hint.to_owned(), |file| file.node.clone());
    let not_placed = || Error::TenantNotPlaced {
        tenant: tenant.to_owned(),
        node: node.clone(),
    };
    let Some(committed) = committed else {
        return Err(not_placed());
    };
    let Some(entry) = committed
        .assignments
        .iter()
        .find(|assignment| assignment.tenant == tenant)
    else {
        return Err(not_placed());
    };
    let Some(file) = read_tenant_file(state_dir, tenant)? else {
        return Err(not_placed());
    };
    // After a crash between the tenant file and the commit point the two may differ for a
    // moment; the committed entry wins.
    let mut assignment = if file.slices == entry.slices && file.priority == entry.priority {
        TenantAssignment {
            tenant: file.tenant,
            priority: file.priority,
            slices: file.slices,
            bandwidth_weight: entry.bandwidth_weight,
        }
    } else {
        entry.clone()
    };
    assignment.slices.sort();
    if assignment.slices.is_empty() {
        return Err(not_placed());
    }
    Ok(Placement {
        node,
        revision: committed.revision,
        assignment,
    })
}

/// What `vgpu-agent exec` runs with.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    pub state_dir: PathBuf,
    /// The node name for messages when the state directory does not say.
    pub node_hint: String,
    pub tenant: String,
    /// `None`: run without the interposer.
    pub interposer: Option<PathBuf>,
    pub shm_dir: PathBuf,
    /// The program and its arguments.
    pub command: Vec<OsString>,
}

/// Replaces this process with `config.command` inside the tenant's slice. Returns only on error.
pub fn exec(config: ExecConfig) -> Result<Infallible> {
    use std::os::unix::process::CommandExt;

    let (program, arguments) = config
        .command
        .split_first()
        .expect("the command line requires a command");
    let placement = load_placement(&config.state_dir, &config.tenant, &config.node_hint)?;
    if let Some(interposer) = &config.interposer
        && !interposer.is_file()
    {
        return Err(Error::InterposerMissing {
            path: interposer.clone(),
        });
    }
    let env_config = EnvConfig {
        interposer: config.interposer.clone(),
        shm_dir: config.shm_dir.clone(),
        state_dir: config.state_dir.clone(),
    };
    let inherited = std::env::var("LD_PRELOAD").ok();
    let environment = tenant_environment(
        &placement.node,
        &placement.assignment,
        &env_config,
        inherited.as_deref(),
    );
    tracing::debug!(
        "tenant {}: running {} with {environment:?}",
        config.tenant,
        program.to_string_lossy()
    );
    let source = std::process::Command::new(program)
        .args(arguments)
        .envs(environment)
        .exec();
    Err(Error::Exec {
        program: program.to_string_lossy().into_owned(),
        source,
    })
}

/// `export KEY='VALUE'` lines for a POSIX shell.
pub fn render_shell(environment: &[(String, String)]) -> String {
    environment
        .iter()
        .map(|(key, value)| format!("export {key}='{}'\n", value.replace('\'', r"'\''")))
        .collect()
}

/// A JSON object of the variables.
pub fn render_json(environment: &[(String, String)]) -> String {
    let object: serde_json::Map<String, serde_json::Value> = environment
        .iter()
        .map(|(key, value)| (key.clone(), serde_json::Value::String(value.clone())))
        .collect();
    serde_json::to_string_pretty(&object).expect("strings serialize")
}

#[cfg(test)]
#[path = "tenant_test.rs"]
mod tests;
