//! On a real GPU (run on the GPU machine through `shared/tools/gpu-bundle`). Without a GPU, the
//! tests that need none check the clear errors instead.

mod common;

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::{Allocator, Error, StreamGuard};

fn kernel(ctx: &Arc<CudaContext>, name: &str) -> CudaFunction {
    let module = ctx.load_module(Ptx::from_src(common::ptx::KERNELS)).expect("PTX loads");
    module.load_function(name).expect("kernel")
}

fn gpu() -> Allocator {
    Allocator::cuda(0).expect("CUDA device 0")
}

#[test]
fn without_a_driver_or_device_errors_are_clear() {
    match mempool::device_count() {
        Err(Error::NoCudaDriver) => {
            let e = Allocator::cuda(0).unwrap_err();
            assert_eq!(e, Error::NoCudaDriver);
            assert!(e.to_string().contains("libcuda.so"), "{e}");
            assert!(mempool::alloc::<f32>(4).is_err());
        }
        Ok(n) => {
            let e = Allocator::cuda(n).unwrap_err();
            assert_eq!(e, Error::InvalidDevice { device: n, count: n });
            assert!(e.to_string().contains(&format!("has {n} CUDA device(s)")), "{e}");
        }
        Err(e) => panic!("unexpected: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn write_and_read_back_and_reuse() {
    let a = gpu();
    let stream = a.current_stream();
    let data: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5).collect();
    let mut buf = a.alloc::<f32>(data.len()).unwrap();
    stream.memcpy_htod(&data, &mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);
    let addr = buf.device_ptr_raw();
    drop(buf);
    let again = a.alloc::<f32>(data.len()).unwrap();
    assert_eq!(again.device_ptr_raw(), addr, "a freed block of the same size was not reused");
    let zeros = a.alloc_zeros::<u32>(12_345).unwrap();
    assert!(stream.clone_dtoh(&zeros).unwrap().iter().all(|&x| x == 0));
    let s = a.memory_stats();
    assert!(s.allocated_bytes.all.current >= (400_000 + 12_345 * 4) as i64);
    println!("{}", a.memory_summary());
}

unsafe extern "C" fn sleep_on_stream(_: *mut c_void) {
    std::thread::sleep(Duration::from_millis(400));
}

/// Makes `stream` wait ~400 ms before its next work (a host function that sleeps).
fn stall(stream: &CudaStream) {
    // SAFETY: the callback takes no data and only sleeps; the stream is live.
    unsafe { result::stream::launch_host_function(stream.cu_stream(), sleep_on_stream, std::ptr::null_mut()) }.unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn freed_buffer_is_not_reused_while_another_stream_reads_it() {
    let a = gpu();
    let ctx = a.context().clone();
    let sa: Arc<CudaStream> = ctx.new_stream().unwrap();
    let sb: Arc<CudaStream> = ctx.new_stream().unwrap();
    let n = 1 << 20;
    let _on_a: StreamGuard = a.set_stream(&sa).unwrap();
    let mut src = a.alloc::<u32>(n).unwrap();
    sa.memcpy_htod(&vec![1u32; n], &mut src).unwrap();
    sa.synchronize().unwrap();
    let old = src.device_ptr_raw();
    let mut out = {
        let _on_b = a.set_stream(&sb).unwrap();
        a.alloc::<u32>(n).unwrap()
    };
    // Stream B: wait, then copy `src` out. Passing `src` to cudarc on B records B automatically.
    stall(&sb);
    sb.memcpy_dtod(&src, &mut out).unwrap();
    drop(src); // freed on A while B has not read it yet: A waits for B's read before reusing it
    let mut fresh = a.alloc::<u32>(n).unwrap();
    sa.memcpy_htod(&vec![2u32; n], &mut fresh).unwrap(); // queued on A behind B's read
    sa.synchronize().unwrap();
    let got = sb.clone_dtoh(&out).unwrap();
    assert!(got.iter().all(|&x| x == 1), "stream B read memory that stream A had already overwritten");
    println!("reused at once, in stream order: {}", fresh.device_ptr_raw() == old);
    drop((fresh, out));
}

/// A fresh `alloc_zeros` read on another stream is zeros: the other stream waits for the zero
/// fill queued on the buffer's own stream (which is stalled here), as cudarc's own slices do.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fresh_zeros_read_on_another_stream_are_zeros() {
    let a = gpu();
    let ctx = a.context().clone();
    let (sa, sb) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let n = 1 << 20;
    let _on_a = a.set_stream(&sa).unwrap();
    let mut dirty = a.alloc::<u32>(n).unwrap();
    sa.memcpy_htod(&vec![7u32; n], &mut dirty).unwrap();
    sa.synchronize().unwrap();
    let old = dirty.device_ptr_raw();
    drop(dirty);
    stall(&sa); // the zero fill below runs ~400 ms from now
    let zeros = a.alloc_zeros::<u32>(n).unwrap();
    assert_eq!(zeros.device_ptr_raw(), old, "the dirty block was not reused");
    let got = sb.clone_dtoh(&zeros).unwrap();
    assert!(got.iter().all(|&x| x == 0), "stream B read the block before its zero fill");
}

/// A stream dropped by its owner stays alive while the allocator caches a segment of it (its
/// handle cannot be given to a new stream), and a new stream never gets its cached blocks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dropped_stream_lives_while_its_segments_are_cached() {
    let a = gpu();
    let ctx = a.context().clone();
    let s1 = ctx.new_stream().unwrap();
    let weak = Arc::downgrade(&s1);
    let old = {
        let _on = a.set_stream(&s1).unwrap();
        let b = a.alloc::<u8>(4096).unwrap();
        b.device_ptr_raw()
    };
    let handle = s1.cu_stream();
    drop(s1);
    assert!(weak.upgrade().is_some(), "the allocator let the stream of a cached segment die");
    let s2 = ctx.new_stream().unwrap();
    assert_ne!(s2.cu_stream(), handle, "a new stream got the handle of one whose segment is cached");
    {
        let _on = a.set_stream(&s2).unwrap();
        let b = a.alloc::<u8>(4096).unwrap();
        assert_ne!(b.device_ptr_raw(), old, "a new stream was handed a dead stream's cached block");
    }
    a.empty_cache().unwrap();
    assert!(weak.upgrade().is_none(), "the stream outlived the last segment that needed it");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn long_kernel_on_another_stream_keeps_a_freed_buffer_until_it_finishes() {
    let a = gpu();
    let ctx = a.context().clone();
    let (sa, sb) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let spin_copy = kernel(&ctx, "spin_copy");
    let n: u32 = 1 << 20;
    let _on_a = a.set_stream(&sa).unwrap();
    let mut src = a.alloc::<u32>(n as usize).unwrap();
    sa.memcpy_htod(&vec![7u32; n as usize], &mut src).unwrap();
    sa.synchronize().unwrap();
    let old = src.device_ptr_raw();
    let mut out = {
        let _on_b = a.set_stream(&sb).unwrap();
        a.alloc::<u32>(n as usize).unwrap()
    };
    // About half a second of spinning before the kernel reads `src`.
    let cycles: u64 = 1_000_000_000;
    let cfg = LaunchConfig { grid_dim: (132, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut launch = sb.launch_builder(&spin_copy);
    launch.arg(&src).arg(&mut out).arg(&n).arg(&cycles);
    // SAFETY: the kernel's signature is (u32*, u32*, u32, u64) and both buffers hold n u32s.
    unsafe { launch.launch(cfg) }.unwrap();
    src.record_stream(&sb).unwrap();
    drop(src);
    let mut fresh = a.alloc::<u32>(n as usize).unwrap();
    assert_ne!(fresh.device_ptr_raw(), old, "reused while the kernel on stream B had yet to read it");
    sa.memcpy_htod(&vec![9u32; n as usize], &mut fresh).unwrap();
    sa.synchronize().unwrap();
    let got = sb.clone_dtoh(&out).unwrap();
    assert!(got.iter().all(|&x| x == 7), "the kernel read overwritten memory");
    let reuse = a.alloc::<u32>(n as usize).unwrap();
    assert_eq!(reuse.device_ptr_raw(), old, "not reused after the kernel finished");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_take_buffers_as_arguments() {
    let a = gpu();
    let ctx = a.context().clone();
    let stream = a.current_stream();
    let add_one = kernel(&ctx, "add_one");
    let n: u32 = 100_003;
    let mut x = a.alloc::<f32>(n as usize).unwrap();
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    stream.memcpy_htod(&host, &mut x).unwrap();
    let mut launch = stream.launch_builder(&add_one);
    launch.arg(&mut x).arg(&n);
    // SAFETY: add_one takes (float*, u32) and x holds n floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    let back = stream.clone_dtoh(&x).unwrap();
    assert!(back.iter().zip(&host).all(|(b, h)| *b == h + 1.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn explicit_record_stream_defers_reuse() {
    let a = gpu();
    let ctx = a.context().clone();
    let sb = ctx.new_stream().unwrap();
    let buf = a.alloc::<u8>(3 << 20).unwrap();
    let old = buf.device_ptr_raw();
    stall(&sb);
    buf.record_stream(&sb).unwrap();
    drop(buf);
    let other = a.alloc::<u8>(3 << 20).unwrap();
    assert_ne!(other.device_ptr_raw(), old);
    sb.synchronize().unwrap();
    drop(other);
    let b2 = a.alloc::<u8>(3 << 20).unwrap();
    let b3 = a.alloc::<u8>(3 << 20).unwrap();
    assert!(b2.device_ptr_raw() == old || b3.device_ptr_raw() == old);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocate_until_refused_then_recover() {
    let a = gpu();
    a.empty_cache().unwrap();
    let (free0, total) = a.device_memory().unwrap();
    let chunk = 1usize << 30;
    let mut held = Vec::new();
    let err = loop {
        match a.alloc::<u8>(chunk) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() * chunk <= total, "allocated more than the device has");
    };
    let Error::OutOfMemory(r) = &err else { panic!("expected out of memory, got {err}") };
    let msg = err.to_string();
    println!("after {} GiB: {msg}", held.len());
    assert!(held.len() * chunk + chunk > free0 / 2, "refused far too early: {} GiB of {free0} free", held.len());
    assert_eq!(r.requested, chunk);
    assert_eq!(r.device_total, Some(total));
    for want in ["cuda out of memory", "Tried to allocate 1.00 GiB", "total capacity of", "allocated by mempool"] {
        assert!(msg.contains(want), "{want:?} missing: {msg}");
    }
    held.clear();
    let again = a.alloc::<u8>(chunk).unwrap();
    drop(again);
    assert!(a.memory_stats().num_ooms >= 1);
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    let (free1, _) = a.device_memory().unwrap();
    assert!(free1 + (64 << 20) >= free0, "driver free memory did not come back: {free0} before, {free1} after");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_bytes_with_the_driver() {
    let a = gpu();
    // Raw driver calls need the context current on this thread (cudarc's safe API binds it).
    a.context().bind_to_thread().unwrap();
    let p = a.alloc_bytes(1 << 20).unwrap();
    // SAFETY: `p` is a live allocation of 1 MiB on device 0, whose context is current.
    unsafe { result::memset_d8_sync(p, 7, 1 << 20) }.unwrap();
    let mut host = vec![0u8; 1 << 20];
    // SAFETY: as above; `host` has room for 1 MiB.
    unsafe { result::memcpy_dtoh_sync(&mut host, p) }.unwrap();
    assert!(host.iter().all(|&x| x == 7));
    assert!(matches!(a.free_bytes(p + 4), Err(Error::InvalidFree { .. })));
    a.free_bytes(p).unwrap();
    assert!(matches!(a.free_bytes(p), Err(Error::InvalidFree { .. })));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_backend_is_pinned_when_a_gpu_is_present() {
    let backend = mempool::backend::host::HostBackend::new();
    assert!(backend.is_pinned());
    let h = Allocator::host_with(backend, mempool::Config::default());
    let b = h.alloc_zeros::<u64>(1000).unwrap();
    // SAFETY: the buffer is 1000 live, zeroed u64s of host memory owned by `b`.
    let s = unsafe { std::slice::from_raw_parts(b.device_ptr_raw() as *const u64, 1000) };
    assert!(s.iter().all(|&x| x == 0));
}

/// Sixteen threads, a stream each, reuse their cached blocks while every byte they wrote is
/// read back intact; statistics are exact when they are done, and `empty_cache` takes back
/// what their caches held.
#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_on_their_own_streams_reuse_cached_blocks_safely() {
    let a = gpu();
    let before = a.memory_stats();
    std::thread::scope(|s| {
        for t in 0..16u32 {
            let a = a.clone();
            s.spawn(move || {
                let stream = a.context().new_stream().unwrap();
                let _on = a.set_stream(&stream).unwrap();
                let mut seen = std::collections::HashSet::new();
                for i in 0..200u32 {
                    let n = [128usize, 1024, 16 << 10, 256 << 10][(i % 4) as usize];
                    let want: Vec<u32> = (0..n as u32).map(|k| t << 24 ^ i << 12 ^ k).collect();
                    let mut b = a.alloc::<u32>(n).unwrap();
                    seen.insert(b.device_ptr_raw());
                    stream.memcpy_htod(&want, &mut b).unwrap();
                    assert_eq!(stream.clone_dtoh(&b).unwrap(), want, "thread {t}, step {i}");
                }
                // Other threads' growth may take this thread's cached blocks; most steps reuse.
                assert!(seen.len() < 100, "thread {t}: {} addresses in 200 steps", seen.len());
            });
        }
    });
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert_eq!(s.allocation.all.allocated - before.allocation.all.allocated, 16 * 200);
    a.empty_cache().unwrap();
    let after = a.memory_stats().reserved_bytes.all.current;
    assert!(after <= before.reserved_bytes.all.current, "cached blocks kept segments: {after} bytes reserved");
}

/// `Allocator::access_from`: a kernel on the second GPU writes a buffer of the first GPU's
/// default pools once peer access is enabled. Skips with one GPU.
#[test]
#[ignore = "needs two CUDA GPUs with peer access (skips with one)"]
fn a_peer_gpu_writes_default_pool_memory_after_access_from() {
    if mempool::device_count().unwrap_or(0) < 2 {
        eprintln!("one GPU: skipped");
        return;
    }
    let a = gpu();
    a.access_from(1).unwrap();
    a.access_from(1).unwrap(); // twice: not an error
    assert!(matches!(a.access_from(99), Err(Error::InvalidDevice { device: 99, .. })));
    let stream = a.current_stream();
    let n = 1u32 << 20;
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = a.alloc::<f32>(n as usize).unwrap();
    stream.memcpy_htod(&host, &mut x).unwrap();
    stream.synchronize().unwrap();
    // No one else holds GPU 1's primary context here: had `access_from` let go of it, the
    // driver would have destroyed it (and the access), and this would be a fresh one.
    let ctx1 = CudaContext::new(1).unwrap();
    let add_one = kernel(&ctx1, "add_one");
    let s1 = ctx1.default_stream();
    let ptr = x.device_ptr_raw();
    let mut launch = s1.launch_builder(&add_one);
    launch.arg(&ptr).arg(&n);
    // SAFETY: add_one takes (float*, u32); `ptr` holds n floats of GPU 0's memory, which GPU 1
    // may now reach; nothing else uses `x` until the stream is synchronised.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    s1.synchronize().unwrap();
    let back = stream.clone_dtoh(&x).unwrap();
    assert!(back.iter().zip(&host).all(|(b, h)| *b == h + 1.0), "the peer's writes landed");
}
