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
//! | `VGPU_SHM_DIR` | the tenant's private directory `<shm dir>/tenants/<tenant>` ([`crate::private`]): its memory ledger and links to its GPUs' compute schedules |
//! | `VGPU_AGENT_STATE_DIR` | the agent's state directory (the tenant files) |
//! | `VGPU_NCCL_WEIGHT` | the tenant's bandwidth weight: as placed (`vgpuctl place --bandwidth`), else its compute percents summed (at least 1) |
//! | `VGPU_NCCL_ACTIVITY_FILE` | `nccl-activity` in the tenant's directory: where the tenants' NCCL tuners see each other |
//! | `VGPU_NETSHARE_TABLE`, `VGPU_NETSHARE_FLOW` | `netshare` in the tenant's directory and the tenant's flow in it: the token bucket its NCCL network sends wait on ([`crate::bandwidth`]) |
//! | `NCCL_NET_PLUGIN`, `NCCL_TUNER_PLUGIN` | `libvgpu_nccl.so` beside the interposer, when it is there |
//! | `NCCL_ENV_PLUGIN` | the same library, for a tenant with a fraction of a GPU: the rank of it that shares a GPU with another of its ranks gets a host identity of its own (`<NCCL_HOSTID>-slot<k>`), so two of its ranks on one GPU join one communicator |
//! | `VGPU_SPATIAL`, `VGPU_LATENCY` | the interposer's spatial mode for tenants with a fraction of a GPU and for latency tenants, and which is the latency tenant ([`concurrent_sharing_mode`]) |
//! | `VGPU_LATENCY_TARGET_US` | a latency tenant's explicit step target (`vgpuctl place --latency-target`) |
//! | `NCCL_HOSTID`, `NCCL_NET` | for a tenant with a fraction of a GPU: `vgpu-<node>-<tenant>` and `vgpu`, so NCCL treats the slice as its own device (no "Duplicate GPU detected" when two tenants' ranks share a GPU) and connects it through the plugin |
//!
//! | `CUDA_MPS_PIPE_DIRECTORY` | on a node that runs MPS: the daemon's pipes |
//!
//! The `VGPU_*` part is one [`TenantEnv`] (the tenant contract, `tenant_abi::env`), written by
//! its `to_env` and read back by the interposer and the NCCL plugin through the same crate.
//!
//! Ordinals follow `CUDA_VISIBLE_DEVICES`: the process's device 0 is the tenant's first slice.

use std::convert::Infallible;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use tenant_abi::{DEVICES_MAX, NetshareEnv, TenantEnv};

use crate::assignments::{SliceAssignment, TenantAssignment};
use crate::error::{Error, Result};
use crate::state::{read_assignments_file, read_tenant_file};

/// The interposer's file name, looked for next to the `vgpu-agent` binary.
pub const INTERPOSER_FILE: &str = "libvgpu_cuda.so";
/// Where the interposer is installed when it is not next to the binary.
pub const INTERPOSER_SYSTEM_PATH: &str = "/usr/lib/vgpu/libvgpu_cuda.so";
/// The NCCL plugin's file name, looked for beside the interposer.
pub const NCCL_PLUGIN_FILE: &str = "libvgpu_nccl.so";
/// The interposers' shared-memory directory by default.
pub const SHM_DIR_DEFAULT: &str = tenant_abi::env::SHM_DIR_DEFAULT;

/// What the environment is built from besides the tenant's assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    /// The interposer to preload; `None` runs without it (nothing enforced).
    pub interposer: Option<PathBuf>,
    /// The shared-memory directory (the root of [`crate::private::Layout`]).
    pub shm_dir: PathBuf,
    pub state_dir: PathBuf,
    /// The node's MPS pipe directory when it runs MPS (concurrent sharing, [`crate::mps`]).
    pub mps_pipe_dir: Option<PathBuf>,
    /// Which tenants join it (the others keep a context of their own).
    pub mps_tenants: crate::mps::MpsTenants,
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
    let plugin = nccl_plugin_beside(config.interposer.as_deref());
    tenant_environment_with_plugin(
        node,
        assignment,
        config,
        inherited_ld_preload,
        plugin.as_deref(),
    )
}

/// [`tenant_environment`] with the NCCL plugin named by the caller rather than looked for beside
/// the interposer: a CDI spec names the plugin's path inside the container, which need not
/// exist where the spec is written.
pub fn tenant_environment_with_plugin(
    node: &str,
    assignment: &TenantAssignment,
    config: &EnvConfig,
    inherited_ld_preload: Option<&str>,
    nccl_plugin: Option<&Path>,
) -> Vec<(String, String)> {
    assert!(
        !assignment.slices.is_empty(),
        "a placed tenant has slices on this node"
    );
    assert!(assignment.slices.is_sorted(), "slices are in GPU order");
    let slices = &assignment.slices;
    let layout = crate::private::Layout::new(&config.shm_dir);
    assert!(
        slices.len() <= DEVICES_MAX,
        "a node has at most {DEVICES_MAX} GPUs a process can number"
    );
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
    // On every node, MPS or not: a latency tenant must never be worse off than plain
    // co-location, so its launches skip the turns and its neighbours obey the closed loop.
    let (spatial, latency) = concurrent_sharing_mode(assignment);
    let tenant_env = TenantEnv {
        tenant: assignment.tenant.clone(),
        node: node.to_owned(),
        shm_dir: layout.tenant_dir(&assignment.tenant),
        agent_state_dir: config.state_dir.clone(),
        memory_limits_bytes: per_ordinal(slices, |slice| slice.memory_bytes),
        compute_pct: per_ordinal(slices, |slice| slice.compute_percent),
        priority: assignment.priority,
        burst: slices.iter().all(|slice| slice.burst),
        guaranteed: slices.iter().all(|slice| slice.guaranteed),
        nccl_weight: u64::from(crate::bandwidth::weight(assignment)),
        nccl_activity_file: layout.nccl_activity(&assignment.tenant),
        netshare: NetshareEnv {
            table: layout.netshare(&assignment.tenant),
            flow: crate::bandwidth::flow_id(&assignment.tenant).0,
        },
        spatial,
        latency,
        latency_target_us: assignment.latency_target_us.filter(|_| latency),
    };
    environment.extend(tenant_env.to_env());
    let identity = slice_identity_environment(node, assignment);
    if let Some(plugin) = nccl_plugin {
        let plugin = plugin.to_string_lossy().into_owned();
        environment.push(("NCCL_NET_PLUGIN".to_owned(), plugin.clone()));
        environment.push(("NCCL_TUNER_PLUGIN".to_owned(), plugin.clone()));
        // two ranks of a fractional tenant on one GPU tell themselves apart through the
        // plugin's env table (a slot per rank on each GPU: nccl-plugin's `identity`)
        if !identity.is_empty() {
            environment.push(("NCCL_ENV_PLUGIN".to_owned(), plugin));
        }
    }
    environment.extend(identity);
    if let Some(pipes) = &config.mps_pipe_dir
        && config.mps_tenants.joins(latency)
    {
        environment.push((
            "CUDA_MPS_PIPE_DIRECTORY".to_owned(),
            pipes.to_string_lossy().into_owned(),
        ));
    }
    assert!(
        environment
            .iter()
            .all(|(key, value)| !key.is_empty() && !key.contains('=') && !value.contains('\0')),
        "environment entries are well formed"
    );
    environment
}

/// A value per device ordinal as the process sees it: the tenant's first slice is its device 0.
fn per_ordinal<T: Copy>(
    slices: &[SliceAssignment],
    value: impl Fn(&SliceAssignment) -> T,
) -> [Option<T>; DEVICES_MAX] {
    let mut values = [None; DEVICES_MAX];
    for (ordinal, slice) in slices.iter().enumerate() {
        values[ordinal] = Some(value(slice));
    }
    values
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

/// Whether the tenant runs in the interposer's spatial mode, and whether it is the latency tenant
/// there. Spatial mode is on for tenants that share a GPU (a fraction of one) and for
/// latency-sensitive tenants, on every node: a latency tenant's launches skip the turns and its
/// steps are measured; the others obey the agent's closed-loop decision (pause and queue bounds
/// everywhere, fewer SMs only under MPS). It costs a squeezable tenant nothing while no decision
/// is in force on its GPU, so it is on whether or not a latency tenant is placed there now: one
/// placed later is protected from the tenants already running.
pub fn concurrent_sharing_mode(assignment: &TenantAssignment) -> (bool, bool) {
    let fractional = assignment
        .slices
        .iter()
        .any(|slice| slice.compute_percent < 100);
    (fractional || assignment.latency, assignment.latency)
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
            latency: entry.latency,
            latency_target_us: entry.latency_target_us,
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
    /// The node's MPS pipe directory when it runs MPS ([`crate::mps`]).
    pub mps_pipe_dir: Option<PathBuf>,
    pub mps_tenants: crate::mps::MpsTenants,
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
    let identity = tenant_user(&config.shm_dir, &config.tenant)?;
    let env_config = EnvConfig {
        interposer: config.interposer.clone(),
        shm_dir: config.shm_dir.clone(),
        state_dir: config.state_dir.clone(),
        mps_pipe_dir: config.mps_pipe_dir.clone(),
        mps_tenants: config.mps_tenants,
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
    let mut command = std::process::Command::new(program);
    command.args(arguments).envs(environment);
    if let Some(identity) = identity {
        // Root switches to the tenant's user (std clears the supplementary groups first).
        command.uid(identity.uid).gid(identity.gid);
    }
    let source = command.exec();
    Err(Error::Exec {
        program: program.to_string_lossy().into_owned(),
        source,
    })
}

/// Who tenant `tenant`'s processes run as: the owner of its private directory. `Some` when the
/// caller is root and must switch to that user; `None` when the caller already is it. Refuses a
/// directory that is not there yet and a caller that is neither root nor the tenant's user.
pub fn tenant_user(shm_dir: &Path, tenant: &str) -> Result<Option<crate::users::Identity>> {
    use std::os::unix::fs::MetadataExt;
    let layout = crate::private::Layout::new(shm_dir);
    let directory = layout.tenant_dir(tenant);
    let missing = || Error::TenantDirMissing {
        tenant: tenant.to_owned(),
        path: directory.clone(),
    };
    let metadata = std::fs::metadata(&directory).map_err(|_| missing())?;
    let owner = crate::users::Identity {
        uid: metadata.uid(),
        gid: metadata.gid(),
    };
    let caller = crate::users::current();
    let name = |uid: u32| crate::users::name_of(uid).unwrap_or_else(|| format!("uid {uid}"));
    let switch = match (caller.uid, owner.uid) {
        (me, it) if me == it => None,
        (0, _) => Some(owner),
        (me, it) => {
            return Err(Error::NotTenantUser {
                tenant: tenant.to_owned(),
                owner: name(it),
                caller: name(me),
            });
        }
    };
    if !crate::private::is_prepared(&layout, tenant) {
        return Err(missing());
    }
    Ok(switch)
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
