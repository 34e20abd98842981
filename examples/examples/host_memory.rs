//! Host memory for a GPU program: pinned staging buffers whose reuse waits for the copies that
//! read them, and a region of code routed to memory on a host NUMA node.
//!
//!     cargo run --release --example host_memory
//!
//! Needs a CUDA GPU; says what the machine supports and skips what it does not.

use std::sync::Arc;

use mempool::backend::host_numa::{probe, HostNumaAllocator};
use mempool::{Allocator, MemPool, PoolOptions};

/// Host-to-device copy bandwidth out of pinned memory (`cuMemHostAlloc`) and out of the host-NUMA
/// pool, the same way (copy engine, 256 MiB, best of 10), in the same run.
fn bandwidth(gpu: &Allocator, pinned: &Allocator, numa: &MemPool) -> Result<(), Box<dyn std::error::Error>> {
    const BYTES: usize = 256 << 20;
    let stream = gpu.current_stream();
    let mut dst = gpu.alloc::<u8>(BYTES)?;
    let from_pinned = pinned.alloc_zeros::<u8>(BYTES)?;
    let from_numa = {
        let _in = numa.scope();
        gpu.alloc_zeros::<u8>(BYTES)?
    };
    let mut best = |src: &mempool::Buffer<u8>| -> Result<f64, Box<dyn std::error::Error>> {
        let mut t = f64::MAX;
        for _ in 0..10 {
            stream.synchronize()?;
            let start = std::time::Instant::now();
            stream.memcpy_dtod(src, &mut dst)?;
            stream.synchronize()?;
            t = t.min(start.elapsed().as_secs_f64());
        }
        Ok(BYTES as f64 / t / 1e9)
    };
    let (p, n) = (best(&from_pinned)?, best(&from_numa)?);
    println!("host-to-device copies: pinned {p:.1} GB/s, host-NUMA pool {n:.1} GB/s ({:.0}% of pinned)", n / p * 100.0);
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = match Allocator::cuda(0) {
        Ok(a) => a,
        Err(e) => {
            println!("no CUDA GPU here ({e}): nothing to show");
            return Ok(());
        }
    };
    let stream = gpu.current_stream();

    // Pinned staging: fill on the host, copy to the device asynchronously, drop at once.
    let pinned = Allocator::pinned(0)?;
    let mut staging = pinned.alloc::<f32>(1 << 20)?;
    staging.host_slice_mut()?.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
    let mut weights = gpu.alloc::<f32>(1 << 20)?;
    stream.memcpy_dtod(&staging, &mut weights)?;
    drop(staging); // its memory is handed out again only after the copy has read it
    let back = stream.clone_dtoh(&weights)?;
    println!("pinned staging: copied {} floats, last {}", back.len(), back[back.len() - 1]);

    // A region routed to host-NUMA memory (Extended GPU Memory on Grace; the near node elsewhere).
    let support = probe(0)?;
    println!("{support}");
    if !support.virtual_memory {
        println!("host-NUMA pools need host-NUMA virtual memory: skipped");
        return Ok(());
    }
    let numa = Arc::new(HostNumaAllocator::new(0, None)?);
    let offload = MemPool::on(&gpu, PoolOptions::new().shared_allocator(numa.clone()))?;
    let optimizer_state = {
        let _in = offload.scope(); // allocations of this thread on this stream go to host memory
        gpu.alloc_zeros::<f32>(16 << 20)?
    };
    let in_gpu_memory = gpu.alloc::<f32>(1 << 20)?; // outside the scope: device memory
    bandwidth(&gpu, &pinned, &offload)?;
    println!(
        "optimizer state: {} MiB on host NUMA node {} (pool {} reserves {} MiB); device buffer at {:#x}",
        (optimizer_state.len() * 4) >> 20,
        numa.node(),
        offload.id().0,
        offload.memory_stats().reserved_bytes.current >> 20,
        in_gpu_memory.device_ptr_raw()
    );
    Ok(())
}
