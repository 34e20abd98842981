//! Attacks on expandable segments from a hostile review (each failed before its fix):
//! requests that best fit's rules pass over a grown block for (`max_split_size`, whole-block
//! pools) mapped the whole device; a reservation made for a request that then found a freed
//! block was never given back.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, Config, Error, MemPool, PoolOptions};

const MIB: usize = 1 << 20;

fn mapped_bytes(sim: &SimDevice) -> usize {
    sim.mapped().iter().map(|m| m.1).sum()
}

/// max_split_size_mb with expandable segments: the very first 23 MiB request on a 1 GiB device.
#[test]
fn max_split_with_expandable_first_request() {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder().expandable_segments(true).max_split_size_mb(24).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    let r = a.alloc::<u8>(23 * MIB);
    eprintln!(
        "alloc(23 MiB): {:?}; mapped {} MiB; maps {:?}",
        r.as_ref().map(|b| b.device_ptr_raw()).map_err(|e| e.to_string()),
        mapped_bytes(&sim) / MIB,
        sim.map_counters()
    );
    check_invariants(&a, Some(&sim));
    assert!(r.is_ok(), "spurious OOM: {}", r.unwrap_err());
}

/// A no_split expandable pool: a free 30 MiB block at the end of the segment, then a 4 MiB request.
#[test]
fn no_split_expandable_pool_small_request_after_big_free() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_split(true)).unwrap();
    drop(p.alloc::<u8>(30 * MIB).unwrap());
    let before = sim.map_counters();
    let r = p.alloc::<u8>(4 * MIB);
    eprintln!(
        "alloc(4 MiB): {:?}; maps/unmaps before {:?} after {:?}; retries {}",
        r.as_ref().map(|b| b.device_ptr_raw()).map_err(|e| e.to_string()),
        before,
        sim.map_counters(),
        a.memory_stats().num_alloc_retries
    );
    check_invariants(&a, Some(&sim));
    assert!(r.is_ok(), "spurious OOM: {}", r.unwrap_err());
    assert_eq!(a.memory_stats().num_alloc_retries, 0, "the whole device was mapped, then unmapped by the OOM ladder");
}

/// Oversize request (>= max_split) after a big free block at the segment's end.
#[test]
fn max_split_oversize_request_after_big_free() {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder().expandable_segments(true).max_split_size_mb(22).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    let x = a.alloc::<u8>(60 * MIB).unwrap();
    drop(x);
    let before = sim.map_counters();
    let r = a.alloc::<u8>(30 * MIB);
    eprintln!(
        "alloc(30 MiB): {:?}; maps/unmaps before {:?} after {:?}; retries {}",
        r.as_ref().map(|b| b.device_ptr_raw()).map_err(|e| e.to_string()),
        before,
        sim.map_counters(),
        a.memory_stats().num_alloc_retries
    );
    check_invariants(&a, Some(&sim));
    assert!(r.is_ok(), "spurious OOM: {}", r.unwrap_err());
    assert_eq!(a.memory_stats().num_alloc_retries, 0, "the whole device was mapped, then unmapped by the OOM ladder");
}

/// Huge requests with expandable on.
#[test]
fn huge_requests() {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder().expandable_segments(true).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    for n in [usize::MAX, usize::MAX / 2, 1 << 40, (1 << 40) - 512, (1 << 40) - (2 << 20), 1 << 39, 2 << 30] {
        let r = a.alloc::<u8>(n);
        match r {
            Err(Error::OutOfMemory(_)) => {}
            other => panic!("{n}: {:?}", other.map(|b| b.device_ptr_raw())),
        }
        check_invariants(&a, Some(&sim));
        assert!(sim.reservations().len() <= 1, "{n}: {:?}", sim.reservations());
    }
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    assert!(sim.reservations().is_empty(), "{:?}", sim.reservations());
}

/// Host backend with expandable config.
#[test]
fn host_with_expandable() {
    let cfg = Config::builder().expandable_segments(true).build().unwrap();
    let a = Allocator::host_with(mempool::backend::host::HostBackend::new(), cfg);
    assert!(!a.config().expandable_segments);
    let b = a.alloc::<u8>(3 * MIB).unwrap();
    drop(b);
    a.empty_cache().unwrap();
    check_invariants(&a, None);
}

/// A reservation made by a growth that, on its retry, finds a block another thread freed while
/// the reservation was being made, is never given back (empty_cache, allocator drop).
#[test]
fn reservation_made_while_another_thread_frees_is_leaked() {
    let sim = SimDevice::new(256 * MIB);
    let cfg = Config::builder()
        .expandable_segments(true)
        .memory_fraction(0.99)
        .garbage_collection_threshold(0.5)
        .build()
        .unwrap();
    let a = Arc::new(Allocator::sim_with(sim.clone(), cfg));
    let s = sim.new_stream();
    let s2 = sim.new_stream();
    {
        // A wholly free 2 MiB segment on another stream, for garbage collection to unmap.
        let _g = a.set_stream(&s2).unwrap();
        drop(a.alloc::<u8>(2 * MIB).unwrap());
    }
    // Thread B holds 200 MiB on stream s (the reservation of s has 56 MiB unmapped left).
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (a2, s_b) = (a.clone(), s);
    let b = std::thread::spawn(move || {
        let _g = a2.set_stream(&s_b).unwrap();
        let x = a2.alloc::<u8>(200 * MIB).unwrap();
        ready_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        drop(x);
        done_tx.send(()).unwrap();
    });
    ready_rx.recv().unwrap();
    assert_eq!(sim.reservations().len(), 2);
    // When A's growth lets the lock go (it runs the outbox: garbage collection's SegmentUnmap),
    // B frees its 200 MiB.
    let me = a.id();
    let fired = Arc::new(AtomicBool::new(false));
    let chans = Arc::new(Mutex::new((go_tx, done_rx)));
    let (f2, c2) = (fired.clone(), chans.clone());
    let _h = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentUnmap && !f2.swap(true, Ordering::SeqCst) {
            let c = c2.lock().unwrap();
            c.0.send(()).unwrap();
            c.1.recv().unwrap();
        }
    })
    .unwrap();
    let y = {
        let _g = a.set_stream(&s).unwrap();
        a.alloc::<u8>(100 * MIB).unwrap()
    };
    b.join().unwrap();
    assert!(fired.load(Ordering::SeqCst));
    eprintln!("y at {:#x}; reservations {:?}", y.device_ptr_raw(), sim.reservations());
    check_invariants(&a, Some(&sim));
    drop(y);
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
    eprintln!("after empty_cache: mapped {:?} reservations {:?}", sim.mapped(), sim.reservations());
    let leaked = sim.reservations();
    drop(_h);
    drop(Arc::try_unwrap(a).ok().unwrap());
    eprintln!("after dropping the allocator: reservations {:?}", sim.reservations());
    assert!(leaked.is_empty() && sim.reservations().is_empty(), "reservation leaked");
}

/// A guard that refuses every unmap: pool release and the allocator's drop neither hang nor
/// crash; the memory stays mapped (the guard's promise) until the device goes.
#[test]
fn a_guard_that_refuses_every_unmap_does_not_hang_release_or_drop() {
    struct Never;
    impl mempool::MapGuard for Never {
        fn mapped(&self, _: u64, _: usize) {}
        fn unmapping(&self, a: u64, _: usize) -> Result<(), String> {
            Err(format!("{a:#x} held forever"))
        }
    }
    let sim = mempool::sim::SimDevice::new(1 << 30);
    let cfg = mempool::Config::builder().expandable_segments(true).build().unwrap();
    let a = mempool::Allocator::sim_with(sim.clone(), cfg);
    let p = mempool::MemPool::on(&a, mempool::PoolOptions::new().expandable(true).map_guard(Never)).unwrap();
    let x = p.alloc::<u8>(3 << 20).unwrap();
    drop(x);
    assert!(p.empty_cache().is_err());
    assert!(p.empty_cache().is_err(), "refused again, not lost");
    drop(p);
    let _ = a.empty_cache();
    assert!(!sim.mapped().is_empty(), "a refused unmap keeps the memory mapped");
    let y = a.alloc::<u8>(1 << 20).unwrap();
    drop(y);
    drop(a);
}
