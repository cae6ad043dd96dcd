//! Fuzz targets for the parsers every vgpu binary shares: size strings, names, placement-request
//! validation (also of requests decoded from arbitrary bytes), the configuration helpers, and
//! the `[VGPU-...]` code read back from a status. Each target must never panic, never hang, and
//! either accept (and then the result round-trips or keeps the rule it checked) or refuse with a
//! message that names the problem. `VGPU_FUZZ_CASES` sets the cases per target;
//! `docs/fuzzing.md` says more.

use fuzzkit as fuzz;

use std::collections::BTreeMap;
use std::path::Path;

use api::config::{self, ConfigError};
use api::names::{NAME_LENGTH_MAX, NameError};
use api::size::{SizeError, format_bytes, parse_bytes};
use api::v1::PlacementRequest;
use api::validate::{
    BANDWIDTH_WEIGHT_MAX, GANG_GPUS_MAX, PRIORITY_MAX, PRIORITY_MIN, RequestError,
    SELECTOR_PAIRS_MAX, admit_request, validate_request,
};
use proptest::prelude::*;
use prost::Message as _;

/// Checks `text` as the `vgpu-node-key` and as the `vgpu-registration` metadata of a call.
fn check_identity_metadata(text: String) {
    use api::metadata::{self, MetadataError};
    let Ok(value) = text.parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>() else {
        return;
    };
    let mut map = tonic::metadata::MetadataMap::new();
    map.insert(metadata::NODE_KEY, value.clone());
    map.insert(metadata::REGISTRATION, value);
    let is_key = text.len() == 64
        && text
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
    match metadata::node_key(&map) {
        Ok(Some(key)) => {
            assert!(is_key, "{text:?} accepted as a node key");
            assert_eq!(key, text);
            assert_eq!(metadata::node_key_sha256(key).len(), 64);
        }
        Ok(None) => panic!("a key that is there is read"),
        Err(error) => {
            assert!(!is_key, "{text:?} refused as a node key");
            assert_eq!(error, MetadataError::MalformedNodeKey);
            assert!(error.to_string().contains(metadata::NODE_KEY));
        }
    }
    let number = (!text.is_empty() && text.chars().all(|c| c.is_ascii_digit()))
        .then(|| text.parse::<u64>().ok())
        .flatten();
    match metadata::registration(&map) {
        Ok(read) => assert_eq!(read, Some(number.expect("only numbers are accepted"))),
        Err(error) => {
            assert_eq!(number, None, "{text:?} refused as a registration");
            assert!(fuzz::explains(&error.to_string()));
        }
    }
}

fn size_examples() -> Vec<String> {
    [
        "20GiB",
        "512MiB",
        "80GB",
        "1.5TiB",
        "4096",
        " 7 gib ",
        "0.25Ki",
        "0",
        "18446744073709551615",
        "16383.99TiB",
        "1e3",
    ]
    .map(String::from)
    .to_vec()
}

fn name_examples() -> Vec<String> {
    [
        "infer-a",
        "node-01",
        "a",
        "x.y",
        &"a".repeat(NAME_LENGTH_MAX),
    ]
    .map(String::from)
    .to_vec()
}

/// The name rule, written out independently of `api::names`.
fn is_dns_label(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let allowed = |c: char| alnum(c) || c == '-' || c == '.';
    !name.is_empty()
        && name.len() <= NAME_LENGTH_MAX
        && name.chars().all(allowed)
        && name.starts_with(alnum)
        && name.ends_with(alnum)
}

fn check_size(text: String) {
    match parse_bytes(&text) {
        Ok(bytes) => {
            let trimmed = text.trim();
            assert!(
                trimmed.starts_with(|c: char| c.is_ascii_digit() || c == '.'),
                "`{text}` was accepted as {bytes} bytes"
            );
            // What we print reads back: within half a hundredth of the unit printed (at most
            // 0.5% of the value), plus the byte that reading a fraction rounds down.
            let shown = format_bytes(bytes);
            let back = parse_bytes(&shown)
                .unwrap_or_else(|error| panic!("{bytes} printed as `{shown}`: {error}"));
            assert!(
                back.abs_diff(bytes) as f64 <= bytes as f64 * 0.005 + 1.0,
                "{bytes} -> `{shown}` -> {back}"
            );
        }
        Err(error) => {
            let message = error.to_string();
            assert!(fuzz::explains(&message), "{message}");
            match &error {
                SizeError::Empty => assert!(text.trim().is_empty()),
                SizeError::Negative(shown)
                | SizeError::Malformed(shown)
                | SizeError::TooLarge(shown)
                | SizeError::UnknownUnit(shown, _) => {
                    assert_eq!(shown, text.trim());
                    assert!(message.contains(shown.as_str()), "{message}");
                }
            }
        }
    }
}

/// A CPU amount read is printed back to the same millicores; a refusal says what to write.
fn check_cpu(text: String) {
    match api::cpu::parse_cpu_milli(&text) {
        Ok(milli) => {
            let shown = api::cpu::format_cpu_milli(milli);
            assert_eq!(api::cpu::parse_cpu_milli(&shown), Ok(milli), "`{text}`");
        }
        Err(error) => {
            let message = error.to_string();
            assert!(fuzz::explains(&message) && message.len() < 300, "{message}");
        }
    }
}

fn check_name(name: String) {
    match api::names::validate("tenant", &name) {
        Ok(()) => assert!(is_dns_label(&name), "`{name}` was accepted"),
        Err(error) => {
            assert!(!is_dns_label(&name), "`{name}` was refused: {error}");
            let message = error.to_string();
            assert!(message.contains("tenant"), "{message}");
            match error {
                NameError::Empty { .. } => assert!(name.is_empty()),
                NameError::TooLong { length, .. } => assert!(length > NAME_LENGTH_MAX),
                NameError::BadCharacter { character, .. } => {
                    assert!(name.contains(character), "{message}")
                }
            }
        }
    }
}

/// The placement-request rules, written out independently of `api::validate`.
fn request_is_valid(request: &PlacementRequest) -> bool {
    let whole = request.whole_gpus;
    let milli = request.milli_gpus;
    let nodes = u64::from(request.nodes.max(1));
    let amount_ok = (whole > 0 && milli == 0) || (whole == 0 && (1..1000).contains(&milli));
    amount_ok
        && request.compute_percent <= 100
        && request.bandwidth_weight <= BANDWIDTH_WEIGHT_MAX
        && (PRIORITY_MIN..=PRIORITY_MAX).contains(&request.priority)
        && (milli == 0 || nodes == 1)
        && nodes * u64::from(whole) <= u64::from(GANG_GPUS_MAX)
        && (0..=3).contains(&request.nvlink)
        && request.node_selector.len() <= SELECTOR_PAIRS_MAX
        && request
            .node_selector
            .iter()
            .all(|(key, value)| !key.is_empty() && key.len() <= 253 && value.len() <= 253)
        && request.memory_bytes_per_gpu <= 1 << 44
        && (request.memory_limit_bytes_per_gpu == 0
            || (request.pin.is_none()
                && request.memory_bytes_per_gpu > 0
                && request.memory_limit_bytes_per_gpu >= request.memory_bytes_per_gpu
                && request.memory_limit_bytes_per_gpu <= 1 << 44))
        && (request.pin.is_some() || request.owner.len() <= 253)
        && request
            .pin
            .as_ref()
            .is_none_or(|pin| pin_is_valid(request, pin))
        && (request.latency_target_us == 0
            || (request.latency && (10..=60_000_000).contains(&request.latency_target_us)))
        && request.cpu_milli <= 16_384_000
        && request.host_memory_bytes <= 1 << 48
        && request.gpu_models.len() <= 16
        && request
            .gpu_models
            .iter()
            .all(|model| !model.is_empty() && model.len() <= 128)
        && request
            .gpu_models
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == request.gpu_models.len()
}

/// The pin rules (issue 18), written out independently of `api::validate`.
fn pin_is_valid(request: &PlacementRequest, pin: &api::v1::Pin) -> bool {
    let asked = if request.milli_gpus > 0 {
        1
    } else {
        request.whole_gpus as usize
    };
    let uuids: std::collections::BTreeSet<&str> =
        pin.gpus.iter().map(|gpu| gpu.uuid.as_str()).collect();
    let kubernetes_name = |text: &str, most: usize| {
        (1..=most).contains(&text.len())
            && text
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    };
    let claim_owner = request
        .owner
        .strip_prefix("k8s:")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(namespace, claim)| {
            kubernetes_name(namespace, 63) && kubernetes_name(claim, 253)
        });
    is_dns_label(&pin.node)
        && (1..=64).contains(&pin.gpus.len())
        && request.nodes <= 1
        && pin.gpus.len() == asked
        && uuids.len() == pin.gpus.len()
        && pin.gpus.iter().all(|gpu| {
            !gpu.uuid.is_empty()
                && gpu.uuid.len() <= 128
                && (1..=100).contains(&gpu.compute_percent)
                && gpu.memory_bytes <= 1 << 44
        })
        && claim_owner
}

fn pinned_gpu() -> impl Strategy<Value = api::v1::PinnedGpu> {
    (
        prop_oneof![
            4 => "GPU-[0-9a-f]{1,2}",
            1 => Just(String::new()),
            1 => Just("u".repeat(129)),
            1 => fuzz::any_text(),
        ],
        edge_u32(),
        prop_oneof![Just(0u64), Just(1 << 44), Just((1 << 44) + 1), any::<u64>()],
    )
        .prop_map(|(uuid, compute_percent, memory_bytes)| api::v1::PinnedGpu {
            uuid,
            compute_percent,
            memory_bytes,
        })
}

fn pin() -> impl Strategy<Value = api::v1::Pin> {
    (
        prop_oneof![3 => "gpu-[0-9]", 1 => Just(String::new()), 1 => fuzz::any_text()],
        prop_oneof![
            8 => proptest::collection::vec(pinned_gpu(), 0..4),
            1 => proptest::collection::vec(pinned_gpu(), 64..=66),
        ],
    )
        .prop_map(|(node, gpus)| api::v1::Pin { node, gpus })
}

fn check_request(request: PlacementRequest) {
    // Whatever admission accepts, the log's rule accepts too.
    if admit_request(&request).is_ok() {
        assert_eq!(validate_request(&request), Ok(()), "{request:?}");
    }
    match admit_request(&request) {
        Ok(()) => {
            assert!(request_is_valid(&request), "accepted {request:?}");
            let bytes = request.encode_to_vec();
            assert_eq!(PlacementRequest::decode(bytes.as_slice()).unwrap(), request);
        }
        Err(error) => {
            assert!(!request_is_valid(&request), "refused {request:?}: {error}");
            let message = error.to_string();
            assert!(fuzz::explains(&message), "{message}");
            if let RequestError::BadSelectorKey(key) = &error {
                assert!(key.is_empty() || key.len() > 253);
            }
        }
    }
}

fn edge_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(1),
        Just(999),
        Just(1000),
        Just(100),
        Just(101),
        Just(4096),
        Just(4097),
        Just(BANDWIDTH_WEIGHT_MAX),
        Just(BANDWIDTH_WEIGHT_MAX + 1),
        Just(u32::MAX),
        0u32..10,
        any::<u32>(),
    ]
}

fn placement_request() -> impl Strategy<Value = PlacementRequest> {
    let selector = proptest::collection::btree_map(
        prop_oneof![
            "[a-z/.]{0,8}",
            Just(String::new()),
            Just("k".repeat(253)),
            Just("k".repeat(254))
        ],
        fuzz::any_text(),
        0..36,
    );
    (
        (
            edge_u32(),
            edge_u32(),
            prop_oneof![
                Just(1u64 << 44),
                Just((1u64 << 44) + 1),
                0u64..=(1 << 44),
                any::<u64>(),
            ],
            edge_u32(),
            any::<bool>(),
        ),
        (
            prop_oneof![
                Just(PRIORITY_MIN),
                Just(PRIORITY_MAX),
                Just(PRIORITY_MAX + 1),
                Just(i32::MIN),
                any::<i32>(),
            ],
            any::<bool>(),
            prop_oneof![-1i32..4, any::<i32>()],
            edge_u32(),
        ),
        (
            selector,
            fuzz::any_text(),
            edge_u32(),
            any::<bool>(),
            prop_oneof![
                Just(0u64),
                Just(9),
                Just(10),
                Just(2_000),
                Just(60_000_000),
                Just(60_000_001),
                any::<u64>(),
            ],
        ),
        (
            prop_oneof![Just(0u64), Just(16_384_000), Just(16_384_001), any::<u64>()],
            prop_oneof![Just(0u64), Just(1 << 48), Just((1 << 48) + 1), any::<u64>()],
            proptest::collection::vec(
                prop_oneof![
                    Just("H100-80GB".to_owned()),
                    Just(String::new()),
                    Just("m".repeat(129)),
                    fuzz::any_text(),
                ],
                0..18,
            ),
            prop_oneof![
                Just(0u64),
                Just(60 << 30),
                Just((1 << 44) + 1),
                any::<u64>()
            ],
        ),
        // A third of requests pin; most of those name a claim as owner (0 and 1: a short and
        // the longest claim owner; else the owner above).
        (proptest::option::weighted(0.3, pin()), 0u8..4),
    )
        .prop_map(
            |(
                (whole_gpus, milli_gpus, memory_bytes_per_gpu, compute_percent, burst),
                (priority, preemptible, nvlink, nodes),
                (node_selector, owner, bandwidth_weight, latency, latency_target_us),
                (cpu_milli, host_memory_bytes, gpu_models, memory_limit_bytes_per_gpu),
                (pin, claim_owner),
            )| PlacementRequest {
                whole_gpus,
                milli_gpus,
                memory_bytes_per_gpu,
                memory_limit_bytes_per_gpu,
                compute_percent,
                burst,
                priority,
                preemptible,
                nvlink,
                nodes,
                node_selector: node_selector.into_iter().collect(),
                owner: match claim_owner {
                    0 => "k8s:ml/train".to_owned(),
                    1 => api::names::claim_owner(&"n".repeat(63), &"c".repeat(253)),
                    _ => owner,
                },
                bandwidth_weight,
                latency,
                latency_target_us,
                cpu_milli,
                host_memory_bytes,
                gpu_models,
                pin,
            },
        )
}

fn check_config_helpers(text: String) {
    if let Err(problem) = config::parse_bool(&text) {
        assert!(problem.contains("`true` or `false`"), "{problem}");
    }
    match config::parse_at_least(1)(&text) {
        Ok(value) => assert!(value >= 1 && text.trim().parse::<u64>() == Ok(value)),
        Err(problem) => assert!(problem.contains("1 or more"), "{problem}"),
    }
    match config::parse_socket_address(&text) {
        Ok(address) => assert_eq!(text.trim().parse(), Ok(address)),
        Err(problem) => assert!(problem.contains("0.0.0.0:7401"), "{problem}"),
    }
    match config::parse_path(&text) {
        Ok(path) => assert!(!path.as_os_str().is_empty()),
        Err(problem) => assert!(problem.contains("empty"), "{problem}"),
    }
    for item in config::split_list(&text) {
        assert!(!item.is_empty() && !item.contains(',') && item == item.trim());
    }
    // A variable goes through the same parsers, and its error names the variable and value.
    let env = BTreeMap::from([("VGPU_FUZZ_X".to_owned(), text)]);
    let key = config::KeyDoc {
        key: "x",
        env: "VGPU_FUZZ_X",
        env_aliases: &[],
        flag: None,
        default: "1",
        example: "1",
    };
    if let Err(error) = config::from_env(&env, &key, config::parse_at_least(1)) {
        let message = error.to_string();
        assert!(message.contains("VGPU_FUZZ_X=`"), "{message}");
    }
}

/// A settings struct shaped like the binaries' (optional fields, unknown keys refused).
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Sample {
    count: Option<u64>,
    flag: Option<bool>,
    name: Option<String>,
    list: Option<Vec<String>>,
    table: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "listen")]
    listen: Option<std::net::SocketAddr>,
}

fn listen<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<std::net::SocketAddr>, D::Error> {
    config::parse_with(deserializer, config::parse_socket_address)
}

fn sample_keys() -> Vec<String> {
    ["count", "flag", "name", "list", "table", "listen"]
        .map(String::from)
        .to_vec()
}

fn sample_files() -> Vec<String> {
    vec![
        "count = 3\nflag = true\nname = \"a\"\nlist = [\"a\", \"b\"]\ntable = { k = \"v\" }\nlisten = \"0.0.0.0:7401\"\n".to_owned(),
        "# a comment\n[table]\nk = \"v\"\n".to_owned(),
        String::new(),
    ]
}

fn check_config_file(text: String) {
    let path = Path::new("/etc/vgpu/fuzz.toml");
    match config::parse::<Sample>(path, &text) {
        Ok(_) => {}
        Err(ConfigError::Parse {
            path: named,
            message,
        }) => {
            assert_eq!(named, path);
            assert!(!message.trim().is_empty());
        }
        Err(other) => panic!("parse gave {other:?}"),
    }
}

/// A registration is admitted only with every field within its bound, and a refusal's message
/// stays short whatever it quotes.
fn check_node(node: api::v1::Node) {
    use api::validate::*;
    match admit_node(Some(&node)) {
        Ok(()) => {
            assert!(node.encoded_len() <= REGISTER_BYTES_MAX);
            assert!(node.address.len() <= NODE_ADDRESS_TEXT_MAX);
            assert!(node.labels.len() <= NODE_LABELS_MAX);
            assert!(node.gpus.len() <= NODE_GPUS_MAX);
            assert!(node.cpu_milli <= CPU_MILLI_MAX);
            assert!(node.host_memory_bytes <= HOST_MEMORY_BYTES_MAX);
            for gpu in &node.gpus {
                assert!(gpu.uuid.len() <= GPU_TEXT_MAX && gpu.model.len() <= GPU_TEXT_MAX);
                assert!(gpu.pci_bus_id.len() <= PCI_BUS_ID_TEXT_MAX);
                assert!(gpu.nearest_nics.len() <= GPU_NICS_MAX);
                assert!(gpu.nvlink_peers.len() <= NODE_GPUS_MAX);
            }
        }
        Err(error) => assert!(error.to_string().len() < 400, "{error}"),
    }
}

fn registration() -> impl Strategy<Value = api::v1::Node> {
    let text = || prop_oneof![fuzz::any_text(), (0usize..600).prop_map(|n| "x".repeat(n))];
    let gpu = (
        text(),
        text(),
        text(),
        proptest::collection::vec(text(), 0..20),
        0usize..70,
    )
        .prop_map(
            |(uuid, model, pci_bus_id, nearest_nics, peers)| api::v1::Gpu {
                uuid,
                model,
                pci_bus_id,
                nearest_nics,
                memory_bytes: 80 << 30,
                nvlink_peers: (0..peers as u32)
                    .map(|gpu_index| api::v1::NvlinkPeer {
                        gpu_index: gpu_index % 66,
                        link_count: gpu_index,
                    })
                    .collect(),
                ..Default::default()
            },
        );
    (
        text(),
        proptest::collection::btree_map(text(), text(), 0..70),
        proptest::collection::vec(gpu, 0..70),
        prop_oneof![Just(0u64), Just(16_384_001), any::<u64>()],
        prop_oneof![Just(0u64), Just((1 << 48) + 1), any::<u64>()],
    )
        .prop_map(
            |(address, labels, gpus, cpu_milli, host_memory_bytes)| api::v1::Node {
                name: "node-a".into(),
                address,
                labels: labels.into_iter().collect(),
                gpus,
                cpu_milli,
                host_memory_bytes,
                ..Default::default()
            },
        )
}

fn check_error_code(message: String) {
    let status = tonic::Status::invalid_argument(message.clone());
    if let Some(code) = api::ErrorCode::of(&status) {
        assert!(message.starts_with(&format!("[{}]", code.as_str())));
    }
    let made = api::ErrorCode::Unplaceable.status(&message);
    assert_eq!(api::ErrorCode::of(&made), Some(api::ErrorCode::Unplaceable));
    assert!(made.message().len() <= api::codes::STATUS_MESSAGE_BYTES_MAX);
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn size_strings(text in fuzz::hostile(size_examples())) {
        fuzz::bounded(text, check_size);
    }

    #[test]
    fn cpu_amounts(text in fuzz::hostile(["8", "2.5", "0.125", "500m", "0", ".5"].map(String::from).to_vec())) {
        fuzz::bounded(text, check_cpu);
    }

    #[test]
    fn sizes_print_as_sizes_that_read_back(bytes in prop_oneof![
        any::<u64>(),
        (0u32..64).prop_map(|shift| 1u64 << shift),
        (0u64..1 << 20).prop_map(|below| u64::MAX - below),
    ]) {
        fuzz::bounded(bytes.to_string(), check_size);
        let shown = format_bytes(bytes);
        fuzz::bounded(shown, check_size);
    }

    #[test]
    fn names(name in fuzz::hostile(name_examples())) {
        fuzz::bounded(name, check_name);
    }

    #[test]
    fn placement_requests(request in placement_request()) {
        fuzz::bounded(request, check_request);
    }

    #[test]
    fn placement_requests_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzz::bounded(bytes, |bytes| {
            if let Ok(request) = PlacementRequest::decode(bytes.as_slice()) {
                check_request(request);
            }
        });
    }

    #[test]
    fn placement_requests_from_mutated_encodings(
        request in placement_request(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = request.encode_to_vec();
        for (at, byte) in flips {
            if !bytes.is_empty() {
                let at = at % bytes.len();
                bytes[at] ^= byte;
            }
        }
        fuzz::bounded(bytes, |bytes| {
            if let Ok(request) = PlacementRequest::decode(bytes.as_slice()) {
                check_request(request);
            }
        });
    }

    #[test]
    fn registrations(node in registration()) {
        fuzz::bounded(node, check_node);
    }

    #[test]
    fn registrations_from_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzz::bounded(bytes, |bytes| {
            if let Ok(node) = api::v1::Node::decode(bytes.as_slice()) {
                check_node(node);
            }
        });
    }

    /// Node keys and registration numbers as call metadata (issue 22, point 5): any value that
    /// is valid metadata text is either the rule's (64 lowercase hex digits; decimal digits that
    /// fit a `u64`) or refused with a message that names the metadata.
    #[test]
    fn node_identity_metadata(text in fuzz::hostile(vec![
        "0123456789abcdef".repeat(4), "f".repeat(64), "A".repeat(64), "0".into(),
        "18446744073709551615".into(), "18446744073709551616".into(), "-1".into(),
    ])) {
        fuzz::bounded(text, check_identity_metadata);
    }

    #[test]
    fn configuration_values(text in fuzz::hostile(vec![
        "true".into(), "off".into(), "0.0.0.0:7401".into(), "[::1]:1".into(), "5000".into(),
        "a, b,,c".into(), "/var/lib/vgpu".into(), "{ k = \"v\", x = 1 }".into(), "[\"a\"]".into(),
    ])) {
        fuzz::bounded(text, check_config_helpers);
    }

    #[test]
    fn configuration_files(text in prop_oneof![
        fuzz::hostile(sample_files()),
        fuzz::toml_document(sample_keys(), vec!["0.0.0.0:7401".into(), "a".into()]),
    ]) {
        fuzz::bounded(text, check_config_file);
    }

    #[test]
    fn error_codes_in_status_messages(message in fuzz::hostile(vec![
        "[VGPU-INVALID-ARGUMENT] bad".into(), "[VGPU-UNPLACEABLE]".into(), "[]".into(),
    ])) {
        fuzz::bounded(message, check_error_code);
    }
}

/// Found by `sizes_print_as_sizes_that_read_back`: sizes within half a hundredth of a TiB of
/// 16 EiB printed as `16777216TiB`, which is 2^64 bytes and does not read back.
#[test]
fn regression_the_largest_sizes_print_as_sizes_that_read_back() {
    for bytes in [u64::MAX, u64::MAX - (1 << 30), u64::MAX - (1 << 20)] {
        let shown = format_bytes(bytes);
        let back = parse_bytes(&shown).unwrap_or_else(|error| panic!("`{shown}`: {error}"));
        assert!(back.abs_diff(bytes) as f64 <= bytes as f64 * 0.005);
    }
}
