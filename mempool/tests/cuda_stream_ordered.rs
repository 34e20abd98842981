//! CUDA's stream-ordered pools as a segment source (`StreamOrderedAllocator`) on a real GPU: the
//! caching layer in front of an explicit `cuMemPoolCreate` pool; the driver's reserved bytes next
//! to ours; `trim_to(0)` gives everything back; peer access for a kernel on the second GPU.
//! Run on the GPU machine through `shared/tools/gpu-bundle`.

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::backend::stream_ordered::{StreamOrderedAllocator, StreamOrderedOptions};
use mempool::{Allocator, Error, MemPool, PoolOptions};

const MIB: usize = 1 << 20;

#[test]
fn bad_devices_are_clear_errors() {
    if let Ok(n) = mempool::device_count() {
        let e = StreamOrderedAllocator::new(n, StreamOrderedOptions::default()).unwrap_err();
        assert_eq!(e, Error::InvalidDevice { device: n, count: n });
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_over_a_driver_pool_round_trip_stats_and_trim() {
    let gpu = Allocator::cuda(0).unwrap();
    let stream = gpu.current_stream();
    let source = Arc::new(StreamOrderedAllocator::new(0, StreamOrderedOptions::default()).unwrap());
    let pool = MemPool::on(&gpu, PoolOptions::new().shared_allocator(source.clone())).unwrap();
    let data: Vec<u32> = (0..(8 * MIB / 4) as u32).collect();
    let mut a = pool.alloc::<u32>(data.len()).unwrap();
    stream.memcpy_htod(&data, &mut a).unwrap();
    assert_eq!(stream.clone_dtoh(&a).unwrap(), data);
    let small = pool.alloc_zeros::<u8>(1000).unwrap();
    assert!(stream.clone_dtoh(&small).unwrap().iter().all(|&b| b == 0));
    stream.synchronize().unwrap();
    let ours = pool.memory_stats().reserved_bytes.current as u64;
    let (used, reserved) = (source.used().unwrap(), source.reserved().unwrap());
    println!("ours reserved {ours}, driver used {used}, driver reserved {reserved}");
    assert_eq!(used, ours, "the driver's used bytes are our segments");
    assert!(reserved >= used);
    // A cache hit: no driver call (the driver's used bytes do not move).
    let addr = a.device_ptr_raw();
    drop(a);
    let again = pool.alloc::<u32>(data.len()).unwrap();
    assert_eq!(again.device_ptr_raw(), addr);
    assert_eq!(source.used().unwrap(), used);
    drop((again, small));
    pool.empty_cache().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(source.used().unwrap(), 0, "our segments went back to the driver pool");
    source.trim_to(0).unwrap();
    assert_eq!(source.reserved().unwrap(), 0, "trim_to(0) with nothing live: the driver holds nothing");
}

#[test]
#[ignore = "needs two CUDA GPUs with peer access (skips with one)"]
fn a_peer_gpu_reads_and_writes_a_stream_ordered_pool_buffer() {
    if mempool::device_count().unwrap_or(0) < 2 {
        eprintln!("one GPU: skipped");
        return;
    }
    let gpu = Allocator::cuda(0).unwrap();
    let stream = gpu.current_stream();
    let source = Arc::new(StreamOrderedAllocator::new(0, StreamOrderedOptions::default()).unwrap());
    source.access_from(1).unwrap();
    let pool = MemPool::on(&gpu, PoolOptions::new().shared_allocator(source.clone())).unwrap();
    let n = (3 * MIB / 4) as u32;
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = pool.alloc::<f32>(n as usize).unwrap();
    stream.memcpy_htod(&host, &mut x).unwrap();
    stream.synchronize().unwrap();
    let ctx1 = CudaContext::new(1).unwrap();
    let module = ctx1.load_module(Ptx::from_src(common::ptx::KERNELS)).unwrap();
    let add_one = module.load_function("add_one").unwrap();
    let s1 = ctx1.default_stream();
    let ptr = x.device_ptr_raw();
    let mut launch = s1.launch_builder(&add_one);
    launch.arg(&ptr).arg(&n);
    // SAFETY: add_one takes (float*, u32); `ptr` holds n floats of GPU 0's pool memory, to which
    // GPU 1 was given read/write access; nothing else uses `x` until the stream is synchronised.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    s1.synchronize().unwrap();
    let back = stream.clone_dtoh(&x).unwrap();
    assert!(back.iter().zip(&host).all(|(b, h)| *b == h + 1.0), "the peer read and wrote the pool's memory");
    let e = source.access_from(99).unwrap_err();
    assert!(matches!(e, Error::InvalidDevice { device: 99, .. }), "{e}");
}

/// `MEMPOOL_ALLOC_CONF=backend:cudaMallocAsync` (PyTorch's backend of that name): the default
/// pools take every buffer straight from a stream-ordered driver pool, exactly sized, and give
/// it back at its free, with no caching. Runs itself in a child process with the setting (the
/// process-wide allocator reads it once).
#[test]
#[ignore = "needs a CUDA GPU"]
fn backend_cuda_malloc_async_passes_every_buffer_to_the_driver() {
    const NAME: &str = "backend_cuda_malloc_async_passes_every_buffer_to_the_driver";
    if std::env::var_os("MEMPOOL_TEST_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--include-ignored", "--nocapture"])
            .env("MEMPOOL_TEST_CHILD", "1")
            .env("MEMPOOL_ALLOC_CONF", "backend:cudaMallocAsync")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    assert!(a.config().malloc_async, "in effect");
    assert!(!a.config().thread_cache, "no caching layer, no thread caches");
    let s = a.current_stream();
    let x = a.alloc::<u8>(1000).unwrap();
    let data: Vec<u8> = (0..(3 * MIB)).map(|i| i as u8).collect();
    let mut y = a.alloc::<u8>(3 * MIB).unwrap();
    s.memcpy_htod(&data, &mut y).unwrap();
    assert_eq!(s.clone_dtoh(&y).unwrap(), data);
    let st = a.memory_stats();
    assert_eq!(st.segment.all.current, 2, "a segment per buffer");
    assert_eq!(st.reserved_bytes.all.current as usize, 1024 + 3 * MIB, "exact sizes, nothing cached");
    drop(x);
    assert_eq!(a.memory_stats().reserved_bytes.all.current as usize, 3 * MIB, "given back at its free");
    drop(y);
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    s.synchronize().unwrap();
}
