//! User pools and scopes on the simulated device.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, BackendError, Error, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

const MIB: usize = 1 << 20;

/// A user allocator that hands out addresses from its own range and records every call.
#[derive(Clone, Default)]
struct Counting {
    log: Arc<Mutex<Log>>,
    granularity: usize,
    misalign: bool,
}

#[derive(Default)]
struct Log {
    next: u64,
    live: Vec<(u64, usize)>,
    allocs: usize,
    frees: Vec<(u64, usize)>,
    fail_allocs: usize,
    fail_frees: usize,
    fail_hard: bool,
    capacity: Option<usize>,
}

const USER_BASE: u64 = 0x7000_0000_0000;

impl Counting {
    fn new() -> Counting {
        Counting { granularity: 512, ..Default::default() }
    }
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap()
    }
    fn freed_bytes(&self) -> usize {
        self.log().frees.iter().map(|f| f.1).sum()
    }
}

// SAFETY: only ever used with simulated allocators, whose memory is never read or written;
// the addresses it makes up are distinct, granularity-aligned ranges, each handed out once.
unsafe impl RawAllocator for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn alloc(&self, size: usize, _device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        let mut l = self.log();
        if l.fail_allocs > 0 {
            l.fail_allocs -= 1;
            return if l.fail_hard { Err(BackendError::Failed("device lost".into())) } else { Ok(0) };
        }
        let used: usize = l.live.iter().map(|x| x.1).sum();
        if l.capacity.is_some_and(|c| used + size > c) {
            return Err(BackendError::OutOfMemory);
        }
        assert_eq!(size % self.granularity, 0, "segment size not a multiple of the granularity");
        let addr = USER_BASE + l.next + if self.misalign { 512 } else { 0 };
        l.next += (size as u64).next_multiple_of(2 << 20) + (2 << 20);
        l.live.push((addr, size));
        l.allocs += 1;
        Ok(addr)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _device: usize, _stream: StreamId) -> Result<(), BackendError> {
        let mut l = self.log();
        if l.fail_frees > 0 {
            l.fail_frees -= 1;
            return Err(BackendError::Failed("free refused".into()));
        }
        let i = l.live.iter().position(|x| *x == (ptr, size)).expect("free of something this allocator never gave");
        l.live.remove(i);
        l.frees.push((ptr, size));
        Ok(())
    }
    fn granularity(&self) -> usize {
        self.granularity
    }
}

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 30);
    (sim.clone(), Allocator::sim(sim))
}

fn pool_of(a: &Allocator<Sim>, c: &Counting) -> MemPool<Sim> {
    MemPool::on(a, PoolOptions::new().allocator(c.clone())).unwrap()
}

fn in_user_range(p: u64) -> bool {
    p >= USER_BASE
}

#[test]
fn scope_routes_this_thread_on_this_stream_only() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let before = a.alloc::<u8>(100).unwrap();
    assert!(!in_user_range(before.device_ptr_raw()));
    let scope = pool.scope();
    let inside = a.alloc::<u8>(100).unwrap();
    assert!(in_user_range(inside.device_ptr_raw()), "not routed to the pool");
    // Another stream of this thread: not routed.
    let s1 = sim.new_stream();
    let other_stream = {
        let _g = a.set_stream(&s1).unwrap();
        a.alloc::<u8>(100).unwrap()
    };
    assert!(!in_user_range(other_stream.device_ptr_raw()));
    // Another thread on the same stream: not routed.
    let a2 = a.clone();
    let other_thread = std::thread::spawn(move || a2.alloc::<u8>(100).unwrap().device_ptr_raw()).join().unwrap();
    assert!(!in_user_range(other_thread));
    drop(scope);
    let after = a.alloc::<u8>(100).unwrap();
    assert!(!in_user_range(after.device_ptr_raw()));
    let ps = pool.memory_stats();
    assert_eq!(ps.allocation.current, 1);
    assert_eq!(ps.num_segment_alloc, 1);
    assert_eq!((ps.allocated_bytes.current, ps.requested_bytes.current), (512, 100));
    assert_eq!(ps.active_bytes, 512);
    assert_eq!(ps.inactive_split_bytes, 2 * MIB - 512);
    common::check_pool(&pool);
    assert_eq!(c.log().allocs, 1);
    assert_eq!(a.memory_stats().allocation.all.current, 4, "device stats count every pool");
    check_invariants(&a, Some(&sim));
}

#[test]
fn scope_on_routes_the_named_stream() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let s1 = sim.new_stream();
    let _scope = pool.scope_on(&s1).unwrap();
    assert!(!in_user_range(a.alloc::<u8>(10).unwrap().device_ptr_raw()), "the current stream was routed");
    let _g = a.set_stream(&s1).unwrap();
    let x = a.alloc::<u8>(10).unwrap();
    assert!(in_user_range(x.device_ptr_raw()));
    assert_eq!(x.stream_id(), s1.id);
}

#[test]
fn scope_on_another_devices_stream_names_both_devices() {
    let (_sim, a) = setup();
    let other = SimDevice::with_index(1, 1 << 20);
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let err = pool.scope_on(&other.new_stream()).unwrap_err();
    assert_eq!(err, Error::WrongDevice { what: "MemPool::scope_on", expected: 0, found: 1 });
    let msg = err.to_string();
    assert!(msg.contains("device 1") && msg.contains("device 0"), "{msg}");
}

#[test]
fn nested_scopes_innermost_wins_and_out_of_order_drops_end_their_own() {
    let (_sim, a) = setup();
    let (ca, cb) = (Counting::new(), Counting::new());
    let (pa, pb) = (pool_of(&a, &ca), pool_of(&a, &cb));
    let outer = pa.scope();
    let inner = pb.scope();
    let x = a.alloc::<u8>(10).unwrap();
    assert_eq!(pb.memory_stats().allocation.current, 1, "innermost scope must win");
    // Drop the outer guard first: the inner scope stays, the outer one ends.
    drop(outer);
    let y = a.alloc::<u8>(10).unwrap();
    assert_eq!(pb.memory_stats().allocation.current, 2);
    assert_eq!(pa.memory_stats().allocation.current, 0);
    drop(inner);
    let z = a.alloc::<u8>(10).unwrap();
    assert!(!in_user_range(z.device_ptr_raw()));
    // Re-entering the same pool inside another keeps working.
    let _o = pa.scope();
    {
        let _i = pb.scope();
        let _again = pa.scope();
        let w = a.alloc::<u8>(10).unwrap();
        assert_eq!(pa.memory_stats().allocation.current, 1);
        drop(w);
    }
    drop((x, y));
}

#[test]
fn released_pool_frees_through_its_own_function_only() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let (keep, gone) = {
        let _s = pool.scope();
        let keep = a.alloc::<u8>(3 * MIB).unwrap(); // 20 MiB segment
        let gone = a.alloc::<u8>(100).unwrap(); // 2 MiB small segment
        (keep, gone)
    };
    drop(gone); // its segment is now wholly free, cached in the pool
    assert_eq!(c.log().frees.len(), 0);
    let device_frees = sim.counters().1;
    assert_eq!(pool.use_count(), 1);
    drop(pool); // the wholly free small segment goes back at once
    let frees = c.log().frees.clone();
    assert_eq!(frees.iter().map(|f| f.1).collect::<Vec<_>>(), vec![2 * MIB]);
    assert_eq!(c.log().live.len(), 1);
    drop(keep); // the last block of the large segment: it goes back now
    assert_eq!(c.log().live.len(), 0, "segment not returned when its last block died");
    assert_eq!(c.freed_bytes(), 22 * MIB);
    assert_eq!(sim.counters().1, device_frees, "a pool's segment was freed through the device");
    let s = a.memory_stats();
    assert_eq!(s.reserved_bytes.all.current, 0);
    check_invariants(&a, Some(&sim));
    // empty_cache has nothing of the pool left to give back, and does not touch user memory.
    a.empty_cache().unwrap();
    assert_eq!(c.log().frees.len(), 2);
}

#[test]
fn default_pools_never_reuse_a_pools_blocks() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let p = {
        let _s = pool.scope();
        a.alloc::<u8>(4096).unwrap().device_ptr_raw()
    };
    for _ in 0..10 {
        let x = a.alloc::<u8>(4096).unwrap();
        assert_ne!(x.device_ptr_raw(), p);
        assert!(!in_user_range(x.device_ptr_raw()));
    }
    let again = pool.alloc::<u8>(4096).unwrap();
    assert_eq!(again.device_ptr_raw(), p, "the pool's own cached block was not reused");
    check_invariants(&a, Some(&sim));
}

#[test]
fn use_on_oom_lends_free_blocks_to_the_default_pools() {
    let sim = SimDevice::new(4 * MIB);
    let a = Allocator::sim(sim.clone());
    let lender = MemPool::on(&a, PoolOptions::new().use_on_oom(true)).unwrap();
    let p = lender.alloc::<u8>(MIB).unwrap().device_ptr_raw(); // 2 MiB segment, cached in the pool
    let _fill = a.alloc::<u8>(MIB).unwrap(); // the default pools' own 2 MiB segment
    let _fill2 = a.alloc::<u8>(MIB - 512).unwrap(); // fills the rest of it
                                                    // The device is full; the default pools borrow the lender's free block.
    let borrowed = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(borrowed.device_ptr_raw(), p);
    assert_eq!(lender.memory_stats().allocation.current, 1, "the block still belongs to the lender");
    drop(borrowed);
    let back = lender.alloc::<u8>(MIB).unwrap();
    assert_eq!(back.device_ptr_raw(), p, "the block did not return to its own pool");
    // Without use_on_oom: no lending.
    let sim2 = SimDevice::new(2 * MIB);
    let a2 = Allocator::sim(sim2);
    let miser = MemPool::on(&a2, PoolOptions::new()).unwrap();
    drop(miser.alloc::<u8>(MIB).unwrap());
    assert!(matches!(a2.alloc::<u8>(MIB), Err(Error::OutOfMemory(_))));
    drop(miser);
}

#[test]
fn no_split_gives_every_block_its_own_segment() {
    let (sim, a) = setup();
    let c = Counting { granularity: 2 * MIB, ..Counting::new() };
    let pool = MemPool::on(&a, PoolOptions::new().allocator(c.clone()).no_split(true)).unwrap();
    let x = pool.alloc::<u8>(100).unwrap();
    let y = pool.alloc::<u8>(100).unwrap();
    let snap = pool.snapshot();
    assert_eq!(snap.segments.len(), 2);
    for s in &snap.segments {
        assert_eq!(s.total_size, 2 * MIB, "segment not sized to the granularity");
        assert_eq!(s.blocks.len(), 1, "a no_split block shared its segment");
        assert_eq!(s.address % (2 * MIB) as u64, 0);
    }
    let big = pool.alloc::<u8>(3 * MIB).unwrap();
    assert_eq!(
        pool.snapshot().segments.iter().find(|s| s.address == big.device_ptr_raw()).unwrap().total_size,
        4 * MIB
    );
    drop((x, y, big));
    check_invariants(&a, Some(&sim));
}

#[test]
fn granularity_rounds_segments_and_misalignment_is_an_error() {
    let (_sim, a) = setup();
    let c = Counting::new();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(c.clone()).granularity(64 * MIB)).unwrap();
    let x = pool.alloc::<u8>(100).unwrap();
    assert_eq!(pool.snapshot().segments[0].total_size, 64 * MIB);
    drop(x);
    let bad = Counting { misalign: true, granularity: 2 * MIB, ..Counting::new() };
    let pool = MemPool::on(&a, PoolOptions::new().allocator(bad.clone())).unwrap();
    let err = pool.alloc::<u8>(100).unwrap_err();
    assert!(matches!(err, Error::PoolAllocator { .. }), "{err:?}");
    assert!(err.to_string().contains("not aligned to its granularity"), "{err}");
    assert_eq!(bad.log().live.len(), 0, "the misaligned segment was not given back");
}

#[test]
fn failing_user_allocator_is_out_of_memory_naming_the_pool() {
    let (_sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    c.log().fail_allocs = 2; // returns null, twice (first try and retry)
    let err = pool.alloc::<u8>(100).unwrap_err();
    let Error::OutOfMemory(r) = &err else { panic!("{err:?}") };
    assert_eq!(r.pool, Some((pool.id().0, "counting".to_string())));
    let msg = err.to_string();
    assert!(msg.contains(&format!("in pool {}", pool.id().0)) && msg.contains("`counting`"), "{msg}");
    assert_eq!(pool.memory_stats().num_ooms, 1);
    c.log().fail_allocs = 1;
    c.log().fail_hard = true;
    let err = pool.alloc::<u8>(100).unwrap_err();
    assert!(matches!(&err, Error::PoolAllocator { allocator, .. } if allocator == "counting"), "{err:?}");
    assert!(err.to_string().contains("device lost"));
    // And then it works again.
    assert!(in_user_range(pool.alloc::<u8>(100).unwrap().device_ptr_raw()));
}

#[test]
fn failing_user_free_is_reported_by_the_next_call() {
    let (_sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    drop(pool.alloc::<u8>(100).unwrap());
    c.log().fail_frees = 1;
    let err = pool.empty_cache().unwrap_err();
    assert!(err.to_string().contains("free of segment") && err.to_string().contains("counting"), "{err}");
    assert_eq!(pool.memory_stats().reserved_bytes.current, 2 * MIB as i64, "accounting lost the segment");
    pool.empty_cache().unwrap();
    assert_eq!(pool.memory_stats().reserved_bytes.current, 0);
    // From a Drop (pool release): kept and reported by the next allocation.
    let b = pool.alloc::<u8>(100).unwrap();
    drop(b);
    c.log().fail_frees = 1;
    drop(pool);
    let err = a.alloc::<u8>(10).unwrap_err();
    assert!(matches!(err, Error::PoolAllocator { .. }), "{err:?}");
    a.alloc::<u8>(10).unwrap();
}

#[test]
fn segment_free_hook_fires_before_the_raw_free() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let events: Arc<Mutex<Vec<(Action, u64, usize)>>> = Arc::default();
    let (ev, log) = (events.clone(), c.log.clone());
    let pool_id = pool.id();
    let hook = trace::attach(move |e| {
        if e.pool == pool_id {
            // How many raw frees had happened when the hook saw this event.
            ev.lock().unwrap().push((e.action, e.addr, log.lock().unwrap().frees.len()));
        }
    })
    .unwrap();
    let x = pool.alloc::<u8>(100).unwrap();
    let seg = pool.snapshot().segments[0].address;
    drop(x);
    pool.empty_cache().unwrap();
    drop(hook);
    let events = events.lock().unwrap().clone();
    let actions: Vec<Action> = events.iter().map(|e| e.0).collect();
    assert_eq!(
        actions,
        vec![Action::SegmentAlloc, Action::Alloc, Action::FreeRequested, Action::FreeCompleted, Action::SegmentFree]
    );
    let seg_free = events.last().unwrap();
    assert_eq!(seg_free.1, seg);
    assert_eq!(seg_free.2, 0, "the raw free ran before the SegmentFree hook");
    assert_eq!(c.log().frees.len(), 1);
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_hook_calling_back_gets_an_error_not_a_deadlock() {
    let (_sim, a) = setup();
    let a2 = a.clone();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let kept: Arc<Mutex<Vec<mempool::Buffer<u8, Sim>>>> = Arc::default();
    let (s2, k2) = (seen.clone(), kept.clone());
    let device = a.device();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let watch = pool.id();
    let hook = trace::attach(move |e| {
        if e.device == device && e.pool == watch && e.action == Action::Alloc {
            match a2.alloc::<u8>(10) {
                Err(err) => s2.lock().unwrap().push(err.to_string()),
                Ok(_) => s2.lock().unwrap().push("no error".into()),
            }
            // Dropping a buffer inside a hook must not deadlock either.
            k2.lock().unwrap().clear();
        }
    })
    .unwrap();
    let b = a.alloc::<u8>(10).unwrap();
    kept.lock().unwrap().push(b);
    let x = pool.alloc::<u8>(10).unwrap();
    drop(hook);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].contains("inside a trace callback"), "{}", seen[0]);
    // The buffer dropped in the hook is freed by the next call.
    drop(x);
    a.alloc::<u8>(10).unwrap();
    assert_eq!(a.memory_stats().allocation.all.current, 0);
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(f).poll(&mut cx)
}

/// Returns `Pending` once, then `Ready`.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}

#[test]
fn wrapped_future_is_routed_only_while_polled() {
    let (_sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let a2 = a.clone();
    let mut task = pool.scoped(async move {
        let first = a2.alloc::<u8>(10).unwrap().device_ptr_raw();
        YieldOnce(false).await;
        let second = a2.alloc::<u8>(10).unwrap().device_ptr_raw();
        (first, second)
    });
    assert!(poll_once(&mut task).is_pending());
    // Another task on the same thread, between polls: not routed.
    let between = a.alloc::<u8>(10).unwrap();
    assert!(!in_user_range(between.device_ptr_raw()));
    let Poll::Ready((first, second)) = poll_once(&mut task) else { panic!("not ready") };
    assert!(in_user_range(first) && in_user_range(second));
    assert!(!in_user_range(a.alloc::<u8>(10).unwrap().device_ptr_raw()));
}

#[test]
fn worker_threads_enter_a_send_handle() {
    let (_sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let handle = pool.scope_handle();
    let a2 = a.clone();
    let p = std::thread::spawn(move || {
        let _s = handle.enter();
        a2.alloc::<u8>(10).unwrap().device_ptr_raw()
    })
    .join()
    .unwrap();
    assert!(in_user_range(p));
    assert_eq!(pool.use_count(), 1, "the handle's reference was not given back");
}

#[test]
fn snapshot_tells_pools_apart() {
    let (sim, a) = setup();
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    let _x = pool.alloc::<u8>(5000).unwrap();
    let _y = a.alloc::<u8>(5000).unwrap();
    drop(pool.alloc::<u8>(70000).unwrap());
    common::check_pool(&pool);
    let ps = pool.memory_stats();
    assert_eq!(ps.allocated_bytes.peak, 5120 + 70144);
    assert_eq!(ps.allocated_bytes.allocated, 5120 + 70144);
    assert_eq!(ps.allocated_bytes.freed, 70144);
    let all = a.snapshot();
    assert_eq!(all.segments.len(), 2);
    let mine = pool.snapshot();
    assert_eq!(mine.segments.len(), 1);
    assert_eq!(mine.segments[0].pool, pool.id());
    assert_eq!(mine.segments[0].blocks[0].requested_size, 5000);
    assert_eq!(mine.segments[0].blocks[0].size, 5120);
    assert!(all.segments.iter().any(|s| s.pool == mempool::PoolId::DEFAULT));
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_pool_dropped_inside_a_hook_is_released_when_the_hook_returns() {
    // Its own device index: hooks see every allocator of the process, other tests' too.
    let a = Allocator::sim(SimDevice::with_index(7, 1 << 30));
    let c = Counting::new();
    let pool = pool_of(&a, &c);
    drop(pool.alloc::<u8>(100).unwrap()); // a cached segment in the pool
    let slot: Arc<Mutex<Option<MemPool<Sim>>>> = Arc::new(Mutex::new(Some(pool)));
    let (s2, device) = (slot.clone(), a.device());
    let hook = trace::attach(move |e| {
        if e.device == device && e.action == Action::Alloc {
            s2.lock().unwrap().take(); // the last handle, dropped inside the callback
        }
    })
    .unwrap();
    let _x = a.alloc::<u8>(10).unwrap();
    drop(hook);
    assert!(slot.lock().unwrap().is_none());
    // Hooks run outside the allocator's lock: the release is queued behind the event being
    // delivered and done before the allocating call returns.
    assert_eq!(c.log().frees.len(), 1, "the pool dropped in a hook was not released");
}

#[test]
fn short_lived_pools_reuse_the_free_sets_of_released_ones() {
    let (sim, a) = setup();
    let s1 = sim.new_stream();
    for i in 0..300 {
        let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
        let _g = a.set_stream(&s1).unwrap();
        let x = pool.alloc::<u8>(100 + i).unwrap();
        let y = pool.alloc::<u8>(3 << 20).unwrap();
        drop(x);
        let z = pool.alloc::<u8>(100 + i).unwrap(); // reuses the block freed just before
        assert_eq!(pool.memory_stats().num_segment_alloc, 2, "pool {i} did not reuse its own blocks");
        drop((y, z, pool));
        // Blocks of a retired pool's sets never reach a new pool or the default pools.
        assert_eq!(a.memory_stats().allocation.all.current, 0);
        common::check_invariants(&a, Some(&sim));
    }
}

/// `PoolOptions::no_cache`: every buffer is a segment of its own, from the pool's source and back
/// to it at its free, once the streams that used it are done (PyTorch's `backend:cudaMallocAsync`
/// with a stream-ordered source).
#[test]
fn a_no_cache_pool_gives_every_segment_back_at_its_free() {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new().no_cache(true)).unwrap();
    let x = pool.alloc::<u8>(1000).unwrap();
    let y = pool.alloc::<u8>(3 << 20).unwrap();
    assert_eq!(pool.memory_stats().segment.current, 2, "a segment per buffer");
    assert_eq!(pool.memory_stats().reserved_bytes.current as usize, 1024 + (3 << 20), "exact sizes, not 2 or 20 MiB");
    drop(x);
    assert_eq!(pool.memory_stats().segment.current, 1, "freed: its segment went back at once");
    // Used on another stream: back once that stream is done.
    let other = sim.new_stream();
    y.record_stream(&other).unwrap();
    drop(y);
    assert_eq!(pool.memory_stats().segment.current, 1, "waits for the other stream");
    sim.complete_stream(other);
    let _z = a.alloc::<u8>(512).unwrap(); // any call processes completed events
    assert_eq!(pool.memory_stats().reserved_bytes.current, 0);
    check_invariants(&a, Some(&sim));
}
