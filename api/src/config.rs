//! Configuration files and environment overrides, done the same way by every vgpu binary.
//!
//! Each binary has one TOML file format: a struct with `#[serde(deny_unknown_fields)]` whose
//! fields are all optional, so that the same struct also holds what the command line and the
//! environment set. The binaries merge four layers, highest first: command-line flags,
//! environment variables (one per setting), the configuration file, built-in defaults.
//!
//! This module holds what the binaries share: finding and reading the file ([`locate`],
//! [`load`]), reading environment variables with messages that name them ([`Environment`],
//! [`from_env`]), turning strings into values with the binaries' own parsers ([`parse_with`] for
//! serde), and the [`KeyDoc`] table each binary keeps of its keys, which tests hold against
//! `docs/configuration.md` and the example files in `deploy/config/`.
//!
//! Everything but [`load`] is pure; environments are passed in, so tests use a `BTreeMap`.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize as _;
use serde::de::{DeserializeOwned, Deserializer, Error as _};

/// Longest configuration file read; anything larger is a mistake (a wrong path), not a config.
pub const FILE_BYTES_MAX: u64 = 1 << 20;

/// What went wrong while gathering a binary's settings. Every message names where the bad value
/// came from (the file, the variable or the flag) and what to write instead.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the configuration file {path} is larger than {FILE_BYTES_MAX} bytes; is it the right file?"
    )]
    TooLarge { path: PathBuf },
    #[error("the configuration file {path} is invalid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the environment variable {var}=`{value}` is invalid: {problem}")]
    Environment {
        var: String,
        value: String,
        problem: String,
    },
    #[error("no {what} given; {hint}")]
    Missing { what: String, hint: String },
    #[error("{0}")]
    Conflict(String),
}

/// The process environment as settings see it: a lookup by name.
pub trait Environment {
    /// The variable's value; unset, empty and non-UTF-8 variables are all `None`, so that
    /// `VGPU_X=` in an environment file means "not set" rather than "set to nothing".
    fn var(&self, name: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|value| !value.is_empty())
    }
}

impl Environment for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).filter(|value| !value.is_empty()).cloned()
    }
}

/// One configuration key of a binary, as documented: its name in the file, its environment
/// variable (plus older names still read), its command-line flag, and its default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDoc {
    /// The key in the TOML file.
    pub key: &'static str,
    /// The environment variable, `<BINARY PREFIX>_<KEY IN UPPER CASE>`.
    pub env: &'static str,
    /// Older variable names, read when `env` is unset (in this order).
    pub env_aliases: &'static [&'static str],
    /// The command-line flag, or `None` for keys only the file and the environment set.
    pub flag: Option<&'static str>,
    /// The default as documented (`required` when there is none).
    pub default: &'static str,
    /// A valid value as it is written in TOML (strings quoted), for tests and docs.
    pub example: &'static str,
}

impl KeyDoc {
    /// The error for a required setting that no layer gave.
    pub fn missing(&self, what: &str, file: Option<&Path>) -> ConfigError {
        let file = match file {
            Some(path) => format!("in {}", path.display()),
            None => "in the configuration file".to_owned(),
        };
        let flag = match self.flag {
            Some(flag) => format!("pass {flag}, "),
            None => String::new(),
        };
        ConfigError::Missing {
            what: what.to_owned(),
            hint: format!(
                "{flag}set {}, or write `{} = {}` {file}",
                self.env, self.key, self.example
            ),
        }
    }

    /// The example as an environment variable would hold it: TOML strings unquoted, arrays and
    /// tables as comma-separated lists (`a,b`, `k=v,k2=v2`).
    /// The variable and its aliases.
    pub fn env_names(&self) -> impl Iterator<Item = &'static str> + use<> {
        std::iter::once(self.env).chain(self.env_aliases.iter().copied())
    }

    pub fn example_for_env(&self) -> String {
        let text = self.example.trim();
        let unquote = |item: &str| item.trim().trim_matches('"').to_owned();
        if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
            return inner.split(',').map(unquote).collect::<Vec<_>>().join(",");
        }
        if let Some(inner) = text.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
            return inner
                .split(',')
                .map(|pair| {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    format!("{}={}", unquote(key), unquote(value))
                })
                .collect::<Vec<_>>()
                .join(",");
        }
        unquote(text)
    }
}

/// Where the configuration file comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileOrigin {
    /// `--config FILE`: it must exist.
    Flag,
    /// The binary's `..._CONFIG` variable: it must exist.
    Environment(String),
    /// A default location: used when it exists, skipped when it does not.
    Default,
}

/// Chooses the configuration file: the `--config` flag, else the variable `env_var`, else the
/// first of `defaults` (which [`load`] skips when it does not exist).
pub fn locate(
    flag: Option<&Path>,
    env: &dyn Environment,
    env_var: &str,
    defaults: &[PathBuf],
) -> Option<(PathBuf, FileOrigin)> {
    if let Some(path) = flag {
        return Some((path.to_owned(), FileOrigin::Flag));
    }
    if let Some(path) = env.var(env_var) {
        return Some((
            PathBuf::from(path),
            FileOrigin::Environment(env_var.to_owned()),
        ));
    }
    defaults
        .iter()
        .find(|path| path.exists())
        .map(|path| (path.clone(), FileOrigin::Default))
}

/// Reads and parses the located file; no file gives `T::default()` and no path.
pub fn load<T: DeserializeOwned + Default>(
    located: Option<(PathBuf, FileOrigin)>,
) -> Result<(T, Option<PathBuf>), ConfigError> {
    let Some((path, origin)) = located else {
        return Ok((T::default(), None));
    };
    let text = match read_bounded(&path) {
        Ok(text) => text,
        Err(source)
            if source.kind() == std::io::ErrorKind::NotFound && origin == FileOrigin::Default =>
        {
            return Ok((T::default(), None));
        }
        Err(source) => return Err(ConfigError::Read { path, source }),
    };
    if text.len() as u64 > FILE_BYTES_MAX {
        return Err(ConfigError::TooLarge { path });
    }
    let parsed = parse::<T>(&path, &text)?;
    Ok((parsed, Some(path)))
}

/// Parses a file's text; `path` only names it in errors.
pub fn parse<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|error| ConfigError::Parse {
        path: path.to_owned(),
        message: error.to_string().trim_end().to_owned(),
    })
}

fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    let mut text = String::new();
    // One byte past the limit is enough to tell that the file is too large.
    file.take(FILE_BYTES_MAX + 1).read_to_string(&mut text)?;
    Ok(text)
}

/// Reads the key's variable (or the first alias that is set) and parses it with `parse`.
pub fn from_env<T>(
    env: &dyn Environment,
    key: &KeyDoc,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    let found = std::iter::once(key.env)
        .chain(key.env_aliases.iter().copied())
        .find_map(|var| env.var(var).map(|value| (var, value)));
    let Some((var, value)) = found else {
        return Ok(None);
    };
    parse(value.trim())
        .map(Some)
        .map_err(|problem| ConfigError::Environment {
            var: var.to_owned(),
            value,
            problem,
        })
}

/// A parser for [`from_env`] from a `FromStr` type, with `what to write` appended to its error.
pub fn parse_from_str<T>(hint: &'static str) -> impl FnOnce(&str) -> Result<T, String>
where
    T: FromStr,
    T::Err: Display,
{
    move |text| {
        text.parse::<T>()
            .map_err(|error| format!("{error}; {hint}"))
    }
}

/// Parses a comma-separated list (`a,b, c`), as environment variables carry lists.
pub fn split_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Parses `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!(
            "`{text}` is not a boolean; write `true` or `false`"
        )),
    }
}

/// Parses a whole number of milliseconds (or any count) that must be at least `min`.
pub fn parse_at_least(min: u64) -> impl Fn(&str) -> Result<u64, String> {
    move |text| match text.trim().parse::<u64>() {
        Ok(value) if value >= min => Ok(value),
        Ok(value) => Err(format!("{value} is below {min}; write {min} or more")),
        Err(_) => Err(format!(
            "`{text}` is not a whole number; write a number of {min} or more"
        )),
    }
}

/// For `#[serde(default, deserialize_with = "...")]` on an `Option<T>` field: reads a string and
/// turns it into `T` with `parse`, whose message TOML shows with the key and line.
pub fn parse_with<'de, D, T>(
    deserializer: D,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
{
    let text = String::deserialize(deserializer)?;
    parse(&text).map(Some).map_err(D::Error::custom)
}

/// Like [`parse_with`] for an array of strings, each parsed with `parse`.
pub fn parse_list_with<'de, D, T>(
    deserializer: D,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
{
    let items = Vec::<String>::deserialize(deserializer)?;
    items
        .iter()
        .map(|item| parse(item))
        .collect::<Result<Vec<T>, String>>()
        .map(Some)
        .map_err(D::Error::custom)
}

/// A socket address to listen on, with a message that says what to write.
pub fn parse_socket_address(text: &str) -> Result<std::net::SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!("`{text}` is not an IP address and port; write e.g. `0.0.0.0:7401` or `[::]:7401`")
    })
}

/// A path that must not be empty.
pub fn parse_path(text: &str) -> Result<PathBuf, String> {
    if text.trim().is_empty() {
        return Err("the path is empty; write a path such as `/var/lib/vgpu`".to_owned());
    }
    Ok(PathBuf::from(text.trim()))
}

/// Test helpers shared by the binaries' configuration tests.
pub mod check {
    use super::*;

    /// What [`assert_consistent`] checks one binary's configuration against.
    pub struct Consistency<'a, T> {
        /// The binary's documented keys.
        pub keys: &'a [KeyDoc],
        /// The repository root (the binary's crate finds it from `CARGO_MANIFEST_DIR`).
        pub repository_root: &'a Path,
        /// The example file, relative to the root, e.g. `deploy/config/vgpu-cp.toml`.
        pub example: &'a str,
        /// The binary's `## NAME` section of `docs/configuration.md`.
        pub docs_section: &'a str,
        /// Text that section must mention (the config-file variable and default path).
        pub docs_mentions: &'a [&'a str],
        /// The binary's settings read from an environment.
        pub from_env: fn(&dyn Environment) -> Result<T, ConfigError>,
    }

    /// The checks every binary's configuration passes, shared by their tests:
    /// 1. every field of the settings is a documented key, and every key reads the same from a
    ///    file and from the environment;
    /// 2. the example file parses, lists every key, and sets every field once uncommented;
    /// 3. every key (and the config-file variable and path) is in `docs/configuration.md`.
    pub fn assert_consistent<T>(check: &Consistency<'_, T>)
    where
        T: DeserializeOwned + serde::Serialize + PartialEq + std::fmt::Debug,
    {
        let keys = check.keys;
        let from_file: T = parse(Path::new("examples"), &all_examples_as_toml(keys)).unwrap();
        let from_env = (check.from_env)(&all_examples_as_env(keys)).unwrap();
        assert_eq!(from_file, from_env);
        let value = serde_json::to_value(&from_file).unwrap();
        let fields = value.as_object().unwrap();
        assert_eq!(
            fields.len(),
            keys.len(),
            "a field of the settings is missing from KEYS"
        );
        for (field, value) in fields {
            assert!(
                !value.is_null(),
                "`{field}` is not in KEYS (no example sets it)"
            );
        }

        let read = |path: &str| {
            std::fs::read_to_string(check.repository_root.join(path))
                .unwrap_or_else(|e| panic!("{path}: {e}"))
        };
        let text = read(check.example);
        let path = Path::new(check.example);
        parse::<T>(path, &text).unwrap();
        assert_eq!(keys_missing_from_example(&text, keys), Vec::<&str>::new());
        let all = uncomment_keys(&text, keys);
        let settings: T = parse(path, &all).unwrap();
        let value = serde_json::to_value(&settings).unwrap();
        assert!(
            value.as_object().unwrap().values().all(|v| !v.is_null()),
            "{value}"
        );

        let docs = read("docs/configuration.md");
        let section = section(&docs, check.docs_section);
        assert!(
            !section.is_empty(),
            "docs/configuration.md has no `## {}` section",
            check.docs_section
        );
        assert_eq!(keys_missing_from_docs(section, keys), Vec::<String>::new());
        for mention in check.docs_mentions {
            assert!(
                section.contains(mention),
                "the `{}` section does not mention `{mention}`",
                check.docs_section
            );
        }
    }

    /// Every key of `keys` set to its example in one TOML document.
    pub fn all_examples_as_toml(keys: &[KeyDoc]) -> String {
        keys.iter()
            .map(|key| format!("{} = {}\n", key.key, key.example))
            .collect()
    }

    /// Every key of `keys` set to its example as environment variables.
    pub fn all_examples_as_env(keys: &[KeyDoc]) -> BTreeMap<String, String> {
        keys.iter()
            .map(|key| (key.env.to_owned(), key.example_for_env()))
            .collect()
    }

    /// The example file with every commented-out `# key = value` line of a known key turned on.
    pub fn uncomment_keys(text: &str, keys: &[KeyDoc]) -> String {
        text.lines()
            .map(|line| {
                let body = line.trim_start().strip_prefix('#').map(str::trim_start);
                match body {
                    Some(body) if keys.iter().any(|key| is_assignment(body, key.key)) => body,
                    _ => line,
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Whether the line (without its `#`) sets `key`.
    pub fn is_assignment(line: &str, key: &str) -> bool {
        line.strip_prefix(key)
            .is_some_and(|rest| rest.trim_start().starts_with('='))
    }

    /// Problems with `keys` in the example file `text`: keys missing from it.
    pub fn keys_missing_from_example(text: &str, keys: &[KeyDoc]) -> Vec<&'static str> {
        keys.iter()
            .filter(|key| {
                !text.lines().any(|line| {
                    let line = line.trim_start();
                    let line = line.strip_prefix('#').map_or(line, str::trim_start);
                    is_assignment(line, key.key)
                })
            })
            .map(|key| key.key)
            .collect()
    }

    /// Keys that `docs` (the binary's section of docs/configuration.md) does not document on one
    /// table row with their variable, flag and default.
    pub fn keys_missing_from_docs(docs: &str, keys: &[KeyDoc]) -> Vec<String> {
        keys.iter()
            .filter(|key| {
                let row_start = format!("| `{}` |", key.key);
                !docs.lines().any(|line| {
                    line.starts_with(&row_start)
                        && line.contains(&format!("`{}`", key.env))
                        && key
                            .flag
                            .is_none_or(|flag| line.contains(&format!("`{flag}")))
                        && key
                            .env_aliases
                            .iter()
                            .all(|alias| line.contains(&format!("`{alias}`")))
                })
            })
            .map(|key| format!("{} ({})", key.key, key.env))
            .collect()
    }

    /// The part of `docs` under the heading `## {title}`, up to the next `## ` heading.
    pub fn section<'a>(docs: &'a str, title: &str) -> &'a str {
        let heading = format!("\n## {title}\n");
        let Some(start) = docs.find(&heading) else {
            return "";
        };
        let rest = &docs[start + heading.len()..];
        let end = rest.find("\n## ").unwrap_or(rest.len());
        &rest[..end]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        count: Option<u64>,
        #[serde(default, deserialize_with = "listen")]
        listen: Option<std::net::SocketAddr>,
    }

    fn listen<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<std::net::SocketAddr>, D::Error> {
        parse_with(deserializer, parse_socket_address)
    }

    const COUNT: KeyDoc = KeyDoc {
        key: "count",
        env: "VGPU_TEST_COUNT",
        env_aliases: &["VGPU_OLD_COUNT"],
        flag: Some("--count"),
        default: "1",
        example: "3",
    };

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_file() {
        let error = parse::<Sample>(Path::new("/etc/vgpu/x.toml"), "count = 1\ncuont = 2\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("/etc/vgpu/x.toml"), "{error}");
        assert!(error.contains("unknown field `cuont`"), "{error}");
        assert!(error.contains("line 2"), "{error}");
    }

    #[test]
    fn bad_values_say_what_to_write() {
        let error = parse::<Sample>(Path::new("x.toml"), "listen = \"nowhere\"\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("write e.g. `0.0.0.0:7401`"), "{error}");
        assert_eq!(
            parse::<Sample>(Path::new("x.toml"), "listen = \"0.0.0.0:1\"").unwrap(),
            Sample {
                count: None,
                listen: Some("0.0.0.0:1".parse().unwrap())
            }
        );
    }

    #[test]
    fn the_primary_variable_wins_over_aliases_and_empty_is_unset() {
        let parse = parse_at_least(1);
        assert_eq!(from_env(&env(&[]), &COUNT, &parse).unwrap(), None);
        assert_eq!(
            from_env(&env(&[("VGPU_OLD_COUNT", "2")]), &COUNT, &parse).unwrap(),
            Some(2)
        );
        let both = env(&[("VGPU_OLD_COUNT", "2"), ("VGPU_TEST_COUNT", "5")]);
        assert_eq!(from_env(&both, &COUNT, &parse).unwrap(), Some(5));
        let empty = env(&[("VGPU_TEST_COUNT", ""), ("VGPU_OLD_COUNT", "2")]);
        assert_eq!(from_env(&empty, &COUNT, &parse).unwrap(), Some(2));
        let error = from_env(&env(&[("VGPU_TEST_COUNT", "0")]), &COUNT, &parse)
            .unwrap_err()
            .to_string();
        assert!(error.contains("VGPU_TEST_COUNT=`0`"), "{error}");
        assert!(error.contains("write 1 or more"), "{error}");
    }

    #[test]
    fn the_flag_wins_then_the_variable_then_an_existing_default() {
        let dir = std::env::temp_dir();
        let flag = Path::new("/flag.toml");
        let vars = env(&[("VGPU_X_CONFIG", "/env.toml")]);
        assert_eq!(
            locate(Some(flag), &vars, "VGPU_X_CONFIG", &[]),
            Some((flag.to_owned(), FileOrigin::Flag))
        );
        assert_eq!(
            locate(None, &vars, "VGPU_X_CONFIG", &[]).map(|(path, _)| path),
            Some(PathBuf::from("/env.toml"))
        );
        let missing = PathBuf::from("/nonexistent/vgpu/x.toml");
        assert_eq!(
            locate(
                None,
                &env(&[]),
                "VGPU_X_CONFIG",
                std::slice::from_ref(&missing)
            ),
            None
        );
        assert_eq!(
            locate(None, &env(&[]), "VGPU_X_CONFIG", &[missing, dir.clone()]),
            Some((dir, FileOrigin::Default))
        );
    }

    #[test]
    fn a_named_file_must_exist_but_a_default_one_may_not() {
        let missing = PathBuf::from("/nonexistent/vgpu/x.toml");
        let (sample, path) = load::<Sample>(Some((missing.clone(), FileOrigin::Default))).unwrap();
        assert_eq!((sample, path), (Sample::default(), None));
        let error = load::<Sample>(Some((missing, FileOrigin::Flag)))
            .unwrap_err()
            .to_string();
        assert!(error.contains("/nonexistent/vgpu/x.toml"), "{error}");
    }

    #[test]
    fn examples_convert_to_environment_values() {
        let key = |example| KeyDoc { example, ..COUNT };
        assert_eq!(key("\"a\"").example_for_env(), "a");
        assert_eq!(key("[\"a:1\", \"b:2\"]").example_for_env(), "a:1,b:2");
        assert_eq!(
            key("{ zone = \"a\", rack = \"r1\" }").example_for_env(),
            "zone=a,rack=r1"
        );
        assert_eq!(key("250").example_for_env(), "250");
    }

    #[test]
    fn checks_find_missing_keys() {
        let keys = [COUNT];
        assert_eq!(
            check::keys_missing_from_example("# count = 3\n", &keys),
            Vec::<&str>::new()
        );
        assert_eq!(
            check::keys_missing_from_example("counter = 3\n", &keys),
            vec!["count"]
        );
        assert_eq!(
            check::uncomment_keys("# count = 3\n# a comment", &keys),
            "count = 3\n# a comment"
        );
        let docs =
            "\n## x\n| `count` | `VGPU_TEST_COUNT`, `VGPU_OLD_COUNT` | `--count` | 1 | n |\n## y\n";
        assert!(check::keys_missing_from_docs(check::section(docs, "x"), &keys).is_empty());
        assert_eq!(
            check::keys_missing_from_docs(check::section(docs, "y"), &keys).len(),
            1
        );
        assert!(parse_bool("yes").unwrap() && !parse_bool("0").unwrap());
        assert!(
            parse_bool("maybe")
                .unwrap_err()
                .contains("`true` or `false`")
        );
        assert_eq!(split_list(" a, ,b "), vec!["a", "b"]);
    }
}
