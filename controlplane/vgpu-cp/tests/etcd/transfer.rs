//! Moving a pool between the stores (`vgpu-cp export` and `vgpu-cp import`, `transfer`): a pool
//! on the Raft store is exported, imported into etcd and started there; then exported from etcd
//! and imported into the Raft store again. After each move the nodes, the tenants (with their
//! owners, slices, revisions and history) and the cluster id are those of the pool that was
//! exported, and the imported pool places new tenants; a member that joins the imported Raft pool
//! gets its state. Refused on the way: exporting a running
//! pool (either store), importing into a data directory or a prefix that holds something.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use api::v1;
use etcd_store::testing::{EtcdCluster, free_ports};

use crate::{Member, channel, node, status, wait_for};

/// Nodes stay ready without heartbeats (no stand-in agents here).
const NODE_LOST_TIMEOUT_MS: &str = "86400000";

/// Where a member keeps the pool's state.
enum Store<'a> {
    Raft,
    Etcd {
        etcd: &'a EtcdCluster,
        prefix: &'a str,
    },
}

impl Store<'_> {
    fn args(&self) -> Vec<String> {
        match self {
            Store::Raft => Vec::new(),
            Store::Etcd { etcd, prefix } => vec![
                "--etcd-endpoints".to_owned(),
                etcd.endpoints().join(","),
                "--etcd-prefix".to_owned(),
                (*prefix).to_owned(),
                "--etcd-lease-ttl-s".to_owned(),
                "2".to_owned(),
            ],
        }
    }
}

/// The settings of member `id` on `port` with its data directory `dir/name`: what `bootstrap`
/// and `import` both take.
fn member_args(id: u64, port: u16, store: &Store, dir: &Path, name: &str) -> Vec<String> {
    let mut args = vec![
        "--id".to_owned(),
        id.to_string(),
        "--listen".to_owned(),
        format!("127.0.0.1:{port}"),
        "--insecure".to_owned(),
        "--data-dir".to_owned(),
        dir.join(name).display().to_string(),
        "--node-lost-timeout-ms".to_owned(),
        NODE_LOST_TIMEOUT_MS.to_owned(),
    ];
    args.extend(store.args());
    args
}

fn bootstrap(id: u64, port: u16, store: &Store, dir: &Path, name: &str) -> Member {
    let log = dir.join(format!("{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_vgpu-cp"))
        .arg("bootstrap")
        .args(member_args(id, port, store, dir, name))
        .env("RUST_LOG", "info,openraft=warn,h2=warn,tower=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("member log"))
        .spawn()
        .expect("start vgpu-cp");
    Member {
        id,
        address: format!("127.0.0.1:{port}"),
        child: Some(child),
        log,
    }
}

/// `vgpu-cp ARGS`, to its end.
fn vgpu_cp(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vgpu-cp"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run vgpu-cp")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|arg| (*arg).to_owned()).collect()
}

/// Waits until `member` leads its pool and answers.
async fn wait_leading(member: &Member) {
    let members = std::slice::from_ref(member);
    wait_for("the imported member leads", members, || async {
        status(member)
            .await
            .filter(|status| status.leader == member.id)
    })
    .await;
}

/// A clean stop (SIGTERM): the member resigns and leaves; waits until it exited.
async fn stop(member: &mut Member) {
    member.signal("-TERM");
    let mut child = member.child.take().expect("running");
    let exited = wait_for("the member exits", &[], || {
        let exited = child.try_wait().expect("wait");
        async move { exited }
    })
    .await;
    assert!(exited.success(), "{exited:?}\n{}", member.log_tail());
}

/// The pool as the API shows it, for comparison: nodes without the leader's soft state (the
/// last heartbeat it saw), tenants as listed, and the cluster id.
async fn pool_view(member: &Member) -> (Vec<v1::Node>, Vec<v1::Tenant>, String) {
    let mut client = v1::pool_client::PoolClient::new(channel(member).await.expect("channel"));
    let mut nodes = client
        .list_nodes(v1::ListRequest { stale: false })
        .await
        .expect("list nodes")
        .into_inner()
        .nodes;
    for node in &mut nodes {
        node.last_heartbeat_unix_ms = 0;
    }
    let tenants = client
        .list_tenants(v1::ListRequest { stale: false })
        .await
        .expect("list tenants")
        .into_inner()
        .tenants;
    let cluster_id = status(member).await.expect("status").cluster_id;
    (nodes, tenants, cluster_id)
}

/// Places `name` through `member` for `owner`: whether it was acknowledged.
async fn place_for(member: &Member, name: &str, owner: &str) -> v1::Tenant {
    let mut client = v1::pool_client::PoolClient::new(channel(member).await.expect("channel"));
    let request = v1::PlaceRequest {
        name: name.to_owned(),
        request: Some(v1::PlacementRequest {
            whole_gpus: 1,
            owner: owner.to_owned(),
            ..Default::default()
        }),
    };
    client
        .place(request)
        .await
        .unwrap_or_else(|status| panic!("placing {name}: {status}\n{}", member.log_tail()))
        .into_inner()
        .tenant
        .expect("a tenant")
}

/// Exports the pool (retrying, bounded, while the stopped members' registrations expire), and
/// checks the summary it printed.
async fn export(source: &[String], out: &Path, members: &[Member]) {
    let mut args = strings(&["export", "--out"]);
    args.push(out.display().to_string());
    args.extend(source.iter().cloned());
    wait_for("the export succeeds", members, || {
        let output = vgpu_cp(&args);
        let done = if output.status.success() {
            Some(())
        } else {
            let message = stderr(&output);
            assert!(message.contains("is running"), "{message}");
            None
        };
        async move { done }
    })
    .await;
    let bytes = std::fs::read(out).expect("the export");
    assert!(bytes.starts_with(b"vgpu-pool-export\nformat_version=1\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_moves_from_raft_to_etcd_and_back_with_its_nodes_tenants_and_owners() {
    let required = std::env::var_os("VGPU_ETCD_REQUIRED").is_some();
    let Some(etcd) = EtcdCluster::start("vgpu_cp_transfer", 3, required).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let ports = free_ports(4);

    // A pool on the Raft store: two nodes of 4 GPUs, 8 tenants of two owners fill them, and a
    // ninth waits (pending).
    let mut raft = bootstrap(1, ports[0], &Store::Raft, dir, "raft-1");
    wait_leading(&raft).await;
    let mut agent = v1::agent_client::AgentClient::new(channel(&raft).await.expect("channel"));
    for name in ["node-a", "node-b"] {
        agent
            .register(v1::RegisterRequest {
                node: Some(node(name)),
            })
            .await
            .expect("register");
    }
    for index in 0..8 {
        let owner = if index % 2 == 0 { "team-a" } else { "team-b" };
        let tenant = place_for(&raft, &format!("train-{index}"), owner).await;
        assert_eq!(tenant.owner, owner);
    }
    let waiting = place_for(&raft, "waiting", "team-b").await;
    assert_eq!(waiting.state, v1::TenantState::Pending as i32);
    let before = pool_view(&raft).await;
    assert_eq!((before.0.len(), before.1.len()), (2, 9));

    // A running pool is not exported.
    let refused = vgpu_cp(&[
        "export".to_owned(),
        "--data-dir".to_owned(),
        dir.join("raft-1").display().to_string(),
        "--out".to_owned(),
        dir.join("refused.export").display().to_string(),
    ]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("stop every member"),
        "{}",
        stderr(&refused)
    );
    stop(&mut raft).await;

    // Raft -> etcd.
    let first = dir.join("from-raft.export");
    export(
        &strings(&["--data-dir", &dir.join("raft-1").display().to_string()]),
        &first,
        &[],
    )
    .await;
    let on_etcd = Store::Etcd {
        etcd: &etcd,
        prefix: "/moved/",
    };
    let mut import = vec![
        "import".to_owned(),
        "--in".to_owned(),
        first.display().to_string(),
    ];
    import.extend(member_args(1, ports[1], &on_etcd, dir, "etcd-1"));
    let imported = vgpu_cp(&import);
    assert!(imported.status.success(), "{}", stderr(&imported));
    let printed = String::from_utf8_lossy(&imported.stdout);
    assert!(
        printed.contains("2 nodes, 9 tenants") && printed.contains("from the raft store"),
        "{printed}"
    );
    let mut on_etcd_member = bootstrap(1, ports[1], &on_etcd, dir, "etcd-1");
    wait_leading(&on_etcd_member).await;
    let after = pool_view(&on_etcd_member).await;
    assert_eq!(after.2, before.2, "the cluster id is kept");
    assert_eq!(after.0, before.0, "the nodes moved as they were");
    assert_eq!(after.1, before.1, "the tenants moved as they were");
    // It serves placements: releasing a tenant makes room for the one that waited, and a new
    // one waits in turn.
    let mut client =
        v1::pool_client::PoolClient::new(channel(&on_etcd_member).await.expect("channel"));
    client
        .release(v1::ReleaseRequest {
            name: "train-0".to_owned(),
        })
        .await
        .expect("release");
    wait_for("the waiting tenant is placed", &[], || async {
        let tenants = pool_view(&on_etcd_member).await.1;
        tenants
            .iter()
            .any(|tenant| {
                tenant.name == "waiting" && tenant.state == v1::TenantState::Placed as i32
            })
            .then_some(())
    })
    .await;
    let late = place_for(&on_etcd_member, "placed-on-etcd", "team-a").await;
    assert_eq!(late.owner, "team-a");

    // Importing into a prefix that holds a pool, or into a used data directory, is refused.
    let mut again = vec![
        "import".to_owned(),
        "--in".to_owned(),
        first.display().to_string(),
    ];
    again.extend(member_args(1, ports[2], &on_etcd, dir, "etcd-2"));
    let refused = vgpu_cp(&again);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("/moved/") && stderr(&refused).contains("--etcd-prefix"),
        "{}",
        stderr(&refused)
    );
    let mut used = vec![
        "import".to_owned(),
        "--in".to_owned(),
        first.display().to_string(),
    ];
    used.extend(member_args(1, ports[2], &Store::Raft, dir, "raft-1"));
    let refused = vgpu_cp(&used);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("not empty"),
        "{}",
        stderr(&refused)
    );
    // A running pool on etcd is not exported either.
    let etcd_source = strings(&[
        "--etcd-endpoints",
        &etcd.endpoints().join(","),
        "--etcd-prefix",
        "/moved/",
    ]);
    let mut running = strings(&["export", "--out"]);
    running.push(dir.join("refused.export").display().to_string());
    running.extend(etcd_source.iter().cloned());
    let refused = vgpu_cp(&running);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("members 1 (127.0.0.1:"),
        "{}",
        stderr(&refused)
    );
    let before = pool_view(&on_etcd_member).await;
    stop(&mut on_etcd_member).await;

    // etcd -> Raft.
    let second = dir.join("from-etcd.export");
    export(&etcd_source, &second, &[]).await;
    let mut import = vec![
        "import".to_owned(),
        "--in".to_owned(),
        second.display().to_string(),
    ];
    import.extend(member_args(1, ports[2], &Store::Raft, dir, "raft-2"));
    let imported = vgpu_cp(&import);
    assert!(imported.status.success(), "{}", stderr(&imported));
    let printed = String::from_utf8_lossy(&imported.stdout);
    assert!(
        printed.contains("2 nodes") && printed.contains("from the etcd store"),
        "{printed}"
    );
    let back = bootstrap(1, ports[2], &Store::Raft, dir, "raft-2");
    wait_leading(&back).await;
    let after = pool_view(&back).await;
    assert_eq!(after.2, before.2, "the cluster id is kept");
    assert_eq!(after.0, before.0, "the nodes moved back as they were");
    assert_eq!(after.1, before.1, "the tenants moved back as they were");
    let last = place_for(&back, "placed-on-raft-again", "team-b").await;
    assert_eq!(last.owner, "team-b");

    // Another member joins the imported Raft pool as usual and gets its state (the imported
    // snapshot, then what followed), read locally (`stale`) from its own copy.
    let mut join_args = vec!["join".to_owned(), "--peer".to_owned(), back.address.clone()];
    join_args.extend(member_args(2, ports[3], &Store::Raft, dir, "raft-2-joined"));
    let joined_log = dir.join("raft-2-joined.log");
    let joined = Member {
        id: 2,
        address: format!("127.0.0.1:{}", ports[3]),
        child: Some(
            Command::new(env!("CARGO_BIN_EXE_vgpu-cp"))
                .args(&join_args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&joined_log).expect("member log"))
                .spawn()
                .expect("start vgpu-cp"),
        ),
        log: joined_log,
    };
    let wanted = pool_view(&back).await.1;
    let members = [back, joined];
    wait_for(
        "the joined member holds the imported state",
        &members,
        || async {
            let mut client = v1::pool_client::PoolClient::new(channel(&members[1]).await?);
            let tenants = client
                .list_tenants(v1::ListRequest { stale: true })
                .await
                .ok()?
                .into_inner()
                .tenants;
            (tenants == wanted).then_some(())
        },
    )
    .await;
}
