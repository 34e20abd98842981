//! Probes of the thread caches' large bin (one large block per thread, reused only while its
//! free set is unchanged): exactly one owner of every cached large block under drains from other
//! threads, exited threads, out-of-memory, captures and the allocator's drop; statistics exact;
//! everything back at the end.

mod common;

use std::sync::{Arc, Barrier};

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, CaptureMode, MemPool, PoolOptions};

const MIB: usize = 1 << 20;

/// A large block freed by a thread that then exits goes back to its set at the next drain.
#[test]
fn an_exited_threads_cached_large_block_is_given_back() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let a2 = a.clone();
    std::thread::spawn(move || drop(a2.alloc::<u8>(40 * MIB).unwrap())).join().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert!(sim.live_segments().is_empty());
    check_invariants(&a, Some(&sim));
}

/// Threads cycling large sizes while another thread empties caches, takes snapshots and
/// statistics: no block handed out twice (the simulated addresses of live buffers never
/// overlap), and at rest everything is exact and goes back.
#[test]
fn large_cycles_against_concurrent_drains() {
    common::drains::race_drains(
        4 << 30,
        4,
        2_000,
        200,
        11,
        |t| t % 2 == 0,
        |a, rng, live, _| {
            let size = if rng.below(4) == 0 { (2 + rng.below(60) as usize) * MIB } else { 8 * MIB };
            let b = a.alloc::<u8>(size).unwrap();
            live.add(&b);
            live.remove(&b);
            drop(b);
        },
    );
}

/// A cached large block on another thread is given back by the out-of-memory ladder: a request
/// that fits only once it is back succeeds.
#[test]
fn out_of_memory_takes_other_threads_cached_large_blocks() {
    let sim = SimDevice::new(100 * MIB);
    let a = Allocator::sim(sim.clone());
    let (a2, go, done) = (a.clone(), Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let (g2, d2) = (go.clone(), done.clone());
    let t = std::thread::spawn(move || {
        drop(a2.alloc::<u8>(60 * MIB).unwrap()); // cached on this thread
        g2.wait();
        d2.wait(); // stays alive (its cache is not orphaned) while main allocates
    });
    go.wait();
    let big = a.alloc::<u8>(90 * MIB).unwrap();
    done.wait();
    t.join().unwrap();
    drop(big);
    check_invariants(&a, Some(&sim));
}

/// The allocator dropped while other threads still hold cached large blocks (their threads
/// alive): nothing panics and every segment goes back.
#[test]
fn allocator_dropped_with_large_blocks_cached_on_live_threads() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let (go, done) = (Arc::new(Barrier::new(3)), Arc::new(Barrier::new(3)));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (a, go, done) = (a.clone(), go.clone(), done.clone());
            std::thread::spawn(move || {
                drop(a.alloc::<u8>(30 * MIB).unwrap());
                drop(a);
                go.wait();
                done.wait();
            })
        })
        .collect();
    go.wait();
    drop(a);
    assert!(sim.live_segments().is_empty(), "segments left: {:?}", sim.live_segments());
    done.wait();
    for t in threads {
        t.join().unwrap();
    }
}

/// A large block cached before a capture is not handed to the capture (it is the default pools'),
/// and the capture's own large frees go back to the graph pool, never to a thread cache.
#[test]
fn captures_never_take_or_leave_cached_large_blocks() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let b = a.alloc::<u8>(40 * MIB).unwrap();
    let cached_at = b.device_ptr_raw();
    drop(b); // in this thread's large bin
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    let c = a.alloc::<u8>(40 * MIB).unwrap();
    assert_ne!(c.device_ptr_raw(), cached_at, "the capture got the default pools' cached block");
    assert_eq!(p.memory_stats().allocated_bytes.current, 40 * MIB as i64);
    let c_at = c.device_ptr_raw();
    drop(c);
    let g = cap.end().unwrap();
    // After the capture, a default-pool request of the same size does not get the graph's block.
    let d = a.alloc::<u8>(40 * MIB).unwrap();
    assert_ne!(d.device_ptr_raw(), c_at, "a default-pool allocation got the graph's temporary");
    drop((d, g, p));
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    check_invariants(&a, Some(&sim));
}
