//! Fuzz targets for what `vgpu-agent` reads from outside: `--simulate` specs
//! (`8xH100-80GB`), topology files (TOML and JSON), and its configuration file and variables.
//! Each must never panic, never hang, and either accept (an inventory that keeps its
//! invariants, reads back, and the control plane would take) or refuse with a message that
//! names the problem. `VGPU_FUZZ_CASES` sets the cases per target; `docs/fuzzing.md` says more.

use fuzzkit as fuzz;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use api::config::KeyDoc;
use proptest::prelude::*;
use vgpu_agent::config::{KEYS, Settings};
use vgpu_agent::inventory::simulated::SimulatedSpec;
use vgpu_agent::inventory::topology::{self, TopologyFile};
use vgpu_agent::inventory::{Inventory, InventorySource, MAX_GPUS_PER_NODE};

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

fn spec_examples() -> Vec<String> {
    [
        "8xH100-80GB",
        "4xH200-141GB",
        "2xL40S-48GB",
        "1xl4-24gb",
        "2xH100-PCIE-80GB",
        "64xA100-40GB",
        "2xB200-192GB",
        "16384xX-16384GB",
    ]
    .map(String::from)
    .to_vec()
}

/// What every accepted inventory must be, whatever its source: consistent, bounded as the
/// control plane requires, printable, and the same after a JSON round trip (the output of
/// `vgpu-agent inventory -o json` is itself a topology file).
fn check_inventory(inventory: &Inventory) {
    inventory.assert_consistent();
    assert!(inventory.gpus.len() <= MAX_GPUS_PER_NODE);
    let mut uuids = std::collections::BTreeSet::new();
    for gpu in &inventory.gpus {
        assert!(!gpu.uuid.is_empty() && uuids.insert(gpu.uuid.clone()));
        assert!(
            gpu.memory_bytes > 0 && gpu.memory_bytes <= api::validate::GPU_MEMORY_BYTES_MAX,
            "GPU {} has {} bytes",
            gpu.index,
            gpu.memory_bytes
        );
    }
    let text = inventory.to_text();
    assert!(text.starts_with(&format!("node {}:", inventory.node)));
    let _ = inventory.to_proto("10.0.0.1:7500", &BTreeMap::new());
    let json = serde_json::to_string(inventory).unwrap();
    let file: TopologyFile = serde_json::from_str(&json).unwrap();
    let (read_back, _) = topology::build(file, &inventory.node)
        .unwrap_or_else(|problem| panic!("the inventory does not read back: {problem}\n{json}"));
    assert_eq!(read_back.gpus, inventory.gpus);
}

fn check_spec(text: String) {
    match SimulatedSpec::parse(&text) {
        Ok(spec) => {
            assert!((1..=MAX_GPUS_PER_NODE as u32).contains(&spec.count));
            assert_eq!(spec.model, spec.model.to_ascii_uppercase());
            // The spec as the agent reports it reads back as the same spec.
            let again = SimulatedSpec::parse(&format!("{}x{}", spec.count, spec.model))
                .unwrap_or_else(|error| panic!("`{text}` -> {spec:?}: {error}"));
            assert_eq!(again, spec);
            check_inventory(&spec.inventory("node-a"));
        }
        Err(error) => {
            let message = error.to_string();
            assert!(fuzz::explains(&message), "{message}");
            assert!(message.contains(text.trim()), "`{text}`: {message}");
        }
    }
    match InventorySource::from_simulate_arg(&text) {
        Ok(InventorySource::Simulated(spec)) => assert!(spec.count >= 1),
        Ok(InventorySource::TopologyFile(path)) => {
            assert!(vgpu_agent::inventory::is_topology_path(&path))
        }
        Ok(InventorySource::Nvml) => panic!("a spec never means NVML"),
        Err(error) => assert!(fuzz::explains(&error.to_string()), "{error}"),
    }
}

// ------------------------------------------------------------------------------------------
// Topology files.

fn topology_examples() -> Vec<String> {
    let mut examples: Vec<String> = ["two-islands-8xH100.toml", "mixed-a100-pairs-and-l4.json"]
        .iter()
        .map(|name| std::fs::read_to_string(examples_dir().join(name)).unwrap())
        .collect();
    let inventory = InventorySource::from_simulate_arg("4xH100-80GB")
        .unwrap()
        .discover("node-a")
        .unwrap();
    examples.push(serde_json::to_string_pretty(&inventory).unwrap());
    examples
}

const GPU_KEYS: &[&str] = &[
    "index",
    "model",
    "memory",
    "memory_bytes",
    "sm_count",
    "numa_node",
    "pci_bus_id",
    "nics",
    "nearest_nics",
    "nvlink_peers",
    "uuid",
    "device_minor",
    "unknown",
];

/// A TOML topology built from parts: `[[gpus]]` tables whose keys get values of any type (and
/// mostly plausible ones), with or without `[nvlink]` islands.
fn topology_toml() -> impl Strategy<Value = String> {
    let texts: Vec<String> = [
        "H100-80GB",
        "80GiB",
        "0000:18:00.0",
        "mlx5_0",
        "GPU-1",
        "1GiB",
    ]
    .map(String::from)
    .to_vec();
    let plausible = prop_oneof![
        (0u32..6).prop_map(|n| n.to_string()),
        Just("\"H100-80GB\"".to_owned()),
        Just("\"80GiB\"".to_owned()),
        Just("85899345920".to_owned()),
        Just("18446744073709551615".to_owned()),
        Just("9223372036854775807".to_owned()),
        Just("[{ gpu = 1, links = 18 }]".to_owned()),
        Just("[{ gpu = 0, links = 4 }, { gpu = 2, links = 4 }]".to_owned()),
        Just("[\"mlx5_0\"]".to_owned()),
    ];
    let value = prop_oneof![3 => plausible, 1 => fuzz::toml_value(texts)];
    let entry = proptest::collection::vec((proptest::sample::select(GPU_KEYS), value), 1..8)
        .prop_map(|pairs| {
            let mut table = "[[gpus]]\n".to_owned();
            let mut seen = std::collections::BTreeSet::new();
            for (key, value) in pairs {
                if seen.insert(key) {
                    table.push_str(&format!("{key} = {value}\n"));
                }
            }
            table
        });
    let islands = prop_oneof![
        Just(String::new()),
        (
            proptest::collection::vec(proptest::collection::vec(0u32..6, 0..5), 0..3),
            prop_oneof![Just(0u32), Just(18), any::<u32>()],
        )
            .prop_map(|(islands, links)| {
                format!("[nvlink]\nislands = {islands:?}\nlinks_per_pair = {links}\n")
            }),
    ];
    (islands, proptest::collection::vec(entry, 0..6))
        .prop_map(|(islands, entries)| islands + &entries.concat())
}

/// A JSON topology built from parts, like [`topology_toml`].
fn topology_json() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        (0i64..6).prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
    ];
    let text = fuzz::hostile(vec!["H100-80GB".into(), "80GiB".into(), "GPU-1".into()])
        .prop_map(serde_json::Value::from);
    let value = prop_oneof![number, text, Just(serde_json::Value::Null)];
    let entry = proptest::collection::btree_map(proptest::sample::select(GPU_KEYS), value, 1..8)
        .prop_map(|map| {
            serde_json::Value::Object(map.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
        });
    proptest::collection::vec(entry, 0..6)
        .prop_map(|gpus| serde_json::json!({ "node": "node-a", "gpus": gpus }).to_string())
}

/// Parses `text` as the file type `extension`, builds the inventory, and checks the outcome;
/// every few cases also through a real file, as the agent reads it.
fn check_topology((text, extension): (String, &'static str)) {
    let parsed: Result<TopologyFile, String> = match extension {
        "toml" => toml::from_str(&text).map_err(|error| error.to_string()),
        _ => serde_json::from_str(&text).map_err(|error| error.to_string()),
    };
    let from_text = match parsed {
        Ok(file) => match topology::build(file, "node-a") {
            Ok((inventory, warnings)) => {
                check_inventory(&inventory);
                for warning in &warnings {
                    assert!(fuzz::explains(warning), "{warning}");
                }
                Some(inventory)
            }
            Err(problem) => {
                assert!(fuzz::explains(&problem.to_string()), "{problem}");
                None
            }
        },
        Err(message) => {
            assert!(!message.trim().is_empty());
            None
        }
    };
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join(format!("layout.{extension}"));
    std::fs::write(&path, &text).unwrap();
    match topology::load(&path, "node-a") {
        Ok((inventory, _)) => assert_eq!(Some(inventory), from_text),
        Err(error) => {
            assert!(from_text.is_none(), "{error}");
            let message = error.to_string();
            assert!(message.contains("layout."), "{message}");
        }
    }
}

// ------------------------------------------------------------------------------------------
// The configuration file and variables.

fn config_examples() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let example = std::fs::read_to_string(root.join("deploy/config/vgpu-agent.toml")).unwrap();
    vec![
        api::config::check::uncomment_keys(&example, KEYS),
        api::config::check::all_examples_as_toml(KEYS),
        "control_plane = [\"a:1\"]\nname = \"n\"\nsimulate = \"2xL40S-48GB\"\nlabels = { zone = \"a\" }\n".to_owned(),
        "labels = { zone = \"a\", \"rack\" = \"r1\" }\n".to_owned(),
        example,
    ]
}

fn value_examples() -> Vec<String> {
    let mut values: Vec<String> = KEYS.iter().map(|key| key.example_for_env()).collect();
    values.extend(
        [
            "node-a",
            "8xH100-80GB",
            "x.toml",
            "zone=a, rack=r1",
            "a=b=c",
            " k = v ",
        ]
        .map(String::from),
    );
    values
}

/// What `join` runs with, from `settings`: must not panic, and what it accepts must hold.
/// The state and CDI directories are set to a temporary directory, since `join` would otherwise
/// probe (and create) `/var/lib/vgpu-agent` and `/var/run/cdi`.
fn check_join(settings: Settings, directory: &Path) {
    let flags = Settings {
        state_dir: Some(directory.join("state")),
        cdi_dir: Some(directory.join("cdi")),
        ..Settings::default()
    };
    // A control plane when none is given, so that most cases get past that check.
    let defaults = Settings {
        control_plane: Some(vec!["cp1:7401".to_owned()]),
        ..Settings::default()
    };
    let settings = vgpu_agent::config::merge(flags, vgpu_agent::config::merge(settings, defaults));
    match settings.join(Some(Path::new("/etc/vgpu/vgpu-agent.toml")), None) {
        Ok(join) => {
            assert!(!join.control_plane.is_empty());
            api::names::validate("node", &join.name).unwrap();
            for (key, value) in &join.labels {
                // What registers is what a `--labels KEY=VALUE` flag would give.
                let parsed = vgpu_agent::parse_label(&format!("{key}={value}")).unwrap();
                assert_eq!(parsed, (key.clone(), value.clone()), "label `{key}`");
            }
        }
        Err(error) => assert!(fuzz::explains(&error.to_string()), "{error}"),
    }
}

fn check_config_file(text: String) {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("vgpu-agent.toml");
    std::fs::write(&path, &text).unwrap();
    let env = BTreeMap::new();
    match vgpu_agent::config::load(Settings::default(), Some(&path), &env) {
        Ok((settings, read)) => {
            assert_eq!(read.as_deref(), Some(path.as_path()));
            if let Some(name) = &settings.name {
                api::names::validate("node", name).unwrap();
            }
            check_join(settings, directory.path());
        }
        Err(error) => {
            let message = error.to_string();
            assert!(message.contains("vgpu-agent.toml"), "{message}");
        }
    }
}

fn check_config_env(env: BTreeMap<String, String>) {
    let directory = tempfile::tempdir().unwrap();
    match Settings::from_env(&env) {
        Ok(settings) => check_join(settings, directory.path()),
        Err(error) => {
            let message = error.to_string();
            assert!(message.contains("VGPU_"), "{message}");
        }
    }
}

fn environment() -> impl Strategy<Value = BTreeMap<String, String>> {
    fuzz::environment(KEYS.iter().flat_map(KeyDoc::env_names), value_examples(), 8)
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn simulate_specs(text in fuzz::hostile(spec_examples())) {
        fuzz::bounded(text, check_spec);
    }

    #[test]
    fn topology_files_toml(text in prop_oneof![
        1 => fuzz::hostile(topology_examples()),
        2 => topology_toml(),
    ]) {
        fuzz::bounded((text, "toml"), check_topology);
    }

    #[test]
    fn topology_files_json(text in prop_oneof![
        1 => fuzz::hostile(topology_examples()),
        2 => topology_json(),
    ]) {
        fuzz::bounded((text, "json"), check_topology);
    }

    #[test]
    fn configuration_files(text in prop_oneof![
        fuzz::hostile(config_examples()),
        fuzz::toml_document(KEYS.iter().map(|key| key.key.to_owned()).collect(), value_examples()),
    ]) {
        fuzz::bounded(text, check_config_file);
    }

    #[test]
    fn configuration_variables(env in environment()) {
        fuzz::bounded(env, check_config_env);
    }
}

// ------------------------------------------------------------------------------------------
// Regressions: inputs the targets found, kept as they were.

/// Found by `simulate_specs`: a model with a leading newline (`64x\n100-40GB`, and so also the
/// typo `8x H100-80GB`) was accepted as an unknown product with 0 SMs and no NVLink.
#[test]
fn regression_a_spec_model_with_whitespace_is_refused() {
    for spec in [
        "64x\n100-40GB",
        "8x H100-80GB",
        "8xH100 -80GB",
        "2xH\u{0}100-80GB",
    ] {
        let error = SimulatedSpec::parse(spec).unwrap_err().to_string();
        assert!(error.starts_with("cannot read the GPU spec"), "{error}");
        check_spec(spec.to_owned());
    }
}

/// Found while fuzzing the control plane's `Register` (the same sum overflowed there): a
/// topology file with two GPUs of `18446744073709551615` bytes was accepted, and
/// `vgpu-agent inventory` then overflowed summing the memory (a panic in debug builds). A GPU
/// past the control plane's limit (16 TiB) is now refused where it is read, by specs and
/// topology files alike.
#[test]
fn regression_gpu_memory_past_the_limit_is_refused() {
    let text = r#"{"gpus": [
        {"index": 0, "model": "X", "memory": 18446744073709551615},
        {"index": 1, "model": "X", "memory": 18446744073709551615}
    ]}"#;
    let file: TopologyFile = serde_json::from_str(text).unwrap();
    let problem = topology::build(file, "node-a").unwrap_err().to_string();
    assert!(problem.contains("the limit is"), "{problem}");
    check_topology((text.to_owned(), "json"));
    assert!(SimulatedSpec::parse("1xX-16384GB").is_ok());
    let error = SimulatedSpec::parse("1xX-16385GB").unwrap_err().to_string();
    assert!(error.contains("at most 16384"), "{error}");
}

/// Found by the label check of `configuration_files`, on a hand-written input (its generator
/// reaches such keys only rarely): a label
/// key of the file with spaces around it (`" zone "`) or an `=` in it was registered as
/// written, so that no selector (`zone=a`) could ever match it. Such labels are now refused,
/// as `--labels` and `VGPU_AGENT_LABELS` refuse them.
#[test]
fn regression_file_labels_read_as_the_flag_reads_them() {
    for text in [
        "labels = { \" zone \" = \"a\" }\n",
        "labels = { \"a=b\" = \"c\" }\n",
        "labels = { zone = \" a \" }\n",
    ] {
        check_config_file(text.to_owned());
        let settings: Settings = api::config::parse(Path::new("x.toml"), text).unwrap();
        let directory = tempfile::tempdir().unwrap();
        let flags = Settings {
            control_plane: Some(vec!["cp1:7401".to_owned()]),
            state_dir: Some(directory.path().join("state")),
            cdi: Some(false),
            ..Settings::default()
        };
        let error = vgpu_agent::config::merge(flags, settings)
            .join(None, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("KEY=VALUE"), "{error}");
    }
}
