//! Pinned host memory (`Allocator::pinned`) on a real GPU: a freed pinned buffer is not handed
//! out again while a copy queued on its own stream may still read it; host views wait for the
//! device; bad uses are refused. Run on the GPU machine through `shared/tools/gpu-bundle`.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};
use mempool::{Allocator, Buffer, Error};

const N: usize = 1 << 20;

fn ctx() -> Arc<cudarc::driver::CudaContext> {
    Allocator::cuda(0).expect("CUDA device 0").context().clone()
}

/// Holds `stream` until the host writes 1 into `flag` (a pinned word): a stream memory wait.
fn gate(stream: &CudaStream, flag: &mempool::Buffer<u32>) {
    // The raw address: a cudarc use on `stream` would synchronise it at the end of the borrow,
    // behind the gate itself. `flag` outlives the wait (the test opens the gate before dropping
    // it and synchronises the stream).
    let ptr = flag.device_ptr_raw();
    // SAFETY: `ptr` is a live, device-mapped pinned word; the stream waits until it is >= 1.
    let r = unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            ptr,
            1,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

#[test]
fn pinned_invalid_device_is_a_clear_error() {
    if let Ok(n) = mempool::device_count() {
        assert_eq!(Allocator::pinned(n).unwrap_err(), Error::InvalidDevice { device: n, count: n });
    }
}

/// A copy from pinned memory queued behind a closed gate, its source already dropped.
struct Gated {
    /// The gate: 0 keeps stream `s` waiting; 1 opens it (a pinned word on the side stream, so
    /// its host view does not wait for `s`).
    flag: Buffer<u32, mempool::Cuda>,
    s: Arc<CudaStream>,
    side: Arc<CudaStream>,
    /// The copy's destination (device memory).
    dst: Buffer<u8, mempool::Cuda>,
    /// The dropped source's address.
    old: u64,
    /// `s` current for both allocators while the test runs.
    _on: (mempool::StreamGuard, mempool::StreamGuard),
}

/// `N` bytes of `pinned` memory filled with `byte` on a new stream, copied to `gpu` memory on
/// that stream behind a closed gate, then dropped (the copy has not read them yet).
fn gated_copy(pinned: &Allocator<mempool::Cuda>, gpu: &Allocator<mempool::Cuda>, byte: u8) -> Gated {
    let ctx = ctx();
    let (s, side) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let mut flag = {
        let _on = pinned.set_stream(&side).unwrap();
        pinned.alloc_zeros::<u32>(1).unwrap()
    };
    flag.host_slice_mut().unwrap()[0] = 0;
    let _on = (pinned.set_stream(&s).unwrap(), gpu.set_stream(&s).unwrap());
    let mut src = pinned.alloc::<u8>(N).unwrap();
    src.host_slice_mut().unwrap().fill(byte);
    let mut dst = gpu.alloc_zeros::<u8>(N).unwrap();
    gate(&s, &flag);
    s.memcpy_dtod(&src, &mut dst).unwrap(); // queued behind the gate: reads `src` later
    let old = src.device_ptr_raw();
    drop(src);
    Gated { flag, s, side, dst, old, _on }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gated_copy_keeps_its_pinned_source_out_of_reuse() {
    let pinned = Allocator::pinned(0).unwrap();
    assert!(pinned.is_pinned() && !Allocator::cuda(0).unwrap().is_pinned());
    let gpu = Allocator::cuda(0).unwrap();
    let Gated { mut flag, s, dst, old, _on, .. } = gated_copy(&pinned, &gpu, 0xAB);
    // The copy has not run: the memory must not go to the next pinned allocation, even on the
    // same stream, whose host writes would not wait for the copy.
    let next = pinned.alloc::<u8>(N).unwrap();
    assert_ne!(next.device_ptr_raw(), old, "a pinned block was reused while a queued copy still reads it");
    flag.host_slice_mut().unwrap()[0] = 1; // open the gate
    s.synchronize().unwrap();
    assert!(s.clone_dtoh(&dst).unwrap().iter().all(|&b| b == 0xAB), "the copy read the original data");
    let next_addr = next.device_ptr_raw();
    drop(next);
    // Their events done, the blocks are cached and reused as usual (no new memory).
    s.synchronize().unwrap();
    let reserved = pinned.memory_stats().reserved_bytes.all.current;
    let again = pinned.alloc::<u8>(N).unwrap();
    assert!([old, next_addr].contains(&again.device_ptr_raw()), "a cached pinned block is reused");
    assert_eq!(pinned.memory_stats().reserved_bytes.all.current, reserved);
    drop(again);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_round_trip_host_views_and_release() {
    let pinned = Allocator::pinned(0).unwrap();
    let gpu = Allocator::cuda(0).unwrap();
    let s = gpu.current_stream();
    let _on = pinned.set_stream(&s).unwrap();
    let mut h = pinned.alloc::<u32>(N).unwrap();
    for (i, x) in h.host_slice_mut().unwrap().iter_mut().enumerate() {
        *x = i as u32 * 3;
    }
    let mut d = gpu.alloc::<u32>(N).unwrap();
    s.memcpy_dtod(&h, &mut d).unwrap(); // pinned -> device, asynchronously
    let mut back = pinned.alloc_zeros::<u32>(N).unwrap();
    s.memcpy_dtod(&d, &mut back).unwrap(); // device -> pinned
                                           // The host view waits for the copy into it.
    assert!(back.host_slice().unwrap().iter().enumerate().all(|(i, &x)| x == i as u32 * 3));
    // Device memory has no host view.
    let e = d.host_slice().unwrap_err();
    assert!(e.to_string().contains("no host view"), "{e}");
    let stats = pinned.memory_stats();
    assert!(stats.reserved_bytes.all.current as usize >= 2 * N * 4);
    assert_eq!(pinned.snapshot().backend, "cuda_pinned");
    drop((h, back, d));
    s.synchronize().unwrap();
    pinned.empty_cache().unwrap();
    assert_eq!(pinned.memory_stats().reserved_bytes.all.current, 0, "pinned memory went back");
}

/// A pinned buffer the device never used goes back at once (no event to wait for), even while
/// its stream is held; one the device used waits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_only_pinned_buffers_need_no_event() {
    let pinned = Allocator::pinned(0).unwrap();
    let ctx = ctx();
    let (s, side) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let mut flag = {
        let _on = pinned.set_stream(&side).unwrap();
        pinned.alloc_zeros::<u32>(1).unwrap()
    };
    flag.host_slice_mut().unwrap()[0] = 0;
    let _on = pinned.set_stream(&s).unwrap();
    gate(&s, &flag); // `s` is held from here
                     // 12 MiB: each allocation gets a segment of its own, so reserved bytes tell reuse apart.
    const BIG: usize = 12 << 20;
    let c = pinned.alloc::<u8>(BIG).unwrap();
    let addr = c.device_ptr_raw(); // a raw address: counts as a device use
    drop(c);
    let d = pinned.alloc::<u8>(BIG).unwrap();
    assert_ne!(d.device_ptr_raw(), addr, "used by the device (raw address): waits for the stream");
    let e = pinned.alloc::<u8>(BIG).unwrap();
    drop(e); // never given to the device
    let reserved = pinned.memory_stats().reserved_bytes.all.current;
    let f = pinned.alloc::<u8>(BIG).unwrap();
    let after = pinned.memory_stats().reserved_bytes.all.current;
    flag.host_slice_mut().unwrap()[0] = 1;
    s.synchronize().unwrap();
    drop((d, f));
    assert_eq!(after, reserved, "the host-only buffer's memory was handed out again at once");
}

/// `pinned_use_cuda_host_register`: page-aligned memory faulted in on 8 threads, then
/// registered; the same round trip and release as `cuMemHostAlloc` memory. Prints the time a
/// fresh 1 GiB segment takes either way.
#[test]
#[ignore = "needs a CUDA GPU"]
fn registered_pinned_memory_round_trip_and_release() {
    let cfg =
        mempool::Config::builder().pinned_use_cuda_host_register(true).pinned_num_register_threads(8).build().unwrap();
    let reg = Allocator::pinned_with(0, cfg).unwrap();
    let plain = Allocator::pinned_with(0, mempool::Config::default()).unwrap();
    assert!(reg.is_pinned());
    for (name, a) in [("cuMemHostRegister, 8 threads", &reg), ("cuMemHostAlloc", &plain)] {
        let t = std::time::Instant::now();
        let big = a.alloc::<u8>(1 << 30).unwrap();
        println!("a fresh 1 GiB pinned segment ({name}): {:?}", t.elapsed());
        drop(big);
    }
    let gpu = Allocator::cuda(0).unwrap();
    let s = gpu.current_stream();
    let _on = reg.set_stream(&s).unwrap();
    let mut h = reg.alloc::<u32>(N).unwrap();
    for (i, x) in h.host_slice_mut().unwrap().iter_mut().enumerate() {
        *x = (i as u32) ^ 0x5A5A_5A5A;
    }
    let mut d = gpu.alloc::<u32>(N).unwrap();
    s.memcpy_dtod(&h, &mut d).unwrap();
    let mut back = reg.alloc_zeros::<u32>(N).unwrap();
    s.memcpy_dtod(&d, &mut back).unwrap();
    assert!(back.host_slice().unwrap().iter().enumerate().all(|(i, &x)| x == (i as u32) ^ 0x5A5A_5A5A));
    drop((h, back, d));
    s.synchronize().unwrap();
    reg.empty_cache().unwrap();
    assert_eq!(reg.memory_stats().reserved_bytes.all.current, 0, "unregistered and freed");
}

/// Registering your own memory: device-visible at its address while registered; memory that is
/// already registered (pinned memory here) or an empty range is refused and nothing changes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn registering_host_memory_and_refusing_twice() {
    use mempool::backend::cuda::HostRegistration;
    let gpu = Allocator::cuda(0).unwrap();
    let mut mine = vec![7u8; 1 << 20];
    let host_addr = mine.as_ptr() as u64;
    let mut r = HostRegistration::new(0, &mut mine).unwrap();
    assert_eq!(r.device_ptr(), host_addr, "unified addressing: the same address");
    let d = gpu.alloc_zeros::<u8>(1 << 20).unwrap();
    let s = gpu.current_stream();
    s.synchronize().unwrap();
    // SAFETY: both ranges are 1 MiB, live for the call (the registration and `d`), and nothing
    // else uses them; the copy is synchronous.
    let rc = unsafe { sys::cuMemcpy(d.device_ptr_raw(), r.device_ptr(), 1 << 20) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    assert!(s.clone_dtoh(&d).unwrap().iter().all(|&b| b == 7), "the device read the registered memory");
    r.as_mut_slice()[0] = 9;
    drop(r);
    assert_eq!(mine[0], 9);
    // Memory registered already (a registered-mode pinned allocator's): refused as such, and
    // the buffer still works; pinned memory from cuMemHostAlloc: refused too.
    let cfg = mempool::Config::builder().pinned_use_cuda_host_register(true).build().unwrap();
    let registered = Allocator::pinned_with(0, cfg).unwrap();
    let mut p = registered.alloc::<u8>(4096).unwrap();
    p.host_slice_mut().unwrap().fill(3);
    let e = HostRegistration::new(0, p.host_slice_mut().unwrap()).unwrap_err();
    println!("registering registered memory: {e}");
    assert!(e.to_string().contains("already registered"), "{e}");
    assert!(p.host_slice().unwrap().iter().all(|&b| b == 3));
    let pinned = Allocator::pinned(0).unwrap();
    let mut q = pinned.alloc::<u8>(4096).unwrap();
    q.host_slice_mut().unwrap().fill(4);
    let e = HostRegistration::new(0, q.host_slice_mut().unwrap()).unwrap_err();
    println!("registering cuMemHostAlloc memory: {e}");
    assert!(e.to_string().contains("nothing was changed"), "{e}");
    assert!(q.host_slice().unwrap().iter().all(|&b| b == 4));
    let e = HostRegistration::new(0, &mut []).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}

/// `pinned_round_power2` (PyTorch's host allocator's rule) rounds pinned sizes up to a power of
/// two (device allocators ignoring it: `sim_rules`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_round_power2_applies_to_pinned_allocators_only() {
    let cfg = mempool::Config::parse("pinned_round_power2:True").unwrap();
    let pinned = Allocator::pinned_with(0, cfg.clone()).unwrap();
    assert!(pinned.config().pinned_round_power2);
    let b = pinned.alloc::<u8>(3000).unwrap();
    assert_eq!(pinned.memory_stats().allocated_bytes.all.current, 4096);
    let big = pinned.alloc::<u8>((1 << 20) + 1).unwrap();
    assert_eq!(pinned.memory_stats().allocated_bytes.all.current, 4096 + (2 << 20));
    drop((b, big));
}

/// The state of the block at `addr` in `a`'s snapshot (a snapshot processes no event).
fn block_state_at(a: &Allocator, addr: u64) -> Option<mempool::BlockState> {
    a.snapshot().segments.iter().flat_map(|s| s.blocks.iter()).find(|b| b.address == addr).map(|b| b.state)
}

/// `pinned_reserve_segment_size_mb`: the reserve is pinned memory from the allocator's creation
/// (reserved bytes count it), the small buffers of the default stream are carved from it and
/// carry real copies both ways, and `empty_cache` keeps it while ordinary segments go back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_reserve_segment_serves_small_default_stream_buffers() {
    const RESERVE: usize = 16 << 20;
    let cfg = mempool::Config::parse("pinned_reserve_segment_size_mb:16").unwrap();
    let pinned = Allocator::pinned_with(0, cfg).unwrap();
    let stats = pinned.memory_stats();
    assert_eq!((stats.reserved_bytes.all.current, stats.num_device_alloc), (RESERVE as i64, 1));
    let snap = pinned.snapshot();
    assert_eq!(snap.segments.len(), 1, "the reserve alone, before any request");
    let (base, end) = (snap.segments[0].address, snap.segments[0].address + RESERVE as u64);
    let gpu = Allocator::cuda(0).unwrap();
    let s = gpu.current_stream(); // the default stream, the reserve's
    const SMALL: usize = 1 << 16; // 256 KiB of u32
    let mut h = pinned.alloc::<u32>(SMALL).unwrap();
    for (i, x) in h.host_slice_mut().unwrap().iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(2_654_435_761);
    }
    let mut d = gpu.alloc::<u32>(SMALL).unwrap();
    s.memcpy_dtod(&h, &mut d).unwrap(); // pinned (reserve) -> device
    let mut back = pinned.alloc_zeros::<u32>(SMALL).unwrap();
    s.memcpy_dtod(&d, &mut back).unwrap(); // device -> pinned (reserve)
    assert!(back.host_slice().unwrap().iter().enumerate().all(|(i, &x)| x == (i as u32).wrapping_mul(2_654_435_761)));
    for b in [&h, &back] {
        let a = b.device_ptr_raw();
        assert!((base..end).contains(&a), "{a:#x} is not in the reserve {base:#x}..{end:#x}");
    }
    assert_eq!(pinned.memory_stats().num_device_alloc, 1, "no segment beyond the reserve");
    // A large buffer gets a segment of its own, which `empty_cache` gives back; not the reserve.
    let big = pinned.alloc::<u8>(4 << 20).unwrap();
    assert!(!(base..end).contains(&big.device_ptr_raw()));
    drop((h, back, d, big));
    s.synchronize().unwrap();
    pinned.empty_cache().unwrap();
    assert_eq!(pinned.memory_stats().reserved_bytes.all.current, RESERVE as i64, "the reserve stays");
    let snap = pinned.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].address, base);
    assert_eq!(snap.segments[0].blocks.len(), 1, "wholly free again");
}

/// `pinned_use_background_threads` (with a reserve too): a copy gated behind a stream that has
/// not run yet keeps its dropped pinned source out of reuse while the gate is closed, even with
/// the background thread looking; once the gate opens, the thread files the block with no
/// allocation made, and the next request of that size gets it back without new memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_background_thread_keeps_a_gated_copy_source_out_of_reuse_then_files_it() {
    let cfg = mempool::Config::parse("pinned_use_background_threads:True,pinned_reserve_segment_size_mb:8").unwrap();
    let pinned = Allocator::pinned_with(0, cfg).unwrap();
    assert!(pinned.config().pinned_use_background_threads);
    let gpu = Allocator::cuda(0).unwrap();
    let Gated { mut flag, s, side, dst, old, _on } = gated_copy(&pinned, &gpu, 0x5C);
    // The thread looks many times meanwhile; the event cannot complete, the block must wait.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(block_state_at(&pinned, old), Some(mempool::BlockState::AwaitingStreams));
    let next = pinned.alloc::<u8>(N).unwrap();
    assert_ne!(next.device_ptr_raw(), old, "a pinned block was reused while a queued copy still reads it");
    flag.host_slice_mut().unwrap()[0] = 1; // open the gate
    s.synchronize().unwrap();
    assert!(s.clone_dtoh(&dst).unwrap().iter().all(|&b| b == 0x5C), "the copy read the original data");
    // No allocation from here: the background thread alone files the block.
    let since = std::time::Instant::now();
    while block_state_at(&pinned, old) != Some(mempool::BlockState::Free) {
        assert!(since.elapsed() < std::time::Duration::from_secs(5), "the background thread did not file the block");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    println!("filed by the background thread {:?} after the stream finished", since.elapsed());
    let reserved = pinned.memory_stats().reserved_bytes.all.current;
    let again = pinned.alloc::<u8>(N).unwrap();
    assert_eq!(again.device_ptr_raw(), old, "the filed block is handed out again");
    assert_eq!(pinned.memory_stats().reserved_bytes.all.current, reserved, "no new memory");
    drop((again, next, flag));
    s.synchronize().unwrap();
    side.synchronize().unwrap();
    // Dropping the allocator stops its thread and gives every segment back (reserve included).
    drop(pinned);
}
