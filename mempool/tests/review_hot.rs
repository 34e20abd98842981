//! Hostile review of the HOT / MINE / MineCache way to a thread's cache (commits d3e9d90,
//! 797c6c1). Sim backend only.

mod common;

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

/// Trace hooks are process-wide (any attached hook turns every thread cache off), so the tests
/// that attach one or probe whether a cache is used run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 32);
    (sim.clone(), Allocator::sim(sim))
}

fn live(a: &Allocator<Sim>) -> (i64, i64) {
    let s = a.memory_stats();
    (s.allocation.all.current, s.allocated_bytes.all.current)
}

/// Whether this thread's cache of `a` takes a freed small block: the block freed here is not
/// handed to another thread (which would get it back from the free set if it were filed).
fn cache_works(a: &Allocator<Sim>) -> bool {
    let keep = a.alloc::<u8>(512).unwrap();
    let x = a.alloc::<u8>(512).unwrap();
    let xa = x.device_ptr_raw();
    drop(x);
    let a2 = a.clone();
    let ya = std::thread::spawn(move || a2.alloc::<u8>(512).unwrap().device_ptr_raw()).join().unwrap();
    // The block comes back to this thread from its cache.
    let z = a.alloc::<u8>(512).unwrap();
    let hit = z.device_ptr_raw() == xa;
    drop((keep, z));
    ya != xa && hit
}

// ------------------------------------------------------------------------------------------
// Thread-local destructors: buffers dropped (and allocations made) before and after MINE goes.
// ------------------------------------------------------------------------------------------

struct OnExit(Option<Allocator<Sim>>, RefCell<Vec<Buffer<u8, Sim>>>);
impl Drop for OnExit {
    fn drop(&mut self) {
        // Free what was parked here, then allocate and free again (MINE may be gone).
        self.1.borrow_mut().clear();
        if let Some(a) = &self.0 {
            for n in [512usize, 4096, 3 * MIB] {
                let b = a.alloc::<u8>(n).unwrap();
                drop(b);
                let c = a.alloc::<u8>(n).unwrap();
                drop(c);
            }
        }
    }
}

thread_local! {
    static EARLY: RefCell<Option<OnExit>> = const { RefCell::new(None) };
    static LATE: RefCell<Option<OnExit>> = const { RefCell::new(None) };
}

#[test]
fn tls_destructors_before_and_after_mine() {
    let _serial = serial();
    let (sim, a) = setup();
    for round in 0..if cfg!(miri) { 2 } else { 20 } {
        let a2 = a.clone();
        std::thread::spawn(move || {
            // Registered before the thread's first use of the allocator (so destroyed after MINE).
            EARLY.with(|e| *e.borrow_mut() = Some(OnExit(Some(a2.clone()), RefCell::new(Vec::new()))));
            let mut held = Vec::new();
            for i in 0..40 {
                let b = a2.alloc::<u8>(512 << (i % 6)).unwrap();
                if i % 3 == 0 {
                    held.push(b);
                } // else freed: cached
            }
            let big = a2.alloc::<u8>(3 * MIB).unwrap();
            drop(big); // the large bin
                       // Registered after (destroyed before MINE).
            LATE.with(|e| *e.borrow_mut() = Some(OnExit(Some(a2.clone()), RefCell::new(Vec::new()))));
            let half = held.split_off(held.len() / 2);
            EARLY.with(|e| e.borrow().as_ref().unwrap().1.borrow_mut().extend(held));
            LATE.with(|e| e.borrow().as_ref().unwrap().1.borrow_mut().extend(half));
            if round % 2 == 0 {
                // The allocator's last handles go in a destructor, too.
                drop(a2);
            }
        })
        .join()
        .unwrap();
        assert_eq!(live(&a), (0, 0), "round {round}: stats after the thread exited");
        check_invariants(&a, Some(&sim));
    }
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty(), "segments left: {:?}", sim.live_segments());
    // The main thread's cache still works.
    assert!(cache_works(&a));
}

// ------------------------------------------------------------------------------------------
// HOT thrash: many allocators used alternately on one thread; allocators dropped and new ones
// made in between (the new ones must never be handed the dropped one's cache).
// ------------------------------------------------------------------------------------------

#[test]
fn hot_thrash_many_allocators_with_churn() {
    let _serial = serial();
    let mut allocs: Vec<(Arc<SimDevice>, Allocator<Sim>)> = (0..12).map(|_| setup()).collect();
    let mut held: Vec<Vec<Buffer<u8, Sim>>> = (0..12).map(|_| Vec::new()).collect();
    let mut seed = 0x1234_5678_u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for step in 0..if cfg!(miri) { 3000 } else { 20_000 } {
        let k = (rnd() % allocs.len() as u64) as usize;
        let (_, a) = &allocs[k];
        let size = [512usize, 1024, 512, 4096, 3 * MIB][(rnd() % 5) as usize];
        let b = a.alloc::<u8>(size).unwrap();
        // Every buffer lies in one of its own allocator's segments.
        if step % 997 == 0 {
            let snap = a.snapshot();
            let p = b.device_ptr_raw();
            assert!(
                snap.segments.iter().any(|s| (s.address..s.address + s.total_size as u64).contains(&p)),
                "buffer {p:#x} of allocator {k} is not in its segments"
            );
        }
        if rnd() % 4 == 0 {
            held[k].push(b);
        }
        if held[k].len() > 6 {
            held[k].remove((rnd() % 6) as usize);
        }
        if step % 1500 == 1499 {
            // Drop one allocator (its buffers first) and make a fresh one in its place.
            let j = (rnd() % allocs.len() as u64) as usize;
            held[j].clear();
            let (sim, old) = std::mem::replace(&mut allocs[j], setup());
            assert_eq!(live(&old), (0, 0));
            check_invariants(&old, Some(&sim));
            drop(old);
            assert!(sim.live_segments().is_empty(), "the dropped allocator left segments");
        }
    }
    for (k, (sim, a)) in allocs.iter().enumerate() {
        let want = (held[k].len() as i64, held[k].iter().map(|b| b.num_bytes() as i64).sum::<i64>());
        let got = live(a);
        assert_eq!(got.0, want.0, "allocator {k}: allocation count");
        check_invariants(a, Some(sim));
    }
    held.clear();
    for (_, a) in &allocs {
        assert!(cache_works(a));
    }
}

// ------------------------------------------------------------------------------------------
// An allocator dropped while another thread's HOT names it (with blocks in that cache), then a
// new allocator used by that thread.
// ------------------------------------------------------------------------------------------

#[test]
fn allocator_dropped_while_worker_hot_names_it() {
    let (tx, rx) = mpsc::channel::<Option<Allocator<Sim>>>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        while let Ok(Some(a)) = rx.recv() {
            // Cache blocks (small bins and the large bin), keep HOT on this allocator.
            for n in [512usize, 1024, 4096, 3 * MIB] {
                for _ in 0..3 {
                    drop(a.alloc::<u8>(n).unwrap());
                }
            }
            drop(a);
            done_tx.send(()).unwrap();
        }
    });
    let mut ids = std::collections::HashSet::new();
    for _ in 0..if cfg!(miri) { 3 } else { 200 } {
        let (sim, a) = setup();
        assert!(ids.insert(a.id()), "allocator id reused");
        tx.send(Some(a.clone())).unwrap();
        done_rx.recv().unwrap();
        // The worker's HOT names `a`; its cache holds blocks. The last handle goes here.
        assert_eq!(live(&a), (0, 0));
        drop(a);
        assert!(sim.live_segments().is_empty(), "blocks of the worker's cache kept segments alive");
    }
    tx.send(None).unwrap();
    worker.join().unwrap();
}

// ------------------------------------------------------------------------------------------
// Reentrancy: user code run by the allocator (pool allocator callbacks, trace hooks), panics
// in it; afterwards this thread's cache must still be used.
// ------------------------------------------------------------------------------------------

struct Reenter {
    a: Mutex<Option<Allocator<Sim>>>,
    other: Mutex<Option<Allocator<Sim>>>,
    next: AtomicU64,
    panic_alloc: AtomicBool,
    panic_free: AtomicBool,
    calls: AtomicUsize,
}

// SAFETY: addresses far above the simulated device's, distinct per call; never touched.
unsafe impl mempool::RawAllocator for Reenter {
    fn name(&self) -> &str {
        "reenter"
    }
    fn alloc(&self, size: usize, _: usize, _: mempool::StreamId) -> Result<u64, mempool::BackendError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        for a in [self.a.lock().unwrap().clone(), self.other.lock().unwrap().clone()].into_iter().flatten() {
            // Hits and frees into this thread's caches of both allocators, from inside a call.
            for _ in 0..4 {
                drop(a.alloc::<u8>(512));
            }
            let _ = a.memory_stats();
        }
        if self.panic_alloc.load(Ordering::Relaxed) {
            panic!("hostile pool allocator");
        }
        Ok(0x7000_0000_0000 + self.next.fetch_add(size as u64, Ordering::Relaxed))
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: mempool::StreamId) -> Result<(), mempool::BackendError> {
        for a in [self.a.lock().unwrap().clone(), self.other.lock().unwrap().clone()].into_iter().flatten() {
            drop(a.alloc::<u8>(512));
        }
        if self.panic_free.load(Ordering::Relaxed) {
            panic!("hostile pool free");
        }
        Ok(())
    }
}

#[test]
fn reentrant_pool_callbacks_leave_the_cache_usable() {
    let _serial = serial();
    let (sim, a) = setup();
    let (sim_b, b) = setup();
    let r = Arc::new(Reenter {
        a: Mutex::new(Some(a.clone())),
        other: Mutex::new(Some(b.clone())),
        next: AtomicU64::new(0),
        panic_alloc: AtomicBool::new(false),
        panic_free: AtomicBool::new(false),
        calls: AtomicUsize::new(0),
    });
    assert!(cache_works(&a));
    for mode in 0..3 {
        r.panic_alloc.store(mode == 1, Ordering::Relaxed);
        r.panic_free.store(mode == 2, Ordering::Relaxed);
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(r.clone())).unwrap();
        for n in [512usize, 4096, 3 * MIB, 40 * MIB] {
            let x = pool.alloc::<u8>(n);
            drop(x);
            let x = pool.alloc::<u8>(n);
            drop(x);
        }
        let _ = pool.empty_cache();
        drop(pool);
        let _ = a.empty_cache();
        let _ = a.take_error();
        assert!(cache_works(&a), "mode {mode}: this thread's cache of `a` is no longer used");
        assert!(cache_works(&b), "mode {mode}: this thread's cache of `b` is no longer used");
    }
    assert!(r.calls.load(Ordering::Relaxed) > 0);
    *r.a.lock().unwrap() = None;
    *r.other.lock().unwrap() = None;
    assert_eq!(live(&a), (0, 0));
    assert_eq!(live(&b), (0, 0));
    check_invariants(&a, Some(&sim));
    check_invariants(&b, Some(&sim_b));
}

#[test]
fn trace_hook_that_allocates_and_panics() {
    let _serial = serial();
    let (_sim, a) = setup();
    let (_sim2, b) = setup();
    let b2 = b.clone();
    let errs = Arc::new(AtomicUsize::new(0));
    let e2 = errs.clone();
    let aid = a.id();
    let h = mempool::trace::attach(move |e| {
        if e.allocator != aid {
            return;
        }
        // From inside a hook: the other allocator's cache and this one's.
        match b2.alloc::<u8>(512) {
            Ok(x) => drop(x),
            Err(_) => {
                e2.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
    .unwrap();
    for _ in 0..10 {
        drop(a.alloc::<u8>(512).unwrap());
    }
    drop(h);
    assert!(errs.load(Ordering::Relaxed) > 0, "allocations inside a hook were not refused");
    assert!(cache_works(&a));
    assert!(cache_works(&b));
    let h = mempool::trace::attach(move |e| {
        if e.allocator == aid {
            panic!("hostile hook")
        }
    })
    .unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(a.alloc::<u8>(512))));
    drop(h);
    eprintln!("panicking hook: {:?}", r.is_ok());
    assert!(cache_works(&a));
    assert!(cache_works(&b));
    assert_eq!(live(&a), (0, 0));
}

// ------------------------------------------------------------------------------------------
// Readers on other threads while owners hit; stats exact at quiescent points.
// ------------------------------------------------------------------------------------------

#[test]
fn stats_exact_at_quiescent_points_under_concurrent_readers() {
    let (sim, a) = setup();
    const T: usize = 4;
    let stop = Arc::new(AtomicBool::new(false));
    let bar = Arc::new(Barrier::new(T + 1));
    let counts = Arc::new(Mutex::new([(0i64, 0i64); T]));
    let mut hs = Vec::new();
    for t in 0..T {
        let (a, bar, counts) = (a.clone(), bar.clone(), counts.clone());
        hs.push(std::thread::spawn(move || {
            let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
            for round in 0..30 {
                for i in 0..2000 {
                    let n = 512 * (1 + (i + t) % 3);
                    let x = a.alloc::<u8>(n).unwrap();
                    if i % 97 == 0 {
                        held.push(x);
                    }
                    if held.len() > 5 {
                        held.remove(0);
                    }
                }
                if round % 5 == 4 {
                    drop(a.alloc::<u8>(3 * MIB).unwrap());
                }
                // Quiescent point: report what we hold.
                let mine: (i64, i64) = (held.len() as i64, held.iter().map(|b| b.num_bytes() as i64).sum());
                counts.lock().unwrap()[t] = mine;
                bar.wait();
                bar.wait();
            }
            drop(held);
        }));
    }
    let reader = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                match n % 4 {
                    0 => drop(a.memory_stats()),
                    1 => a.empty_cache().unwrap(),
                    2 => drop(a.snapshot()),
                    _ => a.reset_peak_stats(),
                }
                n += 1;
            }
        })
    };
    for _ in 0..30 {
        bar.wait();
        // Every worker is parked; the reader may be mid-call. Stats are compared with the
        // block table (the snapshot drains every cache).
        let want = counts.lock().unwrap().iter().fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1));
        let s = a.memory_stats();
        assert_eq!((s.allocation.all.current, s.requested_bytes.all.current), want, "stats vs live buffers");
        bar.wait();
    }
    for h in hs {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    assert_eq!(live(&a), (0, 0));
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
}

/// Threads exit with cached blocks (small, large, deferred), many times: nothing leaks.
#[test]
fn thread_exit_with_cached_blocks() {
    let (sim, a) = setup();
    for _ in 0..if cfg!(miri) { 2 } else { 50 } {
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for i in 0..20 {
                        drop(a.alloc::<u8>(512 * (1 + (i + t) % 4)).unwrap());
                    }
                    drop(a.alloc::<u8>(3 * MIB).unwrap());
                    drop(a.alloc::<u8>(512).unwrap()); // the last free: deferred
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(live(&a), (0, 0));
    }
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
}

/// Miri-sized: the HOT pointer is re-derived and used across list growth, retain and lookups.
#[test]
fn miri_hot_aliasing() {
    let allocs: Vec<_> = (0..3).map(|_| setup()).collect();
    for _ in 0..3 {
        for (_, a) in &allocs {
            let x = a.alloc::<u8>(512).unwrap();
            drop(x);
            let y = a.alloc::<u8>(512).unwrap();
            let _ = a.memory_stats();
            drop(y);
        }
    }
    // A dropped allocator's cache goes from the list when the next one is made.
    let (_s, d) = setup();
    drop(d.alloc::<u8>(512).unwrap());
    drop(d);
    let (_s2, e) = setup();
    drop(e.alloc::<u8>(512).unwrap());
    for (_, a) in &allocs {
        drop(a.alloc::<u8>(512).unwrap());
    }
    let a = allocs[0].1.clone();
    std::thread::spawn(move || {
        thread_local!(static B: RefCell<Vec<Buffer<u8, Sim>>> = const { RefCell::new(Vec::new()) });
        let x = a.alloc::<u8>(512).unwrap();
        drop(a.alloc::<u8>(512).unwrap());
        B.with(|b| b.borrow_mut().push(x));
    })
    .join()
    .unwrap();
}

/// Perf probe (release, `--ignored --nocapture`): one allocator vs two used in turn on one thread
/// (e.g. a pinned staging buffer and a device buffer per step). Each switch misses HOT.
#[test]
#[ignore = "perf probe"]
fn perf_hot_thrash_two_allocators() {
    let (_s1, a) = setup();
    let (_s2, b) = setup();
    let (_s3, c) = setup();
    let n = 2_000_000;
    for round in 0..3 {
        let t = std::time::Instant::now();
        for _ in 0..n {
            drop(std::hint::black_box(a.alloc::<u8>(512).unwrap()));
        }
        let one = t.elapsed().as_nanos() as f64 / n as f64;
        let t = std::time::Instant::now();
        for i in 0..n {
            let x = if i % 2 == 0 { &a } else { &b };
            drop(std::hint::black_box(x.alloc::<u8>(512).unwrap()));
        }
        let two = t.elapsed().as_nanos() as f64 / n as f64;
        let t = std::time::Instant::now();
        for i in 0..n {
            let x = [&a, &b, &c][i % 3];
            drop(std::hint::black_box(x.alloc::<u8>(512).unwrap()));
        }
        let three = t.elapsed().as_nanos() as f64 / n as f64;
        eprintln!(
            "round {round}: pair on one allocator {one:.1} ns, two in turn {two:.1} ns, three in turn {three:.1} ns"
        );
    }
}
