//! vgpu-cp's entries on a real etcd (issue 20, phase 1; `etcd_store::testing` starts 3 etcd
//! members): members that apply the etcd log through `apply_etcd_entry` reach the same
//! `PoolState`; a leader decision takes effect once, from the leadership that fenced it, and a
//! deposed leader's decision writes nothing; a member that starts later catches up from a
//! snapshot in the Raft store's encoding. The wiring into `ControlPlane` is phase 2.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_store::testing::EtcdCluster;
use etcd_store::{Applied, Applier, Connection, Election, ElectionConfig, EtcdLog, Fence};
use prost::Message as _;

use crate::etcd_entry::{EtcdEntry, apply_etcd_entry};
use crate::pool::{Command, PoolState};
use crate::raft_types::NodeId;
use crate::store::{decode_pool_snapshot, encode_pool_snapshot};

const WAIT: Duration = Duration::from_secs(10);
const LEASE_TTL: Duration = Duration::from_secs(2);

/// The applied state with the sequence number it is at, under one lock so a snapshot of it is
/// consistent.
type State = Arc<Mutex<(u64, PoolState)>>;

struct Member {
    id: NodeId,
    log: EtcdLog,
    state: State,
    applier: Applier,
    batch: u64,
}

impl Member {
    async fn start(etcd: &EtcdCluster, id: NodeId) -> Member {
        let mut log = EtcdLog::connect(&etcd.config("/pool/"))
            .await
            .expect("connect");
        log.claim_cluster("cluster-1").await.expect("claim");
        let state: State = Arc::default();
        let applying = Arc::clone(&state);
        let applier = Applier::spawn(log.clone(), 1, move |applied| {
            let mut state = applying.lock().expect("state lock");
            match applied {
                Applied::Entries(entries) => {
                    for entry in entries {
                        apply_etcd_entry(&mut state.1, entry.seq, entry.revision, &entry.bytes)
                            .map_err(|error| error.to_string())?;
                        state.0 = entry.seq;
                    }
                }
                Applied::Snapshot(snapshot) => {
                    let (seq, pool) =
                        decode_pool_snapshot(&snapshot.bytes).map_err(|error| error.to_string())?;
                    assert_eq!(
                        seq, snapshot.seq,
                        "the snapshot covers what its pointer says"
                    );
                    *state = (seq, pool);
                }
            }
            Ok(())
        });
        Member {
            id,
            log,
            state,
            applier,
            batch: 0,
        }
    }

    /// Appends one entry of `commands`: fenced exactly when it carries a fence, the rule that
    /// makes the entry's fence trustworthy to `apply_etcd_entry`.
    async fn write(
        &mut self,
        commands: Vec<Command>,
        fence: Option<Fence>,
    ) -> etcd_store::Result<u64> {
        self.batch += 1;
        let entry = EtcdEntry::new(
            self.id,
            self.batch,
            fence.map(|fence| fence.leader_revision),
            Command::Batch(commands),
        );
        let seqs = match fence {
            Some(fence) => self.log.append_fenced(&[entry.encode()], fence).await?,
            None => self.log.append(&[entry.encode()]).await?,
        };
        Ok(*seqs.end())
    }

    /// A linearizable view: every acknowledged write applied, then the state's encoding.
    async fn snapshot(&self) -> (u64, Vec<u8>) {
        self.applier.linearize(WAIT).await.expect("linearize");
        let state = self.state.lock().expect("state lock");
        (state.0, encode_pool_snapshot(state.0.max(1), &state.1))
    }

    fn nodes_of(&self, tenant: &str) -> Vec<String> {
        let state = self.state.lock().expect("state lock");
        state.1.tenants[tenant]
            .slices
            .iter()
            .map(|slice| slice.node.clone())
            .collect()
    }
}

pub(crate) fn register(name: &str) -> Command {
    let gpu = |index: u32| placement::GpuSpec {
        uuid: format!("GPU-{name}-{index}"),
        index,
        model: "H100-80GB".to_owned(),
        memory_bytes: 80 << 30,
        sm_count: 132,
        nvlink_peers: (0..4)
            .filter(|&peer| peer != index)
            .map(|peer| (peer, 18))
            .collect(),
        numa_node: 0,
        pci_bus_id: format!("0000:{index:02x}:00.0"),
        nearest_nics: Vec::new(),
    };
    Command::RegisterNode {
        spec: placement::NodeSpec {
            name: name.to_owned(),
            labels: BTreeMap::new(),
            gpus: (0..4).map(gpu).collect(),
        },
        address: String::new(),
        unix_ms: 1,
    }
}

fn lost(node: &str, leader: NodeId, fence: Fence) -> Command {
    Command::LeaderDecision {
        term: fence.leader_revision as u64,
        leader,
        command: Box::new(Command::SetNodeState {
            node: node.to_owned(),
            state: placement::NodeState::Lost,
            reason: "no heartbeat for more than 5.0s".to_owned(),
            unix_ms: 3,
        }),
    }
}

async fn candidate(etcd: &EtcdCluster, member: NodeId) -> Election {
    let connection = Connection::connect(&etcd.config("/pool/"))
        .await
        .expect("connect");
    Election::new(
        connection,
        ElectionConfig::new(&member.to_string(), LEASE_TTL),
    )
}

#[tokio::test]
async fn members_on_etcd_apply_the_same_entries_to_the_same_pool_state() {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) =
        EtcdCluster::start("members_on_etcd_apply_the_same_entries", 3, required).await
    else {
        return;
    };
    let mut one = Member::start(&etcd, 1).await;
    let mut two = Member::start(&etcd, 2).await;
    one.write(vec![register("node-a")], None)
        .await
        .expect("write");
    two.write(vec![register("node-b")], None)
        .await
        .expect("write");
    let request = api::v1::PlacementRequest {
        whole_gpus: 4,
        ..Default::default()
    };
    let place = Command::Place {
        name: "train".to_owned(),
        request: request.encode_to_vec(),
        unix_ms: 2,
    };
    two.write(vec![place], None).await.expect("write");
    assert_eq!(one.snapshot().await, two.snapshot().await);
    let first_node = one.nodes_of("train")[0].clone();

    // Member 1 leads and decides, by its clock, that the train's node is lost: the tenant moves.
    let mut elected_one = candidate(&etcd, 1).await;
    let mut elected_two = candidate(&etcd, 2).await;
    let leadership = elected_one
        .campaign(WAIT)
        .await
        .expect("campaign")
        .expect("1 leads");
    assert!(
        elected_two
            .campaign(Duration::from_millis(100))
            .await
            .expect("campaign")
            .is_none()
    );
    one.write(
        vec![lost(&first_node, 1, leadership.fence)],
        Some(leadership.fence),
    )
    .await
    .expect("the leader's decision");
    assert_eq!(one.snapshot().await, two.snapshot().await);
    let second_node = two.nodes_of("train")[0].clone();
    assert_ne!(first_node, second_node, "re-placed on the other node");

    // Member 1's lease ends (as when it is cut off); member 2 leads. Member 1 still decides on
    // its stale view that the new node is lost too: etcd refuses the fenced write.
    let mut raw = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("client");
    raw.lease_revoke(leadership.lease_id).await.expect("revoke");
    let successor = elected_two
        .campaign(WAIT)
        .await
        .expect("campaign")
        .expect("2 leads");
    assert!(successor.fence.leader_revision > leadership.fence.leader_revision);
    let stale = one
        .write(
            vec![lost(&second_node, 1, leadership.fence)],
            Some(leadership.fence),
        )
        .await
        .expect_err("a deposed leader's decision");
    assert!(
        matches!(stale, etcd_store::Error::Deposed { .. }),
        "{stale}"
    );
    let (seq_one, state_one) = one.snapshot().await;
    assert_eq!((seq_one, state_one.clone()), two.snapshot().await);
    assert_eq!(one.nodes_of("train"), two.nodes_of("train"));
    assert!(
        one.nodes_of("train")
            .iter()
            .all(|node| *node == second_node),
        "moved once"
    );

    // The leader snapshots; the log under it goes; a member starting now loads the snapshot and
    // then applies what follows, and all three agree.
    assert!(
        two.log
            .put_snapshot(seq_one, &{
                let state = two.state.lock().expect("state lock");
                assert_eq!(state.0, seq_one);
                encode_pool_snapshot(state.0, &state.1)
            })
            .await
            .expect("snapshot")
    );
    let three = Member::start(&etcd, 3).await;
    one.write(vec![register("node-c")], None)
        .await
        .expect("write");
    let view = one.snapshot().await;
    assert_eq!(two.snapshot().await, view);
    assert_eq!(three.snapshot().await, view);
    assert_eq!(view.0, seq_one + 1);
}
