//! Real PyTorch snapshots (recorded on the GPU machine with PyTorch 2.11 by
//! `fixtures/record_torch_snapshots.py`): each is read whole, and its figures agree with what
//! `torch.cuda.memory_stats` reported in the same program, right after the snapshot.

use std::collections::BTreeMap;

use mempool_viz::{Action, SnapshotView};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// `torch-<mode>.json`: device -> stat -> value (a reader of that one layout).
fn stats(mode: &str) -> BTreeMap<u64, BTreeMap<String, u64>> {
    let text = std::fs::read_to_string(format!("{DIR}/torch-{mode}.json")).unwrap();
    let mut out: BTreeMap<u64, BTreeMap<String, u64>> = BTreeMap::new();
    let mut device = None;
    for line in text.lines().map(str::trim) {
        let Some((k, v)) = line.split_once(':') else { continue };
        let k = k.trim_matches('"');
        let v = v.trim().trim_end_matches(',');
        if v == "{" {
            device = k.parse().ok();
        } else if let (Some(d), Ok(n)) = (device, v.parse::<u64>()) {
            out.entry(d).or_default().insert(k.to_string(), n);
        }
    }
    out
}

fn check(mode: &str) -> SnapshotView {
    let view = SnapshotView::read(format!("{DIR}/torch-{mode}.pickle")).unwrap();
    let stats = stats(mode);
    assert!(!stats.is_empty());
    assert_eq!(view.devices(), stats.keys().copied().collect::<Vec<_>>(), "{mode}: devices");
    for (d, s) in &stats {
        let v = view.on_device(*d);
        let reserved: u64 = v.summary().iter().map(|p| p.reserved).sum();
        let segments: u64 = v.summary().iter().map(|p| p.segments).sum();
        let allocated: u64 =
            v.segments.iter().flat_map(|s| &s.blocks).filter(|b| b.state == "active_allocated").map(|b| b.size).sum();
        let blocks = v.segments.iter().flat_map(|s| &s.blocks).filter(|b| b.state == "active_allocated").count() as u64;
        assert_eq!(reserved, s["reserved_bytes.all.current"], "{mode} device {d}: reserved");
        if mode == "expandable" {
            // PyTorch counts no segments for expandable memory; the snapshot shows the mapped
            // ranges.
            assert_eq!(s["segment.all.current"], 0);
            assert!(segments > 0);
        } else {
            assert_eq!(segments, s["segment.all.current"], "{mode} device {d}: segments");
        }
        assert_eq!(allocated, s["allocated_bytes.all.current"], "{mode} device {d}: allocated");
        assert_eq!(blocks, s["allocation.all.current"], "{mode} device {d}: allocations");
        // History was recorded from before the first allocation: the timeline's peaks are
        // PyTorch's peaks (its trace carries requested sizes: requested bytes).
        assert!(v.requested_sizes);
        let tl = v.timeline();
        assert_eq!(tl.points.first().map(|p| (p.1.iter().sum::<u64>(), p.2)), Some((0, 0)), "{mode}: starts empty");
        let peak_alloc = tl.points.iter().map(|p| p.1.iter().sum::<u64>()).max().unwrap();
        let peak_res = tl.points.iter().map(|p| p.2).max().unwrap();
        assert_eq!(peak_alloc, s["requested_bytes.all.peak"], "{mode} device {d}: peak allocated");
        assert_eq!(peak_res, s["reserved_bytes.all.peak"], "{mode} device {d}: peak reserved");
        let last = tl.points.last().unwrap();
        assert_eq!(
            (last.1.iter().sum::<u64>(), last.2),
            (s["requested_bytes.all.current"], reserved),
            "{mode}: ends at the snapshot"
        );
    }
    view
}

#[test]
fn frames_snapshot_with_shared_frames_reads_and_names_the_sites() {
    let v = check("frames");
    assert!(v.events.iter().all(|e| e.stack != 0), "every entry has its stack");
    assert!(v.frames.len() < 2000, "frames are shared, not copied: {}", v.frames.len());
    let sites = v.top_sites(3);
    assert!(!sites.is_empty());
    // The largest live site is in the recording program, not in PyTorch.
    assert!(sites[0].site.contains("record_torch_snapshots.py"), "{sites:?}");
    let live: u64 = sites.iter().map(|s| s.bytes).sum();
    assert!(live > 0);
}

#[test]
fn noframes_snapshot_reads_and_has_no_sites() {
    let v = check("noframes");
    assert!(v.events.iter().all(|e| e.stack == 0));
    assert!(v.top_sites(3).is_empty());
}

#[test]
fn expandable_snapshot_maps_memory() {
    let v = check("expandable");
    assert!(v.segments.iter().all(|s| s.is_expandable));
    assert!(v.events.iter().any(|e| e.action == Action::SegmentMap));
}

#[test]
fn two_devices_and_a_private_pool() {
    let v = check("multi");
    let pools: std::collections::BTreeSet<u64> = v.on_device(0).segments.iter().map(|s| s.pool).collect();
    assert_eq!(pools.len(), 2, "device 0 has the default pools and the MemPool");
    assert!(v.on_device(1).segments.iter().all(|s| s.pool == 0));
}
