//! The summary and timeline of a mempool snapshot, and of a snapshot in PyTorch's own layout.

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions};
use mempool_viz::SnapshotView;

#[test]
fn summary_timeline_and_svg_of_a_mempool_snapshot() {
    mempool::record_history(10_000);
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let x = a.alloc::<u8>(3 << 20).unwrap(); // 20 MiB segment, 3 MiB used
    let y = pool.alloc::<u8>(1000).unwrap(); // 2 MiB small segment of the pool
    let z = a.alloc::<u8>(1 << 20).unwrap();
    drop(z);
    let snap = a.snapshot();
    let view = SnapshotView::from_pickle(&snap.to_pickle()).unwrap();
    let s = view.summary();
    assert_eq!(s.len(), 2);
    assert_eq!((s[0].pool, s[0].segments, s[0].reserved, s[0].allocated), (0, 2, 22 << 20, 3 << 20));
    assert_eq!(s[0].largest_free, 17 << 20);
    assert_eq!((s[1].pool, s[1].segments, s[1].reserved, s[1].allocated), (pool.id().0, 1, 2 << 20, 1024));
    // Free: 17 MiB + (2 MiB) of the small default segment... the largest is 17 MiB of 19 MiB.
    assert!((s[0].fragmentation() - (1.0 - 17.0 / 19.0)).abs() < 1e-9);
    let table = mempool_viz::format_summary(&s);
    assert!(table.contains("0 (default)") && table.contains("22.00 MiB") && table.contains("fragmentation"), "{table}");
    // The timeline ends where the snapshot is.
    let tl = view.timeline();
    let (_, alloc, reserved) = tl.points.last().unwrap();
    assert_eq!(*reserved, 24 << 20);
    assert_eq!(alloc.iter().sum::<u64>(), (3 << 20) + 1024);
    assert!(tl.points.len() > 5);
    let path = std::env::temp_dir().join(format!("mempool-viz-{}.svg", std::process::id()));
    mempool_viz::render_timeline(&view, &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    for want in [
        "<svg",
        "memory (MiB)",
        "time since the first recorded event (ms)",
        "allocated, default pools",
        &format!("allocated, pool {}", pool.id().0),
        "reserved, all pools",
    ] {
        assert!(svg.contains(want), "{want:?} missing from the SVG");
    }
    std::fs::remove_file(path).ok();
    drop((x, y));
}

#[test]
fn reads_pytorchs_snapshot_layout() {
    // What torch.cuda.memory._snapshot() pickles (abridged), made by Python itself.
    let script = r#"
import pickle, sys
d = {'segments': [{'device': 0, 'address': 1000, 'total_size': 2097152, 'allocated_size': 512,
        'active_size': 512, 'requested_size': 100, 'stream': 0, 'segment_type': 'small',
        'segment_pool_id': (0, 0), 'is_expandable': False, 'frames': [],
        'blocks': [{'address': 1000, 'size': 512, 'requested_size': 100, 'state': 'active_allocated', 'frames': []},
                   {'address': 1512, 'size': 2096640, 'requested_size': 2096640, 'state': 'inactive', 'frames': []}]}],
     'device_traces': [[{'action': 'segment_alloc', 'addr': 1000, 'size': 2097152, 'stream': 0, 'time_us': 10, 'frames': []},
                        {'action': 'alloc', 'addr': 1000, 'size': 512, 'stream': 0, 'time_us': 12, 'frames': []}]]}
sys.stdout.buffer.write(pickle.dumps(d))
"#;
    let out = std::process::Command::new("python3").arg("-c").arg(script).output().expect("python3");
    assert!(out.status.success());
    let view = SnapshotView::from_pickle(&out.stdout).unwrap();
    assert_eq!(view.segments.len(), 1);
    assert_eq!(view.events.len(), 2);
    let s = view.summary();
    assert_eq!((s[0].reserved, s[0].allocated, s[0].largest_free), (2097152, 512, 2096640));
    let tl = view.timeline();
    assert_eq!(tl.points.first().unwrap().2, 0, "reserved before the trace");
    assert_eq!(tl.points.last().unwrap().2, 2097152);
    assert!(SnapshotView::from_pickle(b"not a pickle").is_err());
}

/// Expandable memory: the pickle carries `segment_map` / `segment_unmap`, the timeline's
/// reserved line follows them, and segments are the mapped ranges.
#[test]
fn expandable_memory_maps_and_unmaps_on_the_timeline() {
    mempool::record_history(10_000);
    let sim = SimDevice::new(1 << 30);
    let cfg = mempool::Config::builder().expandable_segments(true).build().unwrap();
    let a = Allocator::sim_with(sim, cfg);
    let x = a.alloc::<u8>(5 << 19).unwrap(); // 2.5 MiB: two pages mapped
    let y = a.alloc::<u8>(5 << 20).unwrap(); // grows the free rest by two more pages
    drop(x);
    let pickle = a.snapshot().to_pickle();
    let text = String::from_utf8_lossy(&pickle);
    assert!(text.contains("segment_map"), "the trace names the maps");
    let view = SnapshotView::from_pickle(&pickle).unwrap();
    let s = view.summary();
    assert_eq!((s[0].segments, s[0].reserved), (1, 8 << 20), "one contiguous mapped range");
    let tl = view.timeline();
    assert_eq!(tl.points.iter().map(|p| p.2).max(), Some(8 << 20));
    drop(y);
    a.empty_cache().unwrap();
    let view = SnapshotView::from_pickle(&a.snapshot().to_pickle()).unwrap();
    let tl = view.timeline();
    assert!(String::from_utf8_lossy(&a.snapshot().to_pickle()).contains("segment_unmap"));
    assert_eq!(tl.points.last().unwrap().2, 0, "unmapped: nothing reserved");
}

#[inline(never)]
fn embeddings_table(a: &Allocator<mempool::Sim>) -> mempool::Buffer<u8, mempool::Sim> {
    a.alloc::<u8>(5 << 20).unwrap()
}

/// Our own stacks (`record_stacks`) reach the pickle's frames, PyTorch's layout: the reader
/// names the Rust function and line as the site, and the page carries it.
#[test]
fn our_allocation_stacks_name_the_sites() {
    mempool::record_stacks(mempool::StackMode::Full);
    mempool::record_history(1000);
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let b = embeddings_table(&a);
    let view = SnapshotView::from_pickle(&a.snapshot().to_pickle()).unwrap();
    let sites = view.top_sites(3);
    assert!(!sites.is_empty());
    assert!(sites[0].site.contains("embeddings_table") && sites[0].site.contains("viz.rs:"), "{sites:?}");
    assert_eq!(sites[0].bytes, 5 << 20);
    assert!(mempool_viz::html::page(&view, None, None).contains("embeddings_table"));
    drop(b);
}

/// PyTorch 2.0's layout (blocks keep their allocation in `history`, no `requested_size`, no
/// `pool_id`), written by Python: read, with the stack and sizes from the history.
#[test]
fn reads_pytorch_2_0_block_history() {
    let script = r#"
import pickle, sys
fr = [{'filename': 'train.py', 'line': 12, 'name': 'forward'}]
d = {'segments': [{'device': 0, 'address': 4096, 'total_size': 2097152, 'allocated_size': 1024,
        'active_size': 1024, 'stream': 0, 'segment_type': 'small',
        'blocks': [{'size': 1024, 'state': 'active_allocated', 'history': [{'addr': 4096, 'real_size': 1000, 'frames': fr}]},
                   {'size': 2096128, 'state': 'inactive'}]}],
     'device_traces': [[{'action': 'segment_alloc', 'addr': 4096, 'size': 2097152, 'stream': 0, 'frames': fr},
                        {'action': 'alloc', 'addr': 4096, 'size': 1000, 'stream': 0, 'frames': fr}]]}
sys.stdout.buffer.write(pickle.dumps(d, protocol=2))
"#;
    let out = std::process::Command::new("python3").arg("-c").arg(script).output().expect("python3");
    assert!(out.status.success());
    let view = SnapshotView::from_pickle(&out.stdout).unwrap();
    let b = &view.segments[0].blocks[0];
    assert_eq!((b.address, b.size, b.requested_size), (4096, 1024, 1000));
    assert_eq!(view.site(b.stack).map(|f| f.to_string()), Some("forward (train.py:12)".to_string()));
    let tl = view.timeline();
    assert_eq!(tl.points.last().map(|p| (p.1.iter().sum::<u64>(), p.2)), Some((1000, 2097152)));
}

/// A snapshot that is not there: the path in the message, the I/O error as the source, and an
/// error that crosses threads.
#[test]
fn a_missing_file_names_the_path_and_keeps_the_io_error() {
    fn is_shareable<T: std::error::Error + Send + Sync + 'static>() {}
    is_shareable::<mempool_viz::Error>();
    let path = std::env::temp_dir().join("mempool-viz-no-such-file.pickle");
    let e = mempool_viz::SnapshotView::read(&path).unwrap_err();
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>()).expect("an io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
}
