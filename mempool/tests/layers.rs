//! The crates' layers (ARCHITECTURE.md, "Layers"): every `crate::<module>` path in a module's
//! code must name a module of a lower layer, so imports point down and there is no cycle.
//! Checked for `mempool` and `mempool-nccl`.

use std::collections::BTreeMap;
use std::path::Path;

/// `mempool`, bottom first. A module may use modules of earlier rows only.
const LAYERS: &[&[&str]] = &[
    &["id", "format", "rules", "elem", "sync"],
    &["error"],
    &["config", "backend", "stacks"],
    &["stats", "trace", "counting"],
    &["snapshot"],
    &["caching"],
    &["stream"],
    &["kind"],
    &["buffer"],
    &["allocator"],
    &["pool"],
    &["scope", "graph", "ipc"],
    &["__private"],
];

/// `mempool-nccl`, bottom first.
const NCCL_LAYERS: &[&[&str]] =
    &[&["error", "ledger", "types"], &["env", "alloc", "register"], &["handle"], &["comm"], &["window", "symm"]];

fn layer_of(layers: &[&[&str]], module: &str) -> Option<usize> {
    layers.iter().position(|row| row.contains(&module))
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

/// Every import of the crate at `dir` (relative to the workspace) against `layers`; `None` when
/// the sources are not there (the GPU machine runs the bundled test binaries elsewhere).
fn check(dir: &str, layers: &[&[&str]]) -> Option<Vec<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir).join("src");
    if !src.is_dir() {
        eprintln!("{} not found: layers not checked here", src.display());
        return None;
    }
    let mut found = BTreeMap::new();
    visit(&src, None, &mut found);
    assert!(found.len() >= layers.len(), "{dir}: too few modules found: {:?}", found.keys());
    let mut wrong = Vec::new();
    for (module, uses) in &found {
        let Some(mine) = layer_of(layers, module) else {
            wrong.push(format!("{dir}: module `{module}` is in no layer: add it to the table and ARCHITECTURE.md"));
            continue;
        };
        for (used, file) in uses {
            match layer_of(layers, used) {
                Some(theirs) if theirs < mine || used == module => {}
                Some(_) => wrong.push(format!("{file}: `{module}` uses `crate::{used}`, a layer at or above its own")),
                None => {} // an item of lib.rs (`crate::current_device`) or a re-export
            }
        }
    }
    Some(wrong)
}

#[test]
fn imports_point_down_the_layers() {
    let mut wrong = Vec::new();
    for (dir, layers) in [("mempool", LAYERS), ("mempool-nccl", NCCL_LAYERS)] {
        wrong.extend(check(dir, layers).unwrap_or_default());
    }
    assert!(wrong.is_empty(), "imports against the layers:\n{}", wrong.join("\n"));
}

#[test]
fn the_checker_sees_paths_in_groups_and_skips_comments() {
    let code = "use crate::{id::PoolId, error::Error};\n// crate::pool\nlet x = crate::stats::f(); // crate::scope\n";
    assert_eq!(crate_paths(code), ["id", "error", "stats"]);
}
