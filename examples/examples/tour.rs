//! A tour of mempool: allocation, reuse, statistics and the summary table.
//!
//! Runs on CUDA device 0 when there is one, else on host memory (and says so).
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

    drop((a2, b2));
    alloc.empty_cache()?;
    println!(
        "5. after empty_cache: reserved {}",
        mempool::format::bytes(alloc.memory_stats().reserved_bytes.all.current as u64)
    );
    if !reused {
        eprintln!("tour: expected the cached blocks to be reused");
        std::process::exit(1);
    }
    Ok(())
}

fn main() -> mempool::Result<()> {
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
