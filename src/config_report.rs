//! Every error of a config file in one run, each once, in plain words, with its YAML path, its
//! line and the fix where there is one:
//!
//! ```text
//! services[0].sheduler: unknown key `sheduler` — did you mean `scheduler`? (line 4)
//! timeouts.first_byte: `first_byte: 120` needs a unit, e.g. `120s` (line 9)
//! ```
//!
//! serde stops at a file's first error, so the file is read in rounds: deserialize, note the
//! error with its path, take the offending node out of the value tree (or put a harmless
//! value in its place), and again, a bounded number of times; the semantic checks then run on
//! what parsed, leaving out what sits where a bad node was taken out. Lines come from
//! [`crate::config_source::Lines`].

use crate::config_source::{self as source, is_secret, key_text, path_string, Lines, Seg};
use serde::de::DeserializeOwned;
use serde_yaml_ng::Value;

/// At most this many structural errors are collected from one file.
const MAX_ROUNDS: usize = 64;

/// Reads `text` into a `T` (expanding `${VAR}` and `*_file` secrets), then runs `validate`
/// on it; every problem found, as `path: message (line N)`.
pub fn parse<T: DeserializeOwned>(
    text: &str,
    validate: impl FnOnce(&T) -> Result<(), Vec<String>>,
) -> Result<T, Vec<String>> {
    let mut lines = Lines::of(text);
    let mut value = match source::parse(text) {
        Ok(Value::Null) => source::empty(),
        Ok(v) => v,
        Err((msg, line)) => {
            return Err(vec![with_line(
                format!("YAML syntax error: {}", strip_locations(&msg)),
                line,
            )])
        }
    };
    let mut found: Vec<(Vec<Seg>, String)> = Vec::new();
    // Where a bad node was taken out: semantic errors there are its consequence.
    let mut neutral: Vec<Vec<Seg>> = Vec::new();
    for p in source::expand(&mut value, &mut lines) {
        neutral.push(p.path.clone());
        if let Some(Seg::Key(k)) = p.path.last() {
            if let Some(base) = k.strip_suffix("_file") {
                let mut b = p.path.clone();
                b.pop();
                b.push(Seg::Key(base.into()));
                neutral.push(b);
            }
        }
        found.push((p.path, p.message));
    }
    let mut parsed = None;
    for _ in 0..MAX_ROUNDS {
        let (path, raw) = match deserialize::<T>(&value) {
            Ok(t) => {
                parsed = Some(t);
                break;
            }
            Err(e) => e,
        };
        let raw = strip_locations(&raw);
        let Some((at, message)) = locate::<T>(&value, &path, &raw) else {
            found.push((path, plain(&raw, &[], None)));
            break;
        };
        let message = plain(&message, &at, node(&value, &at));
        found.push((at.clone(), message));
        if !neutralize::<T>(&mut value, &at, &raw) {
            break;
        }
        // An unknown key taken out changes nothing that parsed.
        if !raw.starts_with("unknown field") {
            neutral.push(at);
        }
    }
    if let Some(t) = &parsed {
        if let Err(errs) = validate(t) {
            for e in errs {
                let p = e
                    .split_once(": ")
                    .map(|(p, _)| p)
                    .filter(|p| !p.contains(' '))
                    .map(source::parse_path)
                    .unwrap_or_default();
                // At or under a node that was taken out, or on the mapping that held it
                // (`throttling: set at least one limit` when its one limit was not a number).
                let consequence = |n: &Vec<Seg>| {
                    p.starts_with(n) || (n.len() > 1 && p.as_slice() == &n[..n.len() - 1])
                };
                if !p.is_empty() && neutral.iter().any(consequence) {
                    continue;
                }
                let line = if p.is_empty() { None } else { lines.line(&p) };
                found.push((Vec::new(), with_line(e, line)));
            }
        }
    }
    let mut out: Vec<(Option<usize>, String)> = Vec::new();
    for (path, msg) in found {
        let (line, text) = if path.is_empty() {
            // Already formatted (semantic errors carry their own path).
            let line = msg
                .rsplit_once("(line ")
                .and_then(|(_, l)| l.trim_end_matches(')').parse().ok());
            (line, msg)
        } else {
            let line = lines.line(&path);
            (
                line,
                with_line(format!("{}: {msg}", path_string(&path)), line),
            )
        };
        if !out.iter().any(|(_, t)| *t == text) {
            out.push((line, text));
        }
    }
    match parsed {
        Some(t) if out.is_empty() => Ok(t),
        _ => {
            // In the file's order; errors without a line last.
            out.sort_by_key(|(l, _)| l.unwrap_or(usize::MAX));
            Err(out.into_iter().map(|(_, t)| t).collect())
        }
    }
}

fn with_line(msg: String, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{msg} (line {l})"),
        None => msg,
    }
}

/// One typed deserialization of the tree, through its YAML text (so that scalars are read as
/// the YAML deserializer reads them: `id: 1` is a string where a string is expected).
fn deserialize<T: DeserializeOwned>(v: &Value) -> Result<T, (Vec<Seg>, String)> {
    let text = serde_yaml_ng::to_string(v).map_err(|e| (Vec::new(), e.to_string()))?;
    let de = serde_yaml_ng::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e
            .path()
            .iter()
            .map_while(|s| match s {
                serde_path_to_error::Segment::Seq { index } => Some(Seg::Index(*index)),
                serde_path_to_error::Segment::Map { key } => Some(Seg::Key(key.clone())),
                serde_path_to_error::Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
                serde_path_to_error::Segment::Unknown => None,
            })
            .collect();
        (path, e.into_inner().to_string())
    })
}

/// Drops the YAML deserializer's own locations (they are of the re-written text) and the
/// path it puts in front of a message.
fn strip_locations(msg: &str) -> String {
    let mut s = msg.to_string();
    while let Some(i) = s.find(" at line ") {
        let rest = &s[i + 9..];
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let mut end = i + 9 + digits;
        if let Some(col) = s[end..].strip_prefix(" column ") {
            let d = col.find(|c: char| !c.is_ascii_digit()).unwrap_or(col.len());
            end += 8 + d;
        }
        s.replace_range(i..end, "");
    }
    for phrase in [
        "unknown field",
        "unknown variant",
        "missing field",
        "invalid type",
        "invalid value",
        "invalid length",
        "duplicate field",
    ] {
        if let Some(i) = s.find(phrase) {
            return s[i..].to_string();
        }
    }
    // `path: message`: the path is ours to give.
    if let Some((p, rest)) = s.split_once(": ") {
        if !p.contains(' ') && !p.starts_with('"') && !p.starts_with('`') {
            return rest.to_string();
        }
    }
    s
}

/// The text between `prefix` and the next backtick.
fn quoted_after<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let i = s.find(prefix)? + prefix.len();
    let rest = &s[i..];
    Some(&rest[..rest.find('`')?])
}

/// The names in "expected one of `a`, `b`" / "expected `a` or `b`" / "expected `a`".
fn expected_names(s: &str) -> Vec<String> {
    let Some(i) = s.find("expected ") else {
        return Vec::new();
    };
    s[i..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The node at `path`, if the tree has it.
fn node<'a>(v: &'a Value, path: &[Seg]) -> Option<&'a Value> {
    let mut v = v;
    for s in path {
        v = match (s, v) {
            (Seg::Key(k), Value::Mapping(m)) => m.iter().find(|(mk, _)| key_text(mk) == *k)?.1,
            (Seg::Index(i), Value::Sequence(items)) => items.get(*i)?,
            (_, Value::Tagged(t)) => return node(&t.value, std::slice::from_ref(s)),
            _ => return None,
        };
    }
    Some(v)
}

fn node_mut<'a>(v: &'a mut Value, path: &[Seg]) -> Option<&'a mut Value> {
    let mut v = v;
    for s in path {
        v = match (s, v) {
            (Seg::Key(k), Value::Mapping(m)) => m.iter_mut().find(|(mk, _)| key_text(mk) == *k)?.1,
            (Seg::Index(i), Value::Sequence(items)) => items.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(v)
}

/// Takes the mapping entry at `path` out; whether there was one.
fn remove(v: &mut Value, path: &[Seg]) -> Option<Value> {
    let (Seg::Key(k), parent) = path.split_last()? else {
        return None;
    };
    let Value::Mapping(m) = node_mut(v, parent)? else {
        return None;
    };
    let key = m.keys().find(|mk| key_text(mk) == *k)?.clone();
    m.remove(&key)
}

/// Takes the node at `path` out, a list item too (for locating only: the items after it
/// move up).
fn remove_any(v: &mut Value, path: &[Seg]) -> bool {
    match path.split_last() {
        Some((Seg::Index(i), parent)) => match node_mut(v, parent) {
            Some(Value::Sequence(items)) if *i < items.len() => {
                items.remove(*i);
                true
            }
            _ => false,
        },
        _ => remove(v, path).is_some(),
    }
}

/// Sets the node at `path` (an entry of a mapping is added when missing).
fn set(v: &mut Value, path: &[Seg], new: Value) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    match (last, node_mut(v, parent)) {
        (Seg::Key(k), Some(Value::Mapping(m))) => {
            let key = m
                .keys()
                .find(|mk| key_text(mk) == *k)
                .cloned()
                .unwrap_or_else(|| Value::String(k.clone()));
            m.insert(key, new);
            true
        }
        (Seg::Index(i), Some(Value::Sequence(items))) if *i < items.len() => {
            items[*i] = new;
            true
        }
        _ => false,
    }
}

/// Where the error really is, and its message. serde's path stops at an internally tagged
/// enum (a scheduler, a plugin): the entry inside it whose removal makes the error go away
/// is the one to blame.
fn locate<T: DeserializeOwned>(v: &Value, path: &[Seg], raw: &str) -> Option<(Vec<Seg>, String)> {
    if let Some(f) = quoted_after(raw, "unknown field `") {
        let key = Seg::Key(f.to_string());
        let mut at = path.to_vec();
        if at.last() != Some(&key) {
            at.push(key.clone());
        }
        if node(v, &at).is_none() {
            // Inside an internally tagged enum: the mapping below that has the key.
            if let Some(found) = node(v, path).and_then(|n| find_key(n, &key, path.to_vec())) {
                at = found;
            }
        }
        return Some((at, raw.to_string()));
    }
    if let Some(f) = quoted_after(raw, "missing field `") {
        let mut at = path.to_vec();
        at.push(Seg::Key(f.to_string()));
        return Some((at, raw.to_string()));
    }
    if path.is_empty() && !matches!(v, Value::Mapping(_)) {
        return None;
    }
    if raw.contains("invalid type: map") {
        return Some((path.to_vec(), raw.to_string()));
    }
    let mut at = culprit::<T>(v, path, path).unwrap_or_else(|| path.to_vec());
    // An unknown tag (`kind: fastest`): the entry that holds it.
    if let (Some(x), Some(Value::Mapping(m))) =
        (quoted_after(raw, "unknown variant `"), node(v, &at))
    {
        if let Some((k, _)) = m.iter().find(|(_, val)| val.as_str() == Some(x)) {
            at.push(Seg::Key(key_text(k)));
        }
    }
    Some((at, raw.to_string()))
}

/// The path of the first mapping entry `key` in `v` (at `path`), depth first.
fn find_key(v: &Value, key: &Seg, path: Vec<Seg>) -> Option<Vec<Seg>> {
    match v {
        Value::Mapping(m) => {
            let Seg::Key(k) = key else { return None };
            if m.keys().any(|mk| key_text(mk) == *k) {
                let mut p = path;
                p.push(key.clone());
                return Some(p);
            }
            m.iter().find_map(|(mk, child)| {
                let mut p = path.clone();
                p.push(Seg::Key(key_text(mk)));
                find_key(child, key, p)
            })
        }
        Value::Sequence(items) => items.iter().enumerate().find_map(|(i, child)| {
            let mut p = path.clone();
            p.push(Seg::Index(i));
            find_key(child, key, p)
        }),
        _ => None,
    }
}

/// The node under `base` whose change makes the error at `err_path` go away, as deep
/// as it can be found.
fn culprit<T: DeserializeOwned>(v: &Value, err_path: &[Seg], base: &[Seg]) -> Option<Vec<Seg>> {
    let children: Vec<Seg> = match node(v, base)? {
        Value::Mapping(m) => m.keys().map(|k| Seg::Key(key_text(k))).collect(),
        Value::Sequence(items) => (0..items.len()).map(Seg::Index).collect(),
        _ => return None,
    };
    let gone = |t: &Value| match deserialize::<T>(t) {
        Ok(_) => true,
        Err((p, _)) => !p.starts_with(err_path),
    };
    for c in children {
        let mut at = base.to_vec();
        at.push(c);
        let mut t = v.clone();
        let mut clears = remove_any(&mut t, &at) && gone(&t);
        if !clears {
            for cand in [
                Value::String("x".into()),
                Value::Number(1.into()),
                Value::Mapping(Default::default()),
                Value::Sequence(Vec::new()),
            ] {
                let mut t = v.clone();
                if set(&mut t, &at, cand) && gone(&t) {
                    clears = true;
                    break;
                }
            }
        }
        if clears {
            return Some(culprit::<T>(v, err_path, &at).unwrap_or(at));
        }
    }
    None
}

/// Makes the error at `at` go away: removes the entry (a default applies) or puts a harmless
/// value there. Whether it could.
fn neutralize<T: DeserializeOwned>(v: &mut Value, at: &[Seg], raw: &str) -> bool {
    let err_at = |v: &Value| deserialize::<T>(v).err();
    let parent = &at[..at.len().saturating_sub(1)];
    let key = match at.last() {
        Some(Seg::Key(k)) => Some(k.clone()),
        _ => None,
    };
    // Whether the tree no longer has the error at `at`: strictly (nothing wrong around it
    // either), or at all.
    let fixed = |e: &Option<(Vec<Seg>, String)>, strict: bool| match e {
        None => true,
        Some((p, r)) => {
            let missing_here = key
                .as_ref()
                .is_some_and(|k| p == parent && r.contains(&format!("missing field `{k}`")));
            // serde's path stops at a tagged enum: an error at an ancestor may be this one.
            let here = at.starts_with(p) || p.starts_with(at) || missing_here;
            let consequence = strict && p.starts_with(parent) && r.contains("missing field");
            !here && !consequence
        }
    };
    let unknown_key = raw.starts_with("unknown field");
    if key.is_some() && (unknown_key || !raw.starts_with("missing field")) {
        let mut t = v.clone();
        if remove(&mut t, at).is_some() && (unknown_key || fixed(&err_at(&t), true)) {
            *v = t;
            return true;
        }
    }
    let mut candidates: Vec<Value> = expected_names(raw)
        .into_iter()
        .filter(|_| raw.starts_with("unknown variant"))
        .map(Value::String)
        .collect();
    candidates.extend([
        Value::String("x".into()),
        Value::Number(1.into()),
        Value::Number(0.into()),
        Value::Bool(false),
        Value::String("1s".into()),
        Value::String("127.0.0.1:1".into()),
        Value::String("http://127.0.0.1:1".into()),
        Value::Sequence(Vec::new()),
        Value::Mapping(Default::default()),
        Value::Null,
    ]);
    let mut weak = None;
    for c in candidates {
        let mut t = v.clone();
        if !set(&mut t, at, c) {
            return false;
        }
        let e = err_at(&t);
        if fixed(&e, true) {
            *v = t;
            return true;
        }
        if weak.is_none() && fixed(&e, false) {
            weak = Some(t);
        }
    }
    match weak {
        Some(t) => {
            *v = t;
            true
        }
        None => false,
    }
}

/// serde's message in plain words, with the fix where there is one.
fn plain(raw: &str, at: &[Seg], value: Option<&Value>) -> String {
    let key = match at.last() {
        Some(Seg::Key(k)) => Some(k.as_str()),
        _ => None,
    };
    if let Some(f) = quoted_after(raw, "unknown field `") {
        let names = expected_names(raw.split_once(", ").map_or("", |(_, r)| r));
        let mut m = format!("unknown key `{f}`");
        match suggest(f, &names) {
            Some(s) => m.push_str(&format!(" — did you mean `{s}`?")),
            None if names.is_empty() => m.push_str(" (this takes no keys)"),
            None => m.push_str(&format!("; the keys here are {}", list(&names))),
        }
        return m;
    }
    if let Some(f) = quoted_after(raw, "missing field `") {
        return format!("`{f}` is required");
    }
    if let Some(f) = quoted_after(raw, "duplicate field `") {
        return format!("`{f}` is given twice");
    }
    if let Some(x) = quoted_after(raw, "unknown variant `") {
        let names = expected_names(raw.split_once(", ").map_or("", |(_, r)| r));
        let mut m = format!("`{x}` is not one of {}", list(&names));
        if let Some(s) = suggest(x, &names) {
            m.push_str(&format!(" — did you mean `{s}`?"));
        }
        return m;
    }
    if raw.contains("expected a duration") {
        return match value {
            Some(Value::Number(n)) => format!(
                "`{}: {n}` needs a unit, e.g. `{n}s` (or `{n}ms`)",
                key.unwrap_or("value")
            ),
            Some(Value::String(s)) => {
                format!("{s:?} is not a duration: write a number with a unit, e.g. `500ms`, `30s`, `2m`")
            }
            _ => "expected a duration: a number with a unit, e.g. `500ms`, `30s`, `2m`".into(),
        };
    }
    for (prefix, fmt_found) in [("invalid type: ", true), ("invalid value: ", true)] {
        if let Some(rest) = raw.strip_prefix(prefix) {
            if let Some((got, exp)) = rest.rsplit_once(", expected ") {
                let got = if is_secret(at) && got.starts_with("string") {
                    "text (not shown: it is a secret)".to_string()
                } else if fmt_found {
                    found_words(got)
                } else {
                    got.to_string()
                };
                return format!("expected {}, found {got}", expected_words(exp));
            }
        }
    }
    raw.to_string()
}

fn list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The closest name, when one is close enough to be a typo.
fn suggest<'a>(x: &str, names: &'a [String]) -> Option<&'a str> {
    names
        .iter()
        .map(|n| (strsim::jaro_winkler(x, n), n))
        .filter(|(s, n)| *s >= 0.8 || strsim::levenshtein(x, n) <= 2)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, n)| n.as_str())
}

fn expected_words(e: &str) -> String {
    match e {
        "usize" | "u64" | "u32" | "u16" | "u8" => "a whole number (0 or more)".into(),
        "isize" | "i64" | "i32" | "i16" | "i8" => "a whole number".into(),
        "f64" | "f32" => "a number".into(),
        "a string" => "text".into(),
        "a boolean" => "true or false".into(),
        "a sequence" => "a list".into(),
        "a map" => "a mapping (`key: value` entries)".into(),
        "a Duration" => "a duration such as `30s`".into(),
        e if e.starts_with("struct ") || e.starts_with("internally tagged enum") => {
            "a mapping (`key: value` entries)".into()
        }
        e if e.starts_with("a sequence") => "a list".into(),
        e => e.to_string(),
    }
}

fn found_words(g: &str) -> String {
    if let Some(s) = g.strip_prefix("string ") {
        return format!("the text {s}");
    }
    for (p, w) in [
        ("integer ", "the number "),
        ("floating point ", "the number "),
        ("boolean ", ""),
    ] {
        if let Some(n) = g.strip_prefix(p) {
            return format!("{w}{}", n.trim_matches('`'));
        }
    }
    match g {
        "sequence" => "a list".into(),
        "map" => "a mapping".into(),
        "unit value" | "null" => "nothing".into(),
        g => g.to_string(),
    }
}
