//! Tests of whole-node placement in the replicated state (issue 19): registrations that report
//! CPU and host memory, requests that ask for them or for GPU models, what reads show, and that
//! a replica rebuilt from an encoded pool and its host state decides like one that never stopped.

use super::*;

const GIB: u64 = 1 << 30;

fn node(name: &str, model: &str) -> NodeSpec {
    NodeSpec {
        name: name.to_owned(),
        labels: BTreeMap::new(),
        gpus: (0..4)
            .map(|index| placement::GpuSpec {
                uuid: format!("GPU-{name}-{index}"),
                index,
                model: model.to_owned(),
                memory_bytes: 80 * GIB,
                sm_count: 132,
                nvlink_peers: (0..4).filter(|&p| p != index).map(|p| (p, 18)).collect(),
                numa_node: 0,
                pci_bus_id: format!("0000:{index:02x}:00.0"),
                nearest_nics: Vec::new(),
            })
            .collect(),
    }
}

fn host(cpus: u64, memory_gib: u64) -> HostCapacity {
    HostCapacity {
        cpu_milli: Some(cpus * 1000),
        memory_bytes: Some(memory_gib * GIB),
    }
}

fn register_host(state: &mut PoolState, index: u64, spec: NodeSpec, host: HostCapacity) {
    let result = state.apply(
        index,
        Command::RegisterHostNode {
            spec,
            host,
            address: String::new(),
            key_sha256: None,
            unix_ms: 0,
        },
    );
    assert_eq!(result, CommandResult::Done);
}

fn constrained(
    whole_gpus: u32,
    cpus: u64,
    memory_gib: u64,
    models: &[&str],
) -> v1::PlacementRequest {
    v1::PlacementRequest {
        whole_gpus,
        cpu_milli: cpus * 1000,
        host_memory_bytes: memory_gib * GIB,
        gpu_models: models.iter().map(|m| (*m).to_owned()).collect(),
        ..Default::default()
    }
}

fn place(
    state: &mut PoolState,
    index: u64,
    name: &str,
    request: &v1::PlacementRequest,
) -> CommandResult {
    state.apply(
        index,
        Command::PlaceConstrained {
            name: name.to_owned(),
            request: request.encode_to_vec(),
            unix_ms: index as i64,
        },
    )
}

fn tenant(result: CommandResult) -> TenantRecord {
    match result {
        CommandResult::Tenant(record) => *record,
        other => panic!("expected a tenant, got {other:?}"),
    }
}

/// A pool of two H100 nodes (16 CPUs, 256 GiB) and one A100 node (64 CPUs, 1 TiB).
fn pool() -> PoolState {
    let mut state = PoolState::default();
    register_host(&mut state, 1, node("h1", "H100-80GB"), host(16, 256));
    register_host(&mut state, 2, node("h2", "H100-80GB"), host(16, 256));
    register_host(&mut state, 3, node("a1", "A100-80GB"), host(64, 1024));
    state
}

#[test]
fn cpu_host_memory_and_models_decide_where_a_tenant_goes_and_reads_show_them() {
    let mut state = pool();
    let cpu_heavy = tenant(place(
        &mut state,
        4,
        "cpu-heavy",
        &constrained(1, 32, 0, &[]),
    ));
    assert_eq!(cpu_heavy.state, TenantState::Placed);
    assert_eq!(cpu_heavy.slices[0].node, "a1", "only a1 has 32 CPUs");
    let h100 = tenant(place(
        &mut state,
        5,
        "h100",
        &constrained(2, 8, 64, &["H100-80GB"]),
    ));
    assert!(
        h100.slices.iter().all(|s| s.node.starts_with('h')),
        "{:?}",
        h100.slices
    );
    let node = h100.slices[0].node.clone();
    let shown = state.node_to_proto(&node).expect("a registered node");
    assert_eq!(shown.cpu_milli, 16_000);
    assert_eq!(shown.host_memory_bytes, 256 * GIB);
    assert_eq!(shown.cpu_milli_allocated, 8_000);
    assert_eq!(shown.host_memory_allocated_bytes, 64 * GIB);
    // The request reads back with its constraints.
    let request = state.tenant_to_proto(&h100).request.expect("a request");
    assert_eq!(request.cpu_milli, 8_000);
    assert_eq!(request.gpu_models, vec!["H100-80GB".to_owned()]);
}

#[test]
fn a_tenant_waits_with_a_reason_that_names_the_constraint() {
    let mut state = pool();
    tenant(place(&mut state, 4, "big-a", &constrained(1, 60, 0, &[])));
    // a1 has 4 CPUs left; the H100 nodes have CPUs but the wrong model.
    let waiting = tenant(place(
        &mut state,
        5,
        "a100",
        &constrained(1, 8, 0, &["A100-80GB"]),
    ));
    assert_eq!(waiting.state, TenantState::Pending);
    assert!(waiting.reason.contains("8 CPUs"), "{}", waiting.reason);
    // No node has the model at all: refused at once, with the model named.
    let CommandResult::Failed { code, message } =
        place(&mut state, 6, "b200", &constrained(1, 0, 0, &["B200"]))
    else {
        panic!("expected a refusal");
    };
    assert_eq!(code, ErrorCode::Unplaceable);
    assert!(message.contains("B200"), "{message}");
    // Releasing the CPU-heavy tenant lets the waiting one in.
    assert_eq!(
        state.apply(
            7,
            Command::Release {
                name: "big-a".into(),
                unix_ms: 7
            }
        ),
        CommandResult::Done
    );
    assert_eq!(state.tenants["a100"].state, TenantState::Placed);
}

#[test]
fn a_plain_place_of_a_constrained_request_honours_the_constraints_too() {
    let mut state = pool();
    let request = constrained(1, 32, 0, &[]);
    let result = state.apply(
        4,
        Command::Place {
            name: "t".into(),
            request: request.encode_to_vec(),
            unix_ms: 4,
        },
    );
    assert_eq!(tenant(result).slices[0].node, "a1");
    assert_eq!(
        state.engine.constraints("t").map(|c| c.cpu_milli),
        Some(32_000)
    );
}

#[test]
fn a_keyed_registration_with_host_capacity_binds_the_name() {
    let mut state = PoolState::default();
    let key = api::metadata::node_key_sha256(&"a".repeat(64));
    let command = |key_sha256: &str| Command::RegisterHostNode {
        spec: node("h1", "H100-80GB"),
        host: host(16, 256),
        address: String::new(),
        key_sha256: Some(key_sha256.to_owned()),
        unix_ms: 0,
    };
    assert!(matches!(
        state.apply(1, command(&key)),
        CommandResult::Registered { .. }
    ));
    assert_eq!(state.node_keys["h1"].key_sha256, key);
    let other = api::metadata::node_key_sha256(&"b".repeat(64));
    let CommandResult::Failed { code, .. } = state.apply(2, command(&other)) else {
        panic!("expected a refusal");
    };
    assert_eq!(code, ErrorCode::NodeNameTaken);
    // A plain registration of the same machine (an agent downgraded) drops the capacity.
    assert!(matches!(
        state.apply(
            3,
            Command::RegisterKeyedNode {
                spec: node("h1", "H100-80GB"),
                address: String::new(),
                key_sha256: key,
                unix_ms: 0,
            }
        ),
        CommandResult::Registered { .. }
    ));
    assert_eq!(state.node_to_proto("h1").unwrap().cpu_milli, 0);
}

#[test]
fn a_registration_with_impossible_host_capacity_is_refused_in_apply() {
    let mut state = PoolState::default();
    for bad in [
        HostCapacity {
            cpu_milli: Some(0),
            memory_bytes: None,
        },
        HostCapacity {
            cpu_milli: None,
            memory_bytes: Some(api::validate::HOST_MEMORY_BYTES_MAX + 1),
        },
    ] {
        let result = state.apply(
            1,
            Command::RegisterHostNode {
                spec: node("h1", "H100-80GB"),
                host: bad,
                address: String::new(),
                key_sha256: None,
                unix_ms: 0,
            },
        );
        let CommandResult::Failed { code, message } = result else {
            panic!("expected a refusal of {bad:?}");
        };
        assert_eq!(code, ErrorCode::InvalidArgument);
        assert!(message.contains("h1"), "{message}");
    }
    assert!(state.nodes.is_empty());
}

#[test]
fn an_owner_places_constrained_tenants_for_itself_only() {
    let mut state = pool();
    let request = v1::PlacementRequest {
        owner: "alice".into(),
        ..constrained(1, 4, 0, &[])
    };
    let command = |owner: &str| Command::AsOwner {
        owner: owner.to_owned(),
        command: Box::new(Command::PlaceConstrained {
            name: "t".into(),
            request: request.encode_to_vec(),
            unix_ms: 4,
        }),
    };
    let CommandResult::Failed { code, .. } = state.apply(4, command("bob")) else {
        panic!("expected a refusal");
    };
    assert_eq!(code, ErrorCode::PermissionDenied);
    assert_eq!(
        tenant(state.apply(5, command("alice"))).state,
        TenantState::Placed
    );
}

/// What a snapshot carries (the pool's encoding, then `Engine::host_state` beside it) rebuilds a
/// replica that decides the next entries exactly like the one that never stopped.
#[test]
fn a_pool_rebuilt_from_its_encoding_and_host_state_decides_alike() {
    let mut state = pool();
    tenant(place(
        &mut state,
        4,
        "t1",
        &constrained(1, 12, 128, &["H100-80GB"]),
    ));
    tenant(place(&mut state, 5, "t2", &constrained(2, 40, 512, &[])));
    let host_state = state.engine.host_state();
    assert_eq!(host_state.nodes.len(), 3);
    assert_eq!(host_state.tenants.len(), 2);
    let bytes = crate::raft_types::encode(&state).expect("encode");
    let mut restored: PoolState = crate::raft_types::decode(&bytes).expect("decode");
    restored.engine.restore_host_state(host_state.clone());
    assert_eq!(restored.engine.host_state(), host_state);
    let next = [
        ("t3", constrained(1, 8, 0, &["H100-80GB"])),
        ("t4", constrained(1, 30, 0, &[])),
        ("t5", constrained(1, 8, 200, &[])),
    ];
    for (offset, (name, request)) in next.iter().enumerate() {
        let index = 6 + offset as u64;
        let left = place(&mut state, index, name, request);
        let right = place(&mut restored, index, name, request);
        assert_eq!(
            left, right,
            "{name}: a restored state decides like the original"
        );
    }
    for node in ["h1", "h2", "a1"] {
        assert_eq!(state.node_to_proto(node), restored.node_to_proto(node));
    }
    // Without its host state, the decoded pool would not know the CPU: the carry matters.
    let mut forgetful: PoolState = crate::raft_types::decode(&bytes).expect("decode");
    let left = place(&mut forgetful, 6, "t3", &constrained(1, 200, 0, &[]));
    assert!(
        matches!(left, CommandResult::Tenant(_)),
        "unbounded without its host state: {left:?}"
    );
}
