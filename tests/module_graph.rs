//! The modules of `src/` form a DAG: reading bottom-up, every module uses only modules below
//! it. A `crate::x` or `super::x` path in code (not in comments) is an edge; a cycle fails
//! the test and names the modules on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `src/a.rs` → `a`, `src/a/mod.rs` → `a`, `src/a/b.rs` → `a::b`.
fn module_of(rel: &Path) -> String {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    parts.join("::")
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The modules a path like `crate::a::b::C` or `super::b` refers to, resolved to the
/// longest known module.
fn target(path: &str, known: &BTreeSet<String>) -> Option<String> {
    let segs: Vec<&str> = path.split("::").collect();
    (1..=segs.len())
        .rev()
        .map(|n| segs[..n].join("::"))
        .find(|m| known.contains(m))
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut fs = Vec::new();
    files(&src, &mut fs);
    let known: BTreeSet<String> = fs
        .iter()
        .map(|f| module_of(f.strip_prefix(&src).unwrap()))
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &fs {
        let m = module_of(f.strip_prefix(&src).unwrap());
        if m == "lib" || m == "main" {
            continue;
        }
        let parent = m.rsplit_once("::").map(|(p, _)| p.to_string());
        let text = std::fs::read_to_string(f).unwrap();
        let edges = g.entry(m.clone()).or_default();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            for (prefix, base) in [("crate::", None), ("super::", parent.as_deref())] {
                let mut rest = code;
                while let Some(i) = rest.find(prefix) {
                    let tail = &rest[i + prefix.len()..];
                    let path: String = tail
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    let full = match (prefix, base) {
                        ("super::", Some(b)) => format!("{b}::{path}"),
                        ("super::", None) => String::new(),
                        _ => path.clone(),
                    };
                    // `super::{a, b}` / `crate::x::{…}`: the brace group names the items.
                    let full = full.trim_end_matches("::").to_string();
                    if let Some(t) = target(&full, &known).or_else(|| {
                        (prefix == "super::")
                            .then(|| base.map(str::to_string))
                            .flatten()
                    }) {
                        if t != m {
                            edges.insert(t);
                        }
                    }
                    // `use super::{a, b}`: each name may be a sibling module.
                    if let Some(group) = tail.strip_prefix('{') {
                        let group = group.split('}').next().unwrap_or("");
                        for name in group.split(',') {
                            let name = name.trim().split("::").next().unwrap_or("");
                            let b = if prefix == "super::" { base } else { None };
                            let cand = match b {
                                Some(b) => format!("{b}::{name}"),
                                None => name.to_string(),
                            };
                            if known.contains(&cand) && cand != m {
                                edges.insert(cand);
                            }
                        }
                    }
                    rest = &rest[i + prefix.len()..];
                }
            }
        }
    }
    g
}

fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // 0 = new, 1 = on the stack, 2 = done
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let i = stack.iter().position(|s| s == m).unwrap();
                    let mut c = stack[i..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_module_graph_of_src_is_a_dag() {
    let g = graph();
    // The graph is really read: the request phases use the runtime, the proxy uses them.
    assert!(g["request::plan"].contains("runtime"), "{g:#?}");
    assert!(g["proxy"].contains("request"), "{g:#?}");
    assert!(
        g["request::attempt"].contains("request::complete"),
        "{g:#?}"
    );
    if let Some(c) = find_cycle(&g) {
        panic!("module cycle: {}\n{g:#?}", c.join(" -> "));
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")] {
        g.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(find_cycle(&g).unwrap(), vec!["a", "b", "c", "a"]);
    g.get_mut("c").unwrap().clear();
    assert!(find_cycle(&g).is_none());
}
