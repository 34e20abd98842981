//! The traces in `traces/`, recorded from PyTorch with `shared/anchors/capture_traces.py`, are what
//! `mempool-bench replay` is for: every one of them must parse.

use std::path::PathBuf;

use mempool_bench::trace::{parse_trace, TraceOp};

/// Every `*.trace` file of the workspace's `traces/`, with its text.
fn recorded() -> Vec<(PathBuf, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let mut traces: Vec<(PathBuf, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "trace"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, text)
        })
        .collect();
    traces.sort();
    assert!(!traces.is_empty(), "no traces in {}", dir.display());
    traces
}

#[test]
fn every_recorded_trace_parses() {
    for (path, text) in recorded() {
        let ops = parse_trace(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(ops.len(), text.lines().count(), "{}", path.display());
        assert!(ops.iter().any(|op| matches!(op, TraceOp::Free { .. })), "{}", path.display());
    }
}
