//! `docs/architecture.md`'s module map names every Rust source file of the four crates
//! (`src/`, `plugins/src/`, `sim/src/`, `bench/src/`) and nothing else. File system only: no
//! gateway, no build of anything.
//!
//! The map is the table between `<!-- module-map -->` and `<!-- /module-map -->`: one row per
//! file, its path (from the repository root) in backticks in the first column. When this test
//! fails it prints the rows to add and the rows to remove.

use std::collections::BTreeSet;
use std::path::Path;

const DOC: &str = "docs/architecture.md";
const ROOTS: [&str; 4] = ["src", "plugins/src", "sim/src", "bench/src"];

fn rust_files(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(root, &p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).unwrap();
            let parts: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            out.insert(parts.join("/"));
        }
    }
}

/// The paths of the map's rows, in order (duplicates kept, to report them).
fn map_rows(doc: &str) -> Vec<String> {
    let start = doc
        .find("<!-- module-map -->")
        .unwrap_or_else(|| panic!("{DOC}: no `<!-- module-map -->` marker"));
    let end = doc[start..]
        .find("<!-- /module-map -->")
        .map(|i| start + i)
        .unwrap_or_else(|| panic!("{DOC}: no `<!-- /module-map -->` marker after the start"));
    doc[start..end]
        .lines()
        .filter_map(|l| {
            let cell = l.trim().strip_prefix('|')?.split('|').next()?.trim();
            let path = cell.strip_prefix('`')?.strip_suffix('`')?;
            Some(path.to_string())
        })
        .collect()
}

#[test]
fn module_map_matches_the_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join(DOC)).unwrap_or_else(|e| panic!("{DOC}: {e}"));
    let rows = map_rows(&doc);
    assert!(!rows.is_empty(), "{DOC}: the module map has no rows");

    let mut files = BTreeSet::new();
    for r in ROOTS {
        rust_files(root, &root.join(r), &mut files);
    }
    let mut listed = BTreeSet::new();
    let mut duplicates = Vec::new();
    for r in &rows {
        if !listed.insert(r.clone()) {
            duplicates.push(r.clone());
        }
    }
    let add: Vec<&String> = files.difference(&listed).collect();
    let remove: Vec<&String> = listed.difference(&files).collect();

    let mut msg = String::new();
    if !add.is_empty() {
        msg += &format!(
            "\n{DOC}'s module map misses {} file(s); add these rows (one line on what each holds):\n",
            add.len()
        );
        for f in &add {
            msg += &format!("| `{f}` | … |\n");
        }
    }
    if !remove.is_empty() {
        msg += &format!(
            "\n{DOC}'s module map names {} file(s) that do not exist; remove (or rename) these rows:\n",
            remove.len()
        );
        for f in &remove {
            msg += &format!("| `{f}` |\n");
        }
    }
    if !duplicates.is_empty() {
        msg += &format!("\n{DOC}'s module map lists these more than once: {duplicates:?}\n");
    }
    assert!(msg.is_empty(), "{msg}");
}

#[test]
fn map_rows_parse() {
    let doc = "x\n<!-- module-map -->\n| file | what |\n|---|---|\n| `src/a.rs` | A |\n  | `b/c.rs` | C |\n| not code | x |\n<!-- /module-map -->\n| `src/after.rs` | no |\n";
    assert_eq!(map_rows(doc), ["src/a.rs", "b/c.rs"]);
}
