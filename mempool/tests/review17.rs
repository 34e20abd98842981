//! Hostile review (helper-45) of c77442c + 7a65c1f: the out-of-memory path of
//! `DeviceAllocator::grow` (growth records, `growth_may_serve`, `wait_for_growth`, the
//! memory-fraction limit's `growing()`). Tests named for a property that failed are findings
//! (each failed 3 of 3 runs at 7a65c1f, and passes since the fix: a refusal by the memory
//! limit waits for the growths it counted, an expandable map's spare counts the free tail it
//! extends, a request waits only for the growths under way when it was refused, and being
//! inside one allocator's segment call stops waits on that allocator only); the delegating
//! helper on the same pool is the documented limit, bounded by `GROWTH_WAIT`. `held_*` tests
//! are attacks that did not get through. The two `a_limit_refusal_*` tests and
//! `expandable_growth_of_a_free_tail_is_waited_for` passed at c77442c (regressions of
//! 7a65c1f's narrowed wait); the churn and cross-allocator findings failed at both.
//!
//! Run: `cargo test -p cuda-mempool --test review17 -- --test-threads=1`.

mod common;

use common::watch::within;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use mempool::sim::SimDevice;
use mempool::{Allocator, BackendError, Config, Error, MemPool, PoolOptions, RawAllocator, StreamId};

const MIB: usize = 1 << 20;

use common::sources::*;

// ------------------------------------------------------------------------------------------
// Findings
// ------------------------------------------------------------------------------------------

/// Two threads keep asking a pool for 1 MiB blocks they cannot have (a retry loop; the source
/// refuses after 2 ms, as a cudaMalloc of a full device takes about that): each refused
/// segment call is a growth of the same free set whose spare (1 MiB of a 2 MiB segment) "may
/// serve" the other's 1 MiB request, so a refused request waits for the other's next call,
/// and the next, until `GROWTH_WAIT` runs out. (PyTorch: their calls are serialized; a report
/// takes a few calls, ~10 ms.)
#[test]
fn oom_is_prompt_while_another_thread_keeps_being_refused_on_the_same_key() {
    within(60, "same-key refusal churn", || {
        let sim = SimDevice::new(64 * MIB);
        let a = no_thread_cache(&sim);
        let src = Script::new(0, Duration::from_millis(2));
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let p = pool.clone();
                std::thread::spawn(move || {
                    let (mut worst, mut total, mut n, mut slow) = (Duration::ZERO, Duration::ZERO, 0u32, 0u32);
                    let t0 = Instant::now();
                    while t0.elapsed() < Duration::from_millis(2500) {
                        let t = Instant::now();
                        assert!(matches!(p.alloc::<u8>(MIB), Err(Error::OutOfMemory(_))));
                        worst = worst.max(t.elapsed());
                        total += t.elapsed();
                        n += 1;
                        slow += u32::from(t.elapsed() > Duration::from_millis(250));
                    }
                    (worst, total / n, n, slow)
                })
            })
            .collect();
        let r: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        eprintln!("same-key oom latency per thread (worst, mean, requests, over 250 ms): {r:?}");
        let worst = r.iter().map(|x| x.0).max().unwrap();
        assert!(worst < Duration::from_millis(250), "a refused request took {worst:?}: {r:?}");
    });
}

/// The same on the simulated device's default pool, full of live blocks, with 3 threads on
/// one stream asking for 1 MiB in a loop (refusals are fast here: the window is the segment
/// call of a simulated device).
#[test]
fn held_oom_is_prompt_while_threads_are_refused_on_the_default_pool() {
    within(60, "default-pool refusal churn", || {
        let sim = SimDevice::new(64 * MIB);
        let a = no_thread_cache(&sim);
        let fill: Vec<_> = (0..64).map(|_| a.alloc::<u8>(MIB).unwrap()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let others: Vec<_> = (0..3)
            .map(|_| {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut worst = Duration::ZERO;
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        assert!(a.alloc::<u8>(MIB).is_err());
                        worst = worst.max(t.elapsed());
                    }
                    worst
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
        let worst = others.into_iter().map(|t| t.join().unwrap()).max().unwrap();
        drop(fill);
        eprintln!("default-pool same-key oom latency: worst {worst:?}");
        assert!(worst < Duration::from_millis(250), "a refused request took {worst:?}");
    });
}

/// A memory-fraction limit with room for one 2 MiB segment. Another pool's segment call is
/// under way (its bytes count against the limit) and will be refused by its source. A 1 MiB
/// request of the default pools is refused by the limit on the strength of that growth, does
/// not wait for it (other key), and reports out of memory; the growth then fails, and nothing
/// is reserved. PyTorch (one lock) runs them in turn: whichever order, the default-pool
/// request is served. (c77442c waited for any growth and served it.)
#[test]
fn a_limit_refusal_waits_for_the_growth_it_counted_of_another_pool() {
    within(30, "limit cross-key", || {
        let (_sim, a) = limited(2 * MIB, false);
        let src = Script::new(1 << 30, Duration::ZERO);
        src.refuse.store(2, Ordering::SeqCst);
        src.gate.arm();
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let p2 = pool.clone();
        let grower = std::thread::spawn(move || p2.alloc::<u8>(MIB).map(drop));
        src.gate.wait_entered(1);
        let g2 = src.clone();
        let opener = opener_after(move || g2.gate.open(), 100);
        let r = a.alloc::<u8>(MIB).map(|b| b.len());
        opener.join().unwrap();
        let g = grower.join().unwrap();
        assert!(g.is_err(), "the source refused the pool's segment");
        assert_eq!(a.memory_stats().reserved_bytes.all.current, if r.is_ok() { 2 * MIB as i64 } else { 0 });
        assert_eq!(r.as_ref().ok(), Some(&MIB), "refused by the limit for a growth that then failed: {r:?}");
    });
}

/// Same key: a 12 MiB growth (no spare: a 12 MiB segment) under a 20 MiB limit, refused by its
/// source; an 8 MiB request of the same pool and stream needs a 20 MiB segment, is refused by
/// the limit (12 + 20 > 20), does not wait (the growth's spare is 0) and reports out of memory,
/// although once the growth failed its segment fits.
#[test]
fn a_limit_refusal_waits_for_the_growth_it_counted_without_spare() {
    within(30, "limit same key no spare", || {
        let (_sim, a) = limited(20 * MIB, false);
        let src = Script::new(1 << 30, Duration::ZERO);
        src.refuse.store(2, Ordering::SeqCst);
        src.gate.arm();
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let p2 = pool.clone();
        let grower = std::thread::spawn(move || p2.alloc::<u8>(12 * MIB).map(drop));
        src.gate.wait_entered(1);
        let g2 = src.clone();
        let opener = opener_after(move || g2.gate.open(), 100);
        let r = pool.alloc::<u8>(8 * MIB).map(|b| b.len());
        opener.join().unwrap();
        // (Which of the two requests the source's second refusal goes to is a race: the grower
        // may be served by its retry, after this request's call took that refusal.)
        let _ = grower.join().unwrap();
        assert_eq!(r.as_ref().ok(), Some(&(8 * MIB)), "refused by the limit for a growth that then failed: {r:?}");
    });
}

/// Expandable pool: a 2.5 MiB block leaves a 1.5 MiB free tail in its 4 MiB mapping. A
/// 1.75 MiB request grows that tail by one 2 MiB page (plan 2 MiB: `spare` recorded as
/// 2 - 1.75 = 0.25 MiB, while the grown block leaves 1.5 + 2 - 1.75 = 1.75 MiB). A second
/// 1.75 MiB request, refused a page of its own (the device is full), does not wait for it and
/// reports out of memory; the memory it needed is in the making. PyTorch: served.
#[test]
fn expandable_growth_of_a_free_tail_is_waited_for() {
    within(30, "expandable tail", || {
        let sim = SimDevice::new(6 * MIB);
        let a = no_thread_cache(&sim);
        let guard = Arc::new(HoldGuard::default());
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Shared(guard.clone()))).unwrap();
        let first = pool.alloc::<u8>(5 * MIB / 2).unwrap();
        assert_eq!(sim.used(), 4 * MIB);
        guard.gate.arm();
        let p2 = pool.clone();
        let grower = std::thread::spawn(move || p2.alloc::<u8>(7 * MIB / 4).map(|b| b.len()));
        guard.gate.wait_entered(1);
        assert_eq!(sim.used(), 6 * MIB);
        let g2 = guard.clone();
        let opener = opener_after(move || g2.gate.open(), 100);
        let r = pool.alloc::<u8>(7 * MIB / 4).map(|b| b.len());
        opener.join().unwrap();
        assert_eq!(grower.join().unwrap().unwrap(), 7 * MIB / 4);
        let s = pool.memory_stats();
        eprintln!("{s:?}");
        assert_eq!(r.as_ref().ok(), Some(&(7 * MIB / 4)), "the grown tail had room for it: {r:?}");
        drop(first);
    });
}

/// A pool's source that hands its work to a helper thread, which allocates a staging block
/// from the same pool (same stream and kind) and is refused a segment: the helper waits for
/// its caller's growth (whose spare "may serve" it), while the caller waits for the helper.
/// review16's version of this probe used the default pools (another key), which the fix
/// stopped waiting for. The same key is the documented limit (RELIABILITY.md, known gaps: the
/// allocator cannot tell such a helper from any other thread): the stall ends at
/// `GROWTH_WAIT`, and the request is served.
#[test]
fn a_segment_call_delegating_to_a_helper_on_the_same_pool_is_stalled_at_most_growth_wait() {
    struct Delegating {
        pool: OnceLock<MemPool<mempool::Sim>>,
        calls: AtomicUsize,
        next: AtomicU64,
        helper: Mutex<Option<Duration>>,
    }
    // SAFETY: distinct 2 MiB-aligned ranges of a counter, never dereferenced (simulated device).
    unsafe impl RawAllocator for Delegating {
        fn name(&self) -> &str {
            "delegating"
        }
        fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                let p = self.pool.get().unwrap().clone();
                let took = std::thread::spawn(move || {
                    let t = Instant::now();
                    let _ = p.alloc::<u8>(MIB);
                    t.elapsed()
                })
                .join()
                .unwrap();
                *self.helper.lock().unwrap() = Some(took);
                Ok(0x7000_0000_0000 + self.next.fetch_add(size.next_multiple_of(2 * MIB) as u64, Ordering::SeqCst))
            } else {
                Err(BackendError::OutOfMemory)
            }
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            Ok(())
        }
        fn granularity(&self) -> usize {
            2 * MIB
        }
    }
    within(30, "delegating, same pool", || {
        let sim = SimDevice::new(64 * MIB);
        let a = no_thread_cache(&sim);
        let src = Arc::new(Delegating {
            pool: OnceLock::new(),
            calls: AtomicUsize::new(0),
            next: AtomicU64::new(0),
            helper: Mutex::new(None),
        });
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let _ = src.pool.set(pool.clone());
        let t = Instant::now();
        let b = pool.alloc::<u8>(MIB).unwrap();
        let total = t.elapsed();
        let helper = *src.helper.lock().unwrap();
        drop(b);
        assert!(total < Duration::from_millis(1500), "the pool request took {total:?} (helper: {helper:?})");
    });
}

/// Two allocators (two devices, say). Allocator Y's pool has memory for two 2 MiB segments:
/// the first is full, another thread's call for the second is held open. A request to Y made
/// from inside a segment call of allocator X's pool (X's source stages through Y) is refused
/// its own segment and does not wait for Y's growth, whose free half would serve it:
/// `GROWING_HERE` counts segment calls of any allocator, so being inside X's call makes every
/// allocator's refusals final. (Y's growth cannot be waiting for X's caller. PyTorch: Y's
/// caller blocks on Y's lock until the segment is made, then is served.)
#[test]
fn a_request_to_another_allocator_from_inside_a_segment_call_waits_for_its_growth() {
    struct Staging {
        y: MemPool<mempool::Sim>,
        got: Mutex<Option<Result<usize, String>>>,
        next: AtomicU64,
    }
    // SAFETY: distinct 2 MiB-aligned ranges of a counter, never dereferenced (simulated device).
    unsafe impl RawAllocator for Staging {
        fn name(&self) -> &str {
            "staging"
        }
        fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            let r = self.y.alloc::<u8>(MIB).map(|b| b.len()).map_err(|e| e.to_string());
            *self.got.lock().unwrap() = Some(r);
            Ok(0x7000_0000_0000 + self.next.fetch_add(size.next_multiple_of(2 * MIB) as u64, Ordering::SeqCst))
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            Ok(())
        }
        fn granularity(&self) -> usize {
            2 * MIB
        }
    }
    within(30, "cross-allocator", || {
        let sim_y = SimDevice::with_index(1, 64 * MIB);
        let ay = no_thread_cache(&sim_y);
        let src = Script::new(4 * MIB, Duration::ZERO);
        src.hold_call.store(2, Ordering::SeqCst);
        src.gate.arm();
        let py = MemPool::on(&ay, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let full = [py.alloc::<u8>(MIB).unwrap(), py.alloc::<u8>(MIB).unwrap()];
        let p2 = py.clone();
        let grower = std::thread::spawn(move || p2.alloc::<u8>(MIB).map(|b| b.len()));
        src.gate.wait_entered(1);
        let g2 = src.clone();
        let opener = opener_after(move || g2.gate.open(), 100);
        let sim_x = SimDevice::new(64 * MIB);
        let ax = no_thread_cache(&sim_x);
        let staging = Arc::new(Staging { y: py.clone(), got: Mutex::new(None), next: AtomicU64::new(0) });
        let px = MemPool::on(&ax, PoolOptions::new().shared_allocator(staging.clone())).unwrap();
        let b = px.alloc::<u8>(MIB).unwrap();
        opener.join().unwrap();
        assert_eq!(grower.join().unwrap().ok(), Some(MIB));
        let got = staging.got.lock().unwrap().take();
        drop((b, full));
        assert_eq!(got, Some(Ok(MIB)), "the staging request to Y: {got:?}");
    });
}

// ------------------------------------------------------------------------------------------
// Held
// ------------------------------------------------------------------------------------------

/// The memory-fraction limit (20 MiB) is whole again after a failure path of a segment call
/// or a map: a 20 MiB block (one 20 MiB segment) is served at once. A growth record left
/// behind would count against the limit for ever.
fn limit_is_whole(a: &Allocator<mempool::Sim>, what: &str) {
    a.empty_cache().unwrap();
    let t = Instant::now();
    let r = a.alloc::<u8>(20 * MIB).map(|b| b.len());
    assert_eq!(r.as_ref().ok(), Some(&(20 * MIB)), "{what}: {r:?}");
    assert!(t.elapsed() < Duration::from_millis(250), "{what}: took {:?}", t.elapsed());
}

#[test]
fn held_growth_records_end_on_every_segment_call_failure() {
    within(60, "growth records, segment calls", || {
        type Arm = fn(&Script);
        let cases: [(&str, Arm); 5] = [
            ("panic", |s| s.panic_next.store(true, Ordering::SeqCst)),
            ("failed", |s| s.fail_next.store(true, Ordering::SeqCst)),
            ("zero", |s| s.zero_next.store(true, Ordering::SeqCst)),
            ("misaligned", |s| s.misalign_next.store(true, Ordering::SeqCst)),
            ("refused", |s| s.refuse.store(2, Ordering::SeqCst)),
        ];
        for (what, arm) in cases {
            let (sim, a) = limited(20 * MIB, false);
            let src = Script::new(1 << 30, Duration::ZERO);
            let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
            arm(&src);
            let r = pool.alloc::<u8>(MIB);
            // (A zero answer is out of memory: the ladder's second call serves it.)
            assert!(r.is_err() || what == "zero", "{what}: {r:?}");
            // The pool's own key: refused promptly next time too, and served after.
            arm(&src);
            let t = Instant::now();
            let _ = pool.alloc::<u8>(MIB);
            assert!(t.elapsed() < Duration::from_millis(250), "{what}");
            drop(r);
            pool.empty_cache().unwrap();
            limit_is_whole(&a, what);
            common::check_invariants(&a, Some(&sim));
        }
    });
}

/// The pool is released while its segment call is under way: the segment goes back, the
/// request is served by the default pools, and no growth record is left (limit whole).
#[test]
fn held_growth_record_ends_when_the_pool_is_released_mid_call() {
    within(30, "released mid call", || {
        let (_sim, a) = limited(20 * MIB, false);
        let src = Script::new(1 << 30, Duration::ZERO);
        src.gate.arm();
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
        let p2 = pool.clone();
        let t = std::thread::spawn(move || p2.alloc::<u8>(MIB).map(|b| b.len()));
        src.gate.wait_entered(1);
        drop(pool);
        src.gate.open();
        let r = t.join().unwrap();
        // The thread's clone was the last handle once the buffer is gone.
        assert_eq!(r.ok(), Some(MIB));
        limit_is_whole(&a, "released");
    });
}

/// Expandable default pools: a refused map, a map refused after its first chunk (partial), and
/// a map guard that panics leave no growth record (limit whole, next refusal prompt).
#[test]
fn held_growth_records_end_on_every_map_failure() {
    within(60, "growth records, maps", || {
        // Refused map.
        let (sim, a) = limited(64 * MIB, true);
        sim.fail_next_maps(2);
        let t = Instant::now();
        let r = a.alloc::<u8>(MIB);
        assert!(r.is_ok() || matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
        assert!(t.elapsed() < Duration::from_millis(250));
        drop(r);
        a.empty_cache().unwrap();
        let b = a.alloc::<u8>(64 * MIB).expect("refused map: the limit is whole");
        drop(b);
        common::check_invariants(&a, Some(&sim));

        // Partial map: 30 MiB in a 20 MiB and a 10 MiB chunk; the second refused.
        let sim = SimDevice::new(1 << 30);
        let a = Allocator::sim_with(
            sim.clone(),
            Config::builder().thread_cache(false).memory_fraction(64.0 / 1024.0).build().unwrap(),
        );
        let guard = Arc::new(HoldGuard::default());
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Shared(guard.clone()))).unwrap();
        let s2 = sim.clone();
        *guard.on_mapped.lock().unwrap() = Some(Box::new(move || s2.fail_next_maps(2)));
        let r = pool.alloc::<u8>(30 * MIB).map(|b| b.len());
        eprintln!("partial map: {r:?}, mapped calls {}", guard.mapped.load(Ordering::SeqCst));
        drop(r);
        pool.empty_cache().unwrap();
        let b = pool.alloc::<u8>(64 * MIB).expect("partial map: the limit is whole");
        drop(b);
        pool.empty_cache().unwrap();

        // Guard panics in `mapped`.
        guard.panic_next.store(true, Ordering::SeqCst);
        let r = pool.alloc::<u8>(MIB).map(|b| b.len());
        eprintln!("guard panic: {r:?}");
        drop(r);
        pool.empty_cache().unwrap();
        let b = pool.alloc::<u8>(64 * MIB).expect("guard panic: the limit is whole");
        drop(b);
        drop(pool);
        common::check_invariants(&a, Some(&sim));
    });
}

/// Many threads on one key with memory for exactly their blocks, expandable segments: no
/// request fails (oom_races' probe, with maps instead of segment calls).
#[test]
fn held_expandable_exact_fit_race_never_fails() {
    within(120, "expandable exact fit", || {
        for n in [2usize, 4, 8] {
            for size in [MIB, 2 * MIB] {
                let sim = SimDevice::new(n * 2 * size);
                let a = Allocator::sim_with(
                    sim.clone(),
                    Config::builder().thread_cache(false).expandable_segments(true).build().unwrap(),
                );
                let stream = sim.new_stream();
                let start = Arc::new(std::sync::Barrier::new(n));
                let failed = Arc::new(AtomicUsize::new(0));
                let threads: Vec<_> = (0..n)
                    .map(|_| {
                        let (a, start, failed) = (a.clone(), start.clone(), failed.clone());
                        std::thread::spawn(move || {
                            let _on = a.set_stream(&stream).unwrap();
                            start.wait();
                            let _kept = a.alloc::<u8>(size);
                            for _ in 0..3000 {
                                if a.alloc::<u8>(size).is_err() {
                                    failed.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().unwrap();
                }
                common::check_invariants(&a, Some(&sim));
                assert_eq!(failed.load(Ordering::Relaxed), 0, "{n} threads, {size} bytes");
            }
        }
    });
}

/// A request from inside a map guard's `mapped` (same expandable pool, device full) does not
/// wait for its own caller's map.
#[test]
fn held_a_request_from_inside_a_map_guard_does_not_wait_for_itself() {
    within(30, "nested from guard", || {
        let sim = SimDevice::new(2 * MIB);
        let a = no_thread_cache(&sim);
        let guard = Arc::new(HoldGuard::default());
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Shared(guard.clone()))).unwrap();
        let took = Arc::new(Mutex::new(None));
        let (p2, t2) = (pool.clone(), took.clone());
        *guard.on_mapped.lock().unwrap() = Some(Box::new(move || {
            let t = Instant::now();
            let r = p2.alloc::<u8>(MIB).map(|b| b.len());
            *t2.lock().unwrap() = Some((t.elapsed(), r.is_ok()));
        }));
        let t = Instant::now();
        let b = pool.alloc::<u8>(MIB).unwrap();
        let total = t.elapsed();
        let inner = *took.lock().unwrap();
        drop(b);
        eprintln!("nested: {inner:?}, total {total:?}");
        assert!(total < Duration::from_millis(250), "{total:?} {inner:?}");
    });
}

/// num_ooms and num_alloc_retries stay exact for a request that waited for a same-key growth
/// and was served by its spare (no retry, no oom), and for requests that waited for a growth
/// that then failed (each refused request one retry and one oom).
#[test]
fn held_stats_exact_around_growth_waits() {
    within(30, "stats", || {
        for grower_refused in [false, true] {
            let sim = SimDevice::new(64 * MIB);
            let a = no_thread_cache(&sim);
            let src = Script::new(if grower_refused { 2 * MIB } else { 4 * MIB }, Duration::ZERO);
            src.hold_call.store(2, Ordering::SeqCst);
            src.gate.arm();
            let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
            let full = [pool.alloc::<u8>(MIB).unwrap(), pool.alloc::<u8>(MIB).unwrap()];
            let p2 = pool.clone();
            let g = std::thread::spawn(move || p2.alloc::<u8>(MIB).map(|b| b.len()));
            src.gate.wait_entered(1);
            let g2 = src.clone();
            let opener = opener_after(move || g2.gate.open(), 100);
            let b = pool.alloc::<u8>(MIB).map(|b| b.len());
            opener.join().unwrap();
            let gr = g.join().unwrap();
            let s = a.memory_stats();
            let ps = pool.memory_stats();
            if grower_refused {
                assert!(b.is_err() && gr.is_err(), "{b:?} {gr:?}");
                assert_eq!((s.num_ooms, s.num_alloc_retries), (2, 2), "{s:?}");
                assert_eq!(ps.reserved_bytes.current, 2 * MIB as i64);
            } else {
                assert_eq!((b.ok(), gr.ok()), (Some(MIB), Some(MIB)));
                assert_eq!((s.num_ooms, s.num_alloc_retries), (0, 0), "{s:?}");
                assert_eq!(ps.reserved_bytes.current, 4 * MIB as i64);
                assert_eq!(ps.reserved_bytes.peak, 4 * MIB as i64);
                assert_eq!(ps.num_segment_alloc, 2);
            }
            drop(full);
            common::check_invariants(&a, Some(&sim));
        }
    });
}

/// A fork child whose parent has a same-key growth under way and a limit: the parent's growth
/// neither makes the child wait nor shrinks the child's limit.
#[test]
fn held_fork_child_limit_ignores_the_parents_growth() {
    let (_sim, a) = limited(20 * MIB, false);
    let src = Script::new(1 << 30, Duration::ZERO);
    src.gate.arm();
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(src.clone())).unwrap();
    let p2 = pool.clone();
    let grower = std::thread::spawn(move || p2.alloc::<u8>(12 * MIB).map(|b| b.len()));
    src.gate.wait_entered(1);
    std::thread::sleep(Duration::from_millis(20));
    // SAFETY: the grower let go of the allocator's locks before its segment call and waits on
    // the gate's condition variable (its mutex is free); the child runs under the alarm.
    let ended = unsafe {
        common::procs::fork_and_wait(10, || {
            let t = Instant::now();
            // Default pool, 20 MiB: fits the limit only if the parent's 12 MiB is not counted.
            match a.alloc::<u8>(20 * MIB) {
                Ok(_) if t.elapsed() < Duration::from_millis(250) => 0,
                Ok(_) => 2,
                Err(_) => 1,
            }
        })
    };
    src.gate.open();
    assert_eq!(grower.join().unwrap().ok(), Some(12 * MIB));
    assert!(matches!(ended, common::procs::Ended::Exited(0)), "child: {ended:?}");
}
