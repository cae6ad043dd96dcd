//! What every crate's `tests/fuzz.rs` shares (a dev-dependency of each; test files of different
//! crates cannot import each other): the case count, a hang bound, and generators of hostile text
//! (arbitrary strings, mutated valid examples, TOML documents over known keys).
//!
//! The fuzz targets are property tests: a parser of outside input must never panic, must finish
//! within [`CASE_TIME_MAX`], and must either accept (and then the result round-trips or holds its
//! invariants) or refuse with a typed error whose message names the problem. `docs/fuzzing.md`
//! says how to run them longer.

use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::BTreeMap;
use std::time::Duration;

/// Cases per target when `VGPU_FUZZ_CASES` is unset: what CI runs (seconds for all targets).
pub const CASES_DEFAULT: u32 = 256;
/// The longest one input may take before it counts as a hang. Generous, so that a loaded CI
/// machine does not fail; a real hang (a loop on some input) blows through any bound.
pub const CASE_TIME_MAX: Duration = Duration::from_secs(10);

/// Cases per target: `VGPU_FUZZ_CASES`, else [`CASES_DEFAULT`].
pub fn cases() -> u32 {
    std::env::var("VGPU_FUZZ_CASES")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .filter(|&cases| cases > 0)
        .unwrap_or(CASES_DEFAULT)
}

/// The proptest configuration of every fuzz target. Failures are not written to
/// `proptest-regressions/` files: each bug a target found is kept as a named regression test
/// beside the targets instead, where it says what it was.
pub fn config() -> Config {
    Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..Config::default()
    }
}

/// Runs `check(input)` on its own thread and fails if it takes longer than [`CASE_TIME_MAX`]
/// (a hang); a panic inside `check` is re-raised here, so proptest shrinks and reports it.
pub fn bounded<I, O>(input: I, check: impl FnOnce(I) -> O + Send + 'static) -> O
where
    I: Send + 'static,
    O: Send + 'static,
{
    let (sender, receiver) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let output = check(input);
        let _ = sender.send(output);
    });
    match receiver.recv_timeout(CASE_TIME_MAX) {
        Ok(output) => {
            worker.join().expect("the worker finished");
            output
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("an input took longer than {CASE_TIME_MAX:?}: a hang")
        }
    }
}

/// Characters that parsers of our formats treat specially, plus a few odd ones.
const SPECIAL: &[char] = &[
    '"',
    '\'',
    '[',
    ']',
    '{',
    '}',
    '=',
    ',',
    '.',
    '-',
    '+',
    '#',
    ':',
    '/',
    '\\',
    '\n',
    '\r',
    '\t',
    ' ',
    'x',
    'X',
    '0',
    '1',
    '9',
    'e',
    'E',
    '_',
    'G',
    'i',
    'B',
    '\0',
    '\u{7f}',
    '\u{a0}',
    '\u{2028}',
    '\u{feff}',
    'ü',
    '€',
    '\u{10ffff}',
];

/// One character: mostly special ones, sometimes anything.
pub fn any_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => proptest::sample::select(SPECIAL),
        1 => any::<char>(),
    ]
}

/// Arbitrary text: any Unicode, short runs of special characters, and lossily decoded bytes.
pub fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(any_char(), 0..48).prop_map(|chars| chars.into_iter().collect()),
        proptest::collection::vec(any::<u8>(), 0..96)
            .prop_map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
    ]
}

/// One edit of a text.
#[derive(Debug, Clone)]
enum Edit {
    Insert(usize, char),
    Delete(usize, usize),
    Replace(usize, char),
    /// Copies a run of characters to another place (repeats keys, brackets, digits).
    Duplicate(usize, usize, usize),
    Truncate(usize),
    /// Appends many digits (numbers past every limit).
    LongNumber(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let at = any::<usize>;
    prop_oneof![
        4 => (at(), any_char()).prop_map(|(at, c)| Edit::Insert(at, c)),
        3 => (at(), 1usize..8).prop_map(|(at, n)| Edit::Delete(at, n)),
        4 => (at(), any_char()).prop_map(|(at, c)| Edit::Replace(at, c)),
        2 => (at(), at(), 1usize..16).prop_map(|(from, to, n)| Edit::Duplicate(from, to, n)),
        1 => at().prop_map(Edit::Truncate),
        1 => (at(), 10usize..40).prop_map(|(at, n)| Edit::LongNumber(at, n)),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for edit in edits {
        let position = |at: usize, len: usize| if len == 0 { 0 } else { at % (len + 1) };
        match *edit {
            Edit::Insert(at, c) => {
                let at = position(at, chars.len());
                chars.insert(at, c);
            }
            Edit::Delete(at, n) => {
                let at = position(at, chars.len());
                let end = (at + n).min(chars.len());
                chars.drain(at..end);
            }
            Edit::Replace(at, c) => {
                if !chars.is_empty() {
                    let at = at % chars.len();
                    chars[at] = c;
                }
            }
            Edit::Duplicate(from, to, n) => {
                if !chars.is_empty() {
                    let from = from % chars.len();
                    let end = (from + n).min(chars.len());
                    let run: Vec<char> = chars[from..end].to_vec();
                    let to = position(to, chars.len());
                    chars.splice(to..to, run);
                }
            }
            Edit::Truncate(at) => {
                let at = position(at, chars.len());
                chars.truncate(at);
            }
            Edit::LongNumber(at, n) => {
                let at = position(at, chars.len());
                chars.splice(at..at, std::iter::repeat_n('9', n));
            }
        }
    }
    chars.into_iter().collect()
}

/// A valid example with one to eight random edits: inputs near the accepted language, where
/// parsers' edge cases live.
pub fn mutated(examples: Vec<String>) -> impl Strategy<Value = String> {
    assert!(!examples.is_empty());
    (
        proptest::sample::select(examples),
        proptest::collection::vec(edit(), 1..8),
    )
        .prop_map(|(example, edits)| apply(&example, &edits))
}

/// Valid examples, mutated examples and arbitrary text, in about equal parts.
pub fn hostile(examples: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![
        1 => proptest::sample::select(examples.clone()),
        2 => mutated(examples),
        2 => any_text(),
    ]
}

/// A TOML string literal holding `text`, escaped as TOML requires.
pub fn toml_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32 & 0xffff)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A TOML value of any type: numbers at the edges, strings near valid `texts`, arrays, tables.
pub fn toml_value(texts: Vec<String>) -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(-1),
            Just(i64::MAX),
            Just(i64::MIN),
            any::<i64>()
        ]
        .prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        Just("nan".to_owned()),
        Just("inf".to_owned()),
        any::<bool>().prop_map(|b| b.to_string()),
        hostile(texts).prop_map(|text| toml_string(&text)),
        Just("1979-05-27T07:32:00Z".to_owned()),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|items| format!("[{}]", items.join(", "))),
            proptest::collection::vec(("[a-z_]{1,8}", inner), 0..4).prop_map(|pairs| {
                let pairs: Vec<String> = pairs.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                format!("{{ {} }}", pairs.join(", "))
            }),
        ]
    })
}

/// A TOML document over `keys` (plus a few unknown ones): each line sets a key to a value of
/// any type, so that every field meets values of the wrong type, out of range and near valid.
pub fn toml_document(keys: Vec<String>, texts: Vec<String>) -> impl Strategy<Value = String> {
    let mut names = keys;
    names.extend(["unknown".to_owned(), "[table]".to_owned(), String::new()]);
    proptest::collection::vec((proptest::sample::select(names), toml_value(texts)), 0..10).prop_map(
        |lines| {
            lines
                .iter()
                .map(|(key, value)| {
                    if key.starts_with('[') || key.is_empty() {
                        format!("{key}\n")
                    } else {
                        format!("{key} = {value}\n")
                    }
                })
                .collect()
        },
    )
}

/// Whether `message` reads as an explanation: not empty, not a bare debug dump.
pub fn explains(message: &str) -> bool {
    message.split_whitespace().count() >= 3
}

/// Environments for a binary's configuration: up to `most` of `vars` (`KEYS`' variables and
/// aliases, `KeyDoc::env_names`), each set to hostile text around `values`.
#[allow(dead_code)]
pub fn environment(
    vars: impl IntoIterator<Item = &'static str>,
    values: Vec<String>,
    most: usize,
) -> impl Strategy<Value = BTreeMap<String, String>> {
    let vars: Vec<String> = vars.into_iter().map(String::from).collect();
    proptest::collection::btree_map(proptest::sample::select(vars), hostile(values), 0..most)
}
