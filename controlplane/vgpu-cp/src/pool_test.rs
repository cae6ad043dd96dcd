//! Tests of the replicated state machine's application logic (with the real placement engine).

use super::*;

fn gpu(node: &str, index: u32) -> placement::GpuSpec {
    placement::GpuSpec {
        uuid: format!("GPU-{node}-{index}"),
        index,
        model: "H100-80GB".to_owned(),
        memory_bytes: 80 << 30,
        sm_count: 132,
        nvlink_peers: (0..4).filter(|&p| p != index).map(|p| (p, 18)).collect(),
        numa_node: 0,
        pci_bus_id: format!("0000:{index:02x}:00.0"),
        nearest_nics: Vec::new(),
    }
}

fn node(name: &str) -> NodeSpec {
    NodeSpec {
        name: name.to_owned(),
        labels: BTreeMap::new(),
        gpus: (0..4).map(|i| gpu(name, i)).collect(),
    }
}

fn register(state: &mut PoolState, index: u64, name: &str) {
    let result = state.apply(
        index,
        Command::RegisterNode {
            spec: node(name),
            address: String::new(),
            unix_ms: 0,
        },
    );
    assert_eq!(result, CommandResult::Done);
}

fn place(
    state: &mut PoolState,
    index: u64,
    name: &str,
    request: v1::PlacementRequest,
) -> CommandResult {
    state.apply(
        index,
        Command::Place {
            name: name.to_owned(),
            request: request.encode_to_vec(),
            unix_ms: index as i64,
        },
    )
}

fn fraction(milli: u32, memory_gib: u64) -> v1::PlacementRequest {
    v1::PlacementRequest {
        milli_gpus: milli,
        memory_bytes_per_gpu: memory_gib << 30,
        ..Default::default()
    }
}

fn whole(count: u32) -> v1::PlacementRequest {
    v1::PlacementRequest {
        whole_gpus: count,
        ..Default::default()
    }
}

#[test]
fn a_fraction_is_placed_and_shows_in_the_node_assignments() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let CommandResult::Tenant(tenant) = place(&mut state, 2, "infer-a", fraction(250, 20)) else {
        panic!("expected a tenant");
    };
    assert_eq!(tenant.state, TenantState::Placed);
    assert_eq!(tenant.slices.len(), 1);
    assert_eq!(tenant.slices[0].compute_percent, 25);
    assert_eq!(tenant.slices[0].memory_bytes, 20 << 30);
    assert_eq!(state.node_revisions["node-a"], 2);
    let (revision, assignments) = state.assignments("node-a");
    assert_eq!(revision, 2);
    assert_eq!(assignments.len(), 1);
    assert_eq!(assignments[0].tenant, "infer-a");
    assert_eq!(state.counters.placements, 1);
}

#[test]
fn an_impossible_request_is_refused_and_leaves_no_tenant() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let result = place(&mut state, 2, "huge", whole(16));
    let CommandResult::Failed { code, message } = result else {
        panic!("expected a refusal")
    };
    assert_eq!(code, ErrorCode::Unplaceable);
    assert!(!message.is_empty());
    assert!(state.tenants.is_empty());
    assert_eq!(state.node_revisions["node-a"], 1, "no assignment changed");
}

#[test]
fn placing_again_is_idempotent_but_a_different_request_conflicts() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let first = place(&mut state, 2, "infer-a", fraction(250, 20));
    let again = place(&mut state, 3, "infer-a", fraction(250, 20));
    assert_eq!(first, again);
    let CommandResult::Failed { code, .. } = place(&mut state, 4, "infer-a", fraction(500, 20))
    else {
        panic!("expected a conflict");
    };
    assert_eq!(code, ErrorCode::TenantExists);
    assert_eq!(state.tenants.len(), 1);
}

#[test]
fn bad_input_that_slipped_past_the_api_is_refused_in_apply() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    for (name, request) in [
        ("Bad Name", fraction(250, 1)),
        ("ok", whole(0)),
        (
            "ok",
            v1::PlacementRequest {
                compute_percent: 250,
                ..whole(1)
            },
        ),
    ] {
        let CommandResult::Failed { code, .. } = place(&mut state, 2, name, request) else {
            panic!("expected a refusal")
        };
        assert_eq!(code, ErrorCode::InvalidArgument);
    }
    let garbage = state.apply(
        3,
        Command::Place {
            name: "x".into(),
            request: vec![0xff, 0xff],
            unix_ms: 0,
        },
    );
    assert!(matches!(
        garbage,
        CommandResult::Failed {
            code: ErrorCode::InvalidArgument,
            ..
        }
    ));
    let release = state.apply(
        4,
        Command::Release {
            name: "nobody".into(),
            unix_ms: 0,
        },
    );
    assert!(matches!(
        release,
        CommandResult::Failed {
            code: ErrorCode::TenantNotFound,
            ..
        }
    ));
    assert!(state.tenants.is_empty());
}

#[test]
fn a_lost_node_has_its_tenants_replaced_with_history() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "train", whole(4));
    register(&mut state, 3, "node-b");
    assert_eq!(state.tenants["train"].slices[0].node, "node-a");
    let lost = Command::SetNodeState {
        node: "node-a".into(),
        state: placement::NodeState::Lost,
        reason: "silent".into(),
        unix_ms: 4,
    };
    assert_eq!(state.apply(4, lost), CommandResult::Done);
    let tenant = &state.tenants["train"];
    assert_eq!(tenant.state, TenantState::Placed);
    assert!(tenant.slices.iter().all(|s| s.node == "node-b"));
    assert!(
        tenant.history.iter().any(|e| e.message.contains("unbound")),
        "{:?}",
        tenant.history
    );
    assert_eq!(state.node_revisions["node-a"], 4);
    assert_eq!(state.node_revisions["node-b"], 4);
    assert!(state.assignments("node-a").1.is_empty());
}

#[test]
fn a_latency_target_survives_placement_and_reaches_the_assignment() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let chat = v1::PlacementRequest {
        latency: true,
        latency_target_us: 2_000,
        ..fraction(250, 10)
    };
    let CommandResult::Tenant(record) = place(&mut state, 2, "chat", chat) else {
        panic!("expected a tenant");
    };
    assert_eq!(record.state, TenantState::Placed);
    let shown = state.tenant_to_proto(&record);
    let request = shown.request.expect("a request");
    assert_eq!((request.latency, request.latency_target_us), (true, 2_000));
    let (_, assignments) = state.assignments("node-a");
    assert_eq!(assignments.len(), 1);
    assert_eq!(
        (assignments[0].latency, assignments[0].latency_target_us),
        (true, 2_000)
    );
    // Re-placed elsewhere when its node is lost, it keeps its target.
    register(&mut state, 3, "node-b");
    let lost = Command::SetNodeState {
        node: "node-a".into(),
        state: placement::NodeState::Lost,
        reason: "silent".into(),
        unix_ms: 4,
    };
    assert_eq!(state.apply(4, lost), CommandResult::Done);
    assert!(state.assignments("node-a").1.is_empty());
    let (_, moved) = state.assignments("node-b");
    assert_eq!(moved[0].tenant, "chat");
    assert_eq!(moved[0].latency_target_us, 2_000);
    // A tenant without a target has none in its assignment.
    place(&mut state, 5, "plain", fraction(250, 10));
    let (_, assignments) = state.assignments("node-b");
    let plain = assignments.iter().find(|a| a.tenant == "plain").unwrap();
    assert_eq!((plain.latency, plain.latency_target_us), (false, 0));
}

#[test]
fn release_frees_capacity_for_the_pending_queue() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "first", whole(4));
    let CommandResult::Tenant(second) = place(&mut state, 3, "second", whole(2)) else {
        panic!("kept")
    };
    assert_eq!(second.state, TenantState::Pending);
    assert!(!second.reason.is_empty());
    assert_eq!(
        state.apply(
            4,
            Command::Release {
                name: "first".into(),
                unix_ms: 4
            }
        ),
        CommandResult::Done
    );
    assert_eq!(state.tenants["second"].state, TenantState::Placed);
    assert!(!state.tenants.contains_key("first"));
}

#[test]
fn the_state_survives_a_serialization_round_trip() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "a", fraction(300, 10));
    let bytes = crate::raft_types::encode(&state).expect("encode");
    let mut restored: PoolState = crate::raft_types::decode(&bytes).expect("decode");
    let left = place(&mut state, 3, "b", fraction(300, 10));
    let right = place(&mut restored, 3, "b", fraction(300, 10));
    assert_eq!(left, right, "a restored state decides like the original");
}

/// Regression: releasing a gang while a larger gang waits used to panic in the engine
/// ("placed tenants are counted"), which would stop every replica at the same entry.
#[test]
fn release_with_a_pending_gang_behind_it() {
    for gpus_per_node in [4u32, 8] {
        let mut state = PoolState::default();
        let spec = NodeSpec {
            name: "node-a".into(),
            labels: BTreeMap::new(),
            gpus: (0..gpus_per_node)
                .map(|i| placement::GpuSpec {
                    nvlink_peers: (0..gpus_per_node)
                        .filter(|&p| p != i)
                        .map(|p| (p, 18))
                        .collect(),
                    ..gpu("node-a", i)
                })
                .collect(),
        };
        state.apply(
            1,
            Command::RegisterNode {
                spec,
                address: String::new(),
                unix_ms: 0,
            },
        );
        let burst = v1::PlacementRequest {
            burst: true,
            ..fraction(250, 20)
        };
        place(&mut state, 2, "infer-a", burst);
        let nvlink = v1::PlacementRequest {
            nvlink: v1::NvlinkPolicy::Require as i32,
            ..whole(2)
        };
        place(&mut state, 3, "train", nvlink);
        place(&mut state, 4, "big", whole(gpus_per_node));
        assert_eq!(
            state.apply(
                5,
                Command::Release {
                    name: "train".into(),
                    unix_ms: 5
                }
            ),
            CommandResult::Done
        );
        state.engine.check_invariants();
        assert_eq!(
            state.apply(
                6,
                Command::Release {
                    name: "infer-a".into(),
                    unix_ms: 6
                }
            ),
            CommandResult::Done
        );
        state.engine.check_invariants();
        assert_eq!(state.tenants["big"].state, TenantState::Placed);
    }
}

/// An agent that restarts re-registers its node; placed tenants keep (or move off) their slices
/// and the engine's accounting stays whole through later releases.
#[test]
fn re_registration_keeps_accounting_whole() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "infer-a", fraction(250, 20));
    place(&mut state, 3, "train", whole(2));
    place(&mut state, 4, "big", whole(4));
    register(&mut state, 5, "node-a");
    state.engine.check_invariants();
    assert_eq!(state.tenants["train"].state, TenantState::Placed);
    let mut changed = node("node-a");
    changed.gpus.pop();
    state.apply(
        6,
        Command::RegisterNode {
            spec: changed,
            address: String::new(),
            unix_ms: 6,
        },
    );
    state.engine.check_invariants();
    for (index, name) in [(7, "train"), (8, "infer-a"), (9, "big")] {
        assert_eq!(
            state.apply(
                index,
                Command::Release {
                    name: name.into(),
                    unix_ms: 0
                }
            ),
            CommandResult::Done
        );
        state.engine.check_invariants();
    }
    let lost = Command::SetNodeState {
        node: "node-a".into(),
        state: placement::NodeState::Lost,
        reason: String::new(),
        unix_ms: 0,
    };
    state.apply(10, lost);
    register(&mut state, 11, "node-a");
    state.engine.check_invariants();
}

#[test]
fn a_batch_applies_its_commands_in_order_with_one_result_each() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let place_command = |name: &str, request: v1::PlacementRequest| Command::Place {
        name: name.to_owned(),
        request: request.encode_to_vec(),
        unix_ms: 2,
    };
    let batch = Command::Batch(vec![
        place_command("first", whole(4)),
        place_command("second", whole(2)),
        place_command("huge", whole(16)),
        Command::Release {
            name: "first".into(),
            unix_ms: 2,
        },
    ]);
    let CommandResult::Batch(results) = state.apply(2, batch) else {
        panic!("a batch result")
    };
    assert_eq!(results.len(), 4);
    assert!(matches!(&results[0], CommandResult::Tenant(t) if t.state == TenantState::Placed));
    // `second` queued behind `first` in the same entry and was placed when `first` left.
    assert!(matches!(&results[1], CommandResult::Tenant(t) if t.state == TenantState::Pending));
    assert!(matches!(
        &results[2],
        CommandResult::Failed {
            code: ErrorCode::Unplaceable,
            ..
        }
    ));
    assert_eq!(results[3], CommandResult::Done);
    assert_eq!(state.tenants["second"].state, TenantState::Placed);
    assert_eq!(state.tenants["second"].revision, 2);
}

#[test]
fn tokens_keep_only_their_hash_and_expire() {
    let mut state = PoolState::default();
    let create = |hash: &str, expires_unix_ms: i64, unix_ms: i64| Command::CreateToken {
        hash: hash.to_owned(),
        expires_unix_ms,
        unix_ms,
    };
    let first = "a".repeat(64);
    let second = "b".repeat(64);
    assert_eq!(
        state.apply(1, create(&first, 2_000, 1_000)),
        CommandResult::Done
    );
    assert_eq!(state.token_expiry(&first), Some(2_000));
    // Creating another after the first expired drops the first.
    assert_eq!(
        state.apply(2, create(&second, 9_000, 3_000)),
        CommandResult::Done
    );
    assert_eq!(state.token_expiry(&first), None);
    assert_eq!(state.token_expiry(&second), Some(9_000));
    // An expiry in the past or a malformed hash is refused and changes nothing.
    for bad in [
        create(&"c".repeat(64), 3_000, 4_000),
        create("short", 9_000, 4_000),
    ] {
        assert!(matches!(
            state.apply(3, bad),
            CommandResult::Failed {
                code: ErrorCode::InvalidArgument,
                ..
            }
        ));
    }
    assert_eq!(state.tokens.len(), 1);
    // The tokens are bounded.
    for index in 0..TOKENS_MAX as u64 {
        state.apply(4 + index, create(&format!("{index:064}"), 9_000, 4_000));
    }
    assert_eq!(state.tokens.len(), TOKENS_MAX);
    assert!(matches!(
        state.apply(5000, create(&"d".repeat(64), 9_000, 4_000)),
        CommandResult::Failed { .. }
    ));
}

#[test]
fn revocations_are_kept_once_in_normal_form_and_bounded() {
    let mut state = PoolState::default();
    let revoke = |serial: &str| Command::RevokeCertificate {
        serial: serial.to_owned(),
        unix_ms: 7,
    };
    assert_eq!(
        state.apply(1, revoke("1f")),
        CommandResult::Revoked {
            newly: true,
            total: 1
        }
    );
    assert_eq!(
        state.apply(2, revoke("1f")),
        CommandResult::Revoked {
            newly: false,
            total: 1
        }
    );
    // Only the normal form is logged (the member normalizes before proposing).
    for bad in ["1F", "0x1f", "", "01f", "zz"] {
        assert!(
            matches!(state.apply(3, revoke(bad)), CommandResult::Failed { .. }),
            "{bad}"
        );
    }
    assert_eq!(state.revoked, BTreeMap::from([("1f".to_owned(), 7)]));
    for index in 1..REVOKED_MAX as u64 {
        state.apply(4, revoke(&format!("{:x}", 0x1000 + index)));
    }
    assert_eq!(state.revoked.len(), REVOKED_MAX);
    assert!(matches!(
        state.apply(5, revoke("abc")),
        CommandResult::Failed { .. }
    ));
}

fn set(
    state: &mut PoolState,
    index: u64,
    name: &str,
    change: (Option<u32>, Option<i32>, Option<u64>),
    owner: Option<&str>,
) -> CommandResult {
    let (compute_percent, priority, latency_target_us) = change;
    state.apply(
        index,
        Command::SetTenant {
            name: name.to_owned(),
            compute_percent,
            priority,
            latency_target_us,
            owner: owner.map(str::to_owned),
            unix_ms: index as i64,
        },
    )
}

fn refusal(result: CommandResult) -> (ErrorCode, String) {
    match result {
        CommandResult::Failed { code, message } => (code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn latency_tenant(owner: &str) -> v1::PlacementRequest {
    v1::PlacementRequest {
        latency: true,
        latency_target_us: 2_000,
        owner: owner.to_owned(),
        ..fraction(250, 10)
    }
}

#[test]
fn a_change_that_fits_reaches_the_assignment_and_the_history() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "chat", latency_tenant("acme"));
    let gpu = state.tenants["chat"].slices[0].gpu_index;
    let CommandResult::Tenant(record) = set(
        &mut state,
        3,
        "chat",
        (Some(40), Some(5), Some(1_500)),
        Some("acme"),
    ) else {
        panic!("expected the changed tenant");
    };
    assert_eq!(record.state, TenantState::Placed);
    assert_eq!(record.slices[0].compute_percent, 40);
    assert_eq!(record.slices[0].gpu_index, gpu, "not moved");
    assert_eq!(record.revision, 3);
    assert_eq!(
        record.history.back().unwrap().message,
        "changed: compute 25% -> 40%, priority 0 -> 5, latency target 2000us -> 1500us"
    );
    let request = decode_request(&record.request);
    assert_eq!(
        (
            request.compute_percent,
            request.priority,
            request.latency_target_us
        ),
        (40, 5, 1_500)
    );
    assert_eq!(
        state.node_revisions["node-a"], 3,
        "the node's agent is told"
    );
    let (revision, assignments) = state.assignments("node-a");
    assert_eq!(revision, 3);
    assert_eq!(assignments[0].slices[0].compute_percent, 40);
    assert_eq!(assignments[0].priority, 5);
    assert_eq!(assignments[0].latency_target_us, 1_500);
    let usage = &state.engine.node("node-a").unwrap().usage[gpu as usize];
    assert_eq!(usage.compute_allocated_percent, 40);

    // The same values again: nothing changes (a resent call), no history, no new revision.
    let again = set(&mut state, 4, "chat", (Some(40), Some(5), None), None);
    assert_eq!(
        again,
        CommandResult::Tenant(Box::new(state.tenants["chat"].clone()))
    );
    assert_eq!(state.tenants["chat"].revision, 3);
    assert_eq!(state.node_revisions["node-a"], 3);
    // A target of 0 removes it.
    set(&mut state, 5, "chat", (None, None, Some(0)), None);
    assert_eq!(state.assignments("node-a").1[0].latency_target_us, 0);
    assert_eq!(
        state.tenants["chat"].history.back().unwrap().message,
        "changed: latency target 1500us -> none"
    );
}

#[test]
fn a_change_that_does_not_fit_is_refused_with_the_reason_and_changes_nothing() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "chat", latency_tenant("acme"));
    let gpu = state.tenants["chat"].slices[0].gpu_index;
    // Fill the rest of chat's GPU: 25% + 70% = 95%.
    let filler = state.tenants["chat"].slices[0].gpu_uuid.clone();
    place(
        &mut state,
        3,
        "batch",
        v1::PlacementRequest {
            compute_percent: 70,
            ..fraction(250, 10)
        },
    );
    assert_eq!(state.tenants["batch"].slices[0].gpu_uuid, filler);
    let before = state.tenants.clone();
    let (code, message) = refusal(set(&mut state, 4, "chat", (Some(40), Some(9), None), None));
    assert_eq!(code, ErrorCode::Unplaceable);
    assert!(
        message.contains(&format!("GPU {gpu} of node node-a has room for 30%")),
        "{message}"
    );
    assert_eq!(
        state.tenants, before,
        "nothing changed, not even the priority"
    );
    assert_eq!(state.node_revisions["node-a"], 3);
    // Whole GPUs are exclusive.
    place(&mut state, 5, "train", whole(1));
    let (code, message) = refusal(set(&mut state, 6, "train", (Some(50), None, None), None));
    assert_eq!(code, ErrorCode::Unplaceable);
    assert!(message.contains("whole GPUs"), "{message}");
}

#[test]
fn changes_of_unknown_or_foreign_tenants_and_bad_targets_are_refused() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "chat", latency_tenant("acme"));
    place(&mut state, 3, "plain", fraction(250, 10));
    let before = state.tenants.clone();
    let (code, _) = refusal(set(&mut state, 4, "ghost", (Some(40), None, None), None));
    assert_eq!(code, ErrorCode::TenantNotFound);
    let (code, message) = refusal(set(
        &mut state,
        5,
        "chat",
        (Some(40), None, None),
        Some("globex"),
    ));
    assert_eq!(code, ErrorCode::PermissionDenied);
    assert!(message.contains("another owner"), "{message}");
    let (code, message) = refusal(set(&mut state, 6, "plain", (None, None, Some(2_000)), None));
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(message.contains("not a latency tenant"), "{message}");
    for bad in [
        (None, None, None),
        (Some(0), None, None),
        (None, Some(5_000), None),
        (None, None, Some(5)),
    ] {
        let (code, _) = refusal(set(&mut state, 7, "chat", bad, None));
        assert_eq!(code, ErrorCode::InvalidArgument, "{bad:?}");
    }
    assert_eq!(state.tenants, before);
}

#[test]
fn a_pending_tenant_changes_its_request_and_a_smaller_share_lets_it_in() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    // Four GPUs: each 80% taken.
    for (index, name) in [(2, "a"), (3, "b"), (4, "c"), (5, "d")] {
        place(
            &mut state,
            index,
            name,
            v1::PlacementRequest {
                compute_percent: 80,
                ..fraction(250, 10)
            },
        );
    }
    let CommandResult::Tenant(waiting) = place(
        &mut state,
        6,
        "late",
        v1::PlacementRequest {
            compute_percent: 30,
            ..fraction(250, 10)
        },
    ) else {
        panic!("kept")
    };
    assert_eq!(waiting.state, TenantState::Pending);
    let CommandResult::Tenant(late) = set(&mut state, 7, "late", (Some(20), None, None), None)
    else {
        panic!("changed")
    };
    assert_eq!(late.state, TenantState::Placed, "20% fits next to 80%");
    assert_eq!(late.slices[0].compute_percent, 20);
    assert!(
        late.history
            .iter()
            .any(|event| event.message == "changed: compute 30% -> 20%"),
        "{:?}",
        late.history
    );
}

/// Issue 22, point 2: the leader of term 3 decided `node-a` lost on its stale view (it had been
/// paused while term 4 elected another leader), and the decision reached the log in an entry of
/// the new leader. Applying it does nothing: the tenant stays where it is.
#[test]
fn a_decision_of_a_deposed_leader_does_nothing() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "train", whole(4));
    register(&mut state, 3, "node-b");
    let revision = state.node_revisions["node-a"];
    let decided = |term, leader| Command::LeaderDecision {
        term,
        leader,
        command: Box::new(Command::SetNodeState {
            node: "node-a".into(),
            state: placement::NodeState::Lost,
            reason: "no heartbeat for more than 5.0s".into(),
            unix_ms: 4,
        }),
    };
    let new_leader = EntryLeader { term: 4, leader: 2 };
    let CommandResult::Failed { code, message } = state.apply_entry(4, new_leader, decided(3, 1))
    else {
        panic!("a stale decision is refused");
    };
    assert_eq!(code, ErrorCode::NotLeader);
    assert!(message.contains("term 3"), "{message}");
    // Batched with other writes, it is refused alone.
    let batch = Command::Batch(vec![decided(3, 1), Command::Retry { unix_ms: 5 }]);
    let CommandResult::Batch(results) = state.apply_entry(5, new_leader, batch) else {
        panic!("a batch answers per command");
    };
    assert!(matches!(results[0], CommandResult::Failed { .. }));
    assert_eq!(results[1], CommandResult::Done);
    // The same leader id in a later term (re-elected) is another leadership too.
    let reelected = EntryLeader { term: 5, leader: 1 };
    assert!(matches!(
        state.apply_entry(6, reelected, decided(3, 1)),
        CommandResult::Failed { .. }
    ));
    // Not applied through the plain path either (the leader is unknown there).
    assert!(matches!(
        state.apply(7, decided(3, 1)),
        CommandResult::Failed { .. }
    ));
    assert_eq!(state.tenants["train"].state, TenantState::Placed);
    assert!(
        state.tenants["train"]
            .slices
            .iter()
            .all(|s| s.node == "node-a")
    );
    assert_eq!(state.node_revisions["node-a"], revision);
    assert_eq!(
        state.engine.node("node-a").map(|view| view.state),
        Some(placement::NodeState::Ready)
    );
    // Decided and appended by the same leadership, it applies.
    assert_eq!(
        state.apply_entry(8, reelected, decided(5, 1)),
        CommandResult::Done
    );
    assert!(
        state.tenants["train"]
            .slices
            .iter()
            .all(|s| s.node == "node-b")
    );
}

#[test]
fn only_node_states_and_retries_are_leader_decisions() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let leader = EntryLeader { term: 2, leader: 1 };
    let release = Command::LeaderDecision {
        term: 2,
        leader: 1,
        command: Box::new(Command::Release {
            name: "x".into(),
            unix_ms: 0,
        }),
    };
    assert!(matches!(
        state.apply_entry(2, leader, release),
        CommandResult::Failed {
            code: ErrorCode::InvalidArgument,
            ..
        }
    ));
}

fn owned(owner: &str, command: Command) -> Command {
    Command::AsOwner {
        owner: owner.to_owned(),
        command: Box::new(command),
    }
}

/// Issue 22, point 4 (a): bob's release checked the owner at his member and was proposed; by
/// the time it was applied the name belonged to alice's new tenant. Applying it refuses and
/// leaves alice's tenant alone.
#[test]
fn a_release_for_another_owner_is_refused_where_it_is_applied() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    let alices = v1::PlacementRequest {
        owner: "alice".into(),
        ..fraction(250, 10)
    };
    let place_alice = Command::Place {
        name: "a1".into(),
        request: alices.encode_to_vec(),
        unix_ms: 2,
    };
    assert!(matches!(
        state.apply(2, owned("alice", place_alice.clone())),
        CommandResult::Tenant(_)
    ));
    let release = Command::Release {
        name: "a1".into(),
        unix_ms: 3,
    };
    let CommandResult::Failed { code, message } = state.apply(3, owned("bob", release.clone()))
    else {
        panic!("bob may not release alice's tenant");
    };
    assert_eq!(code, ErrorCode::PermissionDenied);
    assert!(message.contains("another owner"), "{message}");
    assert_eq!(state.tenants["a1"].state, TenantState::Placed);
    // Nor change it, nor place over it, nor place for alice.
    let change = Command::SetTenant {
        name: "a1".into(),
        compute_percent: None,
        priority: Some(5),
        latency_target_us: None,
        owner: Some("bob".into()),
        unix_ms: 4,
    };
    assert!(matches!(
        state.apply(4, owned("bob", change)),
        CommandResult::Failed {
            code: ErrorCode::PermissionDenied,
            ..
        }
    ));
    assert!(matches!(
        state.apply(5, owned("bob", place_alice)),
        CommandResult::Failed {
            code: ErrorCode::PermissionDenied,
            ..
        }
    ));
    assert_eq!(state.tenants["a1"].revision, 2, "nothing changed");
    // Alice releases her own; a name nobody holds is not found, whoever asks.
    assert_eq!(
        state.apply(6, owned("alice", release.clone())),
        CommandResult::Done
    );
    assert!(matches!(
        state.apply(7, owned("bob", release)),
        CommandResult::Failed {
            code: ErrorCode::TenantNotFound,
            ..
        }
    ));
    // Only tenant writes act for an owner.
    let retry = owned("bob", Command::Retry { unix_ms: 8 });
    assert!(matches!(
        state.apply(8, retry),
        CommandResult::Failed {
            code: ErrorCode::InvalidArgument,
            ..
        }
    ));
}

/// Issue 22, point 1: no API removed a lost or junk node. `RemoveNode` re-places its tenants
/// and forgets it; a node nobody knows is not found.
#[test]
fn a_removed_node_is_forgotten_and_its_tenants_move() {
    let mut state = PoolState::default();
    register(&mut state, 1, "node-a");
    place(&mut state, 2, "train", whole(4));
    register(&mut state, 3, "node-b");
    let remove = |node: &str, unix_ms| Command::RemoveNode {
        node: node.to_owned(),
        unix_ms,
    };
    assert_eq!(state.apply(4, remove("node-a", 4)), CommandResult::Done);
    assert!(!state.nodes.contains_key("node-a"));
    assert!(state.engine.node("node-a").is_none());
    assert!(!state.node_revisions.contains_key("node-a"));
    let train = &state.tenants["train"];
    assert_eq!(train.state, TenantState::Placed);
    assert!(train.slices.iter().all(|s| s.node == "node-b"));
    assert!(matches!(
        state.apply(5, remove("node-a", 5)),
        CommandResult::Failed {
            code: ErrorCode::NodeNotFound,
            ..
        }
    ));
    // It may register again.
    register(&mut state, 6, "node-a");
    assert!(state.nodes.contains_key("node-a"));
}

fn keyed(name: &str, key: &str) -> Command {
    Command::RegisterKeyedNode {
        spec: node(name),
        address: String::new(),
        key_sha256: api::metadata::node_key_sha256(key),
        unix_ms: 0,
    }
}

fn keyless(name: &str) -> Command {
    Command::RegisterNode {
        spec: node(name),
        address: String::new(),
        unix_ms: 0,
    }
}

fn registration(result: CommandResult) -> u64 {
    match result {
        CommandResult::Registered { registration } => registration,
        other => panic!("expected a registration, got {other:?}"),
    }
}

/// Issue 22, point 5: a node's name is bound to the node key that registered it first. Another
/// key (a stolen bootstrap token, a cloned machine) is refused and changes nothing; the same key
/// registers again under a new number; removing the node frees the name.
#[test]
fn a_node_name_is_bound_to_the_key_that_registered_it_first() {
    let (key_a, key_b) = ("a".repeat(64), "b".repeat(64));
    let digest_a = api::metadata::node_key_sha256(&key_a);
    let mut state = PoolState::default();
    let first = registration(state.apply(1, keyed("node-a", &key_a)));
    assert_eq!(state.node_keys["node-a"].key_sha256, digest_a);
    assert_eq!(state.node_keys["node-a"].registration, first);
    place(&mut state, 2, "train", whole(4));
    let before = state.assignments("node-a");

    let (code, message) = refusal(state.apply(3, keyed("node-a", &key_b)));
    assert_eq!(code, ErrorCode::NodeNameTaken);
    assert!(
        message.starts_with("node `node-a` is registered by another node key")
            && message.contains("vgpuctl node remove node-a")
            && message.contains("--name"),
        "{message}"
    );
    // An agent without a key cannot take a bound name either.
    let (code, _) = refusal(state.apply(4, keyless("node-a")));
    assert_eq!(code, ErrorCode::NodeNameTaken);
    assert_eq!(
        state.assignments("node-a"),
        before,
        "refusals change nothing"
    );
    assert_eq!(state.node_keys["node-a"].registration, first);

    let again = registration(state.apply(5, keyed("node-a", &key_a)));
    assert!(again > first, "every registration gets a new number");
    assert_eq!(state.tenants["train"].state, TenantState::Placed);
    assert_eq!(
        state.check_node_claim("node-a", Some(&digest_a), Some(again)),
        Ok(())
    );

    let remove = Command::RemoveNode {
        node: "node-a".to_owned(),
        unix_ms: 6,
    };
    assert_eq!(state.apply(6, remove), CommandResult::Done);
    assert!(
        state.node_keys.is_empty(),
        "removing the node frees its name"
    );
    let taken_over = registration(state.apply(7, keyed("node-a", &key_b)));
    assert_eq!(
        state.node_keys["node-a"].key_sha256,
        api::metadata::node_key_sha256(&key_b)
    );
    assert!(taken_over > again);
}

/// Agents of earlier versions send no key: they register a name nobody bound, and it stays
/// unbound until the first keyed registration binds it.
#[test]
fn a_keyless_registration_leaves_its_name_unbound() {
    let mut state = PoolState::default();
    assert_eq!(state.apply(1, keyless("node-a")), CommandResult::Done);
    assert_eq!(state.apply(2, keyless("node-a")), CommandResult::Done);
    assert!(state.node_keys.is_empty());
    assert_eq!(state.check_node_claim("node-a", None, Some(0)), Ok(()));
    let key = "c".repeat(64);
    registration(state.apply(3, keyed("node-a", &key)));
    assert!(state.node_keys.contains_key("node-a"));
    let (code, _) = refusal(state.apply(4, keyless("node-a")));
    assert_eq!(code, ErrorCode::NodeNameTaken);
}

/// Two registrations of one name with different keys in one entry (or in two entries, in
/// either order): the one applied first binds the name, the other is refused on every replica.
#[test]
fn of_two_racing_registrations_only_the_first_binds_the_name() {
    let (key_a, key_b) = ("a".repeat(64), "b".repeat(64));
    let batch = Command::Batch(vec![keyed("node-a", &key_b), keyed("node-a", &key_a)]);
    let mut replicas = [PoolState::default(), PoolState::default()];
    for state in &mut replicas {
        let CommandResult::Batch(results) = state.apply(1, batch.clone()) else {
            panic!("a batch answers a batch");
        };
        assert_eq!(
            results[0],
            CommandResult::Registered {
                registration: 1 << 16
            }
        );
        assert_eq!(refusal(results[1].clone()).0, ErrorCode::NodeNameTaken);
        assert_eq!(
            state.node_keys["node-a"].key_sha256,
            api::metadata::node_key_sha256(&key_b)
        );
    }
    assert_eq!(replicas[0].node_keys, replicas[1].node_keys);
    // The same key twice in one entry: both accepted, each with its own number.
    let mut state = PoolState::default();
    let batch = Command::Batch(vec![keyed("node-a", &key_a), keyed("node-a", &key_a)]);
    let CommandResult::Batch(results) = state.apply(1, batch) else {
        panic!("a batch answers a batch");
    };
    let numbers: Vec<u64> = results.into_iter().map(registration).collect();
    assert_eq!(numbers, vec![1 << 16, 1 << 16 | 1]);
    assert_eq!(state.node_keys["node-a"].registration, 1 << 16 | 1);
}

/// What heartbeats and assignment streams are judged by: the key's digest, and for a beat the
/// registration it names.
#[test]
fn calls_for_a_bound_name_need_its_key_and_its_latest_registration() {
    let key = "d".repeat(64);
    let digest = api::metadata::node_key_sha256(&key);
    let other = api::metadata::node_key_sha256(&"e".repeat(64));
    let mut state = PoolState::default();
    let first = registration(state.apply(1, keyed("node-a", &key)));
    let second = registration(state.apply(2, keyed("node-a", &key)));
    assert_eq!(
        state.check_node_claim("node-a", Some(&digest), None),
        Ok(())
    );
    assert_eq!(
        state.check_node_claim("node-a", Some(&digest), Some(second)),
        Ok(())
    );
    let NameTaken(stale) = state
        .check_node_claim("node-a", Some(&digest), Some(first))
        .unwrap_err();
    assert!(
        stale.contains(&format!("registration {second}"))
            && stale.contains(&format!("registration {first}")),
        "{stale}"
    );
    for (key, registration) in [(Some(other.as_str()), Some(second)), (None, None)] {
        let NameTaken(message) = state
            .check_node_claim("node-a", key, registration)
            .unwrap_err();
        assert!(message.contains("another node key"), "{message}");
    }
    // A node that is not registered is left to the call's own answer (`known = false`).
    assert_eq!(
        state.check_node_claim("node-b", Some(&other), Some(9)),
        Ok(())
    );
}

fn register_kubernetes(state: &mut PoolState, index: u64, name: &str) {
    let result = state.apply(
        index,
        Command::RegisterKubernetesNode {
            spec: node(name),
            host: HostCapacity::default(),
            address: String::new(),
            key_sha256: None,
            unix_ms: 0,
        },
    );
    assert_eq!(result, CommandResult::Done);
}

fn place_pinned(
    state: &mut PoolState,
    index: u64,
    name: &str,
    node: &str,
    gpu_index: u32,
) -> CommandResult {
    let request = v1::PlacementRequest {
        milli_gpus: 500,
        owner: "k8s:ml/train".to_owned(),
        pin: Some(v1::Pin {
            node: node.to_owned(),
            gpus: vec![v1::PinnedGpu {
                uuid: format!("GPU-{node}-{gpu_index}"),
                compute_percent: 50,
                memory_bytes: 40 << 30,
            }],
        }),
        ..Default::default()
    };
    state.apply(
        index,
        Command::PlacePinned {
            name: name.to_owned(),
            request: request.encode_to_vec(),
            unix_ms: index as i64,
        },
    )
}

/// Issue 18: a pin binds on a Kubernetes-managed node and stays while the node is lost; a pin on
/// an ordinary node is refused; vgpuctl's tenants go only to the ordinary node, and reads say
/// which node is which.
#[test]
fn pins_hold_kubernetes_managed_nodes_and_other_tenants_stay_off_them() {
    let mut state = PoolState::default();
    register_kubernetes(&mut state, 1, "node-k");
    register(&mut state, 2, "node-v");
    let CommandResult::Tenant(tenant) = place_pinned(&mut state, 3, "train-3f2a9c1e", "node-k", 2)
    else {
        panic!("expected a tenant");
    };
    assert_eq!(tenant.state, TenantState::Placed);
    assert_eq!(tenant.slices[0].node, "node-k");
    assert_eq!(tenant.slices[0].gpu_index, 2);
    let CommandResult::Failed { code, message } =
        place_pinned(&mut state, 4, "other-3f2a9c1e", "node-v", 0)
    else {
        panic!("a pin on an ordinary node is refused");
    };
    assert_eq!(code, ErrorCode::Unplaceable);
    assert!(message.contains("not Kubernetes-managed"), "{message}");
    for index in 5..9 {
        let CommandResult::Tenant(tenant) =
            place(&mut state, index, &format!("t{index}"), whole(1))
        else {
            panic!("expected a tenant");
        };
        assert_eq!(
            tenant.slices[0].node, "node-v",
            "vgpuctl's tenants stay off node-k"
        );
    }
    let CommandResult::Tenant(waiting) = place(&mut state, 9, "t9", whole(1)) else {
        panic!("expected a pending tenant");
    };
    assert_eq!(waiting.state, TenantState::Pending);
    let lost = state.apply(
        10,
        Command::SetNodeState {
            node: "node-k".to_owned(),
            state: placement::NodeState::Lost,
            reason: "missed heartbeats".to_owned(),
            unix_ms: 10,
        },
    );
    assert_eq!(lost, CommandResult::Done);
    assert_eq!(state.tenants["train-3f2a9c1e"].state, TenantState::Placed);
    assert_eq!(state.tenants["train-3f2a9c1e"].slices, tenant.slices);
    assert!(state.node_to_proto("node-k").unwrap().kubernetes_managed);
    // The node's agent (its DRA driver) may release the pinned tenant, and nothing else.
    assert_eq!(
        state.pinned_release_owner("node-k", "train-3f2a9c1e"),
        Ok("k8s:ml/train".to_owned())
    );
    for (node, tenant, code) in [
        ("node-v", "train-3f2a9c1e", ErrorCode::PermissionDenied),
        ("node-v", "t5", ErrorCode::PermissionDenied),
        ("node-k", "t5", ErrorCode::PermissionDenied),
        ("node-k", "gone", ErrorCode::TenantNotFound),
    ] {
        let refused = state.pinned_release_owner(node, tenant).unwrap_err();
        assert_eq!(refused.0, code, "{node} {tenant}: {}", refused.1);
    }
    assert!(!state.node_to_proto("node-v").unwrap().kubernetes_managed);
    state.engine.check_invariants();
}

fn elastic(request_gib: u64, limit_gib: u64) -> v1::PlacementRequest {
    v1::PlacementRequest {
        memory_limit_bytes_per_gpu: limit_gib << 30,
        ..fraction(250, request_gib)
    }
}

/// One node with one 80 GiB GPU, so that every tenant lands on the same GPU.
fn register_one_gpu(state: &mut PoolState, index: u64, name: &str) {
    let spec = NodeSpec {
        gpus: vec![placement::GpuSpec {
            nvlink_peers: BTreeMap::new(),
            ..gpu(name, 0)
        }],
        ..node(name)
    };
    let result = state.apply(
        index,
        Command::RegisterNode {
            spec,
            address: String::new(),
            unix_ms: 0,
        },
    );
    assert_eq!(result, CommandResult::Done);
}

#[test]
fn limits_are_overbooked_but_requests_never_are() {
    let mut state = PoolState::default();
    register_one_gpu(&mut state, 1, "node-a");
    for (index, name) in [(2, "first"), (3, "second")] {
        let CommandResult::Tenant(tenant) = place(&mut state, index, name, elastic(30, 70)) else {
            panic!("expected {name} placed");
        };
        assert_eq!(
            tenant.state,
            TenantState::Placed,
            "{name}: {}",
            tenant.reason
        );
        let placed = &tenant.history.back().expect("a placement event").message;
        assert!(placed.contains("borrows what the GPU has free"), "{placed}");
    }
    // The limits add up to 140 GiB on an 80 GiB GPU; the requests to 60 GiB. A third request of
    // 30 GiB would pass the GPU's memory: it waits, limit or not.
    let CommandResult::Tenant(third) = place(&mut state, 4, "third", fraction(250, 30)) else {
        panic!("expected a tenant");
    };
    assert_eq!(third.state, TenantState::Pending);
    assert!(!third.reason.contains("borrow"), "{}", third.reason);
    let CommandResult::Tenant(fourth) = place(&mut state, 5, "fourth", elastic(30, 40)) else {
        panic!("expected a tenant");
    };
    assert_eq!(fourth.state, TenantState::Pending);
    assert!(
        fourth.reason.contains("request 30GiB per GPU is booked"),
        "{}",
        fourth.reason
    );
    // The assignments carry each slice's limit; a tenant without one has its request as limit.
    let (_, assignments) = state.assignments("node-a");
    let limits: Vec<(String, u64, u64)> = assignments
        .iter()
        .map(|a| {
            let slice = &a.slices[0];
            (
                a.tenant.clone(),
                slice.memory_bytes,
                slice.memory_limit_bytes,
            )
        })
        .collect();
    assert_eq!(
        limits,
        [
            ("first".to_owned(), 30 << 30, 70 << 30),
            ("second".to_owned(), 30 << 30, 70 << 30)
        ]
    );
    let first = state.tenant_to_proto(&state.tenants["first"]);
    assert_eq!(first.slices[0].memory_limit_bytes, 70 << 30);
}

#[test]
fn a_limit_is_capped_at_its_gpu_and_one_without_a_limit_is_its_request() {
    let mut state = PoolState::default();
    register_one_gpu(&mut state, 1, "node-a");
    assert_eq!(state.largest_gpu_memory_bytes(), 80 << 30);
    // Admission (`Service::place`) refuses a limit past every GPU; `apply` takes what reaches the
    // log (a member of a version without limits would too) and caps it at the GPU's memory.
    let CommandResult::Tenant(greedy) = place(&mut state, 2, "greedy", elastic(30, 100)) else {
        panic!("expected a tenant");
    };
    assert_eq!(greedy.state, TenantState::Placed);
    let proto = state.tenant_to_proto(&state.tenants["greedy"]);
    assert_eq!(proto.slices[0].memory_limit_bytes, 80 << 30);
    // A record from before limits existed: no limit field, so the request is the limit.
    let CommandResult::Tenant(tenant) = place(&mut state, 3, "plain", fraction(250, 20)) else {
        panic!("expected a tenant");
    };
    assert_eq!(tenant.slices[0].memory_bytes, 20 << 30);
    let proto = state.tenant_to_proto(&state.tenants["plain"]);
    assert_eq!(proto.slices[0].memory_limit_bytes, 20 << 30);
}
