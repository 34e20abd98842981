//! Expandable segments on a real GPU: buffers in memory mapped on demand (across physical
//! allocations, grown into the pages after a free block), filled and read back by the device;
//! memory unmapped by `empty_cache` goes back to the device.

mod common;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use mempool::{Allocator, MemPool, PoolOptions};

const MIB: usize = 1 << 20;

/// The tests measure the device's free memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu() -> Allocator {
    Allocator::cuda(0).expect("CUDA device 0")
}

fn pattern(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed)).collect()
}

fn device_free() -> usize {
    gpu().device_memory().expect("memory info").0
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn buffers_in_mapped_memory_hold_their_data_and_go_back_to_the_device() {
    let _one = serial();
    let a = gpu();
    let stream = a.current_stream();
    for no_span in [false, true] {
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(no_span)).unwrap();
        let free_before = device_free();
        // 2.5 MiB (two pages, 1.5 MiB left free), then 5 MiB: with blocks spanning physical
        // allocations it grows into the free 1.5 MiB; 50 MiB spans 20 MiB chunks; small blocks.
        let sizes = [5 * MIB / 2, 5 * MIB, 50 * MIB, 4096, 700_000, 130 * MIB];
        let mut bufs = Vec::new();
        for (i, &bytes) in sizes.iter().enumerate() {
            let n = bytes / 4;
            let data = pattern(n, i as u32);
            let mut b = pool.alloc::<u32>(n).unwrap();
            stream.memcpy_htod(&data, &mut b).unwrap();
            bufs.push((b, data));
        }
        if !no_span {
            let (x, y) = (bufs[0].0.device_ptr_raw(), bufs[1].0.device_ptr_raw());
            assert_eq!(y, x + (5 * MIB / 2) as u64, "the 5 MiB block grew into the pages after the first");
        }
        let zeros = pool.alloc_zeros::<u32>(3 * MIB / 4).unwrap();
        for (b, data) in &bufs {
            assert_eq!(&stream.clone_dtoh(b).unwrap(), data, "no_span {no_span}");
        }
        assert!(stream.clone_dtoh(&zeros).unwrap().iter().all(|&x| x == 0));
        let st = pool.memory_stats();
        let reserved = st.reserved_bytes.current as usize;
        let asked: usize = sizes.iter().sum::<usize>() + 3 * MIB;
        println!(
            "no_span {no_span}: asked {asked} bytes, reserved {reserved} (x{:.3})",
            reserved as f64 / asked as f64
        );
        assert!(reserved < asked + 12 * MIB, "expandable memory reserves close to what is used");
        drop(bufs);
        drop(zeros);
        pool.empty_cache().unwrap();
        assert_eq!(pool.memory_stats().reserved_bytes.current, 0);
        let free_after = device_free();
        assert!(
            free_after + 64 * MIB >= free_before,
            "unmapped memory went back to the device: {free_before} free before, {free_after} after"
        );
        // And it maps again.
        let again = pool.alloc::<u32>(MIB).unwrap();
        let data = pattern(MIB, 7);
        let mut again = again;
        stream.memcpy_htod(&data, &mut again).unwrap();
        assert_eq!(stream.clone_dtoh(&again).unwrap(), data);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn many_growths_and_cuts_keep_data_intact() {
    let _one = serial();
    let a = gpu();
    let stream = a.current_stream();
    let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    let mut x: u64 = 42;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut live: Vec<(mempool::Buffer<u32>, Vec<u32>)> = Vec::new();
    for step in 0..400u32 {
        let r = next() % 10;
        if r < 6 || live.is_empty() {
            let n = 1 + (1usize << (next() % 23)) + (next() % 4096) as usize;
            let data = pattern(n, step);
            let mut b = pool.alloc::<u32>(n).unwrap();
            stream.memcpy_htod(&data, &mut b).unwrap();
            live.push((b, data));
        } else if r < 9 {
            let i = (next() % live.len() as u64) as usize;
            let (b, data) = live.swap_remove(i);
            assert_eq!(stream.clone_dtoh(&b).unwrap(), data, "step {step}");
        } else {
            pool.empty_cache().unwrap();
        }
    }
    for (b, data) in &live {
        assert_eq!(&stream.clone_dtoh(b).unwrap(), data);
    }
    drop(live);
    pool.empty_cache().unwrap();
    assert_eq!(pool.memory_stats().reserved_bytes.current, 0);
}

/// A kernel on the second GPU writes a buffer of the first GPU's expandable memory directly (the
/// mapping gives every peer that can reach the device read and write access).
#[test]
#[ignore = "needs two CUDA GPUs with peer access (skips with one)"]
fn a_peer_gpu_writes_expandable_memory() {
    let _one = serial();
    if mempool::device_count().unwrap_or(0) < 2 {
        eprintln!("one GPU: skipped");
        return;
    }
    let a = gpu();
    let stream = a.current_stream();
    let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    // 3 MiB of floats: two physical allocations' worth after a first small growth.
    let _first = pool.alloc::<f32>(300_000).unwrap();
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
    // SAFETY: add_one takes (float*, u32); `ptr` holds n floats of GPU 0's memory, mapped with
    // read/write access for GPU 1, and nothing else uses `x` until the stream is synchronised.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    s1.synchronize().unwrap();
    let back = stream.clone_dtoh(&x).unwrap();
    assert!(back.iter().zip(&host).all(|(b, h)| *b == h + 1.0), "the peer's writes landed");
}
