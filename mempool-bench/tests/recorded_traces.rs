//! The traces in `traces/`, recorded from PyTorch with `shared/anchors/capture_traces.py`, are what
//! `mempool-bench replay` is for: every one of them must parse and replay.

use std::path::PathBuf;

use mempool::sim::SimDevice;
use mempool::Allocator;
use mempool_bench::playback::Playback;
use mempool_bench::trace::{parse_trace, TraceOp};

/// Every `*.trace` file of the workspace's `traces/`, with its text. Empty, said on stderr, where
/// the source tree is not there: a test binary bundled for the GPU machine runs away from it.
fn recorded() -> Vec<(PathBuf, String)> {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if !crate_dir.is_dir() {
        eprintln!("skipped: the source tree ({}) is not on this machine", crate_dir.display());
        return Vec::new();
    }
    let dir = crate_dir.join("../traces");
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

#[test]
fn every_recorded_trace_replays_on_the_sim_device() {
    for (path, text) in recorded() {
        let ops = parse_trace(&text).unwrap();
        let sim = SimDevice::new(usize::MAX / 2);
        let a = Allocator::sim(sim.clone());
        let play = Playback::new(&ops, sim.default_stream(), || Ok::<_, String>(sim.new_stream())).unwrap();
        let rep = play.run(&a).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let largest = ops.iter().map(|op| if let TraceOp::Alloc { bytes, .. } = op { *bytes } else { 0 }).max();
        assert_eq!(rep.events, ops.len());
        assert!(rep.peak_allocated >= largest.unwrap() as i64, "{}: {rep:?}", path.display());
        assert!(rep.peak_reserved >= rep.peak_allocated, "{}: {rep:?}", path.display());
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0, "{}", path.display());
    }
}

/// `resnet_train.trace` (recorded from `mempool-torch/python/workloads.py capture resnet`, 30
/// steps, PyTorch 2.11 on an H200) under PyTorch's allocator peaked at 1,606,418,432 bytes
/// reserved. mempool's default pools, thread caches on, must not reserve more: a thread cache
/// that held large blocks kept them from merging and reserved 2,747,269,120.
#[test]
fn thread_caches_do_not_fragment_the_resnet_trace_beyond_pytorch() {
    let Some((_, text)) = recorded().into_iter().find(|(p, _)| p.ends_with("resnet_train.trace")) else { return };
    let ops = parse_trace(&text).unwrap();
    let sim = SimDevice::new(usize::MAX / 2);
    let a = Allocator::sim(sim.clone());
    assert!(a.config().thread_cache);
    let play = Playback::new(&ops, sim.default_stream(), || Ok::<_, String>(sim.new_stream())).unwrap();
    let rep = play.run(&a).unwrap();
    assert!(rep.peak_reserved <= 1_606_418_432, "{rep:?}");
}

/// With expandable segments, on the simulated device: at most PyTorch expandable's peaks,
/// recorded on an H200 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (resnet_train:
/// 1,438,646,272 reserved; transformer_train: 4,483,710,976).
#[test]
fn expandable_segments_reserve_no_more_than_pytorch_expandable() {
    for (name, torch) in [("resnet_train.trace", 1_438_646_272i64), ("transformer_train.trace", 4_483_710_976)] {
        let Some((_, text)) = recorded().into_iter().find(|(p, _)| p.ends_with(name)) else { return };
        let ops = parse_trace(&text).unwrap();
        let sim = SimDevice::new(usize::MAX / 2);
        let cfg = mempool::Config::builder().expandable_segments(true).build().unwrap();
        let a = Allocator::sim_with(sim.clone(), cfg);
        let play = Playback::new(&ops, sim.default_stream(), || Ok::<_, String>(sim.new_stream())).unwrap();
        for rep in 0..3 {
            let r = play.run(&a).unwrap();
            assert!(r.peak_reserved <= torch, "{name} rep {rep}: {r:?}, PyTorch expandable {torch}");
        }
    }
}
