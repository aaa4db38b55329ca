//! Reading a config file before its schema sees it: the YAML as a value tree, the line of
//! every node (so that each error can say where it is), secrets from the environment
//! (`${VAR}`, `${VAR:-default}`, `$${` for a literal `${`) and from files (`api_keys_file`,
//! `admin_token_file`, `api_key_file`, `token_file`, `auth_token_file`), and byte sizes with
//! units (`32MiB`). The schema ([`crate::config`]) stays plain serde structs: it only sees the
//! expanded tree.

use serde::{Deserialize, Deserializer};
use serde_yaml_ng::{Mapping, Value};
use std::collections::HashMap;
use std::fmt::Write as _;

/// One step of a YAML path: a mapping key or a list index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// A YAML path as the errors write it: `services[1].instances[0].addr`.
pub fn path_string(path: &[Seg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => {
                let _ = write!(s, "[{i}]");
            }
        }
    }
    s
}

/// Parses `services[1].instances[0].addr` back into steps (keys with dots or brackets in
/// them are not told apart; the config has none).
pub fn parse_path(s: &str) -> Vec<Seg> {
    let mut out = Vec::new();
    for part in s.split('.') {
        let mut rest = part;
        if let Some(i) = rest.find('[') {
            if i > 0 {
                out.push(Seg::Key(rest[..i].to_string()));
            }
            rest = &rest[i..];
            while let Some(r) = rest.strip_prefix('[') {
                let Some(end) = r.find(']') else { break };
                match r[..end].parse() {
                    Ok(n) => out.push(Seg::Index(n)),
                    Err(_) => out.push(Seg::Key(r[..end].to_string())),
                }
                rest = &r[end + 1..];
            }
        } else if !rest.is_empty() {
            out.push(Seg::Key(rest.to_string()));
        }
    }
    out
}

/// The line (1-based) of every node of the file: a mapping entry's is its key's line, a list
/// item's its own.
#[derive(Debug, Default, Clone)]
pub struct Lines(HashMap<Vec<Seg>, usize>);

impl Lines {
    /// Reads the lines with a YAML parser that marks every event (the value tree has none).
    pub fn of(text: &str) -> Lines {
        let mut b = LineBuilder::default();
        // A syntax error ends the walk; the nodes before it keep their lines.
        let _ = yaml_rust2::parser::Parser::new_from_str(text).load(&mut b, false);
        Lines(b.lines)
    }

    /// The line of `path`, or of its nearest ancestor that is in the file (a key that was left
    /// out and took its default is reported where its parent is).
    pub fn line(&self, path: &[Seg]) -> Option<usize> {
        (1..=path.len())
            .rev()
            .find_map(|n| self.0.get(&path[..n]).copied())
    }

    /// Reports `to` at the line of `from` (a key made from another one).
    fn alias(&mut self, from: &[Seg], to: Vec<Seg>) {
        if let Some(l) = self.0.get(from).copied() {
            self.0.insert(to, l);
        }
    }
}

enum Frame {
    Map {
        path: Vec<Seg>,
        key: Option<String>,
    },
    Seq {
        path: Vec<Seg>,
        next: usize,
    },
    /// A complex key (a mapping or list as a key): skipped.
    Skip(usize),
}

#[derive(Default)]
struct LineBuilder {
    stack: Vec<Frame>,
    lines: HashMap<Vec<Seg>, usize>,
    done: bool,
}

impl yaml_rust2::parser::MarkedEventReceiver for LineBuilder {
    fn on_event(&mut self, ev: yaml_rust2::Event, mark: yaml_rust2::scanner::Marker) {
        use yaml_rust2::Event;
        if self.done {
            return;
        }
        let starts = matches!(ev, Event::MappingStart(..) | Event::SequenceStart(..));
        let node = starts || matches!(ev, Event::Scalar(..) | Event::Alias(..));
        if let Some(Frame::Skip(depth)) = self.stack.last_mut() {
            if starts {
                *depth += 1;
            } else if matches!(ev, Event::MappingEnd | Event::SequenceEnd) {
                *depth -= 1;
                if *depth == 0 {
                    self.stack.pop();
                    if let Some(Frame::Map { key, .. }) = self.stack.last_mut() {
                        // The skipped key's value follows: give it an unmatchable key.
                        *key = Some("?".into());
                    }
                }
            }
            return;
        }
        if matches!(ev, Event::MappingEnd | Event::SequenceEnd) {
            self.stack.pop();
            if self.stack.is_empty() {
                self.done = true; // one document
            }
            return;
        }
        if !node {
            return;
        }
        // The path of this node, or None when it is a mapping key.
        let here: Option<Vec<Seg>> = match self.stack.last_mut() {
            None => Some(Vec::new()),
            Some(Frame::Map { path, key }) => match key.take() {
                None => {
                    match &ev {
                        Event::Scalar(s, ..) => {
                            let mut p = path.clone();
                            p.push(Seg::Key(s.clone()));
                            self.lines.insert(p, mark.line());
                            *key = Some(s.clone());
                        }
                        Event::MappingStart(..) | Event::SequenceStart(..) => {
                            self.stack.push(Frame::Skip(1));
                        }
                        _ => *key = Some("?".into()),
                    }
                    None
                }
                Some(k) => {
                    let mut p = path.clone();
                    p.push(Seg::Key(k));
                    Some(p)
                }
            },
            Some(Frame::Seq { path, next }) => {
                let mut p = path.clone();
                p.push(Seg::Index(*next));
                *next += 1;
                self.lines.insert(p.clone(), mark.line());
                Some(p)
            }
            Some(Frame::Skip(_)) => None,
        };
        let Some(path) = here else { return };
        match ev {
            Event::MappingStart(..) => self.stack.push(Frame::Map { path, key: None }),
            Event::SequenceStart(..) => self.stack.push(Frame::Seq { path, next: 0 }),
            _ if self.stack.is_empty() => self.done = true, // a scalar document
            _ => {}
        }
    }
}

/// A problem found while reading: where, and what.
#[derive(Debug, Clone)]
pub struct Problem {
    pub path: Vec<Seg>,
    pub message: String,
}

/// The keys whose value is a secret: never shown in an error, a log line or `/admin`.
pub const SECRET_KEYS: &[&str] = &[
    "api_keys",
    "keys",
    "admin_token",
    "api_key",
    "token",
    "auth_token",
];

/// The secrets that are lists of keys: their `_file` holds one key per line.
const KEY_LISTS: &[&str] = &["api_keys", "keys"];

/// Whether the node at `path` holds a secret (its key, or its list's key, is one).
pub fn is_secret(path: &[Seg]) -> bool {
    path.iter().rev().find_map(|s| match s {
        Seg::Key(k) => Some(SECRET_KEYS.contains(&k.as_str()) || k.ends_with("_file")),
        Seg::Index(_) => None,
    }) == Some(true)
}

/// Expands `${VAR}` in every string value and replaces each `<secret>_file` key by the
/// secret read from that file. Every problem is returned (the tree is expanded as far as it
/// can be).
pub fn expand(root: &mut Value, lines: &mut Lines) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut path = Vec::new();
    expand_env(root, &mut path, &mut problems);
    let mut path = Vec::new();
    secret_files(root, &mut path, lines, &mut problems);
    problems
}

fn expand_env(v: &mut Value, path: &mut Vec<Seg>, problems: &mut Vec<Problem>) {
    match v {
        Value::String(s) => match expand_str(s) {
            Ok(Some(e)) => *s = e,
            Ok(None) => {}
            Err(message) => problems.push(Problem {
                path: path.clone(),
                message,
            }),
        },
        Value::Sequence(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                path.push(Seg::Index(i));
                expand_env(item, path, problems);
                path.pop();
            }
        }
        Value::Mapping(m) => {
            for (k, item) in m.iter_mut() {
                path.push(Seg::Key(key_text(k)));
                expand_env(item, path, problems);
                path.pop();
            }
        }
        Value::Tagged(t) => expand_env(&mut t.value, path, problems),
        _ => {}
    }
}

/// A mapping key as the paths write it.
pub fn key_text(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        _ => "?".into(),
    }
}

/// `${VAR}`, `${VAR:-default}` and `$${` (a literal `${`) in `s`. `Ok(None)`: nothing to expand.
fn expand_str(s: &str) -> Result<Option<String>, String> {
    if !s.contains("${") {
        return Ok(None);
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix("${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(body) = after.strip_prefix('{') {
            let Some(end) = body.find('}') else {
                return Err(
                    "`${` without its closing `}` (write `$${` for a literal `${`)".to_string(),
                );
            };
            let inner = &body[..end];
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (inner, None),
            };
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!(
                    "`${{{inner}}}`: `{name}` is not an environment variable name (letters, digits and _; write `$${{` for a literal `${{`)"
                ));
            }
            match (std::env::var(name), default) {
                (Ok(v), d) if !v.is_empty() || d.is_none() => out.push_str(&v),
                (Err(std::env::VarError::NotUnicode(_)), None) => {
                    return Err(format!("environment variable `{name}` is not UTF-8"))
                }
                (_, Some(d)) => out.push_str(d),
                (_, None) => {
                    return Err(format!(
                        "environment variable `{name}` is not set (write `${{{name}:-default}}` for a default)"
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(Some(out))
}

fn secret_files(
    v: &mut Value,
    path: &mut Vec<Seg>,
    lines: &mut Lines,
    problems: &mut Vec<Problem>,
) {
    match v {
        Value::Sequence(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                path.push(Seg::Index(i));
                secret_files(item, path, lines, problems);
                path.pop();
            }
        }
        Value::Mapping(m) => {
            keys_from_env(m, path, problems);
            let keys: Vec<String> = m.keys().map(key_text).collect();
            for k in &keys {
                let Some(base) = k.strip_suffix("_file") else {
                    continue;
                };
                if !SECRET_KEYS.contains(&base) {
                    continue;
                }
                let Some(file) = m.remove(k.as_str()) else {
                    continue;
                };
                path.push(Seg::Key(k.clone()));
                let mut to = path.clone();
                to.pop();
                to.push(Seg::Key(base.to_string()));
                match read_secret_file(&file, KEY_LISTS.contains(&base)) {
                    Err(message) => problems.push(Problem {
                        path: path.clone(),
                        message,
                    }),
                    Ok(Value::Sequence(keys)) => {
                        lines.alias(path, to);
                        match m.get_mut(base) {
                            Some(Value::Sequence(have)) => have.extend(keys),
                            Some(_) => problems.push(Problem {
                                path: path.clone(),
                                message: format!("`{base}` must be a list to be joined with `{k}`"),
                            }),
                            None => {
                                m.insert(Value::String(base.into()), Value::Sequence(keys));
                            }
                        }
                    }
                    Ok(secret) => {
                        if m.contains_key(base) {
                            problems.push(Problem {
                                path: path.clone(),
                                message: format!("give `{base}` or `{k}`, not both"),
                            });
                        } else {
                            lines.alias(path, to);
                            m.insert(Value::String(base.into()), secret);
                        }
                    }
                }
                path.pop();
            }
            for (k, item) in m.iter_mut() {
                path.push(Seg::Key(key_text(k)));
                secret_files(item, path, lines, problems);
                path.pop();
            }
        }
        _ => {}
    }
}

/// `keys_env: VAR` (a tenant's keys in an environment variable, separated by commas or
/// whitespace): the keys joined to the mapping's `keys`.
fn keys_from_env(m: &mut Mapping, path: &mut Vec<Seg>, problems: &mut Vec<Problem>) {
    let Some(v) = m.remove("keys_env") else {
        return;
    };
    path.push(Seg::Key("keys_env".into()));
    let read = match &v {
        Value::String(var) => match std::env::var(var) {
            Ok(text) => Ok(text
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|k| !k.is_empty())
                .map(|k| Value::String(k.into()))
                .collect::<Vec<_>>()),
            Err(_) => Err(format!(
                "environment variable `{var}` is not set (or not UTF-8)"
            )),
        },
        _ => Err("expected the name of an environment variable".to_string()),
    };
    match read {
        Err(message) => problems.push(Problem {
            path: path.clone(),
            message,
        }),
        Ok(keys) => match m.get_mut("keys") {
            Some(Value::Sequence(have)) => have.extend(keys),
            Some(_) => problems.push(Problem {
                path: path.clone(),
                message: "`keys` must be a list to be joined with `keys_env`".into(),
            }),
            None => {
                m.insert(Value::String("keys".into()), Value::Sequence(keys));
            }
        },
    }
    path.pop();
}

/// The files named by the `<secret>_file` keys of a config's text (after `${VAR}`
/// expansion): what the reload watcher watches besides the config file itself.
pub fn secret_file_paths(text: &str) -> Vec<std::path::PathBuf> {
    let Ok(mut v) = parse(text) else {
        return Vec::new();
    };
    expand_env(&mut v, &mut Vec::new(), &mut Vec::new());
    let mut out = Vec::new();
    collect_secret_files(&v, &mut out);
    out
}

fn collect_secret_files(v: &Value, out: &mut Vec<std::path::PathBuf>) {
    match v {
        Value::Sequence(items) => items.iter().for_each(|x| collect_secret_files(x, out)),
        Value::Mapping(m) => {
            for (k, x) in m {
                let k = key_text(k);
                match (k.strip_suffix("_file"), x) {
                    (Some(base), Value::String(p)) if SECRET_KEYS.contains(&base) => {
                        out.push(p.into())
                    }
                    _ => collect_secret_files(x, out),
                }
            }
        }
        _ => {}
    }
}

/// The secret in a file: its text without the line end around it, or (for `api_keys_file`)
/// one key per line, blank lines and `#` comments skipped.
fn read_secret_file(file: &Value, list: bool) -> Result<Value, String> {
    let Value::String(p) = file else {
        return Err("expected the path of a file".into());
    };
    let text = std::fs::read_to_string(p).map_err(|e| format!("cannot read {p}: {e}"))?;
    if list {
        Ok(Value::Sequence(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|l| Value::String(l.into()))
                .collect(),
        ))
    } else {
        Ok(Value::String(text.trim().to_string()))
    }
}

/// A byte size: a whole number of bytes, or a size with a unit (`32MiB`, `64 KiB`, `1MB`,
/// `512k`). For `#[serde(deserialize_with = "…")]`.
pub fn bytes<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        N(u64),
        S(String),
    }
    let n = match Raw::deserialize(d).map_err(|_| {
        serde::de::Error::custom("expected a number of bytes or a size such as `32MiB`, `64KiB`, `1MB`")
    })? {
        Raw::N(n) => n,
        Raw::S(s) => parse_size::parse_size(s.trim()).map_err(|_| {
            serde::de::Error::custom(format!(
                "{s:?} is not a size: write a number of bytes or a size such as `32MiB`, `64KiB`, `1MB`"
            ))
        })?,
    };
    T::try_from(n).map_err(|_| serde::de::Error::custom(format!("{n} bytes is too large")))
}

/// [`bytes`] for an optional size.
pub fn opt_bytes<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    bytes(d).map(Some)
}

/// Parses YAML text into a value tree (a syntax error: its message and line).
pub fn parse(text: &str) -> Result<Value, (String, Option<usize>)> {
    serde_yaml_ng::from_str::<Value>(text).map_err(|e| {
        let line = e.location().map(|l| l.line());
        (e.to_string(), line)
    })
}

/// An empty mapping (an empty file is a config of defaults).
pub fn empty() -> Value {
    Value::Mapping(Mapping::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_nested_nodes() {
        let y = "a: 1\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: x}\n      - id: b\n        addr: y\n";
        let l = Lines::of(y);
        assert_eq!(l.line(&parse_path("a")), Some(1));
        assert_eq!(l.line(&parse_path("services[0].name")), Some(3));
        assert_eq!(
            l.line(&parse_path("services[0].instances[1].addr")),
            Some(7)
        );
        assert_eq!(
            l.line(&parse_path("services[0].instances[0].weight")),
            Some(5)
        );
        assert_eq!(
            path_string(&parse_path("services[0].instances[1].addr")),
            "services[0].instances[1].addr"
        );
    }

    #[test]
    fn env_expansion() {
        // A variable every process has (the tests do not change the environment).
        if let Ok(path) = std::env::var("PATH") {
            assert_eq!(
                expand_str("a${PATH}b").unwrap().unwrap(),
                format!("a{path}b")
            );
        }
        assert_eq!(expand_str("${TG_CS_UNSET:-d}").unwrap().unwrap(), "d");
        assert_eq!(expand_str("$${X}").unwrap().unwrap(), "${X}");
        assert!(expand_str("${TG_CS_UNSET}")
            .unwrap_err()
            .contains("`TG_CS_UNSET` is not set"));
        assert_eq!(expand_str("plain $x").unwrap(), None);
    }
}
