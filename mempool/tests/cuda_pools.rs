//! User pools on a real GPU: a pool over a counting allocator backed by `cuMemAlloc`.

mod common;

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::{Allocator, BackendError, Counting, MemPool, PoolOptions, RawAllocator, StreamId};

/// `cuMemAlloc`/`cuMemFree` (counted by the library's `Counting` adaptor).
struct CuMemAlloc {
    ctx: Arc<CudaContext>,
}

// SAFETY: segments are `cuMemAlloc` allocations of exactly `size` bytes, owned by the caller
// until `free` gives them to `cuMemFree` once; a failed free returns before anything was freed.
unsafe impl RawAllocator for CuMemAlloc {
    fn name(&self) -> &str {
        "counting-cuMemAlloc"
    }
    fn alloc(&self, size: usize, _device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        self.ctx.bind_to_thread().map_err(|e| BackendError::Failed(e.to_string()))?;
        // SAFETY: the context is current; the caller owns the segment until `free`.
        unsafe { result::malloc_sync(size) }.map_err(|e| BackendError::Failed(e.to_string()))
    }
    unsafe fn free(&self, ptr: u64, _size: usize, _device: usize, _stream: StreamId) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(|e| BackendError::Failed(e.to_string()))?;
        // SAFETY: `ptr` came from `alloc` above and is freed once.
        unsafe { result::free_sync(ptr) }.map_err(|e| BackendError::Failed(e.to_string()))
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_over_cumemalloc_in_a_scope_with_kernels_and_release() {
    let a = Allocator::cuda(0).unwrap();
    let ctx = a.context().clone();
    let stream = a.current_stream();
    let counting = Counting::new(CuMemAlloc { ctx: ctx.clone() });
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(counting.clone())).unwrap();
    let add_one = ctx.load_module(Ptx::from_src(common::ptx::KERNELS)).unwrap().load_function("add_one").unwrap();
    let n: u32 = 3 << 20;
    let (mut x, y) = {
        let _scope = pool.scope();
        (a.alloc::<f32>(n as usize).unwrap(), a.alloc::<f32>(1000).unwrap())
    };
    let outside = a.alloc::<f32>(1000).unwrap();
    assert_eq!(pool.memory_stats().allocation.current, 2);
    assert!(counting.counts().allocs as usize >= 1);
    let snap = pool.snapshot();
    assert!(snap.segments.iter().all(|s| s.pool == pool.id()));
    assert!(!snap.segments.iter().any(|s| s.address == outside.device_ptr_raw()));
    let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    stream.memcpy_htod(&host, &mut x).unwrap();
    for _ in 0..3 {
        let mut launch = stream.launch_builder(&add_one);
        launch.arg(&mut x).arg(&n);
        // SAFETY: add_one takes (float*, u32) and x holds n floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    }
    let back = stream.clone_dtoh(&x).unwrap();
    assert!(back.iter().zip(&host).all(|(b, h)| *b == h + 3.0), "kernel results wrong in pool memory");
    stream.synchronize().unwrap();
    drop(y);
    drop(pool); // x still lives: its segment stays until x is dropped
    let allocated = counting.counts().allocated_bytes;
    assert!(counting.counts().freed_bytes < allocated, "a live buffer's segment was freed");
    drop(x);
    assert_eq!(counting.counts().freed_bytes, allocated, "not every byte went back through the pool's allocator");
    drop(outside);
}
