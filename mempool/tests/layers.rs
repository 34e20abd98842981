//! The crate's layers (ARCHITECTURE.md, "Layers"): every `crate::<module>` path in a module's
//! code must name a module of a lower layer, so imports point down and there is no cycle.

use std::collections::BTreeMap;
use std::path::Path;

/// Bottom first. A module may use modules of earlier rows only.
const LAYERS: &[&[&str]] = &[
    &["id", "format", "rules", "elem"],
    &["error"],
    &["config", "backend"],
    &["stats", "trace"],
    &["snapshot"],
    &["caching"],
    &["stream"],
    &["kind"],
    &["buffer"],
    &["allocator"],
    &["pool"],
    &["scope"],
    &["__private"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

/// `crate::<name>` paths in the code (comments and doc comments left out).
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            // `crate::{a, b}` groups.
            if after.starts_with('{') {
                let group = &after[1..after.find('}').unwrap_or(after.len())];
                out.extend(group.split(',').map(|g| g.trim().split("::").next().unwrap_or("").to_string()));
            } else {
                out.push(name);
            }
            rest = after;
        }
    }
    out
}

fn visit(dir: &Path, top: Option<&str>, found: &mut BTreeMap<String, Vec<(String, String)>>) {
    for entry in std::fs::read_dir(dir).expect("source folder") {
        let path = entry.expect("entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("").to_string();
        if path.is_dir() {
            if name == "bin" {
                continue;
            }
            visit(&path, Some(top.unwrap_or(&name)), found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let module = top.map_or(name.clone(), str::to_string);
            if module == "lib" {
                continue;
            }
            let code = std::fs::read_to_string(&path).expect("source file");
            for used in crate_paths(&code) {
                found.entry(module.clone()).or_default().push((used, path.display().to_string()));
            }
        }
    }
}

#[test]
fn imports_point_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = BTreeMap::new();
    visit(&src, None, &mut found);
    assert!(found.contains_key("caching") && found.contains_key("allocator"), "sources not found: {found:?}");
    let mut wrong = Vec::new();
    for (module, uses) in &found {
        let Some(mine) = layer_of(module) else {
            wrong.push(format!("module `{module}` is in no layer: add it to LAYERS and ARCHITECTURE.md"));
            continue;
        };
        for (used, file) in uses {
            match layer_of(used) {
                Some(theirs) if theirs < mine || used == module => {}
                Some(_) => wrong.push(format!("{file}: `{module}` uses `crate::{used}`, a layer at or above its own")),
                None => {} // an item of lib.rs (`crate::current_device`) or a re-export
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layers:\n{}", wrong.join("\n"));
}

#[test]
fn the_checker_sees_paths_in_groups_and_skips_comments() {
    let code = "use crate::{id::PoolId, error::Error};\n// crate::pool\nlet x = crate::stats::f(); // crate::scope\n";
    assert_eq!(crate_paths(code), ["id", "error", "stats"]);
}
