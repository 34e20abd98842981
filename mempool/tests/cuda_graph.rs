//! CUDA-graph capture with pools on a real GPU (run on the GPU machine through
//! `shared/tools/gpu-bundle`).

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::{Allocator, Buffer, CaptureMode, Error, MemPool, PoolOptions};

fn kernel(ctx: &Arc<CudaContext>, name: &str) -> CudaFunction {
    let module = ctx.load_module(Ptx::from_src(common::ptx::KERNELS)).expect("PTX loads");
    module.load_function(name).expect("kernel")
}

fn add_one(stream: &Arc<CudaStream>, f: &CudaFunction, x: &mut Buffer<f32>) {
    let n = x.len() as u32;
    let mut launch = stream.launch_builder(f);
    launch.arg(x).arg(&n);
    // SAFETY: add_one takes (float*, u32) and `x` holds `n` floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
}

fn copy(stream: &Arc<CudaStream>, f: &CudaFunction, src: &Buffer<f32>, dst: &mut Buffer<f32>) {
    let n = src.len().min(dst.len()) as u32;
    let cycles: u64 = 0;
    let mut launch = stream.launch_builder(f);
    launch.arg(src).arg(dst).arg(&n).arg(&cycles);
    // SAFETY: spin_copy takes (u32*, u32*, u32, u64) and copies `n` 4-byte words; both buffers
    // hold at least `n` floats (4 bytes each).
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
}

/// Kernels that allocate, write and free buffers (one on a forked side stream) are captured;
/// memory outside the graph is scribbled over; 1,000 replays give the right results and make
/// no allocation and no segment.
#[test]
#[ignore = "needs a CUDA GPU"]
fn captured_kernels_that_allocate_replay_1000_times_without_allocating() {
    let a = Allocator::cuda(0).unwrap();
    let ctx = a.context().clone();
    let (s, side) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let (inc, cp) = (kernel(&ctx, "add_one"), kernel(&ctx, "spin_copy"));
    let _cur = a.set_stream(&s).unwrap();
    let n = 1 << 20;
    // Outside the graph: a counter every replay adds one to.
    let mut acc = a.alloc_zeros::<f32>(n).unwrap();
    s.synchronize().unwrap();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let cap = a.begin_capture(&s, &pool, CaptureMode::Global).unwrap();
    // In the graph: tmp = 0 + 1; out = tmp; tmp freed; on the side stream t2 = 0 + 1 + 1,
    // added into... the main stream's `acc` via out: acc += 1.
    let mut tmp = a.alloc_zeros::<f32>(n).unwrap();
    add_one(&s, &inc, &mut tmp);
    let mut out = a.alloc::<f32>(n).unwrap();
    copy(&s, &cp, &tmp, &mut out);
    let tmp_addr = tmp.device_ptr_raw();
    // `tmp` is read on the side stream too, then freed: it must not be reused in the capture.
    side.join(&s).unwrap();
    let mut side_out = {
        let _c = a.set_stream(&side).unwrap();
        a.alloc_zeros::<f32>(n).unwrap()
    };
    copy(&side, &cp, &tmp, &mut side_out);
    add_one(&side, &inc, &mut side_out);
    tmp.record_stream(&side).unwrap();
    drop(tmp);
    let reuse = a.alloc::<f32>(n).unwrap();
    assert_ne!(reuse.device_ptr_raw(), tmp_addr, "reused during the capture after a use on another stream");
    drop(reuse);
    s.join(&side).unwrap();
    add_one(&s, &inc, &mut acc);
    let in_pool = pool.memory_stats().allocated_bytes.current;
    assert_eq!(in_pool, 2 * (n * 4) as i64, "out and side_out are the pool's");
    let graph = cap.end().unwrap();
    drop(pool);

    // Scribble over memory allocated outside the graph.
    let mut junk: Vec<Buffer<u8>> = Vec::new();
    for i in 0..16 {
        let b = a.alloc::<u8>((i + 1) << 20).unwrap();
        // SAFETY: the range is exactly the buffer's.
        unsafe { cudarc::driver::result::memset_d8_async(b.device_ptr_raw(), 0xAB, b.len(), s.cu_stream()) }.unwrap();
        junk.push(b);
    }
    s.synchronize().unwrap();
    let before = a.memory_stats();
    for _ in 0..1000 {
        // SAFETY: `acc`, `out` and `side_out` are alive and only read after the replays
        // (synchronised); no other graph shares the pool.
        unsafe { graph.replay() }.unwrap();
    }
    s.synchronize().unwrap();
    let after = a.memory_stats();
    assert_eq!(after.allocation.all.allocated, before.allocation.all.allocated, "a replay allocated");
    assert_eq!(after.segment.all.allocated, before.segment.all.allocated, "a replay made a segment");
    assert_eq!(after.reserved_bytes.all.current, before.reserved_bytes.all.current);
    let acc_h = s.clone_dtoh(&acc).unwrap();
    assert!(acc_h.iter().all(|&v| v == 1000.0), "acc {}", acc_h[0]);
    let out_h = s.clone_dtoh(&out).unwrap();
    assert!(out_h.iter().all(|&v| v == 1.0), "out {}", out_h[0]);
    side.synchronize().unwrap();
    let side_h = s.clone_dtoh(&side_out).unwrap();
    assert!(side_h.iter().all(|&v| v == 2.0), "side_out {}", side_h[0]);
    drop((junk, out, side_out, graph));
    a.empty_cache().unwrap();
}

/// Two graphs share one pool (the second captured with the first's `pool()`), replayed in
/// capture order; and a capture refuses `empty_cache` without being broken by it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_graphs_share_a_pool_and_a_capture_refuses_empty_cache() {
    let a = Allocator::cuda(0).unwrap();
    let ctx = a.context().clone();
    let s = ctx.new_stream().unwrap();
    let inc = kernel(&ctx, "add_one");
    let cp = kernel(&ctx, "spin_copy");
    let _cur = a.set_stream(&s).unwrap();
    let n = 4096;
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let cap = a.begin_capture(&s, &pool, CaptureMode::ThreadLocal).unwrap();
    let mut x = a.alloc_zeros::<f32>(n).unwrap();
    add_one(&s, &inc, &mut x);
    assert!(matches!(a.empty_cache(), Err(Error::Capture { .. })));
    let first = cap.end().unwrap();
    let cap = a.begin_capture(&s, first.pool(), CaptureMode::Global).unwrap();
    let mut y = a.alloc::<f32>(n).unwrap();
    copy(&s, &cp, &x, &mut y);
    add_one(&s, &inc, &mut y);
    let second = cap.end().unwrap();
    for _ in 0..10 {
        // SAFETY: `x` and `y` are alive; the two graphs sharing the pool replay in capture order.
        unsafe { first.replay() }.unwrap();
        // SAFETY: as above.
        unsafe { second.replay() }.unwrap();
    }
    let yh = s.clone_dtoh(&y).unwrap();
    assert!(yh.iter().all(|&v| v == 2.0), "y {}", yh[0]);
    assert_eq!(first.pool().memory_stats().allocated_bytes.current, 2 * (n * 4) as i64);
    drop((x, y, first, second, pool));
    a.empty_cache().unwrap();
}
