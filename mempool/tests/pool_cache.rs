//! User pools through the thread caches: a block of a pool freed by a thread and asked for again
//! by that thread (same stream, same pool, same size) comes back without the lock, as a deferred
//! free (see `caching/tcache.rs`). Nothing a user relies on changes: the pool's statistics (totals
//! and peaks), its release when its last block is freed, its `empty_cache`, and the other pools.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, BackendError, Counting, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

const MIB: usize = 1 << 20;

/// A segment source handing out distinct made-up ranges (the simulated device never touches them).
struct MadeUp(AtomicU64);

// SAFETY: used with simulated allocators only, whose memory is never read or written; every range
// handed out is distinct and 512-aligned.
unsafe impl RawAllocator for MadeUp {
    fn name(&self) -> &str {
        "made-up"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        Ok(0x7000_0000_0000 + self.0.fetch_add(size.next_multiple_of(512) as u64, Ordering::Relaxed))
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        Ok(())
    }
}

fn setup() -> (Arc<SimDevice>, Allocator<Sim>, Arc<Counting<MadeUp>>, MemPool<Sim>) {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let source = Counting::new(MadeUp(AtomicU64::new(0)));
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(source.clone())).unwrap();
    (sim, a, source, pool)
}

/// Alloc and free of one size in a pool, in turn: the same block each time, the pool's figures
/// exact (every reuse counted in the totals), the device's too.
#[test]
fn a_pool_pair_reuses_its_block_with_exact_statistics() {
    let (sim, a, source, pool) = setup();
    let first = pool.alloc::<u8>(4096).unwrap();
    let addr = first.device_ptr_raw();
    drop(first);
    for _ in 0..99 {
        let b = pool.alloc::<u8>(4096).unwrap();
        assert_eq!(b.device_ptr_raw(), addr, "the cached block comes back");
    }
    let s = pool.memory_stats();
    assert_eq!(s.allocation.current, 0);
    assert_eq!(s.allocation.allocated, 100, "every reuse is an allocation of the pool");
    assert_eq!(s.allocation.freed, 100);
    assert_eq!(s.allocated_bytes.allocated, 100 * 4096);
    assert_eq!(s.requested_bytes.allocated, 100 * 4096);
    assert_eq!(s.allocation.peak, 1);
    assert_eq!(s.allocated_bytes.peak, 4096);
    assert_eq!(source.counts().allocs, 1);
    let d = a.memory_stats();
    assert_eq!((d.allocation.all.current, d.allocation.all.allocated), (0, 100));
    check_invariants(&a, Some(&sim));
}

/// Inside a scope (`pool.scope()`), `Allocator::alloc` goes to the pool through the cache too.
#[test]
fn scoped_allocations_use_the_cache_and_stay_in_their_pool() {
    let (sim, a, _source, pool) = setup();
    let (in_pool, outside) = {
        let _s = pool.scope();
        let b = a.alloc::<u8>(8192).unwrap();
        let addr = b.device_ptr_raw();
        drop(b);
        (addr, a.alloc::<u8>(8192).unwrap())
    };
    assert_eq!(outside.device_ptr_raw(), in_pool, "the pool's block, reused in its scope");
    // Out of the scope: the default pools, not the pool's cached block.
    drop(outside);
    let d = a.alloc::<u8>(8192).unwrap();
    assert!(d.device_ptr_raw() < 0x7000_0000_0000, "a default-pool block out of the scope");
    assert_eq!(pool.memory_stats().allocation.allocated, 2);
    drop(d);
    check_invariants(&a, Some(&sim));
}

/// The pool's last handle goes while its block waits in this thread's cache: the block is filed
/// and the pool's segment goes back at once.
#[test]
fn dropping_a_pool_gives_back_a_segment_held_in_a_cache() {
    let (sim, a, source, pool) = setup();
    drop(pool.alloc::<u8>(4096).unwrap());
    assert_eq!(source.counts().live_bytes, 2 * MIB);
    drop(pool);
    assert_eq!(source.counts().live_bytes, 0, "the segment went back with the pool");
    check_invariants(&a, Some(&sim));
}

/// A buffer that outlives its pool's handle: freed, it is not cached (the pool is released) and
/// the segment goes back as its last block is freed, as without caches.
#[test]
fn a_released_pools_last_block_is_not_cached() {
    let (sim, a, source, pool) = setup();
    let b = pool.alloc::<u8>(4096).unwrap();
    drop(pool);
    assert_eq!(source.counts().live_bytes, 2 * MIB);
    drop(b);
    assert_eq!(source.counts().live_bytes, 0, "the released pool's last block took its segment back");
    check_invariants(&a, Some(&sim));
}

/// Another thread allocates in the pool (a new peak candidate) while this thread holds the
/// pool's block as a deferred free: the pool's peak leaves it out.
#[test]
fn a_deferred_pool_block_is_not_in_another_threads_pool_peak() {
    let (sim, a, _source, pool) = setup();
    drop(pool.alloc::<u8>(MIB).unwrap());
    let pool = Arc::new(pool);
    {
        let pool = pool.clone();
        std::thread::spawn(move || drop(pool.alloc::<u8>(MIB).unwrap())).join().unwrap();
    }
    let s = pool.memory_stats();
    assert_eq!(s.allocation.peak, 1, "never two blocks at once");
    assert_eq!(s.allocated_bytes.peak, MIB as i64);
    assert_eq!(s.allocation.allocated, 2);
    assert_eq!(s.allocation.current, 0);
    check_invariants(&a, Some(&sim));
}

/// Elided allocations of an exited thread still reach the pool's totals.
#[test]
fn an_exited_threads_pool_reuses_are_counted() {
    let (sim, a, _source, pool) = setup();
    let pool = Arc::new(pool);
    {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for _ in 0..10 {
                drop(pool.alloc::<u8>(4096).unwrap());
            }
        })
        .join()
        .unwrap();
    }
    let s = pool.memory_stats();
    assert_eq!((s.allocation.allocated, s.allocation.current), (10, 0));
    // A second read does not count them twice.
    assert_eq!(pool.memory_stats().allocation.allocated, 10);
    check_invariants(&a, Some(&sim));
}

/// Two pools and the default pools, one size, in turn: each request gets a block of its own
/// pool; figures exact.
#[test]
fn pools_never_share_cached_blocks() {
    let (sim, a, _source, p1) = setup();
    let p2 = MemPool::on(&a, PoolOptions::new()).unwrap();
    for _ in 0..20 {
        let x = p1.alloc::<u8>(4096).unwrap();
        let y = p2.alloc::<u8>(4096).unwrap();
        let z = a.alloc::<u8>(4096).unwrap();
        assert!(x.device_ptr_raw() >= 0x7000_0000_0000, "p1's own source");
        assert_ne!(y.device_ptr_raw(), z.device_ptr_raw());
        drop((x, y, z));
    }
    for p in [&p1, &p2] {
        let s = p.memory_stats();
        assert_eq!((s.allocation.allocated, s.allocation.current), (20, 0));
    }
    p2.empty_cache().unwrap();
    assert_eq!(p2.memory_stats().reserved_bytes.current, 0, "empty_cache took its cached block back");
    check_invariants(&a, Some(&sim));
}

/// The cache is really in the way for pools (and only with `thread_cache` on): a pool block this
/// thread freed is held for this thread, so another thread's request of the same size gets
/// another block; without the caches, best fit gives it the same one.
#[test]
fn a_freed_pool_block_waits_for_its_thread() {
    for cache in [true, false] {
        let sim = SimDevice::new(1 << 30);
        let config = mempool::Config::builder().thread_cache(cache).build().unwrap();
        let a = Allocator::sim_with(sim.clone(), config);
        let pool = Arc::new(MemPool::on(&a, PoolOptions::new()).unwrap());
        // Two default-pool frees in a row: the first is settled (not taken back), so this
        // thread counts its next frees at once for a while; pool blocks are not cached then,
        // and a run of pool pairs brings the deferring back.
        let (p, q) = (a.alloc::<u8>(512).unwrap(), a.alloc::<u8>(1024).unwrap());
        drop(p);
        drop(q);
        for _ in 0..100 {
            drop(pool.alloc::<u8>(4096).unwrap());
        }
        let x = pool.alloc::<u8>(4096).unwrap();
        let addr = x.device_ptr_raw();
        drop(x);
        let other = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.alloc::<u8>(4096).unwrap().device_ptr_raw()).join().unwrap()
        };
        assert_eq!(other == addr, !cache, "thread_cache:{cache}");
        assert_eq!(pool.alloc::<u8>(4096).unwrap().device_ptr_raw(), addr, "this thread gets it back");
        check_invariants(&a, Some(&sim));
    }
}

/// As `thread_cache.rs::a_deferred_block_taken_back_after_a_census_makes_its_peak`, for a pool's
/// own peak: the block left out of another thread's pool peak is taken back through the lock.
#[test]
fn a_deferred_pool_block_taken_back_after_a_census_makes_the_pools_peak() {
    let (sim, a, _source, pool) = setup();
    drop(pool.alloc::<u8>(MIB).unwrap()); // deferred
    let pool = Arc::new(pool);
    let (allocated, go_on) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let other = {
        let pool = pool.clone();
        let (tx, rx) = (allocated.0, go_on.1);
        std::thread::spawn(move || {
            let b = pool.alloc::<u8>(MIB).unwrap();
            tx.send(()).unwrap();
            rx.recv().unwrap();
            drop(b);
        })
    };
    allocated.1.recv().unwrap();
    let mine = pool.alloc::<u8>(MIB).unwrap();
    go_on.0.send(()).unwrap();
    other.join().unwrap();
    drop(mine);
    let s = pool.memory_stats();
    assert_eq!(s.allocation.peak, 2, "two blocks of the pool were live at once");
    assert_eq!(s.allocated_bytes.peak, 2 * MIB as i64);
    let d = a.memory_stats();
    assert_eq!(d.allocation.all.peak, 2);
    check_invariants(&a, Some(&sim));
}
