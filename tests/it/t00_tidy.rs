//! Tidy: keeps the map (`ARCHITECTURE.md`) and a few structural rules true. These tests only
//! read files under the workspace root. They start no process and build nothing.
//!
//! The rules:
//! 1. Every workspace member (the `members` of the root `Cargo.toml`) has a heading in
//!    `ARCHITECTURE.md` that names its folder in backticks with a trailing slash, e.g.
//!    ``### `nodeagent/vgpu-agent/` ``.
//! 2. Every module file of a member is named in that member's section of `ARCHITECTURE.md`. The
//!    section runs from the member's heading to the next heading of the same or a higher level.
//!    A module file is any `.rs` file under `MEMBER/src/` except test files (`*_test.rs`,
//!    `*_tests.rs`) and the crate roots `src/lib.rs` and `src/main.rs`. Its name is the file
//!    stem; for `mod.rs` and `src/bin/NAME/main.rs` it is the folder's name. For a binary
//!    (`src/bin/NAME.rs`), `NAME` with `-` for `_` also counts. A module is named when some inline
//!    code span of the section is its name, or is a path that ends in it: `session`,
//!    `session.rs`, `inventory/nvml.rs` and `store::log_store` all count. Inline `mod x { .. }`
//!    blocks are exempt, as is everything outside `src/` (`tests/`, `benches/`, `examples/`,
//!    `fuzz/`).
//! 3. Every module file and crate root of rule 2 starts with a `//!` line. Blank lines and
//!    attributes may come before it.
//! 4. No `#[path = "..."]` in any `.rs` file of a member resolves to a file outside that member's
//!    folder. The path is resolved against the folder of the file that holds the attribute.
//! 5. No `"VGPU_` string literal appears in a member's `.rs` files outside `tenant-abi/`, except
//!    in tests. Tests are files under a `tests/` or `benches/` folder (the whole `tests/` member and the test-only `fuzzkit/` crate
//!    among them), `*_test.rs` and `*_tests.rs`, and a top-level test module. A top-level test
//!    module starts at a line that is exactly `#[cfg(test)]`, has more attributes or none, then a
//!    `mod` line, and ends at the next line that is exactly `}`. Comment lines are skipped. Each
//!    binary's settings table may declare the binary's own variables: `"VGPU_CP_..."` in
//!    `controlplane/vgpu-cp/src/config.rs`, `"VGPU_AGENT_..."` in
//!    `nodeagent/vgpu-agent/src/config.rs`, and the old names that the tables still accept as
//!    aliases, listed one by one in `SETTINGS_TABLES` (`VGPU_NODE_LOST_TIMEOUT_MS`,
//!    `VGPU_INTERPOSER`, and vgpuctl's `VGPU_ENDPOINTS`). Every other `VGPU_` name belongs to the
//!    tenant contract and is a constant in `tenant_abi::env::var`.

use std::fs;
use std::path::{Component, Path, PathBuf};

/// The map, relative to the workspace root.
const MAP: &str = "ARCHITECTURE.md";

/// The one crate that may spell `VGPU_` names: it defines them.
const CONTRACT_CRATE: &str = "tenant-abi";

/// `"VGPU_` names a file may hold outside tests: each binary's settings table declares its own
/// variables. An entry ending in `_` is a prefix; any other entry is one whole name, an old name
/// of one of the binary's own settings that the table still accepts as an alias.
const SETTINGS_TABLES: &[(&str, &str)] = &[
    ("controlplane/vgpu-cp/src/config.rs", "VGPU_CP_"),
    (
        "controlplane/vgpu-cp/src/config.rs",
        "VGPU_NODE_LOST_TIMEOUT_MS",
    ),
    ("nodeagent/vgpu-agent/src/config.rs", "VGPU_AGENT_"),
    ("nodeagent/vgpu-agent/src/config.rs", "VGPU_INTERPOSER"),
    ("vgpuctl/src/config.rs", "VGPU_ENDPOINTS"),
];

#[test]
fn every_workspace_member_has_a_heading_in_the_map() {
    let root = workspace_root();
    let map = read(&root.join(MAP));
    let mut problems = Vec::new();
    for member in members(&root) {
        if section(&map, &member).is_none() {
            problems.push(format!(
                "{MAP}: no heading names `{member}/`, a member in Cargo.toml: add a codemap entry \
                 \"### `{member}/`\" that says what the crate is for and names its modules"
            ));
        }
    }
    assert_no_problems("workspace members missing from the map", &problems);
}

#[test]
fn every_module_is_named_in_its_crates_section_of_the_map() {
    let root = workspace_root();
    let map = read(&root.join(MAP));
    let mut problems = Vec::new();
    for member in members(&root) {
        // A missing heading is the first test's failure; here we only say that it hides modules.
        let Some(section) = section(&map, &member) else {
            problems.push(format!(
                "{MAP}: no section for `{member}/`, so none of its modules are named (add its heading)"
            ));
            continue;
        };
        let spans = code_spans(&section);
        for file in module_files(&root, &member) {
            let Some(name) = module_name(&root.join(&member).join("src"), &file) else {
                continue;
            };
            let mut names = vec![name.clone()];
            if is_binary_root(&root.join(&member).join("src"), &file) {
                names.push(name.replace('_', "-"));
            }
            let named = spans
                .iter()
                .any(|span| names.iter().any(|name| span_names(span, name)));
            if !named {
                problems.push(format!(
                    "{}: module `{name}` is not named in the `{member}/` section of {MAP}: say in \
                     a line what it holds, naming it as `{name}` (or by a path ending in it)",
                    relative(&root, &file)
                ));
            }
        }
    }
    assert_no_problems("modules missing from the map", &problems);
}

#[test]
fn every_module_starts_with_a_module_doc() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for member in members(&root) {
        for file in module_files(&root, &member) {
            if !starts_with_module_doc(&read(&file)) {
                problems.push(format!(
                    "{}: the file does not start with a `//!` line: add one that says what the \
                     module is for (attributes and blank lines may come first)",
                    relative(&root, &file)
                ));
            }
        }
    }
    assert_no_problems("modules without a `//!` doc", &problems);
}

#[test]
fn no_path_attribute_reaches_outside_its_crate() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for member in members(&root) {
        let crate_dir = normalize(&root.join(&member));
        for file in rust_files(&crate_dir) {
            let text = read(&file);
            for (index, line) in text.lines().enumerate() {
                let Some(target) = path_attribute(line) else {
                    continue;
                };
                let folder = file.parent().expect("a file has a folder");
                let resolved = normalize(&folder.join(target));
                if !resolved.starts_with(&crate_dir) {
                    problems.push(format!(
                        "{}:{}: `#[path = \"{target}\"]` reaches {}, outside `{member}/`: depend \
                         on the crate that owns that code (or move it into a crate both use) \
                         instead of compiling its source into this one",
                        relative(&root, &file),
                        index + 1,
                        relative(&root, &resolved)
                    ));
                }
            }
        }
    }
    assert_no_problems(
        "`#[path]` attributes that reach into another crate",
        &problems,
    );
}

#[test]
fn vgpu_variable_names_are_spelled_only_in_tenant_abi() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for member in members(&root) {
        if member == CONTRACT_CRATE {
            continue;
        }
        for file in rust_files(&root.join(&member)) {
            let path = relative(&root, &file);
            if is_test_path(&path) {
                continue;
            }
            let allowed: Vec<&str> = SETTINGS_TABLES
                .iter()
                .filter(|(table, _)| *table == path)
                .map(|(_, entry)| *entry)
                .collect();
            let text = read(&file);
            for (number, line) in lines_outside_test_modules(&text) {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                for name in vgpu_literals(line) {
                    if allowed
                        .iter()
                        .any(|entry| settings_entry_allows(entry, name))
                    {
                        continue;
                    }
                    problems.push(format!(
                        "{path}:{number}: the literal \"{name}\" spells a tenant-contract \
                         variable: use the constant in `tenant_abi::env::var` (add it there if it \
                         is new), or a view of `tenant_abi::env` that reads it"
                    ));
                }
            }
        }
    }
    assert_no_problems("`\"VGPU_` literals outside tenant-abi", &problems);
}

// ---------------------------------------------------------------------------------------------
// Helpers. Plain text scanning: enough for rustfmt-formatted code and this repository's Markdown.
// ---------------------------------------------------------------------------------------------

fn assert_no_problems(what: &str, problems: &[String]) {
    assert!(
        problems.is_empty(),
        "tidy: {what} ({} found; the rules are in tests/it/t00_tidy.rs):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The workspace root: the folder above the `tests` crate.
fn workspace_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace root")
        .to_path_buf();
    assert!(
        root.join("Cargo.toml").is_file(),
        "no Cargo.toml in {}",
        root.display()
    );
    assert!(root.join(MAP).is_file(), "no {MAP} in {}", root.display());
    root
}

fn read(path: &Path) -> String {
    fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

/// The `members` of the root manifest, as folder paths relative to the root (`nodeagent/vgpu-agent`).
fn members(root: &Path) -> Vec<String> {
    let manifest = read(&root.join("Cargo.toml"));
    let mut members = Vec::new();
    let mut inside = false;
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if !inside {
            inside = line.starts_with("members") && line.contains('[');
            if !inside {
                continue;
            }
        }
        let list = line.split_once('[').map_or(line, |(_, after)| after);
        let (list, done) = match list.split_once(']') {
            Some((before, _)) => (before, true),
            None => (list, false),
        };
        members.extend(
            list.split(',')
                .map(|item| item.trim().trim_matches('"').trim_end_matches('/'))
                .filter(|item| !item.is_empty())
                .map(str::to_owned),
        );
        if done {
            break;
        }
    }
    assert!(
        members.len() >= 2 && members.iter().all(|member| root.join(member).is_dir()),
        "cannot read the workspace members from {}/Cargo.toml (found {members:?})",
        root.display()
    );
    members
}

/// Every `.rs` file under `dir`, in a stable order; `target` and hidden folders are skipped.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        let entries = fs::read_dir(&folder)
            .unwrap_or_else(|error| panic!("cannot list {}: {error}", folder.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    folders.push(path);
                }
            } else if name.ends_with(".rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn is_test_file(file: &Path) -> bool {
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    stem.ends_with("_test") || stem.ends_with("_tests")
}

/// Rule 2's module files and crate roots of a member: every `.rs` under `src/` but test files.
fn module_files(root: &Path, member: &str) -> Vec<PathBuf> {
    let src = root.join(member).join("src");
    let files: Vec<PathBuf> = rust_files(&src)
        .into_iter()
        .filter(|file| !is_test_file(file))
        .collect();
    assert!(
        !files.is_empty(),
        "{member}/src holds no .rs file: is the member list read right?"
    );
    files
}

/// The module's name under rule 2, or `None` for the crate roots `src/lib.rs` and `src/main.rs`.
fn module_name(src: &Path, file: &Path) -> Option<String> {
    let stem = file.file_stem()?.to_str()?;
    let folder = file.parent()?;
    if folder == src && (stem == "lib" || stem == "main") {
        return None;
    }
    if stem == "mod" || stem == "main" {
        return Some(folder.file_name()?.to_str()?.to_owned());
    }
    Some(stem.to_owned())
}

fn is_binary_root(src: &Path, file: &Path) -> bool {
    let bin = src.join("bin");
    file.parent() == Some(bin.as_path())
        || (file.file_stem().is_some_and(|s| s == "main")
            && file.parent().and_then(Path::parent) == Some(bin.as_path()))
}

/// The section of `map` whose heading names `` `member/` ``, up to the next heading of the same or
/// a higher level. Headings inside fenced code blocks do not count.
fn section(map: &str, member: &str) -> Option<String> {
    let wanted = format!("`{member}/`");
    let mut fenced = false;
    let mut level_open: Option<usize> = None;
    let mut text = String::new();
    for line in map.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let level = if fenced { 0 } else { heading_level(line) };
        match level_open {
            None => {
                if level > 0 && line.contains(&wanted) {
                    level_open = Some(level);
                }
            }
            Some(open) => {
                if level > 0 && level <= open {
                    break;
                }
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    level_open.map(|_| text)
}

/// 1 for `# x`, 2 for `## x` and so on; 0 for a line that is not a heading.
fn heading_level(line: &str) -> usize {
    let hashes = line.chars().take_while(|c| *c == '#').count();
    if hashes > 0 && line[hashes..].starts_with(' ') {
        hashes
    } else {
        0
    }
}

/// The inline code spans of a Markdown text, per paragraph (a span may wrap lines); fenced code
/// blocks are left out.
fn code_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    let mut paragraph = String::new();
    let mut fenced = false;
    for line in text.lines().chain(std::iter::once("")) {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if line.trim().is_empty() {
            let pieces: Vec<&str> = paragraph.split('`').collect();
            spans.extend(
                pieces
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .map(|span| span.trim().to_owned()),
            );
            paragraph.clear();
        } else {
            paragraph.push_str(line);
            paragraph.push(' ');
        }
    }
    spans
}

/// Whether a code span names the module `name`: it is the name, or a path that ends in it.
fn span_names(span: &str, name: &str) -> bool {
    let span = span
        .strip_suffix(".rs")
        .unwrap_or(span)
        .trim_end_matches('/');
    span == name || span.ends_with(&format!("/{name}")) || span.ends_with(&format!("::{name}"))
}

/// Whether a file's first line that is neither blank nor part of an attribute is a `//!` line.
fn starts_with_module_doc(text: &str) -> bool {
    let mut open_brackets = 0i32;
    for line in text.lines() {
        let line = line.trim();
        if open_brackets > 0 {
            open_brackets += bracket_balance(line);
            continue;
        }
        if line.is_empty() {
            continue;
        }
        if line.starts_with("#[") || line.starts_with("#![") {
            open_brackets = bracket_balance(line);
            continue;
        }
        return line.starts_with("//!");
    }
    false
}

fn bracket_balance(line: &str) -> i32 {
    line.chars()
        .map(|c| match c {
            '[' => 1,
            ']' => -1,
            _ => 0,
        })
        .sum()
}

/// The target of a `#[path = "..."]` attribute on this line, if it is one.
fn path_attribute(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("#[path")?;
    let rest = rest
        .trim_start()
        .strip_prefix('=')?
        .trim_start()
        .strip_prefix('"')?;
    rest.split_once('"').map(|(target, _)| target)
}

/// `path` with `.` and `..` resolved lexically (the files need not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut normal = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    normal
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// Rule 5's test files: under a `tests/` or `benches/` folder, or named `*_test.rs`/`*_tests.rs`.
fn is_test_path(relative_path: &str) -> bool {
    let path = Path::new(relative_path);
    is_test_file(path)
        || path
            .parent()
            .into_iter()
            .flat_map(Path::components)
            .any(|c| {
                c.as_os_str() == "tests" || c.as_os_str() == "benches" || c.as_os_str() == "fuzzkit"
            })
}

/// The lines of a file with their numbers, less its top-level test modules (see rule 5).
fn lines_outside_test_modules(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut kept = Vec::new();
    let mut index = 0;
    while index < lines.len() {
        if lines[index] == "#[cfg(test)]" {
            let mut item = index + 1;
            while item < lines.len() && lines[item].starts_with("#[") {
                item += 1;
            }
            if item < lines.len() && is_mod_line(lines[item]) {
                let mut end = item;
                if !lines[item].trim_end().ends_with(';') {
                    while end < lines.len() && lines[end] != "}" {
                        end += 1;
                    }
                }
                index = end + 1;
                continue;
            }
        }
        kept.push((index + 1, lines[index]));
        index += 1;
    }
    kept
}

/// Whether an entry of [`SETTINGS_TABLES`] (a prefix ending in `_`, or a whole name) allows `name`.
fn settings_entry_allows(entry: &str, name: &str) -> bool {
    if entry.ends_with('_') {
        name.starts_with(entry)
    } else {
        name == entry
    }
}

fn is_mod_line(line: &str) -> bool {
    let line = line
        .strip_prefix("pub(crate) ")
        .or_else(|| line.strip_prefix("pub "))
        .unwrap_or(line);
    line.starts_with("mod ")
}

/// The `VGPU_...` names that follow a `"` on this line (the name runs over letters, digits, `_`).
fn vgpu_literals(line: &str) -> Vec<&str> {
    line.match_indices("\"VGPU_")
        .map(|(at, _)| {
            let name = &line[at + 1..];
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(name.len());
            &name[..end]
        })
        .collect()
}

#[test]
fn tidy_helpers_read_what_they_claim() {
    let map = "# A\n## `x/`\ntext `one` and `a/two.rs`\n```sh\n# not a heading\n```\n### `x/y/`\n`three`\n## B\n`four`\n";
    let x = section(map, "x").expect("x has a section");
    // A deeper heading stays in the section; the next `##` ends it.
    assert!(x.contains("`one`") && x.contains("# not a heading") && x.contains("`three`"));
    assert!(!x.contains("`four`"));
    assert_eq!(section(map, "x/y").as_deref(), Some("`three`\n"));
    assert!(section(map, "z").is_none());
    let spans = code_spans(&x);
    assert!(
        spans.iter().any(|s| span_names(s, "two")) && !spans.iter().any(|s| span_names(s, "wo"))
    );
    assert!(span_names("store::log_store", "log_store") && !span_names("vgpu-shm", "shm"));

    assert!(starts_with_module_doc(
        "#![allow(\n    x,\n)]\n\n//! Doc.\n"
    ));
    assert!(!starts_with_module_doc("// A comment.\n//! Doc.\n"));
    assert_eq!(
        path_attribute(r#"#[path = "../a/b.rs"]"#),
        Some("../a/b.rs")
    );
    assert_eq!(
        normalize(Path::new("/r/a/src/../../b/c.rs")),
        Path::new("/r/b/c.rs")
    );

    let file = "a\n#[cfg(test)]\n#[path = \"x_test.rs\"]\nmod tests;\nb\n#[cfg(test)]\nmod tests {\n    c\n}\nd\n";
    let kept: Vec<&str> = lines_outside_test_modules(file)
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    assert_eq!(kept, ["a", "b", "d"]);
    assert_eq!(
        vgpu_literals(r#"get("VGPU_TENANT"), "VGPU_LOG `{x}`""#),
        ["VGPU_TENANT", "VGPU_LOG"]
    );
    assert!(is_test_path("nccl-plugin/tests/abi.rs") && is_test_path("a/src/b_test.rs"));
    assert!(!is_test_path("nccl-plugin/src/tuner.rs"));
    assert!(settings_entry_allows("VGPU_CP_", "VGPU_CP_ID"));
    assert!(!settings_entry_allows(
        "VGPU_INTERPOSER",
        "VGPU_INTERPOSER_X"
    ));
}
