//! Three in-process members on the real durable stores (redb `LogStore`, snapshotting
//! `StateMachineStore`), each in its own temporary data directory, joined by the simulated
//! network. A crash shuts a member's Raft down and drops it; a restart opens the same data
//! directory again, so what survives is exactly what the stores made durable.

use crate::network::{Member, NetworkFactory, Router};
use openraft::{BasicNode, ServerState};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use vgpu_cp::raft_types::{NodeId, Raft};
use vgpu_cp::store::{LogStore, StateMachineStore};

pub const MEMBER_IDS: [NodeId; 3] = [1, 2, 3];
/// Entries between snapshots: small, so that snapshots, log purges and snapshot installs on
/// lagging followers all happen within a few seconds of virtual time.
const SNAPSHOT_LOGS_SINCE_LAST: u64 = 40;
const LOGS_KEPT_AFTER_SNAPSHOT: u64 = 8;
/// How long a restart waits for the crashed incarnation to let go of its log database.
const REOPEN_ATTEMPTS_MAX: u32 = 200;
const REOPEN_PAUSE: Duration = Duration::from_millis(10);

pub struct Cluster {
    pub router: Arc<Router>,
    config: Arc<openraft::Config>,
    /// Keeps the data directories for the whole run, across crashes.
    _root: tempfile::TempDir,
    data_dirs: BTreeMap<NodeId, PathBuf>,
    incarnations: BTreeMap<NodeId, u64>,
    /// Fatal errors members had stopped with before they were crashed on purpose.
    pub fatal: Vec<String>,
}

impl Cluster {
    /// Starts all members and initialises the cluster once, on member 1, with all three voters.
    pub async fn start(router: Arc<Router>) -> Result<Cluster, String> {
        // tmpfs, where there is one: fsync costs nothing there, and an in-process crash keeps
        // the page cache anyway, so the durability a restart sees is the same.
        let shm = std::path::Path::new("/dev/shm");
        let mut builder = tempfile::Builder::new();
        builder.prefix("vgpu-sim-");
        let root = if shm.is_dir() {
            builder.tempdir_in(shm)
        } else {
            builder.tempdir()
        }
        .map_err(|e| format!("tempdir: {e}"))?;
        let config = openraft::Config {
            cluster_name: "vgpu-sim".to_owned(),
            heartbeat_interval: 50,
            election_timeout_min: 150,
            election_timeout_max: 300,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(SNAPSHOT_LOGS_SINCE_LAST),
            max_in_snapshot_log_to_keep: LOGS_KEPT_AFTER_SNAPSHOT,
            install_snapshot_timeout: 1000,
            ..Default::default()
        }
        .validate()
        .map_err(|e| format!("raft config: {e}"))?;
        let data_dirs = MEMBER_IDS
            .iter()
            .map(|&id| (id, root.path().join(format!("member-{id}"))))
            .collect();
        let mut cluster = Cluster {
            router,
            config: Arc::new(config),
            _root: root,
            data_dirs,
            incarnations: BTreeMap::new(),
            fatal: Vec::new(),
        };
        for id in MEMBER_IDS {
            cluster.restart(id).await?;
        }
        let members: BTreeMap<NodeId, BasicNode> = MEMBER_IDS
            .iter()
            .map(|&id| (id, BasicNode::new(format!("sim-{id}"))))
            .collect();
        let first = cluster
            .router
            .member(MEMBER_IDS[0])
            .expect("member 1 was just started");
        first
            .raft
            .initialize(members)
            .await
            .map_err(|e| format!("initialize: {e}"))?;
        Ok(cluster)
    }

    pub fn is_up(&self, id: NodeId) -> bool {
        self.router.member(id).is_some()
    }

    /// Starts member `id` from its data directory (fresh on the first start).
    pub async fn restart(&mut self, id: NodeId) -> Result<(), String> {
        assert!(!self.is_up(id), "member {id} is already up");
        let data_dir = self.data_dirs[&id].clone();
        std::fs::create_dir_all(&data_dir).map_err(|e| format!("member {id}: data dir: {e}"))?;
        let log_path = data_dir.join("raft.redb");
        let mut attempts = 0;
        let log = loop {
            // The crashed incarnation's last tasks may still hold the database for a moment.
            match LogStore::open_with(&log_path, vgpu_cp::store::WriteMode::Inline) {
                Ok(log) => break log,
                Err(error) => {
                    attempts += 1;
                    if attempts >= REOPEN_ATTEMPTS_MAX {
                        return Err(format!("member {id}: cannot reopen its log: {error}"));
                    }
                    tokio::time::sleep(REOPEN_PAUSE).await;
                }
            }
        };
        let (state_machine, shared) = StateMachineStore::open(&data_dir)
            .map_err(|e| format!("member {id}: state machine: {e}"))?;
        let incarnation = self.incarnations.entry(id).or_insert(0);
        *incarnation += 1;
        let incarnation = *incarnation;
        let network = NetworkFactory {
            router: self.router.clone(),
            source: id,
            incarnation,
        };
        let raft = Raft::new(id, self.config.clone(), network, log, state_machine)
            .await
            .map_err(|e| format!("member {id}: Raft::new: {e}"))?;
        self.router.add_member(
            id,
            Member {
                raft,
                shared,
                incarnation,
            },
        );
        Ok(())
    }

    /// Stops member `id` abruptly: no hand-over, pending client requests get no answer.
    pub async fn crash(&mut self, id: NodeId) {
        let Some(member) = self.router.remove_member(id) else {
            return;
        };
        if let Err(fatal) = &member.raft.metrics().borrow().running_state {
            self.fatal.push(format!(
                "member {id} had stopped with a fatal error: {fatal}"
            ));
        }
        // Shutting down only stops the tasks; everything the stores made durable stays.
        member.raft.shutdown().await.ok();
    }

    /// The member that believes it leads with the highest term, if any is up.
    pub fn leader(&self) -> Option<NodeId> {
        leader(&self.router)
    }

    /// Starts every member that is down.
    pub async fn restart_all(&mut self) -> Result<(), String> {
        for id in MEMBER_IDS {
            if !self.is_up(id) {
                self.restart(id).await?;
            }
        }
        Ok(())
    }

    pub async fn shutdown(&mut self) {
        for id in MEMBER_IDS {
            self.crash(id).await;
        }
    }
}

pub fn leader(router: &Router) -> Option<NodeId> {
    router
        .members()
        .into_iter()
        .filter_map(|(id, member)| {
            let metrics = member.raft.metrics().borrow().clone();
            (metrics.state == ServerState::Leader).then_some((metrics.current_term, id))
        })
        .max()
        .map(|(_, id)| id)
}
