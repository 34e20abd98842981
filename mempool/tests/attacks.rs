//! Adversarial review of the rewritten core: each test states a property the crate claims
//! (ARCHITECTURE.md, RELIABILITY.md "Soundness", the trait docs) and tries to break it through
//! the safe API, on the simulated and host backends. Every test but the `held_*` ones failed
//! when the review wrote it (a finding, fixed since: RELIABILITY.md lists them); the `held_*`
//! tests are attacks that did not get through.
//!
//! Hangs are caught without stalling the suite: a deadlock test either runs under
//! [`within`] (a watchdog thread) or is built so that the blocked side gives up after a few
//! seconds and the test then reports that it had to.
//!
//! Run: `cargo test -p cuda-mempool --test attacks`.

mod common;

use common::watch::{panic_text, sim, wait_for, within};

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mempool::backend::host::HostBackend;
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, BackendError, Config, Error, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

const MIB: usize = 1 << 20;

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

/// Counts the heap bytes each thread holds (allocated minus freed on that thread), so a leak of
/// the allocator's own bookkeeping can be measured without interference from parallel tests.
struct CountingHeap;

thread_local! {
    static NET_BYTES: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    let _ = NET_BYTES.try_with(|n| n.set(n.get() + delta));
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a `const`
// thread-local `Cell` with no destructor, which never allocates.
unsafe impl GlobalAlloc for CountingHeap {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            count(l.size() as i64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            count(l.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) };
        count(-(l.size() as i64));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            count(new as i64 - l.size() as i64);
        }
        q
    }
}

#[global_allocator]
static HEAP: CountingHeap = CountingHeap;

fn net_bytes() -> i64 {
    NET_BYTES.with(Cell::get)
}

/// A pool allocator over made-up addresses (sim allocators never touch memory). Like a real
/// allocator it reuses a range once it has been given back, and it has switches for the ways a
/// real one misbehaves while keeping its `unsafe impl` promise.
#[derive(Clone, Default)]
struct Ledger {
    st: Arc<Mutex<LedgerState>>,
}

#[derive(Default)]
struct LedgerState {
    next: u64,
    live: Vec<(u64, usize)>,
    /// Ranges given back, handed out again first (as any real allocator does).
    reusable: Vec<(u64, usize)>,
    foreign_frees: Vec<u64>,
    /// `free` refuses and keeps the range.
    refuse_free: bool,
    panic_in_name: bool,
    panic_in_granularity: bool,
    granularity: usize,
}

impl Ledger {
    fn with_base(base: u64) -> Ledger {
        let l = Ledger::default();
        l.state().next = base;
        l
    }
    fn state(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

const USER_BASE: u64 = 0x7000_0000_0000;

// SAFETY: addresses only (used with simulated allocators, which never read or write memory):
// each range it hands out is distinct from every live one, 2 MiB aligned, and it is handed out
// again only after mempool gave it back through `free`.
unsafe impl RawAllocator for Ledger {
    fn name(&self) -> &str {
        if self.state().panic_in_name {
            panic!("name() panicked");
        }
        "ledger"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut s = self.state();
        if let Some(i) = s.reusable.iter().position(|r| r.1 == size) {
            let r = s.reusable.remove(i);
            s.live.push(r);
            return Ok(r.0);
        }
        if s.next == 0 {
            s.next = USER_BASE;
        }
        let addr = s.next;
        s.next += (size as u64).next_multiple_of(2 * MIB as u64);
        s.live.push((addr, size));
        Ok(addr)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        let mut s = self.state();
        if s.refuse_free {
            return Err(BackendError::Failed("free refused".into()));
        }
        match s.live.iter().position(|l| *l == (ptr, size)) {
            Some(i) => {
                s.live.remove(i);
                s.reusable.push((ptr, size));
            }
            None => s.foreign_frees.push(ptr),
        }
        Ok(())
    }
    fn granularity(&self) -> usize {
        let s = self.state();
        if s.panic_in_granularity {
            drop(s);
            panic!("granularity() panicked");
        }
        if s.granularity == 0 {
            512
        } else {
            s.granularity
        }
    }
}

// ------------------------------------------------------------------------------------------
// Findings: hangs
// ------------------------------------------------------------------------------------------

/// Claim: "Trace hooks run outside every allocator lock; ... nothing hangs."
///
/// A hook runs while its thread holds the allocator's *outbox* mutex, and an allocation that
/// needs a new segment (also `empty_cache`, `MemPool::empty_cache`) blocks on that mutex
/// (`flush(wait = true)`). So a hook that takes a user lock deadlocks with any thread that holds
/// that lock while allocating: the classic "callback under a lock" ABBA, with the outbox mutex as
/// the allocator's lock. (The hook here gives up after 6 s so the suite does not stall.)
#[test]
fn hook_taking_a_user_lock_deadlocks_with_a_thread_allocating_under_it() {
    within(60, "ABBA between the outbox mutex and a user lock", || {
        let (_, a) = sim(1 << 30);
        let me = a.id();
        let user_lock = Arc::new(Mutex::new(()));
        let (in_hook, gave_up) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let hook = trace::attach({
            let (m, in_hook, gave_up) = (user_lock.clone(), in_hook.clone(), gave_up.clone());
            move |e| {
                // The first small segment of this allocator only.
                if e.allocator != me || e.action != Action::SegmentAlloc || e.size != 2 * MIB {
                    return;
                }
                in_hook.store(true, Ordering::SeqCst);
                let end = Instant::now() + Duration::from_secs(6);
                loop {
                    if let Ok(_g) = m.try_lock() {
                        return; // e.g. a registration table, a log
                    }
                    if Instant::now() > end {
                        gave_up.store(true, Ordering::SeqCst);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
        .unwrap();
        let held = user_lock.lock().unwrap();
        let a2 = a.clone();
        let t = std::thread::spawn(move || drop(a2.alloc::<u8>(100).unwrap())); // delivers the hook
        assert!(wait_for(&in_hook, 10));
        let start = Instant::now();
        let big = a.alloc::<u8>(5 * MIB).unwrap(); // a new segment, while holding the user lock
        let waited = start.elapsed();
        drop(held);
        t.join().unwrap();
        drop(big);
        drop(hook);
        assert!(
            !gave_up.load(Ordering::SeqCst),
            "DEADLOCK: `alloc` (new segment) blocked {waited:?} on the outbox mutex held by the thread running \
             the hook, while the hook waited for the lock the allocating thread held"
        );
    });
}

/// Same root cause, no user lock: a hook that hands work to another thread and waits for it
/// (a worker pool, `std::thread::scope`) deadlocks if that work allocates a new segment.
#[test]
fn hook_waiting_for_a_worker_that_allocates_deadlocks() {
    within(60, "hook joining an allocating worker", || {
        let (_, a) = sim(1 << 30);
        let me = a.id();
        let timed_out = Arc::new(AtomicBool::new(false));
        let once = Arc::new(AtomicBool::new(false));
        let hook = trace::attach({
            let (a, timed_out, once) = (a.clone(), timed_out.clone(), once.clone());
            move |e| {
                if e.allocator != me || e.action != Action::SegmentAlloc || once.swap(true, Ordering::SeqCst) {
                    return;
                }
                let (tx, rx) = mpsc::channel();
                let a = a.clone();
                std::thread::spawn(move || {
                    let r = a.alloc::<u8>(5 * MIB).map(drop); // not in a hook: allowed
                    let _ = tx.send(r);
                });
                if rx.recv_timeout(Duration::from_secs(6)).is_err() {
                    timed_out.store(true, Ordering::SeqCst);
                }
            }
        })
        .unwrap();
        drop(a.alloc::<u8>(100).unwrap());
        drop(hook);
        assert!(
            !timed_out.load(Ordering::SeqCst),
            "DEADLOCK: the worker's allocation waited on the outbox mutex held by the hook that waited for it"
        );
    });
}

/// Claim: "Pool allocators (`RawAllocator`) are called without locks held and may call mempool."
///
/// A pool's `Arc<dyn RawAllocator>` is dropped by `retire_pool_if_empty` (`p.spec.raw = None`)
/// under the allocator's state mutex when a pool with no segment is released. An allocator whose
/// `Drop` reads the statistics relocks the held (non-reentrant) mutex: the thread hangs forever
/// inside `drop(pool)`.
#[test]
fn raw_allocator_dropped_under_the_state_lock_hangs() {
    struct Reporting {
        inner: Ledger,
        alloc: Allocator<Sim>,
    }
    // SAFETY: forwards to `Ledger`.
    unsafe impl RawAllocator for Reporting {
        fn name(&self) -> &str {
            "reporting"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            self.inner.alloc(size, d, s)
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded unchanged.
            unsafe { self.inner.free(ptr, size, d, s) }
        }
    }
    impl Drop for Reporting {
        fn drop(&mut self) {
            // A last report when the pool's allocator goes away.
            let _ = self.alloc.memory_stats();
        }
    }
    within(10, "drop(pool) whose RawAllocator::drop reads memory_stats", || {
        let (_, a) = sim(1 << 30);
        let pool =
            MemPool::on(&a, PoolOptions::new().allocator(Reporting { inner: Ledger::default(), alloc: a.clone() }))
                .unwrap();
        drop(pool); // no segment: retired at once, the RawAllocator dropped under the lock
    });
}

/// Same: `free_failed` calls `RawAllocator::name()` under the state mutex (and `name()` is user
/// code like any other): a panicking `name()` there unwinds out of `drop(pool)` with the lock
/// held; the segment being re-filed is lost (neither freed nor cached), the pool never retires,
/// and dropping the allocator no longer returns it.
#[test]
fn raw_allocator_name_panicking_while_a_free_fails_loses_the_segment() {
    let (dev, a) = sim(1 << 30);
    let ledger = Ledger::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    drop(pool.alloc::<u8>(100).unwrap());
    {
        let mut s = ledger.state();
        s.refuse_free = true;
        s.panic_in_name = true;
    }
    let r = catch_unwind(AssertUnwindSafe(|| drop(pool)));
    {
        let mut s = ledger.state();
        s.refuse_free = false;
        s.panic_in_name = false;
    }
    let escaped = r.as_ref().err().map(|p| panic_text(&**p));
    let _ = a.empty_cache();
    let cached = a.snapshot().segments.len();
    drop(a);
    let live = ledger.state().live.len();
    assert!(
        escaped.is_none() && live == 0,
        "a panic in RawAllocator::name escaped drop(pool): {escaped:?}; after empty_cache and dropping the \
         allocator the pool allocator still holds {live} segment(s) (the allocator's snapshot showed {cached})"
    );
    let _ = dev;
}

/// Claim: "bad ... granularities ... are clear errors, never panics" / "their panics are caught".
/// `MemPool::on` calls `RawAllocator::granularity()` (and `name()`) without `contain`.
#[test]
fn raw_allocator_granularity_panic_escapes_mempool_on() {
    let (_, a) = sim(1 << 30);
    let ledger = Ledger::default();
    ledger.state().panic_in_granularity = true;
    let r = catch_unwind(AssertUnwindSafe(|| MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).map(drop)));
    assert!(r.is_ok(), "MemPool::on panicked: {}", panic_text(&*r.unwrap_err()));
}

/// "Pool allocators ... may call mempool": one that takes a scratch allocation from the
/// allocator on the thread that asked for the segment is routed by that thread's pool scope back
/// into its own pool, which calls it again: unbounded recursion (stack overflow, i.e. an abort,
/// without the depth cap this test's allocator has).
#[test]
fn pool_allocator_allocating_inside_its_own_scope_recurses_without_bound() {
    thread_local! { static DEPTH: Cell<usize> = const { Cell::new(0) }; }
    struct Scratchy {
        inner: Ledger,
        alloc: Allocator<Sim>,
        max_depth: Arc<AtomicUsize>,
    }
    // SAFETY: forwards to `Ledger`.
    unsafe impl RawAllocator for Scratchy {
        fn name(&self) -> &str {
            "scratchy"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            let depth = DEPTH.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            self.max_depth.fetch_max(depth, Ordering::SeqCst);
            let r = if depth > 16 {
                Err(BackendError::Failed("recursion cap of the test".into()))
            } else {
                // Metadata for the new segment, from the device allocator.
                self.alloc.alloc::<u8>(64).map_err(|e| BackendError::Failed(e.to_string())).map(drop)
            };
            DEPTH.with(|c| c.set(c.get() - 1));
            r?;
            self.inner.alloc(size, d, s)
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded unchanged.
            unsafe { self.inner.free(ptr, size, d, s) }
        }
    }
    let (_, a) = sim(1 << 30);
    let max_depth = Arc::new(AtomicUsize::new(0));
    let pool = MemPool::on(
        &a,
        PoolOptions::new().allocator(Scratchy {
            inner: Ledger::default(),
            alloc: a.clone(),
            max_depth: max_depth.clone(),
        }),
    )
    .unwrap();
    let r = {
        let _scope = pool.scope();
        a.alloc::<u8>(100).map(drop)
    };
    assert_eq!(
        max_depth.load(Ordering::SeqCst),
        1,
        "the pool allocator was re-entered for its own pool (result {r:?})"
    );
}

// ------------------------------------------------------------------------------------------
// Findings: undefined behaviour reachable through a conforming `unsafe impl`
// ------------------------------------------------------------------------------------------

/// Found: `RawAllocator`'s contract did not say what an `Err` from `free` means, and mempool
/// re-caches the segment. The contract now says it: `Err` (or a panic) means the range was not
/// given back. A `free` that refuses within that contract: the range comes back to its own pool
/// once, and the allocator never hands it to another pool meanwhile.
#[test]
fn a_pool_free_that_refuses_keeps_the_range_for_its_pool_alone() {
    let (_, a) = sim(1 << 30);
    let ledger = Ledger::default();
    let p = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    let q = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    drop(p.alloc::<u8>(100).unwrap());
    ledger.state().refuse_free = true;
    let e = p.empty_cache().unwrap_err();
    ledger.state().refuse_free = false;
    assert!(e.to_string().contains("ledger"), "{e}");
    let x = p.alloc::<u8>(100).unwrap(); // from the segment mempool kept
    let y = q.alloc::<u8>(100).unwrap(); // a new range for q
    let (xs, ys) = (x.device_ptr_raw(), y.device_ptr_raw());
    assert!(xs.abs_diff(ys) >= 2 * MIB as u64, "two live buffers in one range: {xs:#x} and {ys:#x}");
    drop((x, y, p, q));
    assert!(ledger.state().live.is_empty(), "a range was never given back");
}

// ------------------------------------------------------------------------------------------
// Findings: panics, wrong results
// ------------------------------------------------------------------------------------------

/// Found: segment sizes could round past `MAX_BLOCK` (a request in (2^40 - 2 MiB, 2^40 - 512]
/// got a 2^40-byte segment, as did every request of a pool with `granularity(1 << 40)`), and
/// the free-set key's 40 bits overflowed on free (a panic in `Buffer::drop`; in release a lost
/// TiB). Such requests are now out-of-memory errors, and such granularities are refused.
#[test]
fn segments_past_the_largest_block_are_refused_up_front() {
    let (_, a) = sim(1 << 41);
    match a.alloc::<u8>((1 << 40) - 512) {
        Err(mempool::Error::OutOfMemory(r)) => assert_eq!(r.requested, (1 << 40) - 512),
        other => panic!("{other:?}"),
    }
    let b = a.alloc::<u8>((1 << 40) - (2 << 20)).unwrap(); // the largest segment there is
    drop(b);
    let again = a.alloc::<u8>((1 << 40) - (2 << 20)).unwrap();
    assert_eq!(a.memory_stats().num_device_alloc, 1, "the cached block was not found again");
    drop(again);
    let ledger = Ledger::with_base(1 << 44);
    let e = MemPool::on(&a, PoolOptions::new().allocator(ledger).granularity(1 << 40)).unwrap_err();
    assert!(e.to_string().contains("at most 1 GiB"), "{e}");
}

/// Claim: "bad sizes/granularities/configs are clear errors". `Config`'s fields are public, so
/// `Config { .. }` skips every check of the builder, and `Allocator::sim_with`/`host_with` take it
/// unchecked. `roundup_power2_divisions: 3` (the builder refuses it: not a power of two) rounds
/// sizes to multiples of 349,525 bytes: blocks stop being multiples of 512 and addresses stop
/// being 512-aligned (the `Backend` contract promises 512; CUDA kernels fault on misaligned
/// loads).
#[test]
fn config_built_by_hand_skips_validation_and_misaligns_blocks() {
    assert!(Config::builder().roundup_power2_divisions(3).build().is_err(), "the builder refuses it");
    let config = Config { roundup_power2_divisions: [3; 16], ..Config::default() };
    let dev = SimDevice::new(1 << 30);
    let a = Allocator::sim_with(dev, config);
    let x = a.alloc::<f64>((MIB + 8) / 8).unwrap();
    let y = a.alloc::<f64>((MIB + 8) / 8).unwrap();
    assert!(
        x.device_ptr_raw() % 512 == 0 && y.device_ptr_raw() % 512 == 0,
        "buffers at {:#x} and {:#x}: not 512-aligned",
        x.device_ptr_raw(),
        y.device_ptr_raw()
    );
}

/// `PoolOptions::granularity` is documented as "segment sizes rounded up to a multiple of
/// `bytes`", but `grow` also demands the *address* be aligned to it, even for a pool whose
/// segments come from the backend, which promises only its own alignment (sim: 2 MiB, host:
/// 4 KiB). `MemPool::on` accepts 4 MiB; allocations then fail depending on where the device put
/// the segment, with a backend error that blames the device.
#[test]
fn pool_granularity_above_the_backends_alignment_fails_allocations() {
    let (dev, a) = sim(1 << 30);
    let _first = a.alloc::<u8>(100).unwrap(); // the next sim segment starts 2 MiB further
    let pool = MemPool::on(&a, PoolOptions::new().granularity(4 * MIB)).unwrap();
    let r = pool.alloc::<u8>(100);
    assert!(r.is_ok(), "pool allocation failed: {}", r.unwrap_err());
    common::check_invariants(&a, Some(&dev));
}

#[test]
fn host_pool_granularity_above_4k_fails_allocations() {
    let a = Allocator::host_with(HostBackend::plain(), Config::default());
    let pool = MemPool::on(&a, PoolOptions::new().granularity(64 * MIB)).unwrap();
    let mut failures = Vec::new();
    let mut keep = Vec::new();
    for _ in 0..8 {
        match pool.alloc::<u8>(1) {
            Ok(b) => keep.push(b),
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(failures.is_empty(), "{} of 8 host pool allocations failed: {:?}", failures.len(), failures.first());
}

/// The simulated device's `zero` accepts only ranges inside its *own* segments, so on a sim
/// allocator `alloc_zeros` fails for every pool whose segments come from a `RawAllocator` (the
/// setup the sim exists to test: NCCL-style pools), with a backend error about the range.
#[test]
fn sim_alloc_zeros_in_a_user_allocator_pool_always_fails() {
    let (_, a) = sim(1 << 30);
    let pool = MemPool::on(&a, PoolOptions::new().allocator(Ledger::default())).unwrap();
    let r = pool.alloc_zeros::<f32>(100);
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

// ------------------------------------------------------------------------------------------
// Findings: work deferred indefinitely (leaks, statistics that disagree with the device)
// ------------------------------------------------------------------------------------------

/// `RUNNING_WORK` is one flag per *thread*, not per allocator: while a thread delivers allocator
/// A's hooks, every flush of any other allocator B on that thread is skipped, and nothing later
/// runs B's outbox unless B is called in a way that flushes. So `b.empty_cache()` from a hook of
/// A returns `Ok` and frees nothing; B then reports 0 reserved bytes while the device still holds
/// the segment, until B's next growth, `empty_cache`, or drop.
#[test]
fn empty_cache_of_another_allocator_from_a_hook_frees_nothing() {
    let (_, a) = sim(1 << 30);
    let (dev_b, b) = sim(1 << 30);
    drop(b.alloc::<u8>(100).unwrap()); // one cached segment in b
    let me = a.id();
    let once = Arc::new(AtomicBool::new(false));
    let seen_inside = Arc::new(Mutex::new(None));
    let hook = trace::attach({
        let (b, once, seen, dev_b) = (b.clone(), once.clone(), seen_inside.clone(), dev_b.clone());
        move |e| {
            if e.allocator != me || once.swap(true, Ordering::SeqCst) {
                return;
            }
            let r = b.empty_cache();
            *seen.lock().unwrap() = Some((r.is_ok(), dev_b.live_segments().len()));
        }
    })
    .unwrap();
    drop(a.alloc::<u8>(100).unwrap());
    drop(hook);
    // Non-flushing calls on b afterwards.
    let reserved = b.memory_stats().reserved_bytes.all.current;
    let _ = b.snapshot();
    let on_device = dev_b.live_segments().len();
    assert_eq!(
        on_device,
        0,
        "inside the hook b.empty_cache() gave (ok, segments on device) = {:?}; after the hook b reports {reserved} \
         reserved bytes while its device still holds {on_device} segment(s)",
        seen_inside.lock().unwrap()
    );
}

/// The same with a pool of B dropped in A's hook: its segment sits in B's outbox, uncounted
/// (`reserved` 0) but not given back, until something makes B grow or empty its cache.
#[test]
fn pool_released_in_another_allocators_hook_keeps_its_segment() {
    let (_, a) = sim(1 << 30);
    let (dev_b, b) = sim(1 << 30);
    let ledger = Ledger::default();
    let pool = MemPool::on(&b, PoolOptions::new().allocator(ledger.clone())).unwrap();
    drop(pool.alloc::<u8>(100).unwrap());
    let _warm = b.alloc::<u8>(100).unwrap(); // b's default pools have a segment: later calls hit the cache
    let slot = Arc::new(Mutex::new(Some(pool)));
    let me = a.id();
    let hook = trace::attach({
        let slot = slot.clone();
        move |e| {
            if e.allocator == me {
                slot.lock().unwrap().take(); // the pool's last handle
            }
        }
    })
    .unwrap();
    drop(a.alloc::<u8>(100).unwrap());
    drop(hook);
    // Calls on b that do not grow it (with no hook attached, cache hits and frees do not flush
    // either; they are left out here because other tests' hooks, attached in parallel, would).
    let _ = b.memory_stats();
    let _ = b.snapshot();
    let _ = b.take_error();
    let live = ledger.state().live.len();
    let reserved = b.memory_stats().reserved_bytes.all.current;
    assert_eq!(
        live, 0,
        "the released pool's segment was never given back to its allocator (b reports {reserved} reserved bytes: \
         only its default segment)"
    );
    let _ = dev_b;
}

/// Free sets are made per (pool, stream key, small/large) and recycled only when a *pool*
/// retires; stream keys are never reused. Every stream that ever allocated keeps its sets (512
/// bins each) for the life of the allocator, even after `empty_cache` left it nothing: a program
/// that makes a stream per request grows without bound.
#[test]
fn free_sets_of_streams_that_are_done_are_never_reclaimed() {
    let (dev, a) = sim(1 << 30);
    let warm = dev.new_stream();
    {
        let _g = a.set_stream(&warm).unwrap();
        drop(a.alloc::<u8>(100).unwrap());
    }
    a.empty_cache().unwrap();
    let n = 2000;
    let before = net_bytes();
    for _ in 0..n {
        let s = dev.new_stream();
        let _g = a.set_stream(&s).unwrap();
        drop(a.alloc::<u8>(100).unwrap());
        drop(_g);
        a.empty_cache().unwrap();
    }
    let per_stream = (net_bytes() - before) / n;
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert!(per_stream < 512, "{per_stream} bytes kept per finished stream (nothing is cached)");
}

/// Claim: "dropping a host/sim allocator returns every segment". A free that fails during the
/// drop is filed back into the cache of an allocator that is going away: the segment is never
/// retried and the error is dropped with the state.
#[test]
fn a_free_failing_while_the_allocator_drops_leaks_the_segment_silently() {
    let (dev, a) = sim(1 << 30);
    drop(a.alloc::<u8>(100).unwrap());
    dev.fail_next_frees(1);
    drop(a);
    assert_eq!(dev.live_segments(), vec![], "a segment outlived its allocator (and no error was reported)");
}

/// Any safe call that reads the thread's allocation context panics once the thread's mempool
/// thread-local is destroyed (thread exit, in another thread-local's destructor): `TLS.with`
/// rather than `try_with` in `stream::current_with_pool` / `current` / `begin_route` /
/// `StreamGuard::new`.
#[test]
fn allocating_from_a_thread_local_destructor_panics() {
    struct Late(Option<Allocator<Sim>>, mpsc::Sender<String>);
    impl Drop for Late {
        fn drop(&mut self) {
            let a = self.0.take().unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| a.alloc::<u8>(1).map(drop)));
            let _ = self.1.send(match r {
                Ok(Ok(())) => "ok".into(),
                Ok(Err(e)) => format!("error: {e}"),
                Err(p) => format!("panicked: {}", panic_text(&*p)),
            });
        }
    }
    thread_local! { static LATE: RefCell<Option<Late>> = const { RefCell::new(None) }; }
    let (_, a) = sim(1 << 30);
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    std::thread::spawn(move || {
        // Registered first, so destroyed after mempool's thread-local (reverse order).
        LATE.with(|l| *l.borrow_mut() = Some(Late(Some(a2.clone()), tx)));
        drop(a2.alloc::<u8>(1).unwrap()); // mempool's thread-local is made here
    })
    .join()
    .unwrap();
    let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(!got.starts_with("panicked"), "alloc in a thread-local destructor: {got}");
}

// ------------------------------------------------------------------------------------------
// Attacks that held up (these pass)
// ------------------------------------------------------------------------------------------

/// A hook that tears everything down: drops buffers, pools (with segments and a user
/// allocator), the allocator's other handles, its own trace handle; attaches a hook; records a
/// stream; takes a snapshot; allocation is refused. Nothing hangs and everything goes back.
#[test]
fn held_hook_tears_everything_down() {
    within(30, "teardown hook", || {
        let (dev, a) = sim(1 << 30);
        let ledger = Ledger::default();
        let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
        let pb = pool.alloc::<u8>(100).unwrap();
        let side = dev.new_stream();
        let kept = a.alloc::<u8>(4096).unwrap();
        let me = a.id();
        type Stash = (MemPool<Sim>, mempool::Buffer<u8, Sim>, mempool::Buffer<u8, Sim>, Allocator<Sim>);
        let stash: Arc<Mutex<Option<Stash>>> = Arc::new(Mutex::new(Some((pool, pb, kept, a.clone()))));
        let own: Arc<Mutex<Option<trace::TraceHandle>>> = Arc::default();
        let results: Arc<Mutex<Vec<String>>> = Arc::default();
        let hook = trace::attach({
            let (stash, own, results) = (stash.clone(), own.clone(), results.clone());
            move |e| {
                if e.allocator != me || e.action != Action::Alloc {
                    return;
                }
                let Some((pool, pb, kept, a2)) = stash.lock().unwrap().take() else { return };
                let mut r = results.lock().unwrap();
                kept.record_stream(&side).unwrap();
                r.push(format!("{}", matches!(a2.alloc::<u8>(1), Err(Error::Reentrant))));
                r.push(format!("{}", matches!(pool.alloc::<u8>(1), Err(Error::Reentrant))));
                r.push(format!("{}", matches!(a2.alloc_bytes(1), Err(Error::Reentrant))));
                let _ = a2.snapshot();
                let _inner = trace::attach(|_| {}).unwrap();
                drop((pb, kept, pool));
                a2.empty_cache().unwrap();
                drop(a2);
                drop(own.lock().unwrap().take()); // detaches itself
            }
        })
        .unwrap();
        *own.lock().unwrap() = Some(hook);
        drop(a.alloc::<u8>(10).unwrap());
        assert_eq!(results.lock().unwrap().join(","), "true,true,true");
        dev.complete_stream(side);
        a.empty_cache().unwrap();
        common::check_invariants(&a, Some(&dev));
        assert!(ledger.state().live.is_empty() && ledger.state().foreign_frees.is_empty());
        assert_eq!(a.memory_stats().active.all.current, 0);
        drop(a);
        assert_eq!(dev.live_segments(), vec![]);
    });
}

/// Pools released and replaced while their allocator is inside `RawAllocator::alloc` (no lock
/// held): the segment goes back to the allocator that made it, the request falls back to the
/// default pools, the new pool in the slot sees nothing.
#[test]
fn held_pool_released_and_slot_reused_during_its_own_alloc() {
    struct Dropping {
        inner: Ledger,
        victim: Arc<Mutex<Option<MemPool<Sim>>>>,
        replacement: Arc<Mutex<Option<MemPool<Sim>>>>,
        alloc: Allocator<Sim>,
        other: Ledger,
    }
    // SAFETY: forwards to `Ledger`.
    unsafe impl RawAllocator for Dropping {
        fn name(&self) -> &str {
            "dropping"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            if let Some(p) = self.victim.lock().unwrap().take() {
                drop(p); // the last handle: released and retired (no segment yet)
                *self.replacement.lock().unwrap() =
                    Some(MemPool::on(&self.alloc, PoolOptions::new().allocator(self.other.clone())).unwrap());
            }
            self.inner.alloc(size, d, s)
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded unchanged.
            unsafe { self.inner.free(ptr, size, d, s) }
        }
    }
    let (dev, a) = sim(1 << 30);
    let (victim, replacement) = (Arc::new(Mutex::new(None)), Arc::new(Mutex::new(None)));
    let (mine, other) = (Ledger::default(), Ledger::with_base(USER_BASE + (1 << 40)));
    let pool = MemPool::on(
        &a,
        PoolOptions::new().allocator(Dropping {
            inner: mine.clone(),
            victim: victim.clone(),
            replacement: replacement.clone(),
            alloc: a.clone(),
            other: other.clone(),
        }),
    )
    .unwrap();
    std::mem::forget(pool.scope());
    *victim.lock().unwrap() = Some(pool);
    let b = a.alloc::<u8>(100).unwrap();
    let q = replacement.lock().unwrap().take().unwrap();
    assert!(b.device_ptr_raw() < USER_BASE, "served from the default pools");
    assert_eq!(q.memory_stats().allocation.current, 0);
    assert!(mine.state().live.is_empty(), "the refused segment went back");
    assert!(other.state().live.is_empty() && other.state().foreign_frees.is_empty());
    drop(b);
    common::check_invariants(&a, Some(&dev));
}

/// Stream guards and pool scopes dropped in every order, forgotten, on many streams; a scope
/// of a released pool (a live buffer keeps it) falls back; a scope entered through a
/// `ScopeHandle` on another thread after the pool's other handles are gone.
#[test]
fn held_scopes_and_guards_in_any_order() {
    let (dev, a) = sim(1 << 30);
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let q = MemPool::on(&a, PoolOptions::new()).unwrap();
    let g1 = a.set_stream(&s1).unwrap();
    let sp = p.scope(); // on s1
    let g2 = a.set_stream(&s2).unwrap();
    let sq = q.scope(); // on s2
    drop(g1);
    drop(sp);
    let x = a.alloc::<u8>(10).unwrap(); // s2, q
    assert_eq!((x.stream_id(), q.memory_stats().allocation.current), (s2.id, 1));
    drop(g2);
    let y = a.alloc::<u8>(10).unwrap(); // default stream, default pools
    assert_eq!((y.stream_id(), p.memory_stats().allocation.current), (StreamId(0), 0));
    drop(sq);
    // A released pool with a live buffer: its forgotten scope falls back to the default pools.
    let z = {
        let _s = p.scope();
        a.alloc::<u8>(10).unwrap()
    };
    std::mem::forget(p.scope());
    drop(p);
    let w = a.alloc::<u8>(10).unwrap();
    let wp = w.device_ptr_raw();
    assert!(a
        .snapshot()
        .segments
        .iter()
        .any(|s| s.address <= wp && wp < s.address + s.total_size as u64 && s.pool.0 == 0));
    let h = q.scope_handle();
    drop(q);
    std::thread::spawn(move || {
        let _s = h.enter();
        drop(h.pool().allocator().alloc::<u8>(10).unwrap());
    })
    .join()
    .unwrap();
    drop((x, y, z, w));
    a.empty_cache().unwrap();
    common::check_invariants(&a, Some(&dev));
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
}

/// A user allocator that misbehaves within what mempool checks: null, an error, a panic in
/// `alloc`, a misaligned address, an address past 2^56: each a clear error, every refused range
/// given back through its own `free`, statistics exact.
#[test]
fn held_pool_allocator_misbehaviour_is_contained() {
    struct Bad {
        mode: Arc<AtomicUsize>,
        inner: Ledger,
    }
    // SAFETY: addresses only; the made-up ranges are never used (sim allocator).
    unsafe impl RawAllocator for Bad {
        fn name(&self) -> &str {
            "bad"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            match self.mode.load(Ordering::SeqCst) {
                0 => Ok(0),
                1 => Err(BackendError::Failed("nope".into())),
                2 => panic!("alloc panicked"),
                3 => self.inner.alloc(size, d, s).map(|a| a + 512),
                4 => Ok((1 << 56) - 4096),
                _ => self.inner.alloc(size, d, s),
            }
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            let ptr = if ptr % 4096 == 512 { ptr - 512 } else { ptr };
            if ptr == (1 << 56) - 4096 {
                return Ok(());
            }
            // SAFETY: forwarded.
            unsafe { self.inner.free(ptr, size, d, s) }
        }
        fn granularity(&self) -> usize {
            4096
        }
    }
    let (dev, a) = sim(1 << 30);
    let mode = Arc::new(AtomicUsize::new(0));
    let inner = Ledger::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(Bad { mode: mode.clone(), inner: inner.clone() })).unwrap();
    for m in 0..5 {
        mode.store(m, Ordering::SeqCst);
        let e = pool.alloc::<u8>(100).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("bad") || matches!(e, Error::OutOfMemory(_)), "mode {m}: {text}");
        common::check_invariants(&a, Some(&dev));
        common::check_pool(&pool);
    }
    assert!(inner.state().live.is_empty() && inner.state().foreign_frees.is_empty());
    mode.store(9, Ordering::SeqCst);
    drop(pool.alloc::<u8>(100).unwrap());
    drop(pool);
    assert!(inner.state().live.is_empty());
}

/// Buffers of one pool dropped on eight threads while the pool's last handle is dropped on
/// another and the device's cache is emptied: every segment goes back once, to its own free.
#[test]
fn held_concurrent_release_and_frees() {
    within(60, "concurrent release", || {
        for round in 0..20 {
            let (dev, a) = sim(1 << 30);
            let ledger = Ledger::default();
            let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
            let bufs: Vec<_> = (0..64).map(|i| pool.alloc::<u8>(1000 + i * 40_000).unwrap()).collect();
            let mut chunks: Vec<Vec<_>> = (0..8).map(|_| Vec::new()).collect();
            for (i, b) in bufs.into_iter().enumerate() {
                chunks[i % 8].push(b);
            }
            let mut ts: Vec<_> = chunks.into_iter().map(|c| std::thread::spawn(move || drop(c))).collect();
            let a2 = a.clone();
            ts.push(std::thread::spawn(move || {
                drop(pool);
                a2.empty_cache().unwrap();
            }));
            for t in ts {
                t.join().unwrap();
            }
            a.empty_cache().unwrap();
            assert!(ledger.state().live.is_empty(), "round {round}");
            assert!(ledger.state().foreign_frees.is_empty(), "round {round}");
            common::check_invariants(&a, Some(&dev));
        }
    });
}

/// Raw byte API misuse: foreign pointers, double frees, frees through another allocator,
/// `record_stream_bytes` of freed memory, zero sizes.
#[test]
fn held_raw_api_misuse() {
    let (dev, a) = sim(1 << 30);
    let (_, b) = sim(1 << 30);
    let p = a.alloc_bytes(1000).unwrap();
    let buf = a.alloc::<u8>(1000).unwrap();
    assert!(matches!(b.free_bytes(p), Err(Error::InvalidFree { .. })));
    assert!(matches!(a.free_bytes(buf.device_ptr_raw()), Err(Error::InvalidFree { .. })));
    assert!(matches!(a.free_bytes(p + 512), Err(Error::InvalidFree { .. })));
    a.free_bytes(p).unwrap();
    assert!(matches!(a.free_bytes(p), Err(Error::InvalidFree { .. })));
    assert!(matches!(a.record_stream_bytes(p, &dev.new_stream()), Err(Error::InvalidFree { .. })));
    assert_eq!(a.alloc_bytes(0).unwrap(), 0);
    a.free_bytes(0).unwrap();
    let e = a.alloc::<u32>(0).unwrap();
    assert_eq!(e.device_ptr_raw(), 0);
    let z = a.alloc::<()>(usize::MAX).unwrap();
    assert_eq!(z.num_bytes(), 0);
    drop((buf, e, z));
    common::check_invariants(&a, Some(&dev));
}

/// Hostile sizes on the host backend (real memory): every one a clear error, never a panic or
/// an allocation of the wrong size; `alloc_zeros` writes exactly its buffer.
#[test]
fn held_host_sizes() {
    let a = Allocator::host_with(HostBackend::plain(), Config::default());
    for n in [(1usize << 40) - 1, 1 << 40, usize::MAX / 2, usize::MAX, isize::MAX as usize] {
        assert!(matches!(a.alloc::<u8>(n), Err(Error::OutOfMemory(_))), "{n}");
    }
    assert!(matches!(a.alloc::<u64>(usize::MAX / 2), Err(Error::SizeOverflow { .. })));
    let z = a.alloc_zeros::<bool>(3 * MIB + 7).unwrap();
    assert_eq!(z.len(), 3 * MIB + 7);
    drop(z);
    let stats = a.memory_stats();
    assert_eq!(stats.allocated_bytes.all.current, 0);
}

/// Events that complete only when told: a block used on another stream is not reused before,
/// even by the pool that owns it after the pool is released, or by OOM recovery (which waits).
#[test]
fn held_cross_stream_reuse_waits() {
    let (dev, a) = sim(64 * MIB);
    let side = dev.new_stream();
    let x = a.alloc::<u8>(30 * MIB).unwrap();
    let addr = x.device_ptr_raw();
    x.record_stream(&side).unwrap();
    drop(x);
    let y = a.alloc::<u8>(30 * MIB).unwrap();
    assert_ne!(y.device_ptr_raw(), addr);
    let z = a.alloc::<u8>(30 * MIB); // out of memory unless the wait happens
    assert!(z.is_ok(), "{:?}", z.err());
    assert_eq!(dev.pending_events(side), 0, "OOM recovery waited for the side stream");
    drop((y, z));
    common::check_invariants(&a, Some(&dev));
}
