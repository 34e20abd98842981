//! User pools and scopes: a counting allocator, allocations inside and outside nested scopes, a
//! second thread, and a pool dropped while one of its buffers lives on.
//!
//! Runs on CUDA device 0 when there is one (the counting allocator uses `cuMemAlloc`), else on
//! host memory. It checks what went where and ends with
//! `pools: ok routed=<n> default=<n> released=<bytes>`; any failed check exits non-zero.
//!
//! ```sh
//! cargo run --release --example pools
//! ```

use std::alloc::Layout;
use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext};
use mempool::{Allocator, BackendError, Counting, Kind, MemPool, PoolOptions, RawAllocator, StreamId};

/// Where the pool's segments come from: host memory or `cuMemAlloc`.
enum Source {
    Host,
    Cuda(Arc<CudaContext>),
}

// SAFETY: segments are fresh `std::alloc` (host) or `cuMemAlloc` (CUDA) allocations of exactly
// `size` bytes, 4 KiB / 256 B aligned, owned by the caller until `free` releases them once; a
// failed free returns before anything was freed.
unsafe impl RawAllocator for Source {
    fn name(&self) -> &str {
        "counting"
    }

    fn alloc(&self, size: usize, _device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        let p = match self {
            Source::Host => {
                let layout = Layout::from_size_align(size, 4096).map_err(|e| BackendError::Failed(e.to_string()))?;
                // SAFETY: the size is non-zero (the caching allocator never asks for empty segments).
                unsafe { std::alloc::alloc(layout) as u64 }
            }
            Source::Cuda(ctx) => {
                ctx.bind_to_thread().map_err(|e| BackendError::Failed(e.to_string()))?;
                // SAFETY: the context is current; the segment is ours until `free`.
                unsafe { result::malloc_sync(size) }.map_err(|e| BackendError::Failed(e.to_string()))?
            }
        };
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64, size: usize, _device: usize, _stream: StreamId) -> Result<(), BackendError> {
        match self {
            Source::Host => {
                let layout = Layout::from_size_align(size, 4096).map_err(|e| BackendError::Failed(e.to_string()))?;
                // SAFETY: `ptr` came from `std::alloc::alloc` with this layout and is freed once.
                unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
            }
            Source::Cuda(ctx) => {
                ctx.bind_to_thread().map_err(|e| BackendError::Failed(e.to_string()))?;
                // SAFETY: `ptr` came from `malloc_sync` above and is freed once.
                unsafe { result::free_sync(ptr) }.map_err(|e| BackendError::Failed(e.to_string()))?;
            }
        }
        Ok(())
    }
}

struct Checks(Vec<String>);

impl Checks {
    fn check(&mut self, ok: bool, what: &str) {
        println!("  [{}] {what}", if ok { "ok" } else { "FAILED" });
        if !ok {
            self.0.push(what.to_string());
        }
    }
}

fn run<K: Kind>(alloc: Allocator<K>, source: Source) -> mempool::Result<ExitCode> {
    // The library's counting adaptor around the source: the pool's segment calls, counted.
    let counting = Counting::new(source);
    let pool = MemPool::on(&alloc, PoolOptions::new().shared_allocator(counting.clone())).unwrap();
    let device_pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    let mut c = Checks(Vec::new());
    let in_pool = |p: &MemPool<K>| p.memory_stats().allocation.current;

    println!("1. outside any scope: the default pools");
    let plain = alloc.alloc::<f32>(1000)?;
    c.check(in_pool(&pool) == 0, "an unscoped allocation stays out of the pool");

    println!("2. nested scopes: the innermost wins");
    let (a, b, d) = {
        let _outer = pool.scope();
        let a = alloc.alloc::<f32>(1 << 20)?;
        let (b, d) = {
            let _inner = device_pool.scope();
            let b = alloc.alloc::<u8>(4096)?;
            println!("3. another thread, same stream, while this thread is inside both scopes");
            let alloc2 = alloc.clone();
            let other = std::thread::spawn(move || alloc2.alloc::<u8>(4096).map(|b| b.device_ptr_raw())).join();
            let d = other.expect("thread").is_ok();
            (b, d)
        };
        (a, b, d)
    };
    c.check(in_pool(&pool) == 1, "the outer scope's allocation went to the counting pool");
    c.check(in_pool(&device_pool) == 1, "the inner scope's allocation went to the inner pool");
    c.check(d && in_pool(&pool) == 1 && in_pool(&device_pool) == 1, "another thread was not routed");

    println!("4. a worker thread entering a Send scope handle");
    let handle = pool.scope_handle();
    let alloc2 = alloc.clone();
    let worker = std::thread::spawn(move || {
        let _s = handle.enter();
        alloc2.alloc::<u8>(100).map(|b| b.device_ptr_raw())
    });
    let worker_ok = worker.join().expect("thread").is_ok();
    c.check(worker_ok && pool.memory_stats().allocation.allocated == 2, "the worker's allocation went to the pool");

    println!("   (timeline of what happened so far: pools-timeline.svg)");
    let snap = alloc.snapshot();
    if let Ok(view) = mempool_viz::SnapshotView::from_pickle(&snap.to_pickle()) {
        if let Err(e) = mempool_viz::render_timeline(&view, "pools-timeline.svg") {
            eprintln!("pools: {e}");
        }
    }

    println!("5. the pool is dropped while one of its buffers lives on");
    let routed = (pool.memory_stats().allocation.allocated + device_pool.memory_stats().allocation.allocated) as usize;
    drop(b);
    drop(device_pool);
    let before = counting.counts().freed_bytes;
    drop(pool);
    c.check(counting.counts().freed_bytes > before, "free segments went back at once through its own free");
    c.check(counting.counts().freed_bytes < counting.counts().allocated_bytes, "the live buffer's segment stayed");
    drop(a);
    let released = counting.counts().freed_bytes;
    c.check(released == counting.counts().allocated_bytes, "every byte went back through the counting allocator");
    let total = alloc.memory_stats().allocation.all.allocated as usize;
    let default = total - routed;
    drop(plain);

    if c.0.is_empty() {
        println!("pools: ok routed={routed} default={default} released={released}");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("pools: FAILED {}", c.0.join("; "));
        Ok(ExitCode::FAILURE)
    }
}

fn main() -> mempool::Result<ExitCode> {
    mempool::record_history(100_000);
    match mempool::device_count() {
        Ok(n) if n > 0 => {
            println!("pools on CUDA device 0");
            let alloc = Allocator::cuda(0)?;
            let ctx = alloc.context().clone();
            run(alloc, Source::Cuda(ctx))
        }
        _ => {
            println!("pools on the host device (no CUDA GPU here)");
            run(Allocator::host_with(mempool::backend::host::HostBackend::plain(), Default::default()), Source::Host)
        }
    }
}
