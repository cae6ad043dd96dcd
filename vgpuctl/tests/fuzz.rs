//! Fuzz targets for what `vgpuctl` reads from outside: its command line (every value parser
//! and whole argument lists), its configuration file and its variables. Each must never panic,
//! never hang, and either accept (a value that keeps the documented rule) or refuse with a
//! message that names the problem. `VGPU_FUZZ_CASES` sets the cases per target;
//! `docs/fuzzing.md` says more.

use fuzzkit as fuzz;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use api::config::KeyDoc;
use clap::Parser as _;
use proptest::prelude::*;
use vgpuctl::cli::{self, Cli, GpuAmount};
use vgpuctl::config::{KEYS, Settings};

fn value_examples() -> Vec<String> {
    [
        "2",
        "0.25",
        "0.125",
        "1.0",
        "20GiB",
        "25%",
        "100",
        "-1000",
        "1000",
        "4",
        "zone=a,gpu=h100",
        "127.0.0.1:7401",
        "http://cp1:7401/",
        "[::1]:7401",
        "10s",
        "500ms",
        "2m",
        "1000000",
        "infer-a",
        "node-01",
        "0.0000000001s",
        "500us",
        "1.5ms",
        "0.002s",
        "60s",
        "9us",
        "1.0000005ms",
        "default",
        "2.5",
        "500m",
        "H100-80GB",
    ]
    .map(String::from)
    .to_vec()
}

/// Every value parser of the command line on one text: accepted values keep their rule.
fn check_values(text: String) {
    let explained = |problem: &String| assert!(fuzz::explains(problem), "{problem}");
    match cli::parse_gpus(&text) {
        Ok(GpuAmount::Whole(whole)) => assert!(whole >= 1),
        Ok(GpuAmount::Milli(milli)) => assert!((1..1000).contains(&milli)),
        Err(problem) => explained(&problem),
    }
    match cli::parse_memory(&text) {
        Ok(bytes) => assert_eq!(api::size::parse_bytes(&text), Ok(bytes)),
        Err(problem) => explained(&problem),
    }
    match cli::parse_compute(&text) {
        Ok(percent) => assert!((1..=100).contains(&percent)),
        Err(problem) => explained(&problem),
    }
    match cli::parse_cpu(&text) {
        Ok(milli) => {
            assert!(milli > 0, "`{text}`");
            let shown = api::cpu::format_cpu_milli(milli);
            assert_eq!(api::cpu::parse_cpu_milli(&shown), Ok(milli), "`{text}`");
        }
        Err(problem) => explained(&problem),
    }
    match cli::parse_gpu_model(&text) {
        Ok(model) => assert!(!model.is_empty() && model == model.trim(), "`{text}`"),
        Err(problem) => explained(&problem),
    }
    match cli::parse_bandwidth(&text) {
        Ok(weight) => assert!((1..=api::validate::BANDWIDTH_WEIGHT_MAX).contains(&weight)),
        Err(problem) => explained(&problem),
    }
    match cli::parse_latency_target(&text) {
        Ok(microseconds) => {
            assert!(
                (api::validate::LATENCY_TARGET_US_MIN..=api::validate::LATENCY_TARGET_US_MAX)
                    .contains(&microseconds),
                "`{text}` -> {microseconds}"
            );
            // What was accepted is exact: written back, it reads as the same number.
            let written = vgpuctl::output::format_latency(microseconds);
            assert_eq!(cli::parse_latency_target(&written), Ok(microseconds));
        }
        Err(problem) => explained(&problem),
    }
    match cli::parse_latency_target_setting(&text) {
        // 0 removes the target; anything else is a target `--latency-target` accepts.
        Ok(0) => assert!(matches!(text.trim(), "default" | "none"), "`{text}`"),
        Ok(microseconds) => assert_eq!(cli::parse_latency_target(&text), Ok(microseconds)),
        Err(problem) => explained(&problem),
    }
    match cli::parse_priority(&text) {
        Ok(priority) => {
            assert!((api::validate::PRIORITY_MIN..=api::validate::PRIORITY_MAX).contains(&priority))
        }
        Err(problem) => explained(&problem),
    }
    match cli::parse_nodes(&text) {
        Ok(nodes) => assert!(nodes >= 1),
        Err(problem) => explained(&problem),
    }
    match cli::parse_selector(&text) {
        Ok(pairs) => {
            assert!(!pairs.is_empty());
            for (key, value) in &pairs {
                assert!(!key.is_empty() && key.trim() == key && value.trim() == value);
                assert!(!key.contains([',', '=']) && !value.contains(','));
            }
        }
        Err(problem) => explained(&problem),
    }
    match cli::parse_endpoint(&text) {
        Ok(endpoint) => {
            assert!(!endpoint.is_empty() && !endpoint.contains(char::is_whitespace));
            // What was accepted reads back as itself.
            assert_eq!(cli::parse_endpoint(&endpoint).as_ref(), Ok(&endpoint));
        }
        Err(problem) => explained(&problem),
    }
    match cli::parse_duration(&text) {
        Ok(duration) => {
            // "More than 0 and at most a day", as the message for a refused one says.
            assert!(
                !duration.is_zero() && duration <= Duration::from_secs(86_400),
                "`{text}` -> {duration:?}"
            );
        }
        Err(problem) => explained(&problem),
    }
}

/// A whole command line: clap with every parser behind it must answer, not panic.
fn check_arguments(arguments: Vec<String>) {
    let argv = std::iter::once("vgpuctl".to_owned()).chain(arguments);
    match Cli::try_parse_from(argv) {
        Ok(cli) => {
            let _ = Settings::from_flags(&cli);
        }
        Err(error) => {
            let _ = error.render().to_string();
        }
    }
}

fn arguments() -> impl Strategy<Value = Vec<String>> {
    let words: Vec<String> = [
        "place",
        "set",
        "release",
        "get",
        "tenants",
        "nodes",
        "tenant",
        "node",
        "describe",
        "drain",
        "uncordon",
        "cluster",
        "status",
        "add-member",
        "--gpus",
        "--memory",
        "--compute",
        "--priority",
        "--nodes",
        "--selector",
        "--owner",
        "--bandwidth",
        "--latency",
        "--latency-target",
        "--endpoints",
        "--timeout",
        "--output",
        "json",
        "--stale",
        "--burst",
        "--preemptible",
        "--nvlink",
        "require",
        "--insecure",
        "--config",
        "-o",
        "--",
    ]
    .map(String::from)
    .to_vec();
    proptest::collection::vec(
        prop_oneof![
            3 => proptest::sample::select(words),
            2 => fuzz::hostile(value_examples()),
        ],
        0..8,
    )
}

fn config_examples() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = std::fs::read_to_string(root.join("deploy/config/vgpuctl.toml")).unwrap();
    vec![
        api::config::check::uncomment_keys(&example, KEYS),
        api::config::check::all_examples_as_toml(KEYS),
        example,
    ]
}

fn check_resolved(settings: Settings) {
    match settings.resolve() {
        Ok(resolved) => {
            assert!(!resolved.endpoints.is_empty());
            assert!(!resolved.timeout.is_zero());
        }
        Err(error) => assert!(fuzz::explains(&error.to_string()), "{error}"),
    }
}

fn check_config_file(text: String) {
    match api::config::parse::<Settings>(Path::new("/home/u/.config/vgpu/vgpuctl.toml"), &text) {
        Ok(settings) => check_resolved(settings),
        Err(error) => {
            let message = error.to_string();
            assert!(message.contains("vgpuctl.toml"), "{message}");
        }
    }
}

fn check_config_env(env: BTreeMap<String, String>) {
    match Settings::from_env(&env) {
        Ok(settings) => check_resolved(settings),
        Err(error) => {
            let message = error.to_string();
            assert!(message.contains("VGPU"), "{message}");
        }
    }
}

fn environment() -> impl Strategy<Value = BTreeMap<String, String>> {
    let mut values: Vec<String> = KEYS.iter().map(|key| key.example_for_env()).collect();
    values.extend(value_examples());
    fuzz::environment(KEYS.iter().flat_map(KeyDoc::env_names), values, 6)
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn command_line_values(text in fuzz::hostile(value_examples())) {
        fuzz::bounded(text, check_values);
    }

    #[test]
    fn command_lines(arguments in arguments()) {
        fuzz::bounded(arguments, check_arguments);
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

/// Found by `command_line_values`: `[::1]::@740740` was accepted as the endpoint
/// `[::1]::@740740:7401`, whose host is `740740` (`[::1]::` is user information of the URI),
/// and (in the 100,000-case run) `[::1]7401` as `[::1]7401:7401`; neither read back.
#[test]
fn regression_malformed_endpoints_are_refused() {
    for text in [
        "[::1]::@740740",
        "user@cp1:7401",
        "cp1:7401?x",
        "cp1:7401#x",
        "[::1]7401",
        "[cp1]:7401",
        "cp]1:7401",
    ] {
        let problem = cli::parse_endpoint(text).unwrap_err();
        assert!(problem.contains("write `host:port`"), "{problem}");
        check_values(text.to_owned());
    }
}

/// Found by `command_line_values` (once a sub-nanosecond example was among its seeds):
/// `--timeout 0.0000000001s` passed the "more than 0" check as seconds but became a zero
/// `Duration`, so every call would time out at once.
#[test]
fn regression_a_duration_below_a_nanosecond_is_refused() {
    for text in ["0.0000000001s", "0.0000001ms"] {
        let problem = cli::parse_duration(text).unwrap_err();
        assert!(problem.contains("more than 0"), "{problem}");
    }
    assert_eq!(
        cli::parse_duration("0.000000001s"),
        Ok(Duration::from_nanos(1))
    );
}
