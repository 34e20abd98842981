//! A tour of mempool: allocation, reuse, statistics and the summary table.
//!
//! Runs on CUDA device 0 when there is one, else on host memory (and says so). Writes
//! `tour-snapshot.pickle` (PyTorch's snapshot layout) and `tour-timeline.svg` in the current
//! directory.
//!
//! ```sh
//! cargo run --release --example tour
//! ```

use mempool::{Allocator, Kind};

fn tour<K: Kind>(alloc: &Allocator<K>) -> mempool::Result<()> {
    println!("1. allocate 1 MiB of f32 and 64 MiB of u8");
    let a = alloc.alloc::<f32>(1 << 18)?;
    let b = alloc.alloc::<u8>(64 << 20)?;
    println!("   a at {:#x} ({} bytes), b at {:#x}", a.device_ptr_raw(), a.num_bytes(), b.device_ptr_raw());
    let segments = alloc.memory_stats().num_device_alloc;

    println!("2. drop them and allocate the same sizes again: cached blocks are reused");
    let (pa, pb) = (a.device_ptr_raw(), b.device_ptr_raw());
    drop((a, b));
    let a2 = alloc.alloc::<f32>(1 << 18)?;
    let b2 = alloc.alloc::<u8>(64 << 20)?;
    let reused = a2.device_ptr_raw() == pa && b2.device_ptr_raw() == pb;
    let new_segments = alloc.memory_stats().num_device_alloc - segments;
    println!("   same addresses: {reused}; new device allocations: {new_segments}");

    println!("3. small requests share 2 MiB segments, split into 512-byte multiples");
    let small: Vec<_> = (1..=8).map(|i| alloc.alloc::<u8>(i * 1000)).collect::<Result<_, _>>()?;
    let snap = alloc.snapshot();
    let seg = snap.segments.iter().find(|s| s.is_small).expect("a small segment");
    println!(
        "   small segment at {:#x}: {} blocks, {} bytes allocated",
        seg.address,
        seg.blocks.len(),
        seg.allocated_size()
    );
    drop(small);

    let s = alloc.memory_stats();
    println!(
        "4. stats: allocated {} (peak {}), reserved {}, device allocations {}",
        mempool::format::bytes(s.allocated_bytes.all.current as u64),
        mempool::format::bytes(s.allocated_bytes.all.peak as u64),
        mempool::format::bytes(s.reserved_bytes.all.current as u64),
        s.num_device_alloc
    );
    println!("{}", alloc.memory_summary());

    println!("5. a snapshot PyTorch's memory viewer reads, and our own timeline picture");
    let snapshot = alloc.snapshot();
    snapshot.write_pickle("tour-snapshot.pickle")?;
    let view = mempool_viz::SnapshotView::from_pickle(&snapshot.to_pickle())
        .map_err(|e| mempool::Error::caused_by("reading the snapshot", e))?;
    print!("{}", mempool_viz::format_summary(&view.summary()));
    mempool_viz::render_timeline(&view, "tour-timeline.svg")
        .map_err(|e| mempool::Error::caused_by("drawing the timeline", e))?;
    let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
    println!(
        "   wrote {here}/tour-snapshot.pickle ({} segments, {} events)",
        snapshot.segments.len(),
        snapshot.trace.len()
    );
    println!("   wrote {here}/tour-timeline.svg");
    println!("   view them: python3 -m torch.cuda._memory_viz trace_plot tour-snapshot.pickle -o trace.html,");
    println!("   or drop the pickle on https://pytorch.org/memory_viz; the SVG opens in any browser");

    drop((a2, b2));
    alloc.empty_cache()?;
    println!(
        "6. after empty_cache: reserved {}",
        mempool::format::bytes(alloc.memory_stats().reserved_bytes.all.current as u64)
    );
    if !reused {
        eprintln!("tour: expected the cached blocks to be reused");
        std::process::exit(1);
    }
    Ok(())
}

fn main() -> mempool::Result<()> {
    mempool::record_history(100_000);
    match mempool::device_count() {
        Ok(n) if n > 0 => {
            println!("mempool tour on CUDA device 0 ({n} device(s) here)");
            tour(&Allocator::cuda(0)?)
        }
        other => {
            let why = match other {
                Err(e) => e.to_string(),
                Ok(_) => "no CUDA device".to_string(),
            };
            println!("mempool tour on the host device ({why})");
            tour(&Allocator::host())
        }
    }
}
